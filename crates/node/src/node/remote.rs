//! Builds in the cluster's object store (see [`crate::store`]): every build record this node
//! writes is uploaded in the background, a start (or `build_info`) of a build the node lacks
//! fetches it, fetched builds are a cache with a size bound, and the store's garbage is
//! collected on request.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::Mutex;
use vmon_proto::node::NodeError;

use super::{err, valid_id, Node};
use crate::builds::{fsync_dir, BuildRecord};
use crate::store::{disk_chain, on_image_rootfs, refused_by_gate, to_evict, Manifest, Store};

/// Tries of one build's upload (30 s, 1 min, 2 min apart) against a store that fails.
const UPLOAD_ATTEMPTS: u32 = 4;
/// How often builds that are still not in the store are queued again.
pub(super) const UNSTORED_SWEEP: Duration = Duration::from_secs(300);
/// How often an upload the node's gate refused looks whether the gate is open again.
const GATE_POLL: Duration = Duration::from_secs(1);

/// Takes a build off the upload queue when its upload task ends (however it ends).
struct Dequeue<'a>(&'a std::sync::Mutex<HashSet<String>>, String);

impl Drop for Dequeue<'_> {
    fn drop(&mut self) {
        if let Ok(mut q) = self.0.lock() {
            q.remove(&self.1);
        }
    }
}

