//! The broker-wide bound on queued memory (`[server] max_queued_memory`; docs/operations.md,
//! "Memory of queued messages"), through real sockets. Memory backend: a publisher feeding
//! an offline fleet past the bound is held for `stall_time`, then the oldest queued messages
//! are dropped (counted `memory_full`, told to `on_dropped`), the total stays within the bound
//! and one fan-out, and each client gets the newest of its messages, in order, when it comes
//! back. SQLite: the fleet's queues are left in storage instead, nothing is dropped, the total
//! stays within the bound and one fan-out, and each client gets every message, in order,
//! before and after a restart.
//!
//! No timing is asserted: the outcomes are counts, the log line and the order.
use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::*;
use mercurio::codec::{ProtocolVersion, QoS, ReasonCode};
use mercurio::config::{Config, StorageBackend};
use mercurio::stats::DropCause;
use mercurio::{Broker, BrokerHandle};

const V5: ProtocolVersion = ProtocolVersion::V5;

/// The bound: 64 KiB, the smallest accepted.
const BOUND: u64 = 64 * 1024;
const SESSIONS: usize = 10;
const MESSAGES: usize = 40;
const PAYLOAD: usize = 1000;

#[tokio::test]
async fn an_offline_fleet_over_the_bound_slows_then_drops_its_oldest_messages() {
    let logs = capture_logs();
    let mut config = test_config();
    config.server.max_queued_memory = BOUND;
    config.server.stall_time = 1;
    let drops: Arc<Mutex<HashMap<String, Vec<DropCause>>>> = Arc::default();
    let seen = Arc::clone(&drops);
    let broker = Broker::builder(config)
        .on_dropped(move |d| {
            seen.lock()
                .unwrap()
                .entry(d.client_id.unwrap_or_default().to_string())
                .or_default()
                .push(d.cause);
        })
        .start()
        .await
        .expect("broker starts");
    let addr = broker.local_addrs()[0];

    let ids: Vec<String> = (0..SESSIONS).map(|i| format!("fleet-{i}")).collect();
    offline_fleet(addr, &ids, "fleet/all").await;
    wait_until("the fleet is offline", || {
        broker.stats().clients_connected == 0
    })
    .await;

    publish_within_bound(&broker, addr, "fleet-publisher", "fleet/all").await;

    assert_eq!(
        logs.matching(&["over max_queued_memory for stall_time"])
            .len(),
        1,
        "the publisher waited stall_time once, then the memory was stalled: {:?}",
        logs.lines()
    );
    let dropped = broker.stats().dropped_count(DropCause::MemoryFull);
    assert!(dropped > 0, "the fleet's backlog is over the bound");
    let drops = drops.lock().unwrap().clone();
    assert_eq!(
        drops.values().map(Vec::len).sum::<usize>() as u64,
        dropped,
        "every drop is told: {drops:?}"
    );
    assert!(drops
        .values()
        .flatten()
        .all(|c| *c == DropCause::MemoryFull));

    // Each client gets the newest of its messages, in order: its oldest were dropped.
    for id in &ids {
        let lost = drops.get(id).map_or(0, Vec::len);
        let (mut c, present) = Client::connect_persistent(addr, V5, id).await;
        assert!(present);
        for n in lost..MESSAGES {
            let p = c.expect_publish().await;
            assert_eq!(
                &p.payload[..4],
                format!("{n:04}").as_bytes(),
                "{id}: lost its {lost} oldest"
            );
            c.ack(&p).await;
        }
        c.disconnect().await;
    }
    wait_until("the queues are empty", || broker.stats().queued_bytes == 0).await;
    broker.shutdown().await;
}

/// Clients that take their messages keep the publisher going under the bound: nothing is
/// dropped, however much goes through.
#[tokio::test]
async fn connected_subscribers_that_drain_lose_nothing() {
    let mut config = test_config();
    config.server.max_queued_memory = BOUND;
    let (broker, addr) = start_with(config).await;
    let mut subscribers = Vec::new();
    for i in 0..4 {
        let mut c = Client::connect(addr, V5, &format!("drain-{i}")).await;
        c.subscribe("drain/all", QoS::AtLeastOnce).await;
        subscribers.push(c);
    }
    let readers: Vec<_> = subscribers
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                for n in 0..MESSAGES * 4 {
                    let p = c.expect_publish().await;
                    assert_eq!(&p.payload[..4], format!("{n:04}").as_bytes());
                    c.ack(&p).await;
                }
                c.disconnect().await;
            })
        })
        .collect();
    let mut publisher = Client::connect(addr, V5, "drain-publisher").await;
    for n in 0..MESSAGES * 4 {
        let mut payload = format!("{n:04}").into_bytes();
        payload.resize(PAYLOAD * 4, b'.');
        publisher
            .publish("drain/all", &payload, QoS::AtLeastOnce, false)
            .await;
    }
    for r in readers {
        r.await.expect("subscriber got every message");
    }
    assert_eq!(broker.stats().dropped_count(DropCause::MemoryFull), 0);
    broker.shutdown().await;
}

