//! A restored session's backlog: the deliveries its queue held in storage when the broker
//! started, left there until something needs them (ARCHITECTURE.md, "Restore").
//!
//! A session restored with a backlog counts it in its queue's length (limits, `client show`,
//! `$SYS`) without holding it in memory. Deliveries queued after the restart go to the
//! in-memory queue as usual: their positions (`seq`) are above every stored one. The broker
//! reads the backlog from storage (`BrokerState::load_backlog`) before the queue's contents
//! are needed, and [`SessionState::install_backlog`] puts it at the head of the queue, in
//! order, ahead of what was queued since.

use super::{Delivery, SessionState};

/// The part of a session's queue left in storage at the restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backlog {
    /// Deliveries it holds.
    pub len: u64,
    /// The highest position (`seq`) it holds: deliveries queued since are numbered above.
    pub last_seq: u64,
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
    /// since. False, and nothing changes, when the session has no backlog any more (another
    /// reader installed it first, or the session ended): the caller drops `deliveries`.
    pub(crate) fn install_backlog(&mut self, deliveries: Vec<Delivery>) -> bool {
        if self.ended || self.backlog.take().is_none() {
            return false;
        }
        for q in deliveries.into_iter().rev() {
            self.queue.push_front(q);
        }
        true
    }

    /// The session ends with its backlog in storage (deleted there with the session): true
    /// when it had one.
    pub(super) fn drop_backlog(&mut self) -> bool {
        self.backlog.take().is_some()
    }
}
