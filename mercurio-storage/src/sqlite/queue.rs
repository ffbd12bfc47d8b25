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
//! (appending to a queue reads the positions of its last chunk, not its deliveries). Each
//! delivery added or removed is counted in the batch's [`Refs`]. Chunks never overlap: a
//! chunk's positions are written again only together with every chunk they would overlap.

use std::collections::{BTreeMap, HashMap};

use rusqlite::{params, Connection, Transaction};

use super::to_i64;
use crate::records::{DeliveryRecord, QueuedRecord};
use crate::refs::Refs;
use crate::rows;

/// Most deliveries in one chunk: a removal rewrites the chunk it is in.
const CHUNK_MAX: usize = 256;

/// Every stored queue, per client, in order (a chunk that cannot be read sets its session
/// aside).
pub(super) fn load_all(conn: &Connection) -> rusqlite::Result<rows::PerClient<QueuedRecord>> {
    let mut out = rows::PerClient::new();
    let mut stmt =
        conn.prepare("SELECT client_id, entries FROM queue_chunks ORDER BY client_id, first_seq")?;
    let mut found = stmt.query([])?;
    while let Some(row) = found.next()? {
        let Ok(client_id) = row.get::<_, String>(0) else {
            continue;
        };
        let entries = row
            .get::<_, String>(1)
            .map_err(|e| e.to_string())
            .and_then(|text| decode(&text))
            .map_err(|e| format!("queued messages: {e}"));
        let entry = out.entry(client_id).or_insert_with(|| Ok(Vec::new()));
        match (entry.as_mut(), entries) {
            (Ok(list), Ok(mut more)) => list.append(&mut more),
            (Ok(_), Err(e)) => *entry = Err(e),
            (Err(_), _) => {}
        }
    }
    Ok(out)
}

/// Each stored queue's count and positions, per client, without reading its deliveries
/// (SQLite counts each chunk's JSON array). A chunk that is not a JSON array sets its session
/// aside, as [`load_all`] would.
pub(super) fn load_backlogs(
    conn: &Connection,
) -> rusqlite::Result<(
    HashMap<String, crate::Backlog>,
    rows::PerClient<QueuedRecord>,
)> {
    let mut backlogs = HashMap::new();
    let mut damaged = rows::PerClient::new();
    let mut stmt = conn.prepare(
        "SELECT client_id, min(readable), sum(iif(readable, json_array_length(entries), 0)), \
         min(first_seq), max(last_seq) FROM (SELECT client_id, entries, first_seq, last_seq, \
         CASE WHEN json_valid(entries) THEN json_type(entries) = 'array' ELSE 0 END AS readable \
         FROM queue_chunks) GROUP BY client_id",
    )?;
    let mut found = stmt.query([])?;
    while let Some(row) = found.next()? {
        let Ok(client_id) = row.get::<_, String>(0) else {
            continue;
        };
        let readable: bool = row.get::<_, Option<bool>>(1)?.unwrap_or(false);
        let len = u64::try_from(row.get::<_, i64>(2)?).unwrap_or(0);
        let first_seq = u64::try_from(row.get::<_, i64>(3)?).unwrap_or(0);
        let last_seq = u64::try_from(row.get::<_, i64>(4)?).unwrap_or(0);
        if !readable {
            damaged.insert(
                client_id,
                Err("queued messages: not a JSON array".to_string()),
            );
        } else if len > 0 {
            backlogs.insert(
                client_id,
                crate::Backlog {
                    len,
                    first_seq,
                    last_seq,
                },
            );
        }
    }
    Ok((backlogs, damaged))
}

/// The queue of `client_id`, in order; `Err` names a chunk that cannot be read.
pub(super) fn load_one(
    conn: &Connection,
    client_id: &str,
) -> rusqlite::Result<Result<Vec<QueuedRecord>, String>> {
    let mut stmt = conn.prepare_cached(
        "SELECT entries FROM queue_chunks WHERE client_id = ?1 ORDER BY first_seq",
    )?;
    let mut found = stmt.query([client_id])?;
    let mut out = Vec::new();
    while let Some(row) = found.next()? {
        let text: String = match row.get(0) {
            Ok(text) => text,
            Err(e) => return Ok(Err(format!("queued messages: {e}"))),
        };
        match decode(&text) {
            Ok(mut more) => out.append(&mut more),
            Err(e) => return Ok(Err(format!("queued messages: {e}"))),
        }
    }
    Ok(Ok(out))
}