fn sqlite(path: &std::path::Path) -> Config {
    let mut config = test_config();
    config.server.max_queued_memory = BOUND;
    config.storage.backend = StorageBackend::Sqlite;
    config.storage.path = Some(path.to_path_buf());
    config
}

/// Publishes [`MESSAGES`] numbered QoS 1 messages on `topic` as `client_id`, checking after
/// each PUBACK that the queues hold at most the bound plus one fan-out (what a single PUBLISH
/// adds before its publisher waits).
async fn publish_within_bound(
    broker: &BrokerHandle,
    addr: std::net::SocketAddr,
    client_id: &str,
    topic: &str,
) {
    let mut publisher = Client::connect(addr, V5, client_id).await;
    let mut fan_out = 0;
    for n in 0..MESSAGES {
        let mut payload = format!("{n:04}").into_bytes();
        payload.resize(PAYLOAD, b'.');
        let before = broker.stats().queued_bytes;
        assert_eq!(
            publisher
                .publish(topic, &payload, QoS::AtLeastOnce, false)
                .await,
            ReasonCode::SUCCESS
        );
        let after = broker.stats().queued_bytes;
        if n == 0 {
            fan_out = after - before;
        }
        assert!(
            after <= BOUND + fan_out,
            "message {n}: {after} bytes queued, over {BOUND} and one fan-out ({fan_out})"
        );
    }
    publisher.disconnect().await;
}

/// Subscribes `ids` to `topic` at QoS 1 with persistent sessions, then disconnects them.
async fn offline_fleet(addr: std::net::SocketAddr, ids: &[String], topic: &str) {
    for id in ids {
        let (mut c, _) = Client::connect_persistent(addr, V5, id).await;
        c.subscribe(topic, QoS::AtLeastOnce).await;
        c.disconnect().await;
    }
}

/// Reconnects `id` and takes messages `from..to` of [`publish_within_bound`], in order.
async fn drain_in_order(addr: std::net::SocketAddr, id: &str, from: usize, to: usize) {
    let (mut c, present) = Client::connect_persistent(addr, V5, id).await;
    assert!(present, "{id}");
    for n in from..to {
        let p = c.expect_publish().await;
        assert_eq!(
            &p.payload[..4],
            format!("{n:04}").as_bytes(),
            "{id}: in order"
        );
        c.ack(&p).await;
    }
    c.disconnect().await;
}

#[tokio::test]
async fn with_sqlite_an_offline_fleet_over_the_bound_stays_in_storage_and_comes_back_whole() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mercurio.db");
    let (broker, addr) = start_with(sqlite(&path)).await;
    let ids: Vec<String> = (0..SESSIONS).map(|i| format!("stored-{i}")).collect();
    offline_fleet(addr, &ids, "stored/all").await;
    wait_until("the fleet is offline", || {
        broker.stats().clients_connected == 0
    })
    .await;

    publish_within_bound(&broker, addr, "stored-publisher", "stored/all").await;
    let stats = broker.stats();
    assert_eq!(
        DropCause::ALL.map(|c| stats.dropped_count(c)),
        [0; 7],
        "nothing dropped"
    );
    // The last PUBLISH's release runs before its connection reads the DISCONNECT.
    wait_until("the total is back under the bound", || {
        broker.stats().queued_bytes <= BOUND
    })
    .await;
    for s in broker
        .sessions()
        .iter()
        .filter(|s| ids.contains(&s.client_id))
    {
        assert_eq!(
            s.queued, MESSAGES,
            "{}: counted, in storage or not",
            s.client_id
        );
    }

    // Half the fleet comes back now, the other half after a restart.
    for id in &ids[..SESSIONS / 2] {
        drain_in_order(addr, id, 0, MESSAGES).await;
    }
    broker.shutdown().await;
    let (broker, addr) = start_with(sqlite(&path)).await;
    for id in &ids[SESSIONS / 2..] {
        drain_in_order(addr, id, 0, MESSAGES).await;
    }
    assert_eq!(broker.stats().queued_bytes, 0);
    broker.shutdown().await;
}
