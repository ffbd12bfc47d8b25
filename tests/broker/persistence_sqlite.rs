//! Persistence with in-process brokers restarted on the same SQLite file: sessions, queues,
//! in-flight messages at each QoS 2 step, inbound QoS 2 identifiers, retained messages, wills;
//! the lock file, the schema version, set-aside sessions, a busy database.
use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use mercurio::codec::{Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, ReasonCode};
use mercurio::config::{Config, StorageBackend};
use mercurio::storage::{
    Change, MessageRecord, SessionHeader, SessionRecord, SubscriptionRecord, WillRecord,
};
use mercurio::{Broker, BrokerHandle, Error};

fn sqlite_config(path: &Path) -> Config {
    let mut config = test_config();
    config.storage.backend = StorageBackend::Sqlite;
    config.storage.path = Some(path.to_path_buf());
    config
}

struct Db {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn db() -> Db {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("mercurio.db");
    Db { _dir: dir, path }
}

/// The ACL of the access-rule tests: `reader` reads and `writer` writes `fleet/#`.
const FLEET_ACL: &str = "user reader\ntopic read fleet/#\n\nuser writer\ntopic write fleet/#\n";

/// SQLite storage in `db` with the ACL file `acl`.
fn sqlite_with_acl(db: &Db, acl: &Path) -> Config {
    let mut config = sqlite_config(&db.path);
    config.auth.acl_file = Some(acl.to_path_buf());
    config
}

/// Client `reader-1` of user `reader`, MQTT 5, resuming its session (expiry 300 s).
fn fleet_reader() -> mercurio::codec::Connect {
    let mut c = connect_as(ProtocolVersion::V5, "reader-1", Some("reader"), None);
    c.clean_start = false;
    c.properties.session_expiry_interval = Some(300);
    c
}

async fn start_on(db: &Db) -> (BrokerHandle, std::net::SocketAddr) {
    start_with(sqlite_config(&db.path)).await
}

/// A PINGREQ round trip: everything the client sent before is handled.
async fn settle(c: &mut Client) {
    c.send(Packet::PingReq).await;
    loop {
        match c.recv().await {
            Some(Packet::PingResp) => return,
            Some(_) => continue,
            None => panic!("closed while settling"),
        }
    }
}

async fn expect_packet(c: &mut Client) -> Packet {
    c.recv().await.expect("a packet, not a close")
}

#[tokio::test]
async fn sessions_queues_and_retained_survive_a_restart() {
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let db = db();
        let (broker, addr) = start_on(&db).await;
        let (mut sub, present) = connect_persistent(addr, version, "sub").await;
        assert!(!present);
        sub.subscribe("t/#", QoS::ExactlyOnce).await;
        sub.disconnect().await;
        let mut publisher = Client::connect(addr, version, "pub").await;
        publisher
            .publish("t/1", b"one", QoS::AtLeastOnce, false)
            .await;
        publisher
            .publish("t/2", b"two", QoS::ExactlyOnce, false)
            .await;
        publisher
            .publish("t/0", b"zero", QoS::AtMostOnce, false)
            .await;
        publisher
            .publish("r/x", b"kept", QoS::AtLeastOnce, true)
            .await;
        publisher.disconnect().await;
        broker.shutdown().await;

        let (broker, addr) = start_on(&db).await;
        assert_eq!(broker.retained_count(), 1);
        let (mut sub, present) = connect_persistent(addr, version, "sub").await;
        assert!(present, "the session is restored ({version:?})");
        let one = sub.expect_publish().await;
        assert_eq!(
            (one.topic.as_str(), &one.payload[..], one.qos),
            ("t/1", &b"one"[..], QoS::AtLeastOnce)
        );
        sub.ack(&one).await;
        let two = sub.expect_publish().await;
        assert_eq!(
            (two.topic.as_str(), &two.payload[..], two.qos),
            ("t/2", &b"two"[..], QoS::ExactlyOnce)
        );
        sub.ack(&two).await;
        sub.expect_nothing(Duration::from_millis(200)).await;
        // The subscription was restored too.
        let mut publisher = Client::connect(addr, version, "pub").await;
        publisher
            .publish("t/3", b"three", QoS::AtLeastOnce, false)
            .await;
        let three = sub.expect_publish().await;
        assert_eq!(&three.payload[..], b"three");
        sub.ack(&three).await;
        settle(&mut sub).await;
        // The retained message, with its RETAIN flag.
        let mut fresh = Client::connect(addr, version, "fresh").await;
        fresh.subscribe("r/#", QoS::AtLeastOnce).await;
        let r = fresh.expect_publish().await;
        assert!(r.retain);
        assert_eq!(&r.payload[..], b"kept");
        sub.disconnect().await;
        broker.shutdown().await;

        // What was delivered and acknowledged is gone after another restart.
        let (broker, addr) = start_on(&db).await;
        let (mut sub, present) = connect_persistent(addr, version, "sub").await;
        assert!(present);
        sub.expect_nothing(Duration::from_millis(200)).await;
        broker.shutdown().await;
    }
}

