//! [`PostgresStorage`]: a PostgreSQL database (12 or later), served by one broker at a time.
//!
//! - Writes go through one connection, in one transaction per batch, its statements pipelined
//!   (sent together, one round trip), a batch written as what it leaves: per client and
//!   table, one multi-row DELETE and one multi-row INSERT for a run of changes (see
//!   `plan`), so that a message queued then dequeued, or set in flight then acknowledged,
//!   in the same batch writes no row. Each write transaction first takes the fence lock
//!   shared (a transaction-level advisory lock that a takeover takes exclusively, see
//!   [`leader`]), then reads the leader epoch; a transaction from an older epoch is rolled
//!   back and refused with
//!   [`ErrorKind::Fenced`](crate::ErrorKind::Fenced), and [`Storage::failed`] resolves: the
//!   broker stops at once. Commits are durable (`synchronous_commit` as the server has it).
//! - Leadership ([`leader`]): a session-level advisory lock on a dedicated connection, a
//!   heartbeat row, standbys, takeovers and the lost-database stop (DESIGN.md section 7).
//! - The schema version is in `mercurio_meta`; a newer one is refused
//!   ([`ErrorKind::Incompatible`](crate::ErrorKind::Incompatible)). A standby migrates only
//!   once it serves.
//! - A session whose rows cannot be read is set aside, as with SQLite.

pub mod leader;
#[cfg(any(test, feature = "conformance"))]
pub mod testing;
mod tls;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{watch, Mutex};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement};

use crate::change::Change;
use crate::error::{ErrorKind, StorageError};
use crate::memory::validate_values;
use crate::records::{
    InflightRecord, InflightState, MessageRecord, QueuedRecord, RetainedRecord, SessionHeader,
    SessionRecord, SubscriptionRecord, WillRecord,
};
use crate::{LoadedState, SetAside, Storage};

pub use leader::{Leadership, HEARTBEAT_STALE, LOST_AFTER};

/// The schema version this build writes and reads (`mercurio_meta.schema_version`).
///
/// 2: write transactions are fenced by a transaction-level advisory lock instead of a row
/// lock on `mercurio_leader` (which made the heartbeat wait behind long writes); an older
/// broker, which fences differently, must not serve these tables; and
/// `mercurio_sessions.username`.
pub const SCHEMA_VERSION: i64 = 2;

