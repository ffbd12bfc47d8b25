//! Reference accounting of the message store, shared by the SQL backends: how many references
//! (queued deliveries, in-flight messages) each stored message gains and loses in a batch, so
//! that a backend updates each message's count once per batch instead of keeping an index of
//! every reference.
//!
//! A backend records each reference it adds ([`Refs::add`], with the index of the change, to
//! name it if the message is not stored) and each it removes ([`Refs::remove`]), and the
//! releases ([`Refs::release`]); at the end of the batch it adds each message's net change to
//! its stored count (`refs`), refuses the batch when an added reference's message is not
//! stored, and deletes the released messages left with no reference among those the batch
//! released or took references from ([`Refs::sweep_candidates`]): a cost per message
//! touched, however many released messages are still referred to (a long stream's). A further kind of
//! reference (e.g. an index of stream offsets) counts through the same calls.

use std::collections::{BTreeMap, BTreeSet};

/// One message's net change of references in a batch.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Delta {
    /// References added minus references removed.
    pub(crate) net: i64,
    /// The index of the first change of the batch that added a reference to it: the message
    /// must be stored.
    pub(crate) first_addition: Option<usize>,
}

/// The reference changes of one batch, per message id.
#[derive(Debug, Default)]
pub(crate) struct Refs {
    deltas: BTreeMap<u64, Delta>,
    /// Messages released in the batch.
    released: BTreeSet<u64>,
}

impl Refs {
    /// Change `index` adds a reference to message `id`.
    pub(crate) fn add(&mut self, id: u64, index: usize) {
        let d = self.deltas.entry(id).or_default();
        d.net += 1;
        d.first_addition.get_or_insert(index);
    }

    /// `n` references to message `id` are removed.
    pub(crate) fn remove(&mut self, id: u64, n: i64) {
        self.deltas.entry(id).or_default().net -= n;
    }

    /// Message `id` was released with no reference stored: it goes at the end of the batch
    /// unless the batch gave it one.
    pub(crate) fn release(&mut self, id: u64) {
        self.released.insert(id);
    }

    /// Each message touched, with its net change; emptied.
    pub(crate) fn take(&mut self) -> BTreeMap<u64, Delta> {
        std::mem::take(&mut self.deltas)
    }

    /// The messages that may have become deletable (released, without references) in the
    /// batch: those it released and those of `deltas` (from [`take`](Self::take)) that lost
    /// references; emptied.
    pub(crate) fn sweep_candidates(&mut self, deltas: &BTreeMap<u64, Delta>) -> BTreeSet<u64> {
        let mut out = std::mem::take(&mut self.released);
        out.extend(deltas.iter().filter(|(_, d)| d.net < 0).map(|(id, _)| *id));
        out
    }
}
