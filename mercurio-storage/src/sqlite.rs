//! [`SqliteStorage`]: one SQLite database file, in WAL mode, written by a dedicated thread.
//!
//! - The connection lives on its own thread; every call sends it a job and awaits the answer,
//!   so the runtime's threads never block on the disk.
//! - `journal_mode = WAL`, `synchronous = NORMAL` (a crash of the machine may lose the last
//!   commits, never corrupt the file), `synchronous = FULL` for
//!   [`apply_durable`](Storage::apply_durable) and [`flush`](Storage::flush).
//! - The file is created readable by its owner only (0600); SQLite gives `-wal` and `-shm` the
//!   same mode.
//! - `<database>.lock` (e.g. `mercurio.db.lock`) is held with `flock` while the storage is open:
//!   a second broker on the same database fails to open it, while `sqlite3` can still read it.
//! - The schema version is `PRAGMA user_version`; a newer one is refused
//!   ([`ErrorKind::Incompatible`]).
//! - A session whose rows cannot be read (a damaged value, one a newer version wrote) is set
//!   aside: reported in [`LoadedState::set_aside`] and left as it is.
//! - Stream segments' messages are in append-only files in `<database>-streams/` (see
//!   [`files`]), the rows saying where; the write-ahead log is checkpointed by this thread
//!   once a second, after syncing those files, instead of by SQLite's automatic checkpoint.

mod files;
mod queue;
mod segment;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use parking_lot::Mutex;
use rusqlite::{params, Connection, ErrorCode, OptionalExtension, Row, Transaction};
use tokio::sync::oneshot;

use crate::access::{validate_access, AccessChange, AccessKind, AccessRecord};
use crate::change::{refused, validate_batch, Change};
use crate::error::StorageError;
use crate::records::{InflightRecord, QueuedRecord, StoredMessage, SubscriptionRecord, WillRecord};
use crate::refs::Refs;
use crate::rows::{
    self, DELIVERY_COLUMNS, RETAINED_COLUMNS, SESSION_COLUMNS, STORED_COLUMNS, SUBSCRIPTION_COLUMNS,
};
use crate::{LoadedState, SetAside, Storage};
use queue::QueueChanges;

/// The schema version this build writes and reads (`PRAGMA user_version`).
///
/// 2: `sessions.username`; 3: `sessions.certificate`, and `share` (a queued or in-flight
/// message's shared subscription) in `queued`, `inflight` and `retained`; 4: the message
/// store: each message once in `messages`, and `queued` / `inflight` rows refer to it
/// (`message_id`) with the delivery's QoS, RETAIN flag, subscription identifiers and shared
/// subscription. 5: `access`, the access records (users, groups, roles) of `[auth] backend
/// = "storage"`. 6: queues in chunks (`queue_chunks`, one row per client and run of
/// positions; the view `queued` shows a delivery a row) and a count of references per
/// message (`messages.refs`) in place of the indexes of references. An older database is
/// upgraded when opened (from 3 to 4, each queued or in-flight row becomes one message and
/// one reference; from 5 to 6, each queue is rewritten in chunks and references counted).
/// 7: streams (`streams`, and `stream_entries` referring to the message store, each entry
/// counted in its message's `refs`). 8: stream segments (`stream_segments`, one row per
/// stream and batch, see [`segment`]), `streams.trimmed` (the stream's first offset: older
/// entries of a partly trimmed segment are skipped) and `inline_released` (releases of
/// messages held only inline); the upgrade from 7 turns each stream's entries into segments
/// of at most 128, moving the messages only streams refer to into them. 9: those releases
/// as runs of consecutive ids (`inline_released_runs`), one row per run instead of one per
/// message (a stream releases each message as it leaves the broker's memory, in order).
/// 10: a retained message's publisher's user name and listener port
/// (`retained.publisher_username`, `retained.publisher_listener`, for `check_retain_source`;
/// NULL in the rows of older versions). 11: stream segments written in version 2 of their
/// format (varints and differences, see [`segment`]); older segments are still read, so
/// the upgrade changes no data: the version is there so that an older build refuses the
/// database when it opens it rather than failing on a segment it cannot read. 12: a
/// segment's body in a file beside the database (`stream_segments.file`, `position`,
/// `length`, its `body` then empty, see [`files`]); the rows of older versions keep their
/// bodies.
pub const SCHEMA_VERSION: i64 = 12;

/// From version 9 to 10: who published a retained message, as its access check needs.
const TO_10: &str = "ALTER TABLE retained ADD COLUMN publisher_username TEXT; \
     ALTER TABLE retained ADD COLUMN publisher_listener INTEGER;";

/// From version 10 to 11: nothing in the data changes (segments of version 1 are still
/// read, new ones are written in version 2); the version number alone keeps older builds
/// away.
const TO_11: &str = "";

/// From version 11 to 12 (and in [`SCHEMA`]): where a segment's body is when it is in a
/// file (NULL: in `body`).
macro_rules! segment_places_12 {
    () => {
        "ALTER TABLE stream_segments ADD COLUMN file INTEGER; \
         ALTER TABLE stream_segments ADD COLUMN position INTEGER; \
         ALTER TABLE stream_segments ADD COLUMN length INTEGER;"
    };
}

/// The streams' tables (schema 7), shared by [`SCHEMA`] and the upgrade from 6. An entry
/// is one reference of its message (`messages.refs`), like a queued delivery.
macro_rules! streams_tables {
    () => {
        "
CREATE TABLE streams (
    name TEXT PRIMARY KEY NOT NULL,
    next_offset INTEGER NOT NULL,
    filter TEXT,
    max_age INTEGER,
    max_bytes INTEGER,
    last_value INTEGER
) WITHOUT ROWID;
"
    };
}

/// Schema 7's stream entries, one row each referring to the message store (counted in its
/// message's `refs`); schema 8 holds them in segments ([`entries_to_segments`]).
macro_rules! stream_entries_7 {
    () => {
        "
CREATE TABLE stream_entries (
    stream TEXT NOT NULL REFERENCES streams (name) ON DELETE CASCADE,
    entry_offset INTEGER NOT NULL,
    time_ms INTEGER NOT NULL,
    message_id INTEGER NOT NULL,
    PRIMARY KEY (stream, entry_offset)
) WITHOUT ROWID;
"
    };
}

/// Stream segments (schema 8): the entries one batch appended to one stream in one row.
macro_rules! segments_table {
    () => {
        "
CREATE TABLE stream_segments (
    stream TEXT NOT NULL REFERENCES streams (name) ON DELETE CASCADE,
    first_offset INTEGER NOT NULL,
    last_offset INTEGER NOT NULL,
    entries INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    refs INTEGER NOT NULL,
    min_id INTEGER,
    max_id INTEGER,
    body BLOB NOT NULL,
    PRIMARY KEY (stream, first_offset)
) WITHOUT ROWID;
CREATE INDEX stream_segments_ids ON stream_segments (min_id) WHERE min_id IS NOT NULL;
CREATE TABLE inline_released (id INTEGER PRIMARY KEY);
ALTER TABLE streams ADD COLUMN trimmed INTEGER NOT NULL DEFAULT 0;
"
    };
}

/// Schema 9: the releases of messages held only inline, as runs of consecutive ids (a
/// release is remembered for a later reference that stores the message, see
/// [`materialize`]); schema 8's table of single ids becomes runs of one.
macro_rules! released_runs_9 {
    () => {
        "
CREATE TABLE inline_released_runs (first_id INTEGER PRIMARY KEY, last_id INTEGER NOT NULL);
INSERT INTO inline_released_runs (first_id, last_id) SELECT id, id FROM inline_released;
DROP TABLE inline_released;
"
    };
}

/// The access records' table (schema 5), shared by [`SCHEMA`] and the upgrade from 4.
macro_rules! access_table {
    () => {
        "
CREATE TABLE access (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (kind, name)
) WITHOUT ROWID;
"
    };
}

/// The message store and the tables that refer to it (schema 4), shared by the upgrade from
/// 3 (schema 6 then changes them, [`TO_6`]).
macro_rules! message_store_4 {
    () => {
        "
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    properties BLOB NOT NULL,
    expires_at INTEGER,
    publisher TEXT,
    released INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX messages_released ON messages (id) WHERE released = 1;
CREATE TABLE queued (
    client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    message_id INTEGER NOT NULL REFERENCES messages (id),
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    subscription_ids BLOB NOT NULL,
    share TEXT,
    PRIMARY KEY (client_id, seq)
) WITHOUT ROWID;
CREATE INDEX queued_message ON queued (message_id);
CREATE TABLE inflight (
    client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
    packet_id INTEGER NOT NULL,
    ord INTEGER NOT NULL,
    state TEXT NOT NULL,
    message_id INTEGER NOT NULL REFERENCES messages (id),
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    subscription_ids BLOB NOT NULL,
    share TEXT,
    PRIMARY KEY (client_id, packet_id)
) WITHOUT ROWID;
CREATE INDEX inflight_message ON inflight (message_id);
"
    };
}

/// The message store of schema 6: each message counts its references (`refs`: queued
/// deliveries and in-flight messages, see `refs.rs`) instead of an index of them; queues are
/// stored in chunks (`queue.rs`), shown one delivery a row by the view `queued`.
macro_rules! message_store {
    () => {
        concat!(
            "
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    properties BLOB NOT NULL,
    expires_at INTEGER,
    publisher TEXT,
    released INTEGER NOT NULL DEFAULT 0,
    refs INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX messages_released ON messages (id) WHERE released = 1;
",
            queue_tables!()
        )
    };
}

/// The tables of queued and in-flight deliveries of schema 6 (and the view `queued`).
macro_rules! queue_tables {
    () => {
        "
CREATE TABLE queue_chunks (
    client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
    first_seq INTEGER NOT NULL,
    last_seq INTEGER NOT NULL,
    entries TEXT NOT NULL,
    PRIMARY KEY (client_id, first_seq)
) WITHOUT ROWID;
CREATE VIEW queued (client_id, seq, message_id, qos, retain, subscription_ids, share) AS
    SELECT c.client_id, e.value ->> 0, e.value ->> 1, e.value ->> 2, e.value ->> 3,
    unhex(e.value ->> 4), e.value ->> 5 FROM queue_chunks AS c, json_each(c.entries) AS e;
CREATE TABLE inflight (
    client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
    packet_id INTEGER NOT NULL,
    ord INTEGER NOT NULL,
    state TEXT NOT NULL,
    message_id INTEGER NOT NULL,
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    subscription_ids BLOB NOT NULL,
    share TEXT,
    PRIMARY KEY (client_id, packet_id)
) WITHOUT ROWID;
"
    };
}

/// From each older schema version to the next, in order (index 0: from 1 to 2).
const UPGRADES: &[&str] = &[
    "ALTER TABLE sessions ADD COLUMN username TEXT;",
    "ALTER TABLE sessions ADD COLUMN certificate TEXT; ALTER TABLE queued ADD COLUMN share TEXT; ALTER TABLE inflight ADD COLUMN share TEXT; \
     ALTER TABLE retained ADD COLUMN share TEXT;",
    concat!(
        "ALTER TABLE queued RENAME TO queued_v3; ALTER TABLE inflight RENAME TO inflight_v3; \
         DROP INDEX IF EXISTS queued_message; DROP INDEX IF EXISTS inflight_message;",
        message_store_4!(),
        "INSERT INTO messages (id, topic, payload, qos, retain, properties, expires_at, publisher) \
         SELECT row_number() OVER (ORDER BY client_id, seq), topic, payload, qos, retain, \
         properties, expires_at, publisher FROM queued_v3; \
         INSERT INTO queued (client_id, seq, message_id, qos, retain, subscription_ids, share) \
         SELECT client_id, seq, row_number() OVER (ORDER BY client_id, seq), qos, retain, X'', \
         share FROM queued_v3; \
         INSERT INTO messages (id, topic, payload, qos, retain, properties, expires_at, publisher) \
         SELECT (SELECT count(*) FROM queued_v3) + row_number() OVER (ORDER BY client_id, ord), \
         topic, payload, qos, retain, properties, expires_at, publisher FROM inflight_v3; \
         INSERT INTO inflight (client_id, packet_id, ord, state, message_id, qos, retain, \
         subscription_ids, share) SELECT client_id, packet_id, ord, state, \
         (SELECT count(*) FROM queued_v3) + row_number() OVER (ORDER BY client_id, ord), qos, \
         retain, X'', share FROM inflight_v3; \
         DROP TABLE queued_v3; DROP TABLE inflight_v3;"
    ),
    access_table!(),
    TO_6,
    concat!(streams_tables!(), stream_entries_7!()),
    segments_table!(),
    released_runs_9!(),
    TO_10,
    TO_11,
    segment_places_12!(),
];

/// Entries one segment holds at most: about what a reader asks for at once, so that a read
/// does not decode (and SQLite does not read) a large blob for a few of its entries.
const ENTRIES_PER_SEGMENT: usize = 128;

/// From version 7 to 8: each stream's entries become segments of at most
/// [`ENTRIES_PER_SEGMENT`]; a message only stream entries refer to moves into them (its row
/// deleted), any other stays in the message store, referred to by id.
fn entries_to_segments(tx: &Transaction<'_>) -> rusqlite::Result<()> {
    let mut stmt = tx.prepare(
        "SELECT e.stream, e.entry_offset, e.time_ms, e.message_id, \
         m.refs <= (SELECT count(*) FROM stream_entries x WHERE x.message_id = m.id), \
         m.topic, m.payload, m.qos, m.retain, m.properties, m.expires_at, m.publisher \
         FROM stream_entries e JOIN messages m ON m.id = e.message_id \
         ORDER BY e.stream, e.entry_offset",
    )?;
    let mut rows = stmt.query([])?;
    let mut inlined = HashSet::new();
    let mut current: Option<String> = None;
    let mut entries: Vec<(crate::StreamEntryRecord, Option<crate::MessageRecord>)> = Vec::new();
    let flush =
        |stream: &str,
         entries: &mut Vec<(crate::StreamEntryRecord, Option<crate::MessageRecord>)>| {
            let ids: Vec<u64> = entries
                .iter()
                .filter(|(_, m)| m.is_none())
                .map(|(e, _)| e.message_id)
                .collect();
            let sizes = ref_sizes(tx, &ids)?;
            let bodies: Vec<_> = entries
                .iter()
                .map(|(e, m)| {
                    let body = match m {
                        Some(m) => segment::Body::Inline(m),
                        None => segment::Body::Ref,
                    };
                    (*e, body)
                })
                .collect();
            insert_segment(tx, stream, &bodies, &sizes, None)?;
            entries.clear();
            Ok::<_, rusqlite::Error>(())
        };
    while let Some(row) = rows.next()? {
        let stream: String = row.get(0)?;
        if current.as_deref() != Some(stream.as_str()) || entries.len() == ENTRIES_PER_SEGMENT {
            if let Some(c) = &current {
                flush(c, &mut entries)?;
            }
            current = Some(stream);
        }
        let unsigned = |i: usize| row.get::<_, i64>(i).map(|v| u64::try_from(v).unwrap_or(0));
        let entry = crate::StreamEntryRecord {
            offset: unsigned(1)?,
            time_ms: unsigned(2)?,
            message_id: unsigned(3)?,
        };
        let only_streams: bool = row.get(4)?;
        // A message row that cannot be read stays where it is, referred to by id.
        let message = match only_streams {
            true => rows::will_message_at(row, 5).ok(),
            false => None,
        };
        if message.is_some() {
            inlined.insert(entry.message_id);
        }
        entries.push((entry, message));
    }
    if let Some(c) = &current {
        flush(c, &mut entries)?;
    }
    drop(rows);
    drop(stmt);
    // The counts of references keep only what is left in the message store.
    let mut delete = tx.prepare("DELETE FROM messages WHERE id = ?1")?;
    for id in inlined {
        delete.execute([to_i64(id)])?;
    }
    tx.execute_batch("DROP TABLE stream_entries;")
}

