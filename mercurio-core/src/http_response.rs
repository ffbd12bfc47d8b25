//! HTTP responses as the broker's HTTP endpoints build them (the plain HTTP side in
//! `http.rs`, the admin API, the console): `HttpBody` (nothing, bytes, or a file read in
//! chunks), `ResponseGuard` (the connection's deadline and the listener's response permit,
//! released when the body is done), and small builders. Below `http`, `admin_api` and
//! `console`, which all use it, so none of them imports another.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::header::{self, HeaderValue};
use hyper::{Response, StatusCode};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;

/// Ties a response to its connection's deadline and, for counted responses, to a permit of
/// the listener's semaphore; both are released when the body is done (dropped).
pub(crate) struct ResponseGuard {
    permit: Option<OwnedSemaphorePermit>,
    on_done: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl ResponseGuard {
    pub(crate) fn new(on_done: impl FnOnce() + Send + Sync + 'static) -> ResponseGuard {
        ResponseGuard {
            permit: None,
            on_done: Some(Box::new(on_done)),
        }
    }

    pub(crate) fn with_permit(mut self, permit: OwnedSemaphorePermit) -> ResponseGuard {
        self.permit = Some(permit);
        self
    }
}

impl Drop for ResponseGuard {
    fn drop(&mut self) {
        if let Some(f) = self.on_done.take() {
            f();
        }
    }
}

/// A response body: nothing, bytes in memory, or a file read in chunks.
pub(crate) struct HttpBody {
    kind: Kind,
    _guard: Option<ResponseGuard>,
}

enum Kind {
    Empty,
    Bytes(Option<Bytes>),
    File {
        file: tokio::fs::File,
        remaining: u64,
        buf: Box<[u8]>,
    },
}

const FILE_CHUNK: usize = 16 * 1024;

impl HttpBody {
    pub(crate) fn empty(guard: Option<ResponseGuard>) -> HttpBody {
        HttpBody {
            kind: Kind::Empty,
            _guard: guard,
        }
    }

    pub(crate) fn bytes(b: impl Into<Bytes>, guard: ResponseGuard) -> HttpBody {
        HttpBody {
            kind: Kind::Bytes(Some(b.into())),
            _guard: Some(guard),
        }
    }

    pub(crate) fn file(file: tokio::fs::File, len: u64, guard: ResponseGuard) -> HttpBody {
        HttpBody {
            kind: Kind::File {
                file,
                remaining: len,
                buf: vec![0u8; FILE_CHUNK.min(len.max(1) as usize)].into_boxed_slice(),
            },
            _guard: Some(guard),
        }
    }
}

impl Body for HttpBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let r = match &mut this.kind {
            Kind::Empty => None,
            Kind::Bytes(b) => b.take().map(|b| Ok(Frame::data(b))),
            Kind::File {
                file,
                remaining,
                buf,
            } => {
                if *remaining == 0 {
                    None
                } else {
                    let want = (*remaining).min(buf.len() as u64) as usize;
                    let mut rb = ReadBuf::new(&mut buf[..want]);
                    match ready!(Pin::new(file).poll_read(cx, &mut rb)) {
                        Err(e) => Some(Err(e)),
                        Ok(()) if rb.filled().is_empty() => Some(Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "file shrank while being served",
                        ))),
                        Ok(()) => {
                            *remaining -= rb.filled().len() as u64;
                            Some(Ok(Frame::data(Bytes::copy_from_slice(rb.filled()))))
                        }
                    }
                }
            }
        };
        if r.is_none() {
            // Done: release the permit and the deadline now, not when hyper drops the body.
            this._guard = None;
        }
        Poll::Ready(r)
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Empty => true,
            Kind::Bytes(b) => b.is_none(),
            Kind::File { remaining, .. } => *remaining == 0,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Empty => SizeHint::with_exact(0),
            Kind::Bytes(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::File { remaining, .. } => SizeHint::with_exact(*remaining),
        }
    }
}

/// A short plain-text response.
pub(crate) fn text(
    status: StatusCode,
    body: impl Into<Bytes>,
    guard: ResponseGuard,
) -> Response<HttpBody> {
    let mut r = Response::new(HttpBody::bytes(body, guard));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// 405 Method Not Allowed for a resource that answers GET and HEAD only.
pub(crate) fn get_or_head_only(guard: ResponseGuard) -> Response<HttpBody> {
    let mut r = text(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed\n",
        guard,
    );
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    r
}

/// HEAD: the same status and headers (Content-Length included), no body.
pub(crate) fn strip(head: bool, mut r: Response<HttpBody>) -> Response<HttpBody> {
    if head {
        let len = r.body().size_hint().exact().unwrap_or(0);
        r.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        let guard = std::mem::replace(r.body_mut(), HttpBody::empty(None))._guard;
        *r.body_mut() = HttpBody::empty(guard);
    }
    r
}

/// Decodes `%XX` escapes; `None` for a malformed escape.
pub(crate) fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = |c: u8| (c as char).to_digit(16);
            let hi = hex(*b.get(i + 1)?)?;
            let lo = hex(*b.get(i + 2)?)?;
            out.push((hi * 16 + lo) as u8);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}
