//! The writer task: applies the changes the broker emits as batches, retries what fails, and
//! runs what waits for a commit (acknowledgements with `durable_ack`, flushes, deletions).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mercurio_storage::{
    Change, DeliveryRecord, StorageError, StreamAppend, StreamEntryRecord, REFUSED_ATTEMPTS,
};
use tokio::sync::{mpsc, oneshot};

use super::records::message_record;
use super::{
    append_cost, AppendBuffer, Charge, Payer, Persister, CHANGE_OVERHEAD, UNWRITABLE_AFTER,
};
use crate::session::SessionTable;
use crate::stats::Counters;

/// Most changes applied in one transaction. Large, so that a fan-out to many offline
/// sessions is written as one chunk of deliveries per session, not one row per delivery
/// (the bytes waiting are bounded by `max_pending_bytes_total` anyway).
const MAX_BATCH: usize = 262_144;
/// A batch smaller than this, with nothing waiting for its commit, that follows such a
/// batch at once (its first change came within [`LINGER`] of the previous batch's end)
/// waits [`LINGER`] for more changes before it is written: a session draining its queue
/// emits three small changes per message (dequeued, in flight, acknowledged), and written
/// as they came they kept the storage thread busy with a transaction every few messages,
/// taking the CPU the drain needs. The first batch after a pause is written at once, and a
/// fan-out's batches are far larger and never wait.
const LINGER_BELOW: usize = 4096;
/// How long a small batch waits for more changes (see [`LINGER_BELOW`]).
const LINGER: Duration = Duration::from_millis(1);
/// Longest pause between two attempts of a failing batch.
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// What runs once a commit is done: `true` when everything it waited for is committed,
/// `false` when storage does not hold all of it (changes given up, fenced, or a dirty
/// client's changes skipped until its session is written whole).
pub(super) type Callback = Box<dyn FnOnce(bool) + Send>;

/// What the broker sends the writer.
pub(super) enum Op {
    /// A change and who owes its bytes until it is stored. Boxed: a `Change` is hundreds of
    /// bytes (a whole session), while most of what waits here is queued deliveries.
    Change(Box<Change>, Charge),
    /// A delivery queued for a stored session ([`Change::MessageQueued`]), owed by the
    /// message's publisher: what a fan-out to many sessions sends, one per session, so
    /// kept small (the session's client identifier shared, not copied).
    Queued(QueuedOp),
    /// A stream's buffer of appends went from empty to not: the writer takes all it holds
    /// then into one [`Change::StreamSegment`] (its debts paid with the batch's).
    Appends(Arc<AppendBuffer>),
    /// A stored message the broker dropped ([`Change::MessageReleased`]), owed by the broker
    /// ([`CHANGE_OVERHEAD`]).
    Released(u64),
    /// Run after everything before it is committed (and synced, with durable_ack), told
    /// whether all of it was.
    AfterCommit(Callback),
    /// As [`Op::AfterCommit`], but nothing waits for it (a stream letting go of entries it
    /// keeps in memory once storage holds them): it neither cuts a lingering batch short
    /// nor asks for a sync.
    Settled(Callback),
    /// Commit everything before it, flush, answer.
    Flush(oneshot::Sender<()>),
    /// Delete a session from storage, in order with the changes before it.
    Delete(String, oneshot::Sender<Result<bool, StorageError>>),
    /// Commit everything before it, close storage, stop.
    Close(oneshot::Sender<()>),
}

impl Op {
    /// Whether something waits for this op's commit (an acknowledgement with `durable_ack`,
    /// a flush, a deletion, the close).
    fn waits(&self) -> bool {
        !matches!(
            self,
            Op::Change(..) | Op::Queued(_) | Op::Appends(_) | Op::Released(_) | Op::Settled(_)
        )
    }
}

/// The writer task.
pub(super) struct BatchWriter {
    pub(super) persister: Arc<Persister>,
    /// The broker's counters (`storage/...`).
    pub(super) stats: Arc<Counters>,
    /// The broker's sessions, to write a dirty client's live session whole.
    pub(super) sessions: Weak<SessionTable>,
    /// Clients whose changes were given up: their changes are skipped until their session
    /// is written whole.
    pub(super) dirty: HashSet<String>,
    pub(super) rx: mpsc::UnboundedReceiver<Op>,
    /// A write was refused because another broker took over: nothing more is written.
    pub(super) fenced: bool,
    /// Changes since the last acknowledgements ran were given up or skipped: those
    /// acknowledgements are not sent (their connections are closed instead).
    pub(super) lost: bool,
    /// When the first of the writes failing in a row failed (transient errors), while they
    /// fail; reported as unwritable storage after [`UNWRITABLE_AFTER`].
    pub(super) failing_since: Option<Instant>,
}

