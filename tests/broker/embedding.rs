//! The embedding API (docs/embedding.md): in-process publish and subscribe, disconnecting a
//! client, shutdown, and session queries, seen from MQTT clients.
use crate::common;

use std::time::Duration;

use common::*;
use mercurio::codec::{Properties, ProtocolVersion, QoS, ReasonCode};
use mercurio::message::Message;
use mercurio::Subscription;

const SHORT: Duration = Duration::from_millis(300);

async fn next(sub: &mut Subscription) -> std::sync::Arc<Message> {
    tokio::time::timeout(DEADLINE, sub.recv())
        .await
        .expect("a message before the deadline")
        .expect("the subscription is open")
}

/// `publish` reaches MQTT subscribers of every version, at the lower of the two QoS
/// [MQTT-3.8.4-6], with properties for 5.0 [MQTT-3.3.2-17].
#[tokio::test]
async fn handle_publish_reaches_mqtt_subscribers() {
    let (broker, addr) = start().await;
    let mut subs = Vec::new();
    for version in VERSIONS {
        let mut c = Client::connect(addr, version, &format!("emb-{}", version.level())).await;
        c.subscribe("emb/+", QoS::AtLeastOnce).await;
        subs.push(c);
    }
    broker
        .publish("emb/t", "from the app", QoS::ExactlyOnce, false)
        .await
        .unwrap();
    let props = Properties {
        user_properties: vec![("source".into(), "app".into())],
        content_type: Some("text/plain".into()),
        ..Properties::default()
    };
    broker
        .publish_with(
            "emb/p",
            "with props",
            QoS::AtMostOnce,
            false,
            props.clone(),
            Some(60),
        )
        .await
        .unwrap();
    for c in &mut subs {
        let p = c.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..]),
            ("emb/t", &b"from the app"[..])
        );
        assert_eq!(p.qos, QoS::AtLeastOnce);
        c.ack(&p).await;
        let p = c.expect_publish().await;
        assert_eq!(p.topic, "emb/p");
        if c.version.is_v5() {
            assert_eq!(p.properties.user_properties, props.user_properties);
            assert_eq!(p.properties.content_type, props.content_type);
            assert!(p
                .properties
                .message_expiry_interval
                .is_some_and(|s| s <= 60));
        }
    }
    broker.shutdown().await;
}

/// `publish` refuses invalid topic names and `$SYS` (MQTT 5.0 section 4.7.2).
#[tokio::test]
async fn handle_publish_refuses_bad_topics() {
    let (broker, _addr) = start().await;
    assert!(broker
        .publish("a/+", "x", QoS::AtMostOnce, false)
        .await
        .is_err());
    assert!(broker
        .publish("a/#", "x", QoS::AtMostOnce, false)
        .await
        .is_err());
    assert!(broker
        .publish("", "x", QoS::AtMostOnce, false)
        .await
        .is_err());
    assert!(broker
        .publish("$SYS/x", "x", QoS::AtMostOnce, false)
        .await
        .is_err());
    assert!(broker.subscribe("a/#/b", QoS::AtMostOnce).is_err());
    broker.shutdown().await;
}

/// `subscribe` receives the retained messages first, then MQTT publishes matching the
/// filter, with their properties; the retained message is the latest one [MQTT-3.3.1-5].
#[tokio::test]
async fn handle_subscribe_receives_retained_then_live() {
    let (broker, addr) = start().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "emb-pub").await;
    publisher
        .publish("in/r", b"old", QoS::AtLeastOnce, true)
        .await;
    publisher
        .publish("in/r", b"retained", QoS::AtLeastOnce, true)
        .await;
    let mut sub = broker.subscribe("in/#", QoS::AtLeastOnce).unwrap();
    let m = next(&mut sub).await;
    assert_eq!(
        (m.topic.as_str(), &m.payload[..]),
        ("in/r", &b"retained"[..])
    );
    let props = Properties {
        user_properties: vec![("k".into(), "v".into())],
        ..Properties::default()
    };
    for v in VERSIONS {
        let mut c = Client::connect(addr, v, "emb-v").await;
        c.publish_with("in/live", b"live", QoS::AtLeastOnce, false, props.clone())
            .await;
        let m = next(&mut sub).await;
        assert_eq!(
            (m.topic.as_str(), &m.payload[..]),
            ("in/live", &b"live"[..])
        );
        if v.is_v5() {
            assert_eq!(m.properties.user_properties, props.user_properties);
        }
        c.disconnect().await;
    }
    publisher
        .publish("other/t", b"no", QoS::AtLeastOnce, false)
        .await;
    publisher
        .publish("in/end", b"end", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(
        next(&mut sub).await.topic,
        "in/end",
        "other/t does not match"
    );
    broker.shutdown().await;
}

