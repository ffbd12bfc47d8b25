//! Cluster mode (docs/cluster.md): mercuriod nodes on one nats-server route messages to each
//! other. Without nats-server the tests skip (a failure under `CI=true`).
#![cfg(unix)]

use super::cluster_qos::interest_of;
use bytes::Bytes;
use mercurio_core::codec::{
    Connect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, Unsubscribe,
};
use mercurio_testkit::{free_port, http, nats_server_bin, wait_until, Client, Daemon, NatsServer};

/// A node on `nats`, with `extra` configuration (sections before `[cluster]`) that adds
/// `listeners - 1` listeners.
fn node(nats: &NatsServer, name: &str, extra: &str, listeners: usize) -> Daemon {
    let mut d = Daemon::start(&format!(
        "{extra}[cluster]\nnats_urls = [\"{}\"]\nnode_name = \"{name}\"\njetstream_max_bytes = 67108864\n",
        nats.url()
    ));
    d.wait_listeners(listeners);
    d.wait_logged("the connection to NATS", |l| {
        l.contains("cluster: connected to NATS")
    });
    d
}

fn client(d: &Daemon, id: &str) -> Client {
    let connect = Connect {
        protocol: ProtocolVersion::V5,
        clean_start: true,
        keep_alive: 60,
        client_id: id.into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    };
    Client::connect(d.addr(), connect).0
}

/// Messages the server sent to the node `name`'s connection.
fn out_msgs(nats: &NatsServer, name: &str) -> u64 {
    let c = nats
        .connection(&format!("mercurio {name}"))
        .unwrap_or_else(|| panic!("node {name} is connected to NATS"));
    c["out_msgs"].as_u64().expect("out_msgs")
}

