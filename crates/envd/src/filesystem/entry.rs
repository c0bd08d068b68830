//! `EntryInfo` for a path, read with the calling thread's (the user's) permissions.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::rpc::filesystem::{EntryInfo, FileType};
use crate::rpc::json;

/// Prefix of the extended attributes that carry user metadata.
pub const XATTR_PREFIX: &str = "user.e2b.";

pub fn entry_info(path: &Path) -> io::Result<EntryInfo> {
    let meta = std::fs::symlink_metadata(path)?;
    let ft = meta.file_type();
    let (file_type, is_symlink, symlink_target) = if ft.is_symlink() {
        let target = std::fs::canonicalize(path)
            .or_else(|_| std::fs::read_link(path))
            .map(|t| t.display().to_string())
            .ok();
        let file_type = match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => FileType::Directory,
            Ok(_) => FileType::File,
            Err(_) => FileType::Symlink,
        };
        (file_type, true, target)
    } else if ft.is_dir() {
        (FileType::Directory, false, None)
    } else {
        (FileType::File, false, None)
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".to_string());
    Ok(EntryInfo {
        name,
        file_type,
        path: path.display().to_string(),
        size: meta.size() as i64,
        mode: meta.mode() & 0o7777,
        permissions: permissions_string(meta.mode()),
        owner: user_name(meta.uid()),
        group: group_name(meta.gid()),
        modified_time: Some(json::timestamp(
            meta.mtime(),
            meta.mtime_nsec().clamp(0, 999_999_999) as u32,
        )),
        symlink_target,
        metadata: read_metadata(path),
        is_symlink,
    })
}

/// `ls -l` style mode string, e.g. `-rw-r--r--` or `drwxr-xr-x`.
pub fn permissions_string(mode: u32) -> String {
    let kind = match mode & libc::S_IFMT {
        libc::S_IFDIR => 'd',
        libc::S_IFLNK => 'l',
        libc::S_IFCHR => 'c',
        libc::S_IFBLK => 'b',
        libc::S_IFIFO => 'p',
        libc::S_IFSOCK => 's',
        _ => '-',
    };
    let mut s = String::with_capacity(10);
    s.push(kind);
    let bit = |m: u32, c: char| if mode & m != 0 { c } else { '-' };
    let exec =
        |x: u32, special: u32, set: char, unset: char| match (mode & x != 0, mode & special != 0) {
            (true, true) => set,
            (false, true) => unset,
            (true, false) => 'x',
            (false, false) => '-',
        };
    s.push(bit(0o400, 'r'));
    s.push(bit(0o200, 'w'));
    s.push(exec(0o100, 0o4000, 's', 'S'));
    s.push(bit(0o040, 'r'));
    s.push(bit(0o020, 'w'));
    s.push(exec(0o010, 0o2000, 's', 'S'));
    s.push(bit(0o004, 'r'));
    s.push(bit(0o002, 'w'));
    s.push(exec(0o001, 0o1000, 't', 'T'));
    s
}

fn user_name(uid: u32) -> String {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: zeroed passwd is a valid out-parameter.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut res: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: pointers are valid for the call.
    let rc =
        unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut res) };
    if rc == 0 && !res.is_null() {
        // SAFETY: on success pw_name points at a NUL-terminated string in buf.
        return unsafe { CStr::from_ptr(pwd.pw_name) }
            .to_string_lossy()
            .into_owned();
    }
    uid.to_string()
}

fn group_name(gid: u32) -> String {
    let mut buf = vec![0u8; 16 * 1024];
    // SAFETY: zeroed group is a valid out-parameter.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut res: *mut libc::group = std::ptr::null_mut();
    // SAFETY: pointers are valid for the call.
    let rc =
        unsafe { libc::getgrgid_r(gid, &mut grp, buf.as_mut_ptr().cast(), buf.len(), &mut res) };
    if rc == 0 && !res.is_null() {
        // SAFETY: on success gr_name points at a NUL-terminated string in buf.
        return unsafe { CStr::from_ptr(grp.gr_name) }
            .to_string_lossy()
            .into_owned();
    }
    gid.to_string()
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// The `user.e2b.*` attributes of a path (not following a final symlink), prefix stripped.
pub fn read_metadata(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(c) = cpath(path) else { return out };
    let mut names = vec![0u8; 4096];
    // SAFETY: names is writable for its length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return out;
    }
    names.truncate(n as usize);
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(name) = std::str::from_utf8(name) else {
            continue;
        };
        let Some(key) = name.strip_prefix(XATTR_PREFIX) else {
            continue;
        };
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; 4096];
        // SAFETY: value is writable for its length.
        let len = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if len >= 0 {
            value.truncate(len as usize);
            out.insert(
                key.to_string(),
                String::from_utf8_lossy(&value).into_owned(),
            );
        }
    }
    out
}

/// Sets `user.e2b.<key>` on an open file.
pub fn write_metadata(file: &std::fs::File, key: &str, value: &str) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let name = CString::new(format!("{XATTR_PREFIX}{key}"))
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: name is NUL-terminated, value is readable for its length.
    let rc = unsafe {
        libc::fsetxattr(
            file.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Removes every `user.e2b.*` attribute of an open file: an overwrite carries only the metadata
/// it was given.
pub fn clear_metadata(file: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut names = vec![0u8; 64 * 1024];
    // SAFETY: names is writable for its length.
    let n = unsafe { libc::flistxattr(fd, names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        let e = io::Error::last_os_error();
        // A filesystem without extended attributes holds no metadata to clear.
        return match e.raw_os_error() {
            Some(libc::ENOTSUP) => Ok(()),
            _ => Err(e),
        };
    }
    names.truncate(n as usize);
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if !name.starts_with(XATTR_PREFIX.as_bytes()) {
            continue;
        }
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        // SAFETY: cname is NUL-terminated.
        if unsafe { libc::fremovexattr(fd, cname.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(e);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overwrite_clears_old_metadata() {
        let dir = std::env::temp_dir().join(format!("envd-md-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("f");
        let f = std::fs::File::create(&p).expect("create");
        if write_metadata(&f, "author", "mish").is_err() {
            // tmpfs without user xattrs: nothing to test here.
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        assert_eq!(
            read_metadata(&p).get("author").map(String::as_str),
            Some("mish")
        );
        clear_metadata(&f).expect("clear");
        assert!(read_metadata(&p).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn mode_strings() {
        assert_eq!(permissions_string(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(permissions_string(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(permissions_string(libc::S_IFDIR | 0o1777), "drwxrwxrwt");
        assert_eq!(permissions_string(libc::S_IFREG | 0o4755), "-rwsr-xr-x");
    }
}
