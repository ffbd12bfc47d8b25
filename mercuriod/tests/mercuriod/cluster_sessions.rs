//! Sessions across cluster nodes (docs/cluster.md, "Sessions across nodes"): a client that
//! connects to another node takes its session there, handed over through NATS. Without
//! nats-server the tests skip (a failure under `CI=true`).
#![cfg(unix)]

use super::cluster_qos::interest_of;
use std::path::Path;

use std::sync::{Arc, Barrier};

use bytes::Bytes;
use mercurio_core::codec::{
    Connect, LastWill, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode,
};
use mercurio_testkit::{wait_until, Client, Daemon, NatsServer};

/// A node on `nats` with its sessions in an SQLite file of its own in `dir`
/// (`{name}.db`).
fn node(nats: &NatsServer, name: &str, dir: &Path) -> Daemon {
    let db = dir.join(format!("{name}.db"));
    let mut d = Daemon::start(&format!(
        "[storage]\nbackend = \"sqlite\"\npath = {:?}\n\n\
         [cluster]\nnats_urls = [\"{}\"]\nnode_name = \"{name}\"\nheartbeat_interval = 1\njetstream_max_bytes = 67108864\n",
        db.display().to_string(),
        nats.url()
    ));
    d.wait_logged("the connection to NATS", |l| {
        l.contains("cluster: connected to NATS")
    });
    d
}

