//! Cluster mode (`[cluster]`, feature `cluster`): nodes serving one fleet route messages to
//! each other through NATS (docs/cluster.md). Below `handle`, which starts it with the broker
//! and stops it at shutdown.
//!
//! - Out: the link's own session, `$internal/cluster`, subscribes with No Local (so what the
//!   link brings in is not sent back) and Retain As Published to what other nodes want and to
//!   this node's shared groups' filters (`remote.rs`), no more; its queue is drained
//!   like any session's (`BrokerState::drain`: its limits, back pressure, drop counting) and
//!   each message is published on NATS on its topic's subject ([`subject::topic_subject`]) as
//!   an [`envelope::Envelope`]. NATS forwards it only to nodes subscribed to a matching
//!   subject, and never back to its publisher (the connection is `no_echo`).
//! - Interest: the filters this node's clients subscribe to (`interest`) become NATS
//!   subscriptions ([`subject::filter_subjects`]), added and removed as they change.
//! - In: a message from NATS is taken once ([`dedup::Seen`]), then routed to the local
//!   subscriptions that match it, as published by `$internal/cluster`; the RETAIN flag goes
//!   with it for Retain As Published; what is kept as the topic's retained message comes
//!   separately (`control.rs`: retained changes, heartbeats, on a third connection).
//! - Shared subscription groups: routing leaves their QoS 0 messages out in cluster mode;
//!   each group with members here is a NATS queue subscription (on a second connection,
//!   which receives this node's own messages too), so that NATS gives each message to one
//!   node with members, and that node to one member (`BrokerState::deliver_to_group`).
//!   Their QoS 1 and 2 messages go through JetStream when the group has members on another
//!   node (one durable consumer per group, `jetstream.rs`), else to a member here.
//!
//! Dependency: `async-nats`, the NATS client of the NATS project (recorded in the crate's
//! Cargo.toml).

mod control;
pub(crate) mod dedup;
pub mod envelope;
mod forward;
mod jetstream;
mod ownership;
mod recovery;
mod registry;
mod remote;
pub mod subject;
mod sweep;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use async_nats::ConnectOptions;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::broker::drain::{Outlet, Unsent};
use crate::broker::{BrokerState, CLUSTER_CLIENT_ID};
use crate::cluster_status::ClusterStatus;
use crate::codec::{ProtocolVersion, QoS};
use crate::error::Error;
use crate::interest::Key;
use crate::link::Link;
use crate::message::Message;
use crate::session::{Delivery, Session};
use envelope::Envelope;

/// The token, after the prefix, of the subject of topics too long for a subject of their own.
const LONG: &str = "long";

/// The longest subject a message is published on; a topic whose subject would be longer
/// travels in the envelope on `{prefix}.long`. NATS servers refuse a protocol line over
/// 4,096 bytes by default (`max_control_line`), and the line holds more than the subject.
pub const MAX_SUBJECT_LEN: usize = 2048;

/// Messages the NATS client holds per subscription for this node before it drops them as a
/// slow consumer.
const SUBSCRIPTION_CAPACITY: usize = 8192;

/// Messages taken from the link's queue per drain before they are published.
const OUT_BATCH: usize = 64;

/// The running cluster link: its tasks, and the NATS connection they share.
pub(crate) struct Cluster {
    tasks: Vec<JoinHandle<()>>,
    /// This node's heartbeat subject, for the last one, at stop.
    heartbeat_subject: String,
    /// The connection of the retained changes and heartbeats.
    control: async_nats::Client,
    /// This start's incarnation.
    origin: u64,
    client: async_nats::Client,
    /// The connection of the shared subscription groups' queue subscriptions.
    shares: async_nats::Client,
    /// The connection of QoS 1 and 2 between nodes (JetStream), with `jetstream` on.
    jetstream: Option<async_nats::Client>,
    session: Arc<Session>,
    link: Arc<Link>,
}

