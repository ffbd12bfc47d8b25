//! Durable in-process clients (`BrokerHandle::client`): a window of unacknowledged
//! messages, redelivery with DUP of what was not acknowledged (after the `Client` is dropped,
//! after the embedding process is killed and started again on its SQLite file, and after a
//! PostgreSQL standby takes over from it), expired messages never handed over, Clean Start.
use crate::common;

use std::time::Duration;

use common::*;
use mercurio::codec::{Properties, QoS};
use mercurio::config::StorageBackend;
use mercurio::stats::DropCause;
use mercurio::{ClientOptions, Received};
use tokio::io::AsyncBufReadExt;

const SHORT: Duration = Duration::from_millis(300);

/// The next message within the deadline.
async fn next(c: &mut mercurio::Client) -> Received {
    tokio::time::timeout(DEADLINE, c.recv())
        .await
        .expect("a message within the deadline")
        .expect("the broker runs")
}

/// Nothing arrives within `wait`.
async fn nothing(c: &mut mercurio::Client, wait: Duration) {
    if let Ok(r) = tokio::time::timeout(wait, c.recv()).await {
        panic!(
            "expected nothing, got {:?}",
            r.map(|r| r.message.topic.clone())
        );
    }
}

/// At most `receive_maximum` QoS 1 messages are handed over unacknowledged (as Receive
/// Maximum, MQTT 5.0 section 3.1.2.11.3); each `ack` lets one more through. A dropped
/// `Client` leaves its session: opened again, the unacknowledged ones come first with DUP
/// set [MQTT-3.3.1-1], then the rest, and Session Present is reported [MQTT-3.2.2-2].
/// Clean Start ends the session [MQTT-3.1.2-4].
#[tokio::test]
async fn window_acks_and_redelivery_on_reopen() {
    let (broker, _) = start().await;
    let options = ClientOptions::default().receive_maximum(2);
    let mut c = broker.client("w", options).unwrap();
    assert!(!c.resumed());
    assert_eq!(c.client_id(), "$internal/client/w");
    assert_eq!(
        c.subscribe("w/#", QoS::ExactlyOnce).unwrap(),
        QoS::AtLeastOnce,
        "granted at most QoS 1"
    );
    for i in 0..5 {
        broker
            .publish(&format!("w/{i}"), "x", QoS::ExactlyOnce, false)
            .await
            .unwrap();
    }
    let first = next(&mut c).await;
    let second = next(&mut c).await;
    assert_eq!(
        (first.message.topic.as_str(), first.qos),
        ("w/0", QoS::AtLeastOnce)
    );
    assert_eq!(second.message.topic, "w/1");
    assert!(!first.dup);
    nothing(&mut c, SHORT).await;
    first.ack();
    let third = next(&mut c).await;
    assert_eq!(third.message.topic, "w/2");
    nothing(&mut c, SHORT).await;
    // A second open of the same name while this one is open is refused.
    assert!(broker.client("w", options).is_err());
    drop(c);

    let mut c = broker.client("w", options).unwrap();
    assert!(c.resumed());
    let again: Vec<(String, bool)> = [next(&mut c).await, next(&mut c).await]
        .into_iter()
        .map(|r| {
            let seen = (r.message.topic.clone(), r.dup);
            r.ack();
            seen
        })
        .collect();
    assert_eq!(
        again,
        [("w/1".to_string(), true), ("w/2".to_string(), true)],
        "the unacknowledged ones, DUP set"
    );
    for want in ["w/3", "w/4"] {
        let r = next(&mut c).await;
        assert_eq!((r.message.topic.as_str(), r.dup), (want, false));
        r.ack();
    }
    nothing(&mut c, SHORT).await;
    broker
        .publish("w/5", "x", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    drop(c);

    // Clean Start: the kept message and the subscription are gone.
    let mut c = broker.client("w", options.clean_start(true)).unwrap();
    assert!(!c.resumed());
    broker
        .publish("w/6", "x", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    nothing(&mut c, SHORT).await;
    broker.shutdown().await;
}

/// A message whose Message Expiry Interval passes while it waits is not handed to an
/// in-process subscriber [MQTT-3.3.2-5], whether it waited in the session's queue (behind a
/// full window) or in the channel to the application; it is counted as dropped (`expired`).
#[tokio::test]
async fn expired_messages_are_not_handed_over() {
    let (broker, _) = start().await;
    let mut c = broker
        .client("exp", ClientOptions::default().receive_maximum(1))
        .unwrap();
    c.subscribe("exp/#", QoS::AtLeastOnce).unwrap();
    let mut sub = broker.subscribe("exp/#", QoS::AtLeastOnce).unwrap();
    let publish = |topic: &'static str, expiry: Option<u32>| {
        let broker = broker.clone();
        async move {
            broker
                .publish_with(
                    topic,
                    "x",
                    QoS::AtLeastOnce,
                    false,
                    Properties::default(),
                    expiry,
                )
                .await
                .unwrap()
        }
    };
    publish("exp/first", None).await;
    publish("exp/short", Some(1)).await;
    publish("exp/last", None).await;
    let first = next(&mut c).await;
    assert_eq!(first.message.topic, "exp/first");
    // Let the interval run out (this waits for time itself, not for an event).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    first.ack();
    let r = next(&mut c).await;
    assert_eq!(
        r.message.topic, "exp/last",
        "the expired message is skipped"
    );
    r.ack();
    // The in-process subscription had all three in its channel already.
    let got = tokio::time::timeout(DEADLINE, sub.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.topic, "exp/first");
    let got = tokio::time::timeout(DEADLINE, sub.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.topic, "exp/last", "the expired message is skipped");
    assert_eq!(broker.stats().dropped_count(DropCause::Expired), 2);
    broker.shutdown().await;
}

/// The example embedding application, examples/durable_worker.rs, on storage `db` (a SQLite
/// file or a PostgreSQL URL; `standby` for a PostgreSQL standby), publishing `publish` jobs
/// and acknowledging `ack`.
fn worker(db: &std::ffi::OsStr, publish: &str, ack: &str, standby: bool) -> tokio::process::Child {
    let mut command = tokio::process::Command::new(crate::events::example_binary("durable_worker"));
    command
        .arg(db)
        .args([publish, ack])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    if standby {
        command.env("DURABLE_WORKER_STANDBY", "1");
    }
    command.spawn().expect("the example starts")
}

/// The worker's lines up to `done acked=...`.
async fn until_done(child: &mut tokio::process::Child) -> Vec<String> {
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no `done` line; saw {} lines", seen.len()))
            .unwrap()
            .unwrap_or_else(|| panic!("the example ended; saw {seen:?}"));
        let done = line.starts_with("done ");
        seen.push(line);
        if done {
            return seen;
        }
    }
}

