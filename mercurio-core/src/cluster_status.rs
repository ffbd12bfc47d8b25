//! The cluster link's live state and counters ([`ClusterStatus`]), read by `$SYS`
//! (`$SYS/broker/cluster/...`) and `/metrics` (`mercurio_cluster_...`). Kept apart from the
//! `cluster` module, which runs the link on top of the broker, so that the broker's state can
//! hold them without the two modules importing each other.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::message::Message;

/// The cluster link's state and counters; all zero while cluster mode is off.
#[derive(Debug, Default)]
pub(crate) struct ClusterStatus {
    /// Cluster mode is on (`[cluster] nats_urls`).
    pub enabled: AtomicBool,
    /// Connected to a NATS server now.
    pub connected: AtomicBool,
    /// Connections to NATS made after the first.
    pub reconnects: AtomicU64,
    /// NATS subscriptions of this node now (its interest, shared groups' included).
    pub subscriptions: AtomicU64,
    /// Messages this node sent to NATS for other nodes.
    pub messages_out: AtomicU64,
    /// Payload bytes of those.
    pub bytes_out: AtomicU64,
    /// Messages from other nodes routed here.
    pub messages_in: AtomicU64,
    /// Payload bytes of those.
    pub bytes_in: AtomicU64,
    /// Copies of a message already taken, received through another of this node's
    /// subjects that matched it too, and dropped.
    pub duplicates: AtomicU64,
    /// Messages that could not be sent to NATS (too large for the server's `max_payload`,
    /// properties that cannot be encoded, the connection closed) or that came from NATS
    /// unreadable.
    pub errors: AtomicU64,
    /// Messages the NATS client dropped for this node as a slow consumer.
    pub slow_consumer: AtomicU64,
    /// QoS 1/2 messages JetStream took for other nodes (all their copies acknowledged).
    pub jetstream_out: AtomicU64,
    /// QoS 1/2 messages from other nodes taken from JetStream and routed here.
    pub jetstream_in: AtomicU64,
    /// Copies published to JetStream again after JetStream did not acknowledge them.
    pub jetstream_retries: AtomicU64,
    /// Messages JetStream did not take within `jetstream_ack_timeout` (their publishers'
    /// connections were closed; the messages are still sent).
    pub jetstream_timeouts: AtomicU64,
    /// Times this node found the JetStream stream with other settings than its own
    /// (`jetstream_replicas`, `jetstream_max_age`, `jetstream_max_bytes`), kept as found.
    pub jetstream_settings_differ: AtomicU64,
    /// Retained changes (set or cleared) sent to the other nodes.
    pub retained_out: AtomicU64,
    /// Retained changes from other nodes applied here (newer than what this node had).
    pub retained_in: AtomicU64,
    /// When this node last connected to NATS, in seconds since the Unix epoch; 0: never.
    pub connected_since: AtomicU64,
    /// Signalled at each connection to NATS (the first included): the node then asks the
    /// others for the retained messages it may have missed, and announces itself.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub connects: Notify,
    /// The retained messages' stamps and the changes waiting for NATS.
    pub retained: RetainedClock,
    /// The other nodes, by name, as their heartbeats announce them.
    pub peers: Mutex<HashMap<String, Peer>>,
    /// This node's interest (filters and shared groups subscribed to here) as announced to
    /// the others.
    pub interest: Mutex<LocalInterest>,
    /// Woken when this node's interest changed.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub interest_wake: Notify,
}

/// One reading of [`ClusterStatus`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ClusterInfo {
    pub connected: bool,
    /// Cluster mode is on but NATS is unreachable: local clients are served, messages for
    /// other nodes wait (docs/cluster.md, "Failures").
    pub degraded: bool,
    /// Nodes up, this one included (heartbeats; docs/cluster.md, "Status").
    pub nodes: u64,
    /// Clients connected to the nodes up, this one's included.
    pub clients: u64,
    pub retained_out: u64,
    pub retained_in: u64,
    pub reconnects: u64,
    pub subscriptions: u64,
    pub messages_out: u64,
    pub bytes_out: u64,
    pub messages_in: u64,
    pub bytes_in: u64,
    pub duplicates: u64,
    pub errors: u64,
    pub slow_consumer: u64,
    pub jetstream_out: u64,
    pub jetstream_in: u64,
    pub jetstream_retries: u64,
    pub jetstream_timeouts: u64,
    pub jetstream_settings_differ: u64,
    /// Bytes (each message's size once per destination node) and messages handed to
    /// JetStream and not yet acknowledged: set by [`BrokerState::cluster_info`](crate::broker::BrokerState::cluster_info).
    pub jetstream_pending_bytes: u64,
    pub jetstream_pending_messages: u64,
}

