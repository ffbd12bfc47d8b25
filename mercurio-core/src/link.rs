//! The tie between a session and the connection serving it ([`Link`]), and why a connection
//! ended ([`DisconnectReason`]).
//!
//! Publishers, timers and the broker reach a connection only through its `Link`: they wake
//! its writer when they queue something, and ask it to close. The link knows nothing of the
//! socket, so the session (which holds the link of its current connection) and the broker
//! sit below the connection code.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::task::AtomicWaker;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::codec::{self, Packet, ProtocolVersion, ReasonCode};

/// Bytes of answers (PUBACK, PINGRESP, ...) the reader may leave for the writer; above it
/// the reader stops reading until the writer has written them out.
const CONTROL_LIMIT: usize = 64 * 1024;

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
    /// An application hook (a publish interceptor) panicked while handling the client's
    /// packet, and the client had no other way to learn that the packet was lost.
    HookPanicked,
    /// Cluster mode: JetStream did not take a message another node wants within
    /// `jetstream_ack_timeout`, so its PUBACK / PUBREC could not be sent; the message is
    /// still sent once JetStream takes it.
    ClusterBusy,
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
            DisconnectReason::HookPanicked => write!(f, "an application hook panicked"),
            DisconnectReason::ClusterBusy => write!(
                f,
                "JetStream did not take a message for another node within jetstream_ack_timeout"
            ),
        }
    }
}

/// The tie between a session and the connection serving it: how publishers wake the writer
/// and how the broker asks the connection to close.
#[derive(Debug)]
pub(crate) struct Link {
    /// The task that serves the link (its connection's, a bridge's, an in-process
    /// subscription's): one task waits for [`Link::wake`], [`Link::kill`] and (a connection's
    /// reader) [`Link::wrote`], so one waker serves all three, and the futures waiting for
    /// them hold no waiter of their own (an idle connection waits on two all the time).
    task: AtomicWaker,
    /// `WOKEN`, `KILLED` and `WRITTEN`, each set until a wait takes it (one pending signal
    /// each, as a `Notify` permit).
    signals: AtomicU8,
    /// Set (under `control`'s lock) once the connection has closed and detached.
    is_closed: AtomicBool,
    /// Packets encoded by the reader, written by the writer ahead of queued messages; and,
    /// under the same lock, the rarely used parts (why the link was killed, the wait for
    /// its close).
    control: Mutex<Control>,
    /// QoS 1 PUBLISH packets received whose PUBACK is not written yet (inbound Receive
    /// Maximum, with the QoS 2 ones awaiting PUBREL; the reader stops reading at 65,535).
    unanswered_qos1: AtomicU32,
    /// The reader waits for the control buffer to drain: the next write signals `WRITTEN`.
    reader_waits: AtomicBool,
    /// The client's Maximum Packet Size, in bytes (unlimited until CONNECT says; MQTT's is a
    /// Four Byte Integer, so `u32::MAX` is unlimited).
    max_packet_size: AtomicU32,
    /// The client's IPv4 address and port, packed by [`pack_v4`] (0: not known, or IPv6,
    /// which is kept in [`Rare`]): set at CONNECT, read by `client show`. (The two counters
    /// above were `usize`; as `u32` they make room for it.)
    peer_v4: AtomicU64,
    /// The keep alive deadline, in the milliseconds of [`crate::keep_alive::KeepAlive`]: 0
    /// while never armed, `u64::MAX` while disarmed.
    keep_alive: AtomicU64,
    /// Parking (`connection::park`): where the connection's reader and writer wait now
    /// (`READER_AT_REST`, `WRITER_AT_REST`), `RESUMED` for the reader's start, `WATCHED` once
    /// the parking's sweep looks at this link. (These three fields fit in what was padding.)
    rest: AtomicU8,
    /// Reads and writes done on the connection, counted (wrapping).
    activity: AtomicU16,
    /// `activity` when the parking's sweep looked last.
    activity_seen: AtomicU16,
}

/// The reader waits in its socket read with an empty buffer.
pub(crate) const READER_AT_REST: u8 = 1;
/// The writer waits for a wake-up with nothing to write.
pub(crate) const WRITER_AT_REST: u8 = 2;
/// The connection is served again after a park: the reader goes on with the keep alive
/// deadline armed before (it moves only when packets come).
pub(crate) const RESUMED: u8 = 4;
/// The parking's sweep has this link in its list.
const WATCHED: u8 = 8;

