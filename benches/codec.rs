//! Codec micro-benchmarks: decode and encode of PUBLISH (64 B and 4 KiB payloads, MQTT 3.1.1
//! and 5.0 with properties) and of CONNECT.
//!
//! Run: `cargo bench --bench codec` (see docs/BENCHMARKS.md).

use bytes::{Bytes, BytesMut};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mercurio::codec::{self, Connect, LastWill, Packet, Properties, ProtocolVersion, Publish, QoS};

/// The properties a typical MQTT 5.0 publisher sends: content type, message expiry,
/// correlation data, response topic and two user properties.
fn publish_properties() -> Properties {
    Properties {
        payload_format_indicator: Some(0),
        message_expiry_interval: Some(3600),
        content_type: Some("application/octet-stream".into()),
        response_topic: Some("replies/device-0042".into()),
        correlation_data: Some(Bytes::from_static(b"0123456789abcdef")),
        user_properties: vec![
            ("tenant".into(), "acme".into()),
            ("trace-id".into(), "4bf92f3577b34da6a3ce929d0e0e4736".into()),
        ],
        ..Properties::default()
    }
}

fn publish(version: ProtocolVersion, payload_len: usize) -> Publish {
    Publish {
        dup: false,
        qos: QoS::AtLeastOnce,
        retain: false,
        topic: "site/berlin/building-7/floor-3/sensor-0042/temperature".into(),
        packet_id: 4242,
        properties: if version.is_v5() {
            publish_properties()
        } else {
            Properties::default()
        },
        payload: Bytes::from(vec![0xA5; payload_len]),
    }
}

fn connect(version: ProtocolVersion) -> Connect {
    let v5 = version.is_v5();
    Connect {
        protocol: version,
        clean_start: false,
        keep_alive: 60,
        client_id: "sensor-0042-5f3c9a".into(),
        will: Some(LastWill {
            topic: "site/berlin/building-7/status/sensor-0042".into(),
            payload: Bytes::from_static(b"offline"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: if v5 {
                Properties {
                    will_delay_interval: Some(30),
                    content_type: Some("text/plain".into()),
                    ..Properties::default()
                }
            } else {
                Properties::default()
            },
        }),
        username: Some("sensor-0042".into()),
        password: Some(Bytes::from_static(b"correct horse battery staple")),
        properties: if v5 {
            Properties {
                session_expiry_interval: Some(3600),
                receive_maximum: Some(100),
                maximum_packet_size: Some(1 << 20),
                topic_alias_maximum: Some(16),
                user_properties: vec![("fw".into(), "2.4.1".into())],
                ..Properties::default()
            }
        } else {
            Properties::default()
        },
    }
}

fn name(version: ProtocolVersion) -> &'static str {
    match version {
        ProtocolVersion::V31 => "3.1",
        ProtocolVersion::V311 => "3.1.1",
        ProtocolVersion::V5 => "5.0",
    }
}

fn encoded(packet: &Packet, version: ProtocolVersion) -> BytesMut {
    let mut buf = BytesMut::new();
    codec::encode(packet, version, &mut buf).expect("encodes");
    buf
}

fn bench_publish(c: &mut Criterion) {
    for (what, payload) in [("64B", 64usize), ("4KiB", 4096)] {
        let mut decode = c.benchmark_group(format!("publish_decode_{what}"));
        for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
            let frame = encoded(&Packet::Publish(publish(version, payload)), version).freeze();
            decode.throughput(Throughput::Bytes(frame.len() as u64));
            decode.bench_with_input(
                BenchmarkId::from_parameter(name(version)),
                &frame,
                |b, f| b.iter(|| codec::decode_packet(black_box(f), version).expect("decodes")),
            );
        }
        decode.finish();

        let mut encode = c.benchmark_group(format!("publish_encode_{what}"));
        for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
            let p = publish(version, payload);
            let r = codec::publish_ref(&p);
            let mut out = BytesMut::with_capacity(8192);
            encode.throughput(Throughput::Bytes(
                codec::publish_encoded_len(&r, version) as u64
            ));
            encode.bench_function(BenchmarkId::from_parameter(name(version)), |b| {
                b.iter(|| {
                    out.clear();
                    codec::encode_publish(black_box(&r), version, &mut out).expect("encodes");
                    black_box(out.len())
                })
            });
        }
        encode.finish();
    }
}

fn bench_connect(c: &mut Criterion) {
    let mut decode = c.benchmark_group("connect_decode");
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let frame = encoded(&Packet::Connect(Box::new(connect(version))), version).freeze();
        decode.throughput(Throughput::Bytes(frame.len() as u64));
        decode.bench_with_input(
            BenchmarkId::from_parameter(name(version)),
            &frame,
            |b, f| {
                b.iter(|| {
                    codec::decode_packet(black_box(f), ProtocolVersion::V311).expect("decodes")
                })
            },
        );
    }
    decode.finish();

    let mut encode = c.benchmark_group("connect_encode");
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let packet = Packet::Connect(Box::new(connect(version)));
        let mut out = BytesMut::with_capacity(1024);
        encode.bench_function(BenchmarkId::from_parameter(name(version)), |b| {
            b.iter(|| {
                out.clear();
                codec::encode(black_box(&packet), version, &mut out).expect("encodes");
                black_box(out.len())
            })
        });
    }
    encode.finish();
}

/// Incremental decoding of a read buffer holding many 64 B PUBLISHes back to back, as a
/// connection's reader sees them (frame check, parse, advance).
fn bench_stream(c: &mut Criterion) {
    let mut group = c.benchmark_group("publish_stream_decode_64B");
    for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
        let mut stream = BytesMut::new();
        let packet = Packet::Publish(publish(version, 64));
        for _ in 0..256 {
            codec::encode(&packet, version, &mut stream).expect("encodes");
        }
        let stream = stream.freeze();
        group.throughput(Throughput::Elements(256));
        group.bench_function(BenchmarkId::from_parameter(name(version)), |b| {
            b.iter(|| {
                let mut buf = BytesMut::from(&stream[..]);
                let mut n = 0;
                while let Some(p) = codec::decode(&mut buf, version, 1 << 20).expect("decodes") {
                    black_box(p);
                    n += 1;
                }
                n
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_publish, bench_connect, bench_stream);
criterion_main!(benches);
