//! Standard output: each message written and flushed as soon as no other one has arrived
//! with it (a pipe sees it live; [`Batched`] writes the messages of one read from the broker
//! together), and a closed pipe (`recado sub | head -1`) ends the command quietly instead of
//! failing.

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

/// Most bytes [`Batched`] holds before it writes them.
pub const BATCH: usize = 64 * 1024;

/// Messages rendered and not yet written: the caller writes them ([`Batched::flush`]) when
/// no other message is already received, or when [`BATCH`] bytes are waiting, so that a
/// fast stream costs a write per read from the broker instead of one per message.
#[derive(Default)]
pub struct Batched {
    pending: Vec<u8>,
}

impl Batched {
    /// Adds `bytes` after what is waiting.
    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// Bytes waiting.
    pub fn bytes_waiting(&self) -> usize {
        self.pending.len()
    }

    /// Writes and flushes what is waiting (see [`write`]).
    pub fn flush(&mut self) -> Result<Written, Failure> {
        if self.pending.is_empty() {
            return Ok(Written::Ok);
        }
        let written = write(&self.pending);
        self.pending.clear();
        written
    }
}
