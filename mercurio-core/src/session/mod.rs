//! Sessions: the state that outlives a connection (MQTT 5.0 section 4.1) — subscriptions,
//! the queue of messages waiting for the client, messages in flight, QoS 2 packet identifiers
//! awaiting PUBREL, the will and the expiry.
//!
//! A session is shared (`Arc<Session>`): publishers' tasks push into its queue while the
//! owning connection's writer drains it. Everything sits behind one short-held mutex.

mod backlog;
mod queue;
mod state;

pub(crate) use backlog::Backlog;
pub(crate) use queue::{Queue, QueueLimits};

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::codec::{ProtocolVersion, QoS, SubscriptionOptions};
use crate::lazy_map::LazyMap;
use crate::link::Link;
use crate::message::Message;
use crate::queued_memory::QueuedMemory;
use crate::stats::DropCause;

/// One delivery of a message to one session: the shared message, plus what this delivery adds
/// to it (QoS, RETAIN, subscription identifiers, its place in the queue). Waits in the
/// session's queue, then in flight until acknowledged.
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    pub msg: Arc<Message>,
    /// QoS of this delivery: the lower of the message's and the subscription's.
    pub qos: QoS,
    /// RETAIN flag of this delivery (retained on subscribe, or retain as published).
    pub retain: bool,
    /// Subscription identifiers of every subscription that matched [MQTT-3.3.4-3].
    pub subscription_ids: Vec<u32>,
    /// Position in the session's queue, set by [`Session::enqueue`] (storage's key).
    pub seq: u64,
    /// For a delivery made through a shared subscription, the group's full filter
    /// (`$share/{ShareName}/{filter}`): if the session ends, or leaves the group, before the
    /// client acknowledges it, it goes to another member (MQTT 5.0 section 4.8.2).
    pub share: Option<Arc<str>>,
}

impl Delivery {
    /// Bytes this delivery holds in a queue: the message's topic, properties and payload,
    /// and its subscription identifiers (what `max_queued_bytes` and the high-water mark
    /// count).
    pub(crate) fn cost(&self) -> u64 {
        (self.msg.size() + 4 * self.subscription_ids.len()) as u64
    }
}

/// Where an outbound QoS 1/2 message stands (MQTT 5.0 section 4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // the states as MQTT names them: what each awaits
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
    pub delivery: Delivery,
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

/// The mutable part of a session.
#[derive(Debug)]
pub(crate) struct SessionState {
    protocol: ProtocolVersion,
    /// Full filter (with `$share/...`) to what was granted.
    subscriptions: LazyMap<String, Granted>,
    /// Deliveries waiting for the client, with the bytes they hold.
    queue: Queue,
    /// The queue's part left in storage at the restore, ahead of `queue` (`backlog.rs`).
    /// Boxed: only restored sessions whose client has not come back have one.
    backlog: Option<Box<Backlog>>,
    /// Outbound QoS 1/2 messages, in the order they were first sent.
    inflight: VecDeque<Inflight>,
    /// Inbound QoS 2 packet identifiers whose PUBREC was sent, awaiting PUBREL (changed
    /// only through `receive_qos2` / `release_qos2`, which report it).
    inbound_qos2: LazyMap<u16, ()>,
    next_packet_id: u16,
    /// Session Expiry Interval in seconds; `u32::MAX` = never.
    expiry_interval: u32,
    /// Boxed: most clients set none, and a will is 24 bytes.
    will: Option<Box<Will>>,
    /// The connection serving this session now, if any.
    link: Option<Arc<Link>>,
    /// Incremented at every connection: timers armed for an older one do nothing.
    generation: u32,
    /// Set when the session has ended (expired, cleaned, taken over by a clean start).
    ended: bool,
    /// What few sessions have (a dropping period, a bridge's own limits), in one box so
    /// that the others pay one pointer for both: an idle session's size is budgeted
    /// (tests/idle_memory.rs).
    rare: Option<Box<Rare>>,
    /// Messages this session's queue dropped since it was made (a bridge reports it).
    dropped: u64,
    /// The client connected as another broker's bridge (mosquitto's `try_private`): what
    /// this broker's own bridges bring in is not delivered to it (docs/bridges.md, Loops).
    remote_bridge: bool,
    /// When the last connection ended; `None` while connected.
    disconnected_at: Option<Instant>,
    /// The user name of the last connection, stored with the session so that access checks
    /// made while it is offline after a restart use it (`identity` is restored from it).
    username: Option<Arc<str>>,
    /// Where changes are reported for storage, for a broker with a storage backend.
    changes: Option<Arc<dyn SessionChanges>>,
    /// The `seq` of the next queued message.
    next_seq: u64,
    /// When the client last took a message from the queue, or was found with nothing to
    /// take (flow control: a client that takes none for `stall_time` is stalled).
    last_progress: Instant,
    /// The queue turned non-empty and its writer has not run since: the stall clock starts
    /// when a publisher first finds it so, not at the last progress before an idle spell.
    woken_unfilled: bool,
    /// A publisher waits for this queue to go under its low-water mark.
    room_waited: bool,
    /// This stall was logged and counted already.
    stall_reported: bool,
}

