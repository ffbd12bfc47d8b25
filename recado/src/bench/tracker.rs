//! Which messages a subscriber has seen: one bit per (publisher, sequence number), so that
//! loss and duplicates are counted exactly, whatever the order of arrival.

/// Seen sequence numbers of every publisher, for one subscriber.
#[derive(Default)]
pub struct Tracker {
    seen: Vec<Vec<u64>>,
    /// Distinct messages received.
    pub unique: u64,
    /// Messages received more than once (each extra copy counts).
    pub duplicates: u64,
    /// Messages that arrived after a higher sequence number of the same publisher.
    pub reordered: u64,
    highest: Vec<u64>,
}

impl Tracker {
    /// Notes message `seq` of publisher `publisher`; returns true if it is new.
    pub fn mark(&mut self, publisher: u32, seq: u64) -> bool {
        let p = publisher as usize;
        if self.seen.len() <= p {
            self.seen.resize_with(p + 1, Vec::new);
            self.highest.resize(p + 1, 0);
        }
        let bits = &mut self.seen[p];
        let (word, bit) = ((seq / 64) as usize, seq % 64);
        if bits.len() <= word {
            bits.resize((word + 1).next_power_of_two(), 0);
        }
        let mask = 1u64 << bit;
        if bits[word] & mask != 0 {
            self.duplicates += 1;
            return false;
        }
        bits[word] |= mask;
        self.unique += 1;
        // Sequence numbers start at 1; `highest` 0 means none yet.
        if seq < self.highest[p] {
            self.reordered += 1;
        } else {
            self.highest[p] = seq;
        }
        true
    }

    /// Whether message `seq` of publisher `publisher` was seen.
    pub fn seen(&self, publisher: u32, seq: u64) -> bool {
        let (word, bit) = ((seq / 64) as usize, seq % 64);
        self.seen
            .get(publisher as usize)
            .and_then(|bits| bits.get(word))
            .is_some_and(|w| w & (1u64 << bit) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_unique_duplicates_and_reordering() {
        let mut t = Tracker::default();
        assert!(t.mark(0, 1));
        assert!(t.mark(0, 2));
        assert!(!t.mark(0, 2));
        assert!(t.mark(3, 1000));
        assert!(t.mark(3, 999));
        assert!(!t.mark(3, 1000));
        assert_eq!(t.unique, 4);
        assert_eq!(t.duplicates, 2);
        assert_eq!(t.reordered, 1);
        assert!(t.seen(3, 999) && t.seen(0, 2));
        assert!(!t.seen(0, 3) && !t.seen(7, 1));
    }
}
