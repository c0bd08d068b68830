//! The cluster contract: what a node says about itself in the registry, and what the control
//! plane may ask of a set of nodes beyond [`crate::node::NodeControl`].
//!
//! A node writes its [`NodeInfo`] under `nodes/<id>` in the KV with a lease it keeps alive;
//! when the lease ends the node is gone. The api's view of the members ([`Cluster`]) tells the
//! leader which nodes are alive, where each sandbox runs and what each node runs, so it can
//! report the sandboxes of a dead node killed (`orphaned`) and kill VMs no record names.

use serde::{Deserialize, Serialize};

use crate::node::{MigrateStats, NodeError, Running};

/// The KV prefix of the node registry.
pub const NODES_PREFIX: &str = "nodes/";

/// One node as it registers itself (refreshed with its heartbeat).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeInfo {
    /// Stable across restarts with the same data dir.
    pub id: String,
    /// Where its node RPC listens (`http://host:port`).
    pub rpc_url: String,
    /// The sandbox ingress (a `vmon proxy`) on the node's host, when one runs there: a proxy
    /// elsewhere forwards this node's sandbox traffic to it.
    #[serde(default)]
    pub ingress_url: Option<String>,
    /// The host it runs on (its hostname unless configured): proxies on the same host reach
    /// its guests directly.
    pub host: String,
    /// `kvm` or `tcg`.
    pub accel: String,
    /// QEMU's version string: a memory restore needs the same QEMU as the build's.
    pub qemu_version: String,
    /// The host CPU's model name (the guest CPU model is fixed; under KVM a restore needs the
    /// same features).
    pub cpu_baseline: String,
    /// Host CPUs and memory.
    pub vcpus: u32,
    pub memory_mb: u64,
    /// Memory available for new guests now (MemAvailable).
    pub free_memory_mb: u64,
    /// Free space on the data dir's filesystem.
    pub free_disk_mb: u64,
    /// Network slots left.
    pub free_slots: u32,
    /// Sandboxes running now.
    pub running: u32,
    /// Unix seconds of this heartbeat.
    pub updated_unix: u64,
    /// GPUs bound to `vfio-pci` and how many are free (none on a node without them, or
    /// one of an older version).
    #[serde(default)]
    pub gpus: crate::gpu::GpuInventory,
}

impl NodeInfo {
    /// Load used for placement: running sandboxes per host CPU, then free memory.
    pub fn load(&self) -> f64 {
        f64::from(self.running) / f64::from(self.vcpus.max(1))
    }

    /// Whether a build made on `origin` can be restored with its memory here.
    pub fn restores_from(&self, origin: &BuildOrigin) -> bool {
        self.accel == origin.accel
            && self.qemu_version == origin.qemu_version
            && (self.accel == "tcg" || self.cpu_baseline == origin.cpu_baseline)
    }
}

/// Where a build was made: what a memory restore of it needs of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildOrigin {
    pub node_id: String,
    pub accel: String,
    pub qemu_version: String,
    pub cpu_baseline: String,
}

impl BuildOrigin {
    pub fn of(node: &NodeInfo) -> BuildOrigin {
        BuildOrigin {
            node_id: node.id.clone(),
            accel: node.accel.clone(),
            qemu_version: node.qemu_version.clone(),
            cpu_baseline: node.cpu_baseline.clone(),
        }
    }
}

/// The KV prefix of nodes that take no new work (`drain/<id>`).
pub const DRAIN_PREFIX: &str = "drain/";

/// A live migration that happened.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Migrated {
    pub from: String,
    pub to: String,
    /// The sandbox on its new node (its guest address there).
    pub running: Running,
    pub stats: MigrateStats,
    /// Source stop to target start, as the control plane saw it (ms).
    pub switch_ms: u64,
    /// The whole move (ms).
    pub total_ms: u64,
}

/// The control plane's view of the members, beside the [`crate::node::NodeControl`] calls
/// that a cluster routes to the right member.
#[async_trait::async_trait]
pub trait Cluster: Send + Sync + 'static {
    /// The nodes whose registration is alive now.
    async fn members(&self) -> Vec<NodeInfo>;
    /// The node a sandbox was last started on, if the cluster knows it.
    async fn placement(&self, sandbox_id: &str) -> Option<String>;
    /// What one node runs; an error when it does not answer.
    async fn running_on(&self, node_id: &str) -> Result<Vec<Running>, NodeError>;
    /// Forgets where a sandbox ran (it was reported killed).
    async fn forget(&self, sandbox_id: &str);
    /// Kills a VM on one node, whatever the placement says (a stray no record names).
    async fn kill_on(
        &self,
        node_id: &str,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<(), NodeError>;
    /// The node a sandbox runs on and its guest address there, read at once (the address
    /// changes with a live migration; `None` for placements written before it was kept).
    async fn location(&self, sandbox_id: &str) -> Option<(String, Option<std::net::IpAddr>)>;
    /// Live-migrates a running sandbox to `target` (or the best other node that can take
    /// it). On error the sandbox runs where it ran, unchanged.
    async fn migrate(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        target: Option<&str>,
        downtime_ms: u64,
    ) -> Result<Migrated, NodeError>;
    /// Marks a node as taking no new work (draining), or as taking it again.
    async fn set_draining(&self, node_id: &str, draining: bool) -> Result<(), NodeError>;
    /// The nodes marked draining.
    async fn draining(&self) -> Vec<String>;
    /// Has a node other than `away_from` hold `build_id` (fetched from the object store), so
    /// that a paused sandbox resumes elsewhere; returns that node.
    async fn rehome(&self, build_id: &str, away_from: &str) -> Result<String, NodeError>;
}
