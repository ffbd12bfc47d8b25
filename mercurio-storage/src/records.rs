//! The persisted data model: sessions and what they hold, and retained messages.
//!
//! These are plain data. Times are unix milliseconds (`u64`) unless a field says seconds;
//! QoS levels are `u8` (0, 1 or 2); MQTT 5 properties are the bytes the core encoded, which
//! storage keeps without reading them.

use bytes::Bytes;

/// The session expiry interval meaning "the session never expires" (seconds).
pub const NEVER_EXPIRES: u32 = u32::MAX;

/// The scalar part of a session: everything of [`SessionRecord`] but its collections.
///
/// Written by [`Change::SessionSaved`](crate::Change::SessionSaved) on connect and on
/// disconnect, without touching the session's subscriptions, will or messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionHeader {
    /// The client identifier (the one the broker assigned, if the client sent none).
    pub client_id: String,
    /// The protocol level the client last connected with: 3 (3.1), 4 (3.1.1) or 5 (5.0).
    pub protocol_level: u8,
    /// Session expiry interval in seconds, counted from `disconnected_at`;
    /// [`NEVER_EXPIRES`] (`u32::MAX`) means never. For 3.x clients the core stores the value
    /// it derives from clean session and `persistent_client_expiration`.
    pub session_expiry_interval: u32,
    /// When the client disconnected, in unix milliseconds; `None` while it is connected.
    /// A session loaded with `None` was connected when the previous broker stopped.
    pub disconnected_at: Option<u64>,
    /// The user name the client last connected with (`None`: none given). Access checks on
    /// messages routed to the session while it is offline after a restart use it.
    pub username: Option<String>,
    /// The name (common name) of the client certificate the client last connected with, on
    /// a listener that asks for one; `None`: no certificate. With `username`, who the
    /// session belongs to: a client of another identity gets a new session.
    pub certificate: Option<String>,
}

impl SessionHeader {
    /// When the session expires, in unix milliseconds: `None` while the client is connected
    /// or if the session never expires.
    pub fn expires_at(&self) -> Option<u64> {
        let disconnected_at = self.disconnected_at?;
        if self.session_expiry_interval == NEVER_EXPIRES {
            return None;
        }
        Some(disconnected_at.saturating_add(u64::from(self.session_expiry_interval) * 1000))
    }

    /// Whether the session has expired at `now` (unix milliseconds).
    pub fn is_expired(&self, now: u64) -> bool {
        self.expires_at().is_some_and(|at| at <= now)
    }
}

/// A session's queue left in storage at load: how many deliveries it holds and the range of
/// their positions ([`QueuedRecord::seq`]), so that the broker can count them and number new
/// deliveries after them without reading them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Deliveries queued, at least 1.
    pub len: u64,
    /// The lowest position queued.
    pub first_seq: u64,
    /// The highest position queued.
    pub last_seq: u64,
}

/// A whole session, as loaded at start or written whole by
/// [`Change::SessionWritten`](crate::Change::SessionWritten).
///
/// Collections come back from [`Storage::load`](crate::Storage::load) in a fixed order:
/// subscriptions by filter (byte order), queued messages by `seq`, in-flight messages in the
/// order their packet identifier was first set, inbound QoS 2 packet identifiers ascending.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SessionRecord {
    /// The client identifier.
    pub client_id: String,
    /// The protocol level the client last connected with: 3, 4 or 5.
    pub protocol_level: u8,
    /// Session expiry interval in seconds from `disconnected_at`; [`NEVER_EXPIRES`] = never.
    pub session_expiry_interval: u32,
    /// When the client disconnected, in unix milliseconds; `None` while it is connected.
    pub disconnected_at: Option<u64>,
    /// The user name the client last connected with (see [`SessionHeader::username`]).
    pub username: Option<String>,
    /// The client certificate's name (see [`SessionHeader::certificate`]).
    pub certificate: Option<String>,
    /// The session's subscriptions, one per topic filter, sorted by filter.
    pub subscriptions: Vec<SubscriptionRecord>,
    /// The will to publish when the session's connection ends abnormally, if any.
    pub will: Option<WillRecord>,
    /// Messages waiting to be sent to the client, sorted by `seq`: references to stored
    /// messages. Empty when the queue was left in storage (see
    /// [`LoadedState::backlogs`](crate::LoadedState::backlogs)).
    pub queued: Vec<QueuedRecord>,
    /// Outbound QoS 1 and 2 messages sent and not yet acknowledged, in the order first sent.
    pub inflight: Vec<InflightRecord>,
    /// Packet identifiers of inbound QoS 2 PUBLISHes received (PUBREC sent) and awaiting
    /// PUBREL, ascending.
    pub inbound_qos2: Vec<u16>,
}

