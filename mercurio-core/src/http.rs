//! The plain HTTP side of a WebSocket listener (docs/operations.md, "Health and
//! metrics" and "Protecting the broker"): `GET /healthz`, `/livez`, `/readyz`, `GET /metrics` and static files from `http_dir`, under the
//! listener's HTTP limits. The WebSocket upgrade itself is in `websocket.rs`.
//!
//! Static files are served only from inside `http_dir`: the path is percent-decoded once, any
//! `..`, `.` or dot-file segment, backslash or NUL is refused, and the file found is
//! canonicalized and must still lie inside the (canonicalized) directory, so a symbolic link
//! pointing out of it is not followed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body::Body;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use tokio::sync::Semaphore;

use crate::admin_api::{AdminApi, AdminHandler};
use crate::broker::BrokerState;
use crate::config::ListenerConfig;
use crate::console;
use crate::error::Error;
use crate::http_response::{
    get_or_head_only, percent_decode, strip, text, HttpBody, ResponseGuard,
};
use crate::metrics::Metrics;

/// The HTTP limits of a WebSocket listener (docs/operations.md, "Protecting the broker"). The
/// defaults are docs/http.md's; an embedding application (or a test) may change them with
/// [`BrokerBuilder::http_limits`](crate::BrokerBuilder::http_limits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Largest request head (request line and headers), in bytes; at least 8192 (hyper's
    /// smallest read buffer). Larger heads get 431. Default 8 KiB.
    pub max_head: usize,
    /// Responses being produced or sent at once per listener; more get 503. WebSocket upgrades
    /// are not counted (`max_connections` bounds them). Default 32.
    pub max_responses: usize,
    /// Longest time from a request's head to the end of its response; a slower response (a
    /// client that does not read) is cut by closing the connection. Default one minute.
    pub response_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_head: 8 * 1024,
            max_responses: 32,
            response_timeout: Duration::from_secs(60),
        }
    }
}

/// One WebSocket listener's HTTP state.
pub(crate) struct Endpoint {
    pub broker: Arc<BrokerState>,
    /// Index of its listener in `config.listeners`, for the connections it upgrades.
    pub listener: usize,
    pub limits: HttpLimits,
    health: bool,
    metrics: Option<Metrics>,
    /// Canonical path of `http_dir`.
    http_dir: Option<PathBuf>,
    responses: Arc<Semaphore>,
    /// The admin API (`admin_api = true`).
    pub(crate) admin: Option<AdminApi>,
    /// Whether the web console is served (`console = true`).
    console: bool,
}

