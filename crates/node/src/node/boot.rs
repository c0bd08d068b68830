//! Cold boots: a fresh QEMU over the image's rootfs or a build's disk, with its own shared RAM
//! file, waited for until envd answers. Template builds and `boot_image` start here.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use vmon_proto::node::{NetworkPolicy, NodeError, Running, VolumeShare};
use vmon_vm::disk::{create_overlay, BackingFormat};
use vmon_vm::machine::{kernel_cmdline, RamSharing};
use vmon_vm::{LaunchSpec, MachineDesc, NetDevice, Vm};

use super::{err, valid_id, Node, ENVD_VERSION};
use crate::builds::new_id;
use crate::envd_client::{self, InitRequest, ENVD_PORT};
use crate::pool::Held;
use crate::sandbox::{Live, RamSource, SandboxState};
use crate::slots::{Slot, TAP};

/// What a cold boot's overlay is made over.
#[derive(Debug, Clone, Copy)]
pub(super) enum BootDisk<'a> {
    /// The image's raw rootfs.
    Image,
    /// A build's frozen qcow2 `top` and the chain under it.
    Build { top: &'a str, below: &'a [String] },
    /// A raw disk just made elsewhere on this filesystem (an OCI image's rootfs): moved into
    /// the artifacts here, under the guard a sweep waits for, so it is never swept before the
    /// overlay over it names it.
    NewRaw(&'a Path),
}

/// One cold boot: where, what and for whom ([`Node::boot`]).
pub(super) struct Boot<'a> {
    pub run_dir: &'a Path,
    pub id: &'a str,
    pub execution_id: &'a str,
    pub machine: MachineDesc,
    pub disk: BootDisk<'a>,
    pub disk_mb: u32,
    pub policy: &'a NetworkPolicy,
    pub init: &'a InitRequest,
    pub volumes: &'a [VolumeShare],
    /// IOMMU groups passed through (a GPU sandbox), already taken for it.
    pub gpus: &'a [vmon_vm::vfio::IommuGroup],
}

/// What a boot's virtio-fs daemons share with its QEMU: its tag (their cgroups), limits, user.
fn share<'a>(
    qemu_tag: &'a str,
    limits: vmon_vm::cgroup::Limits,
    user: &'a Option<vmon_vm::QemuUser>,
) -> super::volumes::ShareContext<'a> {
    super::volumes::ShareContext {
        qemu_tag,
        limits,
        user: user.as_ref(),
    }
}

/// Waits for envd to answer within `left`, then hands it its start (`init`).
async fn wait_ready(addr: SocketAddr, init: &InitRequest, left: Duration) -> anyhow::Result<()> {
    envd_client::wait_healthy(addr, left).await?;
    envd_client::init(addr, init, Duration::from_secs(60)).await
}