/// How long opening a connection may take before it counts as unreachable.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS mercurio_meta (
    key text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE IF NOT EXISTS mercurio_leader (
    id integer PRIMARY KEY CHECK (id = 1),
    epoch bigint NOT NULL,
    host text NOT NULL,
    pid bigint NOT NULL,
    backend_pids integer[] NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    since timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS mercurio_takeovers (
    epoch bigint PRIMARY KEY,
    host text NOT NULL,
    pid bigint NOT NULL,
    previous_host text,
    previous_heartbeat_at timestamptz,
    at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS mercurio_sessions (
    client_id text PRIMARY KEY,
    protocol_level bigint NOT NULL,
    session_expiry_interval bigint NOT NULL,
    disconnected_at bigint,
    will_topic text,
    will_payload bytea,
    will_qos bigint,
    will_retain boolean,
    will_properties bytea,
    will_expires_at bigint,
    will_publisher text,
    will_delay_interval bigint
);
CREATE TABLE IF NOT EXISTS mercurio_subscriptions (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    filter text NOT NULL,
    qos bigint NOT NULL,
    no_local boolean NOT NULL,
    retain_as_published boolean NOT NULL,
    retain_handling bigint NOT NULL,
    subscription_identifier bigint,
    PRIMARY KEY (client_id, filter)
);
CREATE TABLE IF NOT EXISTS mercurio_queued (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    seq bigint NOT NULL,
    topic text NOT NULL,
    payload bytea NOT NULL,
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    properties bytea NOT NULL,
    expires_at bigint,
    publisher text,
    PRIMARY KEY (client_id, seq)
);
CREATE TABLE IF NOT EXISTS mercurio_inflight (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    packet_id bigint NOT NULL,
    ord bigint NOT NULL,
    state text NOT NULL,
    topic text NOT NULL,
    payload bytea NOT NULL,
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    properties bytea NOT NULL,
    expires_at bigint,
    publisher text,
    PRIMARY KEY (client_id, packet_id)
);
CREATE TABLE IF NOT EXISTS mercurio_inbound_qos2 (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    packet_id bigint NOT NULL,
    PRIMARY KEY (client_id, packet_id)
);
CREATE TABLE IF NOT EXISTS mercurio_retained (
    topic text PRIMARY KEY,
    payload bytea NOT NULL,
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    properties bytea NOT NULL,
    expires_at bigint,
    publisher text
);
ALTER TABLE mercurio_sessions ADD COLUMN IF NOT EXISTS username text;
";

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

/// The statements a write connection prepares once.
struct Statements {
    fence: Statement,
    epoch: Statement,
    save_header: Statement,
    delete_children: [Statement; 4],
    delete_session: Statement,
    set_will: Statement,
    add_subscription: Statement,
    queue: Statement,
    set_inflight: Statement,
    add_inbound: Statement,
    /// The multi-row forms, one statement for what a run of changes of one client leaves
    /// in one table (see `plan`).
    exists: Statement,
    queue_many: Statement,
    dequeue_many: Statement,
    set_inflight_many: Statement,
    remove_inflight_many: Statement,
    add_subscriptions: Statement,
    remove_subscriptions: Statement,
    add_inbound_many: Statement,
    remove_inbound_many: Statement,
    set_retained_many: Statement,
    delete_retained_many: Statement,
}

struct Writer {
    client: Client,
    /// Prepared on first use, once the schema exists (after the lead is taken).
    statements: Option<Statements>,
}

/// Storage in a PostgreSQL database. See the [module documentation](self).
pub struct PostgresStorage {
    config: PgConfig,
    writer: Mutex<Option<Writer>>,
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

/// The schema version recorded in the database, `None` when it has no Mercurio tables.
pub(crate) async fn schema_version(
    client: &impl tokio_postgres::GenericClient,
) -> Result<Option<i64>, StorageError> {
    let row = client
        .query_one("SELECT to_regclass('mercurio_meta') IS NOT NULL", &[])
        .await
        .map_err(|e| classify(e, "cannot read the schema"))?;
    if !row.get::<_, bool>(0) {
        return Ok(None);
    }
    let row = client
        .query_opt(
            "SELECT value FROM mercurio_meta WHERE key = 'schema_version'",
            &[],
        )
        .await
        .map_err(|e| classify(e, "cannot read the schema version"))?;
    match row {
        None => Ok(Some(0)),
        Some(row) => {
            let value: String = row.get(0);
            value.parse().map(Some).map_err(|_| {
                StorageError::incompatible(format!("schema version {value:?} is not a number"))
            })
        }
    }
}

/// Refuses a schema newer than this build's.
pub(crate) fn check_version(version: Option<i64>) -> Result<(), StorageError> {
    match version {
        Some(v) if v > SCHEMA_VERSION => Err(StorageError::incompatible(format!(
            "the database has schema version {v}, newer than this broker's {SCHEMA_VERSION}: \
             it was written by a newer version of Mercurio"
        ))),
        _ => Ok(()),
    }
}

/// Creates or updates the tables (only the serving broker does).
pub(crate) async fn migrate(client: &mut Client) -> Result<(), StorageError> {
    let tx = client
        .transaction()
        .await
        .map_err(|e| classify(e, "cannot create the schema"))?;
    let version = schema_version(&tx).await?;
    check_version(version)?;
    if version != Some(SCHEMA_VERSION) {
        tx.batch_execute(SCHEMA)
            .await
            .map_err(|e| classify(e, "cannot create the schema"))?;
        tx.execute(
            "INSERT INTO mercurio_meta (key, value) VALUES ('schema_version', $1) \
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            &[&SCHEMA_VERSION.to_string()],
        )
        .await
        .map_err(|e| classify(e, "cannot record the schema version"))?;
    }
    tx.commit()
        .await
        .map_err(|e| classify(e, "cannot create the schema"))
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
    async fn writer(&self) -> Result<tokio::sync::MutexGuard<'_, Option<Writer>>, StorageError> {
        self.check_open()?;
        let mut guard = self.writer.lock().await;
        if guard.as_ref().map_or(true, |w| w.client.is_closed()) {
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

    async fn write(&self, batch: &[Change]) -> Result<(), StorageError> {
        for (index, change) in batch.iter().enumerate() {
            validate_values(change).map_err(|reason| refused(index, change, &reason))?;
            if let Change::SessionWritten(r) = change {
                let mut seqs = std::collections::BTreeSet::new();
                for q in &r.queued {
                    if !seqs.insert(q.seq) {
                        return Err(refused(index, change, "a queued seq appears twice"));
                    }
                }
            }
        }
        let mut guard = self.writer().await?;
        let Some(writer) = guard.as_mut() else {
            return Err(StorageError::fatal("the PostgreSQL storage is closed"));
        };
        let result = write_batch(writer, batch, self.epoch()).await;
        match result {
            Err(WriteError::Fenced(epoch)) => Err(self.fenced(epoch)),
            Err(WriteError::Storage(e)) => {
                if e.is_transient() && writer.client.is_closed() {
                    *guard = None;
                }
                Err(e)
            }
            Ok(()) => Ok(()),
        }
    }
}

struct OpenedWriter {
    writer: Writer,
    pid: i32,
}

async fn open_writer(config: &PgConfig) -> Result<OpenedWriter, StorageError> {
    let client = connect(config).await?;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| classify(e, "cannot set up the connection"))?
        .get(0);
    leader::zero_timeouts(&client).await?;
    Ok(OpenedWriter {
        writer: Writer {
            statements: None,
            client,
        },
        pid,
    })
}

const MESSAGE_COLUMNS: &str = "topic, payload, qos, retain, properties, expires_at, publisher";
/// The array parameters of [`MessageColumns`], numbered from 1, 3 or 4.
const MESSAGE_ARRAYS_FROM_1: &str =
    "$1::text[], $2::bytea[], $3::bigint[], $4::boolean[], $5::bytea[], $6::bigint[], $7::text[]";
const MESSAGE_ARRAYS_FROM_3: &str =
    "$3::text[], $4::bytea[], $5::bigint[], $6::boolean[], $7::bytea[], $8::bigint[], $9::text[]";
const MESSAGE_ARRAYS_FROM_4: &str = "$4::text[], $5::bytea[], $6::bigint[], $7::boolean[], \
     $8::bytea[], $9::bigint[], $10::text[]";

impl Statements {
    async fn prepare(client: &Client) -> Result<Statements, tokio_postgres::Error> {
        let p = |sql: String| async move { client.prepare(&sql).await };
        Ok(Statements {
            fence: p(format!(
                "SELECT pg_advisory_xact_lock_shared({}, {})",
                leader::LOCK_CLASS,
                leader::FENCE_OBJECT
            ))
            .await?,
            epoch: p("SELECT epoch FROM mercurio_leader WHERE id = 1".into()).await?,
            save_header: p("INSERT INTO mercurio_sessions (client_id, protocol_level, \
                 session_expiry_interval, disconnected_at, username) VALUES ($1, $2, $3, $4, \
                 $5) ON CONFLICT (client_id) DO UPDATE SET \
                 protocol_level = excluded.protocol_level, \
                 session_expiry_interval = excluded.session_expiry_interval, \
                 disconnected_at = excluded.disconnected_at, username = excluded.username"
                .into())
            .await?,
            delete_children: [
                p("DELETE FROM mercurio_subscriptions WHERE client_id = $1".into()).await?,
                p("DELETE FROM mercurio_queued WHERE client_id = $1".into()).await?,
                p("DELETE FROM mercurio_inflight WHERE client_id = $1".into()).await?,
                p("DELETE FROM mercurio_inbound_qos2 WHERE client_id = $1".into()).await?,
            ],
            delete_session: p("DELETE FROM mercurio_sessions WHERE client_id = $1".into()).await?,
            set_will: p(
                "UPDATE mercurio_sessions SET will_topic = $2, will_payload = $3, \
                 will_qos = $4, will_retain = $5, will_properties = $6, will_expires_at = $7, \
                 will_publisher = $8, will_delay_interval = $9 WHERE client_id = $1"
                    .into(),
            )
            .await?,
            add_subscription: p(
                "INSERT INTO mercurio_subscriptions (client_id, filter, qos, \
                 no_local, retain_as_published, retain_handling, subscription_identifier) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (client_id, filter) DO UPDATE \
                 SET qos = excluded.qos, no_local = excluded.no_local, \
                 retain_as_published = excluded.retain_as_published, \
                 retain_handling = excluded.retain_handling, \
                 subscription_identifier = excluded.subscription_identifier"
                    .into(),
            )
            .await?,
            queue: p(format!(
                "INSERT INTO mercurio_queued (client_id, seq, {MESSAGE_COLUMNS}) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (client_id, seq) \
                 DO UPDATE SET topic = excluded.topic, payload = excluded.payload, \
                 qos = excluded.qos, retain = excluded.retain, \
                 properties = excluded.properties, expires_at = excluded.expires_at, \
                 publisher = excluded.publisher"
            ))
            .await?,
            set_inflight: p(format!(
                "INSERT INTO mercurio_inflight (client_id, packet_id, ord, state, \
                 {MESSAGE_COLUMNS}) VALUES ($1, $2, \
                 (SELECT COALESCE(MAX(ord), 0) + 1 FROM mercurio_inflight WHERE client_id = $1), \
                 $3, $4, $5, $6, $7, $8, $9, $10) \
                 ON CONFLICT (client_id, packet_id) DO UPDATE SET state = excluded.state, \
                 topic = excluded.topic, payload = excluded.payload, qos = excluded.qos, \
                 retain = excluded.retain, properties = excluded.properties, \
                 expires_at = excluded.expires_at, publisher = excluded.publisher"
            ))
            .await?,
            add_inbound: p("INSERT INTO mercurio_inbound_qos2 (client_id, packet_id) \
                 VALUES ($1, $2) ON CONFLICT DO NOTHING"
                .into())
            .await?,
            exists: p("SELECT 1 FROM mercurio_sessions WHERE client_id = $1".into()).await?,
            queue_many: p(format!(
                "INSERT INTO mercurio_queued (client_id, seq, {MESSAGE_COLUMNS}) \
                 SELECT $1::text, u.* FROM unnest($2::bigint[], {MESSAGE_ARRAYS_FROM_3}) AS u \
                 ON CONFLICT (client_id, seq) \
                 DO UPDATE SET topic = excluded.topic, payload = excluded.payload, \
                 qos = excluded.qos, retain = excluded.retain, \
                 properties = excluded.properties, expires_at = excluded.expires_at, \
                 publisher = excluded.publisher"
            ))
            .await?,
            dequeue_many: p(
                "DELETE FROM mercurio_queued WHERE client_id = $1 AND seq = ANY($2::bigint[])"
                    .into(),
            )
            .await?,
            // New entries go after every stored one of the client, in the order of the
            // arrays; an entry already stored keeps its place (`ord` is not updated).
            set_inflight_many: p(format!(
                "INSERT INTO mercurio_inflight (client_id, packet_id, ord, state, \
                 {MESSAGE_COLUMNS}) \
                 SELECT $1::text, u.packet_id, b.max_ord + u.n, u.state, u.topic, u.payload, \
                 u.qos, u.retain, u.properties, u.expires_at, u.publisher \
                 FROM unnest($2::bigint[], $3::text[], {MESSAGE_ARRAYS_FROM_4}) \
                 WITH ORDINALITY AS u (packet_id, state, {MESSAGE_COLUMNS}, n), \
                 (SELECT COALESCE(MAX(ord), 0) AS max_ord FROM mercurio_inflight \
                 WHERE client_id = $1) AS b \
                 ON CONFLICT (client_id, packet_id) DO UPDATE SET state = excluded.state, \
                 topic = excluded.topic, payload = excluded.payload, qos = excluded.qos, \
                 retain = excluded.retain, properties = excluded.properties, \
                 expires_at = excluded.expires_at, publisher = excluded.publisher"
            ))
            .await?,
            remove_inflight_many: p("DELETE FROM mercurio_inflight WHERE client_id = $1 \
                 AND packet_id = ANY($2::bigint[])"
                .into())
            .await?,
            add_subscriptions: p(
                "INSERT INTO mercurio_subscriptions (client_id, filter, qos, \
                 no_local, retain_as_published, retain_handling, subscription_identifier) \
                 SELECT $1::text, u.* FROM unnest($2::text[], $3::bigint[], $4::boolean[], \
                 $5::boolean[], $6::bigint[], $7::bigint[]) AS u \
                 ON CONFLICT (client_id, filter) DO UPDATE \
                 SET qos = excluded.qos, no_local = excluded.no_local, \
                 retain_as_published = excluded.retain_as_published, \
                 retain_handling = excluded.retain_handling, \
                 subscription_identifier = excluded.subscription_identifier"
                    .into(),
            )
            .await?,
            remove_subscriptions: p("DELETE FROM mercurio_subscriptions WHERE client_id = $1 \
                 AND filter = ANY($2::text[])"
                .into())
            .await?,
            add_inbound_many: p("INSERT INTO mercurio_inbound_qos2 (client_id, packet_id) \
                 SELECT $1::text, u.* FROM unnest($2::bigint[]) AS u ON CONFLICT DO NOTHING"
                .into())
            .await?,
            remove_inbound_many: p("DELETE FROM mercurio_inbound_qos2 WHERE client_id = $1 \
                 AND packet_id = ANY($2::bigint[])"
                .into())
            .await?,
            set_retained_many: p(format!(
                "INSERT INTO mercurio_retained ({MESSAGE_COLUMNS}) \
                 SELECT u.* FROM unnest({MESSAGE_ARRAYS_FROM_1}) AS u \
                 ON CONFLICT (topic) DO UPDATE SET \
                 payload = excluded.payload, qos = excluded.qos, retain = excluded.retain, \
                 properties = excluded.properties, expires_at = excluded.expires_at, \
                 publisher = excluded.publisher"
            ))
            .await?,
            delete_retained_many: p(
                "DELETE FROM mercurio_retained WHERE topic = ANY($1::text[])".into(),
            )
            .await?,
        })
    }
}

type Param = Box<dyn ToSql + Sync + Send>;

/// One statement of a batch: which change it serves, whether it must touch a row (an
/// addition to a session that must be stored).
struct Op<'a> {
    index: usize,
    statement: &'a Statement,
    params: Vec<Param>,
    must_touch: bool,
}

fn int(v: impl Into<i64>) -> Param {
    Box::new(v.into())
}

fn big(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn text(v: &str) -> Param {
    Box::new(v.to_string())
}

fn message_params(m: &MessageRecord) -> Vec<Param> {
    vec![
        text(&m.topic),
        Box::new(m.payload.to_vec()),
        int(m.qos),
        Box::new(m.retain),
        Box::new(m.properties.to_vec()),
        Box::new(m.expires_at.map(big)),
        Box::new(m.publisher.clone()),
    ]
}

fn header_params(h: &SessionHeader) -> Vec<Param> {
    vec![
        text(&h.client_id),
        int(h.protocol_level),
        int(h.session_expiry_interval),
        Box::new(h.disconnected_at.map(big)),
        Box::new(h.username.clone()),
    ]
}

fn will_params(id: &str, will: Option<&WillRecord>) -> Vec<Param> {
    let m = will.map(|w| &w.message);
    vec![
        text(id),
        Box::new(m.map(|m| m.topic.clone())),
        Box::new(m.map(|m| m.payload.to_vec())),
        Box::new(m.map(|m| i64::from(m.qos))),
        Box::new(m.map(|m| m.retain)),
        Box::new(m.map(|m| m.properties.to_vec())),
        Box::new(m.and_then(|m| m.expires_at.map(big))),
        Box::new(m.and_then(|m| m.publisher.clone())),
        Box::new(will.map(|w| i64::from(w.delay_interval))),
    ]
}

fn subscription_params(id: &str, s: &SubscriptionRecord) -> Vec<Param> {
    vec![
        text(id),
        text(&s.filter),
        int(s.qos),
        Box::new(s.no_local),
        Box::new(s.retain_as_published),
        int(s.retain_handling),
        Box::new(s.subscription_identifier.map(i64::from)),
    ]
}

fn queued_params(id: &str, seq: u64, m: &MessageRecord) -> Vec<Param> {
    let mut params = vec![text(id), Box::new(big(seq)) as Param];
    params.extend(message_params(m));
    params
}

fn inflight_params(id: &str, f: &InflightRecord) -> Vec<Param> {
    let mut params = vec![text(id), int(f.packet_id), text(f.state.as_str())];
    params.extend(message_params(&f.message));
    params
}

/// The statements of a session change (`SessionSaved`, `SessionWritten`, `SessionDeleted`),
/// in order.
fn ops_of<'a>(s: &'a Statements, index: usize, change: &Change, out: &mut Vec<Op<'a>>) {
    let mut push = |statement: &'a Statement, params: Vec<Param>, must_touch: bool| {
        out.push(Op {
            index,
            statement,
            params,
            must_touch,
        })
    };
    match change {
        Change::SessionSaved(h) => push(&s.save_header, header_params(h), false),
        Change::SessionWritten(r) => {
            for statement in &s.delete_children {
                push(statement, vec![text(&r.client_id)], false);
            }
            push(&s.delete_session, vec![text(&r.client_id)], false);
            push(&s.save_header, header_params(&r.header()), false);
            push(
                &s.set_will,
                will_params(&r.client_id, r.will.as_ref()),
                false,
            );
            for sub in &r.subscriptions {
                push(
                    &s.add_subscription,
                    subscription_params(&r.client_id, sub),
                    false,
                );
            }
            for q in &r.queued {
                push(
                    &s.queue,
                    queued_params(&r.client_id, q.seq, &q.message),
                    false,
                );
            }
            for f in &r.inflight {
                push(&s.set_inflight, inflight_params(&r.client_id, f), false);
            }
            for id in &r.inbound_qos2 {
                push(&s.add_inbound, vec![text(&r.client_id), int(*id)], false);
            }
        }
        Change::SessionDeleted { client_id } => {
            for statement in &s.delete_children {
                push(statement, vec![text(client_id)], false);
            }
            push(&s.delete_session, vec![text(client_id)], false);
        }
        _ => unreachable!("planned with the other changes of its run, see `plan`"),
    }
}

/// The statements of `batch`, fewer than one per change: what the batch leaves in the
/// database, not every step to it.
///
/// The changes of different clients touch different rows (and those of the retained set
/// rows of their own), so each client's changes are planned apart, in order. For one client,
/// a session change (`SessionSaved`, `SessionWritten`, `SessionDeleted`) is written as it
/// comes; between two of them (a "run"), each table gets what the run leaves for each key
/// (the last change of a queued seq, of a packet identifier, of a filter; the will) as at
/// most one multi-row DELETE and one multi-row INSERT. So a message queued then dequeued, or
/// an in-flight entry set then removed, in the same batch costs only the DELETE (which finds
/// nothing if the row was never stored), and a drained message costs no in-flight row when
/// its acknowledgement is in the same batch.
///
/// What the database refuses is unchanged: a run with an addition (subscription, will,
/// message, in-flight entry, inbound identifier) for a session that is not stored is refused
/// even when a later change of the run cancels it (a `SELECT` that must find the session),
/// and the batch is one transaction as before.
fn plan<'a>(s: &'a Statements, batch: &[Change], out: &mut Vec<Op<'a>>) {
    // Each client's changes (None: the retained set), in order of first appearance.
    let mut groups: Vec<(Option<&str>, Vec<usize>)> = Vec::new();
    let mut position: HashMap<Option<&str>, usize> = HashMap::new();
    for (index, change) in batch.iter().enumerate() {
        let key = change.client_id();
        let at = *position.entry(key).or_insert_with(|| {
            groups.push((key, Vec::new()));
            groups.len() - 1
        });
        groups[at].1.push(index);
    }
    for (client_id, indices) in groups {
        let Some(client_id) = client_id else {
            plan_retained(s, batch, &indices, out);
            continue;
        };
        // Whether the session is stored for sure: created earlier in this batch.
        let mut created = false;
        let mut run = Run::default();
        for index in indices {
            let change = &batch[index];
            match change {
                Change::SessionSaved(_)
                | Change::SessionWritten(_)
                | Change::SessionDeleted { .. } => {
                    std::mem::take(&mut run).plan(s, client_id, created, out);
                    ops_of(s, index, change, out);
                    created = change.creates_session();
                }
                _ => run.add(index, change),
            }
        }
        run.plan(s, client_id, created, out);
    }
}

