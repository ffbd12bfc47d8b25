//! One MQTT connection from the client side: the CONNECT / CONNACK handshake, packets
//! encoded and decoded whole over any [`Transport`], and the keep alive.

use std::future::Future;
use std::io;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use super::error::ClientError;
use crate::codec::{self, ConnAck, Connect, Packet, ProtocolVersion, ReasonCode};

/// The largest packet MQTT allows, in bytes (fixed header of 5 bytes included): what a
/// connection accepts when its CONNECT sets no Maximum Packet Size.
pub const MAX_PACKET: u32 = 268_435_460;

/// How long [`Connection::connect`] waits for CONNACK unless told otherwise: 10 seconds.
pub const CONNACK_TIMEOUT: Duration = Duration::from_secs(10);

/// A byte stream to the server. Every `AsyncRead + AsyncWrite + Unpin + Send` type is one
/// (TCP, TLS, a `Box<dyn ...>` of either); a transport that frames bytes itself (MQTT over
/// WebSocket, one packet a binary message) implements it directly.
pub trait Transport: Send {
    /// Reads more bytes, appending them to `buf`; `Ok(0)` at the end of the stream. Must be
    /// cancel safe: when the future is dropped before it completes, no byte is lost.
    fn read_into(&mut self, buf: &mut BytesMut) -> impl Future<Output = io::Result<usize>> + Send;

    /// Writes all of `bytes` and flushes them.
    fn write_flush(&mut self, bytes: &[u8]) -> impl Future<Output = io::Result<()>> + Send;

    /// Closes the stream politely (TCP FIN, TLS close_notify, WebSocket Close); errors are
    /// ignored, the connection is over either way.
    fn close(&mut self) -> impl Future<Output = ()> + Send;
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> Transport for S {
    async fn read_into(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        AsyncReadExt::read_buf(self, buf).await
    }

    async fn write_flush(&mut self, bytes: &[u8]) -> io::Result<()> {
        AsyncWriteExt::write_all(self, bytes).await?;
        AsyncWriteExt::flush(self).await
    }

    async fn close(&mut self) {
        let _ = AsyncWriteExt::shutdown(self).await;
    }
}

/// Which way a packet went, for [`Connection::on_packet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Sent to the server.
    Sent,
    /// Received from the server.
    Received,
}

/// What [`Connection::connect`] does besides sending the CONNECT it is given.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// How long to wait for CONNACK after CONNECT is written. Default [`CONNACK_TIMEOUT`].
    pub connack_timeout: Duration,
    /// Set the 0x80 bit of the protocol level in CONNECT: the convention by which a
    /// mosquitto-style bridge tells the server it is a bridge. Default `false`.
    pub bridge_bit: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            connack_timeout: CONNACK_TIMEOUT,
            bridge_bit: false,
        }
    }
}

/// A watcher of every packet sent and received (a debug trace).
type Observer = Box<dyn FnMut(Direction, &Packet) + Send>;

/// One MQTT connection to a server, at the packet level: the caller decides what to send and
/// answers what it receives (acknowledgements are not automatic here; see
/// [`Client`](super::Client) for that). Packets are decoded strictly: a malformed one is a
/// [`ClientError::Decode`], never a panic.
pub struct Connection<T> {
    transport: T,
    rbuf: BytesMut,
    out: BytesMut,
    version: ProtocolVersion,
    max_incoming: u32,
    connack: ConnAck,
    keep_alive: Option<Duration>,
    last_sent: Instant,
    ping_sent: Option<Instant>,
    observer: Option<Observer>,
}

impl<T: Transport> Connection<T> {
    /// A connection over `transport`, before CONNECT: packets are of `version`, and none
    /// larger than `max_incoming` bytes (fixed header included) is accepted from the server
    /// (a larger one is refused from its fixed header, before its body is read).
    pub fn new(transport: T, version: ProtocolVersion, max_incoming: u32) -> Self {
        Connection {
            transport,
            rbuf: BytesMut::with_capacity(8192),
            out: BytesMut::with_capacity(256),
            version,
            max_incoming,
            connack: ConnAck::default(),
            keep_alive: None,
            last_sent: Instant::now(),
            ping_sent: None,
            observer: None,
        }
    }

