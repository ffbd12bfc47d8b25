//! TLS listeners: handshakes (1.2 and 1.3) with certificates made in the test, client
//! certificates required and refused, the certificate's name as the user name, the handshake
//! bounded by connect_timeout (shared with CONNECT), revocation lists, reload, mosquitto_pub /
//! mosquitto_sub over TLS, bursts on connections that were idle, paho over WebSocket over TLS.
use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use mercurio::codec::{Connect, Packet, ProtocolVersion, QoS, ReasonCode};
use mercurio::config::{Config, ListenerConfig};
use mercurio::{Broker, BrokerHandle};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A certificate authority made for one test.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// A leaf certificate: (certificate, key).
    fn issue(&self, cn: &str, server: bool) -> (rcgen::Certificate, KeyPair) {
        let key = KeyPair::generate().unwrap();
        let names = if server {
            vec!["localhost".to_string(), "127.0.0.1".to_string()]
        } else {
            Vec::new()
        };
        let mut p = CertificateParams::new(names).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert, key)
    }
}

/// The files of one test: ca.pem, server.pem (chain), server.key, client.pem, client.key.
struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    client: (rcgen::Certificate, KeyPair),
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("Mercurio test CA");
        let client = ca.issue("device-7", false);
        let pki = Pki { dir, ca, client };
        pki.write_server(&pki.ca);
        std::fs::write(pki.path("ca.pem"), pki.ca.cert.pem()).unwrap();
        std::fs::write(pki.path("client.pem"), pki.client.0.pem()).unwrap();
        std::fs::write(pki.path("client.key"), pki.client.1.serialize_pem()).unwrap();
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes a server certificate issued by `ca`, with the CA in the chain.
    fn write_server(&self, ca: &Ca) {
        let (cert, key) = ca.issue("localhost", true);
        std::fs::write(self.path("server.pem"), cert.pem() + &ca.cert.pem()).unwrap();
        std::fs::write(self.path("server.key"), key.serialize_pem()).unwrap();
    }

    fn listener(&self, require_certificate: bool) -> ListenerConfig {
        ListenerConfig {
            port: 0,
            cert_file: Some(self.path("server.pem")),
            key_file: Some(self.path("server.key")),
            ca_file: require_certificate.then(|| self.path("ca.pem")),
            require_certificate,
            ..ListenerConfig::default()
        }
    }
}

fn config_with(listener: ListenerConfig) -> Config {
    let mut config = test_config();
    config.listeners = vec![listener];
    config
}

fn client_config(
    trusted: &rcgen::Certificate,
    client: Option<&(rcgen::Certificate, KeyPair)>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.der().clone()).unwrap();
    let b = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(versions)
    .unwrap()
    .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => b
            .with_client_auth_cert(
                vec![CertificateDer::from(cert.der().to_vec())],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .unwrap(),
        None => b.with_no_client_auth(),
    };
    Arc::new(config)
}

const ALL: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// An MQTT client over TLS: the tests' [`Client`] on the rustls client stream, with the TLS
/// session at hand ([`TlsClient::tls`]).
type TlsClient = ClientOver<TlsStream<TcpStream>>;

impl TlsClient {
    /// The TLS handshake on `tcp` (a PROXY header may have gone before it), nothing sent.
    async fn over(
        tcp: TcpStream,
        config: Arc<rustls::ClientConfig>,
        version: ProtocolVersion,
    ) -> std::io::Result<TlsClient> {
        let connector = tokio_rustls::TlsConnector::from(config);
        let stream = connector
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await?;
        Ok(ClientOver(Client::on(stream, version)))
    }

    async fn open(
        addr: SocketAddr,
        config: Arc<rustls::ClientConfig>,
    ) -> std::io::Result<TlsClient> {
        let tcp = TcpStream::connect(addr).await?;
        TlsClient::over(tcp, config, ProtocolVersion::V5).await
    }

    /// The TLS stream (the negotiated version, key updates).
    fn tls(&mut self) -> &mut TlsStream<TcpStream> {
        self.stream_mut()
    }

    async fn send(&mut self, p: Packet) -> Result<(), mercurio_codec::client::ClientError> {
        self.0.try_send(p).await
    }

