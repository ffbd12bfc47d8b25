//! The subscription index: insert / replace / remove / prune, grouping per client, shared
//! subscription groups and their cursor, cache invalidation, and a rough measurement with
//! 100,000 subscriptions.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use mercurio_core::codec::{QoS, SubscriptionOptions};
use mercurio_core::router::{ClientKey, Matches, SubscriptionIndex};
use mercurio_core::topic::TopicError;

fn key(s: &str) -> ClientKey {
    Arc::from(s)
}

/// client -> sorted values, for order-independent comparison.
fn by_client<T: Clone + Ord>(m: &Matches<T>) -> BTreeMap<String, Vec<T>> {
    m.clients
        .iter()
        .map(|c| {
            let mut v = c.subscriptions.clone();
            v.sort();
            (c.client.to_string(), v)
        })
        .collect()
}

#[test]
fn insert_is_new_then_replaces() {
    let mut index = SubscriptionIndex::new();
    assert!(index.is_empty());
    assert!(index.insert("a/b", key("c1"), 1));
    assert!(index.insert("a/b", key("c2"), 2));
    assert!(index.insert("a/+", key("c1"), 3));
    assert_eq!(index.len(), 3);
    // [MQTT-3.8.4-3] A SUBSCRIBE for a filter the client already has replaces that subscription.
    assert!(!index.insert("a/b", key("c1"), 10));
    assert_eq!(index.len(), 3);
    assert_eq!(index.get("a/b", "c1"), Some(&10));
    assert_eq!(index.get("a/b", "c2"), Some(&2));
    assert_eq!(index.get("a/b", "c3"), None);
    assert_eq!(index.get("a/c", "c1"), None);
    let m = index.matches("a/b");
    assert_eq!(
        by_client(&m),
        BTreeMap::from([("c1".into(), vec![3, 10]), ("c2".into(), vec![2])])
    );
}

#[test]
fn works_with_subscription_options() {
    let mut index = SubscriptionIndex::new();
    let opts = |qos| SubscriptionOptions {
        qos,
        ..Default::default()
    };
    index.insert("t/#", key("c"), opts(QoS::AtLeastOnce));
    index.insert("t/+", key("c"), opts(QoS::ExactlyOnce));
    let m = index.matches("t/x");
    assert_eq!(m.clients.len(), 1);
    let best = m.clients[0].subscriptions.iter().map(|o| o.qos).max();
    assert_eq!(best, Some(QoS::ExactlyOnce));
}

#[test]
fn overlapping_subscriptions_are_grouped_per_client() {
    // MQTT 5.0 section 3.3.4: overlapping subscriptions of one client give it one message,
    // with the subscription identifiers of every matching subscription.
    let mut index = SubscriptionIndex::new();
    index.insert("sport/#", key("a"), 1);
    index.insert("sport/tennis/+", key("a"), 2);
    index.insert("+/tennis/player1", key("a"), 3);
    index.insert("sport/tennis/player1", key("a"), 4);
    index.insert("#", key("a"), 5);
    index.insert("sport/tennis/player1", key("b"), 6);
    index.insert("#", key("c"), 7);
    index.insert("sport/+/player2", key("d"), 8);
    let m = index.matches("sport/tennis/player1");
    assert_eq!(
        by_client(&m),
        BTreeMap::from([
            ("a".into(), vec![1, 2, 3, 4, 5]),
            ("b".into(), vec![6]),
            ("c".into(), vec![7]),
        ])
    );
    assert!(m.shared.is_empty());
    // Distinct Arc<str> instances of the same client identifier are the same client.
    let mut index = SubscriptionIndex::new();
    index.insert("x", Arc::from("same"), 1);
    index.insert("+", Arc::from(String::from("same")), 2);
    assert_eq!(index.len(), 2);
    assert_eq!(index.matches("x").clients.len(), 1);
}

