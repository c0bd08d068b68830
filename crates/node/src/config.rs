//! The settings of one node ([`NodeConfig`]) and their defaults, some taken from the
//! environment.

use std::path::PathBuf;
use std::time::Duration;

use vmon_vm::Accel;

/// The system's QEMU (Debian's `qemu-system-x86`).
pub const DEFAULT_QEMU: &str = "/usr/bin/qemu-system-x86_64";

/// Settings of one node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// Force an accelerator instead of probing.
    pub accel: Option<Accel>,
    /// The QEMU system emulator (`VMON_QEMU`, default [`DEFAULT_QEMU`]): a binary or a
    /// wrapper such as the one `scripts/install-qemu.sh` writes. Its version must be one
    /// [`vmon_vm::qemu_version::SUPPORTED`] names.
    pub qemu_binary: PathBuf,
    /// The envd binary baked into the image (default: `envd` beside the running binary).
    pub envd_binary: Option<PathBuf>,
    /// Pre-spawned restore processes kept per hot build.
    pub pool_size: usize,
    /// Blank restore processes (spawned, no disk, no state) kept per RAM base in use, for
    /// resumes and fork children.
    pub blank_pool_size: usize,
    /// The most restore processes one pool key grows to under demand (`VMON_POOL_MAX`; never
    /// below its base size). 0 or 1 keeps every pool at its base size.
    pub pool_max: usize,
    /// Pools grow above their base size only while the host has this much memory available
    /// (`VMON_POOL_MIN_AVAILABLE_MB`).
    pub pool_min_available_mb: u64,
    /// How long a refill runs at background CPU weight after it starts, even when it brings
    /// its key back to its base, so the sandbox whose claim started it has the CPU for its
    /// first commands (`VMON_POOL_YIELD_MS`, default 1000; 0: such a refill runs at the normal
    /// weight from its start).
    pub pool_yield: Duration,
    /// Network slots kept ready ahead of time.
    pub spare_slots: usize,
    /// How long a cold boot may take to reach envd.
    pub boot_timeout: Duration,
    /// A cold-booted guest that has not written its disk this long after its start (it writes
    /// as its root is mounted, seconds into a boot) is stuck: it is started again once
    /// (`VMON_BOOT_STALL_SECS`).
    pub boot_stall_after: Duration,
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
    /// Work that writes builds (template builds, pauses, snapshots, forks) is refused while the
    /// data dir's disk has less free space than this (`VMON_MIN_FREE_MB`), so a full disk never
    /// half-writes a build.
    pub min_free_mb: u64,
    /// Where the guest image build reports its steps (`vmon up` shows them and the api answers
    /// with them while the first build runs).
    pub progress: Option<vmon_proto::progress::Progress>,
    /// Where volumes keep their files, `<dir>/<volumeID>` (`VMON_VOLUMES_DIR`, default
    /// `<data dir>/volumes`): the api's content plane writes the same directories.
    pub volumes_dir: PathBuf,
    /// The virtio-fs daemon (`VMON_VIRTIOFSD`; QEMU 7.2's on Debian 12).
    pub virtiofsd: PathBuf,
    /// The S3-compatible store builds are uploaded to and fetched from (`VMON_S3_ENDPOINT`,
    /// `VMON_S3_BUCKET`, `VMON_S3_REGION`, `VMON_S3_ACCESS_KEY_ID`,
    /// `VMON_S3_SECRET_ACCESS_KEY`, `VMON_S3_PREFIX`); `None`: builds stay on this node.
    pub object_store: Option<vmon_objstore::ObjectStoreConfig>,
    /// How much of the data dir builds fetched from the store may take (`VMON_STORE_CACHE_MB`,
    /// default 20 GiB): beyond it the least recently used ones no sandbox runs from go.
    pub store_cache_mb: u64,
    /// Extra CA certificates (PEM) the egress proxy trusts besides the system's when it
    /// connects to a rule's host for secret injection (`VMON_EGRESS_CA_FILE`).
    pub egress_ca_file: Option<PathBuf>,
    /// QEMUs run unprivileged: slot `n` of block `b` as uid `base + b * 512 + n`, all in group
    /// `base` (`VMON_QEMU_UID_BASE`, default 1900000000; 0 runs them as root, for debugging
    /// only). No account needs to exist for these ids.
    pub qemu_uid_base: Option<u32>,
    /// Ranges inside the private and shared networks (10/8, 100.64/10, 172.16/12, 192.0.0/24,
    /// 192.168/16, 198.18/15) that a sandbox's `allowOut` may open (`VMON_PRIVATE_ALLOW`,
    /// comma-separated CIDRs; the api's `private_allow`). Empty: none; an `allowOut` entry
    /// inside one is refused.
    pub private_allow: Vec<String>,
    /// The cluster's own parts, as URLs, `host:port`s or addresses: no guest reaches their
    /// addresses, whatever `allowOut` and `private_allow` say. Gathered from the settings
    /// (etcd, the store URL, the object store, the node's, api's and proxy's addresses);
    /// `vmon up` and `vmon node` add the ones they use.
    pub cluster_endpoints: Vec<String>,
    /// Further addresses or CIDRs no guest reaches (`VMON_PROTECTED`, comma-separated): other
    /// nodes, a management network.
    pub protected: Vec<String>,
    /// The first host id of volumes' id ranges (`VMON_VOLUME_UID_BASE`, default 1000000000):
    /// volume `k` owns `base + k * 65536` and the 65,535 ids after it, 8,192 ranges in all
    /// (below the QEMUs' ids by default). No account needs to exist for these ids.
    pub volume_uid_base: u32,
    /// Where GPUs bound to `vfio-pci` and their IOMMU groups are discovered at open
    /// (`VMON_SYSFS_ROOT`, default `/sys`; tests point it at a tree they build).
    pub sysfs_root: PathBuf,
    /// Where the IOMMU groups' device nodes are (`VMON_VFIO_DEV_DIR`, default `/dev/vfio`).
    pub vfio_dev_dir: PathBuf,
    /// Test-only fault points of pauses, checkpoints and migrations (`vmon_faults`): armed in
    /// `VMON_FAULT_DIR`, off when it is unset.
    pub faults: vmon_faults::Faults,
}

