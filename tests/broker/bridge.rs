//! Bridges: Mercurio as a client of another broker, forwarding `out` topics to it and `in`
//! topics from it, with its state in `$SYS`. The remote is a real mosquitto (skipped when it
//! is not installed, a failure under `CI=true`) or another Mercurio.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use mercurio_core::codec::{Packet, ProtocolVersion, Publish, QoS};
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
        cafile: None,
        certfile: None,
        keyfile: None,
        tls_server_name: None,
        try_private: true,
        notifications: true,
        notification_topic: None,
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
