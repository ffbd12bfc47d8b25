//! A session's queue and the limits it is held to.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::Delivery;
use crate::codec::QoS;
use crate::queued_memory::QueuedMemory;

/// QoS 0 deliveries that count as one message towards the high-water mark. They wait for no
/// acknowledgement, so the writer takes all of them at each wake-up: a deeper QoS 0 queue
/// makes fewer, larger writes (a fan-out to 10 subscribers delivered about half as much
/// again at 4 as at 1; docs/BENCHMARKS.md, "Fewer, larger writes"), while QoS 1/2
/// deliveries, paced by the client's window, gain nothing from waiting in a longer queue.
const QOS0_SHARE: usize = 4;

/// Limits applied when enqueueing (`max_queued_messages`, `max_queued_qos0_messages`,
/// `max_queued_bytes`), and the marks of back pressure (ARCHITECTURE.md, "Flow control").
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueLimits {
    pub max_messages: usize,
    pub max_qos0_messages: usize,
    /// 0 = unlimited.
    pub max_bytes: u64,
    /// From this many queued messages on ([`Queue::pressure`]), publishers routing into the
    /// session wait.
    pub high_water_messages: usize,
    /// How many QoS 0 deliveries count as one message towards `high_water_messages`: 4, or
    /// fewer when `max_queued_qos0_messages` is small (the QoS 0 mark stays at half of it).
    pub qos0_share: usize,
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
        let high_water_messages = server
            .queue_high_water
            .min(server.max_queued_messages / 2)
            .min(server.max_queued_qos0_messages / 2)
            .max(1);
        QueueLimits {
            max_messages: server.max_queued_messages,
            max_qos0_messages: server.max_queued_qos0_messages,
            max_bytes: server.max_queued_bytes,
            high_water_messages,
            qos0_share: (server.max_queued_qos0_messages / 2 / high_water_messages)
                .clamp(1, QOS0_SHARE),
            high_water_bytes: server.queue_high_water_bytes.min(half_bytes).max(1),
            stall_time: Duration::from_secs(server.stall_time.max(1)),
        }
    }
}

/// A session's queue: deliveries waiting for the client, and the bytes they hold (topic,
/// properties and payload: what `max_queued_bytes` bounds), kept together by every change.
/// Each delivery's cost is computed once, when it is queued, and kept beside it, and added
/// to the broker-wide account ([`QueuedMemory`]) while it is queued.
#[derive(Debug)]
pub(crate) struct Queue {
    items: VecDeque<(Delivery, u64)>,
    bytes: u64,
    /// How many of `items` are QoS 0.
    qos0: usize,
    /// The broker's account of every queue's bytes.
    memory: Arc<QueuedMemory>,
}

impl Drop for Queue {
    /// What the queue still holds leaves the broker's account with it.
    fn drop(&mut self) {
        self.memory.sub(self.bytes);
    }
}

impl Queue {
    /// An empty queue whose bytes count in `memory`.
    pub(crate) fn new(memory: Arc<QueuedMemory>) -> Queue {
        Queue {
            items: VecDeque::new(),
            bytes: 0,
            qos0: 0,
            memory,
        }
    }

    /// Deliveries queued.
    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The queue's length as the high-water mark counts it: QoS 1/2 deliveries one each, QoS 0
    /// ones `qos0_share` to a message (rounded up).
    pub(crate) fn pressure(&self, qos0_share: usize) -> usize {
        self.items.len() - self.qos0 + self.qos0.div_ceil(qos0_share.max(1))
    }

    /// Bytes of the queued deliveries ([`Delivery::cost`]).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The next delivery, left in place.
    pub(crate) fn front(&self) -> Option<&Delivery> {
        self.items.front().map(|(q, _)| q)
    }

    /// Gives back the room of deliveries gone when the queue holds less than a quarter of
    /// it (after a release to storage: a queue's room would otherwise stay at the most it
    /// ever held).
    pub(crate) fn shrink(&mut self) {
        if self.items.len() < self.items.capacity() / 4 {
            self.items.shrink_to_fit();
        }
    }

    /// The last delivery queued.
    pub(crate) fn back(&self) -> Option<&Delivery> {
        self.items.back().map(|(q, _)| q)
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
        self.added(&q, cost);
        self.items.push_back((q, cost));
    }

    /// Puts back at the head a delivery just taken by [`Queue::pop_front`].
    pub(crate) fn push_front(&mut self, q: Delivery) {
        let cost = q.cost();
        self.added(&q, cost);
        self.items.push_front((q, cost));
    }

    /// Takes the next delivery.
    pub(crate) fn pop_front(&mut self) -> Option<Delivery> {
        let (q, cost) = self.items.pop_front()?;
        self.removed(&q, cost);
        Some(q)
    }

