//! Lifecycle events, publish interception and the in-process client's options, seen through
//! real sockets; and examples/events.rs against mosquitto_pub / mosquitto_sub.
use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use mercurio::codec::{
    Packet, Properties, ProtocolVersion, PubAck, QoS, ReasonCode, SubscriptionOptions,
};
use mercurio::stats::DropCause;
use mercurio::{
    Broker, BrokerHandle, DisconnectReason, Event, EventStream, InterceptedPublish,
    PublishInterceptor, SubscribedFilter, Subscription, Verdict,
};
use tokio::io::AsyncBufReadExt;

async fn next_event(events: &mut EventStream) -> Event {
    tokio::time::timeout(DEADLINE, events.recv())
        .await
        .expect("an event before the deadline")
        .expect("the event stream is open")
}

async fn next_delivery(sub: &mut Subscription) -> mercurio::Delivered {
    tokio::time::timeout(DEADLINE, sub.recv_delivery())
        .await
        .expect("a message before the deadline")
        .expect("the subscription is open")
}

fn connected(
    client_id: &str,
    username: Option<&str>,
    protocol: ProtocolVersion,
    client: &Client,
    clean_start: bool,
    session_present: bool,
) -> Event {
    Event::Connected {
        client_id: client_id.into(),
        username: username.map(str::to_string),
        protocol,
        peer: client.stream().local_addr().unwrap(),
        clean_start,
        session_present,
    }
}

fn disconnected(client_id: &str, reason: DisconnectReason) -> Event {
    Event::Disconnected {
        client_id: client_id.into(),
        reason,
    }
}

/// Connected carries the client identifier, user name, protocol, peer address, Clean Start
/// and Session Present; Disconnected carries why: the client's DISCONNECT, a lost
/// connection, an administrator, a protocol violation with its reason code.
#[tokio::test]
async fn connected_and_disconnected_carry_their_fields() {
    let (broker, addr) = start().await;
    let mut events = broker.events();

    let (c, ack) = Client::connect_with(
        addr,
        connect_as(ProtocolVersion::V5, "ev-a", Some("alice"), Some("pw")),
    )
    .await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    assert_eq!(
        next_event(&mut events).await,
        connected("ev-a", Some("alice"), ProtocolVersion::V5, &c, true, false)
    );
    c.disconnect().await;
    assert_eq!(
        next_event(&mut events).await,
        disconnected("ev-a", DisconnectReason::ClientDisconnect)
    );

    // A 3.1.1 persistent session: the second connection finds it (Session Present).
    let (c, present) = Client::connect_persistent(addr, ProtocolVersion::V311, "ev-b").await;
    assert!(!present);
    assert_eq!(
        next_event(&mut events).await,
        connected("ev-b", None, ProtocolVersion::V311, &c, false, false)
    );
    c.drop_connection().await;
    assert_eq!(
        next_event(&mut events).await,
        disconnected("ev-b", DisconnectReason::ConnectionLost)
    );
    let (mut c, present) = Client::connect_persistent(addr, ProtocolVersion::V311, "ev-b").await;
    assert!(present);
    assert_eq!(
        next_event(&mut events).await,
        connected("ev-b", None, ProtocolVersion::V311, &c, false, true)
    );
    assert!(broker.disconnect("ev-b"));
    c.expect_closed().await;
    assert_eq!(
        next_event(&mut events).await,
        disconnected("ev-b", DisconnectReason::Administrative)
    );

    // A second CONNECT is a protocol violation [MQTT-3.1.0-2].
    let mut c = Client::connect(addr, ProtocolVersion::V5, "ev-c").await;
    next_event(&mut events).await;
    c.send(Packet::Connect(Box::new(connect_packet(
        ProtocolVersion::V5,
        "ev-c",
    ))))
    .await;
    c.expect_violation(ReasonCode::PROTOCOL_ERROR).await;
    assert_eq!(
        next_event(&mut events).await,
        disconnected(
            "ev-c",
            DisconnectReason::ProtocolViolation(ReasonCode::PROTOCOL_ERROR)
        )
    );
    broker.shutdown().await;
    assert_eq!(
        tokio::time::timeout(DEADLINE, events.recv()).await.unwrap(),
        None,
        "the stream ends after shutdown"
    );
}

