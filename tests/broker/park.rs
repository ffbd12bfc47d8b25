//! Parked connections (`[server] park_after`): an idle plain TCP connection stops being a
//! task and is resumed by its socket's input, a delivery or a kill. Each test waits until the
//! connections are parked (the `clients/parked` gauge), then checks that the client is served
//! as if nothing had happened.

use std::time::Duration;

use mercurio::codec::{
    Packet, Properties, ProtocolVersion, QoS, ReasonCode, Subscribe, SubscribeFilter,
};
use mercurio::BrokerHandle;

use crate::common::{self, connect_packet, Client, DEADLINE};

/// A broker whose connections park after one second of idleness.
async fn start_parking() -> (BrokerHandle, std::net::SocketAddr) {
    let mut config = common::test_config();
    config.server.park_after = 1;
    common::start_with(config).await
}

fn parked(broker: &BrokerHandle) -> u64 {
    broker.stats().clients_parked
}

/// Waits until at least `n` connections are parked.
async fn wait_parked(broker: &BrokerHandle, n: u64) {
    common::wait_until(&format!("{n} parked connections"), || parked(broker) >= n).await;
}

#[tokio::test]
async fn a_parked_client_publishes_and_a_parked_subscriber_receives() {
    let (broker, addr) = start_parking().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V311, "pk-sub").await;
    sub.subscribe("pk/#", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V311, "pk-pub").await;
    wait_parked(&broker, 2).await;
    // Parked connections stay parked while nothing happens (over two looks of the sweep
    // that asks idle connections to park).
    sub.expect_nothing(Duration::from_millis(2500)).await;
    assert_eq!(
        parked(&broker),
        2,
        "a parked connection was resumed for nothing"
    );
    publisher
        .publish("pk/a", b"hello", QoS::AtMostOnce, false)
        .await;
    let p = sub.expect_publish().await;
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("pk/a", &b"hello"[..]));
    // Both park again once idle, and are served again.
    wait_parked(&broker, 2).await;
    publisher
        .publish("pk/b", b"again", QoS::AtMostOnce, false)
        .await;
    assert_eq!(&sub.expect_publish().await.payload[..], b"again");
    broker.shutdown().await;
}