/// The NATS subscriptions of the connection `mercurio {name}` (a node's, or with ` shares`
/// its shared subscriptions'), as the server holds them.
fn subjects(nats: &NatsServer, name: &str) -> Vec<String> {
    let Some(c) = nats.connection(&format!("mercurio {name}")) else {
        return Vec::new();
    };
    let mut v: Vec<String> = c["subscriptions_list"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn a_message_published_on_one_node_reaches_the_subscribers_of_the_others_once() {
    const TEST: &str = "a_message_published_on_one_node_reaches_the_subscribers_of_the_others_once";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    let a = node(
        &nats,
        "a",
        "[server]\nsys_interval = 1\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nprotocol = \"websocket\"\nmetrics = true\n\n",
        2,
    );
    let metrics_addr = a.addrs()[1];
    let mut b = node(&nats, "b", "", 1);
    let c = node(&nats, "c", "", 1);

    // On A, two clients whose filters overlap: of A's NATS subjects (`t.*`; `t` and `t.>`
    // for `t/#`; `t.x`) three match `t/x`, so NATS sends A each message three times; A
    // routes it once.
    let mut wide = client(&a, "wide");
    wide.subscribe("t/+", QoS::AtLeastOnce);
    wide.subscribe("t/#", QoS::AtLeastOnce);
    let mut narrow = client(&a, "narrow");
    narrow.subscribe("t/x", QoS::AtLeastOnce);
    // On C, interest in other topics only.
    let mut other = client(&c, "other");
    other.subscribe("u/#", QoS::AtMostOnce);
    wait_until("A's interest at the NATS server", || {
        subjects(&nats, "a")
            == [
                "mercurio.long",
                "mercurio.msg.t",
                "mercurio.msg.t.*",
                "mercurio.msg.t.>",
                "mercurio.msg.t.x",
            ]
    });
    wait_until("C's interest at the NATS server", || {
        subjects(&nats, "c").len() == 3
    });
    // B, the publisher, knows what A and C want: its link takes those topics only.
    wait_until("A's and C's interest known to B", || {
        interest_of(&b, "a") == Some(3) && interest_of(&b, "c") == Some(1)
    });

    // From B: QoS 0, QoS 1, then QoS 0 again, and one on a topic nobody subscribes to.
    let mut publisher = client(&b, "publisher");
    publisher.publish("t/x", b"1", QoS::AtMostOnce, false);
    publisher.publish("t/x", b"2", QoS::AtLeastOnce, false);
    publisher.publish("nobody/here", b"-", QoS::AtMostOnce, false);
    publisher.publish("t/x", b"3", QoS::AtMostOnce, false);
    // The end marker, on C's topic, published last.
    publisher.publish("u/end", b"end", QoS::AtMostOnce, false);

    for sub in [&mut wide, &mut narrow] {
        let mut got = Vec::new();
        for _ in 0..3 {
            let p = sub.expect_publish();
            assert_eq!(p.topic, "t/x");
            sub.ack(&p);
            got.push((p.payload.to_vec(), p.qos));
        }
        // In order per QoS [MQTT-4.6.0-6]: QoS 1 crosses through JetStream, apart from
        // QoS 0 (docs/cluster.md, "Ordering").
        let qos0: Vec<&[u8]> = got
            .iter()
            .filter(|(_, qos)| *qos == QoS::AtMostOnce)
            .map(|(payload, _)| &payload[..])
            .collect();
        assert_eq!(qos0, [&b"1"[..], &b"3"[..]]);
        got.sort();
        assert_eq!(
            got,
            [
                (b"1".to_vec(), QoS::AtMostOnce),
                (b"2".to_vec(), QoS::AtLeastOnce),
                (b"3".to_vec(), QoS::AtMostOnce),
            ]
        );
    }
    let end = other.expect_publish();
    assert_eq!(
        (end.topic.as_str(), &end.payload[..]),
        ("u/end", &b"end"[..])
    );
    // No copy follows (the marker went out after everything else from B).
    wide.settle();
    narrow.settle();
    other.settle();

    // C, interested in `u/#` only, got the marker and nothing else over NATS; A got each
    // of the two QoS 0 `t/x` messages through its three matching subjects (the QoS 1 one
    // came through JetStream, once), nothing for `nobody/here` or `u/end`; B, the
    // publisher, nothing (no echo).
    assert_eq!(out_msgs(&nats, "c"), 1);
    assert_eq!(out_msgs(&nats, "a"), 6);
    assert_eq!(out_msgs(&nats, "b"), 0);
    // B sent NATS core the three QoS 0 messages other nodes want, not `nobody/here`.
    let in_msgs = nats
        .connection("mercurio b")
        .and_then(|c| c["in_msgs"].as_u64())
        .expect("B's in_msgs");
    assert_eq!(in_msgs, 3);
    // A's metrics: three messages in (one from JetStream), four copies dropped (once each
    // has come).
    let metric = |name: &str| -> u64 {
        let body = http::get(metrics_addr, "/metrics").body;
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {body}"))
    };
    assert_eq!(metric("mercurio_cluster_connected"), 1);
    assert_eq!(metric("mercurio_cluster_subscriptions"), 5);
    assert_eq!(metric("mercurio_cluster_messages_in_total"), 3);
    assert_eq!(metric("mercurio_cluster_jetstream_in_total"), 1);
    wait_until("the four copies dropped", || {
        metric("mercurio_cluster_duplicates_total") == 4
    });
    assert_eq!(metric("mercurio_cluster_messages_in_total"), 3);
    // The same in $SYS (published every second here).
    let mut sys = client(&a, "sys");
    sys.subscribe("$SYS/broker/cluster/messages/in", QoS::AtMostOnce);
    loop {
        let p = sys.expect_publish();
        if &p.payload[..] == b"3" {
            break;
        }
    }

    // Interest removed: `narrow` leaves and `wide` unsubscribes from both filters; A's
    // subjects go, and what B publishes on `t/x` no longer reaches A.
    narrow.disconnect();
    wide.send(Packet::Unsubscribe(Unsubscribe {
        packet_id: 2,
        filters: vec!["t/+".into(), "t/#".into()],
        properties: Properties::default(),
    }));
    assert!(matches!(wide.recv(), Some(Packet::UnsubAck(_))));
    wait_until("A's interest gone from the NATS server", || {
        subjects(&nats, "a") == ["mercurio.long"]
    });
    publisher.publish("t/x", b"4", QoS::AtMostOnce, false);
    publisher.publish("u/end", b"end2", QoS::AtMostOnce, false);
    let end = other.expect_publish();
    assert_eq!(&end.payload[..], b"end2");
    assert_eq!(out_msgs(&nats, "a"), 6, "nothing more sent to A");
    wide.settle();

    // A topic too long for a subject once escaped (each space takes three bytes) travels on
    // the subject of long topics, whole.
    let long_topic = format!("l/{}", "a b ".repeat(700));
    wide.subscribe("l/#", QoS::AtMostOnce);
    wait_until("A's interest in l/#", || {
        subjects(&nats, "a").contains(&"mercurio.msg.l.>".to_string())
            && interest_of(&b, "a") == Some(1)
    });
    publisher.publish(&long_topic, b"long", QoS::AtMostOnce, false);
    let p = wide.expect_publish();
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        (long_topic.as_str(), &b"long"[..])
    );

    // With NATS gone, a node still stops promptly on SIGTERM (the NATS client's flush and
    // drain are bounded).
    drop(nats);
    drop(publisher);
    let started = std::time::Instant::now();
    assert_eq!(b.stop(libc::SIGTERM), Some(0));
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    drop((a, c));
}

/// Node `name` configured for a NATS server on `port` of 127.0.0.1, not waiting for it.
fn node_for_port(port: u16, name: &str) -> Daemon {
    Daemon::start(&format!(
        "[cluster]\nnats_urls = [\"nats://127.0.0.1:{port}\"]\nnode_name = \"{name}\"\njetstream_max_bytes = 67108864\n"
    ))
}

#[test]
fn nodes_serve_their_clients_without_nats_and_route_once_it_is_back() {
    const TEST: &str = "nodes_serve_their_clients_without_nats_and_route_once_it_is_back";
    if nats_server_bin().is_none() {
        // Skips, or fails under CI=true, with the install command.
        let _ = NatsServer::start(TEST);
        return;
    }
    // NATS is not running yet: the nodes start anyway.
    let port = free_port();
    let mut a = node_for_port(port, "a");
    let mut b = node_for_port(port, "b");
    let mut sub = client(&a, "sub");
    sub.subscribe("t/#", QoS::AtLeastOnce);
    // Between clients of one node, everything works as without a cluster.
    let mut local = client(&a, "local");
    local.publish("t/local", b"here", QoS::AtLeastOnce, false);
    let p = sub.expect_publish();
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("t/local", &b"here"[..])
    );
    sub.ack(&p);

    // NATS comes up: both nodes connect, A subscribes to its interest, B's messages reach A.
    let nats = NatsServer::start_on(TEST, port).expect("nats-server");
    for d in [&mut a, &mut b] {
        d.wait_logged("the connection to NATS", |l| {
            l.contains("cluster: connected to NATS")
        });
    }
    let a_subjects = ["mercurio.long", "mercurio.msg.t", "mercurio.msg.t.>"];
    wait_until("A's interest at the NATS server, and known to B", || {
        subjects(&nats, "a") == a_subjects && interest_of(&b, "a") == Some(1)
    });
    let mut publisher = client(&b, "publisher");
    publisher.publish("t/1", b"one", QoS::AtLeastOnce, false);
    let p = sub.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("t/1", &b"one"[..]));
    sub.ack(&p);

    // NATS restarts: the nodes reconnect and subscribe again by themselves.
    drop(nats);
    for d in [&mut a, &mut b] {
        d.wait_logged("the disconnection", |l| {
            l.contains("cluster: disconnected from NATS")
        });
    }
    let nats = NatsServer::start_on(TEST, port).expect("nats-server");
    for d in [&mut a, &mut b] {
        d.wait_logged("the reconnection", |l| {
            l.contains("cluster: reconnected to NATS")
        });
    }
    wait_until("A's interest at the new NATS server", || {
        subjects(&nats, "a") == a_subjects
    });
    publisher.publish("t/2", b"two", QoS::AtLeastOnce, false);
    let p = sub.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("t/2", &b"two"[..]));
    sub.ack(&p);

    // QoS 2 with MQTT 5.0 properties, from B to a QoS 2 subscriber on A: delivered at QoS 2
    // with the publisher's properties, user properties in order [MQTT-3.3.2-17], [MQTT-3.3.2-18],
    // and the Message Expiry Interval decremented, never grown [MQTT-3.3.2-6].
    let mut q2 = client(&a, "q2");
    q2.subscribe("p/#", QoS::ExactlyOnce);
    wait_until("A's interest in p/#", || {
        subjects(&nats, "a").contains(&"mercurio.msg.p.>".to_string())
            && interest_of(&b, "a") == Some(2)
    });
    let properties = Properties {
        content_type: Some("text/plain".into()),
        response_topic: Some("r/1".into()),
        correlation_data: Some(Bytes::from_static(b"c-1")),
        payload_format_indicator: Some(1),
        message_expiry_interval: Some(600),
        user_properties: vec![
            ("k".into(), "1".into()),
            ("j".into(), "2".into()),
            ("k".into(), "3".into()),
        ],
        ..Properties::default()
    };
    publisher.send(Packet::Publish(Publish {
        dup: false,
        qos: QoS::ExactlyOnce,
        retain: false,
        topic: "p/1".into(),
        packet_id: 7,
        properties: properties.clone(),
        payload: Bytes::from_static(b"two-phase"),
    }));
    assert!(matches!(publisher.recv(), Some(Packet::PubRec(r)) if r.packet_id == 7));
    publisher.send(Packet::PubRel(PubAck {
        packet_id: 7,
        ..PubAck::default()
    }));
    assert!(matches!(publisher.recv(), Some(Packet::PubComp(r)) if r.packet_id == 7));
    let p = q2.expect_publish();
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("p/1", &b"two-phase"[..])
    );
    assert_eq!(p.qos, QoS::ExactlyOnce);
    assert!(!p.retain);
    let expiry = p.properties.message_expiry_interval.expect("an expiry");
    assert!((1..=600).contains(&expiry), "{expiry}");
    assert_eq!(
        Properties {
            message_expiry_interval: Some(600),
            ..p.properties.clone()
        },
        properties
    );
    q2.ack(&p);
    q2.settle();

    // A node stops gracefully (SIGTERM): its NATS connection is closed within the shutdown,
    // and the NATS server drops its subscriptions.
    drop(q2);
    drop(sub);
    drop(local);
    let started = std::time::Instant::now();
    assert_eq!(a.stop(libc::SIGTERM), Some(0));
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    wait_until("A gone from the NATS server", || {
        nats.connection("mercurio a").is_none()
    });
    // Stopping is no fault: draining and closing the NATS connections is no warning. The
    // JetStream stream was said ready once, though checked again when A connected.
    let warned = a.seen(|l| l.contains("WARN") && l.contains("cluster: NATS:"));
    assert!(warned.is_empty(), "{warned:?}");
    assert_eq!(
        a.seen(|l| l.contains("JetStream stream ready")).len(),
        1,
        "{:#?}",
        a.log()
    );
    drop(b);
}

