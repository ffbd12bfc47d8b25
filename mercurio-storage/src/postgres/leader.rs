//! [`Leadership`]: which broker serves a PostgreSQL database (docs/operations.md, "Standby brokers").
//!
//! - The serving broker holds a session-level advisory lock on a dedicated connection and
//!   updates the heartbeat row (`mercurio_leader`: epoch, host, pid, backend pids, heartbeat
//!   time) every [`HEARTBEAT_EVERY`]. An update that finds another epoch means another broker
//!   took over: [`ErrorKind::Fenced`], at once. Without a heartbeat for [`LOST_AFTER`] it
//!   stops with [`ErrorKind::Fatal`], before any standby takes over.
//! - A broker that is not a standby tries the lock once and fails, naming the serving host.
//! - A standby blocks on the same lock with every timeout of its connections set to 0, so a
//!   role's `statement_timeout`, `lock_timeout`, `idle_in_transaction_session_timeout` or
//!   `idle_session_timeout` doesn't cut the wait. A second connection watches the heartbeat:
//!   older than [`HEARTBEAT_STALE`], the standby terminates the serving broker's backends,
//!   which releases the lock.
//! - Taking the lock: the schema is created or updated, the epoch incremented and the
//!   takeover recorded in `mercurio_takeovers`.

use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Mutex};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::Client;

use super::{check_version, classify, connect, describe, migrate, schema_version};
use crate::error::{ErrorKind, StorageError};

/// The leadership advisory lock's two keys: "MQTT" and 1 (session level, held by the
/// serving broker's lock connection).
pub(crate) const LOCK_CLASS: i32 = 0x4d51_5454;
pub(crate) const LOCK_OBJECT: i32 = 1;
/// The fence: a transaction-level advisory lock ("MQTT", 2) that every write transaction
/// takes shared and a takeover exclusively, so the epoch cannot change under a write in
/// progress and every write after a takeover sees the new epoch. An advisory lock rather than
/// `FOR SHARE` on the heartbeat row, which made each heartbeat wait for the write in
/// progress: under a long drain the serving broker missed heartbeats for 7 s and stopped.
pub(crate) const FENCE_OBJECT: i32 = 2;

/// How often the serving broker writes its heartbeat.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// How old a heartbeat is when a standby takes over from a serving broker still holding the
/// lock (a host gone, a half-open connection, a stopped process).
pub const HEARTBEAT_STALE: Duration = Duration::from_secs(11);
/// How long a serving broker goes without reaching the database before it stops.
pub const LOST_AFTER: Duration = Duration::from_secs(7);
/// How long one heartbeat may take.
const BEAT_TIMEOUT: Duration = Duration::from_secs(2);

type Failure = Option<(ErrorKind, String)>;

/// This broker's lead on a database: its epoch and the heartbeat task.
pub struct Leadership {
    epoch: i64,
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    failed: watch::Sender<Failure>,
    stop: watch::Sender<bool>,
    writer_pid: AtomicI32,
    lock_pid: AtomicI32,
    epoch: AtomicI64,
    /// When the last heartbeat was written, milliseconds after `started`.
    beat_at: AtomicU64,
    started: std::time::Instant,
}

