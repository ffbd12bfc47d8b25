//! One session taken out of the database of another broker that is gone: a cluster node that
//! crashed (docs/cluster.md, "A crashed node's sessions").
//!
//! - The taker fences the database as a standby would ([`leader`]): it takes the leadership
//!   lock (ending the holder's connections first when its heartbeat is older than the
//!   threshold given), increments the epoch and records the takeover. From then on every
//!   write of the broker that served it is refused ([`ErrorKind::Fenced`]) and it stops.
//! - It reads the session's records and the messages they refer to, and keeps the lock
//!   ([`PeerSession`]) until [`PeerSession::finish`] deletes them (once the taker's own
//!   storage holds the session) and releases it. Dropped instead, the lock goes with its
//!   connection and the records stay.
//!
//! - It reads how long ago the broker it took the database from last wrote its heartbeat
//!   ([`PeerSession::silent_for`]): when that broker's connections ended, for its wills
//!   ([`will_wait`]).
//! - [`sweep_wills`] fences the database the same way, clears every will due there
//!   (committed) and releases the lock at once: the sweeper publishes them, the wills of
//!   sessions whose clients do not come back.
//!
//! The lock serialises the takers and sweepers of one database: a second one waits for the
//! first's [`PeerSession::finish`] (or sweep), at most the wait it was given.

use std::time::Duration;

use tokio_postgres::Client;

use super::leader::{self, LOCK_CLASS, LOCK_OBJECT};
use super::plan::{write_batch, WriteError};
use super::{check_version, classify, migrate, open_writer, parse_config, schema_version};
use super::{load, WriteConnection};
use crate::change::Change;
use crate::error::{ErrorKind, StorageError};
use crate::{SessionRecord, StoredMessage, NEVER_EXPIRES};

/// A session read from another broker's database, its database fenced and its lock held
/// until [`PeerSession::finish`] deletes the session there.
pub struct PeerSession {
    client_id: String,
    epoch: i64,
    silent_for: Option<Duration>,
    lock: Client,
    writer: WriteConnection,
}

impl std::fmt::Debug for PeerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSession")
            .field("client_id", &self.client_id)
            .field("epoch", &self.epoch)
            .field("silent_for", &self.silent_for)
            .finish()
    }
}

/// How a taker's host starts in `mercurio_takeovers` (`cluster node {node_name}`): the
/// takeovers of the takers are told from the serving brokers' by it.
pub const TAKER_HOST_PREFIX: &str = "cluster node ";

/// What [`take_session`] found: the session's records, as that broker's storage held them,
/// the messages its queue and in-flight list refer to (by the ids of the records), and the
/// hold on the database.
pub type Taken = (SessionRecord, Vec<StoredMessage>, PeerSession);

/// Takes the session of `client_id` from the database at `url`, served by another broker
/// that is gone: fences the database (see the [module documentation](self)), then reads the
/// session. `host` is recorded as the taker's in the takeover: [`TAKER_HOST_PREFIX`] and
/// the taker's node name. A broker still holding the
/// lock is ended when its heartbeat is older than `stale_after`; else the lock is waited
/// for, `wait` at most.
///
/// Returns `Ok(None)` when the database holds no such session (its lock released at once),
/// else the session ([`Taken`]), its database fenced and locked until
/// [`PeerSession::finish`].
///
/// Errors: [`ErrorKind::Fenced`] when the lock is still held after `wait` (the message
/// names the serving host); `Incompatible` for a newer schema; `Refused` when the session's
/// rows cannot be read; `Transient` when the database cannot be reached.
pub async fn take_session(
    url: &str,
    client_id: &str,
    host: &str,
    wait: Duration,
    stale_after: Duration,
) -> Result<Option<Taken>, StorageError> {
    let Some(fenced) = fence(url, host, wait, stale_after).await? else {
        return Ok(None);
    };
    let found = load::load_session(&fenced.writer.client, client_id)
        .await
        .map_err(|e| classify(e, "cannot read the session"))?
        .map_err(|cause| StorageError::refused(format!("the session of {client_id}: {cause}")))?;
    let Some((record, messages)) = found else {
        unlock(&fenced.lock).await;
        return Ok(None);
    };
    let hold = PeerSession {
        client_id: client_id.to_string(),
        epoch: fenced.epoch,
        silent_for: fenced.silent_for,
        lock: fenced.lock,
        writer: fenced.writer,
    };
    Ok(Some((record, messages, hold)))
}

