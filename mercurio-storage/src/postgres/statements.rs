//! The statements a write connection prepares once, single-row and multi-row (`unnest` over
//! one array per column).

use tokio_postgres::{Client, Statement};

use super::leader;
use crate::rows::{DELIVERY_COLUMNS, RETAINED_COLUMNS, STORED_COLUMNS};

/// The statements a write connection prepares once.
pub(super) struct Statements {
    pub(super) fence: Statement,
    pub(super) epoch: Statement,
    pub(super) save_header: Statement,
    pub(super) delete_children: [Statement; 4],
    pub(super) delete_session: Statement,
    pub(super) set_will: Statement,
    pub(super) add_subscription: Statement,
    pub(super) set_inflight: Statement,
    pub(super) add_inbound: Statement,
    /// The multi-row forms, one statement for what a run of changes of one client leaves
    /// in one table (see `plan`).
    pub(super) exists: Statement,
    /// The check that every one of many clients' sessions is stored (a row when all are).
    pub(super) all_exist: Statement,
    /// Queued deliveries, for one client or many (a fan-out): `unqueue` removes positions
    /// (client id and position arrays) from the chunks holding them, rewriting or deleting
    /// those chunks and counting down the messages' references; `queue_chunks` stores
    /// deliveries (one array per column, client ids included) as new chunks, one per client
    /// and 256 positions (`CHUNK_MAX`). A delivery replacing a stored position is removed first.
    pub(super) unqueue: Statement,
    pub(super) queue_chunks: Statement,
    /// Adds to each message's count of queued references (ids, counts); a row only when
    /// every message is stored.
    pub(super) add_refs: Statement,
    pub(super) set_inflight_many: Statement,
    pub(super) remove_inflight_many: Statement,
    pub(super) add_subscriptions: Statement,
    pub(super) remove_subscriptions: Statement,
    pub(super) add_inbound_many: Statement,
    pub(super) remove_inbound_many: Statement,
    pub(super) set_retained_many: Statement,
    pub(super) delete_retained_many: Statement,
    /// The message store: insert (ignoring ids stored already), release, and delete what
    /// is released and referred to by nothing.
    pub(super) store_many: Statement,
    pub(super) release_unreferenced: Statement,
    pub(super) mark_released: Statement,
    pub(super) delete_released: Statement,
    /// A new broker starts: messages nothing refers to go, the others are held by it.
    pub(super) delete_unreferenced: Statement,
    pub(super) hold_all: Statement,
    /// ... but those only stream entries refer to: read back with them, never held.
    pub(super) release_streamed: Statement,
    /// Streams: an entry appended (the stream's row made or moved on), entries trimmed
    /// below an offset, one entry removed, a stream deleted (the last three with the
    /// released messages they leave unreferenced).
    pub(super) stream_define: Statement,
    pub(super) stream_next: Statement,
    pub(super) stream_append: Statement,
    pub(super) stream_trim: Statement,
    pub(super) stream_remove_entry: Statement,
    pub(super) stream_delete_entries: Statement,
    pub(super) stream_delete: Statement,
}

/// Whether nothing refers to the message `mercurio_messages.id`: no queued delivery (its
/// count, `refs`), no in-flight message and no stream entry (their indexes by message).
const UNREFERENCED: &str = "mercurio_messages.refs = 0 AND NOT EXISTS (SELECT 1 \
     FROM mercurio_inflight f WHERE f.message_id = mercurio_messages.id) AND NOT EXISTS \
     (SELECT 1 FROM mercurio_stream_entries e WHERE e.message_id = mercurio_messages.id)";

/// Deletes the stream entries `which` selects and, in the same statement, those of their
/// messages the broker released that nothing else refers to: a cost per entry removed, not
/// per released message (the statement sees the entries as they were before it, hence the
/// entries it removes left out by `which` again).
fn remove_entries(which: &str) -> String {
    format!(
        "WITH gone AS (DELETE FROM mercurio_stream_entries WHERE {which} RETURNING message_id) \
         DELETE FROM mercurio_messages m USING (SELECT DISTINCT message_id FROM gone) g \
         WHERE m.id = g.message_id AND m.released AND m.refs = 0 \
         AND NOT EXISTS (SELECT 1 FROM mercurio_inflight f WHERE f.message_id = m.id) \
         AND NOT EXISTS (SELECT 1 FROM mercurio_stream_entries e \
         WHERE e.message_id = m.id AND NOT (e.{}))",
        which.replace(" AND ", " AND e.")
    )
}

