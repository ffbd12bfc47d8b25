//! Standby brokers: two real mercuriod processes on one PostgreSQL database (a throwaway
//! cluster, or `MERCURIO_TEST_POSTGRES_URL`). SIGKILL of the serving broker: the standby serves
//! with persistent sessions and queued messages intact, and a second broker that is not a
//! standby exits naming the serving host. SIGSTOP: the standby takes over once the heartbeat
//! is stale, and the old broker, continued, is refused and exits. A newer schema is refused.
//! A serving broker cut off from the database (a TCP proxy that stops forwarding) exits after
//! about 7 s. Users and rules kept in storage (`[auth] backend = "storage"`) are the
//! standby's once it takes over. A stream continues on the standby: same messages, offsets
//! and times.
//! Waits are on events with deadlines; failover times are printed.
#![cfg(unix)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mercurio_core::codec::{Connect, Properties, ProtocolVersion, QoS};
use mercurio_storage::postgres::testing::TestPostgres;

use mercurio_testkit::{Client, Daemon, DEADLINE};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn config(dir: &Path, name: &str, url: &str, standby: bool) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
             [admin]\nsocket = \"{}\"\n\n\
             [storage]\nbackend = \"postgres\"\nurl = \"{url}\"\nstandby = {standby}\n",
            dir.join(format!("{name}.sock")).display()
        ),
    )
    .expect("write config");
    path
}

/// Waits for `daemon` to exit within `wait`; its exit code and its whole log.
fn exited(daemon: &mut Daemon, wait: Duration) -> (Option<i32>, String) {
    let status = daemon.wait_exit_within(wait).unwrap_or_else(|| {
        panic!(
            "mercuriod did not exit within {wait:?}; output:\n{}",
            daemon.log().join("\n")
        )
    });
    daemon.finish();
    (status.code(), daemon.log().join("\n"))
}

