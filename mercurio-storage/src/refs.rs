//! Reference accounting of the message store, shared by the SQL backends: how many references
//! (queued deliveries, in-flight messages) each stored message gains and loses in a batch, so
//! that a backend updates each message's count once per batch instead of keeping an index of
//! every reference.
//!
//! A backend records each reference it adds ([`Refs::add`], with the index of the change, to
//! name it if the message is not stored) and each it removes ([`Refs::remove`]), and the
//! releases ([`Refs::release`]); at the end of the batch it adds each message's net change to
//! its stored count (`refs`), refuses the batch when an added reference's message is not
//! stored, and deletes the released messages left with no reference. A further kind of
//! reference (e.g. an index of stream offsets) counts through the same calls.

use std::collections::BTreeMap;

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
    /// A reference was removed or a message released: released messages left without
    /// references are to be deleted.
    sweep: bool,
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
        self.sweep = true;
    }

    /// A message was released: it goes once nothing refers to it.
    pub(crate) fn release(&mut self) {
        self.sweep = true;
    }

    /// Whether released messages may have lost their last reference in this batch.
    pub(crate) fn sweeps(&self) -> bool {
        self.sweep
    }

    /// Each message touched, with its net change; emptied.
    pub(crate) fn take(&mut self) -> BTreeMap<u64, Delta> {
        std::mem::take(&mut self.deltas)
    }
}