/// Subscribed lists the granted filters with their options and the Subscription Identifier;
/// Unsubscribed lists the filters that existed.
#[tokio::test]
async fn subscribed_and_unsubscribed_list_filters_with_options() {
    let (broker, addr) = start().await;
    let mut events = broker.events();
    let mut c = Client::connect(addr, ProtocolVersion::V5, "ev-sub").await;
    next_event(&mut events).await;
    let a = SubscriptionOptions {
        qos: QoS::AtLeastOnce,
        no_local: true,
        retain_as_published: true,
        retain_handling: 2,
    };
    let b = opts(QoS::ExactlyOnce);
    let props = Properties {
        subscription_identifiers: vec![42],
        ..Properties::default()
    };
    let codes = c
        .subscribe_with(
            &[("ev/a/#", a), ("$share/g/ev/b", b), ("bad/#/x", b)],
            props,
        )
        .await;
    assert_eq!(codes[2], ReasonCode::TOPIC_FILTER_INVALID);
    assert_eq!(
        next_event(&mut events).await,
        Event::Subscribed {
            client_id: "ev-sub".into(),
            subscriptions: vec![
                SubscribedFilter {
                    filter: "ev/a/#".into(),
                    options: a,
                    identifier: Some(42),
                },
                SubscribedFilter {
                    filter: "$share/g/ev/b".into(),
                    options: b,
                    identifier: Some(42),
                },
            ],
        }
    );
    let codes = c.unsubscribe(&["ev/a/#", "never/subscribed"]).await;
    assert_eq!(
        codes,
        vec![ReasonCode::SUCCESS, ReasonCode::NO_SUBSCRIPTION_EXISTED]
    );
    assert_eq!(
        next_event(&mut events).await,
        Event::Unsubscribed {
            client_id: "ev-sub".into(),
            filters: vec!["ev/a/#".into()],
        }
    );
    broker.shutdown().await;
}

/// A will goes out on an abnormal close (after Disconnected); a session whose expiry runs
/// out fires SessionExpired, then its delayed will is published as the session ends
/// [MQTT-3.1.2-8].
#[tokio::test]
async fn wills_and_session_expiry() {
    let (broker, addr) = start().await;
    let mut events = broker.events();

    let mut connect = connect_packet(ProtocolVersion::V311, "ev-will");
    connect.will = Some(will("ev/will", "gone", QoS::AtLeastOnce, true));
    let (c, _) = Client::connect_with(addr, connect).await;
    next_event(&mut events).await;
    c.drop_connection().await;
    assert_eq!(
        next_event(&mut events).await,
        disconnected("ev-will", DisconnectReason::ConnectionLost)
    );
    assert_eq!(
        next_event(&mut events).await,
        Event::WillPublished {
            client_id: "ev-will".into(),
            topic: "ev/will".into(),
            qos: QoS::AtLeastOnce,
            retain: true,
        }
    );

    // Session Expiry Interval 1 s, Will Delay Interval 60 s: the session ends first.
    let mut connect = connect_packet(ProtocolVersion::V5, "ev-exp");
    connect.properties.session_expiry_interval = Some(1);
    let mut w = will("ev/exp", "late", QoS::AtMostOnce, false);
    w.properties.will_delay_interval = Some(60);
    connect.will = Some(w);
    let (c, _) = Client::connect_with(addr, connect).await;
    next_event(&mut events).await;
    c.drop_connection().await;
    assert_eq!(
        next_event(&mut events).await,
        disconnected("ev-exp", DisconnectReason::ConnectionLost)
    );
    assert_eq!(
        next_event(&mut events).await,
        Event::SessionExpired {
            client_id: "ev-exp".into()
        }
    );
    assert_eq!(
        next_event(&mut events).await,
        Event::WillPublished {
            client_id: "ev-exp".into(),
            topic: "ev/exp".into(),
            qos: QoS::AtMostOnce,
            retain: false,
        }
    );
    broker.shutdown().await;
}

