//! Encoding: every packet of MQTT 3.1, 3.1.1 and 5.0 into a buffer, in the shortest form
//! the specification allows.
//!
//! Each packet body is produced by one function run twice over a `Sink`: first counting
//! bytes (which also validates every field), then writing into the output after the fixed
//! header. Nothing is written when a field cannot be encoded, and nothing is truncated.

use bytes::BytesMut;

use super::error::EncodeError;
use super::packet::*;
use super::properties::Properties;
use super::reason::ReasonCode;
use super::wire::{
    put_binary, put_str, put_vbi, vbi_len, Sink, MAX_STRING_LEN, MAX_VARIABLE_BYTE_INTEGER,
};

/// Appends `packet`, encoded for `version`, to `out`.
///
/// - CONNECT is encoded in the version its `protocol` field names (`MQIsdp`/3 for 3.1,
///   `MQTT`/4, `MQTT`/5), whatever `version` says;
/// - 3.x ignores properties and other 5.0-only fields: acknowledgements carry only the
///   packet identifier, UNSUBACK has no reason codes, DISCONNECT has no body, SUBACK return
///   codes are 0, 1, 2 or 0x80 (any failure code becomes 0x80), and a CONNACK reason code
///   above 5 is mapped with [`ReasonCode::to_v3_connack`]; 3.1 CONNACK has no Session
///   Present flag;
/// - 5.0 acknowledgements with reason code 0x00 and no properties are written as a packet
///   identifier only, DISCONNECT and AUTH with 0x00 and no properties with an empty body
///   (sections 3.4.2.1, 3.14.2.1, 3.15.2.1), and the property length is omitted when a
///   reason code other than 0x00 has no properties.
///
/// Errors: [`EncodeError`] (a string or binary field over 65,535 bytes, a packet over
/// 268,435,455 bytes of remaining length, a property value out of range, AUTH before 5.0).
/// On error `out` is left as it was.
pub fn encode(
    packet: &Packet,
    version: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    if let Packet::Publish(p) = packet {
        return encode_publish(&publish_ref(p), version, out);
    }
    let version = match packet {
        Packet::Connect(c) => c.protocol,
        Packet::Auth(_) if !version.is_v5() => {
            return Err(EncodeError::NotInVersion {
                packet: "AUTH",
                version,
            })
        }
        _ => version,
    };
    let first = first_byte(packet);
    let mut len = 0usize;
    body(&mut len, packet, version)?;
    if len > MAX_VARIABLE_BYTE_INTEGER {
        return Err(EncodeError::PacketTooLarge { size: len });
    }
    let start = out.len();
    out.reserve(1 + vbi_len(len) + len);
    out.put_u8(first);
    let result = put_vbi(out, len).and_then(|()| body(out, packet, version));
    if result.is_err() {
        out.truncate(start);
    }
    result
}

/// Appends a PUBLISH (MQTT 5.0 section 3.3) to `out`: the hot path of message delivery.
///
/// Computes the lengths first, reserves once, writes once; allocates nothing besides
/// growing `out`. The packet identifier is written only for QoS 1 and 2; properties only in
/// 5.0. Errors: topic over 65,535 bytes, remaining length over 268,435,455, a property out
/// of range; `out` is left as it was then.
pub fn encode_publish(
    p: &PublishRef<'_>,
    version: ProtocolVersion,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    encode_publish_within(p, version, usize::MAX, out)
}

/// As [`encode_publish`], for a receiver with a Maximum Packet Size: a PUBLISH larger than
/// `max_packet_size` bytes (fixed header included, as [`publish_encoded_len`] counts) is not
/// written and is [`EncodeError::PacketTooLarge`]. One sizing pass serves both the check and
/// the encoding (the delivery hot path: no separate [`publish_encoded_len`] call).
pub fn encode_publish_within(
    p: &PublishRef<'_>,
    version: ProtocolVersion,
    max_packet_size: usize,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    if !version.is_v5() && p.topic.len() <= MAX_STRING_LEN {
        return encode_publish_v3(p, max_packet_size, out);
    }
    let mut len = 0usize;
    publish_body(&mut len, p, version)?;
    if len > MAX_VARIABLE_BYTE_INTEGER {
        return Err(EncodeError::PacketTooLarge { size: len });
    }
    let size = 1 + vbi_len(len) + len;
    if size > max_packet_size {
        return Err(EncodeError::PacketTooLarge { size });
    }
    let start = out.len();
    out.reserve(1 + vbi_len(len) + len);
    out.put_u8(publish_first_byte(p));
    let result = put_vbi(out, len).and_then(|()| publish_body(out, p, version));
    if result.is_err() {
        out.truncate(start);
    }
    result
}

