//! Checks every [`Storage`] backend must pass: the semantics of
//! [`MemoryStorage`](crate::MemoryStorage), the reference.
//!
//! A backend's tests implement [`Harness`] (how to make an empty storage, how to reopen one)
//! and call [`run_all`], or call the `check_*` functions one by one from their own tests.
//! A failed check panics with what differed, like `assert_eq!`.
//!
//! ```ignore
//! #[tokio::test]
//! async fn sqlite_conforms() {
//!     mercurio_storage::conformance::run_all(&mut SqliteHarness::new()).await;
//! }
//! ```

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Mutex, OnceLock};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{
    AccessChange, AccessKind, AccessRecord, Change, DeliveryRecord, ErrorKind, InflightRecord,
    InflightState, LoadedState, MessageRecord, QueuedRecord, RetainedRecord, SessionHeader,
    SessionRecord, Storage, StorageError, StoredMessage, StreamAppend, StreamDefinition,
    StreamEntryRecord, SubscriptionRecord, WillRecord, NEVER_EXPIRES,
};

/// How the checks get storages of the backend under test.
#[async_trait]
pub trait Harness: Send {
    /// The backend under test.
    type Storage: Storage;

    /// An empty storage, independent of every other one this harness made (its own file,
    /// its own database schema).
    async fn fresh(&mut self) -> Self::Storage;

    /// Close `storage` as a stopping broker would (after [`Storage::flush`]) and open the
    /// same database again, as a restarted broker would.
    async fn reopen(&mut self, storage: Self::Storage) -> Self::Storage;

    /// Make the stored session of `client_id` unreadable (e.g. damage its row), so that
    /// [`Storage::load`] sets it aside. Returns `false` if the backend can't, which skips
    /// [`check_set_aside`].
    async fn make_unreadable(&mut self, storage: &Self::Storage, client_id: &str) -> bool;
}

/// Run every check, each on a fresh storage.
pub async fn run_all<H: Harness>(harness: &mut H) {
    check_empty(&harness.fresh().await).await;
    check_session_saved(&harness.fresh().await).await;
    check_subscriptions(&harness.fresh().await).await;
    check_will(&harness.fresh().await).await;
    check_queue(&harness.fresh().await).await;
    check_inflight(&harness.fresh().await).await;
    check_inbound_qos2(&harness.fresh().await).await;
    check_session_deleted(&harness.fresh().await).await;
    check_session_written(&harness.fresh().await).await;
    check_retained(&harness.fresh().await).await;
    check_message_fields(&harness.fresh().await).await;
    check_order_within_batch(&harness.fresh().await).await;
    check_cancelled_within_batch(harness).await;
    check_many_clients(&harness.fresh().await).await;
    check_batch_is_atomic(&harness.fresh().await).await;
    check_invalid_values_refused(&harness.fresh().await).await;
    check_delete_session(&harness.fresh().await).await;
    check_reopen(harness).await;
    check_set_aside(harness).await;
    check_message_stored_once(&harness.fresh().await).await;
    check_messages_of_deleted_sessions(&harness.fresh().await).await;
    check_refused_batch_stores_nothing(&harness.fresh().await).await;
    check_messages_across_reopen(harness).await;
    check_access_records(harness).await;
    check_fan_out_references(harness).await;
    check_fan_out_into_stored_queues(harness).await;
    check_inflight_set_twice_then_removed(&harness.fresh().await).await;
    check_streams(&harness.fresh().await).await;
    check_streams_across_reopen(harness).await;
    check_read_stream(&harness.fresh().await).await;
    check_stream_segments(harness).await;
    check_queues_left_in_storage(harness).await;
    check_messages_read_by_id(harness).await;
}

// ---------------------------------------------------------------------------------------
// Helpers

async fn must<T, F>(what: &str, future: F) -> T
where
    F: Future<Output = Result<T, StorageError>>,
{
    match future.await {
        Ok(value) => value,
        Err(error) => panic!("{what}: unexpected error: {error}"),
    }
}

/// The messages the checks refer to, by id (the id is a hash of the message, see
/// [`delivery_of`]), so that [`apply`] can store each before the batch refers to it.
fn registry() -> &'static Mutex<HashMap<u64, MessageRecord>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u64, MessageRecord>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The id of a message: a hash of what is stored of it (FNV-1a), below 2^63.
fn id_of(m: &MessageRecord) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes.iter().chain([&0xff]) {
            hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(m.topic.as_bytes());
    eat(&m.payload);
    eat(&m.properties);
    eat(&m.expires_at.unwrap_or(u64::MAX).to_be_bytes());
    eat(m.publisher.as_deref().unwrap_or("\u{0}").as_bytes());
    hash >> 1
}

/// A delivery of `m` (at its QoS, RETAIN flag and shared subscription), its message
/// registered for [`apply`] to store.
fn delivery_of(m: &MessageRecord) -> DeliveryRecord {
    let id = id_of(m);
    let mut stored = m.clone();
    stored.share = None;
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(id)
        .or_insert(stored);
    DeliveryRecord {
        message_id: id,
        qos: m.qos,
        retain: m.retain,
        subscription_ids: Vec::new(),
        share: m.share.clone(),
    }
}

/// The message a delivery of `state` gives the client: the stored message at the
/// delivery's QoS, RETAIN flag and shared subscription.
fn delivered(state: &LoadedState, d: &DeliveryRecord) -> MessageRecord {
    let Some(stored) = state.messages.iter().find(|m| m.id == d.message_id) else {
        panic!("message {} is referred to but not loaded", d.message_id);
    };
    MessageRecord {
        qos: d.qos,
        retain: d.retain,
        share: d.share.clone(),
        ..stored.message.clone()
    }
}

/// `batch` after a `MessageStored` of each message it refers to that the checks registered.
fn with_messages(batch: Vec<Change>) -> Vec<Change> {
    let mut ids = Vec::new();
    for change in &batch {
        match change {
            Change::MessageQueued { delivery, .. } => ids.push(delivery.message_id),
            Change::InflightSet { inflight, .. } => ids.push(inflight.delivery.message_id),
            Change::SessionWritten(record, _) => {
                ids.extend(record.queued.iter().map(|q| q.delivery.message_id));
                ids.extend(record.inflight.iter().map(|f| f.delivery.message_id));
            }
            _ => {}
        }
    }
    ids.sort_unstable();
    ids.dedup();
    let registry = registry().lock().unwrap_or_else(|e| e.into_inner());
    let mut out: Vec<Change> = ids
        .into_iter()
        .filter_map(|id| {
            registry.get(&id).map(|m| Change::MessageStored {
                message: StoredMessage {
                    id,
                    message: m.clone(),
                },
            })
        })
        .collect();
    out.extend(batch);
    out
}

/// Applies `batch`, storing first the messages it refers to.
async fn apply<S: Storage>(storage: &S, batch: Vec<Change>) {
    must("apply", storage.apply(&with_messages(batch))).await;
}

async fn load<S: Storage>(storage: &S) -> LoadedState {
    must("load", storage.load()).await
}

async fn session<S: Storage>(storage: &S, client_id: &str) -> SessionRecord {
    let state = load(storage).await;
    match state
        .sessions
        .into_iter()
        .find(|session| session.client_id == client_id)
    {
        Some(session) => session,
        None => panic!("session {client_id:?} was not loaded"),
    }
}

fn header(client_id: &str) -> SessionHeader {
    SessionHeader {
        client_id: client_id.to_string(),
        protocol_level: 5,
        session_expiry_interval: 3600,
        disconnected_at: None,
        username: Some(format!("{client_id}-user")),
        certificate: Some(format!("{client_id}-cert")),
    }
}

fn saved(client_id: &str) -> Change {
    Change::SessionSaved(header(client_id))
}

fn message(topic: &str, payload: &'static [u8], qos: u8) -> MessageRecord {
    MessageRecord::new(topic, Bytes::from_static(payload), qos)
}

fn queued(client_id: &str, seq: u64, payload: &'static [u8]) -> Change {
    Change::MessageQueued {
        client_id: client_id.to_string(),
        seq,
        delivery: delivery_of(&message("q/t", payload, 1)),
    }
}

fn dequeued(client_id: &str, seq: u64) -> Change {
    Change::MessageDequeued {
        client_id: client_id.to_string(),
        seq,
    }
}

fn subscribed(client_id: &str, filter: &str, qos: u8) -> Change {
    Change::SubscriptionAdded {
        client_id: client_id.to_string(),
        subscription: SubscriptionRecord::new(filter, qos),
    }
}

fn inflight(client_id: &str, packet_id: u16, state: InflightState) -> Change {
    Change::InflightSet {
        client_id: client_id.to_string(),
        inflight: InflightRecord {
            packet_id,
            delivery: delivery_of(&message("i/t", b"in flight", 2)),
            state,
        },
    }
}

fn retained(topic: &str, payload: &'static [u8], publisher: Option<&str>) -> RetainedRecord {
    let mut message = message(topic, payload, 1);
    message.retain = true;
    message.publisher = publisher.map(str::to_string);
    RetainedRecord::new(message)
}

fn seqs(session: &SessionRecord) -> Vec<u64> {
    session.queued.iter().map(|queued| queued.seq).collect()
}

fn filters(session: &SessionRecord) -> Vec<&str> {
    session
        .subscriptions
        .iter()
        .map(|subscription| subscription.filter.as_str())
        .collect()
}

fn packet_ids(session: &SessionRecord) -> Vec<(u16, InflightState)> {
    session
        .inflight
        .iter()
        .map(|inflight| (inflight.packet_id, inflight.state))
        .collect()
}

fn client_ids(state: &LoadedState) -> Vec<&str> {
    state
        .sessions
        .iter()
        .map(|session| session.client_id.as_str())
        .collect()
}

fn expect_refused(result: Result<(), StorageError>, what: &str) {
    match result {
        Ok(()) => panic!("{what}: the batch was accepted, it must be refused"),
        Err(error) => assert_eq!(
            error.kind(),
            ErrorKind::Refused,
            "{what}: wrong error kind: {error}"
        ),
    }
}

