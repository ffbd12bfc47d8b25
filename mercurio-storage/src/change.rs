//! [`Change`]: one small mutation of the stored state, as the core emits them.
//!
//! The core sends changes in order per client to a background writer, which passes them to
//! [`Storage::apply`](crate::Storage::apply) in batches. Every backend gives each change the
//! meaning written on its variant; [`MemoryStorage`](crate::MemoryStorage) is the reference.
//!
//! Removals are idempotent: removing what is not stored (or removing from a session that is
//! not stored) does nothing. Additions to a session that is not stored are refused
//! ([`ErrorKind::Refused`](crate::ErrorKind::Refused)): a session is first created by
//! [`Change::SessionSaved`] or [`Change::SessionWritten`].

use std::collections::BTreeSet;

use crate::records::{
    DeliveryRecord, InflightRecord, MessageRecord, RetainedRecord, SessionHeader, SessionRecord,
    StoredMessage, StreamAppend, StreamDefinition, StreamEntryRecord, SubscriptionRecord,
    WillRecord,
};

/// Largest MQTT 5 Subscription Identifier (a variable byte integer).
const MAX_SUBSCRIPTION_IDENTIFIER: u32 = 268_435_455;

/// One ordered mutation, for one client's session or for the retained set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Create the session with empty collections, or update the header of the stored one,
    /// keeping its subscriptions, will and messages.
    SessionSaved(SessionHeader),
    /// Replace the whole session, collections included, by this record (creating it if
    /// needed), after storing each of the messages it refers to that is not stored yet
    /// (as [`Change::MessageStored`] would). Used to write a "dirty" client again after a
    /// change was given up.
    SessionWritten(SessionRecord, Vec<StoredMessage>),
    /// Delete the session and everything it holds. Nothing if it is not stored.
    SessionDeleted {
        /// The client whose session ends.
        client_id: String,
    },
    /// Add a subscription, replacing the one with the same filter if any.
    SubscriptionAdded {
        /// The subscribing client.
        client_id: String,
        /// The subscription.
        subscription: SubscriptionRecord,
    },
    /// Remove the subscription with this filter.
    SubscriptionRemoved {
        /// The unsubscribing client.
        client_id: String,
        /// The topic filter, as in [`SubscriptionRecord::filter`].
        filter: String,
    },
    /// Set the session's will, replacing any previous one.
    WillSet {
        /// The client whose will this is.
        client_id: String,
        /// The will.
        will: WillRecord,
    },
    /// Remove the session's will (published, or the connection ended normally).
    WillCleared {
        /// The client whose will is cleared.
        client_id: String,
    },
    /// Store a message once for all its deliveries, under `id`, unless a message is stored
    /// under `id` already. Sent before the first reference to it
    /// ([`Change::MessageQueued`], [`Change::InflightSet`]). Belongs to no client.
    MessageStored {
        /// The message, as published.
        message: StoredMessage,
    },
    /// The broker holds message `id` no more (and will make no new reference to it): it is
    /// deleted as soon as nothing refers to it, now or when its last reference goes. A
    /// message is deleted only once released, so that the broker can still refer to a
    /// message whose references all went (a shared subscription's message given to another
    /// member). Belongs to no client; nothing if `id` is not stored.
    MessageReleased {
        /// The [`StoredMessage::id`].
        id: u64,
    },
    /// Queue a delivery of a stored message for the client at position `seq`, replacing a
    /// delivery already queued at that position. Refused if the message is not stored.
    MessageQueued {
        /// The client the message waits for.
        client_id: String,
        /// Its position in the queue, see [`QueuedRecord::seq`](crate::QueuedRecord::seq).
        seq: u64,
        /// The delivery: the stored message and its delivery QoS.
        delivery: DeliveryRecord,
    },
    /// Remove the message queued at `seq` (sent, expired or dropped).
    MessageDequeued {
        /// The client whose queue it leaves.
        client_id: String,
        /// Its position in the queue.
        seq: u64,
    },
    /// Record an in-flight message, or update the one with the same packet identifier
    /// (e.g. to [`InflightState::AwaitingPubComp`](crate::InflightState::AwaitingPubComp)),
    /// which keeps its place in the in-flight order. Refused if its message is not stored.
    InflightSet {
        /// The client the message was sent to.
        client_id: String,
        /// The in-flight message.
        inflight: InflightRecord,
    },
    /// Remove the in-flight message with this packet identifier (acknowledged).
    InflightRemoved {
        /// The client that acknowledged it.
        client_id: String,
        /// Its packet identifier.
        packet_id: u16,
    },
    /// Record an inbound QoS 2 packet identifier awaiting PUBREL (PUBREC sent).
    InboundQos2Added {
        /// The publishing client.
        client_id: String,
        /// The packet identifier of its PUBLISH.
        packet_id: u16,
    },
    /// Forget an inbound QoS 2 packet identifier (PUBREL received, PUBCOMP sent).
    InboundQos2Removed {
        /// The publishing client.
        client_id: String,
        /// The packet identifier.
        packet_id: u16,
    },
    /// Retain a message on its topic, replacing the one retained there.
    RetainedSet(RetainedRecord),
    /// Delete the message retained on `topic`, if any.
    RetainedDeleted {
        /// The topic name.
        topic: String,
    },
    /// Store the definition of a stream created at run time (creating the stream, with no
    /// entries, if needed; replacing its definition otherwise).
    StreamDefined {
        /// The stream's name.
        stream: String,
        /// What it takes and keeps.
        definition: StreamDefinition,
    },
    /// Append an entry to a stream's log (creating the stream if needed), replacing an entry
    /// at the same offset. A reference to a stored message, like [`Change::MessageQueued`]:
    /// refused if the message is not stored. Belongs to no client.
    StreamAppended {
        /// The stream's name.
        stream: String,
        /// The entry.
        entry: StreamEntryRecord,
    },
    /// Append entries to a stream's log (creating the stream if needed), in strictly
    /// increasing offset order, each replacing an entry at the same offset. Each entry
    /// brings its own message, stored under the entry's `message_id` (as by
    /// [`Change::MessageStored`]) and released at once (as by [`Change::MessageReleased`]):
    /// the entry is its only reference and nothing else may ever refer to that id, so the
    /// message goes with the entry. What the broker emits for the messages its streams take,
    /// one change per stream and batch. Belongs to no client.
    StreamSegment {
        /// The stream's name.
        stream: String,
        /// The entries, by offset, with their messages.
        entries: Vec<StreamAppend>,
    },
    /// Retention: remove the stream's entries below offset `below` (and remember that the
    /// stream's offsets go on at `below` at least, even when it is left empty). Nothing if
    /// the stream is not stored.
    StreamTrimmed {
        /// The stream's name.
        stream: String,
        /// The first offset kept.
        below: u64,
    },
    /// Remove the stream's entry at `offset` (a `last_value` stream's older value of a
    /// topic). Nothing if there is none.
    StreamEntryRemoved {
        /// The stream's name.
        stream: String,
        /// The entry's offset.
        offset: u64,
    },
    /// Delete the stream and all its entries (no longer configured). Nothing if it is not
    /// stored.
    StreamDeleted {
        /// The stream's name.
        stream: String,
    },
}

