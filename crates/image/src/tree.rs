//! An unpacked image's root filesystem as a directory handle, the only way vmon reads or writes
//! inside a tree a tenant supplied.
//!
//! vmon runs as root, and an image's tree is the tenant's: any of its names may be a symbolic
//! link meant for the host (`/etc/passwd -> /etc/passwd`, `../../../root`, a chain longer than
//! the kernel follows). So no path into the tree is ever handed to the host kernel as a path.
//! Every name is resolved from the tree's root directory handle with
//! `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`: links are followed as
//! the guest would follow them (an absolute target starts at the tree's root, `..` stops there),
//! and the kernel refuses the rest. Last components that vmon replaces are unlinked and created
//! afresh with `O_CREAT | O_EXCL | O_NOFOLLOW` in a parent resolved that way; modes and owners
//! are changed through the opened descriptor, or with `AT_SYMLINK_NOFOLLOW` on a name in a
//! directory vmon holds open. A link budget that runs out fails with the path named; a kernel
//! without `openat2` fails every call (nothing falls back to following paths).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

/// How deep [`Tree::chown_all`] descends before it gives up (each level holds a descriptor).
const MAX_DEPTH: usize = 128;

/// Why an operation on an image's tree failed, as a sentence naming the path in the image.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    #[error(
        "this kernel has no openat2 (Linux 5.6 or later), which vmon needs to write into an \
         image without following the image's links out of it"
    )]
    NoOpenat2,
    #[error(
        "the image's {0} goes through more than 40 symbolic links (a loop, or a chain longer \
         than the kernel follows)"
    )]
    LinkBudget(String),
    #[error("a part of the image's {0} is not a directory")]
    NotADirectory(String),
    #[error("the image's {0} is a directory")]
    IsADirectory(String),
    #[error("the image's {0} is a symbolic link to nothing")]
    DanglingLink(String),
    #[error("the image's {0} is not a regular file")]
    NotAFile(String),
    #[error("the image's {path} is larger than {limit} bytes")]
    TooLarge { path: String, limit: u64 },
    #[error("the image's {0} is nested more than {MAX_DEPTH} directories deep")]
    TooDeep(String),
    #[error("{what} the image's {path}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, TreeError>;

/// The tree's root directory, held open; every path given to it is a guest path (`/etc/hosts`).
#[derive(Debug)]
pub struct Tree {
    root: OwnedFd,
    at: PathBuf,
}

