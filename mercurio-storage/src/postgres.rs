//! [`PostgresStorage`]: a PostgreSQL database (12 or later), served by one broker at a time.
//!
//! - Writes go through one connection, in one transaction per batch, its statements pipelined
//!   (sent together, one round trip), a batch written as what it leaves: per client and
//!   table, one multi-row DELETE and one multi-row INSERT for a run of changes (see
//!   `plan`), so that a message queued then dequeued, or set in flight then acknowledged,
//!   in the same batch writes no row. A session's queue is stored in chunks of up to 256
//!   deliveries (`mercurio_queue_chunks`, one array per column; the view `mercurio_queued`
//!   shows a row per delivery), and each message counts its queued references. Each write
//!   transaction first takes the fence lock
//!   shared (a transaction-level advisory lock that a takeover takes exclusively, see
//!   [`leader`]), then reads the leader epoch; a transaction from an older epoch is rolled
//!   back and refused with
//!   [`ErrorKind::Fenced`](crate::ErrorKind::Fenced), and [`Storage::failed`] resolves: the
//!   broker stops at once. Commits are durable (`synchronous_commit` as the server has it).
//! - Leadership ([`leader`]): a session-level advisory lock on a dedicated connection, a
//!   heartbeat row, standbys, takeovers and the lost-database stop (docs/operations.md, "Standby brokers").
//! - The schema version is in `mercurio_meta`; a newer one is refused
//!   ([`ErrorKind::Incompatible`](crate::ErrorKind::Incompatible)). A standby migrates only
//!   once it serves.
//! - A session whose rows cannot be read is set aside, as with SQLite.
//! - A cluster node takes one session out of the database of a node that crashed, fencing
//!   it as a standby would ([`peer`]).

pub mod leader;
mod load;
pub mod peer;
mod plan;
mod schema;
mod statements;
#[cfg(any(test, feature = "conformance"))]
pub mod testing;
mod tls;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{watch, Mutex};
use tokio_postgres::Client;

use crate::access::{validate_access, AccessChange, AccessKind, AccessRecord};
use crate::change::{validate_batch, Change};
use crate::error::{ErrorKind, StorageError};
use crate::{LoadedState, QueuedRecord, Storage, StoredMessage};

pub use leader::{Leadership, HEARTBEAT_STALE, LOST_AFTER};
use load::load_all;
use plan::{write_batch, WriteError};
pub use schema::SCHEMA_VERSION;
pub(crate) use schema::{check_version, migrate, schema_version};
use statements::Statements;

/// How long opening a connection may take before it counts as unreachable.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How to open a [`PostgresStorage`].
#[derive(Debug, Clone)]
pub struct PostgresOptions {
    /// The connection URL or key-value string (`postgres://user:password@host/db`).
    pub url: String,
    /// Wait for the serving broker instead of failing when one serves.
    pub standby: bool,
    /// This broker's host name, recorded in the heartbeat row; the machine's by default.
    pub host: Option<String>,
}

impl PostgresOptions {
    /// Options for `url`, not a standby.
    pub fn new(url: impl Into<String>) -> PostgresOptions {
        PostgresOptions {
            url: url.into(),
            standby: false,
            host: None,
        }
    }
}

struct WriteConnection {
    client: Client,
    /// Prepared on first use, once the schema exists (after the lead is taken).
    statements: Option<Statements>,
}

/// Storage in a PostgreSQL database. See the [module documentation](self).
pub struct PostgresStorage {
    config: PgConfig,
    writer: Mutex<Option<WriteConnection>>,
    leadership: Leadership,
    closed: AtomicBool,
    failed: watch::Receiver<Option<(ErrorKind, String)>>,
}

impl std::fmt::Debug for PostgresStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStorage")
            .field("epoch", &self.leadership.epoch())
            .finish()
    }
}

