//! The options users of mosquitto rely on, over real sockets: per-listener authentication
//! (`per_listener_settings`), `mount_point`, `allow_zero_length_clientid`,
//! `message_size_limit`, `check_retain_source` (across a restart too),
//! `upgrade_outgoing_qos`, and an acknowledgement of the wrong type closing the connection.

use crate::common;

use common::*;
use std::time::Duration;

use bytes::Bytes;
use mercurio::codec::{Connect, Packet, ProtocolVersion, PubAck, QoS, ReasonCode};
use mercurio::config::{Config, ListenerConfig};

/// Two listeners on port 0: an anonymous one, and one needing a password from `passwd`.
fn two_listeners(dir: &std::path::Path) -> Config {
    let passwd = dir.join("passwd");
    mercurio::auth::password_file::set_password(&passwd, "alice", b"wonderland")
        .expect("password file");
    let mut config = test_config();
    config.auth.allow_anonymous = Some(false);
    config.listeners = vec![
        ListenerConfig {
            port: 0,
            allow_anonymous: Some(true),
            ..ListenerConfig::default()
        },
        ListenerConfig {
            port: 0,
            password_file: Some(passwd),
            ..ListenerConfig::default()
        },
    ];
    config
}

fn with_credentials(version: ProtocolVersion, id: &str, user: &str, pass: &str) -> Connect {
    let mut c = connect_packet(version, id);
    c.username = Some(user.to_string());
    c.password = Some(Bytes::from(pass.to_string()));
    c
}

/// An anonymous loopback listener beside one that needs a password: each listener's
/// `allow_anonymous` and `password_file` decide for its clients, over `[auth]`.
#[tokio::test]
async fn per_listener_authentication() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (handle, _) = start_with(two_listeners(dir.path())).await;
    let addrs = handle.local_addrs();
    let (open, closed) = (addrs[0], addrs[1]);
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        // Anonymous on the first listener: accepted, although [auth] refuses anonymous clients.
        let c = Client::connect(open, version, "anon-open").await;
        c.disconnect().await;
        // Anonymous on the second: refused (3.1.1: return code 5, not authorized).
        let (_, ack) = Client::connect_with(closed, connect_packet(version, "anon-closed")).await;
        let refused = if version.is_v5() {
            ReasonCode::NOT_AUTHORIZED
        } else {
            ReasonCode(5)
        };
        assert_eq!(ack.reason_code, refused, "{version:?}");
        // Wrong password on the second: not authorized too, as mosquitto answers.
        let (_, ack) =
            Client::connect_with(closed, with_credentials(version, "bad", "alice", "nope")).await;
        assert_eq!(ack.reason_code, refused, "{version:?}");
        // The right one.
        let (c, ack) = Client::connect_with(
            closed,
            with_credentials(version, "good", "alice", "wonderland"),
        )
        .await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        c.disconnect().await;
    }
    handle.shutdown().await;
}

