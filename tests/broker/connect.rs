//! CONNECT and CONNACK: protocol name and level, client identifiers, session present,
//! takeover, CONNACK properties, keep alive and connect_timeout (MQTT 3.1.1 and 5.0
//! sections 3.1 and 3.2).
use crate::common;

use std::time::{Duration, Instant};

use common::*;
use mercurio::codec::{Packet, Properties, ProtocolVersion, QoS, ReasonCode};

/// A 3.1.1-style CONNECT with protocol name `name` and level `level`, client id "x".
fn raw_connect(name: &[u8], level: u8) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&(name.len() as u16).to_be_bytes());
    body.extend_from_slice(name);
    body.push(level);
    body.push(0x02); // clean session
    body.extend_from_slice(&60u16.to_be_bytes());
    if level == 5 {
        body.push(0); // no properties
    }
    body.extend_from_slice(&[0, 1, b'x']);
    let mut out = vec![0x10, body.len() as u8];
    out.extend_from_slice(&body);
    out
}

/// Each version is accepted with its own protocol name and level: 3.1 `MQIsdp`/3, 3.1.1
/// `MQTT`/4, 5.0 `MQTT`/5. [MQTT-3.1.2-1] [MQTT-3.2.2-1]
#[tokio::test]
async fn each_protocol_version_is_accepted() {
    let (broker, addr) = start().await;
    for (version, name, level) in [
        (ProtocolVersion::V31, &b"MQIsdp"[..], 3u8),
        (ProtocolVersion::V311, &b"MQTT"[..], 4),
        (ProtocolVersion::V5, &b"MQTT"[..], 5),
    ] {
        let mut c = Client::open(addr, version).await;
        c.send_raw(&raw_connect(name, level)).await;
        match c.recv().await {
            Some(Packet::ConnAck(ack)) => {
                assert_eq!(ack.reason_code, ReasonCode::SUCCESS, "{version:?}");
                assert!(!ack.session_present);
            }
            other => panic!("{version:?}: expected CONNACK, got {other:?}"),
        }
        c.ping().await;
    }
    broker.shutdown().await;
}

/// An unsupported protocol level is answered with CONNACK return code 1 (unacceptable
/// protocol version), then the connection is closed. [MQTT-3.1.2-2]
#[tokio::test]
async fn unsupported_protocol_level_gets_return_code_1_then_close() {
    let (broker, addr) = start().await;
    for level in [2u8, 6, 0x7f] {
        let mut c = Client::open(addr, ProtocolVersion::V311).await;
        c.send_raw(&raw_connect(b"MQTT", level)).await;
        let seen = c.expect_closed().await;
        match seen.as_slice() {
            [Packet::ConnAck(ack)] => {
                assert_eq!(ack.reason_code, ReasonCode(1), "level {level}");
                assert!(!ack.session_present, "[MQTT-3.2.2-4]");
            }
            other => panic!("level {level}: expected one CONNACK then close, got {other:?}"),
        }
    }
    broker.shutdown().await;
}

/// A protocol name other than `MQTT` (or `MQIsdp` for 3.1) closes the connection without a
/// CONNACK. [MQTT-3.1.2-1]
#[tokio::test]
async fn bad_protocol_name_closes_without_connack() {
    let (broker, addr) = start().await;
    for name in [&b"MQTX"[..], b"mqtt", b"MQIsdp\0"] {
        let mut c = Client::open(addr, ProtocolVersion::V311).await;
        c.send_raw(&raw_connect(name, 4)).await;
        let seen = c.expect_closed().await;
        assert!(seen.is_empty(), "{name:?}: got {seen:?}");
    }
    broker.shutdown().await;
}

