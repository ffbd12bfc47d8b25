//! PUBLISH and SUBSCRIBE: QoS flows both ways, QoS downgrade, overlapping subscriptions,
//! subscription options and identifiers, shared subscriptions, forwarded properties, message
//! expiry, topic aliases, UNSUBSCRIBE (MQTT 3.1.1 and 5.0 sections 3.3 - 3.11, 4.3, 4.8).
use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use mercurio::codec::{
    Packet, Properties, ProtocolVersion, PubAck, QoS, ReasonCode, SubscriptionOptions,
};

const SHORT: Duration = Duration::from_millis(300);

/// QoS 0, 1 and 2 in both directions with the acknowledgement flows of section 4.3: the
/// broker answers PUBACK [MQTT-4.3.2-2], PUBREC then PUBCOMP [MQTT-4.3.3-2]; it sends QoS 1/2
/// with a non-zero packet identifier [MQTT-2.2.1-2] (3.1.1: [MQTT-2.3.1-1]) and answers
/// PUBREC with PUBREL of the same identifier [MQTT-4.3.3-4].
#[tokio::test]
async fn qos_flows_both_directions() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut sub = Client::connect(addr, version, "flow-sub").await;
        sub.subscribe("flow/#", QoS::ExactlyOnce).await;
        let mut publisher = Client::connect(addr, version, "flow-pub").await;

        publisher
            .publish("flow/0", b"zero", QoS::AtMostOnce, false)
            .await;
        let p = sub.expect_publish().await;
        assert_eq!((p.qos, p.packet_id, p.dup), (QoS::AtMostOnce, 0, false));

        assert_eq!(
            publisher
                .publish("flow/1", b"one", QoS::AtLeastOnce, false)
                .await,
            ReasonCode::SUCCESS
        );
        let p = sub.expect_publish().await;
        assert_eq!(p.qos, QoS::AtLeastOnce);
        assert_ne!(p.packet_id, 0);
        sub.ack(&p).await;

        // QoS 2 inbound, by hand: PUBREC, then PUBREL -> PUBCOMP.
        publisher
            .send(publish_packet(
                "flow/2",
                b"two",
                QoS::ExactlyOnce,
                false,
                77,
                Properties::default(),
            ))
            .await;
        match publisher.expect_packet().await {
            Packet::PubRec(a) => assert_eq!(a.packet_id, 77),
            other => panic!("expected PUBREC, got {other:?}"),
        }
        publisher
            .send(Packet::PubRel(PubAck {
                packet_id: 77,
                ..Default::default()
            }))
            .await;
        match publisher.expect_packet().await {
            Packet::PubComp(a) => assert_eq!(a.packet_id, 77),
            other => panic!("expected PUBCOMP, got {other:?}"),
        }
        // QoS 2 outbound, by hand.
        let p = sub.expect_publish().await;
        assert_eq!((p.qos, &p.payload[..]), (QoS::ExactlyOnce, &b"two"[..]));
        assert_ne!(p.packet_id, 0);
        sub.send(Packet::PubRec(PubAck {
            packet_id: p.packet_id,
            ..Default::default()
        }))
        .await;
        match sub.expect_packet().await {
            Packet::PubRel(r) => assert_eq!(r.packet_id, p.packet_id),
            other => panic!("expected PUBREL, got {other:?}"),
        }
        sub.send(Packet::PubComp(PubAck {
            packet_id: p.packet_id,
            ..Default::default()
        }))
        .await;
        sub.ping().await;
        publisher.disconnect().await;
        sub.disconnect().await;
    }
    broker.shutdown().await;
}

/// Unacknowledged QoS 1 messages in flight at the same time carry distinct packet
/// identifiers [MQTT-2.2.1-2] (3.1.1: [MQTT-2.3.1-2]).
#[tokio::test]
async fn inflight_packet_identifiers_are_distinct() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut sub = Client::connect(addr, version, "ids-sub").await;
        sub.subscribe("ids/t", QoS::AtLeastOnce).await;
        let mut publisher = Client::connect(addr, version, "ids-pub").await;
        for i in 0..5u8 {
            publisher
                .publish("ids/t", &[i], QoS::AtLeastOnce, false)
                .await;
        }
        let mut ids = HashSet::new();
        let mut got = Vec::new();
        for _ in 0..5 {
            let p = sub.expect_publish().await;
            assert!(ids.insert(p.packet_id), "packet id {} reused", p.packet_id);
            got.push(p);
        }
        // In order, as published [MQTT-4.6.0-5].
        let payloads: Vec<u8> = got.iter().map(|p| p.payload[0]).collect();
        assert_eq!(payloads, vec![0, 1, 2, 3, 4]);
        for p in &got {
            sub.ack(p).await;
        }
        sub.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// A message is delivered at the lower of its QoS and the subscription's granted QoS
/// [MQTT-3.8.4-6] (3.1.1) / [MQTT-3.8.4-8] (5.0).
#[tokio::test]
async fn qos_is_downgraded_to_the_granted_qos() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut s0 = Client::connect(addr, version, "dg-0").await;
        let mut s1 = Client::connect(addr, version, "dg-1").await;
        assert_eq!(
            s0.subscribe("dg/t", QoS::AtMostOnce).await,
            ReasonCode::GRANTED_QOS_0
        );
        assert_eq!(
            s1.subscribe("dg/t", QoS::AtLeastOnce).await,
            ReasonCode::GRANTED_QOS_1
        );
        let mut publisher = Client::connect(addr, version, "dg-pub").await;
        publisher
            .publish("dg/t", b"x", QoS::ExactlyOnce, false)
            .await;
        assert_eq!(s0.expect_publish().await.qos, QoS::AtMostOnce);
        let p = s1.expect_publish().await;
        assert_eq!(p.qos, QoS::AtLeastOnce);
        s1.ack(&p).await;
        // Never upgraded: QoS 0 published stays QoS 0 for a QoS 1 subscription.
        publisher
            .publish("dg/t", b"y", QoS::AtMostOnce, false)
            .await;
        assert_eq!(s1.expect_publish().await.qos, QoS::AtMostOnce);
        for c in [s0, s1, publisher] {
            c.disconnect().await;
        }
    }
    broker.shutdown().await;
}

