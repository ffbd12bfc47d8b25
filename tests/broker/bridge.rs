//! Bridges: Mercurio as a client of another broker, forwarding `out` topics to it and `in`
//! topics from it, with its state in `$SYS`. The remote is a real mosquitto (skipped when it
//! is not installed, a failure under `CI=true`) or another Mercurio.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use mercurio_core::codec::{Packet, ProtocolVersion, Publish, QoS, ReasonCode};
use mercurio_core::config::{BridgeConfig, BridgeDirection, BridgeProtocol, BridgeTopic, Config};
use mercurio_testkit::Mosquitto;

pub(super) fn topic(
    pattern: &str,
    direction: BridgeDirection,
    qos: u8,
    local: &str,
    remote: &str,
) -> BridgeTopic {
    BridgeTopic {
        pattern: pattern.into(),
        direction,
        qos,
        local_prefix: local.into(),
        remote_prefix: remote.into(),
    }
}

pub(super) fn bridge(name: &str, to: SocketAddr, topics: Vec<BridgeTopic>) -> BridgeConfig {
    BridgeConfig {
        name: name.into(),
        addresses: vec![to.to_string()],
        round_robin: false,
        client_id: None,
        protocol_version: BridgeProtocol::Mqttv311,
        clean_start: false,
        keepalive: 60,
        max_inflight: 100,
        username: None,
        password: None,
        password_file: None,
        cafile: None,
        certfile: None,
        keyfile: None,
        tls_server_name: None,
        try_private: true,
        notifications: true,
        notification_topic: None,
        max_queued_messages: mercurio_core::config::DEFAULT_BRIDGE_QUEUED_MESSAGES,
        max_queued_bytes: mercurio_core::config::DEFAULT_BRIDGE_QUEUED_BYTES,
        max_packet_size: None,
        topics,
    }
}

fn with_bridges(bridges: Vec<BridgeConfig>) -> Config {
    let mut c = test_config();
    c.bridges = bridges;
    c
}

/// The next PUBLISH, acknowledged when QoS 1.
async fn next(c: &mut Client) -> Publish {
    let p = c.expect_publish().await;
    if p.qos == QoS::AtLeastOnce {
        c.ack(&p).await;
    }
    p
}

/// Waits for the retained or live value `want` on a `$SYS` state topic.
async fn expect_state(c: &mut Client, want: &str) {
    loop {
        let p = next(c).await;
        if p.payload.as_ref() == want.as_bytes() {
            return;
        }
    }
}

#[tokio::test]
async fn bridge_to_mosquitto_forwards_out_and_in_with_prefixes_and_reports_its_state() {
    let Some(remote) = Mosquitto::start(
        "bridge_to_mosquitto_forwards_out_and_in_with_prefixes_and_reports_its_state",
        0,
        "",
    ) else {
        return;
    };
    let mut b = bridge(
        "cloud",
        remote.addr(),
        vec![
            topic("sensors/#", BridgeDirection::Out, 1, "", "site1/"),
            topic("cmd/#", BridgeDirection::In, 1, "from-cloud/", "site1/"),
        ],
    );
    b.client_id = Some("site1".into());
    let (handle, addr) = start_with(with_bridges(vec![b])).await;

    let mut state = Client::connect(addr, ProtocolVersion::V5, "state").await;
    state
        .subscribe("$SYS/broker/connection/site1/state", QoS::AtMostOnce)
        .await;
    expect_state(&mut state, "1").await;

    // The remote sees the state too (retained, the bridge's notification).
    let mut far = Client::connect(remote.addr(), ProtocolVersion::V311, "far").await;
    far.subscribe("$SYS/broker/connection/site1/state", QoS::AtLeastOnce)
        .await;
    expect_state(&mut far, "1").await;
    far.subscribe("site1/sensors/#", QoS::AtLeastOnce).await;

    // Out: local sensors/t1 is site1/sensors/t1 on the remote, at QoS 1.
    let mut local = Client::connect(addr, ProtocolVersion::V5, "local").await;
    local.subscribe("from-cloud/#", QoS::AtLeastOnce).await;
    local
        .publish("sensors/t1", b"21.5", QoS::AtLeastOnce, false)
        .await;
    let p = next(&mut far).await;
    assert_eq!(p.topic, "site1/sensors/t1");
    assert_eq!(p.payload.as_ref(), b"21.5");
    assert_eq!(p.qos, QoS::AtLeastOnce);
    assert!(!p.retain);

    // In: site1/cmd/reboot on the remote is from-cloud/cmd/reboot here.
    let mut far_pub = Client::connect(remote.addr(), ProtocolVersion::V311, "far-pub").await;
    far_pub
        .publish("site1/cmd/reboot", b"now", QoS::AtLeastOnce, false)
        .await;
    let p = next(&mut local).await;
    assert_eq!(p.topic, "from-cloud/cmd/reboot");
    assert_eq!(p.payload.as_ref(), b"now");
    // Not out again: the remote's subscriber got nothing more than the forwarded message.
    far.expect_nothing(Duration::from_millis(300)).await;

    let info = handle.bridges();
    assert_eq!(info.len(), 1);
    assert!(info[0].connected);
    assert_eq!(info[0].forwarded_out, 1);
    assert_eq!(info[0].forwarded_in, 1);

    // The remote goes away: state 0 here.
    drop(far);
    drop(far_pub);
    drop(remote);
    expect_state(&mut state, "0").await;
    assert!(!handle.bridges()[0].connected);
    handle.shutdown().await;
}