impl Cluster {
    /// Starts cluster mode when `[cluster] nats_urls` is set: connects to NATS (in the
    /// background: an unreachable NATS does not stop the broker from starting; the client
    /// retries), makes the link's session and starts the tasks.
    ///
    /// Errors: [`Error::File`] for a password or token file that cannot be read,
    /// [`Error::Config`] for a credentials file that cannot be used or an unusable NATS URL,
    /// [`Error::Cluster`] when the NATS client cannot be made.
    pub(crate) async fn start(broker: &Arc<BrokerState>) -> Result<Option<Cluster>, Error> {
        let cfg = &broker.config.cluster;
        if !cfg.enabled() {
            return Ok(None);
        }
        let prefix = cfg.prefix().to_string();
        let urls: Vec<async_nats::ServerAddr> = cfg
            .nats_urls
            .iter()
            .enumerate()
            .map(|(i, u)| {
                u.parse()
                    .map_err(|e| Error::Config(format!("cluster.nats_urls[{i}] {u:?}: {e}")))
            })
            .collect::<Result<_, _>>()?;
        let status = Arc::downgrade(broker);
        let link_log = Arc::new(LinkLog {
            urls: cfg.nats_urls.join(", "),
            ever_connected: AtomicBool::new(false),
            error_told: AtomicBool::new(false),
        });
        let options = connect_options(cfg, format!("mercurio {}", cfg.node_name))
            .await?
            .no_echo()
            .event_callback(move |event| {
                let status = status.clone();
                let link_log = Arc::clone(&link_log);
                async move { on_event(&status, &link_log, event) }
            });
        let client = options
            .connect(urls.clone())
            .await
            .map_err(|e| Error::Cluster(format!("connecting to NATS: {e}")))?;
        // Shared subscription groups' queue subscriptions, on a connection of their own that
        // receives this node's own messages too: NATS chooses one member node per group among
        // all of them, this one included.
        let shares = connect_options(cfg, format!("mercurio {} shares", cfg.node_name))
            .await?
            .event_callback(|event| async move {
                if !matches!(event, async_nats::Event::Connected) {
                    tracing::debug!("cluster: NATS (shared subscriptions): {event}");
                }
            })
            .connect(urls.clone())
            .await
            .map_err(|e| Error::Cluster(format!("connecting to NATS: {e}")))?;
        // Retained changes and heartbeats, on a third connection (no echo): apart from the
        // routed messages, and asking for the retained messages it missed at each (re)connection.
        let connects = Arc::downgrade(broker);
        let control_client = connect_options(cfg, format!("mercurio {} control", cfg.node_name))
            .await?
            .no_echo()
            .event_callback(move |event| {
                let connects = connects.clone();
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            if let Some(b) = connects.upgrade() {
                                b.cluster.connects.notify_one();
                            }
                        }
                        other => tracing::debug!("cluster: NATS (control): {other}"),
                    }
                }
            })
            .connect(urls.clone())
            .await
            .map_err(|e| Error::Cluster(format!("connecting to NATS: {e}")))?;
        broker.cluster.enabled.store(true, Ordering::Relaxed);
        tracing::info!(node = %cfg.node_name, urls = ?cfg.nats_urls, "cluster mode: connecting to NATS");

        let id: Arc<str> = Arc::from(CLUSTER_CLIENT_ID);
        let (session, _) = broker.internal_session(&id);
        let link = Arc::new(Link::new());
        session.attach(&link, ProtocolVersion::V5, u32::MAX, &mut None);
        // The link subscribes to what other nodes want, and to this node's shared groups
        // (remote.rs), no more.
        let link_filters = Arc::new(remote::LinkFilters::new(Arc::clone(&session)));
        let origin = incarnation();
        // Retained messages held before the start (from storage) are older than any change
        // made in the cluster.
        let mut held = Vec::new();
        broker
            .retained
            .lock()
            .for_each_matching("#", |m: &Arc<Message>| held.push(m.topic.clone()));
        broker.cluster.retained.start(&cfg.node_name, held);
        let subjects = control::Subjects::new(&prefix, &cfg.node_name);
        let heartbeat_subject = subjects.heartbeat_subject().to_string();
        let control = tokio::spawn(control::run(
            Arc::clone(broker),
            control_client.clone(),
            subjects,
            origin,
            Arc::clone(&id),
            Arc::clone(&link_filters),
        ));
        // Sessions across nodes: this node's CONNECTs ask the others, and it answers theirs.
        let _ = broker.other_nodes.set(Arc::new(ownership::NatsNodes::new(
            broker,
            control_client.clone(),
            &prefix,
        )));
        // Where QoS 1 and 2 messages of sessions handed over go (used with JetStream).
        let forwards = Arc::new(forward::Forwards::default());
        let sessions = tokio::spawn(ownership::serve(
            Arc::clone(broker),
            control_client.clone(),
            prefix.clone(),
            cfg.jetstream_on().then(|| Arc::clone(&forwards)),
        ));
        let out = tokio::spawn(send_out(
            Arc::clone(broker),
            Arc::clone(&session),
            Arc::clone(&link),
            client.clone(),
            prefix.clone(),
            origin,
        ));
        let mut tasks = vec![out, control, sessions];
        let mut jetstream_client = None;
        // This node's shared groups, told to the JetStream task that pulls their messages.
        let mut group_changes = None;
        if cfg.jetstream_on() {
            // QoS 1 and 2 between nodes through JetStream (jetstream.rs): the broker hands
            // off what other nodes want; this node reads its own durable consumer.
            // On a connection of its own: its inboxes (publish acknowledgements, the
            // consumer's pulls) stay apart from the routed messages' subjects.
            // Each (re)connection is told to the tasks: the NATS server may have started
            // afresh, without the stream and the consumer.
            let (connected_tx, connected) = tokio::sync::watch::channel(0u64);
            let js_client = connect_options(cfg, format!("mercurio {} jetstream", cfg.node_name))
                .await?
                .event_callback(move |event| {
                    let connected_tx = connected_tx.clone();
                    async move {
                        match event {
                            async_nats::Event::Connected => {
                                connected_tx.send_modify(|n| *n += 1);
                            }
                            other => tracing::debug!("cluster: NATS (JetStream): {other}"),
                        }
                    }
                })
                .connect(urls.clone())
                .await
                .map_err(|e| Error::Cluster(format!("connecting to NATS: {e}")))?;
            let js = jetstream::context(js_client.clone());
            jetstream_client = Some(js_client);
            // One owner per persistent session (registry.rs): the bucket made or found at
            // each connection, then this node's sessions checked against it; the wills due
            // at start wait for that, `takeover_timeout` at most.
            let registry = Arc::new(registry::Registry::new(broker));
            let _ = broker.registry.set(Arc::clone(&registry) as _);
            tasks.push(tokio::spawn(registry::release_held_wills_after(
                Arc::clone(broker),
                cfg.takeover(),
            )));
            let mut registry_connected = connected.clone();
            let (registry_broker, registry_js, registry_prefix) =
                (Arc::clone(broker), js.clone(), prefix.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    // At each connection to NATS, and once the registry answers again after
                    // failing while NATS was reachable (a partition healed, say).
                    tokio::select! {
                        changed = registry_connected.changed() => {
                            if changed.is_err() {
                                return;
                            }
                        }
                        () = registry.recheck.notified() => {}
                    }
                    registry::ensure(
                        Arc::clone(&registry_broker),
                        Arc::clone(&registry),
                        registry_js.clone(),
                        registry_prefix.clone(),
                    )
                    .await;
                }
            }));
            let names = jetstream::Names::new(&prefix);
            let (tx, rx) = mpsc::unbounded_channel();
            broker.cluster_qos.start(
                tx,
                cfg.jetstream_max_pending_bytes(),
                cfg.jetstream_ack_timeout(),
            );
            tasks.push(tokio::spawn(jetstream::send(
                Arc::clone(broker),
                js.clone(),
                rx,
                names.clone(),
                cfg.clone(),
                origin,
                connected.clone(),
            )));
            let (groups_tx, groups_rx) = mpsc::unbounded_channel();
            group_changes = Some(groups_tx);
            tasks.push(tokio::spawn(jetstream::take_groups(
                Arc::clone(broker),
                js.clone(),
                names.clone(),
                cfg.clone(),
                Arc::clone(&id),
                groups_rx,
                connected.clone(),
            )));
            tasks.push(tokio::spawn(jetstream::take_in(
                Arc::clone(broker),
                js,
                names,
                cfg.clone(),
                Arc::clone(&id),
                forwards,
                connected,
            )));
        }
        tasks.push(tokio::spawn(take_in(
            Arc::clone(broker),
            Arc::clone(&session),
            client.clone(),
            shares.clone(),
            prefix,
            link_filters,
            group_changes,
        )));
        Ok(Some(Cluster {
            tasks,
            jetstream: jetstream_client,
            heartbeat_subject,
            origin,
            control: control_client,
            client,
            shares,
            session,
            link,
        }))
    }

    /// Stops the link: its tasks end, its session is ended, and the NATS connection is
    /// flushed (what was handed to it goes out) and closed.
    pub(crate) async fn stop(&self, broker: &BrokerState) {
        for t in &self.tasks {
            t.abort();
        }
        self.link.kill(
            crate::link::DisconnectReason::Shutdown,
            crate::codec::ReasonCode::SERVER_SHUTTING_DOWN,
        );
        broker.end_session(&self.session);
        // Bounded: with NATS unreachable neither would end.
        let grace = std::time::Duration::from_secs(2);
        // The others show this node as gone at once.
        let leaving = control::announce(
            broker,
            &self.control,
            &self.heartbeat_subject,
            self.origin,
            true,
        );
        let _ = tokio::time::timeout(grace, leaving).await;
        let _ = tokio::time::timeout(grace, self.control.drain()).await;
        let _ = tokio::time::timeout(grace, self.client.flush()).await;
        let _ = tokio::time::timeout(grace, self.client.drain()).await;
        let _ = tokio::time::timeout(grace, self.shares.drain()).await;
        if let Some(js) = &self.jetstream {
            let _ = tokio::time::timeout(grace, js.drain()).await;
        }
        broker.cluster.connected.store(false, Ordering::Relaxed);
    }
}