/// Overlapping subscriptions of one client: one delivery at the highest granted QoS
/// [MQTT-3.3.5-1] (3.1.1) / [MQTT-3.3.4-2] (5.0), carrying the Subscription Identifier of
/// every matching subscription [MQTT-3.3.4-3] [MQTT-3.3.4-4].
#[tokio::test]
async fn overlapping_subscriptions_deliver_once_at_highest_qos() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut sub = Client::connect(addr, version, "ov-sub").await;
        let with_id = |id: u32| Properties {
            subscription_identifiers: if version.is_v5() { vec![id] } else { vec![] },
            ..Properties::default()
        };
        sub.subscribe_with(&[("ov/+", opts(QoS::AtLeastOnce))], with_id(1))
            .await;
        sub.subscribe_with(&[("ov/#", opts(QoS::ExactlyOnce))], with_id(2))
            .await;
        sub.subscribe_with(&[("other/#", opts(QoS::AtMostOnce))], with_id(3))
            .await;
        let mut publisher = Client::connect(addr, version, "ov-pub").await;
        publisher
            .publish("ov/t", b"x", QoS::ExactlyOnce, false)
            .await;
        let p = sub.expect_publish().await;
        assert_eq!(p.qos, QoS::ExactlyOnce);
        if version.is_v5() {
            let mut ids = p.properties.subscription_identifiers.clone();
            ids.sort();
            assert_eq!(ids, vec![1, 2]);
        } else {
            assert!(p.properties.subscription_identifiers.is_empty());
        }
        sub.ack(&p).await;
        sub.expect_nothing(SHORT).await;
        publisher.disconnect().await;
        sub.disconnect().await;
    }
    broker.shutdown().await;
}

/// One message to many subscribers that get it in different forms: each gets exactly its
/// own (3.1.1 at QoS 0, which share one encoding; 3.1.1 at QoS 1 with its own packet
/// identifier [MQTT-2.3.1-1]; 5.0 with the publisher's properties [MQTT-3.3.2-17]), at the
/// lower of the two QoS [MQTT-3.8.4-6], and the next message is not mistaken for it.
#[tokio::test]
async fn fan_out_in_mixed_forms() {
    let (broker, addr) = start().await;
    let mut plain = Vec::new();
    for i in 0..3 {
        let mut c = Client::connect(addr, ProtocolVersion::V311, &format!("mix-{i}")).await;
        c.subscribe("mix/t", QoS::AtMostOnce).await;
        plain.push(c);
    }
    let mut q1 = Client::connect(addr, ProtocolVersion::V311, "mix-q1").await;
    q1.subscribe("mix/t", QoS::AtLeastOnce).await;
    let mut v5 = Client::connect(addr, ProtocolVersion::V5, "mix-v5").await;
    v5.subscribe("mix/t", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "mix-pub").await;
    let props = Properties {
        content_type: Some("text/plain".into()),
        ..Properties::default()
    };
    for payload in [&b"first"[..], &b"second, longer"[..]] {
        publisher
            .publish_with("mix/t", payload, QoS::AtLeastOnce, false, props.clone())
            .await;
        for c in &mut plain {
            let p = c.expect_publish().await;
            assert_eq!(
                (
                    p.topic.as_str(),
                    &p.payload[..],
                    p.qos,
                    p.packet_id,
                    p.retain
                ),
                ("mix/t", payload, QoS::AtMostOnce, 0, false)
            );
            assert!(p.properties.is_empty());
        }
        let p = q1.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..], p.qos, p.retain),
            ("mix/t", payload, QoS::AtLeastOnce, false)
        );
        assert_ne!(p.packet_id, 0);
        q1.ack(&p).await;
        let p = v5.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..], p.qos),
            ("mix/t", payload, QoS::AtMostOnce)
        );
        assert_eq!(p.properties.content_type.as_deref(), Some("text/plain"));
    }
    for c in &mut plain {
        c.expect_nothing(SHORT).await;
    }
    broker.shutdown().await;
}

/// A message matching a subscription with an identifier carries it; one without carries
/// none [MQTT-3.3.4-3]. A SUBSCRIBE replacing a subscription replaces its identifier.
#[tokio::test]
async fn subscription_identifiers() {
    let (broker, addr) = start().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "sid-sub").await;
    let id = |n: u32| Properties {
        subscription_identifiers: vec![n],
        ..Properties::default()
    };
    sub.subscribe_with(&[("sid/a", opts(QoS::AtMostOnce))], id(268_435_455))
        .await;
    sub.subscribe_with(&[("sid/b", opts(QoS::AtMostOnce))], Properties::default())
        .await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "sid-pub").await;
    publisher
        .publish("sid/a", b"a", QoS::AtMostOnce, false)
        .await;
    let p = sub.expect_publish().await;
    assert_eq!(p.properties.subscription_identifiers, vec![268_435_455]);
    publisher
        .publish("sid/b", b"b", QoS::AtMostOnce, false)
        .await;
    let p = sub.expect_publish().await;
    assert!(p.properties.subscription_identifiers.is_empty());
    // Replacing the subscription replaces the identifier.
    sub.subscribe_with(&[("sid/a", opts(QoS::AtMostOnce))], id(9))
        .await;
    publisher
        .publish("sid/a", b"a", QoS::AtMostOnce, false)
        .await;
    let p = sub.expect_publish().await;
    assert_eq!(p.properties.subscription_identifiers, vec![9]);
    broker.shutdown().await;
}