/// A restored session keeps the user name its client connected with, so the ACL check made
/// when a message is routed to it while it is offline after a restart is the user's, not an
/// anonymous client's: the message is queued, not dropped as `not_authorized`. And the
/// user name is stored again when the client reconnects (seen after a second restart).
#[tokio::test]
async fn restored_sessions_keep_their_user_name_for_access_checks() {
    let db = db();
    let dir = tempfile::tempdir().expect("temp dir");
    let acl = dir.path().join("acl");
    std::fs::write(&acl, FLEET_ACL).expect("acl file");
    let config = || sqlite_with_acl(&db, &acl);
    let (broker, addr) = start_with(config()).await;
    let (mut sub, _) = Client::connect_with(addr, fleet_reader()).await;
    assert_eq!(
        sub.subscribe("fleet/#", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    sub.disconnect().await;
    broker.shutdown().await;

    for round in 1..=2 {
        let (broker, addr) = start_with(config()).await;
        let (mut publisher, ack) = Client::connect_with(
            addr,
            connect_as(ProtocolVersion::V5, "writer-1", Some("writer"), None),
        )
        .await;
        assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
        publisher
            .publish("fleet/7", b"while away", QoS::AtLeastOnce, false)
            .await;
        publisher.disconnect().await;
        assert_eq!(
            broker
                .stats()
                .dropped_count(mercurio::stats::DropCause::NotAuthorized),
            0,
            "round {round}: queued for the reader, not dropped"
        );
        let (mut sub, ack) = Client::connect_with(addr, fleet_reader()).await;
        assert!(ack.session_present);
        let p = sub.expect_publish().await;
        assert_eq!(&p.payload[..], b"while away", "round {round}");
        sub.ack(&p).await;
        settle(&mut sub).await;
        sub.disconnect().await;
        broker.shutdown().await;
    }
}

/// A PUBACK the client sent just before the broker began shutting down is applied and stored:
/// after the restart the message is not delivered again (mosquitto's
/// 11-persistent-subscription-no-local).
#[tokio::test]
async fn puback_sent_as_shutdown_begins_is_applied() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "acker").await;
    sub.subscribe("ack/#", QoS::AtLeastOnce).await;
    broker
        .publish("ack/1", "once", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let p = sub.expect_publish().await;
    // The acknowledgement and the shutdown together: the broker reads it before closing.
    sub.ack(&p).await;
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let (mut sub, present) = connect_persistent(addr, ProtocolVersion::V5, "acker").await;
    assert!(present);
    sub.expect_nothing(Duration::from_millis(300)).await;
    broker.shutdown().await;
}

#[tokio::test]
async fn in_flight_messages_are_resent_at_each_step() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("q/#", QoS::ExactlyOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publisher
        .publish("q/a", b"qos1", QoS::AtLeastOnce, false)
        .await;
    publisher
        .publish("q/b", b"qos2 unacked", QoS::ExactlyOnce, false)
        .await;
    publisher
        .publish("q/c", b"qos2 pubrec", QoS::ExactlyOnce, false)
        .await;
    let a = sub.expect_publish().await;
    let b = sub.expect_publish().await;
    let c = sub.expect_publish().await;
    assert_eq!(&c.payload[..], b"qos2 pubrec");
    // c: PUBREC sent, PUBREL received, no PUBCOMP.
    sub.send(Packet::PubRec(PubAck {
        packet_id: c.packet_id,
        ..PubAck::default()
    }))
    .await;
    match expect_packet(&mut sub).await {
        Packet::PubRel(r) => assert_eq!(r.packet_id, c.packet_id),
        other => panic!("expected PUBREL, got {other:?}"),
    }
    broker.flush_storage().await;
    drop(sub);
    drop(publisher);
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let (mut sub, present) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    assert!(present);
    let mut resent = Vec::new();
    for _ in 0..3 {
        resent.push(expect_packet(&mut sub).await);
    }
    match &resent[0] {
        Packet::Publish(p) => {
            assert!(p.dup);
            assert_eq!((p.packet_id, &p.payload[..]), (a.packet_id, &b"qos1"[..]));
        }
        other => panic!("expected the QoS 1 message again, got {other:?}"),
    }
    match &resent[1] {
        Packet::Publish(p) => {
            assert!(p.dup);
            assert_eq!((p.packet_id, p.qos), (b.packet_id, QoS::ExactlyOnce));
        }
        other => panic!("expected the unacknowledged QoS 2 message again, got {other:?}"),
    }
    match &resent[2] {
        Packet::PubRel(r) => assert_eq!(r.packet_id, c.packet_id),
        other => panic!("expected PUBREL again, got {other:?}"),
    }
    sub.expect_nothing(Duration::from_millis(200)).await;
    broker.shutdown().await;
}

#[tokio::test]
async fn inbound_qos2_ids_survive_a_restart() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("in/#", QoS::AtLeastOnce).await;
    let (mut publisher, _) = connect_persistent(addr, ProtocolVersion::V311, "pub").await;
    let publish = Publish {
        dup: false,
        qos: QoS::ExactlyOnce,
        retain: false,
        topic: "in/x".into(),
        packet_id: 9,
        properties: Properties::default(),
        payload: bytes::Bytes::from_static(b"once"),
    };
    publisher.send(Packet::Publish(publish.clone())).await;
    match expect_packet(&mut publisher).await {
        Packet::PubRec(r) => assert_eq!(r.packet_id, 9),
        other => panic!("expected PUBREC, got {other:?}"),
    }
    let p = sub.expect_publish().await;
    sub.ack(&p).await;
    settle(&mut sub).await;
    drop(publisher);
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    let (mut publisher, present) = connect_persistent(addr, ProtocolVersion::V311, "pub").await;
    assert!(present);
    publisher
        .send(Packet::Publish(Publish {
            dup: true,
            ..publish
        }))
        .await;
    match expect_packet(&mut publisher).await {
        Packet::PubRec(r) => assert_eq!(r.packet_id, 9),
        other => panic!("expected PUBREC, got {other:?}"),
    }
    publisher
        .send(Packet::PubRel(PubAck {
            packet_id: 9,
            ..PubAck::default()
        }))
        .await;
    match expect_packet(&mut publisher).await {
        Packet::PubComp(r) => assert_eq!(r.packet_id, 9),
        other => panic!("expected PUBCOMP, got {other:?}"),
    }
    sub.expect_nothing(Duration::from_millis(300)).await;
    broker.shutdown().await;
}

