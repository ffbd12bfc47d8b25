//! Sessions: state kept while a persistent client is away, resending in-flight messages,
//! exactly-once inbound, session expiry, clean start (MQTT 3.1.1 sections 3.1.2.4, 4.1, 4.4;
//! MQTT 5.0 sections 3.1.2.4, 3.1.2.11.2, 4.1, 4.4).
use crate::common;

use std::time::Duration;

use common::*;
use mercurio::codec::{Disconnect, Packet, Properties, ProtocolVersion, PubAck, QoS, ReasonCode};

const SHORT: Duration = Duration::from_millis(300);

/// Waits (polling, with a deadline) until the broker no longer holds a session for `id`.
async fn wait_session_gone(broker: &mercurio::BrokerHandle, id: &str) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while broker.sessions().iter().any(|s| s.client_id == id) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "session {id} still there"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (polling, with a deadline) until the session `id` is marked disconnected.
async fn wait_disconnected(broker: &mercurio::BrokerHandle, id: &str) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !broker
        .sessions()
        .iter()
        .any(|s| s.client_id == id && !s.connected)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} still connected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A persistent session keeps its subscriptions and the QoS 1 and 2 messages that arrive
/// while the client is away, delivered when it reconnects [MQTT-3.1.2-4] [MQTT-3.1.2-5]
/// (3.1.1) / [MQTT-3.1.2-23] (5.0) [MQTT-4.1.0-1]. QoS 0 messages may be dropped.
#[tokio::test]
async fn persistent_session_keeps_subscriptions_and_messages() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let id = format!("away-{}", version.level());
        let (mut c, _) = Client::connect_persistent(addr, version, &id).await;
        c.subscribe("away/#", QoS::ExactlyOnce).await;
        c.disconnect().await;
        wait_disconnected(&broker, &id).await;

        let mut publisher = Client::connect(addr, version, "away-pub").await;
        publisher
            .publish("away/1", b"one", QoS::AtLeastOnce, false)
            .await;
        publisher
            .publish("away/2", b"two", QoS::ExactlyOnce, false)
            .await;
        publisher.disconnect().await;

        let (mut c, present) = Client::connect_persistent(addr, version, &id).await;
        if version != ProtocolVersion::V31 {
            assert!(present);
        }
        let p = c.expect_publish().await;
        assert_eq!((p.topic.as_str(), p.qos), ("away/1", QoS::AtLeastOnce));
        c.ack(&p).await;
        let p = c.expect_publish().await;
        assert_eq!((p.topic.as_str(), p.qos), ("away/2", QoS::ExactlyOnce));
        c.ack(&p).await;
        // The subscription is still active.
        c.publish("away/3", b"three", QoS::AtLeastOnce, false).await;
        let p = c.expect_publish().await;
        assert_eq!(p.topic, "away/3");
        c.ack(&p).await;
        c.expect_nothing(SHORT).await;
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// Unacknowledged QoS 1 and QoS 2 PUBLISH packets are resent with DUP 1 and the same packet
/// identifier when the session resumes [MQTT-4.4.0-1] [MQTT-3.3.1-1]; a QoS 2 message whose
/// PUBREC was sent is resumed with PUBREL [MQTT-4.4.0-1].
#[tokio::test]
async fn inflight_messages_are_resent_with_dup_on_reconnect() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let id = format!("dup-{}", version.level());
        let (mut c, _) = Client::connect_persistent(addr, version, &id).await;
        c.subscribe("dup/#", QoS::ExactlyOnce).await;
        let mut publisher = Client::connect(addr, version, "dup-pub").await;
        publisher
            .publish("dup/1", b"1", QoS::AtLeastOnce, false)
            .await;
        publisher
            .publish("dup/2", b"2", QoS::ExactlyOnce, false)
            .await;
        publisher
            .publish("dup/3", b"3", QoS::ExactlyOnce, false)
            .await;
        let p1 = c.expect_publish().await;
        let p2 = c.expect_publish().await;
        let p3 = c.expect_publish().await;
        assert!(!p1.dup && !p2.dup && !p3.dup);
        // PUBREC for the third only, then drop the connection.
        c.send(Packet::PubRec(PubAck {
            packet_id: p3.packet_id,
            ..Default::default()
        }))
        .await;
        match c.expect_packet().await {
            Packet::PubRel(r) => assert_eq!(r.packet_id, p3.packet_id),
            other => panic!("expected PUBREL, got {other:?}"),
        }
        c.drop_connection().await;
        wait_disconnected(&broker, &id).await;

        let (mut c, _) = Client::connect_persistent(addr, version, &id).await;
        let r1 = c.expect_publish().await;
        assert_eq!(
            (r1.packet_id, r1.dup, &r1.payload[..]),
            (p1.packet_id, true, &b"1"[..])
        );
        let r2 = c.expect_publish().await;
        assert_eq!(
            (r2.packet_id, r2.dup, &r2.payload[..]),
            (p2.packet_id, true, &b"2"[..])
        );
        assert_eq!(r2.qos, QoS::ExactlyOnce);
        match c.expect_packet().await {
            Packet::PubRel(r) => assert_eq!(r.packet_id, p3.packet_id),
            other => panic!("expected the PUBREL of {}, got {other:?}", p3.packet_id),
        }
        c.ack(&r1).await;
        c.ack(&r2).await;
        c.send(Packet::PubComp(PubAck {
            packet_id: p3.packet_id,
            ..Default::default()
        }))
        .await;
        c.ping().await;
        c.expect_nothing(SHORT).await;
        // Nothing left in flight.
        let info = broker
            .sessions()
            .into_iter()
            .find(|s| s.client_id == id)
            .expect("session");
        assert_eq!((info.inflight, info.queued), (0, 0));
        c.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// A QoS 2 PUBLISH resent with the same packet identifier before PUBREL is acknowledged with