/// Dropping a Subscription unsubscribes it: with a one-message queue, messages published
/// afterwards would overflow a forgotten subscription's queue and count as dropped.
#[tokio::test]
async fn dropping_the_subscription_unsubscribes() {
    let mut config = test_config();
    config.server.max_queued_messages = 1;
    let (broker, addr) = start_with(config).await;
    let mut mqtt = Client::connect(addr, ProtocolVersion::V5, "emb-drop").await;
    mqtt.subscribe("drop/t", QoS::AtLeastOnce).await;
    let sub = broker.subscribe("drop/t", QoS::AtLeastOnce).unwrap();
    drop(sub);
    for i in 0..5u8 {
        broker
            .publish("drop/t", vec![i], QoS::AtLeastOnce, false)
            .await
            .unwrap();
        let p = mqtt.expect_publish().await;
        mqtt.ack(&p).await;
    }
    assert_eq!(broker.stats().dropped_total(), 0);

    // The control: a subscription that is kept but never read does overflow.
    let _kept = broker.subscribe("drop/t", QoS::AtLeastOnce).unwrap();
    for i in 0..100u8 {
        broker
            .publish("drop/t", vec![i], QoS::AtLeastOnce, false)
            .await
            .unwrap();
        let p = mqtt.expect_publish().await;
        mqtt.ack(&p).await;
    }
    assert!(broker.stats().dropped_total() > 0);
    broker.shutdown().await;
}

/// `disconnect` closes a client's connection: 5.0 clients get DISCONNECT 0x98
/// (Administrative action) (5.0 section 3.14.2.1), 3.x clients are closed; an unknown client
/// gives false. The will is published (the connection did not end with DISCONNECT)
/// [MQTT-3.1.2-8].
#[tokio::test]
async fn handle_disconnect_closes_a_client() {
    let (broker, addr) = start().await;
    let mut watcher = Client::connect(addr, ProtocolVersion::V5, "emb-watch").await;
    watcher.subscribe("kick/will", QoS::AtLeastOnce).await;
    for version in VERSIONS {
        let mut connect = connect_packet(version, "kicked");
        connect.will = Some(will("kick/will", "kicked", QoS::AtLeastOnce, false));
        let (mut c, _) = Client::connect_with(addr, connect).await;
        assert!(broker.disconnect("kicked"));
        let rc = c.expect_disconnect().await;
        if version.is_v5() {
            assert_eq!(rc, Some(ReasonCode::ADMINISTRATIVE_ACTION));
        } else {
            assert_eq!(rc, None);
        }
        let p = watcher.expect_publish().await;
        assert_eq!(&p.payload[..], b"kicked");
        watcher.ack(&p).await;
    }
    assert!(!broker.disconnect("nobody"));
    broker.shutdown().await;
}

/// `shutdown` sends DISCONNECT 0x8B (Server shutting down) to 5.0 clients and closes 3.x
/// clients (5.0 section 3.14.2.1); afterwards no new connection is served.
#[tokio::test]
async fn handle_shutdown_disconnects_everyone() {
    let (broker, addr) = start().await;
    let mut clients = Vec::new();
    for version in VERSIONS {
        clients.push(Client::connect(addr, version, &format!("sd-{}", version.level())).await);
    }
    let (mut persistent, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "sd-p").await;
    let stopper = broker.clone();
    let stopped = tokio::spawn(async move { stopper.shutdown().await });
    for c in &mut clients {
        let rc = c.expect_disconnect().await;
        if c.version.is_v5() {
            assert_eq!(rc, Some(ReasonCode::SERVER_SHUTTING_DOWN));
        } else {
            assert_eq!(rc, None);
        }
    }
    assert_eq!(
        persistent.expect_disconnect().await,
        Some(ReasonCode::SERVER_SHUTTING_DOWN)
    );
    tokio::time::timeout(DEADLINE, stopped)
        .await
        .expect("shutdown returns once every connection closed")
        .unwrap();
    // No CONNACK for a new connection after shutdown.
    if let Ok(stream) = tokio::net::TcpStream::connect(addr).await {
        drop(stream);
        let mut c = Client::open(addr, ProtocolVersion::V5).await;
        c.send(mercurio::codec::Packet::Connect(Box::new(connect_packet(
            ProtocolVersion::V5,
            "late",
        ))))
        .await;
        let seen = c.expect_closed().await;
        assert!(
            seen.iter().all(|p| !matches!(p, mercurio::codec::Packet::ConnAck(a) if a.reason_code == ReasonCode::SUCCESS)),
            "{seen:?}"
        );
    }
}

