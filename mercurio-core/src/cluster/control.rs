//! Retained messages cluster-wide, and the nodes' heartbeats (docs/cluster.md, "Retained
//! messages" and "Status"), on the node's first NATS connection:
//!
//! - `{prefix}.retained`: each retained change made on a node (set, or cleared with an empty
//!   payload), stamped ([`crate::cluster_status::Stamp`]), to every node, which applies it
//!   when it is newer than what it has (last writer wins);
//! - `{prefix}.retained.sync`: a node that (re)connects to NATS asks for what it missed; every
//!   node answers on the asker's `{prefix}.retained.reply.{node}`, one message per retained
//!   topic (and per recent clear), applied the same way; and a node that hears a node it
//!   did not (one joining, or back after a partition of NATS) asks that one alone, on
//!   `{prefix}.retained.sync.{node}`;
//! - `{prefix}.node.{node}`: each node's [`Heartbeat`], every `heartbeat_interval`;
//! - `{prefix}.interest...`: the filters each node's clients want ([`super::remote`]).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;

use super::envelope::{Envelope, RetainedUpdate};
use super::remote::{LinkFilters, Next, Remote};
use super::Throttle;
use crate::admin::Heartbeat;
use crate::broker::BrokerState;
use crate::cluster_status::{
    ClusterStatus, Delta, Part, Peer, RetainedChange, Stamp, MISSED_HEARTBEATS, TOMBSTONE_TTL,
};
use crate::codec::QoS;
use crate::message::Message;

/// How long a gone node stays in the list of nodes.
const FORGET_GONE: Duration = Duration::from_secs(3600);

/// The subjects of the control task.
pub(super) struct Subjects {
    prefix: String,
    retained: String,
    sync: String,
    /// This node's own sync subject.
    sync_here: String,
    reply: String,
    heartbeats: String,
    heartbeat: String,
    /// Every node's interest changes: `{prefix}.interest.*`.
    interest_all: String,
    /// This node's: `{prefix}.interest.{node}`.
    interest_here: String,
    /// Asking this node for its whole interest.
    interest_sync_here: String,
    /// The answers to this node's asking.
    interest_reply: String,
}

impl Subjects {
    /// This node's heartbeat subject.
    pub(super) fn heartbeat_subject(&self) -> &str {
        &self.heartbeat
    }

