//! Streams: named logs of the messages whose topic matches a filter (`[[streams]]`,
//! docs/streams.md). Each appended message gets a logical offset, strictly increasing per
//! stream, and its append time; retention (`max_age`, `max_bytes`, `last_value`) removes the
//! oldest entries and counts them. A log holds the `Arc<Message>` routing already made (no copy
//! of the payload). Readers (`broker::stream_reader`) are positions in a log: they read it in
//! bounded batches ([`Stream::read`]) and wait on [`Stream::appended`] at its end, so a
//! reader's replay and its live part are one sequence with no gap and no duplicate.
//!
//! With storage, each append waits in the stream's append buffer (the shared message, owed
//! by its publisher until stored) and the storage writer takes the whole buffer once per
//! batch, as one segment of entries each holding its message (`Persister::stream_append`);
//! retention removes entries (`Persister`'s stream changes, emitted under the log's lock,
//! so in the log's order). The log then keeps only its
//! newest entries in memory, those older are read back from storage in batches (by readers,
//! and by retention, in the background); the restore gives each log its counters, not its
//! entries ([`Stream::restore`]).
//!
//! `log.rs`: the log, its counters and its tail in memory ([`Log`]); `offset.rs`: where a
//! reader starts ([`StartAt`]), parsed from `stream-offset`.

mod log;
mod offset;

pub(crate) use log::{Entry, Found};
pub use offset::{rfc3339_ms, BadOffset, StartAt, TIME_MS_FROM};

use log::Log;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use crate::config::StreamConfig;
use crate::message::Message;
use crate::persist::{AppendBuffer, Persister};

/// The topic prefix readers subscribe under: `$stream/<name>[/@<offset>][/<filter>]`.
pub const STREAM_PREFIX: &str = "$stream/";

/// The user property naming where a reader starts (SUBSCRIBE), and each delivery's offset.
pub const OFFSET_PROPERTY: &str = "stream-offset";

/// The user property carrying each delivery's append time, milliseconds since the Unix epoch.
pub const TIME_PROPERTY: &str = "stream-time";

/// Milliseconds since the Unix epoch, now.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A reader's SUBSCRIBE filter, `$stream/<name>[/@<offset>][/<filter>]`, taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadFilter<'a> {
    /// The stream's name.
    pub name: &'a str,
    /// The `@<offset>` level (the form MQTT 3.1.1 readers use, having no user properties).
    pub at: Option<StartAt>,
    /// The part of the stream to read: a topic filter the messages must also match.
    pub filter: Option<&'a str>,
}

/// Takes a `$stream/` filter apart; `Err` says what is wrong with it. `None` for a filter
/// that does not start with `$stream/`.
pub fn parse_read_filter(filter: &str) -> Option<Result<ReadFilter<'_>, String>> {
    let rest = filter.strip_prefix(STREAM_PREFIX)?;
    let (name, rest) = match rest.split_once('/') {
        Some((name, rest)) => (name, Some(rest)),
        None => (rest, None),
    };
    if !crate::config::valid_stream_name(name) {
        return Some(Err(format!(
            "{name:?} is not a stream name (letters, digits, '_', '-', '.')"
        )));
    }
    let (at, sub) = match rest {
        Some(r) if r.starts_with('@') => {
            let (level, sub) = match r.split_once('/') {
                Some((level, sub)) => (level, Some(sub)),
                None => (r, None),
            };
            match StartAt::parse(&level[1..]) {
                Ok(at) => (Some(at), sub),
                Err(e) => return Some(Err(e.to_string())),
            }
        }
        r => (None, r),
    };
    if let Some(sub) = sub {
        if let Err(e) = crate::topic::validate_topic_filter(sub) {
            return Some(Err(format!("{sub:?} is not a valid topic filter: {e}")));
        }
    }
    Some(Ok(ReadFilter {
        name,
        at,
        filter: sub,
    }))
}