/// `qemu-img rebase -u`: points the qcow2 `path` at `backing` (format `fmt`) without reading
/// either (the bytes are the same; only the name differs on this host).
async fn rebase(path: &Path, backing: &Path, fmt: &str) -> anyhow::Result<()> {
    let out = tokio::process::Command::new("qemu-img")
        .args(["rebase", "-u", "-f", "qcow2", "-F", fmt, "-b"])
        .arg(backing)
        .arg(path)
        .output()
        .await
        .context("running qemu-img (apt-get install qemu-utils)")?;
    if !out.status.success() {
        anyhow::bail!(
            "qemu-img rebase of {} failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Node {
    /// Uploads `rec` to the store in the background (nothing happens without one). The call
    /// that made the build has returned by the time this matters; `build_info` reports
    /// `stored` once the manifest is up. One upload per build at a time: a build already
    /// queued is not queued again.
    ///
    /// A write the node's gate refuses (the node is fenced) is made again once the gate
    /// opens, without counting as a try: a build must not stay out of the store, where the
    /// other nodes look for it, because its node was fenced for a while. A store that fails
    /// gets [`UPLOAD_ATTEMPTS`] tries; what is still not stored then is queued again by
    /// [`Node::upload_unstored`] every [`UNSTORED_SWEEP`].
    pub(super) fn upload_later(&self, rec: &BuildRecord) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let Some(me) = self.me.upgrade() else {
            return;
        };
        let queued = match self.uploads.lock() {
            Ok(mut q) => q.insert(rec.id.clone()),
            Err(_) => false,
        };
        if !queued {
            return;
        }
        let rec = rec.clone();
        tokio::spawn(async move {
            let _done = Dequeue(&me.uploads, rec.id.clone());
            me.upload_now(&store, &rec).await;
        });
    }

    /// The body of [`Node::upload_later`].
    async fn upload_now(&self, store: &Store, rec: &BuildRecord) {
        let t0 = Instant::now();
        let rootfs = on_image_rootfs(rec)
            .then(|| vmon_image::find(&self.cfg.data_dir, &rec.image_hash).ok())
            .flatten()
            .map(|i| i.rootfs);
        let mut attempt = 0;
        while attempt < UPLOAD_ATTEMPTS {
            if !matches!(self.builds.get(&rec.id), Ok(Some(_))) {
                return;
            }
            match store.upload(&self.builds, rec, rootfs.as_deref()).await {
                Ok(()) => {
                    // Deleted while it was uploading: its manifest must not outlive it.
                    if matches!(self.builds.get(&rec.id), Ok(None)) {
                        let _ = store.delete_manifest(&rec.id).await;
                        return;
                    }
                    tracing::info!(build = %rec.id, secs = t0.elapsed().as_secs_f64(), "build uploaded to the object store");
                    return;
                }
                Err(e) if refused_by_gate(&e) => {
                    tracing::warn!(build = %rec.id, "uploading the build waits for the node's fence to lift: {e:#}");
                    while !store.writable() {
                        tokio::time::sleep(GATE_POLL).await;
                        if !matches!(self.builds.get(&rec.id), Ok(Some(_))) {
                            return;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(build = %rec.id, attempt, "uploading the build to the object store failed: {e:#}");
                    attempt += 1;
                    if attempt < UPLOAD_ATTEMPTS {
                        tokio::time::sleep(Duration::from_secs(15 << attempt)).await;
                    }
                }
            }
        }
    }

    /// Queues the upload of every local build whose manifest is not in the store (at start:
    /// builds made before the store was configured, or whose upload a restart interrupted;
    /// then every [`UNSTORED_SWEEP`]: uploads a store outage outlasted).
    pub(super) fn upload_unstored(&self) {
        let Some(store) = &self.store else {
            return;
        };
        match self.builds.list() {
            Ok(recs) => {
                for rec in recs.iter().filter(|r| !store.is_stored(&r.id)) {
                    self.upload_later(rec);
                }
            }
            Err(e) => tracing::warn!("listing builds to upload: {e:#}"),
        }
    }

    /// Whether `id`'s manifest is known to be in the store.
    pub(super) fn is_stored(&self, id: &str) -> bool {
        self.store.as_ref().is_some_and(|s| s.is_stored(id))
    }

    /// Makes sure build `id` is on this node: present already, or fetched from the store when
    /// it has the build. Leaves it absent (for the caller's `BuildNotFound`) when neither has.
    pub(super) async fn ensure_local(&self, id: &str) -> Result<(), NodeError> {
        let Some(store) = self.store.clone() else {
            return Ok(());
        };
        if !valid_id(id) {
            return Ok(());
        }
        if self.builds.get(id).map_err(err)?.is_some() {
            store.touch_fetched(id);
            return Ok(());
        }
        let turn = {
            let mut m = self
                .fetches
                .lock()
                .map_err(|_| NodeError::Failed("fetch table poisoned".into()))?;
            m.entry(id.to_string())
                .or_insert_with(|| Arc::new(Mutex::new(())))
                .clone()
        };
        let result = async {
            let _turn = turn.lock().await;
            // Another start fetched it while this one waited.
            if self.builds.get(id).map_err(err)?.is_some() {
                return Ok(());
            }
            let Some(manifest) = store.manifest(id).await.map_err(err)? else {
                return Ok(());
            };
            let t0 = Instant::now();
            let bytes = self.fetch(&store, manifest).await?;
            tracing::info!(
                build = id,
                mib = bytes >> 20,
                secs = t0.elapsed().as_secs_f64(),
                "build fetched from the object store"
            );
            Ok(())
        }
        .await;
        if let Ok(mut m) = self.fetches.lock() {
            if m.get(id).is_some_and(|t| Arc::ptr_eq(t, &turn)) {
                m.remove(id);
            }
        }
        result?;
        self.evict_fetched(id).await;
        Ok(())
    }

    /// Downloads what this node lacks of `m`'s build, points its disk chain at this node's
    /// files and writes its record. Returns the bytes downloaded.
    async fn fetch(&self, store: &Store, m: Manifest) -> Result<u64, NodeError> {
        let mut rec = m.record.clone();
        self.check_compatible(&rec)?;
        crate::config::check_free(&self.cfg.data_dir, self.cfg.min_free_mb)?;
        let local_image = self.localize_machine(&mut rec);
        let artifacts_dir =
            std::fs::canonicalize(&self.builds.artifacts).map_err(|e| err(e.into()))?;
        let mut staged = Staged {
            incoming: store.incoming(),
            files: Vec::new(),
            bytes: 0,
        };
        let fetched = async {
            self.download_missing(store, &m, &rec, &mut staged).await?;
            let local = local_image.as_ref();
            let bottom = self
                .fetch_bottom(store, &m, local, &artifacts_dir, &mut rec, &mut staged)
                .await?;
            rebase_fetched(&m.record, &artifacts_dir, bottom, &staged).await
        }
        .await;
        let committed = match fetched {
            Ok(()) => {
                let _guard = self.artifacts_guard.read().await;
                let moved = || -> anyhow::Result<()> {
                    for (name, tmp) in &staged.files {
                        std::fs::rename(tmp, self.builds.artifact(name))?;
                    }
                    fsync_dir(&self.builds.artifacts)?;
                    self.builds.put(&rec)
                };
                moved()
            }
            Err(e) => Err(e),
        };
        if let Err(e) = committed {
            for (_, tmp) in &staged.files {
                let _ = std::fs::remove_file(tmp);
            }
            return Err(NodeError::Failed(format!(
                "fetching build {} from the object store: {e:#}",
                rec.id
            )));
        }
        store.mark_stored(&rec.id).map_err(err)?;
        store.mark_fetched(&rec.id, staged.bytes).map_err(err)?;
        Ok(staged.bytes)
    }

    /// Points `rec`'s machine at this host's QEMU and, when this node has the build's image,
    /// its kernel and initramfs; returns that image.
    fn localize_machine(&self, rec: &mut BuildRecord) -> Option<vmon_image::Image> {
        rec.machine.qemu_binary = self.cfg.qemu_binary.clone();
        let local_image = vmon_image::find(&self.cfg.data_dir, &rec.image_hash).ok();
        if let Some(img) = &local_image {
            rec.machine.kernel = img.vmlinuz.clone();
            rec.machine.initrd = img.initrd.clone();
        }
        local_image
    }

    /// Downloads each artifact of `rec` this node lacks (checked against `m`'s sums).
    async fn download_missing(
        &self,
        store: &Store,
        m: &Manifest,
        rec: &BuildRecord,
        staged: &mut Staged,
    ) -> anyhow::Result<()> {
        for name in rec.artifacts().cloned().collect::<HashSet<_>>() {
            // Artifacts are immutable and uniquely named: one here is the one named.
            if self.builds.artifact(&name).exists() {
                continue;
            }
            let sum = m
                .artifacts
                .get(&name)
                .with_context(|| format!("the manifest has no sum for {name}"))?;
            let tmp = staged.incoming.join(&name);
            store.download_artifact(&name, sum, &tmp).await?;
            store.save_sum(&name, sum)?;
            staged.add(name, tmp, sum.size);
        }
        Ok(())
    }

    /// The raw disk under the build's chain, when it stands on an image rootfs: this node's
    /// image rootfs when it is the same bytes, else the store's copy, kept as an artifact at
    /// the bottom of `rec`'s chain.
    async fn fetch_bottom(
        &self,
        store: &Store,
        m: &Manifest,
        local_image: Option<&vmon_image::Image>,
        artifacts_dir: &Path,
        rec: &mut BuildRecord,
        staged: &mut Staged,
    ) -> anyhow::Result<Option<PathBuf>> {
        if !on_image_rootfs(&m.record) {
            return Ok(None);
        }
        let sum = m
            .rootfs
            .as_ref()
            .context("the manifest names no rootfs under the disk chain")?;
        if let Some(img) = local_image {
            if store.rootfs_sum(&img.rootfs).await? == *sum {
                return Ok(Some(img.rootfs.clone()));
            }
        }
        let name = format!("rootfs-{}.img", &sum.sha256[..32.min(sum.sha256.len())]);
        if !self.builds.artifact(&name).exists() {
            let tmp = staged.incoming.join(&name);
            store.download_rootfs(sum, &tmp).await?;
            staged.add(name.clone(), tmp, sum.size);
        }
        rec.disk_chain.push(name.clone());
        Ok(Some(artifacts_dir.join(&name)))
    }

    /// Drops fetched builds, least recently used first, while they take more than the cache
    /// bound; `keep` (the build just fetched) and builds a sandbox runs from stay.
    async fn evict_fetched(&self, keep: &str) {
        let Some(store) = self.store.clone() else {
            return;
        };
        let bound = self.cfg.store_cache_mb.saturating_mul(1 << 20);
        for id in to_evict(&store.fetched(), bound, keep) {
            match self.remove_local_build(&id).await {
                Ok(()) | Err(NodeError::BuildNotFound(_)) => {
                    store.forget_fetched(&id);
                    tracing::info!(build = %id, "evicted a fetched build from the local cache");
                }
                Err(e) => tracing::debug!(build = %id, "fetched build kept: {e}"),
            }
        }
    }

    /// Deletes `id` here and its manifest in the store (its objects go with the next
    /// [`Node::collect_store`]). A build only in the store is deleted there.
    pub(super) async fn remove_build(&self, id: &str) -> Result<(), NodeError> {
        let local = self.remove_local_build(id).await;
        let Some(store) = self.store.clone() else {
            return local;
        };
        match local {
            Ok(()) => {}
            Err(NodeError::BuildNotFound(_)) => {
                if store.manifest(id).await.map_err(err)?.is_none() {
                    return Err(NodeError::BuildNotFound(id.to_string()));
                }
            }
            Err(e) => return Err(e),
        }
        store.forget_fetched(id);
        store.delete_manifest(id).await.map_err(err)
    }

    /// Garbage collection of the object store: deletes artifact and rootfs objects no
    /// manifest names that are older than `min_age` (uploads in flight write their objects
    /// before their manifest: an hour is safe). For the api's leader; returns the keys deleted.
    pub async fn collect_store(&self, min_age: Duration) -> Result<Vec<String>, NodeError> {
        let Some(store) = &self.store else {
            return Ok(Vec::new());
        };
        store.collect(min_age.as_secs()).await.map_err(err)
    }

    /// The object store this node uploads to, if any (tests, benchmarks).
    pub fn object_store(&self) -> Option<&vmon_objstore::ObjectStore> {
        self.store.as_ref().map(|s| s.objects())
    }

    /// Puts `gate` before every write to the object store (in a cluster, the node's fence).
    pub fn set_store_gate(&self, gate: crate::store::WriteGate) {
        if let Some(store) = &self.store {
            store.set_write_gate(gate);
        }
    }
}

/// What a fetch downloaded into `store/incoming/`, moved into the artifacts at its commit.
struct Staged {
    incoming: PathBuf,
    /// Each artifact's name and where it waits.
    files: Vec<(String, PathBuf)>,
    bytes: u64,
}

impl Staged {
    fn add(&mut self, name: String, tmp: PathBuf, size: u64) {
        self.files.push((name, tmp));
        self.bytes += size;
    }
}

/// Points each overlay of `record`'s chain that was downloaded at this node's paths, bottom
/// up: the one below it, or `bottom` (the raw disk) under the lowest.
async fn rebase_fetched(
    record: &BuildRecord,
    artifacts_dir: &Path,
    bottom: Option<PathBuf>,
    staged: &Staged,
) -> anyhow::Result<()> {
    let chain = disk_chain(record);
    let fresh: HashSet<&str> = staged.files.iter().map(|(n, _)| n.as_str()).collect();
    for (i, name) in chain.iter().enumerate().rev() {
        if !name.ends_with(".qcow2") || !fresh.contains(name.as_str()) {
            continue;
        }
        let (backing, fmt) = match chain.get(i + 1) {
            Some(below) if below.ends_with(".qcow2") => (artifacts_dir.join(below), "qcow2"),
            Some(below) => (artifacts_dir.join(below), "raw"),
            None => (
                bottom.clone().context("no rootfs under the disk chain")?,
                "raw",
            ),
        };
        rebase(&staged.incoming.join(name), &backing, fmt).await?;
    }
    Ok(())
}
