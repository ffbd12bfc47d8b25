//! One MQTT connection on the shared client (`mercurio_codec::client`): CONNECT / CONNACK,
//! keep alive pings, the acknowledgement flows of QoS 1 and 2 in both directions, Topic
//! Aliases received, and DISCONNECT are the client's; this module opens the transport, says
//! the client's errors as recado's [`Failure`]s and traces packets for -d. What the commands
//! see are [`Event`]s.

use std::sync::{Arc, Mutex};

use mercurio_codec::client::{
    Client, ClientError, ConnectOptions, Connection, Direction, MAX_PACKET,
};
use mercurio_core::codec::{
    ConnAck, Connect, Packet, Properties, ProtocolVersion, Publish, ReasonCode,
};

pub use mercurio_codec::client::Event;

use crate::exit::{Exit, Failure};
use crate::target::Target;
use crate::transport::{Transport, CONNECT_TIMEOUT};

/// A connected client.
pub struct Session {
    client: Client<Transport>,
    pub version: ProtocolVersion,
    pub connack: ConnAck,
}

/// The 3.x CONNACK return codes' names (MQTT 3.1.1 section 3.2.2.3).
fn v3_connack_name(code: u8) -> &'static str {
    ReasonCode::v3_connack_name(code)
}

/// A client error after the CONNACK, as recado says it.
fn failure(e: ClientError) -> Failure {
    match e {
        ClientError::Closed => Failure::lost("the broker closed the connection"),
        ClientError::Io(e) => Failure::lost(format!("connection lost: {e}")),
        ClientError::KeepAliveTimeout => Failure::lost(
            "connection lost: the broker did not answer PINGREQ within the keep alive",
        ),
        ClientError::Decode { error, .. } => {
            Failure::error(format!("the broker sent an invalid packet: {error}"))
        }
        ClientError::Encode { packet, error } => {
            Failure::usage(format!("cannot send {packet}: {error}"))
        }
        ClientError::Disconnected {
            reason,
            reason_string,
        } => {
            let why = reason_string
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            let message = format!(
                "the broker disconnected this client: reason code 0x{:02X} {}{why}",
                reason.0,
                reason.name()
            );
            // Taken over by another connection, or sent elsewhere: connecting again here
            // would not help.
            let again = !matches!(
                reason,
                ReasonCode::SESSION_TAKEN_OVER
                    | ReasonCode::USE_ANOTHER_SERVER
                    | ReasonCode::SERVER_MOVED
            );
            if again {
                Failure::lost(message)
            } else {
                Failure::error(message)
            }
        }
        ClientError::UnknownTopicAlias(alias) => Failure::error(format!(
            "the broker used Topic Alias {alias} before setting it"
        )),
        ClientError::UnexpectedAuth => {
            Failure::error("the broker started an AUTH exchange, which recado does not support")
        }
        ClientError::UnexpectedPacket(name) => Failure::error(format!(
            "the broker sent {name}, which a broker never sends"
        )),
        other => Failure::error(other.to_string()),
    }
}

/// An error of the CONNECT / CONNACK exchange, as recado says it: [`Exit::ConnackRefused`]
/// for a refusal, [`Exit::Unreachable`] when no CONNACK came.
fn connect_failure(e: ClientError, target: &Target, version: ProtocolVersion) -> Failure {
    match e {
        ClientError::ConnackTimeout(_) => Failure::new(
            Exit::Unreachable,
            format!("{} sent no CONNACK within 10 seconds", target.display()),
        ),
        ClientError::Refused {
            code,
            version: answered,
            reason_string,
        } => {
            if version.is_v5() && !answered.is_v5() {
                return Failure::new(
                    Exit::ConnackRefused,
                    "the broker refused the connection: return code 1 (unacceptable protocol \
                     version): it does not speak MQTT 5, try -V mqttv311",
                );
            }
            let why = if version.is_v5() {
                format!("reason code 0x{:02X} {}", code.0, code.name())
            } else {
                format!("return code {} ({})", code.0, v3_connack_name(code.0))
            };
            let reason_string = reason_string
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            Failure::new(
                Exit::ConnackRefused,
                format!("the broker refused the connection: {why}{reason_string}"),
            )
        }
        ClientError::NotConnAck(name) => Failure::error(format!(
            "the broker answered CONNECT with {name} instead of CONNACK"
        )),
        ClientError::Encode { packet, error } => {
            Failure::usage(format!("cannot send {packet}: {error}"))
        }
        other => {
            let message = match other {
                ClientError::Closed => "the broker closed the connection".to_string(),
                ClientError::Io(e) => format!("connection lost: {e}"),
                ClientError::Decode { error, first_byte } => {
                    // A TLS record (an alert, 0x15, or a handshake, 0x16) where MQTT was
                    // expected: a plain client on a TLS port. No server packet starts so.
                    let hint = match first_byte {
                        Some(0x15 | 0x16) => {
                            " (it looks like TLS: for a TLS port use --cafile FILE or an mqtts:// URL)"
                        }
                        _ => "",
                    };
                    format!("the broker sent an invalid packet: {error}{hint}")
                }
                other => other.to_string(),
            };
            Failure::new(
                Exit::Unreachable,
                format!("no CONNACK from {}: {message}", target.display()),
            )
        }
    }
}

