//! RAM bases as sealed memory files.
//!
//! A restore maps its build's RAM base copy-on-write (`share=off`), so the base is shared by
//! every restore of that build, of every team. QEMU 7.2 opens a RAM file read-write even for a
//! private mapping, so a base handed by path would be writable by every QEMU that maps it. The
//! node instead copies the base once into a memory file (`memfd`), seals it against every write
//! and size change, and passes the descriptor to each QEMU, which opens it as
//! `/proc/self/fd/<n>`: the kernel refuses writes to a sealed file whoever asks, while private
//! mappings of it work as they do for the file.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::Context;

/// The name a base's memory file carries (`/proc/<pid>/maps` shows `/memfd:<name> (deleted)`).
pub fn memfd_name(ram_file: &Path) -> String {
    let file = ram_file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("vmon-ram-{file}")
}

/// What a mapping of `ram_file`'s sealed copy looks like in `/proc/<pid>/maps`.
pub fn maps_name(ram_file: &Path) -> String {
    format!("/memfd:{} (deleted)", memfd_name(ram_file))
}

/// Copies `ram_file` (holes stay holes) into a new memory file and seals it.
pub fn sealed_copy(ram_file: &Path) -> anyhow::Result<OwnedFd> {
    let src = File::open(ram_file)
        .with_context(|| format!("RAM base {} is missing", ram_file.display()))?;
    let len = src.metadata()?.len();
    let name = CString::new(memfd_name(ram_file)).context("RAM base name")?;
    // SAFETY: `name` is NUL-terminated; memfd_create touches nothing else of ours.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("memfd_create");
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
    let dst = unsafe { File::from_raw_fd(fd) };
    dst.set_len(len)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut off: u64 = 0;
    while off < len {
        // Skip holes: a base is mostly pages the guest never touched.
        let data = seek(&src, off, libc::SEEK_DATA);
        let Some(data) = data else { break };
        let hole = seek(&src, data, libc::SEEK_HOLE).unwrap_or(len).min(len);
        let mut at = data;
        while at < hole {
            let n = ((hole - at) as usize).min(buf.len());
            src.read_exact_at(&mut buf[..n], at)
                .with_context(|| format!("reading {}", ram_file.display()))?;
            dst.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        off = hole;
    }
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on a descriptor we own, with an integer argument.
    if unsafe { libc::fcntl(dst.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error()).context("sealing the RAM base");
    }
    Ok(OwnedFd::from(dst))
}

/// lseek with SEEK_DATA/SEEK_HOLE; None past the last data.
fn seek(f: &File, from: u64, whence: i32) -> Option<u64> {
    let from = i64::try_from(from).ok()?;
    // SAFETY: lseek on a descriptor we own.
    let r = unsafe { libc::lseek(f.as_raw_fd(), from, whence) };
    u64::try_from(r).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `fd` refuses writes.
    fn is_sealed(fd: &OwnedFd) -> anyhow::Result<bool> {
        use anyhow::bail;
        // SAFETY: fcntl on a borrowed descriptor, no memory passed.
        let s = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if s < 0 {
            bail!("F_GET_SEALS: {}", std::io::Error::last_os_error());
        }
        Ok(s & libc::F_SEAL_WRITE != 0)
    }

    #[test]
    fn a_sealed_copy_has_the_bytes_and_refuses_writes() {
        let dir = std::env::temp_dir().join(format!("vmon-rambase-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test setup");
        let p = dir.join("ram-x.mem");
        let f = File::create(&p).expect("test setup");
        f.set_len(8 << 20).expect("test setup");
        f.write_all_at(b"hello", 4096).expect("test setup");
        f.write_all_at(b"world", (6 << 20) + 7).expect("test setup");
        drop(f);
        let fd = sealed_copy(&p).expect("test setup");
        assert!(is_sealed(&fd).expect("test setup"));
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let copy = std::fs::read(&path).expect("test setup");
        assert_eq!(copy, std::fs::read(&p).expect("test setup"));
        // Opening for writing works (QEMU does), writing does not.
        let w = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("test setup");
        assert!(
            w.write_all_at(b"x", 0).is_err(),
            "a sealed base took a write"
        );
        std::fs::remove_dir_all(&dir).expect("test setup");
    }
}