#[test]
fn a_shared_subscription_group_gets_each_message_once_in_the_whole_cluster() {
    const TEST: &str = "a_shared_subscription_group_gets_each_message_once_in_the_whole_cluster";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    let a = node(&nats, "a", "", 1);
    let b = node(&nats, "b", "", 1);
    let c = node(&nats, "c", "", 1);
    // Members of group g on A and on C; an ordinary subscriber on A.
    let mut members = Vec::new();
    for (d, id) in [(&a, "member-a"), (&c, "member-c")] {
        let mut m = client(d, id);
        m.subscribe("$share/g/s/#", QoS::AtLeastOnce);
        members.push((id, m));
    }
    let mut plain = client(&a, "plain");
    plain.subscribe("s/#", QoS::AtLeastOnce);
    let group_subjects = ["mercurio.long", "mercurio.msg.s", "mercurio.msg.s.>"];
    wait_until("the group's queue subscriptions at the NATS server", || {
        subjects(&nats, "a shares") == group_subjects
            && subjects(&nats, "c shares") == group_subjects
            && subjects(&nats, "a").len() == 3
            && interest_of(&b, "a") == Some(2)
            && interest_of(&b, "c") == Some(1)
    });

    // Each member's messages, read on a thread of its own until its socket is shut down.
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut readers = Vec::new();
    let mut sockets = Vec::new();
    for (id, mut m) in members {
        sockets.push(m.stream.try_clone().expect("clone the socket"));
        let got = std::sync::Arc::clone(&got);
        readers.push(std::thread::spawn(move || {
            while let Some(p) = m.recv() {
                if let Packet::Publish(p) = p {
                    m.ack(&p);
                    let entry = (p.topic.clone(), p.payload.to_vec(), id);
                    got.lock().unwrap_or_else(|e| e.into_inner()).push(entry);
                }
            }
        }));
    }

    // 20 messages from B (no member there) and 20 from A (a member's node), at QoS 1
    // (through JetStream) and at QoS 0 (through the NATS queue group) each.
    let mut from_b = client(&b, "from-b");
    let mut from_a = client(&a, "from-a");
    for i in 0..20 {
        for qos in [QoS::AtLeastOnce, QoS::AtMostOnce] {
            let q = if qos == QoS::AtMostOnce { "0" } else { "" };
            let payload = i.to_string();
            from_b.publish(&format!("s/b{q}"), payload.as_bytes(), qos, false);
            from_a.publish(&format!("s/a{q}"), payload.as_bytes(), qos, false);
        }
    }
    from_b.settle();
    from_a.settle();
    // The ordinary subscriber gets all 80.
    for _ in 0..80 {
        let p = plain.expect_publish();
        plain.ack(&p);
    }
    plain.settle();
    let count = || got.lock().unwrap_or_else(|e| e.into_inner()).len();
    wait_until("80 messages to the group", || count() >= 80);
    for s in &sockets {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    for r in readers {
        r.join().expect("a reader");
    }
    // Once each in the group as a whole [MQTT-4.8.2-2 (one member per message)], spread by
    // NATS (QoS 0) or JetStream (QoS 1) over the nodes with members. In the stream: the
    // QoS 1 ones once each for the group (40), and B's for A's ordinary subscriber (20); the
    // QoS 0 ones not at all.
    let stream = nats.stream_state("mercurio_qos").expect("the stream");
    assert_eq!(stream["last_seq"], 60, "{stream}");
    let got = got.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut distinct: Vec<(String, Vec<u8>)> =
        got.iter().map(|(t, p, _)| (t.clone(), p.clone())).collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 80, "{got:?}");
    assert_eq!(got.len(), 80, "copies: {got:?}");
    drop((a, b, c));
}

