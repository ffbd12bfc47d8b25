//! `protocol = "websocket"` listeners: HTTP/1.1 through hyper on each accepted socket, the
//! WebSocket upgrade for the `mqtt` subprotocol, and plain HTTP requests answered by
//! [`http::Endpoint`](crate::http::Endpoint).
//!
//! After the upgrade the socket becomes a tokio-tungstenite stream, and [`WsIo`] turns its
//! binary frames back into a byte stream for `connection::serve`, which then runs exactly as it
//! does over TCP, for every protocol version: an MQTT packet may span frames and a frame may
//! hold several packets. A text frame closes the connection (close code 1003).
//!
//! Limits: the request head is read within `connect_timeout` and may be at most
//! [`HttpLimits::max_head`](crate::HttpLimits) bytes (431 otherwise); after the upgrade, CONNECT
//! must come within `connect_timeout` as over TCP. The listener's `max_connections` is applied
//! when the socket is accepted (`listener.rs`). Buffers stay small: hyper's read buffer starts
//! at 8 KiB and is handed over with the upgrade, tungstenite's is 4 KiB and its write buffer
//! is flushed at every message (the connection's writer already coalesces).

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use futures_util::{Sink, Stream};
use hyper::header::{self, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::upgrade::OnUpgrade;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use crate::connection;
use crate::http::Endpoint;
use crate::http_response::{self, HttpBody, ResponseGuard};

/// The WebSocket subprotocol of MQTT 3.1.1 and 5.0 (section 6 of both), chosen whenever the
/// client offers it [MQTT-6.0.0-4].
pub const SUBPROTOCOL: &str = "mqtt";

/// The informal subprotocol of MQTT 3.1 over WebSocket, still offered alone by older clients
/// (Paho JavaScript with MQTT 3.1, old MQTT.js): accepted, and echoed, when `mqtt` is not
/// offered, as mosquitto, RabbitMQ and aedes do.
pub const SUBPROTOCOL_V31: &str = "mqttv3.1";

/// tungstenite's read buffer per connection (its default is 128 KiB).
const WS_READ_BUFFER: usize = 4 * 1024;

/// Serves one accepted socket of a WebSocket listener until it closes.
pub(crate) async fn serve<S>(ep: Arc<Endpoint>, stream: S, peer: SocketAddr)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let broker = Arc::clone(&ep.broker);
    let connect_timeout = Duration::from_secs(broker.config.server.connect_timeout.max(1));
    // The upgrade of an accepted WebSocket handshake, taken over once hyper lets go.
    let upgrade: Arc<Mutex<Option<OnUpgrade>>> = Arc::new(Mutex::new(None));
    // The deadline of the response in progress (HTTP/1.1 answers one request at a time).
    let (deadline_tx, mut deadline_rx) = watch::channel(None::<Instant>);
    let deadline_tx = Arc::new(deadline_tx);

    // Whether a request is under way: bytes of it read, its response not yet sent.
    let in_request = Arc::new(AtomicBool::new(false));

    let service = {
        let ep = Arc::clone(&ep);
        let upgrade = Arc::clone(&upgrade);
        let in_request = Arc::clone(&in_request);
        service_fn(move |mut req: Request<hyper::body::Incoming>| {
            let ep = Arc::clone(&ep);
            let upgrade = Arc::clone(&upgrade);
            let deadline_tx = Arc::clone(&deadline_tx);
            let in_request = Arc::clone(&in_request);
            async move {
                deadline_tx.send_replace(Some(Instant::now() + ep.limits.response_timeout));
                let guard = ResponseGuard::new(move || {
                    deadline_tx.send_replace(None);
                    in_request.store(false, Ordering::Relaxed);
                });
                let mut r = if is_upgrade(&req) {
                    handshake(&ep, &mut req, &upgrade, guard)
                } else if ep.serves_admin(req.uri().path()) {
                    ep.respond_admin(req, peer, guard).await
                } else {
                    ep.respond(&req, guard).await
                };
                if ep.broker.is_shutting_down() {
                    // The last response on this connection.
                    r.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(r)
            }
        })
    };

    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(connect_timeout)
        .max_buf_size(ep.limits.max_head)
        .keep_alive(true);
    let conn = builder
        .serve_connection(
            TokioIo::new(Tracked {
                inner: stream,
                in_request: Arc::clone(&in_request),
            }),
            service,
        )
        .with_upgrades();
    tokio::pin!(conn);

    // When the broker starts stopping, an idle connection is closed at once; a request under
    // way is answered (503 for /healthz) with `Connection: close`.
    let stop = broker.stop_listeners.notified();
    tokio::pin!(stop);
    stop.as_mut().enable();
    let mut stopping = broker.is_shutting_down();
    let mut deadline: Option<Instant> = None;
    loop {
        let sleep = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now));
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%peer, "HTTP connection: {e}");
                }
                break;
            }
            _ = stop.as_mut(), if !stopping => {
                stopping = true;
                if !in_request.load(Ordering::Relaxed) {
                    return;
                }
            }
            changed = deadline_rx.changed() => {
                if changed.is_err() {
                    deadline = None;
                } else {
                    deadline = *deadline_rx.borrow_and_update();
                }
            }
            _ = sleep, if deadline.is_some() => {
                tracing::debug!(%peer, "HTTP response not sent within {:?}: closing", ep.limits.response_timeout);
                return;
            }
        }
    }

    let pending = upgrade.lock().take();
    if let Some(on_upgrade) = pending {
        match on_upgrade.await {
            Ok(upgraded) => {
                let max = broker.config.server.max_packet_size as usize;
                let config = WebSocketConfig::default()
                    .read_buffer_size(WS_READ_BUFFER)
                    .write_buffer_size(0)
                    .max_frame_size(Some(max.saturating_add(16 * 1024)))
                    .max_message_size(Some(max.saturating_add(16 * 1024)));
                let ws = WebSocketStream::from_raw_socket(
                    TokioIo::new(upgraded),
                    Role::Server,
                    Some(config),
                )
                .await;
                connection::serve(Arc::clone(&broker), WsIo::new(ws), peer, ep.listener).await;
            }
            Err(e) => tracing::debug!(%peer, "WebSocket upgrade failed: {e}"),
        }
    }
}

