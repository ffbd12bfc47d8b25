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
//! The lock serialises the takers of one database: a second one waits for the first's
//! [`PeerSession::finish`], at most the wait it was given.

use std::time::Duration;

use tokio_postgres::Client;

use super::leader::{self, LOCK_CLASS, LOCK_OBJECT};
use super::plan::{write_batch, WriteError};
use super::{check_version, classify, migrate, open_writer, parse_config, schema_version};
use super::{load, WriteConnection};
use crate::change::Change;
use crate::error::{ErrorKind, StorageError};
use crate::{SessionRecord, StoredMessage};

/// A session read from another broker's database, its database fenced and its lock held
/// until [`PeerSession::finish`] deletes the session there.
pub struct PeerSession {
    client_id: String,
    epoch: i64,
    lock: Client,
    writer: WriteConnection,
}

impl std::fmt::Debug for PeerSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSession")
            .field("client_id", &self.client_id)
            .field("epoch", &self.epoch)
            .finish()
    }
}

/// What [`take_session`] found: the session's records, as that broker's storage held them,
/// the messages its queue and in-flight list refer to (by the ids of the records), and the
/// hold on the database.
pub type Taken = (SessionRecord, Vec<StoredMessage>, PeerSession);

/// Takes the session of `client_id` from the database at `url`, served by another broker
/// that is gone: fences the database (see the [module documentation](self)), then reads the
/// session. `host` is recorded as the taker's in the takeover. A broker still holding the
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
    let config = parse_config(url)?;
    let mut lock = leader::dedicated(&config).await?;
    let Some(version) = schema_version(&lock).await? else {
        // Never served: no session in it.
        return Ok(None);
    };
    check_version(Some(version))?;
    acquire(&lock, wait, stale_after).await?;
    migrate(&mut lock).await?;
    let opened = open_writer(&config).await?;
    let lock_pid = leader::backend_pid(&lock).await?;
    let epoch = leader::take_over(&mut lock, host, &[lock_pid, opened.pid]).await?;
    let found = load::load_session(&opened.writer.client, client_id)
        .await
        .map_err(|e| classify(e, "cannot read the session"))?
        .map_err(|cause| StorageError::refused(format!("the session of {client_id}: {cause}")))?;
    let Some((record, messages)) = found else {
        unlock(&lock).await;
        return Ok(None);
    };
    let hold = PeerSession {
        client_id: client_id.to_string(),
        epoch,
        lock,
        writer: opened.writer,
    };
    Ok(Some((record, messages, hold)))
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
