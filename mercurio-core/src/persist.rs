//! Persistence: the background storage writer, what the broker emits to it, and the restore
//! at start (DESIGN.md section 6, manual "Persistence").
//!
//! The broker keeps its state in memory and emits [`Change`]s at each mutation point, under
//! the lock of the session they touch, so that they are in order per client. They go through
//! one unbounded channel to one writer task, which applies whatever has accumulated as one
//! batch (group commit: under load, batches grow by themselves; idle, a change reaches the
//! database within a millisecond or so). The message path never waits on the database; only
//! a connection whose client has more than [`MAX_PENDING_PER_CLIENT`] changes not yet stored
//! (or a broker with more than [`MAX_PENDING_TOTAL`]) waits before reading more.
//!
//! Errors: transient ones are retried until storage recovers (`storage/batches/retried`); a
//! batch refused [`REFUSED_ATTEMPTS`] times is split per client, and a client's changes still
//! refused are given up (`storage/batches/dropped`, an error in the log). The client is then
//! dirty (`storage/clients/dirty`): its further changes are skipped and its live session is
//! written whole ([`Change::SessionWritten`]) once storage takes writes again.
//!
//! With `durable_ack`, the reader hands each PUBACK / PUBREC to the writer
//! ([`Persister::then`]), which sends it after the commit of every change emitted before it,
//! synced ([`Storage::apply_durable`]).
//!
//! With the memory backend there is no [`Persister`]: every mutation point checks an `Option`
//! and does nothing more.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use mercurio_storage::{
    Change, InflightRecord, InflightState, LoadedState, MessageRecord, QueuedRecord,
    RetainedRecord, SessionHeader, SessionRecord, Storage, StorageError, SubscriptionRecord,
    WillRecord, NEVER_EXPIRES, REFUSED_ATTEMPTS,
};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, Notify};

use crate::broker::BrokerInner;
use crate::codec::{self, Properties, ProtocolVersion, QoS, SubscriptionOptions};
use crate::message::Message;
use crate::session::{Granted, Inflight, OutboundState, Queued, Session, SessionState, Will};
use crate::stats::Stats;

/// A client with more changes than this not yet stored waits for storage before its
/// connection reads more (manual: "by 10,000 changes for one client").
pub const MAX_PENDING_PER_CLIENT: usize = 10_000;
/// Every connection waits while the broker has more changes than this not yet stored.
pub const MAX_PENDING_TOTAL: usize = 100_000;
/// Most changes applied in one transaction.
const MAX_BATCH: usize = 4_096;
/// Longest pause between two attempts of a failing batch.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

type Callback = Box<dyn FnOnce() + Send>;

enum Op {
    Change(Change),
    /// Run after everything before it is committed (and synced, with durable_ack).
    Then(Callback),
    /// Commit everything before it, flush, answer.
    Flush(oneshot::Sender<()>),
    /// Delete a session from storage, in order with the changes before it.
    Delete(String, oneshot::Sender<Result<bool, StorageError>>),
    /// Commit everything before it, close storage, stop.
    Close(oneshot::Sender<()>),
}

/// The broker's side of persistence: emits changes to the writer task.
pub(crate) struct Persister {
    tx: mpsc::UnboundedSender<Op>,
    storage: Arc<dyn Storage>,
    durable_ack: bool,
    /// Changes sent and not yet stored, per client.
    pending: Mutex<HashMap<Box<str>, usize>>,
    pending_total: AtomicUsize,
    /// Signalled after every batch.
    progress: Notify,
    /// Clients whose stored session could not be read at start: refused until deleted.
    set_aside: Mutex<HashSet<String>>,
}

impl std::fmt::Debug for Persister {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Persister")
            .field("storage", &self.storage.name())
            .field("durable_ack", &self.durable_ack)
            .finish()
    }
}

/// Now in unix milliseconds.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn instant_to_unix(at: Instant, now: Instant, now_ms: u64) -> u64 {
    if at >= now {
        now_ms.saturating_add(at.duration_since(now).as_millis() as u64)
    } else {
        now_ms.saturating_sub(now.duration_since(at).as_millis() as u64)
    }
}

fn unix_to_instant(ms: u64, now: Instant, now_ms: u64) -> Instant {
    if ms >= now_ms {
        now + Duration::from_millis(ms - now_ms)
    } else {
        now.checked_sub(Duration::from_millis(now_ms - ms))
            .unwrap_or(now)
    }
}