/// A dropping queue's marks ([`SessionState`]'s `dropping`).
/// The rarely present part of a [`SessionState`]; the box goes when all are `None`. (Each
/// field here keeps 8 to 16 bytes out of every session: a session of 304 bytes or less is an
/// `Arc` allocation in jemalloc's 320-byte class, not the 384-byte one.)
#[derive(Debug, Default)]
struct Rare {
    /// While the queue is dropping (to log once when it starts and once when it stops): the
    /// messages and payload bytes it must be back to (half its limits) for the "room again"
    /// line, checked as messages leave the queue, and the count dropped since it started.
    dropping: Option<Dropping>,
    /// Queue limits of this session in place of the broker's (a bridge's queue has its
    /// own); `None`: the broker's.
    own_limits: Option<QueueLimits>,
    /// The name of the client certificate of the last connection (`None`: none), stored with
    /// the session: with `username`, who the session belongs to.
    certificate: Option<Arc<str>>,
}

#[derive(Debug)]
struct Dropping {
    room_messages: usize,
    room_bytes: u64,
    /// Messages dropped since the queue started dropping.
    dropped: u64,
}

/// What a stored session reports, one call per change, made under the session's lock so that
/// storage sees each client's changes in the order they happened. The broker's storage
/// writer implements it (`persist`); a broker without storage sets none, and each report
/// costs one `Option` check.
pub(crate) trait SessionChanges: Send + Sync + std::fmt::Debug {
    /// A QoS 1 or 2 message was pushed on the queue.
    fn queued(&self, client_id: &Arc<str>, q: &Delivery);
    /// A QoS 1 or 2 message left the queue without being sent (expired, too large, no longer
    /// readable), or was sent and is now `inflight`.
    fn dequeued(&self, client_id: &str, seq: u64);
    /// An in-flight message was added or changed state.
    fn inflight_set(&self, client_id: &str, f: &Inflight);
    /// An in-flight message was acknowledged (or refused) and removed.
    fn inflight_removed(&self, client_id: &str, packet_id: u16);
    /// An inbound QoS 2 packet identifier was added (`true`) or released.
    fn inbound_qos2(&self, client_id: &str, packet_id: u16, added: bool);
    /// A subscription was added or replaced (`Some`), or removed.
    fn subscription(&self, client_id: &str, filter: &str, granted: Option<&Granted>);
    /// The will was published or dropped.
    fn will_cleared(&self, client_id: &str);
    /// The connection ended: the session's header (with its disconnection time) changed.
    fn detached(&self, client_id: &str, st: &SessionState);
    /// The session ended (expired, cleaned, taken over by a clean start).
    fn ended(&self, client_id: &str);
}

