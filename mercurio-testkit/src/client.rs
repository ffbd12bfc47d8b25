//! A blocking MQTT client on the broker's codec (used by the tests that restart daemons:
//! persistence, standby). Every wait ends by [`DEADLINE`].

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use mercurio_core::codec::{
    self, Connect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS, Subscribe,
    SubscribeFilter, SubscriptionOptions,
};

use crate::DEADLINE;

/// One MQTT connection; its methods panic on what a test does not expect.
pub struct Client {
    /// The connection.
    pub stream: TcpStream,
    version: ProtocolVersion,
    buf: BytesMut,
    next_id: u16,
}

impl Client {
    /// Connects with `connect` and checks the CONNACK; returns the client and Session Present.
    pub fn connect(addr: SocketAddr, connect: Connect) -> (Client, bool) {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).ok();
        let mut c = Client {
            stream,
            version: connect.protocol,
            buf: BytesMut::new(),
            next_id: 1,
        };
        c.send(Packet::Connect(Box::new(connect)));
        match c.recv() {
            Some(Packet::ConnAck(a)) => {
                assert!(!a.reason_code.is_failure(), "CONNACK {:?}", a.reason_code);
                (c, a.session_present)
            }
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    /// Writes one packet.
    pub fn send(&mut self, p: Packet) {
        let mut out = BytesMut::new();
        codec::encode(&p, self.version, &mut out).expect("encode");
        self.stream.write_all(&out).expect("write");
    }

    /// The next packet; `None` when the connection closed.
    pub fn recv(&mut self) -> Option<Packet> {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(p) = codec::decode(&mut self.buf, self.version, 1 << 20).expect("decode") {
                return Some(p);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no packet before the deadline");
            self.stream.set_read_timeout(Some(left)).ok();
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Writes a PUBLISH with the next packet identifier (none for QoS 0) and returns it,
    /// without waiting for its acknowledgement.
    pub fn publish_packet(&mut self, topic: &str, payload: &[u8], qos: QoS, retain: bool) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        self.send(Packet::Publish(Publish {
            dup: false,
            qos,
            retain,
            topic: topic.into(),
            packet_id: if qos == QoS::AtMostOnce { 0 } else { id },
            properties: Properties::default(),
            payload: Bytes::copy_from_slice(payload),
        }));
        id
    }

    /// Publishes and completes the acknowledgement flow.
    pub fn publish(&mut self, topic: &str, payload: &[u8], qos: QoS, retain: bool) {
        let id = self.publish_packet(topic, payload, qos, retain);
        match qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => {
                assert!(matches!(self.recv(), Some(Packet::PubAck(a)) if a.packet_id == id))
            }
            QoS::ExactlyOnce => {
                assert!(matches!(self.recv(), Some(Packet::PubRec(a)) if a.packet_id == id));
                self.send(Packet::PubRel(PubAck {
                    packet_id: id,
                    ..PubAck::default()
                }));
                assert!(matches!(self.recv(), Some(Packet::PubComp(a)) if a.packet_id == id));
            }
        }
    }

    /// Subscribes (packet identifier 1) and waits for the SUBACK.
    pub fn subscribe(&mut self, filter: &str, qos: QoS) {
        self.send(Packet::Subscribe(Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter {
                filter: filter.into(),
                options: SubscriptionOptions {
                    qos,
                    ..Default::default()
                },
            }],
            properties: Properties::default(),
        }));
        assert!(matches!(self.recv(), Some(Packet::SubAck(_))));
    }

    /// The next packet, which must be a PUBLISH.
    pub fn expect_publish(&mut self) -> Publish {
        match self.recv() {
            Some(Packet::Publish(p)) => p,
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }

    /// Acknowledges a received PUBLISH (PUBACK, or PUBREC, PUBREL, PUBCOMP).
    pub fn ack(&mut self, p: &Publish) {
        match p.qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => self.send(Packet::PubAck(PubAck {
                packet_id: p.packet_id,
                ..PubAck::default()
            })),
            QoS::ExactlyOnce => {
                self.send(Packet::PubRec(PubAck {
                    packet_id: p.packet_id,
                    ..PubAck::default()
                }));
                assert!(matches!(self.recv(), Some(Packet::PubRel(_))));
                self.send(Packet::PubComp(PubAck {
                    packet_id: p.packet_id,
                    ..PubAck::default()
                }));
            }
        }
    }

    /// A PINGREQ round trip: everything sent before is handled.
    pub fn settle(&mut self) {
        self.send(Packet::PingReq);
        loop {
            match self.recv() {
                Some(Packet::PingResp) => return,
                Some(_) => {}
                None => panic!("closed"),
            }
        }
    }

    /// DISCONNECT, then waits for the broker to close the connection.
    pub fn disconnect(mut self) {
        self.send(Packet::Disconnect(Default::default()));
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let _ = self.recv();
    }
}
