//! Decoding: is a whole packet buffered ([`check_frame`]), and parsing it ([`decode`],
//! [`decode_packet`]), strictly as MQTT 3.1, 3.1.1 and 5.0 say.
//!
//! "Incomplete" (`Ok(None)`) is never confused with "malformed" (`Err`): only
//! [`check_frame`] waits for bytes; once a frame is whole, any field that does not fit in it
//! is malformed.

use bytes::{Buf, Bytes, BytesMut};

use super::error::DecodeError;
use super::packet::*;
use super::properties::Properties;
use super::reason::ReasonCode;
use super::wire::Reader;

/// Looks at the fixed header at the start of `buf` (MQTT 5.0 section 2.1, 3.1.1 section
/// 2.2) and says whether a whole packet is buffered.
///
/// - `Ok(None)`: more bytes are needed (the fixed header or the body is incomplete);
/// - `Ok(Some(total))`: the first `total` bytes of `buf` (fixed header plus remaining
///   length) are one whole packet;
/// - `Err(PacketTooLarge)`: as soon as the remaining length is known, if the whole packet
///   would exceed `max_packet_size` bytes (fixed header included, as MQTT 5.0 section
///   3.1.2.11.4 counts), whether or not the body has arrived: the body is never buffered;
/// - `Err(MalformedPacket)`: a remaining length encoded in more than 4 bytes, or not in its
///   shortest form [MQTT-1.5.5-1].
///
/// It does not look at the packet type or flags; [`decode_packet`] does.
pub fn check_frame(buf: &[u8], max_packet_size: u32) -> Result<Option<usize>, DecodeError> {
    let mut remaining = 0usize;
    for i in 0..4 {
        let Some(&b) = buf.get(1 + i) else {
            return Ok(None);
        };
        remaining |= ((b & 0x7F) as usize) << (7 * i);
        if b & 0x80 == 0 {
            if i > 0 && b == 0 {
                return Err(DecodeError::MalformedPacket(
                    "remaining length not in its shortest form [MQTT-1.5.5-1]",
                ));
            }
            let total = 2 + i + remaining;
            if total > max_packet_size as usize {
                return Err(DecodeError::PacketTooLarge {
                    size: total,
                    max: max_packet_size,
                });
            }
            return Ok(if buf.len() >= total {
                Some(total)
            } else {
                None
            });
        }
    }
    Err(DecodeError::MalformedPacket(
        "remaining length encoded in more than 4 bytes",
    ))
}

/// Decodes the packet at the start of `buf` if it is whole, and removes exactly its bytes
/// from `buf` (also when it is invalid; the connection is closed then anyway).
///
/// `Ok(None)` means more bytes are needed and leaves `buf` untouched. A CONNECT is decoded
/// in the version it announces itself (protocol name and level); every other packet in
/// `version` (the broker passes `ProtocolVersion::V311` before CONNECT, then the
/// connection's version). `max_packet_size` is in bytes, fixed header included (see
/// [`check_frame`]). Errors: see [`DecodeError`] and [`decode_packet`].
pub fn decode(
    buf: &mut BytesMut,
    version: ProtocolVersion,
    max_packet_size: u32,
) -> Result<Option<Packet>, DecodeError> {
    let Some(total) = check_frame(buf, max_packet_size)? else {
        return Ok(None);
    };
    let result = decode_packet(&buf[..total], version);
    buf.advance(total);
    result.map(Some)
}

/// [`decode`] for a broker reading what a client sent: the same, plus the rules that only
/// apply to packets sent by a client.
///
/// - A PUBLISH with a Subscription Identifier is a Protocol Error [MQTT-3.3.4-6]: the
///   property only goes from the server to a client.
pub fn decode_from_client(
    buf: &mut BytesMut,
    version: ProtocolVersion,
    max_packet_size: u32,
) -> Result<Option<Packet>, DecodeError> {
    let packet = decode(buf, version, max_packet_size)?;
    if let Some(Packet::Publish(p)) = &packet {
        check_client_publish(p)?;
    }
    Ok(packet)
}

/// True when the whole frame `frame` (as [`check_frame`] delimits it) is a PUBLISH, for
/// [`decode_publish_from_client`].
#[inline]
pub fn is_publish_frame(frame: &[u8]) -> bool {
    frame.first().is_some_and(|b| b >> 4 == 3)
}

