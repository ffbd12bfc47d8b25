//! Mercurio's persisted data model and the [`Storage`] trait its backends implement.
//!
//! The broker keeps its state in memory and emits [`Change`]s, in order per client, to a
//! background writer that [`apply`](Storage::apply)s them in batches; at start it
//! [`load`](Storage::load)s everything back, or everything but the queues
//! ([`load_without_queues`](Storage::load_without_queues)), each read later with
//! [`load_queue`](Storage::load_queue) when its client comes back. This crate knows nothing of sockets or of the
//! MQTT codec: QoS is a `u8`, MQTT 5 properties are opaque encoded bytes.
//!
//! Modules:
//! - [`records`]: sessions, subscriptions, messages, wills, in-flight and retained messages;
//!   a message queued for many sessions is stored once ([`StoredMessage`]) and each queue
//!   or in-flight list holds a reference to it ([`DeliveryRecord`]);
//! - [`change`]: the [`Change`] enum, one small ordered mutation each;
//! - [`access`]: the access rules kept in storage (users, groups, roles), records opaque to
//!   storage;
//! - [`error`]: [`StorageError`] and the [`ErrorKind`] that tells the writer how to react;
//! - [`memory`]: [`MemoryStorage`], the default backend and the reference semantics;
//! - [`sqlite`] (feature `sqlite`): [`SqliteStorage`](sqlite::SqliteStorage), one database file
//!   in WAL mode, written by a dedicated thread, queues stored in chunks (`sqlite/queue.rs`);
//! - `refs` (SQL backends): the message store's reference accounting, a count per message
//!   changed once per batch;
//! - [`postgres`] (feature `postgres`): [`PostgresStorage`](postgres::PostgresStorage), a
//!   PostgreSQL database served by one broker at a time, with standbys and epoch fencing;
//! - `conformance` (feature `conformance`): checks every backend must pass.
//!
//! Dependencies:
//! - `bytes`: payloads and encoded properties are shared `Bytes`, not copied, between the
//!   broker's fan-out and storage;
//! - `thiserror`: the one error type of the crate, as everywhere in the workspace;
//! - `async-trait`: `Storage` is used as `Arc<dyn Storage>`, which native async trait methods
//!   don't allow yet;
//! - `parking_lot`: the memory backend's lock, small and never held across an `.await`;
//! - `tokio`: the runtime the backends run on (blocking SQLite calls go to its blocking pool,
//!   PostgreSQL through tokio-postgres).
//! - `rusqlite` (feature `sqlite`, `bundled`): SQLite compiled in, driven from one dedicated
//!   thread; the one copy of libsqlite3-sys in the tree (sqlx-sqlite is not used: it would bring a second copy);
//! - `libc` (feature `sqlite`): `flock` on `mercurio.db.lock`, so that a second broker on the
//!   same database exits (std's `File::try_lock` needs a newer Rust than the workspace's);
//!   `gethostname` for the PostgreSQL heartbeat row (feature `postgres`); `geteuid` in the
//!   PostgreSQL test cluster;
//! - `tokio-postgres-rustls`, `rustls` (feature `postgres`): TLS to PostgreSQL as `sslmode`
//!   asks, on the rustls stack the listeners already use (no OpenSSL).
//! - `serde` (feature `serde`, with `bytes`' own): `Serialize` / `Deserialize` on a session's
//!   records, which the core's cluster mode hands from node to node; no format is chosen here.
//! - `rcgen` (tests only): certificates for the TLS test cluster.
//! - `tokio-postgres` (feature `postgres`): pipelined writes on one connection, a dedicated
//!   connection for the advisory lock, per-connection settings (deadpool-postgres is not used:
//!   the writer is one task, so one write connection is all it needs);
//! - `futures-util` (feature `postgres`): `join_all` to pipeline a batch's statements;
//! - `tracing`: the PostgreSQL backend logs takeovers, heartbeat failures and its stop.

#![warn(missing_docs)]

pub mod access;
pub mod change;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod error;
pub mod memory;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod records;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod refs;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod rows;
#[cfg(feature = "sqlite")]
pub mod sqlite;

use std::collections::HashMap;

use async_trait::async_trait;

pub use access::{AccessChange, AccessKind, AccessRecord};
pub use change::Change;
pub use error::{ErrorKind, StorageError, REFUSED_ATTEMPTS};
pub use memory::MemoryStorage;
pub use records::{
    Backlog, DeliveryRecord, InflightRecord, InflightState, MessageRecord, QueuedRecord,
    RetainedRecord, SessionHeader, SessionRecord, StoredMessage, StreamAppend, StreamDefinition,
    StreamEntryRead, StreamEntryRecord, StreamRecord, SubscriptionRecord, WillRecord,
    NEVER_EXPIRES,
};

