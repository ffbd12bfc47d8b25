//! Connections moved between threads (`Shards` with `Placement::Fill`): a connection asked to
//! move parks and is served again on another thread, in the middle of its traffic. Nothing it
//! was sent or sent may be lost, duplicated where the QoS forbids it, reordered, or taken for
//! a lost connection (its will).
//!
//! The broker runs on threads of its own (shard 0 a thread started here, shard 1 the one
//! `Shards` starts), so the clients' work does not count as a shard's. Its thresholds
//! (`Thresholds`, the setting an embedding application has) make every shard with any work
//! count as busy and every other as having room: connections move as often as
//! `move_every` allows, whatever else the machine runs.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mercurio::codec::{Packet, ProtocolVersion, PubAck, QoS, ReasonCode};
use mercurio::{Broker, BrokerHandle, Placement, Shards, Thresholds};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::common::{self, connect_packet, publish_packet, Client, DEADLINE};

/// How long a test waits for the moves it needs.
const MOVES_DEADLINE: Duration = Duration::from_secs(15);

/// A broker on 2 threads whose connections move every 100 ms or so.
struct Moving {
    handle: BrokerHandle,
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Moving {
    async fn start() -> Moving {
        let (started, ready) = oneshot::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let thresholds = Thresholds {
                    fill: 0,
                    high: 0,
                    low: 1001,
                    move_every: Duration::from_millis(100),
                };
                let shards = Shards::start_with(2, Placement::Fill, thresholds).expect("shards");
                let handle = Broker::builder(common::test_config())
                    .shards(Arc::clone(&shards))
                    .start()
                    .await
                    .expect("broker starts");
                let _ = started.send(handle.clone());
                let _ = stopped.await;
                handle.shutdown().await;
                shards.stop();
            });
        });
        let handle = ready.await.expect("broker thread started the broker");
        let addr = handle.local_addrs()[0];
        Moving {
            handle,
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn moves(&self) -> u64 {
        self.handle.stats().clients_moved
    }

    /// The thread serving `client_id` (or that served it last).
    fn thread_of(&self, client_id: &str) -> Option<usize> {
        self.handle.session_detail(client_id).and_then(|d| d.thread)
    }

    fn stop(mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            thread.join().expect("broker thread");
        }
    }
}

/// What a subscriber received from one publisher: (number, QoS, dup) in arrival order.
type Received = std::collections::HashMap<String, Vec<(u64, QoS, bool)>>;

/// Receives until every publisher in `publishers` sent its "end", acknowledging as the
/// protocol wants (several QoS 2 deliveries may be in flight at once).
async fn collect(mut sub: Client, publishers: Vec<String>) -> Received {
    let mut got = Received::new();
    let mut ended = HashSet::new();
    while ended.len() < publishers.len() {
        match sub.recv().await {
            Some(Packet::Publish(p)) => {
                let from = p.topic.trim_start_matches("mv/").to_string();
                let text = String::from_utf8_lossy(&p.payload).to_string();
                if text == "end" {
                    ended.insert(from);
                } else {
                    let n: u64 = text.parse().expect("a numbered message");
                    got.entry(from).or_default().push((n, p.qos, p.dup));
                }
                match p.qos {
                    QoS::AtMostOnce => {}
                    QoS::AtLeastOnce => sub.send(Packet::PubAck(ack(p.packet_id))).await,
                    QoS::ExactlyOnce => sub.send(Packet::PubRec(ack(p.packet_id))).await,
                }
            }
            Some(Packet::PubRel(r)) => sub.send(Packet::PubComp(ack(r.packet_id))).await,
            other => panic!("subscriber: unexpected {other:?}"),
        }
    }
    sub.disconnect().await;
    got
}

fn ack(packet_id: u16) -> PubAck {
    PubAck {
        packet_id,
        ..PubAck::default()
    }
}

/// Publishes numbered messages on `mv/ID` (each acknowledged before the next) until `stop`,
/// then "end"; returns how many numbered messages were published.
async fn publish_numbered(
    mut publisher: Client,
    id: String,
    qos: QoS,
    stop: Arc<AtomicBool>,
) -> u64 {
    let topic = format!("mv/{id}");
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let rc = publisher
            .publish(&topic, n.to_string().as_bytes(), qos, false)
            .await;
        assert_eq!(rc, ReasonCode::SUCCESS, "{id}: message {n}");
        n += 1;
    }
    let rc = publisher.publish(&topic, b"end", qos, false).await;
    assert_eq!(rc, ReasonCode::SUCCESS, "{id}: end");
    publisher.disconnect().await;
    n
}

