//! The application message as the broker holds it: one allocation shared (through `Arc`) by
//! every queue it is routed to, so a fan-out to N subscribers copies the payload zero times.

use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use bytes::{Bytes, BytesMut};

use crate::codec::{self, Properties, ProtocolVersion, PublishRef, QoS};

/// An application message accepted from a publisher (or an in-process `publish`, or a will).
#[derive(Debug)]
pub struct Message {
    /// Topic name (never empty: a topic alias is resolved before a message is built).
    pub topic: String,
    pub payload: Bytes,
    /// The QoS it was published with.
    pub qos: QoS,
    /// The RETAIN flag it was published with.
    pub retain: bool,
    /// The publisher's MQTT 5.0 properties that are forwarded (payload format indicator,
    /// content type, response topic, correlation data, user properties in order). Topic Alias
    /// and Subscription Identifiers are per connection and never stored here; the Message
    /// Expiry Interval lives in `expires_at` and is recomputed when forwarded [MQTT-3.3.2-6].
    pub properties: Properties,
    /// When the Message Expiry Interval runs out; `None` = never.
    pub expires_at: Option<Instant>,
    /// Client identifier of the publisher, for No Local; `None` for in-process publishes.
    pub publisher: Option<Arc<str>>,
    /// The rest of the publisher's identity (user name, listener), kept only on a retained
    /// message published with `check_retain_source` on, whose delivery asks the access rules
    /// about its publisher again; `None` otherwise (one pointer, no allocation).
    pub(crate) source: Option<Box<Source>>,
    /// This message as an MQTT 3.1.1 PUBLISH at QoS 0 without DUP, RETAIN or properties,
    /// encoded by the first delivery that shares it with others ([`Message::shared_v3_qos0`]);
    /// empty until then. Not copied by `clone`.
    pub(crate) encoded: OnceLock<Bytes>,
    /// Its place in storage's message store, set by the first delivery to a stored session
    /// (which stores it, once, before any reference to it) or by the restore. Dropped with
    /// the message, which then tells storage it holds the message no more. Not copied by
    /// `clone`.
    pub(crate) stored: OnceLock<Stored>,
}

/// A retained message's publisher as the access rules know it (`check_retain_source`): the
/// user name it authenticated with, and the listener whose own rules applied to it (an index
/// into `listeners`; `None`: `[auth]`'s), as in the publisher's session identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Source {
    pub(crate) username: Option<Arc<str>>,
    pub(crate) listener: Option<u32>,
}

/// Who a stored message tells that the broker holds it no more (the storage writer).
pub(crate) trait ReleaseStored: Send + Sync {
    /// Message `id` of the message store is held no more: no reference to it will be made.
    fn release(&self, id: u64);
}

/// The storage writer as stored messages hold it: a sized type, so that their `Weak` to it
/// is one pointer (one to a `dyn` trait is two, which would make every `Message` 8 bytes
/// larger, and its moves dearer on the hot path).
pub(crate) struct Releaser(pub(crate) Box<dyn ReleaseStored>);

/// A message's identifier in storage's message store, released when the message is dropped.
pub(crate) struct Stored {
    pub(crate) id: u64,
    release: Weak<Releaser>,
}

impl Stored {
    pub(crate) fn new(id: u64, release: Weak<Releaser>) -> Stored {
        Stored { id, release }
    }
}

impl Drop for Stored {
    fn drop(&mut self) {
        if let Some(r) = self.release.upgrade() {
            r.0.release(self.id);
        }
    }
}

impl std::fmt::Debug for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Stored").field(&self.id).finish()
    }
}

impl Clone for Message {
    /// A copy without the encoding kept by [`Message::shared_v3_qos0`] (a copy may be given
    /// another topic or payload), and not stored.
    fn clone(&self) -> Message {
        Message {
            topic: self.topic.clone(),
            payload: self.payload.clone(),
            qos: self.qos,
            retain: self.retain,
            properties: self.properties.clone(),
            expires_at: self.expires_at,
            publisher: self.publisher.clone(),
            source: self.source.clone(),
            encoded: OnceLock::new(),
            stored: OnceLock::new(),
        }
    }
}

#[cfg(test)]
impl Message {
    /// A message on `topic` with `payload`, as published without properties (for tests).
    pub(crate) fn for_test(topic: &str, payload: Bytes, qos: QoS) -> Message {
        Message {
            qos,
            retain: false,
            ..Message::broker_retained(topic.into(), payload)
        }
    }
}

impl Message {
    /// One of the broker's own retained messages (`$SYS`, a bridge's state topic): QoS 0,
    /// retained, no properties, no publisher.
    pub(crate) fn broker_retained(topic: String, payload: Bytes) -> Message {
        Message {
            topic,
            payload,
            qos: QoS::AtMostOnce,
            retain: true,
            properties: Properties::default(),
            expires_at: None,
            publisher: None,
            source: None,
            encoded: OnceLock::new(),
            stored: OnceLock::new(),
        }
    }

    /// When a message published now with this Message Expiry Interval (seconds) runs out.
    /// `None` (never) when the property is absent, and also when it is 0: mosquitto treats 0
    /// as "no expiry", and dropping a message in the instant it is published would only ever
    /// lose it, even for subscribers online at that moment.
    pub fn expiry_deadline(interval: Option<u32>, now: Instant) -> Option<Instant> {
        interval
            .filter(|&secs| secs > 0)
            .map(|secs| now + std::time::Duration::from_secs(u64::from(secs)))
    }

    /// Bytes this message holds: its topic, payload and properties. What it costs in each
    /// session queue it waits in (`max_queued_bytes`, the high-water mark).
    pub fn size(&self) -> usize {
        self.topic.len() + self.payload.len() + self.properties.variable_len()
    }

    /// This message as the PUBLISH packet a 3.1 / 3.1.1 subscriber gets at QoS 0 without
    /// RETAIN (under its full topic: no mount point to remove), encoded on the first call and
    /// kept with the message: the deliveries of a message to many such subscribers (a
    /// fan-out) are encoded once and copied. 3.x has no properties, so the bytes are the
    /// same for each of them. `None` when the message cannot be encoded (a topic over 65,535
    /// bytes, a packet over the protocol's limit).
    pub(crate) fn shared_v3_qos0(&self) -> Option<&Bytes> {
        if let Some(bytes) = self.encoded.get() {
            return Some(bytes);
        }
        let p = PublishRef {
            dup: false,
            qos: QoS::AtMostOnce,
            retain: false,
            topic: &self.topic,
            packet_id: 0,
            properties: &self.properties,
            payload: &self.payload,
        };
        let mut buf = BytesMut::new();
        codec::encode_publish(&p, ProtocolVersion::V311, &mut buf).ok()?;
        Some(self.encoded.get_or_init(|| buf.freeze()))
    }

    /// True once the Message Expiry Interval has passed [MQTT-3.3.2-5].
    pub fn is_expired(&self, now: Instant) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }

    /// Seconds left of the Message Expiry Interval, rounded up, at `now`; `None` = no expiry.
    pub fn remaining_expiry(&self, now: Instant) -> Option<u32> {
        self.expires_at.map(|at| {
            let left = at.saturating_duration_since(now);
            let secs = left.as_secs() + u64::from(left.subsec_nanos() > 0);
            u32::try_from(secs).unwrap_or(u32::MAX)
        })
    }
}

// `source` fits where a `Weak<dyn ...>` in `Stored` took room: a move of a message copies
// no more than before it.
const _: () = assert!(std::mem::size_of::<Message>() <= 512);
