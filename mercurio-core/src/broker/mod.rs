//! The broker's shared state and the operations on it that are not tied to one connection:
//! routing a message to the sessions whose subscriptions match, retained messages, taking a
//! session over at CONNECT, ending it at DISCONNECT or expiry, and wills.

pub(crate) mod access;
mod backlog;
pub(crate) mod drain;
mod entry;
pub(crate) mod handover;
mod memory_bound;
pub(crate) mod restore;
mod shared;
mod stream_reader;
mod takeover;

pub(crate) use entry::message_of;
pub(crate) use stream_reader::ReaderStart;
pub(crate) use takeover::{Owner, TakeError};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use crate::codec::{QoS, ReasonCode};
use crate::config::Config;
use crate::events::Event;
use crate::link::{DisconnectReason, Link};
use crate::message::Message;
use crate::observe::RetainedChange;
use crate::router::{RetainedStore, SubscriptionIndex};
use crate::session::{
    Delivery, Detached, Ended, Enqueued, Granted, QueueLimits, Session, SessionTable,
};
use crate::stats::{Counters, DropCause};

/// Client identifier prefix of in-process subscriptions' sessions.
pub(crate) const INTERNAL_PREFIX: &str = "$internal/";

/// The client identifier of the cluster link's session (`cluster`).
pub(crate) const CLUSTER_CLIENT_ID: &str = "$internal/cluster";

/// A change of the retained set to report to the embedding application's callback
/// ([`BrokerState::retain_quietly`]).
pub(crate) enum RetainedNotice {
    /// The topic's retained message is now this one.
    Set(Arc<Message>),
    /// The topic's retained message was deleted.
    Cleared(String),
}

/// What the subscription index holds for each subscription.
#[derive(Debug, Clone)]
pub(crate) struct SubEntry {
    pub session: Arc<Session>,
    pub granted: Granted,
}

