//! Queued deliveries in chunks: a session's queue is stored as rows of `queue_chunks`, each
//! holding the deliveries of consecutive positions (`first_seq` to `last_seq`) as a JSON
//! array, one `[seq, message_id, qos, retain, subscription_ids (hex), share]` per delivery.
//!
//! Why: a message fanned out to many offline sessions adds one delivery to each of their
//! queues. One row per delivery, keyed by client and position, is an insertion at a
//! different place of the table for every session, and SQLite wrote about 30,000 of them a
//! second; a batch writes instead one chunk per session with every delivery the batch queues
//! for it. The view `queued` shows one row per delivery, as the table of schema 4 did.
//!
//! The changes of one client's queue in a batch are gathered ([`QueueChanges`]) and written
//! together when the batch ends, or before a change that replaces or deletes the session:
//! the chunks holding the positions they touch are read, merged with them, and written again
//! (appending to a queue reads nothing). Each delivery added or removed is counted in the
//! batch's [`Refs`].

use std::collections::{BTreeMap, HashMap};

use rusqlite::{params, Transaction};

use super::to_i64;
use crate::records::{DeliveryRecord, QueuedRecord};
use crate::refs::Refs;
use crate::rows;

/// Most deliveries in one chunk: a removal rewrites the chunk it is in.
const CHUNK_MAX: usize = 256;

/// Reads each delivery of the chunks of the `WHERE` clause that follows, as the columns
/// [`rows::queued`] reads: client id, seq, then the delivery's columns.
pub(super) const CHUNK_ENTRIES: &str = "SELECT c.client_id, e.value ->> 0, e.value ->> 1, \
     e.value ->> 2, e.value ->> 3, unhex(e.value ->> 4), e.value ->> 5 \
     FROM queue_chunks AS c, json_each(c.entries) AS e";

/// The queue changes of one batch, per client, in order, until written.
#[derive(Default)]
pub(super) struct QueueChanges<'c> {
    /// Per client: each position touched, with the index of its first change and what the
    /// last change leaves there (`None`: removed).
    clients: HashMap<&'c str, BTreeMap<u64, (usize, Option<&'c DeliveryRecord>)>>,
}

impl<'c> QueueChanges<'c> {
    /// Change `index` queues `delivery` at `seq` (`Some`) or removes what is queued there.
    pub(super) fn add(
        &mut self,
        client_id: &'c str,
        seq: u64,
        index: usize,
        delivery: Option<&'c DeliveryRecord>,
    ) {
        self.clients
            .entry(client_id)
            .or_default()
            .entry(seq)
            .or_insert((index, None))
            .1 = delivery;
    }

    /// Writes the changes gathered for `client_id`, if any.
    pub(super) fn write_client(
        &mut self,
        tx: &Transaction<'_>,
        client_id: &str,
        refs: &mut Refs,
    ) -> rusqlite::Result<()> {
        match self.clients.remove(client_id) {
            Some(changes) => write(tx, client_id, &changes, refs),
            None => Ok(()),
        }
    }

    /// Writes every change gathered.
    pub(super) fn write_all(&mut self, tx: &Transaction<'_>, refs: &mut Refs) -> rusqlite::Result<()> {
        for (client_id, changes) in std::mem::take(&mut self.clients) {
            write(tx, client_id, &changes, refs)?;
        }
        Ok(())
    }
}

/// Merges one client's `changes` into its stored chunks.
fn write(
    tx: &Transaction<'_>,
    client_id: &str,
    changes: &BTreeMap<u64, (usize, Option<&DeliveryRecord>)>,
    refs: &mut Refs,
) -> rusqlite::Result<()> {
    let (Some(&min), Some(&max)) = (changes.keys().next(), changes.keys().next_back()) else {
        return Ok(());
    };
    // The chunks holding a touched position: the last one starting at or before `min` (if it
    // reaches `min`), and those starting after it up to `max`.
    let mut firsts: Vec<i64> = Vec::new();
    {
        let mut before = tx.prepare_cached(
            "SELECT first_seq, last_seq FROM queue_chunks WHERE client_id = ?1 AND first_seq <= ?2 \
             ORDER BY first_seq DESC LIMIT 1",
        )?;
        let mut found = before.query(params![client_id, to_i64(min)])?;
        if let Some(row) = found.next()? {
            let (first, last): (i64, i64) = (row.get(0)?, row.get(1)?);
            if last >= to_i64(min) {
                firsts.push(first);
            }
        }
    }
    {
        let mut within = tx.prepare_cached(
            "SELECT first_seq FROM queue_chunks WHERE client_id = ?1 AND first_seq > ?2 \
             AND first_seq <= ?3",
        )?;
        let found = within.query_map(params![client_id, to_i64(min), to_i64(max)], |r| {
            r.get::<_, i64>(0)
        })?;
        for first in found {
            firsts.push(first?);
        }
    }
    let mut merged: BTreeMap<u64, DeliveryRecord> = BTreeMap::new();
    for first in firsts {
        {
            let mut entries = tx.prepare_cached(&format!(
                "{CHUNK_ENTRIES} WHERE c.client_id = ?1 AND c.first_seq = ?2"
            ))?;
            let mut found = entries.query(params![client_id, first])?;
            while let Some(row) = found.next()? {
                let q = rows::queued(row).map_err(|e| {
                    rusqlite::Error::ToSqlConversionFailure(
                        format!("queued message of {client_id}: {e}").into(),
                    )
                })?;
                merged.insert(q.seq, q.delivery);
            }
        }
        tx.prepare_cached("DELETE FROM queue_chunks WHERE client_id = ?1 AND first_seq = ?2")?
            .execute(params![client_id, first])?;
    }
    for (&seq, &(index, delivery)) in changes {
        if let Some(old) = merged.remove(&seq) {
            refs.remove(old.message_id, 1);
        }
        if let Some(d) = delivery {
            refs.add(d.message_id, index);
            merged.insert(seq, d.clone());
        }
    }
    let entries: Vec<(u64, &DeliveryRecord)> = merged.iter().map(|(s, d)| (*s, d)).collect();
    insert_chunks(tx, client_id, &entries)
}

