//! Broker-wide counters: what `$SYS/broker/...` and `/metrics` report (docs/operations.md,
//! "$SYS"; the metric names in docs/http.md). The live ones are the crate's own
//! ([`Counters`]: plain relaxed atomics, updated where the event happens); applications get
//! a [`Stats`] snapshot of them, which they cannot change the broker through.

use std::sync::atomic::{AtomicU64, Ordering};

/// Why a message accepted from a publisher did not reach one of its subscribers
/// (`$SYS/broker/publish/messages/dropped/<cause>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropCause {
    /// A QoS 0 message found the queue at `max_queued_qos0_messages`.
    QueueFullQos0,
    /// A QoS 1/2 message found the queue at `max_queued_messages` or `max_queued_bytes`.
    QueueFull,
    /// The Message Expiry Interval passed while it waited in a queue.
    Expired,
    /// Larger than the subscriber's Maximum Packet Size.
    TooLarge,
    /// The subscriber may not read the topic.
    NotAuthorized,
    /// No member of a shared subscription's group could take it.
    NoShareMember,
    /// Dropped from a queue for the broker-wide `max_queued_memory`: a queued QoS 0
    /// message, or one of the oldest queued messages of an offline session.
    MemoryFull,
}

impl DropCause {
    /// Every cause, in the order `$SYS` and `/metrics` list them.
    pub const ALL: [DropCause; 7] = [
        DropCause::QueueFullQos0,
        DropCause::QueueFull,
        DropCause::Expired,
        DropCause::TooLarge,
        DropCause::NotAuthorized,
        DropCause::NoShareMember,
        DropCause::MemoryFull,
    ];

    /// The name in `$SYS` and `/metrics`: `queue_full_qos0`, `queue_full`, `expired`, `too_large`,
    /// `not_authorized`, `no_share_member`, `memory_full`.
    pub fn name(self) -> &'static str {
        match self {
            DropCause::QueueFullQos0 => "queue_full_qos0",
            DropCause::QueueFull => "queue_full",
            DropCause::Expired => "expired",
            DropCause::TooLarge => "too_large",
            DropCause::NotAuthorized => "not_authorized",
            DropCause::NoShareMember => "no_share_member",
            DropCause::MemoryFull => "memory_full",
        }
    }
}

/// The broker's counters at one moment, as [`BrokerHandle::stats`](crate::BrokerHandle::stats)
/// returns them: plain values (what `$SYS` and `/metrics` report), read field by field
/// without a common lock (each is exact, two may be a few events apart). Counts are since
/// start; the fields called gauges are values now. Changing a copy changes nothing in the
/// broker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub messages_received: u64,
    pub messages_sent: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub connections_total: u64,
    pub clients_connected: u64,
    pub clients_maximum: u64,
    pub sessions_expired: u64,
    /// Messages a shared subscription's member left unacknowledged (its session ended, or it
    /// left the group) that another member of the group took (MQTT 5.0 section 4.8.2).
    pub shared_passed_on: u64,
    /// Times a client with queued messages was found stalled (took none for `stall_time`)
    /// while publishers routed into its queue: from then on it held nobody back.
    pub clients_stalled: u64,
    /// Times a client's PUBLISH waited for `max_publish_rate` or `max_publish_bytes_rate`
    /// (its socket not read meanwhile).
    pub clients_rate_limited: u64,
    /// Milliseconds clients' PUBLISH packets waited for the publish rate limits, in total.
    pub clients_rate_limited_ms: u64,
    /// Connections parked now: idle for `park_after`, held as a socket and a small record
    /// instead of a task (a gauge).
    pub clients_parked: u64,
    /// Connections served again on another thread than the one that served them before
    /// (`--threads` above 1: a move off a busy thread, or an idle connection resumed
    /// elsewhere), since the start.
    pub clients_moved: u64,
    /// Accepted connections that waited for their listener's `max_connection_rate`.
    pub connections_delayed: u64,
    /// Batches of session changes written again after a storage error.
    pub storage_batches_retried: u64,
    /// Batches of session changes storage refused for good.
    pub storage_batches_dropped: u64,
    /// Clients whose stored state differs from the broker's (a gauge).
    pub storage_clients_dirty: u64,
    /// Stored sessions that could not be read at start (a gauge).
    pub storage_sessions_set_aside: u64,
    /// Bytes of changes not yet stored (a gauge): what `[storage] max_pending_bytes_total`
    /// bounds.
    pub storage_pending_bytes: u64,
    /// Connections not read now because their client owes storage too much (a gauge).
    pub storage_clients_waiting: u64,
    /// Attempts to write a batch that storage failed (each retry counts).
    pub storage_writes_failed: u64,
    /// 1 while storage has taken no write for a second or more (a full disk, an unreachable
    /// database), else 0 (a gauge).
    pub storage_unwritable: u64,
    /// Retained messages not kept because `max_retained_messages` was reached (delivered
    /// to the subscribers all the same).
    pub retained_not_kept_count: u64,
    /// Retained messages not kept because they would have taken the retained messages'
    /// total over `max_retained_bytes` (delivered to the subscribers all the same).
    pub retained_not_kept_bytes: u64,
    /// Bytes the messages waiting in every session's queue hold (a gauge, what
    /// `max_queued_memory` bounds; `$SYS/broker/queued messages/bytes`): each queued
    /// delivery's topic, properties and payload, once per queue it is in.
    pub queued_bytes: u64,
    dropped: [u64; 7],
}

