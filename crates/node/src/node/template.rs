//! Builds made and unmade: a template build (boot, start command, ready command, capture of
//! the whole VM) and the deletion of a build with what was kept for it.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use tokio::sync::Mutex;
use vmon_proto::node::{BuildInfo, NodeError, OciImage, TemplateSpec};

use super::boot::BootDisk;
use super::{err, valid_id, Node, ENVD_VERSION};
use crate::builds::{new_id, now_unix, BuildRecord};
use crate::envd_client::{self, InitRequest, ENVD_PORT};
use crate::pool::{blank_key, Held};
use crate::sandbox::{Live, RamSource};

impl Node {
    /// Builds a template: boots its VM, runs its start and ready commands, captures it.
    pub(super) async fn make_template(&self, spec: TemplateSpec) -> Result<BuildInfo, NodeError> {
        if !valid_id(&spec.build_id) {
            return Err(NodeError::InvalidArgument(format!(
                "{:?} is not a valid build id",
                spec.build_id
            )));
        }
        if let Some(rec) = self.builds.get(&spec.build_id).map_err(err)? {
            return Ok(Self::info(&rec));
        }
        crate::config::check_free(&self.cfg.data_dir, self.cfg.min_free_mb)?;
        let image = self.image().await?;
        let machine = self.machine(image, spec.vcpus, spec.memory_mb)?;
        let exec = new_id("t");
        let dir = self
            .cfg
            .data_dir
            .join("run")
            .join(format!("template-{}", spec.build_id));
        let t0 = std::time::Instant::now();
        let (oci_disk, disk_mb) = self.template_disk(&spec, image, &dir).await?;
        let disk = match &oci_disk {
            Some(p) => BootDisk::NewRaw(p),
            None => BootDisk::Image,
        };
        // A token of the build's own: envd never serves without one, and every restore of the
        // build presents it to hand the guest its sandbox's token (or a pool's warm-up).
        let token = new_id("tb") + &new_id("");
        tracing::info!(build = %spec.build_id, "booting the template VM");
        let live = self
            .boot(super::boot::Boot {
                run_dir: &dir,
                id: &spec.build_id,
                execution_id: &exec,
                machine,
                disk,
                disk_mb,
                policy: &crate::slots::open_policy(),
                init: &InitRequest {
                    env_vars: spec.env_vars.clone(),
                    access_token: Some(token.clone()),
                    ..Default::default()
                },
                volumes: &[],
                gpus: &[],
            })
            .await;
        // Held until the build's record names them: the template VM is in no sandbox table,
        // and a sweep meanwhile (a snapshot deleted) would take its disk and RAM.
        let (mut live, mut held) = match live {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(err(e));
            }
        };
        tracing::info!(build = %spec.build_id, secs = t0.elapsed().as_secs_f64(), "template VM is up");
        let addr = SocketAddr::new(IpAddr::V4(live.slot.addr()), ENVD_PORT);
        let result = match run_start_and_ready(addr, &token, &spec).await {
            Ok(()) => {
                self.capture_template(&mut live, &mut held, &spec, image, &token)
                    .await
            }
            Err(e) => Err(e),
        };
        self.destroy(&mut live, result.is_ok()).await;
        drop(held);
        let _ = std::fs::remove_dir_all(&dir);
        let rec = result.map_err(err)?;
        tracing::info!(build = %rec.id, secs = t0.elapsed().as_secs_f64(), "template built");
        Ok(Self::info(&rec))
    }

    /// The disk a template boots from: from an OCI image, its rootfs made into a raw disk in
    /// the build's run dir (moved into the artifacts by the boot), with the disk's size;
    /// otherwise none (the node's image) and the larger of the image's and the spec's sizes.
    async fn template_disk(
        &self,
        spec: &TemplateSpec,
        image: &vmon_image::Image,
        dir: &Path,
    ) -> Result<(Option<PathBuf>, u32), NodeError> {
        let disk_mb = image.manifest.disk_mb.max(spec.disk_mb);
        if spec.image.is_some() && spec.layer.is_some() {
            return Err(NodeError::InvalidArgument(
                "a template boots an OCI image or a layer, not both".into(),
            ));
        }
        if let Some(layer) = spec.layer.as_deref() {
            std::fs::create_dir_all(dir).map_err(|e| err(e.into()))?;
            return match self.layer_disk(layer, image, dir).await {
                Ok((path, mb)) => Ok((Some(path), mb.max(spec.disk_mb))),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(dir);
                    Err(e)
                }
            };
        }
        let Some(oci) = &spec.image else {
            return Ok((None, disk_mb));
        };
        let t0 = std::time::Instant::now();
        let path = dir.join("rootfs.img");
        std::fs::create_dir_all(dir).map_err(|e| err(e.into()))?;
        match self.oci_disk(oci, image, dir, &path, disk_mb).await {
            Ok(mb) => {
                tracing::info!(build = %spec.build_id, secs = t0.elapsed().as_secs_f64(), "image pulled and made into a disk");
                Ok((Some(path), mb))
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(dir);
                Err(e)
            }
        }
    }

    /// Captures the ready template VM whole: device state, its RAM file as the build's base,
    /// its disk; writes the build's record and queues its upload.
    async fn capture_template(
        &self,
        live: &mut Live,
        held: &mut Vec<Held>,
        spec: &TemplateSpec,
        image: &vmon_image::Image,
        token: &str,
    ) -> anyhow::Result<BuildRecord> {
        let vm = live.vm.as_ref().context("no VM")?;
        vm.qmp.stop().await?;
        let (dev, dev_path) = self.builds.new_artifact("dev", "state");
        held.push(self.held_artifacts.hold(&dev));
        self.hand_new_to(&live.slot, &dev_path)?;
        self.show(&live.dir, [dev.as_str()])?;
        vm.qmp.save_devices_state(&dev_path).await?;
        let RamSource::Shared { file } = live.state.ram.clone() else {
            bail!("template VM must own its RAM");
        };
        let rec = BuildRecord {
            id: spec.build_id.clone(),
            parent: None,
            machine: live.state.machine.clone(),
            image_hash: image.manifest.hash.clone(),
            mem_base: Some(file),
            layers: Vec::new(),
            devstate: Some(dev),
            disk: Some(live.state.overlay.clone()),
            disk_chain: live.state.disk_chain.clone(),
            disk_mb: live.state.disk_mb,
            envd_version: ENVD_VERSION.into(),
            envd_token: Some(token.to_string()),
            resume_generation: 0,
            created_unix: now_unix(),
            warm_request: spec.warm_request.clone(),
            paused_from: None,
        };
        if let Some(vm) = live.vm.take() {
            vm.quit().await;
        }
        self.builds.put(&rec)?;
        self.upload_later(&rec);
        Ok(rec)
    }

    /// Pulls `oci` (by its digest) and makes its rootfs into the raw disk `out`; returns the
    /// disk's size in MiB.
    async fn oci_disk(
        &self,
        oci: &OciImage,
        image: &vmon_image::Image,
        dir: &Path,
        out: &Path,
        min_disk_mb: u32,
    ) -> Result<u32, NodeError> {
        let (registry, qualified) = oci.qualified().ok_or_else(|| {
            NodeError::InvalidArgument(format!("{:?} is not an image reference", oci.reference))
        })?;
        let pinned = match &oci.digest {
            // By digest: what the api resolved (and keyed its cache on) is what is pulled.
            Some(d) => format!(
                "{}@{d}",
                qualified
                    .split('@')
                    .next()
                    .map_or(qualified.as_str(), |n| { strip_tag(n) })
            ),
            None => qualified.clone(),
        };
        let pull = vmon_image::oci::Pull {
            reference: &pinned,
            registry: &registry,
            credentials: oci.credentials.as_ref(),
            tls_verify: oci.tls_verify,
            registry_allow: &oci.registry_allow,
        };
        vmon_image::oci::make_disk(
            &pull,
            image,
            &self.recipe.envd,
            &dir.join("oci"),
            out,
            min_disk_mb,
        )
        .await
        .map_err(|e| match e.downcast::<vmon_image::oci::RegistryError>() {
            Ok(r) => NodeError::InvalidArgument(r.0),
            Err(e) => NodeError::Failed(format!("making {} into a disk: {e:#}", oci.reference)),
        })
    }

    /// The digest of the manifest an image reference names.
    pub(super) async fn image_digest(&self, oci: &OciImage) -> Result<String, NodeError> {
        let (registry, qualified) = oci.qualified().ok_or_else(|| {
            NodeError::InvalidArgument(format!("{:?} is not an image reference", oci.reference))
        })?;
        vmon_image::oci::resolve_digest(&vmon_image::oci::Pull {
            reference: &qualified,
            registry: &registry,
            credentials: oci.credentials.as_ref(),
            tls_verify: oci.tls_verify,
            registry_allow: &oci.registry_allow,
        })
        .await
        .map_err(|e| NodeError::InvalidArgument(e.0))
    }

    /// Deletes a build here (not in the object store) that no running sandbox restores from,
    /// with its pooled and parked processes.
    pub(super) async fn remove_local_build(&self, build_id: &str) -> Result<(), NodeError> {
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
                self.drop_ram_base(m);
            }
        }
        self.sweep().await.map_err(err)?;
        Ok(())
    }
}

