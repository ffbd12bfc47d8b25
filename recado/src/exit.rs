//! Exit codes a script can rely on, and the one-line error that goes with a failure.

use std::fmt;

/// The process exit code of every recado command (also listed in `--help` and
/// docs/recado.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// 0: the command did what was asked.
    Ok = 0,
    /// 1: any other failure: the connection was lost or closed by the broker, a protocol
    /// error, an unreadable file, an output that cannot be written.
    Error = 1,
    /// 2: bad usage: an unknown flag, a missing or invalid value (also clap's own code).
    Usage = 2,
    /// 3: the broker could not be reached: name not resolved, connection refused or timed
    /// out, TLS or WebSocket handshake failed.
    Unreachable = 3,
    /// 4: the broker answered CONNECT with a refusal (CONNACK reason code 0x80 or above in
    /// MQTT 5, return code 1 to 5 in 3.x); the message names the code.
    ConnackRefused = 4,
    /// 5: `-W` expired before the command was done.
    Timeout = 5,
    /// 6: the broker refused a subscription (SUBACK) or a message (PUBACK/PUBREC reason
    /// code 0x80 or above).
    Rejected = 6,
}

/// A failed command: its exit code and a one-sentence explanation for standard error.
#[derive(Debug)]
pub struct Failure {
    pub exit: Exit,
    pub message: String,
    /// The connection was lost (closed, reset, no PINGRESP, a DISCONNECT from the broker
    /// other than a takeover or a redirection): `recado sub` connects again.
    pub lost: bool,
}

impl Failure {
    /// A failure with exit code `exit` and the one-sentence `message`.
    pub fn new(exit: Exit, message: impl Into<String>) -> Failure {
        Failure {
            exit,
            message: message.into(),
            lost: false,
        }
    }

    /// [`Exit::Error`] for a lost connection (see [`Failure::lost`]).
    pub fn lost(message: impl Into<String>) -> Failure {
        Failure {
            lost: true,
            ..Failure::error(message)
        }
    }

    /// [`Exit::Usage`] with `message`.
    pub fn usage(message: impl Into<String>) -> Failure {
        Failure::new(Exit::Usage, message)
    }

    /// [`Exit::Error`] with `message`.
    pub fn error(message: impl Into<String>) -> Failure {
        Failure::new(Exit::Error, message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The exit code table as `--help` prints it.
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success
  1  other failure (connection lost or closed by the broker, protocol error, file error)
  2  bad usage (unknown flag, missing or invalid value)
  3  broker unreachable (name not resolved, connection refused, TLS or WebSocket handshake)
  4  CONNACK refused (the reason code and its name are printed)
  5  timeout: -W expired before the command was done
  6  the broker refused a subscription or a message (SUBACK, PUBACK or PUBREC failure)";
