//! Sessions: the state that outlives a connection (MQTT 5.0 section 4.1) — subscriptions,
//! the queue of messages waiting for the client, messages in flight, QoS 2 packet identifiers
//! awaiting PUBREL, the will and the expiry.
//!
//! A session is shared (`Arc<Session>`): publishers' tasks push into its queue while the
//! owning connection's writer drains it. Everything sits behind one short-held mutex.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::codec::{ProtocolVersion, QoS, SubscriptionOptions};
use crate::connection::Link;
use crate::message::Message;
use crate::stats::DropCause;

/// A message waiting in a session's queue, with what this delivery adds to it.
#[derive(Debug, Clone)]
pub(crate) struct Queued {
    pub msg: Arc<Message>,
    /// QoS of this delivery: the lower of the message's and the subscription's.
    pub qos: QoS,
    /// RETAIN flag of this delivery (retained on subscribe, or retain as published).
    pub retain: bool,
    /// Subscription identifiers of every subscription that matched [MQTT-3.3.4-3].
    pub subscription_ids: Vec<u32>,
    /// Position in the session's queue, set by [`Session::enqueue`] (storage's key).
    pub seq: u64,
}

/// Where an outbound QoS 1/2 message stands (MQTT 5.0 section 4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OutboundState {
    /// QoS 1 PUBLISH sent, PUBACK awaited.
    AwaitingPubAck,
    /// QoS 2 PUBLISH sent, PUBREC awaited.
    AwaitingPubRec,
    /// PUBREL sent, PUBCOMP awaited.
    AwaitingPubComp,
}

/// An outbound message in flight.
#[derive(Debug, Clone)]
pub(crate) struct Inflight {
    pub packet_id: u16,
    pub state: OutboundState,
    pub delivery: Queued,
    /// False until written once on the current connection; resent with DUP on reconnect.
    pub sent: bool,
}

/// One subscription of a session, as granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Granted {
    pub options: SubscriptionOptions,
    pub identifier: Option<u32>,
}

/// The will of a session: published after `delay` when the connection ends abnormally.
#[derive(Debug, Clone)]
pub(crate) struct Will {
    pub msg: Arc<Message>,
    /// Will Delay Interval, seconds.
    pub delay: u32,
    /// Message Expiry Interval, seconds, counted from publication (5.0 section 3.1.3.2.4).
    pub expiry: Option<u32>,
}

/// Limits applied when enqueueing (manual, "Queues and slow clients").
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueueLimits {
    pub max_messages: usize,
    pub max_qos0_messages: usize,
    /// 0 = unlimited.
    pub max_bytes: u64,
}

/// The mutable part of a session.
#[derive(Debug)]
pub(crate) struct SessionState {
    pub protocol: ProtocolVersion,
    /// Full filter (with `$share/...`) to what was granted.
    pub subscriptions: HashMap<String, Granted>,
    pub queue: VecDeque<Queued>,
    pub queued_bytes: u64,
    /// Outbound QoS 1/2 messages, in the order they were first sent.
    pub inflight: VecDeque<Inflight>,
    /// Inbound QoS 2 packet identifiers whose PUBREC was sent, awaiting PUBREL.
    pub inbound_qos2: HashSet<u16>,
    next_packet_id: u16,
    /// Session Expiry Interval in seconds; `u32::MAX` = never.
    pub expiry_interval: u32,
    pub will: Option<Will>,
    /// The connection serving this session now, if any.
    pub link: Option<Arc<Link>>,
    /// Incremented at every connection: timers armed for an older one do nothing.
    pub generation: u64,
    /// Set when the session has ended (expired, cleaned, taken over by a clean start).
    pub ended: bool,
    /// True while the queue is dropping, to log once when it starts and once when it stops.
    pub dropping: bool,
    pub dropped_since_warning: u64,
    /// Messages this session's queue dropped since it was made (a bridge reports it).
    pub dropped: u64,
    /// When the last connection ended; `None` while connected.
    pub disconnected_at: Option<Instant>,
    /// The user name of the last connection, stored with the session so that access checks
    /// made while it is offline after a restart use it (`identity` is restored from it).
    pub username: Option<Arc<str>>,
    /// Storage's writer, for a broker with a storage backend (see `persist.rs`).
    pub persist: Option<Arc<crate::persist::Persister>>,
    /// The `seq` of the next queued message.
    pub next_seq: u64,
}

/// A session, shared between its connection, publishers and timers.
#[derive(Debug)]
pub struct Session {
    pub(crate) client_id: Arc<str>,
    pub(crate) state: Mutex<SessionState>,
    /// Who the session belongs to, for access checks (set at each CONNECT).
    pub(crate) identity: parking_lot::RwLock<crate::auth::Identity>,
}

/// What happened to a message offered to a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Enqueued {
    Queued,
    /// Not kept: QoS 0 for a session with no connection (as mosquitto does by default).
    Skipped,
    Dropped(DropCause),
}