/// From version 5 to 6: queues in chunks of at most 256 deliveries, in-flight messages without
/// an index of their message, and each message's count of references.
const TO_6: &str = concat!(
    "ALTER TABLE queued RENAME TO queued_v5; ALTER TABLE inflight RENAME TO inflight_v5; \
     DROP INDEX IF EXISTS queued_message; DROP INDEX IF EXISTS inflight_message; \
     ALTER TABLE messages ADD COLUMN refs INTEGER NOT NULL DEFAULT 0;",
    queue_tables!(),
    "INSERT INTO queue_chunks (client_id, first_seq, last_seq, entries) \
     SELECT client_id, min(seq), max(seq), json_group_array(json_array(seq, message_id, qos, \
     retain, hex(subscription_ids), share) ORDER BY seq) FROM (SELECT *, (row_number() OVER \
     (PARTITION BY client_id ORDER BY seq) - 1) / 256 AS chunk FROM queued_v5 \
     ORDER BY client_id, seq) GROUP BY client_id, chunk; \
     INSERT INTO inflight SELECT * FROM inflight_v5; \
     UPDATE messages SET refs = (SELECT count(*) FROM queued_v5 WHERE message_id = messages.id) \
     + (SELECT count(*) FROM inflight_v5 WHERE message_id = messages.id); \
     DROP TABLE queued_v5; DROP TABLE inflight_v5;"
);

/// How long a statement waits for a lock held by another connection before the call fails
/// with a transient error (which the broker's writer retries).
const BUSY_TIMEOUT: Duration = Duration::from_millis(250);

const SCHEMA: &str = concat!(
    access_table!(),
    "
CREATE TABLE sessions (
    client_id TEXT PRIMARY KEY NOT NULL,
    protocol_level INTEGER NOT NULL,
    session_expiry_interval INTEGER NOT NULL,
    disconnected_at INTEGER,
    will_topic TEXT,
    will_payload BLOB,
    will_qos INTEGER,
    will_retain INTEGER,
    will_properties BLOB,
    will_expires_at INTEGER,
    will_publisher TEXT,
    will_delay_interval INTEGER,
    username TEXT,
    certificate TEXT
);
CREATE TABLE subscriptions (
    client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
    filter TEXT NOT NULL,
    qos INTEGER NOT NULL,
    no_local INTEGER NOT NULL,
    retain_as_published INTEGER NOT NULL,
    retain_handling INTEGER NOT NULL,
    subscription_identifier INTEGER,
    PRIMARY KEY (client_id, filter)
) WITHOUT ROWID;
",
    message_store!(),
    "CREATE TABLE inbound_qos2 (
    client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
    packet_id INTEGER NOT NULL,
    PRIMARY KEY (client_id, packet_id)
) WITHOUT ROWID;
CREATE TABLE retained (
    topic TEXT PRIMARY KEY NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    properties BLOB NOT NULL,
    expires_at INTEGER,
    publisher TEXT,
    share TEXT,
    publisher_username TEXT,
    publisher_listener INTEGER
) WITHOUT ROWID;
CREATE TABLE meta (
    key TEXT PRIMARY KEY NOT NULL,
    value
) WITHOUT ROWID;
",
    streams_tables!(),
    // Schema 8's tables, then 9's change (it replaces a table 8 creates, empty here).
    segments_table!(),
    released_runs_9!(),
    "\n",
    segment_places_12!()
);

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// Storage in one SQLite database file. See the [module documentation](self).
pub struct SqliteStorage {
    path: PathBuf,
    jobs: Mutex<std_mpsc::Sender<Job>>,
}

impl std::fmt::Debug for SqliteStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStorage")
            .field("path", &self.path)
            .finish()
    }
}

/// What the dedicated thread owns. `None` once closed.
struct Worker {
    open: Option<Open>,
}

/// An open database: the connection, the lock file, and the stream segment files (`None`
/// for a database in memory).
struct Open {
    conn: Connection,
    _lock: File,
    files: Option<files::SegmentFiles>,
}

/// The lock file of the database at `path`: `path` with `.lock` appended.
pub fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// How much lower the SQLite thread's scheduling priority is, when it runs in the
/// background ([`SqliteStorage::open_in_background`]), than the thread that opened the
/// storage (its nice value this much higher, at most 19).
///
/// The broker's event loops and the SQLite thread often share a core: a commit that
/// preempted a loop delayed every client it serves. When nothing waits for a commit (no
/// `durable_ack`), the writer's work can wait a little (what clients owe it is bounded by
/// `max_pending_bytes`, which slows them when it falls behind): it takes the CPU the loops
/// leave, and its fair share (about a tenth of a core against one busy loop) when they leave
/// none. With `durable_ack` acknowledgements wait for commits, and the thread keeps the
/// broker's priority. Measured: docs/BENCHMARKS.md, "Streams".
pub const THREAD_NICE: i32 = 10;

/// Lowers the calling thread's priority by [`THREAD_NICE`] (Linux, where a nice value is a
/// thread's own); a refusal is logged and the thread runs as it is.
fn run_behind_event_loops() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid, getpriority and setpriority take plain integers; none touches
        // memory of ours.
        let tid = unsafe { libc::gettid() } as libc::id_t;
        let current = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
        let nice = (current + THREAD_NICE).min(19);
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
            tracing::debug!(
                "the SQLite thread keeps its priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

impl SqliteStorage {
    /// Opens (creating if needed, mode 0600) the database at `path`, takes its lock file,
    /// and creates or checks the schema.
    ///
    /// Errors: [`ErrorKind::Fenced`](crate::ErrorKind::Fenced) when another process (or
    /// another storage in this one) holds the lock; `Incompatible` for a newer schema;
    /// `Fatal` when the file can't be created or isn't a database.
    pub fn open(path: impl AsRef<Path>) -> Result<SqliteStorage, StorageError> {
        Self::open_on_thread(path.as_ref(), false)
    }

    /// As [`Self::open`], its thread running [`THREAD_NICE`] below the caller's priority:
    /// for a broker whose acknowledgements do not wait for commits (no `durable_ack`).
    pub fn open_in_background(path: impl AsRef<Path>) -> Result<SqliteStorage, StorageError> {
        Self::open_on_thread(path.as_ref(), true)
    }

    fn open_on_thread(path: &Path, background: bool) -> Result<SqliteStorage, StorageError> {
        let path = path.to_path_buf();
        let (conn, lock) = open_database(&path)?;
        let files = files::SegmentFiles::open(&conn)?;
        let (tx, rx) = std_mpsc::channel::<Job>();
        let name = format!("mercurio-sqlite {}", path.display());
        std::thread::Builder::new()
            .name(name.chars().take(15).collect())
            .spawn(move || {
                if background {
                    run_behind_event_loops();
                }
                let mut worker = Worker {
                    open: Some(Open {
                        conn,
                        _lock: lock,
                        files,
                    }),
                };
                while let Ok(job) = rx.recv() {
                    job(&mut worker);
                }
            })
            .map_err(|e| StorageError::fatal(format!("cannot start the SQLite thread: {e}")))?;
        Ok(SqliteStorage {
            path,
            jobs: Mutex::new(tx),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the dedicated thread with the open connection.
    async fn call<R, F>(&self, f: F) -> Result<R, StorageError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<R, StorageError> + Send + 'static,
    {
        self.call_with_files(|conn, _| f(conn)).await
    }

    /// Runs `f` on the dedicated thread with the open connection and its segment files.
    async fn call_with_files<R, F>(&self, f: F) -> Result<R, StorageError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection, Option<&mut files::SegmentFiles>) -> Result<R, StorageError>
            + Send
            + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let path = self.path.clone();
        let job: Job = Box::new(move |worker: &mut Worker| {
            let result = match worker.open.as_mut() {
                Some(open) => f(&mut open.conn, open.files.as_mut()),
                None => Err(StorageError::fatal(format!(
                    "database {} is closed",
                    path.display()
                ))),
            };
            let _ = tx.send(result);
        });
        self.jobs
            .lock()
            .send(job)
            .map_err(|_| StorageError::fatal("the SQLite thread has stopped"))?;
        rx.await
            .map_err(|_| StorageError::fatal("the SQLite thread has stopped"))?
    }
}

fn open_database(path: &Path) -> Result<(Connection, File), StorageError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.is_dir() {
            return Err(StorageError::fatal(format!(
                "cannot open {}: the directory {} does not exist",
                path.display(),
                dir.display()
            )));
        }
    }
    let lock_file = lock_path(path);
    let lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_file)
        .map_err(|e| {
            StorageError::fatal(format!("cannot open {}: {e}", lock_file.display())).with_source(e)
        })?;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    let locked = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if locked != 0 {
        let e = std::io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            StorageError::fenced(format!(
                "database {} is in use by another broker (it holds {})",
                path.display(),
                lock_file.display()
            ))
        } else {
            StorageError::fatal(format!("cannot lock {}: {e}", lock_file.display()))
        });
    }
    // Create the file ourselves so that it is readable by its owner only.
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|e| {
            StorageError::fatal(format!("cannot create {}: {e}", path.display())).with_source(e)
        })?;
    let mut conn = Connection::open(path).map_err(|e| sql_error(path, "open", e))?;
    // Every statement a batch may run stays prepared (rusqlite keeps 16 by default, fewer
    // than one batch of sessions, streams and releases uses).
    conn.set_prepared_statement_cache_capacity(STATEMENTS_CACHED);
    let setup = || -> rusqlite::Result<i64> {
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.query_row("PRAGMA user_version", [], |r| r.get(0))
    };
    let version = setup().map_err(|e| sql_error(path, "set up", e))?;
    if version > SCHEMA_VERSION {
        return Err(StorageError::incompatible(format!(
            "database {} has schema version {version}, newer than this broker's {SCHEMA_VERSION}: \
             it was written by a newer version of Mercurio",
            path.display()
        )));
    }
    if version == 0 {
        let tables: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
                [],
                |r| r.get(0),
            )
            .map_err(|e| sql_error(path, "read the schema", e))?;
        if tables > 0 {
            return Err(StorageError::incompatible(format!(
                "database {} has tables but no Mercurio schema version",
                path.display()
            )));
        }
        conn.execute_batch(&format!(
            "BEGIN; {SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
        ))
        .map_err(|e| sql_error(path, "create the schema", e))?;
    } else {
        for (from, upgrade) in UPGRADES.iter().enumerate().skip((version - 1) as usize) {
            let to = from as i64 + 2;
            let step = |conn: &mut Connection| {
                let tx = conn.transaction()?;
                tx.execute_batch(upgrade)?;
                if to == 8 {
                    entries_to_segments(&tx)?;
                }
                tx.pragma_update(None, "user_version", to)?;
                tx.commit()
            };
            step(&mut conn).map_err(|e| sql_error(path, "upgrade the schema", e))?;
        }
    }
    Ok((conn, lock))
}

/// Maps a SQLite error to the kind the writer acts on.
fn classify(e: rusqlite::Error) -> StorageError {
    let message = e.to_string();
    let kind_error = match &e {
        rusqlite::Error::SqliteFailure(f, _) => match f.code {
            ErrorCode::DatabaseBusy
            | ErrorCode::DatabaseLocked
            | ErrorCode::DiskFull
            | ErrorCode::SystemIoFailure
            | ErrorCode::CannotOpen
            | ErrorCode::OutOfMemory
            | ErrorCode::ReadOnly => StorageError::transient(message),
            ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase => StorageError::fatal(message),
            _ => StorageError::refused(message),
        },
        _ => StorageError::refused(message),
    };
    kind_error.with_source(e)
}