/// MessageDropped names the subscriber, the topic and the cause: a message larger than the
/// subscriber's Maximum Packet Size [MQTT-3.1.2-25], a full queue of a client away.
#[tokio::test]
async fn message_dropped_names_client_topic_and_cause() {
    let mut config = test_config();
    config.server.max_queued_messages = 1;
    let (broker, addr) = start_with(config).await;
    let mut events = broker.events();

    let mut connect = connect_packet(ProtocolVersion::V5, "ev-small");
    connect.properties.maximum_packet_size = Some(64);
    let (mut small, _) = Client::connect_with(addr, connect).await;
    next_event(&mut events).await;
    small.subscribe("ev/big", QoS::AtMostOnce).await;
    next_event(&mut events).await;
    broker
        .publish("ev/big", vec![b'x'; 500], QoS::AtMostOnce, false)
        .await
        .unwrap();
    assert_eq!(
        next_event(&mut events).await,
        Event::MessageDropped {
            client_id: Some("ev-small".into()),
            topic: "ev/big".into(),
            cause: DropCause::TooLarge,
        }
    );

    let (mut away, _) = Client::connect_persistent(addr, ProtocolVersion::V5, "ev-away").await;
    next_event(&mut events).await;
    away.subscribe("ev/q", QoS::AtLeastOnce).await;
    next_event(&mut events).await;
    away.disconnect().await;
    next_event(&mut events).await;
    for i in 0..2u8 {
        broker
            .publish("ev/q", vec![i], QoS::AtLeastOnce, false)
            .await
            .unwrap();
    }
    assert_eq!(
        next_event(&mut events).await,
        Event::MessageDropped {
            client_id: Some("ev-away".into()),
            topic: "ev/q".into(),
            cause: DropCause::QueueFull,
        }
    );
    broker.shutdown().await;
}

/// A stream nobody reads never slows the broker: clients go on connecting and messages on
/// flowing, and the stream then reads Lagged with the number of events it lost, followed by
/// the newest ones.
#[tokio::test]
async fn a_lagging_stream_reads_how_many_events_it_lost() {
    let broker = Broker::builder(test_config())
        .event_capacity(4)
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let mut events = broker.events();
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "ev-lag-sub").await;
    sub.subscribe("lag/t", QoS::AtLeastOnce).await;
    let mut fired = 2u64;
    for i in 0..10 {
        let mut c = Client::connect(addr, ProtocolVersion::V311, &format!("ev-lag-{i}")).await;
        assert_eq!(
            c.publish("lag/t", &[i], QoS::AtLeastOnce, false).await,
            ReasonCode::SUCCESS
        );
        let p = sub.expect_publish().await;
        assert_eq!(p.payload[..], [i]);
        sub.ack(&p).await;
        c.disconnect().await;
        fired += 2;
    }
    let last = format!("ev-lag-{}", 9);
    wait_until("the last client gone", || {
        !broker.sessions().iter().any(|s| s.client_id == last)
    })
    .await;
    let missed = match events.try_recv() {
        Some(Event::Lagged { missed }) => missed,
        other => panic!("expected Lagged first, got {other:?}"),
    };
    let mut kept = Vec::new();
    while let Some(e) = events.try_recv() {
        kept.push(e);
    }
    assert!(missed > 0);
    assert_eq!(
        missed + kept.len() as u64,
        fired,
        "every event lost or read"
    );
    assert_eq!(kept.len(), 4, "the capacity's newest events are kept");
    assert_eq!(
        kept.last(),
        Some(&disconnected(&last, DisconnectReason::ClientDisconnect))
    );
    broker.shutdown().await;
}

/// What the test interceptor saw of one PUBLISH.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    client_id: String,
    username: Option<String>,
    topic: String,
    qos: QoS,
    retain: bool,
    user_properties: Vec<(String, String)>,
}

/// Refuses `refuse/...` with 0x87, moves `rename/x` to `renamed/x` with its payload upper
/// case and a user property, sets an invalid topic for `invalid/...`, lets the rest through.
struct TestInterceptor {
    seen: Arc<Mutex<Vec<Seen>>>,
}

#[async_trait::async_trait]
impl PublishInterceptor for TestInterceptor {
    async fn intercept(&self, p: &mut InterceptedPublish<'_>) -> Verdict {
        self.seen.lock().unwrap().push(Seen {
            client_id: p.client_id().into(),
            username: p.username().map(str::to_string),
            topic: p.topic().into(),
            qos: p.qos(),
            retain: p.retain(),
            user_properties: p.properties().user_properties.clone(),
        });
        // An interceptor may wait (a database, a service).
        tokio::task::yield_now().await;
        if p.topic().starts_with("refuse/") {
            return Verdict::Refuse(ReasonCode::NOT_AUTHORIZED);
        }
        if let Some(rest) = p.topic().strip_prefix("rename/") {
            let topic = format!("renamed/{rest}");
            let payload = p.payload().to_ascii_uppercase();
            p.set_topic(topic);
            p.set_payload(payload);
            p.properties_mut()
                .user_properties
                .push(("checked".into(), "yes".into()));
        }
        if p.topic().starts_with("invalid/") {
            p.set_topic("invalid/#");
        }
        Verdict::Accept
    }
}

