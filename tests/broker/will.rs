//! Will messages: published on an abnormal close, not after a normal DISCONNECT, Will Delay
//! Interval, will retain (MQTT 3.1.1 section 3.1.2.5, MQTT 5.0 sections 3.1.2.5, 3.1.3.2).
use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use mercurio::codec::{Disconnect, Packet, Properties, ProtocolVersion, QoS, ReasonCode};

const SHORT: Duration = Duration::from_millis(300);

/// Connects `id` with a will on `topic`, a will delay and a session expiry (5.0 only).
async fn with_will(
    addr: SocketAddr,
    version: ProtocolVersion,
    id: &str,
    topic: &str,
    retain: bool,
    delay: Option<u32>,
    session_expiry: Option<u32>,
) -> Client {
    let mut connect = connect_packet(version, id);
    let mut w = will(topic, &format!("will of {id}"), QoS::AtLeastOnce, retain);
    w.properties.will_delay_interval = delay;
    connect.will = Some(w);
    connect.properties.session_expiry_interval = session_expiry;
    if session_expiry.is_some() {
        connect.clean_start = false;
    }
    let (c, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    c
}

async fn watcher(addr: SocketAddr, filter: &str) -> Client {
    let mut w = Client::connect(addr, ProtocolVersion::V5, "will-watcher").await;
    w.subscribe(filter, QoS::AtLeastOnce).await;
    w
}

/// Closing the network connection without DISCONNECT publishes the will [MQTT-3.1.2-8], with
/// its topic, payload and QoS.
#[tokio::test]
async fn will_published_on_socket_drop() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/drop/+").await;
    for version in VERSIONS {
        let topic = format!("will/drop/{}", version.level());
        let c = with_will(addr, version, "dropper", &topic, false, None, None).await;
        c.drop_connection().await;
        let p = w.expect_publish().await;
        assert_eq!(p.topic, topic);
        assert_eq!(&p.payload[..], b"will of dropper");
        assert_eq!(p.qos, QoS::AtLeastOnce);
        assert!(!p.retain);
        w.ack(&p).await;
    }
    broker.shutdown().await;
}

/// DISCONNECT with reason code 0x04 (Disconnect with Will Message) publishes the will (MQTT
/// 5.0 section 3.14.2.1); a normal DISCONNECT discards it [MQTT-3.1.2-10] [MQTT-3.14.4-3].
#[tokio::test]
async fn will_on_disconnect_0x04_not_on_normal_disconnect() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/dc/+").await;
    for version in VERSIONS {
        let c = with_will(addr, version, "normal", "will/dc/normal", false, None, None).await;
        c.disconnect().await;
    }
    let mut c = with_will(
        addr,
        ProtocolVersion::V5,
        "with-will",
        "will/dc/0x04",
        false,
        None,
        None,
    )
    .await;
    c.send(Packet::Disconnect(Disconnect {
        reason_code: ReasonCode::DISCONNECT_WITH_WILL_MESSAGE,
        properties: Properties::default(),
    }))
    .await;
    let p = w.expect_publish().await;
    assert_eq!(
        p.topic, "will/dc/0x04",
        "the normal DISCONNECTs published nothing"
    );
    w.ack(&p).await;
    w.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// A protocol violation by the client closes the connection and publishes the will
/// (3.1.1 section 3.1.2.5: "the Server closes the Network Connection because of a protocol
/// error") [MQTT-3.1.2-8].
#[tokio::test]
async fn will_published_after_protocol_error() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/err/+").await;
    for version in VERSIONS {
        let topic = format!("will/err/{}", version.level());
        let mut c = with_will(addr, version, "bad", &topic, false, None, None).await;
        c.send(Packet::Connect(Box::new(connect_packet(version, "bad"))))
            .await;
        c.expect_closed().await;
        let p = w.expect_publish().await;
        assert_eq!(p.topic, topic);
        w.ack(&p).await;
    }
    broker.shutdown().await;
}