fn sql_error(path: &Path, what: &str, e: rusqlite::Error) -> StorageError {
    let classified = classify(e);
    let kind = if classified.is_transient() || classified.is_refused() {
        crate::ErrorKind::Fatal
    } else {
        classified.kind()
    };
    StorageError::new(
        kind,
        format!(
            "database {}: cannot {what}: {}",
            path.display(),
            classified.message()
        ),
    )
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Reads column `i`, describing a failure.
fn col<T: rusqlite::types::FromSql>(row: &Row<'_>, i: usize) -> Result<T, String> {
    row.get::<_, T>(i).map_err(|e| {
        let name = row
            .as_ref()
            .column_name(i)
            .map(str::to_string)
            .unwrap_or_else(|_| i.to_string());
        format!("column {name}: {e}")
    })
}

rows::columns_through!(Row<'_>, col);

/// Reads every row of `sql` (whose first column is the client id) into per-client lists.
fn per_client<T>(
    conn: &Connection,
    sql: &str,
    read: impl Fn(&Row<'_>) -> Result<T, String>,
) -> rusqlite::Result<rows::PerClient<T>> {
    let mut out = rows::PerClient::new();
    let mut stmt = conn.prepare(sql)?;
    let mut found = stmt.query([])?;
    while let Some(row) = found.next()? {
        rows::push_per_client(&mut out, row, &read);
    }
    Ok(out)
}

/// Deletes a message the broker released if nothing refers to it any more.
const DELETE_RELEASED: &str = "DELETE FROM messages WHERE id = ?1 AND released = 1 AND refs <= 0";

/// A new broker starts: messages nothing refers to go, and it holds every other one.
fn start_broker(conn: &mut Connection) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    tx.execute("DELETE FROM messages WHERE refs <= 0", [])?;
    tx.execute("UPDATE messages SET released = 0 WHERE released = 1", [])?;
    // A message only stream entries refer to is read back with them, never held: it goes
    // with its last entry.
    // Every inline message stored so far is released: this broker holds none of them.
    tx.execute("DELETE FROM inline_released_runs", [])?;
    tx.execute(
        "INSERT OR REPLACE INTO meta (key, value) VALUES ('held_from', \
         1 + max(coalesce((SELECT max(id) FROM messages), 0), \
         coalesce((SELECT max(max_id) FROM stream_segments), 0)))",
        [],
    )?;
    let mut held: HashMap<u64, i64> = HashMap::new();
    {
        let mut stmt = tx.prepare(
            "SELECT t.trimmed, s.stream, s.body, s.file, s.position, s.length \
             FROM stream_segments s JOIN streams t ON t.name = s.stream WHERE s.refs > 0",
        )?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let from = u64::try_from(row.get::<_, i64>(0)?).unwrap_or(0);
            let stream: String = row.get(1)?;
            let body = files::body(&tx, &stream, row, 2)?;
            for d in segment::decode(&body).unwrap_or_default() {
                if d.message.is_none() && d.entry.offset >= from {
                    *held.entry(d.entry.message_id).or_default() += 1;
                }
            }
        }
        let mut mark =
            tx.prepare("UPDATE messages SET released = 1 WHERE id = ?1 AND refs <= ?2")?;
        for (id, n) in held {
            mark.execute(params![to_i64(id), n])?;
        }
    }
    tx.commit()
}

/// Up to `max` entries of `stream` from `from_offset` on, appended at `from_time_ms` or
/// later, with their messages (an unreadable one left out), stopping after the entry whose
/// inline message brings the batch to `max_bytes` (a message in the message store counts
/// once read: a batch of those is bounded by `max`): only the segments holding them are
/// read.
fn read_stream(
    conn: &Connection,
    stream: &str,
    from_offset: u64,
    from_time_ms: u64,
    max: usize,
    max_bytes: u64,
) -> rusqlite::Result<Vec<crate::StreamEntryRead>> {
    let trimmed: i64 = conn
        .prepare_cached("SELECT trimmed FROM streams WHERE name = ?1")?
        .query_row([stream], |r| r.get(0))
        .optional()?
        .unwrap_or(0);
    let from = from_offset.max(u64::try_from(trimmed).unwrap_or(0));
    let mut stmt = conn.prepare_cached(
        "SELECT body, file, position, length FROM stream_segments WHERE stream = ?1 \
         AND first_offset >= \
         coalesce((SELECT max(first_offset) FROM stream_segments WHERE stream = ?1 \
         AND first_offset <= ?2), 0) ORDER BY first_offset",
    )?;
    let mut found = stmt.query(params![stream, to_i64(from)])?;
    let mut entries = Vec::new();
    let mut bytes = 0u64;
    while entries.len() < max && bytes < max_bytes {
        let Some(row) = found.next()? else { break };
        let wanted = |e: &crate::StreamEntryRecord| e.offset >= from && e.time_ms >= from_time_ms;
        let left = max - entries.len();
        let blob = files::body(conn, stream, row, 0)?;
        let Ok(decoded) = segment::decode_where(&blob, wanted, left, max_bytes - bytes) else {
            continue;
        };
        bytes += decoded
            .iter()
            .filter_map(|d| d.message.as_ref())
            .map(crate::MessageRecord::size)
            .sum::<u64>();
        entries.extend(decoded);
    }
    // The entries that refer to the message store read their messages in one go.
    let mut ids: Vec<u64> = entries
        .iter()
        .filter(|d| d.message.is_none())
        .map(|d| d.entry.message_id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    let stored: HashMap<u64, crate::MessageRecord> = load_messages(conn, &ids)?
        .into_iter()
        .map(|m| (m.id, m.message))
        .collect();
    Ok(entries
        .into_iter()
        .filter_map(|d| {
            let message = match d.message {
                Some(m) => m,
                None => stored.get(&d.entry.message_id)?.clone(),
            };
            Some(crate::StreamEntryRead {
                entry: d.entry,
                message,
            })
        })
        .collect())
}

/// The readable stored messages among `ids` (sorted, without duplicates), in order: in
/// statements of at most [`IDS_PER_READ`] ids.
fn load_messages(conn: &Connection, ids: &[u64]) -> rusqlite::Result<Vec<StoredMessage>> {
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(IDS_PER_READ) {
        let marks = vec!["?"; chunk.len()].join(",");
        let mut stmt = conn.prepare(&format!(
            "SELECT {STORED_COLUMNS} FROM messages WHERE id IN ({marks}) ORDER BY id"
        ))?;
        let params: Vec<i64> = chunk
            .iter()
            .filter_map(|id| i64::try_from(*id).ok())
            .collect();
        let mut found = stmt.query(rusqlite::params_from_iter(params))?;
        while let Some(row) = found.next()? {
            if let Ok(m) = rows::stored(row) {
                out.push(m);
            }
        }
    }
    Ok(out)
}

/// Ids one statement names at most ([`load_messages`], [`release_messages`]): under SQLite's
/// smallest limit of bound parameters (999).
const IDS_PER_READ: usize = 500;

/// Prepared statements kept per connection: the fixed ones and the few shapes of each list
/// of ids ([`padded_ids`]).
const STATEMENTS_CACHED: usize = 128;

/// Everything stored; with `queues` false, each session's queue is left in storage and
/// counted ([`LoadedState::backlogs`]).
fn load_all(conn: &mut Connection, queues: bool) -> rusqlite::Result<LoadedState> {
    start_broker(conn)?;
    let (queued, mut backlogs) = if queues {
        (queue::load_all(conn)?, HashMap::new())
    } else {
        let (backlogs, damaged) = queue::load_backlogs(conn)?;
        (damaged, backlogs)
    };
    let mut sessions = rows::Sessions {
        subscriptions: per_client(
            conn,
            &format!(
                "SELECT client_id, {SUBSCRIPTION_COLUMNS} FROM subscriptions \
                 ORDER BY client_id, filter"
            ),
            |row| rows::subscription(row),
        )?,
        queued,
        inflight: per_client(
            conn,
            &format!(
                "SELECT client_id, packet_id, state, {DELIVERY_COLUMNS} FROM inflight \
                 ORDER BY client_id, ord"
            ),
            |row| rows::inflight(row),
        )?,
        inbound: per_client(
            conn,
            "SELECT client_id, packet_id FROM inbound_qos2 ORDER BY client_id, packet_id",
            |row| rows::inbound(row),
        )?,
    };
    let mut state = LoadedState::default();
    let mut stmt = conn.prepare(&format!(
        "SELECT {SESSION_COLUMNS} FROM sessions ORDER BY client_id"
    ))?;
    let mut found = stmt.query([])?;
    while let Some(row) = found.next()? {
        let client_id: String = match row.get::<_, String>(0) {
            Ok(c) => c,
            Err(e) => {
                let raw = row.get_ref(0).map(|v| format!("{v:?}")).unwrap_or_default();
                state.set_aside.push(SetAside {
                    client_id: raw,
                    cause: format!("client id: {e}"),
                });
                continue;
            }
        };
        match sessions.read(&client_id, row) {
            Ok(record) => {
                if let Some(backlog) = backlogs.remove(&record.client_id) {
                    state.backlogs.insert(record.client_id.clone(), backlog);
                }
                state.sessions.push(record);
            }
            Err(cause) => state.set_aside.push(SetAside { client_id, cause }),
        }
    }
    let mut stmt = conn.prepare(&format!(
        "SELECT {RETAINED_COLUMNS} FROM retained ORDER BY topic"
    ))?;
    let mut found = stmt.query([])?;
    let mut retained = BTreeMap::new();
    while let Some(row) = found.next()? {
        rows::retained(row, &mut retained);
    }
    state.retained = retained.into_values().collect();
    let mut stmt = conn.prepare(&format!(
        "SELECT {STORED_COLUMNS} FROM messages WHERE released = 0 ORDER BY id"
    ))?;
    let mut found = stmt.query([])?;
    let mut messages = Vec::new();
    while let Some(row) = found.next()? {
        messages.push(rows::stored(row));
    }
    rows::attach_messages(&mut state, messages);
    state.max_message_id = conn
        // Ids held inline in stream segments are taken too.
        .query_row(
            "SELECT max(coalesce((SELECT max(id) FROM messages), 0), \
             coalesce((SELECT max(max_id) FROM stream_segments), 0))",
            [],
            |r| r.get::<_, Option<i64>>(0),
        )?
        .map_or(0, |id| u64::try_from(id).unwrap_or(0));
    // Each stream's counters, not its entries: the sums of its segments, and the first
    // segment (which may be partly trimmed) decoded.
    let mut stmt = conn.prepare(
        "SELECT s.name, s.next_offset, s.trimmed, \
         (SELECT count(*) FROM stream_segments g WHERE g.stream = s.name), \
         (SELECT total(g.entries) FROM stream_segments g WHERE g.stream = s.name), \
         (SELECT total(g.bytes) FROM stream_segments g WHERE g.stream = s.name), \
         s.filter, s.max_age, s.max_bytes, s.last_value FROM streams s ORDER BY s.name",
    )?;
    let mut first_segment = conn.prepare(
        "SELECT body, file, position, length FROM stream_segments WHERE stream = ?1 \
         ORDER BY first_offset LIMIT 1",
    )?;
    let mut found = stmt.query([])?;
    let unsigned = |v: Option<i64>| v.map_or(0, |v| u64::try_from(v).unwrap_or(0));
    while let Some(row) = found.next()? {
        let name: String = row.get(0)?;
        let next_offset = unsigned(row.get(1)?);
        let trimmed = unsigned(row.get(2)?);
        let definition = row
            .get::<_, Option<String>>(6)?
            .map(|filter| crate::StreamDefinition {
                filter,
                max_age: u64::try_from(row.get::<_, i64>(7).unwrap_or(0)).unwrap_or(0),
                max_bytes: u64::try_from(row.get::<_, i64>(8).unwrap_or(0)).unwrap_or(0),
                last_value: row.get::<_, bool>(9).unwrap_or(false),
            });
        let mut messages = row.get::<_, f64>(4)? as u64;
        let mut bytes = row.get::<_, f64>(5)? as u64;
        let (mut first_offset, mut first_time_ms) = (next_offset, 0);
        let first: Option<Vec<u8>> = first_segment
            .query_row([&name], |r| {
                files::body(conn, &name, r, 0).map(|b| b.into_owned())
            })
            .optional()?;
        if let Some(Ok(decoded)) = first.as_deref().map(segment::decode) {
            // Entries below the first offset are skipped, not counted. A referenced message
            // counts its bytes as stored in the segment row's total.
            let skipped: Vec<_> = decoded
                .iter()
                .filter(|d| d.entry.offset < trimmed)
                .collect();
            messages = messages.saturating_sub(skipped.len() as u64);
            for d in &skipped {
                let n = match &d.message {
                    Some(m) => m.size(),
                    None => conn
                        .query_row(
                            "SELECT length(CAST(topic AS BLOB)) + length(payload) \
                             + length(properties) FROM messages WHERE id = ?1",
                            [to_i64(d.entry.message_id)],
                            |r| r.get::<_, i64>(0),
                        )
                        .optional()?
                        .map_or(0, |n| u64::try_from(n).unwrap_or(0)),
                };
                bytes = bytes.saturating_sub(n);
            }
            if let Some(d) = decoded.iter().find(|d| d.entry.offset >= trimmed) {
                (first_offset, first_time_ms) = (d.entry.offset, d.entry.time_ms);
            }
        }
        state.streams.push(crate::StreamRecord {
            name,
            next_offset,
            first_offset,
            first_time_ms,
            messages,
            bytes,
            definition,
        });
    }
    Ok(state)
}

fn store_message(tx: &Transaction<'_>, stored: &StoredMessage) -> rusqlite::Result<usize> {
    let m = &stored.message;
    tx.prepare_cached(
        "INSERT OR IGNORE INTO messages (id, topic, payload, qos, retain, properties, \
         expires_at, publisher) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?
    .execute(params![
        to_i64(stored.id),
        m.topic,
        &m.payload[..],
        m.qos,
        m.retain,
        &m.properties[..],
        m.expires_at.map(to_i64),
        m.publisher,
    ])
}

/// Marks the messages the batch released (`ids`, in statements of at most
/// [`IDS_PER_READ`]); each is deleted at the end of the batch if nothing refers to it (a
/// message still referred to, a stream's, is left alone unless the batch takes references
/// from it). Last in the batch: nothing refers to a message again once it is released.
fn release_messages(tx: &Transaction<'_>, ids: &[u64], refs: &mut Refs) -> rusqlite::Result<()> {
    for chunk in ids.chunks(IDS_PER_READ) {
        let padded = padded_ids(chunk);
        let marks = vec!["?"; padded.len()].join(",");
        let mut stmt = tx.prepare_cached(&format!(
            "UPDATE messages SET released = 1 WHERE id IN ({marks}) RETURNING id, refs"
        ))?;
        let mut found = stmt.query(rusqlite::params_from_iter(padded))?;
        let mut marked = HashSet::new();
        while let Some(row) = found.next()? {
            let (id, n): (i64, i64) = (row.get(0)?, row.get(1)?);
            let id = u64::try_from(id).unwrap_or(0);
            marked.insert(id);
            if n <= 0 {
                refs.release(id);
            }
        }
        // The others are held inline by stream segments (or were never stored): their
        // release is remembered for a later reference that stores them, as runs of
        // consecutive ids (a stream's messages leave memory in the order they were stored).
        let mut inline: Vec<u64> = chunk
            .iter()
            .filter(|id| !marked.contains(id))
            .copied()
            .collect();
        inline.sort_unstable();
        inline.dedup();
        let mut insert = tx.prepare_cached(
            "INSERT OR REPLACE INTO inline_released_runs (first_id, last_id) VALUES (?1, ?2)",
        )?;
        for (first, last) in runs(&inline) {
            insert.execute(params![to_i64(first), to_i64(last)])?;
        }
    }
    Ok(())
}

/// The runs of consecutive ids of `ids` (sorted, without duplicates), as (first, last).
fn runs(ids: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &id in ids {
        match out.last_mut() {
            Some((_, last)) if *last + 1 == id => *last = id,
            _ => out.push((id, id)),
        }
    }
    out
}

/// `ids` (not empty) as statement parameters, the last repeated up to the next power of two:
/// a statement naming a list of ids is then one of a few shapes, each prepared once and
/// cached, not one per length (preparing took a few percent of the core under a stream's
/// releases). Only for statements a repeated id does not change (`IN`).
fn padded_ids(ids: &[u64]) -> Vec<i64> {
    let mut out: Vec<i64> = ids.iter().map(|id| to_i64(*id)).collect();
    if let Some(&last) = out.last() {
        out.resize(out.len().next_power_of_two(), last);
    }
    out
}

/// Sets an in-flight message (change `index`), counting the reference it adds and the one it
/// replaces.
fn set_inflight(
    tx: &Transaction<'_>,
    client_id: &str,
    inflight: &InflightRecord,
    index: usize,
    refs: &mut Refs,
) -> rusqlite::Result<usize> {
    let d = &inflight.delivery;
    let old: Option<i64> = tx
        .prepare_cached("SELECT message_id FROM inflight WHERE client_id = ?1 AND packet_id = ?2")?
        .query_row(params![client_id, inflight.packet_id], |r| r.get(0))
        .optional()?;
    if let Some(old) = old {
        refs.remove(u64::try_from(old).unwrap_or(0), 1);
    }
    refs.add(d.message_id, index);
    tx.prepare_cached(
        "INSERT INTO inflight (client_id, packet_id, ord, state, message_id, qos, retain, \
         subscription_ids, share) VALUES (?1, ?2, \
         (SELECT COALESCE(MAX(ord), 0) + 1 FROM inflight WHERE client_id = ?1), \
         ?3, ?4, ?5, ?6, ?7, ?8) \
         ON CONFLICT (client_id, packet_id) DO UPDATE SET state = excluded.state, \
         message_id = excluded.message_id, qos = excluded.qos, retain = excluded.retain, \
         subscription_ids = excluded.subscription_ids, share = excluded.share",
    )?
    .execute(params![
        client_id,
        inflight.packet_id,
        inflight.state.as_str(),
        to_i64(d.message_id),
        d.qos,
        d.retain,
        rows::encode_ids(&d.subscription_ids),
        d.share,
    ])
}

fn set_will(
    tx: &Transaction<'_>,
    client_id: &str,
    will: Option<&WillRecord>,
) -> rusqlite::Result<usize> {
    let m = will.map(|w| &w.message);
    tx.prepare_cached(
        "UPDATE sessions SET will_topic = ?2, will_payload = ?3, will_qos = ?4, \
         will_retain = ?5, will_properties = ?6, will_expires_at = ?7, will_publisher = ?8, \
         will_delay_interval = ?9 WHERE client_id = ?1",
    )?
    .execute(params![
        client_id,
        m.map(|m| m.topic.as_str()),
        m.map(|m| &m.payload[..]),
        m.map(|m| m.qos),
        m.map(|m| m.retain),
        m.map(|m| &m.properties[..]),
        m.and_then(|m| m.expires_at.map(to_i64)),
        m.and_then(|m| m.publisher.as_deref()),
        will.map(|w| w.delay_interval),
    ])
}

fn save_header(
    tx: &Transaction<'_>,
    client_id: &str,
    level: u8,
    expiry: u32,
    disconnected_at: Option<u64>,
    username: Option<&str>,
    certificate: Option<&str>,
) -> rusqlite::Result<usize> {
    tx.prepare_cached(
        "INSERT INTO sessions (client_id, protocol_level, session_expiry_interval, \
         disconnected_at, username, certificate) VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
         ON CONFLICT (client_id) \
         DO UPDATE SET protocol_level = excluded.protocol_level, \
         session_expiry_interval = excluded.session_expiry_interval, \
         disconnected_at = excluded.disconnected_at, username = excluded.username, \
         certificate = excluded.certificate",
    )?
    .execute(params![
        client_id,
        level,
        expiry,
        disconnected_at.map(to_i64),
        username,
        certificate
    ])
}

/// Deletes the session of `client_id` and everything it holds, counting the references it
/// held.
fn delete_session_rows(
    tx: &Transaction<'_>,
    client_id: &str,
    refs: &mut Refs,
) -> rusqlite::Result<usize> {
    queue::delete_queue(tx, client_id, refs)?;
    {
        let mut held = tx.prepare_cached(
            "SELECT message_id, count(*) FROM inflight WHERE client_id = ?1 GROUP BY 1",
        )?;
        let found = held.query_map([client_id], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
        })?;
        for row in found {
            let (id, n) = row?;
            refs.remove(u64::try_from(id).unwrap_or(0), n);
        }
    }
    // Children first: a damaged session row must not keep its rows behind.
    for table in ["subscriptions", "inflight", "inbound_qos2"] {
        tx.prepare_cached(&format!("DELETE FROM {table} WHERE client_id = ?1"))?
            .execute([client_id])?;
    }
    tx.prepare_cached("DELETE FROM sessions WHERE client_id = ?1")?
        .execute([client_id])
}

/// Applies one change; `Ok(false)` when it adds to a session that is not stored.
/// What a batch gathers while its changes are applied: the references counted, the queue
/// changes not yet written, the clients whose session is known stored.
#[derive(Default)]
struct Pending<'c> {
    refs: Refs,
    queues: QueueChanges<'c>,
    /// Clients whose session is stored (checked, or created by this batch) as of now.
    stored: HashSet<&'c str>,
    /// The `InflightSet` changes the batch removes again ([`cancelled_sets`]).
    cancelled: HashSet<usize>,
    /// The messages the batch releases, marked at its end ([`release_messages`]).
    released: Vec<u64>,
    /// The streams the batch appends to, with the offset after their last entry so far
    /// ([`move_streams_on`]).
    appended: HashMap<&'c str, i64>,
    /// The messages stored by the batch that only its stream appends refer to: held inline
    /// in the stream's segment, not in the message store ([`inline_candidates`]).
    inline: HashSet<u64>,
    /// Those of [`inline`](Self::inline) seen stored so far, by id.
    inline_messages: HashMap<u64, &'c StoredMessage>,
    /// The entries the batch appends, per stream, written as one segment at its end.
    segments: BTreeMap<&'c str, Vec<(crate::StreamEntryRecord, segment::Body<'c>)>>,
}