/// Decodes one whole PUBLISH frame sent by a client: what [`decode_from_client`] does for
/// a PUBLISH (same rules, same errors), returning the [`Publish`] itself rather than a
/// [`Packet`]. The broker's hot path: no packet enum is built and moved around for the
/// most frequent packet. `frame` must hold exactly one packet (see [`check_frame`]); a frame
/// of another packet type is malformed.
pub fn decode_publish_from_client(
    frame: &[u8],
    version: ProtocolVersion,
) -> Result<Publish, DecodeError> {
    let mut r = Reader::new(frame);
    let first = r
        .u8()
        .map_err(|_| DecodeError::MalformedPacket("empty frame"))?;
    if first >> 4 != 3 {
        return Err(DecodeError::MalformedPacket("not a PUBLISH frame"));
    }
    let remaining = r.vbi()?;
    if remaining != r.remaining() {
        return Err(DecodeError::MalformedPacket(
            "frame length does not match the remaining length",
        ));
    }
    // The payload takes whatever follows the variable header: nothing is left over. Returned
    // as decoded (the client's rule checked inside), not moved once more.
    decode_publish(&mut r, first & 0x0F, version, true)
}

/// The rules that apply to a PUBLISH sent by a client only.
fn check_client_publish(p: &Publish) -> Result<(), DecodeError> {
    if !p.properties.subscription_identifiers.is_empty() {
        return Err(CLIENT_SUBSCRIPTION_IDENTIFIER);
    }
    Ok(())
}

/// A PUBLISH from a client may not carry a Subscription Identifier.
const CLIENT_SUBSCRIPTION_IDENTIFIER: DecodeError = DecodeError::ProtocolError(
    "PUBLISH from a client with a Subscription Identifier [MQTT-3.3.4-6]",
);

/// Decodes one complete frame: fixed header, then exactly the remaining length it
/// announces (a frame shorter or longer than that is malformed). See [`decode`] for
/// `version`. The strictness rules applied are those of MQTT 3.1.1 and 5.0 section 3 and
/// are listed in the tests (`tests/core/codec_malformed.rs`), each with its normative statement.
pub fn decode_packet(frame: &[u8], version: ProtocolVersion) -> Result<Packet, DecodeError> {
    let mut r = Reader::new(frame);
    let first = r
        .u8()
        .map_err(|_| DecodeError::MalformedPacket("empty frame"))?;
    let remaining = r.vbi()?;
    if remaining != r.remaining() {
        return Err(DecodeError::MalformedPacket(
            "frame length does not match the remaining length",
        ));
    }
    let body = r.rest();
    let packet_type = first >> 4;
    let flags = first & 0x0F;
    if packet_type == 1 {
        check_flags(flags, 0, ProtocolVersion::V311)?;
        return decode_connect(body);
    }
    let mut r = Reader::new(body);
    let packet = match packet_type {
        2 => {
            check_flags(flags, 0, version)?;
            Packet::ConnAck(decode_connack(&mut r, version)?)
        }
        3 => Packet::Publish(decode_publish(&mut r, flags, version, false)?),
        4 => {
            check_flags(flags, 0, version)?;
            Packet::PubAck(decode_puback(&mut r, version, PUBACK_CODES)?)
        }
        5 => {
            check_flags(flags, 0, version)?;
            Packet::PubRec(decode_puback(&mut r, version, PUBACK_CODES)?)
        }
        6 => {
            check_flags(flags, 0b0010, version)?;
            Packet::PubRel(decode_puback(&mut r, version, PUBREL_CODES)?)
        }
        7 => {
            check_flags(flags, 0, version)?;
            Packet::PubComp(decode_puback(&mut r, version, PUBREL_CODES)?)
        }
        8 => {
            check_flags(flags, 0b0010, version)?;
            Packet::Subscribe(decode_subscribe(&mut r, version)?)
        }
        9 => {
            check_flags(flags, 0, version)?;
            Packet::SubAck(decode_suback(&mut r, version)?)
        }
        10 => {
            check_flags(flags, 0b0010, version)?;
            Packet::Unsubscribe(decode_unsubscribe(&mut r, version)?)
        }
        11 => {
            check_flags(flags, 0, version)?;
            Packet::UnsubAck(decode_unsuback(&mut r, version)?)
        }
        12 => {
            check_flags(flags, 0, version)?;
            Packet::PingReq
        }
        13 => {
            check_flags(flags, 0, version)?;
            Packet::PingResp
        }
        14 => {
            check_flags(flags, 0, version)?;
            let (reason_code, properties) =
                decode_reason_and_properties(&mut r, version, DISCONNECT_CODES, ctx::DISCONNECT)?;
            Packet::Disconnect(Disconnect {
                reason_code,
                properties,
            })
        }
        15 => {
            if !version.is_v5() {
                return Err(DecodeError::MalformedPacket(
                    "AUTH does not exist before MQTT 5.0",
                ));
            }
            check_flags(flags, 0, version)?;
            let (reason_code, properties) =
                decode_reason_and_properties(&mut r, version, AUTH_CODES, ctx::AUTH)?;
            Packet::Auth(Auth {
                reason_code,
                properties,
            })
        }
        _ => {
            return Err(DecodeError::MalformedPacket(
                "packet type 0 is reserved [MQTT-2.1.3-1]",
            ))
        }
    };
    if !r.is_empty() {
        return Err(DecodeError::MalformedPacket(
            "bytes left over after the packet's content",
        ));
    }
    Ok(packet)
}

