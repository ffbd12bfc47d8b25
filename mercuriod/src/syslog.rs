//! Syslog output: each log line as one datagram to the local syslog daemon's socket
//! (`/dev/log`), facility daemon, severity from the line's level, in the local form of
//! RFC 3164 that rsyslog, syslog-ng and journald read: `<PRI>mercuriod[PID]: LINE`.
//!
//! The socket path can be changed with the environment variable `MERCURIO_SYSLOG_SOCKET`, for
//! tests only. (A hand-written sender rather than libc's `syslog(3)`, which always writes to
//! `/dev/log` and keeps process-global state.)

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::Mutex;

use tracing::Level;

use crate::line_output::{severity, Emit};

/// syslog facility `daemon` (3), shifted as in a PRI value.
const FACILITY_DAEMON: u8 = 3 << 3;

/// Longest datagram sent; a longer line is cut (syslog daemons refuse or cut them anyway).
const MAX_DATAGRAM: usize = 8 * 1024;

/// Environment variable naming another socket than `/dev/log` (tests).
pub const SOCKET_ENV: &str = "MERCURIO_SYSLOG_SOCKET";

/// A connection to the syslog socket, made again after an error (the daemon restarted).
pub struct Syslog {
    path: PathBuf,
    socket: Mutex<Option<UnixDatagram>>,
    pid: u32,
}

impl Syslog {
    /// `/dev/log`, or the path in [`SOCKET_ENV`].
    pub fn from_env() -> Syslog {
        let path = std::env::var_os(SOCKET_ENV)
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/dev/log"));
        Syslog {
            path,
            socket: Mutex::new(None),
            pid: std::process::id(),
        }
    }

    fn send(&self, datagram: &[u8]) {
        let mut socket = self.socket.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..2 {
            if socket.is_none() {
                let Ok(s) = UnixDatagram::unbound() else {
                    return;
                };
                if s.connect(&self.path).is_err() {
                    return;
                }
                *socket = Some(s);
            }
            if let Some(s) = socket.as_ref() {
                if s.send(datagram).is_ok() {
                    return;
                }
            }
            *socket = None;
        }
    }
}

/// The datagram of one line.
pub fn format(level: Level, pid: u32, line: &[u8]) -> Vec<u8> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let mut datagram =
        format!("<{}>mercuriod[{pid}]: ", FACILITY_DAEMON + severity(level)).into_bytes();
    datagram.extend_from_slice(line);
    datagram.truncate(MAX_DATAGRAM);
    datagram
}

impl Emit for Syslog {
    fn emit(&self, level: Level, line: &[u8]) {
        self.send(&format(level, self.pid, line));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagram() {
        assert_eq!(
            format(Level::WARN, 42, b"queue full\n"),
            b"<28>mercuriod[42]: queue full".to_vec()
        );
        assert_eq!(format(Level::ERROR, 1, b"x")[..4], *b"<27>");
        assert_eq!(format(Level::INFO, 1, b"x")[..4], *b"<30>");
        assert_eq!(format(Level::DEBUG, 1, b"x")[..4], *b"<31>");
        assert_eq!(format(Level::INFO, 1, &[b'a'; 20_000]).len(), MAX_DATAGRAM);
    }
}