#[tokio::test]
async fn messages_queued_while_the_remote_is_down_reach_it_when_it_comes_back() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("its address").port()
    };
    let remote_addr = SocketAddr::from(([127, 0, 0, 1], port));
    let b = bridge(
        "cloud",
        remote_addr,
        vec![topic("q/#", BridgeDirection::Out, 1, "", "")],
    );
    let (handle, addr) = start_with(with_bridges(vec![b])).await;
    let mut local = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for i in 0..50u32 {
        local
            .publish(&format!("q/{i}"), b"x", QoS::AtLeastOnce, false)
            .await;
    }
    wait_until("50 queued", || handle.bridges()[0].queued == 50).await;
    let Some(remote) = Mosquitto::start(
        "messages_queued_while_the_remote_is_down_reach_it_when_it_comes_back",
        port,
        "",
    ) else {
        return;
    };
    let mut far = Client::connect(remote.addr(), ProtocolVersion::V311, "far").await;
    far.subscribe("q/#", QoS::AtLeastOnce).await;
    // The bridge connects within its backoff (well under the deadline at first).
    let mut seen = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while seen.len() < 50 {
        match far
            .recv_within(deadline - tokio::time::Instant::now())
            .await
        {
            Ok(Some(Packet::Publish(p))) => {
                far.ack(&p).await;
                seen.insert(p.topic.clone());
            }
            other => panic!(
                "expected the queued messages, got {other:?} after {}",
                seen.len()
            ),
        }
    }
    wait_until("queue drained", || handle.bridges()[0].queued == 0).await;
    assert_eq!(handle.bridges()[0].forwarded_out, 50);
    handle.shutdown().await;
}

/// A bridge in MQTT 5 between two Mercurios, both ways on `mesh/#`.
fn mesh_bridge(name: &str, to: SocketAddr) -> BridgeConfig {
    let mut b = bridge(
        name,
        to,
        vec![topic("mesh/#", BridgeDirection::Both, 1, "", "")],
    );
    b.protocol_version = BridgeProtocol::Mqttv5;
    b
}

/// Publishes `n` messages on each broker and checks that each subscriber gets each of the
/// `n * brokers` messages exactly once.
async fn exactly_once_everywhere(addrs: &[SocketAddr], n: usize) {
    let mut subs = Vec::new();
    for (i, a) in addrs.iter().enumerate() {
        let mut c = Client::connect(*a, ProtocolVersion::V5, &format!("sub{i}")).await;
        c.subscribe("mesh/#", QoS::AtLeastOnce).await;
        subs.push(c);
    }
    for (i, a) in addrs.iter().enumerate() {
        let mut p = Client::connect(*a, ProtocolVersion::V5, &format!("pub{i}")).await;
        for k in 0..n {
            p.publish(
                &format!("mesh/{i}"),
                format!("{i}-{k}").as_bytes(),
                QoS::AtLeastOnce,
                false,
            )
            .await;
        }
    }
    let want: std::collections::BTreeSet<String> = (0..addrs.len())
        .flat_map(|i| (0..n).map(move |k| format!("{i}-{k}")))
        .collect();
    for (i, c) in subs.iter_mut().enumerate() {
        let mut got = std::collections::BTreeSet::new();
        while got.len() < want.len() {
            let p = next(c).await;
            let payload = String::from_utf8_lossy(&p.payload).into_owned();
            assert!(got.insert(payload.clone()), "broker {i}: {payload} twice");
        }
        assert_eq!(got, want, "broker {i}");
    }
    // Nothing more: no copy came late, no loop goes on.
    for c in subs.iter_mut() {
        c.expect_nothing(Duration::from_millis(500)).await;
    }
}

pub(super) async fn wait_connected(handle: &mercurio_core::BrokerHandle) {
    wait_until("bridges connected", || {
        handle.bridges().iter().all(|b| b.connected)
    })
    .await;
}