/// The ids of the messages `batch` stores that nothing in it but stream appends refers to.
fn inline_candidates(batch: &[Change]) -> HashSet<u64> {
    let mut stored = HashSet::new();
    let mut appended = HashSet::new();
    let mut other = HashSet::new();
    for change in batch {
        match change {
            Change::MessageStored { message } => {
                stored.insert(message.id);
            }
            Change::StreamAppended { entry, .. } => {
                appended.insert(entry.message_id);
            }
            Change::MessageQueued { delivery, .. } => {
                other.insert(delivery.message_id);
            }
            Change::InflightSet { inflight, .. } => {
                other.insert(inflight.delivery.message_id);
            }
            Change::SessionWritten(r, _) => {
                other.extend(r.queued.iter().map(|q| q.delivery.message_id));
                other.extend(r.inflight.iter().map(|f| f.delivery.message_id));
            }
            _ => {}
        }
    }
    stored
        .into_iter()
        .filter(|id| appended.contains(id) && !other.contains(id))
        .collect()
}

/// The indices of the `InflightSet` changes of `batch` whose entry a later
/// `InflightRemoved` of the same client and packet identifier removes, with no session
/// change of that client between them: what the batch leaves is the same without writing
/// them (the removal deletes whatever was stored before). A message delivered and
/// acknowledged within one batch, as a draining session's are, then writes no in-flight row.
fn cancelled_sets(batch: &[Change]) -> HashSet<usize> {
    let mut pending: HashMap<(&str, u16), Vec<usize>> = HashMap::new();
    let mut cancelled = HashSet::new();
    for (index, change) in batch.iter().enumerate() {
        match change {
            Change::InflightSet {
                client_id,
                inflight,
            } => pending
                .entry((client_id.as_str(), inflight.packet_id))
                .or_default()
                .push(index),
            Change::InflightRemoved {
                client_id,
                packet_id,
            } => {
                if let Some(sets) = pending.remove(&(client_id.as_str(), *packet_id)) {
                    cancelled.extend(sets);
                }
            }
            Change::SessionSaved(_)
            | Change::SessionWritten(..)
            | Change::SessionDeleted { .. } => {
                if let Some(client_id) = change.client_id() {
                    pending.retain(|(c, _), _| *c != client_id);
                }
            }
            _ => {}
        }
    }
    cancelled
}

impl<'c> Pending<'c> {
    /// `stream` holds an entry at `offset`: its row is made now if needed, and moves on
    /// once at the end of the batch ([`move_streams_on`]).
    fn move_on(
        &mut self,
        tx: &Transaction<'_>,
        stream: &'c str,
        offset: u64,
    ) -> rusqlite::Result<()> {
        let next = to_i64(offset) + 1;
        match self.appended.get_mut(stream) {
            Some(n) => *n = (*n).max(next),
            None => {
                tx.prepare_cached(
                    "INSERT INTO streams (name, next_offset) VALUES (?1, ?2) \
                     ON CONFLICT (name) \
                     DO UPDATE SET next_offset = max(next_offset, excluded.next_offset)",
                )?
                .execute(params![stream, next])?;
                self.appended.insert(stream, next);
            }
        }
        Ok(())
    }

    /// Whether the session of `client_id` is stored, as of this point of the batch.
    fn session_stored(
        &mut self,
        tx: &Transaction<'_>,
        client_id: &'c str,
    ) -> rusqlite::Result<bool> {
        if self.stored.contains(client_id) {
            return Ok(true);
        }
        let found = tx
            .prepare_cached("SELECT 1 FROM sessions WHERE client_id = ?1")?
            .exists([client_id])?;
        if found {
            self.stored.insert(client_id);
        }
        Ok(found)
    }
}