    /// Opens, sends CONNECT, returns the CONNACK code; `None` when refused before it.
    async fn connect(
        addr: SocketAddr,
        config: Arc<rustls::ClientConfig>,
        connect: Connect,
    ) -> Option<(TlsClient, ReasonCode)> {
        let tcp = TcpStream::connect(addr).await.ok()?;
        let mut c = TlsClient::over(tcp, config, connect.protocol).await.ok()?;
        c.send(Packet::Connect(Box::new(connect))).await.ok()?;
        match c.recv().await? {
            Packet::ConnAck(a) => {
                let rc = a.reason_code;
                Some((c, rc))
            }
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    async fn subscribe(&mut self, filter: &str) -> ReasonCode {
        self.0.subscribe(filter, QoS::AtMostOnce).await
    }
}

async fn start_tls(config: Config) -> (BrokerHandle, SocketAddr) {
    start_with(config).await
}

#[tokio::test]
async fn tls12_and_tls13_handshakes() {
    let pki = Pki::new();
    let (broker, addr) = start_tls(config_with(pki.listener(false))).await;
    for versions in [
        &[&rustls::version::TLS13][..],
        &[&rustls::version::TLS12][..],
    ] {
        let cfg = client_config(&pki.ca.cert, None, versions);
        let (mut c, rc) = TlsClient::connect(addr, cfg, connect_packet(ProtocolVersion::V5, "tls"))
            .await
            .expect("CONNACK over TLS");
        assert_eq!(rc, ReasonCode::SUCCESS);
        let negotiated = c.tls().get_ref().1.protocol_version().unwrap();
        assert_eq!(negotiated, versions[0].version);
        assert_eq!(c.subscribe("tls/#").await, ReasonCode::GRANTED_QOS_0);
        broker
            .publish("tls/x", "over tls", QoS::AtMostOnce, false)
            .await
            .unwrap();
        match c.recv().await {
            Some(Packet::Publish(p)) => assert_eq!(&p.payload[..], b"over tls"),
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }
    // A client that does not trust the server's CA gives up.
    let other = Ca::new("someone else");
    assert!(TlsClient::open(addr, client_config(&other.cert, None, ALL))
        .await
        .is_err());
    // Plain MQTT on a TLS port gets nothing.
    let (mut plain, _) = (Client::open(addr, ProtocolVersion::V5).await, ());
    plain
        .send(Packet::Connect(Box::new(connect_packet(
            ProtocolVersion::V5,
            "plain",
        ))))
        .await;
    let mut junk = [0u8; 64];
    let n = tokio::time::timeout(DEADLINE, plain.stream_mut().read(&mut junk))
        .await
        .unwrap()
        .unwrap_or(0);
    assert!(
        n == 0 || junk[0] == 0x15,
        "a TLS alert or a close, not MQTT: {:?}",
        &junk[..n]
    );
    broker.shutdown().await;
}

#[tokio::test]
async fn client_certificate_required_and_refused() {
    let pki = Pki::new();
    let (broker, addr) = start_tls(config_with(pki.listener(true))).await;
    let connect = || connect_packet(ProtocolVersion::V311, "dev");
    // With a certificate from the CA: in.
    let (_c, rc) = TlsClient::connect(
        addr,
        client_config(&pki.ca.cert, Some(&pki.client), ALL),
        connect(),
    )
    .await
    .expect("accepted");
    assert_eq!(rc, ReasonCode::SUCCESS);
    // Without a certificate, or with one from another CA: refused in the handshake.
    for (name, client) in [
        ("no certificate", None),
        (
            "another CA",
            Some(Ca::new("rogue").issue("device-7", false)),
        ),
    ] {
        for versions in [
            &[&rustls::version::TLS13][..],
            &[&rustls::version::TLS12][..],
        ] {
            let refused = TlsClient::connect(
                addr,
                client_config(&pki.ca.cert, client.as_ref(), versions),
                connect(),
            )
            .await;
            assert!(refused.is_none(), "{name} must be refused");
        }
    }
    broker.shutdown().await;
}

#[tokio::test]
async fn certificate_name_as_user_name() {
    let pki = Pki::new();
    let mut listener = pki.listener(true);
    listener.use_identity_as_username = true;
    let mut config = config_with(listener);
    config.auth.allow_anonymous = Some(false);
    let acl = pki.path("acl");
    std::fs::write(&acl, "user device-7\ntopic readwrite devices/device-7/#\n").unwrap();
    config.auth.acl_file = Some(acl);
    let (broker, addr) = start_tls(config).await;
    let tls = client_config(&pki.ca.cert, Some(&pki.client), ALL);
    // No user name in CONNECT (or another one): the certificate's name counts.
    for username in [None, Some("admin")] {
        let connect = connect_as(ProtocolVersion::V5, "d7", username, Some("ignored"));
        let (mut c, rc) = TlsClient::connect(addr, Arc::clone(&tls), connect)
            .await
            .unwrap();
        assert_eq!(rc, ReasonCode::SUCCESS);
        assert_eq!(
            c.subscribe("devices/device-7/#").await,
            ReasonCode::GRANTED_QOS_0
        );
        assert_eq!(
            c.subscribe("devices/device-8/#").await,
            ReasonCode::NOT_AUTHORIZED
        );
    }
    broker.shutdown().await;
}

/// A session belongs to the client certificate that made it, also when the certificate's name
/// is not the user name: a client presenting another certificate (of the same CA) with its
/// client identifier gets a new session, never the first one's subscriptions or messages
/// (MQTT 5.0 section 5.4.2: the Server should authorize a session's use).
#[tokio::test]
async fn another_client_certificate_gets_a_fresh_session() {
    let pki = Pki::new();
    let (broker, addr) = start_tls(config_with(pki.listener(true))).await;
    let device_7 = client_config(&pki.ca.cert, Some(&pki.client), ALL);
    let device_8 = client_config(&pki.ca.cert, Some(&pki.ca.issue("device-8", false)), ALL);
    let connect = || persistent(ProtocolVersion::V5, "shared-id", 300);
    let (mut c, rc) = TlsClient::connect(addr, Arc::clone(&device_7), connect())
        .await
        .unwrap();
    assert_eq!(rc, ReasonCode::SUCCESS);
    assert_eq!(c.subscribe("fleet/#").await, ReasonCode::GRANTED_QOS_0);
    c.send(Packet::Disconnect(Default::default()))
        .await
        .unwrap();
    assert!(c.recv().await.is_none(), "closed after DISCONNECT");

    // The same certificate resumes its session.
    let resumed = async |config: &Arc<rustls::ClientConfig>| {
        let mut c = TlsClient::open(addr, Arc::clone(config)).await.unwrap();
        c.send(Packet::Connect(Box::new(connect()))).await.unwrap();
        let present = match c.recv().await {
            Some(Packet::ConnAck(a)) => {
                assert_eq!(a.reason_code, ReasonCode::SUCCESS);
                a.session_present
            }
            other => panic!("expected CONNACK, got {other:?}"),
        };
        c.send(Packet::Disconnect(Default::default()))
            .await
            .unwrap();
        assert!(c.recv().await.is_none(), "closed after DISCONNECT");
        present
    };
    assert!(
        resumed(&device_7).await,
        "its own certificate: session present"
    );
    // Another certificate, same user name (none): a new session.
    assert!(
        !resumed(&device_8).await,
        "another certificate: no session present"
    );
    // And the first certificate's session is gone with it.
    assert!(!resumed(&device_7).await, "the session was replaced");
    broker.shutdown().await;
}

#[tokio::test]
async fn stalled_handshake_is_bounded_by_connect_timeout() {
    let pki = Pki::new();
    let mut config = config_with(pki.listener(false));
    config.server.connect_timeout = 1;
    let (broker, addr) = start_tls(config).await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let started = std::time::Instant::now();
    let mut b = [0u8; 16];
    // Nothing sent: the broker closes after about a second.
    let n = tokio::time::timeout(DEADLINE, tcp.read(&mut b))
        .await
        .expect("closed in time");
    assert!(matches!(n, Ok(0) | Err(_)));
    assert!(started.elapsed() >= Duration::from_millis(900));
    broker.shutdown().await;
}

#[tokio::test]
async fn unusable_files_fail_start_with_path_and_cause() {
    let pki = Pki::new();
    let mut l = pki.listener(true);
    l.cert_file = Some(pki.path("missing.pem"));
    let e = Broker::builder(config_with(l))
        .start()
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with(&format!(
            "{}: cannot read: ",
            pki.path("missing.pem").display()
        )),
        "{e}"
    );

    std::fs::write(pki.path("empty.pem"), "not a certificate\n").unwrap();
    let mut l = pki.listener(true);
    l.ca_file = Some(pki.path("empty.pem"));
    let e = Broker::builder(config_with(l))
        .start()
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with(&format!("{}: ", pki.path("empty.pem").display())),
        "{e}"
    );

    let mut l = pki.listener(false);
    l.key_file = Some(pki.path("client.key")); // not the certificate's key
    let e = Broker::builder(config_with(l))
        .start()
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with(&format!(
            "{}: does not fit",
            pki.path("client.key").display()
        )),
        "{e}"
    );