impl Change {
    /// The client whose session this change touches; `None` for the retained set.
    pub fn client_id(&self) -> Option<&str> {
        match self {
            Change::SessionSaved(header) => Some(&header.client_id),
            Change::SessionWritten(record, _) => Some(&record.client_id),
            Change::SessionDeleted { client_id }
            | Change::SubscriptionAdded { client_id, .. }
            | Change::SubscriptionRemoved { client_id, .. }
            | Change::WillSet { client_id, .. }
            | Change::WillCleared { client_id }
            | Change::MessageQueued { client_id, .. }
            | Change::MessageDequeued { client_id, .. }
            | Change::InflightSet { client_id, .. }
            | Change::InflightRemoved { client_id, .. }
            | Change::InboundQos2Added { client_id, .. }
            | Change::InboundQos2Removed { client_id, .. } => Some(client_id),
            Change::RetainedSet(_)
            | Change::RetainedDeleted { .. }
            | Change::MessageStored { .. }
            | Change::MessageReleased { .. }
            | Change::StreamDefined { .. }
            | Change::StreamAppended { .. }
            | Change::StreamSegment { .. }
            | Change::StreamTrimmed { .. }
            | Change::StreamEntryRemoved { .. }
            | Change::StreamDeleted { .. } => None,
        }
    }

