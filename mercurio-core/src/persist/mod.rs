//! Persistence: what the broker emits to storage ([`Persister`]), the background writer that
//! applies it ([`writer`]), and the conversion between sessions and stored records
//! ([`records`]). The restore at start is the broker's (`broker::restore`).
//!
//! The broker keeps its state in memory and emits [`Change`]s at each mutation point, under
//! the lock of the session they touch, so that they are in order per client. They go through
//! one unbounded channel to one writer task, which applies whatever has accumulated as one
//! batch (group commit: under load, batches grow by themselves; idle, a change reaches the
//! database within a millisecond or so). The message path never waits on the database.
//!
//! Back pressure: each change not yet stored costs its bytes ([`Change::size`] plus the
//! change's own footprint, [`CHANGE_OVERHEAD`]) to the client that caused it, its payer: the
//! publisher of the message for a message queued or retained, the session's own client
//! otherwise. A connection whose client owes more than `[storage] max_pending_bytes`, or
//! that owes anything while the broker holds more than `max_pending_bytes_total`, is not read
//! until storage has caught up (`storage/clients/waiting`): a publisher feeding many offline
//! persistent sessions is slowed, and clients that need no storage are not.
//!
//! A storage that has taken no write for [`UNWRITABLE_AFTER`] (a full disk, an unreachable
//! database) is reported ([`Persister::write_failure`]: `/healthz` 503, a degraded status,
//! `storage/unwritable`) until a write succeeds again; its batch is retried meanwhile.
//!
//! Errors: transient ones are retried until storage recovers (`storage/batches/retried`); a
//! batch refused [`REFUSED_ATTEMPTS`] times is split per client, and a client's changes still
//! refused are given up (`storage/batches/dropped`, an error in the log). The client is then
//! dirty (`storage/clients/dirty`): its further changes are skipped and its live session is
//! written whole ([`Change::SessionWritten`]) once storage takes writes again.
//!
//! With `durable_ack`, the reader hands each PUBACK / PUBREC to the writer
//! ([`Persister::after_commit`]), which sends it after the commit of every change emitted before it,
//! synced ([`Storage::apply_durable`]).
//!
//! With the memory backend there is no [`Persister`]: every mutation point checks an `Option`
//! and does nothing more.

pub(crate) mod records;
mod writer;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mercurio_storage::{
    Change, QueuedRecord, RetainedRecord, Storage, StorageError, StoredMessage,
};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, Notify};

use records::{
    header, inflight_record, message_record, session_record, subscription_record, will_record,
};
use writer::{BatchWriter, Callback, Op, QueuedOp};

use crate::message::{Message, ReleaseStored, Releaser, Stored};
use crate::session::{
    Delivery, Granted, Inflight, Session, SessionChanges, SessionState, SessionTable,
};
use crate::stats::Counters;

/// Bytes a change costs beyond [`Change::size`]: its own footprint while it waits in the
/// writer's channel (a [`Change`] other than a queued delivery is boxed, and costs its size
/// too).
pub(crate) const CHANGE_OVERHEAD: usize = std::mem::size_of::<Op>();

/// How long storage may fail every write before the broker reports it unwritable.
pub(crate) const UNWRITABLE_AFTER: Duration = Duration::from_secs(1);

/// Storage that takes no writes: what `/healthz`, the admin status and
/// `storage/unwritable` report while it lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteFailure {
    /// The last error the backend returned (e.g. SQLite's "database or disk is full").
    pub error: String,
    /// How long every write has failed so far.
    pub duration: Duration,
}

/// Who owes a change's bytes until it is stored.
pub(super) enum Payer {
    /// The client whose session the change touches ([`Change::client_id`]).
    Own,
    /// Another client: the publisher of the message the change stores.
    Client(Arc<str>),
    /// No client (an in-process publish): counted in the broker's total only.
    Broker,
}

/// A change's debt: who owes it and how many bytes.
pub(super) struct Charge {
    pub(super) payer: Payer,
    pub(super) bytes: usize,
}

impl Charge {
    /// The client owing it, for `change`.
    pub(super) fn client<'a>(&'a self, change: &'a Change) -> Option<&'a str> {
        match &self.payer {
            Payer::Own => change.client_id(),
            Payer::Client(c) => Some(c),
            Payer::Broker => None,
        }
    }
}