/// Every session the broker holds, by client identifier. Hashed with ahash, keyed at random
/// per process (client identifiers come from outside: no chosen set of them collides), which
/// costs a connect a fraction of SipHash's.
pub(crate) type SessionTable = Mutex<HashMap<Arc<str>, Arc<Session>, ahash::RandomState>>;

/// A session, shared between its connection, publishers and timers.
#[derive(Debug)]
pub struct Session {
    pub(crate) client_id: Arc<str>,
    /// Lock: taken with at most the session table (`BrokerState::sessions`) held, never
    /// another session's `state`, and never held across an `.await`; under it only leaf
    /// locks are taken (`identity`, a `Link`'s, the `Persister`'s); storage reports and,
    /// for a resend, the authorizers' `authorize_now` run under it.
    pub(crate) state: Mutex<SessionState>,
    /// Publishers waiting for this queue to drain (back pressure) wait on it. Made by the
    /// first wait (a `Notify` is 32 bytes, and most sessions are never waited for); it is
    /// made before the waiter marks `room_waited` under the state's lock, so whoever sees
    /// the mark sees it.
    room: std::sync::OnceLock<Box<Notify>>,
    /// Who the session belongs to, for access checks (set at each CONNECT).
    /// Lock: a leaf (nothing is taken under it); may be taken while holding the session
    /// table or this session's `state`.
    pub(crate) identity: parking_lot::RwLock<crate::auth::Identity>,
}

// Every session is an `Arc<Session>` allocation; 304 bytes or less, it is one of jemalloc's
// 320-byte class (16 bytes of counts included), not the 384-byte one: 64 bytes per session.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Session>() <= 304);

/// What happened to a message offered to a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Enqueued {
    Queued,
    /// Queued, and the queue is now at its high-water mark while a client is connected:
    /// the publisher should wait ([`Session::wait_room`]).
    QueuedOverHighWater,
    /// Not kept: QoS 0 for a session with no connection (as mosquitto does by default).
    Skipped,
    Dropped(DropCause),
}

impl Enqueued {
    /// True when the message went into the queue.
    pub(crate) fn is_queued(self) -> bool {
        matches!(self, Enqueued::Queued | Enqueued::QueuedOverHighWater)
    }
}

impl Session {
    /// A session with nothing in it, its queue's bytes counted in `memory` (the broker's).
    pub(crate) fn new(
        client_id: Arc<str>,
        protocol: ProtocolVersion,
        expiry_interval: u32,
        memory: &Arc<QueuedMemory>,
    ) -> Session {
        Session {
            client_id,
            state: Mutex::new(SessionState {
                protocol,
                subscriptions: LazyMap::new(),
                queue: Queue::new(Arc::clone(memory)),
                inflight: VecDeque::new(),
                inbound_qos2: LazyMap::new(),
                next_packet_id: 1,
                expiry_interval,
                will: None,
                link: None,
                generation: 0,
                ended: false,
                rare: None,
                backlog: None,
                dropped: 0,
                remote_bridge: false,
                disconnected_at: None,
                username: None,
                changes: None,
                next_seq: 1,
                last_progress: Instant::now(),
                woken_unfilled: false,
                room_waited: false,
                stall_reported: false,
            }),
            room: std::sync::OnceLock::new(),
            identity: Default::default(),
        }
    }

    /// The client identifier.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// Offers a delivery to the queue under `limits`, waking the connection if there is one.
    /// Never waits: a full queue drops (QoS 0 first). Logs one warning
    /// when the queue starts dropping, naming the limit; the one with the count comes when
    /// messages leaving bring it back to half its limits (`pop_queued`).
    pub(crate) fn enqueue(&self, delivery: Delivery, limits: &QueueLimits) -> Enqueued {
        let cost = delivery.cost();
        self.enqueue_costing(delivery, cost, limits)
    }

