//! Flow control (ARCHITECTURE.md, "Flow control"), through real sockets: under overload the
//! broker slows its publishers down instead of dropping what it acknowledged; a stalled
//! client holds nobody back; a client that does not read its socket is bounded and closed;
//! the inbound Receive Maximum holds for QoS 1 as for QoS 2.
//!
//! No timing is asserted: every wait has a deadline, and the outcomes are counts.
use crate::common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use common::*;
use mercurio::codec::{self, Packet, Properties, ProtocolVersion, PubAck, QoS, ReasonCode};
use mercurio::config::Config;
use mercurio::stats::DropCause;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

const V311: ProtocolVersion = ProtocolVersion::V311;
const V5: ProtocolVersion = ProtocolVersion::V5;

/// How long a whole overload run may take (a debug build on a loaded machine).
const RUN_DEADLINE: Duration = Duration::from_secs(120);

fn config(f: impl FnOnce(&mut mercurio::config::ServerConfig)) -> Config {
    let mut c = test_config();
    f(&mut c.server);
    c
}

/// Small queues, so that a broker which accepted faster than it delivers would drop.
fn small_queues(s: &mut mercurio::config::ServerConfig) {
    s.max_queued_messages = 100;
    s.max_queued_qos0_messages = 50;
    s.stall_time = 1;
}

/// Publishes `count` messages at `qos` to `topic` as fast as the broker takes them, keeping
/// up to `window` unacknowledged (encoded in batches, one write each). Every payload is
/// `"<publisher>/<n>"`. Returns the payloads the broker acknowledged (PUBACK, or PUBCOMP).
async fn flood(
    addr: SocketAddr,
    client_id: String,
    topic: &'static str,
    qos: QoS,
    count: usize,
    window: usize,
) -> Vec<String> {
    flood_sized(addr, client_id, topic, qos, count, window, 0).await
}

/// [`flood`] with payloads padded with '.' to `size` bytes.
async fn flood_sized(
    addr: SocketAddr,
    client_id: String,
    topic: &'static str,
    qos: QoS,
    count: usize,
    window: usize,
    size: usize,
) -> Vec<String> {
    let mut c = Client::connect(addr, V311, &client_id).await;
    let mut inflight: std::collections::HashMap<u16, String> = Default::default();
    let mut acked = Vec::with_capacity(count);
    let mut sent = 0;
    let mut next_id: u16 = 1;
    while acked.len() < count {
        if sent < count && inflight.len() < window {
            let mut out = BytesMut::new();
            while sent < count && inflight.len() < window {
                let id = next_id;
                next_id = next_id.wrapping_add(1).max(1);
                let mut payload = format!("{client_id}/{sent}");
                let pad = size.saturating_sub(payload.len());
                payload.extend(std::iter::repeat_n('.', pad));
                let p = publish_packet(
                    topic,
                    payload.as_bytes(),
                    qos,
                    false,
                    id,
                    Properties::default(),
                );
                codec::encode(&p, V311, &mut out).expect("encode");
                inflight.insert(id, payload);
                sent += 1;
            }
            c.send_raw(&out).await;
        }
        match c.recv().await {
            Some(Packet::PubAck(a)) | Some(Packet::PubComp(a)) => {
                let payload = inflight
                    .remove(&a.packet_id)
                    .expect("ack for a message in flight");
                acked.push(payload);
            }
            Some(Packet::PubRec(a)) => {
                c.send(Packet::PubRel(PubAck {
                    packet_id: a.packet_id,
                    ..PubAck::default()
                }))
                .await
            }
            other => panic!("{client_id}: expected an acknowledgement, got {other:?}"),
        }
    }
    c.disconnect().await;
    acked
}