/// A listener's `acl_file` applies to its clients only; the other listener has none.
#[tokio::test]
async fn per_listener_acl() {
    let dir = tempfile::tempdir().expect("temp dir");
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "topic read public/#\n").expect("acl");
    let mut config = test_config();
    config.auth.allow_anonymous = Some(true);
    config.listeners = vec![
        ListenerConfig {
            port: 0,
            ..ListenerConfig::default()
        },
        ListenerConfig {
            port: 0,
            acl_file: Some(acl),
            ..ListenerConfig::default()
        },
    ];
    let (handle, _) = start_with(config).await;
    let addrs = handle.local_addrs();
    let v = ProtocolVersion::V5;
    let mut free = Client::connect(addrs[0], v, "free").await;
    assert_eq!(
        free.subscribe("private/#", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    let mut limited = Client::connect(addrs[1], v, "limited").await;
    assert_eq!(
        limited.subscribe("private/#", QoS::AtLeastOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        limited.subscribe("public/#", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    // Publishing is not allowed by that ACL for the limited client...
    assert_eq!(
        limited
            .publish("public/a", b"x", QoS::AtLeastOnce, false)
            .await,
        ReasonCode::NOT_AUTHORIZED
    );
    // ...and the free client's messages reach both, as each may read them.
    assert_eq!(
        free.publish("public/a", b"hello", QoS::AtLeastOnce, false)
            .await,
        ReasonCode::SUCCESS
    );
    let p = limited.expect_publish().await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("public/a", &b"hello"[..])
    );
    handle.shutdown().await;
}

/// `mount_point`: the topics of a listener's clients are prefixed, in PUBLISH, SUBSCRIBE,
/// UNSUBSCRIBE and the will, and the prefix is removed from what they receive; clients of
/// other listeners see the full topics (mosquitto 10-listener-mount-point).
#[tokio::test]
async fn mount_point_prefixes_and_strips_topics() {
    let mut config = test_config();
    config.listeners = vec![
        ListenerConfig {
            port: 0,
            ..ListenerConfig::default()
        },
        ListenerConfig {
            port: 0,
            mount_point: Some("tenant/a/".to_string()),
            ..ListenerConfig::default()
        },
    ];
    let (handle, _) = start_with(config).await;
    let addrs = handle.local_addrs();
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let mut outside = Client::connect(addrs[0], version, "outside").await;
        outside.subscribe("#", QoS::AtLeastOnce).await;
        let mut inside = Client::connect(addrs[1], version, "inside").await;
        assert_eq!(
            inside.subscribe("room/+", QoS::AtLeastOnce).await,
            ReasonCode::GRANTED_QOS_1
        );

        // Inside -> outside: prefixed.
        inside
            .publish("room/1", b"in", QoS::AtLeastOnce, false)
            .await;
        let p = outside.expect_publish().await;
        assert_eq!(p.topic, "tenant/a/room/1");
        outside.ack(&p).await;
        // Inside -> inside: the prefix is removed on delivery.
        let p = inside.expect_publish().await;
        assert_eq!(p.topic, "room/1");
        inside.ack(&p).await;

        // Outside -> inside: only under the mount point, delivered without it.
        outside
            .publish("room/2", b"x", QoS::AtLeastOnce, false)
            .await;
        let p = outside.expect_publish().await;
        outside.ack(&p).await;
        outside
            .publish("tenant/a/room/2", b"y", QoS::AtLeastOnce, false)
            .await;
        let p = outside.expect_publish().await;
        outside.ack(&p).await;
        let p = inside.expect_publish().await;
        assert_eq!((p.topic.as_str(), &p.payload[..]), ("room/2", &b"y"[..]));
        inside.ack(&p).await;

        // UNSUBSCRIBE is prefixed too: nothing more arrives.
        inside.unsubscribe(&["room/+"]).await;
        outside
            .publish("tenant/a/room/3", b"z", QoS::AtMostOnce, false)
            .await;
        let _ = outside.expect_publish().await;
        inside.expect_nothing(Duration::from_millis(200)).await;

        // A will is published under the mount point.
        let mut c = connect_packet(version, "inside-will");
        c.will = Some(will("gone", "bye", QoS::AtMostOnce, false));
        let (w, ack) = Client::connect_with(addrs[1], c).await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        w.drop_connection().await;
        let p = outside.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..]),
            ("tenant/a/gone", &b"bye"[..])
        );

        inside.disconnect().await;
        outside.disconnect().await;
    }
    handle.shutdown().await;
}

/// `allow_zero_length_clientid = false`: an empty client identifier is refused, CONNACK 0x85
/// in 5.0 and 2 (identifier rejected) in 3.1.1, even with clean session; true (the default)
/// assigns one (mosquitto 01-connect-zero-length-id).
#[tokio::test]
async fn allow_zero_length_clientid_false_refuses_empty_identifiers() {
    let mut config = test_config();
    config.server.allow_zero_length_clientid = false;
    let (handle, addr) = start_with(config).await;
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let (mut c, ack) = Client::connect_with(addr, connect_packet(version, "")).await;
        // 3.1.1: return code 2, identifier rejected.
        let refused = if version.is_v5() {
            ReasonCode::CLIENT_IDENTIFIER_NOT_VALID
        } else {
            ReasonCode(2)
        };
        assert_eq!(ack.reason_code, refused, "{version:?}");
        assert!(c.recv().await.is_none(), "closed after the refusal");
        Client::connect(addr, version, "named")
            .await
            .disconnect()
            .await;
    }
    handle.shutdown().await;

    let (handle, addr) = start().await;
    let (_, ack) = Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "")).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    assert!(ack.properties.assigned_client_identifier.is_some());
    handle.shutdown().await;
}