/// The first packet must be CONNECT; anything else closes the connection. [MQTT-3.1.0-1]
#[tokio::test]
async fn first_packet_not_connect_is_closed() {
    let (broker, addr) = start().await;
    let firsts: [&[u8]; 3] = [
        &[0xC0, 0x00],                                     // PINGREQ
        &[0x30, 0x05, 0x00, 0x01, b't', b'h', b'i'],       // PUBLISH
        &[0x82, 0x06, 0x00, 0x01, 0x00, 0x01, b't', 0x00], // SUBSCRIBE
    ];
    for first in firsts {
        let mut c = Client::open(addr, ProtocolVersion::V311).await;
        c.send_raw(first).await;
        let seen = c.expect_closed().await;
        assert!(seen.is_empty(), "{first:02x?}: got {seen:?}");
    }
    broker.shutdown().await;
}

/// A second CONNECT on a connection is a protocol violation: the connection is closed, a 5.0
/// client gets DISCONNECT 0x82 first. [MQTT-3.1.0-2]
#[tokio::test]
async fn second_connect_is_a_protocol_error() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, "twice").await;
        c.send(Packet::Connect(Box::new(connect_packet(version, "twice"))))
            .await;
        c.expect_violation(ReasonCode::PROTOCOL_ERROR).await;
    }
    broker.shutdown().await;
}

/// 5.0: a zero-length client identifier is given one, returned in the Assigned Client
/// Identifier of CONNACK. [MQTT-3.1.3-6] [MQTT-3.2.2-16]
#[tokio::test]
async fn v5_empty_client_id_is_assigned_one() {
    let (broker, addr) = start().await;
    let (mut a, ack_a) = Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "")).await;
    assert_eq!(ack_a.reason_code, ReasonCode::SUCCESS);
    let id_a = ack_a
        .properties
        .assigned_client_identifier
        .expect("Assigned Client Identifier");
    // mosquitto's shape: "auto-" and 36 characters laid out as a UUID.
    assert_eq!(id_a.len(), 41, "{id_a}");
    assert!(id_a.starts_with("auto-"), "{id_a}");
    let dashes: Vec<usize> = id_a.match_indices('-').map(|(i, _)| i).collect();
    assert_eq!(dashes, [4, 13, 18, 23, 28], "{id_a}");
    let (mut b, ack_b) = Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "")).await;
    let id_b = ack_b
        .properties
        .assigned_client_identifier
        .expect("Assigned Client Identifier");
    assert_ne!(id_a, id_b, "each client gets its own identifier");
    // Both still connected: neither took the other over.
    a.ping().await;
    b.ping().await;
    assert!(broker.sessions().iter().any(|s| s.client_id == id_a));
    broker.shutdown().await;
}

/// The hexadecimal digits of an assigned client identifier (`auto-` and a UUID's layout).
fn assigned_hex(id: &str) -> String {
    let hex: String = id["auto-".len()..].chars().filter(|c| *c != '-').collect();
    assert_eq!(hex.len(), 32, "{id}");
    assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    hex
}

