//! A stream's log as the broker holds it: its counters, and its newest entries in memory
//! (the tail) while, with storage, the older ones are only in storage.
//!
//! Offsets `[first, tail_from)` are in storage only: committed, read back in batches
//! (`Storage::read_stream`); `[tail_from, next)` are in `tail`. The tail keeps at most its
//! budget (`[storage] stream_memory_bytes`, each entry counted as [`entry_cost`]), but
//! never lets go of an entry before storage has committed it
//! (`committed`), so a read from storage never misses one. Without storage nothing is
//! evicted: the log is the storage.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::message::Message;

/// What an entry costs in memory beyond its message's bytes: the shared message (its struct,
/// topic and properties allocations, its cached encoding) and the entry itself.
const ENTRY_OVERHEAD: u64 = 512;

/// The memory an entry of `size` bytes ([`Message::size`]) is counted for in the tail.
pub(crate) fn entry_cost(size: u64) -> u64 {
    size + ENTRY_OVERHEAD
}

/// One message in a stream.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    /// Its logical offset in the stream (from 1).
    pub offset: u64,
    /// When it was appended, milliseconds since the Unix epoch (never earlier than the
    /// entry before it).
    pub time_ms: u64,
    pub msg: Arc<Message>,
}

/// Where a read of the log finds its entries.
#[derive(Debug)]
pub(crate) enum Found {
    /// In memory: up to the number asked, from the offset asked (or the oldest held).
    Memory(Vec<Entry>),
    /// In storage only: the offsets `from..upto` are to be read back from storage.
    Stored { from: u64, upto: u64 },
}

/// A stream's entries and counters (see the module's comment).
#[derive(Debug)]
pub(crate) struct Log {
    /// The newest entries, from `tail_from` on.
    tail: VecDeque<Entry>,
    /// The sum of [`entry_cost`] over `tail`.
    tail_cost: u64,
    /// What the tail keeps at most once committed, in [`entry_cost`] bytes.
    budget: u64,
    /// The offset from which entries are in `tail`; those below are in storage only.
    tail_from: u64,
    /// The offset of the oldest entry held (the next one when empty).
    first: u64,
    /// The append time of the entry at `first` (or an earlier time) while it is in storage
    /// only.
    first_time_ms: u64,
    /// The offset the next appended message gets.
    next: u64,
    /// Entries held, in memory and in storage.
    messages: u64,
    /// The sum of their [`Message::size`].
    bytes: u64,
    /// Entries retention removed (age, bytes, or a newer value of a `last_value` topic).
    trimmed_messages: u64,
    trimmed_bytes: u64,
    /// Every entry below this offset is committed to storage.
    committed: u64,
    /// A commit notification is awaited (at most one at a time).
    commit_awaited: bool,
    /// A background trim of the entries in storage only runs.
    trimming: bool,
}

impl Log {
    /// An empty log keeping at most `budget` bytes in memory (once committed).
    pub(crate) fn new(budget: u64) -> Log {
        Log {
            tail: VecDeque::new(),
            tail_cost: 0,
            budget,
            tail_from: 1,
            first: 1,
            first_time_ms: 0,
            next: 1,
            messages: 0,
            bytes: 0,
            trimmed_messages: 0,
            trimmed_bytes: 0,
            committed: 1,
            commit_awaited: false,
            trimming: false,
        }
    }
}

/// The counters of [`Log::counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counters {
    pub messages: u64,
    pub bytes: u64,
    pub in_memory: u64,
    pub first: u64,
    pub next: u64,
    pub trimmed_messages: u64,
    pub trimmed_bytes: u64,
}

impl Log {
    /// A log as storage kept it at the restore: its counters, every entry in storage only.
    pub(crate) fn restored(r: &mercurio_storage::StreamRecord, budget: u64) -> Log {
        let next = r.next_offset.max(1);
        Log {
            tail_from: next,
            first: r.first_offset.clamp(1, next),
            first_time_ms: r.first_time_ms,
            next,
            messages: r.messages,
            bytes: r.bytes,
            committed: next,
            ..Log::new(budget)
        }
    }

    /// What the tail keeps at most once committed.
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// Entries read back whole at the restore (a `last_value` stream), by offset: they go
    /// to the tail, replacing the counters storage gave.
    pub(crate) fn restore_entries(&mut self, entries: Vec<Entry>) {
        self.messages = entries.len() as u64;
        self.bytes = entries.iter().map(|e| e.msg.size() as u64).sum();
        self.tail_cost = entries
            .iter()
            .map(|e| entry_cost(e.msg.size() as u64))
            .sum();
        self.first = entries.first().map_or(self.next, |e| e.offset);
        self.tail_from = self.first;
        self.tail = entries.into();
    }

