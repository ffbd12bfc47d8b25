//! What can go wrong on a client connection.

use std::io;

use crate::codec::{DecodeError, EncodeError, ProtocolVersion, ReasonCode};

/// Why a client operation failed. Every variant but [`ClientError::Encode`] and
/// [`ClientError::WindowFull`] leaves the connection unusable.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The transport failed (reset, TLS alert, WebSocket error, ...).
    #[error("connection lost: {0}")]
    Io(#[from] io::Error),
    /// The server closed the connection (end of stream).
    #[error("the server closed the connection")]
    Closed,
    /// The server sent bytes that are no valid MQTT packet (MQTT 5.0 section 4.13), or one
    /// larger than the Maximum Packet Size this client set. `first_byte` is the first byte of
    /// what was buffered when it was found: a TLS record starts with 0x15 or 0x16, which tells
    /// a plain client talking to a TLS port.
    #[error("the server sent an invalid packet: {error}")]
    Decode {
        /// What the decoder found wrong.
        error: DecodeError,
        /// The first byte buffered before the decoder ran, if any.
        first_byte: Option<u8>,
    },
    /// The packet cannot be encoded (a field too long, a property out of range, AUTH in
    /// 3.1.1). Nothing was sent; the connection stays usable.
    #[error("cannot encode {packet}: {error}")]
    Encode {
        /// The packet's name ("PUBLISH", ...).
        packet: &'static str,
        /// What the encoder refused.
        error: EncodeError,
    },
    /// No CONNACK within the connect timeout (the time is in seconds).
    #[error("no CONNACK within {0} s")]
    ConnackTimeout(u64),
    /// The server answered CONNECT with another packet (its name) than CONNACK
    /// [MQTT-3.2.0-1].
    #[error("the server answered CONNECT with {0} instead of CONNACK")]
    NotConnAck(&'static str),
    /// CONNACK with a failure: an MQTT 5.0 reason code (0x80 and above), or a 3.1/3.1.1
    /// return code 1 to 5 kept as it came (MQTT 3.1.1 section 3.2.2.3; see
    /// [`ReasonCode::v3_connack_name`]). `version` tells which of the two `code` is. A 5.0
    /// CONNECT answered with the 3.1.1 refusal "unacceptable protocol version" (a server
    /// without MQTT 5) is reported with `version` 3.1.1 and code 1.
    #[error("CONNACK refused: code {}", code.0)]
    Refused {
        /// The reason or return code.
        code: ReasonCode,
        /// The protocol of the CONNACK: `code` is a 3.x return code unless it is 5.0.
        version: ProtocolVersion,
        /// The CONNACK's Reason String (5.0), if any.
        reason_string: Option<String>,
    },
    /// The server sent DISCONNECT (MQTT 5.0 section 3.14) with this reason code and Reason
    /// String.
    #[error("the server disconnected this client: reason code 0x{:02X}", reason.0)]
    Disconnected {
        /// The DISCONNECT's reason code.
        reason: ReasonCode,
        /// Its Reason String, if any.
        reason_string: Option<String>,
    },
    /// No PINGRESP within the keep alive period after a PINGREQ (MQTT 5.0 section 3.1.2.10).
    #[error("the server did not answer PINGREQ within the keep alive")]
    KeepAliveTimeout,
    /// A PUBLISH with a Topic Alias (its value here) that was never set on this connection
    /// (MQTT 5.0 section 3.3.2.3.4).
    #[error("the server used Topic Alias {0} before setting it")]
    UnknownTopicAlias(u16),
    /// The server started an AUTH exchange (MQTT 5.0 section 4.12) that this client did not
    /// ask for.
    #[error("the server started an AUTH exchange")]
    UnexpectedAuth,
    /// The server sent a packet (its name) that only a client sends.
    #[error("the server sent {0}, which a server never sends")]
    UnexpectedPacket(&'static str),
    /// A QoS 1 or 2 PUBLISH while as many are awaiting their acknowledgement as the server's
    /// Receive Maximum allows (MQTT 5.0 section 4.9). Nothing was sent.
    #[error("{0} messages already await their acknowledgement (Receive Maximum)")]
    WindowFull(usize),
}

impl ClientError {
    pub(crate) fn encode(packet: &'static str, error: EncodeError) -> ClientError {
        ClientError::Encode { packet, error }
    }
}
