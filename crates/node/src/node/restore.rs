//! Restores: a sandbox started from a build's memory. A restore takes a warmed pooled process,
//! a blank one given the build's disk and layers (write-in), or a fresh one, then loads the
//! device state and `/init`s the guest. Also the warm-up of pooled processes (with a
//! template's warm request, [`warm_service`]) and `start_sandbox`, which picks a restore or a
//! cold boot.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use vmon_proto::node::{NetworkPolicy, NodeError, Running, StartSpec};
use vmon_vm::cgroup::{self, Weight};
use vmon_vm::disk::{create_overlay, BackingFormat};
use vmon_vm::machine::RamSharing;
use vmon_vm::{memory, LaunchSpec, MachineDesc, NetDevice, Vm};

use super::{err, restore_init, valid_id, Node};
use crate::builds::{new_id, BuildRecord};
use crate::envd_client::{self, InitRequest, ENVD_PORT};
use crate::pool::{blank_key, Held, Prepared};
use crate::sandbox::{Live, SandboxState};
use crate::slots::TAP;

impl Node {
    /// A restore only loads into the machine a build was made on.
    pub(super) fn check_compatible(&self, rec: &BuildRecord) -> Result<(), NodeError> {
        let m = &rec.machine;
        if m.accel != self.accel.accel || m.qemu_version != self.qemu.line {
            return Err(NodeError::InvalidArgument(format!(
                "build {} was made with {} on {} and cannot restore here ({} on {})",
                rec.id,
                m.accel.as_str(),
                m.qemu_version,
                self.accel.accel.as_str(),
                self.qemu.line
            )));
        }
        Ok(())
    }

