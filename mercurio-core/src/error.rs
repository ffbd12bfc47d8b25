//! The core crate's error type.

use std::net::SocketAddr;

/// Errors of starting or running the broker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A listener could not be bound.
    #[error("listener {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    /// A listener address did not resolve.
    #[error("listener {addr}: cannot resolve the address: {source}")]
    Resolve {
        addr: String,
        source: std::io::Error,
    },
    /// The configuration is not usable.
    #[error("configuration: {0}")]
    Config(String),
    /// An in-process publish or subscribe was refused (bad topic, broker stopped).
    #[error("{0}")]
    Refused(String),
    /// Storage could not be opened or loaded (locked by another broker, newer schema...).
    #[error("storage: {0}")]
    Storage(#[from] mercurio_storage::StorageError),
    /// A password, ACL, certificate or key file that cannot be used (path, line, cause).
    #[error("{0}")]
    File(#[from] crate::auth::FileError),
    /// Cluster mode could not start: the NATS client could not be made.
    #[error("cluster: {0}")]
    Cluster(String),
    /// I/O error on a bound listener.
    #[error("listener {addr}: {source}")]
    Listener {
        addr: SocketAddr,
        source: std::io::Error,
    },
}
