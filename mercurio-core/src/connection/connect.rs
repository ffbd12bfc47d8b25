//! The CONNECT handshake: reading the first packet, the checks of MQTT 5.0 section 3.1.4
//! (client identifier, authentication, will, keep alive), taking the session (a broker
//! operation, [`BrokerState::take_session`]) and the CONNACK.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::writer::ClientLimits;
use super::TOPIC_ALIAS_MAXIMUM;
use crate::auth::hooks::{AccessRequest, Action, ConnectInfo, DenyReason};
use crate::broker::{BrokerState, INTERNAL_PREFIX};
use crate::codec::{
    self, ConnAck, Connect, DecodeError, Packet, Properties, ProtocolVersion, QoS, ReasonCode,
};
use crate::events::Event;
use crate::link::Link;
use crate::message::Message;
use crate::session::{Session, Will};
use crate::stats::Counters;
use crate::tls::TlsIdentity;
use crate::topic;

pub(super) enum ConnectError {
    Closed,
    /// Bytes to send (possibly none) before closing, and why.
    Refuse(Vec<u8>, String),
}

/// The state topic a bridge may publish and set as its will although `$SYS` is the broker's:
/// `$SYS/broker/connection/<its own client id>/state` (mosquitto's bridge notifications).
pub(crate) fn bridge_state_topic(client_id: &str) -> String {
    format!("$SYS/broker/connection/{client_id}/state")
}

/// Clears the 0x80 bit of the protocol level of a whole CONNECT frame at the start of `buf`
/// (mosquitto's mark for a bridge, `try_private`: 0x83 or 0x84). True when it was set.
fn take_bridge_mark(buf: &mut BytesMut) -> bool {
    if buf.first() != Some(&0x10) {
        return false;
    }
    let Some(mut i) = (1..5).find(|&i| buf.get(i).is_some_and(|b| b & 0x80 == 0)) else {
        return false;
    };
    i += 1;
    let (Some(&hi), Some(&lo)) = (buf.get(i), buf.get(i + 1)) else {
        return false;
    };
    let level = i + 2 + usize::from(u16::from_be_bytes([hi, lo]));
    match buf.get(level) {
        Some(&b) if b & 0x80 != 0 && matches!(b & 0x7F, 3 | 4) => {
            buf[level] = b & 0x7F;
            true
        }
        _ => false,
    }
}

/// Reads the first packet, which must be CONNECT [MQTT-3.1.0-1]; true with it when the
/// client announced itself as a bridge (protocol level with 0x80, 3.1 and 3.1.1).
pub(super) async fn read_connect<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
    max_packet_size: u32,
    stats: &Counters,
) -> Result<(Box<Connect>, bool), ConnectError> {
    let mut bridge = false;
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
        if !bridge && matches!(codec::check_frame(buf, max_packet_size), Ok(Some(_))) {
            bridge = take_bridge_mark(buf);
        }
        match codec::decode(buf, ProtocolVersion::V311, max_packet_size) {
            Ok(Some(Packet::Connect(c))) => return Ok((c, bridge)),
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
            Ok(n) => Counters::add(&stats.bytes_received, n as u64),
        }
    }
}

pub(super) struct Accepted {
    pub(super) session: Arc<Session>,
    pub(super) link: Arc<Link>,
    pub(super) version: ProtocolVersion,
    /// Seconds; 0 = no keep alive.
    pub(super) keep_alive: u16,
    pub(super) client_limits: ClientLimits,
    pub(super) connack: Vec<u8>,
    /// The Authentication Method of an enhanced authentication, for re-authentication.
    pub(super) auth_method: Option<String>,
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

/// A client identifier for a client that sent an empty one [MQTT-3.1.3-6]: mosquitto's shape,
/// `auto-` and 36 characters laid out as a UUID (some clients and tests expect the length),
/// holding 128 random bits from the operating system, as mosquitto's do. Unpredictable, so
/// that nobody can guess another client's identifier and resume its session; and with 128
/// bits, an identifier meets no other, of this run or of the sessions stored by another.
///
/// Errors: the operating system's random source failed (the CONNECT is then refused).
fn assigned_client_id() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes)?;
    let n = u128::from_be_bytes(bytes);
    Ok(format!(
        "auto-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        n >> 96,
        (n >> 80) & 0xffff,
        (n >> 64) & 0xffff,
        (n >> 48) & 0xffff,
        n & 0xffff_ffff_ffff
    ))
}