/// The array parameters of a retained message's columns, numbered from 1.
const RETAINED_ARRAYS_FROM_1: &str = "$1::text[], $2::bytea[], $3::bigint[], $4::boolean[], \
     $5::bytea[], $6::bigint[], $7::text[], $8::text[], $9::text[], $10::bigint[]";
/// The array parameters of the [`DELIVERY_COLUMNS`], numbered from 4.
const DELIVERY_ARRAYS_FROM_4: &str =
    "$4::bigint[], $5::bigint[], $6::boolean[], $7::bytea[], $8::text[]";
/// A delivery replaced at the same key.
const DELIVERY_UPDATE: &str = "message_id = excluded.message_id, qos = excluded.qos, \
     retain = excluded.retain, subscription_ids = excluded.subscription_ids, \
     share = excluded.share";

/// Removes positions from the chunks holding them. Parameters: each position (client ids,
/// positions: `$1`, `$2`), and each client's smallest and largest (`$3` to `$5`). The
/// chunks a client's positions may be in are those whose last position is at or above the
/// smallest and whose first is at or below the largest, found through the key (so that
/// positions above every stored one, a fan-out's, find none at once); each chunk holding
/// one of them is rewritten with the deliveries it keeps, or deleted when it keeps none, and
/// each message loses the references removed.
const UNQUEUE: &str = "WITH hit AS (SELECT h.* \
     FROM unnest($3::text[], $4::bigint[], $5::bigint[]) AS s (client_id, lo, hi) \
     CROSS JOIN LATERAL (SELECT c.client_id, c.last_seq, seqs, message_ids, qos, retains, \
     subscription_ids, shares FROM mercurio_queue_chunks c WHERE c.client_id = s.client_id \
     AND c.last_seq >= s.lo AND c.first_seq <= s.hi OFFSET 0) AS h), \
     e AS (SELECT h.client_id, h.last_seq AS chunk, u.*, (h.client_id, u.seq) IN \
     (SELECT * FROM unnest($1::text[], $2::bigint[])) AS removed \
     FROM hit h CROSS JOIN LATERAL unnest(h.seqs, h.message_ids, h.qos, h.retains, \
     h.subscription_ids, h.shares) WITH ORDINALITY \
     AS u (seq, message_id, qos, retain, subscription_ids, share, n)), \
     chg AS (SELECT client_id, chunk, count(*) FILTER (WHERE NOT removed) AS left_n, \
     min(seq) FILTER (WHERE NOT removed) AS lo, max(seq) FILTER (WHERE NOT removed) AS hi, \
     array_agg(seq ORDER BY n) FILTER (WHERE NOT removed) AS seqs, \
     array_agg(message_id ORDER BY n) FILTER (WHERE NOT removed) AS message_ids, \
     array_agg(qos ORDER BY n) FILTER (WHERE NOT removed) AS qos, \
     array_agg(retain ORDER BY n) FILTER (WHERE NOT removed) AS retains, \
     bool_or(subscription_ids <> '\\x'::bytea OR share IS NOT NULL) \
     FILTER (WHERE NOT removed) AS extras, \
     array_agg(coalesce(subscription_ids, '\\x'::bytea) ORDER BY n) FILTER (WHERE NOT removed) \
     AS subscription_ids, \
     array_agg(share ORDER BY n) FILTER (WHERE NOT removed) AS shares \
     FROM e GROUP BY client_id, chunk HAVING bool_or(removed)), \
     kept AS (UPDATE mercurio_queue_chunks c SET first_seq = k.lo, last_seq = k.hi, \
     seqs = k.seqs, message_ids = k.message_ids, qos = k.qos, retains = k.retains, \
     subscription_ids = CASE WHEN k.extras THEN k.subscription_ids END, \
     shares = CASE WHEN k.extras THEN k.shares END FROM chg k \
     WHERE c.client_id = k.client_id AND c.last_seq = k.chunk AND k.left_n > 0), \
     emptied AS (DELETE FROM mercurio_queue_chunks c USING chg k \
     WHERE c.client_id = k.client_id AND c.last_seq = k.chunk AND k.left_n = 0) \
     UPDATE mercurio_messages m SET refs = m.refs - r.n FROM (SELECT message_id, \
     count(*) AS n FROM e WHERE removed GROUP BY message_id) AS r WHERE m.id = r.message_id";