    let mut l = pki.listener(false);
    l.key_file = Some(pki.path("ca.pem")); // no key at all
    let e = Broker::builder(config_with(l))
        .start()
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with(&format!("{}: ", pki.path("ca.pem").display())),
        "{e}"
    );
}

#[tokio::test]
async fn reload_swaps_certificates_and_keeps_clients() {
    let pki = Pki::new();
    let (broker, addr) = start_tls(config_with(pki.listener(false))).await;
    let old = client_config(&pki.ca.cert, None, ALL);
    let (mut kept, rc) = TlsClient::connect(
        addr,
        Arc::clone(&old),
        connect_packet(ProtocolVersion::V5, "kept"),
    )
    .await
    .unwrap();
    assert_eq!(rc, ReasonCode::SUCCESS);
    assert_eq!(kept.subscribe("r/#").await, ReasonCode::GRANTED_QOS_0);

    let ca2 = Ca::new("second CA");
    pki.write_server(&ca2);
    broker.reload().expect("reload");
    // New handshakes use the new certificate.
    assert!(TlsClient::open(addr, Arc::clone(&old)).await.is_err());
    let (_c, rc) = TlsClient::connect(
        addr,
        client_config(&ca2.cert, None, ALL),
        connect_packet(ProtocolVersion::V5, "new"),
    )
    .await
    .unwrap();
    assert_eq!(rc, ReasonCode::SUCCESS);
    // The connected client is still there.
    broker
        .publish("r/1", "still here", QoS::AtMostOnce, false)
        .await
        .unwrap();
    match kept.recv().await {
        Some(Packet::Publish(p)) => assert_eq!(&p.payload[..], b"still here"),
        other => panic!("expected PUBLISH, got {other:?}"),
    }
    // A broken key on reload: the error names it, the current certificate stays.
    std::fs::write(pki.path("server.key"), "garbage").unwrap();
    let errors = broker.reload().unwrap_err();
    assert!(
        errors[0]
            .to_string()
            .starts_with(&pki.path("server.key").display().to_string()),
        "{}",
        errors[0]
    );
    assert!(TlsClient::open(addr, client_config(&ca2.cert, None, ALL))
        .await
        .is_ok());
    broker.shutdown().await;
}