/// Applies change `index`; `Ok(false)` when it adds to a session that is not stored.
fn apply_one<'c>(
    tx: &Transaction<'_>,
    index: usize,
    change: &'c Change,
    p: &mut Pending<'c>,
) -> rusqlite::Result<bool> {
    let not_stored = |n: usize| n > 0;
    // The queue changes gathered for a session go before it is replaced or deleted.
    if let Change::SessionWritten(..) | Change::SessionDeleted { .. } = change {
        if let Some(client_id) = change.client_id() {
            p.queues.write_client(tx, client_id, &mut p.refs)?;
            p.stored.remove(client_id);
        }
    }
    Ok(match change {
        Change::SessionSaved(h) => {
            save_header(
                tx,
                &h.client_id,
                h.protocol_level,
                h.session_expiry_interval,
                h.disconnected_at,
                h.username.as_deref(),
                h.certificate.as_deref(),
            )?;
            p.stored.insert(&h.client_id);
            true
        }
        Change::SessionWritten(r, messages) => {
            for m in messages {
                store_message(tx, m)?;
            }
            delete_session_rows(tx, &r.client_id, &mut p.refs)?;
            save_header(
                tx,
                &r.client_id,
                r.protocol_level,
                r.session_expiry_interval,
                r.disconnected_at,
                r.username.as_deref(),
                r.certificate.as_deref(),
            )?;
            set_will(tx, &r.client_id, r.will.as_ref())?;
            for s in &r.subscriptions {
                add_subscription(tx, &r.client_id, s)?;
            }
            queue::insert_queue(tx, &r.client_id, &r.queued, index, &mut p.refs)?;
            for f in &r.inflight {
                set_inflight(tx, &r.client_id, f, index, &mut p.refs)?;
            }
            p.stored.insert(&r.client_id);
            for id in &r.inbound_qos2 {
                add_inbound(tx, &r.client_id, *id)?;
            }
            true
        }
        Change::SessionDeleted { client_id } => {
            delete_session_rows(tx, client_id, &mut p.refs)?;
            true
        }
        Change::SubscriptionAdded {
            client_id,
            subscription,
        } => not_stored(add_subscription(tx, client_id, subscription)?),
        Change::SubscriptionRemoved { client_id, filter } => {
            tx.prepare_cached("DELETE FROM subscriptions WHERE client_id = ?1 AND filter = ?2")?
                .execute(params![client_id, filter])?;
            true
        }
        Change::WillSet { client_id, will } => not_stored(set_will(tx, client_id, Some(will))?),
        Change::WillCleared { client_id } => {
            set_will(tx, client_id, None)?;
            true
        }
        Change::MessageStored { message } => {
            if p.inline.contains(&message.id) {
                p.inline_messages.insert(message.id, message);
            } else {
                store_message(tx, message)?;
            }
            true
        }
        Change::MessageReleased { id } => {
            p.released.push(*id);
            true
        }
        Change::MessageQueued {
            client_id,
            seq,
            delivery,
        } => {
            let stored = p.session_stored(tx, client_id)?;
            if stored {
                p.queues.add(client_id, *seq, index, Some(delivery));
            }
            stored
        }
        Change::MessageDequeued { client_id, seq } => {
            p.queues.add(client_id, *seq, index, None);
            true
        }
        Change::InflightSet {
            client_id,
            inflight,
        } if p.cancelled.contains(&index) => {
            // Removed later in the batch: refused as it would be (a session or a message
            // that is not stored), its reference counted in and out, no row written.
            let stored = p.session_stored(tx, client_id)?;
            if stored {
                p.refs.add(inflight.delivery.message_id, index);
                p.refs.remove(inflight.delivery.message_id, 1);
            }
            stored
        }
        Change::InflightSet {
            client_id,
            inflight,
        } => not_stored(set_inflight(tx, client_id, inflight, index, &mut p.refs)?),
        Change::InflightRemoved {
            client_id,
            packet_id,
        } => {
            let removed: Option<i64> = tx
                .prepare_cached(
                    "DELETE FROM inflight WHERE client_id = ?1 AND packet_id = ?2 \
                     RETURNING message_id",
                )?
                .query_row(params![client_id, packet_id], |r| r.get(0))
                .optional()?;
            if let Some(id) = removed {
                p.refs.remove(u64::try_from(id).unwrap_or(0), 1);
            }
            true
        }
        Change::InboundQos2Added {
            client_id,
            packet_id,
        } => not_stored(add_inbound(tx, client_id, *packet_id)?),
        Change::InboundQos2Removed {
            client_id,
            packet_id,
        } => {
            tx.prepare_cached("DELETE FROM inbound_qos2 WHERE client_id = ?1 AND packet_id = ?2")?
                .execute(params![client_id, packet_id])?;
            true
        }
        Change::RetainedSet(r) => {
            let m = &r.message;
            tx.prepare_cached(
                "INSERT OR REPLACE INTO retained (topic, payload, qos, retain, properties, \
                 expires_at, publisher, share, publisher_username, publisher_listener) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            )?
            .execute(params![
                m.topic,
                &m.payload[..],
                m.qos,
                m.retain,
                &m.properties[..],
                m.expires_at.map(to_i64),
                m.publisher,
                m.share,
                r.publisher_username,
                r.publisher_listener,
            ])?;
            true
        }
        Change::RetainedDeleted { topic } => {
            tx.prepare_cached("DELETE FROM retained WHERE topic = ?1")?
                .execute([topic])?;
            true
        }
        Change::StreamDefined {
            stream,
            definition: d,
        } => {
            tx.prepare_cached(
                "INSERT INTO streams (name, next_offset, filter, max_age, max_bytes, last_value) \
                 VALUES (?1, 1, ?2, ?3, ?4, ?5) ON CONFLICT (name) DO UPDATE SET \
                 filter = excluded.filter, max_age = excluded.max_age, \
                 max_bytes = excluded.max_bytes, last_value = excluded.last_value",
            )?
            .execute(params![
                stream,
                d.filter,
                to_i64(d.max_age),
                to_i64(d.max_bytes),
                d.last_value
            ])?;
            true
        }
        Change::StreamAppended { stream, entry } => {
            p.move_on(tx, stream, entry.offset)?;
            let body = match p.inline_messages.get(&entry.message_id) {
                Some(m) => segment::Body::Inline(&m.message),
                None => {
                    // The count of references refuses an entry whose message is not stored.
                    p.refs.add(entry.message_id, index);
                    segment::Body::Ref
                }
            };
            let pending = p.segments.entry(stream.as_str()).or_default();
            // An entry written again at the same offset replaces the one before.
            if pending
                .last()
                .is_some_and(|(e, _)| e.offset >= entry.offset)
            {
                drop_pending(pending, &mut p.refs, |o| o == entry.offset);
            }
            pending.push((*entry, body));
            true
        }
        Change::StreamSegment { stream, entries } => {
            let Some(last) = entries.last() else {
                return Ok(true);
            };
            p.move_on(tx, stream, last.entry.offset)?;
            let pending = p.segments.entry(stream.as_str()).or_default();
            let first = entries
                .first()
                .map_or(last.entry.offset, |a| a.entry.offset);
            // Entries written again at their offsets replace those before.
            let again = pending.last().is_some_and(|(e, _)| e.offset >= first);
            if again {
                let offsets: HashSet<u64> = entries.iter().map(|a| a.entry.offset).collect();
                drop_pending(pending, &mut p.refs, |o| offsets.contains(&o));
            }
            // Held inline: the entry is the message's only reference (released at once).
            pending.extend(
                entries
                    .iter()
                    .map(|a| (a.entry, segment::Body::Inline(&a.message))),
            );
            if again {
                pending.sort_by_key(|(e, _)| e.offset);
            }
            true
        }
        Change::StreamTrimmed { stream, below } => {
            if let Some(pending) = p.segments.get_mut(stream.as_str()) {
                drop_pending(pending, &mut p.refs, |o| o < *below);
            }
            trim_segments(tx, stream, to_i64(*below), &mut p.refs)?;

            tx.prepare_cached(
                "UPDATE streams SET next_offset = max(next_offset, ?2) WHERE name = ?1",
            )?
            .execute(params![stream, to_i64(*below)])?;
            true
        }
        Change::StreamEntryRemoved { stream, offset } => {
            if let Some(pending) = p.segments.get_mut(stream.as_str()) {
                drop_pending(pending, &mut p.refs, |o| o == *offset);
            }
            remove_segment_entry(tx, stream, to_i64(*offset), &mut p.refs)?;

            true
        }
        Change::StreamDeleted { stream } => {
            if let Some(mut pending) = p.segments.remove(stream.as_str()) {
                drop_pending(&mut pending, &mut p.refs, |_| true);
            }
            trim_segments(tx, stream, i64::MAX, &mut p.refs)?;

            tx.prepare_cached("DELETE FROM streams WHERE name = ?1")?
                .execute([stream])?;
            p.appended.remove(stream.as_str());
            true
        }
    })
}

/// Drops the entries of `pending` (a segment not yet written) whose offset `gone` says,
/// giving up the references they held.
fn drop_pending(
    pending: &mut Vec<(crate::StreamEntryRecord, segment::Body<'_>)>,
    refs: &mut Refs,
    gone: impl Fn(u64) -> bool,
) {
    pending.retain(|(e, body)| {
        let keep = !gone(e.offset);
        if !keep && matches!(body, segment::Body::Ref) {
            refs.remove(e.message_id, 1);
        }
        keep
    });
}

/// Gives up the references of the entries of the segment `body` that `gone` says.
fn give_up_refs(body: &[u8], refs: &mut Refs, gone: impl Fn(u64) -> bool) {
    // A segment that cannot be decoded holds no reference this build can count.
    for d in segment::decode(body).unwrap_or_default() {
        if d.message.is_none() && gone(d.entry.offset) {
            refs.remove(d.entry.message_id, 1);
        }
    }
}

/// Deletes the segments of `stream` whose entries are all below `below` and records
/// `below` as the stream's first offset: a segment partly below it is kept, its older
/// entries skipped when read.
fn trim_segments(
    tx: &Transaction<'_>,
    stream: &str,
    below: i64,
    refs: &mut Refs,
) -> rusqlite::Result<()> {
    // Entries below the stream's earlier first offset gave up their references then.
    let trimmed: i64 = tx
        .prepare_cached("SELECT trimmed FROM streams WHERE name = ?1")?
        .query_row([stream], |r| r.get(0))
        .optional()?
        .unwrap_or(0);
    if below <= trimmed {
        return Ok(());
    }
    let (from, to) = (
        u64::try_from(trimmed).unwrap_or(0),
        u64::try_from(below).unwrap_or(0),
    );
    {
        let mut stmt = tx.prepare_cached(
            "DELETE FROM stream_segments WHERE stream = ?1 AND first_offset < ?2 \
             AND last_offset < ?2 RETURNING refs, body, file, position, length",
        )?;
        let mut rows = stmt.query(params![stream, below])?;
        while let Some(row) = rows.next()? {
            if row.get::<_, i64>(0)? > 0 {
                give_up_refs(&files::body(tx, stream, row, 1)?, refs, |o| o >= from);
            }
        }
        // A segment partly below `below` is kept; its entries below give up theirs now.
        let mut stmt = tx.prepare_cached(
            "SELECT body, file, position, length FROM stream_segments WHERE stream = ?1 \
             AND first_offset < ?2 AND refs > 0",
        )?;
        let mut rows = stmt.query(params![stream, below])?;
        while let Some(row) = rows.next()? {
            let body = files::body(tx, stream, row, 0)?;
            give_up_refs(&body, refs, |o| o >= from && o < to);
        }
    }
    tx.prepare_cached("UPDATE streams SET trimmed = ?2 WHERE name = ?1")?
        .execute(params![stream, below])?;
    // Releases below every inline message still held are no longer needed (the runs are
    // disjoint: those starting below it, through the key, but one reaching over it).
    let lowest_held: i64 = tx
        .prepare_cached(
            "SELECT coalesce((SELECT min(min_id) FROM stream_segments \
             WHERE min_id IS NOT NULL), 1 << 62)",
        )?
        .query_row([], |r| r.get(0))?;
    tx.prepare_cached("DELETE FROM inline_released_runs WHERE first_id < ?1 AND last_id < ?1")?
        .execute([lowest_held])?;
    Ok(())
}

/// Removes the entry at `offset` of `stream` from its segment (rewritten without it).
fn remove_segment_entry(
    tx: &Transaction<'_>,
    stream: &str,
    offset: i64,
    refs: &mut Refs,
) -> rusqlite::Result<()> {
    let found: Option<(i64, Vec<u8>)> = tx
        .prepare_cached(
            "SELECT first_offset, body, file, position, length FROM stream_segments \
             WHERE stream = ?1 AND first_offset = (SELECT max(first_offset) \
             FROM stream_segments WHERE stream = ?1 AND first_offset <= ?2) \
             AND last_offset >= ?2",
        )?
        .query_row(params![stream, offset], |r| {
            Ok((r.get(0)?, files::body(tx, stream, r, 1)?.into_owned()))
        })
        .optional()?;
    let Some((first, body)) = found else {
        return Ok(());
    };
    let Ok(decoded) = segment::decode(&body) else {
        return Ok(());
    };
    let offset = u64::try_from(offset).unwrap_or(0);
    let mut kept = Vec::with_capacity(decoded.len());
    let mut ref_messages = Vec::new();
    for d in &decoded {
        if d.entry.offset == offset {
            if d.message.is_none() {
                refs.remove(d.entry.message_id, 1);
            }
            continue;
        }
        if d.message.is_none() {
            ref_messages.push(d.entry.message_id);
        }
        kept.push(d);
    }
    tx.prepare_cached("DELETE FROM stream_segments WHERE stream = ?1 AND first_offset = ?2")?
        .execute(params![stream, first])?;
    if kept.is_empty() {
        return Ok(());
    }
    let sizes = ref_sizes(tx, &ref_messages)?;
    let entries: Vec<_> = kept
        .iter()
        .map(|d| {
            let body = match &d.message {
                Some(m) => segment::Body::Inline(m),
                None => segment::Body::Ref,
            };
            (d.entry, body)
        })
        .collect();
    // Rewritten inline: a file is append-only.
    insert_segment(tx, stream, &entries, &sizes, None)
}

/// The bytes (topic, payload, properties) of each stored message of `ids`.
fn ref_sizes(tx: &Transaction<'_>, ids: &[u64]) -> rusqlite::Result<HashMap<u64, i64>> {
    let mut out = HashMap::new();
    let mut stmt = tx.prepare_cached(
        "SELECT length(CAST(topic AS BLOB)) + length(payload) + length(properties) \
         FROM messages WHERE id = ?1",
    )?;
    for id in ids {
        if let Some(n) = stmt
            .query_row([to_i64(*id)], |r| r.get::<_, i64>(0))
            .optional()?
        {
            out.insert(*id, n);
        }
    }
    Ok(out)
}

/// Writes `entries` (offset order, not empty) of `stream` as one segment row, its body
/// appended to the stream's file by `to` (the row then refers to it), or in the row.
fn insert_segment(
    tx: &Transaction<'_>,
    stream: &str,
    entries: &[(crate::StreamEntryRecord, segment::Body<'_>)],
    sizes: &HashMap<u64, i64>,
    to: Option<&mut files::Appends<'_>>,
) -> rusqlite::Result<()> {
    let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
        return Ok(());
    };
    let (mut bytes, mut refs) = (0i64, 0i64);
    let (mut min_id, mut max_id) = (None::<u64>, None::<u64>);
    for (e, body) in entries {
        match body {
            segment::Body::Inline(m) => {
                bytes += to_i64(m.size());
                min_id = Some(min_id.map_or(e.message_id, |v| v.min(e.message_id)));
                max_id = Some(max_id.map_or(e.message_id, |v| v.max(e.message_id)));
            }
            segment::Body::Ref => {
                refs += 1;
                bytes += sizes.get(&e.message_id).copied().unwrap_or(0);
            }
        }
    }
    // A message that cannot be encoded (a QoS above 2) refuses the batch.
    let body =
        segment::encode(entries).map_err(|e| rusqlite::Error::ToSqlConversionFailure(e.into()))?;
    let row = params![
        stream,
        to_i64(first.0.offset),
        to_i64(last.0.offset),
        entries.len() as i64,
        bytes,
        refs,
        min_id.map(to_i64),
        max_id.map(to_i64),
    ];
    let Some(to) = to else {
        // Without the columns of schema 12: the upgrade from 7 writes these too.
        tx.prepare_cached(
            "INSERT INTO stream_segments (stream, first_offset, last_offset, entries, bytes, \
             refs, min_id, max_id, body) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?
        .execute(rusqlite::params_from_iter(
            row.iter().copied().chain([&body as &dyn rusqlite::ToSql]),
        ))?;
        return Ok(());
    };
    let at = to
        .append(stream, &body)
        .map_err(|e| files::write_failure(stream, e))?;
    tx.prepare_cached(
        "INSERT INTO stream_segments (stream, first_offset, last_offset, entries, bytes, refs, \
         min_id, max_id, body, file, position, length) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, X'', ?9, ?10, ?11)",
    )?
    .execute(rusqlite::params_from_iter(row.iter().copied().chain([
        &to_i64(at.file) as &dyn rusqlite::ToSql,
        &to_i64(at.position),
        &to_i64(at.length),
    ])))?;
    Ok(())
}

/// Writes the segments the batch appended: per stream, one row per
/// [`ENTRIES_PER_SEGMENT`] entries, their bodies in the stream's file through `appends`
/// (a `last_value` stream's in the rows: an older value's removal rewrites its segment).
fn write_segments(
    tx: &Transaction<'_>,
    segments: &BTreeMap<&str, Vec<(crate::StreamEntryRecord, segment::Body<'_>)>>,
    refs: &mut Refs,
    mut appends: Option<&mut files::Appends<'_>>,
) -> rusqlite::Result<()> {
    for (stream, entries) in segments {
        let Some((first, _)) = entries.first() else {
            continue;
        };
        // Appends move on, so this is only for entries written again at their offset.
        let overlap: Option<i64> = tx
            .prepare_cached(
                "SELECT last_offset FROM stream_segments WHERE stream = ?1 \
                 ORDER BY first_offset DESC LIMIT 1",
            )?
            .query_row([stream], |r| r.get(0))
            .optional()?
            .filter(|last| *last >= to_i64(first.offset));
        if overlap.is_some() {
            for (e, _) in entries {
                remove_segment_entry(tx, stream, to_i64(e.offset), refs)?;
            }
        }
        let ids: Vec<u64> = entries
            .iter()
            .filter(|(_, b)| matches!(b, segment::Body::Ref))
            .map(|(e, _)| e.message_id)
            .collect();
        let sizes = ref_sizes(tx, &ids)?;
        let last_value: bool = tx
            .prepare_cached("SELECT coalesce(last_value, 0) FROM streams WHERE name = ?1")?
            .query_row([stream], |r| r.get(0))
            .optional()?
            .unwrap_or(false);
        for chunk in entries.chunks(ENTRIES_PER_SEGMENT) {
            let to = appends.as_deref_mut().filter(|_| !last_value);
            insert_segment(tx, stream, chunk, &sizes, to)?;
        }
    }
    Ok(())
}

/// Stores message `id` from the segment that holds it inline, with `refs` references: a
/// message first held only by a stream that something else now refers to. `false` when no
/// segment holds it.
fn materialize(tx: &Transaction<'_>, id: u64, refs: i64) -> rusqlite::Result<bool> {
    let mut stmt = tx.prepare_cached(
        "SELECT t.trimmed, g.stream, g.body, g.file, g.position, g.length \
         FROM stream_segments g JOIN streams t ON t.name = g.stream WHERE g.min_id <= ?1 AND g.max_id >= ?1 AND g.min_id IS NOT NULL \
         ORDER BY g.min_id DESC",
    )?;
    let mut rows = stmt.query([to_i64(id)])?;
    let mut message = None;
    while let Some(row) = rows.next()? {
        let from = u64::try_from(row.get::<_, i64>(0)?).unwrap_or(0);
        let stream: String = row.get(1)?;
        let Ok(decoded) = segment::decode(&files::body(tx, &stream, row, 2)?) else {
            continue;
        };
        // An entry below its stream's first offset is gone.
        message = decoded
            .into_iter()
            .find(|d| d.entry.message_id == id && d.entry.offset >= from)
            .and_then(|d| d.message);
        if message.is_some() {
            break;
        }
    }
    drop(rows);
    let Some(message) = message else {
        return Ok(false);
    };
    // Released if the broker released it, or it was stored before this broker started
    // (which then holds no message only streams refer to).
    let released: bool = tx
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM inline_released_runs WHERE first_id = \
             (SELECT max(first_id) FROM inline_released_runs WHERE first_id <= ?1) \
             AND last_id >= ?1) OR ?1 < coalesce((SELECT value FROM meta WHERE key = 'held_from'), 0)",
        )?
        .query_row([to_i64(id)], |r| r.get(0))?;
    store_message(tx, &StoredMessage { id, message })?;
    tx.prepare_cached("UPDATE messages SET refs = ?2, released = ?3 WHERE id = ?1")?
        .execute(params![to_i64(id), refs, released])?;
    Ok(true)
}

/// Moves each stream appended to in the batch on to the offset after its last entry: one
/// statement per stream rather than per entry.
fn move_streams_on(tx: &Transaction<'_>, appended: &HashMap<&str, i64>) -> rusqlite::Result<()> {
    let mut update =
        tx.prepare_cached("UPDATE streams SET next_offset = max(next_offset, ?2) WHERE name = ?1")?;
    for (stream, next) in appended {
        update.execute(params![stream, next])?;
    }
    Ok(())
}

fn add_subscription(
    tx: &Transaction<'_>,
    client_id: &str,
    s: &SubscriptionRecord,
) -> rusqlite::Result<usize> {
    // The foreign key refuses a subscription for a session that is not stored.
    tx.prepare_cached(
        "INSERT OR REPLACE INTO subscriptions (client_id, filter, qos, no_local, \
         retain_as_published, retain_handling, subscription_identifier) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        client_id,
        s.filter,
        s.qos,
        s.no_local,
        s.retain_as_published,
        s.retain_handling,
        s.subscription_identifier,
    ])
}

fn add_inbound(tx: &Transaction<'_>, client_id: &str, packet_id: u16) -> rusqlite::Result<usize> {
    // OR IGNORE skips an id already there; the foreign key still refuses a missing session.
    tx.prepare_cached("INSERT OR IGNORE INTO inbound_qos2 (client_id, packet_id) VALUES (?1, ?2)")?
        .execute(params![client_id, packet_id])
        .map(|_| 1)
}

/// Adds each message's net change of references to its count; a reference added to a
/// message that is not stored refuses the batch (`Err` with the index of the change).
fn count_references(tx: &Transaction<'_>, refs: &mut Refs) -> rusqlite::Result<Result<(), usize>> {
    let deltas = refs.take();
    let candidates = refs.sweep_candidates(&deltas);
    let mut update = tx.prepare_cached("UPDATE messages SET refs = refs + ?2 WHERE id = ?1")?;
    for (&id, delta) in &deltas {
        if delta.net == 0 && delta.first_addition.is_none() {
            continue;
        }
        let n = update.execute(params![to_i64(id), delta.net])?;
        if n == 0 && delta.net > 0 && materialize(tx, id, delta.net)? {
            continue;
        }
        if n == 0 {
            if let Some(index) = delta.first_addition {
                return Ok(Err(index));
            }
        }
    }
    let mut delete = tx.prepare_cached(DELETE_RELEASED)?;
    for id in candidates {
        delete.execute([to_i64(id)])?;
    }
    Ok(Ok(()))
}

fn apply_batch(
    conn: &mut Connection,
    mut files: Option<&mut files::SegmentFiles>,
    batch: &[Change],
    durable: bool,
) -> Result<(), StorageError> {
    validate_batch(batch)?;
    if durable {
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(classify)?;
    }
    let result = (|| {
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(classify)?;
        // A durable commit makes the earlier commits' rows durable too: the file bytes they
        // refer to are on disk first.
        if let Some(f) = files.as_deref_mut().filter(|_| durable) {
            f.sync_unsynced().map_err(|e| {
                StorageError::transient(format!("cannot sync the stream segment files: {e}"))
            })?;
        }
        // A durable commit keeps its segments in their rows: in a file they would cost a
        // second sync per commit (the file's, then the log's), about 40 % of a durable
        // publisher's rate with a stream.
        let mut appends = files
            .as_deref_mut()
            .filter(|_| !durable)
            .map(files::SegmentFiles::appends);
        let mut pending = Pending {
            cancelled: cancelled_sets(batch),
            inline: inline_candidates(batch),
            ..Pending::default()
        };
        let failed = |index: usize, e: rusqlite::Error| {
            let e = classify(e);
            let kind = batch.get(index).map_or("batch", Change::kind);
            StorageError::new(
                e.kind(),
                format!("change {index} ({kind}): {}", e.message()),
            )
        };
        for (index, change) in batch.iter().enumerate() {
            match apply_one(&tx, index, change, &mut pending) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(refused(
                        index,
                        change,
                        "no session is stored for the client",
                    ))
                }
                Err(e) => return Err(failed(index, e)),
            }
        }
        let Pending {
            mut refs,
            mut queues,
            released,
            appended,
            segments,
            ..
        } = pending;
        move_streams_on(&tx, &appended).map_err(|e| failed(batch.len(), e))?;
        write_segments(&tx, &segments, &mut refs, appends.as_mut())
            .map_err(|e| failed(batch.len(), e))?;
        queues
            .write_all(&tx, &mut refs)
            .map_err(|e| failed(batch.len(), e))?;
        release_messages(&tx, &released, &mut refs).map_err(|e| failed(batch.len(), e))?;
        match count_references(&tx, &mut refs).map_err(|e| failed(batch.len(), e))? {
            Ok(()) => {}
            Err(index) => {
                return Err(refused(
                    index,
                    &batch[index],
                    "the message it refers to is not stored",
                ))
            }
        }
        tx.commit().map_err(classify)?;
        if let Some(a) = appends {
            a.committed();
        }
        Ok(())
    })();
    if durable {
        let _ = conn.pragma_update(None, "synchronous", "NORMAL");
    }
    if let Some(files) = files.filter(|_| result.is_ok()) {
        // Files of trimmed or deleted ranges go once no committed row refers to them.
        let retained = batch.iter().filter_map(|c| match c {
            Change::StreamTrimmed { stream, .. }
            | Change::StreamDeleted { stream }
            | Change::StreamEntryRemoved { stream, .. } => Some(stream.as_str()),
            _ => None,
        });
        files.tidy(conn, retained);
        files.after_commit(conn);
    }
    result
}

