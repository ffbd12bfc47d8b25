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
//! note their activity ([`BusyPoll::note`]: one relaxed atomic add, and while the spinner
//! sleeps a read of the clock). The spinner sleeps until an activity comes within the window
//! of the one before (events close together); then it yields in a loop
//! (`tokio::task::yield_now`, which the current-thread scheduler answers by polling its
//! sockets without blocking) until a whole window passes with no activity. An isolated event
//! (a keep alive PINGREQ of an idle fleet, a message of a slow steady stream) costs a read of
//! the clock, not a wake-up of the spinner (at a few thousand messages a second the spinner
//! sleeps or rests nearly all the time, and a read would otherwise wake it for nothing).
//! Only the current-thread runtime (mercuriod's default) is served: there the spinner's loop
//! is the runtime's own socket poll; on a multi-threaded runtime it is not started.
//!
//! Polling pays only when the loop is nearly full: then the gaps between events are short and
//! each one it bridges saves a CPU wake-up that would delay the next window. Below that (a fleet
//! publishing at a steady rate far under what the core can carry, events tens of microseconds
//! apart) the spinner would poll through every gap and turn a third of a core into a whole one.
//! So the spinner measures, while it polls, how much of the time the loop's other tasks worked
//! and how much it only polled (the shortest yield of the stretch is what polling alone costs,
//! 1-2 microseconds; what a yield took beyond that, other tasks worked): once [`JUDGE_AFTER`] of polling shows the loop busy less than half the time, it
//! stops and does not poll again for a back-off ([`MIN_BACKOFF`], doubling up to
//! [`MAX_BACKOFF`] while stretches keep failing, reset by one that did not). While it rests
//! nothing wakes it but the end of the rest (or shutdown): activity is only counted.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// How long a polling stretch runs before the spinner judges whether it pays.
const JUDGE_AFTER: Duration = Duration::from_micros(500);
/// The first back-off after a stretch in which the loop was busy less than half the time.
const MIN_BACKOFF: Duration = Duration::from_millis(5);
/// The longest back-off: a load that becomes saturating is polled for within this long.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// The shared half: activity counter and the spinner's wake-up.
pub(crate) struct BusyPoll {
    /// Whether the spinner was started: without it nothing is counted (on a multi-threaded
    /// runtime the counter would be one cache line written by every thread).
    started: AtomicBool,
    /// Network reads that returned data and accepted connections (wrapping; only its
    /// changes matter).
    activity: AtomicU64,
    /// Whether the spinner sleeps, waiting for [`BusyPoll::note`] to wake it (false while it
    /// polls or rests).
    asleep: AtomicBool,
    /// While the spinner sleeps: when the last activity came, in nanoseconds since `epoch`; 0
    /// for none since it slept.
    last_ns: AtomicU64,
    /// The window of "close together", in nanoseconds (set by [`BusyPoll::start`]).
    window_ns: AtomicU64,
    epoch: Instant,
    wake: Notify,
    /// Times the spinner was woken by activity (for tests and debugging).
    wakes: AtomicU64,
    /// Whether the spinner is polling now (for tests and debugging).
    polling: AtomicBool,
    /// Set on shutdown: the spinner ends.
    stopped: AtomicBool,
    /// Polling stretches given up because the loop was mostly idle (for tests and debugging).
    rests: AtomicU64,
}

impl BusyPoll {
    pub(crate) fn new() -> BusyPoll {
        BusyPoll {
            started: AtomicBool::new(false),
            activity: AtomicU64::new(0),
            asleep: AtomicBool::new(false),
            last_ns: AtomicU64::new(0),
            window_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            wake: Notify::new(),
            wakes: AtomicU64::new(0),
            polling: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            rests: AtomicU64::new(0),
        }
    }

