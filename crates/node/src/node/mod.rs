//! The node: sandboxes' lifecycles on top of `vmon_vm`, slots and builds.
//!
//! This file holds the [`Node`] itself (its state, `open`, the sandbox table and the small
//! helpers every room uses). The rest lives in rooms, each an `impl Node` block of one concern:
//! `boot` (cold boots), `restore` (restores, write-in, warm-up, starting a sandbox), `pools`
//! (the restore pool's glue), `parking` (stopped QEMUs kept for fast resumes), `capture`
//! (pause, checkpoint, memory layers), `template` (template builds and deleting builds),
//! `recovery` (re-adoption after a restart, reaping, the sweep), `volumes` (the virtio-fs
//! daemons of mounted volumes), `confine` (the unprivileged user each QEMU runs as, the files
//! handed to it, sealed RAM bases) and `control` (the
//! [`NodeHandler`](vmon_proto::node::NodeHandler) impl, thin calls into those).

mod boot;
mod bucket;
mod capture;
mod confine;
mod control;
mod egress;
mod layer;
mod migrate;
mod migrate_check;
mod parking;
mod pools;
mod recovery;
mod remote;
mod restore;
mod template;
mod volume_owner;
mod volume_store;
mod volumes;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::sync::{Mutex, RwLock};
use vmon_proto::node::{BuildInfo, NodeError, Running, StartSpec};
use vmon_vm::{AccelChoice, MachineDesc};

use crate::builds::{BuildRecord, Builds};
use crate::config::{env_or, NodeConfig};
use crate::envd_client::{self, InitRequest, ENVD_PORT};
use crate::pool::Pool;
use crate::sandbox::{Live, RamSource, SandboxState};
use crate::slots::Slots;

pub use migrate::Peers;
use parking::Parked;

/// The envd feature level our guest agent implements (the SDK gates features on it).
pub const ENVD_VERSION: &str = "0.6.4";

/// QMP commands the snapshot recipe cannot do without.
const REQUIRED_QMP: &[&str] = &[
    "xen-save-devices-state",
    "migrate-incoming",
    "blockdev-snapshot-sync",
    "stop",
    "cont",
    "query-migrate",
];

/// One host's sandboxes.
pub struct Node {
    cfg: NodeConfig,
    accel: AccelChoice,
    /// The QEMU this node runs (a supported release, see [`vmon_vm::qemu_version`]); builds
    /// record its `--version` line and restore only under the same one.
    qemu: vmon_vm::qemu_version::QemuVersion,
    /// What the guest image is made from; the image itself is built once, in the background
    /// from `open` on, and whatever needs it waits (see [`Node::image`]).
    recipe: vmon_image::Recipe,
    image: tokio::sync::OnceCell<vmon_image::Image>,
    builds: Builds,
    slots: Arc<Slots>,
    sandboxes: std::sync::Mutex<HashMap<String, Arc<Mutex<Live>>>>,
    pool: Pool,
    /// Held (shared) by every operation that creates artifacts not yet named by a record;
    /// held exclusively by the sweep.
    artifacts_guard: RwLock<()>,
    /// Overlays of pool processes being made, which nothing else names yet (kept by the sweep).
    held_artifacts: crate::pool::HeldArtifacts,
    /// Restores in their CPU-heavy part (spawn, write-in, load, the guest's first answers) at
    /// once: one per host core. Under TCG a restored guest translates its hot paths anew, and
    /// ten of them sharing two cores finish later than ten taking turns.
    restore_gate: tokio::sync::Semaphore,
    /// Restores waiting for a turn or holding one.
    restores_in_flight: std::sync::atomic::AtomicUsize,
    /// Cold boots started again after their first QEMU made no progress (see `boot.rs`).
    boot_restarts: std::sync::atomic::AtomicU64,
    /// Sandboxes started, by where their QEMU came from (see [`Node::starts_by_origin`]).
    starts: std::sync::Mutex<HashMap<&'static str, u64>>,
    /// The machine of each RAM base that blank processes are kept for.
    blank_machines: std::sync::Mutex<HashMap<String, MachineDesc>>,
    /// Paused sandboxes with their QEMU kept stopped, by paused build.
    parked: std::sync::Mutex<HashMap<String, Parked>>,
    host_memory_mb: u64,
    telemetry: crate::telemetry::Telemetry,
    me: std::sync::Weak<Node>,
    /// The cluster's object store, when configured (see [`crate::store`]).
    store: Option<Arc<crate::store::Store>>,
    /// Fetches from the store in progress, by build: concurrent starts of one build share one.
    fetches: std::sync::Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Builds whose upload to the object store is queued or under way.
    uploads: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Targets of live migrations waiting for their guest, by migration id.
    incoming: std::sync::Mutex<HashMap<String, Arc<migrate::Incoming>>>,
    /// Sources whose QEMU handed over and waits for the control plane's finish or abort.
    handed_over: std::sync::Mutex<migrate::HandedOver>,
    /// How this node reaches other nodes (set in a cluster).
    peers: std::sync::OnceLock<Peers>,
    /// The egress proxy of secret injection, and the listener of each sandbox with rules.
    egress: egress::EgressRoom,
    /// Sealed copies of the RAM bases restores map.
    ram_bases: confine::RamBases,
    /// GPUs for passthrough and which sandbox holds each.
    gpus: crate::gpus::Gpus,
    /// Held for the node's life: no other node on this host may use the same slot block.
    _block_lock: std::fs::File,
    /// Held for the node's life: one node per data dir (another would sweep our artifacts).
    _data_lock: std::fs::File,
}