/// [`encode_publish_within`] for 3.1 and 3.1.1, which have no properties: the lengths are
/// known without a sizing pass, and the packet is written as four slices (fixed header with
/// the topic length, topic, packet identifier, payload). `p.topic` is at most
/// [`MAX_STRING_LEN`] bytes (checked by the caller).
fn encode_publish_v3(
    p: &PublishRef<'_>,
    max_packet_size: usize,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    let id_len = if p.qos == QoS::AtMostOnce { 0 } else { 2 };
    let len = 2 + p.topic.len() + id_len + p.payload.len();
    if len > MAX_VARIABLE_BYTE_INTEGER {
        return Err(EncodeError::PacketTooLarge { size: len });
    }
    let size = 1 + vbi_len(len) + len;
    if size > max_packet_size {
        return Err(EncodeError::PacketTooLarge { size });
    }
    // Fixed header (at most 5 bytes) and the topic's length prefix.
    let mut head = [0u8; 7];
    head[0] = publish_first_byte(p);
    let mut n = 1;
    let mut v = len;
    loop {
        let b = (v & 0x7F) as u8;
        v >>= 7;
        head[n] = if v > 0 { b | 0x80 } else { b };
        n += 1;
        if v == 0 {
            break;
        }
    }
    head[n..n + 2].copy_from_slice(&(p.topic.len() as u16).to_be_bytes());
    n += 2;
    out.reserve(size);
    out.extend_from_slice(&head[..n]);
    out.extend_from_slice(p.topic.as_bytes());
    if id_len > 0 {
        out.extend_from_slice(&p.packet_id.to_be_bytes());
    }
    out.extend_from_slice(p.payload);
    Ok(())
}

/// The size in bytes of the PUBLISH [`encode_publish`] would write, fixed header included:
/// what a subscriber's Maximum Packet Size is compared with (MQTT 5.0 section 3.1.2.11.4,
/// [MQTT-3.1.2-24]) without encoding. `usize::MAX` when the packet cannot be encoded at all
/// (so it is never "small enough").
pub fn publish_encoded_len(p: &PublishRef<'_>, version: ProtocolVersion) -> usize {
    let mut len = 0usize;
    if publish_body(&mut len, p, version).is_err() || len > MAX_VARIABLE_BYTE_INTEGER {
        return usize::MAX;
    }
    1 + vbi_len(len) + len
}

/// Appends a property block in its length-prefixed form (Variable Byte Integer length, then
/// the properties, MQTT 5.0 section 2.2.2) to `out`: the set fields in identifier order,
/// then the user properties in their order. Any property is written (storage keeps message
/// properties this way; [`decode_properties`](super::decode_properties) reads them back).
/// Errors: a string or binary value over 65,535 bytes, a value out of range, a block over
/// 268,435,455 bytes; `out` is left as it was then.
pub fn encode_properties(props: &Properties, out: &mut BytesMut) -> Result<(), EncodeError> {
    let mut len = 0usize;
    put_props(&mut len, props)?;
    let start = out.len();
    out.reserve(len);
    let result = put_props(out, props);
    if result.is_err() {
        out.truncate(start);
    }
    result
}

/// A [`PublishRef`] borrowing an owned [`Publish`] (for [`encode_publish`] and
/// [`publish_encoded_len`]).
pub fn publish_ref(p: &Publish) -> PublishRef<'_> {
    PublishRef {
        dup: p.dup,
        qos: p.qos,
        retain: p.retain,
        topic: &p.topic,
        packet_id: p.packet_id,
        properties: &p.properties,
        payload: &p.payload,
    }
}

fn publish_first_byte(p: &PublishRef<'_>) -> u8 {
    0x30 | ((p.dup as u8) << 3) | ((p.qos as u8) << 1) | p.retain as u8
}

fn publish_body<S: Sink>(
    s: &mut S,
    p: &PublishRef<'_>,
    version: ProtocolVersion,
) -> Result<(), EncodeError> {
    put_str(s, "topic name", p.topic)?;
    if p.qos != QoS::AtMostOnce {
        s.put_u16(p.packet_id);
    }
    if version.is_v5() {
        put_props(s, p.properties)?;
    }
    s.put_bytes(p.payload);
    Ok(())
}

