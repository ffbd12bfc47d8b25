//! Retained messages: set, replace, delete, delivery on subscribe, Retain Handling, shared
//! subscriptions and expiry (MQTT 3.1.1 section 3.3.1.3, MQTT 5.0 sections 3.3.1.3, 3.8.3.1).
use crate::common;

use std::time::Duration;

use common::*;
use mercurio::codec::{Properties, ProtocolVersion, QoS, ReasonCode, SubscriptionOptions};

const SHORT: Duration = Duration::from_millis(300);

fn handling(qos: QoS, retain_handling: u8) -> SubscriptionOptions {
    SubscriptionOptions {
        qos,
        retain_handling,
        ..Default::default()
    }
}

/// A retained message is stored [MQTT-3.3.1-5] and sent to a new subscription with RETAIN 1
/// [MQTT-3.3.1-8] (3.1.1) / [MQTT-3.3.1-9] (5.0), at the lower of its QoS and the granted QoS.
#[tokio::test]
async fn retained_message_is_delivered_on_subscribe() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let topic = format!("ret/{}", version.level());
        let mut publisher = Client::connect(addr, version, "ret-pub").await;
        publisher
            .publish(&topic, b"kept", QoS::AtLeastOnce, true)
            .await;
        let mut sub = Client::connect(addr, version, "ret-sub").await;
        sub.subscribe("ret/+", QoS::ExactlyOnce).await;
        // This version's message, and every earlier version's (in any order).
        let mut topics = Vec::new();
        for _ in 0..(version.level() - 2) {
            let p = sub.expect_publish().await;
            assert_eq!(&p.payload[..], b"kept");
            assert!(p.retain, "RETAIN 1 on delivery to a new subscription");
            assert_eq!(p.qos, QoS::AtLeastOnce);
            sub.ack(&p).await;
            topics.push(p.topic);
        }
        assert!(topics.contains(&topic), "{topics:?}");
        sub.expect_nothing(SHORT).await;
        let mut low = Client::connect(addr, version, "ret-low").await;
        low.subscribe(&topic, QoS::AtMostOnce).await;
        let p = low.expect_publish().await;
        assert_eq!(p.qos, QoS::AtMostOnce);
        for c in [publisher, sub, low] {
            c.disconnect().await;
        }
    }
    assert_eq!(broker.retained_count(), 3);
    broker.shutdown().await;
}

/// A new retained message replaces the one of its topic [MQTT-3.3.1-5] (3.1.1:
/// [MQTT-3.3.1-5]); an empty retained payload deletes it [MQTT-3.3.1-6] (3.1.1:
/// [MQTT-3.3.1-10]) and is still forwarded to current subscribers, and is not itself stored
/// [MQTT-3.3.1-11] (3.1.1).
#[tokio::test]
async fn retained_replace_and_delete() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut publisher = Client::connect(addr, version, "rd-pub").await;
        publisher
            .publish("rd/t", b"one", QoS::AtMostOnce, true)
            .await;
        publisher
            .publish("rd/t", b"two", QoS::AtLeastOnce, true)
            .await;
        publisher.publish("rd/u", b"u", QoS::AtMostOnce, true).await;
        let mut sub = Client::connect(addr, version, "rd-sub").await;
        sub.subscribe("rd/t", QoS::AtLeastOnce).await;
        let p = sub.expect_publish().await;
        assert_eq!(&p.payload[..], b"two");
        sub.ack(&p).await;
        sub.expect_nothing(SHORT).await;

        publisher.publish("rd/t", b"", QoS::AtLeastOnce, true).await;
        let p = sub.expect_publish().await;
        assert!(p.payload.is_empty(), "the delete is forwarded");
        sub.ack(&p).await;

        let mut late = Client::connect(addr, version, "rd-late").await;
        late.subscribe("rd/+", QoS::AtMostOnce).await;
        let p = late.expect_publish().await;
        assert_eq!(p.topic, "rd/u", "rd/t was deleted");
        late.expect_nothing(SHORT).await;
        publisher.publish("rd/u", b"", QoS::AtLeastOnce, true).await;
        for c in [publisher, sub, late] {
            c.disconnect().await;
        }
    }
    assert_eq!(broker.retained_count(), 0);
    broker.shutdown().await;
}