/// Everything a broker reads from storage when it starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadedState {
    /// Every stored session that could be read, sorted by client identifier, expired ones
    /// included (the broker discards them and publishes their wills).
    pub sessions: Vec<SessionRecord>,
    /// Every retained message, sorted by topic.
    pub retained: Vec<RetainedRecord>,
    /// Every stored message some stored session (its queue or in-flight messages, set-aside
    /// sessions included) refers to, each once, sorted by id. Loading starts a new broker:
    /// messages nothing refers to are deleted first, and every loaded one is held by the new
    /// broker until it sends [`Change::MessageReleased`]. Messages only stream entries refer
    /// to are not loaded (they are read with [`Storage::read_stream`]) nor held: they go with
    /// their last entry.
    pub messages: Vec<StoredMessage>,
    /// The highest id in the message store, loaded or not (0: none): the broker numbers new
    /// messages above it.
    pub max_message_id: u64,
    /// Sessions that could not be read. They stay in storage untouched; their clients are
    /// refused until [`Storage::delete_session`] removes them.
    pub set_aside: Vec<SetAside>,
    /// Every stored stream, sorted by name: its counters, its entries left in storage.
    pub streams: Vec<StreamRecord>,
    /// From [`Storage::load_without_queues`]: the queues left in storage, by client, each
    /// session of [`sessions`](Self::sessions) with a non-empty queue once (its
    /// [`SessionRecord::queued`] then empty). Always empty from [`Storage::load`].
    pub backlogs: HashMap<String, Backlog>,
}

/// A stored session that could not be read (a damaged row, one written by a newer version).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAside {
    /// The client the session belongs to.
    pub client_id: String,
    /// What failed, for the log.
    pub cause: String,
}

