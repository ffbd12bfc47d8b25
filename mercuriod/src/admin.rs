//! The admin socket: a Unix socket (mode 0600) that mercurioctl talks to.
//!
//! Protocol: one JSON object per line each way, the admin protocol of
//! [`mercurio_core::admin`] (its table lists the requests and their results): a request names
//! its command and its arguments; the answer is `{"ok":true,"result":...}` or
//! `{"ok":false,"error":"one line","code":...}`. Several requests may follow each other on one
//! connection. Both transports answer through [`answer`]: the remote admin API (docs/admin-api.md)
//! gets it as the broker's [`AdminHandler`] ([`Handler`]).
//!
//! A malformed request gets an error answer; a line over [`MAX_REQUEST`] bytes gets one and
//! the connection is closed. An idle connection is closed after [`IDLE_TIMEOUT`]; at most
//! [`MAX_CONNECTIONS`] are served at once. While the broker starts (a standby waits for the
//! serving broker, perhaps for days) every request is answered at once with the code
//! `unavailable` ([`Answering::Starting`]), one per connection.

use std::convert::Infallible;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use mercurio_core::admin::{socket_path, Answer, ErrorCode, Request};
use mercurio_core::config::StorageBackend;
use mercurio_core::{AdminHandler, BrokerHandle};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use crate::logging::LogControl;

/// Longest request line, in bytes.
pub const MAX_REQUEST: usize = 64 * 1024;

/// Admin connections served at once; more get an error answer.
pub const MAX_CONNECTIONS: usize = 16;

/// An admin connection with no request for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Who answers the admin socket's requests.
#[derive(Clone)]
pub enum Answering {
    /// The broker is not serving yet: every request is refused with this reason and the
    /// code `unavailable`, and its connection closed.
    Starting(Arc<str>),
    /// The running broker, and the log's level control (`broker.log-level`).
    Broker(BrokerHandle, LogControl),
}

/// The bound admin socket; the file is removed when this is dropped.
pub struct AdminSocket {
    listener: UnixListener,
    path: PathBuf,
}

/// Binds a Unix socket that is mode 0600 from the moment it exists: created under umask 0177
/// (restored right after), so no other user can connect in between, as a chmod after the bind
/// would allow. The umask is the process's: this runs at start, before anything else creates
/// files.
fn bind_private(path: &Path) -> std::io::Result<UnixListener> {
    // SAFETY: umask only swaps the process's file mode creation mask; it cannot fail.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the mask in force before.
    unsafe { libc::umask(old) };
    bound
}

