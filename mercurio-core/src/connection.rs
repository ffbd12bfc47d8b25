//! One network connection: the CONNECT handshake, then a reader and a writer running side by
//! side in the connection's task.
//!
//! The reader decodes packets and runs the inbound state machines (MQTT 5.0 section 4.3);
//! what it answers (PUBACK, SUBACK, ...) is encoded into the link's control buffer. The writer
//! sleeps until woken, then drains the control buffer and the session's queue into one buffer
//! and one write (one system call for many messages is what keeps a busy broker fast).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::auth::hooks::{AccessRequest, Action, ConnectInfo, DenyReason};
use crate::broker::access::subscription_topic;
use crate::broker::BrokerInner;
use crate::codec::{
    self, ConnAck, Connect, DecodeError, Disconnect, Packet, Properties, ProtocolVersion, PubAck,
    Publish, PublishRef, QoS, ReasonCode, SubAck, Subscribe, UnsubAck, Unsubscribe,
};
use crate::link::{DisconnectReason, Link};
use crate::message::Message;
use crate::session::{Granted, Inflight, OutboundState, Session, Will};
use crate::stats::{DropCause, Stats};
use crate::topic;

/// Topic aliases a client may use towards the broker (CONNACK Topic Alias Maximum).
pub const TOPIC_ALIAS_MAXIMUM: u16 = 10;
/// A writer writes at most about this many bytes per system call before draining again.
const WRITE_CHUNK: usize = 64 * 1024;
/// A read buffer larger than this is released once empty, so idle connections stay small.
const IDLE_BUFFER_LIMIT: usize = 16 * 1024;
/// How long the final packets (DISCONNECT, a refused CONNACK) may take to be written.
const FINAL_WRITE_TIMEOUT: Duration = Duration::from_secs(2);

/// How the connection ends: why, what to send first, whether the will goes out.
#[derive(Debug)]
struct Close {
    reason: DisconnectReason,
    /// A 5.0 DISCONNECT to send before closing.
    send: Option<ReasonCode>,
    publish_will: bool,
}

impl Close {
    fn lost(reason: DisconnectReason) -> Close {
        Close {
            reason,
            send: None,
            publish_will: true,
        }
    }

    /// A protocol violation: 5.0 clients get DISCONNECT with `rc` [MQTT-4.13.1-1].
    fn violation(rc: ReasonCode, why: &str, client_id: &str) -> Close {
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
pub(crate) async fn serve<S>(broker: Arc<BrokerInner>, stream: S, peer: SocketAddr)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    serve_with(broker, stream, peer, None).await
}

/// [`serve`], with what a TLS handshake told about the client.
pub(crate) async fn serve_with<S>(
    broker: Arc<BrokerInner>,
    stream: S,
    peer: SocketAddr,
    tls: Option<crate::tls::TlsIdentity>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut buf = BytesMut::with_capacity(256);
    let server = &broker.config.server;
    let connect_timeout = Duration::from_secs(server.connect_timeout);

    // 1. CONNECT, within connect_timeout.
    let connect = match tokio::time::timeout(
        connect_timeout,
        read_connect(&mut rd, &mut buf, server.max_packet_size, &broker.stats),
    )
    .await
    {
        Err(_) => {
            tracing::info!(%peer, "no CONNECT within connect_timeout: closing");
            return;
        }
        Ok(Err(ConnectError::Closed)) => return,
        Ok(Err(ConnectError::Refuse(bytes, why))) => {
            tracing::info!(%peer, "refusing connection: {why}");
            let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, wr.write_all(&bytes)).await;
            return;
        }
        Ok(Ok(connect)) => connect,
    };

    // 2. Checks, session, CONNACK.
    // Boxed here and below: a future is as large as the largest state it can be in, and
    // the connection's task holds it for the whole connection (idle ones too).
    let accepted = match Box::pin(accept(&broker, *connect, peer, tls)).await {
        Ok(a) => a,
        Err(connack) => {
            let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, wr.write_all(&connack)).await;
            return;
        }
    };
    let Accepted {
        session,
        link,
        version,
        keep_alive,
        client_limits,
        connack,
    } = accepted;
    let client_id = Arc::clone(&session.client_id);
    broker.stats.client_connected();
    if let Err(e) = wr.write_all(&connack).await {
        tracing::debug!(%client_id, "cannot send CONNACK: {e}");
    }
    Stats::add(&broker.stats.bytes_sent, connack.len() as u64);
    if broker.config.logging.connection_messages {
        tracing::info!(target: "mercurio::connections", %client_id, %peer, protocol = version.level(), keep_alive, "client connected");
    }

    // 3. Reader and writer, until one ends or the broker asks the connection to close.
    let mut reader = Reader {
        broker: &broker,
        session: &session,
        link: &link,
        version,
        aliases: HashMap::new(),
        receive_maximum: broker.config.server.receive_maximum,
    };
    let mut writer = Writer {
        broker: &broker,
        session: &session,
        link: &link,
        version,
        limits: client_limits,
        aliases: HashMap::new(),
        scratch: None,
    };
    link.wake();
    let close = {
        let read = reader.run(&mut rd, &mut buf, keep_alive);
        tokio::pin!(read);
        let mut killed = false;
        let mut write_failed = false;
        let close = tokio::select! {
            c = &mut read => c,
            c = writer.run(&mut wr) => {
                write_failed = true;
                c
            }
            _ = link.wait_killed() => {
                killed = true;
                let (reason, rc) = link.take_kill_reason().unwrap_or((DisconnectReason::Administrative, ReasonCode::ADMINISTRATIVE_ACTION));
                Close { reason, send: Some(rc), publish_will: true }
            }
        };
        if write_failed {
            // The client closed without reading what we sent last (mosquitto_sub -C does),
            // but what it sent before closing is still to be read: its PUBACKs, applied, and
            // its DISCONNECT, which discards the will [MQTT-3.14.4-3]. The reader's verdict
            // wins when it reaches the end of the input in time.
            match tokio::time::timeout(LAST_READ, &mut read).await {
                Ok(c) => c,
                Err(_) => close,
            }
        } else {
            // At shutdown, what the client sent just before is still handled: a PUBACK on
            // its way is applied (and stored), not answered by a redelivery after the restart.
            if killed && matches!(close.reason, DisconnectReason::Shutdown) {
                let _ = tokio::time::timeout(LAST_READ, &mut read).await;
            }
            close
        }
    };

    // 4. Final bytes: what the reader answered last, and a DISCONNECT for 5.0 clients.
    let mut last = link.take_control();
    if let (Some(rc), true) = (close.send, version.is_v5()) {
        let d = Packet::Disconnect(Disconnect {
            reason_code: rc,
            properties: Properties::default(),
        });
        let _ = codec::encode(&d, version, &mut last);
    }
    if !last.is_empty() {
        let _ = tokio::time::timeout(FINAL_WRITE_TIMEOUT, async {
            wr.write_all(&last).await?;
            wr.shutdown().await
        })
        .await;
    }
    broker.stats.client_disconnected();
    broker.detach(&session, &link, close.publish_will);
    link.mark_closed();
    if broker.config.logging.connection_messages {
        tracing::info!(target: "mercurio::connections", %client_id, %peer, reason = %close.reason, "client disconnected");
    }
    if close.send.is_some() {
        linger(&mut rd).await;
    }
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

