//! Reading stored rows back into records, shared by the SQL backends. Each backend runs its
//! own queries (its table names, its driver) and hands every row over as [`Columns`]; the
//! checks of the values read and the assembly of a session from its rows are done here once.
//!
//! A value that cannot be read (a wrong type, a QoS of 7, a negative sequence number) is an
//! error in words; the session it belongs to is then set aside by the caller, and a retained
//! message is skipped.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

use crate::{LoadedState, SetAside};

use crate::records::{
    DeliveryRecord, InflightRecord, InflightState, MessageRecord, QueuedRecord, RetainedRecord,
    SessionRecord, StoredMessage, SubscriptionRecord, WillRecord,
};
#[cfg(feature = "postgres")]
use crate::records::{StreamEntryRead, StreamEntryRecord};

/// The columns of a retained message, in this order: the message (its first eight, read by
/// [`message_at`]), then its publisher's user name and listener port.
pub(crate) const RETAINED_COLUMNS: &str = "topic, payload, qos, retain, properties, expires_at, \
     publisher, share, publisher_username, publisher_listener";
/// The columns of a stored message (the message store's table), in this order.
pub(crate) const STORED_COLUMNS: &str =
    "id, topic, payload, qos, retain, properties, expires_at, publisher";
/// The columns of a delivery (a reference to a stored message) in the queued and in-flight
/// tables, in this order.
pub(crate) const DELIVERY_COLUMNS: &str = "message_id, qos, retain, subscription_ids, share";

/// Subscription identifiers as stored: 4 bytes each, big-endian.
pub(crate) fn encode_ids(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_be_bytes()).collect()
}

