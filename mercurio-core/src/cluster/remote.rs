//! Which topics other nodes want (docs/cluster.md, "Interest"): each node announces the
//! filters and shared groups its clients subscribe to, and the link's session subscribes to
//! exactly what the other nodes want, plus this node's shared groups (whose messages go
//! through NATS). A message no other node wants is not queued for the link, so it costs
//! nothing more than on a single broker.
//!
//! - `{prefix}.interest.{node}`: a node's changes, JSON [`Delta`], numbered from 1 within its
//!   incarnation;
//! - a heartbeat carries the node's incarnation and last number: a node that missed a change,
//!   or does not know the node yet, asks it for its whole set on
//!   `{prefix}.interest.sync.{node}`, answered on `{prefix}.interest.reply.{asker}` in parts
//!   ([`Part`]);
//! - a node gone (or leaving) takes its interest with it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::broker::BrokerState;
use crate::cluster_status::{Delta, Part};
use crate::codec::{QoS, SubscriptionOptions};
use crate::session::{Granted, Session};
use parking_lot::Mutex;

/// The filter the link subscribes to for a key: a shared group's filter, or the filter;
/// `None` for a key that is neither (another node's message is outside input).
fn link_filter(key: &str) -> Option<&str> {
    let filter = match crate::topic::parse_shared(key) {
        Ok(Some(shared)) => shared.filter,
        Ok(None) => key,
        Err(_) => return None,
    };
    crate::topic::validate_topic_filter(filter).ok()?;
    Some(filter)
}

/// The link session's subscriptions, counted: one per filter however many nodes (or local
/// groups) want it.
pub(super) struct LinkFilters {
    session: Arc<Session>,
    counts: Mutex<HashMap<String, usize>>,
}

impl LinkFilters {
    pub(super) fn new(session: Arc<Session>) -> LinkFilters {
        LinkFilters {
            session,
            counts: Mutex::new(HashMap::new()),
        }
    }

    /// One more need of the filter of `key`; the link subscribes to it at the first.
    pub(super) fn add(&self, broker: &BrokerState, key: &str) {
        let Some(filter) = link_filter(key) else {
            return;
        };
        if filter.starts_with('$') {
            return;
        }
        let mut counts = self.counts.lock();
        let n = counts.entry(filter.to_string()).or_insert(0);
        *n += 1;
        if *n == 1 {
            let options = SubscriptionOptions {
                qos: QoS::ExactlyOnce,
                no_local: true,
                retain_as_published: true,
                retain_handling: 2,
            };
            broker.subscribe(
                &self.session,
                filter,
                Granted {
                    options,
                    identifier: None,
                },
            );
        }
    }

    /// One need fewer of the filter of `key`; the link unsubscribes at the last.
    pub(super) fn remove(&self, broker: &BrokerState, key: &str) {
        let Some(filter) = link_filter(key) else {
            return;
        };
        let mut counts = self.counts.lock();
        let Some(n) = counts.get_mut(filter) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            counts.remove(filter);
            broker.unsubscribe(&self.session, filter);
        }
    }
}

/// One other node's interest as known here.
#[derive(Default)]
struct Known {
    inc: u64,
    v: u64,
    keys: HashSet<String>,
    /// A whole set being received: (inc, v, parts expected, parts received, keys).
    assembling: Option<(u64, u64, u64, u64, HashSet<String>)>,
}

/// The other nodes' interest, and what the link subscribes to for it.
#[derive(Default)]
pub(super) struct Remote {
    nodes: HashMap<String, Known>,
}

/// What to do after a message about a node's interest.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next {
    Nothing,
    /// Ask the node for its whole set.
    Ask,
}

impl Remote {
    /// A change from `node`: applied when it is the next one; otherwise the whole set is
    /// asked for (unless it is one already known).
    pub(super) fn delta(
        &mut self,
        broker: &BrokerState,
        link: &LinkFilters,
        node: &str,
        d: Delta,
    ) -> Next {
        let known = self.nodes.entry(node.to_string()).or_default();
        if known.inc == d.inc && d.v <= known.v {
            return Next::Nothing;
        }
        if known.inc != d.inc || d.v != known.v + 1 {
            return if known.assembling.is_some() {
                Next::Nothing
            } else {
                Next::Ask
            };
        }
        known.v = d.v;
        for k in d.add {
            if known.keys.insert(k.clone()) {
                link.add(broker, &k);
                broker.cluster_qos.want(node, &k, true);
            }
        }
        for k in d.remove {
            if known.keys.remove(&k) {
                link.remove(broker, &k);
                broker.cluster_qos.want(node, &k, false);
            }
        }
        Next::Nothing
    }

    /// A heartbeat of `node` saying its interest is at (inc, v): asks for the whole set when
    /// this node is behind.
    pub(super) fn heard(&mut self, node: &str, inc: u64, v: u64) -> Next {
        let known = self.nodes.entry(node.to_string()).or_default();
        if (known.inc, known.v) == (inc, v)
            || known
                .assembling
                .as_ref()
                .is_some_and(|a| (a.0, a.1) == (inc, v))
        {
            return Next::Nothing;
        }
        known.assembling = None;
        Next::Ask
    }

