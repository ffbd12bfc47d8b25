//! A child process whose output a test reads line by line, with deadlines.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::DEADLINE;

/// A child process; killed (SIGKILL) and reaped when dropped, so a failing test leaves no
/// process behind.
///
/// Standard output is read line by line ([`Proc::wait_for`], [`Proc::next_line_within`]);
/// standard error is collected ([`Proc::stderr`]) and, for [`Proc::spawn_merged`], also read
/// as lines with standard output (a daemon's log may be on either).
pub struct Proc {
    /// The name failure messages use.
    pub name: String,
    pub(crate) child: Child,
    lines: Receiver<String>,
    /// Every line read so far, for assertions and failure messages.
    pub seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<JoinHandle<()>>,
}

fn forward_lines(out: impl Read + Send + 'static, tx: Sender<String>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    })
}

impl Proc {
    /// Spawns `command` with standard input closed and its output piped; the lines are those
    /// of standard output.
    pub fn spawn(name: &str, command: &mut Command) -> Proc {
        Proc::start(name, command, false)
    }

    /// As [`Proc::spawn`], the lines being those of standard output and standard error
    /// interleaved as they come.
    pub fn spawn_merged(name: &str, command: &mut Command) -> Proc {
        Proc::start(name, command, true)
    }

    fn start(name: &str, command: &mut Command, merged: bool) -> Proc {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let (tx, lines) = mpsc::channel();
        forward_lines(child.stdout.take().expect("stdout"), tx.clone());
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        let err_pipe = child.stderr.take().expect("stderr");
        let stderr_reader = std::thread::spawn(move || {
            for line in BufReader::new(err_pipe).lines().map_while(Result::ok) {
                {
                    let mut text = sink.lock().unwrap_or_else(|e| e.into_inner());
                    text.push_str(&line);
                    text.push('\n');
                }
                if merged && tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            name: name.to_string(),
            child,
            lines,
            seen: Vec::new(),
            stderr,
            stderr_reader: Some(stderr_reader),
        }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote on standard error so far (all of it once it has exited and
    /// [`Proc::wait_exit_within`] or [`Proc::finish`] returned).
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The next line, or `None` once the output is closed. Panics after `wait`.
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

    /// Reads lines until one satisfies `pred` and returns it. Panics after `wait` or when the
    /// output ends first, naming `what`.
    pub fn wait_for_within(
        &mut self,
        what: &str,
        wait: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{}: no line {what} within {wait:?}; output: {:#?}; stderr: {}",
                    self.name,
                    self.seen,
                    self.stderr()
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "{}: output ended before {what}; output: {:#?}; stderr: {}",
                    self.name,
                    self.seen,
                    self.stderr()
                ),
            }
        }
    }

    /// [`Proc::wait_for_within`] [`DEADLINE`].
    pub fn wait_for(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        self.wait_for_within(what, DEADLINE, pred)
    }

    /// The next line that `keep` accepts (others are skipped, e.g. debug lines). Panics
    /// after [`DEADLINE`] or when the output ends.
    pub fn next_kept(&mut self, keep: impl Fn(&str) -> bool) -> String {
        self.wait_for("an output line", keep)
    }

    /// Takes the lines already there without waiting.
    pub fn read_available(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
    }

    /// Sends `signal` (`libc::SIGTERM`, ...) to the process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid; it has not been reaped while `self` lives
        // (a reaped child is only waited for by the methods that end with it).
        let r = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(
            r,
            0,
            "kill {} with {signal}: {}",
            self.name,
            std::io::Error::last_os_error()
        );
    }

    /// Waits for the process to exit, at most `wait`; `None` if it did not.
    pub fn wait_exit_within(&mut self, wait: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                if let Some(reader) = self.stderr_reader.take() {
                    let _ = reader.join();
                }
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            // Polling the exit status; not a synchronisation sleep.
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the process to exit (panics after [`DEADLINE`]) and returns its status and
    /// the rest of its output lines.
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
