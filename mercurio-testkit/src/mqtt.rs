//! A raw MQTT connection, for tests that check bytes on the wire: packets encoded by the
//! shared codec (`mercurio_core::codec`), or written by hand by the test, and read back as
//! bytes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use bytes::{Bytes, BytesMut};
use mercurio_core::codec::{
    self, Connect, Packet, Properties, ProtocolVersion, Publish, QoS, Subscribe, SubscribeFilter,
};

use crate::DEADLINE;

/// A raw MQTT connection to 127.0.0.1.
pub struct Mqtt(pub TcpStream);

/// The protocol of a protocol level: 3 (3.1), 4 (3.1.1) or 5.
fn version(level: u8) -> ProtocolVersion {
    match level {
        3 => ProtocolVersion::V31,
        4 => ProtocolVersion::V311,
        5 => ProtocolVersion::V5,
        _ => panic!("protocol level {level}: 3, 4 or 5"),
    }
}

/// The bytes of `packet` in `version`.
fn encoded(packet: Packet, version: ProtocolVersion) -> Vec<u8> {
    let mut out = BytesMut::new();
    codec::encode(&packet, version, &mut out).expect("encode");
    out.to_vec()
}

/// A 3.1.1 PUBLISH of `payload` to `topic` at `qos` 0 or 1 (packet identifier `id`, unused
/// at QoS 0), as bytes for [`Mqtt::send`].
pub fn publish_packet(topic: &str, qos: u8, id: u16, payload: &[u8]) -> Vec<u8> {
    let qos = QoS::from_u8(qos).expect("QoS 0, 1 or 2");
    let publish = Publish {
        dup: false,
        qos,
        retain: false,
        topic: topic.into(),
        packet_id: if qos == QoS::AtMostOnce { 0 } else { id },
        properties: Properties::default(),
        payload: Bytes::copy_from_slice(payload),
    };
    encoded(Packet::Publish(publish), ProtocolVersion::V311)
}

impl Mqtt {
    /// Connects to `port` of 127.0.0.1: [`Mqtt::connect_to`].
    pub fn connect(port: u16, level: u8, client_id: &str, clean: bool) -> Mqtt {
        Mqtt::connect_to(
            SocketAddr::from(([127, 0, 0, 1], port)),
            level,
            client_id,
            clean,
        )
    }

    /// Connects with protocol level 3 (3.1, "MQIsdp"), 4 (3.1.1) or 5, clean start or not,
    /// keep alive 60 s (5.0 without clean start: Session Expiry Interval 3600 s); checks
    /// CONNACK 0.
    pub fn connect_to(addr: SocketAddr, level: u8, client_id: &str, clean: bool) -> Mqtt {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(DEADLINE)).expect("timeout");
        let mut mqtt = Mqtt(stream);
        let mut connect = Connect::new(version(level), client_id);
        connect.clean_start = clean;
        connect.keep_alive = 60;
        if level == 5 && !clean {
            connect.properties.session_expiry_interval = Some(3600);
        }
        mqtt.send(&encoded(Packet::Connect(Box::new(connect)), version(level)));
        let (kind, body) = mqtt.read().expect("CONNACK before the close");
        assert_eq!(kind, 0x20, "CONNACK expected, got {kind:#x} {body:?}");
        assert_eq!(body[1], 0, "CONNACK code for {client_id}: {body:?}");
        mqtt
    }

    /// Writes `bytes`.
    pub fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).expect("write");
    }

    /// Subscribes (packet id 1) and waits for SUBACK.
    pub fn subscribe(&mut self, level: u8, filter: &str, qos: u8) {
        let subscribe = Subscribe {
            packet_id: 1,
            filters: vec![SubscribeFilter::new(
                filter,
                QoS::from_u8(qos).expect("QoS 0, 1 or 2"),
            )],
            properties: Properties::default(),
        };
        self.send(&encoded(Packet::Subscribe(subscribe), version(level)));
        let (kind, _) = self.read().expect("SUBACK");
        assert_eq!(kind, 0x90, "SUBACK expected");
    }

    /// DISCONNECT (normal), then close.
    pub fn disconnect(mut self) {
        self.send(&[0xe0, 0]);
    }

    /// The next packet's first byte and body; `None` when the connection is closed (end of
    /// stream or reset) before it. Panics when nothing comes within [`DEADLINE`].
    pub fn read(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut first = [0u8; 1];
        match crate::uninterrupted(|| self.0.read(&mut first)) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!("read: {e}"),
        }
        let mut len = 0usize;
        let mut shift = 0;
        loop {
            let mut b = [0u8; 1];
            self.0.read_exact(&mut b).expect("remaining length");
            len |= usize::from(b[0] & 0x7f) << shift;
            shift += 7;
            if b[0] & 0x80 == 0 {
                break;
            }
        }
        let mut body = vec![0; len];
        self.0.read_exact(&mut body).expect("packet body");
        Some((first[0], body))
    }
}
