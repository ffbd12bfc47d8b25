//! Persistence with mercuriod as a process on a SQLite database: restarts after SIGTERM and
//! after SIGKILL (sessions of 3.1.1 clean session 0 and 5.0 session expiry, queued QoS 1/2
//! messages, an in-flight QoS 2 message, retained messages, the will of a client connected at
//! the crash), durable_ack under SIGKILL in the middle of a QoS 1 stream, a queue left in
//! storage at the restart and read back under SIGKILL mid-drain, queues left in storage for
//! `max_queued_memory` under SIGKILL in the middle of a QoS 1 stream, a stream (`[[streams]]`)
//! under durable_ack and SIGKILL, and a second daemon on the same database. A small blocking client on the broker's codec; waits have deadlines.
#![cfg(unix)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mercurio_core::codec::{
    Connect, LastWill, Packet, Properties, ProtocolVersion, QoS, Subscribe, SubscribeFilter,
};
use mercurio_testkit::{Client, Daemon, DEADLINE};

fn config(dir: &Path, db: &Path, durable_ack: bool) -> PathBuf {
    let path = dir.join(format!("mercuriod-{durable_ack}.toml"));
    std::fs::write(
        &path,
        format!(
            "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
             [storage]\nbackend = \"sqlite\"\npath = \"{}\"\ndurable_ack = {durable_ack}\n",
            db.display()
        ),
    )
    .expect("write config");
    path
}

/// mercuriod on `config`, ready.
fn start(config: &Path) -> Daemon {
    Daemon::with_file(config).start()
}

/// Sends `signal` and waits for the exit: status 0 after SIGTERM.
fn stop(mut daemon: Daemon, signal: i32) {
    let code = daemon.stop(signal);
    if signal == libc::SIGTERM {
        assert_eq!(code, Some(0));
    }
}

/// Polls `sql` (a count) on the database until it returns `want`.
fn wait_count(db: &Path, sql: &str, want: i64) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let n: i64 = rusqlite::Connection::open(db)
            .and_then(|c| c.query_row(sql, [], |r| r.get(0)))
            .unwrap_or(-1);
        if n == want {
            return;
        }
        assert!(Instant::now() < deadline, "{sql}: {n}, want {want}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn connect_packet(version: ProtocolVersion, client_id: &str, persistent: bool) -> Connect {
    let mut properties = Properties::default();
    if persistent && version == ProtocolVersion::V5 {
        properties.session_expiry_interval = Some(300);
    }
    Connect {
        protocol: version,
        clean_start: !persistent,
        keep_alive: 60,
        client_id: client_id.into(),
        will: None,
        username: None,
        password: None,
        properties,
    }
}

/// Receives (acknowledging each) until the last of `acked` (numbers from
/// [`acked_publisher`]) and asserts that none of them was missing.
fn receive_all(client: &mut Client, acked: &[u32]) {
    let mut received = std::collections::HashSet::new();
    let last = *acked.last().expect("acked");
    loop {
        let p = client.expect_publish();
        let i = u32::from_be_bytes(p.payload[..4].try_into().expect("4 bytes"));
        client.ack(&p);
        received.insert(i);
        if i >= last {
            break;
        }
    }
    for i in acked {
        assert!(received.contains(i), "acknowledged message {i} lost");
    }
}

