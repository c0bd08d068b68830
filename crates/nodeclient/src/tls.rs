//! TLS for node RPC (and the other in-cluster links that reuse it: the proxy's calls to the
//! api): a server configuration from a certificate chain and key file, and a client
//! configuration that trusts either one CA file (a cluster's own CA: then nothing else) or,
//! without one, the system's CAs. rustls with ring, TLS 1.2 and 1.3. Here, in the client
//! crate, because both ends of node RPC use it.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
pub use rustls::{ClientConfig, ServerConfig};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file, in order (a chain's leaf first).
fn certificates(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{}: invalid PEM", path.display()))?;
    if certs.is_empty() {
        anyhow::bail!("{}: no certificate in it", path.display());
    }
    Ok(certs)
}

/// A server configuration serving the chain of `cert` (PEM, leaf first) with the key of `key`
/// (PEM: PKCS#8, PKCS#1 or SEC1), offering ALPN `alpn` (e.g. `[b"http/1.1"]`).
pub fn server_config(cert: &Path, key: &Path, alpn: &[&[u8]]) -> anyhow::Result<Arc<ServerConfig>> {
    let chain = certificates(cert)?;
    let key_pem = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| anyhow::anyhow!("{}: no private key in it ({e})", key.display()))?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .with_context(|| {
            format!(
                "the certificate {} and key {}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// What a client verifies servers with.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    /// Whether the roots are a configured CA file (a private PKI): then links that could
    /// carry a bearer token must use TLS.
    pinned: bool,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("pinned", &self.pinned)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Trusts only the CA certificates in `ca_file` (PEM).
    pub fn from_ca_file(ca_file: &Path) -> anyhow::Result<ClientTls> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates(ca_file)? {
            roots
                .add(cert)
                .with_context(|| format!("{}: not a CA certificate", ca_file.display()))?;
        }
        Ok(ClientTls {
            config: client_config(roots)?,
            pinned: true,
        })
    }

    /// Trusts the system's CAs.
    pub fn system() -> anyhow::Result<ClientTls> {
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        for e in &native.errors {
            tracing::debug!(error = %e, "reading a system CA certificate failed");
        }
        let (added, _ignored) = roots.add_parsable_certificates(native.certs);
        if added == 0 {
            tracing::warn!("no system CA certificates found: https links will not verify");
        }
        Ok(ClientTls {
            config: client_config(roots)?,
            pinned: false,
        })
    }

    /// [`ClientTls::from_ca_file`] when a file is given, else [`ClientTls::system`].
    pub fn from_optional_ca(ca_file: Option<&Path>) -> anyhow::Result<ClientTls> {
        match ca_file {
            Some(f) => ClientTls::from_ca_file(f),
            None => ClientTls::system(),
        }
    }

    /// Whether a CA file was configured.
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    pub fn config(&self) -> Arc<ClientConfig> {
        self.config.clone()
    }
}

fn client_config(roots: rustls::RootCertStore) -> anyhow::Result<Arc<ClientConfig>> {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The DNS name a cluster node's certificate carries to prove it is node `id`
/// (`<id>.node.vmon`, beside its addresses). In a cluster the api and the other nodes verify
/// a node against this name, never against the address in its registry entry: an entry
/// pointing at another host cannot borrow that host's certificate.
pub fn node_name(id: &str) -> anyhow::Result<rustls::pki_types::ServerName<'static>> {
    let valid = !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    if !valid {
        anyhow::bail!(
            "node id {id:?} cannot be named in a certificate (lower-case letters, digits and \
             inner '-', at most 63)"
        );
    }
    rustls::pki_types::ServerName::try_from(format!("{id}.node.vmon"))
        .map_err(|e| anyhow::anyhow!("node id {id:?}: {e}"))
}

/// Whether `error` (from a TLS handshake) is the peer's certificate refused: it does not
/// chain to the trusted CA, or does not carry the expected name.
pub fn certificate_refused(error: &std::io::Error) -> bool {
    error
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
        .is_some_and(|e| {
            matches!(
                e,
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented
            )
        })
}

/// The TLS server name of `host:port` (a DNS name or an IP address, IPv6 in brackets).
pub fn server_name(addr: &str) -> anyhow::Result<rustls::pki_types::ServerName<'static>> {
    let host = match addr.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| anyhow::anyhow!("{host:?} is not a TLS server name: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_of_addresses() {
        for (addr, want) in [
            ("127.0.0.1:3021", "127.0.0.1"),
            ("[::1]:3021", "::1"),
            ("node-1.example.com:443", "node-1.example.com"),
            ("localhost", "localhost"),
        ] {
            let name = server_name(addr).expect(addr);
            assert_eq!(name.to_str(), want, "{addr}");
        }
        assert!(server_name("bad name:1").is_err());
    }

    #[test]
    fn node_names_are_dns_names_of_the_id() {
        assert_eq!(
            node_name("node1").expect("name").to_str(),
            "node1.node.vmon"
        );
        for bad in [
            "",
            "Node1",
            "a.b",
            "a b",
            "-a",
            "a-",
            "x/y",
            &"a".repeat(64),
        ] {
            assert!(node_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn files_without_certificates_are_errors() {
        let dir = tempfile::tempdir().expect("dir");
        let f = dir.path().join("empty.pem");
        std::fs::write(&f, "nothing here\n").expect("write");
        assert!(ClientTls::from_ca_file(&f).is_err());
        assert!(ClientTls::from_ca_file(&dir.path().join("missing.pem")).is_err());
        assert!(server_config(&f, &f, &[]).is_err());
    }
}
