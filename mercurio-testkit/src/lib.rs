//! Test support shared by the workspace's process-level tests (mercuriod's and mercurioctl's
//! `tests/`): one way to run each kind of thing a test needs.
//!
//! - [`Daemon`]: mercuriod as a process, started from a configuration, ready when it logs its
//!   listening address, with its ports, its admin socket, its log (printed when the test fails)
//!   and its stop.
//! - [`Mosquitto`]: mosquitto on a free port with a configuration of its own.
//! - [`NatsServer`]: nats-server on free ports with its monitoring endpoint (cluster mode);
//!   [`NatsCluster`]: several of them routed to each other, with JetStream; [`ClusterNode`]:
//!   a mercuriod node on SQLite or PostgreSQL ([`NodeStorage`]), killed and started again.
//! - [`Proc`]: any other program (mosquitto, mosquitto_sub, python3 with paho), its output read
//!   line by line with deadlines.
//! - [`Client`]: a blocking MQTT client on the broker's codec; [`Mqtt`]: a few packets written
//!   by hand, for tests that check bytes.
//! - [`http`]: a blocking HTTP/1.1 client (admin API, console, metrics).
//! - [`prerequisite`]: the rule for a missing program or server: the test writes
//!   `SKIPPED <test>: <why>; install ...` past the harness's capture, so that a plain
//!   `cargo test` shows it, and fails instead under `CI=true` ([`program`],
//!   [`python_modules`], [`mosquitto_clients`], [`paho`] apply it; [`skip`] is for what no
//!   package mends).
//!
//! Every wait ends by [`DEADLINE`]; nothing sleeps to synchronise. The broker's own
//! integration tests (the root `tests/`) start brokers in process with their own helper.
#![allow(clippy::new_without_default)]

mod client;
mod daemon;
pub mod http;
mod mosquitto;
mod mqtt;
mod nats;
mod process;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use client::Client;
pub use daemon::{admin, config_text, mercuriod_bin, parse_listening, Daemon, Launch};
pub use mosquitto::Mosquitto;
pub use mqtt::{publish_packet, Mqtt};
pub use nats::{free_port, nats_server_bin, ClusterNode, NatsCluster, NatsServer, NodeStorage};
pub use process::Proc;

