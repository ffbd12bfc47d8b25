//! Interoperability with Python's paho-mqtt 2.x against the real daemon, in MQTT 3.1, 3.1.1 and
//! 5.0. The scenarios run in `tests/python/paho_interop.py` (connect, subscribe, QoS 0/1/2,
//! retained messages, wills on an abnormal disconnect, persistent sessions; in 5.0 properties,
//! subscription options and message expiry), which prints one JSON
//! line of passed and failed checks; this test asserts on it. Without python3 and paho-mqtt
//! the tests skip, or fail under `CI=true`.
#![cfg(unix)]

use std::path::Path;
use std::process::Command;

use mercurio_testkit::{paho, Daemon, Proc};

/// Checks every version runs.
const COMMON_CHECKS: &[&str] = &[
    "connect",
    "subscribe",
    "received qos 0",
    "received qos 1",
    "received qos 2",
    "retained delivered",
    "empty retained forwarded",
    "nothing retained after delete",
    "will published",
    "no will after DISCONNECT",
    "keep alive will",
    "keep alive honoured",
    "retained will, live",
    "retained will, later",
    "new session not present",
    "session present",
    "queued while away",
];

/// Checks only 5.0 runs.
const V5_CHECKS: &[&str] = &[
    "user properties",
    "response topic",
    "correlation data",
    "content type",
    "payload format indicator",
    "message expiry",
    "no local",
    "retain handling 1, new",
    "retain as published",
    "expired message dropped",
    "expiry counts down",
];

fn run(version: &str) {
    if !paho(&format!("paho_{version}")) {
        return;
    }
    let daemon = Daemon::start("");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/paho_interop.py");
    let mut command = Command::new("python3");
    command
        .arg("-u")
        .arg(&script)
        .arg(daemon.addr().ip().to_string())
        .arg(daemon.port().to_string())
        .arg(version);
    let mut proc = Proc::spawn(&format!("paho_interop.py {version}"), &mut command);
    let (status, _) = proc.finish();
    let stderr = proc.stderr();
    assert!(status.success(), "script exited {status}: {stderr}");
    let line = proc
        .seen
        .iter()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line: {:#?}; stderr: {stderr}", proc.seen))
        .clone();
    assert!(
        line.contains(&format!("\"version\": \"{version}\"")),
        "{line}"
    );
    assert!(line.ends_with("\"failed\": []}"), "failed checks: {line}");
    let expected = COMMON_CHECKS
        .iter()
        .chain(if version == "5" { V5_CHECKS } else { &[] });
    for check in expected {
        assert!(
            line.contains(&format!("\"{check}\"")),
            "check {check:?} did not run: {line}"
        );
    }
}

#[test]
fn paho_mqttv31() {
    run("31");
}

#[test]
fn paho_mqttv311() {
    run("311");
}

#[test]
fn paho_mqttv5() {
    run("5");
}
