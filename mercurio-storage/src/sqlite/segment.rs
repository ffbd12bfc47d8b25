//! Stream segments: the entries one batch appends to one stream, in one row's blob.
//!
//! Format version 2 (written by this build). Integers are LEB128 varints (7 bits a byte,
//! low first, at most 10 bytes); a signed difference is zigzag-coded (0, -1, 1, -2 as 0, 1,
//! 2, 3) so a small one of either sign takes one byte. A header: the version byte 2, the
//! number of entries, then the first entry's offset, append time and message id. Then per
//! entry:
//!
//! - a flags byte: bits 0-1, 0 for a reference (the message is in the message store,
//!   counted in its `refs`; no other bit is set) or 1 + the QoS of a message that follows
//!   inline; bit 2 RETAIN; bit 3 an expiry follows; bit 4 properties follow; bit 5 the
//!   message has a publisher; bit 6 it is the publisher of the previous inline entry (with
//!   bit 5); bit 7 the topic is that of the previous inline entry;
//! - the offset, the append time and the message id, each as the zigzag difference from the
//!   previous entry's (the first entry's from the header, so zero): consecutive offsets and
//!   ids and a clock that moved little take a byte each;
//! - for an inline message: the topic (unless bit 7) and the payload, each a length and its
//!   bytes; the properties (bit 4), a length and bytes; the expiry (bit 3), the zigzag
//!   difference from the append time; the publisher (bit 5 without bit 6), a length and
//!   bytes.
//!
//! A message of 64 bytes on a topic of 17 bytes, from the publisher of the entry before,
//! takes 69 bytes where version 1 took 126 and the publisher's name. Version 1 (written before schema 11, still read): a version byte, then per
//! entry its offset and append time (u64 LE), the message id (u64 LE) and a tag: 0, a
//! reference; 1, the message follows inline: topic, payload and properties as a u32 LE
//! length and bytes, QoS, RETAIN, then the expiry and the publisher, each a presence byte
//! and its value.
//!
//! A blob is never trusted: a length past its end, an overlong varint, a flag with nothing
//! to refer to or an entry count that does not match is an error, and nothing is allocated
//! before the bytes it stands for are found in the blob.

use bytes::Bytes;

use crate::records::{MessageRecord, StreamEntryRecord};

/// The version byte this build writes.
const VERSION: u8 = 2;
/// The version byte of segments written before schema 11, still read.
const VERSION_1: u8 = 1;

/// Flags byte, bits 0-1: 0 a reference, 1 + QoS an inline message.
const KIND: u8 = 0b11;
const RETAIN: u8 = 1 << 2;
const EXPIRY: u8 = 1 << 3;
const PROPERTIES: u8 = 1 << 4;
const PUBLISHER: u8 = 1 << 5;
const SAME_PUBLISHER: u8 = 1 << 6;
const SAME_TOPIC: u8 = 1 << 7;

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