/// The Will Delay Interval delays the will [MQTT-3.1.3-9] (5.0 section 3.1.3.2.2).
#[tokio::test]
async fn will_delay_interval_delays_the_will() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/delay").await;
    let c = with_will(
        addr,
        ProtocolVersion::V5,
        "delayed",
        "will/delay",
        false,
        Some(2),
        Some(60),
    )
    .await;
    let dropped = Instant::now();
    c.drop_connection().await;
    let p = w.expect_publish().await;
    let waited = dropped.elapsed();
    assert_eq!(p.topic, "will/delay");
    assert!(
        waited >= Duration::from_millis(1800),
        "published after {waited:?}"
    );
    broker.shutdown().await;
}

/// A new connection for the session before the Will Delay Interval has passed cancels the
/// will [MQTT-3.1.3-9] (5.0 section 3.1.2.5).
#[tokio::test]
async fn reconnecting_within_the_delay_cancels_the_will() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/cancel/+").await;
    let back = with_will(
        addr,
        ProtocolVersion::V5,
        "comes-back",
        "will/cancel/back",
        false,
        Some(1),
        Some(60),
    )
    .await;
    let gone = with_will(
        addr,
        ProtocolVersion::V5,
        "stays-away",
        "will/cancel/gone",
        false,
        Some(1),
        Some(60),
    )
    .await;
    back.drop_connection().await;
    gone.drop_connection().await;
    let (mut again, present) =
        Client::connect_persistent(addr, ProtocolVersion::V5, "comes-back").await;
    assert!(present);
    // The other client's will, armed at the same time with the same delay, proves the delay
    // has passed.
    let p = w.expect_publish().await;
    assert_eq!(p.topic, "will/cancel/gone");
    w.ack(&p).await;
    w.expect_nothing(SHORT).await;
    again.ping().await;
    broker.shutdown().await;
}

/// When the session ends before the Will Delay Interval passes, the will is published then
/// [MQTT-3.1.3-9] ("whichever happens first"; 5.0 section 3.1.2.5).
#[tokio::test]
async fn session_ending_before_the_delay_publishes_the_will() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/expiry").await;
    let c = with_will(
        addr,
        ProtocolVersion::V5,
        "short-session",
        "will/expiry",
        false,
        Some(3600),
        Some(1),
    )
    .await;
    c.drop_connection().await;
    let p = w.expect_publish().await;
    assert_eq!(p.topic, "will/expiry");
    w.ack(&p).await;

    // Session Expiry 0 with a Will Delay: the session ends at once, so does the delay.
    let mut connect = connect_packet(ProtocolVersion::V5, "no-session");
    let mut wl = will("will/expiry", "now", QoS::AtLeastOnce, false);
    wl.properties.will_delay_interval = Some(3600);
    connect.will = Some(wl);
    let (c, _) = Client::connect_with(addr, connect).await;
    c.drop_connection().await;
    let p = w.expect_publish().await;
    assert_eq!(&p.payload[..], b"now");
    broker.shutdown().await;
}

/// A will with Will Retain 1 is published as a retained message [MQTT-3.1.2-17] (3.1.1) /
/// [MQTT-3.1.2-15] (5.0); with Will Retain 0 it is not retained [MQTT-3.1.2-16] (3.1.1) /
/// [MQTT-3.1.2-14] (5.0).
#[tokio::test]
async fn will_retain_flag_is_stored() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/ret/+").await;
    for version in VERSIONS {
        let kept = with_will(
            addr,
            version,
            "ret-1",
            &format!("will/ret/{}", version.level()),
            true,
            None,
            None,
        )
        .await;
        let not_kept = with_will(addr, version, "ret-0", "will/ret/not", false, None, None).await;
        kept.drop_connection().await;
        not_kept.drop_connection().await;
        for _ in 0..2 {
            let p = w.expect_publish().await;
            w.ack(&p).await;
        }
    }
    let mut late = Client::connect(addr, ProtocolVersion::V5, "late").await;
    late.subscribe("will/ret/+", QoS::AtLeastOnce).await;
    let mut topics = Vec::new();
    for _ in 0..3 {
        let p = late.expect_publish().await;
        assert!(p.retain);
        late.ack(&p).await;
        topics.push(p.topic);
    }
    topics.sort();
    assert_eq!(topics, vec!["will/ret/3", "will/ret/4", "will/ret/5"]);
    late.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// Will properties (User Property, Content Type, Response Topic, Correlation Data, Payload
