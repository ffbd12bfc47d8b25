//! The bridge's connection to its remote broker, on the shared MQTT client's [`Connection`]
//! (crate `mercurio-codec`): TCP or TLS (rustls, the CA of `cafile`, the client certificate
//! of `certfile` and `keyfile`), CONNECT with the bridge's will, CONNACK, then packets read
//! and written whole. Acknowledgements and packet identifiers stay with the bridge: they
//! live in its session, in storage.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
#[cfg(test)]
use bytes::BytesMut;
use mercurio_codec::client::{ClientError, ConnectOptions, Connection};
use rustls::pki_types::ServerName;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::PrivateKeyDer;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::auth::FileError;
use crate::codec::{
    self, ConnAck, Connect, LastWill, Packet, Properties, ProtocolVersion, QoS, ReasonCode,
};
use crate::config::{parse_address, BridgeConfig, BridgeProtocol};

/// A byte stream to the remote: TCP, or TLS over TCP.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The TLS client side of a bridge, loaded from its files.
pub(crate) fn tls_connector(cfg: &BridgeConfig) -> Result<Option<TlsConnector>, FileError> {
    let Some(cafile) = &cfg.cafile else {
        return Ok(None);
    };
    let mut roots = rustls::RootCertStore::empty();
    let certs = crate::tls::load_certs(cafile)?;
    for c in &certs {
        roots
            .add(c.clone())
            .map_err(|e| FileError::new(cafile, format!("bad CA certificate: {e}")))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::clone(&provider),
    )
    .build()
    .map_err(|e| FileError::new(cafile, format!("TLS: {e}")))?;
    let verifier = Arc::new(PinningVerifier {
        webpki,
        pinned: certs,
        bridge: cfg.name.clone(),
    });
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| FileError::new(cafile, format!("TLS: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match (&cfg.certfile, &cfg.keyfile) {
        (Some(cert), Some(key)) => {
            let certs = crate::tls::load_certs(cert)?;
            std::fs::metadata(key).map_err(|e| FileError::io(key, &e))?;
            let k = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| FileError::new(key, format!("no usable PEM private key: {e}")))?;
            builder.with_client_auth_cert(certs, k).map_err(|e| {
                FileError::new(
                    key,
                    format!("does not fit the certificate of {}: {e}", cert.display()),
                )
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Some(TlsConnector::from(Arc::new(config))))
}

/// The check of the remote's certificate: the CA certificates of `cafile` (rustls' WebPKI
/// verifier), or, as mosquitto accepts, the remote's own self-signed certificate held in
/// `cafile`. rustls refuses that one as its own issuer (a CA certificate used as an end
/// entity, `CaUsedAsEndEntity`, or a chain to nothing else); it is accepted when the certificate
/// presented is byte for byte (DER) one of `cafile`'s (pinned), within its validity dates and
/// carrying the server name, and the handshake signed with its key (checked as for any
/// certificate).
#[derive(Debug)]
struct PinningVerifier {
    webpki: Arc<rustls::client::WebPkiServerVerifier>,
    /// Every certificate of `cafile`.
    pinned: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// The bridge's name, for the log.
    bridge: String,
}

impl rustls::client::danger::ServerCertVerifier for PinningVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let refused = match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        if !self
            .pinned
            .iter()
            .any(|p| p.as_ref() == end_entity.as_ref())
        {
            return Err(refused);
        }
        check_validity(end_entity, now)?;
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_name(&parsed, server_name)?;
        tracing::info!(bridge = %self.bridge, "remote certificate pinned: the cafile holds the remote's own self-signed certificate");
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// A pinned certificate's validity dates against `now` (RFC 5280 section 4.1.2.5).
fn check_validity(
    cert: &rustls::pki_types::CertificateDer<'_>,
    now: rustls::pki_types::UnixTime,
) -> Result<(), rustls::Error> {
    use x509_cert::der::Decode;
    let bad = || rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding);
    let parsed = x509_cert::Certificate::from_der(cert.as_ref()).map_err(|_| bad())?;
    let validity = &parsed.tbs_certificate.validity;
    let secs = |t: &x509_cert::time::Time| t.to_unix_duration().as_secs();
    let now = now.as_secs();
    if now < secs(&validity.not_before) {
        return Err(rustls::Error::InvalidCertificate(
            rustls::CertificateError::NotValidYet,
        ));
    }
    if now > secs(&validity.not_after) {
        return Err(rustls::Error::InvalidCertificate(
            rustls::CertificateError::Expired,
        ));
    }
    Ok(())
}

/// Why a connection attempt failed.
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// No connection: address, network or TLS failure.
    Io(String),
    /// Connected, then closed or unanswered before CONNACK.
    Closed(String),
    /// CONNACK with a failure code: a 5.0 reason code, or (3.1.1) a return code 1 to 5 as
    /// it came, which the codec keeps in a [`ReasonCode`].
    Refused(ReasonCode, ProtocolVersion),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Io(e) | ConnectError::Closed(e) => f.write_str(e),
            ConnectError::Refused(rc, v) if v.is_v5() => {
                write!(f, "refused by the remote: CONNACK {rc:?}")
            }
            ConnectError::Refused(rc, _) => write!(
                f,
                "refused by the remote: CONNACK return code {} ({})",
                rc.0,
                ReasonCode::v3_connack_name(rc.0)
            ),
        }
    }
}