#[tokio::test]
async fn a_delayed_will_survives_a_restart() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut watcher, _) = connect_persistent(addr, ProtocolVersion::V5, "watcher").await;
    watcher.subscribe("wills/#", QoS::AtLeastOnce).await;
    let mut c = persistent(ProtocolVersion::V5, "dying", 60);
    let mut w = will("wills/dying", "gone", QoS::AtLeastOnce, false);
    w.properties.will_delay_interval = Some(1);
    c.will = Some(w);
    let (dying, ack) = Client::connect_with(addr, c).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    drop(dying); // connection lost: the will waits for its delay
    watcher.disconnect().await;
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let (mut watcher, present) = connect_persistent(addr, ProtocolVersion::V5, "watcher").await;
    assert!(present);
    let p = watcher.expect_publish().await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("wills/dying", &b"gone"[..])
    );
    watcher.ack(&p).await;
    watcher.expect_nothing(Duration::from_millis(300)).await;
    broker.shutdown().await;
}

#[tokio::test]
async fn sessions_expired_while_down_are_discarded_and_their_wills_published() {
    let db = db();
    let ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        - 3_600_000;
    {
        let storage = mercurio::storage::sqlite::SqliteStorage::open(&db.path).unwrap();
        let mut watcher = SessionRecord::new(SessionHeader {
            client_id: "watcher".into(),
            protocol_level: 5,
            session_expiry_interval: mercurio::storage::NEVER_EXPIRES,
            disconnected_at: Some(ago),
            username: None,
            certificate: None,
        });
        watcher.subscriptions = vec![SubscriptionRecord::new("wills/#", 1)];
        let mut gone = SessionRecord::new(SessionHeader {
            client_id: "gone".into(),
            protocol_level: 5,
            session_expiry_interval: 60,
            disconnected_at: Some(ago),
            username: None,
            certificate: None,
        });
        gone.will = Some(WillRecord {
            message: MessageRecord::new("wills/gone", "bye", 1),
            delay_interval: 120,
        });
        use mercurio::storage::Storage;
        storage
            .apply(&[
                Change::SessionWritten(watcher, Vec::new()),
                Change::SessionWritten(gone, Vec::new()),
            ])
            .await
            .unwrap();
        storage.close().await.unwrap();
    }
    let (broker, addr) = start_on(&db).await;
    let ids: Vec<String> = broker.sessions().into_iter().map(|s| s.client_id).collect();
    assert_eq!(ids, ["watcher"]);
    assert_eq!(broker.stats().sessions_expired, 1);
    let (mut watcher, present) = connect_persistent(addr, ProtocolVersion::V5, "watcher").await;
    assert!(present);
    let p = watcher.expect_publish().await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("wills/gone", &b"bye"[..])
    );
    watcher.ack(&p).await;
    let (_, present) = connect_persistent(addr, ProtocolVersion::V5, "gone").await;
    assert!(!present, "the expired session is gone");
    broker.shutdown().await;
}

