//! One volume's directory tree as the content plane touches it, confined to that directory.
//!
//! Guests write the same tree through their mounts, so any entry may be a symlink, a FIFO or
//! something swapped in between two calls. Every path is therefore walked one component at a
//! time from the volume root's descriptor with `O_NOFOLLOW`, and every change is made through
//! a descriptor or an `*at` call that does not follow a final symlink: nothing here ever
//! resolves a name the guest planted into a path outside the volume. Calls block; run them on
//! the blocking pool.

use std::ffi::CStr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use rustix::fs::{self as rfs, AtFlags, FileType, Gid, Mode, OFlags, Stat, Uid, CWD};
use rustix::io::Errno;
use serde::Serialize;
use time::OffsetDateTime;
use vmon_proto::node::volume_ids;

/// The owner and mode infra gives what the content plane creates when the request names none.
pub const DEFAULT_UID: u32 = 9090;
pub const DEFAULT_GID: u32 = 9090;
pub const DEFAULT_FILE_MODE: u32 = 0o666;
pub const DEFAULT_DIR_MODE: u32 = 0o777;

/// The most components and bytes a path may have.
const MAX_DEPTH: usize = 64;
const MAX_PATH: usize = 4096;
/// The most entries one listing returns.
pub const MAX_LISTED: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeError {
    NotFound(String),
    Exists(String),
    Invalid(String),
    Io(String),
}

pub type TreeResult<T> = Result<T, TreeError>;

/// A path inside a volume, cleaned like Go's `filepath.Clean("/" + p)`: no `.`, no `..` (it
/// stops at the root), no empty components.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePath {
    parts: Vec<String>,
}

impl VolumePath {
    pub fn parse(raw: &str) -> TreeResult<VolumePath> {
        if raw.is_empty() {
            return Err(TreeError::Invalid("path is required".into()));
        }
        if raw.len() > MAX_PATH || raw.contains('\0') {
            return Err(TreeError::Invalid(format!(
                "path must be at most {MAX_PATH} bytes without NUL"
            )));
        }
        let mut parts: Vec<String> = Vec::new();
        for part in raw.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    parts.pop();
                }
                p if p.len() > 255 => {
                    return Err(TreeError::Invalid(
                        "a path component is over 255 bytes".into(),
                    ))
                }
                p => parts.push(p.to_string()),
            }
        }
        if parts.len() > MAX_DEPTH {
            return Err(TreeError::Invalid(format!(
                "path is deeper than {MAX_DEPTH} components"
            )));
        }
        Ok(VolumePath { parts })
    }

    pub fn is_root(&self) -> bool {
        self.parts.is_empty()
    }

    pub fn display(&self) -> String {
        format!("/{}", self.parts.join("/"))
    }

    fn child(&self, name: &str) -> VolumePath {
        let mut parts = self.parts.clone();
        parts.push(name.to_string());
        VolumePath { parts }
    }

    fn split(&self) -> Option<(&[String], &str)> {
        let (last, dirs) = self.parts.split_last()?;
        Some((dirs, last.as_str()))
    }
}

/// `VolumeEntryStat`.
#[derive(Debug, Clone, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EntryStat {
    pub name: String,
    /// `file`, `directory`, `symlink` or `unknown`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    pub size: i64,
    /// Permission bits only.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// Who owns what a request creates, and with which mode.
