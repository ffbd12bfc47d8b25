//! Topic names and filters: wildcard matching, `$` topics, `$SYS`, and invalid names and
//! filters (MQTT 3.1.1 and 5.0 section 4.7).
use crate::common;

use std::time::Duration;

use common::*;
use mercurio::codec::{Properties, ProtocolVersion, QoS, ReasonCode};

const SHORT: Duration = Duration::from_millis(300);

/// Subscribes `filter` on a fresh client, publishes each topic from another, and returns the
/// topics received. The last topic published is `end/<n>`, which every test filter lists
/// through a second subscription, so the run ends on a positive event.
async fn received(addr: std::net::SocketAddr, filter: &str, topics: &[&str]) -> Vec<String> {
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "match-sub").await;
    let codes = sub
        .subscribe_with(
            &[
                (filter, opts(QoS::AtLeastOnce)),
                ("end/marker", opts(QoS::AtLeastOnce)),
            ],
            Properties::default(),
        )
        .await;
    assert!(!codes[0].is_failure(), "{filter}: {codes:?}");
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "match-pub").await;
    for t in topics {
        publisher.publish(t, b"x", QoS::AtLeastOnce, false).await;
    }
    publisher
        .publish("end/marker", b"end", QoS::AtLeastOnce, false)
        .await;
    let mut got = Vec::new();
    loop {
        let p = sub.expect_publish().await;
        sub.ack(&p).await;
        if p.topic == "end/marker" {
            break;
        }
        got.push(p.topic);
    }
    sub.disconnect().await;
    publisher.disconnect().await;
    got
}

/// `+` matches exactly one level, `#` any number of levels including the parent level, and
/// matching is case sensitive, with empty levels significant [MQTT-4.7.1-1] [MQTT-4.7.1-2]
/// [MQTT-4.7.1-3] [MQTT-4.7.3-1..4] (section 4.7.1).
#[tokio::test]
async fn wildcards_match_as_specified() {
    let (broker, addr) = start().await;
    let topics = [
        "sport/tennis/player1",
        "sport/tennis/player1/ranking",
        "sport/tennis",
        "sport",
        "Sport/tennis/player1",
        "sport//player1",
        "/sport",
    ];
    let cases: [(&str, &[&str]); 8] = [
        (
            "sport/tennis/player1/#",
            &["sport/tennis/player1", "sport/tennis/player1/ranking"],
        ),
        (
            "sport/#",
            &[
                "sport/tennis/player1",
                "sport/tennis/player1/ranking",
                "sport/tennis",
                "sport",
                "sport//player1",
            ],
        ),
        ("sport/+", &["sport/tennis"]),
        (
            "sport/+/player1",
            &["sport/tennis/player1", "sport//player1"],
        ),
        ("+/+", &["sport/tennis", "/sport"]),
        ("+", &["sport"]),
        ("/+", &["/sport"]),
        ("#", &topics),
    ];
    for (filter, expected) in cases {
        let mut got = received(addr, filter, &topics).await;
        let mut want: Vec<String> = expected.iter().map(|s| s.to_string()).collect();
        if filter == "#" || filter == "+/+" {
            // These also match the end marker's own level structure; drop nothing else.
            got.retain(|t| t != "end/marker");
        }
        got.sort();
        want.sort();
        assert_eq!(got, want, "filter {filter}");
    }
    broker.shutdown().await;
}

/// Topics starting with `$` are not matched by filters starting with a wildcard
/// [MQTT-4.7.2-1]; a filter naming the `$` level matches them.
#[tokio::test]
async fn dollar_topics_not_matched_by_leading_wildcards() {
    let (broker, addr) = start().await;
    let topics = ["$dollar/x", "$dollar", "plain/x"];
    let mut got = received(addr, "#", &topics).await;
    got.retain(|t| t != "end/marker");
    assert_eq!(got, vec!["plain/x"]);
    assert_eq!(received(addr, "+/x", &topics).await, vec!["plain/x"]);
    assert_eq!(received(addr, "+", &topics).await, Vec::<String>::new());
    assert_eq!(
        received(addr, "$dollar/#", &topics).await,
        vec!["$dollar/x", "$dollar"]
    );
    assert_eq!(
        received(addr, "$dollar/+", &topics).await,
        vec!["$dollar/x"]
    );
    broker.shutdown().await;
}

/// Clients cannot publish to `$SYS/...` (MQTT 5.0 section 4.7.2 reserves
/// `$` topics for the server): a 5.0 PUBACK says 0x87 (Not authorized), 3.1.1 gets a plain
/// PUBACK, and the message is delivered to nobody.
#[tokio::test]
async fn sys_publishes_are_refused() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut sub = Client::connect(addr, version, "sys-sub").await;
        sub.subscribe("$SYS/test/#", QoS::AtLeastOnce).await;
        sub.subscribe("ok/t", QoS::AtLeastOnce).await;
        let mut publisher = Client::connect(addr, version, "sys-pub").await;
        let rc = publisher
            .publish("$SYS/test/fake", b"no", QoS::AtLeastOnce, false)
            .await;
        if version.is_v5() {
            assert_eq!(rc, ReasonCode::NOT_AUTHORIZED);
        }
        publisher
            .publish("$SYS/test/fake", b"no", QoS::ExactlyOnce, true)
            .await;
        publisher
            .publish("ok/t", b"yes", QoS::AtLeastOnce, false)
            .await;
        let p = sub.expect_publish().await;
        assert_eq!(p.topic, "ok/t");
        sub.ack(&p).await;
        sub.expect_nothing(SHORT).await;
        publisher.ping().await;
        sub.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}