#[tokio::test]
async fn a_second_broker_on_the_same_file_is_refused() {
    let db = db();
    let (broker, _) = start_on(&db).await;
    let second = Broker::builder(sqlite_config(&db.path)).start().await;
    match second {
        Err(Error::Storage(e)) => {
            let text = e.to_string();
            assert!(text.contains("mercurio.db"), "{text}");
            assert!(text.contains("in use"), "{text}");
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("a second broker started on the same database"),
    }
    // The sqlite3 shell (any reader) can still read it.
    let reader = rusqlite::Connection::open(&db.path).unwrap();
    let n: i64 = reader
        .query_row("SELECT count(*) FROM sessions", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 0);
    broker.shutdown().await;
    let (again, _) = start_on(&db).await;
    again.shutdown().await;
}

#[tokio::test]
async fn a_newer_schema_is_refused() {
    let db = db();
    let (broker, _) = start_on(&db).await;
    broker.shutdown().await;
    rusqlite::Connection::open(&db.path)
        .unwrap()
        .execute_batch("PRAGMA user_version = 1000")
        .unwrap();
    match Broker::builder(sqlite_config(&db.path)).start().await {
        Err(Error::Storage(e)) => {
            assert!(e.is_incompatible(), "{e}");
            assert!(e.to_string().contains("newer"), "{e}");
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("started on a newer schema"),
    }
}

#[tokio::test]
async fn a_damaged_session_is_set_aside_until_deleted() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    for id in ["good", "bad"] {
        let (mut c, _) = connect_persistent(addr, ProtocolVersion::V311, id).await;
        c.subscribe("x", QoS::AtLeastOnce).await;
        c.disconnect().await;
    }
    broker.shutdown().await;
    rusqlite::Connection::open(&db.path)
        .unwrap()
        .execute(
            "UPDATE sessions SET session_expiry_interval = 'broken' WHERE client_id = 'bad'",
            [],
        )
        .unwrap();

    let (broker, addr) = start_on(&db).await;
    assert_eq!(broker.stats().storage_sessions_set_aside, 1);
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let (_, ack) = Client::connect_with(addr, persistent(version, "bad", 60)).await;
        let expected = if version == ProtocolVersion::V5 {
            ReasonCode::SERVER_UNAVAILABLE
        } else {
            ReasonCode(3)
        };
        assert_eq!(ack.reason_code, expected, "{version:?}");
    }
    let (_, present) = connect_persistent(addr, ProtocolVersion::V311, "good").await;
    assert!(present);
    // Left untouched in the file.
    let reader = rusqlite::Connection::open(&db.path).unwrap();
    let n: i64 = reader
        .query_row(
            "SELECT count(*) FROM subscriptions WHERE client_id = 'bad'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(n, 1);

    assert_eq!(broker.delete_session("bad").await.unwrap(), Some(true));
    assert_eq!(broker.delete_session("bad").await.unwrap(), None);
    assert_eq!(broker.stats().storage_sessions_set_aside, 0);
    let (_, present) = connect_persistent(addr, ProtocolVersion::V311, "bad").await;
    assert!(!present, "a new session");
    broker.shutdown().await;
}

#[tokio::test]
async fn a_locked_database_delays_writes_but_loses_nothing() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("l/#", QoS::AtLeastOnce).await;
    sub.disconnect().await;
    broker.flush_storage().await;

    // Another connection holds the write lock until the broker has been refused by it
    // (the writer's batch retried), however long the publishing below takes.
    let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let path = db.path.clone();
    let holder = std::thread::spawn(move || {
        let other = rusqlite::Connection::open(&path).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        locked_tx.send(()).unwrap();
        // Released when told, or after the deadline if the test failed meanwhile.
        let _ = release_rx.recv_timeout(Duration::from_secs(30));
        other.execute_batch("COMMIT").unwrap();
    });
    locked_rx.await.unwrap();
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for i in 0..50 {
        // Acknowledged at once: the message path doesn't wait on the database.
        let rc = publisher
            .publish("l/t", format!("m{i}").as_bytes(), QoS::AtLeastOnce, false)
            .await;
        assert_eq!(rc, ReasonCode::SUCCESS);
    }
    publisher.disconnect().await;
    wait_until("the writer is refused by the lock and retries", || {
        broker.stats().storage_batches_retried > 0
    })
    .await;
    release_tx.send(()).unwrap();
    holder.join().unwrap();
    broker.shutdown().await;
    assert_eq!(broker.stats().storage_batches_dropped, 0);

    let (broker, addr) = start_on(&db).await;
    let (mut sub, present) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    assert!(present);
    for i in 0..50 {
        let p = sub.expect_publish().await;
        assert_eq!(&p.payload[..], format!("m{i}").as_bytes());
        sub.ack(&p).await;
    }
    broker.shutdown().await;
}