/// No Local: the client's own messages are not sent back to it on that subscription
/// [MQTT-3.8.3-3]; other clients' messages are.
#[tokio::test]
async fn no_local() {
    let (broker, addr) = start().await;
    let mut me = Client::connect(addr, ProtocolVersion::V5, "nl-me").await;
    let o = SubscriptionOptions {
        qos: QoS::AtLeastOnce,
        no_local: true,
        ..Default::default()
    };
    me.subscribe_with(&[("nl/t", o)], Properties::default())
        .await;
    me.publish("nl/t", b"mine", QoS::AtLeastOnce, false).await;
    let mut other = Client::connect(addr, ProtocolVersion::V5, "nl-other").await;
    other
        .publish("nl/t", b"theirs", QoS::AtLeastOnce, false)
        .await;
    let p = me.expect_publish().await;
    assert_eq!(&p.payload[..], b"theirs");
    me.ack(&p).await;
    me.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// Retain As Published 1 keeps the RETAIN flag of the PUBLISH [MQTT-3.3.1-13]; 0 clears it on
/// live delivery [MQTT-3.3.1-12] (3.1.1: [MQTT-3.3.1-9]).
#[tokio::test]
async fn retain_as_published() {
    let (broker, addr) = start().await;
    let mut rap = Client::connect(addr, ProtocolVersion::V5, "rap-1").await;
    let o = SubscriptionOptions {
        qos: QoS::AtMostOnce,
        retain_as_published: true,
        ..Default::default()
    };
    rap.subscribe_with(&[("rap/t", o)], Properties::default())
        .await;
    let mut plain = Client::connect(addr, ProtocolVersion::V5, "rap-0").await;
    plain.subscribe("rap/t", QoS::AtMostOnce).await;
    let mut old = Client::connect(addr, ProtocolVersion::V311, "rap-311").await;
    old.subscribe("rap/t", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rap-pub").await;
    publisher
        .publish("rap/t", b"r", QoS::AtMostOnce, true)
        .await;
    assert!(rap.expect_publish().await.retain);
    assert!(!plain.expect_publish().await.retain);
    assert!(!old.expect_publish().await.retain);
    publisher
        .publish("rap/t", b"n", QoS::AtMostOnce, false)
        .await;
    assert!(!rap.expect_publish().await.retain);
    broker.shutdown().await;
}

/// Shared subscriptions: each message goes to exactly one member of the group, alternating
/// between connected members (MQTT 5.0 section 4.8.2), at the member's granted QoS
/// [MQTT-4.8.2-3]; a non-shared subscription on the same filter still gets every message.
#[tokio::test]
async fn shared_subscription_delivers_each_message_to_one_member() {
    let (broker, addr) = start().await;
    let mut a = Client::connect(addr, ProtocolVersion::V5, "sh-a").await;
    let mut b = Client::connect(addr, ProtocolVersion::V311, "sh-b").await;
    let mut all = Client::connect(addr, ProtocolVersion::V5, "sh-all").await;
    assert_eq!(
        a.subscribe("$share/g/sh/+", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    assert_eq!(
        b.subscribe("$share/g/sh/+", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    all.subscribe("sh/+", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "sh-pub").await;
    for i in 0..6u8 {
        publisher
            .publish("sh/t", &[i], QoS::AtLeastOnce, false)
            .await;
    }
    for i in 0..6u8 {
        assert_eq!(all.expect_publish().await.payload[..], [i]);
    }
    let mut got_a = Vec::new();
    for _ in 0..3 {
        let p = a.expect_publish().await;
        assert_eq!(p.qos, QoS::AtLeastOnce);
        a.ack(&p).await;
        got_a.push(p.payload[0]);
    }
    let mut got_b = Vec::new();
    for _ in 0..3 {
        let p = b.expect_publish().await;
        assert_eq!(p.qos, QoS::AtMostOnce);
        got_b.push(p.payload[0]);
    }
    a.expect_nothing(SHORT).await;
    b.expect_nothing(Duration::from_millis(50)).await;
    let mut every: Vec<u8> = got_a.iter().chain(&got_b).copied().collect();
    every.sort();
    assert_eq!(every, vec![0, 1, 2, 3, 4, 5], "each message exactly once");
    assert!(
        got_a.windows(2).all(|w| w[1] == w[0] + 2),
        "alternating: a got {got_a:?}, b got {got_b:?}"
    );
    broker.shutdown().await;
}

/// Shared subscription filters: `$share/` with an empty ShareName or one holding a wildcard,
/// or with no filter, are invalid [MQTT-4.8.2-1] [MQTT-4.8.2-2]; No Local on a shared
/// subscription is a Protocol Error [MQTT-3.8.3-4].
#[tokio::test]
async fn shared_subscription_filter_rules() {
    let (broker, addr) = start().await;
    let mut c = Client::connect(addr, ProtocolVersion::V5, "sh-rules").await;
    let codes = c
        .subscribe_with(
            &[
                ("$share//t", opts(QoS::AtMostOnce)),
                ("$share/g+/t", opts(QoS::AtMostOnce)),
                ("$share/g", opts(QoS::AtMostOnce)),
                ("$share/g/ok/#", opts(QoS::AtMostOnce)),
            ],
            Properties::default(),
        )
        .await;
    assert_eq!(
        codes,
        vec![
            ReasonCode::TOPIC_FILTER_INVALID,
            ReasonCode::TOPIC_FILTER_INVALID,
            ReasonCode::TOPIC_FILTER_INVALID,
            ReasonCode::GRANTED_QOS_0
        ]
    );
    let o = SubscriptionOptions {
        no_local: true,
        ..Default::default()
    };
    c.send(Packet::Subscribe(mercurio::codec::Subscribe {
        packet_id: 9,
        filters: vec![mercurio::codec::SubscribeFilter {
            filter: "$share/g/x".into(),
            options: o,
        }],
        properties: Properties::default(),
    }))
    .await;
    c.expect_violation(ReasonCode::PROTOCOL_ERROR).await;
    broker.shutdown().await;
}

/// User Properties are forwarded unchanged and in order [MQTT-3.3.2-17] [MQTT-3.3.2-18], as
/// are Response Topic [MQTT-3.3.2-15], Correlation Data [MQTT-3.3.2-16], Content Type
/// [MQTT-3.3.2-20] and the Payload Format Indicator [MQTT-3.3.2-4].
#[tokio::test]
async fn publish_properties_are_forwarded_unchanged() {
    let (broker, addr) = start().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "fw-sub").await;
    sub.subscribe("fw/t", QoS::AtLeastOnce).await;
    let mut old = Client::connect(addr, ProtocolVersion::V311, "fw-311").await;
    old.subscribe("fw/t", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "fw-pub").await;
    let props = Properties {
        payload_format_indicator: Some(1),
        content_type: Some("text/plain; charset=utf-8".into()),
        response_topic: Some("fw/reply/7".into()),
        correlation_data: Some(Bytes::from_static(&[0, 1, 2, 0xff])),
        user_properties: vec![
            ("b".into(), "2".into()),
            ("a".into(), "1".into()),
            ("b".into(), "1".into()),
            ("".into(), "é".into()),
        ],
        ..Properties::default()
    };
    publisher
        .publish_with(
            "fw/t",
            "héllo".as_bytes(),
            QoS::AtLeastOnce,
            false,
            props.clone(),
        )
        .await;
    let p = sub.expect_publish().await;
    assert_eq!(p.properties, props);
    sub.ack(&p).await;
    // A 3.1.1 subscriber gets the message, without properties.
    let p = old.expect_publish().await;
    assert_eq!(p.payload, "héllo".as_bytes());
    broker.shutdown().await;
}

/// A payload that is not UTF-8 with Payload Format Indicator 1 is refused with 0x99
/// (Payload format invalid) and not forwarded [MQTT-3.3.2-4]... (5.0 section 3.3.2.3.2).
#[tokio::test]
async fn invalid_utf8_payload_with_format_indicator_is_refused() {
    let (broker, addr) = start().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "pfi-sub").await;
    sub.subscribe("pfi/t", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pfi-pub").await;
    let props = Properties {
        payload_format_indicator: Some(1),
        ..Properties::default()
    };
    let rc = publisher
        .publish_with("pfi/t", &[0xff, 0xfe], QoS::AtLeastOnce, false, props)
        .await;
    assert_eq!(rc, ReasonCode::PAYLOAD_FORMAT_INVALID);
    publisher
        .publish("pfi/t", b"ok", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(&sub.expect_publish().await.payload[..], b"ok");
    broker.shutdown().await;
}

/// The Message Expiry Interval is forwarded minus the time the message waited
/// [MQTT-3.3.2-6]; a message whose interval has passed is not delivered to a session that
/// reconnects afterwards [MQTT-3.3.2-5], and its packet identifier is used up, as in
/// mosquitto (any free identifier is valid [MQTT-2.2.1-3]).
#[tokio::test]
async fn message_expiry_is_decremented_and_enforced() {
    let (broker, addr) = start().await;
    let (mut sub, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "exp-sub").await;
    sub.subscribe("exp/#", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "exp-pub").await;
    let expiry = |s: u32| Properties {
        message_expiry_interval: Some(s),
        ..Properties::default()
    };
    // Live: forwarded with (at most) the interval it was published with.
    publisher
        .publish_with("exp/live", b"l", QoS::AtLeastOnce, false, expiry(100))
        .await;
    let p = sub.expect_publish().await;
    let left = p.properties.message_expiry_interval.expect("expiry");
    assert!((98..=100).contains(&left), "{left}");
    sub.ack(&p).await;
    sub.disconnect().await;

    publisher
        .publish_with("exp/short", b"s", QoS::AtLeastOnce, false, expiry(1))
        .await;
    publisher
        .publish_with("exp/long", b"g", QoS::AtLeastOnce, false, expiry(100))
        .await;
    publisher
        .publish("exp/none", b"n", QoS::AtLeastOnce, false)
        .await;
    // Let the short interval run out (this waits for time itself, not for an event).
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (mut sub, present) = Client::connect_persistent(addr, ProtocolVersion::V5, "exp-sub").await;
    assert!(present);
    let p = sub.expect_publish().await;
    assert_eq!(p.topic, "exp/long", "the expired message is not delivered");
    assert_eq!(
        p.packet_id, 3,
        "exp/live had 1, the expired exp/short used up 2"
    );
    let left = p.properties.message_expiry_interval.expect("expiry");
    assert!((90..100).contains(&left), "decremented by the wait: {left}");
    sub.ack(&p).await;
    let p = sub.expect_publish().await;
    assert_eq!(p.topic, "exp/none");
    assert_eq!(p.properties.message_expiry_interval, None);
    sub.ack(&p).await;
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// A Message Expiry Interval of 0 means "no expiry", as mosquitto reads it: the message
/// reaches a subscriber online at that moment and one that reconnects later, forwarded
/// without the property (5.0 section 3.3.2.3.3 gives no meaning to a lifetime of 0 s).
#[tokio::test]
async fn message_expiry_interval_zero_never_expires() {
    let (broker, addr) = start().await;
    let (mut offline, _) =
        Client::connect_persistent(addr, ProtocolVersion::V5, "exp0-offline").await;
    offline.subscribe("exp0/t", QoS::AtLeastOnce).await;
    offline.disconnect().await;
    let mut online = Client::connect(addr, ProtocolVersion::V5, "exp0-online").await;
    online.subscribe("exp0/t", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "exp0-pub").await;
    let zero = Properties {
        message_expiry_interval: Some(0),
        ..Properties::default()
    };
    publisher
        .publish_with("exp0/t", b"z", QoS::AtLeastOnce, false, zero)
        .await;
    let p = online.expect_publish().await;
    assert_eq!(&p.payload[..], b"z");
    assert_eq!(p.properties.message_expiry_interval, None);
    let (mut offline, present) =
        Client::connect_persistent(addr, ProtocolVersion::V5, "exp0-offline").await;
    assert!(present);
    let p = offline.expect_publish().await;
    assert_eq!(&p.payload[..], b"z");
    assert_eq!(p.properties.message_expiry_interval, None);
    broker.shutdown().await;
}

/// Inbound topic aliases: a PUBLISH with a topic and an alias sets it, a PUBLISH with an
/// empty topic and the alias uses it (5.0 section 3.3.2.3.4); alias 0 [MQTT-3.3.2-8] or above
/// the broker's Topic Alias Maximum [MQTT-3.3.2-9] closes with DISCONNECT 0x94.
#[tokio::test]
async fn inbound_topic_aliases() {
    let (broker, addr) = start().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "ta-sub").await;
    sub.subscribe("ta/#", QoS::AtMostOnce).await;
    let (mut publisher, ack) =
        Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "ta-pub")).await;
    let max = ack
        .properties
        .topic_alias_maximum
        .expect("Topic Alias Maximum");
    let alias = |a: u16| Properties {
        topic_alias: Some(a),
        ..Properties::default()
    };
    publisher
        .publish_with("ta/one", b"1", QoS::AtMostOnce, false, alias(max))
        .await;
    publisher
        .publish_with("", b"2", QoS::AtLeastOnce, false, alias(max))
        .await;
    // Re-mapping an alias to another topic is allowed.
    publisher
        .publish_with("ta/two", b"3", QoS::AtMostOnce, false, alias(max))
        .await;
    publisher
        .publish_with("", b"4", QoS::AtMostOnce, false, alias(max))
        .await;
    for (topic, payload) in [
        ("ta/one", "1"),
        ("ta/one", "2"),
        ("ta/two", "3"),
        ("ta/two", "4"),
    ] {
        let p = sub.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..]),
            (topic, payload.as_bytes())
        );
        assert_eq!(
            p.properties.topic_alias, None,
            "subscriber asked for no aliases"
        );
    }

    for bad in [0, max + 1] {
        let mut c = Client::connect(addr, ProtocolVersion::V5, "ta-bad").await;
        c.send(publish_packet(
            "ta/x",
            b"x",
            QoS::AtMostOnce,
            false,
            0,
            alias(bad),
        ))
        .await;
        c.expect_violation(ReasonCode::TOPIC_ALIAS_INVALID).await;
    }
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// Outbound topic aliases: only when the client announced a Topic Alias Maximum
/// [MQTT-3.3.2-11], never above it [MQTT-3.3.2-10]; a later PUBLISH may carry the alias with
/// an empty topic, which the client maps back (5.0 section 3.3.2.3.4).
#[tokio::test]
async fn outbound_topic_aliases_respect_the_client_maximum() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "oa-sub");
    connect.properties.topic_alias_maximum = Some(2);
    let (mut sub, _) = Client::connect_with(addr, connect).await;
    sub.subscribe("oa/#", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "oa-pub").await;
    let topics = ["oa/a", "oa/b", "oa/c", "oa/a", "oa/b", "oa/c", "oa/a"];
    for t in topics {
        publisher
            .publish(t, t.as_bytes(), QoS::AtMostOnce, false)
            .await;
    }
    let mut map = std::collections::HashMap::new();
    let mut used_alias = false;
    for t in topics {
        let p = sub.expect_publish().await;
        let topic = match p.properties.topic_alias {
            Some(a) => {
                assert!((1..=2).contains(&a), "alias {a} above the maximum 2");
                used_alias = true;
                if p.topic.is_empty() {
                    map.get(&a).cloned().expect("alias set before use")
                } else {
                    map.insert(a, p.topic.clone());
                    p.topic.clone()
                }
            }
            None => {
                assert!(!p.topic.is_empty());
                p.topic.clone()
            }
        };
        assert_eq!(topic, t);
        assert_eq!(&p.payload[..], t.as_bytes());
    }
    assert!(used_alias, "the broker may use aliases; this one does");
    broker.shutdown().await;
}

