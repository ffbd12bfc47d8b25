//! One network connection: the CONNECT handshake, then a reader and a writer running side by
//! side in the connection's task.
//!
//! The reader decodes packets and runs the inbound state machines (MQTT 5.0 section 4.3);
//! what it answers (PUBACK, SUBACK, ...) is encoded into the link's control buffer. The writer
//! sleeps until woken, then drains the control buffer and the session's queue into one buffer
//! and one write (one system call for many messages is what keeps a busy broker fast).

mod connect;
pub(crate) mod park;
mod rate;
mod reader;
mod writer;

use crate::parking::Park;
pub(crate) use park::Slot;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::broker::BrokerState;
use crate::codec::{self, Disconnect, Packet, Properties, ProtocolVersion, ReasonCode};
use crate::events::Event;
use crate::link::{DisconnectReason, Link};
use crate::session::Session;
use crate::stats::Counters;
use crate::tls::TlsIdentity;
use connect::{accept, read_connect, Accepted, AuthChannel, ConnectError};
use reader::Reader;
use writer::Writer;

/// Topic aliases a client may use towards the broker (CONNACK Topic Alias Maximum).
pub const TOPIC_ALIAS_MAXIMUM: u16 = 10;
/// A read buffer larger than this is released once empty, so idle connections stay small.
pub(super) const IDLE_BUFFER_LIMIT: usize = 16 * 1024;
/// How long the final packets (DISCONNECT, a refused CONNACK) may take to be written.
const FINAL_WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// How the connection ends: why, what to send first, whether the will goes out.
#[derive(Debug)]
pub(super) struct Close {
    pub(super) reason: DisconnectReason,
    /// A 5.0 DISCONNECT to send before closing.
    pub(super) send: Option<ReasonCode>,
    pub(super) publish_will: bool,
}

impl Close {
    pub(super) fn lost(reason: DisconnectReason) -> Close {
        Close {
            reason,
            send: None,
            publish_will: true,
        }
    }

    /// A protocol violation: 5.0 clients get DISCONNECT with `rc` [MQTT-4.13.1-1].
    pub(super) fn violation(rc: ReasonCode, why: &str, client_id: &str) -> Close {
        tracing::info!(client_id, reason = %rc, "closing connection: {why}");
        Close {
            reason: DisconnectReason::ProtocolViolation(rc),
            send: Some(rc),
            publish_will: true,
        }
    }
}

/// Serves one accepted connection until it closes. Generic over the stream so TCP, TLS and
/// WebSocket listeners share it.
/// `listener` is the index of its listener in `config.listeners` (its `mount_point` and
/// authentication settings).
pub(crate) fn serve<S>(
    broker: Arc<BrokerState>,
    stream: S,
    peer: SocketAddr,
    listener: usize,
) -> impl std::future::Future<Output = ()> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send + Park,
{
    // Not an `async fn`: its future would hold its arguments beside `serve_with`'s.
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(broker.config.server.connect_timeout);
    serve_with(broker, stream, peer, None, deadline, listener)
}

/// [`serve`], with what a TLS handshake told about the client and the instant by which
/// CONNECT must have arrived (`connect_timeout` after the socket was accepted: the TLS
/// handshake and CONNECT share it).
pub(crate) fn serve_with<S>(
    broker: Arc<BrokerState>,
    stream: S,
    peer: SocketAddr,
    tls: Option<TlsIdentity>,
    connect_deadline: tokio::time::Instant,
    listener: usize,
) -> impl std::future::Future<Output = ()> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send + Park,
{
    // A future is as large as the largest state it can be in, and the connection's task holds
    // its own for the connection's whole life, idle ones too: so each phase is boxed, and
    // the task holds only the box of the phase running now. Idle, that is `run`'s. (Not an
    // `async fn`: its future would keep room for its arguments.)
    let handshake = Box::pin(handshake(
        broker,
        stream,
        peer,
        tls,
        connect_deadline,
        listener,
    ));
    async move {
        // The connection is moved into its box within the one statement: held past it, it
        // would take room in this future too.
        let running = match handshake.await {
            Some(c) => Box::pin(run(c, false)),
            None => return,
        };
        // Never parked: only `serve_tcp` lets a connection park (it has the slot to keep).
        if let Some(p) = running.await {
            let close = Close::lost(DisconnectReason::Io("cannot park".into()));
            detach(&p.shared, p.peer(), &close);
        }
    }
}

