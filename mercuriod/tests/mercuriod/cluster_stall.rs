//! A stalled node in a cluster (docs/cluster.md, "Failures", a stalled node): the three nodes
//! of the chaos tests (each on its own PostgreSQL database with `durable_ack`, listing the
//! others' in `peer_storage`, on a NATS cluster of three servers with JetStream), one of them
//! stopped with SIGSTOP (a long pause, a frozen VM) under a stream of numbered QoS 1
//! messages, its clients moving to another node, then resumed with SIGCONT. Every message
//! acknowledged to the publisher reaches the persistent subscriber (duplicates, allowed at
//! QoS 1, counted and printed); one connection per client identifier is left open in the
//! cluster; the resumed node publishes no will of a session another node took, and delivers
//! nothing more for it. Without nats-server or initdb/pg_ctl the tests skip; under `CI=true`
//! they fail.
#![cfg(unix)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mercurio_core::codec::{
    Connect, LastWill, Packet, Properties, ProtocolVersion, QoS, ReasonCode,
};
use mercurio_storage::postgres::testing::TestPostgres;
use mercurio_testkit::{wait_until, Client, ClusterNode, NatsCluster};

use super::cluster_chaos::{nodes_on, prerequisites, receive_some, subscriber};
use super::cluster_qos::{
    client, duplicates, interest_of, number, receive_rest, Publisher, CLUSTER_KEYS,
};

/// Every node logs the wills it publishes (at debug), for the tests to see that B does not;
/// and a session's queue holds 2,000 messages, fewer than B is sent while stalled (the
/// node taking its session must give them as its client takes them, not drop them).
const NODE_EXTRA: &str = "[logging]\nlevel = \"info,mercurio_core::broker::entry=debug\"\n\n\
                          [server]\nmax_queued_messages = 2000\n\n";

/// How long the subscriber's reconnection may be refused: past the storage's stale
/// heartbeat (11 s) with room for a loaded machine.
const RECONNECT_WITHIN: Duration = Duration::from_secs(90);

/// The subscriber's CONNECT: MQTT 5, Clean Start 0, an hour of session expiry, and a will
/// that no node may publish while the session goes on (MQTT 5.0 section 3.1.4).
fn sub_connect() -> Connect {
    Connect {
        protocol: ProtocolVersion::V5,
        clean_start: false,
        keep_alive: 60,
        client_id: "sub".into(),
        will: Some(LastWill {
            topic: "will/sub".into(),
            payload: Bytes::from_static(b"gone"),
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: Properties::default(),
        }),
        username: None,
        password: None,
        properties: Properties {
            session_expiry_interval: Some(3600),
            ..Properties::default()
        },
    }
}

/// Connects the subscriber to `on` until it is let in, within [`RECONNECT_WITHIN`]; every
/// refusal must be 0x88 Server unavailable (the session's node silent and still serving its
/// database). The client, Session Present, and the refusals.
fn reconnect(on: &ClusterNode) -> (Client, bool, u32) {
    let deadline = Instant::now() + RECONNECT_WITHIN;
    let mut refused = 0;
    loop {
        match Client::try_connect(on.daemon.addr(), sub_connect()) {
            Ok((c, present)) => return (c, present, refused),
            Err(code) => {
                assert_eq!(
                    code,
                    ReasonCode::SERVER_UNAVAILABLE,
                    "a CONNECT refused while the session's node is stalled"
                );
                refused += 1;
                assert!(
                    Instant::now() < deadline,
                    "still refused after {RECONNECT_WITHIN:?}"
                );
            }
        }
    }
}

/// Reads what the stalled node wrote to `old` before it stopped (it is all in this side's
/// socket already), without acknowledging it: it stays in flight in the session. Returns
/// how many PUBLISH packets there were.
fn drain(old: &mut Client) -> usize {
    let mut n = 0;
    while let Some(p) = old.recv_within(Duration::from_millis(200)) {
        match p {
            Some(Packet::Publish(_)) => n += 1,
            other => panic!("a stalled node's connection: expected PUBLISH, got {other:?}"),
        }
    }
    n
}

