//! The tables of the PostgreSQL backend and their version: created or updated by the broker
//! that serves (a standby migrates only once it serves); a newer version is refused.

use tokio_postgres::Client;

use super::classify;
use crate::error::StorageError;

/// The schema version this build writes and reads (`mercurio_meta.schema_version`).
///
/// 2: write transactions are fenced by a transaction-level advisory lock instead of a row
/// lock on `mercurio_leader` (which made the heartbeat wait behind long writes); an older
/// broker, which fences differently, must not serve these tables; and
/// `mercurio_sessions.username`. 3: `mercurio_sessions.certificate`, and `share` (a queued
/// or in-flight message's shared subscription) in `mercurio_queued`, `mercurio_inflight` and
/// `mercurio_retained`. 4: the message store: each message once in `mercurio_messages`, and
/// `mercurio_queued` / `mercurio_inflight` rows refer to it (`message_id`) with the
/// delivery's QoS, RETAIN flag, subscription identifiers and shared subscription; from 3, each
/// queued or in-flight row becomes one message and one reference. 5: `mercurio_access`, the
/// access records (users, groups, roles) of `[auth] backend = "storage"`. 6: streams
/// (`mercurio_streams`, and `mercurio_stream_entries` referring to the message store). 7:
/// queues in chunks (`mercurio_queue_chunks`: a row holds consecutive deliveries of one
/// session as arrays, one element per delivery), and each message counts the queued
/// deliveries that refer to it (`mercurio_messages.refs`); `mercurio_queued` becomes a view
/// of the chunks, one row per delivery as before. From 6, each session's queue is moved
/// into chunks of at most [`CHUNK_MAX`] deliveries and each message's count set. 8: a
/// retained message's publisher's user name and listener port
/// (`mercurio_retained.publisher_username`, `publisher_listener`, for `check_retain_source`;
/// NULL in the rows of older versions).
pub const SCHEMA_VERSION: i64 = 8;

/// From version 7 to 8: who published a retained message, as its access check needs.
const TO_8: &str = "ALTER TABLE mercurio_retained ADD COLUMN IF NOT EXISTS publisher_username text;
ALTER TABLE mercurio_retained ADD COLUMN IF NOT EXISTS publisher_listener bigint;";

/// Most deliveries in one chunk of `mercurio_queue_chunks` (a removal rewrites the chunks it
/// touches, so they stay small).
pub(crate) const CHUNK_MAX: usize = 256;

/// From version 4 to 5: the access records.
const TO_5: &str = "CREATE TABLE IF NOT EXISTS mercurio_access (
    kind text NOT NULL,
    name text NOT NULL,
    body text NOT NULL,
    PRIMARY KEY (kind, name)
);";

/// From version 5 to 6: the streams.
const TO_6: &str = r"CREATE TABLE IF NOT EXISTS mercurio_streams (
    name text PRIMARY KEY,
    next_offset bigint NOT NULL,
    filter text,
    max_age bigint,
    max_bytes bigint,
    last_value boolean
);
CREATE TABLE IF NOT EXISTS mercurio_stream_entries (
    stream text NOT NULL,
    entry_offset bigint NOT NULL,
    time_ms bigint NOT NULL,
    message_id bigint NOT NULL REFERENCES mercurio_messages (id),
    PRIMARY KEY (stream, entry_offset)
);
CREATE INDEX IF NOT EXISTS mercurio_stream_entries_message ON mercurio_stream_entries (message_id);
";

