//! One QEMU virtual machine: its pinned command line, a typed async QMP client, the accelerator
//! probe, memory layers (pagemap delta capture and write-in) and disk overlays.
//!
//! This crate knows nothing of teams, sandboxes' REST state or networking policy: it is handed
//! paths, a network namespace name and a machine description, and it runs QEMU. Everything it
//! starts it can also stop and clean up.

pub mod accel;
pub mod cgroup;
pub mod console;
pub mod disk;
pub mod machine;
pub mod memory;
pub mod private;
pub mod process;
pub mod qemu_version;
pub mod qmp;
pub mod ram_base;
pub mod ram_check;
pub mod user;
pub mod userns;
pub mod vfio;

pub use accel::{probe as probe_accel, Accel, AccelChoice};
pub use machine::{FsShare, MachineDesc, NetDevice};
pub use process::{LaunchSpec, Vm};
pub use qmp::{Qmp, QmpError};
pub use user::QemuUser;
