//! The restore's read: every table in one round of queries, each row read with the checks
//! shared with SQLite ([`crate::rows`]).

use std::collections::{BTreeMap, HashMap};

use tokio_postgres::{Client, Row};

use crate::rows::{
    self, Columns, DELIVERY_COLUMNS, RETAINED_COLUMNS, SESSION_COLUMNS, STORED_COLUMNS,
    STREAM_ENTRY_COLUMNS, SUBSCRIPTION_COLUMNS,
};
use crate::{Backlog, LoadedState, QueuedRecord, SessionRecord, SetAside, StoredMessage};

fn col<'a, T: tokio_postgres::types::FromSql<'a>>(row: &'a Row, i: usize) -> Result<T, String> {
    row.try_get::<_, T>(i).map_err(|e| {
        let name = row.columns().get(i).map(|c| c.name()).unwrap_or("?");
        format!("column {name}: {e}")
    })
}

rows::columns_through!(Row, col);

fn per_client<T>(found: &[Row], read: impl Fn(&Row) -> Result<T, String>) -> rows::PerClient<T> {
    let mut out = rows::PerClient::new();
    for row in found {
        rows::push_per_client(&mut out, row, &read);
    }
    out
}

/// Everything stored: sessions with their collections (those that cannot be read set aside),
/// and the retained messages. With `queues` false, each session's queue is left in storage
/// and counted ([`LoadedState::backlogs`]).
pub(super) async fn load_all(
    client: &Client,
    queues: bool,
) -> Result<LoadedState, tokio_postgres::Error> {
    let subscriptions_sql = format!(
        "SELECT client_id, {SUBSCRIPTION_COLUMNS} FROM mercurio_subscriptions \
         ORDER BY client_id, filter"
    );
    let queued_sql = if queues {
        format!(
            "SELECT client_id, seq, {DELIVERY_COLUMNS} FROM mercurio_queued \
             ORDER BY client_id, seq"
        )
    } else {
        // Counted from the chunks' arrays, not read delivery by delivery.
        "SELECT client_id, sum(cardinality(seqs))::bigint, min(first_seq), max(last_seq) \
         FROM mercurio_queue_chunks GROUP BY client_id"
            .to_string()
    };
    let inflight_sql = format!(
        "SELECT client_id, packet_id, state, {DELIVERY_COLUMNS} FROM mercurio_inflight \
         ORDER BY client_id, ord"
    );
    let sessions_sql =
        format!("SELECT {SESSION_COLUMNS} FROM mercurio_sessions ORDER BY client_id");
    let retained_sql = format!("SELECT {RETAINED_COLUMNS} FROM mercurio_retained ORDER BY topic");
    let messages_sql =
        format!("SELECT {STORED_COLUMNS} FROM mercurio_messages WHERE NOT released ORDER BY id");
    let (subs, queued, inflight, inbound, sessions, retained, messages, streams, max_id) = tokio::try_join!(
        client.query(&subscriptions_sql, &[]),
        client.query(&queued_sql, &[]),
        client.query(&inflight_sql, &[]),
        client.query(
            "SELECT client_id, packet_id FROM mercurio_inbound_qos2 \
             ORDER BY client_id, packet_id",
            &[],
        ),
        client.query(&sessions_sql, &[]),
        client.query(&retained_sql, &[]),
        client.query(&messages_sql, &[]),
        // Each stream's counters, not its entries.
        client.query(
            "SELECT s.name, s.next_offset, min(e.entry_offset), \
             (array_agg(e.time_ms ORDER BY e.entry_offset))[1], count(e.entry_offset), \
             coalesce(sum(octet_length(m.topic) + octet_length(m.payload) \
             + octet_length(m.properties)), 0)::bigint, \
             s.filter, s.max_age, s.max_bytes, s.last_value \
             FROM mercurio_streams s LEFT JOIN (mercurio_stream_entries e \
             JOIN mercurio_messages m ON m.id = e.message_id) ON e.stream = s.name \
             GROUP BY s.name, s.next_offset, s.filter, s.max_age, s.max_bytes, s.last_value \
             ORDER BY s.name",
            &[],
        ),
        client.query_one("SELECT coalesce(max(id), 0) FROM mercurio_messages", &[]),
    )?;
    let (queued, mut backlogs) = if queues {
        (per_client(&queued, rows::queued), HashMap::new())
    } else {
        (rows::PerClient::new(), backlogs(&queued)?)
    };
    let mut children = rows::Sessions {
        subscriptions: per_client(&subs, rows::subscription),
        queued,
        inflight: per_client(&inflight, rows::inflight),
        inbound: per_client(&inbound, rows::inbound),
    };
    let mut state = LoadedState::default();
    for row in &sessions {
        let client_id = match row.text(0) {
            Ok(c) => c,
            Err(cause) => {
                state.set_aside.push(SetAside {
                    client_id: String::new(),
                    cause,
                });
                continue;
            }
        };
        match children.read(&client_id, row) {
            Ok(record) => {
                if let Some(backlog) = backlogs.remove(&record.client_id) {
                    state.backlogs.insert(record.client_id.clone(), backlog);
                }
                state.sessions.push(record);
            }
            Err(cause) => state.set_aside.push(SetAside { client_id, cause }),
        }
    }
    let mut by_topic = BTreeMap::new();
    for row in &retained {
        rows::retained(row, &mut by_topic);
    }
    state.retained = by_topic.into_values().collect();
    rows::attach_messages(&mut state, messages.iter().map(rows::stored));
    let unsigned = |v: i64| u64::try_from(v).unwrap_or(0);
    state.max_message_id = unsigned(max_id.try_get(0)?);
    for row in &streams {
        let next_offset = unsigned(row.try_get(1)?);
        let definition = match row.try_get::<_, Option<String>>(6)? {
            Some(filter) => Some(crate::StreamDefinition {
                filter,
                max_age: unsigned(row.try_get::<_, Option<i64>>(7)?.unwrap_or(0)),
                max_bytes: unsigned(row.try_get::<_, Option<i64>>(8)?.unwrap_or(0)),
                last_value: row.try_get::<_, Option<bool>>(9)?.unwrap_or(false),
            }),
            None => None,
        };
        state.streams.push(crate::StreamRecord {
            name: row.try_get(0)?,
            next_offset,
            first_offset: row
                .try_get::<_, Option<i64>>(2)?
                .map_or(next_offset, unsigned),
            first_time_ms: unsigned(row.try_get::<_, Option<i64>>(3)?.unwrap_or(0)),
            messages: unsigned(row.try_get(4)?),
            bytes: unsigned(row.try_get(5)?),
            definition,
        });
    }
    Ok(state)
}

