//! Stream readers: a SUBSCRIBE to `$stream/<name>` starts a task that reads the stream's log
//! from its start position in bounded batches and hands each message to the reader's session
//! as a delivery, then follows new appends (docs/streams.md). Entries no longer in memory
//! (with storage, a log keeps only its newest) are read back from storage in larger batches
//! bounded in bytes ([`STORED_BATCH`], [`STORED_BATCH_BYTES`]), held by the task until the
//! session has room for them, the next batch read while they are delivered; then the reader
//! goes on in memory. The task keeps at most
//! [`READER_BATCH`] deliveries in the session's queue (beyond the Receive Maximum window the
//! writer has in flight), so a reader that stops reading costs a position, not a queue; it
//! waits on the session's progress signal for room and on the stream's append signal at its
//! end. It ends with the connection it was started for (or UNSUBSCRIBE, or a new SUBSCRIBE to
//! the same filter).

use std::collections::VecDeque;
use std::sync::Arc;

use crate::codec::QoS;
use crate::link::Link;
use crate::message::Message;
use crate::persist::records::{message_from, unix_ms};
use crate::session::{Delivery, Granted, Session};
use crate::streams::{Entry, Found, Stream, OFFSET_PROPERTY, TIME_PROPERTY};

use super::BrokerState;

/// Deliveries a reader keeps queued at most, and the largest batch it reads from the log.
pub(crate) const READER_BATCH: usize = 64;

/// Entries a reader reads back from storage at most at a time: each read is a round trip to
/// the storage thread and decodes the segments it touches (SQLite: 128 entries each), and
/// reads of what the session's queue had room for (often a few) made a replay's storage
/// thread several times busier.
const STORED_BATCH: usize = 1024;

/// What such a batch holds at most, in message bytes (topic, payload, properties; the entry
/// reaching it included), so that a reader holds about twice that beside its session's queue
/// (a batch being delivered and the next one read).
const STORED_BATCH_BYTES: u64 = 1 << 20;

/// One reader's start: the stream, the part of it to read, where, with which options.
pub(crate) struct ReaderStart {
    pub stream: Arc<Stream>,
    /// The `$stream/...` filter as subscribed (the reader's key for UNSUBSCRIBE).
    pub filter: String,
    /// A topic filter the messages must also match.
    pub sub_filter: Option<String>,
    /// The first offset to read.
    pub from: u64,
    /// The append time its first message must have at least, unix milliseconds (0: any).
    pub from_time_ms: u64,
    pub granted: Granted,
}

impl BrokerState {
    /// Starts a reader for `session` while `link` serves it (replacing its reader on the same
    /// filter, if any).
    pub(crate) fn start_stream_reader(
        self: &Arc<Self>,
        session: &Arc<Session>,
        link: Arc<Link>,
        start: ReaderStart,
    ) {
        let broker = Arc::clone(self);
        let session = Arc::clone(session);
        let client = Arc::clone(&session.client_id);
        let filter = start.filter.clone();
        let stream = start.stream.name().to_string();
        let (id_tx, id_rx) = tokio::sync::oneshot::channel::<u64>();
        let task = tokio::spawn(async move {
            let id = id_rx.await.ok();
            let filter = start.filter.clone();
            broker.read_stream(&session, &link, start).await;
            if let Some(id) = id {
                broker.streams.finished(&session.client_id, &filter, id);
            }
        });
        let id = self
            .streams
            .started(&client, &filter, &stream, task.abort_handle());
        let _ = id_tx.send(id);
    }