/// The last 15 lines the guest wrote to its console (of its last 64 KiB: the guest wrote it).
fn console_tail(log: &Path) -> String {
    let console = vmon_vm::console::read_tail(log, 64 << 10).unwrap_or_default();
    let lines: Vec<&str> = console.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Empties a RAM file and gives it back its size: every page reads as zero again.
fn zero_file(path: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    let len = f.metadata()?.len();
    f.set_len(0)?;
    f.set_len(len)
}

impl Node {
    /// Whether the guest just launched at `addr` is stuck: it has neither answered nor written
    /// its disk `boot_stall_after` into its boot (its root is mounted read-write before its init
    /// runs, seconds in). Stuck: the vCPUs' positions, for the log. A boot wedged in the kernel
    /// or the initramfs is rare under TCG, and a new QEMU gets past it.
    async fn stalled(&self, vm: &Vm, addr: SocketAddr) -> Option<String> {
        let after = self.cfg.boot_stall_after;
        if after >= self.cfg.boot_timeout
            || envd_client::wait_healthy(addr, after).await.is_ok()
            || !matches!(vm.qmp.disk_writes().await, Ok(0))
        {
            return None;
        }
        Some(vm.qmp.cpu_positions().await.unwrap_or_default().join("; "))
    }

    /// Cold boots this node started again because their first QEMU made no progress.
    pub fn boot_restarts(&self) -> u64 {
        self.boot_restarts
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(super) fn machine(
        &self,
        image: &vmon_image::Image,
        vcpus: u32,
        memory_mb: u32,
    ) -> Result<MachineDesc, NodeError> {
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
            qemu_version: self.qemu.line.clone(),
            accel: self.accel.accel,
            cpu_model: self.accel.accel.cpu_model().to_string(),
            vcpus,
            memory_mb,
            kernel: image.vmlinuz.clone(),
            initrd: image.initrd.clone(),
            // Under TCG a translated block is found again only at the same virtual address:
            // with address-space randomisation every new process (each command's shell, its
            // libraries) is translated afresh and soon flushes the whole cache. The guest is
            // the isolation boundary, not its processes; under KVM nothing is translated.
            cmdline: kernel_cmdline(match self.accel.accel {
                vmon_vm::accel::Accel::Tcg => "norandmaps",
                vmon_vm::accel::Accel::Kvm => "",
            }),
            trimmed: true,
        })
    }

    /// Cold-boots a VM with its own shared RAM file over its disk (the image rootfs when
    /// [`BootDisk::Image`]). Its artifacts come back held (taken before the artifacts guard is
    /// let go): a sweep keeps them until the caller drops the holds, once something names them
    /// (the sandbox table, a build record).
    pub(super) async fn boot(&self, b: Boot<'_>) -> anyhow::Result<(Live, Vec<Held>)> {
        let _guard = self.artifacts_guard.read().await;
        let slot = self.slots.acquire(b.policy).await?;
        self.slots.refill();
        let mut made: Vec<PathBuf> = Vec::new();
        let mut daemons = super::volumes::ShareDaemons::none();
        let r = self.boot_in(&b, &slot, &mut made, &mut daemons).await;
        if r.is_err() {
            daemons.kill().await;
            let _ = self.slots.release(&slot).await;
            for p in made {
                let _ = std::fs::remove_file(p);
            }
        } else {
            daemons.detach();
        }
        r
    }

    /// The steps of [`Node::boot`] in its slot: the volumes' daemons, the disk and RAM
    /// artifacts, the QEMU (started once more when stuck), the wait for envd, the record.
    /// What it made is in `made` and `daemons`, for the caller to undo on failure.
    async fn boot_in(
        &self,
        b: &Boot<'_>,
        slot: &Slot,
        made: &mut Vec<PathBuf>,
        daemons: &mut super::volumes::ShareDaemons,
    ) -> anyhow::Result<(Live, Vec<Held>)> {
        let run_dir = b.run_dir;
        std::fs::create_dir_all(run_dir)?;
        let qemu_user = self.qemu_user(slot);
        let limits = vmon_vm::cgroup::Limits::for_guest(b.machine.vcpus, b.machine.memory_mb);
        // The daemons join the cgroups the QEMU will have: chosen before either starts.
        let qemu_tag = new_id("");
        *daemons = self
            .start_share_daemons(run_dir, b.volumes, &share(&qemu_tag, limits, &qemu_user))
            .await?;
        let mut init = b.init.clone();
        init.volume_mounts = b
            .volumes
            .iter()
            .enumerate()
            .map(|(i, v)| (super::volumes::tag(i), v.path.clone()))
            .collect();
        let (overlay, overlay_path, chain) = self.boot_overlay(b.disk, made).await?;
        // QEMU writes both: the overlay, and the RAM file it maps shared.
        self.hand_to(slot, &overlay_path)?;
        made.push(overlay_path);
        let (ram, ram_path) = self.builds.new_artifact("ram", "mem");
        made.push(ram_path.clone());
        self.hand_new_to(slot, &ram_path)?;
        // The groups' device nodes become the QEMU user's (given back at release).
        self.gpus
            .grant(b.gpus, qemu_user.as_ref().map(|u| (u.uid, u.gid)))?;
        let view = self.view_for(run_dir)?;
        self.show(
            run_dir,
            chain
                .iter()
                .map(String::as_str)
                .chain([overlay.as_str(), ram.as_str()]),
        )?;
        let mut spec = LaunchSpec {
            tag: qemu_tag,
            machine: b.machine.clone(),
            run_dir: run_dir.to_path_buf(),
            console_log: run_dir.join("console.log"),
            ram_file: ram_path.clone(),
            ram: RamSharing::Shared,
            disk: Some(self.builds.artifact(&overlay)),
            net: Some(NetDevice { tap: TAP.into() }),
            netns: Some(slot.netns()),
            incoming: false,
            // Template builds run under <data>/run; sandboxes under <data>/sandboxes.
            die_with_node: run_dir.starts_with(self.cfg.data_dir.join("run")),
            fs_shares: daemons.shares.clone(),
            user: self.qemu_user(slot),
            ram_fd: None,
            view,
            weight: vmon_vm::cgroup::Weight::Normal,
            vfio: crate::gpus::devices(b.gpus),
        };
        let addr = SocketAddr::new(IpAddr::V4(slot.addr()), ENVD_PORT);
        let (vm, launched) = self
            .launch_watched(b, &mut spec, daemons, &ram_path, addr, limits, &qemu_user)
            .await?;
        let mut live = Live {
            state: cold_boot_state(
                b,
                slot,
                ram,
                overlay,
                chain,
                init.access_token.clone(),
                spec.tag.clone(),
            ),
            vm: Some(vm),
            slot: slot.clone(),
            dir: run_dir.to_path_buf(),
        };
        let left = self.cfg.boot_timeout.saturating_sub(launched.elapsed());
        if let Err(e) = wait_ready(addr, &init, left).await {
            if let Some(mut vm) = live.vm.take() {
                vm.kill().await;
            }
            bail!(
                "{e:#}\nlast console lines:\n{}",
                console_tail(&run_dir.join("console.log"))
            );
        }
        live.state.save(run_dir)?;
        let held = live
            .state
            .live_artifacts()
            .iter()
            .map(|a| self.held_artifacts.hold(a))
            .collect::<Vec<_>>();
        Ok((live, held))
    }

    /// Starts the QEMU and waits for a sign of progress; a guest stuck before its root (no
    /// disk write `boot_stall_after` in) is started once more over the same, still unwritten
    /// overlay and a zeroed RAM file, with new volume daemons. Returns the QEMU and when it was
    /// started (the second wait has the whole timeout).
    #[allow(clippy::too_many_arguments)]
    async fn launch_watched(
        &self,
        b: &Boot<'_>,
        spec: &mut LaunchSpec,
        daemons: &mut super::volumes::ShareDaemons,
        ram_path: &Path,
        addr: SocketAddr,
        limits: vmon_vm::cgroup::Limits,
        qemu_user: &Option<vmon_vm::QemuUser>,
    ) -> anyhow::Result<(Vm, tokio::time::Instant)> {
        let mut vm = Vm::launch(spec).await?;
        let Some(report) = self.stalled(&vm, addr).await else {
            return Ok((vm, tokio::time::Instant::now()));
        };
        tracing::warn!(
            sandbox = b.id,
            after = ?self.cfg.boot_stall_after,
            cpus = %report,
            "cold boot made no progress: the guest never wrote its disk; booting it again"
        );
        self.boot_restarts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        vm.kill().await;
        if let Err(e) = zero_file(ram_path) {
            tracing::warn!(error = %e, "zeroing {}", ram_path.display());
        }
        spec.tag = new_id("");
        if !b.volumes.is_empty() {
            // A share's daemon serves one QEMU connection: new ones for the new QEMU.
            std::mem::replace(daemons, super::volumes::ShareDaemons::none())
                .kill()
                .await;
            *daemons = self
                .start_share_daemons(b.run_dir, b.volumes, &share(&spec.tag, limits, qemu_user))
                .await?;
            spec.fs_shares = daemons.shares.clone();
        }
        let vm = Vm::launch(spec).await?;
        Ok((vm, tokio::time::Instant::now()))
    }

    /// A new qcow2 overlay over `disk`, with the chain of build artifacts under it (what a
    /// [`BootDisk::NewRaw`] became is pushed to `made` too).
    async fn boot_overlay(
        &self,
        disk: BootDisk<'_>,
        made: &mut Vec<PathBuf>,
    ) -> anyhow::Result<(String, PathBuf, Vec<String>)> {
        let (overlay, overlay_path) = self.builds.new_artifact("disk", "qcow2");
        let chain: Vec<String> = match disk {
            BootDisk::Build { top, below } => {
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
            BootDisk::Image => {
                let rootfs = &self.image().await?.rootfs;
                create_overlay(rootfs, BackingFormat::Raw, &overlay_path).await?;
                Vec::new()
            }
            BootDisk::NewRaw(path) => {
                let (raw, raw_path) = self.builds.new_artifact("rootfs", "img");
                std::fs::rename(path, &raw_path)?;
                made.push(raw_path.clone());
                create_overlay(&raw_path, BackingFormat::Raw, &overlay_path).await?;
                vec![raw]
            }
        };
        Ok((overlay, overlay_path, chain))
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
        let image = self.image().await?;
        let machine = self.machine(image, vcpus, memory_mb)?;
        self.slots
            .vet(policy)
            .await
            .map_err(NodeError::InvalidArgument)?;
        let exec = new_id("e");
        let dir = self.sandbox_root(sandbox_id).join(&exec);
        let (live, _held) = self
            .boot(Boot {
                run_dir: &dir,
                id: sandbox_id,
                execution_id: &exec,
                machine,
                disk: BootDisk::Image,
                disk_mb: image.manifest.disk_mb,
                policy,
                init: &InitRequest::default(),
                volumes: &[],
                gpus: &[],
            })
            .await
            .map_err(err)?;
        self.insert(live)
    }
}

/// The state of a sandbox cold-booted by `b` in `slot` over `overlay` (on `chain`), with its
/// own shared RAM file `ram`, envd's token and its QEMU's tag.
fn cold_boot_state(
    b: &Boot<'_>,
    slot: &Slot,
    ram: String,
    overlay: String,
    chain: Vec<String>,
    envd_token: Option<String>,
    qemu_tag: String,
) -> SandboxState {
    SandboxState {
        id: b.id.to_string(),
        execution_id: b.execution_id.to_string(),
        slot: slot.index,
        machine: b.machine.clone(),
        ram: RamSource::Shared { file: ram },
        overlay,
        disk_chain: chain,
        disk_node: "d0".into(),
        disk_seq: 0,
        envd_token,
        envd_version: ENVD_VERSION.into(),
        disk_mb: b.disk_mb,
        // A cold boot starts the memory's generations over.
        resume_generation: 0,
        qemu_tag,
        pausing_build: None,
        network: Some(b.policy.clone()),
        volumes: b.volumes.to_vec(),
        start_kind: Some(vmon_proto::node::StartKind::ColdBoot),
        gpu_groups: b.gpus.iter().map(|g| g.id).collect(),
    }
}