    /// Spawns a QEMU waiting for `migrate-incoming` on `rec`'s memory, with its own slot and
    /// overlay, and its layers already written in.
    ///
    /// With `warm`, the process also loads the device state, runs the guest until envd has
    /// answered a few requests (so QEMU's translation cache holds the hot paths: under TCG the
    /// first request after a load costs most of a restore), and stops it again. A claim then
    /// costs `cont` and `/init`. Only template builds are warmed: their guest running a moment
    /// longer before its first claim is indistinguishable from a template captured later.
    ///
    /// `weight` is the CPU weight it runs at until claimed: a refill ahead of demand runs in
    /// the background, behind sandboxes and waiting creates. A refill names it to the pool as
    /// `pool_key`'s process in the making (the pool may raise its weight).
    pub(super) async fn prepare(
        &self,
        rec: &BuildRecord,
        warm: bool,
        weight: Weight,
        pool_key: Option<&str>,
    ) -> anyhow::Result<Prepared> {
        let Some(mem_base) = rec.mem_base.clone() else {
            bail!("build {} has no memory", rec.id);
        };
        let blank = self
            .prepare_blank(&mem_base, &rec.machine, weight, pool_key)
            .await?;
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
    pub(super) async fn prepare_blank(
        &self,
        mem_base: &str,
        machine: &MachineDesc,
        weight: Weight,
        pool_key: Option<&str>,
    ) -> anyhow::Result<Prepared> {
        let slot = self.slots.acquire(&crate::slots::open_policy()).await?;
        self.slots.refill();
        let tag = new_id("");
        let run_dir = self.cfg.data_dir.join("pool").join(&tag);
        let r = async {
            std::fs::create_dir_all(&run_dir)?;
            let ram_fd = self.ram_base(mem_base).await?;
            // Empty until a build is given to it (fill_blank).
            let view = self.view_for(&run_dir)?;
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
                fs_shares: Vec::new(),
                user: self.qemu_user(&slot),
                ram_fd,
                view,
                weight,
                // A restore never carries passed-through devices: GPU sandboxes cold-boot.
                vfio: Vec::new(),
            })
            .await?;
            if let Some(key) = pool_key {
                self.pool.making(key, &tag, weight);
            }
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
                weight,
                held: None,
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
        p.held = Some(self.held_artifacts.hold(&overlay));
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
                    let rootfs = &self.image().await?.rootfs;
                    create_overlay(rootfs, BackingFormat::Raw, &overlay_path).await?
                }
            }
            self.hand_to(&p.slot, &overlay_path)?;
            self.show(
                &p.run_dir,
                rec.disk
                    .iter()
                    .chain(rec.disk_chain.iter())
                    .map(String::as_str)
                    .chain([overlay.as_str()]),
            )?;
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
        if let Some(warm) = &rec.warm_request {
            // Best effort: a service that does not answer leaves the process warmed as far as
            // envd, and the sandbox works the same, its first request slower.
            if let Err(e) = warm_service(slot.addr(), warm, token).await {
                tracing::debug!(build = %rec.id, warm = %warm, "warm request failed: {e:#}");
            }
        }
        vm.qmp.stop().await?;
        Ok(())
    }

    /// Restores `rec` for a sandbox: a pooled process when one is ready, else a fresh one.
    async fn restore(
        self: &Arc<Self>,
        spec: &StartSpec,
        rec: &BuildRecord,
    ) -> anyhow::Result<(Live, Origin)> {
        let (Some(mem_base), Some(devstate)) = (rec.mem_base.clone(), rec.devstate.clone()) else {
            bail!("build {} has no memory to restore", rec.id);
        };
        if let Some(live) = self.unpark(&rec.id, &spec.sandbox_id) {
            match self.resume_parked(spec, rec, live).await {
                Ok(live) => return Ok((live, Origin::Parked)),
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
        let (prepared, origin) = self.process_for(rec, &blanks, pooled).await?;
        // Claimed: from now on it is a sandbox's guest.
        let prepared = claimed(prepared);
        let run_dir = self.sandbox_root(&spec.sandbox_id).join(&spec.execution_id);
        let r = self
            .start_claimed(spec, rec, mem_base, &devstate, &prepared, &run_dir)
            .await;
        if rec.parent.is_none() {
            // Templates are hot: keep a process ready (started only now, so the refill does
            // not compete with this claim). Paused builds restore once.
            self.pool.refill(self.clone(), rec.id.clone());
        }
        self.pool.refill(self.clone(), blanks.clone());
        let Prepared {
            slot,
            overlay,
            mut vm,
            run_dir: pool_dir,
            ..
        } = prepared;
        match r {
            Ok(state) => Ok((
                Live {
                    state,
                    vm: Some(vm),
                    slot,
                    dir: run_dir,
                },
                origin,
            )),
            Err(e) => {
                vm.kill().await;
                let _ = self.slots.release(&slot).await;
                let _ = std::fs::remove_file(self.builds.artifact(&overlay));
                let _ = std::fs::remove_dir_all(&pool_dir);
                Err(e)
            }
        }
    }

    /// The process a restore of `rec` claims: the build's own pooled one, else a blank one of
    /// the same machine filled with the build, else a fresh one.
    async fn process_for(
        self: &Arc<Self>,
        rec: &BuildRecord,
        blanks: &str,
        pooled: Option<Prepared>,
    ) -> anyhow::Result<(Prepared, Origin)> {
        if let Some(p) = pooled {
            return Ok((p, Origin::Warm));
        }
        Ok(match self.pool.take(blanks) {
            // Full weight before it is filled: a blank still at a refill's weight could wait
            // tens of seconds for the CPU to answer its disk's attach on a busy host (a resume
            // failed so: "QMP blockdev-add timed out").
            Some(b) if b.vm_matches(&rec.machine) => {
                (self.fill_blank(rec, claimed(b)).await?, Origin::Blank)
            }
            Some(b) => {
                self.discard_prepared(b).await;
                (
                    self.prepare(rec, false, Weight::Normal, None).await?,
                    Origin::Fresh,
                )
            }
            None => (
                self.prepare(rec, false, Weight::Normal, None).await?,
                Origin::Fresh,
            ),
        })
    }

    /// Makes a claimed process the sandbox's: its run dir moved to the sandbox's, its network
    /// policy, the device state loaded (unless warmed), `cont`, envd's `/init`; the sandbox's
    /// state saved for re-adoption.
    async fn start_claimed(
        &self,
        spec: &StartSpec,
        rec: &BuildRecord,
        mem_base: String,
        devstate: &str,
        p: &Prepared,
        run_dir: &Path,
    ) -> anyhow::Result<SandboxState> {
        if let Some(parent) = run_dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        if run_dir.exists() {
            std::fs::remove_dir_all(run_dir)?;
        }
        std::fs::rename(&p.run_dir, run_dir)?;
        if p.loaded {
            // What the guest printed while it warmed up in the pool is not this sandbox's:
            // log readers start after this many console bytes.
            let len = std::fs::metadata(run_dir.join("console.log"))
                .map(|m| m.len())
                .unwrap_or(0);
            std::fs::write(run_dir.join("console.skip"), len.to_string())?;
        }
        if spec.network != crate::slots::open_policy() {
            p.slot
                .set_policy(&spec.network, self.slots.perimeter())
                .await?;
        }
        let t0 = std::time::Instant::now();
        if !p.loaded {
            p.vm.qmp
                .migrate_incoming_file(&self.builds.artifact(devstate))
                .await?;
        }
        let t_load = t0.elapsed();
        p.vm.qmp.cont().await?;
        let t_cont = t0.elapsed();
        let addr = SocketAddr::new(IpAddr::V4(p.slot.addr()), ENVD_PORT);
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
            envd_token: spec.envd_access_token.clone(),
            resume_generation: rec.resume_generation + 1,
            network: Some(spec.network.clone()),
            start_kind: Some(vmon_proto::node::StartKind::Restore),
            ..SandboxState::over_build(
                rec,
                mem_base,
                &spec.sandbox_id,
                &spec.execution_id,
                p.slot.index,
                p.overlay.clone(),
                p.tag.clone(),
            )
        };
        state.save(run_dir)?;
        Ok(state)
    }
}