/// The stored form of `msg` delivered at `qos` with `retain`; subscription identifiers ride
/// in the stored properties.
fn message_record(msg: &Message, qos: QoS, retain: bool, ids: &[u32]) -> MessageRecord {
    let properties = if msg.properties.is_empty() && ids.is_empty() {
        Bytes::new()
    } else {
        let mut props = msg.properties.clone();
        props.subscription_identifiers = ids.to_vec();
        props.topic_alias = None;
        let mut out = BytesMut::new();
        if let Err(e) = codec::encode_properties(&props, &mut out) {
            tracing::warn!(topic = %msg.topic, "message properties not stored: {e}");
        }
        out.freeze()
    };
    let (now, now_ms) = (Instant::now(), unix_ms());
    MessageRecord {
        topic: msg.topic.clone(),
        payload: msg.payload.clone(),
        qos: qos as u8,
        retain,
        properties,
        expires_at: msg.expires_at.map(|at| instant_to_unix(at, now, now_ms)),
        publisher: msg.publisher.as_deref().map(str::to_string),
    }
}

/// A message back from its stored form, with the subscription identifiers stored with it.
fn message_from(
    record: &MessageRecord,
    now: Instant,
    now_ms: u64,
) -> Result<(Message, Vec<u32>), String> {
    let mut properties = if record.properties.is_empty() {
        Properties::default()
    } else {
        codec::decode_properties(&record.properties).map_err(|e| format!("properties: {e}"))?
    };
    let ids = std::mem::take(&mut properties.subscription_identifiers);
    let qos = QoS::from_u8(record.qos).ok_or_else(|| format!("QoS {}", record.qos))?;
    Ok((
        Message {
            topic: record.topic.clone(),
            payload: record.payload.clone(),
            qos,
            retain: record.retain,
            properties,
            expires_at: record.expires_at.map(|ms| unix_to_instant(ms, now, now_ms)),
            publisher: record.publisher.as_deref().map(Arc::from),
        },
        ids,
    ))
}

fn queued_record(q: &Queued) -> MessageRecord {
    message_record(&q.msg, q.qos, q.retain, &q.subscription_ids)
}

fn inflight_record(f: &Inflight) -> InflightRecord {
    InflightRecord {
        packet_id: f.packet_id,
        message: queued_record(&f.delivery),
        state: match f.state {
            OutboundState::AwaitingPubAck => InflightState::AwaitingPubAck,
            OutboundState::AwaitingPubRec => InflightState::AwaitingPubRec,
            OutboundState::AwaitingPubComp => InflightState::AwaitingPubComp,
        },
    }
}

fn subscription_record(filter: &str, granted: &Granted) -> SubscriptionRecord {
    let o = &granted.options;
    SubscriptionRecord {
        filter: filter.to_string(),
        qos: o.qos as u8,
        no_local: o.no_local,
        retain_as_published: o.retain_as_published,
        retain_handling: o.retain_handling,
        subscription_identifier: granted.identifier,
    }
}

/// A will's Message Expiry Interval counts from its publication, so it is stored as the
/// property itself rather than as a deadline.
fn will_record(will: &Will) -> WillRecord {
    let mut msg = (*will.msg).clone();
    msg.properties.message_expiry_interval = will.expiry;
    WillRecord {
        message: message_record(&msg, msg.qos, msg.retain, &[]),
        delay_interval: will.delay,
    }
}

fn header(client_id: &str, st: &SessionState) -> SessionHeader {
    SessionHeader {
        client_id: client_id.to_string(),
        protocol_level: st.protocol.level(),
        session_expiry_interval: st.expiry_interval,
        disconnected_at: st
            .disconnected_at
            .map(|at| instant_to_unix(at, Instant::now(), unix_ms())),
        username: st.username.as_deref().map(str::to_string),
    }
}

