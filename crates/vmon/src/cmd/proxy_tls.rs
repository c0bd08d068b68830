//! The proxy's TLS: the operator's certificate (`proxy_tls_cert`/`proxy_tls_key`), or for
//! `vmon up` without one a local CA, created once in `<data dir>/tls` (`ca.pem`, and `ca.key`
//! mode 0600), that signs a certificate for each `localhost` (or `VMON_DOMAIN`) name clients
//! ask for. Beside it `bundle.pem`: the system's CAs and vmon's, for `SSL_CERT_FILE`, which
//! replaces the system bundle rather than adding to it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use vmon_api::Config;
use vmon_proxy::tls;

pub const TLS_DIR: &str = "tls";
const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca.key";
const BUNDLE: &str = "bundle.pem";
const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// What the proxy serves TLS with.
pub struct ProxyTls {
    pub config: Arc<tls::ServerConfig>,
    /// Set when the certificates come from vmon's local CA: what clients must trust.
    pub local_ca: Option<LocalCaFiles>,
}

pub struct LocalCaFiles {
    /// The CA certificate alone (`NODE_EXTRA_CA_CERTS`, `update-ca-certificates`).
    pub ca: PathBuf,
    /// The system CAs and vmon's (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`).
    pub bundle: PathBuf,
}

/// The operator's certificate when configured; else, with `local_ca`, vmon's local CA (made on
/// first use); else none (plain HTTP only).
pub fn load(config: &Config, data_dir: &Path, local_ca: bool) -> anyhow::Result<Option<ProxyTls>> {
    if let (Some(cert), Some(key)) = (&config.proxy_tls_cert, &config.proxy_tls_key) {
        let chain = std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
        let key_pem = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
        let tls = tls::from_pem(&chain, &key_pem).with_context(|| {
            format!(
                "the proxy's TLS certificate {} and key {}",
                cert.display(),
                key.display()
            )
        })?;
        return Ok(Some(ProxyTls {
            config: tls,
            local_ca: None,
        }));
    }
    if !local_ca {
        return Ok(None);
    }
    let files = LocalCaFiles::paths(data_dir);
    let (ca_pem, key_pem) = ca_files(&data_dir.join(TLS_DIR))?;
    let domains: Vec<String> = config.domain.iter().cloned().collect();
    let ca = tls::LocalCa::new(&ca_pem, &key_pem, &domains).with_context(|| {
        format!(
            "loading vmon's local CA from {} (remove that directory to make a new one)",
            data_dir.join(TLS_DIR).display()
        )
    })?;
    write_bundle(&files.bundle, &ca_pem)?;
    Ok(Some(ProxyTls {
        config: tls::server_config(Arc::new(ca))?,
        local_ca: Some(files),
    }))
}

impl LocalCaFiles {
    pub fn paths(data_dir: &Path) -> LocalCaFiles {
        let dir = data_dir.join(TLS_DIR);
        LocalCaFiles {
            ca: dir.join(CA_CERT),
            bundle: dir.join(BUNDLE),
        }
    }

    /// The lines that make Python (httpx, requests, urllib) and Node trust the CA.
    pub fn exports(&self) -> String {
        format!(
            "export SSL_CERT_FILE={bundle}\nexport REQUESTS_CA_BUNDLE={bundle}\nexport NODE_EXTRA_CA_CERTS={ca}",
            bundle = self.bundle.display(),
            ca = self.ca.display()
        )
    }

    /// How to trust the CA system-wide instead, for the log.
    pub fn hint(&self) -> String {
        format!(
            "vmon: the proxy serves https with vmon's local CA {ca}; the exports trust it for Python and Node. \
             To trust it system-wide (curl, browsers on this machine): \
             cp {ca} /usr/local/share/ca-certificates/vmon-local-ca.crt && update-ca-certificates",
            ca = self.ca.display()
        )
    }
}

/// The CA's certificate and key, made once. The key is created exclusively (of two starts at
/// once one makes it) and owner-only; the certificate is written after it.
pub(crate) fn ca_files(dir: &Path) -> anyhow::Result<(String, String)> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    let (cert, key) = tls::generate_ca().context("generating vmon's local CA")?;
    match vmon_vm::private::create(&key_path, key.as_bytes()) {
        Ok(()) => {
            vmon_vm::private::write(&cert_path, cert.as_bytes())
                .with_context(|| format!("writing {}", cert_path.display()))?;
            // The certificate is public: clients are pointed at it.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cert_path, std::fs::Permissions::from_mode(0o644))
                .with_context(|| format!("chmod {}", cert_path.display()))?;
            tracing::info!(ca = %cert_path.display(), "created vmon's local CA");
            Ok((cert, key))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let key = std::fs::read_to_string(&key_path)
                .with_context(|| format!("reading {}", key_path.display()))?;
            // Another start may be between writing the key and the certificate.
            let mut cert = std::fs::read_to_string(&cert_path);
            for _ in 0..50 {
                if cert.is_ok() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
                cert = std::fs::read_to_string(&cert_path);
            }
            let cert = cert.with_context(|| {
                format!(
                    "reading {} (its key {} exists)",
                    cert_path.display(),
                    key_path.display()
                )
            })?;
            Ok((cert, key))
        }
        Err(e) => Err(e).with_context(|| format!("creating {}", key_path.display())),
    }
}

pub(crate) fn write_bundle(path: &Path, ca_pem: &str) -> anyhow::Result<()> {
    let mut bundle = match std::fs::read_to_string(SYSTEM_BUNDLE) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "no system CA bundle at {SYSTEM_BUNDLE}; {} holds only vmon's CA", path.display());
            String::new()
        }
    };
    if !bundle.is_empty() && !bundle.ends_with('\n') {
        bundle.push('\n');
    }
    bundle.push_str("# vmon local CA\n");
    bundle.push_str(ca_pem);
    let tmp = path.with_extension("pem.tmp");
    std::fs::write(&tmp, bundle).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_local_ca_is_made_once_with_a_private_key() {
        let dir = tempfile::tempdir().expect("dir");
        let config = Config::default();
        let first = load(&config, dir.path(), true).expect("load").expect("tls");
        let files = first.local_ca.expect("local ca");
        let tls_dir = dir.path().join(TLS_DIR);
        let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&tls_dir.join(CA_KEY)), 0o600);
        assert_eq!(mode(&files.ca), 0o644);
        let ca = std::fs::read_to_string(&files.ca).expect("ca");
        let bundle = std::fs::read_to_string(&files.bundle).expect("bundle");
        assert!(bundle.ends_with(&ca), "the bundle ends with vmon's CA");
        // A second start keeps the CA.
        load(&config, dir.path(), true).expect("load again");
        assert_eq!(std::fs::read_to_string(&files.ca).expect("ca"), ca);
        // Without the local CA and no certificate: no TLS.
        assert!(load(&config, dir.path(), false).expect("load").is_none());
    }
}
