//! Streams (`[[streams]]`, docs/streams.md): readers subscribing to `$stream/<name>` replay
//! the stream from an offset or a time, then follow live appends with no gap and no
//! duplicate; retention; access control; MQTT 3.1.1 readers' `@<offset>` level.
use crate::common;

use std::net::SocketAddr;

use common::*;
use mercurio::codec::{Properties, ProtocolVersion, Publish, QoS, ReasonCode};
use mercurio::config::StreamConfig;
use mercurio::BrokerHandle;

fn stream(name: &str, filter: &str) -> StreamConfig {
    StreamConfig {
        name: name.into(),
        filter: filter.into(),
        max_age: 0,
        max_bytes: 0,
        last_value: false,
    }
}

async fn broker_with(streams: Vec<StreamConfig>) -> (BrokerHandle, SocketAddr) {
    let mut config = test_config();
    config.streams = streams;
    start_with(config).await
}

fn offset_prop(value: &str) -> Properties {
    Properties {
        user_properties: vec![("stream-offset".into(), value.into())],
        ..Properties::default()
    }
}

/// A delivery's `stream-offset` and `stream-time` user properties.
fn position(p: &Publish) -> (u64, u64) {
    let get = |k: &str| {
        p.properties
            .user_properties
            .iter()
            .find(|(n, _)| n == k)
            .unwrap_or_else(|| panic!("no {k} on {p:?}"))
            .1
            .parse::<u64>()
            .expect("a number")
    };
    (get("stream-offset"), get("stream-time"))
}

/// Subscribes `c` to `filter` at QoS 1 from `offset`; asserts the SUBACK.
async fn read_from(c: &mut Client, filter: &str, offset: &str) {
    let rc = c
        .subscribe_with(&[(filter, opts(QoS::AtLeastOnce))], offset_prop(offset))
        .await;
    assert_eq!(
        rc,
        [ReasonCode::GRANTED_QOS_1],
        "SUBACK for {filter} at {offset}"
    );
}

/// The next `n` deliveries (acknowledged): (offset, time, topic, payload).
async fn take(c: &mut Client, n: usize) -> Vec<(u64, u64, String, String)> {
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        let p = c.expect_publish().await;
        c.ack(&p).await;
        let (offset, time) = position(&p);
        got.push((
            offset,
            time,
            p.topic.clone(),
            String::from_utf8_lossy(&p.payload).into_owned(),
        ));
    }
    got
}

async fn publish_range(c: &mut Client, topic: &str, range: std::ops::Range<u32>) {
    for i in range {
        let rc = c
            .publish(topic, i.to_string().as_bytes(), QoS::AtLeastOnce, false)
            .await;
        assert!(!rc.is_failure());
    }
}

/// A reader from `earliest` subscribing while a publisher publishes continuously gets every
/// message once, in append order: the replay, then the live ones, no gap and no duplicate
/// at the boundary. Each delivery has the message's own topic and its offset and time.
#[tokio::test]
async fn replay_from_earliest_then_live_without_gap_or_duplicate() {
    let (_broker, addr) = broker_with(vec![stream("s", "t/#")]).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_range(&mut publisher, "t/a", 0..50).await;
    let feeding = tokio::spawn(async move {
        publish_range(&mut publisher, "t/a", 50..400).await;
        publisher
    });
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/s", "earliest").await;
    let got = take(&mut reader, 400).await;
    for (i, (offset, _, topic, payload)) in got.iter().enumerate() {
        assert_eq!(*offset, i as u64 + 1);
        assert_eq!(topic, "t/a", "the message's original topic");
        assert_eq!(payload, &i.to_string());
    }
    assert!(
        got.windows(2).all(|w| w[0].1 <= w[1].1),
        "times never go back"
    );
    let mut publisher = feeding.await.unwrap();
    reader
        .expect_nothing(std::time::Duration::from_millis(100))
        .await;
    publisher
        .publish("t/b", b"live", QoS::AtLeastOnce, false)
        .await;
    let live = take(&mut reader, 1).await;
    assert_eq!((live[0].0, live[0].3.as_str()), (401, "live"));
}