/// The broker's live counters, private to the crate: plain relaxed atomics, updated where
/// the event happens. Gauges (clients connected, sessions, subscriptions, retained) are read
/// from the broker's state when asked, not kept here. Applications read a [`Stats`] snapshot.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) messages_received: AtomicU64,
    pub(crate) messages_sent: AtomicU64,
    pub(crate) bytes_received: AtomicU64,
    pub(crate) bytes_sent: AtomicU64,
    pub(crate) connections_total: AtomicU64,
    pub(crate) clients_connected: AtomicU64,
    pub(crate) clients_maximum: AtomicU64,
    pub(crate) sessions_expired: AtomicU64,
    /// Messages a shared subscription's member left unacknowledged (its session ended, or it
    /// left the group) that another member of the group took (MQTT 5.0 section 4.8.2).
    pub(crate) shared_passed_on: AtomicU64,
    /// Times a client with queued messages was found stalled (took none for `stall_time`)
    /// while publishers routed into its queue: from then on it held nobody back.
    pub(crate) clients_stalled: AtomicU64,
    /// Times a client's PUBLISH waited for `max_publish_rate` or `max_publish_bytes_rate`.
    pub(crate) clients_rate_limited: AtomicU64,
    /// Microseconds clients' PUBLISH packets waited for the publish rate limits, in total.
    pub(crate) clients_rate_limited_us: AtomicU64,
    /// Connections parked now: idle for `park_after`, held as a socket and a small record
    /// instead of a task (a gauge).
    pub(crate) clients_parked: AtomicU64,
    /// Connections served again on another shard than the one that served them before.
    pub(crate) clients_moved: AtomicU64,
    /// Accepted connections that waited for their listener's `max_connection_rate`.
    pub(crate) connections_delayed: AtomicU64,
    /// Batches of session changes written again after a storage error.
    pub(crate) storage_batches_retried: AtomicU64,
    /// Batches of session changes storage refused for good.
    pub(crate) storage_batches_dropped: AtomicU64,
    /// Clients whose stored state differs from the broker's (a gauge).
    pub(crate) storage_clients_dirty: AtomicU64,
    /// Stored sessions that could not be read at start (a gauge).
    pub(crate) storage_sessions_set_aside: AtomicU64,
    /// Bytes of changes not yet stored (a gauge): what `[storage] max_pending_bytes_total`
    /// bounds.
    pub(crate) storage_pending_bytes: AtomicU64,
    /// Connections not read now because their client owes storage too much (a gauge).
    pub(crate) storage_clients_waiting: AtomicU64,
    /// Attempts to write a batch that storage failed (each retry counts).
    pub(crate) storage_writes_failed: AtomicU64,
    /// 1 while storage has taken no write for a second or more (a full disk, an unreachable
    /// database), else 0 (a gauge).
    pub(crate) storage_unwritable: AtomicU64,
    /// Retained messages not kept because `max_retained_messages` was reached (delivered
    /// to the subscribers all the same).
    pub(crate) retained_not_kept_count: AtomicU64,
    /// Retained messages not kept because they would have taken the retained messages'
    /// total over `max_retained_bytes` (delivered to the subscribers all the same).
    pub(crate) retained_not_kept_bytes: AtomicU64,
    dropped: [AtomicU64; 7],
}

