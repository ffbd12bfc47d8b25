//! The storage writer's handling of a backend that refuses changes: a batch refused five times
//! is given up and its client written whole once storage takes writes again (on the memory
//! backend's failure injection; docs/operations.md, "Persistence"); durable_ack never
//! acknowledges what storage did not commit; a queue left in storage at a restart, when the
//! client is made dirty or storage cannot read it when the client comes back.
use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mercurio::codec::{Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode};
use mercurio::storage::{ErrorKind, MemoryStorage, StorageError};
use mercurio::{Broker, BrokerHandle};

#[tokio::test]
async fn refused_changes_are_given_up_and_the_client_written_whole() {
    let storage = MemoryStorage::new();
    let mut config = test_config();
    config.storage.durable_ack = false;
    let broker = Broker::builder(config)
        .storage(Arc::new(storage.clone()))
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("a", QoS::AtLeastOnce).await;
    broker.flush_storage().await;
    storage.fail_next(ErrorKind::Refused, 5);
    sub.subscribe("b", QoS::AtLeastOnce).await;
    // Given up after five attempts; the client is then written whole.
    tokio::time::timeout(DEADLINE, async {
        while broker.stats().storage_batches_dropped == 0 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the batch is given up");
    sub.subscribe("c", QoS::AtLeastOnce).await;
    tokio::time::timeout(
        DEADLINE,
        storage.wait_until(|s| {
            s.sessions.iter().any(|r| {
                r.client_id == "sub"
                    && r.subscriptions
                        .iter()
                        .map(|s| s.filter.as_str())
                        .collect::<Vec<_>>()
                        == ["a", "b", "c"]
            })
        }),
    )
    .await
    .expect("the dirty client is written whole");
    assert_eq!(broker.stats().storage_clients_dirty, 0);
    assert!(broker.stats().storage_batches_retried >= 4);
    broker.shutdown().await;
}

/// A client made dirty while its queue is still in storage after a restart (a message queued
/// for it given up) is written whole with that queue read back first: nothing of it is lost,
/// and its client gets every message in order after the next restart.
#[tokio::test]
async fn a_dirty_client_with_its_queue_left_in_storage_is_written_whole() {
    let storage = MemoryStorage::new();
    let start = || async {
        let mut config = test_config();
        config.storage.durable_ack = false;
        let broker = Broker::builder(config)
            .storage(Arc::new(storage.clone()))
            .start()
            .await
            .unwrap();
        let addr = broker.local_addrs()[0];
        (broker, addr)
    };
    let publish = |addr: SocketAddr, range: std::ops::Range<u32>| async move {
        let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
        for i in range {
            publisher
                .publish("a", format!("m{i}").as_bytes(), QoS::AtLeastOnce, false)
                .await;
        }
        publisher.disconnect().await;
    };
    let (broker, addr) = start().await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("a", QoS::AtLeastOnce).await;
    sub.disconnect().await;
    publish(addr, 0..5).await;
    broker.shutdown().await;

    let (broker, addr) = start().await;
    storage.fail_next(ErrorKind::Refused, 5);
    publish(addr, 5..6).await;
    tokio::time::timeout(DEADLINE, async {
        while broker.stats().storage_batches_dropped == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the batch is given up");
    publish(addr, 6..7).await;
    let queued = |s: &mercurio::storage::LoadedState| {
        s.sessions
            .iter()
            .find(|r| r.client_id == "sub")
            .map(|r| r.queued.iter().map(|q| q.seq).collect::<Vec<_>>())
    };
    tokio::time::timeout(
        DEADLINE,
        storage.wait_until(|s| queued(s).is_some_and(|q| q.len() == 7)),
    )
    .await
    .expect("the dirty client is written whole, its stored queue included");
    assert_eq!(queued(&storage.snapshot()), Some((1..=7).collect()));
    assert_eq!(broker.stats().storage_clients_dirty, 0);
    broker.shutdown().await;

    let (broker, addr) = start().await;
    let (mut sub, present) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    assert!(present);
    for i in 0..7 {
        let p = sub.expect_publish().await;
        assert_eq!(&p.payload[..], format!("m{i}").as_bytes(), "in order");
        sub.ack(&p).await;
    }
    sub.expect_nothing(Duration::from_millis(200)).await;
    broker.shutdown().await;
}

/// Memory storage whose `load_queue` fails while `failing` is set: storage that cannot be
/// read when a client comes back for its queue.
#[derive(Clone)]
struct UnreadableQueues {
    inner: MemoryStorage,
    failing: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl mercurio::storage::Storage for UnreadableQueues {
    fn name(&self) -> &'static str {
        "memory"
    }
    async fn load(&self) -> Result<mercurio::storage::LoadedState, StorageError> {
        self.inner.load().await
    }
    async fn load_without_queues(&self) -> Result<mercurio::storage::LoadedState, StorageError> {
        self.inner.load_without_queues().await
    }
    async fn load_queue(
        &self,
        client_id: &str,
    ) -> Result<Vec<mercurio::storage::QueuedRecord>, StorageError> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(StorageError::fatal("the database is closed"));
        }
        self.inner.load_queue(client_id).await
    }
    async fn load_messages(
        &self,
        ids: &[u64],
    ) -> Result<Vec<mercurio::storage::StoredMessage>, StorageError> {
        self.inner.load_messages(ids).await
    }
    async fn read_stream(
        &self,
        stream: &str,
        from_offset: u64,
        from_time_ms: u64,
        max: usize,
        max_bytes: u64,
    ) -> Result<Vec<mercurio::storage::StreamEntryRead>, StorageError> {
        self.inner
            .read_stream(stream, from_offset, from_time_ms, max, max_bytes)
            .await
    }
    async fn apply(&self, batch: &[mercurio::storage::Change]) -> Result<(), StorageError> {
        self.inner.apply(batch).await
    }
    async fn delete_session(&self, client_id: &str) -> Result<bool, StorageError> {
        self.inner.delete_session(client_id).await
    }
    async fn load_access(&self) -> Result<Vec<mercurio::storage::AccessRecord>, StorageError> {
        self.inner.load_access().await
    }
    async fn apply_access(
        &self,
        changes: &[mercurio::storage::AccessChange],
    ) -> Result<(), StorageError> {
        self.inner.apply_access(changes).await
    }
    async fn flush(&self) -> Result<(), StorageError> {
        self.inner.flush().await
    }
}

/// A client whose queue, left in storage at the restart, cannot be read when it comes back
/// is refused (Server unavailable), its session kept: once storage reads again, it resumes
/// with every message.
#[tokio::test]
async fn a_queue_that_cannot_be_read_yet_refuses_the_client_and_keeps_the_session() {
    let storage = UnreadableQueues {
        inner: MemoryStorage::new(),
        failing: Arc::default(),
    };
    let start = || async {
        let broker = Broker::builder(test_config())
            .storage(Arc::new(storage.clone()))
            .start()
            .await
            .unwrap();
        let addr = broker.local_addrs()[0];
        (broker, addr)
    };
    let (broker, addr) = start().await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("a", QoS::AtLeastOnce).await;
    sub.disconnect().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for i in 0..3 {
        publisher
            .publish("a", format!("m{i}").as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    publisher.disconnect().await;
    broker.shutdown().await;

    let (broker, addr) = start().await;
    storage
        .failing
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (_, ack) = Client::connect_with(addr, persistent(ProtocolVersion::V5, "sub", 300)).await;
    assert_eq!(ack.reason_code, ReasonCode::SERVER_UNAVAILABLE);
    assert_eq!(
        broker.session_detail("sub").map(|d| d.info.queued),
        Some(3),
        "the session and its count are kept"
    );
    storage
        .failing
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let (mut sub, present) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    assert!(present);
    for i in 0..3 {
        let p = sub.expect_publish().await;
        assert_eq!(&p.payload[..], format!("m{i}").as_bytes());
        sub.ack(&p).await;
    }
    broker.shutdown().await;
}

/// durable_ack: PUBCOMP waits for the commit of the PUBREL's removal, as PUBACK and PUBREC
/// wait for theirs. Sent before it, a crash left the identifier "awaiting release" and the
/// client's next QoS 2 message reusing it was answered and never routed.
#[tokio::test]
async fn durable_ack_sends_pubcomp_after_the_release_is_committed() {
    let storage = MemoryStorage::new();
    let mut config = test_config();
    config.storage.durable_ack = true;
    let broker = Broker::builder(config)
        .storage(Arc::new(storage.clone()))
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let (mut c, _) = connect_persistent(addr, ProtocolVersion::V5, "q2").await;
    c.send(Packet::Publish(Publish {
        dup: false,
        qos: QoS::ExactlyOnce,
        retain: false,
        topic: "t".into(),
        packet_id: 7,
        properties: Properties::default(),
        payload: bytes::Bytes::from_static(b"x"),
    }))
    .await;
    assert!(matches!(c.expect_packet().await, Packet::PubRec(_)));
    let stored_ids = || {
        storage
            .snapshot()
            .sessions
            .iter()
            .find(|s| s.client_id == "q2")
            .map(|s| s.inbound_qos2.clone())
            .unwrap_or_default()
    };
    assert_eq!(stored_ids(), vec![7]);
    // Storage unavailable for a while: the release cannot be committed yet.
    storage.fail_next(ErrorKind::Transient, 4);
    c.send(Packet::PubRel(PubAck {
        packet_id: 7,
        ..PubAck::default()
    }))
    .await;
    assert!(matches!(c.expect_packet().await, Packet::PubComp(_)));
    assert_eq!(stored_ids(), Vec::<u16>::new(), "PUBCOMP before the commit");
    broker.shutdown().await;
}

/// A memory-storage broker with `durable_ack` and two offline persistent subscribers to
/// `fan/t`.
async fn two_offline_subscribers(durable_ack: bool) -> (BrokerHandle, MemoryStorage, SocketAddr) {
    let storage = MemoryStorage::new();
    let mut config = test_config();
    config.storage.durable_ack = durable_ack;
    let broker = Broker::builder(config)
        .storage(Arc::new(storage.clone()))
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    for id in ["fan-a", "fan-b"] {
        let (mut c, _) = connect_persistent(addr, ProtocolVersion::V5, id).await;
        c.subscribe("fan/t", QoS::AtLeastOnce).await;
        c.disconnect().await;
    }
    broker.flush_storage().await;
    (broker, storage, addr)
}

/// durable_ack: an acknowledgement whose changes storage gave up is never sent; the
/// connection is closed instead (5.0: DISCONNECT 0x80), so the client sends the message again.
#[tokio::test]
async fn durable_ack_never_acknowledges_what_was_given_up() {
    let (broker, storage, addr) = two_offline_subscribers(true).await;
    storage.fail_next(ErrorKind::Refused, 10);
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "fan-pub").await;
    publisher
        .send(Packet::Publish(Publish {
            dup: false,
            qos: QoS::AtLeastOnce,
            retain: false,
            topic: "fan/t".into(),
            packet_id: 1,
            properties: Properties::default(),
            payload: bytes::Bytes::from_static(b"m"),
        }))
        .await;
    assert_eq!(
        publisher.expect_disconnect().await,
        Some(ReasonCode::UNSPECIFIED_ERROR),
        "closed, not acknowledged"
    );
    // Storage back: the same publish is acknowledged.
    let mut again = Client::connect(addr, ProtocolVersion::V5, "fan-pub").await;
    let rc = again.publish("fan/t", b"m", QoS::AtLeastOnce, false).await;
    assert_eq!(rc, ReasonCode::SUCCESS);
    broker.shutdown().await;
}