/// The connection's side of an enhanced authentication exchange (MQTT 5.0 section 4.12):
/// sends AUTH 0x18 (Continue authentication) with the method and `data`, and returns the
/// Authentication Data of the client's answer, which must be AUTH 0x18 with the same method.
/// `Err`: the CONNACK reason code and why (the connection then closes).
#[async_trait::async_trait]
pub(super) trait AuthChannel: Send {
    async fn exchange(
        &mut self,
        method: &str,
        data: bytes::Bytes,
    ) -> Result<Option<bytes::Bytes>, (ReasonCode, String)>;
}

/// The reason code and words of a refusal.
fn denied(reason: DenyReason) -> (ReasonCode, String) {
    match reason {
        DenyReason::BadCredentials => (
            ReasonCode::BAD_USER_NAME_OR_PASSWORD,
            "bad user name or password".to_string(),
        ),
        DenyReason::NotAuthorized => (ReasonCode::NOT_AUTHORIZED, "not authorized".to_string()),
        DenyReason::Busy => (
            ReasonCode::SERVER_BUSY,
            "too many authentication checks waiting".to_string(),
        ),
    }
}

/// Runs an enhanced authentication exchange from its first step to its end: the user name
/// the client is known by and the last Authentication Data for it, or the refusal.
pub(super) async fn run_exchange(
    enhanced: &Arc<dyn crate::auth::hooks::EnhancedAuthenticator>,
    method: &str,
    info: &ConnectInfo,
    data: Option<bytes::Bytes>,
    channel: &mut dyn AuthChannel,
) -> Result<(Option<String>, Option<bytes::Bytes>), (ReasonCode, String)> {
    use crate::auth::hooks::AuthStep;
    let refused = AuthStep::Deny(DenyReason::NotAuthorized);
    let mut step = crate::hook::guard(
        "enhanced authenticator",
        &info.client_id,
        enhanced.start(method, info, data),
    )
    .await
    .unwrap_or(refused);
    loop {
        match step {
            AuthStep::Continue { data, next } => {
                let answer = channel.exchange(method, data).await?;
                step = crate::hook::guard(
                    "enhanced authenticator",
                    &info.client_id,
                    next.step(answer),
                )
                .await
                .unwrap_or(AuthStep::Deny(DenyReason::NotAuthorized));
            }
            AuthStep::Success { username, data } => return Ok((username, data)),
            AuthStep::Deny(reason) => return Err(denied(reason)),
        }
    }
}

/// What the checks of CONNECT found: the user name the client is known by, and, after an
/// enhanced authentication, its method and the last Authentication Data for the CONNACK.
struct Checked {
    username: Option<Arc<str>>,
    enhanced: Option<(String, Option<bytes::Bytes>)>,
}

