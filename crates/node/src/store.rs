//! Builds in an S3-compatible object store, so that another node can restore them.
//!
//! Layout under the store's prefix:
//! - `artifacts/<name>`: one object per artifact, the file's bytes. Artifacts are immutable and
//!   uniquely named, so an object that exists is complete (it appears only when its upload
//!   finished) and is never uploaded again: builds sharing a parent chain share its objects.
//! - `rootfs/<sha256>.img`: the image rootfs at the bottom of a chain, by content. Images of
//!   one recipe made on two hosts are not byte-identical (debootstrap and mkfs are not
//!   reproducible), so the chain names its rootfs by sha256, not by recipe hash.
//! - `builds/<id>.json`: the [`Manifest`], written last: the commit point. A build whose
//!   manifest is absent is not in the store, whatever objects it already uploaded.
//!
//! On the node, `<data>/store/` keeps each artifact's sha256 (`sums/`, computed once), the
//! builds whose manifest this node wrote or read (`stored/`), the builds it fetched with their
//! size and last use (`fetched/`: a cache, evicted least recently used first) and downloads in
//! progress (`incoming/`, emptied at start).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use vmon_objstore::{ObjectStore, ObjectStoreConfig};

use crate::builds::{fsync_dir, now_unix, valid_name, BuildRecord, Builds};

/// Largest manifest read from the store.
const MAX_MANIFEST: usize = 1 << 20;
const MANIFEST_FORMAT: u32 = 1;

/// An artifact's content: lower-case hex sha256 and length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sum {
    pub sha256: String,
    pub size: u64,
}

/// What `builds/<id>.json` holds: enough to fetch and check every byte of the build.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub record: BuildRecord,
    /// Every artifact the record names (`artifacts/<name>`).
    pub artifacts: BTreeMap<String, Sum>,
    /// The image rootfs under the disk chain (`rootfs/<sha256>.img`), when the chain ends in
    /// the image's rootfs rather than in a raw artifact of its own (OCI builds).
    pub rootfs: Option<Sum>,
    pub uploaded_unix: u64,
}

/// The disk chain of `rec`, top first.
pub fn disk_chain(rec: &BuildRecord) -> Vec<String> {
    rec.disk
        .iter()
        .chain(rec.disk_chain.iter())
        .cloned()
        .collect()
}

/// Whether the bottom of `rec`'s disk chain is the image's rootfs (not an artifact).
pub fn on_image_rootfs(rec: &BuildRecord) -> bool {
    disk_chain(rec)
        .last()
        .is_none_or(|bottom| bottom.ends_with(".qcow2"))
}

/// 64 lower-case hex digits.
fn valid_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn artifact_key(name: &str) -> String {
    format!("artifacts/{name}")
}

fn rootfs_key(sha: &str) -> String {
    format!("rootfs/{sha}.img")
}

fn manifest_key(id: &str) -> String {
    format!("builds/{id}.json")
}

/// The sha256 and length of a file (read once, off the runtime's threads).
pub async fn file_sum(path: &Path) -> anyhow::Result<Sum> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || -> anyhow::Result<Sum> {
        use sha2::Digest;
        use std::io::Read;
        let mut f = std::fs::File::open(&path).with_context(|| format!("{}", path.display()))?;
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut size = 0u64;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            size += n as u64;
        }
        Ok(Sum {
            sha256: hex::encode(h.finalize()),
            size,
        })
    })
    .await
    .map_err(|e| anyhow::anyhow!("hash task: {e}"))?
}

/// A build fetched from the store, as the cache keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fetched {
    pub id: String,
    /// Bytes this fetch downloaded.
    pub bytes: u64,
    pub last_used_unix: u64,
}

/// A node's view of the object store.
pub struct Store {
    s3: ObjectStore,
    dir: PathBuf,
    /// One upload at a time: later builds then find their parents' objects already there.
    uploads: tokio::sync::Semaphore,
    /// Asked before every write (in a cluster, the node's fence): an `Err` refuses it.
    gate: std::sync::OnceLock<WriteGate>,
}

/// Whether the store may be written now; `Err` says why not.
pub type WriteGate = std::sync::Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// A write the gate refused (in a cluster: the node is fenced). Nothing was written; the
/// same write may be made again once the gate opens ([`Store::writable`]).
#[derive(Debug)]
pub struct WriteRefused(pub String);

impl std::fmt::Display for WriteRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WriteRefused {}

/// Whether `e` is (or wraps) a write the gate refused.
pub fn refused_by_gate(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<WriteRefused>())
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("dir", &self.dir).finish()
    }
}

