//! The retained-message store: replace, remove, prune, and lookup by topic filter
//! (MQTT 5.0 sections 3.3.1.3 and 4.7).

use mercurio_core::router::RetainedStore;

fn sorted(mut v: Vec<&'static str>) -> Vec<&'static str> {
    v.sort_unstable();
    v
}

fn store(topics: &[&'static str]) -> RetainedStore<&'static str> {
    let mut s = RetainedStore::new();
    for t in topics {
        assert_eq!(s.insert(t, *t), None);
    }
    s
}

#[test]
fn insert_replaces_and_returns_the_old_message() {
    // [MQTT-3.3.1-5] The Server MUST replace any existing retained message for this topic.
    let mut s = RetainedStore::new();
    assert!(s.is_empty());
    assert_eq!(s.insert("a/b", 1), None);
    assert_eq!(s.insert("a/b", 2), Some(1));
    assert_eq!(s.len(), 1);
    assert_eq!(s.get("a/b"), Some(&2));
    assert_eq!(s.get("a"), None);
    assert_eq!(s.get("a/b/c"), None);
}

#[test]
fn remove_prunes_empty_nodes() {
    let mut s = RetainedStore::new();
    assert_eq!(s.node_count(), 1);
    s.insert("a/b/c", 1);
    s.insert("a", 2);
    s.insert("a/x/y/z", 3);
    assert_eq!(s.node_count(), 7);
    assert_eq!(s.remove("a/b"), None);
    assert_eq!(s.remove("nope/x"), None);
    assert_eq!(s.remove("a/b/c"), Some(1));
    assert_eq!(s.remove("a/b/c"), None);
    assert_eq!(s.node_count(), 5);
    assert_eq!(s.remove("a/x/y/z"), Some(3));
    assert_eq!(s.node_count(), 2);
    assert_eq!(s.remove("a"), Some(2));
    assert_eq!(s.node_count(), 1);
    assert!(s.is_empty());
    // Many topics in and out.
    for i in 0..1000 {
        s.insert(&format!("d/{}/{i}//x", i % 17), i);
    }
    assert_eq!(s.len(), 1000);
    for i in 0..1000 {
        assert_eq!(s.remove(&format!("d/{}/{i}//x", i % 17)), Some(i));
    }
    assert_eq!(s.node_count(), 1);
}

#[test]
fn matching_follows_the_wildcard_rules() {
    let s = store(&[
        "sport",
        "sport/tennis",
        "sport/tennis/player1",
        "sport/tennis/player1/ranking",
        "sport/tennis/player2",
        "sport/golf",
        "sports",
        "/finance",
        "a//b",
    ]);
    // Section 4.7.1.2: "sport/#" includes the parent level "sport".
    assert_eq!(
        sorted(s.matching("sport/#")),
        sorted(vec![
            "sport",
            "sport/tennis",
            "sport/tennis/player1",
            "sport/tennis/player1/ranking",
            "sport/tennis/player2",
            "sport/golf",
        ])
    );
    assert_eq!(
        sorted(s.matching("sport/tennis/player1/#")),
        vec!["sport/tennis/player1", "sport/tennis/player1/ranking"]
    );
    // Section 4.7.1.3.
    assert_eq!(
        sorted(s.matching("sport/tennis/+")),
        vec!["sport/tennis/player1", "sport/tennis/player2"]
    );
    assert_eq!(
        sorted(s.matching("sport/+")),
        vec!["sport/golf", "sport/tennis"]
    );
    assert_eq!(sorted(s.matching("+")), vec!["sport", "sports"]);
    assert_eq!(
        sorted(s.matching("+/+")),
        vec!["/finance", "sport/golf", "sport/tennis"]
    );
    assert_eq!(s.matching("/+"), vec!["/finance"]);
    assert_eq!(sorted(s.matching("a/+/b")), vec!["a//b"]);
    assert_eq!(s.matching("sport/tennis"), vec!["sport/tennis"]);
    assert!(s.matching("sport/tennis/player3").is_empty());
    assert!(s.matching("nothing/#").is_empty());
    assert_eq!(s.matching("#").len(), s.len());
}

#[test]
fn wildcards_at_the_start_skip_dollar_topics() {
    // [MQTT-4.7.2-1]
    let s = store(&["$SYS/broker/uptime", "$SYS", "a/$b", "x"]);
    assert_eq!(sorted(s.matching("#")), vec!["a/$b", "x"]);
    assert_eq!(s.matching("+"), vec!["x"]);
    assert!(s.matching("+/broker/uptime").is_empty());
    assert_eq!(
        sorted(s.matching("$SYS/#")),
        vec!["$SYS", "$SYS/broker/uptime"]
    );
    assert_eq!(s.matching("$SYS/+/uptime"), vec!["$SYS/broker/uptime"]);
    assert_eq!(s.matching("a/+"), vec!["a/$b"]);
}

#[test]
fn for_each_matching_borrows() {
    let s = store(&["a/1", "a/2", "b/1"]);
    let mut n = 0;
    s.for_each_matching("a/+", |_| n += 1);
    assert_eq!(n, 2);
}

#[test]
fn deep_topics_do_not_overflow_the_stack() {
    let mut s = RetainedStore::new();
    let deep = "/".repeat(65_534);
    s.insert(&deep, 1);
    assert_eq!(s.matching("#"), vec![1]);
    assert_eq!(s.matching(&deep), vec![1]);
    assert_eq!(s.remove(&deep), Some(1));
    assert_eq!(s.node_count(), 1);
    s.insert(&deep, 2);
    s.clear();
    assert!(s.is_empty());
    s.insert(&deep, 3);
    drop(s);
}