/// Fixed header byte 1 (type and flags, MQTT 5.0 section 2.1.2) of every packet but PUBLISH.
fn first_byte(packet: &Packet) -> u8 {
    match packet {
        Packet::Connect(_) => 0x10,
        Packet::ConnAck(_) => 0x20,
        Packet::Publish(p) => publish_first_byte(&publish_ref(p)),
        Packet::PubAck(_) => 0x40,
        Packet::PubRec(_) => 0x50,
        Packet::PubRel(_) => 0x62,
        Packet::PubComp(_) => 0x70,
        Packet::Subscribe(_) => 0x82,
        Packet::SubAck(_) => 0x90,
        Packet::Unsubscribe(_) => 0xA2,
        Packet::UnsubAck(_) => 0xB0,
        Packet::PingReq => 0xC0,
        Packet::PingResp => 0xD0,
        Packet::Disconnect(_) => 0xE0,
        Packet::Auth(_) => 0xF0,
    }
}

/// The variable header and payload of `packet`.
fn body<S: Sink>(s: &mut S, packet: &Packet, version: ProtocolVersion) -> Result<(), EncodeError> {
    let v5 = version.is_v5();
    match packet {
        Packet::Connect(c) => connect_body(s, c),
        Packet::ConnAck(c) => {
            match version {
                ProtocolVersion::V31 => s.put_u8(0),
                _ => s.put_u8(c.session_present as u8),
            }
            if v5 {
                s.put_u8(c.reason_code.0);
                let mut len = 0usize;
                connack_props_content(&mut len, &c.properties)?;
                put_vbi(s, len)?;
                connack_props_content(s, &c.properties)?;
            } else if c.reason_code.0 <= 5 {
                s.put_u8(c.reason_code.0);
            } else {
                s.put_u8(c.reason_code.to_v3_connack());
            }
            Ok(())
        }
        Packet::Publish(p) => publish_body(s, &publish_ref(p), version),
        Packet::PubAck(a) | Packet::PubRec(a) | Packet::PubRel(a) | Packet::PubComp(a) => {
            s.put_u16(a.packet_id);
            if v5 {
                reason_and_props(s, a.reason_code, &a.properties)?;
            }
            Ok(())
        }
        Packet::Subscribe(sub) => {
            s.put_u16(sub.packet_id);
            if v5 {
                put_props(s, &sub.properties)?;
            }
            for f in &sub.filters {
                put_str(s, "topic filter", &f.filter)?;
                let o = &f.options;
                if v5 {
                    s.put_u8(
                        o.qos as u8
                            | (o.no_local as u8) << 2
                            | (o.retain_as_published as u8) << 3
                            | (o.retain_handling & 0x03) << 4,
                    );
                } else {
                    s.put_u8(o.qos as u8);
                }
            }
            Ok(())
        }
        Packet::SubAck(a) => {
            s.put_u16(a.packet_id);
            if v5 {
                put_props(s, &a.properties)?;
                for c in &a.reason_codes {
                    s.put_u8(c.0);
                }
            } else {
                for c in &a.reason_codes {
                    s.put_u8(if c.0 <= 2 { c.0 } else { 0x80 });
                }
            }
            Ok(())
        }
        Packet::Unsubscribe(u) => {
            s.put_u16(u.packet_id);
            if v5 {
                put_props(s, &u.properties)?;
            }
            for f in &u.filters {
                put_str(s, "topic filter", f)?;
            }
            Ok(())
        }
        Packet::UnsubAck(a) => {
            s.put_u16(a.packet_id);
            if v5 {
                put_props(s, &a.properties)?;
                for c in &a.reason_codes {
                    s.put_u8(c.0);
                }
            }
            Ok(())
        }
        Packet::PingReq | Packet::PingResp => Ok(()),
        Packet::Disconnect(d) => {
            if v5 {
                short_reason_and_props(s, d.reason_code, &d.properties)?;
            }
            Ok(())
        }
        Packet::Auth(a) => short_reason_and_props(s, a.reason_code, &a.properties),
    }
}

/// 5.0 acknowledgement tail: nothing for success without properties, the reason code alone
/// without properties, else both (section 3.4.2.1).
fn reason_and_props<S: Sink>(
    s: &mut S,
    code: ReasonCode,
    props: &Properties,
) -> Result<(), EncodeError> {
    let no_props = props.is_empty();
    if code == ReasonCode::SUCCESS && no_props {
        return Ok(());
    }
    s.put_u8(code.0);
    if !no_props {
        put_props(s, props)?;
    }
    Ok(())
}