/// The whole session as stored (QoS 0 messages are not kept).
fn session_record(client_id: &str, st: &SessionState) -> SessionRecord {
    let mut record = SessionRecord::new(header(client_id, st));
    let mut subs: Vec<_> = st
        .subscriptions
        .iter()
        .map(|(f, g)| subscription_record(f, g))
        .collect();
    subs.sort_by(|a, b| a.filter.cmp(&b.filter));
    record.subscriptions = subs;
    record.will = st.will.as_ref().map(will_record);
    record.queued = st
        .queue
        .iter()
        .filter(|q| q.qos > QoS::AtMostOnce)
        .map(|q| QueuedRecord {
            seq: q.seq,
            message: queued_record(q),
        })
        .collect();
    record.inflight = st.inflight.iter().map(inflight_record).collect();
    let mut inbound: Vec<u16> = st.inbound_qos2.iter().copied().collect();
    inbound.sort_unstable();
    record.inbound_qos2 = inbound;
    record
}

/// The mutation points: each emits the change that mirrors it, when the session is stored
/// (a persister, a session expiry interval above 0). Called with the session locked.
impl SessionState {
    fn stored(&self) -> Option<&Arc<Persister>> {
        self.persist.as_ref().filter(|_| self.expiry_interval > 0)
    }

    /// A message was pushed on the queue.
    pub(crate) fn persist_queued(&self, client_id: &str, q: &Queued) {
        if q.qos == QoS::AtMostOnce {
            return;
        }
        if let Some(p) = self.stored() {
            p.emit(Change::MessageQueued {
                client_id: client_id.to_string(),
                seq: q.seq,
                message: queued_record(q),
            });
        }
    }

    /// A message left the queue without being sent (expired, too large).
    pub(crate) fn persist_dequeued(&self, client_id: &str, q: &Queued) {
        if q.qos == QoS::AtMostOnce {
            return;
        }
        if let Some(p) = self.stored() {
            p.emit(Change::MessageDequeued {
                client_id: client_id.to_string(),
                seq: q.seq,
            });
        }
    }

    /// The last in-flight message was just sent, taken from the queue.
    pub(crate) fn persist_sent(&self, client_id: &str) {
        let Some(p) = self.stored() else { return };
        let Some(f) = self.inflight.back() else {
            return;
        };
        p.emit(Change::MessageDequeued {
            client_id: client_id.to_string(),
            seq: f.delivery.seq,
        });
        p.emit(Change::InflightSet {
            client_id: client_id.to_string(),
            inflight: inflight_record(f),
        });
    }

    /// The in-flight message at `index` changed state (PUBREC received).
    pub(crate) fn persist_inflight(&self, client_id: &str, index: usize) {
        let Some(p) = self.stored() else { return };
        if let Some(f) = self.inflight.get(index) {
            p.emit(Change::InflightSet {
                client_id: client_id.to_string(),
                inflight: inflight_record(f),
            });
        }
    }

    /// An in-flight message was acknowledged (or refused) and removed.
    pub(crate) fn persist_acked(&self, client_id: &str, packet_id: u16) {
        if let Some(p) = self.stored() {
            p.emit(Change::InflightRemoved {
                client_id: client_id.to_string(),
                packet_id,
            });
        }
    }

    /// An inbound QoS 2 packet identifier was added (`true`) or released.
    pub(crate) fn persist_inbound_qos2(&self, client_id: &str, packet_id: u16, added: bool) {
        if let Some(p) = self.stored() {
            let client_id = client_id.to_string();
            p.emit(if added {
                Change::InboundQos2Added {
                    client_id,
                    packet_id,
                }
            } else {
                Change::InboundQos2Removed {
                    client_id,
                    packet_id,
                }
            });
        }
    }

    /// A subscription was added or replaced (`Some`), or removed.
    pub(crate) fn persist_subscription(
        &self,
        client_id: &str,
        filter: &str,
        granted: Option<&Granted>,
    ) {
        if let Some(p) = self.stored() {
            let client_id = client_id.to_string();
            p.emit(match granted {
                Some(g) => Change::SubscriptionAdded {
                    client_id,
                    subscription: subscription_record(filter, g),
                },
                None => Change::SubscriptionRemoved {
                    client_id,
                    filter: filter.to_string(),
                },
            });
        }
    }

    /// The will was published or dropped.
    pub(crate) fn persist_will_cleared(&self, client_id: &str) {
        if let Some(p) = self.stored() {
            p.emit(Change::WillCleared {
                client_id: client_id.to_string(),
            });
        }
    }

    /// The connection ended: the header with its disconnection time, and the will if gone.
    pub(crate) fn persist_detached(&self, client_id: &str) {
        if let Some(p) = self.stored() {
            p.emit(Change::SessionSaved(header(client_id, self)));
            if self.will.is_none() {
                p.emit(Change::WillCleared {
                    client_id: client_id.to_string(),
                });
            }
        }
    }