/// [`Link::wake`] was called and not waited for yet.
const WOKEN: u8 = 1;
/// [`Link::kill`] was called and not waited for yet.
const KILLED: u8 = 2;
/// [`Link::wrote`] found the reader waiting for room in the control buffer.
const WRITTEN: u8 = 4;
/// The parking's sweep found the connection idle: its task checks, and parks.
const PARK: u8 = 8;

// Every connection holds an `Arc<Link>`; 112 bytes or less, it is one of jemalloc's 128-byte
// class (16 bytes of counts included), not the 160-byte one.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Link>() <= 112);

/// The control buffer and how many PUBACKs it holds; and what is rarely used, each a
/// pointer until then (an idle link is in memory for as long as its connection).
#[derive(Debug, Default)]
struct Control {
    buf: BytesMut,
    /// PUBACKs among `buf`'s packets (a `u32`, as `unanswered_qos1` which bounds it; the
    /// room left holds `shard`).
    pubacks: u32,
    /// The shard serving the connection now (or last, while parked), when the broker has
    /// more than one (`shards`; at most 256).
    shard: u8,
    /// Boxed: most links are never killed, never re-authenticate and are never waited for
    /// (a reason is 32 bytes; and a link of 112 bytes or less is an `Arc` allocation in
    /// jemalloc's 128-byte class, not the 160-byte one).
    rare: Option<Box<Rare>>,
}

/// What few links use, in one box.
#[derive(Debug, Default)]
struct Rare {
    /// Why the link was killed, until taken.
    kill_reason: Option<(DisconnectReason, ReasonCode)>,
    /// The Authentication Method of the connection's enhanced authentication (a
    /// re-authentication must use it [MQTT-4.12.1-1]).
    auth: Option<String>,
    /// The client's address when it is an IPv6 one (an IPv4 one is in `Link::peer_v4`).
    peer_v6: Option<SocketAddr>,
    /// What [`Link::wait_closed`] waits on, made by the first wait (only a takeover or a
    /// shutdown waits for a link's close).
    closed: Option<Arc<Notify>>,
}

/// An IPv4 address and port in one word: bit 48 set (so that 0 is "none"), the address in
/// bits 16 to 47, the port in bits 0 to 15.
fn pack_v4(ip: Ipv4Addr, port: u16) -> u64 {
    1 << 48 | u64::from(u32::from(ip)) << 16 | u64::from(port)
}

/// The address [`pack_v4`] packed, `None` for 0.
fn unpack_v4(packed: u64) -> Option<SocketAddr> {
    if packed == 0 {
        return None;
    }
    let ip = Ipv4Addr::from((packed >> 16) as u32);
    Some(SocketAddr::new(IpAddr::V4(ip), packed as u16))
}

impl Link {
    pub(crate) fn new() -> Link {
        Link {
            task: AtomicWaker::new(),
            signals: AtomicU8::new(0),
            is_closed: AtomicBool::new(false),
            control: Mutex::new(Control::default()),
            unanswered_qos1: AtomicU32::new(0),
            reader_waits: AtomicBool::new(false),
            max_packet_size: AtomicU32::new(u32::MAX),
            peer_v4: AtomicU64::new(0),
            keep_alive: AtomicU64::new(0),
            rest: AtomicU8::new(0),
            activity: AtomicU16::new(0),
            activity_seen: AtomicU16::new(0),
        }
    }

    /// A connection's serving starts (again, with `resumed`): nothing at rest yet, and the
    /// sweep's next look does not find it idle. True when the sweep does not watch it yet (the
    /// caller hands it over, once).
    pub(crate) fn serving(&self, resumed: bool) -> bool {
        let flags = if resumed { RESUMED } else { 0 };
        let before = self.rest.swap(flags | WATCHED, Ordering::Relaxed);
        let activity = self.activity.load(Ordering::Relaxed);
        self.activity_seen
            .store(activity.wrapping_sub(1), Ordering::Relaxed);
        before & WATCHED == 0
    }

    /// Marks the reader or the writer (`bit`) at rest or not.
    pub(crate) fn set_rest(&self, bit: u8, at_rest: bool) {
        if at_rest {
            self.rest.fetch_or(bit, Ordering::Relaxed);
        } else {
            self.rest.fetch_and(!bit, Ordering::Relaxed);
        }
    }