/// What the last change of a key in a run leaves: `Some` stored, `None` removed; with the
/// index of the first change of the run on that key (for error messages).
type Last<'c, T> = (usize, Option<&'c T>);

/// The changes of one client between two session changes, reduced to what they leave.
#[derive(Default)]
struct Run<'c> {
    /// The first addition of the run, if any: the session must be stored.
    first_addition: Option<usize>,
    will: Option<Last<'c, WillRecord>>,
    subscriptions: BTreeMap<&'c str, Last<'c, SubscriptionRecord>>,
    queued: BTreeMap<u64, Last<'c, MessageRecord>>,
    inflight: BTreeMap<u16, InflightLast<'c>>,
    inbound: BTreeMap<u16, Last<'c, ()>>,
}

struct InflightLast<'c> {
    /// The first change of the run on this packet identifier.
    index: usize,
    /// Removed at some point of the run: a stored entry is deleted, and a later set makes a
    /// new entry (it goes last).
    removed: bool,
    /// Set after the last removal, if any.
    last: Option<&'c InflightRecord>,
    /// The position of the first set after the last removal: the order of new entries.
    rank: usize,
}

fn keep<'c, K: Ord, T>(map: &mut BTreeMap<K, Last<'c, T>>, key: K, index: usize, v: Option<&'c T>) {
    map.entry(key).or_insert((index, None)).1 = v;
}

