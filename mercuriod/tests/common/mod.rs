//! mercuriod as a process for tests: start it on port 0 with its admin socket in a temp dir,
//! read its log lines, talk to its admin socket, and a raw MQTT client (bytes written by hand,
//! so these tests need no client library). Also compiled into mercurioctl's tests (`#[path]`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Every wait in these tests ends by this deadline.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// A running mercuriod, killed if the test fails before it exits.
pub struct Daemon {
    pub child: Child,
    lines: mpsc::Receiver<String>,
    /// Every standard output line read so far.
    pub log: Vec<String>,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The configuration of [`Daemon::start`]: anonymous clients on 127.0.0.1 port 0, the admin
/// socket in `dir`, then `extra` (sections other than `[auth]`, `[[listeners]]` and `[admin]`).
pub fn config_text(socket: &Path, extra: &str) -> String {
    format!(
        "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
         [admin]\nsocket = {:?}\n\n{extra}",
        socket.display().to_string()
    )
}

impl Daemon {
    /// Starts `exe -c FILE` with [`config_text`] and the given environment.
    pub fn start(exe: &Path, extra: &str, env: &[(&str, &str)]) -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("run").join("mercuriod.sock");
        Self::start_with(exe, dir, socket.clone(), &config_text(&socket, extra), env)
    }

    /// Starts `exe -c FILE` with `text` as the file, in `dir`.
    pub fn start_with(
        exe: &Path,
        dir: tempfile::TempDir,
        socket: PathBuf,
        text: &str,
        env: &[(&str, &str)],
    ) -> Daemon {
        let config = dir.path().join("mercuriod.toml");
        std::fs::write(&config, text).expect("write config");
        let mut command = Command::new(exe);
        command
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("JOURNAL_STREAM")
            .env_remove("NOTIFY_SOCKET")
            .env_remove("RUNTIME_DIRECTORY");
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("spawn mercuriod");
        let (tx, rx) = mpsc::channel();
        for out in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Daemon {
            child,
            lines: rx,
            log: Vec::new(),
            dir,
            config,
            socket,
        }
    }

    /// Waits for an output line (stdout or stderr) that satisfies `pred`, and returns it.
    pub fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(_) => panic!("no line {what} in {:#?}", self.log),
            }
        }
    }

    /// Lines read until now that satisfy `pred`, reading what is already there.
    pub fn seen(&mut self, pred: impl Fn(&str) -> bool) -> Vec<String> {
        while let Ok(line) = self.lines.try_recv() {
            self.log.push(line);
        }
        self.log.iter().filter(|l| pred(l)).cloned().collect()
    }

    /// Waits for the "listening on" line and returns the MQTT port.
    pub fn wait_listening(&mut self) -> u16 {
        let line = self.wait_line("listening on", |l| l.contains("listening on 127.0.0.1:"));
        let port = line.rsplit(':').next().expect("port");
        port.trim().parse().expect("port number")
    }

    /// Sends one admin request line, returns the answer.
    pub fn admin(&self, request: &str) -> serde_json::Value {
        admin(&self.socket, request)
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: kill with our own child's pid.
        let r = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(r, 0, "kill");
    }

    /// Waits for the process to exit and returns its status code.
    pub fn wait_exit(&mut self) -> Option<i32> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status.code();
            }
            assert!(Instant::now() < deadline, "mercuriod did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
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

/// Waits until `cond` holds, checking every 20 ms, up to [`DEADLINE`].
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A raw MQTT connection.
pub struct Mqtt(pub TcpStream);

fn with_length(first: u8, body: &[u8]) -> Vec<u8> {
    let mut packet = vec![first];
    let mut n = body.len();
    loop {
        let mut byte = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            byte |= 0x80;
        }
        packet.push(byte);
        if n == 0 {
            break;
        }
    }
    packet.extend_from_slice(body);
    packet
}

fn string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u16).to_be_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

impl Mqtt {
    /// Connects with protocol level 4 (3.1.1) or 5, clean start or not; checks CONNACK 0.
    pub fn connect(port: u16, level: u8, client_id: &str, clean: bool) -> Mqtt {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
        let mut mqtt = Mqtt(stream);
        let mut body = string("MQTT");
        body.push(level);
        body.push(if clean { 0x02 } else { 0x00 });
        body.extend_from_slice(&60u16.to_be_bytes());
        if level == 5 {
            if clean {
                body.push(0);
            } else {
                // Session Expiry Interval: 3600 s.
                body.extend_from_slice(&[5, 0x11, 0, 0, 0x0e, 0x10]);
            }
        }
        body.extend_from_slice(&string(client_id));
        mqtt.send(&with_length(0x10, &body));
        let (kind, body) = mqtt.read().expect("CONNACK");
        assert_eq!(kind, 0x20, "CONNACK expected");
        assert_eq!(body[1], 0, "CONNACK reason");
        mqtt
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).expect("write");
    }

    /// Subscribes (packet id 1) and waits for SUBACK.
    pub fn subscribe(&mut self, level: u8, filter: &str, qos: u8) {
        let mut body = 1u16.to_be_bytes().to_vec();
        if level == 5 {
            body.push(0);
        }
        body.extend_from_slice(&string(filter));
        body.push(qos);
        self.send(&with_length(0x82, &body));
        let (kind, _) = self.read().expect("SUBACK");
        assert_eq!(kind, 0x90, "SUBACK expected");
    }

    /// DISCONNECT (normal), then close.
    pub fn disconnect(mut self) {
        self.send(&[0xe0, 0]);
    }

    /// The next packet's first byte and body; `None` at end of stream.
    pub fn read(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut first = [0u8; 1];
        match self.0.read(&mut first) {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
        let mut len = 0usize;
        let mut shift = 0;
        loop {
            let mut b = [0u8; 1];
            self.0.read_exact(&mut b).ok()?;
            len |= usize::from(b[0] & 0x7f) << shift;
            shift += 7;
            if b[0] & 0x80 == 0 {
                break;
            }
        }
        let mut body = vec![0; len];
        self.0.read_exact(&mut body).ok()?;
        Some((first[0], body))
    }
}
