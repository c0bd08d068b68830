//! TLS for the proxy: the rustls server configuration its listener accepts TLS with (on the
//! same port as plain HTTP, see [`crate::listen`]), from either
//!
//! - a certificate chain and key the operator provides (production: a wildcard certificate
//!   for `*.{domain}`), or
//! - a [`LocalCa`]: a CA of this machine's own that signs, on demand, a certificate for the
//!   name each client asks for (SNI) as long as it is under one of the allowed domains. A
//!   certificate per name rather than one wildcard: clients (OpenSSL among them) refuse a
//!   wildcard directly under a one-label name such as `*.localhost`.
//!
//! ALPN offers `h2` and `http/1.1`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
pub use rustls::ServerConfig;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("no certificate in the PEM")]
    NoCertificate,
    #[error("invalid PEM: {0}")]
    Pem(String),
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    #[error("generating a certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server configuration that takes its certificates from `resolver`, with ALPN `h2` and
/// `http/1.1`.
pub fn server_config(resolver: Arc<dyn ResolvesServerCert>) -> Result<Arc<ServerConfig>, TlsError> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A server configuration serving one certificate chain (leaf first) and its private key,
/// both PEM.
pub fn from_pem(chain_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(chain_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem(e.to_string()))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Pem(e.to_string()))?;
    let key = CertifiedKey::from_der(chain, key, &provider())?;
    server_config(Arc::new(Fixed(Arc::new(key))))
}

#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

const CA_NAME: &str = "vmon local CA";
/// Issued certificates are valid this long; the cache renews them well before.
const LEAF_VALIDITY: Duration = Duration::from_secs(90 * 24 * 3600);
const LEAF_RENEW_AFTER: Duration = Duration::from_secs(24 * 3600);
const CACHE_MAX: usize = 4096;

/// The CA's parameters. An existing CA is loaded by rebuilding these around its key: the
/// issuer name and key identifier of what it signs come from them, so they must stay the same
/// as when the CA was made.
fn ca_params() -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    dn.push(DnType::OrganizationName, "vmon");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// A new CA: its certificate and private key, both PEM. Valid for ten years.
pub fn generate_ca() -> Result<(String, String), TlsError> {
    let key = KeyPair::generate()?;
    let mut params = ca_params();
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(3650);
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A server certificate for `names` (DNS names or IP addresses) signed by the CA of
/// `ca_pem`/`ca_key_pem` (as [`generate_ca`] made them), valid for `days`: its chain (leaf,
/// then the CA) and its new private key, both PEM. For the fixed certificates of a cluster's
/// processes (`vmon cert issue`).
pub fn issue_server_cert(
    ca_pem: &str,
    ca_key_pem: &str,
    names: &[String],
    days: i64,
) -> Result<(String, String), TlsError> {
    issue_cert(ca_pem, ca_key_pem, names, days, false)
}

/// [`issue_server_cert`], valid also as a TLS client certificate when `client` (etcd's
/// members and clients, which authenticate with certificates of the cluster's CA).
pub fn issue_cert(
    ca_pem: &str,
    ca_key_pem: &str,
    names: &[String],
    days: i64,
    client: bool,
) -> Result<(String, String), TlsError> {
    let issuer = Issuer::new(ca_params(), KeyPair::from_pem(ca_key_pem)?);
    let mut params = CertificateParams::new(names.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names.first().map(String::as_str).unwrap_or("vmon"),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    if client {
        params
            .extended_key_usages
            .push(ExtendedKeyUsagePurpose::ClientAuth);
    }
    params.use_authority_key_identifier_extension = true;
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    params.not_after = now + time::Duration::days(days);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    let mut chain = cert.pem();
    if !chain.ends_with('\n') {
        chain.push('\n');
    }
    chain.push_str(ca_pem);
    Ok((chain, key.serialize_pem()))
}

/// A CA that signs a certificate for each name clients ask for, when it is an allowed one:
/// `localhost`, any name under it, an IP literal of this machine's loopback, or a configured
/// domain and the names under it.
pub struct LocalCa {
    issuer: Issuer<'static, KeyPair>,
    ca_der: CertificateDer<'static>,
    domains: Vec<String>,
    cache: Mutex<HashMap<String, (Instant, Arc<CertifiedKey>)>>,
}

impl std::fmt::Debug for LocalCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCa")
            .field("domains", &self.domains)
            .finish_non_exhaustive()
    }
}

impl LocalCa {
    /// The CA of `ca_pem`/`key_pem` (as [`generate_ca`] made them); `domains` are allowed
    /// besides `localhost` (a `:port` is ignored).
    pub fn new(ca_pem: &str, key_pem: &str, domains: &[String]) -> Result<LocalCa, TlsError> {
        let key = KeyPair::from_pem(key_pem)?;
        let ca_der = CertificateDer::from_pem_slice(ca_pem.as_bytes())
            .map_err(|e| TlsError::Pem(e.to_string()))?;
        let mut domains: Vec<String> = domains
            .iter()
            .map(|d| host_only(d).trim_matches('.').to_ascii_lowercase())
            .filter(|d| !d.is_empty())
            .collect();
        domains.push("localhost".into());
        Ok(LocalCa {
            issuer: Issuer::new(ca_params(), key),
            ca_der,
            domains,
            cache: Mutex::new(HashMap::new()),
        })
    }

