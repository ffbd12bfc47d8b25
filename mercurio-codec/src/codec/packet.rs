//! The MQTT control packets as plain data, for protocol versions 3.1, 3.1.1 and 5.0.
//!
//! One type per packet of the specifications (MQTT 3.1.1 section 3, MQTT 5.0 section 3).
//! Fields that exist only in 5.0 (properties, reason codes other than the CONNACK return
//! code) are ignored by the encoder for 3.x and left at their defaults by the decoder.

use bytes::Bytes;

use super::properties::Properties;
use super::reason::ReasonCode;

/// The protocol level announced in CONNECT (MQTT 5.0 section 3.1.2.2).
///
/// `V31` is MQTT 3.1 (protocol name `MQIsdp`, level 3), `V311` is MQTT 3.1.1 (`MQTT`, level 4)
/// and `V5` is MQTT 5.0 (`MQTT`, level 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProtocolVersion {
    /// MQTT 3.1, protocol name `MQIsdp`, level 3.
    V31,
    /// MQTT 3.1.1, protocol name `MQTT`, level 4.
    V311,
    /// MQTT 5.0, protocol name `MQTT`, level 5.
    V5,
}

impl ProtocolVersion {
    /// The protocol level byte of CONNECT: 3, 4 or 5.
    pub fn level(self) -> u8 {
        match self {
            ProtocolVersion::V31 => 3,
            ProtocolVersion::V311 => 4,
            ProtocolVersion::V5 => 5,
        }
    }

    /// True for 5.0, the only version with properties and reason codes.
    pub fn is_v5(self) -> bool {
        self == ProtocolVersion::V5
    }
}

/// Quality of service of a PUBLISH or a subscription (MQTT 5.0 section 4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum QoS {
    /// QoS 0: at most once.
    #[default]
    AtMostOnce = 0,
    /// QoS 1: at least once.
    AtLeastOnce = 1,
    /// QoS 2: exactly once.
    ExactlyOnce = 2,
}

impl QoS {
    /// The QoS for a two-bit value; `None` for 3, which is malformed [MQTT-3.3.1-4].
    pub fn from_u8(v: u8) -> Option<QoS> {
        match v {
            0 => Some(QoS::AtMostOnce),
            1 => Some(QoS::AtLeastOnce),
            2 => Some(QoS::ExactlyOnce),
            _ => None,
        }
    }
}

/// Any MQTT control packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    Connect(Box<Connect>),
    ConnAck(ConnAck),
    Publish(Publish),
    PubAck(PubAck),
    PubRec(PubAck),
    PubRel(PubAck),
    PubComp(PubAck),
    Subscribe(Subscribe),
    SubAck(SubAck),
    Unsubscribe(Unsubscribe),
    UnsubAck(UnsubAck),
    PingReq,
    PingResp,
    Disconnect(Disconnect),
    /// AUTH exists in 5.0 only (section 3.15).
    Auth(Auth),
}

impl Packet {
    /// The packet type's name as the specification writes it ("CONNECT", "PUBLISH", ...).
    pub fn name(&self) -> &'static str {
        match self {
            Packet::Connect(_) => "CONNECT",
            Packet::ConnAck(_) => "CONNACK",
            Packet::Publish(_) => "PUBLISH",
            Packet::PubAck(_) => "PUBACK",
            Packet::PubRec(_) => "PUBREC",
            Packet::PubRel(_) => "PUBREL",
            Packet::PubComp(_) => "PUBCOMP",
            Packet::Subscribe(_) => "SUBSCRIBE",
            Packet::SubAck(_) => "SUBACK",
            Packet::Unsubscribe(_) => "UNSUBSCRIBE",
            Packet::UnsubAck(_) => "UNSUBACK",
            Packet::PingReq => "PINGREQ",
            Packet::PingResp => "PINGRESP",
            Packet::Disconnect(_) => "DISCONNECT",
            Packet::Auth(_) => "AUTH",
        }
    }
}

/// CONNECT (MQTT 5.0 section 3.1, 3.1.1 section 3.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    pub protocol: ProtocolVersion,
    /// Clean Session (3.x) or Clean Start (5.0).
    pub clean_start: bool,
    /// Keep Alive in seconds; 0 turns the mechanism off.
    pub keep_alive: u16,
    /// May be empty (MQTT 5.0 section 3.1.3.1).
    pub client_id: String,
    pub will: Option<LastWill>,
    pub username: Option<String>,
    pub password: Option<Bytes>,
    /// CONNECT properties (5.0 only).
    pub properties: Properties,
}

