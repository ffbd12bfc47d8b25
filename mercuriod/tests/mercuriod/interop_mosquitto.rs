//! Interoperability with mosquitto's command-line clients (`mosquitto_pub`, `mosquitto_sub`,
//! Debian's mosquitto-clients 2.x) against the real daemon, in MQTT 3.1, 3.1.1 and 5.0: QoS
//! 0/1/2, retained messages and their deletion, wills, 5.0 properties, persistent sessions.
//!
//! Synchronisation: `mosquitto_sub -d` prints "Subscribed (mid: N): ..." once its SUBACK is in,
//! and every message is printed with `-F`; the tests wait for those lines, with deadlines
//! (`-W` bounds each client's life as well). Without mosquitto's clients the tests skip, or
//! fail under `CI=true`.
#![cfg(unix)]

use std::process::Command;

use mercurio_testkit::{mosquitto_clients, Daemon, Proc};

/// `-V` values.
const VERSIONS: [&str; 3] = ["mqttv31", "mqttv311", "mqttv5"];

/// Whether a `mosquitto_sub -d` line is a message (not a debug line of its own).
fn is_message(line: &str) -> bool {
    !line.starts_with("Client ") && !line.starts_with("Subscribed (mid")
}

/// `mosquitto_sub` on the daemon with `-V version -d -W 30` and `args`, not waited for.
fn spawn_sub(daemon: &Daemon, version: &str, args: &[&str]) -> Proc {
    // mosquitto_sub's output is block-buffered into a pipe; stdbuf makes it line-buffered.
    let mut command = Command::new("stdbuf");
    command
        .args(["-oL", "mosquitto_sub"])
        .args(["-h", "127.0.0.1", "-p", &daemon.port().to_string()])
        .args(["-V", version, "-d", "-W", "30"])
        .args(args);
    Proc::spawn(&format!("mosquitto_sub {version} {args:?}"), &mut command)
}

/// [`spawn_sub`], then waits until its subscriptions are acknowledged.
fn sub(daemon: &Daemon, version: &str, args: &[&str]) -> Proc {
    let mut proc = spawn_sub(daemon, version, args);
    proc.wait_for("the SUBACK", |l| l.starts_with("Subscribed (mid"));
    proc
}

/// The next message line of a `mosquitto_sub -d`.
fn next_message(proc: &mut Proc) -> String {
    proc.next_kept(is_message)
}

/// Runs `mosquitto_pub -V version` with `args` to completion (QoS 1/2: acknowledged) and
/// asserts success.
fn publish(daemon: &Daemon, version: &str, args: &[&str]) {
    let mut command = Command::new("mosquitto_pub");
    command
        .args(["-h", "127.0.0.1", "-p", &daemon.port().to_string()])
        .args(["-V", version])
        .args(args);
    let mut proc = Proc::spawn(&format!("mosquitto_pub {version} {args:?}"), &mut command);
    let (status, _) = proc.finish();
    assert!(
        status.success(),
        "mosquitto_pub {version} {args:?}: {status}: {}",
        proc.stderr()
    );
}

#[test]
fn qos_0_1_2_round_trip() {
    if !mosquitto_clients("qos_0_1_2_round_trip") {
        return;
    }
    let daemon = Daemon::start("");
    for version in VERSIONS {
        let filter = format!("interop/{version}/qos/#");
        let mut s = sub(
            &daemon,
            version,
            &["-q", "2", "-t", &filter, "-F", "%q %r %t %p"],
        );
        for qos in ["0", "1", "2"] {
            let topic = format!("interop/{version}/qos/{qos}");
            let payload = format!("payload at qos {qos}");
            publish(&daemon, version, &["-q", qos, "-t", &topic, "-m", &payload]);
            assert_eq!(next_message(&mut s), format!("{qos} 0 {topic} {payload}"));
        }
        // A QoS 1 subscription gets QoS 2 messages at QoS 1.
        let mut s1 = sub(
            &daemon,
            version,
            &["-q", "1", "-t", &filter, "-F", "%q %t %p"],
        );
        let topic = format!("interop/{version}/qos/down");
        publish(&daemon, version, &["-q", "2", "-t", &topic, "-m", "down"]);
        assert_eq!(next_message(&mut s1), format!("1 {topic} down"));
        assert_eq!(next_message(&mut s), format!("2 0 {topic} down"));
    }
}

