//! TLS to PostgreSQL, as the connection URL asks for it, with libpq's meanings of `sslmode`:
//!
//! | `sslmode` | encrypted | server certificate |
//! |---|---|---|
//! | `disable` | no | - |
//! | `prefer` (libpq's default) | if the server offers TLS | not verified |
//! | `require` | yes | not verified (libpq verifies only when a root certificate is given) |
//! | `verify-ca` | yes | chain verified against `sslrootcert`, or the system's CA bundle |
//! | `verify-full` | yes | chain and host name verified |
//!
//! `sslrootcert=PATH` names a PEM bundle of CA certificates; without it the system bundle
//! (`SSL_CERT_FILE`, else `/etc/ssl/certs/ca-certificates.crt`) is used. tokio-postgres knows
//! only `disable`, `prefer` and `require`, so the verifying modes and `sslrootcert` are taken
//! out of the URL here before it parses the rest.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::StorageError;

/// Where the system's CA bundle is on Debian and most Linux distributions.
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// How the server's certificate is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Encrypt only (`prefer`, `require`).
    None,
    /// The chain (`verify-ca`), and with `hostname` the name too (`verify-full`).
    Chain {
        hostname: bool,
        roots: Option<String>,
    },
}

/// Splits the TLS parameters tokio-postgres does not know out of `url`. Returns the URL to
/// parse and how to verify, `None` when the URL asks for no verifying mode.
pub(crate) fn split_url(url: &str) -> (String, Verify) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), Verify::None);
    };
    let mut kept = Vec::new();
    let mut mode = None;
    let mut roots = None;
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("sslmode", m @ ("verify-ca" | "verify-full"))) => mode = Some(m == "verify-full"),
            Some(("sslrootcert", path)) => roots = Some(path.to_string()),
            _ => kept.push(pair),
        }
    }
    let verify = match mode {
        Some(hostname) => {
            kept.push("sslmode=require");
            Verify::Chain { hostname, roots }
        }
        None => Verify::None,
    };
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    (url, verify)
}

/// The rustls connector for `verify`.
///
/// Errors: a `sslrootcert` (or system bundle) that cannot be read or holds no certificate.
pub(crate) fn connector(verify: &Verify) -> Result<MakeRustlsConnect, StorageError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| StorageError::fatal(format!("TLS to PostgreSQL: {e}")))?;
    let config = match verify {
        Verify::None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
            .with_no_client_auth(),
        Verify::Chain { hostname, roots } => {
            let path = roots
                .clone()
                .or_else(|| std::env::var("SSL_CERT_FILE").ok())
                .unwrap_or_else(|| SYSTEM_CA_BUNDLE.to_string());
            let store = load_roots(&path)?;
            let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(store),
                Arc::clone(&provider),
            )
            .build()
            .map_err(|e| StorageError::fatal(format!("TLS to PostgreSQL: {path}: {e}")))?;
            let verifier: Arc<dyn ServerCertVerifier> = if *hostname {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            };
            builder
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_no_client_auth()
        }
    };
    Ok(MakeRustlsConnect::new(config))
}

fn load_roots(path: &str) -> Result<RootCertStore, StorageError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| StorageError::fatal(format!("sslrootcert {path}: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| StorageError::fatal(format!("sslrootcert {path}: {e}")))?;
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(StorageError::fatal(format!(
            "sslrootcert {path}: no CA certificate in it"
        )));
    }
    Ok(store)
}

/// `require`: the handshake's signatures are checked, the certificate is not (libpq's
/// behaviour without a root certificate).
#[derive(Debug)]
struct EncryptOnly(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted root; a name mismatch is accepted. (recado's
/// `--insecure` has the same verifier in `recado/src/tls.rs`, kept apart on purpose: this
/// crate serves storage only, and recado does not use it.)
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
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
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifying_modes_are_taken_out_of_the_url() {
        assert_eq!(
            split_url("postgres://h/db"),
            ("postgres://h/db".into(), Verify::None)
        );
        assert_eq!(
            split_url("postgres://h/db?sslmode=require"),
            ("postgres://h/db?sslmode=require".into(), Verify::None)
        );
        assert_eq!(
            split_url("postgres://h/db?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x"),
            (
                "postgres://h/db?application_name=x&sslmode=require".into(),
                Verify::Chain {
                    hostname: true,
                    roots: Some("/ca.pem".into())
                }
            )
        );
        assert_eq!(
            split_url("postgres://h/db?sslmode=verify-ca"),
            (
                "postgres://h/db?sslmode=require".into(),
                Verify::Chain {
                    hostname: false,
                    roots: None
                }
            )
        );
    }

    #[test]
    fn unreadable_root_certificate_is_an_error_naming_it() {
        let verify = Verify::Chain {
            hostname: true,
            roots: Some("/nonexistent/ca.pem".into()),
        };
        let e = connector(&verify)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    }
}