#[tokio::test]
async fn deliveries_to_a_parked_subscriber_qos0_and_qos1() {
    let (broker, addr) = start_parking().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "pd-sub").await;
    sub.subscribe("pd/#", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pd-pub").await;
    wait_parked(&broker, 2).await;

    // From the broker itself: only the subscriber's link resumes it.
    broker
        .publish("pd/zero", &b"0"[..], QoS::AtMostOnce, false)
        .await
        .expect("publish");
    let p = sub.expect_publish().await;
    assert_eq!((p.topic.as_str(), p.qos), ("pd/zero", QoS::AtMostOnce));

    wait_parked(&broker, 2).await;
    // A parked publisher's QoS 1 PUBLISH is acknowledged [MQTT-4.3.2-4] ...
    let rc = publisher
        .publish("pd/one", b"1", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(rc, ReasonCode::SUCCESS);
    // ... and delivered to the parked subscriber, whose PUBACK ends it: the next QoS 1
    // message comes with no redelivery before it.
    let p = sub.expect_publish().await;
    assert_eq!(
        (p.topic.as_str(), p.qos, p.dup),
        ("pd/one", QoS::AtLeastOnce, false)
    );
    sub.ack(&p).await;
    wait_parked(&broker, 2).await;
    broker
        .publish("pd/two", &b"2"[..], QoS::AtLeastOnce, false)
        .await
        .expect("publish");
    let q = sub.expect_publish().await;
    assert_eq!((q.topic.as_str(), q.dup), ("pd/two", false));
    assert_ne!(q.packet_id, p.packet_id);
    sub.ack(&q).await;
    broker.shutdown().await;
}

/// A parked client that stays silent past one and a half times its keep alive is closed
/// [MQTT-3.1.2-24] and its will published [MQTT-3.1.2-8].
#[tokio::test]
async fn keep_alive_closes_a_parked_client_and_publishes_its_will() {
    let (broker, addr) = start_parking().await;
    let mut watcher = Client::connect(addr, ProtocolVersion::V311, "pk-watch").await;
    watcher.subscribe("wills/#", QoS::AtMostOnce).await;
    let mut connect = connect_packet(ProtocolVersion::V5, "pk-silent");
    // Closed 4.5 s after its CONNECT: parked well before (after 1 to 2 s).
    connect.keep_alive = 3;
    connect.will = Some(common::will(
        "wills/pk-silent",
        "gone",
        QoS::AtMostOnce,
        false,
    ));
    let (mut silent, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    wait_parked(&broker, 2).await;
    let p = watcher.expect_publish().await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("wills/pk-silent", &b"gone"[..])
    );
    assert_eq!(
        silent.expect_disconnect().await,
        Some(ReasonCode::KEEP_ALIVE_TIMEOUT)
    );
    broker.shutdown().await;
}

/// A parked client that says goodbye is closed as a served one would be: a plain DISCONNECT
/// discards the will [MQTT-3.14.4-3], DISCONNECT 0x04 keeps it, and a socket closed without
/// DISCONNECT publishes it [MQTT-3.1.2-8]; the connection is counted closed and its bytes read.
#[tokio::test]
async fn a_parked_client_that_disconnects_or_goes_away() {
    let (broker, addr) = start_parking().await;
    let mut watcher = Client::connect(addr, ProtocolVersion::V311, "pg-watch").await;
    watcher.subscribe("wills/#", QoS::AtMostOnce).await;
    let with_will = |version, id: &str| {
        let mut connect = connect_packet(version, id);
        connect.will = Some(common::will(
            &format!("wills/{id}"),
            id,
            QoS::AtMostOnce,
            false,
        ));
        connect
    };
    let (bye, _) = Client::connect_with(addr, with_will(ProtocolVersion::V311, "pg-bye")).await;
    let (gone, _) = Client::connect_with(addr, with_will(ProtocolVersion::V5, "pg-gone")).await;
    let (mut keep, _) = Client::connect_with(addr, with_will(ProtocolVersion::V5, "pg-keep")).await;
    wait_parked(&broker, 4).await;
    let (connected, received) = {
        let s = broker.stats();
        (s.clients_connected, s.bytes_received)
    };

    bye.disconnect().await;
    common::wait_until("the client that disconnected counted closed", || {
        broker.stats().clients_connected == connected - 1
    })
    .await;
    assert!(
        broker.stats().bytes_received >= received + 2,
        "the DISCONNECT read while parked is counted"
    );
    assert_eq!(parked(&broker), 3);

    drop(gone);
    let p = watcher.expect_publish().await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("wills/pg-gone", &b"pg-gone"[..]),
        "the will of the client that disconnected was discarded; the lost one's comes"
    );
    keep.send(Packet::Disconnect(mercurio::codec::Disconnect {
        reason_code: ReasonCode::DISCONNECT_WITH_WILL_MESSAGE,
        properties: Properties::default(),
    }))
    .await;
    assert_eq!(watcher.expect_publish().await.topic, "wills/pg-keep");
    watcher.expect_nothing(Duration::from_millis(200)).await;
    common::wait_until("every goodbye counted", || {
        broker.stats().clients_connected == connected - 3
    })
    .await;
    broker.shutdown().await;
}