fn decode_ids(bytes: &[u8]) -> Result<Vec<u32>, String> {
    if !bytes.len().is_multiple_of(4) {
        return Err(format!(
            "subscription_ids: {} bytes is not a multiple of 4",
            bytes.len()
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}
/// What [`subscription`] reads, after the client id.
pub(crate) const SUBSCRIPTION_COLUMNS: &str =
    "filter, qos, no_local, retain_as_published, retain_handling, subscription_identifier";
/// What [`Sessions::read`] reads, from the client id on.
pub(crate) const SESSION_COLUMNS: &str =
    "client_id, protocol_level, session_expiry_interval, disconnected_at, will_topic, \
     will_payload, will_qos, will_retain, will_properties, will_expires_at, will_publisher, \
     will_delay_interval, username, certificate";

/// One row of a query, read by column index; a failure is described in words (the column's
/// name and the driver's reason).
pub(crate) trait Columns {
    fn int(&self, i: usize) -> Result<i64, String>;
    fn opt_int(&self, i: usize) -> Result<Option<i64>, String>;
    fn text(&self, i: usize) -> Result<String, String>;
    fn opt_text(&self, i: usize) -> Result<Option<String>, String>;
    fn bytes(&self, i: usize) -> Result<Vec<u8>, String>;
    fn boolean(&self, i: usize) -> Result<bool, String>;
}

/// Implements [`Columns`] for a driver's row type with its `col(row, index)` function, generic
/// over the driver's "from SQL" trait.
macro_rules! columns_through {
    ($row:ty, $col:path) => {
        impl $crate::rows::Columns for $row {
            fn int(&self, i: usize) -> Result<i64, String> {
                $col(self, i)
            }
            fn opt_int(&self, i: usize) -> Result<Option<i64>, String> {
                $col(self, i)
            }
            fn text(&self, i: usize) -> Result<String, String> {
                $col(self, i)
            }
            fn opt_text(&self, i: usize) -> Result<Option<String>, String> {
                $col(self, i)
            }
            fn bytes(&self, i: usize) -> Result<Vec<u8>, String> {
                $col(self, i)
            }
            fn boolean(&self, i: usize) -> Result<bool, String> {
                $col(self, i)
            }
        }
    };
}
pub(crate) use columns_through;

fn qos(v: i64, what: &str) -> Result<u8, String> {
    match v {
        0..=2 => Ok(v as u8),
        _ => Err(format!("{what} QoS {v} is not 0, 1 or 2")),
    }
}

fn small<T: TryFrom<i64>>(v: i64, what: &str) -> Result<T, String> {
    T::try_from(v).map_err(|_| format!("{what} {v} is out of range"))
}

fn unsigned(v: i64, what: &str) -> Result<u64, String> {
    u64::try_from(v).map_err(|_| format!("{what}: negative value {v}"))
}

/// A message from the first eight [`RETAINED_COLUMNS`] starting at column `at` (`share`
/// included).
pub(crate) fn message_at(row: &impl Columns, at: usize) -> Result<MessageRecord, String> {
    let mut message = will_message_at(row, at)?;
    message.share = row.opt_text(at + 7)?;
    Ok(message)
}

/// A will's or a stored message: the first seven [`RETAINED_COLUMNS`] (no `share`),
/// starting at column `at`.
pub(crate) fn will_message_at(row: &impl Columns, at: usize) -> Result<MessageRecord, String> {
    Ok(MessageRecord {
        topic: row.text(at)?,
        payload: Bytes::from(row.bytes(at + 1)?),
        qos: qos(row.int(at + 2)?, "message")?,
        retain: row.boolean(at + 3)?,
        properties: Bytes::from(row.bytes(at + 4)?),
        expires_at: row
            .opt_int(at + 5)?
            .map(|v| unsigned(v, "expires_at"))
            .transpose()?,
        publisher: row.opt_text(at + 6)?,
        share: None,
    })
}

/// A subscription: client id, then the [`SUBSCRIPTION_COLUMNS`].
pub(crate) fn subscription(row: &impl Columns) -> Result<SubscriptionRecord, String> {
    Ok(SubscriptionRecord {
        filter: row.text(1)?,
        qos: qos(row.int(2)?, "subscription")?,
        no_local: row.boolean(3)?,
        retain_as_published: row.boolean(4)?,
        retain_handling: small(row.int(5)?, "retain handling")?,
        subscription_identifier: row
            .opt_int(6)?
            .map(|v| small(v, "subscription identifier"))
            .transpose()?,
    })
}

/// A delivery from the [`DELIVERY_COLUMNS`] starting at column `at`.
fn delivery_at(row: &impl Columns, at: usize) -> Result<DeliveryRecord, String> {
    Ok(DeliveryRecord {
        message_id: unsigned(row.int(at)?, "message_id")?,
        qos: qos(row.int(at + 1)?, "delivery")?,
        retain: row.boolean(at + 2)?,
        subscription_ids: decode_ids(&row.bytes(at + 3)?)?,
        share: row.opt_text(at + 4)?,
    })
}

/// A stored message: the [`STORED_COLUMNS`]; an error names the id when it can be read.
pub(crate) fn stored(row: &impl Columns) -> Result<StoredMessage, (Option<u64>, String)> {
    let id = row
        .int(0)
        .and_then(|v| unsigned(v, "id"))
        .map_err(|e| (None, e))?;
    Ok(StoredMessage {
        id,
        message: will_message_at(row, 1).map_err(|e| (Some(id), e))?,
    })
}

/// The columns of a stream entry read back with its message ([`stream_entry`]): `e` is the
/// entries' table, `m` the message store's.
#[cfg(feature = "postgres")]
pub(crate) const STREAM_ENTRY_COLUMNS: &str = "e.entry_offset, e.time_ms, e.message_id, \
     m.topic, m.payload, m.qos, m.retain, m.properties, m.expires_at, m.publisher";

/// A stream entry with its message: the [`STREAM_ENTRY_COLUMNS`].
#[cfg(feature = "postgres")]
pub(crate) fn stream_entry(row: &impl Columns) -> Result<StreamEntryRead, String> {
    Ok(StreamEntryRead {
        entry: StreamEntryRecord {
            offset: unsigned(row.int(0)?, "entry_offset")?,
            time_ms: unsigned(row.int(1)?, "time_ms")?,
            message_id: unsigned(row.int(2)?, "message_id")?,
        },
        message: will_message_at(row, 3)?,
    })
}

/// A queued message: client id, seq, then the [`DELIVERY_COLUMNS`] (PostgreSQL's rows;
/// SQLite stores queues in chunks).
#[cfg(feature = "postgres")]
pub(crate) fn queued(row: &impl Columns) -> Result<QueuedRecord, String> {
    Ok(QueuedRecord {
        seq: unsigned(row.int(1)?, "seq")?,
        delivery: delivery_at(row, 2)?,
    })
}

/// An in-flight message: client id, packet id, state, then the [`DELIVERY_COLUMNS`].
pub(crate) fn inflight(row: &impl Columns) -> Result<InflightRecord, String> {
    let state = row.text(2)?;
    Ok(InflightRecord {
        packet_id: small(row.int(1)?, "packet identifier")?,
        state: InflightState::parse(&state)
            .ok_or_else(|| format!("unknown in-flight state {state:?}"))?,
        delivery: delivery_at(row, 3)?,
    })
}

/// An inbound QoS 2 packet identifier: client id, packet id.
pub(crate) fn inbound(row: &impl Columns) -> Result<u16, String> {
    small(row.int(1)?, "packet identifier")
}

/// A retained message: the [`RETAINED_COLUMNS`]; skipped when it cannot be read (it belongs
/// to no session).
pub(crate) fn retained(row: &impl Columns, into: &mut BTreeMap<String, RetainedRecord>) {
    let read = || -> Result<RetainedRecord, String> {
        Ok(RetainedRecord {
            message: message_at(row, 0)?,
            publisher_username: row.opt_text(8)?,
            publisher_listener: row
                .opt_int(9)?
                .map(|v| small(v, "publisher_listener"))
                .transpose()?,
        })
    };
    if let Ok(r) = read() {
        into.insert(r.message.topic.clone(), r);
    }
}

/// The stored messages of `rows` (read with [`stored`]) into `state.messages`, sorted by id;
/// then each session referring to a message that cannot be read, or is not stored, is set
/// aside (its rows stay as they are).
pub(crate) fn attach_messages(
    state: &mut LoadedState,
    rows: impl IntoIterator<Item = Result<StoredMessage, (Option<u64>, String)>>,
) {
    let mut unreadable: HashMap<u64, String> = HashMap::new();
    let mut messages = BTreeMap::new();
    for row in rows {
        match row {
            Ok(m) => {
                messages.insert(m.id, m);
            }
            Err((Some(id), cause)) => {
                unreadable.insert(id, cause);
            }
            Err((None, _)) => {}
        }
    }
    let sessions = std::mem::take(&mut state.sessions);
    for session in sessions {
        let missing = session
            .queued
            .iter()
            .map(|q| q.delivery.message_id)
            .chain(session.inflight.iter().map(|f| f.delivery.message_id))
            .find(|id| !messages.contains_key(id));
        match missing {
            None => state.sessions.push(session),
            Some(id) => state.set_aside.push(SetAside {
                client_id: session.client_id,
                cause: match unreadable.get(&id) {
                    Some(cause) => format!("message {id}: {cause}"),
                    None => format!("message {id} is not stored"),
                },
            }),
        }
    }
    state
        .set_aside
        .sort_by(|a, b| a.client_id.cmp(&b.client_id));
    state.messages = messages.into_values().collect();
}

/// Rows of one kind, per client; a client whose row cannot be read holds the error.
pub(crate) type PerClient<T> = HashMap<String, Result<Vec<T>, String>>;

/// Adds one row (whose first column is the client id) to `out`; a row without a readable
/// client id is skipped.
pub(crate) fn push_per_client<R: Columns, T>(
    out: &mut PerClient<T>,
    row: &R,
    read: impl Fn(&R) -> Result<T, String>,
) {
    let Ok(client_id) = row.text(0) else {
        return;
    };
    let item = read(row);
    let entry = out.entry(client_id).or_insert_with(|| Ok(Vec::new()));
    match (entry.as_mut(), item) {
        (Ok(list), Ok(item)) => list.push(item),
        (Ok(_), Err(e)) => *entry = Err(e),
        (Err(_), _) => {}
    }
}

/// The rows of every session's collections, read first; [`Sessions::read`] then assembles
/// each session row with its own.
#[derive(Default)]
pub(crate) struct Sessions {
    pub subscriptions: PerClient<SubscriptionRecord>,
    pub queued: PerClient<QueuedRecord>,
    pub inflight: PerClient<InflightRecord>,
    pub inbound: PerClient<u16>,
}

impl Sessions {
    /// The session of one row of the [`SESSION_COLUMNS`], with its collections; `Err` is why
    /// it cannot be restored.
    pub(crate) fn read(
        &mut self,
        client_id: &str,
        row: &impl Columns,
    ) -> Result<SessionRecord, String> {
        let level: u8 = small(row.int(1)?, "protocol level")?;
        if !(3..=5).contains(&level) {
            return Err(format!("protocol level {level} is not 3, 4 or 5"));
        }
        let will = match row.opt_text(4)? {
            None => None,
            Some(_) => Some(WillRecord {
                message: will_message_at(row, 4)?,
                delay_interval: small(row.opt_int(11)?.unwrap_or(0), "will delay interval")?,
            }),
        };
        Ok(SessionRecord {
            client_id: client_id.to_string(),
            protocol_level: level,
            session_expiry_interval: small(row.int(2)?, "session expiry interval")?,
            disconnected_at: row
                .opt_int(3)?
                .map(|v| unsigned(v, "disconnected_at"))
                .transpose()?,
            username: row.opt_text(12)?,
            certificate: row.opt_text(13)?,
            subscriptions: self
                .subscriptions
                .remove(client_id)
                .unwrap_or(Ok(Vec::new()))?,
            will,
            queued: self.queued.remove(client_id).unwrap_or(Ok(Vec::new()))?,
            inflight: self.inflight.remove(client_id).unwrap_or(Ok(Vec::new()))?,
            inbound_qos2: self.inbound.remove(client_id).unwrap_or(Ok(Vec::new()))?,
        })
    }
}
