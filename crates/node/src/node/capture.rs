//! Captures: pause and checkpoint of a running sandbox into a new build. The disk switches to a
//! fresh overlay (the old one freezes), the memory becomes a layer over the RAM base (or the
//! VM's own RAM file), and the device state is saved.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use vmon_proto::node::{BuildInfo, NodeError};
use vmon_vm::memory;

use super::parking::Parked;
use super::{err, Node};
use crate::builds::{new_id, now_unix, BuildRecord, PausedFrom, MAX_LAYERS};
use crate::envd_client::{self, InitRequest, ENVD_PORT};
use crate::sandbox::{Live, RamSource, SandboxState};

impl Node {
    /// Switches a stopped sandbox's disk to a fresh overlay; the old one freezes. Returns the
    /// frozen overlay and the chain under it.
    async fn switch_disk(&self, l: &mut Live) -> anyhow::Result<(String, Vec<String>)> {
        let vm = l.vm.as_ref().context("sandbox has no VM")?;
        let (next, next_path) = self.builds.new_artifact("disk", "qcow2");
        // QEMU creates it by name: it must be the QEMU's own.
        self.hand_new_to(&l.slot, &next_path)?;
        self.show(&l.dir, [next.as_str()])?;
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

    /// Captures memory (when asked) and device state of a *stopped* VM into a new build that
    /// shares this sandbox's disk `disk` (frozen). Does not resume or stop the VM. A capture
    /// that fails (a full disk) removes the files it made: nothing half-written stays.
    async fn capture(
        &self,
        live: &Live,
        build_id: &str,
        memory: bool,
        for_pause: bool,
        disk: String,
        disk_chain: Vec<String>,
    ) -> anyhow::Result<BuildRecord> {
        let mut made = Vec::new();
        let captured = self
            .capture_files(
                live, build_id, memory, for_pause, disk, disk_chain, &mut made,
            )
            .await;
        if captured.is_err() {
            for name in made {
                let _ = std::fs::remove_file(self.builds.artifact(&name));
                let _ = std::fs::remove_file(vmon_vm::process::view_dir(&live.dir).join(&name));
            }
        }
        captured
    }

    /// [`Node::capture`]'s work; names every artifact it makes in `made` first.
    #[allow(clippy::too_many_arguments)]
    async fn capture_files(
        &self,
        live: &Live,
        build_id: &str,
        memory: bool,
        for_pause: bool,
        disk: String,
        disk_chain: Vec<String>,
        made: &mut Vec<String>,
    ) -> anyhow::Result<BuildRecord> {
        let vm = live.vm.as_ref().context("sandbox has no VM")?;
        let mut rec = BuildRecord {
            id: build_id.to_string(),
            parent: None,
            machine: live.state.machine.clone(),
            image_hash: self.image().await?.manifest.hash.clone(),
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
            // The template's warm request is for its unused services; a snapshot's have run.
            warm_request: None,
            paused_from: for_pause.then(|| PausedFrom {
                sandbox_id: live.state.id.clone(),
                execution_id: live.state.execution_id.clone(),
            }),
        };
        if !memory {
            return Ok(rec);
        }
        let (dev, dev_path) = self.builds.new_artifact("dev", "state");
        made.push(dev.clone());
        self.hand_new_to(&live.slot, &dev_path)?;
        self.show(&live.dir, [dev.as_str()])?;
        vm.qmp.save_devices_state(&dev_path).await?;
        rec.devstate = Some(dev);
        match &live.state.ram {
            RamSource::Private {
                mem_base,
                layers,
                basis,
            } => {
                rec.parent = Some(basis.clone());
                rec.mem_base = Some(mem_base.clone());
                rec.layers = self.capture_layer(vm.pid, mem_base, layers, made).await?;
            }
            RamSource::Shared { file } if for_pause => {
                // The VM stops for good: its own RAM file becomes the base, no copy.
                std::fs::File::open(self.builds.artifact(file))?.sync_all()?;
                rec.mem_base = Some(file.clone());
            }
            RamSource::Shared { file } => {
                // The running VM keeps writing its file: the build gets a copy.
                let (copy, copy_path) = self.builds.new_artifact("ram", "mem");
                made.push(copy.clone());
                let src = self.builds.artifact(file);
                tokio::task::spawn_blocking(move || sparse_copy(&src, &copy_path))
                    .await
                    .map_err(|e| anyhow::anyhow!("copy task: {e}"))??;
                rec.mem_base = Some(copy);
            }
        }
        Ok(rec)
    }

    /// The memory layer of QEMU `pid` over its RAM base `mem_base`: the pages that differ
    /// from the base and from `layers` (a new stack once it holds [`MAX_LAYERS`]). Returns the
    /// build's layers; a layer that found no page changed is left out (unless it is the first).
    async fn capture_layer(
        &self,
        pid: u32,
        mem_base: &str,
        layers: &[String],
        made: &mut Vec<String>,
    ) -> anyhow::Result<Vec<String>> {
        let flatten = layers.len() >= MAX_LAYERS;
        let (layer, layer_path) = self.builds.new_artifact("layer", "mem");
        made.push(layer.clone());
        let ram_file = self.builds.artifact(mem_base);
        let layer_files: Option<Vec<PathBuf>> = (!flatten && !layers.is_empty())
            .then(|| layers.iter().map(|l| self.builds.artifact(l)).collect());
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
        let mut kept = if flatten { Vec::new() } else { layers.to_vec() };
        if stats.pages > 0 || kept.is_empty() {
            kept.push(layer);
        } else {
            let _ = std::fs::remove_file(self.builds.artifact(&layer));
        }
        Ok(kept)
    }

    /// The start of a capture (`why`: a pause or a snapshot): room on the data dir's disk,
    /// the execution taken and the artifacts guard held, whether its memory can be kept (a
    /// guest with volumes keeps part of its state in virtiofsd, one with GPUs in its devices:
    /// disk only), the guest stopped (its page cache synced first when only its disk is kept),
    /// then its object-store volumes written back whole; when that fails the guest runs on and
    /// the capture fails.
    async fn stop_for_capture(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
        why: &str,
    ) -> Result<Stopped<'_>, NodeError> {
        crate::config::check_free(&self.cfg.data_dir, self.cfg.min_free_mb)?;
        let l = self.live_execution(sandbox_id, execution_id).await?;
        let guard = self.artifacts_guard.read().await;
        let memory = memory && l.state.volumes.is_empty() && l.state.gpu_groups.is_empty();
        if !memory {
            Self::sync_guest(&l, why).await;
        }
        let vm =
            l.vm.as_ref()
                .ok_or_else(|| NodeError::Failed("sandbox has no VM".into()))?;
        vm.qmp.stop().await.map_err(|e| err(e.into()))?;
        if let Err(e) = self.write_back_all(&l.state.volumes).await {
            let _ = vm.qmp.cont().await;
            return Err(e);
        }
        Ok(Stopped {
            live: l,
            _guard: guard,
            memory,
        })
    }

