//! Every strictness rule of the decoder, each citing the normative statement it enforces
//! (MQTT 3.1.1 and 5.0 OASIS Standards).

use bytes::BytesMut;
use mercurio_core::codec::*;

use ProtocolVersion::{V31, V311, V5};

const MAX: u32 = 268_435_460;

/// A frame: `first` byte, remaining length, body.
fn frame(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    let mut n = body.len();
    loop {
        let mut b = (n & 0x7F) as u8;
        n >>= 7;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(body);
    out
}

fn s(v: &str) -> Vec<u8> {
    let mut out = (v.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(v.as_bytes());
    out
}

fn malformed(r: Result<Packet, DecodeError>) {
    match r {
        Err(e @ DecodeError::MalformedPacket(_)) => assert_eq!(e.reason_code().0, 0x81),
        other => panic!("expected MalformedPacket, got {other:?}"),
    }
}

fn protocol_error(r: Result<Packet, DecodeError>) {
    match r {
        Err(e @ DecodeError::ProtocolError(_)) => assert_eq!(e.reason_code().0, 0x82),
        other => panic!("expected ProtocolError, got {other:?}"),
    }
}

fn topic_invalid(r: Result<Packet, DecodeError>) {
    match r {
        Err(e @ DecodeError::TopicNameInvalid(_)) => assert_eq!(e.reason_code().0, 0x90),
        other => panic!("expected TopicNameInvalid, got {other:?}"),
    }
}

/// A CONNECT body: name, level, flags, keep alive 60, [props], client id "c", rest.
fn connect_body(name: &str, level: u8, flags: u8, rest: &[u8]) -> Vec<u8> {
    let mut b = s(name);
    b.push(level);
    b.push(flags);
    b.extend_from_slice(&[0, 60]);
    if level == 5 {
        b.push(0);
    }
    b.extend_from_slice(&s("c"));
    b.extend_from_slice(rest);
    b
}

fn publish_body(topic: &str, pid: Option<u16>, props: Option<&[u8]>, payload: &[u8]) -> Vec<u8> {
    let mut b = s(topic);
    if let Some(id) = pid {
        b.extend_from_slice(&id.to_be_bytes());
    }
    if let Some(p) = props {
        b.push(p.len() as u8);
        b.extend_from_slice(p);
    }
    b.extend_from_slice(payload);
    b
}

// ---------------------------------------------------------------- framing

#[test]
fn packet_too_large_from_a_five_byte_header_announcing_200_mb() {
    // 0x30 then 200 MB as a 4-byte Variable Byte Integer; no body buffered.
    let n = 200 * 1024 * 1024usize;
    let hdr = [
        0x30,
        (n & 0x7F) as u8 | 0x80,
        ((n >> 7) & 0x7F) as u8 | 0x80,
        ((n >> 14) & 0x7F) as u8 | 0x80,
        (n >> 21) as u8,
    ];
    let e = check_frame(&hdr, 1_048_576).unwrap_err();
    assert_eq!(
        e,
        DecodeError::PacketTooLarge {
            size: n + 5,
            max: 1_048_576
        }
    );
    assert_eq!(e.reason_code().0, 0x95);
    let mut buf = BytesMut::from(&hdr[..]);
    assert!(matches!(
        decode(&mut buf, V5, 1_048_576),
        Err(DecodeError::PacketTooLarge { .. })
    ));
}

#[test]
fn packet_size_limit_counts_the_whole_packet() {
    let f = frame(0x30, &publish_body("a", None, None, b"xy"));
    assert_eq!(check_frame(&f, f.len() as u32), Ok(Some(f.len())));
    assert!(matches!(
        check_frame(&f, f.len() as u32 - 1),
        Err(DecodeError::PacketTooLarge { .. })
    ));
    // Known as soon as the header is: one byte of body is enough to know.
    assert!(matches!(
        check_frame(&f[..2], f.len() as u32 - 1),
        Err(DecodeError::PacketTooLarge { .. })
    ));
}

#[test]
fn remaining_length_over_four_bytes_is_malformed_section_2_2_3() {
    let f = [0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01];
    assert!(matches!(
        check_frame(&f, u32::MAX),
        Err(DecodeError::MalformedPacket(_))
    ));
    // Incomplete is not malformed: until the fifth length byte arrives, more bytes may help.
    assert_eq!(check_frame(&[0x30, 0xFF, 0xFF, 0xFF], u32::MAX), Ok(None));
    assert_eq!(check_frame(&[0x30], u32::MAX), Ok(None));
    assert_eq!(check_frame(&[], u32::MAX), Ok(None));
}

#[test]
fn remaining_length_not_in_shortest_form_is_malformed_mqtt_1_5_5_1() {
    assert!(matches!(
        check_frame(&[0xC0, 0x80, 0x00], MAX),
        Err(DecodeError::MalformedPacket(_))
    ));
}

#[test]
fn frame_longer_than_remaining_length_is_malformed() {
    let mut f = frame(0xC0, &[]);
    f.push(0);
    malformed(decode_packet(&f, V311));
}

#[test]
fn trailing_bytes_after_the_content_are_malformed() {
    // PINGREQ with a body, DISCONNECT 3.1.1 with a body, PUBACK 3.1.1 with 3 bytes.
    malformed(decode_packet(&frame(0xC0, &[0]), V311));
    malformed(decode_packet(&frame(0xE0, &[0]), V311));
    malformed(decode_packet(&frame(0x40, &[0, 1, 0]), V311));
    // UNSUBACK 3.1.1 has only the packet identifier.
    malformed(decode_packet(&frame(0xB0, &[0, 1, 0]), V311));
    // CONNECT with bytes after the payload.
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x02, &[0])),
        V311,
    ));
}

