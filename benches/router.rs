//! Topic matching in the subscription index with 1,000 and 100,000 subscriptions: exact
//! filters, `+`, `#` and shared-subscription groups, with the match cache off (the trie walk
//! itself) and on (a repeated topic, the common case of a busy publisher).
//!
//! Run: `cargo bench --bench router` (see docs/BENCHMARKS.md).

use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use mercurio::router::{ClientKey, SubscriptionIndex};

#[derive(Clone, Copy)]
enum Kind {
    Exact,
    Plus,
    Hash,
    Shared,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Exact => "exact",
            Kind::Plus => "plus",
            Kind::Hash => "hash",
            Kind::Shared => "shared",
        }
    }

    /// The filter of subscription `i` out of `n`. Topics are `site/{s}/dev/{d}/temp` with 100
    /// devices per site; each kind's filters are spread over the whole tree.
    fn filter(self, i: usize) -> String {
        let (site, dev) = (i / 100, i % 100);
        match self {
            Kind::Exact => format!("site/{site}/dev/{dev}/temp"),
            Kind::Plus => format!("site/{site}/+/{dev}/temp"),
            Kind::Hash => format!("site/{i}/#"),
            // 10 members per group: subscriptions 10k..10k+9 share one filter.
            Kind::Shared => {
                let f = i / 10;
                format!("$share/workers/site/{}/dev/{}/temp", f / 100, f % 100)
            }
        }
    }

    fn client(self, i: usize) -> ClientKey {
        Arc::from(format!("client-{i}"))
    }

    /// A topic matched by some subscription in the middle of the index.
    fn topic(self, n: usize) -> String {
        let i = n / 2;
        match self {
            Kind::Exact | Kind::Plus => format!("site/{}/dev/{}/temp", i / 100, i % 100),
            Kind::Hash => format!("site/{i}/dev/7/temp"),
            Kind::Shared => {
                let f = i / 10;
                format!("site/{}/dev/{}/temp", f / 100, f % 100)
            }
        }
    }
}

fn build(kind: Kind, n: usize, cache: bool) -> SubscriptionIndex<u8> {
    let mut index = if cache {
        SubscriptionIndex::new()
    } else {
        SubscriptionIndex::with_cache_limits(0, 0)
    };
    for i in 0..n {
        index.insert(&kind.filter(i), kind.client(i), 1);
    }
    assert_eq!(index.len(), n);
    index
}

fn bench_matching(c: &mut Criterion) {
    for cache in [false, true] {
        let mut group = c.benchmark_group(if cache {
            "match_cached"
        } else {
            "match_uncached"
        });
        for n in [1_000usize, 100_000] {
            for kind in [Kind::Exact, Kind::Plus, Kind::Hash, Kind::Shared] {
                let index = build(kind, n, cache);
                let topic = kind.topic(n);
                let m = index.matches(&topic);
                assert!(
                    !m.is_empty(),
                    "{} {n}: {topic} matches nothing",
                    kind.name()
                );
                group.bench_with_input(BenchmarkId::new(kind.name(), n), &topic, |b, t| {
                    b.iter(|| index.matches(black_box(t)))
                });
            }
        }
        group.finish();
    }
}

/// A topic that matches nothing (the trie walk stops early; no cache entry is useful).
fn bench_miss(c: &mut Criterion) {
    let index = build(Kind::Plus, 100_000, false);
    c.bench_function("match_miss_plus_100000", |b| {
        b.iter(|| index.matches(black_box("site/999999/dev/1/humidity")))
    });
}

/// Subscribing and unsubscribing in an index of 100,000 subscriptions (each clears the cache).
fn bench_churn(c: &mut Criterion) {
    let mut index = build(Kind::Exact, 100_000, true);
    let client: ClientKey = Arc::from("churn");
    c.bench_function("subscribe_unsubscribe_100000", |b| {
        b.iter(|| {
            index.insert("site/42/dev/42/humidity", Arc::clone(&client), 1);
            index.remove("site/42/dev/42/humidity", "churn")
        })
    });
}

criterion_group!(benches, bench_matching, bench_miss, bench_churn);
criterion_main!(benches);
