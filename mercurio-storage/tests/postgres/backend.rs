//! The PostgreSQL backend on a throwaway cluster (or `MERCURIO_TEST_POSTGRES_URL`): the
//! conformance checks, one serving broker per database, standbys (after a clean stop, after a
//! stale heartbeat, under a role's short timeouts), epoch fencing and the schema version.
//! Without PostgreSQL the tests print why they skip (and fail with `CI=true`).

use std::time::Duration;

use async_trait::async_trait;
use mercurio_storage::conformance::{self, Harness};
use mercurio_storage::postgres::testing::TestPostgres;
use mercurio_storage::postgres::{PostgresOptions, PostgresStorage};
use mercurio_storage::{
    AccessChange, AccessKind, AccessRecord, Change, DeliveryRecord, ErrorKind, MessageRecord,
    SessionHeader, Storage, StoredMessage,
};

const DEADLINE: Duration = Duration::from_secs(30);

struct PgHarness {
    pg: TestPostgres,
    /// The database of the last fresh storage, the one the checks reopen or damage.
    last_url: String,
}

async fn open(url: &str) -> PostgresStorage {
    PostgresStorage::open(PostgresOptions::new(url))
        .await
        .unwrap_or_else(|e| panic!("open {url}: {e}"))
}

fn standby(url: &str) -> PostgresOptions {
    let mut options = PostgresOptions::new(url);
    options.standby = true;
    options.host = Some("standby-host".into());
    options
}

/// Message `id` on `topic`, payload `m{id}`, stored.
fn stored(topic: &str, id: u64) -> Change {
    Change::MessageStored {
        message: StoredMessage {
            id,
            message: MessageRecord::new(topic, format!("m{id}"), 1),
        },
    }
}

/// The client identifiers of the sessions `storage` loads, sorted.
async fn session_names(storage: &PostgresStorage) -> Vec<String> {
    let mut names: Vec<String> = storage
        .load()
        .await
        .unwrap()
        .sessions
        .into_iter()
        .map(|s| s.client_id)
        .collect();
    names.sort();
    names
}

fn saved(client_id: &str) -> Change {
    Change::SessionSaved(SessionHeader {
        client_id: client_id.into(),
        protocol_level: 5,
        session_expiry_interval: 60,
        disconnected_at: None,
        username: None,
        certificate: None,
    })
}

#[async_trait]
impl Harness for PgHarness {
    type Storage = PostgresStorage;

    async fn fresh(&mut self) -> PostgresStorage {
        let name = self.pg.database("conf", None).await;
        let url = self.pg.url(&name);
        let storage = open(&url).await;
        self.last_url = url;
        storage
    }

    async fn reopen(&mut self, storage: PostgresStorage) -> PostgresStorage {
        let url = self.last_url.clone();
        storage.close().await.unwrap();
        drop(storage);
        open(&url).await
    }

    async fn make_unreadable(&mut self, _storage: &PostgresStorage, client_id: &str) -> bool {
        let url = self.last_url.clone();
        self.pg
            .execute(
                &url,
                &format!(
                    "UPDATE mercurio_sessions SET protocol_level = 99 WHERE client_id = '{client_id}'"
                ),
            )
            .await;
        true
    }
}

#[tokio::test]
async fn postgres_conforms() {
    let Some(pg) = TestPostgres::start("postgres_conforms") else {
        return;
    };
    let mut harness = PgHarness {
        pg,
        last_url: String::new(),
    };
    tokio::time::timeout(Duration::from_secs(120), conformance::run_all(&mut harness))
        .await
        .expect("the conformance checks finish");
}

#[tokio::test]
async fn one_broker_serves_and_a_standby_takes_over_then_fences() {
    let Some(pg) = TestPostgres::start("one_broker_serves") else {
        return;
    };
    let url = pg.url(&pg.database("lead", None).await);
    let mut first_options = PostgresOptions::new(&url);
    first_options.host = Some("serving-host".into());
    let first = PostgresStorage::open(first_options).await.unwrap();
    first.apply(&[saved("a")]).await.unwrap();

    let err = PostgresStorage::open(PostgresOptions::new(&url))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    assert!(err.to_string().contains("serving-host"), "{err}");

    // A standby waits while the first serves, and takes over once it closes.
    let waiting = tokio::spawn(PostgresStorage::open(standby(&url)));
    tokio::time::sleep(Duration::from_millis(500)).await; // lets it reach the wait, not a sync
    assert!(!waiting.is_finished(), "the standby waits");
    first.apply(&[saved("b")]).await.unwrap();
    let first_epoch = first.epoch();
    // Simulate a serving broker that is still running but replaced: release only its lock.
    first.close().await.unwrap();
    let second = tokio::time::timeout(DEADLINE, waiting)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap();
    assert_eq!(second.epoch(), first_epoch + 1);
    let loaded = second.load().await.unwrap();
    assert_eq!(loaded.sessions.len(), 2);
    second.apply(&[saved("c")]).await.unwrap();
    second.close().await.unwrap();
}