#[test]
fn packet_type_0_is_malformed_mqtt_2_1_3_1() {
    malformed(decode_packet(&frame(0x00, &[]), V311));
    malformed(decode_packet(&frame(0x00, &[]), V5));
}

#[test]
fn auth_is_malformed_before_5_0() {
    malformed(decode_packet(&frame(0xF0, &[]), V311));
    malformed(decode_packet(&frame(0xF0, &[]), V31));
    assert_eq!(
        decode_packet(&frame(0xF0, &[]), V5),
        Ok(Packet::Auth(Auth::default()))
    );
}

// ---------------------------------------------------------------- fixed header flags

#[test]
fn reserved_flag_bits_must_be_as_specified_mqtt_2_2_2_1_and_2() {
    for v in [V311, V5] {
        // PUBREL, SUBSCRIBE, UNSUBSCRIBE must be 0b0010.
        malformed(decode_packet(&frame(0x60, &[0, 1]), v));
        malformed(decode_packet(&frame(0x80, &[0, 1, 0, 1, b'a', 0]), v));
        malformed(decode_packet(&frame(0xA0, &[0, 1, 0, 1, b'a']), v));
        // The others 0.
        for first in [0x11, 0x21, 0x41, 0x51, 0x72, 0x91, 0xB1, 0xC8, 0xD1, 0xE2] {
            malformed(decode_packet(&frame(first, &[0, 1]), v));
        }
    }
    // PUBREL as fixed decodes.
    assert!(decode_packet(&frame(0x62, &[0, 1]), V311).is_ok());
}

#[test]
fn mqtt_3_1_tolerates_the_dup_bit_it_had_on_retried_pubrel() {
    assert!(decode_packet(&frame(0x6A, &[0, 1]), V31).is_ok());
    malformed(decode_packet(&frame(0x60, &[0, 1]), V31));
}

#[test]
fn publish_qos_3_is_malformed_mqtt_3_3_1_4() {
    malformed(decode_packet(
        &frame(0x36, &publish_body("a", Some(1), None, b"")),
        V311,
    ));
}

