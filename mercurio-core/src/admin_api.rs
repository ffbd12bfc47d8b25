//! The remote admin API (docs/admin-api.md): JSON over HTTP under `/api/v1/` on a WebSocket
//! listener with `admin_api = true`.
//!
//! The operations are not implemented here: each route becomes an admin [`Request`] (the
//! admin socket's, [`crate::admin`]) that the embedder's [`AdminHandler`] answers, so that
//! mercuriod's admin socket and this API share one implementation. Only `GET /api/v1/stats`
//! (the `$SYS` counters) is answered by the library itself; without a handler every other
//! route answers 404.
//!
//! Every request must be authenticated: `Authorization: Bearer <token>` with the content of
//! `admin_token_file` (compared in constant time, through SHA-256 so that not even its
//! length shows), or HTTP Basic with a broker user that the listener's authentication accepts
//! and `admin_users` names. No credentials or wrong ones: 401; a user who is not an admin:
//! 403. Neither answer tells more than that.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use async_trait::async_trait;
use base64::Engine;
use bytes::Bytes;
use http_body::Body;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::admin::{self, Answer, ErrorCode};
use crate::auth::hooks::ConnectInfo;
use crate::broker::BrokerState;
use crate::codec::ProtocolVersion;
use crate::config::{Config, ListenerConfig};
use crate::error::Error;
use crate::http_response::{HttpBody, ResponseGuard};
use crate::BrokerHandle;

/// Largest request body the API reads (`PUT /api/v1/log-level`), in bytes; a larger one gets
/// 413.
pub const MAX_BODY: usize = 16 * 1024;

/// Shortest token `admin_token_file` may hold, in bytes.
pub const MIN_TOKEN: usize = 16;

/// Every route the admin API serves: method and path, `{name}` standing for one path segment
/// (percent-decoded). docs/admin-api.yaml describes the same list.
pub const ADMIN_ROUTES: &[(&str, &str)] = &[
    ("GET", "/api/v1/status"),
    ("GET", "/api/v1/stats"),
    ("GET", "/api/v1/clients"),
    ("GET", "/api/v1/clients/{client_id}"),
    ("POST", "/api/v1/clients/{client_id}/disconnect"),
    ("DELETE", "/api/v1/sessions/{client_id}"),
    ("GET", "/api/v1/bridges"),
    ("GET", "/api/v1/bridges/{name}"),
    ("GET", "/api/v1/streams"),
    ("GET", "/api/v1/streams/{name}"),
    ("GET", "/api/v1/cluster"),
    ("PUT", "/api/v1/log-level"),
];

/// Answers the admin API's operations: given to
/// [`BrokerBuilder::admin_handler`](crate::BrokerBuilder::admin_handler).
///
/// Each route is one [`admin::Request`] (the table of [`crate::admin`]). An [`Answer::Ok`]'s
/// result is the HTTP body (200); an [`Answer::Refused`]'s code chooses the HTTP status:
/// [`ErrorCode::NotFound`] and [`ErrorCode::Unsupported`] 404, [`ErrorCode::Conflict`] 409,
/// [`ErrorCode::Failed`] 500, [`ErrorCode::BadRequest`] 400, [`ErrorCode::Unavailable`] 503.
/// The body of an error is `{"error":"one line"}`.
#[async_trait]
pub trait AdminHandler: Send + Sync + 'static {
    /// The answer to one request (already authenticated as an admin's).
    async fn answer(&self, broker: &BrokerHandle, request: admin::Request) -> Answer;
}

/// The admin API of one WebSocket listener.
pub(crate) struct AdminApi {
    broker: Arc<BrokerState>,
    listener: usize,
    handler: Option<Arc<dyn AdminHandler>>,
    /// Set once the broker's handle exists (right after the listeners are bound).
    handle: OnceLock<BrokerHandle>,
    /// SHA-256 of the token.
    token: Option<[u8; 32]>,
    users: Vec<String>,
}

/// Who a request is from, or why it is refused.
#[derive(Debug, PartialEq, Eq)]
enum Caller {
    Admin,
    /// No credentials, or credentials that are not valid: 401.
    Unauthenticated,
    /// A valid broker user who is not in `admin_users`: 403.
    Forbidden,
}