impl Shared {
    /// Since the last heartbeat written (the process stalled counts: the clock is the
    /// system's monotonic one).
    fn since_beat(&self) -> Duration {
        let at = Duration::from_millis(self.beat_at.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(at)
    }

    fn beaten(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.beat_at.store(ms, Ordering::Relaxed);
    }

    fn fail(&self, kind: ErrorKind, message: &str) {
        let sent = self.failed.send_if_modified(|failure| {
            if failure.is_none() {
                *failure = Some((kind, message.to_string()));
                true
            } else {
                false
            }
        });
        if sent {
            tracing::error!("PostgreSQL storage: {message}");
        }
    }

    fn pids(&self) -> Vec<i32> {
        vec![
            self.lock_pid.load(Ordering::Relaxed),
            self.writer_pid.load(Ordering::Relaxed),
        ]
    }
}

/// The machine's host name, for the heartbeat row.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf, which we own.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".to_string();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Sets every timeout a role or the server may impose to 0 for this connection.
pub(crate) async fn zero_timeouts(client: &Client) -> Result<(), StorageError> {
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .map_err(|e| classify(e, "cannot read the server version"))?
        .get(0);
    if version < 120000 {
        return Err(StorageError::incompatible(format!(
            "PostgreSQL {version} is too old: Mercurio needs version 12 or later"
        )));
    }
    let mut sql = String::from(
        "SET statement_timeout = 0; SET lock_timeout = 0; \
         SET idle_in_transaction_session_timeout = 0;",
    );
    if version >= 140000 {
        sql.push_str(" SET idle_session_timeout = 0;");
    }
    client
        .batch_execute(&sql)
        .await
        .map_err(|e| classify(e, "cannot set up the connection"))
}

pub(crate) async fn backend_pid(client: &Client) -> Result<i32, StorageError> {
    Ok(client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .map_err(|e| classify(e, "cannot set up the connection"))?
        .get(0))
}

/// A new connection with its timeouts at 0.
pub(crate) async fn dedicated(config: &super::PgConfig) -> Result<Client, StorageError> {
    let client = connect(config).await?;
    zero_timeouts(&client).await?;
    Ok(client)
}

/// Who serves, for messages: "host H (pid P, heartbeat N s ago)".
pub(crate) async fn serving(client: &Client) -> String {
    let row = client
        .query_opt(
            "SELECT host, pid, extract(epoch FROM now() - heartbeat_at)::float8 \
             FROM mercurio_leader WHERE id = 1",
            &[],
        )
        .await;
    match row {
        Ok(Some(row)) => {
            let host: String = row.get(0);
            let pid: i64 = row.get(1);
            let age: f64 = row.get(2);
            format!("the broker on host {host} (pid {pid}, heartbeat {age:.0} s ago)")
        }
        _ => "another broker (its host is not recorded yet)".to_string(),
    }
}

impl Leadership {
    /// Takes the lead, waiting for it as a standby. Returns the lead and the receiver that
    /// reports its loss.
    pub(crate) async fn acquire(
        config: &super::PgConfig,
        host: &str,
        standby: bool,
        writer_pid: i32,
    ) -> Result<(Leadership, watch::Receiver<Failure>), StorageError> {
        let mut lock = dedicated(config).await?;
        check_version(schema_version(&lock).await?)?;
        if standby {
            drop(lock);
            lock = wait_for_lock(config).await?;
        } else {
            let got: bool = lock
                .query_one(
                    "SELECT pg_try_advisory_lock($1, $2)",
                    &[&LOCK_CLASS, &LOCK_OBJECT],
                )
                .await
                .map_err(|e| classify(e, "cannot take the advisory lock"))?
                .get(0);
            if !got {
                return Err(StorageError::fenced(format!(
                    "the database is served by {}: only one broker serves a database; \
                     start this one with standby = true to wait for it",
                    serving(&lock).await
                )));
            }
        }
        migrate(&mut lock).await?;
        let lock_pid = backend_pid(&lock).await?;
        let epoch = take_over(&mut lock, host, &[lock_pid, writer_pid]).await?;
        tracing::info!("PostgreSQL storage: serving the database as epoch {epoch} (host {host})");
        let (failed, failed_rx) = watch::channel(None);
        let (stop, stop_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            failed,
            stop,
            writer_pid: AtomicI32::new(writer_pid),
            lock_pid: AtomicI32::new(lock_pid),
            epoch: AtomicI64::new(epoch),
            beat_at: AtomicU64::new(0),
            started: std::time::Instant::now(),
        });
        let task = tokio::spawn(heartbeat(
            config.clone(),
            lock,
            Arc::clone(&shared),
            stop_rx,
        ));
        Ok((
            Leadership {
                epoch,
                shared,
                task: Mutex::new(Some(task)),
            },
            failed_rx,
        ))
    }