    pub(super) fn new(prefix: &str, node: &str) -> Subjects {
        Subjects {
            prefix: prefix.to_string(),
            retained: format!("{prefix}.retained"),
            sync: format!("{prefix}.retained.sync"),
            sync_here: format!("{prefix}.retained.sync.{node}"),
            reply: format!("{prefix}.retained.reply.{node}"),
            heartbeats: format!("{prefix}.node.*"),
            heartbeat: format!("{prefix}.node.{node}"),
            interest_all: format!("{prefix}.interest.*"),
            interest_here: format!("{prefix}.interest.{node}"),
            interest_sync_here: format!("{prefix}.interest.sync.{node}"),
            interest_reply: format!("{prefix}.interest.reply.{node}"),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// This node's heartbeat now; `origin`, its incarnation.
pub(super) fn heartbeat(broker: &BrokerState, origin: u64, leaving: bool) -> Heartbeat {
    let cfg = &broker.config.cluster;
    Heartbeat {
        node: cfg.node_name.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        clients: broker.stats.clients_connected.load(Ordering::Relaxed),
        // What `broker status` counts: the broker's own sessions (this node's `$internal/cluster`
        // among them) are left out.
        sessions: broker.session_counts().0 as u64,
        connected_since: broker.cluster.connected_since.load(Ordering::Relaxed),
        started: unix_now().saturating_sub(broker.started.elapsed().as_secs()),
        interval_ms: cfg.heartbeat().as_millis() as u64,
        leaving,
        interest_incarnation: origin,
        interest_version: broker.cluster.interest.lock().v,
    }
}

/// Publishes this node's heartbeat (when connected: a heartbeat held while disconnected
/// would say something stale once sent).
pub(super) async fn announce(
    broker: &BrokerState,
    client: &async_nats::Client,
    subject: &str,
    origin: u64,
    leaving: bool,
) {
    if !broker.cluster.connected.load(Ordering::Relaxed) {
        return;
    }
    let Ok(json) = serde_json::to_vec(&heartbeat(broker, origin, leaving)) else {
        return;
    };
    if let Err(e) = client.publish(subject.to_string(), json.into()).await {
        tracing::debug!("cluster: heartbeat not sent: {e}");
    }
}

/// Runs the control subjects until the connection closes.
pub(super) async fn run(
    broker: Arc<BrokerState>,
    client: async_nats::Client,
    subjects: Subjects,
    origin: u64,
    publisher: Arc<str>,
    link: Arc<LinkFilters>,
) {
    let status: &ClusterStatus = &broker.cluster;
    let subscribe = |s: &str| client.subscribe(s.to_string());
    let (retained, sync, sync_here, replies, beats, deltas, asked, parts) = match (
        subscribe(&subjects.retained).await,
        subscribe(&subjects.sync).await,
        subscribe(&subjects.sync_here).await,
        subscribe(&subjects.reply).await,
        subscribe(&subjects.heartbeats).await,
        subscribe(&subjects.interest_all).await,
        subscribe(&subjects.interest_sync_here).await,
        subscribe(&subjects.interest_reply).await,
    ) {
        (Ok(a), Ok(b), Ok(c), Ok(d), Ok(e), Ok(f), Ok(g), Ok(h)) => (a, b, c, d, e, f, g, h),
        _ => {
            // Only a closed client refuses (it buffers while disconnected).
            tracing::warn!("cluster: cannot subscribe to the control subjects on NATS");
            return;
        }
    };
    // Both sync subjects are answered alike.
    let sync = futures_util::stream::select(sync, sync_here);
    let (mut retained, mut sync, mut replies, mut beats) =
        (retained.fuse(), sync.fuse(), replies.fuse(), beats.fuse());
    let (mut deltas, mut asked, mut parts) = (deltas.fuse(), asked.fuse(), parts.fuse());
    let mut remote = Remote::default();
    // Asks `node` for its whole interest.
    let ask = |node: String| {
        let client = client.clone();
        let reply = subjects.interest_reply.clone();
        let to = format!("{}.interest.sync.{node}", subjects.prefix);
        async move {
            if let Err(e) = client.publish_with_reply(to, reply, Bytes::new()).await {
                tracing::debug!("cluster: interest not asked for: {e}");
            }
        }
    };
    // Shows what is known of `node`'s interest in the status.
    let counted = |remote: &Remote, node: &str| {
        if let Some(p) = status.peers.lock().get_mut(node) {
            p.interest = remote.count(node);
        }
    };
    let own = broker.config.cluster.node_name.clone();
    let mut tick = tokio::time::interval(broker.config.cluster.heartbeat());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = Throttle::default();
    let mut seq = 0u64;
    // The other nodes heard as up, for logging membership changes once each.
    let mut members: HashSet<String> = HashSet::new();
    loop {
        tokio::select! {
            _ = status.retained.wake.notified() => {
                for change in status.retained.take_outbox() {
                    seq += 1;
                    send(&client, &subjects.retained, None, origin, seq, &change, status, &mut warned).await;
                }
            }
            _ = status.connects.notified() => {
                // Connected (again): what changed while this node was away comes from the
                // others' answers; they learn that this node is here.
                if let Err(e) = client
                    .publish_with_reply(subjects.sync.clone(), subjects.reply.clone(), Bytes::from(own.clone()))
                    .await
                {
                    tracing::debug!("cluster: retained messages not asked for: {e}");
                }
                announce(&broker, &client, &subjects.heartbeat, origin, false).await;
            }
            _ = tick.tick() => {
                announce(&broker, &client, &subjects.heartbeat, origin, false).await;
                status.retained.prune(TOMBSTONE_TTL);
                let now = Instant::now();
                status.peers.lock().retain(|_, p| now.duration_since(p.seen) < FORGET_GONE);
                let mut gone = Vec::new();
                {
                    let peers = status.peers.lock();
                    members.retain(|node| match peers.get(node) {
                        Some(p) if p.up(now) => true,
                        p => {
                            let silent_s = p.map_or(0, |p| now.duration_since(p.seen).as_secs());
                            tracing::warn!(node = %node, silent_s, "cluster: node gone: its heartbeats stopped");
                            gone.push(node.clone());
                            false
                        }
                    });
                }
                // Its sessions' wills, if its storage is listed; not while this node is the
                // one cut off (then every other node looks gone). A node alive is safe
                // anyway: its database, served, is not taken.
                let connected = status.connected.load(Ordering::Relaxed);
                for node in gone.iter().filter(|_| connected) {
                    super::sweep::start(&broker, node);
                }
                // A node gone takes its interest with it; but while this node is cut off
                // from NATS (or just back, not having heard the others yet), it keeps what
                // it knows, so that messages for the others wait for NATS as before.
                let heard_long_enough = status.connected.load(Ordering::Relaxed)
                    && unix_now().saturating_sub(status.connected_since.load(Ordering::Relaxed))
                        > broker.config.cluster.heartbeat().as_secs() * u64::from(MISSED_HEARTBEATS);
                for node in remote.nodes().into_iter().filter(|_| heard_long_enough) {
                    let up = status.peers.lock().get(&node).is_some_and(|p| p.up(now));
                    if !up {
                        remote.forget(&broker, &link, &node);
                        if let Some(p) = status.peers.lock().get_mut(&node) {
                            p.interest = None;
                        }
                    }
                }
            }
            _ = status.interest_wake.notified() => {
                let delta = status.interest.lock().delta(origin);
                if let Some(json) = delta.and_then(|d| serde_json::to_vec(&d).ok()) {
                    if let Err(e) = client.publish(subjects.interest_here.clone(), json.into()).await {
                        tracing::debug!("cluster: interest change not sent: {e}");
                    }
                }
            }
            Some(m) = asked.next() => {
                let Some(reply) = m.reply else { continue };
                let answer = status.interest.lock().parts(&own, origin);
                for part in answer {
                    let Ok(json) = serde_json::to_vec(&part) else { continue };
                    if let Err(e) = client.publish(reply.clone(), json.into()).await {
                        tracing::debug!("cluster: interest not sent: {e}");
                    }
                }
            }
            Some(m) = deltas.next() => {
                let Some(node) = m.subject.rsplit('.').next().map(str::to_string) else { continue };
                if node == own {
                    continue;
                }
                match serde_json::from_slice::<Delta>(&m.payload) {
                    Ok(d) => {
                        if remote.delta(&broker, &link, &node, d) == Next::Ask {
                            ask(node.clone()).await;
                        }
                        counted(&remote, &node);
                    }
                    Err(e) => super::unreadable(status, &mut warned, &m.subject, &format!("unreadable interest change: {e}")),
                }
            }
            Some(m) = parts.next() => {
                if m.status.is_some() {
                    continue;
                }
                match serde_json::from_slice::<Part>(&m.payload) {
                    Ok(p) if p.node != own => {
                        let node = p.node.clone();
                        remote.part(&broker, &link, p);
                        counted(&remote, &node);
                    }
                    Ok(_) => {}
                    Err(e) => super::unreadable(status, &mut warned, &m.subject, &format!("unreadable interest: {e}")),
                }
            }
            Some(m) = retained.next() => apply(&broker, &publisher, m, &mut warned),
            Some(m) = replies.next() => apply(&broker, &publisher, m, &mut warned),
            Some(m) = sync.next() => {
                let Some(reply) = m.reply else { continue };
                let changes = snapshot(&broker);
                tracing::debug!(asker = %String::from_utf8_lossy(&m.payload), changes = changes.len(), "cluster: sending the retained messages to a node catching up");
                for change in changes {
                    seq += 1;
                    send(&client, &reply, Some(()), origin, seq, &change, status, &mut warned).await;
                }
            }
            Some(m) = beats.next() => {
                match serde_json::from_slice::<Heartbeat>(&m.payload) {
                    Ok(h) if h.node != own => {
                        let now = Instant::now();
                        let name = h.node.clone();
                        let (inc, v, leaving) = (h.interest_incarnation, h.interest_version, h.leaving);
                        let new = status
                            .peers
                            .lock()
                            .insert(name.clone(), Peer { heartbeat: h, seen: now, interest: remote.count(&name) })
                            .is_none_or(|p| !p.up(now));
                        if leaving {
                            if members.remove(&name) {
                                tracing::info!(node = %name, "cluster: node leaving (stopping)");
                            }
                        } else if members.insert(name.clone()) {
                            tracing::info!(node = %name, "cluster: node up (heartbeat heard)");
                        }
                        if leaving {
                            remote.forget(&broker, &link, &name);
                            counted(&remote, &name);
                        } else if remote.heard(&name, inc, v) == Next::Ask {
                            ask(name.clone()).await;
                        }
                        if new {
                            // A node this one did not hear (joining, or back after a
                            // partition of NATS that left both connected): its retained
                            // changes meanwhile.
                            let to = format!("{}.retained.sync.{name}", subjects.prefix);
                            if let Err(e) = client
                                .publish_with_reply(to, subjects.reply.clone(), Bytes::from(own.clone()))
                                .await
                            {
                                tracing::debug!("cluster: retained messages not asked for: {e}");
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(e) => super::unreadable(status, &mut warned, &m.subject, &format!("unreadable heartbeat: {e}")),
                }
            }
            else => return,
        }
    }
}

/// Every retained change this node knows, for a node catching up.
fn snapshot(broker: &BrokerState) -> Vec<RetainedChange> {
    let now = Instant::now();
    broker.cluster.retained.snapshot(
        |topic| {
            broker
                .retained
                .lock()
                .get(topic)
                .filter(|m| !m.is_expired(now))
                .cloned()
        },
        |topic| Arc::new(cleared(topic)),
    )
}

/// The empty retained message that clears `topic`.
fn cleared(topic: &str) -> Message {
    Message {
        topic: topic.to_string(),
        payload: Bytes::new(),
        qos: QoS::AtMostOnce,
        retain: true,
        properties: Default::default(),
        expires_at: None,
        publisher: None,
        source: None,
        encoded: Default::default(),
        stored: Default::default(),
    }
}

/// Sends one retained change on `subject` (counted in `retained_out` unless it answers a
/// node catching up, `answer`).
#[allow(clippy::too_many_arguments)]
async fn send(
    client: &async_nats::Client,
    subject: &str,
    answer: Option<()>,
    origin: u64,
    seq: u64,
    change: &RetainedChange,
    status: &ClusterStatus,
    warned: &mut Throttle,
) {
    let now = Instant::now();
    let msg = &change.msg;
    if !msg.payload.is_empty() && msg.is_expired(now) {
        return;
    }
    let update = RetainedUpdate {
        ms: change.stamp.ms,
        node: change.stamp.node.to_string(),
        envelope: Envelope {
            origin,
            seq,
            qos: msg.qos,
            retain: true,
            expiry: msg.remaining_expiry(now),
            properties: msg.properties.clone(),
            topic: Some(change.topic.clone()),
            payload: msg.payload.clone(),
        },
    };
    let sent = match update.encode() {
        Ok(bytes) => client
            .publish(subject.to_string(), bytes)
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match sent {
        Ok(()) if answer.is_none() => ClusterStatus::add(&status.retained_out, 1),
        Ok(()) => {}
        Err(e) => {
            ClusterStatus::add(&status.errors, 1);
            if warned.due() {
                tracing::warn!(topic = %change.topic, "cluster: retained message not sent to NATS (counted in cluster/messages/errors; at most one warning a minute): {e}");
            } else {
                tracing::debug!(topic = %change.topic, "cluster: retained message not sent to NATS: {e}");
            }
        }
    }
}

/// Applies a retained change from another node when it is newer than this node's.
fn apply(
    broker: &BrokerState,
    publisher: &Arc<str>,
    m: async_nats::Message,
    warned: &mut Throttle,
) {
    let status = &broker.cluster;
    if m.status.is_some() {
        // From the NATS server, not a node: "no responders" when this node asked for the
        // retained messages while no other node was there.
        return;
    }
    let update = match RetainedUpdate::decode(m.payload) {
        Ok(u) => u,
        Err(e) => {
            super::unreadable(
                status,
                warned,
                &m.subject,
                &format!("unreadable retained message: {e}"),
            );
            return;
        }
    };
    let env = update.envelope;
    let Some(topic) = env.topic else {
        return;
    };
    if crate::topic::validate_topic_name(&topic).is_err() || topic.starts_with('$') {
        let what = format!("a retained message on {topic:?}, a topic not shared between nodes");
        super::unreadable(status, warned, &m.subject, &what);
        return;
    }
    let stamp = Stamp {
        ms: update.ms,
        node: Arc::from(update.node),
    };
    let clear = env.payload.is_empty();
    let msg = Arc::new(Message {
        topic: topic.clone(),
        payload: env.payload,
        qos: env.qos,
        retain: true,
        properties: env.properties,
        expires_at: Message::expiry_deadline(env.expiry, Instant::now()),
        publisher: Some(Arc::clone(publisher)),
        source: None,
        encoded: Default::default(),
        stored: Default::default(),
    });
    // The embedding application's callback runs once the clock's lock is released.
    if let Some(change) = status
        .retained
        .remote(&topic, &stamp, clear, || broker.retain_quietly(&msg))
    {
        ClusterStatus::add(&status.retained_in, 1);
        if let Some(change) = change {
            broker.retained_changed(change);
        }
    }
}