async fn start_intercepted() -> (BrokerHandle, std::net::SocketAddr, Arc<Mutex<Vec<Seen>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let broker = Broker::builder(test_config())
        .interceptor(TestInterceptor {
            seen: Arc::clone(&seen),
        })
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    (broker, addr, seen)
}

/// The interceptor sees each PUBLISH (client, user, topic, QoS, retain, properties) and
/// lets it through unchanged, changes its topic, payload and properties, or refuses it: an
/// MQTT 5.0 publisher reads the reason code in PUBACK and PUBREC, and the message is
/// neither delivered nor retained.
#[tokio::test]
async fn interceptor_passes_changes_and_refuses_for_mqtt5() {
    let (broker, addr, seen) = start_intercepted().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "int-sub").await;
    sub.subscribe("#", QoS::AtLeastOnce).await;
    let (mut publ, _) = Client::connect_with(
        addr,
        connect_as(ProtocolVersion::V5, "int-pub", Some("bob"), None),
    )
    .await;
    let props = Properties {
        user_properties: vec![("from".into(), "test".into())],
        ..Properties::default()
    };

    // Through, unchanged.
    let rc = publ
        .publish_with("pass/t", b"same", QoS::AtLeastOnce, false, props.clone())
        .await;
    assert_eq!(rc, ReasonCode::SUCCESS);
    let p = sub.expect_publish().await;
    assert_eq!((p.topic.as_str(), &p.payload[..]), ("pass/t", &b"same"[..]));
    assert_eq!(p.properties.user_properties, props.user_properties);
    sub.ack(&p).await;
    assert_eq!(
        seen.lock().unwrap()[0],
        Seen {
            client_id: "int-pub".into(),
            username: Some("bob".into()),
            topic: "pass/t".into(),
            qos: QoS::AtLeastOnce,
            retain: false,
            user_properties: props.user_properties.clone(),
        }
    );

    // Refused, QoS 1 and 2, retained or not: the reason code, nothing delivered or kept.
    let rc = publ
        .publish("refuse/t", b"no", QoS::AtLeastOnce, true)
        .await;
    assert_eq!(rc, ReasonCode::NOT_AUTHORIZED);
    let rc = publ
        .publish("refuse/t", b"no", QoS::ExactlyOnce, false)
        .await;
    assert_eq!(rc, ReasonCode::NOT_AUTHORIZED);
    assert_eq!(
        broker.retained_count(),
        0,
        "a refused message is not retained"
    );

    // Changed: topic, payload, properties.
    let rc = publ
        .publish_with("rename/x", b"quiet", QoS::ExactlyOnce, true, props.clone())
        .await;
    assert_eq!(rc, ReasonCode::SUCCESS);
    let p = sub.expect_publish().await;
    assert_eq!(
        (p.topic.as_str(), &p.payload[..]),
        ("renamed/x", &b"QUIET"[..]),
        "the changed message, and not the refused ones before it"
    );
    assert_eq!(
        p.properties.user_properties,
        vec![
            ("from".to_string(), "test".to_string()),
            ("checked".to_string(), "yes".to_string())
        ]
    );
    sub.ack(&p).await;
    assert_eq!(broker.retained_count(), 1, "retained under its new topic");
    let mut late = Client::connect(addr, ProtocolVersion::V5, "int-late").await;
    late.subscribe("renamed/#", QoS::AtMostOnce).await;
    assert_eq!(late.expect_publish().await.payload[..], b"QUIET"[..]);

    // An invalid topic set by the interceptor: refused as Topic Name invalid.
    let rc = publ
        .publish("invalid/t", b"x", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(rc, ReasonCode::TOPIC_NAME_INVALID);
    assert_eq!(seen.lock().unwrap().len(), 5);
    broker.shutdown().await;
}