impl Node {
    /// How many sandboxes this node started, by where their QEMU came from: `pool` (a warmed
    /// process of the build's pool), `blank`, `fresh`, `parked` or `cold_boot`.
    pub fn starts_by_origin(&self) -> HashMap<String, u64> {
        self.starts
            .lock()
            .map(|n| n.iter().map(|(k, v)| (k.to_string(), *v)).collect())
            .unwrap_or_default()
    }

    /// Starts a sandbox from a build: a memory restore, or a cold boot when asked or when the
    /// build has no memory.
    pub async fn start_sandbox(self: &Arc<Self>, spec: StartSpec) -> Result<Running, NodeError> {
        self.vet_arrival(&spec.sandbox_id, &spec.execution_id, &spec.network)
            .await?;
        let shares = spec.volumes.clone();
        let started = self.start_mounted(spec).await;
        if started.is_err() {
            // Its bucket mounts' caches are its own: nothing else mounts them.
            self.drop_bucket_caches(&shares).await;
        }
        started
    }

    /// [`Self::start_sandbox`] once the start is known to be new: mounts filled, then booted
    /// or restored.
    async fn start_mounted(self: &Arc<Self>, spec: StartSpec) -> Result<Running, NodeError> {
        self.fill_store_volumes(&spec.volumes).await?;
        self.fill_buckets(&spec.volumes).await?;
        super::volumes::validate(&self.cfg.volumes_dir, &spec.volumes)?;
        let rec = self.record(&spec.build_id)?;
        self.check_compatible(&rec)?;
        // A mount's state lives outside the guest's memory, and a passed-through device's
        // inside no snapshot: never restore either (the pool never serves them).
        let cold_boot = must_cold_boot(&spec);
        // Taken before the boot, given back if it fails.
        let gpus = self.gpus.take(&spec.sandbox_id, spec.gpus)?;
        if cold_boot {
            self.discard_own_parked(&rec.id, &spec.sandbox_id).await;
        }
        let t0 = std::time::Instant::now();
        // Held until the sandbox is in the table: a sweep must not take its new overlay.
        let mut guard = None;
        let (live, held, origin) = if rec.has_memory() && !cold_boot {
            guard = Some(self.artifacts_guard.read().await);
            let (live, origin) = self.restore(&spec, &rec).await.map_err(err)?;
            (live, Vec::new(), origin)
        } else {
            let (live, held) = self.cold_start(&spec, &rec, &gpus).await.map_err(|e| {
                self.gpus.release(&spec.sandbox_id);
                err(e)
            })?;
            (live, held, Origin::ColdBoot)
        };
        if let Ok(mut n) = self.starts.lock() {
            *n.entry(origin.as_str()).or_default() += 1;
        }
        tracing::info!(
            sandbox = %spec.sandbox_id,
            build = %rec.id,
            from = origin.as_str(),
            ms = t0.elapsed().as_millis() as u64,
            "sandbox started"
        );
        let r = self.insert(live);
        drop(guard);
        drop(held);
        let running = r.inspect_err(|_| {
            self.gpus.release(&spec.sandbox_id);
        })?;
        if let Err(e) = self.start_egress(&spec).await {
            tracing::warn!(sandbox = %spec.sandbox_id, error = %e, "egress setup failed; the sandbox is killed");
            let _ = vmon_proto::node::NodeCalls::kill(
                self.as_ref(),
                &spec.sandbox_id,
                &spec.execution_id,
            )
            .await;
            return Err(e);
        }
        Ok(running)
    }