#[tokio::test]
async fn two_mercurios_bridged_both_ways_deliver_each_message_once() {
    let (b, b_addr) = start().await;
    let (a, a_addr) = start_with(with_bridges(vec![mesh_bridge("a-b", b_addr)])).await;
    wait_connected(&a).await;
    // The remote Mercurio keeps the bridge's state (its notification) with its $SYS values.
    let mut state = Client::connect(b_addr, ProtocolVersion::V5, "state").await;
    state
        .subscribe("$SYS/broker/connection/a-b/state", QoS::AtMostOnce)
        .await;
    expect_state(&mut state, "1").await;
    exactly_once_everywhere(&[a_addr, b_addr], 20).await;
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn a_mesh_of_three_mercurios_delivers_each_message_once_on_each() {
    // Each pair linked once: a -> b, b -> c, c -> a, every link both ways.
    let (a, a_addr) = start().await;
    let (b, b_addr) = start().await;
    let (c, c_addr) = start().await;
    for (handle, name, to) in [
        (&a, "a-b", b_addr),
        (&b, "b-c", c_addr),
        (&c, "c-a", a_addr),
    ] {
        let (report, errors) = handle.reload_bridges(&[mesh_bridge(name, to)]).await;
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(report.added, vec![name.to_string()]);
        wait_connected(handle).await;
    }
    exactly_once_everywhere(&[a_addr, b_addr, c_addr], 10).await;
    for h in [a, b, c] {
        h.shutdown().await;
    }
}

#[tokio::test]
async fn mosquitto_bridges_into_mercurio_both_ways_without_echo() {
    let (handle, addr) = start().await;
    // mosquitto's defaults: try_private, notifications on $SYS/broker/connection/<id>/state.
    let Some(site) = Mosquitto::start(
        "mosquitto_bridges_into_mercurio_both_ways_without_echo",
        0,
        &format!(
            "connection to-mercurio\naddress {addr}\nremote_clientid site-m\n\
             topic a/# both 1\nrestart_timeout 1\n"
        ),
    ) else {
        return;
    };
    let mut state = Client::connect(addr, ProtocolVersion::V5, "state").await;
    state
        .subscribe("$SYS/broker/connection/site-m/state", QoS::AtMostOnce)
        .await;
    expect_state(&mut state, "1").await;

    let mut here = Client::connect(addr, ProtocolVersion::V5, "here").await;
    here.subscribe("a/#", QoS::AtLeastOnce).await;
    let mut there = Client::connect(site.addr(), ProtocolVersion::V311, "there").await;
    there.subscribe("a/#", QoS::AtLeastOnce).await;

    // The bridge's subscription is in place once a message from here reaches there.
    let mut p = Client::connect(addr, ProtocolVersion::V5, "p-here").await;
    p.publish("a/from-mercurio", b"1", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(next(&mut there).await.topic, "a/from-mercurio");
    assert_eq!(next(&mut here).await.topic, "a/from-mercurio");

    let mut q = Client::connect(site.addr(), ProtocolVersion::V311, "p-there").await;
    q.publish("a/from-mosquitto", b"2", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(next(&mut here).await.topic, "a/from-mosquitto");
    assert_eq!(next(&mut there).await.topic, "a/from-mosquitto");
    // Each side saw each message once: Mercurio sends a bridge (try_private) none of its own
    // messages back.
    here.expect_nothing(Duration::from_millis(500)).await;
    there.expect_nothing(Duration::from_millis(100)).await;
    drop(site);
    expect_state(&mut state, "0").await;
    handle.shutdown().await;
}

/// A CA, a server certificate for localhost and a client certificate, as PEM files in `dir`:
/// ca.pem, server.pem, server.key, client.pem, client.key.
fn write_pki(dir: &std::path::Path) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, "bridge test CA");
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = p.self_signed(&ca_key).expect("CA");
    std::fs::write(dir.join("ca.pem"), ca.pem()).expect("write");
    for (name, server) in [("server", true), ("client", false)] {
        let key = KeyPair::generate().expect("key");
        let names = if server {
            vec!["localhost".to_string()]
        } else {
            Vec::new()
        };
        let mut p = CertificateParams::new(names).expect("params");
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        let cert = p.signed_by(&key, &ca, &ca_key).expect("sign");
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).expect("write");
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).expect("write");
    }
}

#[tokio::test]
async fn bridge_over_tls_with_a_client_certificate() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_pki(dir.path());
    let mut remote_config = test_config();
    remote_config
        .listeners
        .push(mercurio_core::config::ListenerConfig {
            port: 0,
            cert_file: Some(dir.path().join("server.pem")),
            key_file: Some(dir.path().join("server.key")),
            ca_file: Some(dir.path().join("ca.pem")),
            require_certificate: true,
            ..Default::default()
        });
    let (remote, remote_plain) = start_with(remote_config).await;
    let tls_port = remote.local_addrs()[1].port();

    let mut b = mesh_bridge("tls", SocketAddr::from(([127, 0, 0, 1], tls_port)));
    b.addresses = vec![format!("localhost:{tls_port}")];
    b.cafile = Some(dir.path().join("ca.pem"));
    b.certfile = Some(dir.path().join("client.pem"));
    b.keyfile = Some(dir.path().join("client.key"));
    // Without the client certificate the remote refuses the handshake.
    let mut refused = b.clone();
    refused.name = "no-cert".into();
    refused.certfile = None;
    refused.keyfile = None;
    let (local, addr) = start_with(with_bridges(vec![b, refused])).await;
    wait_until("the TLS bridge connected", || {
        local
            .bridges()
            .iter()
            .any(|x| x.name == "tls" && x.connected)
    })
    .await;
    wait_until("the bridge without certificate failed", || {
        local
            .bridges()
            .iter()
            .any(|x| x.name == "no-cert" && x.last_error.is_some())
    })
    .await;
    assert!(!local
        .bridges()
        .iter()
        .any(|x| x.name == "no-cert" && x.connected));

    let mut far = Client::connect(remote_plain, ProtocolVersion::V5, "far").await;
    far.subscribe("mesh/#", QoS::AtLeastOnce).await;
    let mut p = Client::connect(addr, ProtocolVersion::V5, "p").await;
    p.publish("mesh/secure", b"s", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(next(&mut far).await.payload.as_ref(), b"s");
    local.shutdown().await;
    remote.shutdown().await;
}

