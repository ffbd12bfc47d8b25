//! The storage writer's handling of a backend that refuses changes: a batch refused five times
//! is given up and its client written whole once storage takes writes again (on the memory
//! backend's failure injection; docs/operations.md, "Persistence").
mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mercurio::codec::{ProtocolVersion, QoS};
use mercurio::storage::{ErrorKind, MemoryStorage};
use mercurio::Broker;

#[tokio::test]
async fn refused_changes_are_given_up_and_the_client_written_whole() {
    let storage = MemoryStorage::new();
    let mut config = test_config();
    config.storage.durable_ack = false;
    let broker = Broker::builder(config)
        .storage(Arc::new(storage.clone()))
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let (mut sub, _) = connect_persistent(addr, ProtocolVersion::V5, "sub").await;
    sub.subscribe("a", QoS::AtLeastOnce).await;
    broker.flush_storage().await;
    storage.fail_next(ErrorKind::Refused, 5);
    sub.subscribe("b", QoS::AtLeastOnce).await;
    // Given up after five attempts; the client is then written whole.
    tokio::time::timeout(DEADLINE, async {
        while broker
            .stats()
            .storage_batches_dropped
            .load(Ordering::Relaxed)
            == 0
        {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the batch is given up");
    sub.subscribe("c", QoS::AtLeastOnce).await;
    tokio::time::timeout(
        DEADLINE,
        storage.wait_until(|s| {
            s.sessions.iter().any(|r| {
                r.client_id == "sub"
                    && r.subscriptions
                        .iter()
                        .map(|s| s.filter.as_str())
                        .collect::<Vec<_>>()
                        == ["a", "b", "c"]
            })
        }),
    )
    .await
    .expect("the dirty client is written whole");
    assert_eq!(
        broker.stats().storage_clients_dirty.load(Ordering::Relaxed),
        0
    );
    assert!(
        broker
            .stats()
            .storage_batches_retried
            .load(Ordering::Relaxed)
            >= 4
    );
    broker.shutdown().await;
}
