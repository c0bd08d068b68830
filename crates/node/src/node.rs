//! The node: sandboxes' lifecycles on top of `vmon_vm`, slots and builds.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::sync::{Mutex, RwLock};
use vmon_proto::node::{
    BuildInfo, LogEntry, LogQuery, MetricSample, NetworkPolicy, NodeControl, NodeError, Running,
    StartSpec, TemplateSpec,
};
use vmon_vm::disk::{create_overlay, BackingFormat};
use vmon_vm::machine::{kernel_cmdline, qemu_version, RamSharing};
use vmon_vm::{memory, Accel, AccelChoice, LaunchSpec, MachineDesc, NetDevice, Vm};

use crate::builds::{new_id, now_unix, BuildRecord, Builds, MAX_LAYERS};
use crate::envd_client::{self, InitRequest, ENVD_PORT};
use crate::pool::{Pool, Prepared};
use crate::sandbox::{Live, RamSource, SandboxState};
use crate::slots::{Slots, TAP};

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

/// Crash-test hook: `VMON_FAULT=<point>` aborts the process at that point, as a node crash
/// would. Points: `pause:captured` (artifacts written, no record), `pause:committed` (record
/// written, QEMU not yet gone).
fn fault(point: &str) {
    if std::env::var("VMON_FAULT").as_deref() == Ok(point) {
        tracing::error!(point, "VMON_FAULT: aborting");
        std::process::abort();
    }
}

/// Crash-test hook: `VMON_FAULT=<point>` makes that step fail with an error.
fn fault_err(point: &str) -> anyhow::Result<()> {
    if std::env::var("VMON_FAULT").as_deref() == Ok(point) {
        bail!("injected failure at {point}");
    }
    Ok(())
}

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

/// A paused sandbox whose QEMU is kept stopped: resuming it is `cont` and `/init`.
struct Parked {
    live: Live,
    since: std::time::Instant,
}

/// Below this share of host memory available, parked processes are let go.
const PARK_MIN_AVAILABLE_PERCENT: u64 = 15;

/// A number from the environment, or `default` when unset or not a number.
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Pool keys of blank processes: `blank:<mem_base artifact>`.
pub(crate) const BLANK_PREFIX: &str = "blank:";

fn blank_key(mem_base: &str) -> String {
    format!("{BLANK_PREFIX}{mem_base}")
}

/// One host's sandboxes.
pub struct Node {
    cfg: NodeConfig,
    accel: AccelChoice,
    qemu_version: String,
    image: vmon_image::Image,
    builds: Builds,
    slots: Arc<Slots>,
    sandboxes: std::sync::Mutex<HashMap<String, Arc<Mutex<Live>>>>,
    pool: Pool,
    /// Held (shared) by every operation that creates artifacts not yet named by a record;
    /// held exclusively by the sweep.
    artifacts_guard: RwLock<()>,
    /// Restores in their CPU-heavy part (spawn, write-in, load, the guest's first answers) at
    /// once: one per host core. Under TCG a restored guest translates its hot paths anew, and
    /// ten of them sharing two cores finish later than ten taking turns.
    restore_gate: tokio::sync::Semaphore,
    /// Restores waiting for a turn or holding one.
    restores_in_flight: std::sync::atomic::AtomicUsize,
    /// The machine of each RAM base that blank processes are kept for.
    blank_machines: std::sync::Mutex<HashMap<String, MachineDesc>>,
    /// Paused sandboxes with their QEMU kept stopped, by paused build.
    parked: std::sync::Mutex<HashMap<String, Parked>>,
    host_memory_mb: u64,
    pub(crate) telemetry: crate::telemetry::Telemetry,
    me: std::sync::Weak<Node>,
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

/// One node per data dir: `flock` on `<data>/node.lock`, failing fast when another holds it.
fn lock_data_dir(data_dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(data_dir.join("node.lock"))?;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        bail!(
            "another vmon node is running on {} (one node per data dir)",
            data_dir.display()
        );
    }
    Ok(f)
}

/// Takes the host-wide lock of slot block `b` if no live node holds it.
fn try_lock_block(b: u32) -> anyhow::Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd;
    let lock_dir = Path::new("/run/vmon");
    std::fs::create_dir_all(lock_dir)?;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_dir.join(format!("slots-{b}.lock")))?;
    // SAFETY: flock on a descriptor we own; no memory is passed.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    Ok((rc == 0).then_some(f))
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