#[test]
fn publish_dup_with_qos_0_is_malformed_mqtt_3_3_1_2() {
    malformed(decode_packet(
        &frame(0x38, &publish_body("a", None, None, b"")),
        V311,
    ));
}

// ---------------------------------------------------------------- packet identifiers

/// Packet identifier 0 [MQTT-2.2.1-3]: the packet parses and the protocol forbids the value,
/// a Protocol Error (5.0 section 1.2) in a PUBLISH and the acknowledgements; in a SUBSCRIBE or
/// UNSUBSCRIBE a Malformed Packet (0x81, a packet that does not conform), mosquitto's answers.
#[test]
fn packet_identifier_0_is_a_protocol_error_mqtt_2_2_1_3() {
    for v in [V311, V5] {
        protocol_error(decode_packet(
            &frame(
                0x32,
                &publish_body("a", Some(0), v.is_v5().then_some(&[][..]), b""),
            ),
            v,
        ));
        protocol_error(decode_packet(&frame(0x40, &[0, 0]), v));
        protocol_error(decode_packet(&frame(0x62, &[0, 0]), v));
        let mut sub = vec![0, 0];
        if v.is_v5() {
            sub.push(0);
        }
        sub.extend_from_slice(&s("a"));
        let unsub = sub.clone();
        sub.push(0);
        malformed(decode_packet(&frame(0x82, &sub), v));
        malformed(decode_packet(&frame(0xA2, &unsub), v));
    }
}

// ---------------------------------------------------------------- strings and topics

#[test]
fn invalid_utf8_is_malformed_mqtt_1_5_4_1() {
    let body = [0, 2, 0xC3, 0x28]; // invalid 2-byte sequence
    malformed(decode_packet(&frame(0x30, &body), V311));
    // UTF-16 surrogate encoded in UTF-8 (U+D800).
    malformed(decode_packet(&frame(0x30, &[0, 3, 0xED, 0xA0, 0x80]), V311));
}

#[test]
fn null_character_is_malformed_mqtt_1_5_4_2() {
    malformed(decode_packet(
        &frame(0x30, &publish_body("a\0b", None, None, b"")),
        V311,
    ));
    // In a client identifier too.
    let mut b = s("MQTT");
    b.extend_from_slice(&[4, 0x02, 0, 60]);
    b.extend_from_slice(&s("c\0"));
    malformed(decode_packet(&frame(0x10, &b), V311));
}

/// A wildcard in a PUBLISH topic is data the protocol does not allow in a packet that parses:
/// a Protocol Error, 0x82 (5.0 section 1.2), as mosquitto answers it.
#[test]
fn wildcards_in_a_publish_topic_are_a_protocol_error_mqtt_3_3_2_2() {
    protocol_error(decode_packet(
        &frame(0x30, &publish_body("a/+", None, None, b"")),
        V311,
    ));
    protocol_error(decode_packet(
        &frame(0x30, &publish_body("a/#", None, None, b"")),
        V311,
    ));
    protocol_error(decode_packet(
        &frame(0x30, &publish_body("#", None, Some(&[]), b"")),
        V5,
    ));
}

/// An empty PUBLISH topic without a Topic Alias: a Protocol Error too.
#[test]
fn empty_topic_needs_a_topic_alias_in_5_0_mqtt_4_7_3_1() {
    protocol_error(decode_packet(
        &frame(0x30, &publish_body("", None, None, b"x")),
        V311,
    ));
    protocol_error(decode_packet(
        &frame(0x30, &publish_body("", None, Some(&[]), b"x")),
        V5,
    ));
    let p = decode_packet(
        &frame(0x30, &publish_body("", None, Some(&[0x23, 0, 7]), b"x")),
        V5,
    )
    .unwrap();
    let Packet::Publish(p) = p else { panic!() };
    assert_eq!(p.topic, "");
    assert_eq!(p.properties.topic_alias, Some(7));
}