#[tokio::test]
async fn retained_messages_and_deletes_made_while_down_are_in_step_after_the_reconnect() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("its address").port()
    };
    let remote_addr = SocketAddr::from(([127, 0, 0, 1], port));
    let b = bridge(
        "cloud",
        remote_addr,
        vec![topic("r/#", BridgeDirection::Out, 1, "", "site/")],
    );
    let (handle, addr) = start_with(with_bridges(vec![b])).await;
    let mut p = Client::connect(addr, ProtocolVersion::V5, "p").await;
    // While the remote is away: two retained messages, one deleted again, one at QoS 0.
    p.publish("r/1", b"one", QoS::AtLeastOnce, true).await;
    p.publish("r/2", b"two", QoS::AtLeastOnce, true).await;
    p.publish("r/1", b"", QoS::AtLeastOnce, true).await;
    p.publish("r/3", b"three", QoS::AtMostOnce, true).await;
    let Some(remote) = Mosquitto::start(
        "retained_messages_and_deletes_made_while_down_are_in_step_after_the_reconnect",
        port,
        "",
    ) else {
        return;
    };
    wait_until("the bridge connected and drained", || {
        let b = &handle.bridges()[0];
        b.connected && b.queued == 0
    })
    .await;
    let mut far = Client::connect(remote.addr(), ProtocolVersion::V5, "far").await;
    far.subscribe("site/r/#", QoS::AtLeastOnce).await;
    let mut retained = std::collections::BTreeMap::new();
    while retained.len() < 2 {
        let m = next(&mut far).await;
        assert!(m.retain, "{m:?}");
        retained.insert(m.topic.clone(), m.payload.clone());
    }
    far.expect_nothing(Duration::from_millis(300)).await;
    assert_eq!(
        retained.keys().cloned().collect::<Vec<_>>(),
        vec!["site/r/2".to_string(), "site/r/3".to_string()]
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn counters_in_sys_and_metrics() {
    let (b, b_addr) = start().await;
    let mut config = tcp_and_websocket_config();
    config.listeners[1].metrics = true;
    config.server.sys_interval = 1;
    config.bridges = vec![mesh_bridge("a-b", b_addr)];
    let (a, a_addr) = start_with(config).await;
    let http = a.local_addrs()[1];
    wait_connected(&a).await;
    let mut p = Client::connect(a_addr, ProtocolVersion::V5, "p").await;
    for _ in 0..3 {
        p.publish("mesh/x", b"m", QoS::AtLeastOnce, false).await;
    }
    wait_until("3 forwarded", || a.bridges()[0].forwarded_out == 3).await;

    let mut sys = Client::connect(a_addr, ProtocolVersion::V5, "sys").await;
    sys.subscribe(
        "$SYS/broker/connection/a-b/messages/forwarded/out",
        QoS::AtMostOnce,
    )
    .await;
    expect_state(&mut sys, "3").await;

    let text = http_get(http, "/metrics").await.text();
    for line in [
        "mercurio_bridge_connected{bridge=\"a-b\"} 1",
        "mercurio_bridge_messages_forwarded_out_total{bridge=\"a-b\"} 3",
        "mercurio_bridge_queued_messages{bridge=\"a-b\"} 0",
        "mercurio_bridge_reconnects_total{bridge=\"a-b\"} 0",
    ] {
        assert!(text.contains(line), "{line} not in {text}");
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn an_unreachable_first_address_fails_over_to_the_next() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("its address")
    };
    let (b, b_addr) = start().await;
    let mut config = mesh_bridge("a-b", dead);
    config.addresses = vec![dead.to_string(), b_addr.to_string()];
    let (a, _) = start_with(with_bridges(vec![config])).await;
    wait_connected(&a).await;
    let info = &a.bridges()[0];
    assert_eq!(info.address.as_deref(), Some(b_addr.to_string().as_str()));
    assert!(
        info.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with(&dead.to_string())),
        "{info:?}"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn messages_in_from_the_remote_with_sqlite_and_durable_ack() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (b, b_addr) = start().await;
    let mut config = with_bridges(vec![bridge(
        "in",
        b_addr,
        vec![topic("d/#", BridgeDirection::In, 1, "", "")],
    )]);
    config.storage.backend = mercurio_core::config::StorageBackend::Sqlite;
    config.storage.path = Some(dir.path().join("a.db"));
    config.storage.durable_ack = true;
    let (a, a_addr) = start_with(config).await;
    wait_connected(&a).await;
    let mut here = Client::connect(a_addr, ProtocolVersion::V5, "here").await;
    here.subscribe("d/#", QoS::AtLeastOnce).await;
    let mut there = Client::connect(b_addr, ProtocolVersion::V5, "there").await;
    for i in 0..20u32 {
        there
            .publish(&format!("d/{i}"), b"x", QoS::AtLeastOnce, false)
            .await;
    }
    for i in 0..20u32 {
        assert_eq!(next(&mut here).await.topic, format!("d/{i}"));
    }
    wait_until("20 in", || a.bridges()[0].forwarded_in == 20).await;
    a.shutdown().await;
    b.shutdown().await;
}

/// A free local port with nothing listening on it (a remote that is down).
fn dead_address() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address")
}

