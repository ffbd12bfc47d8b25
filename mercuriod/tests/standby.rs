//! Standby brokers: two real mercuriod processes on one PostgreSQL database (a throwaway
//! cluster, or `MERCURIO_TEST_POSTGRES_URL`). SIGKILL of the serving broker: the standby serves
//! with persistent sessions and queued messages intact, and a second broker that is not a
//! standby exits naming the serving host. SIGSTOP: the standby takes over once the heartbeat
//! is stale, and the old broker, continued, is refused and exits. A newer schema is refused.
//! A serving broker cut off from the database (a TCP proxy that stops forwarding) exits after
//! about 7 s.
//! Waits are on events with deadlines; failover times are printed.
#![cfg(unix)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mercurio_core::codec::{Connect, Properties, ProtocolVersion, QoS};
use mercurio_storage::postgres::testing::TestPostgres;

#[path = "support/sync_client.rs"]
mod sync_client;
use sync_client::Client;

const MERCURIOD: &str = env!("CARGO_BIN_EXE_mercuriod");
const DEADLINE: Duration = Duration::from_secs(30);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A mercuriod process and its output lines (stdout and stderr together).
struct Daemon {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

impl Daemon {
    fn spawn(config: &Path) -> Daemon {
        let mut child = Command::new(MERCURIOD)
            .arg("-c")
            .arg(config)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn mercuriod");
        let (tx, lines) = mpsc::channel();
        let forward = |r: Box<dyn Read + Send>, tx: mpsc::Sender<String>| {
            std::thread::spawn(move || {
                for line in BufReader::new(r).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        };
        forward(Box::new(child.stdout.take().expect("stdout")), tx.clone());
        forward(Box::new(child.stderr.take().expect("stderr")), tx);
        Daemon {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `what`, within `wait`; returns it.
    fn wait_line(&mut self, what: &str, wait: Duration) -> String {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(what) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {what:?} within {wait:?}; output:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    fn wait_listening(&mut self, wait: Duration) -> SocketAddr {
        let line = self.wait_line("listening on ", wait);
        let at = line.find("listening on ").unwrap() + 13;
        line[at..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
            .collect::<String>()
            .parse()
            .expect("address")
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(signal)
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Waits for the process to exit within `wait`; returns its exit code and its output.
    fn wait_exit(&mut self, wait: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(200)) {
                    self.seen.push(line);
                }
                return (status.code(), self.seen.join("\n"));
            }
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            assert!(
                Instant::now() < deadline,
                "mercuriod did not exit within {wait:?}; output:\n{}",
                self.seen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
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
    let mut properties = Properties::default();
    properties.session_expiry_interval = Some(300);
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
    let mut serving = Daemon::spawn(&config(dir.path(), "a", &url, false));
    let addr = serving.wait_listening(DEADLINE);
    let mut standby = Daemon::spawn(&config(dir.path(), "b", &url, true));
    standby.wait_line("waiting for the serving broker", DEADLINE);

    // A second broker that is not a standby exits, naming the serving host.
    let mut second = Daemon::spawn(&config(dir.path(), "c", &url, false));
    let (code, output) = second.wait_exit(DEADLINE);
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

    serving.signal("-KILL");
    let killed = Instant::now();
    let addr = standby.wait_listening(DEADLINE);
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
    standby.signal("-TERM");
    let (code, output) = standby.wait_exit(DEADLINE);
    assert_eq!(code, Some(0), "{output}");
}

#[test]
fn sigstop_of_the_serving_broker_then_takeover_and_the_old_one_is_fenced() {
    let Some(pg) = TestPostgres::start("standby_sigstop") else {
        return;
    };
    let url = new_database(&pg, "stop");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut serving = Daemon::spawn(&config(dir.path(), "a", &url, false));
    let old_addr = serving.wait_listening(DEADLINE);
    let mut standby = Daemon::spawn(&config(dir.path(), "b", &url, true));
    standby.wait_line("waiting for the serving broker", DEADLINE);
    let (mut sub, _) = Client::connect(old_addr, persistent("sub"));
    sub.subscribe("t/#", QoS::AtLeastOnce);
    sub.disconnect();
    wait_count(&url, "SELECT count(*) FROM mercurio_subscriptions", 1);

    serving.signal("-STOP");
    let stopped = Instant::now();
    let addr = standby.wait_listening(Duration::from_secs(40));
    let takeover = stopped.elapsed();
    eprintln!("takeover after SIGSTOP: {takeover:?}");
    assert!(takeover >= Duration::from_secs(8), "{takeover:?}");
    wait_count(&url, "SELECT max(epoch) FROM mercurio_takeovers", 2);

    // The continued broker is refused and exits at once, with an error.
    serving.signal("-CONT");
    let (code, output) = serving.wait_exit(Duration::from_secs(15));
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
    let mut first = Daemon::spawn(&config(dir.path(), "a", &url, false));
    first.wait_listening(DEADLINE);
    first.signal("-TERM");
    assert_eq!(first.wait_exit(DEADLINE).0, Some(0));
    runtime().block_on(pg.execute(
        &url,
        "UPDATE mercurio_meta SET value = '99' WHERE key = 'schema_version'",
    ));
    for (name, standby) in [("b", false), ("c", true)] {
        let mut daemon = Daemon::spawn(&config(dir.path(), name, &url, standby));
        let (code, output) = daemon.wait_exit(DEADLINE);
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
                            match from.read(&mut buf) {
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
    let mut serving = Daemon::spawn(&config(dir.path(), "a", &proxied, false));
    serving.wait_listening(DEADLINE);
    proxy.cut();
    let cut = Instant::now();
    let (code, output) = serving.wait_exit(Duration::from_secs(20));
    let lost = cut.elapsed();
    eprintln!("exit after the database was cut: {lost:?}");
    assert_eq!(code, Some(1), "{output}");
    assert!(output.contains("cannot reach the database"), "{output}");
    assert!(lost >= Duration::from_secs(5), "{lost:?}");
}