/// A QoS 1 publisher (MQTT 3.1.1, client "pub") on a thread of its own: payloads of `size`
/// bytes (at least its number, 4 bytes big-endian) to `topic`, up to 16 awaiting PUBACK; the
/// numbers acknowledged, in order, on the receiver. It ends when the broker goes.
fn acked_publisher(
    addr: SocketAddr,
    topic: &'static str,
    size: usize,
) -> (std::thread::JoinHandle<()>, mpsc::Receiver<u32>) {
    let (acked_tx, acked_rx) = mpsc::channel::<u32>();
    let thread = std::thread::spawn(move || {
        let (mut publisher, _) =
            Client::connect(addr, connect_packet(ProtocolVersion::V311, "pub", false));
        let mut sent = std::collections::VecDeque::new();
        for i in 0u32..1_000_000 {
            let mut payload = i.to_be_bytes().to_vec();
            payload.resize(size.max(4), b'.');
            let id = publisher.publish_packet(topic, &payload, QoS::AtLeastOnce, false);
            sent.push_back((id, i));
            while sent.len() >= 16 {
                match publisher.recv() {
                    Some(Packet::PubAck(a)) => {
                        let (id, i) = sent.pop_front().expect("sent");
                        assert_eq!(a.packet_id, id);
                        if acked_tx.send(i).is_err() {
                            return;
                        }
                    }
                    _ => return,
                }
            }
        }
    });
    (thread, acked_rx)
}

#[test]
fn restart_after_sigterm_and_after_sigkill() {
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("mercurio.db");
        let cfg = config(dir.path(), &db, false);
        let daemon = start(&cfg);
        let addr = daemon.addr();
        let versions = [ProtocolVersion::V311, ProtocolVersion::V5];
        for v in versions {
            let (mut sub, _) =
                Client::connect(addr, connect_packet(v, &format!("sub-{v:?}"), true));
            sub.subscribe("t/#", QoS::ExactlyOnce);
            sub.disconnect();
        }
        // A subscriber that holds a QoS 2 message unacknowledged when the broker stops.
        let (mut holder, _) =
            Client::connect(addr, connect_packet(ProtocolVersion::V5, "holder", true));
        holder.subscribe("h", QoS::ExactlyOnce);
        // A client connected with a will when the broker stops.
        let mut dying = connect_packet(ProtocolVersion::V5, "dying", true);
        dying.will = Some(LastWill {
            topic: "wills/dying".into(),
            payload: Bytes::from_static(b"gone"),
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: Properties::default(),
        });
        let (_dying, _) = Client::connect(addr, dying);
        let (mut watcher, _) =
            Client::connect(addr, connect_packet(ProtocolVersion::V5, "watcher", true));
        watcher.subscribe("wills/#", QoS::AtLeastOnce);
        watcher.disconnect();

        let (mut publisher, _) =
            Client::connect(addr, connect_packet(ProtocolVersion::V311, "pub", false));
        publisher.publish("t/1", b"one", QoS::AtLeastOnce, false);
        publisher.publish("t/2", b"two", QoS::ExactlyOnce, false);
        publisher.publish("r/x", b"kept", QoS::AtLeastOnce, true);
        publisher.publish("h", b"held", QoS::ExactlyOnce, false);
        let held = holder.expect_publish();
        assert_eq!(&held.payload[..], b"held");
        if signal == libc::SIGKILL {
            // Without durable_ack, changes reach the database within milliseconds.
            wait_count(&db, "SELECT count(*) FROM queued", 4);
            wait_count(
                &db,
                "SELECT count(*) FROM inflight WHERE client_id = 'holder'",
                1,
            );
            wait_count(&db, "SELECT count(*) FROM retained", 1);
        }
        stop(daemon, signal);

        let daemon = start(&cfg);
        let addr = daemon.addr();
        for v in versions {
            let (mut sub, present) =
                Client::connect(addr, connect_packet(v, &format!("sub-{v:?}"), true));
            assert!(present, "{signal} {v:?}");
            let one = sub.expect_publish();
            assert_eq!(
                (&one.payload[..], one.qos),
                (&b"one"[..], QoS::AtLeastOnce),
                "{signal}"
            );
            sub.ack(&one);
            let two = sub.expect_publish();
            assert_eq!(
                (&two.payload[..], two.qos),
                (&b"two"[..], QoS::ExactlyOnce),
                "{signal}"
            );
            sub.ack(&two);
            sub.settle();
        }
        let (mut holder, present) =
            Client::connect(addr, connect_packet(ProtocolVersion::V5, "holder", true));
        assert!(present);
        let again = holder.expect_publish();
        assert!(again.dup, "{signal}: resent with DUP");
        assert_eq!(
            (again.packet_id, &again.payload[..]),
            (held.packet_id, &b"held"[..])
        );
        holder.ack(&again);
        let (mut watcher, _) =
            Client::connect(addr, connect_packet(ProtocolVersion::V5, "watcher", true));
        let will = watcher.expect_publish();
        assert_eq!(
            (will.topic.as_str(), &will.payload[..]),
            ("wills/dying", &b"gone"[..]),
            "{signal}"
        );
        watcher.ack(&will);
        let (mut fresh, _) =
            Client::connect(addr, connect_packet(ProtocolVersion::V311, "fresh", false));
        fresh.subscribe("r/#", QoS::AtLeastOnce);
        let r = fresh.expect_publish();
        assert!(r.retain);
        assert_eq!(&r.payload[..], b"kept");
        stop(daemon, libc::SIGTERM);
    }
}