/// Everything the connections, listeners, timers and handles share.
pub(crate) struct BrokerState {
    pub config: Config,
    pub limits: QueueLimits,
    /// The bytes every session's queue holds, and `max_queued_memory` (`queued_memory`,
    /// `memory_bound.rs`); each session's queue holds it.
    pub queued_memory: Arc<crate::queued_memory::QueuedMemory>,
    /// Held by the publisher releasing queues to storage for `max_queued_memory`
    /// (`memory_bound.rs`), one at a time.
    /// Lock: an async mutex, taken with no lock held and held across the wait for the
    /// storage writer's commit; under it, the session table, then each session's state in
    /// turn (never both).
    pub(crate) releasing: tokio::sync::Mutex<()>,
    /// Shared with the storage writer, which writes a session whole after a failure.
    /// Lock: first in the lock order, taken with no other lock held; a session's `state`
    /// and `identity` may be taken under it (ARCHITECTURE.md, "Concurrency model and lock
    /// order").
    pub sessions: Arc<SessionTable>,
    /// Lock: taken with no session lock held (routing collects its matches and releases it
    /// before delivering; `subscribe` and `end_session` change the session first); only
    /// leaf locks may be taken under it.
    pub index: RwLock<SubscriptionIndex<SubEntry>>,
    /// The retained messages, weighed by [`Message::size`] for `max_retained_bytes`.
    /// Lock: taken with no session lock held; held while its change is emitted to storage
    /// (`Persister::emit`, which takes only leaf locks), to keep the retained set's changes
    /// in order.
    pub retained: Mutex<RetainedStore<Arc<Message>>>,
    /// Set when a retained message was not kept for a limit (`max_retained_messages`,
    /// `max_retained_bytes`), cleared once the retained set is back under half of both: the
    /// warning is logged once per such episode, not per message.
    retained_full: AtomicBool,
    /// Retained `$SYS` messages: in memory only, never counted as retained messages.
    /// Lock: a leaf, taken with no session lock held and nothing taken under it.
    pub sys_retained: Mutex<RetainedStore<Arc<Message>>>,
    /// Shared with the storage writer, which counts its batches.
    pub stats: Arc<Counters>,
    pub started: Instant,
    pub shutting_down: AtomicBool,
    /// Open network connections (accepted sockets not yet closed).
    pub open_connections: AtomicUsize,
    /// Signalled each time a connection closes, for shutdown to wait on.
    pub connection_closed: Notify,
    /// Signalled once when shutdown starts, to stop the listeners.
    pub stop_listeners: Notify,
    /// Lock: a leaf (nothing is taken under it; any lock may be held).
    pub local_addrs: Mutex<Vec<SocketAddr>>,
    /// Listeners whose accept loop runs (`listener::run`), for `/readyz`.
    pub listeners_accepting: AtomicUsize,
    /// Why storage failed (`Storage::failed`: leadership lost, fenced, database gone), set
    /// once by the failure watch in `handle`, for `/readyz`.
    pub storage_failed: OnceLock<String>,
    /// Numbers the in-process subscriptions' client identifiers (`handle`).
    pub next_client_number: AtomicU64,
    /// The storage writer, when the broker has a storage backend (`persist`).
    pub persist: OnceLock<Arc<crate::persist::Persister>>,
    /// Authentication and access control (`auth` module); set by the builder.
    pub auth: crate::auth::Auth,
    /// Lifecycle events for the embedding application (`events`).
    pub events: crate::events::Events,
    /// Publish interceptors (`intercept`), in the order they were added; set by the builder.
    pub interceptors: Vec<Arc<dyn crate::intercept::PublishInterceptor>>,
    /// SUBSCRIBE interceptors (`intercept`), in the order they were added; set by the
    /// builder.
    pub subscribe_interceptors: Vec<Arc<dyn crate::intercept::SubscribeInterceptor>>,
    /// The application's callbacks (`observe`); set by the builder.
    pub observers: crate::observe::Observers,
    /// The configured bridges' states and counters (`bridge` module), for `$SYS` and metrics.
    /// Lock: a leaf (nothing is taken under it; any lock may be held).
    pub bridges: Mutex<Vec<Arc<crate::bridge_status::BridgeStatus>>>,
    /// The chains of listeners with their own authentication settings, by listener index
    /// (`None`: `auth` applies); set by the builder.
    pub listener_auth: Vec<Option<crate::auth::Auth>>,
    /// Whether any chain (`auth` or a listener's) checks access; false makes every check free.
    pub checks_access: bool,
    /// The users, groups and roles kept in storage (`[auth] backend = "storage"`), shared by
    /// every chain; set by the builder.
    pub(crate) stored_access: Option<Arc<crate::auth::stored::StoredAccess>>,
    /// The connections' keep alive deadlines and their sweep (`keep_alive`).
    pub keep_alive: Arc<crate::keep_alive::KeepAlive>,
    /// The parked connections and what resumes them (`parking`, `connection::park`), started by the
    /// first connection to park (`None` when it cannot be).
    pub parking: OnceLock<Option<Arc<crate::parking::Parking>>>,
    /// The shards serving connections when there is more than one thread (`shards`);
    /// `None`: every task runs in the runtime that started the broker.
    pub shards: Option<Arc<crate::Shards>>,
    /// Network activity, and the task that polls instead of sleeping while it comes close
    /// together (`busy_poll`); started by the builder.
    pub busy_poll: Arc<crate::busy_poll::BusyPoll>,
    /// The streams of `[[streams]]` and their readers (`streams`, `stream_reader.rs`).
    pub streams: crate::streams::Streams,
    /// The restored messages, held while restored sessions' backlogs are left in storage
    /// (`backlog.rs`).
    pub(crate) held: backlog::HeldMessages,
    /// Messages read back for backlogs released while running, shared while queues hold
    /// them (`backlog.rs`).
    pub(crate) fetched: backlog::FetchedMessages,
    /// This state's own `Arc`, for the work it hands to a task of its own (a will to
    /// intercept); set where the `Arc` is made (`Arc::new_cyclic`), empty before.
    pub this: std::sync::Weak<BrokerState>,
    /// The filters this node's clients subscribe to, for cluster mode (`interest`).
    /// Lock: a leaf, taken under the index's.
    pub interest: crate::interest::Interest,
    /// The cluster link's state and counters (`cluster_status`), for `$SYS` and metrics.
    pub cluster: crate::cluster_status::ClusterStatus,
    /// QoS 1 and 2 messages handed to the cluster's JetStream stream (`cluster_qos`); off
    /// unless cluster mode runs with `jetstream`.
    pub(crate) cluster_qos: crate::cluster_qos::ClusterQos,
    /// In cluster mode, the other nodes a CONNECT asks for its client identifier's session
    /// (`handover.rs`); set once by the cluster link at its start, empty otherwise.
    pub(crate) other_nodes: OnceLock<Arc<dyn handover::OtherNodes>>,
    /// In cluster mode with JetStream, the registry of which node owns each persistent
    /// session (`handover.rs`); set once by the cluster link at its start, empty otherwise.
    pub(crate) registry: OnceLock<Arc<dyn handover::SessionRegistry>>,
    /// The CONNECTs of one client identifier that claim its session in the registry, one at
    /// a time on this node (`takeover.rs`).
    pub(crate) claiming: takeover::Claiming,
    /// The wills due at start, held until the registry is asked (cluster mode with
    /// JetStream), given out at once otherwise.
    pub(crate) held_wills: handover::HeldWills,
}

/// The QoS a message published at `published` goes out at through a subscription granted
/// `granted`: the lower of the two [MQTT-3.8.4-6] (3.1.1), 5.0 section 3.8.4; with
/// `upgrade_outgoing_qos` (`upgrade`), the subscription's, which departs from the
/// specification as mosquitto's option of that name does.
#[inline]
pub(crate) fn outgoing_qos(published: QoS, granted: QoS, upgrade: bool) -> QoS {
    if upgrade {
        granted
    } else {
        published.min(granted)
    }
}

