//! Parking: idle connections held as a socket and a small record instead of a task.
//!
//! A connection idle for `[server] park_after` seconds (the connection code decides when:
//! `connection::park`) hands its record here and its task ends. One epoll set per broker,
//! waited on by one task, watches the parked sockets for input (or a hang-up); while parked,
//! the link's waker is a [`Token`] that puts the record on a resume list (a delivery, a kill:
//! takeover, shutdown, keep alive expiry, an administrator). Either way the record is taken
//! out and [`Resume::resume`] serves the connection again in a new task. This module knows
//! nothing of what a record holds: it sits below the connection code and the broker.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::task::{Wake, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;

use crate::link::Link;
use crate::stats::Counters;

/// A stream whose connection may be parked when idle. Only plain TCP can be (its socket
/// holds no state of its own); TLS and WebSocket streams keep the default.
pub(crate) trait Park: Sized {
    /// Whether connections on this stream park.
    const PARKS: bool = false;

    /// The socket, deregistered from tokio; `None` when it cannot be (the stream is then
    /// gone: the connection is closed).
    fn into_parked(self) -> Option<std::net::TcpStream> {
        None
    }
}

impl Park for tokio::net::TcpStream {
    const PARKS: bool = true;

    fn into_parked(self) -> Option<std::net::TcpStream> {
        match self.into_std() {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::debug!("cannot park a connection: {e}");
                None
            }
        }
    }
}

/// A parked connection's record, as the parking holds it.
pub(crate) trait Resume: Send {
    /// The parked socket.
    fn fd(&self) -> RawFd;
    /// The connection's link: its waker resumes the record while parked.
    fn link(&self) -> &Arc<Link>;
    /// Serves the connection again: first right here, in the parking task's turn (what the
    /// client sent is handled before what others sent later), then in a task of its own.
    /// Called with no lock of the parking held (the connection may park again at once).
    /// The socket is still in the parking's epoll set: `unwatch` takes it out, before it is
    /// served (or parked) again; a record that closes its socket instead lets it go with
    /// [`Unwatch::closing`] (the close takes it out of the set).
    fn resume(self: Box<Self>, unwatch: Unwatch);
}

/// A resumed socket's place in the parking's epoll set, taken out when this is dropped
/// (or [`Unwatch::now`]) unless the socket is closed first ([`Unwatch::closing`]): a
/// connection that only came back to say goodbye costs no `epoll_ctl` for it.
pub(crate) struct Unwatch {
    parking: Arc<Parking>,
    fd: RawFd,
}

impl Unwatch {
    /// Takes the socket out of the parking's epoll set now.
    pub(crate) fn now(self) {
        drop(self);
    }

    /// The socket is about to be closed, which takes it out of the epoll set: nothing to do.
    /// (Its descriptor is its own, never duplicated: closing it ends its registrations.)
    pub(crate) fn closing(mut self) {
        self.fd = -1;
    }
}

impl Drop for Unwatch {
    fn drop(&mut self) {
        if self.fd >= 0 {
            // Fails harmlessly when it was never added.
            let _ = sys::del(self.parking.epoll.get_ref().as_raw_fd(), self.fd);
        }
    }
}

/// The parked connections of a broker and the epoll set that watches their sockets.
pub(crate) struct Parking {
    epoll: AsyncFd<OwnedFd>,
    /// Parked connections by token (the epoll event's data); a token is never reused, so a
    /// late wake-up for a connection resumed already finds nothing.
    parked: Mutex<Records>,
    /// Tokens whose link was woken or killed, for the parking task to resume.
    due: Mutex<Vec<u64>>,
    due_signal: Notify,
    stats: Arc<Counters>,
    /// The links of the connections that may park, until closed (one pointer each): the
    /// sweep asks those idle since its last look to park ([`Link::park_if_idle`]), instead
    /// of a timer per connection.
    watched: Mutex<Vec<Weak<Link>>>,
}

#[derive(Default)]
struct Records {
    next: u64,
    /// Boxed: the table's slots stay 16 bytes, so growing it (thousands of connections
    /// parking at once) moves and doubles little.
    map: HashMap<u64, Box<dyn Resume>>,
}