enum ConnectError {
    Closed,
    /// Bytes to send (possibly none) before closing, and why.
    Refuse(Vec<u8>, String),
}

/// Reads the first packet, which must be CONNECT [MQTT-3.1.0-1].
async fn read_connect<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
    max_packet_size: u32,
    stats: &Stats,
) -> Result<Box<Connect>, ConnectError> {
    loop {
        // Judged on its first byte: a client that opens with anything else is closed before
        // the rest of its packet is read, so it cannot make the broker buffer up to
        // max_packet_size bytes without ever connecting.
        if let Some(&first) = buf.first() {
            if first >> 4 != 1 {
                return Err(ConnectError::Refuse(
                    Vec::new(),
                    format!(
                        "first packet was of type {}, not CONNECT [MQTT-3.1.0-1]",
                        first >> 4
                    ),
                ));
            }
        }
        match codec::decode(buf, ProtocolVersion::V311, max_packet_size) {
            Ok(Some(Packet::Connect(c))) => return Ok(c),
            Ok(Some(other)) => {
                return Err(ConnectError::Refuse(
                    Vec::new(),
                    format!("first packet was {}, not CONNECT", other.name()),
                ))
            }
            Ok(None) => {}
            Err(DecodeError::UnsupportedProtocolVersion { level }) => {
                // 3.1.1 section 3.2.2.3: return code 1, then close [MQTT-3.1.2-2].
                return Err(ConnectError::Refuse(
                    vec![
                        0x20,
                        0x02,
                        0x00,
                        ReasonCode::V3_UNACCEPTABLE_PROTOCOL_VERSION,
                    ],
                    format!("unsupported protocol level {level}"),
                ));
            }
            Err(e) => {
                return Err(ConnectError::Refuse(
                    Vec::new(),
                    format!("bad CONNECT: {e}"),
                ))
            }
        }
        match rd.read_buf(buf).await {
            Ok(0) | Err(_) => return Err(ConnectError::Closed),
            Ok(n) => Stats::add(&stats.bytes_received, n as u64),
        }
    }
}

/// What the client asked for that bounds what the broker sends it.
#[derive(Debug, Clone, Copy)]
struct ClientLimits {
    /// Outbound QoS 1/2 window: the lower of `max_inflight` and the client's Receive Maximum.
    inflight: usize,
    /// The client's Maximum Packet Size, bytes.
    max_packet_size: u32,
    /// The client's Topic Alias Maximum.
    topic_alias_maximum: u16,
}

struct Accepted {
    session: Arc<Session>,
    link: Arc<Link>,
    version: ProtocolVersion,
    /// Seconds; 0 = no keep alive.
    keep_alive: u16,
    client_limits: ClientLimits,
    connack: Vec<u8>,
}

fn encode_connack(
    version: ProtocolVersion,
    session_present: bool,
    rc: ReasonCode,
    properties: Properties,
) -> Vec<u8> {
    let reason_code = if version.is_v5() {
        rc
    } else {
        ReasonCode(rc.to_v3_connack())
    };
    let ack = Packet::ConnAck(ConnAck {
        session_present,
        reason_code,
        properties,
    });
    let mut out = BytesMut::new();
    if let Err(e) = codec::encode(&ack, version, &mut out) {
        tracing::error!("cannot encode CONNACK: {e}");
    }
    out.to_vec()
}

/// The CONNECT checks of the authentication chain: authentication (with the TLS identity), then the will's
/// topic, which the client must be allowed to publish to. `Ok` carries the user name the
/// client is known by; `Err` the CONNACK reason code and why.
async fn connect_checks(
    broker: &BrokerInner,
    connect: &Connect,
    client_id: &str,
    peer: SocketAddr,
    tls: Option<crate::tls::TlsIdentity>,
) -> Result<Option<Arc<str>>, (ReasonCode, String)> {
    let tls = tls.unwrap_or_default();
    let mut username = connect.username.clone();
    if tls.use_as_username {
        match &tls.certificate_cn {
            Some(cn) => username = Some(cn.clone()),
            None => {
                return Err((
                    ReasonCode::NOT_AUTHORIZED,
                    "no client certificate common name to use as the user name".into(),
                ))
            }
        }
    }
    let info = ConnectInfo {
        client_id: client_id.to_string(),
        username,
        password: connect.password.clone(),
        peer,
        protocol: connect.protocol,
        certificate_cn: tls.certificate_cn,
        username_from_certificate: tls.use_as_username,
    };
    let username = broker.auth.authenticate(&info).await.map_err(|r| match r {
        DenyReason::BadCredentials => (
            ReasonCode::BAD_USER_NAME_OR_PASSWORD,
            "bad user name or password".to_string(),
        ),
        DenyReason::NotAuthorized => (ReasonCode::NOT_AUTHORIZED, "not authorized".to_string()),
    })?;
    if let Some(will) = &connect.will {
        if broker.auth.checks_access()
            && !broker
                .auth
                .authorize(&AccessRequest {
                    client_id,
                    username: username.as_deref(),
                    topic: &will.topic,
                    action: Action::Write,
                })
                .await
        {
            return Err((
                ReasonCode::NOT_AUTHORIZED,
                format!("may not publish the will to {:?}", will.topic),
            ));
        }
    }
    Ok(username.map(Arc::from))
}

