//! QoS 1 and 2 messages between nodes, at least once, through one JetStream stream
//! (docs/cluster.md, "QoS across nodes"):
//!
//! - the stream `{prefix with '.' as '_'}_qos` takes the subjects `{prefix}.qos.>`; work-queue
//!   retention (a message goes once its node has acknowledged it), bounded by
//!   `jetstream_max_age` and `jetstream_max_bytes`, refusing new messages when full (never
//!   dropping ones already acknowledged to a publisher);
//! - a message another node wants is published once per such node on
//!   `{prefix}.qos.{node}`, with `Nats-Msg-Id` `{origin}-{seq}-{node}` so that a republish
//!   after a lost acknowledgement is stored once ([`send`]); the publisher's PUBACK / PUBREC
//!   waits for JetStream's acknowledgements (`cluster_qos::Gate`);
//! - each node reads its subject through a durable pull consumer named after `node_name`,
//!   which outlives the node's restarts, routes each message locally, and acknowledges it to
//!   JetStream only then (with `durable_ack`, once storage has committed it) ([`take_in`]);
//!   a message for a session handed over to another node is forwarded there first
//!   (`forward`);
//! - a QoS 1 or 2 message of a shared subscription group with members on another node is
//!   published once, on the group's subject `{prefix}.qos.share.{group id}` ([`Names`]), read
//!   through one durable consumer per group that every node with members pulls from
//!   ([`take_groups`]): JetStream gives each message to one of them, which gives it to one
//!   of its members and acknowledges it then, or gives it back when none here takes it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, consumer, stream, AckKind};
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::sync::mpsc;

use super::envelope::Envelope;
use super::forward::{self, Forward, Forwards};
use super::{dedup, envelope_of, inbound_message, routable, unreadable, Throttle};
use crate::broker::BrokerState;
use crate::cluster_qos::{Gate, Outcome, Outgoing};
use crate::cluster_status::ClusterStatus;
use crate::config::ClusterConfig;
use crate::message::Message;

/// Copies published and not yet acknowledged by JetStream, at most.
const MAX_IN_FLIGHT: usize = 4096;

/// Messages JetStream hands this node before it has acknowledged the first of them.
const MAX_ACK_PENDING: i64 = 1024;

/// How long JetStream waits for this node's acknowledgement before it delivers a message
/// again.
const ACK_WAIT: Duration = Duration::from_secs(30);

/// How long JetStream remembers a `Nats-Msg-Id` (a republish within it is stored once).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The longest wait between two attempts to publish one copy, or to set up the stream or
/// the consumer.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The stream's and subjects' names, from the subject prefix.
#[derive(Clone)]
pub(super) struct Names {
    /// The stream: the prefix with `.` as `_`, then `_qos`.
    pub stream: String,
    /// `{prefix}.qos`
    base: String,
}

impl Names {
    pub(super) fn new(prefix: &str) -> Names {
        Names {
            stream: format!("{}_qos", prefix.replace('.', "_")),
            base: format!("{prefix}.qos"),
        }
    }

    /// The subject of the messages for `node` (a node name is a valid token: letters,
    /// digits, `-` and `_`).
    pub(super) fn node_subject(&self, node: &str) -> String {
        format!("{}.{node}", self.base)
    }

    /// The subject of the messages for the shared subscription group `full`
    /// (`$share/{ShareName}/{filter}`): `{prefix}.qos.share.{group id}`, one more token than
    /// a node's subject, so that no node's consumer reads it.
    pub(super) fn group_subject(&self, full: &str) -> String {
        format!("{}.share.{}", self.base, group_id(full))
    }

    /// The durable consumer every node with members of the group `full` pulls from:
    /// `share-{group id}`, 70 characters, longer than any `node_name` (a node's consumer is
    /// named after the node).
    pub(super) fn group_consumer(full: &str) -> String {
        format!("share-{}", group_id(full))
    }

