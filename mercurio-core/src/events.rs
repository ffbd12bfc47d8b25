//! Lifecycle events for the embedding application: [`BrokerHandle::events`] gives an
//! [`EventStream`] of clients connecting and leaving, subscriptions, expired sessions, wills
//! and dropped messages.
//!
//! The broker never waits for a listener: events go into a bounded broadcast buffer (tokio's
//! `broadcast`), and a stream that falls more than its capacity behind loses the oldest ones,
//! then reads one [`Event::Lagged`] saying how many. With no stream open, firing an event
//! costs one atomic load: nothing is built.
//!
//! [`BrokerHandle::events`]: crate::BrokerHandle::events

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::{broadcast, Notify};

use crate::codec::{ProtocolVersion, QoS, SubscriptionOptions};
use crate::link::DisconnectReason;
use crate::stats::DropCause;

/// Events an [`EventStream`] holds before the oldest are lost, unless the builder sets
/// another capacity ([`BrokerBuilder::event_capacity`](crate::BrokerBuilder::event_capacity)).
pub const DEFAULT_EVENT_CAPACITY: usize = 1024;

/// Something that happened in the broker. Events of network clients only: the
/// application's own in-process subscriptions and publishes fire none.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A client's CONNECT was accepted: fires once its session is taken, just before the
    /// CONNACK (Success) is written.
    Connected {
        /// The client identifier (the assigned one when the client sent none).
        client_id: String,
        /// The user name the client authenticated as (CONNECT's, an authenticator's, or the
        /// certificate's common name); `None` for an anonymous client.
        username: Option<String>,
        protocol: ProtocolVersion,
        /// The client's address.
        peer: SocketAddr,
        /// CONNECT's Clean Start (3.x: Clean Session) flag.
        clean_start: bool,
        /// Whether a session was resumed (CONNACK's Session Present).
        session_present: bool,
    },
    /// A client's connection ended, for any reason; fires before its will is published or
    /// its session ends (so a [`Event::WillPublished`] for it comes after).
    Disconnected {
        client_id: String,
        /// Why: the client's DISCONNECT, a lost connection, keep alive, takeover, shutdown,
        /// an administrator, a protocol violation (with its reason code), a socket error.
        reason: DisconnectReason,
    },
    /// A SUBSCRIBE was handled: fires after the SUBACK is queued, with the subscriptions it
    /// granted (filters refused or invalid are not listed; none granted, no event).
    Subscribed {
        client_id: String,
        subscriptions: Vec<SubscribedFilter>,
    },
    /// An UNSUBSCRIBE removed subscriptions: fires with the filters that existed (none, no
    /// event).
    Unsubscribed {
        client_id: String,
        filters: Vec<String>,
    },
    /// A session's Session Expiry Interval ran out while its client was away, and it ended
    /// (its subscriptions and queued messages are gone; its will, if any, is published next).
    SessionExpired { client_id: String },
    /// A client's will was published: after an abnormal close, after its Will Delay
    /// Interval, or when its session ended (MQTT 5.0 section 3.1.3.2.2).
    WillPublished {
        client_id: String,
        topic: String,
        qos: QoS,
        retain: bool,
    },
    /// A message accepted from a publisher did not reach one subscriber (counted in
    /// `$SYS/broker/publish/messages/dropped/<cause>`).
    MessageDropped {
        /// The subscriber; `None` when no member of a shared subscription's group could take
        /// it ([`DropCause::NoShareMember`]).
        client_id: Option<String>,
        topic: String,
        cause: DropCause,
    },
    /// This stream fell behind: `missed` events were lost before the next one it reads.
    Lagged { missed: u64 },
}

/// One subscription a SUBSCRIBE granted, in [`Event::Subscribed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribedFilter {
    /// The topic filter as sent (with any `$share/group/` prefix).
    pub filter: String,
    /// The options as granted (the QoS is capped at `max_qos`).
    pub options: SubscriptionOptions,
    /// The SUBSCRIBE's Subscription Identifier (MQTT 5.0 section 3.8.2.1.2).
    pub identifier: Option<u32>,
}