    /// Checks a sandbox about to arrive on this node (a start, or a migration's target): its
    /// ids, its network policy against this node's rules, and that it does not run here.
    pub(super) async fn vet_arrival(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        network: &NetworkPolicy,
    ) -> Result<(), NodeError> {
        if !valid_id(sandbox_id) || !valid_id(execution_id) {
            return Err(NodeError::InvalidArgument(
                "sandbox and execution ids must be [A-Za-z0-9_-]".into(),
            ));
        }
        self.slots
            .vet(network)
            .await
            .map_err(NodeError::InvalidArgument)?;
        if self.live(sandbox_id).is_ok() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {sandbox_id} already runs on this node"
            )));
        }
        Ok(())
    }

    /// A cold boot of `spec` from `rec` makes its QEMU anew: a stopped one kept (parked) for
    /// the same sandbox from that build goes.
    async fn discard_own_parked(&self, build_id: &str, sandbox_id: &str) {
        let kept = self
            .parked
            .lock()
            .ok()
            .and_then(|m| m.get(build_id).map(|p| p.live.state.id == sandbox_id))
            .unwrap_or(false);
        if kept {
            self.discard_parked(build_id).await;
        }
    }

    /// A cold boot of `spec` over `rec`'s disk (or the image's, for a build without one),
    /// with `gpus` passed through.
    async fn cold_start(
        &self,
        spec: &StartSpec,
        rec: &BuildRecord,
        gpus: &[vmon_vm::vfio::IommuGroup],
    ) -> anyhow::Result<(Live, Vec<Held>)> {
        let dir = self.sandbox_root(&spec.sandbox_id).join(&spec.execution_id);
        let disk = match rec.disk.as_deref() {
            Some(top) => super::boot::BootDisk::Build {
                top,
                below: rec.disk_chain.as_slice(),
            },
            None => super::boot::BootDisk::Image,
        };
        self.boot(super::boot::Boot {
            run_dir: &dir,
            id: &spec.sandbox_id,
            execution_id: &spec.execution_id,
            machine: rec.machine.clone(),
            disk,
            disk_mb: rec.disk_mb,
            policy: &spec.network,
            init: &InitRequest {
                env_vars: spec.env_vars.clone(),
                access_token: spec.envd_access_token.clone(),
                current_token: None,
                default_user: None,
                volume_mounts: Vec::new(),
            },
            volumes: &spec.volumes,
            gpus,
        })
        .await
    }
}

