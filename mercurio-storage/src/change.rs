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

use crate::records::{
    InflightRecord, MessageRecord, RetainedRecord, SessionHeader, SessionRecord,
    SubscriptionRecord, WillRecord,
};

/// One ordered mutation, for one client's session or for the retained set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Create the session with empty collections, or update the header of the stored one,
    /// keeping its subscriptions, will and messages.
    SessionSaved(SessionHeader),
    /// Replace the whole session, collections included, by this record (creating it if
    /// needed). Used to write a "dirty" client again after a change was given up.
    SessionWritten(SessionRecord),
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
    /// Queue a message for the client at position `seq`, replacing a message already queued
    /// at that position.
    MessageQueued {
        /// The client the message waits for.
        client_id: String,
        /// Its position in the queue, see [`QueuedRecord::seq`](crate::QueuedRecord::seq).
        seq: u64,
        /// The message, at its delivery QoS.
        message: MessageRecord,
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
    /// which keeps its place in the in-flight order.
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
}

impl Change {
    /// The client whose session this change touches; `None` for the retained set.
    pub fn client_id(&self) -> Option<&str> {
        match self {
            Change::SessionSaved(header) => Some(&header.client_id),
            Change::SessionWritten(record) => Some(&record.client_id),
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
            Change::RetainedSet(_) | Change::RetainedDeleted { .. } => None,
        }
    }

    /// A short stable name for the kind of change, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Change::SessionSaved(_) => "session_saved",
            Change::SessionWritten(_) => "session_written",
            Change::SessionDeleted { .. } => "session_deleted",
            Change::SubscriptionAdded { .. } => "subscription_added",
            Change::SubscriptionRemoved { .. } => "subscription_removed",
            Change::WillSet { .. } => "will_set",
            Change::WillCleared { .. } => "will_cleared",
            Change::MessageQueued { .. } => "message_queued",
            Change::MessageDequeued { .. } => "message_dequeued",
            Change::InflightSet { .. } => "inflight_set",
            Change::InflightRemoved { .. } => "inflight_removed",
            Change::InboundQos2Added { .. } => "inbound_qos2_added",
            Change::InboundQos2Removed { .. } => "inbound_qos2_removed",
            Change::RetainedSet(_) => "retained_set",
            Change::RetainedDeleted { .. } => "retained_deleted",
        }
    }

    /// Whether this change creates or replaces a session, so that later additions to it
    /// in the same batch are accepted.
    pub fn creates_session(&self) -> bool {
        matches!(self, Change::SessionSaved(_) | Change::SessionWritten(_))
    }
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
    }
}
