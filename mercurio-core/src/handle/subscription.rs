//! The in-process client of the embedding API: [`Subscription`] (made by
//! [`BrokerHandle::subscribe`](super::BrokerHandle::subscribe)), what it receives
//! ([`Delivered`]), and the checks and publishing it shares with the handle.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::broker::drain::{Outlet, Unsent};
use crate::broker::BrokerState;
use crate::codec::{Properties, Publish, QoS, ReasonCode, SubscriptionOptions};
use crate::error::Error;
use crate::link::Link;
use crate::message::Message;
use crate::session::{Delivery, Granted, Session};
use crate::stats::DropCause;
use crate::topic;

/// Publishes for the application through the entry every message takes
/// ([`BrokerState::enter`]): `from` is the in-process subscription's session (for its No
/// Local subscriptions), `None` for the handle's own publishes. Resolves once the message is
/// routed, the back pressure it met is over and, in cluster mode, JetStream holds a QoS 1 or
/// 2 message another node wants.
#[allow(clippy::too_many_arguments)]
pub(super) async fn publish_as(
    broker: &BrokerState,
    from: Option<&Arc<Session>>,
    topic: &str,
    payload: Bytes,
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
    properties.message_expiry_interval = expiry_secs;
    let p = Publish {
        dup: false,
        qos,
        retain,
        topic: topic.to_string(),
        packet_id: 0,
        properties,
        payload,
    };
    broker
        .enter(from, p)
        .await
        .map(|_| ())
        .map_err(|rc| match rc {
            // From JetStream (cluster mode): the entry's own codes, never an interceptor's.
            ReasonCode::SERVER_BUSY => Error::Refused(format!(
                "JetStream did not take it for the other nodes within jetstream_ack_timeout \
                 (it is still sent): {rc}"
            )),
            ReasonCode::PACKET_TOO_LARGE => Error::Refused(format!(
                "too large for the NATS servers' max_payload: not sent to the other nodes: {rc}"
            )),
            _ => Error::Refused(format!("refused by a publish interceptor: {rc}")),
        })
}

/// Checks an in-process subscription's filter, options and identifier as the broker checks
/// a SUBSCRIBE's.
pub(super) fn check_subscription(
    filter: &str,
    options: &SubscriptionOptions,
    identifier: Option<u32>,
) -> Result<(), Error> {
    let shared = match topic::parse_shared(filter) {
        Ok(Some(_)) => true,
        Ok(None) => {
            topic::validate_topic_filter(filter)
                .map_err(|e| Error::Refused(format!("filter {filter:?}: {e}")))?;
            false
        }
        Err(e) => return Err(Error::Refused(format!("filter {filter:?}: {e}"))),
    };
    if shared && options.no_local {
        return Err(Error::Refused(format!(
            "filter {filter:?}: No Local on a shared subscription"
        )));
    }
    if options.retain_handling > 2 {
        return Err(Error::Refused(format!(
            "retain handling {} (0, 1 or 2)",
            options.retain_handling
        )));
    }
    if identifier.is_some_and(|id| id == 0 || id > 268_435_455) {
        return Err(Error::Refused(
            "subscription identifier out of 1 to 268,435,455".into(),
        ));
    }
    Ok(())
}

/// Moves messages from an in-process subscription's session queue to its channel, through
/// the session's drain ([`BrokerState::drain`]): expired messages are dropped there, and
/// what waits in the queue while the channel is full holds publishers back as a slow
/// network client would.
pub(super) async fn pump(
    broker: Arc<BrokerState>,
    session: Arc<Session>,
    link: Arc<Link>,
    tx: mpsc::Sender<Delivered>,
) {
    loop {
        // Shutdown kills every link: hand over what is queued, then end the stream.
        let killed = tokio::select! {
            _ = link.wait_woken() => false,
            _ = link.wait_killed() => true,
        };
        loop {
            let drained = broker.drain(&session, &mut Channel { tx: &tx });
            if !drained.more {
                break;
            }
            // The channel is full: drain again once the application has taken one.
            match tx.reserve().await {
                Ok(permit) => drop(permit),
                Err(_) => return,
            }
        }
        if killed || tx.is_closed() {
            return;
        }
    }
}

/// An in-process subscription's channel as the drain's [`Outlet`]: it acknowledges nothing,
/// so every message leaves the session as it is handed over.
struct Channel<'a> {
    tx: &'a mpsc::Sender<Delivered>,
}

impl Outlet for Channel<'_> {
    fn window(&self) -> Option<usize> {
        None
    }

    fn has_room(&self) -> bool {
        self.tx.capacity() > 0
    }

    fn send(&mut self, q: &Delivery, _: u16, _: bool, _: Instant) -> Result<(), Unsent> {
        let delivered = Delivered {
            message: Arc::clone(&q.msg),
            qos: q.qos,
            retain: q.retain,
            subscription_ids: q.subscription_ids.clone(),
        };
        // The pump is the only sender, and `has_room` was true: only a dropped receiver
        // (the subscription is going away) refuses it.
        self.tx.try_send(delivered).map_err(|_| Unsent::NotHere)
    }

    fn release(&mut self, _: u16) {}
}