#[test]
fn large_payload_round_trip() {
    if !mosquitto_clients("large_payload_round_trip") {
        return;
    }
    let daemon = Daemon::start("");
    let file = daemon.dir().join("payload.bin");
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&file, &payload).unwrap();
    for version in VERSIONS {
        let topic = format!("interop/{version}/large");
        let mut s = sub(&daemon, version, &["-q", "1", "-t", &topic, "-F", "%l %x"]);
        publish(
            &daemon,
            version,
            &["-q", "1", "-t", &topic, "-f", file.to_str().unwrap()],
        );
        let line = next_message(&mut s);
        let (len, hex) = line.split_once(' ').expect("length and payload");
        assert_eq!(len, "300000");
        let expected: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        assert!(hex == expected, "payload differs ({version})");
    }
}

#[test]
fn retained_message_reaches_a_later_subscriber_and_is_deleted_with_an_empty_one() {
    if !mosquitto_clients("retained") {
        return;
    }
    let daemon = Daemon::start("");
    for version in VERSIONS {
        let topic = format!("interop/{version}/retained");
        publish(
            &daemon,
            version,
            &["-r", "-q", "1", "-t", &topic, "-m", "kept"],
        );
        // A later subscriber gets it with the retain flag...
        let mut later = spawn_sub(
            &daemon,
            version,
            &["-q", "1", "-t", &topic, "-F", "%r %q %t %p", "-C", "1"],
        );
        assert_eq!(next_message(&mut later), format!("1 1 {topic} kept"));
        assert!(later.finish().0.success());

        // ...a subscriber already there gets a retained publication without the flag.
        let mut live = sub(&daemon, version, &["-t", &topic, "-F", "%r %t %p"]);
        assert_eq!(next_message(&mut live), format!("1 {topic} kept"));
        publish(&daemon, version, &["-r", "-t", &topic, "-m", "replaced"]);
        assert_eq!(next_message(&mut live), format!("0 {topic} replaced"));

        // An empty retained message deletes it: a new subscriber gets nothing retained, so
        // the first message it sees is one published after its SUBACK.
        publish(&daemon, version, &["-r", "-n", "-t", &topic]);
        assert_eq!(next_message(&mut live), format!("0 {topic} "));
        let mut after = sub(&daemon, version, &["-t", &topic, "-F", "%r %t %p"]);
        publish(&daemon, version, &["-t", &topic, "-m", "marker"]);
        assert_eq!(next_message(&mut after), format!("0 {topic} marker"));
    }
}

#[test]
fn will_is_published_when_the_client_is_killed() {
    if !mosquitto_clients("will") {
        return;
    }
    let daemon = Daemon::start("");
    for version in VERSIONS {
        let will_topic = format!("interop/{version}/will");
        let mut watcher = sub(
            &daemon,
            version,
            &["-q", "1", "-t", &will_topic, "-F", "%q %t %p"],
        );

        // A clean DISCONNECT (-E: exit once subscribed) discards the will.
        let mut polite = spawn_sub(
            &daemon,
            version,
            &[
                "-t",
                "interop/nothing",
                "-E",
                "--will-topic",
                &will_topic,
                "--will-payload",
                "not sent",
            ],
        );
        assert!(polite.finish().0.success(), "{}", polite.stderr());

        // Killed without DISCONNECT: the will is published.
        let killed = sub(
            &daemon,
            version,
            &[
                "-t",
                "interop/nothing",
                "--will-topic",
                &will_topic,
                "--will-payload",
                "gone",
                "--will-qos",
                "1",
            ],
        );
        killed.signal(libc::SIGKILL);
        assert_eq!(next_message(&mut watcher), format!("1 {will_topic} gone"));
    }
}