impl Counters {
    /// Counts one dropped message.
    pub(crate) fn dropped(&self, cause: DropCause) {
        self.dropped[cause as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Messages dropped for `cause` since start.
    pub(crate) fn dropped_count(&self, cause: DropCause) -> u64 {
        self.dropped[cause as usize].load(Ordering::Relaxed)
    }

    /// Messages dropped for any cause since start.
    pub(crate) fn dropped_total(&self) -> u64 {
        self.dropped.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn client_connected(&self) {
        let now = self.clients_connected.fetch_add(1, Ordering::Relaxed) + 1;
        self.clients_maximum.fetch_max(now, Ordering::Relaxed);
        self.connections_total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn client_disconnected(&self) {
        self.clients_connected.fetch_sub(1, Ordering::Relaxed);
    }

    /// The counters now, as the plain values applications read.
    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            messages_received: self.messages_received.load(Ordering::Relaxed),
            messages_sent: self.messages_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            connections_total: self.connections_total.load(Ordering::Relaxed),
            clients_connected: self.clients_connected.load(Ordering::Relaxed),
            clients_maximum: self.clients_maximum.load(Ordering::Relaxed),
            sessions_expired: self.sessions_expired.load(Ordering::Relaxed),
            shared_passed_on: self.shared_passed_on.load(Ordering::Relaxed),
            clients_stalled: self.clients_stalled.load(Ordering::Relaxed),
            clients_rate_limited: self.clients_rate_limited.load(Ordering::Relaxed),
            clients_rate_limited_ms: self.clients_rate_limited_us.load(Ordering::Relaxed) / 1000,
            clients_parked: self.clients_parked.load(Ordering::Relaxed),
            clients_moved: self.clients_moved.load(Ordering::Relaxed),
            connections_delayed: self.connections_delayed.load(Ordering::Relaxed),
            storage_batches_retried: self.storage_batches_retried.load(Ordering::Relaxed),
            storage_batches_dropped: self.storage_batches_dropped.load(Ordering::Relaxed),
            storage_clients_dirty: self.storage_clients_dirty.load(Ordering::Relaxed),
            storage_sessions_set_aside: self.storage_sessions_set_aside.load(Ordering::Relaxed),
            storage_pending_bytes: self.storage_pending_bytes.load(Ordering::Relaxed),
            storage_clients_waiting: self.storage_clients_waiting.load(Ordering::Relaxed),
            storage_writes_failed: self.storage_writes_failed.load(Ordering::Relaxed),
            storage_unwritable: self.storage_unwritable.load(Ordering::Relaxed),
            retained_not_kept_count: self.retained_not_kept_count.load(Ordering::Relaxed),
            retained_not_kept_bytes: self.retained_not_kept_bytes.load(Ordering::Relaxed),
            // Kept by the broker's `queued_memory`, not a counter: set by the handle.
            queued_bytes: 0,
            dropped: std::array::from_fn(|i| self.dropped[i].load(Ordering::Relaxed)),
        }
    }
}

impl Stats {
    /// Messages dropped for `cause` since start.
    pub fn dropped_count(&self, cause: DropCause) -> u64 {
        self.dropped[cause as usize]
    }

    /// Messages dropped for any cause since start.
    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().sum()
    }
}