#[derive(Debug, Clone, Copy)]
pub struct Owner {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

fn io(what: &str, path: &VolumePath, e: Errno) -> TreeError {
    let p = path.display();
    match e {
        Errno::NOENT => TreeError::NotFound(format!("{p} does not exist")),
        Errno::EXIST => TreeError::Exists(format!("{p} already exists")),
        Errno::NOTDIR | Errno::LOOP => {
            TreeError::Invalid(format!("{p}: a component on the way is not a directory"))
        }
        Errno::ISDIR => TreeError::Invalid(format!("{p} is a directory")),
        // A FIFO (or socket) a guest made, opened without blocking.
        Errno::NXIO | Errno::OPNOTSUPP => TreeError::Invalid(format!("{p} is not a regular file")),
        Errno::NAMETOOLONG => TreeError::Invalid(format!("{p}: name too long")),
        Errno::NOSPC | Errno::DQUOT => TreeError::Io(format!("{what} {p}: no space left")),
        e => TreeError::Io(format!("{what} {p}: {e}")),
    }
}

fn time_of(secs: i64, nanos: i64) -> String {
    let t = OffsetDateTime::from_unix_timestamp_nanos(
        i128::from(secs) * 1_000_000_000 + i128::from(nanos),
    )
    .unwrap_or(OffsetDateTime::UNIX_EPOCH);
    crate::rfc3339(t)
}

fn kind(st: &Stat) -> &'static str {
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => "file",
        FileType::Directory => "directory",
        FileType::Symlink => "symlink",
        _ => "unknown",
    }
}

/// A volume's tree, held by a descriptor of its root.
pub struct Tree {
    root: OwnedFd,
    /// The volume's id range on the host ([`volume_ids`]): owners given and shown are the
    /// guest's, stored as `base + id`.
    base: u32,
}

impl Tree {
    /// Opens the volume directory `dir` (which must be a directory, not a symlink).
    pub fn open(dir: &Path) -> TreeResult<Tree> {
        let root = rfs::openat(
            CWD,
            dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| TreeError::Io(format!("opening the volume directory: {e}")))?;
        let st = rfs::fstat(&root)
            .map_err(|e| TreeError::Io(format!("reading the volume directory: {e}")))?;
        Ok(Tree {
            root,
            base: volume_ids::base_of(st.st_uid),
        })
    }

    /// `owner` as the host stores it; with `creating`, unset ids are the defaults.
    fn host(&self, owner: Owner, creating: bool) -> TreeResult<Owner> {
        let map = |id: Option<u32>, default: u32| -> TreeResult<Option<u32>> {
            match id.or(creating.then_some(default)) {
                None => Ok(None),
                Some(id) => volume_ids::to_host(self.base, id).map(Some).ok_or_else(|| {
                    TreeError::Invalid(format!(
                        "uid and gid must be below {}",
                        volume_ids::VOLUME_IDS
                    ))
                }),
            }
        };
        Ok(Owner {
            uid: map(owner.uid, DEFAULT_UID)?,
            gid: map(owner.gid, DEFAULT_GID)?,
            mode: owner.mode,
        })
    }

    fn entry(&self, st: &Stat, path: &VolumePath, target: Option<String>) -> EntryStat {
        let mut e = entry(st, path, target);
        e.uid = volume_ids::to_guest(self.base, e.uid);
        e.gid = volume_ids::to_guest(self.base, e.gid);
        e
    }