/// Outbound topic alias numbers never wrap: with a Topic Alias Maximum of 65,535 no topic gets
/// alias 0 (the 65,536th once wrapped to 0, an alias the client must treat as a Protocol
/// Error, section 3.3.2.3.4); the broker sets at most 100 aliases towards a client (its alias
/// table is bounded), so every topic after the 100th goes without one.
#[tokio::test]
async fn outbound_topic_aliases_never_wrap() {
    let mut config = test_config();
    config.server.max_queued_qos0_messages = 0;
    config.server.max_queued_messages = 0;
    let (broker, addr) = start_with(config).await;
    let mut connect = connect_packet(ProtocolVersion::V5, "wrap-sub");
    connect.properties.topic_alias_maximum = Some(u16::MAX);
    let (mut sub, _) = Client::connect_with(addr, connect).await;
    sub.subscribe("w/#", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "wrap-pub").await;
    const N: u32 = 65_537;
    let reader = tokio::spawn(async move {
        let mut without = Vec::new();
        for i in 0..N {
            let p = sub.expect_publish().await;
            assert_eq!(p.topic, format!("w/{i}"));
            match p.properties.topic_alias {
                Some(a) => assert_ne!(a, 0, "topic {i} got alias 0"),
                None => without.push(i),
            }
        }
        without
    });
    for i in 0..N {
        publisher
            .send(Packet::Publish(mercurio::codec::Publish {
                dup: false,
                qos: QoS::AtMostOnce,
                retain: false,
                topic: format!("w/{i}"),
                packet_id: 0,
                properties: Properties::default(),
                payload: bytes::Bytes::from_static(b"x"),
            }))
            .await;
    }
    let without = tokio::time::timeout(Duration::from_secs(120), reader)
        .await
        .expect("every message within two minutes")
        .expect("reader");
    assert_eq!(
        without,
        (100..N).collect::<Vec<u32>>(),
        "the topics past the 100 aliases"
    );
    broker.shutdown().await;
}