/// Assigned client identifiers cannot be guessed: each holds 128 random bits, so the second
/// client's identifier has nothing to do with the first one's, and a client that takes the
/// first and adds one to its last part does not resume the second client's persistent
/// session nor read the message queued for it (5.0: a zero-length identifier with a Session
/// Expiry Interval keeps its session under the assigned one [MQTT-3.1.3-6] [MQTT-3.2.2-16]).
#[tokio::test]
async fn assigned_client_ids_cannot_be_guessed() {
    let (broker, addr) = start().await;
    // The attacker connects first and learns an identifier.
    let (attacker, ack) =
        Client::connect_with(addr, persistent(ProtocolVersion::V5, "", 300)).await;
    let first = ack
        .properties
        .assigned_client_identifier
        .expect("Assigned Client Identifier");
    attacker.disconnect().await;
    // The victim keeps a persistent session with a subscription, and goes away.
    let (mut victim, ack) =
        Client::connect_with(addr, persistent(ProtocolVersion::V5, "", 300)).await;
    let second = ack
        .properties
        .assigned_client_identifier
        .expect("Assigned Client Identifier");
    victim.subscribe("victim/inbox", QoS::AtLeastOnce).await;
    victim.disconnect().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publisher
        .publish("victim/inbox", b"secret", QoS::AtLeastOnce, false)
        .await;

    // 128 bits of hexadecimal: 32 digits, about 30 of them different between two random
    // identifiers (fewer than 16 has a probability below 1e-15); a counter changes one or two.
    let (a, b) = (assigned_hex(&first), assigned_hex(&second));
    let differing = a.chars().zip(b.chars()).filter(|(x, y)| x != y).count();
    assert!(
        differing >= 16,
        "{first} and {second} differ in {differing} digits"
    );

    // "The first identifier with its counter plus one": the last group, plus one.
    let (head, last) = first.rsplit_once('-').expect("a UUID's layout");
    let next = u64::from_str_radix(last, 16).expect("hex") + 1;
    let guess = format!("{head}-{:012x}", next & 0xffff_ffff_ffff);
    let (mut thief, ack) =
        Client::connect_with(addr, persistent(ProtocolVersion::V5, &guess, 300)).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    assert!(
        !ack.session_present,
        "{guess} resumed the session of {second}"
    );
    thief.expect_nothing(Duration::from_millis(300)).await;

    // The victim still finds its message.
    let (mut victim, ack) =
        Client::connect_with(addr, persistent(ProtocolVersion::V5, &second, 300)).await;
    assert!(ack.session_present);
    assert_eq!(&victim.expect_publish().await.payload[..], b"secret");
    broker.shutdown().await;
}

/// 3.1.1: a zero-length client identifier is allowed with clean session 1 [MQTT-3.1.3-6]
/// [MQTT-3.1.3-7], refused with return code 2 otherwise, then closed [MQTT-3.1.3-8]
/// [MQTT-3.2.2-4]. No Assigned Client Identifier exists in 3.1.1.
#[tokio::test]
async fn v311_empty_client_id_needs_clean_session() {
    let (broker, addr) = start().await;
    let (mut c, ack) = Client::connect_with(addr, connect_packet(ProtocolVersion::V311, "")).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    c.ping().await;

    let mut persistent = connect_packet(ProtocolVersion::V311, "");
    persistent.clean_start = false;
    let (mut c, ack) = Client::connect_with(addr, persistent).await;
    assert_eq!(ack.reason_code, ReasonCode(2), "identifier rejected");
    assert!(!ack.session_present);
    assert!(c.expect_closed().await.is_empty());
    broker.shutdown().await;
}

/// 3.1: the client identifier must be 1 to 23 characters; an empty one is refused with
/// return code 2 (identifier rejected) (MQTT 3.1 section 3.1, "Client Identifier").
#[tokio::test]
async fn v31_empty_client_id_is_rejected() {
    let (broker, addr) = start().await;
    let (mut c, ack) = Client::connect_with(addr, connect_packet(ProtocolVersion::V31, "")).await;
    assert_eq!(ack.reason_code, ReasonCode(2));
    assert!(c.expect_closed().await.is_empty());
    broker.shutdown().await;
}