/// A database fenced by a taker or sweeper, its lock held.
struct Fenced {
    epoch: i64,
    silent_for: Option<Duration>,
    lock: Client,
    writer: WriteConnection,
}

/// Fences the database at `url` for `host` (see [`take_session`]); `None` when it never
/// served (nothing in it).
async fn fence(
    url: &str,
    host: &str,
    wait: Duration,
    stale_after: Duration,
) -> Result<Option<Fenced>, StorageError> {
    let config = parse_config(url)?;
    let mut lock = leader::dedicated(&config).await?;
    let Some(version) = schema_version(&lock).await? else {
        return Ok(None);
    };
    check_version(Some(version))?;
    acquire(&lock, wait, stale_after).await?;
    migrate(&mut lock).await?;
    let opened = open_writer(&config).await?;
    let lock_pid = leader::backend_pid(&lock).await?;
    let epoch = leader::take_over(&mut lock, host, &[lock_pid, opened.pid]).await?;
    let silent_for = last_served(&lock).await?;
    Ok(Some(Fenced {
        epoch,
        silent_for,
        lock,
        writer: opened.writer,
    }))
}

/// How long from `now_ms` (unix milliseconds) until the will of `record`, a session of a
/// database whose broker is gone, is due: its Will Delay Interval, or its session's expiry
/// if sooner (MQTT 5.0 section 3.1.3.2.2), counted from the end of its connection: its
/// `disconnected_at`, or for a connection open when its broker stopped, that broker's last
/// heartbeat, `silent_for` before `now_ms` (`now_ms` itself when unknown). Zero: due now
/// (a 3.1.1 will is due at once). `None`: the session has no will.
pub fn will_wait(
    record: &SessionRecord,
    silent_for: Option<Duration>,
    now_ms: u64,
) -> Option<Duration> {
    let will = record.will.as_ref()?;
    let silent_ms = silent_for.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let ended = record
        .disconnected_at
        .unwrap_or_else(|| now_ms.saturating_sub(silent_ms));
    let mut wait = u64::from(will.delay_interval) * 1000;
    if record.session_expiry_interval != NEVER_EXPIRES {
        wait = wait.min(u64::from(record.session_expiry_interval) * 1000);
    }
    Some(Duration::from_millis(
        ended.saturating_add(wait).saturating_sub(now_ms),
    ))
}

/// What [`sweep_wills`] did.
#[derive(Debug, Default)]
pub struct SweptWills {
    /// The sessions whose will was due, each with its will (its other collections empty):
    /// cleared in the database (committed), for the sweeper to publish.
    pub due: Vec<SessionRecord>,
    /// How long until the first will left there is due; `None` when none is left.
    pub next: Option<Duration>,
    /// Sessions whose row cannot be read (client identifier, why): left as they are.
    pub unreadable: Vec<(String, String)>,
}

/// Sweeps the database at `url`, served by another broker that is gone, for the wills of its
/// sessions that are due ([`will_wait`]): fences it as [`take_session`] does (`host`,
/// `wait`, `stale_after` alike), clears those wills in one commit, and releases the lock.
/// A will is cleared before its publication, so a sweeper that stops in between loses it
/// rather than publishing it twice.
///
/// Errors: as [`take_session`]'s, and `Fenced` when another broker took the database over
/// while the wills were cleared (nothing cleared then).
pub async fn sweep_wills(
    url: &str,
    host: &str,
    wait: Duration,
    stale_after: Duration,
) -> Result<SweptWills, StorageError> {
    let Some(mut fenced) = fence(url, host, wait, stale_after).await? else {
        return Ok(SweptWills::default());
    };
    let result = clear_due_wills(&mut fenced).await;
    unlock(&fenced.lock).await;
    result
}

/// [`sweep_wills`] with the lock held.
async fn clear_due_wills(fenced: &mut Fenced) -> Result<SweptWills, StorageError> {
    let found = load::load_wills(&fenced.writer.client)
        .await
        .map_err(|e| classify(e, "cannot read the wills"))?;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let mut swept = SweptWills::default();
    for read in found {
        let record = match read {
            Ok(record) => record,
            Err(unreadable) => {
                swept.unreadable.push(unreadable);
                continue;
            }
        };
        match will_wait(&record, fenced.silent_for, now_ms) {
            Some(left) if left.is_zero() => swept.due.push(record),
            Some(left) => swept.next = Some(swept.next.map_or(left, |n| n.min(left))),
            None => {}
        }
    }
    if swept.due.is_empty() {
        return Ok(swept);
    }
    let cleared: Vec<Change> = swept
        .due
        .iter()
        .map(|r| Change::WillCleared {
            client_id: r.client_id.clone(),
        })
        .collect();
    match write_batch(&mut fenced.writer, &cleared, fenced.epoch, false).await {
        Ok(()) => Ok(swept),
        Err(WriteError::Fenced(epoch)) => Err(StorageError::new(
            ErrorKind::Fenced,
            format!("another broker took the database over (epoch {epoch})"),
        )),
        Err(WriteError::Storage(e)) => Err(e),
    }
}