/// `message_size_limit`: a larger payload is acknowledged (5.0: reason 0x83, as mosquitto's
/// manual says; mosquitto 2.0 sends 0x95, which a PUBACK may not carry, 5.0 section 3.4.2.1)
/// and not delivered; the connection stays up; a will over it is refused at CONNECT
/// (mosquitto 02-subpub-qos1-oversize-payload, 07-will-oversize-payload).
#[tokio::test]
async fn message_size_limit_drops_larger_payloads() {
    let mut config = test_config();
    config.server.message_size_limit = 4;
    let (handle, addr) = start_with(config).await;
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let mut sub = Client::connect(addr, version, "sub").await;
        sub.subscribe("size/#", QoS::ExactlyOnce).await;
        let mut publisher = Client::connect(addr, version, "pub").await;
        let too_large = if version.is_v5() {
            ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR
        } else {
            ReasonCode::SUCCESS
        };
        assert_eq!(
            publisher
                .publish("size/1", b"12345", QoS::AtLeastOnce, false)
                .await,
            too_large
        );
        assert_eq!(
            publisher
                .publish("size/2", b"12345", QoS::ExactlyOnce, false)
                .await,
            too_large
        );
        publisher
            .publish("size/0", b"12345", QoS::AtMostOnce, false)
            .await;
        // At the limit: delivered; nothing before it was.
        assert_eq!(
            publisher
                .publish("size/3", b"1234", QoS::AtLeastOnce, false)
                .await,
            ReasonCode::SUCCESS
        );
        let p = sub.expect_publish().await;
        assert_eq!((p.topic.as_str(), &p.payload[..]), ("size/3", &b"1234"[..]));
        sub.ack(&p).await;
        publisher.ping().await;

        let mut c = connect_packet(version, "big-will");
        c.will = Some(will("size/will", "12345", QoS::AtMostOnce, false));
        let (_, ack) = Client::connect_with(addr, c).await;
        // 3.x: return code 5, not authorized.
        let expected = if version.is_v5() {
            ReasonCode::PACKET_TOO_LARGE
        } else {
            ReasonCode(5)
        };
        assert_eq!(ack.reason_code, expected, "{version:?}");
        sub.disconnect().await;
        publisher.disconnect().await;
    }
    handle.shutdown().await;
}

/// An acknowledgement of the wrong type for a packet identifier in flight (PUBCOMP for a QoS 1
/// message, PUBACK or PUBCOMP before PUBREC for a QoS 2 one) is a Protocol Error: the
/// connection is closed (5.0: DISCONNECT 0x82), as mosquitto does: a QoS 1 message is
/// acknowledged by PUBACK [MQTT-4.3.2-4], a QoS 2 message by PUBREC then PUBCOMP
/// [MQTT-4.3.3-8], [MQTT-4.3.3-9].
#[tokio::test]
async fn acknowledgement_of_the_wrong_type_closes_the_connection() {
    let (handle, addr) = start().await;
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        for (qos, wrong) in [
            (QoS::AtLeastOnce, "pubcomp"),
            (QoS::AtLeastOnce, "pubrec"),
            (QoS::ExactlyOnce, "puback"),
            (QoS::ExactlyOnce, "pubcomp"),
        ] {
            let mut sub = Client::connect(addr, version, "acker").await;
            sub.subscribe("wrong/ack", qos).await;
            let mut publisher = Client::connect(addr, version, "sender").await;
            publisher.publish("wrong/ack", b"m", qos, false).await;
            let p = sub.expect_publish().await;
            let ack = PubAck {
                packet_id: p.packet_id,
                ..PubAck::default()
            };
            sub.send(match wrong {
                "pubcomp" => Packet::PubComp(ack),
                "pubrec" => Packet::PubRec(ack),
                _ => Packet::PubAck(ack),
            })
            .await;
            sub.expect_violation(ReasonCode::PROTOCOL_ERROR).await;
            publisher.disconnect().await;
        }
        // An acknowledgement for an identifier not in flight is still ignored.
        let mut c = Client::connect(addr, version, "unknown-ack").await;
        c.send(Packet::PubAck(PubAck {
            packet_id: 77,
            ..PubAck::default()
        }))
        .await;
        c.send(Packet::PubComp(PubAck {
            packet_id: 78,
            ..PubAck::default()
        }))
        .await;
        c.ping().await;
        c.disconnect().await;
    }
    handle.shutdown().await;
}