    /// Takes the `RESUMED` mark: true once after a resume.
    pub(crate) fn take_resumed(&self) -> bool {
        self.rest.fetch_and(!RESUMED, Ordering::Relaxed) & RESUMED != 0
    }

    /// Counts a read or a write.
    pub(crate) fn active(&self) {
        self.activity.fetch_add(1, Ordering::Relaxed);
    }

    /// True when both halves wait with nothing in hand and nothing is signalled: the
    /// connection may park now.
    pub(crate) fn at_rest(&self) -> bool {
        let both = READER_AT_REST | WRITER_AT_REST;
        self.rest.load(Ordering::Relaxed) & both == both && !self.signalled()
    }

    /// The parking's sweep: asks the connection to park when nothing was read or written
    /// since the last look and it is at rest now.
    pub(crate) fn park_if_idle(&self) {
        let activity = self.activity.load(Ordering::Relaxed);
        let seen = self.activity_seen.swap(activity, Ordering::Relaxed);
        if activity == seen && self.at_rest() {
            self.signal(PARK);
        }
    }

    /// Asks the connection to park as soon as it is at rest, idle or not: it is then served
    /// again, at its next packet, on the shard `Shards::place` picks (`shards`).
    pub(crate) fn park_now(&self) {
        self.signal(PARK);
    }

    /// Notes the shard serving the connection now.
    pub(crate) fn set_shard(&self, shard: usize) {
        self.control.lock().shard = u8::try_from(shard).unwrap_or(u8::MAX);
    }

    /// The shard serving the connection (as last noted by [`Link::set_shard`]).
    pub(crate) fn shard(&self) -> usize {
        usize::from(self.control.lock().shard)
    }

    /// Ready (once) when the sweep's [`Link::park_if_idle`] asked since the last call (only
    /// the link's own task calls it).
    pub(crate) fn poll_park(&self, cx: &mut std::task::Context<'_>) -> Poll<()> {
        self.poll_signal(cx, PARK)
    }

    /// Arms the keep alive deadline `at` (milliseconds, above 0); true the first time (the
    /// link is not watched yet).
    pub(crate) fn arm_keep_alive(&self, at: u64) -> bool {
        self.keep_alive.swap(at, Ordering::AcqRel) == 0
    }

    /// Disarms the keep alive deadline (the link stays watched).
    pub(crate) fn disarm_keep_alive(&self) {
        self.keep_alive.store(u64::MAX, Ordering::Release);
    }

    /// True, once, when the armed deadline is `now` or earlier (milliseconds): it is then
    /// disarmed.
    pub(crate) fn keep_alive_expired(&self, now: u64) -> bool {
        let at = self.keep_alive.load(Ordering::Acquire);
        at != 0
            && at <= now
            && self
                .keep_alive
                .compare_exchange(at, u64::MAX, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// The keep alive deadline as [`Link::arm_keep_alive`] took it (0: never armed,
    /// `u64::MAX`: disarmed).
    pub(crate) fn keep_alive_at(&self) -> u64 {
        self.keep_alive.load(Ordering::Acquire)
    }

    /// Puts back a deadline read by [`Link::keep_alive_at`]: a parked connection's stays armed.
    pub(crate) fn restore_keep_alive(&self, at: u64) {
        self.keep_alive.store(at, Ordering::Release);
    }

    /// Makes `waker` the one a wake-up or a kill wakes (a parked connection's).
    pub(crate) fn set_waker(&self, waker: &std::task::Waker) {
        self.task.register(waker);
    }

    /// True when a wake-up or a kill is waiting to be taken.
    pub(crate) fn signalled(&self) -> bool {
        self.signals.load(Ordering::Acquire) & (WOKEN | KILLED) != 0
    }

    /// True once the connection has closed and detached ([`Link::mark_closed`]).
    pub(crate) fn is_closed(&self) -> bool {
        self.is_closed.load(Ordering::Acquire)
    }

    /// Sets the client's Maximum Packet Size, in bytes, which [`Link::send`] respects.
    pub(crate) fn set_max_packet_size(&self, max: usize) {
        let max = u32::try_from(max).unwrap_or(u32::MAX);
        self.max_packet_size.store(max, Ordering::Relaxed);
    }

    /// Records the client's address (the one a PROXY protocol header gave, if any), for
    /// [`Link::peer`].
    pub(crate) fn set_peer(&self, peer: SocketAddr) {
        match peer {
            SocketAddr::V4(v4) => {
                self.peer_v4
                    .store(pack_v4(*v4.ip(), v4.port()), Ordering::Relaxed);
            }
            SocketAddr::V6(_) => {
                self.control
                    .lock()
                    .rare
                    .get_or_insert_with(Box::default)
                    .peer_v6 = Some(peer);
            }
        }
    }

    /// The client's address, once its CONNECT was accepted (`None` for an in-process or
    /// bridge link).
    pub(crate) fn peer(&self) -> Option<SocketAddr> {
        unpack_v4(self.peer_v4.load(Ordering::Relaxed))
            .or_else(|| self.control.lock().rare.as_ref().and_then(|r| r.peer_v6))
    }

    /// Wakes the writer: something was queued.
    pub(crate) fn wake(&self) {
        self.signal(WOKEN);
    }

    /// Waits for the next [`Link::wake`] (a wake-up before the wait counts, once). Only the
    /// link's own task waits on a link.
    /// (Not an `async fn`, whose future would hold `self` twice: an idle connection waits on
    /// it all the time.)
    pub(crate) fn wait_woken(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.wait(WOKEN)
    }

    fn signal(&self, bit: u8) {
        self.signals.fetch_or(bit, Ordering::AcqRel);
        self.task.wake();
    }

    /// Resolves once `bit` is set, and clears it. No waiter of its own: the task's waker is
    /// registered before the check, so a signal after it wakes the task.
    fn wait(&self, bit: u8) -> impl std::future::Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| self.poll_signal(cx, bit))
    }

