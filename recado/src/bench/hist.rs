//! A log-linear latency histogram (HdrHistogram's idea in 60 lines): values below 64 are
//! exact, above that each power of two is split into 32 buckets, so a recorded value is known
//! to within 1/32 (about 3 %). Fixed size (1,920 counters), mergeable, allocation-free to
//! record. Values are nanoseconds here, but nothing depends on the unit.

/// Sub-buckets per power of two above 64.
const SUB: u64 = 32;
/// Number of buckets: 64 exact ones, then 32 per power of two from 2^6 to 2^63.
const BUCKETS: usize = 64 + 58 * SUB as usize;

/// A latency histogram. See the module documentation.
#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    min: u64,
    max: u64,
    sum: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
            min: u64::MAX,
            max: 0,
            sum: 0,
        }
    }
}

fn bucket(v: u64) -> usize {
    if v < 64 {
        return v as usize;
    }
    let high = 63 - v.leading_zeros() as u64; // 6..=63
    let shift = high - 5;
    ((high - 5) * SUB + (v >> shift)) as usize
}

/// The highest value that falls in bucket `i`.
fn bucket_high(i: usize) -> u64 {
    if i < 64 {
        return i as u64;
    }
    let k = i as u64 / SUB; // >= 2
    let m = i as u64 % SUB + SUB;
    let shift = k - 1;
    ((m + 1) << shift).wrapping_sub(1).max(m << shift)
}

impl Histogram {
    /// Records one value.
    pub fn record(&mut self, v: u64) {
        self.counts[bucket(v)] += 1;
        self.total += 1;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.sum += u128::from(v);
    }

    /// Adds every value of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.sum += other.sum;
    }

    /// Number of values recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The largest value recorded (exact); 0 when empty.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The mean (exact); 0 when empty.
    pub fn mean(&self) -> u64 {
        if self.total == 0 {
            0
        } else {
            (self.sum / u128::from(self.total)) as u64
        }
    }

    /// The value below or at which a fraction `q` (0 to 1) of the values lie: the upper
    /// edge of the bucket holding that rank, never more than the exact maximum. 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_high(i).min(self.max).max(self.min);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_tight() {
        let mut last = 0;
        for v in (0..200_000u64).chain([u64::MAX / 3, u64::MAX]) {
            let b = bucket(v);
            assert!(b >= last, "bucket order at {v}");
            assert!(b < BUCKETS);
            assert!(bucket_high(b) >= v, "value {v} above its bucket's edge");
            // Relative width of a bucket: at most 1/32.
            assert!(bucket_high(b) - v <= v / 32 + 1, "bucket too wide at {v}");
            last = b;
        }
    }

    #[test]
    fn quantiles_of_a_uniform_range() {
        let mut h = Histogram::default();
        for v in 1..=100_000u64 {
            h.record(v);
        }
        assert_eq!(h.count(), 100_000);
        assert_eq!(h.max(), 100_000);
        assert_eq!(h.mean(), 50_000);
        for (q, exact) in [(0.5, 50_000f64), (0.99, 99_000.0), (0.999, 99_900.0)] {
            let got = h.quantile(q) as f64;
            assert!(
                got >= exact && got <= exact * 1.035,
                "q{q}: {got} vs {exact}"
            );
        }
        assert_eq!(h.quantile(1.0), 100_000);
        assert_eq!(Histogram::default().quantile(0.5), 0);
    }

    #[test]
    fn merge_adds_counts() {
        let mut a = Histogram::default();
        let mut b = Histogram::default();
        a.record(10);
        b.record(1_000_000);
        b.record(5);
        a.merge(&b);
        assert_eq!(a.count(), 3);
        assert_eq!(a.max(), 1_000_000);
        assert_eq!(a.quantile(0.0), 5);
        assert_eq!(a.quantile(0.5), 10);
    }
}