/// A 3.x publisher has no way to be told of a refusal: its PUBACK / PUBREC is as usual, and
/// the message is not delivered.
#[tokio::test]
async fn interceptor_refusal_for_mqtt311_is_acknowledged_and_not_delivered() {
    let (broker, addr, seen) = start_intercepted().await;
    let mut sub = Client::connect(addr, ProtocolVersion::V311, "int-sub3").await;
    sub.subscribe("#", QoS::AtLeastOnce).await;
    let mut publ = Client::connect(addr, ProtocolVersion::V311, "int-pub3").await;
    for qos in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce] {
        let rc = publ.publish("refuse/t", b"no", qos, false).await;
        assert_eq!(rc, ReasonCode::SUCCESS);
    }
    // QoS 2 refused: a PUBREL for it is answered, nothing is pending.
    publ.publish("pass/after", b"yes", QoS::AtLeastOnce, false)
        .await;
    let p = sub.expect_publish().await;
    assert_eq!(
        p.topic, "pass/after",
        "the refused messages were not delivered"
    );
    assert_eq!(seen.lock().unwrap().len(), 4);
    broker.shutdown().await;
}

/// A refused QoS 2 message leaves no packet identifier waiting for PUBREL: the same
/// identifier can be used again at once.
#[tokio::test]
async fn refused_qos2_keeps_no_packet_identifier() {
    let (broker, addr, _seen) = start_intercepted().await;
    let mut publ = Client::connect(addr, ProtocolVersion::V5, "int-q2").await;
    publ.send(publish_packet(
        "refuse/t",
        b"x",
        QoS::ExactlyOnce,
        false,
        7,
        Properties::default(),
    ))
    .await;
    match publ.expect_packet().await {
        Packet::PubRec(PubAck {
            packet_id: 7,
            reason_code,
            ..
        }) => assert_eq!(reason_code, ReasonCode::NOT_AUTHORIZED),
        other => panic!("expected PUBREC 7, got {other:?}"),
    }
    publ.send(publish_packet(
        "pass/t",
        b"x",
        QoS::ExactlyOnce,
        false,
        7,
        Properties::default(),
    ))
    .await;
    match publ.expect_packet().await {
        Packet::PubRec(a) => assert_eq!(a.reason_code, ReasonCode::SUCCESS),
        other => panic!("expected PUBREC, got {other:?}"),
    }
    broker.shutdown().await;
}

