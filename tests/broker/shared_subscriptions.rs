//! Shared subscriptions whose member leaves (MQTT 5.0 section 4.8.2): the messages it was sent
//! and did not acknowledge, and those queued for it, go to another member of the group when its
//! session ends (DISCONNECT with a Session Expiry Interval of 0, expiry while away, Clean
//! Start) or when it unsubscribes; dropped (and counted) when no member is left.
//!
//! The member that leaves is the project's raw client, which never acknowledges anything; the
//! member that stays is rumqttc (3.1.1) or the raw client.
use crate::common;

use std::time::Duration;

use common::*;
use mercurio::codec::{ProtocolVersion, QoS};
use mercurio::stats::DropCause;
use tokio::sync::mpsc;

const SHORT: Duration = Duration::from_millis(300);

/// A 5.0 CONNECT with this Receive Maximum and Session Expiry Interval (clean start).
fn member(client_id: &str, receive_maximum: u16, expiry: u32) -> mercurio::codec::Connect {
    let mut c = connect_packet(ProtocolVersion::V5, client_id);
    c.properties.receive_maximum = Some(receive_maximum);
    c.properties.session_expiry_interval = Some(expiry);
    c
}

/// The payloads of the next `n` PUBLISH packets, left unacknowledged, with their QoS.
async fn take(c: &mut Client, n: usize) -> Vec<(String, QoS)> {
    let mut got = Vec::new();
    for _ in 0..n {
        let p = c.expect_publish().await;
        got.push((String::from_utf8_lossy(&p.payload).into_owned(), p.qos));
    }
    got
}

/// rumqttc's 3.1.1 client subscribed to `filter`, acknowledging what it receives (the
/// library does), and the payloads it received, in order.
async fn rumqttc_member(
    port: u16,
    id: &str,
    filter: &str,
    qos: rumqttc::QoS,
) -> (rumqttc::AsyncClient, mpsc::UnboundedReceiver<(String, u8)>) {
    let mut options = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
    options.set_keep_alive(Duration::from_secs(30));
    let (client, mut eventloop) = rumqttc::AsyncClient::new(options, 100);
    let (tx, rx) = mpsc::unbounded_channel();
    let (subscribed_tx, mut subscribed) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(event) = eventloop.poll().await {
            match event {
                rumqttc::Event::Incoming(rumqttc::Packet::Publish(p)) => {
                    let payload = String::from_utf8_lossy(&p.payload).into_owned();
                    if tx.send((payload, p.qos as u8)).is_err() {
                        break;
                    }
                }
                rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_)) => {
                    let _ = subscribed_tx.send(());
                }
                _ => {}
            }
        }
    });
    client.subscribe(filter, qos).await.expect("subscribe");
    tokio::time::timeout(DEADLINE, subscribed.recv())
        .await
        .expect("SUBACK before the deadline");
    (client, rx)
}

async fn received(rx: &mut mpsc::UnboundedReceiver<(String, u8)>, n: usize) -> Vec<(String, u8)> {
    let mut got = Vec::new();
    for _ in 0..n {
        let m = tokio::time::timeout(DEADLINE, rx.recv())
            .await
            .expect("a message before the deadline")
            .expect("the client's event loop ended");
        got.push(m);
    }
    got
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("{prefix}{i}")).collect()
}

