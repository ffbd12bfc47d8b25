//! One MQTT connection on mercurio-core's codec: CONNECT / CONNACK, keep alive pings, the
//! acknowledgement flows of QoS 1 and 2 in both directions, Topic Aliases received, and
//! DISCONNECT. What the commands see are [`Event`]s.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bytes::BytesMut;
use mercurio_core::codec::{
    self, ConnAck, Connect, Disconnect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS,
    ReasonCode, SubAck, UnsubAck,
};
use tokio::time::Instant;

use crate::exit::{Exit, Failure};
use crate::target::Target;
use crate::transport::{Transport, CONNECT_TIMEOUT};

/// Largest packet accepted from the broker when CONNECT sets no Maximum Packet Size: the
/// largest MQTT allows.
const MAX_PACKET: u32 = 268_435_460;

/// What the broker sent that a command acts on; everything else (pings, the QoS 2
/// handshake steps) the session answers itself.
#[derive(Debug)]
pub enum Event {
    /// An application message (its topic restored if it came with a Topic Alias).
    Publish(Publish),
    /// A message this client published is done: PUBACK (QoS 1), PUBCOMP (QoS 2), or a
    /// PUBREC with a failure reason code (QoS 2 stops there).
    Published {
        packet_id: u16,
        reason: ReasonCode,
    },
    SubAck(SubAck),
    UnsubAck(UnsubAck),
}

/// A connected client.
pub struct Session {
    transport: Transport,
    rbuf: BytesMut,
    pub version: ProtocolVersion,
    pub client_id: String,
    pub connack: ConnAck,
    keep_alive: Option<Duration>,
    last_sent: Instant,
    ping_sent: Option<Instant>,
    next_id: u16,
    /// Topic Aliases the broker set (MQTT 5.0 section 3.3.2.3.4).
    aliases: HashMap<u16, String>,
    /// QoS 2 messages received, PUBREC sent, PUBREL not yet: a resend is not delivered twice.
    qos2_in: HashSet<u16>,
    max_packet: u32,
    debug: bool,
}

/// The 3.x CONNACK return codes' names (MQTT 3.1.1 section 3.2.2.3).
fn v3_connack_name(code: u8) -> &'static str {
    match code {
        1 => "unacceptable protocol version",
        2 => "identifier rejected",
        3 => "server unavailable",
        4 => "bad user name or password",
        5 => "not authorized",
        _ => "unknown return code",
    }
}

impl Session {
    /// Connects to `target`, sends `connect` and waits for CONNACK (10 seconds at most).
    /// Errors: [`Exit::Unreachable`] (no connection, no CONNACK), [`Exit::ConnackRefused`]
    /// (the code and its name in the message).
    pub async fn open(target: &Target, connect: Connect, debug: bool) -> Result<Session, Failure> {
        let transport = Transport::open(target).await?;
        let version = connect.protocol;
        let keep_alive =
            (connect.keep_alive > 0).then(|| Duration::from_secs(connect.keep_alive.into()));
        let mut s = Session {
            transport,
            rbuf: BytesMut::with_capacity(8192),
            version,
            client_id: connect.client_id.clone(),
            connack: ConnAck::default(),
            keep_alive,
            last_sent: Instant::now(),
            ping_sent: None,
            next_id: 0,
            aliases: HashMap::new(),
            qos2_in: HashSet::new(),
            max_packet: connect.properties.maximum_packet_size.unwrap_or(MAX_PACKET),
            debug,
        };
        s.send(&Packet::Connect(Box::new(connect))).await?;
        let ack = match tokio::time::timeout(CONNECT_TIMEOUT, s.read_connack()).await {
            Err(_) => {
                return Err(Failure::new(
                    Exit::Unreachable,
                    format!("{} sent no CONNACK within 10 seconds", target.display()),
                ))
            }
            Ok(Err(f)) if f.exit == Exit::ConnackRefused => return Err(f),
            Ok(Err(f)) => {
                return Err(Failure::new(
                    Exit::Unreachable,
                    format!("no CONNACK from {}: {}", target.display(), f.message),
                ))
            }
            Ok(Ok(Packet::ConnAck(ack))) => ack,
            Ok(Ok(other)) => {
                return Err(Failure::error(format!(
                    "the broker answered CONNECT with {} instead of CONNACK",
                    other.name()
                )))
            }
        };
        if ack.reason_code.0 != 0 {
            let code = ack.reason_code;
            let why = if version.is_v5() {
                format!("reason code 0x{:02X} {}", code.0, code.name())
            } else {
                format!("return code {} ({})", code.0, v3_connack_name(code.0))
            };
            let reason_string = ack
                .properties
                .reason_string
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            return Err(Failure::new(
                Exit::ConnackRefused,
                format!("the broker refused the connection: {why}{reason_string}"),
            ));
        }
        if let Some(id) = &ack.properties.assigned_client_identifier {
            s.client_id = id.clone();
        }
        if let Some(ka) = ack.properties.server_keep_alive {
            // The broker's Server Keep Alive replaces ours [MQTT-3.2.2-21].
            s.keep_alive = (ka > 0).then(|| Duration::from_secs(ka.into()));
        }
        s.connack = ack;
        Ok(s)
    }