/// Decodes a property block in its length-prefixed form (a Variable Byte Integer length,
/// then the properties, MQTT 5.0 section 2.2.2), as [`encode_properties`](super::encode_properties)
/// writes it. Any property is allowed and Subscription Identifiers may repeat (storage keeps
/// the properties of PUBLISH and Will messages this way); value rules are those of the
/// packets, except that strings may hold the control characters and non-characters a packet
/// may not (section 1.5.4), which older versions stored. `buf` must hold exactly the block:
/// trailing bytes are malformed.
pub fn decode_properties(buf: &[u8]) -> Result<Properties, DecodeError> {
    let mut r = Reader::stored(buf);
    let props = decode_props(&mut r, ctx::ANY)?;
    if !r.is_empty() {
        return Err(DecodeError::MalformedPacket(
            "bytes left over after the properties",
        ));
    }
    Ok(props)
}

/// The fixed header flags of every packet but PUBLISH are fixed [MQTT-2.2.2-1], [MQTT-2.2.2-2]
/// (3.1.1 [MQTT-2.2.2-1]). MQTT 3.1 had a DUP bit on PUBREL, SUBSCRIBE and UNSUBSCRIBE
/// retries and left the others unused, so for 3.1 only the QoS bits are checked.
fn check_flags(flags: u8, expected: u8, version: ProtocolVersion) -> Result<(), DecodeError> {
    let ok = if version == ProtocolVersion::V31 {
        flags & 0b0110 == expected & 0b0110
    } else {
        flags == expected
    };
    if ok {
        Ok(())
    } else {
        Err(DecodeError::MalformedPacket(
            "fixed header flags differ from those the specification fixes [MQTT-2.2.2-2]",
        ))
    }
}

/// A packet identifier: 0 parses, but the protocol forbids it [MQTT-2.2.1-3], which makes it
/// a Protocol Error (0x82) rather than a Malformed Packet (5.0 section 1.2), as mosquitto
/// answers for a PUBLISH (a SUBSCRIBE's or UNSUBSCRIBE's: [`request_packet_id`]).
fn packet_id(r: &mut Reader<'_>) -> Result<u16, DecodeError> {
    let id = r.u16()?;
    if id == 0 {
        return Err(DecodeError::ProtocolError(
            "packet identifier 0 [MQTT-2.2.1-3]",
        ));
    }
    Ok(id)
}

/// The packet identifier of a SUBSCRIBE or UNSUBSCRIBE: 0 is a Malformed Packet (0x81), the
/// answer mosquitto gives there. [MQTT-2.2.1-3] forbids the value without naming the error,
/// and 0x81 is the code for a packet that "does not conform to this specification" (5.0
/// section 3.14.2.1). A PUBLISH's or an acknowledgement's 0 stays a Protocol Error (0x82),
/// mosquitto's answer for a PUBLISH.
fn request_packet_id(r: &mut Reader<'_>) -> Result<u16, DecodeError> {
    packet_id(r).map_err(|e| match e {
        DecodeError::ProtocolError(m) => DecodeError::MalformedPacket(m),
        other => other,
    })
}