    /// The session ended (expired, cleaned, taken over by a clean start).
    pub(crate) fn persist_ended(&self, client_id: &str) {
        if let Some(p) = &self.persist {
            p.emit(Change::SessionDeleted {
                client_id: client_id.to_string(),
            });
        }
    }
}

/// A connection took `session` (new, or resumed when `resumed`): attach the persister and
/// store the header and the will, or delete a stored session that is no longer kept.
pub(crate) fn connected(broker: &BrokerInner, session: &Session, resumed: bool) {
    let Some(p) = broker.persist.get() else {
        return;
    };
    let mut st = session.state.lock();
    if st.persist.is_none() {
        st.persist = Some(Arc::clone(p));
    }
    let client_id = session.client_id();
    if st.expiry_interval == 0 {
        if resumed {
            p.emit(Change::SessionDeleted {
                client_id: client_id.to_string(),
            });
        }
        return;
    }
    if resumed {
        p.emit(Change::SessionSaved(header(client_id, &st)));
        p.emit(match &st.will {
            Some(w) => Change::WillSet {
                client_id: client_id.to_string(),
                will: will_record(w),
            },
            None => Change::WillCleared {
                client_id: client_id.to_string(),
            },
        });
    } else {
        // A new session: written whole (it may already hold subscriptions or messages if
        // it was made before this call).
        p.emit(Change::SessionWritten(session_record(client_id, &st)));
    }
}

/// Whether the stored session of `client_id` was set aside (its client is refused).
pub(crate) fn is_set_aside(broker: &BrokerInner, client_id: &str) -> bool {
    broker
        .persist
        .get()
        .is_some_and(|p| p.set_aside.lock().contains(client_id))
}

impl Persister {
    /// Starts the writer task for `storage`.
    pub(crate) fn start(
        storage: Arc<dyn Storage>,
        durable_ack: bool,
        broker: Weak<BrokerInner>,
    ) -> Arc<Persister> {
        let (tx, rx) = mpsc::unbounded_channel();
        let persister = Arc::new(Persister {
            tx,
            storage,
            durable_ack,
            pending: Mutex::new(HashMap::new()),
            pending_total: AtomicUsize::new(0),
            progress: Notify::new(),
            set_aside: Mutex::new(HashSet::new()),
        });
        let writer = Writer {
            persister: Arc::clone(&persister),
            broker,
            dirty: HashSet::new(),
            rx,
            fenced: false,
        };
        tokio::spawn(writer.run());
        persister
    }

    /// Whether acknowledgements wait for the commit.
    pub(crate) fn durable_ack(&self) -> bool {
        self.durable_ack
    }

    /// Sends one change to the writer.
    pub(crate) fn emit(&self, change: Change) {
        if let Some(client_id) = change.client_id() {
            let mut pending = self.pending.lock();
            match pending.get_mut(client_id) {
                Some(n) => *n += 1,
                None => {
                    pending.insert(client_id.into(), 1);
                }
            }
        }
        self.pending_total.fetch_add(1, Ordering::Relaxed);
        if let Err(mpsc::error::SendError(Op::Change(change))) = self.tx.send(Op::Change(change)) {
            // The writer has stopped (the broker is stopping): nothing more is stored.
            self.done(change.client_id(), 1);
        }
    }

    /// Runs `f` once every change sent so far is committed (synced, with durable_ack).
    pub(crate) fn then(&self, f: Callback) {
        if let Err(mpsc::error::SendError(Op::Then(f))) = self.tx.send(Op::Then(f)) {
            f();
        }
    }

    fn done(&self, client_id: Option<&str>, n: usize) {
        if let Some(client_id) = client_id {
            let mut pending = self.pending.lock();
            if let Some(count) = pending.get_mut(client_id) {
                *count = count.saturating_sub(n);
                if *count == 0 {
                    pending.remove(client_id);
                }
            }
        }
        self.pending_total.fetch_sub(n, Ordering::Relaxed);
    }

    /// Waits while `client_id` (or the broker) is too far ahead of storage.
    pub(crate) async fn wait_room(&self, client_id: &str) {
        loop {
            let notified = self.progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let own = self.pending.lock().get(client_id).copied().unwrap_or(0);
            if own <= MAX_PENDING_PER_CLIENT
                && self.pending_total.load(Ordering::Relaxed) <= MAX_PENDING_TOTAL
            {
                return;
            }
            notified.await;
        }
    }