/// Waits until each of `nodes` hears all of them.
fn wait_cluster(nodes: &[&Daemon]) {
    wait_until("every node hears the others", || {
        nodes.iter().all(|d| {
            let s = d.admin(r#"{"command":"cluster.status"}"#);
            s["result"]["nodes"].as_u64() == Some(nodes.len() as u64)
        })
    });
}

/// A NATS server and the nodes `names`, each on its own SQLite file in the returned
/// directory, once every node hears the others; `None` (the test skips, or fails under
/// CI=true) without nats-server.
fn cluster<const N: usize>(
    test: &str,
    names: [&str; N],
) -> Option<(NatsServer, tempfile::TempDir, [Daemon; N])> {
    let nats = NatsServer::start(test)?;
    let dir = tempfile::tempdir().expect("temp dir");
    let nodes = names.map(|name| node(&nats, name, dir.path()));
    wait_cluster(&nodes.iter().collect::<Vec<_>>());
    Some((nats, dir, nodes))
}

/// A persistent MQTT 5 CONNECT (session expiry `expiry` seconds), with `will`.
fn connect(id: &str, clean_start: bool, expiry: u32, will: Option<LastWill>) -> Connect {
    Connect {
        protocol: ProtocolVersion::V5,
        clean_start,
        keep_alive: 60,
        client_id: id.into(),
        will,
        username: None,
        password: None,
        properties: Properties {
            session_expiry_interval: Some(expiry),
            // One message in flight at a time: the others stay queued.
            receive_maximum: Some(1),
            ..Properties::default()
        },
    }
}

fn will(payload: &str, delay: u32) -> LastWill {
    LastWill {
        topic: "will/dev".into(),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
        qos: QoS::AtLeastOnce,
        retain: false,
        properties: Properties {
            will_delay_interval: Some(delay),
            ..Properties::default()
        },
    }
}

/// Whether node `d` has a session for `client_id` (`client.show`).
fn has_session(d: &Daemon, client_id: &str) -> bool {
    let show = d.admin(&format!(
        r#"{{"command":"client.show","client_id":"{client_id}"}}"#
    ));
    show["ok"] == true
}

/// The PUBLISHes `c` receives before the broker answers a PINGREQ, acknowledged.
fn drain(c: &mut Client) -> Vec<Publish> {
    c.send(Packet::PingReq);
    let mut got = Vec::new();
    loop {
        match c.recv() {
            Some(Packet::PingResp) => return got,
            Some(Packet::Publish(p)) => {
                c.ack(&p);
                got.push(p);
            }
            Some(_) => {}
            None => panic!("closed"),
        }
    }
}

#[test]
fn a_client_connecting_to_another_node_takes_its_session_there() {
    const TEST: &str = "a_client_connecting_to_another_node_takes_its_session_there";
    let Some((_nats, _dir, [a, b])) = cluster(TEST, ["a", "b"]) else {
        return;
    };

    // On A: a persistent session subscribed to dev/in, then three QoS 1 messages for it.
    let (mut dev, present) = Client::connect(a.addr(), connect("dev", true, 300, None));
    assert!(!present);
    dev.subscribe("dev/in", QoS::AtLeastOnce);
    dev.disconnect();
    let (mut publisher, _) = Client::connect(a.addr(), connect("pub", true, 0, None));
    for m in [b"m1", b"m2", b"m3"] {
        publisher.publish("dev/in", m, QoS::AtLeastOnce, false);
    }
    // The client back on A, with a will: m1 in flight and left unacknowledged, m2 and m3
    // queued behind it (Receive Maximum 1).
    let (mut on_a, present) =
        Client::connect(a.addr(), connect("dev", false, 300, Some(will("a", 0))));
    assert!(present);
    let m1 = on_a.expect_publish();
    assert_eq!(&m1.payload[..], b"m1");
    let (mut watcher, _) = Client::connect(b.addr(), connect("watcher", true, 0, None));
    watcher.subscribe("will/#", QoS::AtLeastOnce);
    wait_until("B's interest in will/# known to A", || {
        interest_of(&a, "b") == Some(1)
    });

    // The client connects to B: A closes its connection with Session taken over
    // [MQTT-3.1.4-3] and hands the session over; B resumes it [MQTT-3.2.2-2].
    let (mut on_b, present) = Client::connect(b.addr(), connect("dev", false, 300, None));
    assert!(present, "session present on B");
    match on_a.recv() {
        Some(Packet::Disconnect(d)) => assert_eq!(d.reason_code, ReasonCode::SESSION_TAKEN_OVER),
        other => panic!("expected DISCONNECT 0x8E on A, got {other:?}"),
    }
    assert!(on_a.recv().is_none(), "A's connection closed");
    // The message in flight is sent again (DUP) [MQTT-4.4.0-1], then the queued ones.
    let again = on_b.expect_publish();
    assert_eq!((&again.payload[..], again.dup), (&b"m1"[..], true));
    on_b.ack(&again);
    for m in [b"m2", b"m3"] {
        let p = on_b.expect_publish();
        assert_eq!(&p.payload[..], m);
        on_b.ack(&p);
    }
    // A no longer has the session, once B confirmed it has it.
    wait_until("the session gone from A", || !has_session(&a, "dev"));
    assert!(has_session(&b, "dev"));

    // The subscription came along: a message published on either node arrives once.
    wait_until("B's interest in dev/in known to A", || {
        interest_of(&a, "b") == Some(2)
    });
    publisher.publish("dev/in", b"from a", QoS::AtLeastOnce, false);
    let (mut publisher_b, _) = Client::connect(b.addr(), connect("pub-b", true, 0, None));
    publisher_b.publish("dev/in", b"from b", QoS::AtLeastOnce, false);
    let mut got: Vec<Vec<u8>> = Vec::new();
    while got.len() < 2 {
        let p = on_b.expect_publish();
        on_b.ack(&p);
        got.push(p.payload.to_vec());
    }
    got.sort();
    assert_eq!(got, [b"from a".to_vec(), b"from b".to_vec()]);
    assert!(drain(&mut on_b).is_empty(), "each message once");

    // The connection taken over on A did not publish its will: the marker, published on
    // A after the takeover, is the first thing the watcher gets.
    publisher.publish("will/marker", b"end", QoS::AtLeastOnce, false);
    let p = watcher.expect_publish();
    assert_eq!(p.topic, "will/marker", "no will before the marker");
}

#[test]
fn a_will_fires_once_in_the_cluster_when_a_handed_over_session_expires() {
    const TEST: &str = "a_will_fires_once_in_the_cluster_when_a_handed_over_session_expires";
    let Some((_nats, _dir, [a, b])) = cluster(TEST, ["a", "b"]) else {
        return;
    };
    let (mut watcher, _) = Client::connect(a.addr(), connect("watcher", true, 0, None));
    watcher.subscribe("will/#", QoS::AtLeastOnce);
    wait_until("A's interest in will/# known to B", || {
        interest_of(&b, "a") == Some(1)
    });

    // On A with a will delayed 1 s and a session of 1 s, then on B with another such will.
    let (mut on_a, _) = Client::connect(a.addr(), connect("dev", true, 1, Some(will("a", 1))));
    let (on_b, present) = Client::connect(b.addr(), connect("dev", false, 1, Some(will("b", 1))));
    assert!(present);
    assert!(
        matches!(on_a.recv(), Some(Packet::Disconnect(d)) if d.reason_code == ReasonCode::SESSION_TAKEN_OVER)
    );
    wait_until("the session gone from A", || !has_session(&a, "dev"));

    // B's connection ends without DISCONNECT: B's will goes out once, from B, when the
    // delay (or the session) ends [MQTT-3.1.2-8]; A holds nothing that could send another.
    drop(on_b);
    let p = watcher.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("will/dev", &b"b"[..]));
    watcher.send(Packet::PubAck(PubAck {
        packet_id: p.packet_id,
        ..PubAck::default()
    }));
    wait_until("the session expired on B", || !has_session(&b, "dev"));
    assert!(!has_session(&a, "dev"));
    let (mut publisher, _) = Client::connect(b.addr(), connect("pub", true, 0, None));
    publisher.publish("will/marker", b"end", QoS::AtLeastOnce, false);
    let p = watcher.expect_publish();
    assert_eq!(p.topic, "will/marker", "one will, then the marker");
}