impl<'c> Run<'c> {
    fn add(&mut self, index: usize, change: &'c Change) {
        let addition = matches!(
            change,
            Change::SubscriptionAdded { .. }
                | Change::WillSet { .. }
                | Change::MessageQueued { .. }
                | Change::InflightSet { .. }
                | Change::InboundQos2Added { .. }
        );
        if addition && self.first_addition.is_none() {
            self.first_addition = Some(index);
        }
        match change {
            Change::SubscriptionAdded { subscription, .. } => keep(
                &mut self.subscriptions,
                &subscription.filter,
                index,
                Some(subscription),
            ),
            Change::SubscriptionRemoved { filter, .. } => {
                keep(&mut self.subscriptions, filter, index, None)
            }
            Change::WillSet { will, .. } => {
                let first = self.will.map_or(index, |(first, _)| first);
                self.will = Some((first, Some(will)));
            }
            Change::WillCleared { .. } => {
                let first = self.will.map_or(index, |(first, _)| first);
                self.will = Some((first, None));
            }
            Change::MessageQueued { seq, message, .. } => {
                keep(&mut self.queued, *seq, index, Some(message))
            }
            Change::MessageDequeued { seq, .. } => keep(&mut self.queued, *seq, index, None),
            Change::InflightSet { inflight, .. } => {
                let entry = self
                    .inflight
                    .entry(inflight.packet_id)
                    .or_insert(InflightLast {
                        index,
                        removed: false,
                        last: None,
                        rank: index,
                    });
                if entry.last.is_none() {
                    entry.rank = index;
                }
                entry.last = Some(inflight);
            }
            Change::InflightRemoved { packet_id, .. } => {
                let entry = self.inflight.entry(*packet_id).or_insert(InflightLast {
                    index,
                    removed: false,
                    last: None,
                    rank: index,
                });
                entry.removed = true;
                entry.last = None;
            }
            Change::InboundQos2Added { packet_id, .. } => {
                keep(&mut self.inbound, *packet_id, index, Some(&()))
            }
            Change::InboundQos2Removed { packet_id, .. } => {
                keep(&mut self.inbound, *packet_id, index, None)
            }
            Change::SessionSaved(_)
            | Change::SessionWritten(_)
            | Change::SessionDeleted { .. }
            | Change::RetainedSet(_)
            | Change::RetainedDeleted { .. } => unreachable!("not part of a run"),
        }
    }