#[test]
fn sport_hash_matches_sport_and_dollar_rule_holds() {
    let mut index = SubscriptionIndex::new();
    index.insert("sport/#", key("a"), 1);
    index.insert("#", key("b"), 2);
    index.insert("+/monitor/Clients", key("c"), 3);
    index.insert("$SYS/#", key("d"), 4);
    index.insert("$SYS/monitor/+", key("e"), 5);
    index.insert("$share/g/#", key("f"), 6);
    assert_eq!(
        by_client(&index.matches("sport")),
        BTreeMap::from([("a".into(), vec![1]), ("b".into(), vec![2])])
    );
    assert_eq!(index.matches("sport").shared.len(), 1);
    // [MQTT-4.7.2-1] No filter starting with a wildcard matches a topic starting with '$',
    // shared ones included.
    let m = index.matches("$SYS/monitor/Clients");
    assert_eq!(
        by_client(&m),
        BTreeMap::from([("d".into(), vec![4]), ("e".into(), vec![5])])
    );
    assert!(m.shared.is_empty());
    let m = index.matches("x/monitor/Clients");
    assert_eq!(
        by_client(&m),
        BTreeMap::from([("b".into(), vec![2]), ("c".into(), vec![3])])
    );
}

#[test]
fn empty_levels_are_levels() {
    let mut index = SubscriptionIndex::new();
    index.insert("/+", key("a"), 1);
    index.insert("+/+", key("b"), 2);
    index.insert("+", key("c"), 3);
    index.insert("a//b", key("d"), 4);
    index.insert("a/+/b", key("e"), 5);
    assert_eq!(
        by_client(&index.matches("/finance")),
        BTreeMap::from([("a".into(), vec![1]), ("b".into(), vec![2])])
    );
    assert_eq!(
        by_client(&index.matches("a//b")),
        BTreeMap::from([("d".into(), vec![4]), ("e".into(), vec![5])])
    );
}

#[test]
fn remove_reports_existence_and_prunes_nodes() {
    let mut index = SubscriptionIndex::new();
    let empty_nodes = index.node_count();
    assert_eq!(empty_nodes, 1);
    index.insert("a/b/c/d", key("x"), 1);
    index.insert("a/b/+/#", key("x"), 2);
    index.insert("a/b", key("y"), 3);
    index.insert("$share/g/a/b/c/d", key("z"), 4);
    let full = index.node_count();
    assert!(full > empty_nodes);
    assert!(!index.remove("a/b/c/d", "nobody"));
    assert!(!index.remove("a/b/c", "x"));
    assert!(!index.remove("q/r/s", "x"));
    assert!(!index.remove("$share/h/a/b/c/d", "z"));
    assert!(!index.remove("$share/g/a/b/c/d", "x"));
    assert_eq!(index.node_count(), full);

    assert!(index.remove("a/b/c/d", "x"));
    assert!(!index.remove("a/b/c/d", "x"));
    // The shared group still holds a/b/c/d.
    assert_eq!(index.node_count(), full);
    assert!(index.remove("$share/g/a/b/c/d", "z"));
    assert!(index.node_count() < full);
    assert!(index.remove("a/b/+/#", "x"));
    assert_eq!(index.len(), 1);
    // Only root -> a -> b remains.
    assert_eq!(index.node_count(), 3);
    assert!(index.remove("a/b", "y"));
    assert!(index.is_empty());
    assert_eq!(index.node_count(), empty_nodes);
    assert!(index.matches("a/b/c/d").is_empty());
}