/// The waker a parked connection's link holds: a delivery or a kill resumes the connection.
struct Token {
    parking: Weak<Parking>,
    id: u64,
}

impl Wake for Token {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(parking) = self.parking.upgrade() {
            parking.due.lock().push(self.id);
            parking.due_signal.notify_one();
        }
    }
}

impl Parking {
    /// Starts the parking of a broker (in a tokio runtime): its socket watcher and its sweep
    /// (every `park_after` seconds). Errors: the epoll set cannot be made (not Linux).
    pub(crate) fn start(stats: Arc<Counters>, park_after: u64) -> std::io::Result<Arc<Parking>> {
        let fd = sys::create()?;
        // SAFETY: an `OwnedFd` returns the same open descriptor for as long as it lives.
        let epoll = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(std::io::Error::from)?;
        let parking = Arc::new(Parking {
            epoll,
            parked: Mutex::default(),
            due: Mutex::default(),
            due_signal: Notify::new(),
            stats,
            watched: Mutex::default(),
        });
        tokio::spawn(Arc::clone(&parking).watch_sockets());
        tokio::spawn(Parking::sweep(
            Arc::downgrade(&parking),
            Duration::from_secs(park_after),
        ));
        Ok(parking)
    }

    /// Adds `link` to the sweep's list (once per link: see [`Link::serving`]).
    pub(crate) fn watch(&self, link: &Arc<Link>) {
        self.watched.lock().push(Arc::downgrade(link));
    }

    /// Every `park_after`, asks the connections idle since the last look to park, and
    /// forgets the closed ones. A connection thus parks after `park_after` to twice that
    /// without a byte read or written.
    async fn sweep(parking: Weak<Parking>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            let Some(parking) = parking.upgrade() else {
                return;
            };
            let mut watched = parking.watched.lock();
            watched.retain(|weak| match weak.upgrade() {
                Some(link) if !link.is_closed() => {
                    link.park_if_idle();
                    true
                }
                _ => false,
            });
            let len = watched.len();
            if len < watched.capacity() / 4 {
                watched.shrink_to(len * 2);
            }
        }
    }

    /// Parks a connection: its socket watched, its link's waker a [`Token`]. Resumed at once
    /// when its link was woken or killed meanwhile.
    pub(crate) fn park(self: &Arc<Self>, record: Box<dyn Resume>) {
        let fd = record.fd();
        let link = Arc::clone(record.link());
        // Under the lock throughout: the parking task takes a record out only once it is
        // completely parked, so the resumed task's own waker always replaces the token.
        let mut records = self.parked.lock();
        let id = records.next;
        records.next += 1;
        records.map.insert(id, record);
        link.set_waker(&Waker::from(Arc::new(Token {
            parking: Arc::downgrade(self),
            id,
        })));
        Counters::add(&self.stats.clients_parked, 1);
        if let Err(e) = sys::add(self.epoll.get_ref().as_raw_fd(), fd, id) {
            tracing::warn!("cannot watch a parked connection: {e}");
            self.due.lock().push(id);
            self.due_signal.notify_one();
        } else if link.signalled() {
            self.due.lock().push(id);
            self.due_signal.notify_one();
        }
    }

    /// Takes a parked connection out and serves it again ([`Resume::resume`]).
    fn resume(self: &Arc<Self>, id: u64) {
        let record = self.parked.lock().map.remove(&id);
        let Some(record) = record else {
            return;
        };
        self.stats.clients_parked.fetch_sub(1, Ordering::Relaxed);
        let unwatch = Unwatch {
            parking: Arc::clone(self),
            fd: record.fd(),
        };
        record.resume(unwatch);
    }

    /// The parking task: resumes the connections whose socket is readable or whose link was
    /// woken.
    async fn watch_sockets(self: Arc<Self>) {
        let mut events = vec![sys::EMPTY; 256];
        loop {
            tokio::select! {
                ready = self.epoll.readable() => {
                    let mut guard = match ready {
                        Ok(g) => g,
                        Err(e) => {
                            tracing::error!("parked connections cannot be watched: {e}");
                            return;
                        }
                    };
                    let n = sys::wait(self.epoll.get_ref().as_raw_fd(), &mut events);
                    if n == 0 {
                        guard.clear_ready();
                        continue;
                    }
                    for e in &events[..n] {
                        self.resume(sys::token(e));
                    }
                    drop(guard);
                    // A resumed connection is first served in this task's turn, and one that
                    // closes there gives back its registration with the runtime only at the
                    // runtime's next look at its sockets: without a yield per batch, a fleet
                    // disconnecting at once would hold every registration until the end.
                    tokio::task::yield_now().await;
                }
                _ = self.due_signal.notified() => {
                    let due = std::mem::take(&mut *self.due.lock());
                    for id in due {
                        self.resume(id);
                    }
                    tokio::task::yield_now().await;
                }
            }
        }
    }
}

