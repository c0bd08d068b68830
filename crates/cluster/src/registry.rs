//! The node registry: a node's entry under `nodes/<id>`, bound to a lease it keeps alive and
//! rewritten with every heartbeat; reading the live members.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use vmon_kv::{Kv, Write};
use vmon_proto::cluster::{NodeInfo, NODES_PREFIX};

/// How long a silent node stays registered. A restart shorter than this keeps its sandboxes.
pub const NODE_TTL: Duration = Duration::from_secs(10);
/// How often a node rewrites its entry (load, free memory and slots).
pub const HEARTBEAT: Duration = Duration::from_secs(2);

/// Keeps `nodes/<id>` alive until `cancel` fires, rewriting it from `info` every heartbeat.
/// A lost lease (etcd unreachable for a whole TTL) is granted anew: the cluster may have
/// reported the node's sandboxes killed meanwhile, and the leader then kills what the node
/// still runs without a record. On `cancel` the lease is left to expire, as after a crash:
/// a node restarted within the TTL keeps its sandboxes.
pub async fn register<F, Fut>(kv: Kv, id: String, info: F, cancel: CancellationToken)
where
    F: Fn() -> Fut + Send,
    Fut: Future<Output = NodeInfo> + Send,
{
    let key = format!("{NODES_PREFIX}{id}");
    while !cancel.is_cancelled() {
        let lease = match kv.grant_lease(NODE_TTL).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "registering the node failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        tracing::info!(node_id = %id, lease = lease.id(), "node registered");
        let lost = lease.lost();
        loop {
            let entry = info().await;
            match serde_json::to_vec(&entry) {
                Ok(value) => {
                    if let Err(e) = kv.write(Write::put(&key, value).lease(&lease)).await {
                        tracing::warn!(error = %e, "node heartbeat failed");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "encoding the node entry failed"),
            }
            tokio::select! {
                _ = cancel.cancelled() => {
                    lease.abandon();
                    return;
                }
                _ = lost.cancelled() => {
                    tracing::warn!(node_id = %id, "the node's registration lease was lost; registering again");
                    break;
                }
                _ = tokio::time::sleep(HEARTBEAT) => {}
            }
        }
    }
}

/// The nodes registered now. Entries that do not decode are skipped (and logged).
pub async fn members(kv: &Kv) -> vmon_kv::Result<Vec<NodeInfo>> {
    let mut out = Vec::new();
    for e in kv.list(NODES_PREFIX).await? {
        match serde_json::from_slice::<NodeInfo>(&e.value) {
            Ok(n) => out.push(n),
            Err(err) => tracing::warn!(key = %e.key, error = %err, "a node entry does not decode"),
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// What the host says about itself: hostname, CPU model, CPUs, memory, free disk.
#[derive(Debug, Clone, Default)]
pub struct HostFacts {
    pub hostname: String,
    pub cpu_model: String,
    pub vcpus: u32,
    pub memory_mb: u64,
    pub free_memory_mb: u64,
    pub free_disk_mb: u64,
}

/// Reads [`HostFacts`] from `/proc` and the data dir's filesystem.
pub fn host_facts(data_dir: &Path) -> HostFacts {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
    };
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|r| r.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_default();
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    HostFacts {
        hostname,
        cpu_model,
        vcpus: std::thread::available_parallelism()
            .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
            .unwrap_or(1),
        memory_mb: kib("MemTotal:") / 1024,
        free_memory_mb: kib("MemAvailable:") / 1024,
        free_disk_mb: free_disk_mb(data_dir),
    }
}

fn free_disk_mb(dir: &Path) -> u64 {
    match rustix::fs::statvfs(dir) {
        Ok(st) => st.f_bavail.saturating_mul(st.f_frsize) >> 20,
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_describes_itself() {
        let f = host_facts(Path::new("/"));
        assert!(f.vcpus >= 1);
        assert!(f.memory_mb > 0 && f.free_memory_mb <= f.memory_mb);
        assert!(f.free_disk_mb > 0);
    }

    #[tokio::test]
    async fn a_registration_lives_with_its_heartbeat() {
        let dir = std::env::temp_dir().join(format!("vmon-reg-{}", std::process::id()));
        let kv = Kv::open_embedded(&vmon_kv::EmbeddedConfig::new(&dir))
            .await
            .expect("kv");
        let cancel = CancellationToken::new();
        let info = |n: u32| NodeInfo {
            id: "n1".into(),
            rpc_url: "http://127.0.0.1:1".into(),
            ingress_url: None,
            host: "h".into(),
            accel: "tcg".into(),
            qemu_version: "q".into(),
            cpu_baseline: "c".into(),
            vcpus: 2,
            memory_mb: 1,
            free_memory_mb: 1,
            free_disk_mb: 1,
            free_slots: 1,
            running: n,
            updated_unix: 0,
            gpus: Default::default(),
        };
        let counter = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let c = counter.clone();
        let task = tokio::spawn(register(
            kv.clone(),
            "n1".into(),
            move || {
                let n = c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move { info(n) }
            },
            cancel.clone(),
        ));
        let mut seen = None;
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            seen = members(&kv).await.expect("members").into_iter().next();
            if seen.is_some() {
                break;
            }
        }
        assert_eq!(seen.map(|n| n.id), Some("n1".to_string()));
        cancel.cancel();
        task.await.expect("register task");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
