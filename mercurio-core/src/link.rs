//! The tie between a session and the connection serving it ([`Link`]), and why a connection
//! ended ([`DisconnectReason`]).
//!
//! Publishers, timers and the broker reach a connection only through its `Link`: they wake
//! its writer when they queue something, and ask it to close. The link knows nothing of the
//! socket, so the session (which holds the link of its current connection) and the broker
//! sit below the connection code.

use std::sync::atomic::{AtomicBool, Ordering};

use bytes::BytesMut;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::codec::{self, Packet, ProtocolVersion, ReasonCode};

/// Why a connection ended, as logs and counters show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DisconnectReason {
    /// The client sent DISCONNECT.
    ClientDisconnect,
    /// The client closed the socket without DISCONNECT.
    ConnectionLost,
    /// No packet within 1.5 times the keep alive.
    KeepAliveTimeout,
    /// A second connection took the session over.
    TakenOver,
    /// The broker is shutting down.
    Shutdown,
    /// Closed by an administrator or the embedding application.
    Administrative,
    /// The client broke the protocol (malformed packet, protocol error, a limit).
    ProtocolViolation(ReasonCode),
    /// Reading or writing the socket failed.
    Io(String),
    /// Storage did not commit what an acknowledgement owed to the client covers (durable_ack):
    /// the connection is closed instead, so the client sends it again.
    NotStored,
}

impl std::fmt::Display for DisconnectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DisconnectReason::ClientDisconnect => write!(f, "client disconnected"),
            DisconnectReason::ConnectionLost => write!(f, "connection closed by client"),
            DisconnectReason::KeepAliveTimeout => write!(f, "keep alive timeout"),
            DisconnectReason::TakenOver => write!(f, "session taken over"),
            DisconnectReason::Shutdown => write!(f, "server shutting down"),
            DisconnectReason::Administrative => write!(f, "administrative action"),
            DisconnectReason::ProtocolViolation(rc) => write!(f, "protocol violation: {rc}"),
            DisconnectReason::Io(e) => write!(f, "socket error: {e}"),
            DisconnectReason::NotStored => {
                write!(f, "storage did not commit what an acknowledgement covers")
            }
        }
    }
}

/// The tie between a session and the connection serving it: how publishers wake the writer
/// and how the broker asks the connection to close.
#[derive(Debug)]
pub(crate) struct Link {
    wake: Notify,
    kill: Notify,
    kill_reason: Mutex<Option<(DisconnectReason, ReasonCode)>>,
    closed: Notify,
    is_closed: AtomicBool,
    /// Packets encoded by the reader, written by the writer ahead of queued messages.
    control: Mutex<BytesMut>,
    /// The client's Maximum Packet Size, in bytes (unlimited until CONNECT says).
    max_packet_size: std::sync::atomic::AtomicUsize,
}

impl Link {
    pub(crate) fn new() -> Link {
        Link {
            wake: Notify::new(),
            kill: Notify::new(),
            kill_reason: Mutex::new(None),
            closed: Notify::new(),
            is_closed: AtomicBool::new(false),
            control: Mutex::new(BytesMut::new()),
            max_packet_size: std::sync::atomic::AtomicUsize::new(usize::MAX),
        }
    }

    /// Sets the client's Maximum Packet Size, in bytes, which [`Link::send`] respects.
    pub(crate) fn set_max_packet_size(&self, max: usize) {
        self.max_packet_size.store(max, Ordering::Relaxed);
    }

    /// Wakes the writer: something was queued.
    pub(crate) fn wake(&self) {
        self.wake.notify_one();
    }

    /// Waits for the next [`Link::wake`].
    pub(crate) async fn wait_woken(&self) {
        self.wake.notified().await;
    }

    /// Asks the connection to close, sending DISCONNECT `rc` to a 5.0 client.
    pub(crate) fn kill(&self, reason: DisconnectReason, rc: ReasonCode) {
        let mut slot = self.kill_reason.lock();
        if slot.is_none() {
            *slot = Some((reason, rc));
        }
        drop(slot);
        self.kill.notify_one();
    }

    /// Waits for [`Link::kill`] (for links without a connection task: in-process
    /// subscriptions).
    pub(crate) async fn wait_killed(&self) {
        self.kill.notified().await;
    }

    /// Waits until the connection has closed and detached from its session.
    pub(crate) async fn wait_closed(&self) {
        loop {
            let notified = self.closed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_closed.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// The reason given to [`Link::kill`], taken (`None` when it was never called).
    pub(crate) fn take_kill_reason(&self) -> Option<(DisconnectReason, ReasonCode)> {
        self.kill_reason.lock().take()
    }

    /// Marks the connection closed and detached: wakes [`Link::wait_closed`].
    pub(crate) fn mark_closed(&self) {
        self.is_closed.store(true, Ordering::Release);
        self.closed.notify_waiters();
    }

    /// Encodes a packet for the writer and wakes it. A packet larger than the client's
    /// Maximum Packet Size is never sent [MQTT-3.1.2-24] (a SUBACK for very many filters, say):
    /// the connection is closed instead (MQTT 5: DISCONNECT 0x95 Packet too large).
    pub(crate) fn send(&self, packet: &Packet, version: ProtocolVersion) {
        let mut control = self.control.lock();
        let before = control.len();
        if let Err(e) = codec::encode(packet, version, &mut control) {
            tracing::error!("cannot encode {}: {e}", packet.name());
        }
        let size = control.len() - before;
        if size > self.max_packet_size.load(Ordering::Relaxed) {
            control.truncate(before);
            drop(control);
            tracing::info!(
                size,
                "{} larger than the client's Maximum Packet Size: closing",
                packet.name()
            );
            self.kill(
                DisconnectReason::ProtocolViolation(ReasonCode::PACKET_TOO_LARGE),
                ReasonCode::PACKET_TOO_LARGE,
            );
            return;
        }
        drop(control);
        self.wake.notify_one();
    }

    /// Appends the packets waiting for the writer to `buf`, leaving none.
    pub(crate) fn drain_control_into(&self, buf: &mut BytesMut) {
        let mut control = self.control.lock();
        if !control.is_empty() {
            buf.extend_from_slice(&control);
            control.clear();
        }
    }

    /// The packets waiting for the writer, taken (the last bytes of a closing connection).
    pub(crate) fn take_control(&self) -> BytesMut {
        std::mem::take(&mut *self.control.lock())
    }
}