/// Reads `old` until it closes: the PUBLISH packets that came, and the reason code of its
/// DISCONNECT if one came.
fn until_closed(old: &mut Client) -> (usize, Option<ReasonCode>) {
    let mut n = 0;
    loop {
        match old.recv() {
            Some(Packet::Publish(_)) => n += 1,
            Some(Packet::Disconnect(d)) => {
                assert!(old.recv().is_none(), "closed after its DISCONNECT");
                return (n, Some(d.reason_code));
            }
            None => return (n, None),
            Some(other) => panic!("expected PUBLISH or DISCONNECT, got {other:?}"),
        }
    }
}

/// The subscriber reading and acknowledging on a thread of its own, as a client does (one
/// that reads nothing for `stall_time` is a stalled client: its queue's limit drops), until
/// [`Reading::finish`].
struct Reading {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Client, BTreeMap<u32, u32>)>,
}

impl Reading {
    /// `sub` reading on, counting into `got`.
    fn start(mut sub: Client, mut got: BTreeMap<u32, u32>) -> Reading {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match sub.recv_within(Duration::from_millis(100)) {
                    Some(Some(Packet::Publish(p))) => {
                        sub.ack(&p);
                        *got.entry(number(&p)).or_insert(0) += 1;
                    }
                    None => {}
                    other => panic!("the subscriber on C: expected PUBLISH, got {other:?}"),
                }
            }
            (sub, got)
        });
        Reading { stop, thread }
    }

    /// The client and what it received.
    fn finish(self) -> (Client, BTreeMap<u32, u32>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the subscriber's thread")
    }
}