fn mosquitto(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args).stdin(Stdio::null());
    c
}

#[tokio::test]
async fn mosquitto_clients_over_tls() {
    const TEST: &str = "mosquitto_clients_over_tls";
    if !have_program(TEST, "mosquitto_pub") || !have_program(TEST, "mosquitto_sub") {
        return;
    }
    let pki = Pki::new();
    let mut listener = pki.listener(false);
    listener.ca_file = Some(pki.path("ca.pem")); // client certificates optional
    let (broker, addr) = start_tls(config_with(listener)).await;
    let port = addr.port().to_string();
    let ca = pki.path("ca.pem");
    let cert = pki.path("client.pem");
    let key = pki.path("client.key");
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let (ca, cert, key) = (p(&ca), p(&cert), p(&key));
    for (n, with_cert) in [(1, false), (2, true)] {
        let topic = format!("mosq/{n}");
        let id = format!("mosq-sub-{n}");
        let mut args = vec![
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "--cafile",
            &ca,
            "-t",
            &topic,
            "-C",
            "1",
            "-W",
            "10",
            "-i",
            &id,
            "-V",
            "mqttv311",
        ];
        if with_cert {
            args.extend(["--cert", &cert, "--key", &key]);
        }
        let sub = mosquitto("mosquitto_sub", &args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_until("mosquitto_sub subscribed", || {
            broker
                .sessions()
                .iter()
                .any(|s| s.client_id == id && s.subscriptions == 1)
        })
        .await;
        let mut args = vec![
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "--cafile",
            &ca,
            "-t",
            &topic,
            "-m",
            "hello over tls",
            "-q",
            "1",
            "-V",
            "5",
        ];
        if with_cert {
            args.extend(["--cert", &cert, "--key", &key]);
        }
        let mut publisher = mosquitto("mosquitto_pub", &args);
        // Not on the runtime's thread: the broker runs there.
        let out = tokio::task::spawn_blocking(move || publisher.output())
            .await
            .unwrap()
            .unwrap();
        assert!(
            out.status.success(),
            "mosquitto_pub: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = tokio::task::spawn_blocking(move || sub.wait_with_output())
            .await
            .unwrap()
            .unwrap();
        assert!(
            out.status.success(),
            "mosquitto_sub: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "hello over tls"
        );
    }
    broker.shutdown().await;
}

/// TLS 1.3 key updates after the handshake: a client that refreshes its keys (asking the
/// broker to update its own) goes on exchanging packets both ways; the broker's answering key
/// update reaches the client before anything encrypted with its new keys.
#[tokio::test]
async fn tls13_key_updates_keep_the_connection() {
    let pki = Pki::new();
    let (broker, addr) = start_tls(config_with(pki.listener(false))).await;
    let cfg = client_config(&pki.ca.cert, None, &[&rustls::version::TLS13]);
    let (mut c, rc) = TlsClient::connect(addr, cfg, connect_packet(ProtocolVersion::V5, "ku"))
        .await
        .expect("CONNACK over TLS");
    assert_eq!(rc, ReasonCode::SUCCESS);
    assert_eq!(c.subscribe("ku/#").await, ReasonCode::GRANTED_QOS_0);
    for i in 0..3 {
        c.tls().get_mut().1.refresh_traffic_keys().unwrap();
        c.send(Packet::PingReq).await.unwrap();
        assert!(
            matches!(c.recv().await, Some(Packet::PingResp)),
            "PINGRESP after key update {i}"
        );
        broker
            .publish("ku/x", format!("after update {i}"), QoS::AtMostOnce, false)
            .await
            .unwrap();
        match c.recv().await {
            Some(Packet::Publish(p)) => assert_eq!(p.payload, format!("after update {i}")),
            other => panic!("expected PUBLISH, got {other:?}"),
        }
    }
    broker.shutdown().await;
}

/// Forwards each connection made to the address it returns to `to`, both ways, in pieces of at
/// most `piece` bytes written one at a time: the broker's reads end anywhere in a TLS record.
async fn chopping_relay(to: SocketAddr, piece: usize) -> SocketAddr {
    use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
    async fn chop(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, piece: usize) {
        let mut buf = vec![0u8; piece];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
            }
        }
        let _ = to.shutdown().await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((a, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(b) = TcpStream::connect(to).await else {
                    return;
                };
                let _ = (a.set_nodelay(true), b.set_nodelay(true));
                let ((ar, aw), (br, bw)) = (a.into_split(), b.into_split());
                tokio::join!(chop(ar, bw, piece), chop(br, aw, piece));
            });
        }
    });
    addr
}