impl AdminApi {
    /// The API of listener `listener`, `None` when it does not have `admin_api`. Reads the
    /// token file. Errors: [`Error::Config`] naming the key when the token file cannot be read
    /// or holds fewer than [`MIN_TOKEN`] bytes.
    pub(crate) fn new(
        broker: Arc<BrokerState>,
        cfg: &ListenerConfig,
        listener: usize,
        handler: Option<Arc<dyn AdminHandler>>,
    ) -> Result<Option<AdminApi>, Error> {
        if !cfg.admin_api {
            return Ok(None);
        }
        let token = read_token(&broker.config, cfg, listener)?
            .map(|t| <[u8; 32]>::from(Sha256::digest(t.as_bytes())));
        let users = cfg
            .admin_users
            .clone()
            .unwrap_or_else(|| broker.config.admin.users.clone());
        Ok(Some(AdminApi {
            broker,
            listener,
            handler,
            handle: OnceLock::new(),
            token,
            users,
        }))
    }

    /// Gives the API the broker's handle, which the handler is called with.
    pub(crate) fn set_handle(&self, handle: BrokerHandle) {
        let _ = self.handle.set(handle);
    }

    /// Whether `path` is the API's.
    pub(crate) fn serves(path: &str) -> bool {
        path == "/api" || path.starts_with("/api/")
    }