/// Session Present is 0 with clean start [MQTT-3.2.2-1] (3.1.1) / [MQTT-3.2.2-2] (5.0), and
/// 1 when a stored session is resumed [MQTT-3.2.2-2] (3.1.1) / [MQTT-3.2.2-3] (5.0); 0 when
/// there was nothing to resume. (3.1 has no Session Present flag: its CONNACK byte is 0.)
#[tokio::test]
async fn session_present_flag() {
    let (broker, addr) = start().await;
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let id = format!("sp-{}", version.level());
        let (c, present) = Client::connect_persistent(addr, version, &id).await;
        assert!(!present, "{version:?}: no session stored yet");
        c.disconnect().await;
        let (c, present) = Client::connect_persistent(addr, version, &id).await;
        assert!(present, "{version:?}: the session was stored");
        c.disconnect().await;
        let (c, ack) = Client::connect_with(addr, connect_packet(version, &id)).await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        assert!(!ack.session_present, "{version:?}: clean start");
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// A second connection with the same client identifier closes the first (5.0: DISCONNECT
/// 0x8E, Session taken over) and is served normally. [MQTT-3.1.4-2] (3.1.1) /
/// [MQTT-3.1.4-3] (5.0)
#[tokio::test]
async fn second_connection_takes_the_client_over() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let id = format!("take-{}", version.level());
        let mut first = Client::connect(addr, version, &id).await;
        let mut second = Client::connect(addr, version, &id).await;
        let connected = Instant::now();
        let rc = first.expect_disconnect().await;
        // [MQTT-3.1.4-3]: the existing connection is closed, at once: a 3.1.1 client, which
        // gets no DISCONNECT, used to see its socket close only after half a second.
        let closed_after = connected.elapsed();
        assert!(
            closed_after < Duration::from_millis(400),
            "{version:?}: the taken-over connection closed {closed_after:?} after the new CONNACK"
        );
        if version.is_v5() {
            assert_eq!(rc, Some(ReasonCode::SESSION_TAKEN_OVER));
        } else {
            assert_eq!(rc, None);
        }
        second.subscribe("take/t", QoS::AtLeastOnce).await;
        second
            .publish("take/t", b"works", QoS::AtLeastOnce, false)
            .await;
        let p = second.expect_publish().await;
        assert_eq!(&p.payload[..], b"works");
        second.ack(&p).await;
        second.disconnect().await;
    }
    broker.shutdown().await;
}

/// CONNACK properties say what the server allows: Receive Maximum, Topic Alias Maximum,
/// Maximum Packet Size, Maximum QoS when below 2 [MQTT-3.2.2-9], Retain Available when 0
/// [MQTT-3.2.2-12], Server Keep Alive when it overrides the client's [MQTT-3.2.2-21].
#[tokio::test]
async fn connack_properties_reflect_configuration() {
    let mut config = test_config();
    config.server.receive_maximum = 7;
    config.server.max_packet_size = 4096;
    config.server.max_qos = 1;
    config.server.retain_available = false;
    config.server.max_keepalive = 30;
    let (broker, addr) = start_with(config).await;
    let (mut c, ack) =
        Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "props")).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    let p = &ack.properties;
    assert_eq!(p.receive_maximum, Some(7));
    assert_eq!(p.maximum_packet_size, Some(4096));
    assert_eq!(p.maximum_qos, Some(1));
    assert_eq!(p.retain_available, Some(0));
    assert_eq!(p.server_keep_alive, Some(30), "client asked for 60");
    assert!(p.topic_alias_maximum.is_some_and(|m| m > 0));
    // Maximum QoS 1: a QoS 2 subscription is granted QoS 1 [MQTT-3.2.2-9].
    assert_eq!(
        c.subscribe("p/t", QoS::ExactlyOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    c.disconnect().await;
    broker.shutdown().await;
}

/// With the defaults, CONNACK does not send Maximum QoS, Retain Available nor Server Keep
/// Alive (absent means QoS 2, retain available, the client's keep alive).
/// [MQTT-3.2.2-9] [MQTT-3.2.2-12] [MQTT-3.2.2-21]
#[tokio::test]
async fn connack_properties_default_absent() {
    let (broker, addr) = start().await;
    let (c, ack) =
        Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "defaults")).await;
    let p = &ack.properties;
    assert_eq!(p.maximum_qos, None);
    assert_eq!(p.retain_available, None);
    assert_eq!(p.server_keep_alive, None);
    assert!(
        p.assigned_client_identifier.is_none(),
        "the client chose its identifier"
    );
    c.disconnect().await;
    broker.shutdown().await;
}

