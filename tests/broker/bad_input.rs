//! Malformed packets and protocol errors: they close only the offending connection (5.0:
//! DISCONNECT with the reason code the specification names first) and every other client
//! keeps working (MQTT 5.0 sections 4.13 and 2, 3.1.1 section 4.8).
use crate::common;

use std::net::SocketAddr;

use common::*;
use mercurio::codec::{Packet, ProtocolVersion, QoS, ReasonCode};

const MALFORMED: ReasonCode = ReasonCode::MALFORMED_PACKET;
const PROTOCOL: ReasonCode = ReasonCode::PROTOCOL_ERROR;

/// A packet from its first byte and body (body shorter than 128 bytes).
fn frame(first: u8, body: &[u8]) -> Vec<u8> {
    assert!(body.len() < 128);
    let mut out = vec![first, body.len() as u8];
    out.extend_from_slice(body);
    out
}

/// A PUBLISH body: topic bytes as given, packet id when Some, 5.0 empty properties when v5.
fn publish_body(topic: &[u8], packet_id: Option<u16>, v5: bool, payload: &[u8]) -> Vec<u8> {
    let mut b = (topic.len() as u16).to_be_bytes().to_vec();
    b.extend_from_slice(topic);
    if let Some(id) = packet_id {
        b.extend_from_slice(&id.to_be_bytes());
    }
    if v5 {
        b.push(0);
    }
    b.extend_from_slice(payload);
    b
}

/// Two clients that stay connected through the whole test and prove the broker still serves
/// them: a subscriber on `witness/t` and a publisher.
struct Witness {
    sub: Client,
    publisher: Client,
    n: u32,
}

impl Witness {
    async fn new(addr: SocketAddr) -> Witness {
        let mut sub = Client::connect(addr, ProtocolVersion::V5, "witness-sub").await;
        sub.subscribe("witness/t", QoS::AtLeastOnce).await;
        let publisher = Client::connect(addr, ProtocolVersion::V311, "witness-pub").await;
        Witness {
            sub,
            publisher,
            n: 0,
        }
    }

    async fn still_works(&mut self) {
        self.n += 1;
        let payload = self.n.to_string();
        self.publisher
            .publish("witness/t", payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
        let p = self.sub.expect_publish().await;
        assert_eq!(&p.payload[..], payload.as_bytes());
        self.sub.ack(&p).await;
    }
}

/// Connects a fresh client of `version`, sends `bytes`, and checks the broker closes it: a
/// 5.0 client must get DISCONNECT with one of `v5_codes` first, a 3.x client nothing.
async fn expect_refused(
    addr: SocketAddr,
    version: ProtocolVersion,
    bytes: &[u8],
    v5_codes: &[ReasonCode],
) {
    let mut c = Client::connect(addr, version, "offender").await;
    c.send_raw(bytes).await;
    let rc = c.expect_disconnect().await;
    if version.is_v5() {
        assert!(
            rc.is_some_and(|rc| v5_codes.contains(&rc)),
            "{bytes:02x?}: got DISCONNECT {rc:?}, expected one of {v5_codes:?}"
        );
    } else {
        assert_eq!(rc, None, "{bytes:02x?}");
    }
}

/// A Remaining Length of more than four bytes, or not in its shortest form, is malformed
/// [MQTT-1.5.5-1] (5.0 section 1.5.5; 3.1.1 section 2.2.3): closed, 5.0 DISCONNECT 0x81
/// [MQTT-4.13.1-1].
#[tokio::test]
async fn bad_remaining_length() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        for bytes in [
            &[0x30, 0xff, 0xff, 0xff, 0xff, 0x01][..],
            &[0x30, 0x80, 0x00],
            &[0xC0, 0x80, 0x80, 0x00],
        ] {
            expect_refused(addr, version, bytes, &[MALFORMED]).await;
            witness.still_works().await;
        }
    }
    broker.shutdown().await;
}

