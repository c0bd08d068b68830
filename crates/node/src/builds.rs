//! Builds: what sandboxes restore from, and the artifact files they are made of.
//!
//! A build is a record (`builds/<id>.json`) naming artifacts in `artifacts/`: the RAM base file
//! (`mem0`), the memory layers written on top of it in order, the device state, and the top of
//! the disk chain (a frozen qcow2 overlay whose backing chain ends in the image's raw rootfs).
//! Artifacts never move once written (qcow2 overlays name their backing files by path), and
//! are shared between builds: a paused sandbox's build shares mem0 with its template, a fork
//! build shares the frozen disk with every child. An artifact is deleted by a sweep, once no
//! build record and no live sandbox names it.
//!
//! Durability: every artifact is fsynced before the record that names it is written, and
//! records are written by rename, so a crash leaves either no record or a complete one.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use vmon_vm::MachineDesc;

/// How many memory layers a build may stack before the next capture flattens them.
pub const MAX_LAYERS: usize = 8;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuildRecord {
    pub id: String,
    pub parent: Option<String>,
    pub machine: MachineDesc,
    pub image_hash: String,
    /// Guest RAM base (artifact name), when the build carries memory.
    pub mem_base: Option<String>,
    /// Memory layers applied on top of `mem_base`, oldest first.
    #[serde(default)]
    pub layers: Vec<String>,
    /// Device state (artifact name), when the build carries memory.
    pub devstate: Option<String>,
    /// Top of the disk chain: an artifact name, or the image rootfs when `None`.
    pub disk: Option<String>,
    /// Every disk artifact in the chain under `disk` (for the sweep).
    #[serde(default)]
    pub disk_chain: Vec<String>,
    pub disk_mb: u32,
    pub envd_version: String,
    /// The envd token the guest in this build holds (needed to re-`/init` it after a restore).
    pub envd_token: Option<String>,
    /// Memory restores the state in this build went through.
    pub resume_generation: u32,
    pub created_unix: u64,
    /// The template's [`vmon_proto::node::TemplateSpec::warm_request`], for the pool's warm-up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_request: Option<String>,
    /// The run a pause made this build from (none for templates and checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_from: Option<PausedFrom>,
}

/// The sandbox run a pause build came from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PausedFrom {
    pub sandbox_id: String,
    pub execution_id: String,
}

impl BuildRecord {
    pub fn has_memory(&self) -> bool {
        self.mem_base.is_some() && self.devstate.is_some()
    }

    /// Every artifact this build needs.
    pub fn artifacts(&self) -> impl Iterator<Item = &String> {
        self.mem_base
            .iter()
            .chain(self.layers.iter())
            .chain(self.devstate.iter())
            .chain(self.disk.iter())
            .chain(self.disk_chain.iter())
    }
}

/// The build and artifact directories of a node.
#[derive(Debug, Clone)]
pub struct Builds {
    pub records: PathBuf,
    pub artifacts: PathBuf,
    qemu_gid: Option<u32>,
}

pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh random id (lowercase hex).
pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 10];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut b);
    format!("{prefix}{}", hex::encode(b))
}

pub(crate) fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !s.starts_with('.')
}

pub fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

impl Builds {
    pub fn open(data_dir: &Path) -> anyhow::Result<Builds> {
        let b = Builds {
            records: data_dir.join("builds"),
            artifacts: data_dir.join("artifacts"),
            qemu_gid: None,
        };
        std::fs::create_dir_all(&b.records)?;
        std::fs::create_dir_all(&b.artifacts)?;
        Ok(b)
    }

    /// Seals every artifact a record names at [`Builds::put`]: root's, readable by the QEMU
    /// group `gid` (backing chains), writable by no QEMU (see `node/confine.rs`).
    pub fn sealing_for(mut self, gid: Option<u32>) -> Builds {
        self.qemu_gid = gid;
        self
    }

    pub fn artifact(&self, name: &str) -> PathBuf {
        self.artifacts.join(name)
    }

    /// A new artifact path (not yet created).
    pub fn new_artifact(&self, kind: &str, ext: &str) -> (String, PathBuf) {
        let name = format!("{}.{ext}", new_id(&format!("{kind}-")));
        let path = self.artifact(&name);
        (name, path)
    }

