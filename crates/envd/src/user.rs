//! Who a request acts as, and doing file work with exactly that user's permissions.
//!
//! envd runs as root, but a request never gets root's file access: filesystem work runs on a
//! blocking thread that has switched its filesystem uid, gid and supplementary groups (all
//! per-thread in Linux) to the requesting user, so the kernel does the permission checks.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use base64::Engine;

use crate::connect::{Code, ConnectError};

/// A local account, as `getpwnam` knows it.
#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
    /// Supplementary groups, including the primary group.
    pub groups: Vec<u32>,
}

impl User {
    /// Looks up a user by name (blocking: NSS may read files).
    pub fn lookup(name: &str) -> Result<User, ConnectError> {
        let cname = CString::new(name)
            .map_err(|_| ConnectError::new(Code::Unauthenticated, "invalid username"))?;
        let mut buf = vec![0u8; 16 * 1024];
        // SAFETY: zeroed passwd is a valid out-parameter for getpwnam_r.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: all pointers are valid for the call; buf outlives the use of pwd's strings.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut result,
            )
        };
        if rc != 0 || result.is_null() {
            return Err(ConnectError::new(
                Code::Unauthenticated,
                format!("invalid username: '{name}'"),
            ));
        }
        // SAFETY: getpwnam_r succeeded, so these are NUL-terminated strings inside buf.
        let (home, shell) = unsafe {
            (
                CStr::from_ptr(pwd.pw_dir).to_string_lossy().into_owned(),
                CStr::from_ptr(pwd.pw_shell).to_string_lossy().into_owned(),
            )
        };
        let groups = group_list(&cname, pwd.pw_gid);
        Ok(User {
            name: name.to_string(),
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
            home: PathBuf::from(if home.is_empty() { "/".into() } else { home }),
            shell,
            groups,
        })
    }

    /// Resolves a client-given path: `~` and relative paths are taken from the user's home.
    pub fn resolve(&self, path: &str) -> Result<PathBuf, ConnectError> {
        resolve_in(path, &self.home)
    }
}

/// Resolves `path` against `base` (the user's home or workdir), expanding a leading `~`.
pub fn resolve_in(path: &str, base: &Path) -> Result<PathBuf, ConnectError> {
    if path.contains('\0') {
        return Err(ConnectError::invalid("path contains a NUL byte"));
    }
    let p = if path == "~" {
        base.to_path_buf()
    } else if let Some(rest) = path.strip_prefix("~/") {
        base.join(rest)
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        base.join(path)
    };
    Ok(normalize(&p))
}

/// Lexically cleans a path (`.`/`..`/duplicate slashes), like Go's `filepath.Clean`.
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::Normal(s) => out.push(s),
            _ => {}
        }
    }
    out
}

fn group_list(name: &CStr, gid: u32) -> Vec<u32> {
    let mut n: libc::c_int = 64;
    loop {
        let mut groups = vec![0 as libc::gid_t; n as usize];
        let mut count = n;
        // SAFETY: groups has room for `count` entries; getgrouplist updates count.
        let rc = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        if rc >= 0 {
            groups.truncate(count.max(0) as usize);
            return groups;
        }
        if count <= n || n > 65536 {
            return vec![gid];
        }
        n = count;
    }
}