fn decode_connect(body: &[u8]) -> Result<Packet, DecodeError> {
    let mut r = Reader::new(body);
    let name = r.binary()?;
    let level = r.u8()?;
    let protocol = match (name, level) {
        (b"MQTT", 4) => ProtocolVersion::V311,
        (b"MQTT", 5) => ProtocolVersion::V5,
        (b"MQIsdp", 3) => ProtocolVersion::V31,
        (b"MQTT", _) | (b"MQIsdp", _) => {
            return Err(DecodeError::UnsupportedProtocolVersion { level })
        }
        _ => return Err(DecodeError::InvalidProtocolName),
    };
    let flags = r.u8()?;
    if flags & 0x01 != 0 {
        return Err(DecodeError::MalformedPacket(
            "CONNECT reserved flag is not 0 [MQTT-3.1.2-3]",
        ));
    }
    let clean_start = flags & 0x02 != 0;
    let will_flag = flags & 0x04 != 0;
    let will_qos_bits = (flags >> 3) & 0x03;
    let will_retain = flags & 0x20 != 0;
    let password_flag = flags & 0x40 != 0;
    let username_flag = flags & 0x80 != 0;
    let will_qos = QoS::from_u8(will_qos_bits)
        .ok_or(DecodeError::MalformedPacket("Will QoS 3 [MQTT-3.1.2-14]"))?;
    if !will_flag && will_qos_bits != 0 {
        return Err(DecodeError::MalformedPacket(
            "Will QoS not 0 without Will Flag [MQTT-3.1.2-11] [MQTT-3.1.2-13]",
        ));
    }
    if !will_flag && will_retain {
        return Err(DecodeError::MalformedPacket(
            "Will Retain set without Will Flag [MQTT-3.1.2-15]",
        ));
    }
    if !protocol.is_v5() && password_flag && !username_flag {
        return Err(DecodeError::MalformedPacket(
            "Password Flag without User Name Flag [MQTT-3.1.2-22]",
        ));
    }
    let keep_alive = r.u16()?;
    let properties = if protocol.is_v5() {
        decode_props(&mut r, ctx::CONNECT)?
    } else {
        Properties::default()
    };
    let client_id = r.string()?;
    let will = if will_flag {
        let properties = if protocol.is_v5() {
            decode_props(&mut r, ctx::WILL)?
        } else {
            Properties::default()
        };
        let topic = r.str()?;
        check_topic_name(topic, false, true)?;
        let payload = Bytes::copy_from_slice(r.binary()?);
        Some(LastWill {
            topic: topic.to_owned(),
            payload,
            qos: will_qos,
            retain: will_retain,
            properties,
        })
    } else {
        None
    };
    let username = if username_flag {
        Some(r.string()?)
    } else {
        None
    };
    let password = if password_flag {
        Some(Bytes::copy_from_slice(r.binary()?))
    } else {
        None
    };
    if !r.is_empty() {
        return Err(DecodeError::MalformedPacket(
            "bytes left over after the CONNECT payload",
        ));
    }
    Ok(Packet::Connect(Box::new(Connect {
        protocol,
        clean_start,
        keep_alive,
        client_id,
        will,
        username,
        password,
        properties,
    })))
}

/// Topic Name rules: no wildcard [MQTT-3.3.2-2] [MQTT-4.7.1-1]; at least one character
/// [MQTT-4.7.3-1] unless a Topic Alias stands for it (5.0 section 3.3.2.3.4).
///
/// In a PUBLISH, breaking them is a Protocol Error (0x82): the packet parses and carries a
/// value the protocol does not allow (5.0 section 1.2), where 0x90 Topic Name invalid is for
/// a correctly formed name the receiver does not accept (mosquitto answers 0x82 too). A will
/// topic breaking them is `TopicNameInvalid`, the CONNACK code for a will topic (0x90).
fn check_topic_name(topic: &str, alias_present: bool, will: bool) -> Result<(), DecodeError> {
    let problem = if topic.is_empty() && !alias_present {
        "empty topic name without a Topic Alias [MQTT-4.7.3-1]"
    } else if topic.bytes().any(|b| b == b'+' || b == b'#') {
        "wildcard character in a topic name [MQTT-3.3.2-2]"
    } else {
        return Ok(());
    };
    Err(if will {
        DecodeError::TopicNameInvalid(problem)
    } else {
        DecodeError::ProtocolError(problem)
    })
}

