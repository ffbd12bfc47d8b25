//! Chaos in a cluster (docs/cluster.md, "Failures"): three mercuriod nodes, each on its own
//! PostgreSQL database (one throwaway server) with `durable_ack`, on a NATS cluster of three
//! servers with JetStream; a QoS 1 publisher streams numbered messages and a node is killed
//! (SIGKILL) in the middle of the stream. Every message the publisher got a PUBACK for reaches
//! the persistent subscriber: nothing lost, duplicates (allowed at QoS 1) counted. The test
//! prints its counts. Without nats-server or initdb/pg_ctl it skips; under `CI=true` it fails.
//! The subscriber's node handing its session over to another node (after a kill, or live)
//! loses nothing either: what still reaches it for the session is forwarded.
#![cfg(unix)]

use std::collections::BTreeMap;

use mercurio_core::codec::{Packet, QoS};
use mercurio_storage::postgres::testing::TestPostgres;
use mercurio_testkit::{wait_until, Client, ClusterNode, NatsCluster, NodeStorage};

use super::cluster_qos::{
    client, connect, duplicates, interest_of, number, receive_rest, Publisher, CLUSTER_KEYS,
};

/// A NATS cluster of three servers with JetStream, and a PostgreSQL server named `pg` (a
/// short name: it names the server's socket directory, whose path PostgreSQL limits);
/// `None` (the test skips) without nats-server or PostgreSQL.
pub(super) fn prerequisites(test: &str, pg: &str) -> Option<(NatsCluster, TestPostgres)> {
    let nats = NatsCluster::start(test, 3)?;
    Some((nats, TestPostgres::start(pg)?))
}

/// Nodes `a`, `b` and `c`, each on its own NATS server of `nats` and its own database of
/// `pg`; returns once each hears the other two.
fn three_nodes(nats: &NatsCluster, pg: &TestPostgres) -> [ClusterNode; 3] {
    nodes_on(nats, pg, false, "")
}