    /// The epoch this broker serves under.
    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    /// Whether [`LOST_AFTER`] has passed since the last heartbeat written: this broker may
    /// have been stalled (stopped, frozen) long enough for another to take the database
    /// ([`HEARTBEAT_STALE`] later), and must not act for it until its next heartbeat says it
    /// still serves (or fails, [`ErrorKind::Fenced`]). Awake and unable to write its
    /// heartbeat that long, it stops anyway.
    pub fn lapsed(&self) -> bool {
        self.shared.since_beat() >= LOST_AFTER
    }

    /// Records the backend of a new write connection (a standby terminates it on takeover).
    pub(crate) async fn set_writer_pid(&self, pid: i32) {
        self.shared.writer_pid.store(pid, Ordering::Relaxed);
    }

    /// Reports the lead lost: the broker stops at once.
    pub(crate) fn fail(&self, kind: ErrorKind, message: &str) {
        self.shared.fail(kind, message);
    }

    /// Stops the heartbeat and releases the lock (closing its connection).
    pub(crate) async fn release(&self) {
        let _ = self.shared.stop.send(true);
        if let Some(task) = self.task.lock().await.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        let _ = self.shared.stop.send(true);
    }
}

/// Blocks on the advisory lock; meanwhile a second connection terminates a serving broker
/// whose heartbeat is older than [`HEARTBEAT_STALE`]. Returns the connection holding the lock.
async fn wait_for_lock(config: &super::PgConfig) -> Result<Client, StorageError> {
    tracing::info!("PostgreSQL storage: standby, waiting for the serving broker to stop");
    let mut retry = Duration::from_millis(200);
    loop {
        let lock = match dedicated(config).await {
            Ok(lock) => lock,
            Err(e) if e.is_transient() => {
                tracing::warn!("standby: {e}; retrying");
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(Duration::from_secs(5));
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut monitor: Option<Client> = None;
        let acquired = {
            let waiting = lock.query_one(
                "SELECT pg_advisory_lock($1, $2)",
                &[&LOCK_CLASS, &LOCK_OBJECT],
            );
            tokio::pin!(waiting);
            let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    result = &mut waiting => break result,
                    _ = tick.tick() => {
                        if monitor.as_ref().is_none_or_closed() {
                            monitor = dedicated(config).await.ok();
                        }
                        if let Some(m) = &monitor {
                            if let Err(e) = terminate_if_stale(m, HEARTBEAT_STALE).await {
                                tracing::warn!("standby: cannot check the heartbeat: {e}");
                            }
                        }
                    }
                }
            }
        };
        match acquired {
            Ok(_) => {
                tracing::info!("standby: took the lock, taking over");
                return Ok(lock);
            }
            Err(e) => {
                tracing::warn!(
                    "standby: waiting for the lock failed: {}; retrying",
                    describe(&e)
                );
                tokio::time::sleep(retry).await;
            }
        }
    }
}

trait ClosedExt {
    fn is_none_or_closed(&self) -> bool;
}

impl ClosedExt for Option<&Client> {
    fn is_none_or_closed(&self) -> bool {
        self.is_none_or(|c| c.is_closed())
    }
}

