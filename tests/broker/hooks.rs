//! The embedding application's SUBSCRIBE interceptors and callbacks (docs/embedding.md):
//! delivery completed, dropped, will, retained change; each as documented, seen through real
//! clients.
use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use mercurio::codec::{Packet, ProtocolVersion, PubAck, QoS, ReasonCode};
use mercurio::stats::DropCause;
use mercurio::{
    Broker, BrokerHandle, ClientOptions, InterceptedSubscribe, RetainedChange,
    SubscribeInterceptor, Verdict,
};

const SHORT: Duration = Duration::from_millis(300);

async fn start_built(builder: mercurio::BrokerBuilder) -> (BrokerHandle, std::net::SocketAddr) {
    let handle = builder.start().await.expect("broker starts");
    let addr = handle.local_addrs()[0];
    (handle, addr)
}

/// 10,000 QoS 1 deliveries acknowledged with PUBACK give 10,000 delivery-completed
/// callbacks, one per message; a duplicate PUBACK (an identifier no longer in flight) gives
/// none. A QoS 2 delivery completes at PUBCOMP [MQTT-4.3.3-9], not at PUBREC; an in-process
/// client's `ack` completes too, and the bridge-less total adds up.
#[tokio::test]
async fn every_acknowledged_delivery_completes_once() {
    let completed = Arc::new(AtomicU64::new(0));
    let qos2 = Arc::new(AtomicU64::new(0));
    let (c, q) = (Arc::clone(&completed), Arc::clone(&qos2));
    let builder = Broker::builder(test_config()).on_delivery_completed(move |d| {
        assert!(d.client_id == "done-sub" || d.client_id == "$internal/client/app");
        c.fetch_add(1, Ordering::Relaxed);
        if d.qos == QoS::ExactlyOnce {
            q.fetch_add(1, Ordering::Relaxed);
        }
    });
    let (broker, addr) = start_built(builder).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "done-sub").await;
    sub.subscribe("done/#", QoS::AtLeastOnce).await;
    const N: u64 = 10_000;
    let publisher = {
        let broker = broker.clone();
        tokio::spawn(async move {
            for i in 0..N {
                broker
                    .publish(&format!("done/{i}"), "x", QoS::AtLeastOnce, false)
                    .await
                    .unwrap();
            }
        })
    };
    let mut last = None;
    for _ in 0..N {
        let p = sub.expect_publish().await;
        sub.ack(&p).await;
        last = Some(p);
    }
    publisher.await.unwrap();
    wait_until("10,000 completed callbacks", || {
        completed.load(Ordering::Relaxed) == N
    })
    .await;
    // A PUBACK for an identifier no longer in flight: no second callback.
    sub.ack(&last.unwrap()).await;
    sub.ping().await;
    assert_eq!(completed.load(Ordering::Relaxed), N);

    // QoS 2: complete at PUBCOMP only.
    sub.subscribe("two/#", QoS::ExactlyOnce).await;
    broker
        .publish("two/x", "x", QoS::ExactlyOnce, false)
        .await
        .unwrap();
    let p = sub.expect_publish().await;
    sub.send(Packet::PubRec(PubAck {
        packet_id: p.packet_id,
        ..PubAck::default()
    }))
    .await;
    assert!(matches!(sub.recv().await, Some(Packet::PubRel(_))));
    assert_eq!(qos2.load(Ordering::Relaxed), 0, "not at PUBREC");
    sub.send(Packet::PubComp(PubAck {
        packet_id: p.packet_id,
        ..PubAck::default()
    }))
    .await;
    sub.ping().await;
    assert_eq!(qos2.load(Ordering::Relaxed), 1, "at PUBCOMP");

    // An in-process client's acknowledgement.
    let mut app = broker.client("app", ClientOptions::default()).unwrap();
    app.subscribe("app/#", QoS::AtLeastOnce).unwrap();
    broker
        .publish("app/1", "x", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let r = tokio::time::timeout(DEADLINE, app.recv())
        .await
        .unwrap()
        .unwrap();
    let before = completed.load(Ordering::Relaxed);
    r.ack();
    assert_eq!(completed.load(Ordering::Relaxed), before + 1);
    broker.shutdown().await;
}

/// Refuses `secret/...` with 0x87, rewrites `old/...` to `new/...`, caps `capped/...` at
/// QoS 0, refuses `panic/...` by panicking.
struct Rules;