/// PUBREC again but not delivered twice [MQTT-4.3.3-9] (5.0) / [MQTT-4.3.3-2] (3.1.1); this
/// holds across a reconnect of a persistent session. After PUBREL the identifier is free
/// for a new message [MQTT-4.3.3-11] (5.0).
#[tokio::test]
async fn qos2_inbound_duplicate_is_not_delivered_twice() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut sub = Client::connect(addr, version, "q2-sub").await;
        sub.subscribe("q2/t", QoS::ExactlyOnce).await;
        let id = format!("q2-pub-{}", version.level());
        let (mut p, _) = Client::connect_persistent(addr, version, &id).await;
        let publish = |dup: bool, payload: &'static [u8]| {
            let mut pk = publish_packet(
                "q2/t",
                payload,
                QoS::ExactlyOnce,
                false,
                42,
                Properties::default(),
            );
            if let Packet::Publish(x) = &mut pk {
                x.dup = dup;
            }
            pk
        };
        let expect_pubrec = |pk: Packet| match pk {
            Packet::PubRec(a) => {
                assert_eq!((a.packet_id, a.reason_code), (42, ReasonCode::SUCCESS))
            }
            other => panic!("expected PUBREC, got {other:?}"),
        };
        p.send(publish(false, b"first")).await;
        expect_pubrec(p.expect_packet().await);
        p.send(publish(true, b"first")).await;
        expect_pubrec(p.expect_packet().await);
        // Across a reconnect.
        p.drop_connection().await;
        wait_disconnected(&broker, &id).await;
        let (mut p, _) = Client::connect_persistent(addr, version, &id).await;
        p.send(publish(true, b"first")).await;
        expect_pubrec(p.expect_packet().await);
        p.send(Packet::PubRel(PubAck {
            packet_id: 42,
            ..Default::default()
        }))
        .await;
        match p.expect_packet().await {
            Packet::PubComp(a) => assert_eq!(a.packet_id, 42),
            other => panic!("expected PUBCOMP, got {other:?}"),
        }
        let m = sub.expect_publish().await;
        assert_eq!(&m.payload[..], b"first");
        sub.ack(&m).await;
        // The identifier is free again: a new message with it is a new message.
        p.send(publish(false, b"second")).await;
        expect_pubrec(p.expect_packet().await);
        p.send(Packet::PubRel(PubAck {
            packet_id: 42,
            ..Default::default()
        }))
        .await;
        assert!(matches!(p.expect_packet().await, Packet::PubComp(_)));
        let m = sub.expect_publish().await;
        assert_eq!(&m.payload[..], b"second");
        sub.ack(&m).await;
        sub.expect_nothing(SHORT).await;
        sub.disconnect().await;
        p.disconnect().await;
    }
    broker.shutdown().await;
}