/// What one client gets of `msg` through its matching subscriptions `cm`: one copy at the
/// highest QoS granted, with every subscription identifier (MQTT 5.0 section 3.3.4); `None`
/// when No Local leaves none. `upgrade`: `upgrade_outgoing_qos`.
fn delivery_for(
    cm: &crate::router::ClientMatch<SubEntry>,
    msg: &Arc<Message>,
    upgrade: bool,
) -> Option<Delivery> {
    let mut qos: Option<QoS> = None;
    let mut retain = false;
    let mut ids = Vec::new();
    for e in &cm.subscriptions {
        let o = &e.granted.options;
        // No Local: never back to the publisher's own subscription [MQTT-3.8.3-3].
        if o.no_local && msg.publisher.as_deref() == Some(&*cm.client) {
            continue;
        }
        let q = outgoing_qos(msg.qos, o.qos, upgrade);
        qos = Some(qos.map_or(q, |have| have.max(q)));
        retain |= o.retain_as_published && msg.retain;
        if let Some(id) = e.granted.identifier {
            ids.push(id);
        }
    }
    Some(Delivery {
        msg: Arc::clone(msg),
        qos: qos?,
        retain,
        subscription_ids: ids,
        seq: 0,
        share: None,
    })
}

/// True for a message one of this broker's bridges brought in (published by its session
/// `$internal/bridge/<name>`): it is not sent to other brokers' bridges connected here
/// (`try_private`), so that over MQTT 3.1.1 too a message crosses one bridge
/// (docs/bridges.md, Loops).
fn from_own_bridge(msg: &Message) -> bool {
    msg.publisher
        .as_deref()
        .and_then(|p| p.strip_prefix(INTERNAL_PREFIX))
        .is_some_and(|p| p.starts_with("bridge/"))
}

impl BrokerState {
    pub(crate) fn new(mut config: Config) -> BrokerState {
        // Every limit's 0 means unlimited: from here on each is its largest value.
        config.server = config.server.resolved();
        let limits = QueueLimits::new(&config.server);
        let interest = crate::interest::Interest::default();
        if cfg!(feature = "cluster") && config.cluster.enabled() {
            // Before any subscription (the restore's included) reaches the index.
            interest.start(Arc::from(CLUSTER_CLIENT_ID));
        }
        let streams =
            crate::streams::Streams::new(&config.streams, config.storage.stream_memory_bytes);
        let queued_memory = Arc::new(crate::queued_memory::QueuedMemory::new(
            config.server.max_queued_memory,
        ));
        let held_wills = if cfg!(feature = "cluster")
            && config.cluster.enabled()
            && config.cluster.jetstream_on()
        {
            handover::HeldWills::holding()
        } else {
            handover::HeldWills::default()
        };
        BrokerState {
            config,
            limits,
            queued_memory,
            releasing: tokio::sync::Mutex::new(()),
            sessions: Arc::new(Mutex::new(HashMap::default())),
            index: RwLock::new(SubscriptionIndex::new()),
            retained: Mutex::new(RetainedStore::weighed(|m: &Arc<Message>| m.size())),
            retained_full: AtomicBool::new(false),
            sys_retained: Mutex::new(RetainedStore::new()),
            stats: Arc::default(),
            started: Instant::now(),
            shutting_down: AtomicBool::new(false),
            open_connections: AtomicUsize::new(0),
            connection_closed: Notify::new(),
            stop_listeners: Notify::new(),
            local_addrs: Mutex::new(Vec::new()),
            listeners_accepting: AtomicUsize::new(0),
            storage_failed: OnceLock::new(),
            next_client_number: AtomicU64::new(1),
            persist: OnceLock::new(),
            auth: crate::auth::Auth::allow_all(),
            events: crate::events::Events::new(crate::events::DEFAULT_EVENT_CAPACITY),
            interceptors: Vec::new(),
            subscribe_interceptors: Vec::new(),
            observers: crate::observe::Observers::default(),
            bridges: Mutex::new(Vec::new()),
            listener_auth: Vec::new(),
            checks_access: false,
            stored_access: None,
            keep_alive: Arc::default(),
            parking: OnceLock::new(),
            shards: None,
            interest,
            cluster: Default::default(),
            cluster_qos: Default::default(),
            other_nodes: OnceLock::new(),
            registry: OnceLock::new(),
            claiming: Default::default(),
            held_wills,
            busy_poll: Arc::new(crate::busy_poll::BusyPoll::new()),
            streams,
            held: backlog::HeldMessages::default(),
            fetched: backlog::FetchedMessages::default(),
            this: std::sync::Weak::new(),
        }
    }

    /// Accepts a message from a publisher: stores or clears the retained copy, then routes it.
    /// Returns whether any subscription matched its topic (see [`BrokerState::route`]), or,
    /// in cluster mode, another node's subscription it is handed to JetStream for (a node
    /// away included: the message waits for it), so that a publisher is not told "no
    /// matching subscribers" for a message that will be delivered.
    pub(crate) fn publish(&self, msg: Message) -> bool {
        self.publish_from(Arc::new(msg), &mut Vec::new())
    }