    /// A short stable name for the kind of change, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Change::SessionSaved(_) => "session_saved",
            Change::SessionWritten(..) => "session_written",
            Change::SessionDeleted { .. } => "session_deleted",
            Change::SubscriptionAdded { .. } => "subscription_added",
            Change::SubscriptionRemoved { .. } => "subscription_removed",
            Change::WillSet { .. } => "will_set",
            Change::WillCleared { .. } => "will_cleared",
            Change::MessageStored { .. } => "message_stored",
            Change::MessageReleased { .. } => "message_released",
            Change::MessageQueued { .. } => "message_queued",
            Change::MessageDequeued { .. } => "message_dequeued",
            Change::InflightSet { .. } => "inflight_set",
            Change::InflightRemoved { .. } => "inflight_removed",
            Change::InboundQos2Added { .. } => "inbound_qos2_added",
            Change::InboundQos2Removed { .. } => "inbound_qos2_removed",
            Change::RetainedSet(_) => "retained_set",
            Change::RetainedDeleted { .. } => "retained_deleted",
            Change::StreamDefined { .. } => "stream_defined",
            Change::StreamAppended { .. } => "stream_appended",
            Change::StreamSegment { .. } => "stream_segment",
            Change::StreamTrimmed { .. } => "stream_trimmed",
            Change::StreamEntryRemoved { .. } => "stream_entry_removed",
            Change::StreamDeleted { .. } => "stream_deleted",
        }
    }

    /// Bytes this change holds, as the core counts them for its back pressure: the topic,
    /// payload and properties of each message in it, plus its strings (client identifier,
    /// filters, user name, shared subscription) and subscription identifiers (4 bytes each).
    /// A reference to a stored message counts its own fields, not the message. Fixed-size
    /// fields are not counted: a change without a message is a few bytes, which the core's
    /// own per-change overhead covers.
    pub fn size(&self) -> usize {
        fn message(m: &MessageRecord) -> usize {
            m.topic.len() + m.payload.len() + m.properties.len()
        }
        fn delivery(d: &DeliveryRecord) -> usize {
            d.share.as_ref().map_or(0, String::len) + 4 * d.subscription_ids.len()
        }
        fn id(client_id: &str) -> usize {
            client_id.len()
        }
        match self {
            Change::SessionSaved(h) => {
                id(&h.client_id) + h.username.as_ref().map_or(0, String::len)
            }
            Change::SessionWritten(r, messages) => {
                id(&r.client_id)
                    + r.username.as_ref().map_or(0, String::len)
                    + r.subscriptions
                        .iter()
                        .map(|s| s.filter.len())
                        .sum::<usize>()
                    + r.will.as_ref().map_or(0, |w| message(&w.message))
                    + r.queued
                        .iter()
                        .map(|q| delivery(&q.delivery))
                        .sum::<usize>()
                    + r.inflight
                        .iter()
                        .map(|f| delivery(&f.delivery))
                        .sum::<usize>()
                    + messages.iter().map(|m| message(&m.message)).sum::<usize>()
            }
            Change::SubscriptionAdded {
                client_id,
                subscription,
            } => id(client_id) + subscription.filter.len(),
            Change::SubscriptionRemoved { client_id, filter } => id(client_id) + filter.len(),
            Change::WillSet { client_id, will } => id(client_id) + message(&will.message),
            Change::MessageStored { message: m } => message(&m.message),
            Change::MessageReleased { .. } => 0,
            Change::MessageQueued {
                client_id,
                delivery: d,
                ..
            } => id(client_id) + delivery(d),
            Change::InflightSet {
                client_id,
                inflight,
            } => id(client_id) + delivery(&inflight.delivery),
            Change::SessionDeleted { client_id }
            | Change::WillCleared { client_id }
            | Change::MessageDequeued { client_id, .. }
            | Change::InflightRemoved { client_id, .. }
            | Change::InboundQos2Added { client_id, .. }
            | Change::InboundQos2Removed { client_id, .. } => id(client_id),
            Change::RetainedSet(r) => message(&r.message),
            Change::RetainedDeleted { topic } => topic.len(),
            Change::StreamDefined { stream, definition } => stream.len() + definition.filter.len(),
            Change::StreamSegment { stream, entries } => {
                stream.len()
                    + entries
                        .iter()
                        .map(|a| std::mem::size_of::<StreamAppend>() + message(&a.message))
                        .sum::<usize>()
            }
            Change::StreamAppended { stream, .. }
            | Change::StreamTrimmed { stream, .. }
            | Change::StreamEntryRemoved { stream, .. }
            | Change::StreamDeleted { stream } => stream.len(),
        }
    }

    /// Whether this change creates or replaces a session, so that later additions to it
    /// in the same batch are accepted.
    pub fn creates_session(&self) -> bool {
        matches!(self, Change::SessionSaved(_) | Change::SessionWritten(..))
    }
}