    /// The statements of the run; `created`: the session was created earlier in the batch.
    fn plan<'a>(self, s: &'a Statements, client_id: &str, created: bool, out: &mut Vec<Op<'a>>) {
        let mut push = |index: usize, statement: &'a Statement, params: Vec<Param>, must_touch| {
            out.push(Op {
                index,
                statement,
                params,
                must_touch,
            })
        };
        if let Some(index) = self.first_addition.filter(|_| !created) {
            push(index, &s.exists, vec![text(client_id)], true);
        }
        if let Some((index, will)) = self.will {
            push(index, &s.set_will, will_params(client_id, will), false);
        }
        // Deletions first: they and the insertions of the same table have no key in common.
        let Split {
            removed,
            set,
            first_set,
        } = split(&self.subscriptions);
        if let Some(index) = removed.first().map(|(index, _)| *index) {
            let filters: Vec<String> = removed.iter().map(|(_, f)| f.to_string()).collect();
            push(
                index,
                &s.remove_subscriptions,
                vec![text(client_id), Box::new(filters)],
                false,
            );
        }
        if !set.is_empty() {
            let index = first_set;
            let mut c = SubscriptionColumns::default();
            for (_, sub) in &set {
                c.push(sub);
            }
            let mut params = vec![text(client_id)];
            params.extend(c.into_params());
            push(index, &s.add_subscriptions, params, false);
        }
        let Split {
            removed,
            set,
            first_set,
        } = split(&self.queued);
        if let Some(index) = removed.first().map(|(index, _)| *index) {
            let seqs: Vec<i64> = removed.iter().map(|(_, seq)| big(**seq)).collect();
            push(
                index,
                &s.dequeue_many,
                vec![text(client_id), Box::new(seqs)],
                false,
            );
        }
        if !set.is_empty() {
            let index = first_set;
            let mut seqs = Vec::with_capacity(set.len());
            let mut c = MessageColumns::default();
            for (seq, message) in &set {
                seqs.push(big(**seq));
                c.push(message);
            }
            let mut params = vec![text(client_id), Box::new(seqs) as Param];
            params.extend(c.into_params());
            push(index, &s.queue_many, params, false);
        }
        let removed: Vec<(usize, i64)> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.removed)
            .map(|(id, f)| (f.index, i64::from(*id)))
            .collect();
        if let Some(index) = removed.iter().map(|(index, _)| *index).min() {
            let ids: Vec<i64> = removed.iter().map(|(_, id)| *id).collect();
            push(
                index,
                &s.remove_inflight_many,
                vec![text(client_id), Box::new(ids)],
                false,
            );
        }
        let mut set: Vec<(usize, usize, &InflightRecord)> = self
            .inflight
            .values()
            .filter_map(|f| f.last.map(|r| (f.rank, f.index, r)))
            .collect();
        set.sort_by_key(|(rank, _, _)| *rank);
        if let Some(index) = set.iter().map(|(_, index, _)| *index).min() {
            let mut ids = Vec::with_capacity(set.len());
            let mut states = Vec::with_capacity(set.len());
            let mut c = MessageColumns::default();
            for (_, _, f) in &set {
                ids.push(i64::from(f.packet_id));
                states.push(f.state.as_str().to_string());
                c.push(&f.message);
            }
            let mut params = vec![text(client_id), Box::new(ids) as Param, Box::new(states)];
            params.extend(c.into_params());
            push(index, &s.set_inflight_many, params, false);
        }
        let Split {
            removed,
            set,
            first_set,
        } = split(&self.inbound);
        if let Some(index) = removed.first().map(|(index, _)| *index) {
            let ids: Vec<i64> = removed.iter().map(|(_, id)| i64::from(**id)).collect();
            push(
                index,
                &s.remove_inbound_many,
                vec![text(client_id), Box::new(ids)],
                false,
            );
        }
        if !set.is_empty() {
            let index = first_set;
            let ids: Vec<i64> = set.iter().map(|(id, _)| i64::from(**id)).collect();
            push(
                index,
                &s.add_inbound_many,
                vec![text(client_id), Box::new(ids)],
                false,
            );
        }
    }
}

