//! Errors of the codec: what can go wrong decoding bytes from a peer ([`DecodeError`]) and
//! what cannot be put on the wire ([`EncodeError`]).

use super::packet::ProtocolVersion;
use super::reason::ReasonCode;

/// Why a packet could not be decoded.
///
/// Every variant is fatal for the connection: the broker answers with the reason code
/// [`DecodeError::reason_code`] names (a DISCONNECT in 5.0, or a CONNACK when the packet was
/// CONNECT) and closes it (MQTT 5.0 section 4.13). "More bytes are needed" is never an error:
/// [`check_frame`](super::check_frame) and [`decode`](super::decode()) return `Ok(None)` for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes do not follow the specification's grammar (MQTT 5.0 section 1.2 "Malformed
    /// Packet"): bad flag bits, truncated fields, trailing bytes, invalid UTF-8, ...
    /// The text says which rule was broken. Reason code 0x81.
    #[error("malformed packet: {0}")]
    MalformedPacket(&'static str),
    /// The packet parses but breaks a rule of the protocol (MQTT 5.0 section 1.2 "Protocol
    /// Error"): a property given twice, a zero Receive Maximum, ... Reason code 0x82.
    #[error("protocol error: {0}")]
    ProtocolError(&'static str),
    /// The fixed header announces a packet of `size` bytes (fixed header included), more
    /// than the `max` bytes allowed (MQTT 5.0 section 3.1.2.11.4 / 3.2.2.3.6). Returned as soon
    /// as the remaining length is known, before the body is buffered. Reason code 0x95.
    #[error("packet of {size} bytes exceeds the maximum packet size of {max} bytes")]
    PacketTooLarge {
        /// Total size announced: fixed header plus remaining length, in bytes.
        size: usize,
        /// The maximum packet size in force, in bytes.
        max: u32,
    },
    /// CONNECT with a known protocol name (`MQTT` or `MQIsdp`) but a protocol level this
    /// name does not go with (MQTT 3.1.1 [MQTT-3.1.2-2], MQTT 5.0 section 3.1.2.2). The broker
    /// answers CONNACK return code 1 (3.x) or reason code 0x84 (5.0) and closes.
    #[error("unsupported protocol level {level}")]
    UnsupportedProtocolVersion {
        /// The protocol level byte the client sent.
        level: u8,
    },
    /// CONNECT whose protocol name is neither `MQTT` nor `MQIsdp`: the peer does not speak
    /// MQTT, the broker closes the connection without CONNACK [MQTT-3.1.2-1].
    /// [`DecodeError::reason_code`] gives 0x84, the code 5.0 allows should one be sent.
    #[error("invalid protocol name")]
    InvalidProtocolName,
    /// A Will Topic that breaks the topic rules: a wildcard character [MQTT-3.3.2-2], or empty
    /// [MQTT-4.7.3-1]. Reason code 0x90 (CONNACK). The same in a PUBLISH topic is a
    /// `ProtocolError`.
    #[error("invalid topic name: {0}")]
    TopicNameInvalid(&'static str),
}

impl DecodeError {
    /// The MQTT 5.0 reason code for this error, for the DISCONNECT (or CONNACK) the broker
    /// sends before closing: 0x81 Malformed Packet, 0x82 Protocol Error, 0x95 Packet too
    /// large, 0x84 Unsupported Protocol Version, 0x90 Topic Name invalid.
    pub fn reason_code(&self) -> ReasonCode {
        match self {
            DecodeError::MalformedPacket(_) => ReasonCode::MALFORMED_PACKET,
            DecodeError::ProtocolError(_) => ReasonCode::PROTOCOL_ERROR,
            DecodeError::PacketTooLarge { .. } => ReasonCode::PACKET_TOO_LARGE,
            DecodeError::UnsupportedProtocolVersion { .. } => {
                ReasonCode::UNSUPPORTED_PROTOCOL_VERSION
            }
            DecodeError::InvalidProtocolName => ReasonCode::UNSUPPORTED_PROTOCOL_VERSION,
            DecodeError::TopicNameInvalid(_) => ReasonCode::TOPIC_NAME_INVALID,
        }
    }
}

/// Why a packet could not be encoded. The encoder never truncates a field and never
/// panics; on error the output buffer is left as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A UTF-8 string or binary data field longer than 65,535 bytes, the most its two-byte
    /// length prefix can say (MQTT 5.0 sections 1.5.4 and 1.5.6).
    #[error("{field} is {len} bytes long, more than 65,535")]
    StringTooLong {
        /// Which field ("topic name", "client identifier", "password", ...).
        field: &'static str,
        /// Its length in bytes.
        len: usize,
    },
    /// The remaining length (or a property length) would exceed 268,435,455 bytes, the
    /// largest Variable Byte Integer (MQTT 5.0 section 1.5.5).
    #[error("packet body of {size} bytes exceeds 268,435,455")]
    PacketTooLarge {
        /// The length in bytes that could not be encoded.
        size: usize,
    },
    /// A property whose value the specification does not allow (MQTT 5.0 section 3.x.2.2):
    /// a Subscription Identifier of 0 or over 268,435,455, a Receive Maximum or Maximum
    /// Packet Size of 0, a byte property other than 0 or 1. The text names the property.
    #[error("property value out of range: {0}")]
    PropertyOutOfRange(&'static str),
    /// The packet does not exist in this protocol version (AUTH before 5.0).
    #[error("{packet} does not exist in {version:?}")]
    NotInVersion {
        /// The packet's name ("AUTH").
        packet: &'static str,
        /// The version asked for.
        version: ProtocolVersion,
    },
}