/// [`serve`] for a plain TCP connection, which parks when idle (`park`): `slot`, its place
/// in the connection counts, goes with it. `tls`: what a load balancer that terminated TLS
/// said of the client certificate (PROXY protocol version 2, `proxy_protocol`).
pub(crate) fn serve_tcp(
    slot: Slot,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    tls: Option<TlsIdentity>,
    listener: usize,
) -> impl std::future::Future<Output = ()> + Send {
    let broker = Arc::clone(&slot.broker);
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(broker.config.server.connect_timeout);
    let handshake = Box::pin(handshake(broker, stream, peer, tls, deadline, listener));
    async move {
        let running = match handshake.await {
            Some(c) => Box::pin(run(c, true)),
            None => return,
        };
        if let Some(p) = running.await {
            park::park_or_resume(p, slot);
        }
    }
}

pub(super) use crate::lazy_map::LazyMap;

/// A connection past its CONNACK: what its reader, its writer and its close share.
struct Connected<S> {
    /// What the reader and the writer both refer to, once (one reference each).
    shared: Shared,
    /// Both halves of the stream are used in the connection's task (`Half`).
    stream: parking_lot::Mutex<S>,
    /// The read buffer, with what the client sent after its CONNECT.
    buf: BytesMut,
    peer: SocketAddr,
    /// Served again after a park: the reader's and the writer's topic alias tables (one
    /// pointer: only resumed connections have it).
    resumed: Option<Box<park::Aliases>>,
}

/// What a connection's reader and writer share, fixed for the connection's life. Each holds
/// one reference to it: an idle connection's state holds these once, not once per half.
struct Shared {
    broker: Arc<BrokerState>,
    session: Arc<Session>,
    link: Arc<Link>,
    /// The index of the connection's listener in `config.listeners` (its `mount_point`);
    /// a `u32` packs with the fields below (a listener index never comes near its limit).
    listener: u32,
    limits: writer::ClientLimits,
    version: ProtocolVersion,
    /// The client announced itself as a bridge (mosquitto's `try_private`): its
    /// subscriptions get No Local and Retain As Published, as mosquitto gives them.
    bridge: bool,
    keep_alive: u16,
}

/// The handshake's [`AuthChannel`]: AUTH packets written to and read from the stream before
/// the CONNACK.
struct HandshakeAuth<'a, S> {
    stream: &'a mut S,
    buf: &'a mut BytesMut,
    max_packet_size: u32,
    stats: &'a Counters,
}

#[async_trait::async_trait]
impl<S: AsyncRead + AsyncWrite + Unpin + Send> AuthChannel for HandshakeAuth<'_, S> {
    async fn exchange(
        &mut self,
        method: &str,
        data: bytes::Bytes,
    ) -> Result<Option<bytes::Bytes>, (ReasonCode, String)> {
        let auth = Packet::Auth(codec::Auth {
            reason_code: ReasonCode::CONTINUE_AUTHENTICATION,
            properties: Properties {
                authentication_method: Some(method.to_string()),
                authentication_data: Some(data),
                ..Properties::default()
            },
        });
        let mut out = BytesMut::new();
        codec::encode(&auth, ProtocolVersion::V5, &mut out).map_err(|e| {
            (
                ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR,
                format!("cannot encode AUTH: {e}"),
            )
        })?;
        let lost = |e: std::io::Error| {
            (
                ReasonCode::UNSPECIFIED_ERROR,
                format!("connection lost during authentication: {e}"),
            )
        };
        self.stream.write_all(&out).await.map_err(lost)?;
        Counters::add(&self.stats.bytes_sent, out.len() as u64);
        loop {
            match codec::decode(self.buf, ProtocolVersion::V5, self.max_packet_size) {
                Ok(Some(Packet::Auth(a))) => {
                    // The client answers with Continue authentication and the same method
                    // (MQTT 5.0 section 4.12, [MQTT-4.12.0-4]).
                    if a.reason_code != ReasonCode::CONTINUE_AUTHENTICATION
                        || a.properties.authentication_method.as_deref() != Some(method)
                    {
                        return Err((
                            ReasonCode::PROTOCOL_ERROR,
                            "AUTH without Continue authentication and the same method".into(),
                        ));
                    }
                    return Ok(a.properties.authentication_data);
                }
                Ok(Some(other)) => {
                    return Err((
                        ReasonCode::PROTOCOL_ERROR,
                        format!("{} during authentication [MQTT-4.12.0-5]", other.name()),
                    ))
                }
                Ok(None) => {}
                Err(e) => return Err((e.reason_code(), format!("bad AUTH: {e}"))),
            }
            match self.stream.read_buf(self.buf).await {
                Ok(0) => {
                    return Err((
                        ReasonCode::UNSPECIFIED_ERROR,
                        "closed during authentication".into(),
                    ))
                }
                Ok(n) => Counters::add(&self.stats.bytes_received, n as u64),
                Err(e) => return Err(lost(e)),
            }
        }
    }
}

