//! Callbacks for the embedding application that observe what happens to messages: a
//! delivery completed (its acknowledgement received), a message dropped (with its cause, as
//! the drop counters count it), a will published, a retained message set or cleared
//! (docs/embedding.md, "Observing deliveries").
//!
//! Each is installed with its [`BrokerBuilder`](crate::BrokerBuilder) method
//! (`on_delivery_completed`, `on_dropped`, `on_will`, `on_retained_change`) and is an
//! `Option` in [`Observers`]: a broker without one pays a `None` check where it would be
//! called, nothing is built. A callback runs on the task of the event (a connection's
//! reader for an acknowledgement, a publisher's task for a drop at routing...), with none of
//! the broker's locks held, and must not block: it delays that task (for the network
//! reader, every packet of that client). A panic in one is caught and logged once per call
//! (error level, with the client identifier) and changes nothing else.

use std::sync::Arc;

use crate::codec::QoS;
use crate::hook::guard_now;
use crate::message::Message;
use crate::stats::DropCause;

/// A message one subscriber acknowledged: PUBACK for QoS 1, PUBCOMP for QoS 2, a bridge's
/// remote's acknowledgement, or [`Received::ack`](crate::Received::ack) for an in-process
/// client. Reported once per message and subscriber: a duplicate acknowledgement (an
/// identifier no longer in flight) is not.
#[derive(Debug)]
pub struct DeliveryCompleted<'a> {
    /// The subscriber's client identifier (`$internal/bridge/<name>` for a bridge,
    /// `$internal/client/<id>` for an in-process client).
    pub client_id: &'a str,
    /// The message delivered.
    pub message: &'a Arc<Message>,
    /// The QoS it was delivered at (1 or 2).
    pub qos: QoS,
}

/// A message that did not reach a subscriber, counted in `publish/messages/dropped/<cause>`
/// (the same drops as [`Event::MessageDropped`](crate::Event::MessageDropped)).
#[derive(Debug)]
pub struct MessageDropped<'a> {
    /// The subscriber that lost it; `None` when no member of a shared group could take it.
    pub client_id: Option<&'a str>,
    /// Its topic.
    pub topic: &'a str,
    /// Why.
    pub cause: DropCause,
}

/// A will being published (MQTT 5.0 section 3.1.2.5), before the publish interceptors see it.
#[derive(Debug)]
pub struct WillPublished<'a> {
    /// The client whose will it is.
    pub client_id: &'a str,
    /// The will message (topic, payload, QoS, RETAIN, properties).
    pub message: &'a Message,
}

/// A change of the retained messages (MQTT 5.0 section 3.3.1.3).
#[derive(Debug)]
pub enum RetainedChange<'a> {
    /// `message` is now the retained message of its topic (new or replacing one).
    Set(&'a Arc<Message>),
    /// The topic's retained message was deleted: by an empty retained PUBLISH, or because
    /// its replacement was over `max_retained_messages` / `max_retained_bytes` (not kept).
    Cleared {
        /// The topic.
        topic: &'a str,
    },
}

/// The callbacks' types, each called with what it observes, borrowed for the call.
type OnCompleted = dyn for<'a> Fn(&DeliveryCompleted<'a>) + Send + Sync;
type OnDropped = dyn for<'a> Fn(&MessageDropped<'a>) + Send + Sync;
type OnWill = dyn for<'a> Fn(&WillPublished<'a>) + Send + Sync;
type OnRetained = dyn for<'a> Fn(&RetainedChange<'a>) + Send + Sync;

/// The installed callbacks (set by the builder, never changed afterwards).
#[derive(Default)]
pub(crate) struct Observers {
    pub(crate) completed: Option<Box<OnCompleted>>,
    pub(crate) dropped: Option<Box<OnDropped>>,
    pub(crate) will: Option<Box<OnWill>>,
    pub(crate) retained: Option<Box<OnRetained>>,
}

impl Observers {
    /// A delivery to `client_id` completed.
    #[inline]
    pub(crate) fn completed(&self, client_id: &str, message: &Arc<Message>, qos: QoS) {
        if let Some(f) = &self.completed {
            let event = DeliveryCompleted {
                client_id,
                message,
                qos,
            };
            guard_now("delivery-completed callback", client_id, || f(&event));
        }
    }

    /// A message dropped.
    #[inline]
    pub(crate) fn dropped(&self, client_id: Option<&str>, topic: &str, cause: DropCause) {
        if let Some(f) = &self.dropped {
            let event = MessageDropped {
                client_id,
                topic,
                cause,
            };
            guard_now("dropped callback", client_id.unwrap_or(""), || f(&event));
        }
    }

    /// A will published.
    #[inline]
    pub(crate) fn will(&self, client_id: &str, message: &Message) {
        if let Some(f) = &self.will {
            let event = WillPublished { client_id, message };
            guard_now("will callback", client_id, || f(&event));
        }
    }

    /// The retained set changed.
    #[inline]
    pub(crate) fn retained(&self, change: RetainedChange<'_>) {
        if let Some(f) = &self.retained {
            guard_now("retained-change callback", "", || f(&change));
        }
    }
}