fn err(e: anyhow::Error) -> NodeError {
    NodeError::Failed(format!("{e:#}"))
}

fn valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Fields of `/proc/meminfo` (KiB), in the order asked; None where missing.
fn meminfo_kib<const N: usize>(fields: [&str; N]) -> [Option<u64>; N] {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    fields.map(|name| {
        text.lines()
            .find(|l| l.split(':').next() == Some(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse().ok())
    })
}

fn host_memory_mb() -> u64 {
    let [total] = meminfo_kib(["MemTotal"]);
    total.map(|kb| kb / 1024).unwrap_or(0)
}

/// How long a node start waits for the data dir's lock: a node that just died may have left a
/// forked child that shares the lock's open file until it execs.
const DATA_LOCK_WAIT: Duration = Duration::from_secs(10);

/// One node per data dir: `flock` on `<data>/node.lock`, failing when another still holds it
/// after [`DATA_LOCK_WAIT`].
fn lock_data_dir(data_dir: &Path) -> anyhow::Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(data_dir.join("node.lock"))?;
    let start = std::time::Instant::now();
    // std's file locks are flock(2) on Linux (what `lock_holders` reads in /proc/locks).
    let take = || f.try_lock().is_ok();
    let mut locked = take();
    while !locked && start.elapsed() < DATA_LOCK_WAIT {
        std::thread::sleep(Duration::from_millis(100));
        locked = take();
    }
    if !locked {
        bail!(
            "another vmon node is running on {} (one node per data dir){}",
            data_dir.display(),
            lock_holders(&f)
        );
    }
    Ok(f)
}

/// `: held by pid N (cmdline)` for each process `/proc/locks` names as holding a lock on
/// the file `f` is open on, or nothing when none can be found.
fn lock_holders(f: &std::fs::File) -> String {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = f.metadata() else {
        return String::new();
    };
    let ino = meta.ino().to_string();
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let holders: Vec<String> = locks
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            // `1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF`
            let dev_ino = fields.iter().find(|f| f.matches(':').count() == 2)?;
            if dev_ino.rsplit(':').next() != Some(ino.as_str()) {
                return None;
            }
            let pid = fields.get(fields.iter().position(|f| f == dev_ino)? - 1)?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .unwrap_or_default();
            Some(format!("pid {pid} ({})", cmd.trim()))
        })
        .collect();
    if holders.is_empty() {
        String::new()
    } else {
        format!(": held by {}", holders.join(", "))
    }
}

