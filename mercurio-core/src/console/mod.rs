//! The web console (docs/console.md): one HTML page, one script and one style sheet, compiled
//! into the binary and served under `/console/` on a WebSocket listener with `console = true`.
//! Nothing is fetched from elsewhere: the page reads the admin API of the same listener
//! (`admin_api.rs`) with the credentials the operator types in, and keeps them in memory only.

use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};

use crate::http_response::{get_or_head_only, text, HttpBody, ResponseGuard};

const INDEX: &str = include_str!("index.html");
const SCRIPT: &str = include_str!("app.js");
const STYLE: &str = include_str!("style.css");

/// Whether `path` is the console's.
pub(crate) fn serves(path: &str) -> bool {
    path == "/console" || path.starts_with("/console/")
}

/// Serves one of the console's files (GET and HEAD only).
pub(crate) fn respond<B>(req: &Request<B>, guard: ResponseGuard) -> Response<HttpBody> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return get_or_head_only(guard);
    }
    let (body, content_type) = match req.uri().path() {
        "/console" => {
            let mut r = text(StatusCode::PERMANENT_REDIRECT, "see /console/\n", guard);
            r.headers_mut()
                .insert(header::LOCATION, HeaderValue::from_static("/console/"));
            return r;
        }
        "/console/" | "/console/index.html" => (INDEX, "text/html; charset=utf-8"),
        "/console/app.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "/console/style.css" => (STYLE, "text/css; charset=utf-8"),
        _ => return text(StatusCode::NOT_FOUND, "not found\n", guard),
    };
    let mut r = Response::new(HttpBody::bytes(body, guard));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Everything comes from this listener; no inline script, no other origin.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    r
}
