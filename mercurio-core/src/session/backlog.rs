//! A session's backlog: the deliveries its queue held in storage when the broker started,
//! or that the broker released from memory to storage while the client was away
//! (`max_queued_memory`, [`SessionState::release_to_storage`]), left there until something
//! needs them (ARCHITECTURE.md, "Restore").
//!
//! A session restored with a backlog counts it in its queue's length (limits, `client show`,
//! `$SYS`) without holding it in memory. Deliveries queued after the restart go to the
//! in-memory queue as usual: their positions (`seq`) are above every stored one. The broker
//! reads the backlog from storage (`BrokerState::load_backlog`) before the queue's contents
//! are needed, and [`SessionState::install_backlog`] puts it at the head of the queue, in
//! order, ahead of what was queued since.

use super::{Delivery, SessionState};
use crate::codec::QoS;

/// The part of a session's queue left in storage at the restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backlog {
    /// Deliveries it holds.
    pub len: u64,
    /// The highest position (`seq`) it holds: deliveries queued since are numbered above.
    pub last_seq: u64,
    /// Some of it was left in storage at the restore: the broker holds the restored
    /// messages for it until it is read or dropped (`broker::backlog::HeldMessages`).
    pub restored: bool,
}

impl SessionState {
    /// Restore: the queue's stored part, left in storage (not reported: it is stored). Numbers
    /// the next queued message after it.
    pub(crate) fn restore_backlog(&mut self, backlog: Backlog) {
        self.restored_seq(backlog.last_seq);
        self.backlog = Some(Box::new(backlog));
    }

    /// The queue's part still in storage, if any.
    pub(crate) fn backlog(&self) -> Option<Backlog> {
        self.backlog.as_deref().copied()
    }

    /// Deliveries queued: those in memory and those of the backlog still in storage.
    pub(crate) fn queued_len(&self) -> usize {
        let stored = self.backlog.as_ref().map_or(0, |b| b.len);
        self.queue.len() + usize::try_from(stored).unwrap_or(usize::MAX)
    }

    /// The backlog read from storage (`deliveries`, in order, their positions at most
    /// [`Backlog::last_seq`]) goes to the head of the queue, before the deliveries queued
    /// since. Returns the backlog it replaced; `None`, and nothing changes, when the session
    /// has no backlog any more (another reader installed it first, or the session ended):
    /// the caller drops `deliveries`.
    pub(crate) fn install_backlog(&mut self, deliveries: Vec<Delivery>) -> Option<Backlog> {
        if self.ended {
            return None;
        }
        let backlog = self.backlog.take()?;
        for q in deliveries.into_iter().rev() {
            self.queue.push_front(q);
        }
        Some(*backlog)
    }

    /// The session ends with its backlog in storage (deleted there with the session): the
    /// backlog it had, if any.
    pub(super) fn drop_backlog(&mut self) -> Option<Backlog> {
        self.backlog.take().map(|b| *b)
    }

    /// `max_queued_memory`: the deliveries at the head of the queue up to position `upto`,
    /// which storage holds (the caller waited for their commit), leave memory and join the
    /// backlog (after the part already there, if any), to be read back as a restored one is.
    /// Stops at a delivery made through a shared subscription or at QoS 0 (neither is left
    /// in storage). Returns the bytes the queue gave back: 0, and nothing changes, when the
    /// session is connected or ended, or its head is above `upto`.
    pub(crate) fn release_to_storage(&mut self, upto: u64) -> u64 {
        if self.ended || self.link.is_some() || self.stored().is_none() {
            return 0;
        }
        let before = self.queue.bytes();
        let mut released = 0;
        let mut last = None;
        while self
            .queue
            .front()
            .is_some_and(|q| q.seq <= upto && q.share.is_none() && q.qos != QoS::AtMostOnce)
        {
            if let Some(q) = self.queue.pop_front() {
                last = Some(q.seq);
                released += 1;
            }
        }
        let Some(last_seq) = last else {
            return 0;
        };
        self.queue.shrink();
        match self.backlog.as_deref_mut() {
            Some(b) => {
                b.len += released;
                b.last_seq = last_seq;
            }
            None => {
                self.backlog = Some(Box::new(Backlog {
                    len: released,
                    last_seq,
                    restored: false,
                }))
            }
        }
        before - self.queue.bytes()
    }
}
