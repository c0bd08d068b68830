//! Confinement of the node's QEMUs: who each runs as, which files it is handed, and the sealed
//! RAM bases restores map (see [`vmon_vm::user`] and [`vmon_vm::ram_base`]).
//!
//! The rules, in one place:
//! - a slot's QEMU runs as [`Slot::qemu_uid`] in the shared group `qemu_uid_base`;
//! - the data dir and the directories QEMUs reach through are root's, `--x` for that group;
//! - a QEMU owns only what it writes: its run directory, its overlay, a boot's RAM file, the
//!   files a capture asks it to write;
//! - everything a build record names is sealed at [`crate::builds::Builds::put`] (root's,
//!   group-readable for backing chains, writable by no QEMU);
//! - RAM bases are mapped from sealed memory files, never opened by path;
//! - each QEMU has a mount namespace of its own where the artifacts directory shows only the
//!   files linked into its view ([`Node::show`]): its chain, its overlay, its captures' files.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use vmon_vm::QemuUser;

use super::Node;
use crate::slots::Slot;

/// Sealed RAM bases kept for the next restore (the least recently used beyond this go; the
/// processes already mapping one keep it).
const RAM_BASES_KEPT: usize = 8;

/// Sealed copies of RAM bases, most recently used last.
#[derive(Default)]
pub(super) struct RamBases {
    kept: std::sync::Mutex<VecDeque<(String, Arc<OwnedFd>)>>,
    /// One copy at a time per base: concurrent restores of a new base share it.
    making: tokio::sync::Mutex<()>,
}

impl Node {
    /// The user a QEMU in `slot` runs as (None: QEMUs run as root, `VMON_QEMU_UID_BASE=0`).
    pub(super) fn qemu_user(&self, slot: &Slot) -> Option<QemuUser> {
        let base = self.cfg.qemu_uid_base?;
        let mut groups = vec![base];
        if self.accel.accel == vmon_vm::Accel::Kvm {
            if let Some(kvm) = vmon_vm::user::group_id("kvm") {
                groups.push(kvm);
            }
        }
        Some(QemuUser {
            uid: slot.qemu_uid(base),
            gid: base,
            groups,
        })
    }

    /// The private view of the artifacts for the QEMU of `run_dir` (made empty if missing;
    /// None when QEMUs run as root and see everything).
    pub(super) fn view_for(
        &self,
        run_dir: &Path,
    ) -> anyhow::Result<Option<(std::path::PathBuf, std::path::PathBuf)>> {
        let Some(gid) = self.qemu_gid() else {
            return Ok(None);
        };
        let view = vmon_vm::process::view_dir(run_dir);
        std::fs::create_dir_all(&view)?;
        vmon_vm::user::traverse_only(&view, gid)?;
        Ok(Some((view, self.builds.artifacts.clone())))
    }