/// A parsed connection URL and the TLS it asks for (`sslmode`, see [`tls`]).
#[derive(Clone)]
pub(crate) struct PgConfig {
    pg: tokio_postgres::Config,
    /// `None` with `sslmode=disable`.
    tls: Option<tokio_postgres_rustls::MakeRustlsConnect>,
}

impl std::fmt::Debug for PgConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgConfig")
            .field("pg", &self.pg)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl std::ops::Deref for PgConfig {
    type Target = tokio_postgres::Config;
    fn deref(&self) -> &tokio_postgres::Config {
        &self.pg
    }
}

/// Parses `url` into a connection configuration named `mercurio`.
pub(crate) fn parse_config(url: &str) -> Result<PgConfig, StorageError> {
    let (url, verify) = tls::split_url(url);
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| StorageError::fatal(format!("invalid PostgreSQL connection URL: {e}")))?;
    if config.get_application_name().is_none() {
        config.application_name("mercurio");
    }
    config.connect_timeout(CONNECT_TIMEOUT);
    config.keepalives_idle(Duration::from_secs(5));
    let tls = match config.get_ssl_mode() {
        tokio_postgres::config::SslMode::Disable => None,
        _ => Some(tls::connector(&verify)?),
    };
    Ok(PgConfig { pg: config, tls })
}

/// Opens a connection (over TLS unless `sslmode=disable`) and drives it on the runtime.
pub(crate) async fn connect(config: &PgConfig) -> Result<Client, StorageError> {
    match &config.tls {
        None => connect_with(&config.pg, tokio_postgres::NoTls).await,
        Some(tls) => connect_with(&config.pg, tls.clone()).await,
    }
}

