//! mercuriod as a process: started from a configuration, ready when it logs where it listens.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::OnceLock;
use std::time::Duration;

use crate::{Proc, DEADLINE};

/// The daemon under test: `MERCURIOD_BIN` when set (to test an installed or release binary),
/// else `mercuriod` in the target directory of the running test (`target/<profile>/`), which
/// cargo builds for mercuriod's own tests; it is built here when missing (as for
/// `cargo test -p mercurioctl`).
pub fn mercuriod_bin() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(bin) = std::env::var_os("MERCURIOD_BIN") {
            return PathBuf::from(bin);
        }
        // The test binary is target/<profile>/deps/NAME-HASH.
        let test = std::env::current_exe().expect("the test's own path");
        let dir = test
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps");
        let exe = dir.join("mercuriod");
        if !exe.exists() {
            let target = dir.parent().expect("target root");
            let mut build = Command::new(env!("CARGO"));
            build
                .args(["build", "-p", "mercuriod", "--target-dir"])
                .arg(target)
                .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
            if dir.file_name().is_some_and(|n| n == "release") {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo build -p mercuriod");
            assert!(status.success(), "cargo build -p mercuriod failed");
        }
        exe
    })
    .clone()
}

/// The configuration of [`Daemon::start`]: anonymous clients on 127.0.0.1 port 0, the admin
/// socket at `socket`, then `extra` (sections other than `[auth]`, `[[listeners]]` and
/// `[admin]`).
pub fn config_text(socket: &Path, extra: &str) -> String {
    format!(
        "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
         [admin]\nsocket = {:?}\n\n{extra}",
        socket.display().to_string()
    )
}

/// How to start a mercuriod: made by [`Daemon::with`], [`Daemon::with_config`],
/// [`Daemon::with_file`] or [`Daemon::without_file`], then [`Launch::spawn`] or
/// [`Launch::start`].
pub struct Launch {
    dir: tempfile::TempDir,
    config: PathBuf,
    /// The file's text to write at `config`; `None`: the file exists (or none is wanted).
    text: Option<String>,
    use_file: bool,
    socket: PathBuf,
    exe: Option<PathBuf>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
}

