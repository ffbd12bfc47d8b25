//! MQTT over WebSocket (MQTT 5.0 section 6): a [`Transport`] on tokio-tungstenite's stream.

use std::io;

use bytes::{Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::Transport;

/// MQTT bytes in binary WebSocket messages over `S` (TCP, TLS), after the handshake
/// (subprotocol `mqtt`, which is the caller's to make): each write is one binary message,
/// reads take the binary messages' bytes whatever their boundaries. A text message from the
/// server is an error, as MQTT wants [MQTT-6.0.0-1]; pings are answered by tungstenite; a
/// Close message ends the stream and is kept ([`WebSocket::close_frame`]).
#[derive(Debug)]
pub struct WebSocket<S> {
    ws: WebSocketStream<S>,
    close_frame: Option<CloseFrame>,
}

impl<S> WebSocket<S> {
    /// The transport over an open WebSocket.
    pub fn new(ws: WebSocketStream<S>) -> Self {
        WebSocket {
            ws,
            close_frame: None,
        }
    }

    /// The WebSocket.
    pub fn get_ref(&self) -> &WebSocketStream<S> {
        &self.ws
    }

    /// The WebSocket, to send messages of its own (text, ping, a Close of its choosing).
    pub fn get_mut(&mut self) -> &mut WebSocketStream<S> {
        &mut self.ws
    }

    /// The WebSocket alone.
    pub fn into_inner(self) -> WebSocketStream<S> {
        self.ws
    }

    /// The server's Close message, once one came (`None` also when it had no payload).
    pub fn close_frame(&self) -> Option<&CloseFrame> {
        self.close_frame.as_ref()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> Transport for WebSocket<S> {
    /// Cancel safe: a message is taken from the stream only when it is appended whole.
    async fn read_into(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        loop {
            match self.ws.next().await {
                None => return Ok(0),
                Some(Err(e)) => return Err(io::Error::other(e)),
                Some(Ok(Message::Binary(b))) => {
                    if b.is_empty() {
                        continue;
                    }
                    buf.extend_from_slice(&b);
                    return Ok(b.len());
                }
                Some(Ok(Message::Close(frame))) => {
                    self.close_frame = frame;
                    return Ok(0);
                }
                Some(Ok(Message::Text(t))) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the server sent a text message, which is no MQTT: {t}"),
                    ))
                }
                // Ping, pong (answered by tungstenite), raw frames.
                Some(Ok(_)) => continue,
            }
        }
    }

    async fn write_flush(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.ws
            .send(Message::Binary(Bytes::copy_from_slice(bytes)))
            .await
            .map_err(io::Error::other)
    }

    async fn close(&mut self) {
        // The Sink's close sends a Close message and flushes it.
        let _ = SinkExt::close(&mut self.ws).await;
    }
}