    /// Answers one request under `/api/`.
    pub(crate) async fn respond<B>(
        &self,
        req: Request<B>,
        peer: SocketAddr,
        guard: ResponseGuard,
    ) -> Response<HttpBody>
    where
        B: Body<Data = Bytes> + Unpin,
    {
        match self.authenticate(&req, peer).await {
            Caller::Admin => {}
            Caller::Unauthenticated => {
                let mut r = error(StatusCode::UNAUTHORIZED, "authentication required", guard);
                r.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"mercurio-admin\""),
                );
                return r;
            }
            Caller::Forbidden => {
                return error(StatusCode::FORBIDDEN, "not an admin user", guard);
            }
        }
        let method = if req.method() == Method::HEAD {
            Method::GET
        } else {
            req.method().clone()
        };
        let path = req.uri().path().to_string();
        let Some((template, params)) = match_path(&path) else {
            return error(StatusCode::NOT_FOUND, "no such route", guard);
        };
        if !ADMIN_ROUTES
            .iter()
            .any(|(m, t)| *t == template && *m == method.as_str())
        {
            let allow: Vec<&str> = ADMIN_ROUTES
                .iter()
                .filter(|(_, t)| *t == template)
                .map(|(m, _)| *m)
                .collect();
            let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed", guard);
            if let Ok(v) = HeaderValue::from_str(&allow.join(", ")) {
                r.headers_mut().insert(header::ALLOW, v);
            }
            return r;
        }
        let param = |i: usize| params.get(i).cloned().unwrap_or_default();
        let request = match template {
            "/api/v1/stats" => return json_response(StatusCode::OK, &self.stats(), guard),
            "/api/v1/status" => admin::Request::Status,
            "/api/v1/clients" => admin::Request::ClientList,
            "/api/v1/clients/{client_id}" => admin::Request::ClientShow {
                client_id: param(0),
            },
            "/api/v1/clients/{client_id}/disconnect" => admin::Request::ClientDisconnect {
                client_id: param(0),
            },
            "/api/v1/sessions/{client_id}" => admin::Request::ClientDeleteSession {
                client_id: param(0),
            },
            "/api/v1/bridges" => admin::Request::BridgeList,
            "/api/v1/bridges/{name}" => admin::Request::BridgeShow { name: param(0) },
            "/api/v1/streams" => admin::Request::StreamList,
            "/api/v1/streams/{name}" => admin::Request::StreamShow { name: param(0) },
            "/api/v1/cluster" => admin::Request::ClusterStatus,
            "/api/v1/log-level" => {
                let body = match read_body(req.into_body()).await {
                    Ok(b) => b,
                    Err(status) => return error(status, "request body too large", guard),
                };
                let level = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v.get("level").and_then(Value::as_str).map(str::to_string));
                match level {
                    Some(level) => admin::Request::LogLevel { level },
                    None => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            "the body must be a JSON object with a string \"level\"",
                            guard,
                        )
                    }
                }
            }
            _ => return error(StatusCode::NOT_FOUND, "no such route", guard),
        };
        let (Some(handler), Some(handle)) = (&self.handler, self.handle.get()) else {
            return error(
                StatusCode::NOT_FOUND,
                "this broker has no admin handler for this route",
                guard,
            );
        };
        match handler.answer(handle, request).await {
            Answer::Ok(result) => json_response(StatusCode::OK, &result, guard),
            Answer::Refused {
                error: message,
                code,
            } => {
                let status = match code {
                    ErrorCode::NotFound | ErrorCode::Unsupported => StatusCode::NOT_FOUND,
                    ErrorCode::Conflict => StatusCode::CONFLICT,
                    ErrorCode::Failed => StatusCode::INTERNAL_SERVER_ERROR,
                    ErrorCode::BadRequest => StatusCode::BAD_REQUEST,
                    ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                };
                error(status, &message, guard)
            }
        }
    }

    /// Checks the request's `Authorization` header.
    async fn authenticate<B>(&self, req: &Request<B>, peer: SocketAddr) -> Caller {
        let Some(value) = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return Caller::Unauthenticated;
        };
        let (scheme, credentials) = value.trim().split_once(' ').unwrap_or((value, ""));
        let credentials = credentials.trim();
        if scheme.eq_ignore_ascii_case("bearer") {
            let Some(token) = &self.token else {
                return Caller::Unauthenticated;
            };
            let given: [u8; 32] = Sha256::digest(credentials.as_bytes()).into();
            return if bool::from(given.ct_eq(token)) {
                Caller::Admin
            } else {
                Caller::Unauthenticated
            };
        }
        if !scheme.eq_ignore_ascii_case("basic") {
            return Caller::Unauthenticated;
        }
        let Some((user, password)) = base64::engine::general_purpose::STANDARD
            .decode(credentials)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .and_then(|s| {
                s.split_once(':')
                    .map(|(u, p)| (u.to_string(), p.to_string()))
            })
        else {
            return Caller::Unauthenticated;
        };
        if user.is_empty() {
            return Caller::Unauthenticated;
        }
        let info = ConnectInfo {
            client_id: String::new(),
            username: Some(user),
            password: Some(Bytes::from(password)),
            peer,
            protocol: ProtocolVersion::V5,
            certificate_cn: None,
            username_from_certificate: false,
        };
        let auth = self.broker.auth_of(Some(self.listener));
        match auth.check_password(&info).await {
            Some(name) if self.users.contains(&name) => Caller::Admin,
            Some(_) => Caller::Forbidden,
            None => Caller::Unauthenticated,
        }
    }

    /// `GET /api/v1/stats`: the `$SYS` counters now, what the console samples.
    fn stats(&self) -> Value {
        let s = crate::metrics::Snapshot::take(&self.broker);
        let dropped: serde_json::Map<String, Value> = s
            .dropped
            .iter()
            .map(|(cause, n)| (cause.name().to_string(), json!(n)))
            .collect();
        let (mut queued, mut queued_bytes) = (0u64, 0u64);
        let sessions: Vec<_> = self.broker.sessions.lock().values().cloned().collect();
        for session in sessions.iter().filter(|s| !s.is_internal()) {
            let st = session.state.lock();
            queued += st.queued_len() as u64;
            queued_bytes += st.queue().bytes();
        }
        let bridges: Vec<_> = self
            .broker
            .bridges
            .lock()
            .iter()
            .map(|b| b.info())
            .collect();
        json!({
            "uptime_seconds": s.uptime_seconds,
            "clients_connected": s.clients_connected,
            "clients_maximum": s.clients_maximum,
            "clients_parked": s.clients_parked,
            "clients_moved": s.clients_moved,
            "clients_stalled": s.clients_stalled,
            "clients_rate_limited": s.clients_rate_limited,
            "clients_rate_limited_ms": s.clients_rate_limited_ms,
            "sessions": s.sessions,
            "sessions_disconnected": s.sessions_disconnected,
            "subscriptions": s.subscriptions,
            "retained_messages": s.retained_messages,
            "messages_received": s.messages_received,
            "messages_sent": s.messages_sent,
            "bytes_received": s.bytes_received,
            "bytes_sent": s.bytes_sent,
            "connections": s.connections_total,
            "queued_messages": queued,
            "queued_bytes": queued_bytes,
            "dropped": dropped,
            "storage": {
                "pending_bytes": s.storage_pending_bytes,
                "waiting_clients": s.storage_waiting_clients,
                "dirty_clients": s.storage_dirty_clients,
                "writes_failed": s.storage_writes_failed,
                "unwritable": s.storage_unwritable != 0,
            },
            "bridges_connected": bridges.iter().filter(|b| b.connected).count(),
            "bridges": bridges.len(),
        })
    }
}