// ---------------------------------------------------------------------------------------
// Checks

/// A fresh storage loads nothing; an empty batch and a flush succeed.
pub async fn check_empty<S: Storage>(storage: &S) {
    assert_eq!(load(storage).await, LoadedState::default());
    apply(storage, Vec::new()).await;
    must("flush", storage.flush()).await;
    assert_eq!(load(storage).await, LoadedState::default());
}

/// `SessionSaved` creates an empty session, then updates only its header.
pub async fn check_session_saved<S: Storage>(storage: &S) {
    apply(storage, vec![saved("a")]).await;
    assert_eq!(
        session(storage, "a").await,
        SessionRecord::new(header("a")),
        "a new session is empty"
    );

    apply(
        storage,
        vec![subscribed("a", "x/#", 1), queued("a", 1, b"one")],
    )
    .await;
    let disconnected = SessionHeader {
        client_id: "a".to_string(),
        protocol_level: 4,
        session_expiry_interval: NEVER_EXPIRES,
        disconnected_at: Some(1_700_000_000_123),
        username: None,
        certificate: None,
    };
    apply(storage, vec![Change::SessionSaved(disconnected.clone())]).await;
    let loaded = session(storage, "a").await;
    assert_eq!(loaded.header(), disconnected, "the header is updated");
    assert_eq!(
        filters(&loaded),
        ["x/#"],
        "SessionSaved keeps subscriptions"
    );
    assert_eq!(seqs(&loaded), [1], "SessionSaved keeps queued messages");
    assert_eq!(loaded.expires_at(), None);
}

/// Subscriptions: added, replaced by filter, removed, listed by filter.
pub async fn check_subscriptions<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![
            saved("a"),
            subscribed("a", "b/+", 0),
            subscribed("a", "$share/g/a/#", 1),
            subscribed("a", "a/b", 2),
        ],
    )
    .await;
    assert_eq!(
        filters(&session(storage, "a").await),
        ["$share/g/a/#", "a/b", "b/+"]
    );

    let replacement = SubscriptionRecord {
        filter: "a/b".to_string(),
        qos: 1,
        no_local: true,
        retain_as_published: true,
        retain_handling: 2,
        subscription_identifier: Some(268_435_455),
    };
    apply(
        storage,
        vec![
            Change::SubscriptionAdded {
                client_id: "a".to_string(),
                subscription: replacement.clone(),
            },
            Change::SubscriptionRemoved {
                client_id: "a".to_string(),
                filter: "b/+".to_string(),
            },
            Change::SubscriptionRemoved {
                client_id: "a".to_string(),
                filter: "not/subscribed".to_string(),
            },
        ],
    )
    .await;
    let loaded = session(storage, "a").await;
    assert_eq!(filters(&loaded), ["$share/g/a/#", "a/b"]);
    assert_eq!(loaded.subscriptions[1], replacement, "options are kept");
    assert_eq!(loaded.subscriptions[0].share(), Some(("g", "a/#")));
}

/// The will: set, replaced, cleared.
pub async fn check_will<S: Storage>(storage: &S) {
    let first = WillRecord {
        message: message("will/a", b"gone", 1),
        delay_interval: 0,
    };
    let mut second_message = message("will/a", b"really gone", 2);
    second_message.retain = true;
    second_message.properties = Bytes::from_static(&[0x03, 0x00, 0x01, b'x']);
    second_message.expires_at = Some(1_700_000_060_000);
    let second = WillRecord {
        message: second_message,
        delay_interval: 30,
    };
    apply(
        storage,
        vec![
            saved("a"),
            Change::WillSet {
                client_id: "a".to_string(),
                will: first,
            },
            Change::WillSet {
                client_id: "a".to_string(),
                will: second.clone(),
            },
        ],
    )
    .await;
    assert_eq!(session(storage, "a").await.will, Some(second));
    apply(
        storage,
        vec![Change::WillCleared {
            client_id: "a".to_string(),
        }],
    )
    .await;
    assert_eq!(session(storage, "a").await.will, None);
}

/// Queued messages come back by seq whatever the order they were queued in; dequeued ones
/// are gone; queueing at an existing seq replaces.
pub async fn check_queue<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![saved("a"), queued("a", 3, b"three"), queued("a", 1, b"one")],
    )
    .await;
    apply(
        storage,
        vec![
            queued("a", 2, b"two"),
            queued("a", 1 << 40, b"far"),
            queued("a", 4, b"four"),
        ],
    )
    .await;
    assert_eq!(seqs(&session(storage, "a").await), [1, 2, 3, 4, 1 << 40]);

    apply(
        storage,
        vec![
            dequeued("a", 1),
            dequeued("a", 3),
            dequeued("a", 99),
            queued("a", 4, b"four again"),
        ],
    )
    .await;
    let state = load(storage).await;
    let loaded = &state.sessions[0];
    assert_eq!(seqs(loaded), [2, 4, 1 << 40]);
    assert_eq!(
        delivered(&state, &loaded.queued[0].delivery).payload,
        Bytes::from_static(b"two")
    );
    assert_eq!(
        loaded.queued[1],
        QueuedRecord {
            seq: 4,
            delivery: delivery_of(&message("q/t", b"four again", 1)),
        }
    );
    assert_eq!(
        delivered(&state, &loaded.queued[1].delivery),
        message("q/t", b"four again", 1)
    );
}

/// [`Storage::load_without_queues`] returns what [`Storage::load`] does, each queue replaced
/// by its count and positions ([`LoadedState::backlogs`]) and its messages still loaded;
/// [`Storage::load_queue`] then reads one queue as `load` would (the changes applied since
/// included), through a reopen; a session without a queue, and no session, have none.
pub async fn check_queues_left_in_storage<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    // More deliveries than one SQLite chunk holds, queued over several batches.
    let mut batch = vec![
        saved("a"),
        saved("b"),
        saved("c"),
        subscribed("a", "q/#", 1),
    ];
    for seq in 1..=150 {
        batch.push(queued("a", seq, b"lazy one"));
    }
    apply(&storage, batch).await;
    let mut batch = Vec::new();
    for seq in 151..=300 {
        batch.push(queued("a", seq, b"lazy two"));
    }
    batch.push(queued("c", 5, b"lazy three"));
    apply(&storage, batch).await;
    apply(&storage, vec![dequeued("a", 1), dequeued("a", 200)]).await;

    let full = load(&storage).await;
    let lazy = must("load_without_queues", storage.load_without_queues()).await;
    assert_lazy(&full, &lazy);
    let a = must("load_queue", storage.load_queue("a")).await;
    assert_eq!(a, full.sessions[0].queued, "the queue as load reads it");
    assert_eq!(a.len(), 298);
    assert_eq!(
        must("load_queue", storage.load_queue("b")).await,
        [],
        "a session with no queue"
    );
    assert_eq!(
        must("load_queue", storage.load_queue("nobody")).await,
        [],
        "no session"
    );

    // Changes after the load: appended, dequeued at both ends; read as they are now.
    apply(
        &storage,
        vec![
            queued("a", 301, b"after the load"),
            dequeued("a", 2),
            dequeued("a", 300),
        ],
    )
    .await;
    let a = must("load_queue", storage.load_queue("a")).await;
    assert_eq!(a.len(), 297);
    assert_eq!(a.first().map(|q| q.seq), Some(3));
    assert_eq!(
        a.iter().rev().take(2).map(|q| q.seq).collect::<Vec<_>>(),
        [301, 299]
    );
    must("flush", storage.flush()).await;

    // Through a reopen, the messages only the unread queues refer to are still loaded.
    let storage = harness.reopen(storage).await;
    let full = load(&storage).await;
    let storage = harness.reopen(storage).await;
    let lazy = must("load_without_queues", storage.load_without_queues()).await;
    assert_lazy(&full, &lazy);
    assert_eq!(
        must("load_queue", storage.load_queue("a")).await,
        full.sessions[0].queued
    );
    assert_eq!(
        must("load_queue", storage.load_queue("c")).await,
        full.sessions[2].queued
    );
    let c = &full.sessions[2].queued[0].delivery;
    assert_eq!(delivered(&lazy, c), message("q/t", b"lazy three", 1));

    // A deleted session's queue goes with it.
    apply(
        &storage,
        vec![Change::SessionDeleted {
            client_id: "a".into(),
        }],
    )
    .await;
    assert_eq!(must("load_queue", storage.load_queue("a")).await, []);
}

/// [`Storage::load_messages`] reads the stored messages of the ids asked, each once, sorted,
/// leaving out ids not stored, through a reopen; asking for none reads none.
pub async fn check_messages_read_by_id<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    let mut batch = vec![saved("a"), subscribed("a", "q/#", 1)];
    for seq in 1..=700 {
        let m = MessageRecord::new("q/t", Bytes::from(format!("by id {seq}")), 1);
        batch.push(Change::MessageQueued {
            client_id: "a".to_string(),
            seq,
            delivery: delivery_of(&m),
        });
    }
    apply(&storage, batch).await;
    let full = load(&storage).await;
    assert_eq!(full.messages.len(), 700);
    let mut ids: Vec<u64> = full.messages.iter().rev().map(|m| m.id).collect();
    ids.push(full.messages[0].id);
    ids.push(u64::MAX >> 2);
    let read = must("load_messages", storage.load_messages(&ids)).await;
    assert_eq!(read, full.messages, "every message asked, once, by id");
    assert_eq!(must("load_messages", storage.load_messages(&[])).await, []);
    let some = [full.messages[10].id, full.messages[3].id];
    assert_eq!(
        must("load_messages", storage.load_messages(&some)).await,
        [full.messages[3].clone(), full.messages[10].clone()]
    );
    must("flush", storage.flush()).await;
    let storage = harness.reopen(storage).await;
    let read = must("load_messages", storage.load_messages(&ids)).await;
    assert_eq!(read, full.messages, "through a reopen");
}