    /// [`Link::wait`]'s poll.
    fn poll_signal(&self, cx: &mut std::task::Context<'_>, bit: u8) -> Poll<()> {
        self.task.register(cx.waker());
        if self.signals.fetch_and(!bit, Ordering::AcqRel) & bit != 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Asks the connection to close, sending DISCONNECT `rc` to a 5.0 client.
    pub(crate) fn kill(&self, reason: DisconnectReason, rc: ReasonCode) {
        let mut control = self.control.lock();
        let rare = control.rare.get_or_insert_with(Default::default);
        if rare.kill_reason.is_none() {
            rare.kill_reason = Some((reason, rc));
        }
        drop(control);
        self.signal(KILLED);
    }

    /// Waits for [`Link::kill`] (a kill before the wait counts, once). Only the link's own
    /// task waits on a link.
    pub(crate) fn wait_killed(&self) -> impl std::future::Future<Output = ()> + '_ {
        self.wait(KILLED)
    }

    /// Waits until the connection has closed and detached from its session.
    pub(crate) async fn wait_closed(&self) {
        loop {
            // Made or taken under the lock `mark_closed` sets the flag under: either the flag
            // is seen here, or `mark_closed` finds this `Notify` and wakes its waiters (a
            // `Notified` hears `notify_waiters` from its creation on, enabled or not).
            let closed = {
                let mut control = self.control.lock();
                if self.is_closed.load(Ordering::Acquire) {
                    return;
                }
                let rare = control.rare.get_or_insert_with(Default::default);
                Arc::clone(rare.closed.get_or_insert_with(Default::default))
            };
            let notified = closed.notified();
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
        self.control
            .lock()
            .rare
            .as_mut()
            .and_then(|r| r.kill_reason.take())
    }

    /// Records the Authentication Method the connection authenticated with (MQTT 5.0
    /// section 4.12), for its re-authentications.
    pub(crate) fn set_auth_method(&self, method: String) {
        let mut control = self.control.lock();
        control.rare.get_or_insert_with(Default::default).auth = Some(method);
    }

    /// The Authentication Method the connection authenticated with and the client's
    /// address ([`Link::set_peer`]), if it used one.
    pub(crate) fn auth_method(&self) -> Option<(String, SocketAddr)> {
        let method = self
            .control
            .lock()
            .rare
            .as_ref()
            .and_then(|r| r.auth.clone())?;
        Some((method, self.peer()?))
    }

    /// Marks the connection closed and detached: wakes [`Link::wait_closed`].
    pub(crate) fn mark_closed(&self) {
        let closed = {
            let control = self.control.lock();
            self.is_closed.store(true, Ordering::Release);
            control.rare.as_ref().and_then(|r| r.closed.clone())
        };
        if let Some(closed) = closed {
            closed.notify_waiters();
        }
    }

    /// Encodes a packet for the writer and wakes it. A packet larger than the client's
    /// Maximum Packet Size is never sent [MQTT-3.1.2-24] (a SUBACK for very many filters, say):
    /// the connection is closed instead (MQTT 5: DISCONNECT 0x95 Packet too large).
    pub(crate) fn send(&self, packet: &Packet, version: ProtocolVersion) {
        let mut control = self.control.lock();
        let before = control.buf.len();
        if let Err(e) = codec::encode(packet, version, &mut control.buf) {
            tracing::error!("cannot encode {}: {e}", packet.name());
        }
        let size = control.buf.len() - before;
        if size > self.max_packet_size.load(Ordering::Relaxed) as usize {
            control.buf.truncate(before);
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
        if let Packet::PubAck(_) = packet {
            control.pubacks = control.pubacks.saturating_add(1);
        }
        drop(control);
        self.wake();
    }

    /// Appends the packets waiting for the writer to `buf`, leaving none. Returns how many
    /// PUBACKs they hold (for [`Link::wrote`] once written).
    pub(crate) fn drain_control_into(&self, buf: &mut BytesMut) -> usize {
        let mut control = self.control.lock();
        if !control.buf.is_empty() {
            buf.extend_from_slice(&control.buf);
            // Released, not kept: an idle link holds no buffer.
            control.buf = BytesMut::new();
        }
        std::mem::take(&mut control.pubacks) as usize
    }

    /// True when no packet waits for the writer.
    pub(crate) fn control_is_empty(&self) -> bool {
        self.control.lock().buf.is_empty()
    }

    /// The packets waiting for the writer, taken (the last bytes of a closing connection).
    pub(crate) fn take_control(&self) -> BytesMut {
        std::mem::take(&mut self.control.lock().buf)
    }

    /// QoS 1 PUBLISH packets received and not answered on the socket yet.
    pub(crate) fn unanswered_qos1(&self) -> usize {
        self.unanswered_qos1.load(Ordering::Acquire) as usize
    }

    /// A QoS 1 PUBLISH was received: it counts until its PUBACK is written.
    pub(crate) fn qos1_received(&self) {
        self.unanswered_qos1.fetch_add(1, Ordering::AcqRel);
    }

    /// True when the reader must stop reading: the answers it left are over the limit.
    pub(crate) fn control_full(&self) -> bool {
        self.control.lock().buf.len() > CONTROL_LIMIT
    }

    /// Waits until the writer has taken the control buffer under its limit; false when no
    /// write went out for `patience` (the client does not read its socket).
    pub(crate) async fn wait_control_room(&self, patience: Duration) -> bool {
        let mut give_up = tokio::time::Instant::now() + patience;
        loop {
            // A signal left from before this wait is stale.
            self.signals.fetch_and(!WRITTEN, Ordering::AcqRel);
            self.reader_waits.store(true, Ordering::Release);
            if !self.control_full() {
                self.reader_waits.store(false, Ordering::Release);
                return true;
            }
            tokio::select! {
                // A write went out: progress, so the patience starts again.
                _ = self.wait(WRITTEN) => give_up = tokio::time::Instant::now() + patience,
                _ = tokio::time::sleep_until(give_up) => return !self.control_full(),
            }
        }
    }

    /// The writer wrote to the socket, `pubacks` PUBACKs among what it wrote.
    pub(crate) fn wrote(&self, pubacks: usize) {
        if pubacks > 0 {
            let pubacks = u32::try_from(pubacks).unwrap_or(u32::MAX);
            self.unanswered_qos1.fetch_sub(pubacks, Ordering::AcqRel);
        }
        if self.reader_waits.swap(false, Ordering::AcqRel) {
            self.signal(WRITTEN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clients_address_is_kept_for_ipv4_and_ipv6() {
        let link = Link::new();
        assert_eq!(link.peer(), None, "not known before CONNECT");
        for text in [
            "127.0.0.5:1883",
            "0.0.0.0:0",
            "255.255.255.255:65535",
            "[::1]:8883",
        ] {
            let addr: SocketAddr = text.parse().unwrap();
            let link = Link::new();
            link.set_peer(addr);
            assert_eq!(link.peer(), Some(addr), "{text}");
        }
    }

    #[test]
    fn a_link_stays_within_its_memory_budget() {
        // Every connection holds one, parked or not (docs/BENCHMARKS.md, "Parked
        // connections"): the client's address took the room the two counters gave up.
        assert!(
            std::mem::size_of::<Link>() <= 120,
            "{}",
            std::mem::size_of::<Link>()
        );
    }
}
