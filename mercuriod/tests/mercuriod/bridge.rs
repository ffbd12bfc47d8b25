//! Bridges with the daemon: the outgoing queue lives in storage (SQLite here), so messages
//! acknowledged to their publisher while the remote was frozen reach it after mercuriod is
//! killed (SIGKILL) and started again. The remote is a real mosquitto; without mosquitto
//! and its clients the test skips (a failure under `CI=true`).
#![cfg(unix)]

use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

use mercurio_testkit::{mosquitto_clients, Daemon, Mosquitto, Proc};

#[test]
fn messages_queued_while_the_remote_is_frozen_survive_a_sigkill() {
    const TEST: &str = "messages_queued_while_the_remote_is_frozen_survive_a_sigkill";
    if !mosquitto_clients(TEST) {
        return;
    }
    let Some(remote) = Mosquitto::start(TEST, 0, "") else {
        return;
    };
    let port = remote.port;
    let dir = tempfile::tempdir().expect("temp dir");

    // The far subscriber: a persistent QoS 1 session on the remote, connected throughout.
    let mut far = {
        let mut command = Command::new("stdbuf");
        command
            .args(["-oL", "mosquitto_sub", "-h", "127.0.0.1"])
            .args(["-p", &port.to_string(), "-V", "mqttv311", "-d", "-W", "60"])
            .args([
                "-q", "1", "-c", "-i", "far", "-t", "site/q/#", "-F", "%t %p",
            ]);
        Proc::spawn("mosquitto_sub", &mut command)
    };
    far.wait_for("the SUBACK", |l| l.starts_with("Subscribed (mid"));

    let db = dir.path().join("mercurio.db");
    let config = format!(
        "[storage]\nbackend = \"sqlite\"\npath = \"{}\"\ndurable_ack = true\n\n\
         [[bridges]]\nname = \"cloud\"\naddresses = [\"127.0.0.1:{port}\"]\nkeepalive = 5\n\
         [[bridges.topics]]\npattern = \"q/#\"\ndirection = \"out\"\nqos = 1\nremote_prefix = \"site/\"\n",
        db.display()
    );
    let mut daemon = Daemon::start(&config);
    daemon.wait_logged("the bridge's connection", |l| {
        l.contains("bridge connected")
    });

    // The remote freezes: its socket stays open, nothing is answered.
    remote.proc.signal(libc::SIGSTOP);
    let mut publish = Command::new("sh");
    publish.arg("-c").arg(format!(
        "seq 0 199 | mosquitto_pub -h 127.0.0.1 -p {} -V mqttv311 -q 1 -t q/n -l",
        daemon.port()
    ));
    let mut publisher = Proc::spawn("mosquitto_pub", &mut publish);
    let (status, _) = publisher.finish();
    assert!(status.success(), "mosquitto_pub: {}", publisher.stderr());

    // Every message was acknowledged (durable_ack: stored first). Kill the broker, thaw the
    // remote, start the broker again on the same database.
    daemon.stop(libc::SIGKILL);
    remote.proc.signal(libc::SIGCONT);
    let mut daemon = Daemon::start(&config);
    daemon.wait_logged("the bridge's connection", |l| {
        l.contains("bridge connected")
    });

    let mut seen = BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.len() < 200 {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = far.next_line_within(left).expect("mosquitto_sub runs");
        if let Some(payload) = line.strip_prefix("site/q/n ") {
            seen.insert(payload.parse::<u32>().expect("a number"));
        }
    }
    assert_eq!(seen, (0..200).collect::<BTreeSet<u32>>());
    drop(daemon);
}

/// One MQTT packet read whole from a blocking stream: (first byte, body).
pub(crate) fn read_packet(s: &mut std::net::TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    use std::io::Read;
    let mut first = [0u8; 1];
    s.read_exact(&mut first)?;
    let mut len = 0usize;
    for i in 0..4 {
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        len |= usize::from(b[0] & 0x7F) << (7 * i);
        if b[0] & 0x80 == 0 {
            break;
        }
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body)?;
    Ok((first[0], body))
}

