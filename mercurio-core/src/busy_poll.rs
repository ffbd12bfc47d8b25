//! Busy polling: while network events come close together, the event loop keeps polling its
//! sockets between them instead of sleeping (`[server] busy_poll`, in microseconds).
//!
//! Why: a broker serving QoS 1/2 through a window of 20 messages, or accepting connections,
//! spends much of each round trip waiting for the next packet, and each time it sleeps its
//! CPU may idle; waking an idle CPU costs the sender an inter-processor interrupt and the
//! broker the CPU's wake-up, tens to hundreds of microseconds on a virtual machine. That
//! time, not the broker's work, then bounds how many messages a window carries per second
//! (docs/BENCHMARKS.md, "Busy polling"). Linux's setting of the same name
//! (`net.core.busy_poll`, `SO_BUSY_POLL`) polls network devices, not the loopback and not an
//! event loop's sockets: this is the event loop's.
//!
//! How: one task, [`BusyPoll::run`], is the spinner. Network reads and accepted connections
//! note their activity ([`BusyPoll::note`]: one relaxed atomic add). The spinner sleeps until an activity comes;
//! when it comes within the window of the one before (events close together), the spinner
//! yields in a loop (`tokio::task::yield_now`, which the current-thread scheduler answers by
//! polling its sockets without blocking) until a whole window passes with no activity. An
//! isolated event (a keep alive PINGREQ of an idle fleet) costs one wake-up of the spinner,
//! not a window of polling. Only the current-thread runtime (mercuriod's default) is served:
//! there the spinner's loop is the runtime's own socket poll; on a multi-threaded runtime it
//! is not started.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// The shared half: activity counter and the spinner's wake-up.
pub(crate) struct BusyPoll {
    /// Whether the spinner was started: without it nothing is counted (on a multi-threaded
    /// runtime the counter would be one cache line written by every thread).
    started: AtomicBool,
    /// Network reads that returned data and accepted connections (wrapping; only its
    /// changes matter).
    activity: AtomicU64,
    /// Whether the spinner sleeps, waiting for [`BusyPoll::note`] to wake it.
    asleep: AtomicBool,
    wake: Notify,
    /// Whether the spinner is polling now (for tests and debugging).
    polling: AtomicBool,
    /// Set on shutdown: the spinner ends.
    stopped: AtomicBool,
}

impl BusyPoll {
    pub(crate) fn new() -> BusyPoll {
        BusyPoll {
            started: AtomicBool::new(false),
            activity: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            wake: Notify::new(),
            polling: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    /// Notes network activity (a read that returned data, an accepted connection).
    #[inline]
    pub(crate) fn note(&self) {
        if !self.started.load(Ordering::Relaxed) {
            return;
        }
        self.activity.fetch_add(1, Ordering::Relaxed);
        if self.asleep.load(Ordering::Relaxed) {
            self.asleep.store(false, Ordering::Relaxed);
            self.wake.notify_one();
        }
    }

    /// Starts the spinner with a window of `micros` microseconds, when that is above 0 and the
    /// runtime is the current-thread one (see the module's comment); `None` when not started.
    pub(crate) fn start(self: &Arc<Self>, micros: u32) -> Option<JoinHandle<()>> {
        let current_thread =
            Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::CurrentThread);
        if micros == 0 {
            return None;
        }
        if !current_thread {
            tracing::info!("busy_poll does not apply with more than one thread: nothing polls");
            return None;
        }
        tracing::info!("busy polling: {micros} us after network activity (busy_poll)");
        let window = Duration::from_micros(u64::from(micros));
        self.started.store(true, Ordering::Relaxed);
        Some(tokio::spawn(Arc::clone(self).run(window)))
    }

    /// Whether the spinner is polling (not asleep) now.
    #[cfg_attr(not(test), allow(dead_code))] // read by the tests only, so far
    pub(crate) fn polling(&self) -> bool {
        self.polling.load(Ordering::Relaxed)
    }

    /// Ends the spinner (at shutdown).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// The spinner: sleeps until activity; polls without sleeping while activities come
    /// less than `window` apart.
    async fn run(self: Arc<Self>, window: Duration) {
        let mut last: Option<Instant> = None;
        loop {
            self.asleep.store(true, Ordering::Relaxed);
            self.wake.notified().await;
            if self.stopped.load(Ordering::Relaxed) {
                return;
            }
            let now = Instant::now();
            let close = last.is_some_and(|t| now.duration_since(t) <= window);
            last = Some(now);
            if !close {
                continue;
            }
            let mut seen = self.activity.load(Ordering::Relaxed);
            let mut until = now + window;
            self.polling.store(true, Ordering::Relaxed);
            loop {
                tokio::task::yield_now().await;
                let now = Instant::now();
                let activity = self.activity.load(Ordering::Relaxed);
                if activity != seen {
                    seen = activity;
                    last = Some(now);
                    until = now + window;
                } else if now >= until || self.stopped.load(Ordering::Relaxed) {
                    break;
                }
            }
            self.polling.store(false, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Yields until `f` holds, for at most 5 s.
    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "still not {what} after 5 s");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn polls_while_activity_comes_close_together_and_sleeps_after_a_window_without() {
        let busy = Arc::new(BusyPoll::new());
        // A window of 300 ms: wide enough that the test's own pauses stay inside it.
        let task = busy.start(300_000).expect("a current-thread runtime");
        until("asleep", || busy.asleep.load(Ordering::Relaxed)).await;
        // An isolated activity wakes the spinner, which goes back to sleep without polling.
        busy.note();
        until("asleep again", || busy.asleep.load(Ordering::Relaxed)).await;
        assert!(!busy.polling());
        // A second one within the window: a busy stretch, the spinner polls.
        busy.note();
        until("polling", || busy.polling()).await;
        // More activity keeps it polling; a window without any ends it.
        busy.note();
        tokio::task::yield_now().await;
        assert!(busy.polling());
        until("done polling", || !busy.polling()).await;
        busy.stop();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the spinner ends on stop")
            .expect("the spinner does not panic");
    }

    #[tokio::test]
    async fn not_started_when_off() {
        assert!(Arc::new(BusyPoll::new()).start(0).is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn not_started_on_a_multi_threaded_runtime() {
        assert!(Arc::new(BusyPoll::new()).start(50).is_none());
    }
}
