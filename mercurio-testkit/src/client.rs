//! A blocking MQTT client on the shared client's [`Connection`] (`mercurio_codec::client`),
//! driven by a runtime of its own (used by the tests that restart daemons: persistence,
//! standby). The tests see every packet: nothing is acknowledged for them. Every wait ends by
//! [`DEADLINE`].

use std::net::{SocketAddr, TcpStream};

use bytes::Bytes;
use mercurio_codec::client::{ClientError, ConnectOptions, Connection, MAX_PACKET};
use mercurio_core::codec::{
    Connect, Packet, Properties, PubAck, Publish, QoS, ReasonCode, Subscribe, SubscribeFilter,
};
use tokio::runtime::Runtime;

use crate::DEADLINE;

/// Largest packet accepted from the broker, in bytes.
const MAX_INCOMING: u32 = 1 << 20;

/// One MQTT connection; its methods panic on what a test does not expect.
pub struct Client {
    /// The connection's socket (the same one the client reads and writes, in non-blocking
    /// mode): shutting it down from another thread ends a [`Client::recv`] there.
    pub stream: TcpStream,
    conn: Connection<tokio::net::TcpStream>,
    runtime: Runtime,
    next_id: u16,
}

impl Client {
    /// Connects with `connect` and checks the CONNACK; returns the client and Session Present.
    pub fn connect(addr: SocketAddr, connect: Connect) -> (Client, bool) {
        match Client::try_connect(addr, connect) {
            Ok(c) => c,
            Err(code) => panic!("CONNACK {code:?}"),
        }
    }

    /// Connects with `connect`: the client and Session Present, or the reason code of a
    /// refusing CONNACK.
    pub fn try_connect(addr: SocketAddr, connect: Connect) -> Result<(Client, bool), ReasonCode> {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).ok();
        stream.set_nonblocking(true).expect("non-blocking socket");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let io = {
            let _entered = runtime.enter();
            tokio::net::TcpStream::from_std(stream.try_clone().expect("clone the socket"))
                .expect("register the socket")
        };
        let mut conn = Connection::new(io, connect.protocol, MAX_INCOMING.min(MAX_PACKET));
        let options = ConnectOptions {
            connack_timeout: DEADLINE,
            bridge_bit: false,
        };
        let session_present = match runtime.block_on(conn.connect(&connect, &options)) {
            Ok(ack) => ack.session_present,
            Err(ClientError::Refused { code, .. }) => return Err(code),
            Err(e) => panic!("expected CONNACK, got {e}"),
        };
        let c = Client {
            stream,
            conn,
            runtime,
            next_id: 1,
        };
        Ok((c, session_present))
    }

    /// Writes one packet.
    pub fn send(&mut self, p: Packet) {
        self.runtime.block_on(self.conn.send(&p)).expect("write");
    }

    /// Writes one packet; `false` when the connection is gone (its broker killed, say).
    pub fn try_send(&mut self, p: Packet) -> bool {
        self.runtime.block_on(self.conn.send(&p)).is_ok()
    }

    /// The next packet; `None` when the connection closed.
    pub fn recv(&mut self) -> Option<Packet> {
        let conn = &mut self.conn;
        let read = self
            .runtime
            .block_on(async { tokio::time::timeout(DEADLINE, conn.recv()).await });
        match read {
            Err(_) => panic!("no packet before the deadline"),
            Ok(Ok(p)) => Some(p),
            Ok(Err(ClientError::Decode { error, .. })) => panic!("decode: {error}"),
            Ok(Err(_)) => None,
        }
    }

    /// The next packet within `wait`: `None` when nothing came in that time (a broker
    /// stalled, or nothing more to read), `Some(None)` when the connection closed.
    pub fn recv_within(&mut self, wait: std::time::Duration) -> Option<Option<Packet>> {
        let conn = &mut self.conn;
        let read = self
            .runtime
            .block_on(async { tokio::time::timeout(wait, conn.recv()).await });
        match read {
            Err(_) => None,
            Ok(Ok(p)) => Some(Some(p)),
            Ok(Err(ClientError::Decode { error, .. })) => panic!("decode: {error}"),
            Ok(Err(_)) => Some(None),
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
            filters: vec![SubscribeFilter::new(filter, qos)],
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