/// Reads packets until one whose first byte is `kind` (the packet type and flags) and whose
/// body starts with packet identifier `id`.
fn expect_packet(s: &mut std::net::TcpStream, kind: u8, id: u16) {
    loop {
        let (first, body) = read_packet(s).expect("a packet from the bridge");
        if first == kind && body.get(..2) == Some(&id.to_be_bytes()[..]) {
            return;
        }
    }
}

#[test]
fn a_qos2_message_from_the_remote_is_delivered_once_across_a_sigkill() {
    use std::io::Write;
    const TEST: &str = "a_qos2_message_from_the_remote_is_delivered_once_across_a_sigkill";
    if !mosquitto_clients(TEST) {
        return;
    }
    // A raw remote: QoS 2 PUBLISH d/x (identifier 7); after the broker's restart it sends it
    // again with DUP (as a remote does that did not get the PUBREC), then PUBREL.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    let (to_test, events) = std::sync::mpsc::channel::<&'static str>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let remote = std::thread::spawn(move || {
        const PUBLISH: [u8; 10] = [0x34, 8, 0, 3, b'd', b'/', b'x', 0, 7, b'm'];
        let (mut s, _) = listener.accept().expect("the first connection");
        read_packet(&mut s).expect("CONNECT");
        s.write_all(&[0x20, 2, 0, 0]).expect("CONNACK");
        go_rx.recv().expect("the test");
        s.write_all(&PUBLISH).expect("PUBLISH");
        expect_packet(&mut s, 0x50, 7);
        to_test.send("PUBREC").expect("the test");
        // The broker is killed; it connects again.
        let (mut s, _) = listener.accept().expect("the second connection");
        read_packet(&mut s).expect("CONNECT");
        s.write_all(&[0x20, 2, 1, 0])
            .expect("CONNACK, session present");
        go_rx.recv().expect("the test");
        let mut dup = PUBLISH;
        dup[0] |= 0x08;
        s.write_all(&dup).expect("PUBLISH again");
        expect_packet(&mut s, 0x50, 7);
        s.write_all(&[0x62, 2, 0, 7]).expect("PUBREL");
        expect_packet(&mut s, 0x70, 7);
        to_test.send("PUBCOMP").expect("the test");
    });

    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("mercurio.db");
    let config = format!(
        "[storage]\nbackend = \"sqlite\"\npath = \"{}\"\ndurable_ack = true\n\n\
         [[bridges]]\nname = \"in\"\naddresses = [\"127.0.0.1:{port}\"]\nnotifications = false\n\
         [[bridges.topics]]\npattern = \"d/#\"\ndirection = \"in\"\nqos = 2\n",
        db.display()
    );
    let subscriber = |port: u16| {
        let mut command = Command::new("stdbuf");
        command
            .args(["-oL", "mosquitto_sub", "-h", "127.0.0.1"])
            .args(["-p", &port.to_string(), "-V", "mqttv311", "-d"])
            .args(["-q", "2", "-t", "d/#", "-F", "%t %p"]);
        let mut sub = Proc::spawn("mosquitto_sub", &mut command);
        sub.wait_for("the SUBACK", |l| l.starts_with("Subscribed (mid"));
        sub
    };
    let is_message = |l: &str| l.starts_with("d/");

    let mut daemon = Daemon::start(&config);
    let mut sub = subscriber(daemon.port());
    go.send(()).expect("the remote");
    assert_eq!(events.recv().expect("the remote"), "PUBREC");
    assert_eq!(sub.next_kept(is_message), "d/x m");
    // Killed between PUBREC and PUBREL: the message and its identifier are stored
    // (durable_ack: before the PUBREC).
    daemon.stop(libc::SIGKILL);
    drop(sub);
    let daemon = Daemon::start(&config);
    let mut sub = subscriber(daemon.port());
    go.send(()).expect("the remote");
    assert_eq!(events.recv().expect("the remote"), "PUBCOMP");
    // Then a marker: any second copy of d/x would have come before it.
    let status = Command::new("mosquitto_pub")
        .args(["-h", "127.0.0.1", "-p", &daemon.port().to_string()])
        .args(["-V", "mqttv311", "-q", "1", "-t", "d/end", "-m", "end"])
        .status()
        .expect("mosquitto_pub runs");
    assert!(status.success());
    assert_eq!(sub.next_kept(is_message), "d/end end");
    remote.join().expect("the remote");
    drop(daemon);
}