fn decode_connack(r: &mut Reader<'_>, version: ProtocolVersion) -> Result<ConnAck, DecodeError> {
    let flags = r.u8()?;
    let code = r.u8()?;
    match version {
        ProtocolVersion::V31 => {
            // 3.1: the first byte is reserved and carries no Session Present flag.
            if code > 5 {
                return Err(DecodeError::MalformedPacket("reserved CONNACK return code"));
            }
            Ok(ConnAck {
                session_present: false,
                reason_code: ReasonCode(code),
                properties: Properties::default(),
            })
        }
        ProtocolVersion::V311 => {
            if flags & 0xFE != 0 {
                return Err(DecodeError::MalformedPacket(
                    "CONNACK reserved flags not 0 [MQTT-3.2.2-1]",
                ));
            }
            if code > 5 {
                return Err(DecodeError::MalformedPacket("reserved CONNACK return code"));
            }
            Ok(ConnAck {
                session_present: flags & 1 != 0,
                reason_code: ReasonCode(code),
                properties: Properties::default(),
            })
        }
        ProtocolVersion::V5 => {
            if flags & 0xFE != 0 {
                return Err(DecodeError::MalformedPacket(
                    "CONNACK reserved flags not 0 [MQTT-3.2.2-1]",
                ));
            }
            let reason_code = check_reason(code, CONNACK_CODES)?;
            let properties = decode_props(r, ctx::CONNACK)?;
            Ok(ConnAck {
                session_present: flags & 1 != 0,
                reason_code,
                properties,
            })
        }
    }
}

/// A PUBLISH body; `from_client` adds the rules of a PUBLISH sent by a client
/// ([`check_client_publish`]), checked after every other.
fn decode_publish(
    r: &mut Reader<'_>,
    flags: u8,
    version: ProtocolVersion,
    from_client: bool,
) -> Result<Publish, DecodeError> {
    let dup = flags & 0b1000 != 0;
    let retain = flags & 0b0001 != 0;
    let qos = QoS::from_u8((flags >> 1) & 0x03).ok_or(DecodeError::MalformedPacket(
        "PUBLISH with QoS 3 [MQTT-3.3.1-4]",
    ))?;
    if dup && qos == QoS::AtMostOnce {
        return Err(DecodeError::MalformedPacket(
            "PUBLISH with DUP 1 and QoS 0 [MQTT-3.3.1-2]",
        ));
    }
    let (topic, no_wildcard) = r.topic()?;
    let packet_id = if qos == QoS::AtMostOnce {
        0
    } else {
        packet_id(r)?
    };
    let properties = if version.is_v5() {
        decode_props(r, ctx::PUBLISH)?
    } else {
        Properties::default()
    };
    if !no_wildcard || topic.is_empty() {
        check_topic_name(topic, properties.topic_alias.is_some(), false)?;
    }
    if from_client && !properties.subscription_identifiers.is_empty() {
        return Err(CLIENT_SUBSCRIPTION_IDENTIFIER);
    }
    let payload = Bytes::copy_from_slice(r.rest());
    Ok(Publish {
        dup,
        qos,
        retain,
        topic: topic.to_owned(),
        packet_id,
        properties,
        payload,
    })
}

/// PUBACK, PUBREC, PUBREL, PUBCOMP. In 5.0 a remaining length of 2 means reason code 0x00
/// and no properties; 3 means no properties [MQTT-3.4.2-1] (section 3.4.2.1).
fn decode_puback(
    r: &mut Reader<'_>,
    version: ProtocolVersion,
    codes: &[u8],
) -> Result<PubAck, DecodeError> {
    let packet_id = packet_id(r)?;
    if !version.is_v5() || r.is_empty() {
        return Ok(PubAck {
            packet_id,
            ..PubAck::default()
        });
    }
    let reason_code = check_reason(r.u8()?, codes)?;
    let properties = if r.is_empty() {
        Properties::default()
    } else {
        decode_props(r, ctx::ACK)?
    };
    Ok(PubAck {
        packet_id,
        reason_code,
        properties,
    })
}

/// DISCONNECT and AUTH. In 3.x DISCONNECT has no body. In 5.0 a remaining length of 0 means
/// reason code 0x00 and no properties, 1 means no properties (sections 3.14.2.1, 3.15.2.1).
fn decode_reason_and_properties(
    r: &mut Reader<'_>,
    version: ProtocolVersion,
    codes: &[u8],
    context: u16,
) -> Result<(ReasonCode, Properties), DecodeError> {
    if !version.is_v5() || r.is_empty() {
        return Ok((ReasonCode::SUCCESS, Properties::default()));
    }
    let reason_code = check_reason(r.u8()?, codes)?;
    let properties = if r.is_empty() {
        Properties::default()
    } else {
        decode_props(r, context)?
    };
    Ok((reason_code, properties))
}

