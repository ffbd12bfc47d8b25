//! The PROXY protocol on listeners (`proxy_protocol`, `proxy_from`), with HAProxy in front
//! of mercuriod: `send-proxy-v2` and `send-proxy` give the broker HAProxy's client address,
//! which the broker logs and `client show` reports as the client's (each client binds its own loopback source address,
//! 127.0.0.5 or 127.0.0.6, to be told from HAProxy's 127.0.0.1); a header from outside
//! `proxy_from` is refused; a header that never comes is closed within `connect_timeout`.
#![cfg(unix)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use mercurio_testkit::{prerequisite, Daemon, Proc, DEADLINE};

/// HAProxy, found where Debian puts it or on the path.
fn haproxy() -> Option<String> {
    ["/usr/sbin/haproxy", "haproxy"]
        .into_iter()
        .find(|p| {
            std::process::Command::new(p)
                .arg("-v")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .map(str::to_string)
}

/// A free loopback port (bound, then let go, for HAProxy to bind).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("address")
        .port()
}

/// A CONNECT of MQTT 3.1.1 for `client_id`.
fn connect_packet(client_id: &str) -> Vec<u8> {
    let id = client_id.as_bytes();
    let mut b = vec![
        0x10,
        (12 + id.len()) as u8,
        0,
        4,
        b'M',
        b'Q',
        b'T',
        b'T',
        4,
        2,
        0,
        60,
    ];
    b.extend_from_slice(&(id.len() as u16).to_be_bytes());
    b.extend_from_slice(id);
    b
}

/// A TCP connection to `to` from `from` (a loopback address of its own).
fn connect_from(from: [u8; 4], to: SocketAddr) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let stream = rt.block_on(async {
        let s = tokio::net::TcpSocket::new_v4().expect("socket");
        s.bind(SocketAddr::from((from, 0)))
            .expect("bind the source");
        s.connect(to).await.expect("connect")
    });
    let stream = stream.into_std().expect("std stream");
    stream.set_nonblocking(false).expect("blocking");
    stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
    stream
}

/// Sends CONNECT and returns the CONNACK's 4 bytes, or `None` when the connection closes first.
fn mqtt_connect(s: &mut TcpStream, client_id: &str) -> Option<[u8; 4]> {
    s.write_all(&connect_packet(client_id)).ok()?;
    let mut ack = [0u8; 4];
    s.read_exact(&mut ack).ok().map(|_| ack)
}

/// How long until `s` is closed by the other side (end of stream or reset).
fn closed_after(s: &mut TcpStream, started: Instant) -> Duration {
    let mut buf = [0u8; 64];
    loop {
        match mercurio_testkit::uninterrupted(|| s.read(&mut buf)) {
            Ok(0) | Err(_) => return started.elapsed(),
            Ok(_) => {}
        }
    }
}