/// [`three_nodes`]; with `peer_storage`, each node lists the other two's databases
/// (`[cluster] peer_storage`), to take a crashed node's sessions from its database; `extra`:
/// configuration sections of every node (before `[storage]`).
pub(super) fn nodes_on(
    nats: &NatsCluster,
    pg: &TestPostgres,
    peer_storage: bool,
    extra: &str,
) -> [ClusterNode; 3] {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let urls = nats.urls();
    let names = ["a", "b", "c"];
    let dbs = names.map(|name| rt.block_on(async { pg.url(&pg.database(name, None).await) }));
    let nodes = [0, 1, 2].map(|i| {
        let mut keys = CLUSTER_KEYS.to_string();
        if peer_storage {
            let peers: Vec<String> = (0..3)
                .filter(|j| *j != i)
                .map(|j| format!("{} = {:?}", names[j], dbs[j]))
                .collect();
            keys.push_str(&format!("peer_storage = {{ {} }}\n", peers.join(", ")));
        }
        ClusterNode::start_on(
            names[i],
            &urls[i..=i],
            NodeStorage::Postgres(dbs[i].clone()),
            extra,
            &keys,
        )
    });
    wait_until("every node hears the other two", || {
        nodes.iter().all(|n| {
            n.daemon.admin(r#"{"command":"cluster.status"}"#)["result"]["nodes"].as_u64() == Some(3)
        })
    });
    nodes
}

/// Receives on `sub` (acknowledging each) until `n` messages in all have come, into `got`.
pub(super) fn receive_some(sub: &mut Client, n: usize, got: &mut BTreeMap<u32, u32>) {
    for _ in 0..n {
        match sub.recv() {
            Some(Packet::Publish(p)) => {
                sub.ack(&p);
                *got.entry(number(&p)).or_insert(0) += 1;
            }
            other => panic!("expected a PUBLISH, got {other:?}"),
        }
    }
}

#[test]
fn a_publishers_node_killed_mid_stream_and_the_publisher_going_on_through_another_loses_nothing() {
    const TEST: &str =
        "a_publishers_node_killed_mid_stream_and_the_publisher_going_on_through_another_loses_nothing";
    let Some((nats, pg)) = prerequisites(TEST, "cluster_chaos") else {
        return;
    };
    let [mut a, b, c] = three_nodes(&nats, &pg);

    // An MQTT 5 persistent subscriber on B (Clean Start 0, an hour of session expiry).
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("chaos/#", QoS::AtLeastOnce);
    for n in [&a, &c] {
        wait_until("B's interest known to A and C", || {
            interest_of(&n.daemon, "b") == Some(1)
        });
    }

    // The publisher on A, falling back on C; A is killed in the middle of the stream, while
    // the subscriber reads it.
    let publisher =
        Publisher::start_with_fallback(&a.daemon, Some(c.daemon.addr()), "pub", "chaos/pub");
    let mut got = BTreeMap::new();
    receive_some(&mut sub, 200, &mut got);
    a.kill();
    let killed_at = publisher.acked();
    publisher.wait_acked(killed_at + 200);
    let acked = publisher.finish();
    // Every acknowledged number reaches B (each wait within the deadline): a PUBACK
    // says the broker took ownership of the message [MQTT-4.3.2-4].
    let got = receive_rest(&mut sub, &acked, got);
    eprintln!(
        "{TEST}: {} messages acknowledged to the publisher ({killed_at} by A before its kill, \
         the rest by C), {} received on B, {} duplicates, none lost",
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}

/// A persistent subscriber to `chaos/#` on `on`, known to the nodes `others`.
pub(super) fn subscriber(on: &ClusterNode, name: &str, others: [&ClusterNode; 2]) -> Client {
    let mut sub = client(&on.daemon, "sub", true);
    sub.subscribe("chaos/#", QoS::AtLeastOnce);
    for n in others {
        wait_until("the subscriber's interest known to the other nodes", || {
            interest_of(&n.daemon, name) == Some(1)
        });
    }
    sub
}

/// Kills the subscriber `sub`'s node `b` once `sub` has received 200 messages of
/// `publisher`'s stream, and waits for 200 more to be acknowledged to the publisher; returns
/// what `sub` received, and the messages acknowledged before the kill.
fn killed_under_stream(
    b: &mut ClusterNode,
    mut sub: Client,
    publisher: &Publisher,
) -> (BTreeMap<u32, u32>, usize) {
    let mut got = BTreeMap::new();
    receive_some(&mut sub, 200, &mut got);
    b.kill();
    drop(sub);
    let killed_at = publisher.acked();
    publisher.wait_acked(killed_at + 200);
    (got, killed_at)
}

#[test]
fn a_subscribers_node_killed_restarted_and_its_session_taken_by_another_node_loses_nothing() {
    const TEST: &str =
        "a_subscribers_node_killed_restarted_and_its_session_taken_by_another_node_loses_nothing";
    let Some((nats, pg)) = prerequisites(TEST, "cluster_chaos_sub") else {
        return;
    };
    let [a, mut b, c] = three_nodes(&nats, &pg);
    let sub = subscriber(&b, "b", [&a, &c]);

    // B is killed under its subscriber's stream; the publisher on A goes on.
    let publisher = Publisher::start(&a.daemon, "pub", "chaos/pub");
    let (got, killed_at) = killed_under_stream(&mut b, sub, &publisher);
    // B is back on the same storage and node name, with the session and what JetStream
    // kept for it; the subscriber comes back on C, which takes the session from B.
    b.restart();
    wait_until("C hears B again", || {
        c.daemon.admin(r#"{"command":"cluster.status"}"#)["result"]["nodes"].as_u64() == Some(3)
    });
    let (mut sub, present) = connect(&c.daemon, "sub", true);
    assert!(
        present,
        "the session taken from B is present [MQTT-3.2.2-2]"
    );
    publisher.wait_acked(publisher.acked() + 200);
    let acked = publisher.finish();
    // Every acknowledged number reaches the subscriber [MQTT-4.3.2-4].
    let got = receive_rest(&mut sub, &acked, got);
    eprintln!(
        "{TEST}: {} messages acknowledged to the publisher ({killed_at} before B's kill), \
         {} received, {} duplicates, none lost",
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}

#[test]
fn a_session_taken_over_by_another_node_mid_stream_loses_nothing() {
    const TEST: &str = "a_session_taken_over_by_another_node_mid_stream_loses_nothing";
    let Some((nats, pg)) = prerequisites(TEST, "cluster_chaos_move") else {
        return;
    };
    let [a, b, c] = three_nodes(&nats, &pg);
    let mut sub = subscriber(&b, "b", [&a, &c]);
    let publisher = Publisher::start(&a.daemon, "pub", "chaos/pub");
    let mut got = BTreeMap::new();
    receive_some(&mut sub, 200, &mut got);
    // The same client identifier connects to C while its connection on B is live: B closes
    // it and hands the session over [MQTT-3.1.4-3].
    let moved_at = publisher.acked();
    let (mut moved, present) = connect(&c.daemon, "sub", true);
    assert!(
        present,
        "the session taken from B is present [MQTT-3.2.2-2]"
    );
    drop(sub);
    publisher.wait_acked(publisher.acked() + 300);
    let acked = publisher.finish();
    let got = receive_rest(&mut moved, &acked, got);
    eprintln!(
        "{TEST}: {} messages acknowledged to the publisher ({moved_at} before the hand-over), \
         {} received, {} duplicates, none lost",
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}

/// The subscriber's node killed and left down: the subscriber reconnecting to another node
/// (Clean Start 0) gets its session from the dead node's database (`peer_storage`), present
/// [MQTT-3.2.2-2], and every message acknowledged to the publisher [MQTT-4.3.2-4]: those
/// the dead node had committed, those it had taken from JetStream and not committed, those
/// sent to it after its death, and those after the move. Prints how long the CONNECT took.
#[test]
fn a_subscribers_node_killed_and_left_down_its_session_taken_from_its_database_loses_nothing() {
    const TEST: &str =
        "a_subscribers_node_killed_and_left_down_its_session_taken_from_its_database_loses_nothing";
    let Some((nats, pg)) = prerequisites(TEST, "cluster_chaos_dead") else {
        return;
    };
    let [a, mut b, c] = nodes_on(&nats, &pg, true, "");
    let sub = subscriber(&b, "b", [&a, &c]);
    let publisher = Publisher::start(&a.daemon, "pub", "chaos/pub");
    let (got, killed_at) = killed_under_stream(&mut b, sub, &publisher);
    // B stays down; the subscriber comes back on C.
    let started = std::time::Instant::now();
    let (mut sub, present) = connect(&c.daemon, "sub", true);
    let took = started.elapsed();
    assert!(
        present,
        "the session taken from B's database is present [MQTT-3.2.2-2]"
    );
    publisher.wait_acked(publisher.acked() + 200);
    let acked = publisher.finish();
    let got = receive_rest(&mut sub, &acked, got);
    eprintln!(
        "{TEST}: CONNECT on C took {} ms; {} messages acknowledged to the publisher \
         ({killed_at} before B's kill), {} received, {} duplicates, none lost",
        took.as_millis(),
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}
