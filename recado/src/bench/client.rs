//! A minimal MQTT client over TCP or TLS, on the shared client's [`Connection`]
//! (`mercurio_codec::client`): connect, subscribe and the handful of packets a load generator
//! needs. Reads go into one large buffer and writes are
//! batched by the callers (one `write_all` per batch), so that the generator is not the
//! bottleneck. Nothing here is specific to any broker.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Buf;
use mercurio_codec::client::{self, ClientError, Connection};
use mercurio_core::codec::{
    ConnAck, Connect, Packet, Properties, ProtocolVersion, QoS, Subscribe, SubscribeFilter,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::source::SourceAddrs;
use crate::stream::Stream;
use crate::tls::Tls;

/// Largest packet the generator accepts from a broker.
pub const MAX_PACKET: u32 = 16 << 20;

/// How long a handshake step (CONNACK, SUBACK) may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where to connect: the broker's address, TLS settings when `--tls`, and the local
/// addresses to connect from when `--source-net`.
#[derive(Clone)]
pub struct Target {
    pub addr: SocketAddr,
    pub tls: Option<Arc<Tls>>,
    pub source: Option<Arc<SourceAddrs>>,
}

/// A connected client: the shared client's [`Connection`] over the stream, and the version.
/// The hot loops take the stream and the bytes read but not yet decoded from it
/// ([`Connection::parts_mut`], [`Connection::into_parts`]) and parse PUBLISH in place.
pub struct Client {
    pub conn: Connection<Stream>,
    pub version: ProtocolVersion,
}

/// What to put in CONNECT.
pub struct ConnectOptions<'a> {
    pub client_id: &'a str,
    pub clean_start: bool,
    pub keep_alive: u16,
    /// 5.0 Session Expiry Interval (ignored in 3.1.1).
    pub session_expiry: u32,
}

fn err(msg: impl Into<String>) -> io::Error {
    io::Error::other(msg.into())
}

/// A client error as the generator reports it.
fn io_err(e: ClientError) -> io::Error {
    match e {
        ClientError::Io(e) => e,
        ClientError::ConnackTimeout(_) => err("no CONNACK in time"),
        ClientError::Closed => err("connection closed before CONNACK"),
        ClientError::Refused { code, .. } => err(format!("CONNACK refused: {code:?}")),
        ClientError::NotConnAck(name) => err(format!("expected CONNACK, got {name}")),
        other => err(other.to_string()),
    }
}