/// The jobs a worker acknowledged, with their DUP flag.
fn acked(lines: &[String]) -> Vec<(String, bool)> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("acked "))
        .map(|l| {
            let (topic, dup) = l.split_once(" dup=").unwrap();
            (topic.to_string(), dup == "true")
        })
        .collect()
}

/// A worker on `db` is given 1,000 jobs and acknowledges 500, then is killed with SIGKILL;
/// another (started as a standby when `standby`, before the kill) gets the other 500 in
/// order, those handed to the first one unacknowledged first with DUP set [MQTT-3.3.1-1]
/// [MQTT-4.4.0-1], and none of the 500 acknowledged. Returns the second worker, still
/// running.
async fn jobs_survive_sigkill(db: &std::ffi::OsStr, standby: bool) -> tokio::process::Child {
    let mut first = worker(db, "1000", "500", false);
    let lines = until_done(&mut first).await;
    assert_eq!(lines[0], "resumed=false");
    let want: Vec<(String, bool)> = (0..500).map(|i| (format!("jobs/{i}"), false)).collect();
    assert_eq!(acked(&lines), want);
    let mut second = if standby {
        // Waiting for the serving worker before it is killed.
        let second = worker(db, "0", "500", true);
        first.kill().await.unwrap(); // SIGKILL
        second
    } else {
        // SQLite: one process at a time (the database's lock file).
        first.kill().await.unwrap(); // SIGKILL
        worker(db, "0", "500", false)
    };
    let lines = until_done(&mut second).await;
    assert_eq!(lines[0], "resumed=true");
    assert_eq!(lines.last().unwrap(), "done acked=500");
    let got = acked(&lines);
    let topics: Vec<&str> = got.iter().map(|(t, _)| t.as_str()).collect();
    let want: Vec<String> = (500..1000).map(|i| format!("jobs/{i}")).collect();
    assert_eq!(topics, want, "the other 500, in order");
    let dups = got.iter().take_while(|(_, dup)| *dup).count();
    assert!(
        dups > 0 && got[dups..].iter().all(|(_, dup)| !dup),
        "those handed over before the kill first, DUP set; then the queued ones: {dups} DUP"
    );
    second
}