/// Checks a CONNECT (MQTT 5.0 section 3.1.4), takes the session over or creates it, and
/// builds the CONNACK. `Err` carries a refusing CONNACK to send before closing.
async fn accept(
    broker: &Arc<BrokerInner>,
    connect: Connect,
    peer: SocketAddr,
    tls: Option<crate::tls::TlsIdentity>,
) -> Result<Accepted, Vec<u8>> {
    let version = connect.protocol;
    let server = &broker.config.server;
    let refuse = |rc: ReasonCode, why: &str| {
        tracing::info!(%peer, client_id = %connect.client_id, username = connect.username.as_deref().unwrap_or(""), reason = %rc, "refusing CONNECT: {why}");
        encode_connack(version, false, rc, Properties::default())
    };
    if broker.is_shutting_down() {
        return Err(refuse(ReasonCode::SERVER_UNAVAILABLE, "shutting down"));
    }
    let props = &connect.properties;

    // "It is a Protocol Error to include Authentication Data if there is no Authentication
    // Method" (5.0 section 3.1.2.11.10).
    if props.authentication_data.is_some() && props.authentication_method.is_none() {
        return Err(refuse(
            ReasonCode::PROTOCOL_ERROR,
            "Authentication Data without an Authentication Method",
        ));
    }
    // Enhanced authentication: no method is supported.
    if props.authentication_method.is_some() {
        return Err(refuse(
            ReasonCode::BAD_AUTHENTICATION_METHOD,
            "authentication method not supported",
        ));
    }
    // Client identifier [MQTT-3.1.3-6..9].
    let mut assigned = None;
    let client_id: Arc<str> = if connect.client_id.is_empty() {
        match version {
            ProtocolVersion::V31 => {
                return Err(refuse(
                    ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
                    "empty client identifier in 3.1",
                ))
            }
            ProtocolVersion::V311 if !connect.clean_start => {
                return Err(refuse(
                    ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
                    "empty client identifier without clean session [MQTT-3.1.3-8]",
                ))
            }
            _ => {
                // mosquitto's shape, "auto-" and a UUID's 36 characters (some clients and
                // tests expect the length): the salt, then a counter, so unique in a run.
                let n = broker.next_client_number.fetch_add(1, Ordering::Relaxed);
                let salt = broker.client_id_salt;
                let id = format!(
                    "auto-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                    salt >> 32,
                    (salt >> 16) & 0xffff,
                    salt & 0xffff,
                    (n >> 48) & 0xffff,
                    n & 0xffff_ffff_ffff
                );
                if version.is_v5() {
                    assigned = Some(id.clone());
                }
                Arc::from(id)
            }
        }
    } else {
        Arc::from(connect.client_id.as_str())
    };
    if !server.clientid_prefixes.is_empty()
        && !server
            .clientid_prefixes
            .iter()
            .any(|p| client_id.starts_with(p.as_str()))
    {
        return Err(refuse(
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            "client identifier outside clientid_prefixes",
        ));
    }
    // In-process subscriptions own these identifiers (handle.rs); taking one over would wait
    // forever for a connection that does not exist.
    if client_id.starts_with("$internal/") {
        return Err(refuse(
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            "client identifier reserved for in-process subscriptions",
        ));
    }
    // Authentication: the hooks, then allow_anonymous and the password file.
    let username = match connect_checks(broker, &connect, &client_id, peer, tls).await {
        Ok(username) => username,
        Err((rc, why)) => return Err(refuse(rc, &why)),
    };
    // Keep alive and max_keepalive: a 5.0 client asking for more (or for none) is told the
    // Server Keep Alive [MQTT-3.2.2-21]; a 3.x client asking for more is refused with
    // "identifier rejected", as mosquitto documents (3.x has no way to be told).
    let mut keep_alive = connect.keep_alive;
    let mut server_keep_alive = None;
    let limited = server.max_keepalive < u16::MAX;
    if version.is_v5() {
        if limited && (keep_alive == 0 || keep_alive > server.max_keepalive) {
            keep_alive = server.max_keepalive;
            server_keep_alive = Some(keep_alive);
        }
    } else if keep_alive > server.max_keepalive {
        return Err(refuse(
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            "keep alive above max_keepalive",
        ));
    }
    // The will [MQTT-3.1.2-9..] and what the broker supports.
    let max_qos = QoS::from_u8(server.max_qos).unwrap_or(QoS::ExactlyOnce);
    let mut will = None;
    if let Some(w) = &connect.will {
        if topic::validate_topic_name(&w.topic).is_err() || w.topic.starts_with("$SYS") {
            return Err(refuse(ReasonCode::TOPIC_NAME_INVALID, "invalid will topic"));
        }
        if w.qos > max_qos {
            return Err(refuse(
                ReasonCode::QOS_NOT_SUPPORTED,
                "will QoS above max_qos [MQTT-3.2.2-12]",
            ));
        }
        if w.retain && !server.retain_available {
            return Err(refuse(
                ReasonCode::RETAIN_NOT_SUPPORTED,
                "will retain but retain_available = false [MQTT-3.2.2-13]",
            ));
        }
        if w.properties.payload_format_indicator == Some(1)
            && std::str::from_utf8(&w.payload).is_err()
        {
            return Err(refuse(
                ReasonCode::PAYLOAD_FORMAT_INVALID,
                "will payload is not UTF-8",
            ));
        }
        let mut properties = w.properties.clone();
        let delay = properties.will_delay_interval.take().unwrap_or(0);
        let expiry = properties.message_expiry_interval.take();
        will = Some(Will {
            delay,
            expiry,
            msg: Arc::new(Message {
                topic: w.topic.clone(),
                payload: w.payload.clone(),
                qos: w.qos,
                retain: w.retain,
                properties,
                expires_at: None,
                publisher: Some(Arc::clone(&client_id)),
            }),
        });
    }
    // Session Expiry Interval: 5.0 from the property; 3.x clean session 0 lives for
    // persistent_client_expiration (0 = forever).
    let expiry_interval = match version {
        ProtocolVersion::V5 => props.session_expiry_interval.unwrap_or(0),
        _ if connect.clean_start => 0,
        _ => match server.persistent_client_expiration {
            0 => u32::MAX,
            s => u32::try_from(s).unwrap_or(u32::MAX - 1),
        },
    };

    if broker
        .persist
        .get()
        .is_some_and(|p| p.is_set_aside(&client_id))
    {
        return Err(refuse(
            ReasonCode::SERVER_UNAVAILABLE,
            "its stored session could not be read (set aside until deleted)",
        ));
    }
    // Take the session over [MQTT-3.1.4-3], or start a new one [MQTT-3.1.2-4].
    let link = Arc::new(Link::new());
    let session_present;
    // Whether this connection took over a connected client (rather than a session whose
    // client was away): it decides the fate of a will waiting for its delay below.
    let mut took_over = false;
    let session = loop {
        let existing = broker.sessions.lock().get(&client_id).cloned();
        if let Some(old) = existing {
            let old_link = old.state.lock().link.clone();
            if let Some(old_link) = old_link {
                // The session goes on under the new connection (clean start 0, a session that
                // outlives its connection): the old connection's will is dropped, not published,
                // since a new connection for its client identifier opened before any will delay
                // could elapse [MQTT-3.1.2-8] [MQTT-3.1.3-9], as mosquitto does for 3.x and 5.0
                // alike. A session that ends here publishes it (detach, then end_session).
                if !connect.clean_start {
                    let mut st = old.state.lock();
                    if st.expiry_interval > 0 && st.will.take().is_some() {
                        st.persist_will_cleared(&old.client_id);
                    }
                }
                old_link.kill(DisconnectReason::TakenOver, ReasonCode::SESSION_TAKEN_OVER);
                old_link.wait_closed().await;
                took_over = true;
                continue;
            }
            if connect.clean_start || old.state.lock().ended {
                // Clean Start ends the old session. Its will, if still waiting for its Will
                // Delay Interval: published now when this connection took over a connected
                // client (the non-normative comment of section 3.1.4: "it will be sent
                // because the original Session is ended on the takeover"); dropped when the
                // client was away, since a new connection for its client identifier opened
                // before the delay elapsed [MQTT-3.1.2-8] (mosquitto 07-will-delay-recover).
                if !took_over {
                    old.state.lock().will = None;
                }
                broker.end_session(&old);
                continue;
            }
            let mut st = old.state.lock();
            if st.ended || st.link.is_some() {
                continue;
            }
            st.link = Some(Arc::clone(&link));
            st.generation += 1;
            st.disconnected_at = None;
            st.protocol = version;
            st.expiry_interval = expiry_interval;
            st.will = will.take();
            drop(st);
            session_present = true;
            break old;
        }
        let fresh = Arc::new(Session::new(
            Arc::clone(&client_id),
            version,
            expiry_interval,
        ));
        {
            let mut st = fresh.state.lock();
            st.link = Some(Arc::clone(&link));
            st.generation = 1;
            st.will = will.take();
        }
        let mut sessions = broker.sessions.lock();
        if sessions.contains_key(&client_id) {
            continue;
        }
        sessions.insert(Arc::clone(&client_id), Arc::clone(&fresh));
        session_present = false;
        break fresh;
    };

    // The identity first: the header stored next records the user name.
    session.state.lock().username = username.clone();
    *session.identity.write() = crate::auth::Identity::Client { username };
    if let Some(p) = broker.persist.get() {
        p.connected(&session, session_present);
    }

    // CONNACK properties (MQTT 5.0 section 3.2.2.3).
    let mut p = Properties::default();
    if version.is_v5() {
        p.receive_maximum = Some(server.receive_maximum);
        if max_qos < QoS::ExactlyOnce {
            p.maximum_qos = Some(max_qos as u8);
        }
        if !server.retain_available {
            p.retain_available = Some(0);
        }
        if server.max_packet_size < 268_435_455 {
            p.maximum_packet_size = Some(server.max_packet_size);
        }
        p.topic_alias_maximum = Some(TOPIC_ALIAS_MAXIMUM);
        p.assigned_client_identifier = assigned;
        p.server_keep_alive = server_keep_alive;
    }
    let connack = encode_connack(version, session_present, ReasonCode::SUCCESS, p);
    let client_limits = ClientLimits {
        inflight: usize::from(
            server
                .max_inflight
                .min(props.receive_maximum.unwrap_or(u16::MAX)),
        )
        .max(1),
        max_packet_size: props.maximum_packet_size.unwrap_or(268_435_455 + 5),
        topic_alias_maximum: props.topic_alias_maximum.unwrap_or(0),
    };
    Ok(Accepted {
        session,
        link,
        version,
        keep_alive,
        client_limits,
        connack,
    })
}

