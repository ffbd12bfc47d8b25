//! QoS 1 and 2 between cluster nodes, at least once, through JetStream (docs/cluster.md, "QoS
//! across nodes"): mercuriod nodes, each on its own SQLite storage with `durable_ack`, on a
//! NATS cluster of three servers with JetStream. Every message a publisher had acknowledged
//! reaches a persistent subscriber on another node, even when either node is killed
//! (SIGKILL) meanwhile. Without nats-server the tests skip (a failure under `CI=true`).
#![cfg(unix)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mercurio_core::codec::{
    Connect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode,
};
use mercurio_testkit::{
    free_port, http, wait_until, Client, ClusterNode, Daemon, NatsCluster, NatsServer, DEADLINE,
};

/// `[cluster]` keys of every node: three copies of the stream on the three NATS servers, and
/// heartbeats every second (a node killed is seen gone in three).
pub(super) const CLUSTER_KEYS: &str = "heartbeat_interval = 1\njetstream_replicas = 3\n";

/// Nodes `a` and `b`, each connected to its own NATS server of `nats`.
fn nodes(nats: &NatsCluster) -> (ClusterNode, ClusterNode) {
    let urls = nats.urls();
    let a = ClusterNode::start("a", &urls[0..1], "", CLUSTER_KEYS);
    let b = ClusterNode::start("b", &urls[1..2], "", CLUSTER_KEYS);
    (a, b)
}

/// A 5.0 client; `persistent`: an hour of session expiry, the session resumed if there is
/// one.
pub(super) fn client(d: &Daemon, id: &str, persistent: bool) -> Client {
    client_at(d.addr(), id, persistent)
}

/// [`client`] connecting to `addr`.
fn client_at(addr: SocketAddr, id: &str, persistent: bool) -> Client {
    connect_at(addr, id, persistent).0
}

/// [`client`], and whether its session was present (CONNACK).
pub(super) fn connect(d: &Daemon, id: &str, persistent: bool) -> (Client, bool) {
    connect_at(d.addr(), id, persistent)
}

/// [`connect`] to `addr`.
fn connect_at(addr: SocketAddr, id: &str, persistent: bool) -> (Client, bool) {
    let connect = Connect {
        protocol: ProtocolVersion::V5,
        clean_start: !persistent,
        keep_alive: 60,
        client_id: id.into(),
        will: None,
        username: None,
        password: None,
        properties: Properties {
            session_expiry_interval: persistent.then_some(3600),
            ..Properties::default()
        },
    };
    Client::connect(addr, connect)
}

/// A `[[listeners]]` section serving `/metrics` on a free port, and that port's address.
fn metrics_listener() -> (String, SocketAddr) {
    let port = free_port();
    let section = format!(
        "[[listeners]]\nhost = \"127.0.0.1\"\nport = {port}\nprotocol = \"websocket\"\n\
         metrics = true\n\n"
    );
    (section, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// The value of `/metrics`' sample `name` at `addr`.
fn metric(addr: SocketAddr, name: &str) -> u64 {
    let body = http::get(addr, "/metrics").body;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} in {body}"))
}

/// The filters and shared groups of node `name` that `d` knows (`cluster.status`), `None`
/// while it knows none.
pub(super) fn interest_of(d: &Daemon, name: &str) -> Option<u64> {
    let answer = d.admin(r#"{"command":"cluster.status"}"#);
    answer["result"]["members"]
        .as_array()?
        .iter()
        .find(|m| m["node"] == name)
        .and_then(|m| m["interest"].as_u64())
}

/// A publisher on its own thread: QoS 1 messages `0`, `1`, ... on `topic`, one at a time,
/// each after the previous one's PUBACK, until told to stop or its connection closes (then,
/// given a node to fall back on, it connects there and goes on from the unacknowledged one).
pub(super) struct Publisher {
    /// The numbers the broker acknowledged (PUBACK), in order.
    acked: Arc<Mutex<Vec<u32>>>,
    /// How many were acknowledged when it fell back on the other node, once it did.
    moved_at: Arc<Mutex<Option<usize>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Publisher {
    pub(super) fn start(d: &Daemon, id: &str, topic: &'static str) -> Publisher {
        Publisher::start_with_fallback(d, None, id, topic)
    }

    /// [`Publisher::start`], reconnecting to `fallback` (once) when its node closes the
    /// connection.
    pub(super) fn start_with_fallback(
        d: &Daemon,
        fallback: Option<SocketAddr>,
        id: &str,
        topic: &'static str,
    ) -> Publisher {
        Publisher::spawn(d, fallback, id, topic, None)
    }

    /// [`Publisher::start_with_fallback`], falling back also when a PUBACK does not come
    /// within `silence` (its node stalled: the connection open and silent), as a client's
    /// keep alive would.
    pub(super) fn start_watching(
        d: &Daemon,
        fallback: SocketAddr,
        id: &str,
        topic: &'static str,
        silence: Duration,
    ) -> Publisher {
        Publisher::spawn(d, Some(fallback), id, topic, Some(silence))
    }

    fn spawn(
        d: &Daemon,
        mut fallback: Option<SocketAddr>,
        id: &str,
        topic: &'static str,
        silence: Option<Duration>,
    ) -> Publisher {
        let mut c = client(d, id, false);
        let client_id = id.to_string();
        let acked = Arc::new(Mutex::new(Vec::new()));
        let moved_at = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let (acked2, moved2, stop2) =
            (Arc::clone(&acked), Arc::clone(&moved_at), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let mut n = 0u32;
            while !stop2.load(Ordering::Relaxed) {
                let id = c.publish_packet(topic, n.to_string().as_bytes(), QoS::AtLeastOnce, false);
                let answer = match c.recv_within(silence.unwrap_or(DEADLINE)) {
                    Some(answer) => answer,
                    None if silence.is_some() && fallback.is_some() => None,
                    None => panic!("no PUBACK {id} before the deadline"),
                };
                match answer {
                    Some(Packet::PubAck(a)) if a.packet_id == id => {
                        assert!(!a.reason_code.is_failure(), "PUBACK {a:?}");
                        acked2.lock().expect("acked").push(n);
                    }
                    // The node is gone (killed) or silent (stalled): what it acknowledged is
                    // what counts; the unacknowledged message goes again to the node fallen
                    // back on.
                    None => match fallback.take() {
                        Some(addr) => {
                            *moved2.lock().expect("moved") =
                                Some(acked2.lock().expect("acked").len());
                            c = client_at(addr, &client_id, false);
                            continue;
                        }
                        None => return,
                    },
                    Some(other) => panic!("expected PUBACK {id}, got {other:?}"),
                }
                n += 1;
            }
        });
        Publisher {
            acked,
            moved_at,
            stop,
            thread: Some(thread),
        }
    }

    pub(super) fn acked(&self) -> usize {
        self.acked.lock().expect("acked").len()
    }

    /// How many messages were acknowledged when it fell back on the other node; `None`
    /// while it has not.
    pub(super) fn moved_at(&self) -> Option<usize> {
        *self.moved_at.lock().expect("moved")
    }

    /// Waits until `n` messages in all were acknowledged.
    pub(super) fn wait_acked(&self, n: usize) {
        wait_until(
            &format!("{n} messages acknowledged to the publisher"),
            || self.acked() >= n,
        );
    }

    /// Stops (or waits for the end of) the thread; the numbers acknowledged.
    pub(super) fn finish(mut self) -> Vec<u32> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("publisher thread");
        }
        std::mem::take(&mut *self.acked.lock().expect("acked"))
    }
}

