//! The bridge's outgoing queue: a persistent session of this broker, subscribed to the
//! bridge's `out` filters, so that what waits for the remote is stored (memory, SQLite or
//! PostgreSQL) with a persistent session's guarantees and limits. Messages move from its
//! queue to its in-flight list as they are sent to the remote, and leave it on the remote's
//! PUBACK / PUBCOMP, each step emitted to storage as a client's session would.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;

use crate::broker::drain::{encode_pubrel, Outlet, Unsent, WRITE_CHUNK};
use crate::broker::{BrokerState, INTERNAL_PREFIX};
use crate::codec::{self, Properties, ProtocolVersion, PublishRef, QoS, SubscriptionOptions};
use crate::link::Link;
use crate::session::{Delivery, Granted, Session};

use super::topics::TopicMap;

/// The user property (the hop marker) a bridge adds to each message it carries, out to the
/// remote and in from it; its value is the bridge's client identifier. A message that has it
/// crosses no other bridge: it is not sent out, and one received from a remote is not
/// published here. So a mesh of brokers, each pair linked by one bridge (MQTT 5 at both
/// ends), delivers each message once on each broker, and never loops.
pub const HOP_PROPERTY: &str = "mercurio-bridged";

/// The local client identifier of a bridge's session: in the in-process namespace, which
/// network clients cannot take.
pub(crate) fn session_id(name: &str) -> String {
    format!("{INTERNAL_PREFIX}bridge/{name}")
}

/// True for a message that came over a bridge.
pub(crate) fn is_bridged(props: &Properties) -> bool {
    props.user_properties.iter().any(|(k, _)| k == HOP_PROPERTY)
}

/// The bridge's session while the bridge runs.
pub(crate) struct Outgoing {
    pub session: Arc<Session>,
    pub link: Arc<Link>,
}

impl Outgoing {
    /// Takes up the bridge's session (restored from storage, or new), marks it connected so
    /// that QoS 0 messages queue too, and makes its subscriptions those of `map`.
    pub(crate) fn attach(broker: &Arc<BrokerState>, name: &str, map: &TopicMap) -> Outgoing {
        let id: Arc<str> = Arc::from(session_id(name));
        let (session, resumed) = broker.internal_session(&id);
        let link = Arc::new(Link::new());
        if !session.attach(&link, ProtocolVersion::V5, u32::MAX, &mut None) {
            // Held by an older task of this bridge (a reload in progress): take it over.
            if let Some(old) = session.link() {
                session.detach(&old, false);
            }
            session.attach(&link, ProtocolVersion::V5, u32::MAX, &mut None);
        }
        if let Some(p) = broker.persist.get() {
            p.connected(&session, resumed);
        }
        let wanted = map.local_subscriptions();
        let stale: Vec<String> = session
            .state
            .lock()
            .subscriptions()
            .keys()
            .filter(|f| !wanted.iter().any(|(w, _)| w == *f))
            .cloned()
            .collect();
        for f in stale {
            broker.unsubscribe(&session, &f);
        }
        for (filter, qos) in wanted {
            let granted = Granted {
                options: SubscriptionOptions {
                    qos,
                    // What the bridge publishes locally never goes back out through it.
                    no_local: true,
                    retain_as_published: true,
                    retain_handling: 0,
                },
                identifier: None,
            };
            let same = session.state.lock().subscriptions().get(&filter) == Some(&granted);
            if !same {
                broker.subscribe(&session, &filter, granted);
            }
        }
        Outgoing { session, link }
    }

    /// The bridge stops but stays configured: the session keeps its queue (stored) and its
    /// subscriptions, so messages go on queuing for the remote.
    pub(crate) fn detach(&self) {
        self.session.detach(&self.link, false);
    }

    /// The bridge was removed from the configuration: its session ends, queue included.
    pub(crate) fn end(&self, broker: &BrokerState) {
        broker.end_session(&self.session);
    }

    /// Queues this broker's retained messages that go out over the bridge, RETAIN set, so
    /// that the remote's retained set is in step with ours after messages were lost on the
    /// way (dropped by the queue's limits, QoS 0 across a restart). Those that came over a
    /// bridge themselves are left out.
    pub(crate) fn enqueue_retained(&self, broker: &BrokerState, map: &TopicMap) -> usize {
        let now = Instant::now();
        let mut queued = 0;
        for rule in map.rules.iter().filter(|r| r.out) {
            let found = broker.retained.lock().matching(&rule.local_filter);
            for msg in found {
                if msg.is_expired(now) || is_bridged(&msg.properties) {
                    continue;
                }
                let q = Delivery {
                    qos: msg.qos.min(rule.qos),
                    msg,
                    retain: true,
                    subscription_ids: Vec::new(),
                    seq: 0,
                    share: None,
                };
                if broker.deliver(&self.session, q) {
                    queued += 1;
                }
            }
        }
        queued
    }

    /// Messages this session's queue dropped so far.
    pub(crate) fn dropped(&self) -> u64 {
        self.session.state.lock().dropped()
    }

