//! Property tests: the subscription index and the retained store agree with a naive scan that
//! uses `topic::matches` over random filters, topics and changes (cache included).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use mercurio_core::router::{RetainedStore, SubscriptionIndex};
use mercurio_core::topic::{matches, parse_shared, validate_topic_filter, validate_topic_name};
use proptest::prelude::*;

fn level() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        Just("c".to_string()),
        Just(String::new()),
        Just("$SYS".to_string()),
    ]
}

fn topic() -> impl Strategy<Value = String> {
    prop::collection::vec(level(), 1..5)
        .prop_map(|levels| levels.join("/"))
        // A topic name is at least one character long [MQTT-4.7.3-1].
        .prop_filter("empty topic", |t| !t.is_empty())
}

fn filter() -> impl Strategy<Value = String> {
    let filter_level = prop_oneof![3 => level(), 2 => Just("+".to_string())];
    (
        prop::collection::vec(filter_level, 0..5),
        any::<bool>(),
        prop::option::of(0u8..3),
    )
        .prop_filter_map("empty filter", |(mut levels, hash, share)| {
            if hash || levels.is_empty() {
                levels.push("#".to_string());
            }
            let f = levels.join("/");
            if f.is_empty() {
                return None;
            }
            Some(match share {
                Some(g) => format!("$share/g{g}/{f}"),
                None => f,
            })
        })
}

#[derive(Debug, Clone)]
enum Op {
    Insert(String, u8, u32),
    Remove(String, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (filter(), 0u8..5, any::<u32>()).prop_map(|(f, c, v)| Op::Insert(f, c, v)),
        1 => (filter(), 0u8..5).prop_map(|(f, c)| Op::Remove(f, c)),
    ]
}

type Plain = BTreeMap<String, BTreeSet<u32>>;
type Shared = BTreeSet<(String, String, Vec<(String, u32)>)>;

/// The naive answer: every subscription whose filter matches, grouped like the index.
fn naive(
    subs: &BTreeMap<(String, String), u32>,
    order: &[(String, String)],
    topic: &str,
) -> (Plain, Shared) {
    let mut plain: Plain = BTreeMap::new();
    let mut groups: BTreeMap<(String, String), Vec<(String, u32)>> = BTreeMap::new();
    // Shared members in subscription order.
    for (full, client) in order {
        let value = subs[&(full.clone(), client.clone())];
        match parse_shared(full).expect("generated filters are valid") {
            Some(s) => {
                if matches(s.filter, topic) {
                    groups
                        .entry((s.group.to_string(), s.filter.to_string()))
                        .or_default()
                        .push((client.clone(), value));
                }
            }
            None => {
                if matches(full, topic) {
                    plain.entry(client.clone()).or_default().insert(value);
                }
            }
        }
    }
    let shared = groups
        .into_iter()
        .map(|((g, f), members)| (g, f, members))
        .collect();
    (plain, shared)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn generated_inputs_are_valid(f in filter(), t in topic()) {
        let inner = parse_shared(&f).expect("valid").map(|s| s.filter).unwrap_or(&f);
        prop_assert_eq!(validate_topic_filter(inner), Ok(()));
        prop_assert_eq!(validate_topic_name(&t), Ok(()));
    }

    #[test]
    fn index_agrees_with_a_naive_scan(
        ops in prop::collection::vec(op(), 1..40),
        topics in prop::collection::vec(topic(), 1..8),
    ) {
        let mut index = SubscriptionIndex::with_cache_limits(4, 64);
        let mut subs: BTreeMap<(String, String), u32> = BTreeMap::new();
        let mut order: Vec<(String, String)> = Vec::new();
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Insert(f, c, v) => {
                    let client = format!("c{c}");
                    let key = (f.clone(), client.clone());
                    let new = subs.insert(key.clone(), *v).is_none();
                    if new {
                        order.push(key);
                    }
                    prop_assert_eq!(index.insert(f, Arc::from(client.as_str()), *v), new);
                }
                Op::Remove(f, c) => {
                    let client = format!("c{c}");
                    let key = (f.clone(), client.clone());
                    let existed = subs.remove(&key).is_some();
                    order.retain(|k| *k != key);
                    prop_assert_eq!(index.remove(f, &client), existed);
                }
            }
            prop_assert_eq!(index.len(), subs.len());
            // Match after every change: a stale cache would show here.
            let topic = &topics[step % topics.len()];
            let got = index.matches(topic);
            let got_plain: Plain = got
                .clients
                .iter()
                .map(|c| (c.client.to_string(), c.subscriptions.iter().copied().collect()))
                .collect();
            // Each client appears once, and holds each matching subscription once.
            prop_assert_eq!(got_plain.len(), got.clients.len());
            let total: usize = got.clients.iter().map(|c| c.subscriptions.len()).sum();
            prop_assert_eq!(total, got_plain.values().map(|v| v.len()).sum::<usize>());
            let mut got_shared: Vec<(String, Vec<(String, u32)>)> = got
                .shared
                .iter()
                .map(|g| {
                    (
                        g.group.to_string(),
                        g.members.iter().map(|(c, v)| (c.to_string(), *v)).collect(),
                    )
                })
                .collect();
            got_shared.sort();
            let (want_plain, want_shared) = naive(&subs, &order, topic);
            prop_assert_eq!(&got_plain, &want_plain, "topic {}", topic);
            // The filter of a group is not in the result: compare (ShareName, members), with
            // members in subscription order.
            let mut want_groups: Vec<(String, Vec<(String, u32)>)> =
                want_shared.iter().map(|(g, _, m)| (g.clone(), m.clone())).collect();
            want_groups.sort();
            prop_assert_eq!(got_shared, want_groups, "topic {}", topic);
        }
        // Removing everything frees every node.
        for (full, client) in order.clone() {
            prop_assert!(index.remove(&full, &client));
        }
        prop_assert!(index.is_empty());
        prop_assert_eq!(index.node_count(), 1);
    }

    #[test]
    fn retained_store_agrees_with_a_naive_scan(
        inserts in prop::collection::vec((topic(), any::<u16>()), 0..30),
        removals in prop::collection::vec(topic(), 0..10),
        filters in prop::collection::vec(filter(), 1..10),
    ) {
        let mut store = RetainedStore::new();
        let mut naive: BTreeMap<String, u16> = BTreeMap::new();
        for (t, v) in &inserts {
            prop_assert_eq!(store.insert(t, *v), naive.insert(t.clone(), *v));
        }
        for t in &removals {
            prop_assert_eq!(store.remove(t), naive.remove(t));
        }
        prop_assert_eq!(store.len(), naive.len());
        for f in &filters {
            // Retained lookup uses ordinary filters: drop any $share prefix.
            let f = parse_shared(f).expect("valid").map(|s| s.filter).unwrap_or(f);
            let mut got = store.matching(f);
            got.sort_unstable();
            let mut want: Vec<u16> = naive
                .iter()
                .filter(|(t, _)| matches(f, t))
                .map(|(_, v)| *v)
                .collect();
            want.sort_unstable();
            prop_assert_eq!(got, want, "filter {}", f);
        }
        for t in naive.keys() {
            prop_assert!(store.remove(t).is_some());
        }
        prop_assert_eq!(store.node_count(), 1);
    }
}