#[test]
fn topic_alias_0_is_kept_for_the_broker_to_reject_mqtt_3_3_2_8() {
    let p = decode_packet(
        &frame(0x30, &publish_body("t", None, Some(&[0x23, 0, 0]), b"")),
        V5,
    )
    .unwrap();
    let Packet::Publish(p) = p else { panic!() };
    assert_eq!(p.properties.topic_alias, Some(0));
}

#[test]
fn publish_payload_is_its_own_allocation() {
    let f = frame(0x30, &publish_body("t", None, None, b"payload"));
    let mut buf = BytesMut::from(&f[..]);
    let Some(Packet::Publish(p)) = decode(&mut buf, V311, MAX).unwrap() else {
        panic!()
    };
    assert_eq!(&p.payload[..], b"payload");
    // Not a view into the read buffer: the Bytes is unique and exactly sized.
    let v: Vec<u8> = p.payload.into();
    assert_eq!(v.capacity(), 7);
}

// ---------------------------------------------------------------- CONNECT

#[test]
fn connect_protocol_names_and_levels_mqtt_3_1_2_1_and_2() {
    for (name, level, v) in [("MQTT", 4, V311), ("MQTT", 5, V5), ("MQIsdp", 3, V31)] {
        let p = decode_packet(&frame(0x10, &connect_body(name, level, 0x02, &[])), V311).unwrap();
        let Packet::Connect(c) = p else { panic!() };
        assert_eq!(c.protocol, v);
        assert_eq!(c.client_id, "c");
        assert!(c.clean_start);
    }
    for (name, level) in [("MQTT", 3), ("MQTT", 6), ("MQIsdp", 4), ("MQTT", 0x84)] {
        let e =
            decode_packet(&frame(0x10, &connect_body(name, level, 0x02, &[])), V311).unwrap_err();
        assert_eq!(e, DecodeError::UnsupportedProtocolVersion { level });
        assert_eq!(e.reason_code().0, 0x84);
    }
    for name in ["MQTX", "mqtt", "HTTP/1.1", ""] {
        assert_eq!(
            decode_packet(&frame(0x10, &connect_body(name, 4, 0x02, &[])), V311),
            Err(DecodeError::InvalidProtocolName)
        );
    }
}

#[test]
fn connect_reserved_flag_must_be_0_mqtt_3_1_2_3() {
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x03, &[])),
        V311,
    ));
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 5, 0x01, &[])),
        V311,
    ));
}

#[test]
fn will_qos_3_is_malformed_mqtt_3_1_2_14() {
    let mut will = s("w");
    will.extend_from_slice(&s("p"));
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x04 | 0x18, &will)),
        V311,
    ));
}

#[test]
fn will_qos_and_retain_must_be_0_without_will_flag_mqtt_3_1_2_11_13_15() {
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x08, &[])),
        V311,
    ));
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x10, &[])),
        V311,
    ));
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x20, &[])),
        V311,
    ));
}

#[test]
fn will_topic_with_wildcard_is_topic_name_invalid() {
    let mut will = s("w/#");
    will.extend_from_slice(&s("p"));
    topic_invalid(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x04, &will)),
        V311,
    ));
}

#[test]
fn password_without_user_name_malformed_in_3_1_1_mqtt_3_1_2_22_allowed_in_5_0() {
    let pw = s("secret");
    malformed(decode_packet(
        &frame(0x10, &connect_body("MQTT", 4, 0x40, &pw)),
        V311,
    ));
    let p = decode_packet(&frame(0x10, &connect_body("MQTT", 5, 0x40, &pw)), V311).unwrap();
    let Packet::Connect(c) = p else { panic!() };
    assert_eq!(c.username, None);
    assert_eq!(c.password.as_deref(), Some(&b"secret"[..]));
}

#[test]
fn truncated_connect_is_malformed_not_incomplete() {
    let b = connect_body("MQTT", 4, 0xC0, &s("user")); // password flag but no password
    malformed(decode_packet(&frame(0x10, &b), V311));
}