    /// The directory `parts` name, each component opened without following symlinks.
    /// With `create`, missing directories are made (mkdir -p) with that owner.
    fn dir(
        &self,
        path: &VolumePath,
        parts: &[String],
        create: Option<Owner>,
    ) -> TreeResult<OwnedFd> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mut fd = rfs::openat(&self.root, ".", flags, Mode::empty())
            .map_err(|e| io("opening", path, e))?;
        for part in parts {
            let next = match rfs::openat(&fd, part.as_str(), flags, Mode::empty()) {
                Err(Errno::NOENT) if create.is_some() => {
                    let owner = create.unwrap_or(Owner {
                        uid: None,
                        gid: None,
                        mode: None,
                    });
                    match make_dir_at(&fd, part, owner) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(io("creating", path, e)),
                    }
                    rfs::openat(&fd, part.as_str(), flags, Mode::empty())
                }
                r => r,
            };
            fd = next.map_err(|e| io("opening", path, e))?;
        }
        Ok(fd)
    }

    fn stat_in(&self, dir: &OwnedFd, name: &str, path: &VolumePath) -> TreeResult<EntryStat> {
        let st = rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io("reading", path, e))?;
        let target = if kind(&st) == "symlink" {
            rfs::readlinkat(dir, name, Vec::new())
                .ok()
                .map(|t| t.to_string_lossy().into_owned())
        } else {
            None
        };
        Ok(self.entry(&st, path, target))
    }

    /// `GET …/path`.
    pub fn stat(&self, path: &VolumePath) -> TreeResult<EntryStat> {
        match path.split() {
            None => {
                let st = rfs::fstat(&self.root).map_err(|e| io("reading", path, e))?;
                Ok(self.entry(&st, path, None))
            }
            Some((dirs, name)) => {
                let dir = self.dir(path, dirs, None)?;
                self.stat_in(&dir, name, path)
            }
        }
    }

    /// `GET …/dir`: the entries under `path`, `depth` levels down (1 = its children), sorted
    /// by path. Symlinked directories are listed, never entered.
    pub fn list(&self, path: &VolumePath, depth: u32) -> TreeResult<Vec<EntryStat>> {
        let top = self.stat(path)?;
        if top.kind != "directory" {
            return Err(TreeError::Invalid(format!(
                "{} is not a directory",
                path.display()
            )));
        }
        let mut out = Vec::new();
        let dir = self.dir(path, &path.parts, None)?;
        self.list_into(&dir, path, depth, &mut out)?;
        Ok(out)
    }

    fn list_into(
        &self,
        dir: &OwnedFd,
        path: &VolumePath,
        depth: u32,
        out: &mut Vec<EntryStat>,
    ) -> TreeResult<()> {
        let readable = rfs::openat(
            dir,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("listing", path, e))?;
        let mut names = names(readable).map_err(|e| io("listing", path, e))?;
        names.sort();
        for name in names {
            if out.len() >= MAX_LISTED {
                return Err(TreeError::Invalid(format!(
                    "more than {MAX_LISTED} entries; list a smaller depth"
                )));
            }
            let child = path.child(&name);
            let stat = match self.stat_in(dir, &name, &child) {
                Ok(s) => s,
                // Removed by a guest meanwhile.
                Err(TreeError::NotFound(_)) => continue,
                Err(e) => return Err(e),
            };
            let is_dir = stat.kind == "directory";
            out.push(stat);
            if is_dir && depth > 1 {
                let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                match rfs::openat(dir, name.as_str(), flags, Mode::empty()) {
                    Ok(sub) => self.list_into(&sub, &child, depth - 1, out)?,
                    Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => {}
                    Err(e) => return Err(io("listing", &child, e)),
                }
            }
        }
        Ok(())
    }

    /// `POST …/dir`: without `force` the parent must exist and `path` must not; with it,
    /// parents are made and an existing directory is fine.
    pub fn make_dir(&self, path: &VolumePath, owner: Owner, force: bool) -> TreeResult<EntryStat> {
        let owner = self.host(owner, true)?;
        let Some((dirs, name)) = path.split() else {
            if force {
                return self.stat(path);
            }
            return Err(TreeError::Exists("/ already exists".into()));
        };
        let parent = self.dir(path, dirs, force.then_some(default_dir(owner)))?;
        match make_dir_at(&parent, name, default_dir(owner)) {
            Ok(()) => {}
            Err(Errno::EXIST) if force => {
                let st = self.stat_in(&parent, name, path)?;
                if st.kind != "directory" {
                    return Err(TreeError::Exists(format!(
                        "{} exists and is not a directory",
                        path.display()
                    )));
                }
            }
            Err(e) => return Err(io("creating", path, e)),
        }
        self.stat_in(&parent, name, path)
    }

    /// `PATCH …/path`: owner and mode of an existing entry (a symlink's mode cannot change;
    /// its owner does, the link itself).
    pub fn set_meta(&self, path: &VolumePath, owner: Owner) -> TreeResult<EntryStat> {
        let owner = self.host(owner, false)?;
        let (dir, name) = self.parent_of(path)?;
        if owner.uid.is_some() || owner.gid.is_some() {
            rfs::chownat(
                &dir,
                name.as_str(),
                owner.uid.map(Uid::from_raw),
                owner.gid.map(Gid::from_raw),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| io("changing the owner of", path, e))?;
        }
        if let Some(mode) = owner.mode {
            // chmod through a descriptor of exactly that inode: a name the guest swaps for a
            // symlink meanwhile fails to open instead of redirecting the chmod.
            let fd = rfs::openat(
                &dir,
                name.as_str(),
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| io("opening", path, e))?;
            let st = rfs::fstat(&fd).map_err(|e| io("reading", path, e))?;
            if kind(&st) != "symlink" {
                chmod_fd(&fd, mode).map_err(|e| io("changing the mode of", path, e))?;
            }
        }
        self.stat_in(&dir, &name, path)
    }

    /// The parent directory's descriptor and the last component; `.` for the root.
    fn parent_of(&self, path: &VolumePath) -> TreeResult<(OwnedFd, String)> {
        match path.split() {
            None => Ok((self.dir(path, &[], None)?, ".".to_string())),
            Some((dirs, name)) => Ok((self.dir(path, dirs, None)?, name.to_string())),
        }
    }

    /// `DELETE …/path`: recursively. The root cannot be removed.
    pub fn remove(&self, path: &VolumePath) -> TreeResult<()> {
        let Some((dirs, name)) = path.split() else {
            return Err(TreeError::Invalid(
                "the volume root cannot be removed".into(),
            ));
        };
        let parent = self.dir(path, dirs, None)?;
        remove_at(&parent, name, path)
    }

    /// `GET …/file`: a regular file, opened for reading.
    pub fn open_read(&self, path: &VolumePath) -> TreeResult<std::fs::File> {
        let Some((dirs, name)) = path.split() else {
            return Err(TreeError::Invalid("/ is a directory".into()));
        };
        let dir = self.dir(path, dirs, None)?;
        // O_NONBLOCK: a FIFO a guest made must not hang the request.
        let fd = rfs::openat(
            &dir,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("opening", path, e))?;
        let st = rfs::fstat(&fd).map_err(|e| io("reading", path, e))?;
        if kind(&st) != "file" {
            return Err(TreeError::Invalid(format!(
                "{} is not a regular file",
                path.display()
            )));
        }
        Ok(std::fs::File::from(fd))
    }

    /// `PUT …/file`, the opening half: without `force` the parent must exist and the file
    /// must not (`O_EXCL`); with it, parents are made and an existing file is truncated.
    pub fn create_file(
        &self,
        path: &VolumePath,
        owner: Owner,
        force: bool,
    ) -> TreeResult<std::fs::File> {
        let owner = self.host(owner, true)?;
        let Some((dirs, name)) = path.split() else {
            return Err(TreeError::Invalid("/ is a directory".into()));
        };
        let parent_owner = Owner {
            mode: None,
            ..owner
        };
        let dir = self.dir(path, dirs, force.then_some(default_dir(parent_owner)))?;
        let mut flags = OFlags::WRONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        flags |= if force { OFlags::TRUNC } else { OFlags::EXCL };
        let fd = rfs::openat(
            &dir,
            name,
            flags | OFlags::NONBLOCK,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io("creating", path, e))?;
        let st = rfs::fstat(&fd).map_err(|e| io("reading", path, e))?;
        if kind(&st) != "file" {
            return Err(TreeError::Invalid(format!(
                "{} is not a regular file",
                path.display()
            )));
        }
        let uid = owner.uid.unwrap_or(DEFAULT_UID);
        let gid = owner.gid.unwrap_or(DEFAULT_GID);
        rfs::fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .map_err(|e| io("changing the owner of", path, e))?;
        rfs::fchmod(
            &fd,
            Mode::from_raw_mode(owner.mode.unwrap_or(DEFAULT_FILE_MODE)),
        )
        .map_err(|e| io("changing the mode of", path, e))?;
        Ok(std::fs::File::from(fd))
    }

    /// `PUT …/file`, the closing half: the entry as written.
    pub fn written(&self, path: &VolumePath, file: &std::fs::File) -> TreeResult<EntryStat> {
        rfs::fsync(file).map_err(|e| io("syncing", path, e))?;
        let st = rfs::fstat(file).map_err(|e| io("reading", path, e))?;
        Ok(self.entry(&st, path, None))
    }
}