/// Whether the request asks for a WebSocket upgrade (`Upgrade: websocket`).
fn is_upgrade<B>(req: &Request<B>) -> bool {
    req.headers()
        .get_all(header::UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("websocket"))
}

fn header_has_token<B>(req: &Request<B>, name: header::HeaderName, token: &str) -> bool {
    req.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Checks a WebSocket handshake (RFC 6455 section 4.2.1) and answers 101 with the `mqtt`
/// subprotocol, or refuses it: 405 for a method other than GET, 426 for a WebSocket version
/// other than 13, 400 without a key or without the `mqtt` subprotocol, 503 while stopping.
fn handshake(
    ep: &Endpoint,
    req: &mut Request<hyper::body::Incoming>,
    slot: &Mutex<Option<OnUpgrade>>,
    guard: ResponseGuard,
) -> Response<HttpBody> {
    if req.method() != Method::GET {
        let mut r = http_response::text(
            StatusCode::METHOD_NOT_ALLOWED,
            "a WebSocket handshake is a GET\n",
            guard,
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if ep.broker.is_shutting_down() {
        return http_response::text(StatusCode::SERVICE_UNAVAILABLE, "stopping\n", guard);
    }
    let version_ok = req
        .headers()
        .get(header::SEC_WEBSOCKET_VERSION)
        .is_some_and(|v| v.as_bytes() == b"13");
    if !version_ok {
        let mut r = http_response::text(
            StatusCode::UPGRADE_REQUIRED,
            "WebSocket version 13 required\n",
            guard,
        );
        r.headers_mut().insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
        return r;
    }
    let Some(key) = req.headers().get(header::SEC_WEBSOCKET_KEY).cloned() else {
        return http_response::text(
            StatusCode::BAD_REQUEST,
            "Sec-WebSocket-Key missing\n",
            guard,
        );
    };
    if !header_has_token(req, header::CONNECTION, "upgrade") {
        return http_response::text(
            StatusCode::BAD_REQUEST,
            "Connection: Upgrade missing\n",
            guard,
        );
    }
    // Subprotocol names are case-sensitive tokens (RFC 6455 section 4.1).
    let offered = |name: &str| {
        req.headers()
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim() == name)
    };
    let selected = if offered(SUBPROTOCOL) {
        SUBPROTOCOL
    } else if offered(SUBPROTOCOL_V31) {
        SUBPROTOCOL_V31
    } else {
        tracing::debug!("WebSocket upgrade without the mqtt subprotocol: 400");
        return http_response::text(
            StatusCode::BAD_REQUEST,
            "the WebSocket subprotocol \"mqtt\" is required\n",
            guard,
        );
    };
    *slot.lock() = Some(hyper::upgrade::on(req));
    let mut r = Response::new(HttpBody::empty(Some(guard)));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(
        header::SEC_WEBSOCKET_ACCEPT,
        HeaderValue::from_str(&derive_accept_key(key.as_bytes()))
            .expect("base64 is a valid header value"),
    );
    h.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(selected),
    );
    r
}

/// A WebSocket stream as a byte stream: binary frames in, one binary frame per write out.
pub(crate) struct WsIo<S> {
    ws: WebSocketStream<S>,
    /// What is left of the last binary frame read.
    pending: Bytes,
    /// Bytes of the last write handed to tungstenite but not yet flushed (reported once flushed).
    unflushed: usize,
    eof: bool,
}

impl<S> WsIo<S> {
    pub(crate) fn new(ws: WebSocketStream<S>) -> WsIo<S> {
        WsIo {
            ws,
            pending: Bytes::new(),
            unflushed: 0,
            eof: false,
        }
    }
}

fn io_err(e: WsError) -> io::Error {
    match e {
        WsError::Io(e) => e,
        WsError::ConnectionClosed | WsError::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "WebSocket closed")
        }
        e => io::Error::new(io::ErrorKind::InvalidData, e),
    }
}

