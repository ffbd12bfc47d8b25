//! Parking, the connection's side: what is left of a plain TCP connection idle for
//! `[server] park_after` seconds ([`Parked`]), its place in the connection counts ([`Slot`]),
//! and how it is served again. The epoll set that holds parked records and resumes them is
//! `crate::parking`.

use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Waker};

use bytes::BytesMut;

use super::reader::READ_ROOM;
use super::{Connected, LazyMap, Shared};
use crate::broker::BrokerState;
use crate::link::{DisconnectReason, Link};
use crate::parking::{Parking, Resume, Unwatch};
use crate::shards::Shards;
use crate::stats::Counters;

/// An accepted socket's place in the connection counts (`max_connections`, shutdown's wait):
/// given back when the connection has closed, whichever task (or parked record) holds it then.
pub(crate) struct Slot {
    pub(crate) broker: Arc<BrokerState>,
    on_listener: Arc<AtomicUsize>,
}

impl Slot {
    /// The slot of a connection accepted (and counted) on the listener counting `on_listener`.
    pub(crate) fn new(broker: Arc<BrokerState>, on_listener: Arc<AtomicUsize>) -> Slot {
        Slot {
            broker,
            on_listener,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.on_listener.fetch_sub(1, Ordering::Relaxed);
        self.broker.open_connections.fetch_sub(1, Ordering::Relaxed);
        self.broker.connection_closed.notify_waiters();
    }
}

/// What is left of a parked connection. Not its peer's address: the link has it (set at
/// CONNECT, 8 bytes for IPv4), and a 32-byte `SocketAddr` here would take the record out of
/// jemalloc's 80-byte class.
pub(super) struct Parked {
    pub(super) stream: std::net::TcpStream,
    pub(super) shared: Shared,
    pub(super) aliases: Aliases,
}

impl Parked {
    /// The peer's address: the link's (set at CONNECT, before any connection can park), else
    /// the socket's.
    pub(super) fn peer(&self) -> SocketAddr {
        self.shared
            .link
            .peer()
            .or_else(|| self.stream.peer_addr().ok())
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

/// The topic alias tables of a connection's reader and writer, which last as long as the
/// network connection (MQTT 5.0 section 3.3.2.3.4), parks included.
#[derive(Default)]
pub(super) struct Aliases {
    pub(super) inbound: LazyMap<u16, String>,
    pub(super) outbound: LazyMap<String, u16>,
}

/// Serves a parked connection again, in the task this runs in; `unwatch`: its socket's place
/// in the parking's epoll set, if any.
async fn resume(p: Parked, slot: Slot, unwatch: Option<Unwatch>) {
    let peer = p.peer();
    let Parked {
        stream,
        shared,
        aliases,
    } = p;
    // What the client sent while parked is read first, before anything else can happen to
    // the connection: the runtime learns a socket's readiness only at its next turn, and a
    // takeover or a kill that resumed the connection must not win over a DISCONNECT already
    // here (which discards the will [MQTT-3.14.4-3]: a client that disconnects and connects
    // again at once would otherwise have its will published). Nothing there, or an error or
    // the end of the stream: the reader finds it again.
    // (In a block: a local in scope at a wait would take room in this future, which the
    // resumed connection's task holds for as long as it is served.)
    let (buf, goodbye) = {
        let mut buf = BytesMut::new();
        let mut first = [0u8; READ_ROOM];
        let read = std::io::Read::read(&mut &stream, &mut first);
        if let Ok(n @ 1..) = read {
            Counters::add(&shared.broker.stats.bytes_received, n as u64);
            buf.extend_from_slice(&first[..n]);
        }
        (buf, goodbye(&read, &first))
    };
    // A client that only said goodbye is closed here, as its reader would close it, without
    // the stream registered with the runtime and a reader and a writer set up for one packet:
    // at the end of a connect storm, or when a fleet disconnects, that is most of what a
    // resume costs. Not when answers are owed to it (they would be written first).
    if let Some(close) = goodbye.filter(|_| shared.link.control_is_empty()) {
        shared.link.disarm_keep_alive();
        super::detach(&shared, peer, &close);
        // Closed below, as `stream` goes: no `epoll_ctl` to take it out of the set first.
        if let Some(unwatch) = unwatch {
            unwatch.closing();
        }
        drop(stream);
        return;
    }
    if let Some(unwatch) = unwatch {
        unwatch.now();
    }
    let stream = match tokio::net::TcpStream::from_std(stream) {
        Ok(s) => s,
        Err(e) => {
            let close = super::Close::lost(DisconnectReason::Io(e.to_string()));
            super::detach(&shared, peer, &close);
            return;
        }
    };
    let c = Connected {
        shared,
        stream: parking_lot::Mutex::new(stream),
        buf,
        peer,
        resumed: Some(Box::new(aliases)),
    };
    let running = Box::pin(super::run(c, true));
    if let Some(p) = running.await {
        park_or_resume(p, slot);
    }
}

/// How a parked connection closes when all its client sent is a plain DISCONNECT (`E0 00`:
/// Normal disconnection, no properties, in every protocol version; the will is discarded
/// [MQTT-3.14.4-3]) or the end of the stream (the connection is lost: the will goes out);
/// `None` for anything else, which the reader handles. `read`: the first read of a resume,
/// into `first`.
fn goodbye(read: &std::io::Result<usize>, first: &[u8]) -> Option<super::Close> {
    match read {
        Ok(0) => Some(super::Close::lost(DisconnectReason::ConnectionLost)),
        Ok(2) if first[..2] == [0xE0, 0x00] => Some(super::Close {
            reason: DisconnectReason::ClientDisconnect,
            send: None,
            publish_will: false,
        }),
        _ => None,
    }
}

/// Parks `p`; or, without a parking (never: the connection checked for one before it
/// stopped), serves it again at once.
pub(super) fn park_or_resume(p: Parked, slot: Slot) {
    match parking_of(&p.shared.broker) {
        Some(parking) => Arc::clone(parking).park(Box::new(Record { p, slot })),
        None => drop(tokio::spawn(resume(p, slot, None))),
    }
}

/// A parked connection with its slot, as the parking holds it.
struct Record {
    p: Parked,
    slot: Slot,
}

// One per parked connection: 80 bytes or less, one of jemalloc's 80-byte class.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Record>() <= 80);

impl Resume for Record {
    fn fd(&self) -> RawFd {
        self.p.stream.as_raw_fd()
    }

    fn link(&self) -> &Arc<Link> {
        &self.p.shared.link
    }

    fn resume(self: Box<Self>, unwatch: Unwatch) {
        let Record { p, slot } = *self;
        // More than one shard: served again where there is room (`shards`), in a task of
        // that shard's, which registers the socket with its event loop.
        if let Some(shards) = slot.broker.shards.clone() {
            let k = shards.place_again(&p.shared.link);
            // What operators see of moves (`clients/moved`): the link still names the shard
            // that served it last.
            if k != p.shared.link.shard() {
                Counters::add(&slot.broker.stats.clients_moved, 1);
            }
            if Shards::current() != Some(k) {
                shards.spawn(k, resume(p, slot, Some(unwatch)));
                return;
            }
        }
        // Served a first time here, in the parking's turn, and only then, if not done, in a
        // task of its own: a new task runs after every task woken before it, and what this
        // client sent (a SUBSCRIBE, say) would be handled after what another client sent
        // later in the same turn (a PUBLISH to that filter, which the subscriber would miss).
        // Whatever this poll registers its (no-op) waker with, the task's first poll
        // registers again.
        let mut task = Box::pin(resume(p, slot, Some(unwatch)));
        let mut cx = Context::from_waker(Waker::noop());
        if task.as_mut().poll(&mut cx).is_pending() {
            drop(tokio::spawn(task));
        }
    }
}

/// The broker's parking, started on first use (in a tokio runtime); `None` when it cannot
/// be started (connections then never park).
pub(crate) fn parking_of(broker: &BrokerState) -> Option<&Arc<Parking>> {
    broker
        .parking
        .get_or_init(|| {
            let after = broker.config.server.park_after;
            if after == 0 {
                return None;
            }
            match Parking::start(Arc::clone(&broker.stats), after) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!("idle connections will not be parked: {e}");
                    None
                }
            }
        })
        .as_ref()
}
