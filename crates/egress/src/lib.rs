//! The egress proxy of secret injection (`docs/networking.md`, "Secrets at egress").
//!
//! A sandbox whose `network.rules` set headers for a host gets a [`Listener`] of its own, on
//! its slot's host address: the slot namespace DNATs the guest's TCP/443 to that host's
//! addresses there (`crates/node/src/slots.rs`). The listener reads the TLS ClientHello, and
//! for a server name the rules name
//!
//! 1. terminates TLS with a certificate for that name, signed by the node's egress CA (which
//!    the node installs in the guest's trust store at start);
//! 2. reads each HTTP/1.1 request (headers bounded), sets the rule's headers with the secrets'
//!    current values filled in ([`vmon_proto::egress::fill`]), replacing what the guest sent;
//! 3. forwards it over TLS to the real host at the addresses the node vetted against the
//!    slot's policy, verifying its certificate for that name (the system's roots plus an
//!    operator's CA file), and streams the answer back.
//!
//! Any other server name (or none) is refused: the connection is closed. Values live in
//! memory only; no error or log line carries one.

mod conn;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, RwLock};

use anyhow::Context;
use vmon_proto::egress::EgressSpec;

pub use conn::{MAX_CONNECTIONS, MAX_HEADERS, MAX_HEADER_BYTES};

/// What one sandbox's listener applies: its rules and secrets, and where each rule host may be
/// reached (addresses its policy lets it reach, resolved by the node).
#[derive(Debug, Clone, Default)]
pub struct SlotRules {
    pub spec: EgressSpec,
    pub upstream: BTreeMap<String, Vec<Ipv4Addr>>,
    /// The port real hosts are reached at: 443 (what the slot intercepts); tests use others.
    pub upstream_port: u16,
}

/// The node's egress proxy: its CA and the TLS settings towards real hosts.
pub struct Egress {
    ca_pem: String,
    ca_key_pem: String,
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Egress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Egress").finish_non_exhaustive()
    }
}

/// A new egress CA: its certificate and key, PEM (ten years).
pub fn generate_ca() -> anyhow::Result<(String, String)> {
    vmon_proxy::tls::generate_ca().map_err(|e| anyhow::anyhow!("{e}"))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The roots real hosts are verified against: the system's, plus `extra`'s certificates.
fn client_config(extra: Option<&Path>) -> anyhow::Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(c);
    }
    if let Some(path) = extra {
        let certs = CertificateDer::pem_file_iter(path)
            .with_context(|| format!("reading {}", path.display()))?;
        for c in certs {
            let c = c.with_context(|| format!("{}", path.display()))?;
            roots
                .add(c)
                .with_context(|| format!("{}", path.display()))?;
        }
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

impl Egress {
    /// The proxy of the CA `ca_pem`/`ca_key_pem` (as [`generate_ca`] made them), verifying real
    /// hosts against the system's roots and `extra_ca`'s.
    pub fn new(
        ca_pem: String,
        ca_key_pem: String,
        extra_ca: Option<&Path>,
    ) -> anyhow::Result<Egress> {
        // Fail now on a CA that cannot sign.
        vmon_proxy::tls::LocalCa::new(&ca_pem, &ca_key_pem, &[])
            .map_err(|e| anyhow::anyhow!("the egress CA: {e}"))?;
        Ok(Egress {
            ca_pem,
            ca_key_pem,
            client: Arc::new(client_config(extra_ca)?),
        })
    }

    /// The CA certificate guests with rules must trust (PEM).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Listens on `bind` for one sandbox's intercepted connections.
    pub async fn listen(&self, bind: SocketAddr, rules: SlotRules) -> anyhow::Result<Listener> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket
            .bind(bind)
            .with_context(|| format!("binding the egress listener on {bind}"))?;
        self.serve(socket.listen(128)?, rules)
    }

    /// Serves one sandbox's intercepted connections on `listener` (the node binds it inside
    /// the sandbox's slot namespace). Needs a Tokio runtime.
    pub fn serve(
        &self,
        listener: tokio::net::TcpListener,
        rules: SlotRules,
    ) -> anyhow::Result<Listener> {
        let hosts: Vec<String> = rules.spec.rules.iter().map(|r| r.host.clone()).collect();
        let ca = vmon_proxy::tls::LocalCa::new(&self.ca_pem, &self.ca_key_pem, &hosts)
            .map_err(|e| anyhow::anyhow!("the egress CA: {e}"))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(ca));
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let state = Arc::new(RwLock::new(Arc::new(rules)));
        let shared = Arc::new(conn::Shared {
            state: state.clone(),
            server: Arc::new(server),
            client: self.client.clone(),
            slots: tokio::sync::Semaphore::new(MAX_CONNECTIONS),
        });
        let local = listener.local_addr()?;
        let task = Some(tokio::spawn(conn::accept_loop(listener, shared)));
        Ok(Listener { task, state, local })
    }
}

/// One sandbox's listener; dropping it stops accepting (connections in flight end with it).
pub struct Listener {
    task: Option<tokio::task::JoinHandle<()>>,
    state: Arc<RwLock<Arc<SlotRules>>>,
    local: SocketAddr,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").finish_non_exhaustive()
    }
}

impl Listener {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Replaces the rules and secrets; the next request uses them.
    pub fn update(&self, spec: EgressSpec) {
        let mut st = self.state.write().unwrap_or_else(|p| p.into_inner());
        let mut next = SlotRules::clone(&st);
        next.spec = spec;
        *st = Arc::new(next);
    }
}

impl Listener {
    /// Stops it and returns once its socket and connections are closed (so the address can be
    /// bound again at once).
    pub async fn close(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}