    pub(crate) fn counters(&self) -> Counters {
        Counters {
            messages: self.messages,
            bytes: self.bytes,
            in_memory: self.tail.len() as u64,
            first: self.first,
            next: self.next,
            trimmed_messages: self.trimmed_messages,
            trimmed_bytes: self.trimmed_bytes,
        }
    }

    /// Forgets what retention removed so far (the restore counts from its start).
    pub(crate) fn reset_trimmed(&mut self) {
        self.trimmed_messages = 0;
        self.trimmed_bytes = 0;
    }

    /// The offset of the oldest entry held, or the next one when the log is empty.
    pub(crate) fn first(&self) -> u64 {
        self.first
    }

    pub(crate) fn next(&self) -> u64 {
        self.next
    }

    /// Whether some entries are in storage only.
    pub(crate) fn has_stored(&self) -> bool {
        self.first < self.tail_from
    }

    /// Where the entries in memory start.
    pub(crate) fn tail_from(&self) -> u64 {
        self.tail_from
    }

    /// The append time of the oldest entry, or a time before it (0 when unknown).
    fn oldest_time(&self) -> Option<u64> {
        if self.has_stored() {
            Some(self.first_time_ms)
        } else {
            self.tail.front().map(|e| e.time_ms)
        }
    }

    /// Appends `msg` at `offset` = the next one, at `now_ms` or the last entry's time if
    /// later. Returns the entry's offset and time.
    pub(crate) fn push(&mut self, msg: &Arc<Message>, now_ms: u64) -> (u64, u64) {
        let last = self.tail.back().map_or(self.first_time_ms, |e| e.time_ms);
        let time_ms = last.max(now_ms);
        let offset = self.next;
        self.next += 1;
        let size = msg.size() as u64;
        self.messages += 1;
        self.bytes += size;
        self.tail_cost += entry_cost(size);
        self.tail.push_back(Entry {
            offset,
            time_ms,
            msg: Arc::clone(msg),
        });
        (offset, time_ms)
    }

    /// Removes the newest entry in memory on `topic` before the last one (a `last_value`
    /// stream's older value), counted as trimmed. Returns its offset.
    pub(crate) fn remove_older_value(&mut self, topic: &str) -> Option<u64> {
        let newest = self.tail.len().checked_sub(1)?;
        let i = self
            .tail
            .iter()
            .take(newest)
            .rposition(|e| e.msg.topic == topic)?;
        let old = self.tail.remove(i)?;
        let size = old.msg.size() as u64;
        self.messages -= 1;
        self.bytes -= size;
        self.tail_cost -= entry_cost(size);
        self.trimmed_messages += 1;
        self.trimmed_bytes += size;
        if i == 0 && !self.has_stored() {
            self.first = self.tail.front().map_or(self.next, |e| e.offset);
        }
        Some(old.offset)
    }

    /// Removes the oldest entry in memory (no entry in storage only), counted as trimmed.
    fn pop_front(&mut self) {
        if let Some(e) = self.tail.pop_front() {
            let size = e.msg.size() as u64;
            self.messages -= 1;
            self.bytes -= size;
            self.tail_cost -= entry_cost(size);
            self.trimmed_messages += 1;
            self.trimmed_bytes += size;
            self.tail_from = self.tail_from.max(e.offset + 1);
            self.first = self.tail.front().map_or(self.next, |e| e.offset);
        }
    }

    /// Retention over the entries in memory, when none is in storage only: the oldest go
    /// while over `max_bytes` (the newest stays) or older than `max_age` seconds at `now_ms`
    /// (0: no limit). True when it removed any.
    pub(crate) fn trim_memory(&mut self, max_bytes: u64, max_age: u64, now_ms: u64) -> bool {
        if self.has_stored() {
            return false;
        }
        let mut trimmed = false;
        if max_bytes > 0 {
            while self.bytes > max_bytes && self.tail.len() > 1 {
                self.pop_front();
                trimmed = true;
            }
        }
        if max_age > 0 {
            let oldest = now_ms.saturating_sub(max_age.saturating_mul(1000));
            while self.tail.front().is_some_and(|e| e.time_ms < oldest) {
                self.pop_front();
                trimmed = true;
            }
        }
        trimmed
    }