/// After the Session Expiry Interval the session is gone: a reconnect gets Session Present 0
/// and no old subscription [MQTT-3.1.2-23] (5.0 section 3.1.2.11.2); for 3.x the same holds
/// with persistent_client_expiration.
#[tokio::test]
async fn session_expires_after_the_interval() {
    let mut config = test_config();
    config.server.persistent_client_expiration = 1;
    let (broker, addr) = start_with(config).await;
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let id = format!("exp-{}", version.level());
        let mut connect = connect_packet(version, &id);
        connect.clean_start = false;
        if version.is_v5() {
            connect.properties.session_expiry_interval = Some(1);
        }
        let (mut c, _) = Client::connect_with(addr, connect.clone()).await;
        c.subscribe("exp/t", QoS::AtLeastOnce).await;
        c.disconnect().await;
        wait_session_gone(&broker, &id).await;
        let (mut c, ack) = Client::connect_with(addr, connect).await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        assert!(!ack.session_present, "{version:?}");
        c.publish("exp/t", b"x", QoS::AtLeastOnce, false).await;
        c.subscribe("exp/other", QoS::AtLeastOnce).await;
        c.publish("exp/other", b"y", QoS::AtLeastOnce, false).await;
        let p = c.expect_publish().await;
        assert_eq!(
            p.topic, "exp/other",
            "the old subscription ended with the session"
        );
        c.ack(&p).await;
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// DISCONNECT may change the Session Expiry Interval (5.0 section 3.14.2.2.2): set to 0 the
/// session ends at the close; set when CONNECT said 0 it is a Protocol Error, DISCONNECT 0x82
/// [MQTT-3.14.2-2].
#[tokio::test]
async fn disconnect_changes_session_expiry_but_not_from_zero() {
    let (broker, addr) = start().await;
    // 3600 -> 0: the session ends.
    let (mut c, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "dse").await;
    c.subscribe("dse/t", QoS::AtLeastOnce).await;
    c.send(Packet::Disconnect(Disconnect {
        reason_code: ReasonCode::NORMAL_DISCONNECTION,
        properties: Properties {
            session_expiry_interval: Some(0),
            ..Properties::default()
        },
    }))
    .await;
    assert!(c.expect_closed().await.is_empty());
    wait_session_gone(&broker, "dse").await;
    let (c, present) = Client::connect_persistent(addr, ProtocolVersion::V5, "dse").await;
    assert!(!present);
    c.disconnect().await;

    // 0 -> 60: protocol error.
    let mut c = Client::connect(addr, ProtocolVersion::V5, "dse0").await;
    c.send(Packet::Disconnect(Disconnect {
        reason_code: ReasonCode::NORMAL_DISCONNECTION,
        properties: Properties {
            session_expiry_interval: Some(60),
            ..Properties::default()
        },
    }))
    .await;
    c.expect_violation(ReasonCode::PROTOCOL_ERROR).await;
    wait_session_gone(&broker, "dse0").await;

    // 1 -> 3600: the session outlives the original interval... checked by it still being
    // there after a reconnect with session expiry kept.
    let mut connect = connect_packet(ProtocolVersion::V5, "dse1");
    connect.clean_start = false;
    connect.properties.session_expiry_interval = Some(1);
    let (mut c, _) = Client::connect_with(addr, connect).await;
    c.send(Packet::Disconnect(Disconnect {
        reason_code: ReasonCode::NORMAL_DISCONNECTION,
        properties: Properties {
            session_expiry_interval: Some(3600),
            ..Properties::default()
        },
    }))
    .await;
    assert!(c.expect_closed().await.is_empty());
    // A control session with interval 1 expires; dse1 must not.
    let mut connect = connect_packet(ProtocolVersion::V5, "dse-control");
    connect.clean_start = false;
    connect.properties.session_expiry_interval = Some(1);
    let (c, _) = Client::connect_with(addr, connect).await;
    c.disconnect().await;
    wait_session_gone(&broker, "dse-control").await;
    assert!(broker.sessions().iter().any(|s| s.client_id == "dse1"));
    broker.shutdown().await;
}

/// Clean start discards the stored session [MQTT-3.1.2-4] (5.0) / [MQTT-3.1.2-6] (3.1.1):
/// Session Present 0, old subscriptions and queued messages gone.
#[tokio::test]
async fn clean_start_discards_the_old_session() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let id = format!("clean-{}", version.level());
        let (mut c, _) = Client::connect_persistent(addr, version, &id).await;
        c.subscribe("clean/old", QoS::AtLeastOnce).await;
        c.disconnect().await;
        wait_disconnected(&broker, &id).await;
        let mut publisher = Client::connect(addr, version, "clean-pub").await;
        publisher
            .publish("clean/old", b"queued", QoS::AtLeastOnce, false)
            .await;

        let (mut c, ack) = Client::connect_with(addr, connect_packet(version, &id)).await;
        assert!(!ack.session_present);
        c.subscribe("clean/new", QoS::AtLeastOnce).await;
        publisher
            .publish("clean/old", b"live", QoS::AtLeastOnce, false)
            .await;
        publisher
            .publish("clean/new", b"new", QoS::AtLeastOnce, false)
            .await;
        let p = c.expect_publish().await;
        assert_eq!(
            &p.payload[..],
            b"new",
            "no queued message, no old subscription"
        );
        c.ack(&p).await;
        c.expect_nothing(SHORT).await;
        c.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// With clean session 1 (3.1.1) or session expiry 0 (5.0) the session ends with the
/// connection: reconnecting without clean start finds none [MQTT-3.1.2-6] (3.1.1)
/// [MQTT-3.1.2-22]... (5.0 section 3.1.2.11.2, absent interval = 0).
#[tokio::test]
async fn non_persistent_session_ends_with_the_connection() {
    let (broker, addr) = start().await;
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let id = format!("np-{}", version.level());
        let mut c = Client::connect(addr, version, &id).await;
        c.subscribe("np/t", QoS::AtLeastOnce).await;
        c.disconnect().await;
        wait_session_gone(&broker, &id).await;
        let mut connect = connect_packet(version, &id);
        connect.clean_start = false;
        let (c, ack) = Client::connect_with(addr, connect).await;
        assert!(!ack.session_present);
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// Session state survives a takeover: the new connection (clean start 0) resumes the
/// session of the connection it replaced [MQTT-3.1.4-3] [MQTT-3.2.2-3].
#[tokio::test]
async fn takeover_resumes_the_session() {
    let (broker, addr) = start().await;
    let (mut first, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "tk").await;
    first.subscribe("tk/t", QoS::AtLeastOnce).await;
    let (mut second, present) = Client::connect_persistent(addr, ProtocolVersion::V5, "tk").await;
    assert!(present);
    assert_eq!(
        first.expect_disconnect().await,
        Some(ReasonCode::SESSION_TAKEN_OVER)
    );
    second.publish("tk/t", b"x", QoS::AtLeastOnce, false).await;
    let p = second.expect_publish().await;
    assert_eq!(&p.payload[..], b"x");
    broker.shutdown().await;
}

/// 5.0 Clean Start 1 with a Session Expiry Interval above 0: the new session outlives the
/// connection [MQTT-3.1.2-23], and the next Clean Start 0 connection resumes it.
#[tokio::test]
async fn clean_start_with_expiry_keeps_the_new_session() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "cs1");
    connect.properties.session_expiry_interval = Some(60);
    let (mut c, ack) = Client::connect_with(addr, connect).await;
    assert!(!ack.session_present);
    c.subscribe("cs1/t", QoS::AtLeastOnce).await;
    c.disconnect().await;
    wait_disconnected(&broker, "cs1").await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "cs1-pub").await;
    publisher
        .publish("cs1/t", b"kept", QoS::AtLeastOnce, false)
        .await;
    let (mut c, present) = Client::connect_persistent(addr, ProtocolVersion::V5, "cs1").await;
    assert!(present);
    assert_eq!(&c.expect_publish().await.payload[..], b"kept");
    broker.shutdown().await;
}