impl Tree {
    /// Opens the tree at `root` (itself not a link) and checks that the kernel has `openat2`.
    pub fn open(root: &Path) -> Result<Tree> {
        let fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("opening", &root.display().to_string(), e))?;
        let tree = Tree {
            root: fd,
            at: root.to_path_buf(),
        };
        tree.resolve("/", OFlags::PATH | OFlags::DIRECTORY)?;
        Ok(tree)
    }

    /// Where the tree is on the host (for programs that only read it, such as `mkfs.ext4 -d`).
    pub fn host_path(&self) -> &Path {
        &self.at
    }

    /// Opens `path` with its links resolved inside the tree.
    fn resolve(&self, path: &str, flags: OFlags) -> Result<OwnedFd> {
        let rel = relative(path)?;
        let how = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV;
        let mut tries = 0;
        loop {
            // EAGAIN: something was renamed in the tree meanwhile; the kernel asks to retry.
            match rustix::fs::openat2(
                &self.root,
                &rel,
                flags | OFlags::CLOEXEC,
                Mode::empty(),
                how,
            ) {
                Err(Errno::AGAIN) if tries < 8 => tries += 1,
                Ok(fd) => return Ok(fd),
                Err(e) => return Err(classify("opening", path, e)),
            }
        }
    }

    /// What `path` is once its links are followed inside the tree; `None` when nothing is there.
    pub fn kind(&self, path: &str) -> Result<Option<FileType>> {
        match self.resolve(path, OFlags::PATH) {
            Ok(fd) => {
                let st = rustix::fs::fstat(&fd).map_err(|e| io_err("examining", path, e))?;
                Ok(Some(FileType::from_raw_mode(st.st_mode)))
            }
            // A file where a directory would be: the guest finds nothing there either.
            Err(TreeError::NotADirectory(_)) => Ok(None),
            Err(TreeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    pub fn is_dir(&self, path: &str) -> Result<bool> {
        Ok(self.kind(path)? == Some(FileType::Directory))
    }

    pub fn is_file(&self, path: &str) -> Result<bool> {
        Ok(self.kind(path)? == Some(FileType::RegularFile))
    }

    /// The contents of the regular file at `path` (at most `limit` bytes), `None` when nothing
    /// is there. Anything else there (a device node, a FIFO) is an error and is never opened
    /// for reading.
    pub fn read(&self, path: &str, limit: u64) -> Result<Option<Vec<u8>>> {
        match self.kind(path)? {
            None => return Ok(None),
            Some(FileType::RegularFile) => {}
            Some(_) => return Err(TreeError::NotAFile(path.to_string())),
        }
        let fd = self.resolve(path, OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY)?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err("examining", path, e))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(TreeError::NotAFile(path.to_string()));
        }
        let mut buf = Vec::new();
        File::from(fd)
            .take(limit + 1)
            .read_to_end(&mut buf)
            .map_err(|e| TreeError::Io {
                what: "reading",
                path: path.to_string(),
                source: e,
            })?;
        if buf.len() as u64 > limit {
            return Err(TreeError::TooLarge {
                path: path.to_string(),
                limit,
            });
        }
        Ok(Some(buf))
    }

    /// The directory at `path`, which must exist.
    pub fn open_dir(&self, path: &str) -> Result<OwnedFd> {
        self.resolve(path, OFlags::RDONLY | OFlags::DIRECTORY)
    }

    /// The directory at `path`, made (with its missing parents, 0755) when it is not there;
    /// `mode` is given to the last one only when vmon makes it.
    pub fn ensure_dir(&self, path: &str, mode: u32) -> Result<OwnedFd> {
        let names = components(path)?;
        let mut dir = self.open_dir("/")?;
        for i in 0..names.len() {
            let prefix = format!("/{}", names[..=i].join("/"));
            match self.open_dir(&prefix) {
                Ok(d) => dir = d,
                Err(TreeError::Io { ref source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    let m = if i + 1 == names.len() { mode } else { 0o755 };
                    match rustix::fs::mkdirat(&dir, names[i], Mode::from_raw_mode(m)) {
                        Ok(()) => {}
                        Err(Errno::EXIST) => return Err(TreeError::DanglingLink(prefix)),
                        Err(e) => return Err(io_err("making", &prefix, e)),
                    }
                    let made = rustix::fs::openat(
                        &dir,
                        names[i],
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                        Mode::empty(),
                    )
                    .map_err(|e| classify("opening", &prefix, e))?;
                    // mkdir's mode passes the umask; the sticky bit of /tmp does not.
                    rustix::fs::fchmod(&made, Mode::from_raw_mode(m))
                        .map_err(|e| io_err("setting the mode of", &prefix, e))?;
                    dir = made;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(dir)
    }

    /// Puts a new regular file with `contents` and `mode` at `path` (its parent must exist),
    /// replacing whatever non-directory was there: a link there is replaced, never followed.
    pub fn write(&self, path: &str, contents: &[u8], mode: u32) -> Result<()> {
        self.write_from(path, &mut &contents[..], mode)
    }

    /// [`Tree::write`] with the contents of the host file `from` (one vmon chose, not the
    /// tenant).
    pub fn copy_in(&self, path: &str, from: &Path, mode: u32) -> Result<()> {
        let mut src = File::open(from).map_err(|e| TreeError::Io {
            what: "opening the host's file for",
            path: path.to_string(),
            source: e,
        })?;
        self.write_from(path, &mut src, mode)
    }

    fn write_from(&self, path: &str, from: &mut dyn Read, mode: u32) -> Result<()> {
        let (parent, name) = split(path)?;
        let dir = self.open_dir(&parent)?;
        unlink(&dir, name, path)?;
        let fd = rustix::fs::openat(
            &dir,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )
        .map_err(|e| classify("creating", path, e))?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))
            .map_err(|e| io_err("setting the mode of", path, e))?;
        let mut f = File::from(fd);
        std::io::copy(from, &mut f)
            .and_then(|_| f.flush())
            .map_err(|e| TreeError::Io {
                what: "writing",
                path: path.to_string(),
                source: e,
            })?;
        Ok(())
    }

    /// Removes the non-directory at `path` (a link itself, not what it names); nothing there
    /// is not an error.
    pub fn remove(&self, path: &str) -> Result<()> {
        let (parent, name) = split(path)?;
        match self.open_dir(&parent) {
            Ok(dir) => unlink(&dir, name, path),
            Err(TreeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Moves `name` out of the host directory `from` (one vmon made, on the tree's file
    /// system) to `path`, whose parent must exist and whose last component must not.
    pub fn move_in(&self, from: &Path, name: &str, path: &str) -> Result<()> {
        let (parent, last) = split(path)?;
        let dir = self.open_dir(&parent)?;
        let src = rustix::fs::open(
            from,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err("opening the staging directory for", path, e))?;
        rustix::fs::renameat(&src, name, &dir, last).map_err(|e| classify("moving into", path, e))
    }

    /// Gives `path` (links followed inside the tree) and everything under it to `uid`:`gid`,
    /// through descriptors: links below it are changed themselves, never followed, and a file
    /// with more than one name is left alone (its other name may be anywhere).
    pub fn chown_all(&self, path: &str, uid: u32, gid: u32) -> Result<()> {
        let dir = self.open_dir(path)?;
        let (u, g) = owner(uid, gid);
        rustix::fs::fchown(&dir, Some(u), Some(g))
            .map_err(|e| io_err("changing the owner of", path, e))?;
        chown_below(&dir, path, u, g, 0)
    }

    /// Copies the regular files directly in the tree's directory `from` into the tree's
    /// directory `to` (owned by root; [`Tree::chown_all`] after), each at most `limit` bytes,
    /// leaving names that exist in `to` alone.
    pub fn copy_files(&self, from: &str, to: &str, limit: u64) -> Result<()> {
        let src = match self.open_dir(from) {
            Ok(d) => d,
            Err(TreeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(())
            }
            Err(e) => return Err(e),
        };
        let dst = self.open_dir(to)?;
        for name in entries(&src, from)? {
            let shown = format!("{from}/{}", name.to_string_lossy());
            let st = rustix::fs::statat(&src, &name, AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| io_err("examining", &shown, e))?;
            if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                continue;
            }
            if st.st_size as u64 > limit {
                return Err(TreeError::TooLarge { path: shown, limit });
            }
            let fd = rustix::fs::openat(
                &src,
                &name,
                OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| classify("opening", &shown, e))?;
            let out = match rustix::fs::openat(
                &dst,
                &name,
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(st.st_mode & 0o777),
            ) {
                Ok(fd) => fd,
                Err(Errno::EXIST) => continue,
                Err(e) => return Err(classify("creating", to, e)),
            };
            std::io::copy(&mut File::from(fd).take(limit), &mut File::from(out)).map_err(|e| {
                TreeError::Io {
                    what: "copying",
                    path: shown.clone(),
                    source: e,
                }
            })?;
        }
        Ok(())
    }
}

fn owner(uid: u32, gid: u32) -> (rustix::fs::Uid, rustix::fs::Gid) {
    (
        rustix::fs::Uid::from_raw(uid),
        rustix::fs::Gid::from_raw(gid),
    )
}

fn chown_below(
    dir: &OwnedFd,
    path: &str,
    uid: rustix::fs::Uid,
    gid: rustix::fs::Gid,
    depth: usize,
) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(TreeError::TooDeep(path.to_string()));
    }
    for name in entries(dir, path)? {
        let shown = format!("{path}/{}", name.to_string_lossy());
        let st = rustix::fs::statat(dir, &name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_err("examining", &shown, e))?;
        let kind = FileType::from_raw_mode(st.st_mode);
        if kind == FileType::Directory {
            let sub = rustix::fs::openat(
                dir,
                &name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| classify("opening", &shown, e))?;
            rustix::fs::fchown(&sub, Some(uid), Some(gid))
                .map_err(|e| io_err("changing the owner of", &shown, e))?;
            chown_below(&sub, &shown, uid, gid, depth + 1)?;
        } else if kind == FileType::Symlink || st.st_nlink <= 1 {
            rustix::fs::chownat(dir, &name, Some(uid), Some(gid), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| io_err("changing the owner of", &shown, e))?;
        }
    }
    Ok(())
}

/// The names in the directory `dir` (without `.` and `..`).
fn entries(dir: &OwnedFd, path: &str) -> Result<Vec<std::ffi::CString>> {
    let mut names = Vec::new();
    let listing =
        rustix::fs::Dir::read_from(dir.as_fd()).map_err(|e| io_err("listing", path, e))?;
    for entry in listing {
        let entry = entry.map_err(|e| io_err("listing", path, e))?;
        let name = entry.file_name();
        if name.to_bytes() != b"." && name.to_bytes() != b".." {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

fn unlink(dir: &OwnedFd, name: &str, path: &str) -> Result<()> {
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(Errno::ISDIR) => Err(TreeError::IsADirectory(path.to_string())),
        Err(e) => Err(io_err("removing", path, e)),
    }
}

/// The names of the guest path `path`; `.`, `..` and empty names are refused (vmon's own
/// paths never have them).
fn components(path: &str) -> Result<Vec<&str>> {
    let names: Vec<&str> = path.split('/').filter(|n| !n.is_empty()).collect();
    if names.iter().any(|n| *n == "." || *n == "..") || !path.starts_with('/') {
        return Err(TreeError::Io {
            what: "naming",
            path: path.to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not an absolute path without `.` or `..`",
            ),
        });
    }
    Ok(names)
}

fn relative(path: &str) -> Result<String> {
    let names = components(path)?;
    Ok(if names.is_empty() {
        ".".to_string()
    } else {
        names.join("/")
    })
}

/// `path`'s parent (as a guest path) and last name.
fn split(path: &str) -> Result<(String, &str)> {
    let mut names = components(path)?;
    let Some(last) = names.pop() else {
        return Err(TreeError::IsADirectory("/".to_string()));
    };
    Ok((format!("/{}", names.join("/")), last))
}

fn classify(what: &'static str, path: &str, e: Errno) -> TreeError {
    match e {
        Errno::LOOP => TreeError::LinkBudget(path.to_string()),
        Errno::NOSYS => TreeError::NoOpenat2,
        Errno::NOTDIR => TreeError::NotADirectory(path.to_string()),
        e => io_err(what, path, e),
    }
}

fn io_err(what: &'static str, path: &str, e: Errno) -> TreeError {
    TreeError::Io {
        what,
        path: path.to_string(),
        source: e.into(),
    }
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