/// Encodes `entries` (in offset order) as one segment blob of the current version; an
/// inline message's QoS must be 0, 1 or 2 (the error names the entry otherwise).
pub(super) fn encode(entries: &[(StreamEntryRecord, Body<'_>)]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(16 + entries.len() * 80);
    out.push(VERSION);
    put_varint(&mut out, entries.len() as u64);
    let mut prev = entries.first().map_or(
        StreamEntryRecord {
            offset: 0,
            time_ms: 0,
            message_id: 0,
        },
        |(e, _)| *e,
    );
    put_varint(&mut out, prev.offset);
    put_varint(&mut out, prev.time_ms);
    put_varint(&mut out, prev.message_id);
    let (mut topic, mut publisher): (Option<&str>, Option<&str>) = (None, None);
    for (e, body) in entries {
        let m = match body {
            Body::Ref => None,
            Body::Inline(m) if m.qos <= 2 => Some(*m),
            Body::Inline(m) => {
                return Err(format!(
                    "stream entry {} has QoS {}, not 0, 1 or 2",
                    e.offset, m.qos
                ))
            }
        };
        let mut flags = 0;
        if let Some(m) = m {
            flags |= 1 + m.qos;
            if m.retain {
                flags |= RETAIN;
            }
            if m.expires_at.is_some() {
                flags |= EXPIRY;
            }
            if !m.properties.is_empty() {
                flags |= PROPERTIES;
            }
            if let Some(p) = &m.publisher {
                flags |= PUBLISHER;
                if publisher == Some(p.as_str()) {
                    flags |= SAME_PUBLISHER;
                }
            }
            if topic == Some(m.topic.as_str()) {
                flags |= SAME_TOPIC;
            }
        }
        out.push(flags);
        put_varint(&mut out, zigzag(e.offset.wrapping_sub(prev.offset)));
        put_varint(&mut out, zigzag(e.time_ms.wrapping_sub(prev.time_ms)));
        put_varint(&mut out, zigzag(e.message_id.wrapping_sub(prev.message_id)));
        prev = *e;
        let Some(m) = m else { continue };
        if flags & SAME_TOPIC == 0 {
            put_bytes(&mut out, m.topic.as_bytes());
        }
        put_bytes(&mut out, &m.payload);
        if flags & PROPERTIES != 0 {
            put_bytes(&mut out, &m.properties);
        }
        if let Some(at) = m.expires_at {
            put_varint(&mut out, zigzag(at.wrapping_sub(e.time_ms)));
        }
        if let Some(p) = &m.publisher {
            if flags & SAME_PUBLISHER == 0 {
                put_bytes(&mut out, p.as_bytes());
            }
        }
        topic = Some(&m.topic);
        publisher = m.publisher.as_deref();
    }
    Ok(out)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A difference taken modulo 2^64 as a signed one, small of either sign to small.
fn zigzag(d: u64) -> u64 {
    let d = d as i64;
    ((d << 1) ^ (d >> 63)) as u64
}

fn unzigzag(z: u64) -> u64 {
    (z >> 1) ^ (z & 1).wrapping_neg()
}

/// Decodes a segment blob; an error names what is wrong (a damaged or newer segment).
pub(super) fn decode(blob: &[u8]) -> Result<Vec<Decoded>, String> {
    decode_where(blob, |_| true, usize::MAX, u64::MAX)
}

/// Decodes the first `max` entries of a segment blob that `keep` takes, stopping after the
/// one whose inline message brings them to `max_bytes` ([`MessageRecord::size`]); the
/// others are skipped without copying their messages (a reader asks for a few entries of a
/// segment of thousands). Reads versions 1 and 2.
pub(super) fn decode_where(
    blob: &[u8],
    keep: impl Fn(&StreamEntryRecord) -> bool,
    max: usize,
    max_bytes: u64,
) -> Result<Vec<Decoded>, String> {
    let mut r = Reader { blob, at: 0 };
    let mut out = Taken {
        entries: Vec::new(),
        bytes: 0,
        max,
        max_bytes,
    };
    match r.u8()? {
        VERSION => decode_v2(&mut r, keep, &mut out)?,
        VERSION_1 => decode_v1(&mut r, keep, &mut out)?,
        v => {
            return Err(format!(
                "segment version {v}, this build reads {VERSION_1} and {VERSION}"
            ))
        }
    }
    Ok(out.entries)
}

/// The entries taken so far, and the bounds on them.
struct Taken {
    entries: Vec<Decoded>,
    bytes: u64,
    max: usize,
    max_bytes: u64,
}

impl Taken {
    fn full(&self) -> bool {
        self.entries.len() >= self.max || self.bytes >= self.max_bytes
    }
    fn push(&mut self, entry: StreamEntryRecord, message: Option<MessageRecord>) {
        self.bytes += message.as_ref().map_or(0, MessageRecord::size);
        self.entries.push(Decoded { entry, message });
    }
}

fn decode_v2(
    r: &mut Reader<'_>,
    keep: impl Fn(&StreamEntryRecord) -> bool,
    out: &mut Taken,
) -> Result<(), String> {
    let count = r.varint()?;
    let mut prev = StreamEntryRecord {
        offset: r.varint()?,
        time_ms: r.varint()?,
        message_id: r.varint()?,
    };
    // The previous inline entry's topic and publisher, as bytes of the blob and, once a
    // kept entry needed them, as text (checked as UTF-8 once for a run of entries).
    let mut topic: Option<Text<'_>> = None;
    let mut publisher: Option<Text<'_>> = None;
    let mut read = 0u64;
    while read < count && !out.full() {
        read += 1;
        let flags = r.u8()?;
        let entry = StreamEntryRecord {
            offset: prev.offset.wrapping_add(unzigzag(r.varint()?)),
            time_ms: prev.time_ms.wrapping_add(unzigzag(r.varint()?)),
            message_id: prev.message_id.wrapping_add(unzigzag(r.varint()?)),
        };
        prev = entry;
        let wanted = keep(&entry);
        if flags & KIND == 0 {
            if flags != 0 {
                return Err(format!(
                    "reference entry {} has flags {flags:#04x}",
                    entry.offset
                ));
            }
            if wanted {
                out.push(entry, None);
            }
            continue;
        }
        if flags & SAME_TOPIC == 0 {
            topic = Some(Text::new(r.bytes()?));
        } else if topic.is_none() {
            return Err(format!(
                "entry {} repeats the topic of no earlier entry",
                entry.offset
            ));
        }
        let payload = r.bytes()?;
        let properties = if flags & PROPERTIES != 0 {
            r.bytes()?
        } else {
            &[]
        };
        let expires_at = if flags & EXPIRY != 0 {
            Some(entry.time_ms.wrapping_add(unzigzag(r.varint()?)))
        } else {
            None
        };
        match (flags & PUBLISHER != 0, flags & SAME_PUBLISHER != 0) {
            (true, false) => publisher = Some(Text::new(r.bytes()?)),
            (false, false) => publisher = None,
            (true, true) if publisher.is_some() => {}
            _ => {
                return Err(format!(
                    "entry {} repeats the publisher of no earlier entry",
                    entry.offset
                ))
            }
        }
        if !wanted {
            continue;
        }
        let topic = match &mut topic {
            Some(t) => t.string("topic")?,
            None => return Err(format!("entry {} has no topic", entry.offset)),
        };
        let publisher = match &mut publisher {
            Some(p) => Some(p.string("publisher")?),
            None => None,
        };
        let message = MessageRecord {
            topic,
            payload: Bytes::copy_from_slice(payload),
            qos: (flags & KIND) - 1,
            retain: flags & RETAIN != 0,
            properties: Bytes::copy_from_slice(properties),
            expires_at,
            publisher,
            share: None,
        };
        out.push(entry, Some(message));
    }
    if read == count && r.at != r.blob.len() {
        return Err(format!(
            "segment of {count} entries has {} bytes more",
            r.blob.len() - r.at
        ));
    }
    Ok(())
}

/// A topic or publisher in a blob, and its text once a kept entry needed it.
struct Text<'a> {
    bytes: &'a [u8],
    text: Option<String>,
}

impl<'a> Text<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Text { bytes, text: None }
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        if let Some(t) = &self.text {
            return Ok(t.clone());
        }
        let t = std::str::from_utf8(self.bytes)
            .map_err(|_| format!("{what} is not UTF-8"))?
            .to_string();
        self.text = Some(t.clone());
        Ok(t)
    }
}