/// A connected remote broker: a [`Connection`] of the shared client over TCP or TLS.
pub(crate) struct Remote {
    conn: Connection<Box<dyn Io>>,
    /// Set when a packet over the bridge's largest incoming packet ended the connection.
    pub too_large: bool,
    pub version: ProtocolVersion,
    pub connack: ConnAck,
}

impl Remote {
    /// Opens the connection to `address` and goes through CONNECT / CONNACK within `timeout`.
    /// `private` sets the protocol level's 0x80 bit (mosquitto's bridge convention).
    /// `max_incoming` is the largest packet accepted from the remote, in bytes (told to an
    /// MQTT 5 remote as Maximum Packet Size).
    pub(crate) async fn connect(
        cfg: &BridgeConfig,
        tls: Option<&TlsConnector>,
        address: &str,
        private: bool,
        timeout: Duration,
        max_incoming: u32,
    ) -> Result<Remote, ConnectError> {
        let attempt = Self::connect_inner(cfg, tls, address, private, timeout, max_incoming);
        match tokio::time::timeout(timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(ConnectError::Closed(format!(
                "no CONNACK within {} s",
                timeout.as_secs()
            ))),
        }
    }

    async fn connect_inner(
        cfg: &BridgeConfig,
        tls: Option<&TlsConnector>,
        address: &str,
        private: bool,
        timeout: Duration,
        max_incoming: u32,
    ) -> Result<Remote, ConnectError> {
        let default_port = if tls.is_some() { 8883 } else { 1883 };
        let (host, port) = parse_address(address, default_port).map_err(ConnectError::Io)?;
        let tcp = TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| ConnectError::Io(format!("connect: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let io: Box<dyn Io> = match tls {
            Some(connector) => {
                let name = cfg.tls_server_name.clone().unwrap_or(host.clone());
                let name = ServerName::try_from(name.clone())
                    .map_err(|e| ConnectError::Io(format!("TLS server name {name:?}: {e}")))?;
                let stream = connector
                    .connect(name, tcp)
                    .await
                    .map_err(|e| ConnectError::Io(format!("TLS: {e}")))?;
                Box::new(stream)
            }
            None => Box::new(tcp),
        };
        let version = match cfg.protocol_version {
            BridgeProtocol::Mqttv5 => ProtocolVersion::V5,
            BridgeProtocol::Mqttv311 => ProtocolVersion::V311,
        };
        let mut conn = Connection::new(io, version, max_incoming);
        let options = ConnectOptions {
            connack_timeout: timeout,
            bridge_bit: private,
        };
        let connack = match conn
            .connect(&connect_packet(cfg, version, max_incoming), &options)
            .await
        {
            Ok(ack) => ack.clone(),
            Err(ClientError::Refused { code, version, .. }) => {
                return Err(ConnectError::Refused(code, version))
            }
            Err(ClientError::Encode { error, .. }) => {
                return Err(ConnectError::Io(format!("CONNECT: {error}")))
            }
            Err(ClientError::NotConnAck(name)) => {
                return Err(ConnectError::Closed(format!("{name} instead of CONNACK")))
            }
            Err(ClientError::ConnackTimeout(s)) => {
                return Err(ConnectError::Closed(format!("no CONNACK within {s} s")))
            }
            Err(e) => return Err(ConnectError::Closed(format!("no CONNACK: {e}"))),
        };
        Ok(Remote {
            conn,
            too_large: false,
            version,
            connack,
        })
    }

    /// The next packet already buffered, if any.
    pub(crate) fn buffered(&mut self) -> io::Result<Option<Packet>> {
        let r = self.conn.buffered();
        r.map_err(|e| self.lost(e))
    }

    /// The I/O error for a connection lost; notes a packet over the bridge's largest
    /// incoming one, which [`codec::check_frame`] finds from its fixed header.
    fn lost(&mut self, e: ClientError) -> io::Error {
        match e {
            ClientError::Io(e) => e,
            ClientError::Closed => io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "connection closed by the remote",
            ),
            ClientError::Decode { error, .. } => {
                let mut why = error.to_string();
                if let codec::DecodeError::PacketTooLarge { .. } = error {
                    self.too_large = true;
                    why.push_str(" (the bridge's max_packet_size)");
                }
                io::Error::new(io::ErrorKind::InvalidData, why)
            }
            other => io::Error::other(other.to_string()),
        }
    }

    /// The next whole packet. Cancel safe: bytes read stay in the buffer.
    pub(crate) async fn read(&mut self) -> io::Result<Packet> {
        let r = self.conn.recv().await;
        r.map_err(|e| self.lost(e))
    }