/// With SQLite: the worker killed, then started again on the same file. A third start gets
/// nothing: every acknowledgement was stored.
#[tokio::test]
async fn unacknowledged_jobs_survive_sigkill_of_the_embedding_process() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("worker.db");
    let mut second = jobs_survive_sigkill(db.as_os_str(), false).await;
    second.kill().await.unwrap();

    let mut config = test_config();
    config.storage.backend = StorageBackend::Sqlite;
    config.storage.path = Some(db.clone());
    let (broker, _) = start_with(config).await;
    let mut c = broker.client("worker", ClientOptions::default()).unwrap();
    assert!(c.resumed());
    nothing(&mut c, SHORT).await;
    drop(c);
    broker.shutdown().await;
}

/// With PostgreSQL (a throwaway cluster): the second worker is a standby waiting for the
/// first, which is killed; it takes over and resumes the client's session from the database.
#[tokio::test]
async fn unacknowledged_jobs_survive_a_standby_takeover() {
    use mercurio::storage::postgres::testing::TestPostgres;
    const TEST: &str = "unacknowledged_jobs_survive_a_standby_takeover";
    let Some(pg) = TestPostgres::start(TEST) else {
        return;
    };
    let url = pg.url(&pg.database("durable", None).await);
    let mut second = jobs_survive_sigkill(std::ffi::OsStr::new(&url), true).await;
    second.kill().await.unwrap();
}

/// A window larger than what waits for the application at once: every message handed over
/// and not acknowledged (more than fit in the channel to the application) is handed over
/// again on reopen, DUP set, in order; none is lost on the way [MQTT-4.4.0-1].
#[tokio::test]
async fn a_wide_window_is_redelivered_whole() {
    let (broker, _) = start().await;
    let options = ClientOptions::default().receive_maximum(500);
    let mut c = broker.client("wide", options).unwrap();
    c.subscribe("wide/#", QoS::AtLeastOnce).unwrap();
    for i in 0..300 {
        broker
            .publish(&format!("wide/{i}"), "x", QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    for i in 0..200 {
        let r = next(&mut c).await;
        assert_eq!(r.message.topic, format!("wide/{i}"));
        // Not acknowledged: dropped unhandled.
    }
    drop(c);
    let mut c = broker.client("wide", options).unwrap();
    for i in 0..300 {
        let r = next(&mut c).await;
        assert_eq!(r.message.topic, format!("wide/{i}"));
        assert!(r.dup || i >= 200, "wide/{i} was handed over before");
        r.ack();
    }
    nothing(&mut c, SHORT).await;
    broker.shutdown().await;
}

/// A durable client's session restored from SQLite is the broker's own before the
/// application opens it again: an ACL that lets anonymous clients read nothing does not
/// take its subscription or its messages away, and what is published meanwhile is queued
/// for it.
#[tokio::test]
async fn a_restored_session_is_trusted_before_it_is_opened() {
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(&acl, "user someone\ntopic read t/#\n").unwrap();
    let mut config = test_config();
    config.storage.backend = StorageBackend::Sqlite;
    config.storage.path = Some(dir.path().join("m.db"));
    config.auth.acl_file = Some(acl);
    let (broker, _) = start_with(config.clone()).await;
    let c = broker.client("kept", ClientOptions::default()).unwrap();
    c.subscribe("t/#", QoS::AtLeastOnce).unwrap();
    drop(c);
    broker
        .publish("t/1", "a", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    broker.shutdown().await;

    let (broker, _) = start_with(config).await;
    broker
        .publish("t/2", "b", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let mut c = broker.client("kept", ClientOptions::default()).unwrap();
    assert!(c.resumed());
    for want in ["t/1", "t/2"] {
        let r = next(&mut c).await;
        assert_eq!(r.message.topic, want);
        r.ack();
    }
    assert_eq!(broker.stats().dropped_total(), 0);
    drop(c);
    broker.shutdown().await;
}