#[tokio::test]
async fn a_bridge_queue_has_its_own_limits_and_devices_keep_the_server_ones() {
    // [server] max_queued_messages = 10 for every session; one bridge allows 5, the other
    // 1,000 (an uplink sized for an outage), both with their remote down.
    let dead = dead_address();
    let mut small = bridge(
        "small",
        dead,
        vec![topic("q/#", BridgeDirection::Out, 1, "", "")],
    );
    small.max_queued_messages = 5;
    let mut big = bridge(
        "big",
        dead,
        vec![topic("q/#", BridgeDirection::Out, 1, "", "")],
    );
    big.max_queued_messages = 1000;
    let mut config = with_bridges(vec![small, big]);
    config.server.max_queued_messages = 10;
    config.server.sys_interval = 1;
    let (handle, addr) = start_with(config).await;
    // A device's persistent session, offline.
    let (mut device, _) = connect_persistent(addr, ProtocolVersion::V311, "device").await;
    device.subscribe("q/#", QoS::AtLeastOnce).await;
    device.disconnect().await;

    let mut p = Client::connect(addr, ProtocolVersion::V5, "pub").await;
    for i in 0..20u32 {
        p.publish(&format!("q/{i}"), b"x", QoS::AtLeastOnce, false)
            .await;
    }
    let info = |name: &str| {
        handle
            .bridges()
            .into_iter()
            .find(|b| b.name == name)
            .expect("the bridge")
    };
    wait_until("the queues took the 20 messages", || {
        let (s, b) = (info("small"), info("big"));
        s.queued as u64 + s.dropped == 20 && b.queued as u64 + b.dropped == 20
    })
    .await;
    assert_eq!((info("small").queued, info("small").dropped), (5, 15));
    assert_eq!((info("big").queued, info("big").dropped), (20, 0));
    // The drops are in the bridge's $SYS counter.
    let mut sys = Client::connect(addr, ProtocolVersion::V5, "sys").await;
    sys.subscribe(
        "$SYS/broker/connection/small/messages/dropped",
        QoS::AtMostOnce,
    )
    .await;
    expect_state(&mut sys, "15").await;

    // The device session kept the [server] limit: the first 10.
    let (mut device, present) = connect_persistent(addr, ProtocolVersion::V311, "device").await;
    assert!(present);
    for i in 0..10u32 {
        assert_eq!(next(&mut device).await.topic, format!("q/{i}"));
    }
    device.expect_nothing(Duration::from_millis(300)).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn a_local_client_with_the_bridge_client_id_cannot_set_the_bridge_state() {
    let b = bridge(
        "cloud",
        dead_address(),
        vec![topic("q/#", BridgeDirection::Out, 1, "", "")],
    );
    let (handle, addr) = start_with(with_bridges(vec![b])).await;
    let state_topic = "$SYS/broker/connection/cloud/state";
    let mut watch = Client::connect(addr, ProtocolVersion::V5, "watch").await;
    watch.subscribe(state_topic, QoS::AtMostOnce).await;
    expect_state(&mut watch, "0").await;

    // A client taking the bridge's client id: its will and its publish on the state topic
    // (what a remote bridge of that name may do) do not change this broker's own value.
    let mut c = connect_packet(ProtocolVersion::V5, "cloud");
    c.will = Some(will(state_topic, "1", QoS::AtLeastOnce, true));
    let (mut fake, ack) = Client::connect_with(addr, c).await;
    assert_eq!(ack.reason_code, ReasonCode::SUCCESS);
    let rc = fake
        .publish(state_topic, b"1", QoS::AtLeastOnce, true)
        .await;
    assert_eq!(rc, ReasonCode::NOT_AUTHORIZED);
    fake.drop_connection().await;
    wait_until("the fake client gone", || {
        handle
            .sessions()
            .iter()
            .all(|c| c.client_id != "cloud" || !c.connected)
    })
    .await;
    watch.expect_nothing(Duration::from_millis(300)).await;
    let mut late = Client::connect(addr, ProtocolVersion::V5, "late").await;
    late.subscribe(state_topic, QoS::AtMostOnce).await;
    let p = next(&mut late).await;
    assert_eq!(p.payload.as_ref(), b"0");
    handle.shutdown().await;
}

/// A raw remote that answers every CONNECT with CONNACK 0 and closes at once; counts the
/// connections it accepted.
async fn accept_then_close() -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = std::sync::Arc::clone(&count);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(&[0x20, 2, 0, 0]).await;
        }
    });
    (addr, count)
}