/// A client sending nothing for one and a half times its keep alive is disconnected
/// [MQTT-3.1.2-24] (a 5.0 client may get DISCONNECT 0x8D), and its will is published
/// [MQTT-3.1.2-8].
#[tokio::test]
async fn keep_alive_expiry_closes_and_publishes_will() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut watcher = Client::connect(addr, version, "ka-watch").await;
        watcher.subscribe("ka/will", QoS::AtLeastOnce).await;
        let mut connect = connect_packet(version, "ka-client");
        connect.keep_alive = 1;
        connect.will = Some(will("ka/will", "gone", QoS::AtLeastOnce, false));
        let (mut c, ack) = Client::connect_with(addr, connect).await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        let started = Instant::now();
        let rc = c.expect_disconnect().await;
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(900),
            "closed too early: {elapsed:?}"
        );
        assert!(
            elapsed <= Duration::from_millis(3000),
            "closed too late: {elapsed:?}"
        );
        if version.is_v5() {
            assert!(
                rc.is_none() || rc == Some(ReasonCode::KEEP_ALIVE_TIMEOUT),
                "{rc:?}"
            );
        }
        let p = watcher.expect_publish().await;
        assert_eq!(p.topic, "ka/will");
        assert_eq!(&p.payload[..], b"gone");
        watcher.ack(&p).await;
        watcher.disconnect().await;
    }
    broker.shutdown().await;
}

/// Packets within the keep alive keep the connection open: PINGREQ is answered with
/// PINGRESP [MQTT-3.12.4-1] and resets the timer [MQTT-3.1.2-24].
#[tokio::test]
async fn pingreq_keeps_the_connection_alive() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V311, "ka-ping");
    connect.keep_alive = 1;
    let (mut c, _) = Client::connect_with(addr, connect).await;
    let started = Instant::now();
    // Pacing, not synchronisation: a ping every 600 ms for longer than 1.5 s.
    while started.elapsed() < Duration::from_millis(2500) {
        tokio::time::sleep(Duration::from_millis(600)).await;
        c.ping().await;
    }
    c.disconnect().await;
    broker.shutdown().await;
}

/// A network connection that sends no CONNECT within connect_timeout is closed (3.1.1
/// section 3.1.4: "a reasonable amount of time"; docs/configuration.md, connect_timeout).
#[tokio::test]
async fn no_connect_within_connect_timeout_is_closed() {
    let mut config = test_config();
    config.server.connect_timeout = 1;
    let (broker, addr) = start_with(config).await;
    let mut silent = Client::open(addr, ProtocolVersion::V311).await;
    let mut partial = Client::open(addr, ProtocolVersion::V311).await;
    partial.send_raw(&[0x10, 0x10, 0x00, 0x04]).await; // the start of a CONNECT
    assert!(silent.expect_closed().await.is_empty());
    assert!(partial.expect_closed().await.is_empty());
    broker.shutdown().await;
}

/// A 3.1.1 client asking for a keep alive above max_keepalive, or for none (0), is refused
/// (mosquitto 2.0.12+'s behaviour, 3.1.1 cannot be told a Server Keep Alive); without
/// max_keepalive (0, the default) keep alive 0 is accepted.
#[tokio::test]
async fn v311_keep_alive_above_maximum_is_refused() {
    let mut config = test_config();
    config.server.max_keepalive = 30;
    let (broker, addr) = start_with(config).await;
    let (mut c, ack) =
        Client::connect_with(addr, connect_packet(ProtocolVersion::V311, "ka60")).await;
    assert_eq!(ack.reason_code, ReasonCode(2));
    assert!(c.expect_closed().await.is_empty());
    let mut zero = connect_packet(ProtocolVersion::V311, "ka0");
    zero.keep_alive = 0;
    let (mut c, ack) = Client::connect_with(addr, zero.clone()).await;
    assert_eq!(ack.reason_code, ReasonCode(2));
    assert!(c.expect_closed().await.is_empty());
    let mut ka30 = connect_packet(ProtocolVersion::V311, "ka30");
    ka30.keep_alive = 30;
    let (mut c, ack) = Client::connect_with(addr, ka30).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    c.ping().await;
    broker.shutdown().await;

    let (broker, addr) = start_with(test_config()).await;
    let (mut c, ack) = Client::connect_with(addr, zero).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    c.ping().await;
    broker.shutdown().await;
}

