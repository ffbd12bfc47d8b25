//! Durable in-process clients: [`Client`] (made by
//! [`BrokerHandle::client`](super::BrokerHandle::client)), a named session of the broker with
//! a network client's persistence (subscriptions, queue and unacknowledged messages stored
//! with a storage backend, its Session Expiry Interval, resumed after a restart), whose
//! messages the application acknowledges ([`Received::ack`]) as a QoS 1 subscriber sends
//! PUBACK.
//!
//! Its session is `$internal/client/<name>`, in the broker's own namespace: no network
//! client can take it, and the access checks do not apply to it. Messages leave its queue
//! through the session's drain ([`BrokerState::drain`]) into a bounded channel, with a window
//! of `receive_maximum` unacknowledged QoS 1 messages, as for a network client with that
//! Receive Maximum.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::subscription::{check_subscription, publish_as, subscribe_session};
use crate::broker::drain::{Outlet, Unsent};
use crate::broker::{BrokerState, INTERNAL_PREFIX};
use crate::codec::{Properties, ProtocolVersion, QoS, SubscriptionOptions};
use crate::error::Error;
use crate::link::Link;
use crate::message::Message;
use crate::session::{Delivery, Session};
use crate::stats::DropCause;

/// How many messages wait in a client's channel for [`Client::recv`] (QoS 1 ones are bounded
/// by the window too).
const CHANNEL: usize = 64;

/// How a [`Client`] opens its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOptions {
    clean_start: bool,
    session_expiry: u32,
    receive_maximum: u16,
}

impl Default for ClientOptions {
    /// Resume the stored session, never expire, 100 unacknowledged messages at most.
    fn default() -> Self {
        ClientOptions {
            clean_start: false,
            session_expiry: u32::MAX,
            receive_maximum: 100,
        }
    }
}

impl ClientOptions {
    /// Start a new session, ending the one kept under this name (its subscriptions and
    /// queue are dropped), as Clean Start does [MQTT-3.1.2-4]. Default false: the kept
    /// session, if any, is resumed [MQTT-3.1.2-5].
    pub fn clean_start(mut self, clean_start: bool) -> Self {
        self.clean_start = clean_start;
        self
    }

    /// Session Expiry Interval in seconds (MQTT 5.0 section 3.1.2.11.2): how long the
    /// session is kept after the [`Client`] is dropped (or the broker stopped). 0: it ends
    /// with the `Client`; `u32::MAX` (the default): never expires.
    pub fn session_expiry(mut self, seconds: u32) -> Self {
        self.session_expiry = seconds;
        self
    }

    /// The most QoS 1 messages handed over and not yet acknowledged (as Receive Maximum,
    /// MQTT 5.0 section 3.1.2.11.3); at least 1, default 100. Further ones wait in the
    /// session's queue, where the broker's queue limits apply.
    pub fn receive_maximum(mut self, window: u16) -> Self {
        self.receive_maximum = window.max(1);
        self
    }
}

/// A durable in-process client: a named session that outlives the `Client`, a restart of
/// the broker and, with PostgreSQL, a standby's takeover (with a storage backend; in
/// memory only otherwise), receiving the messages of its subscriptions as a QoS 1
/// subscriber does: each QoS 1 message is redelivered (with [`Received::dup`] set) when the
/// client is opened again, until it is acknowledged with [`Received::ack`].
///
/// The session is resumed by [`BrokerHandle::client`](super::BrokerHandle::client) with the
/// same name. Subscriptions grant at most QoS 1 (an acknowledgement is a PUBACK in effect;
/// a QoS 2 message is delivered at QoS 1 [MQTT-3.8.4-6]). Dropping the `Client` leaves the
/// session as a network client's disconnection does: QoS 0 messages waiting are dropped,
/// the rest is kept for its Session Expiry Interval.
pub struct Client {
    name: String,
    rx: mpsc::Receiver<Received>,
    broker: Arc<BrokerState>,
    session: Arc<Session>,
    link: Arc<Link>,
    pump: tokio::task::JoinHandle<()>,
    resumed: bool,
}

