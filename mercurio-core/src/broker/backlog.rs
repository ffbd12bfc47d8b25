//! Backlogs, read from storage when they are needed: a session restored with its queue left
//! in storage, or whose queue the broker released to storage while its client was away
//! (`max_queued_memory`, `memory_bound.rs`) ([`Backlog`]), gets it back when its client
//! reconnects
//! (`take_session`, before the session is attached and drained), so that a restart reads a
//! row per session, not every queued delivery, and an offline fleet's backlog costs disk,
//! not memory (ARCHITECTURE.md, "Restore").
//!
//! Which sessions are restored so: every one except the broker's own (`$internal/...`,
//! attached without `take_session`) and those with a shared subscription, whose queue is read
//! at the restore; none when access is checked (the restore applies the rules of the restart
//! to every queued message, `restore::read_needed_queues`). A delivery made through a shared subscription is queued only while the
//! session is in the group (leaving it passes those deliveries on), so a backlog left in
//! storage holds none: a session that ends with its backlog unread (expiry, Clean Start,
//! `delete-session`) has nothing to pass on, and storage deletes the backlog with it.
//!
//! The messages restored backlogs refer to are restored with the rest ([`HeldMessages`]) and
//! held until the last restored backlog is read or dropped: storage keeps a message the
//! broker holds, so each one is there when its backlog is read. A backlog released while
//! running holds nothing in memory: its queue rows keep its messages in storage, and the
//! read fetches them (`Storage::load_messages`).
//!
//! Each delivery read is checked as the restore would have: those whose message cannot be
//! read are dequeued from storage (logged), and with access control those the client may no
//! longer read are dropped (`not_authorized`). Expired ones go to the queue: the drain drops
//! them as it drops any expired queued message, counted, its packet identifier used up.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use mercurio_storage::{Change, QueuedRecord, StorageError};
use parking_lot::Mutex;

use super::BrokerState;
use crate::auth::hooks::Action;
use crate::message::Message;
use crate::persist::records::{delivery_from, message_from, Restored};
use crate::session::{Backlog, Delivery, Session};
use crate::stats::DropCause;

/// First wait before reading a backlog again after a transient storage error; doubled up to
/// [`RETRY_MAX`], for at most [`RETRY_FOR`] in all (then the client is refused, and comes
/// back later).
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(1);
const RETRY_FOR: Duration = Duration::from_secs(5);

/// The restored messages, held while sessions' backlogs are left in storage.
/// Lock: a leaf (nothing is taken under it; any lock may be held).
#[derive(Default)]
pub(crate) struct HeldMessages {
    inner: Mutex<Held>,
}

/// The messages read back for backlogs released while running, by stored id, for as long as
/// a queue holds them: sessions whose clients come back together share one copy of each
/// (in memory, and stored again once rather than once per session), as the running broker
/// shared it before the release.
/// Lock: a leaf (nothing is taken under it; any lock may be held).
#[derive(Default)]
pub(crate) struct FetchedMessages {
    inner: Mutex<Fetched>,
}

#[derive(Default)]
struct Fetched {
    /// A message and its subscription identifiers, by stored id; dead entries are pruned when
    /// the map has doubled since the last prune.
    by_id: HashMap<u64, (Weak<Message>, Vec<u32>)>,
    prune_at: usize,
}

impl Fetched {
    fn live(&self, id: u64) -> Option<(Arc<Message>, Vec<u32>)> {
        let (msg, ids) = self.by_id.get(&id)?;
        Some((msg.upgrade()?, ids.clone()))
    }
}

impl FetchedMessages {
    /// Puts in `into` those of `ids` another read has in memory; returns the others.
    fn take_live(&self, ids: Vec<u64>, into: &mut Restored) -> Vec<u64> {
        let fetched = self.inner.lock();
        ids.into_iter()
            .filter(|id| match fetched.live(*id) {
                Some(m) => {
                    into.insert(*id, Ok(m));
                    false
                }
                None => true,
            })
            .collect()
    }

    /// Puts in `into` the messages just `read`, or the copy another read made meanwhile.
    fn share(&self, read: Restored, into: &mut Restored) {
        let mut fetched = self.inner.lock();
        for (id, m) in read {
            let m = m.map(|(msg, ids)| match fetched.live(id) {
                Some(shared) => shared,
                None => {
                    fetched
                        .by_id
                        .insert(id, (Arc::downgrade(&msg), ids.clone()));
                    (msg, ids)
                }
            });
            into.insert(id, m);
        }
        if fetched.by_id.len() > fetched.prune_at {
            fetched.by_id.retain(|_, (msg, _)| msg.strong_count() > 0);
            fetched.prune_at = (fetched.by_id.len() * 2).max(1024);
        }
    }
}