impl Endpoint {
    /// The endpoint for a WebSocket listener; fails when `http_dir` is not a readable
    /// directory.
    pub(crate) fn new(
        broker: Arc<BrokerState>,
        cfg: &ListenerConfig,
        listener: usize,
        limits: HttpLimits,
        admin_handler: Option<Arc<dyn AdminHandler>>,
    ) -> Result<Endpoint, Error> {
        let http_dir = match &cfg.http_dir {
            None => None,
            Some(dir) => {
                let canonical = std::fs::canonicalize(dir)
                    .ok()
                    .filter(|d| d.is_dir())
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "listener {}:{}: http_dir {} is not a directory",
                            cfg.host,
                            cfg.port,
                            dir.display()
                        ))
                    })?;
                Some(canonical)
            }
        };
        let metrics = cfg.metrics.then(|| Metrics::new(Arc::clone(&broker)));
        let admin = AdminApi::new(Arc::clone(&broker), cfg, listener, admin_handler)?;
        Ok(Endpoint {
            broker,
            listener,
            limits: HttpLimits {
                max_head: limits.max_head.max(8192),
                ..limits
            },
            health: cfg.health,
            metrics,
            http_dir,
            responses: Arc::new(Semaphore::new(limits.max_responses)),
            admin,
            console: cfg.console,
        })
    }

    /// Whether `path` is the admin API's or the console's on this listener: those requests
    /// go to [`Endpoint::respond_admin`].
    pub(crate) fn serves_admin(&self, path: &str) -> bool {
        (self.admin.is_some() && AdminApi::serves(path)) || (self.console && console::serves(path))
    }

    /// Answers a request of the admin API or the console (any method; the API reads the body).
    pub(crate) async fn respond_admin<B>(
        &self,
        req: Request<B>,
        peer: std::net::SocketAddr,
        guard: ResponseGuard,
    ) -> Response<HttpBody>
    where
        B: Body<Data = Bytes> + Unpin,
    {
        let head = req.method() == Method::HEAD;
        let Ok(permit) = Arc::clone(&self.responses).try_acquire_owned() else {
            return strip(head, text(StatusCode::SERVICE_UNAVAILABLE, "busy\n", guard));
        };
        let guard = guard.with_permit(permit);
        let r = match &self.admin {
            Some(api) if AdminApi::serves(req.uri().path()) => api.respond(req, peer, guard).await,
            _ => console::respond(&req, guard),
        };
        strip(head, r)
    }

    /// Answers a plain HTTP request (not an upgrade). `guard` is held by the response body
    /// until it has been sent.
    pub(crate) async fn respond<B>(
        &self,
        req: &Request<B>,
        guard: ResponseGuard,
    ) -> Response<HttpBody> {
        let head = req.method() == Method::HEAD;
        if req.method() != Method::GET && !head {
            return get_or_head_only(guard);
        }
        let Ok(permit) = Arc::clone(&self.responses).try_acquire_owned() else {
            tracing::debug!(
                "HTTP: {} responses at once, answering 503",
                self.limits.max_responses
            );
            return strip(head, text(StatusCode::SERVICE_UNAVAILABLE, "busy\n", guard));
        };
        let guard = guard.with_permit(permit);
        let path = req.uri().path();
        let r = if self.health && path == "/livez" {
            // The process serves: nothing else is asked (liveness must not depend on storage).
            text(StatusCode::OK, "ok\n", guard)
        } else if self.health && path == "/readyz" {
            match not_ready(&self.broker) {
                Some(reason) => text(StatusCode::SERVICE_UNAVAILABLE, reason, guard),
                None => text(StatusCode::OK, "ok\n", guard),
            }
        } else if self.health && path == "/healthz" {
            let unwritable = self.broker.persist.get().and_then(|p| p.write_failure());
            if self.broker.is_shutting_down() {
                text(StatusCode::SERVICE_UNAVAILABLE, "stopping\n", guard)
            } else if let Some(f) = unwritable {
                // Nothing can be stored: a persistent client's messages would pile up.
                let body = format!(
                    "storage unwritable for {} s: {}\n",
                    f.duration.as_secs(),
                    f.error
                );
                text(StatusCode::SERVICE_UNAVAILABLE, body, guard)
            } else {
                text(StatusCode::OK, "ok\n", guard)
            }
        } else if let (Some(m), "/metrics") = (&self.metrics, path) {
            let accept = req
                .headers()
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok());
            let (body, content_type) = m.render(crate::metrics::wants_openmetrics(accept));
            let mut r = Response::new(HttpBody::bytes(body, guard));
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            r
        } else if let Some(dir) = &self.http_dir {
            static_file(dir, path, guard).await
        } else {
            not_found(guard)
        };
        strip(head, r)
    }
}

/// Why the broker should not be sent clients (`/readyz` 503's body, one line), or `None`
/// when it is ready: storage has not failed (leadership held: a PostgreSQL standby's
/// listeners are not bound until it leads, and one that loses the lead stops), it is not
/// stopping, every listener accepts, and storage takes writes.
fn not_ready(broker: &BrokerState) -> Option<String> {
    if let Some(e) = broker.storage_failed.get() {
        return Some(format!("storage failed, leadership not held: {e}\n"));
    }
    if broker.is_shutting_down() {
        return Some("stopping\n".into());
    }
    let accepting = broker
        .listeners_accepting
        .load(std::sync::atomic::Ordering::Relaxed);
    let listeners = broker.config.listeners.len();
    if accepting < listeners {
        return Some(format!(
            "listeners not up: {accepting} of {listeners} accepting\n"
        ));
    }
    if let Some(f) = broker.persist.get().and_then(|p| p.write_failure()) {
        return Some(format!(
            "storage unwritable for {} s: {}\n",
            f.duration.as_secs(),
            f.error
        ));
    }
    None
}

fn not_found(guard: ResponseGuard) -> Response<HttpBody> {
    text(StatusCode::NOT_FOUND, "not found\n", guard)
}