/// QoS 1 and QoS 2 publishers and subscribers of both versions, their connections moved
/// between the threads while messages flow: a QoS 2 message arrives exactly once
/// [MQTT-4.3.3-2], a QoS 1 message at least once [MQTT-4.3.2-2], and each publisher's
/// messages in the order it sent them [MQTT-4.6.0-5].
#[tokio::test]
async fn moved_connections_lose_duplicate_and_reorder_nothing() {
    let broker = Moving::start().await;
    let addr = broker.addr;
    let publishers = [
        ("p5q1", ProtocolVersion::V5, QoS::AtLeastOnce),
        ("p3q1", ProtocolVersion::V311, QoS::AtLeastOnce),
        ("p5q2", ProtocolVersion::V5, QoS::ExactlyOnce),
        ("p3q2", ProtocolVersion::V311, QoS::ExactlyOnce),
    ];
    let names: Vec<String> = publishers.iter().map(|p| p.0.to_string()).collect();
    let mut subscribers = Vec::new();
    for (id, version) in [("s5", ProtocolVersion::V5), ("s3", ProtocolVersion::V311)] {
        let mut sub = Client::connect(addr, version, id).await;
        assert_eq!(
            sub.subscribe("mv/#", QoS::ExactlyOnce).await,
            ReasonCode::GRANTED_QOS_2
        );
        subscribers.push((id, tokio::spawn(collect(sub, names.clone()))));
    }
    let before = broker.moves();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (id, version, qos) in publishers {
        let publisher = Client::connect(addr, version, id).await;
        tasks.push((
            id,
            qos,
            tokio::spawn(publish_numbered(
                publisher,
                id.to_string(),
                qos,
                Arc::clone(&stop),
            )),
        ));
    }

    // Until every client was seen on both threads and connections moved 20 times.
    let clients: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .chain(["s5", "s3"])
        .collect();
    let mut seen: HashSet<(&str, usize)> = HashSet::new();
    let deadline = Instant::now() + MOVES_DEADLINE;
    loop {
        for &c in &clients {
            if let Some(t) = broker.thread_of(c) {
                seen.insert((c, t));
            }
        }
        let moved = broker.moves() - before;
        if moved >= 20 && seen.len() == 2 * clients.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {moved} moves; clients seen on threads: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut sent = std::collections::HashMap::new();
    for (id, qos, task) in tasks {
        let n = tokio::time::timeout(DEADLINE, task)
            .await
            .expect("publisher ends")
            .expect("publisher task");
        assert!(n > 0, "{id} published nothing");
        sent.insert(id, (qos, n));
    }
    let moved = broker.moves() - before;
    eprintln!("moves while publishing: {moved}; published: {sent:?}");

    for (sub, task) in subscribers {
        let got = tokio::time::timeout(DEADLINE, task)
            .await
            .expect("subscriber ends")
            .expect("subscriber task");
        for (id, (qos, n)) in &sent {
            let received = got.get(*id).map(Vec::as_slice).unwrap_or_default();
            let numbers: Vec<u64> = received.iter().map(|r| r.0).collect();
            assert!(
                received.iter().all(|r| r.1 == *qos),
                "{sub} from {id}: delivered at another QoS than {qos:?}"
            );
            if *qos == QoS::ExactlyOnce {
                assert_eq!(
                    numbers,
                    (0..*n).collect::<Vec<_>>(),
                    "{sub} from {id}: each QoS 2 message once, in order"
                );
            } else {
                // At least once, in order: a number is either the next one or a repeat of
                // one already received.
                let mut next = 0;
                for &k in &numbers {
                    assert!(
                        k <= next,
                        "{sub} from {id}: {k} before {next} (received {numbers:?})"
                    );
                    if k == next {
                        next += 1;
                    }
                }
                assert_eq!(next, *n, "{sub} from {id}: QoS 1 messages lost");
            }
        }
    }
    broker.stop();
}

/// A connection with a will and QoS 2 in flight both ways (a delivery to it released but not
/// completed, a message from it received but not released) moves to the other thread: the
/// flows complete there, nothing is published twice, and the move does not publish the will
/// (only the loss of the connection does [MQTT-3.1.2-8]; it is not lost).
#[tokio::test]
async fn a_connection_moved_with_qos2_in_flight_and_a_will() {
    let broker = Moving::start().await;
    let addr = broker.addr;
    let mut observer = Client::connect(addr, ProtocolVersion::V5, "mw-obs").await;
    observer.subscribe("mvw/#", QoS::ExactlyOnce).await;
    let mut feeder = Client::connect(addr, ProtocolVersion::V311, "mw-feed").await;
    let mut connect = connect_packet(ProtocolVersion::V5, "mw-w");
    connect.will = Some(common::will("mvw/will", "gone", QoS::AtLeastOnce, false));
    let (mut w, ack_) = Client::connect_with(addr, connect).await;
    assert_eq!(ack_.reason_code, ReasonCode::SUCCESS);
    w.subscribe("mvw/in", QoS::ExactlyOnce).await;

    // To it: PUBLISH, PUBREC, PUBREL; its PUBCOMP held back.
    feeder
        .publish("mvw/in", b"in-1", QoS::ExactlyOnce, false)
        .await;
    let in1 = w.expect_publish().await;
    assert_eq!(
        (&in1.payload[..], in1.qos),
        (&b"in-1"[..], QoS::ExactlyOnce)
    );
    w.send(Packet::PubRec(ack(in1.packet_id))).await;
    match w.recv().await {
        Some(Packet::PubRel(r)) if r.packet_id == in1.packet_id => {}
        other => panic!("expected PUBREL, got {other:?}"),
    }
    // From it: PUBLISH, PUBREC; its PUBREL held back.
    let out_id = w.next_packet_id();
    w.send(publish_packet(
        "mvw/out",
        b"out-1",
        QoS::ExactlyOnce,
        false,
        out_id,
        Default::default(),
    ))
    .await;
    match w.recv().await {
        Some(Packet::PubRec(r)) if r.packet_id == out_id => {}
        other => panic!("expected PUBREC, got {other:?}"),
    }

    // Keeps it busy (a PINGREQ at a time) until it is served on the other thread.
    let first = broker.thread_of("mw-w").expect("served on a thread");
    let deadline = Instant::now() + MOVES_DEADLINE;
    while broker.thread_of("mw-w") == Some(first) {
        assert!(
            Instant::now() < deadline,
            "mw-w never moved off thread {first}"
        );
        w.ping().await;
    }
    let detail = broker.handle.session_detail("mw-w").expect("session");
    assert!(detail.will, "the will is still pending after the move");

    // The flows complete on the new thread.
    w.send(Packet::PubComp(ack(in1.packet_id))).await;
    w.send(Packet::PubRel(ack(out_id))).await;
    match w.recv().await {
        Some(Packet::PubComp(c)) if c.packet_id == out_id => {}
        other => panic!("expected PUBCOMP {out_id}, got {other:?}"),
    }
    feeder
        .publish("mvw/in", b"in-2", QoS::ExactlyOnce, false)
        .await;
    // The next delivery is the new message, not in-1 again.
    let in2 = w.expect_publish().await;
    assert_eq!((&in2.payload[..], in2.dup), (&b"in-2"[..], false));
    w.ack(&in2).await;
    feeder
        .publish("mvw/marker", b"marker", QoS::ExactlyOnce, false)
        .await;

    // The observer saw each message once, and no will, up to the marker.
    let mut seen: Vec<String> = Vec::new();
    loop {
        match observer.recv().await {
            Some(Packet::Publish(p)) => {
                if p.qos == QoS::ExactlyOnce {
                    observer.send(Packet::PubRec(ack(p.packet_id))).await;
                }
                if p.topic == "mvw/marker" {
                    break;
                }
                seen.push(String::from_utf8_lossy(&p.payload).to_string());
            }
            Some(Packet::PubRel(r)) => observer.send(Packet::PubComp(ack(r.packet_id))).await,
            other => panic!("observer: unexpected {other:?}"),
        }
    }
    seen.sort();
    assert_eq!(seen, ["in-1", "in-2", "out-1"], "each once, no will");
    w.disconnect().await;
    feeder.disconnect().await;
    observer.disconnect().await;
    broker.stop();
}