/// DISCONNECT and AUTH body (sections 3.14.2.1, 3.15.2.1): same rule as the acknowledgements.
fn short_reason_and_props<S: Sink>(
    s: &mut S,
    code: ReasonCode,
    props: &Properties,
) -> Result<(), EncodeError> {
    reason_and_props(s, code, props)
}

fn connect_body<S: Sink>(s: &mut S, c: &Connect) -> Result<(), EncodeError> {
    let v5 = c.protocol.is_v5();
    match c.protocol {
        ProtocolVersion::V31 => put_str(s, "protocol name", "MQIsdp")?,
        _ => put_str(s, "protocol name", "MQTT")?,
    }
    s.put_u8(c.protocol.level());
    let mut flags = 0u8;
    if c.clean_start {
        flags |= 0x02;
    }
    if let Some(w) = &c.will {
        flags |= 0x04 | (w.qos as u8) << 3;
        if w.retain {
            flags |= 0x20;
        }
    }
    if c.password.is_some() {
        flags |= 0x40;
    }
    if c.username.is_some() {
        flags |= 0x80;
    }
    s.put_u8(flags);
    s.put_u16(c.keep_alive);
    if v5 {
        put_props(s, &c.properties)?;
    }
    put_str(s, "client identifier", &c.client_id)?;
    if let Some(w) = &c.will {
        if v5 {
            put_props(s, &w.properties)?;
        }
        put_str(s, "will topic", &w.topic)?;
        put_binary(s, "will payload", &w.payload)?;
    }
    if let Some(u) = &c.username {
        put_str(s, "user name", u)?;
    }
    if let Some(p) = &c.password {
        put_binary(s, "password", p)?;
    }
    Ok(())
}

/// A property block with its length prefix.
fn put_props<S: Sink>(s: &mut S, p: &Properties) -> Result<(), EncodeError> {
    let mut len = 0usize;
    props_content(&mut len, p)?;
    put_vbi(s, len)?;
    props_content(s, p)
}

fn bool_prop<S: Sink>(
    s: &mut S,
    id: u8,
    v: Option<u8>,
    what: &'static str,
) -> Result<(), EncodeError> {
    if let Some(v) = v {
        if v > 1 {
            return Err(EncodeError::PropertyOutOfRange(what));
        }
        s.put_u8(id);
        s.put_u8(v);
    }
    Ok(())
}

fn u32_prop<S: Sink>(s: &mut S, id: u8, v: Option<u32>) {
    if let Some(v) = v {
        s.put_u8(id);
        s.put_u32(v);
    }
}

fn u16_prop<S: Sink>(s: &mut S, id: u8, v: Option<u16>) {
    if let Some(v) = v {
        s.put_u8(id);
        s.put_u16(v);
    }
}

fn str_prop<S: Sink>(
    s: &mut S,
    id: u8,
    v: &Option<String>,
    what: &'static str,
) -> Result<(), EncodeError> {
    if let Some(v) = v {
        s.put_u8(id);
        put_str(s, what, v)?;
    }
    Ok(())
}

fn bin_prop<S: Sink>(
    s: &mut S,
    id: u8,
    v: &Option<bytes::Bytes>,
    what: &'static str,
) -> Result<(), EncodeError> {
    if let Some(v) = v {
        s.put_u8(id);
        put_binary(s, what, v)?;
    }
    Ok(())
}

