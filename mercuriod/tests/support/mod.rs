//! Shared support for the tests that run `mercuriod` as a process and talk to it with other
//! programs (mosquitto's clients, Python's paho-mqtt): the daemon on a port-0 listener, child
//! processes whose output is read line by line with deadlines, and the rule for missing
//! prerequisites (skip with a reason, but fail under `CI=true`; ARCHITECTURE.md, "Where a test goes").
//!
//! Every child is killed when its guard drops, so a failing test leaves no process behind.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The daemon under test: the one cargo built for this package's tests, or `MERCURIOD_BIN`
/// when set (to test an installed or release binary).
pub fn mercuriod_bin() -> PathBuf {
    std::env::var_os("MERCURIOD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_mercuriod")))
}

/// How long a test waits for an expected event before failing.
pub const DEADLINE: Duration = Duration::from_secs(15);

/// Whether missing prerequisites are failures (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// The prerequisite rule (ARCHITECTURE.md, "Where a test goes"), in one place: `Ok(())` runs the test;
/// `Err(why)` prints why the test skips and returns false, or panics under `CI=true`.
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

/// Whether `program args` runs and exits (any status); the error says what is missing.
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

pub struct Output {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// `mosquitto_pub` and `mosquitto_sub` (Debian: mosquitto-clients), version 2 (for MQTT 5),
/// and coreutils' `stdbuf` (mosquitto_sub's output into a pipe is block-buffered).
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

/// `python3` with `paho-mqtt` 2.x (pip install 'paho-mqtt>=2,<3').
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

/// A child process whose standard output is read line by line by a thread; killed on drop.
pub struct Proc {
    pub name: String,
    child: Child,
    lines: Receiver<String>,
    /// Every line read so far, for failure messages.
    pub seen: Vec<String>,
    stderr: std::sync::Arc<Mutex<String>>,
}

impl Proc {
    /// Spawns `command` with stdout and stderr piped (stdin closed).
    pub fn spawn(name: &str, command: &mut Command) -> Proc {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = std::sync::Arc::new(Mutex::new(String::new()));
        let mut err_pipe = child.stderr.take().expect("stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Proc {
            name: name.to_string(),
            child,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote on standard error so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The next line of standard output, or `None` once it is closed. Panics after `wait`.
    pub fn next_line_within(&mut self, wait: Duration) -> Option<String> {
        match self.lines.recv_timeout(wait) {
            Ok(line) => {
                self.seen.push(line.clone());
                Some(line)
            }
            Err(RecvTimeoutError::Disconnected) => None,
            Err(RecvTimeoutError::Timeout) => panic!(
                "{}: no line within {wait:?}; output so far: {:#?}; stderr: {}",
                self.name,
                self.seen,
                self.stderr()
            ),
        }
    }

    /// Reads lines until one satisfies `pred` and returns it. Panics after [`DEADLINE`] or
    /// when the output ends first.
    pub fn wait_for(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_line_within(left) {
                Some(line) if pred(&line) => return line,
                Some(_) => {}
                None => panic!(
                    "{}: output ended before {what}; output: {:#?}; stderr: {}",
                    self.name,
                    self.seen,
                    self.stderr()
                ),
            }
        }
    }

    /// The next line that `keep` accepts (others are skipped, e.g. debug lines). Panics
    /// after [`DEADLINE`] or when the output ends.
    pub fn next_kept(&mut self, keep: impl Fn(&str) -> bool) -> String {
        self.wait_for("an output line", keep)
    }

    /// Sends `signal` (e.g. "TERM", "KILL") with kill(1).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {}", self.name);
    }

    /// Waits for the process to exit, at most `wait`; `None` if it did not.
    pub fn wait_exit_within(&mut self, wait: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            // Polling the exit status; not a synchronisation sleep.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the process to exit (panics after [`DEADLINE`]) and returns the rest of its
    /// standard output.
    pub fn finish(&mut self) -> (ExitStatus, Vec<String>) {
        let status = self.wait_exit_within(DEADLINE).unwrap_or_else(|| {
            panic!(
                "{} did not exit; output: {:#?}; stderr: {}",
                self.name,
                self.seen,
                self.stderr()
            )
        });
        let mut rest = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(DEADLINE) {
            self.seen.push(line.clone());
            rest.push(line);
        }
        (status, rest)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// A running `mercuriod`, with the address it listens on. Stopped on drop: SIGTERM, up to
/// 6 s to exit, then SIGKILL.
pub struct Daemon {
    pub proc: Proc,
    /// The first address the daemon reported listening on.
    pub addr: SocketAddr,
    /// Every address it reported.
    pub addrs: Vec<SocketAddr>,
    _dir: tempfile::TempDir,
    pub config_path: PathBuf,
}

/// The configuration of [`Daemon::start`]: one listener on 127.0.0.1 port 0, anonymous
/// clients allowed, plus `extra` (more TOML, e.g. a `[server]` table).
pub fn port0_config(extra: &str) -> String {
    format!(
        "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n{extra}"
    )
}

impl Daemon {
    /// Starts `mercuriod -c FILE` with [`port0_config`]`(extra)` and waits for its
    /// "listening on" line.
    pub fn start(extra: &str) -> Daemon {
        Daemon::start_with(&port0_config(extra), &[])
    }

    /// Starts `mercuriod -c FILE ARGS...` with `config` as the file.
    pub fn start_with(config: &str, args: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        let config_path = dir.path().join("mercuriod.toml");
        std::fs::write(&config_path, config).expect("write config");
        let mut command = Command::new(mercuriod_bin());
        command.arg("-c").arg(&config_path).args(args);
        Daemon::spawn(command, dir, config_path)
    }

    /// Starts `command` (a mercuriod) and waits for its listening lines.
    pub fn spawn(mut command: Command, dir: tempfile::TempDir, config_path: PathBuf) -> Daemon {
        // No colours in the log whatever the terminal; the daemon already checks for a tty.
        command.env("NO_COLOR", "1");
        let mut proc = Proc::spawn("mercuriod", &mut command);
        let line = proc.wait_for("the \"listening on\" line", |l| l.contains("listening on "));
        let mut addrs = vec![parse_listening(&line)];
        // Further listeners are logged right after the first one; the configurations of these
        // tests have one listener, so only the first is waited for.
        while let Ok(line) = proc.lines.try_recv() {
            proc.seen.push(line.clone());
            if line.contains("listening on ") {
                addrs.push(parse_listening(&line));
            }
        }
        Daemon {
            proc,
            addr: addrs[0],
            addrs,
            _dir: dir,
            config_path,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn config_dir(&self) -> &Path {
        self._dir.path()
    }

    /// SIGTERM, then waits up to `wait` for the exit status.
    pub fn terminate_within(&mut self, wait: Duration) -> Option<ExitStatus> {
        self.proc.signal("TERM");
        self.proc.wait_exit_within(wait)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.proc.child.try_wait() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(self.proc.child.id().to_string())
                .status();
            if self.proc.wait_exit_within(Duration::from_secs(6)).is_none() {
                let _ = self.proc.child.kill();
            }
        }
        // Proc's own drop reaps the child.
    }
}

/// The address of a "... listening on ADDR" log line.
pub fn parse_listening(line: &str) -> SocketAddr {
    let rest = &line[line.find("listening on ").expect("listening line") + 13..];
    let word = rest.split_whitespace().next().unwrap_or("");
    word.parse()
        .unwrap_or_else(|e| panic!("cannot parse the address in {line:?}: {e}"))
}