/// What a run leaves for the keys of one table: the keys removed (with the index of their
/// first change, smallest first) and the keys set, with the smallest index of those.
struct Split<'m, 'c, K, T> {
    removed: Vec<(usize, &'m K)>,
    set: Vec<(&'m K, &'c T)>,
    first_set: usize,
}

fn split<'m, 'c, K, T>(map: &'m BTreeMap<K, Last<'c, T>>) -> Split<'m, 'c, K, T> {
    let mut removed = Vec::new();
    let mut set = Vec::new();
    let mut first_set = usize::MAX;
    for (key, (index, value)) in map {
        match value {
            None => removed.push((*index, key)),
            Some(v) => {
                first_set = first_set.min(*index);
                set.push((key, *v));
            }
        }
    }
    removed.sort_by_key(|(index, _)| *index);
    Split {
        removed,
        set,
        first_set,
    }
}

/// The retained set's changes: the last one for each topic.
fn plan_retained<'a>(
    s: &'a Statements,
    batch: &[Change],
    indices: &[usize],
    out: &mut Vec<Op<'a>>,
) {
    let mut last: BTreeMap<&str, Last<'_, RetainedRecord>> = BTreeMap::new();
    for &index in indices {
        match &batch[index] {
            Change::RetainedSet(r) => keep(&mut last, r.message.topic.as_str(), index, Some(r)),
            Change::RetainedDeleted { topic } => keep(&mut last, topic.as_str(), index, None),
            _ => unreachable!("a change of the retained set"),
        }
    }
    let Split {
        removed,
        set,
        first_set,
    } = split(&last);
    if let Some(index) = removed.first().map(|(index, _)| *index) {
        let topics: Vec<String> = removed.iter().map(|(_, t)| t.to_string()).collect();
        out.push(Op {
            index,
            statement: &s.delete_retained_many,
            params: vec![Box::new(topics)],
            must_touch: false,
        });
    }
    if !set.is_empty() {
        let index = first_set;
        let mut c = MessageColumns::default();
        for (_, r) in &set {
            c.push(&r.message);
        }
        out.push(Op {
            index,
            statement: &s.set_retained_many,
            params: c.into_params(),
            must_touch: false,
        });
    }
}

/// Messages as one array per column, for `unnest`.
#[derive(Default)]
struct MessageColumns {
    topic: Vec<String>,
    payload: Vec<Vec<u8>>,
    qos: Vec<i64>,
    retain: Vec<bool>,
    properties: Vec<Vec<u8>>,
    expires_at: Vec<Option<i64>>,
    publisher: Vec<Option<String>>,
}

