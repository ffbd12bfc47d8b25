//! Proptest generators of valid packets for every version, shared by the codec tests
//! (included with `mod codec_support;`; as a test target of its own it holds no test).
#![allow(dead_code)]

use bytes::Bytes;
use mercurio_core::codec::*;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

/// Strings the decoder accepts: any character (multi-byte included) but U+0000, the control
/// characters and the non-characters (section 1.5.4).
pub fn any_str() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9/_ -]{0,12}",
        "[\u{20}-\u{7e}\u{a0}-\u{d7ff}\u{e000}-\u{fdcf}\u{fdf0}-\u{fffd}\u{10000}-\u{1fffd}\u{100000}-\u{10fffd}]{0,6}",
    ]
}

/// Topic names: at least one character, no wildcard.
pub fn topic_name() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9/$]{1,20}",
        "[a-z]{1,5}/[\u{e9}\u{4e2d}\u{1f600}a-z ]{1,5}",
    ]
}

/// Valid topic filters: levels of letters, digits or `+`, maybe a final `#` (an UNSUBSCRIBE's
/// filters are checked by the decoder; a SUBSCRIBE's by the broker, filter by filter).
pub fn topic_filter() -> impl Strategy<Value = String> {
    (
        vec(
            prop_oneof![3 => "[a-z0-9]{0,4}", 1 => Just("+".to_string())],
            1..5,
        ),
        any::<bool>(),
    )
        .prop_map(|(mut levels, hash)| {
            if hash {
                levels.push("#".to_string());
            }
            levels.join("/")
        })
        .prop_filter("empty filter", |f| !f.is_empty())
}