/// Up to `max` entries of `stream` from `from_offset` on, appended at `from_time_ms` or
/// later, with their messages (an unreadable one left out), stopping after the entry whose
/// message brings the batch to `max_bytes`: the running sum is computed by the database, so
/// no more than that crosses the connection. The entries are limited before the join, so a
/// read joins at most `max` messages however long the rest of the stream is.
pub(super) async fn read_stream(
    client: &Client,
    stream: &str,
    from_offset: u64,
    from_time_ms: u64,
    max: usize,
    max_bytes: u64,
) -> Result<Vec<crate::StreamEntryRead>, tokio_postgres::Error> {
    let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    // A message's size as `MessageRecord::size` counts it: topic, payload and properties.
    let size = "octet_length(m.topic) + octet_length(m.payload) \
                + coalesce(octet_length(m.properties), 0)";
    let sql = format!(
        "SELECT * FROM (SELECT {STREAM_ENTRY_COLUMNS}, \
         sum({size}) OVER (ORDER BY e.entry_offset) - ({size}) AS bytes_before \
         FROM (SELECT * FROM mercurio_stream_entries WHERE stream = $1 \
         AND entry_offset >= $2 AND time_ms >= $3 ORDER BY entry_offset LIMIT $4) e \
         JOIN mercurio_messages m ON m.id = e.message_id) r \
         WHERE r.bytes_before < $5 ORDER BY r.entry_offset"
    );
    let found = client
        .query(
            &sql,
            &[
                &stream,
                &clamp(from_offset),
                &clamp(from_time_ms),
                &clamp(max as u64),
                &clamp(max_bytes),
            ],
        )
        .await?;
    Ok(found
        .iter()
        .filter_map(|r| rows::stream_entry(r).ok())
        .collect())
}

/// Each queue's count and positions, per client, from rows of `client_id, count, first
/// position, last position`.
fn backlogs(found: &[Row]) -> Result<HashMap<String, Backlog>, tokio_postgres::Error> {
    let unsigned = |v: i64| u64::try_from(v).unwrap_or(0);
    let mut out = HashMap::new();
    for row in found {
        let client_id: String = row.try_get(0)?;
        let len = unsigned(row.try_get(1)?);
        if len > 0 {
            out.insert(
                client_id,
                Backlog {
                    len,
                    first_seq: unsigned(row.try_get(2)?),
                    last_seq: unsigned(row.try_get(3)?),
                },
            );
        }
    }
    Ok(out)
}