/// What a stream holds now: `$SYS/broker/streams/<name>/...`, `/metrics`, `mercurioctl`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamInfo {
    pub name: String,
    pub filter: String,
    /// Seconds; 0 = no limit.
    pub max_age: u64,
    /// Bytes; 0 = no limit.
    pub max_bytes: u64,
    pub last_value: bool,
    /// Messages held now.
    pub messages: u64,
    /// Bytes held now (topic, payload and properties of each message).
    pub bytes: u64,
    /// Messages held in the broker's memory now (the newest; with storage, the others are
    /// read back from it).
    #[serde(default)]
    pub in_memory: u64,
    /// Offset of the oldest message held (the next offset when empty).
    pub first_offset: u64,
    /// Offset of the newest message appended (0 before the first).
    pub last_offset: u64,
    /// Readers reading it now.
    pub readers: u64,
    /// Created at run time (`mercurioctl stream create`), not in the configuration file.
    pub runtime: bool,
    /// Messages retention removed since the start.
    pub trimmed_messages: u64,
    /// Bytes retention removed since the start.
    pub trimmed_bytes: u64,
}

/// Entries a background trim reads back from storage at a time.
const TRIM_BATCH: usize = 256;

/// How long a background trim waits before it reads storage again after a failed read.
const TRIM_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// One stream: its configuration, its log, its readers.
#[derive(Debug)]
pub struct Stream {
    pub(crate) config: StreamConfig,
    /// Its appends waiting for the storage writer (with storage).
    appends: Arc<AppendBuffer>,
    /// Lock: taken with no session lock held; under it only the storage writer's leaf locks
    /// (`Persister::emit`, the append buffer's, and a released message's), so its changes
    /// reach storage in the log's order.
    log: Mutex<Log>,
    /// Signalled (all waiters) after each append, for readers at the end of the log.
    pub(crate) appended: Notify,
    readers: AtomicUsize,
    /// The storage writer, when the broker has storage: set once, before the first append.
    persist: std::sync::OnceLock<Arc<Persister>>,
    /// Created at run time, not in `[[streams]]`.
    runtime: bool,
    /// This stream, for the commit notifications and background trims it starts.
    me: Weak<Stream>,
    /// Deleted at run time: its background trim stops (storage deleted its entries).
    deleted: AtomicBool,
}

impl Stream {
    fn new(config: StreamConfig, runtime: bool, memory_bytes: u64) -> Arc<Stream> {
        Arc::new_cyclic(|me| Stream {
            runtime,
            appends: AppendBuffer::new(&config.name),
            config,
            log: Mutex::new(Log::new(memory_bytes)),
            appended: Notify::new(),
            readers: AtomicUsize::new(0),
            persist: std::sync::OnceLock::new(),
            me: me.clone(),
            deleted: AtomicBool::new(false),
        })
    }

    /// Whether older entries are let go from memory once committed: with storage to read
    /// them back from, but a `last_value` stream (one entry per topic) is held whole.
    fn evicts(&self) -> bool {
        self.persist.get().is_some() && !self.config.last_value
    }

    /// Applies retention at `now_ms` under the log's lock, telling storage what went: in
    /// memory at once; the entries in storage only by a background trim, so that appends
    /// never wait for it.
    fn retain(&self, log: &mut Log, now_ms: u64) {
        let c = &self.config;
        if log.trim_memory(c.max_bytes, c.max_age, now_ms) {
            if let Some(p) = self.persist.get() {
                p.stream_trimmed(&c.name, log.first());
            }
        }
        if log.needs_stored_trim(c.max_bytes, c.max_age, now_ms) && log.start_trimming() {
            if let Some(me) = self.me.upgrade() {
                tokio::spawn(me.trim_stored());
            } else {
                log.stop_trimming();
            }
        }
    }