    /// Commits everything sent so far and flushes storage.
    pub(crate) async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Commits everything sent so far, then closes storage and stops the writer.
    pub(crate) async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Op::Close(tx)).is_ok() {
            let _ = rx.await;
        }
    }

    /// Deletes the stored session of `client_id` after the changes sent before.
    pub(crate) async fn delete_session(&self, client_id: &str) -> Result<bool, StorageError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Op::Delete(client_id.to_string(), tx))
            .map_err(|_| StorageError::fatal("storage is closed"))?;
        let deleted = rx
            .await
            .map_err(|_| StorageError::fatal("storage is closed"))??;
        let was_set_aside = self.set_aside.lock().remove(client_id);
        Ok(deleted || was_set_aside)
    }

    /// The number of sessions set aside now.
    pub(crate) fn set_aside_count(&self) -> usize {
        self.set_aside.lock().len()
    }
}

/// The writer task.
struct Writer {
    persister: Arc<Persister>,
    broker: Weak<BrokerInner>,
    /// Clients whose changes were given up: their changes are skipped until their session
    /// is written whole.
    dirty: HashSet<String>,
    rx: mpsc::UnboundedReceiver<Op>,
    /// A write was refused because another broker took over: nothing more is written.
    fenced: bool,
}

/// What to do after the changes of a batch are committed.
enum After {
    Then(Callback),
    Flush(oneshot::Sender<()>),
    Delete(String, oneshot::Sender<Result<bool, StorageError>>),
    Close(oneshot::Sender<()>),
}

impl Writer {
    async fn run(mut self) {
        let mut ops = Vec::new();
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
            ops.push(first);
            while ops.len() < MAX_BATCH {
                match self.rx.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            if !self.dirty.is_empty() {
                self.rewrite_dirty().await;
            }
            if self.process(&mut ops).await {
                return;
            }
        }
    }