/// The token of listener `listener`'s admin API: its `admin_token_file`, else `[admin]
/// token_file`, trimmed.
pub(crate) fn read_token(
    config: &Config,
    cfg: &ListenerConfig,
    listener: usize,
) -> Result<Option<String>, Error> {
    let (path, key) = match (&cfg.admin_token_file, &config.admin.token_file) {
        (Some(p), _) => (p, format!("listeners[{listener}].admin_token_file")),
        (None, Some(p)) => (p, "admin.token_file".to_string()),
        (None, None) => return Ok(None),
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("{key}: cannot read {}: {e}", path.display())))?;
    let token = text.trim();
    if token.len() < MIN_TOKEN {
        return Err(Error::Config(format!(
            "{key}: {} holds {} bytes; a token has at least {MIN_TOKEN}",
            path.display(),
            token.len()
        )));
    }
    Ok(Some(token.to_string()))
}

/// The route template `path` matches, with its `{...}` segments percent-decoded; `None` when
/// no route has this path (whatever the method).
fn match_path(path: &str) -> Option<(&'static str, Vec<String>)> {
    let segments: Vec<&str> = path.split('/').collect();
    'routes: for (_, template) in ADMIN_ROUTES {
        let parts: Vec<&str> = template.split('/').collect();
        if parts.len() != segments.len() {
            continue;
        }
        let mut params = Vec::new();
        for (t, s) in parts.iter().zip(&segments) {
            if t.starts_with('{') {
                let decoded =
                    crate::http_response::percent_decode(s).and_then(|b| String::from_utf8(b).ok());
                match decoded {
                    Some(d) if !d.is_empty() => params.push(d),
                    _ => continue 'routes,
                }
            } else if t != s {
                continue 'routes;
            }
        }
        return Some((template, params));
    }
    None
}

/// Reads a request body of at most [`MAX_BODY`] bytes; 413 when longer, 400 when it fails.
async fn read_body<B>(mut body: B) -> Result<Vec<u8>, StatusCode>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut out = Vec::new();
    while let Some(frame) =
        std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
    {
        let frame = frame.map_err(|_| StatusCode::BAD_REQUEST)?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > MAX_BODY {
                return Err(StatusCode::PAYLOAD_TOO_LARGE);
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(out)
}

/// A JSON response, never cached.
fn json_response(status: StatusCode, body: &Value, guard: ResponseGuard) -> Response<HttpBody> {
    let mut r = Response::new(HttpBody::bytes(body.to_string(), guard));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

/// `{"error": message}` with `status`.
fn error(status: StatusCode, message: &str, guard: ResponseGuard) -> Response<HttpBody> {
    json_response(status, &json!({ "error": message }), guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_match_their_templates() {
        assert_eq!(
            match_path("/api/v1/clients/a%2Fb"),
            Some(("/api/v1/clients/{client_id}", vec!["a/b".to_string()]))
        );
        assert_eq!(
            match_path("/api/v1/clients/x/disconnect"),
            Some((
                "/api/v1/clients/{client_id}/disconnect",
                vec!["x".to_string()]
            ))
        );
        assert_eq!(match_path("/api/v1/clients/"), None);
        assert_eq!(match_path("/api/v1/nothing"), None);
        assert_eq!(match_path("/api/v1/clients/%zz"), None);
    }
}