/// Terminates the lock holder and the recorded backends when the heartbeat is older than
/// `stale_after`.
pub(crate) async fn terminate_if_stale(
    monitor: &Client,
    stale_after: Duration,
) -> Result<(), StorageError> {
    let row = monitor
        .query_opt(
            "SELECT extract(epoch FROM now() - heartbeat_at)::float8, host, backend_pids \
             FROM mercurio_leader WHERE id = 1 AND to_regclass('mercurio_leader') IS NOT NULL",
            &[],
        )
        .await;
    let row = match row {
        Ok(Some(row)) => row,
        Ok(None) => return Ok(()),
        // No table yet: the first broker is creating it.
        Err(e) if e.code().map(|c| c.code()) == Some("42P01") => return Ok(()),
        Err(e) => return Err(classify(e, "cannot read the heartbeat")),
    };
    let age: f64 = row.get(0);
    if age < stale_after.as_secs_f64() {
        return Ok(());
    }
    let host: String = row.get(1);
    let pids: Vec<i32> = row.get(2);
    let sql = format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE pid <> pg_backend_pid() AND datname = current_database() AND (pid = ANY($1) \
         OR pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted \
         AND classid = {} AND objid = {} AND objsubid = 2))",
        LOCK_CLASS as u32, LOCK_OBJECT
    );
    let terminated: i64 = monitor
        .query_one(&sql, &[&pids])
        .await
        .map_err(|e| classify(e, "cannot terminate the serving broker's connections"))?
        .get(0);
    tracing::warn!(
        "standby: the serving broker on host {host} last wrote its heartbeat {age:.1} s ago: \
         terminated its {terminated} connection(s), taking over"
    );
    Ok(())
}

/// With the lock held: ends the previous leader's connections, increments the epoch and
/// records the takeover. Returns the new epoch.
pub(crate) async fn take_over(
    lock: &mut Client,
    host: &str,
    pids: &[i32],
) -> Result<i64, StorageError> {
    let err = |e| classify(e, "cannot record the takeover");
    // A previous leader's write transaction may still hold the row (a stopped process):
    // its backends belong to an older epoch and must not write anyway.
    let app: String = lock
        .query_one("SELECT current_setting('application_name')", &[])
        .await
        .map_err(err)?
        .get(0);
    lock.execute(
        "SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a, mercurio_leader l \
         WHERE l.id = 1 AND a.pid = ANY(l.backend_pids) AND NOT a.pid = ANY($1) \
         AND a.datname = current_database() AND a.application_name = $2",
        &[&pids, &app],
    )
    .await
    .map_err(err)?;
    let pid = i64::from(std::process::id());
    let tx = lock.transaction().await.map_err(err)?;
    // Waits for write transactions in progress (of a previous leader still running), and
    // holds later ones until the new epoch is committed.
    tx.execute(
        "SELECT pg_advisory_xact_lock($1, $2)",
        &[&LOCK_CLASS, &FENCE_OBJECT],
    )
    .await
    .map_err(err)?;
    let previous = tx
        .query_opt(
            "SELECT host, heartbeat_at::text FROM mercurio_leader WHERE id = 1 FOR UPDATE",
            &[],
        )
        .await
        .map_err(err)?;
    let epoch: i64 = tx
        .query_one(
            "INSERT INTO mercurio_leader (id, epoch, host, pid, backend_pids, heartbeat_at, \
             since) VALUES (1, 1, $1, $2, $3, now(), now()) ON CONFLICT (id) DO UPDATE SET \
             epoch = mercurio_leader.epoch + 1, host = excluded.host, pid = excluded.pid, \
             backend_pids = excluded.backend_pids, heartbeat_at = now(), since = now() \
             RETURNING epoch",
            &[&host, &pid, &pids],
        )
        .await
        .map_err(err)?
        .get(0);
    let (previous_host, previous_beat): (Option<String>, Option<String>) = match &previous {
        Some(row) => (Some(row.get(0)), Some(row.get(1))),
        None => (None, None),
    };
    tx.execute(
        "INSERT INTO mercurio_takeovers (epoch, host, pid, previous_host, \
         previous_heartbeat_at) VALUES ($1, $2, $3, $4, $5::text::timestamptz)",
        &[&epoch, &host, &pid, &previous_host, &previous_beat],
    )
    .await
    .map_err(err)?;
    tx.commit().await.map_err(err)?;
    if let Some(previous_host) = previous_host {
        tracing::info!("PostgreSQL storage: took over from the broker on host {previous_host}");
    }
    Ok(epoch)
}

