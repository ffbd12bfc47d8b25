//! Standard output: each message written and flushed at once (a pipe sees it live), and a
//! closed pipe (`recado sub | head -1`) ends the command quietly instead of failing.

use std::io::{ErrorKind, Write};

use crate::exit::Failure;

/// What writing said.
pub enum Written {
    Ok,
    /// The reader went away: stop, successfully.
    Closed,
}

/// Writes `bytes` to standard output and flushes.
pub fn write(bytes: &[u8]) -> Result<Written, Failure> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => Ok(Written::Ok),
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(Written::Closed),
        Err(e) => Err(Failure::error(format!(
            "cannot write to standard output: {e}"
        ))),
    }
}