async fn connect_with<T>(config: &tokio_postgres::Config, tls: T) -> Result<Client, StorageError>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket> + Send + 'static,
    T::Stream: Send + 'static,
    T::TlsConnect: Send,
    <T::TlsConnect as tokio_postgres::tls::TlsConnect<tokio_postgres::Socket>>::Future: Send,
{
    let connecting = config.connect(tls);
    let (client, connection) = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
        .await
        .map_err(|_| StorageError::transient("cannot connect to PostgreSQL: timed out"))?
        .map_err(|e| classify(e, "cannot connect to PostgreSQL"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Maps a tokio-postgres error to the kind the writer acts on.
pub(crate) fn classify(e: tokio_postgres::Error, what: &str) -> StorageError {
    let message = format!("{what}: {}", describe(&e));
    let kind = match e.code() {
        None => ErrorKind::Transient,
        Some(code) => {
            let code = code.code();
            match &code[..2] {
                "08" | "53" | "57" | "40" | "55" | "58" => ErrorKind::Transient,
                "22" | "23" => ErrorKind::Refused,
                _ => ErrorKind::Fatal,
            }
        }
    };
    StorageError::new(kind, message).with_source(e)
}

/// The server's message when there is one (tokio-postgres' Display says only "db error").
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => {
            // tokio-postgres' message is generic ("error performing TLS handshake"): the
            // cause (a certificate from an unknown root, say) is in its sources.
            let mut text = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        }
    }
}

impl PostgresStorage {
    /// Connects, takes the lead (or, as a standby, waits for it), creates or checks the
    /// schema and records the takeover.
    ///
    /// Errors: [`ErrorKind::Fenced`] when another broker serves and this one is not a
    /// standby (the message names its host); `Incompatible` for a newer schema (a standby
    /// checks before waiting); `Transient` when the database can't be reached.
    pub async fn open(options: PostgresOptions) -> Result<PostgresStorage, StorageError> {
        let config = parse_config(&options.url)?;
        let host = options.host.clone().unwrap_or_else(leader::host_name);
        let writer = open_writer(&config).await?;
        let (leadership, failed) =
            Leadership::acquire(&config, &host, options.standby, writer.pid).await?;
        let storage = PostgresStorage {
            config,
            writer: Mutex::new(Some(writer.writer)),
            leadership,
            closed: AtomicBool::new(false),
            failed,
        };
        Ok(storage)
    }

    /// The leader epoch this storage writes under.
    pub fn epoch(&self) -> i64 {
        self.leadership.epoch()
    }

    fn check_open(&self) -> Result<(), StorageError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        }
        if let Some((kind, message)) = self.failed.borrow().clone() {
            return Err(StorageError::new(kind, message));
        }
        Ok(())
    }

    /// The write connection, reconnected when it was lost.
    async fn writer(
        &self,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<WriteConnection>>, StorageError> {
        self.check_open()?;
        let mut guard = self.writer.lock().await;
        if guard.as_ref().is_none_or(|w| w.client.is_closed()) {
            *guard = None;
            let opened = open_writer(&self.config).await?;
            self.leadership.set_writer_pid(opened.pid).await;
            *guard = Some(opened.writer);
        }
        Ok(guard)
    }

    /// Refused because another broker took over: stop everything.
    fn fenced(&self, epoch: i64) -> StorageError {
        let message = format!(
            "another broker took over this database (epoch {epoch}, ours {}): stopping",
            self.epoch()
        );
        self.leadership.fail(ErrorKind::Fenced, &message);
        StorageError::fenced(message)
    }

    async fn write(&self, batch: &[Change], start: bool) -> Result<(), StorageError> {
        validate_batch(batch)?;
        let mut guard = self.writer().await?;
        let Some(writer) = guard.as_mut() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        let result = write_batch(writer, batch, self.epoch(), start).await;
        self.written(guard, result).await
    }

    /// The end of a write on the writer connection: a refusal by epoch stops the broker; a
    /// transient error drops a closed connection and asks whether a takeover caused it.
    async fn written(
        &self,
        mut guard: tokio::sync::MutexGuard<'_, Option<WriteConnection>>,
        result: Result<(), WriteError>,
    ) -> Result<(), StorageError> {
        match result {
            Err(WriteError::Fenced(epoch)) => Err(self.fenced(epoch)),
            Err(WriteError::Storage(e)) => {
                if !e.is_transient() {
                    return Err(e);
                }
                if guard.as_ref().is_some_and(|w| w.client.is_closed()) {
                    *guard = None;
                }
                drop(guard);
                Err(self.fenced_since().await.unwrap_or(e))
            }
            Ok(()) => Ok(()),
        }
    }

    /// Whether another broker took over since our epoch, asked on a new connection. A standby
    /// that takes over ends the serving broker's connections, so the replaced broker's next
    /// write fails with a lost connection before it can read the epoch: this turns that into
    /// [`ErrorKind::Fenced`]. `None` when the epoch is still ours or cannot be read.
    async fn fenced_since(&self) -> Option<StorageError> {
        let client = connect(&self.config).await.ok()?;
        let row = client
            .query_opt("SELECT epoch FROM mercurio_leader WHERE id = 1", &[])
            .await
            .ok()??;
        let current: i64 = row.get(0);
        (current != self.epoch()).then(|| self.fenced(current))
    }
}

struct OpenedConnection {
    writer: WriteConnection,
    pid: i32,
}

async fn open_writer(config: &PgConfig) -> Result<OpenedConnection, StorageError> {
    let client = connect(config).await?;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| classify(e, "cannot set up the connection"))?
        .get(0);
    leader::zero_timeouts(&client).await?;
    Ok(OpenedConnection {
        writer: WriteConnection {
            statements: None,
            client,
        },
        pid,
    })
}

#[async_trait]
impl Storage for PostgresStorage {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn load(&self) -> Result<LoadedState, StorageError> {
        // A new broker starts: what nothing refers to goes, and it holds the rest.
        self.write(&[], true).await?;
        let guard = self.writer().await?;
        let Some(writer) = guard.as_ref() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        load_all(&writer.client, true)
            .await
            .map_err(|e| classify(e, "cannot load the stored state"))
    }