/// Waits until `port` of 127.0.0.1 accepts connections.
fn wait_accepting(port: u16) {
    let deadline = Instant::now() + DEADLINE;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "HAProxy does not listen on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn haproxy_in_front_gives_the_clients_address() {
    let Some(haproxy) = haproxy() else {
        prerequisite(
            "haproxy_in_front_gives_the_clients_address",
            Err("haproxy is not installed".into()),
        );
        return;
    };
    // 0: v2 from loopback; 1: v1; 2: v2, but only from 10.0.0.0/8 (HAProxy's 127.0.0.1 is
    // not); 3: optional.
    let mut d = Daemon::with(
        "[server]\nconnect_timeout = 2\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nproxy_protocol = \"v2\"\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nproxy_protocol = \"v1\"\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nproxy_protocol = \"v2\"\nproxy_from = [\"10.0.0.0/8\"]\n\n\
         [[listeners]]\nhost = \"127.0.0.1\"\nport = 0\nproxy_protocol = \"optional\"\n",
    )
    .start();
    let addrs = d.wait_listeners(5).to_vec();
    let (v2, v1, outside, optional) = (addrs[1], addrs[2], addrs[3], addrs[4]);
    let front: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = dir.path().join("haproxy.cfg");
    let mut text = String::from(
        "global\n  maxconn 100\n\ndefaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n\n",
    );
    for (i, (port, backend, send)) in [
        (front[0], v2, "send-proxy-v2"),
        (front[1], v1, "send-proxy"),
        (front[2], outside, "send-proxy-v2"),
        (front[3], optional, "send-proxy-v2"),
    ]
    .into_iter()
    .enumerate()
    {
        text.push_str(&format!(
            "listen l{i}\n  bind 127.0.0.1:{port}\n  server broker {backend} {send}\n\n"
        ));
    }
    std::fs::write(&cfg, text).expect("write haproxy.cfg");
    let mut hap = Proc::spawn_merged(
        "haproxy",
        std::process::Command::new(&haproxy)
            .arg("-db")
            .arg("-f")
            .arg(&cfg),
    );
    for &p in &front {
        wait_accepting(p);
    }

    // send-proxy-v2 and send-proxy: the broker sees the client's own address and port.
    for (i, (port, source, id)) in [
        (front[0], [127, 0, 0, 5], "through-v2"),
        (front[1], [127, 0, 0, 6], "through-v1"),
        (front[3], [127, 0, 0, 7], "through-optional"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = connect_from(source, SocketAddr::from(([127, 0, 0, 1], port)));
        let local = c.local_addr().expect("local address");
        assert_eq!(mqtt_connect(&mut c, id), Some([0x20, 2, 0, 0]), "{i}: {id}");
        let line = d.wait_line("client connected", |l| {
            l.contains("client connected") && l.contains(&format!("client_id={id}"))
        });
        assert!(
            line.contains(&format!("peer={local}")),
            "{id} from {local}: {line}"
        );
        // What `mercurioctl client show` prints: the client's, not HAProxy's.
        let shown = d.admin(&format!(
            r#"{{"command":"client.show","client_id":"{id}"}}"#
        ));
        assert_eq!(
            shown["result"]["address"],
            local.to_string(),
            "{id}: {shown}"
        );
    }
    // An optional listener serves a client without a header, under its own address.
    let mut plain = TcpStream::connect(optional).expect("connect");
    plain.set_read_timeout(Some(DEADLINE)).unwrap();
    let local = plain.local_addr().unwrap();
    assert_eq!(mqtt_connect(&mut plain, "no-header"), Some([0x20, 2, 0, 0]));
    let line = d.wait_line("client connected", |l| {
        l.contains("client connected") && l.contains("client_id=no-header")
    });
    assert!(line.contains(&format!("peer={local}")), "{line}");
    let shown = d.admin(r#"{"command":"client.show","client_id":"no-header"}"#);
    assert_eq!(shown["result"]["address"], local.to_string(), "{shown}");

    // From a peer outside proxy_from: closed, no CONNACK, a warning (the first one was
    // logged for the check that HAProxy listens, which connected through it too; the
    // warnings are limited to one per listener every 10 s).
    let mut refused = connect_from([127, 0, 0, 8], SocketAddr::from(([127, 0, 0, 1], front[2])));
    assert_eq!(mqtt_connect(&mut refused, "outside"), None);
    d.wait_logged("refused", |l| {
        l.contains("WARN") && l.contains("not in proxy_from") && l.contains(&outside.to_string())
    });

    // Straight to a v2 listener without a header: closed, no CONNACK.
    let mut direct = TcpStream::connect(v2).expect("connect");
    direct.set_read_timeout(Some(DEADLINE)).unwrap();
    assert_eq!(mqtt_connect(&mut direct, "direct"), None);

    // A header that never comes: closed within connect_timeout (2 s).
    let started = Instant::now();
    let mut silent = TcpStream::connect(v1).expect("connect");
    silent.set_read_timeout(Some(DEADLINE)).unwrap();
    let after = closed_after(&mut silent, started);
    assert!(
        after >= Duration::from_millis(1500) && after < Duration::from_secs(4),
        "closed after {after:?}"
    );
    // Warnings are limited per listener: one for the outside listener, one for the v2
    // listener's connection without a header; the silent v1 connection's is the first of
    // its listener.
    d.wait_logged("the silent connection's warning", |l| {
        l.contains("sent no PROXY header within connect_timeout")
    });
    let warnings = d.seen(|l| l.contains("PROXY protocol:"));
    assert_eq!(warnings.len(), 3, "{warnings:#?}");
    hap.signal(libc::SIGTERM);
    let _ = hap.wait_exit_within(DEADLINE);
}
