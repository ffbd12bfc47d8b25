//! The storage writer's handling of a backend that refuses changes: a batch refused five times
//! is given up and its client written whole once storage takes writes again (on the memory
//! backend's failure injection; docs/operations.md, "Persistence"); durable_ack never
//! acknowledges what storage did not commit.
use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mercurio::codec::{Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode};
use mercurio::storage::{ErrorKind, MemoryStorage};
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