/// A subscriber that answers every QoS 1/2 PUBLISH at once; the distinct payloads received
/// so far are watched through the returned receiver.
fn fast_subscriber(
    mut c: Client,
) -> (
    watch::Receiver<HashSet<String>>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = watch::channel(HashSet::new());
    let task = tokio::spawn(async move {
        while let Ok(Some(p)) = c.recv_within(RUN_DEADLINE).await {
            match p {
                Packet::Publish(p) => {
                    let ack = PubAck {
                        packet_id: p.packet_id,
                        ..PubAck::default()
                    };
                    match p.qos {
                        QoS::AtMostOnce => {}
                        QoS::AtLeastOnce => c.send(Packet::PubAck(ack)).await,
                        QoS::ExactlyOnce => c.send(Packet::PubRec(ack)).await,
                    }
                    let payload = String::from_utf8_lossy(&p.payload).into_owned();
                    tx.send_modify(|got| {
                        got.insert(payload);
                    });
                }
                Packet::PubRel(r) => {
                    c.send(Packet::PubComp(PubAck {
                        packet_id: r.packet_id,
                        ..PubAck::default()
                    }))
                    .await
                }
                _ => {}
            }
        }
    });
    (rx, task)
}

/// Runs `publishers` floods of `count` messages each into `topic` and returns every payload
/// the broker acknowledged.
async fn run_publishers(
    addr: SocketAddr,
    publishers: usize,
    topic: &'static str,
    qos: QoS,
    count: usize,
) -> Vec<String> {
    let tasks: Vec<_> = (0..publishers)
        .map(|i| tokio::spawn(flood(addr, format!("pub{i}"), topic, qos, count, 64)))
        .collect();
    let mut acked = Vec::new();
    for t in tasks {
        let got = tokio::time::timeout(RUN_DEADLINE, t)
            .await
            .expect("publishers done before the deadline")
            .expect("publisher task");
        acked.extend(got);
    }
    acked
}

/// Waits until the subscriber has every payload of `expected`; panics with the missing
/// count at the deadline.
async fn delivered_all(rx: &mut watch::Receiver<HashSet<String>>, expected: &[String]) {
    let done = tokio::time::timeout(
        RUN_DEADLINE,
        rx.wait_for(|got| expected.iter().all(|p| got.contains(p))),
    )
    .await
    .map(|r| r.is_ok());
    if done != Ok(true) {
        let got = rx.borrow();
        let missing = expected.iter().filter(|p| !got.contains(*p)).count();
        panic!(
            "{missing} of {} acknowledged messages never delivered",
            expected.len()
        );
    }
}

/// Four publishers flood one subscriber whose queue holds 100 messages. Every message the
/// broker acknowledged reaches the subscriber: overload slows the publishers down, it never
/// drops what was acknowledged.
async fn no_loss_of_acknowledged_messages(qos: QoS) {
    let (broker, addr) = start_with(config(small_queues)).await;
    let mut sub = Client::connect(addr, V311, "sink").await;
    sub.subscribe("load/#", qos).await;
    let (mut got, task) = fast_subscriber(sub);
    let acked = run_publishers(addr, 4, "load/in", qos, 3000).await;
    assert_eq!(acked.len(), 4 * 3000);
    delivered_all(&mut got, &acked).await;
    assert_eq!(broker.stats().dropped_total(), 0, "nothing dropped");
    task.abort();
    broker.shutdown().await;
}

#[tokio::test]
async fn overload_never_drops_acknowledged_qos1_messages() {
    no_loss_of_acknowledged_messages(QoS::AtLeastOnce).await;
}

#[tokio::test]
async fn overload_never_drops_acknowledged_qos2_messages() {
    no_loss_of_acknowledged_messages(QoS::ExactlyOnce).await;
}