#[test]
fn durable_ack_loses_no_acknowledged_message_under_sigkill() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("mercurio.db");
    let cfg = config(dir.path(), &db, true);
    let daemon = start(&cfg);
    let addr = daemon.addr();
    let (mut sub, _) = Client::connect(addr, connect_packet(ProtocolVersion::V5, "sub", true));
    sub.subscribe("s", QoS::AtLeastOnce);
    sub.disconnect();

    // A QoS 1 stream with up to 16 messages awaiting PUBACK; the acknowledged ones recorded.
    let (stream, acked_rx) = acked_publisher(addr, "s", 4);
    let mut acked = Vec::new();
    while acked.len() < 500 {
        acked.push(acked_rx.recv_timeout(DEADLINE).expect("acknowledgements"));
    }
    stop(daemon, libc::SIGKILL);
    let _ = stream.join();
    acked.extend(acked_rx.try_iter());

    let daemon = start(&cfg);
    let (mut sub, present) = Client::connect(
        daemon.addr(),
        connect_packet(ProtocolVersion::V5, "sub", true),
    );
    assert!(present);
    receive_all(&mut sub, &acked);
    stop(daemon, libc::SIGTERM);
}

/// A stream on SQLite under durable_ack: a SIGKILL in the middle of a QoS 1 publisher loses
/// no acknowledged message from the stream (a durable commit keeps its segments in their
/// rows, the other batches' go to files beside the database), and appends go on after it.
#[test]
fn a_stream_keeps_every_acknowledged_message_under_sigkill() {
    stream_through_sigkill(true);
}

/// Without durable_ack the segments are in files beside the database; a SIGKILL in the
/// middle of a publisher leaves the stream whole up to its last commit (what the killed
/// batch wrote after it is cut at the restart): the messages read back in order, none twice,
/// and appends go on after them.
#[test]
fn a_streams_files_are_whole_after_sigkill() {
    stream_through_sigkill(false);
}