    /// Notes network activity (a read that returned data, an accepted connection); wakes the
    /// sleeping spinner when it came within the window of the activity before.
    #[inline]
    pub(crate) fn note(&self) {
        if !self.started.load(Ordering::Relaxed) {
            return;
        }
        self.activity.fetch_add(1, Ordering::Relaxed);
        if self.asleep.load(Ordering::Relaxed) {
            let now = self.nanos(Instant::now());
            let before = self.last_ns.swap(now, Ordering::Relaxed);
            if before != 0 && now.saturating_sub(before) <= self.window_ns.load(Ordering::Relaxed) {
                self.asleep.store(false, Ordering::Relaxed);
                self.wake.notify_one();
            }
        }
    }

    /// `t` in nanoseconds since `epoch` (1 at the least, so that 0 is "no activity yet").
    fn nanos(&self, t: Instant) -> u64 {
        (t.saturating_duration_since(self.epoch).as_nanos() as u64).max(1)
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
        self.window_ns
            .store(window.as_nanos() as u64, Ordering::Relaxed);
        self.started.store(true, Ordering::Relaxed);
        Some(tokio::spawn(Arc::clone(self).run(window)))
    }

    /// Whether the spinner is polling (not asleep) now: the loop is busy.
    pub(crate) fn polling(&self) -> bool {
        self.polling.load(Ordering::Relaxed)
    }