impl Node {
    /// Opens the node: probes the host, finds or builds the guest image, re-adopts sandboxes
    /// that survived a restart and cleans up what a crash left.
    pub async fn open(cfg: NodeConfig) -> anyhow::Result<Arc<Node>> {
        std::fs::create_dir_all(&cfg.data_dir)?;
        let data_lock = lock_data_dir(&cfg.data_dir)?;
        let accel = vmon_vm::probe_accel(cfg.accel).map_err(|e| anyhow::anyhow!(e))?;
        tracing::info!(accel = accel.accel.as_str(), reason = %accel.reason, "accelerator");
        let qemu_version = qemu_version(&cfg.qemu_binary)?;
        probe_qmp(&cfg.qemu_binary, &cfg.data_dir.join("run")).await?;
        let envd = match &cfg.envd_binary {
            Some(p) => p.clone(),
            None => std::env::current_exe()?.with_file_name("envd"),
        };
        let recipe = vmon_image::Recipe::for_host(envd)?;
        let image = vmon_image::build(&cfg.data_dir, &recipe).await?;
        let builds = Builds::open(&cfg.data_dir)?;
        Slots::prepare_host().await?;
        let (slot_block, block_lock) = claim_slot_block(&cfg)?;
        tracing::info!(slot_block, "network slot block");
        let node = Arc::new_cyclic(|me| Node {
            me: me.clone(),
            pool: Pool::new(cfg.pool_size, cfg.blank_pool_size),
            cfg,
            accel,
            qemu_version,
            image,
            builds,
            slots: Arc::new(Slots::new(slot_block)),
            sandboxes: std::sync::Mutex::new(HashMap::new()),
            artifacts_guard: RwLock::new(()),
            restore_gate: tokio::sync::Semaphore::new(env_or(
                "VMON_RESTORE_TURNS",
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
            parked: Default::default(),
            restores_in_flight: Default::default(),
            blank_machines: Default::default(),
            host_memory_mb: host_memory_mb(),
            telemetry: Default::default(),
            _block_lock: block_lock,
            _data_lock: data_lock,
        });
        node.recover().await?;
        node.slots.set_spares(node.cfg.spare_slots);
        node.slots.refill();
        crate::telemetry::spawn(Arc::downgrade(&node));
        let weak = Arc::downgrade(&node);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let Some(node) = weak.upgrade() else { break };
                node.evict_parked(false).await;
            }
        });
        Ok(node)
    }

    /// How many paused sandboxes may keep their stopped QEMU.
    pub fn park_max(&self) -> usize {
        self.cfg.park_max
    }

    /// Lets parked processes go: all of them, or those past their linger time, over the count,
    /// or while the host runs short of memory. Their pauses were committed; nothing is lost.
    pub async fn evict_parked(&self, all: bool) {
        let max = self.cfg.park_max;
        let short = !all && memory_is_short();
        let out: Vec<Parked> = {
            let Ok(mut m) = self.parked.lock() else {
                return;
            };
            let mut by_age: Vec<(String, std::time::Instant)> =
                m.iter().map(|(k, p)| (k.clone(), p.since)).collect();
            by_age.sort_by_key(|(_, t)| *t);
            let over = by_age.len().saturating_sub(max);
            let mut out = Vec::new();
            for (i, (k, t)) in by_age.into_iter().enumerate() {
                let expired = t.elapsed() >= self.cfg.park_linger;
                if all || short || i < over || expired {
                    if let Some(p) = m.remove(&k) {
                        out.push(p);
                    }
                }
            }
            out
        };
        for mut p in out {
            tracing::debug!(sandbox = %p.live.state.id, "parked QEMU let go");
            self.destroy(&mut p.live, false).await;
        }
    }

    /// Switches a stopped sandbox's disk to a fresh overlay; the old one freezes. Returns the
    /// frozen overlay and the chain under it.
    async fn switch_disk(&self, l: &mut Live) -> anyhow::Result<(String, Vec<String>)> {
        let vm = l.vm.as_ref().context("sandbox has no VM")?;
        let (next, next_path) = self.builds.new_artifact("disk", "qcow2");
        let next_node = format!("d{}", l.state.disk_seq + 1);
        vm.qmp
            .blockdev_snapshot_sync(&l.state.disk_node, &next_path, &next_node)
            .await?;
        let frozen = std::mem::replace(&mut l.state.overlay, next);
        let chain = l.state.disk_chain.clone();
        l.state.disk_chain.insert(0, frozen.clone());
        l.state.disk_node = next_node;
        l.state.disk_seq += 1;
        Ok((frozen, chain))
    }

    /// Takes the parked process of `sandbox_id` paused into `build_id`, if it is still kept.
    fn unpark(&self, build_id: &str, sandbox_id: &str) -> Option<Live> {
        let mut m = self.parked.lock().ok()?;
        if m.get(build_id)?.live.state.id != sandbox_id {
            return None;
        }
        m.remove(build_id).map(|p| p.live)
    }

    /// Whether the QEMU of the sandbox paused into `build_id` is kept.
    pub fn is_parked(&self, build_id: &str) -> bool {
        self.parked
            .lock()
            .map(|m| m.contains_key(build_id))
            .unwrap_or(false)
    }

    /// Lets the kept QEMU of a paused build go (its next resume restores from the build).
    /// Returns whether one was kept.
    pub async fn let_go_parked(&self, build_id: &str) -> bool {
        let kept = self.is_parked(build_id);
        self.discard_parked(build_id).await;
        kept
    }

    async fn discard_parked(&self, build_id: &str) {
        let p = self.parked.lock().ok().and_then(|mut m| m.remove(build_id));
        if let Some(mut p) = p {
            self.destroy(&mut p.live, false).await;
        }
    }

    /// Resumes a parked sandbox: `cont`, then `/init` with the new run's token and settings.
    async fn resume_parked(
        &self,
        spec: &StartSpec,
        rec: &BuildRecord,
        mut live: Live,
    ) -> anyhow::Result<Live> {
        let run_dir = self.sandbox_root(&spec.sandbox_id).join(&spec.execution_id);
        let r = async {
            if live.dir != run_dir {
                if run_dir.exists() {
                    std::fs::remove_dir_all(&run_dir)?;
                }
                std::fs::rename(&live.dir, &run_dir)?;
                live.dir = run_dir.clone();
            }
            if live.state.network.as_ref() != Some(&spec.network) {
                live.slot.set_policy(&spec.network).await?;
                live.state.network = Some(spec.network.clone());
            }
            let vm = live.vm.as_ref().context("parked sandbox has no VM")?;
            vm.qmp.cont().await?;
            let addr = SocketAddr::new(IpAddr::V4(live.slot.addr()), ENVD_PORT);
            envd_client::init(addr, &restore_init(spec, rec), self.cfg.restore_timeout).await?;
            live.state.execution_id = spec.execution_id.clone();
            live.state.envd_token = spec.envd_access_token.clone();
            live.state.resume_generation = rec.resume_generation + 1;
            live.state.pausing_build = None;
            live.state.save(&live.dir)?;
            anyhow::Ok(())
        }
        .await;
        match r {
            Ok(()) => Ok(live),
            Err(e) => {
                self.destroy(&mut live, false).await;
                Err(e)
            }
        }
    }

    pub(crate) fn pool_ref(&self) -> &Pool {
        &self.pool
    }

    pub(crate) fn restore_gate(&self) -> &tokio::sync::Semaphore {
        &self.restore_gate
    }

    /// Pre-spawned processes ready for `build_id`.
    pub fn pool_depth(&self, build_id: &str) -> usize {
        self.pool.depth(build_id)
    }

    /// Fills the restore pool of a build in the background.
    pub fn warm(self: &Arc<Self>, build_id: &str) {
        self.pool.refill(self.clone(), build_id.to_string());
    }

    async fn discard_prepared(&self, p: Prepared) {
        let Prepared {
            mut vm,
            slot,
            overlay,
            run_dir,
            ..
        } = p;
        vm.kill().await;
        let _ = self.slots.release(&slot).await;
        let _ = std::fs::remove_file(self.builds.artifact(&overlay));
        let _ = std::fs::remove_dir_all(run_dir);
    }

    /// Stops every pooled process and frees the spare slots (shutdown).
    pub async fn drain_pool(&self) {
        self.evict_parked(true).await;
        self.slots.drain_spares().await;
        for id in self.pool.builds() {
            for p in self.pool.discard(&id).await {
                self.discard_prepared(p).await;
            }
        }
    }

    /// Changes how many processes are kept ready per hot build (0 turns the pool off).
    pub fn set_pool_size(&self, n: usize) {
        self.pool.set_size(n);
    }

    /// Changes how many blank processes are kept per RAM base (0 turns them off).
    pub fn set_blank_pool_size(&self, n: usize) {
        self.pool.set_blank_size(n);
    }

    /// QEMU pids of the blank processes kept ready (any RAM base).
    pub fn blank_pids(&self) -> Vec<u32> {
        self.pool
            .pids()
            .into_iter()
            .filter(|(k, _)| k.starts_with(BLANK_PREFIX))
            .map(|(_, p)| p)
            .collect()
    }

    /// Blank processes ready for the RAM base of `build_id`.
    pub fn blank_depth(&self, build_id: &str) -> usize {
        match self.builds.get(build_id) {
            Ok(Some(rec)) => rec
                .mem_base
                .as_deref()
                .map(|m| self.pool.depth(&blank_key(m)))
                .unwrap_or(0),
            _ => 0,
        }
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

    pub fn qemu_version(&self) -> &str {
        &self.qemu_version
    }

    pub fn image(&self) -> &vmon_image::Image {
        &self.image
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

    /// Running sandboxes the telemetry scraper may sample now (busy ones wait a round).
    pub(crate) fn scrape_targets(&self) -> Vec<crate::telemetry::Target> {
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
                })
            })
            .collect()
    }

    fn machine(&self, vcpus: u32, memory_mb: u32) -> Result<MachineDesc, NodeError> {
        if vcpus == 0 {
            return Err(NodeError::InvalidArgument(
                "vCPUs must be at least 1".into(),
            ));
        }
        if vcpus > 64 {
            return Err(NodeError::InvalidArgument(format!(
                "{vcpus} vCPUs is more than 64"
            )));
        }
        if memory_mb < 128 {
            return Err(NodeError::InvalidArgument(format!(
                "memory of {memory_mb} MiB is below the 128 MiB a guest needs"
            )));
        }
        if self.host_memory_mb > 0 && u64::from(memory_mb) > self.host_memory_mb {
            return Err(NodeError::InvalidArgument(format!(
                "memory of {memory_mb} MiB is more than this host's {} MiB",
                self.host_memory_mb
            )));
        }
        Ok(MachineDesc {
            qemu_binary: self.cfg.qemu_binary.clone(),
            qemu_version: self.qemu_version.clone(),
            accel: self.accel.accel,
            cpu_model: self.accel.accel.cpu_model().to_string(),
            vcpus,
            memory_mb,
            kernel: self.image.vmlinuz.clone(),
            initrd: self.image.initrd.clone(),
            // Under TCG a translated block is found again only at the same virtual address:
            // with address-space randomisation every new process (each command's shell, its
            // libraries) is translated afresh and soon flushes the whole cache. The guest is
            // the isolation boundary, not its processes; under KVM nothing is translated.
            cmdline: kernel_cmdline(match self.accel.accel {
                vmon_vm::accel::Accel::Tcg => "norandmaps",
                vmon_vm::accel::Accel::Kvm => "",
            }),
        })
    }

    /// A restore only loads into the machine a build was made on.
    fn check_compatible(&self, rec: &BuildRecord) -> Result<(), NodeError> {
        let m = &rec.machine;
        if m.accel != self.accel.accel || m.qemu_version != self.qemu_version {
            return Err(NodeError::InvalidArgument(format!(
                "build {} was made with {} on {} and cannot restore here ({} on {})",
                rec.id,
                m.accel.as_str(),
                m.qemu_version,
                self.accel.accel.as_str(),
                self.qemu_version
            )));
        }
        Ok(())
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
        }
    }

    /// Flushes the guest's page cache so the disk holds every file written (before a capture
    /// that keeps the disk only). A failure is logged: the capture still has what was synced.
    async fn sync_guest(l: &Live, before: &str) {
        let addr = SocketAddr::new(IpAddr::V4(l.slot.addr()), ENVD_PORT);
        let token = l.state.envd_token.as_deref();
        if let Err(e) = envd_client::run(addr, token, "root", "sync", Duration::from_secs(60)).await
        {
            tracing::warn!(sandbox = %l.state.id, "guest sync before {before} failed: {e:#}");
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
        }
    }

    /// Cold-boots a VM with its own shared RAM file over `disk` (the image rootfs when `None`).
    #[allow(clippy::too_many_arguments)]
    async fn boot(
        &self,
        run_dir: &Path,
        id: &str,
        execution_id: &str,
        machine: MachineDesc,
        disk: Option<(&str, &[String])>,
        disk_mb: u32,
        policy: &NetworkPolicy,
        init: &InitRequest,
        resume_generation: u32,
    ) -> anyhow::Result<Live> {
        let _guard = self.artifacts_guard.read().await;
        let slot = self.slots.acquire(policy).await?;
        self.slots.refill();
        let mut made: Vec<PathBuf> = Vec::new();
        let r = async {
            std::fs::create_dir_all(run_dir)?;
            let (overlay, overlay_path) = self.builds.new_artifact("disk", "qcow2");
            let chain: Vec<String> = match disk {
                Some((top, below)) => {
                    create_overlay(
                        &self.builds.artifact(top),
                        BackingFormat::Qcow2,
                        &overlay_path,
                    )
                    .await?;
                    std::iter::once(top.to_string())
                        .chain(below.iter().cloned())
                        .collect()
                }
                None => {
                    create_overlay(&self.image.rootfs, BackingFormat::Raw, &overlay_path).await?;
                    Vec::new()
                }
            };
            made.push(overlay_path);
            let (ram, ram_path) = self.builds.new_artifact("ram", "mem");
            made.push(ram_path.clone());
            let tag = new_id("");
            let vm = Vm::launch(&LaunchSpec {
                tag: tag.clone(),
                machine: machine.clone(),
                run_dir: run_dir.to_path_buf(),
                console_log: run_dir.join("console.log"),
                ram_file: ram_path,
                ram: RamSharing::Shared,
                disk: Some(self.builds.artifact(&overlay)),
                net: Some(NetDevice { tap: TAP.into() }),
                netns: Some(slot.netns()),
                incoming: false,
                // Template builds run under <data>/run; sandboxes under <data>/sandboxes.
                die_with_node: run_dir.starts_with(self.cfg.data_dir.join("run")),
            })
            .await?;
            let mut live = Live {
                state: SandboxState {
                    id: id.to_string(),
                    execution_id: execution_id.to_string(),
                    slot: slot.index,
                    machine,
                    ram: RamSource::Shared { file: ram },
                    overlay,
                    disk_chain: chain,
                    disk_node: "d0".into(),
                    disk_seq: 0,
                    envd_token: init.access_token.clone(),
                    envd_version: ENVD_VERSION.into(),
                    disk_mb,
                    resume_generation,
                    qemu_tag: tag,
                    pausing_build: None,
                    network: Some(policy.clone()),
                },
                vm: Some(vm),
                slot: slot.clone(),
                dir: run_dir.to_path_buf(),
            };
            let addr = SocketAddr::new(IpAddr::V4(slot.addr()), ENVD_PORT);
            let ready = async {
                envd_client::wait_healthy(addr, self.cfg.boot_timeout).await?;
                envd_client::init(addr, init, Duration::from_secs(60)).await
            };
            if let Err(e) = ready.await {
                if let Some(mut vm) = live.vm.take() {
                    vm.kill().await;
                }
                let console =
                    std::fs::read_to_string(run_dir.join("console.log")).unwrap_or_default();
                let tail: String = console
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                bail!("{e:#}\nlast console lines:\n{tail}");
            }
            live.state.save(run_dir)?;
            anyhow::Ok(live)
        }
        .await;
        if r.is_err() {
            let _ = self.slots.release(&slot).await;
            for p in made {
                let _ = std::fs::remove_file(p);
            }
        }
        r
    }

    /// Spawns a QEMU waiting for `migrate-incoming` on `rec`'s memory, with its own slot and
    /// overlay, and its layers already written in.
    ///
    /// With `warm`, the process also loads the device state, runs the guest until envd has
    /// answered a few requests (so QEMU's translation cache holds the hot paths: under TCG the
    /// first request after a load costs most of a restore), and stops it again. A claim then
    /// costs `cont` and `/init`. Only template builds are warmed: their guest running a moment
    /// longer before its first claim is indistinguishable from a template captured later.
    pub(crate) async fn prepare(&self, rec: &BuildRecord, warm: bool) -> anyhow::Result<Prepared> {
        let Some(mem_base) = rec.mem_base.clone() else {
            bail!("build {} has no memory", rec.id);
        };
        let blank = self.prepare_blank(&mem_base, &rec.machine).await?;
        let mut p = self.fill_blank(rec, blank).await?;
        if warm {
            if let Err(e) = self.warm_up(&p.vm, rec, &p.slot).await {
                self.discard_prepared(p).await;
                return Err(e);
            }
            p.loaded = true;
        }
        Ok(p)
    }

    /// The caller holds the artifacts guard (shared) from here until the process is in the
    /// pool or its sandbox in the table: until then nothing else names its overlay.
    ///
    /// Spawns a restore process for RAM base `mem_base` with no disk and no state yet: a slot,
    /// QEMU waiting for `migrate-incoming`. Kept ahead of time per RAM base, it takes the spawn
    /// out of resumes and fork children; [`Node::fill_blank`] gives it a build.
    pub(crate) async fn prepare_blank(
        &self,
        mem_base: &str,
        machine: &MachineDesc,
    ) -> anyhow::Result<Prepared> {
        let slot = self.slots.acquire(&crate::slots::open_policy()).await?;
        self.slots.refill();
        let tag = new_id("");
        let run_dir = self.cfg.data_dir.join("pool").join(&tag);
        let r = async {
            std::fs::create_dir_all(&run_dir)?;
            let vm = Vm::launch(&LaunchSpec {
                tag: tag.clone(),
                machine: machine.clone(),
                run_dir: run_dir.clone(),
                console_log: run_dir.join("console.log"),
                ram_file: self.builds.artifact(mem_base),
                ram: RamSharing::Private,
                disk: None,
                net: Some(NetDevice { tap: TAP.into() }),
                netns: Some(slot.netns()),
                incoming: true,
                die_with_node: false,
            })
            .await?;
            if let Err(e) = vm.qmp.prepare_incoming().await {
                let mut vm = vm;
                vm.kill().await;
                return Err(e.into());
            }
            anyhow::Ok(vm)
        }
        .await;
        match r {
            Ok(vm) => Ok(Prepared {
                tag,
                slot,
                overlay: String::new(),
                vm,
                run_dir,
                loaded: false,
                mem_base: mem_base.to_string(),
                machine: machine.clone(),
            }),
            Err(e) => {
                let _ = self.slots.release(&slot).await;
                let _ = std::fs::remove_dir_all(&run_dir);
                Err(e)
            }
        }
    }

    /// Gives a blank process `rec`'s disk (a fresh overlay on its chain, attached at the slot
    /// the device state names) and memory layers. The process is discarded on failure.
    async fn fill_blank(&self, rec: &BuildRecord, mut p: Prepared) -> anyhow::Result<Prepared> {
        let (overlay, overlay_path) = self.builds.new_artifact("disk", "qcow2");
        let t0 = std::time::Instant::now();
        let r = async {
            if rec.mem_base.as_deref() != Some(p.mem_base.as_str()) {
                bail!("process was made for another RAM base");
            }
            match &rec.disk {
                Some(d) => {
                    create_overlay(
                        &self.builds.artifact(d),
                        BackingFormat::Qcow2,
                        &overlay_path,
                    )
                    .await?
                }
                None => {
                    create_overlay(&self.image.rootfs, BackingFormat::Raw, &overlay_path).await?
                }
            }
            for (cmd, args) in vmon_vm::machine::disk_attach(&overlay_path) {
                p.vm.qmp
                    .execute_raw(cmd, args, Duration::from_secs(30))
                    .await?;
            }
            let t_attach = t0.elapsed();
            let pid = p.vm.pid;
            let ram_file = self.builds.artifact(&p.mem_base);
            let layers: Vec<PathBuf> = rec.layers.iter().map(|l| self.builds.artifact(l)).collect();
            tokio::task::spawn_blocking(move || {
                for l in &layers {
                    memory::write_in(pid, &ram_file, l)?;
                }
                anyhow::Ok(())
            })
            .await
            .map_err(|e| anyhow::anyhow!("write-in task: {e}"))??;
            tracing::debug!(
                build = %rec.id,
                attach_ms = t_attach.as_secs_f64() * 1e3,
                write_in_ms = (t0.elapsed() - t_attach).as_secs_f64() * 1e3,
                "fill stages"
            );
            anyhow::Ok(())
        }
        .await;
        match r {
            Ok(()) => {
                p.overlay = overlay;
                Ok(p)
            }
            Err(e) => {
                self.discard_prepared(p).await;
                let _ = std::fs::remove_file(&overlay_path);
                Err(e)
            }
        }
    }

    /// What the background refill of pool `key` should make: a warmed process of a template
    /// build, or a blank one for a RAM base (`blank:<mem_base>`). None: nothing to make.
    pub(crate) async fn artifacts_shared(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.artifacts_guard.read().await
    }

    pub(crate) async fn prepare_for_pool(&self, key: &str) -> anyhow::Result<Option<Prepared>> {
        if let Some(mem_base) = key.strip_prefix(BLANK_PREFIX) {
            let machine = self
                .blank_machines
                .lock()
                .ok()
                .and_then(|m| m.get(mem_base).cloned());
            let Some(machine) = machine else {
                return Ok(None);
            };
            if !self.builds.artifact(mem_base).exists() {
                return Ok(None);
            }
            return self.prepare_blank(mem_base, &machine).await.map(Some);
        }
        let Some(rec) = self.builds.get(key)? else {
            return Ok(None);
        };
        self.prepare(&rec, true).await.map(Some)
    }

    /// Restores waiting for or holding a turn; pool refills wait until there are none.
    pub(crate) fn restores_in_flight(&self) -> usize {
        self.restores_in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn warm_up(
        &self,
        vm: &Vm,
        rec: &BuildRecord,
        slot: &crate::slots::Slot,
    ) -> anyhow::Result<()> {
        let devstate = rec
            .devstate
            .as_deref()
            .context("build has no device state")?;
        vm.qmp
            .migrate_incoming_file(&self.builds.artifact(devstate))
            .await?;
        vm.qmp.cont().await?;
        let addr = SocketAddr::new(IpAddr::V4(slot.addr()), ENVD_PORT);
        envd_client::wait_healthy(addr, self.cfg.restore_timeout).await?;
        let token = rec.envd_token.as_deref();
        // The claim's own `/init` (clock, entropy, token) runs through the same code: translate
        // it now. The build's token stays; the claim sets the sandbox's.
        let keep = envd_client::InitRequest {
            access_token: rec.envd_token.clone(),
            current_token: rec.envd_token.clone(),
            ..Default::default()
        };
        for _ in 0..3 {
            envd_client::healthy(addr).await;
            envd_client::init(addr, &keep, Duration::from_secs(30)).await?;
            envd_client::run(addr, token, "user", "true", Duration::from_secs(30)).await?;
        }
        vm.qmp.stop().await?;
        Ok(())
    }

    /// Restores `rec` for a sandbox: a pooled process when one is ready, else a fresh one.
    async fn restore(
        self: &Arc<Self>,
        spec: &StartSpec,
        rec: &BuildRecord,
    ) -> anyhow::Result<Live> {
        let (Some(mem_base), Some(devstate)) = (rec.mem_base.clone(), rec.devstate.clone()) else {
            bail!("build {} has no memory to restore", rec.id);
        };
        if let Some(live) = self.unpark(&rec.id, &spec.sandbox_id) {
            match self.resume_parked(spec, rec, live).await {
                Ok(live) => return Ok(live),
                Err(e) => tracing::warn!(
                    sandbox = %spec.sandbox_id,
                    "resuming the kept QEMU failed, restoring from the build: {e:#}"
                ),
            }
        }
        let _in_flight = InFlight::new(&self.restores_in_flight);
        let blanks = blank_key(&mem_base);
        let pooled = self.pool.take(&rec.id);
        // A warmed pooled process only needs `cont` and `/init`: it skips the gate.
        let _turn = match &pooled {
            Some(p) if p.loaded => None,
            _ => Some(
                self.restore_gate
                    .acquire()
                    .await
                    .map_err(|_| anyhow::anyhow!("node is shutting down"))?,
            ),
        };
        // Resumes and fork children share their RAM base with a template: keep blank processes
        // for it from now on.
        if let Ok(mut m) = self.blank_machines.lock() {
            m.entry(mem_base.clone())
                .or_insert_with(|| rec.machine.clone());
        }
        let prepared = match pooled {
            Some(p) => p,
            None => match self.pool.take(&blanks) {
                Some(b) if b.vm_matches(&rec.machine) => self.fill_blank(rec, b).await?,
                Some(b) => {
                    self.discard_prepared(b).await;
                    self.prepare(rec, false).await?
                }
                None => self.prepare(rec, false).await?,
            },
        };
        let Prepared {
            tag,
            slot,
            overlay,
            mut vm,
            run_dir: pool_dir,
            loaded,
            ..
        } = prepared;
        let run_dir = self.sandbox_root(&spec.sandbox_id).join(&spec.execution_id);
        let r = async {
            if let Some(parent) = run_dir.parent() {
                std::fs::create_dir_all(parent)?;
            }
            if run_dir.exists() {
                std::fs::remove_dir_all(&run_dir)?;
            }
            std::fs::rename(&pool_dir, &run_dir)?;
            if loaded {
                // What the guest printed while it warmed up in the pool is not this sandbox's:
                // log readers start after this many console bytes.
                let len = std::fs::metadata(run_dir.join("console.log"))
                    .map(|m| m.len())
                    .unwrap_or(0);
                std::fs::write(run_dir.join("console.skip"), len.to_string())?;
            }
            if spec.network != crate::slots::open_policy() {
                slot.set_policy(&spec.network).await?;
            }
            let t0 = std::time::Instant::now();
            if !loaded {
                vm.qmp
                    .migrate_incoming_file(&self.builds.artifact(&devstate))
                    .await?;
            }
            let t_load = t0.elapsed();
            vm.qmp.cont().await?;
            let t_cont = t0.elapsed();
            let addr = SocketAddr::new(IpAddr::V4(slot.addr()), ENVD_PORT);
            let init =
                envd_client::init(addr, &restore_init(spec, rec), self.cfg.restore_timeout).await;
            tracing::debug!(
                sandbox = %spec.sandbox_id,
                load_ms = t_load.as_secs_f64() * 1e3,
                cont_ms = (t_cont - t_load).as_secs_f64() * 1e3,
                init_ms = (t0.elapsed() - t_cont).as_secs_f64() * 1e3,
                "restore stages"
            );
            init?;
            let state = SandboxState {
                id: spec.sandbox_id.clone(),
                execution_id: spec.execution_id.clone(),
                slot: slot.index,
                machine: rec.machine.clone(),
                ram: RamSource::Private {
                    mem_base,
                    layers: rec.layers.clone(),
                    basis: rec.id.clone(),
                },
                overlay: overlay.clone(),
                disk_chain: rec
                    .disk
                    .iter()
                    .chain(rec.disk_chain.iter())
                    .cloned()
                    .collect(),
                disk_node: "d0".into(),
                disk_seq: 0,
                envd_token: spec.envd_access_token.clone(),
                envd_version: rec.envd_version.clone(),
                disk_mb: rec.disk_mb,
                resume_generation: rec.resume_generation + 1,
                qemu_tag: tag.clone(),
                pausing_build: None,
                network: Some(spec.network.clone()),
            };
            state.save(&run_dir)?;
            anyhow::Ok(state)
        }
        .await;
        match r {
            Ok(state) => {
                if rec.parent.is_none() {
                    // Templates are hot: keep a process ready (started only now, so the
                    // refill does not compete with this claim). Paused builds restore once.
                    self.pool.refill(self.clone(), rec.id.clone());
                }
                self.pool.refill(self.clone(), blanks.clone());
                Ok(Live {
                    state,
                    vm: Some(vm),
                    slot,
                    dir: run_dir,
                })
            }
            Err(e) => {
                if rec.parent.is_none() {
                    self.pool.refill(self.clone(), rec.id.clone());
                }
                self.pool.refill(self.clone(), blanks.clone());
                vm.kill().await;
                let _ = self.slots.release(&slot).await;
                let _ = std::fs::remove_file(self.builds.artifact(&overlay));
                let _ = std::fs::remove_dir_all(&pool_dir);
                Err(e)
            }
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
        if let Some(vm) = live.vm.take() {
            vm.quit().await;
        }
        vmon_vm::process::kill_recorded(&live.dir, &live.state.qemu_tag);
        let _ = self.slots.release(&live.slot).await;
        if !keep_artifacts {
            let _ = std::fs::remove_file(self.builds.artifact(&live.state.overlay));
            if let RamSource::Shared { file } = &live.state.ram {
                let _ = std::fs::remove_file(self.builds.artifact(file));
            }
        }
        let _ = std::fs::remove_file(SandboxState::path(&live.dir));
        for f in ["qmp.sock", "qemu.pid"] {
            let _ = std::fs::remove_file(live.dir.join(f));
        }
    }

    /// Captures memory (when asked) and device state of a *stopped* VM into a new build that
    /// shares this sandbox's disk `disk` (frozen). Does not resume or stop the VM.
    async fn capture(
        &self,
        live: &Live,
        build_id: &str,
        memory: bool,
        for_pause: bool,
        disk: String,
        disk_chain: Vec<String>,
    ) -> anyhow::Result<BuildRecord> {
        let vm = live.vm.as_ref().context("sandbox has no VM")?;
        let mut rec = BuildRecord {
            id: build_id.to_string(),
            parent: None,
            machine: live.state.machine.clone(),
            image_hash: self.image.manifest.hash.clone(),
            mem_base: None,
            layers: Vec::new(),
            devstate: None,
            disk: Some(disk),
            disk_chain,
            disk_mb: live.state.disk_mb,
            envd_version: live.state.envd_version.clone(),
            envd_token: live.state.envd_token.clone(),
            resume_generation: live.state.resume_generation,
            created_unix: now_unix(),
        };
        if !memory {
            return Ok(rec);
        }
        let (dev, dev_path) = self.builds.new_artifact("dev", "state");
        vm.qmp.save_devices_state(&dev_path).await?;
        rec.devstate = Some(dev);
        match &live.state.ram {
            RamSource::Private {
                mem_base,
                layers,
                basis,
            } => {
                rec.parent = Some(basis.clone());
                let flatten = layers.len() >= MAX_LAYERS;
                let previous = if flatten || layers.is_empty() {
                    None
                } else {
                    Some(layers.clone())
                };
                let (layer, layer_path) = self.builds.new_artifact("layer", "mem");
                let pid = vm.pid;
                let ram_file = self.builds.artifact(mem_base);
                let layer_files: Option<Vec<PathBuf>> = previous
                    .as_ref()
                    .map(|ls| ls.iter().map(|l| self.builds.artifact(l)).collect());
                let stats = tokio::task::spawn_blocking(move || {
                    let hashes = match layer_files {
                        Some(files) => {
                            let mut h = memory::PageHashes::new();
                            for f in files {
                                h.extend(memory::read_layer_index(&f)?.page_hashes());
                            }
                            Some(h)
                        }
                        None => None,
                    };
                    memory::capture(pid, &ram_file, &layer_path, hashes.as_ref())
                })
                .await
                .map_err(|e| anyhow::anyhow!("capture task: {e}"))??;
                tracing::debug!(pages = stats.pages, skipped = stats.skipped, "memory layer");
                rec.mem_base = Some(mem_base.clone());
                rec.layers = if flatten { Vec::new() } else { layers.clone() };
                if stats.pages > 0 || rec.layers.is_empty() {
                    rec.layers.push(layer);
                } else {
                    let _ = std::fs::remove_file(self.builds.artifact(&layer));
                }
            }
            RamSource::Shared { file } if for_pause => {
                // The VM stops for good: its own RAM file becomes the base, no copy.
                std::fs::File::open(self.builds.artifact(file))?.sync_all()?;
                rec.mem_base = Some(file.clone());
            }
            RamSource::Shared { file } => {
                // The running VM keeps writing its file: the build gets a copy.
                let (copy, copy_path) = self.builds.new_artifact("ram", "mem");
                let src = self.builds.artifact(file);
                tokio::task::spawn_blocking(move || sparse_copy(&src, &copy_path))
                    .await
                    .map_err(|e| anyhow::anyhow!("copy task: {e}"))??;
                rec.mem_base = Some(copy);
            }
        }
        Ok(rec)
    }

    /// Re-adopts running VMs and cleans up after a crash.
    async fn recover(self: &Arc<Self>) -> anyhow::Result<()> {
        let root = self.cfg.data_dir.join("sandboxes");
        std::fs::create_dir_all(&root)?;
        let mut keep_slots = Vec::new();
        for sb in std::fs::read_dir(&root)?.flatten() {
            for ex in std::fs::read_dir(sb.path()).into_iter().flatten().flatten() {
                let dir = ex.path();
                let Ok(state) = SandboxState::load(&dir) else {
                    continue;
                };
                match self.adopt(&dir, state).await {
                    Ok(Some(slot)) => keep_slots.push(slot),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(dir = %dir.display(), "cannot adopt: {e:#}"),
                }
            }
        }
        // Pool processes are not worth adopting: kill them.
        let pool = self.cfg.data_dir.join("pool");
        if let Ok(rd) = std::fs::read_dir(&pool) {
            for e in rd.flatten() {
                let tag = e.file_name().to_string_lossy().to_string();
                vmon_vm::process::kill_recorded(&e.path(), &tag);
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let removed = self.slots.reclaim(&keep_slots).await?;
        // Namespaces of nodes that died without cleaning up: a block whose lock nobody holds.
        for b in 0..crate::slots::BLOCKS {
            if b == self.slots.block() {
                continue;
            }
            if let Ok(Some(lock)) = try_lock_block(b) {
                let stale = Slots::new(b).reclaim(&[]).await.unwrap_or_default();
                if !stale.is_empty() {
                    tracing::info!(
                        block = b,
                        count = stale.len(),
                        "removed slots of a dead node"
                    );
                }
                drop(lock);
            }
        }
        crate::slots::remove_legacy().await;
        if !removed.is_empty() {
            tracing::info!(?removed, "reclaimed network slots");
        }
        self.sweep().await?;
        Ok(())
    }

    async fn adopt(&self, dir: &Path, state: SandboxState) -> anyhow::Result<Option<u32>> {
        let slot = self.slots.slot(state.slot);
        match Vm::adopt(dir, &state.qemu_tag).await {
            Ok(vm) => {
                self.slots.mark_used(slot.index);
                let status = vm.qmp.query_status().await?;
                let mut live = Live {
                    state,
                    vm: Some(vm),
                    slot: slot.clone(),
                    dir: dir.to_path_buf(),
                };
                if let Some(b) = live.state.pausing_build.clone() {
                    if self.builds.get(&b)?.is_some() {
                        // The pause was committed: finish it.
                        tracing::info!(sandbox = %live.state.id, build = %b, "finishing a pause cut by a restart");
                        self.destroy(&mut live, true).await;
                        return Ok(None);
                    }
                }
                if !status.running {
                    if let Some(vm) = &live.vm {
                        vm.qmp.cont().await?;
                    }
                }
                live.state.pausing_build = None;
                live.state.save(dir)?;
                tracing::info!(sandbox = %live.state.id, "re-adopted running sandbox");
                let idx = live.slot.index;
                self.insert(live).map_err(|e| anyhow::anyhow!(e))?;
                Ok(Some(idx))
            }
            Err(e) => {
                tracing::warn!(sandbox = %state.id, "QEMU is gone ({e:#}); cleaning up");
                vmon_vm::process::kill_recorded(dir, &state.qemu_tag);
                let committed = match &state.pausing_build {
                    Some(b) => self.builds.get(b)?.is_some(),
                    None => false,
                };
                if !committed {
                    let _ = std::fs::remove_file(self.builds.artifact(&state.overlay));
                }
                let _ = std::fs::remove_file(SandboxState::path(dir));
                Ok(None)
            }
        }
    }

    /// Deletes artifacts nothing names any more.
    pub async fn sweep(&self) -> anyhow::Result<Vec<String>> {
        let _g = self.artifacts_guard.write().await;
        let mut live: HashSet<String> = HashSet::new();
        let lives: Vec<Arc<Mutex<Live>>> = self
            .sandboxes
            .lock()
            .map_err(|_| anyhow::anyhow!("sandbox table poisoned"))?
            .values()
            .cloned()
            .collect();
        for l in lives {
            let l = l.lock().await;
            live.extend(l.state.live_artifacts());
        }
        live.extend(self.pool.artifacts());
        if let Ok(m) = self.parked.lock() {
            for p in m.values() {
                live.extend(p.live.state.live_artifacts());
            }
        }
        let removed = self.builds.sweep(&live)?;
        if !removed.is_empty() {
            tracing::debug!(count = removed.len(), "swept artifacts");
        }
        Ok(removed)
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

    /// Boots a fresh sandbox straight from the image (no build): the slow path every build
    /// starts from.
    pub async fn boot_image(
        &self,
        sandbox_id: &str,
        vcpus: u32,
        memory_mb: u32,
        policy: &NetworkPolicy,
    ) -> Result<Running, NodeError> {
        if !valid_id(sandbox_id) {
            return Err(NodeError::InvalidArgument(format!(
                "{sandbox_id:?} is not a valid id"
            )));
        }
        let machine = self.machine(vcpus, memory_mb)?;
        crate::slots::validate_policy(policy).map_err(NodeError::InvalidArgument)?;
        let exec = new_id("e");
        let dir = self.sandbox_root(sandbox_id).join(&exec);
        let live = self
            .boot(
                &dir,
                sandbox_id,
                &exec,
                machine,
                None,
                self.image.manifest.disk_mb,
                policy,
                &InitRequest::default(),
                0,
            )
            .await
            .map_err(err)?;
        self.insert(live)
    }

    /// Finds sandboxes whose QEMU died and cleans up after them; returns their ids.
    pub async fn reap_dead(&self) -> Vec<String> {
        let lives: Vec<(String, Arc<Mutex<Live>>)> = match self.sandboxes.lock() {
            Ok(m) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => return Vec::new(),
        };
        let mut dead = Vec::new();
        for (id, l) in lives {
            let Ok(mut l) = l.try_lock() else { continue };
            let alive =
                l.vm.as_ref()
                    .is_some_and(|v| vmon_vm::process::is_alive(v.pid));
            if !alive {
                tracing::warn!(sandbox = %id, "QEMU died; cleaning up");
                self.remove(&id);
                if let Some(mut vm) = l.vm.take() {
                    vm.wait_exit(Duration::from_millis(100)).await;
                }
                self.destroy(&mut l, false).await;
                dead.push(id);
            }
        }
        dead
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

/// Copies a sparse file keeping its holes.
/// The `/init` after restoring `rec` for `spec`: its settings, authenticated with the token the
/// guest holds from the build.
fn restore_init(spec: &StartSpec, rec: &BuildRecord) -> InitRequest {
    InitRequest {
        env_vars: spec.env_vars.clone(),
        access_token: spec.envd_access_token.clone(),
        current_token: rec.envd_token.clone(),
        default_user: None,
    }
}

/// Counts a restore as in flight while alive.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(n: &'a std::sync::atomic::AtomicUsize) -> InFlight<'a> {
        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// True when less than [`PARK_MIN_AVAILABLE_PERCENT`] of host memory is available.
fn memory_is_short() -> bool {
    match meminfo_kib(["MemTotal", "MemAvailable"]) {
        [Some(total), Some(avail)] if total > 0 => avail * 100 < total * PARK_MIN_AVAILABLE_PERCENT,
        _ => false,
    }
}

fn sparse_copy(src: &Path, dst: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;
    let s = std::fs::File::open(src)?;
    let len = s.metadata()?.len();
    let d = std::fs::File::create(dst)?;
    d.set_len(len)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < len {
        let n = ((len - off) as usize).min(buf.len());
        s.read_exact_at(&mut buf[..n], off)?;
        if buf[..n].iter().any(|&b| b != 0) {
            d.write_all_at(&buf[..n], off)?;
        }
        off += n as u64;
    }
    d.sync_all()?;
    Ok(())
}

#[async_trait::async_trait]
impl NodeControl for Node {
    async fn build_template(&self, spec: TemplateSpec) -> Result<BuildInfo, NodeError> {
        if !valid_id(&spec.build_id) {
            return Err(NodeError::InvalidArgument(format!(
                "{:?} is not a valid build id",
                spec.build_id
            )));
        }
        if let Some(rec) = self.builds.get(&spec.build_id).map_err(err)? {
            return Ok(Self::info(&rec));
        }
        let machine = self.machine(spec.vcpus, spec.memory_mb)?;
        let exec = new_id("t");
        let dir = self
            .cfg
            .data_dir
            .join("run")
            .join(format!("template-{}", spec.build_id));
        let t0 = std::time::Instant::now();
        tracing::info!(build = %spec.build_id, "booting the template VM");
        let mut live = self
            .boot(
                &dir,
                &spec.build_id,
                &exec,
                machine,
                None,
                self.image.manifest.disk_mb.max(spec.disk_mb),
                &crate::slots::open_policy(),
                &InitRequest {
                    env_vars: spec.env_vars.clone(),
                    ..Default::default()
                },
                0,
            )
            .await
            .map_err(err)?;
        tracing::info!(build = %spec.build_id, secs = t0.elapsed().as_secs_f64(), "template VM is up");
        let result = async {
            let addr = SocketAddr::new(IpAddr::V4(live.slot.addr()), ENVD_PORT);
            if let Some(cmd) = &spec.start_cmd {
                let quoted = cmd.replace('\'', "'\\''");
                let out = envd_client::run(
                    addr,
                    None,
                    "user",
                    &format!("setsid -f bash -l -c '{quoted}' >/dev/null 2>&1 </dev/null"),
                    Duration::from_secs(60),
                )
                .await?;
                if out.exit_code != 0 {
                    bail!(
                        "start command could not be launched: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
            if let Some(ready) = &spec.ready_cmd {
                let start = tokio::time::Instant::now();
                loop {
                    let out = envd_client::run(addr, None, "user", ready, Duration::from_secs(60))
                        .await?;
                    if out.exit_code == 0 {
                        break;
                    }
                    if start.elapsed() > Duration::from_secs(600) {
                        bail!(
                            "ready command never succeeded: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            // Let the guest settle (page cache, deferred work) so restores start quiet.
            envd_client::run(addr, None, "root", "sync", Duration::from_secs(60)).await?;
            let vm = live.vm.as_ref().context("no VM")?;
            vm.qmp.stop().await?;
            let (dev, dev_path) = self.builds.new_artifact("dev", "state");
            vm.qmp.save_devices_state(&dev_path).await?;
            let RamSource::Shared { file } = live.state.ram.clone() else {
                bail!("template VM must own its RAM");
            };
            let rec = BuildRecord {
                id: spec.build_id.clone(),
                parent: None,
                machine: live.state.machine.clone(),
                image_hash: self.image.manifest.hash.clone(),
                mem_base: Some(file),
                layers: Vec::new(),
                devstate: Some(dev),
                disk: Some(live.state.overlay.clone()),
                disk_chain: Vec::new(),
                disk_mb: live.state.disk_mb,
                envd_version: ENVD_VERSION.into(),
                envd_token: None,
                resume_generation: 0,
                created_unix: now_unix(),
            };
            if let Some(vm) = live.vm.take() {
                vm.quit().await;
            }
            self.builds.put(&rec)?;
            anyhow::Ok(rec)
        }
        .await;
        self.destroy(&mut live, result.is_ok()).await;
        let _ = std::fs::remove_dir_all(&dir);
        let rec = result.map_err(err)?;
        tracing::info!(build = %rec.id, secs = t0.elapsed().as_secs_f64(), "template built");
        Ok(Self::info(&rec))
    }

    async fn build_info(&self, build_id: &str) -> Result<BuildInfo, NodeError> {
        self.record(build_id).map(|r| Self::info(&r))
    }

    async fn delete_build(&self, build_id: &str) -> Result<(), NodeError> {
        let rec = self.record(build_id)?;
        let lives: Vec<Arc<Mutex<Live>>> = self
            .sandboxes
            .lock()
            .map_err(|_| NodeError::Failed("sandbox table poisoned".into()))?
            .values()
            .cloned()
            .collect();
        for l in lives {
            let l = l.lock().await;
            if matches!(&l.state.ram, RamSource::Private { basis, .. } if basis == build_id) {
                return Err(NodeError::BuildInUse(build_id.to_string()));
            }
        }
        for p in self.pool.discard(build_id).await {
            self.discard_prepared(p).await;
        }
        self.discard_parked(build_id).await;
        self.builds.remove_record(build_id).map_err(err)?;
        if let Some(m) = rec.mem_base.as_deref() {
            // Blank processes go with the last build on their RAM base.
            let still_used = self
                .builds
                .list()
                .map_err(err)?
                .iter()
                .any(|r| r.mem_base.as_deref() == Some(m));
            if !still_used {
                for p in self.pool.discard(&blank_key(m)).await {
                    self.discard_prepared(p).await;
                }
                if let Ok(mut bm) = self.blank_machines.lock() {
                    bm.remove(m);
                }
            }
        }
        self.sweep().await.map_err(err)?;
        Ok(())
    }

    async fn start(&self, spec: StartSpec) -> Result<Running, NodeError> {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| NodeError::Failed("node is shutting down".into()))?;
        me.start_sandbox(spec).await
    }

    async fn kill(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
        let mut l = self.live_execution(sandbox_id, execution_id).await?;
        self.remove(sandbox_id);
        self.destroy(&mut l, false).await;
        Ok(())
    }

    async fn pause(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        let mut l = self.live_execution(sandbox_id, execution_id).await?;
        let _guard = self.artifacts_guard.read().await;
        let build_id = new_id("p");
        if !memory {
            Self::sync_guest(&l, "pause").await;
        }
        let vm =
            l.vm.as_ref()
                .ok_or_else(|| NodeError::Failed("sandbox has no VM".into()))?;
        vm.qmp.stop().await.map_err(|e| err(e.into()))?;
        // Park: keep the stopped QEMU for a fast resume. Its disk moves to a fresh overlay first
        // so the build's stays frozen whatever happens to the kept process.
        let park =
            memory && self.cfg.park_max > 0 && matches!(l.state.ram, RamSource::Private { .. });
        l.state.pausing_build = Some(build_id.clone());
        let captured = async {
            let (disk, chain) = if park {
                self.switch_disk(&mut l).await?
            } else {
                (l.state.overlay.clone(), l.state.disk_chain.clone())
            };
            l.state.save(&l.dir)?;
            let rec = self
                .capture(&l, &build_id, memory, true, disk, chain)
                .await?;
            fault("pause:captured");
            fault_err("pause:error")?;
            // The commit point: from here the pause has happened. QEMU is stopped, so its RAM
            // and the build's overlay no longer change; a crash before it quits is finished by
            // the next start (see `adopt`).
            self.builds.put(&rec)?;
            anyhow::Ok(rec)
        }
        .await;
        let rec = match captured {
            Ok(r) => r,
            Err(e) => {
                // A failed pause leaves the sandbox running.
                l.state.pausing_build = None;
                let _ = l.state.save(&l.dir);
                if let Some(vm) = l.vm.as_ref() {
                    let _ = vm.qmp.cont().await;
                }
                return Err(err(e));
            }
        };
        fault("pause:committed");
        self.remove(sandbox_id);
        if park {
            if let RamSource::Private { mem_base, .. } = &l.state.ram {
                l.state.ram = RamSource::Private {
                    mem_base: mem_base.clone(),
                    layers: rec.layers.clone(),
                    basis: rec.id.clone(),
                };
            }
            if l.state.save(&l.dir).is_ok() {
                let live = Live {
                    state: l.state.clone(),
                    vm: l.vm.take(),
                    slot: l.slot.clone(),
                    dir: l.dir.clone(),
                };
                if let Ok(mut m) = self.parked.lock() {
                    m.insert(
                        rec.id.clone(),
                        Parked {
                            live,
                            since: std::time::Instant::now(),
                        },
                    );
                }
                drop(l);
                self.evict_parked(false).await;
                return Ok(Self::info(&rec));
            }
        }
        if let Some(vm) = l.vm.take() {
            vm.quit().await;
        }
        // Artifacts now belong to the build.
        let _ = self.slots.release(&l.slot).await;
        let _ = std::fs::remove_file(SandboxState::path(&l.dir));
        for f in ["qmp.sock", "qemu.pid"] {
            let _ = std::fs::remove_file(l.dir.join(f));
        }
        if park {
            // Parking failed after the switch: the fresh overlay is nobody's.
            let _ = std::fs::remove_file(self.builds.artifact(&l.state.overlay));
        }
        if !memory {
            if let RamSource::Shared { file } = &l.state.ram {
                let _ = std::fs::remove_file(self.builds.artifact(file));
            }
        }
        Ok(Self::info(&rec))
    }

    async fn checkpoint(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        let mut l = self.live_execution(sandbox_id, execution_id).await?;
        let _guard = self.artifacts_guard.read().await;
        let build_id = new_id("c");
        let vm =
            l.vm.as_ref()
                .ok_or_else(|| NodeError::Failed("sandbox has no VM".into()))?;
        if !memory {
            Self::sync_guest(&l, "snapshot").await;
        }
        vm.qmp.stop().await.map_err(|e| err(e.into()))?;
        let result = async {
            let (frozen, chain) = self.switch_disk(&mut l).await?;
            l.state.save(&l.dir)?;
            let rec = self
                .capture(&l, &build_id, memory, false, frozen, chain)
                .await?;
            self.builds.put(&rec)?;
            if let RamSource::Private { mem_base, .. } = &l.state.ram {
                // Later captures of this sandbox compare with the checkpoint.
                l.state.ram = RamSource::Private {
                    mem_base: mem_base.clone(),
                    layers: rec.layers.clone(),
                    basis: rec.id.clone(),
                };
                l.state.save(&l.dir)?;
            }
            anyhow::Ok(rec)
        }
        .await;
        if let Some(vm) = l.vm.as_ref() {
            if let Err(e) = vm.qmp.cont().await {
                tracing::error!(sandbox = sandbox_id, "cont after checkpoint failed: {e}");
            }
        }
        let rec = result.map_err(err)?;
        if memory {
            // The source's own RNG must not be shared with its children: reseed it too.
            let addr = SocketAddr::new(IpAddr::V4(l.slot.addr()), ENVD_PORT);
            let token = l.state.envd_token.clone();
            let req = InitRequest {
                access_token: token.clone(),
                current_token: token,
                ..Default::default()
            };
            if let Err(e) = envd_client::init(addr, &req, Duration::from_secs(10)).await {
                tracing::warn!(sandbox = sandbox_id, "reseeding the source failed: {e:#}");
            }
        }
        Ok(Self::info(&rec))
    }

    async fn update_network(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        policy: NetworkPolicy,
    ) -> Result<(), NodeError> {
        crate::slots::validate_policy(&policy).map_err(NodeError::InvalidArgument)?;
        let mut l = self.live_execution(sandbox_id, execution_id).await?;
        l.slot.set_policy(&policy).await.map_err(err)?;
        l.state.network = Some(policy);
        let dir = l.dir.clone();
        l.state.save(&dir).map_err(err)
    }

    async fn list_running(&self) -> Vec<Running> {
        let lives: Vec<Arc<Mutex<Live>>> = match self.sandboxes.lock() {
            Ok(m) => m.values().cloned().collect(),
            Err(_) => return Vec::new(),
        };
        let mut out = Vec::new();
        for l in lives {
            let l = l.lock().await;
            out.push(Self::running(&l));
        }
        out
    }

    async fn metrics(
        &self,
        sandbox_id: &str,
        start_unix: i64,
        end_unix: i64,
    ) -> Result<Vec<MetricSample>, NodeError> {
        let dir = self.cfg.data_dir.clone();
        let id = sandbox_id.to_string();
        tokio::task::spawn_blocking(move || {
            crate::telemetry::read_samples(&dir, &id, start_unix, end_unix)
        })
        .await
        .map_err(|e| NodeError::Failed(format!("metrics task: {e}")))
    }

    async fn latest_metrics(&self, sandbox_ids: &[String]) -> Vec<(String, MetricSample)> {
        self.telemetry.latest_of(sandbox_ids)
    }

    async fn logs(&self, sandbox_id: &str, query: LogQuery) -> Result<Vec<LogEntry>, NodeError> {
        let consoles = self.console_logs(sandbox_id);
        tokio::task::spawn_blocking(move || {
            crate::telemetry::select(crate::telemetry::read_entries(&consoles), &query)
        })
        .await
        .map_err(|e| NodeError::Failed(format!("logs task: {e}")))
    }

    async fn pool_depths(&self) -> Vec<(String, usize)> {
        let builds = self.pool.builds();
        builds
            .into_iter()
            .map(|b| {
                let d = self.pool.depth(&b);
                (b, d)
            })
            .collect()
    }
}

impl Node {
    /// Starts a sandbox from a build: a memory restore, or a cold boot when asked or when the
    /// build has no memory.
    pub async fn start_sandbox(self: &Arc<Self>, spec: StartSpec) -> Result<Running, NodeError> {
        if !valid_id(&spec.sandbox_id) || !valid_id(&spec.execution_id) {
            return Err(NodeError::InvalidArgument(
                "sandbox and execution ids must be [A-Za-z0-9_-]".into(),
            ));
        }
        crate::slots::validate_policy(&spec.network).map_err(NodeError::InvalidArgument)?;
        if self.live(&spec.sandbox_id).is_ok() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {} is already running",
                spec.sandbox_id
            )));
        }
        let rec = self.record(&spec.build_id)?;
        self.check_compatible(&rec)?;
        if spec.cold_boot {
            let kept = self
                .parked
                .lock()
                .ok()
                .and_then(|m| m.get(&rec.id).map(|p| p.live.state.id == spec.sandbox_id))
                .unwrap_or(false);
            if kept {
                self.discard_parked(&rec.id).await;
            }
        }
        let t0 = std::time::Instant::now();
        // Held until the sandbox is in the table: a sweep must not take its new overlay.
        let mut guard = None;
        let live = if rec.has_memory() && !spec.cold_boot {
            guard = Some(self.artifacts_guard.read().await);
            self.restore(&spec, &rec).await.map_err(err)?
        } else {
            let dir = self.sandbox_root(&spec.sandbox_id).join(&spec.execution_id);
            let disk = rec.disk.as_deref().map(|d| (d, rec.disk_chain.as_slice()));
            self.boot(
                &dir,
                &spec.sandbox_id,
                &spec.execution_id,
                rec.machine.clone(),
                disk,
                rec.disk_mb,
                &spec.network,
                &InitRequest {
                    env_vars: spec.env_vars.clone(),
                    access_token: spec.envd_access_token.clone(),
                    current_token: None,
                    default_user: None,
                },
                0,
            )
            .await
            .map_err(err)?
        };
        tracing::info!(sandbox = %spec.sandbox_id, build = %rec.id, ms = t0.elapsed().as_millis() as u64, "sandbox started");
        let r = self.insert(live);
        drop(guard);
        r
    }
}
