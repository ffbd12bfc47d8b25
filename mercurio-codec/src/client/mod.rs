//! An async MQTT 3.1 / 3.1.1 / 5.0 client on the codec (feature `client`).
//!
//! Two levels, over any [`Transport`] (every `AsyncRead + AsyncWrite + Unpin + Send` stream
//! is one):
//!
//! - [`Connection`]: CONNECT / CONNACK, packets sent and received whole, the keep alive; the
//!   caller answers what it receives (for callers that keep acknowledgement state elsewhere,
//!   as the broker's bridges do in their sessions, or tests that check each packet);
//! - [`Client`]: a whole client session on a connection: packet identifiers, QoS 1 and 2
//!   acknowledgements in both directions answered automatically, the in-flight window of the
//!   server's Receive Maximum, Topic Aliases received, SUBSCRIBE / UNSUBSCRIBE, DISCONNECT;
//!   what the caller sees are [`Event`]s.
//!
//! Session state lives as long as the [`Client`]: a new connection starts a new one.

#![warn(missing_docs)]

mod connection;
mod error;
#[cfg(feature = "websocket")]
mod websocket;

use std::collections::{HashMap, HashSet};

pub use connection::{
    encode_connect, ConnectOptions, Connection, Direction, Transport, CONNACK_TIMEOUT, MAX_PACKET,
};
pub use error::ClientError;
#[cfg(feature = "websocket")]
pub use websocket::WebSocket;

use crate::codec::{
    ConnAck, Connect, Disconnect, Packet, Properties, ProtocolVersion, PubAck, Publish, QoS,
    ReasonCode, SubAck, Subscribe, SubscribeFilter, UnsubAck, Unsubscribe,
};

/// What the server sent that the application acts on; the rest (PINGRESP, the steps of the
/// QoS 2 handshakes) the [`Client`] answers itself.
#[derive(Debug)]
pub enum Event {
    /// An application message, its topic restored if it came with a Topic Alias (MQTT 5.0
    /// section 3.3.2.3.4), already acknowledged (PUBACK, or PUBREC for QoS 2). A QoS 2
    /// message sent again before its PUBREL is not delivered twice.
    Publish(Publish),
    /// A QoS 1 or 2 message this client published is done, and its packet identifier free
    /// again: PUBACK (QoS 1), PUBCOMP (QoS 2), or a PUBREC with a failure reason code (QoS 2
    /// ends there, MQTT 5.0 section 4.3.3).
    Published {
        /// The PUBLISH's packet identifier.
        packet_id: u16,
        /// The acknowledgement's reason code (0 Success in 3.x).
        reason: ReasonCode,
    },
    /// The answer to a SUBSCRIBE ([`Client::subscribe`]).
    SubAck(SubAck),
    /// The answer to an UNSUBSCRIBE ([`Client::unsubscribe`]).
    UnsubAck(UnsubAck),
}

/// A connected MQTT client: see the [module](self) documentation.
pub struct Client<T> {
    conn: Connection<T>,
    client_id: String,
    next_id: u16,
    /// QoS 1 and 2 PUBLISH sent, not yet done (MQTT 5.0 section 4.9).
    in_flight: HashSet<u16>,
    /// Topic Aliases the server set (MQTT 5.0 section 3.3.2.3.4).
    aliases: HashMap<u16, String>,
    /// QoS 2 messages received, PUBREC sent, PUBREL not yet.
    qos2_in: HashSet<u16>,
}

impl<T: Transport> Client<T> {
    /// Connects over `conn` (made with [`Connection::new`], observed or not) with `connect`
    /// (MQTT 5.0 section 3.1: clean start, Session Expiry Interval, keep alive, will,
    /// username and password are its fields) and waits for CONNACK.
    ///
    /// # Errors
    ///
    /// Those of [`Connection::connect`].
    pub async fn connect(
        mut conn: Connection<T>,
        connect: &Connect,
        options: &ConnectOptions,
    ) -> Result<Client<T>, ClientError> {
        let ack = conn.connect(connect, options).await?;
        let client_id = ack
            .properties
            .assigned_client_identifier
            .clone()
            .unwrap_or_else(|| connect.client_id.clone());
        Ok(Client {
            conn,
            client_id,
            next_id: 0,
            in_flight: HashSet::new(),
            aliases: HashMap::new(),
            qos2_in: HashSet::new(),
        })
    }