/// The readable stored messages among `ids`, sorted by id.
pub(super) async fn load_messages(
    client: &Client,
    ids: &[u64],
) -> Result<Vec<StoredMessage>, tokio_postgres::Error> {
    let ids: Vec<i64> = ids
        .iter()
        .filter_map(|id| i64::try_from(*id).ok())
        .collect();
    let sql = format!(
        "SELECT {STORED_COLUMNS} FROM mercurio_messages WHERE id = ANY($1::bigint[]) ORDER BY id"
    );
    let found = client.query(&sql, &[&ids]).await?;
    Ok(found.iter().filter_map(|r| rows::stored(r).ok()).collect())
}

/// The queue of `client_id`, in order; `Err` names a row that cannot be read.
pub(super) async fn load_queue(
    client: &Client,
    client_id: &str,
) -> Result<Result<Vec<QueuedRecord>, String>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT client_id, seq, {DELIVERY_COLUMNS} FROM mercurio_queued WHERE client_id = $1 \
         ORDER BY seq"
    );
    let found = client.query(&sql, &[&client_id]).await?;
    Ok(found.iter().map(rows::queued).collect())
}

/// The session of `client_id` with its collections and its queue, and the messages they
/// refer to: `Ok(None)` when the database has no such session, `Err` (inside) naming a row
/// that cannot be read.
pub(super) async fn load_session(
    client: &Client,
    client_id: &str,
) -> Result<Result<Option<(SessionRecord, Vec<StoredMessage>)>, String>, tokio_postgres::Error> {
    let subscriptions_sql = format!(
        "SELECT client_id, {SUBSCRIPTION_COLUMNS} FROM mercurio_subscriptions \
         WHERE client_id = $1 ORDER BY filter"
    );
    let queued_sql = format!(
        "SELECT client_id, seq, {DELIVERY_COLUMNS} FROM mercurio_queued WHERE client_id = $1 \
         ORDER BY seq"
    );
    let inflight_sql = format!(
        "SELECT client_id, packet_id, state, {DELIVERY_COLUMNS} FROM mercurio_inflight \
         WHERE client_id = $1 ORDER BY ord"
    );
    let session_sql =
        format!("SELECT {SESSION_COLUMNS} FROM mercurio_sessions WHERE client_id = $1");
    let id: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&client_id];
    let (subs, queued, inflight, inbound, session) = tokio::try_join!(
        client.query(&subscriptions_sql, &id),
        client.query(&queued_sql, &id),
        client.query(&inflight_sql, &id),
        client.query(
            "SELECT client_id, packet_id FROM mercurio_inbound_qos2 WHERE client_id = $1 \
             ORDER BY packet_id",
            &id,
        ),
        client.query_opt(&session_sql, &id),
    )?;
    let Some(row) = session else {
        return Ok(Ok(None));
    };
    let mut children = rows::Sessions {
        subscriptions: per_client(&subs, rows::subscription),
        queued: per_client(&queued, rows::queued),
        inflight: per_client(&inflight, rows::inflight),
        inbound: per_client(&inbound, rows::inbound),
    };
    let record = match children.read(client_id, &row) {
        Ok(record) => record,
        Err(cause) => return Ok(Err(cause)),
    };
    let mut ids: Vec<u64> = record
        .queued
        .iter()
        .map(|q| q.delivery.message_id)
        .chain(record.inflight.iter().map(|i| i.delivery.message_id))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    let messages = load_messages(client, &ids).await?;
    if messages.len() != ids.len() {
        return Ok(Err(format!(
            "{} of the {} messages its queue and in-flight list refer to cannot be read",
            ids.len() - messages.len(),
            ids.len()
        )));
    }
    Ok(Ok(Some((record, messages))))
}

/// The sessions that hold a will, each without its collections; a row that cannot be read
/// is given back as its client identifier and why.
pub(super) async fn load_wills(
    client: &Client,
) -> Result<Vec<Result<SessionRecord, (String, String)>>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT {SESSION_COLUMNS} FROM mercurio_sessions WHERE will_topic IS NOT NULL \
         ORDER BY client_id"
    );
    let found = client.query(&sql, &[]).await?;
    let mut none = rows::Sessions::default();
    Ok(found
        .iter()
        .map(|row| {
            let client_id: String = row.try_get(0).unwrap_or_default();
            none.read(&client_id, row)
                .map_err(|cause| (client_id, cause))
        })
        .collect())
}