/// A PUBLISH without RETAIN neither stores nor replaces a retained message
/// [MQTT-3.3.1-7] (3.1.1) / [MQTT-3.3.1-8] (5.0).
#[tokio::test]
async fn non_retained_publish_leaves_retained_message() {
    let (broker, addr) = start().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "nr-pub").await;
    publisher
        .publish("nr/t", b"kept", QoS::AtMostOnce, true)
        .await;
    publisher
        .publish("nr/t", b"live", QoS::AtMostOnce, false)
        .await;
    publisher.publish("nr/t", b"", QoS::AtMostOnce, false).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "nr-sub").await;
    sub.subscribe("nr/t", QoS::AtMostOnce).await;
    assert_eq!(&sub.expect_publish().await.payload[..], b"kept");
    broker.shutdown().await;
}

/// Retain Handling 0 sends retained messages at every subscribe [MQTT-3.3.1-9], 1 only when
/// the subscription did not exist [MQTT-3.3.1-10], 2 never [MQTT-3.3.1-11].
#[tokio::test]
async fn retain_handling() {
    let (broker, addr) = start().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rh-pub").await;
    publisher.publish("rh/t", b"r", QoS::AtMostOnce, true).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "rh-sub").await;

    // 0: at the first subscribe and again when it is repeated.
    for _ in 0..2 {
        sub.subscribe_with(
            &[("rh/t", handling(QoS::AtMostOnce, 0))],
            Properties::default(),
        )
        .await;
        let p = sub.expect_publish().await;
        assert!(p.retain);
    }
    // 1: only for a new subscription.
    sub.subscribe_with(
        &[("rh/+", handling(QoS::AtMostOnce, 1))],
        Properties::default(),
    )
    .await;
    assert!(sub.expect_publish().await.retain);
    sub.subscribe_with(
        &[("rh/+", handling(QoS::AtMostOnce, 1))],
        Properties::default(),
    )
    .await;
    // 2: never.
    sub.subscribe_with(
        &[("rh/#", handling(QoS::AtMostOnce, 2))],
        Properties::default(),
    )
    .await;
    sub.ping().await;
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// Retained messages are not sent to a shared subscription when it is made (MQTT 5.0 section
/// 4.8.2: "the Server MUST NOT send retained messages" for shared subscriptions).
#[tokio::test]
async fn retained_not_sent_to_shared_subscriptions() {
    let (broker, addr) = start().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rs-pub").await;
    publisher.publish("rs/t", b"r", QoS::AtMostOnce, true).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "rs-sub").await;
    sub.subscribe("$share/g/rs/t", QoS::AtMostOnce).await;
    // Positive: a plain subscription on the same connection does get it.
    sub.subscribe("rs/#", QoS::AtMostOnce).await;
    let p = sub.expect_publish().await;
    assert!(p.retain);
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// A retained message whose Message Expiry Interval has passed is no longer sent
/// [MQTT-3.3.2-5]; one still valid is sent with the remaining interval [MQTT-3.3.2-6].
#[tokio::test]
async fn retained_message_expiry() {
    let (broker, addr) = start().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rx-pub").await;
    let expiry = |s: u32| Properties {
        message_expiry_interval: Some(s),
        ..Properties::default()
    };
    publisher
        .publish_with("rx/short", b"s", QoS::AtMostOnce, true, expiry(1))
        .await;
    publisher
        .publish_with("rx/long", b"l", QoS::AtMostOnce, true, expiry(100))
        .await;
    // Let the short interval run out (waiting for time itself).
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "rx-sub").await;
    sub.subscribe("rx/+", QoS::AtMostOnce).await;
    let p = sub.expect_publish().await;
    assert_eq!(p.topic, "rx/long");
    let left = p.properties.message_expiry_interval.expect("expiry");
    assert!((90..100).contains(&left), "{left}");
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// With retain_available = false, a retained PUBLISH is a protocol error: DISCONNECT 0x9A
/// (Retain not supported) (MQTT 5.0 section 3.2.2.3.5) [MQTT-3.2.2-14].
#[tokio::test]
async fn retain_unavailable_refuses_retained_publish() {
    let mut config = test_config();
    config.server.retain_available = false;
    let (broker, addr) = start_with(config).await;
    let mut c = Client::connect(addr, ProtocolVersion::V5, "ru").await;
    c.publish("ru/t", b"plain", QoS::AtMostOnce, false).await;
    c.ping().await;
    c.send(publish_packet(
        "ru/t",
        b"r",
        QoS::AtMostOnce,
        true,
        0,
        Properties::default(),
    ))
    .await;
    c.expect_violation(ReasonCode::RETAIN_NOT_SUPPORTED).await;
    assert_eq!(broker.retained_count(), 0);
    broker.shutdown().await;
}