/// Takes the host-wide lock of slot block `b` if no live node holds it.
fn try_lock_block(b: u32) -> anyhow::Result<Option<std::fs::File>> {
    let lock_dir = Path::new("/run/vmon");
    std::fs::create_dir_all(lock_dir)?;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_dir.join(format!("slots-{b}.lock")))?;
    let locked = f.try_lock().is_ok();
    Ok(locked.then_some(f))
}

/// Picks this node's slot block and locks it host-wide (`flock` on `/run/vmon`), so two nodes
/// never hand out the same namespaces and addresses. The block is remembered in the data dir,
/// so a restarted node finds its sandboxes' slots again.
fn claim_slot_block(cfg: &NodeConfig) -> anyhow::Result<(u32, std::fs::File)> {
    let lock_dir = Path::new("/run/vmon");
    std::fs::create_dir_all(lock_dir)?;
    let remembered = cfg.data_dir.join("slot-block");
    let try_lock = try_lock_block;
    if let Some(b) = cfg.slot_block {
        let b = b % crate::slots::BLOCKS;
        return match try_lock(b)? {
            Some(f) => {
                std::fs::write(&remembered, b.to_string())?;
                Ok((b, f))
            }
            None => bail!("slot block {b} is in use by another vmon node on this host"),
        };
    }
    if let Some(b) = std::fs::read_to_string(&remembered)
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
    {
        if let Some(f) = try_lock(b % crate::slots::BLOCKS)? {
            return Ok((b % crate::slots::BLOCKS, f));
        }
        // Another node holds it now (and has reclaimed whatever we left there).
        tracing::warn!(block = b, "remembered slot block is taken by another node");
    }
    let canon = std::fs::canonicalize(&cfg.data_dir).unwrap_or_else(|_| cfg.data_dir.clone());
    let start = (xxhash_rust::xxh3::xxh3_64(canon.as_os_str().as_encoded_bytes())
        % u64::from(crate::slots::BLOCKS)) as u32;
    for i in 0..crate::slots::BLOCKS {
        let b = (start + i) % crate::slots::BLOCKS;
        if let Some(f) = try_lock(b)? {
            std::fs::write(&remembered, b.to_string())?;
            return Ok((b, f));
        }
    }
    bail!(
        "all {} slot blocks on this host are taken by other vmon nodes",
        crate::slots::BLOCKS
    )
}

/// The `/init` after restoring `rec` for `spec`: its settings, authenticated with the token the
/// guest holds from the build.
/// The operator's side of every slot: `private_allow`, and the protected addresses gathered
/// from the configuration (the cluster's endpoints resolved now, the host's own addresses,
/// the operator's list).
async fn perimeter(cfg: &NodeConfig) -> anyhow::Result<crate::slots::Perimeter> {
    use vmon_proto::ranges::check_ranges;
    check_ranges(&cfg.private_allow).map_err(|e| anyhow::anyhow!("private_allow: {e}"))?;
    check_ranges(&cfg.protected).map_err(|e| anyhow::anyhow!("protected: {e}"))?;
    let mut endpoints = cfg.cluster_endpoints.clone();
    if let Some(s3) = &cfg.object_store {
        endpoints.push(s3.endpoint.clone());
    }
    crate::slots::Perimeter::gather(cfg.private_allow.clone(), &endpoints, &cfg.protected).await
}

fn restore_init(spec: &StartSpec, rec: &BuildRecord) -> InitRequest {
    InitRequest {
        env_vars: spec.env_vars.clone(),
        access_token: spec.envd_access_token.clone(),
        current_token: rec.envd_token.clone(),
        default_user: None,
        volume_mounts: Vec::new(),
    }
}