/// The in-process client: subscription options (No Local, Retain As Published, Retain
/// Handling), several filters with their Subscription Identifiers, publishing with retain,
/// QoS and properties.
#[tokio::test]
async fn in_process_subscription_options_and_identifiers() {
    let (broker, addr) = start().await;
    let mut mqtt = Client::connect(addr, ProtocolVersion::V5, "inp-pub").await;
    mqtt.publish("inp/r", b"kept", QoS::AtLeastOnce, true).await;

    // Retain Handling 2: nothing at subscribe. Retain As Published: live RETAIN kept.
    let o = SubscriptionOptions {
        qos: QoS::AtLeastOnce,
        retain_as_published: true,
        retain_handling: 2,
        ..Default::default()
    };
    let mut sub = broker.subscribe_with("inp/#", o, Some(7)).unwrap();
    // A second filter with its own identifier, Retain Handling 1: retained sent (new).
    let o2 = SubscriptionOptions {
        qos: QoS::ExactlyOnce,
        retain_handling: 1,
        ..Default::default()
    };
    sub.subscribe("inp/r", o2, Some(9)).unwrap();
    let d = next_delivery(&mut sub).await;
    assert_eq!(
        (
            d.message.topic.as_str(),
            d.retain,
            d.subscription_ids.clone()
        ),
        ("inp/r", true, vec![9]),
        "only the new filter's retained message [MQTT-3.3.1-9]"
    );
    // The same filter again with Retain Handling 1: not new, nothing sent [MQTT-3.3.1-10].
    sub.subscribe("inp/r", o2, Some(9)).unwrap();
    let props = Properties {
        user_properties: vec![("k".into(), "v".into())],
        ..Properties::default()
    };
    mqtt.publish_with("inp/r", b"live", QoS::ExactlyOnce, true, props.clone())
        .await;
    let d = next_delivery(&mut sub).await;
    assert_eq!(
        &d.message.payload[..],
        b"live",
        "no retained message resent"
    );
    assert!(d.retain, "Retain As Published on inp/# [MQTT-3.3.1-12]");
    assert_eq!(d.qos, QoS::ExactlyOnce, "the highest granted QoS");
    let mut ids = d.subscription_ids.clone();
    ids.sort();
    assert_eq!(ids, vec![7, 9], "both identifiers [MQTT-3.3.4-3]");
    assert_eq!(d.message.properties.user_properties, props.user_properties);

    // Without Retain As Published, a live retained message arrives with RETAIN clear.
    let mut plain = broker.subscribe("inp/r", QoS::AtMostOnce).unwrap();
    assert!(
        next_delivery(&mut plain).await.retain,
        "retained at subscribe"
    );
    mqtt.publish("inp/r", b"again", QoS::AtMostOnce, true).await;
    let d = next_delivery(&mut plain).await;
    assert_eq!((&d.message.payload[..], d.retain), (&b"again"[..], false));
    assert_eq!(d.qos, QoS::AtMostOnce);
    next_delivery(&mut sub).await;

    // Unsubscribing one filter leaves the other.
    assert!(sub.unsubscribe("inp/r"));
    assert!(!sub.unsubscribe("inp/r"));
    mqtt.publish("inp/r", b"one id", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(next_delivery(&mut sub).await.subscription_ids, vec![7]);

    // Invalid options are refused as a SUBSCRIBE would be.
    let bad_rh = SubscriptionOptions {
        retain_handling: 3,
        ..Default::default()
    };
    assert!(broker.subscribe_with("x", bad_rh, None).is_err());
    assert!(broker.subscribe_with("x", o, Some(0)).is_err());
    assert!(broker.subscribe_with("x", o, Some(268_435_456)).is_err());
    let nl = SubscriptionOptions {
        no_local: true,
        ..Default::default()
    };
    assert!(broker.subscribe_with("$share/g/x", nl, None).is_err());
    broker.shutdown().await;
}

/// No Local: what an in-process subscription publishes itself does not come back to it
/// [MQTT-3.8.3-3]; network subscribers and the handle's publishes are not affected.
#[tokio::test]
async fn in_process_no_local() {
    let (broker, addr) = start().await;
    let mut mqtt = Client::connect(addr, ProtocolVersion::V5, "nl-sub").await;
    mqtt.subscribe("nl/#", QoS::AtLeastOnce).await;
    let o = SubscriptionOptions {
        qos: QoS::AtLeastOnce,
        no_local: true,
        ..Default::default()
    };
    let mut sub = broker.subscribe_with("nl/#", o, None).unwrap();
    sub.publish_with(
        "nl/own",
        "mine",
        QoS::AtLeastOnce,
        false,
        Properties::default(),
        None,
    )
    .await
    .unwrap();
    let p = mqtt.expect_publish().await;
    assert_eq!(p.topic, "nl/own", "network subscribers receive it");
    mqtt.ack(&p).await;
    broker
        .publish("nl/app", "from the handle", QoS::AtLeastOnce, false)
        .await
        .unwrap();
    let d = next_delivery(&mut sub).await;
    assert_eq!(
        d.message.topic, "nl/app",
        "its own message did not come back"
    );
    broker.shutdown().await;
}

/// examples/events.rs against mosquitto_pub / mosquitto_sub: one line per event, topics
/// under blocked/ refused with 0x87 (5.0) or not delivered (3.1.1), a user property added
/// to what goes through; a busy port is said as a sentence.
#[tokio::test]
async fn events_example_with_mosquitto_clients() {
    use tokio::io::BufReader;
    use tokio::process::Command;

    const TEST: &str = "events_example_with_mosquitto_clients";
    if !have_program(TEST, "mosquitto_pub") || !have_program(TEST, "mosquitto_sub") {
        return;
    }
    let example = example_binary("events");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let port_s = port.to_string();
    let mut child = Command::new(&example)
        .arg(&port_s)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the example starts");
    let mut example_out = Lines {
        lines: BufReader::new(child.stdout.take().unwrap()).lines(),
        seen: Vec::new(),
    };
    example_out
        .wait_line(format!("listening on 127.0.0.1:{port}"))
        .await;

    let sub = Command::new("mosquitto_sub")
        .args(["-h", "127.0.0.1", "-p", &port_s, "-V", "5", "-i", "ex-sub"])
        .args([
            "-t", "#", "-q", "1", "-C", "1", "-W", "10", "-F", "%t %p %P",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let line = example_out.wait_line("subscribed client_id=ex-sub").await;
    assert!(line.contains("filter=# qos=1 no_local=false"), "{line}");

    let publish = |version: &'static str, id: &'static str, topic: &'static str| {
        let port = port_s.clone();
        async move {
            Command::new("mosquitto_pub")
                .args(["-h", "127.0.0.1", "-p", &port, "-V", version, "-i", id])
                .args(["-q", "1", "-t", topic, "-m", "payload"])
                .output()
                .await
                .unwrap()
        }
    };
    let out = publish("5", "ex-pub5", "blocked/x").await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Not authorized"), "mosquitto_pub: {stderr}");
    let out = publish("311", "ex-pub3", "blocked/y").await;
    assert!(out.status.success(), "3.1.1: acknowledged as usual");
    let out = publish("5", "ex-pub-ok", "open/t").await;
    assert!(out.status.success());
    let received = sub.wait_with_output().await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&received.stdout).trim(),
        "open/t payload via:events-example",
        "the first message delivered is the one let through, with the property"
    );

    let line = example_out.wait_line("connected client_id=ex-pub3").await;
    assert!(
        line.starts_with("connected client_id=ex-pub3 user=- proto=4 peer=127.0.0.1:")
            && line.ends_with("clean_start=true session_present=false"),
        "{line}"
    );
    example_out
        .wait_line("disconnected client_id=ex-pub-ok reason=\"client disconnected\"")
        .await;
    example_out.wait_line("disconnected client_id=ex-sub").await;

    // The same port again: busy, said as a sentence.
    let out = Command::new(&example).arg(&port_s).output().await.unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("port {port} is busy")),
        "stderr: {stderr}"
    );
    child.kill().await.unwrap();
}