/// The `cluster.status` answer of node `d`.
fn cluster_status(d: &Daemon) -> serde_json::Value {
    let answer = d.admin(r#"{"command":"cluster.status"}"#);
    assert_eq!(answer["ok"], true, "{answer}");
    answer["result"].clone()
}

/// A counter of `cluster.status` (`retained_in`, `nodes`...) on node `d`.
fn status_count(d: &Daemon, key: &str) -> u64 {
    cluster_status(d)[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} in cluster.status"))
}

/// The state `d` shows for node `name` in `cluster.status`.
fn member_state(d: &Daemon, name: &str) -> Option<String> {
    let status = cluster_status(d);
    status["members"]
        .as_array()?
        .iter()
        .find(|m| m["node"] == name)
        .and_then(|m| m["state"].as_str().map(String::from))
}

/// Subscribes `c` to `filter` and returns the retained messages that come before the broker
/// answers a PINGREQ sent after the SUBACK (retained messages are sent with the SUBACK).
fn retained_for(c: &mut Client, filter: &str) -> Vec<(String, Vec<u8>)> {
    c.subscribe(filter, QoS::AtMostOnce);
    c.send(Packet::PingReq);
    let mut got = Vec::new();
    loop {
        match c.recv() {
            Some(Packet::PingResp) => return got,
            Some(Packet::Publish(p)) => {
                assert!(p.retain, "a retained message: {p:?}");
                got.push((p.topic.clone(), p.payload.to_vec()));
            }
            other => panic!("expected PUBLISH or PINGRESP, got {other:?}"),
        }
    }
}

#[test]
fn retained_messages_are_cluster_wide_and_a_node_away_catches_up() {
    const TEST: &str = "retained_messages_are_cluster_wide_and_a_node_away_catches_up";
    if nats_server_bin().is_none() {
        let _ = NatsServer::start(TEST);
        return;
    }
    // Two NATS servers in one NATS cluster: A and B on the first, C on the second, which
    // stops for a while below (C alone then loses NATS).
    let (route1, route2, port2) = (free_port(), free_port(), free_port());
    let nats1 = NatsServer::start_clustered(TEST, 0, route1, &[route2]).expect("nats-server");
    let nats2 = NatsServer::start_clustered(TEST, port2, route2, &[route1]).expect("nats-server");
    wait_until("the NATS servers routed", || {
        nats1.routes() >= 1 && nats2.routes() >= 1
    });
    let extra = "[server]\nsys_interval = 1\n\n";
    // NATS core only (the servers have no JetStream): QoS 1 between nodes at most once.
    let cluster = "[cluster]\nheartbeat_interval = 1\njetstream = false\n";
    let start = |nats: &NatsServer, name: &str, more: &str, listeners: usize| {
        let mut d = Daemon::start(&format!(
            "{extra}{more}{cluster}nats_urls = [\"{}\"]\nnode_name = \"{name}\"\n",
            nats.url()
        ));
        d.wait_listeners(listeners);
        d.wait_logged("the connection to NATS", |l| {
            l.contains("cluster: connected to NATS")
        });
        d
    };
    let mut a = start(&nats1, "a", "", 1);
    let b = start(&nats1, "b", "", 1);
    let mut c = start(
        &nats2,
        "c",
        "[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nprotocol = \"websocket\"\nmetrics = true\n\n",
        2,
    );
    let c_metrics = c.addrs()[1];
    wait_until("three nodes up, as A, B and C see it", || {
        [&a, &b, &c].iter().all(|d| status_count(d, "nodes") == 3)
    });

    // Retained on A: a new subscriber on C gets it.
    let mut pa = client(&a, "pa");
    pa.publish("r/1", b"one", QoS::AtLeastOnce, true);
    wait_until("C has A's retained message", || {
        status_count(&c, "retained_in") == 1
    });
    let mut sc = client(&c, "sc");
    assert_eq!(
        retained_for(&mut sc, "r/#"),
        [("r/1".to_string(), b"one".to_vec())]
    );
    assert_eq!(status_count(&a, "retained_out"), 1);

    // Cleared on B: a new subscriber on A gets nothing.
    wait_until("C's interest known to B", || {
        interest_of(&b, "c") == Some(1)
    });
    let mut pb = client(&b, "pb");
    pb.publish("r/1", b"", QoS::AtLeastOnce, true);
    wait_until("A and C applied B's clear", || {
        status_count(&a, "retained_in") == 1 && status_count(&c, "retained_in") == 2
    });
    // (C's subscriber got the clear itself, routed as any message.)
    let p = sc.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("r/1", &b""[..]));
    let mut sa = client(&a, "sa");
    assert_eq!(retained_for(&mut sa, "r/#"), []);
    let mut sc2 = client(&c, "sc2");
    assert_eq!(retained_for(&mut sc2, "r/#"), []);

    // C loses NATS (its server stops): it reports degraded, keeps serving its own clients,
    // and the others show it as gone after three missed heartbeats.
    let mut sys = client(&c, "sys");
    sys.subscribe("$SYS/broker/cluster/degraded", QoS::AtMostOnce);
    drop(nats2);
    c.wait_logged("the disconnection", |l| {
        l.contains("cluster: disconnected from NATS")
    });
    assert_eq!(member_state(&c, "c").as_deref(), Some("degraded"));
    loop {
        let p = sys.expect_publish();
        if &p.payload[..] == b"1" {
            break;
        }
    }
    let metric = |name: &str| -> u64 {
        let body = http::get(c_metrics, "/metrics").body;
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {body}"))
    };
    assert_eq!(metric("mercurio_cluster_degraded"), 1);
    assert_eq!(metric("mercurio_cluster_connected"), 0);
    let mut local = client(&c, "local");
    local.publish("r/local", b"here", QoS::AtLeastOnce, false);
    let p = sc.expect_publish();
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("r/local", &b"here"[..])
    );
    wait_until("C gone, as A sees it", || {
        member_state(&a, "c").as_deref() == Some("gone") && status_count(&a, "nodes") == 2
    });
    // Membership changes are logged once each: C up at the start, then gone.
    let on_c = |what: &'static str| move |l: &str| l.contains(what) && l.contains("node=c");
    a.wait_logged(
        "C's heartbeats stopping, logged",
        on_c("cluster: node gone"),
    );
    assert_eq!(a.seen(on_c("cluster: node up")).len(), 1);

    // Meanwhile A retains r/2 and B r/3, then clears r/3: C missed all three.
    pa.publish("r/2", b"two", QoS::AtLeastOnce, true);
    pb.publish("r/3", b"three", QoS::AtLeastOnce, true);
    pb.publish("r/3", b"", QoS::AtLeastOnce, true);
    wait_until("A and B applied each other's changes", || {
        status_count(&a, "retained_in") == 3 && status_count(&b, "retained_in") == 2
    });

    // C's NATS server is back: C reconnects, asks for what it missed, and a new subscriber on
    // C gets r/2 (and not r/3).
    let nats2 = NatsServer::start_clustered(TEST, port2, route2, &[route1]).expect("nats-server");
    c.wait_logged("the reconnection", |l| {
        l.contains("cluster: reconnected to NATS")
    });
    wait_until("C caught up", || {
        let s = cluster_status(&c);
        s["state"] == "connected" && s["retained_stamps"] == 3 && s["nodes"] == 3
    });
    assert_eq!(metric("mercurio_cluster_degraded"), 0);
    let mut sc3 = client(&c, "sc3");
    assert_eq!(
        retained_for(&mut sc3, "r/#"),
        [("r/2".to_string(), b"two".to_vec())]
    );
    wait_until("C up again, as A sees it", || {
        member_state(&a, "c").as_deref() == Some("up")
    });
    wait_until("C back, logged", || {
        a.seen(on_c("cluster: node up")).len() == 2
    });
    assert_eq!(a.seen(on_c("cluster: node gone")).len(), 1);
    // The totals: three nodes, and the clients of all three.
    let clients: u64 = [&a, &b, &c]
        .iter()
        .map(|d| {
            d.admin(r#"{"command":"broker.status"}"#)["result"]["clients_connected"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    wait_until("the clients of the three nodes in A's totals", || {
        status_count(&a, "clients") == clients
    });
    drop((nats1, nats2));
}