/// `lazy` is `full` with each non-empty queue replaced by its backlog.
fn assert_lazy(full: &LoadedState, lazy: &LoadedState) {
    let mut expected = full.clone();
    for s in &mut expected.sessions {
        let queued = std::mem::take(&mut s.queued);
        if let (Some(first), Some(last)) = (queued.first(), queued.last()) {
            expected.backlogs.insert(
                s.client_id.clone(),
                crate::Backlog {
                    len: queued.len() as u64,
                    first_seq: first.seq,
                    last_seq: last.seq,
                },
            );
        }
    }
    assert_eq!(
        lazy, &expected,
        "load_without_queues is load without the queues"
    );
}

/// In-flight messages keep the order their packet id was first set in, through state
/// updates; removed ones are gone and a reused packet id goes last.
pub async fn check_inflight<S: Storage>(storage: &S) {
    use InflightState::*;
    apply(
        storage,
        vec![
            saved("a"),
            inflight("a", 9, AwaitingPubRec),
            inflight("a", 2, AwaitingPubAck),
            inflight("a", 65535, AwaitingPubRec),
        ],
    )
    .await;
    apply(storage, vec![inflight("a", 1, AwaitingPubAck)]).await;
    assert_eq!(
        packet_ids(&session(storage, "a").await),
        [
            (9, AwaitingPubRec),
            (2, AwaitingPubAck),
            (65535, AwaitingPubRec),
            (1, AwaitingPubAck)
        ]
    );

    apply(
        storage,
        vec![
            inflight("a", 9, AwaitingPubComp),
            Change::InflightRemoved {
                client_id: "a".to_string(),
                packet_id: 2,
            },
            Change::InflightRemoved {
                client_id: "a".to_string(),
                packet_id: 77,
            },
        ],
    )
    .await;
    apply(storage, vec![inflight("a", 2, AwaitingPubAck)]).await;
    let state = load(storage).await;
    let loaded = &state.sessions[0];
    assert_eq!(
        packet_ids(loaded),
        [
            (9, AwaitingPubComp),
            (65535, AwaitingPubRec),
            (1, AwaitingPubAck),
            (2, AwaitingPubAck)
        ]
    );
    assert_eq!(
        delivered(&state, &loaded.inflight[0].delivery),
        message("i/t", b"in flight", 2)
    );
}

/// Inbound QoS 2 packet ids: a set, listed ascending.
pub async fn check_inbound_qos2<S: Storage>(storage: &S) {
    let added = |packet_id| Change::InboundQos2Added {
        client_id: "a".to_string(),
        packet_id,
    };
    let removed = |packet_id| Change::InboundQos2Removed {
        client_id: "a".to_string(),
        packet_id,
    };
    apply(
        storage,
        vec![saved("a"), added(7), added(1), added(65535), added(7)],
    )
    .await;
    assert_eq!(session(storage, "a").await.inbound_qos2, [1, 7, 65535]);
    apply(storage, vec![removed(7), removed(8)]).await;
    assert_eq!(session(storage, "a").await.inbound_qos2, [1, 65535]);
}

/// Deleting a session removes everything of it, and nothing of others; a session created
/// again starts empty; removals for a session not stored do nothing.
pub async fn check_session_deleted<S: Storage>(storage: &S) {
    let full = |client_id: &str| {
        vec![
            saved(client_id),
            subscribed(client_id, "t/#", 1),
            Change::WillSet {
                client_id: client_id.to_string(),
                will: WillRecord {
                    message: message("will", b"w", 0),
                    delay_interval: 5,
                },
            },
            queued(client_id, 1, b"q"),
            inflight(client_id, 1, InflightState::AwaitingPubAck),
            Change::InboundQos2Added {
                client_id: client_id.to_string(),
                packet_id: 3,
            },
        ]
    };
    apply(storage, full("a")).await;
    apply(storage, full("b")).await;
    let b_before = session(storage, "b").await;
    apply(
        storage,
        vec![
            Change::SessionDeleted {
                client_id: "a".to_string(),
            },
            Change::RetainedSet(retained("r", b"kept", Some("a"))),
        ],
    )
    .await;
    let state = load(storage).await;
    assert_eq!(client_ids(&state), ["b"]);
    assert_eq!(state.sessions[0], b_before, "other sessions are untouched");
    assert_eq!(
        state.retained.len(),
        1,
        "retained messages outlive sessions"
    );

    apply(
        storage,
        vec![
            Change::SessionDeleted {
                client_id: "a".to_string(),
            },
            dequeued("a", 1),
            Change::SubscriptionRemoved {
                client_id: "a".to_string(),
                filter: "t/#".to_string(),
            },
            Change::WillCleared {
                client_id: "a".to_string(),
            },
            Change::InflightRemoved {
                client_id: "a".to_string(),
                packet_id: 1,
            },
            Change::InboundQos2Removed {
                client_id: "a".to_string(),
                packet_id: 3,
            },
        ],
    )
    .await;
    assert_eq!(client_ids(&load(storage).await), ["b"]);

    apply(storage, vec![saved("a")]).await;
    assert_eq!(
        session(storage, "a").await,
        SessionRecord::new(header("a")),
        "a session created again starts empty"
    );
}

/// `SessionWritten` replaces the whole session, dropping what the record doesn't hold.
pub async fn check_session_written<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![
            saved("a"),
            subscribed("a", "old/#", 1),
            queued("a", 1, b"old"),
            queued("a", 2, b"old"),
            inflight("a", 5, InflightState::AwaitingPubAck),
            Change::InboundQos2Added {
                client_id: "a".to_string(),
                packet_id: 3,
            },
            Change::WillSet {
                client_id: "a".to_string(),
                will: WillRecord {
                    message: message("will", b"w", 0),
                    delay_interval: 5,
                },
            },
        ],
    )
    .await;

    let mut record = SessionRecord::new(SessionHeader {
        client_id: "a".to_string(),
        protocol_level: 3,
        session_expiry_interval: 0,
        disconnected_at: Some(42),
        username: None,
        certificate: None,
    });
    record.subscriptions = vec![
        SubscriptionRecord::new("new/a", 2),
        SubscriptionRecord::new("new/b", 0),
    ];
    record.queued = vec![
        QueuedRecord {
            seq: 2,
            delivery: delivery_of(&message("q", b"new two", 1)),
        },
        QueuedRecord {
            seq: 10,
            delivery: delivery_of(&message("q", b"new ten", 0)),
        },
    ];
    record.inflight = vec![
        InflightRecord {
            packet_id: 40,
            delivery: delivery_of(&message("i", b"x", 2)),
            state: InflightState::AwaitingPubComp,
        },
        InflightRecord {
            packet_id: 4,
            delivery: delivery_of(&MessageRecord {
                share: Some("$share/g/i".to_string()),
                ..message("i", b"y", 1)
            }),
            state: InflightState::AwaitingPubAck,
        },
    ];
    record.queued[0].delivery.share = Some("$share/g/q".to_string());
    record.queued[0].delivery.subscription_ids = vec![1, 268_435_455];
    record.inbound_qos2 = vec![8, 9];
    // The messages it refers to come with it.
    let messages: Vec<StoredMessage> = [("q", &b"new two"[..], 1), ("q", b"new ten", 0)]
        .into_iter()
        .chain([("i", &b"x"[..], 2), ("i", b"y", 1)])
        .map(|(topic, payload, qos)| {
            let m = MessageRecord::new(topic, Bytes::copy_from_slice(payload), qos);
            StoredMessage {
                id: id_of(&m),
                message: m,
            }
        })
        .collect();
    must(
        "apply",
        storage.apply(&[Change::SessionWritten(record.clone(), messages)]),
    )
    .await;
    assert_eq!(session(storage, "a").await, record);

    // Written whole, then changed in the same batch; also creates a session not stored.
    let mut fresh = SessionRecord::new(header("b"));
    fresh.queued.push(QueuedRecord {
        seq: 1,
        delivery: delivery_of(&message("q", b"one", 1)),
    });
    apply(
        storage,
        vec![
            Change::SessionWritten(fresh.clone(), Vec::new()),
            queued("b", 2, b"two"),
        ],
    )
    .await;
    assert_eq!(seqs(&session(storage, "b").await), [1, 2]);
}

/// Retained messages: set, replaced, deleted, listed by topic, with their publisher (its
/// client identifier, user name and listener port).
pub async fn check_retained<S: Storage>(storage: &S) {
    let mut second = retained("b/t", b"second", Some("p2"));
    second.publisher_username = Some("utilisateur-é".to_string());
    second.publisher_listener = Some(8883);
    apply(
        storage,
        vec![
            Change::RetainedSet(retained("b/t", b"first", Some("p1"))),
            Change::RetainedSet(retained("a/t", b"a", None)),
            Change::RetainedSet(retained("c/t", b"c", Some("p3"))),
        ],
    )
    .await;
    apply(
        storage,
        vec![
            Change::RetainedSet(second.clone()),
            Change::RetainedDeleted {
                topic: "c/t".to_string(),
            },
            Change::RetainedDeleted {
                topic: "never/retained".to_string(),
            },
        ],
    )
    .await;
    let state = load(storage).await;
    assert_eq!(state.retained, [retained("a/t", b"a", None), second]);
    assert!(
        state.sessions.is_empty(),
        "retained changes create no session"
    );
}