    /// A part of a node's whole set; once all have come, the set replaces what was known.
    pub(super) fn part(&mut self, broker: &BrokerState, link: &LinkFilters, p: Part) {
        let known = self.nodes.entry(p.node.clone()).or_default();
        if known.inc == p.inc && p.v < known.v {
            return;
        }
        let fresh = known
            .assembling
            .as_ref()
            .is_none_or(|a| (a.0, a.1, a.2) != (p.inc, p.v, p.parts));
        if fresh {
            known.assembling = Some((p.inc, p.v, p.parts, 0, HashSet::new()));
        }
        let Some(a) = known.assembling.as_mut() else {
            return;
        };
        a.3 += 1;
        a.4.extend(p.keys);
        if a.3 < a.2 {
            return;
        }
        let Some((inc, v, _, _, keys)) = known.assembling.take() else {
            return;
        };
        for k in keys.difference(&known.keys) {
            link.add(broker, k);
        }
        for k in known.keys.difference(&keys) {
            link.remove(broker, k);
        }
        broker.cluster_qos.replace(&p.node, &keys);
        known.inc = inc;
        known.v = v;
        known.keys = keys;
    }

    /// `node` is gone: its interest goes.
    pub(super) fn forget(&mut self, broker: &BrokerState, link: &LinkFilters, node: &str) {
        if let Some(known) = self.nodes.remove(node) {
            for k in &known.keys {
                link.remove(broker, k);
            }
            // Its filters stay JetStream destinations for a while: what its persistent
            // sessions want waits for its return.
            broker.cluster_qos.gone(node);
        }
    }

    /// Keys known of `node`.
    pub(super) fn count(&self, node: &str) -> Option<u64> {
        self.nodes.get(node).map(|k| k.keys.len() as u64)
    }

    /// The nodes known.
    pub(super) fn nodes(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    /// A broker and a link session, with the link's subscriptions read from the session.
    fn setup() -> (Arc<BrokerState>, LinkFilters, Arc<Session>) {
        let broker = Arc::new(BrokerState::new(Config::default()));
        let id: Arc<str> = Arc::from("$internal/cluster");
        let (session, _) = broker.internal_session(&id);
        (
            Arc::clone(&broker),
            LinkFilters::new(Arc::clone(&session)),
            session,
        )
    }

    fn subscribed(session: &Session) -> Vec<String> {
        let mut v: Vec<String> = session
            .state
            .lock()
            .subscriptions()
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }

    fn delta(inc: u64, v: u64, add: &[&str], remove: &[&str]) -> Delta {
        Delta {
            inc,
            v,
            add: add.iter().map(|s| s.to_string()).collect(),
            remove: remove.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn changes_in_order_apply_and_a_gap_asks_for_the_whole_set() {
        let (broker, link, session) = setup();
        let mut remote = Remote::default();
        // Not known yet: ask.
        assert_eq!(
            remote.delta(&broker, &link, "b", delta(7, 1, &["a/#"], &[])),
            Next::Ask
        );
        assert!(subscribed(&session).is_empty());
        // The whole set, in two parts, then changes in order.
        for (i, keys) in [
            vec!["a/#".to_string()],
            vec!["$share/g/s/+".to_string(), "bad/#/x".to_string()],
        ]
        .into_iter()
        .enumerate()
        {
            let part = Part {
                node: "b".into(),
                inc: 7,
                v: 1,
                part: i as u64,
                parts: 2,
                keys,
            };
            remote.part(&broker, &link, part);
        }
        // A group's filter is subscribed to; an invalid filter is not.
        assert_eq!(subscribed(&session), ["a/#", "s/+"]);
        assert_eq!(remote.count("b"), Some(3));
        assert_eq!(
            remote.delta(&broker, &link, "b", delta(7, 2, &["c"], &["a/#"])),
            Next::Nothing
        );
        assert_eq!(subscribed(&session), ["c", "s/+"]);
        // An old change is ignored; one after a gap, or from a new incarnation, asks.
        assert_eq!(
            remote.delta(&broker, &link, "b", delta(7, 2, &["x"], &[])),
            Next::Nothing
        );
        assert_eq!(
            remote.delta(&broker, &link, "b", delta(7, 4, &["x"], &[])),
            Next::Ask
        );
        assert_eq!(
            remote.delta(&broker, &link, "b", delta(8, 1, &["x"], &[])),
            Next::Ask
        );
        assert_eq!(subscribed(&session), ["c", "s/+"]);
        // A heartbeat at the known number asks nothing; a later one asks.
        assert_eq!(remote.heard("b", 7, 2), Next::Nothing);
        assert_eq!(remote.heard("b", 7, 3), Next::Ask);
        // Two nodes wanting one filter: one subscription, gone with the last.
        remote.part(
            &broker,
            &link,
            Part {
                node: "c".into(),
                inc: 1,
                v: 0,
                part: 0,
                parts: 1,
                keys: vec!["c".into()],
            },
        );
        remote.forget(&broker, &link, "b");
        assert_eq!(subscribed(&session), ["c"]);
        remote.forget(&broker, &link, "c");
        assert!(subscribed(&session).is_empty());
        assert_eq!(remote.count("b"), None);
    }
}
