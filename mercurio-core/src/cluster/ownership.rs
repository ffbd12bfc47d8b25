//! Session ownership across nodes over NATS (docs/cluster.md, "Sessions across nodes"): a
//! CONNECT on one node asks the others for its client identifier's session, and the node
//! that has it hands it over (`broker/handover.rs` for both sides' session work).
//!
//! - `{prefix}.session.take`: a node asks every other node (an [`Ask`], CBOR), with a reply
//!   subject of its own. Each node answers there ([`Answer`]): none, unavailable, or the
//!   session's records (CBOR) in parts of at most the NATS server's `max_payload`, in order,
//!   with a subject of its own on which the taker confirms.
//! - The asker waits for every node it hears (heartbeats) to answer, within
//!   `takeover_timeout`; then it adopts the session (the most recently active copy, if
//!   several nodes had one), and once its storage committed it, confirms to each node that
//!   answered with a copy: they end theirs. A node that gets no confirmation within
//!   [`confirm_wait`] keeps its copy.
//!
//! Dependency: `ciborium` (CBOR through serde) for the asks, answers and records: compact
//! binary payloads without a format of our own (recorded in the crate's Cargo.toml).

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use mercurio_storage::{SessionRecord, StoredMessage};
use serde::{Deserialize, Serialize};

use super::forward::Forwards;
use super::recovery;
use crate::broker::handover::{HandOver, HandedOver, OtherNodes, Taken};
use crate::broker::BrokerState;

/// The most a session's records may weigh in a hand-over, in bytes (CBOR): a session
/// larger than that stays where it is, and its client is refused with Server unavailable
/// on the other nodes.
pub(super) const MAX_HANDOVER_BYTES: usize = 64 * 1024 * 1024;

/// Room left in each NATS message for the answer's other fields.
const PART_OVERHEAD: usize = 1024;

/// A node asking for a client identifier's session.
#[derive(Debug, Serialize, Deserialize)]
struct Ask {
    client_id: String,
    /// The CONNECT's Clean Start: the owner ends the session instead of handing it over.
    clean_start: bool,
    /// The asking node, for the log.
    node: String,
}

/// What a node has of the session asked for.
#[derive(Debug, Serialize, Deserialize)]
enum Has {
    Nothing,
    /// It has the session but cannot hand it over now, and why.
    Unavailable(String),
    /// Part `part` (from 0) of `parts` of the session's records.
    Part {
        part: u32,
        parts: u32,
        data: Bytes,
    },
}

/// One answer message.
#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    node: String,
    has: Has,
    /// With a session's parts: where the taker confirms it has the session.
    confirm: Option<String>,
    /// With a session's parts: the copy is stale ([`HandedOver::stale`]).
    stale: bool,
}