#[test]
fn many_subscriptions_come_and_go_without_leaking_nodes() {
    let mut index = SubscriptionIndex::new();
    let filters: Vec<String> = (0..2000)
        .map(|i| match i % 4 {
            0 => format!("dev/{i}/temp"),
            1 => format!("dev/+/{i}/#"),
            2 => format!("$share/g{}/dev/{i}", i % 7),
            _ => format!("{i}//{}", i % 13),
        })
        .collect();
    for (i, f) in filters.iter().enumerate() {
        assert!(index.insert(f, key(&format!("c{}", i % 50)), i));
    }
    assert_eq!(index.len(), 2000);
    for (i, f) in filters.iter().enumerate() {
        assert!(index.remove(f, &format!("c{}", i % 50)), "{f}");
    }
    assert!(index.is_empty());
    assert_eq!(index.node_count(), 1);
}

#[test]
fn remove_client_removes_its_filters_only() {
    let mut index = SubscriptionIndex::new();
    index.insert("a", key("x"), 1);
    index.insert("b/#", key("x"), 2);
    index.insert("$share/g/c", key("x"), 3);
    index.insert("a", key("y"), 4);
    let removed = index.remove_client("x", ["a", "b/#", "$share/g/c", "not/there"]);
    assert_eq!(removed, 3);
    assert_eq!(index.len(), 1);
    assert_eq!(
        by_client(&index.matches("a")),
        BTreeMap::from([("y".into(), vec![4])])
    );
    index.clear();
    assert!(index.is_empty());
    assert!(index.matches("a").is_empty());
}

#[test]
fn shared_groups_live_on_the_node_of_their_filter() {
    // MQTT 5.0 section 4.8.2: each group on each filter receives one copy.
    let mut index = SubscriptionIndex::new();
    index.insert("$share/g1/sport/+", key("a"), 1);
    index.insert("$share/g1/sport/+", key("b"), 2);
    index.insert("$share/g2/sport/+", key("c"), 3);
    index.insert("$share/g1/sport/#", key("d"), 4);
    index.insert("sport/+", key("e"), 5);
    // Replacing a member keeps one entry.
    assert!(!index.insert("$share/g1/sport/+", key("a"), 11));
    assert_eq!(index.len(), 5);
    assert_eq!(index.get("$share/g1/sport/+", "a"), Some(&11));
    assert_eq!(index.get("sport/+", "a"), None);

    let m = index.matches("sport/tennis");
    assert_eq!(by_client(&m), BTreeMap::from([("e".into(), vec![5])]));
    let mut groups: Vec<(String, Vec<(String, i32)>)> = m
        .shared
        .iter()
        .map(|g| {
            (
                g.group.to_string(),
                g.members.iter().map(|(c, v)| (c.to_string(), *v)).collect(),
            )
        })
        .collect();
    groups.sort();
    assert_eq!(
        groups,
        vec![
            ("g1".into(), vec![("a".into(), 11), ("b".into(), 2)]),
            ("g1".into(), vec![("d".into(), 4)]),
            ("g2".into(), vec![("c".into(), 3)]),
        ]
    );
    // A malformed shared filter given to insert is kept as literal text.
    index.insert("$share/g3", key("z"), 9);
    assert_eq!(
        by_client(&index.matches("$share/g3")),
        BTreeMap::from([("z".into(), vec![9])])
    );
}

#[test]
fn shared_cursor_rotates_across_calls() {
    let mut index = SubscriptionIndex::new();
    for c in ["a", "b", "c"] {
        index.insert("$share/g/job", key(c), 0u8);
    }
    let mut picked = Vec::new();
    for _ in 0..6 {
        // A fresh call each time: the cursor lives in the index, not in the result.
        let m = index.matches("job");
        assert_eq!(m.shared.len(), 1);
        let (client, _) = m.shared[0].pick(|_, _| true).expect("a member");
        picked.push(client.to_string());
    }
    assert_eq!(picked, ["a", "b", "c", "a", "b", "c"]);

    // The cursor survives a change of the index (which clears the cache).
    index.insert("other", key("x"), 0);
    let m = index.matches("job");
    assert_eq!(m.shared[0].next.load(Ordering::Relaxed), 6);
    assert_eq!(&*m.shared[0].pick(|_, _| true).expect("member").0, "a");

    // Skipping a disconnected member moves the cursor past the chosen one.
    let m = index.matches("job");
    let chosen = m.shared[0].pick(|c, _| &**c != "b").expect("member");
    assert_eq!(&*chosen.0, "c");
    assert_eq!(&*m.shared[0].pick(|_, _| true).expect("member").0, "a");
    assert!(m.shared[0].pick(|_, _| false).is_none());
}

