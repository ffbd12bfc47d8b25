//! The broker-wide account of the bytes sessions' queues hold in memory, and its bound
//! (`[server] max_queued_memory`; ARCHITECTURE.md, "Flow control").
//!
//! What is counted: every delivery waiting in a session's queue, at its
//! [`Delivery::cost`](crate::session::Delivery) (the message's topic, properties and payload,
//! and its subscription identifiers: what `max_queued_bytes` counts), once per queue it is
//! in: a message queued for three sessions counts three times, as each session's
//! `queued_bytes` counts it, although the three deliveries share one copy of the payload.
//! Not counted: messages in flight (sent, awaiting their acknowledgement), retained messages,
//! stream entries, and a restored session's queue left in storage until it is read.
//!
//! Each queue ([`Queue`](crate::session::Queue)) adds and takes out its deliveries' costs as
//! they come and go (one atomic add per change), and gives back what it still holds when it
//! is dropped, so the total is the sum of the queues' `bytes` at every moment.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The bytes all sessions' queues hold, and the bound publishers wait under.
#[derive(Debug, Default)]
pub(crate) struct QueuedMemory {
    /// Sum of the queues' bytes.
    bytes: AtomicU64,
    /// `max_queued_memory`; 0 = no limit.
    limit: u64,
    /// A publisher waits for the total to go back to `limit` ([`QueuedMemory::wait_under`]).
    waited: AtomicBool,
    /// A wait ran out (nobody drained the queues for `stall_time`): publishers shed rather
    /// than wait, until the total is back at half the bound (`broker::memory_bound`).
    stalled: AtomicBool,
    /// Signalled when the total goes back to `limit` while `waited` is set.
    room: Notify,
    /// The total when the last round of releasing or shedding freed nothing (0: it did, or
    /// none ran since the total was last at half the bound): the next round waits until
    /// the total has grown by an eighth of the bound, so that a bound held by what cannot
    /// be freed (connected clients) does not make every PUBLISH visit every session.
    fruitless: AtomicU64,
}

impl QueuedMemory {
    /// An empty account bounded by `limit` bytes (0: no limit).
    pub(crate) fn new(limit: u64) -> QueuedMemory {
        QueuedMemory {
            limit,
            ..QueuedMemory::default()
        }
    }

    /// Bytes queued now, in every session's queue.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The bound, in bytes; 0 = no limit.
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// True while a bound is set and the queues hold more than it.
    #[inline]
    pub(crate) fn over(&self) -> bool {
        self.limit > 0 && self.bytes.load(Ordering::SeqCst) > self.limit
    }

    /// A queue took `n` more bytes.
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::SeqCst);
    }

    /// A queue gave back `n` bytes; wakes the publishers waiting for the total to be back
    /// under the bound when it now is.
    #[inline]
    pub(crate) fn sub(&self, n: u64) {
        let before = self.bytes.fetch_sub(n, Ordering::SeqCst);
        let after = before.saturating_sub(n);
        if self.limit == 0 || after > self.limit {
            return;
        }
        if self.waited.load(Ordering::SeqCst) && self.waited.swap(false, Ordering::SeqCst) {
            self.room.notify_waiters();
        }
        if after <= self.limit / 2 && self.fruitless.load(Ordering::Relaxed) != 0 {
            self.fruitless.store(0, Ordering::Relaxed);
        }
        if after <= self.limit / 2
            && self.stalled.load(Ordering::Relaxed)
            && self.stalled.swap(false, Ordering::Relaxed)
        {
            tracing::info!(
                queued_bytes = after,
                "queued messages back at half of max_queued_memory: publishers wait again"
            );
        }
    }

    /// True while the memory is stalled: a wait for the bound ran out, and the total has not
    /// been back at half the bound since.
    pub(crate) fn stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }

    /// Whether a round of releasing or shedding may free something: none since the last
    /// fruitless one, or the total grew by an eighth of the bound since.
    pub(crate) fn worth_a_round(&self) -> bool {
        let at = self.fruitless.load(Ordering::Relaxed);
        at == 0 || self.bytes() >= at.saturating_add(self.limit / 8)
    }

    /// A round of releasing or shedding is over: `freed_any` false when it freed nothing
    /// (the next waits, see [`QueuedMemory::worth_a_round`]).
    pub(crate) fn round_done(&self, freed_any: bool) {
        let at = if freed_any { 0 } else { self.bytes().max(1) };
        self.fruitless.store(at, Ordering::Relaxed);
    }

    /// Marks the memory stalled; true when it was not (the caller logs it, once).
    pub(crate) fn set_stalled(&self) -> bool {
        !self.stalled.swap(true, Ordering::Relaxed)
    }

    /// Waits until the total is back under the bound: true then (or at once when it is),
    /// false when `patience` ran out first (the caller sheds, `broker::memory_bound`).
    /// Wakes on the queues' progress (`sub`); the only timer is the deadline.
    pub(crate) async fn wait_under(&self, patience: Duration) -> bool {
        let deadline = Instant::now() + patience;
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Marked before the total is read, and `sub` reads the mark after it changed
            // the total (both sequentially consistent): one of the two sees the other.
            self.waited.store(true, Ordering::SeqCst);
            if !self.over() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline.into()) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_follows_adds_and_subs_and_the_bound() {
        let m = QueuedMemory::new(100);
        assert!(!m.over());
        m.add(60);
        m.add(60);
        assert_eq!(m.bytes(), 120);
        assert!(m.over());
        m.sub(20);
        assert_eq!(m.bytes(), 100);
        assert!(!m.over(), "at the bound is not over it");
        assert!(m.worth_a_round());
        m.round_done(false);
        assert!(!m.worth_a_round(), "nothing freed at 100");
        m.add(11);
        assert!(!m.worth_a_round(), "grown by less than an eighth");
        m.add(1);
        assert!(m.worth_a_round(), "grown by an eighth");
        m.round_done(true);
        assert!(m.worth_a_round());
        m.round_done(false);
        m.sub(62);
        assert!(m.worth_a_round(), "back at half the bound");
        let unbounded = QueuedMemory::new(0);
        unbounded.add(u64::MAX / 2);
        assert!(!unbounded.over());
    }

    #[tokio::test]
    async fn a_waiter_wakes_when_the_total_goes_back_under_the_bound() {
        let m = std::sync::Arc::new(QueuedMemory::new(100));
        m.add(150);
        let waiter = tokio::spawn({
            let m = std::sync::Arc::clone(&m);
            async move { m.wait_under(Duration::from_secs(3600)).await }
        });
        tokio::task::yield_now().await;
        m.sub(30);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "still over the bound");
        m.sub(30);
        assert!(waiter.await.expect("waiter"), "back under the bound");
    }

    #[tokio::test]
    async fn a_waiter_gives_up_after_its_patience() {
        let m = QueuedMemory::new(100);
        m.add(150);
        assert!(!m.wait_under(Duration::from_millis(10)).await);
        assert!(m.set_stalled() && !m.set_stalled(), "marked once");
        m.sub(50);
        assert!(m.wait_under(Duration::ZERO).await);
        assert!(m.stalled(), "at the bound, not at half of it");
        m.sub(50);
        assert!(!m.stalled(), "back at half the bound");
    }
}