impl Store {
    pub fn open(cfg: ObjectStoreConfig, data_dir: &Path) -> anyhow::Result<Store> {
        let dir = data_dir.join("store");
        for sub in ["sums", "stored", "fetched", "incoming"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        // Downloads a crash interrupted.
        for e in std::fs::read_dir(dir.join("incoming"))?.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
        Ok(Store {
            s3: ObjectStore::new(cfg)?,
            dir,
            uploads: tokio::sync::Semaphore::new(1),
            gate: std::sync::OnceLock::new(),
        })
    }

    /// Puts `gate` before every write from now on (once; a later gate is ignored).
    pub fn set_write_gate(&self, gate: WriteGate) {
        let _ = self.gate.set(gate);
    }

    /// Whether the store may be written now (the gate, when there is one); a refusal is a
    /// [`WriteRefused`].
    fn may_write(&self) -> anyhow::Result<()> {
        match self.gate.get() {
            Some(g) => g().map_err(|m| anyhow::Error::new(WriteRefused(m))),
            None => Ok(()),
        }
    }

    /// Whether the gate lets writes through now.
    pub fn writable(&self) -> bool {
        self.may_write().is_ok()
    }

    pub fn objects(&self) -> &ObjectStore {
        &self.s3
    }

    /// Where a fetch stages its downloads (same filesystem as the artifacts: moved by rename).
    pub fn incoming(&self) -> PathBuf {
        self.dir.join("incoming")
    }

    fn sum_path(&self, name: &str) -> PathBuf {
        self.dir.join("sums").join(name)
    }

    pub fn cached_sum(&self, name: &str) -> Option<Sum> {
        let t = std::fs::read_to_string(self.sum_path(name)).ok()?;
        serde_json::from_str(&t).ok()
    }

    pub fn save_sum(&self, name: &str, sum: &Sum) -> anyhow::Result<()> {
        std::fs::write(self.sum_path(name), serde_json::to_vec(sum)?)?;
        Ok(())
    }

    /// The sum of artifact `name` at `path`: cached, or computed now and cached.
    async fn artifact_sum(&self, name: &str, path: &Path) -> anyhow::Result<Sum> {
        if let Some(s) = self.cached_sum(name) {
            return Ok(s);
        }
        let s = file_sum(path).await?;
        self.save_sum(name, &s)?;
        Ok(s)
    }

    /// The sum of an image's rootfs, computed once and cached beside it (`rootfs.img.sha256`).
    pub async fn rootfs_sum(&self, rootfs: &Path) -> anyhow::Result<Sum> {
        let cache = PathBuf::from(format!("{}.sha256", rootfs.display()));
        let len = std::fs::metadata(rootfs)
            .with_context(|| format!("{}", rootfs.display()))?
            .len();
        if let Some(s) = std::fs::read_to_string(&cache)
            .ok()
            .and_then(|t| serde_json::from_str::<Sum>(&t).ok())
            .filter(|s| s.size == len)
        {
            return Ok(s);
        }
        let s = file_sum(rootfs).await?;
        let tmp = PathBuf::from(format!("{}.{}.tmp", cache.display(), std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec(&s)?)?;
        std::fs::rename(&tmp, &cache)?;
        Ok(s)
    }

    fn stored_path(&self, id: &str) -> PathBuf {
        self.dir.join("stored").join(id)
    }

    /// Whether this node knows `id`'s manifest to be in the store.
    pub fn is_stored(&self, id: &str) -> bool {
        self.stored_path(id).exists()
    }

    pub fn mark_stored(&self, id: &str) -> anyhow::Result<()> {
        std::fs::write(self.stored_path(id), b"")?;
        Ok(())
    }

    /// Uploads `rec` (every artifact the store lacks, the rootfs under it when `rootfs` is the
    /// image's, then the manifest) and marks it stored.
    pub async fn upload(
        &self,
        builds: &Builds,
        rec: &BuildRecord,
        rootfs: Option<&Path>,
    ) -> anyhow::Result<()> {
        let _turn = self
            .uploads
            .acquire()
            .await
            .map_err(|_| anyhow::anyhow!("upload queue closed"))?;
        let mut sums = BTreeMap::new();
        let mut seen = HashSet::new();
        for name in rec.artifacts() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let path = builds.artifact(name);
            let key = artifact_key(name);
            let sum = match self.s3.head(&key).await? {
                Some(_) => self.artifact_sum(name, &path).await?,
                None => {
                    self.may_write()?;
                    let (size, sha256) = self
                        .s3
                        .put_file(&key, &path)
                        .await
                        .with_context(|| format!("uploading {name}"))?;
                    let s = Sum { sha256, size };
                    self.save_sum(name, &s)?;
                    s
                }
            };
            sums.insert(name.clone(), sum);
        }
        let rootfs_sum = match (on_image_rootfs(rec), rootfs) {
            (false, _) => None,
            (true, None) => bail!(
                "build {} sits on image {}, which this node does not have",
                rec.id,
                rec.image_hash
            ),
            (true, Some(path)) => {
                let sum = self.rootfs_sum(path).await?;
                let key = rootfs_key(&sum.sha256);
                if self.s3.head(&key).await?.is_none() {
                    self.may_write()?;
                    let (_, sha) = self.s3.put_file(&key, path).await?;
                    if sha != sum.sha256 {
                        let _ = self.s3.delete(&key).await;
                        bail!("{} changed while it was uploaded", path.display());
                    }
                }
                Some(sum)
            }
        };
        let manifest = Manifest {
            format: MANIFEST_FORMAT,
            record: rec.clone(),
            artifacts: sums,
            rootfs: rootfs_sum,
            uploaded_unix: now_unix(),
        };
        // The manifest makes the build usable elsewhere: the last word of a fenced node is
        // never it.
        self.may_write()?;
        self.s3
            .put_bytes(
                &manifest_key(&rec.id),
                Bytes::from(serde_json::to_vec_pretty(&manifest)?),
            )
            .await?;
        self.mark_stored(&rec.id)?;
        Ok(())
    }

    /// The manifest of `id`, when the store has one.
    pub async fn manifest(&self, id: &str) -> anyhow::Result<Option<Manifest>> {
        let Some(bytes) = self.s3.get_bytes(&manifest_key(id), MAX_MANIFEST).await? else {
            return Ok(None);
        };
        let m: Manifest = serde_json::from_slice(&bytes)
            .with_context(|| format!("the store's manifest of build {id} is corrupt"))?;
        if m.format != MANIFEST_FORMAT || m.record.id != id {
            bail!("the store's manifest of build {id} is not one this node reads");
        }
        if !valid_name(&m.record.image_hash) {
            bail!("the store's manifest of build {id} names a malformed image hash");
        }
        for a in m.record.artifacts() {
            if !m.artifacts.contains_key(a) {
                bail!("the store's manifest of build {id} has no sum for {a}");
            }
        }
        // Names become file names here, sums parts of names and keys: check both.
        for (name, sum) in m
            .artifacts
            .iter()
            .map(|(n, s)| (Some(n), s))
            .chain(m.rootfs.iter().map(|s| (None, s)))
        {
            if name.is_some_and(|n| !valid_name(n)) {
                bail!("the store's manifest of build {id} names an artifact {name:?}");
            }
            if !valid_sha256(&sum.sha256) {
                bail!("the store's manifest of build {id} has a malformed sha256");
            }
        }
        Ok(Some(m))
    }

    /// Downloads artifact `name` to `dest`, checked against `sum`.
    pub async fn download_artifact(
        &self,
        name: &str,
        sum: &Sum,
        dest: &Path,
    ) -> anyhow::Result<()> {
        self.download(&artifact_key(name), sum, dest).await
    }

    /// Downloads the rootfs of `sum` to `dest`.
    pub async fn download_rootfs(&self, sum: &Sum, dest: &Path) -> anyhow::Result<()> {
        self.download(&rootfs_key(&sum.sha256), sum, dest).await
    }

    async fn download(&self, key: &str, sum: &Sum, dest: &Path) -> anyhow::Result<()> {
        let (size, _) = self
            .s3
            .get_to_file(key, dest, Some(&sum.sha256))
            .await
            .with_context(|| format!("fetching {key}"))?;
        if size != sum.size {
            let _ = std::fs::remove_file(dest);
            bail!("{key} is {size} bytes, the manifest says {}", sum.size);
        }
        Ok(())
    }

    /// Deletes `id`'s manifest (its objects go with the next [`Store::collect`]).
    pub async fn delete_manifest(&self, id: &str) -> anyhow::Result<()> {
        self.may_write()?;
        self.s3.delete(&manifest_key(id)).await?;
        let _ = std::fs::remove_file(self.stored_path(id));
        Ok(())
    }

    /// Garbage collection: deletes artifact and rootfs objects that no manifest names and that
    /// are older than `min_age_secs` (an upload in flight writes its objects before its
    /// manifest). Returns the keys deleted. Meant for one caller at a time (the api's leader).
    pub async fn collect(&self, min_age_secs: u64) -> anyhow::Result<Vec<String>> {
        let mut named: HashSet<String> = HashSet::new();
        for m in self.s3.list("builds/").await? {
            let Some(id) = m
                .key
                .strip_prefix("builds/")
                .and_then(|k| k.strip_suffix(".json"))
            else {
                continue;
            };
            // A manifest that cannot be read names nothing we could trust; keep everything.
            let manifest = self
                .manifest(id)
                .await
                .with_context(|| format!("reading manifest {id}; collecting nothing"))?;
            if let Some(m) = manifest {
                named.extend(m.artifacts.keys().map(|a| artifact_key(a)));
                named.extend(m.rootfs.iter().map(|r| rootfs_key(&r.sha256)));
            }
        }
        let cutoff = now_unix().saturating_sub(min_age_secs) as i64;
        let mut deleted = Vec::new();
        for prefix in ["artifacts/", "rootfs/"] {
            for o in self.s3.list(prefix).await? {
                let old = o.modified_unix.is_some_and(|t| t <= cutoff);
                if old && !named.contains(&o.key) {
                    self.may_write()?;
                    self.s3.delete(&o.key).await?;
                    deleted.push(o.key);
                }
            }
        }
        Ok(deleted)
    }

    fn fetched_path(&self, id: &str) -> PathBuf {
        self.dir.join("fetched").join(id)
    }

    pub fn mark_fetched(&self, id: &str, bytes: u64) -> anyhow::Result<()> {
        let f = Fetched {
            id: id.to_string(),
            bytes,
            last_used_unix: now_unix(),
        };
        std::fs::write(self.fetched_path(id), serde_json::to_vec(&f)?)?;
        fsync_dir(&self.dir.join("fetched"))?;
        Ok(())
    }

    /// Notes a use of a fetched build (a start), for the cache's order.
    pub fn touch_fetched(&self, id: &str) {
        let p = self.fetched_path(id);
        let Some(mut f) = std::fs::read_to_string(&p)
            .ok()
            .and_then(|t| serde_json::from_str::<Fetched>(&t).ok())
        else {
            return;
        };
        f.last_used_unix = now_unix();
        if let Ok(b) = serde_json::to_vec(&f) {
            let _ = std::fs::write(&p, b);
        }
    }

    pub fn forget_fetched(&self, id: &str) {
        let _ = std::fs::remove_file(self.fetched_path(id));
    }

    /// Fetched builds, least recently used first.
    pub fn fetched(&self) -> Vec<Fetched> {
        let mut v: Vec<Fetched> = std::fs::read_dir(self.dir.join("fetched"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .filter_map(|t| serde_json::from_str(&t).ok())
            .collect();
        v.sort_by_key(|f: &Fetched| (f.last_used_unix, f.id.clone()));
        v
    }
}

/// Which fetched builds to evict, least recently used first, so that the rest fit in
/// `bound_bytes`; `keep` is never chosen.
pub fn to_evict(fetched: &[Fetched], bound_bytes: u64, keep: &str) -> Vec<String> {
    let mut total: u64 = fetched.iter().map(|f| f.bytes).sum();
    let mut out = Vec::new();
    for f in fetched {
        if total <= bound_bytes {
            break;
        }
        if f.id == keep {
            continue;
        }
        total = total.saturating_sub(f.bytes);
        out.push(f.id.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(id: &str, bytes: u64, t: u64) -> Fetched {
        Fetched {
            id: id.into(),
            bytes,
            last_used_unix: t,
        }
    }

    #[test]
    fn manifest_sums_must_be_sha256_hex() {
        assert!(valid_sha256(&"ab".repeat(32)));
        assert!(!valid_sha256(&"AB".repeat(32)));
        assert!(!valid_sha256(&"a".repeat(63)));
        assert!(!valid_sha256(&format!("{}é", "a".repeat(62))));
        assert!(!valid_name("../../etc/passwd"));
    }

    #[test]
    fn the_cache_evicts_least_recently_used_first_and_never_the_build_in_hand() {
        let v = vec![f("a", 10, 1), f("b", 10, 2), f("c", 10, 3)];
        assert!(to_evict(&v, 30, "c").is_empty());
        assert_eq!(to_evict(&v, 25, "c"), vec!["a"]);
        assert_eq!(to_evict(&v, 10, "c"), vec!["a", "b"]);
        assert_eq!(to_evict(&v, 10, "a"), vec!["b", "c"]);
        assert_eq!(to_evict(&v, 0, "b"), vec!["a", "c"]);
    }
}