impl MessageColumns {
    fn push(&mut self, m: &MessageRecord) {
        self.topic.push(m.topic.clone());
        self.payload.push(m.payload.to_vec());
        self.qos.push(i64::from(m.qos));
        self.retain.push(m.retain);
        self.properties.push(m.properties.to_vec());
        self.expires_at.push(m.expires_at.map(big));
        self.publisher.push(m.publisher.clone());
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.topic),
            Box::new(self.payload),
            Box::new(self.qos),
            Box::new(self.retain),
            Box::new(self.properties),
            Box::new(self.expires_at),
            Box::new(self.publisher),
        ]
    }
}

/// Subscriptions as one array per column, for `unnest`.
#[derive(Default)]
struct SubscriptionColumns {
    filter: Vec<String>,
    qos: Vec<i64>,
    no_local: Vec<bool>,
    retain_as_published: Vec<bool>,
    retain_handling: Vec<i64>,
    identifier: Vec<Option<i64>>,
}

impl SubscriptionColumns {
    fn push(&mut self, s: &SubscriptionRecord) {
        self.filter.push(s.filter.clone());
        self.qos.push(i64::from(s.qos));
        self.no_local.push(s.no_local);
        self.retain_as_published.push(s.retain_as_published);
        self.retain_handling.push(i64::from(s.retain_handling));
        self.identifier
            .push(s.subscription_identifier.map(i64::from));
    }

    fn into_params(self) -> Vec<Param> {
        vec![
            Box::new(self.filter),
            Box::new(self.qos),
            Box::new(self.no_local),
            Box::new(self.retain_as_published),
            Box::new(self.retain_handling),
            Box::new(self.identifier),
        ]
    }
}

enum WriteError {
    /// The epoch in the database is this one, newer than ours.
    Fenced(i64),
    Storage(StorageError),
}

impl From<StorageError> for WriteError {
    fn from(e: StorageError) -> WriteError {
        WriteError::Storage(e)
    }
}

/// One transaction: the epoch check, then every change, pipelined; committed only when the
/// epoch is ours and every statement succeeded.
async fn write_batch(writer: &mut Writer, batch: &[Change], epoch: i64) -> Result<(), WriteError> {
    if writer.statements.is_none() {
        let prepared = Statements::prepare(&writer.client)
            .await
            .map_err(|e| classify(e, "cannot prepare the statements"))?;
        writer.statements = Some(prepared);
    }
    let Writer { client, statements } = writer;
    let statements = statements.as_ref().expect("prepared above");
    let tx = client
        .transaction()
        .await
        .map_err(|e| classify(e, "cannot begin a transaction"))?;
    let mut ops = Vec::new();
    plan(statements, batch, &mut ops);
    let refs: Vec<Vec<&(dyn ToSql + Sync)>> = ops
        .iter()
        .map(|op| {
            op.params
                .iter()
                .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                .collect()
        })
        .collect();
    // In this order on the server: the fence lock (held until commit, so a takeover waits
    // for this transaction), then the epoch, read after the lock (READ COMMITTED: each
    // statement sees what was committed before it started), then the writes.
    let fence = tx.execute(&statements.fence, &[]);
    let check = tx.query_opt(&statements.epoch, &[]);
    let writes = futures_util::future::join_all(
        ops.iter()
            .zip(&refs)
            .map(|(op, params)| tx.execute(op.statement, params)),
    );
    let (fenced, current, results) = tokio::join!(fence, check, writes);
    fenced.map_err(|e| classify(e, "cannot take the fence lock"))?;
    let current = current.map_err(|e| classify(e, "cannot check the leader epoch"))?;
    let current: i64 = current.map(|row| row.get(0)).unwrap_or(0);
    if current != epoch {
        drop(tx);
        return Err(WriteError::Fenced(current));
    }
    for (op, result) in ops.iter().zip(results) {
        let change = &batch[op.index];
        match result {
            Ok(0) if op.must_touch => {
                return Err(refused(op.index, change, "no session is stored for the client").into())
            }
            Ok(_) => {}
            Err(e) => {
                let e = classify(e, "");
                return Err(StorageError::new(
                    e.kind(),
                    format!(
                        "change {} ({}) for {}{}",
                        op.index,
                        change.kind(),
                        change.client_id().unwrap_or("the retained set"),
                        e.message()
                    ),
                )
                .into());
            }
        }
    }
    tx.commit()
        .await
        .map_err(|e| classify(e, "cannot commit").into())
}

fn refused(index: usize, change: &Change, reason: &str) -> StorageError {
    let target = change.client_id().unwrap_or("the retained set");
    StorageError::refused(format!(
        "change {index} ({}) for {target} refused: {reason}",
        change.kind()
    ))
}

fn qos(v: i64, what: &str) -> Result<u8, String> {
    match v {
        0..=2 => Ok(v as u8),
        _ => Err(format!("{what} QoS {v} is not 0, 1 or 2")),
    }
}

fn small<T: TryFrom<i64>>(v: i64, what: &str) -> Result<T, String> {
    T::try_from(v).map_err(|_| format!("{what} {v} is out of range"))
}

fn unsigned(v: i64, what: &str) -> Result<u64, String> {
    u64::try_from(v).map_err(|_| format!("{what}: negative value {v}"))
}

fn col<'a, T: tokio_postgres::types::FromSql<'a>>(row: &'a Row, i: usize) -> Result<T, String> {
    row.try_get::<_, T>(i).map_err(|e| {
        let name = row.columns().get(i).map(|c| c.name()).unwrap_or("?");
        format!("column {name}: {e}")
    })
}

/// A message from the columns topic, payload, qos, retain, properties, expires_at, publisher
/// starting at `at`.
fn message_at(row: &Row, at: usize) -> Result<MessageRecord, String> {
    Ok(MessageRecord {
        topic: col(row, at)?,
        payload: Bytes::from(col::<Vec<u8>>(row, at + 1)?),
        qos: qos(col(row, at + 2)?, "message")?,
        retain: col(row, at + 3)?,
        properties: Bytes::from(col::<Vec<u8>>(row, at + 4)?),
        expires_at: col::<Option<i64>>(row, at + 5)?
            .map(|v| unsigned(v, "expires_at"))
            .transpose()?,
        publisher: col(row, at + 6)?,
    })
}