/// The back pressure bounds, in bytes (`usize::MAX` for unlimited).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PendingLimits {
    /// `[storage] max_pending_bytes`.
    pub(crate) per_client: usize,
    /// `[storage] max_pending_bytes_total`.
    pub(crate) total: usize,
}

impl PendingLimits {
    /// The limits `[storage]` sets (0 = unlimited).
    pub(crate) fn from_config(c: &crate::config::StorageConfig) -> PendingLimits {
        let bound = |n: u64| match n {
            0 => usize::MAX,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        };
        PendingLimits {
            per_client: bound(c.max_pending_bytes),
            total: bound(c.max_pending_bytes_total),
        }
    }
}

/// The broker's side of persistence: emits changes to the writer task.
pub(crate) struct Persister {
    tx: mpsc::UnboundedSender<Op>,
    storage: Arc<dyn Storage>,
    durable_ack: bool,
    limits: PendingLimits,
    /// The broker's counters: `storage_pending_bytes` is the total owed.
    stats: Arc<Counters>,
    /// Bytes sent and not yet stored, per paying client.
    pending: Mutex<HashMap<Box<str>, usize>>,
    /// Paying clients over `limits.per_client` now, so that a connection under no pressure
    /// checks one atomic and takes no lock.
    over: AtomicUsize,
    /// Signalled after every batch.
    progress: Notify,
    /// Clients whose stored session could not be read at start: refused until deleted.
    set_aside: Mutex<HashSet<String>>,
    /// Set by the writer while storage takes no writes: the last error and since when.
    failure: Mutex<Option<(String, Instant)>>,
    /// The id the next message stored gets (seeded by the restore above every stored one).
    next_message_id: AtomicU64,
    /// This persister, for the messages it stores to release themselves when dropped (they
    /// hold a `Weak` to it; gone with the persister).
    releaser: Arc<Releaser>,
}

impl std::fmt::Debug for Persister {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Persister")
            .field("storage", &self.storage.name())
            .field("durable_ack", &self.durable_ack)
            .finish()
    }
}

impl Persister {
    /// Starts the writer task for `storage`.
    pub(crate) fn start(
        storage: Arc<dyn Storage>,
        durable_ack: bool,
        limits: PendingLimits,
        stats: Arc<Counters>,
        sessions: Weak<SessionTable>,
    ) -> Arc<Persister> {
        let (tx, rx) = mpsc::unbounded_channel();
        let persister = Arc::new_cyclic(|me| Persister {
            tx,
            storage,
            durable_ack,
            limits,
            stats: Arc::clone(&stats),
            pending: Mutex::new(HashMap::new()),
            over: AtomicUsize::new(0),
            progress: Notify::new(),
            set_aside: Mutex::new(HashSet::new()),
            failure: Mutex::new(None),
            next_message_id: AtomicU64::new(1),
            releaser: Arc::new(Releaser(Box::new(me.clone()))),
        });
        let writer = BatchWriter {
            persister: Arc::clone(&persister),
            stats,
            sessions,
            dirty: HashSet::new(),
            rx,
            fenced: false,
            lost: false,
            failing_since: None,
        };
        tokio::spawn(writer.run());
        persister
    }

    /// Whether acknowledgements wait for the commit.
    pub(crate) fn durable_ack(&self) -> bool {
        self.durable_ack
    }

    /// Sends one change to the writer, owed by the client whose session it touches.
    pub(crate) fn emit(&self, change: Change) {
        self.emit_paid(change, Payer::Own);
    }

    /// Sends one change to the writer, owed by `payer` until it is stored.
    fn emit_paid(&self, change: Change, payer: Payer) {
        let charge = Charge {
            payer,
            bytes: change.size() + CHANGE_OVERHEAD + std::mem::size_of::<Change>(),
        };
        self.owe(charge.client(&change), charge.bytes);
        self.send(Op::Change(Box::new(change), charge));
    }