/// A storage backend: memory, SQLite or PostgreSQL.
///
/// Implementations are shared (`Arc<dyn Storage>`) between the broker's background writer
/// and its admin commands; every method may be called concurrently.
#[async_trait]
pub trait Storage: Send + Sync + 'static {
    /// The backend's name, as in the configuration: `"memory"`, `"sqlite"`, `"postgres"`.
    fn name(&self) -> &'static str;

    /// Read every stored session and retained message.
    ///
    /// A session that cannot be read is reported in [`LoadedState::set_aside`], not as an
    /// error. Errors are for storage as a whole: unreachable ([`ErrorKind::Transient`]),
    /// newer schema ([`ErrorKind::Incompatible`]), another broker serving
    /// ([`ErrorKind::Fenced`]).
    async fn load(&self) -> Result<LoadedState, StorageError>;

    /// [`load`](Storage::load), with each session's queued deliveries left in storage: a
    /// session with a queue has an empty [`SessionRecord::queued`] and its
    /// [`LoadedState::backlogs`] entry (count and positions) instead, so that a restart reads a
    /// row per session rather than one per queued delivery. The messages those queues refer
    /// to are in [`LoadedState::messages`] as with `load`, held by the new broker alike.
    /// Errors as `load`'s.
    async fn load_without_queues(&self) -> Result<LoadedState, StorageError>;

    /// The queued deliveries of the session of `client_id`, sorted by `seq`, as
    /// [`load`](Storage::load) would return them in [`SessionRecord::queued`] now (the
    /// changes applied so far included); empty when it has none or no session. Their messages
    /// are stored for as long as the broker holds them (it did since the load).
    ///
    /// Errors: storage unreachable ([`ErrorKind::Transient`]); a queue that cannot be read
    /// ([`ErrorKind::Refused`]).
    async fn load_queue(&self, client_id: &str) -> Result<Vec<QueuedRecord>, StorageError>;

    /// The stored messages of `ids` that are in the message store, sorted by id (an id not
    /// there is left out; one that cannot be read too: the caller names what it misses).
    /// The broker reads the messages of a queue it left in storage while running (its
    /// `max_queued_memory`) with it: they are stored for as long as a delivery refers to
    /// them. Reading holds nothing: the broker gives a message read so no stored identity.
    ///
    /// Errors: storage unreachable ([`ErrorKind::Transient`]).
    async fn load_messages(&self, ids: &[u64]) -> Result<Vec<StoredMessage>, StorageError>;

    /// Entries of stream `stream` with their messages, by offset: those at offset
    /// `from_offset` or above appended at `from_time_ms` (unix milliseconds) or later (0: any
    /// time), as the changes applied so far left them. At most `max` entries, stopping once
    /// their messages add up to `max_bytes` or more ([`MessageRecord::size`]; the entry that
    /// reaches it is included, so a read returns at least one entry while any is left). A
    /// reader of a stream longer than the broker holds in memory reads it so, in batches,
    /// reading on after the last entry returned until a read is empty: it never holds more
    /// than one batch's bytes. Empty for a stream not stored or read to its end; an entry
    /// whose message cannot be read is left out.
    ///
    /// Errors: storage unreachable ([`ErrorKind::Transient`]).
    async fn read_stream(
        &self,
        stream: &str,
        from_offset: u64,
        from_time_ms: u64,
        max: usize,
        max_bytes: u64,
    ) -> Result<Vec<StreamEntryRead>, StorageError>;

    /// Apply `batch` in order, in one transaction: all of it or none of it.
    ///
    /// The meaning of each change is on [`Change`]. On error nothing was applied and the
    /// error's kind says whether to retry ([`StorageError::is_transient`]), give up after
    /// [`REFUSED_ATTEMPTS`] ([`StorageError::is_refused`]) or stop
    /// ([`StorageError::must_stop`]). An empty batch succeeds without touching storage.
    async fn apply(&self, batch: &[Change]) -> Result<(), StorageError>;

    /// Delete the session of `client_id` and everything it holds, whether it could be read
    /// or was set aside (`mercurioctl client delete-session`). Returns whether there was one.
    async fn delete_session(&self, client_id: &str) -> Result<bool, StorageError>;

    /// Every stored access record (users, groups, roles: [`access`]), sorted by kind then
    /// name. A broker reads them when it starts (a PostgreSQL standby: when it takes over).
    async fn load_access(&self) -> Result<Vec<AccessRecord>, StorageError>;

    /// Apply `changes` in order, in one transaction, and return once they are durable: all of
    /// them or none. Refused ([`ErrorKind::Refused`]) for an empty name or a NUL character;
    /// PostgreSQL refuses a broker that no longer serves ([`ErrorKind::Fenced`]) as
    /// [`apply`](Storage::apply) does.
    async fn apply_access(&self, changes: &[AccessChange]) -> Result<(), StorageError>;

    /// Return once everything applied so far is durable (fsynced / committed).
    async fn flush(&self) -> Result<(), StorageError>;

    /// [`apply`](Storage::apply) `batch` and return once it is durable (synced), as
    /// `durable_ack` needs before acknowledging a message. By default `apply` then
    /// [`flush`](Storage::flush); SQLite commits this one transaction with
    /// `synchronous = FULL`.
    async fn apply_durable(&self, batch: &[Change]) -> Result<(), StorageError> {
        self.apply(batch).await?;
        self.flush().await
    }

    /// [`apply`](Storage::apply) `batch`, or [`apply_durable`](Storage::apply_durable) when
    /// `durable`, given shared rather than borrowed: a backend that writes on a thread of its
    /// own (SQLite) sends it there as it is instead of copying every change. By default the
    /// borrowed methods.
    async fn apply_shared(
        &self,
        batch: std::sync::Arc<Vec<Change>>,
        durable: bool,
    ) -> Result<(), StorageError> {
        if durable {
            self.apply_durable(&batch).await
        } else {
            self.apply(&batch).await
        }
    }

    /// Flush and release the database (its file lock, its connections): a stopping broker's
    /// last call, after which another broker may open the same database. Later calls fail.
    /// By default only [`flush`](Storage::flush).
    async fn close(&self) -> Result<(), StorageError> {
        self.flush().await
    }

    /// Resolves when this broker must stop using the storage at once: another broker took
    /// the database over ([`ErrorKind::Fenced`]), or it was unreachable too long for this
    /// broker to keep serving (PostgreSQL). Never resolves by default.
    async fn failed(&self) -> StorageError {
        std::future::pending().await
    }

    /// Whether this broker cannot tell now that it still serves the database: with
    /// PostgreSQL, 7 s (`postgres::LOST_AFTER`) since its last heartbeat, as after the
    /// process was stalled (stopped, a frozen VM) long enough for another broker or cluster
    /// node to take the database over. While true the broker sends its clients nothing; its
    /// next heartbeat ends it, or [`Storage::failed`] resolves. `false` by default (a
    /// database no other process takes).
    fn lapsed(&self) -> bool {
        false
    }
}