    /// The connection underneath.
    pub fn connection(&mut self) -> &mut Connection<T> {
        &mut self.conn
    }

    /// The protocol version.
    pub fn version(&self) -> ProtocolVersion {
        self.conn.version()
    }

    /// The server's CONNACK.
    pub fn connack(&self) -> &ConnAck {
        self.conn.connack()
    }

    /// The client identifier: the one sent, or the one the server assigned (5.0).
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// The server's Receive Maximum (65,535 when it says nothing).
    pub fn receive_maximum(&self) -> u16 {
        self.conn.receive_maximum()
    }

    /// The server's Maximum QoS (2 when it says nothing, MQTT 5.0 section 3.2.2.3.4).
    pub fn maximum_qos(&self) -> u8 {
        self.connack().properties.maximum_qos.unwrap_or(2)
    }

    /// Whether a whole packet from the server is already read, so that [`Client::next`]
    /// handles it without a read (see [`Connection::packet_buffered`]).
    pub fn packet_buffered(&self) -> bool {
        self.conn.packet_buffered()
    }

    /// How many QoS 1 and 2 messages published await their acknowledgement.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The next free packet identifier: 1 to 65,535, never 0 [MQTT-2.2.1-3], none of the
    /// messages in flight.
    pub fn next_packet_id(&mut self) -> u16 {
        loop {
            self.next_id = self.next_id.wrapping_add(1).max(1);
            if !self.in_flight.contains(&self.next_id) {
                return self.next_id;
            }
        }
    }

    /// Sends any packet as it is (no identifier allocated, nothing tracked).
    ///
    /// # Errors
    ///
    /// Those of [`Connection::send`].
    pub async fn send(&mut self, packet: &Packet) -> Result<(), ClientError> {
        self.conn.send(packet).await
    }

    /// Publishes `publish` (MQTT 5.0 section 3.3). At QoS 1 and 2 its packet identifier is
    /// allocated here (whatever it held) and returned; the message is in flight until
    /// [`Event::Published`] says it is done. At QoS 0 the identifier is 0.
    ///
    /// # Errors
    ///
    /// [`ClientError::WindowFull`] when as many messages are in flight as the server's
    /// Receive Maximum allows (nothing sent); those of [`Connection::send`].
    pub async fn publish(&mut self, mut publish: Publish) -> Result<u16, ClientError> {
        if publish.qos == QoS::AtMostOnce {
            publish.packet_id = 0;
        } else {
            if self.in_flight.len() >= usize::from(self.receive_maximum()) {
                return Err(ClientError::WindowFull(self.in_flight.len()));
            }
            publish.packet_id = self.next_packet_id();
        }
        let id = publish.packet_id;
        self.conn.send(&Packet::Publish(publish)).await?;
        if id != 0 {
            self.in_flight.insert(id);
        }
        Ok(id)
    }

    /// Sends SUBSCRIBE (MQTT 5.0 section 3.8) with a new packet identifier, returned; its
    /// SUBACK comes as [`Event::SubAck`].
    ///
    /// # Errors
    ///
    /// Those of [`Connection::send`].
    pub async fn subscribe(
        &mut self,
        filters: Vec<SubscribeFilter>,
        properties: Properties,
    ) -> Result<u16, ClientError> {
        self.send_with_id(|packet_id| {
            Packet::Subscribe(Subscribe {
                packet_id,
                filters,
                properties,
            })
        })
        .await
    }