    /// `bytes` more are owed by `client_id` (`None`: by the broker only).
    fn owe(&self, client_id: Option<&str>, bytes: usize) {
        if let Some(client_id) = client_id {
            let mut pending = self.pending.lock();
            let owed = match pending.get_mut(client_id) {
                Some(n) => {
                    *n += bytes;
                    *n
                }
                None => {
                    pending.insert(client_id.into(), bytes);
                    bytes
                }
            };
            if owed > self.limits.per_client && owed - bytes <= self.limits.per_client {
                self.over.fetch_add(1, Ordering::Relaxed);
            }
        }
        Counters::add(&self.stats.storage_pending_bytes, bytes as u64);
    }

    /// Sends `op`, owed already ([`Self::owe`]), to the writer.
    fn send(&self, op: Op) {
        if let Err(mpsc::error::SendError(op)) = self.tx.send(op) {
            // The writer has stopped (the broker is stopping): nothing more is stored.
            if let Some((client_id, bytes)) = op.debt() {
                self.done(client_id, bytes);
            }
        }
    }

    /// Runs `f` once every change sent so far is committed (synced, with durable_ack), with
    /// `true` when all of them are, `false` when storage does not hold some (given up, fenced,
    /// or the writer stopped): an acknowledgement must then not be sent.
    pub(crate) fn after_commit(&self, f: Callback) {
        if let Err(mpsc::error::SendError(Op::AfterCommit(f))) = self.tx.send(Op::AfterCommit(f)) {
            f(false);
        }
    }

    /// Runs `f` as [`Self::after_commit`] does, for what nobody waits on: the writer may
    /// let its batch linger for more changes, and does not sync it for `f`.
    pub(crate) fn when_settled(&self, f: Callback) {
        if let Err(mpsc::error::SendError(Op::Settled(f))) = self.tx.send(Op::Settled(f)) {
            f(false);
        }
    }

    /// `bytes` owed by `client_id` (`None`: by the broker) are stored, given up or dropped.
    pub(super) fn done(&self, client_id: Option<&str>, bytes: usize) {
        if let Some(client_id) = client_id {
            let mut pending = self.pending.lock();
            if let Some(owed) = pending.get_mut(client_id) {
                let before = *owed;
                *owed = owed.saturating_sub(bytes);
                if before > self.limits.per_client && *owed <= self.limits.per_client {
                    self.over.fetch_sub(1, Ordering::Relaxed);
                }
                if *owed == 0 {
                    pending.remove(client_id);
                }
            }
        }
        self.stats
            .storage_pending_bytes
            .fetch_sub(bytes as u64, Ordering::Relaxed);
    }

    /// Whether the connection of `client_id` must wait for storage before it reads more:
    /// its client owes more than `max_pending_bytes`, or owes anything while the broker owes
    /// more than `max_pending_bytes_total`. One atomic load or two while nobody is over.
    pub(crate) fn must_wait(&self, client_id: &str) -> bool {
        let over_total =
            self.stats.storage_pending_bytes.load(Ordering::Relaxed) as usize > self.limits.total;
        if !over_total && self.over.load(Ordering::Relaxed) == 0 {
            return false;
        }
        let own = self.pending.lock().get(client_id).copied().unwrap_or(0);
        own > self.limits.per_client || (over_total && own > 0)
    }

    /// Waits while the connection of `client_id` must wait for storage ([`Self::must_wait`]),
    /// counted in `storage/clients/waiting` meanwhile.
    pub(crate) async fn wait_room(&self, client_id: &str) {
        let mut waiting = None;
        loop {
            let notified = self.progress.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.must_wait(client_id) {
                return;
            }
            if waiting.is_none() {
                waiting = Some(Waiting::new(&self.stats));
            }
            notified.await;
        }
    }

    /// Storage has taken no write for [`UNWRITABLE_AFTER`] or more: the last error and how
    /// long. `None` while writes succeed.
    pub(crate) fn write_failure(&self) -> Option<WriteFailure> {
        self.failure
            .lock()
            .as_ref()
            .map(|(error, since)| WriteFailure {
                error: error.clone(),
                duration: since.elapsed(),
            })
    }

