//! [`MemoryStorage`]: the default backend, which keeps everything in memory (lost when the
//! process ends), and the reference semantics every other backend must match.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::access::{validate_access, AccessChange, AccessKind, AccessRecord};
use crate::change::{refused, validate_batch, Change};
use crate::error::{ErrorKind, StorageError};
use crate::records::{
    DeliveryRecord, InflightRecord, MessageRecord, QueuedRecord, RetainedRecord, SessionHeader,
    SessionRecord, StoredMessage, StreamDefinition, StreamEntryRead, StreamEntryRecord,
    StreamRecord, SubscriptionRecord, WillRecord,
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
    /// The message store: each message once, with how many deliveries refer to it.
    messages: BTreeMap<u64, Stored>,
    retained: BTreeMap<String, RetainedRecord>,
    /// The access records, by kind and name.
    access: BTreeMap<(AccessKind, String), String>,
    /// The streams: each one's next offset and its entries by offset.
    streams: BTreeMap<String, MemStream>,
    /// Clients whose session is reported as unreadable, with the cause.
    set_aside: BTreeMap<String, String>,
    /// Failures to return from the next calls to `apply`, oldest first.
    failures: VecDeque<ErrorKind>,
    /// Fail every call to `apply` with this until cleared.
    failing: Option<ErrorKind>,
    /// Batches applied successfully.
    applied_batches: u64,
}

/// A stored message and what keeps it.
struct Stored {
    message: MessageRecord,
    /// Queued and in-flight deliveries, and stream entries, that refer to it.
    references: usize,
    /// The broker released it: it goes with its last reference.
    released: bool,
}

/// A stream: where its offsets go on, and its entries.
#[derive(Default)]
struct MemStream {
    next_offset: u64,
    entries: BTreeMap<u64, StreamEntryRecord>,
    definition: Option<StreamDefinition>,
}

struct StoredSession {
    header: SessionHeader,
    subscriptions: BTreeMap<String, SubscriptionRecord>,
    will: Option<WillRecord>,
    queued: BTreeMap<u64, DeliveryRecord>,
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
            stored.queued.insert(queued.seq, queued.delivery.clone());
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
            .map(|(seq, delivery)| QueuedRecord {
                seq: *seq,
                delivery: delivery.clone(),
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
            messages: {
                let streamed = self.stream_only();
                self.messages
                    .iter()
                    .filter(|(id, _)| !streamed.contains(*id))
                    .map(|(id, stored)| StoredMessage {
                        id: *id,
                        message: stored.message.clone(),
                    })
                    .collect()
            },
            max_message_id: self.messages.keys().next_back().copied().unwrap_or(0),
            set_aside: self
                .set_aside
                .iter()
                .map(|(client_id, cause)| SetAside {
                    client_id: client_id.clone(),
                    cause: cause.clone(),
                })
                .collect(),
            streams: self
                .streams
                .iter()
                .map(|(name, s)| {
                    let held: Vec<&StreamEntryRecord> = s
                        .entries
                        .values()
                        .filter(|e| self.messages.contains_key(&e.message_id))
                        .collect();
                    StreamRecord {
                        name: name.clone(),
                        next_offset: s.next_offset,
                        first_offset: held.first().map_or(s.next_offset, |e| e.offset),
                        first_time_ms: held.first().map_or(0, |e| e.time_ms),
                        messages: held.len() as u64,
                        bytes: held
                            .iter()
                            .filter_map(|e| self.messages.get(&e.message_id))
                            .map(|m| m.message.size())
                            .sum(),
                        definition: s.definition.clone(),
                    }
                })
                .collect(),
            backlogs: HashMap::new(),
        }
    }

