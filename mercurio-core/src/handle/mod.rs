//! The embedding API (docs/embedding.md): build a broker from a [`Config`], start it, and
//! drive it through a cloneable [`BrokerHandle`].

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::auth::hooks::{Authenticator, Authorizer};
use crate::auth::{Auth, FileError};
use crate::bridge::{BridgeInfo, BridgeReload, Bridges};
use crate::broker::{BrokerState, INTERNAL_PREFIX};
use crate::codec::{Properties, ProtocolVersion, QoS, ReasonCode, SubscriptionOptions};
use crate::config::{Config, ListenerProtocol};
use crate::error::Error;
use crate::events::{EventStream, Events, DEFAULT_EVENT_CAPACITY};
use crate::http::{Endpoint, HttpLimits};
use crate::intercept::{PublishInterceptor, SubscribeInterceptor};
use crate::link::{DisconnectReason, Link};
use crate::listener;
use crate::observe::{DeliveryCompleted, MessageDropped, Observers, RetainedChange, WillPublished};
use crate::persist::{Persister, WriteFailure};
use crate::session::{Session, SessionState};
use crate::stats::Stats;
use crate::sys::SysPublisher;
use crate::tls::TlsListener;

mod client;
mod subscription;
pub use client::{Client, ClientOptions, Received};
use subscription::{check_subscription, publish_as, pump};
pub use subscription::{Delivered, Subscription};

/// How long [`BrokerHandle::shutdown`] waits for connections to close (docs/operations.md, "Shutdown").
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Entry point of the embedding API.
///
/// ```no_run
/// # async fn f() -> Result<(), mercurio_core::Error> {
/// let handle = mercurio_core::Broker::builder(mercurio_core::config::Config::default()).start().await?;
/// handle.publish("greetings", "hello", mercurio_core::codec::QoS::AtMostOnce, false).await?;
/// handle.shutdown().await;
/// # Ok(()) }
/// ```
pub struct Broker;

impl Broker {
    /// A builder for a broker with this configuration.
    pub fn builder(config: Config) -> BrokerBuilder {
        BrokerBuilder {
            config,
            http_limits: HttpLimits::default(),
            storage: None,
            authenticators: Vec::new(),
            authorizers: Vec::new(),
            enhanced: Vec::new(),
            interceptors: Vec::new(),
            subscribe_interceptors: Vec::new(),
            observers: Observers::default(),
            event_capacity: DEFAULT_EVENT_CAPACITY,
            admin_handler: None,
            shards: None,
        }
    }
}

/// Checks what a configuration names outside itself without starting anything: the password
/// and ACL files parse, every certificate and key loads, each `http_dir` is a directory, each
/// admin API's token file holds a token, and a
/// SQLite database's directory exists (what `mercuriod --check-config` runs).
///
/// Errors: [`Error::File`] (path, line, cause) or [`Error::Config`], as [`BrokerBuilder::start`]
/// would return them.
pub fn check_files(config: &Config) -> Result<(), Error> {
    let hooks = crate::auth::Hooks::default();
    Auth::from_config(config, &hooks, None)?;
    Bridges::check(&config.bridges)?;
    if config.storage.backend == crate::config::StorageBackend::Postgres {
        crate::credentials::storage_url(&config.storage)?;
    }
    Auth::for_listeners(config, &hooks, None)?;
    for (i, l) in config.listeners.iter().enumerate() {
        if l.cert_file.is_some() {
            TlsListener::load(l)?;
        }
        if l.admin_api {
            crate::admin_api::read_token(config, l, i)?;
        }
        if let Some(dir) = l.http_dir.as_ref().filter(|d| !d.is_dir()) {
            return Err(Error::Config(format!(
                "listener {}:{}: http_dir {} is not a directory",
                l.host,
                l.port,
                dir.display()
            )));
        }
    }
    if config.storage.backend == crate::config::StorageBackend::Sqlite {
        if let Some(dir) = config.storage.path.as_ref().and_then(|p| p.parent()) {
            if !dir.as_os_str().is_empty() && !dir.is_dir() {
                return Err(Error::Config(format!(
                    "storage.path: the directory {} does not exist",
                    dir.display()
                )));
            }
        }
    }
    Ok(())
}

/// Builds and starts a broker.
pub struct BrokerBuilder {
    config: Config,
    http_limits: HttpLimits,
    storage: Option<Arc<dyn mercurio_storage::Storage>>,
    authenticators: Vec<Arc<dyn Authenticator>>,
    authorizers: Vec<Arc<dyn Authorizer>>,
    enhanced: Vec<Arc<dyn crate::auth::hooks::EnhancedAuthenticator>>,
    interceptors: Vec<Arc<dyn PublishInterceptor>>,
    subscribe_interceptors: Vec<Arc<dyn SubscribeInterceptor>>,
    observers: Observers,
    event_capacity: usize,
    admin_handler: Option<Arc<dyn crate::AdminHandler>>,
    shards: Option<Arc<crate::Shards>>,
}

impl BrokerBuilder {
    /// Adds a publish interceptor, asked after those added earlier: it sees every PUBLISH
    /// from a client after authorization and before routing, and may change or refuse it
    /// (see [`PublishInterceptor`]). Without any, a PUBLISH costs nothing more.
    pub fn interceptor(mut self, interceptor: impl PublishInterceptor) -> Self {
        self.interceptors.push(Arc::new(interceptor));
        self
    }

    /// Adds a SUBSCRIBE interceptor, asked after those added earlier: it sees each topic
    /// filter of a network client's SUBSCRIBE after authorization and before it is
    /// recorded, and may rewrite the filter, lower the QoS, or refuse it with a SUBACK
    /// reason code (see [`SubscribeInterceptor`]). Without any, a SUBSCRIBE costs one
    /// length check more.
    pub fn subscribe_interceptor(mut self, interceptor: impl SubscribeInterceptor) -> Self {
        self.subscribe_interceptors.push(Arc::new(interceptor));
        self
    }