/// One message as an in-process [`Subscription`] receives it: the message, and what this
/// delivery adds to it, as a network subscriber would see it in its PUBLISH.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub message: Arc<Message>,
    /// The lower of the message's QoS and the subscription's maximum [MQTT-3.8.4-6].
    pub qos: QoS,
    /// The RETAIN flag as delivered: set for retained messages sent at subscribe, and for
    /// live ones only under Retain As Published [MQTT-3.3.1-12].
    pub retain: bool,
    /// The Subscription Identifiers of every subscription that matched [MQTT-3.3.4-3].
    pub subscription_ids: Vec<u32>,
}

/// An in-process subscription: a bounded stream of messages, the in-process counterpart of
/// a network client's session (one or more filters, its own client identifier
/// `$internal/N`). Dropping it unsubscribes.
pub struct Subscription {
    pub(super) rx: mpsc::Receiver<Delivered>,
    pub(super) broker: Arc<BrokerState>,
    pub(super) session: Arc<Session>,
    pub(super) pump: tokio::task::JoinHandle<()>,
}

impl Subscription {
    /// The next message; `None` once the broker has stopped. A message whose Message
    /// Expiry Interval passed while it waited is not handed over (dropped, counted as
    /// `expired`) [MQTT-3.3.2-5].
    pub async fn recv(&mut self) -> Option<Arc<Message>> {
        self.recv_delivery().await.map(|d| d.message)
    }

    /// The next message with its delivery's QoS, RETAIN flag and subscription identifiers;
    /// `None` once the broker has stopped. Expired messages are skipped, as by
    /// [`Subscription::recv`].
    pub async fn recv_delivery(&mut self) -> Option<Delivered> {
        loop {
            let d = self.rx.recv().await?;
            if !d.message.is_expired(Instant::now()) {
                return Some(d);
            }
            self.broker.dropped(
                Some(&self.session.client_id),
                &d.message.topic,
                DropCause::Expired,
            );
        }
    }

    /// The client identifier of this subscription's session (`$internal/N`).
    pub fn client_id(&self) -> &str {
        &self.session.client_id
    }

    /// Adds a filter to this subscription, or replaces the options of one it has, as a
    /// SUBSCRIBE would (see [`BrokerHandle::subscribe_with`] for the options). Retained
    /// messages follow Retain Handling: with 1, only when the filter is new.
    ///
    /// Errors: as [`BrokerHandle::subscribe_with`].
    pub fn subscribe(
        &self,
        filter: &str,
        options: SubscriptionOptions,
        identifier: Option<u32>,
    ) -> Result<(), Error> {
        check_subscription(filter, &options, identifier)?;
        if self.broker.is_shutting_down() {
            return Err(Error::Refused("the broker is shutting down".into()));
        }
        self.add(filter, options, identifier);
        Ok(())
    }

    /// Removes one filter of this subscription; false when it had none such.
    pub fn unsubscribe(&self, filter: &str) -> bool {
        self.broker.unsubscribe(&self.session, filter)
    }

    /// Publishes as this subscription's session: like [`BrokerHandle::publish_with`] (the
    /// publish interceptors see this subscription's client identifier; the future waits
    /// out the back pressure of full subscribers and, in cluster mode, for JetStream to hold
    /// a QoS 1 or 2 message another node wants), but its own No Local subscriptions do not
    /// receive the message [MQTT-3.8.3-3].
    ///
    /// Errors: as [`BrokerHandle::publish_with`](super::BrokerHandle::publish_with).
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
        .await
    }

    pub(super) fn add(&self, filter: &str, options: SubscriptionOptions, identifier: Option<u32>) {
        subscribe_session(&self.broker, &self.session, filter, options, identifier);
    }
}

/// Subscribes an in-process session (checked by [`check_subscription`]) as a SUBSCRIBE
/// would: the QoS lowered to `[server] max_qos`, then retained messages as Retain Handling
/// says (with 1, only when the filter is new). Returns the granted QoS.
pub(super) fn subscribe_session(
    broker: &BrokerState,
    session: &Arc<Session>,
    filter: &str,
    mut options: SubscriptionOptions,
    identifier: Option<u32>,
) -> QoS {
    let max_qos = QoS::from_u8(broker.config.server.max_qos).unwrap_or(QoS::ExactlyOnce);
    options.qos = options.qos.min(max_qos);
    let granted = Granted {
        options,
        identifier,
    };
    let existed = broker.subscribe(session, filter, granted);
    let shared = matches!(topic::parse_shared(filter), Ok(Some(_)));
    let send = match options.retain_handling {
        0 => true,
        1 => !existed,
        _ => false,
    };
    if send && !shared {
        broker.send_retained(session, filter, &granted);
    }
    options.qos
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.pump.abort();
        self.broker.end_session(&self.session);
    }
}