    /// Whether retention has entries in storage only to remove (over `max_bytes`, or the
    /// oldest possibly older than `max_age` seconds at `now_ms`).
    pub(crate) fn needs_stored_trim(&self, max_bytes: u64, max_age: u64, now_ms: u64) -> bool {
        if !self.has_stored() {
            return false;
        }
        let over = max_bytes > 0 && self.bytes > max_bytes && self.messages > 1;
        let aged = max_age > 0
            && self
                .oldest_time()
                .is_some_and(|t| t < now_ms.saturating_sub(max_age.saturating_mul(1000)));
        over || aged
    }

    /// Claims the background trim; false when one runs already.
    pub(crate) fn start_trimming(&mut self) -> bool {
        !std::mem::replace(&mut self.trimming, true)
    }

    pub(crate) fn stop_trimming(&mut self) {
        self.trimming = false;
    }

    /// Retention over a batch read back from storage from [`first`](Self::first) on
    /// (`(offset, time, size)` by offset; `complete_below`: the batch holds every entry in
    /// storage only below that offset, read when it was where the tail starts): the oldest
    /// go while over `max_bytes` or older than `max_age` at `now_ms`; the first kept one
    /// sets the oldest time. True when it removed any.
    pub(crate) fn trim_stored(
        &mut self,
        batch: &[(u64, u64, u64)],
        complete_below: Option<u64>,
        max_bytes: u64,
        max_age: u64,
        now_ms: u64,
    ) -> bool {
        let oldest = if max_age > 0 {
            now_ms.saturating_sub(max_age.saturating_mul(1000))
        } else {
            0
        };
        let mut trimmed = false;
        for &(offset, time_ms, size) in batch {
            if offset < self.first || offset >= self.tail_from {
                continue;
            }
            let over = max_bytes > 0 && self.bytes > max_bytes && self.messages > 1;
            if !(over || time_ms < oldest) {
                self.first = offset;
                self.first_time_ms = time_ms;
                return trimmed;
            }
            self.messages = self.messages.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub(size);
            self.trimmed_messages += 1;
            self.trimmed_bytes += size;
            self.first = offset + 1;
            self.first_time_ms = time_ms;
            trimmed = true;
        }
        // Entries evicted since the read may be missing from the batch.
        if complete_below == Some(self.tail_from) {
            // Nothing left in storage only: the counters are the tail's (whatever storage
            // could not read back is not held either).
            self.first = self.tail.front().map_or(self.next, |e| e.offset);
            self.tail_from = self.first;
            self.messages = self.tail.len() as u64;
            self.bytes = self.tail.iter().map(|e| e.msg.size() as u64).sum();
            trimmed |= self.trim_memory(max_bytes, max_age, now_ms);
        }
        trimmed
    }

    /// Marks every entry below `upto` committed and lets go of the oldest in memory over
    /// its budget (committed ones only); as [`evict`](Self::evict), the offset of the
    /// next commit to await.
    pub(crate) fn committed(&mut self, upto: u64, out: &mut Vec<Entry>) -> Option<u64> {
        self.committed = self.committed.max(upto);
        self.commit_awaited = false;
        self.evict(out)
    }

    /// A commit notification failed (storage does not hold something): nothing is let go
    /// until a later one succeeds.
    pub(crate) fn commit_failed(&mut self) {
        self.commit_awaited = false;
    }

    /// Lets go of the oldest committed entries while the tail is over its budget, into
    /// `out` (dropped by the caller once the log is unlocked: dropping a message may release
    /// it to storage); the next offset when a commit notification must be awaited first (over
    /// the budget with its oldest entry not committed, none awaited yet).
    pub(crate) fn evict(&mut self, out: &mut Vec<Entry>) -> Option<u64> {
        while self.tail_cost > self.budget {
            let Some(front) = self.tail.front() else {
                break;
            };
            if front.offset >= self.committed {
                if self.commit_awaited {
                    return None;
                }
                self.commit_awaited = true;
                return Some(self.next);
            }
            if !self.has_stored() {
                self.first_time_ms = front.time_ms;
            }
            self.tail_from = front.offset + 1;
            self.tail_cost -= entry_cost(front.msg.size() as u64);
            out.extend(self.tail.pop_front());
        }
        None
    }

