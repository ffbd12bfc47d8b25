//! Sessions handed from node to node in cluster mode (docs/cluster.md, "Sessions across
//! nodes"): a client identifier's session lives on one node at a time, and a CONNECT on
//! another node takes it from there.
//!
//! - The taking node asks the others ([`OtherNodes`], which the cluster link implements over
//!   NATS) before it looks at its own sessions ([`BrokerState::take_session`]).
//! - The owner closes the connection serving the session (DISCONNECT 0x8E Session taken
//!   over [MQTT-3.1.4-3]), with its will dropped when the session goes on, and answers with
//!   the session as storage records ([`BrokerState::hand_over`]). It keeps the session until
//!   the taker confirms, then ends it without its will and without passing its shared
//!   subscriptions' deliveries on: they went with it ([`BrokerState::handed_over`]).
//! - The taker makes the records a session of its own, written whole to its storage, and
//!   resumes it as a session present ([`BrokerState::adopt`]).
// Without the feature `cluster` no `OtherNodes` exists: only the check that none is set is
// used.
#![cfg_attr(not(feature = "cluster"), allow(dead_code))]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use mercurio_storage::{SessionRecord, StoredMessage};

use super::restore::restore_session;
use super::BrokerState;
use crate::codec::ReasonCode;
use crate::link::DisconnectReason;
use crate::message::Message;
use crate::persist::records::{instant_to_unix, message_from, session_record, unix_ms, Restored};
use crate::session::{Ended, Session, Will};

/// What the other nodes answered for a client identifier ([`OtherNodes::take`]).
pub(crate) enum Taken {
    /// No other node has the session (or none could be asked: see `OtherNodes::take`).
    None,
    /// A node handed it over (boxed: the records are large next to the other variants).
    Session(Box<HandedOver>),
    /// A node has it but cannot hand it over now (its queue left in storage cannot be read,
    /// or it is larger than a hand-over carries): the CONNECT is refused with Server
    /// unavailable, the session kept where it is.
    Unavailable(String),
}

/// A session handed over by another node.
pub(crate) struct HandedOver {
    /// The session, as its owner's storage would hold it.
    pub record: SessionRecord,
    /// The messages its queue and in-flight list refer to, by the ids of `record`.
    pub messages: Vec<StoredMessage>,
    /// Its node restored it from storage at its start and no client took it up since: a
    /// copy left by a crash, older than any copy a client used since.
    pub stale: bool,
    /// Tells the nodes that answered with a copy that this node has the session now: they
    /// end theirs. Called once the session is this node's (after its storage committed it).
    pub confirm: Box<dyn FnOnce() + Send>,
}

/// The other nodes of the cluster, as a CONNECT asks them for its session.
#[async_trait::async_trait]
pub(crate) trait OtherNodes: Send + Sync {
    /// Asks every other node for the session of `client_id`: the node that has it closes
    /// the client's connection there and hands the session over, or, with `clean_start`,
    /// ends it (then [`Taken::None`]). Waits for the nodes it knows to answer, within the
    /// cluster's `takeover_timeout`. `owner`: the other node the registry named the owner
    /// before this node's claim; when it is gone, its session may be taken from its storage.
    async fn take(&self, client_id: &str, clean_start: bool, owner: Option<&str>) -> Taken;
}

/// What the session ownership registry says of a client identifier's session (cluster mode
/// with JetStream: `cluster/registry.rs`).
pub(crate) enum Claim {
    /// This node owns it, at this revision (its ownership epoch; 0: nobody owns it).
    Ours(u64),
    /// Another node owns it, named (a newer revision than this node's).
    Lost(String),
    /// The registry could not be asked within `takeover_timeout`, and why: the node goes on
    /// alone, as without the registry.
    Unknown(String),
}

