//! One entry for every message (ARCHITECTURE.md, "One entry for every message"): a network
//! client's PUBLISH, a message a bridge brings in from its remote, an application's
//! in-process publish and a will all go through the same steps, in this order:
//!
//! 1. the authorizers' write check ([`BrokerState::admit`]; the broker's own sessions, a
//!    bridge's and in-process subscriptions', are trusted; a will was checked when its
//!    CONNECT set it);
//! 2. the publish interceptors ([`BrokerState::admit`]), which may change or refuse it;
//! 3. the RETAIN flag and routing ([`BrokerState::publish_from`]), which collects the
//!    receiving sessions now at their high-water mark;
//! 4. back pressure for the entering side ([`BrokerState::wait_congested`]): the publisher
//!    waits while a session it fed is over its high-water mark and its client takes
//!    messages (a network reader stops reading its socket, a bridge its remote, an
//!    in-process `publish` future does not resolve), and while the queues together hold
//!    more than `max_queued_memory` (`memory_bound.rs`); a will has no publisher left to
//!    slow;
//! 5. storage back pressure ([`Persister::wait_room`](crate::persist::Persister::wait_room)).
//!
//! The network reader and a bridge run the steps themselves, around their packet loops (they
//! acknowledge after step 3 and wait before they decode the next packet); the embedding API
//! calls [`BrokerState::enter`], which runs them all. `$SYS` messages of the broker's own
//! ([`BrokerState::publish_sys`]) are the one exception: routed directly.

use std::sync::Arc;
use std::time::Instant;

use super::BrokerState;
use crate::auth::hooks::Action;
use crate::cluster_qos::Outcome;
use crate::codec::{Publish, ReasonCode};
use crate::intercept::{refusal_code, InterceptedPublish, Verdict};
use crate::message::Message;
use crate::session::{Session, Will};
use crate::topic;

/// The message a PUBLISH brings in, from `publisher`: its Message Expiry Interval becomes a
/// deadline counted from now (the clock is read only for a message that expires); its Topic
/// Alias and Subscription Identifiers, which belong to one connection, are not kept.
#[inline]
pub(crate) fn message_of(p: Publish, publisher: Option<Arc<str>>) -> Message {
    // Moved out whole (no `mem::take`: no default `Properties` built, then dropped).
    let Publish {
        topic,
        payload,
        qos,
        retain,
        mut properties,
        ..
    } = p;
    let expiry = properties.message_expiry_interval.take();
    properties.topic_alias = None;
    properties.subscription_identifiers.clear();
    let expires_at = expiry.and_then(|_| Message::expiry_deadline(expiry, Instant::now()));
    Message {
        topic,
        payload,
        qos,
        retain,
        properties,
        expires_at,
        publisher,
        source: None,
        encoded: Default::default(),
        stored: Default::default(),
    }
}

impl BrokerState {
    /// Steps 1 and 2 of the entry: the authorizers' write check, then the publish
    /// interceptors, for a PUBLISH from `from` (`None`: the application's own publish). The
    /// interceptors may change `p`'s topic, payload and properties. `Err` carries the reason
    /// code of a refusal (0x87 Not authorized for the authorizers'), or `None` when an
    /// interceptor panicked (caught and logged by `hook::guard`; `p` is then left without its
    /// topic, payload and properties, and the message is lost: the caller tells its
    /// publisher as it can).
    pub(crate) async fn admit(
        &self,
        from: Option<&Session>,
        p: &mut Publish,
    ) -> Result<(), Option<ReasonCode>> {
        if let Some(session) = from {
            if self.checks_access() && !self.may(session, &p.topic, Action::Write).await {
                tracing::debug!(client_id = %session.client_id, topic = %p.topic, "PUBLISH not authorized");
                return Err(Some(ReasonCode::NOT_AUTHORIZED));
            }
        }
        if self.interceptors.is_empty() {
            return Ok(());
        }
        let username = from.and_then(Session::username);
        self.intercept(from.map_or("", |s| &s.client_id), username.as_deref(), p)
            .await
    }

    /// Step 2 alone: the publish interceptors, in the order they were added, each seeing the
    /// changes of those before; the first refusal stops the chain. `Err(None)`: one panicked.
    async fn intercept(
        &self,
        client_id: &str,
        username: Option<&str>,
        p: &mut Publish,
    ) -> Result<(), Option<ReasonCode>> {
        let mut publish = InterceptedPublish {
            client_id,
            username,
            qos: p.qos,
            retain: p.retain,
            topic: std::mem::take(&mut p.topic),
            payload: std::mem::take(&mut p.payload),
            properties: std::mem::take(&mut p.properties),
        };
        let mut verdict = Verdict::Accept;
        for i in &self.interceptors {
            verdict =
                crate::hook::guard("publish interceptor", client_id, i.intercept(&mut publish))
                    .await
                    .ok_or(None)?;
            if verdict != Verdict::Accept {
                break;
            }
        }
        p.topic = publish.topic;
        p.payload = publish.payload;
        p.properties = publish.properties;
        p.properties.topic_alias = None;
        if let Verdict::Refuse(rc) = verdict {
            tracing::debug!(client_id, topic = %p.topic, reason = %rc, "PUBLISH refused by an interceptor");
            return Err(Some(refusal_code(rc)));
        }
        if topic::validate_topic_name(&p.topic).is_err() || p.topic.starts_with("$SYS") {
            tracing::warn!(client_id, topic = %p.topic, "an interceptor set an invalid topic name: PUBLISH refused");
            return Err(Some(ReasonCode::TOPIC_NAME_INVALID));
        }
        Ok(())
    }