/// The options both NATS connections share: name, reconnection, subscription capacity,
/// credentials and TLS.
async fn connect_options(
    cfg: &crate::config::ClusterConfig,
    name: String,
) -> Result<ConnectOptions, Error> {
    let mut options = ConnectOptions::new()
        .name(name)
        .retry_on_initial_connect()
        .subscription_capacity(SUBSCRIPTION_CAPACITY);
    if let Some(path) = &cfg.credentials_file {
        options = options.credentials_file(path).await.map_err(|e| {
            Error::Config(format!("cluster.credentials_file {}: {e}", path.display()))
        })?;
    }
    if let (Some(user), Some(path)) = (&cfg.username, &cfg.password_file) {
        let password = crate::credentials::read_secret(path, "cluster.password_file")?;
        options = options.user_and_password(user.clone(), password);
    }
    if let Some(path) = &cfg.token_file {
        options = options.token(crate::credentials::read_secret(path, "cluster.token_file")?);
    }
    if let Some(ca) = &cfg.ca_file {
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&cfg.cert_file, &cfg.key_file) {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(options)
}

/// A random number for this start of this node: the origin of the messages it publishes,
/// so that numbering starts afresh at each start without being taken for copies.
fn incarnation() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // No randomness (hardly ever): the clock's nanoseconds differ between starts too.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return t.as_nanos() as u64;
    }
    u64::from_be_bytes(b)
}

