//! The conversion between the broker's session types and storage's records; times go from
//! `Instant`s to unix milliseconds and back.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use mercurio_storage::{
    InflightRecord, InflightState, MessageRecord, QueuedRecord, SessionHeader, SessionRecord,
    SubscriptionRecord, WillRecord,
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
    let (now, now_ms) = (Instant::now(), unix_ms());
    MessageRecord {
        topic: msg.topic.clone(),
        payload: msg.payload.clone(),
        qos: qos as u8,
        retain,
        properties,
        expires_at: msg.expires_at.map(|at| instant_to_unix(at, now, now_ms)),
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
            encoded: Default::default(),
        },
        ids,
    ))
}

/// The stored form of a queued or in-flight delivery, with its shared subscription.
pub(crate) fn queued_record(q: &Delivery) -> MessageRecord {
    let mut record = message_record(&q.msg, q.qos, q.retain, &q.subscription_ids);
    record.share = q.share.as_deref().map(str::to_string);
    record
}

pub(crate) fn inflight_record(f: &Inflight) -> InflightRecord {
    InflightRecord {
        packet_id: f.packet_id,
        message: queued_record(&f.delivery),
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

/// The whole session as stored (QoS 0 messages are not kept).
pub(crate) fn session_record(client_id: &str, st: &SessionState) -> SessionRecord {
    let mut record = SessionRecord::new(header(client_id, st));
    let mut subs: Vec<_> = st
        .subscriptions()
        .iter()
        .map(|(f, g)| subscription_record(f, g))
        .collect();
    subs.sort_by(|a, b| a.filter.cmp(&b.filter));
    record.subscriptions = subs;
    record.will = st.will().map(will_record);
    record.queued = st
        .queue()
        .iter()
        .filter(|q| q.qos > QoS::AtMostOnce)
        .map(|q| QueuedRecord {
            seq: q.seq,
            message: queued_record(q),
        })
        .collect();
    record.inflight = st.inflight().iter().map(inflight_record).collect();
    record.inbound_qos2 = st.inbound_qos2_ids();
    record
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

/// An in-flight message back from its stored form, to be resent (with DUP) on reconnect.
pub(crate) fn inflight_from(
    record: &InflightRecord,
    now: Instant,
    now_ms: u64,
) -> Result<Inflight, String> {
    let (msg, ids) = message_from(&record.message, now, now_ms)?;
    Ok(Inflight {
        packet_id: record.packet_id,
        state: match record.state {
            InflightState::AwaitingPubAck => OutboundState::AwaitingPubAck,
            InflightState::AwaitingPubRec => OutboundState::AwaitingPubRec,
            InflightState::AwaitingPubComp => OutboundState::AwaitingPubComp,
        },
        delivery: Delivery {
            retain: msg.retain,
            qos: msg.qos,
            msg: Arc::new(msg),
            subscription_ids: ids,
            seq: 0,
            share: record.message.share.as_deref().map(Arc::from),
        },
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
