//! `Seen`: which messages a node has taken from NATS, so that a message reaching it through
//! two of its subjects (`a/+` and `a/b` both match `a/b`) is routed once
//! (docs/cluster.md, "Exactly once per subscription").

use std::collections::{HashMap, HashSet, VecDeque};

/// Identifiers kept per origin: a copy of a message comes at most this many messages of the
/// same origin after the first (the NATS client buffers up to `SUBSCRIPTION_CAPACITY`
/// messages per subject, so this covers copies held back in eight full subjects).
pub(crate) const WINDOW: usize = 65_536;

/// Origins kept: a node's incarnations (one per start) beyond this many, the least recently
/// heard from first, are forgotten.
const MAX_ORIGINS: usize = 256;

/// The last [`WINDOW`] sequence numbers taken from each origin.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    origins: HashMap<u64, Recent>,
    /// Bumped at each message, to find the origin heard from least recently.
    clock: u64,
}

#[derive(Debug, Default)]
struct Recent {
    order: VecDeque<u64>,
    set: HashSet<u64>,
    last_used: u64,
}

impl Seen {
    /// True the first time `(origin, seq)` is offered, false for a copy.
    pub(crate) fn first(&mut self, origin: u64, seq: u64) -> bool {
        self.clock += 1;
        if !self.origins.contains_key(&origin) && self.origins.len() >= MAX_ORIGINS {
            if let Some(oldest) = self
                .origins
                .iter()
                .min_by_key(|(_, r)| r.last_used)
                .map(|(o, _)| *o)
            {
                self.origins.remove(&oldest);
            }
        }
        let r = self.origins.entry(origin).or_default();
        r.last_used = self.clock;
        if !r.set.insert(seq) {
            return false;
        }
        r.order.push_back(seq);
        if r.order.len() > WINDOW {
            if let Some(old) = r.order.pop_front() {
                r.set.remove(&old);
            }
        }
        true
    }

    /// Forgets `(origin, seq)`: the message was given back undone, and its next delivery is
    /// to be taken as the first.
    pub(crate) fn forget(&mut self, origin: u64, seq: u64) {
        if let Some(r) = self.origins.get_mut(&origin) {
            if r.set.remove(&seq) {
                r.order.retain(|&s| s != seq);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_refused_once_per_origin() {
        let mut s = Seen::default();
        assert!(s.first(1, 1));
        assert!(s.first(1, 3));
        assert!(s.first(2, 1), "another origin's numbers are its own");
        assert!(!s.first(1, 1));
        assert!(s.first(1, 2), "out of order, but new");
        assert!(!s.first(1, 3));
    }

    #[test]
    fn bounded() {
        let mut s = Seen::default();
        for seq in 0..(WINDOW as u64 + 10) {
            assert!(s.first(7, seq));
        }
        assert_eq!(s.origins[&7].set.len(), WINDOW);
        for origin in 0..(MAX_ORIGINS as u64 + 5) {
            s.first(1000 + origin, 1);
        }
        assert_eq!(s.origins.len(), MAX_ORIGINS);
    }
}