/// How long a test waits for an expected event (a line, an exit, a packet, a condition)
/// before failing. Long enough for restarts and standby takeovers on a loaded machine.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Runs a blocking socket call, again each time it fails with `Interrupted`, and returns its
/// first other result.
///
/// A blocking `read` or `recv` on a socket with a read timeout (`set_read_timeout`) fails with
/// `EINTR` when the process is stopped and resumed (a stop signal, a cgroup freeze), even
/// with no signal handler (signal(7), "Interruption of system calls ... by stop signals").
/// `read_exact`, `read_to_end` and `BufRead::read_line` retry it themselves; a plain `read`
/// or `recv` does not, and a test that reads that way would take the pause for a close.
pub fn uninterrupted<T>(mut call: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match call() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Waits until `cond` holds, checking every 20 ms, up to [`DEADLINE`]; panics naming `what`.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether missing prerequisites are failures (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// The prerequisite rule (ARCHITECTURE.md, "Where a test goes"), in one place: `Ok(())` runs
/// the test; `Err(why)` writes `SKIPPED <test>: <why> (CI=true makes this a failure)` past
/// the test harness's capture ([`skip_note`]) and returns false, or panics under `CI=true`.
/// `why` says what is missing and how to install it (the helpers below add the Debian or pip
/// command; README.md, "Tests", lists every prerequisite).
pub fn prerequisite(test: &str, check: Result<(), String>) -> bool {
    match check {
        Ok(()) => true,
        Err(why) if in_ci() => panic!("{test}: prerequisite missing under CI=true: {why}"),
        Err(why) => {
            skip_note(&skip_line(test, &why));
            false
        }
    }
}

/// The line [`prerequisite`] writes for a test that skips.
pub fn skip_line(test: &str, why: &str) -> String {
    format!("SKIPPED {test}: {why} (CI=true makes this a failure)")
}

/// A test that cannot run here for a reason no package mends (a port taken by another
/// program, no permission to mount a file system): writes `SKIPPED <test>: <why>` past the
/// harness's capture, under `CI=true` as well.
pub fn skip(test: &str, why: &str) {
    skip_note(&format!("SKIPPED {test}: {why}"));
}

/// Writes `note` straight to the process's standard error, past the test harness's capture
/// (libtest captures `print!`/`eprint!`, not a write to `std::io::stderr()`), so that a plain
/// `cargo test` shows it even for a test that passes.
pub fn skip_note(note: &str) {
    use std::io::Write;
    let mut line = note.to_string();
    line.push('\n');
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// The program `name` runs (`name --help`, any status), else `test` skips
/// ([`prerequisite`]) with `install`, the command that installs it
/// (`apt-get install mosquitto-clients`).
pub fn program(test: &str, name: &str, install: &str) -> bool {
    let check = runs(name, &["--help"])
        .map(drop)
        .map_err(|e| format!("{e}; install it: {install}"));
    prerequisite(test, check)
}

/// `python3` can import each of `modules` (`paho.mqtt.client`, `prometheus_client`), else
/// `test` skips ([`prerequisite`]) naming the pip packages to install.
pub fn python_modules(test: &str, modules: &[&str]) -> bool {
    let imports = modules
        .iter()
        .map(|m| format!("import {m}"))
        .collect::<Vec<_>>()
        .join("; ");
    let check = runs("python3", &["-c", &imports]).and_then(|out| {
        if out.success {
            return Ok(());
        }
        let packages: Vec<&str> = modules
            .iter()
            .map(|m| match m.split('.').next().unwrap_or(m) {
                "paho" => "'paho-mqtt>=2,<3'",
                "prometheus_client" => "prometheus-client",
                other => other,
            })
            .collect();
        Err(format!(
            "python3 cannot import {}: {}; install: python3 -m pip install {}",
            modules.join(", "),
            out.stderr.lines().last().unwrap_or(""),
            packages.join(" ")
        ))
    });
    prerequisite(test, check)
}

/// What a program printed, for the prerequisite checks.
struct Output {
    success: bool,
    stdout: String,
    stderr: String,
}

/// Runs `program args` to its end (any status); the error says what is missing.
fn runs(program: &str, args: &[&str]) -> Result<Output, String> {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map(|o| Output {
            success: o.status.success(),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        })
        .map_err(|e| format!("cannot run {program}: {e}"))
}

/// Whether `program` can be run at all (`program --help`, any status).
pub fn have(program: &str) -> bool {
    runs(program, &["--help"]).is_ok()
}

/// The mosquitto broker: `MOSQUITTO` when set (one that does not run counts as missing),
/// else `mosquitto` on the path, `/usr/sbin/mosquitto` or `/usr/local/sbin/mosquitto`;
/// `None` when none runs.
pub fn mosquitto_bin() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let candidates: Vec<PathBuf> = match std::env::var_os("MOSQUITTO") {
        Some(p) => vec![PathBuf::from(p)],
        None => [
            "mosquitto",
            "/usr/sbin/mosquitto",
            "/usr/local/sbin/mosquitto",
        ]
        .iter()
        .map(PathBuf::from)
        .collect(),
    };
    candidates.into_iter().find(|p| {
        Command::new(p)
            .arg("-h")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    })
}

/// `mosquitto_pub` and `mosquitto_sub` (Debian: mosquitto-clients), version 2 (for MQTT 5),
/// and coreutils' `stdbuf` (mosquitto_sub's output into a pipe is block-buffered). Applies
/// [`prerequisite`].
pub fn mosquitto_clients(test: &str) -> bool {
    let check = (|| {
        let install = "; install: apt-get install mosquitto-clients coreutils";
        runs("stdbuf", &["--version"]).map_err(|e| e + install)?;
        for program in ["mosquitto_pub", "mosquitto_sub"] {
            // `--help` exits 1 on mosquitto 2 but prints the version line.
            let out = runs(program, &["--help"]).map_err(|e| e + install)?;
            let text = out.stdout + &out.stderr;
            if !text.contains("version 2.") {
                return Err(format!(
                    "{program} is not version 2 (MQTT 5 needs it): {}; install mosquitto-clients 2",
                    text.lines().nth(1).unwrap_or("")
                ));
            }
        }
        Ok(())
    })();
    prerequisite(test, check)
}

/// `python3` with `paho-mqtt` 2.x (pip install 'paho-mqtt>=2,<3'). Applies [`prerequisite`].
pub fn paho(test: &str) -> bool {
    let check = (|| {
        let out = runs(
            "python3",
            &["-c", "import paho.mqtt; print(paho.mqtt.__version__)"],
        )
        .map_err(|e| e + "; install: apt-get install python3")?;
        if !out.success {
            return Err(format!(
                "python3 cannot import paho.mqtt: {}; install: python3 -m pip install 'paho-mqtt>=2,<3'",
                out.stderr.lines().last().unwrap_or("")
            ));
        }
        let version = out.stdout.trim().to_string();
        if !version.starts_with("2.") {
            return Err(format!(
                "paho-mqtt {version} is not 2.x; install: python3 -m pip install 'paho-mqtt>=2,<3'"
            ));
        }
        Ok(())
    })();
    prerequisite(test, check)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child of `a_skip_is_seen_in_plain_cargo_test_output`: the probe test skips.
    const PROBE: &str = "MERCURIO_TESTKIT_SKIP_PROBE";

    /// Skips through [`prerequisite`] when run as the probe; passes otherwise.
    #[test]
    fn skip_probe() {
        if std::env::var_os(PROBE).is_some() {
            assert!(!prerequisite(
                "skip_probe",
                Err("probe-tool is missing; install: apt-get install probe-tool".into())
            ));
        }
    }

    /// Runs this test binary's `skip_probe` as a plain `cargo test` runs it (output captured,
    /// no `--nocapture`), with `CI` as given; returns (passed, stdout, stderr).
    fn run_probe(ci: &str) -> (bool, String, String) {
        let exe = std::env::current_exe().expect("test binary");
        let out = Command::new(exe)
            .args(["--exact", "tests::skip_probe", "--test-threads", "1"])
            .env(PROBE, "1")
            .env("CI", ci)
            .output()
            .expect("run the test binary");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// A test that skips passes, and its SKIPPED line (test, cause, install command) is in the
    /// output although the harness captures the test's output; under `CI=true` it fails.
    #[test]
    fn a_skip_is_seen_in_plain_cargo_test_output() {
        let (passed, stdout, stderr) = run_probe("");
        assert!(passed, "{stdout}\n{stderr}");
        assert!(stdout.contains("test tests::skip_probe ... ok"), "{stdout}");
        assert!(
            stderr.contains(
                "SKIPPED skip_probe: probe-tool is missing; install: apt-get install probe-tool \
                 (CI=true makes this a failure)"
            ),
            "{stderr}"
        );

        let (passed, stdout, _) = run_probe("true");
        assert!(!passed, "{stdout}");
        assert!(
            stdout.contains("prerequisite missing under CI=true: probe-tool is missing"),
            "{stdout}"
        );
    }
}