/// Makes the serving broker's heartbeat look 20 s old and freezes it, as a stopped
/// process's would be.
async fn freeze_heartbeat(pg: &TestPostgres, url: &str) {
    pg.execute(
        url,
        "CREATE FUNCTION stale_beat() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN NEW.heartbeat_at := now() - interval '20 s'; RETURN NEW; END $$; \
         CREATE TRIGGER stale_beat BEFORE UPDATE ON mercurio_leader FOR EACH ROW \
         WHEN (NEW.epoch = OLD.epoch) EXECUTE FUNCTION stale_beat(); \
         UPDATE mercurio_leader SET heartbeat_at = now() - interval '20 s';",
    )
    .await;
}

#[tokio::test]
async fn stale_heartbeat_is_taken_over_and_the_old_writer_is_fenced() {
    let Some(pg) = TestPostgres::start("stale_heartbeat") else {
        return;
    };
    let url = pg.url(&pg.database("stale", None).await);
    let first = open(&url).await;
    first.apply(&[saved("a")]).await.unwrap();
    freeze_heartbeat(&pg, &url).await;
    let started = std::time::Instant::now();
    let second = tokio::time::timeout(DEADLINE, PostgresStorage::open(standby(&url)))
        .await
        .expect("the standby takes over from a stale heartbeat")
        .unwrap();
    eprintln!("takeover after {:?}", started.elapsed());
    assert_eq!(second.epoch(), first.epoch() + 1);
    // The old broker's next write is refused, and it is told to stop.
    let err = first.apply(&[saved("late")]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    let failed = tokio::time::timeout(DEADLINE, first.failed())
        .await
        .expect("failed resolves");
    assert_eq!(failed.kind(), ErrorKind::Fenced);
    assert_eq!(session_names(&second).await, ["a"]);
    second.close().await.unwrap();
}

/// The users and rules a serving broker stored are what a standby reads when it takes over;
/// the replaced broker can no longer change them (fenced, as its other writes).
#[tokio::test]
async fn a_standby_takes_over_the_access_records() {
    let Some(pg) = TestPostgres::start("access_takeover") else {
        return;
    };
    let url = pg.url(&pg.database("access", None).await);
    let first = open(&url).await;
    let user = AccessRecord {
        kind: AccessKind::User,
        name: "alice".into(),
        body: r#"{"password_hash":"x","groups":["fleet"]}"#.into(),
    };
    let group = AccessRecord {
        kind: AccessKind::Group,
        name: "fleet".into(),
        body: r#"{"roles":[]}"#.into(),
    };
    first
        .apply_access(&[
            AccessChange::Put(user.clone()),
            AccessChange::Put(group.clone()),
        ])
        .await
        .unwrap();
    pg.execute(
        &url,
        "UPDATE mercurio_leader SET heartbeat_at = now() - interval '20 s';          CREATE FUNCTION stale_beat() RETURNS trigger LANGUAGE plpgsql AS          $$ BEGIN NEW.heartbeat_at := now() - interval '20 s'; RETURN NEW; END $$;          CREATE TRIGGER stale_beat BEFORE UPDATE ON mercurio_leader FOR EACH ROW          WHEN (NEW.epoch = OLD.epoch) EXECUTE FUNCTION stale_beat();",
    )
    .await;
    let second = tokio::time::timeout(DEADLINE, PostgresStorage::open(standby(&url)))
        .await
        .expect("the standby takes over")
        .unwrap();
    assert_eq!(second.load_access().await.unwrap(), [user, group.clone()]);
    let err = first
        .apply_access(&[AccessChange::Deleted {
            kind: AccessKind::User,
            name: "alice".into(),
        }])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    assert_eq!(second.load_access().await.unwrap().len(), 2);
    second
        .apply_access(&[AccessChange::Deleted {
            kind: AccessKind::User,
            name: "alice".into(),
        }])
        .await
        .unwrap();
    assert_eq!(second.load_access().await.unwrap(), [group]);
    second.close().await.unwrap();
}

#[tokio::test]
async fn standby_waits_through_short_role_timeouts() {
    let Some(pg) = TestPostgres::start("short_timeouts") else {
        return;
    };
    pg.admin(
        "CREATE ROLE hasty LOGIN; \
         ALTER ROLE hasty SET statement_timeout = '200ms'; \
         ALTER ROLE hasty SET lock_timeout = '200ms'; \
         ALTER ROLE hasty SET idle_in_transaction_session_timeout = '200ms'; \
         ALTER ROLE hasty SET idle_session_timeout = '200ms';",
    )
    .await;
    let name = pg.database("hasty", Some("hasty")).await;
    let url = pg.url(&name).replace("postgres@", "hasty@");
    let first = open(&url).await;
    first.apply(&[saved("a")]).await.unwrap();
    let waiting = tokio::spawn(PostgresStorage::open(standby(&url)));
    // Ten times the role's timeouts: a wait cut short would have ended (with an error or a
    // takeover) by then.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!waiting.is_finished(), "the standby still waits");
    first.apply(&[saved("b")]).await.unwrap();
    first.close().await.unwrap();
    let second = tokio::time::timeout(DEADLINE, waiting)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap();
    assert_eq!(second.load().await.unwrap().sessions.len(), 2);
    second.close().await.unwrap();
}

/// The heartbeat goes on while a write transaction is in progress: a drain of thousands of
/// messages makes transactions last seconds, and a heartbeat waiting behind them for 7 s made
/// the serving broker stop with the database up.
#[tokio::test]
async fn heartbeat_is_not_held_up_by_a_long_write() {
    let Some(pg) = TestPostgres::start("long_write") else {
        return;
    };
    let url = pg.url(&pg.database("longwrite", None).await);
    let storage = std::sync::Arc::new(open(&url).await);
    // A write that takes 4 s inside its transaction.
    pg.execute(
        &url,
        "CREATE FUNCTION slow_insert() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(4); RETURN NEW; END $$; \
         CREATE TRIGGER slow_insert BEFORE INSERT ON mercurio_sessions FOR EACH ROW \
         WHEN (NEW.client_id = 'slow') EXECUTE FUNCTION slow_insert();",
    )
    .await;
    let started = pg.scalar(&url, "SELECT now()::text").await.expect("now()");
    let writing = {
        let storage = std::sync::Arc::clone(&storage);
        tokio::spawn(async move { storage.apply(&[saved("slow")]).await })
    };
    // The heartbeat (every second) moves more than 1.5 s past the write's start while the
    // write still runs (it ends 4 s after its start).
    let sql = format!(
        "SELECT heartbeat_at > '{started}'::timestamptz + interval '1.5 s' FROM mercurio_leader"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_millis(3500);
    loop {
        if pg.scalar(&url, &sql).await.as_deref() == Some("t") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the heartbeat waited for the write transaction"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!writing.is_finished(), "the write is still in progress");
    writing.await.unwrap().unwrap();
    assert_eq!(storage.load().await.unwrap().sessions.len(), 1);
}

#[tokio::test]
async fn newer_schema_is_refused() {
    let Some(pg) = TestPostgres::start("newer_schema") else {
        return;
    };
    let url = pg.url(&pg.database("newer", None).await);
    open(&url).await.close().await.unwrap();
    pg.execute(
        &url,
        "UPDATE mercurio_meta SET value = '99' WHERE key = 'schema_version'",
    )
    .await;
    let err = PostgresStorage::open(PostgresOptions::new(&url))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Incompatible, "{err}");
    assert!(err.to_string().contains("99"), "{err}");
    // A standby refuses at once too, without waiting.
    let err = tokio::time::timeout(DEADLINE, PostgresStorage::open(standby(&url)))
        .await
        .expect("refused at once")
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Incompatible, "{err}");
}

/// A version 3 database (each queued or in-flight row holding its own copy of the message),
/// built with that version's SQL, is upgraded to the message store by the broker that serves
/// it: every stored queue and in-flight list comes back, each old row one message and one
/// reference, and new messages are stored after them.
#[tokio::test]
async fn version_3_schema_is_upgraded() {
    let Some(pg) = TestPostgres::start("upgrade_3") else {
        return;
    };
    let url = pg.url(&pg.database("upgrade", None).await);
    pg.execute(
        &url,
        &format!(
            "{} INSERT INTO mercurio_meta (key, value) VALUES ('schema_version', '3'); \
             INSERT INTO mercurio_sessions (client_id, protocol_level, session_expiry_interval) \
             VALUES ('a', 5, 3600), ('b', 4, 60); \
             INSERT INTO mercurio_queued (client_id, seq, topic, payload, qos, retain, \
             properties, expires_at, publisher, share) VALUES \
             ('a', 1, 't/1', '\\x01', 1, false, '\\x', NULL, 'pub', NULL), \
             ('a', 2, 't/2', '\\x0203', 2, true, '\\x0b01', 1700000000000, NULL, \
             '$share/g/t/#'), ('b', 7, 't/1', '\\x01', 1, false, '\\x', NULL, 'pub', NULL); \
             INSERT INTO mercurio_inflight (client_id, packet_id, ord, state, topic, payload, \
             qos, retain, properties, expires_at, publisher, share) VALUES \
             ('a', 9, 1, 'awaiting_pubrec', 't/i', '\\xff', 2, false, '\\x', NULL, 'pub', NULL); \
             INSERT INTO mercurio_retained (topic, payload, qos, retain, properties, expires_at, \
             publisher, share) VALUES ('r/t', '\\x07', 1, true, '\\x', NULL, 'pub', NULL);",
            mercurio_storage::postgres::testing::SCHEMA_VERSION_3_SQL
        ),
    )
    .await;
    let storage = open(&url).await;
    let state = storage.load().await.unwrap();
    assert!(state.set_aside.is_empty(), "{:?}", state.set_aside);
    assert_eq!(state.sessions.len(), 2);
    assert_eq!(state.messages.len(), 4, "one message per old row");
    let message = |id: u64| {
        &state
            .messages
            .iter()
            .find(|m| m.id == id)
            .expect("referred message loaded")
            .message
    };
    let a = &state.sessions[0];
    assert_eq!(a.queued.iter().map(|q| q.seq).collect::<Vec<_>>(), [1, 2]);
    let second = &a.queued[1].delivery;
    assert_eq!((second.qos, second.retain), (2, true));
    assert_eq!(second.share.as_deref(), Some("$share/g/t/#"));
    let m = message(second.message_id);
    assert_eq!((m.topic.as_str(), &m.payload[..]), ("t/2", &[2u8, 3][..]));
    assert_eq!(&m.properties[..], [0x0b, 0x01]);
    assert_eq!(m.expires_at, Some(1_700_000_000_000));
    assert_eq!(a.inflight[0].packet_id, 9);
    assert_eq!(message(a.inflight[0].delivery.message_id).topic, "t/i");
    assert_eq!(state.sessions[1].queued[0].seq, 7);
    // A retained message of an older schema has no publisher's user name or listener.
    assert_eq!(state.retained.len(), 1);
    assert_eq!(state.retained[0].publisher(), Some("pub"));
    assert_eq!(state.retained[0].publisher_username, None);
    assert_eq!(state.retained[0].publisher_listener, None);
    let next = state.messages.iter().map(|m| m.id).max().unwrap() + 1;
    storage
        .apply(&[
            Change::MessageStored {
                message: StoredMessage {
                    id: next,
                    message: MessageRecord::new("t/new", "n", 1),
                },
            },
            Change::MessageQueued {
                client_id: "b".into(),
                seq: 8,
                delivery: DeliveryRecord::new(next, 1),
            },
        ])
        .await
        .unwrap();
    assert_eq!(storage.load().await.unwrap().messages.len(), 5);
    storage.close().await.unwrap();
    let version = pg
        .scalar(
            &url,
            "SELECT value FROM mercurio_meta WHERE key = 'schema_version'",
        )
        .await;
    assert_eq!(
        version,
        Some(mercurio_storage::postgres::SCHEMA_VERSION.to_string())
    );
}

/// A standby that takes over loads every message its sessions refer to, once, and none that
/// nothing refers to; it holds them until it releases them itself.
#[tokio::test]
async fn a_standby_takes_over_the_message_store() {
    let Some(pg) = TestPostgres::start("takeover_messages") else {
        return;
    };
    let url = pg.url(&pg.database("takeover", None).await);
    let first = open(&url).await;
    let stored = |id: u64| stored("fan/out", id);
    let queued = |client_id: &str, id: u64| Change::MessageQueued {
        client_id: client_id.into(),
        seq: id,
        delivery: DeliveryRecord::new(id, 1),
    };
    first
        .apply(&[
            saved("a"),
            saved("b"),
            stored(1),
            stored(2),
            queued("a", 1),
            queued("b", 1),
            Change::MessageReleased { id: 1 },
        ])
        .await
        .unwrap();
    let waiting = tokio::spawn(PostgresStorage::open(standby(&url)));
    first.close().await.unwrap();
    let second = tokio::time::timeout(DEADLINE, waiting)
        .await
        .expect("the standby takes over")
        .unwrap()
        .unwrap();
    let loaded = second.load().await.unwrap();
    assert_eq!(
        loaded.messages.iter().map(|m| m.id).collect::<Vec<_>>(),
        [1],
        "the referred message once, the unreferred one gone"
    );
    assert!(loaded
        .sessions
        .iter()
        .all(|s| s.queued[0].delivery.message_id == 1));
    let count = "SELECT count(*) FROM mercurio_messages";
    second
        .apply(&[
            Change::MessageDequeued {
                client_id: "a".into(),
                seq: 1,
            },
            Change::MessageDequeued {
                client_id: "b".into(),
                seq: 1,
            },
        ])
        .await
        .unwrap();
    assert_eq!(pg.scalar(&url, count).await.as_deref(), Some("1"), "held");
    second
        .apply(&[Change::MessageReleased { id: 1 }])
        .await
        .unwrap();
    assert_eq!(
        pg.scalar(&url, count).await.as_deref(),
        Some("0"),
        "released"
    );
    second.close().await.unwrap();
}

/// A schema-6 database (a row per queued delivery) holding queues is upgraded to chunks:
/// every queue reads back whole and in order (one longer than a chunk), counted without its
/// deliveries by `load_without_queues`, and each message counts its queued references, so
/// that it goes with the last one once released, and not before.
#[tokio::test]
async fn version_6_queues_are_upgraded_to_chunks() {
    let Some(pg) = TestPostgres::start("upgrade_6") else {
        return;
    };
    let url = pg.url(&pg.database("upgrade", None).await);
    pg.execute(
        &url,
        &format!(
            "{} INSERT INTO mercurio_meta (key, value) VALUES ('schema_version', '6'); \
             INSERT INTO mercurio_sessions (client_id, protocol_level, session_expiry_interval) \
             VALUES ('a', 5, 3600), ('b', 4, 60); \
             INSERT INTO mercurio_messages (id, topic, payload, qos, retain, properties, \
             expires_at, publisher) VALUES (1, 't/1', '\\x01', 1, false, '\\x', NULL, 'pub'), \
             (2, 't/2', '\\x0203', 2, true, '\\x0b01', 1700000000000, NULL), \
             (3, 't/3', '\\x03', 1, false, '\\x', NULL, NULL); \
             INSERT INTO mercurio_queued (client_id, seq, message_id, qos, retain, \
             subscription_ids, share) SELECT 'a', g, 1, 1, false, '\\x'::bytea, NULL \
             FROM generate_series(1, 300) AS g; \
             INSERT INTO mercurio_queued (client_id, seq, message_id, qos, retain, \
             subscription_ids, share) VALUES ('a', 500, 2, 2, true, '\\x00000005', '$share/g/t/#'), \
             ('b', 7, 2, 1, false, '\\x', NULL); \
             INSERT INTO mercurio_inflight (client_id, packet_id, ord, state, message_id, qos, \
             retain, subscription_ids, share) \
             VALUES ('b', 9, 1, 'awaiting_puback', 3, 1, false, '\\x', NULL);",
            mercurio_storage::postgres::testing::schema_version_6_sql()
        ),
    )
    .await;
    let storage = open(&url).await;
    let lazy = storage.load_without_queues().await.unwrap();
    let backlog = lazy.backlogs.get("a").expect("a's queue is counted");
    assert_eq!(
        (backlog.len, backlog.first_seq, backlog.last_seq),
        (301, 1, 500)
    );
    assert_eq!(lazy.backlogs.get("b").map(|b| b.len), Some(1));
    let queue = storage.load_queue("a").await.unwrap();
    let mut want: Vec<u64> = (1..=300).collect();
    want.push(500);
    assert_eq!(queue.iter().map(|q| q.seq).collect::<Vec<_>>(), want);
    let last = &queue[300].delivery;
    assert_eq!(
        (last.message_id, last.qos, last.retain),
        (2, 2, true),
        "the delivery's own fields"
    );
    assert_eq!(last.share.as_deref(), Some("$share/g/t/#"));
    assert_eq!(last.subscription_ids, [5]);
    storage.close().await.unwrap();
    let storage = open(&url).await;
    let state = storage.load().await.unwrap();
    assert!(state.set_aside.is_empty(), "{:?}", state.set_aside);
    assert_eq!(state.sessions.len(), 2);
    assert_eq!(state.sessions[0].queued.len(), 301);
    assert_eq!(state.sessions[1].queued[0].seq, 7);
    assert_eq!(state.sessions[1].inflight[0].packet_id, 9);
    let mut ids: Vec<u64> = state.messages.iter().map(|m| m.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(
        pg.scalar(
            &url,
            "SELECT string_agg(id || ':' || refs, ',' ORDER BY id) FROM mercurio_messages"
        )
        .await
        .as_deref(),
        Some("1:300,2:2,3:0"),
        "each message counts its queued references"
    );
    let count = "SELECT count(*) FROM mercurio_messages";
    let dequeue = |client_id: &str, seq: u64| Change::MessageDequeued {
        client_id: client_id.into(),
        seq,
    };
    let mut batch: Vec<Change> = (1..=3).map(|id| Change::MessageReleased { id }).collect();
    batch.extend((1..=299).map(|seq| dequeue("a", seq)));
    batch.push(dequeue("b", 7));
    storage.apply(&batch).await.unwrap();
    assert_eq!(
        pg.scalar(&url, count).await.as_deref(),
        Some("3"),
        "1 and 2 still queued, 3 in flight"
    );
    storage
        .apply(&[dequeue("a", 300), dequeue("a", 500)])
        .await
        .unwrap();
    assert_eq!(
        pg.scalar(&url, count).await.as_deref(),
        Some("1"),
        "3 in flight"
    );
    storage.close().await.unwrap();
    let version = pg
        .scalar(
            &url,
            "SELECT value FROM mercurio_meta WHERE key = 'schema_version'",
        )
        .await;
    assert_eq!(
        version,
        Some(mercurio_storage::postgres::SCHEMA_VERSION.to_string())
    );
}

/// A cluster node takes one session out of the database of a node gone
/// (`postgres::peer`): while the old broker serves the database (a fresh heartbeat) the take
/// is refused after its wait; once its heartbeat is stale (a stalled process), the taker
/// ends its connections, fences the database and reads the session whole (subscription,
/// queue, in-flight message, the messages they refer to); the old broker's late write is
/// refused; once finished, the session is gone from the database, for the old broker's
/// next start too.
#[tokio::test]
async fn a_gone_brokers_session_is_taken_from_its_database_and_its_late_write_refused() {
    use mercurio_storage::postgres::{peer, HEARTBEAT_STALE};
    use mercurio_storage::{InflightRecord, InflightState, SubscriptionRecord};

    let Some(pg) = TestPostgres::start("peer_take") else {
        return;
    };
    let url = pg.url(&pg.database("peer", None).await);
    let old = open(&url).await;
    let stored = |id: u64| stored("dev/1", id);
    old.apply(&[
        saved("dev"),
        saved("other"),
        Change::SubscriptionAdded {
            client_id: "dev".into(),
            subscription: SubscriptionRecord::new("dev/#", 1),
        },
        stored(1),
        stored(2),
        Change::MessageQueued {
            client_id: "dev".into(),
            seq: 1,
            delivery: DeliveryRecord::new(2, 1),
        },
        Change::InflightSet {
            client_id: "dev".into(),
            inflight: InflightRecord {
                packet_id: 7,
                delivery: DeliveryRecord::new(1, 1),
                state: InflightState::AwaitingPubAck,
            },
        },
        Change::MessageReleased { id: 1 },
        Change::MessageReleased { id: 2 },
    ])
    .await
    .unwrap();

    // Still served: refused once the wait is over, the old broker untouched.
    let wait = Duration::from_millis(300);
    let err = peer::take_session(&url, "dev", "taker", wait, HEARTBEAT_STALE)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    old.apply(&[saved("still-served")]).await.unwrap();

    // Stalled: its heartbeat frozen.
    freeze_heartbeat(&pg, &url).await;
    let (record, messages, hold) = tokio::time::timeout(
        DEADLINE,
        peer::take_session(&url, "dev", "taker", DEADLINE, HEARTBEAT_STALE),
    )
    .await
    .expect("the take ends")
    .unwrap()
    .expect("the session is there");
    assert_eq!(hold.epoch(), old.epoch() + 1);
    assert_eq!(record.client_id, "dev");
    assert_eq!(record.subscriptions[0].filter, "dev/#");
    assert_eq!(record.queued[0].delivery.message_id, 2);
    assert_eq!(record.inflight[0].packet_id, 7);
    let payloads: Vec<_> = messages
        .iter()
        .map(|m| (m.id, m.message.payload.clone()))
        .collect();
    assert_eq!(payloads, [(1, "m1".into()), (2, "m2".into())]);

    // The stalled broker's late write is refused, and it is told to stop.
    let err = old.apply(&[saved("late")]).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Fenced, "{err}");
    let failed = tokio::time::timeout(DEADLINE, old.failed())
        .await
        .expect("failed resolves");
    assert_eq!(failed.kind(), ErrorKind::Fenced);

    hold.finish().await.unwrap();
    let again = peer::take_session(&url, "dev", "taker", DEADLINE, HEARTBEAT_STALE)
        .await
        .unwrap();
    assert!(again.is_none(), "the session was deleted");
    // The old broker starting again finds the other sessions, not the one taken.
    drop(old);
    let restarted = open(&url).await;
    assert_eq!(session_names(&restarted).await, ["other", "still-served"]);
    restarted.close().await.unwrap();
}

/// A cluster node sweeps the wills of a node gone out of its database
/// (`postgres::peer::sweep_wills`): the database fenced as for a take (its broker's heartbeat
/// stale, 20 s old), the wills due cleared there and returned: one without delay, one
/// whose 10 s delay passed since the broker's last heartbeat (its connection's end); one
/// delayed by an hour is left, and when it is due said: at its session's end (60 s of
/// expiry), sooner than its delay. A second sweep finds nothing due.
#[tokio::test]
async fn a_gone_brokers_due_wills_are_swept_from_its_database_once() {
    use mercurio_storage::postgres::{peer, HEARTBEAT_STALE};
    use mercurio_storage::WillRecord;

    let Some(pg) = TestPostgres::start("peer_sweep") else {
        return;
    };
    let url = pg.url(&pg.database("sweep", None).await);
    let old = open(&url).await;
    let will = |client_id: &str, delay_interval: u32| Change::WillSet {
        client_id: client_id.into(),
        will: WillRecord {
            message: MessageRecord::new(format!("will/{client_id}"), "gone", 1),
            delay_interval,
        },
    };
    old.apply(&[
        saved("now"),
        will("now", 0),
        saved("soon"),
        will("soon", 10),
        saved("later"),
        will("later", 3600),
        saved("plain"),
    ])
    .await
    .unwrap();
    freeze_heartbeat(&pg, &url).await;

    let host = format!("{}a", peer::TAKER_HOST_PREFIX);
    let swept = tokio::time::timeout(
        DEADLINE,
        peer::sweep_wills(&url, &host, DEADLINE, HEARTBEAT_STALE),
    )
    .await
    .expect("the sweep ends")
    .unwrap();
    let due: Vec<(&str, &str)> = swept
        .due
        .iter()
        .map(|r| {
            let w = r.will.as_ref().expect("a will");
            (r.client_id.as_str(), w.message.topic.as_str())
        })
        .collect();
    assert_eq!(due, [("now", "will/now"), ("soon", "will/soon")]);
    let next = swept.next.expect("a will left");
    assert!(
        next > Duration::from_secs(30) && next <= Duration::from_secs(40),
        "{next:?}"
    );
    assert_eq!(
        pg.scalar(
            &url,
            "SELECT string_agg(client_id, ',') FROM mercurio_sessions \
             WHERE will_topic IS NOT NULL"
        )
        .await
        .as_deref(),
        Some("later"),
        "the wills swept are cleared there"
    );

    // A second sweeper (the first's takeover no longer counts as the broker's heartbeat).
    let again = peer::sweep_wills(&url, &host, DEADLINE, HEARTBEAT_STALE)
        .await
        .unwrap();
    assert!(again.due.is_empty(), "swept once");
    assert!(again.next.is_some_and(|n| n > Duration::from_secs(30)));
}
