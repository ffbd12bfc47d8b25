//! Fuzzes the decoder: any bytes, for each protocol version, never panic; whatever decodes
//! re-encodes, and the re-encoding decodes to the same packets.
//!
//! Run with `cargo +nightly fuzz run decode fuzz/corpus/decode` from the repository root.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use mercurio_core::codec::{decode, encode, ProtocolVersion};

fuzz_target!(|data: &[u8]| {
    for version in [
        ProtocolVersion::V31,
        ProtocolVersion::V311,
        ProtocolVersion::V5,
    ] {
        let mut buf = BytesMut::from(data);
        while let Ok(Some(packet)) = decode(&mut buf, version, 1 << 20) {
            // A CONNECT is encoded and decoded in its own version.
            let mut out = BytesMut::new();
            encode(&packet, version, &mut out).expect("a decoded packet re-encodes");
            let again = decode(&mut out, version, u32::MAX)
                .expect("the re-encoding decodes")
                .expect("the re-encoding is whole");
            assert_eq!(again, packet);
            assert!(out.is_empty());
        }
    }
});