impl AdminSocket {
    /// Binds `path` with mode 0600, creating its directory (mode 0700) when missing.
    ///
    /// Refused, with a one-line reason: a path that exists and is not a socket or belongs to
    /// another user, a socket another broker answers on, a directory of another user or open
    /// to others when it is the `/tmp` default. A stale socket (nobody answers) is replaced.
    pub fn bind(path: &Path) -> Result<AdminSocket, String> {
        use std::os::unix::fs::MetadataExt;
        let shown = path.display();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| {
                        format!("admin socket {shown}: cannot create {}: {e}", dir.display())
                    })?;
            }
            let shared_tmp = dir.parent() == Some(Path::new("/tmp"))
                && dir
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("mercurio-"));
            if shared_tmp {
                // The /tmp/mercurio-$UID default: another user could have made it first.
                let meta = std::fs::metadata(dir)
                    .map_err(|e| format!("admin socket {shown}: {}: {e}", dir.display()))?;
                if meta.uid() != socket_path::euid() || meta.mode() & 0o077 != 0 {
                    return Err(format!(
                        "admin socket {shown}: {} must belong to this user with mode 0700",
                        dir.display()
                    ));
                }
            }
        }
        if std::fs::symlink_metadata(path).is_ok() {
            socket_path::check_existing(path, false).map_err(|e| format!("admin socket: {e}"))?;
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(format!(
                    "admin socket {shown}: another mercuriod answers on it"
                ));
            }
            std::fs::remove_file(path).map_err(|e| {
                format!("admin socket {shown}: cannot remove the stale socket: {e}")
            })?;
        }
        let listener = bind_private(path).map_err(|e| format!("admin socket {shown}: {e}"))?;
        Ok(AdminSocket {
            listener,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves connections, answered by `answering`, until the future is dropped (it never
    /// ends on its own). A connection accepted meanwhile is served to its end by its own task.
    pub async fn serve(&self, answering: Answering) -> Infallible {
        let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        loop {
            match self.listener.accept().await {
                Ok((mut stream, _)) => match Arc::clone(&permits).try_acquire_owned() {
                    Ok(permit) => {
                        let answering = answering.clone();
                        tokio::spawn(async move {
                            connection(stream, answering).await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        let busy = Answer::bad_request(format!(
                            "more than {MAX_CONNECTIONS} admin connections"
                        ));
                        tokio::spawn(async move {
                            let line = format!("{}\n", busy.to_json());
                            let _ = stream.write_all(line.as_bytes()).await;
                        });
                    }
                },
                Err(e) => {
                    tracing::warn!("admin socket: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

impl Drop for AdminSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One admin connection: answers each request line (the first only, while starting).
async fn connection(stream: UnixStream, answering: Answering) {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    let mut line = Vec::new();
    loop {
        line.clear();
        let mut limited = (&mut reader).take(MAX_REQUEST as u64 + 1);
        let read = tokio::time::timeout(IDLE_TIMEOUT, limited.read_until(b'\n', &mut line)).await;
        let n = match read {
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => return,
        };
        if n == 0 {
            return;
        }
        let too_long = line.len() > MAX_REQUEST;
        let answer = if too_long {
            Answer::bad_request(format!("request longer than {MAX_REQUEST} bytes"))
        } else {
            match serde_json::from_slice(&line)
                .map_err(|e| e.to_string())
                .and_then(Request::parse)
            {
                Ok(request) => match &answering {
                    Answering::Broker(handle, log) => {
                        answer(request, handle, log, "mercurioctl").await
                    }
                    Answering::Starting(why) => {
                        Answer::refused(ErrorCode::Unavailable, why.to_string())
                    }
                },
                Err(e) => Answer::bad_request(format!("bad request: {e}")),
            }
        };
        let mut out = answer.to_json().to_string().into_bytes();
        out.push(b'\n');
        // While starting, one answer: a later request on this connection would get the
        // same refusal after the broker serves.
        let starting = matches!(answering, Answering::Starting(_));
        if write.write_all(&out).await.is_err() || too_long || starting {
            return;
        }
    }
}

/// The broker's [`AdminHandler`]: the remote admin API's requests answered by the same code
/// as the socket's.
pub struct Handler {
    pub log: LogControl,
}

#[async_trait::async_trait]
impl AdminHandler for Handler {
    async fn answer(&self, broker: &BrokerHandle, request: Request) -> Answer {
        answer(request, broker, &self.log, "the admin API").await
    }
}

/// An error answer with its `code`.
fn failure(code: ErrorCode, message: impl Into<String>) -> Answer {
    Answer::refused(code, message)
}

fn ok(result: Value) -> Answer {
    Answer::Ok(result)
}

/// The answer to one request; `by` names the transport in the log lines ("mercurioctl", "the
/// admin API").
pub async fn answer(request: Request, handle: &BrokerHandle, log: &LogControl, by: &str) -> Answer {
    match &request {
        // Credentials (hashes, SCRAM keys) stay out of the log.
        Request::UserAdd { username, .. } | Request::UserPasswd { username, .. } => {
            tracing::debug!(%username, "admin request: credentials of a user")
        }
        _ => tracing::debug!(?request, "admin request"),
    }
    // `user.*`, `group.*`, `role.*`, `acl.*`: the access rules kept in storage.
    if let Some(answer) = handle.access(&request).await {
        return answer;
    }
    match request {
        Request::Status => ok(status(handle, log)),
        Request::LogLevel { level } => match log.set_level(&level) {
            Ok((directives, warning)) => {
                if let Some(w) = &warning {
                    tracing::warn!("{w}");
                }
                tracing::info!("log level set to {directives:?} by {by}");
                match warning {
                    Some(w) => ok(json!({"level": directives, "warning": w})),
                    None => ok(json!({"level": directives})),
                }
            }
            Err(e) => Answer::bad_request(e),
        },
        Request::ClientList => {
            let mut sessions = handle.sessions();
            sessions.sort_by(|a, b| a.client_id.cmp(&b.client_id));
            let clients: Vec<Value> = sessions
                .iter()
                .map(|s| {
                    json!({
                        "client_id": s.client_id,
                        "connected": s.connected,
                        "protocol_level": s.protocol_level,
                        "subscriptions": s.subscriptions,
                        "queued": s.queued,
                        "inflight": s.inflight,
                    })
                })
                .collect();
            ok(json!({ "clients": clients }))
        }
        Request::ClientShow { client_id } => match handle.session_detail(&client_id) {
            Some(d) => ok(json!({
                "client_id": d.info.client_id,
                "connected": d.info.connected,
                "protocol_level": d.info.protocol_level,
                "subscriptions": d.subscriptions.iter()
                    .map(|(filter, qos)| json!({"filter": filter, "qos": *qos as u8}))
                    .collect::<Vec<_>>(),
                "queued": d.info.queued,
                "queued_bytes": d.queued_bytes,
                "queued_in_storage": d.queued_in_storage,
                "inflight": d.info.inflight,
                "expiry_interval": d.expiry_interval,
                "will": d.will,
                "disconnected_secs": d.disconnected_for.map(|t| t.as_secs()),
                "address": d.address.map(|a| a.to_string()),
                "thread": d.thread,
            })),
            None => failure(ErrorCode::NotFound, format!("no such client: {client_id}")),
        },
        Request::ClientDisconnect { client_id } => {
            if handle.disconnect(&client_id) {
                tracing::info!(%client_id, "disconnected by {by}");
                ok(json!({}))
            } else if handle.session_detail(&client_id).is_some() {
                failure(ErrorCode::Conflict, format!("client {client_id} is not connected"))
            } else {
                failure(ErrorCode::NotFound, format!("no such client: {client_id}"))
            }
        }
        Request::ClientDeleteSession { client_id } => match handle.delete_session(&client_id).await {
            Err(e) => failure(ErrorCode::Failed, format!("cannot delete the session of {client_id}: {e}")),
            Ok(Some(true)) => {
                tracing::info!(%client_id, "session deleted by {by}");
                ok(json!({}))
            }
            Ok(Some(false)) => failure(ErrorCode::Conflict, format!(
                "client {client_id} is connected: disconnect it first (mercurioctl client disconnect {client_id})"
            )),
            Ok(None) => failure(ErrorCode::NotFound, format!("no such client: {client_id}")),
        },
        Request::BridgeList => {
            let bridges: Vec<Value> = handle.bridges().iter().map(bridge).collect();
            ok(json!({ "bridges": bridges }))
        }
        Request::BridgeShow { name } => match handle.bridges().iter().find(|b| b.name == name) {
            Some(b) => ok(bridge(b)),
            None => failure(ErrorCode::NotFound, format!("no such bridge: {name}")),
        },
        Request::StreamList => ok(json!({ "streams": handle.streams() })),
        Request::StreamShow { name } => match handle.streams().into_iter().find(|s| s.name == name) {
            Some(s) => ok(json!(s)),
            None => failure(ErrorCode::NotFound, format!("no such stream: {name}")),
        },
        Request::StreamCreate {
            name,
            filter,
            max_age,
            max_bytes,
            last_value,
        } => {
            let config = mercurio_core::config::StreamConfig {
                name,
                filter,
                max_age,
                max_bytes,
                last_value,
            };
            match handle.create_stream(config) {
                Ok(info) => {
                    tracing::info!(stream = %info.name, "stream created by {by}");
                    ok(json!(info))
                }
                Err(e) => failure(stream_refused(&e), e.to_string()),
            }
        }
        Request::StreamDelete { name } => match handle.delete_stream(&name) {
            Ok(()) => {
                tracing::info!(stream = %name, "stream deleted by {by}");
                ok(json!({}))
            }
            Err(e) => failure(stream_refused(&e), e.to_string()),
        },
        Request::ClusterStatus => match handle.cluster_status() {
            Some(status) => ok(json!(status)),
            None => failure(
                ErrorCode::Unsupported,
                "cluster mode is off on this broker (no [cluster] nats_urls)",
            ),
        },
        // Answered by `BrokerHandle::access` above.
        _ => failure(ErrorCode::Unsupported, "unsupported request"),
    }
}

/// The admin error code of a stream's refusal.
fn stream_refused(e: &mercurio_core::streams::StreamRefused) -> ErrorCode {
    use mercurio_core::streams::StreamRefused;
    match e {
        StreamRefused::Invalid(_) => ErrorCode::BadRequest,
        StreamRefused::Exists(_) | StreamRefused::Configured(_) => ErrorCode::Conflict,
        StreamRefused::NotFound(_) => ErrorCode::NotFound,
    }
}

/// One bridge's state and counters.
fn bridge(b: &mercurio_core::BridgeInfo) -> Value {
    json!({
        "name": b.name,
        "client_id": b.client_id,
        "addresses": b.addresses,
        "connected": b.connected,
        "address": b.address,
        "connected_secs": b.connected_for.map(|t| t.as_secs()),
        "last_error": b.last_error,
        "forwarded_out": b.forwarded_out,
        "forwarded_in": b.forwarded_in,
        "queued": b.queued,
        "queued_bytes": b.queued_bytes,
        "dropped": b.dropped,
        "reconnects": b.reconnects,
        "packets_too_large": b.packets_too_large,
    })
}

fn status(handle: &BrokerHandle, log: &LogControl) -> Value {
    let sessions = handle.sessions();
    let disconnected = sessions.iter().filter(|s| !s.connected).count();
    let config = handle.config();
    let stats = handle.stats();
    let backend = match config.storage.backend {
        StorageBackend::Memory => "memory",
        StorageBackend::Sqlite => "sqlite",
        StorageBackend::Postgres => "postgres",
    };
    // The writer's counters ($SYS/broker/storage/...): clients waiting to be written whole
    // again after a refused change, and sessions set aside at start because unreadable.
    // And storage that takes no writes at all (a full disk, a database down).
    let dirty = stats.storage_clients_dirty;
    let set_aside = stats.storage_sessions_set_aside;
    let unwritable = handle.storage_write_failure();
    let state = match (config.storage.backend, unwritable) {
        (StorageBackend::Memory, _) => "in memory: lost when the broker stops".to_string(),
        (_, Some(f)) => format!(
            "degraded: cannot write for {} s ({}); clients with changes to store wait",
            f.duration.as_secs(),
            f.error
        ),
        _ if dirty == 0 && set_aside == 0 => "ok".to_string(),
        _ => format!(
            "degraded: {dirty} clients waiting to be written again, {set_aside} sessions set aside"
        ),
    };
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_secs": handle.uptime().as_secs(),
        "clients_connected": stats.clients_connected,
        "clients_maximum": stats.clients_maximum,
        "sessions": sessions.len(),
        "sessions_disconnected": disconnected,
        "storage": {
            "backend": backend,
            "state": state,
            "pending_bytes": stats.storage_pending_bytes,
            "writes_failed": stats.storage_writes_failed,
        },
        "log_level": log.level(),
        "listeners": handle.local_addrs().iter().map(|a| a.to_string()).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::AdminSocket;

    /// The socket is mode 0600 from the moment it exists: a watcher that stats it as soon as it
    /// appears never sees another mode (with a chmod after the bind it could, under the
    /// usual umask 022, and connect in between).
    #[tokio::test]
    async fn the_socket_is_private_from_the_moment_it_exists() {
        let dir = tempfile::tempdir().expect("temp dir");
        for i in 0..200 {
            let path = dir.path().join(format!("s{i}.sock"));
            let watched = path.clone();
            let watcher = std::thread::spawn(move || loop {
                if let Ok(m) = std::fs::symlink_metadata(&watched) {
                    return m.permissions().mode() & 0o777;
                }
                std::hint::spin_loop();
            });
            let socket = AdminSocket::bind(&path).expect("bind");
            let first = watcher.join().expect("watcher");
            assert_eq!(first, 0o600, "socket {i} first seen with mode {first:o}");
            drop(socket);
        }
    }
}