impl Shared {
    /// The listener's `mount_point`: prefixed to every topic and filter the client sends,
    /// removed from the topics delivered. (Looked up, not kept: a reference into the
    /// configuration would borrow from the broker held beside it.)
    fn mount(&self) -> Option<&str> {
        self.broker
            .config
            .listeners
            .get(self.listener as usize)
            .and_then(|l| l.mount_point.as_deref())
    }
}

/// CONNECT within the deadline, its checks, the session, the CONNACK. `None` when the
/// connection closed or was refused.
async fn handshake<S>(
    broker: Arc<BrokerState>,
    mut stream: S,
    peer: SocketAddr,
    tls: Option<TlsIdentity>,
    connect_deadline: tokio::time::Instant,
    listener: usize,
) -> Option<Connected<S>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut buf = BytesMut::with_capacity(256);
    let server = &broker.config.server;

    // 1. CONNECT, within connect_timeout.
    let (connect, bridge) = match tokio::time::timeout_at(
        connect_deadline,
        read_connect(&mut stream, &mut buf, server.max_packet_size, &broker.stats),
    )
    .await
    {
        Err(_) => {
            tracing::info!(%peer, "no CONNECT within connect_timeout: closing");
            return None;
        }
        Ok(Err(ConnectError::Closed)) => return None,
        Ok(Err(ConnectError::Refuse(bytes, why))) => {
            tracing::info!(%peer, "refusing connection: {why}");
            let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, stream.write_all(&bytes)).await;
            return None;
        }
        Ok(Ok(connect)) => connect,
    };

    // 2. Checks, session, CONNACK. `accept` takes the packet's box and frees it.
    let mut channel = HandshakeAuth {
        stream: &mut stream,
        buf: &mut buf,
        max_packet_size: server.max_packet_size,
        stats: &broker.stats,
    };
    let accepted = Box::pin(accept(
        &broker,
        connect,
        peer,
        tls,
        connect_deadline,
        listener,
        &mut channel,
    ))
    .await;
    let accepted = match accepted {
        Ok(a) => a,
        Err(connack) => {
            let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, stream.write_all(&connack)).await;
            return None;
        }
    };
    let Accepted {
        session,
        link,
        version,
        keep_alive,
        client_limits,
        connack,
        auth_method,
    } = accepted;
    session.state.lock().set_remote_bridge(bridge);
    if let Some(method) = auth_method {
        link.set_auth_method(method);
    }
    broker.stats.client_connected();
    if let Err(e) = stream.write_all(&connack).await {
        tracing::debug!(client_id = %session.client_id, "cannot send CONNACK: {e}");
    }
    Counters::add(&broker.stats.bytes_sent, connack.len() as u64);
    if broker.config.logging.connection_messages {
        tracing::info!(target: "mercurio::connections", client_id = %session.client_id, %peer, protocol = version.level(), keep_alive, "client connected");
    }
    Some(Connected {
        shared: Shared {
            broker,
            session,
            link,
            listener: u32::try_from(listener).unwrap_or(u32::MAX),
            limits: client_limits,
            version,
            bridge,
            keep_alive,
        },
        stream: parking_lot::Mutex::new(stream),
        buf,
        peer,
        resumed: None,
    })
}