/// The registry of which node owns each persistent session, as the broker asks it.
#[async_trait::async_trait]
pub(crate) trait SessionRegistry: Send + Sync {
    /// At the CONNECT of a persistent session: this node claims it over the revision it
    /// reads (compare-and-set). [`Claim::Lost`] when another node claimed it in between.
    /// With the claim, the other node the registry named the owner before it, if any.
    async fn claim(&self, client_id: &str) -> (Claim, Option<String>);
    /// Once `session` is attached: claims it again over `revision` (the claim's, 0 for
    /// none), so that a node that claimed it meanwhile wins over this one, and records the
    /// new revision as `session`'s.
    async fn confirm(&self, client_id: &Arc<str>, revision: u64, session: &Arc<Session>) -> Claim;
    /// A CONNECT refused after its claim at `revision` (the session could not be taken from
    /// `owner`, the other node the registry named the owner before it): `owner` is written
    /// back over `revision` (compare-and-set: a newer claim stays), so that the client's next
    /// CONNECT asks that node, or its storage, again rather than finding this node the owner
    /// of a session it does not have.
    async fn give_back(&self, client_id: &str, revision: u64, owner: &str);
    /// Before a timer of a session acts (its delayed will, its expiry): which node owns it.
    async fn check(&self, client_id: &str) -> Claim;
    /// `session` ended here: its key is deleted (compare-and-delete on its revision), but
    /// when it was `handed_over` (the taker owns the key now).
    fn ended(&self, session: &Arc<Session>, handed_over: bool);
    /// The sessions this node holds a confirmed claim on.
    fn owned(&self) -> usize;
}

/// The wills the restore found due, held in cluster mode until the registry has said which
/// sessions another node owns now (`cluster/registry.rs`, `fence`).
#[derive(Default)]
pub(crate) struct HeldWills {
    held: parking_lot::Mutex<Option<Vec<(String, Will)>>>,
}

impl HeldWills {
    /// Holds the wills given from now on ([`HeldWills::hold`]).
    pub(crate) fn holding() -> HeldWills {
        HeldWills {
            held: parking_lot::Mutex::new(Some(Vec::new())),
        }
    }

    /// Keeps `will` for later, or gives it back when nothing is held (any more).
    pub(crate) fn hold(&self, client_id: String, will: Will) -> Option<(String, Will)> {
        match &mut *self.held.lock() {
            Some(held) => {
                held.push((client_id, will));
                None
            }
            None => Some((client_id, will)),
        }
    }

    /// The wills held, and nothing held from now on.
    pub(crate) fn release(&self) -> Vec<(String, Will)> {
        self.held.lock().take().unwrap_or_default()
    }
}

/// The confirmation owed to the nodes that handed a session over, sent once every part of
/// the taking is done ([`Confirmation::done`]): the session committed to this node's storage
/// and, with the registry, this node's claim confirmed. Dropped before that, nothing is sent:
/// the nodes keep their copies (`kept_after_all`), and a node that claimed the session after
/// this one takes it from them.
pub(crate) struct Confirmation {
    left: std::sync::atomic::AtomicUsize,
    confirm: parking_lot::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Confirmation {
    fn new(parts: usize, confirm: Box<dyn FnOnce() + Send>) -> Arc<Confirmation> {
        Arc::new(Confirmation {
            left: std::sync::atomic::AtomicUsize::new(parts),
            confirm: parking_lot::Mutex::new(Some(confirm)),
        })
    }

    /// One part done; the last sends the confirmation.
    pub(crate) fn done(&self) {
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            if let Some(confirm) = self.confirm.lock().take() {
                confirm();
            }
        }
    }
}

/// What this node did when asked for a session ([`BrokerState::hand_over`]).
pub(crate) enum HandOver {
    /// It has no session of the client identifier (or has just ended it for a clean start).
    NotHere,
    /// Its session, to send; kept here until the taker confirms ([`BrokerState::handed_over`]),
    /// its subscriptions out of the index meanwhile ([`BrokerState::kept_after_all`] puts them
    /// back).
    Session {
        record: Box<SessionRecord>,
        messages: Vec<StoredMessage>,
        /// See [`HandedOver::stale`].
        stale: bool,
        session: Arc<Session>,
    },
    /// It has one it cannot hand over now.
    Unavailable(String),
}