/// `host[:port]/repo:tag` without its tag (a port's colon is not a tag's).
fn strip_tag(name: &str) -> &str {
    match name.rsplit_once(':') {
        Some((head, tag)) if !tag.contains('/') => head,
        _ => name,
    }
}

/// Most bytes of a step's stdout or stderr that are kept (the rest is cut, said so).
const MAX_STEP_OUTPUT: usize = 1 << 20;
/// Largest file a template step may write into its guest.
const MAX_STEP_FILE: u64 = 1 << 30;

fn bounded_text(mut bytes: Vec<u8>) -> String {
    let cut = bytes.len() > MAX_STEP_OUTPUT;
    bytes.truncate(MAX_STEP_OUTPUT);
    let mut s = String::from_utf8_lossy(&bytes).into_owned();
    if cut {
        s.push_str("\n[output cut at 1 MiB]");
    }
    s
}

impl Node {
    /// A running sandbox's envd address and token, if it is in run `execution_id`.
    pub(super) async fn envd_of(
        &self,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<(SocketAddr, Option<String>), NodeError> {
        let l = self.live_execution(sandbox_id, execution_id).await?;
        Ok((
            SocketAddr::new(IpAddr::V4(l.slot.addr()), ENVD_PORT),
            l.state.envd_token.clone(),
        ))
    }

    /// Runs one template build step's command to its end.
    pub(super) async fn exec_step(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        spec: vmon_proto::node::ExecSpec,
    ) -> Result<vmon_proto::node::ExecOutput, NodeError> {
        let (addr, token) = self.envd_of(sandbox_id, execution_id).await?;
        let timeout = Duration::from_secs(spec.timeout_secs.clamp(1, 24 * 3600));
        let out = envd_client::run_in(
            addr,
            token.as_deref(),
            &spec.user,
            &spec.cmd,
            spec.cwd.as_deref(),
            &spec.env,
            timeout,
        )
        .await
        .map_err(err)?;
        Ok(vmon_proto::node::ExecOutput {
            exit_code: out.exit_code,
            stdout: bounded_text(out.stdout),
            stderr: bounded_text(out.stderr),
        })
    }

    /// Copies a host file into a running sandbox (a template build's COPY archive).
    pub(super) async fn put_step_file(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        host_path: &str,
        guest_path: &str,
    ) -> Result<(), NodeError> {
        if !guest_path.starts_with('/') {
            return Err(NodeError::InvalidArgument(format!(
                "{guest_path:?} is not an absolute guest path"
            )));
        }
        let (addr, token) = self.envd_of(sandbox_id, execution_id).await?;
        let len = std::fs::metadata(host_path)
            .map_err(|e| NodeError::InvalidArgument(format!("{host_path}: {e}")))?
            .len();
        if len > MAX_STEP_FILE {
            return Err(NodeError::InvalidArgument(format!(
                "{host_path} is larger than {MAX_STEP_FILE} bytes"
            )));
        }
        let data = tokio::fs::read(host_path)
            .await
            .map_err(|e| NodeError::InvalidArgument(format!("{host_path}: {e}")))?;
        envd_client::upload(
            addr,
            token.as_deref(),
            "root",
            guest_path,
            data,
            Duration::from_secs(600),
        )
        .await
        .map_err(err)
    }
}

/// The template's start command (detached, as `user`), then its ready command every 500 ms
/// until it succeeds (at most 10 minutes), then a `sync` so restores start quiet.
/// How long one run of a template's ready command may take.
const READY_CHECK: Duration = Duration::from_secs(60);
/// How long a template's ready command may keep failing.
const READY_WITHIN: Duration = Duration::from_secs(600);

async fn run_start_and_ready(
    addr: SocketAddr,
    token: &str,
    spec: &TemplateSpec,
) -> anyhow::Result<()> {
    if let Some(cmd) = &spec.start_cmd {
        let quoted = cmd.replace('\'', "'\\''");
        let out = envd_client::run(
            addr,
            Some(token),
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
            // A check that does not answer in time is a "not yet": on a loaded host a TCG
            // guest's start command (a desktop session) can starve one check for a minute.
            let why = match envd_client::run(addr, Some(token), "user", ready, READY_CHECK).await {
                Ok(out) if out.exit_code == 0 => break,
                Ok(out) => String::from_utf8_lossy(&out.stderr).into_owned(),
                Err(e) => format!("{e:#}"),
            };
            if start.elapsed() > READY_WITHIN {
                bail!("ready command never succeeded: {why}");
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    // Let the guest settle (page cache, deferred work) so restores start quiet.
    envd_client::run(addr, Some(token), "root", "sync", Duration::from_secs(60)).await?;
    Ok(())
}
