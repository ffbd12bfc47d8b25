//! Shards: more than one thread serving clients (`mercuriod --threads N`), as N single-thread
//! event loops, each on its own OS thread, each connection served by one of them at a time.
//!
//! Why not one multi-threaded scheduler: below saturation its workers sleep between
//! messages, and every message that a task on one worker hands to a task on another wakes
//! that worker (a futex wake-up and a scheduling of the thread, several times what routing
//! the message costs): two threads cost 1.7 to 3 times the CPU of one at rates one core carries
//! (docs/BENCHMARKS.md, "More than one thread"). Here a shard is a current-thread runtime, as
//! with one thread, and a message crosses threads only when its publisher and a subscriber
//! are served on different shards.
//!
//! Placement ([`Shards::place`], [`Placement`]): with `Fill` (the default) a connection goes
//! to the first shard that is not busy (its thread used less than [`Thresholds::fill`] per
//! mille of a core over the last samples), so a load one core carries stays on shard 0 and
//! costs what it costs with one thread; the next shard takes connections only once the first
//! is busy. Connections are placed when accepted and each time they are served again after a
//! park (new connections park as soon as their CONNECT is answered, so each is placed again
//! at its first packet). A shard over [`Thresholds::high`] while another is under
//! [`Thresholds::low`] asks one of its connections at a time to park ([`Link::park_now`]): it
//! is served again, at its next packet, where placement says (counted in `clients/moved` when
//! that is another shard). With `Spread` connections are dealt out in turn when
//! accepted and stay where they are.
//!
//! What stays on shard 0 (the thread that starts the broker): the listeners' accept loops,
//! the parking, the storage writer, `$SYS`, bridges and the cluster. What a message shares
//! between shards: the subscription index (a read lock), the receiving session's state (its
//! own lock), the counters (atomic adds) and, for a subscriber on another shard, the wake-up
//! of its writer there (an `eventfd` write when that shard's thread sleeps).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::link::Link;

/// How often each shard samples its thread's CPU time (each sample wakes the thread: an idle
/// broker's threads wake 4 times a second each).
const SAMPLE: Duration = Duration::from_millis(250);

/// When [`Placement::Fill`] fills a shard and moves connections off it: shares of a core
/// (per mille, 0 to 1000) that a shard's thread used over the last samples (one every 250
/// ms, smoothed over about half a second). `mercuriod` uses the default; an embedding
/// application sets others with [`Shards::start_with`] (a test, say, that wants connections
/// to move whatever the load: `fill: 0, high: 0, low: 1001`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thresholds {
    /// A shard that used less than this takes new connections and those served again after a
    /// park (the first such shard; when none does, the least busy). Default 600.
    pub fill: u32,
    /// A shard that used more than this asks one of its connections at a time to move, while
    /// another shard used less than `low`. Default 850.
    pub high: u32,
    /// See `high`; above 1000, every other shard counts as having room. Default 500.
    pub low: u32,
    /// A busy shard asks one connection to move at most this often. Default 500 ms.
    pub move_every: Duration,
}

impl Default for Thresholds {
    fn default() -> Thresholds {
        Thresholds {
            fill: 600,
            high: 850,
            low: 500,
            move_every: Duration::from_millis(500),
        }
    }
}

thread_local! {
    /// The shard this thread runs (`usize::MAX`: none).
    static CURRENT: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The links served on this thread's shard, by address: the candidates to move.
    static SERVED: RefCell<HashMap<usize, Weak<Link>>> = RefCell::new(HashMap::new());
}

/// How [`Shards::place`] picks a shard for a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// The first shard that is not busy (the default): a load one core carries stays on one
    /// thread, and costs what it costs with one thread; busy shards hand connections on.
    #[default]
    Fill,
    /// Each shard in turn: every thread serves clients from the start, for a load known to
    /// need them all; messages between connections on different shards cross threads, which
    /// costs CPU below saturation.
    Spread,
}