    /// [`BrokerState::publish`] for a client's reader: `congested` gets the receiving sessions
    /// now at their high-water mark (or full while connected), for the reader to wait on
    /// ([`Session::wait_room`]) before it reads more. The reader builds the message in its
    /// `Arc` directly (one move of a large struct less per message).
    pub(crate) fn publish_from(
        &self,
        msg: Arc<Message>,
        congested: &mut Vec<Arc<Session>>,
    ) -> bool {
        let plan = self.cluster_qos.plan(&msg);
        let matched = self.publish_unoffered(&msg, congested, plan.as_ref());
        // Another node (or a group with members on one) wants it at QoS 1 or 2: handed to
        // JetStream, to get it at least once (nobody waits here: see `publish_gated`).
        let offered = self.cluster_qos.offer(&msg, plan).is_some();
        matched || offered
    }

    /// The cluster's counters and gauges (`None` while cluster mode is off), with what waits
    /// for JetStream's acknowledgement now.
    pub(crate) fn cluster_info(&self) -> Option<crate::cluster_status::ClusterInfo> {
        let own_clients = self.stats.clients_connected.load(Ordering::Relaxed);
        let mut info = self.cluster.info(own_clients)?;
        (
            info.jetstream_pending_bytes,
            info.jetstream_pending_messages,
        ) = self.cluster_qos.pending();
        Some(info)
    }

    /// [`BrokerState::publish_from`] for a publisher that waits before it acknowledges: also
    /// returns the gate of the hand-off to JetStream when another node wants the message at
    /// QoS 1 or 2 (docs/cluster.md, "QoS across nodes"), resolved once JetStream holds it.
    pub(crate) fn publish_gated(
        &self,
        msg: Arc<Message>,
        congested: &mut Vec<Arc<Session>>,
    ) -> (bool, Option<Arc<crate::cluster_qos::Gate>>) {
        let plan = self.cluster_qos.plan(&msg);
        let matched = self.publish_unoffered(&msg, congested, plan.as_ref());
        let gate = self.cluster_qos.offer(&msg, plan);
        (matched || gate.is_some(), gate)
    }

    /// The retained copy, the streams and the routing of a message on this node; `plan`: what
    /// goes through JetStream (`cluster_qos`), for routing to leave to it.
    fn publish_unoffered(
        &self,
        msg: &Arc<Message>,
        congested: &mut Vec<Arc<Session>>,
        plan: Option<&crate::cluster_qos::Plan>,
    ) -> bool {
        if msg.topic.starts_with("$SYS") && self.is_own_bridge_state(&msg.topic) {
            // A client (or its will) on the state topic of a bridge this broker runs: the
            // broker's value stays.
            tracing::debug!(topic = %msg.topic, "a client's message on the state of one of this broker's bridges: dropped");
            return false;
        }
        if msg.retain {
            if msg.topic.starts_with("$SYS") {
                // A bridge's state (the only `$SYS` topic a client may publish): in memory,
                // with the broker's own `$SYS` values.
                let mut sys = self.sys_retained.lock();
                if msg.payload.is_empty() {
                    sys.remove(&msg.topic);
                } else {
                    sys.insert(&msg.topic, Arc::clone(msg));
                }
            } else if msg.topic.starts_with('$') || !self.cluster.enabled.load(Ordering::Relaxed) {
                // This node's retained set alone: not in cluster mode, or a `$` topic, which
                // stays on its node.
                self.retain(msg);
            } else {
                // In cluster mode the change is stamped and queued for the other nodes too
                // (docs/cluster.md, "Retained messages"); the callback runs once the clock's
                // lock is released.
                match self
                    .cluster
                    .retained
                    .local(msg, || self.retain_quietly(msg))
                {
                    Some(Some(change)) => self.retained_changed(change),
                    Some(None) => {}
                    None => self.retain(msg),
                }
            }
        }
        self.streams.append(msg);
        self.route_planned(msg, congested, plan)
    }

    /// True when `topic` is `$SYS/broker/connection/<client id>/state` of a bridge this
    /// broker runs (`[[bridges]]`): the broker's own value, which clients may not set even
    /// when they connect with that client identifier.
    pub(crate) fn is_own_bridge_state(&self, topic: &str) -> bool {
        let Some(id) = topic
            .strip_prefix("$SYS/broker/connection/")
            .and_then(|t| t.strip_suffix("/state"))
        else {
            return false;
        };
        self.bridges.lock().iter().any(|b| b.client_id == id)
    }

    /// Publishes one of the broker's own `$SYS` messages: kept in the `$SYS` retained store
    /// (an empty payload deletes the topic's value there instead), then routed like any
    /// message.
    pub(crate) fn publish_sys(&self, msg: Message) {
        let msg = Arc::new(msg);
        {
            let mut store = self.sys_retained.lock();
            if msg.payload.is_empty() {
                store.remove(&msg.topic);
            } else {
                store.insert(&msg.topic, Arc::clone(&msg));
            }
        }
        self.route(&msg);
    }

    /// (sessions, connected clients), in-process subscriptions excluded.
    pub(crate) fn session_counts(&self) -> (usize, usize) {
        let sessions = self.sessions.lock();
        let mut total = 0;
        let mut connected = 0;
        for s in sessions.values().filter(|s| !s.is_internal()) {
            total += 1;
            connected += usize::from(s.is_connected());
        }
        (total, connected)
    }

