//! recado over TLS (mqtts://, --cafile, --cert/--key, --insecure, --tls-server-name) and
//! WebSocket (ws://), against Mercurio's listeners and mosquitto's WebSocket listener.

use crate::support;

use std::path::{Path, PathBuf};

use mercurio::config::ListenerConfig;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use support::{exit, recado, Background, TestBroker};

/// A CA, a server certificate for localhost and 127.0.0.1, a client certificate, in `dir`:
/// ca.pem, server.pem, server.key, client.pem, client.key; and another CA (other.pem).
fn make_pki(dir: &Path) {
    let ca = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        (p.self_signed(&key).unwrap(), key)
    };
    let (ca_cert, ca_key) = ca("recado test CA");
    let (other, _) = ca("another CA");
    let leaf = |names: Vec<String>, server: bool| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(names).unwrap();
        p.distinguished_name.push(DnType::CommonName, "leaf");
        p.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        (p.signed_by(&key, &ca_cert, &ca_key).unwrap(), key)
    };
    let (server, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()], true);
    let (client, client_key) = leaf(Vec::new(), false);
    let w = |name: &str, text: String| std::fs::write(dir.join(name), text).unwrap();
    w("ca.pem", ca_cert.pem());
    w("other.pem", other.pem());
    w("server.pem", server.pem() + &ca_cert.pem());
    w("server.key", server_key.serialize_pem());
    w("client.pem", client.pem());
    w("client.key", client_key.serialize_pem());
}