    /// Calls `f` each time a subscriber acknowledges a message: PUBACK (QoS 1) or PUBCOMP
    /// (QoS 2) from a network client, the acknowledgement of a bridge's remote, or
    /// [`Received::ack`] from an in-process [`Client`]: once per message and subscriber.
    /// Runs on the acknowledging side's task (a client's reader: its next packets wait), under
    /// no lock of the broker; it must not block. Replaces a callback set before. Without one
    /// an acknowledgement pays a `None` check.
    pub fn on_delivery_completed(
        mut self,
        f: impl Fn(&DeliveryCompleted<'_>) + Send + Sync + 'static,
    ) -> Self {
        self.observers.completed = Some(Box::new(f));
        self
    }

    /// Calls `f` for every message that does not reach a subscriber, with the cause the
    /// drop counters (`publish/messages/dropped/<cause>`) count it under: a full queue, an
    /// expired message, one too large for the subscriber, one it may no longer read, a shared
    /// group without a member. Runs on the task that found the drop (a publisher's, a
    /// subscriber's writer...), under no lock of the broker; it must not block. Replaces a
    /// callback set before. Without one a drop pays a `None` check.
    pub fn on_dropped(mut self, f: impl Fn(&MessageDropped<'_>) + Send + Sync + 'static) -> Self {
        self.observers.dropped = Some(Box::new(f));
        self
    }

    /// Calls `f` when a will is published (its client's connection ended without
    /// DISCONNECT, its delay passed, its session ended), before the publish interceptors see
    /// it. Runs on the task that ends the connection or session (or the will's timer), under
    /// no lock of the broker; it must not block. Replaces a callback set before.
    pub fn on_will(mut self, f: impl Fn(&WillPublished<'_>) + Send + Sync + 'static) -> Self {
        self.observers.will = Some(Box::new(f));
        self
    }

    /// Calls `f` after each change of the retained messages (set, replaced, deleted), on
    /// the publisher's task, once the retained set's lock is released: two publishers
    /// changing one topic at the same instant may be reported in the other order than the
    /// one applied. Retained messages restored from storage at start, and `$SYS` ones, are
    /// not reported. It must not block. Replaces a callback set before.
    pub fn on_retained_change(
        mut self,
        f: impl Fn(&RetainedChange<'_>) + Send + Sync + 'static,
    ) -> Self {
        self.observers.retained = Some(Box::new(f));
        self
    }

    /// How many events each [`EventStream`] holds before it loses the oldest (default
    /// [`DEFAULT_EVENT_CAPACITY`], 1,024; at least 1).
    pub fn event_capacity(mut self, capacity: usize) -> Self {
        self.event_capacity = capacity;
        self
    }

    /// The HTTP limits of every WebSocket listener (default: docs/http.md's 8 KiB request head,
    /// 32 responses at once, a minute per response).
    pub fn http_limits(mut self, limits: HttpLimits) -> Self {
        self.http_limits = limits;
        self
    }

    /// Answers the remote admin API's operations (listeners with `admin_api = true`,
    /// docs/admin-api.md): each route becomes a request that `handler` answers, as mercuriod's
    /// admin socket does. Without one, only `GET /api/v1/stats` is answered and the other
    /// routes get 404.
    pub fn admin_handler(mut self, handler: impl crate::AdminHandler) -> Self {
        self.admin_handler = Some(Arc::new(handler));
        self
    }

    /// Uses `storage` instead of the backend `[storage]` names (an application's own
    /// backend, or a shared [`MemoryStorage`](mercurio_storage::MemoryStorage) in tests).
    pub fn storage(mut self, storage: Arc<dyn mercurio_storage::Storage>) -> BrokerBuilder {
        self.storage = Some(storage);
        self
    }

    /// Adds an authenticator, asked before those added later and before the `[auth]`
    /// section's (`allow_anonymous`, `password_file`); the first opinion wins, so one that
    /// always answers replaces the configured authentication.
    pub fn authenticator(mut self, authenticator: impl Authenticator) -> Self {
        self.authenticators.push(Arc::new(authenticator));
        self
    }

    /// Adds an authorizer, asked before those added later and before the `acl_file`; the
    /// first opinion wins. With no authorizer and no ACL file, everything is allowed (and
    /// costs nothing).
    pub fn authorizer(mut self, authorizer: impl Authorizer) -> Self {
        self.authorizers.push(Arc::new(authorizer));
        self
    }

    /// Adds an enhanced authenticator (MQTT 5.0 AUTH exchanges, section 4.12) for the
    /// Authentication Methods it supports, asked before those added later and before the
    /// built-in SCRAM-SHA-256 / SCRAM-SHA-512 of `[auth] backend = "storage"`. Without one
    /// that supports a client's method, its CONNECT is refused with 0x8C (Bad authentication
    /// method). See [`EnhancedAuthenticator`](crate::auth::hooks::EnhancedAuthenticator).
    pub fn enhanced_authenticator(
        mut self,
        authenticator: impl crate::auth::hooks::EnhancedAuthenticator,
    ) -> Self {
        self.enhanced.push(Arc::new(authenticator));
        self
    }

    /// Serves clients on these shards (more than one thread, see [`Shards`](crate::Shards)):
    /// each connection on one of them, placed where there is room, filling the first shard
    /// first. Without this (the default), every task runs in the runtime that calls
    /// [`BrokerBuilder::start`]. `[server] busy_poll` does not apply with more than one shard.
    pub fn shards(mut self, shards: Arc<crate::Shards>) -> Self {
        self.shards = Some(shards);
        self
    }

    /// Binds every listener and starts serving. Returns once all listeners are bound.
    ///
    /// Errors: [`Error::Bind`] when an address is in use or not available,
    /// [`Error::Config`] for an `http_dir` that is not a directory, [`Error::File`] for a
    /// password, ACL, certificate or key file that cannot be used, [`Error::Storage`] when
    /// storage cannot be opened or loaded.
    /// Must be called inside a Tokio runtime.
    pub async fn start(self) -> Result<BrokerHandle, Error> {
        let hooks = crate::auth::Hooks {
            authenticators: self.authenticators,
            authorizers: self.authorizers,
            enhanced: self.enhanced,
        };
        let stored = (self.config.auth.backend == crate::config::AuthBackend::Storage)
            .then(|| Arc::new(crate::auth::stored::StoredAccess::new()));
        let listener_auth = Auth::for_listeners(&self.config, &hooks, stored.as_ref())?;
        let auth = Auth::from_config(&self.config, &hooks, stored.as_ref())?;
        let mut tls = Vec::with_capacity(self.config.listeners.len());
        for l in &self.config.listeners {
            tls.push(match l.cert_file {
                Some(_) => Some(Arc::new(TlsListener::load(l)?)),
                None => None,
            });
        }
        let storage = match self.storage {
            Some(storage) => Some(storage),
            None => open_configured(&self.config.storage).await?,
        };
        let checks_access =
            auth.checks_access() || listener_auth.iter().flatten().any(|a| a.checks_access());
        // Queues are left in storage, read when their clients come back (`broker::backlog`);
        // with access checks, read now (`read_needed_queues`).
        let loaded = match &storage {
            Some(storage) => {
                let mut loaded = storage.load_without_queues().await?;
                crate::broker::restore::read_needed_queues(
                    storage.as_ref(),
                    &mut loaded,
                    checks_access,
                )
                .await?;
                let streamed = crate::broker::restore::read_last_value_streams(
                    storage.as_ref(),
                    &loaded,
                    &self.config.streams,
                )
                .await?;
                Some((loaded, streamed))
            }
            None => None,
        };
        if let Some(stored) = &stored {
            // With the memory backend, the access rules live as long as the broker.
            let access_storage = storage.clone().unwrap_or_else(|| {
                Arc::new(mercurio_storage::MemoryStorage::new())
                    as Arc<dyn mercurio_storage::Storage>
            });
            if let Err(e) = stored.attach(access_storage).await {
                if let Some(storage) = &storage {
                    let _ = storage.close().await;
                }
                return Err(e.into());
            }
        }
        let bound = match listener::bind_all(&self.config.listeners).await {
            Ok(bound) => bound,
            Err(e) => {
                if let Some(storage) = &storage {
                    let _ = storage.close().await;
                }
                return Err(e);
            }
        };
        let (failure_tx, failure) = tokio::sync::watch::channel(None);
        let durable_ack = self.config.storage.durable_ack;
        let pending_limits = crate::persist::PendingLimits::from_config(&self.config.storage);
        let mut inner = BrokerState::new(self.config);
        inner.checks_access = checks_access;
        inner.auth = auth;
        inner.events = Events::new(self.event_capacity);
        inner.interceptors = self.interceptors;
        inner.subscribe_interceptors = self.subscribe_interceptors;
        inner.observers = self.observers;
        inner.listener_auth = listener_auth;
        inner.stored_access = stored;
        inner.shards = self.shards.filter(|s| s.len() > 1);
        let inner = Arc::new_cyclic(|this| {
            inner.this = this.clone();
            inner
        });
        if let (Some(storage), Some(loaded)) = (storage, loaded) {
            spawn_failure_watch(Arc::clone(&storage), Arc::downgrade(&inner), failure_tx);
            let persister = Persister::start(
                storage,
                durable_ack,
                pending_limits,
                Arc::clone(&inner.stats),
                Arc::downgrade(&inner.sessions),
            );
            inner.streams.set_persister(&persister);
            let _ = inner.persist.set(persister);
            let (loaded, streamed) = loaded;
            crate::broker::restore::restore(&inner, loaded, streamed);
        }
        let mut addrs = Vec::new();
        let mut ready = Vec::with_capacity(bound.len());
        for (index, ((l, cfg), tls)) in bound.into_iter().zip(tls.iter().cloned()).enumerate() {
            let addr = l.local_addr().map_err(|source| Error::Bind {
                addr: format!("{}:{}", cfg.host, cfg.port),
                source,
            })?;
            addrs.push(addr);
            let http = match cfg.protocol {
                ListenerProtocol::Websocket => Some(Arc::new(Endpoint::new(
                    Arc::clone(&inner),
                    &cfg,
                    index,
                    self.http_limits,
                    self.admin_handler.clone(),
                )?)),
                ListenerProtocol::Mqtt => None,
            };
            ready.push((index, l, cfg, http, tls));
        }
        let admin_apis: Vec<Arc<Endpoint>> = ready
            .iter()
            .filter_map(|(_, _, _, http, _)| http.clone())
            .filter(|ep| ep.admin.is_some())
            .collect();
        for (index, l, cfg, http, tls) in ready {
            tokio::spawn(listener::run(Arc::clone(&inner), l, index, cfg, http, tls));
        }
        *inner.local_addrs.lock() = addrs;
        if inner.shards.is_some() {
            // The parking's tasks on this shard, whichever connection parks first.
            let _ = crate::connection::park::parking_of(&inner);
            if inner.config.server.busy_poll > 0 {
                tracing::info!("busy_poll does not apply with more than one thread: nothing polls");
            }
        } else {
            let _ = inner.busy_poll.start(inner.config.server.busy_poll);
        }
        // sys_interval = 0 turns $SYS off, as in mosquitto.
        if inner.config.server.sys_interval > 0 {
            let mut sys = SysPublisher::new(Arc::clone(&inner));
            sys.publish_all();
            tokio::spawn(sys.run());
        }
        let bridges = Arc::new(Bridges::new(Arc::clone(&inner)));
        bridges.start(&inner.config.bridges).await?;
        #[cfg(feature = "cluster")]
        let cluster = crate::cluster::Cluster::start(&inner).await?.map(Arc::new);
        let handle = BrokerHandle {
            inner,
            bridges,
            #[cfg(feature = "cluster")]
            cluster,
            tls: Arc::new(tls.into_iter().flatten().collect()),
            failure,
        };
        for ep in admin_apis {
            if let Some(api) = &ep.admin {
                api.set_handle(handle.clone());
            }
        }
        Ok(handle)
    }
}

/// The backend `[storage]` names, opened (`None` for memory: nothing is stored).
async fn open_configured(
    config: &crate::config::StorageConfig,
) -> Result<Option<Arc<dyn mercurio_storage::Storage>>, Error> {
    use crate::config::StorageBackend;
    match config.backend {
        StorageBackend::Memory => Ok(None),
        #[cfg(feature = "sqlite")]
        StorageBackend::Sqlite => {
            let path = config
                .path
                .clone()
                .ok_or_else(|| Error::Config("backend = \"sqlite\" needs path".into()))?;
            // Without durable_ack nothing waits for a commit: the storage thread then runs
            // behind the event loops (`THREAD_NICE`).
            let background = !config.durable_ack;
            let storage = tokio::task::spawn_blocking(move || {
                use mercurio_storage::sqlite::SqliteStorage;
                if background {
                    SqliteStorage::open_in_background(path)
                } else {
                    SqliteStorage::open(path)
                }
            })
            .await
            .map_err(|e| Error::Config(format!("opening the database: {e}")))??;
            Ok(Some(Arc::new(storage)))
        }
        #[cfg(not(feature = "sqlite"))]
        StorageBackend::Sqlite => Err(Error::Config(
            "backend = \"sqlite\" needs the sqlite feature".into(),
        )),
        #[cfg(feature = "postgres")]
        StorageBackend::Postgres => {
            let url = crate::credentials::storage_url(config)?.ok_or_else(|| {
                Error::Config("backend = \"postgres\" needs url or url_file".into())
            })?;
            let mut options = mercurio_storage::postgres::PostgresOptions::new(url);
            options.standby = config.standby;
            let storage = mercurio_storage::postgres::PostgresStorage::open(options).await?;
            Ok(Some(Arc::new(storage)))
        }
        #[cfg(not(feature = "postgres"))]
        StorageBackend::Postgres => Err(Error::Config(
            "backend = \"postgres\" needs the postgres feature".into(),
        )),
    }
}

/// Waits for [`Storage::failed`](mercurio_storage::Storage::failed): then the broker stops at
/// once (listeners closed, clients cut off, nothing more written) and
/// [`BrokerHandle::failed`] reports why.
fn spawn_failure_watch(
    storage: Arc<dyn mercurio_storage::Storage>,
    inner: std::sync::Weak<BrokerState>,
    failure: tokio::sync::watch::Sender<Option<Arc<mercurio_storage::StorageError>>>,
) {
    tokio::spawn(async move {
        let e = storage.failed().await;
        tracing::error!("storage failed, stopping at once: {e}");
        if let Some(inner) = inner.upgrade() {
            let _ = inner.storage_failed.set(e.to_string());
            inner.shutting_down.store(true, Ordering::Release);
            inner.stop_listeners.notify_waiters();
            inner.busy_poll.stop();
            inner.close_all(DisconnectReason::Shutdown, ReasonCode::SERVER_UNAVAILABLE);
        }
        let _ = failure.send(Some(Arc::new(e)));
    });
}

/// A handle on a running broker. Cheap to clone; every clone drives the same broker.
#[derive(Clone)]
pub struct BrokerHandle {
    inner: Arc<BrokerState>,
    /// The running bridges.
    bridges: Arc<Bridges>,
    /// The cluster link, in cluster mode.
    #[cfg(feature = "cluster")]
    cluster: Option<Arc<crate::cluster::Cluster>>,
    /// The TLS listeners, for [`BrokerHandle::reload`].
    tls: Arc<Vec<Arc<TlsListener>>>,
    /// Set when storage failed and the broker stopped at once.
    failure: tokio::sync::watch::Receiver<Option<Arc<mercurio_storage::StorageError>>>,
}

/// What [`BrokerHandle::sessions`] reports of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    pub client_id: String,
    pub connected: bool,
    /// 3, 4 or 5.
    pub protocol_level: u8,
    pub subscriptions: usize,
    /// Messages waiting in its queue.
    pub queued: usize,
    /// Outbound QoS 1/2 messages awaiting acknowledgement.
    pub inflight: usize,
}

impl SessionInfo {
    fn of(session: &Session, st: &SessionState) -> SessionInfo {
        SessionInfo {
            client_id: session.client_id.to_string(),
            connected: st.is_connected(),
            protocol_level: st.protocol().level(),
            subscriptions: st.subscriptions().len(),
            queued: st.queued_len(),
            inflight: st.inflight().len(),
        }
    }
}

impl BrokerHandle {
    /// The addresses the listeners are bound to, in configuration order (useful with port 0).
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.inner.local_addrs.lock().clone()
    }

    /// A new stream of the broker's lifecycle [`Event`](crate::Event)s, from now on: clients
    /// connecting and disconnecting, subscribing and unsubscribing, sessions expiring, wills
    /// published, messages dropped. Bounded ([`BrokerBuilder::event_capacity`]): a stream
    /// that falls behind never slows the broker, it loses the oldest events and reads
    /// [`Event::Lagged`](crate::Event::Lagged) with their number. Ends after
    /// [`BrokerHandle::shutdown`]. While no stream is open, the broker builds no events.
    pub fn events(&self) -> EventStream {
        self.inner.events.subscribe()
    }

    /// The configuration the broker runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The broker's counters now: a snapshot of plain values (what `$SYS` and `/metrics`
    /// report), taken at each call; read it again to see later activity.
    pub fn stats(&self) -> Stats {
        let mut stats = self.inner.stats.snapshot();
        stats.queued_bytes = self.inner.queued_memory.bytes();
        stats
    }

    /// Seconds since start.
    pub fn uptime(&self) -> Duration {
        self.inner.started.elapsed()
    }

    /// Publishes a message as if a client had, with no properties, through the entry every
    /// message takes (ARCHITECTURE.md, "One entry for every message"): the publish
    /// interceptors (which see an empty client identifier), routing, then back pressure: the
    /// future resolves once every subscriber it fed that is over its high-water mark and
    /// still taking messages is back under its low-water mark (or stalled, or gone), as a
    /// network publisher is held; in cluster mode, a QoS 1 or 2 message another node wants
    /// resolves once JetStream holds it (docs/cluster.md, "QoS across nodes").
    ///
    /// Errors: [`Error::Refused`] for an invalid topic name, a `$SYS` topic, or a refusal
    /// by a publish interceptor; in cluster mode, with reason code 0x89 (Server busy) when
    /// JetStream did not take the message within `jetstream_ack_timeout` (it is still sent)
    /// or 0x95 (Packet too large) when it never can (larger than the NATS servers'
    /// `max_payload`).
    pub async fn publish(
        &self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        retain: bool,
    ) -> Result<(), Error> {
        self.publish_with(topic, payload, qos, retain, Properties::default(), None)
            .await
    }

    /// Publishes with MQTT 5.0 properties (user properties, content type, response topic...)
    /// and an optional Message Expiry Interval in seconds; as [`BrokerHandle::publish`].
    ///
    /// Errors: as [`BrokerHandle::publish`].
    pub async fn publish_with(
        &self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        retain: bool,
        properties: Properties,
        expiry_secs: Option<u32>,
    ) -> Result<(), Error> {
        publish_as(
            &self.inner,
            None,
            topic,
            payload.into(),
            qos,
            retain,
            properties,
            expiry_secs,
        )
        .await
    }

    /// Subscribes in-process. The returned [`Subscription`] yields matching messages, retained
    /// ones first; it holds up to `max_queued_messages` (the broker's per-session queue limits
    /// apply) and unsubscribes when dropped.
    ///
    /// Errors: [`Error::Refused`] for an invalid topic filter or a stopped broker.
    pub fn subscribe(&self, filter: &str, qos: QoS) -> Result<Subscription, Error> {
        let options = SubscriptionOptions {
            qos,
            ..Default::default()
        };
        self.subscribe_with(filter, options, None)
    }

    /// Subscribes in-process with the options of an MQTT 5.0 subscription (MQTT 5.0 section
    /// 3.8.3.1): maximum QoS, No Local (messages published through this
    /// [`Subscription`]'s own [`Subscription::publish_with`] are not delivered back to it),
    /// Retain As Published (otherwise live messages arrive with RETAIN clear), Retain
    /// Handling (0: retained messages sent at subscribe; 1: only when the subscription is
    /// new; 2: never), and a Subscription Identifier (1 to 268,435,455) that
    /// [`Subscription::recv_delivery`] reports with each message it matched. Add filters to
    /// the same subscription with [`Subscription::subscribe`].
    ///
    /// Errors: [`Error::Refused`] for an invalid topic filter, Retain Handling above 2, an
    /// identifier out of range, No Local on a shared subscription [MQTT-3.8.3-4], or a
    /// stopped broker.
    pub fn subscribe_with(
        &self,
        filter: &str,
        options: SubscriptionOptions,
        identifier: Option<u32>,
    ) -> Result<Subscription, Error> {
        check_subscription(filter, &options, identifier)?;
        if self.inner.is_shutting_down() {
            return Err(Error::Refused("the broker is shutting down".into()));
        }
        let n = self
            .inner
            .next_client_number
            .fetch_add(1, Ordering::Relaxed);
        let id: Arc<str> = Arc::from(format!("{INTERNAL_PREFIX}{n}"));
        let (session, _) = self.inner.internal_session(&id);
        let link = Arc::new(Link::new());
        session.attach(&link, ProtocolVersion::V5, u32::MAX, &mut None);
        let (tx, rx) = mpsc::channel(64);
        let pump = tokio::spawn(pump(
            Arc::clone(&self.inner),
            Arc::clone(&session),
            Arc::clone(&link),
            tx,
        ));
        let sub = Subscription {
            rx,
            broker: Arc::clone(&self.inner),
            session,
            pump,
        };
        sub.add(filter, options, identifier);
        Ok(sub)
    }

    /// Opens the durable in-process client `name` (docs/embedding.md, "Durable in-process
    /// clients"): its session `$internal/client/<name>` is kept like a network client's
    /// (stored with a storage backend, resumed after a restart, ended after its Session
    /// Expiry Interval), and its QoS 1 messages are handed over within a window of
    /// `options`' receive maximum until the application acknowledges them
    /// ([`Received::ack`]); those it had not acknowledged are handed over again, DUP set,
    /// when it is opened again.
    ///
    /// Errors: [`Error::Refused`] for an empty name (or one over 65,535 bytes, or with NUL),
    /// a name whose `Client` is open already, or a stopped broker.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), mercurio_core::Error> {
    /// use mercurio_core::codec::QoS;
    /// use mercurio_core::config::Config;
    /// use mercurio_core::{Broker, ClientOptions};
    ///
    /// let config = Config { listeners: Vec::new(), ..Config::default() };
    /// let handle = Broker::builder(config).start().await?;
    /// let options = ClientOptions::default().receive_maximum(10);
    /// let mut worker = handle.client("worker", options)?;
    /// worker.subscribe("jobs/#", QoS::AtLeastOnce)?;
    /// handle.publish("jobs/1", "resize", QoS::AtLeastOnce, false).await?;
    /// let job = worker.recv().await.expect("the broker runs");
    /// assert_eq!((job.message.topic.as_str(), job.dup), ("jobs/1", false));
    /// job.ack(); // handled: it leaves the session
    ///
    /// drop(worker); // the session is kept (never expires by default)...
    /// handle.publish("jobs/2", "crop", QoS::AtLeastOnce, false).await?;
    /// let mut worker = handle.client("worker", options)?;
    /// assert!(worker.resumed()); // ...and resumed with what was queued meanwhile
    /// assert_eq!(worker.recv().await.expect("queued").message.topic, "jobs/2");
    /// handle.shutdown().await;
    /// # Ok(()) }
    /// ```
    pub fn client(&self, name: &str, options: ClientOptions) -> Result<Client, Error> {
        Client::open(&self.inner, name, options)
    }

    /// Closes a client's connection (5.0 clients get DISCONNECT 0x98, Administrative action).
    /// Returns false when no such client is connected.
    pub fn disconnect(&self, client_id: &str) -> bool {
        if client_id.starts_with(INTERNAL_PREFIX) {
            // An in-process subscription, not a client (see `sessions`).
            return false;
        }
        let link = self
            .inner
            .sessions
            .lock()
            .get(client_id)
            .and_then(|s| s.link());
        match link {
            Some(link) => {
                link.kill(
                    DisconnectReason::Administrative,
                    ReasonCode::ADMINISTRATIVE_ACTION,
                );
                true
            }
            None => false,
        }
    }

    /// Answers an admin request about the access rules kept in storage (`user.*`,
    /// `group.*`, `role.*`, `acl.*` of [`admin::Request`](crate::admin::Request)); `None` for
    /// any other request. A change is stored before it is answered and applies at once: to
    /// new connections, and, for rules, to connected clients as an ACL reload does (the
    /// subscriptions and queued messages they may no longer hold are dropped, counted
    /// `not_authorized`); a removed user's clients are disconnected (5.0: DISCONNECT 0x98,
    /// Administrative action). Refused as `unsupported` unless `[auth] backend = "storage"`.
    pub async fn access(&self, request: &crate::admin::Request) -> Option<crate::admin::Answer> {
        if !request.is_access() {
            return None;
        }
        let Some(stored) = &self.inner.stored_access else {
            return Some(crate::admin::Answer::refused(
                crate::admin::ErrorCode::Unsupported,
                "users, groups and roles are kept in storage only with [auth] backend = \"storage\"",
            ));
        };
        let (answer, effect) = stored.answer(request).await?;
        let mut disconnected = 0usize;
        if let Some(user) = &effect.removed_user {
            let sessions: Vec<Arc<Session>> =
                self.inner.sessions.lock().values().cloned().collect();
            for s in sessions.iter().filter(|s| !s.is_internal()) {
                let owned = matches!(
                    &*s.identity.read(),
                    crate::auth::Identity::Client { username: Some(u), .. } if **u == **user
                );
                if let (true, Some(link)) = (owned, s.link()) {
                    link.kill(
                        DisconnectReason::Administrative,
                        ReasonCode::ADMINISTRATIVE_ACTION,
                    );
                    disconnected += 1;
                }
            }
        }
        if effect.rules_changed {
            self.inner.revoke_unauthorized();
        }
        Some(match answer {
            crate::admin::Answer::Ok(_) if effect.removed_user.is_some() => {
                crate::admin::Answer::Ok(serde_json::json!({ "disconnected": disconnected }))
            }
            other => other,
        })
    }

    /// Every session the broker holds, connected or not (in-process subscriptions excluded).
    pub fn sessions(&self) -> Vec<SessionInfo> {
        let sessions: Vec<Arc<Session>> = self.inner.sessions.lock().values().cloned().collect();
        sessions
            .iter()
            .filter(|s| !s.is_internal())
            .map(|s| SessionInfo::of(s, &s.state.lock()))
            .collect()
    }

    /// Reads the password file, the ACL file and the TLS certificates and keys again (what
    /// the daemon does on SIGHUP). Connected clients stay connected; a client whose
    /// permissions shrank loses the subscriptions it may no longer hold. A file that cannot be
    /// used keeps its old contents, and is in the returned errors.
    pub fn reload(&self) -> Result<(), Vec<FileError>> {
        let mut errors = self.inner.reload_auth();
        for t in self.tls.iter() {
            if let Err(e) = t.reload() {
                errors.push(e);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// Every stream (`[[streams]]`), in configuration order: what it holds, its bounds, its
    /// readers and what retention removed (`mercurioctl stream list`).
    pub fn streams(&self) -> Vec<crate::streams::StreamInfo> {
        self.inner.streams.all().iter().map(|s| s.info()).collect()
    }

    /// Creates a stream while the broker runs (`mercurioctl stream create`): empty, its
    /// offsets from 1, taking the messages published from now on; stored with the broker's
    /// state (SQLite, PostgreSQL), so that it is back after a restart. Errors: a bad name or
    /// filter, a name in use.
    pub fn create_stream(
        &self,
        config: crate::config::StreamConfig,
    ) -> Result<crate::streams::StreamInfo, crate::streams::StreamRefused> {
        let stream = self.inner.streams.create(config)?;
        tracing::info!(stream = %stream.name(), "stream created");
        if stream.config.max_bytes == 0 {
            tracing::warn!(
                stream = %stream.name(),
                "stream created without max_bytes: it grows with what is published to its filter \
                 (in storage, or in memory without storage)"
            );
        }
        Ok(stream.info())
    }

    /// Deletes a stream created at run time (`mercurioctl stream delete`): its readers
    /// stop, its messages go, from storage too. Errors: no such stream, or one of the
    /// configuration file (removed from the file, it goes at the next start).
    pub fn delete_stream(&self, name: &str) -> Result<(), crate::streams::StreamRefused> {
        self.inner.streams.delete(name)?;
        tracing::info!(stream = %name, "stream deleted");
        Ok(())
    }

    /// Every configured bridge: its state and counters (`mercurioctl bridge list`).
    pub fn bridges(&self) -> Vec<BridgeInfo> {
        let list: Vec<_> = self.inner.bridges.lock().clone();
        let mut infos: Vec<BridgeInfo> = list.iter().map(|b| b.info()).collect();
        infos.sort_by(|a, b| a.name.cmp(&b.name));
        infos
    }

    /// Applies a new `[[bridges]]` list (validated, as [`Config::validate`] does): added
    /// bridges start, removed ones stop and their queues are deleted, changed ones restart
    /// with their queues kept, the others go on untouched. A bridge whose TLS files cannot be
    /// used keeps running as it was, and its error is returned with the others' report.
    pub async fn reload_bridges(
        &self,
        bridges: &[crate::config::BridgeConfig],
    ) -> (BridgeReload, Vec<FileError>) {
        self.bridges.reload(bridges).await
    }

    /// The cluster as this node sees it (`cluster.status`, docs/cluster.md "Status"): this
    /// node, the totals over the nodes up, and every node known, this one first, then by
    /// name. `None` while cluster mode is off.
    pub fn cluster_status(&self) -> Option<crate::admin::ClusterStatus> {
        use crate::admin::{ClusterNode, NodeState};
        let b = &self.inner;
        let own_clients = b.stats.clients_connected.load(Ordering::Relaxed);
        let info = b.cluster_info()?;
        let node = b.config.cluster.node_name.clone();
        let state = if info.degraded {
            NodeState::Degraded
        } else {
            NodeState::Connected
        };
        let since = b.cluster.connected_since.load(Ordering::Relaxed);
        let mut members = vec![ClusterNode {
            node: node.clone(),
            state,
            this: true,
            clients: own_clients,
            // As `broker status` counts them: without the broker's own sessions.
            sessions: b.session_counts().0 as u64,
            version: env!("CARGO_PKG_VERSION").to_string(),
            connected_since: (since > 0).then_some(since),
            last_heartbeat_ms: None,
            interest: Some(b.cluster.interest.lock().keys.len() as u64),
        }];
        let now = std::time::Instant::now();
        let mut peers: Vec<ClusterNode> = b
            .cluster
            .peers
            .lock()
            .values()
            .map(|p| ClusterNode {
                node: p.heartbeat.node.clone(),
                state: if p.up(now) {
                    NodeState::Up
                } else {
                    NodeState::Gone
                },
                this: false,
                clients: p.heartbeat.clients,
                sessions: p.heartbeat.sessions,
                version: p.heartbeat.version.clone(),
                connected_since: Some(p.heartbeat.connected_since),
                last_heartbeat_ms: Some(now.duration_since(p.seen).as_millis() as u64),
                interest: p.interest,
            })
            .collect();
        peers.sort_by(|a, b| a.node.cmp(&b.node));
        members.extend(peers);
        Some(crate::admin::ClusterStatus {
            node,
            state,
            nodes: info.nodes,
            clients: info.clients,
            retained_stamps: b.cluster.retained.len() as u64,
            retained_out: info.retained_out,
            retained_in: info.retained_in,
            jetstream_pending_bytes: info.jetstream_pending_bytes,
            jetstream_pending_messages: info.jetstream_pending_messages,
            registry_sessions: b.registry.get().map(|r| r.owned() as u64),
            members,
        })
    }

    /// Number of retained messages held.
    pub fn retained_count(&self) -> usize {
        self.inner.retained.lock().len()
    }

    /// Bytes the retained messages take together: the topic, payload and properties of
    /// each, what `[server] max_retained_bytes` bounds.
    pub fn retained_bytes(&self) -> usize {
        self.inner.retained.lock().bytes()
    }

    /// Resolves when the broker stopped at once because of its storage: another broker took
    /// the database over (PostgreSQL epoch fencing) or it was unreachable too long. The daemon
    /// then exits with an error. Never resolves with storage that cannot fail so.
    pub async fn failed(&self) -> Arc<mercurio_storage::StorageError> {
        let mut failure = self.failure.clone();
        loop {
            if let Some(e) = failure.borrow_and_update().clone() {
                return e;
            }
            if failure.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Stops the broker gracefully: listeners stop accepting, every client is sent DISCONNECT
    /// 0x8B (Server shutting down; 3.x clients are just closed), and this waits up to
    /// [`SHUTDOWN_GRACE`] for connections to close. Calling it twice is harmless.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        if inner.shutting_down.swap(true, Ordering::AcqRel) {
            return self.wait_closed(SHUTDOWN_GRACE).await;
        }
        inner.stop_listeners.notify_waiters();
        inner.busy_poll.stop();
        // Bridges first: their remotes get state 0 and DISCONNECT, their queues stay stored.
        self.bridges.stop_all().await;
        #[cfg(feature = "cluster")]
        if let Some(cluster) = &self.cluster {
            cluster.stop(inner).await;
        }
        inner.close_all(DisconnectReason::Shutdown, ReasonCode::SERVER_SHUTTING_DOWN);
        self.wait_closed(SHUTDOWN_GRACE).await;
        if let Some(p) = inner.persist.get() {
            // Everything the sessions changed, written and synced; the database released.
            p.close().await;
        }
        inner.events.stop();
    }

    /// Deletes the session of a client that is not connected, as its expiry would (a pending
    /// will is published), from memory and from storage, including a session set aside at
    /// start because it could not be read (`mercurioctl client delete-session`). Its client
    /// then connects with a new session. A durable in-process [`Client`]'s session is
    /// `$internal/client/<name>` (open: `Ok(Some(false))`); other in-process sessions are
    /// not deleted here (`Ok(None)`).
    ///
    /// Returns `Ok(None)` when there was no such session, `Ok(Some(false))` when the client
    /// is connected (nothing is done: disconnect it first), `Ok(Some(true))` when deleted.
    ///
    /// Errors: [`Error::Storage`] when storage fails.
    pub async fn delete_session(&self, client_id: &str) -> Result<Option<bool>, Error> {
        if client_id.starts_with(INTERNAL_PREFIX) && !client::is_client_session(client_id) {
            return Ok(None);
        }
        let session = self.inner.sessions.lock().get(client_id).cloned();
        let mut existed = false;
        if let Some(session) = session {
            {
                let st = session.state.lock();
                if st.is_connected() {
                    return Ok(Some(false));
                }
                existed = !st.ended();
            }
            self.inner.end_session(&session);
            // A connection that took the session over between the check and its end holds
            // an ended session: close it, so that the client reconnects to a new one.
            let late = session.link();
            if let Some(link) = late {
                link.kill(
                    DisconnectReason::Administrative,
                    ReasonCode::ADMINISTRATIVE_ACTION,
                );
            }
        }
        if let Some(p) = self.inner.persist.get() {
            existed |= p.delete_session(client_id).await?;
            self.inner
                .stats
                .storage_sessions_set_aside
                .store(p.set_aside_count() as u64, Ordering::Relaxed);
        }
        Ok(existed.then_some(true))
    }

    /// Returns once every change made so far is written to storage and synced (at once
    /// with the memory backend).
    pub async fn flush_storage(&self) {
        if let Some(p) = self.inner.persist.get() {
            p.flush().await;
        }
    }

    /// `Some` while storage takes no writes: every attempt has failed for a second or more
    /// (a full disk, a database that cannot be reached), with the last error. Meanwhile the
    /// broker retries, serves what needs no storage, and holds back the clients whose
    /// changes wait (`[storage] max_pending_bytes`); `/healthz` answers 503. `None` with the
    /// memory backend and while writes succeed.
    pub fn storage_write_failure(&self) -> Option<WriteFailure> {
        self.inner.persist.get().and_then(|p| p.write_failure())
    }

    async fn wait_closed(&self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let notified = self.inner.connection_closed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let open = self.inner.open_connections.load(Ordering::Relaxed);
            if open == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                tracing::warn!(
                    open,
                    "shutdown: connections still open after the grace period"
                );
                return;
            }
        }
    }

    /// One session in detail (for `mercurioctl client show`); `None` when the broker holds
    /// no session for `client_id`.
    pub fn session_detail(&self, client_id: &str) -> Option<SessionDetail> {
        if client_id.starts_with(INTERNAL_PREFIX) {
            return None;
        }
        let session = self.inner.sessions.lock().get(client_id).cloned()?;
        let link = session.link();
        let address = link.as_ref().and_then(|link| link.peer());
        let thread = link
            .filter(|_| self.inner.shards.is_some())
            .map(|link| link.shard());
        let st = session.state.lock();
        if st.ended() {
            return None;
        }
        let mut subscriptions: Vec<(String, QoS)> = st
            .subscriptions()
            .iter()
            .map(|(filter, granted)| (filter.clone(), granted.options.qos))
            .collect();
        subscriptions.sort();
        Some(SessionDetail {
            info: SessionInfo::of(&session, &st),
            subscriptions,
            expiry_interval: st.expiry_interval(),
            queued_bytes: st.queue().bytes(),
            queued_in_storage: st.backlog().map_or(0, |b| b.len),
            will: st.will().is_some(),
            disconnected_for: st.disconnected_at().map(|at| at.elapsed()),
            address,
            thread,
        })
    }
}

/// What [`BrokerHandle::session_detail`] reports of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionDetail {
    pub info: SessionInfo,
    /// Topic filters with their granted QoS, sorted by filter.
    pub subscriptions: Vec<(String, QoS)>,
    /// Session Expiry Interval in seconds (`u32::MAX`: never).
    pub expiry_interval: u32,
    /// Bytes of queued messages (topic, properties and payload of each, as `max_queued_bytes`
    /// counts them).
    pub queued_bytes: u64,
    /// How many of `info.queued` are in storage only (left there at a restart or by
    /// `max_queued_memory`), read when the client comes back; their bytes are not in
    /// `queued_bytes` until then. 0 with the memory backend.
    pub queued_in_storage: u64,
    /// Whether a will is pending.
    pub will: bool,
    /// Time since the connection ended; `None` while connected.
    pub disconnected_for: Option<Duration>,
    /// The connected client's address and port: the one a PROXY protocol header gave
    /// (`proxy_protocol`), else the socket's peer. `None` while disconnected.
    pub address: Option<SocketAddr>,
    /// The thread that serves the connection (or served it last, if it is parked), from 0,
    /// when the broker serves clients on more than one ([`BrokerBuilder::shards`]); `None`
    /// with one thread or while disconnected.
    pub thread: Option<usize>,
}
