//! Bucket mounts (`vmonS3Mounts`): a prefix of a tenant's S3 bucket as a directory in one
//! sandbox, each object under the prefix a file. The sandbox gets a cache of its own,
//! `<volumes dir>/<share's volume_id>`, served by the same unprivileged virtiofsd as a volume
//! (bound read-only in the daemon's mount namespace for a read-only mount, so the host's
//! kernel refuses the guest's writes).
//!
//! - **Fill**, before the start mounts it: the prefix is listed (bounded by the share's
//!   `max_objects` and `max_bytes`), each object fetched into a root-owned staging file and
//!   appended to a tar stream the node writes ([`crate::tarball`]), and the archive unpacked
//!   into the emptied cache by GNU tar running as the cache's own id range (the confined
//!   unpacker of object-store volumes). The node writes no tenant path itself. A key that
//!   cannot be a path (empty, `.` or `..` components, a NUL, too long) or that names a file
//!   where another key needs a directory is left out, and logged.
//! - **Write-back** (read-write mounts only), at pause, at a checkpoint, at kill and every
//!   `volume_sync` interval: the confined archiver packs the cache, the node reads the archive
//!   as a stream, and each regular file whose sha256 differs from the one it last filled or
//!   wrote (`<volumes dir>/.synced/<id>.manifest.json`, root's) is uploaded; an object it
//!   filled or wrote whose file is gone is deleted. Nothing else in the bucket is touched:
//!   **last writer wins per object**. Links, devices and empty directories do not travel.
//! - The credentials travel in the start call and stay in the sandbox's state in memory
//!   (`sandbox.json` keeps them empty): a node that restarted cannot write a re-adopted
//!   sandbox's mounts back and says so.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use sha2::Digest;
use vmon_objstore::{ObjectInfo, ObjectStore, ObjectStoreConfig};
use vmon_proto::node::{BucketShare, NodeError, VolumeShare};

use super::volume_store::{self, WriteBack};
use super::{valid_id, Node};
use crate::tarball;

/// How the api names bucket caches (`s3m-<sandbox>-<n>`, `crates/control/src/s3mounts.rs`).
const CACHE_PREFIX: &str = "s3m-";
/// The longest object key (after the prefix) that becomes a path.
const MAX_KEY: usize = 1024;
/// The longest path component.
const MAX_COMPONENT: usize = 255;

/// What the node last filled or wrote: each file's sha256 by its path (the key after the
/// prefix).
#[derive(Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
struct Manifest {
    files: BTreeMap<String, String>,
}

/// An object key (after the prefix) as a relative path in the cache, when it can be one.
pub(crate) fn key_path(key: &str) -> Option<&str> {
    let ok = !key.is_empty()
        && key.len() <= MAX_KEY
        && !key.contains('\0')
        && key
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != ".." && c.len() <= MAX_COMPONENT);
    ok.then_some(key)
}

/// What a fill makes of a listing: the directories (parents first), the files (path and
/// object), and the keys left out.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub dirs: Vec<String>,
    pub files: Vec<(String, ObjectInfo)>,
    pub left_out: Vec<String>,
}

pub(crate) fn plan(list: Vec<ObjectInfo>) -> Plan {
    let mut dirs = BTreeSet::new();
    let mut files = Vec::new();
    let mut left_out = Vec::new();
    for o in list {
        // The prefix's own "folder" object: the mount's root.
        if o.key.is_empty() {
            continue;
        }
        // A "folder" object (`a/b/`): a directory.
        if let Some(d) = o.key.strip_suffix('/') {
            match key_path(d) {
                Some(d) => {
                    add_parents(&mut dirs, d);
                    dirs.insert(d.to_string());
                }
                None => left_out.push(o.key),
            }
            continue;
        }
        match key_path(&o.key) {
            Some(p) => {
                add_parents(&mut dirs, p);
                files.push((p.to_string(), o));
            }
            None => left_out.push(o.key),
        }
    }
    // A key that is also another key's directory: the directory wins.
    let (files, shadowed): (Vec<_>, Vec<_>) =
        files.into_iter().partition(|(p, _)| !dirs.contains(p));
    left_out.extend(shadowed.into_iter().map(|(_, o)| o.key));
    Plan {
        dirs: dirs.into_iter().collect(),
        files,
        left_out,
    }
}

