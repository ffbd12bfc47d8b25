//! mercuriod and its security files as a process: SIGHUP reloads the ACL (a client whose
//! permissions shrank loses what it may no longer read, and stays connected); a malformed file
//! on SIGHUP keeps the old rules and logs the file and line; at start it exits with 78.
#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

const MERCURIOD: &str = env!("CARGO_BIN_EXE_mercuriod");
const DEADLINE: Duration = Duration::from_secs(20);

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn have(program: &str) -> bool {
    let found = Command::new(program)
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{program} is not installed (CI=true: a missing prerequisite is a failure)"
        );
        eprintln!("skipping: {program} is not installed");
    }
    found
}

/// Lines of a child's output, read on a thread.
fn lines(out: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for a line containing `what`; returns it with the lines skipped before it.
fn wait_for(rx: &Receiver<String>, what: &str) -> (String, Vec<String>) {
    let mut seen = Vec::new();
    loop {
        let line = rx
            .recv_timeout(DEADLINE)
            .unwrap_or_else(|_| panic!("no line with {what:?} in {seen:#?}"));
        if line.contains(what) {
            return (line, seen);
        }
        seen.push(line);
    }
}

fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill")
        .arg(sig)
        .arg(child.id().to_string())
        .status()
        .expect("run kill");
    assert!(st.success());
}

fn publish(port: &str, topic: &str, message: &str) {
    let st = Command::new("mosquitto_pub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            port,
            "-u",
            "u",
            "-t",
            topic,
            "-m",
            message,
            "-q",
            "1",
        ])
        .status()
        .expect("run mosquitto_pub");
    assert!(st.success());
}

#[test]
fn sighup_reloads_the_acl_file() {
    if !have("mosquitto_sub") || !have("mosquitto_pub") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "user u\ntopic readwrite a/#\ntopic readwrite b/#\n").unwrap();
    let config = dir.path().join("mercuriod.toml");
    std::fs::write(
        &config,
        format!(
            "[auth]\nallow_anonymous = true\nacl_file = \"{}\"\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n",
            acl.display()
        ),
    )
    .unwrap();
    let mut daemon = Killed(
        Command::new(MERCURIOD)
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn mercuriod"),
    );
    let log = lines(daemon.0.stdout.take().unwrap());
    let (line, _) = wait_for(&log, "listening on 127.0.0.1:");
    let port = line.rsplit(':').next().unwrap().trim().to_string();

    let mut sub = Killed(
        // Line-buffered: mosquitto_sub's debug lines are not flushed into a pipe otherwise.
        Command::new("stdbuf")
            .args([
                "-oL",
                "mosquitto_sub",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-u",
                "u",
                "-i",
                "reloaded",
                "-t",
                "a/#",
                "-t",
                "b/#",
                "-v",
                "-d",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn mosquitto_sub"),
    );
    let out = lines(sub.0.stdout.take().unwrap());
    wait_for(&out, "received SUBACK");
    publish(&port, "b/1", "before");
    wait_for(&out, "b/1 before");

    // A malformed file: logged with its line, the old rules stay.
    std::fs::write(&acl, "user u\ntopic readwrite a/#\nsubscribe b/#\n").unwrap();
    signal(&daemon.0, "-HUP");
    let (line, _) = wait_for(&log, &format!("{}:3: ", acl.display()));
    assert!(line.contains("unknown keyword"), "{line}");
    publish(&port, "b/2", "old rules");
    wait_for(&out, "b/2 old rules");

    // Permissions shrink: b/# may no longer be read.
    std::fs::write(&acl, "user u\ntopic readwrite a/#\ntopic write b/#\n").unwrap();
    signal(&daemon.0, "-HUP");
    wait_for(&log, "reloaded");
    publish(&port, "b/3", "new rules");
    publish(&port, "a/1", "kept");
    let (_, skipped) = wait_for(&out, "a/1 kept");
    assert!(
        !skipped.iter().any(|l| l.contains("b/3")),
        "b/3 delivered after the reload: {skipped:#?}"
    );

    signal(&daemon.0, "-TERM");
    let status = daemon.0.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

#[test]
fn malformed_password_file_exits_78_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let passwd = dir.path().join("passwd");
    std::fs::write(&passwd, "alice:$7$101$c2FsdA==$aGFzaA==\nbob:$5$nope\n").unwrap();
    let config = dir.path().join("mercuriod.toml");
    std::fs::write(
        &config,
        format!(
            "[auth]\npassword_file = \"{}\"\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n",
            passwd.display()
        ),
    )
    .unwrap();
    let out = Command::new(MERCURIOD)
        .arg("-c")
        .arg(&config)
        .stdout(Stdio::null())
        .output()
        .expect("run mercuriod");
    assert_eq!(out.status.code(), Some(78));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("{}:2: ", passwd.display())),
        "{stderr}"
    );
}