type PerClient<T> = HashMap<String, Result<Vec<T>, String>>;

fn per_client<T>(rows: &[Row], read: impl Fn(&Row) -> Result<T, String>) -> PerClient<T> {
    let mut out: PerClient<T> = HashMap::new();
    for row in rows {
        let Ok(client_id) = row.try_get::<_, String>(0) else {
            continue;
        };
        let item = read(row);
        let entry = out.entry(client_id).or_insert_with(|| Ok(Vec::new()));
        match (entry.as_mut(), item) {
            (Ok(list), Ok(item)) => list.push(item),
            (Ok(_), Err(e)) => *entry = Err(e),
            (Err(_), _) => {}
        }
    }
    out
}

async fn load_all(client: &Client) -> Result<LoadedState, tokio_postgres::Error> {
    let queued_sql = format!(
        "SELECT client_id, seq, {MESSAGE_COLUMNS} FROM mercurio_queued ORDER BY client_id, seq"
    );
    let inflight_sql = format!(
        "SELECT client_id, packet_id, state, {MESSAGE_COLUMNS} FROM mercurio_inflight \
         ORDER BY client_id, ord"
    );
    let retained_sql = format!("SELECT {MESSAGE_COLUMNS} FROM mercurio_retained ORDER BY topic");
    let (subs, queued, inflight, inbound, sessions, retained) = tokio::try_join!(
        client.query(
            "SELECT client_id, filter, qos, no_local, retain_as_published, retain_handling, \
             subscription_identifier FROM mercurio_subscriptions ORDER BY client_id, filter",
            &[],
        ),
        client.query(&queued_sql, &[]),
        client.query(&inflight_sql, &[]),
        client.query(
            "SELECT client_id, packet_id FROM mercurio_inbound_qos2 \
             ORDER BY client_id, packet_id",
            &[],
        ),
        client.query(
            "SELECT client_id, protocol_level, session_expiry_interval, disconnected_at, \
             will_topic, will_payload, will_qos, will_retain, will_properties, will_expires_at, \
             will_publisher, will_delay_interval, username FROM mercurio_sessions \
             ORDER BY client_id",
            &[],
        ),
        client.query(&retained_sql, &[]),
    )?;
    let mut subscriptions = per_client(&subs, |row| {
        Ok(SubscriptionRecord {
            filter: col(row, 1)?,
            qos: qos(col(row, 2)?, "subscription")?,
            no_local: col(row, 3)?,
            retain_as_published: col(row, 4)?,
            retain_handling: small(col(row, 5)?, "retain handling")?,
            subscription_identifier: col::<Option<i64>>(row, 6)?
                .map(|v| small(v, "subscription identifier"))
                .transpose()?,
        })
    });
    let mut queued = per_client(&queued, |row| {
        Ok(QueuedRecord {
            seq: unsigned(col(row, 1)?, "seq")?,
            message: message_at(row, 2)?,
        })
    });
    let mut inflight = per_client(&inflight, |row| {
        let state: String = col(row, 2)?;
        Ok(InflightRecord {
            packet_id: small(col(row, 1)?, "packet identifier")?,
            state: InflightState::parse(&state)
                .ok_or_else(|| format!("unknown in-flight state {state:?}"))?,
            message: message_at(row, 3)?,
        })
    });
    let mut inbound = per_client(&inbound, |row| {
        small::<u16>(col(row, 1)?, "packet identifier")
    });
    let mut state = LoadedState::default();
    for row in &sessions {
        let client_id: String = row.get(0);
        let mut read = || -> Result<SessionRecord, String> {
            let level: u8 = small(col(row, 1)?, "protocol level")?;
            if !(3..=5).contains(&level) {
                return Err(format!("protocol level {level} is not 3, 4 or 5"));
            }
            let will = match col::<Option<String>>(row, 4)? {
                None => None,
                Some(_) => Some(WillRecord {
                    message: message_at(row, 4)?,
                    delay_interval: small(
                        col::<Option<i64>>(row, 11)?.unwrap_or(0),
                        "will delay interval",
                    )?,
                }),
            };
            Ok(SessionRecord {
                client_id: client_id.clone(),
                protocol_level: level,
                session_expiry_interval: small(col(row, 2)?, "session expiry interval")?,
                disconnected_at: col::<Option<i64>>(row, 3)?
                    .map(|v| unsigned(v, "disconnected_at"))
                    .transpose()?,
                username: col(row, 12)?,
                subscriptions: subscriptions.remove(&client_id).unwrap_or(Ok(Vec::new()))?,
                will,
                queued: queued.remove(&client_id).unwrap_or(Ok(Vec::new()))?,
                inflight: inflight.remove(&client_id).unwrap_or(Ok(Vec::new()))?,
                inbound_qos2: inbound.remove(&client_id).unwrap_or(Ok(Vec::new()))?,
            })
        };
        match read() {
            Ok(record) => state.sessions.push(record),
            Err(cause) => state.set_aside.push(SetAside { client_id, cause }),
        }
    }
    let mut by_topic = BTreeMap::new();
    for row in &retained {
        if let Ok(message) = message_at(row, 0) {
            by_topic.insert(message.topic.clone(), RetainedRecord::new(message));
        }
    }
    state.retained = by_topic.into_values().collect();
    Ok(state)
}

#[async_trait]
impl Storage for PostgresStorage {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn load(&self) -> Result<LoadedState, StorageError> {
        let guard = self.writer().await?;
        let writer = guard.as_ref().expect("open");
        load_all(&writer.client)
            .await
            .map_err(|e| classify(e, "cannot load the stored state"))
    }

    async fn apply(&self, batch: &[Change]) -> Result<(), StorageError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.write(batch).await
    }

    async fn delete_session(&self, client_id: &str) -> Result<bool, StorageError> {
        let existed = {
            let guard = self.writer().await?;
            let writer = guard.as_ref().expect("open");
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
        self.write(&[Change::SessionDeleted {
            client_id: client_id.to_string(),
        }])
        .await?;
        Ok(existed)
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