fn add_parents(dirs: &mut BTreeSet<String>, path: &str) {
    let mut at = 0;
    while let Some(i) = path[at..].find('/') {
        dirs.insert(path[..at + i].to_string());
        at += i + 1;
    }
}

/// The tenant's store for `share`: its endpoint, bucket and prefix, signed with its
/// credentials.
fn store_of(share: &BucketShare) -> anyhow::Result<ObjectStore> {
    if share.credentials.is_empty() {
        bail!(
            "this node holds no credentials for the mount (it restarted since the sandbox \
             started; they are never written to its disk)"
        );
    }
    ObjectStore::new(ObjectStoreConfig {
        endpoint: share.endpoint.clone(),
        bucket: share.bucket.clone(),
        region: share.region.clone(),
        access_key_id: share.credentials.access_key_id.clone(),
        secret_access_key: share.credentials.secret_access_key.clone(),
        prefix: share.prefix.clone(),
    })
}

/// A store error of a mount as a node error: what the tenant can fix (a missing bucket,
/// refused credentials, bounds) is `InvalidArgument`, the rest a failure.
fn store_error(share: &BucketShare, path: &str, e: vmon_objstore::Error) -> NodeError {
    let at = format!(
        "S3 mount {path} (bucket {:?} at {})",
        share.bucket, share.endpoint
    );
    match e {
        vmon_objstore::Error::NotFound(_) => {
            NodeError::InvalidArgument(format!("{at}: the bucket does not exist"))
        }
        vmon_objstore::Error::Status {
            status,
            code,
            message,
            ..
        } if (400..500).contains(&status) => NodeError::InvalidArgument(format!(
            "{at}: the endpoint refused the request ({status} {code}{}{message}); check the \
             secret's access key and the bucket's permissions",
            if message.is_empty() { "" } else { ": " }
        )),
        e => NodeError::Failed(format!("{at}: {e:#}")),
    }
}

/// One node's caches of bucket mounts.
struct Caches<'a> {
    volumes_dir: &'a Path,
    first: u32,
}