    /// Sends UNSUBSCRIBE (MQTT 5.0 section 3.10) with a new packet identifier, returned; its
    /// UNSUBACK comes as [`Event::UnsubAck`].
    ///
    /// # Errors
    ///
    /// Those of [`Connection::send`].
    pub async fn unsubscribe(
        &mut self,
        filters: Vec<String>,
        properties: Properties,
    ) -> Result<u16, ClientError> {
        let unsubscribe = |packet_id| {
            let packet = Unsubscribe {
                packet_id,
                filters,
                properties,
            };
            Packet::Unsubscribe(packet)
        };
        self.send_with_id(unsubscribe).await
    }

    /// Sends the packet `make` builds around a new packet identifier; returns the identifier.
    async fn send_with_id(&mut self, make: impl FnOnce(u16) -> Packet) -> Result<u16, ClientError> {
        let packet_id = self.next_packet_id();
        self.conn.send(&make(packet_id)).await?;
        Ok(packet_id)
    }

    /// Sends DISCONNECT with `reason` and `properties` (5.0; 3.x sends neither, MQTT 5.0
    /// section 3.14) and closes the transport.
    ///
    /// # Errors
    ///
    /// Those of [`Connection::send`]; the transport is closed either way.
    pub async fn disconnect(
        &mut self,
        reason: ReasonCode,
        properties: Properties,
    ) -> Result<(), ClientError> {
        let sent = self
            .conn
            .send(&Packet::Disconnect(Disconnect {
                reason_code: reason,
                properties,
            }))
            .await;
        self.conn.close().await;
        sent
    }

    /// Waits for the next [`Event`], answering PINGRESP, PUBREC, PUBREL and the
    /// acknowledgement of received messages meanwhile, and pinging for the keep alive. A
    /// received message's acknowledgement is written before its event is returned, in one
    /// write with those of the other packets of the same read (it waits, queued, while a
    /// packet of that read is still to be handed over). Cancel safe between packets.
    ///
    /// # Errors
    ///
    /// Those of [`Connection::recv_keeping_alive`]; [`ClientError::Disconnected`] for a
    /// DISCONNECT from the server; [`ClientError::UnknownTopicAlias`];
    /// [`ClientError::UnexpectedAuth`]; [`ClientError::UnexpectedPacket`] for a packet only
    /// clients send.
    pub async fn next(&mut self) -> Result<Event, ClientError> {
        loop {
            let packet = self.conn.recv_keeping_alive().await?;
            if let Some(event) = self.handle(packet)? {
                // The acknowledgements of the packets of one read go out in one write: here
                // when no other packet is buffered, else when the last one is handed over.
                // The server thus gets them together and refills its window in one write
                // (each on its own cost a write on both sides per message).
                if !self.conn.packet_buffered() {
                    self.conn.flush().await?;
                }
                return Ok(event);
            }
        }
    }

    /// Queues an acknowledgement step (written by [`Client::next`]).
    fn ack(&mut self, make: fn(PubAck) -> Packet, packet_id: u16) -> Result<(), ClientError> {
        self.conn.queue(&make(PubAck {
            packet_id,
            ..PubAck::default()
        }))
    }