fn to_cbor<T: Serialize>(value: &T) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    ciborium::into_writer(value, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

fn from_cbor<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, String> {
    ciborium::from_reader(bytes).map_err(|e| e.to_string())
}

/// The subject every node asks on.
fn take_subject(prefix: &str) -> String {
    format!("{prefix}.session.take")
}

/// How long an owner keeps a session it handed over while waiting for the taker's
/// confirmation: the taker's whole wait for answers, then time for its storage to commit.
fn confirm_wait(takeover: Duration) -> Duration {
    takeover + Duration::from_secs(10)
}

/// The other nodes over NATS: what this node's CONNECTs ask ([`OtherNodes`]).
pub(super) struct NatsNodes {
    broker: Weak<BrokerState>,
    client: async_nats::Client,
    prefix: String,
    subject: String,
    node: String,
    timeout: Duration,
}

impl NatsNodes {
    pub(super) fn new(
        broker: &Arc<BrokerState>,
        client: async_nats::Client,
        prefix: &str,
    ) -> NatsNodes {
        let cfg = &broker.config.cluster;
        NatsNodes {
            broker: Arc::downgrade(broker),
            client,
            prefix: prefix.to_string(),
            subject: take_subject(prefix),
            node: cfg.node_name.clone(),
            timeout: cfg.takeover(),
        }
    }
}

/// One node's answer as it comes in.
#[derive(Default)]
struct Collected {
    parts: Vec<Bytes>,
    bytes: usize,
    done: bool,
    unavailable: Option<String>,
    confirm: Option<String>,
    stale: bool,
}

#[async_trait::async_trait]
impl OtherNodes for NatsNodes {
    async fn take(&self, client_id: &str, clean_start: bool, owner: Option<&str>) -> Taken {
        let Some(broker) = self.broker.upgrade() else {
            return Taken::None;
        };
        if !broker
            .cluster
            .connected
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(%client_id, "cluster: NATS unreachable: the other nodes cannot be asked for this client's session; served from this node's own");
            return Taken::None;
        }
        let now = Instant::now();
        let asked: Vec<String> = broker
            .cluster
            .peers
            .lock()
            .values()
            .filter(|p| p.up(now))
            .map(|p| p.heartbeat.node.clone())
            .collect();
        let expected = asked.len();
        // The registry's owner, gone: its session may be in its storage ("recovery").
        let from_storage = |owner: Option<&str>| {
            let owner = owner.filter(|_| !clean_start).map(str::to_string);
            let broker = Arc::clone(&broker);
            async move {
                match owner {
                    Some(owner) => {
                        let nodes = recovery::Nodes {
                            client: &self.client,
                            prefix: &self.prefix,
                            node: &self.node,
                            timeout: self.timeout,
                        };
                        recovery::take(&broker, &nodes, client_id, &owner).await
                    }
                    None => Taken::None,
                }
            }
        };
        if expected == 0 {
            return from_storage(owner).await;
        }
        let ask = Ask {
            client_id: client_id.to_string(),
            clean_start,
            node: self.node.clone(),
        };
        let Ok(ask) = to_cbor(&ask) else {
            return Taken::None;
        };
        let inbox = self.client.new_inbox();
        let mut answers = match self.client.subscribe(inbox.clone()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(%client_id, "cluster: the other nodes cannot be asked for this client's session: {e}");
                return Taken::None;
            }
        };
        if let Err(e) = self
            .client
            .publish_with_reply(self.subject.clone(), inbox, ask.into())
            .await
        {
            tracing::warn!(%client_id, "cluster: the other nodes cannot be asked for this client's session: {e}");
            return Taken::None;
        }
        let mut nodes: HashMap<String, Collected> = HashMap::new();
        let asked_at = tokio::time::Instant::now();
        let deadline = asked_at + self.timeout;
        while nodes.values().filter(|c| c.done).count() < expected {
            let msg = match tokio::time::timeout_at(deadline, answers.next()).await {
                Ok(Some(msg)) => msg,
                Ok(None) | Err(_) => break,
            };
            if msg.payload.is_empty() {
                // A status from the server (no responders), not an answer.
                continue;
            }
            let answer: Answer = match from_cbor(&msg.payload) {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!("cluster: unreadable answer about a session: {e}");
                    continue;
                }
            };
            let c = nodes.entry(answer.node).or_default();
            if c.done {
                continue;
            }
            match answer.has {
                Has::Nothing => c.done = true,
                Has::Unavailable(why) => {
                    c.unavailable = Some(why);
                    c.done = true;
                }
                Has::Part { part, parts, data } => {
                    c.bytes += data.len();
                    if part as usize != c.parts.len() || c.bytes > MAX_HANDOVER_BYTES {
                        c.unavailable = Some("its answer came out of order or too large".into());
                        c.done = true;
                        continue;
                    }
                    c.parts.push(data);
                    c.confirm = answer.confirm;
                    c.stale = answer.stale;
                    c.done = c.parts.len() as u32 >= parts;
                }
            }
        }
        let _ = answers.unsubscribe().await;
        // The CONNECT waited for these (up to takeover_timeout): say so, naming them.
        let silent: Vec<&str> = asked
            .iter()
            .filter(|n| !nodes.get(n.as_str()).is_some_and(|c| c.done))
            .map(String::as_str)
            .collect();
        if !silent.is_empty() {
            tracing::info!(
                %client_id,
                nodes = %silent.join(", "),
                "cluster: no complete answer about this client's session from these nodes after {} ms (takeover_timeout {} s); going on with the answers received",
                asked_at.elapsed().as_millis(),
                self.timeout.as_secs()
            );
        }
        // Every complete copy; the most recent one wins (several exist only after a crash or
        // a NATS outage left one behind): one a client took up since its node started, then
        // the latest disconnection.
        let mut copies: Vec<(
            SessionRecord,
            Vec<StoredMessage>,
            bool,
            Option<String>,
            String,
        )> = Vec::new();
        let mut unavailable = None;
        let answered: Vec<String> = nodes
            .iter()
            .filter(|(_, c)| c.done)
            .map(|(n, _)| n.clone())
            .collect();
        for (node, c) in nodes {
            if let Some(why) = c.unavailable {
                unavailable = Some(format!("node {node}: {why}"));
                continue;
            }
            if c.parts.is_empty() || !c.done {
                continue;
            }
            let bytes: Vec<u8> = c.parts.concat();
            match from_cbor::<(SessionRecord, Vec<StoredMessage>)>(&bytes) {
                Ok((record, messages)) => copies.push((record, messages, c.stale, c.confirm, node)),
                Err(e) => unavailable = Some(format!("node {node}: unreadable session: {e}")),
            }
        }
        let confirms: Vec<String> = copies.iter().filter_map(|c| c.3.clone()).collect();
        let others = copies.len().saturating_sub(1);
        let Some((record, messages, stale, _, from)) = copies
            .into_iter()
            .max_by_key(|c| (!c.2, c.0.disconnected_at.unwrap_or(u64::MAX)))
        else {
            return match unavailable {
                Some(why) => Taken::Unavailable(why),
                // The owner did not answer: gone (crashed, not yet seen as gone).
                None if owner.is_some_and(|o| !answered.iter().any(|n| n == o)) => {
                    from_storage(owner).await
                }
                None => Taken::None,
            };
        };
        let client = self.client.clone();
        let confirm = Box::new(move || {
            tokio::spawn(async move {
                for subject in confirms {
                    if let Err(e) = client.publish(subject, Bytes::new()).await {
                        tracing::warn!("cluster: a session's hand-over not confirmed: {e}");
                    }
                }
            });
        });
        if others > 0 {
            // Copies left by a crash or an outage: the older ones end on their nodes.
            tracing::info!(%client_id, %from, others, "cluster: session taken over from another node, its older copies elsewhere discarded");
        } else {
            tracing::info!(%client_id, %from, "cluster: session taken over from another node");
        }
        Taken::Session(Box::new(HandedOver {
            record,
            messages,
            stale,
            confirm,
        }))
    }
}

