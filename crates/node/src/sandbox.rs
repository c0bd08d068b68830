//! One sandbox on this node: its VM, slot, disk overlay and where its RAM comes from, plus the
//! small JSON file that lets a restarted node re-adopt it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vmon_vm::{MachineDesc, Vm};

use crate::slots::Slot;

/// Where a sandbox's guest RAM lives.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RamSource {
    /// Its own RAM file, mapped shared (cold boots): the file is the memory.
    Shared { file: String },
    /// A build's `mem0` mapped privately; written pages are anonymous copies. `basis` is the
    /// build whose memory lies under those pages (for incremental captures).
    Private {
        mem_base: String,
        layers: Vec<String>,
        basis: String,
    },
}

/// What survives a node restart about a running sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxState {
    pub id: String,
    pub execution_id: String,
    pub slot: u32,
    pub machine: MachineDesc,
    pub ram: RamSource,
    /// The disk overlay QEMU writes (artifact name).
    pub overlay: String,
    /// Artifacts under `overlay` (frozen overlays), top first.
    pub disk_chain: Vec<String>,
    /// QMP node name of the active disk layer.
    pub disk_node: String,
    pub disk_seq: u32,
    pub envd_token: Option<String>,
    pub envd_version: String,
    pub disk_mb: u32,
    pub resume_generation: u32,
    /// A unique word in QEMU's command line, to recognise the process after a restart.
    pub qemu_tag: String,
    /// Set while a pause is being committed: the build it is writing. A parked sandbox (paused,
    /// QEMU kept stopped for a fast resume) keeps it set, so a restarted node finishes the
    /// pause.
    #[serde(default)]
    pub pausing_build: Option<String>,
    /// The egress policy its slot enforces now.
    #[serde(default)]
    pub network: Option<vmon_proto::node::NetworkPolicy>,
    /// Volumes and bucket prefixes it mounts (virtio-fs): its memory is never captured.
    #[serde(default)]
    pub volumes: Vec<vmon_proto::node::VolumeShare>,
    /// How its current execution started (reported to the api with the start).
    #[serde(default)]
    pub start_kind: Option<vmon_proto::node::StartKind>,
    /// The IOMMU groups passed through to it (a GPU sandbox): held while its QEMU lives, its
    /// memory never captured, never migrated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_groups: Vec<u32>,
}

impl SandboxState {
    /// A sandbox whose memory and disk lie over build `rec` (a restore, a live migration's
    /// target): `mem_base` mapped privately with `rec`'s layers written in, and a fresh
    /// `overlay` on `rec`'s disk chain. The caller sets what the build does not say (token,
    /// network, how it started).
    pub fn over_build(
        rec: &crate::builds::BuildRecord,
        mem_base: String,
        id: &str,
        execution_id: &str,
        slot: u32,
        overlay: String,
        qemu_tag: String,
    ) -> SandboxState {
        SandboxState {
            id: id.to_string(),
            execution_id: execution_id.to_string(),
            slot,
            machine: rec.machine.clone(),
            ram: RamSource::Private {
                mem_base,
                layers: rec.layers.clone(),
                basis: rec.id.clone(),
            },
            overlay,
            disk_chain: rec
                .disk
                .iter()
                .chain(rec.disk_chain.iter())
                .cloned()
                .collect(),
            disk_node: "d0".into(),
            disk_seq: 0,
            envd_token: None,
            envd_version: rec.envd_version.clone(),
            disk_mb: rec.disk_mb,
            resume_generation: rec.resume_generation,
            qemu_tag,
            pausing_build: None,
            network: None,
            volumes: Vec::new(),
            start_kind: None,
            gpu_groups: Vec::new(),
        }
    }

    pub fn path(dir: &Path) -> PathBuf {
        dir.join("sandbox.json")
    }

    /// Writes `sandbox.json`, without the credentials of bucket mounts (they stay in the
    /// node's memory only: a re-adopted sandbox's bucket mounts are not written back).
    pub fn save(&self, dir: &Path) -> anyhow::Result<()> {
        let mut kept = self.clone();
        for v in &mut kept.volumes {
            if let Some(b) = &mut v.bucket {
                b.credentials = Default::default();
            }
        }
        vmon_vm::private::write(&Self::path(dir), &serde_json::to_vec_pretty(&kept)?)?;
        Ok(())
    }

    pub fn load(dir: &Path) -> anyhow::Result<SandboxState> {
        Ok(serde_json::from_slice(&std::fs::read(Self::path(dir))?)?)
    }

    /// The artifacts this sandbox writes or reads outside of any build.
    pub fn live_artifacts(&self) -> Vec<String> {
        let mut v = vec![self.overlay.clone()];
        v.extend(self.disk_chain.iter().cloned());
        match &self.ram {
            RamSource::Shared { file } => v.push(file.clone()),
            RamSource::Private {
                mem_base, layers, ..
            } => {
                v.push(mem_base.clone());
                v.extend(layers.iter().cloned());
            }
        }
        v
    }
}

/// A running sandbox: its state and its QEMU.
pub struct Live {
    pub state: SandboxState,
    pub vm: Option<Vm>,
    pub slot: Slot,
    pub dir: PathBuf,
}