/// Format Indicator) are sent with the will (5.0 section 3.1.3.2) [MQTT-3.1.3-10].
#[tokio::test]
async fn will_properties_are_forwarded() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/props").await;
    let mut connect = connect_packet(ProtocolVersion::V5, "wp");
    let mut wl = will("will/props", "bye", QoS::AtLeastOnce, false);
    wl.properties = Properties {
        payload_format_indicator: Some(1),
        content_type: Some("text/plain".into()),
        response_topic: Some("will/reply".into()),
        correlation_data: Some(bytes::Bytes::from_static(b"cd")),
        user_properties: vec![("z".into(), "1".into()), ("a".into(), "2".into())],
        ..Properties::default()
    };
    let expected = wl.properties.clone();
    connect.will = Some(wl);
    let (c, _) = Client::connect_with(addr, connect).await;
    c.drop_connection().await;
    let p = w.expect_publish().await;
    assert_eq!(p.properties, expected);
    broker.shutdown().await;
}

/// The will's Message Expiry Interval is its lifetime from when it is published, sent as the
/// Message Expiry Interval of the PUBLISH (5.0 section 3.1.3.2.4) [MQTT-3.3.2-6]: a connection
/// lasting longer than that interval still leaves a live will.
#[tokio::test]
async fn will_message_expiry_counts_from_publication() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/exp").await;
    let mut connect = connect_packet(ProtocolVersion::V5, "will-exp");
    let mut wl = will("will/exp", "late", QoS::AtLeastOnce, true);
    wl.properties.message_expiry_interval = Some(1);
    connect.will = Some(wl);
    let (c, _) = Client::connect_with(addr, connect).await;
    // The connection outlives the will's expiry interval (waiting for time itself).
    tokio::time::sleep(Duration::from_millis(1600)).await;
    c.drop_connection().await;
    let p = w.expect_publish().await;
    assert_eq!(&p.payload[..], b"late");
    assert_eq!(p.properties.message_expiry_interval, Some(1));
    w.ack(&p).await;
    broker.shutdown().await;
}

/// A takeover closes the existing connection without DISCONNECT from the client: its will
/// (no delay) is published [MQTT-3.1.4-3] (5.0) [MQTT-3.1.2-8].
#[tokio::test]
async fn takeover_publishes_the_will_of_the_old_connection() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/take").await;
    let mut old = with_will(
        addr,
        ProtocolVersion::V5,
        "taken",
        "will/take",
        false,
        None,
        None,
    )
    .await;
    let mut new = Client::connect(addr, ProtocolVersion::V5, "taken").await;
    assert_eq!(
        old.expect_disconnect().await,
        Some(ReasonCode::SESSION_TAKEN_OVER)
    );
    let p = w.expect_publish().await;
    assert_eq!(p.topic, "will/take");
    w.ack(&p).await;
    new.ping().await;
    broker.shutdown().await;
}

/// A delayed will is published once: not again when the session expires later
/// [MQTT-3.1.2-8] (the will is removed from the session once published).
#[tokio::test]
async fn delayed_will_is_published_once() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/once").await;
    let c = with_will(
        addr,
        ProtocolVersion::V5,
        "once",
        "will/once",
        false,
        Some(1),
        Some(2),
    )
    .await;
    c.drop_connection().await;
    let p = w.expect_publish().await;
    assert_eq!(p.topic, "will/once");
    w.ack(&p).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while broker.sessions().iter().any(|s| s.client_id == "once") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "session never expired"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// A will may use any valid topic name, `$` topics included (only `$SYS` is the broker's,
/// as for PUBLISH): it is published to a subscriber naming the `$`
/// level [MQTT-3.1.2-8] [MQTT-4.7.2-1]. A will on `$SYS/...` is refused at CONNECT.
#[tokio::test]
async fn will_on_a_dollar_topic() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "$app/will/#").await;
    let c = with_will(
        addr,
        ProtocolVersion::V5,
        "dollar",
        "$app/will/x",
        false,
        None,
        None,
    )
    .await;
    c.drop_connection().await;
    let p = w.expect_publish().await;
    assert_eq!(p.topic, "$app/will/x");
    w.ack(&p).await;

    let mut connect = connect_packet(ProtocolVersion::V5, "sys-will");
    connect.will = Some(will("$SYS/fake", "x", QoS::AtMostOnce, false));
    let (mut c, ack) = Client::connect_with(addr, connect).await;
    assert!(ack.reason_code.is_failure(), "{:?}", ack.reason_code);
    c.expect_closed().await;
    broker.shutdown().await;
}

