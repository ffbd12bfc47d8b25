//! The data representations of MQTT 5.0 section 1.5 (3.1.1 section 1.5): two- and four-byte
//! integers, Variable Byte Integers, UTF-8 strings and binary data, read from a complete
//! frame ([`Reader`]) and written to a [`Sink`] (a byte counter or a buffer).

use bytes::{BufMut, BytesMut};

use super::error::{DecodeError, EncodeError};

/// The largest value a Variable Byte Integer holds: 268,435,455 (MQTT 5.0 section 1.5.5).
pub const MAX_VARIABLE_BYTE_INTEGER: usize = 268_435_455;

/// The largest UTF-8 string or binary data field: 65,535 bytes (MQTT 5.0 sections 1.5.4, 1.5.6).
pub const MAX_STRING_LEN: usize = 65_535;

/// Number of bytes the Variable Byte Integer encoding of `v` takes (1 to 4; 4 past the range).
pub(crate) fn vbi_len(v: usize) -> usize {
    match v {
        0..=127 => 1,
        128..=16_383 => 2,
        16_384..=2_097_151 => 3,
        _ => 4,
    }
}

/// A cursor over a complete frame. Running out of bytes here is malformed: the frame is
/// whole, so a field that does not fit in it contradicts the remaining length.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    /// Bytes this codec wrote for storage or another node: their strings were checked when
    /// they arrived, perhaps by an older version that let the discouraged code points pass.
    stored: bool,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, stored: false }
    }

    /// A reader over stored bytes (a property block written by `encode_properties`): its
    /// strings need only be well-formed UTF-8 without U+0000, so that what an older version
    /// stored still reads back.
    pub(crate) fn stored(buf: &'a [u8]) -> Self {
        Reader { buf, stored: true }
    }

    /// The next `n` bytes as a reader of their own, checking strings as this one does.
    pub(crate) fn sub(&mut self, n: usize) -> Result<Reader<'a>, DecodeError> {
        let stored = self.stored;
        Ok(Reader {
            buf: self.take(n)?,
            stored,
        })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.buf.len() {
            return Err(DecodeError::MalformedPacket(
                "field extends past the remaining length",
            ));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// Everything left.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A Variable Byte Integer, at most 4 bytes, in its shortest form [MQTT-1.5.5-1].
    pub(crate) fn vbi(&mut self) -> Result<usize, DecodeError> {
        let mut value = 0usize;
        for i in 0..4 {
            let b = self.u8()?;
            value |= ((b & 0x7F) as usize) << (7 * i);
            if b & 0x80 == 0 {
                if i > 0 && b == 0 {
                    return Err(DecodeError::MalformedPacket(
                        "variable byte integer not in its shortest form [MQTT-1.5.5-1]",
                    ));
                }
                return Ok(value);
            }
        }
        Err(DecodeError::MalformedPacket(
            "variable byte integer longer than 4 bytes",
        ))
    }

    /// Binary data: a two-byte length then that many bytes (section 1.5.6).
    pub(crate) fn binary(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.u16()? as usize;
        self.take(n)
    }

    /// A UTF-8 Encoded String: well-formed UTF-8 [MQTT-1.5.4-1] without U+0000
    /// [MQTT-1.5.4-2] and, unless read from storage, without the control characters and
    /// non-characters of section 1.5.4, else malformed. Borrowed from the frame.
    pub(crate) fn str(&mut self) -> Result<&'a str, DecodeError> {
        let stored = self.stored;
        utf8_string(self.binary()?, stored)
    }

    /// A PUBLISH Topic Name: as [`Reader::str`], plus whether it is known to hold no wildcard
    /// character, found in the same single pass for the common ASCII case; `false` means
    /// "not looked at", and the caller checks.
    pub(crate) fn topic(&mut self) -> Result<(&'a str, bool), DecodeError> {
        let stored = self.stored;
        let b = self.binary()?;
        if plain_ascii(b, true) {
            return Ok((ascii_str(b), true));
        }
        Ok((utf8_string(b, stored)?, false))
    }

    /// As [`Reader::str`], owned.
    pub(crate) fn string(&mut self) -> Result<String, DecodeError> {
        Ok(self.str()?.to_owned())
    }
}