#[test]
fn a_clean_start_ends_the_session_on_its_node_a_3_1_1_client_is_closed_and_a_crashed_nodes_copy_is_stale(
) {
    const TEST: &str =
        "a_clean_start_ends_the_session_on_its_node_a_3_1_1_client_is_closed_and_a_crashed_nodes_copy_is_stale";
    let Some((nats, dir, [mut a, b])) = cluster(TEST, ["a", "b"]) else {
        return;
    };

    // Clean Start on B: A's connection is taken over [MQTT-3.1.4-3] and its session ends
    // there; B starts a new one [MQTT-3.2.2-1].
    let (mut on_a, _) = Client::connect(a.addr(), connect("dev", true, 300, None));
    on_a.subscribe("dev/in", QoS::AtLeastOnce);
    let (on_b, present) = Client::connect(b.addr(), connect("dev", true, 300, None));
    assert!(!present, "a new session on B");
    assert!(
        matches!(on_a.recv(), Some(Packet::Disconnect(d)) if d.reason_code == ReasonCode::SESSION_TAKEN_OVER)
    );
    assert!(!has_session(&a, "dev"), "ended on A");
    on_b.disconnect();

    // A 3.1.1 client taken over is closed without DISCONNECT (none exists in 3.1.1)
    // [MQTT-3.1.4-3], and resumes its session on the other node [MQTT-3.2.2-2].
    let v311 = |id: &str| Connect {
        protocol: ProtocolVersion::V311,
        clean_start: false,
        keep_alive: 60,
        client_id: id.into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    };
    let (mut old_311, _) = Client::connect(a.addr(), v311("dev311"));
    old_311.subscribe("dev311/in", QoS::AtLeastOnce);
    let (_new_311, present) = Client::connect(b.addr(), v311("dev311"));
    assert!(present, "the 3.1.1 session on B");
    assert!(old_311.recv().is_none(), "closed without a packet");

    // The session's owner crashes: its sessions stay in its storage, out of reach. A client
    // connecting to B meanwhile is not held up beyond the takeover timeout, and gets what B
    // has: a new session.
    let (mut again, present) = Client::connect(a.addr(), connect("dev2", true, 300, None));
    assert!(!present);
    again.subscribe("old/in", QoS::AtLeastOnce);
    wait_until("A's storage holds the subscription", || {
        rusqlite::Connection::open(dir.path().join("a.db"))
            .and_then(|c| {
                c.query_row(
                    "SELECT count(*) FROM subscriptions WHERE client_id = 'dev2'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
            })
            .is_ok_and(|n| n == 1)
    });
    assert_eq!(a.stop(libc::SIGKILL), None);
    let (mut on_b, present) = Client::connect(b.addr(), connect("dev2", false, 300, None));
    assert!(!present, "the crashed node's session is out of reach");
    on_b.subscribe("new/in", QoS::AtLeastOnce);
    on_b.disconnect();

    // A back with its copy from before the crash: it is stale, and the registry names B:
    // A ends it at its start. The client connecting to B again resumes B's session (its
    // subscription is new/in, not old/in).
    let a = node(&nats, "a", dir.path());
    wait_cluster(&[&a, &b]);
    wait_until("A's stale copy ended", || !has_session(&a, "dev2"));
    let (mut on_b, present) = Client::connect(b.addr(), connect("dev2", false, 300, None));
    assert!(present);
    // B's interest: dev311/in and new/in.
    wait_until("B's interest in new/in known to A", || {
        interest_of(&a, "b") == Some(2)
    });
    let (mut publisher, _) = Client::connect(a.addr(), connect("pub", true, 0, None));
    publisher.publish("old/in", b"old", QoS::AtLeastOnce, false);
    publisher.publish("new/in", b"new", QoS::AtLeastOnce, false);
    let p = on_b.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("new/in", &b"new"[..]));
}