/// What the NATS events' log lines need to remember between events.
struct LinkLog {
    /// `cluster.nats_urls`, for the lines that say what could not be reached.
    urls: String,
    ever_connected: AtomicBool,
    /// An error was logged as a warning since the last connection: the next ones, one per
    /// reconnection attempt, go to the debug level.
    error_told: AtomicBool,
}

/// The NATS client's events, into the link's state and counters and the log.
fn on_event(broker: &Weak<BrokerState>, log: &LinkLog, event: async_nats::Event) {
    let Some(broker) = broker.upgrade() else {
        return;
    };
    let status: &ClusterStatus = &broker.cluster;
    match event {
        async_nats::Event::Connected => {
            status.connected.store(true, Ordering::Relaxed);
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            status.connected_since.store(now, Ordering::Relaxed);
            log.error_told.store(false, Ordering::Relaxed);
            if log.ever_connected.swap(true, Ordering::Relaxed) {
                ClusterStatus::add(&status.reconnects, 1);
                tracing::info!("cluster: reconnected to NATS");
            } else {
                tracing::info!("cluster: connected to NATS");
            }
        }
        async_nats::Event::Disconnected => {
            status.connected.store(false, Ordering::Relaxed);
            tracing::warn!("cluster: disconnected from NATS; reconnecting");
        }
        async_nats::Event::SlowConsumer(_) => {
            ClusterStatus::add(&status.slow_consumer, 1);
            tracing::warn!("cluster: NATS dropped messages for this node (slow consumer)");
        }
        async_nats::Event::ClientError(e) => {
            let urls = &log.urls;
            if log.error_told.swap(true, Ordering::Relaxed) {
                tracing::debug!("cluster: NATS ({urls}): {e}");
            } else {
                tracing::warn!("cluster: NATS ({urls}): {e}; retrying (further errors at the debug level until connected)");
            }
        }
        // The node drains and closes its NATS connections when it stops: nothing wrong then.
        e @ (async_nats::Event::Draining | async_nats::Event::Closed)
            if broker.is_shutting_down() =>
        {
            tracing::info!("cluster: NATS: {e} (stopping)")
        }
        other => tracing::warn!("cluster: NATS: {other}"),
    }
}