impl SessionRecord {
    /// A session with this header and empty collections.
    pub fn new(header: SessionHeader) -> SessionRecord {
        SessionRecord {
            client_id: header.client_id,
            protocol_level: header.protocol_level,
            session_expiry_interval: header.session_expiry_interval,
            disconnected_at: header.disconnected_at,
            username: header.username,
            certificate: header.certificate,
            subscriptions: Vec::new(),
            will: None,
            queued: Vec::new(),
            inflight: Vec::new(),
            inbound_qos2: Vec::new(),
        }
    }

    /// The scalar part of this session.
    pub fn header(&self) -> SessionHeader {
        SessionHeader {
            client_id: self.client_id.clone(),
            protocol_level: self.protocol_level,
            session_expiry_interval: self.session_expiry_interval,
            disconnected_at: self.disconnected_at,
            username: self.username.clone(),
            certificate: self.certificate.clone(),
        }
    }

    /// When the session expires, in unix milliseconds (see [`SessionHeader::expires_at`]).
    pub fn expires_at(&self) -> Option<u64> {
        self.header().expires_at()
    }

    /// Whether the session has expired at `now` (unix milliseconds).
    pub fn is_expired(&self, now: u64) -> bool {
        self.expires_at().is_some_and(|at| at <= now)
    }
}

/// One subscription of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SubscriptionRecord {
    /// The topic filter as the client sent it, including a `$share/{group}/` prefix for a
    /// shared subscription. Unique within a session.
    pub filter: String,
    /// Maximum QoS granted: 0, 1 or 2.
    pub qos: u8,
    /// MQTT 5 No Local: don't send the client its own publications.
    pub no_local: bool,
    /// MQTT 5 Retain As Published: keep the RETAIN flag when forwarding.
    pub retain_as_published: bool,
    /// MQTT 5 Retain Handling: 0 send retained on subscribe, 1 only if the subscription is
    /// new, 2 never.
    pub retain_handling: u8,
    /// MQTT 5 Subscription Identifier (1 to 268,435,455), if the SUBSCRIBE carried one.
    pub subscription_identifier: Option<u32>,
}

impl SubscriptionRecord {
    /// A subscription to `filter` at `qos` with every MQTT 5 option at its default.
    pub fn new(filter: impl Into<String>, qos: u8) -> SubscriptionRecord {
        SubscriptionRecord {
            filter: filter.into(),
            qos,
            no_local: false,
            retain_as_published: false,
            retain_handling: 0,
            subscription_identifier: None,
        }
    }

    /// For a shared subscription `$share/{group}/{filter}`, its group and filter.
    pub fn share(&self) -> Option<(&str, &str)> {
        self.filter.strip_prefix("$share/")?.split_once('/')
    }
}

/// An application message, as stored once for its deliveries ([`StoredMessage`]), retained
/// or set as a will.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct MessageRecord {
    /// The topic name (never an alias: the core resolves topic aliases before storing).
    pub topic: String,
    /// The payload, shared with every other copy of the message.
    pub payload: Bytes,
    /// QoS as published (for a stored, retained or will message). 0, 1 or 2.
    pub qos: u8,
    /// The RETAIN flag.
    pub retain: bool,
    /// MQTT 5 PUBLISH properties as encoded by the core; opaque here, empty for 3.x.
    /// The message expiry interval is not among them: it is `expires_at`.
    pub properties: Bytes,
    /// When the message expires, in unix milliseconds (from the MQTT 5 Message Expiry
    /// Interval); `None` = never.
    pub expires_at: Option<u64>,
    /// The client that published the message; `None` for messages published by the broker
    /// itself or by the embedding application.
    pub publisher: Option<String>,
    /// Always `None` now (a delivery's shared subscription is
    /// [`DeliveryRecord::share`]); kept for the `share` column of retained messages.
    pub share: Option<String>,
}

impl MessageRecord {
    /// Its bytes as a stream counts them: topic, payload and properties.
    pub fn size(&self) -> u64 {
        (self.topic.len() + self.payload.len() + self.properties.len()) as u64
    }

    /// A message with no properties, no expiry and no publisher.
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>, qos: u8) -> MessageRecord {
        MessageRecord {
            topic: topic.into(),
            payload: payload.into(),
            qos,
            retain: false,
            properties: Bytes::new(),
            expires_at: None,
            publisher: None,
            share: None,
        }
    }

    /// Whether the message has expired at `now` (unix milliseconds).
    pub fn is_expired(&self, now: u64) -> bool {
        self.expires_at.is_some_and(|at| at <= now)
    }
}

/// A session's will.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WillRecord {
    /// The will message.
    pub message: MessageRecord,
    /// MQTT 5 Will Delay Interval in seconds, counted from the session's `disconnected_at`;
    /// 0 for 3.x.
    pub delay_interval: u32,
}

