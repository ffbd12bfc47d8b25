//! A few MQTT packets written by hand, for tests that check bytes on the wire.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use crate::DEADLINE;

/// A raw MQTT connection to 127.0.0.1.
pub struct Mqtt(pub TcpStream);

fn with_length(first: u8, body: &[u8]) -> Vec<u8> {
    let mut packet = vec![first];
    let mut n = body.len();
    loop {
        let mut byte = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            byte |= 0x80;
        }
        packet.push(byte);
        if n == 0 {
            break;
        }
    }
    packet.extend_from_slice(body);
    packet
}

fn string(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u16).to_be_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// A 3.1.1 PUBLISH of `payload` to `topic` at `qos` 0 or 1 (packet identifier `id`, unused
/// at QoS 0), as bytes for [`Mqtt::send`].
pub fn publish_packet(topic: &str, qos: u8, id: u16, payload: &[u8]) -> Vec<u8> {
    let mut body = string(topic);
    if qos > 0 {
        body.extend_from_slice(&id.to_be_bytes());
    }
    body.extend_from_slice(payload);
    with_length(0x30 | (qos << 1), &body)
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
        let mut body = string(if level == 3 { "MQIsdp" } else { "MQTT" });
        body.push(level);
        body.push(if clean { 0x02 } else { 0x00 });
        body.extend_from_slice(&60u16.to_be_bytes());
        if level == 5 {
            if clean {
                body.push(0);
            } else {
                // Session Expiry Interval: 3600 s.
                body.extend_from_slice(&[5, 0x11, 0, 0, 0x0e, 0x10]);
            }
        }
        body.extend_from_slice(&string(client_id));
        mqtt.send(&with_length(0x10, &body));
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
        let mut body = 1u16.to_be_bytes().to_vec();
        if level == 5 {
            body.push(0);
        }
        body.extend_from_slice(&string(filter));
        body.push(qos);
        self.send(&with_length(0x82, &body));
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
        match self.0.read(&mut first) {
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
