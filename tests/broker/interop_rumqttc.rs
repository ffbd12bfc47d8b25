//! Interoperability with rumqttc 0.24, a widely used Rust client, against an in-process broker:
//! its 3.1.1 client (`rumqttc`) and its 5.0 client (`rumqttc::v5`). QoS 0/1/2 round trips,
//! retained messages, persistent sessions, flow control over many QoS 1 messages, and 5.0
//! publish properties.
//!
//! Each client's event loop runs in a task that forwards its events to a channel; the tests
//! wait on that channel with deadlines.
use crate::common;

use std::time::Duration;

use common::{start, DEADLINE};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};
use tokio::sync::mpsc;

/// A 3.1.1 client and its events.
struct V4 {
    client: AsyncClient,
    events: mpsc::UnboundedReceiver<Event>,
}

/// Runs `eventloop` until it fails, forwarding events; the failure ends the channel.
fn drive_v4(mut eventloop: EventLoop) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(event) = eventloop.poll().await {
            if tx.send(event).is_err() {
                break;
            }
        }
    });
    rx
}

impl V4 {
    async fn connect(port: u16, id: &str, clean: bool) -> (V4, rumqttc::ConnAck) {
        let mut options = MqttOptions::new(id, "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(30));
        options.set_clean_session(clean);
        let (client, eventloop) = AsyncClient::new(options, 1000);
        let mut c = V4 {
            client,
            events: drive_v4(eventloop),
        };
        let ack = c
            .expect(|p| match p {
                Packet::ConnAck(a) => Some(a.clone()),
                _ => None,
            })
            .await;
        assert_eq!(ack.code, rumqttc::ConnectReturnCode::Success, "{id}");
        (c, ack)
    }

    /// The first incoming packet `f` accepts; others are skipped.
    async fn expect<T>(&mut self, mut f: impl FnMut(&Packet) -> Option<T>) -> T {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let event = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .expect("event before the deadline")
                .expect("event loop ended (connection error)");
            if let Event::Incoming(p) = &event {
                if let Some(t) = f(p) {
                    return t;
                }
            }
        }
    }

    async fn next_publish(&mut self) -> rumqttc::Publish {
        self.expect(|p| match p {
            Packet::Publish(p) => Some(p.clone()),
            _ => None,
        })
        .await
    }

    async fn subscribe(&mut self, filter: &str, qos: QoS) {
        self.client.subscribe(filter, qos).await.expect("subscribe");
        let codes = self
            .expect(|p| match p {
                Packet::SubAck(a) => Some(a.return_codes.clone()),
                _ => None,
            })
            .await;
        assert_eq!(codes, vec![rumqttc::SubscribeReasonCode::Success(qos)]);
    }

    /// Publishes and, for QoS 1/2, waits for the PUBACK / PUBCOMP.
    async fn publish(&mut self, topic: &str, qos: QoS, retain: bool, payload: &[u8]) {
        self.client
            .publish(topic, qos, retain, payload.to_vec())
            .await
            .expect("publish");
        match qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => {
                self.expect(|p| matches!(p, Packet::PubAck(_)).then_some(()))
                    .await
            }
            QoS::ExactlyOnce => {
                self.expect(|p| matches!(p, Packet::PubComp(_)).then_some(()))
                    .await
            }
        }
    }

    async fn disconnect(mut self) {
        self.client.disconnect().await.expect("disconnect");
        // The event loop ends once the DISCONNECT is out.
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while let Ok(Some(_)) = tokio::time::timeout_at(deadline, self.events.recv()).await {}
    }
}

#[tokio::test]
async fn v4_qos_0_1_2_round_trip() {
    let (broker, addr) = start().await;
    let (mut sub, _) = V4::connect(addr.port(), "rumqttc-sub", true).await;
    sub.subscribe("rumqttc/qos/#", QoS::ExactlyOnce).await;
    let (mut publisher, _) = V4::connect(addr.port(), "rumqttc-pub", true).await;
    for qos in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce] {
        let topic = format!("rumqttc/qos/{}", qos as u8);
        publisher
            .publish(&topic, qos, false, format!("{qos:?}").as_bytes())
            .await;
        let p = sub.next_publish().await;
        assert_eq!(p.topic, topic);
        assert_eq!(p.qos, qos);
        assert!(!p.retain);
        assert_eq!(&p.payload[..], format!("{qos:?}").as_bytes());
    }
    publisher.disconnect().await;
    sub.disconnect().await;
    broker.shutdown().await;
}

