//! Opening the connection (TCP, TLS, WebSocket over either) and moving MQTT bytes over it.

use std::time::Duration;

use bytes::BytesMut;
use mercurio_codec::client::{Transport as _, WebSocket};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

use crate::exit::{Exit, Failure};
use crate::stream::{write_flush, Stream};
use crate::target::Target;

/// How long connecting (TCP, TLS and WebSocket handshakes) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// An open connection to the broker.
pub enum Transport {
    /// MQTT straight over TCP or TLS.
    Plain(Stream),
    /// MQTT in binary WebSocket messages, over TCP or TLS (the shared client's adapter).
    WebSocket(Box<WebSocket<Stream>>),
}

fn unreachable(target: &Target, why: impl std::fmt::Display) -> Failure {
    Failure::new(
        Exit::Unreachable,
        format!("cannot connect to {}: {why}", target.display()),
    )
}

/// Connects from the local address `local` (-A) to the first address of the target's host in
/// the same family that accepts.
async fn connect_from(target: &Target, local: std::net::IpAddr) -> Result<TcpStream, Failure> {
    let addrs = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .map_err(|e| unreachable(target, e))?;
    let mut last = None;
    for addr in addrs.filter(|a| a.is_ipv4() == local.is_ipv4()) {
        let socket = if local.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        }
        .map_err(|e| unreachable(target, e))?;
        socket
            .bind((local, 0).into())
            .map_err(|e| unreachable(target, format!("cannot bind to {local}: {e}")))?;
        match socket.connect(addr).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e.to_string()),
        }
    }
    Err(unreachable(
        target,
        last.unwrap_or_else(|| format!("no address of the host in the family of {local}")),
    ))
}

impl Transport {
    /// Connects to `target`: TCP, then TLS and the WebSocket handshake (subprotocol `mqtt`)
    /// as it says. Errors are [`Exit::Unreachable`].
    pub async fn open(target: &Target) -> Result<Transport, Failure> {
        match tokio::time::timeout(CONNECT_TIMEOUT, Self::open_inner(target)).await {
            Ok(r) => r,
            Err(_) => Err(unreachable(target, "no answer in 10 seconds")),
        }
    }

    async fn open_inner(target: &Target) -> Result<Transport, Failure> {
        let tcp = match target.bind {
            None => TcpStream::connect((target.host.as_str(), target.port))
                .await
                .map_err(|e| unreachable(target, e))?,
            Some(local) => connect_from(target, local).await?,
        };
        let _ = tcp.set_nodelay(true);
        let stream = match &target.tls {
            None => Stream::Tcp(tcp),
            Some(tls) => {
                let s = tls
                    .connector
                    .connect(tls.server_name.clone(), tcp)
                    .await
                    .map_err(|e| unreachable(target, format!("TLS handshake failed: {e}")))?;
                Stream::Tls(Box::new(s))
            }
        };
        let Some(path) = &target.websocket else {
            return Ok(Transport::Plain(stream));
        };
        let scheme = if target.tls.is_some() { "wss" } else { "ws" };
        let host = if target.host.contains(':') {
            format!("[{}]", target.host)
        } else {
            target.host.clone()
        };
        let url = format!("{scheme}://{host}:{}{path}", target.port);
        let mut request = url
            .as_str()
            .into_client_request()
            .map_err(|e| Failure::usage(format!("{url}: {e}")))?;
        request
            .headers_mut()
            .insert("Sec-WebSocket-Protocol", HeaderValue::from_static("mqtt"));
        let (ws, _response) = tokio_tungstenite::client_async(request, stream)
            .await
            .map_err(|e| unreachable(target, format!("WebSocket handshake failed: {e}")))?;
        Ok(Transport::WebSocket(Box::new(WebSocket::new(ws))))
    }

    /// Reads more bytes into `buf`; 0 at the end of the connection. Cancel safe.
    pub async fn read(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        match self {
            Transport::Plain(s) => s.read_buf(buf).await,
            Transport::WebSocket(ws) => ws.read_into(buf).await,
        }
    }

    /// Writes `bytes` (one WebSocket message) and flushes.
    pub async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Transport::Plain(s) => write_flush(s, bytes).await,
            Transport::WebSocket(ws) => ws.write_flush(bytes).await,
        }
    }

    /// Closes the connection politely (TLS close_notify, WebSocket close frame).
    pub async fn close(&mut self) {
        use tokio::io::AsyncWriteExt;
        match self {
            Transport::Plain(s) => {
                let _ = s.shutdown().await;
            }
            Transport::WebSocket(ws) => ws.close().await,
        }
    }
}

/// The shared client's view of the connection: MQTT bytes in and out, whatever the framing.
impl mercurio_codec::client::Transport for Transport {
    async fn read_into(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        self.read(buf).await
    }

    async fn write_flush(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.write(bytes).await
    }

    async fn close(&mut self) {
        Transport::close(self).await
    }
}
