//! `$SYS/broker/...` statistics (docs/operations.md, "$SYS").
use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use mercurio::codec::{Packet, ProtocolVersion, QoS, ReasonCode};

/// Every topic the broker publishes, as mosquitto names them.
const TOPICS: &[&str] = &[
    "version",
    "uptime",
    "clients/connected",
    "clients/disconnected",
    "clients/total",
    "clients/maximum",
    "clients/expired",
    "messages/received",
    "messages/sent",
    "bytes/received",
    "bytes/sent",
    "retained messages/count",
    "subscriptions/count",
    "publish/messages/dropped",
    "publish/messages/dropped/queue_full_qos0",
    "publish/messages/dropped/queue_full",
    "publish/messages/dropped/expired",
    "publish/messages/dropped/too_large",
    "publish/messages/dropped/not_authorized",
    "publish/messages/dropped/no_share_member",
    "publish/messages/dropped/memory_full",
    "queued messages/bytes",
    "storage/batches/retried",
    "storage/batches/dropped",
    "storage/clients/dirty",
    "storage/sessions/set aside",
    "load/messages/received/1min",
    "load/messages/received/5min",
    "load/messages/received/15min",
    "load/messages/sent/1min",
    "load/bytes/received/1min",
    "load/bytes/sent/15min",
    "load/connections/5min",
];

/// Collects `$SYS/broker/<name>` values until `done` holds for them.
async fn collect_until(
    c: &mut Client,
    done: impl Fn(&HashMap<String, String>) -> bool,
) -> HashMap<String, String> {
    let mut seen = HashMap::new();
    while !done(&seen) {
        let p = c.expect_publish().await;
        assert!(
            p.retain || !seen.is_empty() || p.topic.starts_with("$SYS/"),
            "{p:?}"
        );
        let name = p
            .topic
            .strip_prefix("$SYS/broker/")
            .expect("a $SYS/broker topic")
            .to_string();
        seen.insert(
            name,
            String::from_utf8(p.payload.to_vec()).expect("UTF-8 value"),
        );
    }
    seen
}

/// A subscriber to `$SYS/broker/#` gets every topic of the table at once (retained), and the
/// counts follow known traffic within one sys_interval.
#[tokio::test]
async fn sys_topics_report_known_traffic() {
    let mut config = test_config();
    config.server.sys_interval = 1;
    let (broker, addr) = start_with(config).await;

    let mut sys = Client::connect(addr, ProtocolVersion::V311, "sys-watcher").await;
    assert_eq!(
        sys.subscribe("$SYS/broker/#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    let first = collect_until(&mut sys, |s| TOPICS.iter().all(|t| s.contains_key(*t))).await;
    assert!(
        first["version"].starts_with("mercurio version "),
        "{:?}",
        first["version"]
    );
    assert!(first["uptime"].ends_with(" seconds"));

    // Known traffic: a retained message, 3 publishes, one more subscription.
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "sys-publisher").await;
    assert_eq!(
        publisher.subscribe("sys/test", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    publisher
        .publish("sys/retained", b"kept", QoS::AtLeastOnce, true)
        .await;
    for _ in 0..3 {
        publisher
            .publish("sys/test", b"x", QoS::AtMostOnce, false)
            .await;
        publisher.expect_publish().await;
    }
    let now = collect_until(&mut sys, |s| {
        s.get("messages/received").is_some_and(|v| v == "4")
            && s.get("clients/connected").is_some_and(|v| v == "2")
            && s.get("retained messages/count").is_some_and(|v| v == "1")
            && s.get("subscriptions/count").is_some_and(|v| v == "2")
    })
    .await;
    assert!(now.get("clients/total").is_none_or(|v| v == "2"), "{now:?}");
    broker.shutdown().await;
}

/// Wildcards at the start of a filter do not match `$SYS` topics [MQTT-4.7.2-1], and clients
/// cannot publish to them.
#[tokio::test]
async fn sys_topics_hidden_from_leading_wildcards_and_not_publishable() {
    let mut config = test_config();
    config.server.sys_interval = 1;
    let (broker, addr) = start_with(config).await;
    let mut all = Client::connect(addr, ProtocolVersion::V5, "sys-all").await;
    all.subscribe("#", QoS::AtMostOnce).await;
    all.subscribe("+/broker/#", QoS::AtMostOnce).await;
    let mut sys = Client::connect(addr, ProtocolVersion::V5, "sys-sub").await;
    sys.subscribe("$SYS/broker/uptime", QoS::AtMostOnce).await;
    sys.expect_publish().await;

    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "sys-pub").await;
    let rc = publisher
        .publish("$SYS/broker/uptime", b"forged", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(rc, ReasonCode::NOT_AUTHORIZED);
    publisher
        .publish("visible", b"1", QoS::AtMostOnce, false)
        .await;
    // The next thing `all` sees is the ordinary message: no $SYS update got through.
    let p = all.expect_publish().await;
    assert_eq!(p.topic, "visible");
    // The forged value never reached the $SYS subscriber: the next update is the broker's.
    let p = sys.expect_publish().await;
    assert!(p.payload.ends_with(b" seconds"), "{p:?}");
    match all.recv_within(Duration::from_millis(1500)).await {
        Err(()) => {}
        Ok(Some(Packet::Publish(p))) => panic!("a leading wildcard matched {:?}", p.topic),
        Ok(other) => panic!("unexpected {other:?}"),
    }
    broker.shutdown().await;
}

/// `sys_interval = 0` turns `$SYS` off, as in mosquitto: a subscriber to `$SYS/#` gets nothing,
/// neither at subscription (no retained values) nor later, while ordinary messages flow.
#[tokio::test]
async fn sys_interval_0_turns_sys_off() {
    let mut config = test_config();
    config.server.sys_interval = 0;
    let (broker, addr) = start_with(config).await;
    let mut sys = Client::connect(addr, ProtocolVersion::V311, "sys-off").await;
    assert_eq!(
        sys.subscribe("$SYS/#", QoS::AtMostOnce).await,
        ReasonCode(0)
    );
    sys.subscribe("plain/t", QoS::AtMostOnce).await;
    let mut publ = Client::connect(addr, ProtocolVersion::V311, "sys-off-pub").await;
    publ.publish("plain/t", b"x", QoS::AtLeastOnce, false).await;
    let p = sys.expect_publish().await;
    assert_eq!(p.topic, "plain/t", "no $SYS before the ordinary message");
    sys.expect_nothing(Duration::from_millis(1500)).await;
    broker.shutdown().await;
}