fn decode_subscribe(
    r: &mut Reader<'_>,
    version: ProtocolVersion,
) -> Result<Subscribe, DecodeError> {
    let packet_id = request_packet_id(r)?;
    let properties = if version.is_v5() {
        decode_props(r, ctx::SUBSCRIBE)?
    } else {
        Properties::default()
    };
    if r.is_empty() {
        return Err(DecodeError::ProtocolError(
            "SUBSCRIBE without a topic filter [MQTT-3.8.3-3]",
        ));
    }
    let mut filters = Vec::new();
    while !r.is_empty() {
        let filter = r.string()?;
        let byte = r.u8()?;
        let options = if version.is_v5() {
            if byte & 0xC0 != 0 {
                return Err(DecodeError::MalformedPacket(
                    "subscription options reserved bits not 0 [MQTT-3.8.3-5]",
                ));
            }
            let qos = QoS::from_u8(byte & 0x03).ok_or(DecodeError::MalformedPacket(
                "subscription with Maximum QoS 3 (section 3.8.3.1)",
            ))?;
            let retain_handling = (byte >> 4) & 0x03;
            if retain_handling == 3 {
                return Err(DecodeError::ProtocolError(
                    "Retain Handling 3 (section 3.8.3.1)",
                ));
            }
            let no_local = byte & 0x04 != 0;
            if no_local && filter.starts_with("$share/") {
                return Err(DecodeError::ProtocolError(
                    "No Local on a shared subscription [MQTT-3.8.3-4]",
                ));
            }
            SubscriptionOptions {
                qos,
                no_local,
                retain_as_published: byte & 0x08 != 0,
                retain_handling,
            }
        } else {
            if byte & 0xFC != 0 {
                return Err(DecodeError::MalformedPacket(
                    "requested QoS byte upper bits not 0 [MQTT-3-8.3-4]",
                ));
            }
            let qos = QoS::from_u8(byte).ok_or(DecodeError::MalformedPacket(
                "requested QoS 3 [MQTT-3-8.3-4]",
            ))?;
            SubscriptionOptions {
                qos,
                ..SubscriptionOptions::default()
            }
        };
        filters.push(SubscribeFilter { filter, options });
    }
    Ok(Subscribe {
        packet_id,
        filters,
        properties,
    })
}

fn decode_suback(r: &mut Reader<'_>, version: ProtocolVersion) -> Result<SubAck, DecodeError> {
    let packet_id = packet_id(r)?;
    let (properties, codes) = if version.is_v5() {
        (decode_props(r, ctx::ACK)?, SUBACK_CODES)
    } else {
        (Properties::default(), SUBACK_V3_CODES)
    };
    let reason_codes = r
        .rest()
        .iter()
        .map(|&c| check_reason(c, codes))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SubAck {
        packet_id,
        reason_codes,
        properties,
    })
}

fn decode_unsubscribe(
    r: &mut Reader<'_>,
    version: ProtocolVersion,
) -> Result<Unsubscribe, DecodeError> {
    let packet_id = request_packet_id(r)?;
    let properties = if version.is_v5() {
        decode_props(r, ctx::UNSUBSCRIBE)?
    } else {
        Properties::default()
    };
    if r.is_empty() {
        return Err(DecodeError::ProtocolError(
            "UNSUBSCRIBE without a topic filter [MQTT-3.10.3-2]",
        ));
    }
    let mut filters = Vec::new();
    while !r.is_empty() {
        let filter = r.string()?;
        // The same rules as a SUBSCRIBE's filters [MQTT-4.7.3-1] [MQTT-4.7.1-2]
        // [MQTT-4.7.1-3] (section 4.8.2 for `$share/`); a filter no SUBSCRIBE could have made
        // is malformed, as mosquitto treats it.
        if crate::topic::validate_subscription_filter(&filter).is_err() {
            return Err(DecodeError::MalformedPacket(
                "UNSUBSCRIBE with an invalid topic filter [MQTT-4.7.3-1] [MQTT-4.7.1-2]",
            ));
        }
        filters.push(filter);
    }
    Ok(Unsubscribe {
        packet_id,
        filters,
        properties,
    })
}

fn decode_unsuback(r: &mut Reader<'_>, version: ProtocolVersion) -> Result<UnsubAck, DecodeError> {
    let packet_id = packet_id(r)?;
    if !version.is_v5() {
        return Ok(UnsubAck {
            packet_id,
            reason_codes: Vec::new(),
            properties: Properties::default(),
        });
    }
    let properties = decode_props(r, ctx::ACK)?;
    let reason_codes = r
        .rest()
        .iter()
        .map(|&c| check_reason(c, UNSUBACK_CODES))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(UnsubAck {
        packet_id,
        reason_codes,
        properties,
    })
}