    /// The next packet identifier (1 to 65,535, never 0 [MQTT-2.2.1-3]).
    pub fn next_packet_id(&mut self) -> u16 {
        self.next_id = self.next_id.wrapping_add(1);
        if self.next_id == 0 {
            self.next_id = 1;
        }
        self.next_id
    }

    /// The broker's Receive Maximum: how many QoS 1 and 2 messages may await their
    /// acknowledgement at once (65,535 when it says nothing, MQTT 5.0 section 3.2.2.3.3).
    pub fn receive_maximum(&self) -> u16 {
        self.connack.properties.receive_maximum.unwrap_or(u16::MAX)
    }

    /// The broker's Maximum QoS (2 when it says nothing).
    pub fn maximum_qos(&self) -> u8 {
        self.connack.properties.maximum_qos.unwrap_or(2)
    }

    /// Encodes and sends one packet.
    pub async fn send(&mut self, packet: &Packet) -> Result<(), Failure> {
        let mut out = BytesMut::with_capacity(64);
        codec::encode(packet, self.version, &mut out)
            .map_err(|e| Failure::usage(format!("cannot send {}: {e}", packet.name())))?;
        if self.debug {
            eprintln!("Client {} sending {}", self.client_id, describe(packet));
        }
        self.transport
            .write(&out)
            .await
            .map_err(|e| Failure::lost(format!("connection lost while sending: {e}")))?;
        self.last_sent = Instant::now();
        Ok(())
    }

    /// Sends DISCONNECT (with `properties`, MQTT 5) and closes the connection.
    pub async fn disconnect(&mut self, properties: Properties) -> Result<(), Failure> {
        self.send(&Packet::Disconnect(Disconnect {
            reason_code: ReasonCode::NORMAL_DISCONNECTION,
            properties,
        }))
        .await?;
        self.transport.close().await;
        Ok(())
    }

    /// Reads the CONNACK. A broker without MQTT 5 answers a 5.0 CONNECT with a 3.1.1
    /// CONNACK (return code 1, unacceptable protocol version), which is not a valid 5.0
    /// CONNACK: it is reported as the refusal it is.
    async fn read_connack(&mut self) -> Result<Packet, Failure> {
        if self.version.is_v5() {
            while self.rbuf.len() < 4 {
                match self.transport.read(&mut self.rbuf).await {
                    Ok(0) => return Err(Failure::error("the broker closed the connection")),
                    Ok(_) => {}
                    Err(e) => return Err(Failure::error(format!("connection lost: {e}"))),
                }
            }
            if self.rbuf[..4] == [0x20, 0x02, 0x00, 0x01] {
                return Err(Failure::new(
                    Exit::ConnackRefused,
                    "the broker refused the connection: return code 1 (unacceptable protocol \
                     version): it does not speak MQTT 5, try -V mqttv311",
                ));
            }
        }
        self.read_packet().await
    }