/// One shard: its runtime's handle and how busy its thread is.
struct Shard {
    handle: Handle,
    /// The share of a core its thread used over the last samples, per mille (smoothed).
    busy: AtomicU32,
}

/// The shards of a broker serving clients on more than one thread (`BrokerBuilder::shards`).
/// Made by [`Shards::start`]; shard 0 is the runtime that calls it.
pub struct Shards {
    shards: Vec<Shard>,
    placement: Placement,
    /// When placement fills a shard and moves connections off it.
    thresholds: Thresholds,
    /// The next shard of [`Placement::Spread`] (wrapping).
    next: AtomicUsize,
    /// Each other shard's thread runs until its sender here is dropped.
    threads: parking_lot::Mutex<Vec<(oneshot::Sender<()>, std::thread::JoinHandle<()>)>>,
}

impl Shards {
    /// Starts `n` shards (1 to 256): shard 0 is the current-thread runtime this is called
    /// in, the others are new threads (`mercurio-shard-K`), each with its own current-thread
    /// runtime, until [`Shards::stop`]; connections are placed by `placement`, with the
    /// default [`Thresholds`]. Errors: a thread or a runtime cannot be made, or this is not
    /// called in a current-thread tokio runtime.
    pub fn start(n: usize, placement: Placement) -> std::io::Result<Arc<Shards>> {
        Shards::start_with(n, placement, Thresholds::default())
    }

    /// [`Shards::start`] with `thresholds` for [`Placement::Fill`] (unused with `Spread`).
    /// Errors: as [`Shards::start`].
    pub fn start_with(
        n: usize,
        placement: Placement,
        thresholds: Thresholds,
    ) -> std::io::Result<Arc<Shards>> {
        let here = Handle::try_current()
            .ok()
            .filter(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread)
            .ok_or_else(|| std::io::Error::other("shards start in a current-thread runtime"))?;
        // A link notes its shard in a byte.
        let n = n.clamp(1, 256);
        let mut handles = vec![here];
        let mut threads = Vec::new();
        for k in 1..n {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            let thread = std::thread::Builder::new()
                .name(format!("mercurio-shard-{k}"))
                .spawn(move || {
                    CURRENT.set(k);
                    let _ = runtime.block_on(stopped);
                    // Connections still served here (a stopped broker's) are not waited for.
                    runtime.shutdown_timeout(Duration::from_millis(500));
                })?;
            threads.push((stop, thread));
        }
        CURRENT.set(0);
        let shards = Arc::new(Shards {
            shards: handles
                .into_iter()
                .map(|handle| Shard {
                    handle,
                    busy: AtomicU32::new(0),
                })
                .collect(),
            placement,
            thresholds,
            next: AtomicUsize::new(0),
            threads: parking_lot::Mutex::new(threads),
        });
        for (k, shard) in shards.shards.iter().enumerate() {
            shard.handle.spawn(sample(Arc::downgrade(&shards), k));
        }
        Ok(shards)
    }

    /// The number of shards.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Always false: there is at least one shard.
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// Stops the shards' threads (after the broker has stopped) and waits for them.
    pub fn stop(&self) {
        for (stop, thread) in std::mem::take(&mut *self.threads.lock()) {
            drop(stop);
            let _ = thread.join();
        }
    }

    /// The shard the calling thread runs, if it runs one.
    pub(crate) fn current() -> Option<usize> {
        Some(CURRENT.get()).filter(|&k| k != usize::MAX)
    }

    /// Where an accepted connection is served: with [`Placement::Fill`], the first shard
    /// under [`Thresholds::fill`], else the least busy; with [`Placement::Spread`], the next
    /// in turn.
    pub(crate) fn place(&self) -> usize {
        if self.placement == Placement::Spread {
            return self.next.fetch_add(1, Ordering::Relaxed) % self.shards.len();
        }
        self.place_fill()
    }

