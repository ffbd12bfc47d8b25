//! The broker-wide bound on queued memory (`[server] max_queued_memory`; ARCHITECTURE.md,
//! "Flow control"; what is counted: `queued_memory`).
//!
//! With a storage backend, over the bound, the publisher releases offline sessions' queues
//! to storage ([`BrokerState::release_to_storage`]): the largest first, until the total is
//! at [`RELEASE_TO`] of the bound, each session's queue up to its last delivery when the
//! release began, once the storage writer has committed everything emitted until then (the
//! publisher waits for that commit). The released deliveries become the session's backlog,
//! as a restored session's (`backlog.rs`): read back from storage when its client comes
//! back, before the session is attached. Nothing is dropped. Kept in memory, as at a
//! restore: sessions with a shared subscription, the broker's own (`$internal/...`), every
//! session while access is checked, connected ones, and a session the writer gave up a
//! change of (the commit then reports that storage does not hold everything, and nothing is
//! released that round). If what can be released does not bring the total back under the
//! bound, the publisher waits as below, for up to `stall_time`, then goes on (nothing is
//! dropped with storage).
//!
//! With the memory backend, over the bound, the entry's back pressure
//! ([`BrokerState::wait_congested`]) makes the publisher wait, as for a session at its
//! high-water mark, until the queues' drains bring the total back to the bound. If they do not within `stall_time` (nobody takes messages:
//! the queues belong to offline sessions), the memory is stalled: the waiting publisher
//! sheds, and from then on publishers that find the total over the bound shed at once
//! rather than wait, until the drains bring it down to half the bound.
//!
//! Shedding drops queued QoS 0 messages first (any session's), then the oldest queued
//! messages of offline sessions, the session offline longest first and from the head of
//! its queue, until the total is down to [`SHED_TO`] of the bound: a margin so that each
//! publish does not shed again (each shed visits every session). A round of either kind
//! that frees nothing is not tried again until the total has grown by an eighth of the
//! bound (or been back at half of it): what cannot be freed (connected sessions' QoS 1/2
//! messages) may then take the total over the bound by that eighth. Each drop is counted
//! `memory_full` and told as any other (`on_dropped`, `Event::MessageDropped`). Connected
//! sessions keep their QoS 1/2 messages: their clients are taking them.

use std::sync::Arc;
use std::time::Instant;

use super::BrokerState;
use crate::persist::Persister;
use crate::session::{Session, Shed};
use crate::stats::DropCause;

/// Shedding stops once the total is at this fraction of the bound (numerator, denominator).
const SHED_TO: (u64, u64) = (7, 8);

/// Releasing to storage stops once the total is at this fraction of the bound: lower than
/// [`SHED_TO`], since each round waits for the writer's commit (fewer, larger rounds).
const RELEASE_TO: (u64, u64) = (1, 2);

impl BrokerState {
    /// True when a publisher must wait for queued memory ([`BrokerState::wait_memory`]):
    /// a bound is set and the queues hold more than it.
    #[inline]
    pub(crate) fn memory_congested(&self) -> bool {
        self.queued_memory.over()
    }

    /// The publisher's side of the bound. With storage: releases offline sessions' queues
    /// to storage, then, if the total is still over, waits for up to `stall_time` (not at
    /// all while the memory is stalled). With the memory backend: waits for the total to go
    /// back under it, for up to `stall_time` (not at all while the memory is stalled), then
    /// sheds.
    pub(crate) async fn wait_memory(&self) {
        let m = &self.queued_memory;
        if !m.over() {
            return;
        }
        if let Some(p) = self.persist.get() {
            self.release_to_storage(p).await;
            if m.over()
                && !m.stalled()
                && !m.wait_under(self.limits.stall_time).await
                && m.set_stalled()
            {
                tracing::warn!(
                    queued_bytes = m.bytes(),
                    max_queued_memory = m.limit(),
                    "queued messages over max_queued_memory and none can be left in storage (connected clients, shared subscriptions, access checks): publishers no longer wait"
                );
            }
            return;
        }
        if !m.stalled() {
            if m.wait_under(self.limits.stall_time).await {
                return;
            }
            if m.set_stalled() {
                tracing::warn!(
                    queued_bytes = m.bytes(),
                    max_queued_memory = m.limit(),
                    stall_time = self.limits.stall_time.as_secs(),
                    "queued messages over max_queued_memory for stall_time: dropping QoS 0 then the oldest messages of offline sessions"
                );
            }
        }
        self.shed_memory();
    }