    /// Reads the next whole packet (no keep alive handling; used for CONNACK).
    async fn read_packet(&mut self) -> Result<Packet, Failure> {
        loop {
            // The decoder may consume what it rejects: the first byte, kept for the hint below.
            let first = self.rbuf.first().copied();
            match codec::decode(&mut self.rbuf, self.version, self.max_packet) {
                Ok(Some(p)) => {
                    if self.debug {
                        eprintln!("Client {} received {}", self.client_id, describe(&p));
                    }
                    return Ok(p);
                }
                Ok(None) => {}
                Err(e) => {
                    // A TLS record (an alert, 0x15, or a handshake, 0x16) where MQTT was
                    // expected: a plain client on a TLS port. No server packet starts so.
                    let hint = match first {
                        Some(0x15 | 0x16) => {
                            " (it looks like TLS: for a TLS port use --cafile FILE or an mqtts:// URL)"
                        }
                        _ => "",
                    };
                    return Err(Failure::error(format!(
                        "the broker sent an invalid packet: {e}{hint}"
                    )));
                }
            }
            match self.transport.read(&mut self.rbuf).await {
                Ok(0) => {
                    return Err(Failure::error("the broker closed the connection"));
                }
                Ok(_) => {}
                Err(e) => return Err(Failure::error(format!("connection lost: {e}"))),
            }
        }
    }

    /// When the next keep alive action is due: a PINGREQ after `keep_alive` without sending,
    /// or the end of the wait for PINGRESP.
    fn ping_deadline(&self) -> Option<Instant> {
        let ka = self.keep_alive?;
        Some(match self.ping_sent {
            Some(sent) => sent + ka,
            None => self.last_sent + ka,
        })
    }

    /// Waits for the next [`Event`], answering pings and acknowledgement steps meanwhile.
    /// Cancel safe between packets. Errors: the connection closed or lost, a DISCONNECT from
    /// the broker (its reason in the message), no PINGRESP within the keep alive.
    pub async fn next(&mut self) -> Result<Event, Failure> {
        loop {
            if let Some(packet) = self.try_decode()? {
                if let Some(event) = self.handle(packet).await? {
                    return Ok(event);
                }
                continue;
            }
            let deadline = self.ping_deadline();
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            let read = tokio::select! {
                read = self.transport.read(&mut self.rbuf) => Some(read),
                () = sleep => None,
            };
            match read {
                Some(Ok(0)) => return Err(Failure::lost("the broker closed the connection")),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(Failure::lost(format!("connection lost: {e}"))),
                None => {
                    if self.ping_sent.is_some() {
                        return Err(Failure::lost(
                            "connection lost: the broker did not answer PINGREQ within the keep alive",
                        ));
                    }
                    self.send(&Packet::PingReq).await?;
                    self.ping_sent = Some(Instant::now());
                }
            }
        }
    }