/// Retained messages on `$` topics are not sent to filters starting with a wildcard
/// [MQTT-4.7.2-1], but are to filters naming their first level.
#[tokio::test]
async fn retained_dollar_topics_not_matched_by_leading_wildcards() {
    let (broker, addr) = start().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rd$-pub").await;
    publisher
        .publish("$app/x", b"d", QoS::AtLeastOnce, true)
        .await;
    publisher
        .publish("app/x", b"p", QoS::AtLeastOnce, true)
        .await;
    for filter in ["#", "+/x", "+/#"] {
        let mut sub = Client::connect(addr, ProtocolVersion::V5, "rd$-sub").await;
        sub.subscribe(filter, QoS::AtMostOnce).await;
        let mut topics = Vec::new();
        // Whatever else is retained (the broker's own $SYS is never matched here either).
        while let Ok(Some(mercurio::codec::Packet::Publish(p))) = sub.recv_within(SHORT).await {
            topics.push(p.topic);
        }
        assert_eq!(topics, vec!["app/x"], "filter {filter}");
        sub.disconnect().await;
    }
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "rd$-sub").await;
    sub.subscribe("$app/#", QoS::AtMostOnce).await;
    assert_eq!(sub.expect_publish().await.topic, "$app/x");
    broker.shutdown().await;
}

/// Retained messages sent at subscribe carry the subscription's identifier [MQTT-3.3.4-3].
#[tokio::test]
async fn retained_delivery_carries_the_subscription_identifier() {
    let (broker, addr) = start().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rsi-pub").await;
    publisher
        .publish("rsi/t", b"r", QoS::AtLeastOnce, true)
        .await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "rsi-sub").await;
    sub.subscribe_with(
        &[("rsi/#", handling(QoS::AtLeastOnce, 0))],
        Properties {
            subscription_identifiers: vec![7],
            ..Properties::default()
        },
    )
    .await;
    let p = sub.expect_publish().await;
    assert!(p.retain);
    assert_eq!(p.properties.subscription_identifiers, vec![7]);
    broker.shutdown().await;
}

/// Retained messages are matched on subscribe with the same rules as live messages
/// (section 4.7): `#` includes the parent level [MQTT-4.7.1-2], `+` matches empty levels,
/// `$` topics are not matched by leading wildcards [MQTT-4.7.2-1].
#[tokio::test]
async fn retained_matching_follows_the_wildcard_rules() {
    let (broker, addr) = start().await;
    let topics = [
        "rw", "rw/a", "rw/a/b", "rw//b", "rw/", "/rw", "RW/a", "$rw/a",
    ];
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rw-pub").await;
    for t in topics {
        publisher
            .publish(t, t.as_bytes(), QoS::AtLeastOnce, true)
            .await;
    }
    let cases: [(&str, &[&str]); 9] = [
        ("rw/#", &["rw", "rw/a", "rw/a/b", "rw//b", "rw/"]),
        ("rw/+", &["rw/a", "rw/"]),
        ("rw/+/b", &["rw/a/b", "rw//b"]),
        ("+/a", &["rw/a", "RW/a"]),
        ("+/+", &["rw/a", "rw/", "/rw", "RW/a"]),
        ("+", &["rw"]),
        ("/+", &["/rw"]),
        ("$rw/#", &["$rw/a"]),
        ("rw", &["rw"]),
    ];
    for (filter, expected) in cases {
        let mut sub = Client::connect(addr, ProtocolVersion::V5, "rw-sub").await;
        sub.subscribe_with(
            &[
                (filter, handling(QoS::AtMostOnce, 0)),
                ("rw-end", handling(QoS::AtMostOnce, 0)),
            ],
            Properties::default(),
        )
        .await;
        publisher
            .publish("rw-end", b"", QoS::AtLeastOnce, false)
            .await;
        let mut got = Vec::new();
        loop {
            let p = sub.expect_publish().await;
            if p.topic == "rw-end" {
                break;
            }
            assert!(p.retain);
            got.push(p.topic);
        }
        got.sort();
        let mut want: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(got, want, "filter {filter}");
        sub.disconnect().await;
    }
    broker.shutdown().await;
}