/// Stores deliveries as new chunks (the parameters of `QueueColumns` in `plan`): each
/// chunk's arrays are slices of the delivery arrays; its subscription identifiers and
/// shared subscriptions, when it has any, are gathered from their own arrays.
const QUEUE_CHUNKS: &str = "INSERT INTO mercurio_queue_chunks (client_id, first_seq, \
     last_seq, seqs, message_ids, qos, retains, subscription_ids, shares) \
     SELECT k.client_id, k.first_seq, k.last_seq, ($6::bigint[])[k.lo:k.hi], \
     ($7::bigint[])[k.lo:k.hi], ($8::bigint[])[k.lo:k.hi], ($9::boolean[])[k.lo:k.hi], \
     x.subscription_ids, x.shares \
     FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::int[], $5::int[]) \
     WITH ORDINALITY AS k (client_id, first_seq, last_seq, lo, hi, chunk) \
     LEFT JOIN (SELECT chunk, array_agg(subscription_ids ORDER BY place) AS subscription_ids, \
     array_agg(share ORDER BY place) AS shares \
     FROM unnest($10::bigint[], $11::bigint[], $12::bytea[], $13::text[]) \
     AS e (chunk, place, subscription_ids, share) GROUP BY chunk) AS x ON x.chunk = k.chunk";