#[test]
fn v5_properties_are_forwarded() {
    if !mosquitto_clients("v5_properties") {
        return;
    }
    let daemon = Daemon::start("");
    let mut s = sub(
        &daemon,
        "mqttv5",
        &[
            "-q",
            "1",
            "-t",
            "interop/v5/props",
            "-F",
            "%P|%C|%R|%D|%F|%E|%p",
        ],
    );
    publish(
        &daemon,
        "mqttv5",
        &[
            "-q",
            "1",
            "-t",
            "interop/v5/props",
            "-m",
            "with properties",
            "-D",
            "publish",
            "user-property",
            "k",
            "v",
            "-D",
            "publish",
            "user-property",
            "a",
            "b",
            "-D",
            "publish",
            "user-property",
            "k",
            "v2",
            "-D",
            "publish",
            "content-type",
            "text/plain",
            "-D",
            "publish",
            "response-topic",
            "interop/v5/reply",
            "-D",
            "publish",
            "correlation-data",
            "corr-42",
            "-D",
            "publish",
            "payload-format-indicator",
            "1",
            "-D",
            "publish",
            "message-expiry-interval",
            "3600",
        ],
    );
    let line = next_message(&mut s);
    let fields: Vec<&str> = line.split('|').collect();
    assert_eq!(fields.len(), 7, "{line}");
    // User properties unchanged and in order, duplicates included.
    assert_eq!(fields[0], "k:v a:b k:v2", "{line}");
    assert_eq!(fields[1], "text/plain", "{line}");
    assert_eq!(fields[2], "interop/v5/reply", "{line}");
    assert_eq!(fields[3], "corr-42", "{line}");
    assert_eq!(fields[4], "1", "{line}");
    // The expiry interval is forwarded as what is left of it.
    let expiry: u32 = fields[5].parse().unwrap_or_else(|_| panic!("{line}"));
    assert!((3590..=3600).contains(&expiry), "{line}");
    assert_eq!(fields[6], "with properties");

    // A 3.1.1 subscriber gets the same message without properties.
    let mut old = sub(
        &daemon,
        "mqttv311",
        &["-t", "interop/v5/props", "-F", "%t %p"],
    );
    publish(
        &daemon,
        "mqttv5",
        &[
            "-t",
            "interop/v5/props",
            "-m",
            "to 3.1.1",
            "-D",
            "publish",
            "user-property",
            "k",
            "v",
        ],
    );
    assert_eq!(next_message(&mut old), "interop/v5/props to 3.1.1");
    assert_eq!(next_message(&mut s), "k:v||||||to 3.1.1");
}

#[test]
fn persistent_session_receives_what_was_published_while_away() {
    if !mosquitto_clients("persistent_session") {
        return;
    }
    let daemon = Daemon::start("");
    for version in VERSIONS {
        let id = format!("persist-{version}");
        let topic = format!("interop/{version}/persist");
        // Subscribe with a persistent session (-c), then leave (-E: exit once subscribed).
        let mut first = spawn_sub(
            &daemon,
            version,
            &["-c", "-i", &id, "-q", "1", "-t", &topic, "-E"],
        );
        let (status, _) = first.finish();
        assert!(status.success(), "{}", first.stderr());

        for payload in ["away 1", "away 2", "away 3"] {
            publish(&daemon, version, &["-q", "1", "-t", &topic, "-m", payload]);
        }
        // A QoS 0 message to a QoS 1 subscription of an absent session: delivered at QoS 0
        // or dropped, never at a higher QoS; so only QoS 1 is checked here.

        let mut back = spawn_sub(
            &daemon,
            version,
            &[
                "-c", "-i", &id, "-q", "1", "-t", &topic, "-F", "%q %p", "-C", "3",
            ],
        );
        for payload in ["away 1", "away 2", "away 3"] {
            assert_eq!(next_message(&mut back), format!("1 {payload}"), "{version}");
        }
        assert!(back.finish().0.success(), "{}", back.stderr());

        // Clean up the session: a clean connection with the same id.
        let mut clean = spawn_sub(&daemon, version, &["-i", &id, "-t", &topic, "-E"]);
        assert!(clean.finish().0.success());
    }
}

#[test]
fn shared_subscription_delivers_each_message_to_one_member() {
    if !mosquitto_clients("shared_subscription") {
        return;
    }
    let daemon = Daemon::start("");
    for version in ["mqttv311", "mqttv5"] {
        let group = format!("$share/g/interop/{version}/shared");
        let mark = format!("interop/{version}/mark");
        let args = ["-q", "1", "-t", &group, "-t", &mark, "-F", "%t %p"];
        let mut a = sub(&daemon, version, &args);
        let mut b = sub(&daemon, version, &args);
        let topic = format!("interop/{version}/shared");
        for i in 0..10 {
            publish(
                &daemon,
                version,
                &["-q", "1", "-t", &topic, "-m", &format!("m{i}")],
            );
        }
        publish(&daemon, version, &["-q", "1", "-t", &mark, "-m", "end"]);
        // Each member reads until the mark (not shared, so both get it); the shared messages
        // they saw before it must be the ten, each once.
        let mut got = Vec::new();
        for member in [&mut a, &mut b] {
            loop {
                let line = next_message(member);
                if line == format!("{mark} end") {
                    break;
                }
                got.push(line);
            }
        }
        got.sort();
        let mut expected: Vec<String> = (0..10).map(|i| format!("{topic} m{i}")).collect();
        expected.sort();
        assert_eq!(got, expected, "{version}");
    }
}