/// Properties in a 5.0 CONNECT are accepted (Receive Maximum, Maximum Packet Size, Topic
/// Alias Maximum, User Property) [MQTT-3.1.2-1].
#[tokio::test]
async fn v5_connect_properties_are_accepted() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "cprops");
    connect.properties = Properties {
        receive_maximum: Some(5),
        maximum_packet_size: Some(10_000),
        topic_alias_maximum: Some(3),
        request_problem_information: Some(1),
        user_properties: vec![("k".into(), "v".into())],
        ..Properties::default()
    };
    let (mut c, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    c.ping().await;
    broker.shutdown().await;
}

/// A will the broker cannot honour refuses the connection: will QoS above Maximum QoS gets
/// 0x9B [MQTT-3.2.2-12], will retain without retain support 0x9A [MQTT-3.2.2-13]; a will
/// topic with a wildcard is invalid [MQTT-3.1.3-11] [MQTT-3.3.2-2] (0x90 in 5.0, 3.1.1 has
/// no such code and may just close). An authentication method the broker does not support
/// gets 0x8C (5.0 section 4.12).
#[tokio::test]
async fn connect_refusals() {
    let mut config = test_config();
    config.server.max_qos = 1;
    config.server.retain_available = false;
    let (broker, addr) = start_with(config).await;
    let cases: Vec<(mercurio::codec::Connect, ReasonCode)> = {
        let mut qos = connect_packet(ProtocolVersion::V5, "r1");
        qos.will = Some(will("w/t", "x", QoS::ExactlyOnce, false));
        let mut retain = connect_packet(ProtocolVersion::V5, "r2");
        retain.will = Some(will("w/t", "x", QoS::AtMostOnce, true));
        let mut topic = connect_packet(ProtocolVersion::V5, "r3");
        topic.will = Some(will("w/+", "x", QoS::AtMostOnce, false));
        let mut auth = connect_packet(ProtocolVersion::V5, "r4");
        auth.properties.authentication_method = Some("SCRAM-SHA-1".into());
        vec![
            (qos, ReasonCode::QOS_NOT_SUPPORTED),
            (retain, ReasonCode::RETAIN_NOT_SUPPORTED),
            (topic, ReasonCode::TOPIC_NAME_INVALID),
            (auth, ReasonCode::BAD_AUTHENTICATION_METHOD),
        ]
    };
    for (connect, rc) in cases {
        let mut c = Client::open(addr, ProtocolVersion::V5).await;
        c.send(Packet::Connect(Box::new(connect))).await;
        let seen = c.expect_closed().await;
        match seen.as_slice() {
            [Packet::ConnAck(ack)] => {
                assert_eq!(ack.reason_code, rc);
                assert!(!ack.session_present, "[MQTT-3.2.2-6]");
            }
            [] if rc == ReasonCode::TOPIC_NAME_INVALID => {}
            other => panic!("expected CONNACK {rc:?}, got {other:?}"),
        }
    }
    // 3.1.1: will QoS above the maximum is refused too (return code 2..5 or a close).
    let mut qos = connect_packet(ProtocolVersion::V311, "r5");
    qos.will = Some(will("w/t", "x", QoS::ExactlyOnce, false));
    let mut c = Client::open(addr, ProtocolVersion::V311).await;
    c.send(Packet::Connect(Box::new(qos))).await;
    let seen = c.expect_closed().await;
    assert!(
        seen.iter()
            .all(|p| !matches!(p, Packet::ConnAck(a) if a.reason_code == ReasonCode::SUCCESS)),
        "{seen:?}"
    );
    broker.shutdown().await;
}