/// From version 6 to 7: queues in chunks, and each message's count of queued references.
/// A chunk's arrays are parallel, one element per delivery, ordered by position, with
/// `first_seq` and `last_seq` the smallest and largest; a position is in one chunk at most,
/// but the ranges of a session's chunks may overlap (a position queued below the last one
/// stored goes into a new chunk), so a queue is read ordered by position. The chunks are
/// cut at 256 deliveries here, as [`CHUNK_MAX`] says. `subscription_ids` and `shares` are
/// NULL in a chunk where no delivery has subscription identifiers or a shared subscription
/// (the arrays that remain are padded with NULLs when read together: no identifier, no share). Keyed by their last position: the
/// chunks a removal or a replacement may touch are found from the smallest position it
/// names, so appending to a queue (positions above every stored one) finds none at once.
const TO_7: &str = r"ALTER TABLE mercurio_messages ADD COLUMN refs bigint NOT NULL DEFAULT 0;
CREATE TABLE mercurio_queue_chunks (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    first_seq bigint NOT NULL,
    last_seq bigint NOT NULL,
    seqs bigint[] NOT NULL,
    message_ids bigint[] NOT NULL,
    qos bigint[] NOT NULL,
    retains boolean[] NOT NULL,
    subscription_ids bytea[],
    shares text[],
    PRIMARY KEY (client_id, last_seq)
);
INSERT INTO mercurio_queue_chunks (client_id, first_seq, last_seq, seqs, message_ids, qos,
    retains, subscription_ids, shares)
    SELECT client_id, min(seq), max(seq), array_agg(seq ORDER BY seq),
    array_agg(message_id ORDER BY seq), array_agg(qos ORDER BY seq),
    array_agg(retain ORDER BY seq),
    CASE WHEN bool_or(subscription_ids <> '\x'::bytea OR share IS NOT NULL)
    THEN array_agg(subscription_ids ORDER BY seq) END,
    CASE WHEN bool_or(subscription_ids <> '\x'::bytea OR share IS NOT NULL)
    THEN array_agg(share ORDER BY seq) END
    FROM (SELECT q.*, (row_number() OVER (PARTITION BY client_id ORDER BY seq) - 1) / 256 AS part
    FROM mercurio_queued q) AS d GROUP BY client_id, part;
UPDATE mercurio_messages m SET refs = c.n
    FROM (SELECT message_id, count(*) AS n FROM mercurio_queued GROUP BY message_id) AS c
    WHERE m.id = c.message_id;
DROP TABLE mercurio_queued;
CREATE VIEW mercurio_queued AS
    SELECT c.client_id, e.seq, e.message_id, e.qos, e.retain,
    coalesce(e.subscription_ids, '\x'::bytea) AS subscription_ids, e.share
    FROM mercurio_queue_chunks c, unnest(c.seqs, c.message_ids, c.qos, c.retains,
    c.subscription_ids, c.shares) AS e (seq, message_id, qos, retain, subscription_ids, share);
";