impl ClusterStatus {
    /// Adds `n` to a counter.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The current values, or `None` while cluster mode is off. `own_clients`: the clients
    /// connected to this node now.
    pub(crate) fn info(&self, own_clients: u64) -> Option<ClusterInfo> {
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let connected = self.connected.load(Ordering::Relaxed);
        let now = Instant::now();
        let (mut nodes, mut clients) = (1, own_clients);
        for p in self.peers.lock().values().filter(|p| p.up(now)) {
            nodes += 1;
            clients += p.heartbeat.clients;
        }
        Some(ClusterInfo {
            connected,
            degraded: !connected,
            nodes,
            clients,
            retained_out: get(&self.retained_out),
            retained_in: get(&self.retained_in),
            reconnects: get(&self.reconnects),
            subscriptions: get(&self.subscriptions),
            messages_out: get(&self.messages_out),
            bytes_out: get(&self.bytes_out),
            messages_in: get(&self.messages_in),
            bytes_in: get(&self.bytes_in),
            duplicates: get(&self.duplicates),
            errors: get(&self.errors),
            slow_consumer: get(&self.slow_consumer),
            jetstream_out: get(&self.jetstream_out),
            jetstream_in: get(&self.jetstream_in),
            jetstream_retries: get(&self.jetstream_retries),
            jetstream_timeouts: get(&self.jetstream_timeouts),
            jetstream_settings_differ: get(&self.jetstream_settings_differ),
            jetstream_pending_bytes: 0,
            jetstream_pending_messages: 0,
        })
    }
}

/// How long a cleared retained message's stamp (its tombstone) is kept, so that an older
/// copy arriving late, or from a node that was away, does not bring the message back.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub(crate) const TOMBSTONE_TTL: Duration = Duration::from_secs(3600);

/// Most bytes of topic names the tombstones hold (clients choose how many topics they clear):
/// past it the oldest go first, down to three quarters, as if their hour had run out.
const TOMBSTONE_BYTES: usize = 16 * 1024 * 1024;

/// The order of retained changes across nodes: the wall-clock milliseconds of the change
/// (never below the last stamp of its topic this node knew, plus one), then the node's name.
/// The change with the greater stamp wins on every node (last writer wins).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Stamp {
    /// Milliseconds since the Unix epoch.
    pub ms: u64,
    /// The node that made the change.
    pub node: Arc<str>,
}

impl Stamp {
    /// The stamp of a retained message this node had before it joined (loaded from its
    /// storage): older than any change made in the cluster.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn zero() -> Stamp {
        Stamp {
            ms: 0,
            node: Arc::from(""),
        }
    }
}

/// A retained message change waiting to be sent to the other nodes, or one to apply here.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
pub(crate) struct RetainedChange {
    pub topic: String,
    pub stamp: Stamp,
    /// The retained message; an empty payload clears it.
    pub msg: Arc<Message>,
}

/// A topic's latest change.
struct Entry {
    stamp: Stamp,
    /// When it was cleared, for a tombstone.
    cleared_at: Option<Instant>,
}

#[derive(Default)]
struct ClockState {
    /// This node's name; empty while cluster mode is off.
    node: Option<Arc<str>>,
    /// Topic -> its latest change (tombstones included).
    stamps: HashMap<String, Entry>,
    /// Bytes of the tombstones' topic names (bounded by [`TOMBSTONE_BYTES`]).
    tombstone_bytes: usize,
    /// Topic -> the latest local change not yet sent to NATS: while NATS is unreachable only
    /// the last change of each topic waits.
    outbox: HashMap<String, (Stamp, Arc<Message>)>,
}