impl Launch {
    fn new(use_file: bool) -> Launch {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = dir.path().join("mercuriod.toml");
        let socket = dir.path().join("run").join("mercuriod.sock");
        Launch {
            dir,
            config,
            text: None,
            use_file,
            socket,
            exe: None,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Runs in `dir` (kept by the daemon, removed when it is dropped) instead of a new
    /// temporary directory; the configuration file is written there.
    pub fn in_dir(mut self, dir: tempfile::TempDir) -> Launch {
        if self.config.starts_with(self.dir.path()) {
            self.config = dir.path().join("mercuriod.toml");
        }
        if self.socket.starts_with(self.dir.path()) {
            self.socket = dir.path().join("run").join("mercuriod.sock");
        }
        self.dir = dir;
        self
    }

    /// The admin socket the configuration names (for [`Daemon::admin`]).
    pub fn socket(mut self, socket: impl Into<PathBuf>) -> Launch {
        self.socket = socket.into();
        self
    }

    /// Runs `exe` (e.g. a wrapper script that execs [`mercuriod_bin`]) instead of mercuriod.
    pub fn exe(mut self, exe: impl Into<PathBuf>) -> Launch {
        self.exe = Some(exe.into());
        self
    }

    /// One more command line argument.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Launch {
        self.args.push(arg.into());
        self
    }

    /// More command line arguments.
    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Launch {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// An environment variable for the daemon.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Launch {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Starts the process and returns at once (for a test that waits for something else
    /// than readiness, e.g. a refusal or an exit).
    pub fn spawn(self) -> Daemon {
        if let Some(text) = &self.text {
            if let Some(parent) = self.config.parent() {
                std::fs::create_dir_all(parent).expect("config dir");
            }
            std::fs::write(&self.config, text).expect("write config");
        }
        let mut command = Command::new(self.exe.unwrap_or_else(mercuriod_bin));
        if self.use_file {
            command.arg("-c").arg(&self.config);
        }
        command
            .args(&self.args)
            // Whatever runs the tests: no systemd, no colours.
            .env_remove("JOURNAL_STREAM")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("RUNTIME_DIRECTORY")
            .env("NO_COLOR", "1");
        for (k, v) in &self.env {
            command.env(k, v);
        }
        Daemon {
            proc: Proc::spawn_merged("mercuriod", &mut command),
            addrs: Vec::new(),
            config: self.config,
            socket: self.socket,
            dir: self.dir,
        }
    }

    /// Starts the process and waits until it is ready: its first "listening on" line
    /// (panics after [`DEADLINE`], or when it exits first, showing its log).
    pub fn start(self) -> Daemon {
        let mut daemon = self.spawn();
        daemon.wait_ready();
        daemon
    }
}

/// A running mercuriod.
///
/// Its log (standard output and standard error, line by line) is kept in `log()`, and is
/// printed when a test fails while it runs. Dropping it kills the process (SIGKILL); stop it
/// with [`Daemon::stop`] to check how it exits.
pub struct Daemon {
    /// The process (its lines are the log).
    pub proc: Proc,
    addrs: Vec<SocketAddr>,
    /// The configuration file (written for [`Daemon::with`] and [`Daemon::with_config`]).
    pub config: PathBuf,
    /// The admin socket.
    pub socket: PathBuf,
    dir: tempfile::TempDir,
}

impl Daemon {
    /// A daemon with [`config_text`]`(socket, extra)` in a new temporary directory.
    pub fn with(extra: &str) -> Launch {
        let mut launch = Launch::new(true);
        launch.text = Some(config_text(&launch.socket, extra));
        launch
    }

    /// A daemon with `text` as its configuration file, in a new temporary directory (or the
    /// one given with [`Launch::in_dir`]).
    pub fn with_config(text: &str) -> Launch {
        let mut launch = Launch::new(true);
        launch.text = Some(text.to_string());
        launch
    }

    /// A daemon reading the existing file `config`.
    pub fn with_file(config: &Path) -> Launch {
        let mut launch = Launch::new(true);
        launch.config = config.to_path_buf();
        launch
    }

    /// A daemon started without `-c` (its defaults, or the arguments given).
    pub fn without_file() -> Launch {
        Launch::new(false)
    }

    /// `Daemon::with(extra).start()`: started and ready.
    pub fn start(extra: &str) -> Daemon {
        Daemon::with(extra).start()
    }

    /// Waits for the first "listening on ADDR" line, then takes the other listeners' lines
    /// logged right after it; returns the first address.
    pub fn wait_ready(&mut self) -> SocketAddr {
        self.wait_ready_within(DEADLINE)
    }

    /// [`Daemon::wait_ready`] with a deadline of its own (e.g. a standby's takeover).
    pub fn wait_ready_within(&mut self, wait: Duration) -> SocketAddr {
        let line = self.wait_line_within("listening on", wait, |l| l.contains("listening on "));
        self.addrs.push(parse_listening(&line));
        let after = self.proc.seen.len();
        self.proc.read_available();
        let more: Vec<SocketAddr> = self.proc.seen[after..]
            .iter()
            .filter(|l| l.contains("listening on "))
            .map(|l| parse_listening(l))
            .collect();
        self.addrs.extend(more);
        self.addrs[0]
    }

    /// Waits until `n` listening addresses are logged (after [`Daemon::wait_ready`]) and
    /// returns them.
    pub fn wait_listeners(&mut self, n: usize) -> &[SocketAddr] {
        while self.addrs.len() < n {
            let line = self.wait_line("one more listening line", |l| l.contains("listening on "));
            self.addrs.push(parse_listening(&line));
        }
        &self.addrs
    }

    /// [`Daemon::wait_ready`], returning the first listener's port.
    pub fn wait_listening(&mut self) -> u16 {
        self.wait_ready().port()
    }

    /// The first listener's address (after [`Daemon::wait_ready`] or [`Launch::start`]).
    pub fn addr(&self) -> SocketAddr {
        *self.addrs.first().expect("the daemon is not ready yet")
    }

    /// The first listener's port.
    pub fn port(&self) -> u16 {
        self.addr().port()
    }

    /// Every listening address logged so far.
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.proc.id()
    }

    /// Whether the process is still running (it is reaped if it has exited).
    pub fn is_running(&mut self) -> bool {
        self.proc.child.try_wait().expect("try_wait").is_none()
    }

    /// The daemon's directory (its configuration, its admin socket, files a test adds).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Waits for a log line that satisfies `pred` and returns it; panics after [`DEADLINE`]
    /// naming `what`, with the log.
    pub fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        self.proc.wait_for(what, pred)
    }