    pub fn get(&self, id: &str) -> anyhow::Result<Option<BuildRecord>> {
        if !valid_name(id) {
            return Ok(None);
        }
        let p = self.records.join(format!("{id}.json"));
        match std::fs::read_to_string(&p) {
            Ok(t) => {
                Ok(Some(serde_json::from_str(&t).with_context(|| {
                    format!("build record {id} is corrupt")
                })?))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub fn list(&self) -> anyhow::Result<Vec<BuildRecord>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.records)?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(id) = name.strip_suffix(".json") {
                if let Some(r) = self.get(id)? {
                    out.push(r);
                }
            }
        }
        Ok(out)
    }

    /// When the record of `id` was written (Unix seconds; its file's mtime: records are
    /// written once, by rename, so this is the instant the build came to exist).
    pub fn recorded_unix(&self, id: &str) -> Option<u64> {
        if !valid_name(id) {
            return None;
        }
        let modified = std::fs::metadata(self.records.join(format!("{id}.json")))
            .ok()?
            .modified()
            .ok()?;
        Some(
            modified
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?
                .as_secs(),
        )
    }

    /// Writes a record once all its artifacts are durable.
    pub fn put(&self, rec: &BuildRecord) -> anyhow::Result<()> {
        if !valid_name(&rec.id) {
            bail!("{:?} is not a valid build id", rec.id);
        }
        for a in rec.artifacts() {
            let p = self.artifact(a);
            std::fs::File::open(&p)
                .with_context(|| format!("artifact {a} of build {} is missing", rec.id))?
                .sync_all()?;
            if let Some(gid) = self.qemu_gid {
                vmon_vm::user::seal(&p, gid)
                    .with_context(|| format!("sealing artifact {a} of build {}", rec.id))?;
            }
        }
        fsync_dir(&self.artifacts)?;
        // The record holds an envd token: owner-only from its first byte.
        vmon_vm::private::write(
            &self.records.join(format!("{}.json", rec.id)),
            serde_json::to_string_pretty(rec)?.as_bytes(),
        )?;
        fsync_dir(&self.records)?;
        Ok(())
    }

    pub fn remove_record(&self, id: &str) -> anyhow::Result<()> {
        if !valid_name(id) {
            bail!("{id:?} is not a valid build id");
        }
        match std::fs::remove_file(self.records.join(format!("{id}.json"))) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        fsync_dir(&self.records)?;
        Ok(())
    }

    /// Deletes every artifact named by no build record, not in `live` (the artifacts of
    /// running sandboxes) and not `held` (asked of each file as it is found, so a file made
    /// after `live` was read but held before it was made is kept). Also removes half-written
    /// temporary files. Returns what it deleted.
    pub fn sweep(
        &self,
        live: &HashSet<String>,
        held: &dyn Fn(&str) -> bool,
    ) -> anyhow::Result<Vec<String>> {
        let mut keep: HashSet<String> = live.clone();
        for r in self.list()? {
            keep.extend(r.artifacts().cloned());
        }
        let mut removed = Vec::new();
        for e in std::fs::read_dir(&self.artifacts)?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !keep.contains(&name) && !held(&name) {
                let _ = std::fs::remove_file(e.path());
                removed.push(name);
            }
        }
        for e in std::fs::read_dir(&self.records)?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_keeps_live_and_held_artifacts_and_deletes_the_rest() {
        let dir = std::env::temp_dir().join(format!("vmon-builds-sweep-{}", new_id("")));
        let builds = Builds::open(&dir).expect("open");
        let make = || {
            let (name, path) = builds.new_artifact("disk", "qcow2");
            std::fs::write(&path, b"x").expect("write");
            name
        };
        let (live, held, orphan) = (make(), make(), make());
        let removed = builds
            .sweep(&HashSet::from([live.clone()]), &|n| n == held)
            .expect("sweep");
        assert_eq!(removed, vec![orphan.clone()]);
        assert!(builds.artifact(&live).exists());
        assert!(builds.artifact(&held).exists(), "a held artifact is kept");
        assert!(!builds.artifact(&orphan).exists());
        let removed = builds.sweep(&HashSet::new(), &|_| false).expect("sweep");
        assert_eq!(removed.len(), 2, "released, they go");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
