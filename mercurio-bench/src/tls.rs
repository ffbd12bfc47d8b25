//! TLS for the generator's connections (`--tls`): rustls 0.23 with the ring provider, the
//! server certificate verified against `--cafile` for `--tls-server-name`, an optional client
//! certificate (`--cert` / `--key`). Session resumption is off unless `--tls-resume`, so that
//! every connection pays for a full handshake.

use std::path::Path;
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::TlsConnector;

/// What every TLS connection of a run shares.
pub struct Tls {
    pub connector: TlsConnector,
    pub server_name: ServerName<'static>,
}

/// The TLS options as given on the command line.
pub struct TlsOptions<'a> {
    pub cafile: &'a Path,
    pub server_name: &'a str,
    pub cert: Option<&'a Path>,
    pub key: Option<&'a Path>,
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
    pub fn new(o: &TlsOptions<'_>) -> Result<Tls, String> {
        let mut roots = RootCertStore::empty();
        for c in certs(o.cafile)? {
            roots
                .add(c)
                .map_err(|e| format!("{}: bad CA certificate: {e}", o.cafile.display()))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots);
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