/// Two readers at different positions (an offset, a time) each get their own complete
/// sequence; `latest` gets only what comes after; reading acknowledges nothing away.
#[tokio::test]
async fn readers_at_an_offset_and_a_time_get_their_own_sequences() {
    let (_broker, addr) = broker_with(vec![stream("s", "t/#")]).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_range(&mut publisher, "t/x", 0..30).await;

    let mut all = Client::connect(addr, ProtocolVersion::V5, "all").await;
    read_from(&mut all, "$stream/s", "earliest").await;
    let every = take(&mut all, 30).await;

    let mut at_offset = Client::connect(addr, ProtocolVersion::V5, "at-offset").await;
    read_from(&mut at_offset, "$stream/s", "12").await;
    let from_12 = take(&mut at_offset, 19).await;
    assert_eq!(
        from_12.iter().map(|e| e.0).collect::<Vec<_>>(),
        (12..=30).collect::<Vec<_>>()
    );

    // A time: the first message appended at or after it.
    let t = every[20].1;
    let first = every.iter().find(|e| e.1 >= t).unwrap().0;
    let mut at_time = Client::connect(addr, ProtocolVersion::V5, "at-time").await;
    read_from(&mut at_time, "$stream/s", &t.to_string()).await;
    let from_t = take(&mut at_time, (31 - first) as usize).await;
    assert_eq!(from_t[0].0, first);
    assert_eq!(from_t.last().unwrap().0, 30);

    // An RFC 3339 time before everything is the earliest.
    let mut rfc = Client::connect(addr, ProtocolVersion::V5, "rfc").await;
    read_from(&mut rfc, "$stream/s", "2001-01-01T00:00:00Z").await;
    assert_eq!(take(&mut rfc, 1).await[0].0, 1);

    let mut latest = Client::connect(addr, ProtocolVersion::V5, "latest").await;
    read_from(&mut latest, "$stream/s", "latest").await;

    publisher
        .publish("t/y", b"new", QoS::AtLeastOnce, false)
        .await;
    for c in [&mut all, &mut at_offset, &mut at_time, &mut latest] {
        let e = take(c, 1).await;
        assert_eq!((e[0].0, e[0].3.as_str()), (31, "new"));
        c.expect_nothing(std::time::Duration::from_millis(50)).await;
    }
    // Nothing was removed by the readers' acknowledgements.
    let mut again = Client::connect(addr, ProtocolVersion::V5, "again").await;
    read_from(&mut again, "$stream/s", "earliest").await;
    assert_eq!(take(&mut again, 31).await.len(), 31);
}

/// `$stream/<name>/<filter>` reads the part of the stream matching the filter; the offsets
/// are the stream's.
#[tokio::test]
async fn a_sub_filter_reads_part_of_the_stream() {
    let (_broker, addr) = broker_with(vec![stream("s", "t/#")]).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for topic in ["t/a", "t/b", "t/a", "t/b"] {
        publisher
            .publish(topic, b"x", QoS::AtLeastOnce, false)
            .await;
    }
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/s/t/b", "earliest").await;
    let got = take(&mut reader, 2).await;
    assert_eq!(
        got.iter().map(|e| (e.0, e.2.as_str())).collect::<Vec<_>>(),
        [(2, "t/b"), (4, "t/b")]
    );
    reader
        .expect_nothing(std::time::Duration::from_millis(50))
        .await;
}