    /// The writer's report: storage takes no writes since `since` (`Some`), or does again.
    pub(super) fn set_write_failure(&self, failure: Option<(String, Instant)>) {
        let unwritable = u64::from(failure.is_some());
        *self.failure.lock() = failure;
        self.stats
            .storage_unwritable
            .store(unwritable, Ordering::Relaxed);
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

    /// A connection took `session` (new, or resumed when `resumed`): attach the persister and
    /// store the header and the will, or delete a stored session that is no longer kept.
    pub(crate) fn connected(self: &Arc<Self>, session: &Session, resumed: bool) {
        let p = self;
        let mut st = session.state.lock();
        st.report_changes_to(Arc::clone(p) as Arc<dyn SessionChanges>);
        let client_id = session.client_id();
        if st.expiry_interval() == 0 {
            if resumed {
                p.emit(Change::SessionDeleted {
                    client_id: client_id.to_string(),
                });
            }
            return;
        }
        if resumed {
            p.emit(Change::SessionSaved(header(client_id, &st)));
            p.emit(match st.will() {
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
            p.emit(p.session_written(client_id, &st, Vec::new()));
        }
    }

    /// Message ids from `next` on are free: the restore's seed, above every stored one.
    pub(crate) fn seed_message_ids(&self, next: u64) {
        self.next_message_id.fetch_max(next, Ordering::Relaxed);
    }

    /// The id of `msg` in the message store. The first call stores it (`MessageStored`,
    /// owed by its publisher) before returning; any other caller waits for that, so no
    /// reference to a message reaches storage before the message.
    pub(crate) fn message_id(&self, msg: &Message) -> u64 {
        msg.stored
            .get_or_init(|| {
                let id = self.next_message_id.fetch_add(1, Ordering::Relaxed);
                self.emit_paid(
                    Change::MessageStored {
                        message: StoredMessage {
                            id,
                            message: message_record(msg, msg.qos, msg.retain, &[]),
                        },
                    },
                    publisher(msg),
                );
                Stored::new(id, Arc::downgrade(&self.releaser))
            })
            .id
    }

    /// A restored message: already in the message store under `id`.
    pub(crate) fn restored_message(&self, msg: &Message, id: u64) {
        msg.stored
            .get_or_init(|| Stored::new(id, Arc::downgrade(&self.releaser)));
    }

    /// The whole session as stored (QoS 0 messages are not kept), with the messages it
    /// refers to; its queue is `backlog` (the part left in storage at the restore, read back,
    /// its messages stored) then the deliveries in memory.
    pub(crate) fn session_written(
        &self,
        client_id: &str,
        st: &SessionState,
        backlog: Vec<QueuedRecord>,
    ) -> Change {
        let (record, messages) = session_record(client_id, st, backlog, |msg| self.message_id(msg));
        Change::SessionWritten(record, messages)
    }

    /// Whether the stored session of `client_id` was set aside (its client is refused).
    pub(crate) fn is_set_aside(&self, client_id: &str) -> bool {
        self.set_aside.lock().contains(client_id)
    }

    /// Sets the stored session of `client_id` aside: it could not be read, and its client is
    /// refused until it is deleted. Returns how many are set aside now.
    pub(crate) fn set_aside_client(&self, client_id: String) -> usize {
        let mut set_aside = self.set_aside.lock();
        set_aside.insert(client_id);
        set_aside.len()
    }

    /// The storage backend, for reads made after the restore (a session's backlog).
    pub(crate) fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// The storage backend's name, for logs.
    pub(crate) fn storage_name(&self) -> &'static str {
        self.storage.name()
    }

    /// The number of sessions set aside now.
    pub(crate) fn set_aside_count(&self) -> usize {
        self.set_aside.lock().len()
    }
}

/// One connection waiting for storage, counted in `storage_clients_waiting` while it lives
/// (a waiting reader can be cancelled when its connection closes).
struct Waiting<'a>(&'a Counters);

impl<'a> Waiting<'a> {
    fn new(stats: &'a Counters) -> Waiting<'a> {
        Counters::add(&stats.storage_clients_waiting, 1);
        Waiting(stats)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0
            .storage_clients_waiting
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Retained-set changes, emitted under the retained store's lock.
impl Persister {
    /// Owed by the message's publisher. `listener_port`: the port of the publisher's listener
    /// when `msg` keeps its source (`check_retain_source`).
    pub(crate) fn retained_set(&self, msg: &Message, listener_port: Option<u16>) {
        let mut record = RetainedRecord::new(message_record(msg, msg.qos, true, &[]));
        if let Some(source) = &msg.source {
            record.publisher_username = source.username.as_deref().map(str::to_string);
            record.publisher_listener = listener_port;
        }
        self.emit_paid(Change::RetainedSet(record), publisher(msg));
    }

    pub(crate) fn retained_deleted(&self, topic: &str) {
        self.emit(Change::RetainedDeleted {
            topic: topic.to_string(),
        });
    }
}

/// Streams' changes, emitted under the stream's log lock (in the order of its log).
impl Persister {
    /// An entry appended to the stream whose buffer is `appends`, called under the stream's
    /// log lock (so in the log's order): the shared message waits in the buffer, owed by its
    /// publisher ([`append_cost`]), and the writer takes the whole buffer once per batch into
    /// one [`Change::StreamSegment`], each message stored with its entry under an id of its
    /// own. No change, no message id and no release per message: the stream's copy of a
    /// message is not the one sessions refer to (a message also queued for a stored session
    /// is stored a second time for it).
    ///
    /// The first append to an empty buffer sends the writer a notice, in order with the other
    /// ops: an acknowledgement the publisher sends after this call (`durable_ack`) follows
    /// the notice, so the commit it waits for holds the entry.
    pub(crate) fn stream_append(
        &self,
        appends: &Arc<AppendBuffer>,
        offset: u64,
        time_ms: u64,
        msg: &Arc<Message>,
    ) {
        self.owe(msg.publisher.as_deref(), append_cost(msg));
        let first = {
            let mut pending = appends.pending.lock();
            pending.push(PendingAppend {
                offset,
                time_ms,
                msg: Arc::clone(msg),
            });
            pending.len() == 1
        };
        if first {
            if let Err(mpsc::error::SendError(_)) = self.tx.send(Op::Appends(Arc::clone(appends))) {
                // The writer has stopped (the broker is stopping): nothing more is stored.
                for a in appends.take() {
                    self.done(a.msg.publisher.as_deref(), append_cost(&a.msg));
                }
            }
        }
    }

    /// Retention removed the entries below `below`.
    pub(crate) fn stream_trimmed(&self, stream: &str, below: u64) {
        self.emit_paid(
            Change::StreamTrimmed {
                stream: stream.to_string(),
                below,
            },
            Payer::Broker,
        );
    }

    /// A `last_value` stream's older entry of a topic removed.
    pub(crate) fn stream_entry_removed(&self, stream: &str, offset: u64) {
        self.emit_paid(
            Change::StreamEntryRemoved {
                stream: stream.to_string(),
                offset,
            },
            Payer::Broker,
        );
    }

    /// A stream created at run time: its definition, stored.
    pub(crate) fn stream_defined(&self, config: &crate::config::StreamConfig) {
        self.emit_paid(
            Change::StreamDefined {
                stream: config.name.clone(),
                definition: mercurio_storage::StreamDefinition {
                    filter: config.filter.clone(),
                    max_age: config.max_age,
                    max_bytes: config.max_bytes,
                    last_value: config.last_value,
                },
            },
            Payer::Broker,
        );
    }

    /// A stored stream no longer configured (or deleted at run time): deleted with its
    /// entries.
    pub(crate) fn stream_deleted(&self, stream: &str) {
        self.emit_paid(
            Change::StreamDeleted {
                stream: stream.to_string(),
            },
            Payer::Broker,
        );
    }
}

/// A stored message dropped by the broker: storage deletes it with its last reference.
impl ReleaseStored for Weak<Persister> {
    fn release(&self, id: u64) {
        if let Some(p) = self.upgrade() {
            // Unboxed: a stream releases each message as it leaves memory.
            p.owe(None, CHANGE_OVERHEAD);
            p.send(Op::Released(id));
        }
    }
}

/// The session changes, as storage changes.
impl SessionChanges for Persister {
    /// Owed by the message's publisher, not by the (often offline) session it waits in: the
    /// message once (its first delivery to a stored session stores it), then a reference
    /// per delivery, which costs what it holds while it waits ([`CHANGE_OVERHEAD`], its
    /// subscription identifiers and shared subscription), not a copy of the message.
    fn queued(&self, client_id: &Arc<str>, q: &Delivery) {
        let message_id = self.message_id(&q.msg);
        let extra = (!q.subscription_ids.is_empty() || q.share.is_some()).then(|| {
            Box::new((
                q.subscription_ids.clone(),
                q.share.as_deref().map(str::to_string),
            ))
        });
        let bytes = CHANGE_OVERHEAD
            + extra.as_ref().map_or(0, |e| {
                std::mem::size_of_val(&**e) + 4 * e.0.len() + e.1.as_ref().map_or(0, String::len)
            });
        let payer = q.msg.publisher.clone();
        self.owe(payer.as_deref(), bytes);
        self.send(Op::Queued(QueuedOp {
            client_id: Arc::clone(client_id),
            seq: q.seq,
            message_id,
            qos: q.qos as u8,
            retain: q.retain,
            extra,
            payer,
            bytes,
        }));
    }

    fn dequeued(&self, client_id: &str, seq: u64) {
        self.emit(Change::MessageDequeued {
            client_id: client_id.to_string(),
            seq,
        });
    }

    fn inflight_set(&self, client_id: &str, f: &Inflight) {
        let id = self.message_id(&f.delivery.msg);
        self.emit(Change::InflightSet {
            client_id: client_id.to_string(),
            inflight: inflight_record(id, f),
        });
    }

    fn inflight_removed(&self, client_id: &str, packet_id: u16) {
        self.emit(Change::InflightRemoved {
            client_id: client_id.to_string(),
            packet_id,
        });
    }

    fn inbound_qos2(&self, client_id: &str, packet_id: u16, added: bool) {
        let client_id = client_id.to_string();
        self.emit(if added {
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

    fn subscription(&self, client_id: &str, filter: &str, granted: Option<&Granted>) {
        let client_id = client_id.to_string();
        self.emit(match granted {
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

    fn will_cleared(&self, client_id: &str) {
        self.emit(Change::WillCleared {
            client_id: client_id.to_string(),
        });
    }

    fn detached(&self, client_id: &str, st: &SessionState) {
        self.emit(Change::SessionSaved(header(client_id, st)));
        if st.will().is_none() {
            self.will_cleared(client_id);
        }
    }

    fn ended(&self, client_id: &str) {
        self.emit(Change::SessionDeleted {
            client_id: client_id.to_string(),
        });
    }
}

/// A message a stream took, waiting in its [`AppendBuffer`] for the writer: the shared
/// message, not a copy.
pub(crate) struct PendingAppend {
    /// Its offset in the stream.
    pub(crate) offset: u64,
    /// Its append time, milliseconds since the Unix epoch.
    pub(crate) time_ms: u64,
    pub(crate) msg: Arc<Message>,
}

/// What an append owes until it is stored: the message's bytes and what its entry holds
/// while it waits (in the buffer, then in the writer's segment).
pub(crate) fn append_cost(msg: &Message) -> usize {
    msg.size()
        + std::mem::size_of::<PendingAppend>()
        + std::mem::size_of::<mercurio_storage::StreamAppend>()
}

/// One stream's appends waiting for the writer ([`Persister::stream_append`]), owned by the
/// stream and taken whole by the writer once per batch.
pub(crate) struct AppendBuffer {
    /// The stream's name.
    stream: Arc<str>,
    /// Lock: a leaf, taken under the stream's log lock (an append) or alone (the writer).
    pending: Mutex<Vec<PendingAppend>>,
}

impl std::fmt::Debug for AppendBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppendBuffer")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl AppendBuffer {
    /// An empty buffer for the stream named `stream`.
    pub(crate) fn new(stream: &str) -> Arc<AppendBuffer> {
        Arc::new(AppendBuffer {
            stream: Arc::from(stream),
            pending: Mutex::new(Vec::new()),
        })
    }

    /// The stream's name.
    pub(super) fn stream(&self) -> &str {
        &self.stream
    }

    /// Every append waiting, in offset order; the next append sends a notice again.
    pub(super) fn take(&self) -> Vec<PendingAppend> {
        std::mem::take(&mut *self.pending.lock())
    }
}

/// Who owes the changes that store `msg`: its publisher, or the broker for an in-process
/// publish.
fn publisher(msg: &Message) -> Payer {
    match &msg.publisher {
        Some(p) => Payer::Client(Arc::clone(p)),
        None => Payer::Broker,
    }
}