// ---------------------------------------------------------------- SUBSCRIBE / UNSUBSCRIBE

#[test]
fn subscribe_without_filter_is_a_protocol_error_mqtt_3_8_3_3() {
    protocol_error(decode_packet(&frame(0x82, &[0, 1]), V311));
    protocol_error(decode_packet(&frame(0x82, &[0, 1, 0]), V5));
}

#[test]
fn unsubscribe_without_filter_is_a_protocol_error_mqtt_3_10_3_2() {
    protocol_error(decode_packet(&frame(0xA2, &[0, 1]), V311));
    protocol_error(decode_packet(&frame(0xA2, &[0, 1, 0]), V5));
}

/// An UNSUBSCRIBE's filters follow the rules of a SUBSCRIBE's: non-empty [MQTT-4.7.3-1], `#`
/// alone in the last level [MQTT-4.7.1-2], `+` a whole level [MQTT-4.7.1-3], a well-formed
/// `$share/` filter (section 4.8.2). Anything else is malformed.
#[test]
fn unsubscribe_with_an_invalid_filter_is_malformed_mqtt_4_7_3_1() {
    for v in [V31, V311, V5] {
        for bad in [
            "",
            "#/a",
            "a#",
            "a/b+",
            "$share/g",
            "$share//a",
            "$share/g+/a",
        ] {
            let mut b = vec![0, 1];
            if v.is_v5() {
                b.push(0);
            }
            b.extend_from_slice(&s("ok/+"));
            b.extend_from_slice(&s(bad));
            malformed(decode_packet(&frame(0xA2, &b), v));
        }
        for good in ["a", "+", "#", "a/+/#", "/", "$share/g/a/#"] {
            let mut b = vec![0, 1];
            if v.is_v5() {
                b.push(0);
            }
            b.extend_from_slice(&s(good));
            assert!(decode_packet(&frame(0xA2, &b), v).is_ok(), "{good}");
        }
    }
}

/// A PUBLISH from a client must not carry a Subscription Identifier [MQTT-3.3.4-6]; the same
/// PUBLISH from the server (what a client decodes) is valid.
#[test]
fn client_publish_with_a_subscription_identifier_is_a_protocol_error_mqtt_3_3_4_6() {
    // Topic "t", QoS 0, properties: Subscription Identifier 5.
    let body = [0, 1, b't', 2, 0x0B, 5, b'x'];
    let wire = frame(0x30, &body);
    assert!(decode_packet(&wire, V5).is_ok());
    let mut buf = BytesMut::from(&wire[..]);
    protocol_error(decode_from_client(&mut buf, V5, MAX).map(|p| p.expect("whole")));
    assert!(buf.is_empty());
    // Without the property the client's PUBLISH is fine.
    let mut buf = BytesMut::from(&frame(0x30, &[0, 1, b't', 0, b'x'])[..]);
    assert!(matches!(
        decode_from_client(&mut buf, V5, MAX),
        Ok(Some(Packet::Publish(_)))
    ));
}

fn subscribe(v: ProtocolVersion, filter: &str, options: u8) -> Result<Packet, DecodeError> {
    let mut b = vec![0, 1];
    if v.is_v5() {
        b.push(0);
    }
    b.extend_from_slice(&s(filter));
    b.push(options);
    decode_packet(&frame(0x82, &b), v)
}

#[test]
fn requested_qos_upper_bits_must_be_0_in_3_x_mqtt_3_8_3_4() {
    malformed(subscribe(V311, "a", 0x04));
    malformed(subscribe(V311, "a", 0x80));
    malformed(subscribe(V31, "a", 0x03));
    assert!(subscribe(V311, "a", 0x02).is_ok());
}

#[test]
fn subscription_options_reserved_bits_must_be_0_mqtt_3_8_3_5() {
    malformed(subscribe(V5, "a", 0x40));
    malformed(subscribe(V5, "a", 0x80));
    malformed(subscribe(V5, "a", 0x03)); // Maximum QoS 3
}