/// Every field of a message round-trips: binary payload, empty payload, properties, expiry,
/// publisher, non-ASCII topics.
pub async fn check_message_fields<S: Storage>(storage: &S) {
    let mut binary = MessageRecord::new(
        "capteurs/température/ü",
        Bytes::from_static(&[0, 159, 146, 150, 255, 0]),
        2,
    );
    binary.retain = true;
    binary.properties = Bytes::from_static(&[0x01, 0x01, 0x26, 0, 1, b'k', 0, 1, b'v']);
    binary.expires_at = Some(1_700_000_000_999);
    binary.publisher = Some("publisher-é".to_string());
    let empty = MessageRecord::new("e", Bytes::new(), 0);
    let mut shared = binary.clone();
    shared.share = Some("$share/groupe-é/capteurs/#".to_string());
    apply(
        storage,
        vec![
            Change::SessionSaved(SessionHeader {
                client_id: "client-ñ".to_string(),
                protocol_level: 3,
                session_expiry_interval: 0,
                disconnected_at: Some(0),
                username: None,
                certificate: None,
            }),
            Change::MessageQueued {
                client_id: "client-ñ".to_string(),
                seq: 0,
                delivery: delivery_of(&binary),
            },
            Change::MessageQueued {
                client_id: "client-ñ".to_string(),
                seq: 1,
                delivery: delivery_of(&empty),
            },
            Change::MessageQueued {
                client_id: "client-ñ".to_string(),
                seq: 2,
                delivery: delivery_of(&shared),
            },
            Change::InflightSet {
                client_id: "client-ñ".to_string(),
                inflight: InflightRecord {
                    packet_id: 7,
                    delivery: delivery_of(&shared),
                    state: InflightState::AwaitingPubRec,
                },
            },
            Change::RetainedSet(RetainedRecord::new(binary.clone())),
        ],
    )
    .await;
    let state = load(storage).await;
    let loaded = &state.sessions[0];
    assert_eq!(loaded.client_id, "client-ñ");
    assert_eq!(loaded.protocol_level, 3);
    assert_eq!(loaded.disconnected_at, Some(0));
    assert!(loaded.is_expired(0));
    assert_eq!(delivered(&state, &loaded.queued[0].delivery), binary);
    assert_eq!(delivered(&state, &loaded.queued[1].delivery), empty);
    // The shared subscription of a delivery is kept, queued and in flight.
    assert_eq!(delivered(&state, &loaded.queued[2].delivery), shared);
    assert_eq!(delivered(&state, &loaded.inflight[0].delivery), shared);
    // One message queued twice (once through a shared subscription) and in flight is
    // stored once.
    assert_eq!(state.messages.len(), 2);
    assert_eq!(state.retained, [RetainedRecord::new(binary)]);
}

/// Changes apply in batch order: queued then dequeued, deleted then created again.
pub async fn check_order_within_batch<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![
            saved("a"),
            queued("a", 1, b"one"),
            dequeued("a", 1),
            queued("a", 2, b"two"),
            subscribed("a", "gone", 1),
            Change::SessionDeleted {
                client_id: "a".to_string(),
            },
            saved("a"),
            subscribed("a", "kept", 1),
            Change::RetainedSet(retained("r", b"x", None)),
            Change::RetainedDeleted {
                topic: "r".to_string(),
            },
            Change::RetainedSet(retained("s", b"y", None)),
        ],
    )
    .await;
    let state = load(storage).await;
    assert_eq!(filters(&state.sessions[0]), ["kept"]);
    assert!(state.sessions[0].queued.is_empty());
    assert_eq!(state.retained, [retained("s", b"y", None)]);
}

/// Changes cancelled later in the same batch (set then removed, queued then dequeued,
/// removed then set again) leave what applying them one by one leaves, before and after a
/// reopen: nothing for what the batch added and removed, the removal of what was stored
/// before, a new place at the end for an in-flight entry removed and set again, its place
/// for one only updated. An addition for a session not stored is refused even when a later
/// change of the batch cancels it.
pub async fn check_cancelled_within_batch<H: Harness>(harness: &mut H) {
    use InflightState::*;
    let storage = harness.fresh().await;
    let removed = |packet_id| Change::InflightRemoved {
        client_id: "a".to_string(),
        packet_id,
    };
    let inbound = |packet_id, added| {
        let client_id = "a".to_string();
        if added {
            Change::InboundQos2Added {
                client_id,
                packet_id,
            }
        } else {
            Change::InboundQos2Removed {
                client_id,
                packet_id,
            }
        }
    };
    let will = || Change::WillSet {
        client_id: "a".to_string(),
        will: WillRecord {
            message: message("will", b"w", 1),
            delay_interval: 0,
        },
    };
    apply(
        &storage,
        vec![
            saved("a"),
            subscribed("a", "kept", 1),
            queued("a", 1, b"one"),
            queued("a", 2, b"two"),
            inflight("a", 5, AwaitingPubRec),
            inflight("a", 6, AwaitingPubAck),
            inflight("a", 8, AwaitingPubAck),
            inbound(3, true),
            Change::RetainedSet(retained("r", b"r", None)),
        ],
    )
    .await;
    apply(
        &storage,
        vec![
            // Queued then dequeued: never stored.
            queued("a", 3, b"three"),
            dequeued("a", 3),
            // Stored before, replaced then dequeued: gone.
            queued("a", 1, b"one again"),
            dequeued("a", 1),
            // Dequeued then queued again: stored with the new message.
            dequeued("a", 2),
            queued("a", 2, b"two again"),
            // In flight then acknowledged: never stored; the same for a stored one.
            inflight("a", 7, AwaitingPubAck),
            removed(7),
            inflight("a", 5, AwaitingPubComp),
            removed(5),
            // New entries, one removed and set again (after the other); an update.
            inflight("a", 20, AwaitingPubAck),
            inflight("a", 21, AwaitingPubAck),
            removed(20),
            inflight("a", 20, AwaitingPubRec),
            inflight("a", 6, AwaitingPubComp),
            // A stored entry removed and set again goes last.
            removed(8),
            inflight("a", 8, AwaitingPubRec),
            subscribed("a", "gone", 1),
            Change::SubscriptionRemoved {
                client_id: "a".to_string(),
                filter: "gone".to_string(),
            },
            will(),
            Change::WillCleared {
                client_id: "a".to_string(),
            },
            inbound(4, true),
            inbound(4, false),
            inbound(3, false),
            inbound(3, true),
            Change::RetainedSet(retained("s", b"s", None)),
            Change::RetainedDeleted {
                topic: "s".to_string(),
            },
            Change::RetainedDeleted {
                topic: "r".to_string(),
            },
            Change::RetainedSet(retained("r", b"r again", None)),
        ],
    )
    .await;
    let check = |state: &LoadedState, when: &str| {
        let a = &state.sessions[0];
        assert_eq!(seqs(a), [2], "{when}: queued");
        assert_eq!(
            delivered(state, &a.queued[0].delivery).payload,
            Bytes::from_static(b"two again"),
            "{when}: queued again"
        );
        assert_eq!(
            packet_ids(a),
            [
                (6, AwaitingPubComp),
                (21, AwaitingPubAck),
                (20, AwaitingPubRec),
                (8, AwaitingPubRec)
            ],
            "{when}: in flight"
        );
        assert_eq!(filters(a), ["kept"], "{when}: subscriptions");
        assert_eq!(a.will, None, "{when}: will");
        assert_eq!(a.inbound_qos2, [3], "{when}: inbound QoS 2");
        assert_eq!(
            state.retained,
            [retained("r", b"r again", None)],
            "{when}: retained"
        );
    };
    must("flush", storage.flush()).await;
    let before = load(&storage).await;
    check(&before, "applied");
    let storage = harness.reopen(storage).await;
    let after = load(&storage).await;
    check(&after, "reopened");
    assert_eq!(after, before, "the state survives a reopen");

    // Set and cleared within a batch that also deletes and creates the session again.
    apply(
        &storage,
        vec![
            queued("a", 10, b"ten"),
            Change::SessionDeleted {
                client_id: "a".to_string(),
            },
            saved("a"),
            queued("a", 11, b"eleven"),
            dequeued("a", 11),
            inflight("a", 1, AwaitingPubAck),
            removed(1),
            inflight("a", 2, AwaitingPubAck),
        ],
    )
    .await;
    let a = session(&storage, "a").await;
    assert!(a.queued.is_empty(), "queued after the session's deletion");
    assert_eq!(packet_ids(&a), [(2, AwaitingPubAck)]);

    for (what, batch) in [
        (
            "queued then dequeued",
            vec![queued("nobody", 1, b"x"), dequeued("nobody", 1)],
        ),
        (
            "set in flight then removed",
            vec![
                Change::InflightSet {
                    client_id: "nobody".to_string(),
                    inflight: InflightRecord {
                        packet_id: 1,
                        delivery: delivery_of(&message("i/t", b"x", 1)),
                        state: AwaitingPubAck,
                    },
                },
                Change::InflightRemoved {
                    client_id: "nobody".to_string(),
                    packet_id: 1,
                },
            ],
        ),
        (
            "queued after the deletion then dequeued",
            vec![
                Change::SessionDeleted {
                    client_id: "a".to_string(),
                },
                queued("a", 1, b"x"),
                dequeued("a", 1),
            ],
        ),
    ] {
        let what = format!("{what}, for a session not stored");
        expect_refused(storage.apply(&batch).await, &what);
    }
    assert_eq!(
        load(&storage).await.sessions[0],
        a,
        "refused batches change nothing"
    );
}

/// A batch interleaving many clients; sessions come back sorted by client id.
pub async fn check_many_clients<S: Storage>(storage: &S) {
    let clients: Vec<String> = (0..50).rev().map(|i| format!("client-{i:03}")).collect();
    let mut batch: Vec<Change> = clients.iter().map(|client| saved(client)).collect();
    for seq in 0..5 {
        for client in &clients {
            batch.push(queued(client, seq, b"m"));
        }
    }
    for client in &clients {
        batch.push(dequeued(client, 0));
    }
    apply(storage, batch).await;
    let state = load(storage).await;
    let mut expected = clients.clone();
    expected.sort();
    assert_eq!(client_ids(&state), expected);
    for session in &state.sessions {
        assert_eq!(seqs(session), [1, 2, 3, 4], "{}", session.client_id);
    }
}