    /// Where a connection that parked is served again: with [`Placement::Fill`], as a new
    /// one; with [`Placement::Spread`], where it was (`link`'s shard).
    pub(crate) fn place_again(&self, link: &Link) -> usize {
        match self.placement {
            Placement::Fill => self.place_fill(),
            Placement::Spread => link.shard().min(self.shards.len() - 1),
        }
    }

    /// The first shard under [`Thresholds::fill`], else the least busy.
    fn place_fill(&self) -> usize {
        let mut least = (u32::MAX, 0);
        for (k, shard) in self.shards.iter().enumerate() {
            let busy = shard.busy.load(Ordering::Relaxed);
            if busy < self.thresholds.fill {
                return k;
            }
            least = least.min((busy, k));
        }
        least.1
    }

    /// Runs `task` on shard `k`.
    pub(crate) fn spawn<F>(&self, k: usize, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        drop(self.shards[k].handle.spawn(task));
    }

    /// Notes that `link` is served on this thread's shard (a candidate to move), until
    /// [`Shards::not_serving`].
    pub(crate) fn serving(link: &Arc<Link>) {
        if let Some(k) = Shards::current() {
            link.set_shard(k);
            SERVED.with_borrow_mut(|s| {
                s.insert(Arc::as_ptr(link) as usize, Arc::downgrade(link));
            });
        }
    }

    /// `link`'s connection parks or closes: no longer a candidate to move (the list holds
    /// only connections being served, and closed ones are not kept).
    pub(crate) fn not_serving(link: &Arc<Link>) {
        if Shards::current().is_some() {
            SERVED.with_borrow_mut(|s| s.remove(&(Arc::as_ptr(link) as usize)));
        }
    }
}

/// A shard's sampler: every [`SAMPLE`], how much of a core its thread used; when it is over
/// [`Thresholds::high`] and another shard is under [`Thresholds::low`], one of its
/// connections is asked to move.
async fn sample(shards: Weak<Shards>, k: usize) {
    let mut tick = tokio::time::interval(SAMPLE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = (Instant::now(), thread_cpu());
    let mut moved = Instant::now();
    let mut turn = 0;
    loop {
        tick.tick().await;
        let Some(shards) = shards.upgrade() else {
            return;
        };
        let now = (Instant::now(), thread_cpu());
        let wall = now.0.duration_since(last.0).as_nanos().max(1);
        let used = now.1.saturating_sub(last.1).as_nanos();
        last = now;
        let sampled = (used * 1000 / wall).min(1000) as u32;
        // Smoothed over about half a second: one slow turn does not move connections.
        let busy = &shards.shards[k].busy;
        let smoothed = (busy.load(Ordering::Relaxed) + sampled) / 2;
        busy.store(smoothed, Ordering::Relaxed);
        let idle_elsewhere = shards
            .shards
            .iter()
            .enumerate()
            .any(|(j, s)| j != k && s.busy.load(Ordering::Relaxed) < shards.thresholds.low);
        if shards.placement == Placement::Fill
            && smoothed > shards.thresholds.high
            && idle_elsewhere
            && moved.elapsed() >= shards.thresholds.move_every
        {
            moved = Instant::now();
            turn += 1;
            move_one(turn);
        }
    }
}

/// Asks one connection served on this thread's shard to park, to be served again where
/// [`Shards::place_again`] says. `turn` counts the asks: each picks the next connection (one
/// not at rest when asked does not move, and the next ask goes to another).
fn move_one(turn: usize) {
    SERVED.with_borrow_mut(|served| {
        // Parked and closed connections take themselves out (`Shards::not_serving`).
        if served.is_empty() {
            return;
        }
        if let Some(link) = served
            .values()
            .nth(turn % served.len())
            .and_then(Weak::upgrade)
        {
            link.park_now();
        }
    });
}

/// The CPU time this thread has used (zero where it cannot be read: no shard is ever busy
/// then, and placement keeps every connection on shard 0).
#[cfg(not(unix))]
fn thread_cpu() -> Duration {
    Duration::ZERO
}

/// The CPU time this thread has used.
#[cfg(unix)]
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to; the clock id is a constant.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
