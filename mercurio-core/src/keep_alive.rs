//! Keep alive for every connection at once ([`KeepAlive`]): the server closes a connection
//! whose client sent nothing within one and a half times its keep alive [MQTT-3.1.2-24].
//!
//! A timer per connection would cost each idle connection a tokio `Sleep` (112 bytes) for its
//! whole life. Instead a connection's reader arms a deadline in its [`Link`] while it waits for
//! the client's bytes ([`KeepAlive::arm`]), and one sweep task, running while any connection
//! has armed one, checks every [`SWEEP`] and kills the links whose deadline has passed (the
//! connection then closes as after any kill: DISCONNECT 0x8D Keep Alive timeout for a 5.0
//! client, the will published). A connection is thus closed between its deadline and
//! [`SWEEP`] after it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::codec::ReasonCode;
use crate::link::{DisconnectReason, Link};

/// How often the sweep checks the deadlines: how late past its deadline a silent client's
/// connection may be closed.
pub(crate) const SWEEP: Duration = Duration::from_millis(500);

/// The links whose keep alive is watched, and the sweep task that checks them.
#[derive(Debug)]
pub(crate) struct KeepAlive {
    /// Deadlines are kept in milliseconds since this instant (tokio's clock).
    epoch: Instant,
    watched: Mutex<Watched>,
}

#[derive(Debug, Default)]
struct Watched {
    /// Every link that has armed a deadline, until its connection closed (one pointer each).
    links: Vec<Weak<Link>>,
    /// A sweep task is running (it ends when `links` is empty).
    sweeping: bool,
}

impl Default for KeepAlive {
    fn default() -> Self {
        KeepAlive {
            epoch: Instant::now(),
            watched: Mutex::default(),
        }
    }
}

/// An armed deadline: disarmed when dropped (the read it covers is over).
pub(crate) struct Armed<'a>(&'a Link);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.disarm_keep_alive();
    }
}

impl KeepAlive {
    /// Arms `link`'s keep alive: its connection is killed (`KeepAliveTimeout`) once
    /// `deadline` has passed, unless the returned guard is dropped first. Must run in a tokio
    /// runtime (the first link watched starts the sweep task).
    pub(crate) fn arm<'a>(self: &Arc<Self>, link: &'a Arc<Link>, deadline: Instant) -> Armed<'a> {
        // At least 1: 0 stands for a link never watched.
        let at = (deadline.saturating_duration_since(self.epoch).as_millis() as u64).max(1);
        if link.arm_keep_alive(at) {
            let mut w = self.watched.lock();
            w.links.push(Arc::downgrade(link));
            if !w.sweeping {
                w.sweeping = true;
                tokio::spawn(Arc::clone(self).sweep());
            }
        }
        Armed(link)
    }

    /// The deadline armed in `link` (a parked connection's, on resume), if one is.
    pub(crate) fn armed_deadline(&self, link: &Link) -> Option<Instant> {
        let at = link.keep_alive_at();
        (at != 0 && at != u64::MAX).then(|| self.epoch + Duration::from_millis(at))
    }

    /// Every [`SWEEP`], kills the links past their deadline and forgets the closed ones; ends
    /// when no link is left.
    async fn sweep(self: Arc<Self>) {
        let mut tick = tokio::time::interval(SWEEP);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = Instant::now()
                .saturating_duration_since(self.epoch)
                .as_millis() as u64;
            let mut w = self.watched.lock();
            w.links.retain(|weak| {
                let Some(link) = weak.upgrade() else {
                    return false;
                };
                if link.is_closed() {
                    return false;
                }
                if link.keep_alive_expired(now) {
                    link.kill(
                        DisconnectReason::KeepAliveTimeout,
                        ReasonCode::KEEP_ALIVE_TIMEOUT,
                    );
                }
                true
            });
            if w.links.is_empty() {
                w.sweeping = false;
                w.links = Vec::new();
                return;
            }
            let len = w.links.len();
            if len < w.links.capacity() / 4 {
                w.links.shrink_to(len * 2);
            }
        }
    }
}