    fn handle(&mut self, packet: Packet) -> Result<Option<Event>, ClientError> {
        match packet {
            Packet::PingResp => Ok(None),
            Packet::Publish(mut p) => {
                if let Some(alias) = p.properties.topic_alias {
                    if p.topic.is_empty() {
                        match self.aliases.get(&alias) {
                            Some(t) => p.topic = t.clone(),
                            None => return Err(ClientError::UnknownTopicAlias(alias)),
                        }
                    } else {
                        self.aliases.insert(alias, p.topic.clone());
                    }
                }
                match p.qos {
                    QoS::AtMostOnce => Ok(Some(Event::Publish(p))),
                    QoS::AtLeastOnce => {
                        self.ack(Packet::PubAck, p.packet_id)?;
                        Ok(Some(Event::Publish(p)))
                    }
                    QoS::ExactlyOnce => {
                        let first = self.qos2_in.insert(p.packet_id);
                        self.ack(Packet::PubRec, p.packet_id)?;
                        Ok(first.then_some(Event::Publish(p)))
                    }
                }
            }
            Packet::PubRel(rel) => {
                self.qos2_in.remove(&rel.packet_id);
                self.ack(Packet::PubComp, rel.packet_id)?;
                Ok(None)
            }
            Packet::PubAck(ack) | Packet::PubComp(ack) => Ok(self.done(ack)),
            Packet::PubRec(rec) => {
                if rec.reason_code.is_failure() {
                    return Ok(self.done(rec));
                }
                self.ack(Packet::PubRel, rec.packet_id)?;
                Ok(None)
            }
            Packet::SubAck(a) => Ok(Some(Event::SubAck(a))),
            Packet::UnsubAck(a) => Ok(Some(Event::UnsubAck(a))),
            Packet::Disconnect(d) => Err(ClientError::Disconnected {
                reason: d.reason_code,
                reason_string: d.properties.reason_string,
            }),
            Packet::Auth(_) => Err(ClientError::UnexpectedAuth),
            other => Err(ClientError::UnexpectedPacket(other.name())),
        }
    }

    /// The end of an outgoing QoS 1 or 2 flow; an acknowledgement of no message in flight
    /// is dropped.
    fn done(&mut self, ack: PubAck) -> Option<Event> {
        self.in_flight
            .remove(&ack.packet_id)
            .then_some(Event::Published {
                packet_id: ack.packet_id,
                reason: ack.reason_code,
            })
    }
}

#[cfg(test)]
mod tests {
    use bytes::{Bytes, BytesMut};
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use super::*;
    use crate::codec;

    const V5: ProtocolVersion = ProtocolVersion::V5;

    fn connect_packet() -> Connect {
        Connect::new(V5, "c")
    }

    /// The server's side: reads one packet, writes packets.
    struct Server {
        io: DuplexStream,
        buf: BytesMut,
    }

    impl Server {
        async fn recv(&mut self) -> Packet {
            loop {
                if let Some(p) = codec::decode(&mut self.buf, V5, MAX_PACKET).unwrap() {
                    return p;
                }
                assert!(self.io.read_buf(&mut self.buf).await.unwrap() > 0);
            }
        }

        async fn send(&mut self, p: Packet) {
            let mut out = BytesMut::new();
            codec::encode(&p, V5, &mut out).unwrap();
            self.io.write_all(&out).await.unwrap();
        }
    }

    async fn connected(receive_maximum: u16) -> (Client<DuplexStream>, Server) {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut server = Server {
            io: b,
            buf: BytesMut::new(),
        };
        let conn = Connection::new(a, V5, MAX_PACKET);
        let connect = connect_packet();
        let options = ConnectOptions::default();
        let client = Client::connect(conn, &connect, &options);
        let serve = async {
            assert!(matches!(server.recv().await, Packet::Connect(_)));
            let mut ack = ConnAck::default();
            ack.properties.receive_maximum = Some(receive_maximum);
            ack.properties.assigned_client_identifier = Some("given".into());
            server.send(Packet::ConnAck(ack)).await;
        };
        let (client, ()) = tokio::join!(client, serve);
        (client.unwrap(), server)
    }

    fn publish(qos: QoS, packet_id: u16) -> Publish {
        Publish {
            dup: false,
            qos,
            retain: false,
            topic: "t".into(),
            packet_id,
            properties: Properties::default(),
            payload: Bytes::from_static(b"x"),
        }
    }