/// Invalid topic filters in SUBSCRIBE fail that filter only: `#` not last or not alone in its
/// level [MQTT-4.7.1-2], `+` not alone in its level [MQTT-4.7.1-3], empty filter
/// [MQTT-4.7.3-1]; 5.0 gets 0x8F, 3.1.1 0x80 [MQTT-3.8.4-5] [MQTT-3.9.3-1].
#[tokio::test]
async fn invalid_filters_are_refused_per_filter() {
    let (broker, addr) = start().await;
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, "inv").await;
        let bad = ["a/#/b", "a#", "a/b#", "+a", "a/+b/c", "#/"];
        let filters: Vec<(&str, _)> = bad
            .iter()
            .map(|f| (*f, opts(QoS::AtMostOnce)))
            .chain([("fine/+/#", opts(QoS::AtMostOnce))])
            .collect();
        let codes = c.subscribe_with(&filters, Properties::default()).await;
        let fail = if version.is_v5() {
            ReasonCode::TOPIC_FILTER_INVALID
        } else {
            ReasonCode(0x80)
        };
        let mut want = vec![fail; bad.len()];
        want.push(ReasonCode::GRANTED_QOS_0);
        assert_eq!(codes, want, "{version:?}");
        c.ping().await;
        c.disconnect().await;
    }
    broker.shutdown().await;
}

/// A topic name with a wildcard character in PUBLISH is refused: the connection is closed
/// [MQTT-3.3.2-2] (5.0: DISCONNECT 0x82 Protocol Error, data the protocol does not allow in a
/// packet that parses, section 1.2; mosquitto's code too), and nobody receives it.
#[tokio::test]
async fn publish_topic_with_wildcard_is_refused() {
    let (broker, addr) = start().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "wc-sub").await;
    sub.subscribe("#", QoS::AtMostOnce).await;
    for version in VERSIONS {
        for topic in ["wc/+", "wc/#"] {
            let mut c = Client::connect(addr, version, "wc-pub").await;
            c.send(publish_packet(
                topic,
                b"x",
                QoS::AtMostOnce,
                false,
                0,
                Properties::default(),
            ))
            .await;
            let rc = c.expect_disconnect().await;
            if version.is_v5() {
                assert_eq!(rc, Some(ReasonCode::PROTOCOL_ERROR), "{topic}");
            }
        }
    }
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "wc-ok").await;
    publisher
        .publish("wc/ok", b"x", QoS::AtMostOnce, false)
        .await;
    assert_eq!(sub.expect_publish().await.topic, "wc/ok");
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// The `$` rule holds inside shared subscriptions too: `$share/g/#` and `$share/g/+/x` do
/// not match `$` topics [MQTT-4.7.2-1].
#[tokio::test]
async fn dollar_topics_not_matched_by_shared_leading_wildcards() {
    let (broker, addr) = start().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "shd-sub").await;
    sub.subscribe("$share/g/#", QoS::AtMostOnce).await;
    sub.subscribe("$share/h/+/x", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "shd-pub").await;
    publisher
        .publish("$d/x", b"no", QoS::AtMostOnce, false)
        .await;
    publisher
        .publish("d/x", b"yes", QoS::AtMostOnce, false)
        .await;
    // One delivery per matching shared group: `#` and `+/x`.
    for _ in 0..2 {
        let p = sub.expect_publish().await;
        assert_eq!(p.topic, "d/x");
    }
    sub.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// Topic alias mappings last one network connection only [MQTT-3.3.2-7]: after a reconnect
/// an alias set before is unknown, a Protocol Error (DISCONNECT 0x82).
#[tokio::test]
async fn topic_aliases_do_not_survive_a_reconnect() {
    let (broker, addr) = start().await;
    let alias = Properties {
        topic_alias: Some(1),
        ..Properties::default()
    };
    let (mut c, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "ta-re").await;
    c.publish_with("ta/re", b"1", QoS::AtLeastOnce, false, alias.clone())
        .await;
    c.publish_with("", b"2", QoS::AtLeastOnce, false, alias.clone())
        .await;
    c.disconnect().await;
    let (mut c, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "ta-re").await;
    c.send(publish_packet("", b"3", QoS::AtMostOnce, false, 0, alias))
        .await;
    c.expect_violation(ReasonCode::PROTOCOL_ERROR).await;
    broker.shutdown().await;
}