/// CONNECT with the reserved connect flag set [MQTT-3.1.2-3], a will QoS without the will
/// flag [MQTT-3.1.2-11] [MQTT-3.1.2-13], or will QoS 3 [MQTT-3.1.2-14] is malformed: closed
/// without CONNACK (5.0 may answer CONNACK 0x81 first).
#[tokio::test]
async fn malformed_connect_flags() {
    let (broker, addr) = start().await;
    for (level, flags) in [(4u8, 0x03u8), (5, 0x03), (4, 0x0A), (5, 0x1E), (4, 0x1E)] {
        let mut bytes = raw_connect(b"MQTT", level);
        bytes[9] = flags;
        let mut c = Client::open(addr, ProtocolVersion::V5).await;
        c.send_raw(&bytes).await;
        let seen = c.expect_closed().await;
        assert!(
            seen.iter().all(
                |p| matches!(p, Packet::ConnAck(a) if a.reason_code == ReasonCode::MALFORMED_PACKET)
            ),
            "level {level} flags {flags:#04x}: {seen:?}"
        );
    }
    broker.shutdown().await;
}

/// "It is a Protocol Error to include Authentication Data if there is no Authentication
/// Method" (5.0 section 3.1.2.11.10): such a CONNECT is closed, at most after CONNACK 0x82
/// [MQTT-4.13.1-1]; the same CONNECT without the data is accepted.
#[tokio::test]
async fn authentication_data_without_method_is_a_protocol_error() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "authdata");
    connect.properties.authentication_data = Some(bytes::Bytes::from_static(b"secret"));
    let mut c = Client::open(addr, ProtocolVersion::V5).await;
    c.send(Packet::Connect(Box::new(connect))).await;
    let seen = c.expect_closed().await;
    assert!(
        seen.iter().all(
            |p| matches!(p, Packet::ConnAck(a) if a.reason_code == ReasonCode::PROTOCOL_ERROR)
        ),
        "{seen:?}"
    );
    let c = Client::connect(addr, ProtocolVersion::V5, "authdata").await;
    c.disconnect().await;
    broker.shutdown().await;
}

/// A 5.0 client asking for no keep alive (or more than max_keepalive) is told the Server
/// Keep Alive, which the broker then enforces [MQTT-3.2.2-21] [MQTT-3.1.2-24]: silent for one
/// and a half times it, the client is disconnected (DISCONNECT 0x8D).
#[tokio::test]
async fn server_keep_alive_is_enforced() {
    let mut config = test_config();
    config.server.max_keepalive = 1;
    let (broker, addr) = start_with(config).await;
    let mut connect = connect_packet(ProtocolVersion::V5, "ska");
    connect.keep_alive = 0;
    let (mut c, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.properties.server_keep_alive, Some(1));
    let started = Instant::now();
    let rc = c.expect_disconnect().await;
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert!(
        rc.is_none() || rc == Some(ReasonCode::KEEP_ALIVE_TIMEOUT),
        "{rc:?}"
    );
    broker.shutdown().await;
}

/// A password without a user name: 3.1.1 forbids it [MQTT-3.1.2-22] (closed without a
/// successful CONNACK); 5.0 allows it (section 3.1.2.9).
#[tokio::test]
async fn password_without_user_name() {
    let (broker, addr) = start().await;
    for level in [4u8, 5] {
        let mut bytes = raw_connect(b"MQTT", level);
        bytes[9] = 0x42; // password flag + clean start, no user name flag
        bytes.extend_from_slice(&[0, 2, b'p', b'w']);
        bytes[1] += 4;
        let version = if level == 5 {
            ProtocolVersion::V5
        } else {
            ProtocolVersion::V311
        };
        let mut c = Client::open(addr, version).await;
        c.send_raw(&bytes).await;
        if level == 5 {
            match c.recv().await {
                Some(Packet::ConnAck(a)) => assert_eq!(a.reason_code, ReasonCode::SUCCESS),
                other => panic!("expected CONNACK, got {other:?}"),
            }
            c.ping().await;
        } else {
            let seen = c.expect_closed().await;
            assert!(
                seen.iter().all(
                    |p| !matches!(p, Packet::ConnAck(a) if a.reason_code == ReasonCode::SUCCESS)
                ),
                "{seen:?}"
            );
        }
    }
    broker.shutdown().await;
}