/// Reserved fixed header flags must have their specified values [MQTT-2.1.3-1] (3.1.1:
/// [MQTT-2.2.2-1] [MQTT-2.2.2-2]): SUBSCRIBE [MQTT-3.8.1-1], UNSUBSCRIBE [MQTT-3.10.1-1],
/// PUBREL [MQTT-3.6.1-1] need 0b0010; PINGREQ and DISCONNECT 0. Reserved packet type 0 is
/// malformed too. 5.0: DISCONNECT 0x81.
#[tokio::test]
async fn reserved_flags_and_packet_types() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let v5 = version.is_v5();
        let opt_props: &[u8] = if v5 { &[0] } else { &[] };
        let mut sub_body = vec![0, 1];
        sub_body.extend_from_slice(opt_props);
        sub_body.extend_from_slice(&[0, 1, b't', 0]);
        let mut unsub_body = vec![0, 1];
        unsub_body.extend_from_slice(opt_props);
        unsub_body.extend_from_slice(&[0, 1, b't']);
        let cases = [
            frame(0x80, &sub_body),   // SUBSCRIBE with flags 0
            frame(0xA0, &unsub_body), // UNSUBSCRIBE with flags 0
            frame(0x60, &[0, 1]),     // PUBREL with flags 0
            // PINGREQ with flags 1 (3.1 ignores DUP and RETAIN in every fixed header, so
            // only the QoS bits count there).
            frame(
                if version == ProtocolVersion::V31 {
                    0xC2
                } else {
                    0xC1
                },
                &[],
            ),
            frame(0xE2, &[]), // DISCONNECT with flags 2
            frame(0x00, &[]), // reserved packet type 0
        ];
        for bytes in &cases {
            expect_refused(addr, version, bytes, &[MALFORMED]).await;
            witness.still_works().await;
        }
        if !v5 {
            // AUTH (type 15) does not exist before 5.0.
            expect_refused(addr, version, &frame(0xF0, &[]), &[]).await;
            witness.still_works().await;
        }
    }
    broker.shutdown().await;
}

/// Ill-formed UTF-8 [MQTT-1.5.3-1] (5.0: [MQTT-1.5.4-1]) or U+0000 [MQTT-1.5.3-2] (5.0:
/// [MQTT-1.5.4-2]) in a topic name is a malformed packet: closed, 5.0 DISCONNECT 0x81.
#[tokio::test]
async fn invalid_utf8_topic() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let v5 = version.is_v5();
        for topic in [
            &[0xC3, 0x28][..],
            &[b'a', 0x00, b'b'],
            &[0xED, 0xA0, 0x80],
            &[0xFF],
        ] {
            let bytes = frame(0x30, &publish_body(topic, None, v5, b"x"));
            expect_refused(addr, version, &bytes, &[MALFORMED]).await;
            witness.still_works().await;
        }
        // In a SUBSCRIBE topic filter too.
        let mut body = vec![0, 1];
        if v5 {
            body.push(0);
        }
        body.extend_from_slice(&[0, 2, 0xC3, 0x28, 0]);
        expect_refused(addr, version, &frame(0x82, &body), &[MALFORMED]).await;
        witness.still_works().await;
    }
    broker.shutdown().await;
}

/// A raw CONNECT of `version` with `client_id` as given (3.1: `MQIsdp`, level 3), clean
/// session, keep alive 60.
fn connect_bytes(version: ProtocolVersion, client_id: &[u8]) -> Vec<u8> {
    let (name, level): (&[u8], u8) = match version {
        ProtocolVersion::V31 => (b"MQIsdp", 3),
        ProtocolVersion::V311 => (b"MQTT", 4),
        ProtocolVersion::V5 => (b"MQTT", 5),
    };
    let mut body = (name.len() as u16).to_be_bytes().to_vec();
    body.extend_from_slice(name);
    body.extend_from_slice(&[level, 0x02, 0, 60]);
    if version.is_v5() {
        body.push(0);
    }
    body.extend_from_slice(&(client_id.len() as u16).to_be_bytes());
    body.extend_from_slice(client_id);
    frame(0x10, &body)
}

