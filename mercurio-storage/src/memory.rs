//! [`MemoryStorage`]: the default backend, which keeps everything in memory (lost when the
//! process ends), and the reference semantics every other backend must match.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::change::{refused, validate_batch, Change};
use crate::error::{ErrorKind, StorageError};
use crate::records::{
    InflightRecord, MessageRecord, QueuedRecord, RetainedRecord, SessionHeader, SessionRecord,
    SubscriptionRecord, WillRecord,
};
use crate::{LoadedState, SetAside, Storage};

/// Storage in memory.
///
/// Clones share the same data, so a test can stop a broker and start another one on a clone
/// to see what a restarted broker would load. For tests it also offers failure injection
/// ([`fail_next`](Self::fail_next)), unreadable sessions ([`set_aside`](Self::set_aside)) and a
/// way to wait for a state ([`wait_until`](Self::wait_until)).
#[derive(Clone, Default)]
pub struct MemoryStorage {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    applied: Notify,
}

#[derive(Default)]
struct State {
    sessions: BTreeMap<String, StoredSession>,
    retained: BTreeMap<String, RetainedRecord>,
    /// Clients whose session is reported as unreadable, with the cause.
    set_aside: BTreeMap<String, String>,
    /// Failures to return from the next calls to `apply`, oldest first.
    failures: VecDeque<ErrorKind>,
    /// Fail every call to `apply` with this until cleared.
    failing: Option<ErrorKind>,
    /// Batches applied successfully.
    applied_batches: u64,
}

struct StoredSession {
    header: SessionHeader,
    subscriptions: BTreeMap<String, SubscriptionRecord>,
    will: Option<WillRecord>,
    queued: BTreeMap<u64, MessageRecord>,
    /// In the order their packet identifier was first set.
    inflight: Vec<InflightRecord>,
    inbound_qos2: BTreeSet<u16>,
}

impl StoredSession {
    fn new(header: SessionHeader) -> StoredSession {
        StoredSession {
            header,
            subscriptions: BTreeMap::new(),
            will: None,
            queued: BTreeMap::new(),
            inflight: Vec::new(),
            inbound_qos2: BTreeSet::new(),
        }
    }

    fn from_record(record: &SessionRecord) -> StoredSession {
        let mut stored = StoredSession::new(record.header());
        for subscription in &record.subscriptions {
            stored
                .subscriptions
                .insert(subscription.filter.clone(), subscription.clone());
        }
        stored.will = record.will.clone();
        for queued in &record.queued {
            stored.queued.insert(queued.seq, queued.message.clone());
        }
        stored.inflight = record.inflight.clone();
        stored.inbound_qos2 = record.inbound_qos2.iter().copied().collect();
        stored
    }

    fn to_record(&self) -> SessionRecord {
        let mut record = SessionRecord::new(self.header.clone());
        record.subscriptions = self.subscriptions.values().cloned().collect();
        record.will = self.will.clone();
        record.queued = self
            .queued
            .iter()
            .map(|(seq, message)| QueuedRecord {
                seq: *seq,
                message: message.clone(),
            })
            .collect();
        record.inflight = self.inflight.clone();
        record.inbound_qos2 = self.inbound_qos2.iter().copied().collect();
        record
    }
}

impl State {
    fn snapshot(&self) -> LoadedState {
        LoadedState {
            sessions: self
                .sessions
                .iter()
                .filter(|(client_id, _)| !self.set_aside.contains_key(*client_id))
                .map(|(_, stored)| stored.to_record())
                .collect(),
            retained: self.retained.values().cloned().collect(),
            set_aside: self
                .set_aside
                .iter()
                .map(|(client_id, cause)| SetAside {
                    client_id: client_id.clone(),
                    cause: cause.clone(),
                })
                .collect(),
        }
    }