    /// Step 4 of the entry: waits for each session in `congested` but `own` (the publisher's
    /// own session, which only the publisher's side drains) until it is back under its
    /// low-water mark, stalled, gone or ended ([`Session::wait_room`]); then, while the
    /// queues hold more than `max_queued_memory`, for them to drain
    /// ([`BrokerState::wait_memory`], `memory_bound.rs`); then, while more than
    /// `jetstream_max_pending_bytes` wait for JetStream, for them to go out
    /// ([`ClusterQos::wait_room`](crate::cluster_qos::ClusterQos::wait_room)). Empties
    /// `congested`.
    pub(crate) async fn wait_congested(
        &self,
        own: Option<&Session>,
        congested: &mut Vec<Arc<Session>>,
    ) {
        for s in std::mem::take(congested) {
            if !own.is_some_and(|own| std::ptr::eq(own, &*s)) {
                s.wait_room(&self.limits, &self.stats).await;
            }
        }
        if self.memory_congested() {
            self.wait_memory().await;
        }
        // Too much waits for JetStream (cluster mode, QoS 1 and 2 between nodes).
        if self.cluster_qos.over() {
            self.cluster_qos.wait_room().await;
        }
    }

    /// Every step of the entry, for the application's messages (`from` an in-process
    /// subscription's session, or `None` for the handle's own). `p`'s QoS, RETAIN, topic, payload and properties
    /// make the message (its Message Expiry Interval counted from now); the Topic Alias and
    /// Subscription Identifiers are not kept. Returns whether any subscription matched, once
    /// the back pressure it met is over and, when another node wants it at QoS 1 or 2, once
    /// JetStream holds it; `Err` with the reason code of a refusal, 0x89 (Server busy) when
    /// JetStream did not take it within `jetstream_ack_timeout` (it is still sent), or 0x95
    /// (Packet too large) when JetStream can never take it (over the NATS servers'
    /// `max_payload`).
    pub(crate) async fn enter(
        &self,
        from: Option<&Arc<Session>>,
        mut p: Publish,
    ) -> Result<bool, ReasonCode> {
        let from_session = from.map(|s| &**s);
        self.admit(from_session, &mut p)
            .await
            .map_err(|rc| rc.unwrap_or(ReasonCode::UNSPECIFIED_ERROR))?;
        let msg = Arc::new(message_of(p, from.map(|s| Arc::clone(&s.client_id))));
        let mut congested = Vec::new();
        let (matched, gate) = self.publish_gated(msg, &mut congested);
        self.wait_congested(from_session, &mut congested).await;
        // Another node wants it at QoS 1 or 2: resolved once JetStream holds it.
        if let Some(gate) = gate {
            match gate.wait().await {
                Outcome::Held => {}
                Outcome::TimedOut => return Err(ReasonCode::SERVER_BUSY),
                Outcome::Refused => return Err(ReasonCode::PACKET_TOO_LARGE),
            }
        }
        if let (Some(p), Some(s)) = (self.persist.get(), from) {
            p.wait_room(&s.client_id).await;
        }
        Ok(matched)
    }

    /// A will, through the entry: its write access was checked when its CONNECT set it;
    /// with publish interceptors it is handed to them (as its client's, without a user
    /// name) on a task of its own, since the callers cannot wait, then routed; nobody waits
    /// for back pressure (its publisher is gone).
    pub(crate) fn publish_will(&self, client_id: &str, will: Will) {
        tracing::debug!(client_id, topic = %will.msg.topic, "publishing will");
        self.observers.will(client_id, &will.msg);
        self.events.fire(|| crate::events::Event::WillPublished {
            client_id: client_id.to_string(),
            topic: will.msg.topic.clone(),
            qos: will.msg.qos,
            retain: will.msg.retain,
        });
        let mut msg = Arc::unwrap_or_clone(will.msg);
        msg.expires_at = Message::expiry_deadline(will.expiry, Instant::now());
        let broker = match self.this.upgrade() {
            Some(broker) if !self.interceptors.is_empty() => broker,
            _ => {
                self.publish(msg);
                return;
            }
        };
        tokio::spawn(async move {
            let mut p = Publish {
                dup: false,
                qos: msg.qos,
                retain: msg.retain,
                topic: msg.topic,
                packet_id: 0,
                properties: msg.properties,
                payload: msg.payload,
            };
            let client_id = msg.publisher.as_deref().unwrap_or_default();
            if broker.intercept(client_id, None, &mut p).await.is_err() {
                return;
            }
            // The deadline counts from the will's publication, not from the interceptors'
            // answer.
            p.properties.message_expiry_interval = None;
            let mut will = message_of(p, msg.publisher);
            will.expires_at = msg.expires_at;
            broker.publish(will);
        });
    }
}