/// The example's output lines.
struct Lines {
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    seen: Vec<String>,
}

impl Lines {
    /// The first line (seen before or next) containing `needle`; panics after 10 s.
    async fn wait_line(&mut self, needle: impl AsRef<str>) -> String {
        let needle = needle.as_ref();
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        loop {
            let l = tokio::time::timeout(Duration::from_secs(10), self.lines.next_line())
                .await
                .unwrap_or_else(|_| panic!("no line with {needle:?}; saw {:?}", self.seen))
                .unwrap()
                .unwrap_or_else(|| panic!("the example ended; saw {:?}", self.seen));
            self.seen.push(l.clone());
            if l.contains(needle) {
                return l;
            }
        }
    }
}

/// The example binary, built by `cargo test` with the examples; built here when a filtered
/// run (`cargo test --test broker events::`) did not, or when a source changed since.
pub(crate) fn example_binary(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap().join("examples");
    let path = dir.join(name);
    // Up to date when no source it is built from changed after it. (Comparing with this
    // test binary would not do: a full `cargo test` may link the test after the example.)
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if let Some(example) = modified(&path) {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let sources = [
            "src",
            "examples",
            "mercurio-core/src",
            "mercurio-storage/src",
            "Cargo.toml",
            "Cargo.lock",
            "mercurio-core/Cargo.toml",
            "mercurio-storage/Cargo.toml",
        ];
        if sources
            .iter()
            .all(|s| newest_modified(&root.join(s)).is_none_or(|m| m <= example))
        {
            return path;
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // Without what cargo sets for a test (the variables of this package, its library
    // path): build scripts that watch them would make the next `cargo test` rebuild.
    let mut build = std::process::Command::new(cargo);
    for (key, _) in std::env::vars_os() {
        let key_s = key.to_string_lossy();
        let kept = ["CARGO_HOME", "CARGO_INCREMENTAL", "CARGO_TARGET_DIR"];
        if (key_s.starts_with("CARGO_") && !kept.contains(&key_s.as_ref()))
            || key_s == "LD_LIBRARY_PATH"
            || key_s == "OUT_DIR"
        {
            build.env_remove(&key);
        }
    }
    let status = build
        .args(["build", "--example", name])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("cargo runs");
    assert!(status.success(), "cargo build --example {name}");
    assert!(path.exists(), "{} exists", path.display());
    path
}

/// The latest modification time of a file, or of any file under a directory.
fn newest_modified(p: &std::path::Path) -> Option<std::time::SystemTime> {
    let meta = std::fs::metadata(p).ok()?;
    if !meta.is_dir() {
        return meta.modified().ok();
    }
    std::fs::read_dir(p)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| newest_modified(&e.path()))
        .max()
}

/// Panics on every PUBLISH to `panic/...`; lets the rest through.
struct PanickingInterceptor;

#[async_trait::async_trait]
impl PublishInterceptor for PanickingInterceptor {
    async fn intercept(&self, p: &mut InterceptedPublish<'_>) -> Verdict {
        tokio::task::yield_now().await;
        if p.topic().starts_with("panic/") {
            panic!("interceptor bug on {}", p.topic());
        }
        Verdict::Accept
    }
}

/// Connects `client_id` with clean start 0 (a session that outlives the connection) and
/// asserts the CONNACK comes within a second: nothing holds the client identifier.
async fn reconnects_at_once(addr: std::net::SocketAddr, version: ProtocolVersion, id: &str) {
    let (mut c, ack) = tokio::time::timeout(
        Duration::from_secs(1),
        Client::connect_with(addr, persistent(version, id, 60)),
    )
    .await
    .unwrap_or_else(|_| panic!("{id}: no CONNACK within a second"));
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS, "{id}");
    c.ping().await;
    c.disconnect().await;
}