#[tokio::test]
async fn durable_ack_acknowledges_after_the_commit() {
    let db = db();
    let mut config = sqlite_config(&db.path);
    config.storage.durable_ack = true;
    let (broker, addr) = start_with(config.clone()).await;
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("d/#", QoS::ExactlyOnce).await;
    sub.disconnect().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for i in 0..20 {
        let qos = if i % 2 == 0 {
            QoS::AtLeastOnce
        } else {
            QoS::ExactlyOnce
        };
        let rc = publisher
            .publish("d/t", format!("m{i}").as_bytes(), qos, false)
            .await;
        assert_eq!(rc, ReasonCode::SUCCESS);
        // Acknowledged means in the file already, seen by another connection.
        let reader = rusqlite::Connection::open(&db.path).unwrap();
        let n: i64 = reader
            .query_row(
                "SELECT count(*) FROM queued WHERE client_id = 'sub'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(n, i + 1);
    }
    broker.shutdown().await;
}

/// A delivery made through a shared subscription keeps its group in storage: messages queued
/// for member A before a restart go to member B after it when A's session ends (here by a
/// Clean Start), as they would have without the restart (MQTT 5.0 section 4.8.2).
#[tokio::test]
async fn shared_deliveries_keep_their_group_across_a_restart() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut a, _) =
        Client::connect_with(addr, persistent(ProtocolVersion::V5, "member-a", 300)).await;
    a.subscribe("$share/g/jobs", QoS::AtLeastOnce).await;
    a.disconnect().await;
    wait_until("member-a disconnected", || {
        broker
            .sessions()
            .iter()
            .any(|s| s.client_id == "member-a" && !s.connected)
    })
    .await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for job in ["job-1", "job-2"] {
        publisher
            .publish("jobs", job.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    publisher.disconnect().await;
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let mut b = Client::connect(addr, ProtocolVersion::V5, "member-b").await;
    b.subscribe("$share/g/jobs", QoS::AtLeastOnce).await;
    // A comes back with Clean Start: its old session, with the two messages, ends.
    let (_a, ack) =
        Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "member-a")).await;
    assert!(!ack.session_present);
    for job in ["job-1", "job-2"] {
        let p = b.expect_publish().await;
        assert_eq!((&p.payload[..], p.qos), (job.as_bytes(), QoS::AtLeastOnce));
        b.ack(&p).await;
    }
    assert_eq!(broker.stats().shared_passed_on, 2);
    broker.shutdown().await;
}

