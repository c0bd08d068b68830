//! Wire contracts shared between parts of vmon.
//!
//! `node` is the contract between the control plane (api, proxy) and a node: the api asks a
//! node to start, pause, fork and kill sandboxes through [`node::NodeControl`] and never sees
//! QEMU, slots or layer files. The envd message types live beside it.
//!
//! This crate holds types only: it must never do I/O.

pub mod addrs;
pub mod cluster;
pub mod egress;
pub mod gpu;
pub mod node;
pub mod progress;
pub mod ranges;