#[async_trait::async_trait]
impl SubscribeInterceptor for Rules {
    async fn intercept(&self, s: &mut InterceptedSubscribe<'_>) -> Verdict {
        assert!(s.client_id().starts_with("si-"));
        if s.filter().starts_with("secret/") {
            return Verdict::Refuse(ReasonCode::NOT_AUTHORIZED);
        }
        if let Some(rest) = s.filter().strip_prefix("old/") {
            let to = format!("new/{rest}");
            s.set_filter(to);
        }
        if s.filter().starts_with("capped/") {
            s.set_qos(QoS::AtMostOnce);
            s.set_qos(QoS::ExactlyOnce); // never raises
        }
        if s.filter().starts_with("bad/") {
            s.set_filter("bad/#/x");
        }
        if s.filter().starts_with("panic/") {
            panic!("subscribe interceptor bug");
        }
        Verdict::Accept
    }
}

/// A refused filter gets the interceptor's reason code in SUBACK (MQTT 5.0; a 3.1.1 client
/// gets 0x80 Failure [MQTT-3.9.3-2]... the only failure code 3.1.1 has), and is not
/// subscribed; a rewritten filter is what the subscription matches; a lowered QoS is what
/// SUBACK grants and what messages come with [MQTT-3.8.4-6]; an invalid rewrite gets 0x8F; a
/// panic 0x80, and the connection goes on.
#[tokio::test]
async fn subscribe_interceptor_refuses_rewrites_and_downgrades() {
    let (broker, addr) =
        start_built(Broker::builder(test_config()).subscribe_interceptor(Rules)).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "si-5").await;
    let codes = sub
        .subscribe_with(
            &[
                ("secret/#", opts(QoS::AtLeastOnce)),
                ("old/#", opts(QoS::AtLeastOnce)),
                ("capped/#", opts(QoS::ExactlyOnce)),
                ("bad/x", opts(QoS::AtLeastOnce)),
                ("panic/x", opts(QoS::AtLeastOnce)),
            ],
            Default::default(),
        )
        .await;
    assert_eq!(
        codes,
        [
            ReasonCode::NOT_AUTHORIZED,
            ReasonCode(1),
            ReasonCode(0),
            ReasonCode::TOPIC_FILTER_INVALID,
            ReasonCode::UNSPECIFIED_ERROR,
        ]
    );
    let mut v3 = Client::connect(addr, ProtocolVersion::V311, "si-3").await;
    assert_eq!(
        v3.subscribe("secret/#", QoS::AtLeastOnce).await,
        ReasonCode::UNSPECIFIED_ERROR,
        "0x80 Failure for 3.1.1"
    );
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "si-pub").await;
    for topic in ["secret/a", "old/a", "new/a", "capped/a"] {
        publisher
            .publish(topic, b"x", QoS::AtLeastOnce, false)
            .await;
    }
    let p = sub.expect_publish().await;
    assert_eq!(
        p.topic, "new/a",
        "the rewritten filter matches; the old one does not"
    );
    sub.ack(&p).await;
    let p = sub.expect_publish().await;
    assert_eq!((p.topic.as_str(), p.qos), ("capped/a", QoS::AtMostOnce));
    sub.expect_nothing(SHORT).await;
    v3.expect_nothing(SHORT).await;
    let detail = broker.session_detail("si-5").unwrap();
    let filters: Vec<&str> = detail
        .subscriptions
        .iter()
        .map(|(f, _)| f.as_str())
        .collect();
    assert_eq!(filters, ["capped/#", "new/#"]);
    broker.shutdown().await;
}