/// A session that expired while the broker was down passes the messages it held through a
/// shared subscription (queued, and in flight unacknowledged) on to another member at start.
#[tokio::test]
async fn shared_deliveries_of_a_session_expired_while_down_go_to_another_member() {
    use mercurio::storage::{
        DeliveryRecord, InflightRecord, InflightState, QueuedRecord, Storage, StoredMessage,
    };
    let db = db();
    let ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        - 3_600_000;
    let header = |client_id: &str, expiry: u32| SessionHeader {
        client_id: client_id.into(),
        protocol_level: 5,
        session_expiry_interval: expiry,
        disconnected_at: Some(ago),
        username: None,
        certificate: None,
    };
    let shared = |id: u64| DeliveryRecord {
        share: Some("$share/g/jobs".into()),
        ..DeliveryRecord::new(id, 1)
    };
    let messages: Vec<StoredMessage> = [
        (1, "jobs", "sent"),
        (2, "jobs", "queued"),
        (3, "own", "own"),
    ]
    .into_iter()
    .map(|(id, topic, payload)| StoredMessage {
        id,
        message: MessageRecord::new(topic, payload, 1),
    })
    .collect();
    {
        let storage = mercurio::storage::sqlite::SqliteStorage::open(&db.path).unwrap();
        let mut stays = SessionRecord::new(header("member-b", mercurio::storage::NEVER_EXPIRES));
        stays.subscriptions = vec![SubscriptionRecord::new("$share/g/jobs", 1)];
        let mut gone = SessionRecord::new(header("member-a", 60));
        gone.subscriptions = vec![SubscriptionRecord::new("$share/g/jobs", 1)];
        gone.inflight = vec![InflightRecord {
            packet_id: 1,
            delivery: shared(1),
            state: InflightState::AwaitingPubAck,
        }];
        gone.queued = vec![
            QueuedRecord {
                seq: 1,
                delivery: shared(2),
            },
            // Not through a shared subscription: it ends with the session.
            QueuedRecord {
                seq: 2,
                delivery: DeliveryRecord::new(3, 1),
            },
        ];
        storage
            .apply(&[
                Change::SessionWritten(stays, Vec::new()),
                Change::SessionWritten(gone, messages),
            ])
            .await
            .unwrap();
        storage.close().await.unwrap();
    }
    let (broker, addr) = start_on(&db).await;
    let (mut b, present) = connect_persistent(addr, ProtocolVersion::V5, "member-b").await;
    assert!(present);
    for payload in ["sent", "queued"] {
        let p = b.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..]),
            ("jobs", payload.as_bytes())
        );
        b.ack(&p).await;
    }
    b.expect_nothing(Duration::from_millis(300)).await;
    assert_eq!(broker.stats().shared_passed_on, 2);
    broker.shutdown().await;
}

/// Messages queued for an offline session are checked again at start against the access
/// rules, which may have changed while the broker was down: a message the client may no
/// longer read is not delivered, and is counted `not_authorized`, as after a reload.
#[tokio::test]
async fn restored_queues_are_checked_against_the_access_rules_of_the_restart() {
    let db = db();
    let dir = tempfile::tempdir().expect("temp dir");
    let acl = dir.path().join("acl");
    std::fs::write(&acl, FLEET_ACL).expect("acl file");
    let config = || sqlite_with_acl(&db, &acl);
    let (broker, addr) = start_with(config()).await;
    let (mut sub, _) = Client::connect_with(addr, fleet_reader()).await;
    sub.subscribe("fleet/#", QoS::AtLeastOnce).await;
    sub.disconnect().await;
    let (mut publisher, _) = Client::connect_with(
        addr,
        connect_as(ProtocolVersion::V5, "writer-1", Some("writer"), None),
    )
    .await;
    publisher
        .publish("fleet/secret/1", b"secret", QoS::AtLeastOnce, false)
        .await;
    publisher
        .publish("fleet/public/1", b"public", QoS::AtLeastOnce, false)
        .await;
    publisher.disconnect().await;
    broker.shutdown().await;

    // While the broker is down, the reader loses fleet/secret.
    std::fs::write(
        &acl,
        "user reader\ntopic read fleet/public/#\n\nuser writer\ntopic write fleet/#\n",
    )
    .expect("acl file");
    let (broker, addr) = start_with(config()).await;
    assert_eq!(
        broker
            .stats()
            .dropped_count(mercurio::stats::DropCause::NotAuthorized),
        1
    );
    let (mut sub, ack) = Client::connect_with(addr, fleet_reader()).await;
    assert!(ack.session_present);
    let p = sub.expect_publish().await;
    assert_eq!(&p.payload[..], b"public");
    sub.ack(&p).await;
    sub.expect_nothing(Duration::from_millis(300)).await;
    broker.shutdown().await;
}