impl Statements {
    pub(super) async fn prepare(client: &Client) -> Result<Statements, tokio_postgres::Error> {
        let p = |sql: String| async move { client.prepare(&sql).await };
        Ok(Statements {
            fence: p(format!(
                "SELECT pg_advisory_xact_lock_shared({}, {})",
                leader::LOCK_CLASS,
                leader::FENCE_OBJECT
            ))
            .await?,
            epoch: p("SELECT epoch FROM mercurio_leader WHERE id = 1".into()).await?,
            save_header: p("INSERT INTO mercurio_sessions (client_id, protocol_level, \
                 session_expiry_interval, disconnected_at, username, certificate) \
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (client_id) DO UPDATE SET \
                 protocol_level = excluded.protocol_level, \
                 session_expiry_interval = excluded.session_expiry_interval, \
                 disconnected_at = excluded.disconnected_at, username = excluded.username, \
                 certificate = excluded.certificate"
                .into())
            .await?,
            delete_children: [
                p("DELETE FROM mercurio_subscriptions WHERE client_id = $1".into()).await?,
                p(
                    "WITH gone AS (DELETE FROM mercurio_queue_chunks WHERE client_id = $1 \
                   RETURNING message_ids) UPDATE mercurio_messages m SET refs = m.refs - c.n \
                   FROM (SELECT id, count(*) AS n FROM gone, unnest(gone.message_ids) AS id \
                   GROUP BY id) AS c WHERE m.id = c.id"
                        .into(),
                )
                .await?,
                p("DELETE FROM mercurio_inflight WHERE client_id = $1".into()).await?,
                p("DELETE FROM mercurio_inbound_qos2 WHERE client_id = $1".into()).await?,
            ],
            delete_session: p("DELETE FROM mercurio_sessions WHERE client_id = $1".into()).await?,
            set_will: p(
                "UPDATE mercurio_sessions SET will_topic = $2, will_payload = $3, \
                 will_qos = $4, will_retain = $5, will_properties = $6, will_expires_at = $7, \
                 will_publisher = $8, will_delay_interval = $9 WHERE client_id = $1"
                    .into(),
            )
            .await?,
            add_subscription: p(
                "INSERT INTO mercurio_subscriptions (client_id, filter, qos, \
                 no_local, retain_as_published, retain_handling, subscription_identifier) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (client_id, filter) DO UPDATE \
                 SET qos = excluded.qos, no_local = excluded.no_local, \
                 retain_as_published = excluded.retain_as_published, \
                 retain_handling = excluded.retain_handling, \
                 subscription_identifier = excluded.subscription_identifier"
                    .into(),
            )
            .await?,
            set_inflight: p(format!(
                "INSERT INTO mercurio_inflight (client_id, packet_id, ord, state, \
                 {DELIVERY_COLUMNS}) VALUES ($1, $2, \
                 (SELECT COALESCE(MAX(ord), 0) + 1 FROM mercurio_inflight WHERE client_id = $1), \
                 $3, $4, $5, $6, $7, $8) \
                 ON CONFLICT (client_id, packet_id) DO UPDATE SET state = excluded.state, \
                 {DELIVERY_UPDATE}"
            ))
            .await?,
            add_inbound: p("INSERT INTO mercurio_inbound_qos2 (client_id, packet_id) \
                 VALUES ($1, $2) ON CONFLICT DO NOTHING"
                .into())
            .await?,
            exists: p("SELECT 1 FROM mercurio_sessions WHERE client_id = $1".into()).await?,
            all_exist: p("SELECT 1 WHERE (SELECT count(*) FROM mercurio_sessions \
                 WHERE client_id = ANY($1::text[])) = cardinality($1::text[])"
                .into())
            .await?,
            unqueue: p(UNQUEUE.into()).await?,
            queue_chunks: p(QUEUE_CHUNKS.into()).await?,
            add_refs: p(
                "WITH c AS (SELECT * FROM unnest($1::bigint[], $2::bigint[]) AS c (id, n)), \
                 u AS (UPDATE mercurio_messages m SET refs = m.refs + c.n FROM c \
                 WHERE m.id = c.id RETURNING 1) \
                 SELECT 1 WHERE (SELECT count(*) FROM u) = cardinality($1::bigint[])"
                    .into(),
            )
            .await?,
            // New entries go after every stored one of the client, in the order of the
            // arrays; an entry already stored keeps its place (`ord` is not updated).
            set_inflight_many: p(format!(
                "INSERT INTO mercurio_inflight (client_id, packet_id, ord, state, \
                 {DELIVERY_COLUMNS}) \
                 SELECT $1::text, u.packet_id, b.max_ord + u.n, u.state, u.message_id, u.qos, \
                 u.retain, u.subscription_ids, u.share \
                 FROM unnest($2::bigint[], $3::text[], {DELIVERY_ARRAYS_FROM_4}) \
                 WITH ORDINALITY AS u (packet_id, state, {DELIVERY_COLUMNS}, n), \
                 (SELECT COALESCE(MAX(ord), 0) AS max_ord FROM mercurio_inflight \
                 WHERE client_id = $1) AS b \
                 ON CONFLICT (client_id, packet_id) DO UPDATE SET state = excluded.state, \
                 {DELIVERY_UPDATE}"
            ))
            .await?,
            remove_inflight_many: p("DELETE FROM mercurio_inflight WHERE client_id = $1 \
                 AND packet_id = ANY($2::bigint[])"
                .into())
            .await?,
            add_subscriptions: p(
                "INSERT INTO mercurio_subscriptions (client_id, filter, qos, \
                 no_local, retain_as_published, retain_handling, subscription_identifier) \
                 SELECT $1::text, u.* FROM unnest($2::text[], $3::bigint[], $4::boolean[], \
                 $5::boolean[], $6::bigint[], $7::bigint[]) AS u \
                 ON CONFLICT (client_id, filter) DO UPDATE \
                 SET qos = excluded.qos, no_local = excluded.no_local, \
                 retain_as_published = excluded.retain_as_published, \
                 retain_handling = excluded.retain_handling, \
                 subscription_identifier = excluded.subscription_identifier"
                    .into(),
            )
            .await?,
            remove_subscriptions: p("DELETE FROM mercurio_subscriptions WHERE client_id = $1 \
                 AND filter = ANY($2::text[])"
                .into())
            .await?,
            add_inbound_many: p("INSERT INTO mercurio_inbound_qos2 (client_id, packet_id) \
                 SELECT $1::text, u.* FROM unnest($2::bigint[]) AS u ON CONFLICT DO NOTHING"
                .into())
            .await?,
            remove_inbound_many: p("DELETE FROM mercurio_inbound_qos2 WHERE client_id = $1 \
                 AND packet_id = ANY($2::bigint[])"
                .into())
            .await?,
            set_retained_many: p(format!(
                "INSERT INTO mercurio_retained ({RETAINED_COLUMNS}) \
                 SELECT u.* FROM unnest({RETAINED_ARRAYS_FROM_1}) AS u \
                 ON CONFLICT (topic) DO UPDATE SET \
                 payload = excluded.payload, qos = excluded.qos, retain = excluded.retain, \
                 properties = excluded.properties, expires_at = excluded.expires_at, \
                 publisher = excluded.publisher, \
                 publisher_username = excluded.publisher_username, \
                 publisher_listener = excluded.publisher_listener"
            ))
            .await?,
            delete_retained_many: p(
                "DELETE FROM mercurio_retained WHERE topic = ANY($1::text[])".into(),
            )
            .await?,
            store_many: p(format!(
                "INSERT INTO mercurio_messages ({STORED_COLUMNS}) \
                 SELECT u.* FROM unnest($1::bigint[], $2::text[], $3::bytea[], $4::bigint[], \
                 $5::boolean[], $6::bytea[], $7::bigint[], $8::text[]) AS u \
                 ON CONFLICT (id) DO NOTHING"
            ))
            .await?,
            release_unreferenced: p(format!(
                "DELETE FROM mercurio_messages WHERE id = ANY($1::bigint[]) AND {UNREFERENCED}"
            ))
            .await?,
            mark_released: p(
                "UPDATE mercurio_messages SET released = true WHERE id = ANY($1::bigint[])".into(),
            )
            .await?,
            delete_released: p(format!(
                "DELETE FROM mercurio_messages WHERE released AND {UNREFERENCED}"
            ))
            .await?,
            delete_unreferenced: p(format!(
                "DELETE FROM mercurio_messages WHERE {UNREFERENCED}"
            ))
            .await?,
            hold_all: p("UPDATE mercurio_messages SET released = false WHERE released".into())
                .await?,
            release_streamed: p(
                "UPDATE mercurio_messages SET released = true WHERE refs = 0 AND NOT EXISTS \
                 (SELECT 1 FROM mercurio_inflight f WHERE f.message_id = mercurio_messages.id) \
                 AND EXISTS (SELECT 1 FROM mercurio_stream_entries e \
                 WHERE e.message_id = mercurio_messages.id)"
                    .into(),
            )
            .await?,
            stream_define: p(
                "INSERT INTO mercurio_streams (name, next_offset, filter, max_age, \
                 max_bytes, last_value) VALUES ($1, 1, $2, $3, $4, $5) ON CONFLICT (name) \
                 DO UPDATE SET filter = excluded.filter, max_age = excluded.max_age, \
                 max_bytes = excluded.max_bytes, last_value = excluded.last_value"
                    .into(),
            )
            .await?,
            stream_next: p(
                "INSERT INTO mercurio_streams (name, next_offset) VALUES ($1, $2) \
                 ON CONFLICT (name) DO UPDATE \
                 SET next_offset = GREATEST(mercurio_streams.next_offset, excluded.next_offset)"
                    .into(),
            )
            .await?,
            stream_append: p(
                "INSERT INTO mercurio_stream_entries (stream, entry_offset, \
                 time_ms, message_id) SELECT $1, a.entry_offset, a.time_ms, a.message_id \
                 FROM unnest($2::bigint[], $3::bigint[], $4::bigint[]) \
                 AS a(entry_offset, time_ms, message_id) \
                 ON CONFLICT (stream, entry_offset) DO UPDATE \
                 SET time_ms = excluded.time_ms, message_id = excluded.message_id"
                    .into(),
            )
            .await?,
            stream_trim: p(remove_entries("stream = $1 AND entry_offset < $2")).await?,
            stream_remove_entry: p(remove_entries("stream = $1 AND entry_offset = $2")).await?,
            stream_delete_entries: p(remove_entries("stream = $1")).await?,
            stream_delete: p("DELETE FROM mercurio_streams WHERE name = $1".into()).await?,
        })
    }
}