#[tokio::test]
async fn v4_retained_message_reaches_a_later_subscriber() {
    let (broker, addr) = start().await;
    let (mut publisher, _) = V4::connect(addr.port(), "rumqttc-retain-pub", true).await;
    publisher
        .publish("rumqttc/retained", QoS::AtLeastOnce, true, b"kept")
        .await;
    let (mut later, _) = V4::connect(addr.port(), "rumqttc-retain-sub", true).await;
    later.subscribe("rumqttc/#", QoS::AtLeastOnce).await;
    let p = later.next_publish().await;
    assert_eq!(p.topic, "rumqttc/retained");
    assert!(p.retain);
    assert_eq!(p.qos, QoS::AtLeastOnce);
    assert_eq!(&p.payload[..], b"kept");

    // Deleted with an empty retained message: the next subscriber gets only what follows.
    publisher
        .publish("rumqttc/retained", QoS::AtLeastOnce, true, b"")
        .await;
    let (mut after, _) = V4::connect(addr.port(), "rumqttc-retain-after", true).await;
    after.subscribe("rumqttc/#", QoS::AtLeastOnce).await;
    publisher
        .publish("rumqttc/live", QoS::AtLeastOnce, false, b"marker")
        .await;
    let p = after.next_publish().await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("rumqttc/live", &b"marker"[..])
    );
    broker.shutdown().await;
}

#[tokio::test]
async fn v4_persistent_session_gets_what_was_published_while_away() {
    let (broker, addr) = start().await;
    let (mut sub, ack) = V4::connect(addr.port(), "rumqttc-persistent", false).await;
    assert!(!ack.session_present);
    sub.subscribe("rumqttc/persistent", QoS::AtLeastOnce).await;
    sub.disconnect().await;

    let (mut publisher, _) = V4::connect(addr.port(), "rumqttc-persistent-pub", true).await;
    for i in 0..5 {
        publisher
            .publish(
                "rumqttc/persistent",
                QoS::AtLeastOnce,
                false,
                format!("away {i}").as_bytes(),
            )
            .await;
    }
    let (mut back, ack) = V4::connect(addr.port(), "rumqttc-persistent", false).await;
    assert!(ack.session_present);
    for i in 0..5 {
        let p = back.next_publish().await;
        assert_eq!(&p.payload[..], format!("away {i}").as_bytes());
        assert_eq!(p.qos, QoS::AtLeastOnce);
    }
    broker.shutdown().await;
}

/// More QoS 1 messages than any window (the broker's max_inflight is 20, rumqttc's 100):
/// all arrive, in order.
#[tokio::test]
async fn v4_many_qos1_messages_arrive_in_order() {
    const N: usize = 2000;
    let (broker, addr) = start().await;
    let (mut sub, _) = V4::connect(addr.port(), "rumqttc-many-sub", true).await;
    sub.subscribe("rumqttc/many", QoS::AtLeastOnce).await;
    let (publisher, _) = V4::connect(addr.port(), "rumqttc-many-pub", true).await;
    let client = publisher.client.clone();
    let producer = tokio::spawn(async move {
        for i in 0..N {
            client
                .publish("rumqttc/many", QoS::AtLeastOnce, false, i.to_string())
                .await
                .expect("publish");
        }
    });
    for i in 0..N {
        let p = sub.next_publish().await;
        assert_eq!(&p.payload[..], i.to_string().as_bytes(), "message {i}");
    }
    producer.await.unwrap();
    broker.shutdown().await;
}