    /// [`Session::enqueue`] with the delivery's [`Delivery::cost`] computed by the caller
    /// (routing computes a message's size once for all the sessions it goes to).
    pub(crate) fn enqueue_costing(
        &self,
        mut delivery: Delivery,
        bytes: u64,
        limits: &QueueLimits,
    ) -> Enqueued {
        let mut st = self.state.lock();
        if st.ended {
            return Enqueued::Skipped;
        }
        if st.link.is_none() && delivery.qos == QoS::AtMostOnce {
            return Enqueued::Skipped;
        }
        let own = st.own_limits().copied();
        let limits = own.as_ref().unwrap_or(limits);
        let len = st.queued_len();
        // The limit that refuses it, if any (named in the warning).
        let limit = if delivery.qos == QoS::AtMostOnce && len >= limits.max_qos0_messages {
            Some("max_queued_qos0_messages")
        } else if len >= limits.max_messages {
            Some("max_queued_messages")
        } else if limits.max_bytes > 0 && st.queue.bytes() + bytes > limits.max_bytes {
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
            if st.rare.as_ref().is_none_or(|r| r.dropping.is_none()) {
                // Half its limits, not the first message that fits, or a queue hovering at a
                // limit would log at every message.
                st.rare.get_or_insert_default().dropping = Some(Dropping {
                    room_messages: limits.max_qos0_messages.min(limits.max_messages) / 2,
                    room_bytes: if limits.max_bytes == 0 {
                        u64::MAX
                    } else {
                        limits.max_bytes / 2
                    },
                    dropped: 0,
                });
                tracing::warn!(client_id = %self.client_id, queued = len, queued_bytes = st.queue.bytes(), limit = limit.unwrap_or_default(), "session queue full: dropping messages");
            }
            if let Some(d) = st.rare.as_mut().and_then(|r| r.dropping.as_mut()) {
                d.dropped += 1;
            }
            st.dropped += 1;
            return Enqueued::Dropped(cause);
        }
        delivery.seq = st.next_seq;
        st.next_seq += 1;
        st.persist_queued(&self.client_id, &delivery);
        // Wake the connection only when the queue turns non-empty: whoever drains it (the
        // writer's `fill`, an in-process subscription's pump) takes messages until it is
        // empty, or stops for a reason that wakes it again (an acknowledgement opening the
        // window, the write chunk limit, which loops), and a wake-up while it runs is kept
        // as a permit. So no `Arc<Link>` clone and drop, and no `notify_one`, per message.
        let was_empty = st.queue.is_empty();
        st.queue.push_back_costing(delivery, bytes);
        if was_empty {
            st.woken_unfilled = true;
        }
        let over = st.link.is_some()
            && (st.queue.pressure(limits.qos0_share) >= limits.high_water_messages
                || st.queue.bytes() >= limits.high_water_bytes);
        let link = if was_empty { st.link.clone() } else { None };
        drop(st);
        if let Some(link) = link {
            link.wake();
        }
        if over {
            Enqueued::QueuedOverHighWater
        } else {
            Enqueued::Queued
        }
    }
}