/// Polls `sql` (one bigint) on `url` until it returns `want`.
fn wait_count(url: &str, sql: &str, want: i64) {
    let rt = runtime();
    rt.block_on(async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        let deadline = Instant::now() + DEADLINE;
        loop {
            let n: i64 = client
                .query_one(sql, &[])
                .await
                .map(|r| r.get(0))
                .unwrap_or(-1);
            if n == want {
                return;
            }
            assert!(Instant::now() < deadline, "{sql}: {n}, want {want}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
}

fn persistent(client_id: &str) -> Connect {
    let properties = Properties {
        session_expiry_interval: Some(300),
        ..Properties::default()
    };
    Connect {
        protocol: ProtocolVersion::V5,
        clean_start: false,
        keep_alive: 60,
        client_id: client_id.into(),
        will: None,
        username: None,
        password: None,
        properties,
    }
}

fn new_database(pg: &TestPostgres, prefix: &str) -> String {
    runtime().block_on(async { pg.url(&pg.database(prefix, None).await) })
}

#[test]
fn sigkill_of_the_serving_broker_and_the_standby_serves() {
    let Some(pg) = TestPostgres::start("standby_sigkill") else {
        return;
    };
    let url = new_database(&pg, "kill");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut serving = Daemon::with_file(&config(dir.path(), "a", &url, false)).spawn();
    let addr = serving.wait_ready();
    // The schema is created before the listeners open, without PostgreSQL's notices.
    let notices = serving.seen(|l| l.contains("NOTICE") || l.contains("skipping"));
    assert!(notices.is_empty(), "{notices:#?}");
    let mut standby = Daemon::with_file(&config(dir.path(), "b", &url, true)).spawn();
    standby.wait_line("waiting for the serving broker", |l| {
        l.contains("waiting for the serving broker")
    });
    // While it waits, its admin socket says so at once (code unavailable, 503 over HTTP).
    let waiting =
        mercurio_testkit::admin(&dir.path().join("b.sock"), r#"{"command":"broker.status"}"#);
    assert_eq!(waiting["ok"], false, "{waiting}");
    assert_eq!(waiting["code"], "unavailable", "{waiting}");
    assert!(
        waiting["error"]
            .as_str()
            .is_some_and(|e| e.contains("standby waiting")),
        "{waiting}"
    );

    // A second broker that is not a standby exits, naming the serving host.
    let mut second = Daemon::with_file(&config(dir.path(), "c", &url, false)).spawn();
    let (code, output) = exited(&mut second, DEADLINE);
    assert_eq!(code, Some(1), "{output}");
    assert!(output.contains("served by the broker on host"), "{output}");

    let (mut sub, _) = Client::connect(addr, persistent("sub"));
    sub.subscribe("t/#", QoS::AtLeastOnce);
    sub.disconnect();
    let (mut publisher, _) = Client::connect(addr, persistent("pub"));
    for i in 0..3u8 {
        publisher.publish("t/x", &[b'0' + i], QoS::AtLeastOnce, false);
    }
    publisher.publish("r/x", b"kept", QoS::AtLeastOnce, true);
    wait_count(
        &url,
        "SELECT count(*) FROM mercurio_queued WHERE client_id = 'sub'",
        3,
    );
    wait_count(&url, "SELECT count(*) FROM mercurio_retained", 1);
    // A connected subscriber acknowledges two of four messages: the other two are in flight
    // when the broker is killed, and resent by the standby.
    let (mut held, _) = Client::connect(addr, persistent("held"));
    held.subscribe("u/#", QoS::AtLeastOnce);
    for i in 0..4u8 {
        publisher.publish("u/x", &[b'0' + i], QoS::AtLeastOnce, false);
    }
    for i in 0..4u8 {
        let p = held.expect_publish();
        assert_eq!(&p.payload[..], &[b'0' + i]);
        if i < 2 {
            held.ack(&p);
        }
    }
    held.settle();
    wait_count(
        &url,
        "SELECT count(*) FROM mercurio_inflight WHERE client_id = 'held'",
        2,
    );
    wait_count(
        &url,
        "SELECT count(*) FROM mercurio_queued WHERE client_id = 'held'",
        0,
    );

    serving.signal(libc::SIGKILL);
    let killed = Instant::now();
    let addr = standby.wait_ready();
    let failover = killed.elapsed();
    eprintln!("failover after SIGKILL: {failover:?}");
    assert!(failover < Duration::from_secs(5), "{failover:?}");

    let (mut sub, present) = Client::connect(addr, persistent("sub"));
    assert!(present, "the session survived the failover");
    let mut payloads = Vec::new();
    for _ in 0..3 {
        let p = sub.expect_publish();
        sub.ack(&p);
        payloads.push(p.payload.to_vec());
    }
    assert_eq!(payloads, [b"0".to_vec(), b"1".to_vec(), b"2".to_vec()]);
    sub.subscribe("r/#", QoS::AtLeastOnce);
    let retained = sub.expect_publish();
    assert_eq!(&retained.payload[..], b"kept");
    sub.disconnect();
    let (mut held, present) = Client::connect(addr, persistent("held"));
    assert!(present, "the session survived the failover");
    for i in 2..4u8 {
        let p = held.expect_publish();
        assert_eq!(
            &p.payload[..],
            &[b'0' + i],
            "unacknowledged, resent in order"
        );
        assert!(p.dup, "resent");
        held.ack(&p);
    }
    held.disconnect();
    standby.signal(libc::SIGTERM);
    let (code, output) = exited(&mut standby, DEADLINE);
    assert_eq!(code, Some(0), "{output}");
}

#[test]
fn sigstop_of_the_serving_broker_then_takeover_and_the_old_one_is_fenced() {
    let Some(pg) = TestPostgres::start("standby_sigstop") else {
        return;
    };
    let url = new_database(&pg, "stop");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut serving = Daemon::with_file(&config(dir.path(), "a", &url, false)).spawn();
    let old_addr = serving.wait_ready();
    let mut standby = Daemon::with_file(&config(dir.path(), "b", &url, true)).spawn();
    standby.wait_line("waiting for the serving broker", |l| {
        l.contains("waiting for the serving broker")
    });
    let (mut sub, _) = Client::connect(old_addr, persistent("sub"));
    sub.subscribe("t/#", QoS::AtLeastOnce);
    sub.disconnect();
    wait_count(&url, "SELECT count(*) FROM mercurio_subscriptions", 1);

    serving.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let addr = standby.wait_ready_within(Duration::from_secs(40));
    let takeover = stopped.elapsed();
    eprintln!("takeover after SIGSTOP: {takeover:?}");
    assert!(takeover >= Duration::from_secs(8), "{takeover:?}");
    wait_count(&url, "SELECT max(epoch) FROM mercurio_takeovers", 2);

    // The continued broker is refused and exits at once, with an error.
    serving.signal(libc::SIGCONT);
    let (code, output) = exited(&mut serving, Duration::from_secs(15));
    assert_eq!(code, Some(1), "{output}");
    assert!(output.contains("stopping at once"), "{output}");
    assert!(output.contains("took over"), "{output}");

    let (sub, present) = Client::connect(addr, persistent("sub"));
    assert!(present, "the new broker serves the session");
    sub.disconnect();
}

#[test]
fn newer_schema_is_refused_by_broker_and_standby() {
    let Some(pg) = TestPostgres::start("standby_schema") else {
        return;
    };
    let url = new_database(&pg, "schema");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut first = Daemon::with_file(&config(dir.path(), "a", &url, false)).spawn();
    first.wait_ready();
    first.signal(libc::SIGTERM);
    assert_eq!(exited(&mut first, DEADLINE).0, Some(0));
    runtime().block_on(pg.execute(
        &url,
        "UPDATE mercurio_meta SET value = '99' WHERE key = 'schema_version'",
    ));
    for (name, standby) in [("b", false), ("c", true)] {
        let mut daemon = Daemon::with_file(&config(dir.path(), name, &url, standby)).spawn();
        let (code, output) = exited(&mut daemon, DEADLINE);
        assert_eq!(code, Some(1), "{output}");
        assert!(output.contains("schema version 99"), "{output}");
    }
}

/// A TCP proxy to the database that can be cut: it then forwards nothing more, in either
/// direction, keeping connections open (as a half-open network), and closes new ones.
struct Proxy {
    port: u16,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Proxy {
    fn start(upstream: SocketAddr) -> Proxy {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&cut);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(client) = stream else { return };
                if flag.load(Ordering::Relaxed) {
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let flag = Arc::clone(&flag);
                    std::thread::spawn(move || {
                        from.set_read_timeout(Some(Duration::from_millis(100))).ok();
                        let mut buf = [0u8; 16384];
                        loop {
                            match mercurio_testkit::uninterrupted(|| from.read(&mut buf)) {
                                Ok(0) => return,
                                Ok(n) => {
                                    if !flag.load(Ordering::Relaxed)
                                        && to.write_all(&buf[..n]).is_err()
                                    {
                                        return;
                                    }
                                }
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock
                                            | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => return,
                            }
                        }
                    });
                }
            }
        });
        Proxy { port, cut }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn serving_broker_exits_when_the_database_is_lost() {
    let Some(pg) = TestPostgres::start("standby_lost") else {
        return;
    };
    let url = new_database(&pg, "lost");
    // postgres://user@127.0.0.1:PORT/db, through the proxy.
    let (rest, db) = url.rsplit_once('/').unwrap();
    let port: u16 = rest.rsplit_once(':').unwrap().1.parse().unwrap();
    let proxy = Proxy::start(SocketAddr::from(([127, 0, 0, 1], port)));
    let proxied = format!("postgres://postgres@127.0.0.1:{}/{db}", proxy.port);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut serving = Daemon::with_file(&config(dir.path(), "a", &proxied, false)).spawn();
    serving.wait_ready();
    proxy.cut();
    let cut = Instant::now();
    let (code, output) = exited(&mut serving, Duration::from_secs(20));
    let lost = cut.elapsed();
    eprintln!("exit after the database was cut: {lost:?}");
    assert_eq!(code, Some(1), "{output}");
    assert!(output.contains("cannot reach the database"), "{output}");
    assert!(lost >= Duration::from_secs(5), "{lost:?}");
}

/// Users and rules added with the admin protocol on the serving broker are what the standby
/// reads when it takes over: the user connects to it with its password and gets its rules;
/// a user unknown to the database is still refused.
#[test]
fn the_standby_takes_over_users_and_rules() {
    let Some(pg) = TestPostgres::start("standby_access") else {
        return;
    };
    let url = new_database(&pg, "access");
    let dir = tempfile::tempdir().expect("temp dir");
    let config = |name: &str, standby: bool| {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "[auth]\nbackend = \"storage\"\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
                 [admin]\nsocket = \"{}\"\n\n\
                 [storage]\nbackend = \"postgres\"\nurl = \"{url}\"\nstandby = {standby}\n",
                dir.path().join(format!("{name}.sock")).display()
            ),
        )
        .expect("write config");
        path
    };
    let mut serving = Daemon::with_file(&config("a", false))
        .socket(dir.path().join("a.sock"))
        .spawn();
    let addr = serving.wait_ready();
    let mut standby = Daemon::with_file(&config("b", true)).spawn();
    standby.wait_line("waiting for the serving broker", |l| {
        l.contains("waiting for the serving broker")
    });

    let credentials = serde_json::to_value(
        mercurio_core::auth::stored::Credentials::from_password(b"pw").expect("credentials"),
    )
    .expect("json");
    for request in [
        serde_json::json!({"command": "user.add", "username": "eve", "credentials": credentials}),
        serde_json::json!({"command": "role.create", "role": "r"}),
        serde_json::json!({"command": "acl.add", "role": "r", "access": "read", "topic": "t/#"}),
        serde_json::json!({"command": "user.add-role", "username": "eve", "role": "r"}),
    ] {
        let answer = serving.admin(&request.to_string());
        assert_eq!(answer["ok"], true, "{request}: {answer}");
    }
    let eve = |addr| {
        let mut c = persistent("eve");
        c.username = Some("eve".into());
        c.password = Some(bytes::Bytes::from_static(b"pw"));
        Client::connect(addr, c)
    };
    eve(addr).0.disconnect();

    serving.signal(libc::SIGKILL);
    let addr = standby.wait_ready();
    let (mut c, _) = eve(addr);
    c.subscribe("t/#", QoS::AtLeastOnce);
    c.disconnect();
    // Not in the database: refused (CONNACK 0x87).
    let mut stranger = persistent("stranger");
    stranger.username = Some("mallory".into());
    stranger.password = Some(bytes::Bytes::from_static(b"pw"));
    let mut stream = TcpStream::connect(addr).expect("connect");
    let mut out = bytes::BytesMut::new();
    mercurio_core::codec::encode(
        &mercurio_core::codec::Packet::Connect(Box::new(stranger)),
        ProtocolVersion::V5,
        &mut out,
    )
    .expect("encode");
    stream.write_all(&out).expect("write");
    stream.set_read_timeout(Some(DEADLINE)).ok();
    let mut connack = [0u8; 4];
    stream.read_exact(&mut connack).expect("CONNACK");
    assert_eq!(connack[0], 0x20);
    assert_eq!(connack[3], 0x87, "{connack:?}");
    standby.signal(libc::SIGTERM);
    let (code, output) = exited(&mut standby, DEADLINE);
    assert_eq!(code, Some(0), "{output}");
}

/// A stream kept in PostgreSQL continues on the standby that takes over: a reader from
/// `earliest` gets every acknowledged message with its offset and append time, and the
/// offsets go on.
#[test]
fn a_stream_continues_on_the_standby() {
    let Some(pg) = TestPostgres::start("standby_stream") else {
        return;
    };
    let url = new_database(&pg, "stream");
    let dir = tempfile::tempdir().expect("temp dir");
    let with_stream = |name: &str, standby: bool| {
        let path = config(dir.path(), name, &url, standby);
        let mut text = std::fs::read_to_string(&path).expect("read config");
        text.push_str("\n[[streams]]\nname = \"s\"\nfilter = \"t/#\"\n");
        std::fs::write(&path, text).expect("write config");
        path
    };
    let mut serving = Daemon::with_file(&with_stream("a", false)).spawn();
    let addr = serving.wait_ready();
    let mut standby = Daemon::with_file(&with_stream("b", true)).spawn();
    standby.wait_line("waiting for the serving broker", |l| {
        l.contains("waiting for the serving broker")
    });
    let (mut publisher, _) = Client::connect(addr, persistent("pub"));
    for i in 0..5u8 {
        publisher.publish("t/x", &[b'0' + i], QoS::AtLeastOnce, false);
    }
    let position = |p: &mercurio_core::codec::Publish| {
        let get = |k: &str| {
            p.properties
                .user_properties
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        (get("stream-offset"), get("stream-time"), p.payload.to_vec())
    };
    let (mut reader, _) = Client::connect(addr, persistent("reader"));
    reader.subscribe("$stream/s/@earliest", QoS::AtLeastOnce);
    let mut before = Vec::new();
    for _ in 0..5 {
        let p = reader.expect_publish();
        reader.ack(&p);
        before.push(position(&p));
    }
    wait_count(
        &url,
        "SELECT count(*) FROM mercurio_stream_entries WHERE stream = 's'",
        5,
    );
    serving.signal(libc::SIGKILL);
    let addr = standby.wait_ready();

    // Another client: the first reader's session may come back with acknowledgements the
    // kill left uncommitted, and its resent messages would arrive before the SUBACK
    // [MQTT-4.4.0-1].
    let (mut reader, _) = Client::connect(addr, persistent("reader-after"));
    reader.subscribe("$stream/s/@earliest", QoS::AtLeastOnce);
    let mut after = Vec::new();
    for _ in 0..5 {
        let p = reader.expect_publish();
        reader.ack(&p);
        after.push(position(&p));
    }
    assert_eq!(after, before, "the same messages, offsets and times");
    assert_eq!(after[4].0, "5");
    let (mut publisher, _) = Client::connect(addr, persistent("pub"));
    publisher.publish("t/x", b"new", QoS::AtLeastOnce, false);
    let p = reader.expect_publish();
    assert_eq!(position(&p).0, "6", "offsets go on");
    standby.signal(libc::SIGTERM);
    let (code, output) = exited(&mut standby, DEADLINE);
    assert_eq!(code, Some(0), "{output}");
}