impl ClockState {
    /// Records the latest change of `topic`, keeping the tombstones' bytes within their bound.
    fn stamp(&mut self, topic: &str, entry: Entry) {
        let cleared = entry.cleared_at.is_some();
        if let Some(old) = self.stamps.insert(topic.to_string(), entry) {
            if old.cleared_at.is_some() {
                self.tombstone_bytes -= topic.len();
            }
        }
        if cleared {
            self.tombstone_bytes += topic.len();
        }
        if self.tombstone_bytes > TOMBSTONE_BYTES {
            let mut tombstones: Vec<(Instant, String)> = self
                .stamps
                .iter()
                .filter_map(|(t, e)| e.cleared_at.map(|at| (at, t.clone())))
                .collect();
            tombstones.sort_unstable();
            for (_, t) in tombstones {
                if self.tombstone_bytes <= TOMBSTONE_BYTES / 4 * 3 {
                    break;
                }
                self.stamps.remove(&t);
                self.tombstone_bytes -= t.len();
            }
        }
    }
}

/// The retained messages' stamps (last writer wins across nodes) and the local changes
/// waiting for NATS. Inert while cluster mode is off.
#[derive(Default)]
pub(crate) struct RetainedClock {
    state: Mutex<ClockState>,
    /// Woken when a local change waits in the outbox.
    pub wake: Notify,
}

impl std::fmt::Debug for RetainedClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("RetainedClock")
            .field("stamps", &s.stamps.len())
            .field("outbox", &s.outbox.len())
            .finish()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl RetainedClock {
    /// Starts stamping as node `node`; the retained messages `held` (loaded from storage
    /// before the start) get [`Stamp::zero`].
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn start(&self, node: &str, held: impl IntoIterator<Item = String>) {
        let mut s = self.state.lock();
        s.node = Some(Arc::from(node));
        for topic in held {
            s.stamps.entry(topic).or_insert(Entry {
                stamp: Stamp::zero(),
                cleared_at: None,
            });
        }
    }

    /// A retained change made on this node (`msg`, its RETAIN flag set; an empty payload
    /// clears): stamps it, applies it here (`apply`, under the clock's lock so that a change
    /// from another node cannot come between) and queues it for the other nodes. Returns
    /// what `apply` returned, or `None`, applying nothing, before cluster mode started: the
    /// caller applies it alone.
    pub(crate) fn local<R>(&self, msg: &Arc<Message>, apply: impl FnOnce() -> R) -> Option<R> {
        let mut s = self.state.lock();
        let node = s.node.clone()?;
        let ms = match s.stamps.get(&msg.topic) {
            Some(e) => now_ms().max(e.stamp.ms + 1),
            None => now_ms(),
        };
        let stamp = Stamp { ms, node };
        let cleared_at = msg.payload.is_empty().then(Instant::now);
        s.stamp(
            &msg.topic,
            Entry {
                stamp: stamp.clone(),
                cleared_at,
            },
        );
        let applied = apply();
        s.outbox.insert(msg.topic.clone(), (stamp, Arc::clone(msg)));
        drop(s);
        self.wake.notify_one();
        Some(applied)
    }

    /// A retained change from another node: applied (`apply`, under the clock's lock) when
    /// its stamp is greater than the topic's latest known here. Returns what `apply`
    /// returned, or `None` when the change was older and not applied.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn remote<R>(
        &self,
        topic: &str,
        stamp: &Stamp,
        clear: bool,
        apply: impl FnOnce() -> R,
    ) -> Option<R> {
        let mut s = self.state.lock();
        if s.stamps.get(topic).is_some_and(|e| e.stamp >= *stamp) {
            return None;
        }
        s.stamp(
            topic,
            Entry {
                stamp: stamp.clone(),
                cleared_at: clear.then(Instant::now),
            },
        );
        Some(apply())
    }

    /// The local changes waiting for NATS, taken out.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn take_outbox(&self) -> Vec<RetainedChange> {
        let mut s = self.state.lock();
        s.outbox
            .drain()
            .map(|(topic, (stamp, msg))| RetainedChange { topic, stamp, msg })
            .collect()
    }

    /// Every retained change known here, for a node catching up: the stamped topics with
    /// `current(topic)`, this node's retained message (skipped when it holds none, e.g. it
    /// expired or was over a limit), and the tombstones as `clear` (an empty message).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn snapshot(
        &self,
        current: impl Fn(&str) -> Option<Arc<Message>>,
        clear: impl Fn(&str) -> Arc<Message>,
    ) -> Vec<RetainedChange> {
        let s = self.state.lock();
        s.stamps
            .iter()
            .filter_map(|(topic, e)| {
                let msg = match e.cleared_at {
                    Some(_) => clear(topic),
                    None => current(topic)?,
                };
                Some(RetainedChange {
                    topic: topic.clone(),
                    stamp: e.stamp.clone(),
                    msg,
                })
            })
            .collect()
    }

    /// Drops the tombstones older than `ttl`.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn prune(&self, ttl: Duration) {
        let now = Instant::now();
        let s = &mut *self.state.lock();
        let mut freed = 0;
        s.stamps.retain(|topic, e| {
            let keep = e.cleared_at.is_none_or(|t| now.duration_since(t) < ttl);
            if !keep {
                freed += topic.len();
            }
            keep
        });
        s.tombstone_bytes -= freed;
    }

    /// Topics with a stamp (tombstones included).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.state.lock().stamps.len()
    }
}

