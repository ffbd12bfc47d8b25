//! Taking a session at CONNECT: a new connection for a client identifier takes its session
//! over from the connection serving it (which is closed first), resumes the session its client
//! left, or starts a new one (MQTT 5.0 sections 3.1.2.4 and 3.1.4).

use std::sync::Arc;

use super::BrokerState;
use crate::codec::{ProtocolVersion, ReasonCode};
use crate::link::{DisconnectReason, Link};
use crate::session::{Session, Will};

use super::handover::Claim;

/// Why a CONNECT cannot have its session ([`BrokerState::take_session`]).
#[derive(Debug)]
pub(crate) enum TakeError {
    /// Its queue left in storage cannot be read, or another node has it and cannot hand it
    /// over now (refused with Server unavailable).
    Storage(mercurio_storage::StorageError),
    /// Another node claimed the session in the registry at the same time, and won
    /// (refused with Server busy: the client connects again and takes it from that node).
    Claimed(String),
}

/// The CONNECTs of one client identifier claiming its session in the registry, one at a
/// time on this node. A second CONNECT made while the first still waits (for the nodes'
/// answers, for a stalled owner's database) would otherwise read the first one's claim as
/// this node's ownership and start a new session, with the old one still elsewhere; it now
/// waits for the first to be answered, then claims afresh: it takes over the first
/// connection, or is refused as the first was.
#[derive(Default)]
pub(crate) struct Claiming {
    /// Per client identifier being claimed, its turn (held by the CONNECT whose turn it is).
    turns: parking_lot::Mutex<std::collections::HashMap<Arc<str>, Arc<tokio::sync::Mutex<()>>>>,
}

/// One CONNECT's turn to claim its client identifier's session ([`Claiming::turn`]).
pub(crate) struct Turn<'a> {
    claiming: &'a Claiming,
    client_id: Arc<str>,
    turn: Arc<tokio::sync::Mutex<()>>,
    _held: tokio::sync::OwnedMutexGuard<()>,
}

impl Claiming {
    /// Waits for the CONNECTs of `client_id` before this one to be answered.
    pub(crate) async fn turn(&self, client_id: &Arc<str>) -> Turn<'_> {
        let turn = Arc::clone(self.turns.lock().entry(Arc::clone(client_id)).or_default());
        let held = Arc::clone(&turn).lock_owned().await;
        Turn {
            claiming: self,
            client_id: Arc::clone(client_id),
            turn,
            _held: held,
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut turns = self.claiming.turns.lock();
        // Nobody else waits (the references are the map's, this turn's and its guard's):
        // the entry goes. A waiter holds two more, and takes its first under this lock.
        if Arc::strong_count(&self.turn) == 3 {
            turns.remove(&self.client_id);
        }
    }
}

impl From<mercurio_storage::StorageError> for TakeError {
    fn from(e: mercurio_storage::StorageError) -> TakeError {
        TakeError::Storage(e)
    }
}

impl std::fmt::Display for TakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TakeError::Storage(e) => write!(f, "{e}"),
            TakeError::Claimed(node) => write!(
                f,
                "its session was claimed at the same time by {node} (the session registry)"
            ),
        }
    }
}

/// Who a connection's client is, as far as its session is concerned (see
/// [`BrokerState::take_session`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owner<'a> {
    /// The authenticated user name (the certificate's name with `use_identity_as_username`),
    /// `None` for anonymous.
    pub username: Option<&'a str>,
    /// The name of the verified client certificate, `None` without one.
    pub certificate: Option<&'a str>,
}

impl BrokerState {
    /// The broker's own session `id` (a bridge's `$internal/bridge/<name>`, an in-process
    /// subscription's `$internal/N`, which clients cannot take): the one the session table
    /// holds (restored from storage, say), or a new one (MQTT 5, never expiring) put there
    /// under the same hold of the table's lock, as [`BrokerState::take_session`] re-checks
    /// under it, so that two callers never make two sessions for one identifier. Either way
    /// it is trusted (the broker's own: no access check applies). Returns it and whether it
    /// was there already.
    pub(crate) fn internal_session(&self, id: &Arc<str>) -> (Arc<Session>, bool) {
        let mut sessions = self.sessions.lock();
        let (session, existed) = match sessions.get(id) {
            Some(s) => (Arc::clone(s), true),
            None => {
                let s = Arc::new(Session::new(
                    Arc::clone(id),
                    ProtocolVersion::V5,
                    u32::MAX,
                    &self.queued_memory,
                ));
                sessions.insert(Arc::clone(id), Arc::clone(&s));
                (s, false)
            }
        };
        // A leaf lock, taken under the table's (lock order, ARCHITECTURE.md).
        *session.identity.write() = crate::auth::Identity::Trusted;
        (session, existed)
    }