    /// Pauses a sandbox into a new build (with its memory when `memory`), parking its QEMU when it may.
    ///
    /// Fault points (`vmon_faults`, crash tests): `pause:switched` (QEMU writes to a fresh
    /// overlay the sandbox's state file does not name yet), `pause:captured` (artifacts
    /// written, no record), `pause:error` (there, the pause fails), `pause:committed` (record
    /// written, QEMU not yet gone).
    pub(super) async fn pause_sandbox(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        let Stopped {
            live: mut l,
            _guard,
            memory,
        } = self
            .stop_for_capture(sandbox_id, execution_id, memory, "pause")
            .await?;
        let build_id = new_id("p");
        // Park: keep the stopped QEMU for a fast resume. Its disk moves to a fresh overlay first
        // so the build's stays frozen whatever happens to the kept process.
        let park =
            memory && self.cfg.park_max > 0 && matches!(l.state.ram, RamSource::Private { .. });
        l.state.pausing_build = Some(build_id.clone());
        let rec = match self.capture_pause(&mut l, &build_id, memory, park).await {
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
        self.cfg.faults.point("pause:committed", sandbox_id).await;
        self.remove(sandbox_id);
        if park && self.park(&mut l, &rec) {
            drop(l);
            // The kept QEMU writes to a fresh overlay: the build's files are frozen.
            self.upload_later(&rec);
            self.evict_parked(false).await;
            return Ok(Self::info(&rec));
        }
        self.end_paused(&mut l, sandbox_id, memory, park).await;
        // Uploaded once QEMU has closed the build's overlay and RAM file for good.
        self.upload_later(&rec);
        Ok(Self::info(&rec))
    }

    /// A pause's capture of the stopped sandbox, up to its commit point (the record written);
    /// with `park` its disk first switches to a fresh overlay the kept QEMU goes on with.
    async fn capture_pause(
        &self,
        l: &mut Live,
        build_id: &str,
        memory: bool,
        park: bool,
    ) -> anyhow::Result<BuildRecord> {
        let faults = &self.cfg.faults;
        let id = l.state.id.clone();
        let (disk, chain) = if park {
            let switched = self.switch_disk(l).await?;
            faults.point("pause:switched", &id).await;
            switched
        } else {
            (l.state.overlay.clone(), l.state.disk_chain.clone())
        };
        l.state.save(&l.dir)?;
        let rec = self.capture(l, build_id, memory, true, disk, chain).await?;
        faults.point("pause:captured", &id).await;
        faults.fallible("pause:error", &id).await?;
        // The commit point: from here the pause has happened. QEMU is stopped, so its RAM and
        // the build's overlay no longer change; a crash before it quits is finished by the
        // next start (see `adopt`).
        self.builds.put(&rec)?;
        Ok(rec)
    }

    /// Keeps a paused sandbox's stopped QEMU for a fast resume of `rec`; false when its state
    /// could not be saved (then it ends as any pause does).
    fn park(&self, l: &mut Live, rec: &BuildRecord) -> bool {
        layer_later_captures_over(&mut l.state, rec);
        if l.state.save(&l.dir).is_err() {
            return false;
        }
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
        true
    }

    /// A paused sandbox that is not parked ends: its QEMU quits and gives its GPUs, slot and
    /// files back; the artifacts it used now belong to the build.
    async fn end_paused(&self, l: &mut Live, sandbox_id: &str, memory: bool, park: bool) {
        if let Some(vm) = l.vm.take() {
            vm.quit().await;
        }
        // Its QEMU is gone: its GPUs are free, its bucket mounts' caches (written back above)
        // are refilled by the resume, wherever it runs.
        self.gpus.release(sandbox_id);
        self.drop_bucket_caches(&l.state.volumes).await;
        self.egress.stop(&l.state.id, None).await;
        let _ = self.slots.release(&l.slot).await;
        let _ = std::fs::remove_file(SandboxState::path(&l.dir));
        vmon_vm::process::clear_files(&l.dir);
        if park {
            // Parking failed after the switch: the fresh overlay is nobody's.
            let _ = std::fs::remove_file(self.builds.artifact(&l.state.overlay));
        }
        if !memory {
            if let RamSource::Shared { file } = &l.state.ram {
                let _ = std::fs::remove_file(self.builds.artifact(file));
            }
        }
    }

    /// Captures a running sandbox into a new build (with its memory when `memory`); it keeps running.
    ///
    /// Fault point: `checkpoint:committed` (a fork's or snapshot's build record written, before
    /// the api's record names it; the source is still stopped).
    pub(super) async fn checkpoint_sandbox(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        // A snapshot's or fork's object-store volumes go back as they are now.
        let Stopped {
            live: mut l,
            _guard,
            memory,
        } = self
            .stop_for_capture(sandbox_id, execution_id, memory, "snapshot")
            .await?;
        let build_id = new_id("c");
        let result = async {
            let (frozen, chain) = self.switch_disk(&mut l).await?;
            l.state.save(&l.dir)?;
            let rec = self
                .capture(&l, &build_id, memory, false, frozen, chain)
                .await?;
            self.builds.put(&rec)?;
            self.cfg
                .faults
                .point("checkpoint:committed", sandbox_id)
                .await;
            self.upload_later(&rec);
            if layer_later_captures_over(&mut l.state, &rec) {
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
}

/// A sandbox stopped for a capture: its execution, the artifacts guard, whether its memory
/// is kept.
struct Stopped<'a> {
    live: tokio::sync::OwnedMutexGuard<Live>,
    _guard: tokio::sync::RwLockReadGuard<'a, ()>,
    memory: bool,
}

/// Later memory captures of the sandbox are layers over `rec` (its layers, it as their basis),
/// when its RAM is its own; whether it is.
fn layer_later_captures_over(state: &mut SandboxState, rec: &BuildRecord) -> bool {
    let RamSource::Private { mem_base, .. } = &state.ram else {
        return false;
    };
    state.ram = RamSource::Private {
        mem_base: mem_base.clone(),
        layers: rec.layers.clone(),
        basis: rec.id.clone(),
    };
    true
}

/// Copies a sparse file keeping its holes.
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
