//! Routing: the subscription index that finds who receives a PUBLISH, and the store of
//! retained messages (MQTT 5.0 sections 4.7 and 3.3.1.3).
//!
//! Both are topic tries, one node per level. Neither locks for writes: the broker wraps each in
//! a `parking_lot::RwLock`, publishers match under the read lock, SUBSCRIBE / UNSUBSCRIBE and
//! retained PUBLISHes take the write lock.

pub mod index;
pub mod retained;

pub use index::{ClientKey, ClientMatch, Matches, SharedMatch, SubscriptionIndex};
pub use retained::RetainedStore;