/// `b` as a UTF-8 Encoded String: well-formed UTF-8 [MQTT-1.5.4-1] without U+0000
/// [MQTT-1.5.4-2], else malformed. Unless `stored`, a control character (U+0001 to U+001F,
/// U+007F to U+009F) or a non-character is malformed too: section 1.5.4 says a string
/// SHOULD NOT hold them and a receiver MAY treat a packet that does as malformed, which
/// mosquitto does.
fn utf8_string(b: &[u8], stored: bool) -> Result<&str, DecodeError> {
    // Fast path, one pass: printable ASCII needs neither the UTF-8 decoder nor a search for
    // U+0000 (which were two passes, and most of the cost of decoding a short topic).
    if plain_ascii(b, false) {
        return Ok(ascii_str(b));
    }
    let s = std::str::from_utf8(b).map_err(|_| {
        DecodeError::MalformedPacket("string is not well-formed UTF-8 [MQTT-1.5.4-1]")
    })?;
    if b.contains(&0) {
        return Err(DecodeError::MalformedPacket(
            "string contains U+0000 [MQTT-1.5.4-2]",
        ));
    }
    if !stored && s.chars().any(discouraged) {
        return Err(DecodeError::MalformedPacket(
            "string contains a control character or a non-character (section 1.5.4)",
        ));
    }
    Ok(s)
}

/// The code points a UTF-8 Encoded String SHOULD NOT hold (section 1.5.4), U+0000 aside:
/// control characters, and the non-characters U+FDD0 to U+FDEF and U+nFFFE / U+nFFFF.
fn discouraged(c: char) -> bool {
    let c = u32::from(c);
    c <= 0x1F
        || (0x7F..=0x9F).contains(&c)
        || (0xFDD0..=0xFDEF).contains(&c)
        || c & 0xFFFE == 0xFFFE
}

/// True when every byte of `b` is printable ASCII (0x20 to 0x7E) and, with `no_wildcards`,
/// none is `+` or `#`. Without early exit, so the loop vectorises.
#[inline]
fn plain_ascii(b: &[u8], no_wildcards: bool) -> bool {
    let mut bad = false;
    for &c in b {
        bad |= (c.wrapping_sub(0x20) >= 0x5F) | (no_wildcards & ((c == b'+') | (c == b'#')));
    }
    !bad
}

/// `b`, which [`plain_ascii`] accepted, as a `str`.
#[inline]
fn ascii_str(b: &[u8]) -> &str {
    debug_assert!(b.is_ascii());
    // SAFETY: `plain_ascii` checked that every byte is below 0x80: ASCII is valid UTF-8.
    unsafe { std::str::from_utf8_unchecked(b) }
}

/// Where encoded bytes go: a `usize` counts them (the sizing pass, which also validates),
/// a `BytesMut` stores them (the writing pass). One body function serves both, so the
/// length written in a header always matches the bytes that follow.
pub(crate) trait Sink {
    fn put_u8(&mut self, v: u8);
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_bytes(&mut self, b: &[u8]);
}

impl Sink for usize {
    #[inline]
    fn put_u8(&mut self, _: u8) {
        *self += 1;
    }
    #[inline]
    fn put_u16(&mut self, _: u16) {
        *self += 2;
    }
    #[inline]
    fn put_u32(&mut self, _: u32) {
        *self += 4;
    }
    #[inline]
    fn put_bytes(&mut self, b: &[u8]) {
        *self += b.len();
    }
}

impl Sink for BytesMut {
    #[inline]
    fn put_u8(&mut self, v: u8) {
        BufMut::put_u8(self, v);
    }
    #[inline]
    fn put_u16(&mut self, v: u16) {
        BufMut::put_u16(self, v);
    }
    #[inline]
    fn put_u32(&mut self, v: u32) {
        BufMut::put_u32(self, v);
    }
    #[inline]
    fn put_bytes(&mut self, b: &[u8]) {
        self.extend_from_slice(b);
    }
}

/// Writes `v` as a Variable Byte Integer in its shortest form.
pub(crate) fn put_vbi<S: Sink>(s: &mut S, v: usize) -> Result<(), EncodeError> {
    if v > MAX_VARIABLE_BYTE_INTEGER {
        return Err(EncodeError::PacketTooLarge { size: v });
    }
    let mut v = v;
    loop {
        let mut b = (v & 0x7F) as u8;
        v >>= 7;
        if v > 0 {
            b |= 0x80;
        }
        s.put_u8(b);
        if v == 0 {
            return Ok(());
        }
    }
}