/// A delivery queued for a stored session, as it waits for the writer: about 70 bytes
/// (a `Change` is hundreds), what a fan-out costs per session.
pub(super) struct QueuedOp {
    /// The session's client identifier, shared with it.
    pub(super) client_id: Arc<str>,
    pub(super) seq: u64,
    pub(super) message_id: u64,
    pub(super) qos: u8,
    pub(super) retain: bool,
    /// Its subscription identifiers and shared subscription, when it has any.
    pub(super) extra: Option<Box<(Vec<u32>, Option<String>)>>,
    /// Who owes it until it is stored: the message's publisher (`None`: the broker).
    pub(super) payer: Option<Arc<str>>,
    pub(super) bytes: usize,
}

impl QueuedOp {
    /// The change it stands for.
    fn into_change(self) -> (Change, Charge) {
        let (subscription_ids, share) = self.extra.map(|e| *e).unwrap_or_default();
        let change = Change::MessageQueued {
            client_id: self.client_id.to_string(),
            seq: self.seq,
            delivery: DeliveryRecord {
                message_id: self.message_id,
                qos: self.qos,
                retain: self.retain,
                subscription_ids,
                share,
            },
        };
        let charge = Charge {
            payer: match self.payer {
                Some(p) => Payer::Client(p),
                None => Payer::Broker,
            },
            bytes: self.bytes,
        };
        (change, charge)
    }
}

impl Op {
    /// Who owes this op's bytes and how many, for a change.
    pub(super) fn debt(&self) -> Option<(Option<&str>, usize)> {
        match self {
            Op::Change(change, charge) => Some((charge.client(change), charge.bytes)),
            Op::Queued(q) => Some((q.payer.as_deref(), q.bytes)),
            Op::Released(_) => Some((None, CHANGE_OVERHEAD)),
            _ => None,
        }
    }
}

/// What to do after the changes of a batch are committed.
enum After {
    Run(Callback),
    Settled(Callback),
    Flush(oneshot::Sender<()>),
    Delete(String, oneshot::Sender<Result<bool, StorageError>>),
    Close(oneshot::Sender<()>),
}

impl BatchWriter {
    pub(super) async fn run(mut self) {
        let mut ops = Vec::new();
        // When the previous batch was written, if it was small.
        let mut small_written: Option<Instant> = None;
        loop {
            let first = if self.dirty.is_empty() {
                self.rx.recv().await
            } else {
                match tokio::time::timeout(MAX_BACKOFF, self.rx.recv()).await {
                    Ok(op) => op,
                    Err(_) => {
                        self.rewrite_dirty().await;
                        continue;
                    }
                }
            };
            let Some(first) = first else { return };
            let streaming = small_written.is_some_and(|at| at.elapsed() < LINGER);
            ops.push(first);
            self.gather(&mut ops);
            if streaming && ops.len() < LINGER_BELOW && !ops.iter().any(Op::waits) {
                tokio::time::sleep(LINGER).await;
                self.gather(&mut ops);
            }
            // A batch something waited for (a flush, an acknowledgement) is not a stream's.
            let small = ops.len() < LINGER_BELOW && !ops.iter().any(Op::waits);
            if !self.dirty.is_empty() {
                self.rewrite_dirty().await;
            }
            if self.process(&mut ops).await {
                return;
            }
            small_written = small.then(Instant::now);
        }
    }