    /// Applies the RETAIN flag of `msg` (MQTT 5.0 section 3.3.1.3): an empty payload deletes
    /// the retained message of its topic [MQTT-3.3.1-6], anything else replaces it
    /// [MQTT-3.3.1-5]; nothing is kept with `retain_available = false` (clients cannot
    /// publish retained then; wills and in-process publishes can still carry the flag).
    ///
    /// Two limits bound the retained set: `max_retained_messages` (topics) and
    /// `max_retained_bytes` (the sum of [`Message::size`]). A message over either is not
    /// kept (the caller still routes it to the current subscribers), counted in
    /// `retained_not_kept_*` and logged once per episode. Replacing a retained message
    /// never counts against the topic limit, and against the byte limit only by what it
    /// adds; a replacement that is not kept deletes the message it replaced, which is no
    /// longer the topic's latest.
    pub(crate) fn retain(&self, msg: &Arc<Message>) {
        if let Some(change) = self.retain_quietly(msg) {
            self.retained_changed(change);
        }
    }

    /// Tells the embedding application's retained-change callback about `change` (with no
    /// lock held).
    pub(crate) fn retained_changed(&self, change: RetainedNotice) {
        match &change {
            RetainedNotice::Set(msg) => self.observers.retained(RetainedChange::Set(msg)),
            RetainedNotice::Cleared(topic) => {
                self.observers.retained(RetainedChange::Cleared { topic })
            }
        }
    }

    /// [`BrokerState::retain`] without the callback: returns the change to report, for the
    /// caller to report once it holds no lock.
    pub(crate) fn retain_quietly(&self, msg: &Arc<Message>) -> Option<RetainedNotice> {
        if !self.config.server.retain_available {
            return None;
        }
        let mut store = self.retained.lock();
        if msg.payload.is_empty() {
            if store.remove(&msg.topic).is_some() {
                if let Some(p) = self.persist.get() {
                    p.retained_deleted(&msg.topic);
                }
                self.retained_room(&store);
                return Some(RetainedNotice::Cleared(msg.topic.clone()));
            }
            return None;
        }
        let s = &self.config.server;
        let replaced = store.get(&msg.topic).map(|m| m.size() as u64);
        let over = if replaced.is_none()
            && s.max_retained_messages > 0
            && store.len() >= s.max_retained_messages
        {
            Some((
                "max_retained_messages",
                s.max_retained_messages as u64,
                &self.stats.retained_not_kept_count,
            ))
        } else if s.max_retained_bytes > 0
            && store.bytes() as u64 - replaced.unwrap_or(0) + msg.size() as u64
                > s.max_retained_bytes
        {
            Some((
                "max_retained_bytes",
                s.max_retained_bytes,
                &self.stats.retained_not_kept_bytes,
            ))
        } else {
            None
        };
        if let Some((limit, max, counter)) = over {
            let cleared = replaced.is_some() && store.remove(&msg.topic).is_some();
            if cleared {
                if let Some(p) = self.persist.get() {
                    p.retained_deleted(&msg.topic);
                }
            }
            let (len, bytes) = (store.len(), store.bytes());
            drop(store);
            crate::stats::Counters::add(counter, 1);
            if !self.retained_full.swap(true, Ordering::Relaxed) {
                let client_id = msg.publisher.as_deref().unwrap_or("(in-process)");
                tracing::warn!(
                    client_id,
                    topic = %msg.topic,
                    size = msg.size(),
                    retained_messages = len,
                    retained_bytes = bytes,
                    "retained message not kept: {limit} = {max} reached; retained messages \
                     over a limit are delivered but not kept, counted in $SYS/broker/retained \
                     messages/not kept/{limit}, and logged again once the retained set is \
                     back under half its limits"
                );
            }
            return cleared.then(|| RetainedNotice::Cleared(msg.topic.clone()));
        }
        store.insert(&msg.topic, Arc::clone(msg));
        if let Some(p) = self.persist.get() {
            // The publisher's listener is stored as its port, which outlives its place in
            // the configuration's list.
            let port = msg
                .source
                .as_ref()
                .and_then(|s| s.listener)
                .and_then(|i| self.config.listeners.get(i as usize))
                .map(|l| l.port);
            p.retained_set(msg, port);
        }
        self.retained_room(&store);
        Some(RetainedNotice::Set(Arc::clone(msg)))
    }

    /// After a change to the retained set: when a message was not kept for a limit, and the
    /// set is now back under half of both limits, says so and lets the next refusal be
    /// logged again. One atomic load while nothing was refused.
    fn retained_room(&self, store: &RetainedStore<Arc<Message>>) {
        if !self.retained_full.load(Ordering::Relaxed) {
            return;
        }
        let s = &self.config.server;
        let under = |used: u64, max: u64| max == 0 || used <= max / 2;
        if under(store.len() as u64, s.max_retained_messages as u64)
            && under(store.bytes() as u64, s.max_retained_bytes)
            && self.retained_full.swap(false, Ordering::Relaxed)
        {
            tracing::info!(
                retained_messages = store.len(),
                retained_bytes = store.bytes(),
                "retained messages are kept again: the retained set is back under half its limits"
            );
        }
    }

