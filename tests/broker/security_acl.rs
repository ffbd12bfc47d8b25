//! Access control with an ACL file in mosquitto's format: the tenant layout, %c / %u
//! patterns, anonymous clients, $SYS, checks at delivery, reload.
use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use mercurio::codec::{Packet, ProtocolVersion, QoS, ReasonCode};
use mercurio::stats::DropCause;
use mercurio::{Broker, BrokerHandle};

const V3_FAILURE: ReasonCode = ReasonCode(0x80);

/// A broker with this ACL (anonymous clients allowed, user names unchecked).
async fn broker_with_acl(acl: &str) -> (BrokerHandle, SocketAddr, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("acl");
    std::fs::write(&path, acl).unwrap();
    let mut config = test_config();
    config.auth.acl_file = Some(path.clone());
    let (broker, addr) = start_with(config).await;
    (broker, addr, dir, path)
}

async fn client(addr: SocketAddr, v: ProtocolVersion, id: &str, user: Option<&str>) -> Client {
    let (c, ack) = Client::connect_with(addr, connect_as(v, id, user, None)).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS, "{id}");
    c
}

const TENANTS: &str = "\
# Two tenants: a writer that may only publish to its own topic, readers that may only read
# their own.
user t1-writer
topic write tenants/t1/#

user t1-reader
topic read tenants/t1/#

user t2-reader
topic read tenants/t2/#
";

#[tokio::test]
async fn tenant_layout() {
    let (broker, addr, _dir, _) = broker_with_acl(TENANTS).await;
    for v in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let failure = if v.is_v5() {
            ReasonCode::NOT_AUTHORIZED
        } else {
            V3_FAILURE
        };
        let mut r1 = client(addr, v, "r1", Some("t1-reader")).await;
        let mut r2 = client(addr, v, "r2", Some("t2-reader")).await;
        let mut w1 = client(addr, v, "w1", Some("t1-writer")).await;

        assert_eq!(
            r1.subscribe("tenants/t1/#", QoS::AtLeastOnce).await,
            ReasonCode::GRANTED_QOS_1
        );
        assert_eq!(
            r1.subscribe("tenants/t2/#", QoS::AtLeastOnce).await,
            failure
        );
        assert_eq!(r1.subscribe("tenants/+/x", QoS::AtLeastOnce).await, failure);
        assert_eq!(r1.subscribe("#", QoS::AtLeastOnce).await, failure);
        assert_eq!(
            r2.subscribe("tenants/t2/#", QoS::AtLeastOnce).await,
            ReasonCode::GRANTED_QOS_1
        );
        assert_eq!(
            r2.subscribe("tenants/t1/#", QoS::AtLeastOnce).await,
            failure
        );
        // The writer may not read, not even its own tenant.
        assert_eq!(
            w1.subscribe("tenants/t1/#", QoS::AtLeastOnce).await,
            failure
        );
        // Readers may not publish.
        let refused = if v.is_v5() {
            ReasonCode::NOT_AUTHORIZED
        } else {
            ReasonCode::SUCCESS // 3.x: acknowledged and dropped
        };
        assert_eq!(
            r1.publish("tenants/t1/x", b"r", QoS::AtLeastOnce, false)
                .await,
            refused
        );

        assert_eq!(
            w1.publish("tenants/t1/x", b"ok", QoS::AtLeastOnce, false)
                .await,
            ReasonCode::SUCCESS
        );
        assert_eq!(
            w1.publish("tenants/t2/x", b"no", QoS::AtLeastOnce, false)
                .await,
            refused
        );
        assert_eq!(
            w1.publish("tenants/t2/x", b"no", QoS::ExactlyOnce, false)
                .await,
            refused
        );
        w1.publish("tenants/t2/x", b"no", QoS::AtMostOnce, false)
            .await;
        let p = r1.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..]),
            ("tenants/t1/x", &b"ok"[..])
        );
        r1.ack(&p).await;
        r1.expect_nothing(Duration::from_millis(200)).await;
        r2.expect_nothing(Duration::from_millis(100)).await;
        // Anonymous clients get nothing (no line before the first `user`).
        let mut anon = client(addr, v, "anon", None).await;
        assert_eq!(
            anon.subscribe("tenants/t1/#", QoS::AtMostOnce).await,
            failure
        );
        for c in [r1, r2, w1, anon] {
            c.disconnect().await;
        }
    }
    broker.shutdown().await;
}