/// A new connection with the client identifier of a parked one takes the session over: the
/// parked one is closed (5.0: DISCONNECT 0x8E Session taken over [MQTT-3.1.4-3]).
#[tokio::test]
async fn a_parked_connection_is_taken_over() {
    let (broker, addr) = start_parking().await;
    // A session that outlives its connection, so that the new one goes on with it.
    let mut connect = connect_packet(ProtocolVersion::V5, "pk-same");
    connect.properties.session_expiry_interval = Some(60);
    let (mut first, _) = Client::connect_with(addr, connect.clone()).await;
    first.subscribe("to/#", QoS::AtMostOnce).await;
    wait_parked(&broker, 1).await;
    connect.clean_start = false;
    let (mut second, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    assert_eq!(
        first.expect_disconnect().await,
        Some(ReasonCode::SESSION_TAKEN_OVER)
    );
    // The session went on: the new connection has the subscription.
    broker
        .publish("to/x", &b"x"[..], QoS::AtMostOnce, false)
        .await
        .expect("publish");
    assert_eq!(second.expect_publish().await.topic, "to/x");
    broker.shutdown().await;
}

/// Shutdown closes parked connections like the others (5.0: DISCONNECT 0x8B), and returns
/// once they are closed, well before its grace period ends.
#[tokio::test]
async fn shutdown_closes_parked_connections() {
    let (broker, addr) = start_parking().await;
    let mut a = Client::connect(addr, ProtocolVersion::V5, "pk-a").await;
    let mut b = Client::connect(addr, ProtocolVersion::V311, "pk-b").await;
    wait_parked(&broker, 2).await;
    let grace = mercurio::SHUTDOWN_GRACE;
    let took = tokio::time::Instant::now();
    tokio::time::timeout(DEADLINE, broker.shutdown())
        .await
        .expect("shutdown ends");
    assert!(
        took.elapsed() < grace,
        "shutdown waited its whole grace period for parked connections"
    );
    assert_eq!(
        a.expect_disconnect().await,
        Some(ReasonCode::SERVER_SHUTTING_DOWN)
    );
    assert!(b.expect_closed().await.is_empty());
    assert_eq!(parked(&broker), 0);
}

/// Topic aliases last as long as the network connection (MQTT 5.0 section 3.3.2.3.4), parks
/// included: an alias the client set before is used after, and one the broker set is still
/// sent alone.
#[tokio::test]
async fn topic_aliases_survive_a_park() {
    let (broker, addr) = start_parking().await;
    let mut connect = connect_packet(ProtocolVersion::V5, "pa-sub");
    connect.properties.topic_alias_maximum = Some(4);
    let (mut sub, _) = Client::connect_with(addr, connect).await;
    sub.subscribe("pa/#", QoS::AtMostOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pa-pub").await;
    let alias = Properties {
        topic_alias: Some(1),
        ..Properties::default()
    };
    publisher
        .publish_with("pa/t", b"1", QoS::AtMostOnce, false, alias.clone())
        .await;
    let first = sub.expect_publish().await;
    let out_alias = first.properties.topic_alias.expect("an outbound alias");
    assert_eq!(first.topic, "pa/t");

    wait_parked(&broker, 2).await;
    // The inbound alias, alone: QoS 1, so its PUBACK shows it was taken.
    let rc = publisher
        .publish_with("", b"2", QoS::AtLeastOnce, false, alias)
        .await;
    assert_eq!(rc, ReasonCode::SUCCESS);
    let second = sub.expect_publish().await;
    assert_eq!(
        (second.topic.as_str(), second.properties.topic_alias),
        ("", Some(out_alias)),
        "the alias the broker set before the park is used alone"
    );
    assert_eq!(&second.payload[..], b"2");
    broker.shutdown().await;
}

/// A new connection parks as soon as it has answered its CONNECT, without waiting for
/// `park_after` (a reconnecting fleet never holds a task per connection at once); once served
/// again, it parks only after `park_after` of idleness.
#[tokio::test]
async fn a_new_connection_parks_at_once_then_only_after_park_after() {
    let mut config = common::test_config();
    config.server.park_after = 3600;
    let (broker, addr) = common::start_with(config).await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "pk-fresh").await;
    wait_parked(&broker, 1).await;
    // Served again by its SUBSCRIBE; then busy, it stays a task (the sweep, an hour away,
    // is what parks it now).
    sub.subscribe("fresh/#", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V311, "pk-fresh-pub").await;
    publisher
        .publish("fresh/a", b"one", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(&sub.expect_publish().await.payload[..], b"one");
    // Both were served again (the publisher parked after its CONNACK too, and its PUBLISH
    // woke it): neither parks again before park_after.
    sub.expect_nothing(Duration::from_millis(1500)).await;
    assert_eq!(
        parked(&broker),
        0,
        "a connection served again parked before park_after"
    );
    broker.shutdown().await;
}

/// What a parked connection sent is handled before what a live connection sent after it.
/// A subscriber parked since its CONNACK sends SUBSCRIBE, and another client, already served,
/// publishes to that filter right after, without waiting for the SUBACK (Paho's
/// interoperability tests do this). Both arrive in one turn of the runtime: resumed in a task
/// of its own, queued behind the publisher's, the subscriber would subscribe too late and miss
/// the message.
#[tokio::test]
async fn a_parked_subscribers_subscribe_is_handled_before_a_later_publish() {
    let mut config = common::test_config();
    config.server.park_after = 3600;
    let (broker, addr) = common::start_with(config).await;
    for round in 0..3 {
        let mut publisher = Client::connect(addr, ProtocolVersion::V5, "order-pub").await;
        // Served again by its SUBSCRIBE, the publisher stays a live task (see the test above).
        publisher.subscribe("order/none", QoS::AtMostOnce).await;
        let mut sub = Client::connect(addr, ProtocolVersion::V5, "order-sub").await;
        wait_parked(&broker, 1).await;
        let filter = format!("order/{round}");
        let packet_id = sub.next_packet_id();
        sub.send(Packet::Subscribe(Subscribe {
            packet_id,
            filters: vec![SubscribeFilter {
                filter: filter.clone(),
                options: common::opts(QoS::AtLeastOnce),
            }],
            properties: Properties::default(),
        }))
        .await;
        publisher
            .publish(&filter, b"after", QoS::AtMostOnce, false)
            .await;
        match sub.recv().await {
            Some(Packet::SubAck(ack)) => assert_eq!(ack.packet_id, packet_id),
            other => panic!("expected SUBACK, got {other:?}"),
        }
        let p = sub.expect_publish().await;
        assert_eq!(
            (p.topic.as_str(), &p.payload[..]),
            (filter.as_str(), &b"after"[..])
        );
        sub.disconnect().await;
        publisher.disconnect().await;
    }
    broker.shutdown().await;
}