    /// Calls `observer` with every packet sent or received from now on (CONNECT and CONNACK
    /// included when set before [`Connection::connect`]).
    pub fn on_packet(&mut self, observer: impl FnMut(Direction, &Packet) + Send + 'static) {
        self.observer = Some(Box::new(observer));
    }

    /// Sends `connect` and waits for a successful CONNACK (MQTT 5.0 sections 3.1 and 3.2).
    /// Its protocol version must be the connection's. The keep alive becomes that of
    /// `connect`, or the server's Server Keep Alive when its CONNACK has one
    /// [MQTT-3.2.2-21]. The CONNACK is kept: [`Connection::connack`].
    ///
    /// # Errors
    ///
    /// [`ClientError::ConnackTimeout`] after `options.connack_timeout`;
    /// [`ClientError::Refused`] for a CONNACK with a failure code (also for a 3.1.1 server
    /// refusing a 5.0 CONNECT with return code 1); [`ClientError::NotConnAck`] for another
    /// packet; [`ClientError::Closed`], [`ClientError::Io`], [`ClientError::Decode`] or
    /// [`ClientError::Encode`] otherwise.
    pub async fn connect(
        &mut self,
        connect: &Connect,
        options: &ConnectOptions,
    ) -> Result<&ConnAck, ClientError> {
        let packet = Packet::Connect(Box::new(connect.clone()));
        encode_connect(&packet, self.version, options, &mut self.out)?;
        self.observe(Direction::Sent, &packet);
        self.flush().await?;
        self.keep_alive =
            (connect.keep_alive > 0).then(|| Duration::from_secs(connect.keep_alive.into()));
        let timeout = options.connack_timeout;
        let ack = match tokio::time::timeout(timeout, self.read_connack()).await {
            Ok(r) => r?,
            Err(_) => return Err(ClientError::ConnackTimeout(timeout.as_secs())),
        };
        if ack.reason_code != ReasonCode::SUCCESS {
            return Err(ClientError::Refused {
                code: ack.reason_code,
                version: self.version,
                reason_string: ack.properties.reason_string,
            });
        }
        if let Some(ka) = ack.properties.server_keep_alive {
            self.keep_alive = (ka > 0).then(|| Duration::from_secs(ka.into()));
        }
        self.connack = ack;
        Ok(&self.connack)
    }

    /// The CONNACK. A server without MQTT 5 answers a 5.0 CONNECT with the 3.1.1 CONNACK
    /// 20 02 00 01, which is no valid 5.0 CONNACK: it is the refusal it means.
    async fn read_connack(&mut self) -> Result<ConnAck, ClientError> {
        if self.version.is_v5() {
            while self.rbuf.len() < 4 {
                self.read_more().await?;
            }
            if self.rbuf[..4] == [0x20, 0x02, 0x00, 0x01] {
                return Err(ClientError::Refused {
                    code: ReasonCode(1),
                    version: ProtocolVersion::V311,
                    reason_string: None,
                });
            }
        }
        match self.recv().await? {
            Packet::ConnAck(ack) => Ok(ack),
            other => Err(ClientError::NotConnAck(other.name())),
        }
    }

    /// The protocol version of the connection.
    pub fn version(&self) -> ProtocolVersion {
        self.version
    }

    /// The server's CONNACK (the default one before [`Connection::connect`]).
    pub fn connack(&self) -> &ConnAck {
        &self.connack
    }

    /// The keep alive in force: `None` when off.
    pub fn keep_alive(&self) -> Option<Duration> {
        self.keep_alive
    }

    /// The server's Receive Maximum: how many QoS 1 and 2 PUBLISH may await their
    /// acknowledgement at once (65,535 when its CONNACK says nothing, MQTT 5.0 section
    /// 3.2.2.3.3).
    pub fn receive_maximum(&self) -> u16 {
        self.connack.properties.receive_maximum.unwrap_or(u16::MAX)
    }