/// The checks a database's constraints would make on the values of one change.
pub(crate) fn validate_values(change: &Change) -> Result<(), String> {
    match change {
        Change::SessionSaved(header) => validate_header(header),
        Change::SessionWritten(record, messages) => {
            for m in messages {
                validate_stored(m)?;
            }
            validate_record(record)
        }
        Change::MessageStored { message } => validate_stored(message),
        Change::SubscriptionAdded { subscription, .. } => validate_subscription(subscription),
        Change::WillSet { will, .. } => validate_message(&will.message),
        Change::MessageQueued { delivery, .. } => validate_delivery(delivery),
        Change::InflightSet { inflight, .. } => validate_delivery(&inflight.delivery),
        Change::RetainedSet(record) => validate_message(&record.message),
        Change::SessionDeleted { .. }
        | Change::SubscriptionRemoved { .. }
        | Change::WillCleared { .. }
        | Change::MessageDequeued { .. }
        | Change::InflightRemoved { .. }
        | Change::InboundQos2Added { .. }
        | Change::InboundQos2Removed { .. }
        | Change::RetainedDeleted { .. }
        | Change::MessageReleased { .. }
        | Change::StreamDeleted { .. } => Ok(()),
        Change::StreamDefined { definition, .. } => {
            if definition.max_age > MAX_ID || definition.max_bytes > MAX_ID {
                return Err("a stream bound is over 2^63 - 1".to_string());
            }
            Ok(())
        }
        Change::StreamAppended { entry, .. } => validate_entry(entry),
        Change::StreamSegment { entries, .. } => {
            let mut last = None;
            for a in entries {
                validate_entry(&a.entry)?;
                validate_message(&a.message)?;
                if last.is_some_and(|l| l >= a.entry.offset) {
                    return Err(format!(
                        "stream entry {} follows entry {} (offsets must increase)",
                        a.entry.offset,
                        last.unwrap_or(0)
                    ));
                }
                last = Some(a.entry.offset);
            }
            Ok(())
        }
        Change::StreamTrimmed { below: offset, .. } | Change::StreamEntryRemoved { offset, .. } => {
            if *offset > MAX_ID {
                return Err(format!("stream offset {offset} is over 2^63 - 1"));
            }
            Ok(())
        }
    }
}

fn validate_entry(entry: &StreamEntryRecord) -> Result<(), String> {
    if entry.message_id > MAX_ID || entry.offset > MAX_ID || entry.time_ms > MAX_ID {
        return Err(format!(
            "stream entry {} (message {}) is over 2^63 - 1",
            entry.offset, entry.message_id
        ));
    }
    Ok(())
}

fn validate_header(header: &SessionHeader) -> Result<(), String> {
    if !(3..=5).contains(&header.protocol_level) {
        return Err(format!(
            "protocol level {} is not 3, 4 or 5",
            header.protocol_level
        ));
    }
    Ok(())
}

fn validate_record(record: &SessionRecord) -> Result<(), String> {
    validate_header(&record.header())?;
    let mut filters = BTreeSet::new();
    for subscription in &record.subscriptions {
        validate_subscription(subscription)?;
        if !filters.insert(subscription.filter.as_str()) {
            return Err(format!("filter {:?} appears twice", subscription.filter));
        }
    }
    if let Some(will) = &record.will {
        validate_message(&will.message)?;
    }
    let mut seqs = BTreeSet::new();
    for queued in &record.queued {
        validate_delivery(&queued.delivery)?;
        if !seqs.insert(queued.seq) {
            return Err(format!("queued seq {} appears twice", queued.seq));
        }
    }
    let mut packet_ids = BTreeSet::new();
    for inflight in &record.inflight {
        validate_delivery(&inflight.delivery)?;
        if !packet_ids.insert(inflight.packet_id) {
            return Err(format!(
                "in-flight packet id {} appears twice",
                inflight.packet_id
            ));
        }
    }
    let inbound: BTreeSet<u16> = record.inbound_qos2.iter().copied().collect();
    if inbound.len() != record.inbound_qos2.len() {
        return Err("an inbound QoS 2 packet id appears twice".to_string());
    }
    Ok(())
}