/// This node's sessions as the registry names it their owner (`cluster.status`).
fn registry_sessions(d: &Daemon) -> Option<u64> {
    d.admin(r#"{"command":"cluster.status"}"#)["result"]["registry_sessions"].as_u64()
}

/// Whether `c`'s connection is open: its PINGREQ answered, rather than a DISCONNECT (which
/// must be Session taken over) or a close.
fn open(c: &mut Client) -> bool {
    c.send(Packet::PingReq);
    match c.recv() {
        Some(Packet::PingResp) => true,
        Some(Packet::Disconnect(d)) => {
            assert_eq!(d.reason_code, ReasonCode::SESSION_TAKEN_OVER);
            false
        }
        None => false,
        other => panic!("expected PINGRESP or DISCONNECT, got {other:?}"),
    }
}

/// The address of whichever of `a` and `b` holds `id`'s session.
fn client_addr(a: &Daemon, b: &Daemon, id: &str) -> std::net::SocketAddr {
    if has_session(a, id) {
        a.addr()
    } else {
        b.addr()
    }
}

#[test]
fn two_connects_at_once_on_two_nodes_end_with_one_session() {
    const TEST: &str = "two_connects_at_once_on_two_nodes_end_with_one_session";
    let Some((_nats, _dir, [a, b, c])) = cluster(TEST, ["a", "b", "c"]) else {
        return;
    };

    // Several rounds, since "at once" is up to the scheduler: without a session anywhere,
    // and with one on C.
    for round in 0..10 {
        let id = format!("race{round}");
        let with_session = round % 2 == 1;
        if with_session {
            let (mut on_c, _) = Client::connect(c.addr(), connect(&id, true, 300, None));
            on_c.subscribe("race/in", QoS::AtLeastOnce);
            on_c.disconnect();
        }
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = [a.addr(), b.addr()]
            .into_iter()
            .map(|addr| {
                let (barrier, id) = (Arc::clone(&barrier), id.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    Client::try_connect(addr, connect(&id, false, 300, None))
                })
            })
            .collect();
        let mut open_ones = Vec::new();
        for racer in racers {
            match racer.join().expect("racer") {
                // The connection kept, or taken over by the other [MQTT-3.1.4-3].
                Ok((mut client, present)) => {
                    if open(&mut client) {
                        open_ones.push((client, present));
                    }
                }
                // The node whose claim lost refuses: Server busy.
                Err(code) => assert_eq!(code, ReasonCode::SERVER_BUSY, "{id}"),
            }
        }
        assert_eq!(
            open_ones.len(),
            1,
            "{id}: one connection open in the cluster"
        );
        wait_until("one node holds the session", || {
            [&a, &b, &c].iter().filter(|d| has_session(d, &id)).count() == 1
        });
        if with_session {
            // The one open resumed C's session [MQTT-3.2.2-2], its subscription included.
            let (mut client, present) = open_ones.pop().expect("one open");
            assert!(present, "{id}: C's session resumed");
            // Published on the node holding it (C's copy is gone: not there).
            let holder = client_addr(&a, &b, &id);
            let (mut publisher, _) = Client::connect(holder, connect("pub", true, 0, None));
            publisher.publish("race/in", id.as_bytes(), QoS::AtLeastOnce, false);
            let p = client.expect_publish();
            assert_eq!(&p.payload[..], id.as_bytes());
        }
    }
}