#[test]
fn cache_is_invalidated_by_every_change() {
    let mut index = SubscriptionIndex::new();
    index.insert("a/+", key("x"), 1);
    let first = index.matches("a/b");
    assert_eq!(index.cached_topics(), 1);
    // A cached result is shared.
    assert!(Arc::ptr_eq(&first, &index.matches("a/b")));
    // A match after an insert sees the new subscriber.
    index.insert("a/#", key("y"), 2);
    assert_eq!(index.cached_topics(), 0);
    assert_eq!(
        by_client(&index.matches("a/b")),
        BTreeMap::from([("x".into(), vec![1]), ("y".into(), vec![2])])
    );
    // ... and a replacement's new value.
    index.matches("a/b");
    index.insert("a/#", key("y"), 3);
    assert_eq!(
        index
            .matches("a/b")
            .clients
            .iter()
            .find(|c| &*c.client == "y")
            .map(|c| c.subscriptions.clone()),
        Some(vec![3])
    );
    // ... and a removal.
    index.remove("a/+", "x");
    assert_eq!(
        by_client(&index.matches("a/b")),
        BTreeMap::from([("y".into(), vec![3])])
    );
    // A shared join too.
    index.matches("a/b");
    index.insert("$share/g/a/b", key("z"), 4);
    assert_eq!(index.matches("a/b").shared.len(), 1);
    // Failed removals leave the cache alone.
    index.matches("a/b");
    assert!(!index.remove("zzz", "x"));
    assert_eq!(index.cached_topics(), 1);
    // The previously returned result is unchanged.
    assert_eq!(by_client(&first), BTreeMap::from([("x".into(), vec![1])]));
}

#[test]
fn cache_is_bounded() {
    let mut index = SubscriptionIndex::with_cache_limits(64, 1 << 20);
    index.insert("#", key("x"), 1);
    for i in 0..1000 {
        assert_eq!(index.matches(&format!("t/{i}")).clients.len(), 1);
        assert!(index.cached_topics() <= 64);
    }
    // A disabled cache still matches.
    let mut index = SubscriptionIndex::with_cache_limits(0, 0);
    index.insert("#", key("x"), 1);
    assert_eq!(index.matches("t").clients.len(), 1);
    assert_eq!(index.cached_topics(), 0);
    // Results too large for the subscription budget are not cached.
    let mut index = SubscriptionIndex::with_cache_limits(64, 80);
    for i in 0..20 {
        index.insert("big", key(&format!("c{i}")), i);
    }
    assert_eq!(index.matches("big").clients.len(), 20);
    assert_eq!(index.cached_topics(), 0);
}

#[test]
fn try_insert_validates() {
    let mut index = SubscriptionIndex::new();
    assert_eq!(
        index.try_insert("a/#/b", key("x"), 1),
        Err(TopicError::MisplacedMultiLevelWildcard)
    );
    assert_eq!(
        index.try_insert("$share//a", key("x"), 1),
        Err(TopicError::MissingShareName)
    );
    assert!(index.is_empty());
    assert_eq!(index.try_insert("a/+", key("x"), 1), Ok(true));
    assert_eq!(index.try_insert("a/+", key("x"), 2), Ok(false));
}

