//! The session ownership registry (docs/cluster.md, "Sessions across nodes", "One owner per
//! session"): which node owns each persistent session, in a JetStream key-value bucket
//! `{prefix with '.' as '_'}_sessions` that every node shares.
//!
//! - Key: the client identifier, escaped reversibly into the characters a key may hold
//!   ([`key_of`]). Value: JSON, the owning node's name and when it claimed the session
//!   ([`Owner`]). The key's revision is the session's ownership epoch: every claim is a
//!   compare-and-set on the revision the claiming node read, so of two nodes claiming at
//!   once exactly one succeeds.
//! - A node claims at the CONNECT of a persistent session, then, once the session is
//!   attached, confirms its claim with a second compare-and-set ([`SessionRegistry`]); the
//!   session's end deletes the key (compare-and-delete on its revision).
//! - Fencing ([`fence`]): at start, at each connection to NATS and once the registry answers
//!   again after failing, a node checks the sessions it holds; those another node owns now
//!   end here without their wills. The
//!   wills its restore found due wait for that check (`HeldWills`), as long as
//!   `takeover_timeout` at most.
//!
//! Every call waits `takeover_timeout` at most; a registry that cannot be reached then is
//! [`Claim::Unknown`]: the node goes on alone, as without the registry, and logs it.
//! Dependency: the `kv` feature of `async-nats` (the NATS project's own key-value API over
//! JetStream).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use futures_util::StreamExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::broker::handover::{Claim, SessionRegistry};
use crate::broker::BrokerState;
use crate::session::{Session, Will};

/// The longest key the registry takes: a client identifier whose escaped form is longer
/// (NATS refuses protocol lines over 4,096 bytes) is not registered ([`Claim::Unknown`]).
const MAX_KEY_LEN: usize = 2048;

/// Sessions checked at once by [`fence`].
const FENCE_CONCURRENCY: usize = 32;

/// The longest wait between two attempts to make or find the bucket.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// A registry entry's value.
#[derive(Debug, Serialize, Deserialize)]
struct Owner {
    /// The owning node's `node_name`.
    node: String,
    /// When it claimed the session, Unix milliseconds.
    at: u64,
}

/// The bucket's name for `prefix`.
pub(super) fn bucket_name(prefix: &str) -> String {
    format!("{}_sessions", prefix.replace('.', "_"))
}

/// A client identifier as a key: `A`-`Z`, `a`-`z`, `0`-`9`, `-` and `_` stand for
/// themselves, every other byte of its UTF-8 is `=` and two upper-case hexadecimal digits;
/// the empty identifier is `=` alone. Reversible ([`client_id_of`]), and only characters a
/// key may hold.
pub(super) fn key_of(client_id: &str) -> String {
    if client_id.is_empty() {
        return "=".into();
    }
    let mut key = String::with_capacity(client_id.len());
    for b in client_id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            key.push(b as char);
        } else {
            key.push_str(&format!("={b:02X}"));
        }
    }
    key
}

