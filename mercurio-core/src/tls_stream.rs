//! A server TLS connection as a byte stream that holds no buffer while idle: rustls's
//! unbuffered API driven over a TCP socket.
//!
//! rustls's buffered connection (what `tokio-rustls` wraps) keeps a 4 KiB record buffer for
//! the life of the connection, read or not. Here the buffers are this module's own and exist
//! only while they hold bytes:
//!
//! - `incoming` (TLS bytes read, not yet decrypted) is allocated when the socket is readable,
//!   and released (or shrunk to the partial record it holds) when a read would block, that is
//!   each time the connection goes back to waiting;
//! - `outgoing` (TLS records not yet written) is released once written;
//! - `plain` (plaintext decrypted, not yet taken by the reader) is released once taken.
//!
//! A write is encrypted once, then reported written once its records are all on the socket;
//! a caller retrying after `Pending` must pass the same bytes again (as `write_all` does), or
//! at least bytes that start with them (the connection's final write does: what an
//! interrupted write left comes first).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, EncryptError, UnbufferedStatus};
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// How much is read from the socket at once: a whole TLS record of 16 KiB and its framing.
const READ_SIZE: usize = 16 * 1024 + 512;
/// Largest part of one write encrypted at once (four full records).
const WRITE_CHUNK: usize = 64 * 1024;
/// Upper bound of a record's framing and authentication tag (TLS 1.2 AES-GCM: 5 + 8 + 16;
/// TLS 1.3: 5 + 1 + 16), used to size the output before encrypting.
const RECORD_OVERHEAD: usize = 64;

/// A TLS connection accepted by a listener, after its handshake (see [`accept`]).
///
/// Boxed: a connection's task keeps its stream by value, and rustls's connection state is
/// over a kilobyte.
pub(crate) struct TlsStream {
    inner: Box<Inner>,
}

struct Inner {
    io: TcpStream,
    conn: UnbufferedServerConnection,
    /// TLS bytes read and not yet processed; no allocation between records.
    incoming: Vec<u8>,
    /// TLS records to write, from `out_pos`; no allocation once written.
    outgoing: Vec<u8>,
    out_pos: usize,
    /// Plaintext not yet read by the caller, from `plain_pos`.
    plain: Vec<u8>,
    plain_pos: usize,
    /// Bytes of the caller's write encrypted into `outgoing`, reported once written.
    unacked: usize,
    /// The peer closed (close_notify or end of the TCP stream): reads return end of file.
    read_closed: bool,
    /// A close_notify was queued.
    close_queued: bool,
}

/// What [`Inner::step`] should do once the connection can carry application data.
#[derive(Clone, Copy)]
enum Job<'a> {
    Nothing,
    Encrypt(&'a [u8]),
    CloseNotify,
}