/// A batch with a change the database refuses applies nothing, not even the changes before
/// it; the error is `Refused`.
pub async fn check_batch_is_atomic<S: Storage>(storage: &S) {
    apply(storage, vec![saved("a"), queued("a", 1, b"one")]).await;
    let before = load(storage).await;
    let result = storage
        .apply(&[
            dequeued("a", 1),
            saved("b"),
            Change::RetainedSet(retained("r", b"x", None)),
            queued("nobody", 1, b"lost"),
        ])
        .await;
    expect_refused(result, "a message queued for a session not stored");
    assert_eq!(
        load(storage).await,
        before,
        "a refused batch changes nothing"
    );

    for change in [
        subscribed("nobody", "t", 0),
        Change::WillSet {
            client_id: "nobody".to_string(),
            will: WillRecord {
                message: message("w", b"w", 0),
                delay_interval: 0,
            },
        },
        inflight("nobody", 1, InflightState::AwaitingPubAck),
        Change::InboundQos2Added {
            client_id: "nobody".to_string(),
            packet_id: 1,
        },
    ] {
        let what = format!("{} for a session not stored", change.kind());
        expect_refused(storage.apply(&[change]).await, &what);
    }
    let result = storage
        .apply(&[
            Change::SessionDeleted {
                client_id: "a".to_string(),
            },
            queued("a", 2, b"after delete"),
        ])
        .await;
    expect_refused(result, "a message queued after the session's deletion");
    assert_eq!(
        load(storage).await,
        before,
        "refused batches change nothing"
    );
}

/// Values no MQTT packet can carry are refused: QoS over 2, retain handling over 2,
/// protocol levels other than 3 to 5, subscription identifier 0.
pub async fn check_invalid_values_refused<S: Storage>(storage: &S) {
    apply(storage, vec![saved("a")]).await;
    let before = load(storage).await;
    let mut bad_header = header("b");
    bad_header.protocol_level = 6;
    let mut bad_subscription = SubscriptionRecord::new("t", 1);
    bad_subscription.retain_handling = 3;
    let mut zero_identifier = SubscriptionRecord::new("t", 1);
    zero_identifier.subscription_identifier = Some(0);
    let cases = vec![
        ("protocol level 6", Change::SessionSaved(bad_header)),
        ("subscription QoS 3", subscribed("a", "t", 3)),
        (
            "retain handling 3",
            Change::SubscriptionAdded {
                client_id: "a".to_string(),
                subscription: bad_subscription,
            },
        ),
        (
            "subscription identifier 0",
            Change::SubscriptionAdded {
                client_id: "a".to_string(),
                subscription: zero_identifier,
            },
        ),
        (
            "message QoS 3",
            Change::MessageQueued {
                client_id: "a".to_string(),
                seq: 1,
                delivery: DeliveryRecord {
                    qos: 3,
                    ..delivery_of(&message("t", b"x", 1))
                },
            },
        ),
        (
            "retained QoS 3",
            Change::RetainedSet(RetainedRecord::new(message("t", b"x", 3))),
        ),
    ];
    for (what, change) in cases {
        expect_refused(storage.apply(&[change]).await, what);
    }
    let mut duplicated = SessionRecord::new(header("a"));
    duplicated.queued = vec![
        QueuedRecord {
            seq: 1,
            delivery: delivery_of(&message("t", b"x", 0)),
        },
        QueuedRecord {
            seq: 1,
            delivery: delivery_of(&message("t", b"y", 0)),
        },
    ];
    expect_refused(
        storage
            .apply(&with_messages(vec![Change::SessionWritten(
                duplicated,
                Vec::new(),
            )]))
            .await,
        "a written session with a seq twice",
    );
    assert_eq!(
        load(storage).await,
        before,
        "refused batches change nothing"
    );
}

/// `delete_session` removes a stored session and says whether there was one.
pub async fn check_delete_session<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![
            saved("a"),
            queued("a", 1, b"x"),
            saved("b"),
            Change::RetainedSet(retained("r", b"x", Some("a"))),
        ],
    )
    .await;
    assert!(must("delete_session", storage.delete_session("a")).await);
    assert!(!must("delete_session", storage.delete_session("a")).await);
    assert!(!must("delete_session", storage.delete_session("never")).await);
    let state = load(storage).await;
    assert_eq!(client_ids(&state), ["b"]);
    assert_eq!(state.retained.len(), 1);
}

/// What was applied and flushed is there after reopening.
pub async fn check_reopen<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    let mut record = SessionRecord::new(SessionHeader {
        client_id: "a".to_string(),
        protocol_level: 5,
        session_expiry_interval: 60,
        disconnected_at: Some(1_700_000_000_000),
        username: None,
        certificate: None,
    });
    record.subscriptions = vec![SubscriptionRecord::new("t/#", 1)];
    record.will = Some(WillRecord {
        message: message("will", b"w", 1),
        delay_interval: 10,
    });
    record.queued = vec![QueuedRecord {
        seq: 7,
        delivery: delivery_of(&message("t/x", b"queued", 1)),
    }];
    record.inflight = vec![InflightRecord {
        packet_id: 12,
        delivery: delivery_of(&message("t/y", b"in flight", 2)),
        state: InflightState::AwaitingPubRec,
    }];
    record.inbound_qos2 = vec![3];
    apply(
        &storage,
        vec![
            Change::SessionWritten(record.clone(), Vec::new()),
            Change::RetainedSet(retained("r", b"x", Some("a"))),
        ],
    )
    .await;
    must("flush", storage.flush()).await;
    let expected = load(&storage).await;
    let storage = harness.reopen(storage).await;
    assert_eq!(
        load(&storage).await,
        expected,
        "the state survives a reopen"
    );
    assert_eq!(expected.sessions, [record]);

    apply(&storage, vec![dequeued("a", 7)]).await;
    assert!(session(&storage, "a").await.queued.is_empty());
}

fn stored(id: u64, topic: &str, payload: &'static [u8]) -> Change {
    Change::MessageStored {
        message: StoredMessage {
            id,
            message: message(topic, payload, 1),
        },
    }
}

fn queue_ref(client_id: &str, seq: u64, id: u64) -> Change {
    Change::MessageQueued {
        client_id: client_id.to_string(),
        seq,
        delivery: DeliveryRecord::new(id, 1),
    }
}

fn released(id: u64) -> Change {
    Change::MessageReleased { id }
}

/// Whether message `id` is stored: a reference to it is accepted (then removed again, and
/// the probe's session deleted). Does not load (a load starts a new broker).
async fn is_stored<S: Storage>(storage: &S, id: u64) -> bool {
    let probe = vec![saved("probe"), queue_ref("probe", 1, id)];
    match storage.apply(&probe).await {
        Ok(()) => {
            let cleanup = vec![Change::SessionDeleted {
                client_id: "probe".to_string(),
            }];
            must("apply", storage.apply(&cleanup)).await;
            true
        }
        Err(error) => {
            assert_eq!(
                error.kind(),
                ErrorKind::Refused,
                "a reference to message {id}: {error}"
            );
            false
        }
    }
}

/// A message queued for N sessions is stored once; it stays while one of them refers to it
/// (queued or in flight), and goes with the last reference once released, not before.
pub async fn check_message_stored_once<S: Storage>(storage: &S) {
    let mut batch = vec![stored(1, "t/fan", b"to everyone")];
    for client in ["a", "b", "c"] {
        batch.push(saved(client));
        batch.push(queue_ref(client, 1, 1));
    }
    batch.push(Change::InflightSet {
        client_id: "c".to_string(),
        inflight: InflightRecord {
            packet_id: 4,
            delivery: DeliveryRecord::new(1, 1),
            state: InflightState::AwaitingPubAck,
        },
    });
    apply(storage, batch).await;
    let state = load(storage).await;
    assert_eq!(
        state.messages,
        [StoredMessage {
            id: 1,
            message: message("t/fan", b"to everyone", 1),
        }],
        "a message queued for three sessions is stored once"
    );
    for session in &state.sessions {
        assert_eq!(session.queued[0].delivery, DeliveryRecord::new(1, 1));
    }

    // Released while referred to: kept.
    apply(storage, vec![released(1), dequeued("a", 1)]).await;
    assert!(
        is_stored(storage, 1).await,
        "kept while b and c refer to it"
    );
    apply(storage, vec![dequeued("b", 1), dequeued("c", 1)]).await;
    assert!(is_stored(storage, 1).await, "kept while in flight for c");
    apply(
        storage,
        vec![Change::InflightRemoved {
            client_id: "c".to_string(),
            packet_id: 4,
        }],
    )
    .await;
    assert!(!is_stored(storage, 1).await, "gone with its last reference");

    // Not released: kept without references (the broker may still refer to it), until
    // released.
    apply(storage, vec![stored(2, "t", b"x"), queue_ref("a", 2, 2)]).await;
    apply(storage, vec![dequeued("a", 2)]).await;
    assert!(is_stored(storage, 2).await, "kept until released");
    apply(storage, vec![released(2)]).await;
    assert!(
        !is_stored(storage, 2).await,
        "released without references: gone"
    );
    assert!(load(storage).await.messages.is_empty());
}

/// A session deleted (by a change or by `delete_session`) or written whole takes its
/// references with it, and the released messages they kept.
pub async fn check_messages_of_deleted_sessions<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![
            saved("a"),
            saved("b"),
            saved("c"),
            stored(1, "t", b"1"),
            stored(2, "t", b"2"),
            stored(3, "t", b"3"),
            stored(4, "t", b"4"),
            queue_ref("a", 1, 1),
            queue_ref("a", 2, 4),
            queue_ref("b", 1, 2),
            queue_ref("c", 1, 3),
            queue_ref("c", 2, 4),
            released(1),
            released(2),
            released(3),
            released(4),
        ],
    )
    .await;
    apply(
        storage,
        vec![Change::SessionDeleted {
            client_id: "a".to_string(),
        }],
    )
    .await;
    assert!(!is_stored(storage, 1).await, "a's own message goes with a");
    assert!(is_stored(storage, 4).await, "c still refers to message 4");
    assert!(must("delete_session", storage.delete_session("b")).await);
    assert!(!is_stored(storage, 2).await, "b's message goes with b");
    let mut record = SessionRecord::new(header("c"));
    record.queued = vec![QueuedRecord {
        seq: 5,
        delivery: DeliveryRecord::new(4, 1),
    }];
    apply(storage, vec![Change::SessionWritten(record, Vec::new())]).await;
    assert!(
        !is_stored(storage, 3).await,
        "replaced by a written session: gone"
    );
    assert!(
        is_stored(storage, 4).await,
        "still referred to by the written session"
    );
    let state = load(storage).await;
    assert_eq!(state.messages.len(), 1);
    assert_eq!(state.messages[0].id, 4);
}