/// Whether a start cold-boots whatever the build holds: asked to, volumes mounted (their
/// state is outside the guest's memory) or GPUs passed through (a device's state is in no
/// snapshot, and a restored guest would find its driver's view of the card stale).
pub(super) fn must_cold_boot(spec: &StartSpec) -> bool {
    spec.cold_boot || !spec.volumes.is_empty() || spec.gpus > 0
}

/// Where a started sandbox's QEMU came from (logged with "sandbox started", counted by the pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// A warmed process of the build's pool: `cont` and `/init`.
    Warm,
    /// A blank process of its RAM base, given the build's disk and layers.
    Blank,
    /// A process spawned for it (the pools had nothing).
    Fresh,
    /// The paused sandbox's own stopped QEMU.
    Parked,
    /// Booted from disk.
    ColdBoot,
}

impl Origin {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Origin::Warm => "pool",
            Origin::Blank => "blank",
            Origin::Fresh => "fresh",
            Origin::Parked => "parked",
            Origin::ColdBoot => "cold_boot",
        }
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

/// A process taken from the pool for a waiting request: it runs at full CPU weight from now on
/// (a refill runs at a low one, behind sandboxes and waiting requests).
fn claimed(mut p: Prepared) -> Prepared {
    if p.weight != Weight::Normal {
        if let Err(e) = cgroup::set_weight(&p.tag, Weight::Normal) {
            tracing::debug!(tag = %p.tag, "restoring a claimed process's CPU weight: {e:#}");
        }
        p.weight = Weight::Normal;
    }
    p
}

/// POSTs a template's warm request (`port/path`) to the guest at `ip` with the build's token,
/// twice (the second runs what the first's translation left cold).
async fn warm_service(ip: Ipv4Addr, warm: &str, token: Option<&str>) -> anyhow::Result<()> {
    let (port, path) = warm
        .split_once('/')
        .context("a warm request is port/path")?;
    let port: u16 = port.parse().context("a warm request's port")?;
    let addr = SocketAddr::new(IpAddr::V4(ip), port);
    let path = format!("/{path}");
    let mut headers = vec![("content-type", "application/json".to_string())];
    if let Some(t) = token {
        headers.push(("x-access-token", t.to_string()));
    }
    for _ in 0..2 {
        let (status, _) = envd_client::request(
            addr,
            "POST",
            &path,
            &headers,
            b"{}".to_vec(),
            Duration::from_secs(60),
        )
        .await?;
        if !(200..300).contains(&status) {
            bail!("{path} answered {status}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(cold_boot: bool, gpus: u32) -> StartSpec {
        StartSpec {
            sandbox_id: "s".into(),
            execution_id: "e".into(),
            build_id: "b".into(),
            cold_boot,
            env_vars: Default::default(),
            envd_access_token: None,
            network: Default::default(),
            volumes: Vec::new(),
            egress: Default::default(),
            gpus,
        }
    }

    #[test]
    fn gpu_sandboxes_always_cold_boot() {
        assert!(!must_cold_boot(&spec(false, 0)), "a plain start restores");
        assert!(must_cold_boot(&spec(true, 0)));
        // Asked for a restore, a GPU sandbox still boots: the pool never serves it.
        assert!(must_cold_boot(&spec(false, 1)));
        let mut v = spec(false, 0);
        v.volumes.push(vmon_proto::node::VolumeShare {
            volume_id: "v".into(),
            path: "/data".into(),
            ..Default::default()
        });
        assert!(must_cold_boot(&v));
    }
}
