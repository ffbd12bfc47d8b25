//! Stream segments: the entries one batch appends to one stream, in one row's blob.
//!
//! Format (version 1): a version byte, then per entry its offset and append time (u64 LE),
//! the message id (u64 LE) and a tag: 0, the message is in the message store (a reference,
//! counted in its `refs`); 1, the message follows inline: topic, payload and properties as a
//! u32 LE length and bytes, QoS, RETAIN, then the expiry and the publisher, each a presence
//! byte and its value.

use bytes::Bytes;

use crate::records::{MessageRecord, StreamEntryRecord};

/// The version byte this build writes and reads.
const VERSION: u8 = 1;

/// One entry of a segment: its message inline, or a reference to the message store.
pub(super) enum Body<'a> {
    Inline(&'a MessageRecord),
    Ref,
}

/// One entry read back: inline messages decoded, references to be looked up.
pub(super) struct Decoded {
    pub(super) entry: StreamEntryRecord,
    pub(super) message: Option<MessageRecord>,
}

/// Encodes `entries` (in offset order) as one segment blob.
pub(super) fn encode(entries: &[(StreamEntryRecord, Body<'_>)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + entries.len() * 96);
    out.push(VERSION);
    for (e, body) in entries {
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.time_ms.to_le_bytes());
        out.extend_from_slice(&e.message_id.to_le_bytes());
        match body {
            Body::Ref => out.push(0),
            Body::Inline(m) => {
                out.push(1);
                put_bytes(&mut out, m.topic.as_bytes());
                put_bytes(&mut out, &m.payload);
                put_bytes(&mut out, &m.properties);
                out.push(m.qos);
                out.push(u8::from(m.retain));
                match m.expires_at {
                    Some(at) => {
                        out.push(1);
                        out.extend_from_slice(&at.to_le_bytes());
                    }
                    None => out.push(0),
                }
                match &m.publisher {
                    Some(p) => {
                        out.push(1);
                        put_bytes(&mut out, p.as_bytes());
                    }
                    None => out.push(0),
                }
            }
        }
    }
    out
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    // A topic, payload or publisher is below 256 MiB (MQTT's largest packet).
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// Decodes a segment blob; an error names what is wrong (a damaged or newer segment).
pub(super) fn decode(blob: &[u8]) -> Result<Vec<Decoded>, String> {
    decode_where(blob, |_| true, usize::MAX, u64::MAX)
}

/// Decodes the first `max` entries of a segment blob that `keep` takes, stopping after the
/// one whose inline message brings them to `max_bytes` ([`MessageRecord::size`]); the
/// others are skipped without copying their messages (a reader asks for a few entries of a
/// segment of thousands).
pub(super) fn decode_where(
    blob: &[u8],
    keep: impl Fn(&StreamEntryRecord) -> bool,
    max: usize,
    max_bytes: u64,
) -> Result<Vec<Decoded>, String> {
    let mut r = Reader { blob, at: 0 };
    match r.u8()? {
        VERSION => {}
        v => return Err(format!("segment version {v}, this build reads {VERSION}")),
    }
    let mut out = Vec::new();
    let mut bytes = 0u64;
    while r.at < blob.len() && out.len() < max && bytes < max_bytes {
        let entry = StreamEntryRecord {
            offset: r.u64()?,
            time_ms: r.u64()?,
            message_id: r.u64()?,
        };
        let wanted = keep(&entry);
        let message = match r.u8()? {
            0 => None,
            1 if !wanted => {
                r.skip_message()?;
                None
            }
            1 => {
                let topic = String::from_utf8(r.bytes()?.to_vec())
                    .map_err(|_| "topic is not UTF-8".to_string())?;
                let payload = Bytes::copy_from_slice(r.bytes()?);
                let properties = Bytes::copy_from_slice(r.bytes()?);
                let qos = r.u8()?;
                let retain = r.u8()? != 0;
                let expires_at = match r.u8()? {
                    0 => None,
                    _ => Some(r.u64()?),
                };
                let publisher = match r.u8()? {
                    0 => None,
                    _ => Some(
                        String::from_utf8(r.bytes()?.to_vec())
                            .map_err(|_| "publisher is not UTF-8".to_string())?,
                    ),
                };
                Some(MessageRecord {
                    topic,
                    payload,
                    qos,
                    retain,
                    properties,
                    expires_at,
                    publisher,
                    share: None,
                })
            }
            t => return Err(format!("entry tag {t}")),
        };
        if wanted {
            bytes += message.as_ref().map_or(0, MessageRecord::size);
            out.push(Decoded { entry, message });
        }
    }
    Ok(out)
}

struct Reader<'a> {
    blob: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.blob.len());
        let end = end.ok_or_else(|| format!("segment cut short at byte {}", self.at))?;
        let out = &self.blob[self.at..end];
        self.at = end;
        Ok(out)
    }
    /// Passes over an inline message.
    fn skip_message(&mut self) -> Result<(), String> {
        for _ in 0..3 {
            self.bytes()?;
        }
        self.take(2)?;
        if self.u8()? != 0 {
            self.take(8)?;
        }
        if self.u8()? != 0 {
            self.bytes()?;
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        self.take(u32::from_le_bytes(b) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(offset: u64, message_id: u64) -> StreamEntryRecord {
        StreamEntryRecord {
            offset,
            time_ms: 1_000 + offset,
            message_id,
        }
    }

    #[test]
    fn entries_come_back_as_written() {
        let mut m = MessageRecord::new("t/a", &b"\x00\xffpayload"[..], 2);
        m.retain = true;
        m.properties = Bytes::from_static(&[0x0B, 0x01]);
        m.expires_at = Some(1_700_000_000_000);
        m.publisher = Some("pub".into());
        let bare = MessageRecord::new("t/b", "", 0);
        let blob = encode(&[
            (entry(5, 10), Body::Inline(&m)),
            (entry(6, 3), Body::Ref),
            (entry(7, 11), Body::Inline(&bare)),
        ]);
        let back = decode(&blob).unwrap();
        let seen: Vec<_> = back.iter().map(|d| (d.entry, d.message.clone())).collect();
        assert_eq!(
            seen,
            [
                (entry(5, 10), Some(m)),
                (entry(6, 3), None),
                (entry(7, 11), Some(bare.clone()))
            ]
        );
        let some = decode_where(&blob, |e| e.offset >= 6, 1, u64::MAX).unwrap();
        assert_eq!(some.len(), 1, "at most max");
        assert_eq!((some[0].entry.offset, some[0].message.is_none()), (6, true));
        let last = decode_where(&blob, |e| e.offset == 7, 10, u64::MAX).unwrap();
        assert_eq!(
            last[0].message.as_ref(),
            Some(&bare),
            "skipped ones passed over"
        );
        let within = decode_where(&blob, |_| true, 10, 1).unwrap();
        assert_eq!(
            within.len(),
            1,
            "stops after the entry that reaches the bound in bytes"
        );
        let within = decode_where(&blob, |e| e.offset >= 6, 10, 1).unwrap();
        assert_eq!(within.len(), 2, "a reference counts no bytes here");
    }

    #[test]
    fn damaged_or_newer_segments_are_errors() {
        let m = MessageRecord::new("t/a", "x", 1);
        let blob = encode(&[(entry(1, 1), Body::Inline(&m))]);
        let err = decode(&blob[..blob.len() - 1]).err().unwrap();
        assert!(err.contains("cut short"), "{err}");
        let mut newer = blob.clone();
        newer[0] = 2;
        let err = decode(&newer).err().unwrap();
        assert!(err.contains("version 2"), "{err}");
    }
}
