//! Log outputs that take one whole line with its level: [`PerEvent`] hands each event's line
//! to an [`Emit`] (the syslog sender of `syslog.rs`, or [`Journal`], standard output read by
//! journald), and [`severity`], the syslog severity both use.

use std::io::Write;

use tracing::{Level, Metadata};
use tracing_subscriber::fmt::MakeWriter;

/// The syslog severity of a level (also what journald reads in a `<N>` prefix).
pub fn severity(level: Level) -> u8 {
    match level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// An output that takes one whole line with its level.
pub trait Emit: Send + Sync + 'static {
    fn emit(&self, level: Level, line: &[u8]);
}

/// A [`MakeWriter`] that collects each event's line and hands it to an [`Emit`] with the
/// event's level.
pub struct PerEvent<E>(pub E);

/// The writer of one event: collects its bytes, emits them when dropped.
pub struct EventWriter<'a, E: Emit> {
    emit: &'a E,
    level: Level,
    buf: Vec<u8>,
}

impl<'a, E: Emit> MakeWriter<'a> for PerEvent<E> {
    type Writer = EventWriter<'a, E>;

    fn make_writer(&'a self) -> Self::Writer {
        EventWriter {
            emit: &self.0,
            level: Level::INFO,
            buf: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> Self::Writer {
        EventWriter {
            emit: &self.0,
            level: *meta.level(),
            buf: Vec::new(),
        }
    }
}

impl<E: Emit> Write for EventWriter<'_, E> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<E: Emit> Drop for EventWriter<'_, E> {
    fn drop(&mut self) {
        if !self.buf.is_empty() {
            self.emit.emit(self.level, &self.buf);
        }
    }
}

/// Standard output read by journald: each line prefixed with `<N>`, its severity.
pub struct Journal;

impl Emit for Journal {
    fn emit(&self, level: Level, line: &[u8]) {
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "<{}>", severity(level));
        let _ = out.write_all(line);
        if !line.ends_with(b"\n") {
            let _ = out.write_all(b"\n");
        }
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn severities() {
        assert_eq!(severity(Level::ERROR), 3);
        assert_eq!(severity(Level::WARN), 4);
        assert_eq!(severity(Level::INFO), 6);
        assert_eq!(severity(Level::DEBUG), 7);
        assert_eq!(severity(Level::TRACE), 7);
    }
}