#[async_trait]
impl Storage for SqliteStorage {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    async fn load(&self) -> Result<LoadedState, StorageError> {
        self.call(|conn| load_all(conn, true).map_err(classify))
            .await
    }

    async fn load_without_queues(&self) -> Result<LoadedState, StorageError> {
        self.call(|conn| load_all(conn, false).map_err(classify))
            .await
    }

    async fn load_queue(&self, client_id: &str) -> Result<Vec<QueuedRecord>, StorageError> {
        let client_id = client_id.to_string();
        self.call(move |conn| {
            queue::load_one(conn, &client_id)
                .map_err(classify)?
                .map_err(|cause| {
                    StorageError::refused(format!("the queue of {client_id}: {cause}"))
                })
        })
        .await
    }

    async fn load_messages(&self, ids: &[u64]) -> Result<Vec<StoredMessage>, StorageError> {
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        self.call(move |conn| load_messages(conn, &ids).map_err(classify))
            .await
    }

    async fn read_stream(
        &self,
        stream: &str,
        from_offset: u64,
        from_time_ms: u64,
        max: usize,
        max_bytes: u64,
    ) -> Result<Vec<crate::StreamEntryRead>, StorageError> {
        let stream = stream.to_string();
        self.call(move |conn| {
            read_stream(conn, &stream, from_offset, from_time_ms, max, max_bytes).map_err(classify)
        })
        .await
    }

    async fn apply(&self, batch: &[Change]) -> Result<(), StorageError> {
        if batch.is_empty() {
            return Ok(());
        }
        let batch = batch.to_vec();
        self.call_with_files(move |conn, files| apply_batch(conn, files, &batch, false))
            .await
    }

    async fn apply_durable(&self, batch: &[Change]) -> Result<(), StorageError> {
        if batch.is_empty() {
            return self.flush().await;
        }
        let batch = batch.to_vec();
        self.call_with_files(move |conn, files| apply_batch(conn, files, &batch, true))
            .await
    }

    async fn apply_shared(
        &self,
        batch: Arc<Vec<Change>>,
        durable: bool,
    ) -> Result<(), StorageError> {
        if batch.is_empty() && durable {
            return self.flush().await;
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.call_with_files(move |conn, files| apply_batch(conn, files, &batch, durable))
            .await
    }

    async fn delete_session(&self, client_id: &str) -> Result<bool, StorageError> {
        let client_id = client_id.to_string();
        self.call(move |conn| {
            let tx = conn
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .map_err(classify)?;
            let mut refs = Refs::default();
            let n = delete_session_rows(&tx, &client_id, &mut refs).map_err(classify)?;
            if let Err(index) = count_references(&tx, &mut refs).map_err(classify)? {
                return Err(StorageError::refused(format!(
                    "deleting the session of {client_id}: message reference {index} is not stored"
                )));
            }
            tx.commit().map_err(classify)?;
            Ok(n > 0)
        })
        .await
    }

    async fn load_access(&self) -> Result<Vec<AccessRecord>, StorageError> {
        self.call(|conn| {
            let mut stmt = conn
                .prepare_cached("SELECT kind, name, body FROM access ORDER BY kind, name")
                .map_err(classify)?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                    ))
                })
                .map_err(classify)?;
            let mut records = Vec::new();
            for row in rows {
                let (kind, name, body) = row.map_err(classify)?;
                // A kind a newer version wrote is left alone.
                if let Some(kind) = AccessKind::parse(&kind) {
                    records.push(AccessRecord { kind, name, body });
                }
            }
            records.sort_by(|a, b| (a.kind, &a.name).cmp(&(b.kind, &b.name)));
            Ok(records)
        })
        .await
    }

    async fn apply_access(&self, changes: &[AccessChange]) -> Result<(), StorageError> {
        validate_access(changes)?;
        let changes = changes.to_vec();
        self.call(move |conn| {
            conn.pragma_update(None, "synchronous", "FULL")
                .map_err(classify)?;
            let result = (|| {
                let tx = conn
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .map_err(classify)?;
                for change in &changes {
                    match change {
                        AccessChange::Put(r) => tx.execute(
                            "INSERT OR REPLACE INTO access (kind, name, body) VALUES (?1, ?2, ?3)",
                            params![r.kind.as_str(), r.name, r.body],
                        ),
                        AccessChange::Deleted { kind, name } => tx.execute(
                            "DELETE FROM access WHERE kind = ?1 AND name = ?2",
                            params![kind.as_str(), name],
                        ),
                    }
                    .map_err(classify)?;
                }
                tx.commit().map_err(classify)
            })();
            let _ = conn.pragma_update(None, "synchronous", "NORMAL");
            result
        })
        .await
    }

    async fn flush(&self) -> Result<(), StorageError> {
        // A commit with synchronous = FULL syncs the write-ahead log, and with it every
        // commit before it.
        self.call_with_files(|conn, files| {
            // And the segment files written since their last sync, first.
            if let Some(files) = files {
                files.sync_unsynced().map_err(|e| {
                    StorageError::transient(format!("cannot sync the stream segment files: {e}"))
                })?;
            }
            conn.pragma_update(None, "synchronous", "FULL")
                .map_err(classify)?;
            let result = conn
                .execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('flushed_at', \
                     strftime('%s', 'now'))",
                    [],
                )
                .map_err(classify);
            let _ = conn.pragma_update(None, "synchronous", "NORMAL");
            result.map(|_| ())
        })
        .await
    }

    async fn close(&self) -> Result<(), StorageError> {
        self.flush().await?;
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |worker: &mut Worker| {
            // Dropping the connection checkpoints the log; dropping the file releases the lock.
            worker.open = None;
            let _ = tx.send(());
        });
        if self.jobs.lock().send(job).is_ok() {
            let _ = rx.await;
        }
        Ok(())
    }
}

impl Drop for SqliteStorage {
    fn drop(&mut self) {
        // The thread ends when the sender is dropped, closing the connection and the lock.
    }
}

#[cfg(test)]
mod tests {
    use async_trait::async_trait;

    /// The schema of version 3 (before the message store), to build old databases.
    const SCHEMA_V3: &str = "
    CREATE TABLE sessions (
        client_id TEXT PRIMARY KEY NOT NULL,
        protocol_level INTEGER NOT NULL,
        session_expiry_interval INTEGER NOT NULL,
        disconnected_at INTEGER,
        will_topic TEXT,
        will_payload BLOB,
        will_qos INTEGER,
        will_retain INTEGER,
        will_properties BLOB,
        will_expires_at INTEGER,
        will_publisher TEXT,
        will_delay_interval INTEGER,
        username TEXT,
        certificate TEXT
    );
    CREATE TABLE subscriptions (
        client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
        filter TEXT NOT NULL,
        qos INTEGER NOT NULL,
        no_local INTEGER NOT NULL,
        retain_as_published INTEGER NOT NULL,
        retain_handling INTEGER NOT NULL,
        subscription_identifier INTEGER,
        PRIMARY KEY (client_id, filter)
    ) WITHOUT ROWID;
    CREATE TABLE queued (
        client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        topic TEXT NOT NULL,
        payload BLOB NOT NULL,
        qos INTEGER NOT NULL,
        retain INTEGER NOT NULL,
        properties BLOB NOT NULL,
        expires_at INTEGER,
        publisher TEXT,
        share TEXT,
        PRIMARY KEY (client_id, seq)
    ) WITHOUT ROWID;
    CREATE TABLE inflight (
        client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
        packet_id INTEGER NOT NULL,
        ord INTEGER NOT NULL,
        state TEXT NOT NULL,
        topic TEXT NOT NULL,
        payload BLOB NOT NULL,
        qos INTEGER NOT NULL,
        retain INTEGER NOT NULL,
        properties BLOB NOT NULL,
        expires_at INTEGER,
        publisher TEXT,
        share TEXT,
        PRIMARY KEY (client_id, packet_id)
    ) WITHOUT ROWID;
    CREATE TABLE inbound_qos2 (
        client_id TEXT NOT NULL REFERENCES sessions (client_id) ON DELETE CASCADE,
        packet_id INTEGER NOT NULL,
        PRIMARY KEY (client_id, packet_id)
    ) WITHOUT ROWID;
    CREATE TABLE retained (
        topic TEXT PRIMARY KEY NOT NULL,
        payload BLOB NOT NULL,
        qos INTEGER NOT NULL,
        retain INTEGER NOT NULL,
        properties BLOB NOT NULL,
        expires_at INTEGER,
        publisher TEXT,
        share TEXT
    ) WITHOUT ROWID;
    CREATE TABLE meta (
        key TEXT PRIMARY KEY NOT NULL,
        value
    ) WITHOUT ROWID;
    ";

    use super::*;
    use crate::conformance::{self, Harness};
    use crate::DeliveryRecord;

    struct SqliteHarness {
        dir: PathBuf,
        n: u32,
    }