/// One message as a [`Client`] receives it.
#[derive(Debug)]
pub struct Received {
    /// The message.
    pub message: Arc<Message>,
    /// QoS of this delivery: the lower of the message's and the subscription's (0 or 1).
    pub qos: QoS,
    /// The RETAIN flag as delivered (set for retained messages sent at subscribe, and for
    /// live ones only under Retain As Published [MQTT-3.3.1-12]).
    pub retain: bool,
    /// Set when the message was handed over before without being acknowledged (the
    /// client, or the broker, was stopped meanwhile) [MQTT-3.3.1-1].
    pub dup: bool,
    /// The Subscription Identifiers of every subscription that matched [MQTT-3.3.4-3].
    pub subscription_ids: Vec<u32>,
    ack: Option<Ack>,
}

/// What acknowledging a QoS 1 message takes.
struct Ack {
    broker: Arc<BrokerState>,
    session: Arc<Session>,
    link: Arc<Link>,
    packet_id: u16,
}

impl std::fmt::Debug for Ack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ack")
            .field("packet_id", &self.packet_id)
            .finish()
    }
}

impl Received {
    /// Acknowledges the message: it leaves the session (and storage) and its slot of the
    /// window is free; the delivery-completed callback is told. Does nothing for a QoS 0
    /// message, or once its [`Client`] was dropped (the message is then redelivered to the
    /// next one). A QoS 1 message dropped without `ack` stays unacknowledged, holding its
    /// slot, until the client is opened again.
    pub fn ack(mut self) {
        let Some(ack) = self.ack.take() else {
            return;
        };
        let mut st = ack.session.state.lock();
        if !st.served_by(&ack.link) {
            return;
        }
        let done = st.take_inflight(&ack.session.client_id, ack.packet_id);
        drop(st);
        if let Some(q) = done {
            ack.link.wake();
            ack.broker
                .observers
                .completed(&ack.session.client_id, &q.msg, q.qos);
        }
    }
}

/// The session identifiers of in-process clients start so.
const PREFIX: &str = "client/";

/// The session identifier of the in-process client `name`.
fn session_id(name: &str) -> String {
    format!("{INTERNAL_PREFIX}{PREFIX}{name}")
}

/// True for the session of a durable in-process client.
pub(super) fn is_client_session(client_id: &str) -> bool {
    client_id
        .strip_prefix(INTERNAL_PREFIX)
        .is_some_and(|id| id.starts_with(PREFIX))
}

impl Client {
    /// Opens the client `name` (see [`BrokerHandle::client`](super::BrokerHandle::client)).
    pub(super) fn open(
        broker: &Arc<BrokerState>,
        name: &str,
        options: ClientOptions,
    ) -> Result<Client, Error> {
        if name.is_empty() || name.len() > 65_535 || name.contains('\0') {
            return Err(Error::Refused(format!(
                "client name {name:?}: 1 to 65,535 bytes without NUL"
            )));
        }
        if broker.is_shutting_down() {
            return Err(Error::Refused("the broker is shutting down".into()));
        }
        let id: Arc<str> = Arc::from(session_id(name));
        if broker.persist.get().is_some_and(|p| p.is_set_aside(&id)) {
            return Err(Error::Refused(format!(
                "client {name:?}: its stored session cannot be read (set aside): \
                 BrokerHandle::delete_session(\"{id}\") deletes it"
            )));
        }
        let (mut session, mut resumed) = broker.internal_session(&id);
        if session.is_connected() {
            return Err(Error::Refused(format!("client {name:?} is open already")));
        }
        if resumed && options.clean_start {
            broker.end_session(&session);
            (session, resumed) = broker.internal_session(&id);
        }
        let link = Arc::new(Link::new());
        if !session.attach(
            &link,
            ProtocolVersion::V5,
            options.session_expiry,
            &mut None,
        ) {
            return Err(Error::Refused(format!("client {name:?} is open already")));
        }
        if let Some(p) = broker.persist.get() {
            p.connected(&session, resumed);
        }
        let (tx, rx) = mpsc::channel(CHANNEL);
        let pump = tokio::spawn(pump(
            Arc::clone(broker),
            Arc::clone(&session),
            Arc::clone(&link),
            usize::from(options.receive_maximum),
            tx,
        ));
        // Messages kept for it (in flight, queued) go out now.
        link.wake();
        Ok(Client {
            name: name.to_string(),
            rx,
            broker: Arc::clone(broker),
            session,
            link,
            pump,
            resumed,
        })
    }