/// Writes binary data (or a string's bytes) with its two-byte length; never truncates.
pub(crate) fn put_binary<S: Sink>(
    s: &mut S,
    field: &'static str,
    b: &[u8],
) -> Result<(), EncodeError> {
    if b.len() > MAX_STRING_LEN {
        return Err(EncodeError::StringTooLong {
            field,
            len: b.len(),
        });
    }
    s.put_u16(b.len() as u16);
    s.put_bytes(b);
    Ok(())
}

/// Writes a UTF-8 Encoded String with its two-byte length; never truncates.
pub(crate) fn put_str<S: Sink>(s: &mut S, field: &'static str, v: &str) -> Result<(), EncodeError> {
    put_binary(s, field, v.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variable_byte_integer_boundaries_section_1_5_5() {
        for (v, bytes) in [
            (0usize, &[0x00][..]),
            (127, &[0x7F]),
            (128, &[0x80, 0x01]),
            (16_383, &[0xFF, 0x7F]),
            (16_384, &[0x80, 0x80, 0x01]),
            (2_097_151, &[0xFF, 0xFF, 0x7F]),
            (2_097_152, &[0x80, 0x80, 0x80, 0x01]),
            (268_435_455, &[0xFF, 0xFF, 0xFF, 0x7F]),
        ] {
            let mut out = BytesMut::new();
            put_vbi(&mut out, v).unwrap();
            assert_eq!(&out[..], bytes);
            assert_eq!(vbi_len(v), bytes.len());
            let mut n = 0usize;
            put_vbi(&mut n, v).unwrap();
            assert_eq!(n, bytes.len());
            assert_eq!(Reader::new(bytes).vbi(), Ok(v));
        }
        let mut out = BytesMut::new();
        assert!(put_vbi(&mut out, 268_435_456).is_err());
        assert!(out.is_empty());
        assert!(Reader::new(&[0xFF, 0xFF, 0xFF, 0xFF, 0x01]).vbi().is_err());
        assert!(Reader::new(&[0x80, 0x00]).vbi().is_err());
        assert!(Reader::new(&[0x80]).vbi().is_err());
    }

    #[test]
    fn strings_without_control_characters_or_non_characters_unless_stored() {
        for bad in [
            "a\tb",
            "\u{1f}",
            "\u{7f}",
            "\u{80}",
            "\u{9f}",
            "\u{fdd0}",
            "\u{fdef}",
            "\u{fffe}",
            "\u{ffff}",
            "\u{1fffe}",
            "\u{10ffff}",
        ] {
            let mut frame = BytesMut::new();
            put_str(&mut frame, "test", bad).unwrap();
            assert!(Reader::new(&frame).str().is_err(), "{bad:?}");
            assert!(Reader::new(&frame).topic().is_err(), "{bad:?}");
            assert_eq!(Reader::stored(&frame).str(), Ok(bad));
            assert_eq!(
                Reader::new(&frame).sub(frame.len()).unwrap().str().ok(),
                None
            );
            assert_eq!(
                Reader::stored(&frame).sub(frame.len()).unwrap().str(),
                Ok(bad)
            );
        }
        for good in [
            "\u{a0}",
            "\u{fdcf}",
            "\u{fdf0}",
            "\u{fffd}",
            "\u{10000}",
            "\u{10fffd}",
            "\u{e9}t\u{e9}",
        ] {
            let mut frame = BytesMut::new();
            put_str(&mut frame, "test", good).unwrap();
            assert_eq!(Reader::new(&frame).str(), Ok(good));
        }
    }

    #[test]
    fn strings_are_strict_utf8_without_null_mqtt_1_5_4_1_and_2() {
        assert_eq!(Reader::new(b"\x00\x03a\xC3\xA9").str(), Ok("a\u{e9}"));
        assert!(Reader::new(b"\x00\x01\x00").str().is_err());
        assert!(Reader::new(b"\x00\x02\xC0\x80").str().is_err()); // overlong U+0000
        assert!(Reader::new(b"\x00\x05abc").str().is_err()); // short
        assert_eq!(Reader::new(b"\x00\x02 ~").str(), Ok(" ~"));
        let long = "x".repeat(65_536);
        let mut out = BytesMut::new();
        assert!(put_str(&mut out, "topic name", &long).is_err());
        assert!(out.is_empty());
    }
}
