//! TLS on MQTT listeners (rustls 0.23 with ring): TLS 1.2 and 1.3, a certificate chain and a
//! key from PEM files, client certificates verified against `ca_file` (required with
//! `require_certificate`) and the revocation lists of `crl_file`, the client certificate's
//! common name as the user name with `use_identity_as_username`.
//!
//! Each TLS listener holds its current `rustls` configuration behind a lock: a reload (SIGHUP)
//! swaps it for new handshakes, and connections already up keep theirs. The connections
//! themselves are `tls_stream::TlsStream`s, which hold no buffer while idle.

use std::path::Path;
use std::sync::Arc;

use parking_lot::RwLock;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};

use crate::auth::FileError;
use crate::config::ListenerConfig;
use crate::tls_stream::{self, TlsStream};

/// What the TLS handshake tells about the client.
#[derive(Debug, Clone, Default)]
pub(crate) struct TlsIdentity {
    /// The verified client certificate's subject common name.
    pub certificate_cn: Option<String>,
    /// The listener's `use_identity_as_username`.
    pub use_as_username: bool,
}

/// A TLS listener's configuration, reloadable.
pub(crate) struct TlsListener {
    cfg: ListenerConfig,
    config: RwLock<Arc<ServerConfig>>,
}

impl TlsListener {
    /// Reads the certificate, key and CA files of `cfg` (which has `cert_file`).
    pub(crate) fn load(cfg: &ListenerConfig) -> Result<TlsListener, FileError> {
        let config = server_config(cfg)?;
        Ok(TlsListener {
            cfg: cfg.clone(),
            config: RwLock::new(Arc::new(config)),
        })
    }

    /// Reads the files again; on error the current configuration stays.
    pub(crate) fn reload(&self) -> Result<(), FileError> {
        let config = server_config(&self.cfg)?;
        *self.config.write() = Arc::new(config);
        tracing::info!(listener = %format!("{}:{}", self.cfg.host, self.cfg.port), "TLS certificates reloaded");
        Ok(())
    }

    /// The configuration for a new connection.
    pub(crate) fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.config.read())
    }

    /// The identity of a connection whose handshake is done.
    pub(crate) fn identity(&self, conn: &TlsStream) -> TlsIdentity {
        TlsIdentity {
            certificate_cn: conn
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|c| subject_common_name(c)),
            use_as_username: self.cfg.use_identity_as_username,
        }
    }
}

pub(crate) fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, FileError> {
    std::fs::metadata(path).map_err(|e| FileError::io(path, &e))?;
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| FileError::new(path, format!("cannot read certificates: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| FileError::new(path, format!("bad PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(FileError::new(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

fn load_crls(path: &Path) -> Result<Vec<CertificateRevocationListDer<'static>>, FileError> {
    std::fs::metadata(path).map_err(|e| FileError::io(path, &e))?;
    let crls = CertificateRevocationListDer::pem_file_iter(path)
        .map_err(|e| FileError::new(path, format!("cannot read revocation lists: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| FileError::new(path, format!("bad PEM revocation list: {e}")))?;
    if crls.is_empty() {
        return Err(FileError::new(
            path,
            "no PEM revocation list (X509 CRL) in the file",
        ));
    }
    Ok(crls)
}

fn server_config(cfg: &ListenerConfig) -> Result<ServerConfig, FileError> {
    let (Some(cert_file), Some(key_file)) = (&cfg.cert_file, &cfg.key_file) else {
        return Err(FileError::new(
            Path::new(""),
            "TLS needs cert_file and key_file",
        ));
    };
    let certs = load_certs(cert_file)?;
    std::fs::metadata(key_file).map_err(|e| FileError::io(key_file, &e))?;
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| FileError::new(key_file, format!("no usable PEM private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| FileError::new(cert_file, format!("TLS: {e}")))?;
    let builder = match &cfg.ca_file {
        Some(ca_file) => {
            let mut roots = RootCertStore::empty();
            for c in load_certs(ca_file)? {
                roots
                    .add(c)
                    .map_err(|e| FileError::new(ca_file, format!("bad CA certificate: {e}")))?;
            }
            let mut verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider));
            if let Some(crl_file) = &cfg.crl_file {
                // The client's own certificate is checked, as mosquitto's crlfile does; one
                // whose CA has no CRL here is refused (its status unknown).
                verifier = verifier
                    .with_crls(load_crls(crl_file)?)
                    .only_check_end_entity_revocation();
            }
            let verifier = if cfg.require_certificate {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier.build().map_err(|e| match (&e, &cfg.crl_file) {
                // The CRLs are parsed here, not when read: name their file, not the CA's.
                (rustls::server::VerifierBuilderError::InvalidCrl(_), Some(crl_file)) => {
                    FileError::new(
                        crl_file,
                        format!(
                            "crl_file: cannot use the revocation list: {e} (a CRL must be \
                             X.509 version 2, as `openssl ca -gencrl` makes with crl_extensions \
                             set, e.g. crlnumber)"
                        ),
                    )
                }
                _ => FileError::new(ca_file, format!("cannot verify clients: {e}")),
            })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        FileError::new(
            key_file,
            format!(
                "does not fit the certificate of {}: {e}",
                cert_file.display()
            ),
        )
    })?;
    config.alpn_protocols = Vec::new();
    Ok(config)
}

/// Reads one DER element: (tag, contents, what follows).
fn der(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let tag = *input.first()?;
    let first = *input.get(1)?;
    let (len, header) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for i in 0..n {
            len = (len << 8) | usize::from(*input.get(2 + i)?);
        }
        (len, 2 + n)
    };
    let end = header.checked_add(len)?;
    Some((tag, input.get(header..end)?, input.get(end..)?))
}

/// The subject common name (OID 2.5.4.3) of an X.509 certificate in DER.
pub(crate) fn subject_common_name(cert: &[u8]) -> Option<String> {
    let (_, certificate, _) = der(cert)?;
    let (_, tbs, _) = der(certificate)?;
    let mut rest = tbs;
    let (tag, _, after) = der(rest)?;
    if tag == 0xa0 {
        rest = after; // [0] version
    }
    for _ in 0..4 {
        // serial number, signature algorithm, issuer, validity
        rest = der(rest)?.2;
    }
    let (_, mut name, _) = der(rest)?;
    while !name.is_empty() {
        let (_, mut set, after) = der(name)?;
        name = after;
        while !set.is_empty() {
            let (_, attribute, after) = der(set)?;
            set = after;
            let (tag, oid, value) = der(attribute)?;
            if tag == 0x06 && oid == [0x55, 0x04, 0x03] {
                let (_, value, _) = der(value)?;
                return String::from_utf8(value.to_vec()).ok();
            }
        }
    }
    None
}

/// Runs the TLS handshake until `deadline` (`connect_timeout` after the accept, which CONNECT
/// shares); `None` (logged at debug) when it fails or stalls.
pub(crate) async fn handshake(
    tls: &TlsListener,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    deadline: tokio::time::Instant,
) -> Option<(TlsStream, TlsIdentity)> {
    match tokio::time::timeout_at(deadline, tls_stream::accept(tls.server_config(), stream)).await {
        Ok(Ok(stream)) => {
            let identity = tls.identity(&stream);
            Some((stream, identity))
        }
        Ok(Err(e)) => {
            tracing::debug!(%peer, "TLS handshake failed: {e}");
            None
        }
        Err(_) => {
            tracing::debug!(%peer, "no TLS handshake within connect_timeout: closing");
            None
        }
    }
}