/// A client that opens with anything but CONNECT is closed as soon as the packet's first byte
/// arrives, without the broker reading (and buffering) the body its remaining length announces
/// [MQTT-3.1.0-1]: here a PUBLISH announcing about 244 MB, of which only a few bytes are sent.
#[tokio::test]
async fn first_packet_not_connect_is_closed_before_its_body() {
    let mut config = test_config();
    config.server.max_packet_size = 268_435_455;
    let (broker, addr) = start_with(config).await;
    for first in [0x20u8, 0x30, 0x82, 0xC0, 0xE0, 0xF0] {
        let mut c = Client::open(addr, ProtocolVersion::V311).await;
        c.send_raw(&[first, 0x80, 0x80, 0x80, 0x74, 0x01, 0x01, 0x01])
            .await;
        let seen = c.expect_closed().await;
        assert!(seen.is_empty(), "{first:02x}: got {seen:?}");
    }
    broker.shutdown().await;
}

/// CONNACK properties come in the order mosquitto writes them (Server Keep Alive, Topic Alias
/// Maximum, Assigned Client Identifier, Retain Available, Maximum Packet Size, Receive
/// Maximum, Maximum QoS), so clients and test suites that compare CONNACK byte for byte
/// against mosquitto's see the same bytes; the order is otherwise free (MQTT 5.0 section
/// 2.2.2.2).
#[tokio::test]
async fn connack_properties_in_mosquitto_order() {
    let mut config = test_config();
    config.server.max_keepalive = 60;
    config.server.retain_available = false;
    config.server.max_packet_size = 30_000;
    config.server.receive_maximum = 20;
    config.server.max_qos = 1;
    let (broker, addr) = start_with(config).await;
    let mut connect = connect_packet(ProtocolVersion::V5, "");
    connect.keep_alive = 0;
    let mut c = Client::open(addr, ProtocolVersion::V5).await;
    c.send(Packet::Connect(Box::new(connect))).await;
    let mut raw = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        use tokio::io::AsyncReadExt;
        let mut b = [0u8; 256];
        while raw.len() < 2 || raw.len() < 2 + raw[1] as usize {
            let n = c.stream_mut().read(&mut b).await.expect("read");
            assert!(n > 0, "closed after {raw:02x?}");
            raw.extend_from_slice(&b[..n]);
        }
    })
    .await
    .expect("CONNACK");
    assert_eq!(&raw[..4], &[0x20, raw[1], 0x00, 0x00], "{raw:02x?}");
    let props = &raw[5..];
    let ids: Vec<u8> = {
        let mut ids = Vec::new();
        let mut i = 0;
        while i < props.len() {
            let id = props[i];
            ids.push(id);
            i += 1 + match id {
                0x13 | 0x22 | 0x21 => 2,
                0x25 | 0x24 => 1,
                0x27 => 4,
                0x12 => 2 + u16::from_be_bytes([props[i + 1], props[i + 2]]) as usize,
                other => panic!("unexpected property {other:#04x} in {raw:02x?}"),
            };
        }
        ids
    };
    assert_eq!(
        ids,
        [0x13, 0x22, 0x12, 0x25, 0x27, 0x21, 0x24],
        "{raw:02x?}"
    );
    assert_eq!(&props[..3], &[0x13, 0x00, 60]);
    assert_eq!(&props[3..6], &[0x22, 0x00, 10]);
    broker.shutdown().await;
}
