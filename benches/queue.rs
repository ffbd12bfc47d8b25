//! Enqueue and dequeue on a session queue, through the public API: the session queue type is
//! private to mercurio-core, so this publishes in-process (`BrokerHandle::publish`: route,
//! enqueue, wake) to an in-process subscription and receives (`Subscription::recv`: the pump
//! drains the session queue into a channel). That is the path a message takes between a
//! publisher and a subscriber's writer, minus the sockets and the codec.
//!
//! Run: `cargo bench --bench queue` (see docs/BENCHMARKS.md).

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mercurio::codec::QoS;
use mercurio::config::Config;
use mercurio::Broker;

/// Messages published before they are received; below every queue limit.
const BATCH: u64 = 50;

fn bench_queue(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut config = Config::default();
    config.listeners.clear();
    config.logging.connection_messages = false;
    let broker = rt.block_on(async { Broker::builder(config).start().await.expect("starts") });

    let mut group = c.benchmark_group("queue_publish_recv");
    group.throughput(Throughput::Elements(BATCH));
    for (qos, name) in [(QoS::AtMostOnce, "qos0"), (QoS::AtLeastOnce, "qos1")] {
        for subscribers in [1usize, 10] {
            let topic = format!("bench/queue/{name}/{subscribers}");
            let mut subs: Vec<_> = rt.block_on(async {
                (0..subscribers)
                    .map(|_| broker.subscribe(&topic, qos).expect("subscribes"))
                    .collect()
            });
            let payload = Bytes::from(vec![7u8; 64]);
            group.bench_function(BenchmarkId::new(name, format!("{subscribers}sub")), |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            for _ in 0..BATCH {
                                broker
                                    .publish(&topic, payload.clone(), qos, false)
                                    .await
                                    .expect("publishes");
                            }
                            for sub in subs.iter_mut() {
                                for _ in 0..BATCH {
                                    let m =
                                        tokio::time::timeout(Duration::from_secs(5), sub.recv())
                                            .await
                                            .expect("delivered in time")
                                            .expect("broker running");
                                    criterion::black_box(m);
                                }
                            }
                        }
                        start.elapsed()
                    })
                })
            });
            drop(subs);
        }
    }
    group.finish();
    rt.block_on(broker.shutdown());
}

criterion_group!(benches, bench_queue);
criterion_main!(benches);