impl NodeConfig {
    pub fn new(data_dir: PathBuf) -> NodeConfig {
        let volumes_dir = std::env::var_os("VMON_VOLUMES_DIR")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| data_dir.join("volumes"));
        NodeConfig {
            data_dir,
            accel: None,
            qemu_binary: std::env::var_os("VMON_QEMU")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_QEMU)),
            envd_binary: None,
            pool_size: 1,
            blank_pool_size: env_or("VMON_BLANK_POOL", 4),
            pool_max: env_or("VMON_POOL_MAX", 8),
            pool_min_available_mb: env_or("VMON_POOL_MIN_AVAILABLE_MB", 2048),
            pool_yield: Duration::from_millis(env_or("VMON_POOL_YIELD_MS", 1000)),
            spare_slots: 2,
            boot_timeout: Duration::from_secs(240),
            boot_stall_after: Duration::from_secs(env_or("VMON_BOOT_STALL_SECS", 60)),
            restore_timeout: Duration::from_secs(60),
            slot_block: None,
            park_max: env_or("VMON_PARK_MAX", 4),
            park_linger: Duration::from_secs(env_or("VMON_PARK_SECS", 300)),
            min_free_mb: env_or("VMON_MIN_FREE_MB", 1024),
            progress: None,
            volumes_dir,
            virtiofsd: std::env::var_os("VMON_VIRTIOFSD")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/usr/lib/qemu/virtiofsd")),
            // A partial setting is reported by `Node::open`.
            object_store: vmon_objstore::ObjectStoreConfig::from_env().ok().flatten(),
            store_cache_mb: env_or("VMON_STORE_CACHE_MB", 20 << 10),
            egress_ca_file: std::env::var_os("VMON_EGRESS_CA_FILE")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            qemu_uid_base: match env_or("VMON_QEMU_UID_BASE", DEFAULT_QEMU_UID_BASE) {
                0 => None,
                b => Some(b),
            },
            private_allow: env_list("VMON_PRIVATE_ALLOW"),
            cluster_endpoints: env_endpoints(),
            protected: env_list("VMON_PROTECTED"),
            volume_uid_base: match env_or("VMON_VOLUME_UID_BASE", DEFAULT_VOLUME_UID_BASE) {
                // Ranges start above the guest ids themselves (a base below would read as none).
                b if b < vmon_proto::node::volume_ids::VOLUME_IDS => DEFAULT_VOLUME_UID_BASE,
                b => b,
            },
            sysfs_root: std::env::var_os("VMON_SYSFS_ROOT")
                .filter(|v| !v.is_empty())
                .map_or_else(|| PathBuf::from("/sys"), PathBuf::from),
            vfio_dev_dir: std::env::var_os("VMON_VFIO_DEV_DIR")
                .filter(|v| !v.is_empty())
                .map_or_else(|| PathBuf::from("/dev/vfio"), PathBuf::from),
            faults: vmon_faults::Faults::from_env(),
        }
    }
}

/// A comma-separated list from the environment (empty when unset).
pub(crate) fn env_list(name: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The cluster's endpoints the environment names (a guest reaches none of them).
fn env_endpoints() -> Vec<String> {
    let mut v = Vec::new();
    for name in [
        "VMON_ETCD_ENDPOINTS",
        "VMON_STORE_URL",
        "VMON_S3_ENDPOINT",
        "VMON_NODE_LISTEN",
        "VMON_NODE_ADVERTISE",
        "VMON_NODE_INGRESS",
        "VMON_API_LISTEN",
        "VMON_PROXY_LISTEN",
        "VMON_API_URL",
        "VMON_SANDBOX_URL",
    ] {
        v.extend(env_list(name));
    }
    v
}

/// Far above the ids distributions hand to accounts and to user namespaces' sub-id ranges.
pub const DEFAULT_QEMU_UID_BASE: u32 = 1_900_000_000;

/// Volumes' id ranges: 8,192 ranges of 65,536 ids end below [`DEFAULT_QEMU_UID_BASE`].
pub const DEFAULT_VOLUME_UID_BASE: u32 = 1_000_000_000;

/// A number from the environment, or `default` when unset or not a number.
pub(crate) fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Free space (MiB) on the filesystem holding `path`, when it can be read.
pub fn free_mb(path: &std::path::Path) -> Option<u64> {
    let st = rustix::fs::statvfs(path).ok()?;
    Some(st.f_bavail.saturating_mul(st.f_frsize) >> 20)
}

/// `Exhausted` (503 at the api) when `path`'s disk has less than `floor_mb` free.
pub fn check_free(
    path: &std::path::Path,
    floor_mb: u64,
) -> Result<(), vmon_proto::node::NodeError> {
    match free_mb(path) {
        Some(free) if free < floor_mb => Err(vmon_proto::node::NodeError::Exhausted(format!(
            "the node's data dir {} has {free} MiB free, below its floor of {floor_mb} MiB (min_free_mb); free space there first",
            path.display()
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_below_the_floor_refuses_work_with_a_clear_message() {
        let here = std::env::temp_dir();
        assert!(free_mb(&here).is_some());
        assert!(check_free(&here, 0).is_ok());
        match check_free(&here, u64::MAX) {
            Err(vmon_proto::node::NodeError::Exhausted(m)) => {
                assert!(m.contains("min_free_mb"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }
}
