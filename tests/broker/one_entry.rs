//! One drain and one entry for every message (ARCHITECTURE.md, "One entry for every
//! message"): what an in-process subscriber, a bridge's remote and an in-process publisher
//! see of expiry, interception and back pressure, as a network client would.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use crate::bridge::{bridge, topic, wait_connected};
use async_trait::async_trait;
use common::*;
use mercurio::codec::{Properties, ProtocolVersion, QoS, ReasonCode};
use mercurio::message::Message;
use mercurio::{Broker, InterceptedPublish, PublishInterceptor, Subscription, Verdict};
use mercurio_core::config::{BridgeConfig, BridgeDirection, Config};
use mercurio_core::stats::DropCause;
use mercurio_testkit::Mosquitto;

async fn next(sub: &mut Subscription) -> Arc<Message> {
    tokio::time::timeout(DEADLINE, sub.recv())
        .await
        .expect("a message before the deadline")
        .expect("the subscription is open")
}

/// A bridge to `to` that brings `in/#` in at QoS 1, under the same topic.
fn bridge_in(to: std::net::SocketAddr) -> BridgeConfig {
    let mut b = bridge(
        "in",
        to,
        vec![topic("in/#", BridgeDirection::In, 1, "", "")],
    );
    b.client_id = Some("entry-bridge".into());
    b.max_inflight = 20;
    b.notifications = false;
    b
}