/// The epoll calls (Linux); elsewhere creating the set fails, and nothing parks.
#[cfg(target_os = "linux")]
mod sys {
    use super::*;

    pub(super) const EMPTY: libc::epoll_event = libc::epoll_event { events: 0, u64: 0 };

    pub(super) fn create() -> std::io::Result<OwnedFd> {
        // SAFETY: a plain system call; the descriptor it returns is owned from here on.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(super) fn add(epoll: RawFd, fd: RawFd, token: u64) -> std::io::Result<()> {
        // One event, then the socket is left alone until taken out (`del`).
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLONESHOT) as u32,
            u64: token,
        };
        // SAFETY: both descriptors are open (the socket is owned by the parked record).
        let r = unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    pub(super) fn del(epoll: RawFd, fd: RawFd) -> std::io::Result<()> {
        let mut ev = EMPTY;
        // SAFETY: as in `add`.
        let r = unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_DEL, fd, &mut ev) };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The events ready now, without waiting; how many were written to `events`.
    pub(super) fn wait(epoll: RawFd, events: &mut [libc::epoll_event]) -> usize {
        let max = events.len().min(i32::MAX as usize) as i32;
        // SAFETY: `events` has room for `max` events.
        let n = unsafe { libc::epoll_wait(epoll, events.as_mut_ptr(), max, 0) };
        usize::try_from(n).unwrap_or(0)
    }

    pub(super) fn token(e: &libc::epoll_event) -> u64 {
        e.u64
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    use super::*;

    pub(super) const EMPTY: u64 = 0;

    pub(super) fn create() -> std::io::Result<OwnedFd> {
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "parking needs epoll (Linux)",
        ))
    }

    pub(super) fn add(_: RawFd, _: RawFd, _: u64) -> std::io::Result<()> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    pub(super) fn del(_: RawFd, _: RawFd) -> std::io::Result<()> {
        Ok(())
    }

    pub(super) fn wait(_: RawFd, _: &mut [u64]) -> usize {
        0
    }

    pub(super) fn token(e: &u64) -> u64 {
        *e
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn watched(parking: &Arc<Parking>, fd: RawFd, token: u64) -> Unwatch {
        sys::add(parking.epoll.get_ref().as_raw_fd(), fd, token).expect("added to the set");
        Unwatch {
            parking: Arc::clone(parking),
            fd,
        }
    }

    /// A resumed socket leaves the epoll set through `Unwatch`, unless it is closing (then
    /// the close takes it out, and no `epoll_ctl` is spent on it).
    #[tokio::test]
    async fn unwatch_takes_the_socket_out_unless_it_is_closing() {
        let parking = Parking::start(Arc::new(Counters::default()), 60).expect("parking");
        let epoll = parking.epoll.get_ref().as_raw_fd();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let socket =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let fd = socket.as_raw_fd();

        watched(&parking, fd, 1).now();
        assert!(sys::del(epoll, fd).is_err(), "now: out of the set");
        drop(watched(&parking, fd, 2));
        assert!(sys::del(epoll, fd).is_err(), "dropped: out of the set");
        watched(&parking, fd, 3).closing();
        assert!(sys::del(epoll, fd).is_ok(), "closing: left in the set");
        assert_eq!(
            Arc::strong_count(&parking),
            2,
            "this test's and the parking task's: none kept by an Unwatch"
        );
    }
}