/// How long ago, by the database's clock, the last broker that served the database (not a
/// taker) wrote its last heartbeat: the previous heartbeat recorded by the first takeover
/// after that broker's own. `None` when none is recorded.
async fn last_served(lock: &Client) -> Result<Option<Duration>, StorageError> {
    let row = lock
        .query_opt(
            "SELECT extract(epoch FROM now() - previous_heartbeat_at)::float8 \
             FROM mercurio_takeovers WHERE previous_heartbeat_at IS NOT NULL AND epoch > \
             (SELECT coalesce(max(epoch), 0) FROM mercurio_takeovers \
              WHERE NOT starts_with(host, $1)) \
             ORDER BY epoch LIMIT 1",
            &[&TAKER_HOST_PREFIX],
        )
        .await
        .map_err(|e| classify(e, "cannot read the takeovers"))?;
    Ok(row.and_then(|r| Duration::try_from_secs_f64(r.get::<_, f64>(0).max(0.0)).ok()))
}

/// Takes the leadership lock on `lock`, ending a holder whose heartbeat is older than
/// `stale_after`, waiting `wait` at most.
async fn acquire(lock: &Client, wait: Duration, stale_after: Duration) -> Result<(), StorageError> {
    let err = |e| classify(e, "cannot take the advisory lock");
    let got: bool = lock
        .query_one(
            "SELECT pg_try_advisory_lock($1, $2)",
            &[&LOCK_CLASS, &LOCK_OBJECT],
        )
        .await
        .map_err(err)?
        .get(0);
    if got {
        return Ok(());
    }
    leader::terminate_if_stale(lock, stale_after).await?;
    lock.batch_execute(&format!("SET lock_timeout = {}", wait.as_millis().max(1)))
        .await
        .map_err(err)?;
    let waited = lock
        .query_one(
            "SELECT pg_advisory_lock($1, $2)",
            &[&LOCK_CLASS, &LOCK_OBJECT],
        )
        .await;
    match waited {
        Ok(_) => {}
        // lock_not_available: the lock_timeout ran out.
        Err(e) if e.code().map(|c| c.code()) == Some("55P03") => {
            return Err(StorageError::fenced(format!(
                "the database is still served by {}",
                leader::serving(lock).await
            )));
        }
        Err(e) => return Err(err(e)),
    }
    lock.batch_execute("SET lock_timeout = 0")
        .await
        .map_err(err)
}

/// Releases the leadership lock (its connection dropped afterwards releases it too).
async fn unlock(lock: &Client) {
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        lock.batch_execute("SELECT pg_advisory_unlock_all()"),
    )
    .await;
}

impl PeerSession {
    /// The epoch the take runs under: the database's, incremented by the take.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// How long before the take the broker that served the database last wrote its
    /// heartbeat (the database's clock; every second while it serves): when its clients'
    /// connections ended, at most a heartbeat's interval earlier. `None` when the database
    /// does not record it.
    pub fn silent_for(&self) -> Option<Duration> {
        self.silent_for
    }

    /// Deletes the session from the other broker's database and releases its lock.
    ///
    /// Errors: the database cannot be written (the session stays there); `Fenced` when
    /// another taker took the database over since (it cannot while this one holds the lock,
    /// but for an administrator's hand).
    pub async fn finish(mut self) -> Result<(), StorageError> {
        let deleted = [Change::SessionDeleted {
            client_id: self.client_id.clone(),
        }];
        let result = write_batch(&mut self.writer, &deleted, self.epoch, false).await;
        unlock(&self.lock).await;
        match result {
            Ok(()) => Ok(()),
            Err(WriteError::Fenced(epoch)) => Err(StorageError::new(
                ErrorKind::Fenced,
                format!("another broker took the database over (epoch {epoch})"),
            )),
            Err(WriteError::Storage(e)) => Err(e),
        }
    }
}
