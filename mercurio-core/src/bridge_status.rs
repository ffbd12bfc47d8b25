//! A bridge's live state and counters ([`BridgeStatus`]) and the report made of them
//! ([`BridgeInfo`]): what the broker's `$SYS`, `/metrics` and admin commands read. Kept apart
//! from the `bridge` module, which runs the bridges on top of the broker, so that the broker's
//! state can hold them without the two modules importing each other.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::config::BridgeConfig;
use crate::session::Session;

/// A bridge's live state and counters, read by `$SYS`, `/metrics` and `mercurioctl`.
#[derive(Debug)]
pub(crate) struct BridgeStatus {
    pub name: String,
    pub client_id: String,
    pub addresses: Vec<String>,
    pub connected: AtomicBool,
    /// The address of the current (or last) connection.
    pub address: Mutex<Option<String>>,
    pub since: Mutex<Option<Instant>>,
    pub last_error: Mutex<Option<String>>,
    /// Messages acknowledged by the remote (QoS 1/2) or sent to it (QoS 0).
    pub forwarded_out: AtomicU64,
    /// Messages received from the remote and published here.
    pub forwarded_in: AtomicU64,
    /// Connections made after the first.
    pub reconnects: AtomicU64,
    /// Connections closed for a packet from the remote over the bridge's `max_packet_size`.
    pub too_large: AtomicU64,
    session: Mutex<Option<Arc<Session>>>,
}

impl BridgeStatus {
    pub(crate) fn new(cfg: &BridgeConfig) -> BridgeStatus {
        BridgeStatus {
            name: cfg.name.clone(),
            client_id: cfg.remote_client_id().to_string(),
            addresses: cfg.addresses.clone(),
            connected: AtomicBool::new(false),
            address: Mutex::new(None),
            since: Mutex::new(None),
            last_error: Mutex::new(None),
            forwarded_out: AtomicU64::new(0),
            forwarded_in: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            too_large: AtomicU64::new(0),
            session: Mutex::new(None),
        }
    }

    /// Takes over the counters of `old`, the status of the same bridge before a restart (a
    /// reload that changed its settings): counters only grow while the process lives, as
    /// `/metrics` counters must.
    pub(crate) fn carry_counters(&self, old: &BridgeStatus) {
        for (new, old) in [
            (&self.forwarded_out, &old.forwarded_out),
            (&self.forwarded_in, &old.forwarded_in),
            (&self.reconnects, &old.reconnects),
            (&self.too_large, &old.too_large),
        ] {
            new.store(old.load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// Sets (or clears) the bridge's local session, whose queue `info` reports.
    pub(crate) fn set_session(&self, session: Option<Arc<Session>>) {
        *self.session.lock() = session;
    }

    /// What [`crate::BrokerHandle::bridges`] reports.
    pub(crate) fn info(&self) -> BridgeInfo {
        let (queued, inflight, queued_bytes, dropped) = match &*self.session.lock() {
            Some(s) => {
                let st = s.state.lock();
                (
                    st.queue().len(),
                    st.inflight().len(),
                    st.queue().bytes(),
                    st.dropped(),
                )
            }
            None => (0, 0, 0, 0),
        };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        BridgeInfo {
            name: self.name.clone(),
            client_id: self.client_id.clone(),
            addresses: self.addresses.clone(),
            connected: self.connected.load(Ordering::Relaxed),
            address: self.address.lock().clone(),
            connected_for: self.since.lock().map(|t| t.elapsed()),
            last_error: self.last_error.lock().clone(),
            forwarded_out: get(&self.forwarded_out),
            forwarded_in: get(&self.forwarded_in),
            queued: queued + inflight,
            queued_bytes,
            dropped,
            reconnects: get(&self.reconnects),
            packets_too_large: get(&self.too_large),
        }
    }
}

/// One bridge as [`crate::BrokerHandle::bridges`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeInfo {
    pub name: String,
    /// The client identifier on the remote (the `$SYS` state topic names it).
    pub client_id: String,
    pub addresses: Vec<String>,
    pub connected: bool,
    /// The address of the current connection, or of the last one.
    pub address: Option<String>,
    /// Time since the connection was made; `None` while not connected.
    pub connected_for: Option<Duration>,
    /// Why the last attempt or connection failed.
    pub last_error: Option<String>,
    /// Messages the remote acknowledged (QoS 1/2) or was sent (QoS 0).
    pub forwarded_out: u64,
    /// Messages from the remote published on this broker.
    pub forwarded_in: u64,
    /// Messages waiting for the remote, in flight included.
    pub queued: usize,
    /// Payload bytes waiting in the queue.
    pub queued_bytes: u64,
    /// Messages for the remote dropped by the queue's limits.
    pub dropped: u64,
    /// Connections made after the first.
    pub reconnects: u64,
    /// Connections closed because the remote sent a packet over the bridge's
    /// `max_packet_size`.
    pub packets_too_large: u64,
}