fn decode_v1(
    r: &mut Reader<'_>,
    keep: impl Fn(&StreamEntryRecord) -> bool,
    out: &mut Taken,
) -> Result<(), String> {
    while r.at < r.blob.len() && !out.full() {
        let entry = StreamEntryRecord {
            offset: r.u64()?,
            time_ms: r.u64()?,
            message_id: r.u64()?,
        };
        let wanted = keep(&entry);
        let message = match r.u8()? {
            0 => None,
            1 if !wanted => {
                r.skip_message_v1()?;
                None
            }
            1 => {
                let topic = String::from_utf8(r.bytes_v1()?.to_vec())
                    .map_err(|_| "topic is not UTF-8".to_string())?;
                let payload = Bytes::copy_from_slice(r.bytes_v1()?);
                let properties = Bytes::copy_from_slice(r.bytes_v1()?);
                let qos = r.u8()?;
                let retain = r.u8()? != 0;
                let expires_at = match r.u8()? {
                    0 => None,
                    _ => Some(r.u64()?),
                };
                let publisher = match r.u8()? {
                    0 => None,
                    _ => Some(
                        String::from_utf8(r.bytes_v1()?.to_vec())
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
            out.push(entry, message);
        }
    }
    Ok(())
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
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    /// A LEB128 varint of at most 10 bytes that fits in 64 bits.
    fn varint(&mut self) -> Result<u64, String> {
        let start = self.at;
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            if shift == 63 && b > 1 {
                break;
            }
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(format!("varint at byte {start} does not fit in 64 bits"))
    }
    /// A varint length and that many bytes.
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let at = self.at;
        let n = self.varint()?;
        let n = usize::try_from(n).map_err(|_| format!("length {n} at byte {at}"))?;
        self.take(n)
    }
    /// Passes over a version 1 inline message.
    fn skip_message_v1(&mut self) -> Result<(), String> {
        for _ in 0..3 {
            self.bytes_v1()?;
        }
        self.take(2)?;
        if self.u8()? != 0 {
            self.take(8)?;
        }
        if self.u8()? != 0 {
            self.bytes_v1()?;
        }
        Ok(())
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    /// A u32 LE length and that many bytes (version 1).
    fn bytes_v1(&mut self) -> Result<&'a [u8], String> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        self.take(u32::from_le_bytes(b) as usize)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn entry(offset: u64, message_id: u64) -> StreamEntryRecord {
        StreamEntryRecord {
            offset,
            time_ms: 1_000 + offset,
            message_id,
        }
    }

    /// Version 1's encoder, as builds before schema 11 wrote segments.
    pub(in crate::sqlite) fn encode_v1(entries: &[(StreamEntryRecord, Body<'_>)]) -> Vec<u8> {
        fn put(out: &mut Vec<u8>, b: &[u8]) {
            out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            out.extend_from_slice(b);
        }
        let mut out = vec![VERSION_1];
        for (e, body) in entries {
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.time_ms.to_le_bytes());
            out.extend_from_slice(&e.message_id.to_le_bytes());
            let Body::Inline(m) = body else {
                out.push(0);
                continue;
            };
            out.push(1);
            put(&mut out, m.topic.as_bytes());
            put(&mut out, &m.payload);
            put(&mut out, &m.properties);
            out.extend_from_slice(&[m.qos, u8::from(m.retain)]);
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
                    put(&mut out, p.as_bytes());
                }
                None => out.push(0),
            }
        }
        out
    }

    type Written = Vec<(StreamEntryRecord, Option<MessageRecord>)>;

    fn bodies(written: &Written) -> Vec<(StreamEntryRecord, Body<'_>)> {
        written
            .iter()
            .map(|(e, m)| (*e, m.as_ref().map_or(Body::Ref, Body::Inline)))
            .collect()
    }

    fn back(decoded: Vec<Decoded>) -> Written {
        decoded.into_iter().map(|d| (d.entry, d.message)).collect()
    }

    /// Every combination of the flags byte's fields, after an inline entry whose topic and
    /// publisher it may repeat: a reference, or an inline message with QoS 0-2, RETAIN or
    /// not, no, a near or an extreme expiry, properties or none, no, the same or another
    /// publisher, the same topic or another, an empty payload or not.
    fn combinations() -> Vec<Option<MessageRecord>> {
        let mut out = vec![None];
        for bits in 0..432u32 {
            let pick = |n: u32, below: u32| (bits / below) % n;
            let mut m = MessageRecord::new(
                ["a/b", "other/topic"][pick(2, 1) as usize],
                ["", "\u{0}\u{ff}payload"][pick(2, 2) as usize],
                pick(3, 4) as u8,
            );
            m.retain = pick(2, 12) == 1;
            m.expires_at = [None, Some(1_000_060_000), Some(u64::MAX)][pick(3, 24) as usize];
            if pick(2, 72) == 1 {
                m.properties = Bytes::from_static(&[0x0B, 0x01, 0x26, 0, 1, b'k', 0, 0]);
            }
            m.publisher =
                [None, Some("p".to_string()), Some("q".to_string())][pick(3, 144) as usize].clone();
            out.push(Some(m));
        }
        out
    }

    /// Offsets, times and ids of two entries: consecutive, with gaps, backwards, at the
    /// ends of the range.
    const PATTERNS: [[(u64, u64, u64); 2]; 5] = [
        [(1, 1_000_000_000, 7), (2, 1_000_000_000, 8)],
        [(10, 5, 100), (300, 9_000, 90_000)],
        [(10, 5_000, 100), (11, 4_000, 3)],
        [(0, 0, 0), (u64::MAX, u64::MAX, u64::MAX)],
        [(u64::MAX - 1, u64::MAX, u64::MAX), (0, 0, 0)],
    ];

    #[test]
    fn every_field_combination_round_trips() {
        let mut first = MessageRecord::new("a/b", "x", 1);
        first.publisher = Some("p".into());
        for pattern in PATTERNS {
            let [(o1, t1, i1), (o2, t2, i2)] = pattern;
            let e1 = StreamEntryRecord {
                offset: o1,
                time_ms: t1,
                message_id: i1,
            };
            let e2 = StreamEntryRecord {
                offset: o2,
                time_ms: t2,
                message_id: i2,
            };
            for m in combinations() {
                for lead in [None, Some(first.clone())] {
                    let written: Written = vec![(e1, lead), (e2, m.clone())];
                    let blob = encode(&bodies(&written)).unwrap();
                    assert_eq!(back(decode(&blob).unwrap()), written, "{blob:02x?}");
                    let second = decode_where(&blob, |e| e == &e2, 1, u64::MAX).unwrap();
                    assert_eq!(back(second), written[1..], "the first passed over");
                }
            }
        }
        // All of them in one segment, and every other one of them read.
        let written: Written = combinations()
            .into_iter()
            .enumerate()
            .map(|(i, m)| (entry(i as u64 + 1, 50 + i as u64), m))
            .collect();
        let blob = encode(&bodies(&written)).unwrap();
        assert_eq!(back(decode(&blob).unwrap()), written);
        let odd = decode_where(&blob, |e| e.offset % 2 == 1, usize::MAX, u64::MAX).unwrap();
        let expected: Written = written.iter().step_by(2).cloned().collect();
        assert_eq!(back(odd), expected);
    }

    #[test]
    fn entries_come_back_as_written() {
        let mut m = MessageRecord::new("t/a", &b"\x00\xffpayload"[..], 2);
        m.retain = true;
        m.properties = Bytes::from_static(&[0x0B, 0x01]);
        m.expires_at = Some(1_700_000_000_000);
        m.publisher = Some("pub".into());
        let bare = MessageRecord::new("t/b", "", 0);
        let entries = [
            (entry(5, 10), Body::Inline(&m)),
            (entry(6, 3), Body::Ref),
            (entry(7, 11), Body::Inline(&bare)),
        ];
        for blob in [encode(&entries).unwrap(), encode_v1(&entries)] {
            let back = decode(&blob).unwrap();
            let seen: Vec<_> = back.iter().map(|d| (d.entry, d.message.clone())).collect();
            assert_eq!(
                seen,
                [
                    (entry(5, 10), Some(m.clone())),
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
            assert!(decode_where(&blob, |_| true, 0, u64::MAX)
                .unwrap()
                .is_empty());
        }
    }

    /// A segment of a version 1 build, byte for byte: an inline message with everything,
    /// then a reference.
    #[test]
    fn version_1_segments_still_decode() {
        let mut fixture = vec![1u8];
        fixture.extend_from_slice(&5u64.to_le_bytes());
        fixture.extend_from_slice(&1_005u64.to_le_bytes());
        fixture.extend_from_slice(&10u64.to_le_bytes());
        fixture.extend_from_slice(b"\x01\x03\x00\x00\x00t/a\x02\x00\x00\x00\x00\xff");
        fixture.extend_from_slice(b"\x02\x00\x00\x00\x0b\x01\x02\x01\x01");
        fixture.extend_from_slice(&1_700_000_000_000u64.to_le_bytes());
        fixture.extend_from_slice(b"\x01\x03\x00\x00\x00pub");
        fixture.extend_from_slice(&6u64.to_le_bytes());
        fixture.extend_from_slice(&1_006u64.to_le_bytes());
        fixture.extend_from_slice(&3u64.to_le_bytes());
        fixture.push(0);
        let mut m = MessageRecord::new("t/a", &b"\x00\xff"[..], 2);
        m.retain = true;
        m.properties = Bytes::from_static(&[0x0B, 0x01]);
        m.expires_at = Some(1_700_000_000_000);
        m.publisher = Some("pub".into());
        let written: Written = vec![(entry(5, 10), Some(m)), (entry(6, 3), None)];
        assert_eq!(encode_v1(&bodies(&written)), fixture);
        assert_eq!(back(decode(&fixture).unwrap()), written);
        let written: Written = combinations()
            .into_iter()
            .enumerate()
            .map(|(i, m)| (entry(i as u64 + 1, 50 + i as u64), m))
            .collect();
        let blob = encode_v1(&bodies(&written));
        assert_eq!(back(decode(&blob).unwrap()), written);
    }

    /// The benchmark's case: one publisher, one topic, 64-byte payloads, consecutive
    /// offsets and ids in the same millisecond or the next.
    #[test]
    fn a_run_of_one_publisher_takes_little_more_than_its_payloads() {
        let mut m = MessageRecord::new("bench/mb1234/in/0", vec![7u8; 64], 1);
        m.publisher = Some("bench-pub-0".into());
        let written: Written = (0..128)
            .map(|i| {
                let e = StreamEntryRecord {
                    offset: 1_000 + i,
                    time_ms: 1_700_000_000_000 + i / 3,
                    message_id: 90_000 + i,
                };
                (e, Some(m.clone()))
            })
            .collect();
        let blob = encode(&bodies(&written)).unwrap();
        assert_eq!(back(decode(&blob).unwrap()), written);
        let per_entry = blob.len() as f64 / 128.0;
        assert!(per_entry < 70.0, "{per_entry} bytes per entry");
    }

    #[test]
    fn damaged_or_newer_segments_are_errors() {
        let mut m = MessageRecord::new("t/a", "xy", 1);
        m.publisher = Some("p".into());
        m.expires_at = Some(9_000);
        m.properties = Bytes::from_static(&[0x0B, 0x01]);
        let e = |o| entry(o, o);
        let blob = encode(&[
            (e(1), Body::Inline(&m)),
            (e(2), Body::Ref),
            (e(3), Body::Inline(&m)),
        ])
        .unwrap();
        assert_eq!(decode(&blob).unwrap().len(), 3);
        // Cut anywhere, even between two entries: an error, never a panic.
        for n in 0..blob.len() {
            let err = decode(&blob[..n]).err().unwrap();
            assert!(err.contains("cut short"), "{n}: {err}");
        }
        let mut longer = blob.clone();
        longer.push(0);
        let err = decode(&longer).err().unwrap();
        assert!(err.contains("1 bytes more"), "{err}");
        // Any byte changed: decoded or refused, never a panic.
        for at in 0..blob.len() {
            for x in [0x01, 0x40, 0x80, 0xff] {
                let mut damaged = blob.clone();
                damaged[at] ^= x;
                let _ = decode(&damaged);
                let _ = decode_where(&damaged, |e| e.offset == 3, 1, 1);
            }
        }
        let mut newer = blob.clone();
        newer[0] = 3;
        let err = decode(&newer).err().unwrap();
        assert!(err.contains("version 3"), "{err}");
        // A header of one entry at offset 1, time 1, id 1, then `rest`.
        let one = |rest: &[u8]| [&[VERSION, 1, 1, 1, 1][..], rest].concat();
        let cases: [(&[u8], &str); 7] = [
            // A payload of 2^40 bytes: refused before anything is allocated.
            (
                &[1, 0, 0, 0, 1, b't', 0x80, 0x80, 0x80, 0x80, 0x80, 0x20],
                "cut short",
            ),
            (
                &[
                    0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
                ],
                "64 bits",
            ),
            (
                &[
                    0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0,
                ],
                "64 bits",
            ),
            (&[1 | SAME_TOPIC, 0, 0, 0, 0], "topic of no earlier"),
            (
                &[1 | PUBLISHER | SAME_PUBLISHER, 0, 0, 0, 1, b't', 0],
                "publisher of no earlier",
            ),
            (
                &[1 | SAME_PUBLISHER, 0, 0, 0, 1, b't', 0],
                "publisher of no earlier",
            ),
            (&[RETAIN, 0, 0, 0], "reference entry 1 has flags"),
        ];
        for (rest, expected) in cases {
            let err = decode(&one(rest)).err().unwrap();
            assert!(err.contains(expected), "{rest:02x?}: {err}");
        }
        let err = decode(&one(&[1, 0, 0, 0, 2, 0xc3, 0x28, 0])).err().unwrap();
        assert!(err.contains("topic is not UTF-8"), "{err}");
        // A count of 2^64 - 1 entries and one: cut short, nothing allocated for the count.
        let huge = [
            &[VERSION][..],
            &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
            &[1, 1, 1, 0, 0, 0, 0],
        ]
        .concat();
        let err = decode(&huge).err().unwrap();
        assert!(err.contains("cut short"), "{err}");
        let mut bad = MessageRecord::new("t", "x", 3);
        bad.retain = true;
        let err = encode(&[(e(4), Body::Inline(&bad))]).err().unwrap();
        assert!(err.contains("QoS 3"), "{err}");
    }
}