/// Writes `entries` (sorted by seq, none of them stored) as new chunks.
pub(super) fn insert_chunks(
    tx: &Transaction<'_>,
    client_id: &str,
    entries: &[(u64, &DeliveryRecord)],
) -> rusqlite::Result<()> {
    let mut insert = tx.prepare_cached(
        "INSERT INTO queue_chunks (client_id, first_seq, last_seq, entries) \
         VALUES (?1, ?2, ?3, ?4)",
    )?;
    for chunk in entries.chunks(CHUNK_MAX) {
        let (Some(first), Some(last)) = (chunk.first(), chunk.last()) else {
            continue;
        };
        insert.execute(params![
            client_id,
            to_i64(first.0),
            to_i64(last.0),
            encode(chunk)
        ])?;
    }
    Ok(())
}

/// Writes a whole queue, with the references it adds (change `index`).
pub(super) fn insert_queue(
    tx: &Transaction<'_>,
    client_id: &str,
    queued: &[QueuedRecord],
    index: usize,
    refs: &mut Refs,
) -> rusqlite::Result<()> {
    let mut entries: Vec<(u64, &DeliveryRecord)> = Vec::with_capacity(queued.len());
    for q in queued {
        refs.add(q.delivery.message_id, index);
        entries.push((q.seq, &q.delivery));
    }
    entries.sort_by_key(|(seq, _)| *seq);
    // A position given twice keeps the last.
    entries.reverse();
    entries.dedup_by_key(|(seq, _)| *seq);
    entries.reverse();
    insert_chunks(tx, client_id, &entries)
}

/// Deletes the queue of `client_id`, counting the references it held.
pub(super) fn delete_queue(
    tx: &Transaction<'_>,
    client_id: &str,
    refs: &mut Refs,
) -> rusqlite::Result<()> {
    {
        let mut held = tx.prepare_cached(
            "SELECT e.value ->> 1, count(*) FROM queue_chunks AS c, json_each(c.entries) AS e \
             WHERE c.client_id = ?1 GROUP BY 1",
        )?;
        let found = held.query_map([client_id], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
        for row in found {
            let (id, n) = row?;
            refs.remove(u64::try_from(id).unwrap_or(0), n);
        }
    }
    tx.prepare_cached("DELETE FROM queue_chunks WHERE client_id = ?1")?
        .execute([client_id])?;
    Ok(())
}

/// The JSON array of a chunk's deliveries.
fn encode(entries: &[(u64, &DeliveryRecord)]) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(entries.len() * 24 + 2);
    out.push('[');
    for (i, (seq, d)) in entries.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            "[{seq},{},{},{},\"",
            d.message_id,
            d.qos,
            u8::from(d.retain)
        );
        for byte in rows::encode_ids(&d.subscription_ids) {
            let _ = write!(out, "{byte:02x}");
        }
        out.push_str("\",");
        match &d.share {
            Some(share) => json_string(&mut out, share),
            None => out.push_str("null"),
        }
        out.push(']');
    }
    out.push(']');
    out
}

/// `s` as a JSON string.
fn json_string(out: &mut String, s: &str) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deliveries_are_encoded_as_json_arrays() {
        let mut d = DeliveryRecord::new(7, 1);
        d.subscription_ids = vec![1, 258];
        d.share = Some("$share/g/\"a\\b\n".to_string());
        let plain = DeliveryRecord::new(8, 2);
        assert_eq!(
            encode(&[(3, &d), (4, &plain)]),
            r#"[[3,7,1,0,"0000000100000102","$share/g/\"a\\b\u000a"],[4,8,2,0,"",null]]"#
        );
    }
}