    async fn load_without_queues(&self) -> Result<LoadedState, StorageError> {
        self.write(&[], true).await?;
        let guard = self.writer().await?;
        let Some(writer) = guard.as_ref() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        load_all(&writer.client, false)
            .await
            .map_err(|e| classify(e, "cannot load the stored state"))
    }

    async fn load_queue(&self, client_id: &str) -> Result<Vec<QueuedRecord>, StorageError> {
        let guard = self.writer().await?;
        let Some(writer) = guard.as_ref() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        load::load_queue(&writer.client, client_id)
            .await
            .map_err(|e| classify(e, "cannot load a queue"))?
            .map_err(|cause| StorageError::refused(format!("the queue of {client_id}: {cause}")))
    }

    async fn load_messages(&self, ids: &[u64]) -> Result<Vec<StoredMessage>, StorageError> {
        let guard = self.writer().await?;
        let Some(writer) = guard.as_ref() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        load::load_messages(&writer.client, ids)
            .await
            .map_err(|e| classify(e, "cannot load messages"))
    }

    async fn read_stream(
        &self,
        stream: &str,
        from_offset: u64,
        from_time_ms: u64,
        max: usize,
        max_bytes: u64,
    ) -> Result<Vec<crate::StreamEntryRead>, StorageError> {
        let guard = self.writer().await?;
        let Some(writer) = guard.as_ref() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        load::read_stream(
            &writer.client,
            stream,
            from_offset,
            from_time_ms,
            max,
            max_bytes,
        )
        .await
        .map_err(|e| classify(e, "cannot read a stream"))
    }

    async fn apply(&self, batch: &[Change]) -> Result<(), StorageError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.write(batch, false).await
    }

    async fn delete_session(&self, client_id: &str) -> Result<bool, StorageError> {
        let existed = {
            let guard = self.writer().await?;
            let Some(writer) = guard.as_ref() else {
                return Err(StorageError::fatal("the PostgreSQL storage is closed"));
            };
            writer
                .client
                .query_opt(
                    "SELECT 1 FROM mercurio_sessions WHERE client_id = $1",
                    &[&client_id],
                )
                .await
                .map_err(|e| classify(e, "cannot read the session"))?
                .is_some()
        };
        self.write(
            &[Change::SessionDeleted {
                client_id: client_id.to_string(),
            }],
            false,
        )
        .await?;
        Ok(existed)
    }

    async fn load_access(&self) -> Result<Vec<AccessRecord>, StorageError> {
        let guard = self.writer().await?;
        let Some(writer) = guard.as_ref() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        let rows = writer
            .client
            .query(
                "SELECT kind, name, body FROM mercurio_access ORDER BY kind, name",
                &[],
            )
            .await
            .map_err(|e| classify(e, "cannot load the access records"))?;
        let mut records: Vec<AccessRecord> = rows
            .iter()
            .filter_map(|row| {
                // A kind a newer version wrote is left alone.
                let kind = AccessKind::parse(row.get::<_, &str>(0))?;
                Some(AccessRecord {
                    kind,
                    name: row.get(1),
                    body: row.get(2),
                })
            })
            .collect();
        records.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
        Ok(records)
    }

    async fn apply_access(&self, changes: &[AccessChange]) -> Result<(), StorageError> {
        validate_access(changes)?;
        let mut guard = self.writer().await?;
        let Some(writer) = guard.as_mut() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        let result = plan::write_access(writer, changes, self.epoch()).await;
        self.written(guard, result).await
    }

    async fn flush(&self) -> Result<(), StorageError> {
        // Every commit is durable when it returns.
        self.check_open()
    }

    async fn close(&self) -> Result<(), StorageError> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        *self.writer.lock().await = None;
        self.leadership.release().await;
        Ok(())
    }

    fn lapsed(&self) -> bool {
        self.leadership.lapsed()
    }

    async fn failed(&self) -> StorageError {
        let mut failed = self.failed.clone();
        loop {
            if let Some((kind, message)) = failed.borrow_and_update().clone() {
                return StorageError::new(kind, message);
            }
            if failed.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}