/// A TLS connection holds no read buffer while idle: one is taken when the socket becomes
/// readable, and released, or cut down to the partial record it holds, when the socket has
/// nothing more. Connections that have been idle still take and deliver bursts larger than
/// one read (16 KiB) and than one write (64 KiB), in both directions, TLS 1.2 and 1.3, with
/// reads that end mid-record (through a relay that forwards 1,000 bytes at a time):
/// mosquitto_pub -l, connected and then idle until lines arrive on its standard input, gets
/// 100 lines at once (one of 100,000 bytes); mosquitto_sub, idle since it subscribed,
/// receives all of them, whole and in order.
#[tokio::test]
async fn idle_tls_connections_take_bursts() {
    const TEST: &str = "idle_tls_connections_take_bursts";
    if !have_program(TEST, "mosquitto_pub") || !have_program(TEST, "mosquitto_sub") {
        return;
    }
    let pki = Pki::new();
    let (broker, addr) = start_tls(config_with(pki.listener(false))).await;
    let port = chopping_relay(addr, 1_000).await.port().to_string();
    let ca = pki.path("ca.pem").to_str().unwrap().to_string();
    let lines: Vec<String> = (0..100)
        .map(|i| {
            let len = if i == 50 { 100_000 } else { 2_000 + i * 37 };
            format!("{i:03}:{}", "x".repeat(len))
        })
        .collect();
    for version in ["tlsv1.2", "tlsv1.3"] {
        let topic = format!("burst/{version}");
        let (sub_id, pub_id) = (
            format!("burst-sub-{version}"),
            format!("burst-pub-{version}"),
        );
        let common = |id: &str| -> Vec<String> {
            [
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "--cafile",
                &ca,
                "--tls-version",
                version,
                "-t",
                &topic,
                "-q",
                "1",
                "-i",
                id,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect()
        };
        let mut sub_args = common(&sub_id);
        sub_args.extend(["-C", "100", "-W", "30"].map(String::from));
        let sub = Command::new("mosquitto_sub")
            .args(&sub_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_until("mosquitto_sub subscribed", || {
            broker
                .sessions()
                .iter()
                .any(|s| s.client_id == sub_id && s.subscriptions == 1)
        })
        .await;
        let mut pub_args = common(&pub_id);
        pub_args.push("-l".into());
        let mut publisher = Command::new("mosquitto_pub")
            .args(&pub_args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_until("mosquitto_pub connected", || {
            broker
                .sessions()
                .iter()
                .any(|s| s.client_id == pub_id && s.connected)
        })
        .await;
        // Both connections are idle now; the lines go out in one go.
        let mut stdin = publisher.stdin.take().unwrap();
        let input = lines.join("\n") + "\n";
        let out = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            stdin.write_all(input.as_bytes()).unwrap();
            drop(stdin);
            let p = publisher.wait_with_output().unwrap();
            (p, sub.wait_with_output().unwrap())
        })
        .await
        .unwrap();
        let (p, s) = out;
        assert!(
            p.status.success(),
            "mosquitto_pub {version}: {}",
            String::from_utf8_lossy(&p.stderr)
        );
        assert!(
            s.status.success(),
            "mosquitto_sub {version}: {}",
            String::from_utf8_lossy(&s.stderr)
        );
        let received: Vec<&str> = std::str::from_utf8(&s.stdout).unwrap().lines().collect();
        assert_eq!(received.len(), lines.len(), "{version}: messages received");
        for (got, sent) in received.iter().zip(&lines) {
            assert!(*got == sent, "{version}: message {} differs", &sent[..3]);
        }
    }
    broker.shutdown().await;
}

const PAHO_WSS: &str = r#"
import sys, threading
import paho.mqtt.client as mqtt

port, ca = int(sys.argv[1]), sys.argv[2]
payloads = [bytes([65 + i]) * n for i, n in enumerate([10, 40000, 150000])]
got = threading.Event()
received = []

c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paho-wss",
                protocol=mqtt.MQTTv5, transport="websockets")