fn stream_through_sigkill(durable_ack: bool) {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("mercurio.db");
    let cfg = config(dir.path(), &db, durable_ack);
    let mut text = std::fs::read_to_string(&cfg).expect("read config");
    text.push_str("\n[[streams]]\nname = \"all\"\nfilter = \"s/#\"\n");
    std::fs::write(&cfg, text).expect("write config");
    let daemon = start(&cfg);
    let addr = daemon.addr();
    let (publisher, acked_rx) = acked_publisher(addr, "s/x", 204);
    let mut acked = Vec::new();
    while acked.len() < 2_000 {
        acked.push(acked_rx.recv_timeout(DEADLINE).expect("acknowledgements"));
    }
    stop(daemon, libc::SIGKILL);
    let _ = publisher.join();
    acked.extend(acked_rx.try_iter());
    if !durable_ack {
        let files = dir.path().join("mercurio.db-streams").join("s-all");
        assert!(files.join("0.seg").is_file(), "segments in files");
    }

    let daemon = start(&cfg);
    let read_all = |addr, client_id: &str| {
        let (mut reader, _) =
            Client::connect(addr, connect_packet(ProtocolVersion::V5, client_id, false));
        let properties = Properties {
            user_properties: vec![("stream-offset".into(), "earliest".into())],
            ..Properties::default()
        };
        reader.send(Packet::Subscribe(Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter::new("$stream/all", QoS::AtLeastOnce)],
            properties,
        }));
        assert!(matches!(reader.recv(), Some(Packet::SubAck(_))));
        reader
    };
    if durable_ack {
        let mut reader = read_all(daemon.addr(), "r1");
        receive_all(&mut reader, &acked);
    }
    // Appends go on after the cut tail, and read back with the rest: in order, none twice.
    let (mut publisher, _) = Client::connect(
        daemon.addr(),
        connect_packet(ProtocolVersion::V311, "pub2", false),
    );
    publisher.publish("s/x", &u32::MAX.to_be_bytes(), QoS::AtLeastOnce, false);
    let mut reader = read_all(daemon.addr(), "r2");
    let mut next = 0;
    loop {
        let p = reader.expect_publish();
        reader.ack(&p);
        let i = u32::from_be_bytes(p.payload[..4].try_into().expect("4 bytes"));
        if i == u32::MAX {
            break;
        }
        assert_eq!(
            i, next,
            "the stream's messages in order, none missing or twice"
        );
        next += 1;
    }
    assert!(
        next > 0,
        "the stream kept what was committed before the kill"
    );
    stop(daemon, libc::SIGTERM);
}

