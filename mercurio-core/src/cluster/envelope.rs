//! A routed message as it crosses NATS between nodes: the NATS message's payload
//! (docs/cluster.md, "What NATS carries").
//!
//! ```text
//! byte 0      version, 1
//! byte 1      flags: bits 0-1 QoS, bit 2 RETAIN as published, bit 3 the topic follows
//! bytes 2-9   origin: the publishing node's incarnation (random at each start), big endian
//! bytes 10-17 sequence number of the message from that origin, big endian
//! bytes 18-21 Message Expiry Interval left, in seconds, big endian; 0: none
//! then        the MQTT 5.0 properties, length-prefixed (MQTT 5.0 section 2.2.2)
//! then        with bit 3: the topic, a 2-byte big-endian length and UTF-8
//! the rest    the payload
//! ```
//!
//! The topic normally travels in the subject ([`super::subject`]); only a topic whose subject
//! would be too long for NATS travels here, on the subject of long topics.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::codec::{decode_properties, encode_properties, Properties, QoS};

const VERSION: u8 = 1;
const RETAIN: u8 = 0b100;
const HAS_TOPIC: u8 = 0b1000;
const FIXED: usize = 22;

/// One routed message, as the publishing node sends it.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// The publishing node's incarnation.
    pub origin: u64,
    /// This message's number among those of `origin`, from 1.
    pub seq: u64,
    pub qos: QoS,
    /// RETAIN as published.
    pub retain: bool,
    /// Message Expiry Interval left when sent, in seconds.
    pub expiry: Option<u32>,
    pub properties: Properties,
    /// Present only for a topic too long for a subject.
    pub topic: Option<String>,
    pub payload: Bytes,
}

/// Why a NATS message is not an envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("too short ({0} bytes)")]
    Short(usize),
    #[error("unknown version {0}")]
    Version(u8),
    #[error("QoS 3")]
    QoS,
    #[error("properties: {0}")]
    Properties(String),
    #[error("topic: not UTF-8 or cut short")]
    Topic,
}

impl Envelope {
    /// Encodes the envelope. Errors: properties the codec cannot write (a string over
    /// 65,535 bytes), or a topic over 65,535 bytes.
    pub fn encode(&self) -> Result<Bytes, crate::codec::EncodeError> {
        let mut out = BytesMut::with_capacity(FIXED + 8 + self.payload.len());
        out.put_u8(VERSION);
        let mut flags = self.qos as u8;
        if self.retain {
            flags |= RETAIN;
        }
        if self.topic.is_some() {
            flags |= HAS_TOPIC;
        }
        out.put_u8(flags);
        out.put_u64(self.origin);
        out.put_u64(self.seq);
        out.put_u32(self.expiry.unwrap_or(0));
        encode_properties(&self.properties, &mut out)?;
        if let Some(topic) = &self.topic {
            let len = u16::try_from(topic.len()).map_err(|_| {
                crate::codec::EncodeError::StringTooLong {
                    field: "topic name",
                    len: topic.len(),
                }
            })?;
            out.put_u16(len);
            out.put_slice(topic.as_bytes());
        }
        out.put_slice(&self.payload);
        Ok(out.freeze())
    }

    /// Decodes an envelope; the payload shares `buf`'s allocation.
    pub fn decode(mut buf: Bytes) -> Result<Envelope, EnvelopeError> {
        if buf.len() < FIXED {
            return Err(EnvelopeError::Short(buf.len()));
        }
        let version = buf.get_u8();
        if version != VERSION {
            return Err(EnvelopeError::Version(version));
        }
        let flags = buf.get_u8();
        let qos = QoS::from_u8(flags & 0b11).ok_or(EnvelopeError::QoS)?;
        let origin = buf.get_u64();
        let seq = buf.get_u64();
        let expiry = Some(buf.get_u32()).filter(|&e| e > 0);
        let props_len = properties_len(&buf)
            .ok_or_else(|| EnvelopeError::Properties("length cut short".into()))?;
        if buf.len() < props_len {
            return Err(EnvelopeError::Properties("cut short".into()));
        }
        let props = buf.split_to(props_len);
        let properties =
            decode_properties(&props).map_err(|e| EnvelopeError::Properties(e.to_string()))?;
        let topic = if flags & HAS_TOPIC != 0 {
            if buf.len() < 2 {
                return Err(EnvelopeError::Topic);
            }
            let len = usize::from(buf.get_u16());
            if buf.len() < len {
                return Err(EnvelopeError::Topic);
            }
            let t = buf.split_to(len);
            Some(String::from_utf8(t.to_vec()).map_err(|_| EnvelopeError::Topic)?)
        } else {
            None
        };
        Ok(Envelope {
            origin,
            seq,
            qos,
            retain: flags & RETAIN != 0,
            expiry,
            properties,
            topic,
            payload: buf,
        })
    }
}

