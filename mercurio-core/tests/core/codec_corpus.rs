//! The fuzz seed corpus (`fuzz/corpus/decode/`) decodes, and the fuzz target's property
//! (decoded packets re-encode and decode to themselves) holds on it and on its mutations,
//! so the invariant is checked without a nightly toolchain.

use bytes::BytesMut;
use mercurio_core::codec::*;

fn property(data: &[u8]) -> usize {
    let mut decoded = 0;
    for version in [
        ProtocolVersion::V31,
        ProtocolVersion::V311,
        ProtocolVersion::V5,
    ] {
        let mut buf = BytesMut::from(data);
        while let Ok(Some(packet)) = decode(&mut buf, version, 1 << 20) {
            decoded += 1;
            let mut out = BytesMut::new();
            encode(&packet, version, &mut out).expect("a decoded packet re-encodes");
            let again = decode(&mut out, version, u32::MAX)
                .expect("the re-encoding decodes")
                .expect("the re-encoding is whole");
            assert_eq!(again, packet);
            assert!(out.is_empty());
        }
    }
    decoded
}

fn corpus() -> Vec<(String, Vec<u8>)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus/decode");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("corpus directory")
        .map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect();
    files.sort();
    files
}

#[test]
fn every_seed_decodes_in_some_version_and_round_trips() {
    let files = corpus();
    assert!(files.len() >= 12);
    for (name, data) in files {
        let v5 = if name.contains("v5") {
            ProtocolVersion::V5
        } else {
            ProtocolVersion::V311
        };
        let mut buf = BytesMut::from(&data[..]);
        while !buf.is_empty() {
            decode(&mut buf, v5, 1 << 20)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .unwrap_or_else(|| panic!("{name}: incomplete"));
        }
        assert!(property(&data) > 0, "{name}");
    }
}

#[test]
fn mutated_seeds_never_panic_and_keep_the_round_trip_property() {
    // A deterministic stand-in for the fuzzer: flip, drop and truncate bytes of every seed.
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for (_, seed) in corpus() {
        for _ in 0..2000 {
            let mut data = seed.clone();
            for _ in 0..(next() % 4 + 1) {
                if data.is_empty() {
                    break;
                }
                let i = (next() as usize) % data.len();
                match next() % 4 {
                    0 => data[i] ^= 1 << (next() % 8),
                    1 => data[i] = next() as u8,
                    2 => {
                        data.remove(i);
                    }
                    _ => data.truncate(i),
                }
            }
            property(&data);
        }
    }
}