/// A message whose Message Expiry Interval passed while it waited in an in-process
/// subscription's queue is not handed over [MQTT-3.3.2-5], and counts as dropped (expired),
/// as for a network subscriber.
#[tokio::test]
async fn an_expired_message_is_not_handed_to_an_in_process_subscriber() {
    let (broker, _) = start().await;
    let mut sub = broker.subscribe("exp/#", QoS::AtLeastOnce).unwrap();
    // The subscription's channel holds 64: what follows waits in the session's queue.
    for i in 0..65u8 {
        broker
            .publish("exp/fill", vec![i], QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    broker
        .publish_with(
            "exp/short",
            "s",
            QoS::AtLeastOnce,
            false,
            Properties::default(),
            Some(1),
        )
        .await
        .unwrap();
    broker
        .publish("exp/last", "l", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    // Let the interval run out (this waits for time itself, not for an event).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for i in 0..65u8 {
        let m = next(&mut sub).await;
        assert_eq!(
            (m.topic.as_str(), m.payload.as_ref()),
            ("exp/fill", &[i][..])
        );
    }
    let m = next(&mut sub).await;
    assert_eq!(
        m.topic, "exp/last",
        "the expired message is not handed over"
    );
    assert_eq!(broker.stats().dropped_count(DropCause::Expired), 1);
    broker.shutdown().await;
}

/// Refuses every message whose topic ends in `/blocked`.
struct RefuseBlocked;

#[async_trait]
impl PublishInterceptor for RefuseBlocked {
    async fn intercept(&self, publish: &mut InterceptedPublish<'_>) -> Verdict {
        if publish.topic().ends_with("/blocked") {
            Verdict::Refuse(ReasonCode::NOT_AUTHORIZED)
        } else {
            Verdict::Accept
        }
    }
}

/// A message a bridge brings in from its remote (mosquitto) enters like a client's PUBLISH:
/// a publish interceptor refuses it, and no local subscriber gets it.
#[tokio::test]
async fn a_bridged_in_message_is_refused_by_a_publish_interceptor() {
    let Some(remote) = Mosquitto::start(
        "a_bridged_in_message_is_refused_by_a_publish_interceptor",
        0,
        "",
    ) else {
        return;
    };
    let mut config = test_config();
    config.bridges = vec![bridge_in(remote.addr())];
    let broker = Broker::builder(config)
        .interceptor(RefuseBlocked)
        .start()
        .await
        .expect("broker starts");
    let addr = broker.local_addrs()[0];
    wait_connected(&broker).await;
    let mut local = Client::connect(addr, ProtocolVersion::V5, "entry-local").await;
    local.subscribe("in/#", QoS::AtLeastOnce).await;

    let mut far = Client::connect(remote.addr(), ProtocolVersion::V311, "entry-far").await;
    far.publish("in/blocked", b"no", QoS::AtLeastOnce, false)
        .await;
    far.publish("in/ok", b"yes", QoS::AtLeastOnce, false).await;
    let p = local.expect_publish().await;
    assert_eq!(p.topic, "in/ok", "the refused message is not delivered");
    local.ack(&p).await;
    local.expect_nothing(Duration::from_millis(300)).await;
    assert_eq!(broker.bridges()[0].forwarded_in, 1);
    broker.shutdown().await;
}

/// How many messages the back-pressure tests send; more than a subscriber's queue holds
/// (`SMALL_QUEUE`), so that without back pressure most would be dropped.
const STREAM: usize = 300;
const SMALL_QUEUE: usize = 100;

/// Reads `STREAM` QoS 1 messages on `topic` slowly (a few milliseconds each, a consumer
/// slower than its publisher but still taking messages), acknowledging each; checks they
/// all arrive, in order.
async fn read_slowly(sub: &mut Client, topic: &str) {
    for i in 0..STREAM {
        let p = sub.expect_publish().await;
        assert_eq!(p.topic, topic);
        assert_eq!(
            p.payload.as_ref(),
            i.to_string().as_bytes(),
            "in order, none lost"
        );
        sub.ack(&p).await;
        // The consumer's own pace (not a synchronisation).
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
}

fn small_queue_config() -> Config {
    let mut config = test_config();
    config.server.max_queued_messages = SMALL_QUEUE;
    config
}

/// A fast stream bridged in from a remote (mosquitto) into a slow local subscriber is slowed
/// down, not dropped: the bridge stops reading its remote while the subscriber's queue is
/// over its high-water mark, so the remote holds the rest; every message arrives and the
/// dropped counter stays 0.
#[tokio::test]
async fn a_bridged_in_stream_into_a_slow_subscriber_is_slowed_not_dropped() {
    let Some(remote) = Mosquitto::start(
        "a_bridged_in_stream_into_a_slow_subscriber_is_slowed_not_dropped",
        0,
        "max_queued_messages 10000\n",
    ) else {
        return;
    };
    let mut config = small_queue_config();
    config.bridges = vec![bridge_in(remote.addr())];
    let (broker, addr) = start_with(config).await;
    wait_connected(&broker).await;
    let mut local = Client::connect(addr, ProtocolVersion::V5, "entry-slow").await;
    local.subscribe("in/#", QoS::AtLeastOnce).await;

    let far_addr = remote.addr();
    let publisher = tokio::spawn(async move {
        let mut far = Client::connect(far_addr, ProtocolVersion::V311, "entry-fast").await;
        for i in 0..STREAM {
            far.publish(
                "in/stream",
                i.to_string().as_bytes(),
                QoS::AtLeastOnce,
                false,
            )
            .await;
        }
        far
    });
    read_slowly(&mut local, "in/stream").await;
    let _far = publisher.await.expect("publisher");
    assert_eq!(broker.stats().dropped_total(), 0, "slowed, not dropped");
    broker.shutdown().await;
}

/// An in-process publish into a subscriber over its high-water mark waits (its future does
/// not resolve) while the subscriber still takes messages, as a network publisher is held:
/// every message arrives, none is dropped.
#[tokio::test]
async fn an_in_process_publish_waits_for_a_full_subscriber_instead_of_dropping() {
    let (broker, addr) = start_with(small_queue_config()).await;
    let mut local = Client::connect(addr, ProtocolVersion::V5, "entry-reader").await;
    local.subscribe("app/#", QoS::AtLeastOnce).await;
    let handle = broker.clone();
    let publisher = tokio::spawn(async move {
        for i in 0..STREAM {
            handle
                .publish("app/stream", i.to_string(), QoS::AtLeastOnce, false)
                .await
                .expect("published");
        }
    });
    read_slowly(&mut local, "app/stream").await;
    publisher.await.expect("publisher");
    assert_eq!(broker.stats().dropped_total(), 0, "held back, not dropped");
    broker.shutdown().await;
}

/// `BrokerHandle::stats` is a snapshot of plain values: it reflects the activity up to the
/// call, a later call sees more, and changing a copy changes nothing in the broker (its
/// counters, storage back pressure's among them, are the broker's own).
#[tokio::test]
async fn stats_are_a_snapshot_that_reflects_activity() {
    let (broker, addr) = start().await;
    let before = broker.stats();
    let mut c = Client::connect(addr, ProtocolVersion::V5, "stats-pub").await;
    c.publish("stats/t", b"x", QoS::AtLeastOnce, false).await;
    wait_until("the PUBLISH counted", || {
        broker.stats().messages_received > before.messages_received
    })
    .await;
    let mut copy = broker.stats();
    assert_eq!(copy.connections_total, before.connections_total + 1);
    assert_eq!(copy.clients_connected, 1);
    copy.storage_pending_bytes = u64::MAX;
    assert_ne!(copy, broker.stats(), "a copy, not the broker's counters");
    assert_eq!(broker.stats().storage_pending_bytes, 0);
    broker.shutdown().await;
}