/// UNSUBSCRIBE: UNSUBACK with the same packet identifier [MQTT-3.10.4-4] [MQTT-3.10.4-5] and, in
/// 5.0, one reason code per filter: 0x00 or 0x11 (No subscription existed) [MQTT-3.11.3-1];
/// the broker stops delivering on the removed filter [MQTT-3.10.4-1] [MQTT-3.10.4-2].
#[tokio::test]
async fn unsubscribe_reason_codes_and_no_more_delivery() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut sub = Client::connect(addr, version, "uns-sub").await;
        sub.subscribe("uns/a", QoS::AtLeastOnce).await;
        sub.subscribe("uns/b", QoS::AtLeastOnce).await;
        let codes = sub.unsubscribe(&["uns/a", "uns/none"]).await;
        if version.is_v5() {
            assert_eq!(
                codes,
                vec![ReasonCode::SUCCESS, ReasonCode::NO_SUBSCRIPTION_EXISTED]
            );
        } else {
            assert!(codes.is_empty());
        }
        let mut publisher = Client::connect(addr, version, "uns-pub").await;
        publisher
            .publish("uns/a", b"a", QoS::AtLeastOnce, false)
            .await;
        publisher
            .publish("uns/b", b"b", QoS::AtLeastOnce, false)
            .await;
        let p = sub.expect_publish().await;
        assert_eq!(p.topic, "uns/b");
        sub.ack(&p).await;
        sub.expect_nothing(SHORT).await;
        sub.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// SUBACK carries one code per filter, in order [MQTT-3.8.4-5] [MQTT-3.9.3-1]: the granted QoS,