    /// Keeps the deliveries for which `keep` is true, in order; returns those removed.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Delivery) -> bool) -> Vec<Delivery> {
        let mut removed = Vec::new();
        for (q, cost) in std::mem::take(&mut self.items) {
            if keep(&q) {
                self.items.push_back((q, cost));
            } else {
                self.removed(&q, cost);
                removed.push(q);
            }
        }
        removed
    }

    fn added(&mut self, q: &Delivery, cost: u64) {
        self.bytes += cost;
        self.memory.add(cost);
        self.qos0 += usize::from(q.qos == QoS::AtMostOnce);
    }

    fn removed(&mut self, q: &Delivery, cost: u64) {
        let cost = cost.min(self.bytes);
        self.bytes -= cost;
        self.memory.sub(cost);
        self.qos0 -= usize::from(q.qos == QoS::AtMostOnce);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::ServerConfig;
    use crate::message::Message;

    fn delivery(qos: QoS) -> Delivery {
        delivery_of(qos, bytes::Bytes::from_static(b"x"))
    }

    /// A delivery of a message on `t` with `payload` (the session's tests use it too).
    pub(in crate::session) fn delivery_of(qos: QoS, payload: bytes::Bytes) -> Delivery {
        Delivery {
            msg: Arc::new(Message::for_test("t", payload, qos)),
            qos,
            retain: false,
            subscription_ids: Vec::new(),
            seq: 0,
            share: None,
        }
    }

    #[test]
    fn qos0_deliveries_weigh_a_share_of_a_message_on_the_high_water_mark() {
        let mut q = Queue::new(Arc::default());
        for _ in 0..5 {
            q.push_back(delivery(QoS::AtMostOnce));
        }
        q.push_back(delivery(QoS::AtLeastOnce));
        q.push_front(delivery(QoS::ExactlyOnce));
        // 2 QoS 1/2, and 5 QoS 0 counted 4 to a message, rounded up.
        assert_eq!(q.pressure(4), 4);
        assert_eq!(q.pressure(1), 7);
        let removed = q.retain(|d| d.qos != QoS::AtLeastOnce);
        assert_eq!(removed.len(), 1);
        while q.front().is_some_and(|d| d.qos != QoS::AtMostOnce) {
            q.pop_front();
        }
        assert_eq!(q.pressure(4), 2);
        while q.pop_front().is_some() {}
        assert_eq!((q.pressure(4), q.bytes()), (0, 0));
    }

    /// The broker's account is the sum of its queues' bytes through every change, and a
    /// dropped queue gives back what it held.
    #[test]
    fn queues_count_their_bytes_in_the_broker_account() {
        let memory = Arc::new(QueuedMemory::new(0));
        let mut a = Queue::new(Arc::clone(&memory));
        let mut b = Queue::new(Arc::clone(&memory));
        let cost = delivery(QoS::AtLeastOnce).cost();
        for _ in 0..3 {
            a.push_back(delivery(QoS::AtLeastOnce));
        }
        // One message queued for two sessions counts twice, as each queue counts it.
        let shared = delivery(QoS::AtMostOnce);
        a.push_back(shared.clone());
        b.push_back(shared);
        assert_eq!(memory.bytes(), 5 * cost);
        assert_eq!(memory.bytes(), a.bytes() + b.bytes());
        let head = a.pop_front().expect("queued");
        a.push_front(head);
        a.pop_front();
        assert_eq!(memory.bytes(), 4 * cost);
        let removed = a.retain(|d| d.qos != QoS::AtMostOnce);
        assert_eq!(removed.len(), 1);
        assert_eq!(memory.bytes(), 3 * cost);
        drop(a);
        assert_eq!(
            memory.bytes(),
            cost,
            "what a dropped queue held leaves the account"
        );
        drop(b);
        assert_eq!(memory.bytes(), 0);
    }

    #[test]
    fn the_qos0_mark_stays_at_half_of_max_queued_qos0_messages() {
        let limits = |high_water, qos0| {
            let server = ServerConfig {
                queue_high_water: high_water,
                max_queued_qos0_messages: qos0,
                ..ServerConfig::default()
            };
            let l = QueueLimits::new(&server);
            (l.high_water_messages, l.qos0_share)
        };
        // Defaults: a mark of 100, QoS 0 counted 4 to a message (400 <= 1,000 / 2).
        assert_eq!(limits(100, 1_000), (100, 4));
        assert_eq!(limits(100, 600), (100, 3));
        assert_eq!(limits(100, 50), (25, 1));
        assert_eq!(limits(100, usize::MAX), (100, 4));
    }
}