/// A panicking interceptor costs only that PUBLISH: an MQTT 5.0 QoS 1 / QoS 2 publisher gets
/// PUBACK / PUBREC 0x80 Unspecified error and stays connected; a QoS 0 5.0 publisher gets
/// DISCONNECT 0x80 and a 3.1.1 publisher is closed (it has no other way to learn that its
/// message was lost). Each can connect again at once, and other clients are unaffected.
#[tokio::test]
async fn a_panicking_interceptor_costs_only_that_publish() {
    let broker = Broker::builder(test_config())
        .interceptor(PanickingInterceptor)
        .start()
        .await
        .unwrap();
    let addr = broker.local_addrs()[0];
    let logs = capture_logs();
    let mut sub = Client::connect(addr, ProtocolVersion::V5, "panic-sub").await;
    sub.subscribe("#", QoS::AtLeastOnce).await;

    // 5.0 at QoS 1 and 2: told, and still connected.
    let (mut p5, _) =
        Client::connect_with(addr, persistent(ProtocolVersion::V5, "panic-p5", 60)).await;
    for qos in [QoS::AtLeastOnce, QoS::ExactlyOnce] {
        let rc = p5.publish("panic/a", b"lost", qos, false).await;
        assert_eq!(rc, ReasonCode::UNSPECIFIED_ERROR, "{qos:?}");
    }
    p5.publish("ok/a", b"fine", QoS::AtLeastOnce, false).await;
    let got = sub.expect_publish().await;
    assert_eq!(
        (got.topic.as_str(), &got.payload[..]),
        ("ok/a", &b"fine"[..])
    );
    sub.ack(&got).await;
    // 5.0 at QoS 0: closed with DISCONNECT 0x80.
    p5.publish("panic/b", b"lost", QoS::AtMostOnce, false).await;
    assert_eq!(
        p5.expect_disconnect().await,
        Some(ReasonCode::UNSPECIFIED_ERROR)
    );
    reconnects_at_once(addr, ProtocolVersion::V5, "panic-p5").await;

    // 3.1.1: closed, at any QoS.
    for qos in [QoS::AtMostOnce, QoS::AtLeastOnce] {
        let (mut p3, _) =
            Client::connect_with(addr, persistent(ProtocolVersion::V311, "panic-p3", 60)).await;
        p3.send(publish_packet(
            "panic/c",
            b"lost",
            qos,
            false,
            u16::from(qos != QoS::AtMostOnce),
            Properties::default(),
        ))
        .await;
        assert_eq!(p3.expect_disconnect().await, None, "{qos:?}");
        reconnects_at_once(addr, ProtocolVersion::V311, "panic-p3").await;
    }

    // Nothing of the lost messages reached anyone; the subscriber was never disturbed.
    sub.ping().await;
    let mut other = Client::connect(addr, ProtocolVersion::V311, "panic-other").await;
    other
        .publish("ok/b", b"still", QoS::AtLeastOnce, false)
        .await;
    let got = sub.expect_publish().await;
    assert_eq!(got.topic, "ok/b");
    sub.ack(&got).await;
    sub.expect_nothing(Duration::from_millis(200)).await;
    // Logged at error level, once per panic, with the client identifier.
    let logged = logs.matching(&["ERROR", "publish interceptor panicked", "interceptor bug"]);
    assert_eq!(logged.len(), 5, "{:?}", logs.lines());
    assert!(logged
        .iter()
        .all(|l| l.contains("panic-p5") || l.contains("panic-p3")));
    broker.shutdown().await;
}
