//! `Interest`: the topic filters this node's clients subscribe to, as cluster mode announces
//! them to NATS (docs/cluster.md, "Interest"). The broker reports each subscription added to
//! or removed from its index; the cluster link takes the filters whose presence changed.
//! Off (one atomic load per report) unless cluster mode is on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::topic;

/// The filters subscribed to on this node, counted, and the changes not yet taken.
#[derive(Debug, Default)]
pub(crate) struct Interest {
    on: AtomicBool,
    /// The cluster link's own session, whose subscription is not interest.
    own: OnceLock<Arc<str>>,
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// Subscriptions per filter (shared ones by their filter without `$share/{ShareName}/`).
    count: HashMap<String, usize>,
    /// Filters that appeared (true) or disappeared (false) since the last `take`.
    pending: HashMap<String, bool>,
}

impl Interest {
    /// Starts tracking, with `own` (the cluster link's client identifier) left out. Called
    /// before any subscription exists.
    pub(crate) fn start(&self, own: Arc<str>) {
        let _ = self.own.set(own);
        self.on.store(true, Ordering::Release);
    }

    /// The filter a subscription counts under, or `None` when it is not interest: the
    /// cluster link's own, and `$` filters (`$` topics stay on their node).
    fn filter_of<'a>(&self, filter: &'a str, client: &str) -> Option<&'a str> {
        if !self.on.load(Ordering::Acquire) || self.own.get().is_some_and(|o| &**o == client) {
            return None;
        }
        let f = match topic::parse_shared(filter) {
            Ok(Some(shared)) => shared.filter,
            _ => filter,
        };
        (!f.starts_with('$')).then_some(f)
    }

    /// A subscription of `client` to `filter` was added to the index.
    pub(crate) fn add(&self, filter: &str, client: &str) {
        let Some(f) = self.filter_of(filter, client) else {
            return;
        };
        let mut st = self.state.lock();
        let n = st.count.entry(f.to_string()).or_insert(0);
        *n += 1;
        if *n == 1 {
            st.pending.insert(f.to_string(), true);
            drop(st);
            self.changed.notify_one();
        }
    }

    /// A subscription of `client` to `filter` was removed from the index.
    pub(crate) fn remove(&self, filter: &str, client: &str) {
        let Some(f) = self.filter_of(filter, client) else {
            return;
        };
        let mut st = self.state.lock();
        let Some(n) = st.count.get_mut(f) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            st.count.remove(f);
            st.pending.insert(f.to_string(), false);
            drop(st);
            self.changed.notify_one();
        }
    }

    /// The filters that appeared (true) or disappeared (false) since the last call.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn take(&self) -> Vec<(String, bool)> {
        self.state.lock().pending.drain().collect()
    }

    /// Resolves after the next change (at once when one came since the last wait).
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) async fn changed(&self) {
        self.changed.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_changes() {
        let i = Interest::default();
        i.add("a/b", "c1");
        assert!(i.take().is_empty(), "off until started");
        i.start(Arc::from("$internal/cluster"));
        i.add("#", "$internal/cluster");
        i.add("a/+", "c1");
        i.add("$share/g/a/+", "c2");
        i.add("$SYS/#", "c2");
        assert_eq!(i.take(), [("a/+".to_string(), true)]);
        i.remove("a/+", "c1");
        assert!(i.take().is_empty(), "c2's shared subscription still counts");
        i.remove("$share/g/a/+", "c2");
        assert_eq!(i.take(), [("a/+".to_string(), false)]);
        i.add("x", "c1");
        i.remove("x", "c1");
        assert_eq!(i.take(), [("x".to_string(), false)]);
    }
}