#[test]
fn v5_session_takeover_disconnects_the_first_client_with_0x8e() {
    if !mosquitto_clients("takeover") {
        return;
    }
    let daemon = Daemon::start("");
    let mut first = sub(
        &daemon,
        "mqttv5",
        &["-i", "takeover", "-t", "interop/takeover"],
    );
    let mut second = spawn_sub(
        &daemon,
        "mqttv5",
        &["-i", "takeover", "-t", "interop/takeover", "-E"],
    );
    assert!(second.finish().0.success(), "{}", second.stderr());
    // mosquitto_sub -d prints "Client takeover received DISCONNECT (142)".
    first.wait_for("DISCONNECT 0x8E (142)", |l| {
        l.contains("DISCONNECT") && l.contains("142")
    });
}

#[test]
fn v5_will_with_delay_and_properties() {
    if !mosquitto_clients("will_delay") {
        return;
    }
    let daemon = Daemon::start("");
    let mut watcher = sub(
        &daemon,
        "mqttv5",
        &["-q", "1", "-t", "interop/v5/will", "-F", "%P|%C|%p"],
    );
    // The will waits for its delay or the end of the session, whichever comes first
    // [MQTT-3.1.3.2-2]: the session must outlive the connection for the delay to count.
    let killed = sub(
        &daemon,
        "mqttv5",
        &[
            "-c",
            "-i",
            "will-delay",
            "-x",
            "60",
            "-t",
            "interop/nothing",
            "--will-topic",
            "interop/v5/will",
            "--will-payload",
            "delayed",
            "--will-qos",
            "1",
            "-D",
            "will",
            "will-delay-interval",
            "1",
            "-D",
            "will",
            "user-property",
            "wk",
            "wv",
            "-D",
            "will",
            "content-type",
            "text/plain",
        ],
    );
    let killed_at = std::time::Instant::now();
    killed.signal(libc::SIGKILL);
    assert_eq!(next_message(&mut watcher), "wk:wv|text/plain|delayed");
    assert!(
        killed_at.elapsed() >= std::time::Duration::from_millis(900),
        "the will came before its 1 s delay: {:?}",
        killed_at.elapsed()
    );

    // Without a session that outlives the connection, the will is not delayed: it is
    // published when the session ends, at once.
    let killed = sub(
        &daemon,
        "mqttv5",
        &[
            "-t",
            "interop/nothing",
            "--will-topic",
            "interop/v5/will",
            "--will-payload",
            "session ended",
            "--will-qos",
            "1",
            "-D",
            "will",
            "will-delay-interval",
            "30",
        ],
    );
    killed.signal(libc::SIGKILL);
    assert_eq!(next_message(&mut watcher), "||session ended");
}

#[test]
fn v5_subscription_identifier_and_client_maximum_packet_size() {
    if !mosquitto_clients("v5_subscription_options") {
        return;
    }
    let daemon = Daemon::start("");
    let mut s = sub(
        &daemon,
        "mqttv5",
        &[
            "-q",
            "1",
            "-t",
            "interop/v5/small/#",
            "-D",
            "subscribe",
            "subscription-identifier",
            "42",
            "-D",
            "connect",
            "maximum-packet-size",
            "200",
            "-F",
            "%S %t %l",
        ],
    );
    let big = "x".repeat(500);
    // Too large for the client: the broker must not send it (it drops it for this client).
    publish(
        &daemon,
        "mqttv5",
        &["-q", "1", "-t", "interop/v5/small/big", "-m", &big],
    );
    publish(
        &daemon,
        "mqttv5",
        &["-q", "1", "-t", "interop/v5/small/ok", "-m", "fits"],
    );
    assert_eq!(next_message(&mut s), "42 interop/v5/small/ok 4");
}

/// Runs `mosquitto_pub` expecting a failure; returns its standard error.
fn publish_fails(daemon: &Daemon, version: &str, args: &[&str]) -> String {
    let (success, stderr) = publish_status(daemon, version, args);
    assert!(!success, "mosquitto_pub {version} {args:?} succeeded");
    stderr
}