#[test]
fn retained_changes_on_both_sides_of_a_partition_meet_when_it_heals() {
    const TEST: &str = "retained_changes_on_both_sides_of_a_partition_meet_when_it_heals";
    if nats_server_bin().is_none() {
        let _ = NatsServer::start(TEST);
        return;
    }
    // Two NATS servers not routed to each other yet: A on one, C on the other, each side
    // connected to NATS, neither hearing the other.
    let (route1, route2) = (free_port(), free_port());
    let nats1 = NatsServer::start_partitioned(TEST, route1).expect("nats-server");
    let nats2 = NatsServer::start_partitioned(TEST, route2).expect("nats-server");
    let start = |nats: &NatsServer, name: &str| {
        let mut d = Daemon::start(&format!(
            "[cluster]\nheartbeat_interval = 1\njetstream = false\n\
             nats_urls = [\"{}\"]\nnode_name = \"{name}\"\n",
            nats.url()
        ));
        d.wait_listeners(1);
        d.wait_logged("the connection to NATS", |l| {
            l.contains("cluster: connected to NATS")
        });
        d
    };
    let a = start(&nats1, "a");
    let c = start(&nats2, "c");
    let mut pa = client(&a, "pa");
    pa.publish("p/a", b"from a", QoS::AtLeastOnce, true);
    pa.publish("p/both", b"older", QoS::AtLeastOnce, true);
    let mut pc = client(&c, "pc");
    pc.publish("p/c", b"from c", QoS::AtLeastOnce, true);
    // The later change of p/both: A acknowledged its own before C's is made, so C's stamp is
    // not earlier on this one clock (and at the same millisecond, "c" is after "a").
    pc.publish("p/both", b"newer", QoS::AtLeastOnce, true);
    assert_eq!(status_count(&a, "nodes"), 1);
    assert_eq!(status_count(&c, "nodes"), 1);

    // The partition heals (the servers route to each other; no node reconnects): each node
    // hears the other, asks for its set, and both end with the same three topics, the later
    // change of p/both winning.
    nats2.route_to(route2, &[route1]);
    wait_until("the NATS servers routed", || {
        nats1.routes() >= 1 && nats2.routes() >= 1
    });
    wait_until("A and C caught up with each other", || {
        status_count(&a, "nodes") == 2
            && status_count(&c, "nodes") == 2
            && status_count(&a, "retained_stamps") == 3
            && status_count(&c, "retained_stamps") == 3
            && status_count(&a, "retained_in") >= 2
            && status_count(&c, "retained_in") >= 1
    });
    for d in [&a, &c] {
        let mut s = client(d, "reader");
        let mut got = retained_for(&mut s, "p/#");
        got.sort();
        assert_eq!(
            got,
            [
                ("p/a".to_string(), b"from a".to_vec()),
                ("p/both".to_string(), b"newer".to_vec()),
                ("p/c".to_string(), b"from c".to_vec()),
            ]
        );
    }
}