    /// The name it was opened with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The client identifier of its session (`$internal/client/<name>`), as events, hooks
    /// and interceptors see it.
    pub fn client_id(&self) -> &str {
        &self.session.client_id
    }

    /// Whether a kept session was resumed (Session Present [MQTT-3.2.2-2]).
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// The next message; `None` once the broker has stopped. A message whose Message
    /// Expiry Interval passed while it waited is not handed over (dropped, counted as
    /// `expired`) [MQTT-3.3.2-5].
    pub async fn recv(&mut self) -> Option<Received> {
        loop {
            let r = self.rx.recv().await?;
            if !r.message.is_expired(Instant::now()) {
                return Some(r);
            }
            let topic = r.message.topic.clone();
            if let Some(ack) = &r.ack {
                // Leaves flight as if acknowledged, not delivered.
                let mut st = ack.session.state.lock();
                let taken = st.served_by(&ack.link)
                    && st
                        .take_inflight(&ack.session.client_id, ack.packet_id)
                        .is_some();
                drop(st);
                if taken {
                    ack.link.wake();
                }
            }
            self.broker
                .dropped(Some(&self.session.client_id), &topic, DropCause::Expired);
        }
    }

    /// Subscribes to `filter` (a topic filter or `$share/<group>/<filter>`) at most at
    /// `qos` (QoS 2 is granted as 1); retained messages matching it are delivered first
    /// [MQTT-3.8.4-4]. The subscription is stored with the session. Returns the granted QoS.
    ///
    /// Errors: [`Error::Refused`] for an invalid filter or a stopped broker.
    pub fn subscribe(&self, filter: &str, qos: QoS) -> Result<QoS, Error> {
        let options = SubscriptionOptions {
            qos: qos.min(QoS::AtLeastOnce),
            ..Default::default()
        };
        self.subscribe_with(filter, options, None)
    }

    /// Subscribes with MQTT 5.0 subscription options (as
    /// [`BrokerHandle::subscribe_with`](super::BrokerHandle::subscribe_with); the maximum
    /// QoS is at most 1). Returns the granted QoS.
    ///
    /// Errors: as [`BrokerHandle::subscribe_with`](super::BrokerHandle::subscribe_with).
    pub fn subscribe_with(
        &self,
        filter: &str,
        mut options: SubscriptionOptions,
        identifier: Option<u32>,
    ) -> Result<QoS, Error> {
        check_subscription(filter, &options, identifier)?;
        if self.broker.is_shutting_down() {
            return Err(Error::Refused("the broker is shutting down".into()));
        }
        options.qos = options.qos.min(QoS::AtLeastOnce);
        Ok(subscribe_session(
            &self.broker,
            &self.session,
            filter,
            options,
            identifier,
        ))
    }

    /// Removes a subscription; false when it had none on `filter`.
    pub fn unsubscribe(&self, filter: &str) -> bool {
        self.broker.unsubscribe(&self.session, filter)
    }

    /// Publishes as this client, through the entry every message takes (the publish
    /// interceptors see its client identifier; its No Local subscriptions do not get it
    /// back [MQTT-3.8.3-3]). Resolves once the message is routed, the back pressure of full
    /// subscribers is over and, with `[storage] durable_ack` and QoS 1 or 2, once it is
    /// committed and synced to storage (with what it was queued for); in cluster mode, a QoS
    /// 1 or 2 message another node wants, once JetStream holds it too (docs/cluster.md, "QoS
    /// across nodes"): what a network publisher's PUBACK waits for.
    ///
    /// Errors: [`Error::Refused`] for an invalid topic name, a `$SYS` topic, a refusal by a
    /// publish interceptor, or storage that did not keep it (given up, or the broker
    /// stopped before the commit); in cluster mode, as [`BrokerHandle::publish`]'s
    /// (JetStream did not take it in time, or never can).
    ///
    /// [`BrokerHandle::publish`]: crate::BrokerHandle::publish
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

