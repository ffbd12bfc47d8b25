//! Test support shared by the workspace's process-level tests (mercuriod's and mercurioctl's
//! `tests/`): one way to run each kind of thing a test needs.
//!
//! - [`Daemon`]: mercuriod as a process, started from a configuration, ready when it logs its
//!   listening address, with its ports, its admin socket, its log (printed when the test fails)
//!   and its stop.
//! - [`Mosquitto`]: mosquitto on a free port with a configuration of its own.
//! - [`Proc`]: any other program (mosquitto, mosquitto_sub, python3 with paho), its output read
//!   line by line with deadlines.
//! - [`Client`]: a blocking MQTT client on the broker's codec; [`Mqtt`]: a few packets written
//!   by hand, for tests that check bytes.
//! - [`http`]: a blocking HTTP/1.1 client (admin API, console, metrics).
//! - [`prerequisite`]: the rule for a missing program or server: the test prints why it skips,
//!   and fails instead under `CI=true`.
//!
//! Every wait ends by [`DEADLINE`]; nothing sleeps to synchronise. The broker's own
//! integration tests (the root `tests/`) start brokers in process with their own helper.
#![allow(clippy::new_without_default)]

mod client;
mod daemon;
pub mod http;
mod mosquitto;
mod mqtt;
mod process;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use client::Client;
pub use daemon::{admin, config_text, mercuriod_bin, parse_listening, Daemon, Launch};
pub use mosquitto::Mosquitto;
pub use mqtt::{publish_packet, Mqtt};
pub use process::Proc;

/// How long a test waits for an expected event (a line, an exit, a packet, a condition)
/// before failing. Long enough for restarts and standby takeovers on a loaded machine.
pub const DEADLINE: Duration = Duration::from_secs(30);

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
/// the test; `Err(why)` prints why the test skips and returns false, or panics under `CI=true`.
pub fn prerequisite(test: &str, check: Result<(), String>) -> bool {
    match check {
        Ok(()) => true,
        Err(why) if in_ci() => panic!("{test}: prerequisite missing under CI=true: {why}"),
        Err(why) => {
            skip_note(&format!(
                "{test}: SKIPPED: {why} (with CI=true this is a failure)"
            ));
            false
        }
    }
}

/// Prints `note` on standard error past the test harness's capture (which would hide it for a
/// test that passes), so that `cargo test` shows why a test skipped.
pub fn skip_note(note: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{note}");
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
        runs("stdbuf", &["--version"])?;
        for program in ["mosquitto_pub", "mosquitto_sub"] {
            // `--help` exits 1 on mosquitto 2 but prints the version line.
            let out = runs(program, &["--help"])?;
            let text = out.stdout + &out.stderr;
            if !text.contains("version 2.") {
                return Err(format!(
                    "{program} is not version 2 (MQTT 5 needs it): {}",
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
        )?;
        if !out.success {
            return Err(format!(
                "python3 cannot import paho.mqtt: {}",
                out.stderr.lines().last().unwrap_or("")
            ));
        }
        let version = out.stdout.trim().to_string();
        if !version.starts_with("2.") {
            return Err(format!("paho-mqtt {version} is not 2.x"));
        }
        Ok(())
    })();
    prerequisite(test, check)
}