/// The connections of client `id` open on `node` (`client.list`).
fn connected(node: &ClusterNode, id: &str) -> usize {
    node.daemon.admin(r#"{"command":"client.list"}"#)["result"]["clients"]
        .as_array()
        .map_or(0, |clients| {
            clients
                .iter()
                .filter(|c| c["client_id"] == id && c["connected"] == true)
                .count()
        })
}

/// The will log lines of client `sub` in `node`'s log.
fn wills_of_sub(node: &mut ClusterNode) -> Vec<String> {
    node.daemon
        .seen(|l| l.contains("publishing will") && l.contains("sub"))
}

/// A new client on `node` subscribes and gets what another new client there publishes.
fn serves(node: &ClusterNode) {
    let mut s = client(&node.daemon, "fresh-sub", false);
    s.subscribe("fresh/#", QoS::AtLeastOnce);
    let mut p = client(&node.daemon, "fresh-pub", false);
    p.publish("fresh/1", b"here", QoS::AtLeastOnce, false);
    let m = s.expect_publish();
    assert_eq!(
        (m.topic.as_str(), &m.payload[..]),
        ("fresh/1", &b"here"[..])
    );
}

/// Waits until every node of `nodes` hears three.
fn all_hear_three(nodes: &[&ClusterNode]) {
    wait_until("every node hears the other two", || {
        nodes.iter().all(|n| {
            n.daemon.admin(r#"{"command":"cluster.status"}"#)["result"]["nodes"].as_u64() == Some(3)
        })
    });
}

/// The subscriber on `b`, known to `a` and `c`.
fn subscriber_with_will(b: &ClusterNode, a: &ClusterNode, c: &ClusterNode) -> Client {
    let (mut sub, _) = Client::connect(b.daemon.addr(), sub_connect());
    sub.subscribe("chaos/#", QoS::AtLeastOnce);
    for n in [a, c] {
        wait_until("B's interest known to A and C", || {
            interest_of(&n.daemon, "b") == Some(1)
        });
    }
    sub
}

/// Three nodes, the subscriber (with a will) on B under a publisher's stream from A, and B
/// stalled once the subscriber has received 200 messages.
struct Stalled {
    nodes: [ClusterNode; 3],
    /// The subscriber's connection to B, what B wrote before the stall read.
    old: Client,
    publisher: Publisher,
    /// What the subscriber received (and acknowledged) before the stall.
    got: BTreeMap<u32, u32>,
    stalled: Instant,
    /// Messages acknowledged to the publisher when B was stalled.
    stalled_at: usize,
    /// PUBLISH packets B wrote before the stall and the subscriber had not read.
    buffered: usize,
    // Last: the nodes stop before the servers they use.
    _servers: (NatsCluster, TestPostgres),
}

/// [`Stalled`], on a PostgreSQL server named `pg`; `None` (the test skips) without
/// nats-server or PostgreSQL.
fn stalled_under_stream(test: &str, pg: &str) -> Option<Stalled> {
    let (nats, pg) = prerequisites(test, pg)?;
    let nodes = nodes_on(&nats, &pg, true, NODE_EXTRA, CLUSTER_KEYS);
    let [a, b, c] = &nodes;
    let mut old = subscriber_with_will(b, a, c);
    let publisher = Publisher::start(&a.daemon, "pub", "chaos/pub");
    let mut got = BTreeMap::new();
    receive_some(&mut old, 200, &mut got);
    b.stall();
    let stalled = Instant::now();
    let stalled_at = publisher.acked();
    let buffered = drain(&mut old);
    Some(Stalled {
        nodes,
        old,
        publisher,
        got,
        stalled,
        stalled_at,
        buffered,
        _servers: (nats, pg),
    })
}

/// B stalled past its database's stale heartbeat: the subscriber's CONNECT on C is refused
/// with 0x88 until C can take the session from B's database, then gets it (Session Present 1
/// [MQTT-3.2.2-2]) and every message acknowledged to the publisher [MQTT-4.3.2-4]. B,
/// resumed, finds its database taken: it delivers nothing more on the subscriber's old
/// connection, publishes no will, and stops; started again (as a service manager does), it
/// serves without the session.
#[test]
fn a_subscribers_node_stalled_past_its_stale_heartbeat_has_the_session_taken_and_resumes_fenced() {
    const TEST: &str =
        "a_subscribers_node_stalled_past_its_stale_heartbeat_has_the_session_taken_and_resumes_fenced";
    let Some(setup) = stalled_under_stream(TEST, "cluster_stall_taken") else {
        return;
    };
    let Stalled {
        nodes: [a, mut b, mut c],
        mut old,
        publisher,
        got,
        stalled,
        stalled_at,
        buffered,
        ..
    } = setup;
    // The subscriber, its connection to B silent, goes to C and keeps trying.
    let (sub, present, refused) = reconnect(&c);
    let took = stalled.elapsed();
    let reading = Reading::start(sub, got);
    assert!(
        present,
        "the session taken from B's database [MQTT-3.2.2-2]"
    );
    // B's database is taken only once its heartbeat is stale (11 s): before, C refused. B
    // wrote its last one about a second before it stopped, and surely less than 7 s before
    // (or it would have stopped itself), whatever the load.
    assert!(
        took >= Duration::from_secs(4) && refused >= 1,
        "taken {} ms after the stall, after {refused} refusals",
        took.as_millis()
    );
    c.daemon.wait_logged("the take", |l| {
        l.contains("session taken from the storage of a node gone")
    });
    let taken_at = publisher.acked();
    publisher.wait_acked(taken_at + 100);

    // B resumes: its next heartbeat finds its database taken, and it stops at once.
    b.resume();
    let (after, reason) = until_closed(&mut old);
    b.daemon.wait_logged("B fenced", |l| {
        l.contains("another broker took over this database")
    });
    let exit = b.daemon.wait_exit();
    assert_eq!(
        after, 0,
        "B, resumed, delivered on the connection of a session C took"
    );
    assert!(
        wills_of_sub(&mut b).is_empty(),
        "B published the will of a session C took"
    );
    // One connection of the client in the cluster: C's.
    assert_eq!((connected(&a, "sub"), connected(&c, "sub")), (0, 1));
    publisher.wait_acked(publisher.acked() + 100);
    let acked = publisher.finish();
    let (mut sub, got) = reading.finish();
    let got = receive_rest(&mut sub, &acked, got);

    // B started again (as a service manager would) on its database: without the session,
    // serving new clients, its wills logged as ever.
    b.restart();
    all_hear_three(&[&a, &b, &c]);
    assert_eq!(connected(&b, "sub"), 0);
    assert!(
        b.daemon.admin(r#"{"command":"client.list"}"#)["result"]["clients"]
            .as_array()
            .is_some_and(|cs| cs.iter().all(|c| c["client_id"] != "sub")),
        "B restored the session C took"
    );
    serves(&b);
    let (dropped, _) = Client::connect(
        b.daemon.addr(),
        Connect {
            client_id: "sub-2".into(),
            ..sub_connect()
        },
    );
    drop(dropped);
    b.daemon
        .wait_line("a will published on B", |l| l.contains("publishing will"));
    eprintln!(
        "{TEST}: CONNECT on C let in {} ms after B's stall, after {refused} refusals (0x88); \
         B, resumed, closed the old connection ({reason:?}) with {after} PUBLISH after \
         {buffered} buffered before the stall, exited {exit:?}; {} messages acknowledged \
         ({stalled_at} before the stall, {taken_at} before the take), {} received, {} \
         duplicates, none lost",
        took.as_millis(),
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}

/// B stalled for less than its database's stale heartbeat: the subscriber's CONNECT on C is
/// refused with 0x88 (the session left on B); once B resumes, the next CONNECT takes the
/// session from B over NATS (Session Present 1 [MQTT-3.2.2-2]), B closes the old connection
/// with 0x8E Session taken over [MQTT-3.1.4-3], and every message acknowledged to the
/// publisher reaches the subscriber [MQTT-4.3.2-4]. B keeps serving.
#[test]
fn a_subscribers_node_stalled_briefly_keeps_the_session_until_it_resumes_and_hands_it_over() {
    const TEST: &str =
        "a_subscribers_node_stalled_briefly_keeps_the_session_until_it_resumes_and_hands_it_over";
    let Some(setup) = stalled_under_stream(TEST, "cluster_stall_brief") else {
        return;
    };
    let Stalled {
        nodes: [a, mut b, c],
        mut old,
        publisher,
        got,
        stalled,
        stalled_at,
        buffered,
        ..
    } = setup;
    // B's heartbeat is fresh: its database is not taken, the CONNECT is refused.
    match Client::try_connect(c.daemon.addr(), sub_connect()) {
        Err(code) => assert_eq!(code, ReasonCode::SERVER_UNAVAILABLE),
        Ok(_) => panic!("the session of a node stalled for a moment taken"),
    }
    let refused_after = stalled.elapsed();
    assert!(
        refused_after < Duration::from_secs(10),
        "the refusal came {} ms after the stall, past the stale heartbeat: inconclusive",
        refused_after.as_millis()
    );
    b.resume();
    let (sub, present, refused) = reconnect(&c);
    assert!(present, "the session handed over by B [MQTT-3.2.2-2]");
    let reading = Reading::start(sub, got);
    // What B sent on the old connection after it resumed, and before the hand-over, is not
    // acknowledged: it stays in flight and C sends it again.
    let (after, reason) = until_closed(&mut old);
    assert_eq!(
        reason,
        Some(ReasonCode::SESSION_TAKEN_OVER),
        "[MQTT-3.1.4-3]"
    );
    // B answered, once resumed, the ask of the CONNECT refused while it was stalled too: that
    // hand-over is never confirmed, and B gives up waiting (`takeover_timeout` + 10 s) with
    // the session on C. The stream goes on past it.
    b.daemon
        .wait_logged("B giving up the unconfirmed hand-over", |l| {
            l.contains("handed over without confirmation")
        });
    publisher.wait_acked(publisher.acked() + 200);
    let acked = publisher.finish();
    let (mut sub, got) = reading.finish();
    let got = receive_rest(&mut sub, &acked, got);
    assert_eq!(
        (
            connected(&a, "sub"),
            connected(&b, "sub"),
            connected(&c, "sub")
        ),
        (0, 0, 1)
    );
    assert!(
        wills_of_sub(&mut b).is_empty(),
        "B published the will of a session it handed over"
    );
    assert!(b.daemon.is_running());
    serves(&b);
    eprintln!(
        "{TEST}: CONNECT on C refused (0x88) {} ms after B's stall, then {refused} more \
         refusals after B resumed; B sent {after} PUBLISH on the old connection after \
         {buffered} buffered before the stall, then closed it ({reason:?}); {} messages \
         acknowledged ({stalled_at} before the stall), {} received, {} duplicates, none lost",
        refused_after.as_millis(),
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}

/// B stalled with the subscriber's session: a second CONNECT of the client on C, made while
/// C still waits on B for the first, waits its turn; neither gets a new session (Session
/// Present 0 would leave the old one, with its queued messages, on B). Each is refused with
/// 0x88 or resumes the session [MQTT-3.2.2-2]; the client's next CONNECT gets it, with every
/// message acknowledged to the publisher [MQTT-4.3.2-4].
#[test]
fn two_connects_of_a_client_on_one_node_while_its_sessions_node_is_stalled_start_no_new_session() {
    const TEST: &str =
        "two_connects_of_a_client_on_one_node_while_its_sessions_node_is_stalled_start_no_new_session";
    let Some(setup) = stalled_under_stream(TEST, "cluster_stall_twice") else {
        return;
    };
    let Stalled {
        nodes: [_a, _b, c],
        publisher,
        got,
        ..
    } = setup;
    let addr = c.daemon.addr();
    let first = std::thread::spawn(move || Client::try_connect(addr, sub_connect()));
    // The second CONNECT starts while the first waits on B (at least `takeover_timeout`, 2 s,
    // for B's answer): not a synchronisation, the overlap this test is about.
    std::thread::sleep(Duration::from_millis(300));
    let second = Client::try_connect(addr, sub_connect());
    let first = first.join().expect("first CONNECT");
    let mut open = Vec::new();
    for (which, outcome) in [("first", first), ("second", second)] {
        match outcome {
            Ok((client, present)) => {
                assert!(
                    present,
                    "the {which} CONNECT started a new session while B holds the old one"
                );
                open.push(client);
            }
            Err(code) => assert_eq!(code, ReasonCode::SERVER_UNAVAILABLE, "{which} CONNECT"),
        }
    }
    drop(open);
    let (sub, present, _) = reconnect(&c);
    let reading = Reading::start(sub, got);
    assert!(
        present,
        "the session taken from B's database [MQTT-3.2.2-2]"
    );
    publisher.wait_acked(publisher.acked() + 100);
    let acked = publisher.finish();
    let (mut sub, got) = reading.finish();
    // Every acknowledged number reaches the subscriber (within the deadline).
    receive_rest(&mut sub, &acked, got);
}

/// The publisher's node A stalled mid-stream: the publisher, without a PUBACK for 5 s, goes
/// on through C from the message A did not acknowledge; every message acknowledged (by A
/// before its stall, by C after) reaches the persistent subscriber on B [MQTT-4.3.2-4]. A,
/// resumed (stalled past the 7 s after which it holds its writes until its next heartbeat:
/// its database was not taken), keeps serving.
#[test]
fn a_publishers_node_stalled_mid_stream_and_the_publisher_going_on_through_another_loses_nothing() {
    const TEST: &str =
        "a_publishers_node_stalled_mid_stream_and_the_publisher_going_on_through_another_loses_nothing";
    let Some((nats, pg)) = prerequisites(TEST, "cluster_stall_pub") else {
        return;
    };
    let [mut a, b, c] = nodes_on(&nats, &pg, true, "", CLUSTER_KEYS);
    let mut sub = subscriber(&b, "b", [&a, &c]);
    let publisher = Publisher::start_watching(
        &a.daemon,
        c.daemon.addr(),
        "pub",
        "chaos/pub",
        Duration::from_secs(5),
    );
    let mut got = BTreeMap::new();
    receive_some(&mut sub, 200, &mut got);
    a.stall();
    let stalled = Instant::now();
    let stalled_at = publisher.acked();
    wait_until("the publisher gone on through C", || {
        publisher.moved_at().is_some()
    });
    let moved_at = publisher.moved_at().unwrap_or_default();
    assert!(moved_at >= stalled_at, "moved to C before A's stall");
    publisher.wait_acked(moved_at + 200);
    // A stays stalled past the 7 s after which, resumed, it holds its writes until its next
    // heartbeat (no session was taken from its database: it goes on).
    wait_until("A stalled 8 s", || {
        stalled.elapsed() >= Duration::from_secs(8)
    });
    let stalled_for = stalled.elapsed();
    a.resume();
    publisher.wait_acked(publisher.acked() + 100);
    let acked = publisher.finish();
    let got = receive_rest(&mut sub, &acked, got);
    all_hear_three(&[&a, &b, &c]);
    serves(&a);
    assert!(a.daemon.is_running(), "A stopped");
    eprintln!(
        "{TEST}: A stalled {} ms; {} messages acknowledged ({moved_at} by A before its \
         stall, the rest by C), {} received on B, {} duplicates, none lost",
        stalled_for.as_millis(),
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}