    /// The remote connection ended: everything in flight is sent again on the next one.
    pub(crate) fn unsent(&self) {
        self.session.state.lock().mark_inflight_unsent();
    }

    /// Encodes into `buf` what can go to the remote now, through the session's drain
    /// ([`BrokerState::drain`]): in-flight messages not yet sent on this connection (DUP),
    /// then queued messages while fewer than `window` are in flight, up to
    /// [`WRITE_CHUNK`] bytes. Returns the QoS 0 messages sent (forwarded already: nothing
    /// acknowledges them).
    pub(crate) fn fill(&self, out: &mut Sender<'_>, buf: &mut BytesMut) -> u64 {
        let broker = out.broker;
        broker
            .drain(&self.session, &mut ToRemote { out, buf })
            .sent_qos0
    }

    /// PUBACK (QoS 1) or PUBCOMP (QoS 2) from the remote: the message leaves the session
    /// (the delivery-completed callback is told). True when it was in flight.
    pub(crate) fn acknowledged(&self, broker: &BrokerState, packet_id: u16) -> bool {
        let mut st = self.session.state.lock();
        let done = st.take_inflight(&self.session.client_id, packet_id);
        drop(st);
        match done {
            Some(q) => {
                broker
                    .observers
                    .completed(&self.session.client_id, &q.msg, q.qos);
                true
            }
            None => false,
        }
    }

    /// A refusing PUBREC from the remote: the message leaves the session, not delivered.
    pub(crate) fn refused(&self, packet_id: u16) {
        let mut st = self.session.state.lock();
        let _ = st.take_inflight(&self.session.client_id, packet_id);
    }

    /// PUBREC from the remote: the QoS 2 message waits for PUBCOMP; returns whether PUBREL
    /// is to be sent (the identifier is known).
    pub(crate) fn received(&self, packet_id: u16) -> bool {
        let mut st = self.session.state.lock();
        st.inflight_received(&self.session.client_id, packet_id)
    }
}

/// What encoding toward the remote needs.
pub(crate) struct Sender<'a> {
    pub broker: &'a BrokerState,
    pub map: &'a TopicMap,
    pub version: ProtocolVersion,
    /// Most QoS 1/2 messages in flight.
    pub window: usize,
    pub max_packet_size: usize,
    /// The hop marker's value: the bridge's client identifier.
    pub hop: &'a str,
}

/// The remote connection as the drain's [`Outlet`].
struct ToRemote<'s, 'a, 'b> {
    out: &'s Sender<'a>,
    buf: &'b mut BytesMut,
}

impl Outlet for ToRemote<'_, '_, '_> {
    fn window(&self) -> Option<usize> {
        Some(self.out.window)
    }

    fn has_room(&self) -> bool {
        self.buf.len() < WRITE_CHUNK
    }

    /// At the lower of the delivery's QoS and its rule's; a message that came over a bridge
    /// is not sent over another one, nor one whose rule is gone (a reload).
    fn admit(&mut self, q: &Delivery) -> Result<QoS, Unsent> {
        if is_bridged(&q.msg.properties) {
            return Err(Unsent::NotHere);
        }
        let (_, ceiling) = self.out.map.outgoing(&q.msg.topic).ok_or(Unsent::NotHere)?;
        Ok(q.qos.min(ceiling))
    }

    fn send(&mut self, q: &Delivery, id: u16, dup: bool, now: Instant) -> Result<(), Unsent> {
        self.out.encode(q, id, dup, now, self.buf)
    }

    fn release(&mut self, packet_id: u16) {
        encode_pubrel(packet_id, self.out.version, self.buf);
    }
}

impl Sender<'_> {
    /// Encodes one PUBLISH under its remote topic, at `q.qos`. `Err` when it cannot go: its
    /// rule is gone (a reload), or it is too large for the remote.
    fn encode(
        &self,
        q: &Delivery,
        packet_id: u16,
        dup: bool,
        now: Instant,
        buf: &mut BytesMut,
    ) -> Result<(), Unsent> {
        let Some((topic, _)) = self.map.outgoing(&q.msg.topic) else {
            return Err(Unsent::NotHere);
        };
        let mut properties = if self.version.is_v5() {
            let mut p = q.msg.properties.clone();
            p.subscription_identifiers.clear();
            p.topic_alias = None;
            p.message_expiry_interval = q.msg.expires_at.map(|at| {
                let left = at.saturating_duration_since(now);
                left.as_secs().max(1).min(u64::from(u32::MAX)) as u32
            });
            p
        } else {
            Properties::default()
        };
        if self.version.is_v5() {
            properties
                .user_properties
                .push((HOP_PROPERTY.to_string(), self.hop.to_string()));
        }
        let publish = PublishRef {
            dup,
            qos: q.qos,
            retain: q.retain,
            topic: &topic,
            packet_id,
            properties: &properties,
            payload: &q.msg.payload,
        };
        codec::encode_publish_within(&publish, self.version, self.max_packet_size, buf)
            .map_err(|_| Unsent::TooLarge)
    }
}
