//! vmon-cluster: many nodes behind one control plane (DESIGN §7).
//!
//! * [`registry`]: a node registers itself under `nodes/<id>` in the KV (etcd in a cluster)
//!   with a lease and a heartbeat; when the lease ends the node is gone.
//! * [`ClusterNodes`]: the node contract ([`vmon_proto::node::NodeControl`]) over every
//!   registered node, so the api's state machine is the same on one node and on many. Starts
//!   are placed ([`placement`]); every other call goes to the node that runs the sandbox or
//!   holds the build. It also implements [`vmon_proto::cluster::Cluster`], the leader's view
//!   for reporting a dead node's sandboxes killed.
//! * [`fence`]: a node that cannot show its lease takes no new work, and past the grace
//!   stops its VMs and writes nothing, before the cluster reports its sandboxes killed.

pub mod fence;
pub mod nodes;
pub mod placement;
mod reach;
pub mod registry;

pub use nodes::ClusterNodes;