    /// Queues `msg` for every session with a matching subscription: one delivery per client at
    /// the highest QoS its matching subscriptions grant, carrying all their subscription
    /// identifiers [MQTT-3.3.4-3]; one member per shared subscription group (MQTT 5.0 section 4.8.2).
    /// Returns whether any subscription matched the topic, whether or not a copy was queued (a
    /// No Local subscription of the publisher's own, a full queue or a reader without
    /// permission still count, as in mosquitto): MQTT 5 publishers are told when none did
    /// (PUBACK 0x10).
    pub(crate) fn route(&self, msg: &Arc<Message>) -> bool {
        self.route_from(msg, &mut Vec::new())
    }

    /// [`BrokerState::route`], collecting the sessions at their high-water mark.
    pub(crate) fn route_from(&self, msg: &Arc<Message>, congested: &mut Vec<Arc<Session>>) -> bool {
        self.route_planned(msg, congested, None)
    }

    /// [`BrokerState::route_from`] for a message published on this node, with `plan`, what
    /// goes through JetStream ([`crate::cluster_qos::ClusterQos::plan`]): in cluster mode a
    /// QoS 1/2 message of a group with members on this node only goes to one of them here.
    fn route_planned(
        &self,
        msg: &Arc<Message>,
        congested: &mut Vec<Arc<Session>>,
        plan: Option<&crate::cluster_qos::Plan>,
    ) -> bool {
        let matches = self.index.read().matches(&msg.topic);
        // What the message costs in a queue, computed once for every client it goes to.
        let size = msg.size() as u64;
        let matched =
            !matches.clients.is_empty() || matches.shared.iter().any(|s| !s.members.is_empty());
        // Brought in by one of this broker's bridges: not for other brokers' bridges.
        let from_own_bridge = from_own_bridge(msg);
        let upgrade = self.config.server.upgrade_outgoing_qos;
        for cm in &matches.clients {
            let Some(first) = cm.subscriptions.first() else {
                continue;
            };
            if from_own_bridge && first.session.state.lock().remote_bridge() {
                // A message crosses at most one bridge (docs/bridges.md, Loops): over MQTT
                // 3.1.1 the remote cannot tell, so it is not sent.
                continue;
            }
            let Some(q) = delivery_for(cm, msg, upgrade) else {
                continue;
            };
            let cost = size + 4 * q.subscription_ids.len() as u64;
            if self.offer(&first.session, q, cost) {
                congested.push(Arc::clone(&first.session));
            }
        }
        // In cluster mode a group gets a message once in the whole cluster (`cluster`,
        // `deliver_to_group`): QoS 0 through NATS core; QoS 1 and 2 through JetStream when
        // the group has members on another node (`plan`), else here. `$` topics stay on
        // their node.
        let all_here = !self.interest.is_on() || msg.topic.starts_with('$');
        let here = |sm: &&crate::router::SharedMatch<SubEntry>| {
            all_here || plan.is_some_and(|p| !p.crosses(&sm.filter))
        };
        for sm in matches.shared.iter().filter(here) {
            if sm.members.is_empty() {
                continue;
            }
            if !self.deliver_shared(sm, msg, msg.qos, congested) {
                self.dropped(None, &msg.topic, DropCause::NoShareMember);
            }
        }
        matched
    }

    /// In cluster mode, a message another node was sent for a session this node took from
    /// that node's storage after it crashed (`cluster/recovery.rs`): offered to that session
    /// alone, as routing would offer it. True when queued.
    #[cfg(all(feature = "cluster", feature = "postgres"))]
    pub(crate) fn deliver_to_client(&self, client_id: &str, msg: &Arc<Message>) -> bool {
        let matches = self.index.read().matches(&msg.topic);
        let Some(cm) = matches.clients.iter().find(|cm| &*cm.client == client_id) else {
            return false;
        };
        let upgrade = self.config.server.upgrade_outgoing_qos;
        match (cm.subscriptions.first(), delivery_for(cm, msg, upgrade)) {
            (Some(first), Some(q)) => self.deliver(&first.session, q),
            _ => false,
        }
    }

    /// Offers one delivery to a session, counting a drop. True when queued.
    pub(crate) fn deliver(&self, session: &Session, q: Delivery) -> bool {
        if !self.may_read(session, &q.msg.topic) {
            self.dropped(
                Some(&session.client_id),
                &q.msg.topic,
                DropCause::NotAuthorized,
            );
            return false;
        }
        let topic = self.tells_drops().then(|| Arc::clone(&q.msg));
        match session.enqueue(q, &self.limits) {
            Enqueued::Queued | Enqueued::QueuedOverHighWater => true,
            Enqueued::Skipped => false,
            Enqueued::Dropped(cause) => {
                let topic = topic.as_ref().map_or("", |m| m.topic.as_str());
                self.dropped(Some(&session.client_id), topic, cause);
                false
            }
        }
    }