/// The link's session as the drain's [`Outlet`]: it acknowledges nothing (every message
/// leaves the session as it is handed over), taking up to [`OUT_BATCH`] per drain.
struct Batch {
    messages: Vec<(Arc<Message>, QoS, bool)>,
}

impl Outlet for Batch {
    fn window(&self) -> Option<usize> {
        None
    }

    fn has_room(&self) -> bool {
        self.messages.len() < OUT_BATCH
    }

    fn send(&mut self, q: &Delivery, _: u16, _: bool, _: Instant) -> Result<(), Unsent> {
        self.messages.push((Arc::clone(&q.msg), q.qos, q.retain));
        Ok(())
    }

    fn release(&mut self, _: u16) {}
}

/// Out: drains the link's session and publishes each message on NATS. While the NATS
/// client's buffer is full (NATS down, or slower than the node) this waits, the session's
/// queue fills, and its limits apply as to any slow subscriber.
async fn send_out(
    broker: Arc<BrokerState>,
    session: Arc<Session>,
    link: Arc<Link>,
    client: async_nats::Client,
    prefix: String,
    origin: u64,
) {
    let status = &broker.cluster;
    let long_subject = format!("{prefix}.{LONG}");
    let mut seq = 0u64;
    let mut warned = Throttle::default();
    let mut batch = Batch {
        messages: Vec::with_capacity(OUT_BATCH),
    };
    loop {
        let killed = tokio::select! {
            _ = link.wait_woken() => false,
            _ = link.wait_killed() => true,
        };
        loop {
            let drained = broker.drain(&session, &mut batch);
            let now = Instant::now();
            for (msg, qos, retain) in batch.messages.drain(..) {
                // QoS 1 and 2 go to the other nodes and to shared groups through JetStream
                // (jetstream.rs).
                if qos != QoS::AtMostOnce && broker.cluster_qos.is_on() {
                    continue;
                }
                seq += 1;
                let mut subject = subject::topic_subject(&prefix, &msg.topic);
                let mut topic = None;
                if subject.len() > MAX_SUBJECT_LEN {
                    subject.clone_from(&long_subject);
                    topic = Some(msg.topic.clone());
                }
                let envelope = Envelope {
                    origin,
                    seq,
                    qos,
                    retain,
                    expiry: msg.remaining_expiry(now),
                    properties: msg.properties.clone(),
                    topic,
                    payload: msg.payload.clone(),
                };
                let sent = match envelope.encode() {
                    Ok(bytes) => client
                        .publish(subject, bytes)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                match sent {
                    Ok(()) => {
                        ClusterStatus::add(&status.messages_out, 1);
                        ClusterStatus::add(&status.bytes_out, msg.payload.len() as u64);
                    }
                    Err(e) => {
                        ClusterStatus::add(&status.errors, 1);
                        if warned.due() {
                            tracing::warn!(topic = %msg.topic, "cluster: message not sent to NATS (counted in cluster/messages/errors; at most one warning a minute): {e}");
                        } else {
                            tracing::debug!(topic = %msg.topic, "cluster: message not sent to NATS: {e}");
                        }
                    }
                }
            }
            if !drained.more {
                break;
            }
        }
        if killed {
            return;
        }
    }
}

/// A message from NATS, with the shared subscription group (its full filter) whose queue
/// subscription brought it, or `None` for an ordinary subscription's.
type Inbound = (Option<Arc<str>>, async_nats::Message);

/// In: keeps this node's NATS subscriptions in step with its interest, and routes what they
/// bring.
async fn take_in(
    broker: Arc<BrokerState>,
    session: Arc<Session>,
    client: async_nats::Client,
    shares: async_nats::Client,
    prefix: String,
    link_filters: Arc<remote::LinkFilters>,
    group_changes: Option<mpsc::UnboundedSender<jetstream::GroupChange>>,
) {
    let (tx, mut rx) = mpsc::channel::<Inbound>(1024);
    // QoS 1 and 2 messages of a group come through JetStream (jetstream.rs), for as long as
    // it has members here.
    let tell_group = |full: &str, present: bool| {
        if let Some(tx) = &group_changes {
            let _ = tx.send((Arc::from(full), present));
        }
    };
    // Subject -> (filters needing it, the task forwarding its messages).
    let mut subs: HashMap<String, (usize, Forward)> = HashMap::new();
    // The filters subscribed to on NATS.
    let mut filters: std::collections::HashSet<String> = Default::default();
    // Shared subscription group (full filter) -> its queue subscriptions.
    let mut groups: HashMap<String, Vec<Forward>> = HashMap::new();
    let mut seen = dedup::Seen::default();
    let mut warned = Throttle::default();
    let long_subject = format!("{prefix}.{LONG}");
    subscribe(&client, &long_subject, &tx, &mut subs).await;
    let mut congested = Vec::new();
    loop {
        // Changes first: a filter subscribed before a message arrives gets it.
        for (key, present) in broker.interest.take() {
            match key {
                Key::Filter(filter) => {
                    // A filter gone and back (or back and gone) between two takes is no
                    // change.
                    let changed = if present {
                        filters.insert(filter.clone())
                    } else {
                        filters.remove(&filter)
                    };
                    if !changed {
                        continue;
                    }
                    // Told to the other nodes (control.rs).
                    broker
                        .cluster
                        .interest
                        .lock()
                        .change(filter.clone(), present);
                    broker.cluster.interest_wake.notify_one();
                    for s in subject::filter_subjects(&prefix, &filter) {
                        if present {
                            subscribe(&client, &s, &tx, &mut subs).await;
                        } else if let Some((n, _)) = subs.get_mut(&s) {
                            *n -= 1;
                            if *n == 0 {
                                // Dropping the forwarding task (and its subscriber)
                                // unsubscribes.
                                subs.remove(&s);
                            }
                        }
                    }
                }
                Key::Group(full) if present => {
                    if let std::collections::hash_map::Entry::Vacant(e) = groups.entry(full) {
                        // Its messages go through NATS, from this node too: the link takes
                        // them; and the other nodes are told.
                        link_filters.add(&broker, e.key());
                        broker.cluster_qos.want("", e.key(), true);
                        broker.cluster.interest.lock().change(e.key().clone(), true);
                        broker.cluster.interest_wake.notify_one();
                        tell_group(e.key(), true);
                        let forwards = subscribe_group(&shares, &prefix, e.key(), &tx).await;
                        e.insert(forwards);
                    }
                }
                Key::Group(full) => {
                    if groups.remove(&full).is_some() {
                        tell_group(&full, false);
                        link_filters.remove(&broker, &full);
                        broker.cluster_qos.want("", &full, false);
                        broker.cluster.interest.lock().change(full, false);
                        broker.cluster.interest_wake.notify_one();
                    }
                }
            }
        }
        let count = subs.len() + groups.values().map(Vec::len).sum::<usize>();
        broker
            .cluster
            .subscriptions
            .store(count as u64, Ordering::Relaxed);
        let (group, m) = tokio::select! {
            biased;
            _ = broker.interest.changed() => continue,
            m = rx.recv() => match m {
                Some(m) => m,
                None => return,
            },
        };
        let Some(msg) = receive(
            &broker,
            &session.client_id,
            &prefix,
            &long_subject,
            group.as_deref(),
            &mut seen,
            &mut warned,
            m,
        ) else {
            continue;
        };
        let msg = Arc::new(msg);
        match &group {
            Some(full) => broker.deliver_to_group(full, &msg, &mut congested),
            None => {
                broker.route_from(&msg, &mut congested);
            }
        }
        broker.wait_congested(Some(&session), &mut congested).await;
    }
}

/// The queue subscriptions of the shared subscription group `full`
/// (`$share/{ShareName}/{filter}`): its filter's subjects and the subject of long topics,
/// in the queue group named after it ([`subject::queue_group`]), so that NATS gives each
/// message to one of the nodes with members.
async fn subscribe_group(
    shares: &async_nats::Client,
    prefix: &str,
    full: &str,
    tx: &mpsc::Sender<Inbound>,
) -> Vec<Forward> {
    let Ok(Some(shared)) = crate::topic::parse_shared(full) else {
        return Vec::new();
    };
    let queue = subject::queue_group(full);
    let group: Arc<str> = Arc::from(full);
    let mut subjects = subject::filter_subjects(prefix, shared.filter);
    subjects.push(format!("{prefix}.{LONG}"));
    let mut forwards = Vec::with_capacity(subjects.len());
    for s in subjects {
        match shares.queue_subscribe(s.clone(), queue.clone()).await {
            Ok(sub) => forwards.push(forward(sub, Some(Arc::clone(&group)), tx)),
            Err(e) => {
                tracing::warn!(
                    subject = s,
                    group = full,
                    "cluster: cannot subscribe on NATS: {e}"
                )
            }
        }
    }
    forwards
}

/// Adds one filter's need for `subject`, subscribing on NATS when it is the first.
async fn subscribe(
    client: &async_nats::Client,
    subject: &str,
    tx: &mpsc::Sender<Inbound>,
    subs: &mut HashMap<String, (usize, Forward)>,
) {
    if let Some((n, _)) = subs.get_mut(subject) {
        *n += 1;
        return;
    }
    match client.subscribe(subject.to_string()).await {
        Ok(sub) => {
            subs.insert(subject.to_string(), (1, forward(sub, None, tx)));
        }
        Err(e) => {
            // Only a closed client refuses (it buffers while disconnected).
            tracing::warn!(subject, "cluster: cannot subscribe on NATS: {e}");
        }
    }
}

/// Forwards a NATS subscription's messages into the inbound channel, tagged with `group`.
fn forward(
    mut sub: async_nats::Subscriber,
    group: Option<Arc<str>>,
    tx: &mpsc::Sender<Inbound>,
) -> Forward {
    let tx = tx.clone();
    Forward(tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if tx.send((group.clone(), m)).await.is_err() {
                return;
            }
        }
    }))
}