#[test]
fn retain_handling_3_is_a_protocol_error_section_3_8_3_1() {
    protocol_error(subscribe(V5, "a", 0x30));
    let Packet::Subscribe(s) = subscribe(V5, "a", 0x2E).unwrap() else {
        panic!()
    };
    let o = s.filters[0].options;
    assert_eq!(
        (o.qos, o.no_local, o.retain_as_published, o.retain_handling),
        (QoS::ExactlyOnce, true, true, 2)
    );
}

#[test]
fn no_local_on_a_shared_subscription_is_a_protocol_error_mqtt_3_8_3_4() {
    protocol_error(subscribe(V5, "$share/g/a", 0x04));
}

// ---------------------------------------------------------------- 5.0 short forms

#[test]
fn short_acks_mean_success_without_properties_mqtt_3_4_2_1() {
    for first in [0x40, 0x50, 0x62, 0x70] {
        let p = decode_packet(&frame(first, &[0, 9]), V5).unwrap();
        let a = match p {
            Packet::PubAck(a) | Packet::PubRec(a) | Packet::PubRel(a) | Packet::PubComp(a) => a,
            _ => panic!(),
        };
        assert_eq!(a.packet_id, 9);
        assert_eq!(a.reason_code, ReasonCode::SUCCESS);
        assert!(a.properties.is_empty());
    }
    let Packet::PubAck(a) = decode_packet(&frame(0x40, &[0, 9, 0x10]), V5).unwrap() else {
        panic!()
    };
    assert_eq!(a.reason_code, ReasonCode::NO_MATCHING_SUBSCRIBERS);
    // Encoding writes the short forms.
    let mut out = BytesMut::new();
    encode(
        &Packet::PubAck(PubAck {
            packet_id: 9,
            ..Default::default()
        }),
        V5,
        &mut out,
    )
    .unwrap();
    assert_eq!(&out[..], &[0x40, 2, 0, 9]);
    out.clear();
    encode(&Packet::PubAck(a), V5, &mut out).unwrap();
    assert_eq!(&out[..], &[0x40, 3, 0, 9, 0x10]);
}

#[test]
fn bare_disconnect_is_normal_disconnection_mqtt_3_14_2_1() {
    assert_eq!(
        decode_packet(&[0xE0, 0], V5),
        Ok(Packet::Disconnect(Disconnect::default()))
    );
    let Packet::Disconnect(d) = decode_packet(&[0xE0, 1, 0x04], V5).unwrap() else {
        panic!()
    };
    assert_eq!(d.reason_code, ReasonCode::DISCONNECT_WITH_WILL_MESSAGE);
    let mut out = BytesMut::new();
    encode(&Packet::Disconnect(Disconnect::default()), V5, &mut out).unwrap();
    assert_eq!(&out[..], &[0xE0, 0]);
}

#[test]
fn reason_code_not_allowed_in_the_packet_is_malformed_section_2_4() {
    malformed(decode_packet(&[0xE0, 1, 0x05], V5));
    malformed(decode_packet(&[0x62, 3, 0, 1, 0x10], V5)); // PUBREL 0x10
    malformed(decode_packet(&[0xF0, 1, 0x01], V5));
    malformed(decode_packet(&[0x90, 3, 0, 1, 0x03], V311)); // SUBACK 3.x return code 3
}

// ---------------------------------------------------------------- properties

fn publish_with_props(props: &[u8]) -> Result<Packet, DecodeError> {
    decode_packet(&frame(0x30, &publish_body("t", None, Some(props), b"")), V5)
}

#[test]
fn property_not_allowed_in_the_packet_is_malformed_section_2_2_2_2() {
    malformed(publish_with_props(&[0x11, 0, 0, 0, 1])); // session expiry in PUBLISH
    malformed(publish_with_props(&[0x27, 0, 0, 0, 1])); // maximum packet size
    malformed(publish_with_props(&[0x7F, 0])); // unknown identifier
    malformed(decode_packet(&[0x40, 6, 0, 1, 0, 2, 0x23, 0], V5)); // topic alias in PUBACK
}