/// or a failure for an invalid filter (5.0: 0x8F Topic Filter invalid; 3.1.1: 0x80).
#[tokio::test]
async fn subscribe_invalid_filter_fails_only_that_filter() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, "bad-filter").await;
        let codes = c
            .subscribe_with(
                &[
                    ("ok/+/x", opts(QoS::AtLeastOnce)),
                    ("a/#/b", opts(QoS::AtLeastOnce)),
                    ("a+/b", opts(QoS::AtLeastOnce)),
                    ("ok/#", opts(QoS::ExactlyOnce)),
                ],
                Properties::default(),
            )
            .await;
        let fail = if version.is_v5() {
            ReasonCode::TOPIC_FILTER_INVALID
        } else {
            ReasonCode(0x80)
        };
        assert_eq!(
            codes,
            vec![
                ReasonCode::GRANTED_QOS_1,
                fail,
                fail,
                ReasonCode::GRANTED_QOS_2
            ]
        );
        c.ping().await;
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// The broker never sends a packet larger than the client's Maximum Packet Size: such a
/// message is discarded for that client [MQTT-3.1.2-24] [MQTT-3.1.2-25], others still flow.
#[tokio::test]
async fn client_maximum_packet_size_is_respected() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "mps-sub");
    connect.properties.maximum_packet_size = Some(100);
    let (mut small, _) = Client::connect_with(addr, connect).await;
    small.subscribe("mps/t", QoS::AtLeastOnce).await;
    let mut big = Client::connect(addr, ProtocolVersion::V5, "mps-big").await;
    big.subscribe("mps/t", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "mps-pub").await;
    publisher
        .publish("mps/t", &[b'x'; 200], QoS::AtLeastOnce, false)
        .await;
    publisher
        .publish("mps/t", b"small", QoS::AtLeastOnce, false)
        .await;
    let p = big.expect_publish().await;
    assert_eq!(p.payload.len(), 200);
    big.ack(&p).await;
    let p = small.expect_publish().await;
    assert_eq!(&p.payload[..], b"small");
    small.ack(&p).await;
    small.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// The broker sends no more unacknowledged QoS 1/2 PUBLISH packets than the client's Receive