/// `sessions` reports each session: client identifier, connected or not, protocol level,
/// subscriptions, queued and in-flight messages; in-process subscriptions are not listed.
#[tokio::test]
async fn handle_sessions_reports() {
    let (broker, addr) = start().await;
    let _internal = broker.subscribe("rep/#", QoS::AtMostOnce).unwrap();
    let (mut away, _) = Client::connect_persistent(addr, ProtocolVersion::V311, "rep-away").await;
    away.subscribe("rep/a", QoS::AtLeastOnce).await;
    away.subscribe("rep/b", QoS::AtLeastOnce).await;
    away.disconnect().await;
    let mut here = Client::connect(addr, ProtocolVersion::V5, "rep-here").await;
    here.subscribe("rep/a", QoS::AtLeastOnce).await;
    // Wait (polling with a deadline) for the first client's session to be detached.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while broker
        .sessions()
        .iter()
        .any(|s| s.client_id == "rep-away" && s.connected)
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "rep-pub").await;
    publisher
        .publish("rep/a", b"1", QoS::AtLeastOnce, false)
        .await;
    publisher
        .publish("rep/a", b"2", QoS::AtLeastOnce, false)
        .await;
    publisher.disconnect().await;
    // Two unacknowledged deliveries to `here` prove the routing is done.
    let _p1 = here.expect_publish().await;
    let _p2 = here.expect_publish().await;
    here.expect_nothing(SHORT).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while broker.sessions().iter().any(|s| s.client_id == "rep-pub") {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut sessions = broker.sessions();
    sessions.sort_by(|a, b| a.client_id.cmp(&b.client_id));
    assert_eq!(sessions.len(), 2, "{sessions:?}");
    let away = &sessions[0];
    assert_eq!(away.client_id, "rep-away");
    assert!(!away.connected);
    assert_eq!(away.protocol_level, 4);
    assert_eq!(away.subscriptions, 2);
    assert_eq!(away.queued, 2);
    assert_eq!(away.inflight, 0);
    let here_info = &sessions[1];
    assert_eq!(here_info.client_id, "rep-here");
    assert!(here_info.connected);
    assert_eq!(here_info.protocol_level, 5);
    assert_eq!(here_info.subscriptions, 1);
    assert_eq!(here_info.inflight, 2);
    broker.shutdown().await;
}

/// An in-process subscription ends (`recv` gives `None`) once the broker has shut down, as
/// `Subscription::recv` documents, after delivering what it already held.
#[tokio::test]
async fn subscription_ends_after_shutdown() {
    let (broker, _addr) = start().await;
    let mut sub = broker.subscribe("end/#", QoS::AtMostOnce).unwrap();
    broker
        .publish("end/t", "last", QoS::AtMostOnce, false)
        .await
        .unwrap();
    assert_eq!(&next(&mut sub).await.payload[..], b"last");
    broker.shutdown().await;
    let end = tokio::time::timeout(DEADLINE, sub.recv())
        .await
        .expect("recv returns once the broker has stopped");
    assert!(end.is_none());
    assert!(broker.subscribe("end/#", QoS::AtMostOnce).is_err());
}

/// An MQTT client cannot take over the session behind an in-process subscription by using
/// its internal client identifier: it gets a CONNACK (refusing it) without hanging, and the
/// in-process subscription keeps working [MQTT-3.1.3-5] (the server may refuse identifiers).
#[tokio::test]
async fn internal_client_ids_cannot_be_taken_over() {
    let (broker, addr) = start().await;
    let mut sub = broker.subscribe("int/#", QoS::AtMostOnce).unwrap();
    for n in 0..4 {
        let id = format!("$internal/{n}");
        let (mut c, ack) =
            Client::connect_with(addr, connect_packet(ProtocolVersion::V5, &id)).await;
        assert_eq!(
            ack.reason_code,
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID,
            "{id}"
        );
        c.expect_closed().await;
    }
    // Nor can `disconnect` reach them: they are not clients.
    for n in 0..4 {
        assert!(
            !broker.disconnect(&format!("$internal/{n}")),
            "$internal/{n}"
        );
    }
    broker
        .publish("int/t", "still", QoS::AtMostOnce, false)
        .await
        .unwrap();
    assert_eq!(&next(&mut sub).await.payload[..], b"still");
    broker.shutdown().await;
}
