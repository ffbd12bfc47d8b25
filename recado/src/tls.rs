//! TLS client settings, for the commands and the load generator: rustls 0.23 with the ring
//! provider, the server certificate verified against `--cafile` (or the system's trusted
//! roots without it) for `--tls-server-name`, an optional client certificate (`--cert` /
//! `--key`). `--insecure` keeps the chain check but accepts a certificate issued for another
//! name (as mosquitto's `--insecure`). Session resumption can be turned off, so that every
//! connection of a benchmark pays for a full handshake.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::TlsConnector;

/// What every TLS connection of a run shares.
pub struct Tls {
    pub connector: TlsConnector,
    pub server_name: ServerName<'static>,
}

/// The TLS options as given on the command line.
pub struct TlsOptions<'a> {
    /// PEM CA certificates; with neither this nor `capath`: the system's trusted roots.
    pub cafile: Option<&'a Path>,
    /// A directory of PEM CA certificates (`*.pem`, `*.crt`).
    pub capath: Option<&'a Path>,
    /// Add the system's trusted roots to `cafile` / `capath`.
    pub os_roots: bool,
    /// Only this TLS version (`tlsv1.3` or `tlsv1.2`); `None`: either.
    pub version: Option<&'a str>,
    pub server_name: &'a str,
    pub cert: Option<&'a Path>,
    pub key: Option<&'a Path>,
    /// Accept a certificate whose name does not match (the chain is still verified).
    pub insecure: bool,
    pub resume: bool,
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: bad PEM certificate: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate", path.display()));
    }
    Ok(certs)
}

impl Tls {
    /// Reads the certificates and keys `o` names. Errors: an unreadable or invalid PEM
    /// file, no CA certificate at all, a TLS version other than tlsv1.3 or tlsv1.2, a bad
    /// server name; one sentence each.
    pub fn new(o: &TlsOptions<'_>) -> Result<Tls, String> {
        let mut roots = RootCertStore::empty();
        let mut add = |path: &Path| -> Result<(), String> {
            for c in certs(path)? {
                roots
                    .add(c)
                    .map_err(|e| format!("{}: bad CA certificate: {e}", path.display()))?;
            }
            Ok(())
        };
        if let Some(cafile) = o.cafile {
            add(cafile)?;
        }
        if let Some(dir) = o.capath {
            let entries =
                std::fs::read_dir(dir).map_err(|e| format!("--capath {}: {e}", dir.display()))?;
            let mut files: Vec<_> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "pem" || x == "crt"))
                .collect();
            files.sort();
            for f in files {
                add(&f)?;
            }
        }
        if o.os_roots || (o.cafile.is_none() && o.capath.is_none()) {
            for c in rustls_native_certs::load_native_certs()
                .map_err(|e| format!("cannot read the system's CA certificates: {e}"))?
            {
                // A system bundle may hold certificates rustls cannot parse: skip them.
                let _ = roots.add(c);
            }
        }
        if roots.is_empty() {
            return Err(
                "no CA certificate to verify the broker with: give one with --cafile".into(),
            );
        }
        let versions: &[&'static rustls::SupportedProtocolVersion] = match o.version {
            None => &[&rustls::version::TLS13, &rustls::version::TLS12],
            Some("tlsv1.3") => &[&rustls::version::TLS13],
            Some("tlsv1.2") => &[&rustls::version::TLS12],
            Some(v) => {
                return Err(format!(
                    "--tls-version {v}: tlsv1.3 or tlsv1.2 (older versions are not supported)"
                ))
            }
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(|e| format!("TLS: {e}"))?;
        let builder = if o.insecure {
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("TLS: {e}"))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyName { inner }))
        } else {
            builder.with_root_certificates(roots)
        };
        let mut config = match (o.cert, o.key) {
            (Some(cert), Some(key)) => {
                let chain = certs(cert)?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("{}: no usable PEM private key: {e}", key.display()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| format!("client certificate: {e}"))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => return Err("--cert and --key go together".into()),
        };
        if !o.resume {
            config.resumption = rustls::client::Resumption::disabled();
        }
        let server_name = ServerName::try_from(o.server_name.to_string())
            .map_err(|e| format!("--tls-server-name {}: {e}", o.server_name))?;
        Ok(Tls {
            connector: TlsConnector::from(Arc::new(config)),
            server_name,
        })
    }
}

/// `--insecure`: the chain must lead to a trusted root, but the name may differ.
///
/// mercurio-storage has the same verifier for PostgreSQL's `sslmode=verify-ca`
/// (`postgres/tls.rs`, `ChainOnly`); they are kept apart on purpose: the storage crate is the
/// bottom of the workspace and holds nothing for MQTT clients, and recado takes none of its
/// TLS settings from libpq's rules (nor the storage crate any of mosquitto's flags).
#[derive(Debug)]
struct AnyName {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