    /// The background trim: reads the oldest entries back from storage in batches and
    /// removes those retention wants gone, until none is left to remove.
    async fn trim_stored(self: Arc<Self>) {
        let Some(p) = self.persist.get() else {
            self.log.lock().stop_trimming();
            return;
        };
        let c = &self.config;
        loop {
            let (from, upto) = {
                let mut log = self.log.lock();
                if self.deleted.load(Ordering::Relaxed)
                    || !log.needs_stored_trim(c.max_bytes, c.max_age, now_ms())
                {
                    log.stop_trimming();
                    return;
                }
                (log.first(), log.tail_from())
            };
            let batch = match p
                .storage()
                .read_stream(&c.name, from, 0, TRIM_BATCH, u64::MAX)
                .await
            {
                Ok(batch) => batch,
                Err(e) => {
                    tracing::warn!(stream = %c.name, "stream retention cannot read storage, retried: {e}");
                    tokio::time::sleep(TRIM_RETRY).await;
                    continue;
                }
            };
            let complete = batch.len() < TRIM_BATCH || batch.iter().any(|e| e.entry.offset >= upto);
            let batch: Vec<(u64, u64, u64)> = batch
                .iter()
                .map(|e| (e.entry.offset, e.entry.time_ms, e.message.size()))
                .collect();
            let mut log = self.log.lock();
            if log.first() != from || self.deleted.load(Ordering::Relaxed) {
                continue;
            }
            let trimmed = log.trim_stored(
                &batch,
                complete.then_some(upto),
                c.max_bytes,
                c.max_age,
                now_ms(),
            );
            if trimmed {
                p.stream_trimmed(&c.name, log.first());
            }
        }
    }

