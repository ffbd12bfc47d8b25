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
/// (`mercurio_streams`, and `mercurio_stream_entries` referring to the message store).
pub const SCHEMA_VERSION: i64 = 6;

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