/// Runs `mosquitto_pub`; returns whether it exited 0, and its standard error.
fn publish_status(daemon: &Daemon, version: &str, args: &[&str]) -> (bool, String) {
    let mut command = Command::new("mosquitto_pub");
    command
        .args(["-h", "127.0.0.1", "-p", &daemon.port().to_string()])
        .args(["-V", version])
        .args(args);
    let mut proc = Proc::spawn(&format!("mosquitto_pub {version} {args:?}"), &mut command);
    let (status, _) = proc.finish();
    (status.success(), proc.stderr())
}

#[test]
fn server_limits_as_mosquitto_clients_see_them() {
    if !mosquitto_clients("server_limits") {
        return;
    }
    let daemon = Daemon::start(
        "[server]\nmax_qos = 1\nmax_packet_size = 1000\nclientid_prefixes = [\"ok-\"]\n",
    );
    // Client identifier prefixes: others are refused with "identifier rejected" (3.x) or
    // 0x85 Client Identifier not valid (5.0).
    for version in ["mqttv31", "mqttv311"] {
        let err = publish_fails(&daemon, version, &["-i", "bad", "-t", "t", "-m", "m"]);
        assert!(err.contains("identifier rejected"), "{version}: {err}");
    }
    let err = publish_fails(&daemon, "mqttv5", &["-i", "bad", "-t", "t", "-m", "m"]);
    assert!(err.contains("Client Identifier not valid"), "{err}");

    // max_qos = 1: a QoS 2 subscription is granted QoS 1; a 5.0 client is told and refuses
    // to publish at QoS 2 itself; a 3.1.1 client publishing at QoS 2 is disconnected.
    let mut s = sub(
        &daemon,
        "mqttv311",
        &[
            "-i",
            "ok-sub",
            "-q",
            "2",
            "-t",
            "interop/limits/#",
            "-F",
            "%q %t %l",
        ],
    );
    assert!(
        s.seen.iter().any(|l| l == "Subscribed (mid: 1): 1"),
        "granted QoS 1: {:#?}",
        s.seen
    );
    // (mosquitto_pub 2.0.11 reports this on stderr but exits 0.)
    let (_, err) = publish_status(
        &daemon,
        "mqttv5",
        &["-i", "ok-5", "-q", "2", "-t", "interop/limits/q", "-m", "m"],
    );
    assert!(err.contains("QoS not supported"), "{err}");
    let err = publish_fails(
        &daemon,
        "mqttv311",
        &[
            "-i",
            "ok-311",
            "-q",
            "2",
            "-t",
            "interop/limits/q",
            "-m",
            "m",
        ],
    );
    assert!(err.contains("connection was lost"), "{err}");

    // max_packet_size = 1000: a 3.1.1 client sending more is disconnected; a 5.0 client is
    // told the limit in CONNACK and does not send it.
    let big = daemon.dir().join("big.txt");
    std::fs::write(&big, "a".repeat(5000)).unwrap();
    let big = big.to_str().unwrap();
    let err = publish_fails(
        &daemon,
        "mqttv311",
        &[
            "-i",
            "ok-big",
            "-q",
            "1",
            "-t",
            "interop/limits/big",
            "-f",
            big,
        ],
    );
    assert!(err.contains("connection was lost"), "{err}");
    publish(
        &daemon,
        "mqttv5",
        &[
            "-i",
            "ok-big5",
            "-q",
            "1",
            "-t",
            "interop/limits/big",
            "-f",
            big,
        ],
    );
    publish(
        &daemon,
        "mqttv5",
        &[
            "-i",
            "ok-small",
            "-q",
            "1",
            "-t",
            "interop/limits/small",
            "-m",
            "fits",
        ],
    );
    // Only what was accepted reaches the subscriber.
    assert_eq!(next_message(&mut s), "1 interop/limits/small 4");
}