/// Where the broker fires its events.
pub(crate) struct Events {
    tx: broadcast::Sender<Event>,
    /// Open [`EventStream`]s: the one check made before building an event.
    listeners: Arc<AtomicUsize>,
    stopped: Arc<Stopped>,
}

/// Set when the broker has shut down, so that streams end.
#[derive(Default)]
struct Stopped {
    flag: AtomicBool,
    notify: Notify,
}

impl Events {
    pub(crate) fn new(capacity: usize) -> Events {
        let (tx, _) = broadcast::channel(capacity.max(1));
        Events {
            tx,
            listeners: Arc::default(),
            stopped: Arc::default(),
        }
    }

    /// True when a stream is open: only then is an event worth building.
    #[inline]
    pub(crate) fn listening(&self) -> bool {
        self.listeners.load(Ordering::Relaxed) > 0
    }

    /// Fires the event `make` builds, when a stream is open. Never waits.
    #[inline]
    pub(crate) fn fire(&self, make: impl FnOnce() -> Event) {
        if self.listening() {
            let _ = self.tx.send(make());
        }
    }

    /// A new stream, receiving the events fired from now on.
    pub(crate) fn subscribe(&self) -> EventStream {
        self.listeners.fetch_add(1, Ordering::Relaxed);
        EventStream {
            rx: self.tx.subscribe(),
            listeners: Arc::clone(&self.listeners),
            stopped: Arc::clone(&self.stopped),
        }
    }

    /// The broker has stopped: streams end once they have read what was fired.
    pub(crate) fn stop(&self) {
        self.stopped.flag.store(true, Ordering::Release);
        self.stopped.notify.notify_waiters();
    }
}

/// A bounded stream of broker [`Event`]s, from [`BrokerHandle::events`]. Read it with
/// [`EventStream::recv`]; one that falls behind loses the oldest events and reads an
/// [`Event::Lagged`] with their number. Dropping it stops the broker building events for it.
///
/// [`BrokerHandle::events`]: crate::BrokerHandle::events
pub struct EventStream {
    rx: broadcast::Receiver<Event>,
    listeners: Arc<AtomicUsize>,
    stopped: Arc<Stopped>,
}

impl EventStream {
    /// The next event; [`Event::Lagged`] when events were lost since the last one read;
    /// `None` once the broker has shut down and every event fired before is read.
    pub async fn recv(&mut self) -> Option<Event> {
        loop {
            let stopped = self.stopped.notify.notified();
            tokio::pin!(stopped);
            stopped.as_mut().enable();
            match self.rx.try_recv() {
                Ok(event) => return Some(event),
                Err(broadcast::error::TryRecvError::Lagged(missed)) => {
                    return Some(Event::Lagged { missed })
                }
                Err(broadcast::error::TryRecvError::Closed) => return None,
                Err(broadcast::error::TryRecvError::Empty) => {}
            }
            if self.stopped.flag.load(Ordering::Acquire) {
                return None;
            }
            tokio::select! {
                r = self.rx.recv() => return match r {
                    Ok(event) => Some(event),
                    Err(broadcast::error::RecvError::Lagged(missed)) => Some(Event::Lagged { missed }),
                    Err(broadcast::error::RecvError::Closed) => None,
                },
                _ = &mut stopped => {}
            }
        }
    }

    /// The next event if one is waiting, without waiting (`Lagged` as for `recv`).
    pub fn try_recv(&mut self) -> Option<Event> {
        match self.rx.try_recv() {
            Ok(event) => Some(event),
            Err(broadcast::error::TryRecvError::Lagged(missed)) => Some(Event::Lagged { missed }),
            Err(_) => None,
        }
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.listeners.fetch_sub(1, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream").finish_non_exhaustive()
    }
}