    /// The log as storage kept it (the restore): its counters, its entries left in storage;
    /// `entries` (a `last_value` stream's, read back whole) in memory. Retention then
    /// applies at once.
    pub(crate) fn restore(
        &self,
        record: &mercurio_storage::StreamRecord,
        entries: Option<Vec<Entry>>,
    ) {
        let mut log = self.log.lock();
        *log = Log::restored(record, log.budget());
        if let Some(entries) = entries {
            log.restore_entries(entries);
        }
        self.retain(&mut log, now_ms());
        // Counted as what this broker's retention removed, not what was restored.
        log.reset_trimmed();
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Appends `msg` at `now_ms`, then applies retention: a `last_value` stream removes the
    /// topic's older entry, then the oldest entries go while the stream is over `max_bytes`
    /// (the newest is always kept) or older than `max_age`. Wakes the readers at the end.
    pub(crate) fn append(&self, msg: &Arc<Message>, now_ms: u64) {
        let persist = self.persist.get();
        let name = &self.config.name;
        let mut evicted = Vec::new();
        let await_commit = {
            let mut log = self.log.lock();
            let (offset, time_ms) = log.push(msg, now_ms);
            if self.config.last_value {
                if let Some(old) = log.remove_older_value(&msg.topic) {
                    if let Some(p) = persist {
                        p.stream_entry_removed(name, old);
                    }
                }
            }
            if let Some(p) = persist {
                p.stream_append(&self.appends, offset, time_ms, msg);
            }
            self.retain(&mut log, now_ms);
            if self.evicts() {
                log.evict(&mut evicted)
            } else {
                None
            }
        };
        // Outside the lock: a message dropped may be released to storage.
        drop(evicted);
        if let Some(upto) = await_commit {
            self.await_commit(persist, upto);
        }
        // Waking takes the waiters' lock: not for a stream nobody reads. A reader is counted
        // before its first look at the log, and the entry is in the log before this load, so
        // either the reader sees the entry or this sees the reader.
        if self.readers.load(Ordering::SeqCst) > 0 {
            self.appended.notify_waiters();
        }
    }

    /// Asks the writer to tell once every entry below `upto` is committed (sent after those
    /// entries' changes), so that they may leave memory. Called without the log's lock: a
    /// stopped writer answers at once.
    fn await_commit(&self, persist: Option<&Arc<Persister>>, upto: u64) {
        let Some(p) = persist else {
            return;
        };
        let me = self.me.clone();
        p.when_settled(Box::new(move |ok| {
            if let Some(stream) = me.upgrade() {
                let mut evicted = Vec::new();
                let next = {
                    let mut log = stream.log.lock();
                    if ok {
                        log.committed(upto, &mut evicted)
                    } else {
                        log.commit_failed();
                        None
                    }
                };
                drop(evicted);
                if let Some(next) = next {
                    stream.await_commit(stream.persist.get(), next);
                }
            }
        }));
    }

    /// The offset a reader starting at `at` reads first (the oldest held for `earliest`
    /// and a time, the next offset appended for `latest`), with the append time its first
    /// message must have at least (0: any).
    pub(crate) fn resolve(&self, at: StartAt) -> (u64, u64) {
        let mut log = self.log.lock();
        self.retain(&mut log, now_ms());
        match at {
            StartAt::Earliest => (log.first(), 0),
            StartAt::Latest => (log.next(), 0),
            StartAt::Offset(n) => (n.max(log.first()), 0),
            StartAt::Time(ms) => (log.first(), ms),
        }
    }

    /// Where the entries from offset `from` (from the oldest held when `from` was removed)
    /// appended at `from_time_ms` or later are: up to `max` of them in memory (copies of
    /// `Arc`s, never of messages), or a range of offsets to read back from storage.
    pub(crate) fn read(&self, from: u64, from_time_ms: u64, max: usize) -> Found {
        let mut log = self.log.lock();
        self.retain(&mut log, now_ms());
        log.read(from, from_time_ms, max)
    }

    /// The oldest offset held now.
    pub(crate) fn first(&self) -> u64 {
        self.log.lock().first()
    }

    /// The storage the entries not in memory are read back from.
    pub(crate) fn storage(&self) -> Option<&Arc<dyn mercurio_storage::Storage>> {
        self.persist.get().map(|p| p.storage())
    }

    /// What the stream holds now.
    pub fn info(&self) -> StreamInfo {
        let mut log = self.log.lock();
        self.retain(&mut log, now_ms());
        let n = log.counters();
        let c = &self.config;
        StreamInfo {
            name: c.name.clone(),
            filter: c.filter.clone(),
            max_age: c.max_age,
            max_bytes: c.max_bytes,
            last_value: c.last_value,
            messages: n.messages,
            bytes: n.bytes,
            in_memory: n.in_memory,
            first_offset: n.first,
            last_offset: n.next - 1,
            readers: self.readers.load(Ordering::Relaxed) as u64,
            runtime: self.runtime,
            trimmed_messages: n.trimmed_messages,
            trimmed_bytes: n.trimmed_bytes,
        }
    }

    /// Counts a reader until the returned guard drops.
    pub(crate) fn reading(self: &Arc<Stream>) -> ReaderCount {
        // Before the reader's first look at the log (see `append`).
        self.readers.fetch_add(1, Ordering::SeqCst);
        ReaderCount(Arc::clone(self))
    }
}

/// One reader counted in [`StreamInfo::readers`] while it lives.
pub(crate) struct ReaderCount(Arc<Stream>);

impl Drop for ReaderCount {
    fn drop(&mut self) {
        self.0.readers.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A running reader: its number (to tell it from a later one on the same filter), the stream
/// it reads and the handle that stops it.
struct Running {
    id: u64,
    stream: String,
    task: tokio::task::AbortHandle,
}

/// Why a stream could not be created or deleted at run time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamRefused {
    /// A bad name or filter (what is wrong).
    Invalid(String),
    /// A stream of this name exists.
    Exists(String),
    /// No stream has this name.
    NotFound(String),
    /// The stream is in the configuration file: removed there, not at run time.
    Configured(String),
}

impl std::fmt::Display for StreamRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamRefused::Invalid(why) => f.write_str(why),
            StreamRefused::Exists(name) => write!(f, "a stream named {name} exists"),
            StreamRefused::NotFound(name) => write!(f, "no such stream: {name}"),
            StreamRefused::Configured(name) => write!(
                f,
                "stream {name} is in the configuration file ([[streams]]): remove it there; \
                 it goes at the next start"
            ),
        }
    }
}