/// A control character (U+0001 to U+001F, U+007F to U+009F) or a non-character (U+FDD0 to
/// U+FDEF, U+nFFFE, U+nFFFF) in a string is malformed, as mosquitto treats it: the data
/// SHOULD NOT hold them and a receiver MAY treat such a packet as malformed (5.0 section
/// 1.5.4, 3.1.1 section 1.5.3). In a topic name, a topic filter or a user property: closed,
/// 5.0 DISCONNECT 0x81; in a client identifier: closed without CONNACK. Other characters
/// beyond ASCII still pass.
#[tokio::test]
async fn control_characters_and_non_characters_in_strings() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let v5 = version.is_v5();
        for topic in [
            "a\tb",
            "a/\u{7f}",
            "\u{85}",
            "a/\u{fdd0}",
            "\u{ffff}",
            "a\u{1fffe}",
        ] {
            let bytes = frame(0x30, &publish_body(topic.as_bytes(), None, v5, b"x"));
            expect_refused(addr, version, &bytes, &[MALFORMED]).await;
            witness.still_works().await;
        }
        // A SUBSCRIBE topic filter with ESC.
        let mut body = vec![0, 1];
        if v5 {
            body.push(0);
        }
        body.extend_from_slice(&[0, 3, b'a', 0x1B, b'#', 0]);
        expect_refused(addr, version, &frame(0x82, &body), &[MALFORMED]).await;
        witness.still_works().await;
        // A client identifier.
        let mut c = Client::open(addr, version).await;
        c.send_raw(&connect_bytes(version, b"a\x01b")).await;
        assert!(c.expect_closed().await.is_empty(), "{version:?}");
        witness.still_works().await;
    }
    // A 5.0 user property whose value is BEL.
    let bell = frame(0x30, &[0, 1, b't', 7, 0x26, 0, 1, b'k', 0, 1, 0x07, b'x']);
    expect_refused(addr, ProtocolVersion::V5, &bell, &[MALFORMED]).await;
    witness.still_works().await;

    let mut sub = Client::connect(addr, ProtocolVersion::V311, "utf8-sub").await;
    sub.subscribe("caf\u{e9}/#", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "utf8-pub").await;
    let topic = "caf\u{e9}/\u{a0}\u{fdcf}\u{fffd}\u{10fffd}";
    publisher.publish(topic, b"x", QoS::AtMostOnce, false).await;
    assert_eq!(sub.expect_publish().await.topic, topic);
    broker.shutdown().await;
}

/// A PUBLISH with both QoS bits set is malformed [MQTT-3.3.1-4]; so is DUP 1 with QoS 0
/// [MQTT-3.3.1-2]; a QoS 1 PUBLISH with packet identifier 0 breaks [MQTT-2.2.1-3] (3.1.1:
/// [MQTT-2.3.1-1]). Closed, 5.0 DISCONNECT 0x81 (or 0x82 for the identifier).
#[tokio::test]
async fn bad_publish_header() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let v5 = version.is_v5();
        let qos3 = frame(0x36, &publish_body(b"t", Some(1), v5, b"x"));
        expect_refused(addr, version, &qos3, &[MALFORMED]).await;
        witness.still_works().await;
        let dup0 = frame(0x38, &publish_body(b"t", None, v5, b"x"));
        expect_refused(addr, version, &dup0, &[MALFORMED]).await;
        witness.still_works().await;
        let id0 = frame(0x32, &publish_body(b"t", Some(0), v5, b"x"));
        expect_refused(addr, version, &id0, &[MALFORMED, PROTOCOL]).await;
        witness.still_works().await;
        // A topic length running past the end of the packet.
        let short = frame(0x30, &[0, 50, b'a', b'b']);
        expect_refused(addr, version, &short, &[MALFORMED]).await;
        witness.still_works().await;
    }
    broker.shutdown().await;
}

/// SUBSCRIBE without any filter [MQTT-3.8.3-3] (3.1.1) / [MQTT-3.8.3-2] (5.0), UNSUBSCRIBE
/// without any filter [MQTT-3.10.3-2], and subscription options with reserved bits set
/// [MQTT-3.8.3-5] or Retain Handling 3 (5.0 section 3.8.3.1) close the connection. So does a
/// SUBSCRIBE or UNSUBSCRIBE with packet identifier 0 [MQTT-2.2.1-3]: 5.0 DISCONNECT 0x81
/// Malformed Packet, mosquitto's code for it.
#[tokio::test]
async fn bad_subscribe_and_unsubscribe() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let v5 = version.is_v5();
        let head: &[u8] = if v5 { &[0, 1, 0] } else { &[0, 1] };
        expect_refused(addr, version, &frame(0x82, head), &[MALFORMED, PROTOCOL]).await;
        witness.still_works().await;
        expect_refused(addr, version, &frame(0xA2, head), &[MALFORMED, PROTOCOL]).await;
        witness.still_works().await;
        let id0: &[u8] = if v5 {
            &[0, 0, 0, 0, 1, b't']
        } else {
            &[0, 0, 0, 1, b't']
        };
        let mut sub0 = id0.to_vec();
        sub0.push(0);
        expect_refused(addr, version, &frame(0x82, &sub0), &[MALFORMED]).await;
        witness.still_works().await;
        expect_refused(addr, version, &frame(0xA2, id0), &[MALFORMED]).await;
        witness.still_works().await;
        let mut reserved = head.to_vec();
        reserved.extend_from_slice(&[0, 1, b't', 0xC0]);
        expect_refused(addr, version, &frame(0x82, &reserved), &[MALFORMED]).await;
        witness.still_works().await;
        if v5 {
            let mut rh3 = head.to_vec();
            rh3.extend_from_slice(&[0, 1, b't', 0x30]);
            expect_refused(addr, version, &frame(0x82, &rh3), &[MALFORMED, PROTOCOL]).await;
            witness.still_works().await;
        }
        // QoS 3 in 3.x subscription options is malformed [MQTT-3-8.3-4].
        let mut q3 = head.to_vec();
        q3.extend_from_slice(&[0, 1, b't', 0x03]);
        expect_refused(addr, version, &frame(0x82, &q3), &[MALFORMED]).await;
        witness.still_works().await;
    }
    broker.shutdown().await;
}