pub fn bytes_(max: usize) -> impl Strategy<Value = Bytes> {
    vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

pub fn qos() -> impl Strategy<Value = QoS> {
    prop_oneof![
        Just(QoS::AtMostOnce),
        Just(QoS::AtLeastOnce),
        Just(QoS::ExactlyOnce)
    ]
}

pub fn version() -> impl Strategy<Value = ProtocolVersion> {
    prop_oneof![
        Just(ProtocolVersion::V31),
        Just(ProtocolVersion::V311),
        Just(ProtocolVersion::V5)
    ]
}

fn user_props() -> impl Strategy<Value = Vec<(String, String)>> {
    vec((any_str(), any_str()), 0..3)
}

fn bool_byte() -> impl Strategy<Value = Option<u8>> {
    option::of(0u8..=1)
}

fn sub_id() -> impl Strategy<Value = u32> {
    prop_oneof![1u32..200, 1u32..=268_435_455]
}

/// The properties a packet type allows (MQTT 5.0 section 2.2.2.2), with valid values.
#[derive(Clone, Copy, Debug)]
pub enum Place {
    Connect,
    Will,
    ConnAck,
    Publish,
    Ack,
    Subscribe,
    Unsubscribe,
    Disconnect,
    Auth,
}

pub fn props(place: Place) -> BoxedStrategy<Properties> {
    match place {
        Place::Publish | Place::Will => (
            bool_byte(),
            option::of(any::<u32>()),
            option::of(any_str()),
            option::of(topic_name()),
            option::of(bytes_(8)),
            vec(sub_id(), 0..3),
            option::of(any::<u16>()),
            option::of(any::<u32>()),
            user_props(),
        )
            .prop_map(move |(pfi, mei, ct, rt, cd, sids, ta, wdi, up)| {
                let mut p = Properties {
                    payload_format_indicator: pfi,
                    message_expiry_interval: mei,
                    content_type: ct,
                    response_topic: rt,
                    correlation_data: cd,
                    user_properties: up,
                    ..Properties::default()
                };
                if matches!(place, Place::Publish) {
                    p.subscription_identifiers = sids;
                    p.topic_alias = ta;
                } else {
                    p.will_delay_interval = wdi;
                }
                p
            })
            .boxed(),
        Place::Connect => (
            option::of(any::<u32>()),
            option::of(any_str()),
            option::of(bytes_(8)),
            bool_byte(),
            bool_byte(),
            option::of(1u16..),
            option::of(any::<u16>()),
            option::of(1u32..),
            user_props(),
        )
            .prop_map(|(sei, am, ad, rpi, rri, rm, tam, mps, up)| Properties {
                session_expiry_interval: sei,
                authentication_method: am,
                authentication_data: ad,
                request_problem_information: rpi,
                request_response_information: rri,
                receive_maximum: rm,
                topic_alias_maximum: tam,
                maximum_packet_size: mps,
                user_properties: up,
                ..Properties::default()
            })
            .boxed(),
        Place::ConnAck => (
            (
                option::of(any::<u32>()),
                option::of(any_str()),
                option::of(any::<u16>()),
                option::of(any_str()),
                option::of(bytes_(8)),
                option::of(any_str()),
                option::of(any_str()),
                option::of(any_str()),
            ),
            (
                option::of(1u16..),
                option::of(any::<u16>()),
                bool_byte(),
                bool_byte(),
                option::of(1u32..),
                bool_byte(),
                bool_byte(),
                bool_byte(),
                user_props(),
            ),
        )
            .prop_map(
                |((sei, aci, ska, am, ad, ri, sr, rs), (rm, tam, mq, ra, mps, w, s, sh, up))| {
                    Properties {
                        session_expiry_interval: sei,
                        assigned_client_identifier: aci,
                        server_keep_alive: ska,
                        authentication_method: am,
                        authentication_data: ad,
                        response_information: ri,
                        server_reference: sr,
                        reason_string: rs,
                        receive_maximum: rm,
                        topic_alias_maximum: tam,
                        maximum_qos: mq,
                        retain_available: ra,
                        maximum_packet_size: mps,
                        wildcard_subscription_available: w,
                        subscription_identifier_available: s,
                        shared_subscription_available: sh,
                        user_properties: up,
                        ..Properties::default()
                    }
                },
            )
            .boxed(),
        Place::Ack => (option::of(any_str()), user_props())
            .prop_map(|(rs, up)| Properties {
                reason_string: rs,
                user_properties: up,
                ..Properties::default()
            })
            .boxed(),
        Place::Subscribe => (option::of(sub_id()), user_props())
            .prop_map(|(sid, up)| Properties {
                subscription_identifiers: sid.into_iter().collect(),
                user_properties: up,
                ..Properties::default()
            })
            .boxed(),
        Place::Unsubscribe => user_props()
            .prop_map(|up| Properties {
                user_properties: up,
                ..Properties::default()
            })
            .boxed(),
        Place::Disconnect => (
            option::of(any::<u32>()),
            option::of(any_str()),
            option::of(any_str()),
            user_props(),
        )
            .prop_map(|(sei, sr, rs, up)| Properties {
                session_expiry_interval: sei,
                server_reference: sr,
                reason_string: rs,
                user_properties: up,
                ..Properties::default()
            })
            .boxed(),
        Place::Auth => (
            option::of(any_str()),
            option::of(bytes_(8)),
            option::of(any_str()),
            user_props(),
        )
            .prop_map(|(am, ad, rs, up)| Properties {
                authentication_method: am,
                authentication_data: ad,
                reason_string: rs,
                user_properties: up,
                ..Properties::default()
            })
            .boxed(),
    }
}

/// 5.0 properties, or none before 5.0 (3.x has none; the decoder leaves them empty).
fn props_for(v: ProtocolVersion, place: Place) -> BoxedStrategy<Properties> {
    if v.is_v5() {
        props(place)
    } else {
        Just(Properties::default()).boxed()
    }
}

fn code_from(
    v: ProtocolVersion,
    v5: &'static [u8],
    v3: &'static [u8],
) -> BoxedStrategy<ReasonCode> {
    let list = if v.is_v5() { v5 } else { v3 };
    proptest::sample::select(list).prop_map(ReasonCode).boxed()
}

pub const CONNACK_CODES: &[u8] = &[
    0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97,
    0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F,
];
pub const PUBACK_CODES: &[u8] = &[0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99];
pub const PUBREL_CODES: &[u8] = &[0x00, 0x92];
pub const SUBACK_CODES: &[u8] = &[
    0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2,
];
pub const UNSUBACK_CODES: &[u8] = &[0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91];
pub const DISCONNECT_CODES: &[u8] = &[
    0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95,
    0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2,
];
pub const AUTH_CODES: &[u8] = &[0x00, 0x18, 0x19];

pub fn connect(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    let will = (
        props_for(v, Place::Will),
        topic_name(),
        bytes_(16),
        qos(),
        any::<bool>(),
    )
        .prop_map(|(properties, topic, payload, qos, retain)| LastWill {
            topic,
            payload,
            qos,
            retain,
            properties,
        });
    (
        any::<bool>(),
        any::<u16>(),
        any_str(),
        option::of(will),
        option::of(any_str()),
        option::of(bytes_(12)),
        props_for(v, Place::Connect),
    )
        .prop_map(
            move |(clean_start, keep_alive, client_id, will, username, password, properties)| {
                // 3.x: a password needs a user name [MQTT-3.1.2-22].
                let password = if !v.is_v5() && username.is_none() {
                    None
                } else {
                    password
                };
                Packet::Connect(Box::new(Connect {
                    protocol: v,
                    clean_start,
                    keep_alive,
                    client_id,
                    will,
                    username,
                    password,
                    properties,
                }))
            },
        )
}

pub fn publish(v: ProtocolVersion) -> impl Strategy<Value = Packet> {
    (
        any::<bool>(),
        qos(),
        any::<bool>(),
        topic_name(),
        1u16..,
        props_for(v, Place::Publish),
        bytes_(64),
        any::<bool>(),
    )
        .prop_map(
            move |(dup, qos, retain, topic, pid, properties, payload, empty_topic)| {
                let qos0 = qos == QoS::AtMostOnce;
                // 5.0: an empty topic name with a Topic Alias.
                let topic = if v.is_v5() && empty_topic && properties.topic_alias.is_some() {
                    String::new()
                } else {
                    topic
                };
                Packet::Publish(Publish {
                    dup: dup && !qos0,
                    qos,
                    retain,
                    topic,
                    packet_id: if qos0 { 0 } else { pid },
                    properties,
                    payload,
                })
            },
        )
}

fn puback(v: ProtocolVersion, codes: &'static [u8]) -> impl Strategy<Value = PubAck> {
    (1u16.., code_from(v, codes, &[0]), props_for(v, Place::Ack)).prop_map(
        |(packet_id, reason_code, properties)| PubAck {
            packet_id,
            reason_code,
            properties,
        },
    )
}

fn sub_options(v: ProtocolVersion) -> BoxedStrategy<SubscriptionOptions> {
    if v.is_v5() {
        (qos(), any::<bool>(), any::<bool>(), 0u8..3)
            .prop_map(
                |(qos, no_local, retain_as_published, retain_handling)| SubscriptionOptions {
                    qos,
                    no_local,
                    retain_as_published,
                    retain_handling,
                },
            )
            .boxed()
    } else {
        qos()
            .prop_map(|qos| SubscriptionOptions {
                qos,
                ..SubscriptionOptions::default()
            })
            .boxed()
    }
}

pub fn packet(v: ProtocolVersion) -> BoxedStrategy<Packet> {
    let mut s = vec![
        connect(v).boxed(),
        (
            any::<bool>(),
            code_from(v, CONNACK_CODES, &[0, 1, 2, 3, 4, 5]),
            props_for(v, Place::ConnAck),
        )
            .prop_map(move |(sp, reason_code, properties)| {
                Packet::ConnAck(ConnAck {
                    session_present: sp && v != ProtocolVersion::V31,
                    reason_code,
                    properties,
                })
            })
            .boxed(),
        publish(v).boxed(),
        puback(v, PUBACK_CODES).prop_map(Packet::PubAck).boxed(),
        puback(v, PUBACK_CODES).prop_map(Packet::PubRec).boxed(),
        puback(v, PUBREL_CODES).prop_map(Packet::PubRel).boxed(),
        puback(v, PUBREL_CODES).prop_map(Packet::PubComp).boxed(),
        (
            1u16..,
            vec((topic_filter(), sub_options(v)), 1..4),
            props_for(v, Place::Subscribe),
        )
            .prop_map(|(packet_id, filters, properties)| {
                Packet::Subscribe(Subscribe {
                    packet_id,
                    filters: filters
                        .into_iter()
                        .map(|(filter, options)| SubscribeFilter { filter, options })
                        .collect(),
                    properties,
                })
            })
            .boxed(),
        (
            1u16..,
            vec(code_from(v, SUBACK_CODES, &[0, 1, 2, 0x80]), 1..4),
            props_for(v, Place::Ack),
        )
            .prop_map(|(packet_id, reason_codes, properties)| {
                Packet::SubAck(SubAck {
                    packet_id,
                    reason_codes,
                    properties,
                })
            })
            .boxed(),
        (
            1u16..,
            vec(topic_filter(), 1..4),
            props_for(v, Place::Unsubscribe),
        )
            .prop_map(|(packet_id, filters, properties)| {
                Packet::Unsubscribe(Unsubscribe {
                    packet_id,
                    filters,
                    properties,
                })
            })
            .boxed(),
        (
            1u16..,
            vec(
                code_from(v, UNSUBACK_CODES, &[0]),
                if v.is_v5() { 1..4 } else { 0..1 },
            ),
            props_for(v, Place::Ack),
        )
            .prop_map(|(packet_id, reason_codes, properties)| {
                Packet::UnsubAck(UnsubAck {
                    packet_id,
                    reason_codes,
                    properties,
                })
            })
            .boxed(),
        Just(Packet::PingReq).boxed(),
        Just(Packet::PingResp).boxed(),
        (
            code_from(v, DISCONNECT_CODES, &[0]),
            props_for(v, Place::Disconnect),
        )
            .prop_map(|(reason_code, properties)| {
                Packet::Disconnect(Disconnect {
                    reason_code,
                    properties,
                })
            })
            .boxed(),
    ];
    if v.is_v5() {
        s.push(
            (code_from(v, AUTH_CODES, &[0]), props(Place::Auth))
                .prop_map(|(reason_code, properties)| {
                    Packet::Auth(Auth {
                        reason_code,
                        properties,
                    })
                })
                .boxed(),
        );
    }
    proptest::strategy::Union::new(s).boxed()
}

/// A version and a valid packet of that version.
pub fn versioned_packet() -> impl Strategy<Value = (ProtocolVersion, Packet)> {
    version().prop_flat_map(|v| packet(v).prop_map(move |p| (v, p)))
}

/// Encodes `p` for `v`, panicking on error (test helper).
pub fn enc(p: &Packet, v: ProtocolVersion) -> bytes::BytesMut {
    let mut out = bytes::BytesMut::new();
    encode(p, v, &mut out).expect("encodes");
    out
}