    /// The server's Maximum Packet Size in bytes (no limit when its CONNACK says nothing,
    /// MQTT 5.0 section 3.2.2.3.6).
    pub fn maximum_packet_size(&self) -> usize {
        self.connack
            .properties
            .maximum_packet_size
            .map_or(usize::MAX, |m| m as usize)
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport and the bytes read from it but not yet decoded, for a caller that
    /// parses and writes on its own for a while (a load generator's hot loop). What it reads
    /// must be appended to the buffer and what it takes out removed from its front; what it
    /// writes does not count for the keep alive.
    pub fn parts_mut(&mut self) -> (&mut T, &mut BytesMut) {
        (&mut self.transport, &mut self.rbuf)
    }

    /// The transport and the bytes read from it but not yet decoded, the connection ended
    /// (for instance to split the transport into halves).
    pub fn into_parts(self) -> (T, BytesMut) {
        (self.transport, self.rbuf)
    }

    fn observe(&mut self, direction: Direction, packet: &Packet) {
        if let Some(f) = &mut self.observer {
            f(direction, packet);
        }
    }

    /// Encodes `packet` after what is already queued, without writing it: see
    /// [`Connection::flush`].
    ///
    /// # Errors
    ///
    /// [`ClientError::Encode`]; nothing is queued then.
    pub fn queue(&mut self, packet: &Packet) -> Result<(), ClientError> {
        codec::encode(packet, self.version, &mut self.out)
            .map_err(|e| ClientError::encode(packet.name(), e))?;
        self.observe(Direction::Sent, packet);
        Ok(())
    }

    /// Writes what is queued, whole.
    ///
    /// # Errors
    ///
    /// [`ClientError::Io`]; what was queued is dropped.
    pub async fn flush(&mut self) -> Result<(), ClientError> {
        if self.out.is_empty() {
            return Ok(());
        }
        let r = self.transport.write_flush(&self.out).await;
        self.out.clear();
        r?;
        self.last_sent = Instant::now();
        Ok(())
    }

    /// Encodes and writes one packet: [`Connection::queue`], then [`Connection::flush`].
    ///
    /// # Errors
    ///
    /// Those of both.
    pub async fn send(&mut self, packet: &Packet) -> Result<(), ClientError> {
        self.queue(packet)?;
        self.flush().await
    }

    /// Writes packets already encoded for this connection's version, whole. The bytes are
    /// not checked: a test may write a malformed packet through here on purpose.
    ///
    /// # Errors
    ///
    /// [`ClientError::Io`].
    pub async fn write_encoded(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        self.transport.write_flush(bytes).await?;
        self.last_sent = Instant::now();
        Ok(())
    }

    /// The next packet already buffered, if any (no read).
    ///
    /// # Errors
    ///
    /// [`ClientError::Decode`] for a malformed or too large packet.
    pub fn buffered(&mut self) -> Result<Option<Packet>, ClientError> {
        let first_byte = self.rbuf.first().copied();
        match codec::decode(&mut self.rbuf, self.version, self.max_incoming) {
            Ok(Some(p)) => {
                if matches!(p, Packet::PingResp) {
                    self.ping_sent = None;
                }
                self.observe(Direction::Received, &p);
                Ok(Some(p))
            }
            Ok(None) => Ok(None),
            Err(error) => Err(ClientError::Decode { error, first_byte }),
        }
    }

    /// Whether a whole packet is buffered, so that [`Connection::buffered`] returns one
    /// without a read (a malformed or too large one counts: decoding it is what fails).
    pub fn packet_buffered(&self) -> bool {
        !matches!(codec::check_frame(&self.rbuf, self.max_incoming), Ok(None))
    }

    async fn read_more(&mut self) -> Result<(), ClientError> {
        match self.transport.read_into(&mut self.rbuf).await? {
            0 => Err(ClientError::Closed),
            _ => Ok(()),
        }
    }

    /// The next whole packet, without keep alive (see [`Connection::recv_keeping_alive`]).
    /// What is queued ([`Connection::queue`]) is written before it waits for bytes. Cancel
    /// safe: bytes read stay buffered.
    ///
    /// # Errors
    ///
    /// [`ClientError::Closed`], [`ClientError::Io`] or [`ClientError::Decode`].
    pub async fn recv(&mut self) -> Result<Packet, ClientError> {
        loop {
            if let Some(p) = self.buffered()? {
                return Ok(p);
            }
            self.flush().await?;
            self.read_more().await?;
        }
    }

    /// The next whole packet, sending PINGREQ when nothing was sent for the keep alive
    /// (MQTT 5.0 section 3.1.2.10). PINGRESP is returned like any packet. What is queued
    /// ([`Connection::queue`]) is written before it waits for bytes. Cancel safe.
    ///
    /// # Errors
    ///
    /// Those of [`Connection::recv`], and [`ClientError::KeepAliveTimeout`] when a PINGREQ
    /// is unanswered for a keep alive period.
    pub async fn recv_keeping_alive(&mut self) -> Result<Packet, ClientError> {
        loop {
            if let Some(p) = self.buffered()? {
                return Ok(p);
            }
            self.flush().await?;
            let deadline = self.keep_alive.map(|ka| match self.ping_sent {
                Some(sent) => sent + ka,
                None => self.last_sent + ka,
            });
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            let read = tokio::select! {
                read = self.transport.read_into(&mut self.rbuf) => Some(read),
                () = sleep => None,
            };
            match read {
                Some(Ok(0)) => return Err(ClientError::Closed),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => {
                    if self.ping_sent.is_some() {
                        return Err(ClientError::KeepAliveTimeout);
                    }
                    self.send(&Packet::PingReq).await?;
                    self.ping_sent = Some(Instant::now());
                }
            }
        }
    }

    /// Closes the transport (after a DISCONNECT the caller sent, or without one).
    pub async fn close(&mut self) {
        self.transport.close().await;
    }
}

/// Encodes `connect` (a [`Packet::Connect`]) for `version` after what `out` holds, as
/// [`Connection::connect`] sends it: with the bridge bit when `options.bridge_bit`.
///
/// # Errors
///
/// [`ClientError::Encode`]; `out` is left as it was.
pub fn encode_connect(
    connect: &Packet,
    version: ProtocolVersion,
    options: &ConnectOptions,
    out: &mut BytesMut,
) -> Result<(), ClientError> {
    let start = out.len();
    codec::encode(connect, version, out).map_err(|e| ClientError::encode(connect.name(), e))?;
    if options.bridge_bit {
        set_bridge_bit(&mut out[start..]);
    }
    Ok(())
}

/// Sets the 0x80 bit of the protocol level of an encoded CONNECT: after the fixed header
/// (type byte, remaining length) and the protocol name ("MQTT" or "MQIsdp").
fn set_bridge_bit(connect: &mut [u8]) {
    let mut i = 1;
    while i < connect.len() && connect[i] & 0x80 != 0 {
        i += 1;
    }
    // The protocol name's two-byte length follows the fixed header.
    let name_at = i + 1;
    let name_len = match connect.get(name_at..name_at + 2) {
        Some(&[hi, lo]) => usize::from(u16::from_be_bytes([hi, lo])),
        _ => return,
    };
    if let Some(b) = connect.get_mut(name_at + 2 + name_len) {
        *b |= 0x80;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bridge_bit_is_on_the_protocol_level() {
        for (version, at) in [(ProtocolVersion::V311, 8), (ProtocolVersion::V31, 10)] {
            let mut out = BytesMut::new();
            let connect = Connect::new(version, "b");
            codec::encode(&Packet::Connect(Box::new(connect)), version, &mut out).unwrap();
            let level = out[at];
            set_bridge_bit(&mut out);
            assert_eq!(out[at], level | 0x80);
        }
    }
}