/// An UNSUBSCRIBE filter no SUBSCRIBE could have made (empty [MQTT-4.7.3-1], `#` not last
/// [MQTT-4.7.1-2], `+` sharing a level [MQTT-4.7.1-3]) closes the connection as malformed,
/// as mosquitto does; a valid one that matches nothing is still answered.
#[tokio::test]
async fn unsubscribe_with_an_invalid_filter() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let head: &[u8] = if version.is_v5() { &[0, 1, 0] } else { &[0, 1] };
        for bad in [&b""[..], b"#/a", b"a/b+"] {
            let mut body = head.to_vec();
            body.extend_from_slice(&(bad.len() as u16).to_be_bytes());
            body.extend_from_slice(bad);
            expect_refused(addr, version, &frame(0xA2, &body), &[MALFORMED]).await;
            witness.still_works().await;
        }
        let mut c = Client::connect(addr, version, "unsub-ok").await;
        c.unsubscribe(&["never/subscribed/#", "$share/g/x"]).await;
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// A client's PUBLISH carrying a Subscription Identifier is a Protocol Error
/// [MQTT-3.3.4-6]: DISCONNECT 0x82, nothing acknowledged or delivered.
#[tokio::test]
async fn client_publish_with_a_subscription_identifier() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "subid-sub").await;
    sub.subscribe("subid/t", QoS::AtLeastOnce).await;
    // QoS 1, packet id 1, properties: Subscription Identifier 7.
    let body = [
        0, 7, b's', b'u', b'b', b'i', b'd', b'/', b't', 0, 1, 2, 0x0B, 7, b'x',
    ];
    let mut c = Client::connect(addr, ProtocolVersion::V5, "offender").await;
    c.send_raw(&frame(0x32, &body)).await;
    let rc = c.expect_disconnect().await;
    assert_eq!(
        rc,
        Some(PROTOCOL),
        "expected DISCONNECT 0x82 [MQTT-3.3.4-6]"
    );
    witness.still_works().await;
    sub.expect_nothing(std::time::Duration::from_millis(300))
        .await;
    broker.shutdown().await;
}

/// Packets only a server sends (CONNACK, SUBACK, UNSUBACK, PINGRESP) coming from a client are
/// a protocol error (5.0 section 4.13: DISCONNECT 0x82, or 0x81 where the packet cannot be
/// read as a client's).
#[tokio::test]
async fn server_only_packets_from_a_client() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let v5 = version.is_v5();
        let connack = if v5 {
            frame(0x20, &[0, 0, 0])
        } else {
            frame(0x20, &[0, 0])
        };
        let suback = if v5 {
            frame(0x90, &[0, 1, 0, 0])
        } else {
            frame(0x90, &[0, 1, 0])
        };
        for bytes in [connack, suback, frame(0xD0, &[])] {
            expect_refused(addr, version, &bytes, &[PROTOCOL, MALFORMED]).await;
            witness.still_works().await;
        }
    }
    broker.shutdown().await;
}