    /// Shows artifacts `names` to the QEMU of `run_dir`: hard links in its view, so that the
    /// paths QEMU is given (and its backing chain names) resolve in its mount namespace.
    pub(super) fn show<'a>(
        &self,
        run_dir: &Path,
        names: impl IntoIterator<Item = &'a str>,
    ) -> anyhow::Result<()> {
        if self.qemu_gid().is_none() {
            return Ok(());
        }
        let view = vmon_vm::process::view_dir(run_dir);
        for name in names {
            let to = view.join(name);
            match std::fs::hard_link(self.builds.artifact(name), &to) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("showing {name} to its QEMU"));
                }
            }
        }
        Ok(())
    }

    /// The group every QEMU is in.
    pub(super) fn qemu_gid(&self) -> Option<u32> {
        self.cfg.qemu_uid_base
    }

    /// Hands `path` to the QEMU of `slot` (a no-op when QEMUs run as root).
    pub(super) fn hand_to(&self, slot: &Slot, path: &Path) -> anyhow::Result<()> {
        if let Some(u) = self.qemu_user(slot) {
            u.hand(path)
                .with_context(|| format!("handing {} to QEMU", path.display()))?;
        }
        Ok(())
    }

    /// Creates `path` for the QEMU of `slot` to write by name.
    pub(super) fn hand_new_to(&self, slot: &Slot, path: &Path) -> anyhow::Result<()> {
        match self.qemu_user(slot) {
            Some(u) => u
                .hand_new(path)
                .with_context(|| format!("handing {} to QEMU", path.display())),
            None => Ok(()),
        }
    }

    /// Makes the directories QEMUs pass through traversable by their group alone (run once at
    /// open; also mends data dirs made before QEMUs ran unprivileged).
    pub(super) fn open_paths_to_qemu(&self) -> anyhow::Result<()> {
        let Some(gid) = self.qemu_gid() else {
            return Ok(());
        };
        let d = &self.cfg.data_dir;
        // The data dir and the directories above it are the operator's: only what QEMUs lack
        // is added (group search on the data dir), and a parent they cannot pass is an error
        // that says so rather than a failure at the first boot.
        vmon_vm::user::searchable_by_group(d, gid)
            .with_context(|| format!("opening {} to QEMUs", d.display()))?;
        let mut up = d.parent();
        while let Some(dir) = up {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir)
                .map(|m| m.permissions().mode())
                .unwrap_or(0);
            if mode & 0o001 == 0 {
                anyhow::bail!(
                    "QEMUs run unprivileged (uid {gid} and up) and cannot pass {} (mode {:o}) \
                     to reach the data dir {}: choose a data dir under /var/lib, or set \
                     VMON_QEMU_UID_BASE=0 to run QEMU as root",
                    dir.display(),
                    mode & 0o7777,
                    d.display()
                );
            }
            up = dir.parent();
        }
        if self.accel.accel == vmon_vm::Accel::Kvm {
            use std::os::unix::fs::{MetadataExt, PermissionsExt};
            let kvm = vmon_vm::user::group_id("kvm");
            let ok = std::fs::metadata("/dev/kvm").is_ok_and(|m| {
                let mode = m.permissions().mode();
                mode & 0o006 == 0o006 || (Some(m.gid()) == kvm && mode & 0o060 == 0o060)
            });
            if !ok {
                anyhow::bail!(
                    "QEMUs run unprivileged and cannot open /dev/kvm: give it to group kvm with \
                     mode 0660 (the udev default), or set VMON_QEMU_UID_BASE=0 to run QEMU as root"
                );
            }
        }
        for dir in [
            d.join("artifacts"),
            d.join("pool"),
            d.join("sandboxes"),
            d.join("run"),
        ] {
            std::fs::create_dir_all(&dir)?;
            vmon_vm::user::traverse_only(&dir, gid)
                .with_context(|| format!("opening {} to QEMUs", dir.display()))?;
        }
        Ok(())
    }

    /// The sealed memory file of RAM base `mem_base`, made on first use.
    pub(super) async fn ram_base(&self, mem_base: &str) -> anyhow::Result<Option<Arc<OwnedFd>>> {
        if self.cfg.qemu_uid_base.is_none() {
            // Root QEMUs map the file itself, as before.
            return Ok(None);
        }
        if let Some(fd) = self.kept_base(mem_base) {
            return Ok(Some(fd));
        }
        let _turn = self.ram_bases.making.lock().await;
        if let Some(fd) = self.kept_base(mem_base) {
            return Ok(Some(fd));
        }
        let path = self.builds.artifact(mem_base);
        let t0 = std::time::Instant::now();
        let fd = tokio::task::spawn_blocking(move || vmon_vm::ram_base::sealed_copy(&path))
            .await
            .map_err(|e| anyhow::anyhow!("RAM base copy: {e}"))??;
        tracing::debug!(
            mem_base,
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "sealed RAM base"
        );
        let fd = Arc::new(fd);
        if let Ok(mut kept) = self.ram_bases.kept.lock() {
            kept.push_back((mem_base.to_string(), fd.clone()));
            while kept.len() > RAM_BASES_KEPT {
                kept.pop_front();
            }
        }
        Ok(Some(fd))
    }

    fn kept_base(&self, mem_base: &str) -> Option<Arc<OwnedFd>> {
        let mut kept = self.ram_bases.kept.lock().ok()?;
        let i = kept.iter().position(|(n, _)| n == mem_base)?;
        let entry = kept.remove(i)?;
        let fd = entry.1.clone();
        kept.push_back(entry);
        Some(fd)
    }

    /// The files build `build_id` is made of (paths), for checks of their modes.
    pub fn build_files(&self, build_id: &str) -> Vec<std::path::PathBuf> {
        self.record(build_id)
            .map(|r| r.artifacts().map(|a| self.builds.artifact(a)).collect())
            .unwrap_or_default()
    }

    /// The disk overlay a running sandbox writes.
    pub async fn overlay_file(&self, sandbox_id: &str) -> Option<std::path::PathBuf> {
        let live = self.live(sandbox_id).ok()?;
        let l = live.lock().await;
        Some(self.builds.artifact(&l.state.overlay))
    }

    /// Forgets the sealed copy of a RAM base whose build is gone.
    pub(super) fn drop_ram_base(&self, mem_base: &str) {
        if let Ok(mut kept) = self.ram_bases.kept.lock() {
            kept.retain(|(n, _)| n != mem_base);
        }
    }
}
