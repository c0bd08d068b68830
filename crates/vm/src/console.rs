//! The guest's console log, bounded: QEMU appends to it (`append=on`), and [`cap`] cuts the
//! oldest part away once it grows past its limit, so a guest flooding its serial port costs the
//! host a bounded amount of disk and the newest lines are kept.
//!
//! The cut is `fallocate(FALLOC_FL_COLLAPSE_RANGE)` on whole filesystem blocks: done in place,
//! while QEMU keeps appending at the (new) end. Filesystems without it (tmpfs) get a copy of the
//! tail instead, which may lose what is written during the copy.

use std::os::fd::AsRawFd;
use std::path::Path;

/// The default bound of one sandbox's console log.
pub const DEFAULT_MAX_BYTES: u64 = 4 * 1024 * 1024;

/// Cuts `path` down to about `keep` bytes (at least `keep`, less than `keep` plus one block)
/// when it is larger than `max`; returns the bytes removed. The first line left may be partial:
/// readers skip up to the first newline of a file that was cut ([`was_cut`]).
pub fn cap(path: &Path, max: u64, keep: u64) -> std::io::Result<u64> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let meta = f.metadata()?;
    let len = meta.len();
    if len <= max || keep >= len {
        return Ok(0);
    }
    let block = {
        use std::os::unix::fs::MetadataExt;
        meta.blksize().max(512)
    };
    let cut = (len - keep) / block * block;
    if cut == 0 {
        return Ok(0);
    }
    let cut_i = i64::try_from(cut).map_err(|_| std::io::Error::other("console log too large"))?;
    // SAFETY: fallocate on a descriptor we own, with plain integer arguments.
    let rc = unsafe { libc::fallocate(f.as_raw_fd(), libc::FALLOC_FL_COLLAPSE_RANGE, 0, cut_i) };
    if rc == 0 {
        mark_cut(path);
        return Ok(cut);
    }
    // No collapse here: keep the tail by copying it over the head.
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut src = f;
    src.seek(SeekFrom::Start(len - keep))?;
    let mut tail = Vec::with_capacity(usize::try_from(keep).unwrap_or(0));
    Read::by_ref(&mut src).take(keep).read_to_end(&mut tail)?;
    src.set_len(0)?;
    src.seek(SeekFrom::Start(0))?;
    src.write_all(&tail)?;
    mark_cut(path);
    Ok(len - keep)
}

/// The last `max` bytes of `path` as text (lossy), from the first whole line.
pub fn read_tail(path: &Path, max: u64) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let skip = len.saturating_sub(max);
    f.seek(SeekFrom::Start(skip))?;
    let mut bytes = Vec::new();
    f.take(max).read_to_end(&mut bytes)?;
    if skip > 0 {
        let cut = bytes.iter().position(|b| *b == b'\n').map_or(0, |i| i + 1);
        bytes.drain(..cut);
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn marker(path: &Path) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".cut");
    p.into()
}

fn mark_cut(path: &Path) {
    let _ = std::fs::write(marker(path), b"");
}

/// True when [`cap`] has cut the head of `path` (its first line may be partial).
pub fn was_cut(path: &Path) -> bool {
    marker(path).exists()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn dir() -> tempfile::TempDir {
        // /var/tmp is a disk filesystem on the machines vmon runs on (collapse works there);
        // /tmp may be tmpfs (the copy fallback).
        tempfile::tempdir_in("/var/tmp").expect("tempdir")
    }

    #[test]
    fn a_log_past_its_bound_keeps_its_newest_lines() {
        let d = dir();
        let p = d.path().join("console.log");
        let mut w = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .expect("open");
        for i in 0..200_000 {
            writeln!(w, "line {i:08}").expect("write");
        }
        let len = std::fs::metadata(&p).expect("meta").len();
        let removed = cap(&p, 1 << 20, 256 << 10).expect("cap");
        assert!(removed > 0);
        let after = std::fs::metadata(&p).expect("meta").len();
        assert_eq!(after, len - removed);
        assert!((256 << 10..(256 << 10) + 65536).contains(&after), "{after}");
        // The writer keeps appending at the end, after the cut.
        writeln!(w, "after the cut").expect("write");
        let text = std::fs::read_to_string(&p).expect("read");
        assert!(
            text.ends_with("line 00199999\nafter the cut\n"),
            "{}",
            &text[text.len() - 40..]
        );
        assert!(!text.contains("line 00000000"));
        assert!(was_cut(&p));
        // Under the bound nothing happens.
        assert_eq!(cap(&p, 1 << 20, 256 << 10).expect("cap"), 0);
    }

    #[test]
    fn a_small_log_is_left_alone() {
        let d = dir();
        let p = d.path().join("console.log");
        std::fs::write(&p, "hello\n").expect("write");
        assert_eq!(cap(&p, 1024, 512).expect("cap"), 0);
        assert_eq!(std::fs::read_to_string(&p).expect("read"), "hello\n");
        assert!(!was_cut(&p));
    }
}