/// The client identifier of a key made by [`key_of`]; `None` for another key.
#[cfg(test)]
fn client_id_of(key: &str) -> Option<String> {
    if key == "=" {
        return Some(String::new());
    }
    let mut out = Vec::with_capacity(key.len());
    let mut bytes = key.bytes();
    while let Some(b) = bytes.next() {
        if b == b'=' {
            let hex = [bytes.next()?, bytes.next()?];
            let hex = std::str::from_utf8(&hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The registry as this node uses it: the bucket once reachable, and the claims this node
/// holds, by client identifier (the revision, and the session it stands for).
pub(super) struct Registry {
    /// For whether NATS is reachable now.
    broker: Weak<BrokerState>,
    node: String,
    timeout: Duration,
    store: Mutex<Option<kv::Store>>,
    owned: Mutex<HashMap<Arc<str>, Held>>,
    /// A call failed while NATS was reachable (JetStream without a leader: a partition, say).
    missed: std::sync::atomic::AtomicBool,
    /// Told when a call succeeds after such a failure: this node's sessions are checked
    /// again ([`fence`]), as at a connection to NATS.
    pub(super) recheck: tokio::sync::Notify,
}

/// A claim this node holds: the entry's revision, and the session it stands for.
type Held = (u64, Weak<Session>);

impl Registry {
    pub(super) fn new(broker: &Arc<BrokerState>) -> Registry {
        let cfg = &broker.config.cluster;
        Registry {
            broker: Arc::downgrade(broker),
            node: cfg.node_name.clone(),
            timeout: cfg.takeover(),
            store: Mutex::new(None),
            owned: Mutex::new(HashMap::new()),
            missed: std::sync::atomic::AtomicBool::new(false),
            recheck: tokio::sync::Notify::new(),
        }
    }

    fn store(&self) -> Result<kv::Store, String> {
        // Cut off from NATS: no wait for what cannot answer.
        if !self.broker.upgrade().is_some_and(|b| {
            b.cluster
                .connected
                .load(std::sync::atomic::Ordering::Relaxed)
        }) {
            return Err("NATS unreachable".into());
        }
        self.store
            .lock()
            .clone()
            .ok_or_else(|| "the session registry is not reachable yet".to_string())
    }

    fn value(&self) -> Bytes {
        let owner = Owner {
            node: self.node.clone(),
            at: unix_ms(),
        };
        serde_json::to_vec(&owner).map_or_else(|_| Bytes::new(), Bytes::from)
    }

    /// Runs `op` on the bucket within `takeover_timeout`.
    async fn within<T, F: std::future::Future<Output = Result<T, String>>>(
        &self,
        op: impl FnOnce(kv::Store) -> F,
    ) -> Result<T, String> {
        use std::sync::atomic::Ordering;
        let store = self.store()?;
        let result = match tokio::time::timeout(self.timeout, op(store)).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "the session registry did not answer within takeover_timeout ({} s)",
                self.timeout.as_secs()
            )),
        };
        if result.is_err() {
            self.missed.store(true, Ordering::Relaxed);
        } else if self.missed.swap(false, Ordering::Relaxed) {
            self.recheck.notify_one();
        }
        result
    }

    /// The owner of the session at `key` (`None` when no node owns it) and the key's last
    /// revision (a deletion's included; 0 for a key never written).
    async fn read(&self, key: &str) -> Result<(Option<String>, u64), String> {
        let key = key.to_string();
        self.within(|store| async move {
            match store.entry(key).await {
                Ok(Some(e)) if e.operation == kv::Operation::Put => {
                    let owner: Owner = serde_json::from_slice(&e.value)
                        .map_err(|e| format!("unreadable registry entry: {e}"))?;
                    Ok((Some(owner.node), e.revision))
                }
                // Deleted (the session ended): its marker's revision is written over.
                Ok(Some(e)) => Ok((None, e.revision)),
                Ok(None) => Ok((None, 0)),
                Err(e) => Err(format!("the session registry: {e}")),
            }
        })
        .await
    }

    /// Writes this node as the owner over `revision` (0: a key never written), the key's
    /// last revision as this node read it.
    async fn write(&self, key: &str, revision: u64) -> Result<Claim, String> {
        let (key, value) = (key.to_string(), self.value());
        let node = self.node.clone();
        self.within(|store| async move {
            // Revision 0: JetStream takes it only for a key never written.
            let written = store.update(&key, value, revision).await.map_err(|e| {
                (
                    e.kind() == kv::UpdateErrorKind::WrongLastRevision,
                    e.to_string(),
                )
            });
            match written {
                Ok(rev) => Ok(Claim::Ours(rev)),
                Err((true, _)) => {
                    // Claimed since it was read: by another node, which wins; or by another
                    // connection on this node, which the session table puts in order.
                    match store.entry(key).await {
                        Ok(Some(e)) if e.operation == kv::Operation::Put => {
                            match serde_json::from_slice::<Owner>(&e.value) {
                                Ok(o) if o.node == node => Ok(Claim::Ours(e.revision)),
                                Ok(o) => Ok(Claim::Lost(o.node)),
                                Err(_) => Ok(Claim::Lost("another node".into())),
                            }
                        }
                        _ => Ok(Claim::Lost("another node".into())),
                    }
                }
                Err((false, e)) => Err(format!("the session registry: {e}")),
            }
        })
        .await
    }

    /// Deletes `key` if it is still at `revision`.
    fn delete(&self, key: String, revision: u64) {
        let Ok(store) = self.store() else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let timeout = self.timeout;
        rt.spawn(async move {
            // A newer claim (another node's) keeps the key: the compare fails, as meant.
            let _ =
                tokio::time::timeout(timeout, store.delete_expect_revision(&key, Some(revision)))
                    .await;
        });
    }
}

#[async_trait::async_trait]
impl SessionRegistry for Registry {
    async fn claim(&self, client_id: &str) -> (Claim, Option<String>) {
        let key = key_of(client_id);
        if key.len() > MAX_KEY_LEN {
            let why = "its client identifier is too long for the registry";
            return (Claim::Unknown(why.into()), None);
        }
        // A client back on the node that owns its session: over the revision known here,
        // without reading first (the read below when another write came in between).
        let known = self.owned.lock().get(client_id).map(|(rev, _)| *rev);
        if let Some(rev) = known {
            if let Ok(Claim::Ours(rev)) = self.write(&key, rev).await {
                return (Claim::Ours(rev), None);
            }
        }
        let (owner, revision) = match self.read(&key).await {
            Ok(read) => read,
            Err(e) => return (Claim::Unknown(e), None),
        };
        let claim = self
            .write(&key, revision)
            .await
            .unwrap_or_else(Claim::Unknown);
        (claim, owner.filter(|o| *o != self.node))
    }

    async fn confirm(&self, client_id: &Arc<str>, revision: u64, session: &Arc<Session>) -> Claim {
        let claim = self
            .write(&key_of(client_id), revision)
            .await
            .unwrap_or_else(Claim::Unknown);
        if let Claim::Ours(rev) = claim {
            self.owned
                .lock()
                .insert(Arc::clone(client_id), (rev, Arc::downgrade(session)));
        }
        claim
    }

    async fn give_back(&self, client_id: &str, revision: u64, owner: &str) {
        let key = key_of(client_id);
        let value = Owner {
            node: owner.to_string(),
            at: unix_ms(),
        };
        let Ok(value) = serde_json::to_vec(&value) else {
            return;
        };
        let written = self
            .within(|store| async move {
                store
                    .update(&key, value.into(), revision)
                    .await
                    .map_err(|e| e.to_string())
            })
            .await;
        match written {
            Ok(_) => {
                tracing::info!(%client_id, %owner, "cluster: CONNECT refused, the session left to its owner in the registry")
            }
            // Claimed again since (another CONNECT), or the registry unreachable: that claim,
            // or the fencing at the next reconnection, decides.
            Err(e) => {
                tracing::debug!(%client_id, %owner, "cluster: the session's claim not given back: {e}")
            }
        }
    }

    async fn check(&self, client_id: &str) -> Claim {
        match self.read(&key_of(client_id)).await {
            Ok((Some(node), _)) if node != self.node => {
                self.owned.lock().remove(client_id);
                Claim::Lost(node)
            }
            // This node's, or nobody's (then nobody else acts for it).
            Ok((_, rev)) => Claim::Ours(rev),
            Err(e) => Claim::Unknown(e),
        }
    }

    fn ended(&self, session: &Arc<Session>, handed_over: bool) {
        let revision = {
            let mut owned = self.owned.lock();
            match owned.get(&session.client_id) {
                Some((rev, s)) if std::ptr::eq(s.as_ptr(), Arc::as_ptr(session)) => {
                    let rev = *rev;
                    owned.remove(&session.client_id);
                    rev
                }
                _ => return,
            }
        };
        if !handed_over {
            self.delete(key_of(&session.client_id), revision);
        }
    }

    fn owned(&self) -> usize {
        self.owned.lock().len()
    }
}

/// Makes or finds the bucket, retrying until NATS answers; then this node's sessions are
/// checked ([`fence`]). Run at start and at each connection to NATS (the server may have
/// started afresh, without the bucket).
pub(super) async fn ensure(
    broker: Arc<BrokerState>,
    registry: Arc<Registry>,
    js: jetstream::Context,
    prefix: String,
) {
    let cfg = &broker.config.cluster;
    let bucket = bucket_name(&prefix);
    // The bucket's stream as the key-value API makes it (one value per key, deletions as
    // markers), made here: the API's own maker asks for account details NATS servers before
    // 2.10 do not give. Without direct gets: every read goes to the stream's leader, so a
    // claim is never checked against a replica behind it.
    let config = jetstream::stream::Config {
        name: format!("KV_{bucket}"),
        description: Some("mercurio: the owner of each persistent session".into()),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        max_bytes: i64::try_from(cfg.jetstream_max_bytes()).unwrap_or(i64::MAX),
        storage: jetstream::stream::StorageType::File,
        num_replicas: cfg.jetstream_replicas(),
        allow_rollup: true,
        deny_delete: true,
        allow_direct: false,
        discard: jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    let mut backoff = Duration::from_millis(50);
    let mut told = false;
    let store = loop {
        let found = match js.get_or_create_stream(config.clone()).await {
            Ok(_) => js
                .get_key_value(bucket.clone())
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match found {
            Ok(store) => break store,
            Err(e) => {
                if !told {
                    told = true;
                    tracing::warn!(%bucket, "cluster: the session registry cannot be made or found yet (JetStream on the NATS servers?); sessions are served without it meanwhile; retrying: {e}");
                } else {
                    tracing::debug!(%bucket, "cluster: session registry not ready: {e}");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    };
    *registry.store.lock() = Some(store);
    tracing::debug!(%bucket, "cluster: session registry ready");
    fence(&broker, &registry).await;
}

/// Fences out the sessions held here that another node owns now (a copy left by a crash or
/// by an outage of NATS): their wills discarded, their connections closed with Session taken
/// over, their state kept for `takeover_timeout` for the owner's hand-over, then ended;
/// claims those nobody owns; then publishes the wills the restore held, but those of
/// sessions another node owns.
pub(super) async fn fence(broker: &Arc<BrokerState>, registry: &Arc<Registry>) {
    let held: Vec<(String, Will)> = broker.held_wills.release();
    let sessions: Vec<Arc<Session>> = broker
        .sessions
        .lock()
        .values()
        .filter(|s| !s.is_internal() && s.state.lock().expiry_interval() > 0)
        .cloned()
        .collect();
    // Collected first: futures owning what they use (a stream holding a closure that
    // borrows would not be `Send` for the task).
    let checks: Vec<_> = sessions.iter().map(|session| {
        let (registry, session) = (Arc::clone(registry), Arc::clone(session));
        async move {
            match registry.read(&key_of(&session.client_id)).await {
                Ok((Some(node), _)) if node != registry.node => {
                    registry.owned.lock().remove(&session.client_id);
                    Some(node)
                }
                // Already this node's: kept as it is, not written again. A write here could
                // overtake a node claiming the session this instant (its client moving on
                // while this node starts), and refuse that client.
                Ok((Some(_), rev)) => {
                    registry
                        .owned
                        .lock()
                        .insert(Arc::clone(&session.client_id), (rev, Arc::downgrade(&session)));
                    None
                }
                // Nobody's: claimed for this copy.
                Ok((None, rev)) => match registry.confirm(&session.client_id, rev, &session).await {
                    Claim::Lost(node) => Some(node),
                    _ => None,
                },
                Err(e) => {
                    tracing::debug!(client_id = %session.client_id, "cluster: session not checked against the registry: {e}");
                    None
                }
            }
        }
    }).collect();
    let lost: Vec<Option<String>> = futures_util::stream::iter(checks)
        .buffered(FENCE_CONCURRENCY)
        .collect()
        .await;
    // Whether each session checked here is lost to another node.
    let mut checked: HashMap<Arc<str>, bool> = HashMap::new();
    for (session, lost) in sessions.iter().zip(lost) {
        checked.insert(Arc::clone(&session.client_id), lost.is_some());
        let Some(node) = lost else {
            continue;
        };
        // Not ended at once: the owner may have claimed it this instant (its client moving
        // on while this node starts) and be about to ask this node for it, which the
        // hand-over answers with this copy. Its will discarded and its connection closed
        // now; after `takeover_timeout`, ended if still here and still another node's.
        tracing::info!(client_id = %session.client_id, owner = %node, "cluster: session owned by another node now: this node's copy ends, without its will, once handed over or after takeover_timeout");
        broker.fence_out(session).await;
        let (broker, session) = (Arc::clone(broker), Arc::clone(session));
        tokio::spawn(async move {
            tokio::time::sleep(broker.config.cluster.takeover()).await;
            let here = broker
                .sessions
                .lock()
                .get(&session.client_id)
                .is_some_and(|s| Arc::ptr_eq(s, &session));
            if here {
                broker.still_owned(&session).await;
            }
        });
    }
    for (client_id, will) in held {
        let lost = match checked.get(client_id.as_str()) {
            Some(lost) => *lost,
            // A session that ended at the restore (expired while the node was down).
            None => matches!(registry.check(&client_id).await, Claim::Lost(_)),
        };
        if lost {
            tracing::info!(%client_id, "cluster: will of a session another node owns now: not published");
            continue;
        }
        broker.publish_will(&client_id, will);
    }
}

/// Publishes the wills the restore held once `takeover_timeout` has passed without the
/// registry (they are not held longer).
pub(super) async fn release_held_wills_after(broker: Arc<BrokerState>, wait: Duration) {
    tokio::time::sleep(wait).await;
    let held = broker.held_wills.release();
    if !held.is_empty() {
        tracing::warn!(
            wills = held.len(),
            "cluster: the session registry is not reachable: the wills due at start are published without checking which node owns their sessions"
        );
    }
    for (client_id, will) in held {
        broker.publish_will(&client_id, will);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_are_escaped() {
        assert_eq!(key_of("dev-1_a"), "dev-1_a");
        assert_eq!(key_of("a.b/c d"), "a=2Eb=2Fc=20d");
        assert_eq!(key_of("é="), "=C3=A9=3D");
        assert_eq!(key_of(""), "=");
    }

    proptest! {
        #[test]
        fn a_key_gives_back_its_client_identifier(id in "\\PC{0,40}") {
            let key = key_of(&id);
            prop_assert!(key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'='));
            prop_assert_eq!(client_id_of(&key), Some(id));
        }
    }
}
