//! Volumes kept in the cluster's object store ([`VolumeShare::object_store`]): a node mounts
//! its own cache of the volume, `<volumes dir>/<id>`, served by the same unprivileged
//! virtiofsd as a local volume, filled from the store before a mount and written back at
//! pause, at kill and every `volume_sync` interval.
//!
//! In the store a volume is one archive of its whole tree, `volumes/<id>/tree-<sha256>.tar`
//! (GNU tar, names sorted, numeric owners as the guest sees them), and `volumes/<id>/head`,
//! the sha256 of the current one. A node remembers the sha256 it last filled or wrote in
//! `<volumes dir>/.synced/<id>` (root's): a mount when that is still the head downloads
//! nothing, a write-back whose archive hashes the same uploads nothing. An upload writes the
//! archive first and the head after it, so a reader sees the old tree or the new one, never
//! part of either.
//!
//! The volume's bytes are the tenant's: the archive is made and unpacked by `tar` running as
//! the volume's own unprivileged host ids (in its user namespace, as the volume's virtiofsd
//! is, [`super::volume_owner`]), in a mount namespace of its own where the cache directory
//! is bound over [`super::volumes::MOUNT_POINT`]; GNU tar refuses members with `..` and
//! absolute names and never extracts through a link it made. The node itself only moves the
//! archive between the store and a root-owned staging file whose name it chose.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use anyhow::{bail, Context};
use sha2::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;
use vmon_proto::node::{NodeError, VolumeShare};

use super::{valid_id, Node};

/// The root-owned directory (in the volumes directory) of sync markers and staging files.
const SYNCED_DIR: &str = ".synced";
/// The archiver, run confined (Debian's GNU tar).
const TAR: &str = "/usr/bin/tar";
/// The largest `head` object (a hex sha256 and a newline).
const MAX_HEAD: usize = 128;

fn head_key(volume: &str) -> String {
    format!("volumes/{volume}/head")
}

/// Written when the volume is destroyed: a write-back that finds it sends nothing.
fn deleted_key(volume: &str) -> String {
    format!("volumes/{volume}/deleted")
}

fn tree_key(volume: &str, sha: &str) -> String {
    format!("volumes/{volume}/tree-{sha}.tar")
}

fn is_sha(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What a write-back did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum WriteBack {
    /// The node has no copy of the volume.
    Absent,
    /// The tree hashes as the node last filled or wrote it: nothing was sent.
    Unchanged,
    /// The tree was stored; its archive's sha256 and size.
    Stored(String, u64),
}

/// A write-back refused because the archive passed the share's `max_bytes`.
#[derive(Debug)]
pub(super) struct OverQuota {
    pub volume: String,
    pub max: u64,
}

impl std::fmt::Display for OverQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "volume {} holds more than {} bytes (quotas.max_volume_bytes): not written back; \
             the object store keeps its previous contents",
            self.volume, self.max
        )
    }
}

impl std::error::Error for OverQuota {}

/// A sync error as a node error: over quota is the caller's (400), the rest a failure.
pub(super) fn node_error(what: &str, volume: &str, e: anyhow::Error) -> NodeError {
    if let Some(q) = e.downcast_ref::<OverQuota>() {
        return NodeError::InvalidArgument(q.to_string());
    }
    NodeError::Failed(format!("{what} volume {volume}: {e:#}"))
}

/// One node's copies of object-store volumes: its volumes directory, the first id of its
/// ranges, its store. The caller serialises the calls of one volume.
pub(super) struct Syncer<'a> {
    pub objects: &'a vmon_objstore::ObjectStore,
    pub volumes_dir: &'a Path,
    pub first: u32,
}