    /// Where the entries from `from` (the oldest held when `from` was removed) appended at
    /// `from_time_ms` or later are: up to `max` of them in memory, or a range in storage
    /// only.
    pub(crate) fn read(&self, from: u64, from_time_ms: u64, max: usize) -> Found {
        let from = from.max(self.first);
        if from < self.tail_from {
            return Found::Stored {
                from,
                upto: self.tail_from,
            };
        }
        let i = self.tail.partition_point(|e| e.offset < from);
        Found::Memory(
            self.tail
                .iter()
                .skip(i)
                .skip_while(|e| e.time_ms < from_time_ms)
                .take(max)
                .cloned()
                .collect(),
        )
    }

    /// Entries in memory now (for tests).
    #[cfg(test)]
    pub(crate) fn in_memory(&self) -> usize {
        self.tail.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::QoS;

    /// The budget of the logs tested: 8 MiB.
    const TAIL: u64 = 8 << 20;

    fn msg(payload_len: usize) -> Arc<Message> {
        Arc::new(Message::for_test(
            "t/a",
            bytes::Bytes::from(vec![b'x'; payload_len]),
            QoS::AtLeastOnce,
        ))
    }

    /// Appends entries of 1 MiB until the tail is over its budget; nothing leaves memory
    /// before it is committed, then the oldest leave down to the budget and are read from
    /// storage, the newest from memory.
    #[test]
    fn the_tail_lets_go_of_committed_entries_only() {
        let mut log = Log::new(TAIL);
        let big = msg(1 << 20);
        for i in 0..20 {
            log.push(&big, 1000 + i);
        }
        assert_eq!(
            log.evict(&mut Vec::new()),
            Some(21),
            "a commit is awaited first"
        );
        assert_eq!(log.evict(&mut Vec::new()), None, "once");
        assert_eq!(log.in_memory(), 20, "nothing uncommitted leaves memory");
        assert_eq!(
            log.committed(11, &mut Vec::new()),
            Some(21),
            "still over the budget with uncommitted entries: the next commit is awaited"
        );
        assert_eq!(
            log.in_memory(),
            10,
            "committed ones leave while over the budget"
        );
        assert!(log.has_stored());
        assert!(matches!(
            log.read(0, 0, 5),
            Found::Stored { from: 1, upto: 11 }
        ));
        let Found::Memory(tail) = log.read(11, 0, 2) else {
            panic!("the tail is in memory");
        };
        assert_eq!(tail.iter().map(|e| e.offset).collect::<Vec<_>>(), [11, 12]);
        let n = log.counters();
        assert_eq!(
            (n.messages, n.first, n.next),
            (20, 1, 21),
            "counters hold both"
        );
        assert_eq!(log.evict(&mut Vec::new()), None, "awaited already");
        assert_eq!(log.committed(21, &mut Vec::new()), None);
        assert!(log.in_memory() as u64 * entry_cost(big.size() as u64) <= TAIL);
    }

    /// Retention over entries in storage only: by bytes, by age, then in memory once none
    /// is left in storage only.
    #[test]
    fn retention_reads_the_stored_part_back() {
        let mut log = Log::new(TAIL);
        let m = msg(1 << 20);
        let size = m.size() as u64;
        for i in 0..20 {
            log.push(&m, 1000 + i);
        }
        log.committed(21, &mut Vec::new());
        let stored: Vec<(u64, u64, u64)> =
            (1..log.tail_from()).map(|o| (o, 999 + o, size)).collect();
        let max_bytes = 15 * size;
        assert!(log.needs_stored_trim(max_bytes, 0, 2000));
        assert!(log.trim_stored(&stored[..2], None, max_bytes, 0, 2000));
        let n = log.counters();
        assert_eq!((n.messages, n.first, n.trimmed_messages), (18, 3, 2));
        assert!(log.needs_stored_trim(max_bytes, 0, 2000));
        let upto = log.tail_from();
        assert!(log.trim_stored(&stored[2..], Some(upto), max_bytes, 0, 2000));
        let n = log.counters();
        assert_eq!((n.messages, n.bytes, n.first), (15, 15 * size, 6));
        assert!(!log.needs_stored_trim(max_bytes, 0, 2000));
        // By age: the oldest kept is at 1005; at 7000 with 5 s, those before 2000 go.
        assert!(log.needs_stored_trim(0, 5, 7000));
        let upto = log.tail_from();
        let rest: Vec<_> = stored.iter().copied().filter(|e| e.0 >= 6).collect();
        log.trim_stored(&rest, Some(upto), 0, 5, 7000);
        let n = log.counters();
        assert_eq!(
            (n.messages, n.first),
            (0, 21),
            "everything aged, in storage and in memory"
        );
    }
}