    /// [`BrokerState::deliver`] for routing a client's message: true when the publisher
    /// should wait for this session (at its high-water mark, or full while connected).
    /// `cost` is the delivery's [`Delivery::cost`].
    fn offer(&self, session: &Session, q: Delivery, cost: u64) -> bool {
        if !self.may_read(session, &q.msg.topic) {
            self.dropped(
                Some(&session.client_id),
                &q.msg.topic,
                DropCause::NotAuthorized,
            );
            return false;
        }
        let topic = self.tells_drops().then(|| Arc::clone(&q.msg));
        match session.enqueue_costing(q, cost, &self.limits) {
            Enqueued::Queued | Enqueued::Skipped => false,
            Enqueued::QueuedOverHighWater => true,
            Enqueued::Dropped(cause) => {
                let topic = topic.as_ref().map_or("", |m| m.topic.as_str());
                self.dropped(Some(&session.client_id), topic, cause);
                session.is_connected()
            }
        }
    }

    /// Counts a message that did not reach a subscriber (`None`: no member of a shared
    /// group could take it), fires [`Event::MessageDropped`](crate::Event) and calls the
    /// application's dropped callback. Called with no session lock held.
    pub(crate) fn dropped(&self, client_id: Option<&str>, topic: &str, cause: DropCause) {
        self.stats.dropped(cause);
        self.observers.dropped(client_id, topic, cause);
        self.events.fire(|| Event::MessageDropped {
            client_id: client_id.map(str::to_string),
            topic: topic.to_string(),
            cause,
        });
    }

    /// Whether a drop is told to anyone (an event stream open, a dropped callback): the
    /// topic is kept for it only then.
    #[inline]
    fn tells_drops(&self) -> bool {
        self.events.listening() || self.observers.dropped.is_some()
    }

    /// Records a subscription in the session and the index. Returns true when it replaced an
    /// existing subscription on the same filter [MQTT-3.8.4-3].
    pub(crate) fn subscribe(&self, session: &Arc<Session>, filter: &str, granted: Granted) -> bool {
        self.subscribe_within(session, filter, granted, usize::MAX)
            .unwrap_or(true)
    }

    /// [`subscribe`](Self::subscribe), unless the session already holds `max` subscriptions
    /// and this one is new: `None` then (`max_subscriptions_per_client`).
    pub(crate) fn subscribe_within(
        &self,
        session: &Arc<Session>,
        filter: &str,
        granted: Granted,
        max: usize,
    ) -> Option<bool> {
        let existed = session.add_subscription_within(filter, granted, max)?;
        let entry = SubEntry {
            session: Arc::clone(session),
            granted,
        };
        let mut index = self.index.write();
        if index.insert(filter, Arc::clone(&session.client_id), entry) {
            self.interest.add(filter, &session.client_id);
        }
        Some(existed)
    }

    /// Removes a subscription. True when it existed. Leaving a shared subscription's group
    /// passes the messages queued through it on to another member ([`BrokerState::pass_on`]).
    pub(crate) fn unsubscribe(&self, session: &Session, filter: &str) -> bool {
        let existed = session.remove_subscription(filter);
        if existed {
            let mut index = self.index.write();
            if index.remove(filter, &session.client_id) {
                self.interest.remove(filter, &session.client_id);
            }
            drop(index);
            if filter.starts_with("$share/") {
                let left = session.take_shared(filter);
                self.pass_on(&session.client_id, left);
            }
        }
        existed
    }

    /// Queues the retained messages matching `filter` for `session`, as a new subscription
    /// with these options receives them [MQTT-3.8.4-4], with RETAIN set [MQTT-3.3.1-8].
    pub(crate) fn send_retained(&self, session: &Session, filter: &str, granted: &Granted) {
        let now = Instant::now();
        // `$SYS` messages match only filters that name `$SYS` [MQTT-4.7.2-1].
        let found = if filter.starts_with("$SYS") {
            self.sys_retained.lock().matching(filter)
        } else {
            self.retained.lock().matching(filter)
        };
        let remote_bridge = session.state.lock().remote_bridge();
        for msg in found {
            if msg.is_expired(now)
                || (remote_bridge && from_own_bridge(&msg))
                || !self.source_may_publish(&msg)
            {
                continue;
            }
            let q = Delivery {
                qos: outgoing_qos(
                    msg.qos,
                    granted.options.qos,
                    self.config.server.upgrade_outgoing_qos,
                ),
                msg,
                retain: true,
                subscription_ids: granted.identifier.into_iter().collect(),
                seq: 0,
                share: None,
            };
            self.deliver(session, q);
        }
    }

    /// Ends a session: removes its subscriptions from the index and the session from the map
    /// (if it is still the one there), passes the messages it holds through shared
    /// subscriptions on to other members of their groups ([`BrokerState::pass_on`]), and
    /// publishes a will still pending [MQTT-3.1.2-8].
    pub(crate) fn end_session(&self, session: &Arc<Session>) {
        let Some(Ended {
            filters,
            will,
            shared,
            backlog,
        }) = session.end()
        else {
            return;
        };
        if let Some(r) = self.registry.get() {
            r.ended(session, false);
        }
        self.forget_session(session, &filters, backlog);
        self.pass_on(&session.client_id, shared);
        if let Some(will) = will {
            self.publish_will(&session.client_id, will);
        }
    }