/// A message as published, stored once however many sessions it waits for: what
/// [`Change::MessageStored`](crate::Change::MessageStored) writes and
/// [`LoadedState::messages`](crate::LoadedState::messages) holds. Queued and in-flight
/// deliveries refer to it by `id` ([`DeliveryRecord::message_id`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct StoredMessage {
    /// The message's identifier, given by the broker (unique among stored messages).
    /// Below 2^63: SQL backends store it as a signed 64-bit integer.
    pub id: u64,
    /// The message with the QoS and RETAIN flag it was published with; `share` is `None`
    /// (a delivery's shared subscription is on the [`DeliveryRecord`]).
    pub message: MessageRecord,
}

/// One delivery of a stored message to one session: a reference to the message, with what
/// differs per delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct DeliveryRecord {
    /// The [`StoredMessage::id`] of the message delivered.
    pub message_id: u64,
    /// The delivery QoS (the lower of the published QoS and the subscription's): 0, 1 or 2.
    pub qos: u8,
    /// The RETAIN flag of the delivery (Retain As Published, or a retained message sent on
    /// subscribe).
    pub retain: bool,
    /// MQTT 5 Subscription Identifiers of the subscriptions that matched, in order; empty
    /// for none. (A message migrated from schema 3 has them in its properties instead.)
    pub subscription_ids: Vec<u32>,
    /// For a delivery through a shared subscription, the group's full filter
    /// (`$share/{ShareName}/{filter}`): if the session ends before the client acknowledges
    /// it, the broker gives it to another member of the group (MQTT 5.0 section 4.8.2).
    pub share: Option<String>,
}

impl DeliveryRecord {
    /// A delivery of message `message_id` at `qos`, without RETAIN, subscription
    /// identifiers or shared subscription.
    pub fn new(message_id: u64, qos: u8) -> DeliveryRecord {
        DeliveryRecord {
            message_id,
            qos,
            retain: false,
            subscription_ids: Vec::new(),
            share: None,
        }
    }
}

/// A message waiting in a session's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct QueuedRecord {
    /// Position in the session's queue, assigned by the core, increasing; unique per session.
    /// Below 2^63: SQL backends store it as a signed 64-bit integer.
    pub seq: u64,
    /// The delivery: which stored message, at which QoS.
    pub delivery: DeliveryRecord,
}

/// Where an outbound QoS 1 or 2 message stands in its acknowledgement flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum InflightState {
    /// QoS 1 PUBLISH sent, PUBACK awaited. Resent (DUP) after a reconnect.
    AwaitingPubAck,
    /// QoS 2 PUBLISH sent, PUBREC awaited. Resent (DUP) after a reconnect.
    AwaitingPubRec,
    /// QoS 2 PUBREC received and PUBREL sent, PUBCOMP awaited. After a reconnect the PUBREL
    /// is resent, not the message.
    AwaitingPubComp,
}

impl InflightState {
    /// A stable name for the state, as SQL backends store it.
    pub fn as_str(self) -> &'static str {
        match self {
            InflightState::AwaitingPubAck => "awaiting_puback",
            InflightState::AwaitingPubRec => "awaiting_pubrec",
            InflightState::AwaitingPubComp => "awaiting_pubcomp",
        }
    }

    /// The state [`as_str`](Self::as_str) names, or `None` for an unknown name.
    pub fn parse(name: &str) -> Option<InflightState> {
        match name {
            "awaiting_puback" => Some(InflightState::AwaitingPubAck),
            "awaiting_pubrec" => Some(InflightState::AwaitingPubRec),
            "awaiting_pubcomp" => Some(InflightState::AwaitingPubComp),
            _ => None,
        }
    }
}

/// An outbound message sent to the client and not yet fully acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct InflightRecord {
    /// The packet identifier it was sent with; unique among a session's in-flight messages.
    pub packet_id: u16,
    /// The delivery: which stored message, at which QoS (1 or 2).
    pub delivery: DeliveryRecord,
    /// Where its acknowledgement stands.
    pub state: InflightState,
}

/// A retained message. Its topic is `message.topic`, the key of the retained set; its
/// publisher is `message.publisher`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetainedRecord {
    /// The retained message (its RETAIN flag set), with the client that published it.
    pub message: MessageRecord,
    /// The user name the publisher had authenticated with, kept with `check_retain_source`
    /// (whose check asks the access rules for the publisher as it was); `None` for none, or
    /// when not kept. Schema 10 (SQLite), 8 (PostgreSQL).
    pub publisher_username: Option<String>,
    /// The port of the listener the publisher had connected to, kept with
    /// `check_retain_source` (a listener's own access rules apply to its clients); `None`
    /// when not kept. Schema 10 (SQLite), 8 (PostgreSQL).
    pub publisher_listener: Option<u16>,
}