    /// [`Client::publish`] with MQTT 5.0 properties and an optional Message Expiry Interval
    /// in seconds.
    ///
    /// Errors: as [`Client::publish`].
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
            &self.broker,
            Some(&self.session),
            topic,
            payload.into(),
            qos,
            retain,
            properties,
            expiry_secs,
        )
        .await?;
        match self.broker.persist.get().filter(|p| p.durable_ack()) {
            Some(p) if qos > QoS::AtMostOnce => {
                let (tx, rx) = oneshot::channel();
                p.after_commit(Box::new(move |held| {
                    let _ = tx.send(held);
                }));
                match rx.await {
                    Ok(true) => Ok(()),
                    _ => Err(Error::Refused("storage did not keep the message".into())),
                }
            }
            _ => Ok(()),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.pump.abort();
        if tokio::runtime::Handle::try_current().is_ok() {
            self.broker.detach(&self.session, &self.link, false);
        } else {
            // Dropped after the runtime stopped: no timer can be armed; the session is left
            // as the broker's stop leaves it.
            let _ = self.session.detach(&self.link, false);
        }
    }
}

/// Moves messages from the client's session to its channel through the session's drain, as
/// a network client's writer does: in-flight ones not yet handed over on this opening first
/// (DUP), then the queue within the window. Woken by routing (a message queued) and by each
/// acknowledgement (a slot free).
async fn pump(
    broker: Arc<BrokerState>,
    session: Arc<Session>,
    link: Arc<Link>,
    window: usize,
    tx: mpsc::Sender<Received>,
) {
    loop {
        let killed = tokio::select! {
            _ = link.wait_woken() => false,
            _ = link.wait_killed() => true,
        };
        loop {
            let mut outlet = ToApp {
                tx: &tx,
                window,
                broker: &broker,
                session: &session,
                link: &link,
            };
            if !broker.drain(&session, &mut outlet).more {
                break;
            }
            match tx.reserve().await {
                Ok(permit) => drop(permit),
                Err(_) => return,
            }
        }
        if killed {
            // Shutdown: the session stays, as a network client's does when its connection
            // is closed.
            broker.detach(&session, &link, false);
            return;
        }
        if tx.is_closed() {
            return;
        }
    }
}

/// The client's channel as the drain's [`Outlet`]: a window of QoS 1 messages, each
/// carrying what acknowledging it takes.
struct ToApp<'a> {
    tx: &'a mpsc::Sender<Received>,
    window: usize,
    broker: &'a Arc<BrokerState>,
    session: &'a Arc<Session>,
    link: &'a Arc<Link>,
}

impl Outlet for ToApp<'_> {
    fn window(&self) -> Option<usize> {
        Some(self.window)
    }

    /// Room in the channel; none once the `Client` is gone (what is left stays in the
    /// session for the next one).
    fn has_room(&self) -> bool {
        self.tx.capacity() > 0 && !self.tx.is_closed()
    }

    fn send(&mut self, q: &Delivery, id: u16, dup: bool, _: Instant) -> Result<(), Unsent> {
        let ack = (q.qos > QoS::AtMostOnce).then(|| Ack {
            broker: Arc::clone(self.broker),
            session: Arc::clone(self.session),
            link: Arc::clone(self.link),
            packet_id: id,
        });
        let received = Received {
            message: Arc::clone(&q.msg),
            qos: q.qos,
            retain: q.retain,
            dup,
            subscription_ids: q.subscription_ids.clone(),
            ack,
        };
        // The pump is the only sender and `has_room` was true: only a dropped receiver
        // (the client is going away) refuses it; a QoS 1 message then stays in flight.
        self.tx.try_send(received).map_err(|_| Unsent::NotHere)
    }

    fn release(&mut self, _: u16) {}
}