#[test]
fn property_given_twice_is_a_protocol_error_section_2_2_2_2() {
    protocol_error(publish_with_props(&[0x02, 0, 0, 0, 1, 0x02, 0, 0, 0, 2]));
    protocol_error(publish_with_props(&[0x23, 0, 1, 0x23, 0, 2]));
    // A Subscription Identifier twice in SUBSCRIBE.
    let mut b = vec![0, 1, 4, 0x0B, 1, 0x0B, 2];
    b.extend_from_slice(&s("a"));
    b.push(0);
    protocol_error(decode_packet(&frame(0x82, &b), V5));
}

#[test]
fn user_properties_and_subscription_identifiers_repeat_in_order() {
    let mut props = vec![0x0B, 3, 0x0B, 1];
    for (k, v) in [("k", "2"), ("a", "1"), ("k", "2")] {
        props.push(0x26);
        props.extend_from_slice(&s(k));
        props.extend_from_slice(&s(v));
    }
    let Packet::Publish(p) = publish_with_props(&props).unwrap() else {
        panic!()
    };
    assert_eq!(p.properties.subscription_identifiers, vec![3, 1]);
    let up: Vec<(&str, &str)> = p
        .properties
        .user_properties
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    assert_eq!(up, vec![("k", "2"), ("a", "1"), ("k", "2")]);
}

#[test]
fn subscription_identifier_0_is_a_protocol_error_section_3_3_2_3_8() {
    protocol_error(publish_with_props(&[0x0B, 0]));
}

#[test]
fn byte_properties_other_than_0_or_1_are_protocol_errors() {
    protocol_error(publish_with_props(&[0x01, 2]));
    // Request Problem Information 2 in CONNECT.
    let mut b = s("MQTT");
    b.extend_from_slice(&[5, 0x02, 0, 60, 2, 0x17, 2]);
    b.extend_from_slice(&s("c"));
    protocol_error(decode_packet(&frame(0x10, &b), V311));
    // Maximum QoS 2 in CONNACK.
    protocol_error(decode_packet(&[0x20, 5, 0, 0, 2, 0x24, 2], V5));
}

#[test]
fn receive_maximum_0_and_maximum_packet_size_0_are_protocol_errors() {
    for props in [&[0x21u8, 0, 0][..], &[0x27, 0, 0, 0, 0][..]] {
        let mut b = s("MQTT");
        b.extend_from_slice(&[5, 0x02, 0, 60, props.len() as u8]);
        b.extend_from_slice(props);
        b.extend_from_slice(&s("c"));
        protocol_error(decode_packet(&frame(0x10, &b), V311));
    }
}

#[test]
fn property_length_past_the_packet_is_malformed() {
    malformed(decode_packet(&frame(0x30, &[0, 1, b't', 9, 0x01]), V5));
}

#[test]
fn decode_properties_allows_every_property_and_rejects_trailing_bytes() {
    let p = Properties {
        session_expiry_interval: Some(5),
        topic_alias: Some(3),
        will_delay_interval: Some(9),
        subscription_identifiers: vec![1, 2],
        user_properties: vec![("a".into(), "b".into())],
        ..Properties::default()
    };
    let mut out = BytesMut::new();
    encode_properties(&p, &mut out).unwrap();
    assert_eq!(decode_properties(&out), Ok(p));
    out.extend_from_slice(&[0]);
    assert!(matches!(
        decode_properties(&out),
        Err(DecodeError::MalformedPacket(_))
    ));
}

// ---------------------------------------------------------------- encoder limits

