//! mercuriod as a process: start errors and signals. (Connecting clients is tested with the
//! broker.)
#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const MERCURIOD: &str = env!("CARGO_BIN_EXE_mercuriod");
const DEADLINE: Duration = Duration::from_secs(20);

fn config_file(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mercuriod.toml");
    // Each broker's admin socket in its own dir (the default one is shared by every broker).
    let socket = dir.path().join("mercuriod.sock");
    let text = text.replace("ADMIN_SOCKET", &socket.display().to_string());
    std::fs::write(&path, text).expect("write config");
    (dir, path)
}

/// Kills the child if a test fails before it exits.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_exit(child: &mut Child) -> Option<i32> {
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status.code();
        }
        assert!(start.elapsed() < DEADLINE, "mercuriod did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn port_in_use_exits_1_with_one_line() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let (_dir, path) = config_file(&format!(
        "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = {port}\n\n\
         [admin]\nsocket = \"ADMIN_SOCKET\"\n"
    ));
    let mut daemon = Daemon(
        Command::new(MERCURIOD)
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn mercuriod"),
    );
    assert_eq!(wait_exit(&mut daemon.0), Some(1));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut daemon.0.stderr.take().expect("stderr"), &mut stderr)
        .expect("read stderr");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(&port.to_string()), "{stderr}");
}

#[test]
fn sigterm_stops_with_status_0() {
    for signal in ["-TERM", "-INT"] {
        let (_dir, path) = config_file(&format!(
            "[auth]\nallow_anonymous = true\n\n[[listeners]]\nhost = \"127.0.0.1\"\nport = 0\n\n\
             [admin]\nsocket = \"ADMIN_SOCKET\"\n"
        ));
        let mut daemon = Daemon(
            Command::new(MERCURIOD)
                .arg("-c")
                .arg(&path)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn mercuriod"),
        );
        // Wait for the log line of the listening address.
        let stdout = daemon.0.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut log = Vec::new();
        loop {
            let line = rx
                .recv_timeout(DEADLINE)
                .unwrap_or_else(|_| panic!("no listening line in {log:#?}"));
            let listening = line.contains("listening on 127.0.0.1:");
            log.push(line);
            if listening {
                break;
            }
        }
        assert!(log[0].contains(env!("CARGO_PKG_VERSION")), "{log:#?}");

        let status = Command::new("kill")
            .arg(signal)
            .arg(daemon.0.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success());
        assert_eq!(wait_exit(&mut daemon.0), Some(0), "after {signal}");
        let rest: Vec<String> = rx.iter().collect();
        assert!(
            rest.iter().any(|l| l.contains("received")),
            "{signal}: {rest:#?}"
        );
    }
}