/// The user named by `Authorization: Basic base64("<user>:")`, if the header is present.
pub fn basic_auth_user(headers: &http::HeaderMap) -> Result<Option<String>, ConnectError> {
    let Some(value) = headers.get(http::header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || ConnectError::new(Code::Unauthenticated, "invalid Authorization header");
    let value = value.to_str().map_err(|_| bad())?;
    let encoded = value
        .strip_prefix("Basic ")
        .or_else(|| value.strip_prefix("basic "))
        .ok_or_else(bad)?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map_err(|_| bad())?;
    let decoded = String::from_utf8(decoded).map_err(|_| bad())?;
    let name = decoded.split(':').next().unwrap_or("").to_string();
    Ok((!name.is_empty()).then_some(name))
}

/// Runs `f` on a blocking thread whose filesystem identity is `user`'s.
pub async fn run_as<T, F>(user: &User, f: F) -> Result<T, ConnectError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ConnectError> + Send + 'static,
{
    let user = user.clone();
    tokio::task::spawn_blocking(move || {
        let _identity = FsIdentity::enter(&user)?;
        f()
    })
    .await
    .map_err(|e| ConnectError::internal(format!("file worker failed: {e}")))?
}

/// Holds a thread's switched filesystem identity; restores envd's own on drop.
struct FsIdentity {
    switched: bool,
}

fn raw_setgroups(groups: &[u32]) -> std::io::Result<()> {
    // The raw syscall changes only this thread; glibc's setgroups() would change every thread.
    // SAFETY: the pointer and length describe a valid gid array.
    let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl FsIdentity {
    fn enter(user: &User) -> Result<Self, ConnectError> {
        // SAFETY: geteuid/getegid have no preconditions.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        if user.uid == euid && user.gid == egid {
            return Ok(Self { switched: false });
        }
        let fail = |what: &str, e: std::io::Error| {
            ConnectError::new(
                Code::PermissionDenied,
                format!("cannot act as user '{}' ({what}): {e}", user.name),
            )
        };
        raw_setgroups(&user.groups).map_err(|e| fail("setgroups", e))?;
        let guard = Self { switched: true };
        // SAFETY: setfsgid/setfsuid only change this thread's credentials.
        unsafe {
            libc::setfsgid(user.gid);
            libc::setfsuid(user.uid);
        }
        // setfs*id report the previous id, so read back with an invalid id to verify.
        // SAFETY: as above; -1 is rejected and only returns the current value.
        let (fsuid, fsgid) = unsafe { (libc::setfsuid(u32::MAX), libc::setfsgid(u32::MAX)) };
        if fsuid as u32 != user.uid || fsgid as u32 != user.gid {
            return Err(fail(
                "setfsuid",
                std::io::Error::from_raw_os_error(libc::EPERM),
            ));
        }
        Ok(guard)
    }
}

impl Drop for FsIdentity {
    fn drop(&mut self) {
        if !self.switched {
            return;
        }
        // SAFETY: restoring this thread's credentials to the process's effective ids.
        unsafe {
            libc::setfsuid(libc::geteuid());
            libc::setfsgid(libc::getegid());
        }
        let own = own_groups();
        if raw_setgroups(&own).is_err() {
            // A blocking thread that cannot get its identity back must not serve anyone else.
            std::process::abort();
        }
    }
}

/// envd's own supplementary groups, read once at first use.
fn own_groups() -> Vec<u32> {
    static GROUPS: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    GROUPS
        .get_or_init(|| {
            // SAFETY: a zero-size query returns the count.
            let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
            if n <= 0 {
                return Vec::new();
            }
            let mut v = vec![0 as libc::gid_t; n as usize];
            // SAFETY: v has room for n entries.
            let got = unsafe { libc::getgroups(n, v.as_mut_ptr()) };
            v.truncate(got.max(0) as usize);
            v
        })
        .clone()
}

/// Must be called once before any identity switch, while every thread still has envd's groups.
pub fn remember_own_groups() {
    let _ = own_groups();
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_in_home() {
        let home = Path::new("/home/u");
        assert_eq!(
            resolve_in("a/b", home).unwrap(),
            PathBuf::from("/home/u/a/b")
        );
        assert_eq!(resolve_in("~/x", home).unwrap(), PathBuf::from("/home/u/x"));
        assert_eq!(
            resolve_in("/tmp/../etc/./p", home).unwrap(),
            PathBuf::from("/etc/p")
        );
        assert!(resolve_in("a\0b", home).is_err());
    }

    #[test]
    fn basic_auth_parses() {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            "Basic cm9vdDo=".parse().unwrap(),
        );
        assert_eq!(basic_auth_user(&h).unwrap().as_deref(), Some("root"));
        h.insert(http::header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert!(basic_auth_user(&h).is_err());
    }
}
