//! TCP listeners: bind (with `admission::LISTEN_BACKLOG`), accept at most
//! `max_connection_rate` per second (`admission::AcceptRate`), enforce `max_connections`
//! (global and per listener) before
//! anything is allocated for the connection, and hand the socket to `connection::serve`
//! (MQTT over TCP) or `websocket::serve` (a WebSocket listener's HTTP and MQTT over WebSocket).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpSocket};

use crate::admission::{AcceptRate, LISTEN_BACKLOG};

use crate::broker::BrokerState;
use crate::config::{ListenerConfig, ListenerProtocol};
use crate::connection;
use crate::error::Error;
use crate::http::Endpoint;
use crate::proxy_protocol::{ProxyListener, Refused};
use crate::shards::Shards;
use crate::tls::{self, TlsIdentity, TlsListener};
use crate::websocket;

/// Binds every configured listener. Fails on the first that cannot be bound.
pub(crate) async fn bind_all(
    configs: &[ListenerConfig],
) -> Result<Vec<(TcpListener, ListenerConfig)>, Error> {
    let mut bound = Vec::with_capacity(configs.len());
    for cfg in configs {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host(&addr)
            .await
            .map_err(|source| Error::Resolve {
                addr: addr.clone(),
                source,
            })?
            .collect();
        let mut last_err = None;
        let mut listener = None;
        for a in addrs {
            match bind(a, defers_accept(cfg)) {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(e) => last_err = Some(e),
            }
        }
        match listener {
            Some(l) => bound.push((l, cfg.clone())),
            None => {
                let source = last_err.unwrap_or_else(|| {
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no address")
                });
                return Err(Error::Bind { addr, source });
            }
        }
    }
    Ok(bound)
}

/// Whether a listener accepts connections once their first bytes are in: one that speaks
/// MQTT over plain TCP (no TLS, no WebSocket, no PROXY header) and is not paced by
/// `max_connection_rate`. A paced listener keeps clients waiting in the backlog on purpose;
/// deferred, those beyond the accept queue wait as unfinished handshakes whose CONNECT the
/// kernel drops and the client sends again on its own timer, so they come back in bunches
/// rather than in the order the rate serves them.
fn defers_accept(cfg: &ListenerConfig) -> bool {
    matches!(cfg.protocol, ListenerProtocol::Mqtt)
        && cfg.cert_file.is_none()
        && cfg.proxy_protocol.is_none()
        && cfg.max_connection_rate == 0
}

/// A listening socket on `a` with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`, as
/// `TcpListener::bind` sets it); with `defer`, accepting connections once their first bytes
/// are in ([`crate::admission::DEFER_ACCEPT_SECS`], Linux).
fn bind(a: SocketAddr, defer: bool) -> std::io::Result<TcpListener> {
    let socket = if a.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(a)?;
    if defer {
        defer_accept(&socket);
    }
    socket.listen(LISTEN_BACKLOG)
}

