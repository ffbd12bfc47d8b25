//! `Interest`: the topic filters and shared subscription groups this node's clients subscribe
//! to, as cluster mode announces them to NATS (docs/cluster.md, "Interest"). The broker reports
//! each subscription added to or removed from its index; the cluster link takes the filters
//! and groups whose presence changed. Off (one atomic load per report) unless cluster mode is
//! on.

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
    /// Subscriptions per filter or shared group.
    count: HashMap<Key, usize>,
    /// Filters and groups that appeared (true) or disappeared (false) since the last `take`.
    pending: HashMap<Key, bool>,
}

/// What a subscription is interested in, as the cluster serves it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Key {
    /// An ordinary filter: every matching message.
    Filter(String),
    /// A shared subscription's group, by its full filter `$share/{ShareName}/{filter}`: one
    /// member in the whole cluster gets each matching message.
    Group(String),
}

impl Interest {
    /// Starts tracking, with `own` (the cluster link's client identifier) left out. Called
    /// before any subscription exists.
    pub(crate) fn start(&self, own: Arc<str>) {
        let _ = self.own.set(own);
        self.on.store(true, Ordering::Release);
    }

    /// Whether cluster mode tracks interest (and serves shared subscriptions through NATS).
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    /// What a subscription counts under, or `None` when it is not interest: the cluster
    /// link's own, and `$` filters (`$` topics stay on their node).
    fn key_of(&self, filter: &str, client: &str) -> Option<Key> {
        if !self.is_on() || self.own.get().is_some_and(|o| &**o == client) {
            return None;
        }
        match topic::parse_shared(filter) {
            Ok(Some(shared)) => {
                (!shared.filter.starts_with('$')).then(|| Key::Group(filter.to_string()))
            }
            _ => (!filter.starts_with('$')).then(|| Key::Filter(filter.to_string())),
        }
    }

    /// A subscription of `client` to `filter` was added to the index.
    pub(crate) fn add(&self, filter: &str, client: &str) {
        let Some(key) = self.key_of(filter, client) else {
            return;
        };
        let mut st = self.state.lock();
        let n = st.count.entry(key.clone()).or_insert(0);
        *n += 1;
        if *n == 1 {
            st.pending.insert(key, true);
            drop(st);
            self.changed.notify_one();
        }
    }

    /// A subscription of `client` to `filter` was removed from the index.
    pub(crate) fn remove(&self, filter: &str, client: &str) {
        let Some(key) = self.key_of(filter, client) else {
            return;
        };
        let mut st = self.state.lock();
        let Some(n) = st.count.get_mut(&key) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            st.count.remove(&key);
            st.pending.insert(key, false);
            drop(st);
            self.changed.notify_one();
        }
    }

    /// The filters and groups that appeared (true) or disappeared (false) since the last
    /// call.
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    pub(crate) fn take(&self) -> Vec<(Key, bool)> {
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

    fn filter(f: &str, present: bool) -> (Key, bool) {
        (Key::Filter(f.to_string()), present)
    }

    #[test]
    fn counts_and_changes() {
        let i = Interest::default();
        i.add("a/b", "c1");
        assert!(i.take().is_empty(), "off until started");
        i.start(Arc::from("$internal/cluster"));
        i.add("#", "$internal/cluster");
        i.add("a/+", "c1");
        i.add("a/+", "c3");
        i.add("$SYS/#", "c2");
        i.add("$share/g/$SYS/#", "c2");
        assert_eq!(i.take(), [filter("a/+", true)]);
        i.remove("a/+", "c1");
        assert!(i.take().is_empty(), "c3's subscription still counts");
        i.remove("a/+", "c3");
        assert_eq!(i.take(), [filter("a/+", false)]);
        i.add("x", "c1");
        i.remove("x", "c1");
        assert_eq!(i.take(), [filter("x", false)]);
    }

    #[test]
    fn shared_groups_count_apart() {
        let i = Interest::default();
        i.start(Arc::from("$internal/cluster"));
        i.add("$share/g/a/+", "c1");
        i.add("$share/g/a/+", "c2");
        i.add("$share/h/a/+", "c2");
        let mut got = i.take();
        got.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        assert_eq!(
            got,
            [
                (Key::Group("$share/g/a/+".into()), true),
                (Key::Group("$share/h/a/+".into()), true),
            ]
        );
        i.remove("$share/g/a/+", "c1");
        assert!(i.take().is_empty(), "c2 is still a member of g");
        i.remove("$share/g/a/+", "c2");
        assert_eq!(i.take(), [(Key::Group("$share/g/a/+".into()), false)]);
    }
}
