//! The conversion between the broker's session types and storage's records; times go from
//! `Instant`s to unix milliseconds and back.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use std::collections::HashMap;

use mercurio_storage::{
    DeliveryRecord, InflightRecord, InflightState, MessageRecord, QueuedRecord, SessionHeader,
    SessionRecord, StoredMessage, SubscriptionRecord, WillRecord,
};

use crate::codec::{self, Properties, ProtocolVersion, QoS, SubscriptionOptions};
use crate::message::Message;
use crate::session::{Delivery, Granted, Inflight, OutboundState, SessionState, Will};

/// Now in unix milliseconds.
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn instant_to_unix(at: Instant, now: Instant, now_ms: u64) -> u64 {
    if at >= now {
        now_ms.saturating_add(at.duration_since(now).as_millis() as u64)
    } else {
        now_ms.saturating_sub(now.duration_since(at).as_millis() as u64)
    }
}

pub(crate) fn unix_to_instant(ms: u64, now: Instant, now_ms: u64) -> Instant {
    if ms >= now_ms {
        now + Duration::from_millis(ms - now_ms)
    } else {
        now.checked_sub(Duration::from_millis(now_ms - ms))
            .unwrap_or(now)
    }
}

/// The stored form of `msg` delivered at `qos` with `retain`; subscription identifiers ride
/// in the stored properties.
pub(crate) fn message_record(msg: &Message, qos: QoS, retain: bool, ids: &[u32]) -> MessageRecord {
    let properties = if msg.properties.is_empty() && ids.is_empty() {
        Bytes::new()
    } else {
        let mut props = msg.properties.clone();
        props.subscription_identifiers = ids.to_vec();
        props.topic_alias = None;
        let mut out = BytesMut::new();
        if let Err(e) = codec::encode_properties(&props, &mut out) {
            tracing::warn!(topic = %msg.topic, "message properties not stored: {e}");
        }
        out.freeze()
    };
    MessageRecord {
        topic: msg.topic.clone(),
        payload: msg.payload.clone(),
        qos: qos as u8,
        retain,
        properties,
        // The clock is read only for a message that expires (most do not).
        expires_at: msg
            .expires_at
            .map(|at| instant_to_unix(at, Instant::now(), unix_ms())),
        publisher: msg.publisher.as_deref().map(str::to_string),
        share: None,
    }
}

/// A message back from its stored form, with the subscription identifiers stored with it.
pub(crate) fn message_from(
    record: &MessageRecord,
    now: Instant,
    now_ms: u64,
) -> Result<(Message, Vec<u32>), String> {
    let mut properties = if record.properties.is_empty() {
        Properties::default()
    } else {
        codec::decode_properties(&record.properties).map_err(|e| format!("properties: {e}"))?
    };
    let ids = std::mem::take(&mut properties.subscription_identifiers);
    let qos = QoS::from_u8(record.qos).ok_or_else(|| format!("QoS {}", record.qos))?;
    Ok((
        Message {
            topic: record.topic.clone(),
            payload: record.payload.clone(),
            qos,
            retain: record.retain,
            properties,
            expires_at: record.expires_at.map(|ms| unix_to_instant(ms, now, now_ms)),
            publisher: record.publisher.as_deref().map(Arc::from),
            source: None,
            encoded: Default::default(),
            stored: Default::default(),
        },
        ids,
    ))
}

/// The stored form of a queued or in-flight delivery of the stored message `id`.
pub(crate) fn delivery_record(id: u64, q: &Delivery) -> DeliveryRecord {
    DeliveryRecord {
        message_id: id,
        qos: q.qos as u8,
        retain: q.retain,
        subscription_ids: q.subscription_ids.clone(),
        share: q.share.as_deref().map(str::to_string),
    }
}

/// The stored form of an in-flight delivery of the stored message `id`.
pub(crate) fn inflight_record(id: u64, f: &Inflight) -> InflightRecord {
    InflightRecord {
        packet_id: f.packet_id,
        delivery: delivery_record(id, &f.delivery),
        state: match f.state {
            OutboundState::AwaitingPubAck => InflightState::AwaitingPubAck,
            OutboundState::AwaitingPubRec => InflightState::AwaitingPubRec,
            OutboundState::AwaitingPubComp => InflightState::AwaitingPubComp,
        },
    }
}

pub(crate) fn subscription_record(filter: &str, granted: &Granted) -> SubscriptionRecord {
    let o = &granted.options;
    SubscriptionRecord {
        filter: filter.to_string(),
        qos: o.qos as u8,
        no_local: o.no_local,
        retain_as_published: o.retain_as_published,
        retain_handling: o.retain_handling,
        subscription_identifier: granted.identifier,
    }
}

/// A will's Message Expiry Interval counts from its publication, so it is stored as the
/// property itself rather than as a deadline.
pub(crate) fn will_record(will: &Will) -> WillRecord {
    let mut msg = (*will.msg).clone();
    msg.properties.message_expiry_interval = will.expiry;
    WillRecord {
        message: message_record(&msg, msg.qos, msg.retain, &[]),
        delay_interval: will.delay,
    }
}

