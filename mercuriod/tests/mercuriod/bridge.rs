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