/// Member A is sent two QoS 1 messages (its Receive Maximum) and has two more queued; it
/// acknowledges none and disconnects with a Session Expiry Interval of 0, which ends its
/// session: all four go to member B, at QoS 1 (MQTT 5.0 section 4.8.2, a statement without a
/// number: "If the Client's Session terminates before the Client reconnects, the Server SHOULD
/// send the Application Message to another Client that is subscribed to the same Shared
/// Subscription").
#[tokio::test]
async fn unacknowledged_and_queued_messages_go_to_another_member_when_a_session_ends() {
    let (broker, addr) = start().await;
    let (mut a, _) = Client::connect_with(addr, member("member-a", 2, 0)).await;
    a.subscribe("$share/g/jobs", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for job in names("job-", 4) {
        publisher
            .publish("jobs", job.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    // A is the only member: it gets two, two wait in its queue behind its window.
    let sent_to_a = take(&mut a, 2).await;
    assert_eq!(
        sent_to_a,
        [
            ("job-1".to_string(), QoS::AtLeastOnce),
            ("job-2".to_string(), QoS::AtLeastOnce)
        ]
    );
    a.expect_nothing(SHORT).await;

    let (_b, mut b) = rumqttc_member(
        addr.port(),
        "member-b",
        "$share/g/jobs",
        rumqttc::QoS::AtLeastOnce,
    )
    .await;
    a.disconnect().await;
    let mut got = received(&mut b, 4).await;
    got.sort();
    assert_eq!(
        got,
        names("job-", 4)
            .into_iter()
            .map(|j| (j, 1))
            .collect::<Vec<_>>()
    );
    wait_until("four passed on", || broker.stats().shared_passed_on == 4).await;
    assert_eq!(broker.stats().dropped_count(DropCause::NoShareMember), 0);
    broker.shutdown().await;
}

/// Member A's session outlives its connection (expiry 3 s); QoS 1 messages published while it
/// is away wait in its queue (it is the group's only member then). B joins; when A's session
/// expires, B receives them.
#[tokio::test]
async fn messages_queued_for_an_expired_member_go_to_another() {
    let (broker, addr) = start().await;
    let mut connect = member("member-a", 10, 3);
    connect.clean_start = false;
    let (mut a, _) = Client::connect_with(addr, connect).await;
    a.subscribe("$share/g/work/+", QoS::AtLeastOnce).await;
    a.disconnect().await;
    wait_until("member-a disconnected", || {
        broker
            .sessions()
            .iter()
            .any(|s| s.client_id == "member-a" && !s.connected)
    })
    .await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for job in names("w-", 3) {
        publisher
            .publish("work/x", job.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    let mut b = Client::connect(addr, ProtocolVersion::V5, "member-b").await;
    // B subscribes at QoS 0: the messages come at the QoS its subscription grants.
    b.subscribe("$share/g/work/+", QoS::AtMostOnce).await;
    let got = take(&mut b, 3).await;
    assert_eq!(
        got,
        names("w-", 3)
            .into_iter()
            .map(|j| (j, QoS::AtMostOnce))
            .collect::<Vec<_>>()
    );
    assert_eq!(broker.stats().shared_passed_on, 3);
    broker.shutdown().await;
}

/// A member that unsubscribes from the group passes its queued messages of the group on; the
/// one in flight stays with it (it may still acknowledge it, [MQTT-3.10.4-3]).
#[tokio::test]
async fn a_member_that_unsubscribes_passes_its_queued_messages_on() {
    let (broker, addr) = start().await;
    let (mut a, _) = Client::connect_with(addr, member("member-a", 1, 0)).await;
    a.subscribe("$share/g/t", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for m in names("m-", 3) {
        publisher
            .publish("t", m.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    let first = a.expect_publish().await;
    assert_eq!(&first.payload[..], b"m-1");
    let mut b = Client::connect(addr, ProtocolVersion::V5, "member-b").await;
    b.subscribe("$share/g/t", QoS::AtLeastOnce).await;
    a.unsubscribe(&["$share/g/t"]).await;
    let got = take(&mut b, 2).await;
    assert_eq!(
        got,
        [
            ("m-2".to_string(), QoS::AtLeastOnce),
            ("m-3".to_string(), QoS::AtLeastOnce)
        ]
    );
    b.expect_nothing(SHORT).await;
    // A still acknowledges its in-flight message, and gets nothing more.
    a.ack(&first).await;
    a.expect_nothing(SHORT).await;
    broker.shutdown().await;
}

/// A member taken over by a connection with Clean Start ends its session: its unacknowledged
/// messages go to the other member, not to the new connection (which has no subscription).
#[tokio::test]
async fn clean_start_takeover_passes_messages_on() {
    let (broker, addr) = start().await;
    let mut connect = member("member-a", 10, 300);
    connect.clean_start = false;
    let (mut a, _) = Client::connect_with(addr, connect.clone()).await;
    a.subscribe("$share/g/t", QoS::ExactlyOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publisher
        .publish("t", b"two", QoS::ExactlyOnce, false)
        .await;
    let sent = a.expect_publish().await;
    assert_eq!(sent.qos, QoS::ExactlyOnce);
    let mut b = Client::connect(addr, ProtocolVersion::V5, "member-b").await;
    b.subscribe("$share/g/t", QoS::ExactlyOnce).await;
    connect.clean_start = true;
    let (mut a2, ack) = Client::connect_with(addr, connect).await;
    assert!(!ack.session_present);
    let p = b.expect_publish().await;
    assert_eq!(
        (&p.payload[..], p.qos, p.dup),
        (&b"two"[..], QoS::ExactlyOnce, false)
    );
    b.ack(&p).await;
    a2.expect_nothing(SHORT).await;
    drop(a);
    broker.shutdown().await;
}

/// With no member left, the messages the last one held are dropped and counted
/// (`no_share_member`).
#[tokio::test]
async fn with_no_member_left_the_messages_are_dropped_and_counted() {
    let (broker, addr) = start().await;
    let (mut a, _) = Client::connect_with(addr, member("member-a", 1, 0)).await;
    a.subscribe("$share/g/t", QoS::AtLeastOnce).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for m in names("m-", 2) {
        publisher
            .publish("t", m.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    a.expect_publish().await;
    a.disconnect().await;
    wait_until("two dropped", || {
        broker.stats().dropped_count(DropCause::NoShareMember) == 2
    })
    .await;
    assert_eq!(broker.stats().shared_passed_on, 0);
    // A later member does not get them.
    let mut b = Client::connect(addr, ProtocolVersion::V5, "member-b").await;
    b.subscribe("$share/g/t", QoS::AtLeastOnce).await;
    b.expect_nothing(SHORT).await;
    broker.shutdown().await;
}
