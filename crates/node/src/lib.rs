//! Sandboxes on one host: QEMU processes, network slots, disk overlays, memory layers, builds,
//! the restore pool, and the re-adoption of running VMs after a node restart.
//!
//! The node handles the calls of [`vmon_proto::node::NodeHandler`]; it never parses REST and knows nothing of
//! teams or API keys. Every sandbox's operations are serialized by its own lock, and every
//! state change that must survive a crash is written (fsynced) before it is acted on.

pub mod builds;
pub mod channel;
mod config;
pub mod envd_client;
pub mod gpus;
mod node;
mod pool;
pub mod rpc;
pub mod sandbox;
pub mod slots;
pub mod store;
mod tarball;
pub mod telemetry;
pub use vmon_nodeclient::tls;

pub use config::{free_mb, NodeConfig, DEFAULT_QEMU};
pub use node::{probe_qmp, Node, Peers, ENVD_VERSION};
pub use slots::BLOCKS as SLOT_BLOCKS;
