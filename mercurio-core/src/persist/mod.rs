//! Persistence: what the broker emits to storage ([`Persister`]), the background writer that
//! applies it ([`writer`]), and the conversion between sessions and stored records
//! ([`records`]). The restore at start is the broker's (`broker::restore`).
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

pub(crate) mod records;
mod writer;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use mercurio_storage::{Change, RetainedRecord, Storage, StorageError};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, Notify};

use records::{
    header, inflight_record, message_record, queued_record, session_record, subscription_record,
    will_record,
};
use writer::{BatchWriter, Callback, Op};

use crate::message::Message;
use crate::session::{
    Delivery, Granted, Inflight, Session, SessionChanges, SessionState, SessionTable,
};
use crate::stats::Stats;

/// A client with more changes than this not yet stored waits for storage before its
/// connection reads more (docs/operations.md, "Persistence").
pub const MAX_PENDING_PER_CLIENT: usize = 10_000;
/// Every connection waits while the broker has more changes than this not yet stored.
pub const MAX_PENDING_TOTAL: usize = 100_000;

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

impl Persister {
    /// Starts the writer task for `storage`.
    pub(crate) fn start(
        storage: Arc<dyn Storage>,
        durable_ack: bool,
        stats: Arc<Stats>,
        sessions: Weak<SessionTable>,
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
        let writer = BatchWriter {
            persister: Arc::clone(&persister),
            stats,
            sessions,
            dirty: HashSet::new(),
            rx,
            fenced: false,
            lost: false,
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

    /// Runs `f` once every change sent so far is committed (synced, with durable_ack), with
    /// `true` when all of them are, `false` when storage does not hold some (given up, fenced,
    /// or the writer stopped): an acknowledgement must then not be sent.
    pub(crate) fn after_commit(&self, f: Callback) {
        if let Err(mpsc::error::SendError(Op::AfterCommit(f))) = self.tx.send(Op::AfterCommit(f)) {
            f(false);
        }
    }

    pub(super) fn done(&self, client_id: Option<&str>, n: usize) {
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

    /// A connection took `session` (new, or resumed when `resumed`): attach the persister and
    /// store the header and the will, or delete a stored session that is no longer kept.
    pub(crate) fn connected(self: &Arc<Self>, session: &Session, resumed: bool) {
        let p = self;
        let mut st = session.state.lock();
        if st.changes.is_none() {
            st.changes = Some(Arc::clone(p) as Arc<dyn SessionChanges>);
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

    /// The storage backend's name, for logs.
    pub(crate) fn storage_name(&self) -> &'static str {
        self.storage.name()
    }

    /// The number of sessions set aside now.
    pub(crate) fn set_aside_count(&self) -> usize {
        self.set_aside.lock().len()
    }
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

/// The session changes, as storage changes.
impl SessionChanges for Persister {
    fn queued(&self, client_id: &str, q: &Delivery) {
        self.emit(Change::MessageQueued {
            client_id: client_id.to_string(),
            seq: q.seq,
            message: queued_record(q),
        });
    }

    fn dequeued(&self, client_id: &str, seq: u64) {
        self.emit(Change::MessageDequeued {
            client_id: client_id.to_string(),
            seq,
        });
    }

    fn inflight_set(&self, client_id: &str, f: &Inflight) {
        self.emit(Change::InflightSet {
            client_id: client_id.to_string(),
            inflight: inflight_record(f),
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
        if st.will.is_none() {
            self.will_cleared(client_id);
        }
    }

    fn ended(&self, client_id: &str) {
        self.emit(Change::SessionDeleted {
            client_id: client_id.to_string(),
        });
    }
}