    /// The reader's loop (see the module's comment).
    async fn read_stream(&self, session: &Session, link: &Arc<Link>, start: ReaderStart) {
        let ReaderStart {
            stream,
            sub_filter,
            mut from,
            from_time_ms,
            granted,
            ..
        } = start;
        let _counted = stream.reading();
        let deliver = |e: Entry| {
            if sub_filter
                .as_deref()
                .is_some_and(|f| !crate::topic::matches(f, &e.msg.topic))
            {
                return;
            }
            let mut msg = Message::clone(&e.msg);
            msg.retain = false;
            let props = &mut msg.properties.user_properties;
            props.push((OFFSET_PROPERTY.to_string(), e.offset.to_string()));
            props.push((TIME_PROPERTY.to_string(), e.time_ms.to_string()));
            let qos: QoS = msg.qos.min(granted.options.qos);
            let q = Delivery {
                msg: Arc::new(msg),
                qos,
                retain: false,
                subscription_ids: granted.identifier.into_iter().collect(),
                seq: 0,
                share: None,
            };
            self.deliver(session, q);
        };
        // Entries read back from storage, not yet delivered (by offset, from before `from`).
        let mut stored: VecDeque<Entry> = VecDeque::new();
        // The next batch, read from storage while `stored` is delivered (so that the
        // connection does not wait for storage), from `from` below `stored_upto`.
        let mut ahead: Option<tokio::task::JoinHandle<StoredRead>> = None;
        let mut stored_upto = 0;
        loop {
            let room_signal = session.room_signal().notified();
            tokio::pin!(room_signal);
            room_signal.as_mut().enable();
            let appended = stream.appended.notified();
            tokio::pin!(appended);
            appended.as_mut().enable();
            let Some(room) = session.reader_room(READER_BATCH, link) else {
                return;
            };
            if room == 0 {
                room_signal.await;
                continue;
            }
            if !stored.is_empty() {
                // Retention may have removed some since they were read.
                let first = stream.first();
                let n = room.min(stored.len());
                for e in stored.drain(..n).filter(|e| e.offset >= first) {
                    deliver(e);
                }
                if ahead.is_none() && stored.len() < STORED_BATCH / 2 && from < stored_upto {
                    let (s, upto) = (Arc::clone(&stream), stored_upto);
                    ahead = Some(tokio::spawn(async move {
                        read_stored(&s, from, upto, from_time_ms).await
                    }));
                }
                continue;
            }
            if let Some(read) = ahead.take() {
                // Failed: read again below.
                if let Ok(Some((entries, next))) = read.await {
                    from = next;
                    stored.extend(entries);
                    continue;
                }
            }
            match stream.read(from, from_time_ms, room) {
                Found::Memory(batch) if batch.is_empty() => {
                    tokio::select! {
                        _ = &mut room_signal => {}
                        _ = &mut appended => {}
                    }
                }
                Found::Memory(batch) => {
                    for e in batch {
                        from = e.offset + 1;
                        deliver(e);
                    }
                }
                Found::Stored { from: at, upto } => {
                    stored_upto = upto;
                    let Some((entries, next)) = read_stored(&stream, at, upto, from_time_ms).await
                    else {
                        tokio::time::sleep(STORAGE_RETRY).await;
                        continue;
                    };
                    from = next;
                    stored.extend(entries);
                }
            }
        }
    }
}

/// What [`read_stored`] returns: the entries read and the offset to read next, `None` when
/// storage could not be read.
type StoredRead = Option<(Vec<Entry>, u64)>;

/// How long a reader waits before it reads storage again after a failed read.
const STORAGE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Up to [`STORED_BATCH`] entries (and about [`STORED_BATCH_BYTES`]) of `stream` from `from`
/// below `upto` appended at `from_time_ms` or later, read back from storage (committed, since
/// they left memory), and the offset to read next; `None` when storage could not be read
/// (logged).
async fn read_stored(stream: &Stream, from: u64, upto: u64, from_time_ms: u64) -> StoredRead {
    let storage = stream.storage()?;
    let read = match storage
        .read_stream(
            stream.name(),
            from,
            from_time_ms,
            STORED_BATCH,
            STORED_BATCH_BYTES,
        )
        .await
    {
        Ok(read) => read,
        Err(e) => {
            tracing::warn!(stream = %stream.name(), "a stream reader cannot read storage, retried: {e}");
            return None;
        }
    };
    // Empty, or reaching the tail: every committed entry below `upto` was read, the next
    // ones are in memory. A backend may return fewer than asked: read on after the last.
    let next = match read.last() {
        Some(last) if last.entry.offset + 1 < upto => last.entry.offset + 1,
        _ => upto,
    };
    let (now, now_ms) = (std::time::Instant::now(), unix_ms());
    let mut out = Vec::with_capacity(read.len());
    for r in read.into_iter().take_while(|r| r.entry.offset < upto) {
        match message_from(&r.message, now, now_ms) {
            Ok((msg, _)) => out.push(Entry {
                offset: r.entry.offset,
                time_ms: r.entry.time_ms,
                msg: Arc::new(msg),
            }),
            Err(cause) => tracing::error!(
                stream = %stream.name(),
                offset = r.entry.offset,
                "stored stream entry cannot be read, skipped: {cause}"
            ),
        }
    }
    Some((out, next))
}