fn check_reason(code: u8, allowed: &[u8]) -> Result<ReasonCode, DecodeError> {
    if allowed.contains(&code) {
        Ok(ReasonCode(code))
    } else {
        Err(DecodeError::MalformedPacket(
            "reason code not allowed in this packet (section 2.4)",
        ))
    }
}

/// Reason codes each packet allows (MQTT 5.0 sections 3.2.2.2, 3.4.2.1, 3.5.2.1, 3.6.2.1,
/// 3.7.2.1, 3.9.3, 3.11.3, 3.14.2.1, 3.15.2.1) and the 3.1.1 SUBACK return codes (3.9.3).
pub(crate) const CONNACK_CODES: &[u8] = &[
    0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97,
    0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F,
];
pub(crate) const PUBACK_CODES: &[u8] = &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99];
pub(crate) const PUBREL_CODES: &[u8] = &[0x00, 0x92];
pub(crate) const SUBACK_CODES: &[u8] = &[
    0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2,
];
pub(crate) const SUBACK_V3_CODES: &[u8] = &[0x00, 0x01, 0x02, 0x80];
pub(crate) const UNSUBACK_CODES: &[u8] = &[0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91];
pub(crate) const DISCONNECT_CODES: &[u8] = &[
    0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
    0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2,
];
pub(crate) const AUTH_CODES: &[u8] = &[0x00, 0x18, 0x19];

/// Where a property block sits, as a bit set: the table of MQTT 5.0 section 2.2.2.2 says
/// which properties each place allows.
mod ctx {
    pub const CONNECT: u16 = 1 << 0;
    pub const WILL: u16 = 1 << 1;
    pub const CONNACK: u16 = 1 << 2;
    pub const PUBLISH: u16 = 1 << 3;
    /// PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK: reason string and user properties.
    pub const ACK: u16 = 1 << 4;
    pub const SUBSCRIBE: u16 = 1 << 5;
    pub const UNSUBSCRIBE: u16 = 1 << 6;
    pub const DISCONNECT: u16 = 1 << 7;
    pub const AUTH: u16 = 1 << 8;
    /// Stored properties ([`super::decode_properties`]): everything allowed.
    pub const ANY: u16 = u16::MAX;
}

/// Which places allow property `id`; 0 for an unknown identifier.
fn allowed_in(id: usize) -> u16 {
    use ctx::*;
    match id {
        0x01 | 0x02 | 0x03 | 0x08 | 0x09 => PUBLISH | WILL,
        0x0B => PUBLISH | SUBSCRIBE,
        0x11 => CONNECT | CONNACK | DISCONNECT,
        0x12 | 0x13 | 0x1A | 0x24 | 0x25 | 0x28 | 0x29 | 0x2A => CONNACK,
        0x15 | 0x16 => CONNECT | CONNACK | AUTH,
        0x17 | 0x19 => CONNECT,
        0x18 => WILL,
        0x1C => CONNACK | DISCONNECT,
        0x1F => CONNACK | ACK | DISCONNECT | AUTH,
        0x21 | 0x22 | 0x27 => CONNECT | CONNACK,
        0x23 => PUBLISH,
        0x26 => {
            CONNECT | WILL | CONNACK | PUBLISH | ACK | SUBSCRIBE | UNSUBSCRIBE | DISCONNECT | AUTH
        }
        _ => 0,
    }
}

fn once<T>(slot: &mut Option<T>, value: T) -> Result<(), DecodeError> {
    if slot.is_some() {
        return Err(DecodeError::ProtocolError(
            "property included more than once (section 2.2.2.2)",
        ));
    }
    *slot = Some(value);
    Ok(())
}

fn bool_byte(v: u8, what: &'static str) -> Result<u8, DecodeError> {
    if v > 1 {
        return Err(DecodeError::ProtocolError(what));
    }
    Ok(v)
}

