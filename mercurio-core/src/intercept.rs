//! Interception: the application's hooks on what enters the broker. SUBSCRIBE interception
//! ([`SubscribeInterceptor`]) is at the end of this module.
//!
//! Publish interception: an application's hook that sees every message entering the broker
//! (ARCHITECTURE.md, "One entry for every message": a client's PUBLISH, a message a bridge
//! brings in from its remote, the application's own
//! [`BrokerHandle::publish`](crate::BrokerHandle::publish), a will), after the authorizers
//! allowed it and before it is retained and routed, and may let it through, change its topic,
//! payload or properties, or refuse it with a reason code. The broker's own `$SYS` messages
//! are not intercepted.
//!
//! Installed with [`BrokerBuilder::interceptor`](crate::BrokerBuilder::interceptor). Without
//! one, a PUBLISH pays one length check: nothing is built and nothing awaited.

use async_trait::async_trait;
use bytes::Bytes;

use crate::codec::{Properties, QoS, ReasonCode};

/// A PUBLISH as an interceptor sees it: who sent it (read only) and what it carries, which the
/// interceptor may change.
#[derive(Debug)]
pub struct InterceptedPublish<'a> {
    pub(crate) client_id: &'a str,
    pub(crate) username: Option<&'a str>,
    pub(crate) qos: QoS,
    pub(crate) retain: bool,
    pub(crate) topic: String,
    pub(crate) payload: Bytes,
    pub(crate) properties: Properties,
}

impl InterceptedPublish<'_> {
    /// The publisher's client identifier: a network client's; `$internal/bridge/<name>` for
    /// a message a bridge brings in; `$internal/N` for a publish through an in-process
    /// [`Subscription`](crate::Subscription); empty for
    /// [`BrokerHandle::publish`](crate::BrokerHandle::publish); a will's client for a will.
    pub fn client_id(&self) -> &str {
        self.client_id
    }

    /// The user name the publisher authenticated as; `None` when anonymous, for the broker's
    /// own sessions (bridges, in-process) and for a will.
    pub fn username(&self) -> Option<&str> {
        self.username
    }

    /// The QoS it was published with.
    pub fn qos(&self) -> QoS {
        self.qos
    }

    /// Its RETAIN flag.
    pub fn retain(&self) -> bool {
        self.retain
    }

    /// The topic name (a topic alias already resolved).
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Routes the message to another topic name. It must be a valid topic name outside
    /// `$SYS` (no wildcards, not empty): otherwise the PUBLISH is refused with 0x90 (Topic
    /// Name invalid) and a warning is logged.
    pub fn set_topic(&mut self, topic: impl Into<String>) {
        self.topic = topic.into();
    }

    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    /// Replaces the payload.
    pub fn set_payload(&mut self, payload: impl Into<Bytes>) {
        self.payload = payload.into();
    }

    /// The MQTT 5.0 properties (empty for 3.x publishers), Message Expiry Interval included.
    pub fn properties(&self) -> &Properties {
        &self.properties
    }

    /// The properties, to change: user properties, content type, response topic,
    /// correlation data, payload format indicator, Message Expiry Interval. A Topic Alias
    /// or Subscription Identifiers set here are ignored (they belong to one connection).
    pub fn properties_mut(&mut self) -> &mut Properties {
        &mut self.properties
    }
}

/// An interceptor's answer (publish or subscribe).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Let the message through, with whatever changes were made to it.
    Accept,
    /// Refuse it: it is neither retained nor delivered. An MQTT 5.0 publisher gets this
    /// reason code in its PUBACK or PUBREC (one of 0x80 Unspecified error, 0x83
    /// Implementation specific error, 0x87 Not authorized, 0x90 Topic Name invalid,
    /// 0x97 Quota exceeded, 0x99 Payload format invalid; any other becomes 0x80). A 3.x
    /// publisher, which has no way to be told, is acknowledged as usual.
    ///
    /// From a [`SubscribeInterceptor`]: the filter is not subscribed, and the SUBACK carries
    /// this reason code for it (see [`SubscribeInterceptor`] for those allowed; a 3.x
    /// client gets 0x80 Failure).
    Refuse(ReasonCode),
}

/// Sees every message entering the broker after authorization and before routing.
///
/// Asked from the publisher's task, which awaits the answer (a client's or a bridge's next
/// packets wait too, an in-process `publish` future does not resolve; a will is asked on a
/// task of its own). The task runs on the broker's runtime threads, so `intercept` must not
/// block the thread: a blocking call (synchronous I/O, `std::thread::sleep`, a lock held
/// long) stalls every client that thread serves (all of them with one event loop), not only
/// this publisher. Run blocking work with `tokio::task::spawn_blocking` and await it; an
/// interceptor that awaits holds back only its own publisher. Several interceptors run in the
/// order they were added, each seeing the changes of those before; the first refusal stops
/// the chain.
///
/// A panic in `intercept` is caught and logged (error level, with the client identifier),
/// and costs only that PUBLISH: an MQTT 5.0 publisher at QoS 1 or 2 gets PUBACK / PUBREC 0x80
/// Unspecified error; a 3.x publisher, or one at QoS 0, has no way to be told but the close
/// of its connection (5.0: DISCONNECT 0x80). It can connect again at once.
#[async_trait]
pub trait PublishInterceptor: Send + Sync + 'static {
    async fn intercept(&self, publish: &mut InterceptedPublish<'_>) -> Verdict;
}