#[tokio::test]
async fn patterns_and_anonymous_lines() {
    let acl = "\
topic read public/#
topic deny public/secret
user alice
topic readwrite alice/#
pattern readwrite devices/%c/#
pattern read inbox/%u/+
";
    let (broker, addr, _dir, _) = broker_with_acl(acl).await;
    let v = ProtocolVersion::V5;
    let mut anon = client(addr, v, "dev1", None).await;
    assert_eq!(
        anon.subscribe("public/#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    assert_eq!(
        anon.subscribe("public/secret", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        anon.subscribe("devices/dev1/#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    assert_eq!(
        anon.subscribe("devices/dev2/#", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    // %u never matches an anonymous client.
    assert_eq!(
        anon.subscribe("inbox/+/x", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        anon.publish("alice/x", b"", QoS::AtLeastOnce, false).await,
        ReasonCode::NOT_AUTHORIZED
    );

    let mut alice = client(addr, v, "dev2", Some("alice")).await;
    // `topic` lines before any `user` are for anonymous clients only.
    assert_eq!(
        alice.subscribe("public/#", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        alice.subscribe("inbox/alice/+", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    assert_eq!(
        alice.subscribe("inbox/bob/+", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        alice
            .publish("devices/dev2/state", b"on", QoS::AtLeastOnce, false)
            .await,
        ReasonCode::NO_MATCHING_SUBSCRIBERS,
        "allowed (nobody subscribes)"
    );
    assert_eq!(
        alice
            .publish("devices/dev1/state", b"on", QoS::AtLeastOnce, false)
            .await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        alice
            .publish("alice/x", b"a", QoS::AtLeastOnce, false)
            .await,
        ReasonCode::NO_MATCHING_SUBSCRIBERS,
        "allowed (nobody subscribes)"
    );

    // At delivery: public/# was granted, but public/secret may not be read.
    let before = broker.stats().dropped_count(DropCause::NotAuthorized);
    broker
        .publish("public/secret", "s", QoS::AtMostOnce, false)
        .await
        .unwrap();
    broker
        .publish("public/news", "n", QoS::AtMostOnce, false)
        .await
        .unwrap();
    let p = anon.expect_publish().await;
    assert_eq!(p.topic, "public/news");
    assert_eq!(
        broker.stats().dropped_count(DropCause::NotAuthorized),
        before + 1
    );
    // Shared subscriptions are checked on their filter.
    assert_eq!(
        anon.subscribe("$share/g/public/#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    assert_eq!(
        anon.subscribe("$share/g/alice/#", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    broker.shutdown().await;
}

#[tokio::test]
async fn sys_topics_only_where_the_acl_says() {
    let (broker, addr, _dir, _) =
        broker_with_acl("topic read #\nuser admin\ntopic read $SYS/#\n").await;
    let v = ProtocolVersion::V5;
    let mut anon = client(addr, v, "a", None).await;
    assert_eq!(
        anon.subscribe("$SYS/#", QoS::AtMostOnce).await,
        ReasonCode::NOT_AUTHORIZED
    );
    assert_eq!(
        anon.subscribe("#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    let mut admin = client(addr, v, "b", Some("admin")).await;
    assert_eq!(
        admin.subscribe("$SYS/broker/uptime", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    // The retained value reaches the client the ACL lets read it.
    let p = admin.expect_publish().await;
    assert_eq!(p.topic, "$SYS/broker/uptime");
    assert!(p.retain);
    broker.shutdown().await;
}

#[tokio::test]
async fn reload_removes_subscriptions_no_longer_allowed() {
    let (broker, addr, _dir, path) =
        broker_with_acl("user u\ntopic read a/#\ntopic read b/#\ntopic write x\n").await;
    let v = ProtocolVersion::V5;
    let mut c = client(addr, v, "c", Some("u")).await;
    assert_eq!(
        c.subscribe("a/#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );
    assert_eq!(
        c.subscribe("b/#", QoS::AtMostOnce).await,
        ReasonCode::GRANTED_QOS_0
    );

    // A malformed file: the old rules stay, the error names the file and the line.
    std::fs::write(&path, "user u\ntopic read a/#\ntopic read b/#/c\n").unwrap();
    let errors = broker.reload().unwrap_err();
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0]
            .to_string()
            .starts_with(&format!("{}:3: ", path.display())),
        "{}",
        errors[0]
    );
    broker
        .publish("b/1", "still", QoS::AtMostOnce, false)
        .await
        .unwrap();
    assert_eq!(c.expect_publish().await.topic, "b/1");

    // Permissions shrink: b/# goes, a/# stays, the client stays connected.
    std::fs::write(&path, "user u\ntopic read a/#\n").unwrap();
    broker.reload().expect("reload");
    let sessions = broker.sessions();
    assert_eq!(
        sessions
            .iter()
            .find(|s| s.client_id == "c")
            .unwrap()
            .subscriptions,
        1
    );
    broker
        .publish("b/1", "gone", QoS::AtMostOnce, false)
        .await
        .unwrap();
    broker
        .publish("a/1", "kept", QoS::AtMostOnce, false)
        .await
        .unwrap();
    let p = c.expect_publish().await;
    assert_eq!(p.topic, "a/1");
    assert_eq!(
        c.publish("x", b"", QoS::AtLeastOnce, false).await,
        ReasonCode::NOT_AUTHORIZED
    );
    broker.shutdown().await;
}

/// `connect` made by user `u`.
fn as_user_u(mut connect: mercurio::codec::Connect) -> mercurio::codec::Connect {
    connect.username = Some("u".into());
    connect
}

/// Messages queued for an offline session when the client's read permission is revoked
/// are not delivered when it comes back: a reload drops them (counted `not_authorized`), as
/// the check at routing would have (mosquitto's 09-acl-change).
#[tokio::test]
async fn reload_drops_queued_messages_no_longer_readable() {
    let (broker, addr, _dir, path) =
        broker_with_acl("user u\ntopic read a/#\ntopic read b/#\n").await;
    let persistent = || as_user_u(persistent(ProtocolVersion::V5, "away", 300));
    let (mut c, _) = Client::connect_with(addr, persistent()).await;
    assert_eq!(
        c.subscribe("a/#", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    assert_eq!(
        c.subscribe("b/#", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    c.disconnect().await;
    broker
        .publish("b/1", "revoked", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    broker
        .publish("a/1", "allowed", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let before = broker.stats().dropped_count(DropCause::NotAuthorized);

    std::fs::write(&path, "user u\ntopic read a/#\n").unwrap();
    broker.reload().expect("reload");
    assert_eq!(
        broker.stats().dropped_count(DropCause::NotAuthorized),
        before + 1
    );
    let (mut c, ack) = Client::connect_with(addr, persistent()).await;
    assert!(ack.session_present);
    let p = c.expect_publish().await;
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("a/1", &b"allowed"[..]));
    c.ack(&p).await;
    c.expect_nothing(Duration::from_millis(300)).await;
    broker.shutdown().await;
}

/// The same for messages in flight: sent, not acknowledged, and resent when the client comes
/// back [MQTT-4.4.0-1]. A resend is a delivery: after the read permission is revoked, the
/// message is not resent but dropped (counted `not_authorized`), and one still readable is.
#[tokio::test]
async fn reload_stops_resending_in_flight_messages_no_longer_readable() {
    let (broker, addr, _dir, path) =
        broker_with_acl("user u\ntopic read a/#\ntopic read b/#\n").await;
    let persistent = || as_user_u(persistent(ProtocolVersion::V5, "in-flight", 300));
    let (mut c, _) = Client::connect_with(addr, persistent()).await;
    c.subscribe("a/#", QoS::AtLeastOnce).await;
    c.subscribe("b/#", QoS::AtLeastOnce).await;
    broker
        .publish("b/1", "revoked", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    broker
        .publish("a/1", "allowed", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    // Received, never acknowledged: both stay in flight.
    assert_eq!(c.expect_publish().await.topic, "b/1");
    assert_eq!(c.expect_publish().await.topic, "a/1");
    c.drop_connection().await;
    let before = broker.stats().dropped_count(DropCause::NotAuthorized);

    std::fs::write(&path, "user u\ntopic read a/#\n").unwrap();
    broker.reload().expect("reload");
    let (mut c, ack) = Client::connect_with(addr, persistent()).await;
    assert!(ack.session_present);
    let p = c.expect_publish().await;
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("a/1", &b"allowed"[..]));
    assert!(p.dup, "a resend carries DUP");
    c.ack(&p).await;
    c.expect_nothing(Duration::from_millis(300)).await;
    assert_eq!(
        broker.stats().dropped_count(DropCause::NotAuthorized),
        before + 1
    );
    broker.shutdown().await;
}

#[tokio::test]
async fn will_topic_must_be_writable() {
    let (broker, addr, _dir, _) = broker_with_acl("pattern write wills/%c\n").await;
    let mut ok = connect_as(ProtocolVersion::V5, "d1", None, None);
    ok.will = Some(will("wills/d1", "gone", QoS::AtMostOnce, false));
    let (_c, ack) = Client::connect_with(addr, ok).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    let mut bad = connect_as(ProtocolVersion::V5, "d2", None, None);
    bad.will = Some(will("wills/d1", "gone", QoS::AtMostOnce, false));
    let (_c, ack) = Client::connect_with(addr, bad).await;
    assert_eq!(ack.reason_code, ReasonCode::NOT_AUTHORIZED);
    broker.shutdown().await;
}

#[tokio::test]
async fn bad_acl_file_fails_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("acl");
    std::fs::write(&path, "user a\ntopic read ok/#\n\nsubscribe x\n").unwrap();
    let mut config = test_config();
    config.auth.acl_file = Some(path.clone());
    let e = Broker::builder(config.clone())
        .start()
        .await
        .err()
        .expect("refused");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("{}:4: unknown keyword", path.display())),
        "{msg}"
    );

    let missing: &Path = &dir.path().join("nope");
    config.auth.acl_file = Some(missing.to_path_buf());
    let e = Broker::builder(config)
        .start()
        .await
        .err()
        .expect("refused");
    assert!(
        e.to_string()
            .starts_with(&format!("{}: cannot read: ", missing.display())),
        "{e}"
    );
}

/// A session belongs to the identity that created it: another user connecting with its client
/// identifier and clean session 0 gets a new session (session present 0), none of the owner's
/// queued messages (which its ACL would refuse anyway) and none of its subscriptions; the
/// owner's session is ended as a Clean Start ends one (a connected owner is taken over, 5.0:
/// DISCONNECT 0x8E). The owner itself resumes its session as before.
#[tokio::test]
async fn a_session_belongs_to_the_identity_that_created_it() {
    let (broker, addr, _dir, _) = broker_with_acl(
        "user alice\ntopic readwrite secret/#\n\nuser mallory\ntopic readwrite public/#\n",
    )
    .await;
    for v in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let id = format!("victim-{}", v.level());
        let persistent = |user: &str| {
            let mut c = connect_as(v, &id, Some(user), None);
            c.clean_start = false;
            if v.is_v5() {
                c.properties.session_expiry_interval = Some(3600);
            }
            c
        };
        // alice's session: a subscription and three queued messages.
        let (mut alice, ack) = Client::connect_with(addr, persistent("alice")).await;
        assert!(!ack.session_present);
        alice.subscribe("secret/#", QoS::AtLeastOnce).await;
        alice.disconnect().await;
        let mut publisher = client(addr, v, "alice-pub", Some("alice")).await;
        for i in 0..3 {
            publisher
                .publish(
                    "secret/plans",
                    format!("s{i}").as_bytes(),
                    QoS::AtLeastOnce,
                    false,
                )
                .await;
        }
        // alice resumes her own session: present, the first message delivered.
        let (mut alice, ack) = Client::connect_with(addr, persistent("alice")).await;
        assert!(ack.session_present, "the owner resumes its session");
        let p = alice.expect_publish().await;
        assert_eq!(&p.payload[..], b"s0");
        // mallory takes the client identifier while alice is connected: a new session.
        let (mut mallory, ack) = Client::connect_with(addr, persistent("mallory")).await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        assert!(
            !ack.session_present,
            "another user's session is never resumed"
        );
        // (alice may have got the rest of her queue before being taken over.)
        let seen = alice.expect_closed().await;
        if v.is_v5() {
            assert!(
                matches!(seen.last(), Some(Packet::Disconnect(d)) if d.reason_code == ReasonCode::SESSION_TAKEN_OVER),
                "{seen:?}"
            );
        }
        publisher
            .publish("secret/plans", b"later", QoS::AtLeastOnce, false)
            .await;
        mallory.expect_nothing(Duration::from_millis(500)).await;
        let info = broker
            .sessions()
            .into_iter()
            .find(|s| s.client_id == id)
            .expect("mallory's session");
        assert_eq!((info.subscriptions, info.queued, info.inflight), (0, 0, 0));
        mallory.disconnect().await;
        // Nor does alice get mallory's session: a new one again.
        let (alice, ack) = Client::connect_with(addr, persistent("alice")).await;
        assert!(!ack.session_present);
        alice.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}