    /// Drops queued messages until the total is at [`SHED_TO`] of the bound: QoS 0 ones,
    /// then the oldest of offline sessions. Takes the session table's lock to list the
    /// sessions, then each session's, one at a time (never both).
    fn shed_memory(&self) {
        let m = &self.queued_memory;
        let target = m.limit() / SHED_TO.1 * SHED_TO.0;
        let to_free = || m.bytes().saturating_sub(target);
        if to_free() == 0 || !m.worth_a_round() {
            return;
        }
        let sessions: Vec<Arc<Session>> = self.sessions.lock().values().cloned().collect();
        let mut dropped = 0u64;
        for s in &sessions {
            if to_free() == 0 {
                break;
            }
            dropped += self.count_shed(s, s.shed(Shed::Qos0));
        }
        if to_free() > 0 {
            let mut offline: Vec<(Instant, &Arc<Session>)> = sessions
                .iter()
                .filter_map(|s| {
                    let st = s.state.lock();
                    let at = st.disconnected_at()?;
                    (!st.queue().is_empty()).then_some((at, s))
                })
                .collect();
            offline.sort_by_key(|(at, _)| *at);
            for (_, s) in offline {
                let bytes = to_free();
                if bytes == 0 {
                    break;
                }
                dropped += self.count_shed(s, s.shed(Shed::Oldest(bytes)));
            }
        }
        m.round_done(dropped > 0);
        tracing::debug!(
            dropped,
            queued_bytes = m.bytes(),
            "queued messages shed for max_queued_memory"
        );
    }

    /// With storage: releases offline sessions' queues to storage, the largest first, until
    /// the total is at [`RELEASE_TO`] of the bound, once their deliveries are committed. One
    /// publisher releases at a time (`releasing`); the others wait for it, then find the
    /// total under the bound, or release in turn.
    async fn release_to_storage(&self, p: &Persister) {
        let _releasing = self.releasing.lock().await;
        let m = &self.queued_memory;
        let target = m.limit() / RELEASE_TO.1 * RELEASE_TO.0;
        let to_free = m.bytes().saturating_sub(target);
        if to_free == 0 || self.checks_access || !m.worth_a_round() {
            return;
        }
        let sessions: Vec<Arc<Session>> = self.sessions.lock().values().cloned().collect();
        let mut candidates: Vec<(u64, u64, Arc<Session>)> = sessions
            .into_iter()
            .filter(|s| !s.is_internal())
            .filter_map(|s| {
                let st = s.state.lock();
                if st.is_connected() || st.ended() || st.disconnected_at().is_none() {
                    return None;
                }
                if st.subscriptions().keys().any(|f| f.starts_with("$share/")) {
                    return None;
                }
                let upto = st.queue().back()?.seq;
                let bytes = st.queue().bytes();
                drop(st);
                Some((bytes, upto, s))
            })
            .collect();
        candidates.sort_by_key(|c| std::cmp::Reverse(c.0));
        let mut chosen = Vec::new();
        let mut sum = 0;
        for c in candidates {
            if sum >= to_free {
                break;
            }
            sum += c.0;
            chosen.push(c);
        }
        if chosen.is_empty() {
            m.round_done(false);
            return;
        }
        // Every delivery up to each chosen `upto` was emitted before this point.
        let (tx, rx) = tokio::sync::oneshot::channel();
        p.after_commit(Box::new(move |stored| {
            let _ = tx.send(stored);
        }));
        if !rx.await.unwrap_or(false) {
            tracing::debug!("storage does not hold every queued message yet: none released");
            return;
        }
        let mut freed = 0;
        let mut released = 0;
        for (_, upto, s) in &chosen {
            let bytes = s.state.lock().release_to_storage(*upto);
            if bytes > 0 {
                freed += bytes;
                released += 1;
            }
        }
        m.round_done(freed > 0);
        tracing::debug!(
            sessions = released,
            freed,
            queued_bytes = m.bytes(),
            "queues left in storage for max_queued_memory"
        );
    }

    /// Counts and tells the drops of one session's shed; returns how many.
    fn count_shed(&self, s: &Session, msgs: Vec<Arc<crate::message::Message>>) -> u64 {
        for msg in &msgs {
            self.dropped(Some(&s.client_id), &msg.topic, DropCause::MemoryFull);
        }
        msgs.len() as u64
    }
}