/// The message a NATS message carries, or `None` for a copy already taken, one that cannot
/// be read (counted, logged), or, for a shared subscription `group`, a message on the subject
/// of long topics that its filter does not match.
#[allow(clippy::too_many_arguments)]
fn receive(
    broker: &BrokerState,
    publisher: &Arc<str>,
    prefix: &str,
    long_subject: &str,
    group: Option<&str>,
    seen: &mut dedup::Seen,
    warned: &mut Throttle,
    m: async_nats::Message,
) -> Option<Message> {
    let status = &broker.cluster;
    let mut env = envelope_of(status, warned, &m.subject, m.payload)?;
    // With JetStream, QoS 1 and 2 messages for this node's subscriptions come through
    // JetStream (jetstream.rs); NATS core brings them here only for a shared group.
    if group.is_none() && env.qos != QoS::AtMostOnce && broker.cluster_qos.is_on() {
        return None;
    }
    // A group's queue subscriptions never overlap (a filter's subjects match disjoint
    // subjects): only ordinary subscriptions bring copies.
    if group.is_none() && !seen.first(env.origin, env.seq) {
        ClusterStatus::add(&status.duplicates, 1);
        return None;
    }
    let topic = match env.topic.take() {
        Some(t) if *m.subject == *long_subject => t,
        _ => match subject::subject_topic(prefix, &m.subject) {
            Ok(t) => t,
            Err(e) => {
                unreadable(
                    status,
                    warned,
                    &m.subject,
                    &format!("unreadable subject: {e}"),
                );
                return None;
            }
        },
    };
    if !routable(status, warned, &m.subject, &topic) {
        return None;
    }
    if let Some(full) = group {
        let matches = matches!(
            crate::topic::parse_shared(full),
            Ok(Some(shared)) if crate::topic::matches(shared.filter, &topic)
        );
        if !matches {
            return None;
        }
    }
    let expiry = env.expiry;
    Some(inbound_message(status, publisher, topic, env, expiry))
}