/// The relative path a request path names inside `http_dir`, or `None` when it tries to leave
/// it or names something hidden: segments `..`, `.` or starting with a dot, backslashes, NUL,
/// invalid UTF-8, or escapes that decode to any of those (decoded once, never twice).
pub(crate) fn safe_relative_path(request_path: &str) -> Option<PathBuf> {
    let decoded = String::from_utf8(percent_decode(request_path)?).ok()?;
    let mut rel = PathBuf::new();
    for seg in decoded.split('/') {
        if seg.is_empty() {
            continue;
        }
        if seg.starts_with('.') || seg.contains(['\\', '\0']) || seg.contains(':') {
            return None;
        }
        rel.push(seg);
    }
    Some(rel)
}

/// The content type for a file name's extension.
pub(crate) fn content_type(path: &Path) -> &'static str {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("html" | "htm") => "text/html; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("json" | "map") => "application/json",
        Some("txt" | "md") => "text/plain; charset=utf-8",
        Some("xml") => "application/xml",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("webp") => "image/webp",
        Some("ico") => "image/x-icon",
        Some("wasm") => "application/wasm",
        Some("pdf") => "application/pdf",
        Some("woff") => "font/woff",
        Some("woff2") => "font/woff2",
        Some("ttf") => "font/ttf",
        Some("otf") => "font/otf",
        Some("mp4") => "video/mp4",
        Some("webm") => "video/webm",
        Some("mp3") => "audio/mpeg",
        Some("wav") => "audio/wav",
        Some("csv") => "text/csv; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// Serves `request_path` from `dir` (canonical), `index.html` for a directory.
async fn static_file(dir: &Path, request_path: &str, guard: ResponseGuard) -> Response<HttpBody> {
    let Some(rel) = safe_relative_path(request_path) else {
        tracing::debug!(path = request_path, "HTTP: refused path");
        return not_found(guard);
    };
    let inside = |p: &Path| p.starts_with(dir);
    let Ok(mut path) = tokio::fs::canonicalize(dir.join(&rel)).await else {
        return not_found(guard);
    };
    if !inside(&path) {
        tracing::debug!(
            path = request_path,
            "HTTP: refused a path leading out of http_dir"
        );
        return not_found(guard);
    }
    let Ok(mut meta) = tokio::fs::metadata(&path).await else {
        return not_found(guard);
    };
    if meta.is_dir() {
        match tokio::fs::canonicalize(path.join("index.html")).await {
            Ok(p) if inside(&p) => path = p,
            _ => return not_found(guard),
        }
        match tokio::fs::metadata(&path).await {
            Ok(m) => meta = m,
            Err(_) => return not_found(guard),
        }
    }
    if !meta.is_file() {
        return not_found(guard);
    }
    let Ok(file) = tokio::fs::File::open(&path).await else {
        return not_found(guard);
    };
    let len = meta.len();
    let mut r = Response::new(HttpBody::file(file, len, guard));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(content_type(&path)),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_paths() {
        assert_eq!(safe_relative_path("/"), Some(PathBuf::new()));
        assert_eq!(
            safe_relative_path("/a/b.html"),
            Some(PathBuf::from("a/b.html"))
        );
        assert_eq!(
            safe_relative_path("/a%20b.txt"),
            Some(PathBuf::from("a b.txt"))
        );
        for bad in [
            "/../etc/passwd",
            "/a/../../x",
            "/%2e%2e/etc/passwd",
            "/%2E%2E%2Fetc%2Fpasswd",
            "/a/%2e%2e%2f%2e%2e/x",
            "/..%5cwindows",
            "/.hidden",
            "/a/./b",
            "/%00",
            "/%zz",
            "/%",
            "/%c0%ae%c0%ae/x",
            "/C:/x",
        ] {
            assert_eq!(safe_relative_path(bad), None, "{bad}");
        }
        // Decoded once: %252e stays the literal "%2e", a harmless file name.
        assert_eq!(
            safe_relative_path("/%252e%252e/x"),
            Some(PathBuf::from("%2e%2e/x"))
        );
    }

    #[test]
    fn content_types() {
        assert_eq!(
            content_type(Path::new("index.html")),
            "text/html; charset=utf-8"
        );
        assert_eq!(
            content_type(Path::new("a.JS")),
            "text/javascript; charset=utf-8"
        );
        assert_eq!(content_type(Path::new("x.png")), "image/png");
        assert_eq!(content_type(Path::new("noext")), "application/octet-stream");
    }
}
