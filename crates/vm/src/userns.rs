//! User namespaces for daemons that serve tenant files (virtiofsd): a process that is root
//! inside the namespace, and nobody outside it.
//!
//! A [`UserNs`] maps uids and gids `0..count` inside to `host_base..host_base+count` on the
//! host. A process that [`enter`]s it runs as the namespace's root, which on the host is the
//! unprivileged `host_base`: its capabilities reach only files owned by mapped ids, a file it
//! creates for uid `n` is owned by `host_base + n`, and a setuid-root file it makes is setuid
//! to `host_base` on the host. It holds no capability in the host's namespace.
//!
//! The namespace is made by a short-lived forked child (the node writes the maps of a namespace
//! it does not live in, which only a process privileged in the parent namespace may), kept by
//! its descriptor, and entered with `setns(2)` between fork and exec.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// How many ids a namespace maps: the 16-bit range every guest distribution uses.
pub const IDS: u32 = 65_536;

/// A user namespace kept open by its descriptor.
#[derive(Debug)]
pub struct UserNs {
    fd: OwnedFd,
    pub host_base: u32,
}

fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn pipe() -> std::io::Result<(std::fs::File, std::fs::File)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(last_error());
    }
    // SAFETY: pipe2 returned two new descriptors that nothing else owns.
    Ok(unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    })
}

impl UserNs {
    /// Makes a namespace mapping `0..IDS` to `host_base..host_base+IDS` (uids and gids).
    /// Blocking: it forks and waits for a child that lives a few milliseconds.
    pub fn new(host_base: u32) -> std::io::Result<UserNs> {
        if host_base == 0 || host_base.checked_add(IDS).is_none() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{host_base} cannot start a range of {IDS} host ids"),
            ));
        }
        let (mut ready_r, ready_w) = pipe()?;
        let (done_r, done_w) = pipe()?;
        let (ready_w_fd, done_r_fd) = (ready_w.as_raw_fd(), done_r.as_raw_fd());
        // SAFETY: the child only makes async-signal-safe calls (unshare, write, read, _exit)
        // on descriptors made before the fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(last_error());
        }
        if pid == 0 {
            // SAFETY: in the forked child; see above.
            unsafe {
                let ok: u8 = u8::from(libc::unshare(libc::CLONE_NEWUSER) == 0);
                libc::write(ready_w_fd, (&ok as *const u8).cast(), 1);
                let mut b = 0u8;
                // Until the parent has written the maps and opened the namespace.
                libc::read(done_r_fd, (&mut b as *mut u8).cast(), 1);
                libc::_exit(0);
            }
        }
        drop(ready_w);
        drop(done_r);
        let made = (|| {
            let mut ok = [0u8; 1];
            ready_r.read_exact(&mut ok)?;
            if ok[0] != 1 {
                return Err(std::io::Error::other(
                    "unshare(CLONE_NEWUSER) failed (user namespaces disabled?)",
                ));
            }
            let map = format!("0 {host_base} {IDS}\n");
            for file in ["uid_map", "gid_map"] {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(format!("/proc/{pid}/{file}"))?
                    .write_all(map.as_bytes())?;
            }
            let ns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
            Ok(OwnedFd::from(ns))
        })();
        // A byte rather than EOF: a process forked meanwhile elsewhere may hold a copy of the
        // pipe's write end.
        let _ = (&done_w).write_all(&[1]);
        drop(done_w);
        let mut status = 0;
        // SAFETY: waits for the child forked above, which exits once it read that byte.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        Ok(UserNs {
            fd: made?,
            host_base,
        })
    }

    /// The descriptor [`enter`] takes in a child.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// In the child between fork and exec, as the host's root: drops the supplementary groups,
/// enters the namespace `ns_fd` and becomes its root (uid and gid 0 inside, `host_base` on the
/// host). The exec that follows gives the program every capability inside the namespace and
/// none outside it.
///
/// # Safety
/// Call only in a freshly forked, single-threaded child (a `pre_exec` closure).
pub unsafe fn enter(ns_fd: RawFd) -> std::io::Result<()> {
    // SAFETY: plain system calls on integers; async-signal-safe.
    unsafe {
        // Root's groups (gid 0 among them) would still count on the host after the switch.
        if libc::setgroups(0, std::ptr::null()) != 0
            || libc::setns(ns_fd, libc::CLONE_NEWUSER) != 0
            || libc::setresgid(0, 0, 0) != 0
            || libc::setresuid(0, 0, 0) != 0
        {
            return Err(last_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn a_process_in_the_namespace_is_root_inside_and_nobody_outside() {
        let ns = UserNs::new(1_234_500_000).expect("user namespace");
        let fd = ns.raw_fd();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.args(["-c", "id -u; id -g; read x || true"]);
        cmd.stdin(std::process::Stdio::piped());
        cmd.stdout(std::process::Stdio::piped());
        // SAFETY: `enter` is made for a pre_exec closure.
        unsafe { cmd.pre_exec(move || enter(fd)) };
        let mut child = cmd.spawn().expect("run sh");
        // Seen from the host: an unprivileged uid and gid, in a namespace of its own that maps
        // nothing of the host's ids below the base (so its capabilities hold only there).
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", child.id())).expect("status");
        let field = |name: &str| -> String {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap_or_default()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(field("Uid:"), "1234500000 1234500000 1234500000 1234500000");
        assert_eq!(field("Gid:"), "1234500000 1234500000 1234500000 1234500000");
        assert_eq!(field("Groups:"), "", "no supplementary group of root's");
        let own = std::fs::read_link("/proc/self/ns/user").expect("own ns");
        let its = std::fs::read_link(format!("/proc/{}/ns/user", child.id())).expect("its ns");
        assert_ne!(own, its);
        let map = std::fs::read_to_string(format!("/proc/{}/uid_map", child.id())).expect("map");
        let map: Vec<&str> = map.split_whitespace().collect();
        assert_eq!(map, ["0", "1234500000", "65536"]);
        drop(child.stdin.take());
        let out = child.wait_with_output().expect("sh ends");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[..2], ["0", "0"], "root inside: {text}");
    }

    #[test]
    fn a_range_that_does_not_fit_is_refused() {
        assert!(UserNs::new(0).is_err());
        assert!(UserNs::new(u32::MAX - 10).is_err());
    }
}