/// What another node announced in its last heartbeat, and when it came.
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    pub heartbeat: crate::admin::Heartbeat,
    pub seen: Instant,
    /// Filters and shared groups of its clients known here.
    pub interest: Option<u64>,
}

impl Peer {
    /// Up while heartbeats keep coming: the last one less than [`MISSED_HEARTBEATS`] of its
    /// intervals ago, and not a leaving node's.
    pub(crate) fn up(&self, now: Instant) -> bool {
        let interval = Duration::from_millis(self.heartbeat.interval_ms.max(1));
        !self.heartbeat.leaving && now.duration_since(self.seen) < interval * MISSED_HEARTBEATS
    }
}

/// Heartbeats a node may miss before the others show it as gone.
pub(crate) const MISSED_HEARTBEATS: u32 = 3;

/// Keys per part of a whole interest set sent to a node catching up.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
const PART: usize = 1000;

/// One change of a node's interest.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Delta {
    /// The node's incarnation.
    pub inc: u64,
    /// This change's number, from 1.
    pub v: u64,
    /// Filters and shared groups (`$share/{group}/{filter}`) that appeared.
    pub add: Vec<String>,
    /// Those that disappeared.
    pub remove: Vec<String>,
}

/// A part of a node's whole interest, as of change `v`.
#[cfg_attr(not(feature = "cluster"), allow(dead_code))]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Part {
    pub node: String,
    pub inc: u64,
    pub v: u64,
    /// This part's index, from 0, of `parts`.
    pub part: u64,
    pub parts: u64,
    pub keys: Vec<String>,
}

/// This node's interest as announced: its keys, and the changes not sent yet.
#[derive(Debug, Default)]
pub(crate) struct LocalInterest {
    /// The number of the last change sent.
    pub v: u64,
    pub keys: HashSet<String>,
    pub add: Vec<String>,
    pub remove: Vec<String>,
}