    fn try_decode(&mut self) -> Result<Option<Packet>, Failure> {
        match codec::decode(&mut self.rbuf, self.version, self.max_packet) {
            Ok(Some(p)) => {
                if self.debug {
                    eprintln!("Client {} received {}", self.client_id, describe(&p));
                }
                Ok(Some(p))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(Failure::error(format!(
                "the broker sent an invalid packet: {e}"
            ))),
        }
    }

    async fn handle(&mut self, packet: Packet) -> Result<Option<Event>, Failure> {
        match packet {
            Packet::PingResp => {
                self.ping_sent = None;
                Ok(None)
            }
            Packet::Publish(mut p) => {
                if let Some(alias) = p.properties.topic_alias {
                    if p.topic.is_empty() {
                        match self.aliases.get(&alias) {
                            Some(t) => p.topic = t.clone(),
                            None => {
                                return Err(Failure::error(format!(
                                    "the broker used Topic Alias {alias} before setting it"
                                )))
                            }
                        }
                    } else {
                        self.aliases.insert(alias, p.topic.clone());
                    }
                }
                match p.qos {
                    QoS::AtMostOnce => Ok(Some(Event::Publish(p))),
                    QoS::AtLeastOnce => {
                        self.send(&Packet::PubAck(PubAck {
                            packet_id: p.packet_id,
                            ..PubAck::default()
                        }))
                        .await?;
                        Ok(Some(Event::Publish(p)))
                    }
                    QoS::ExactlyOnce => {
                        let first = self.qos2_in.insert(p.packet_id);
                        self.send(&Packet::PubRec(PubAck {
                            packet_id: p.packet_id,
                            ..PubAck::default()
                        }))
                        .await?;
                        Ok(first.then_some(Event::Publish(p)))
                    }
                }
            }
            Packet::PubRel(rel) => {
                self.qos2_in.remove(&rel.packet_id);
                self.send(&Packet::PubComp(PubAck {
                    packet_id: rel.packet_id,
                    ..PubAck::default()
                }))
                .await?;
                Ok(None)
            }
            Packet::PubAck(ack) | Packet::PubComp(ack) => Ok(Some(Event::Published {
                packet_id: ack.packet_id,
                reason: ack.reason_code,
            })),
            Packet::PubRec(rec) => {
                if rec.reason_code.is_failure() {
                    return Ok(Some(Event::Published {
                        packet_id: rec.packet_id,
                        reason: rec.reason_code,
                    }));
                }
                self.send(&Packet::PubRel(PubAck {
                    packet_id: rec.packet_id,
                    ..PubAck::default()
                }))
                .await?;
                Ok(None)
            }
            Packet::SubAck(a) => Ok(Some(Event::SubAck(a))),
            Packet::UnsubAck(a) => Ok(Some(Event::UnsubAck(a))),
            Packet::Disconnect(d) => {
                let reason = d
                    .properties
                    .reason_string
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default();
                let message = format!(
                    "the broker disconnected this client: reason code 0x{:02X} {}{reason}",
                    d.reason_code.0,
                    d.reason_code.name()
                );
                // Taken over by another connection, or sent elsewhere: connecting again
                // here would not help.
                let again = !matches!(
                    d.reason_code,
                    ReasonCode::SESSION_TAKEN_OVER
                        | ReasonCode::USE_ANOTHER_SERVER
                        | ReasonCode::SERVER_MOVED
                );
                Err(if again {
                    Failure::lost(message)
                } else {
                    Failure::error(message)
                })
            }
            Packet::Auth(_) => Err(Failure::error(
                "the broker started an AUTH exchange, which recado does not support",
            )),
            other => Err(Failure::error(format!(
                "the broker sent {}, which a broker never sends",
                other.name()
            ))),
        }
    }
}

/// One line about a packet for -d, in the spirit of mosquitto's debug output.
pub fn describe(p: &Packet) -> String {
    match p {
        Packet::Connect(c) => format!(
            "CONNECT (p{}, c{}, k{}, u{}, w{})",
            c.protocol.level(),
            u8::from(c.clean_start),
            c.keep_alive,
            u8::from(c.username.is_some()),
            u8::from(c.will.is_some()),
        ),
        Packet::ConnAck(a) => format!(
            "CONNACK (s{}, 0x{:02X})",
            u8::from(a.session_present),
            a.reason_code.0
        ),
        Packet::Publish(p) => format!(
            "PUBLISH (d{}, q{}, r{}, m{}, '{}', ... ({} bytes))",
            u8::from(p.dup),
            p.qos as u8,
            u8::from(p.retain),
            p.packet_id,
            p.topic,
            p.payload.len()
        ),
        Packet::PubAck(a) | Packet::PubRec(a) | Packet::PubRel(a) | Packet::PubComp(a) => {
            format!("{} (m{}, rc{})", p.name(), a.packet_id, a.reason_code.0)
        }
        Packet::Subscribe(s) => {
            let filters: Vec<String> = s
                .filters
                .iter()
                .map(|f| format!("{} (QoS {})", f.filter, f.options.qos as u8))
                .collect();
            format!("SUBSCRIBE (m{}, {})", s.packet_id, filters.join(", "))
        }
        Packet::SubAck(a) => {
            let codes: Vec<String> = a.reason_codes.iter().map(|c| c.0.to_string()).collect();
            format!("SUBACK (m{}, {})", a.packet_id, codes.join(", "))
        }
        Packet::Unsubscribe(u) => {
            format!("UNSUBSCRIBE (m{}, {})", u.packet_id, u.filters.join(", "))
        }
        Packet::UnsubAck(a) => format!("UNSUBACK (m{})", a.packet_id),
        Packet::Disconnect(d) => format!("DISCONNECT (0x{:02X})", d.reason_code.0),
        Packet::Auth(a) => format!("AUTH (0x{:02X})", a.reason_code.0),
        Packet::PingReq | Packet::PingResp => p.name().to_string(),
    }
}