/// Back pressure (ARCHITECTURE.md, "Flow control").
impl Session {
    /// Waits until this session's queue is back under its low-water mark, or its client is
    /// stalled (took nothing for `stall_time`), gone or ended. Wakes on the writer's
    /// notification; the only timer is the stall deadline. The first waiter to find the
    /// client stalled logs it and counts it.
    pub(crate) async fn wait_room(&self, limits: &QueueLimits, stats: &crate::stats::Counters) {
        loop {
            let notified = self.room.get_or_init(|| Box::new(Notify::new())).notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let stall_at = {
                let mut st = self.state.lock();
                if st.ended || st.link.is_none() || st.under_low_water(limits) {
                    return;
                }
                if st.woken_unfilled {
                    // Its writer has not run since the queue filled: the clock starts now.
                    st.woken_unfilled = false;
                    st.last_progress = now;
                }
                let stall_at = st.last_progress + limits.stall_time;
                if stall_at <= now {
                    if !st.stall_reported {
                        st.stall_reported = true;
                        let queued = st.queue.len();
                        drop(st);
                        crate::stats::Counters::add(&stats.clients_stalled, 1);
                        tracing::warn!(client_id = %self.client_id, queued, stall_time = limits.stall_time.as_secs(), "client stalled: it took no message for stall_time; publishers no longer wait for it");
                    }
                    return;
                }
                st.room_waited = true;
                stall_at
            };
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(stall_at.into()) => {}
            }
        }
    }

    /// For a stream reader feeding this session while `link` serves it: how many more
    /// deliveries its queue takes below `n`, or `None` once `link` serves it no more (the
    /// client left or another connection took over) or the session ended. At 0 the wait is
    /// marked, so that the writer's next progress signals [`Session::room_signal`] (made
    /// before the mark, as [`Session::wait_room`] does).
    pub(crate) fn reader_room(&self, n: usize, link: &Arc<crate::link::Link>) -> Option<usize> {
        self.room_signal();
        let mut st = self.state.lock();
        if st.ended || !st.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
            return None;
        }
        let room = n.saturating_sub(st.queue.len());
        if room == 0 {
            st.room_waited = true;
        }
        Some(room)
    }

    /// Signalled when the writer makes progress after a wait was marked, when the session's
    /// link leaves and when it ends (what [`Session::wait_room`] waits on).
    pub(crate) fn room_signal(&self) -> &Notify {
        self.room.get_or_init(|| Box::new(Notify::new()))
    }

    /// Wakes every publisher waiting in [`Session::wait_room`].
    pub(crate) fn release_waiters(&self) {
        if let Some(room) = self.room.get() {
            room.notify_waiters();
        }
    }

    /// Records that the writer ran and took `took` messages from the queue; returns true
    /// when publishers waiting for room must be woken ([`Session::release_waiters`]).
    pub(crate) fn progressed(
        st: &mut SessionState,
        took: usize,
        now: Instant,
        limits: &QueueLimits,
    ) -> bool {
        st.woken_unfilled = false;
        if took > 0 || st.queue.is_empty() {
            st.last_progress = now;
            st.stall_reported = false;
        }
        if st.room_waited && st.under_low_water(limits) {
            st.room_waited = false;
            return true;
        }
        false
    }
}

/// What a session gives up for the broker-wide bound (`max_queued_memory`,
/// `broker::memory_bound`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shed {
    /// Its queued QoS 0 deliveries, connected or not.
    Qos0,
    /// Its oldest queued deliveries, from the head of the queue, until at least this many
    /// bytes are freed; only while no client is connected.
    Oldest(u64),
}

impl Session {
    /// Drops what `shed` asks from the queue (reported to storage as any dequeue), counted
    /// in the session's own drop count. Returns the dropped deliveries' messages, for the
    /// caller to count and tell with no lock held; none when the session ended.
    pub(crate) fn shed(&self, shed: Shed) -> Vec<Arc<Message>> {
        let mut st = self.state.lock();
        if st.ended {
            return Vec::new();
        }
        let dropped = match shed {
            Shed::Qos0 => st.queue.retain(|q| q.qos != QoS::AtMostOnce),
            Shed::Oldest(_) if st.link.is_some() => return Vec::new(),
            Shed::Oldest(bytes) => {
                let mut freed = 0;
                let mut dropped = Vec::new();
                while freed < bytes {
                    let before = st.queue.bytes();
                    let Some(q) = st.queue.pop_front() else {
                        break;
                    };
                    freed += before - st.queue.bytes();
                    dropped.push(q);
                }
                dropped
            }
        };
        for q in &dropped {
            st.persist_dequeued(&self.client_id, q);
        }
        st.queue.shrink();
        st.dropped += dropped.len() as u64;
        drop(st);
        dropped.into_iter().map(|q| q.msg).collect()
    }
}

