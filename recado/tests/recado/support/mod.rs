//! Support for recado's tests: the recado binary run as a process with deadlines, and the two
//! brokers it is tested against: Mercurio in process (the workspace's test broker, from
//! tests/common) and a real mosquitto spawned on a free port. A missing mosquitto skips with a
//! message, or fails under `CI=true`.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use mercurio::config::Config;
use mercurio::BrokerHandle;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdout, Command};

#[path = "../../../../tests/common/mod.rs"]
pub mod common;

use mercurio_testkit::Mosquitto;

/// How long a recado run may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// The exit codes recado documents.
pub mod exit {
    pub const OK: i32 = 0;
    pub const ERROR: i32 = 1;
    pub const USAGE: i32 = 2;
    pub const UNREACHABLE: i32 = 3;
    pub const CONNACK_REFUSED: i32 = 4;
    pub const TIMEOUT: i32 = 5;
    pub const REJECTED: i32 = 6;
}

/// What a finished recado run printed and its exit code.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Asserts exit code 0 and returns standard output.
    pub fn ok(&self) -> &str {
        assert_eq!(self.code, 0, "recado failed: {self:?}");
        &self.stdout
    }

    /// Standard output's lines.
    pub fn lines(&self) -> Vec<&str> {
        self.stdout.lines().collect()
    }
}

fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_recado"));
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

async fn finish(child: Child) -> Run {
    let out = tokio::time::timeout(DEADLINE, child.wait_with_output())
        .await
        .expect("recado finished before the deadline")
        .expect("recado ran");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `recado args...` to its end.
pub async fn recado(args: &[&str]) -> Run {
    finish(command(args).spawn().expect("spawn recado")).await
}

/// Runs `recado args...` with `input` on standard input.
pub async fn recado_with_input(args: &[&str], input: &[u8]) -> Run {
    use tokio::io::AsyncWriteExt;
    let mut child = command(args)
        .stdin(Stdio::piped())
        .spawn()
        .expect("spawn recado");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input).await.expect("write stdin");
    drop(stdin);
    finish(child).await
}

/// A `recado sub` (or `rr`) running in the background, started with -d so that the test
/// knows when its subscription is in place (the SUBACK line) without sleeping.
pub struct Background {
    child: Child,
    stderr: BufReader<ChildStderr>,
    seen: String,
    /// Standard output, once [`Background::wait_stdout`] read from it.
    stdout: Option<BufReader<ChildStdout>>,
    printed: String,
}

impl Background {
    /// Starts `recado args... -d` and waits for the SUBACK.
    pub async fn subscribed(args: &[&str]) -> Background {
        let mut all: Vec<&str> = args.to_vec();
        all.push("-d");
        let mut child = command(&all).spawn().expect("spawn recado");
        let stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let mut b = Background {
            child,
            stderr,
            seen: String::new(),
            stdout: None,
            printed: String::new(),
        };
        b.wait_stderr("received SUBACK").await;
        b
    }

    /// Waits for a line of standard error containing `needle`.
    pub async fn wait_stderr(&mut self, needle: &str) {
        let found = wait_line(&mut self.stderr, &mut self.seen, |l| l.contains(needle)).await;
        assert!(
            found,
            "recado printed no line with {needle:?}; standard error so far:\n{}",
            self.seen
        );
    }

    /// Waits for a line of standard output equal to `line` (without its newline), printed
    /// while recado runs.
    pub async fn wait_stdout(&mut self, line: &str) {
        let stdout = match self.stdout.as_mut() {
            Some(stdout) => stdout,
            None => self
                .stdout
                .insert(BufReader::new(self.child.stdout.take().expect("stdout"))),
        };
        let found = wait_line(stdout, &mut self.printed, |l| {
            l.trim_end_matches('\n') == line
        })
        .await;
        assert!(
            found,
            "recado did not print {line:?} while running; standard output so far:\n{}",
            self.printed
        );
    }

    /// Waits for the end of the run.
    pub async fn finish(mut self) -> Run {
        let mut rest = String::new();
        let mut stderr = self.stderr;
        let (status, out) = tokio::time::timeout(DEADLINE, async {
            let mut out = std::mem::take(&mut self.printed).into_bytes();
            let mut stdout: Box<dyn tokio::io::AsyncRead + Unpin + Send> = match self.stdout.take()
            {
                Some(read) => Box::new(read),
                None => Box::new(self.child.stdout.take().expect("stdout")),
            };
            let (_, _, status) = tokio::join!(
                stdout.read_to_end(&mut out),
                stderr.read_to_string(&mut rest),
                self.child.wait()
            );
            (status, out)
        })
        .await
        .expect("recado finished before the deadline");
        Run {
            code: status.expect("recado ran").code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out).into_owned(),
            stderr: self.seen + &rest,
        }
    }
}

/// Reads lines from `from` into `seen` until one `wanted` (true) or the end or the deadline
/// (false).
async fn wait_line<R: tokio::io::AsyncBufRead + Unpin>(
    from: &mut R,
    seen: &mut String,
    wanted: impl Fn(&str) -> bool,
) -> bool {
    let found = tokio::time::timeout(DEADLINE, async {
        let mut line = String::new();
        loop {
            line.clear();
            if from.read_line(&mut line).await.unwrap_or(0) == 0 {
                return false;
            }
            seen.push_str(&line);
            if wanted(&line) {
                return true;
            }
        }
    })
    .await;
    matches!(found, Ok(true))
}

/// A broker under test.
pub struct TestBroker {
    pub name: &'static str,
    pub addr: SocketAddr,
    mercurio: Option<BrokerHandle>,
    mosquitto: Option<Mosquitto>,
}

impl TestBroker {
    /// "-p PORT" as recado arguments (with -h 127.0.0.1).
    pub fn port(&self) -> String {
        self.addr.port().to_string()
    }

    /// The port of Mercurio's listener number `i` (in the configuration's order).
    pub fn listener_port(&self, i: usize) -> String {
        let h = self.mercurio.as_ref().expect("a Mercurio broker");
        h.local_addrs()[i].port().to_string()
    }

    /// Mercurio in process with `config`.
    pub async fn mercurio_with(config: Config) -> TestBroker {
        let (handle, addr) = common::start_with(config).await;
        TestBroker {
            name: "mercurio",
            addr,
            mercurio: Some(handle),
            mosquitto: None,
        }
    }

    /// Mercurio in process, one MQTT listener, anonymous clients allowed.
    pub async fn mercurio() -> TestBroker {
        Self::mercurio_with(common::test_config()).await
    }

    /// mosquitto on a free port with `extra` configuration lines (`{port}` is replaced by a
    /// second free port, e.g. for a WebSocket listener). `None` (the test skips) when
    /// mosquitto is not installed; a failure under CI=true.
    pub async fn mosquitto(test: &str, extra: &str) -> Option<(TestBroker, u16)> {
        let m = Mosquitto::start(&format!("{test} against mosquitto"), 0, extra)?;
        let extra_port = m.extra_port;
        let broker = TestBroker {
            name: "mosquitto",
            addr: m.addr(),
            mercurio: None,
            mosquitto: Some(m),
        };
        Some((broker, extra_port))
    }

    /// Both brokers: Mercurio, and mosquitto when installed.
    pub async fn both(test: &str) -> Vec<TestBroker> {
        let mut v = vec![Self::mercurio().await];
        if let Some((m, _)) = Self::mosquitto(test, "").await {
            v.push(m);
        }
        v
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        drop(self.mosquitto.take());
        drop(self.mercurio.take());
    }
}

/// A port free at the time of the call (bound to port 0, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