impl BrokerState {
    /// In cluster mode, before a CONNECT looks at this node's sessions: takes the session of
    /// `client_id` from the node that has it, if any, and makes it this node's (a copy kept
    /// here gives way: its connection, if any, is taken over, and it ends without its will).
    /// Nothing to do outside cluster mode and for the broker's own sessions.
    ///
    /// With `claimed` (the session claimed in the registry), the confirmation to the nodes
    /// that handed it over also waits for the claim's own confirmation: it is returned, for
    /// the caller's [`Confirmation::done`] once the claim is confirmed, or to drop. `owner`:
    /// the other node the registry named the owner before the claim ([`OtherNodes::take`]).
    ///
    /// Errors: a node has the session and cannot hand it over now ([`Taken::Unavailable`]).
    pub(crate) async fn take_from_other_nodes(
        &self,
        client_id: &Arc<str>,
        clean_start: bool,
        claimed: bool,
        owner: Option<&str>,
    ) -> Result<Option<Arc<Confirmation>>, mercurio_storage::StorageError> {
        let Some(others) = self.other_nodes.get() else {
            return Ok(None);
        };
        if client_id.starts_with(super::INTERNAL_PREFIX) {
            return Ok(None);
        }
        let handed = match others.take(client_id, clean_start, owner).await {
            Taken::None => return Ok(None),
            Taken::Unavailable(why) => {
                return Err(mercurio_storage::StorageError::transient(format!(
                    "its session is on another node and cannot be taken now: {why}"
                )))
            }
            Taken::Session(handed) => *handed,
        };
        let confirmation = Confirmation::new(1 + usize::from(claimed), handed.confirm);
        let owed = claimed.then(|| Arc::clone(&confirmation));
        // A copy kept here (after a crash or a NATS outage) that is more recent than the one
        // handed over stays, and the other copy ends: a copy a client took up since its node
        // started is more recent than a stale one, then the later disconnection (by the
        // nodes' clocks) wins, this node's on a tie.
        let handed_rank = (
            !handed.stale,
            handed.record.disconnected_at.unwrap_or(u64::MAX),
        );
        let local = self.sessions.lock().get(client_id).cloned();
        let local_newer = local.is_some_and(|local| {
            let stale = local.idle_since(0);
            let connected = local.is_connected();
            let st = local.state.lock();
            let at = match st.disconnected_at() {
                Some(at) if !connected => instant_to_unix(at, Instant::now(), unix_ms()),
                _ => u64::MAX,
            };
            !st.ended() && (!stale, at) >= handed_rank
        });
        if local_newer {
            tracing::info!(%client_id, "session kept here: more recent than another node's copy, which ends");
            confirmation.done();
            return Ok(owed);
        }
        loop {
            let Some(local) = self.sessions.lock().get(client_id).cloned() else {
                break;
            };
            if let Some(link) = local.link() {
                local.state.lock().discard_will();
                link.kill(DisconnectReason::TakenOver, ReasonCode::SESSION_TAKEN_OVER);
                link.wait_closed().await;
                continue;
            }
            local.state.lock().discard_will();
            self.end_session(&local);
        }
        let Some(this) = self.this.upgrade() else {
            return Ok(None);
        };
        let committed = Box::new(move || confirmation.done());
        if let Err(e) = this.adopt(handed.record, &handed.messages, committed) {
            tracing::warn!(%client_id, "session handed over by another node cannot be read, a new one is started: {e}");
        }
        Ok(owed)
    }