c.ws_set_options(path="/mqtt")
c.tls_set(ca_certs=ca)

def on_connect(client, userdata, flags, reason_code, properties):
    client.subscribe("wss/echo", qos=1)

def on_subscribe(client, userdata, mid, reason_codes, properties):
    for p in payloads:
        client.publish("wss/echo", p, qos=1)

def on_message(client, userdata, msg):
    received.append(msg.payload)
    if len(received) == len(payloads):
        got.set()

c.on_connect, c.on_subscribe, c.on_message = on_connect, on_subscribe, on_message
c.connect("127.0.0.1", port, keepalive=30)
c.loop_start()
ok = got.wait(20)
c.disconnect()
c.loop_stop()
print("OK" if ok and received == payloads else "FAILED %d %s" % (len(received), [len(r) for r in received]))
"#;

/// MQTT over WebSocket over TLS (paho-mqtt, `wss`): a subscriber's own messages, up to
/// 150,000 bytes (several TLS records and WebSocket frames), come back whole and in order.
#[tokio::test]
async fn paho_mqtt_over_websocket_over_tls() {
    let Some(python) = python_with("paho_mqtt_over_websocket_over_tls", &["paho.mqtt.client"])
    else {
        return;
    };
    let pki = Pki::new();
    let mut listener = pki.listener(false);
    listener.protocol = mercurio::config::ListenerProtocol::Websocket;
    let (broker, addr) = start_tls(config_with(listener)).await;
    let out = run_python(
        python,
        PAHO_WSS,
        &[
            addr.port().to_string(),
            pki.path("ca.pem").to_str().unwrap().to_string(),
        ],
        b"",
    )
    .await;
    assert_eq!(out.trim(), "OK");
    broker.shutdown().await;
}