/// Whether `topic`, from another node, may be routed here: a valid topic name, not a `$`
/// topic; if not, it is counted and logged.
fn routable(status: &ClusterStatus, warned: &mut Throttle, subject: &str, topic: &str) -> bool {
    if crate::topic::validate_topic_name(topic).is_err() || topic.starts_with('$') {
        let what = format!("a message on {topic:?}, a topic not routed between nodes");
        unreadable(status, warned, subject, &what);
        return false;
    }
    true
}

/// The message `env` from another node carries, on `topic` with `expiry` seconds left, as
/// published by the link's session `publisher` (No Local keeps it from going back out);
/// counted in.
fn inbound_message(
    status: &ClusterStatus,
    publisher: &Arc<str>,
    topic: String,
    env: Envelope,
    expiry: Option<u32>,
) -> Message {
    ClusterStatus::add(&status.messages_in, 1);
    ClusterStatus::add(&status.bytes_in, env.payload.len() as u64);
    Message {
        topic,
        payload: env.payload,
        qos: env.qos,
        retain: env.retain,
        properties: env.properties,
        expires_at: Message::expiry_deadline(expiry, Instant::now()),
        publisher: Some(Arc::clone(publisher)),
        source: None,
        encoded: Default::default(),
        stored: Default::default(),
    }
}

