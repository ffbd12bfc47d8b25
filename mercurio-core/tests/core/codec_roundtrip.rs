//! Round trips: every valid packet of every version encodes, decodes to itself, decodes the
//! same when fed byte by byte, and `publish_encoded_len` matches what `encode_publish` writes.

use crate::codec_support;

use bytes::BytesMut;
use codec_support::*;
use mercurio_core::codec::*;
use proptest::prelude::*;

const MAX: u32 = 268_435_460;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn every_packet_round_trips((v, p) in versioned_packet()) {
        let mut buf = enc(&p, v);
        let frame = buf.clone();
        prop_assert_eq!(check_frame(&frame, MAX), Ok(Some(frame.len())));
        prop_assert_eq!(decode_packet(&frame, v), Ok(p.clone()));
        prop_assert_eq!(decode(&mut buf, v, MAX), Ok(Some(p)));
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn byte_by_byte_decoding_gives_the_same_packets(
        (v, ps) in version().prop_flat_map(|v| (Just(v), proptest::collection::vec(packet(v), 1..5)))
    ) {
        let mut wire = BytesMut::new();
        for p in &ps {
            encode(p, v, &mut wire).unwrap();
        }
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for &b in wire.iter() {
            buf.extend_from_slice(&[b]);
            // Never an error before completion; Some exactly when a packet is complete.
            while let Some(p) = decode(&mut buf, v, MAX).unwrap() {
                got.push(p);
            }
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, ps);
    }

    #[test]
    fn publish_encoded_len_is_exact(p in version().prop_flat_map(|v| (Just(v), publish(v)))) {
        let (v, p) = p;
        let Packet::Publish(p) = p else { unreachable!() };
        let r = PublishRef {
            dup: p.dup,
            qos: p.qos,
            retain: p.retain,
            topic: &p.topic,
            packet_id: p.packet_id,
            properties: &p.properties,
            payload: &p.payload,
        };
        let mut out = BytesMut::from(&b"prefix"[..]);
        encode_publish(&r, v, &mut out).unwrap();
        prop_assert_eq!(out.len() - 6, publish_encoded_len(&r, v));
        prop_assert_eq!(&out[..6], b"prefix");
        prop_assert_eq!(decode_packet(&out[6..], v), Ok(Packet::Publish(p)));
    }

    #[test]
    fn stored_properties_round_trip(p in prop_oneof![
        props(Place::Publish), props(Place::Will), props(Place::ConnAck), props(Place::Connect)
    ]) {
        let mut out = BytesMut::new();
        encode_properties(&p, &mut out).unwrap();
        prop_assert_eq!(decode_properties(&out), Ok(p));
    }

    #[test]
    fn incomplete_frames_are_never_errors((v, p) in versioned_packet()) {
        let buf = enc(&p, v);
        for n in 0..buf.len() {
            prop_assert_eq!(check_frame(&buf[..n], MAX), Ok(None));
        }
    }
}
