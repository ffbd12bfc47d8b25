//! The embedding API (DESIGN.md section 5): build a broker from a [`Config`], start it, and
//! drive it through a cloneable [`BrokerHandle`].

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::auth::hooks::{Authenticator, Authorizer};
use crate::auth::{Auth, FileError, Identity};
use crate::broker::BrokerInner;
use crate::codec::{Properties, ProtocolVersion, QoS, ReasonCode, SubscriptionOptions};
use crate::config::Config;
use crate::connection::{DisconnectReason, Link};
use crate::error::Error;
use crate::listener;
use crate::message::Message;
use crate::session::{Granted, Session};
use crate::stats::Stats;
use crate::tls::TlsListener;
use crate::topic;

/// How long [`BrokerHandle::shutdown`] waits for connections to close (manual, "Shutdown").
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Entry point of the embedding API.
///
/// ```no_run
/// # async fn f() -> Result<(), mercurio_core::Error> {
/// let handle = mercurio_core::Broker::builder(mercurio_core::config::Config::default()).start().await?;
/// handle.publish("greetings", "hello", mercurio_core::codec::QoS::AtMostOnce, false)?;
/// handle.shutdown().await;
/// # Ok(()) }
/// ```
pub struct Broker;

impl Broker {
    /// A builder for a broker with this configuration.
    pub fn builder(config: Config) -> BrokerBuilder {
        BrokerBuilder {
            config,
            authenticators: Vec::new(),
            authorizers: Vec::new(),
        }
    }
}

/// Builds and starts a broker.
pub struct BrokerBuilder {
    config: Config,
    authenticators: Vec<Arc<dyn Authenticator>>,
    authorizers: Vec<Arc<dyn Authorizer>>,
}

impl BrokerBuilder {
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

    /// Binds every listener and starts serving. Returns once all listeners are bound.
    ///
    /// Errors: [`Error::Bind`] when an address is in use or not available,
    /// [`Error::Config`] for a configuration this build cannot serve (WebSocket),
    /// [`Error::File`] for a password, ACL, certificate or key file that cannot be used.
    /// Must be called inside a Tokio runtime.
    pub async fn start(self) -> Result<BrokerHandle, Error> {
        let auth = Auth::from_config(&self.config, self.authenticators, self.authorizers)?;
        let mut tls = Vec::with_capacity(self.config.listeners.len());
        for l in &self.config.listeners {
            tls.push(match l.cert_file {
                Some(_) => Some(Arc::new(TlsListener::load(l)?)),
                None => None,
            });
        }
        let bound = listener::bind_all(&self.config.listeners).await?;
        let mut inner = BrokerInner::new(self.config);
        inner.auth = auth;
        let inner = Arc::new(inner);
        let mut addrs = Vec::new();
        for ((l, cfg), tls) in bound.into_iter().zip(tls.iter().cloned()) {
            let addr = l.local_addr().map_err(|source| Error::Bind {
                addr: format!("{}:{}", cfg.host, cfg.port),
                source,
            })?;
            addrs.push(addr);
            tokio::spawn(listener::run(Arc::clone(&inner), l, cfg, tls));
        }
        *inner.local_addrs.lock() = addrs;
        Ok(BrokerHandle {
            inner,
            tls: Arc::new(tls.into_iter().flatten().collect()),
        })
    }
}

/// A handle on a running broker. Cheap to clone; every clone drives the same broker.
#[derive(Clone)]
pub struct BrokerHandle {
    inner: Arc<BrokerInner>,
    /// The TLS listeners, for [`BrokerHandle::reload`].
    tls: Arc<Vec<Arc<TlsListener>>>,
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

impl BrokerHandle {
    /// The addresses the listeners are bound to, in configuration order (useful with port 0).
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.inner.local_addrs.lock().clone()
    }

    /// The configuration the broker runs with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The broker's counters.
    pub fn stats(&self) -> &Stats {
        &self.inner.stats
    }

    /// Seconds since start.
    pub fn uptime(&self) -> Duration {
        self.inner.started.elapsed()
    }

    /// Publishes a message as if a client had, with no properties.
    ///
    /// Errors: [`Error::Refused`] for an invalid topic name or a `$SYS` topic.
    pub fn publish(
        &self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        retain: bool,
    ) -> Result<(), Error> {
        self.publish_with(topic, payload, qos, retain, Properties::default(), None)
    }

    /// Publishes with MQTT 5.0 properties (user properties, content type, response topic...)
    /// and an optional Message Expiry Interval in seconds.
    pub fn publish_with(
        &self,
        topic: &str,
        payload: impl Into<Bytes>,
        qos: QoS,
        retain: bool,
        mut properties: Properties,
        expiry_secs: Option<u32>,
    ) -> Result<(), Error> {
        topic::validate_topic_name(topic)
            .map_err(|e| Error::Refused(format!("topic {topic:?}: {e}")))?;
        if topic.starts_with("$SYS") {
            return Err(Error::Refused("$SYS topics are the broker's own".into()));
        }
        properties.topic_alias = None;
        properties.subscription_identifiers.clear();
        properties.message_expiry_interval = None;
        self.inner.publish(Message {
            topic: topic.to_string(),
            payload: payload.into(),
            qos,
            retain,
            properties,
            expires_at: expiry_secs.map(|s| Instant::now() + Duration::from_secs(u64::from(s))),
            publisher: None,
        });
        Ok(())
    }