/// Counts a message from NATS that cannot be routed, and logs it (a warning at most once a
/// minute, debug otherwise).
/// The envelope of a message from NATS on `subject`, or `None` when it cannot be read (counted
/// in `cluster/messages/errors` and logged, as [`unreadable`]).
fn envelope_of(
    status: &ClusterStatus,
    warned: &mut Throttle,
    subject: &str,
    payload: bytes::Bytes,
) -> Option<Envelope> {
    match Envelope::decode(payload) {
        Ok(env) => Some(env),
        Err(e) => {
            unreadable(status, warned, subject, &format!("unreadable message: {e}"));
            None
        }
    }
}

fn unreadable(status: &ClusterStatus, warned: &mut Throttle, subject: &str, what: &str) {
    ClusterStatus::add(&status.errors, 1);
    if warned.due() {
        tracing::warn!(subject, "cluster: from NATS, {what} (counted in cluster/messages/errors; at most one warning a minute)");
    } else {
        tracing::debug!(subject, "cluster: from NATS, {what}");
    }
}

/// At most one warning a minute for a kind of error that may come with every message; the
/// others are logged at debug level (the counters count them all).
#[derive(Default)]
struct Throttle {
    last: Option<Instant>,
}

impl Throttle {
    /// Whether a warning is due now (and then none is for a minute).
    fn due(&mut self) -> bool {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < std::time::Duration::from_secs(60))
        {
            return false;
        }
        self.last = Some(now);
        true
    }
}

/// The task forwarding one NATS subscription's messages into the inbound channel; dropping
/// it ends the task, whose subscriber then unsubscribes.
struct Forward(JoinHandle<()>);

impl Drop for Forward {
    fn drop(&mut self) {
        self.0.abort();
    }
}