    /// Check the whole batch before applying any of it, so that applying cannot fail.
    fn validate(&self, batch: &[Change]) -> Result<(), StorageError> {
        validate_batch(batch)?;
        // Whether each client touched so far in the batch has a session after its changes.
        let mut exists: HashMap<&str, bool> = HashMap::new();
        for (index, change) in batch.iter().enumerate() {
            let Some(client_id) = change.client_id() else {
                continue;
            };
            let stored = *exists
                .entry(client_id)
                .or_insert_with(|| self.sessions.contains_key(client_id));
            match change {
                Change::SessionSaved(_) | Change::SessionWritten(_) => {
                    exists.insert(client_id, true);
                }
                Change::SessionDeleted { .. } => {
                    exists.insert(client_id, false);
                }
                Change::SubscriptionAdded { .. }
                | Change::WillSet { .. }
                | Change::MessageQueued { .. }
                | Change::InflightSet { .. }
                | Change::InboundQos2Added { .. }
                    if !stored =>
                {
                    return Err(refused(
                        index,
                        change,
                        "no session is stored for the client",
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Apply one validated change.
    fn apply(&mut self, change: &Change) {
        match change {
            Change::SessionSaved(header) => match self.sessions.get_mut(&header.client_id) {
                Some(stored) => stored.header = header.clone(),
                None => {
                    self.sessions
                        .insert(header.client_id.clone(), StoredSession::new(header.clone()));
                }
            },
            Change::SessionWritten(record) => {
                self.sessions
                    .insert(record.client_id.clone(), StoredSession::from_record(record));
            }
            Change::SessionDeleted { client_id } => {
                self.sessions.remove(client_id);
            }
            Change::SubscriptionAdded {
                client_id,
                subscription,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored
                        .subscriptions
                        .insert(subscription.filter.clone(), subscription.clone());
                }
            }
            Change::SubscriptionRemoved { client_id, filter } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.subscriptions.remove(filter);
                }
            }
            Change::WillSet { client_id, will } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.will = Some(will.clone());
                }
            }
            Change::WillCleared { client_id } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.will = None;
                }
            }
            Change::MessageQueued {
                client_id,
                seq,
                message,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.queued.insert(*seq, message.clone());
                }
            }
            Change::MessageDequeued { client_id, seq } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.queued.remove(seq);
                }
            }
            Change::InflightSet {
                client_id,
                inflight,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    match stored
                        .inflight
                        .iter_mut()
                        .find(|existing| existing.packet_id == inflight.packet_id)
                    {
                        Some(existing) => *existing = inflight.clone(),
                        None => stored.inflight.push(inflight.clone()),
                    }
                }
            }
            Change::InflightRemoved {
                client_id,
                packet_id,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored
                        .inflight
                        .retain(|existing| existing.packet_id != *packet_id);
                }
            }
            Change::InboundQos2Added {
                client_id,
                packet_id,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.inbound_qos2.insert(*packet_id);
                }
            }
            Change::InboundQos2Removed {
                client_id,
                packet_id,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.inbound_qos2.remove(packet_id);
                }
            }
            Change::RetainedSet(record) => {
                self.retained
                    .insert(record.message.topic.clone(), record.clone());
            }
            Change::RetainedDeleted { topic } => {
                self.retained.remove(topic);
            }
        }
    }
}

impl MemoryStorage {
    /// An empty storage.
    pub fn new() -> MemoryStorage {
        MemoryStorage::default()
    }

    /// What [`load`](Storage::load) would return now, without waiting.
    pub fn snapshot(&self) -> LoadedState {
        self.shared.state.lock().snapshot()
    }

    /// How many non-empty batches were applied successfully so far.
    pub fn applied_batches(&self) -> u64 {
        self.shared.state.lock().applied_batches
    }

    /// Make the next `times` non-empty calls to [`apply`](Storage::apply) fail with `kind`,
    /// applying nothing (after the failures already planned). For tests of the writer's retry
    /// and give-up behaviour.
    pub fn fail_next(&self, kind: ErrorKind, times: u32) {
        let mut state = self.shared.state.lock();
        for _ in 0..times {
            state.failures.push_back(kind);
        }
    }