/// One heartbeat: `Ok(false)` when the epoch is no longer ours.
async fn beat(lock: &Client, shared: &Shared) -> Result<bool, StorageError> {
    let epoch = shared.epoch.load(Ordering::Relaxed);
    let n = lock
        .execute(
            "UPDATE mercurio_leader SET heartbeat_at = now(), backend_pids = $2 \
             WHERE id = 1 AND epoch = $1",
            &[&epoch, &shared.pids()],
        )
        .await
        .map_err(|e| classify(e, "cannot write the heartbeat"))?;
    Ok(n == 1)
}

/// A new lock connection after the old one was lost: the lock again, and the epoch still
/// ours. `Err(Fenced)` when another broker holds either.
async fn relock(config: &super::PgConfig, shared: &Shared) -> Result<Client, StorageError> {
    let lock = dedicated(config).await?;
    let got: bool = lock
        .query_one(
            "SELECT pg_try_advisory_lock($1, $2)",
            &[&LOCK_CLASS, &LOCK_OBJECT],
        )
        .await
        .map_err(|e| classify(e, "cannot take the advisory lock"))?
        .get(0);
    if !got {
        return Err(StorageError::fenced(format!(
            "lost the advisory lock: another broker took over this database, served by {}",
            serving(&lock).await
        )));
    }
    shared
        .lock_pid
        .store(backend_pid(&lock).await?, Ordering::Relaxed);
    Ok(lock)
}

fn fenced_message(what: &str) -> String {
    format!("{what}: another broker took over this database (a newer epoch): stopping")
}

/// The serving broker's heartbeat, until stopped, fenced or the database is lost.
async fn heartbeat(
    config: super::PgConfig,
    lock: Client,
    shared: Arc<Shared>,
    mut stop: watch::Receiver<bool>,
) {
    let mut lock = Some(lock);
    let mut last_ok = Instant::now();
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => break,
            _ = tick.tick() => {}
        }
        // A lost lock connection (terminated by a standby, a network cut) is replaced at
        // once within the same tick: the new one finds whether another broker took over.
        let mut result = None;
        for _ in 0..2 {
            let attempt = async {
                if lock.as_ref().is_none_or_closed() {
                    lock = None;
                    lock = Some(relock(&config, &shared).await?);
                }
                beat(lock.as_ref().expect("connected"), &shared).await
            };
            let r = tokio::time::timeout(BEAT_TIMEOUT, attempt).await;
            let retry =
                matches!(&r, Ok(Err(e)) if e.is_transient()) && lock.as_ref().is_none_or_closed();
            result = Some(r);
            if !retry {
                break;
            }
        }
        let result = result.expect("attempted");
        match result {
            Ok(Ok(true)) => {
                last_ok = Instant::now();
                shared.beaten();
            }
            Ok(Ok(false)) => {
                shared.fail(ErrorKind::Fenced, &fenced_message("heartbeat refused"));
                break;
            }
            Ok(Err(e)) if e.is_fenced() => {
                shared.fail(ErrorKind::Fenced, e.message());
                break;
            }
            Ok(Err(e)) => tracing::warn!("PostgreSQL storage: heartbeat failed: {e}"),
            Err(_) => tracing::warn!("PostgreSQL storage: heartbeat timed out"),
        }
        if last_ok.elapsed() >= LOST_AFTER {
            shared.fail(
                ErrorKind::Fatal,
                &format!(
                    "cannot reach the database for {} s: stopping (a standby may take over)",
                    last_ok.elapsed().as_secs()
                ),
            );
            break;
        }
    }
    if let Some(lock) = lock {
        let _ = tokio::time::timeout(
            Duration::from_secs(1),
            lock.batch_execute("SELECT pg_advisory_unlock_all()"),
        )
        .await;
    }
}
