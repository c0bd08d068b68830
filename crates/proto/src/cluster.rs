//! The cluster contract: what a node says about itself in the registry, and what the control
//! plane may ask of a set of nodes beyond [`crate::node::NodeControl`].
//!
//! A node writes its [`NodeInfo`] under `nodes/<id>` in the KV with a lease it keeps alive;
//! when the lease ends the node is gone. The api's view of the members ([`Cluster`]) tells the
//! leader which nodes are alive, where each sandbox runs and what each node runs, so it can
//! report the sandboxes of a dead node killed (`orphaned`) and kill VMs no record names.

use serde::{Deserialize, Serialize};

use crate::node::{NodeError, Running};

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
}