/// Receives until every number of `acked` has come (at QoS 1, acknowledging each; each
/// packet within the client's deadline); returns how many times each number came.
fn receive_all(sub: &mut Client, acked: &[u32]) -> BTreeMap<u32, u32> {
    receive_rest(sub, acked, BTreeMap::new())
}

/// [`receive_all`], counting on from `got` (what the subscriber received before).
pub(super) fn receive_rest(
    sub: &mut Client,
    acked: &[u32],
    mut got: BTreeMap<u32, u32>,
) -> BTreeMap<u32, u32> {
    let missing = |got: &BTreeMap<u32, u32>| acked.iter().filter(|n| !got.contains_key(n)).count();
    while missing(&got) > 0 {
        let p = match sub.recv_within(DEADLINE) {
            Some(Some(Packet::Publish(p))) => p,
            other => {
                let lost: Vec<&u32> = acked.iter().filter(|n| !got.contains_key(n)).collect();
                panic!(
                    "{} of {} acknowledged messages missing (the first: {:?}); got {other:?}",
                    lost.len(),
                    acked.len(),
                    &lost[..lost.len().min(20)]
                )
            }
        };
        assert_eq!(p.qos, QoS::AtLeastOnce);
        sub.ack(&p);
        *got.entry(number(&p)).or_insert(0) += 1;
    }
    got
}

/// The number a [`Publisher`]'s message carries.
pub(super) fn number(p: &Publish) -> u32 {
    std::str::from_utf8(&p.payload)
        .expect("UTF-8")
        .parse()
        .expect("a number")
}

/// Copies received beyond the first, as the test's report.
pub(super) fn duplicates(got: &BTreeMap<u32, u32>) -> u32 {
    got.values().map(|c| c - 1).sum()
}