/// A retained change as it crosses NATS on `{prefix}.retained` (and in the answers to
/// `{prefix}.retained.sync`): its stamp, then the message's envelope, which always carries
/// the topic.
///
/// ```text
/// byte 0      version, 1
/// bytes 1-8   the stamp's milliseconds since the Unix epoch, big endian
/// byte 9      the length of the stamp's node name (at most 64)
/// then        the node name
/// the rest    the envelope (above); an empty payload clears the topic's retained message
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RetainedUpdate {
    /// The stamp's milliseconds.
    pub ms: u64,
    /// The stamp's node.
    pub node: String,
    /// The message, its topic in `topic`.
    pub envelope: Envelope,
}

impl RetainedUpdate {
    /// Encodes the update. Errors: the envelope's ([`Envelope::encode`]), or a node name over
    /// 255 bytes.
    pub fn encode(&self) -> Result<Bytes, crate::codec::EncodeError> {
        let env = self.envelope.encode()?;
        let len = u8::try_from(self.node.len()).map_err(|_| {
            crate::codec::EncodeError::StringTooLong {
                field: "node name",
                len: self.node.len(),
            }
        })?;
        let mut out = BytesMut::with_capacity(10 + self.node.len() + env.len());
        out.put_u8(VERSION);
        out.put_u64(self.ms);
        out.put_u8(len);
        out.put_slice(self.node.as_bytes());
        out.put_slice(&env);
        Ok(out.freeze())
    }

    /// Decodes an update. Errors: cut short, an unknown version, a node name that is not
    /// UTF-8 ([`EnvelopeError::Topic`]), or the envelope's, or an envelope without its topic.
    pub fn decode(mut buf: Bytes) -> Result<RetainedUpdate, EnvelopeError> {
        if buf.len() < 10 {
            return Err(EnvelopeError::Short(buf.len()));
        }
        let version = buf.get_u8();
        if version != VERSION {
            return Err(EnvelopeError::Version(version));
        }
        let ms = buf.get_u64();
        let len = usize::from(buf.get_u8());
        if buf.len() < len {
            return Err(EnvelopeError::Short(buf.len()));
        }
        let node =
            String::from_utf8(buf.split_to(len).to_vec()).map_err(|_| EnvelopeError::Topic)?;
        let envelope = Envelope::decode(buf)?;
        if envelope.topic.is_none() {
            return Err(EnvelopeError::Topic);
        }
        Ok(RetainedUpdate { ms, node, envelope })
    }
}

/// The length of the length-prefixed property block at the start of `buf` (its Variable
/// Byte Integer included); `None` when the integer is cut short or over 4 bytes.
fn properties_len(buf: &[u8]) -> Option<usize> {
    let mut value = 0usize;
    for (i, &b) in buf.iter().take(4).enumerate() {
        value |= usize::from(b & 0x7F) << (7 * i);
        if b & 0x80 == 0 {
            return Some(i + 1 + value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn envelope() -> impl Strategy<Value = Envelope> {
        (
            any::<u64>(),
            any::<u64>(),
            0u8..3,
            any::<bool>(),
            prop::option::of(1u32..),
            prop::option::of("[a-z/ .]{0,40}"),
            prop::collection::vec(any::<u8>(), 0..64),
            prop::option::of("[a-z/]{1,20}"),
        )
            .prop_map(|(origin, seq, qos, retain, expiry, topic, payload, ct)| {
                let properties = Properties {
                    content_type: ct,
                    user_properties: vec![("k".into(), "v".into())],
                    ..Properties::default()
                };
                Envelope {
                    origin,
                    seq,
                    qos: QoS::from_u8(qos).unwrap_or(QoS::AtMostOnce),
                    retain,
                    expiry,
                    properties,
                    topic,
                    payload: Bytes::from(payload),
                }
            })
    }

    proptest! {
        #[test]
        fn retained_updates_round_trip(mut e in envelope(), ms in any::<u64>(), node in "[a-z0-9_-]{0,64}") {
            e.topic = Some(e.topic.unwrap_or_default());
            let u = RetainedUpdate { ms, node, envelope: e };
            let bytes = u.encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(RetainedUpdate::decode(bytes), Ok(u));
        }

        /// Any bytes decode to an update or an error, never a panic.
        #[test]
        fn garbage_updates_are_errors_not_panics(b in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = RetainedUpdate::decode(Bytes::from(b));
        }

        #[test]
        fn round_trips(e in envelope()) {
            let bytes = e.encode().map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(Envelope::decode(bytes), Ok(e));
        }

        /// Any bytes decode to an envelope or an error, never a panic.
        #[test]
        fn garbage_is_an_error_not_a_panic(b in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = Envelope::decode(Bytes::from(b));
        }
    }

    #[test]
    fn cut_short() {
        assert_eq!(
            Envelope::decode(Bytes::from_static(b"\x01\x00")),
            Err(EnvelopeError::Short(2))
        );
        let mut b = vec![2u8; FIXED];
        b[1] = 0;
        assert_eq!(
            Envelope::decode(Bytes::from(b)),
            Err(EnvelopeError::Version(2))
        );
    }
}
