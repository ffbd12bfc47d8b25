//! Reason codes (MQTT 5.0 section 2.4) and the 3.x CONNACK return codes.

/// An MQTT 5.0 reason code. Values below 0x80 are successes, 0x80 and above failures.
/// The associated constants carry the specification's names.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct ReasonCode(pub u8);

impl ReasonCode {
    pub const SUCCESS: ReasonCode = ReasonCode(0x00);
    /// Same value as SUCCESS; the name DISCONNECT uses.
    pub const NORMAL_DISCONNECTION: ReasonCode = ReasonCode(0x00);
    pub const GRANTED_QOS_0: ReasonCode = ReasonCode(0x00);
    pub const GRANTED_QOS_1: ReasonCode = ReasonCode(0x01);
    pub const GRANTED_QOS_2: ReasonCode = ReasonCode(0x02);
    pub const DISCONNECT_WITH_WILL_MESSAGE: ReasonCode = ReasonCode(0x04);
    pub const NO_MATCHING_SUBSCRIBERS: ReasonCode = ReasonCode(0x10);
    pub const NO_SUBSCRIPTION_EXISTED: ReasonCode = ReasonCode(0x11);
    pub const CONTINUE_AUTHENTICATION: ReasonCode = ReasonCode(0x18);
    pub const RE_AUTHENTICATE: ReasonCode = ReasonCode(0x19);
    pub const UNSPECIFIED_ERROR: ReasonCode = ReasonCode(0x80);
    pub const MALFORMED_PACKET: ReasonCode = ReasonCode(0x81);
    pub const PROTOCOL_ERROR: ReasonCode = ReasonCode(0x82);
    pub const IMPLEMENTATION_SPECIFIC_ERROR: ReasonCode = ReasonCode(0x83);
    pub const UNSUPPORTED_PROTOCOL_VERSION: ReasonCode = ReasonCode(0x84);
    pub const CLIENT_IDENTIFIER_NOT_VALID: ReasonCode = ReasonCode(0x85);
    pub const BAD_USER_NAME_OR_PASSWORD: ReasonCode = ReasonCode(0x86);
    pub const NOT_AUTHORIZED: ReasonCode = ReasonCode(0x87);
    pub const SERVER_UNAVAILABLE: ReasonCode = ReasonCode(0x88);
    pub const SERVER_BUSY: ReasonCode = ReasonCode(0x89);
    pub const BANNED: ReasonCode = ReasonCode(0x8A);
    pub const SERVER_SHUTTING_DOWN: ReasonCode = ReasonCode(0x8B);
    pub const BAD_AUTHENTICATION_METHOD: ReasonCode = ReasonCode(0x8C);
    pub const KEEP_ALIVE_TIMEOUT: ReasonCode = ReasonCode(0x8D);
    pub const SESSION_TAKEN_OVER: ReasonCode = ReasonCode(0x8E);
    pub const TOPIC_FILTER_INVALID: ReasonCode = ReasonCode(0x8F);
    pub const TOPIC_NAME_INVALID: ReasonCode = ReasonCode(0x90);
    pub const PACKET_IDENTIFIER_IN_USE: ReasonCode = ReasonCode(0x91);
    pub const PACKET_IDENTIFIER_NOT_FOUND: ReasonCode = ReasonCode(0x92);
    pub const RECEIVE_MAXIMUM_EXCEEDED: ReasonCode = ReasonCode(0x93);
    pub const TOPIC_ALIAS_INVALID: ReasonCode = ReasonCode(0x94);
    pub const PACKET_TOO_LARGE: ReasonCode = ReasonCode(0x95);
    pub const MESSAGE_RATE_TOO_HIGH: ReasonCode = ReasonCode(0x96);
    pub const QUOTA_EXCEEDED: ReasonCode = ReasonCode(0x97);
    pub const ADMINISTRATIVE_ACTION: ReasonCode = ReasonCode(0x98);
    pub const PAYLOAD_FORMAT_INVALID: ReasonCode = ReasonCode(0x99);
    pub const RETAIN_NOT_SUPPORTED: ReasonCode = ReasonCode(0x9A);
    pub const QOS_NOT_SUPPORTED: ReasonCode = ReasonCode(0x9B);
    pub const USE_ANOTHER_SERVER: ReasonCode = ReasonCode(0x9C);
    pub const SERVER_MOVED: ReasonCode = ReasonCode(0x9D);
    pub const SHARED_SUBSCRIPTIONS_NOT_SUPPORTED: ReasonCode = ReasonCode(0x9E);
    pub const CONNECTION_RATE_EXCEEDED: ReasonCode = ReasonCode(0x9F);
    pub const MAXIMUM_CONNECT_TIME: ReasonCode = ReasonCode(0xA0);
    pub const SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED: ReasonCode = ReasonCode(0xA1);
    pub const WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED: ReasonCode = ReasonCode(0xA2);