/// Connects `id` with a persistent session (3.x clean session 0, 5.0 Session Expiry
/// Interval 60) and a will on `topic` with `payload` and Will Delay Interval `delay` (5.0).
async fn persistent_with_will(
    addr: SocketAddr,
    version: ProtocolVersion,
    id: &str,
    topic: &str,
    payload: &str,
    delay: Option<u32>,
) -> Client {
    let mut connect = persistent(version, id, 60);
    let mut w = will(topic, payload, QoS::AtLeastOnce, false);
    w.properties.will_delay_interval = delay;
    connect.will = Some(w);
    let (c, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    c
}

/// 3.x: a takeover closes the old network connection without DISCONNECT, so its will is
/// published [MQTT-3.1.2-8], whether the new connection continues the session (clean
/// session 0 on both) or starts a new one (clean session 1). (mosquitto 2 drops the will
/// when the session goes on.)
#[tokio::test]
async fn v3_takeover_publishes_the_will() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/v3take/+").await;
    for version in [ProtocolVersion::V31, ProtocolVersion::V311] {
        let topic = format!("will/v3take/{}", version.level());
        let id = format!("v3take-{}", version.level());
        // Continued: the new connection resumes the session.
        let mut old = persistent_with_will(addr, version, &id, &topic, "continued", None).await;
        let (mut new, present) = Client::connect_persistent(addr, version, &id).await;
        // 3.1 has no Session Present flag.
        assert!(
            present || version == ProtocolVersion::V31,
            "{version:?}: session present"
        );
        assert_eq!(
            old.expect_disconnect().await,
            None,
            "3.x: closed, no DISCONNECT"
        );
        let p = w.expect_publish().await;
        assert_eq!(p.topic, topic, "{version:?}");
        assert_eq!(&p.payload[..], b"continued", "{version:?}");
        w.ack(&p).await;
        new.ping().await;
        // Clean session: the session ends, and the will goes out too.
        let mut connect = connect_packet(version, &id);
        connect.will = Some(will(&topic, "clean", QoS::AtLeastOnce, false));
        let (mut old, ack) = Client::connect_with(addr, connect).await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        let mut new = Client::connect(addr, version, &id).await;
        assert_eq!(old.expect_disconnect().await, None);
        let p = w.expect_publish().await;
        assert_eq!(&p.payload[..], b"clean", "{version:?}");
        w.ack(&p).await;
        new.ping().await;
        // The new connections set no will: nothing more.
        w.expect_nothing(SHORT).await;
    }
    broker.shutdown().await;
}

/// 5.0: the existing connection's will is published as in section 3.1.2.5 on a takeover
/// (section 3.1.4); with a Will Delay Interval of 0 it is sent because the network
/// connection is closed, even when the new connection continues the session [MQTT-3.1.2-8].
/// (mosquitto 2 drops the will when the session goes on.)
#[tokio::test]
async fn v5_takeover_publishes_a_will_without_delay() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/v5take/+").await;
    for delay in [None, Some(0)] {
        let id = format!("v5take-{delay:?}");
        let topic = format!("will/v5take/{}", delay.is_some());
        let mut old =
            persistent_with_will(addr, ProtocolVersion::V5, &id, &topic, "continued", delay).await;
        let (mut new, present) = Client::connect_persistent(addr, ProtocolVersion::V5, &id).await;
        assert!(present, "the session goes on");
        assert_eq!(
            old.expect_disconnect().await,
            Some(ReasonCode::SESSION_TAKEN_OVER)
        );
        let p = w.expect_publish().await;
        assert_eq!(p.topic, topic);
        assert_eq!(&p.payload[..], b"continued");
        w.ack(&p).await;
        new.ping().await;
    }
    broker.shutdown().await;
}