    /// Ends the spinner (at shutdown).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// The spinner: sleeps until two activities come less than `window` apart; then polls
    /// without sleeping while activities keep coming that close and the loop is busy at least
    /// half the time it polls.
    async fn run(self: Arc<Self>, window: Duration) {
        let mut last: Option<Instant> = None;
        let mut backoff = MIN_BACKOFF;
        let mut resting_until: Option<Instant> = None;
        loop {
            if let Some(until) = resting_until.take() {
                // `asleep` is false: activity does not wake a resting spinner, only shutdown.
                let _ = tokio::time::timeout_at(until.into(), self.wake.notified()).await;
                last = None;
            }
            if self.stopped.load(Ordering::Relaxed) {
                return;
            }
            self.last_ns
                .store(last.map_or(0, |t| self.nanos(t)), Ordering::Relaxed);
            self.asleep.store(true, Ordering::Relaxed);
            self.wake.notified().await;
            if self.stopped.load(Ordering::Relaxed) {
                return;
            }
            self.wakes.fetch_add(1, Ordering::Relaxed);
            last = Some(Instant::now());
            match self.poll_stretch(window, &mut last).await {
                Stretch::Paid => backoff = MIN_BACKOFF,
                Stretch::Idle => {
                    resting_until = Some(Instant::now() + backoff);
                    self.rests.fetch_add(1, Ordering::Relaxed);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// Polls until a whole `window` passes with no activity ([`Stretch::Paid`]) or until the
    /// loop has proved to be busy less than half the time it polled ([`Stretch::Idle`]).
    async fn poll_stretch(&self, window: Duration, last: &mut Option<Instant>) -> Stretch {
        let start = Instant::now();
        let mut seen = self.activity.load(Ordering::Relaxed);
        let mut until = start + window;
        // Time the other tasks worked and time the spinner only polled, since `judged`.
        let (mut busy, mut idle) = (Duration::ZERO, Duration::ZERO);
        let mut judged = start;
        // The shortest yield so far: a turn in which only the sockets were polled.
        let mut floor = Duration::MAX;
        self.polling.store(true, Ordering::Relaxed);
        let outcome = loop {
            let before = Instant::now();
            tokio::task::yield_now().await;
            let now = Instant::now();
            let turn = now.duration_since(before);
            floor = floor.min(turn);
            idle += floor;
            busy += turn - floor;
            let activity = self.activity.load(Ordering::Relaxed);
            if activity != seen {
                seen = activity;
                *last = Some(now);
                until = now + window;
            } else if now >= until || self.stopped.load(Ordering::Relaxed) {
                break Stretch::Paid;
            }
            if now.duration_since(judged) >= JUDGE_AFTER {
                if idle > busy {
                    break Stretch::Idle;
                }
                (busy, idle, judged) = (Duration::ZERO, Duration::ZERO, now);
            }
        };
        self.polling.store(false, Ordering::Relaxed);
        outcome
    }
}

/// How a polling stretch ended.
enum Stretch {
    /// A window passed with no activity while the loop was busy enough: polling paid.
    Paid,
    /// The loop was busy less than half the time: polling would only spend CPU.
    Idle,
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

    /// A task that keeps the loop busy: works 20 us (spinning on the clock, as handling a
    /// packet would) between yields, until `stop` is set.
    fn load(stop: Arc<AtomicBool>) -> JoinHandle<()> {
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let until = Instant::now() + Duration::from_micros(20);
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
                tokio::task::yield_now().await;
            }
        })
    }

    #[tokio::test]
    async fn polls_while_activity_comes_close_together_and_the_loop_is_busy() {
        let busy = Arc::new(BusyPoll::new());
        // A window of 300 ms: wide enough that the test's own pauses stay inside it.
        let task = busy.start(300_000).expect("a current-thread runtime");
        until("asleep", || busy.asleep.load(Ordering::Relaxed)).await;
        // An isolated activity does not even wake the spinner.
        busy.note();
        tokio::task::yield_now().await;
        assert!(busy.asleep.load(Ordering::Relaxed));
        assert_eq!(busy.wakes.load(Ordering::Relaxed), 0);
        assert!(!busy.polling());
        // A second one within the window while the loop works: a busy stretch, it polls, and
        // goes on polling well past the point where it judges whether polling pays.
        let stop = Arc::new(AtomicBool::new(false));
        let worker = load(Arc::clone(&stop));
        busy.note();
        until("polling", || busy.polling()).await;
        let judged = Instant::now() + JUDGE_AFTER * 20;
        while Instant::now() < judged {
            busy.note();
            tokio::task::yield_now().await;
            assert!(busy.polling(), "a busy loop is polled");
        }
        assert_eq!(busy.rests.load(Ordering::Relaxed), 0);
        // A window without activity ends it.
        until("done polling", || !busy.polling()).await;
        stop.store(true, Ordering::Relaxed);
        worker.await.expect("the load task ends");
        busy.stop();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the spinner ends on stop")
            .expect("the spinner does not panic");
    }

    #[tokio::test]
    async fn stops_polling_and_rests_when_the_loop_is_mostly_idle() {
        let busy = Arc::new(BusyPoll::new());
        let task = busy.start(300_000).expect("a current-thread runtime");
        until("asleep", || busy.asleep.load(Ordering::Relaxed)).await;
        // Activity close together but nothing to do between: a steady rate far below what
        // the core carries. The spinner starts, finds the loop idle and rests.
        busy.note();
        until("asleep again", || busy.asleep.load(Ordering::Relaxed)).await;
        let before_rest = Instant::now();
        busy.note();
        until("resting", || busy.rests.load(Ordering::Relaxed) == 1).await;
        until("not polling", || !busy.polling()).await;
        // More activity within the back-off (which began after `before_rest`) does not start
        // it again.
        loop {
            busy.note();
            tokio::task::yield_now().await;
            if Instant::now() >= before_rest + MIN_BACKOFF {
                break;
            }
            assert!(!busy.polling(), "no polling while resting");
        }
        busy.stop();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the spinner ends on stop")
            .expect("the spinner does not panic");
    }

    #[tokio::test]
    async fn activities_further_apart_than_the_window_never_wake_the_spinner() {
        let busy = Arc::new(BusyPoll::new());
        let task = busy.start(50).expect("a current-thread runtime");
        until("asleep", || busy.asleep.load(Ordering::Relaxed)).await;
        // A slow steady stream: one read every 2 ms, 40 times the window.
        for _ in 0..20 {
            busy.note();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(
            busy.wakes.load(Ordering::Relaxed),
            0,
            "no wake-up for isolated reads"
        );
        // Two close together do.
        busy.note();
        busy.note();
        until("woken", || busy.wakes.load(Ordering::Relaxed) == 1).await;
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