#[test]
fn qos_1_and_2_messages_acknowledged_on_one_node_reach_a_persistent_subscriber_on_another() {
    const TEST: &str =
        "qos_1_and_2_messages_acknowledged_on_one_node_reach_a_persistent_subscriber_on_another";
    let Some(nats) = NatsCluster::start(TEST, 3) else {
        return;
    };
    let (a, b) = nodes(&nats);
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("q/#", QoS::ExactlyOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    let mut publisher = client(&a.daemon, "pub", false);
    // Each PUBACK / PUBREC comes once JetStream holds the message for B
    // [MQTT-4.3.2-1] [MQTT-4.3.3-1].
    for n in 0..100u32 {
        publisher.publish("q/1", n.to_string().as_bytes(), QoS::AtLeastOnce, false);
    }
    publisher.publish("q/2", b"exactly", QoS::ExactlyOnce, false);
    let acked: Vec<u32> = (0..100).collect();
    let mut got = BTreeMap::new();
    let mut exactly = 0;
    while got.len() < acked.len() || exactly == 0 {
        let p = sub.expect_publish();
        sub.ack(&p);
        if p.topic == "q/2" {
            assert_eq!((&p.payload[..], p.qos), (&b"exactly"[..], QoS::ExactlyOnce));
            exactly += 1;
            continue;
        }
        assert_eq!((p.topic.as_str(), p.qos), ("q/1", QoS::AtLeastOnce));
        let n: u32 = std::str::from_utf8(&p.payload)
            .expect("UTF-8")
            .parse()
            .expect("n");
        *got.entry(n).or_insert(0u32) += 1;
    }
    // In order, each once: nothing failed, so nothing was sent twice.
    assert_eq!(got.keys().copied().collect::<Vec<_>>(), acked);
    assert_eq!(duplicates(&got), 0);
    // JetStream took each message once, and let it go once B had it.
    let stream = || {
        nats.servers[0]
            .stream_state("mercurio_qos")
            .expect("the stream")
    };
    wait_until("the stream emptied by B's acknowledgements", || {
        stream()["messages"] == 0
    });
    assert_eq!(stream()["last_seq"], 101);
    // A message only A's clients want costs JetStream nothing, nor does QoS 0 to B.
    let mut local = client(&a.daemon, "local", false);
    local.subscribe("l/#", QoS::AtLeastOnce);
    publisher.publish("l/1", b"here", QoS::AtLeastOnce, false);
    let p = local.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("l/1", &b"here"[..]));
    publisher.publish("q/0", b"zero", QoS::AtMostOnce, false);
    let p = sub.expect_publish();
    assert_eq!((p.topic.as_str(), p.qos), ("q/0", QoS::AtMostOnce));
    assert_eq!(stream()["last_seq"], 101);
}