/// A restart leaves an offline session's queue in storage; messages published after it queue
/// behind the stored ones; a SIGKILL once the client has taken part of the queue loses
/// nothing (durable_ack): after the next restart the client gets the rest, in order, from at
/// most the first message it had not acknowledged on.
#[test]
fn a_queue_left_in_storage_survives_sigkill_mid_drain() {
    const STORED: u32 = 300;
    const AFTER: u32 = 20;
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("mercurio.db");
    let cfg = config(dir.path(), &db, true);
    let socket = dir.path().join("admin.sock");
    let mut text = std::fs::read_to_string(&cfg).expect("config");
    text.push_str(&format!("\n[admin]\nsocket = \"{}\"\n", socket.display()));
    std::fs::write(&cfg, text).expect("config");
    let start = |cfg: &Path| Daemon::with_file(cfg).socket(&socket).start();
    let daemon = start(&cfg);
    let (mut sub, _) = Client::connect(
        daemon.addr(),
        connect_packet(ProtocolVersion::V5, "sub", true),
    );
    sub.subscribe("s", QoS::AtLeastOnce);
    sub.disconnect();
    let (mut publisher, _) = Client::connect(
        daemon.addr(),
        connect_packet(ProtocolVersion::V311, "pub", false),
    );
    for i in 0..STORED {
        publisher.publish("s", &i.to_be_bytes(), QoS::AtLeastOnce, false);
    }
    publisher.disconnect();
    stop(daemon, libc::SIGTERM);

    let daemon = start(&cfg);
    let show = daemon.admin(r#"{"command":"client.show","client_id":"sub"}"#);
    assert_eq!(
        show["result"]["queued"], STORED,
        "the stored queue is counted: {show}"
    );
    assert_eq!(
        show["result"]["queued_in_storage"], STORED,
        "and said to be in storage: {show}"
    );
    let (mut publisher, _) = Client::connect(
        daemon.addr(),
        connect_packet(ProtocolVersion::V311, "pub", false),
    );
    for i in STORED..STORED + AFTER {
        publisher.publish("s", &i.to_be_bytes(), QoS::AtLeastOnce, false);
    }
    publisher.disconnect();
    let (mut sub, present) = Client::connect(
        daemon.addr(),
        connect_packet(ProtocolVersion::V5, "sub", true),
    );
    assert!(present);
    let number = |p: &mercurio_core::codec::Publish| {
        u32::from_be_bytes(p.payload[..4].try_into().expect("4 bytes"))
    };
    for want in 0..100 {
        let p = sub.expect_publish();
        assert_eq!(number(&p), want, "in order");
        sub.ack(&p);
    }
    sub.settle();
    stop(daemon, libc::SIGKILL);

    let daemon = start(&cfg);
    let (mut sub, present) = Client::connect(
        daemon.addr(),
        connect_packet(ProtocolVersion::V5, "sub", true),
    );
    assert!(present);
    let p = sub.expect_publish();
    let first = number(&p);
    sub.ack(&p);
    assert!(
        first <= 100,
        "starts at or before the first unacknowledged: {first}"
    );
    let mut next = first + 1;
    while next < STORED + AFTER {
        let p = sub.expect_publish();
        assert_eq!(number(&p), next, "every message, in order");
        sub.ack(&p);
        next += 1;
    }
    stop(daemon, libc::SIGTERM);
}

/// `max_queued_memory` with durable_ack: an offline fleet's queues go to storage as a QoS 1
/// stream fills them past the bound; a SIGKILL in the middle of the stream loses no
/// acknowledged message: after the restart each client gets every one, in order.
#[test]
fn queues_left_in_storage_for_max_queued_memory_lose_nothing_under_sigkill() {
    const FLEET: usize = 6;
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("mercurio.db");
    let cfg = config(dir.path(), &db, true);
    let text = std::fs::read_to_string(&cfg).expect("config");
    std::fs::write(
        &cfg,
        format!("[server]\nmax_queued_memory = 65536\n\n{text}"),
    )
    .expect("config");
    let daemon = start(&cfg);
    let addr = daemon.addr();
    let ids: Vec<String> = (0..FLEET).map(|i| format!("fleet-{i}")).collect();
    for id in &ids {
        let (mut sub, _) = Client::connect(addr, connect_packet(ProtocolVersion::V5, id, true));
        sub.subscribe("s", QoS::AtLeastOnce);
        sub.disconnect();
    }

    // 1 KiB messages, each queued for the whole fleet: the bound is passed every 10 or so.
    let (stream, acked_rx) = acked_publisher(addr, "s", 1024);
    let mut acked = Vec::new();
    while acked.len() < 300 {
        acked.push(acked_rx.recv_timeout(DEADLINE).expect("acknowledgements"));
    }
    stop(daemon, libc::SIGKILL);
    let _ = stream.join();
    acked.extend(acked_rx.try_iter());
    let last = *acked.last().expect("acked");

    let daemon = start(&cfg);
    for id in &ids {
        let (mut sub, present) =
            Client::connect(daemon.addr(), connect_packet(ProtocolVersion::V5, id, true));
        assert!(present);
        let mut next = 0;
        while next <= last {
            let p = sub.expect_publish();
            let i = u32::from_be_bytes(p.payload[..4].try_into().expect("4 bytes"));
            sub.ack(&p);
            assert_eq!(i, next, "{id}: every acknowledged message, in order");
            next += 1;
        }
        sub.disconnect();
    }
    stop(daemon, libc::SIGTERM);
}

#[test]
fn a_second_daemon_on_the_same_database_exits() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("mercurio.db");
    let cfg = config(dir.path(), &db, false);
    let first = start(&cfg);
    let mut second = Daemon::with_file(&cfg).spawn();
    assert_eq!(second.wait_exit(), Some(1));
    let text = second.stderr();
    assert!(text.contains("mercurio.db"), "{text}");
    assert!(text.contains("in use"), "{text}");
    stop(first, libc::SIGTERM);
}