/// A QoS 1 subscriber that never reads nor acknowledges sits beside a fast one on the same
/// topic. The stalled one is found stalled and holds nobody back: its queue stops at its
/// limit (drops counted), and the fast one gets every message.
#[tokio::test]
async fn stalled_subscriber_costs_a_fast_one_no_message() {
    let (broker, addr) = start_with(config(small_queues)).await;
    let mut stalled = Client::open_small_buffer(addr, V311).await;
    stalled
        .send(Packet::Connect(Box::new(connect_packet(V311, "stalled"))))
        .await;
    assert!(matches!(stalled.recv().await, Some(Packet::ConnAck(_))));
    stalled.subscribe("load/#", QoS::AtLeastOnce).await;
    let mut fast = Client::connect(addr, V311, "fast").await;
    fast.subscribe("load/#", QoS::AtLeastOnce).await;
    let (mut got, task) = fast_subscriber(fast);

    let acked = run_publishers(addr, 2, "load/in", QoS::AtLeastOnce, 2000).await;
    delivered_all(&mut got, &acked).await;
    let stats = broker.stats();
    assert!(
        stats.dropped_count(DropCause::QueueFull) > 0,
        "the stalled queue dropped at its limit"
    );
    let s = broker
        .sessions()
        .into_iter()
        .find(|s| s.client_id == "stalled")
        .expect("stalled session");
    assert!(s.queued <= 100, "queue within its limit: {}", s.queued);
    task.abort();
    drop(stalled);
    broker.shutdown().await;
}

/// Writes `chunk` over and over on another task without ever reading, until a write fails
/// (the broker closed the connection) or `cap` bytes went out. Returns the bytes written
/// and whether a write failed.
fn write_without_reading(
    mut stream: tokio::net::tcp::OwnedWriteHalf,
    chunk: Vec<u8>,
    cap: usize,
) -> tokio::task::JoinHandle<(usize, bool)> {
    tokio::spawn(async move {
        let mut written = 0;
        while written < cap {
            if stream.write_all(&chunk).await.is_err() {
                return (written, true);
            }
            written += chunk.len();
        }
        (written, false)
    })
}

/// A client floods PINGREQ and never reads its socket. The broker stops reading it once the
/// answers it owes pile up (the PINGRESPs it cannot write), closes it after `stall_time`,
/// and serves the other clients meanwhile.
#[tokio::test]
async fn pingreq_flood_without_reading_is_bounded_and_closed() {
    let (broker, addr) = start_with(config(|s| s.stall_time = 1)).await;
    let mut flooder = Client::open_small_buffer(addr, V311).await;
    flooder
        .send(Packet::Connect(Box::new(connect_packet(V311, "flooder"))))
        .await;
    assert!(matches!(flooder.recv().await, Some(Packet::ConnAck(_))));
    let (_rd, wr) = flooder.into_stream().into_split();
    let cap = 64 << 20;
    let pings = [0xC0u8, 0x00].repeat(32 * 1024);
    let flood = write_without_reading(wr, pings, cap);

    // Others are served while the flood goes on.
    let mut other = Client::connect(addr, V5, "bystander").await;
    other.subscribe("b", QoS::AtLeastOnce).await;
    other.ping().await;
    let rc = other.publish("b", b"hello", QoS::AtLeastOnce, false).await;
    assert_eq!(rc, ReasonCode::SUCCESS);
    assert_eq!(&other.expect_publish().await.payload[..], b"hello");

    let (written, closed) = tokio::time::timeout(RUN_DEADLINE, flood)
        .await
        .expect("flood ends before the deadline")
        .expect("flood task");
    assert!(
        closed,
        "the broker kept reading PINGREQs it could not answer: {written} bytes and still open"
    );
    other.ping().await;
    broker.shutdown().await;
}