#[derive(Default)]
struct Held {
    /// Every restored message by stored id; `None` once no backlog is left.
    messages: Option<Arc<Restored>>,
    /// Sessions whose backlog is still in storage.
    pending: usize,
}

impl HeldMessages {
    /// Holds `messages` for `pending` backlogs left in storage (nothing when 0).
    pub(crate) fn hold(&self, messages: Restored, pending: usize) {
        if pending > 0 {
            *self.inner.lock() = Held {
                messages: Some(Arc::new(messages)),
                pending,
            };
        }
    }

    /// The restored messages, while a backlog is left.
    fn messages(&self) -> Option<Arc<Restored>> {
        self.inner.lock().messages.clone()
    }

    /// One restored backlog was read or dropped; after the last one, the messages no session
    /// holds are released (their `Arc`s dropped with the lock released).
    pub(crate) fn done(&self) {
        let released = {
            let mut held = self.inner.lock();
            held.pending = held.pending.saturating_sub(1);
            if held.pending == 0 {
                held.messages.take()
            } else {
                None
            }
        };
        drop(released);
    }
}

/// A backlog read from storage, checked: what goes to the queue and what is dropped.
struct Read {
    deliveries: Vec<Delivery>,
    /// Positions to dequeue from storage: unreadable or not authorized.
    dequeued: Vec<u64>,
    not_authorized: Vec<Arc<Message>>,
}

impl BrokerState {
    /// Reads the backlog of `session` from storage, if it has one, and puts it at the head
    /// of its queue. `Ok` once the session has no backlog: installed, by this call or
    /// another, or the session ended. A transient storage error is retried (logged) for up to
    /// [`RETRY_FOR`]; then, or at once when storage must stop (fenced, closed), the error,
    /// the backlog left in storage for a later attempt. A backlog storage cannot read
    /// ([`ErrorKind::Refused`](mercurio_storage::ErrorKind::Refused)) is given up: logged as
    /// an error, its rows left to be deleted with the session. Call it with no lock held.
    pub(crate) async fn load_backlog(&self, session: &Arc<Session>) -> Result<(), StorageError> {
        let mut wait = RETRY_FIRST;
        let give_up = Instant::now() + RETRY_FOR;
        loop {
            let Some(backlog) = session.state.lock().backlog() else {
                return Ok(());
            };
            let Some(p) = self.persist.get() else {
                return Ok(());
            };
            match self.read_backlog(p, session, backlog).await {
                Ok((records, loaded)) => {
                    let read = self.check_backlog(session, backlog, records, &loaded);
                    self.install_backlog(session, read);
                    return Ok(());
                }
                Err(e) if e.is_transient() && Instant::now() + wait < give_up => {
                    tracing::warn!(client_id = %session.client_id, "cannot read the stored queue, retrying in {wait:?}: {e}");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(RETRY_MAX);
                }
                Err(e) if e.is_transient() || e.must_stop() => return Err(e),
                Err(e) => {
                    tracing::error!(client_id = %session.client_id, queued = backlog.len, "stored queue cannot be read, its messages are not delivered: {e}");
                    self.install_backlog(
                        session,
                        Read {
                            deliveries: Vec::new(),
                            dequeued: Vec::new(),
                            not_authorized: Vec::new(),
                        },
                    );
                    return Ok(());
                }
            }
        }
    }

    /// The stored queue of `session`, and the messages of its deliveries up to the
    /// backlog's last position that the restored ones held in memory do not have (those of
    /// deliveries released while running, `max_queued_memory`), shared with other sessions'
    /// reads ([`FetchedMessages`]) or read from storage: without a stored identity, so that
    /// each is stored again, under a new id, if it is referred to again (a message this
    /// broker released may be deleted once nothing refers to it).
    async fn read_backlog(
        &self,
        p: &crate::persist::Persister,
        session: &Session,
        backlog: Backlog,
    ) -> Result<(Vec<QueuedRecord>, Restored), StorageError> {
        let records = p.storage().load_queue(&session.client_id).await?;
        let held = self.held.messages();
        let mut missing: Vec<u64> = records
            .iter()
            .filter(|q| q.seq <= backlog.last_seq)
            .map(|q| q.delivery.message_id)
            .filter(|id| !held.as_ref().is_some_and(|h| h.contains_key(id)))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let mut loaded = Restored::new();
        let missing = self.fetched.take_live(missing, &mut loaded);
        if missing.is_empty() {
            return Ok((records, loaded));
        }
        let stored = p.storage().load_messages(&missing).await?;
        let now = Instant::now();
        let now_ms = crate::persist::records::unix_ms();
        let read = stored
            .into_iter()
            .map(|m| {
                let msg =
                    message_from(&m.message, now, now_ms).map(|(msg, ids)| (Arc::new(msg), ids));
                (m.id, msg)
            })
            .collect();
        self.fetched.share(read, &mut loaded);
        Ok((records, loaded))
    }

