//! Secret injection at egress, the node's side (`docs/networking.md`, "Secrets at egress"):
//! the node's egress CA (`<data dir>/egress/ca.pem`, its key `ca.key` 0600), one
//! [`vmon_egress::Listener`] per running sandbox with rules (a socket in its slot namespace), the
//! slot's interception rules, and the CA put into the guest's trust store at every start.
//!
//! Secret values arrive in the start call (or `update_egress`) and stay in the listener's
//! memory: they are not in `sandbox.json`, in any log line, or in `Debug` output.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use vmon_proto::egress::EgressSpec;
use vmon_proto::node::{NodeError, StartSpec};

use super::{err, Node};
use crate::envd_client::{self, ENVD_PORT};
use crate::slots::{self, EGRESS_PORT};

/// Where the guest keeps the CA (Debian's place for local CAs) and the bundle OpenSSL, curl,
/// Python and Node read by default.
const GUEST_CA: &str = "/usr/local/share/ca-certificates/vmon-egress.crt";
const GUEST_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

pub(super) struct EgressRoom {
    proxy: vmon_egress::Egress,
    listeners: Mutex<HashMap<String, vmon_egress::Listener>>,
}

impl EgressRoom {
    /// Loads the node's egress CA, or makes it on first start.
    pub(super) fn open(cfg: &crate::NodeConfig) -> anyhow::Result<EgressRoom> {
        let dir = cfg.data_dir.join("egress");
        std::fs::create_dir_all(&dir)?;
        let (pem_path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        let (pem, key) = match (
            std::fs::read_to_string(&pem_path),
            std::fs::read_to_string(&key_path),
        ) {
            (Ok(p), Ok(k)) => (p, k),
            _ => {
                let (p, k) = vmon_egress::generate_ca()?;
                vmon_vm::private::write(&key_path, k.as_bytes())
                    .with_context(|| format!("writing {}", key_path.display()))?;
                vmon_vm::private::write(&pem_path, p.as_bytes())
                    .with_context(|| format!("writing {}", pem_path.display()))?;
                (p, k)
            }
        };
        Ok(EgressRoom {
            proxy: vmon_egress::Egress::new(pem, key, cfg.egress_ca_file.as_deref())?,
            listeners: Mutex::new(HashMap::new()),
        })
    }

    /// Stops a sandbox's listener, if it has one, and any other listening on `addr` (a slot
    /// whose sandbox went without a kill, e.g. a discarded parked process).
    pub(super) async fn stop(&self, sandbox_id: &str, addr: Option<SocketAddr>) {
        let gone: Vec<vmon_egress::Listener> = match self.listeners.lock() {
            Ok(mut m) => {
                let ids: Vec<String> = m
                    .iter()
                    .filter(|(id, l)| *id == sandbox_id || Some(l.local_addr()) == addr)
                    .map(|(id, _)| id.clone())
                    .collect();
                ids.iter().filter_map(|id| m.remove(id)).collect()
            }
            Err(_) => Vec::new(),
        };
        for l in gone {
            l.close().await;
        }
    }
}

/// A listening socket on `addr` inside the network namespace `ns` (`ip netns` names it), so
/// only that slot's traffic can reach it. A thread of its own enters the namespace, makes the
/// socket (which stays in the namespace it was made in) and ends: no other thread of the node
/// ever changes namespace.
fn listen_in_netns(ns: &str, addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    let path = format!("/run/netns/{ns}");
    let target = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    std::thread::spawn(move || -> anyhow::Result<std::net::TcpListener> {
        use std::os::fd::AsRawFd;
        // SAFETY: `target` is an open file of a network namespace for the whole call; setns
        // changes only this thread's network namespace, and this thread ends below.
        let rc = unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            anyhow::bail!(
                "entering the slot namespace: {}",
                std::io::Error::last_os_error()
            );
        }
        let l = std::net::TcpListener::bind(addr)
            .with_context(|| format!("binding the egress listener on {addr}"))?;
        l.set_nonblocking(true)?;
        Ok(l)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the namespace thread panicked"))?
}

/// The script that puts the CA (uploaded next to its place) into the guest's trust store once.
fn install_script() -> String {
    format!(
        "set -e
mv -f {GUEST_CA}.new {GUEST_CA}
chmod 644 {GUEST_CA}
line=$(sed -n 2p {GUEST_CA})
if ! grep -qF \"$line\" {GUEST_BUNDLE} 2>/dev/null; then
  {{ echo; cat {GUEST_CA}; }} >> {GUEST_BUNDLE}
fi"
    )
}

impl Node {
    /// For a sandbox just put in the table: its listener, its slot's interception and the CA
    /// in its guest. Without rules: nothing (a listener left from an earlier start goes).
    pub(super) async fn start_egress(&self, spec: &StartSpec) -> Result<(), NodeError> {
        let id = &spec.sandbox_id;
        if spec.egress.is_empty() {
            // Slots are made fresh (or kept by this sandbox's own pause): nothing to undo.
            return Ok(());
        }
        let live = self.live(id)?;
        let (slot, token) = {
            let l = live.lock().await;
            (l.slot.clone(), l.state.envd_token.clone())
        };
        let bind = SocketAddr::new(IpAddr::V4(slot.addr()), EGRESS_PORT);
        self.egress.stop(id, Some(bind)).await;
        let resolved = slots::resolve_names(&spec.network, slots::system_resolve).await;
        let mut upstream: BTreeMap<String, Vec<Ipv4Addr>> = BTreeMap::new();
        for rule in &spec.egress.rules {
            let addrs: Vec<Ipv4Addr> = slots::system_resolve(rule.host.clone())
                .await
                .into_iter()
                .filter(|a| slots::allow_out_reaches(&resolved, *a, self.slots.perimeter()))
                .collect();
            if addrs.is_empty() {
                tracing::warn!(sandbox = %id, host = %rule.host, "egress rule host resolves to no address the sandbox may reach; nothing is intercepted for it");
            }
            upstream.insert(rule.host.clone(), addrs);
        }
        let mut all: Vec<Ipv4Addr> = upstream.values().flatten().copied().collect();
        all.sort();
        all.dedup();
        let ns = slot.netns();
        let socket = tokio::task::spawn_blocking(move || listen_in_netns(&ns, bind))
            .await
            .map_err(|e| NodeError::Failed(format!("egress listener task: {e}")))?
            .and_then(|l| Ok(tokio::net::TcpListener::from_std(l)?))
            .map_err(err)?;
        let listener = self
            .egress
            .proxy
            .serve(
                socket,
                vmon_egress::SlotRules {
                    spec: spec.egress.clone(),
                    upstream,
                    upstream_port: 443,
                },
            )
            .map_err(err)?;
        if let Ok(mut m) = self.egress.listeners.lock() {
            m.insert(id.clone(), listener);
        }
        slot.set_intercept(&all).await.map_err(err)?;
        let envd = SocketAddr::new(IpAddr::V4(slot.addr()), ENVD_PORT);
        envd_client::upload(
            envd,
            token.as_deref(),
            "root",
            &format!("{GUEST_CA}.new"),
            self.egress.proxy.ca_pem().as_bytes().to_vec(),
            Duration::from_secs(30),
        )
        .await
        .map_err(err)?;
        let out = envd_client::run(
            envd,
            token.as_deref(),
            "root",
            &install_script(),
            Duration::from_secs(30),
        )
        .await
        .map_err(err)?;
        if out.exit_code != 0 {
            return Err(NodeError::Failed(format!(
                "installing the egress CA in the guest failed ({}): {}",
                out.exit_code,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        tracing::info!(sandbox = %id, hosts = spec.egress.rules.len(), "egress rules in force");
        Ok(())
    }

    /// New rules or secret values for a running sandbox's listener.
    pub(super) async fn update_egress_of(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        egress: EgressSpec,
    ) -> Result<(), NodeError> {
        let _l = self.live_execution(sandbox_id, execution_id).await?;
        let m = self
            .egress
            .listeners
            .lock()
            .map_err(|_| NodeError::Failed("egress table poisoned".into()))?;
        match m.get(sandbox_id) {
            Some(l) => {
                l.update(egress);
                Ok(())
            }
            None => Err(NodeError::InvalidArgument(format!(
                "sandbox {sandbox_id} has no egress rules"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_install_script_appends_the_ca_once() {
        let s = super::install_script();
        assert!(s.contains("grep -qF") && s.contains(">> /etc/ssl/certs/ca-certificates.crt"));
    }
}