impl Caches<'_> {
    fn synced_dir(&self) -> std::io::Result<PathBuf> {
        volume_store::synced_dir(self.volumes_dir)
    }

    fn manifest_path(&self, id: &str) -> std::io::Result<PathBuf> {
        Ok(self.synced_dir()?.join(format!("{id}.manifest.json")))
    }

    fn manifest(&self, id: &str) -> anyhow::Result<Manifest> {
        match std::fs::read(self.manifest_path(id)?) {
            Ok(b) => Ok(serde_json::from_slice(&b)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Manifest::default()),
            Err(e) => Err(e.into()),
        }
    }

    fn set_manifest(&self, id: &str, m: &Manifest) -> anyhow::Result<()> {
        let path = self.manifest_path(id)?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(m)?)?;
        std::fs::rename(&tmp, &path)?;
        Ok(())
    }

    /// Empties the cache `id` and fills it with the share's objects.
    async fn fill(&self, id: &str, share: &BucketShare, path: &str) -> Result<(), NodeError> {
        let t0 = std::time::Instant::now();
        let failed = |e: anyhow::Error| NodeError::Failed(format!("S3 mount {path}: {e:#}"));
        let store = store_of(share)
            .map_err(|e| NodeError::InvalidArgument(format!("S3 mount {path}: {e:#}")))?;
        let list = store
            .list("")
            .await
            .map_err(|e| store_error(share, path, e))?;
        let plan = plan(list);
        if !plan.left_out.is_empty() {
            tracing::warn!(mount = path, keys = ?plan.left_out.iter().take(20).collect::<Vec<_>>(), count = plan.left_out.len(), "S3 mount: keys that cannot be paths are left out");
        }
        if plan.files.len() as u64 > share.max_objects {
            return Err(NodeError::InvalidArgument(format!(
                "S3 mount {path}: the prefix holds {} objects, more than {} a mount fetches",
                plan.files.len(),
                share.max_objects
            )));
        }
        let total: u64 = plan.files.iter().map(|(_, o)| o.size).sum();
        if total > share.max_bytes {
            return Err(NodeError::InvalidArgument(format!(
                "S3 mount {path}: the prefix holds {total} bytes, more than {} a mount fetches \
                 (quotas.max_volume_bytes)",
                share.max_bytes
            )));
        }
        let dir = self.volumes_dir.join(id);
        if !dir.exists() {
            volume_store::ensure_volumes_dir(self.volumes_dir).map_err(|e| failed(e.into()))?;
            std::fs::create_dir(&dir).map_err(|e| failed(e.into()))?;
            // As a volume's root: anyone in the guest may write a read-write mount.
            let mode = if share.read_only { 0o755 } else { 0o777 };
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                .map_err(|e| failed(e.into()))?;
        }
        let synced = self.synced_dir().map_err(|e| failed(e.into()))?;
        let staged = synced.join(format!("{id}.in.tar"));
        let object_tmp = synced.join(format!("{id}.object"));
        let built = self
            .archive(&store, &plan, &staged, &object_tmp, share, path)
            .await;
        let _ = std::fs::remove_file(&object_tmp);
        let manifest = match built {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&staged);
                return Err(e);
            }
        };
        let r = volume_store::unpack(self.volumes_dir, self.first, id, Some(&staged)).await;
        let _ = std::fs::remove_file(&staged);
        r.map_err(failed)?;
        self.set_manifest(id, &manifest).map_err(failed)?;
        tracing::info!(
            mount = path,
            cache = id,
            files = manifest.files.len(),
            bytes = total,
            ms = t0.elapsed().as_millis() as u64,
            "S3 mount filled"
        );
        Ok(())
    }

    /// Fetches the plan's objects into one archive at `staged`; returns what it holds.
    async fn archive(
        &self,
        store: &ObjectStore,
        plan: &Plan,
        staged: &Path,
        object_tmp: &Path,
        share: &BucketShare,
        path: &str,
    ) -> Result<Manifest, NodeError> {
        let failed = |e: anyhow::Error| NodeError::Failed(format!("S3 mount {path}: {e:#}"));
        let file = std::fs::File::create(staged).map_err(|e| failed(e.into()))?;
        let mut w = tarball::Writer::new(std::io::BufWriter::new(file));
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        for d in &plan.dirs {
            w.dir(d, now).map_err(|e| failed(e.into()))?;
        }
        let mut manifest = Manifest::default();
        let mut total = 0u64;
        for (p, o) in &plan.files {
            let (size, sha) = match store.get_to_file(&o.key, object_tmp, None).await {
                Ok(v) => v,
                // Deleted since the listing: left out.
                Err(vmon_objstore::Error::NotFound(_)) => continue,
                Err(e) => return Err(store_error(share, path, e)),
            };
            total += size;
            if total > share.max_bytes {
                return Err(NodeError::InvalidArgument(format!(
                    "S3 mount {path}: the prefix holds more than {} bytes a mount fetches",
                    share.max_bytes
                )));
            }
            let (tmp, p2, mtime) = (
                object_tmp.to_path_buf(),
                p.clone(),
                o.modified_unix.unwrap_or(0),
            );
            w = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
                let mut f = std::fs::File::open(&tmp)?;
                w.file(&p2, size, mtime, &mut f)?;
                Ok(w)
            })
            .await
            .map_err(|e| failed(e.into()))?
            .map_err(|e| failed(e.into()))?;
            manifest.files.insert(p.clone(), sha);
        }
        let mut out = w.finish().map_err(|e| failed(e.into()))?;
        out.flush().map_err(|e| failed(e.into()))?;
        out.get_ref().sync_all().map_err(|e| failed(e.into()))?;
        Ok(manifest)
    }

    /// Uploads what changed in the cache `id` since its fill or last write-back.
    async fn write_back(&self, id: &str, share: &BucketShare) -> anyhow::Result<WriteBack> {
        if share.read_only {
            return Ok(WriteBack::Unchanged);
        }
        if !self.volumes_dir.join(id).is_dir() {
            return Ok(WriteBack::Absent);
        }
        let store = store_of(share)?;
        let t0 = std::time::Instant::now();
        let synced = self.synced_dir()?;
        let tmp = synced.join(format!("{id}.out.tar"));
        // The archive's own records add at most 1.5 KiB a file (header, long name, padding).
        let bound = share
            .max_bytes
            .saturating_add(share.max_objects.saturating_mul(1536))
            .saturating_add(1 << 20);
        if let Err(e) = volume_store::pack(self.volumes_dir, self.first, id, &tmp, bound).await {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let old = self.manifest(id)?;
        let up_dir = synced.join(format!("{id}.up"));
        let _ = std::fs::remove_dir_all(&up_dir);
        std::fs::create_dir(&up_dir)?;
        let scanned = {
            let (tmp, up_dir, old_files) = (tmp.clone(), up_dir.clone(), old.files.clone());
            let (max_bytes, max_objects) = (share.max_bytes, share.max_objects);
            tokio::task::spawn_blocking(move || {
                scan(&tmp, &up_dir, &old_files, max_bytes, max_objects)
            })
            .await?
        };
        let _ = std::fs::remove_file(&tmp);
        let scanned = match scanned {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&up_dir);
                return Err(e.context(format!("volume {id}")));
            }
        };
        let sent = async {
            for (path, staged) in &scanned.changed {
                store
                    .put_file(path, staged)
                    .await
                    .with_context(|| format!("uploading {path:?}"))?;
            }
            for gone in old
                .files
                .keys()
                .filter(|k| !scanned.now.files.contains_key(*k))
            {
                match store.delete(gone).await {
                    Ok(()) | Err(vmon_objstore::Error::NotFound(_)) => {}
                    Err(e) => {
                        return Err(anyhow::Error::from(e).context(format!("deleting {gone:?}")))
                    }
                }
            }
            anyhow::Ok(())
        }
        .await;
        let _ = std::fs::remove_dir_all(&up_dir);
        // On failure what did reach the bucket is sent again next time (the old manifest stays).
        sent?;
        let deleted = old
            .files
            .keys()
            .filter(|k| !scanned.now.files.contains_key(*k))
            .count();
        if scanned.changed.is_empty() && deleted == 0 {
            return Ok(WriteBack::Unchanged);
        }
        self.set_manifest(id, &scanned.now)?;
        tracing::info!(
            cache = id,
            uploaded = scanned.changed.len(),
            deleted,
            skipped = scanned.skipped,
            ms = t0.elapsed().as_millis() as u64,
            "S3 mount written back"
        );
        Ok(WriteBack::Stored(String::new(), scanned.bytes))
    }

    /// Removes the cache `id` (emptied by its own ids first) and its manifest.
    async fn drop_cache(&self, id: &str) -> anyhow::Result<()> {
        let dir = self.volumes_dir.join(id);
        if dir.is_dir() {
            volume_store::unpack(self.volumes_dir, self.first, id, None).await?;
            std::fs::remove_dir(&dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        match std::fs::remove_file(self.manifest_path(id)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
}

/// What a write-back found in the cache's archive.
struct Scan {
    /// Files whose content differs from the manifest's: path, and a staging copy.
    changed: Vec<(String, PathBuf)>,
    /// Every file now, with its sha256.
    now: Manifest,
    /// Entries that do not travel (links, devices, names that cannot be keys).
    skipped: usize,
    bytes: u64,
}

/// Reads the archive at `tar`, hashing each regular file and copying those that changed into
/// `up_dir` (numbered names). Over `max_bytes` of files or `max_objects` files it fails with
/// [`volume_store::OverQuota`].
fn scan(
    tar: &Path,
    up_dir: &Path,
    old: &BTreeMap<String, String>,
    max_bytes: u64,
    max_objects: u64,
) -> anyhow::Result<Scan> {
    let mut out = Scan {
        changed: Vec::new(),
        now: Manifest::default(),
        skipped: 0,
        bytes: 0,
    };
    let mut f = std::io::BufReader::new(std::fs::File::open(tar)?);
    let mut over = false;
    tarball::read_entries(&mut f, |e, data| {
        match e.kind {
            tarball::Kind::Dir => return Ok(()),
            tarball::Kind::Other => {
                out.skipped += 1;
                return Ok(());
            }
            tarball::Kind::File => {}
        }
        if key_path(&e.path).is_none() {
            out.skipped += 1;
            return Ok(());
        }
        out.bytes += e.size;
        if out.bytes > max_bytes || out.now.files.len() as u64 >= max_objects {
            over = true;
            return Err(std::io::Error::other("over the mount's bounds"));
        }
        let staged = up_dir.join(out.changed.len().to_string());
        let mut copy = std::fs::File::create(&staged)?;
        let mut hash = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = data.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            copy.write_all(&buf[..n])?;
        }
        let sha = hex::encode(hash.finalize());
        if old.get(&e.path) == Some(&sha) {
            drop(copy);
            std::fs::remove_file(&staged)?;
        } else {
            out.changed.push((e.path.clone(), staged));
        }
        out.now.files.insert(e.path.clone(), sha);
        Ok(())
    })
    .map_err(|e| -> anyhow::Error {
        if over {
            volume_store::OverQuota {
                volume: "S3 mount".into(),
                max: max_bytes,
            }
            .into()
        } else {
            anyhow::Error::from(e).context("reading the mount's archive")
        }
    })?;
    Ok(out)
}

impl Node {
    fn caches(&self) -> Caches<'_> {
        Caches {
            volumes_dir: &self.cfg.volumes_dir,
            first: self.cfg.volume_uid_base,
        }
    }

    /// Fills the cache of every bucket share of a start (before anything is mounted).
    pub(super) async fn fill_buckets(&self, shares: &[VolumeShare]) -> Result<(), NodeError> {
        for s in shares {
            let Some(b) = &s.bucket else { continue };
            if !valid_id(&s.volume_id) {
                return Err(NodeError::InvalidArgument(format!(
                    "{:?} is not a cache id",
                    s.volume_id
                )));
            }
            self.caches().fill(&s.volume_id, b, &s.path).await?;
        }
        Ok(())
    }

    /// Writes a bucket share's cache back (read-write mounts).
    pub(super) async fn write_back_bucket(
        &self,
        share: &VolumeShare,
        bucket: &BucketShare,
    ) -> anyhow::Result<WriteBack> {
        self.caches()
            .write_back(&share.volume_id, bucket)
            .await
            .with_context(|| format!("S3 mount {}", share.path))
    }

    /// At start, after re-adoption: removes every bucket cache no running sandbox mounts (its
    /// sandbox ended while the node was down; nothing is starting yet).
    pub(super) async fn sweep_bucket_caches(&self) {
        let lives: Vec<_> = match self.sandboxes.lock() {
            Ok(m) => m.values().cloned().collect(),
            Err(_) => return,
        };
        let mut kept = BTreeSet::new();
        for l in lives {
            for s in &l.lock().await.state.volumes {
                if s.bucket.is_some() {
                    kept.insert(s.volume_id.clone());
                }
            }
        }
        let Ok(entries) = std::fs::read_dir(&self.cfg.volumes_dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(CACHE_PREFIX) && valid_id(&name) && !kept.contains(&name) {
                tracing::info!(cache = %name, "removing a bucket cache no sandbox mounts");
                if let Err(e) = self.caches().drop_cache(&name).await {
                    tracing::warn!(cache = %name, error = %format!("{e:#}"), "removing an S3 mount's cache");
                }
            }
        }
    }

    /// Removes the caches of a sandbox's bucket shares (it was paused or killed: a resume
    /// fills afresh, on whichever node).
    pub(super) async fn drop_bucket_caches(&self, shares: &[VolumeShare]) {
        for s in shares.iter().filter(|s| s.bucket.is_some()) {
            let lock = self.volume_lock(&s.volume_id);
            let held = lock.lock().await;
            if let Err(e) = self.caches().drop_cache(&s.volume_id).await {
                tracing::warn!(cache = %s.volume_id, error = %format!("{e:#}"), "removing an S3 mount's cache");
            }
            drop(held);
            if let Ok(mut m) = self.fetches.lock() {
                m.remove(&format!("volume:{}", s.volume_id));
            }
        }
    }
}

#[cfg(test)]
mod tests;