/// Sets `TCP_DEFER_ACCEPT` ([`crate::admission::DEFER_ACCEPT_SECS`]) on a listening socket. Without it the
/// listener still works, accepting at the handshake: a failure is only logged.
#[cfg(target_os = "linux")]
fn defer_accept(socket: &TcpSocket) {
    use std::os::fd::AsRawFd;
    let secs = crate::admission::DEFER_ACCEPT_SECS;
    // SAFETY: a plain system call on an open socket, with a pointer to a live c_int and its
    // size.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            std::ptr::from_ref(&secs).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        tracing::debug!(
            "TCP_DEFER_ACCEPT not set: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Elsewhere connections are accepted at the handshake.
#[cfg(not(target_os = "linux"))]
fn defer_accept(_socket: &TcpSocket) {}

/// Accepts connections until the broker stops. `http` is the HTTP side of a WebSocket
/// listener (`None` for MQTT over TCP); with `tls`, each connection first completes a TLS
/// handshake within `connect_timeout`.
pub(crate) async fn run(
    broker: Arc<BrokerState>,
    listener: TcpListener,
    index: usize,
    cfg: ListenerConfig,
    http: Option<Arc<Endpoint>>,
    tls: Option<Arc<TlsListener>>,
) {
    let on_listener = Arc::new(AtomicUsize::new(0));
    let _accepting = Accepting::new(&broker);
    let global_max = broker.config.server.max_connections as usize;
    let listener_max = cfg.max_connections as usize;
    let mut rate = AcceptRate::new(cfg.max_connection_rate, cfg.max_connection_burst);
    let proxy = ProxyListener::new(&cfg, listener.local_addr().ok()).map(Arc::new);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = broker.stop_listeners.notified() => break,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: say so, pause briefly, go on.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        if broker.is_shutting_down() {
            break;
        }
        // Over max_connection_rate: this socket waits its turn before it is served (its
        // connect_timeout has not started), and the next ones wait in the listen backlog.
        if let Some(wait) = rate
            .as_mut()
            .and_then(|r| r.take(tokio::time::Instant::now()))
        {
            broker
                .stats
                .connections_delayed
                .fetch_add(1, Ordering::Relaxed);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = broker.stop_listeners.notified() => break,
            }
            if broker.is_shutting_down() {
                break;
            }
        }
        broker.busy_poll.note();
        // Counted first, then checked, so two listeners accepting at once cannot both take
        // the last slot. Over the limit, the socket is closed as it is: nothing is read and
        // nothing allocated, so no CONNACK 0x97 either (reading a CONNECT to answer it would
        // spend, per refused connection, what the limit is there to save).
        let full = || {
            let open = broker.open_connections.load(Ordering::Relaxed);
            if global_max > 0 && open >= global_max {
                Some(global_max)
            } else if listener_max > 0 && on_listener.load(Ordering::Relaxed) >= listener_max {
                Some(listener_max)
            } else {
                None
            }
        };
        if full().is_some() && !slot_frees(&broker, || full().is_none()).await {
            tracing::warn!(%peer, max_connections = full().unwrap_or(0), "connection refused: max_connections reached");
            continue;
        }
        let open = broker.open_connections.fetch_add(1, Ordering::Relaxed);
        if global_max > 0 && open >= global_max {
            broker.open_connections.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!(%peer, max_connections = global_max, "connection refused: max_connections reached");
            continue;
        }
        let _ = stream.set_nodelay(true);
        on_listener.fetch_add(1, Ordering::Relaxed);
        // Given back when the connection closes, by whichever task serves it then (a plain
        // TCP connection's task ends while it is parked).
        let slot = connection::Slot::new(Arc::clone(&broker), Arc::clone(&on_listener));
        let accepted = || Accepted {
            http: http.clone(),
            tls: tls.clone(),
            proxy: proxy.clone(),
            use_identity_as_username: cfg.use_identity_as_username,
            index,
        };
        // More than one shard: the connection is served on the one `Shards::place` picks,
        // its socket registered with that shard's event loop.
        if let Some(shards) = &broker.shards {
            let k = shards.place();
            if Shards::current() != Some(k) {
                let socket = match stream.into_std() {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(%peer, "cannot hand a connection to a shard: {e}");
                        continue;
                    }
                };
                let accepted = accepted();
                shards.spawn(k, async move {
                    match tokio::net::TcpStream::from_std(socket) {
                        Ok(stream) => accepted.serve(slot, stream, peer).await,
                        Err(e) => tracing::debug!(%peer, "cannot serve a connection: {e}"),
                    }
                });
                continue;
            }
        }
        // A task is as large as its future: a plain MQTT connection, idle most of its life,
        // gets a task of its own kind; the others share one whose TLS and WebSocket branches
        // (TLS state, HTTP) are boxed.
        if tls.is_none() && http.is_none() && proxy.is_none() {
            tokio::spawn(connection::serve_tcp(slot, stream, peer, None, index));
            continue;
        }
        tokio::spawn(accepted().serve_other(slot, stream, peer));
    }
}

/// What serving an accepted socket takes from its listener.
struct Accepted {
    http: Option<Arc<Endpoint>>,
    tls: Option<Arc<TlsListener>>,
    proxy: Option<Arc<ProxyListener>>,
    use_identity_as_username: bool,
    index: usize,
}