fn path(dir: &Path, name: &str) -> String {
    let p: PathBuf = dir.join(name);
    p.to_string_lossy().into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_against_a_mercurio_tls_listener() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_pki(d);
    let mut config = support::common::test_config();
    config.listeners = vec![ListenerConfig {
        port: 0,
        cert_file: Some(d.join("server.pem")),
        key_file: Some(d.join("server.key")),
        ca_file: Some(d.join("ca.pem")),
        require_certificate: true,
        ..ListenerConfig::default()
    }];
    // WebSocket over TLS, no client certificate.
    config.listeners.push(ListenerConfig {
        port: 0,
        protocol: mercurio::config::ListenerProtocol::Websocket,
        cert_file: Some(d.join("server.pem")),
        key_file: Some(d.join("server.key")),
        ..ListenerConfig::default()
    });
    let b = TestBroker::mercurio_with(config).await;
    let port = b.port();
    let (ca, cert, key) = (
        path(d, "ca.pem"),
        path(d, "client.pem"),
        path(d, "client.key"),
    );
    let tls = [
        "--cafile",
        ca.as_str(),
        "--cert",
        cert.as_str(),
        "--key",
        key.as_str(),
    ];
    // mqtts:// URL, a client certificate, MQTT 5.
    let url = format!("mqtts://localhost:{port}/secure/t");
    let sub = Background::subscribed(
        &[
            &["sub", "-L", url.as_str(), "-C", "1", "-v", "-V", "5"][..],
            &tls[..],
        ]
        .concat(),
    )
    .await;
    recado(
        &[
            &["pub", "-L", url.as_str(), "-m", "over tls", "-q", "1"][..],
            &tls[..],
        ]
        .concat(),
    )
    .await
    .ok();
    assert_eq!(sub.finish().await.ok(), "secure/t over tls\n");
    // -h/-p with --cafile: TLS too.
    let run = recado(
        &[
            &[
                "pub",
                "-h",
                "localhost",
                "-p",
                port.as_str(),
                "-t",
                "x",
                "-m",
                "y",
            ][..],
            &tls[..],
        ]
        .concat(),
    )
    .await;
    assert_eq!(run.code, exit::OK, "{run:?}");
    // A certificate from another CA: the handshake fails, exit code 3.
    let other = path(d, "other.pem");
    let run = recado(&[
        "pub", "-L", &url, "-m", "x", "--cafile", &other, "--cert", &cert, "--key", &key,
    ])
    .await;
    assert_eq!(run.code, exit::UNREACHABLE, "{run:?}");
    assert!(run.stderr.contains("TLS handshake failed"), "{run:?}");
    // The server certificate is for localhost: another name fails, unless --insecure.
    let wrong = ["--tls-server-name", "elsewhere.example"];
    let run = recado(
        &[
            &["pub", "-L", url.as_str(), "-m", "x"][..],
            &tls[..],
            &wrong[..],
        ]
        .concat(),
    )
    .await;
    assert_eq!(run.code, exit::UNREACHABLE, "{run:?}");
    let run = recado(
        &[
            &["pub", "-L", url.as_str(), "-m", "x", "--insecure"][..],
            &tls[..],
            &wrong[..],
        ]
        .concat(),
    )
    .await;
    assert_eq!(run.code, exit::OK, "{run:?}");
    // Without a client certificate the listener refuses.
    let run = recado(&["pub", "-L", &url, "-m", "x", "--cafile", &ca]).await;
    assert_ne!(run.code, exit::OK, "{run:?}");
    // A plain client on the TLS port reads a TLS alert where CONNACK should be: the error
    // says it looks like TLS and how to connect.
    let run = recado(&["pub", "-p", port.as_str(), "-t", "x", "-m", "y"]).await;
    assert_eq!(run.code, exit::UNREACHABLE, "{run:?}");
    assert!(run.stderr.contains("it looks like TLS"), "{run:?}");
    // --capath: a directory of CA certificates; --tls-version.
    let capath = tempfile::tempdir().unwrap();
    std::fs::copy(d.join("ca.pem"), capath.path().join("ca.pem")).unwrap();
    let capath_s = capath.path().to_string_lossy().into_owned();
    for version in ["tlsv1.2", "tlsv1.3"] {
        let run = recado(&[
            "pub",
            "-L",
            &url,
            "-m",
            "x",
            "--capath",
            &capath_s,
            "--cert",
            &cert,
            "--key",
            &key,
            "--tls-version",
            version,
        ])
        .await;
        assert_eq!(run.code, exit::OK, "{version}: {run:?}");
    }
    let run = recado(
        &[
            &[
                "pub",
                "-L",
                url.as_str(),
                "-m",
                "x",
                "--tls-version",
                "tlsv1.1",
            ][..],
            &tls[..],
        ]
        .concat(),
    )
    .await;
    assert_eq!(run.code, exit::USAGE, "{run:?}");
    // wss://: WebSocket over TLS.
    let wss = format!("wss://localhost:{}/mqtt", b.listener_port(1));
    let sub = Background::subscribed(&[
        "sub", "-L", &wss, "-t", "w/t", "-C", "1", "-v", "--cafile", &ca,
    ])
    .await;
    recado(&[
        "pub", "-L", &wss, "-t", "w/t", "-m", "over wss", "--cafile", &ca, "-V", "5",
    ])
    .await
    .ok();
    assert_eq!(sub.finish().await.ok(), "w/t over wss\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn websocket_urls() {
    let mercurio = TestBroker::mercurio_with(support::common::websocket_config()).await;
    let mut targets = vec![(mercurio.name, mercurio.port())];
    let mosquitto = TestBroker::mosquitto(
        "websocket_urls",
        "listener {port} 127.0.0.1\nprotocol websockets",
    )
    .await;
    if let Some((m, ws_port)) = &mosquitto {
        targets.push((m.name, ws_port.to_string()));
    }
    for (name, port) in targets {
        for v in ["mqttv311", "mqttv5"] {
            let url = format!("ws://127.0.0.1:{port}/mqtt");
            let sub = Background::subscribed(&[
                "sub", "-L", &url, "-t", "ws/t", "-C", "1", "-v", "-V", v,
            ])
            .await;
            recado(&[
                "pub", "-L", &url, "-t", "ws/t", "-m", "over ws", "-V", v, "-q", "1",
            ])
            .await
            .ok();
            assert_eq!(sub.finish().await.ok(), "ws/t over ws\n", "{name} {v}");
            // --ws with -h and -p, and -A: the same from a given local address.
            let sub = Background::subscribed(&[
                "sub",
                "--ws",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-t",
                "ws/t",
                "-C",
                "1",
                "-v",
                "-V",
                v,
                "-A",
                "127.0.0.1",
            ])
            .await;
            recado(&[
                "pub",
                "--ws",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-t",
                "ws/t",
                "-m",
                "again",
                "-V",
                v,
            ])
            .await
            .ok();
            assert_eq!(sub.finish().await.ok(), "ws/t again\n", "{name} {v}");
        }
    }
    drop(mosquitto);
}
