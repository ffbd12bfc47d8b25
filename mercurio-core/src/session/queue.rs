//! A session's queue and the limits it is held to.

use std::collections::VecDeque;
use std::time::Duration;

use super::Delivery;

/// Limits applied when enqueueing (`max_queued_messages`, `max_queued_qos0_messages`,
/// `max_queued_bytes`), and the marks of back pressure (ARCHITECTURE.md, "Flow control").
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueLimits {
    pub max_messages: usize,
    pub max_qos0_messages: usize,
    /// 0 = unlimited.
    pub max_bytes: u64,
    /// From this many queued messages on, publishers routing into the session wait.
    pub high_water_messages: usize,
    /// From this many queued bytes on, publishers routing into the session wait.
    pub high_water_bytes: u64,
    /// A client with queued messages that takes none for this long is stalled.
    pub stall_time: Duration,
}

impl QueueLimits {
    /// The limits of `server`: the high-water marks are capped at half of the matching queue
    /// limits, so that publishers slow down before anything is dropped.
    pub(crate) fn new(server: &crate::config::ServerConfig) -> QueueLimits {
        let half_bytes = match server.max_queued_bytes {
            0 => u64::MAX,
            b => b / 2,
        };
        QueueLimits {
            max_messages: server.max_queued_messages,
            max_qos0_messages: server.max_queued_qos0_messages,
            max_bytes: server.max_queued_bytes,
            high_water_messages: server
                .queue_high_water
                .min(server.max_queued_messages / 2)
                .min(server.max_queued_qos0_messages / 2)
                .max(1),
            high_water_bytes: server.queue_high_water_bytes.min(half_bytes).max(1),
            stall_time: Duration::from_secs(server.stall_time.max(1)),
        }
    }
}

/// A session's queue: deliveries waiting for the client, and the bytes they hold (topic,
/// properties and payload: what `max_queued_bytes` bounds), kept together by every change.
/// Each delivery's cost is computed once, when it is queued, and kept beside it.
#[derive(Debug, Default)]
pub(crate) struct Queue {
    items: VecDeque<(Delivery, u64)>,
    bytes: u64,
}

impl Queue {
    /// Deliveries queued.
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Bytes of the queued deliveries ([`Delivery::cost`]).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The next delivery, left in place.
    pub(crate) fn front(&self) -> Option<&Delivery> {
        self.items.front().map(|(q, _)| q)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Delivery> {
        self.items.iter().map(|(q, _)| q)
    }

    /// Adds a delivery at the end.
    pub(crate) fn push_back(&mut self, q: Delivery) {
        let cost = q.cost();
        self.push_back_costing(q, cost);
    }

    /// Adds a delivery at the end, its [`Delivery::cost`] already computed.
    pub(super) fn push_back_costing(&mut self, q: Delivery, cost: u64) {
        self.bytes += cost;
        self.items.push_back((q, cost));
    }

    /// Puts back at the head a delivery just taken by [`Queue::pop_front`].
    pub(crate) fn push_front(&mut self, q: Delivery) {
        let cost = q.cost();
        self.bytes += cost;
        self.items.push_front((q, cost));
    }

    /// Takes the next delivery.
    pub(crate) fn pop_front(&mut self) -> Option<Delivery> {
        let (q, cost) = self.items.pop_front()?;
        self.bytes = self.bytes.saturating_sub(cost);
        Some(q)
    }

    /// Keeps the deliveries for which `keep` is true, in order; returns those removed.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Delivery) -> bool) -> Vec<Delivery> {
        let mut removed = Vec::new();
        for (q, cost) in std::mem::take(&mut self.items) {
            if keep(&q) {
                self.items.push_back((q, cost));
            } else {
                self.bytes = self.bytes.saturating_sub(cost);
                removed.push(q);
            }
        }
        removed
    }
}
