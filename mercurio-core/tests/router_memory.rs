//! A topic level's memory follows its bytes: a filter or retained topic of many empty levels
//! (`//////...`, the cheapest levels a client can send) costs tens of bytes per level in the
//! subscription index and the retained store, not a hash table per level (which took one
//! 520 KB SUBSCRIBE to 390 MiB). Measured with a counting global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use mercurio_core::router::{RetainedStore, SubscriptionIndex};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const LEVELS: usize = 20_000;

/// Bytes still allocated after `f`, per level.
fn per_level(f: impl FnOnce() -> Box<dyn std::any::Any>) -> isize {
    let before = LIVE.load(Ordering::Relaxed);
    let kept = f();
    let used = LIVE.load(Ordering::Relaxed) - before;
    drop(kept);
    used / LEVELS as isize
}

// One test function: the counter is global, tests in parallel would mix their counts.
#[test]
fn a_level_costs_tens_of_bytes() {
    let filter = "/".repeat(LEVELS - 1);
    let index = per_level(|| {
        let mut index = SubscriptionIndex::<u8>::new();
        index.insert(&filter, Arc::from("c"), 1);
        Box::new(index)
    });
    assert!(
        index <= 96,
        "{index} bytes per level in the subscription index"
    );
    let retained = per_level(|| {
        let mut store = RetainedStore::<u8>::new();
        store.insert(&filter, 1);
        Box::new(store)
    });
    assert!(
        retained <= 96,
        "{retained} bytes per level in the retained store"
    );
}