    impl SqliteHarness {
        fn new(name: &str) -> SqliteHarness {
            let dir = std::env::temp_dir().join(format!(
                "mercurio-sqlite-{name}-{}-{:?}",
                std::process::id(),
                std::time::SystemTime::now()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            SqliteHarness { dir, n: 0 }
        }
    }

    impl Drop for SqliteHarness {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[async_trait]
    impl Harness for SqliteHarness {
        type Storage = SqliteStorage;

        async fn fresh(&mut self) -> SqliteStorage {
            self.n += 1;
            SqliteStorage::open(self.dir.join(format!("db{}.db", self.n))).unwrap()
        }

        async fn reopen(&mut self, storage: SqliteStorage) -> SqliteStorage {
            let path = storage.path().to_path_buf();
            storage.close().await.unwrap();
            drop(storage);
            SqliteStorage::open(path).unwrap()
        }

        async fn make_unreadable(&mut self, storage: &SqliteStorage, client_id: &str) -> bool {
            let conn = Connection::open(storage.path()).unwrap();
            conn.busy_timeout(Duration::from_secs(5)).unwrap();
            conn.execute(
                "UPDATE sessions SET protocol_level = 'garbage' WHERE client_id = ?1",
                [client_id],
            )
            .unwrap();
            true
        }
    }

    #[tokio::test]
    async fn sqlite_conforms() {
        conformance::run_all(&mut SqliteHarness::new("conf")).await;
    }

    #[tokio::test]
    async fn second_open_is_refused_and_close_releases() {
        let h = SqliteHarness::new("lock");
        let path = h.dir.join("m.db");
        let first = SqliteStorage::open(&path).unwrap();
        let err = SqliteStorage::open(&path).unwrap_err();
        assert!(err.is_fenced(), "{err}");
        assert!(err.to_string().contains("m.db"), "{err}");
        first.close().await.unwrap();
        let again = SqliteStorage::open(&path).unwrap();
        again.close().await.unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[tokio::test]
    async fn newer_schema_is_refused() {
        let h = SqliteHarness::new("schema");
        let path = h.dir.join("m.db");
        SqliteStorage::open(&path).unwrap().close().await.unwrap();
        Connection::open(&path)
            .unwrap()
            .execute_batch("PRAGMA user_version = 99")
            .unwrap();
        let err = SqliteStorage::open(&path).unwrap_err();
        assert!(err.is_incompatible(), "{err}");
        assert!(err.to_string().contains("99"), "{err}");
    }

    /// A database of schema `version` built with the SQL of version 3 (and, below 3, without
    /// the columns added since).
    /// A database of schema 3 brought to `version` by the upgrades' statements alone (the
    /// rows a test then adds are upgraded when the storage opens it).
    fn upgraded_database(path: &Path, version: usize) -> Connection {
        old_database(path, 3, "");
        let conn = Connection::open(path).unwrap();
        for (from, upgrade) in UPGRADES.iter().enumerate().take(version - 1).skip(2) {
            let to = from + 2;
            conn.execute_batch(&format!("{upgrade} PRAGMA user_version = {to};"))
                .unwrap();
        }
        conn
    }

    fn old_database(path: &Path, version: i64, extra: &str) {
        let conn = Connection::open(path).unwrap();
        let downgrade = if version < 3 {
            "ALTER TABLE sessions DROP COLUMN username; \
             ALTER TABLE sessions DROP COLUMN certificate; ALTER TABLE queued DROP COLUMN share; \
             ALTER TABLE inflight DROP COLUMN share; ALTER TABLE retained DROP COLUMN share;"
        } else {
            ""
        };
        conn.execute_batch(&format!(
            "{SCHEMA_V3} {extra} {downgrade} PRAGMA user_version = {version};"
        ))
        .unwrap();
    }

    #[tokio::test]
    async fn version_1_database_is_upgraded() {
        let h = SqliteHarness::new("upgrade");
        let path = h.dir.join("m.db");
        old_database(&path, 1, "");
        let storage = SqliteStorage::open(&path).unwrap();
        let header = crate::SessionHeader {
            client_id: "up".into(),
            protocol_level: 5,
            session_expiry_interval: 10,
            disconnected_at: None,
            username: Some("alice".into()),
            certificate: Some("alice-device".into()),
        };
        storage
            .apply(&[Change::SessionSaved(header)])
            .await
            .unwrap();
        let loaded = storage.load().await.unwrap();
        assert_eq!(loaded.sessions[0].username.as_deref(), Some("alice"));
        assert_eq!(
            loaded.sessions[0].certificate.as_deref(),
            Some("alice-device")
        );
        storage.close().await.unwrap();
        let version: i64 = Connection::open(&path)
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }

    /// A retained message of schema 9 and before has no publisher's user name or listener;
    /// once upgraded to 10, both are kept.
    #[tokio::test]
    async fn version_9_retained_gains_its_publisher_identity() {
        let h = SqliteHarness::new("upgrade9");
        let path = h.dir.join("m.db");
        old_database(
            &path,
            3,
            "INSERT INTO retained (topic, payload, qos, retain, properties, expires_at, \
             publisher, share) VALUES ('r/t', X'07', 1, 1, X'', NULL, 'pub', NULL);",
        );
        let storage = SqliteStorage::open(&path).unwrap();
        let loaded = storage.load().await.unwrap();
        assert_eq!(loaded.retained.len(), 1);
        assert_eq!(loaded.retained[0].publisher(), Some("pub"));
        assert_eq!(loaded.retained[0].publisher_username, None);
        assert_eq!(loaded.retained[0].publisher_listener, None);
        let mut again = loaded.retained[0].clone();
        again.publisher_username = Some("alice".into());
        again.publisher_listener = Some(1884);
        storage
            .apply(&[Change::RetainedSet(again.clone())])
            .await
            .unwrap();
        assert_eq!(storage.load().await.unwrap().retained, [again]);
        storage.close().await.unwrap();
    }

    /// Schema 10's segments (format version 1) are read after the upgrades, counted at
    /// start, trimmed, and rewritten in version 2 when an entry is removed from one.
    #[tokio::test]
    async fn version_10_segments_are_still_read() {
        let h = SqliteHarness::new("upgrade10");
        let path = h.dir.join("m.db");
        use crate::{MessageRecord, StreamEntryRecord};
        let mut first = MessageRecord::new("t/a", &b"\x01\x02"[..], 1);
        first.publisher = Some("p".into());
        first.expires_at = Some(1_700_000_000_000);
        let mut second = MessageRecord::new("t/b", &b"\x03"[..], 2);
        second.retain = true;
        second.properties = bytes::Bytes::from_static(&[0x0B, 0x01]);
        let entry = |offset| StreamEntryRecord {
            offset,
            time_ms: 1_000 + offset,
            message_id: offset,
        };
        let v1 = segment::tests::encode_v1(&[
            (entry(1), segment::Body::Inline(&first)),
            (entry(2), segment::Body::Inline(&second)),
            (entry(3), segment::Body::Inline(&first)),
        ]);
        let conn = upgraded_database(&path, 10);
        conn.execute(
            "INSERT INTO streams (name, next_offset, filter, max_age, max_bytes, last_value) \
             VALUES ('s', 4, NULL, NULL, NULL, NULL)",
            [],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO stream_segments (stream, first_offset, last_offset, entries, bytes, \
             refs, min_id, max_id, body) VALUES ('s', 1, 3, 3, 16, 0, 1, 3, ?1)",
            [&v1],
        )
        .unwrap();
        drop(conn);
        let storage = SqliteStorage::open(&path).unwrap();
        let state = storage.load().await.unwrap();
        let s = &state.streams[0];
        assert_eq!(
            (
                s.next_offset,
                s.first_offset,
                s.first_time_ms,
                s.messages,
                s.bytes
            ),
            (4, 1, 1_001, 3, 16)
        );
        async fn entries(storage: &SqliteStorage) -> Vec<(StreamEntryRecord, MessageRecord)> {
            let read = storage.read_stream("s", 0, 0, 10, u64::MAX).await.unwrap();
            read.into_iter().map(|r| (r.entry, r.message)).collect()
        }
        assert_eq!(
            entries(&storage).await,
            [
                (entry(1), first.clone()),
                (entry(2), second.clone()),
                (entry(3), first.clone())
            ]
        );
        let read = storage.read_stream("s", 2, 0, 1, u64::MAX).await.unwrap();
        assert_eq!(read[0].message, second);
        let stream = || "s".to_string();
        let removed = Change::StreamEntryRemoved {
            stream: stream(),
            offset: 2,
        };
        storage.apply(&[removed]).await.unwrap();
        assert_eq!(
            entries(&storage).await,
            [(entry(1), first.clone()), (entry(3), first.clone())]
        );
        let trimmed = Change::StreamTrimmed {
            stream: stream(),
            below: 3,
        };
        storage.apply(&[trimmed]).await.unwrap();
        assert_eq!(entries(&storage).await, [(entry(3), first)]);
        storage.close().await.unwrap();
        let conn = Connection::open(&path).unwrap();
        let (version, format): (i64, Vec<u8>) = conn
            .query_row(
                "SELECT (SELECT user_version FROM pragma_user_version), substr(body, 1, 1) \
                 FROM stream_segments",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((version, format), (SCHEMA_VERSION, vec![2]), "rewritten");
        drop(conn);
        let storage = SqliteStorage::open(&path).unwrap();
        let state = storage.load().await.unwrap();
        let s = &state.streams[0];
        assert_eq!((s.first_offset, s.messages, s.bytes), (3, 1, 5));
        storage.close().await.unwrap();
    }

    /// Schema 10's segments keep their bodies in their rows; the upgrade to 12 adds where
    /// a body in a file is, and new segments go to the stream's file.
    #[tokio::test]
    async fn version_10_segments_keep_their_bodies() {
        let h = SqliteHarness::new("upgrade10");
        let path = h.dir.join("m.db");
        let conn = upgraded_database(&path, 10);
        let old = pieces(1..=3, 5);
        let bodies: Vec<_> = old
            .iter()
            .map(|a| (a.entry, segment::Body::Inline(&a.message)))
            .collect();
        conn.execute(
            "INSERT INTO streams (name, next_offset) VALUES ('s', 4)",
            [],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO stream_segments (stream, first_offset, last_offset, entries, bytes, \
             refs, min_id, max_id, body) VALUES ('s', 1, 3, 3, 0, 0, 1001, 1003, ?1)",
            [segment::tests::encode_v1(&bodies)],
        )
        .unwrap();
        conn.execute_batch("PRAGMA user_version = 10;").unwrap();
        drop(conn);
        let storage = SqliteStorage::open(&path).unwrap();
        storage.load().await.unwrap();
        append(&storage, "s", 4..=5, 5).await;
        assert_eq!(read_offsets(&storage, "s").await, [1, 2, 3, 4, 5]);
        storage.close().await.unwrap();
        drop(storage);
        let conn = Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        let places: Vec<(i64, Option<i64>, i64)> = conn
            .prepare("SELECT first_offset, file, length(body) FROM stream_segments ORDER BY 1")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        assert!(places[0].1.is_none() && places[0].2 > 0, "{places:?}");
        assert_eq!((places[1].0, places[1].1, places[1].2), (4, Some(0), 0));
        assert!(segment_file(&path, "s", 0).is_file());
    }

    /// Entries at `offsets`, each with a payload of `len` bytes (the offset's
    /// digits repeated) stored under id `1000 + offset`.
    fn pieces(offsets: std::ops::RangeInclusive<u64>, len: usize) -> Vec<crate::StreamAppend> {
        offsets
            .map(|offset| crate::StreamAppend {
                entry: crate::StreamEntryRecord {
                    offset,
                    time_ms: 1_000 + offset,
                    message_id: 1_000 + offset,
                },
                message: crate::MessageRecord::new("seg/t", payload_of(offset, len), 1),
            })
            .collect()
    }

    fn payload_of(offset: u64, len: usize) -> Vec<u8> {
        offset.to_string().bytes().cycle().take(len).collect()
    }

    /// Appends the entries at `offsets` of `stream` ([`pieces`]) in one batch.
    async fn append(
        storage: &SqliteStorage,
        stream: &str,
        offsets: std::ops::RangeInclusive<u64>,
        len: usize,
    ) {
        storage
            .apply(&[Change::StreamSegment {
                stream: stream.into(),
                entries: pieces(offsets, len),
            }])
            .await
            .unwrap();
    }

    /// The offsets read back from `stream`, each payload checked.
    async fn read_offsets(storage: &SqliteStorage, stream: &str) -> Vec<u64> {
        let read = storage
            .read_stream(stream, 0, 0, 100_000, u64::MAX)
            .await
            .unwrap();
        for r in &read {
            let len = r.message.payload.len();
            assert_eq!(r.message.payload, payload_of(r.entry.offset, len));
        }
        read.iter().map(|r| r.entry.offset).collect()
    }

    /// Segment file `n` of `stream` of the database at `db`.
    fn segment_file(db: &Path, stream: &str, n: u64) -> PathBuf {
        PathBuf::from(format!("{}-streams", db.display()))
            .join(format!("s-{stream}"))
            .join(format!("{n}.seg"))
    }

    /// The nice value of the thread `task` of this process (field 19 of its `stat`).
    #[cfg(target_os = "linux")]
    fn nice_of(task: &str) -> i32 {
        let stat = std::fs::read_to_string(format!("/proc/self/task/{task}/stat")).unwrap();
        // After the command name in parentheses: state is field 3, nice field 19.
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.split(' ').nth(16).unwrap().parse().unwrap()
    }

    /// In the background, the SQLite thread runs THREAD_NICE below the thread that opened
    /// the storage; opened plainly, at its priority.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn the_sqlite_thread_runs_behind_the_event_loops() {
        let h = SqliteHarness::new("nice");
        let mine = nice_of(&unsafe { libc::gettid() }.to_string());
        let on_its_thread = || Ok(nice_of(&unsafe { libc::gettid() }.to_string()));
        let storage = SqliteStorage::open_in_background(h.dir.join("b.db")).unwrap();
        let behind = storage.call(move |_| on_its_thread()).await.unwrap();
        assert_eq!(behind, (mine + THREAD_NICE).min(19), "in the background");
        storage.close().await.unwrap();
        let storage = SqliteStorage::open(h.dir.join("p.db")).unwrap();
        let plain = storage.call(move |_| on_its_thread()).await.unwrap();
        assert_eq!(plain, mine, "opened plainly");
        storage.close().await.unwrap();
    }

    /// Bytes after the last segment a row refers to (a SIGKILL between a batch's write and
    /// its commit) are cut when the database is opened, and the next segment goes there.
    #[tokio::test]
    async fn torn_tail_is_cut_when_reopened() {
        let h = SqliteHarness::new("torn");
        let path = h.dir.join("m.db");
        let storage = SqliteStorage::open(&path).unwrap();
        for range in [1..=10, 11..=20] {
            append(&storage, "s", range, 300).await;
        }
        storage.close().await.unwrap();
        drop(storage);
        let file = segment_file(&path, "s", 0);
        let len = std::fs::metadata(&file).unwrap().len();
        assert!(len > 20 * 300, "{len}");
        {
            use std::io::Write;
            let mut f = OpenOptions::new().append(true).open(&file).unwrap();
            f.write_all(&[0xAB; 1000]).unwrap();
        }
        let storage = SqliteStorage::open(&path).unwrap();
        assert_eq!(
            std::fs::metadata(&file).unwrap().len(),
            len,
            "cut to its end"
        );
        let state = storage.load().await.unwrap();
        assert_eq!(state.streams[0].messages, 20);
        assert_eq!(
            read_offsets(&storage, "s").await,
            (1..=20).collect::<Vec<_>>()
        );
        append(&storage, "s", 21..=30, 300).await;
        assert_eq!(
            read_offsets(&storage, "s").await,
            (1..=30).collect::<Vec<_>>()
        );
        let storage = {
            storage.close().await.unwrap();
            drop(storage);
            SqliteStorage::open(&path).unwrap()
        };
        assert_eq!(
            read_offsets(&storage, "s").await,
            (1..=30).collect::<Vec<_>>()
        );
    }

    /// Retention unlinks the files no row refers to any more, a deleted stream's directory
    /// goes, and names that are special in paths (`.`, `..`) stay inside the directory of
    /// segment files. A `last_value` stream keeps its segments in its rows.
    #[tokio::test]
    async fn trimmed_files_and_deleted_streams_are_removed() {
        let h = SqliteHarness::new("trimfiles");
        let path = h.dir.join("m.db");
        let storage = SqliteStorage::open(&path).unwrap();
        // 12 batches of 10 entries of 64 KiB: 7.5 MiB, so files 0 and 1.
        for stream in [".", ".."] {
            for b in 0..12u64 {
                append(&storage, stream, b * 10 + 1..=b * 10 + 10, 64 << 10).await;
            }
        }
        for stream in [".", ".."] {
            assert!(segment_file(&path, stream, 0).is_file());
            assert!(segment_file(&path, stream, 1).is_file());
            assert!(!segment_file(&path, stream, 2).exists());
        }
        // File 0 holds the first 7 batches (4.375 MiB), so below 71 it is not needed.
        storage
            .apply(&[Change::StreamTrimmed {
                stream: ".".into(),
                below: 71,
            }])
            .await
            .unwrap();
        assert!(
            !segment_file(&path, ".", 0).exists(),
            "trimmed file unlinked"
        );
        assert!(segment_file(&path, ".", 1).is_file());
        assert_eq!(
            read_offsets(&storage, ".").await,
            (71..=120).collect::<Vec<_>>()
        );
        storage
            .apply(&[Change::StreamDeleted { stream: ".".into() }])
            .await
            .unwrap();
        assert!(!segment_file(&path, ".", 1).parent().unwrap().exists());
        assert_eq!(
            read_offsets(&storage, "..").await,
            (1..=120).collect::<Vec<_>>()
        );
        // A last_value stream's segments stay in its rows.
        storage
            .apply(&[
                Change::StreamDefined {
                    stream: "lv".into(),
                    definition: crate::StreamDefinition {
                        filter: "lv/#".into(),
                        max_age: 0,
                        max_bytes: 0,
                        last_value: true,
                    },
                },
                Change::StreamSegment {
                    stream: "lv".into(),
                    entries: pieces(1..=3, 10),
                },
            ])
            .await
            .unwrap();
        assert_eq!(read_offsets(&storage, "lv").await, [1, 2, 3]);
        assert!(!segment_file(&path, "lv", 0).parent().unwrap().exists());
        storage.close().await.unwrap();
        drop(storage);
        let storage = SqliteStorage::open(&path).unwrap();
        assert_eq!(
            read_offsets(&storage, "..").await,
            (1..=120).collect::<Vec<_>>()
        );
        assert!(h.dir.join("m.db-streams").join("s-..").is_dir());
        assert!(h.dir.join("m.db").is_file(), "nothing outside was touched");
    }

    /// A batch refused after its segment was written to the file leaves the file's end
    /// where it was: the next batch writes over those bytes, and nothing refers to them.
    #[tokio::test]
    async fn a_refused_batch_is_overwritten_by_the_next() {
        let h = SqliteHarness::new("refusedfile");
        let path = h.dir.join("m.db");
        let storage = SqliteStorage::open(&path).unwrap();
        let missing = Change::StreamAppended {
            stream: "s".into(),
            entry: crate::StreamEntryRecord {
                offset: 6,
                time_ms: 1,
                message_id: 999,
            },
        };
        let segment = Change::StreamSegment {
            stream: "s".into(),
            entries: pieces(1..=5, 100),
        };
        // The entry at 6 refers to a message that is not stored: refused at the end of the
        // batch, after the segment of 1 to 6 went to the file.
        let e = storage
            .apply(&[segment.clone(), missing])
            .await
            .unwrap_err();
        assert!(e.is_refused(), "{e}");
        let file = segment_file(&path, "s", 0);
        let written = std::fs::metadata(&file).unwrap().len();
        assert!(written > 500, "{written}");
        storage.apply(&[segment]).await.unwrap();
        append(&storage, "s", 6..=7, 100).await;
        assert_eq!(read_offsets(&storage, "s").await, [1, 2, 3, 4, 5, 6, 7]);
        storage.close().await.unwrap();
        drop(storage);
        let places: Vec<(i64, i64)> = Connection::open(&path)
            .unwrap()
            .prepare("SELECT position, length FROM stream_segments ORDER BY first_offset")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(places.len(), 2);
        assert_eq!(places[0].0, 0, "written again from the start");
        assert_eq!(places[1].0, places[0].1, "then after it");
        let storage = SqliteStorage::open(&path).unwrap();
        let end = u64::try_from(places[1].0 + places[1].1).unwrap();
        assert_eq!(std::fs::metadata(&file).unwrap().len(), end);
        assert_eq!(read_offsets(&storage, "s").await, [1, 2, 3, 4, 5, 6, 7]);
    }

    /// Segments whose bytes are not all in their file (a power failure before the file was
    /// synced, a copy taken while retention deleted a file) are dropped when the database is
    /// opened, logged as lost; the rest of the stream reads, and appends go on.
    #[tokio::test]
    async fn segments_beyond_a_short_or_missing_file_are_dropped() {
        let h = SqliteHarness::new("missingfile");
        let path = h.dir.join("m.db");
        let storage = SqliteStorage::open(&path).unwrap();
        append(&storage, "gone", 1..=5, 100).await;
        append(&storage, "gone", 6..=10, 100).await;
        storage.close().await.unwrap();
        drop(storage);
        let file = segment_file(&path, "gone", 0);
        let len = std::fs::metadata(&file).unwrap().len();
        OpenOptions::new()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(len - 10)
            .unwrap();
        // The second segment's bytes are not all there: it goes, the first stays.
        let storage = SqliteStorage::open(&path).unwrap();
        assert_eq!(
            read_offsets(&storage, "gone").await,
            (1..=5).collect::<Vec<_>>()
        );
        let state = storage.load().await.unwrap();
        assert_eq!(state.streams[0].messages, 5, "counted from what is left");
        // Appends go on after what is left, at the stream's next offset.
        append(&storage, "gone", 11..=12, 100).await;
        assert_eq!(
            read_offsets(&storage, "gone").await,
            [1, 2, 3, 4, 5, 11, 12]
        );
        storage.close().await.unwrap();
        drop(storage);
        std::fs::remove_file(&file).unwrap();
        let storage = SqliteStorage::open(&path).unwrap();
        assert!(
            read_offsets(&storage, "gone").await.is_empty(),
            "the file is gone"
        );
        append(&storage, "gone", 13..=13, 100).await;
        assert_eq!(read_offsets(&storage, "gone").await, [13]);
        storage.close().await.unwrap();
    }

    /// Schema 8's releases of inline messages, one row each, become runs of one; a batch
    /// writes runs of consecutive ids.
    #[tokio::test]
    async fn version_8_releases_become_runs() {
        assert_eq!(runs(&[3, 4, 5, 9, 11, 12]), [(3, 5), (9, 9), (11, 12)]);
        let h = SqliteHarness::new("upgrade8");
        let path = h.dir.join("m.db");
        old_database(&path, 3, "");
        let conn = Connection::open(&path).unwrap();
        for (from, upgrade) in UPGRADES.iter().enumerate().take(7).skip(2) {
            let to = from + 2;
            conn.execute_batch(&format!("{upgrade} PRAGMA user_version = {to};"))
                .unwrap();
        }
        conn.execute_batch("INSERT INTO inline_released (id) VALUES (4), (5), (9);")
            .unwrap();
        drop(conn);
        SqliteStorage::open(&path).unwrap().close().await.unwrap();
        let conn = Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let mut stmt = conn
            .prepare("SELECT first_id, last_id FROM inline_released_runs ORDER BY first_id")
            .unwrap();
        let rows: Vec<(i64, i64)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        assert_eq!(rows, [(4, 4), (5, 5), (9, 9)]);
    }

    /// The stream entries of schema 7 (a row each, referring to the message store) become
    /// segments: a message only streams refer to moves into its segment, one an in-flight
    /// message also refers to stays in the store, and the streams read back and count as
    /// before.
    #[tokio::test]
    async fn version_7_stream_entries_become_segments() {
        let h = SqliteHarness::new("upgrade7");
        let path = h.dir.join("m.db");
        let conn = upgraded_database(&path, 7);
        conn.execute_batch(
            "INSERT INTO sessions (client_id, protocol_level, session_expiry_interval) \
             VALUES ('c', 5, 3600); \
             INSERT INTO messages (id, topic, payload, qos, retain, properties, expires_at, \
             publisher, released, refs) VALUES \
             (1, 't/a', X'01', 1, 0, X'', NULL, 'p', 1, 1), \
             (2, 't/b', X'0203', 2, 0, X'0B01', 1700000000000, NULL, 0, 2), \
             (3, 't/a', X'04', 0, 1, X'', NULL, 'p', 1, 1); \
             INSERT INTO inflight (client_id, packet_id, ord, state, message_id, qos, retain, \
             subscription_ids, share) VALUES ('c', 5, 1, 'awaiting_puback', 2, 1, 0, X'', NULL); \
             INSERT INTO streams (name, next_offset, filter, max_age, max_bytes, last_value) \
             VALUES ('s', 4, NULL, NULL, NULL, NULL); \
             INSERT INTO stream_entries (stream, entry_offset, time_ms, message_id) VALUES \
             ('s', 1, 1001, 1), ('s', 2, 1002, 2), ('s', 3, 1003, 3); \
             PRAGMA user_version = 7;",
        )
        .unwrap();
        drop(conn);
        let storage = SqliteStorage::open(&path).unwrap();
        let state = storage.load().await.unwrap();
        let s = &state.streams[0];
        assert_eq!(
            (
                s.name.as_str(),
                s.next_offset,
                s.first_offset,
                s.first_time_ms
            ),
            ("s", 4, 1, 1001)
        );
        assert_eq!(
            (s.messages, s.bytes),
            (3, 4 + 7 + 4),
            "topic, payload, properties"
        );
        assert_eq!(state.max_message_id, 3);
        assert_eq!(state.messages.len(), 1, "the in-flight message only");
        assert_eq!(state.messages[0].id, 2);
        let read = storage.read_stream("s", 0, 0, 10, u64::MAX).await.unwrap();
        let seen: Vec<_> = read
            .iter()
            .map(|r| {
                (
                    r.entry.offset,
                    r.entry.time_ms,
                    r.entry.message_id,
                    r.message.topic.as_str(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (1, 1001, 1, "t/a"),
                (2, 1002, 2, "t/b"),
                (3, 1003, 3, "t/a")
            ]
        );
        let m = &read[1].message;
        assert_eq!(
            (&m.payload[..], &m.properties[..], m.qos),
            (&[2, 3][..], &[0x0B, 0x01][..], 2)
        );
        assert_eq!(m.expires_at, Some(1_700_000_000_000));
        let m = &read[2].message;
        assert_eq!(
            (m.qos, m.retain, m.publisher.as_deref()),
            (0, true, Some("p"))
        );
        // Trimmed below 3: the in-flight message stays, the stream starts at 3.
        storage
            .apply(&[Change::StreamTrimmed {
                stream: "s".into(),
                below: 3,
            }])
            .await
            .unwrap();
        let read = storage.read_stream("s", 0, 0, 10, u64::MAX).await.unwrap();
        assert_eq!(read.iter().map(|r| r.entry.offset).collect::<Vec<_>>(), [3]);
        let state = storage.load().await.unwrap();
        assert_eq!(state.sessions[0].inflight[0].delivery.message_id, 2);
        assert_eq!(state.messages[0].message.topic, "t/b");
        assert_eq!(
            (state.streams[0].first_offset, state.streams[0].messages),
            (3, 1)
        );
        storage.close().await.unwrap();
        let conn = Connection::open(&path).unwrap();
        let ids: Vec<i64> = conn
            .prepare("SELECT id FROM messages ORDER BY id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            ids,
            [2],
            "messages only the stream referred to are in its segment"
        );
        let tables: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE name = 'stream_entries'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(tables, 0);
    }

    /// A stored queue and in-flight list of schema 3 (one copy of the message per row) come
    /// back after the upgrade to the message store: each row one message and one reference.
    #[tokio::test]
    async fn version_3_queues_survive_the_upgrade() {
        let h = SqliteHarness::new("upgrade3");
        let path = h.dir.join("m.db");
        old_database(
            &path,
            3,
            "INSERT INTO sessions (client_id, protocol_level, session_expiry_interval) \
             VALUES ('a', 5, 3600), ('b', 4, 60); \
             INSERT INTO queued (client_id, seq, topic, payload, qos, retain, properties, \
             expires_at, publisher, share) VALUES \
             ('a', 1, 't/1', X'01', 1, 0, X'', NULL, 'pub', NULL), \
             ('a', 2, 't/2', X'0203', 2, 1, X'0B01', 1700000000000, NULL, '$share/g/t/#'), \
             ('b', 7, 't/1', X'01', 1, 0, X'', NULL, 'pub', NULL); \
             INSERT INTO inflight (client_id, packet_id, ord, state, topic, payload, qos, \
             retain, properties, expires_at, publisher, share) VALUES \
             ('a', 9, 1, 'awaiting_pubrec', 't/i', X'FF', 2, 0, X'', NULL, 'pub', NULL);",
        );
        let storage = SqliteStorage::open(&path).unwrap();
        let state = storage.load().await.unwrap();
        assert!(state.set_aside.is_empty(), "{:?}", state.set_aside);
        assert_eq!(state.sessions.len(), 2);
        assert_eq!(state.messages.len(), 4, "one message per old row");
        let message = |id: u64| {
            &state
                .messages
                .iter()
                .find(|m| m.id == id)
                .expect("referred message loaded")
                .message
        };
        let a = &state.sessions[0];
        assert_eq!(a.queued.iter().map(|q| q.seq).collect::<Vec<_>>(), [1, 2]);
        let second = &a.queued[1].delivery;
        assert_eq!((second.qos, second.retain), (2, true));
        assert_eq!(second.share.as_deref(), Some("$share/g/t/#"));
        let m = message(second.message_id);
        assert_eq!(m.topic, "t/2");
        assert_eq!(&m.payload[..], [2, 3]);
        assert_eq!(&m.properties[..], [0x0B, 0x01]);
        assert_eq!(m.expires_at, Some(1_700_000_000_000));
        assert_eq!(
            message(a.queued[0].delivery.message_id)
                .publisher
                .as_deref(),
            Some("pub")
        );
        assert_eq!(a.inflight.len(), 1);
        assert_eq!(a.inflight[0].packet_id, 9);
        assert_eq!(a.inflight[0].state, crate::InflightState::AwaitingPubRec);
        assert_eq!(message(a.inflight[0].delivery.message_id).topic, "t/i");
        assert_eq!(state.sessions[1].queued[0].seq, 7);
        // The upgraded store takes new messages after the old ones.
        let next = state.messages.iter().map(|m| m.id).max().unwrap() + 1;
        storage
            .apply(&[
                Change::MessageStored {
                    message: crate::StoredMessage {
                        id: next,
                        message: crate::MessageRecord::new("t/new", "n", 1),
                    },
                },
                Change::MessageQueued {
                    client_id: "b".into(),
                    seq: 8,
                    delivery: DeliveryRecord::new(next, 1),
                },
            ])
            .await
            .unwrap();
        assert_eq!(storage.load().await.unwrap().messages.len(), 5);
        storage.close().await.unwrap();
    }

    #[tokio::test]
    async fn busy_database_is_transient() {
        let h = SqliteHarness::new("busy");
        let path = h.dir.join("m.db");
        let storage = SqliteStorage::open(&path).unwrap();
        let other = Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let header = crate::SessionHeader {
            client_id: "a".into(),
            protocol_level: 5,
            session_expiry_interval: 10,
            disconnected_at: None,
            username: None,
            certificate: None,
        };
        let err = storage
            .apply(&[Change::SessionSaved(header.clone())])
            .await
            .unwrap_err();
        assert!(err.is_transient(), "{err}");
        other.execute_batch("COMMIT").unwrap();
        storage
            .apply(&[Change::SessionSaved(header)])
            .await
            .unwrap();
        assert_eq!(storage.load().await.unwrap().sessions.len(), 1);
    }

    /// A queue chunk that is not a JSON array sets its session aside when queues are left in
    /// storage, as a full load does; one that is an array of unreadable deliveries is found
    /// when the queue is read, and refused.
    #[tokio::test]
    async fn damaged_queue_left_in_storage() {
        let h = SqliteHarness::new("lazy-damaged");
        let path = h.dir.join("m.db");
        let storage = SqliteStorage::open(&path).unwrap();
        let header = |client_id: &str| crate::SessionHeader {
            client_id: client_id.into(),
            protocol_level: 5,
            session_expiry_interval: 10,
            disconnected_at: Some(1),
            username: None,
            certificate: None,
        };
        let mut batch = vec![
            Change::MessageStored {
                message: crate::StoredMessage {
                    id: 1,
                    message: crate::MessageRecord::new("t", "m", 1),
                },
            },
            Change::SessionSaved(header("bad")),
            Change::SessionSaved(header("odd")),
        ];
        for client_id in ["bad", "odd"] {
            batch.push(Change::MessageQueued {
                client_id: client_id.into(),
                seq: 1,
                delivery: DeliveryRecord::new(1, 1),
            });
        }
        storage.apply(&batch).await.unwrap();
        storage.close().await.unwrap();
        drop(storage);
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(
            "UPDATE queue_chunks SET entries = 'garbage' WHERE client_id = 'bad'; \
             UPDATE queue_chunks SET entries = '[[1, \"x\"]]' WHERE client_id = 'odd';",
        )
        .unwrap();
        drop(conn);
        let storage = SqliteStorage::open(&path).unwrap();
        let state = storage.load_without_queues().await.unwrap();
        assert_eq!(
            state
                .set_aside
                .iter()
                .map(|s| s.client_id.as_str())
                .collect::<Vec<_>>(),
            ["bad"]
        );
        assert_eq!(state.sessions.len(), 1);
        assert_eq!(state.backlogs.get("odd").map(|b| b.len), Some(1));
        let err = storage.load_queue("odd").await.unwrap_err();
        assert!(err.is_refused(), "{err}");
        storage.close().await.unwrap();
    }
}