    /// What ending `session` takes out of the broker: its `filters` from the index, the
    /// session from the map (if it is still the one there), and the hold of its restored
    /// `backlog`'s messages.
    fn forget_session(
        &self,
        session: &Arc<Session>,
        filters: &[String],
        backlog: Option<crate::session::Backlog>,
    ) {
        if backlog.is_some_and(|b| b.restored) {
            self.held.done();
        }
        {
            let mut index = self.index.write();
            for f in filters {
                if index.remove(f, &session.client_id) {
                    self.interest.remove(f, &session.client_id);
                }
            }
        }
        let mut sessions = self.sessions.lock();
        if sessions
            .get(&session.client_id)
            .is_some_and(|s| Arc::ptr_eq(s, session))
        {
            sessions.remove(&session.client_id);
        }
    }

    /// Called when a session's connection has ended. `publish_will` is false after a normal
    /// DISCONNECT [MQTT-3.1.2-10]. Arms the will delay and session expiry timers.
    pub(crate) fn detach(
        self: &Arc<Self>,
        session: &Arc<Session>,
        link: &Arc<Link>,
        publish_will: bool,
    ) {
        let Some(Detached {
            generation,
            expiry,
            will_now,
            will_delay,
        }) = session.detach(link, publish_will)
        else {
            return;
        };
        if let Some(will) = will_now {
            self.publish_will(&session.client_id, will);
        }
        if expiry == 0 {
            self.end_session(session);
            return;
        }
        if let Some(delay) = will_delay {
            if delay < expiry {
                self.arm_will(session, generation, Duration::from_secs(u64::from(delay)));
            }
        }
        if expiry != u32::MAX {
            self.arm_expiry(session, generation, Duration::from_secs(u64::from(expiry)));
        }
    }

    /// Publishes the will of `session` after `after` (its Will Delay Interval, MQTT 5.0
    /// section 3.1.3.2.2) unless a connection took the session up again since `generation`
    /// or the session ended (which publishes the will itself).
    pub(crate) fn arm_will(
        self: &Arc<Self>,
        session: &Arc<Session>,
        generation: u32,
        after: Duration,
    ) {
        self.when_idle_after(session, generation, after, move |broker, session| {
            if let Some(will) = session.take_will_if_idle(generation) {
                broker.publish_will(&session.client_id, will);
            }
        });
    }

    /// Ends `session` after `after` unless a connection took it up again since `generation`
    /// (the Session Expiry Interval, MQTT 5.0 section 3.1.2.11.2).
    pub(crate) fn arm_expiry(
        self: &Arc<Self>,
        session: &Arc<Session>,
        generation: u32,
        after: Duration,
    ) {
        self.when_idle_after(session, generation, after, |broker, session| {
            tracing::debug!(client_id = %session.client_id, "session expired");
            broker
                .stats
                .sessions_expired
                .fetch_add(1, Ordering::Relaxed);
            broker.events.fire(|| Event::SessionExpired {
                client_id: session.client_id.to_string(),
            });
            broker.end_session(session);
        });
    }

    /// The timers of sessions: runs `act` after `after` unless a connection took `session`
    /// up again since `generation` or the session ended meanwhile.
    fn when_idle_after(
        self: &Arc<Self>,
        session: &Arc<Session>,
        generation: u32,
        after: Duration,
        act: impl FnOnce(&Arc<Self>, &Arc<Session>) + Send + 'static,
    ) {
        let broker = Arc::clone(self);
        let session = Arc::clone(session);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            // In cluster mode a copy whose session another node owns now acts no more.
            if session.idle_since(generation)
                && broker.still_owned(&session).await
                && session.idle_since(generation)
            {
                act(&broker, &session);
            }
        });
    }

    /// Asks every connection (and in-process subscription) to close, sending DISCONNECT `rc`
    /// to 5.0 clients.
    pub(crate) fn close_all(&self, reason: DisconnectReason, rc: ReasonCode) {
        let links: Vec<Arc<Link>> = self
            .sessions
            .lock()
            .values()
            .filter_map(|s| s.link())
            .collect();
        for link in links {
            link.kill(reason.clone(), rc);
        }
    }

    /// True once shutdown has begun.
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }
}

impl Session {
    /// True for the sessions behind in-process subscriptions ([`crate::BrokerHandle::subscribe`]).
    pub(crate) fn is_internal(&self) -> bool {
        self.client_id.starts_with(INTERNAL_PREFIX)
    }

    /// The user name its client authenticated as (`None`: anonymous, or one of the
    /// broker's own sessions), as the application's hooks are told.
    pub(crate) fn username(&self) -> Option<Arc<str>> {
        match &*self.identity.read() {
            crate::auth::Identity::Client { username, .. } => username.clone(),
            crate::auth::Identity::Trusted => None,
        }
    }

    /// True while a connection serves this session.
    pub(crate) fn is_connected(&self) -> bool {
        self.link().is_some()
    }
}