/// [MQTT-3.3.4-8]-style flow control for QoS 1 (5.0 sections 3.3.4 and 4.9): a client that
/// keeps sending QoS 1 PUBLISH while never reading its PUBACKs passes receive_maximum
/// unanswered messages and is closed with DISCONNECT 0x93.
#[tokio::test]
async fn qos1_receive_maximum_exceeded() {
    let (broker, addr) = start_with(config(|s| s.receive_maximum = 10)).await;
    let logs = capture_logs();
    let mut c = Client::open_small_buffer(addr, V5).await;
    c.send(Packet::Connect(Box::new(connect_packet(V5, "greedy"))))
        .await;
    match c.recv().await {
        Some(Packet::ConnAck(ack)) => {
            assert_eq!(ack.properties.receive_maximum, Some(10))
        }
        other => panic!("expected CONNACK, got {other:?}"),
    }
    // Packet identifiers cycle through 1..=60000: each was acknowledged long before it comes
    // back (the broker answers in order).
    let mut batch = BytesMut::new();
    for i in 0..60_000u32 {
        let p = publish_packet(
            "greedy/t",
            b"x",
            QoS::AtLeastOnce,
            false,
            (i + 1) as u16,
            Properties::default(),
        );
        codec::encode(&p, V5, &mut batch).expect("encode");
    }
    let (mut rd, wr) = c.into_stream().into_split();
    let flood = write_without_reading(wr, batch.to_vec(), 64 << 20);

    // The broker says why it closes (and logs it) once the PUBACKs it cannot write pile up.
    let deadline = tokio::time::Instant::now() + RUN_DEADLINE;
    while logs.matching(&["greedy", "0x93"]).is_empty()
        && logs.matching(&["greedy", "Receive Maximum"]).is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline && !flood.is_finished(),
            "never closed for exceeding receive_maximum: {:?}",
            logs.lines()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Stop writing (the broker lingers until its client falls silent), then read: PUBACKs,
    // then DISCONNECT 0x93, then the close.
    flood.abort();
    let mut buf = BytesMut::new();
    let mut disconnect = None;
    let read_all = async {
        loop {
            while let Some(p) = codec::decode(&mut buf, V5, u32::MAX).expect("decodable") {
                match p {
                    Packet::PubAck(_) => {}
                    Packet::Disconnect(d) => disconnect = Some(d.reason_code),
                    other => panic!("unexpected {other:?}"),
                }
            }
            match rd.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(RUN_DEADLINE, read_all)
        .await
        .expect("connection closed before the deadline");
    assert_eq!(disconnect, Some(ReasonCode::RECEIVE_MAXIMUM_EXCEEDED));
    broker.shutdown().await;
}

/// `max_publish_rate`: a client publishing QoS 1 as fast as it can is paced at the rate
/// after a second's worth (the bucket): 600 messages at 200/s take at least (600 - 200) / 200
/// = 2 s. Every message is acknowledged and delivered, none dropped, the client is never
/// disconnected (`flood` panics on a close), and a second client publishing meanwhile is not
/// held by the first: its 50 messages are all acknowledged while the first is still held.
#[tokio::test]
async fn publish_rate_slows_a_client_never_drops_nor_holds_others() {
    const RATE: u32 = 200;
    const COUNT: usize = 600;
    let (broker, addr) = start_with(config(|s| s.max_publish_rate = RATE)).await;
    let mut sub = Client::connect(addr, V311, "sink").await;
    sub.subscribe("rate/#", QoS::AtLeastOnce).await;
    let (mut got, task) = fast_subscriber(sub);
    let start = tokio::time::Instant::now();
    let limited = tokio::spawn(flood(
        addr,
        "limited".into(),
        "rate/limited",
        QoS::AtLeastOnce,
        COUNT,
        64,
    ));
    wait_until("the limited client is held", || {
        broker.stats().clients_rate_limited > 0
    })
    .await;
    let other = flood(addr, "other".into(), "rate/other", QoS::AtLeastOnce, 50, 64).await;
    assert_eq!(other.len(), 50);
    assert!(
        !limited.is_finished(),
        "the second client finished its 50 messages while the first was still held"
    );
    let acked = tokio::time::timeout(RUN_DEADLINE, limited)
        .await
        .expect("the limited client done before the deadline")
        .expect("limited task");
    let elapsed = start.elapsed();
    assert_eq!(acked.len(), COUNT, "every message acknowledged");
    let least = Duration::from_secs_f64((COUNT as f64 - f64::from(RATE)) / f64::from(RATE));
    assert!(
        elapsed >= least,
        "{COUNT} messages at {RATE}/s took {elapsed:?}, less than {least:?}"
    );
    delivered_all(&mut got, &acked).await;
    delivered_all(&mut got, &other).await;
    let stats = broker.stats();
    assert_eq!(stats.dropped_total(), 0, "nothing dropped");
    assert!(stats.clients_rate_limited > 0);
    // Held for most of the run: at least the time the rate added, less the waits' rounding.
    assert!(
        stats.clients_rate_limited_ms >= least.as_millis() as u64 / 2,
        "held {} ms in total",
        stats.clients_rate_limited_ms
    );
    task.abort();
    broker.shutdown().await;
}

/// `max_publish_bytes_rate`: 60 payloads of 10,000 bytes at 200,000 bytes/s take at least
/// (600,000 - 200,000) / 200,000 = 2 s; all are acknowledged and delivered, none dropped.
#[tokio::test]
async fn publish_bytes_rate_slows_large_payloads_never_drops() {
    const RATE: u32 = 200_000;
    const COUNT: usize = 60;
    const SIZE: usize = 10_000;
    let (broker, addr) = start_with(config(|s| s.max_publish_bytes_rate = RATE)).await;
    let mut sub = Client::connect(addr, V311, "sink").await;
    sub.subscribe("rate/#", QoS::AtLeastOnce).await;
    let (mut got, task) = fast_subscriber(sub);
    let start = tokio::time::Instant::now();
    let acked = tokio::time::timeout(
        RUN_DEADLINE,
        flood_sized(
            addr,
            "large".into(),
            "rate/large",
            QoS::AtLeastOnce,
            COUNT,
            16,
            SIZE,
        ),
    )
    .await
    .expect("done before the deadline");
    let elapsed = start.elapsed();
    assert_eq!(acked.len(), COUNT, "every message acknowledged");
    let least =
        Duration::from_secs_f64(((COUNT * SIZE) as f64 - f64::from(RATE)) / f64::from(RATE));
    assert!(
        elapsed >= least,
        "{COUNT} x {SIZE} bytes at {RATE} bytes/s took {elapsed:?}, less than {least:?}"
    );
    delivered_all(&mut got, &acked).await;
    assert_eq!(broker.stats().dropped_total(), 0, "nothing dropped");
    assert!(broker.stats().clients_rate_limited > 0);
    task.abort();
    broker.shutdown().await;
}

/// A client held by `max_publish_rate` longer than one and a half times its keep alive is not
/// closed for it: the keep alive runs only while the broker waits to read [MQTT-3.1.2-24].
/// Keep alive 1 s (closed after 1.5 s of silence), one PUBLISH a second: four PUBLISH written
/// at once hold the client about 3 s; it then gets its PUBACKs and a PINGRESP. Run with
/// parking (a new connection parks right after its CONNACK, so the PUBLISH packets are read
/// by its resume) and without.
#[tokio::test]
async fn keep_alive_does_not_run_out_while_held_by_the_publish_rate() {
    for park_after in [10, 0] {
        let (broker, addr) = start_with(config(|s| {
            s.max_publish_rate = 1;
            s.park_after = park_after;
        }))
        .await;
        let mut connect = connect_packet(V311, "slow");
        connect.keep_alive = 1;
        let (mut c, ack) = Client::connect_with(addr, connect).await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        let mut out = BytesMut::new();
        for id in 1..=4u16 {
            let p = publish_packet(
                "ka/t",
                b"x",
                QoS::AtLeastOnce,
                false,
                id,
                Properties::default(),
            );
            codec::encode(&p, V311, &mut out).expect("encode");
        }
        c.send_raw(&out).await;
        for id in 1..=4u16 {
            match c.recv().await {
                Some(Packet::PubAck(a)) => assert_eq!(a.packet_id, id),
                other => panic!("park_after {park_after}: expected PUBACK {id}, got {other:?}"),
            }
        }
        c.ping().await;
        assert!(broker.stats().clients_rate_limited >= 3);
        broker.shutdown().await;
    }
}