impl Client {
    /// Opens a TCP connection (TCP_NODELAY; from the next address of `target.source` when
    /// set), does the TLS handshake when `target.tls`, sends
    /// CONNECT and waits for a successful CONNACK.
    pub async fn connect(
        target: &Target,
        version: ProtocolVersion,
        opts: &ConnectOptions<'_>,
    ) -> io::Result<(Client, ConnAck)> {
        let tcp = match &target.source {
            None => TcpStream::connect(target.addr).await?,
            Some(source) => {
                let socket = TcpSocket::new_v4()?;
                socket.bind(source.next())?;
                socket.connect(target.addr).await?
            }
        };
        tcp.set_nodelay(true)?;
        let stream = match &target.tls {
            None => Stream::Tcp(tcp),
            Some(tls) => {
                let handshake = tls.connector.connect(tls.server_name.clone(), tcp);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                    Err(_) => return Err(err("no TLS handshake in time")),
                    Ok(Err(e)) => return Err(err(format!("TLS handshake: {e}"))),
                    Ok(Ok(s)) => Stream::Tls(Box::new(s)),
                }
            }
        };
        let mut properties = Properties::default();
        if version.is_v5() {
            if opts.session_expiry > 0 {
                properties.session_expiry_interval = Some(opts.session_expiry);
            }
            properties.receive_maximum = Some(u16::MAX);
            properties.maximum_packet_size = Some(MAX_PACKET);
        }
        let connect = Connect {
            protocol: version,
            clean_start: opts.clean_start,
            keep_alive: opts.keep_alive,
            client_id: opts.client_id.to_string(),
            will: None,
            username: None,
            password: None,
            properties,
        };
        let mut conn = Connection::new(stream, version, MAX_PACKET);
        let options = client::ConnectOptions {
            connack_timeout: HANDSHAKE_TIMEOUT,
            bridge_bit: false,
        };
        let ack = conn
            .connect(&connect, &options)
            .await
            .map_err(io_err)?
            .clone();
        Ok((Client { conn, version }, ack))
    }

    /// Encodes and writes one packet.
    pub async fn send(&mut self, packet: &Packet) -> io::Result<()> {
        self.conn.send(packet).await.map_err(io_err)
    }

    /// Reads the next packet; `None` at end of stream.
    pub async fn recv(&mut self) -> io::Result<Option<Packet>> {
        match self.conn.recv().await {
            Ok(p) => Ok(Some(p)),
            Err(ClientError::Closed) => Ok(None),
            Err(e) => Err(io_err(e)),
        }
    }

    /// Subscribes to `filters` at `qos` and waits for a SUBACK granting every one.
    pub async fn subscribe(&mut self, filters: &[String], qos: QoS) -> io::Result<()> {
        let sub = Subscribe {
            packet_id: 1,
            filters: filters
                .iter()
                .map(|f| SubscribeFilter::new(f.as_str(), qos))
                .collect(),
            properties: Properties::default(),
        };
        self.send(&Packet::Subscribe(sub)).await?;
        let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
        loop {
            match tokio::time::timeout_at(deadline, self.recv()).await {
                Err(_) => return Err(err("no SUBACK in time")),
                Ok(Ok(Some(Packet::SubAck(ack)))) => {
                    if ack.reason_codes.iter().any(|c| c.0 >= 0x80) {
                        return Err(err(format!("SUBSCRIBE refused: {:?}", ack.reason_codes)));
                    }
                    return Ok(());
                }
                // A persistent session may deliver queued messages before the SUBACK; the
                // persistent scenario subscribes before anything is published, so none here.
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) => return Err(err("connection closed before SUBACK")),
                Ok(Err(e)) => return Err(e),
            }
        }
    }

    /// Sends DISCONNECT and waits, up to 2 s, for the broker to close the connection (the
    /// server closes it on DISCONNECT, MQTT 3.1.1 section 3.14.4) before closing this side.
    /// The side that closes first holds the connection in TIME_WAIT for a minute; were it the
    /// generator, thousands of its local ports would stay taken and slow down the connects of
    /// the next run (the next broker's), which is not what a benchmark compares.
    pub async fn disconnect(mut self) -> io::Result<()> {
        self.send(&Packet::Disconnect(Default::default())).await?;
        let (stream, _) = self.conn.parts_mut();
        let mut scratch = [0u8; 256];
        let broker_closed = async {
            while let Ok(n) = stream.read(&mut scratch).await {
                if n == 0 {
                    break;
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(2), broker_closed)
            .await
            .is_err()
        {
            let (stream, _) = self.conn.parts_mut();
            stream.shutdown().await?;
        }
        Ok(())
    }
}

/// A PUBLISH parsed in place (no allocation): what the subscriber's hot path needs.
pub struct PublishView<'a> {
    pub qos: u8,
    pub packet_id: u16,
    pub payload: &'a [u8],
}

/// Parses the PUBLISH in `frame` (a whole frame, fixed header included) without copying.
/// `None` if it is not a well-formed PUBLISH.
pub fn parse_publish(frame: &[u8], version: ProtocolVersion) -> Option<PublishView<'_>> {
    let first = *frame.first()?;
    if first >> 4 != 3 {
        return None;
    }
    let qos = (first >> 1) & 3;
    // Skip the remaining length.
    let mut i = 1;
    while frame.get(i)? & 0x80 != 0 {
        i += 1;
    }
    i += 1;
    let mut body = frame.get(i..)?;
    if body.len() < 2 {
        return None;
    }
    let topic_len = body.get_u16() as usize;
    body = body.get(topic_len..)?;
    let mut packet_id = 0;
    if qos > 0 {
        if body.len() < 2 {
            return None;
        }
        packet_id = body.get_u16();
    }
    if version.is_v5() {
        // Property length (Variable Byte Integer), then skip the properties.
        let mut len = 0usize;
        let mut shift = 0;
        loop {
            let b = *body.first()?;
            body = &body[1..];
            len |= ((b & 0x7F) as usize) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 21 {
                return None;
            }
        }
        body = body.get(len..)?;
    }
    Some(PublishView {
        qos,
        packet_id,
        payload: body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{Bytes, BytesMut};
    use mercurio_core::codec::{self, Publish};

    #[test]
    fn parse_publish_matches_the_codec() {
        for version in [ProtocolVersion::V311, ProtocolVersion::V5] {
            for qos in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce] {
                let mut properties = Properties::default();
                if version.is_v5() {
                    properties.user_properties.push(("k".into(), "v".into()));
                }
                let p = Publish {
                    dup: false,
                    qos,
                    retain: false,
                    topic: "a/b".into(),
                    packet_id: if qos == QoS::AtMostOnce { 0 } else { 77 },
                    properties,
                    payload: Bytes::from(vec![9u8; 300]),
                };
                let mut buf = BytesMut::new();
                codec::encode(&Packet::Publish(p.clone()), version, &mut buf).unwrap();
                let v = parse_publish(&buf, version).expect("parses");
                assert_eq!(v.qos, qos as u8);
                assert_eq!(v.packet_id, p.packet_id);
                assert_eq!(v.payload, &p.payload[..]);
            }
        }
    }
}