impl Connect {
    /// A CONNECT of `protocol` for `client_id` with Clean Start (Clean Session in 3.x) set,
    /// the keep alive off (0 s), no will, no user name or password and no properties; the
    /// fields are public to change any of these.
    pub fn new(protocol: ProtocolVersion, client_id: impl Into<String>) -> Connect {
        Connect {
            protocol,
            clean_start: true,
            keep_alive: 0,
            client_id: client_id.into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        }
    }
}

/// The Will Message of a CONNECT (MQTT 5.0 section 3.1.3.2 - 3.1.3.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastWill {
    pub topic: String,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    /// Will properties (5.0 only): will delay interval, payload format indicator, message
    /// expiry interval, content type, response topic, correlation data, user properties.
    pub properties: Properties,
}

/// CONNACK (MQTT 5.0 section 3.2).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnAck {
    pub session_present: bool,
    /// In 3.x the CONNACK return code (0 to 5, see [`ReasonCode::to_v3_connack`]);
    /// in 5.0 the reason code.
    pub reason_code: ReasonCode,
    pub properties: Properties,
}

/// PUBLISH (MQTT 5.0 section 3.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub dup: bool,
    pub qos: QoS,
    pub retain: bool,
    /// The topic name; empty in 5.0 when a Topic Alias stands for it.
    pub topic: String,
    /// Packet identifier; 0 for QoS 0 (which carries none).
    pub packet_id: u16,
    pub properties: Properties,
    /// The application message. The decoder gives it an allocation of its own (never a
    /// slice of the read buffer), so a queued message pins nothing else.
    pub payload: Bytes,
}

/// A borrowed PUBLISH for encoding a message held elsewhere (a shared, queued message)
/// without building an owned [`Publish`] per subscriber.
#[derive(Debug, Clone, Copy)]
pub struct PublishRef<'a> {
    pub dup: bool,
    pub qos: QoS,
    pub retain: bool,
    pub topic: &'a str,
    pub packet_id: u16,
    pub properties: &'a Properties,
    pub payload: &'a [u8],
}

/// PUBACK, PUBREC, PUBREL and PUBCOMP share this shape (MQTT 5.0 sections 3.4 - 3.7).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PubAck {
    pub packet_id: u16,
    /// 5.0 only; 0x00 Success in 3.x.
    pub reason_code: ReasonCode,
    pub properties: Properties,
}

/// Subscription Options of one topic filter (MQTT 5.0 section 3.8.3.1).
/// In 3.x only `qos` exists; the others stay at their defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SubscriptionOptions {
    /// Maximum QoS.
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    /// 0: send retained messages at subscribe; 1: only if the subscription is new; 2: never.
    pub retain_handling: u8,
}

/// One topic filter of a SUBSCRIBE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeFilter {
    pub filter: String,
    pub options: SubscriptionOptions,
}

impl SubscribeFilter {
    /// `filter` at maximum QoS `qos`, the other Subscription Options at their defaults (No
    /// Local and Retain As Published off, Retain Handling 0: retained messages sent at
    /// subscribe).
    pub fn new(filter: impl Into<String>, qos: QoS) -> SubscribeFilter {
        SubscribeFilter {
            filter: filter.into(),
            options: SubscriptionOptions {
                qos,
                ..SubscriptionOptions::default()
            },
        }
    }
}

/// SUBSCRIBE (MQTT 5.0 section 3.8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscribe {
    pub packet_id: u16,
    /// At least one [MQTT-3.8.3-2].
    pub filters: Vec<SubscribeFilter>,
    /// 5.0: subscription identifier and user properties.
    pub properties: Properties,
}

/// SUBACK (MQTT 5.0 section 3.9). In 3.x a return code per filter: 0, 1, 2 or 0x80.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubAck {
    pub packet_id: u16,
    pub reason_codes: Vec<ReasonCode>,
    pub properties: Properties,
}

/// UNSUBSCRIBE (MQTT 5.0 section 3.10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsubscribe {
    pub packet_id: u16,
    /// At least one [MQTT-3.10.3-2].
    pub filters: Vec<String>,
    pub properties: Properties,
}

/// UNSUBACK (MQTT 5.0 section 3.11). `reason_codes` is empty in 3.x, which has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsubAck {
    pub packet_id: u16,
    pub reason_codes: Vec<ReasonCode>,
    pub properties: Properties,
}

/// DISCONNECT (MQTT 5.0 section 3.14). In 3.x it has no body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Disconnect {
    pub reason_code: ReasonCode,
    pub properties: Properties,
}

/// AUTH (MQTT 5.0 section 3.15).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Auth {
    pub reason_code: ReasonCode,
    pub properties: Properties,
}