/// MQTT 3.1.1 has no user properties: the start goes in the topic filter's `@` level.
#[tokio::test]
async fn mqtt311_readers_give_the_offset_in_the_filter() {
    let (_broker, addr) = broker_with(vec![stream("s", "t/#")]).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_range(&mut publisher, "t/a", 0..5).await;
    let mut reader = Client::connect(addr, ProtocolVersion::V311, "old").await;
    assert_eq!(
        reader.subscribe("$stream/s/@3", QoS::AtLeastOnce).await,
        ReasonCode::GRANTED_QOS_1
    );
    let mut payloads = Vec::new();
    for _ in 0..3 {
        let p = reader.expect_publish().await;
        assert_eq!(p.topic, "t/a");
        reader.ack(&p).await;
        payloads.push(String::from_utf8_lossy(&p.payload).into_owned());
    }
    assert_eq!(payloads, ["2", "3", "4"]);
    // UNSUBSCRIBE stops the reader (a 3.1.1 UNSUBACK has no reason codes).
    reader.unsubscribe(&["$stream/s/@3"]).await;
    publisher
        .publish("t/a", b"after", QoS::AtLeastOnce, false)
        .await;
    reader
        .expect_nothing(std::time::Duration::from_millis(100))
        .await;
}

/// Bad stream filters and offsets are refused in the SUBACK, with no effect on the others.
#[tokio::test]
async fn unknown_streams_and_bad_offsets_are_refused() {
    let (_broker, addr) = broker_with(vec![stream("s", "t/#")]).await;
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    let rc = reader
        .subscribe_with(
            &[
                ("$stream/nope", opts(QoS::AtLeastOnce)),
                ("$stream/s/@soon", opts(QoS::AtLeastOnce)),
            ],
            Properties::default(),
        )
        .await;
    assert_eq!(
        rc,
        [
            ReasonCode::TOPIC_FILTER_INVALID,
            ReasonCode::TOPIC_FILTER_INVALID
        ]
    );
    let rc = reader
        .subscribe_with(
            &[("$stream/s", opts(QoS::AtLeastOnce))],
            offset_prop("yesterday"),
        )
        .await;
    assert_eq!(rc, [ReasonCode::IMPLEMENTATION_SPECIFIC_ERROR]);
}