/// CONNACK's properties without their length, in the order mosquitto writes them (clients and
/// test suites written against mosquitto compare CONNACK byte for byte; the order of
/// properties is otherwise free, MQTT 5.0 section 2.2.2.2), then the properties mosquitto does
/// not send, user properties last. Properties a CONNACK cannot carry are not written.
fn connack_props_content<S: Sink>(s: &mut S, p: &Properties) -> Result<(), EncodeError> {
    u16_prop(s, 0x13, p.server_keep_alive);
    u16_prop(s, 0x22, p.topic_alias_maximum);
    str_prop(
        s,
        0x12,
        &p.assigned_client_identifier,
        "assigned client identifier",
    )?;
    str_prop(s, 0x15, &p.authentication_method, "authentication method")?;
    bin_prop(s, 0x16, &p.authentication_data, "authentication data")?;
    bool_prop(s, 0x25, p.retain_available, "Retain Available")?;
    if p.maximum_packet_size == Some(0) {
        return Err(EncodeError::PropertyOutOfRange("Maximum Packet Size"));
    }
    u32_prop(s, 0x27, p.maximum_packet_size);
    if p.receive_maximum == Some(0) {
        return Err(EncodeError::PropertyOutOfRange("Receive Maximum"));
    }
    u16_prop(s, 0x21, p.receive_maximum);
    bool_prop(s, 0x24, p.maximum_qos, "Maximum QoS")?;
    u32_prop(s, 0x11, p.session_expiry_interval);
    str_prop(s, 0x1A, &p.response_information, "response information")?;
    str_prop(s, 0x1C, &p.server_reference, "server reference")?;
    str_prop(s, 0x1F, &p.reason_string, "reason string")?;
    bool_prop(
        s,
        0x28,
        p.wildcard_subscription_available,
        "Wildcard Subscription Available",
    )?;
    bool_prop(
        s,
        0x29,
        p.subscription_identifier_available,
        "Subscription Identifier Available",
    )?;
    bool_prop(
        s,
        0x2A,
        p.shared_subscription_available,
        "Shared Subscription Available",
    )?;
    for (name, value) in &p.user_properties {
        s.put_u8(0x26);
        put_str(s, "user property name", name)?;
        put_str(s, "user property value", value)?;
    }
    Ok(())
}

/// The properties without their length: set fields in identifier order, user properties last.
fn props_content<S: Sink>(s: &mut S, p: &Properties) -> Result<(), EncodeError> {
    bool_prop(
        s,
        0x01,
        p.payload_format_indicator,
        "Payload Format Indicator",
    )?;
    u32_prop(s, 0x02, p.message_expiry_interval);
    str_prop(s, 0x03, &p.content_type, "content type")?;
    str_prop(s, 0x08, &p.response_topic, "response topic")?;
    bin_prop(s, 0x09, &p.correlation_data, "correlation data")?;
    for &id in &p.subscription_identifiers {
        if id == 0 || id as usize > MAX_VARIABLE_BYTE_INTEGER {
            return Err(EncodeError::PropertyOutOfRange("Subscription Identifier"));
        }
        s.put_u8(0x0B);
        put_vbi(s, id as usize)?;
    }
    u32_prop(s, 0x11, p.session_expiry_interval);
    str_prop(
        s,
        0x12,
        &p.assigned_client_identifier,
        "assigned client identifier",
    )?;
    u16_prop(s, 0x13, p.server_keep_alive);
    str_prop(s, 0x15, &p.authentication_method, "authentication method")?;
    bin_prop(s, 0x16, &p.authentication_data, "authentication data")?;
    bool_prop(
        s,
        0x17,
        p.request_problem_information,
        "Request Problem Information",
    )?;
    u32_prop(s, 0x18, p.will_delay_interval);
    bool_prop(
        s,
        0x19,
        p.request_response_information,
        "Request Response Information",
    )?;
    str_prop(s, 0x1A, &p.response_information, "response information")?;
    str_prop(s, 0x1C, &p.server_reference, "server reference")?;
    str_prop(s, 0x1F, &p.reason_string, "reason string")?;
    if p.receive_maximum == Some(0) {
        return Err(EncodeError::PropertyOutOfRange("Receive Maximum"));
    }
    u16_prop(s, 0x21, p.receive_maximum);
    u16_prop(s, 0x22, p.topic_alias_maximum);
    u16_prop(s, 0x23, p.topic_alias);
    bool_prop(s, 0x24, p.maximum_qos, "Maximum QoS")?;
    bool_prop(s, 0x25, p.retain_available, "Retain Available")?;
    if p.maximum_packet_size == Some(0) {
        return Err(EncodeError::PropertyOutOfRange("Maximum Packet Size"));
    }
    u32_prop(s, 0x27, p.maximum_packet_size);
    bool_prop(
        s,
        0x28,
        p.wildcard_subscription_available,
        "Wildcard Subscription Available",
    )?;
    bool_prop(
        s,
        0x29,
        p.subscription_identifier_available,
        "Subscription Identifier Available",
    )?;
    bool_prop(
        s,
        0x2A,
        p.shared_subscription_available,
        "Shared Subscription Available",
    )?;
    for (name, value) in &p.user_properties {
        s.put_u8(0x26);
        put_str(s, "user property name", name)?;
        put_str(s, "user property value", value)?;
    }
    Ok(())
}