    fn allowed(&self, name: &str) -> bool {
        if let Ok(ip) = name.parse::<IpAddr>() {
            return ip.is_loopback();
        }
        self.domains.iter().any(|d| {
            name == d
                || name
                    .strip_suffix(d.as_str())
                    .is_some_and(|p| p.len() > 1 && p.ends_with('.'))
        })
    }

    /// A certificate for `name` (`None`: no SNI, i.e. the client dialed an address: then
    /// one for `localhost` and the loopback addresses), signed now.
    fn issue(&self, name: Option<&str>) -> Result<CertifiedKey, TlsError> {
        let names = match name {
            Some(n) => vec![n.to_string()],
            None => vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
        };
        let mut params = CertificateParams::new(names)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name.unwrap_or("localhost"));
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + LEAF_VALIDITY;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let key_der = PrivateKeyDer::try_from(key.serialize_der())
            .map_err(|e| TlsError::Pem(e.to_string()))?;
        Ok(CertifiedKey::from_der(
            vec![cert.der().clone(), self.ca_der.clone()],
            key_der,
            &provider(),
        )?)
    }

    fn cached(&self, name: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let cache_key = name.unwrap_or("").to_string();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((made, key)) = cache.get(&cache_key) {
            if made.elapsed() < LEAF_RENEW_AFTER {
                return Some(key.clone());
            }
        }
        let key = match self.issue(name) {
            Ok(k) => Arc::new(k),
            Err(e) => {
                tracing::warn!(name = name.unwrap_or(""), error = %e, "issuing a certificate failed");
                return None;
            }
        };
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(cache_key, (Instant::now(), key.clone()));
        Some(key)
    }
}

impl ResolvesServerCert for LocalCa {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        match hello.server_name().map(str::to_ascii_lowercase) {
            Some(name) if self.allowed(&name) => self.cached(Some(&name)),
            // A name this CA does not vouch for: no certificate, the handshake fails.
            Some(name) => {
                tracing::debug!(name, "TLS for a name outside the proxy's domains");
                None
            }
            None => self.cached(None),
        }
    }
}

fn host_only(domain: &str) -> &str {
    match domain.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => domain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_local_ca_vouches_for() {
        let (ca, key) = generate_ca().expect("ca");
        let local = LocalCa::new(&ca, &key, &["Sbx.Example.com:3001".into()]).expect("load");
        for ok in [
            "localhost",
            "49983-iabc.localhost",
            "sbx.example.com",
            "8080-iabc.sbx.example.com",
            "127.0.0.1",
            "::1",
        ] {
            assert!(local.allowed(ok), "{ok}");
        }
        for bad in [
            "example.com",
            "evil-localhost",
            "xsbx.example.com",
            ".localhost",
            "10.0.0.1",
            "google.com",
        ] {
            assert!(!local.allowed(bad), "{bad}");
        }
        assert!(local.issue(Some("49983-iabc.localhost")).is_ok());
        assert!(local.issue(None).is_ok());
    }

    #[test]
    fn issued_certificates_verify_against_the_ca() {
        use rustls::client::danger::ServerCertVerifier;
        let (ca, key) = generate_ca().expect("ca");
        let names = vec!["127.0.0.1".to_string(), "node1.local".to_string()];
        let (chain, leaf_key) = issue_server_cert(&ca, &key, &names, 30).expect("issue");
        assert!(from_pem(chain.as_bytes(), leaf_key.as_bytes()).is_ok());
        let certs = CertificateDer::pem_slice_iter(chain.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("pem");
        assert_eq!(certs.len(), 2, "leaf, then the CA");
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.as_bytes()).expect("ca der"))
            .expect("root");
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .build()
        .expect("verifier");
        let now = rustls::pki_types::UnixTime::now();
        for (name, ok) in [
            ("127.0.0.1", true),
            ("node1.local", true),
            ("other.local", false),
        ] {
            let server = rustls::pki_types::ServerName::try_from(name).expect("name");
            let r = verifier.verify_server_cert(&certs[0], &certs[1..], &server, &[], now);
            assert_eq!(r.is_ok(), ok, "{name}: {r:?}");
        }
    }

    #[test]
    fn pem_errors_are_errors() {
        assert!(matches!(from_pem(b"", b""), Err(TlsError::NoCertificate)));
        let (ca, _) = generate_ca().expect("ca");
        assert!(from_pem(ca.as_bytes(), b"not a key").is_err());
    }
}