    /// Gives the connection of `client_id` its session: with `clean_start`, or when none is
    /// kept, a new one; otherwise the one kept, taken over from a connection still serving
    /// it [MQTT-3.1.4-3]. Returns the session, the link of the new connection, and whether
    /// the session was present (resumed).
    ///
    /// A session belongs to the identity that created it (`owner`: the authenticated user
    /// name, and the client certificate's name whether or not it is used as the user name):
    /// another identity connecting with its client identifier (another user name, another
    /// certificate, or none where there was one) gets a new session, as with Clean Start, so
    /// it never sees the owner's subscriptions, queued or in-flight messages.
    ///
    /// In cluster mode the session is first taken from the node that has it, if another one
    /// does (`handover.rs`).
    ///
    /// In cluster mode with JetStream, a persistent session (`expiry_interval` above 0) is
    /// claimed in the session registry first, and the claim confirmed once the session is
    /// attached (`cluster/registry.rs`): of two CONNECTs at once on two nodes, one gets the
    /// session, the other [`TakeError::Claimed`].
    ///
    /// Errors: the session's queue left in storage at the restart cannot be read now
    /// (`BrokerState::load_backlog`), or another node has the session and cannot hand it
    /// over now ([`TakeError::Storage`]; the connection is refused, the session kept), or
    /// another node claimed it at the same time ([`TakeError::Claimed`]).
    pub(crate) async fn take_session(
        &self,
        client_id: &Arc<str>,
        owner: Owner<'_>,
        clean_start: bool,
        version: ProtocolVersion,
        expiry_interval: u32,
        will: Option<Will>,
    ) -> Result<(Arc<Session>, Arc<Link>, bool), TakeError> {
        let registry = self
            .registry
            .get()
            .filter(|_| expiry_interval > 0 && !client_id.starts_with(super::INTERNAL_PREFIX));
        let mut revision = None;
        let mut previous_owner = None;
        let _turn = match registry {
            Some(_) => Some(self.claiming.turn(client_id).await),
            None => None,
        };
        if let Some(r) = registry {
            let (claim, before) = r.claim(client_id).await;
            match claim {
                Claim::Ours(rev) => {
                    revision = Some(rev);
                    previous_owner = before;
                }
                Claim::Lost(node) => return Err(TakeError::Claimed(node)),
                Claim::Unknown(why) => {
                    tracing::warn!(%client_id, "cluster: session not claimed in the registry, served by this node alone: {why}");
                }
            }
        }
        let attached = match self
            .take_from_other_nodes(
                client_id,
                clean_start,
                revision.is_some(),
                previous_owner.as_deref(),
            )
            .await
        {
            Ok(owed) => self
                .attach_session(
                    client_id,
                    owner,
                    clean_start,
                    version,
                    expiry_interval,
                    will,
                )
                .await
                .map(|attached| (attached, owed)),
            Err(e) => Err(e),
        };
        let ((session, link, present), owed) = match attached {
            Ok(attached) => attached,
            Err(e) => {
                // Refused, the session left where it was (a node stalled, say): the claim
                // would hide its owner from the client's next CONNECT.
                if let (Some(r), Some(rev), Some(before)) =
                    (registry, revision, previous_owner.as_deref())
                {
                    r.give_back(client_id, rev, before).await;
                }
                return Err(e.into());
            }
        };
        if let (Some(r), Some(rev)) = (registry, revision) {
            // A node that claimed it after this one asked the others (and so found nothing
            // here yet) wins: this copy ends, its client refused, and the nodes that handed it
            // over keep theirs (not confirmed), for the winner to take.
            match r.confirm(client_id, rev, &session).await {
                Claim::Ours(_) => {}
                Claim::Lost(node) => {
                    let _ = session.detach(&link, false);
                    // A hand-over waiting for this connection to close goes on.
                    link.mark_closed();
                    self.end_session(&session);
                    return Err(TakeError::Claimed(node));
                }
                Claim::Unknown(why) => {
                    tracing::warn!(%client_id, "cluster: session claim not confirmed in the registry, served by this node alone: {why}");
                }
            }
            if let Some(owed) = owed {
                owed.done();
            }
        }
        Ok((session, link, present))
    }

