//! The settings of one node ([`NodeConfig`]) and their defaults, some taken from the
//! environment.

use std::path::PathBuf;
use std::time::Duration;

use vmon_vm::Accel;

/// Settings of one node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// Force an accelerator instead of probing.
    pub accel: Option<Accel>,
    pub qemu_binary: PathBuf,
    /// The envd binary baked into the image (default: `envd` beside the running binary).
    pub envd_binary: Option<PathBuf>,
    /// Pre-spawned restore processes kept per hot build.
    pub pool_size: usize,
    /// Blank restore processes (spawned, no disk, no state) kept per RAM base in use, for
    /// resumes and fork children.
    pub blank_pool_size: usize,
    /// Network slots kept ready ahead of time.
    pub spare_slots: usize,
    /// How long a cold boot may take to reach envd.
    pub boot_timeout: Duration,
    /// How long a restored guest may take to answer `/init`.
    pub restore_timeout: Duration,
    /// Which block of slot addresses and namespace names this node owns (several nodes may
    /// share a host). Default: derived from the data dir.
    pub slot_block: Option<u32>,
    /// Paused sandboxes whose stopped QEMU is kept for a fast resume (0: every pause ends its
    /// QEMU at once). Their pause is committed like any other: a parked process is a cache.
    pub park_max: usize,
    /// How long a parked QEMU is kept.
    pub park_linger: Duration,
}

impl NodeConfig {
    pub fn new(data_dir: PathBuf) -> NodeConfig {
        NodeConfig {
            data_dir,
            accel: None,
            qemu_binary: PathBuf::from("/usr/bin/qemu-system-x86_64"),
            envd_binary: None,
            pool_size: 1,
            blank_pool_size: env_or("VMON_BLANK_POOL", 4),
            spare_slots: 2,
            boot_timeout: Duration::from_secs(240),
            restore_timeout: Duration::from_secs(60),
            slot_block: None,
            park_max: env_or("VMON_PARK_MAX", 4),
            park_linger: Duration::from_secs(env_or("VMON_PARK_SECS", 300)),
        }
    }
}

/// A number from the environment, or `default` when unset or not a number.
pub(crate) fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}
