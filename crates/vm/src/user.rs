//! The unprivileged identity a QEMU runs as, and the files handed to it.
//!
//! The node runs as root; each QEMU drops to a uid of its own (one per network slot, so two
//! guests' QEMUs never share a uid and cannot signal, trace or open each other) and to one
//! shared group. The node gives that uid exactly what the process writes: its run directory,
//! its disk overlay, the RAM file of a boot, the files a capture asks QEMU to write. Whatever
//! becomes part of a build is taken back ([`seal`]): owned by root, readable by the group (a
//! restore's QEMU reads its backing chain) and writable by no QEMU. RAM bases that restores map
//! copy-on-write are handed as sealed memory files instead ([`crate::ram_base`]), because QEMU
//! 7.2 opens a RAM file for writing even when it maps it privately.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Who a QEMU runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuUser {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the shared group, and `kvm` where `/dev/kvm` needs it).
    pub groups: Vec<u32>,
}

impl QemuUser {
    /// Hands `path` to this user: owned by it, owner-only.
    pub fn hand(&self, path: &Path) -> std::io::Result<()> {
        std::os::unix::fs::chown(path, Some(self.uid), Some(self.gid))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
    }

    /// Creates `path` empty (or empties it) and hands it over, for a file QEMU is asked to
    /// write by name (a device state, a snapshot overlay).
    pub fn hand_new(&self, path: &Path) -> std::io::Result<()> {
        std::fs::File::create(path)?;
        self.hand(path)
    }

    /// A run directory: owned by the user, private to it (QEMU makes its QMP socket and pidfile
    /// there; the node, as root, reaches them anyway).
    pub fn hand_dir(&self, dir: &Path) -> std::io::Result<()> {
        std::os::unix::fs::chown(dir, Some(self.uid), Some(self.gid))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
    }
}

/// Takes a file back from whichever QEMU wrote it: root's, readable by the QEMU group (`gid`),
/// written by nobody but root.
pub fn seal(path: &Path, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::chown(path, Some(0), Some(gid))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o640))
}

/// A directory QEMUs pass through but do not list: root's, `--x` for the group.
pub fn traverse_only(dir: &Path, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::chown(dir, Some(0), Some(gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o710))
}

/// Lets the group `gid` pass through `dir` without taking anything away: a directory anyone
/// may pass is left alone; otherwise it is given to the group with `g+x` added.
pub fn searchable_by_group(dir: &Path, gid: u32) -> std::io::Result<()> {
    let mode = std::fs::metadata(dir)?.permissions().mode();
    if mode & 0o001 != 0 {
        return Ok(());
    }
    std::os::unix::fs::chown(dir, None, Some(gid))?;
    std::fs::set_permissions(
        dir,
        std::fs::Permissions::from_mode((mode & 0o7777) | 0o010),
    )
}

/// The gid of group `name` in `/etc/group`, if it exists.
pub fn group_id(name: &str) -> Option<u32> {
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|l| {
        let mut f = l.split(':');
        if f.next()? != name {
            return None;
        }
        f.nth(1)?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handing_and_sealing_set_owner_and_mode() {
        let dir = std::env::temp_dir().join(format!("vmon-user-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test setup");
        let f = dir.join("disk.qcow2");
        let u = QemuUser {
            uid: 4_000_123,
            gid: 4_000_000,
            groups: vec![4_000_000],
        };
        u.hand_new(&f).expect("test setup");
        let m = std::fs::metadata(&f).expect("test setup");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o777),
            (4_000_123, 4_000_000, 0o600)
        );
        seal(&f, 4_000_000).expect("test setup");
        let m = std::fs::metadata(&f).expect("test setup");
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o777), (0, 4_000_000, 0o640));
        std::fs::remove_dir_all(&dir).expect("test setup");
    }

    #[test]
    fn group_ids_come_from_etc_group() {
        assert_eq!(group_id("root"), Some(0));
        assert_eq!(group_id("no-such-group-vmon"), None);
    }
}