fn validate_subscription(subscription: &SubscriptionRecord) -> Result<(), String> {
    if subscription.qos > 2 {
        return Err(format!("subscription QoS {} is over 2", subscription.qos));
    }
    if subscription.retain_handling > 2 {
        return Err(format!(
            "retain handling {} is over 2",
            subscription.retain_handling
        ));
    }
    if let Some(identifier) = subscription.subscription_identifier {
        if identifier == 0 || identifier > MAX_SUBSCRIPTION_IDENTIFIER {
            return Err(format!(
                "subscription identifier {identifier} is out of range"
            ));
        }
    }
    Ok(())
}

/// Largest message id and queue position: SQL backends store them as signed 64-bit integers.
const MAX_ID: u64 = i64::MAX as u64;

fn validate_stored(stored: &StoredMessage) -> Result<(), String> {
    if stored.id > MAX_ID {
        return Err(format!("message id {} is over 2^63 - 1", stored.id));
    }
    validate_message(&stored.message)
}

fn validate_delivery(delivery: &DeliveryRecord) -> Result<(), String> {
    if delivery.qos > 2 {
        return Err(format!("message QoS {} is over 2", delivery.qos));
    }
    if delivery.message_id > MAX_ID {
        return Err(format!(
            "message id {} is over 2^63 - 1",
            delivery.message_id
        ));
    }
    for &identifier in &delivery.subscription_ids {
        if identifier == 0 || identifier > MAX_SUBSCRIPTION_IDENTIFIER {
            return Err(format!(
                "subscription identifier {identifier} is out of range"
            ));
        }
    }
    Ok(())
}

fn validate_message(message: &MessageRecord) -> Result<(), String> {
    if message.qos > 2 {
        return Err(format!("message QoS {} is over 2", message.qos));
    }
    Ok(())
}

/// The value checks of every change of `batch`, before a backend applies any of it: the
/// first change refused, as [`ErrorKind::Refused`](crate::ErrorKind::Refused).
pub(crate) fn validate_batch(batch: &[Change]) -> Result<(), crate::StorageError> {
    for (index, change) in batch.iter().enumerate() {
        validate_values(change).map_err(|reason| refused(index, change, &reason))?;
    }
    Ok(())
}

/// Change `index` of a batch, refused for `reason`: names the change and its client.
pub(crate) fn refused(index: usize, change: &Change, reason: &str) -> crate::StorageError {
    let target = match change {
        Change::MessageStored { .. } | Change::MessageReleased { .. } => "the message store",
        Change::StreamDefined { .. }
        | Change::StreamAppended { .. }
        | Change::StreamSegment { .. }
        | Change::StreamTrimmed { .. }
        | Change::StreamEntryRemoved { .. }
        | Change::StreamDeleted { .. } => "the streams",
        _ => change.client_id().unwrap_or("the retained set"),
    };
    crate::StorageError::refused(format!(
        "change {index} ({}) for {target} refused: {reason}",
        change.kind()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::MessageRecord;

    #[test]
    fn client_id_accessor() {
        let change = Change::MessageDequeued {
            client_id: "a".into(),
            seq: 1,
        };
        assert_eq!(change.client_id(), Some("a"));
        assert_eq!(change.kind(), "message_dequeued");
        assert!(!change.creates_session());
        let retained = Change::RetainedSet(RetainedRecord::new(MessageRecord::new("t", "p", 0)));
        assert_eq!(retained.client_id(), None);
        let deleted = Change::RetainedDeleted { topic: "t".into() };
        assert_eq!(deleted.client_id(), None);
        assert_eq!(retained.size(), 2);
        assert_eq!(deleted.size(), 1);
        let stored = Change::MessageStored {
            message: StoredMessage {
                id: 7,
                message: MessageRecord::new("topic", vec![0u8; 100], 1),
            },
        };
        assert_eq!(stored.client_id(), None);
        assert_eq!(stored.size(), 5 + 100);
        // A reference counts its own fields, not the message it refers to.
        let mut delivery = DeliveryRecord::new(7, 1);
        delivery.share = Some("$share/g/t".into());
        delivery.subscription_ids = vec![1, 2];
        let queued = Change::MessageQueued {
            client_id: "ab".into(),
            seq: 1,
            delivery,
        };
        assert_eq!(queued.size(), 2 + 10 + 8);
    }
}