/// The tables up to version 3 (created if missing, completed if older); [`TO_4`] follows.
pub(crate) const SCHEMA_V3: &str = "
CREATE TABLE IF NOT EXISTS mercurio_meta (
    key text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE IF NOT EXISTS mercurio_leader (
    id integer PRIMARY KEY CHECK (id = 1),
    epoch bigint NOT NULL,
    host text NOT NULL,
    pid bigint NOT NULL,
    backend_pids integer[] NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    since timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS mercurio_takeovers (
    epoch bigint PRIMARY KEY,
    host text NOT NULL,
    pid bigint NOT NULL,
    previous_host text,
    previous_heartbeat_at timestamptz,
    at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS mercurio_sessions (
    client_id text PRIMARY KEY,
    protocol_level bigint NOT NULL,
    session_expiry_interval bigint NOT NULL,
    disconnected_at bigint,
    will_topic text,
    will_payload bytea,
    will_qos bigint,
    will_retain boolean,
    will_properties bytea,
    will_expires_at bigint,
    will_publisher text,
    will_delay_interval bigint
);
CREATE TABLE IF NOT EXISTS mercurio_subscriptions (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    filter text NOT NULL,
    qos bigint NOT NULL,
    no_local boolean NOT NULL,
    retain_as_published boolean NOT NULL,
    retain_handling bigint NOT NULL,
    subscription_identifier bigint,
    PRIMARY KEY (client_id, filter)
);
CREATE TABLE IF NOT EXISTS mercurio_queued (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    seq bigint NOT NULL,
    topic text NOT NULL,
    payload bytea NOT NULL,
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    properties bytea NOT NULL,
    expires_at bigint,
    publisher text,
    share text,
    PRIMARY KEY (client_id, seq)
);
CREATE TABLE IF NOT EXISTS mercurio_inflight (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    packet_id bigint NOT NULL,
    ord bigint NOT NULL,
    state text NOT NULL,
    topic text NOT NULL,
    payload bytea NOT NULL,
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    properties bytea NOT NULL,
    expires_at bigint,
    publisher text,
    share text,
    PRIMARY KEY (client_id, packet_id)
);
CREATE TABLE IF NOT EXISTS mercurio_inbound_qos2 (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    packet_id bigint NOT NULL,
    PRIMARY KEY (client_id, packet_id)
);
CREATE TABLE IF NOT EXISTS mercurio_retained (
    topic text PRIMARY KEY,
    payload bytea NOT NULL,
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    properties bytea NOT NULL,
    expires_at bigint,
    publisher text,
    share text
);
ALTER TABLE mercurio_sessions ADD COLUMN IF NOT EXISTS username text;
ALTER TABLE mercurio_sessions ADD COLUMN IF NOT EXISTS certificate text;
ALTER TABLE mercurio_queued ADD COLUMN IF NOT EXISTS share text;
ALTER TABLE mercurio_inflight ADD COLUMN IF NOT EXISTS share text;
ALTER TABLE mercurio_retained ADD COLUMN IF NOT EXISTS share text;
";

/// From version 3 to 4: the message store, and the queued and in-flight tables as
/// references to it.
const TO_4: &str = r"CREATE TABLE mercurio_messages (
    id bigint PRIMARY KEY,
    topic text NOT NULL,
    payload bytea NOT NULL,
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    properties bytea NOT NULL,
    expires_at bigint,
    publisher text,
    released boolean NOT NULL DEFAULT false
);
CREATE INDEX mercurio_messages_released ON mercurio_messages (id) WHERE released;
ALTER TABLE mercurio_queued RENAME TO mercurio_queued_v3;
ALTER TABLE mercurio_queued_v3 RENAME CONSTRAINT mercurio_queued_pkey TO mercurio_queued_v3_pkey;
ALTER TABLE mercurio_inflight RENAME TO mercurio_inflight_v3;
ALTER TABLE mercurio_inflight_v3
    RENAME CONSTRAINT mercurio_inflight_pkey TO mercurio_inflight_v3_pkey;
CREATE TABLE mercurio_queued (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    seq bigint NOT NULL,
    message_id bigint NOT NULL REFERENCES mercurio_messages (id),
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    subscription_ids bytea NOT NULL,
    share text,
    PRIMARY KEY (client_id, seq)
);
CREATE INDEX mercurio_queued_message ON mercurio_queued (message_id);
CREATE TABLE mercurio_inflight (
    client_id text NOT NULL REFERENCES mercurio_sessions (client_id) ON DELETE CASCADE,
    packet_id bigint NOT NULL,
    ord bigint NOT NULL,
    state text NOT NULL,
    message_id bigint NOT NULL REFERENCES mercurio_messages (id),
    qos bigint NOT NULL,
    retain boolean NOT NULL,
    subscription_ids bytea NOT NULL,
    share text,
    PRIMARY KEY (client_id, packet_id)
);
CREATE INDEX mercurio_inflight_message ON mercurio_inflight (message_id);
INSERT INTO mercurio_messages (id, topic, payload, qos, retain, properties, expires_at, publisher)
    SELECT row_number() OVER (ORDER BY client_id, seq), topic, payload, qos, retain, properties,
    expires_at, publisher FROM mercurio_queued_v3;
INSERT INTO mercurio_queued (client_id, seq, message_id, qos, retain, subscription_ids, share)
    SELECT client_id, seq, row_number() OVER (ORDER BY client_id, seq), qos, retain, '\x'::bytea,
    share FROM mercurio_queued_v3;
INSERT INTO mercurio_messages (id, topic, payload, qos, retain, properties, expires_at, publisher)
    SELECT (SELECT count(*) FROM mercurio_queued_v3)
    + row_number() OVER (ORDER BY client_id, ord), topic, payload, qos, retain, properties,
    expires_at, publisher FROM mercurio_inflight_v3;
INSERT INTO mercurio_inflight (client_id, packet_id, ord, state, message_id, qos, retain,
    subscription_ids, share)
    SELECT client_id, packet_id, ord, state, (SELECT count(*) FROM mercurio_queued_v3)
    + row_number() OVER (ORDER BY client_id, ord), qos, retain, '\x'::bytea, share
    FROM mercurio_inflight_v3;
DROP TABLE mercurio_queued_v3;
DROP TABLE mercurio_inflight_v3;
";

/// The SQL of schema version 6 (queues one row per delivery), for the tests of the upgrade.
#[cfg(any(test, feature = "conformance"))]
pub(crate) fn schema_v6() -> String {
    format!("{SCHEMA_V3}{TO_4}{TO_5}{TO_6}")
}

/// The schema version recorded in the database, `None` when it has no Mercurio tables.
pub(crate) async fn schema_version(
    client: &impl tokio_postgres::GenericClient,
) -> Result<Option<i64>, StorageError> {
    let row = client
        .query_one("SELECT to_regclass('mercurio_meta') IS NOT NULL", &[])
        .await
        .map_err(|e| classify(e, "cannot read the schema"))?;
    if !row.get::<_, bool>(0) {
        return Ok(None);
    }
    let row = client
        .query_opt(
            "SELECT value FROM mercurio_meta WHERE key = 'schema_version'",
            &[],
        )
        .await
        .map_err(|e| classify(e, "cannot read the schema version"))?;
    match row {
        None => Ok(Some(0)),
        Some(row) => {
            let value: String = row.get(0);
            value.parse().map(Some).map_err(|_| {
                StorageError::incompatible(format!("schema version {value:?} is not a number"))
            })
        }
    }
}

/// Refuses a schema newer than this build's.
pub(crate) fn check_version(version: Option<i64>) -> Result<(), StorageError> {
    match version {
        Some(v) if v > SCHEMA_VERSION => Err(StorageError::incompatible(format!(
            "the database has schema version {v}, newer than this broker's {SCHEMA_VERSION}: \
             it was written by a newer version of Mercurio"
        ))),
        _ => Ok(()),
    }
}

/// Creates or updates the tables (only the serving broker does).
pub(crate) async fn migrate(client: &mut Client) -> Result<(), StorageError> {
    let tx = client
        .transaction()
        .await
        .map_err(|e| classify(e, "cannot create the schema"))?;
    let version = schema_version(&tx).await?;
    check_version(version)?;
    if version != Some(SCHEMA_VERSION) {
        // The steps are written to run again harmlessly (`IF NOT EXISTS`), and PostgreSQL
        // answers each such step that finds its work done with a NOTICE ("already exists,
        // skipping"), which the broker would log: not news, so not asked for.
        tx.batch_execute("SET LOCAL client_min_messages = warning")
            .await
            .map_err(|e| classify(e, "cannot create the schema"))?;
        if version.is_none_or(|v| v < 4) {
            tx.batch_execute(SCHEMA_V3)
                .await
                .map_err(|e| classify(e, "cannot create the schema"))?;
            tx.batch_execute(TO_4)
                .await
                .map_err(|e| classify(e, "cannot upgrade the schema to version 4"))?;
        }
        if version.is_none_or(|v| v < 5) {
            tx.batch_execute(TO_5)
                .await
                .map_err(|e| classify(e, "cannot upgrade the schema to version 5"))?;
        }
        tx.batch_execute(TO_6)
            .await
            .map_err(|e| classify(e, "cannot upgrade the schema to version 6"))?;
        if version.is_none_or(|v| v < 7) {
            tx.batch_execute(TO_7)
                .await
                .map_err(|e| classify(e, "cannot upgrade the schema to version 7"))?;
        }
        if version.is_none_or(|v| v < 8) {
            tx.batch_execute(TO_8)
                .await
                .map_err(|e| classify(e, "cannot upgrade the schema to version 8"))?;
        }
        tx.execute(
            "INSERT INTO mercurio_meta (key, value) VALUES ('schema_version', $1) \
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            &[&SCHEMA_VERSION.to_string()],
        )
        .await
        .map_err(|e| classify(e, "cannot record the schema version"))?;
    }
    tx.commit()
        .await
        .map_err(|e| classify(e, "cannot create the schema"))
}