/// Packets a reader handles before it yields to the scheduler.
const READER_BATCH: u32 = 64;

/// The inbound half: decodes packets and runs their state machines.
struct Reader<'a> {
    broker: &'a Arc<BrokerInner>,
    session: &'a Arc<Session>,
    link: &'a Arc<Link>,
    version: ProtocolVersion,
    /// Topic aliases the client set, alias -> topic (MQTT 5.0 section 3.3.2.3.4).
    aliases: HashMap<u16, String>,
    receive_maximum: u16,
}

impl Reader<'_> {
    async fn run<R: AsyncRead + Unpin>(
        &mut self,
        rd: &mut R,
        buf: &mut BytesMut,
        keep_alive: u16,
    ) -> Close {
        // Close after one and a half times the keep alive with no packet [MQTT-3.1.2-24].
        let grace = (keep_alive > 0).then(|| Duration::from_millis(u64::from(keep_alive) * 1500));
        let max = self.broker.config.server.max_packet_size;
        let mut deadline = grace.map(|g| tokio::time::Instant::now() + g);
        let mut handled = 0u32;
        loop {
            // The keep alive deadline moves once per read that brought packets, not per packet:
            // one clock reading for a whole buffer of them.
            let before = handled;
            loop {
                match codec::decode(buf, self.version, max) {
                    Ok(Some(packet)) => {
                        // A future holds room for the largest state it can be in, and this
                        // one lives as long as the connection (idle ones too): the waiting
                        // handlers (SUBSCRIBE; PUBLISH under access checks) are boxed, and a
                        // PUBLISH without access checks (fixed for the broker's lifetime)
                        // never waits, so it runs to completion here, its state on the stack.
                        let handled_now = match packet {
                            Packet::Publish(p) if !self.broker.auth.checks_access() => self
                                .on_publish(p)
                                .now_or_never()
                                .expect("on_publish waits only for access checks"),
                            Packet::Publish(_) | Packet::Subscribe(_) => {
                                Box::pin(self.handle(packet)).await
                            }
                            other => self.handle_other(other),
                        };
                        if let Err(close) = handled_now {
                            return close;
                        }
                        // A fast publisher's buffer can hold thousands of packets: let the
                        // subscribers' writers this routing woke run (tokio keeps the last
                        // woken task in this worker's unstealable LIFO slot), or their
                        // queues fill up and drop while the consumers are idle.
                        handled += 1;
                        if handled % READER_BATCH == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let mut why = e.to_string();
                        if let DecodeError::PacketTooLarge { .. } = e {
                            why.push_str(" (max_packet_size)");
                        }
                        return Close::violation(e.reason_code(), &why, &self.session.client_id);
                    }
                }
            }
            if let (Some(g), true) = (grace, handled != before) {
                deadline = Some(tokio::time::Instant::now() + g);
            }
            if buf.is_empty() && buf.capacity() > IDLE_BUFFER_LIMIT {
                *buf = BytesMut::with_capacity(256);
            }
            if let Some(p) = self.broker.persist.get() {
                p.wait_room(&self.session.client_id).await;
            }
            let read = async {
                match deadline {
                    Some(d) => tokio::time::timeout_at(d, rd.read_buf(buf)).await.ok(),
                    None => Some(rd.read_buf(buf).await),
                }
            };
            match read.await {
                None => {
                    return Close {
                        reason: DisconnectReason::KeepAliveTimeout,
                        send: Some(ReasonCode::KEEP_ALIVE_TIMEOUT),
                        publish_will: true,
                    }
                }
                Some(Ok(0)) => return Close::lost(DisconnectReason::ConnectionLost),
                Some(Ok(n)) => Stats::add(&self.broker.stats.bytes_received, n as u64),
                Some(Err(e)) => return Close::lost(DisconnectReason::Io(e.to_string())),
            }
        }
    }

    fn send(&self, packet: Packet) {
        self.link.send(&packet, self.version);
    }

    fn violation(&self, rc: ReasonCode, why: &str) -> Close {
        Close::violation(rc, why, &self.session.client_id)
    }

    async fn handle(&mut self, packet: Packet) -> Result<(), Close> {
        match packet {
            Packet::Publish(p) => self.on_publish(p).await,
            Packet::Subscribe(s) => self.on_subscribe(s).await,
            other => self.handle_other(other),
        }
    }

    /// Every packet but PUBLISH and SUBSCRIBE.
    fn handle_other(&mut self, packet: Packet) -> Result<(), Close> {
        match packet {
            Packet::PubAck(a) => {
                self.on_ack(a.packet_id, OutboundState::AwaitingPubAck);
                Ok(())
            }
            Packet::PubRec(a) => {
                self.on_pubrec(a);
                Ok(())
            }
            Packet::PubComp(a) => {
                self.on_ack(a.packet_id, OutboundState::AwaitingPubComp);
                Ok(())
            }
            Packet::PubRel(a) => {
                // Release of an inbound QoS 2 message [MQTT-4.3.3-9..11]. An unknown
                // identifier is answered with Success too, as mosquitto does: it is a PUBREL
                // resent after a reconnect whose PUBCOMP was lost [MQTT-4.4.0-1], for a
                // message already complete, and some clients (rumqttc) drop the connection
                // on a PUBCOMP error code such as 0x92.
                let known = {
                    let mut st = self.session.state.lock();
                    let known = st.inbound_qos2.remove(&a.packet_id);
                    if known {
                        st.persist_inbound_qos2(&self.session.client_id, a.packet_id, false);
                    }
                    known
                };
                if !known {
                    tracing::debug!(client_id = %self.session.client_id, packet_id = a.packet_id, "PUBREL for a completed or unknown packet identifier");
                }
                self.send(Packet::PubComp(PubAck {
                    packet_id: a.packet_id,
                    reason_code: ReasonCode::SUCCESS,
                    properties: Properties::default(),
                }));
                Ok(())
            }
            Packet::Unsubscribe(u) => {
                self.on_unsubscribe(u);
                Ok(())
            }
            Packet::PingReq => {
                self.send(Packet::PingResp);
                Ok(())
            }
            Packet::Disconnect(d) => Err(self.on_disconnect(d)),
            Packet::Connect(_) => {
                Err(self.violation(ReasonCode::PROTOCOL_ERROR, "second CONNECT [MQTT-3.1.0-2]"))
            }
            Packet::Auth(_) => Err(self.violation(
                ReasonCode::PROTOCOL_ERROR,
                "AUTH without an authentication method",
            )),
            other => Err(self.violation(
                ReasonCode::PROTOCOL_ERROR,
                &format!("{} is sent by servers only", other.name()),
            )),
        }
    }

    fn ack_publish(&self, qos: QoS, packet_id: u16, reason_code: ReasonCode) {
        let ack = PubAck {
            packet_id,
            reason_code,
            properties: Properties::default(),
        };
        let packet = match qos {
            QoS::AtMostOnce => return,
            QoS::AtLeastOnce => Packet::PubAck(ack),
            QoS::ExactlyOnce => {
                if !reason_code.is_failure() {
                    let mut st = self.session.state.lock();
                    if st.inbound_qos2.insert(packet_id) {
                        st.persist_inbound_qos2(&self.session.client_id, packet_id, true);
                    }
                }
                Packet::PubRec(ack)
            }
        };
        // durable_ack: acknowledged once storage has committed what the message changed.
        match self.broker.persist.get().filter(|p| p.durable_ack()) {
            Some(p) => {
                let (link, version) = (Arc::clone(self.link), self.version);
                p.after_commit(Box::new(move || link.send(&packet, version)));
            }
            None => self.send(packet),
        }
    }

    async fn on_publish(&mut self, mut p: Publish) -> Result<(), Close> {
        let broker = self.broker;
        Stats::add(&broker.stats.messages_received, 1);
        let server = &broker.config.server;
        if p.qos as u8 > server.max_qos {
            return Err(self.violation(
                ReasonCode::QOS_NOT_SUPPORTED,
                "PUBLISH above max_qos [MQTT-3.2.2-11]",
            ));
        }
        if p.retain && !server.retain_available {
            return Err(self.violation(
                ReasonCode::RETAIN_NOT_SUPPORTED,
                "retained PUBLISH but retain_available = false",
            ));
        }
        // Topic alias (MQTT 5.0 section 3.3.2.3.4).
        if let Some(alias) = p.properties.topic_alias.take() {
            if alias == 0 || alias > TOPIC_ALIAS_MAXIMUM {
                return Err(self.violation(
                    ReasonCode::TOPIC_ALIAS_INVALID,
                    "topic alias out of range [MQTT-3.3.2-8]",
                ));
            }
            if p.topic.is_empty() {
                match self.aliases.get(&alias) {
                    Some(t) => p.topic = t.clone(),
                    None => {
                        return Err(
                            self.violation(ReasonCode::PROTOCOL_ERROR, "unknown topic alias")
                        )
                    }
                }
            } else {
                self.aliases.insert(alias, p.topic.clone());
            }
        }
        if p.topic.is_empty() {
            return Err(self.violation(ReasonCode::PROTOCOL_ERROR, "empty topic name"));
        }
        if !self.version.is_v5() && !p.properties.is_empty() {
            p.properties = Properties::default();
        }
        // Flow control: QoS 2 messages awaiting PUBREL [MQTT-3.3.4-7].
        if p.qos == QoS::ExactlyOnce {
            let st = self.session.state.lock();
            if st.inbound_qos2.contains(&p.packet_id) {
                // A resent QoS 2 PUBLISH already received: acknowledge, never deliver twice.
                drop(st);
                self.ack_publish(p.qos, p.packet_id, ReasonCode::SUCCESS);
                return Ok(());
            }
            if st.inbound_qos2.len() >= usize::from(self.receive_maximum) {
                drop(st);
                return Err(self.violation(
                    ReasonCode::RECEIVE_MAXIMUM_EXCEEDED,
                    "more QoS 2 messages awaiting PUBREL than receive_maximum",
                ));
            }
        }
        if p.topic.starts_with("$SYS") {
            tracing::debug!(client_id = %self.session.client_id, topic = %p.topic, "PUBLISH to $SYS refused");
            self.ack_publish(p.qos, p.packet_id, ReasonCode::NOT_AUTHORIZED);
            return Ok(());
        }
        if p.properties.payload_format_indicator == Some(1)
            && std::str::from_utf8(&p.payload).is_err()
        {
            self.ack_publish(p.qos, p.packet_id, ReasonCode::PAYLOAD_FORMAT_INVALID);
            return Ok(());
        }
        if broker.auth.checks_access() && !broker.may(self.session, &p.topic, Action::Write).await {
            // 5.0: 0x87; 3.x has no way to say it: acknowledged and dropped.
            tracing::debug!(client_id = %self.session.client_id, topic = %p.topic, "PUBLISH not authorized");
            let rc = if self.version.is_v5() {
                ReasonCode::NOT_AUTHORIZED
            } else {
                ReasonCode::SUCCESS
            };
            self.ack_publish(p.qos, p.packet_id, rc);
            return Ok(());
        }
        // Moved out whole (no `mem::take`: no default `Properties` built, then dropped).
        let Publish {
            topic,
            payload,
            qos,
            retain,
            packet_id,
            mut properties,
            ..
        } = p;
        let expiry = properties.message_expiry_interval.take();
        properties.subscription_identifiers.clear();
        let msg = Message {
            topic,
            payload,
            qos,
            retain,
            properties,
            expires_at: Message::expiry_deadline(expiry, Instant::now()),
            publisher: Some(Arc::clone(&self.session.client_id)),
        };
        let matched = broker.publish(msg);
        // 5.0: a QoS 1 message no subscription matched is acknowledged with 0x10 (No matching
        // subscribers), which the Server MAY use (MQTT 5.0 section 3.4.2.1), as mosquitto does;
        // PUBREC stays 0x00, as in mosquitto.
        let rc = if !matched && qos == QoS::AtLeastOnce && self.version.is_v5() {
            ReasonCode::NO_MATCHING_SUBSCRIBERS
        } else {
            ReasonCode::SUCCESS
        };
        self.ack_publish(qos, packet_id, rc);
        Ok(())
    }

    /// PUBACK or PUBCOMP: the outbound message leaves flight and frees a slot of the window.
    fn on_ack(&self, packet_id: u16, expected: OutboundState) {
        let mut st = self.session.state.lock();
        match st.inflight_position(packet_id) {
            Some(i) if st.inflight[i].state == expected => {
                st.inflight.remove(i);
                st.persist_acked(&self.session.client_id, packet_id);
                drop(st);
                self.link.wake();
            }
            _ => {
                tracing::debug!(client_id = %self.session.client_id, packet_id, "acknowledgement for an unknown packet identifier")
            }
        }
    }

    fn on_pubrec(&self, a: PubAck) {
        let mut st = self.session.state.lock();
        let reason_code = match st.inflight_position(a.packet_id) {
            Some(i) if a.reason_code.is_failure() => {
                st.inflight.remove(i);
                st.persist_acked(&self.session.client_id, a.packet_id);
                drop(st);
                self.link.wake();
                return;
            }
            Some(i) => {
                st.inflight[i].state = OutboundState::AwaitingPubComp;
                st.persist_inflight(&self.session.client_id, i);
                ReasonCode::SUCCESS
            }
            None => ReasonCode::PACKET_IDENTIFIER_NOT_FOUND,
        };
        drop(st);
        self.send(Packet::PubRel(PubAck {
            packet_id: a.packet_id,
            reason_code,
            properties: Properties::default(),
        }));
    }

    async fn on_subscribe(&mut self, s: Subscribe) -> Result<(), Close> {
        let broker = self.broker;
        let max_qos = QoS::from_u8(broker.config.server.max_qos).unwrap_or(QoS::ExactlyOnce);
        let identifier = s.properties.subscription_identifiers.first().copied();
        let mut codes = Vec::with_capacity(s.filters.len());
        let mut retained = Vec::new();
        for f in &s.filters {
            let shared = match topic::parse_shared(&f.filter) {
                Ok(shared) => shared.is_some(),
                Err(_) => {
                    codes.push(self.filter_failure(ReasonCode::TOPIC_FILTER_INVALID));
                    continue;
                }
            };
            if !shared && topic::validate_topic_filter(&f.filter).is_err() {
                codes.push(self.filter_failure(ReasonCode::TOPIC_FILTER_INVALID));
                continue;
            }
            if shared && f.options.no_local {
                return Err(self.violation(
                    ReasonCode::PROTOCOL_ERROR,
                    "No Local on a shared subscription [MQTT-3.8.3-4]",
                ));
            }
            if broker.auth.checks_access()
                && !broker
                    .may(
                        self.session,
                        subscription_topic(&f.filter),
                        Action::Subscribe,
                    )
                    .await
            {
                tracing::debug!(client_id = %self.session.client_id, filter = %f.filter, "SUBSCRIBE not authorized");
                codes.push(self.filter_failure(ReasonCode::NOT_AUTHORIZED));
                continue;
            }
            let mut options = f.options;
            options.qos = options.qos.min(max_qos);
            let granted = Granted {
                options,
                identifier,
            };
            let existed = broker.subscribe(self.session, &f.filter, granted);
            codes.push(ReasonCode(options.qos as u8));
            let send = match options.retain_handling {
                0 => true,
                1 => !existed,
                _ => false,
            };
            if send && !shared {
                retained.push((f.filter.clone(), granted));
            }
        }
        self.send(Packet::SubAck(SubAck {
            packet_id: s.packet_id,
            reason_codes: codes,
            properties: Properties::default(),
        }));
        for (filter, granted) in retained {
            broker.send_retained(self.session, &filter, &granted);
        }
        Ok(())
    }

    fn filter_failure(&self, rc: ReasonCode) -> ReasonCode {
        if self.version.is_v5() {
            rc
        } else {
            ReasonCode::UNSPECIFIED_ERROR
        }
    }

    fn on_unsubscribe(&mut self, u: Unsubscribe) {
        let codes = u
            .filters
            .iter()
            .map(|f| {
                if self.broker.unsubscribe(self.session, f) {
                    ReasonCode::SUCCESS
                } else {
                    ReasonCode::NO_SUBSCRIPTION_EXISTED
                }
            })
            .collect();
        self.send(Packet::UnsubAck(UnsubAck {
            packet_id: u.packet_id,
            reason_codes: codes,
            properties: Properties::default(),
        }));
    }

    fn on_disconnect(&mut self, d: Disconnect) -> Close {
        if let Some(expiry) = d.properties.session_expiry_interval {
            let mut st = self.session.state.lock();
            if st.expiry_interval == 0 && expiry != 0 {
                drop(st);
                return self.violation(
                    ReasonCode::PROTOCOL_ERROR,
                    "session expiry set at DISCONNECT after 0 at CONNECT [MQTT-3.14.2-2]",
                );
            }
            st.expiry_interval = expiry;
        }
        // Only DISCONNECT with 0x04 keeps the will [MQTT-3.14.4-3].
        let publish_will = d.reason_code == ReasonCode::DISCONNECT_WITH_WILL_MESSAGE;
        Close {
            reason: DisconnectReason::ClientDisconnect,
            send: None,
            publish_will,
        }
    }
}