    /// Another node asks for the session of `client_id` (see the module's comment). With
    /// `clean_start` the session ends here as a local Clean Start would end it (its will
    /// published when its connection was taken over [MQTT-3.1.2-8]).
    pub(crate) async fn hand_over(&self, client_id: &str, clean_start: bool) -> HandOver {
        let mut took_over = false;
        loop {
            let Some(old) = self.sessions.lock().get(client_id).cloned() else {
                return HandOver::NotHere;
            };
            if old.is_internal() {
                return HandOver::NotHere;
            }
            if let Some(link) = old.link() {
                if !clean_start {
                    // The session goes on on the other node: the connection closed here does
                    // not publish its will (MQTT 5.0 section 3.1.4; mosquitto drops it too),
                    // and the new connection's CONNECT brings its own.
                    let mut st = old.state.lock();
                    if st.take_will().is_some() {
                        st.persist_will_cleared(&old.client_id);
                    }
                }
                link.kill(DisconnectReason::TakenOver, ReasonCode::SESSION_TAKEN_OVER);
                link.wait_closed().await;
                took_over = true;
                continue;
            }
            if clean_start || old.state.lock().ended() {
                if !took_over {
                    old.state.lock().discard_will();
                }
                self.end_session(&old);
                return HandOver::NotHere;
            }
            if old.state.lock().backlog().is_some() {
                if let Err(e) = self.load_backlog(&old).await {
                    return HandOver::Unavailable(format!("its queue cannot be read: {e}"));
                }
                continue;
            }
            // Until the taker confirms, what is routed here no longer reaches the session:
            // it would be left behind, dropped with it. The taker's subscriptions take over
            // once the nodes hear of them, as for any new subscription (in cluster mode,
            // QoS 1 and 2 messages still reaching this node meanwhile are forwarded to the
            // taker). Withdrawn before the record is made: a message routed here in between
            // is in the record.
            self.withdraw_subscriptions(&old);
            // Each message once, numbered for the record (the ids of this node's storage
            // mean nothing on the other node's).
            let mut ids: HashMap<*const Message, u64> = HashMap::new();
            let (record, messages) = {
                let st = old.state.lock();
                session_record(&old.client_id, &st, Vec::new(), |m| {
                    let next = ids.len() as u64 + 1;
                    *ids.entry(m as *const Message).or_insert(next)
                })
            };
            return HandOver::Session {
                record: Box::new(record),
                messages,
                stale: old.idle_since(0),
                session: old,
            };
        }
    }

    /// Takes the subscriptions of `session` out of the index (not out of the session). They
    /// stay in `interest` until the hand-over ends ([`BrokerState::handed_over`]): the other
    /// nodes go on sending their messages here, forwarded to the taker, rather than to no
    /// node until they hear of the taker's subscriptions.
    fn withdraw_subscriptions(&self, session: &Arc<Session>) {
        let filters: Vec<String> = session
            .state
            .lock()
            .subscriptions()
            .iter()
            .map(|(f, _)| f.clone())
            .collect();
        let mut index = self.index.write();
        for f in &filters {
            index.remove(f, &session.client_id);
        }
    }

    /// A session handed over without the taker's confirmation stays here: its
    /// subscriptions go back into the index (unless it ended meanwhile), still in `interest`.
    pub(crate) fn kept_after_all(&self, session: &Arc<Session>) {
        let subscriptions: Vec<(String, crate::session::Granted)> = {
            let st = session.state.lock();
            if st.ended() {
                return;
            }
            st.subscriptions()
                .iter()
                .map(|(f, g)| (f.clone(), *g))
                .collect()
        };
        let mut index = self.index.write();
        for (f, granted) in subscriptions {
            let entry = super::SubEntry {
                session: Arc::clone(session),
                granted,
            };
            index.insert(&f, Arc::clone(&session.client_id), entry);
        }
    }

    /// The node that asked has `session` now: it ends here, deleted from storage, without
    /// its will (dropped when its connection was taken over) and without passing its shared
    /// subscriptions' deliveries on (they went with it). Left alone if a client took it up
    /// here again meanwhile.
    pub(crate) fn handed_over(&self, session: &Arc<Session>) {
        if session.is_connected() {
            tracing::warn!(client_id = %session.client_id, "session handed to another node was taken up here again meanwhile: kept here too");
            self.kept_after_all(session);
            return;
        }
        let Some(Ended {
            filters, backlog, ..
        }) = session.end()
        else {
            return;
        };
        if let Some(r) = self.registry.get() {
            r.ended(session, true);
        }
        // Out of the index since the hand-over, still in `interest` until now.
        for f in &filters {
            self.interest.remove(f, &session.client_id);
        }
        self.forget_session(session, &filters, backlog);
        tracing::debug!(client_id = %session.client_id, "session handed over to another node");
    }

