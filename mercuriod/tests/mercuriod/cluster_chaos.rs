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
use std::time::{Duration, Instant};

use bytes::Bytes;
use mercurio_core::codec::{Connect, LastWill, Packet, Properties, ProtocolVersion, QoS};
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
    nodes_on(nats, pg, false, "", CLUSTER_KEYS)
}

/// [`three_nodes`] with the `[cluster]` keys `keys`; with `peer_storage`, each node lists
/// the other two's databases (`[cluster] peer_storage`), to take a crashed node's sessions
/// from its database; `extra`: configuration sections of every node (before `[storage]`).
pub(super) fn nodes_on(
    nats: &NatsCluster,
    pg: &TestPostgres,
    peer_storage: bool,
    extra: &str,
    keys: &str,
) -> [ClusterNode; 3] {
    nodes_and_databases(nats, pg, peer_storage, extra, keys).0
}

/// [`nodes_on`], and the URLs of the nodes' databases.
fn nodes_and_databases(
    nats: &NatsCluster,
    pg: &TestPostgres,
    peer_storage: bool,
    extra: &str,
    keys: &str,
) -> ([ClusterNode; 3], [String; 3]) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let urls = nats.urls();
    let names = ["a", "b", "c"];
    let dbs = names.map(|name| rt.block_on(async { pg.url(&pg.database(name, None).await) }));
    let nodes = [0, 1, 2].map(|i| {
        let mut keys = keys.to_string();
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
    (nodes, dbs)
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
    let [a, mut b, c] = nodes_on(&nats, &pg, true, "", CLUSTER_KEYS);
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

/// A persistent MQTT 5 CONNECT of `id` (an hour of session expiry, Clean Start as given),
/// with a QoS 1 will on `will/{id}` of Will Delay Interval `delay` seconds, or none.
fn with_will(id: &str, clean_start: bool, delay: Option<u32>) -> Connect {
    Connect {
        protocol: ProtocolVersion::V5,
        clean_start,
        keep_alive: 60,
        client_id: id.into(),
        will: delay.map(|delay| LastWill {
            topic: format!("will/{id}"),
            payload: Bytes::from_static(b"gone"),
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: Properties {
                will_delay_interval: Some(delay),
                ..Properties::default()
            },
        }),
        username: None,
        password: None,
        properties: Properties {
            session_expiry_interval: Some(3600),
            ..Properties::default()
        },
    }
}

/// A cluster of three nodes, each listing the others' databases, whose node B was killed
/// with a device's connection open (see [`crashed_with_a_device`]).
struct Crashed {
    a: ClusterNode,
    c: ClusterNode,
    /// Watchers of `will/#` on A and on C.
    watchers: [Client; 2],
    /// When B was killed.
    killed: Instant,
    _b: ClusterNode,
    _servers: (NatsCluster, TestPostgres),
}

/// Watchers of `will/#` on A and C, a device `dev` on B with a will of Will Delay Interval
/// `delay`; B killed (SIGKILL: the device's connection ends without DISCONNECT
/// [MQTT-3.1.2-8]) and left down. The nodes run with the `[cluster]` keys `keys`. `None`
/// without the prerequisites.
fn crashed_with_a_device(test: &str, pg: &str, delay: u32, keys: &str) -> Option<Crashed> {
    let (nats, pg) = prerequisites(test, pg)?;
    let ([a, mut b, c], [_, b_db, _]) = nodes_and_databases(&nats, &pg, true, "", keys);
    let watchers = [(&a, "watcher-a"), (&c, "watcher-c")].map(|(n, id)| {
        let mut w = client(&n.daemon, id, false);
        w.subscribe("will/#", QoS::AtLeastOnce);
        w
    });
    wait_until("C's watcher known to A", || {
        interest_of(&a.daemon, "c") == Some(1)
    });
    wait_until("A's watcher known to C", || {
        interest_of(&c.daemon, "a") == Some(1)
    });
    let (mut dev, _) = Client::connect(b.daemon.addr(), with_will("dev", true, Some(delay)));
    dev.subscribe("dev/in", QoS::AtLeastOnce);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let sql = "SELECT will_topic FROM mercurio_sessions WHERE client_id = 'dev'";
    wait_until(
        "B's database holds the device's session and its will",
        || rt.block_on(pg.scalar(&b_db, sql)).as_deref() == Some("will/dev"),
    );
    b.kill();
    let killed = Instant::now();
    drop(dev);
    Some(Crashed {
        a,
        c,
        watchers,
        killed,
        _b: b,
        _servers: (nats, pg),
    })
}

/// Whether `line` is a node's log of a sweep of B's database, the last one when `last`
/// (nothing left there to wait for: no `next_s`).
fn swept_b(line: &str, last: bool) -> bool {
    line.contains("wills due in the storage of the node gone swept")
        && line.contains("node=b")
        && !(last && line.contains("next_s"))
}

/// Once A and C have each logged a sweep of B's database (the last one when `last`), and
/// so published every will they publish for B's sessions: publishes a marker on
/// `will/marker` from A and from C, and returns how many wills of the device each watcher
/// received before it had both markers. What a node publishes reaches each watcher in order
/// (its own session, or the node's link to the other node), so a will published by A or C
/// before its marker arrives before that marker; B is dead. Each watcher's count is the
/// number of times the will was published in the cluster.
fn wills_before_the_markers(x: &mut Crashed, last: bool) -> [usize; 2] {
    for n in [&mut x.a, &mut x.c] {
        n.daemon
            .wait_logged("a sweep of B's database", |l| swept_b(l, last));
    }
    for (n, id) in [(&x.a, "marker-a"), (&x.c, "marker-c")] {
        let (mut publisher, _) = Client::connect(n.daemon.addr(), with_will(id, true, None));
        publisher.publish("will/marker", b"end", QoS::AtLeastOnce, false);
    }
    x.watchers.each_mut().map(|w| {
        let (mut markers, mut wills) = (0, 0);
        while markers < 2 {
            let p = w.expect_publish();
            w.ack(&p);
            match &*p.topic {
                "will/marker" => markers += 1,
                "will/dev" => {
                    assert_eq!(&p.payload[..], b"gone");
                    wills += 1;
                }
                other => panic!("unexpected message on {other}"),
            }
        }
        wills
    })
}

/// [`crashed_with_a_device`], then the device back on A with Clean Start 0 and no will, its
/// session taken from B's database (Session Present 1 [MQTT-3.2.2-2]); returns once A has
/// finished the take: the session deleted from B's database, the will (if due) published,
/// then the stream read for the session (logged). The take comes first, before A and C
/// declare B gone and sweep its database: A takes after `takeover_timeout` (1 s), the nodes
/// declare B gone three heartbeat intervals (2 s each) after its last heartbeat.
fn device_back_on_a(test: &str, pg: &str, delay: u32) -> Option<(Crashed, Client)> {
    const KEYS: &str = "heartbeat_interval = 2\njetstream_replicas = 3\ntakeover_timeout = 1\n";
    let mut x = crashed_with_a_device(test, pg, delay, KEYS)?;
    let (dev, present) = Client::connect(x.a.daemon.addr(), with_will("dev", false, None));
    assert!(
        present,
        "the session taken from B's database is present [MQTT-3.2.2-2]"
    );
    x.a.daemon.wait_logged("A's take confirmed", |l| {
        l.contains("never took, given to the session taken")
    });
    Some((x, dev))
}

/// A node killed with a device's connection open, the device back on another node: that
/// node, taking the device's session from the dead node's database, publishes the will of
/// the connection that ended without DISCONNECT [MQTT-3.1.2-8] (Will Delay Interval 0: due
/// at once), exactly once in the cluster (the sweeps of the dead node's database that
/// follow find it gone), to watchers on the taker and on another node.
#[test]
fn a_crashed_nodes_will_is_published_once_by_the_node_that_takes_its_session() {
    const TEST: &str = "a_crashed_nodes_will_is_published_once_by_the_node_that_takes_its_session";
    let Some((mut x, _dev)) = device_back_on_a(TEST, "chaos_will", 0) else {
        return;
    };
    assert_eq!(
        wills_before_the_markers(&mut x, false),
        [1, 1],
        "the will once, on A and on C [MQTT-3.1.2-8]"
    );
    let published =
        |l: &str| l.contains("the will of the connection that ended with the node gone, published");
    assert_eq!(
        x.a.daemon.seen(published).len(),
        1,
        "published by A, the taker"
    );
}

/// A node killed with a device's connection open, its will delayed by 60 s: the device
/// connecting again within the delay (to another node, which takes its session from the
/// dead node's database) means the will is not published [MQTT-3.1.3-9], by the taker or
/// by the sweeps of the dead node's database.
#[test]
fn a_crashed_nodes_delayed_will_is_not_published_when_its_client_is_back_within_the_delay() {
    const TEST: &str =
        "a_crashed_nodes_delayed_will_is_not_published_when_its_client_is_back_within_the_delay";
    let Some((mut x, _dev)) = device_back_on_a(TEST, "chaos_delay", 60) else {
        return;
    };
    assert_eq!(
        wills_before_the_markers(&mut x, false),
        [0, 0],
        "no will: its client is back within the delay [MQTT-3.1.3-9]"
    );
}

/// The device's will, the first message A's watcher receives [MQTT-3.1.2-8], published by
/// a survivor's sweep of B's database and received once on A and on C; returns how long
/// after B's kill it reached A's watcher (printed).
fn swept_will(x: &mut Crashed, test: &str) -> Duration {
    let p = x.watchers[0].expect_publish();
    let took = x.killed.elapsed();
    x.watchers[0].ack(&p);
    assert_eq!(p.topic, "will/dev", "the will [MQTT-3.1.2-8]");
    let [on_a, on_c] = wills_before_the_markers(x, true);
    assert_eq!((on_a + 1, on_c), (1, 1), "the will once, on A and on C");
    eprintln!(
        "{test}: the will reached A's watcher {} ms after the kill",
        took.as_millis()
    );
    took
}

/// A node killed with a device's connection open, the device never back: a surviving node
/// sweeping the dead node's database publishes its will [MQTT-3.1.2-8], exactly once in the
/// cluster (both survivors sweep), within the bound docs/cluster.md gives: three heartbeat
/// intervals for the node to be declared gone (1 s each here), then the sweep (B's
/// database connections died with it, so its lock is free at once). 10 s allows for a
/// loaded machine.
#[test]
fn a_crashed_nodes_will_is_published_once_by_a_survivor_when_its_client_never_comes_back() {
    const TEST: &str =
        "a_crashed_nodes_will_is_published_once_by_a_survivor_when_its_client_never_comes_back";
    let Some(mut x) = crashed_with_a_device(TEST, "chaos_sweep", 0, CLUSTER_KEYS) else {
        return;
    };
    let took = swept_will(&mut x, TEST);
    assert!(
        took < Duration::from_secs(10),
        "published {took:?} after the kill"
    );
}

/// A node killed with a device's connection open, its will delayed by 6 s, the device never
/// back: the will is published by a survivor once the delay has passed since the device's
/// connection ended (B's last heartbeat, at most 1 s before the kill) [MQTT-3.1.3-9], not
/// at the first sweep (about 3 s after the kill), and once.
#[test]
fn a_crashed_nodes_delayed_will_is_published_by_a_survivor_once_the_delay_has_passed() {
    const TEST: &str =
        "a_crashed_nodes_delayed_will_is_published_by_a_survivor_once_the_delay_has_passed";
    let Some(mut x) = crashed_with_a_device(TEST, "chaos_later", 6, CLUSTER_KEYS) else {
        return;
    };
    let took = swept_will(&mut x, TEST);
    assert!(
        took >= Duration::from_millis(4500),
        "not before the Will Delay Interval [MQTT-3.1.3-9]: {took:?} after the kill"
    );
}