    /// Make every call to [`apply`](Storage::apply) fail with `kind`, applying nothing, until
    /// [`stop_failing`](Self::stop_failing): storage that takes no writes (a full disk).
    pub fn fail_always(&self, kind: ErrorKind) {
        self.shared.state.lock().failing = Some(kind);
    }

    /// Ends [`fail_always`](Self::fail_always) and drops the failures planned by
    /// [`fail_next`](Self::fail_next): `apply` works again.
    pub fn stop_failing(&self) {
        let mut state = self.shared.state.lock();
        state.failing = None;
        state.failures.clear();
    }

    /// Report `client_id`'s session as unreadable from now on: [`load`](Storage::load) lists
    /// it in [`LoadedState::set_aside`] with `cause` (its data, if any, is kept) until
    /// [`delete_session`](Storage::delete_session) removes it. For tests of set-aside sessions.
    pub fn set_aside(&self, client_id: impl Into<String>, cause: impl Into<String>) {
        self.shared
            .state
            .lock()
            .set_aside
            .insert(client_id.into(), cause.into());
    }

    /// Wait until `condition` holds for the current [`snapshot`](Self::snapshot), checking
    /// again after every applied batch. Wrap it in a timeout: it waits forever otherwise.
    pub async fn wait_until<F>(&self, mut condition: F)
    where
        F: FnMut(&LoadedState) -> bool,
    {
        loop {
            let notified = self.shared.applied.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if condition(&self.snapshot()) {
                return;
            }
            notified.await;
        }
    }
}

impl std::fmt::Debug for MemoryStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.state.lock();
        f.debug_struct("MemoryStorage")
            .field("sessions", &state.sessions.len())
            .field("retained", &state.retained.len())
            .field("set_aside", &state.set_aside.len())
            .finish()
    }
}

#[async_trait]
impl Storage for MemoryStorage {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn load(&self) -> Result<LoadedState, StorageError> {
        Ok(self.snapshot())
    }

    async fn apply(&self, batch: &[Change]) -> Result<(), StorageError> {
        if batch.is_empty() {
            return Ok(());
        }
        {
            let mut state = self.shared.state.lock();
            if let Some(kind) = state.failing.or_else(|| state.failures.pop_front()) {
                return Err(StorageError::new(kind, "injected failure"));
            }
            state.validate(batch)?;
            for change in batch {
                state.apply(change);
            }
            state.applied_batches += 1;
        }
        self.shared.applied.notify_waiters();
        Ok(())
    }

    async fn delete_session(&self, client_id: &str) -> Result<bool, StorageError> {
        let deleted = {
            let mut state = self.shared.state.lock();
            let session = state.sessions.remove(client_id).is_some();
            let set_aside = state.set_aside.remove(client_id).is_some();
            session || set_aside
        };
        self.shared.applied.notify_waiters();
        Ok(deleted)
    }

    async fn flush(&self) -> Result<(), StorageError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;

    use super::MemoryStorage;
    use crate::conformance::{self, Harness};

    /// The memory backend under the conformance checks.
    struct MemoryHarness;

    #[async_trait]
    impl Harness for MemoryHarness {
        type Storage = MemoryStorage;

        async fn fresh(&mut self) -> MemoryStorage {
            MemoryStorage::new()
        }

        async fn reopen(&mut self, storage: MemoryStorage) -> MemoryStorage {
            // A restarted broker on the same MemoryStorage: a clone shares the data.
            let reopened = storage.clone();
            drop(storage);
            reopened
        }

        async fn make_unreadable(&mut self, storage: &MemoryStorage, client_id: &str) -> bool {
            storage.set_aside(client_id, "damaged for the test");
            true
        }
    }

    #[tokio::test]
    async fn memory_conforms() {
        conformance::run_all(&mut MemoryHarness).await;
    }
}