/// Where processing the buffered TLS bytes stopped.
enum Step {
    /// Plaintext was added to `plain`, or the peer closed (`read_closed`).
    Input,
    /// `outgoing` must be written before going on.
    Flush,
    /// More bytes from the peer are needed (mid-handshake, or mid-record / no record).
    NeedInput,
    /// Application data may be sent; the job was done (bytes of it encrypted).
    Traffic(usize),
    /// Both sides closed.
    Closed,
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Runs the server side of a TLS handshake on `io` with `config`. Cancel-safe in the sense
/// that dropping it drops the connection. A handshake that fails sends the peer its alert
/// when the socket takes it at once.
pub(crate) async fn accept(config: Arc<ServerConfig>, io: TcpStream) -> io::Result<TlsStream> {
    let conn = UnbufferedServerConnection::new(config).map_err(tls_error)?;
    let mut inner = Box::new(Inner {
        io,
        conn,
        incoming: Vec::new(),
        outgoing: Vec::new(),
        out_pos: 0,
        plain: Vec::new(),
        plain_pos: 0,
        unacked: 0,
        read_closed: false,
        close_queued: false,
    });
    std::future::poll_fn(|cx| inner.poll_handshake(cx)).await?;
    Ok(TlsStream { inner })
}

impl TlsStream {
    /// The verified client certificate chain, end entity first, when the client sent one.
    pub(crate) fn peer_certificates(&self) -> Option<&[rustls_pki_types::CertificateDer<'static>]> {
        self.inner.conn.peer_certificates()
    }
}

impl Inner {
    fn poll_handshake(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            let step = match self.step(Job::Nothing) {
                Ok(s) => s,
                Err(e) => {
                    self.send_alert();
                    return Poll::Ready(Err(e));
                }
            };
            match step {
                Step::Flush => ready!(self.poll_flush_out(cx))?,
                Step::Input | Step::Traffic(_) if !self.conn.is_handshaking() => {
                    return Poll::Ready(Ok(()))
                }
                Step::Input | Step::Traffic(_) | Step::NeedInput => {
                    if ready!(self.poll_fill(cx))? == 0 {
                        return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                    }
                }
                Step::Closed => return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into())),
            }
        }
    }

    /// After a failed handshake: encodes the alert rustls queued and writes it if the socket
    /// takes it now (best effort; the connection is closed next).
    fn send_alert(&mut self) {
        let UnbufferedStatus { state, .. } = self.conn.process_tls_records(&mut []);
        if let Ok(ConnectionState::EncodeTlsData(mut e)) = state {
            let start = self.outgoing.len();
            let mut room = 64;
            loop {
                self.outgoing.resize(start + room, 0);
                match e.encode(&mut self.outgoing[start..]) {
                    Ok(n) => {
                        self.outgoing.truncate(start + n);
                        break;
                    }
                    Err(EncodeError::InsufficientSize(s)) => room = s.required_size,
                    Err(EncodeError::AlreadyEncoded) => {
                        self.outgoing.truncate(start);
                        break;
                    }
                }
            }
        }
        let _ = self.io.try_write(&self.outgoing[self.out_pos..]);
    }

    /// Processes what `incoming` holds until a state that needs the caller; does `job` when
    /// the connection can carry application data.
    fn step(&mut self, job: Job<'_>) -> io::Result<Step> {
        loop {
            let UnbufferedStatus { mut discard, state } =
                self.conn.process_tls_records(&mut self.incoming);
            let state = match state {
                Ok(s) => s,
                Err(e) => {
                    self.incoming.drain(..discard);
                    return Err(tls_error(e));
                }
            };
            let next = match state {
                ConnectionState::ReadTraffic(mut traffic) => {
                    if self.plain_pos > 0 {
                        self.plain.drain(..self.plain_pos);
                        self.plain_pos = 0;
                    }
                    let mut failed = None;
                    while let Some(record) = traffic.next_record() {
                        match record {
                            Ok(r) => {
                                discard += r.discard;
                                self.plain.extend_from_slice(r.payload);
                            }
                            Err(e) => {
                                failed = Some(e);
                                break;
                            }
                        }
                    }
                    match failed {
                        Some(e) => Err(tls_error(e)),
                        None => Ok(Some(Step::Input)),
                    }
                }
                ConnectionState::PeerClosed => {
                    self.read_closed = true;
                    Ok(Some(Step::Input))
                }
                ConnectionState::Closed => Ok(Some(Step::Closed)),
                ConnectionState::EncodeTlsData(mut e) => {
                    let start = self.outgoing.len();
                    let mut room = 512;
                    loop {
                        self.outgoing.resize(start + room, 0);
                        match e.encode(&mut self.outgoing[start..]) {
                            Ok(n) => {
                                self.outgoing.truncate(start + n);
                                break Ok(None);
                            }
                            Err(EncodeError::InsufficientSize(s)) => room = s.required_size,
                            Err(EncodeError::AlreadyEncoded) => {
                                self.outgoing.truncate(start);
                                break Ok(None);
                            }
                        }
                    }
                }
                ConnectionState::TransmitTlsData(t) => {
                    if self.out_pos == self.outgoing.len() {
                        t.done();
                        Ok(None)
                    } else {
                        Ok(Some(Step::Flush))
                    }
                }
                ConnectionState::BlockedHandshake => Ok(Some(Step::NeedInput)),
                ConnectionState::WriteTraffic(mut w) => {
                    // rustls puts what it queued (a TLS 1.3 key update) before the records.
                    let start = self.outgoing.len();
                    let (data, close) = match job {
                        Job::Nothing => (&[][..], false),
                        Job::Encrypt(d) => (d, false),
                        Job::CloseNotify => (&[][..], true),
                    };
                    let mut room = data.len() + RECORD_OVERHEAD * (data.len() / (16 * 1024) + 2);
                    let done = loop {
                        if matches!(job, Job::Nothing) {
                            break Ok(0);
                        }
                        self.outgoing.resize(start + room, 0);
                        let r = if close {
                            w.queue_close_notify(&mut self.outgoing[start..])
                        } else {
                            w.encrypt(data, &mut self.outgoing[start..])
                        };
                        match r {
                            Ok(n) => {
                                self.outgoing.truncate(start + n);
                                break Ok(data.len());
                            }
                            Err(EncryptError::InsufficientSize(s)) => room = s.required_size,
                            Err(e) => {
                                self.outgoing.truncate(start);
                                break Err(io::Error::other(e));
                            }
                        }
                    };
                    done.map(|n| Some(Step::Traffic(n)))
                }
                _ => Err(io::Error::other("unexpected TLS state (early data)")),
            };
            self.incoming.drain(..discard);
            if let Some(step) = next? {
                return Ok(step);
            }
        }
    }

    /// Reads what the socket holds into `incoming` once it is readable; 0 at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.io.poll_read_ready(cx))?;
            if self.incoming.capacity() - self.incoming.len() < READ_SIZE / 4 {
                self.incoming.reserve_exact(READ_SIZE);
            }
            match self.io.try_read_buf(&mut self.incoming) {
                Ok(n) => return Poll::Ready(Ok(n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Going back to waiting: keep no more than the partial record.
                    if self.incoming.is_empty() {
                        self.incoming = Vec::new();
                    } else {
                        self.incoming.shrink_to_fit();
                    }
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Writes `outgoing` to the socket; releases it once written.
    fn poll_flush_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.out_pos < self.outgoing.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.outgoing[self.out_pos..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out_pos += n;
        }
        self.outgoing = Vec::new();
        self.out_pos = 0;
        Poll::Ready(Ok(()))
    }
}

/// A TLS connection keeps its task: its session state lives in the stream.
impl crate::parking::Park for TlsStream {}

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self.get_mut().inner;
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.plain_pos < this.plain.len() {
                let n = buf.remaining().min(this.plain.len() - this.plain_pos);
                buf.put_slice(&this.plain[this.plain_pos..this.plain_pos + n]);
                this.plain_pos += n;
                if this.plain_pos == this.plain.len() {
                    this.plain = Vec::new();
                    this.plain_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            match this.step(Job::Nothing)? {
                Step::Input => {}
                Step::Flush => ready!(this.poll_flush_out(cx))?,
                Step::NeedInput | Step::Traffic(_) => {
                    if ready!(this.poll_fill(cx))? == 0 {
                        this.read_closed = true;
                    }
                }
                Step::Closed => this.read_closed = true,
            }
        }
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self.get_mut().inner;
        if this.unacked == 0 && !buf.is_empty() {
            let chunk = &buf[..buf.len().min(WRITE_CHUNK)];
            loop {
                match this.step(Job::Encrypt(chunk))? {
                    Step::Traffic(n) => {
                        this.unacked = n;
                        break;
                    }
                    Step::Input => {}
                    Step::Flush => ready!(this.poll_flush_out(cx))?,
                    Step::NeedInput => {
                        return Poll::Ready(Err(io::Error::other("TLS handshake not complete")))
                    }
                    Step::Closed => return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into())),
                }
            }
        }
        ready!(this.poll_flush_out(cx))?;
        Poll::Ready(Ok(std::mem::take(&mut this.unacked).min(buf.len())))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().inner.poll_flush_out(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self.get_mut().inner;
        while !this.close_queued {
            match this.step(Job::CloseNotify) {
                Ok(Step::Input) => {}
                Ok(Step::Flush) => ready!(this.poll_flush_out(cx))?,
                Ok(_) | Err(_) => this.close_queued = true,
            }
        }
        ready!(this.poll_flush_out(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}