/// The outbound half: drains the control buffer and the session's queue.
struct Writer<'a> {
    broker: &'a Arc<BrokerInner>,
    session: &'a Arc<Session>,
    link: &'a Arc<Link>,
    version: ProtocolVersion,
    limits: ClientLimits,
    /// Topic aliases the broker set towards the client, topic -> alias.
    aliases: HashMap<String, u16>,
    /// Delivery properties built per message (5.0 only), allocated on first use.
    scratch: Option<Box<Properties>>,
}

impl Writer<'_> {
    async fn run<W: AsyncWrite + Unpin>(&mut self, wr: &mut W) -> Close {
        let mut buf = BytesMut::new();
        loop {
            self.link.wait_woken().await;
            loop {
                let more = self.fill(&mut buf);
                if buf.is_empty() {
                    break;
                }
                if let Err(e) = wr.write_all(&buf).await {
                    return Close::lost(DisconnectReason::Io(e.to_string()));
                }
                Stats::add(&self.broker.stats.bytes_sent, buf.len() as u64);
                buf.clear();
                if !more {
                    break;
                }
            }
            if buf.capacity() > IDLE_BUFFER_LIMIT {
                buf = BytesMut::new();
            }
        }
    }

    /// Encodes into `buf` the pending control packets, then in-flight messages not yet sent on
    /// this connection (resent with DUP [MQTT-4.4.0-1]), then queued messages while the window
    /// allows. Returns true when more is waiting (the chunk limit was reached).
    fn fill(&mut self, buf: &mut BytesMut) -> bool {
        self.link.drain_control_into(buf);
        let stats = &self.broker.stats;
        let now = Instant::now();
        let mut st = self.session.state.lock();
        let st = &mut *st;
        let mut sent = 0u64;
        // Resent PUBLISH packets count against this connection's window like new ones: a
        // client that reconnects with a smaller Receive Maximum gets no more unacknowledged
        // QoS 1 and 2 PUBLISH packets than it allows [MQTT-3.3.4-9] [MQTT-4.9.0-2]; the rest
        // are resent as acknowledgements free the window. (PUBREL uses no send quota, but is
        // counted too: the window never overflows, whatever the mix.)
        let mut window = st.inflight.iter().filter(|f| f.sent).count();
        for f in st.inflight.iter_mut().filter(|f| !f.sent) {
            if f.state != OutboundState::AwaitingPubComp && window >= self.limits.inflight {
                continue;
            }
            f.sent = true;
            window += 1;
            match f.state {
                OutboundState::AwaitingPubComp => {
                    let rel = Packet::PubRel(PubAck {
                        packet_id: f.packet_id,
                        ..PubAck::default()
                    });
                    let _ = codec::encode(&rel, self.version, buf);
                }
                _ => {
                    encode_delivery(
                        self.version,
                        &f.delivery,
                        f.packet_id,
                        true,
                        None,
                        now,
                        &mut self.scratch,
                        buf,
                    );
                    sent += 1;
                }
            }
        }
        let mut more = false;
        loop {
            if buf.len() >= WRITE_CHUNK {
                more = !st.queue.is_empty();
                break;
            }
            let Some(head) = st.queue.front() else { break };
            if head.qos > QoS::AtMostOnce && st.inflight.len() >= self.limits.inflight {
                break;
            }
            let Some(q) = st.pop_queued() else { break };
            if q.msg.is_expired(now) {
                stats.dropped(DropCause::Expired);
                st.persist_dequeued(&self.session.client_id, &q);
                continue;
            }
            let alias = self.alias_for(&q.msg.topic);
            let packet_id = if q.qos > QoS::AtMostOnce {
                match st.allocate_packet_id() {
                    Some(id) => id,
                    None => {
                        st.queue.push_front(q);
                        break;
                    }
                }
            } else {
                0
            };
            // Sized once, checked and written (an identifier taken for a packet that is then
            // dropped is simply skipped).
            if encode_delivery_within(
                self.version,
                &q,
                packet_id,
                false,
                alias,
                now,
                &mut self.scratch,
                self.limits.max_packet_size as usize,
                buf,
            )
            .is_err()
            {
                // [MQTT-3.1.2-25]: never send a packet above the client's Maximum Packet Size.
                stats.dropped(DropCause::TooLarge);
                st.persist_dequeued(&self.session.client_id, &q);
                continue;
            }
            let new_alias = alias.filter(|(_, known)| !known).is_some();
            if new_alias {
                if let Some((a, _)) = alias {
                    self.aliases.insert(q.msg.topic.clone(), a);
                }
            }
            sent += 1;
            if q.qos > QoS::AtMostOnce {
                let state = if q.qos == QoS::AtLeastOnce {
                    OutboundState::AwaitingPubAck
                } else {
                    OutboundState::AwaitingPubRec
                };
                st.inflight.push_back(Inflight {
                    packet_id,
                    state,
                    delivery: q,
                    sent: true,
                });
                st.persist_sent(&self.session.client_id);
            }
        }
        if sent > 0 {
            Stats::add(&stats.messages_sent, sent);
        }
        more
    }

    /// The topic alias to use for `topic`: (alias, already known to the client).
    fn alias_for(&self, topic: &str) -> Option<(u16, bool)> {
        if !self.version.is_v5() || self.limits.topic_alias_maximum == 0 {
            return None;
        }
        if let Some(&a) = self.aliases.get(topic) {
            return Some((a, true));
        }
        let next = self.aliases.len() as u16 + 1;
        (next <= self.limits.topic_alias_maximum).then_some((next, false))
    }
}