/// [`probe_qmp`] up to three times while it times out: on a loaded host a fresh QEMU can
/// miss the QMP deadline, and a node that then fails to start (a restart after a crash) leaves
/// its surviving sandboxes unserved. A probe that answers is never retried.
async fn probe_qmp_patiently(qemu: &Path, dir: &Path) -> anyhow::Result<()> {
    let mut attempt = 1;
    loop {
        match probe_qmp(qemu, dir).await {
            Err(e)
                if attempt < 3
                    && matches!(
                        e.downcast_ref::<vmon_vm::QmpError>(),
                        Some(vmon_vm::QmpError::Timeout(_))
                    ) =>
            {
                tracing::warn!(attempt, error = %e, "the QMP probe timed out (a loaded host?); probing again");
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// Checks that `qemu` offers what snapshots need, with a throwaway machine-less process.
pub async fn probe_qmp(qemu: &Path, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let sock = dir.join("probe.sock");
    let _ = std::fs::remove_file(&sock);
    let mut child = tokio::process::Command::new(qemu)
        .args([
            "-machine",
            "none",
            "-nodefaults",
            "-display",
            "none",
            "-qmp",
        ])
        .arg(format!("unix:{},server=on,wait=off", sock.display()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", qemu.display()))?;
    let result = async {
        let qmp = vmon_vm::Qmp::connect(&sock, Duration::from_secs(10)).await?;
        let cmds: HashSet<String> = qmp.query_commands().await?.into_iter().collect();
        let missing: Vec<&str> = REQUIRED_QMP
            .iter()
            .copied()
            .filter(|c| !cmds.contains(*c))
            .collect();
        if !missing.is_empty() {
            bail!(
                "{} lacks the QMP commands {} that snapshots need",
                qemu.display(),
                missing.join(", ")
            );
        }
        anyhow::Ok(())
    }
    .await;
    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = std::fs::remove_file(&sock);
    result
}

/// The guest image's recipe for this host, with the envd binary it bakes in (`envd` beside
/// the running binary unless the config names one); fails here, not in the background, when
/// envd is missing.
fn guest_recipe(cfg: &NodeConfig) -> anyhow::Result<vmon_image::Recipe> {
    let envd = match &cfg.envd_binary {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("envd"),
    };
    let recipe = vmon_image::Recipe::for_host(envd)?;
    recipe.hash()?;
    Ok(recipe)
}

/// The object store builds travel through, when one is configured; a partial setting fails
/// rather than run without the store.
fn object_store(cfg: &NodeConfig) -> anyhow::Result<Option<Arc<crate::store::Store>>> {
    match &cfg.object_store {
        Some(c) => Ok(Some(Arc::new(crate::store::Store::open(
            c.clone(),
            &cfg.data_dir,
        )?))),
        None => {
            vmon_objstore::ObjectStoreConfig::from_env()?;
            Ok(None)
        }
    }
}

impl Node {
    /// Opens the node: probes the host, re-adopts sandboxes that survived a restart and cleans
    /// up what a crash left, and starts finding or building the guest image in the background
    /// (reporting to `cfg.progress`); boots and template builds wait for it.
    pub async fn open(cfg: NodeConfig) -> anyhow::Result<Arc<Node>> {
        std::fs::create_dir_all(&cfg.data_dir)?;
        let dir = cfg.data_dir.clone();
        let data_lock = tokio::task::spawn_blocking(move || lock_data_dir(&dir)).await??;
        let accel = vmon_vm::probe_accel(cfg.accel).map_err(|e| anyhow::anyhow!(e))?;
        tracing::info!(accel = accel.accel.as_str(), reason = %accel.reason, "accelerator");
        let qemu = vmon_vm::qemu_version::require_supported(&cfg.qemu_binary)?;
        tracing::info!(qemu = %qemu, binary = %cfg.qemu_binary.display(), "QEMU");
        probe_qmp_patiently(&cfg.qemu_binary, &cfg.data_dir.join("run")).await?;
        let recipe = guest_recipe(&cfg)?;
        let builds = Builds::open(&cfg.data_dir)?.sealing_for(cfg.qemu_uid_base);
        let store = object_store(&cfg)?;
        let egress_room = egress::EgressRoom::open(&cfg)?;
        let perimeter = perimeter(&cfg).await?;
        tracing::info!(private_allow = ?perimeter.private_allow, protected = ?perimeter.protected, "guest network perimeter");
        Slots::prepare_host(&perimeter).await?;
        let (slot_block, block_lock) = claim_slot_block(&cfg)?;
        tracing::info!(slot_block, "network slot block");
        let qemu_ids = cfg.qemu_uid_base;
        let gpus = crate::gpus::Gpus::discover(&cfg.sysfs_root, &cfg.vfio_dev_dir);
        let node = Arc::new_cyclic(|me| Node {
            me: me.clone(),
            pool: Pool::new(
                cfg.pool_size,
                cfg.blank_pool_size,
                cfg.pool_max,
                cfg.pool_min_available_mb,
            )
            .with_yield(cfg.pool_yield),
            cfg,
            accel,
            qemu,
            recipe,
            image: tokio::sync::OnceCell::new(),
            builds,
            slots: Arc::new(Slots::new(slot_block, qemu_ids, perimeter)),
            sandboxes: std::sync::Mutex::new(HashMap::new()),
            artifacts_guard: RwLock::new(()),
            held_artifacts: Default::default(),
            restore_gate: tokio::sync::Semaphore::new(env_or(
                "VMON_RESTORE_TURNS",
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            parked: Default::default(),
            restores_in_flight: Default::default(),
            boot_restarts: Default::default(),
            starts: Default::default(),
            blank_machines: Default::default(),
            host_memory_mb: host_memory_mb(),
            telemetry: Default::default(),
            store,
            fetches: Default::default(),
            uploads: Default::default(),
            incoming: Default::default(),
            handed_over: Default::default(),
            peers: Default::default(),
            egress: egress_room,
            ram_bases: Default::default(),
            gpus,
            _block_lock: block_lock,
            _data_lock: data_lock,
        });
        node.open_paths_to_qemu()?;
        node.recover().await?;
        node.sweep_bucket_caches().await;
        node.upload_unstored();
        if node.store.is_some() {
            let weak = Arc::downgrade(&node);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(remote::UNSTORED_SWEEP).await;
                    let Some(node) = weak.upgrade() else { break };
                    node.upload_unstored();
                }
            });
        }
        node.slots.set_spares(node.cfg.spare_slots);
        node.slots.refill();
        node.start_background_work();
        Ok(node)
    }

    /// What the node does on its own once open: telemetry, volume syncs (object-store
    /// volumes and read-write bucket mounts), the guest image found or built, and every 5 s parked QEMUs evicted and the
    /// pools trimmed. Each task ends when the node is dropped.
    fn start_background_work(self: &Arc<Self>) {
        crate::telemetry::spawn(Arc::downgrade(self));
        self.spawn_volume_sync(Duration::from_secs(
            env_or("VMON_VOLUME_SYNC_SECS", 60u64).max(1),
        ));
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let Some(node) = weak.upgrade() else { return };
            if let Err(e) = node.image().await {
                tracing::warn!(error = %e, "building the guest image failed; the next boot retries");
            }
        });
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let Some(node) = weak.upgrade() else { break };
                node.evict_parked(false).await;
                node.trim_pool().await;
            }
        });
    }

    /// The GPUs this node passes through, and how many are free.
    pub fn gpu_inventory(&self) -> vmon_proto::gpu::GpuInventory {
        self.gpus.inventory()
    }

    /// The QEMU process of a running sandbox.
    pub async fn qemu_pid(&self, sandbox_id: &str) -> Option<u32> {
        let live = self.live(sandbox_id).ok()?;
        let l = live.lock().await;
        l.vm.as_ref().map(|v| v.pid)
    }

    /// The block of slot addresses this node owns.
    pub fn slot_block(&self) -> u32 {
        self.slots.block()
    }

    pub fn accel(&self) -> &AccelChoice {
        &self.accel
    }

    /// The `--version` line of this node's QEMU (what builds record).
    pub fn qemu_version(&self) -> &str {
        &self.qemu.line
    }

    /// This node's QEMU release.
    pub fn qemu(&self) -> &vmon_vm::qemu_version::QemuVersion {
        &self.qemu
    }

    /// The guest image: the cached one, or built now (one build at a time; a caller that
    /// arrives meanwhile waits for it, and a failed build is tried again by the next caller).
    pub async fn image(&self) -> Result<&vmon_image::Image, NodeError> {
        self.image
            .get_or_try_init(|| async {
                let progress = self.cfg.progress.as_ref();
                let image = vmon_image::build_with(&self.cfg.data_dir, &self.recipe, progress)
                    .await
                    .context("building the guest image")?;
                // What a first start does next (a ready progress ignores this).
                if let Some(p) = progress {
                    p.step("template VM");
                    p.update("booting the template VM and snapshotting it", None);
                }
                anyhow::Ok(image)
            })
            .await
            .map_err(err)
    }

    pub fn data_dir(&self) -> &Path {
        &self.cfg.data_dir
    }

    fn sandbox_root(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("sandboxes").join(id)
    }

    /// The console logs of a sandbox, oldest execution first.
    pub fn console_logs(&self, sandbox_id: &str) -> Vec<PathBuf> {
        if !valid_id(sandbox_id) {
            return Vec::new();
        }
        let mut v: Vec<(std::time::SystemTime, PathBuf)> =
            std::fs::read_dir(self.sandbox_root(sandbox_id))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    let p = e.path().join("console.log");
                    let t = std::fs::metadata(e.path())
                        .and_then(|m| m.created().or(m.modified()))
                        .ok()?;
                    p.is_file().then_some((t, p))
                })
                .collect();
        v.sort();
        v.into_iter().map(|(_, p)| p).collect()
    }

    fn record(&self, id: &str) -> Result<BuildRecord, NodeError> {
        match self.builds.get(id) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(NodeError::BuildNotFound(id.to_string())),
            Err(e) => Err(err(e)),
        }
    }

    fn info(rec: &BuildRecord) -> BuildInfo {
        BuildInfo {
            build_id: rec.id.clone(),
            has_memory: rec.has_memory(),
            vcpus: rec.machine.vcpus,
            memory_mb: rec.machine.memory_mb,
            disk_mb: rec.disk_mb,
            envd_version: rec.envd_version.clone(),
            parent: rec.parent.clone(),
            older_image: false,
            stored: false,
        }
    }

    /// A running sandbox, locked, if it is still in run `execution_id`.
    async fn live_execution(
        &self,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<tokio::sync::OwnedMutexGuard<Live>, NodeError> {
        let l = self.live(sandbox_id)?.lock_owned().await;
        if l.state.execution_id != execution_id {
            return Err(NodeError::NotFound(format!(
                "{sandbox_id} (execution {execution_id})"
            )));
        }
        Ok(l)
    }

    fn live(&self, sandbox_id: &str) -> Result<Arc<Mutex<Live>>, NodeError> {
        self.sandboxes
            .lock()
            .map_err(|_| NodeError::Failed("sandbox table poisoned".into()))?
            .get(sandbox_id)
            .cloned()
            .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))
    }

    fn running(l: &Live) -> Running {
        Running {
            sandbox_id: l.state.id.clone(),
            execution_id: l.state.execution_id.clone(),
            guest_ip: IpAddr::V4(l.slot.addr()),
            envd_version: l.state.envd_version.clone(),
            vcpus: l.state.machine.vcpus,
            memory_mb: l.state.machine.memory_mb,
            disk_mb: l.state.disk_mb,
            resume_generation: l.state.resume_generation,
            start_kind: l.state.start_kind,
        }
    }

    fn insert(&self, live: Live) -> Result<Running, NodeError> {
        let running = Self::running(&live);
        self.sandboxes
            .lock()
            .map_err(|_| NodeError::Failed("sandbox table poisoned".into()))?
            .insert(live.state.id.clone(), Arc::new(Mutex::new(live)));
        Ok(running)
    }

    fn remove(&self, sandbox_id: &str) {
        if let Ok(mut m) = self.sandboxes.lock() {
            m.remove(sandbox_id);
        }
    }

    /// Stops and forgets a live sandbox: QEMU, slot, its own artifacts.
    async fn destroy(&self, live: &mut Live, keep_artifacts: bool) {
        self.egress.stop(&live.state.id, None).await;
        if let Some(vm) = live.vm.take() {
            vm.quit().await;
        }
        vmon_vm::process::kill_recorded(&live.dir, &live.state.qemu_tag);
        let _ = self.slots.release(&live.slot).await;
        self.gpus.release(&live.state.id);
        if !keep_artifacts {
            let _ = std::fs::remove_file(self.builds.artifact(&live.state.overlay));
            if let RamSource::Shared { file } = &live.state.ram {
                let _ = std::fs::remove_file(self.builds.artifact(file));
            }
        }
        let _ = std::fs::remove_file(SandboxState::path(&live.dir));
        vmon_vm::process::clear_files(&live.dir);
    }

    /// Runs a shell command in a sandbox as `user` (tests, template start commands).
    pub async fn exec(
        &self,
        sandbox_id: &str,
        user: &str,
        cmd: &str,
        timeout: Duration,
    ) -> anyhow::Result<envd_client::CommandOutput> {
        let live = self.live(sandbox_id).map_err(|e| anyhow::anyhow!(e))?;
        let (addr, token) = {
            let l = live.lock().await;
            (
                SocketAddr::new(IpAddr::V4(l.slot.addr()), ENVD_PORT),
                l.state.envd_token.clone(),
            )
        };
        envd_client::run(addr, token.as_deref(), user, cmd, timeout).await
    }

    /// Marks `groups` held by sandbox `sandbox_id` as a GPU sandbox's are (tests of the release
    /// paths on hosts without GPUs, where no QEMU can be given a device).
    pub fn hold_gpus(&self, sandbox_id: &str, groups: &[u32]) {
        self.gpus.hold(sandbox_id, groups);
    }

    /// Kills a sandbox's QEMU without telling it (tests of crash recovery).
    pub async fn crash_vm(&self, sandbox_id: &str) -> Result<u32, NodeError> {
        let live = self.live(sandbox_id)?;
        let mut l = live.lock().await;
        let pid = l.vm.as_ref().map(|v| v.pid).unwrap_or(0);
        vmon_vm::process::signal(pid, libc::SIGKILL);
        if let Some(vm) = l.vm.as_mut() {
            vm.wait_exit(Duration::from_secs(10)).await;
        }
        Ok(pid)
    }
}

impl crate::telemetry::Scraped for Node {
    /// Running sandboxes the telemetry scraper may sample now (busy ones wait a round).
    fn scrape_targets(&self) -> Vec<crate::telemetry::Target> {
        let Ok(map) = self.sandboxes.lock() else {
            return Vec::new();
        };
        map.values()
            .filter_map(|live| {
                let l = live.try_lock().ok()?;
                Some(crate::telemetry::Target {
                    sandbox_id: l.state.id.clone(),
                    envd: SocketAddr::new(IpAddr::V4(l.slot.addr()), ENVD_PORT),
                    token: l.state.envd_token.clone(),
                    console: l.vm.as_ref().map(|v| v.run_dir.join("console.log")),
                })
            })
            .collect()
    }

    fn data_dir(&self) -> &Path {
        &self.cfg.data_dir
    }

    fn telemetry(&self) -> &crate::telemetry::Telemetry {
        &self.telemetry
    }
}