/// The reader and the writer side by side, until one ends or the broker asks the connection
/// to close; then the close. Or, with `parks` and a stream that can park (`Park`), once the
/// connection has been idle for `park_after`, what is left of it to park.
// Not an `async fn`: an `async fn` moves its arguments into locals of its body, and its
// future keeps room for both (the connection twice); an `async move` block uses its capture
// in place.
#[allow(clippy::manual_async_fn)] // the point: see above
fn run<S>(
    mut c: Connected<S>,
    parks: bool,
) -> impl std::future::Future<Output = Option<park::Parked>> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send + Park,
{
    async move {
        let kept = {
            let shared = &c.shared;
            let (mut rd, mut wr) = (Half(&c.stream), Half(&c.stream));
            // 3. Reader and writer, until one ends or the broker asks the connection to close.
            // Made in a block: its locals, in scope at a wait, would take room in this future
            // (which every connection holds), moved from or not.
            let (mut reader, mut writer, may_park, fresh) = {
                let resumed = c.resumed.take().map(|a| *a);
                // Parks only where it can (see `run`'s doc), when the broker has it on.
                let parking = (parks && S::PARKS)
                    .then(|| park::parking_of(&shared.broker))
                    .flatten();
                if shared.broker.shards.is_some() {
                    crate::shards::Shards::serving(&shared.link);
                }
                if shared.link.serving(resumed.is_some()) {
                    if let Some(parking) = parking {
                        parking.watch(&shared.link);
                    }
                }
                let fresh = resumed.is_none();
                let aliases = resumed.unwrap_or_default();
                let reader = Reader {
                    c: shared,
                    aliases: aliases.inbound,
                    congested: Vec::new(),
                    memory_congested: false,
                    rate: rate::PublishRate::of(&shared.broker.config.server),
                    reauth: None,
                };
                let writer = Writer {
                    c: shared,
                    aliases: aliases.outbound,
                    scratch: None,
                    out: BytesMut::new(),
                };
                (reader, writer, parking.is_some(), fresh)
            };
            let link = &shared.link;
            link.wake();
            // `Err`: the connection parks, with its keep alive deadline (the read's end
            // disarms it: put back once the read is dropped, at the end of the block below).
            let close = {
                let read = reader.run(&mut rd, &mut c.buf);
                tokio::pin!(read);
                let mut killed = false;
                let mut write_failed = false;
                // In this order: `idle` looks at where the reader and the writer rest, so it
                // comes after both in every pass (it registers no waker for their moves).
                let close = tokio::select! {
                    biased;
                    c = &mut read => Ok(c),
                    c = writer.run(&mut wr) => {
                        write_failed = true;
                        Ok(c)
                    }
                    _ = link.wait_killed() => {
                        killed = true;
                        let (reason, rc) = link.take_kill_reason().unwrap_or((DisconnectReason::Administrative, ReasonCode::ADMINISTRATIVE_ACTION));
                        Ok(Close { reason, send: Some(rc), publish_will: true })
                    }
                    _ = idle(link, fresh), if may_park => Err(link.keep_alive_at())
                };
                match close {
                    Err(at) => Err(at),
                    Ok(close) if write_failed => {
                        // The client closed without reading what we sent last (mosquitto_sub
                        // -C does), but what it sent before closing is still to be read: its
                        // PUBACKs, applied, and its DISCONNECT, which discards the will
                        // [MQTT-3.14.4-3]. The reader's verdict wins when it reaches the end of
                        // the input in time. Boxed, as below: rare, and a timer is large.
                        match Box::pin(tokio::time::timeout(LAST_READ, &mut read)).await {
                            Ok(c) => Ok(c),
                            Err(_) => Ok(close),
                        }
                    }
                    Ok(close) => {
                        // At shutdown, what the client sent just before is still handled: a
                        // PUBACK on its way is applied (and stored), not answered by a
                        // redelivery after the restart.
                        if killed && matches!(close.reason, DisconnectReason::Shutdown) {
                            let _ = Box::pin(tokio::time::timeout(LAST_READ, &mut read)).await;
                        }
                        Ok(close)
                    }
                }
            };
            match close {
                Ok(close) => {
                    let last = std::mem::take(&mut writer.out);
                    drop((reader, writer));
                    Box::pin(finish(shared, &mut rd, c.peer, close, last)).await;
                    return None;
                }
                Err(at) => {
                    link.restore_keep_alive(at);
                    // Not at rest while parked: the sweep would ask again, and its signal,
                    // through the parked connection's waker, would resume it.
                    link.set_rest(
                        crate::link::READER_AT_REST | crate::link::WRITER_AT_REST,
                        false,
                    );
                    park::Aliases {
                        inbound: std::mem::take(&mut reader.aliases),
                        outbound: std::mem::take(&mut writer.aliases),
                    }
                }
            }
        };
        // Parking: nothing is in flight (`idle`), so the stream and what the halves keep
        // are all there is.
        if c.shared.broker.shards.is_some() {
            crate::shards::Shards::not_serving(&c.shared.link);
        }
        let Connected {
            shared,
            stream,
            peer,
            ..
        } = c;
        match stream.into_inner().into_parked() {
            Some(stream) => Some(park::Parked {
                stream,
                shared,
                aliases: kept,
            }),
            None => {
                let close = Close::lost(DisconnectReason::Io("cannot park".into()));
                detach(&shared, peer, &close);
                None
            }
        }
    }
}

