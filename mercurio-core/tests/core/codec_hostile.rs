//! Property tests of the decoder against hostile input, on stable Rust (the cargo-fuzz target
//! in `fuzz/` explores further on machines with a nightly toolchain):
//!
//! - random bytes never panic, in any version, and whatever decodes re-encodes to itself;
//! - "incomplete" and "malformed" are never confused: a buffer that is not a whole frame is
//!   `Ok(None)` and left untouched; a whole frame is a packet or an error, and its bytes are
//!   consumed either way;
//! - a valid packet cut short or padded inside a frame that announces the new length is a
//!   packet that round trips or an error, never "incomplete" and never a panic.

use crate::codec_support;

use bytes::BytesMut;
use codec_support::*;
use mercurio_core::codec::*;
use proptest::prelude::*;

const MAX: u32 = 268_435_460;

/// Writes a frame: `first` byte, remaining length (shortest form), `body`.
fn frame(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    let mut n = body.len();
    loop {
        let mut b = (n & 0x7F) as u8;
        n >>= 7;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(body);
    out
}

/// The length of the fixed header at the start of a valid frame.
fn header_len(frame: &[u8]) -> usize {
    1 + frame[1..].iter().take_while(|&&b| b & 0x80 != 0).count() + 1
}

/// Decodes everything in `data` as `v` and checks the decoder's contract at each step;
/// returns how many packets decoded.
fn check_contract(data: &[u8], v: ProtocolVersion) -> Result<usize, TestCaseError> {
    let mut buf = BytesMut::from(data);
    let mut decoded = 0;
    loop {
        let before = buf.clone();
        let whole = check_frame(&before, MAX);
        match decode(&mut buf, v, MAX) {
            Ok(None) => {
                // Incomplete: nothing consumed, and the fixed header said so.
                prop_assert_eq!(&buf[..], &before[..]);
                prop_assert_eq!(whole, Ok(None));
                return Ok(decoded);
            }
            Ok(Some(p)) => {
                decoded += 1;
                let Ok(Some(total)) = whole else {
                    return Err(TestCaseError::fail("decoded without a whole frame"));
                };
                prop_assert_eq!(buf.len(), before.len() - total);
                // What decodes re-encodes to a packet that decodes to itself.
                let mut out = BytesMut::new();
                encode(&p, v, &mut out)
                    .map_err(|e| TestCaseError::fail(format!("re-encoding {p:?}: {e}")))?;
                prop_assert_eq!(decode(&mut out, v, MAX), Ok(Some(p)));
                prop_assert!(out.is_empty());
            }
            Err(_) => {
                // An error only for a whole frame (its bytes consumed) or a bad fixed header.
                match whole {
                    Ok(Some(total)) => prop_assert_eq!(buf.len(), before.len() - total),
                    Ok(None) => return Err(TestCaseError::fail("error on an incomplete frame")),
                    Err(_) => {}
                }
                return Ok(decoded);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn random_bytes_never_panic(v in version(), data in prop::collection::vec(any::<u8>(), 0..300)) {
        check_contract(&data, v)?;
    }

    #[test]
    fn random_bodies_behind_a_valid_fixed_header_never_panic(
        v in version(),
        first in any::<u8>(),
        body in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        // Past check_frame, so every parser of every packet type sees hostile bytes.
        check_contract(&frame(first, &body), v)?;
    }

    #[test]
    fn a_valid_packet_cut_short_is_a_packet_or_an_error_never_incomplete(
        (v, p) in versioned_packet(),
        cut in any::<prop::sample::Index>(),
    ) {
        let wire = enc(&p, v);
        let h = header_len(&wire);
        let body = &wire[h..];
        let keep = cut.index(body.len() + 1);
        let short = frame(wire[0], &body[..keep]);
        prop_assert_eq!(check_frame(&short, MAX), Ok(Some(short.len())));
        check_contract(&short, v)?;
    }

    #[test]
    fn a_valid_packet_with_trailing_bytes_is_a_packet_or_an_error(
        (v, p) in versioned_packet(),
        extra in prop::collection::vec(any::<u8>(), 1..16),
    ) {
        let wire = enc(&p, v);
        let h = header_len(&wire);
        let mut body = wire[h..].to_vec();
        body.extend_from_slice(&extra);
        check_contract(&frame(wire[0], &body), v)?;
    }

    #[test]
    fn a_truncated_stream_is_incomplete_then_decodes_when_the_rest_arrives(
        (v, p) in versioned_packet(),
        cut in any::<prop::sample::Index>(),
    ) {
        let wire = enc(&p, v);
        let n = cut.index(wire.len());
        let mut buf = BytesMut::from(&wire[..n]);
        prop_assert_eq!(decode(&mut buf, v, MAX), Ok(None));
        prop_assert_eq!(buf.len(), n);
        buf.extend_from_slice(&wire[n..]);
        prop_assert_eq!(decode(&mut buf, v, MAX), Ok(Some(p)));
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn a_frame_over_the_maximum_is_refused_before_its_body(
        (v, p) in versioned_packet(),
    ) {
        let wire = enc(&p, v);
        let h = header_len(&wire);
        let max = (wire.len() - 1) as u32;
        // Only the fixed header has arrived: too large already, the body is never awaited.
        let mut buf = BytesMut::from(&wire[..h]);
        let refused = matches!(decode(&mut buf, v, max), Err(DecodeError::PacketTooLarge { .. }));
        prop_assert!(refused);
    }
}