/// Makes the volumes directory when this node has none yet (with the store no shared one is
/// laid out for it): root's, 0700, as the api makes a local one.
pub(super) fn ensure_volumes_dir(volumes_dir: &Path) -> std::io::Result<()> {
    if !volumes_dir.is_dir() {
        std::fs::create_dir_all(volumes_dir)?;
        std::fs::set_permissions(volumes_dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// The root-owned directory of sync markers and staging files (made when missing).
pub(super) fn synced_dir(volumes_dir: &Path) -> std::io::Result<PathBuf> {
    ensure_volumes_dir(volumes_dir)?;
    let dir = volumes_dir.join(SYNCED_DIR);
    std::fs::create_dir_all(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    Ok(dir)
}

impl Syncer<'_> {
    fn ensure_volumes_dir(&self) -> std::io::Result<()> {
        ensure_volumes_dir(self.volumes_dir)
    }

    fn synced_dir(&self) -> std::io::Result<PathBuf> {
        synced_dir(self.volumes_dir)
    }

    /// The sha256 of the tree this node last filled or wrote.
    fn synced(&self, volume: &str) -> Option<String> {
        let dir = self.synced_dir().ok()?;
        let s = std::fs::read_to_string(dir.join(volume)).ok()?;
        let s = s.trim().to_string();
        is_sha(&s).then_some(s)
    }

    fn set_synced(&self, volume: &str, sha: Option<&str>) -> std::io::Result<()> {
        let path = self.synced_dir()?.join(volume);
        match sha {
            Some(sha) => {
                let tmp = path.with_extension("tmp");
                std::fs::write(&tmp, sha)?;
                std::fs::rename(&tmp, &path)
            }
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        }
    }

    /// The sha256 of the store's current tree of `volume`, if it has one.
    async fn head(&self, volume: &str) -> anyhow::Result<Option<String>> {
        match self.objects.get_bytes(&head_key(volume), MAX_HEAD).await? {
            Some(b) => {
                let s = String::from_utf8_lossy(&b).trim().to_string();
                if !is_sha(&s) {
                    bail!("the store's head of volume {volume} is not a sha256");
                }
                Ok(Some(s))
            }
            None => Ok(None),
        }
    }

    /// Brings the copy of `volume` up to the store's tree, unless it is `live` (mounted on
    /// this node: kept). Returns whether it unpacked anything.
    pub(super) async fn fill(&self, volume: &str, live: bool) -> anyhow::Result<bool> {
        self.ensure_volumes_dir()
            .with_context(|| format!("creating {}", self.volumes_dir.display()))?;
        let dir = self.volumes_dir.join(volume);
        if !dir.exists() {
            // As the api makes a volume's root: anyone in the guest may write it (the volumes
            // directory above is root's 0700).
            std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))?;
            self.set_synced(volume, None)?;
        }
        let head = self.head(volume).await?;
        if head == self.synced(volume) {
            return Ok(false);
        }
        if live {
            tracing::info!(volume, "volume mounted here already: its live copy is kept");
            return Ok(false);
        }
        let t0 = std::time::Instant::now();
        // The old copy goes first; a failure below leaves no marker, so the next mount retries.
        self.set_synced(volume, None)?;
        let staged = match &head {
            Some(sha) => {
                let tmp = self.synced_dir()?.join(format!("{volume}.in.tar"));
                self.objects
                    .get_to_file(&tree_key(volume, sha), &tmp, Some(sha))
                    .await
                    .with_context(|| format!("fetching volume {volume}'s tree {sha}"))?;
                Some(tmp)
            }
            None => None,
        };
        let r = unpack(self.volumes_dir, self.first, volume, staged.as_deref()).await;
        if let Some(tmp) = &staged {
            let _ = std::fs::remove_file(tmp);
        }
        r?;
        self.set_synced(volume, head.as_deref())?;
        tracing::info!(volume, head = ?head, ms = t0.elapsed().as_millis() as u64, "volume filled from the object store");
        Ok(true)
    }

    /// A destroyed volume: the marker that stops every later write-back, then every other
    /// object of it, then this node's copy unless it is `live` (mounted here).
    pub(super) async fn delete(&self, volume: &str, live: bool) -> anyhow::Result<()> {
        let marker = deleted_key(volume);
        self.objects
            .put_bytes(&marker, bytes::Bytes::from_static(b"deleted\n"))
            .await?;
        for o in self.objects.list(&format!("volumes/{volume}/")).await? {
            if o.key == marker {
                continue;
            }
            match self.objects.delete(&o.key).await {
                Ok(()) | Err(vmon_objstore::Error::NotFound(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        drop_copy(self.volumes_dir, self.first, volume, live).await
    }

    /// Writes the copy of `volume` back to the store when it changed since this node's last
    /// sync. Over `max` bytes (0: no limit) it is refused with [`OverQuota`] and the store
    /// keeps what it had.
    pub(super) async fn write_back(&self, volume: &str, max: u64) -> anyhow::Result<WriteBack> {
        if !self.volumes_dir.join(volume).is_dir() {
            return Ok(WriteBack::Absent);
        }
        let t0 = std::time::Instant::now();
        let tmp = self.synced_dir()?.join(format!("{volume}.out.tar"));
        let packed = pack(self.volumes_dir, self.first, volume, &tmp, max).await;
        let (sha, size) = match packed {
            Ok(v) => v,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        if self.synced(volume).as_deref() == Some(sha.as_str()) {
            let _ = std::fs::remove_file(&tmp);
            return Ok(WriteBack::Unchanged);
        }
        if self.objects.head(&deleted_key(volume)).await?.is_some() {
            let _ = std::fs::remove_file(&tmp);
            tracing::info!(volume, "volume destroyed: not written back");
            return Ok(WriteBack::Unchanged);
        }
        let stored = async {
            self.objects.put_file(&tree_key(volume, &sha), &tmp).await?;
            let prev = self.head(volume).await.ok().flatten();
            self.objects
                .put_bytes(&head_key(volume), bytes::Bytes::from(sha.clone()))
                .await?;
            anyhow::Ok(prev)
        }
        .await;
        let _ = std::fs::remove_file(&tmp);
        let prev = stored?;
        self.set_synced(volume, Some(&sha))?;
        // Older trees go; the previous head stays a while for a reader that just read it.
        let keep = [
            tree_key(volume, &sha),
            tree_key(volume, prev.as_deref().unwrap_or("")),
        ];
        if let Ok(list) = self.objects.list(&format!("volumes/{volume}/tree-")).await {
            for o in list.into_iter().filter(|o| !keep.contains(&o.key)) {
                let _ = self.objects.delete(&o.key).await;
            }
        }
        tracing::info!(volume, sha = %sha, size, ms = t0.elapsed().as_millis() as u64, "volume written back to the object store");
        Ok(WriteBack::Stored(sha, size))
    }
}

impl Node {
    fn syncer(&self) -> anyhow::Result<Syncer<'_>> {
        match &self.store {
            Some(s) => Ok(Syncer {
                objects: s.objects(),
                volumes_dir: &self.cfg.volumes_dir,
                first: self.cfg.volume_uid_base,
            }),
            None => {
                bail!("this node has no object store (VMON_S3_ENDPOINT) for object-store volumes")
            }
        }
    }

    /// Serialises the syncs of one volume on this node (the fetch locks' map, its own keys).
    pub(super) fn volume_lock(&self, volume: &str) -> Arc<Mutex<()>> {
        let mut m = self
            .fetches
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        m.entry(format!("volume:{volume}")).or_default().clone()
    }

    /// Whether a sandbox on this node mounts `volume` now (its cache is live: never refilled).
    async fn mounted_here(&self, volume: &str) -> bool {
        let lives: Vec<_> = match self.sandboxes.lock() {
            Ok(m) => m.values().cloned().collect(),
            Err(_) => return true,
        };
        for l in lives {
            if l.lock()
                .await
                .state
                .volumes
                .iter()
                .any(|s| s.volume_id == volume)
            {
                return true;
            }
        }
        false
    }

    /// The object-store volumes of running sandboxes, once each (for the periodic write-back).
    async fn store_shares(&self) -> Vec<VolumeShare> {
        let lives: Vec<_> = match self.sandboxes.lock() {
            Ok(m) => m.values().cloned().collect(),
            Err(_) => return Vec::new(),
        };
        let mut out: Vec<VolumeShare> = Vec::new();
        for l in lives {
            for s in &l.lock().await.state.volumes {
                if written_back(s) && !out.iter().any(|o| o.volume_id == s.volume_id) {
                    out.push(s.clone());
                }
            }
        }
        out
    }

    /// Brings this node's copy of each object-store volume of a start up to the store's
    /// current tree (before anything is mounted). A volume a sandbox here mounts already keeps
    /// its live copy.
    pub(super) async fn fill_store_volumes(&self, shares: &[VolumeShare]) -> Result<(), NodeError> {
        for s in shares.iter().filter(|s| s.object_store) {
            let volume = s.volume_id.as_str();
            if !valid_id(volume) {
                return Err(NodeError::InvalidArgument(format!(
                    "{volume:?} is not a volume id"
                )));
            }
            let filled = async {
                let syncer = self.syncer()?;
                // Asked before the lock: a pause holding its sandbox waits for the lock.
                let live = self.mounted_here(volume).await;
                let lock = self.volume_lock(volume);
                let _held = lock.lock().await;
                syncer.fill(volume, live).await
            };
            filled.await.map_err(|e| node_error("filling", volume, e))?;
        }
        Ok(())
    }

    /// A destroyed volume's objects and this node's cache (see [`vmon_proto::node::DeleteVolume`]).
    pub(super) async fn delete_store_volume(&self, volume: &str) -> Result<(), NodeError> {
        if !valid_id(volume) {
            return Err(NodeError::InvalidArgument(format!(
                "{volume:?} is not a volume id"
            )));
        }
        let live = self.mounted_here(volume).await;
        let lock = self.volume_lock(volume);
        let _held = lock.lock().await;
        let deleted = match &self.store {
            Some(s) => {
                Syncer {
                    objects: s.objects(),
                    volumes_dir: &self.cfg.volumes_dir,
                    first: self.cfg.volume_uid_base,
                }
                .delete(volume, live)
                .await
            }
            // No store: only this node's cache.
            None => {
                drop_copy(
                    &self.cfg.volumes_dir,
                    self.cfg.volume_uid_base,
                    volume,
                    live,
                )
                .await
            }
        };
        deleted.map_err(|e| NodeError::Failed(format!("deleting volume {volume}: {e:#}")))?;
        tracing::info!(volume, "destroyed volume's objects and cache deleted");
        Ok(())
    }

    /// Writes this node's copy of `share` (an object-store volume, or a read-write bucket
    /// mount's cache) back when it changed.
    async fn write_back(&self, share: &VolumeShare) -> anyhow::Result<WriteBack> {
        let lock = self.volume_lock(&share.volume_id);
        let _held = lock.lock().await;
        if let Some(b) = &share.bucket {
            return self.write_back_bucket(share, b).await;
        }
        self.syncer()?
            .write_back(&share.volume_id, share.max_bytes)
            .await
    }

    /// Writes back every object-store volume and read-write bucket mount of `shares` (a
    /// pause: its guest is stopped). The first failure is returned: the pause fails and the
    /// sandbox runs on.
    pub(super) async fn write_back_all(&self, shares: &[VolumeShare]) -> Result<(), NodeError> {
        for s in shares.iter().filter(|s| written_back(s)) {
            self.write_back(s)
                .await
                .map_err(|e| node_error("writing back", &s.volume_id, e))?;
        }
        Ok(())
    }

    /// Writes back what a killed sandbox mounted; failures are logged (a kill cannot fail).
    pub(super) async fn write_back_after_kill(&self, shares: &[VolumeShare]) {
        for s in shares.iter().filter(|s| written_back(s)) {
            if let Err(e) = self.write_back(s).await {
                tracing::warn!(volume = %s.volume_id, error = %format!("{e:#}"), "writing back a killed sandbox's volume");
            }
        }
    }

    /// Every `interval`, writes back the object-store volumes of running sandboxes.
    pub(super) fn spawn_volume_sync(self: &Arc<Self>, interval: std::time::Duration) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(node) = weak.upgrade() else { break };
                for s in node.store_shares().await {
                    if let Err(e) = node.write_back(&s).await {
                        tracing::warn!(volume = %s.volume_id, error = %format!("{e:#}"), "periodic volume write-back");
                    }
                }
            }
        });
    }
}

/// Removes this node's copy of a destroyed volume (emptied by its own ids) and its marker,
/// unless a sandbox here mounts it (`live`: it stays until the node's disk is cleaned).
async fn drop_copy(volumes_dir: &Path, first: u32, volume: &str, live: bool) -> anyhow::Result<()> {
    let dir = volumes_dir.join(volume);
    if live {
        tracing::info!(
            volume,
            "destroyed volume still mounted here: its cache stays"
        );
    } else if dir.is_dir() {
        unpack(volumes_dir, first, volume, None).await?;
        std::fs::remove_dir(&dir).with_context(|| format!("removing {}", dir.display()))?;
        let _ = std::fs::remove_file(synced_dir(volumes_dir)?.join(volume));
    }
    Ok(())
}

/// Whether a share's node copy goes back to a store: an object-store volume, or a bucket
/// mount that is not read-only.
fn written_back(s: &VolumeShare) -> bool {
    s.object_store || s.bucket.as_ref().is_some_and(|b| !b.read_only)
}

/// A command run as the volume's own ids, in `<volumes dir>/<id>` bound over the mount
/// point (its working directory). The caller sets its arguments and stdio.
async fn confined(
    volumes_dir: &Path,
    first: u32,
    volume: &str,
    program: &str,
) -> anyhow::Result<tokio::process::Command> {
    let (dir, v) = (volumes_dir.to_path_buf(), volume.to_string());
    let ns = tokio::task::spawn_blocking(move || {
        let base = super::volume_owner::ensure_range(&dir, &v, first)?;
        vmon_vm::userns::UserNs::new(base).context("making the volume's user namespace")
    })
    .await??;
    super::volumes::mount_point()?;
    let source = volumes_dir.join(volume);
    let source_c = std::ffi::CString::new(source.as_os_str().as_encoded_bytes())
        .context("a volume path holds a NUL byte")?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.kill_on_drop(true)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("LC_ALL", "C");
    let ns = Arc::new(ns);
    let ns_fd = ns.raw_fd();
    let keep = ns.clone();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe system calls on values prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let _ = &keep;
            vmon_vm::process::bind_in_own_mount_namespace(
                &source_c,
                super::volumes::MOUNT_POINT_C,
            )?;
            vmon_vm::userns::enter(ns_fd)?;
            if libc::chdir(super::volumes::MOUNT_POINT_C.as_ptr()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// Empties the cache of `volume` and unpacks `archive` into it, confined.
pub(super) async fn unpack(
    volumes_dir: &Path,
    first: u32,
    volume: &str,
    archive: Option<&Path>,
) -> anyhow::Result<()> {
    let script = "find . -mindepth 1 -maxdepth 1 -exec rm -rf -- {} + && \
                  if [ \"$1\" = 1 ]; then exec /usr/bin/tar --extract --file=- \
                  --numeric-owner --same-owner --preserve-permissions \
                  --delay-directory-restore; fi";
    let has = if archive.is_some() { "1" } else { "0" };
    let stdin = match archive {
        Some(a) => Stdio::from(std::fs::File::open(a)?),
        None => Stdio::null(),
    };
    let mut cmd = confined(volumes_dir, first, volume, "/bin/sh").await?;
    cmd.args(["-c", script, "unpack", has])
        .stdin(stdin)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let out = cmd
        .spawn()
        .context("starting the unpacker")?
        .wait_with_output()
        .await?;
    if !out.status.success() {
        bail!(
            "unpacking failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .chars()
                .take(2000)
                .collect::<String>()
        );
    }
    Ok(())
}

/// Archives the cache of `volume` into `dest` (confined), hashing it; over `max` bytes
/// (when not 0) the archiver is stopped and [`OverQuota`] returned.
pub(super) async fn pack(
    volumes_dir: &Path,
    first: u32,
    volume: &str,
    dest: &Path,
    max: u64,
) -> anyhow::Result<(String, u64)> {
    let mut cmd = confined(volumes_dir, first, volume, TAR).await?;
    cmd.args([
        "--create",
        "--file=-",
        "--format=gnu",
        "--sort=name",
        "--numeric-owner",
        "--one-file-system",
        "--warning=no-file-ignored",
        "--warning=no-file-changed",
        ".",
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().context("starting the archiver")?;
    let mut out = child.stdout.take().context("the archiver's stdout")?;
    let mut err = child.stderr.take().context("the archiver's stderr")?;
    let errs = tokio::spawn(async move {
        let mut v = Vec::new();
        let _ = (&mut err).take(8192).read_to_end(&mut v).await;
        v
    });
    let mut file = tokio::fs::File::create(dest).await?;
    let mut hash = sha2::Sha256::new();
    let mut size: u64 = 0;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = out.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        size += n as u64;
        if max > 0 && size > max {
            let _ = child.kill().await;
            return Err(OverQuota {
                volume: volume.to_string(),
                max,
            }
            .into());
        }
        hash.update(&buf[..n]);
        file.write_all(&buf[..n]).await?;
    }
    file.sync_all().await?;
    let status = child.wait().await?;
    let errs = errs.await.unwrap_or_default();
    // 1: a file changed while it was read (a periodic write-back of a running guest).
    if !matches!(status.code(), Some(0) | Some(1)) {
        bail!(
            "archiving failed ({status}): {}",
            String::from_utf8_lossy(&errs)
        );
    }
    Ok((hex::encode(hash.finalize()), size))
}

#[cfg(test)]
mod tests;