/// 5.0 property errors: a property given twice (section 2.2.2.2: Protocol Error), an unknown topic
/// alias (section 3.3.2.3.4: Protocol Error), AUTH without an authentication method
/// (section 4.12: Protocol Error).
#[tokio::test]
async fn v5_property_errors() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    let v5 = ProtocolVersion::V5;
    // PUBLISH with Payload Format Indicator twice.
    let twice = frame(0x30, &[0, 1, b't', 4, 0x01, 0, 0x01, 0, b'x']);
    expect_refused(addr, v5, &twice, &[PROTOCOL, MALFORMED]).await;
    witness.still_works().await;
    // PUBLISH with an empty topic and an alias never set.
    let alias = frame(0x30, &[0, 0, 3, 0x23, 0, 1, b'x']);
    expect_refused(addr, v5, &alias, &[PROTOCOL]).await;
    witness.still_works().await;
    // AUTH.
    let auth = frame(0xF0, &[0x18, 0]);
    expect_refused(addr, v5, &auth, &[PROTOCOL]).await;
    witness.still_works().await;
    // Property length running past the packet.
    let long = frame(0x30, &[0, 1, b't', 20, 0x01, 0]);
    expect_refused(addr, v5, &long, &[MALFORMED]).await;
    witness.still_works().await;
    broker.shutdown().await;
}

/// A packet larger than max_packet_size closes the connection, 5.0 with DISCONNECT 0x95
/// (Packet too large) (5.0 section 3.2.2.3.6) [MQTT-3.2.2-15]; the size is judged from the
/// fixed header, before the body arrives (docs/operations.md, "Protecting the broker").
#[tokio::test]
async fn packet_over_max_packet_size() {
    let mut config = test_config();
    config.server.max_packet_size = 128;
    let (broker, addr) = start_with(config).await;
    let mut witness = Witness::new(addr).await;
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, "big").await;
        c.publish("big/t", &[b'x'; 64], QoS::AtLeastOnce, false)
            .await;
        c.send(publish_packet(
            "big/t",
            &[b'x'; 200],
            QoS::AtMostOnce,
            false,
            0,
            Default::default(),
        ))
        .await;
        c.expect_violation(ReasonCode::PACKET_TOO_LARGE).await;
        witness.still_works().await;
        // Only the fixed header of a huge packet: refused without waiting for the body.
        let mut c = Client::connect(addr, version, "big").await;
        c.send_raw(&[0x30, 0xff, 0xff, 0xff, 0x7f]).await;
        c.expect_violation(ReasonCode::PACKET_TOO_LARGE).await;
        witness.still_works().await;
    }
    broker.shutdown().await;
}

/// More unacknowledged inbound QoS 2 PUBLISH packets than the broker's Receive Maximum:
/// DISCONNECT 0x93 (Receive Maximum exceeded) (5.0 section 3.3.4) [MQTT-3.3.4-7]
/// [MQTT-3.3.4-8]. QoS 1 messages answered at once do not count.
#[tokio::test]
async fn receive_maximum_exceeded() {
    let mut config = test_config();
    config.server.receive_maximum = 2;
    let (broker, addr) = start_with(config).await;
    let mut witness = Witness::new(addr).await;
    let (mut c, ack) = Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "rm")).await;
    assert_eq!(ack.properties.receive_maximum, Some(2));
    for _ in 0..5 {
        c.publish("rm/t", b"q1", QoS::AtLeastOnce, false).await;
    }
    for id in 1..=3u16 {
        c.send(publish_packet(
            "rm/t",
            b"q2",
            QoS::ExactlyOnce,
            false,
            id,
            Default::default(),
        ))
        .await;
    }
    let mut seen = c.expect_closed().await;
    let last = seen.pop();
    assert!(
        matches!(last, Some(Packet::Disconnect(ref d)) if d.reason_code == ReasonCode::RECEIVE_MAXIMUM_EXCEEDED),
        "{last:?}"
    );
    assert!(
        seen.iter().all(|p| matches!(p, Packet::PubRec(_))),
        "{seen:?}"
    );
    witness.still_works().await;
    broker.shutdown().await;
}

/// Garbage that is not MQTT at all as first bytes: closed without CONNACK, broker fine.
/// [MQTT-3.1.0-1] [MQTT-4.8.0-1]
#[tokio::test]
async fn garbage_instead_of_connect() {
    let (broker, addr) = start().await;
    let mut witness = Witness::new(addr).await;
    for bytes in [
        &b"GET / HTTP/1.1\r\nHost: example.com\r\nUser-Agent: test/1.0\r\nAccept: */*\r\n\r\n"[..],
        &[0x10, 0x00],
        &[0x10, 0x03, 0x00, 0x04, b'M'],
        &[0xff; 32],
    ] {
        let mut c = Client::open(addr, ProtocolVersion::V311).await;
        c.send_raw(bytes).await;
        assert!(c.expect_closed().await.is_empty(), "{bytes:02x?}");
        witness.still_works().await;
    }
    broker.shutdown().await;
}
