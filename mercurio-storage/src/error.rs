//! [`StorageError`]: what went wrong, and its [`ErrorKind`], which tells the writer what to do.

use std::error::Error as StdError;
use std::fmt;

/// How many times the writer attempts a batch the database refuses before giving it up
/// (and marking its clients dirty).
pub const REFUSED_ATTEMPTS: u32 = 5;

/// What kind of failure a [`StorageError`] is, and so how the caller reacts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The database is unreachable, busy, locked or out of connections: retry the same
    /// batch until it recovers.
    Transient,
    /// The database refused the change (a constraint, bad data): give it up after
    /// [`REFUSED_ATTEMPTS`] attempts, then write its clients whole.
    Refused,
    /// A newer leader epoch exists: another broker serves this database. Stop at once,
    /// without writing anything more.
    Fenced,
    /// The database's schema is newer than this build (or otherwise not one it can use):
    /// refuse to start.
    Incompatible,
    /// Anything else that cannot be retried (a broken file, a bug): stop.
    Fatal,
}

impl ErrorKind {
    /// A stable lowercase name, for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Transient => "transient",
            ErrorKind::Refused => "refused",
            ErrorKind::Fenced => "fenced",
            ErrorKind::Incompatible => "incompatible",
            ErrorKind::Fatal => "fatal",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A storage failure: its [`ErrorKind`], a message, and the underlying error if any.
#[derive(Debug, thiserror::Error)]
#[error("storage error ({kind}): {message}")]
pub struct StorageError {
    kind: ErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
}

impl StorageError {
    /// An error of `kind` described by `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> StorageError {
        StorageError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A [`ErrorKind::Transient`] error.
    pub fn transient(message: impl Into<String>) -> StorageError {
        StorageError::new(ErrorKind::Transient, message)
    }

    /// A [`ErrorKind::Refused`] error.
    pub fn refused(message: impl Into<String>) -> StorageError {
        StorageError::new(ErrorKind::Refused, message)
    }

    /// A [`ErrorKind::Fenced`] error.
    pub fn fenced(message: impl Into<String>) -> StorageError {
        StorageError::new(ErrorKind::Fenced, message)
    }

    /// A [`ErrorKind::Incompatible`] error.
    pub fn incompatible(message: impl Into<String>) -> StorageError {
        StorageError::new(ErrorKind::Incompatible, message)
    }

    /// A [`ErrorKind::Fatal`] error.
    pub fn fatal(message: impl Into<String>) -> StorageError {
        StorageError::new(ErrorKind::Fatal, message)
    }

    /// This error with `source` as its underlying cause.
    pub fn with_source(
        mut self,
        source: impl Into<Box<dyn StdError + Send + Sync + 'static>>,
    ) -> StorageError {
        self.source = Some(source.into());
        self
    }

    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without the kind or the source.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Retry until the database recovers.
    pub fn is_transient(&self) -> bool {
        self.kind == ErrorKind::Transient
    }

    /// The database refused the change: give up after [`REFUSED_ATTEMPTS`] attempts.
    pub fn is_refused(&self) -> bool {
        self.kind == ErrorKind::Refused
    }

    /// Another broker took over: stop at once.
    pub fn is_fenced(&self) -> bool {
        self.kind == ErrorKind::Fenced
    }

    /// The database is newer than this build.
    pub fn is_incompatible(&self) -> bool {
        self.kind == ErrorKind::Incompatible
    }

    /// Neither retriable nor refusable.
    pub fn is_fatal(&self) -> bool {
        self.kind == ErrorKind::Fatal
    }

    /// Whether the broker must stop serving: fenced, incompatible or fatal.
    pub fn must_stop(&self) -> bool {
        matches!(
            self.kind,
            ErrorKind::Fenced | ErrorKind::Incompatible | ErrorKind::Fatal
        )
    }
}