impl RetainedRecord {
    /// A retained record holding `message`, without its publisher's user name and listener.
    pub fn new(message: MessageRecord) -> RetainedRecord {
        RetainedRecord {
            message,
            publisher_username: None,
            publisher_listener: None,
        }
    }

    /// The topic the message is retained on.
    pub fn topic(&self) -> &str {
        &self.message.topic
    }

    /// The client that published it, if a client did.
    pub fn publisher(&self) -> Option<&str> {
        self.message.publisher.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(interval: u32, disconnected_at: Option<u64>) -> SessionHeader {
        SessionHeader {
            client_id: "c".into(),
            protocol_level: 5,
            session_expiry_interval: interval,
            disconnected_at,
            username: None,
            certificate: None,
        }
    }

    #[test]
    fn session_expiry() {
        assert_eq!(header(10, None).expires_at(), None);
        assert_eq!(header(NEVER_EXPIRES, Some(5)).expires_at(), None);
        assert_eq!(header(10, Some(1_000)).expires_at(), Some(11_000));
        assert!(header(10, Some(1_000)).is_expired(11_000));
        assert!(!header(10, Some(1_000)).is_expired(10_999));
        assert!(header(0, Some(1_000)).is_expired(1_000));
        let record = SessionRecord::new(header(10, Some(1_000)));
        assert_eq!(record.header(), header(10, Some(1_000)));
        assert_eq!(record.expires_at(), Some(11_000));
    }

    #[test]
    fn share_and_states() {
        let sub = SubscriptionRecord::new("$share/g1/a/b", 1);
        assert_eq!(sub.share(), Some(("g1", "a/b")));
        assert_eq!(SubscriptionRecord::new("a/b", 1).share(), None);
        for state in [
            InflightState::AwaitingPubAck,
            InflightState::AwaitingPubRec,
            InflightState::AwaitingPubComp,
        ] {
            assert_eq!(InflightState::parse(state.as_str()), Some(state));
        }
        assert_eq!(InflightState::parse("x"), None);
        let mut message = MessageRecord::new("t", "p", 0);
        assert!(!message.is_expired(u64::MAX));
        message.expires_at = Some(10);
        assert!(message.is_expired(10));
        message.publisher = Some("pub".into());
        let retained = RetainedRecord::new(message);
        assert_eq!(retained.topic(), "t");
        assert_eq!(retained.publisher(), Some("pub"));
    }
}

/// One entry of a stream's log: a reference to a stored message, at its offset, as
/// [`Change::StreamAppended`](crate::Change::StreamAppended) writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamEntryRecord {
    /// The entry's logical offset in its stream (from 1, strictly increasing per stream).
    /// Below 2^63.
    pub offset: u64,
    /// When it was appended, unix milliseconds.
    pub time_ms: u64,
    /// The [`StoredMessage::id`] of the message.
    pub message_id: u64,
}

/// One entry of a [`Change::StreamSegment`](crate::Change::StreamSegment): the entry and
/// the message only it refers to (stored under `entry.message_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamAppend {
    /// The entry (its offset, append time and the id its message is stored under).
    pub entry: StreamEntryRecord,
    /// Its message.
    pub message: MessageRecord,
}

/// A stream as loaded at start: its counters, not its entries (read with
/// [`Storage::read_stream`](crate::Storage::read_stream)), and where its offsets go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamRecord {
    /// The stream's name.
    pub name: String,
    /// The lowest offset the next appended entry may take: above every offset appended so
    /// far, trimmed ones included (so that offsets are never given twice).
    pub next_offset: u64,
    /// The offset of its oldest entry; `next_offset` when it has none.
    pub first_offset: u64,
    /// The append time of its oldest entry, unix milliseconds; 0 when it has none.
    pub first_time_ms: u64,
    /// Its entries (those whose message is stored).
    pub messages: u64,
    /// The bytes of their messages: topic, payload and properties of each, as the broker
    /// counts a message's size.
    pub bytes: u64,
    /// Its definition, for a stream created while the broker ran (`mercurioctl stream
    /// create`); `None` for one defined elsewhere (the configuration file).
    pub definition: Option<StreamDefinition>,
}

/// One entry of a stream read back ([`Storage::read_stream`](crate::Storage::read_stream)):
/// the entry and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEntryRead {
    /// The entry (its offset, append time and message id).
    pub entry: StreamEntryRecord,
    /// Its message.
    pub message: MessageRecord,
}

/// What a stream created at run time is, stored by
/// [`Change::StreamDefined`](crate::Change::StreamDefined): which messages it takes and its
/// retention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamDefinition {
    /// The MQTT topic filter of the messages appended.
    pub filter: String,
    /// Seconds a message stays; 0 = no limit. Below 2^63.
    pub max_age: u64,
    /// Bytes the stream holds at most; 0 = no limit. Below 2^63.
    pub max_bytes: u64,
    /// Only the newest message of each topic is kept.
    pub last_value: bool,
}