impl Session {
    pub(crate) fn new(
        client_id: Arc<str>,
        protocol: ProtocolVersion,
        expiry_interval: u32,
    ) -> Session {
        Session {
            client_id,
            state: Mutex::new(SessionState {
                protocol,
                subscriptions: HashMap::new(),
                queue: VecDeque::new(),
                queued_bytes: 0,
                inflight: VecDeque::new(),
                inbound_qos2: HashSet::new(),
                next_packet_id: 1,
                expiry_interval,
                will: None,
                link: None,
                generation: 0,
                ended: false,
                dropping: false,
                dropped_since_warning: 0,
                dropped: 0,
                disconnected_at: None,
                username: None,
                persist: None,
                next_seq: 1,
            }),
            identity: Default::default(),
        }
    }

    /// The client identifier.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// Offers a delivery to the queue under `limits`, waking the connection if there is one.
    /// Never waits: a full queue drops (QoS 0 first), as the manual says. Logs one warning
    /// when the queue starts dropping, naming the limit, and one with the count when a
    /// message finds it back at half its limits.
    pub(crate) fn enqueue(&self, mut delivery: Queued, limits: &QueueLimits) -> Enqueued {
        let mut st = self.state.lock();
        if st.ended {
            return Enqueued::Skipped;
        }
        if st.link.is_none() && delivery.qos == QoS::AtMostOnce {
            return Enqueued::Skipped;
        }
        let len = st.queue.len();
        let bytes = delivery.msg.payload.len() as u64;
        // The limit that refuses it, if any (named in the warning).
        let limit = if delivery.qos == QoS::AtMostOnce && len >= limits.max_qos0_messages {
            Some("max_queued_qos0_messages")
        } else if len >= limits.max_messages {
            Some("max_queued_messages")
        } else if limits.max_bytes > 0 && st.queued_bytes + bytes > limits.max_bytes {
            Some("max_queued_bytes")
        } else {
            None
        };
        let cause = limit.map(|_| {
            if delivery.qos == QoS::AtMostOnce {
                DropCause::QueueFullQos0
            } else {
                DropCause::QueueFull
            }
        });
        if let Some(cause) = cause {
            if !st.dropping {
                st.dropping = true;
                tracing::warn!(client_id = %self.client_id, queued = len, queued_bytes = st.queued_bytes, limit = limit.unwrap_or_default(), "session queue full: dropping messages");
            }
            st.dropped_since_warning += 1;
            st.dropped += 1;
            return Enqueued::Dropped(cause);
        }
        // Room again once back to half its limits (not at the first message that fits, or a
        // queue hovering at a limit would log at every message).
        let low_water = len <= limits.max_qos0_messages.min(limits.max_messages) / 2
            && (limits.max_bytes == 0 || st.queued_bytes <= limits.max_bytes / 2);
        if st.dropping && low_water {
            st.dropping = false;
            tracing::warn!(
                client_id = %self.client_id,
                dropped = st.dropped_since_warning,
                "session queue has room again"
            );
            st.dropped_since_warning = 0;
        }
        st.queued_bytes += bytes;
        delivery.seq = st.next_seq;
        st.next_seq += 1;
        st.persist_queued(&self.client_id, &delivery);
        // Wake the connection only when the queue turns non-empty: whoever drains it (the
        // writer's `fill`, an in-process subscription's pump) takes messages until it is
        // empty, or stops for a reason that wakes it again (an acknowledgement opening the
        // window, the write chunk limit, which loops), and a wake-up while it runs is kept
        // as a permit. So no `Arc<Link>` clone and drop, and no `notify_one`, per message.
        let was_empty = len == 0;
        st.queue.push_back(delivery);
        let link = if was_empty { st.link.clone() } else { None };
        drop(st);
        if let Some(link) = link {
            link.wake();
        }
        Enqueued::Queued
    }
}

impl SessionState {
    /// The next free packet identifier for an outbound message, skipping those in flight
    /// [MQTT-2.2.1-4]. `None` when all 65,535 are taken.
    pub(crate) fn allocate_packet_id(&mut self) -> Option<u16> {
        for _ in 0..u16::MAX {
            let id = self.next_packet_id;
            self.next_packet_id = if id == u16::MAX { 1 } else { id + 1 };
            if !self.inflight.iter().any(|f| f.packet_id == id) {
                return Some(id);
            }
        }
        None
    }

    /// Takes the head of the queue, keeping `queued_bytes` right.
    pub(crate) fn pop_queued(&mut self) -> Option<Queued> {
        let q = self.queue.pop_front()?;
        self.queued_bytes = self.queued_bytes.saturating_sub(q.msg.payload.len() as u64);
        Some(q)
    }

    /// Position of the in-flight message with this packet identifier.
    pub(crate) fn inflight_position(&self, packet_id: u16) -> Option<usize> {
        self.inflight.iter().position(|f| f.packet_id == packet_id)
    }
}
