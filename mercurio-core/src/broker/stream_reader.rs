//! Stream readers: a SUBSCRIBE to `$stream/<name>` starts a task that reads the stream's log
//! from its start position in bounded batches and hands each message to the reader's session
//! as a delivery, then follows new appends (docs/streams.md). The task keeps at most
//! [`READER_BATCH`] deliveries in the session's queue (beyond the Receive Maximum window the
//! writer has in flight), so a reader that stops reading costs a position, not a queue; it
//! waits on the session's progress signal for room and on the stream's append signal at its
//! end. It ends with the connection it was started for (or UNSUBSCRIBE, or a new SUBSCRIBE to
//! the same filter).

use std::sync::Arc;

use crate::codec::QoS;
use crate::link::Link;
use crate::message::Message;
use crate::session::{Delivery, Granted, Session};
use crate::streams::{Stream, OFFSET_PROPERTY, TIME_PROPERTY};

use super::BrokerState;

/// Deliveries a reader keeps queued at most, and the largest batch it reads from the log.
pub(crate) const READER_BATCH: usize = 64;

/// One reader's start: the stream, the part of it to read, where, with which options.
pub(crate) struct ReaderStart {
    pub stream: Arc<Stream>,
    /// The `$stream/...` filter as subscribed (the reader's key for UNSUBSCRIBE).
    pub filter: String,
    /// A topic filter the messages must also match.
    pub sub_filter: Option<String>,
    /// The first offset to read.
    pub from: u64,
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
            granted,
            ..
        } = start;
        let _counted = stream.reading();
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
            let batch = stream.read(from, room);
            if batch.is_empty() {
                tokio::select! {
                    _ = &mut room_signal => {}
                    _ = &mut appended => {}
                }
                continue;
            }
            for e in batch {
                from = e.offset + 1;
                if sub_filter
                    .as_deref()
                    .is_some_and(|f| !crate::topic::matches(f, &e.msg.topic))
                {
                    continue;
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
            }
        }
    }
}