/// A refused batch stores no message and no reference; a reference to a message not stored
/// is refused.
pub async fn check_refused_batch_stores_nothing<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![saved("a"), stored(1, "t", b"1"), queue_ref("a", 1, 1)],
    )
    .await;
    let before = load(storage).await;
    let result = storage
        .apply(&[
            stored(2, "t", b"2"),
            queue_ref("a", 2, 2),
            released(1),
            dequeued("a", 1),
            queued("nobody", 1, b"lost"),
        ])
        .await;
    expect_refused(result, "a message queued for a session not stored");
    assert!(
        !is_stored(storage, 2).await,
        "the refused batch stored no message"
    );
    assert!(is_stored(storage, 1).await, "nor released or dequeued any");
    assert_eq!(
        load(storage).await,
        before,
        "a refused batch changes nothing"
    );
    expect_refused(
        storage.apply(&[queue_ref("a", 3, 99)]).await,
        "a reference to a message not stored",
    );
    expect_refused(
        storage
            .apply(&[Change::InflightSet {
                client_id: "a".to_string(),
                inflight: InflightRecord {
                    packet_id: 1,
                    delivery: DeliveryRecord::new(99, 1),
                    state: InflightState::AwaitingPubAck,
                },
            }])
            .await,
        "an in-flight reference to a message not stored",
    );
    assert_eq!(
        load(storage).await,
        before,
        "refused references change nothing"
    );
}

/// After a reopen every referred message is loaded once and nothing else: a message stored
/// but never referred to (its references given up) is gone; the new broker holds every
/// loaded message until it releases it.
pub async fn check_messages_across_reopen<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    apply(
        &storage,
        vec![
            saved("a"),
            saved("b"),
            stored(10, "t/kept", b"kept"),
            stored(11, "t/orphan", b"orphan"),
            queue_ref("a", 1, 10),
            queue_ref("b", 1, 10),
            released(10),
        ],
    )
    .await;
    must("flush", storage.flush()).await;
    let storage = harness.reopen(storage).await;
    let state = load(&storage).await;
    assert_eq!(
        state.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        [10],
        "referred messages are loaded once, orphans are gone"
    );
    assert_eq!(state.sessions.len(), 2);
    // Held by the new broker: its last reference going does not delete it...
    apply(&storage, vec![dequeued("a", 1), dequeued("b", 1)]).await;
    assert!(
        is_stored(&storage, 10).await,
        "held by the broker that loaded it"
    );
    // ...until that broker releases it.
    apply(&storage, vec![released(10)]).await;
    assert!(!is_stored(&storage, 10).await);
}

/// A fan-out of many messages to two sessions in one batch, then removals and replacements
/// inside the queue, appends, and deletions: every queue reads back in order with its
/// messages after a reopen, and each message counts its references across batches and
/// reopens (kept while one session refers to it, gone with its last reference once
/// released).
pub async fn check_fan_out_references<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    let mut batch = vec![saved("a"), saved("b")];
    for id in 1..=300 {
        batch.push(stored(id, "t/fan", b"m"));
    }
    for seq in 1..=300 {
        batch.push(queue_ref("a", seq, seq));
        batch.push(queue_ref("b", seq, seq));
    }
    apply(&storage, batch).await;
    let mut batch: Vec<Change> = (1..=100).map(|seq| dequeued("a", seq)).collect();
    // Replaced in the middle of the queue, then appended after it.
    batch.push(dequeued("a", 150));
    batch.push(queue_ref("a", 150, 300));
    batch.push(queue_ref("a", 200, 1));
    for seq in 301..=310 {
        batch.push(queue_ref("a", seq, seq - 300));
    }
    apply(&storage, batch).await;
    apply(&storage, (1..=300).map(released).collect()).await;
    must("flush", storage.flush()).await;
    let storage = harness.reopen(storage).await;
    let state = load(&storage).await;
    let a = state.sessions.iter().find(|s| s.client_id == "a");
    let b = state.sessions.iter().find(|s| s.client_id == "b");
    let (Some(a), Some(b)) = (a, b) else {
        panic!("both sessions come back: {:?}", state.set_aside);
    };
    let expected: Vec<u64> = (101..=310).collect();
    assert_eq!(seqs(a), expected, "a's queue, in order");
    let ids: Vec<u64> = a.queued.iter().map(|q| q.delivery.message_id).collect();
    let mut want: Vec<u64> = (101..=300).collect();
    want[150 - 101] = 300;
    want[200 - 101] = 1;
    want.extend(1..=10);
    assert_eq!(ids, want, "a's queue refers to its messages");
    assert_eq!(seqs(b), (1..=300).collect::<Vec<u64>>(), "b's queue");
    assert_eq!(state.messages.len(), 300, "every message is referred to");

    // The new broker holds every message it loaded; released again, each goes with its
    // last reference.
    apply(&storage, (1..=300).map(released).collect()).await;
    apply(
        &storage,
        vec![Change::SessionDeleted {
            client_id: "b".to_string(),
        }],
    )
    .await;
    assert!(is_stored(&storage, 1).await, "a still refers to message 1");
    assert!(
        !is_stored(&storage, 50).await,
        "only b referred to message 50"
    );
    let storage = harness.reopen(storage).await;
    let state = load(&storage).await;
    assert_eq!(
        state.messages.len(),
        208,
        "the messages a refers to: 101..=300 but 150 and 200, and 1..=10"
    );
    apply(&storage, vec![queue_ref("a", 311, 300)]).await;
    apply(&storage, (1..=300).map(released).collect()).await;
    apply(
        &storage,
        (101..=310).map(|seq| dequeued("a", seq)).collect(),
    )
    .await;
    assert!(is_stored(&storage, 300).await, "queued again for a");
    assert!(!is_stored(&storage, 1).await, "dequeued and released: gone");
    apply(&storage, vec![dequeued("a", 311)]).await;
    assert!(!is_stored(&storage, 300).await, "its last reference went");
    assert!(load(&storage).await.messages.is_empty());
}

/// Fan-outs (batches where each session's only changes are deliveries queued) that do more
/// than append: a delivery queued below a session's last stored position, one replacing a
/// stored position (its former message loses that reference), and one after a queue longer
/// than a backend's chunk; then removals across the whole queue. Every queue reads back in
/// order after a reopen, and each message goes with its last reference once released.
pub async fn check_fan_out_into_stored_queues<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    let mut batch = vec![saved("a"), saved("b")];
    for id in 1..=10 {
        batch.push(stored(id, "t/fan", b"m"));
    }
    for seq in 1..=10 {
        batch.push(queue_ref("a", seq * 10, seq));
        batch.push(queue_ref("b", seq * 10, seq));
    }
    // b's queue: longer than a chunk.
    batch.push(stored(12, "t/long", b"l"));
    for seq in 1000..1600 {
        batch.push(queue_ref("b", seq, 12));
    }
    apply(&storage, batch).await;
    apply(
        &storage,
        vec![
            stored(11, "t/fan", b"new"),
            queue_ref("a", 15, 11),
            queue_ref("a", 20, 11),
            queue_ref("b", 2000, 11),
        ],
    )
    .await;
    apply(&storage, (1..=12).map(released).collect()).await;
    must("flush", storage.flush()).await;
    let storage = harness.reopen(storage).await;
    let state = load(&storage).await;
    let a = state.sessions.iter().find(|s| s.client_id == "a");
    let b = state.sessions.iter().find(|s| s.client_id == "b");
    let (Some(a), Some(b)) = (a, b) else {
        panic!("both sessions come back: {:?}", state.set_aside);
    };
    let mut want: Vec<u64> = (1..=10).map(|seq| seq * 10).collect();
    want.insert(1, 15);
    assert_eq!(seqs(a), want, "a's queue, in order");
    let ids: Vec<u64> = a.queued.iter().map(|q| q.delivery.message_id).collect();
    assert_eq!(
        ids,
        [1, 11, 11, 3, 4, 5, 6, 7, 8, 9, 10],
        "a's replaced delivery"
    );
    let mut want: Vec<u64> = (1..=10).map(|seq| seq * 10).collect();
    want.extend(1000..1600);
    want.push(2000);
    assert_eq!(seqs(b), want, "b's queue, in order");
    assert_eq!(state.messages.len(), 12, "every message is referred to");

    // b's deliveries removed across its chunks, every other one, then the rest: message 2
    // goes with b's reference (a's was replaced), 12 with the last of the long run.
    apply(&storage, (1..=12).map(released).collect()).await;
    let mut batch: Vec<Change> = (1000..1600)
        .step_by(2)
        .map(|seq| dequeued("b", seq))
        .collect();
    batch.push(dequeued("b", 20));
    apply(&storage, batch).await;
    assert!(!is_stored(&storage, 2).await, "no reference to 2 is left");
    assert!(is_stored(&storage, 12).await, "b still refers to 12");
    let state = load(&storage).await;
    let b = state.sessions.iter().find(|s| s.client_id == "b");
    let Some(b) = b else {
        panic!("b comes back: {:?}", state.set_aside);
    };
    let mut want: Vec<u64> = (1..=10).filter(|s| *s != 2).map(|seq| seq * 10).collect();
    want.extend((1001..1600).step_by(2));
    want.push(2000);
    assert_eq!(seqs(b), want, "b's queue after the removals");
    apply(&storage, (1..=12).map(released).collect()).await;
    apply(
        &storage,
        (1001..1600)
            .step_by(2)
            .map(|seq| dequeued("b", seq))
            .collect(),
    )
    .await;
    assert!(!is_stored(&storage, 12).await, "its last reference went");
    assert!(is_stored(&storage, 11).await, "a and b still refer to 11");
}