/// A persistent subscriber that stops reading (SIGSTOP) and then dies (SIGKILL) without
/// acknowledging gets the unacknowledged messages again when it comes back, in order, at
/// their QoS (the broker may have sent them already: then they come with DUP set).
#[test]
fn unacknowledged_messages_are_delivered_again_after_a_crash() {
    if !mosquitto_clients("redelivery") {
        return;
    }
    let daemon = Daemon::start("");
    for version in VERSIONS {
        for qos in ["1", "2"] {
            let id = format!("redeliver-{version}-{qos}");
            let topic = format!("interop/{version}/redeliver/{qos}");
            let frozen = sub(
                &daemon,
                version,
                &["-c", "-i", &id, "-q", qos, "-t", &topic],
            );
            frozen.signal(libc::SIGSTOP);
            for payload in ["a", "b", "c"] {
                publish(&daemon, version, &["-q", qos, "-t", &topic, "-m", payload]);
            }
            frozen.signal(libc::SIGKILL);
            drop(frozen);

            let mut back = spawn_sub(
                &daemon,
                version,
                &[
                    "-c", "-i", &id, "-q", qos, "-t", &topic, "-F", "%q %p", "-C", "3",
                ],
            );
            for payload in ["a", "b", "c"] {
                assert_eq!(
                    next_message(&mut back),
                    format!("{qos} {payload}"),
                    "{version} QoS {qos}"
                );
            }
            assert!(back.finish().0.success(), "{}", back.stderr());
            let mut clean = spawn_sub(&daemon, version, &["-i", &id, "-t", &topic, "-E"]);
            assert!(clean.finish().0.success());
        }
    }
}

/// `mosquitto_pub -l` sends a burst of QoS 0 messages (one per line) as fast as it can; a
/// subscriber that keeps up gets every one of them. (The broker once routed a whole read
/// buffer of PUBLISH packets before letting the subscriber's writer run, so the subscriber's
/// queue reached max_queued_qos0_messages and most of the burst was dropped.)
#[test]
fn qos0_burst_reaches_a_subscriber_that_keeps_up() {
    if !mosquitto_clients("qos0_burst") {
        return;
    }
    const N: usize = 5000;
    let daemon = Daemon::start("");
    for version in ["mqttv311", "mqttv5"] {
        let topic = format!("interop/{version}/burst");
        let mut s = sub(&daemon, version, &["-t", &topic, "-F", "%p"]);
        let mut publisher = Proc::spawn(
            "seq | mosquitto_pub -l",
            Command::new("sh").arg("-c").arg(format!(
                "seq 1 {N} | mosquitto_pub -h 127.0.0.1 -p {} -V {version} -q 0 -t {topic} -l",
                daemon.port()
            )),
        );
        assert!(publisher.finish().0.success(), "{}", publisher.stderr());
        for i in 1..=N {
            assert_eq!(
                next_message(&mut s),
                i.to_string(),
                "{version}: message {i}"
            );
        }
    }
}

/// SIGTERM: a mosquitto_sub in 5.0 is told the server is shutting down (0x8B = 139), and the
/// daemon exits 0 within 6 s with mosquitto clients connected in every version.
#[test]
fn sigterm_is_seen_by_mosquitto_clients() {
    if !mosquitto_clients("sigterm") {
        return;
    }
    let mut daemon = Daemon::start("");
    let mut subs: Vec<Proc> = VERSIONS
        .iter()
        .map(|v| {
            sub(
                &daemon,
                v,
                &["-c", "-i", &format!("stop-{v}"), "-t", "interop/stop"],
            )
        })
        .collect();
    daemon.signal(libc::SIGTERM);
    let status = daemon
        .wait_exit_within(std::time::Duration::from_secs(6))
        .expect("mercuriod exits within 6 s of SIGTERM");
    assert_eq!(status.code(), Some(0), "{}", daemon.proc.stderr());
    subs[2].wait_for("DISCONNECT 0x8B (139)", |l| {
        l.contains("DISCONNECT") && l.contains("139")
    });
}

/// `mercuriod -p PORT` without a file, as `mosquitto -p PORT`: the loopback on that port (0: a
/// free one, logged), anonymous clients allowed.
#[test]
fn port_option_without_a_file() {
    if !mosquitto_clients("port_option_without_a_file") {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let runtime = dir.path().to_path_buf();
    let daemon = Daemon::without_file()
        .in_dir(dir)
        .args(["-p", "0"])
        .env("RUNTIME_DIRECTORY", runtime)
        .start();
    assert!(daemon.addr().ip().is_loopback(), "{}", daemon.addr());
    assert_eq!(daemon.addrs().len(), 1);
    let mut s = sub(&daemon, "mqttv311", &["-t", "p/#", "-F", "%t %p"]);
    publish(
        &daemon,
        "mqttv311",
        &["-t", "p/1", "-m", "on the given port"],
    );
    assert_eq!(next_message(&mut s), "p/1 on the given port");
}