    /// Adds to `ops` what has been sent since, up to [`MAX_BATCH`].
    fn gather(&mut self, ops: &mut Vec<Op>) {
        while ops.len() < MAX_BATCH {
            match self.rx.try_recv() {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
    }

    /// Applies `ops` in order. Returns true once closed.
    async fn process(&mut self, ops: &mut Vec<Op>) -> bool {
        let mut changes = Batch::default();
        let mut after: Vec<After> = Vec::new();
        let mut closed = false;
        for op in ops.drain(..) {
            match op {
                Op::Change(change, charge) => {
                    let skip = change.client_id().is_some_and(|c| self.dirty.contains(c));
                    if skip {
                        self.lost = true;
                        self.persister.done(charge.client(&change), charge.bytes);
                    } else {
                        changes.changes.push(*change);
                        changes.charges.push(charge);
                    }
                }
                Op::Queued(q) => {
                    if self.dirty.contains(&*q.client_id) {
                        self.lost = true;
                        self.persister.done(q.payer.as_deref(), q.bytes);
                    } else {
                        let (change, charge) = q.into_change();
                        changes.changes.push(change);
                        changes.charges.push(charge);
                    }
                }
                Op::Appends(buffer) => self.segment(&buffer, &mut changes),
                Op::Released(id) => {
                    changes.changes.push(Change::MessageReleased { id });
                    changes.charges.push(Charge {
                        payer: Payer::Broker,
                        bytes: CHANGE_OVERHEAD,
                    });
                }
                Op::AfterCommit(f) => after.push(After::Run(f)),
                Op::Settled(f) => after.push(After::Settled(f)),
                Op::Flush(tx) => {
                    after.push(After::Flush(tx));
                    closed |= self.finish(&mut changes, &mut after).await;
                }
                Op::Delete(c, tx) => {
                    after.push(After::Delete(c, tx));
                    closed |= self.finish(&mut changes, &mut after).await;
                }
                Op::Close(tx) => {
                    after.push(After::Close(tx));
                    closed |= self.finish(&mut changes, &mut after).await;
                }
            }
        }
        closed |= self.finish(&mut changes, &mut after).await;
        closed
    }

    /// Takes every append waiting in `buffer` into one [`Change::StreamSegment`] of
    /// `changes`, each message stored under a new id of its own (taken as one range), and
    /// owes each append's debt to the batch.
    fn segment(&self, buffer: &AppendBuffer, changes: &mut Batch) {
        let taken = buffer.take();
        let Some(n) = u64::try_from(taken.len()).ok().filter(|n| *n > 0) else {
            return;
        };
        let first_id = self
            .persister
            .next_message_id
            .fetch_add(n, Ordering::Relaxed);
        let mut entries = Vec::with_capacity(taken.len());
        for (id, a) in (first_id..).zip(&taken) {
            let msg = &a.msg;
            entries.push(StreamAppend {
                entry: StreamEntryRecord {
                    offset: a.offset,
                    time_ms: a.time_ms,
                    message_id: id,
                },
                message: message_record(msg, msg.qos, msg.retain, &[]),
            });
            let cost = append_cost(msg);
            match changes.appends_owed.last_mut() {
                // Summed per run of one publisher (see `finish`).
                Some((p, bytes)) if p.as_deref() == msg.publisher.as_deref() => *bytes += cost,
                _ => changes.appends_owed.push((msg.publisher.clone(), cost)),
            }
        }
        changes.changes.push(Change::StreamSegment {
            stream: buffer.stream().to_string(),
            entries,
        });
        changes.charges.push(Charge {
            payer: Payer::Broker,
            bytes: 0,
        });
    }

    /// Commits `changes`, then runs `after`. Returns true once closed.
    async fn finish(&mut self, changes: &mut Batch, after: &mut Vec<After>) -> bool {
        if changes.changes.is_empty() && after.is_empty() {
            return false;
        }
        let durable =
            self.persister.durable_ack && after.iter().any(|a| matches!(a, After::Run(_)));
        let Batch {
            changes: batch,
            charges,
            appends_owed,
        } = std::mem::take(changes);
        // Shared with the backend, which may write it on a thread of its own: not copied.
        let batch = Arc::new(batch);
        if !batch.is_empty() || durable {
            self.commit(&batch, durable).await;
        }
        // What each client owed for this batch is paid, stored or given up.
        let mut owed: HashMap<Option<&str>, usize> = HashMap::new();
        // Summed per run of one payer first: a publisher's changes come in runs, and a
        // comparison costs less than hashing its client identifier per change.
        let mut run: Option<(Option<&str>, usize)> = None;
        for (change, charge) in batch.iter().zip(&charges) {
            let client = charge.client(change);
            match &mut run {
                Some((c, n)) if *c == client => *n += charge.bytes,
                _ => {
                    if let Some((c, n)) = run.replace((client, charge.bytes)) {
                        *owed.entry(c).or_default() += n;
                    }
                }
            }
        }
        if let Some((c, n)) = run {
            *owed.entry(c).or_default() += n;
        }
        for (c, n) in &appends_owed {
            *owed.entry(c.as_deref()).or_default() += n;
        }
        for (client_id, bytes) in owed {
            self.persister.done(client_id, bytes);
        }
        self.stats
            .storage_clients_dirty
            .store(self.dirty.len() as u64, Ordering::Relaxed);
        self.persister.progress.notify_waiters();
        let mut closed = false;
        for a in after.drain(..) {
            match a {
                // Never an acknowledgement for what storage does not hold.
                After::Run(f) | After::Settled(f) => f(!self.fenced && !self.lost),
                After::Flush(tx) => {
                    if let Err(e) = self.persister.storage.flush().await {
                        tracing::error!("storage flush failed: {e}");
                    }
                    let _ = tx.send(());
                }
                After::Delete(client_id, tx) => {
                    self.dirty.remove(&client_id);
                    let _ = tx.send(self.persister.storage.delete_session(&client_id).await);
                }
                After::Close(tx) => {
                    if !self.dirty.is_empty() {
                        self.rewrite_dirty().await;
                    }
                    if let Err(e) = self.persister.storage.close().await {
                        tracing::error!("closing storage failed: {e}");
                    }
                    self.rx.close();
                    let _ = tx.send(());
                    closed = true;
                }
            }
        }
        self.lost = false;
        closed
    }

    /// Applies `batch`, retrying transient errors until storage recovers; a change refused
    /// [`REFUSED_ATTEMPTS`] times in all is given up (its client marked dirty). A refused batch
    /// that covers several clients is split per client at once, each part having the attempts
    /// left, so no change is tried more than [`REFUSED_ATTEMPTS`] times.
    async fn commit(&mut self, batch: &Arc<Vec<Change>>, durable: bool) {
        self.commit_within(batch, durable, REFUSED_ATTEMPTS).await
    }

    async fn commit_within(&mut self, batch: &Arc<Vec<Change>>, durable: bool, attempts: u32) {
        if self.fenced {
            return;
        }
        let mut refused = 0;
        let mut backoff = Duration::from_millis(5);
        loop {
            let result = self
                .persister
                .storage
                .apply_shared(Arc::clone(batch), durable)
                .await;
            let e = match result {
                Ok(()) => {
                    self.writable();
                    return;
                }
                Err(e) => e,
            };
            self.count(|s| &s.storage_writes_failed);
            if e.is_transient() {
                self.unwritable(&e);
                if backoff == Duration::from_millis(5) {
                    tracing::warn!("storage unavailable, retrying until it recovers: {e}");
                }
            } else if e.is_fenced() {
                // Another broker serves the database: write nothing more. Storage reports
                // it through `Storage::failed`, which stops the broker.
                tracing::error!("storage refused a write, another broker took over: {e}");
                self.fenced = true;
                return;
            } else {
                refused += 1;
                let left = attempts.saturating_sub(refused);
                if left == 0 || e.must_stop() || spans_clients(batch) {
                    self.give_up(batch, durable, &e, left).await;
                    return;
                }
            }
            self.count(|s| &s.storage_batches_retried);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// A refused batch: split per client, each part retried with the `left` attempts; a
    /// single client's part with none left is given up.
    ///
    /// The messages the batch stores go first, as a part of their own (the references to
    /// them, in the clients' parts, are refused without them), and its releases last.
    async fn give_up(
        &mut self,
        batch: &Arc<Vec<Change>>,
        durable: bool,
        e: &StorageError,
        left: u32,
    ) {
        let mut groups: Vec<(Part<'_>, Vec<Change>)> = Vec::new();
        for c in batch.iter() {
            let key = match c {
                Change::MessageStored { .. } => Part::Stored,
                Change::MessageReleased { .. } => Part::Released,
                _ => Part::Client(c.client_id()),
            };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, list)) => list.push(c.clone()),
                None => groups.push((key, vec![c.clone()])),
            }
        }
        groups.sort_by_key(|(k, _)| match k {
            Part::Stored => 0,
            Part::Client(_) => 1,
            Part::Released => 2,
        });
        if groups.len() > 1 {
            for (_, part) in groups {
                let part = Arc::new(part);
                if left > 0 {
                    Box::pin(self.commit_within(&part, durable, left)).await;
                } else {
                    Box::pin(self.give_up(&part, durable, e, 0)).await;
                }
            }
            return;
        }
        if left > 0 && !e.must_stop() {
            return Box::pin(self.commit_within(batch, durable, left)).await;
        }
        let client = batch
            .first()
            .and_then(|c| c.client_id())
            .map(str::to_string);
        self.lost = true;
        tracing::error!(
            client_id = client.as_deref().unwrap_or("(retained or stored messages)"),
            changes = batch.len(),
            "storage refused changes {REFUSED_ATTEMPTS} times, giving them up: {e}"
        );
        self.count(|s| &s.storage_batches_dropped);
        if let Some(client) = client {
            self.dirty.insert(client);
        }
    }

    /// A write failed with transient `e`: once writes have failed in a row for
    /// [`UNWRITABLE_AFTER`], storage is reported unwritable (logged once, `/healthz` 503).
    fn unwritable(&mut self, e: &StorageError) {
        let since = *self.failing_since.get_or_insert_with(Instant::now);
        if since.elapsed() < UNWRITABLE_AFTER {
            return;
        }
        if self.persister.write_failure().is_none() {
            tracing::error!(
                "storage takes no writes (failing for {} ms), reporting it unwritable; retrying until it recovers: {e}",
                since.elapsed().as_millis()
            );
        }
        self.persister
            .set_write_failure(Some((e.message().to_string(), since)));
    }

    /// A write succeeded: storage is writable again.
    fn writable(&mut self) {
        if let Some(since) = self.failing_since.take() {
            if self.persister.write_failure().is_some() {
                tracing::warn!(
                    "storage takes writes again after {} s",
                    since.elapsed().as_secs()
                );
                self.persister.set_write_failure(None);
            }
        }
    }

    fn count(&self, counter: impl Fn(&Counters) -> &std::sync::atomic::AtomicU64) {
        counter(&self.stats).fetch_add(1, Ordering::Relaxed);
    }

    /// Writes each dirty client's live session whole (or deletes it when it is gone).
    async fn rewrite_dirty(&mut self) {
        let Some(sessions) = self.sessions.upgrade() else {
            return;
        };
        let dirty: Vec<String> = self.dirty.drain().collect();
        let mut batch = Vec::new();
        for client_id in dirty {
            let session = sessions.lock().get(client_id.as_str()).cloned();
            // A backlog still in storage is written again with the rest of the queue: read
            // first (what storage holds above its last position is in memory).
            let backlog = session.as_ref().and_then(|s| s.state.lock().backlog());
            let stored = match backlog {
                None => Vec::new(),
                Some(b) => match self.persister.storage().load_queue(&client_id).await {
                    Ok(queued) => queued.into_iter().filter(|q| q.seq <= b.last_seq).collect(),
                    Err(e) => {
                        tracing::warn!(%client_id, "cannot read the stored queue to write the session again, retried later: {e}");
                        self.dirty.insert(client_id);
                        continue;
                    }
                },
            };
            let change = session
                .and_then(|s| {
                    let st = s.state.lock();
                    // Read into memory meanwhile: the queue in memory holds it.
                    let stored = if st.backlog().is_some() {
                        stored
                    } else {
                        Vec::new()
                    };
                    (!st.ended() && st.expiry_interval() > 0)
                        .then(|| self.persister.session_written(&client_id, &st, stored))
                })
                .unwrap_or(Change::SessionDeleted { client_id });
            batch.push(change);
        }
        // Marked clean before the write: changes emitted from now on follow it.
        for change in batch {
            self.commit(&Arc::new(vec![change]), false).await;
        }
        self.stats
            .storage_clients_dirty
            .store(self.dirty.len() as u64, Ordering::Relaxed);
    }
}

/// The parts a refused batch is split into.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part<'a> {
    /// The messages it stores.
    Stored,
    /// One client's changes (`None`: the retained set's).
    Client(Option<&'a str>),
    /// The messages it releases.
    Released,
}

/// Changes to commit together, with what each one costs its payer.
#[derive(Default)]
struct Batch {
    changes: Vec<Change>,
    /// `charges[i]` is owed for `changes[i]`.
    charges: Vec<Charge>,
    /// What the appends of its [`Change::StreamSegment`]s owe, in runs of one publisher
    /// (`None`: the broker).
    appends_owed: Vec<(Option<Arc<str>>, usize)>,
}

/// Whether `batch` holds the changes of more than one client (or of a client and the retained
/// messages).
fn spans_clients(batch: &[Change]) -> bool {
    let mut keys = batch.iter().map(|c| c.client_id());
    let first = keys.next();
    keys.any(|k| Some(k) != first)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Weak};

    use mercurio_storage::{Change, ErrorKind, MemoryStorage};

    use bytes::Bytes;
    use tokio::sync::oneshot;

    use super::super::{append_cost, AppendBuffer, PendingLimits, Persister};
    use crate::codec::QoS;
    use crate::message::Message;
    use crate::stats::Counters;

    const LIMITS: PendingLimits = PendingLimits {
        per_client: 1 << 20,
        total: 1 << 24,
    };

    /// A writer on `storage`, with its counters.
    fn start(storage: &MemoryStorage, durable_ack: bool) -> (Arc<Persister>, Arc<Counters>) {
        let stats = Arc::new(Counters::default());
        let p = Persister::start(
            Arc::new(storage.clone()),
            durable_ack,
            LIMITS,
            Arc::clone(&stats),
            Weak::new(),
        );
        (p, stats)
    }

    fn deleted(client_id: &str) -> Change {
        Change::SessionDeleted {
            client_id: client_id.into(),
        }
    }

    /// A fan-out sends one op per stored session: it must stay small (a whole `Change` made
    /// it about 500 bytes, and the publisher's debt bound then let few deliveries per
    /// session into a batch).
    #[test]
    fn a_queued_delivery_waits_in_a_small_op() {
        let size = std::mem::size_of::<super::Op>();
        assert!(size <= 80, "an Op is {size} bytes");
    }

    /// A stream's appends wait in its buffer, not as changes: the writer takes them whole
    /// into one segment, committed before an acknowledgement handed to it after them
    /// (`durable_ack`), and pays their debts at that commit; no message gets an id the broker
    /// holds (nothing to release per message). An append after the take sends a new notice.
    #[tokio::test]
    async fn a_streams_appends_are_one_segment_committed_before_the_acknowledgement() {
        let storage = MemoryStorage::new();
        let (p, stats) = start(&storage, true);
        let buffer = AppendBuffer::new("s");
        let msgs: Vec<Arc<Message>> = (0..3)
            .map(|_| {
                let mut m = Message::for_test("t/a", Bytes::from(vec![b'x'; 10]), QoS::AtLeastOnce);
                m.publisher = Some(Arc::from("pub"));
                Arc::new(m)
            })
            .collect();
        // Sent before the writer task runs: one batch.
        for (offset, m) in (1..).zip(&msgs) {
            p.stream_append(&buffer, offset, 1_000, m);
        }
        let owed = stats.storage_pending_bytes.load(Ordering::Relaxed);
        assert_eq!(owed, 3 * append_cost(&msgs[0]) as u64, "owed until stored");
        let (tx, rx) = oneshot::channel();
        let seen = storage.clone();
        p.after_commit(Box::new(move |ok| {
            let state = seen.snapshot();
            let held = state
                .streams
                .iter()
                .find(|s| s.name == "s")
                .map(|s| s.messages);
            let _ = tx.send((ok, held, seen.applied_batches()));
        }));
        assert_eq!(
            rx.await.ok(),
            Some((true, Some(3), 1)),
            "one commit holding the three entries, before the acknowledgement"
        );
        assert_eq!(stats.storage_pending_bytes.load(Ordering::Relaxed), 0);
        p.stream_append(&buffer, 4, 1_001, &msgs[0]);
        p.flush().await;
        let state = storage.snapshot();
        let s = state.streams.iter().find(|s| s.name == "s");
        assert_eq!(s.map(|s| (s.messages, s.next_offset)), Some((4, 5)));
        assert_eq!(stats.storage_pending_bytes.load(Ordering::Relaxed), 0);
        assert!(
            msgs.iter().all(|m| m.stored.get().is_none()),
            "no message id per append"
        );
    }

    /// One batch holding two clients' changes, refused nine times: each change has been
    /// tried five times (the batch once, then its client's part four times) and both are
    /// given up; before, the batch had five attempts and each part five more, ten in all.
    #[tokio::test]
    async fn a_refused_batch_of_several_clients_gets_five_attempts_in_all() {
        let storage = MemoryStorage::new();
        storage.fail_next(ErrorKind::Refused, 9);
        let (p, stats) = start(&storage, false);
        // Both sent before the writer task runs: one batch.
        p.emit(deleted("a"));
        p.emit(deleted("b"));
        p.flush().await;
        assert_eq!(stats.storage_batches_dropped.load(Ordering::Relaxed), 2);
        assert_eq!(stats.storage_batches_retried.load(Ordering::Relaxed), 6);
        // Five refusals exactly: the batch, then four for the first part, which is given up;
        // the second part then goes through at its first attempt.
        let storage = MemoryStorage::new();
        storage.fail_next(ErrorKind::Refused, 5);
        let (p, stats) = start(&storage, false);
        p.emit(deleted("a"));
        p.emit(deleted("b"));
        p.flush().await;
        assert_eq!(stats.storage_batches_dropped.load(Ordering::Relaxed), 1);
    }
}