/// The properties a delivery carries: the message's, plus what this delivery adds (the
/// remaining expiry [MQTT-3.3.2-6], subscription identifiers, a topic alias).
fn delivery_properties<'p>(
    q: &'p Queued,
    alias: Option<(u16, bool)>,
    now: Instant,
    scratch: &'p mut Option<Box<Properties>>,
) -> &'p Properties {
    if q.msg.expires_at.is_none() && q.subscription_ids.is_empty() && alias.is_none() {
        return &q.msg.properties;
    }
    let scratch: &mut Properties = scratch.get_or_insert_with(Default::default);
    scratch.clone_from(&q.msg.properties);
    scratch.message_expiry_interval = q.msg.remaining_expiry(now);
    scratch
        .subscription_identifiers
        .clone_from(&q.subscription_ids);
    scratch.topic_alias = alias.map(|(a, _)| a);
    scratch
}

use crate::session::Queued;

#[allow(clippy::too_many_arguments)]
fn encode_delivery(
    version: ProtocolVersion,
    q: &Queued,
    packet_id: u16,
    dup: bool,
    alias: Option<(u16, bool)>,
    now: Instant,
    scratch: &mut Option<Box<Properties>>,
    buf: &mut BytesMut,
) {
    let r = encode_delivery_within(
        version,
        q,
        packet_id,
        dup,
        alias,
        now,
        scratch,
        usize::MAX,
        buf,
    );
    if let Err(e) = r {
        tracing::error!(topic = %q.msg.topic, "cannot encode PUBLISH: {e}");
    }
}

/// Encodes a delivery unless it is larger than `max_packet_size` bytes (or cannot be
/// encoded at all): then nothing is written.
#[allow(clippy::too_many_arguments)]
fn encode_delivery_within(
    version: ProtocolVersion,
    q: &Queued,
    packet_id: u16,
    dup: bool,
    alias: Option<(u16, bool)>,
    now: Instant,
    scratch: &mut Option<Box<Properties>>,
    max_packet_size: usize,
    buf: &mut BytesMut,
) -> Result<(), codec::EncodeError> {
    let properties = delivery_properties(q, alias, now, scratch);
    let topic = if alias.is_some_and(|(_, known)| known) {
        ""
    } else {
        q.msg.topic.as_str()
    };
    let p = PublishRef {
        dup,
        qos: q.qos,
        retain: q.retain,
        topic,
        packet_id,
        properties,
        payload: &q.msg.payload,
    };
    codec::encode_publish_within(&p, version, max_packet_size, buf)
}
