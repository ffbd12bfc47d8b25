//! Load generator for `benches/persistence.sh`: QoS 1 messages into an offline persistent
//! session, then drained. Works against any MQTT 3.1.1 broker.
//!
//! ```text
//! cargo run --release --example persistence_load -- 127.0.0.1:1883 10000 [payload bytes]
//! ```
//!
//! 1. `bench-sub` connects with clean session 0, subscribes to `bench/t` at QoS 1, leaves.
//! 2. `bench-pub` publishes N QoS 1 messages with up to 64 awaiting PUBACK: messages/s in.
//! 3. `bench-sub` comes back and acknowledges every message: messages/s out.
//!
//! Prints one line: `in_msgs_per_s=... out_msgs_per_s=... received=...`.

use std::io::{BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use mercurio::codec::{
    self, Connect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, Subscribe,
    SubscribeFilter, SubscriptionOptions,
};

const V: ProtocolVersion = ProtocolVersion::V311;
const WINDOW: usize = 64;

struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    fn open(addr: SocketAddr, client_id: &str, clean: bool) -> Conn {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).ok();
        let mut c = Conn {
            stream,
            buf: BytesMut::new(),
        };
        c.send(&Packet::Connect(Box::new(Connect {
            protocol: V,
            clean_start: clean,
            keep_alive: 600,
            client_id: client_id.into(),
            will: None,
            username: None,
            password: None,
            properties: Properties::default(),
        })));
        match c.recv() {
            Some(Packet::ConnAck(a)) if !a.reason_code.is_failure() => c,
            other => panic!("CONNACK: {other:?}"),
        }
    }

    fn send(&mut self, p: &Packet) {
        let mut out = BytesMut::new();
        codec::encode(p, V, &mut out).expect("encode");
        self.stream.write_all(&out).expect("write");
    }

    fn recv(&mut self) -> Option<Packet> {
        recv(&mut self.stream, &mut self.buf)
    }

    fn disconnect(mut self) {
        self.send(&Packet::Disconnect(Default::default()));
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        while self.recv().is_some() {}
    }
}

fn recv(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<Packet> {
    loop {
        if let Some(p) = codec::decode(buf, V, 1 << 24).expect("decode") {
            return Some(p);
        }
        let mut chunk = [0u8; 65536];
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let addr: SocketAddr = args
        .next()
        .unwrap_or_else(|| "127.0.0.1:1883".into())
        .parse()
        .expect("address");
    let n: usize = args.next().map_or(10_000, |s| s.parse().expect("count"));
    let size: usize = args
        .next()
        .map_or(64, |s| s.parse().expect("payload bytes"));

    // 1. The persistent session, offline.
    let sub = Conn::open(addr, "bench-sub", true);
    sub.disconnect();
    let mut sub = Conn::open(addr, "bench-sub", false);
    sub.send(&Packet::Subscribe(Subscribe {
        packet_id: 1,
        filters: vec![SubscribeFilter {
            filter: "bench/t".into(),
            options: SubscriptionOptions {
                qos: QoS::AtLeastOnce,
                ..Default::default()
            },
        }],
        properties: Properties::default(),
    }));
    assert!(matches!(sub.recv(), Some(Packet::SubAck(_))));
    sub.disconnect();

    // 2. N QoS 1 messages in, WINDOW awaiting PUBACK.
    let publisher = Conn::open(addr, "bench-pub", true);
    let mut reader = publisher.stream.try_clone().expect("clone");
    let (permits_tx, permits_rx) = mpsc::sync_channel::<()>(WINDOW);
    let acks = std::thread::spawn(move || {
        let mut buf = BytesMut::new();
        let mut acked = 0;
        while acked < n {
            match recv(&mut reader, &mut buf) {
                Some(Packet::PubAck(_)) => {
                    acked += 1;
                    let _ = permits_rx.recv();
                }
                Some(_) => {}
                None => panic!("publisher connection closed after {acked} PUBACKs"),
            }
        }
    });
    let payload = Bytes::from(vec![b'x'; size]);
    let start = Instant::now();
    let mut writer =
        BufWriter::with_capacity(64 * 1024, publisher.stream.try_clone().expect("clone"));
    let mut out = BytesMut::new();
    for i in 0..n {
        if permits_tx.try_send(()).is_err() {
            writer.flush().expect("flush");
            permits_tx.send(()).expect("permit");
        }
        out.clear();
        let id = (i % 65_535 + 1) as u16;
        codec::encode(
            &Packet::Publish(Publish {
                dup: false,
                qos: QoS::AtLeastOnce,
                retain: false,
                topic: "bench/t".into(),
                packet_id: id,
                properties: Properties::default(),
                payload: payload.clone(),
            }),
            V,
            &mut out,
        )
        .expect("encode");
        writer.write_all(&out).expect("write");
    }
    writer.flush().expect("flush");
    acks.join().expect("acks");
    let in_secs = start.elapsed().as_secs_f64();
    drop(writer);
    publisher.disconnect();

    // 3. Drain.
    let start = Instant::now();
    let mut sub = Conn::open(addr, "bench-sub", false);
    let mut writer = BufWriter::with_capacity(64 * 1024, sub.stream.try_clone().expect("clone"));
    let mut received = 0;
    let mut chunk = vec![0u8; 1 << 16];
    'drain: while received < n {
        // Acknowledge everything decoded from one read, in one write.
        loop {
            match codec::decode(&mut sub.buf, V, 1 << 24).expect("decode") {
                Some(Packet::Publish(p)) => {
                    received += 1;
                    out.clear();
                    codec::encode(
                        &Packet::PubAck(PubAck {
                            packet_id: p.packet_id,
                            ..PubAck::default()
                        }),
                        V,
                        &mut out,
                    )
                    .expect("encode");
                    writer.write_all(&out).expect("write");
                }
                Some(_) => {}
                None => break,
            }
        }
        writer.flush().expect("flush");
        if received >= n {
            break;
        }
        match sub.stream.read(&mut chunk) {
            Ok(0) | Err(_) => break 'drain,
            Ok(k) => sub.buf.extend_from_slice(&chunk[..k]),
        }
    }
    let out_secs = start.elapsed().as_secs_f64();
    drop(writer);
    sub.disconnect();
    println!(
        "in_msgs_per_s={:.0} out_msgs_per_s={:.0} received={received}",
        n as f64 / in_secs,
        received as f64 / out_secs
    );
}