/// `crl_file`: a client certificate its CA revoked is refused in the handshake (TLS 1.2 and
/// 1.3); one the list does not name still connects; a certificate of a CA without a CRL in the
/// file is refused too (its revocation status is unknown).
#[tokio::test]
async fn revoked_client_certificate_is_refused() {
    let pki = Pki::new();
    let issue = |ca: &Ca, cn: &str, serial: u64| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        p.serial_number = Some(rcgen::SerialNumber::from(serial));
        (p.signed_by(&key, &ca.cert, &ca.key).unwrap(), key)
    };
    let good = issue(&pki.ca, "good", 1001);
    let revoked = issue(&pki.ca, "revoked", 1002);
    let crl = rcgen::CertificateRevocationListParams {
        this_update: rcgen::date_time_ymd(2024, 1, 1),
        next_update: rcgen::date_time_ymd(2099, 1, 1),
        crl_number: rcgen::SerialNumber::from(1u64),
        issuing_distribution_point: None,
        revoked_certs: vec![rcgen::RevokedCertParams {
            serial_number: rcgen::SerialNumber::from(1002u64),
            revocation_time: rcgen::date_time_ymd(2024, 6, 1),
            reason_code: Some(rcgen::RevocationReason::KeyCompromise),
            invalidity_date: None,
        }],
        key_identifier_method: rcgen::KeyIdMethod::Sha256,
    }
    .signed_by(&pki.ca.cert, &pki.ca.key)
    .unwrap();
    std::fs::write(pki.path("crl.pem"), crl.pem().unwrap()).unwrap();
    let mut listener = pki.listener(true);
    listener.crl_file = Some(pki.path("crl.pem"));
    let (broker, addr) = start_tls(config_with(listener)).await;
    for versions in [
        &[&rustls::version::TLS13][..],
        &[&rustls::version::TLS12][..],
    ] {
        let (_c, rc) = TlsClient::connect(
            addr,
            client_config(&pki.ca.cert, Some(&good), versions),
            connect_packet(ProtocolVersion::V311, "good"),
        )
        .await
        .expect("a certificate the CRL does not name is accepted");
        assert_eq!(rc, ReasonCode::SUCCESS);
        let refused = TlsClient::connect(
            addr,
            client_config(&pki.ca.cert, Some(&revoked), versions),
            connect_packet(ProtocolVersion::V311, "revoked"),
        )
        .await;
        assert!(refused.is_none(), "a revoked certificate must be refused");
    }
    broker.shutdown().await;
}

/// A crl_file without ca_file is a configuration error naming the key; a file that holds no
/// CRL fails the start naming the file.
#[tokio::test]
async fn unusable_crl_file_fails_start() {
    let pki = Pki::new();
    let mut listener = pki.listener(false);
    listener.crl_file = Some(pki.path("ca.pem"));
    let e = config_with(listener).validate().expect_err("refused");
    assert_eq!(e.key, "listeners[0].crl_file", "{e}");
    let mut listener = pki.listener(true);
    listener.crl_file = Some(pki.path("ca.pem"));
    let e = Broker::builder(config_with(listener))
        .start()
        .await
        .err()
        .expect("refused");
    assert!(e.to_string().contains("ca.pem"), "{e}");
}

/// The TLS handshake and CONNECT share one connect_timeout, counted from the accept: a
/// client that takes most of it before its handshake is closed when it runs out, not given a
/// fresh connect_timeout for CONNECT.
#[tokio::test]
async fn handshake_and_connect_share_connect_timeout() {
    let pki = Pki::new();
    let mut config = config_with(pki.listener(false));
    config.server.connect_timeout = 2;
    let (broker, addr) = start_tls(config).await;
    let tcp = TcpStream::connect(addr).await.unwrap();
    let started = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let connector = tokio_rustls::TlsConnector::from(client_config(&pki.ca.cert, None, ALL));
    let mut stream = connector
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .expect("handshake within connect_timeout");
    // No CONNECT: closed when the 2 s since the accept are over (not 2 s after the handshake).
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(DEADLINE, stream.read(&mut b))
        .await
        .expect("closed in time");
    assert!(matches!(n, Ok(0) | Err(_)));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_millis(3000),
        "closed after {took:?}"
    );
    broker.shutdown().await;
}