    /// 3.x CONNACK return codes (MQTT 3.1.1 section 3.2.2.3).
    pub const V3_ACCEPTED: u8 = 0;
    pub const V3_UNACCEPTABLE_PROTOCOL_VERSION: u8 = 1;
    pub const V3_IDENTIFIER_REJECTED: u8 = 2;
    pub const V3_SERVER_UNAVAILABLE: u8 = 3;
    pub const V3_BAD_USER_NAME_OR_PASSWORD: u8 = 4;
    pub const V3_NOT_AUTHORIZED: u8 = 5;

    /// True for 0x80 and above.
    pub fn is_failure(self) -> bool {
        self.0 >= 0x80
    }

    /// The 3.x CONNACK return code closest to this 5.0 CONNACK reason code
    /// (the mapping mosquitto uses): 0x84 -> 1, 0x85 -> 2, 0x86 -> 4, 0x87 -> 5, else 3.
    pub fn to_v3_connack(self) -> u8 {
        match self.0 {
            0x00 => Self::V3_ACCEPTED,
            0x84 => Self::V3_UNACCEPTABLE_PROTOCOL_VERSION,
            0x85 => Self::V3_IDENTIFIER_REJECTED,
            0x86 => Self::V3_BAD_USER_NAME_OR_PASSWORD,
            0x87 | 0x8A => Self::V3_NOT_AUTHORIZED,
            _ => Self::V3_SERVER_UNAVAILABLE,
        }
    }

    /// The name of a 3.x CONNACK return code (MQTT 3.1.1 section 3.2.2.3, the table of
    /// Connect Return code values), for logs: 1 "unacceptable protocol version", 2
    /// "identifier rejected", 3 "server unavailable", 4 "bad user name or password", 5 "not
    /// authorized"; 0 "accepted"; others "reserved return code".
    pub fn v3_connack_name(code: u8) -> &'static str {
        match code {
            Self::V3_ACCEPTED => "accepted",
            Self::V3_UNACCEPTABLE_PROTOCOL_VERSION => "unacceptable protocol version",
            Self::V3_IDENTIFIER_REJECTED => "identifier rejected",
            Self::V3_SERVER_UNAVAILABLE => "server unavailable",
            Self::V3_BAD_USER_NAME_OR_PASSWORD => "bad user name or password",
            Self::V3_NOT_AUTHORIZED => "not authorized",
            _ => "reserved return code",
        }
    }

    /// The specification's name, for logs ("Session taken over", ...).
    pub fn name(self) -> &'static str {
        match self.0 {
            0x00 => "Success",
            0x01 => "Granted QoS 1",
            0x02 => "Granted QoS 2",
            0x04 => "Disconnect with Will Message",
            0x10 => "No matching subscribers",
            0x11 => "No subscription existed",
            0x18 => "Continue authentication",
            0x19 => "Re-authenticate",
            0x80 => "Unspecified error",
            0x81 => "Malformed Packet",
            0x82 => "Protocol Error",
            0x83 => "Implementation specific error",
            0x84 => "Unsupported Protocol Version",
            0x85 => "Client Identifier not valid",
            0x86 => "Bad User Name or Password",
            0x87 => "Not authorized",
            0x88 => "Server unavailable",
            0x89 => "Server busy",
            0x8A => "Banned",
            0x8B => "Server shutting down",
            0x8C => "Bad authentication method",
            0x8D => "Keep Alive timeout",
            0x8E => "Session taken over",
            0x8F => "Topic Filter invalid",
            0x90 => "Topic Name invalid",
            0x91 => "Packet Identifier in use",
            0x92 => "Packet Identifier not found",
            0x93 => "Receive Maximum exceeded",
            0x94 => "Topic Alias invalid",
            0x95 => "Packet too large",
            0x96 => "Message rate too high",
            0x97 => "Quota exceeded",
            0x98 => "Administrative action",
            0x99 => "Payload format invalid",
            0x9A => "Retain not supported",
            0x9B => "QoS not supported",
            0x9C => "Use another server",
            0x9D => "Server moved",
            0x9E => "Shared Subscriptions not supported",
            0x9F => "Connection rate exceeded",
            0xA0 => "Maximum connect time",
            0xA1 => "Subscription Identifiers not supported",
            0xA2 => "Wildcard Subscriptions not supported",
            _ => "Unknown reason code",
        }
    }
}

impl std::fmt::Debug for ReasonCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "0x{:02X} ({})", self.0, self.name())
    }
}

impl std::fmt::Display for ReasonCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}