/// 5.0: a will with a Will Delay Interval above 0 is not sent when the new connection
/// continues the session: it opened before the delay elapsed [MQTT-3.1.3-9] (as mosquitto).
/// Not later either, once the delay has passed. A takeover with clean start 1 ends the
/// session, and the will goes out (the non-normative comment of section 3.1.4).
#[tokio::test]
async fn v5_takeover_continuing_the_session_cancels_a_delayed_will() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/v5delay/+").await;
    let mut old = persistent_with_will(
        addr,
        ProtocolVersion::V5,
        "v5delay",
        "will/v5delay/continued",
        "continued",
        Some(1),
    )
    .await;
    let (mut new, present) = Client::connect_persistent(addr, ProtocolVersion::V5, "v5delay").await;
    assert!(present, "the session goes on");
    assert_eq!(
        old.expect_disconnect().await,
        Some(ReasonCode::SESSION_TAKEN_OVER)
    );
    new.ping().await;
    // Past the one-second delay: still nothing.
    w.expect_nothing(Duration::from_millis(1500)).await;
    new.ping().await;

    // Clean start 1: the session ends with the takeover, and its will is published.
    let mut old = persistent_with_will(
        addr,
        ProtocolVersion::V5,
        "v5delay",
        "will/v5delay/ended",
        "ended",
        Some(3600),
    )
    .await;
    let mut new = Client::connect(addr, ProtocolVersion::V5, "v5delay").await;
    assert_eq!(
        old.expect_disconnect().await,
        Some(ReasonCode::SESSION_TAKEN_OVER)
    );
    let p = w.expect_publish().await;
    assert_eq!(p.topic, "will/v5delay/ended");
    w.ack(&p).await;
    new.ping().await;
    broker.shutdown().await;
}

/// A will waiting for its Will Delay Interval when a new connection for its client
/// identifier arrives: not published when the client was away, whatever the Clean Start,
/// since the new connection opened before the delay elapsed [MQTT-3.1.2-8] (mosquitto's
/// 07-will-delay-recover); published when a Clean Start 1 connection takes over a connected
/// client, which ends the session (the non-normative comment of section 3.1.4: "it will be
/// sent because the original Session is ended on the takeover"). Clean Start 0 resumes the
/// session and cancels the will [MQTT-3.1.3-9].
#[tokio::test]
async fn delayed_will_and_a_new_connection() {
    let (broker, addr) = start().await;
    let mut w = watcher(addr, "will/clean/+").await;

    // Away, its will waiting for an hour.
    let c = with_will(
        addr,
        ProtocolVersion::V5,
        "clean-away",
        "will/clean/away",
        false,
        Some(3600),
        Some(3600),
    )
    .await;
    c.drop_connection().await;
    w.expect_nothing(SHORT).await;
    let again = Client::connect(addr, ProtocolVersion::V5, "clean-away").await;
    w.expect_nothing(SHORT).await;
    again.disconnect().await;

    // Connected, taken over by a Clean Start connection.
    let mut old = with_will(
        addr,
        ProtocolVersion::V5,
        "clean-taken",
        "will/clean/taken",
        false,
        Some(3600),
        Some(3600),
    )
    .await;
    let mut new = Client::connect(addr, ProtocolVersion::V5, "clean-taken").await;
    assert_eq!(
        old.expect_disconnect().await,
        Some(ReasonCode::SESSION_TAKEN_OVER)
    );
    let p = w.expect_publish().await;
    assert_eq!(p.topic, "will/clean/taken");
    w.ack(&p).await;
    new.ping().await;

    // Clean Start 0: the session goes on, the will is cancelled.
    let old = with_will(
        addr,
        ProtocolVersion::V5,
        "clean-resumed",
        "will/clean/resumed",
        false,
        Some(3600),
        Some(3600),
    )
    .await;
    old.drop_connection().await;
    let (mut resumed, present) =
        Client::connect_persistent(addr, ProtocolVersion::V5, "clean-resumed").await;
    assert!(present);
    w.expect_nothing(SHORT).await;
    resumed.ping().await;
    broker.shutdown().await;
}