impl std::error::Error for StreamRefused {}

/// The broker's streams (`[[streams]]`, and those created at run time) and their running
/// readers.
#[derive(Default)]
pub struct Streams {
    /// Lock: read by publishes, `$SYS` and SUBSCRIBE with no other lock taken under it but a
    /// stream's log lock (an append); written by a stream's creation and deletion.
    list: RwLock<Vec<Arc<Stream>>>,
    /// Whether `list` holds any stream: a publish with no stream reads one atomic.
    any: AtomicBool,
    /// The storage writer, for streams created after the start.
    persist: std::sync::OnceLock<Arc<Persister>>,
    /// What each stream keeps in memory at most, with storage (bytes).
    memory_bytes: u64,
    /// Readers by (client identifier, the `$stream/...` filter subscribed to).
    /// Lock: a leaf (nothing is taken under it; any lock may be held).
    readers: Mutex<HashMap<(Arc<str>, String), Running>>,
    next_reader: AtomicU64,
}

impl Streams {
    /// The streams of `[[streams]]` (a validated configuration), empty logs, each keeping
    /// at most `memory_bytes` in memory when the broker has storage
    /// (`[storage] stream_memory_bytes`).
    pub(crate) fn new(configs: &[StreamConfig], memory_bytes: u64) -> Streams {
        Streams {
            list: RwLock::new(
                configs
                    .iter()
                    .cloned()
                    .map(|c| Stream::new(c, false, memory_bytes))
                    .collect(),
            ),
            memory_bytes,
            any: AtomicBool::new(!configs.is_empty()),
            persist: std::sync::OnceLock::new(),
            readers: Mutex::new(HashMap::new()),
            next_reader: AtomicU64::new(1),
        }
    }

    /// Appends `msg` to every stream whose filter matches its topic. One atomic load when
    /// there is no stream.
    pub(crate) fn append(&self, msg: &Arc<Message>) {
        if !self.any.load(Ordering::Relaxed) {
            return;
        }
        let mut now = None;
        for s in self.list.read().iter() {
            if crate::topic::matches(&s.config.filter, &msg.topic) {
                let now = *now.get_or_insert_with(now_ms);
                s.append(msg, now);
            }
        }
    }

    /// Tells every stream's appends and retention to storage from now on (set once, before
    /// the restore).
    pub(crate) fn set_persister(&self, p: &Arc<Persister>) {
        let _ = self.persist.set(Arc::clone(p));
        for s in self.list.read().iter() {
            let _ = s.persist.set(Arc::clone(p));
        }
    }