    /// [`BrokerState::take_session`] on this node, once the other nodes were asked.
    async fn attach_session(
        &self,
        client_id: &Arc<str>,
        owner: Owner<'_>,
        clean_start: bool,
        version: ProtocolVersion,
        expiry_interval: u32,
        mut will: Option<Will>,
    ) -> Result<(Arc<Session>, Arc<Link>, bool), mercurio_storage::StorageError> {
        let link = Arc::new(Link::new());
        // Whether this connection took over a connected client (rather than a session whose
        // client was away): it decides the fate of a will waiting for its delay below.
        let mut took_over = false;
        loop {
            let existing = self.sessions.lock().get(client_id).cloned();
            if let Some(old) = existing {
                let foreign = {
                    let st = old.state.lock();
                    st.username().map(|u| &**u) != owner.username
                        || st.certificate().map(|c| &**c) != owner.certificate
                };
                if foreign {
                    tracing::info!(%client_id, "session of another user or certificate: a new session replaces it");
                }
                let clean_start = clean_start || foreign;
                let old_link = old.link();
                if let Some(old_link) = old_link {
                    // The old network connection closes without DISCONNECT, so its will is
                    // published as for any such close (MQTT 5.0 section 3.1.4: "as specified
                    // in section 3.1.2.5"): 3.x wills and 5.0 ones with a Will Delay Interval
                    // of 0 at once, by the detach that closing the old connection runs
                    // [MQTT-3.1.2-8]. With a delay above 0 and the session going on under the
                    // new connection (clean start 0, a session that outlives its connection),
                    // a new connection for the client identifier opened before the delay
                    // elapsed: the will is not sent [MQTT-3.1.3-9]. (mosquitto 2 drops the
                    // will in both cases when the session goes on.) A session that ends here
                    // publishes it (detach, then end_session).
                    if !clean_start {
                        let mut st = old.state.lock();
                        if st.expiry_interval() > 0
                            && st.will().is_some_and(|w| w.delay > 0)
                            && st.take_will().is_some()
                        {
                            st.persist_will_cleared(&old.client_id);
                        }
                    }
                    old_link.kill(DisconnectReason::TakenOver, ReasonCode::SESSION_TAKEN_OVER);
                    old_link.wait_closed().await;
                    took_over = true;
                    continue;
                }
                if clean_start || old.state.lock().ended() {
                    // Clean Start ends the old session. Its will, if still waiting for its Will
                    // Delay Interval: published now when this connection took over a connected
                    // client (the non-normative comment of section 3.1.4: "it will be sent
                    // because the original Session is ended on the takeover"); dropped when the
                    // client was away, since a new connection for its client identifier opened
                    // before the delay elapsed [MQTT-3.1.2-8] (mosquitto 07-will-delay-recover).
                    if !took_over {
                        old.state.lock().discard_will();
                    }
                    self.end_session(&old);
                    continue;
                }
                // A restored session's queue left in storage comes back before the session
                // is attached, and so before anything is drained (`backlog.rs`).
                if old.state.lock().backlog().is_some() {
                    self.load_backlog(&old).await?;
                    continue;
                }
                if !old.attach(&link, version, expiry_interval, &mut will) {
                    continue;
                }
                return Ok((old, link, true));
            }
            let fresh = Arc::new(Session::new(
                Arc::clone(client_id),
                version,
                expiry_interval,
                &self.queued_memory,
            ));
            let mut sessions = self.sessions.lock();
            if sessions.contains_key(client_id) {
                continue;
            }
            fresh.attach(&link, version, expiry_interval, &mut will);
            sessions.insert(Arc::clone(client_id), Arc::clone(&fresh));
            return Ok((fresh, link, false));
        }
    }
}