/// Messages resent when a session resumes count against the new connection's window: a
/// client that reconnects with a smaller Receive Maximum gets at most that many
/// unacknowledged QoS 1 PUBLISH packets, "The Server MUST NOT send more than Receive Maximum
/// QoS 1 and QoS 2 PUBLISH packets for which it has not received PUBACK, PUBCOMP, or PUBREC
/// with a Reason Code of 128 or greater from the Client" [MQTT-3.3.4-9] [MQTT-4.9.0-2]; each
/// acknowledgement lets the next one be resent, in order, with DUP 1 [MQTT-4.4.0-1].
#[tokio::test]
async fn resent_messages_respect_the_new_receive_maximum() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "rm-resume");
    connect.clean_start = false;
    connect.properties.session_expiry_interval = Some(60);
    connect.properties.receive_maximum = Some(10);
    let (mut c, _) = Client::connect_with(addr, connect.clone()).await;
    c.subscribe("rm/t", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rm-pub").await;
    for i in 0..4u8 {
        publisher
            .publish("rm/t", &[i], QoS::AtLeastOnce, false)
            .await;
    }
    let mut first = vec![];
    for _ in 0..4 {
        first.push(c.expect_publish().await);
    }
    c.drop_connection().await;
    wait_disconnected(&broker, "rm-resume").await;

    connect.properties.receive_maximum = Some(2);
    let (mut c, ack) = Client::connect_with(addr, connect).await;
    assert!(ack.session_present);
    let mut held = vec![c.expect_publish().await, c.expect_publish().await];
    c.expect_nothing(SHORT).await;
    for (i, next) in (2..4u8).enumerate() {
        let done = held.remove(0);
        assert_eq!(
            (done.packet_id, done.dup, &done.payload[..]),
            (first[i].packet_id, true, &[i as u8][..])
        );
        c.ack(&done).await;
        let m = c.expect_publish().await;
        assert_eq!((m.dup, &m.payload[..]), (true, &[next][..]));
        c.expect_nothing(Duration::from_millis(100)).await;
        held.push(m);
    }
    for m in held {
        c.ack(&m).await;
    }
    c.ping().await;
    publisher.disconnect().await;
    broker.shutdown().await;
}