#[tokio::test]
async fn a_remote_that_accepts_then_drops_the_link_is_retried_ever_more_slowly() {
    let logs = capture_logs();
    let (remote, attempts) = accept_then_close().await;
    let b = bridge(
        "flap",
        remote,
        vec![topic("q/#", BridgeDirection::Out, 1, "", "")],
    );
    let (handle, _) = start_with(with_bridges(vec![b])).await;
    // The pauses double from 0.5 s (each drawn in its upper half): within 6 s, at most
    // 5 connections (0, 0.5, 1.5, 3.5 and 7.5 s at the latest), where a pause starting
    // again from the shortest after each CONNACK made one every 0.25 to 0.5 s.
    let window = tokio::time::Instant::now() + Duration::from_secs(6);
    wait_until("a first connection", || {
        attempts.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    tokio::time::sleep_until(window).await;
    let n = attempts.load(std::sync::atomic::Ordering::SeqCst);
    assert!((3..=6).contains(&n), "{n} connections in 6 s");
    // One warning for the lost link, the repeats at debug level.
    let lost = logs.matching(&["WARN", "bridge connection lost"]);
    assert_eq!(lost.len(), 1, "{lost:#?}");
    handle.shutdown().await;
}

/// A bridge in MQTT 3.1.1 between two Mercurios, both ways on `mesh/#`.
fn mesh_bridge_311(name: &str, to: SocketAddr) -> BridgeConfig {
    bridge(
        name,
        to,
        vec![topic("mesh/#", BridgeDirection::Both, 1, "", "")],
    )
}

#[tokio::test]
async fn two_mercurios_bridged_both_ways_at_3_1_1_deliver_each_message_once() {
    let (b, b_addr) = start().await;
    let (a, a_addr) = start_with(with_bridges(vec![mesh_bridge_311("a-b", b_addr)])).await;
    wait_connected(&a).await;
    exactly_once_everywhere(&[a_addr, b_addr], 20).await;
    let info = a.bridges();
    assert_eq!((info[0].forwarded_out, info[0].forwarded_in), (20, 20));
    a.shutdown().await;
    b.shutdown().await;
}

/// Subscribes on `mesh/#` at each of `addrs`, then publishes one message on the first;
/// returns how many copies each subscriber got, once nothing more came for 500 ms (a loop
/// would go on sending).
async fn copies_of_one_publish(addrs: &[SocketAddr]) -> Vec<usize> {
    let mut subs = Vec::new();
    for (i, addr) in addrs.iter().enumerate() {
        let mut c = Client::connect(*addr, ProtocolVersion::V5, &format!("sub{i}")).await;
        c.subscribe("mesh/#", QoS::AtLeastOnce).await;
        subs.push(c);
    }
    let mut p = Client::connect(addrs[0], ProtocolVersion::V5, "p").await;
    p.publish("mesh/x", b"once", QoS::AtLeastOnce, false).await;
    let mut counts = Vec::new();
    for c in subs.iter_mut() {
        let mut n = 0;
        loop {
            match c.recv_within(Duration::from_millis(500)).await {
                Ok(Some(Packet::Publish(m))) => {
                    c.ack(&m).await;
                    assert_eq!(m.payload.as_ref(), b"once");
                    n += 1;
                    assert!(n <= 10, "a loop: {n} copies");
                }
                Err(()) => break,
                other => panic!("expected PUBLISH, got {other:?}"),
            }
        }
        counts.push(n);
    }
    counts
}

#[tokio::test]
async fn two_mercurios_each_bridged_to_the_other_at_3_1_1_do_not_loop() {
    // a -> b and b -> a, both ways on the same topics: two links between one pair.
    let (a, a_addr) = start().await;
    let (b, b_addr) = start().await;
    for (handle, name, to) in [(&a, "a-b", b_addr), (&b, "b-a", a_addr)] {
        let (_, errors) = handle.reload_bridges(&[mesh_bridge_311(name, to)]).await;
        assert!(errors.is_empty(), "{errors:?}");
    }
    wait_connected(&a).await;
    wait_connected(&b).await;
    // Once on a, and on b once by each link: no message crosses a second bridge.
    assert_eq!(copies_of_one_publish(&[a_addr, b_addr]).await, [1, 2]);
    for h in [&a, &b] {
        let info = &h.bridges()[0];
        assert_eq!(info.forwarded_out + info.forwarded_in, 1, "{info:?}");
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// a -> b -> c -> a over MQTT 3.1.1, every link `direction`.
async fn ring_311(
    direction: BridgeDirection,
) -> (Vec<mercurio_core::BrokerHandle>, Vec<SocketAddr>) {
    let mut handles = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let (h, a) = start().await;
        handles.push(h);
        addrs.push(a);
    }
    for i in 0..3 {
        let b = bridge(
            &format!("link{i}"),
            addrs[(i + 1) % 3],
            vec![topic("mesh/#", direction, 1, "", "")],
        );
        let (_, errors) = handles[i].reload_bridges(&[b]).await;
        assert!(errors.is_empty(), "{errors:?}");
    }
    for h in &handles {
        wait_connected(h).await;
    }
    (handles, addrs)
}

#[tokio::test]
async fn a_star_at_3_1_1_passes_a_site_message_on_to_the_other_sites_once() {
    // Two sites, each with one bridge into the central broker, both ways: the central broker
    // passes a site's message on from one site's bridge to the other's (one bridge into each
    // broker), and nothing comes back.
    let (hub, hub_addr) = start().await;
    let (s1, s1_addr) = start_with(with_bridges(vec![mesh_bridge_311("s1", hub_addr)])).await;
    let (s2, s2_addr) = start_with(with_bridges(vec![mesh_bridge_311("s2", hub_addr)])).await;
    wait_connected(&s1).await;
    wait_connected(&s2).await;
    assert_eq!(
        copies_of_one_publish(&[s1_addr, hub_addr, s2_addr]).await,
        [1, 1, 1]
    );
    for h in [s1, s2, hub] {
        h.shutdown().await;
    }
}

#[tokio::test]
async fn a_ring_of_three_mercurios_at_3_1_1_linked_both_ways_delivers_once_on_each() {
    let (handles, addrs) = ring_311(BridgeDirection::Both).await;
    assert_eq!(copies_of_one_publish(&addrs).await, [1, 1, 1]);
    for h in handles {
        h.shutdown().await;
    }
}

#[tokio::test]
async fn a_ring_of_three_mercurios_at_3_1_1_linked_out_only_crosses_one_bridge() {
    // a -> b -> c -> a, each only `out`: a message crosses one bridge, so one published on
    // a reaches b and stops there (it would otherwise go round for ever).
    let (handles, addrs) = ring_311(BridgeDirection::Out).await;
    assert_eq!(copies_of_one_publish(&addrs).await, [1, 1, 0]);
    for h in handles {
        h.shutdown().await;
    }
}

#[tokio::test]
async fn a_remote_packet_over_max_packet_size_closes_the_link_before_its_body_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // A raw remote: CONNACK, then a 16 MiB PUBLISH; `[server] max_packet_size` is 1 MiB.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let remote = listener.local_addr().expect("address");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Result<usize, String>>();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(&[0x20, 2, 0, 0]).await;
            if !first {
                let _ = tx.send(Ok(0));
                continue;
            }
            first = false;
            // PUBLISH QoS 0, topic "big/x": remaining length 16 MiB (4-byte varint).
            let remaining: usize = 16 * 1024 * 1024;
            let mut header = vec![0x30];
            let mut n = remaining;
            loop {
                let mut b = (n % 128) as u8;
                n /= 128;
                if n > 0 {
                    b |= 0x80;
                }
                header.push(b);
                if n == 0 {
                    break;
                }
            }
            header.extend_from_slice(&[0, 5]);
            header.extend_from_slice(b"big/x");
            // What follows the fixed header so far: the topic's length and the topic.
            let mut sent = 2 + 5;
            let result = async {
                s.write_all(&header).await.map_err(|e| e.to_string())?;
                let chunk = vec![b'x'; 64 * 1024];
                while sent < remaining {
                    let n = chunk.len().min(remaining - sent);
                    s.write_all(&chunk[..n]).await.map_err(|e| e.to_string())?;
                    sent += n;
                }
                Ok(sent)
            }
            .await;
            let _ = tx.send(result);
        }
    });
    let b = bridge(
        "big",
        remote,
        vec![topic("big/#", BridgeDirection::In, 0, "", "")],
    );
    let mut config = with_bridges(vec![b]);
    config.server.max_packet_size = 1024 * 1024;
    let (handle, _) = start_with(config).await;
    // The bridge closed the link on the fixed header: the remote could not write the body.
    let first = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the first connection within 10 s")
        .expect("a result");
    assert!(first.is_err(), "the 16 MiB body was read whole: {first:?}");
    // Counted, and connected again after the pause.
    let again = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a second connection within 10 s");
    assert_eq!(again, Some(Ok(0)));
    let info = &handle.bridges()[0];
    assert_eq!(info.packets_too_large, 1, "{info:?}");
    assert!(
        info.last_error
            .as_deref()
            .is_some_and(|e| e.contains("max_packet_size")),
        "{info:?}"
    );
    handle.shutdown().await;
}