/// A client whose Maximum Packet Size is below the CONNACK is closed without one: the Server
/// MUST NOT send it a larger packet [MQTT-3.1.2-24] (mosquitto 12-prop-maximum-packet-size-connect).
#[tokio::test]
async fn maximum_packet_size_below_the_connack_closes_without_one() {
    let (handle, addr) = start().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "tiny");
    connect.properties.maximum_packet_size = Some(2);
    let mut c = Client::open(addr, ProtocolVersion::V5).await;
    c.send(Packet::Connect(Box::new(connect))).await;
    assert!(c.recv().await.is_none(), "closed without CONNACK");
    // A limit the CONNACK fits in connects.
    let mut connect = connect_packet(ProtocolVersion::V5, "small");
    connect.properties.maximum_packet_size = Some(64);
    let (_, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    handle.shutdown().await;
}

/// The ACL of the `check_retain_source` tests: `alice` and `bob` may publish and read
/// `retained/#`; with `alice_writes` false, alice may only read it.
fn retain_source_acl(alice_writes: bool) -> String {
    let alice = if alice_writes { "readwrite" } else { "read" };
    format!("user alice\ntopic {alice} retained/#\n\nuser bob\ntopic readwrite retained/#\n")
}

/// Subscribes `sub` to `retained/#` and returns the topics of the retained messages it gets:
/// bob's always comes (his rights are intact); whatever else was queued with it comes with
/// it, so a short quiet wait after it is enough to see it is all.
async fn retained_topics(sub: &mut Client) -> Vec<String> {
    assert_eq!(
        sub.subscribe("retained/#", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    let mut topics = Vec::new();
    while !topics.iter().any(|t| t == "retained/bob") {
        let p = sub.expect_publish().await;
        assert!(
            p.retain,
            "a retained message sent on subscribe has RETAIN set"
        );
        sub.ack(&p).await;
        topics.push(p.topic);
    }
    loop {
        match sub.recv_within(Duration::from_millis(300)).await {
            Ok(Some(Packet::Publish(p))) => {
                sub.ack(&p).await;
                topics.push(p.topic);
            }
            Ok(Some(other)) => panic!("unexpected {other:?}"),
            Ok(None) => panic!("closed"),
            Err(()) => break,
        }
    }
    topics.sort();
    topics
}

/// `check_retain_source`: once alice may no longer publish `retained/#` (the ACL reloaded),
/// her retained message is not delivered to a new subscription, while bob's still is
/// (mosquitto 04-retain-check-source). Off (the default), both are: only the subscriber's
/// read access is checked.
#[tokio::test]
async fn check_retain_source_drops_retained_messages_whose_publisher_lost_write_access() {
    for on in [false, true] {
        let dir = tempfile::tempdir().expect("temp dir");
        let acl = dir.path().join("acl");
        std::fs::write(&acl, retain_source_acl(true)).expect("acl");
        let mut config = test_config();
        config.auth.allow_anonymous = Some(true);
        config.auth.acl_file = Some(acl.clone());
        config.server.check_retain_source = on;
        let (handle, addr) = start_with(config).await;
        for (id, user) in [("alice-1", "alice"), ("bob-1", "bob")] {
            // 3.1.1: PUBACK has no code for "no matching subscribers".
            let v = ProtocolVersion::V311;
            let (mut c, _) = Client::connect_with(addr, connect_as(v, id, Some(user), None)).await;
            let topic = format!("retained/{user}");
            assert_eq!(
                c.publish(&topic, b"kept", QoS::AtLeastOnce, true).await,
                ReasonCode::SUCCESS
            );
            c.disconnect().await;
        }
        let reader = |id: &str| connect_as(ProtocolVersion::V311, id, Some("bob"), None);
        // Both publishers may publish: both retained messages come, option on or off.
        let (mut sub, _) = Client::connect_with(addr, reader("reader-1")).await;
        assert_eq!(
            retained_topics(&mut sub).await,
            ["retained/alice", "retained/bob"],
            "check_retain_source = {on}, before the reload"
        );
        sub.disconnect().await;

        std::fs::write(&acl, retain_source_acl(false)).expect("acl");
        handle.reload().expect("reload");
        let (mut sub, _) = Client::connect_with(addr, reader("reader-2")).await;
        let expected: &[&str] = if on {
            &["retained/bob"]
        } else {
            &["retained/alice", "retained/bob"]
        };
        assert_eq!(
            retained_topics(&mut sub).await,
            expected,
            "check_retain_source = {on}, after alice lost write access"
        );
        sub.disconnect().await;
        handle.shutdown().await;
    }
}

/// `check_retain_source` across a restart on SQLite: the publisher's user name and listener
/// are stored with its retained message, so after a restart with alice's write access
/// taken away from the ACL of the listener she published on, her message is not delivered
/// to a subscriber of another listener (one without access rules), while bob's is
/// (mosquitto 04-retain-check-source-persist-diff-port). Without the stored user name both
/// would be refused; without the stored listener, both delivered.
#[tokio::test]
async fn check_retain_source_remembers_the_publisher_across_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let acl = dir.path().join("acl");
    std::fs::write(&acl, retain_source_acl(true)).expect("acl");
    // Fixed ports: the stored listener is its port.
    let (guarded, open) = (mercurio_testkit::free_port(), mercurio_testkit::free_port());
    let config = || {
        let mut config = test_config();
        config.auth.allow_anonymous = Some(true);
        config.server.check_retain_source = true;
        config.storage.backend = mercurio::config::StorageBackend::Sqlite;
        config.storage.path = Some(dir.path().join("mercurio.db"));
        config.listeners = vec![
            ListenerConfig {
                port: guarded,
                acl_file: Some(acl.clone()),
                ..ListenerConfig::default()
            },
            ListenerConfig {
                port: open,
                ..ListenerConfig::default()
            },
        ];
        config
    };
    let (handle, _) = start_with(config()).await;
    let addrs = handle.local_addrs();
    for (id, user) in [("alice-1", "alice"), ("bob-1", "bob")] {
        let v = ProtocolVersion::V311;
        let (mut c, _) = Client::connect_with(addrs[0], connect_as(v, id, Some(user), None)).await;
        let topic = format!("retained/{user}");
        assert_eq!(
            c.publish(&topic, b"kept", QoS::AtLeastOnce, true).await,
            ReasonCode::SUCCESS
        );
        c.disconnect().await;
    }
    handle.shutdown().await;

    std::fs::write(&acl, retain_source_acl(false)).expect("acl");
    let (handle, _) = start_with(config()).await;
    let addrs = handle.local_addrs();
    assert_eq!(addrs[1].port(), open);
    let mut sub = Client::connect(addrs[1], ProtocolVersion::V5, "reader").await;
    assert_eq!(retained_topics(&mut sub).await, ["retained/bob"]);
    sub.disconnect().await;
    handle.shutdown().await;
}

/// `upgrade_outgoing_qos`: a QoS 0 message, retained or routed, goes out at the QoS 1 of
/// the subscription (mosquitto 04-retain-upgrade-outgoing-qos). Off (the default), at the
/// lower of the two, as the specification requires [MQTT-3.8.4-6].
#[tokio::test]
async fn upgrade_outgoing_qos_sends_at_the_granted_qos() {
    for on in [false, true] {
        let mut config = test_config();
        config.server.upgrade_outgoing_qos = on;
        let (handle, addr) = start_with(config).await;
        let expected = if on {
            QoS::AtLeastOnce
        } else {
            QoS::AtMostOnce
        };
        for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
            let mut publisher = Client::connect(addr, version, "upgrade-pub").await;
            publisher
                .publish("upgrade/retained", b"r", QoS::AtMostOnce, true)
                .await;
            // Handled (retained) once the round trip after it is done.
            publisher.ping().await;
            let mut sub = Client::connect(addr, version, "upgrade-sub").await;
            assert_eq!(
                sub.subscribe("upgrade/#", QoS::AtLeastOnce).await,
                ReasonCode::GRANTED_QOS_1
            );
            let p = sub.expect_publish().await;
            assert_eq!((p.topic.as_str(), p.retain), ("upgrade/retained", true));
            assert_eq!(p.qos, expected, "retained, upgrade_outgoing_qos = {on}");
            sub.ack(&p).await;
            publisher
                .publish("upgrade/live", b"l", QoS::AtMostOnce, false)
                .await;
            let p = sub.expect_publish().await;
            assert_eq!(p.topic, "upgrade/live");
            assert_eq!(p.qos, expected, "routed, upgrade_outgoing_qos = {on}");
            sub.ack(&p).await;
            publisher
                .publish("upgrade/retained", b"", QoS::AtMostOnce, true)
                .await;
            publisher.disconnect().await;
            sub.disconnect().await;
        }
        handle.shutdown().await;
    }
}