    /// The stream named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Stream>> {
        self.list
            .read()
            .iter()
            .find(|s| s.config.name == name)
            .cloned()
    }

    /// Every stream: those of the configuration in its order, then those created at run time.
    pub fn all(&self) -> Vec<Arc<Stream>> {
        self.list.read().clone()
    }

    /// Creates a stream at run time (`mercurioctl stream create`), empty, its offsets from 1;
    /// stored (its definition) when the broker has storage, so that it is back after a
    /// restart. Refused for a bad name or filter, or a name in use.
    pub(crate) fn create(&self, config: StreamConfig) -> Result<Arc<Stream>, StreamRefused> {
        config.check().map_err(StreamRefused::Invalid)?;
        let mut list = self.list.write();
        let stream = self.add(&mut list, config, true)?;
        if let Some(p) = self.persist.get() {
            // Before any append: no publish reaches it while the list is write-locked.
            p.stream_defined(&stream.config);
        }
        Ok(stream)
    }

    /// A stream created at run time, back from storage at start (not stored again).
    pub(crate) fn restore_created(
        &self,
        config: StreamConfig,
    ) -> Result<Arc<Stream>, StreamRefused> {
        config.check().map_err(StreamRefused::Invalid)?;
        self.add(&mut self.list.write(), config, true)
    }

    fn add(
        &self,
        list: &mut Vec<Arc<Stream>>,
        config: StreamConfig,
        runtime: bool,
    ) -> Result<Arc<Stream>, StreamRefused> {
        if list.iter().any(|s| s.config.name == config.name) {
            return Err(StreamRefused::Exists(config.name));
        }
        let stream = Stream::new(config, runtime, self.memory_bytes);
        if let Some(p) = self.persist.get() {
            let _ = stream.persist.set(Arc::clone(p));
        }
        list.push(Arc::clone(&stream));
        self.any.store(true, Ordering::Relaxed);
        Ok(stream)
    }

    /// Deletes a stream created at run time: its readers stop, its messages go (from
    /// storage too). Refused for a stream of the configuration file.
    pub(crate) fn delete(&self, name: &str) -> Result<(), StreamRefused> {
        let stream = {
            let mut list = self.list.write();
            let Some(i) = list.iter().position(|s| s.config.name == name) else {
                return Err(StreamRefused::NotFound(name.to_string()));
            };
            if !list[i].runtime {
                return Err(StreamRefused::Configured(name.to_string()));
            }
            let stream = list.remove(i);
            stream.deleted.store(true, Ordering::Relaxed);
            self.any.store(!list.is_empty(), Ordering::Relaxed);
            if let Some(p) = self.persist.get() {
                // After its last append: no publish reaches it while the list is
                // write-locked, and none will once it is out of the list.
                p.stream_deleted(name);
            }
            stream
        };
        self.readers.lock().retain(|_, r| {
            let stop = r.stream == name;
            if stop {
                r.task.abort();
            }
            !stop
        });
        // Its log goes with the readers' references (the readers just stopped).
        drop(stream);
        Ok(())
    }

    /// Records a running reader of `client` on `filter`, stopping the one it replaces.
    /// Returns its number for [`Streams::finished`].
    pub(crate) fn started(
        &self,
        client: &Arc<str>,
        filter: &str,
        stream: &str,
        task: tokio::task::AbortHandle,
    ) -> u64 {
        let id = self.next_reader.fetch_add(1, Ordering::Relaxed);
        let old = self.readers.lock().insert(
            (Arc::clone(client), filter.to_string()),
            Running {
                id,
                stream: stream.to_string(),
                task,
            },
        );
        if let Some(old) = old {
            old.task.abort();
        }
        id
    }

    /// Forgets reader `id` (it ended by itself), unless a later one took its place.
    pub(crate) fn finished(&self, client: &Arc<str>, filter: &str, id: u64) {
        let mut readers = self.readers.lock();
        let key = (Arc::clone(client), filter.to_string());
        if readers.get(&key).is_some_and(|r| r.id == id) {
            readers.remove(&key);
        }
    }

    /// Stops the reader of `client` on `filter` (UNSUBSCRIBE). True when there was one.
    pub(crate) fn stop(&self, client: &Arc<str>, filter: &str) -> bool {
        let removed = self
            .readers
            .lock()
            .remove(&(Arc::clone(client), filter.to_string()));
        match removed {
            Some(r) => {
                r.task.abort();
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{Properties, QoS};

    fn msg(topic: &str, payload: &str) -> Arc<Message> {
        Arc::new(Message {
            topic: topic.into(),
            payload: bytes::Bytes::copy_from_slice(payload.as_bytes()),
            qos: QoS::AtLeastOnce,
            retain: false,
            properties: Properties::default(),
            expires_at: None,
            publisher: None,
            source: None,
            encoded: Default::default(),
            stored: Default::default(),
        })
    }

    fn stream(max_age: u64, max_bytes: u64, last_value: bool) -> Arc<Stream> {
        Stream::new(
            StreamConfig {
                name: "s".into(),
                filter: "t/#".into(),
                max_age,
                max_bytes,
                last_value,
            },
            false,
            1 << 20,
        )
    }

    fn offsets(found: Found) -> Vec<u64> {
        match found {
            Found::Memory(entries) => entries.iter().map(|e| e.offset).collect(),
            Found::Stored { .. } => panic!("without storage, the log is in memory"),
        }
    }

    #[test]
    fn read_filters() {
        let f = |s| parse_read_filter(s).map(|r| r.map(|r| (r.name, r.at, r.filter)));
        assert_eq!(f("a/b"), None);
        assert_eq!(f("$stream/s"), Some(Ok(("s", None, None))));
        assert_eq!(f("$stream/s/a/+"), Some(Ok(("s", None, Some("a/+")))));
        assert_eq!(
            f("$stream/s/@7/a/#"),
            Some(Ok(("s", Some(StartAt::Offset(7)), Some("a/#"))))
        );
        assert_eq!(
            f("$stream/s/@earliest"),
            Some(Ok(("s", Some(StartAt::Earliest), None)))
        );
        assert!(matches!(f("$stream/s/@soon"), Some(Err(_))));
        assert!(matches!(f("$stream/a+b"), Some(Err(_))));
        assert!(matches!(f("$stream/s/a/#/b"), Some(Err(_))));
    }

    #[test]
    fn offsets_and_reads() {
        let s = stream(0, 0, false);
        assert_eq!(s.resolve(StartAt::Earliest), (1, 0));
        for i in 0..10 {
            s.append(&msg("t/a", &i.to_string()), 1000 + i);
        }
        assert_eq!(offsets(s.read(4, 0, 3)), [4, 5, 6]);
        assert_eq!(offsets(s.read(0, 1005, 2)), [6, 7], "from a time");
        assert_eq!(offsets(s.read(0, 5000, 2)), Vec::<u64>::new());
        assert_eq!(s.resolve(StartAt::Latest), (11, 0));
        assert_eq!(s.resolve(StartAt::Time(1005)), (1, 1005));
        let i = s.info();
        assert_eq!((i.messages, i.first_offset, i.last_offset), (10, 1, 10));
    }

    #[test]
    fn retention_by_bytes_and_last_value() {
        let s = stream(0, 10, false);
        for _ in 0..5 {
            s.append(&msg("t/a", "12"), 1); // 5 bytes each
        }
        let i = s.info();
        assert_eq!((i.messages, i.bytes, i.first_offset), (2, 10, 4));
        assert_eq!((i.trimmed_messages, i.trimmed_bytes), (3, 15));
        assert_eq!(s.resolve(StartAt::Offset(1)), (4, 0));

        let s = stream(0, 0, true);
        s.append(&msg("t/a", "1"), 1);
        s.append(&msg("t/b", "1"), 1);
        s.append(&msg("t/a", "2"), 1);
        let Found::Memory(read) = s.read(0, 0, 10) else {
            panic!("without storage, the log is in memory");
        };
        let got: Vec<(u64, &str)> = read
            .iter()
            .map(|e| (e.offset, if e.msg.topic == "t/a" { "a" } else { "b" }))
            .collect();
        assert_eq!(got, [(2, "b"), (3, "a")]);
        assert_eq!(s.info().trimmed_messages, 1);
    }

    #[test]
    fn retention_by_age() {
        let s = stream(1, 0, false);
        let now = now_ms();
        s.append(&msg("t/a", "old"), now - 5000);
        s.append(&msg("t/a", "new"), now);
        let i = s.info();
        assert_eq!((i.messages, i.first_offset, i.trimmed_messages), (1, 2, 1));
    }
}
