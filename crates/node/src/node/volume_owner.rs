//! Which host ids own a volume's files (see [`vmon_proto::node::volume_ids`]).
//!
//! Each volume gets a range of 65,536 host ids at its first mount, from
//! `volume_uid_base` on, never one another volume holds: the lowest range whose base owns no
//! root in the volumes directory. The range is recorded nowhere but in the owner of the
//! volume's root, so every node and api that shares the directory reads the same one. Files a
//! volume held before (written by the content plane, or by a root virtiofsd of an older node)
//! are moved into the range once, walking the tree by descriptor without following a link.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::{bail, Context};
use rustix::fs::{self as rfs, AtFlags, Gid, Mode, OFlags, Uid};
use vmon_proto::node::volume_ids::{to_host, OVERFLOW, VOLUME_IDS};

/// The most ranges one volumes directory hands out (from the base, 65,536 ids each).
pub(super) const MAX_RANGES: u32 = 8_192;

/// A tree deeper than this is refused rather than walked (one descriptor per level).
const MAX_DEPTH: usize = 1_024;

/// Serialises range choices of the processes that share the volumes directory.
const LOCK_FILE: &str = ".ranges.lock";

/// The base of `volume`'s range, giving it one (and moving its files into it) when it has
/// none yet. Blocking.
pub(super) fn ensure_range(volumes_dir: &Path, volume: &str, first: u32) -> anyhow::Result<u32> {
    let root = volumes_dir.join(volume);
    let owner = std::fs::symlink_metadata(&root)
        .with_context(|| format!("reading {}", root.display()))?
        .uid();
    if in_ranges(owner, first) {
        return Ok(owner);
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(volumes_dir.join(LOCK_FILE))
        .context("opening the volume ranges' lock")?;
    rfs::flock(&lock, rfs::FlockOperation::LockExclusive).context("locking volume ranges")?;
    // Another process may have given it one while this one waited.
    let owner = std::fs::symlink_metadata(&root)?.uid();
    if in_ranges(owner, first) {
        return Ok(owner);
    }
    let mut taken = std::collections::HashSet::new();
    for e in std::fs::read_dir(volumes_dir)?.flatten() {
        if let Ok(m) = e.path().symlink_metadata() {
            if m.is_dir() && in_ranges(m.uid(), first) {
                taken.insert(m.uid());
            }
        }
    }
    let Some(base) = (0..MAX_RANGES)
        .map(|i| first + i * VOLUME_IDS)
        .find(|b| !taken.contains(b))
    else {
        bail!("every one of the {MAX_RANGES} volume id ranges is taken");
    };
    let dir = rfs::open(
        &root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening {}", root.display()))?;
    shift_tree(&dir, base).with_context(|| format!("moving {volume}'s files to its ids"))?;
    // The root last: it is what says the range is taken and the files are in it.
    let st = rfs::fstat(&dir)?;
    rfs::fchown(
        &dir,
        Some(Uid::from_raw(host_of(base, st.st_uid))),
        Some(Gid::from_raw(host_of(base, st.st_gid))),
    )?;
    tracing::info!(volume, base, "volume given its id range");
    Ok(base)
}

/// Whether `uid` is the base of a range that starts at `first`.
fn in_ranges(uid: u32, first: u32) -> bool {
    uid >= first
        && (uid - first).is_multiple_of(VOLUME_IDS)
        && (uid - first) / VOLUME_IDS < MAX_RANGES
}

/// A host id of a volume without a range (its ids are the guest's) in the range at `base`.
fn host_of(base: u32, id: u32) -> u32 {
    to_host(base, id)
        .or_else(|| to_host(base, OVERFLOW))
        .unwrap_or(base)
}

/// Gives every entry below `root` its owner in the range at `base`: by descriptor, links
/// changed themselves (never what they point to), directories entered with `O_NOFOLLOW`.
/// `chown` clears setuid and setgid bits of what it moves, as it does for any owner change.
fn shift_tree(root: &OwnedFd, base: u32) -> anyhow::Result<()> {
    let mut stack: Vec<rfs::Dir> = vec![rfs::Dir::read_from(root)?];
    loop {
        let depth = stack.len();
        let Some(dir) = stack.last_mut() else {
            break;
        };
        let Some(entry) = dir.next() else {
            stack.pop();
            continue;
        };
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let Ok(st) = rfs::statat(dir.fd()?, name, AtFlags::SYMLINK_NOFOLLOW) else {
            continue; // gone meanwhile
        };
        let (uid, gid) = (host_of(base, st.st_uid), host_of(base, st.st_gid));
        rfs::chownat(
            dir.fd()?,
            name,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )?;
        if rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Directory {
            if depth >= MAX_DEPTH {
                bail!("the volume is nested deeper than {MAX_DEPTH} directories");
            }
            let sub = rfs::openat(
                dir.fd()?,
                name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let sub = rfs::Dir::read_from(sub.as_fd())?;
            stack.push(sub);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_volume_gets_a_range_of_its_own_and_its_files_move_into_it() {
        let vols = tempfile::tempdir().expect("tempdir");
        let outside = tempfile::tempdir().expect("tempdir");
        let canary = outside.path().join("canary");
        std::fs::write(&canary, "host").expect("canary");
        for v in ["a", "b"] {
            std::fs::create_dir(vols.path().join(v)).expect("volume");
        }
        let a = vols.path().join("a");
        std::fs::create_dir_all(a.join("d/e")).expect("tree");
        std::fs::write(a.join("d/e/f"), "x").expect("file");
        std::os::unix::fs::chown(a.join("d/e/f"), Some(9090), Some(9091)).expect("chown");
        std::fs::write(a.join("suid"), "x").expect("file");
        std::fs::set_permissions(a.join("suid"), std::fs::Permissions::from_mode(0o4755))
            .expect("chmod");
        std::os::unix::fs::symlink(&canary, a.join("link")).expect("symlink");
        std::os::unix::fs::symlink(outside.path(), a.join("dirlink")).expect("symlink");

        let first = 1_000_000_000;
        let base_a = ensure_range(vols.path(), "a", first).expect("range a");
        assert_eq!(base_a, first);
        assert_eq!(ensure_range(vols.path(), "a", first).expect("again"), first);
        let base_b = ensure_range(vols.path(), "b", first).expect("range b");
        assert_eq!(base_b, first + VOLUME_IDS, "another volume, another range");

        let meta = |p: &Path| std::fs::symlink_metadata(p).expect("meta");
        assert_eq!(meta(&a).uid(), first);
        assert_eq!(meta(&a.join("d/e")).uid(), first);
        let f = meta(&a.join("d/e/f"));
        assert_eq!((f.uid(), f.gid()), (first + 9090, first + 9091));
        let s = meta(&a.join("suid"));
        assert_eq!(s.uid(), first);
        assert_eq!(s.mode() & 0o4000, 0, "no setuid bit survives the move");
        assert_eq!(meta(&a.join("link")).uid(), first, "the link itself");
        let c = meta(&canary);
        assert_eq!(c.uid(), 0, "what a link points to is never touched");
        assert_eq!(meta(outside.path()).uid(), 0);
    }
}