/// TLS terminated at a load balancer: HAProxy verifies the client certificate and sends its
/// common name in the PROXY protocol version 2 header (`send-proxy-v2-ssl-cn`,
/// `PP2_SUBTYPE_SSL_CN`); a plain MQTT listener with `proxy_protocol = "v2"` and
/// `use_identity_as_username` takes it as the user name, as if it had verified the
/// certificate itself (the ACL's `user device-7` lines apply), and the client's address is
/// the one HAProxy saw.
#[tokio::test]
async fn certificate_name_from_a_balancer_that_terminated_tls() {
    let Some(haproxy) = ["/usr/sbin/haproxy", "haproxy"].into_iter().find(|p| {
        Command::new(p)
            .arg("-v")
            .output()
            .is_ok_and(|o| o.status.success())
    }) else {
        mercurio_testkit::prerequisite(
            "certificate_name_from_a_balancer_that_terminated_tls",
            Err("haproxy is not installed".into()),
        );
        return;
    };
    let pki = Pki::new();
    let listener = ListenerConfig {
        port: 0,
        proxy_protocol: Some(mercurio::config::ProxyProtocol::V2),
        use_identity_as_username: true,
        ..ListenerConfig::default()
    };
    let mut config = config_with(listener);
    config.auth.allow_anonymous = Some(false);
    let acl = pki.path("acl");
    std::fs::write(&acl, "user device-7\ntopic readwrite devices/device-7/#\n").unwrap();
    config.auth.acl_file = Some(acl);
    let broker = Broker::builder(config).start().await.unwrap();
    let mut events = broker.events();
    let addr = broker.local_addrs()[0];
    // HAProxy: TLS with the broker's certificate, client certificates verified against the CA.
    let crt = pki.path("haproxy.pem");
    std::fs::write(
        &crt,
        std::fs::read_to_string(pki.path("server.pem")).unwrap()
            + &std::fs::read_to_string(pki.path("server.key")).unwrap(),
    )
    .unwrap();
    let front = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = pki.path("haproxy.cfg");
    std::fs::write(
        &cfg,
        format!(
            "defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n\n\
             listen mqtts\n  bind {front} ssl crt {} ca-file {} verify required\n  \
             server broker {addr} send-proxy-v2 send-proxy-v2-ssl-cn\n",
            crt.display(),
            pki.path("ca.pem").display()
        ),
    )
    .unwrap();
    let mut hap = mercurio_testkit::Proc::spawn_merged(
        "haproxy",
        Command::new(haproxy).arg("-db").arg("-f").arg(&cfg),
    );
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while TcpStream::connect(front).await.is_err() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "haproxy does not listen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tls = client_config(&pki.ca.cert, Some(&pki.client), ALL);
    let connect = connect_as(ProtocolVersion::V5, "d7", None, None);
    let (mut c, rc) = TlsClient::connect(front, Arc::clone(&tls), connect)
        .await
        .unwrap();
    assert_eq!(rc, ReasonCode::SUCCESS);
    assert_eq!(
        c.subscribe("devices/device-7/#").await,
        ReasonCode::GRANTED_QOS_0
    );
    assert_eq!(
        c.subscribe("devices/device-8/#").await,
        ReasonCode::NOT_AUTHORIZED
    );
    loop {
        let e = tokio::time::timeout(DEADLINE, events.recv())
            .await
            .expect("an event")
            .expect("events open");
        if let mercurio::Event::Connected {
            client_id,
            username,
            peer,
            ..
        } = e
        {
            if client_id == "d7" {
                assert_eq!(username.as_deref(), Some("device-7"));
                assert_eq!(peer.ip(), std::net::IpAddr::from([127, 0, 0, 1]));
                assert_ne!(peer, addr);
                break;
            }
        }
    }
    // Straight to the listener, without the balancer: no header, closed without CONNACK.
    let mut direct = TcpStream::connect(addr).await.unwrap();
    direct
        .write_all(b"\x10\x12\x00\x04MQTT\x04\x02\x00\x3c\x00\x06direct")
        .await
        .unwrap();
    let mut buf = [0u8; 8];
    let n = tokio::time::timeout(DEADLINE, direct.read(&mut buf))
        .await
        .expect("closed in time")
        .unwrap_or(0);
    assert_eq!(n, 0, "no CONNACK: {:?}", &buf[..n]);
    broker.shutdown().await;
    hap.signal(15); // SIGTERM
    let _ = hap.wait_exit_within(DEADLINE);
}

/// A TLS listener with `proxy_protocol = "v1"`: the header comes on the TCP connection before
/// the TLS handshake, and its address is the client's.
#[tokio::test]
async fn proxy_header_before_the_tls_handshake() {
    let pki = Pki::new();
    let mut listener = pki.listener(false);
    listener.proxy_protocol = Some(mercurio::config::ProxyProtocol::V1);
    let broker = Broker::builder(config_with(listener))
        .start()
        .await
        .unwrap();
    let mut events = broker.events();
    let addr = broker.local_addrs()[0];
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"PROXY TCP4 198.51.100.9 127.0.0.1 4711 8883\r\n")
        .await
        .unwrap();
    let mut c = TlsClient::over(
        tcp,
        client_config(&pki.ca.cert, None, ALL),
        ProtocolVersion::V5,
    )
    .await
    .expect("TLS after the header");
    let peer = c.connect_and_wait_connected(&mut events, "behind").await;
    assert_eq!(peer, "198.51.100.9:4711".parse::<SocketAddr>().unwrap());
    broker.shutdown().await;
}