impl Session {
    /// Connects to `target`, sends `connect` and waits for CONNACK (10 seconds at most).
    /// Errors: [`Exit::Unreachable`] (no connection, no CONNACK), [`Exit::ConnackRefused`]
    /// (the code and its name in the message).
    pub async fn open(target: &Target, connect: Connect, debug: bool) -> Result<Session, Failure> {
        let transport = Transport::open(target).await?;
        let version = connect.protocol;
        let max_packet = connect.properties.maximum_packet_size.unwrap_or(MAX_PACKET);
        let mut conn = Connection::new(transport, version, max_packet);
        // The client identifier -d names: the one sent, then the one assigned, if any.
        let traced_id = Arc::new(Mutex::new(connect.client_id.clone()));
        if debug {
            let id = Arc::clone(&traced_id);
            conn.on_packet(move |direction, packet| {
                let id = id.lock().map(|id| id.clone()).unwrap_or_default();
                let verb = match direction {
                    Direction::Sent => "sending",
                    Direction::Received => "received",
                };
                eprintln!("Client {id} {verb} {}", describe(packet));
            });
        }
        let options = ConnectOptions {
            connack_timeout: CONNECT_TIMEOUT,
            bridge_bit: false,
        };
        let client = Client::connect(conn, &connect, &options)
            .await
            .map_err(|e| connect_failure(e, target, version))?;
        if let Ok(mut id) = traced_id.lock() {
            *id = client.client_id().to_string();
        }
        Ok(Session {
            version,
            connack: client.connack().clone(),
            client,
        })
    }

    /// The next packet identifier (1 to 65,535, never 0 [MQTT-2.2.1-3]).
    pub fn next_packet_id(&mut self) -> u16 {
        self.client.next_packet_id()
    }

    /// The broker's Receive Maximum: how many QoS 1 and 2 messages may await their
    /// acknowledgement at once (65,535 when it says nothing, MQTT 5.0 section 3.2.2.3.3).
    pub fn receive_maximum(&self) -> u16 {
        self.client.receive_maximum()
    }

    /// The broker's Maximum QoS (2 when it says nothing).
    pub fn maximum_qos(&self) -> u8 {
        self.client.maximum_qos()
    }

    /// How many QoS 1 and 2 messages published await their acknowledgement.
    pub fn in_flight(&self) -> usize {
        self.client.in_flight()
    }

    /// Whether a whole packet from the broker is already read, so that [`Session::next`]
    /// has it without waiting.
    pub fn packet_buffered(&self) -> bool {
        self.client.packet_buffered()
    }

    /// Encodes and sends one packet.
    pub async fn send(&mut self, packet: &Packet) -> Result<(), Failure> {
        self.client.send(packet).await.map_err(sending)
    }

    /// Publishes (a packet identifier is allocated for QoS 1 and 2 and returned); its end
    /// comes as [`Event::Published`].
    pub async fn publish(&mut self, publish: Publish) -> Result<u16, Failure> {
        self.client.publish(publish).await.map_err(sending)
    }

    /// Sends DISCONNECT (with `properties`, MQTT 5) and closes the connection.
    pub async fn disconnect(&mut self, properties: Properties) -> Result<(), Failure> {
        self.client
            .disconnect(ReasonCode::NORMAL_DISCONNECTION, properties)
            .await
            .map_err(sending)
    }

    /// Waits for the next [`Event`], answering pings and acknowledgement steps meanwhile.
    /// Cancel safe between packets. Errors: the connection closed or lost, a DISCONNECT from
    /// the broker (its reason in the message), no PINGRESP within the keep alive.
    pub async fn next(&mut self) -> Result<Event, Failure> {
        self.client.next().await.map_err(failure)
    }
}

/// An error writing a packet, as recado says it.
fn sending(e: ClientError) -> Failure {
    match e {
        ClientError::Io(e) => Failure::lost(format!("connection lost while sending: {e}")),
        other => failure(other),
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