    /// The first log line that satisfies `pred`, whether already read (by
    /// [`Daemon::wait_ready`], say, which reads what follows the "listening on" line) or still
    /// to come; panics after [`DEADLINE`] naming `what`. For an event that may be logged right
    /// at start, where [`Daemon::wait_line`] (which waits for a new line) could miss it.
    pub fn wait_logged(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        match self.proc.seen.iter().find(|l| pred(l)) {
            Some(line) => line.clone(),
            None => self.proc.wait_for(what, pred),
        }
    }

    /// [`Daemon::wait_line`] with a deadline of its own.
    pub fn wait_line_within(
        &mut self,
        what: &str,
        wait: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        self.proc.wait_for_within(what, wait, pred)
    }

    /// The log lines read until now (taking those already there) that satisfy `pred`.
    pub fn seen(&mut self, pred: impl Fn(&str) -> bool) -> Vec<String> {
        self.proc.read_available();
        self.proc.seen.iter().filter(|l| pred(l)).cloned().collect()
    }

    /// Every log line read so far.
    pub fn log(&self) -> &[String] {
        &self.proc.seen
    }

    /// What the daemon wrote on standard error.
    pub fn stderr(&self) -> String {
        self.proc.stderr()
    }

    /// Sends one admin request line, returns the answer.
    pub fn admin(&self, request: &str) -> serde_json::Value {
        admin(&self.socket, request)
    }

    /// Sends `signal` (`libc::SIGHUP`, ...).
    pub fn signal(&self, signal: i32) {
        self.proc.signal(signal);
    }

    /// Waits for the process to exit (panics after [`DEADLINE`]) and returns its status
    /// code (`None`: killed by a signal).
    pub fn wait_exit(&mut self) -> Option<i32> {
        match self.proc.wait_exit_within(DEADLINE) {
            Some(status) => status.code(),
            None => panic!("mercuriod did not exit; log: {:#?}", self.log()),
        }
    }

    /// Waits for the process to exit, at most `wait`; `None` if it did not.
    pub fn wait_exit_within(&mut self, wait: Duration) -> Option<ExitStatus> {
        self.proc.wait_exit_within(wait)
    }

    /// Sends `signal` and waits for the exit (panics after [`DEADLINE`]); its status code.
    pub fn stop(&mut self, signal: i32) -> Option<i32> {
        self.signal(signal);
        self.wait_exit()
    }

    /// Waits for the exit and returns its status and the rest of the log.
    pub fn finish(&mut self) -> (ExitStatus, Vec<String>) {
        self.proc.finish()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.proc.read_available();
            crate::skip_note(&format!(
                "mercuriod's log (config {}):\n{}\nstderr:\n{}",
                self.config.display(),
                self.proc.seen.join("\n"),
                self.proc.stderr()
            ));
        }
        // Proc's own drop kills and reaps the process.
    }
}

/// One request line on the admin socket at `path`, the answer parsed.
pub fn admin(path: &Path, request: &str) -> serde_json::Value {
    let stream = UnixStream::connect(path).expect("connect to the admin socket");
    stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
    (&stream)
        .write_all(format!("{request}\n").as_bytes())
        .expect("write request");
    let mut answer = String::new();
    BufReader::new(&stream)
        .read_line(&mut answer)
        .expect("read answer");
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("answer {answer:?}: {e}"))
}

/// The address of a "... listening on ADDR" log line.
pub fn parse_listening(line: &str) -> SocketAddr {
    let at = line.find("listening on ").expect("a listening line") + 13;
    let word: String = line[at..]
        .chars()
        .take_while(|c| !c.is_whitespace())
        .collect();
    word.parse()
        .unwrap_or_else(|e| panic!("cannot parse the address in {line:?}: {e}"))
}
