//! TLS for the REST API: the server side from this member's certificate,
//! and the client side, for calls to other members' APIs, trusting only
//! the members' CA.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

const VERSIONS: [&rustls::SupportedProtocolVersion; 2] =
    [&rustls::version::TLS13, &rustls::version::TLS12];

/// A certificate chain and its key, from PEM files. Errors name the file.
fn identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<_, _>>())
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate found", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    Ok((certs, key))
}

/// The server side: `cert` (PEM chain) and `key` (PEM); with `client_ca`,
/// clients are asked for a certificate chained to it, which they must
/// present unless `optional`.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    optional: bool,
) -> Result<Arc<ServerConfig>, String> {
    let (certs, key) = identity(cert, key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&VERSIONS)
        .map_err(|e| e.to_string())?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(ca)?),
                provider(),
            );
            if optional {
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("certificate and key do not fit: {e}"))?;
    Ok(Arc::new(config))
}

/// The client side: servers must present a certificate that chains to
/// the CA certificates in `ca` (PEM) and names the host of the URL; with
/// `identity` (certificate and key files), the client presents it.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, String> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&VERSIONS)
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca)?);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let (certs, key) = self::identity(cert, key)?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| format!("certificate and key do not fit: {e}"))?
        }
    };
    Ok(Arc::new(config))
}

/// The CA certificates in `ca` (PEM), at least one.
fn roots(ca: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
        let c = c.map_err(|e| format!("{}: {e}", ca.display()))?;
        roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{}: no CA certificate found", ca.display()));
    }
    Ok(roots)
}