/// A message published to many offline persistent sessions is stored once, with one small
/// reference per session; after a restart each session gets it, and once every session has
/// acknowledged it, its row is gone with its last reference.
#[tokio::test]
async fn a_broadcast_to_offline_sessions_is_stored_once() {
    const SESSIONS: usize = 20;
    let db = db();
    let (broker, addr) = start_on(&db).await;
    for i in 0..SESSIONS {
        let (mut s, _) = Client::connect_with(
            addr,
            persistent(ProtocolVersion::V5, &format!("fleet-{i}"), 3600),
        )
        .await;
        s.subscribe("fleet/all", QoS::AtLeastOnce).await;
        s.disconnect().await;
    }
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for n in 0..3 {
        publisher
            .publish(
                "fleet/all",
                format!("m{n}").as_bytes(),
                QoS::AtLeastOnce,
                false,
            )
            .await;
    }
    publisher.disconnect().await;
    broker.shutdown().await;
    let count = |sql: &str| -> i64 {
        rusqlite::Connection::open(&db.path)
            .unwrap()
            .query_row(sql, [], |r| r.get(0))
            .unwrap()
    };
    assert_eq!(
        count("SELECT count(*) FROM messages"),
        3,
        "each message once"
    );
    assert_eq!(
        count("SELECT count(*) FROM queued"),
        3 * SESSIONS as i64,
        "one reference per delivery"
    );

    let (broker, addr) = start_on(&db).await;
    for i in 0..SESSIONS {
        let (mut s, present) = Client::connect_with(
            addr,
            persistent(ProtocolVersion::V5, &format!("fleet-{i}"), 3600),
        )
        .await;
        assert!(present.session_present);
        for n in 0..3 {
            let p = s.expect_publish().await;
            assert_eq!(&p.payload[..], format!("m{n}").as_bytes());
            s.ack(&p).await;
        }
        settle(&mut s).await;
        s.disconnect().await;
    }
    broker.shutdown().await;
    assert_eq!(count("SELECT count(*) FROM queued"), 0);
    assert_eq!(count("SELECT count(*) FROM inflight"), 0);
    assert_eq!(
        count("SELECT count(*) FROM messages"),
        0,
        "delivered to every session: gone"
    );
}