/// A WebSocket connection keeps its task: its framing state lives in the stream.
impl<S> crate::parking::Park for WsIo<S> {}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending[..n]);
                this.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut this.ws).poll_next(cx)) {
                None | Some(Ok(Message::Close(_))) => {
                    this.eof = true;
                }
                Some(Ok(Message::Binary(b))) => this.pending = b,
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Text(_))) => {
                    // MQTT travels in binary frames only: close with 1003 (unsupported data).
                    let frame = CloseFrame {
                        code: CloseCode::Unsupported,
                        reason: "MQTT over WebSocket uses binary frames".into(),
                    };
                    let mut ws = Pin::new(&mut this.ws);
                    if let Poll::Ready(Ok(())) = ws.as_mut().poll_ready(cx) {
                        let _ = ws.as_mut().start_send(Message::Close(Some(frame)));
                        let _ = ws.as_mut().poll_flush(cx);
                    }
                    this.eof = true;
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "text frame on an MQTT WebSocket",
                    )));
                }
                Some(Err(e)) => return Poll::Ready(Err(io_err(e))),
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsIo<S> {
    /// Sends `buf` as one binary frame and reports it written once flushed to the socket, so
    /// nothing is left in tungstenite's buffer when the connection's writer goes back to
    /// waiting for its queue.
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let mut ws = Pin::new(&mut this.ws);
        if this.unflushed == 0 {
            if buf.is_empty() {
                return Poll::Ready(Ok(0));
            }
            ready!(ws.as_mut().poll_ready(cx)).map_err(io_err)?;
            ws.as_mut()
                .start_send(Message::Binary(Bytes::copy_from_slice(buf)))
                .map_err(io_err)?;
            this.unflushed = buf.len();
        }
        let flushed = ready!(ws.poll_flush(cx));
        let n = std::mem::take(&mut this.unflushed);
        flushed.map_err(io_err)?;
        Poll::Ready(Ok(n.min(buf.len())))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().ws)
            .poll_flush(cx)
            .map_err(io_err)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match ready!(Pin::new(&mut self.get_mut().ws).poll_close(cx)) {
            Ok(()) | Err(WsError::ConnectionClosed | WsError::AlreadyClosed) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(io_err(e))),
        }
    }
}

/// The accepted socket, noting when a request's first bytes arrive (see `serve`).
struct Tracked<S> {
    inner: S,
    in_request: Arc<AtomicBool>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            this.in_request.store(true, Ordering::Relaxed);
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