/// An in-flight entry set, updated and removed within one batch leaves nothing, and an entry
/// stored before is removed; their messages go with their last reference once released.
pub async fn check_inflight_set_twice_then_removed<S: Storage>(storage: &S) {
    use InflightState::*;
    let set = |packet_id: u16, id: u64, state| Change::InflightSet {
        client_id: "a".to_string(),
        inflight: InflightRecord {
            packet_id,
            delivery: DeliveryRecord::new(id, 1),
            state,
        },
    };
    let removed = |packet_id| Change::InflightRemoved {
        client_id: "a".to_string(),
        packet_id,
    };
    apply(
        storage,
        vec![saved("a"), stored(1, "t", b"1"), set(9, 1, AwaitingPubRec)],
    )
    .await;
    apply(
        storage,
        vec![
            stored(2, "t", b"2"),
            stored(3, "t", b"3"),
            set(1, 2, AwaitingPubRec),
            set(1, 3, AwaitingPubComp),
            set(2, 3, AwaitingPubAck),
            removed(1),
            set(9, 2, AwaitingPubComp),
            removed(9),
            released(1),
            released(2),
            released(3),
        ],
    )
    .await;
    assert_eq!(
        packet_ids(&session(storage, "a").await),
        [(2, AwaitingPubAck)],
        "only the entry not removed"
    );
    assert!(!is_stored(storage, 1).await, "its entry was removed");
    assert!(
        !is_stored(storage, 2).await,
        "never referred to after the batch"
    );
    assert!(is_stored(storage, 3).await, "in flight as packet 2");
}

/// A session that can't be read is set aside (the rest loads), and `delete_session` clears
/// it. Skipped if the harness can't make a session unreadable.
pub async fn check_set_aside<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    apply(
        &storage,
        vec![
            saved("good"),
            saved("bad"),
            queued("bad", 1, b"x"),
            subscribed("bad", "t", 1),
        ],
    )
    .await;
    if !harness.make_unreadable(&storage, "bad").await {
        return;
    }
    let state = load(&storage).await;
    assert_eq!(client_ids(&state), ["good"]);
    assert_eq!(state.set_aside.len(), 1);
    assert_eq!(state.set_aside[0].client_id, "bad");
    assert!(!state.set_aside[0].cause.is_empty(), "the cause is given");

    assert!(must("delete_session", storage.delete_session("bad")).await);
    let state = load(&storage).await;
    assert!(state.set_aside.is_empty(), "delete_session clears it");
    assert_eq!(client_ids(&state), ["good"]);

    apply(&storage, vec![saved("bad")]).await;
    assert_eq!(
        session(&storage, "bad").await,
        SessionRecord::new(header("bad")),
        "its client starts a new session"
    );
}

/// Access records: stored, replaced, deleted (deleting a missing one does nothing), returned
/// sorted by kind then name, kept across a reopen; a change with an empty name is refused and
/// its whole call stores nothing.
pub async fn check_access_records<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    assert_eq!(must("load_access", storage.load_access()).await, []);
    let record = |kind, name: &str, body: &str| AccessRecord {
        kind,
        name: name.to_string(),
        body: body.to_string(),
    };
    must(
        "apply_access",
        storage.apply_access(&[
            AccessChange::Put(record(AccessKind::Role, "r", "{\"rules\":[]}")),
            AccessChange::Put(record(AccessKind::User, "bob", "1")),
            AccessChange::Put(record(AccessKind::User, "alice", "1")),
            AccessChange::Put(record(AccessKind::Group, "g", "é ünïcode")),
            AccessChange::Put(record(AccessKind::User, "alice", "2")),
            AccessChange::Deleted {
                kind: AccessKind::Group,
                name: "none".into(),
            },
        ]),
    )
    .await;
    let expected = vec![
        record(AccessKind::User, "alice", "2"),
        record(AccessKind::User, "bob", "1"),
        record(AccessKind::Group, "g", "é ünïcode"),
        record(AccessKind::Role, "r", "{\"rules\":[]}"),
    ];
    assert_eq!(must("load_access", storage.load_access()).await, expected);
    let refused = storage
        .apply_access(&[
            AccessChange::Deleted {
                kind: AccessKind::User,
                name: "bob".into(),
            },
            AccessChange::Put(record(AccessKind::User, "", "x")),
        ])
        .await
        .expect_err("an empty name is refused");
    assert!(refused.is_refused(), "{refused}");
    assert_eq!(must("load_access", storage.load_access()).await, expected);
    must(
        "apply_access",
        storage.apply_access(&[AccessChange::Deleted {
            kind: AccessKind::User,
            name: "bob".into(),
        }]),
    )
    .await;
    must("flush", storage.flush()).await;
    let storage = harness.reopen(storage).await;
    let mut left = expected;
    left.remove(1);
    assert_eq!(
        must("load_access", storage.load_access()).await,
        left,
        "the access records survive a reopen"
    );
}

fn appended(stream: &str, offset: u64, id: u64) -> Change {
    Change::StreamAppended {
        stream: stream.to_string(),
        entry: StreamEntryRecord {
            offset,
            time_ms: 1_000 + offset,
            message_id: id,
        },
    }
}

/// The stream's next offset (from `state`) and its entries (offset, message id), read back.
async fn offsets<S: Storage>(
    storage: &S,
    state: &LoadedState,
    stream: &str,
) -> (u64, Vec<(u64, u64)>) {
    let s = state
        .streams
        .iter()
        .find(|s| s.name == stream)
        .unwrap_or_else(|| panic!("stream {stream} stored: {:?}", state.streams));
    let entries = must(
        "read_stream",
        storage.read_stream(stream, 0, 0, 1000, u64::MAX),
    )
    .await;
    (
        s.next_offset,
        entries
            .iter()
            .map(|e| (e.entry.offset, e.entry.message_id))
            .collect(),
    )
}

/// Stream entries refer to stored messages like queued deliveries: a message stays while an
/// entry refers to it, and goes with its last reference once released; retention removes
/// entries below an offset (the offsets go on above it) or one entry; a deleted stream takes
/// its entries with it.
pub async fn check_streams<S: Storage>(storage: &S) {
    apply(
        storage,
        vec![
            stored(1, "t/a", b"1"),
            stored(2, "t/b", b"2"),
            stored(3, "t/a", b"3"),
            appended("s", 1, 1),
            appended("s", 2, 2),
            appended("s", 3, 3),
            appended("all", 7, 1),
        ],
    )
    .await;
    expect_refused(
        storage.apply(&[appended("s", 4, 99)]).await,
        "an entry referring to a message not stored",
    );
    let definition = StreamDefinition {
        filter: "t/#".into(),
        max_age: 10_800,
        max_bytes: 10 << 20,
        last_value: true,
    };
    apply(
        storage,
        vec![
            Change::StreamDefined {
                stream: "created".into(),
                definition: definition.clone(),
            },
            appended("created", 1, 2),
        ],
    )
    .await;
    let state = load(storage).await;
    let created = state.streams.iter().find(|s| s.name == "created").unwrap();
    assert_eq!(created.definition.as_ref(), Some(&definition));
    assert_eq!(offsets(storage, &state, "created").await, (2, vec![(1, 2)]));
    apply(
        storage,
        vec![Change::StreamDeleted {
            stream: "created".into(),
        }],
    )
    .await;
    let state = load(storage).await;
    assert_eq!(
        state
            .streams
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>(),
        ["all", "s"],
        "streams sorted by name"
    );
    assert_eq!(
        offsets(storage, &state, "s").await,
        (4, vec![(1, 1), (2, 2), (3, 3)])
    );
    assert_eq!(
        state.streams[1].definition, None,
        "a stream with entries only"
    );
    assert_eq!(offsets(storage, &state, "all").await, (8, vec![(7, 1)]));
    let s = &state.streams[1];
    assert_eq!(
        (s.first_offset, s.first_time_ms, s.messages, s.bytes),
        (1, 1_001, 3, 12),
        "a stream's counters: its first entry, its entries, their bytes (3 + 1 each)"
    );
    assert!(
        state.messages.is_empty(),
        "messages only streams refer to are not loaded: {:?}",
        state.messages
    );
    assert_eq!(
        state.max_message_id, 3,
        "the highest id stored, loaded or not"
    );

    apply(storage, vec![released(1), released(2), released(3)]).await;
    assert!(
        is_stored(storage, 2).await,
        "kept while a stream refers to it"
    );
    apply(
        storage,
        vec![Change::StreamTrimmed {
            stream: "s".into(),
            below: 3,
        }],
    )
    .await;
    assert!(!is_stored(storage, 2).await, "trimmed and released: gone");
    assert!(is_stored(storage, 1).await, "still in the stream all");
    apply(
        storage,
        vec![Change::StreamEntryRemoved {
            stream: "s".into(),
            offset: 3,
        }],
    )
    .await;
    assert!(!is_stored(storage, 3).await, "its entry removed: gone");
    apply(
        storage,
        vec![Change::StreamDeleted {
            stream: "all".into(),
        }],
    )
    .await;
    assert!(!is_stored(storage, 1).await, "its stream deleted: gone");
    let state = load(storage).await;
    assert_eq!(
        offsets(storage, &state, "s").await,
        (4, vec![]),
        "an emptied stream keeps its next offset"
    );
    let s = &state.streams[0];
    assert_eq!(
        (s.first_offset, s.messages, s.bytes),
        (4, 0, 0),
        "an empty stream starts at its next offset"
    );
    assert_eq!(state.streams.len(), 1);
    apply(
        storage,
        vec![Change::StreamTrimmed {
            stream: "s".into(),
            below: 10,
        }],
    )
    .await;
    let state = load(storage).await;
    assert_eq!(offsets(storage, &state, "s").await.0, 10);
}