    /// The deliveries of `records` that belong to `backlog` (storage may hold deliveries
    /// queued since, above its last position: those are in memory), as restored: their
    /// messages from those held since the restore, else from `loaded`.
    fn check_backlog(
        &self,
        session: &Session,
        backlog: Backlog,
        records: Vec<QueuedRecord>,
        loaded: &Restored,
    ) -> Read {
        let mut read = Read {
            deliveries: Vec::with_capacity(records.len()),
            dequeued: Vec::new(),
            not_authorized: Vec::new(),
        };
        // Held from the restore for as long as a restored backlog is pending.
        let held = self.held.messages();
        if backlog.restored && held.is_none() {
            tracing::error!(client_id = %session.client_id, "stored queue read after its messages were released: not delivered");
            return read;
        }
        for q in records.iter().filter(|q| q.seq <= backlog.last_seq) {
            let messages = match &held {
                Some(h) if h.contains_key(&q.delivery.message_id) => h,
                _ => loaded,
            };
            match delivery_from(messages, &q.delivery, q.seq) {
                Ok(d)
                    if self.checks_access
                        && !session.is_internal()
                        && !self.check_now(session, &d.msg.topic, Action::Read) =>
                {
                    read.dequeued.push(q.seq);
                    read.not_authorized.push(d.msg);
                }
                Ok(d) => read.deliveries.push(d),
                Err(cause) => {
                    tracing::error!(client_id = %session.client_id, seq = q.seq, "stored queued message cannot be restored, dropped: {cause}");
                    read.dequeued.push(q.seq);
                }
            }
        }
        read
    }

    /// Puts `read` at the head of the queue of `session` and dequeues from storage what it
    /// drops, under the session's lock (in order with its other changes); nothing when the
    /// session has no backlog any more.
    fn install_backlog(&self, session: &Session, read: Read) {
        let installed = {
            let mut st = session.state.lock();
            let installed = st.install_backlog(read.deliveries);
            if installed.is_some() {
                if let Some(p) = self.persist.get() {
                    for seq in &read.dequeued {
                        p.emit(Change::MessageDequeued {
                            client_id: session.client_id.to_string(),
                            seq: *seq,
                        });
                    }
                }
            }
            installed
        };
        let Some(installed) = installed else {
            return;
        };
        if installed.restored {
            self.held.done();
        }
        for msg in &read.not_authorized {
            self.dropped(
                Some(&session.client_id),
                &msg.topic,
                DropCause::NotAuthorized,
            );
        }
        tracing::debug!(client_id = %session.client_id, dropped = read.dequeued.len(), "stored queue read");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::QoS;

    fn message(topic: &str) -> Arc<Message> {
        Arc::new(Message::for_test(
            topic,
            bytes::Bytes::from_static(b"x"),
            QoS::AtLeastOnce,
        ))
    }

    fn read(id: u64, topic: &str) -> Restored {
        Restored::from([(id, Ok((message(topic), vec![7])))])
    }

    fn shared(loaded: &Restored, id: u64) -> Arc<Message> {
        match loaded.get(&id) {
            Some(Ok((msg, ids))) => {
                assert_eq!(ids, &vec![7]);
                Arc::clone(msg)
            }
            other => panic!("message {id}: {other:?}"),
        }
    }

    /// Two sessions reading back the same released message get one copy, whether the second
    /// finds it before reading (take_live) or read it too, concurrently (share); once no
    /// queue holds it, it is read again.
    #[test]
    fn sessions_reading_back_one_message_share_it() {
        let fetched = FetchedMessages::default();
        let mut first = Restored::new();
        assert_eq!(fetched.take_live(vec![1], &mut first), vec![1]);
        fetched.share(read(1, "a"), &mut first);
        let a = shared(&first, 1);

        let mut second = Restored::new();
        assert!(fetched.take_live(vec![1], &mut second).is_empty());
        assert!(Arc::ptr_eq(&a, &shared(&second, 1)));

        let mut racing = Restored::new();
        fetched.share(read(1, "a"), &mut racing);
        assert!(
            Arc::ptr_eq(&a, &shared(&racing, 1)),
            "the copy read first is kept"
        );

        drop((first, second, racing, a));
        let mut later = Restored::new();
        assert_eq!(fetched.take_live(vec![1], &mut later), vec![1]);
    }
}