/// A self-signed certificate for localhost (a CA certificate, as `openssl req -x509` makes
/// by default) and its key, as PEM files `{name}.pem` and `{name}.key` in `dir`.
fn self_signed(dir: &std::path::Path, name: &str) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let key = KeyPair::generate().expect("key");
    let mut p = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
    p.distinguished_name.push(DnType::CommonName, "localhost");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).expect("self-signed");
    std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).expect("write");
    std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).expect("write");
}

#[tokio::test]
async fn a_self_signed_remote_certificate_in_cafile_is_pinned() {
    let logs = capture_logs();
    let dir = tempfile::tempdir().expect("temp dir");
    self_signed(dir.path(), "remote");
    self_signed(dir.path(), "other");
    let mut remote_config = test_config();
    remote_config
        .listeners
        .push(mercurio_core::config::ListenerConfig {
            port: 0,
            cert_file: Some(dir.path().join("remote.pem")),
            key_file: Some(dir.path().join("remote.key")),
            ..Default::default()
        });
    let (remote, remote_plain) = start_with(remote_config).await;
    let tls_port = remote.local_addrs()[1].port();

    let mut pinned = mesh_bridge("pinned", SocketAddr::from(([127, 0, 0, 1], tls_port)));
    pinned.addresses = vec![format!("localhost:{tls_port}")];
    pinned.cafile = Some(dir.path().join("remote.pem"));
    // Another self-signed certificate in cafile: refused.
    let mut other = pinned.clone();
    other.name = "other".into();
    other.cafile = Some(dir.path().join("other.pem"));
    // The right certificate, the wrong name: refused too.
    let mut wrong_name = pinned.clone();
    wrong_name.name = "wrong-name".into();
    wrong_name.tls_server_name = Some("elsewhere.example".into());
    let (local, addr) = start_with(with_bridges(vec![pinned, other, wrong_name])).await;
    let info = |name: &str| {
        local
            .bridges()
            .into_iter()
            .find(|b| b.name == name)
            .expect("the bridge")
    };
    wait_until("the pinned bridge connected", || info("pinned").connected).await;
    wait_until("the other two failed", || {
        info("other").last_error.is_some() && info("wrong-name").last_error.is_some()
    })
    .await;
    assert!(!info("other").connected && !info("wrong-name").connected);
    let pinned_lines = logs.matching(&["remote certificate pinned", "bridge=pinned"]);
    assert!(!pinned_lines.is_empty(), "{:#?}", logs.lines());

    let mut far = Client::connect(remote_plain, ProtocolVersion::V5, "far").await;
    far.subscribe("mesh/#", QoS::AtLeastOnce).await;
    let mut p = Client::connect(addr, ProtocolVersion::V5, "p").await;
    p.publish("mesh/pinned", b"s", QoS::AtLeastOnce, false)
        .await;
    assert_eq!(next(&mut far).await.payload.as_ref(), b"s");
    local.shutdown().await;
    remote.shutdown().await;
}