/// Answers the other nodes' asks for sessions until the connection closes.
/// With `forwards` (JetStream on), each session handed over is recorded there.
pub(super) async fn serve(
    broker: Arc<BrokerState>,
    client: async_nats::Client,
    prefix: String,
    forwards: Option<Arc<Forwards>>,
) {
    let mut asks = match client.subscribe(take_subject(&prefix)).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cluster: cannot hand sessions over to other nodes: {e}");
            return;
        }
    };
    while let Some(msg) = asks.next().await {
        let Some(reply) = msg.reply else {
            continue;
        };
        let ask: Ask = match from_cbor(&msg.payload) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("cluster: unreadable ask for a session: {e}");
                continue;
            }
        };
        // Each ask on a task of its own: closing a connection and reading a queue from
        // storage take time, and other clients' asks need not wait for them.
        tokio::spawn(answer(
            Arc::clone(&broker),
            client.clone(),
            ask,
            reply.to_string(),
            forwards.clone(),
        ));
    }
}

/// Answers one ask on `reply`; with a session handed over, waits for its confirmation.
async fn answer(
    broker: Arc<BrokerState>,
    client: async_nats::Client,
    ask: Ask,
    reply: String,
    forwards: Option<Arc<Forwards>>,
) {
    let node = broker.config.cluster.node_name.clone();
    let send = |has: Has, confirm: Option<String>, stale: bool| {
        let answer = Answer {
            node: node.clone(),
            has,
            confirm,
            stale,
        };
        let client = client.clone();
        let reply = reply.clone();
        async move {
            match to_cbor(&answer) {
                Ok(bytes) => client.publish(reply, bytes.into()).await.is_ok(),
                Err(_) => false,
            }
        }
    };
    // Before the session's subscriptions leave the index: from then on its QoS 1/2 messages
    // still reaching this node go to the asker (held back until it confirms), not if the
    // session stays here after all.
    let here = broker.sessions.lock().get(ask.client_id.as_str()).cloned();
    if let (Some(f), Some(session), false) = (&forwards, here, ask.clean_start) {
        let filters: Vec<_> = session
            .state
            .lock()
            .subscriptions()
            .iter()
            .map(|(f, g)| (f.clone(), g.options.qos))
            .collect();
        f.record(
            &ask.client_id,
            &ask.node,
            filters,
            broker.config.cluster.jetstream_max_age(),
        );
    }
    let (record, messages, stale, session) = match broker
        .hand_over(&ask.client_id, ask.clean_start)
        .await
    {
        HandOver::NotHere => {
            if let Some(f) = &forwards {
                f.cancel(&ask.client_id);
            }
            send(Has::Nothing, None, false).await;
            return;
        }
        HandOver::Unavailable(why) => {
            if let Some(f) = &forwards {
                f.cancel(&ask.client_id);
            }
            tracing::warn!(client_id = %ask.client_id, asker = %ask.node, "cluster: session not handed over: {why}");
            send(Has::Unavailable(why), None, false).await;
            return;
        }
        HandOver::Session {
            record,
            messages,
            stale,
            session,
        } => (record, messages, stale, session),
    };
    let kept_after_all = |session: &Arc<crate::session::Session>| {
        // Handed over meanwhile through a later ask (an earlier one's CONNECT given up, asked
        // again, a node resumed after a stall answering both): the forwarding is that one's.
        if session.state.lock().ended() {
            return;
        }
        if let Some(f) = &forwards {
            f.cancel(&ask.client_id);
        }
        broker.kept_after_all(session);
    };
    let data = match to_cbor(&(&*record, messages)) {
        Ok(d) if d.len() <= MAX_HANDOVER_BYTES => Bytes::from(d),
        Ok(d) => {
            let why = format!(
                "the session's {} bytes are more than a hand-over carries ({MAX_HANDOVER_BYTES})",
                d.len()
            );
            tracing::warn!(client_id = %ask.client_id, asker = %ask.node, "cluster: session not handed over: {why}");
            kept_after_all(&session);
            send(Has::Unavailable(why), None, false).await;
            return;
        }
        Err(e) => {
            kept_after_all(&session);
            send(Has::Unavailable(format!("cannot encode: {e}")), None, false).await;
            return;
        }
    };
    let confirm_subject = client.new_inbox();
    let mut confirmed = match client.subscribe(confirm_subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            kept_after_all(&session);
            send(Has::Unavailable(format!("NATS: {e}")), None, false).await;
            return;
        }
    };
    let part_size = (client.server_info().max_payload)
        .saturating_sub(PART_OVERHEAD)
        .max(PART_OVERHEAD);
    let parts = data.len().div_ceil(part_size).max(1) as u32;
    for part in 0..parts {
        let from = part as usize * part_size;
        let chunk = data.slice(from..(from + part_size).min(data.len()));
        let has = Has::Part {
            part,
            parts,
            data: chunk,
        };
        if !send(has, Some(confirm_subject.clone()), stale).await {
            tracing::warn!(client_id = %ask.client_id, "cluster: session not handed over: NATS refused the answer; kept here");
            kept_after_all(&session);
            return;
        }
    }
    let wait = confirm_wait(broker.config.cluster.takeover());
    match tokio::time::timeout(wait, confirmed.next()).await {
        Ok(Some(_)) => {
            tracing::info!(client_id = %ask.client_id, to = %ask.node, "cluster: session handed over");
            broker.handed_over(&session);
            if let Some(f) = &forwards {
                if session.is_connected() {
                    // Taken up here again meanwhile: it stays.
                    f.cancel(&ask.client_id);
                } else {
                    f.confirm(&ask.client_id);
                }
            }
        }
        _ => {
            tracing::warn!(client_id = %ask.client_id, asker = %ask.node, "cluster: session handed over without confirmation: kept here");
            kept_after_all(&session);
        }
    }
    let _ = confirmed.unsubscribe().await;
}