    #[tokio::test]
    async fn publish_in_a_window_and_acknowledge_both_ways() {
        let (mut client, mut server) = connected(1).await;
        assert_eq!(client.client_id(), "given");
        let id = client.publish(publish(QoS::ExactlyOnce, 0)).await.unwrap();
        assert!(matches!(
            client.publish(publish(QoS::AtLeastOnce, 0)).await,
            Err(ClientError::WindowFull(1))
        ));
        assert!(matches!(server.recv().await, Packet::Publish(p) if p.packet_id == id));
        server
            .send(Packet::PubRec(PubAck {
                packet_id: id,
                ..PubAck::default()
            }))
            .await;
        // A QoS 2 message from the server, sent twice before its PUBREL: delivered once.
        server
            .send(Packet::Publish(publish(QoS::ExactlyOnce, 7)))
            .await;
        server
            .send(Packet::Publish(publish(QoS::ExactlyOnce, 7)))
            .await;
        server
            .send(Packet::PubComp(PubAck {
                packet_id: id,
                ..PubAck::default()
            }))
            .await;
        assert!(matches!(client.next().await, Ok(Event::Publish(p)) if p.packet_id == 7));
        assert!(matches!(
            client.next().await,
            Ok(Event::Published { packet_id, reason }) if packet_id == id && reason == ReasonCode::SUCCESS
        ));
        assert_eq!(client.in_flight(), 0);
        assert!(matches!(server.recv().await, Packet::PubRel(a) if a.packet_id == id));
        assert!(matches!(server.recv().await, Packet::PubRec(a) if a.packet_id == 7));
        assert!(matches!(server.recv().await, Packet::PubRec(a) if a.packet_id == 7));
    }

    /// Whether the server can read a byte now, without waiting (a zero timeout polls its
    /// read once; a byte read is lost, and the test fails then anyway).
    async fn readable_now(server: &mut Server) -> bool {
        let mut probe = [0u8; 1];
        let read = tokio::time::timeout(std::time::Duration::ZERO, server.io.read(&mut probe));
        read.await.is_ok()
    }

    #[tokio::test]
    async fn the_acknowledgements_of_one_read_go_out_together() {
        let (mut client, mut server) = connected(10).await;
        // Three QoS 1 messages in one write: the client's first read takes them all.
        let mut out = BytesMut::new();
        for id in 1..=3 {
            codec::encode(
                &Packet::Publish(publish(QoS::AtLeastOnce, id)),
                V5,
                &mut out,
            )
            .unwrap();
        }
        server.io.write_all(&out).await.unwrap();
        for id in 1..=2 {
            assert!(matches!(client.next().await, Ok(Event::Publish(p)) if p.packet_id == id));
            // Its PUBACK waits for those of the rest of the read.
            assert!(
                !readable_now(&mut server).await,
                "PUBACK {id} written alone"
            );
        }
        // The last one of the read: all three are written before it is handed over, without
        // the client reading again.
        assert!(matches!(client.next().await, Ok(Event::Publish(p)) if p.packet_id == 3));
        for id in 1..=3 {
            assert!(matches!(server.recv().await, Packet::PubAck(a) if a.packet_id == id));
        }
    }

    #[tokio::test]
    async fn a_malformed_packet_is_a_typed_error() {
        let (mut client, mut server) = connected(10).await;
        // PUBACK with a remaining length of 1: too short for its packet identifier.
        server.io.write_all(&[0x40, 0x01, 0x00]).await.unwrap();
        assert!(matches!(
            client.next().await,
            Err(ClientError::Decode {
                first_byte: Some(0x40),
                ..
            })
        ));
    }

    #[tokio::test]
    async fn a_refusal_and_a_3_1_1_answer_to_5_0() {
        for (bytes, version, code) in [
            (&[0x20, 0x03, 0x00, 0x87, 0x00][..], V5, 0x87),
            (&[0x20, 0x02, 0x00, 0x01][..], ProtocolVersion::V311, 1),
        ] {
            let (a, mut b) = tokio::io::duplex(1 << 16);
            b.write_all(bytes).await.unwrap();
            let mut conn = Connection::new(a, V5, MAX_PACKET);
            let e = conn
                .connect(&connect_packet(), &ConnectOptions::default())
                .await
                .err();
            assert!(
                matches!(&e, Some(ClientError::Refused { code: c, version: v, .. }) if c.0 == code && *v == version),
                "{e:?}"
            );
        }
    }
}