/// `max_bytes` keeps the newest messages within the bound; `last_value` one per topic.
#[tokio::test]
async fn retention_by_bytes_and_last_value() {
    let mut bounded = stream("bounded", "b/#");
    bounded.max_bytes = 100;
    let mut last = stream("last", "l/#");
    last.last_value = true;
    let (_broker, addr) = broker_with(vec![bounded, last]).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    // Each message is 3 (topic) + 7 (payload) bytes: 10 fit in 100.
    for i in 0..25 {
        let payload = format!("{i:07}");
        publisher
            .publish("b/x", payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/bounded", "earliest").await;
    let got = take(&mut reader, 10).await;
    assert_eq!(got[0].0, 16, "the oldest went first");
    assert_eq!(got[9].3, "0000024");
    reader
        .expect_nothing(std::time::Duration::from_millis(50))
        .await;

    for (topic, payload) in [
        ("l/a", "1"),
        ("l/b", "1"),
        ("l/a", "2"),
        ("l/c", "1"),
        ("l/b", "2"),
    ] {
        publisher
            .publish(topic, payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    read_from(&mut reader, "$stream/last", "earliest").await;
    let got = take(&mut reader, 3).await;
    assert_eq!(
        got.iter()
            .map(|e| (e.0, e.2.as_str(), e.3.as_str()))
            .collect::<Vec<_>>(),
        [(3, "l/a", "2"), (4, "l/c", "1"), (5, "l/b", "2")]
    );
}

/// A QoS 1 reader gets at most its Receive Maximum unacknowledged; one that stops reading
/// holds a position: its session's queue stays bounded however much the stream grows.
#[tokio::test]
async fn a_reader_that_stops_costs_a_position_not_a_queue() {
    let (broker, addr) = broker_with(vec![stream("s", "t/#")]).await;
    let mut connect = connect_packet(ProtocolVersion::V5, "slow");
    connect.properties.receive_maximum = Some(5);
    let (mut reader, ack) = Client::connect_with(addr, connect).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    read_from(&mut reader, "$stream/s", "earliest").await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_range(&mut publisher, "t/a", 0..1000).await;
    let mut first = Vec::new();
    for _ in 0..5 {
        first.push(position(&reader.expect_publish().await).0);
    }
    assert_eq!(first, [1, 2, 3, 4, 5]);
    // [MQTT-3.3.4-9]: no more unacknowledged QoS 1 PUBLISH than the Receive Maximum.
    reader
        .expect_nothing(std::time::Duration::from_millis(100))
        .await;
    let slow = broker
        .sessions()
        .into_iter()
        .find(|s| s.client_id == "slow")
        .unwrap();
    assert!(slow.queued <= 64, "queued {}", slow.queued);
    assert_eq!(slow.inflight, 5);
}

/// Reading needs read access to the stream's filter, or to the part asked for: otherwise
/// SUBACK 0x87 [MQTT-3.9.3-1].
#[tokio::test]
async fn readers_need_read_access() {
    let dir = tempfile::tempdir().unwrap();
    let acl = dir.path().join("acl");
    std::fs::write(
        &acl,
        "user a\ntopic read tenants/a/#\ntopic write tenants/#\n",
    )
    .unwrap();
    let mut config = test_config();
    config.auth.acl_file = Some(acl);
    config.streams = vec![stream("all", "tenants/#")];
    let (_broker, addr) = start_with(config).await;
    let (mut a, _) =
        Client::connect_with(addr, connect_as(ProtocolVersion::V5, "a", Some("a"), None)).await;
    let rc = a
        .subscribe_with(
            &[
                ("$stream/all", opts(QoS::AtLeastOnce)),
                ("$stream/all/tenants/a/#", opts(QoS::AtLeastOnce)),
            ],
            offset_prop("earliest"),
        )
        .await;
    assert_eq!(rc, [ReasonCode::NOT_AUTHORIZED, ReasonCode::GRANTED_QOS_1]);
    let (mut w, _) =
        Client::connect_with(addr, connect_as(ProtocolVersion::V5, "w", Some("a"), None)).await;
    w.publish("tenants/b/x", b"b", QoS::AtLeastOnce, false)
        .await;
    w.publish("tenants/a/x", b"a", QoS::AtLeastOnce, false)
        .await;
    let p = a.expect_publish().await;
    assert_eq!((p.topic.as_str(), position(&p).0), ("tenants/a/x", 2));
    match a.recv_within(std::time::Duration::from_millis(50)).await {
        Err(()) => {}
        other => panic!("expected nothing, got {other:?}"),
    }
}

/// What a stream holds, its readers and what retention removed, in
/// `$SYS/broker/streams/<name>/...` and in `/metrics` (labelled by stream).
#[tokio::test]
async fn sys_topics_and_metrics_per_stream() {
    let mut config = tcp_and_websocket_config();
    config.server.sys_interval = 1;
    config.listeners[1].metrics = true;
    let mut s = stream("s", "t/#");
    s.max_bytes = 40; // 4 messages of 3 + 7 bytes
    config.streams = vec![s];
    let (broker, addr) = start_with(config).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for i in 0..6 {
        let payload = format!("{i:07}");
        publisher
            .publish("t/a", payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/s", "earliest").await;
    assert_eq!(take(&mut reader, 4).await[0].0, 3);

    let mut sys = Client::connect(addr, ProtocolVersion::V311, "sys").await;
    sys.subscribe("$SYS/broker/streams/s/#", QoS::AtMostOnce)
        .await;
    let want = [
        ("messages", "4"),
        ("bytes", "40"),
        ("first_offset", "3"),
        ("last_offset", "6"),
        ("readers", "1"),
        ("trimmed/messages", "2"),
        ("trimmed/bytes", "20"),
    ];
    let mut seen = std::collections::HashMap::new();
    while !want
        .iter()
        .all(|(k, v)| seen.get(*k).is_some_and(|have: &String| have == v))
    {
        let p = sys.expect_publish().await;
        let name = p.topic.strip_prefix("$SYS/broker/streams/s/").unwrap();
        seen.insert(
            name.to_string(),
            String::from_utf8_lossy(&p.payload).into_owned(),
        );
    }
    let metrics = http_get(broker.local_addrs()[1], "/metrics").await.text();
    for line in [
        "mercurio_stream_messages{stream=\"s\"} 4",
        "mercurio_stream_last_offset{stream=\"s\"} 6",
        "mercurio_stream_readers{stream=\"s\"} 1",
        "mercurio_stream_trimmed_messages_total{stream=\"s\"} 2",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }
}

/// A stream deleted while the broker runs leaves no `$SYS` value behind: at the next tick
/// its topics' subscribers get each value deleted (an empty retained message, as a client
/// deletes one [MQTT-3.3.1-6]), and a new subscriber gets none of them.
#[tokio::test]
async fn a_deleted_streams_sys_topics_are_cleared() {
    let mut config = test_config();
    config.server.sys_interval = 1;
    let (broker, addr) = start_with(config).await;
    broker
        .create_stream(stream("gone", "g/#"))
        .expect("created");
    let mut sys = Client::connect(addr, ProtocolVersion::V311, "sys").await;
    sys.subscribe("$SYS/broker/streams/gone/messages", QoS::AtMostOnce)
        .await;
    assert_eq!(&sys.expect_publish().await.payload[..], b"0");
    broker.delete_stream("gone").expect("deleted");
    let cleared = sys.expect_publish().await;
    assert_eq!(cleared.topic, "$SYS/broker/streams/gone/messages");
    assert!(cleared.payload.is_empty(), "{cleared:?}");
    let mut late = Client::connect(addr, ProtocolVersion::V311, "late").await;
    late.subscribe("$SYS/broker/streams/#", QoS::AtMostOnce)
        .await;
    // Retained values come before the answer to a later PINGREQ: none here.
    late.ping().await;
}

/// With SQLite, a restart keeps every acknowledged message of a stream with its offset and
/// append time, retention's place (offsets go on, never given twice) and a `last_value`
/// stream's values; a stream removed from the configuration is deleted.
#[tokio::test]
async fn a_restart_keeps_streams_with_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let config = |streams: Vec<StreamConfig>| {
        let mut config = test_config();
        config.storage.backend = mercurio::config::StorageBackend::Sqlite;
        config.storage.path = Some(dir.path().join("mercurio.db"));
        config.streams = streams;
        config
    };
    let mut bounded = stream("bounded", "t/#");
    bounded.max_bytes = 40; // 4 messages of 3 + 7 bytes
    let mut last = stream("last", "t/#");
    last.last_value = true;
    let streams = vec![stream("all", "t/#"), bounded, last];

    let (broker, addr) = start_with(config(streams.clone())).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for i in 0..30 {
        let topic = if i % 2 == 0 { "t/a" } else { "t/b" };
        let payload = format!("{i:07}");
        publisher
            .publish(topic, payload.as_bytes(), QoS::AtLeastOnce, false)
            .await;
    }
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/all", "earliest").await;
    let before = take(&mut reader, 30).await;
    broker.shutdown().await;

    let (broker, addr) = start_with(config(streams)).await;
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/all", "earliest").await;
    assert_eq!(
        take(&mut reader, 30).await,
        before,
        "offsets, times, topics, payloads"
    );
    read_from(&mut reader, "$stream/bounded", "earliest").await;
    let bounded = take(&mut reader, 4).await;
    assert_eq!(
        bounded.iter().map(|e| e.0).collect::<Vec<_>>(),
        [27, 28, 29, 30]
    );
    read_from(&mut reader, "$stream/last", "earliest").await;
    let last = take(&mut reader, 2).await;
    assert_eq!(
        last.iter()
            .map(|e| (e.0, e.2.as_str(), e.3.as_str()))
            .collect::<Vec<_>>(),
        [(29, "t/a", "0000028"), (30, "t/b", "0000029")]
    );
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publisher
        .publish("t/a", b"after", QoS::AtLeastOnce, false)
        .await;
    let mut live = Vec::new();
    for _ in 0..3 {
        let p = reader.expect_publish().await;
        reader.ack(&p).await;
        live.push(position(&p).0);
    }
    assert_eq!(live, [31, 31, 31], "offsets go on after the restart");
    broker.shutdown().await;

    // Streams no longer configured are deleted with their entries; a stream configured
    // again starts empty, its offsets from 1.
    let (broker, _) = start_with(config(Vec::new())).await;
    broker.shutdown().await;
    let (broker, addr) = start_with(config(vec![stream("all", "t/#")])).await;
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/all", "earliest").await;
    reader
        .expect_nothing(std::time::Duration::from_millis(100))
        .await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publisher
        .publish("t/a", b"new", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(take(&mut reader, 1).await[0].0, 1);
    broker.shutdown().await;
}

/// A stream created at run time takes the messages published from then on and, with
/// SQLite, is back after a restart with its messages; deleted, it is gone for good.
#[tokio::test]
async fn a_stream_created_at_run_time_is_kept_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config();
    config.storage.backend = mercurio::config::StorageBackend::Sqlite;
    config.storage.path = Some(dir.path().join("mercurio.db"));

    let (broker, addr) = start_with(config.clone()).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publisher
        .publish("t/a", b"before", QoS::AtLeastOnce, false)
        .await;
    let mut made = stream("made", "t/#");
    made.max_bytes = 1 << 20;
    let info = broker.create_stream(made.clone()).expect("created");
    assert!(info.runtime);
    assert_eq!(
        broker.create_stream(made),
        Err(mercurio::streams::StreamRefused::Exists("made".into()))
    );
    broker
        .create_stream(stream("doomed", "t/#"))
        .expect("created");
    publisher
        .publish("t/a", b"1", QoS::AtLeastOnce, false)
        .await;
    publisher
        .publish("t/b", b"2", QoS::AtLeastOnce, false)
        .await;
    broker.delete_stream("doomed").expect("deleted");
    broker.shutdown().await;

    let (broker, addr) = start_with(config.clone()).await;
    let streams = broker.streams();
    assert_eq!(
        streams.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["made"]
    );
    assert_eq!((streams[0].max_bytes, streams[0].runtime), (1 << 20, true));
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/made", "earliest").await;
    let got = take(&mut reader, 2).await;
    assert_eq!(
        got.iter().map(|e| (e.0, e.3.as_str())).collect::<Vec<_>>(),
        [(1, "1"), (2, "2")],
        "what was published after its creation, not before"
    );
    broker.delete_stream("made").expect("deleted");
    broker.shutdown().await;
    let (broker, _) = start_with(config).await;
    assert!(broker.streams().is_empty());
    broker.shutdown().await;
}

/// Payloads of 16 KiB: a few hundred of them are more than a stream keeps in memory (8 MiB).
const BIG: usize = 16 << 10;

/// Message `i` of the big ones: its number, then padding up to [`BIG`] bytes.
fn big_payload(i: u32) -> Vec<u8> {
    let mut p = format!("{i:07}").into_bytes();
    p.resize(BIG, b'.');
    p
}

async fn publish_big(c: &mut Client, range: std::ops::Range<u32>) {
    for i in range {
        let rc = c
            .publish("t/a", &big_payload(i), QoS::AtLeastOnce, false)
            .await;
        assert!(!rc.is_failure(), "message {i}");
    }
}

/// The next `n` deliveries (acknowledged): (offset, time, the number in the payload), each
/// payload checked whole.
async fn take_big(c: &mut Client, n: usize) -> Vec<(u64, u64, u32)> {
    let mut got = Vec::with_capacity(n);
    for _ in 0..n {
        let p = c.expect_publish().await;
        c.ack(&p).await;
        let (offset, time) = position(&p);
        let i: u32 = std::str::from_utf8(&p.payload[..7])
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("payload of offset {offset}"));
        assert_eq!(
            p.payload.as_ref(),
            big_payload(i).as_slice(),
            "offset {offset}"
        );
        got.push((offset, time, i));
    }
    got
}

fn sqlite_config(dir: &std::path::Path, streams: Vec<StreamConfig>) -> mercurio::config::Config {
    let mut config = test_config();
    config.storage.backend = mercurio::config::StorageBackend::Sqlite;
    config.storage.path = Some(dir.join("mercurio.db"));
    config.streams = streams;
    config
}

fn info(broker: &BrokerHandle, name: &str) -> mercurio::streams::StreamInfo {
    broker
        .streams()
        .into_iter()
        .find(|s| s.name == name)
        .expect("the stream")
}

/// With SQLite, a stream larger than what it keeps in memory holds only its newest messages
/// there: a reader from `earliest` gets the older ones read back from storage, then those in
/// memory, then the live ones, every one once and in order while a publisher keeps
/// publishing through both switches.
#[tokio::test]
async fn a_replay_longer_than_memory_reads_storage_then_memory_then_live() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, addr) = start_with(sqlite_config(dir.path(), vec![stream("s", "t/#")])).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_big(&mut publisher, 0..1200).await;
    wait_until("older messages left memory", || {
        let s = info(&broker, "s");
        s.messages == 1200 && s.in_memory < 700
    })
    .await;
    let feeding = tokio::spawn(async move {
        publish_big(&mut publisher, 1200..1800).await;
        publisher
    });
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/s", "earliest").await;
    let got = take_big(&mut reader, 1800).await;
    for (i, (offset, _, n)) in got.iter().enumerate() {
        assert_eq!((*offset, *n), (i as u64 + 1, i as u32), "in order, no gap");
    }
    assert!(
        got.windows(2).all(|w| w[0].1 <= w[1].1),
        "times never go back"
    );
    let mut publisher = feeding.await.unwrap();
    reader
        .expect_nothing(std::time::Duration::from_millis(100))
        .await;
    publish_big(&mut publisher, 1800..1801).await;
    assert_eq!(take_big(&mut reader, 1).await[0].0, 1801, "then live");
    let s = info(&broker, "s");
    assert_eq!((s.messages, s.first_offset, s.last_offset), (1801, 1, 1801));
    assert!(s.in_memory < 700, "{} messages in memory", s.in_memory);
    broker.shutdown().await;
}

/// With SQLite, a reader replays thousands of small messages left in storage only (read
/// back a thousand at a time, the next batch while the last is delivered): every one once,
/// in order, with its payload, then those in memory, then a live one.
#[tokio::test]
async fn a_long_replay_of_small_messages_from_storage_is_whole_and_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = sqlite_config(dir.path(), vec![stream("s", "t/#")]);
    config.storage.stream_memory_bytes = 64 << 10;
    let (broker, addr) = start_with(config).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_range(&mut publisher, "t/a", 0..3000).await;
    wait_until("most messages left memory", || {
        let s = info(&broker, "s");
        s.messages == 3000 && s.in_memory < 200
    })
    .await;
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/s", "earliest").await;
    let got = take(&mut reader, 3000).await;
    for (i, (offset, _, topic, payload)) in got.iter().enumerate() {
        assert_eq!(
            (*offset, topic.as_str(), payload.as_str()),
            (i as u64 + 1, "t/a", i.to_string().as_str()),
            "in order, no gap"
        );
    }
    reader
        .expect_nothing(std::time::Duration::from_millis(100))
        .await;
    publish_range(&mut publisher, "t/a", 3000..3001).await;
    assert_eq!(take(&mut reader, 1).await[0].0, 3001, "then live");
    broker.shutdown().await;
}

/// With SQLite, retention (`max_bytes`) trims a stream whose oldest messages are in storage
/// only, and counts what it removed; a restart keeps every offset, time and message, with
/// nothing of the stream read into memory until a reader asks, and offsets go on.
#[tokio::test]
async fn retention_and_a_restart_keep_a_stream_larger_than_memory_with_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let size = 3 + BIG as u64; // topic and payload
    let mut bounded = stream("bounded", "t/#");
    bounded.max_bytes = 1000 * size;
    let streams = vec![stream("all", "t/#"), bounded];
    let (broker, addr) = start_with(sqlite_config(dir.path(), streams.clone())).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_big(&mut publisher, 0..1300).await;
    wait_until("retention trimmed the oldest, in storage only", || {
        let s = info(&broker, "bounded");
        (s.messages, s.bytes, s.first_offset, s.trimmed_messages) == (1000, 1000 * size, 301, 300)
    })
    .await;
    assert_eq!(info(&broker, "bounded").trimmed_bytes, 300 * size);
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/all", "earliest").await;
    let before = take_big(&mut reader, 1300).await;
    broker.shutdown().await;

    let (broker, addr) = start_with(sqlite_config(dir.path(), streams)).await;
    let all = info(&broker, "all");
    assert_eq!(
        (
            all.messages,
            all.bytes,
            all.first_offset,
            all.last_offset,
            all.in_memory
        ),
        (1300, 1300 * size, 1, 1300, 0),
        "counters back, entries left in storage"
    );
    let bounded = info(&broker, "bounded");
    assert_eq!(
        (bounded.messages, bounded.first_offset, bounded.last_offset),
        (1000, 301, 1300)
    );
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/all", "earliest").await;
    assert_eq!(
        take_big(&mut reader, 1300).await,
        before,
        "offsets, times, messages"
    );
    read_from(&mut reader, "$stream/bounded", "earliest").await;
    let kept = take_big(&mut reader, 1000).await;
    assert_eq!(
        kept.iter().map(|e| e.0).collect::<Vec<_>>(),
        (301..=1300).collect::<Vec<_>>()
    );
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_big(&mut publisher, 1300..1301).await;
    let live: Vec<u64> = take_big(&mut reader, 2).await.iter().map(|e| e.0).collect();
    assert_eq!(
        live,
        [1301, 1301],
        "offsets go on after the restart, in both streams"
    );
    wait_until("the oldest trimmed", || {
        info(&broker, "bounded").first_offset == 302
    })
    .await;
    broker.shutdown().await;
}

/// With SQLite, `max_age` removes the messages of a stream that are in storage only (the
/// oldest, beyond what it keeps in memory), and those in memory, and counts them; the
/// offsets go on.
#[tokio::test]
async fn max_age_removes_messages_in_storage_only_with_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let mut aging = stream("aging", "t/#");
    aging.max_age = 3;
    let (broker, addr) = start_with(sqlite_config(dir.path(), vec![aging])).await;
    let mut publisher = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    publish_big(&mut publisher, 0..1000).await;
    wait_until("older messages in storage only", || {
        let s = info(&broker, "aging");
        s.in_memory < s.messages
    })
    .await;
    wait_until("every message aged out", || {
        let s = info(&broker, "aging");
        (s.messages, s.bytes, s.first_offset, s.trimmed_messages) == (0, 0, 1001, 1000)
    })
    .await;
    let mut reader = Client::connect(addr, ProtocolVersion::V5, "reader").await;
    read_from(&mut reader, "$stream/aging", "earliest").await;
    reader
        .expect_nothing(std::time::Duration::from_millis(100))
        .await;
    publish_big(&mut publisher, 1000..1001).await;
    assert_eq!(take_big(&mut reader, 1).await[0].0, 1001);
    broker.shutdown().await;
}