impl Accepted {
    /// Serves the socket, as the listener's loop would have in its own runtime.
    async fn serve(self, slot: connection::Slot, stream: tokio::net::TcpStream, peer: SocketAddr) {
        if self.tls.is_none() && self.http.is_none() && self.proxy.is_none() {
            connection::serve_tcp(slot, stream, peer, None, self.index).await
        } else {
            Box::pin(self.serve_other(slot, stream, peer)).await
        }
    }

    /// Serves a socket of a TLS, WebSocket or PROXY protocol listener.
    async fn serve_other(
        self,
        slot: connection::Slot,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
    ) {
        let Accepted {
            http,
            tls,
            proxy,
            use_identity_as_username,
            index,
        } = self;
        // The PROXY header, the TLS handshake and CONNECT share one connect_timeout,
        // counted from the task's start (on a plain TCP listener, CONNECT gets its own
        // after the header: `serve_tcp` counts it). Plain TCP connections without a
        // PROXY header never come here: their task does not hold these.
        let deadline = tokio::time::Instant::now()
            + std::time::Duration::from_secs(slot.broker.config.server.connect_timeout);
        let mut stream = stream;
        let mut peer = peer;
        let mut balancer_identity = None;
        if let Some(proxy) = &proxy {
            match Box::pin(proxy.read(&mut stream, peer, deadline)).await {
                Ok(header) => {
                    let header = header.unwrap_or_default();
                    if let Some(source) = header.source {
                        tracing::debug!(balancer = %peer, client = %source, "PROXY header");
                        peer = source;
                    }
                    // TLS terminated at the balancer: the certificate it verified.
                    if use_identity_as_username && tls.is_none() {
                        balancer_identity = Some(TlsIdentity {
                            certificate_cn: header.ssl_cn,
                            use_as_username: true,
                        });
                    }
                }
                Err(Refused::Quiet) => return,
                Err(Refused::Warn(why)) => {
                    proxy.warn(&why);
                    return;
                }
            }
        }
        match (tls, http) {
            (None, None) => {
                connection::serve_tcp(slot, stream, peer, balancer_identity, index).await
            }
            (None, Some(ep)) => {
                Box::pin(websocket::serve(ep, stream, peer)).await;
                drop(slot);
            }
            (Some(tls), None) => {
                let broker = &slot.broker;
                Box::pin(async {
                    if let Some((stream, identity)) =
                        tls::handshake(&tls, stream, peer, deadline).await
                    {
                        connection::serve_with(
                            Arc::clone(broker),
                            stream,
                            peer,
                            Some(identity),
                            deadline,
                            index,
                        )
                        .await
                    }
                })
                .await;
                drop(slot);
            }
            (Some(tls), Some(ep)) => {
                Box::pin(async {
                    if let Some((stream, _identity)) =
                        tls::handshake(&tls, stream, peer, deadline).await
                    {
                        websocket::serve(ep, stream, peer).await
                    }
                })
                .await;
                drop(slot);
            }
        }
    }
}

/// Counts a listener's accept loop in `BrokerState::listeners_accepting` while it runs.
struct Accepting(Arc<BrokerState>);

impl Accepting {
    fn new(broker: &Arc<BrokerState>) -> Accepting {
        broker.listeners_accepting.fetch_add(1, Ordering::Relaxed);
        Accepting(Arc::clone(broker))
    }
}

impl Drop for Accepting {
    fn drop(&mut self) {
        self.0.listeners_accepting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a connection over `max_connections` waits for a slot before it is refused.
const SLOT_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// Waits up to [`SLOT_GRACE`] for `free()` to hold. A client that closes its connections and
/// opens new ones at once (as test suites and reconnecting fleets do) can be accepted before
/// the tasks of the closed ones have seen their end: those slots are freed within moments.
async fn slot_frees(broker: &BrokerState, free: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + SLOT_GRACE;
    loop {
        let closed = broker.connection_closed.notified();
        tokio::pin!(closed);
        closed.as_mut().enable();
        if free() {
            return true;
        }
        if tokio::time::timeout_at(deadline, closed).await.is_err() {
            return free();
        }
    }
}