#[test]
fn concurrent_matching_under_a_read_lock() {
    let index = Arc::new(parking_lot::RwLock::new(SubscriptionIndex::new()));
    for i in 0..100 {
        index
            .write()
            .insert(&format!("s/{i}/#"), key(&format!("c{i}")), i);
    }
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let index = Arc::clone(&index);
            std::thread::spawn(move || {
                for i in 0..2000 {
                    let topic = format!("s/{}/x", (i * 7 + t) % 100);
                    // One subscriber, or two once "late" has subscribed to s/{i}/x.
                    let n = index.read().matches(&topic).clients.len();
                    assert!(n == 1 || n == 2, "{topic}: {n}");
                }
            })
        })
        .collect();
    for i in 0..50 {
        index.write().insert(&format!("s/{i}/x"), key("late"), 1000);
    }
    for t in threads {
        t.join().expect("matcher thread");
    }
    assert_eq!(index.read().matches("s/3/x").clients.len(), 2);
}

#[test]
fn hundred_thousand_subscriptions_rough_measure() {
    // No timed assertion (ARCHITECTURE.md, "Where a test goes"): prints the figures for a human.
    let mut index = SubscriptionIndex::new();
    let start = Instant::now();
    for i in 0..100_000u32 {
        let filter = match i % 10 {
            0 => format!("tenant/{}/+/status", i % 1000),
            1 => format!("tenant/{}/#", i % 1000),
            2 => format!("$share/workers/jobs/{}", i % 100),
            _ => format!("tenant/{}/device/{}/telemetry", i % 1000, i),
        };
        index.insert(&filter, key(&format!("client-{i}")), i);
    }
    let built = start.elapsed();
    assert_eq!(index.len(), 100_000);
    let start = Instant::now();
    let mut delivered = 0usize;
    let topics = 50_000u32;
    for i in 0..topics {
        // Distinct topics: mostly cache misses.
        let m = index.matches(&format!("tenant/{}/device/{}/telemetry", i % 1000, i));
        delivered += m.clients.len() + m.shared.len();
    }
    let uncached = start.elapsed();
    let start = Instant::now();
    for _ in 0..topics {
        let m = index.matches("tenant/7/device/7/telemetry");
        delivered += m.clients.len();
    }
    let cached = start.elapsed();
    eprintln!(
        "100k subscriptions: built in {built:?} ({} nodes); {topics} uncached matches in {uncached:?}; \
         {topics} cached matches in {cached:?}; {delivered} deliveries",
        index.node_count()
    );
    assert!(delivered > 0);
}

/// A shared group found by its full filter (what a delivery made through it remembers): its
/// members, its full filter, and the same cursor as the matches of a topic report; `None` for
/// a group without members, another ShareName, or a filter that is not shared.
#[test]
fn shared_group_by_full_filter() {
    let mut index: SubscriptionIndex<u32> = SubscriptionIndex::new();
    index.insert("$share/g/jobs/+", key("a"), 1);
    index.insert("$share/g/jobs/+", key("b"), 2);
    index.insert("$share/h/jobs/+", key("c"), 3);
    index.insert("jobs/+", key("d"), 4);
    let group = index.shared_group("$share/g/jobs/+").expect("the group");
    assert_eq!(&*group.group, "g");
    assert_eq!(&*group.filter, "$share/g/jobs/+");
    let members: Vec<(String, u32)> = group
        .members
        .iter()
        .map(|(c, v)| (c.to_string(), *v))
        .collect();
    assert_eq!(members, [("a".to_string(), 1), ("b".to_string(), 2)]);
    let matched = index.matches("jobs/x");
    let same = matched
        .shared
        .iter()
        .find(|s| &*s.group == "g")
        .expect("g matches");
    assert_eq!(&*same.filter, "$share/g/jobs/+");
    assert!(Arc::ptr_eq(&same.next, &group.next), "one cursor per group");
    assert!(index.shared_group("$share/x/jobs/+").is_none());
    assert!(index.shared_group("jobs/+").is_none());
    index.remove("$share/h/jobs/+", "c");
    assert!(index.shared_group("$share/h/jobs/+").is_none());
}