/// A restart leaves offline sessions' queues in storage, counted (`sessions`, `client show`)
/// and read when their clients come back: each gets its queue with its session present,
/// in order, the messages published after the restart behind it; one that takes part of its
/// queue before the next restart gets the rest after it.
#[tokio::test]
async fn queues_left_in_storage_are_read_when_their_clients_come_back() {
    const STORED: usize = 300;
    let db = db();
    let (broker, addr) = start_on(&db).await;
    for id in ["away-a", "away-b"] {
        let (mut s, _) = connect_persistent(addr, ProtocolVersion::V5, id).await;
        s.subscribe("fleet/#", QoS::AtLeastOnce).await;
        s.disconnect().await;
    }
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for n in 0..STORED {
        let payload = format!("m{n}");
        publisher
            .publish("fleet/all", payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    publisher.disconnect().await;
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let queued = |broker: &BrokerHandle, id: &str| {
        broker
            .sessions()
            .into_iter()
            .find(|s| s.client_id == id)
            .map(|s| s.queued)
    };
    assert_eq!(queued(&broker, "away-a"), Some(STORED));
    assert_eq!(
        broker.session_detail("away-b").map(|d| d.info.queued),
        Some(STORED)
    );
    // Published after the restart, while both are away: behind the stored queue.
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for n in STORED..STORED + 2 {
        let payload = format!("m{n}");
        publisher
            .publish("fleet/all", payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    publisher.disconnect().await;
    assert_eq!(queued(&broker, "away-a"), Some(STORED + 2));
    let (mut a, present) = connect_persistent(addr, ProtocolVersion::V5, "away-a").await;
    assert!(present);
    for n in 0..STORED + 2 {
        let p = a.expect_publish().await;
        assert_eq!(&p.payload[..], format!("m{n}").as_bytes(), "in order");
        a.ack(&p).await;
    }
    a.expect_nothing(Duration::from_millis(200)).await;
    a.disconnect().await;
    // away-b takes 100 of its messages, then the broker restarts.
    let (mut b, present) = connect_persistent(addr, ProtocolVersion::V5, "away-b").await;
    assert!(present);
    for n in 0..100 {
        let p = b.expect_publish().await;
        assert_eq!(&p.payload[..], format!("m{n}").as_bytes());
        b.ack(&p).await;
    }
    settle(&mut b).await;
    drop(b);
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let (mut b, present) = connect_persistent(addr, ProtocolVersion::V5, "away-b").await;
    assert!(present);
    let first = b.expect_publish().await;
    let mut n: usize = std::str::from_utf8(&first.payload[1..])
        .expect("text")
        .parse()
        .expect("a number");
    assert!(n <= 100, "from the first unacknowledged on: m{n}");
    b.ack(&first).await;
    while n + 1 < STORED + 2 {
        n += 1;
        let p = b.expect_publish().await;
        assert_eq!(&p.payload[..], format!("m{n}").as_bytes(), "in order");
        b.ack(&p).await;
    }
    b.expect_nothing(Duration::from_millis(200)).await;
    broker.shutdown().await;
}

/// A queue left in storage at the restart is checked as a queue in memory is: a message
/// whose expiry interval ran out while its client was away is not delivered [MQTT-3.3.2-5],
/// and its packet identifier is used up, as in mosquitto, so the next message's number shows
/// the gap (any free identifier is valid [MQTT-2.2.1-3]); the rest keep their order and have
/// their interval reduced by the time they waited [MQTT-3.3.2-6].
#[tokio::test]
async fn an_expired_message_of_a_queue_left_in_storage_uses_up_its_identifier() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut s, _) = connect_persistent(addr, ProtocolVersion::V5, "exp-away").await;
    s.subscribe("exp/#", QoS::AtLeastOnce).await;
    s.disconnect().await;
    let expiry = |s| Properties {
        message_expiry_interval: Some(s),
        ..Properties::default()
    };
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "exp-pub").await;
    publisher
        .publish_with("exp/short", b"s", QoS::AtLeastOnce, false, expiry(1))
        .await;
    publisher
        .publish_with("exp/long", b"g", QoS::AtLeastOnce, false, expiry(100))
        .await;
    publisher
        .publish("exp/none", b"n", QoS::AtLeastOnce, false)
        .await;
    publisher.disconnect().await;
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    assert_eq!(
        broker.session_detail("exp-away").map(|d| d.info.queued),
        Some(3),
        "the queue is left in storage, counted"
    );
    // Let the short interval run out (this waits for time itself, not for an event).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (mut s, present) = connect_persistent(addr, ProtocolVersion::V5, "exp-away").await;
    assert!(present);
    let p = s.expect_publish().await;
    assert_eq!(p.topic, "exp/long", "the expired message is not delivered");
    assert_eq!(p.packet_id, 2, "the expired exp/short used up 1");
    let left = p.properties.message_expiry_interval.expect("expiry");
    assert!(left < 100, "reduced by the wait: {left}");
    s.ack(&p).await;
    let p = s.expect_publish().await;
    assert_eq!(p.topic, "exp/none");
    assert_eq!(p.packet_id, 3);
    s.ack(&p).await;
    s.expect_nothing(Duration::from_millis(200)).await;
    broker.shutdown().await;
}

/// A member of a shared subscription gets its queue back at the restart, not left in
/// storage: when its session then ends (Clean Start) before it takes them, its deliveries go
/// to another member of the group.
#[tokio::test]
async fn a_shared_member_ending_after_a_restart_passes_its_queue_on() {
    let db = db();
    let (broker, addr) = start_on(&db).await;
    let (mut a, _) = connect_persistent(addr, ProtocolVersion::V5, "member-a").await;
    a.subscribe("$share/g/jobs", QoS::AtLeastOnce).await;
    a.disconnect().await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for n in 0..3 {
        let payload = format!("j{n}");
        publisher
            .publish("jobs", payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    publisher.disconnect().await;
    broker.shutdown().await;

    let (broker, addr) = start_on(&db).await;
    let (mut b, _) = connect_persistent(addr, ProtocolVersion::V5, "member-b").await;
    b.subscribe("$share/g/jobs", QoS::AtLeastOnce).await;
    // member-a comes back with Clean Start: its session ends, its jobs go to member-b.
    let (a, _) = Client::connect_with(addr, connect_packet(ProtocolVersion::V5, "member-a")).await;
    for n in 0..3 {
        let p = b.expect_publish().await;
        assert_eq!(&p.payload[..], format!("j{n}").as_bytes());
        b.ack(&p).await;
    }
    assert_eq!(broker.stats().shared_passed_on, 3);
    drop(a);
    broker.shutdown().await;
}