    /// Check the whole batch before applying any of it, so that applying cannot fail.
    fn validate(&self, batch: &[Change]) -> Result<(), StorageError> {
        validate_batch(batch)?;
        // Whether each client touched so far in the batch has a session after its changes.
        let mut exists: HashMap<&str, bool> = HashMap::new();
        // Messages stored by the batch before the change at hand.
        let mut stored_now: HashSet<u64> = HashSet::new();
        let is_stored = |stored_now: &HashSet<u64>, id: u64| {
            stored_now.contains(&id) || self.messages.contains_key(&id)
        };
        for (index, change) in batch.iter().enumerate() {
            let missing = match change {
                Change::MessageStored { message } => {
                    stored_now.insert(message.id);
                    None
                }
                Change::SessionWritten(record, messages) => {
                    stored_now.extend(messages.iter().map(|m| m.id));
                    record
                        .queued
                        .iter()
                        .map(|q| &q.delivery)
                        .chain(record.inflight.iter().map(|f| &f.delivery))
                        .find(|d| !is_stored(&stored_now, d.message_id))
                }
                Change::MessageQueued { delivery, .. } => {
                    Some(delivery).filter(|d| !is_stored(&stored_now, d.message_id))
                }
                Change::InflightSet { inflight, .. } => {
                    Some(&inflight.delivery).filter(|d| !is_stored(&stored_now, d.message_id))
                }
                _ => None,
            };
            if let Some(d) = missing {
                return Err(refused(
                    index,
                    change,
                    &format!("message {} is not stored", d.message_id),
                ));
            }
            if let Change::StreamAppended { entry, .. } = change {
                if !is_stored(&stored_now, entry.message_id) {
                    return Err(refused(
                        index,
                        change,
                        &format!("message {} is not stored", entry.message_id),
                    ));
                }
            }
            let Some(client_id) = change.client_id() else {
                continue;
            };
            let stored = *exists
                .entry(client_id)
                .or_insert_with(|| self.sessions.contains_key(client_id));
            match change {
                Change::SessionSaved(_) | Change::SessionWritten(..) => {
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

    /// One more delivery refers to message `id`.
    fn refer(&mut self, id: u64) {
        if let Some(stored) = self.messages.get_mut(&id) {
            stored.references += 1;
        }
    }

    /// `entry` appended to `stream`, replacing one at its offset.
    fn append(&mut self, stream: &str, entry: &StreamEntryRecord) {
        let s = self.streams.entry(stream.to_string()).or_default();
        s.next_offset = s.next_offset.max(entry.offset + 1);
        let replaced = s.entries.insert(entry.offset, *entry);
        self.refer(entry.message_id);
        if let Some(old) = replaced {
            self.unrefer(old.message_id);
        }
    }

    /// A delivery of message `id` went: the message goes too if it was the last one and the
    /// broker released it.
    fn unrefer(&mut self, id: u64) {
        if let Some(stored) = self.messages.get_mut(&id) {
            stored.references = stored.references.saturating_sub(1);
            if stored.references == 0 && stored.released {
                self.messages.remove(&id);
            }
        }
    }

    fn store(&mut self, message: &StoredMessage) {
        self.messages.entry(message.id).or_insert_with(|| Stored {
            message: message.message.clone(),
            references: 0,
            released: false,
        });
    }

    /// Removes the session of `client_id` and its references. Whether there was one.
    fn remove_session(&mut self, client_id: &str) -> bool {
        let Some(stored) = self.sessions.remove(client_id) else {
            return false;
        };
        for d in stored.queued.values() {
            self.unrefer(d.message_id);
        }
        for f in &stored.inflight {
            self.unrefer(f.delivery.message_id);
        }
        true
    }

    /// A new broker loads the storage: messages nothing refers to go, and every other one is
    /// held by it (not released).
    fn start_broker(&mut self) {
        self.messages.retain(|_, stored| stored.references > 0);
        let streamed = self.stream_only();
        for (id, stored) in self.messages.iter_mut() {
            // The broker holds what it loads; a message only streams refer to is read back
            // with them, never held.
            stored.released = streamed.contains(id);
        }
    }

    /// The messages only stream entries refer to.
    fn stream_only(&self) -> HashSet<u64> {
        let mut entries: HashMap<u64, usize> = HashMap::new();
        for s in self.streams.values() {
            for e in s.entries.values() {
                *entries.entry(e.message_id).or_default() += 1;
            }
        }
        entries
            .into_iter()
            .filter(|(id, n)| {
                self.messages
                    .get(id)
                    .is_some_and(|stored| stored.references <= *n)
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// Up to `max` entries of `stream` from `from_offset` on, appended at `from_time_ms` or
    /// later, with their messages, stopping after the one that brings them to `max_bytes`.
    fn read_stream(
        &self,
        stream: &str,
        from_offset: u64,
        from_time_ms: u64,
        max: usize,
        max_bytes: u64,
    ) -> Vec<StreamEntryRead> {
        let Some(s) = self.streams.get(stream) else {
            return Vec::new();
        };
        let mut bytes = 0u64;
        s.entries
            .range(from_offset..)
            .map(|(_, e)| e)
            .filter(|e| e.time_ms >= from_time_ms)
            .filter_map(|e| {
                self.messages.get(&e.message_id).map(|m| StreamEntryRead {
                    entry: *e,
                    message: m.message.clone(),
                })
            })
            .take(max)
            .take_while(|read| {
                let under = bytes < max_bytes;
                bytes = bytes.saturating_add(read.message.size());
                under
            })
            .collect()
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
            Change::SessionWritten(record, messages) => {
                for m in messages {
                    self.store(m);
                }
                let stored = StoredSession::from_record(record);
                for d in stored.queued.values() {
                    self.refer(d.message_id);
                }
                for f in &stored.inflight {
                    self.refer(f.delivery.message_id);
                }
                self.remove_session(&record.client_id);
                self.sessions.insert(record.client_id.clone(), stored);
            }
            Change::SessionDeleted { client_id } => {
                self.remove_session(client_id);
            }
            Change::MessageStored { message } => self.store(message),
            Change::MessageReleased { id } => {
                if let Some(stored) = self.messages.get_mut(id) {
                    stored.released = true;
                    if stored.references == 0 {
                        self.messages.remove(id);
                    }
                }
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
                delivery,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    let replaced = stored.queued.insert(*seq, delivery.clone());
                    self.refer(delivery.message_id);
                    if let Some(old) = replaced {
                        self.unrefer(old.message_id);
                    }
                }
            }
            Change::MessageDequeued { client_id, seq } => {
                if let Some(old) = self
                    .sessions
                    .get_mut(client_id)
                    .and_then(|stored| stored.queued.remove(seq))
                {
                    self.unrefer(old.message_id);
                }
            }
            Change::InflightSet {
                client_id,
                inflight,
            } => {
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    let replaced = match stored
                        .inflight
                        .iter_mut()
                        .find(|existing| existing.packet_id == inflight.packet_id)
                    {
                        Some(existing) => Some(std::mem::replace(existing, inflight.clone())),
                        None => {
                            stored.inflight.push(inflight.clone());
                            None
                        }
                    };
                    self.refer(inflight.delivery.message_id);
                    if let Some(old) = replaced {
                        self.unrefer(old.delivery.message_id);
                    }
                }
            }
            Change::InflightRemoved {
                client_id,
                packet_id,
            } => {
                let mut removed = Vec::new();
                if let Some(stored) = self.sessions.get_mut(client_id) {
                    stored.inflight.retain(|existing| {
                        let keep = existing.packet_id != *packet_id;
                        if !keep {
                            removed.push(existing.delivery.message_id);
                        }
                        keep
                    });
                }
                for id in removed {
                    self.unrefer(id);
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
            Change::StreamDefined { stream, definition } => {
                self.streams.entry(stream.clone()).or_default().definition =
                    Some(definition.clone());
            }
            Change::StreamAppended { stream, entry } => self.append(stream, entry),
            Change::StreamSegment { stream, entries } => {
                for a in entries {
                    // Released at once: the entry is its only reference.
                    self.messages
                        .entry(a.entry.message_id)
                        .or_insert_with(|| Stored {
                            message: a.message.clone(),
                            references: 0,
                            released: true,
                        });
                    self.append(stream, &a.entry);
                }
            }
            Change::StreamTrimmed { stream, below } => {
                let mut removed = Vec::new();
                if let Some(s) = self.streams.get_mut(stream) {
                    s.next_offset = s.next_offset.max(*below);
                    let kept = s.entries.split_off(below);
                    removed.extend(s.entries.values().map(|e| e.message_id));
                    s.entries = kept;
                }
                for id in removed {
                    self.unrefer(id);
                }
            }
            Change::StreamEntryRemoved { stream, offset } => {
                if let Some(old) = self
                    .streams
                    .get_mut(stream)
                    .and_then(|s| s.entries.remove(offset))
                {
                    self.unrefer(old.message_id);
                }
            }
            Change::StreamDeleted { stream } => {
                if let Some(s) = self.streams.remove(stream) {
                    for e in s.entries.values() {
                        self.unrefer(e.message_id);
                    }
                }
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
        let mut state = self.shared.state.lock();
        state.start_broker();
        Ok(state.snapshot())
    }

    async fn read_stream(
        &self,
        stream: &str,
        from_offset: u64,
        from_time_ms: u64,
        max: usize,
        max_bytes: u64,
    ) -> Result<Vec<StreamEntryRead>, StorageError> {
        Ok(self
            .shared
            .state
            .lock()
            .read_stream(stream, from_offset, from_time_ms, max, max_bytes))
    }

    async fn load_without_queues(&self) -> Result<LoadedState, StorageError> {
        let mut loaded = self.load().await?;
        for session in &mut loaded.sessions {
            let queued = std::mem::take(&mut session.queued);
            if let (Some(first), Some(last)) = (queued.first(), queued.last()) {
                loaded.backlogs.insert(
                    session.client_id.clone(),
                    crate::Backlog {
                        len: queued.len() as u64,
                        first_seq: first.seq,
                        last_seq: last.seq,
                    },
                );
            }
        }
        Ok(loaded)
    }

    async fn load_queue(&self, client_id: &str) -> Result<Vec<QueuedRecord>, StorageError> {
        let state = self.shared.state.lock();
        if state.set_aside.contains_key(client_id) {
            return Err(StorageError::refused(format!(
                "the queue of {client_id} cannot be read"
            )));
        }
        Ok(state
            .sessions
            .get(client_id)
            .map(|s| s.to_record().queued)
            .unwrap_or_default())
    }

    async fn load_messages(&self, ids: &[u64]) -> Result<Vec<StoredMessage>, StorageError> {
        let state = self.shared.state.lock();
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        Ok(ids
            .into_iter()
            .filter_map(|id| {
                state.messages.get(&id).map(|stored| StoredMessage {
                    id,
                    message: stored.message.clone(),
                })
            })
            .collect())
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
            let session = state.remove_session(client_id);
            let set_aside = state.set_aside.remove(client_id).is_some();
            session || set_aside
        };
        self.shared.applied.notify_waiters();
        Ok(deleted)
    }

    async fn load_access(&self) -> Result<Vec<AccessRecord>, StorageError> {
        let state = self.shared.state.lock();
        Ok(state
            .access
            .iter()
            .map(|((kind, name), body)| AccessRecord {
                kind: *kind,
                name: name.clone(),
                body: body.clone(),
            })
            .collect())
    }

    async fn apply_access(&self, changes: &[AccessChange]) -> Result<(), StorageError> {
        validate_access(changes)?;
        let mut state = self.shared.state.lock();
        if let Some(kind) = state.failing.or_else(|| state.failures.pop_front()) {
            return Err(StorageError::new(kind, "injected failure"));
        }
        for change in changes {
            match change {
                AccessChange::Put(r) => {
                    state
                        .access
                        .insert((r.kind, r.name.clone()), r.body.clone());
                }
                AccessChange::Deleted { kind, name } => {
                    state.access.remove(&(*kind, name.clone()));
                }
            }
        }
        Ok(())
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

    /// A batch that fails (an injected failure) stores no message and no reference; the same
    /// batch applied again stores each once.
    #[tokio::test]
    async fn a_failed_batch_leaves_no_message_and_no_reference() {
        use crate::{Change, DeliveryRecord, ErrorKind, MessageRecord, SessionHeader, Storage};
        use crate::{StorageError, StoredMessage};
        let storage = MemoryStorage::new();
        let mut batch = vec![Change::MessageStored {
            message: StoredMessage {
                id: 1,
                message: MessageRecord::new("t", "m", 1),
            },
        }];
        for client in ["a", "b"] {
            batch.push(Change::SessionSaved(SessionHeader {
                client_id: client.into(),
                protocol_level: 5,
                session_expiry_interval: 60,
                disconnected_at: None,
                username: None,
                certificate: None,
            }));
            batch.push(Change::MessageQueued {
                client_id: client.into(),
                seq: 1,
                delivery: DeliveryRecord::new(1, 1),
            });
        }
        storage.fail_next(ErrorKind::Transient, 1);
        let failed: Result<(), StorageError> = storage.apply(&batch).await;
        assert!(failed.is_err());
        let state = storage.snapshot();
        assert!(state.messages.is_empty() && state.sessions.is_empty());
        storage.apply(&batch).await.unwrap();
        let state = storage.snapshot();
        assert_eq!(state.messages.len(), 1);
        assert_eq!(state.sessions.len(), 2);
    }
}