/// Maximum [MQTT-3.3.4-9]; acknowledging one lets the next through. 3.x clients are bounded by
/// max_inflight the same way.
#[tokio::test]
async fn outbound_flow_control() {
    let mut config = test_config();
    config.server.max_inflight = 3;
    let (broker, addr) = start_with(config).await;
    for (version, window) in [(ProtocolVersion::V5, 2usize), (ProtocolVersion::V311, 3)] {
        let mut connect = connect_packet(version, "fc-sub");
        if version.is_v5() {
            connect.properties.receive_maximum = Some(2);
        }
        let (mut sub, _) = Client::connect_with(addr, connect).await;
        sub.subscribe("fc/t", QoS::ExactlyOnce).await;
        let mut publisher = Client::connect(addr, version, "fc-pub").await;
        for i in 0..6u8 {
            let qos = if i % 2 == 0 {
                QoS::AtLeastOnce
            } else {
                QoS::ExactlyOnce
            };
            publisher.publish("fc/t", &[i], qos, false).await;
        }
        let mut first = Vec::new();
        for _ in 0..window {
            first.push(sub.expect_publish().await);
        }
        sub.expect_nothing(SHORT).await;
        let mut next = 0u8;
        for p in &first {
            assert_eq!(p.payload[0], next);
            next += 1;
        }
        // Acknowledge what we hold; the rest then flows, never more than `window`
        // unacknowledged (PUBLISH without PUBACK, or without PUBCOMP for QoS 2) at once.
        let mut outstanding = HashSet::new();
        for p in &first {
            outstanding.insert(p.packet_id);
        }
        let answer = |p: &mercurio::codec::Publish| {
            let ack = PubAck {
                packet_id: p.packet_id,
                ..Default::default()
            };
            if p.qos == QoS::AtLeastOnce {
                Packet::PubAck(ack)
            } else {
                Packet::PubRec(ack)
            }
        };
        for p in &first {
            if p.qos == QoS::AtLeastOnce {
                outstanding.remove(&p.packet_id);
            }
            sub.send(answer(p)).await;
        }
        while next < 6 || !outstanding.is_empty() {
            match sub.expect_packet().await {
                Packet::Publish(p) => {
                    assert_eq!(p.payload[0], next);
                    next += 1;
                    assert!(outstanding.insert(p.packet_id));
                    assert!(outstanding.len() <= window, "{outstanding:?}");
                    if p.qos == QoS::AtLeastOnce {
                        outstanding.remove(&p.packet_id);
                    }
                    sub.send(answer(&p)).await;
                }
                Packet::PubRel(r) => {
                    assert!(outstanding.remove(&r.packet_id));
                    sub.send(Packet::PubComp(PubAck {
                        packet_id: r.packet_id,
                        ..Default::default()
                    }))
                    .await;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        sub.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// Unsubscribing a shared subscription removes this member: the other member then gets every
/// message (MQTT 5.0 section 4.8.2) [MQTT-3.10.4-1].
#[tokio::test]
async fn unsubscribe_shared_subscription() {
    let (broker, addr) = start().await;
    let mut a = Client::connect(addr, ProtocolVersion::V5, "ush-a").await;
    let mut b = Client::connect(addr, ProtocolVersion::V5, "ush-b").await;
    a.subscribe("$share/g/ush/t", QoS::AtMostOnce).await;
    b.subscribe("$share/g/ush/t", QoS::AtMostOnce).await;
    assert_eq!(
        a.unsubscribe(&["$share/g/ush/t"]).await,
        vec![ReasonCode::SUCCESS]
    );
    assert_eq!(
        a.unsubscribe(&["$share/g/ush/t", "$share/other/ush/t"])
            .await,
        vec![
            ReasonCode::NO_SUBSCRIPTION_EXISTED,
            ReasonCode::NO_SUBSCRIPTION_EXISTED
        ]
    );
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "ush-pub").await;
    for i in 0..4u8 {
        publisher
            .publish("ush/t", &[i], QoS::AtMostOnce, false)
            .await;
    }
    for i in 0..4u8 {
        assert_eq!(b.expect_publish().await.payload[..], [i]);
    }
    a.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// A PUBLISH above the Maximum QoS the broker announced closes the connection with
/// DISCONNECT 0x9B (QoS not supported) [MQTT-3.2.2-11].
#[tokio::test]
async fn publish_above_maximum_qos() {
    let mut config = test_config();
    config.server.max_qos = 1;
    let (broker, addr) = start_with(config).await;
    let mut c = Client::connect(addr, ProtocolVersion::V5, "mq").await;
    c.publish("mq/t", b"1", QoS::AtLeastOnce, false).await;
    c.send(publish_packet(
        "mq/t",
        b"2",
        QoS::ExactlyOnce,
        false,
        5,
        Properties::default(),
    ))
    .await;
    c.expect_violation(ReasonCode::QOS_NOT_SUPPORTED).await;
    broker.shutdown().await;
}

/// An empty topic name without a topic alias is refused: 3.1.1 [MQTT-4.7.3-1] closes, 5.0
/// closes with DISCONNECT 0x82 (section 3.3.2.3.4: Protocol Error).
#[tokio::test]
async fn empty_topic_name_is_refused() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, "empty-topic").await;
        c.send(publish_packet(
            "",
            b"x",
            QoS::AtMostOnce,
            false,
            0,
            Properties::default(),
        ))
        .await;
        let rc = c.expect_disconnect().await;
        if version.is_v5() {
            assert!(
                rc == Some(ReasonCode::PROTOCOL_ERROR)
                    || rc == Some(ReasonCode::TOPIC_NAME_INVALID)
                    || rc == Some(ReasonCode::MALFORMED_PACKET),
                "{rc:?}"
            );
        }
    }
    broker.shutdown().await;
}

/// PUBREL for a packet identifier the broker does not hold is answered with PUBCOMP
/// [MQTT-4.3.3-11], Success as mosquitto answers: it is what a client resends after a
/// reconnect when the PUBCOMP was lost [MQTT-4.4.0-1], and rumqttc drops its connection on
/// a PUBCOMP 0x92. The connection stays open.
#[tokio::test]
async fn pubrel_for_unknown_identifier() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, "unknown-rel").await;
        c.send(Packet::PubRel(PubAck {
            packet_id: 99,
            ..Default::default()
        }))
        .await;
        match c.expect_packet().await {
            Packet::PubComp(a) => {
                assert_eq!(a.packet_id, 99);
                assert_eq!(a.reason_code, ReasonCode::SUCCESS);
            }
            other => panic!("expected PUBCOMP, got {other:?}"),
        }
        c.ping().await;
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// A PUBREC with a failure reason code ends the QoS 2 flow: no PUBREL follows and the packet
/// identifier and window slot are free again (5.0 section 4.3.3, [MQTT-4.3.3-4]... "unless it
/// has received a PUBREC with a Reason Code of 0x80 or greater").
#[tokio::test]
async fn pubrec_failure_ends_the_flow() {
    let (broker, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "rec-fail");
    connect.properties.receive_maximum = Some(1);
    let (mut sub, _) = Client::connect_with(addr, connect).await;
    sub.subscribe("rf/t", QoS::ExactlyOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rf-pub").await;
    publisher
        .publish("rf/t", b"1", QoS::ExactlyOnce, false)
        .await;
    publisher
        .publish("rf/t", b"2", QoS::ExactlyOnce, false)
        .await;
    let p = sub.expect_publish().await;
    assert_eq!(&p.payload[..], b"1");
    sub.send(Packet::PubRec(PubAck {
        packet_id: p.packet_id,
        reason_code: ReasonCode::UNSPECIFIED_ERROR,
        ..Default::default()
    }))
    .await;
    // The window (Receive Maximum 1) reopens: the next message comes, not a PUBREL.
    let p = sub.expect_publish().await;
    assert_eq!(&p.payload[..], b"2");
    sub.ack(&p).await;
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// The DUP flag of an incoming PUBLISH is not propagated to subscribers [MQTT-3.3.1-3].
#[tokio::test]
async fn dup_flag_is_not_propagated() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut sub = Client::connect(addr, version, "dupf-sub").await;
        sub.subscribe("dupf/t", QoS::AtLeastOnce).await;
        let mut publisher = Client::connect(addr, version, "dupf-pub").await;
        let mut pk = publish_packet(
            "dupf/t",
            b"x",
            QoS::AtLeastOnce,
            false,
            3,
            Properties::default(),
        );
        if let Packet::Publish(p) = &mut pk {
            p.dup = true;
        }
        publisher.send(pk).await;
        assert!(matches!(publisher.expect_packet().await, Packet::PubAck(a) if a.packet_id == 3));
        let p = sub.expect_publish().await;
        assert!(!p.dup, "{version:?}");
        sub.ack(&p).await;
        sub.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// A shared subscription member whose session ends leaves the group: the remaining member
/// gets every message (MQTT 5.0 section 4.8.2).
#[tokio::test]
async fn shared_member_leaving_hands_over_to_the_rest() {
    let (broker, addr) = start().await;
    let mut a = Client::connect(addr, ProtocolVersion::V5, "shl-a").await;
    let mut b = Client::connect(addr, ProtocolVersion::V5, "shl-b").await;
    a.subscribe("$share/g/shl/t", QoS::AtMostOnce).await;
    b.subscribe("$share/g/shl/t", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "shl-pub").await;
    // Both members are served first (proves the group has two members).
    publisher
        .publish("shl/t", b"0", QoS::AtMostOnce, false)
        .await;
    publisher
        .publish("shl/t", b"1", QoS::AtMostOnce, false)
        .await;
    a.expect_publish().await;
    b.expect_publish().await;
    b.disconnect().await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while broker.sessions().iter().any(|s| s.client_id == "shl-b") {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for i in 0..4u8 {
        publisher
            .publish("shl/t", &[i], QoS::AtMostOnce, false)
            .await;
    }
    for i in 0..4u8 {
        assert_eq!(a.expect_publish().await.payload[..], [i]);
    }
    broker.shutdown().await;
}

/// UNSUBSCRIBE compares filters character by character, without wildcard matching
/// [MQTT-3.10.4-1]: unsubscribing `us/x` does not remove `us/#`.
#[tokio::test]
async fn unsubscribe_matches_filters_literally() {
    let (broker, addr) = start().await;
    let mut c = Client::connect(addr, ProtocolVersion::V5, "lit").await;
    c.subscribe("us/#", QoS::AtMostOnce).await;
    assert_eq!(
        c.unsubscribe(&["us/x", "us/+"]).await,
        vec![ReasonCode::NO_SUBSCRIPTION_EXISTED; 2]
    );
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "lit-pub").await;
    publisher
        .publish("us/x", b"x", QoS::AtMostOnce, false)
        .await;
    assert_eq!(c.expect_publish().await.topic, "us/x");
    broker.shutdown().await;
}

/// A SUBSCRIBE for a filter the client already has replaces that subscription (new QoS and
/// options), it does not add a second one [MQTT-3.8.4-3].
#[tokio::test]
async fn resubscribe_replaces_the_subscription() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, "resub").await;
        c.subscribe("resub/t", QoS::ExactlyOnce).await;
        assert_eq!(
            c.subscribe("resub/t", QoS::AtMostOnce).await,
            ReasonCode::GRANTED_QOS_0
        );
        let mut publisher = Client::connect(addr, version, "resub-pub").await;
        publisher
            .publish("resub/t", b"x", QoS::ExactlyOnce, false)
            .await;
        let p = c.expect_publish().await;
        assert_eq!(p.qos, QoS::AtMostOnce);
        c.expect_nothing(SHORT).await;
        let info = broker
            .sessions()
            .into_iter()
            .find(|s| s.client_id == "resub")
            .unwrap();
        assert_eq!(info.subscriptions, 1);
        c.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// A shared subscription whose only member is away with a persistent session keeps QoS 1
/// messages for it, delivered when it reconnects (MQTT 5.0 section 4.8.2).
#[tokio::test]
async fn shared_subscription_member_away_gets_messages_on_return() {
    let (broker, addr) = start().await;
    let (mut m, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "sha-m").await;
    m.subscribe("$share/g/sha/t", QoS::AtLeastOnce).await;
    m.disconnect().await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while broker
        .sessions()
        .iter()
        .any(|s| s.client_id == "sha-m" && s.connected)
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "sha-pub").await;
    publisher
        .publish("sha/t", b"kept", QoS::AtLeastOnce, false)
        .await;
    let (mut m, present) = Client::connect_persistent(addr, ProtocolVersion::V5, "sha-m").await;
    assert!(present);
    let p = m.expect_publish().await;
    assert_eq!(&p.payload[..], b"kept");
    m.ack(&p).await;
    broker.shutdown().await;
}

/// A 5.0 QoS 1 PUBLISH that no subscription matches is acknowledged with PUBACK 0x10 (No
/// matching subscribers), which the Server MAY send (MQTT 5.0 section 3.4.2.1), as mosquitto
/// does; a matching subscription, even the publisher's own with No Local, gives 0x00. 3.x
/// has no reason code, and PUBREC stays 0x00 (as in mosquitto).
#[tokio::test]
async fn puback_no_matching_subscribers() {
    let (broker, addr) = start().await;
    let mut p5 = Client::connect(addr, ProtocolVersion::V5, "nms-pub5").await;
    assert_eq!(
        p5.publish("nms/none", b"m", QoS::AtLeastOnce, false).await,
        ReasonCode::NO_MATCHING_SUBSCRIBERS
    );
    assert_eq!(
        p5.publish("nms/none", b"m", QoS::AtLeastOnce, true).await,
        ReasonCode::NO_MATCHING_SUBSCRIBERS
    );
    assert_eq!(
        p5.publish("nms/none", b"m", QoS::ExactlyOnce, false).await,
        ReasonCode::SUCCESS
    );
    let mut p3 = Client::connect(addr, ProtocolVersion::V311, "nms-pub3").await;
    assert_eq!(
        p3.publish("nms/none", b"m", QoS::AtLeastOnce, false).await,
        ReasonCode::SUCCESS
    );
    // The publisher's own No Local subscription matches (and delivers nothing).
    let o = SubscriptionOptions {
        qos: QoS::AtLeastOnce,
        no_local: true,
        ..Default::default()
    };
    p5.subscribe_with(&[("nms/own", o)], Properties::default())
        .await;
    assert_eq!(
        p5.publish("nms/own", b"m", QoS::AtLeastOnce, false).await,
        ReasonCode::SUCCESS
    );
    p5.expect_nothing(SHORT).await;
    // Another client's subscription, and a shared one.
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "nms-sub").await;
    sub.subscribe("nms/+/x", QoS::AtLeastOnce).await;
    sub.subscribe("$share/g/nms/shared", QoS::AtLeastOnce).await;
    for topic in ["nms/a/x", "nms/shared"] {
        assert_eq!(
            p5.publish(topic, b"m", QoS::AtLeastOnce, false).await,
            ReasonCode::SUCCESS,
            "{topic}"
        );
        let p = sub.expect_publish().await;
        sub.ack(&p).await;
    }
    broker.shutdown().await;
}