/// A stream is read back in batches from an offset or a time, its entries with their
/// messages, as its appends, trims and removals left it; a message a session also refers to
/// is loaded (and held) as any queued one.
pub async fn check_read_stream<S: Storage>(storage: &S) {
    let mut batch = Vec::new();
    for id in 1..=5u64 {
        batch.push(stored(id, "t/a", b"m"));
        batch.push(appended("s", id, id));
    }
    batch.push(saved("c"));
    batch.push(queue_ref("c", 1, 5));
    apply(storage, batch).await;
    let read = |from: u64, time: u64, max: usize| async move {
        must(
            "read_stream",
            storage.read_stream("s", from, time, max, u64::MAX),
        )
        .await
        .iter()
        .map(|e| e.entry.offset)
        .collect::<Vec<_>>()
    };
    assert_eq!(read(2, 0, 2).await, [2, 3], "from an offset, at most max");
    // Bounded in bytes: the first entries, at least one, each message counted once read.
    let within = must("read_stream", storage.read_stream("s", 2, 0, 10, 1)).await;
    let offsets: Vec<u64> = within.iter().map(|e| e.entry.offset).collect();
    assert!(
        !offsets.is_empty()
            && offsets.len() <= 4
            && offsets == (2..2 + offsets.len() as u64).collect::<Vec<_>>(),
        "a prefix of the entries from the offset: {offsets:?}"
    );
    let all = must("read_stream", storage.read_stream("s", 1, 0, 3, u64::MAX)).await;
    assert!((1..=3).contains(&all.len()), "at most max: {}", all.len());
    assert_eq!(read(0, 1_004, 10).await, [4, 5], "from a time");
    assert_eq!(read(6, 0, 10).await, Vec::<u64>::new(), "read to its end");
    let first = must("read_stream", storage.read_stream("s", 1, 0, 1, u64::MAX)).await;
    assert_eq!(first.len(), 1);
    assert_eq!(
        (first[0].entry.time_ms, first[0].entry.message_id),
        (1_001, 1)
    );
    assert_eq!(
        first[0].message,
        message("t/a", b"m", 1),
        "with its message"
    );
    assert!(
        must(
            "read_stream",
            storage.read_stream("none", 0, 0, 10, u64::MAX)
        )
        .await
        .is_empty(),
        "a stream not stored reads empty"
    );
    apply(storage, vec![appended("s", 5, 4)]).await;
    let again = must("read_stream", storage.read_stream("s", 5, 0, 1, u64::MAX)).await;
    assert_eq!(
        again.iter().map(|e| e.entry.message_id).collect::<Vec<_>>(),
        [4],
        "an entry written again at its offset replaces it"
    );
    apply(storage, vec![appended("s", 5, 5)]).await;
    apply(
        storage,
        vec![
            Change::StreamEntryRemoved {
                stream: "s".into(),
                offset: 3,
            },
            Change::StreamTrimmed {
                stream: "s".into(),
                below: 2,
            },
        ],
    )
    .await;
    assert_eq!(
        read(0, 0, 3).await,
        [2, 4, 5],
        "trimmed and removed entries go"
    );
    let state = load(storage).await;
    assert_eq!(
        state.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        [5],
        "a message a session refers to is loaded, one only a stream refers to is not"
    );
    let s = &state.streams[0];
    assert_eq!(
        (s.first_offset, s.first_time_ms, s.messages, s.bytes),
        (2, 1_002, 3, 12)
    );
    apply(
        storage,
        vec![Change::StreamTrimmed {
            stream: "s".into(),
            below: 6,
        }],
    )
    .await;
    for id in 2..=4 {
        assert!(
            !is_stored(storage, id).await,
            "message {id}, not held after the load, goes with its last entry"
        );
    }
    assert!(is_stored(storage, 5).await, "still queued");
    // Messages only a stream holds: 4 bytes each (topic "t/b", payload "m"), so a bound of
    // 5 bytes stops after the second, the one that reaches it.
    let mut only_stream = Vec::new();
    for id in 11..=14u64 {
        only_stream.push(stored(id, "t/b", b"m"));
        only_stream.push(appended("b", id, id));
    }
    apply(storage, only_stream).await;
    let bounded = must("read_stream", storage.read_stream("b", 0, 0, 10, 5)).await;
    assert_eq!(
        bounded.iter().map(|e| e.entry.offset).collect::<Vec<_>>(),
        [11, 12],
        "bounded in bytes: up to the entry whose message reaches the bound"
    );
}

/// Streams and the messages they refer to survive a reopen; the messages nothing refers to
/// any more are gone.
pub async fn check_streams_across_reopen<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    apply(
        &storage,
        vec![
            stored(1, "t", b"kept"),
            stored(2, "t", b"trimmed"),
            appended("s", 1, 2),
            appended("s", 2, 1),
            Change::StreamTrimmed {
                stream: "s".into(),
                below: 2,
            },
            released(1),
            released(2),
        ],
    )
    .await;
    let storage = harness.reopen(storage).await;
    let state = load(&storage).await;
    assert_eq!(offsets(&storage, &state, "s").await, (3, vec![(2, 1)]));
    let read = must("read_stream", storage.read_stream("s", 0, 0, 10, u64::MAX)).await;
    assert_eq!(
        read.iter().map(|e| e.message.clone()).collect::<Vec<_>>(),
        [message("t", b"kept", 1)]
    );
    assert_eq!(state.max_message_id, 1, "the trimmed message is gone");
}

/// A segment of `stream`: entries at `offsets`, each with its own message (payload: the
/// offset in decimal) stored under id `1000 + offset`.
fn segment(stream: &str, offsets: std::ops::RangeInclusive<u64>) -> Change {
    Change::StreamSegment {
        stream: stream.to_string(),
        entries: offsets
            .map(|offset| StreamAppend {
                entry: StreamEntryRecord {
                    offset,
                    time_ms: 1_000 + offset,
                    message_id: 1_000 + offset,
                },
                message: MessageRecord::new("seg/t", offset.to_string(), 1),
            })
            .collect(),
    }
}

/// The payloads of `stream`'s entries read back, by offset.
async fn payloads<S: Storage>(storage: &S, stream: &str) -> Vec<(u64, String)> {
    must(
        "read_stream",
        storage.read_stream(stream, 0, 0, 1000, u64::MAX),
    )
    .await
    .iter()
    .map(|e| {
        (
            e.entry.offset,
            String::from_utf8_lossy(&e.message.payload).into_owned(),
        )
    })
    .collect()
}

/// A stream's appends as segments, each entry with the message only it refers to: read
/// back with their messages in offset order, mixed in one batch with entries referring to
/// the message store, trimmed and removed like any entry (their messages go with them:
/// released at once), counted at the load and kept across a reopen; a segment whose offsets
/// do not increase is refused.
pub async fn check_stream_segments<H: Harness>(harness: &mut H) {
    let storage = harness.fresh().await;
    apply(&storage, vec![segment("s", 1..=3)]).await;
    let expected = |r: std::ops::RangeInclusive<u64>| -> Vec<(u64, String)> {
        r.map(|o| (o, o.to_string())).collect()
    };
    assert_eq!(payloads(&storage, "s").await, expected(1..=3));
    // One batch: a segment, an entry referring to the message store, a segment, a trim.
    apply(
        &storage,
        vec![
            segment("s", 4..=5),
            stored(7, "t/a", b"6"),
            appended("s", 6, 7),
            segment("s", 7..=9),
            Change::StreamTrimmed {
                stream: "s".into(),
                below: 3,
            },
            released(7),
        ],
    )
    .await;
    assert_eq!(payloads(&storage, "s").await, expected(3..=9));
    assert!(
        must("load_messages", storage.load_messages(&[1_001, 1_002]))
            .await
            .is_empty(),
        "trimmed: their messages went with them"
    );
    apply(
        &storage,
        vec![Change::StreamEntryRemoved {
            stream: "s".into(),
            offset: 8,
        }],
    )
    .await;
    let mut left = expected(3..=9);
    left.retain(|(o, _)| *o != 8);
    assert_eq!(payloads(&storage, "s").await, left);
    expect_refused(
        storage
            .apply(&[Change::StreamSegment {
                stream: "s".into(),
                entries: match segment("s", 10..=11) {
                    Change::StreamSegment { mut entries, .. } => {
                        entries.reverse();
                        entries
                    }
                    _ => unreachable!(),
                },
            }])
            .await,
        "a segment whose offsets do not increase",
    );
    let state = load(&storage).await;
    let s = state.streams.iter().find(|s| s.name == "s").unwrap();
    assert_eq!(
        (s.next_offset, s.first_offset, s.messages, s.bytes),
        (10, 3, 6, 5 * 6 + 4),
        "counters: 6 entries (seg/t or t/a, and one digit each)"
    );
    assert!(
        state.messages.is_empty(),
        "messages only a stream refers to are not loaded: {:?}",
        state.messages
    );
    assert!(state.max_message_id >= 1_009, "the segments' ids are taken");
    let storage = harness.reopen(storage).await;
    assert_eq!(payloads(&storage, "s").await, left, "kept across a reopen");
    apply(
        &storage,
        vec![
            segment("s", 10..=10),
            Change::StreamTrimmed {
                stream: "s".into(),
                below: 10,
            },
        ],
    )
    .await;
    assert_eq!(payloads(&storage, "s").await, expected(10..=10));
    assert!(!is_stored(&storage, 7).await, "trimmed and released: gone");
    apply(&storage, vec![Change::StreamDeleted { stream: "s".into() }]).await;
    assert!(payloads(&storage, "s").await.is_empty());
}