/// What [`Session::detach`] leaves for the broker to do.
#[derive(Debug)]
pub(crate) struct Detached {
    /// The session's generation, for the timers armed now.
    pub generation: u32,
    /// Session Expiry Interval, seconds (0: the session ends now; `u32::MAX`: never).
    pub expiry: u32,
    /// A will to publish now.
    pub will_now: Option<Will>,
    /// A will waiting for its Will Delay Interval, in seconds.
    pub will_delay: Option<u32>,
}

/// What [`Session::end`] leaves for the broker to do.
#[derive(Debug)]
pub(crate) struct Ended {
    /// The filters the session was subscribed to, to take out of the index.
    pub filters: Vec<String>,
    /// Its will, still to be published [MQTT-3.1.2-8].
    pub will: Option<Will>,
    /// Its queued and unacknowledged deliveries made through shared subscriptions, for
    /// other members of their groups (MQTT 5.0 section 4.8.2).
    pub shared: Vec<Delivery>,
    /// The backlog it ended with in storage, if any (never read: none of it was made
    /// through a shared subscription, see `broker/backlog.rs`).
    pub backlog: Option<Backlog>,
}

/// The session's life: taken by a connection, left, ended; its subscriptions.
impl Session {
    /// The connection serving this session now, if any.
    pub(crate) fn link(&self) -> Option<Arc<Link>> {
        self.state.lock().link.clone()
    }

    /// Gives the session to the connection of `link`, with what its CONNECT asked for; each
    /// connection starts a new generation. False when the session ended or another
    /// connection holds it (then `will` is left in place).
    pub(crate) fn attach(
        &self,
        link: &Arc<Link>,
        protocol: ProtocolVersion,
        expiry_interval: u32,
        will: &mut Option<Will>,
    ) -> bool {
        let mut st = self.state.lock();
        // A backlog still in storage is read first (`BrokerState::load_backlog`).
        if st.ended || st.link.is_some() || st.backlog.is_some() {
            return false;
        }
        st.link = Some(Arc::clone(link));
        // Wrapping: a timer compares for equality, and none lives for 2^32 connections.
        st.generation = st.generation.wrapping_add(1);
        st.disconnected_at = None;
        st.protocol = protocol;
        st.expiry_interval = expiry_interval;
        st.will = will.take().map(Box::new);
        true
    }