impl LocalInterest {
    /// A key appeared (true) or disappeared.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn change(&mut self, key: String, present: bool) {
        if present {
            self.keys.insert(key.clone());
            self.add.push(key);
        } else {
            self.keys.remove(&key);
            self.remove.push(key);
        }
    }

    /// The changes to send, numbered, or `None` when there are none.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn delta(&mut self, inc: u64) -> Option<Delta> {
        if self.add.is_empty() && self.remove.is_empty() {
            return None;
        }
        self.v += 1;
        Some(Delta {
            inc,
            v: self.v,
            add: std::mem::take(&mut self.add),
            remove: std::mem::take(&mut self.remove),
        })
    }

    /// The whole set, in parts, for a node catching up. Changes not yet sent are in the
    /// set but not in `v`: the delta that sends them is then applied again, harmlessly.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn parts(&self, node: &str, inc: u64) -> Vec<Part> {
        let keys: Vec<String> = self.keys.iter().cloned().collect();
        let chunks: Vec<Vec<String>> = if keys.is_empty() {
            vec![Vec::new()]
        } else {
            keys.chunks(PART).map(<[String]>::to_vec).collect()
        };
        let parts = chunks.len() as u64;
        chunks
            .into_iter()
            .enumerate()
            .map(|(i, keys)| Part {
                node: node.to_string(),
                inc,
                v: self.v,
                part: i as u64,
                parts,
                keys,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn msg(topic: &str, payload: &'static [u8]) -> Arc<Message> {
        let mut m = Message::for_test(
            topic,
            Bytes::from_static(payload),
            crate::codec::QoS::AtMostOnce,
        );
        m.retain = true;
        Arc::new(m)
    }

    fn stamp(ms: u64, node: &str) -> Stamp {
        Stamp {
            ms,
            node: Arc::from(node),
        }
    }

    #[test]
    fn the_greatest_stamp_wins_whatever_the_order() {
        let clock = RetainedClock::default();
        // Before the start, nothing is stamped: the caller applies alone.
        assert_eq!(clock.local(&msg("t", b"x"), || 1), None);
        clock.start("a", ["held".to_string()]);
        // A change from another node beats a message loaded from storage.
        assert_eq!(clock.remote("held", &stamp(1, "b"), false, || ()), Some(()));
        // Older, or equal, is ignored; newer applies; at the same millisecond the node name
        // decides.
        assert_eq!(clock.remote("t", &stamp(100, "b"), false, || ()), Some(()));
        assert_eq!(clock.remote("t", &stamp(99, "c"), false, || ()), None);
        assert_eq!(clock.remote("t", &stamp(100, "b"), false, || ()), None);
        assert_eq!(clock.remote("t", &stamp(100, "c"), false, || ()), Some(()));
        // A local change after one from a node whose clock is far ahead still wins: its stamp
        // is one more than the topic's last.
        let future = now_ms() + 3_600_000;
        assert_eq!(
            clock.remote("t", &stamp(future, "z"), false, || ()),
            Some(())
        );
        assert_eq!(clock.local(&msg("t", b"mine"), || 2), Some(2));
        let out = clock.take_outbox();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].stamp, stamp(future + 1, "a"));
        assert!(clock.take_outbox().is_empty());
        assert_eq!(clock.remote("t", &stamp(future, "z"), false, || ()), None);
    }

    #[test]
    fn a_clear_is_a_tombstone_until_pruned() {
        let clock = RetainedClock::default();
        clock.start("a", []);
        clock.local(&msg("gone", b""), || ());
        clock.local(&msg("kept", b"v"), || ());
        // The snapshot has the clear as an empty message, and the set topic's message.
        let snapshot = clock.snapshot(|t| Some(msg(t, b"v")), |t| msg(t, b""));
        let mut got: Vec<(String, bool)> = snapshot
            .iter()
            .map(|c| (c.topic.clone(), c.msg.payload.is_empty()))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [("gone".to_string(), true), ("kept".to_string(), false)]
        );
        // An older set does not bring the cleared message back...
        assert_eq!(clock.remote("gone", &stamp(1, "b"), false, || ()), None);
        // ...until the tombstone is pruned; set topics stay.
        clock.prune(Duration::ZERO);
        assert_eq!(clock.len(), 1);
        assert_eq!(clock.remote("gone", &stamp(1, "b"), false, || ()), Some(()));
        assert_eq!(clock.state.lock().tombstone_bytes, 0);
    }

    /// Clearing ever more topics keeps the tombstones' bytes bounded: the oldest go first,
    /// set topics stay.
    #[test]
    fn tombstones_are_bounded_in_bytes() {
        let clock = RetainedClock::default();
        clock.start("a", []);
        clock.local(&msg("kept", b"v"), || ());
        let long = "x".repeat(60_000);
        let cleared = TOMBSTONE_BYTES / 60_000 + 10;
        for i in 0..cleared {
            clock.local(&msg(&format!("{long}/{i:05}"), b""), || ());
        }
        let s = clock.state.lock();
        assert!(
            s.tombstone_bytes <= TOMBSTONE_BYTES,
            "{}",
            s.tombstone_bytes
        );
        let held: usize = s
            .stamps
            .iter()
            .filter(|(_, e)| e.cleared_at.is_some())
            .map(|(t, _)| t.len())
            .sum();
        assert_eq!(held, s.tombstone_bytes);
        assert!(s.stamps.contains_key("kept"));
        assert!(
            s.stamps.contains_key(&format!("{long}/{:05}", cleared - 1)),
            "the newest stays"
        );
        assert!(
            !s.stamps.contains_key(&format!("{long}/00000")),
            "the oldest went"
        );
    }
}