    /// The stream's configuration from `[cluster]`.
    fn stream_config(&self, cfg: &ClusterConfig) -> stream::Config {
        stream::Config {
            name: self.stream.clone(),
            subjects: vec![format!("{}.>", self.base)],
            retention: stream::RetentionPolicy::WorkQueue,
            discard: stream::DiscardPolicy::New,
            max_age: cfg.jetstream_max_age(),
            max_bytes: i64::try_from(cfg.jetstream_max_bytes()).unwrap_or(i64::MAX),
            num_replicas: cfg.jetstream_replicas(),
            duplicate_window: DUPLICATE_WINDOW,
            storage: stream::StorageType::File,
            ..Default::default()
        }
    }
}

/// A shared subscription group's identifier in JetStream names: the SHA-256 of its full
/// filter, in hexadecimal (64 digits). A group's filter may be longer than a consumer's name
/// may be, and hold characters names may not; every node computes the same.
fn group_id(full: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(full.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The JetStream context on the node's connection: acknowledgements awaited for the context's
/// request timeout (5 s) before a copy is published again.
pub(super) fn context(client: async_nats::Client) -> jetstream::Context {
    jetstream::context::ContextBuilder::new()
        .max_ack_inflight(MAX_IN_FLIGHT)
        .backpressure_on_inflight(true)
        .build(client)
}

/// The `[cluster]` settings of `ours` that `theirs` (the stream as found) does not have:
/// `setting (this node X, the stream Y)` each.
fn differing(ours: &stream::Config, theirs: &stream::Config) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |name: &str, ours: String, theirs: String| {
        if ours != theirs {
            out.push(format!("{name} (this node {ours}, the stream {theirs})"));
        }
    };
    check(
        "jetstream_replicas",
        ours.num_replicas.to_string(),
        theirs.num_replicas.to_string(),
    );
    check(
        "jetstream_max_age",
        ours.max_age.as_secs().to_string(),
        theirs.max_age.as_secs().to_string(),
    );
    check(
        "jetstream_max_bytes",
        ours.max_bytes.to_string(),
        theirs.max_bytes.to_string(),
    );
    out
}

/// Creates the stream with `[cluster]`'s settings, retrying until NATS answers. A stream
/// found with other settings (made by a node configured otherwise, or changed by an
/// operator) keeps them: nodes configured apart do not undo each other's; the difference is
/// logged and counted (`cluster/jetstream/settings_differ`). `again`: a check after the
/// first (at each connection to NATS, the first one included), whose success is logged at the
/// debug level only.
async fn ensure_stream(
    broker: Arc<BrokerState>,
    js: jetstream::Context,
    names: Names,
    cfg: ClusterConfig,
    again: bool,
) {
    let config = names.stream_config(&cfg);
    let mut backoff = Duration::from_millis(50);
    let mut told = false;
    loop {
        match js.get_or_create_stream(config.clone()).await {
            Ok(stream) => {
                let differ = differing(&config, &stream.cached_info().config);
                if differ.is_empty() && again {
                    tracing::debug!(stream = %names.stream, "cluster: JetStream stream checked again: ready");
                } else if differ.is_empty() {
                    tracing::info!(stream = %names.stream, "cluster: JetStream stream ready for QoS 1 and 2 between nodes");
                } else {
                    ClusterStatus::add(&broker.cluster.jetstream_settings_differ, 1);
                    tracing::warn!(stream = %names.stream, "cluster: the JetStream stream exists with other settings than this node's [cluster] ones, kept as they are: {}; give every node the same settings, or change the stream's (nats stream edit)", differ.join(", "));
                }
                return;
            }
            Err(e) => {
                if told {
                    tracing::debug!(stream = %names.stream, "cluster: JetStream stream not ready: {e}");
                } else {
                    told = true;
                    tracing::warn!(stream = %names.stream, "cluster: cannot create the JetStream stream (is JetStream enabled on the NATS servers? set [cluster] jetstream = false to carry QoS 1 and 2 at most once over NATS core); QoS 1 and 2 publishers whose messages other nodes want wait; retrying: {e}");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// One copy of a handed-off message, for one node or one shared group.
struct NodeCopy {
    out: Arc<Handed>,
    subject: String,
    id: String,
    payload: bytes::Bytes,
    attempts: u32,
}

/// A handed-off message: the copies still unacknowledged.
struct Handed {
    gate: Arc<Gate>,
    cost: u64,
    left: AtomicUsize,
    /// A copy JetStream can never take (too large).
    refused: AtomicBool,
}

impl Handed {
    /// One copy done with (acknowledged, or refused for good); at the last, the publisher
    /// is told and the bytes are counted out.
    fn copy_done(&self, broker: &BrokerState) {
        if self.left.fetch_sub(1, Ordering::Relaxed) == 1 {
            if self.refused.load(Ordering::Relaxed) {
                self.gate.resolve(Outcome::Refused);
            } else {
                ClusterStatus::add(&broker.cluster.jetstream_out, 1);
                self.gate.resolve(Outcome::Held);
            }
            broker.cluster_qos.settled(self.cost);
        }
    }
}

/// Publishes what the broker hands off (`cluster_qos`), in order, one copy per destination
/// node, and resolves each message's gate once JetStream has acknowledged all its copies; a
/// copy JetStream did not acknowledge is published again (same `Nats-Msg-Id`) until it does.
pub(super) async fn send(
    broker: Arc<BrokerState>,
    js: jetstream::Context,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    names: Names,
    cfg: ClusterConfig,
    origin: u64,
    mut connected: tokio::sync::watch::Receiver<u64>,
) {
    // The stream is made (or found) on a task of its own, retried until NATS answers;
    // made again when JetStream did not know it (a NATS server started afresh) or at a
    // reconnection.
    let ensure = |again| {
        super::Forward(tokio::spawn(ensure_stream(
            Arc::clone(&broker),
            js.clone(),
            names.clone(),
            cfg.clone(),
            again,
        )))
    };
    let mut making = ensure(false);
    let mut recreate = false;
    // Publishers whose messages JetStream has not taken within jetstream_ack_timeout are
    // told, on a task of its own (this one may wait on a full NATS client).
    let max_age = cfg.jetstream_max_age();
    let expiring = Arc::clone(&broker);
    let _expiry = super::Forward(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let late = expiring.cluster_qos.expire();
            ClusterStatus::add(&expiring.cluster.jetstream_timeouts, late as u64);
            expiring.cluster_qos.forget_gone(max_age);
        }
    }));
    let status = &broker.cluster;
    let mut seq = 0u64;
    let mut warned = Throttle::default();
    type Acked = std::pin::Pin<
        Box<dyn std::future::Future<Output = (NodeCopy, Result<(), Failure>)> + Send>,
    >;
    let mut in_flight: FuturesUnordered<Acked> = FuturesUnordered::new();
    let mut retries: VecDeque<(tokio::time::Instant, NodeCopy)> = VecDeque::new();
    let mut recheck = tokio::time::interval(MAX_BACKOFF);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let publish = |c: NodeCopy| {
        let js = js.clone();
        async move {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", c.id.as_str());
            match js
                .publish_with_headers(c.subject.clone(), headers, c.payload.clone())
                .await
            {
                Ok(ack) => {
                    let acked: Acked = Box::pin(async move {
                        let r = ack.await.map(drop).map_err(|e| Failure {
                            stream_gone: e.kind() == PublishErrorKind::StreamNotFound,
                            permanent: false,
                            text: e.to_string(),
                        });
                        (c, r)
                    });
                    Ok(acked)
                }
                Err(e) => Err((
                    c,
                    Failure {
                        stream_gone: false,
                        permanent: e.kind() == PublishErrorKind::MaxPayloadExceeded,
                        text: e.to_string(),
                    },
                )),
            }
        }
    };
    loop {
        let next_retry = retries.front().map(|(at, _)| *at);
        tokio::select! {
            biased;
            Some((c, r)) = in_flight.next(), if !in_flight.is_empty() => match r {
                Ok(()) => c.out.copy_done(&broker),
                Err(e) if e.permanent => refuse(&broker, &mut warned, c, &e.text),
                Err(e) => {
                    recreate |= e.stream_gone;
                    failed(status, &mut warned, &e.text);
                    retries.push_back((tokio::time::Instant::now() + backoff(c.attempts), c));
                }
            },
            Ok(()) = connected.changed() => recreate = true,
            _ = recheck.tick() => {
                if recreate && making.0.is_finished() {
                    recreate = false;
                    making = ensure(true);
                }
            }
            _ = tokio::time::sleep_until(next_retry.unwrap_or_else(tokio::time::Instant::now)), if next_retry.is_some() => {
                let now = tokio::time::Instant::now();
                while retries.front().is_some_and(|(at, _)| *at <= now) {
                    let Some((_, mut c)) = retries.pop_front() else { break };
                    c.attempts += 1;
                    match publish(c).await {
                        Ok(acked) => in_flight.push(acked),
                        Err((c, e)) if e.permanent => refuse(&broker, &mut warned, c, &e.text),
                        Err((c, e)) => {
                            failed(status, &mut warned, &e.text);
                            retries.push_back((tokio::time::Instant::now() + backoff(c.attempts), c));
                        }
                    }
                }
            },
            m = rx.recv(), if in_flight.len() < MAX_IN_FLIGHT => {
                let Some(o) = m else { return };
                seq += 1;
                let envelope = Envelope {
                    origin,
                    seq,
                    qos: o.msg.qos,
                    retain: o.msg.retain,
                    expiry: o.msg.remaining_expiry(Instant::now()),
                    properties: o.msg.properties.clone(),
                    topic: Some(o.msg.topic.clone()),
                    payload: o.msg.payload.clone(),
                };
                let payload = match envelope.encode() {
                    Ok(p) => p,
                    Err(e) => {
                        // Cannot be carried (a property over 65,535 bytes): the publisher
                        // is not acknowledged as if it were.
                        ClusterStatus::add(&status.errors, 1);
                        tracing::warn!(topic = %o.msg.topic, "cluster: a message for other nodes cannot be encoded (counted in cluster/messages/errors): {e}");
                        o.gate.resolve(Outcome::Refused);
                        broker.cluster_qos.settled(o.cost);
                        continue;
                    }
                };
                let out = Arc::new(Handed {
                    gate: o.gate,
                    cost: o.cost,
                    left: AtomicUsize::new(o.nodes.len() + o.groups.len()),
                    refused: AtomicBool::new(false),
                });
                let nodes = o.nodes.iter().map(|node| {
                    (names.node_subject(node), format!("{origin:016x}-{seq}-{node}"))
                });
                let groups = o.groups.iter().map(|full| {
                    let consumer = Names::group_consumer(full);
                    (names.group_subject(full), format!("{origin:016x}-{seq}-{consumer}"))
                });
                for (subject, id) in nodes.chain(groups) {
                    let c = NodeCopy {
                        out: Arc::clone(&out),
                        subject,
                        id,
                        payload: payload.clone(),
                        attempts: 0,
                    };
                    match publish(c).await {
                        Ok(acked) => in_flight.push(acked),
                        Err((c, e)) if e.permanent => refuse(&broker, &mut warned, c, &e.text),
                        Err((c, e)) => {
                            failed(status, &mut warned, &e.text);
                            retries.push_back((tokio::time::Instant::now() + backoff(c.attempts), c));
                        }
                    }
                }
            }
        }
    }
}

/// Why JetStream did not acknowledge a copy.
struct Failure {
    /// JetStream does not know the stream (no responders).
    stream_gone: bool,
    /// It never will take it: larger than the NATS servers' `max_payload`.
    permanent: bool,
    text: String,
}

/// A copy JetStream can never take: counted, logged, and its message's publisher told
/// ([`Outcome::Refused`]) once its other copies are done with.
fn refuse(broker: &BrokerState, warned: &mut Throttle, c: NodeCopy, e: &str) {
    ClusterStatus::add(&broker.cluster.errors, 1);
    if warned.due() {
        tracing::warn!(subject = %c.subject, "cluster: JetStream cannot take a message for another node (raise max_payload on the NATS servers to carry it; counted in cluster/messages/errors; at most one warning a minute): {e}");
    } else {
        tracing::debug!(subject = %c.subject, "cluster: JetStream cannot take a message: {e}");
    }
    c.out.refused.store(true, Ordering::Relaxed);
    c.out.copy_done(broker);
}

/// The wait before the next attempt at a copy tried `attempts` times already.
fn backoff(attempts: u32) -> Duration {
    (Duration::from_millis(50) * 2u32.saturating_pow(attempts.min(5))).min(MAX_BACKOFF)
}

/// Counts a copy JetStream did not take (it is published again), and logs it (a warning at
/// most once a minute).
fn failed(status: &ClusterStatus, warned: &mut Throttle, e: &str) {
    ClusterStatus::add(&status.jetstream_retries, 1);
    if warned.due() {
        tracing::warn!("cluster: JetStream did not take a QoS 1/2 message for another node; publishing it again (counted in cluster/jetstream/retries; at most one warning a minute): {e}");
    } else {
        tracing::debug!("cluster: JetStream did not take a message: {e}");
    }
}

/// What waits for a message's acknowledgement to JetStream: `true` to acknowledge it, `false`
/// to have it delivered again at once.
type Ack = (jetstream::message::Acker, bool);

/// In: reads this node's messages from its durable consumer (named after `node`), routes
/// each once ([`dedup::Seen`]) as published by `publisher`, and acknowledges it once routed
/// (with `durable_ack`, once storage has committed what routing stored).
pub(super) async fn take_in(
    broker: Arc<BrokerState>,
    js: jetstream::Context,
    names: Names,
    cfg: ClusterConfig,
    publisher: Arc<str>,
    forwards: Arc<Forwards>,
    mut connected: tokio::sync::watch::Receiver<u64>,
) {
    let node = cfg.node_name.clone();
    let stream_config = names.stream_config(&cfg);
    // Unbounded, but JetStream hands out at most MAX_ACK_PENDING unacknowledged messages.
    let (ack_tx, ack_rx) = mpsc::unbounded_channel::<Ack>();
    // Acknowledgements go out in the order given, on a task of their own.
    let _acks = super::Forward(tokio::spawn(acknowledge(ack_rx)));
    let config = consumer::pull::Config {
        durable_name: Some(node.clone()),
        filter_subject: names.node_subject(&node),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        max_ack_pending: MAX_ACK_PENDING,
        deliver_policy: consumer::DeliverPolicy::All,
        ..Default::default()
    };
    let mut seen = dedup::Seen::default();
    let mut warned = Throttle::default();
    let mut congested = Vec::new();
    let mut backoff = Duration::from_millis(50);
    loop {
        let messages = async {
            // Created here too: after a NATS server started afresh, before anything is
            // published.
            let stream = js
                .get_or_create_stream(stream_config.clone())
                .await
                .map_err(|e| e.to_string())?;
            let consumer: consumer::PullConsumer = stream
                .get_or_create_consumer(&node, config.clone())
                .await
                .map_err(|e| e.to_string())?;
            consumer.messages().await.map_err(|e| e.to_string())
        }
        .await;
        let mut messages = match messages {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(consumer = %node, "cluster: JetStream consumer not ready: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let mut errors = 0;
        connected.mark_unchanged();
        loop {
            let m = tokio::select! {
                m = messages.next() => m,
                // Reconnected: the consumer is looked up again (and made, after a NATS
                // server started afresh).
                Ok(()) = connected.changed() => break,
            };
            let Some(m) = m else { break };
            let m = match m {
                Ok(m) => {
                    errors = 0;
                    m
                }
                Err(e) => {
                    // Missed heartbeats while NATS is away, and the like: the stream goes on;
                    // after a few in a row, the consumer is looked up again (it may be gone
                    // with a NATS server started afresh).
                    tracing::debug!(consumer = %node, "cluster: JetStream: {e}");
                    errors += 1;
                    if errors >= 3 {
                        break;
                    }
                    continue;
                }
            };
            let age = age_of(&m);
            let (m, acker) = m.split();
            let Some(msg) = receive_from(&broker, &publisher, &mut seen, &mut warned, &m, age)
            else {
                // A copy already routed, or unreadable: acknowledged, never to come again.
                let _ = ack_tx.send((acker, true));
                continue;
            };
            // Meant for a session handed over to another node: forwarded there first.
            let done = match forwards.route(&msg.topic) {
                Forward::To(nodes) => {
                    nodes.is_empty() || forward::forward(&js, &names, &m.payload, &nodes).await
                }
                Forward::Later => false,
            };
            if !done {
                // Given back, to be taken as new when it comes again.
                given_back(&mut seen, &m.payload);
                let later = AckKind::Nak(Some(forward::RETRY_LATER));
                tokio::spawn(async move { acker.ack_with(later).await });
                continue;
            }
            let msg = Arc::new(msg);
            broker.route_from(&msg, &mut congested);
            broker.wait_congested(None, &mut congested).await;
            acknowledge_after_commit(&broker, &ack_tx, acker);
        }
        tokio::time::sleep(backoff).await;
    }
}

/// How long JetStream waits for a node's acknowledgement of a shared group's message before
/// it gives the message to a node again (a node killed with messages taken: the other nodes
/// with members get them after this).
const GROUP_ACK_WAIT: Duration = Duration::from_secs(10);

/// Messages a node asks a group's consumer for at a time (one pull request): at most this
/// many wait for the node's members at once, the rest for whichever node asks next.
const GROUP_BATCH: usize = 16;

/// How long one pull request for a group's messages waits for them before the node asks
/// again.
const GROUP_PULL_WAIT: Duration = Duration::from_secs(5);

/// How long a group's consumer outlives the last node pulling from it (its members gone
/// everywhere, or their nodes stopped); what its subject holds then stays in the stream
/// (`jetstream_max_age`), for the consumer made again when a member comes.
const GROUP_INACTIVE: Duration = Duration::from_secs(300);

/// A change of this node's shared groups for [`take_groups`]: the group's full filter, and
/// whether it has members here now.
pub(super) type GroupChange = (Arc<str>, bool);

/// In, for shared subscription groups: pulls from the consumer of each group with members
/// on this node (one task per group, started and stopped as `changes` say), as
/// [`take_group`].
pub(super) async fn take_groups(
    broker: Arc<BrokerState>,
    js: jetstream::Context,
    names: Names,
    cfg: ClusterConfig,
    publisher: Arc<str>,
    mut changes: mpsc::UnboundedReceiver<GroupChange>,
    connected: tokio::sync::watch::Receiver<u64>,
) {
    // Unbounded, but each group's consumer hands out at most MAX_ACK_PENDING messages.
    let (ack_tx, ack_rx) = mpsc::unbounded_channel::<Ack>();
    let _acks = super::Forward(tokio::spawn(acknowledge(ack_rx)));
    let mut pulling: std::collections::HashMap<Arc<str>, super::Forward> = Default::default();
    while let Some((full, present)) = changes.recv().await {
        if !present {
            // What it took and had not given yet goes to another node after GROUP_ACK_WAIT.
            pulling.remove(&full);
            continue;
        }
        let task = tokio::spawn(take_group(
            Arc::clone(&broker),
            js.clone(),
            names.clone(),
            cfg.clone(),
            Arc::clone(&publisher),
            Arc::clone(&full),
            connected.clone(),
            ack_tx.clone(),
        ));
        pulling.insert(full, super::Forward(task));
    }
}

/// Sends the acknowledgements given, in order: `true` acknowledges, `false` has the message
/// delivered again at once.
async fn acknowledge(mut acks: mpsc::UnboundedReceiver<Ack>) {
    while let Some((acker, ok)) = acks.recv().await {
        let r = if ok {
            acker.ack().await
        } else {
            acker.ack_with(AckKind::Nak(None)).await
        };
        if let Err(e) = r {
            // JetStream delivers it again after its ack wait.
            tracing::debug!("cluster: acknowledging to JetStream: {e}");
        }
    }
}

/// Pulls the messages of the shared group `full` from its durable consumer (made by the
/// first node to need it), gives each to one member here (`BrokerState::give_to_group`)
/// and acknowledges it then (with `durable_ack`, once storage has committed it); a message
/// no member here takes is given back, for JetStream to give it again (to this node or
/// another with members), after a second.
#[allow(clippy::too_many_arguments)]
async fn take_group(
    broker: Arc<BrokerState>,
    js: jetstream::Context,
    names: Names,
    cfg: ClusterConfig,
    publisher: Arc<str>,
    full: Arc<str>,
    mut connected: tokio::sync::watch::Receiver<u64>,
    ack_tx: mpsc::UnboundedSender<Ack>,
) {
    let name = Names::group_consumer(&full);
    let stream_config = names.stream_config(&cfg);
    let config = consumer::pull::Config {
        durable_name: Some(name.clone()),
        description: Some(format!("mercurio shared subscription group {full}")),
        filter_subject: names.group_subject(&full),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: GROUP_ACK_WAIT,
        max_ack_pending: MAX_ACK_PENDING,
        deliver_policy: consumer::DeliverPolicy::All,
        inactive_threshold: GROUP_INACTIVE,
        ..Default::default()
    };
    let mut seen = dedup::Seen::default();
    let mut warned = Throttle::default();
    let mut congested = Vec::new();
    let mut backoff = Duration::from_millis(50);
    loop {
        let found = async {
            let stream = js
                .get_or_create_stream(stream_config.clone())
                .await
                .map_err(|e| e.to_string())?;
            stream
                .get_or_create_consumer::<consumer::pull::Config>(&name, config.clone())
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        let consumer = match found {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(consumer = %name, group = %full, "cluster: JetStream consumer not ready: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        connected.mark_unchanged();
        // One pull request at a time (not a continuous stream of them): the node holds no
        // more of the group's messages than GROUP_BATCH beyond what its members took.
        let mut errors = 0;
        while errors < 3 {
            let batch = consumer
                .batch()
                .max_messages(GROUP_BATCH)
                .expires(GROUP_PULL_WAIT)
                .messages()
                .await;
            let mut batch = match batch {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(consumer = %name, "cluster: JetStream: {e}");
                    errors += 1;
                    tokio::time::sleep(backoff).await;
                    continue;
                }
            };
            loop {
                let m = tokio::select! {
                    m = batch.next() => m,
                    // Reconnected: the consumer is looked up again (and made, after a NATS
                    // server started afresh).
                    Ok(()) = connected.changed() => {
                        errors = 3;
                        break;
                    }
                };
                let Some(m) = m else { break };
                let m = match m {
                    Ok(m) => {
                        errors = 0;
                        m
                    }
                    Err(e) => {
                        // As for the node's own consumer (take_in): after a few errors in a
                        // row (the consumer removed, a NATS server started afresh), looked up
                        // again.
                        tracing::debug!(consumer = %name, "cluster: JetStream: {e}");
                        errors += 1;
                        break;
                    }
                };
                let age = age_of(&m);
                let (m, acker) = m.split();
                let Some(msg) = receive_from(&broker, &publisher, &mut seen, &mut warned, &m, age)
                else {
                    let _ = ack_tx.send((acker, true));
                    continue;
                };
                let msg = Arc::new(msg);
                if !broker.give_to_group(&full, &msg, &mut congested) {
                    // No member here takes it (they left, or are full): given back, to be
                    // taken as new when it comes again.
                    given_back(&mut seen, &m.payload);
                    let later = AckKind::Nak(Some(Duration::from_secs(1)));
                    tokio::spawn(async move { acker.ack_with(later).await });
                    continue;
                }
                broker.wait_congested(None, &mut congested).await;
                acknowledge_after_commit(&broker, &ack_tx, acker);
            }
        }
        tokio::time::sleep(backoff).await;
    }
}

/// Acknowledges a message routed here: now, or with `durable_ack` once storage has
/// committed what routing stored (`false`, delivered again, when it could not).
fn acknowledge_after_commit(
    broker: &BrokerState,
    ack_tx: &mpsc::UnboundedSender<Ack>,
    acker: jetstream::message::Acker,
) {
    match broker.persist.get().filter(|p| p.durable_ack()) {
        Some(p) => {
            let tx = ack_tx.clone();
            p.after_commit(Box::new(move |held| {
                let _ = tx.send((acker, held));
            }));
        }
        None => {
            let _ = ack_tx.send((acker, true));
        }
    }
}

/// Forgets the message `payload` carries: given back undone, its next delivery is to be
/// taken as the first.
fn given_back(seen: &mut dedup::Seen, payload: &bytes::Bytes) {
    if let Ok(env) = Envelope::decode(payload.clone()) {
        seen.forget(env.origin, env.seq);
    }
}

/// Seconds since JetStream stored `m`, if it says.
fn age_of(m: &jetstream::Message) -> Option<u32> {
    m.info().ok().map(|i| {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        u32::try_from(now - i.published.unix_timestamp()).unwrap_or(0)
    })
}

/// [`receive`] for a message from a consumer.
fn receive_from(
    broker: &BrokerState,
    publisher: &Arc<str>,
    seen: &mut dedup::Seen,
    warned: &mut Throttle,
    m: &async_nats::Message,
    age: Option<u32>,
) -> Option<Message> {
    receive(broker, publisher, seen, warned, &m.subject, &m.payload, age)
}

/// The message a JetStream message carries, or `None` for a copy already taken or one that
/// cannot be read (counted, logged). `age`: seconds since JetStream stored it, taken off its
/// Message Expiry Interval.
pub(super) fn receive(
    broker: &BrokerState,
    publisher: &Arc<str>,
    seen: &mut dedup::Seen,
    warned: &mut Throttle,
    subject: &str,
    payload: &bytes::Bytes,
    age: Option<u32>,
) -> Option<Message> {
    let status = &broker.cluster;
    let mut env = envelope_of(status, warned, subject, payload.clone())?;
    if !seen.first(env.origin, env.seq) {
        ClusterStatus::add(&status.duplicates, 1);
        return None;
    }
    let Some(topic) = env.topic.take() else {
        unreadable(status, warned, subject, "a message without its topic");
        return None;
    };
    if !routable(status, warned, subject, &topic) {
        return None;
    }
    let expiry = match env.expiry {
        Some(left) => match left.checked_sub(age.unwrap_or(0)) {
            Some(left) if left > 0 => Some(left),
            // Expired while it waited in JetStream [MQTT-3.3.2-5].
            _ => return None,
        },
        None => None,
    };
    ClusterStatus::add(&status.jetstream_in, 1);
    Some(inbound_message(status, publisher, topic, env, expiry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_differing_settings_are_named_with_both_values() {
        let names = Names::new("mercurio");
        let ours = names.stream_config(&ClusterConfig::default());
        assert!(differing(&ours, &ours.clone()).is_empty());
        let theirs = stream::Config {
            num_replicas: 3,
            max_age: Duration::from_secs(60),
            // Not a `[cluster]` setting: not compared.
            description: Some("edited".into()),
            ..ours.clone()
        };
        assert_eq!(
            differing(&ours, &theirs),
            [
                format!(
                    "jetstream_replicas (this node {}, the stream 3)",
                    ours.num_replicas
                ),
                format!(
                    "jetstream_max_age (this node {}, the stream 60)",
                    ours.max_age.as_secs()
                ),
            ]
        );
    }
}