/// A property block (length, then properties) allowed in `context`.
fn decode_props(r: &mut Reader<'_>, context: u16) -> Result<Properties, DecodeError> {
    let len = r.vbi()?;
    let mut p = Properties::default();
    if len == 0 {
        return Ok(p);
    }
    let mut r = r.sub(len)?;
    while !r.is_empty() {
        let id = r.vbi()?;
        if allowed_in(id) & context == 0 {
            return Err(DecodeError::MalformedPacket(
                "property not allowed in this packet (section 2.2.2.2)",
            ));
        }
        match id {
            0x01 => once(
                &mut p.payload_format_indicator,
                bool_byte(r.u8()?, "Payload Format Indicator not 0 or 1")?,
            )?,
            0x02 => once(&mut p.message_expiry_interval, r.u32()?)?,
            0x03 => once(&mut p.content_type, r.string()?)?,
            0x08 => {
                let topic = r.string()?;
                if topic.bytes().any(|b| b == b'+' || b == b'#') {
                    return Err(DecodeError::ProtocolError(
                        "Response Topic with a wildcard [MQTT-3.3.2-14]",
                    ));
                }
                once(&mut p.response_topic, topic)?
            }
            0x09 => once(&mut p.correlation_data, Bytes::copy_from_slice(r.binary()?))?,
            0x0B => {
                let v = r.vbi()?;
                if v == 0 {
                    return Err(DecodeError::ProtocolError(
                        "Subscription Identifier 0 (section 3.3.2.3.8)",
                    ));
                }
                if context & ctx::PUBLISH == 0 && !p.subscription_identifiers.is_empty() {
                    return Err(DecodeError::ProtocolError(
                        "Subscription Identifier included more than once (section 3.8.2.1.2)",
                    ));
                }
                p.subscription_identifiers.push(v as u32);
            }
            0x11 => once(&mut p.session_expiry_interval, r.u32()?)?,
            0x12 => once(&mut p.assigned_client_identifier, r.string()?)?,
            0x13 => once(&mut p.server_keep_alive, r.u16()?)?,
            0x15 => once(&mut p.authentication_method, r.string()?)?,
            0x16 => once(
                &mut p.authentication_data,
                Bytes::copy_from_slice(r.binary()?),
            )?,
            0x17 => once(
                &mut p.request_problem_information,
                bool_byte(r.u8()?, "Request Problem Information not 0 or 1")?,
            )?,
            0x18 => once(&mut p.will_delay_interval, r.u32()?)?,
            0x19 => once(
                &mut p.request_response_information,
                bool_byte(r.u8()?, "Request Response Information not 0 or 1")?,
            )?,
            0x1A => once(&mut p.response_information, r.string()?)?,
            0x1C => once(&mut p.server_reference, r.string()?)?,
            0x1F => once(&mut p.reason_string, r.string()?)?,
            0x21 => {
                let v = r.u16()?;
                if v == 0 {
                    return Err(DecodeError::ProtocolError(
                        "Receive Maximum 0 (section 3.1.2.11.3)",
                    ));
                }
                once(&mut p.receive_maximum, v)?
            }
            0x22 => once(&mut p.topic_alias_maximum, r.u16()?)?,
            // A Topic Alias of 0 is kept: the broker rejects it with 0x94 [MQTT-3.3.2-8].
            0x23 => once(&mut p.topic_alias, r.u16()?)?,
            0x24 => once(
                &mut p.maximum_qos,
                bool_byte(r.u8()?, "Maximum QoS not 0 or 1")?,
            )?,
            0x25 => once(
                &mut p.retain_available,
                bool_byte(r.u8()?, "Retain Available not 0 or 1")?,
            )?,
            0x26 => {
                let name = r.string()?;
                let value = r.string()?;
                p.user_properties.push((name, value));
            }
            0x27 => {
                let v = r.u32()?;
                if v == 0 {
                    return Err(DecodeError::ProtocolError(
                        "Maximum Packet Size 0 (section 3.1.2.11.4)",
                    ));
                }
                once(&mut p.maximum_packet_size, v)?
            }
            0x28 => once(
                &mut p.wildcard_subscription_available,
                bool_byte(r.u8()?, "Wildcard Subscription Available not 0 or 1")?,
            )?,
            0x29 => once(
                &mut p.subscription_identifier_available,
                bool_byte(r.u8()?, "Subscription Identifier Available not 0 or 1")?,
            )?,
            0x2A => once(
                &mut p.shared_subscription_available,
                bool_byte(r.u8()?, "Shared Subscription Available not 0 or 1")?,
            )?,
            _ => {
                return Err(DecodeError::MalformedPacket(
                    "unknown property identifier (section 2.2.2.2)",
                ))
            }
        }
    }
    Ok(p)
}