/// Resolves once the connection may park: when it is at rest (both halves wait with nothing
/// in hand) and either the parking's sweep found it idle (nothing read or written for
/// `park_after`: no timer of its own, the sweep asks through the link) or it is `fresh`, a
/// new connection that has not rested yet. A new connection parks as soon as it has answered
/// its CONNECT and what came with it: at a reconnect storm (a fleet coming back after a
/// restart or a network cut) the memory of a serving task is taken one connection at a time
/// and given back for the next, instead of by every connection at once until the sweep.
fn idle(link: &Link, fresh: bool) -> impl std::future::Future<Output = ()> + '_ {
    std::future::poll_fn(move |cx| {
        // Taken whatever comes next: an ask found not at rest waits for the next one.
        let asked = link.poll_park(cx).is_ready();
        if (asked || fresh) && link.at_rest() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
}

/// The close (step 4): the final bytes (what an interrupted write left, never half a packet
/// before the DISCONNECT; what the reader answered last; a DISCONNECT for 5.0 clients), the
/// session detached, then, after a DISCONNECT, the linger.
async fn finish<S>(
    shared: &Shared,
    rw: &mut Half<'_, S>,
    peer: SocketAddr,
    close: Close,
    mut last: BytesMut,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let Shared { link, version, .. } = shared;
    let version = *version;
    last.extend_from_slice(&link.take_control());
    if let (Some(rc), true) = (close.send, version.is_v5()) {
        let d = Packet::Disconnect(Disconnect {
            reason_code: rc,
            properties: Properties::default(),
        });
        let _ = codec::encode(&d, version, &mut last);
    }
    // A close the server decides ends the sending side at once, even with nothing left to
    // write (a 3.1.1 client taken over has no DISCONNECT): the client sees the close now,
    // not once the linger below is over.
    if !last.is_empty() || close.send.is_some() {
        let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, async {
            rw.write_all(&last).await?;
            rw.shutdown().await
        })
        .await;
    }
    detach(shared, peer, &close);
    if close.send.is_some() {
        linger(rw).await;
    }
}

/// The session detached from a closed connection (the will published, unless `close` says
/// not), counted and logged.
fn detach(shared: &Shared, peer: SocketAddr, close: &Close) {
    let Shared {
        broker,
        session,
        link,
        ..
    } = shared;
    broker.stats.client_disconnected();
    let client_id = &session.client_id;
    broker.events.fire(|| Event::Disconnected {
        client_id: client_id.to_string(),
        reason: close.reason.clone(),
    });
    broker.detach(session, link, close.publish_will);
    link.mark_closed();
    if broker.shards.is_some() {
        crate::shards::Shards::not_serving(link);
    }
    if broker.config.logging.connection_messages {
        tracing::info!(target: "mercurio::connections", %client_id, %peer, reason = %close.reason, "client disconnected");
    }
}

/// One half of a stream whose reader and writer run in the same task (`select!`): each poll
/// takes the stream's lock, never held across polls, so the halves never wait for each other.
/// (`tokio::io::split` would put the stream in an `Arc` of its own.)
struct Half<'a, S>(&'a parking_lot::Mutex<S>);

impl<S: AsyncRead + Unpin> AsyncRead for Half<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Half<'_, S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.lock()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.lock()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.lock().is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_shutdown(cx)
    }
}

/// `topic` (or filter) of a client of a listener with `mount_point`: prefixed, including the
/// filter of a shared subscription (`$share/group/` stays in front), as mosquitto does.
pub(super) fn mounted(mount: Option<&str>, topic: &str) -> String {
    let Some(mount) = mount else {
        return topic.to_string();
    };
    if let Ok(Some(shared)) = crate::topic::parse_shared(topic) {
        return format!("$share/{}/{mount}{}", shared.group, shared.filter);
    }
    format!("{mount}{topic}")
}

/// How long a connection goes on reading what its client sent last, once the broker starts
/// shutting down or a write to the client has failed.
const LAST_READ: Duration = Duration::from_millis(50);

/// After a server-initiated close, reads and discards what the client still sends: closing a
/// socket with unread input makes the kernel send RST, and a client still writing (the
/// PUBRELs for a thousand PUBRECs, say) would then lose the DISCONNECT that tells it why.
/// Ends when the client closes, falls silent for half a second, has sent 1 MiB, or after 5 s.
async fn linger<R: AsyncRead + Unpin>(rd: &mut R) {
    const LINGER: Duration = Duration::from_secs(5);
    const LINGER_IDLE: Duration = Duration::from_millis(500);
    const LINGER_BYTES: usize = 1 << 20;
    // On the heap: an array here would make every connection's task 4 KiB larger.
    let mut sink = vec![0u8; 4096];
    let mut drained = 0;
    let _ = tokio::time::timeout(LINGER, async {
        while drained < LINGER_BYTES {
            match tokio::time::timeout(LINGER_IDLE, rd.read(&mut sink)).await {
                Ok(Ok(n)) if n > 0 => drained += n,
                _ => break,
            }
        }
    })
    .await;
}
