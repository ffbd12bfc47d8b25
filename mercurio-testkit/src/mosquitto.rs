//! mosquitto as a process, for the tests that run against it (a bridge's remote, the
//! reference broker of recado's tests).

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{mosquitto_bin, prerequisite, Proc, DEADLINE};

/// mosquitto listening on 127.0.0.1 with a configuration of its own (in a temporary
/// directory), anonymous clients allowed; killed when dropped.
pub struct Mosquitto {
    /// The process, for signals (`SIGSTOP` freezes it) and for what it printed.
    pub proc: Proc,
    /// The port of its MQTT listener.
    pub port: u16,
    /// The second free port `{port}` stood for in the extra configuration (0 if none).
    pub extra_port: u16,
    _dir: tempfile::TempDir,
}

impl Mosquitto {
    /// Starts mosquitto on `port` (0: a free one) with `extra` configuration lines, in which
    /// `{port}` stands for a second free port (a WebSocket listener, say); returns once every
    /// listener accepts connections (mosquitto logs nothing when it is ready), within
    /// [`DEADLINE`], else panics. `None` when mosquitto is not installed: `test` then skips,
    /// or fails under `CI=true` ([`prerequisite`]).
    pub fn start(test: &str, port: u16, extra: &str) -> Option<Mosquitto> {
        let Some(bin) = mosquitto_bin() else {
            prerequisite(
                test,
                Err("mosquitto is not installed; install: apt-get install mosquitto".into()),
            );
            return None;
        };
        let port = if port == 0 { free_port() } else { port };
        let extra_port = if extra.contains("{port}") {
            free_port()
        } else {
            0
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let conf = dir.path().join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "listener {port} 127.0.0.1\nallow_anonymous true\n{}\n",
                extra.replace("{port}", &extra_port.to_string())
            ),
        )
        .expect("write mosquitto.conf");
        let proc = Proc::spawn("mosquitto", Command::new(bin).arg("-c").arg(&conf));
        let deadline = Instant::now() + DEADLINE;
        for p in [port, extra_port].into_iter().filter(|&p| p != 0) {
            while TcpStream::connect(("127.0.0.1", p)).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "mosquitto does not listen on port {p}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Some(Mosquitto {
            proc,
            port,
            extra_port,
            _dir: dir,
        })
    }

    /// The address of its MQTT listener.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

/// A port free at the time of the call (bound to port 0, then released).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address").port()
}