/// The retained topics under `filter` a new subscriber gets, sorted.
async fn retained_topics(addr: std::net::SocketAddr, filter: &str) -> Vec<String> {
    let mut c = Client::connect(addr, ProtocolVersion::V311, "retained-reader").await;
    c.subscribe(filter, QoS::AtMostOnce).await;
    let mut topics = Vec::new();
    while let Ok(Some(mercurio::codec::Packet::Publish(p))) = c.recv_within(SHORT).await {
        assert!(p.retain);
        topics.push(p.topic);
    }
    c.disconnect().await;
    topics.sort();
    topics
}

/// `max_retained_bytes` bounds the bytes of all retained messages (topic, payload and
/// properties of each). A retained PUBLISH that would go over it is still delivered to the
/// current subscribers but not kept, so a new subscriber does not get it; it is counted in
/// `$SYS` and logged once, not per message. Deleting a retained message [MQTT-3.3.1-6]
/// frees its bytes; a replacement that does not fit is not kept and takes the message it
/// replaced with it (no longer the topic's latest).
#[tokio::test]
async fn max_retained_bytes_bounds_the_retained_set() {
    let mut config = test_config();
    config.server.max_retained_bytes = 4096;
    config.server.sys_interval = 1;
    let (broker, addr) = start_with(config).await;
    let logs = capture_logs();
    let mut live = Client::connect(addr, ProtocolVersion::V311, "live").await;
    live.subscribe("big/#", QoS::AtMostOnce).await;
    let mut p = Client::connect(addr, ProtocolVersion::V311, "big-pub").await;
    // Each message: a 5-byte topic and a 1,500-byte payload (3.1.1: no properties).
    let payload = vec![b'x'; 1500];
    for topic in ["big/a", "big/b", "big/c", "big/d"] {
        p.publish(topic, &payload, QoS::AtLeastOnce, true).await;
        let got = live.expect_publish().await;
        assert_eq!(got.topic, topic, "delivered to the current subscriber");
        assert_eq!(got.payload.len(), 1500);
    }
    assert_eq!(broker.retained_count(), 2);
    assert_eq!(broker.retained_bytes(), 2 * 1505);
    assert_eq!(retained_topics(addr, "big/#").await, ["big/a", "big/b"]);
    assert_eq!(
        logs.matching(&["big-pub", "max_retained_bytes"]).len(),
        1,
        "logged once for two messages not kept: {:?}",
        logs.lines()
    );
    let mut sys = broker
        .subscribe(
            "$SYS/broker/retained messages/not kept/max_retained_bytes",
            QoS::AtMostOnce,
        )
        .expect("$SYS subscription");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let m = tokio::time::timeout_at(deadline, sys.recv())
            .await
            .expect("$SYS counter within the deadline")
            .expect("broker running");
        if &m.payload[..] == b"2" {
            break;
        }
    }

    // Deleting one makes room.
    p.publish("big/a", b"", QoS::AtLeastOnce, true).await;
    live.expect_publish().await;
    assert_eq!(broker.retained_bytes(), 1505);
    p.publish("big/c", &payload, QoS::AtLeastOnce, true).await;
    live.expect_publish().await;
    assert_eq!(retained_topics(addr, "big/#").await, ["big/b", "big/c"]);
    assert_eq!(broker.retained_bytes(), 2 * 1505);

    // Replacing with a smaller message frees the difference; with one that does not fit,
    // the topic keeps nothing.
    p.publish("big/b", b"small", QoS::AtLeastOnce, true).await;
    live.expect_publish().await;
    assert_eq!(broker.retained_bytes(), 1505 + 10);
    p.publish("big/c", &vec![b'y'; 4090], QoS::AtLeastOnce, true)
        .await;
    assert_eq!(live.expect_publish().await.payload.len(), 4090);
    assert_eq!(retained_topics(addr, "big/#").await, ["big/b"]);
    assert_eq!(broker.retained_bytes(), 10);
    broker.shutdown().await;
}