    /// Makes the session another node handed over this node's own: restored from its
    /// records as at a start (subscriptions, queue, in-flight messages, inbound QoS 2
    /// identifiers, expiry timer), then written whole to storage. A session of the same
    /// client identifier kept here (after a crash or a NATS outage) must have been ended
    /// first. `confirmed` runs once storage committed it (at once without storage).
    ///
    /// Errors: a record that cannot be read (unknown QoS, a message it refers to missing,
    /// properties that do not decode); nothing is made then.
    pub(crate) fn adopt(
        self: &Arc<Self>,
        record: SessionRecord,
        messages: &[StoredMessage],
        confirmed: Box<dyn FnOnce() + Send>,
    ) -> Result<(), String> {
        let (now, now_ms) = (Instant::now(), unix_ms());
        let restored: Restored = messages
            .iter()
            .map(|m| {
                let msg =
                    message_from(&m.message, now, now_ms).map(|(msg, ids)| (Arc::new(msg), ids));
                (m.id, msg)
            })
            .collect();
        let client_id: Arc<str> = Arc::from(record.client_id.as_str());
        restore_session(self, None, &restored, record, None, now, now_ms)?;
        let Some(p) = self.persist.get() else {
            confirmed();
            return Ok(());
        };
        let Some(session) = self.sessions.lock().get(&client_id).cloned() else {
            // Expired at once: made from an old copy.
            return Err("ended as soon as it was made".into());
        };
        {
            let mut st = session.state.lock();
            st.report_changes_to(Arc::clone(p) as Arc<dyn crate::session::SessionChanges>);
            p.emit(p.session_written(&client_id, &st, Vec::new()));
        }
        p.after_commit(Box::new(move |committed| {
            if committed {
                confirmed();
            }
        }));
        Ok(())
    }
}

impl BrokerState {
    /// A session another node owns now ends here (fencing, `cluster/registry.rs`): its
    /// connection, if any, closed with Session taken over [MQTT-3.1.4-3], without its will
    /// (the session goes on on the other node).
    pub(crate) async fn fenced(&self, session: &Arc<Session>) {
        self.fence_out(session).await;
        self.end_session(session);
    }

    /// The part of [`BrokerState::fenced`] that stops `session` acting here, its state
    /// kept (for a hand-over to the node that owns it now): its will discarded, its
    /// connection closed with 0x8E Session taken over.
    pub(crate) async fn fence_out(&self, session: &Arc<Session>) {
        loop {
            session.state.lock().discard_will();
            let Some(link) = session.link() else {
                break;
            };
            link.kill(DisconnectReason::TakenOver, ReasonCode::SESSION_TAKEN_OVER);
            link.wait_closed().await;
        }
        session.state.lock().discard_will();
    }

    /// In cluster mode, before a timer of `session` acts: false when another node owns the
    /// session now, which then ends here without its will.
    pub(crate) async fn still_owned(&self, session: &Arc<Session>) -> bool {
        let Some(r) = self.registry.get() else {
            return true;
        };
        match r.check(&session.client_id).await {
            Claim::Lost(node) => {
                let queued = session.state.lock().queued_len();
                tracing::info!(client_id = %session.client_id, owner = %node, queued, "cluster: session owned by another node now: this node's copy ends, without its will (its queued messages with it)");
                self.fenced(session).await;
                false
            }
            Claim::Ours(_) => true,
            Claim::Unknown(why) => {
                tracing::warn!(client_id = %session.client_id, "cluster: the session's timer acts without knowing which node owns it: {why}");
                true
            }
        }
    }
}