#[test]
fn a_node_back_from_a_crash_ends_a_session_another_node_owns_now_without_its_will() {
    const TEST: &str =
        "a_node_back_from_a_crash_ends_a_session_another_node_owns_now_without_its_will";
    let Some((nats, dir, [mut a, b, _c])) = cluster(TEST, ["a", "b", "c"]) else {
        return;
    };

    // A watcher's persistent session on A keeps what A publishes on will/# for it.
    let (mut watcher, _) = Client::connect(a.addr(), connect("watcher", true, 300, None));
    watcher.subscribe("will/#", QoS::AtLeastOnce);
    watcher.disconnect();
    // The device on A, with a will due as soon as its connection ends [MQTT-3.1.2-8].
    let (mut on_a, _) = Client::connect(a.addr(), connect("dev", true, 300, Some(will("a", 0))));
    on_a.subscribe("dev/in", QoS::AtLeastOnce);
    wait_until("A's storage holds the device's session", || {
        rusqlite::Connection::open(dir.path().join("a.db"))
            .and_then(|c| {
                c.query_row(
                    "SELECT count(*) FROM subscriptions WHERE client_id = 'dev'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
            })
            .is_ok_and(|n| n == 1)
    });
    assert_eq!(
        registry_sessions(&a),
        Some(2),
        "A owns the watcher and the device"
    );

    // A crashes; the device connects to B, which cannot reach A's copy and starts a new
    // session, now the device's in the registry.
    assert_eq!(a.stop(libc::SIGKILL), None);
    drop(on_a);
    let (mut on_b, present) = Client::connect(b.addr(), connect("dev", false, 300, None));
    assert!(!present, "A's copy is out of reach");
    assert_eq!(
        registry_sessions(&b),
        Some(1),
        "B owns the device's session"
    );

    // A back: at its start, before any CONNECT, it ends its copy (the registry names B),
    // without publishing the will its crashed connection left due.
    let a = node(&nats, "a", dir.path());
    wait_until("A's stale copy ended at its start", || {
        !has_session(&a, "dev")
    });
    assert_eq!(
        registry_sessions(&a),
        Some(1),
        "A owns the watcher's session only"
    );
    assert!(open(&mut on_b), "the device still connected to B");
    let (mut watcher, present) = Client::connect(a.addr(), connect("watcher", false, 300, None));
    assert!(present);
    let (mut publisher, _) = Client::connect(a.addr(), connect("pub", true, 0, None));
    publisher.publish("will/marker", b"end", QoS::AtLeastOnce, false);
    let p = watcher.expect_publish();
    assert_eq!(p.topic, "will/marker", "no will before the marker");
    assert_eq!(
        registry_sessions(&b),
        Some(1),
        "B still owns the device's session"
    );
}

#[test]
fn a_delayed_will_is_not_published_by_a_node_whose_session_another_node_claimed_meanwhile() {
    const TEST: &str =
        "a_delayed_will_is_not_published_by_a_node_whose_session_another_node_claimed_meanwhile";
    let Some((_nats, _dir, [a, b, c])) = cluster(TEST, ["a", "b", "c"]) else {
        return;
    };
    let (mut watcher, _) = Client::connect(c.addr(), connect("watcher", true, 0, None));
    watcher.subscribe("will/#", QoS::AtLeastOnce);
    wait_until("C's interest in will/# known to A", || {
        interest_of(&a, "c") == Some(1)
    });

    // The device's connection to A ends without DISCONNECT: its will is due in 4 s
    // [MQTT-3.1.3-9]. A stops answering (SIGSTOP) before that, and the device connects to
    // B, which claims the session in the registry and, A silent, starts a new one.
    let (on_a, _) = Client::connect(a.addr(), connect("dev", true, 60, Some(will("a", 4))));
    drop(on_a);
    wait_until("A saw the connection end", || {
        a.admin(r#"{"command":"client.show","client_id":"dev"}"#)["result"]["connected"] == false
    });
    a.signal(libc::SIGSTOP);
    let (mut on_b, present) = Client::connect(b.addr(), connect("dev", false, 60, None));
    a.signal(libc::SIGCONT);
    assert!(!present, "A did not answer");

    // A's will timer finds the session owned by B: A's copy ends, without the will.
    wait_until("A's copy ended by its timer", || !has_session(&a, "dev"));
    let (mut publisher, _) = Client::connect(a.addr(), connect("pub", true, 0, None));
    publisher.publish("will/marker", b"end", QoS::AtLeastOnce, false);
    let p = watcher.expect_publish();
    assert_eq!(p.topic, "will/marker", "no will before the marker");
    assert!(open(&mut on_b), "the device still connected to B");
}