mod v5 {
    use super::*;
    use bytes::Bytes;
    use rumqttc::v5::mqttbytes::v5::{
        ConnAck, ConnectProperties, ConnectReturnCode, Packet, Publish, PublishProperties,
        SubscribeReasonCode,
    };
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};

    struct V5 {
        client: AsyncClient,
        events: mpsc::UnboundedReceiver<Event>,
    }

    fn drive(mut eventloop: EventLoop) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(event) = eventloop.poll().await {
                if tx.send(event).is_err() {
                    break;
                }
            }
        });
        rx
    }

    impl V5 {
        async fn connect(port: u16, id: &str, session_expiry: Option<u32>) -> (V5, ConnAck) {
            let mut options = MqttOptions::new(id, "127.0.0.1", port);
            options.set_keep_alive(Duration::from_secs(30));
            if let Some(expiry) = session_expiry {
                options.set_clean_start(false);
                let mut props = ConnectProperties::new();
                props.session_expiry_interval = Some(expiry);
                options.set_connect_properties(props);
            }
            let (client, eventloop) = AsyncClient::new(options, 1000);
            let mut c = V5 {
                client,
                events: drive(eventloop),
            };
            let ack = c
                .expect(|p| match p {
                    Packet::ConnAck(a) => Some(a.clone()),
                    _ => None,
                })
                .await;
            assert_eq!(ack.code, ConnectReturnCode::Success, "{id}");
            (c, ack)
        }

        async fn expect<T>(&mut self, mut f: impl FnMut(&Packet) -> Option<T>) -> T {
            let deadline = tokio::time::Instant::now() + DEADLINE;
            loop {
                let event = tokio::time::timeout_at(deadline, self.events.recv())
                    .await
                    .expect("event before the deadline")
                    .expect("event loop ended (connection error)");
                if let Event::Incoming(p) = &event {
                    if let Some(t) = f(p) {
                        return t;
                    }
                }
            }
        }

        async fn next_publish(&mut self) -> Publish {
            self.expect(|p| match p {
                Packet::Publish(p) => Some(p.clone()),
                _ => None,
            })
            .await
        }

        async fn subscribe(&mut self, filter: &str, qos: QoS) {
            self.client.subscribe(filter, qos).await.expect("subscribe");
            let codes = self
                .expect(|p| match p {
                    Packet::SubAck(a) => Some(a.return_codes.clone()),
                    _ => None,
                })
                .await;
            assert_eq!(codes, vec![SubscribeReasonCode::Success(qos)]);
        }

        async fn publish(
            &mut self,
            topic: &str,
            qos: QoS,
            props: PublishProperties,
            payload: &str,
        ) {
            self.client
                .publish_with_properties(topic, qos, false, payload.to_string(), props)
                .await
                .expect("publish");
            match qos {
                QoS::AtMostOnce => {}
                QoS::AtLeastOnce => {
                    self.expect(|p| matches!(p, Packet::PubAck(_)).then_some(()))
                        .await
                }
                QoS::ExactlyOnce => {
                    self.expect(|p| matches!(p, Packet::PubComp(_)).then_some(()))
                        .await
                }
            }
        }
    }

    fn properties(i: u8) -> PublishProperties {
        PublishProperties {
            user_properties: vec![
                ("k".into(), format!("v{i}")),
                ("a".into(), "b".into()),
                ("k".into(), "again".into()),
            ],
            response_topic: Some("rumqttc/v5/reply".into()),
            correlation_data: Some(Bytes::from(vec![0, i, 0xff])),
            content_type: Some("text/plain".into()),
            ..PublishProperties::default()
        }
    }

    #[tokio::test]
    async fn v5_round_trip_with_properties() {
        let (broker, addr) = start().await;
        let (mut sub, _) = V5::connect(addr.port(), "rumqttc5-sub", None).await;
        sub.subscribe("rumqttc/v5/#", QoS::ExactlyOnce).await;
        let (mut publisher, _) = V5::connect(addr.port(), "rumqttc5-pub", None).await;
        for (i, qos) in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce]
            .into_iter()
            .enumerate()
        {
            let topic = format!("rumqttc/v5/{i}");
            publisher
                .publish(&topic, qos, properties(i as u8), &format!("{qos:?}"))
                .await;
            let p = sub.next_publish().await;
            assert_eq!(&p.topic[..], topic.as_bytes());
            assert_eq!(p.qos, qos);
            assert_eq!(&p.payload[..], format!("{qos:?}").as_bytes());
            let got = p.properties.expect("properties forwarded");
            let sent = properties(i as u8);
            assert_eq!(got.user_properties, sent.user_properties, "in order");
            assert_eq!(got.response_topic, sent.response_topic);
            assert_eq!(got.correlation_data, sent.correlation_data);
            assert_eq!(got.content_type, sent.content_type);
        }
        broker.shutdown().await;
    }

    #[tokio::test]
    async fn v5_session_expiry_keeps_the_session() {
        let (broker, addr) = start().await;
        let (mut sub, ack) = V5::connect(addr.port(), "rumqttc5-persist", Some(300)).await;
        assert!(!ack.session_present);
        sub.subscribe("rumqttc/v5/persist", QoS::AtLeastOnce).await;
        sub.client.disconnect().await.expect("disconnect");
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while let Ok(Some(_)) = tokio::time::timeout_at(deadline, sub.events.recv()).await {}

        let (mut publisher, _) = V5::connect(addr.port(), "rumqttc5-persist-pub", None).await;
        publisher
            .publish(
                "rumqttc/v5/persist",
                QoS::AtLeastOnce,
                properties(7),
                "while away",
            )
            .await;
        let (mut back, ack) = V5::connect(addr.port(), "rumqttc5-persist", Some(300)).await;
        assert!(ack.session_present);
        let p = back.next_publish().await;
        assert_eq!(&p.payload[..], b"while away");
        assert_eq!(
            p.properties.expect("properties").user_properties,
            properties(7).user_properties
        );
        broker.shutdown().await;
    }
}