fn default_dir(owner: Owner) -> Owner {
    Owner {
        uid: Some(owner.uid.unwrap_or(DEFAULT_UID)),
        gid: Some(owner.gid.unwrap_or(DEFAULT_GID)),
        mode: Some(owner.mode.unwrap_or(DEFAULT_DIR_MODE)),
    }
}

fn entry(st: &Stat, path: &VolumePath, target: Option<String>) -> EntryStat {
    EntryStat {
        name: path
            .parts
            .last()
            .cloned()
            .unwrap_or_else(|| "/".to_string()),
        kind: kind(st),
        path: path.display(),
        size: st.st_size,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        atime: time_of(st.st_atime, st.st_atime_nsec as i64),
        mtime: time_of(st.st_mtime, st.st_mtime_nsec as i64),
        ctime: time_of(st.st_ctime, st.st_ctime_nsec as i64),
        target,
    }
}

/// Makes `name` in `dir` and gives it `owner` (mkdir's mode is cut by the umask; the
/// explicit chmod is not).
fn make_dir_at(dir: &OwnedFd, name: &str, owner: Owner) -> Result<(), Errno> {
    rfs::mkdirat(dir, name, Mode::from_raw_mode(0o700))?;
    let fd = rfs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    rfs::fchown(
        &fd,
        owner.uid.map(Uid::from_raw),
        owner.gid.map(Gid::from_raw),
    )?;
    rfs::fchmod(
        &fd,
        Mode::from_raw_mode(owner.mode.unwrap_or(DEFAULT_DIR_MODE)),
    )?;
    Ok(())
}

