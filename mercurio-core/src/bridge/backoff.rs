//! The pause between two connection attempts of a bridge: doubling from [`Backoff::MIN`] up
//! to [`Backoff::MAX`], each pause drawn at random in its upper half ("equal jitter"), so
//! that many sites cut off together do not reconnect to their central broker in step.

use std::time::Duration;

/// Exponential backoff with jitter, capped.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    attempt: u32,
    min: Duration,
    max: Duration,
}

impl Backoff {
    /// The first pause's ceiling.
    pub(crate) const MIN: Duration = Duration::from_millis(500);
    /// The longest pause.
    pub(crate) const MAX: Duration = Duration::from_secs(30);

    pub(crate) fn new() -> Backoff {
        Backoff::with(Backoff::MIN, Backoff::MAX)
    }

    pub(crate) fn with(min: Duration, max: Duration) -> Backoff {
        Backoff {
            attempt: 0,
            min,
            max: max.max(min),
        }
    }

    /// The next pause: a random duration in the upper half of `min * 2^attempt`, capped at
    /// `max`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .min
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        half + half.mul_f64(random_unit())
    }

    /// After a connection that worked: start again from the shortest pause.
    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// A number in [0, 1) from the standard library's randomly keyed hasher (random enough for
/// jitter; no dependency).
fn random_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_with_jitter_up_to_the_cap() {
        let mut b = Backoff::with(Duration::from_millis(100), Duration::from_secs(1));
        let mut ceilings = Vec::new();
        for _ in 0..8 {
            let d = b.next_delay();
            ceilings.push(d);
        }
        // Attempt n waits between half and all of min * 2^n, capped at max.
        for (n, d) in ceilings.iter().enumerate() {
            let ceiling = Duration::from_millis(100 * (1 << n)).min(Duration::from_secs(1));
            assert!(*d >= ceiling / 2 && *d <= ceiling, "attempt {n}: {d:?}");
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn jitter_varies() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..20 {
            let mut b = Backoff::with(Duration::from_secs(10), Duration::from_secs(10));
            seen.insert(b.next_delay());
        }
        assert!(seen.len() > 1, "no jitter: {seen:?}");
    }
}