/// The reason code a refusal is sent with: one PUBACK and PUBREC allow for a refusal
/// (MQTT 5.0 sections 3.4.2.1 and 3.5.2.1), else 0x80.
pub(crate) fn refusal_code(rc: ReasonCode) -> ReasonCode {
    match rc.0 {
        0x80 | 0x83 | 0x87 | 0x90 | 0x97 | 0x99 => rc,
        _ => ReasonCode::UNSPECIFIED_ERROR,
    }
}

/// One topic filter of a SUBSCRIBE as a [`SubscribeInterceptor`] sees it: who asks (read
/// only), the filter and the QoS it asks for, which the interceptor may rewrite or lower.
#[derive(Debug)]
pub struct InterceptedSubscribe<'a> {
    pub(crate) client_id: &'a str,
    pub(crate) username: Option<&'a str>,
    pub(crate) filter: String,
    pub(crate) qos: QoS,
}

impl InterceptedSubscribe<'_> {
    /// The subscriber's client identifier.
    pub fn client_id(&self) -> &str {
        self.client_id
    }

    /// The user name the subscriber authenticated as; `None` when anonymous.
    pub fn username(&self) -> Option<&str> {
        self.username
    }

    /// The topic filter (a shared subscription's whole `$share/<group>/<filter>`, with the
    /// listener's `mount_point` already applied).
    pub fn filter(&self) -> &str {
        &self.filter
    }

    /// Subscribes to another filter instead: what the subscription then matches, and the
    /// filter it is stored, listed and unsubscribed under. It must be a valid topic filter
    /// (or shared subscription): otherwise the SUBSCRIBE's filter is refused with 0x8F
    /// (Topic Filter invalid) and a warning is logged.
    pub fn set_filter(&mut self, filter: impl Into<String>) {
        self.filter = filter.into();
    }

    /// The maximum QoS asked for (already lowered to `[server] max_qos`).
    pub fn qos(&self) -> QoS {
        self.qos
    }

    /// Grants a lower maximum QoS, which the SUBACK reports; one higher than asked is
    /// ignored (a subscription never gets more than its SUBSCRIBE asked for).
    pub fn set_qos(&mut self, qos: QoS) {
        self.qos = self.qos.min(qos);
    }
}

/// Sees each topic filter of every network client's SUBSCRIBE after the authorizers allowed
/// it and before it is recorded, and may let it through, rewrite its filter, lower its QoS,
/// or refuse it with a reason code that the client gets in its SUBACK.
///
/// Asked from the subscriber's reader task, which awaits the answer (the client's next
/// packets wait), with none of the broker's locks held; like [`PublishInterceptor`] it must
/// not block its thread. Several run in the order they were added, each seeing the changes
/// of those before; the first refusal stops the chain. In-process subscriptions
/// ([`BrokerHandle::subscribe`](crate::BrokerHandle::subscribe),
/// [`Client::subscribe`](crate::Client::subscribe)) are the application's own and are not
/// intercepted. A panic is caught and logged, and refuses that filter with 0x80.
#[async_trait]
pub trait SubscribeInterceptor: Send + Sync + 'static {
    async fn intercept(&self, subscribe: &mut InterceptedSubscribe<'_>) -> Verdict;
}

/// The reason code a refused filter gets in SUBACK: one SUBACK allows for a failure (MQTT
/// 5.0 section 3.9.3: 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2), else 0x80.
pub(crate) fn suback_refusal(rc: ReasonCode) -> ReasonCode {
    match rc.0 {
        0x80 | 0x83 | 0x87 | 0x8F | 0x91 | 0x97 | 0x9E | 0xA1 | 0xA2 => rc,
        _ => ReasonCode::UNSPECIFIED_ERROR,
    }
}

/// Runs the SUBSCRIBE interceptors on one filter of `client_id`'s SUBSCRIBE (`qos` the QoS
/// asked for, lowered in place; `no_local` its No Local option). Returns the filter to
/// subscribe (rewritten or not), or the reason code of a refusal for the SUBACK: the
/// interceptor's ([`suback_refusal`]), 0x8F for a rewritten filter that is not valid (or a
/// shared one with No Local), 0x80 for a panic (logged).
pub(crate) async fn intercept_subscribe(
    interceptors: &[std::sync::Arc<dyn SubscribeInterceptor>],
    client_id: &str,
    username: Option<&str>,
    filter: String,
    qos: &mut QoS,
    no_local: bool,
) -> Result<String, ReasonCode> {
    let mut subscribe = InterceptedSubscribe {
        client_id,
        username,
        filter,
        qos: *qos,
    };
    for i in interceptors {
        let verdict = crate::hook::guard(
            "subscribe interceptor",
            client_id,
            i.intercept(&mut subscribe),
        )
        .await
        .unwrap_or(Verdict::Refuse(ReasonCode::UNSPECIFIED_ERROR));
        if let Verdict::Refuse(rc) = verdict {
            tracing::debug!(client_id, filter = %subscribe.filter, reason = %rc, "SUBSCRIBE refused by an interceptor");
            return Err(suback_refusal(rc));
        }
    }
    let valid = match crate::topic::parse_shared(&subscribe.filter) {
        Ok(Some(_)) => !no_local,
        Ok(None) => crate::topic::validate_topic_filter(&subscribe.filter).is_ok(),
        Err(_) => false,
    };
    if !valid {
        tracing::warn!(client_id, filter = %subscribe.filter, "a subscribe interceptor set an invalid topic filter: refused");
        return Err(ReasonCode::TOPIC_FILTER_INVALID);
    }
    *qos = subscribe.qos;
    Ok(subscribe.filter)
}
