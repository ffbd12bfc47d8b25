//! MQTT 5.0 properties (MQTT 5.0 section 2.2.2.2).
//!
//! One struct holds every property; each packet type allows a subset, which the decoder
//! enforces (a property not allowed in a packet, or a single-valued property given twice,
//! is a Protocol Error / Malformed Packet as section 2.2.2.2 says). The encoder writes the
//! fields that are set, in identifier order, then the user properties in their order.

use bytes::Bytes;

/// Every MQTT 5.0 property. `None` / empty means absent.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Properties {
    /// 0x01, byte: 0 unspecified bytes, 1 UTF-8 (PUBLISH, Will).
    pub payload_format_indicator: Option<u8>,
    /// 0x02, seconds (PUBLISH, Will).
    pub message_expiry_interval: Option<u32>,
    /// 0x03 (PUBLISH, Will).
    pub content_type: Option<String>,
    /// 0x08 (PUBLISH, Will).
    pub response_topic: Option<String>,
    /// 0x09 (PUBLISH, Will).
    pub correlation_data: Option<Bytes>,
    /// 0x0B, variable byte integer 1 to 268,435,455: several in PUBLISH (server to client),
    /// at most one in SUBSCRIBE.
    pub subscription_identifiers: Vec<u32>,
    /// 0x11, seconds (CONNECT, CONNACK, DISCONNECT).
    pub session_expiry_interval: Option<u32>,
    /// 0x12 (CONNACK).
    pub assigned_client_identifier: Option<String>,
    /// 0x13, seconds (CONNACK).
    pub server_keep_alive: Option<u16>,
    /// 0x15 (CONNECT, CONNACK, AUTH).
    pub authentication_method: Option<String>,
    /// 0x16 (CONNECT, CONNACK, AUTH).
    pub authentication_data: Option<Bytes>,
    /// 0x17, byte 0 or 1 (CONNECT).
    pub request_problem_information: Option<u8>,
    /// 0x18, seconds (Will).
    pub will_delay_interval: Option<u32>,
    /// 0x19, byte 0 or 1 (CONNECT).
    pub request_response_information: Option<u8>,
    /// 0x1A (CONNACK).
    pub response_information: Option<String>,
    /// 0x1C (CONNACK, DISCONNECT).
    pub server_reference: Option<String>,
    /// 0x1F (every acknowledgement, DISCONNECT, AUTH).
    pub reason_string: Option<String>,
    /// 0x21, 1 to 65,535 (CONNECT, CONNACK).
    pub receive_maximum: Option<u16>,
    /// 0x22 (CONNECT, CONNACK).
    pub topic_alias_maximum: Option<u16>,
    /// 0x23, 1 or more (PUBLISH).
    pub topic_alias: Option<u16>,
    /// 0x24, byte 0 or 1 (CONNACK).
    pub maximum_qos: Option<u8>,
    /// 0x25, byte 0 or 1 (CONNACK).
    pub retain_available: Option<u8>,
    /// 0x26, name and value pairs, in order, repeats allowed (every packet with properties).
    pub user_properties: Vec<(String, String)>,
    /// 0x27, bytes, at least 1 (CONNECT, CONNACK).
    pub maximum_packet_size: Option<u32>,
    /// 0x28, byte 0 or 1 (CONNACK).
    pub wildcard_subscription_available: Option<u8>,
    /// 0x29, byte 0 or 1 (CONNACK).
    pub subscription_identifier_available: Option<u8>,
    /// 0x2A, byte 0 or 1 (CONNACK).
    pub shared_subscription_available: Option<u8>,
}

impl Properties {
    /// Bytes held by the variable-length properties (strings, binary data, user properties,
    /// subscription identifiers at 4 bytes each); the fixed-size ones count nothing. What a
    /// queued message's properties cost in a session's queued bytes.
    pub fn variable_len(&self) -> usize {
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        let bin = |b: &Option<Bytes>| b.as_ref().map_or(0, Bytes::len);
        text(&self.content_type)
            + text(&self.response_topic)
            + bin(&self.correlation_data)
            + 4 * self.subscription_identifiers.len()
            + text(&self.assigned_client_identifier)
            + text(&self.authentication_method)
            + bin(&self.authentication_data)
            + text(&self.response_information)
            + text(&self.server_reference)
            + text(&self.reason_string)
            + self
                .user_properties
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }

    /// True when no property is set (the common case for 3.x traffic and plain 5.0 PUBLISH).
    pub fn is_empty(&self) -> bool {
        // Field by field: comparing with `Properties::default()` built and dropped a whole
        // struct on every call (a hot path: every inbound PUBLISH).
        let Properties {
            payload_format_indicator,
            message_expiry_interval,
            content_type,
            response_topic,
            correlation_data,
            subscription_identifiers,
            session_expiry_interval,
            assigned_client_identifier,
            server_keep_alive,
            authentication_method,
            authentication_data,
            request_problem_information,
            will_delay_interval,
            request_response_information,
            response_information,
            server_reference,
            reason_string,
            receive_maximum,
            topic_alias_maximum,
            topic_alias,
            maximum_qos,
            retain_available,
            user_properties,
            maximum_packet_size,
            wildcard_subscription_available,
            subscription_identifier_available,
            shared_subscription_available,
        } = self;
        payload_format_indicator.is_none()
            && message_expiry_interval.is_none()
            && content_type.is_none()
            && response_topic.is_none()
            && correlation_data.is_none()
            && subscription_identifiers.is_empty()
            && session_expiry_interval.is_none()
            && assigned_client_identifier.is_none()
            && server_keep_alive.is_none()
            && authentication_method.is_none()
            && authentication_data.is_none()
            && request_problem_information.is_none()
            && will_delay_interval.is_none()
            && request_response_information.is_none()
            && response_information.is_none()
            && server_reference.is_none()
            && reason_string.is_none()
            && receive_maximum.is_none()
            && topic_alias_maximum.is_none()
            && topic_alias.is_none()
            && maximum_qos.is_none()
            && retain_available.is_none()
            && user_properties.is_empty()
            && maximum_packet_size.is_none()
            && wildcard_subscription_available.is_none()
            && subscription_identifier_available.is_none()
            && shared_subscription_available.is_none()
    }
}
