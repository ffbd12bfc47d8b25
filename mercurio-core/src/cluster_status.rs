//! The cluster link's live state and counters ([`ClusterStatus`]), read by `$SYS`
//! (`$SYS/broker/cluster/...`) and `/metrics` (`mercurio_cluster_...`). Kept apart from the
//! `cluster` module, which runs the link on top of the broker, so that the broker's state can
//! hold them without the two modules importing each other.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
}

/// One reading of [`ClusterStatus`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ClusterInfo {
    pub connected: bool,
    pub reconnects: u64,
    pub subscriptions: u64,
    pub messages_out: u64,
    pub bytes_out: u64,
    pub messages_in: u64,
    pub bytes_in: u64,
    pub duplicates: u64,
    pub errors: u64,
    pub slow_consumer: u64,
}

impl ClusterStatus {
    /// Adds `n` to a counter.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The current values, or `None` while cluster mode is off.
    pub(crate) fn info(&self) -> Option<ClusterInfo> {
        if !self.enabled.load(Ordering::Relaxed) {
            return None;
        }
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Some(ClusterInfo {
            connected: self.connected.load(Ordering::Relaxed),
            reconnects: get(&self.reconnects),
            subscriptions: get(&self.subscriptions),
            messages_out: get(&self.messages_out),
            bytes_out: get(&self.bytes_out),
            messages_in: get(&self.messages_in),
            bytes_in: get(&self.bytes_in),
            duplicates: get(&self.duplicates),
            errors: get(&self.errors),
            slow_consumer: get(&self.slow_consumer),
        })
    }
}