    /// Applies `ops` in order. Returns true once closed.
    async fn process(&mut self, ops: &mut Vec<Op>) -> bool {
        let mut changes: Vec<Change> = Vec::new();
        let mut after: Vec<After> = Vec::new();
        let mut closed = false;
        for op in ops.drain(..) {
            match op {
                Op::Change(change) => {
                    let skip = change.client_id().is_some_and(|c| self.dirty.contains(c));
                    if skip {
                        self.persister.done(change.client_id(), 1);
                    } else {
                        changes.push(change);
                    }
                }
                Op::Then(f) => after.push(After::Then(f)),
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

    /// Commits `changes`, then runs `after`. Returns true once closed.
    async fn finish(&mut self, changes: &mut Vec<Change>, after: &mut Vec<After>) -> bool {
        if changes.is_empty() && after.is_empty() {
            return false;
        }
        let durable =
            self.persister.durable_ack && after.iter().any(|a| matches!(a, After::Then(_)));
        let batch = std::mem::take(changes);
        if !batch.is_empty() || durable {
            self.commit(&batch, durable).await;
        }
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for c in &batch {
            match c.client_id() {
                Some(id) => *counts.entry(id).or_default() += 1,
                None => self.persister.done(None, 1),
            }
        }
        for (id, n) in counts {
            self.persister.done(Some(id), n);
        }
        if let Some(broker) = self.broker.upgrade() {
            broker
                .stats
                .storage_clients_dirty
                .store(self.dirty.len() as u64, Ordering::Relaxed);
        }
        self.persister.progress.notify_waiters();
        let mut closed = false;
        for a in after.drain(..) {
            match a {
                After::Then(f) => f(),
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
        closed
    }

    /// Applies `batch`, retrying transient errors until storage recovers; a batch refused
    /// [`REFUSED_ATTEMPTS`] times is split per client, and what is still refused is given up.
    async fn commit(&mut self, batch: &[Change], durable: bool) {
        if self.fenced {
            return;
        }
        let mut refused = 0;
        let mut backoff = Duration::from_millis(5);
        loop {
            let result = if durable {
                self.persister.storage.apply_durable(batch).await
            } else {
                self.persister.storage.apply(batch).await
            };
            let e = match result {
                Ok(()) => return,
                Err(e) => e,
            };
            if e.is_transient() {
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
                if refused >= REFUSED_ATTEMPTS || e.must_stop() {
                    self.give_up(batch, durable, &e).await;
                    return;
                }
            }
            self.count(|s| &s.storage_batches_retried);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// A batch refused for good: split it per client and retry each part, giving up only the
    /// parts still refused.
    async fn give_up(&mut self, batch: &[Change], durable: bool, e: &StorageError) {
        let mut groups: Vec<(Option<&str>, Vec<Change>)> = Vec::new();
        for c in batch {
            let key = c.client_id();
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, list)) => list.push(c.clone()),
                None => groups.push((key, vec![c.clone()])),
            }
        }
        if groups.len() > 1 {
            for (_, part) in groups {
                Box::pin(self.commit(&part, durable)).await;
            }
            return;
        }
        let client = batch
            .first()
            .and_then(|c| c.client_id())
            .map(str::to_string);
        tracing::error!(
            client_id = client.as_deref().unwrap_or("(retained messages)"),
            changes = batch.len(),
            "storage refused changes {REFUSED_ATTEMPTS} times, giving them up: {e}"
        );
        self.count(|s| &s.storage_batches_dropped);
        if let Some(client) = client {
            self.dirty.insert(client);
        }
    }

    fn count(&self, counter: impl Fn(&Stats) -> &std::sync::atomic::AtomicU64) {
        if let Some(broker) = self.broker.upgrade() {
            counter(&broker.stats).fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Writes each dirty client's live session whole (or deletes it when it is gone).
    async fn rewrite_dirty(&mut self) {
        let Some(broker) = self.broker.upgrade() else {
            return;
        };
        let dirty: Vec<String> = self.dirty.drain().collect();
        let mut batch = Vec::new();
        for client_id in dirty {
            let session = broker.sessions.lock().get(client_id.as_str()).cloned();
            let change = session
                .and_then(|s| {
                    let st = s.state.lock();
                    (!st.ended && st.expiry_interval > 0)
                        .then(|| Change::SessionWritten(session_record(&client_id, &st)))
                })
                .unwrap_or(Change::SessionDeleted { client_id });
            batch.push(change);
        }
        // Marked clean before the write: changes emitted from now on follow it.
        for change in &batch {
            self.commit(std::slice::from_ref(change), false).await;
        }
        broker
            .stats
            .storage_clients_dirty
            .store(self.dirty.len() as u64, Ordering::Relaxed);
    }
}

fn protocol_from_level(level: u8) -> ProtocolVersion {
    match level {
        3 => ProtocolVersion::V31,
        4 => ProtocolVersion::V311,
        _ => ProtocolVersion::V5,
    }
}

/// Rebuilds the broker's state from what storage holds, before the listeners serve: retained
/// messages, sessions with their subscriptions, queues, in-flight messages, inbound QoS 2
/// identifiers and wills; timers for expiry and delayed wills. Sessions that expired while
/// the broker was down are deleted and their wills published.
pub(crate) fn restore(broker: &Arc<BrokerInner>, loaded: LoadedState) {
    let Some(p) = broker.persist.get() else {
        return;
    };
    let (now, now_ms) = (Instant::now(), unix_ms());
    {
        let mut retained = broker.retained.lock();
        for r in &loaded.retained {
            match message_from(&r.message, now, now_ms) {
                Ok((msg, _)) if !msg.is_expired(now) => {
                    let msg = Arc::new(msg);
                    retained.insert(&msg.topic, Arc::clone(&msg));
                }
                Ok(_) => p.emit(Change::RetainedDeleted {
                    topic: r.topic().to_string(),
                }),
                Err(e) => tracing::error!(topic = r.topic(), "retained message not restored: {e}"),
            }
        }
    }
    {
        let mut set_aside = p.set_aside.lock();
        for s in &loaded.set_aside {
            tracing::error!(
                client_id = %s.client_id,
                "stored session cannot be read, set aside (its client is refused until \
                 `mercurioctl client delete-session`): {}",
                s.cause
            );
            set_aside.insert(s.client_id.clone());
        }
        broker
            .stats
            .storage_sessions_set_aside
            .store(set_aside.len() as u64, Ordering::Relaxed);
    }
    let mut wills_now: Vec<(String, Will)> = Vec::new();
    let mut restored = 0usize;
    for record in loaded.sessions {
        let client_id = record.client_id.clone();
        if record.is_expired(now_ms) || record.session_expiry_interval == 0 {
            tracing::info!(client_id = %client_id, "stored session expired while the broker was down: discarded");
            broker
                .stats
                .sessions_expired
                .fetch_add(1, Ordering::Relaxed);
            p.emit(Change::SessionDeleted {
                client_id: client_id.clone(),
            });
            if let Some(w) = &record.will {
                if let Ok((mut msg, _)) = message_from(&w.message, now, now_ms) {
                    let expiry = msg.properties.message_expiry_interval.take();
                    wills_now.push((
                        client_id,
                        Will {
                            msg: Arc::new(msg),
                            delay: w.delay_interval,
                            expiry,
                        },
                    ));
                }
            }
            continue;
        }
        match restore_session(broker, p, record, now, now_ms) {
            Ok(Some(will)) => wills_now.push((client_id, will)),
            Ok(None) => {}
            Err(cause) => {
                tracing::error!(client_id = %client_id, "stored session cannot be restored, set aside: {cause}");
                p.set_aside.lock().insert(client_id);
                broker
                    .stats
                    .storage_sessions_set_aside
                    .store(p.set_aside_count() as u64, Ordering::Relaxed);
                continue;
            }
        }
        restored += 1;
    }
    tracing::info!(
        sessions = restored,
        retained = loaded.retained.len(),
        set_aside = p.set_aside_count(),
        "restored from {} storage",
        p.storage.name()
    );
    for (client_id, will) in wills_now {
        broker.publish_will(&client_id, will);
    }
}

/// Restores one session; returns its will when it is due now.
fn restore_session(
    broker: &Arc<BrokerInner>,
    p: &Arc<Persister>,
    record: SessionRecord,
    now: Instant,
    now_ms: u64,
) -> Result<Option<Will>, String> {
    let client_id: Arc<str> = Arc::from(record.client_id.as_str());
    let session = Arc::new(Session::new(
        Arc::clone(&client_id),
        protocol_from_level(record.protocol_level),
        record.session_expiry_interval,
    ));
    // The client was connected when the previous broker stopped: its connection ended now.
    let crashed = record.disconnected_at.is_none();
    // Access checks while the client is away use the user name it last connected with.
    let username: Option<Arc<str>> = record.username.as_deref().map(Arc::from);
    *session.identity.write() = crate::auth::Identity::Client {
        username: username.clone(),
    };
    let disconnected_ms = record.disconnected_at.unwrap_or(now_ms);
    let mut will_due = None;
    {
        let mut st = session.state.lock();
        st.disconnected_at = Some(unix_to_instant(disconnected_ms, now, now_ms));
        st.username = username;
        for (seq, q) in record.queued.iter().map(|q| (q.seq, &q.message)) {
            let (msg, ids) = message_from(q, now, now_ms)?;
            let qos = msg.qos;
            st.next_seq = st.next_seq.max(seq + 1);
            if msg.is_expired(now) {
                p.emit(Change::MessageDequeued {
                    client_id: record.client_id.clone(),
                    seq,
                });
                continue;
            }
            st.queued_bytes += msg.payload.len() as u64;
            st.queue.push_back(Queued {
                retain: msg.retain,
                msg: Arc::new(msg),
                qos,
                subscription_ids: ids,
                seq,
            });
        }
        for f in &record.inflight {
            let (msg, ids) = message_from(&f.message, now, now_ms)?;
            st.inflight.push_back(Inflight {
                packet_id: f.packet_id,
                state: match f.state {
                    InflightState::AwaitingPubAck => OutboundState::AwaitingPubAck,
                    InflightState::AwaitingPubRec => OutboundState::AwaitingPubRec,
                    InflightState::AwaitingPubComp => OutboundState::AwaitingPubComp,
                },
                delivery: Queued {
                    retain: msg.retain,
                    qos: msg.qos,
                    msg: Arc::new(msg),
                    subscription_ids: ids,
                    seq: 0,
                },
                sent: false,
            });
        }
        st.inbound_qos2 = record.inbound_qos2.iter().copied().collect();
        if let Some(w) = &record.will {
            let (mut msg, _) = message_from(&w.message, now, now_ms)?;
            let expiry = msg.properties.message_expiry_interval.take();
            st.will = Some(Will {
                msg: Arc::new(msg),
                delay: w.delay_interval,
                expiry,
            });
        }
    }
    for s in &record.subscriptions {
        let granted = Granted {
            options: SubscriptionOptions {
                qos: QoS::from_u8(s.qos).ok_or("subscription QoS")?,
                no_local: s.no_local,
                retain_as_published: s.retain_as_published,
                retain_handling: s.retain_handling,
            },
            identifier: s.subscription_identifier,
        };
        broker.subscribe(&session, &s.filter, granted);
    }
    let expiry = record.session_expiry_interval;
    let expires_at =
        (expiry != NEVER_EXPIRES).then(|| disconnected_ms.saturating_add(u64::from(expiry) * 1000));
    {
        let mut st = session.state.lock();
        st.persist = Some(Arc::clone(p));
        if crashed {
            p.emit(Change::SessionSaved(header(&client_id, &st)));
        }
        // A will pending when the broker stopped: due after its delay, unless the session
        // ends first (then it goes out with the session's end).
        if let Some(w) = &st.will {
            let due = disconnected_ms.saturating_add(u64::from(w.delay) * 1000);
            if expires_at.is_none_or(|e| due < e) {
                if due <= now_ms {
                    will_due = st.will.take();
                    st.persist_will_cleared(&client_id);
                } else {
                    arm_will(broker, &session, Duration::from_millis(due - now_ms));
                }
            }
        }
    }
    broker
        .sessions
        .lock()
        .insert(Arc::clone(&client_id), Arc::clone(&session));
    if let Some(at) = expires_at {
        broker.arm_expiry(
            &session,
            0,
            Duration::from_millis(at.saturating_sub(now_ms)),
        );
    }
    Ok(will_due)
}

fn arm_will(broker: &Arc<BrokerInner>, session: &Arc<Session>, after: Duration) {
    let broker = Arc::clone(broker);
    let session = Arc::clone(session);
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        let will = {
            let mut st = session.state.lock();
            if st.generation != 0 || st.link.is_some() || st.ended {
                return;
            }
            let will = st.will.take();
            if will.is_some() {
                st.persist_will_cleared(&session.client_id);
            }
            will
        };
        if let Some(will) = will {
            broker.publish_will(&session.client_id, will);
        }
    });
}

/// Retained-set changes, emitted under the retained store's lock.
impl Persister {
    pub(crate) fn retained_set(&self, msg: &Message) {
        self.emit(Change::RetainedSet(RetainedRecord::new(message_record(
            msg,
            msg.qos,
            true,
            &[],
        ))));
    }

    pub(crate) fn retained_deleted(&self, topic: &str) {
        self.emit(Change::RetainedDeleted {
            topic: topic.to_string(),
        });
    }
}

/// The backend `[storage]` names, opened (`None` for memory: nothing is stored).
pub(crate) async fn open_configured(
    config: &crate::config::StorageConfig,
) -> Result<Option<Arc<dyn Storage>>, crate::Error> {
    use crate::config::StorageBackend;
    match config.backend {
        StorageBackend::Memory => Ok(None),
        #[cfg(feature = "sqlite")]
        StorageBackend::Sqlite => {
            let path = config
                .path
                .clone()
                .ok_or_else(|| crate::Error::Config("backend = \"sqlite\" needs path".into()))?;
            let storage = tokio::task::spawn_blocking(move || {
                mercurio_storage::sqlite::SqliteStorage::open(path)
            })
            .await
            .map_err(|e| crate::Error::Config(format!("opening the database: {e}")))??;
            Ok(Some(Arc::new(storage)))
        }
        #[cfg(not(feature = "sqlite"))]
        StorageBackend::Sqlite => Err(crate::Error::Config(
            "backend = \"sqlite\" needs the sqlite feature".into(),
        )),
        #[cfg(feature = "postgres")]
        StorageBackend::Postgres => {
            let url = config
                .url
                .clone()
                .ok_or_else(|| crate::Error::Config("backend = \"postgres\" needs url".into()))?;
            let mut options = mercurio_storage::postgres::PostgresOptions::new(url);
            options.standby = config.standby;
            let storage = mercurio_storage::postgres::PostgresStorage::open(options).await?;
            Ok(Some(Arc::new(storage)))
        }
        #[cfg(not(feature = "postgres"))]
        StorageBackend::Postgres => Err(crate::Error::Config(
            "backend = \"postgres\" needs the postgres feature".into(),
        )),
    }
}