    /// Subscribes in-process. The returned [`Subscription`] yields matching messages, retained
    /// ones first; it holds up to `max_queued_messages` (the broker's per-session queue limits
    /// apply) and unsubscribes when dropped.
    ///
    /// Errors: [`Error::Refused`] for an invalid topic filter or a stopped broker.
    pub fn subscribe(&self, filter: &str, qos: QoS) -> Result<Subscription, Error> {
        match topic::parse_shared(filter) {
            Ok(Some(_)) => {}
            Ok(None) => topic::validate_topic_filter(filter)
                .map_err(|e| Error::Refused(format!("filter {filter:?}: {e}")))?,
            Err(e) => return Err(Error::Refused(format!("filter {filter:?}: {e}"))),
        }
        if self.inner.is_shutting_down() {
            return Err(Error::Refused("the broker is shutting down".into()));
        }
        let n = self
            .inner
            .next_client_number
            .fetch_add(1, Ordering::Relaxed);
        let id: Arc<str> = Arc::from(format!("$internal/{n}"));
        let session = Arc::new(Session::new(Arc::clone(&id), ProtocolVersion::V5, u32::MAX));
        *session.identity.write() = Identity::Trusted;
        let link = Arc::new(Link::new());
        session.state.lock().link = Some(Arc::clone(&link));
        self.inner
            .sessions
            .lock()
            .insert(Arc::clone(&id), Arc::clone(&session));
        let granted = Granted {
            options: SubscriptionOptions {
                qos,
                ..Default::default()
            },
            identifier: None,
        };
        self.inner.subscribe(&session, filter, granted);
        let (tx, rx) = mpsc::channel(64);
        let pump = tokio::spawn(pump(Arc::clone(&session), Arc::clone(&link), tx));
        self.inner.send_retained(&session, filter, &granted);
        Ok(Subscription {
            rx,
            broker: Arc::clone(&self.inner),
            session,
            pump,
        })
    }

    /// Closes a client's connection (5.0 clients get DISCONNECT 0x98, Administrative action).
    /// Returns false when no such client is connected.
    pub fn disconnect(&self, client_id: &str) -> bool {
        let link = self
            .inner
            .sessions
            .lock()
            .get(client_id)
            .and_then(|s| s.state.lock().link.clone());
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

    /// Every session the broker holds, connected or not (in-process subscriptions excluded).
    pub fn sessions(&self) -> Vec<SessionInfo> {
        let sessions: Vec<Arc<Session>> = self.inner.sessions.lock().values().cloned().collect();
        sessions
            .iter()
            .filter(|s| !s.client_id.starts_with("$internal/"))
            .map(|s| {
                let st = s.state.lock();
                SessionInfo {
                    client_id: s.client_id.to_string(),
                    connected: st.link.is_some(),
                    protocol_level: st.protocol.level(),
                    subscriptions: st.subscriptions.len(),
                    queued: st.queue.len(),
                    inflight: st.inflight.len(),
                }
            })
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

    /// Number of retained messages held.
    pub fn retained_count(&self) -> usize {
        self.inner.retained.lock().len()
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
        let links: Vec<Arc<Link>> = inner
            .sessions
            .lock()
            .values()
            .filter_map(|s| s.state.lock().link.clone())
            .collect();
        for link in links {
            link.kill(DisconnectReason::Shutdown, ReasonCode::SERVER_SHUTTING_DOWN);
        }
        self.wait_closed(SHUTDOWN_GRACE).await;
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
}

/// Moves messages from an in-process subscription's session queue to its channel.
async fn pump(
    session: Arc<Session>,
    link: Arc<Link>,
    tx: mpsc::Sender<Arc<crate::message::Message>>,
) {
    loop {
        link.wait_woken().await;
        loop {
            let next = session.state.lock().pop_queued();
            let Some(q) = next else { break };
            if tx.send(q.msg).await.is_err() {
                return;
            }
        }
    }
}

/// An in-process subscription: a bounded stream of messages. Dropping it unsubscribes.
pub struct Subscription {
    rx: mpsc::Receiver<Arc<Message>>,
    broker: Arc<BrokerInner>,
    session: Arc<Session>,
    pump: tokio::task::JoinHandle<()>,
}

impl Subscription {
    /// The next message; `None` once the broker has stopped.
    pub async fn recv(&mut self) -> Option<Arc<Message>> {
        self.rx.recv().await
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.pump.abort();
        self.broker.end_session(&self.session);
    }
}