/// The CONNECT checks of the authentication chain: authentication (with the TLS identity;
/// an Authentication Method's exchange through `channel`), then the will's topic, which the
/// client must be allowed to publish to. `Err` carries the CONNACK reason code and why.
async fn connect_checks(
    connect: &Connect,
    client_id: &str,
    peer: SocketAddr,
    tls: Option<TlsIdentity>,
    auth: &crate::auth::Auth,
    channel: &mut dyn AuthChannel,
) -> Result<Checked, (ReasonCode, String)> {
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
    let mut enhanced = None;
    let username = match &connect.properties.authentication_method {
        Some(method) => {
            let Some(e) = auth.enhanced_for(method) else {
                return Err((
                    ReasonCode::BAD_AUTHENTICATION_METHOD,
                    format!("authentication method {method:?} not supported"),
                ));
            };
            let data = connect.properties.authentication_data.clone();
            let (username, data) = run_exchange(e, method, &info, data, channel).await?;
            enhanced = Some((method.clone(), data));
            username.or_else(|| info.username.clone())
        }
        None => auth.authenticate(&info).await.map_err(denied)?,
    };
    if let Some(will) = &connect.will {
        if auth.checks_access()
            && !auth
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
    Ok(Checked {
        username: username.map(Arc::from),
        enhanced,
    })
}

/// Checks a CONNECT (MQTT 5.0 section 3.1.4), takes the session over or creates it, and
/// builds the CONNACK. `Err` carries a refusing CONNACK to send before closing.
pub(super) async fn accept(
    broker: &Arc<BrokerState>,
    connect: Box<Connect>,
    peer: SocketAddr,
    tls: Option<TlsIdentity>,
    deadline: tokio::time::Instant,
    listener: usize,
    channel: &mut dyn AuthChannel,
) -> Result<Accepted, Vec<u8>> {
    let mount = broker
        .config
        .listeners
        .get(listener)
        .and_then(|l| l.mount_point.as_deref());
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
    // The client's Maximum Packet Size binds every packet (checked for the CONNACK below).
    let client_max = props.maximum_packet_size.map_or(usize::MAX, |m| m as usize);

    // "It is a Protocol Error to include Authentication Data if there is no Authentication
    // Method" (5.0 section 3.1.2.11.10).
    if props.authentication_data.is_some() && props.authentication_method.is_none() {
        return Err(refuse(
            ReasonCode::PROTOCOL_ERROR,
            "Authentication Data without an Authentication Method",
        ));
    }
    // Client identifier [MQTT-3.1.3-6..9].
    let mut assigned = None;
    if connect.client_id.is_empty() && !server.allow_zero_length_clientid {
        return Err(refuse(
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            "empty client identifier and allow_zero_length_clientid = false",
        ));
    }
    // message_size_limit applies to the will's payload too; refused as mosquitto does
    // (5.0: Packet too large; 3.x has no such code: not authorized).
    let size_limit = server.message_size_limit;
    if let Some(w) = connect
        .will
        .as_ref()
        .filter(|w| size_limit > 0 && w.payload.len() > size_limit as usize)
    {
        let rc = if version.is_v5() {
            ReasonCode::PACKET_TOO_LARGE
        } else {
            ReasonCode::NOT_AUTHORIZED
        };
        return Err(refuse(
            rc,
            &format!(
                "will payload of {} bytes over message_size_limit",
                w.payload.len()
            ),
        ));
    }
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
                let id = match assigned_client_id() {
                    Ok(id) => id,
                    Err(e) => {
                        return Err(refuse(
                            ReasonCode::SERVER_UNAVAILABLE,
                            &format!("no random bytes for an assigned client identifier: {e}"),
                        ))
                    }
                };
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
    if client_id.starts_with(INTERNAL_PREFIX) {
        return Err(refuse(
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            "client identifier reserved for in-process subscriptions",
        ));
    }
    // Authentication: the hooks, then allow_anonymous and the password file.
    // The listener's own settings, or [auth]'s.
    let own_auth = broker
        .listener_auth
        .get(listener)
        .is_some_and(Option::is_some)
        .then_some(listener);
    let auth = broker.auth_of(own_auth);
    let certificate: Option<Arc<str>> = tls
        .as_ref()
        .and_then(|t| t.certificate_cn.as_deref())
        .map(Arc::from);
    // Within the connect_timeout the TLS handshake and CONNECT share: a check that waits
    // longer (a queue of slow password hashes) closes the connection without CONNACK.
    let checked = tokio::time::timeout_at(
        deadline,
        connect_checks(&connect, &client_id, peer, tls, auth, channel),
    )
    .await;
    let Checked { username, enhanced } = match checked {
        Ok(Ok(checked)) => checked,
        Ok(Err((rc, why))) => return Err(refuse(rc, &why)),
        Err(_) => {
            tracing::info!(%peer, %client_id, "authentication not done within connect_timeout: closing");
            return Err(Vec::new());
        }
    };
    // Keep alive and max_keepalive (0: no limit): a 5.0 client asking for more (or for none)
    // is told the Server Keep Alive [MQTT-3.2.2-21]; a 3.x client asking for more or for none
    // is refused with "identifier rejected", as mosquitto 2.0.12+ does (3.x cannot be told).
    let mut keep_alive = connect.keep_alive;
    let mut server_keep_alive = None;
    let over = server.max_keepalive != 0 && (keep_alive == 0 || keep_alive > server.max_keepalive);
    if over && version.is_v5() {
        keep_alive = server.max_keepalive;
        server_keep_alive = Some(keep_alive);
    } else if over {
        return Err(refuse(
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            "keep alive 0 or above max_keepalive",
        ));
    }
    // The will [MQTT-3.1.2-9..] and what the broker supports.
    let max_qos = QoS::from_u8(server.max_qos).unwrap_or(QoS::ExactlyOnce);
    let mut will = None;
    if let Some(w) = &connect.will {
        if topic::validate_topic_name(&w.topic).is_err()
            || (w.topic.starts_with("$SYS") && w.topic != bridge_state_topic(&client_id))
            || topic::level_count(&w.topic) > server.max_topic_levels
        {
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
                topic: super::mounted(mount, &w.topic),
                payload: w.payload.clone(),
                qos: w.qos,
                retain: w.retain,
                properties,
                expires_at: None,
                publisher: Some(Arc::clone(&client_id)),
                // A will retained is checked as any retained message (`check_retain_source`).
                source: (server.check_retain_source && w.retain).then(|| {
                    Box::new(crate::message::Source {
                        username: username.clone(),
                        listener: own_auth.and_then(|l| u32::try_from(l).ok()),
                    })
                }),
                encoded: Default::default(),
                stored: Default::default(),
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
        // The method again, with the exchange's last data (MQTT 5.0 section 4.12).
        if let Some((method, data)) = &enhanced {
            p.authentication_method = Some(method.clone());
            p.authentication_data = data.clone();
        }
    }
    // The Server MUST NOT send a packet larger than the client's Maximum Packet Size
    // [MQTT-3.1.2-24]: a client whose limit is below the CONNACK itself is closed without
    // one, before its session is touched (as mosquitto does).
    let connack_size = encode_connack(version, false, ReasonCode::SUCCESS, p.clone()).len();
    if let Some(max) = props
        .maximum_packet_size
        .filter(|&max| (max as usize) < connack_size)
    {
        tracing::info!(%peer, %client_id, "refusing CONNECT: its Maximum Packet Size ({max} bytes) is below the CONNACK's {connack_size} bytes [MQTT-3.1.2-24]: closed without CONNACK");
        return Err(Vec::new());
    }
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
    let taken = broker
        .take_session(
            &client_id,
            crate::broker::Owner {
                username: username.as_deref(),
                certificate: certificate.as_deref(),
            },
            connect.clean_start,
            version,
            expiry_interval,
            will,
        )
        .await;
    let (session, link, session_present) = match taken {
        Ok(taken) => taken,
        Err(e @ crate::broker::TakeError::Claimed(_)) => {
            return Err(refuse(ReasonCode::SERVER_BUSY, &e.to_string()))
        }
        Err(e) => {
            return Err(refuse(
                ReasonCode::SERVER_UNAVAILABLE,
                &format!("its session cannot be taken now: {e}"),
            ))
        }
    };

    broker.events.fire(|| Event::Connected {
        client_id: client_id.to_string(),
        username: username.as_deref().map(str::to_string),
        protocol: version,
        peer,
        clean_start: connect.clean_start,
        session_present,
    });
    // The identity first: the header stored next records the user name.
    {
        let mut st = session.state.lock();
        st.set_owner(username.clone(), certificate);
    }
    *session.identity.write() = crate::auth::Identity::Client {
        username,
        // A listener index fits (a broker has nowhere near 2^32 listeners).
        listener: own_auth.and_then(|l| u32::try_from(l).ok()),
    };
    if let Some(p) = broker.persist.get() {
        p.connected(&session, session_present);
    }

    let connack = encode_connack(version, session_present, ReasonCode::SUCCESS, p);
    link.set_max_packet_size(client_max);
    link.set_peer(peer);
    let client_limits = ClientLimits {
        inflight: server
            .max_inflight
            .min(props.receive_maximum.unwrap_or(u16::MAX))
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
        auth_method: enhanced.map(|(method, _)| method),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bridge_mark_is_taken_off_the_level() {
        // CONNECT, remaining length 12: "MQTT", level 0x84, flags, keep alive, empty id.
        let mut buf = BytesMut::from(
            &[
                0x10, 12, 0, 4, b'M', b'Q', b'T', b'T', 0x84, 0x02, 0, 60, 0, 0,
            ][..],
        );
        assert!(take_bridge_mark(&mut buf));
        assert_eq!(buf[8], 4);
        assert!(!take_bridge_mark(&mut buf));
        let mut v5 = BytesMut::from(
            &[
                0x10, 13, 0, 4, b'M', b'Q', b'T', b'T', 0x85, 0x02, 0, 60, 0, 0, 0,
            ][..],
        );
        assert!(
            !take_bridge_mark(&mut v5),
            "only 3.1 and 3.1.1 carry the mark"
        );
    }
}
