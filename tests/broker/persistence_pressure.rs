//! Storage back pressure and storage that takes no writes (docs/operations.md, "Persistence"),
//! on the memory backend's failure injection: the bytes waiting for storage are owed by the
//! publisher whose messages they are, which is not read while it owes more than
//! `[storage] max_pending_bytes`; storage failing every write is reported (`/healthz` 503,
//! `storage/unwritable`) while clients that need no storage are served, until it recovers.
use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::*;
use mercurio::codec::{Packet, Properties, ProtocolVersion, Publish, QoS};
use mercurio::config::Config;
use mercurio::storage::{ErrorKind, MemoryStorage};
use mercurio::{Broker, BrokerHandle};

const SUBSCRIBERS: usize = 20;
const MESSAGES: u16 = 100;

/// A broker on `storage` with `config`, and `n` offline persistent subscribers to `topic`
/// (QoS 1), stored.
async fn offline_subscribers(
    config: Config,
    storage: &MemoryStorage,
    n: usize,
    topic: &str,
) -> (BrokerHandle, SocketAddr) {
    let broker = Broker::builder(config)
        .storage(Arc::new(storage.clone()))
        .start()
        .await
        .expect("broker starts");
    let addr = broker.local_addrs()[0];
    for i in 0..n {
        let (mut c, _) =
            connect_persistent(addr, ProtocolVersion::V5, &format!("offline-{i}")).await;
        c.subscribe(topic, QoS::AtLeastOnce).await;
        c.disconnect().await;
    }
    broker.flush_storage().await;
    (broker, addr)
}

fn publish(packet_id: u16, topic: &str, payload: Vec<u8>) -> Packet {
    Packet::Publish(Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: topic.into(),
        packet_id,
        properties: Properties::default(),
        payload: payload.into(),
    })
}

/// A publisher whose messages are queued for 20 offline persistent sessions owes storage each
/// message once and 20 references to it: once that is over `max_pending_bytes` it is not read
/// and its PUBACKs stop,
/// although no subscriber owes anything and each session holds only a few changes (counted
/// per changed session, as before, nobody waited and memory grew with the offline sessions).
/// Storage back, every acknowledged message reaches every session.
#[tokio::test]
async fn a_publisher_feeding_offline_sessions_waits_for_the_bytes_it_owes_storage() {
    let storage = MemoryStorage::new();
    let mut config = test_config();
    config.storage.max_pending_bytes = 64 * 1024;
    config.storage.max_pending_bytes_total = 0;
    let (broker, addr) = offline_subscribers(config, &storage, SUBSCRIBERS, "fan/t").await;
    let stats = || broker.stats();
    // Storage takes nothing: what the publisher owes only grows.
    storage.fail_always(ErrorKind::Transient);
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "fan-pub").await;
    // 100 messages of 1 KiB: 100 KiB and 2,000 references owed if all were read.
    for id in 1..=MESSAGES {
        publisher
            .send(publish(id, "fan/t", vec![id as u8; 1024]))
            .await;
    }
    wait_until("the publisher is held for storage", || {
        stats().storage_clients_waiting == 1
    })
    .await;
    // While it waits nothing more of it is read: only a few of the 100 PUBLISH were handled,
    // so only a few PUBACKs can come (each was owed as soon as its message was routed).
    let read = stats().messages_received;
    assert!(
        read < u64::from(MESSAGES) / 2,
        "{read} of {MESSAGES} PUBLISH read while the publisher owes storage"
    );
    let pending = stats().storage_pending_bytes;
    assert!(
        (64 * 1024..512 * 1024).contains(&pending),
        "owed {pending} bytes: over the bound by about one PUBLISH's copies"
    );
    let mut acked = 0u16;
    while acked < read as u16 {
        match publisher.expect_packet().await {
            Packet::PubAck(a) => {
                acked += 1;
                assert_eq!(a.packet_id, acked, "PUBACKs in order");
            }
            other => panic!("expected PUBACK, got {other:?}"),
        }
    }
    // Storage back: the publisher is read again and every message acknowledged.
    storage.stop_failing();
    while acked < MESSAGES {
        match publisher.expect_packet().await {
            Packet::PubAck(a) => {
                acked += 1;
                assert_eq!(a.packet_id, acked, "PUBACKs in order");
            }
            other => panic!("expected PUBACK, got {other:?}"),
        }
    }
    assert_eq!(stats().storage_clients_waiting, 0);
    // Every acknowledged message is delivered to every session [MQTT-4.3.2-1]... once the
    // writer has caught up, and from storage too.
    broker.flush_storage().await;
    assert_eq!(stats().storage_pending_bytes, 0);
    let stored = storage.snapshot();
    for i in 0..SUBSCRIBERS {
        let id = format!("offline-{i}");
        let s = stored
            .sessions
            .iter()
            .find(|s| s.client_id == id)
            .expect("stored session");
        assert_eq!(s.queued.len(), usize::from(MESSAGES), "{id}: stored queue");
    }
    for i in 0..SUBSCRIBERS {
        let id = format!("offline-{i}");
        let (mut c, present) = connect_persistent(addr, ProtocolVersion::V5, &id).await;
        assert!(present, "{id}: session present");
        for n in 1..=MESSAGES {
            let p = c.expect_publish().await;
            assert_eq!(
                p.payload.as_ref(),
                &[n as u8; 1024][..],
                "{id}: message {n}"
            );
            c.ack(&p).await;
        }
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// A message queued for many offline persistent sessions costs its publisher the message
/// once and, per session, the small op its delivery waits in, not a whole change per
/// session (about 500 bytes each, which let a publisher's `max_pending_bytes` hold a few
/// deliveries per session and made storage write a fan-out a delivery at a time): with 200
/// sessions and storage taking nothing, one PUBLISH of 1 KiB owes under 1 KiB plus 100
/// bytes per session (and a change's own footprint).
#[tokio::test]
async fn a_fan_out_costs_its_publisher_a_small_reference_per_session() {
    const SESSIONS: usize = 200;
    let storage = MemoryStorage::new();
    let mut config = test_config();
    config.storage.max_pending_bytes = 0;
    config.storage.max_pending_bytes_total = 0;
    let (broker, addr) = offline_subscribers(config, &storage, SESSIONS, "fan/small").await;
    storage.fail_always(ErrorKind::Transient);
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "fan-small-pub").await;
    publisher.send(publish(1, "fan/small", vec![7; 1024])).await;
    match publisher.expect_packet().await {
        Packet::PubAck(a) => assert_eq!(a.packet_id, 1),
        other => panic!("expected PUBACK, got {other:?}"),
    }
    // Owed once the message is routed, before its PUBACK.
    let pending = broker.stats().storage_pending_bytes as usize;
    assert!(
        pending > 1024 + SESSIONS * 16,
        "owed {pending} bytes: the message and a reference per session"
    );
    assert!(
        pending < 1024 + SESSIONS * 100 + 1024,
        "owed {pending} bytes for one message of 1 KiB to {SESSIONS} sessions: more than \
         100 bytes per session"
    );
    storage.stop_failing();
    broker.flush_storage().await;
    assert_eq!(broker.stats().storage_pending_bytes, 0);
    let stored = storage.snapshot();
    let queued: usize = stored.sessions.iter().map(|s| s.queued.len()).sum();
    assert_eq!(queued, SESSIONS, "one delivery stored per session");
    broker.shutdown().await;
}