pub(crate) fn header(client_id: &str, st: &SessionState) -> SessionHeader {
    SessionHeader {
        client_id: client_id.to_string(),
        protocol_level: st.protocol().level(),
        session_expiry_interval: st.expiry_interval(),
        disconnected_at: st
            .disconnected_at()
            .map(|at| instant_to_unix(at, Instant::now(), unix_ms())),
        username: st.username().map(|u| u.to_string()),
        certificate: st.certificate().map(|c| c.to_string()),
    }
}

pub(crate) fn protocol_from_level(level: u8) -> ProtocolVersion {
    match level {
        3 => ProtocolVersion::V31,
        4 => ProtocolVersion::V311,
        _ => ProtocolVersion::V5,
    }
}

/// A will back from its stored form (its expiry interval taken out of the properties).
pub(crate) fn will_from(record: &WillRecord, now: Instant, now_ms: u64) -> Result<Will, String> {
    let (mut msg, _) = message_from(&record.message, now, now_ms)?;
    let expiry = msg.properties.message_expiry_interval.take();
    Ok(Will {
        msg: Arc::new(msg),
        delay: record.delay_interval,
        expiry,
    })
}

/// The stored messages back, each once, by id: shared by every delivery that refers to it.
/// A message migrated from schema 3 has its delivery's subscription identifiers in its
/// properties: they come with it. One that cannot be read holds why.
pub(crate) type Restored = HashMap<u64, Result<(Arc<Message>, Vec<u32>), String>>;

/// A delivery back from its stored form, sharing the restored message it refers to.
pub(crate) fn delivery_from(
    messages: &Restored,
    d: &DeliveryRecord,
    seq: u64,
) -> Result<Delivery, String> {
    let (msg, ids) = match messages.get(&d.message_id) {
        Some(Ok(m)) => m,
        Some(Err(e)) => return Err(format!("message {}: {e}", d.message_id)),
        None => return Err(format!("message {} is not stored", d.message_id)),
    };
    Ok(Delivery {
        msg: Arc::clone(msg),
        qos: QoS::from_u8(d.qos).ok_or_else(|| format!("delivery QoS {}", d.qos))?,
        retain: d.retain,
        subscription_ids: if d.subscription_ids.is_empty() {
            ids.clone()
        } else {
            d.subscription_ids.clone()
        },
        seq,
        share: d.share.as_deref().map(Arc::from),
    })
}

/// An in-flight message back from its stored form, to be resent (with DUP) on reconnect.
pub(crate) fn inflight_from(
    messages: &Restored,
    record: &InflightRecord,
) -> Result<Inflight, String> {
    Ok(Inflight {
        packet_id: record.packet_id,
        state: match record.state {
            InflightState::AwaitingPubAck => OutboundState::AwaitingPubAck,
            InflightState::AwaitingPubRec => OutboundState::AwaitingPubRec,
            InflightState::AwaitingPubComp => OutboundState::AwaitingPubComp,
        },
        delivery: delivery_from(messages, &record.delivery, 0)?,
        sent: false,
    })
}

/// A subscription back from its stored form.
pub(crate) fn granted_from(record: &SubscriptionRecord) -> Result<Granted, String> {
    Ok(Granted {
        options: SubscriptionOptions {
            qos: QoS::from_u8(record.qos).ok_or("subscription QoS")?,
            no_local: record.no_local,
            retain_as_published: record.retain_as_published,
            retain_handling: record.retain_handling,
        },
        identifier: record.subscription_identifier,
    })
}

/// The whole session as stored (QoS 0 messages are not kept), with the messages it refers
/// to, each once, sorted by id: its queue is `backlog` (a part read back from storage) then
/// the deliveries in memory. `id_of` gives each message its id (the message store's, or one
/// of the record's own for a session handed to another node).
pub(crate) fn session_record(
    client_id: &str,
    st: &SessionState,
    backlog: Vec<QueuedRecord>,
    mut id_of: impl FnMut(&Message) -> u64,
) -> (SessionRecord, Vec<StoredMessage>) {
    let mut record = SessionRecord::new(header(client_id, st));
    let mut subs: Vec<_> = st
        .subscriptions()
        .iter()
        .map(|(f, g)| subscription_record(f, g))
        .collect();
    subs.sort_by(|a, b| a.filter.cmp(&b.filter));
    record.subscriptions = subs;
    record.will = st.will().map(will_record);
    let mut messages: HashMap<u64, StoredMessage> = HashMap::new();
    let mut stored = |msg: &Message| {
        let id = id_of(msg);
        messages.entry(id).or_insert_with(|| StoredMessage {
            id,
            message: message_record(msg, msg.qos, msg.retain, &[]),
        });
        id
    };
    record.queued = backlog;
    record.queued.extend(
        st.queue()
            .iter()
            .filter(|q| q.qos > QoS::AtMostOnce)
            .map(|q| QueuedRecord {
                seq: q.seq,
                delivery: delivery_record(stored(&q.msg), q),
            }),
    );
    record.inflight = st
        .inflight()
        .iter()
        .map(|f| inflight_record(stored(&f.delivery.msg), f))
        .collect();
    record.inbound_qos2 = st.inbound_qos2_ids();
    let mut messages: Vec<StoredMessage> = messages.into_values().collect();
    messages.sort_by_key(|m| m.id);
    (record, messages)
}