    /// The connection of `link` ended: in-flight messages are to be resent, QoS 0 messages
    /// are dropped (they are not kept for a client that is away), and the will is dropped
    /// (`publish_will` false: a normal DISCONNECT [MQTT-3.1.2-10]), due now, or left waiting
    /// for its delay. `None` when `link` no longer serves the session.
    pub(crate) fn detach(&self, link: &Arc<Link>, publish_will: bool) -> Option<Detached> {
        let mut st = self.state.lock();
        if !st.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
            return None;
        }
        st.link = None;
        st.disconnected_at = Some(Instant::now());
        st.mark_inflight_unsent();
        st.drop_qos0();
        let mut will_now = None;
        let mut will_delay = None;
        if !publish_will {
            st.will = None;
        } else if let Some(w) = &st.will {
            if w.delay == 0 || st.expiry_interval == 0 {
                will_now = st.take_will();
            } else {
                will_delay = Some(w.delay);
            }
        }
        st.persist_detached(&self.client_id);
        let detached = Detached {
            generation: st.generation,
            expiry: st.expiry_interval,
            will_now,
            will_delay,
        };
        drop(st);
        // Publishers waiting for this client stop waiting: nobody drains its queue now.
        self.release_waiters();
        Some(detached)
    }

    /// Ends the session: its queue, in-flight messages and subscriptions are dropped. Returns
    /// what it leaves behind ([`Ended`]), or `None` when it had ended.
    pub(crate) fn end(&self) -> Option<Ended> {
        let mut st = self.state.lock();
        if st.ended {
            return None;
        }
        st.ended = true;
        st.persist_ended(&self.client_id);
        // Oldest first: in flight, then queued. A QoS 2 message whose PUBREC came back was
        // received: only its PUBREL was owed.
        let mut shared: Vec<Delivery> = st
            .inflight
            .drain(..)
            .filter(|f| f.state != OutboundState::AwaitingPubComp)
            .map(|f| f.delivery)
            .collect();
        shared.extend(st.queue.retain(|_| false));
        shared.retain(|q| q.share.is_some());
        let filters: Vec<String> = st.subscriptions.drain().map(|(f, _)| f).collect();
        let will = st.take_will();
        let backlog = st.drop_backlog();
        drop(st);
        self.release_waiters();
        Some(Ended {
            filters,
            will,
            shared,
            backlog,
        })
    }

    /// Takes out of the queue the deliveries made through the shared subscription `filter`
    /// (the session left the group), reporting them to storage. In-flight ones stay: the
    /// client holds them and may acknowledge them [MQTT-3.10.4-3].
    pub(crate) fn take_shared(&self, filter: &str) -> Vec<Delivery> {
        let mut st = self.state.lock();
        let taken = st.queue.retain(|q| q.share.as_deref() != Some(filter));
        for q in &taken {
            st.persist_dequeued(&self.client_id, q);
        }
        st.note_room(&self.client_id);
        taken
    }

    /// True when no connection took the session up since `generation` and it has not ended:
    /// a timer armed then may act.
    pub(crate) fn idle_since(&self, generation: u32) -> bool {
        let st = self.state.lock();
        st.generation == generation && st.link.is_none() && !st.ended
    }

    /// The will, taken for publication, if the session is idle since `generation`.
    pub(crate) fn take_will_if_idle(&self, generation: u32) -> Option<Will> {
        let mut st = self.state.lock();
        if st.generation != generation || st.link.is_some() || st.ended {
            return None;
        }
        let will = st.take_will();
        if will.is_some() {
            st.persist_will_cleared(&self.client_id);
        }
        will
    }

    /// Records a subscription: `Some(true)` when it replaced one on the same filter, `None`
    /// (nothing recorded) when the session holds `max` subscriptions already and `filter` is
    /// not one of them.
    pub(crate) fn add_subscription_within(
        &self,
        filter: &str,
        granted: Granted,
        max: usize,
    ) -> Option<bool> {
        let mut st = self.state.lock();
        if st.subscriptions.len() >= max && !st.subscriptions.contains_key(filter) {
            return None;
        }
        let existed = st
            .subscriptions
            .insert(filter.to_string(), granted)
            .is_some();
        st.persist_subscription(&self.client_id, filter, Some(&granted));
        Some(existed)
    }

    /// Removes a subscription. True when it existed.
    pub(crate) fn remove_subscription(&self, filter: &str) -> bool {
        let mut st = self.state.lock();
        let existed = st.subscriptions.remove(filter).is_some();
        if existed {
            st.persist_subscription(&self.client_id, filter, None);
        }
        existed
    }

    /// The filters of the session's subscriptions.
    pub(crate) fn filters(&self) -> Vec<String> {
        self.state.lock().subscriptions.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServerConfig;

    fn delivery(qos: QoS, n: u8) -> Delivery {
        queue::tests::delivery_of(qos, bytes::Bytes::from(vec![n; 10]))
    }

    /// An offline session sheds its QoS 0 deliveries, then its oldest, from the head, until
    /// the bytes asked for are freed; the broker's account follows.
    #[test]
    fn an_offline_session_sheds_qos0_then_its_oldest() {
        let memory = Arc::new(QueuedMemory::new(0));
        let s = Session::new("c".into(), ProtocolVersion::V5, u32::MAX, &memory);
        let limits = QueueLimits::new(&ServerConfig::default());
        // Offline, QoS 0 is not queued: put one in as a connected session would have.
        s.state.lock().queue.push_back(delivery(QoS::AtMostOnce, 0));
        for n in 1..=4 {
            assert!(s
                .enqueue(delivery(QoS::AtLeastOnce, n), &limits)
                .is_queued());
        }
        let cost = delivery(QoS::AtLeastOnce, 0).cost();
        assert_eq!(memory.bytes(), 5 * cost);

        let dropped = s.shed(Shed::Qos0);
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].qos, QoS::AtMostOnce);
        assert_eq!(memory.bytes(), 4 * cost);

        // Just over one delivery's bytes: two go, the oldest two.
        let dropped = s.shed(Shed::Oldest(cost + 1));
        let firsts: Vec<u8> = dropped.iter().map(|m| m.payload[0]).collect();
        assert_eq!(firsts, [1, 2]);
        assert_eq!(memory.bytes(), 2 * cost);
        let st = s.state.lock();
        let left: Vec<u8> = st.queue.iter().map(|d| d.msg.payload[0]).collect();
        assert_eq!(left, [3, 4]);
        assert_eq!(st.dropped, 3, "counted in the session's own drops");
        drop(st);

        s.end();
        assert_eq!(memory.bytes(), 0);
        assert!(
            s.shed(Shed::Oldest(u64::MAX)).is_empty(),
            "an ended session"
        );
    }

    /// Storage that takes every report and keeps none.
    #[derive(Debug)]
    struct Reported;

    impl SessionChanges for Reported {
        fn queued(&self, _: &Arc<str>, _: &Delivery) {}
        fn dequeued(&self, _: &str, _: u64) {}
        fn inflight_set(&self, _: &str, _: &Inflight) {}
        fn inflight_removed(&self, _: &str, _: u16) {}
        fn inbound_qos2(&self, _: &str, _: u16, _: bool) {}
        fn subscription(&self, _: &str, _: &str, _: Option<&Granted>) {}
        fn will_cleared(&self, _: &str) {}
        fn detached(&self, _: &str, _: &SessionState) {}
        fn ended(&self, _: &str) {}
    }

    /// A stored offline session leaves the head of its queue, up to a position, in storage:
    /// it joins the backlog (counted, not in memory), twice over, and the queue's bytes leave
    /// the broker's account; a session not stored keeps its queue.
    #[test]
    fn the_head_of_a_stored_queue_joins_the_backlog() {
        let memory = Arc::new(QueuedMemory::new(0));
        let limits = QueueLimits::new(&ServerConfig::default());
        let s = Session::new("c".into(), ProtocolVersion::V5, u32::MAX, &memory);
        for n in 1..=5 {
            assert!(s
                .enqueue(delivery(QoS::AtLeastOnce, n), &limits)
                .is_queued());
        }
        let cost = delivery(QoS::AtLeastOnce, 0).cost();
        assert_eq!(s.state.lock().release_to_storage(5), 0, "not stored");

        s.state.lock().report_changes_to(Arc::new(Reported));
        let mut st = s.state.lock();
        assert_eq!(st.release_to_storage(2), 2 * cost);
        let backlog = |len, last_seq| {
            Some(Backlog {
                len,
                last_seq,
                restored: false,
            })
        };
        assert_eq!(st.backlog(), backlog(2, 2));
        assert_eq!(st.release_to_storage(4), 2 * cost);
        assert_eq!(st.backlog(), backlog(4, 4));
        assert_eq!(st.release_to_storage(4), 0, "the head is above 4");
        assert_eq!(st.queued_len(), 5, "the backlog still counts");
        assert_eq!(memory.bytes(), cost);
        let left: Vec<u64> = st.queue.iter().map(|d| d.seq).collect();
        assert_eq!(left, [5]);
    }
}