/// Storage that fails every write for a second is reported: `/healthz` 503 with the error,
/// `storage/unwritable` 1, failed writes counted. The publisher whose message waits for
/// storage is held (over `max_pending_bytes_total`), while clients that owe storage nothing
/// go on (QoS 0 and QoS 1 between non-persistent sessions). When writes succeed again it is
/// healthy again and the message kept for an offline session while storage failed is delivered.
#[tokio::test]
async fn storage_that_takes_no_writes_is_reported_and_the_rest_goes_on() {
    let storage = MemoryStorage::new();
    let mut config = tcp_and_websocket_config();
    config.listeners[1].health = true;
    // Any byte owed is over the broker's total: every client owing something waits.
    config.storage.max_pending_bytes_total = 1;
    let (broker, addr) = offline_subscribers(config, &storage, 1, "keep/t").await;
    let http = broker.local_addrs()[1];
    assert_eq!(http_get(http, "/healthz").await.status, 200);
    storage.fail_always(ErrorKind::Transient);
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    // Acknowledged (no durable_ack) and kept in memory while storage fails.
    publisher
        .publish("keep/t", b"kept", QoS::AtLeastOnce, false)
        .await;
    wait_until("the publisher owing storage is held", || {
        broker.stats().storage_clients_waiting == 1
    })
    .await;
    let mut answer = http_get(http, "/healthz").await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while answer.status != 503 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "/healthz still {} while storage fails",
            answer.status
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        answer = http_get(http, "/healthz").await;
    }
    assert!(
        answer.text().contains("storage unwritable") && answer.text().contains("injected failure"),
        "{}",
        answer.text()
    );
    let failure = broker.storage_write_failure().expect("reported");
    assert!(failure.error.contains("injected failure"), "{failure:?}");
    let stats = || broker.stats();
    assert_eq!(stats().storage_unwritable, 1);
    assert!(stats().storage_writes_failed >= 2);
    // What needs no storage is served: QoS 0 and QoS 1 between non-persistent sessions.
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "live-sub").await;
    sub.subscribe("live/#", QoS::AtLeastOnce).await;
    let mut live = Client::connect(addr, ProtocolVersion::V5, "live-pub").await;
    live.publish("live/0", b"zero", QoS::AtMostOnce, false)
        .await;
    live.publish("live/1", b"one", QoS::AtLeastOnce, false)
        .await;
    let p = sub.expect_publish().await;
    assert_eq!(p.payload.as_ref(), b"zero");
    let p = sub.expect_publish().await;
    assert_eq!(p.payload.as_ref(), b"one");
    sub.ack(&p).await;
    // Storage back: healthy again, and the kept message stored and delivered.
    storage.stop_failing();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let r = http_get(http, "/healthz").await;
        if r.status == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/healthz still {} after storage recovered",
            r.status
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(broker.storage_write_failure().is_none());
    assert_eq!(stats().storage_unwritable, 0);
    wait_until("the publisher is read again", || {
        stats().storage_clients_waiting == 0
    })
    .await;
    publisher
        .publish("live/2", b"two", QoS::AtLeastOnce, false)
        .await;
    broker.flush_storage().await;
    let (mut c, present) = connect_persistent(addr, ProtocolVersion::V5, "offline-0").await;
    assert!(present);
    assert_eq!(c.expect_publish().await.payload.as_ref(), b"kept");
    broker.shutdown().await;
}