/// The dropped callback sees every drop with the cause the counters count it under: at
/// routing (a full queue) and in a session's drain (a message expired in the queue
/// [MQTT-3.3.2-5]), where it runs with the session's lock released: it may read the broker's
/// state (here the session itself) without a deadlock.
#[tokio::test]
async fn dropped_callback_matches_the_drop_counters() {
    let seen: Seen = Arc::default();
    let s = Arc::clone(&seen);
    let handle: Arc<std::sync::OnceLock<BrokerHandle>> = Arc::default();
    let h = Arc::clone(&handle);
    let mut config = test_config();
    config.server.max_queued_messages = 3;
    let builder = Broker::builder(config).on_dropped(move |d| {
        if let (Some(h), Some(client_id)) = (h.get(), d.client_id) {
            assert!(h.session_detail(client_id).is_some());
        }
        s.lock().unwrap().push((
            d.client_id.map(str::to_string),
            d.topic.to_string(),
            d.cause,
        ));
    });
    let (broker, addr) = start_built(builder).await;
    let _ = handle.set(broker.clone());
    let (sub, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "dr-sub").await;
    let mut sub = sub;
    sub.subscribe("dr/#", QoS::AtLeastOnce).await;
    sub.disconnect().await;
    wait_until("dr-sub away", || {
        broker
            .sessions()
            .iter()
            .any(|s| s.client_id == "dr-sub" && !s.connected)
    })
    .await;
    for i in 0..5 {
        broker
            .publish(&format!("dr/{i}"), "x", QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    assert_eq!(
        seen_now(&seen),
        [
            (
                Some("dr-sub".to_string()),
                "dr/3".to_string(),
                DropCause::QueueFull
            ),
            (
                Some("dr-sub".to_string()),
                "dr/4".to_string(),
                DropCause::QueueFull
            ),
        ]
    );
    assert_eq!(broker.stats().dropped_total(), 2);
    assert_eq!(broker.stats().dropped_count(DropCause::QueueFull), 2);

    let (mut exp, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "dr-exp").await;
    exp.subscribe("exp/#", QoS::AtLeastOnce).await;
    exp.disconnect().await;
    wait_until("dr-exp away", || {
        broker
            .sessions()
            .iter()
            .any(|s| s.client_id == "dr-exp" && !s.connected)
    })
    .await;
    broker
        .publish_with(
            "exp/1",
            "x",
            QoS::AtLeastOnce,
            false,
            Default::default(),
            Some(1),
        )
        .await
        .unwrap();
    // Let the interval run out (this waits for time itself, not for an event).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (mut exp, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "dr-exp").await;
    exp.expect_nothing(SHORT).await;
    assert_eq!(
        seen_now(&seen).last().cloned(),
        Some((
            Some("dr-exp".to_string()),
            "exp/1".to_string(),
            DropCause::Expired
        ))
    );
    assert_eq!(broker.stats().dropped_count(DropCause::Expired), 1);
    broker.shutdown().await;
}

type Seen = Arc<Mutex<Vec<(Option<String>, String, DropCause)>>>;

fn seen_now(seen: &Seen) -> Vec<(Option<String>, String, DropCause)> {
    seen.lock().unwrap().clone()
}

/// The will callback sees a will as it is published [MQTT-3.1.2-8]; the retained-change
/// callback sees a retained message set [MQTT-3.3.1-5], replaced, and deleted by an empty
/// payload [MQTT-3.3.1-6].
#[tokio::test]
async fn will_and_retained_change_callbacks() {
    let wills: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let retained: Arc<Mutex<Vec<String>>> = Arc::default();
    let (w, r) = (Arc::clone(&wills), Arc::clone(&retained));
    let builder = Broker::builder(test_config())
        .on_will(move |will| {
            w.lock()
                .unwrap()
                .push((will.client_id.to_string(), will.message.topic.clone()));
        })
        .on_retained_change(move |change| {
            r.lock().unwrap().push(match change {
                RetainedChange::Set(m) => {
                    format!("set {} {}", m.topic, String::from_utf8_lossy(&m.payload))
                }
                RetainedChange::Cleared { topic } => format!("cleared {topic}"),
            });
        });
    let (broker, addr) = start_built(builder).await;
    let mut connect = connect_packet(ProtocolVersion::V5, "wl");
    connect.will = Some(will("wills/wl", "gone", QoS::AtLeastOnce, false));
    let (c, _) = Client::connect_with(addr, connect).await;
    c.drop_connection().await;
    wait_until("the will callback", || !wills.lock().unwrap().is_empty()).await;
    assert_eq!(
        *wills.lock().unwrap(),
        [("wl".to_string(), "wills/wl".to_string())]
    );

    let mut p = Client::connect(addr, ProtocolVersion::V5, "rt").await;
    p.publish("r/t", b"one", QoS::AtLeastOnce, true).await;
    p.publish("r/t", b"two", QoS::AtLeastOnce, true).await;
    p.publish("r/t", b"", QoS::AtLeastOnce, true).await;
    p.publish("r/t", b"", QoS::AtLeastOnce, true).await; // nothing to delete
    p.publish("r/u", b"live", QoS::AtLeastOnce, false).await; // not retained
    assert_eq!(
        *retained.lock().unwrap(),
        ["set r/t one", "set r/t two", "cleared r/t"]
    );
    broker.shutdown().await;
}