    /// Writes `bytes` (packets encoded for the remote's version) whole.
    pub(crate) async fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        let r = self.conn.write_encoded(bytes).await;
        r.map_err(|e| self.lost(e))
    }

    /// Receive Maximum of the remote (5.0 CONNACK; 65,535 when absent).
    pub(crate) fn receive_maximum(&self) -> u16 {
        self.conn.receive_maximum()
    }

    /// Maximum Packet Size of the remote (5.0 CONNACK), in bytes.
    pub(crate) fn maximum_packet_size(&self) -> usize {
        self.conn.maximum_packet_size()
    }
}

/// CONNECT for this bridge: its client id, Clean Start, keep alive, credentials, and the will
/// that sets its state to 0 on the remote when notifications are on.
fn connect_packet(cfg: &BridgeConfig, version: ProtocolVersion, max_incoming: u32) -> Connect {
    let mut properties = Properties::default();
    if version.is_v5() && !cfg.clean_start {
        // Keep the session on the remote while the link is down [MQTT-3.1.2-23].
        properties.session_expiry_interval = Some(u32::MAX);
    }
    if version.is_v5() && max_incoming < crate::config::MAX_PACKET_SIZE_LIMIT {
        // The remote must send nothing larger [MQTT-3.1.2-24].
        properties.maximum_packet_size = Some(max_incoming);
    }
    let will = cfg.notifications.then(|| LastWill {
        topic: cfg.remote_state_topic(),
        payload: Bytes::from_static(b"0"),
        qos: QoS::AtLeastOnce,
        retain: true,
        properties: Properties::default(),
    });
    Connect {
        protocol: version,
        clean_start: cfg.clean_start,
        keep_alive: cfg.keepalive,
        client_id: cfg.remote_client_id().to_string(),
        will,
        username: cfg.username.clone(),
        password: cfg.password.clone().map(Bytes::from),
        properties,
    }
}

/// Whether a CONNECT refusal means the remote does not take the private bit (so the next
/// attempt goes without it): the protocol version refused, or the connection closed.
pub(crate) fn refuses_private(e: &ConnectError) -> bool {
    match e {
        ConnectError::Refused(rc, _) => {
            *rc == ReasonCode::UNSUPPORTED_PROTOCOL_VERSION
                || rc.0 == ReasonCode::V3_UNACCEPTABLE_PROTOCOL_VERSION
        }
        ConnectError::Closed(_) => true,
        ConnectError::Io(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The CONNECT [`Remote::connect`] writes, encoded.
    fn encode_connect(
        cfg: &BridgeConfig,
        version: ProtocolVersion,
        private: bool,
        max_incoming: u32,
        out: &mut BytesMut,
    ) -> Result<(), ClientError> {
        let connect = Packet::Connect(Box::new(connect_packet(cfg, version, max_incoming)));
        let options = ConnectOptions {
            bridge_bit: private,
            ..ConnectOptions::default()
        };
        mercurio_codec::client::encode_connect(&connect, version, &options, out)
    }

    #[test]
    fn private_bit_on_the_protocol_level() {
        let cfg = crate::bridge::tests::example();
        let mut out = BytesMut::new();
        encode_connect(&cfg, ProtocolVersion::V311, true, 1 << 20, &mut out).unwrap();
        assert_eq!(&out[4..8], b"MQTT");
        assert_eq!(out[8], 0x84);
    }

    /// The bridge tells an MQTT 5 remote the largest packet it accepts [MQTT-3.1.2-24].
    #[test]
    fn maximum_packet_size_in_the_v5_connect() {
        let mut cfg = crate::bridge::tests::example();
        cfg.protocol_version = BridgeProtocol::Mqttv5;
        let mut out = BytesMut::new();
        encode_connect(&cfg, ProtocolVersion::V5, false, 1 << 20, &mut out).unwrap();
        let Ok(Some(Packet::Connect(c))) = codec::decode(&mut out, ProtocolVersion::V5, 1 << 20)
        else {
            panic!("a CONNECT");
        };
        assert_eq!(c.properties.maximum_packet_size, Some(1 << 20));
    }

    /// A 3.1.1 remote refusing the CONNECT: the error names the return code as MQTT 3.1.1
    /// section 3.2.2.3 does, not as a 5.0 reason code of the same value.
    #[tokio::test]
    async fn a_3_1_1_refusal_is_named() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            for code in 1u8..=5 {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 256];
                let _ = s.read(&mut buf).await;
                let _ = s.write_all(&[0x20, 2, 0, code]).await;
            }
        });
        let mut cfg = crate::bridge::tests::example();
        cfg.addresses = vec![addr.to_string()];
        let mut seen = Vec::new();
        for _ in 1..=5 {
            let e = Remote::connect(
                &cfg,
                None,
                &addr.to_string(),
                false,
                Duration::from_secs(5),
                1 << 20,
            )
            .await
            .err()
            .unwrap();
            seen.push(e.to_string());
        }
        assert_eq!(
            seen,
            [
                "refused by the remote: CONNACK return code 1 (unacceptable protocol version)",
                "refused by the remote: CONNACK return code 2 (identifier rejected)",
                "refused by the remote: CONNACK return code 3 (server unavailable)",
                "refused by the remote: CONNACK return code 4 (bad user name or password)",
                "refused by the remote: CONNACK return code 5 (not authorized)",
            ]
        );
    }
}