#[test]
fn encoder_rejects_strings_over_65535_bytes_without_truncating() {
    let topic = "a".repeat(65_536);
    let props = Properties::default();
    let p = PublishRef {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: false,
        topic: &topic,
        packet_id: 0,
        properties: &props,
        payload: b"",
    };
    let mut out = BytesMut::from(&b"keep"[..]);
    assert!(matches!(
        encode_publish(&p, V311, &mut out),
        Err(EncodeError::StringTooLong { len: 65_536, .. })
    ));
    assert_eq!(&out[..], b"keep");
    assert_eq!(publish_encoded_len(&p, V311), usize::MAX);
    // 65,535 is fine.
    let topic = "a".repeat(65_535);
    let p = PublishRef { topic: &topic, ..p };
    encode_publish(&p, V311, &mut out).unwrap();
}

#[test]
fn encoder_rejects_packets_over_268435455_bytes() {
    let payload = vec![0u8; 268_435_455];
    let props = Properties::default();
    let p = PublishRef {
        dup: false,
        qos: QoS::AtMostOnce,
        retain: false,
        topic: "t",
        packet_id: 0,
        properties: &props,
        payload: &payload,
    };
    let mut out = BytesMut::new();
    assert!(matches!(
        encode_publish(&p, V311, &mut out),
        Err(EncodeError::PacketTooLarge { .. })
    ));
    assert!(out.is_empty());
}

#[test]
fn encoder_rejects_property_values_out_of_range() {
    for p in [
        Properties {
            subscription_identifiers: vec![0],
            ..Default::default()
        },
        Properties {
            subscription_identifiers: vec![268_435_456],
            ..Default::default()
        },
        Properties {
            receive_maximum: Some(0),
            ..Default::default()
        },
        Properties {
            maximum_packet_size: Some(0),
            ..Default::default()
        },
        Properties {
            payload_format_indicator: Some(2),
            ..Default::default()
        },
    ] {
        let mut out = BytesMut::new();
        assert!(matches!(
            encode_properties(&p, &mut out),
            Err(EncodeError::PropertyOutOfRange(_))
        ));
        assert!(out.is_empty());
    }
}

#[test]
fn auth_cannot_be_encoded_before_5_0() {
    let mut out = BytesMut::new();
    assert!(matches!(
        encode(&Packet::Auth(Auth::default()), V311, &mut out),
        Err(EncodeError::NotInVersion { .. })
    ));
}

#[test]
fn v3_encoding_maps_codes_and_drops_5_0_fields() {
    let mut out = BytesMut::new();
    let suback = SubAck {
        packet_id: 1,
        reason_codes: vec![ReasonCode(1), ReasonCode::NOT_AUTHORIZED],
        properties: Properties {
            reason_string: Some("x".into()),
            ..Default::default()
        },
    };
    encode(&Packet::SubAck(suback), V311, &mut out).unwrap();
    assert_eq!(&out[..], &[0x90, 4, 0, 1, 1, 0x80]);
    out.clear();
    let connack = ConnAck {
        reason_code: ReasonCode::UNSUPPORTED_PROTOCOL_VERSION,
        ..Default::default()
    };
    encode(&Packet::ConnAck(connack), V311, &mut out).unwrap();
    assert_eq!(&out[..], &[0x20, 2, 0, 1]);
    out.clear();
    let unsuback = UnsubAck {
        packet_id: 2,
        reason_codes: vec![ReasonCode(0x11)],
        properties: Properties::default(),
    };
    encode(&Packet::UnsubAck(unsuback), V311, &mut out).unwrap();
    assert_eq!(&out[..], &[0xB0, 2, 0, 2]);
}

#[test]
fn v31_connect_is_mqisdp_level_3() {
    let c = Connect {
        protocol: V31,
        clean_start: true,
        keep_alive: 10,
        client_id: "c".into(),
        will: None,
        username: None,
        password: None,
        properties: Properties::default(),
    };
    let mut out = BytesMut::new();
    encode(&Packet::Connect(Box::new(c)), V311, &mut out).unwrap();
    assert_eq!(&out[2..11], b"\x00\x06MQIsdp\x03");
}