#[test]
fn without_jetstream_a_publisher_is_not_acknowledged_and_closed_as_server_busy() {
    const TEST: &str =
        "without_jetstream_a_publisher_is_not_acknowledged_and_closed_as_server_busy";
    // One NATS server without JetStream.
    let Some(nats) = NatsServer::start_clustered(TEST, 0, free_port(), &[]) else {
        return;
    };
    let keys = "heartbeat_interval = 1\njetstream_ack_timeout = 2\n";
    let a = ClusterNode::start("a", &[nats.url()], "", keys);
    let b = ClusterNode::start("b", &[nats.url()], "", keys);
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("q/#", QoS::AtLeastOnce);
    let mut local = client(&a.daemon, "local", false);
    local.subscribe("q/#", QoS::AtLeastOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    // The message reaches A's own subscriber, but JetStream cannot hold it for B: no PUBACK
    // (it would acknowledge what B may never get), and after jetstream_ack_timeout the
    // publisher is told, DISCONNECT 0x89 Server busy (MQTT 5.0 section 3.14.2.1), and may
    // send it again.
    let mut publisher = client(&a.daemon, "pub", false);
    publisher.publish_packet("q/1", b"one", QoS::AtLeastOnce, false);
    let p = local.expect_publish();
    assert_eq!(&p.payload[..], b"one");
    match publisher.recv() {
        Some(Packet::Disconnect(d)) => assert_eq!(d.reason_code, ReasonCode::SERVER_BUSY),
        other => panic!("expected DISCONNECT 0x89, got {other:?}"),
    }
    assert!(publisher.recv().is_none(), "closed");
    // A message only A's clients want is acknowledged as ever.
    let mut publisher = client(&a.daemon, "pub", false);
    local.subscribe("l/#", QoS::AtLeastOnce);
    publisher.publish("l/1", b"here", QoS::AtLeastOnce, false);
    let p = local.expect_publish();
    assert_eq!(&p.payload[..], b"here");
}

#[test]
fn killing_the_publishers_node_loses_no_message_it_acknowledged() {
    const TEST: &str = "killing_the_publishers_node_loses_no_message_it_acknowledged";
    let Some(nats) = NatsCluster::start(TEST, 3) else {
        return;
    };
    let (mut a, b) = nodes(&nats);
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("chaos/#", QoS::AtLeastOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    // A continuous stream from a publisher on A; A is killed in the middle of it.
    let publisher = Publisher::start(&a.daemon, "pub", "chaos/a");
    publisher.wait_acked(300);
    a.kill();
    let acked = publisher.finish();
    assert!(acked.len() >= 300);
    let got = receive_all(&mut sub, &acked);
    eprintln!(
        "{TEST}: {} messages acknowledged before the kill, {} received on B, {} duplicates",
        acked.len(),
        got.len(),
        duplicates(&got)
    );
}

#[test]
fn a_subscribers_node_killed_and_restarted_gets_every_message_acknowledged_meanwhile() {
    const TEST: &str =
        "a_subscribers_node_killed_and_restarted_gets_every_message_acknowledged_meanwhile";
    let Some(nats) = NatsCluster::start(TEST, 3) else {
        return;
    };
    let (a, mut b) = nodes(&nats);
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("chaos/#", QoS::AtLeastOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    let publisher = Publisher::start(&a.daemon, "pub", "chaos/b");
    publisher.wait_acked(200);
    // B dies under its subscriber's stream; the publisher goes on while A sees B gone (three
    // heartbeats), and after.
    b.kill();
    drop(sub);
    let killed_at = publisher.acked();
    wait_until("B seen gone by A", || {
        a.daemon.admin(r#"{"command":"cluster.status"}"#)["result"]["members"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["node"] == "b" && m["state"] == "gone"))
    });
    publisher.wait_acked(publisher.acked() + 200);
    // A message for a node that is away waits in JetStream for it: its publisher is told
    // success, not 0x10 No matching subscribers [MQTT-3.4.2.1].
    let mut probe = client(&a.daemon, "probe", false);
    // (A number out of the publisher's range, as the subscriber reads numbers.)
    let id = probe.publish_packet("chaos/b", b"4000000000", QoS::AtLeastOnce, false);
    expect_acknowledgement(&mut probe, id, QoS::AtLeastOnce, ReasonCode::SUCCESS);
    drop(probe);
    // B is back, on the same storage: the subscriber's session, and what JetStream held.
    b.restart();
    publisher.wait_acked(publisher.acked() + 100);
    let acked = publisher.finish();
    let mut sub = client(&b.daemon, "sub", true);
    let got = receive_all(&mut sub, &acked);
    eprintln!(
        "{TEST}: {} messages acknowledged ({} before the kill), {} received on B, {} duplicates",
        acked.len(),
        killed_at,
        got.len(),
        duplicates(&got)
    );
}

#[test]
fn a_publisher_waits_while_nats_is_down_and_is_acknowledged_once_jetstream_has_the_message() {
    const TEST: &str =
        "a_publisher_waits_while_nats_is_down_and_is_acknowledged_once_jetstream_has_the_message";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    let port = nats.port;
    let keys = "heartbeat_interval = 1\njetstream_ack_timeout = 120\n";
    let mut a = ClusterNode::start("a", &[nats.url()], "", keys);
    let mut b = ClusterNode::start("b", &[nats.url()], "", keys);
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("q/#", QoS::AtLeastOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    let mut publisher = client(&a.daemon, "pub", false);
    publisher.publish("q/1", b"before", QoS::AtLeastOnce, false);
    assert_eq!(&sub.expect_publish().payload[..], b"before");

    // NATS goes away: a QoS 1 message for B is not acknowledged (its PINGRESP, asked for
    // after it, comes first) [MQTT-4.3.2-1].
    drop(nats);
    for d in [&mut a.daemon, &mut b.daemon] {
        d.wait_logged("the disconnection", |l| {
            l.contains("cluster: disconnected from NATS")
        });
    }
    let id = publisher.publish_packet("q/1", b"during", QoS::AtLeastOnce, false);
    publisher.send(Packet::PingReq);
    assert!(matches!(publisher.recv(), Some(Packet::PingResp)));

    // NATS is back, its JetStream empty: the nodes make the stream and B's consumer again,
    // A's message goes in, its PUBACK follows, and B's subscriber gets it.
    let nats = NatsServer::start_on(TEST, port).expect("nats-server");
    assert!(matches!(publisher.recv(), Some(Packet::PubAck(p)) if p.packet_id == id));
    let p = sub.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("q/1", &b"during"[..]));
    sub.ack(&p);
    // Through the new server's stream, made again: the one message.
    let state = nats
        .stream_state("mercurio_qos")
        .expect("the stream made again");
    assert_eq!(state["last_seq"], 1);
}

/// The next packet `c` receives is the acknowledgement of its PUBLISH `id` sent at `qos`
/// (PUBACK for QoS 1, PUBREC for QoS 2), with `reason`.
fn expect_acknowledgement(c: &mut Client, id: u16, qos: QoS, reason: ReasonCode) {
    let got = c.recv();
    let ack = match (&got, qos) {
        (Some(Packet::PubAck(a)), QoS::AtLeastOnce)
        | (Some(Packet::PubRec(a)), QoS::ExactlyOnce) => a,
        _ => panic!("expected the acknowledgement of {id} at {qos:?}, got {got:?}"),
    };
    assert_eq!((ack.packet_id, ack.reason_code), (id, reason));
}

/// Publishes a QoS 1 message on a topic nobody subscribes to (it waits for nothing but
/// storage, as every acknowledgement under `durable_ack`, in order) and returns the first
/// packet `c` receives after sending it: its PUBACK when no acknowledgement owed before it is
/// ready, else that acknowledgement.
fn next_acknowledgement(c: &mut Client) -> Option<Packet> {
    let id = c.publish_packet("nobody/here", b"marker", QoS::AtLeastOnce, false);
    let got = c.recv();
    if matches!(&got, Some(Packet::PubAck(a)) if a.packet_id == id) {
        return None;
    }
    got
}

#[test]
fn a_resent_qos_2_publish_gets_its_pubrec_only_once_jetstream_has_the_message() {
    const TEST: &str = "a_resent_qos_2_publish_gets_its_pubrec_only_once_jetstream_has_the_message";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    let port = nats.port;
    let keys = "heartbeat_interval = 1\njetstream_ack_timeout = 120\n";
    let (metrics, metrics_addr) = metrics_listener();
    let mut a = ClusterNode::start("a", &[nats.url()], &metrics, keys);
    let metric = |name: &str| metric(metrics_addr, name);
    let mut b = ClusterNode::start("b", &[nats.url()], "", keys);
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("q/#", QoS::ExactlyOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    drop(nats);
    for d in [&mut a.daemon, &mut b.daemon] {
        d.wait_logged("the disconnection", |l| {
            l.contains("cluster: disconnected from NATS")
        });
    }
    // A QoS 2 message for B while JetStream is away: no PUBREC (a later message's PUBACK,
    // which follows every acknowledgement ready before it, comes first).
    let mut publisher = client(&a.daemon, "pub", true);
    let id = publisher.publish_packet("q/1", b"once", QoS::ExactlyOnce, false);
    assert_eq!(next_acknowledgement(&mut publisher), None);
    // What waits for JetStream, as operators see it: the message, its bytes.
    assert_eq!(metric("mercurio_cluster_jetstream_pending_messages"), 1);
    let bytes = metric("mercurio_cluster_jetstream_pending_bytes");
    assert!(
        bytes >= 7,
        "{bytes} bytes pending (topic and payload at least)"
    );
    let status = a.daemon.admin(r#"{"command":"cluster.status"}"#);
    assert_eq!(status["result"]["jetstream_pending_messages"], 1);
    assert_eq!(status["result"]["jetstream_pending_bytes"], bytes);
    // The client reconnects and sends it again, DUP set, same packet identifier
    // [MQTT-4.4.0-1]: its PUBREC waits as the first copy's does.
    drop(publisher);
    let (mut publisher, present) = connect(&a.daemon, "pub", true);
    assert!(present, "the publisher's session resumed");
    publisher.send(Packet::Publish(Publish {
        dup: true,
        qos: QoS::ExactlyOnce,
        retain: false,
        topic: "q/1".into(),
        packet_id: id,
        properties: Properties::default(),
        payload: bytes::Bytes::from_static(b"once"),
    }));
    assert_eq!(
        next_acknowledgement(&mut publisher),
        None,
        "no PUBREC before JetStream has the message"
    );
    // JetStream back: the message goes in, then the PUBREC, and B's subscriber gets it once.
    let _nats = NatsServer::start_on(TEST, port).expect("nats-server");
    expect_acknowledgement(&mut publisher, id, QoS::ExactlyOnce, ReasonCode::SUCCESS);
    let p = sub.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("q/1", &b"once"[..]));
    wait_until("nothing waiting for JetStream", || {
        metric("mercurio_cluster_jetstream_pending_bytes") == 0
            && metric("mercurio_cluster_jetstream_pending_messages") == 0
    });
}

#[test]
fn a_bridge_acknowledges_its_remote_only_once_jetstream_has_the_message() {
    use std::io::Write;
    const TEST: &str = "a_bridge_acknowledges_its_remote_only_once_jetstream_has_the_message";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    let port = nats.port;
    // A raw remote (MQTT 3.1.1): QoS 1 PUBLISH d/x (identifier 7) to node A's bridge.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let remote_port = listener.local_addr().expect("address").port();
    let (to_test, events) = std::sync::mpsc::channel::<String>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let remote = std::thread::spawn(move || {
        const PUBLISH: [u8; 10] = [0x32, 8, 0, 3, b'd', b'/', b'x', 0, 7, b'm'];
        // The bridge's first packet but its SUBSCRIBE and PINGREQ (type and flags, packet
        // identifier), or "closed".
        let answer = |s: &mut std::net::TcpStream| loop {
            match crate::bridge::read_packet(s) {
                Ok((0x82 | 0xC0, _)) => {}
                Ok((first, body)) => return format!("{first:#04x} {:?}", body.get(..2)),
                Err(_) => return "closed".to_string(),
            }
        };
        let (mut s, _) = listener.accept().expect("the first connection");
        crate::bridge::read_packet(&mut s).expect("CONNECT");
        s.write_all(&[0x20, 2, 0, 0]).expect("CONNACK");
        go_rx.recv().expect("the test");
        s.write_all(&PUBLISH).expect("PUBLISH");
        to_test.send(answer(&mut s)).expect("the test");
        // The bridge connects again: the message again, DUP set.
        let (mut s, _) = listener.accept().expect("the second connection");
        crate::bridge::read_packet(&mut s).expect("CONNECT");
        s.write_all(&[0x20, 2, 1, 0])
            .expect("CONNACK, session present");
        go_rx.recv().expect("the test");
        let mut dup = PUBLISH;
        dup[0] |= 0x08;
        s.write_all(&dup).expect("PUBLISH again");
        to_test.send(answer(&mut s)).expect("the test");
    });
    let keys = "heartbeat_interval = 1\njetstream_ack_timeout = 2\n";
    let bridge = format!(
        "[[bridges]]\nname = \"in\"\naddresses = [\"127.0.0.1:{remote_port}\"]\n\
         keepalive = 60\nnotifications = false\n\
         [[bridges.topics]]\npattern = \"d/#\"\ndirection = \"in\"\nqos = 1\n\n"
    );
    let mut a = ClusterNode::start("a", &[nats.url()], &bridge, keys);
    let mut b = ClusterNode::start("b", &[nats.url()], "", keys);
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("d/#", QoS::AtLeastOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    drop(nats);
    for d in [&mut a.daemon, &mut b.daemon] {
        d.wait_logged("the disconnection", |l| {
            l.contains("cluster: disconnected from NATS")
        });
    }
    // JetStream away: no PUBACK to the remote [MQTT-4.3.2-2] (it would acknowledge what B
    // may never get); after jetstream_ack_timeout the bridge's connection is closed instead.
    go.send(()).expect("the remote");
    assert_eq!(events.recv().expect("the remote"), "closed");
    // JetStream back: the copy sent again is acknowledged once JetStream holds it, and B's
    // subscriber gets the message.
    // The nodes back on NATS first: their client retries with a growing delay (up to
    // seconds), longer than jetstream_ack_timeout, so the copy sent before that could time out
    // again.
    let _nats = NatsServer::start_on(TEST, port).expect("nats-server");
    for d in [&mut a.daemon, &mut b.daemon] {
        d.wait_logged("the reconnection", |l| {
            l.contains("cluster: reconnected to NATS")
        });
    }
    go.send(()).expect("the remote");
    assert_eq!(events.recv().expect("the remote"), "0x40 Some([0, 7])");
    let p = sub.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("d/x", &b"m"[..]));
    remote.join().expect("the remote");
}

#[test]
fn a_node_finding_the_stream_with_other_settings_keeps_them_and_warns() {
    const TEST: &str = "a_node_finding_the_stream_with_other_settings_keeps_them_and_warns";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    // The stream's max_age (nanoseconds) as the NATS server holds it.
    let max_age = || -> Option<u64> {
        let jsz = nats.monitor("/jsz?streams=true&config=true");
        jsz["account_details"]
            .as_array()?
            .iter()
            .filter_map(|a| a["stream_detail"].as_array())
            .flatten()
            .find(|s| s["name"] == "mercurio_qos")?["config"]["max_age"]
            .as_u64()
    };
    let a = ClusterNode::start("a", &[nats.url()], "", "jetstream_max_age = 3600\n");
    wait_until("the stream made by A", || {
        max_age() == Some(3600 * 1_000_000_000)
    });
    let (metrics, metrics_addr) = metrics_listener();
    let mut b = ClusterNode::start("b", &[nats.url()], &metrics, "jetstream_max_age = 60\n");
    // B keeps the stream as A made it, and says what differs.
    b.daemon.wait_logged("the warning", |l| {
        l.contains("the JetStream stream exists with other settings")
            && l.contains("jetstream_max_age (this node 60, the stream 3600)")
    });
    assert_eq!(max_age(), Some(3600 * 1_000_000_000));
    assert_eq!(
        metric(
            metrics_addr,
            "mercurio_cluster_jetstream_settings_differ_total"
        ),
        1
    );
    drop(a);
}

#[test]
fn a_message_over_the_nats_max_payload_is_refused_for_other_nodes_and_its_publisher_told() {
    const TEST: &str =
        "a_message_over_the_nats_max_payload_is_refused_for_other_nodes_and_its_publisher_told";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    let (metrics, metrics_addr) = metrics_listener();
    let mut a = ClusterNode::start("a", &[nats.url()], &metrics, "");
    let b = ClusterNode::start("b", &[nats.url()], "", "");
    let mut sub = client(&b.daemon, "sub", true);
    sub.subscribe("big/#", QoS::AtLeastOnce);
    let mut local = client(&a.daemon, "local", false);
    local.subscribe("big/#", QoS::AtLeastOnce);
    wait_until("B's interest known to A", || {
        interest_of(&a.daemon, "b") == Some(1)
    });
    // Its PUBLISH packet just fits the brokers' max_packet_size (1 MiB by default); with
    // the envelope it does not fit NATS's max_payload (1 MiB by default).
    let big = vec![b'x'; 1_048_560];
    let mut publisher = client(&a.daemon, "pub", false);
    // QoS 1: PUBACK 0x83 (Implementation specific error), as for message_size_limit; A's
    // own subscriber has it.
    let id = publisher.publish_packet("big/1", &big, QoS::AtLeastOnce, false);
    expect_acknowledgement(
        &mut publisher,
        id,
        QoS::AtLeastOnce,
        ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR,
    );
    let p = local.expect_publish();
    assert_eq!((p.topic.as_str(), p.payload.len()), ("big/1", big.len()));
    local.ack(&p);
    // QoS 2: PUBREC 0x83, which ends the exchange [MQTT-4.3.3-4]: no PUBREL needed, and the
    // packet identifier may carry a new message at once.
    let id = publisher.publish_packet("big/2", &big, QoS::ExactlyOnce, false);
    expect_acknowledgement(
        &mut publisher,
        id,
        QoS::ExactlyOnce,
        ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR,
    );
    // Counted and logged.
    assert_eq!(metric(metrics_addr, "mercurio_cluster_errors_total"), 2);
    a.daemon
        .wait_logged("the refusal", |l| l.contains("max_payload"));
    // B never gets them: the next message, small, is the first B's subscriber receives.
    publisher.publish("big/3", b"small", QoS::AtLeastOnce, false);
    let p = sub.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("big/3", &b"small"[..]));
}

/// A message a [`Publisher`] sent: its topic and number.
type Sent = (String, u32);

/// The messages `acked` (numbers, as [`Publisher::finish`] returns them) on `topic`.
fn on(topic: &str, acked: &[u32]) -> Vec<Sent> {
    acked.iter().map(|n| (topic.to_string(), *n)).collect()
}

/// The members of a shared subscription group, each read on a thread of its own (each QoS 1
/// message acknowledged) until [`Members::finish`] shuts their sockets.
struct Members {
    /// Each message received, with the members that got it, in order.
    got: Arc<Mutex<BTreeMap<Sent, Vec<&'static str>>>>,
    sockets: Vec<std::net::TcpStream>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Members {
    fn new() -> Members {
        Members {
            got: Arc::default(),
            sockets: Vec::new(),
            readers: Vec::new(),
        }
    }

    /// Reads `m`, the member `name`, from now on, until its connection closes.
    fn read(&mut self, name: &'static str, mut m: Client) {
        self.sockets
            .push(m.stream.try_clone().expect("clone the socket"));
        let got = Arc::clone(&self.got);
        self.readers.push(std::thread::spawn(move || {
            while let Some(p) = m.recv() {
                if let Packet::Publish(p) = p {
                    assert_eq!(p.qos, QoS::AtLeastOnce);
                    got.lock()
                        .expect("got")
                        .entry((p.topic.clone(), number(&p)))
                        .or_default()
                        .push(name);
                    // The member's node may be killed under it: the connection is gone then.
                    let ack = Packet::PubAck(PubAck {
                        packet_id: p.packet_id,
                        ..PubAck::default()
                    });
                    if !m.try_send(ack) {
                        break;
                    }
                }
            }
        }));
    }

    /// How many of `sent` some member received.
    fn received(&self, sent: &[Sent]) -> usize {
        let got = self.got.lock().expect("got");
        sent.iter().filter(|s| got.contains_key(*s)).count()
    }

    /// Waits until every message of `sent` was received by some member.
    fn wait_all(&self, sent: &[Sent]) {
        wait_until(
            &format!("{} messages received by the group", sent.len()),
            || self.received(sent) == sent.len(),
        );
    }

    /// Stops reading; the members each message went to.
    fn finish(self) -> BTreeMap<Sent, Vec<&'static str>> {
        for s in &self.sockets {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for r in self.readers {
            r.join().expect("a member's reader");
        }
        std::mem::take(&mut *self.got.lock().expect("got"))
    }
}

/// How many messages of `got` each member received, as the test's report.
fn per_member(got: &BTreeMap<Sent, Vec<&'static str>>) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    for m in got.values().flatten() {
        *counts.entry(*m).or_insert(0) += 1;
    }
    counts
}

/// Whether `d` knows that node `name` has `n` filters and groups.
fn knows(d: &Daemon, name: &str, n: u64) -> bool {
    interest_of(d, name) == Some(n)
}

#[test]
fn a_group_with_members_on_two_nodes_gets_every_acknowledged_qos_1_message_once() {
    const TEST: &str =
        "a_group_with_members_on_two_nodes_gets_every_acknowledged_qos_1_message_once";
    let Some(nats) = NatsCluster::start(TEST, 3) else {
        return;
    };
    let (a, b) = nodes(&nats);
    let c = ClusterNode::start("c", &nats.urls()[2..3], "", CLUSTER_KEYS);
    // Members of group g on A and B; the publishers on A (a member's node) and C (none).
    let mut members = Members::new();
    for (d, name) in [(&a.daemon, "member-a"), (&b.daemon, "member-b")] {
        let mut m = client(d, name, true);
        m.subscribe("$share/g/grp/#", QoS::AtLeastOnce);
        members.read(name, m);
    }
    wait_until("the group known on every node", || {
        knows(&a.daemon, "b", 1) && knows(&c.daemon, "a", 1) && knows(&c.daemon, "b", 1)
    });
    let from_c = Publisher::start(&c.daemon, "pub-c", "grp/c");
    let from_a = Publisher::start(&a.daemon, "pub-a", "grp/a");
    from_c.wait_acked(300);
    from_a.wait_acked(300);
    let mut sent = on("grp/c", &from_c.finish());
    sent.extend(on("grp/a", &from_a.finish()));
    members.wait_all(&sent);
    // Through JetStream, one copy a message, for the group as a whole.
    let stream = || {
        nats.servers[0]
            .stream_state("mercurio_qos")
            .expect("the stream")
    };
    wait_until("the stream emptied by the nodes' acknowledgements", || {
        stream()["messages"] == 0
    });
    assert_eq!(stream()["last_seq"], sent.len() as u64);
    let got = members.finish();
    eprintln!(
        "{TEST}: {} messages, by member {:?}",
        sent.len(),
        per_member(&got)
    );
    // Each acknowledged message reached one member once [MQTT-4.8.2-2]: nothing failed, so
    // nothing came twice; and nothing came that was not sent.
    for s in &sent {
        assert_eq!(got[s].len(), 1, "{s:?} went to {:?}", got[s]);
    }
    assert_eq!(got.len(), sent.len());

    // A group whose members are all on the publisher's node gets its messages there,
    // without JetStream, as on a single broker.
    let mut solo = client(&c.daemon, "solo", false);
    solo.subscribe("$share/solo/only/#", QoS::AtLeastOnce);
    let mut publisher = client(&c.daemon, "pub-solo", false);
    for n in 0..20u32 {
        publisher.publish("only/c", n.to_string().as_bytes(), QoS::AtLeastOnce, false);
    }
    for n in 0..20u32 {
        let p = solo.expect_publish();
        solo.ack(&p);
        assert_eq!((p.topic.as_str(), number(&p)), ("only/c", n));
    }
    assert_eq!(stream()["last_seq"], sent.len() as u64);
}

#[test]
fn killing_the_node_of_a_receiving_member_loses_no_acknowledged_group_message() {
    const TEST: &str = "killing_the_node_of_a_receiving_member_loses_no_acknowledged_group_message";
    let Some(nats) = NatsCluster::start(TEST, 3) else {
        return;
    };
    let (a, b) = nodes(&nats);
    let c = ClusterNode::start("c", &nats.urls()[2..3], "", CLUSTER_KEYS);
    // Persistent members of group g on A and B; the publisher on C.
    let mut members = Members::new();
    for (d, name) in [(&a.daemon, "member-a"), (&b.daemon, "member-b")] {
        let mut m = client(d, name, true);
        m.subscribe("$share/g/grp/#", QoS::AtLeastOnce);
        members.read(name, m);
    }
    wait_until("the group known on C", || {
        knows(&c.daemon, "a", 1) && knows(&c.daemon, "b", 1)
    });
    let publisher = Publisher::start(&c.daemon, "pub", "grp/c");
    publisher.wait_acked(200);
    // The node of the member receiving the latest message is killed.
    let latest = on("grp/c", &[publisher.acked() as u32 - 1]).remove(0);
    wait_until("the latest message received", || {
        members.received(std::slice::from_ref(&latest)) == 1
    });
    let receiving = members.got.lock().expect("got")[&latest][0];
    let (mut victim, survivor) = if receiving == "member-a" {
        (a, "member-b")
    } else {
        (b, "member-a")
    };
    victim.kill();
    let killed_at = publisher.acked();
    // The publisher goes on; the surviving member takes what the killed node had taken from
    // JetStream and not acknowledged (after its ack wait), and everything from now on.
    publisher.wait_acked(killed_at + 300);
    let acked = publisher.finish();
    // (Past the one in flight at the kill, which the killed node may have had.)
    let after: Vec<Sent> = on("grp/c", &acked[killed_at + 5..]);
    members.wait_all(&after);
    // What the killed node had committed to its member's session stays in that session, as
    // on a single broker: the node back, its member gets it.
    victim.restart();
    members.read("restarted", client(&victim.daemon, receiving, true));
    let sent = on("grp/c", &acked);
    members.wait_all(&sent);
    let got = members.finish();
    let duplicates: usize = got.values().map(|m| m.len() - 1).sum();
    eprintln!(
        "{TEST}: {} acknowledged ({killed_at} before {receiving}'s node was killed), by member {:?} (restarted: the killed node's member after its restart), {duplicates} duplicates",
        acked.len(),
        per_member(&got)
    );
    // Every acknowledged message reached a member; those after the kill, the survivor.
    for s in &sent {
        assert!(got.contains_key(s), "{s:?} lost");
    }
    for s in &after {
        assert!(got[s].contains(&survivor), "{s:?} went to {:?}", got[s]);
    }
}

#[test]
fn a_publishers_puback_waits_for_jetstream_when_a_groups_members_are_on_other_nodes() {
    const TEST: &str =
        "a_publishers_puback_waits_for_jetstream_when_a_groups_members_are_on_other_nodes";
    let Some(nats) = NatsServer::start(TEST) else {
        return;
    };
    let port = nats.port;
    let keys = "heartbeat_interval = 1
jetstream_ack_timeout = 120
";
    let mut a = ClusterNode::start("a", &[nats.url()], "", keys);
    let mut b = ClusterNode::start("b", &[nats.url()], "", keys);
    let mut member = client(&b.daemon, "member", true);
    member.subscribe("$share/g/q/#", QoS::AtLeastOnce);
    wait_until("B's group known to A", || knows(&a.daemon, "b", 1));
    drop(nats);
    for d in [&mut a.daemon, &mut b.daemon] {
        d.wait_logged("the disconnection", |l| {
            l.contains("cluster: disconnected from NATS")
        });
    }
    // NATS away: a QoS 1 message for the group, whose only member is on B, is not
    // acknowledged (a later message's PUBACK, which follows every acknowledgement ready
    // before it, comes first) [MQTT-4.3.2-1].
    let mut publisher = client(&a.daemon, "pub", false);
    let id = publisher.publish_packet("q/1", b"1", QoS::AtLeastOnce, false);
    assert_eq!(
        next_acknowledgement(&mut publisher),
        None,
        "no PUBACK before JetStream has the message"
    );
    // NATS back (its JetStream empty): the message goes in, then its PUBACK, and the member
    // gets it.
    let nats = NatsServer::start_on(TEST, port).expect("nats-server");
    expect_acknowledgement(&mut publisher, id, QoS::AtLeastOnce, ReasonCode::SUCCESS);
    let p = member.expect_publish();
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("q/1", &b"1"[..]));
    member.ack(&p);
    let state = nats.stream_state("mercurio_qos").expect("the stream");
    assert_eq!(state["last_seq"], 1);
}