/// The deliveries of the chunk of `client_id` starting at `first`.
fn read_chunk(
    tx: &Transaction<'_>,
    client_id: &str,
    first: i64,
) -> rusqlite::Result<Vec<QueuedRecord>> {
    let text: String = tx
        .prepare_cached("SELECT entries FROM queue_chunks WHERE client_id = ?1 AND first_seq = ?2")?
        .query_row(params![client_id, first], |r| r.get(0))?;
    decode(&text).map_err(|e| {
        rusqlite::Error::ToSqlConversionFailure(
            format!("queued messages of {client_id}: {e}").into(),
        )
    })
}

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
    pub(super) fn write_all(
        &mut self,
        tx: &Transaction<'_>,
        refs: &mut Refs,
    ) -> rusqlite::Result<()> {
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
    // The chunks holding a touched position: from the last one starting at or before `max`
    // down to the first that ends before `min` (appending to a queue reads one row).
    let mut firsts: Vec<i64> = Vec::new();
    {
        let mut down = tx.prepare_cached(
            "SELECT first_seq, last_seq FROM queue_chunks WHERE client_id = ?1 AND first_seq <= ?2 \
             ORDER BY first_seq DESC",
        )?;
        let mut found = down.query(params![client_id, to_i64(max)])?;
        while let Some(row) = found.next()? {
            let (first, last): (i64, i64) = (row.get(0)?, row.get(1)?);
            if last < to_i64(min) {
                break;
            }
            firsts.push(first);
        }
    }
    let mut merged: BTreeMap<u64, DeliveryRecord> = BTreeMap::new();
    for first in firsts {
        for q in read_chunk(tx, client_id, first)? {
            merged.insert(q.seq, q.delivery);
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

/// Deletes the queue of `client_id`, counting the references it held (a chunk that cannot be
/// read is deleted without: its messages go at the next start if nothing else refers to
/// them).
pub(super) fn delete_queue(
    tx: &Transaction<'_>,
    client_id: &str,
    refs: &mut Refs,
) -> rusqlite::Result<()> {
    {
        let mut held =
            tx.prepare_cached("SELECT entries FROM queue_chunks WHERE client_id = ?1")?;
        let found = held.query_map([client_id], |r| r.get::<_, String>(0))?;
        for text in found {
            for q in decode(&text?).unwrap_or_default() {
                refs.remove(q.delivery.message_id, 1);
            }
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
        out.push('[');
        push_uint(&mut out, *seq);
        out.push(',');
        push_uint(&mut out, d.message_id);
        out.push(',');
        push_uint(&mut out, u64::from(d.qos));
        out.push_str(if d.retain { ",1,\"" } else { ",0,\"" });
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

/// The deliveries of a chunk's JSON array ([`encode`]'s form; also what SQLite's `json_array`
/// wrote when the database was upgraded), read without SQLite's JSON functions: a restart
/// reads every queued delivery this way.
pub(super) fn decode(text: &str) -> Result<Vec<QueuedRecord>, String> {
    let mut p = Parser {
        s: text.as_bytes(),
        at: 0,
    };
    let mut out = Vec::new();
    p.expect(b'[')?;
    if p.peek() == Some(b']') {
        return Ok(out);
    }
    loop {
        p.expect(b'[')?;
        let seq = p.uint("seq")?;
        p.expect(b',')?;
        let message_id = p.uint("message_id")?;
        p.expect(b',')?;
        let qos = p.uint("qos")?;
        p.expect(b',')?;
        let retain = p.uint("retain")?;
        p.expect(b',')?;
        let hex = p.string()?.ok_or("subscription_ids: null")?;
        p.expect(b',')?;
        let share = p.string()?;
        p.expect(b']')?;
        let qos = u8::try_from(qos)
            .ok()
            .filter(|q| *q <= 2)
            .ok_or_else(|| format!("delivery QoS {qos} is not 0, 1 or 2"))?;
        out.push(QueuedRecord {
            seq,
            delivery: DeliveryRecord {
                message_id,
                qos,
                retain: retain != 0,
                subscription_ids: ids_from_hex(&hex)?,
                share,
            },
        });
        match p.next()? {
            b',' => continue,
            b']' => return Ok(out),
            c => return Err(format!("unexpected {:?} at byte {}", c as char, p.at)),
        }
    }
}

fn ids_from_hex(hex: &str) -> Result<Vec<u32>, String> {
    let bytes = hex.as_bytes();
    if !bytes.len().is_multiple_of(8) {
        return Err(format!(
            "subscription_ids: {hex:?} is not 4 bytes per identifier"
        ));
    }
    let digit = |c: u8| {
        (c as char)
            .to_digit(16)
            .ok_or(format!("subscription_ids: {hex:?}"))
    };
    bytes
        .chunks_exact(8)
        .map(|c| c.iter().try_fold(0u32, |v, &d| Ok(v << 4 | digit(d)?)))
        .collect()
}

struct Parser<'a> {
    s: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn skip_space(&mut self) {
        while self.s.get(self.at).is_some_and(|c| c.is_ascii_whitespace()) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_space();
        self.s.get(self.at).copied()
    }

    fn next(&mut self) -> Result<u8, String> {
        let c = self.peek().ok_or("the array ends early")?;
        self.at += 1;
        Ok(c)
    }

    fn expect(&mut self, want: u8) -> Result<(), String> {
        match self.next()? {
            c if c == want => Ok(()),
            c => Err(format!(
                "expected {:?}, found {:?} at byte {}",
                want as char,
                c as char,
                self.at - 1
            )),
        }
    }

    fn uint(&mut self, what: &str) -> Result<u64, String> {
        self.skip_space();
        let start = self.at;
        while self.s.get(self.at).is_some_and(u8::is_ascii_digit) {
            self.at += 1;
        }
        std::str::from_utf8(&self.s[start..self.at])
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| format!("{what}: not a number at byte {start}"))
    }

    /// A JSON string, or `null`.
    fn string(&mut self) -> Result<Option<String>, String> {
        if self.peek() == Some(b'n') {
            if self.s[self.at..].starts_with(b"null") {
                self.at += 4;
                return Ok(None);
            }
            return Err(format!("unexpected value at byte {}", self.at));
        }
        self.expect(b'"')?;
        let mut out: Vec<u8> = Vec::new();
        loop {
            let c = *self.s.get(self.at).ok_or("a string ends early")?;
            self.at += 1;
            match c {
                b'"' => break,
                b'\\' => {
                    let e = *self.s.get(self.at).ok_or("a string ends early")?;
                    self.at += 1;
                    match e {
                        b'"' | b'\\' | b'/' => out.push(e),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'u' => {
                            let mut code = self.hex4()?;
                            if (0xD800..0xDC00).contains(&code)
                                && self.s[self.at..].starts_with(b"\\u")
                            {
                                self.at += 2;
                                let low = self.hex4()?;
                                code = 0x10000
                                    + ((code - 0xD800) << 10)
                                    + (low.wrapping_sub(0xDC00) & 0x3FF);
                            }
                            let ch = char::from_u32(code).ok_or("a bad \\u escape")?;
                            let mut buf = [0u8; 4];
                            out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                        }
                        _ => return Err(format!("a bad escape at byte {}", self.at - 1)),
                    }
                }
                c => out.push(c),
            }
        }
        String::from_utf8(out)
            .map(Some)
            .map_err(|_| "a string is not UTF-8".to_string())
    }

    fn hex4(&mut self) -> Result<u32, String> {
        let digits = self
            .s
            .get(self.at..self.at + 4)
            .ok_or("a string ends early")?;
        self.at += 4;
        std::str::from_utf8(digits)
            .ok()
            .and_then(|d| u32::from_str_radix(d, 16).ok())
            .ok_or_else(|| "a bad \\u escape".to_string())
    }
}

/// `v` in decimal (a fan-out encodes millions of them: no formatting machinery).
fn push_uint(out: &mut String, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for &d in &digits[at..] {
        out.push(char::from(d));
    }
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
        let text = encode(&[(3, &d), (4, &plain)]);
        assert_eq!(
            text,
            r#"[[3,7,1,0,"0000000100000102","$share/g/\"a\\b\u000a"],[4,8,2,0,"",null]]"#
        );
        let back = decode(&text).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!((back[0].seq, &back[0].delivery), (3, &d));
        assert_eq!((back[1].seq, &back[1].delivery), (4, &plain));
        // As SQLite's json_array writes them (the upgrade from schema 4), and damaged.
        let sqlite = decode(r#"[[1,2,1,1,"0000000A","\ud83d\ude00 \t\/"]]"#).unwrap();
        assert_eq!(sqlite[0].delivery.subscription_ids, [10]);
        assert!(sqlite[0].delivery.retain);
        assert_eq!(sqlite[0].delivery.share.as_deref(), Some("\u{1f600} \t/"));
        assert!(decode("[[1,2,7,0,\"\",null]]").is_err());
        assert!(decode("[[1,2,1,0,\"\",null]").is_err());
        assert!(decode("[[1,2,1,0,\"abc\",null]]").is_err());
        assert_eq!(decode("[]").unwrap(), []);
    }
}