#[tokio::test]
async fn a_password_without_tls_is_warned_about_once() {
    let logs = capture_logs();
    let mut b = bridge(
        "plain",
        dead_address(),
        vec![topic("q/#", BridgeDirection::Out, 1, "", "")],
    );
    b.username = Some("site".into());
    b.password = Some("secret".into());
    let (handle, _) = start_with(with_bridges(vec![b])).await;
    wait_until("a failed attempt", || {
        handle.bridges()[0].last_error.is_some()
    })
    .await;
    let lines = logs.matching(&["WARN", "password without TLS", "bridge=plain"]);
    assert_eq!(lines.len(), 1, "{:#?}", logs.lines());
    handle.shutdown().await;
}

/// A 3.1.1 bridge without the bridge mark (`try_private = false`) that takes messages in has
/// no loop protection (docs/bridges.md, Loops): the broker says so at start, once; an `out`
/// only bridge without the mark, or one with it, is not warned about.
#[tokio::test]
async fn a_3_1_1_bridge_without_try_private_taking_messages_in_is_warned_about() {
    let logs = capture_logs();
    let mut unmarked = bridge(
        "unmarked",
        dead_address(),
        vec![topic("q/#", BridgeDirection::Both, 1, "", "")],
    );
    unmarked.try_private = false;
    let mut out_only = bridge(
        "out-only",
        dead_address(),
        vec![topic("o/#", BridgeDirection::Out, 1, "", "")],
    );
    out_only.try_private = false;
    let marked = bridge(
        "marked",
        dead_address(),
        vec![topic("m/#", BridgeDirection::Both, 1, "", "")],
    );
    let (handle, _) = start_with(with_bridges(vec![unmarked, out_only, marked])).await;
    wait_until("a failed attempt of each", || {
        handle.bridges().iter().all(|b| b.last_error.is_some())
    })
    .await;
    let warned = |name: &str| {
        logs.matching(&["WARN", "try_private = false", &format!("bridge={name}")])
            .len()
    };
    assert_eq!(warned("unmarked"), 1, "{:#?}", logs.lines());
    assert_eq!(warned("out-only"), 0, "{:#?}", logs.lines());
    assert_eq!(warned("marked"), 0, "{:#?}", logs.lines());
    handle.shutdown().await;
}

#[tokio::test]
async fn a_retained_message_brought_in_by_a_bridge_does_not_go_back_to_a_3_1_1_bridge() {
    // b's bridge brings a's retained r/x = v1 in, then goes away; a's r/x becomes v2. When a
    // then bridges to b, b must not hand it v1 back as a retained message (it came over a
    // bridge into b), or a's retained value would go back to the stale v1.
    let (a, a_addr) = start().await;
    let (b, b_addr) = start().await;
    let rule = |d| vec![topic("r/#", d, 1, "", "")];
    let (_, errors) = b
        .reload_bridges(&[bridge("b-a", a_addr, rule(BridgeDirection::In))])
        .await;
    assert!(errors.is_empty(), "{errors:?}");
    wait_connected(&b).await;
    let mut watch_b = Client::connect(b_addr, ProtocolVersion::V5, "watch-b").await;
    watch_b.subscribe("r/#", QoS::AtLeastOnce).await;
    let mut p = Client::connect(a_addr, ProtocolVersion::V5, "p").await;
    p.publish("r/x", b"v1", QoS::AtLeastOnce, true).await;
    assert_eq!(next(&mut watch_b).await.payload.as_ref(), b"v1");
    let (report, _) = b.reload_bridges(&[]).await;
    assert_eq!(report.removed, vec!["b-a".to_string()]);
    p.publish("r/x", b"v2", QoS::AtLeastOnce, true).await;

    let (_, errors) = a
        .reload_bridges(&[bridge("a-b", b_addr, rule(BridgeDirection::In))])
        .await;
    assert!(errors.is_empty(), "{errors:?}");
    wait_connected(&a).await;
    let mut watch_a = Client::connect(a_addr, ProtocolVersion::V5, "watch-a").await;
    watch_a.subscribe("r/#", QoS::AtLeastOnce).await;
    assert_eq!(next(&mut watch_a).await.payload.as_ref(), b"v2");
    watch_a.expect_nothing(Duration::from_millis(500)).await;
    let mut late = Client::connect(a_addr, ProtocolVersion::V5, "late").await;
    late.subscribe("r/#", QoS::AtLeastOnce).await;
    assert_eq!(next(&mut late).await.payload.as_ref(), b"v2");
    a.shutdown().await;
    b.shutdown().await;
}