/// chmod of the inode an `O_PATH` descriptor holds (`fchmod` refuses `O_PATH`; the
/// `/proc/self/fd` link names exactly that inode, whatever its name has become).
fn chmod_fd(fd: &OwnedFd, mode: u32) -> Result<(), Errno> {
    use std::os::fd::AsRawFd;
    let link = format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd());
    rfs::chmodat(
        CWD,
        link.as_str(),
        Mode::from_raw_mode(mode),
        AtFlags::empty(),
    )
}

fn names(dir: OwnedFd) -> Result<Vec<String>, Errno> {
    let mut out = Vec::new();
    for e in rfs::Dir::new(dir)? {
        let e = e?;
        let name: &CStr = e.file_name();
        let bytes = name.to_bytes();
        if bytes == b"." || bytes == b".." {
            continue;
        }
        out.push(String::from_utf8_lossy(bytes).into_owned());
    }
    Ok(out)
}

/// Removes `name` in `dir`, a directory with everything in it, never following a symlink.
fn remove_at(dir: &OwnedFd, name: &str, path: &VolumePath) -> TreeResult<()> {
    match rfs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) => return Ok(()),
        Err(Errno::ISDIR | Errno::PERM) => {}
        Err(e) => return Err(io("removing", path, e)),
    }
    let sub = rfs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("removing", path, e))?;
    let listing = rfs::openat(
        &sub,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("removing", path, e))?;
    for child in names(listing).map_err(|e| io("removing", path, e))? {
        match remove_at(&sub, &child, &path.child(&child)) {
            Ok(()) | Err(TreeError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    rfs::unlinkat(dir, name, AtFlags::REMOVEDIR).map_err(|e| io("removing", path, e))
}

/// Bytes the files under `dir` take (apparent sizes), never following a symlink.
pub fn usage(dir: &Path) -> u64 {
    fn walk(fd: &OwnedFd, depth: usize) -> u64 {
        if depth > 256 {
            return 0;
        }
        let Ok(listing) = rfs::openat(
            fd,
            ".",
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            return 0;
        };
        let Ok(children) = names(listing) else {
            return 0;
        };
        let mut total = 0u64;
        for name in children {
            let Ok(st) = rfs::statat(fd, name.as_str(), AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => {
                    if let Ok(sub) = rfs::openat(
                        fd,
                        name.as_str(),
                        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                        Mode::empty(),
                    ) {
                        total += walk(&sub, depth + 1);
                    }
                }
                _ => total += u64::try_from(st.st_size).unwrap_or(0),
            }
        }
        total
    }
    match rfs::openat(
        CWD,
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => walk(&fd, 0),
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_cleaned_and_never_climb_out() {
        let p = |s: &str| VolumePath::parse(s).map(|p| p.display());
        assert_eq!(p("a/b"), Ok("/a/b".into()));
        assert_eq!(p("/a//./b/"), Ok("/a/b".into()));
        assert_eq!(p("../../etc/passwd"), Ok("/etc/passwd".into()));
        assert_eq!(p("/a/../.."), Ok("/".into()));
        assert!(p("").is_err());
        assert!(p("a\0b").is_err());
    }

    #[test]
    fn a_planted_symlink_is_never_followed() {
        let tmp = tempfile::tempdir().expect("tmp");
        let vol = tmp.path().join("vol");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(&vol).expect("vol");
        std::fs::create_dir_all(&outside).expect("outside");
        std::fs::write(outside.join("secret"), b"host").expect("secret");
        std::os::unix::fs::symlink(&outside, vol.join("escape")).expect("link");
        std::os::unix::fs::symlink(outside.join("secret"), vol.join("file")).expect("link");
        let tree = Tree::open(&vol).expect("open");
        let path = |s: &str| VolumePath::parse(s).expect("path");
        assert!(tree.open_read(&path("escape/secret")).is_err());
        assert!(tree.open_read(&path("file")).is_err());
        assert!(tree.list(&path("escape"), 1).is_err());
        let owner = Owner {
            uid: None,
            gid: None,
            mode: Some(0o600),
        };
        assert!(tree.create_file(&path("escape/new"), owner, true).is_err());
        assert!(tree.create_file(&path("file"), owner, true).is_err());
        tree.set_meta(&path("file"), owner)
            .expect("a symlink's mode is left alone");
        tree.remove(&path("escape")).expect("remove the link");
        assert!(outside.join("secret").exists(), "the target survives");
        let listed = tree.list(&path("/"), 1).expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].kind, "symlink");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(outside.join("secret"))
            .expect("meta")
            .permissions()
            .mode();
        assert_ne!(mode & 0o777, 0o600, "the chmod did not reach the target");
    }

    #[test]
    fn owners_are_the_guests_stored_in_the_volumes_range() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().expect("tmp");
        let vol = tmp.path().join("vol");
        std::fs::create_dir_all(&vol).expect("vol");
        let base = 1_000_065_536;
        std::os::unix::fs::chown(&vol, Some(base), Some(base)).expect("chown");
        let tree = Tree::open(&vol).expect("open");
        let path = |s: &str| VolumePath::parse(s).expect("path");
        let owner = |uid, gid| Owner {
            uid,
            gid,
            mode: None,
        };
        let f = tree
            .create_file(&path("a/f"), owner(Some(1000), None), true)
            .expect("create");
        let stat = tree.written(&path("a/f"), &f).expect("written");
        assert_eq!((stat.uid, stat.gid), (1000, DEFAULT_GID));
        let m = std::fs::metadata(vol.join("a/f")).expect("meta");
        assert_eq!((m.uid(), m.gid()), (base + 1000, base + DEFAULT_GID));
        let d = std::fs::metadata(vol.join("a")).expect("meta");
        assert_eq!(d.uid(), base + 1000, "parents made with the same owner");
        let set = tree
            .set_meta(&path("a/f"), owner(Some(0), Some(0)))
            .expect("chown");
        assert_eq!((set.uid, set.gid), (0, 0));
        assert_eq!(
            std::fs::metadata(vol.join("a/f")).expect("meta").uid(),
            base
        );
        assert!(matches!(
            tree.set_meta(&path("a/f"), owner(Some(70_000), None)),
            Err(TreeError::Invalid(_))
        ));
        // A file of an id outside the range (the host's root) reads as nobody.
        std::os::unix::fs::chown(vol.join("a/f"), Some(0), Some(0)).expect("chown");
        let st = tree.stat(&path("a/f")).expect("stat");
        assert_eq!((st.uid, st.gid), (65_534, 65_534));
    }
}
