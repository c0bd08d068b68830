//! A page-by-page check of one QEMU's guest RAM against another's, from outside both
//! processes, and the repair of the pages that differ.
//!
//! Live migration under TCG can lose writes: QEMU 7.2 (Debian 12's) clears its migration dirty
//! bitmap without re-arming the vCPUs' TLB entries, so a guest write that lands through a
//! stale entry after a bitmap sync marks nothing dirty, and the page is not sent again (fixed
//! upstream in QEMU 9.0, "physmem: Fix migration dirty bitmap coherency with TCG memory
//! access"). A guest that wrote a kernel structure in that window runs on the target with
//! the stale copy and, sooner or later, crashes.
//!
//! The check needs no dirty tracking of its own: a restored guest's RAM is a private mapping
//! of its build's memory, so every page written since the restore is an anonymous page of the
//! source process ([`crate::memory::private_runs`]); every other page still holds the build's
//! content, which the migration's first round sent and nothing changed since. With both
//! guests stopped, the source hashes its private pages ([`private_digest`]), the target hashes
//! the same pages of its own RAM and names the ones that differ ([`mismatches`]), and the
//! source's copies of those are written over the target's ([`read_pages`], [`write_pages`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{bail, Context};
use xxhash_rust::xxh3::xxh3_64;

use crate::memory::{private_runs, ram_mappings, RamMapping, PAGE};

/// Pages read per `/proc/PID/mem` read.
const CHUNK_PAGES: u64 = 256;

/// The source's written pages and their hashes, in page order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageDigest {
    pub pages: Vec<u64>,
    pub hashes: Vec<u64>,
}

/// Every private (written-since-restore) page of a stopped `pid`'s RAM, in order.
pub fn private_pages(pid: u32, ram_file: &Path) -> anyhow::Result<Vec<u64>> {
    let maps = ram_mappings(pid, ram_file)?;
    let runs = private_runs(pid, &maps)?;
    let mut pages: Vec<u64> = runs
        .iter()
        .flat_map(|&(start, count)| start..start + count)
        .collect();
    // Mappings come in address order, which need not be the file's.
    pages.sort_unstable();
    pages.dedup();
    Ok(pages)
}

/// The hashes of `pages` (sorted) of a stopped `pid`'s RAM, in the same order.
pub fn page_hashes(pid: u32, ram_file: &Path, pages: &[u64]) -> anyhow::Result<Vec<u64>> {
    if !pages.windows(2).all(|w| w[0] < w[1]) {
        bail!("the pages to hash are not in order");
    }
    let maps = ram_mappings(pid, ram_file)?;
    let mem = open_mem(pid, false)?;
    let mut hashes = Vec::with_capacity(pages.len());
    let mut buf = Vec::new();
    for_each_chunk(&maps, &runs_of(pages), |page0, va, n| {
        buf.resize((n * PAGE) as usize, 0);
        mem.read_exact_at(&mut buf, va)
            .with_context(|| format!("reading guest page {page0}"))?;
        hashes.extend(buf.chunks_exact(PAGE as usize).map(xxh3_64));
        Ok(())
    })?;
    Ok(hashes)
}

/// Hashes of every private (written-since-restore) page of a stopped `pid`'s RAM.
pub fn private_digest(pid: u32, ram_file: &Path) -> anyhow::Result<PageDigest> {
    let pages = private_pages(pid, ram_file)?;
    let hashes = page_hashes(pid, ram_file, &pages)?;
    Ok(PageDigest { pages, hashes })
}

/// The pages of `digest` whose hashes differ from `ours` (the same pages' hashes elsewhere).
pub fn differing(digest: &PageDigest, ours: &[u64]) -> anyhow::Result<Vec<u64>> {
    if digest.pages.len() != digest.hashes.len() || ours.len() != digest.pages.len() {
        bail!(
            "a page digest has {} pages and {} hashes against {} of ours",
            digest.pages.len(),
            digest.hashes.len(),
            ours.len()
        );
    }
    Ok(digest
        .pages
        .iter()
        .zip(digest.hashes.iter().zip(ours))
        .filter(|(_, (theirs, ours))| theirs != ours)
        .map(|(&p, _)| p)
        .collect())
}

/// The pages of `digest` whose content in a stopped `pid`'s RAM hashes otherwise.
pub fn mismatches(pid: u32, ram_file: &Path, digest: &PageDigest) -> anyhow::Result<Vec<u64>> {
    if digest.pages.len() != digest.hashes.len() {
        bail!(
            "a page digest has {} pages and {} hashes",
            digest.pages.len(),
            digest.hashes.len()
        );
    }
    differing(digest, &page_hashes(pid, ram_file, &digest.pages)?)
}

/// The content of `pages` (in that order) of a stopped `pid`'s RAM.
pub fn read_pages(pid: u32, ram_file: &Path, pages: &[u64]) -> anyhow::Result<Vec<u8>> {
    let maps = ram_mappings(pid, ram_file)?;
    let mem = open_mem(pid, false)?;
    let mut out = vec![0u8; pages.len() * PAGE as usize];
    for (i, &page) in pages.iter().enumerate() {
        let va = vaddr(&maps, page)?;
        let at = i * PAGE as usize;
        mem.read_exact_at(&mut out[at..at + PAGE as usize], va)
            .with_context(|| format!("reading guest page {page}"))?;
    }
    Ok(out)
}

/// Writes `data` (one page per entry of `pages`) into a stopped `pid`'s RAM.
pub fn write_pages(pid: u32, ram_file: &Path, pages: &[u64], data: &[u8]) -> anyhow::Result<()> {
    if data.len() != pages.len() * PAGE as usize {
        bail!("{} bytes for {} pages", data.len(), pages.len());
    }
    let maps = ram_mappings(pid, ram_file)?;
    let mem = open_mem(pid, true)?;
    for (i, &page) in pages.iter().enumerate() {
        let va = vaddr(&maps, page)?;
        let at = i * PAGE as usize;
        mem.write_all_at(&data[at..at + PAGE as usize], va)
            .with_context(|| format!("writing guest page {page}"))?;
    }
    Ok(())
}

fn open_mem(pid: u32, write: bool) -> anyhow::Result<File> {
    std::fs::OpenOptions::new()
        .read(!write)
        .write(write)
        .open(format!("/proc/{pid}/mem"))
        .with_context(|| format!("opening /proc/{pid}/mem"))
}

fn vaddr(maps: &[RamMapping], page: u64) -> anyhow::Result<u64> {
    let off = page
        .checked_mul(PAGE)
        .with_context(|| format!("page {page} is out of range"))?;
    maps.iter()
        .find(|m| off >= m.file_offset && off < m.file_offset + m.len)
        .map(|m| m.vaddr + (off - m.file_offset))
        .with_context(|| format!("page {page} is outside this machine's RAM"))
}

/// Sorted pages as `(first, count)` runs.
fn runs_of(pages: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &p in pages {
        match runs.last_mut() {
            Some((s, n)) if *s + *n == p => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// Calls `f(first page, its address, pages)` for pieces of `runs` that are contiguous in the
/// process (at most [`CHUNK_PAGES`], never across two mappings).
fn for_each_chunk(
    maps: &[RamMapping],
    runs: &[(u64, u64)],
    mut f: impl FnMut(u64, u64, u64) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    for &(start, count) in runs {
        let mut done = 0;
        while done < count {
            let page0 = start + done;
            let va = vaddr(maps, page0)?;
            let m = maps
                .iter()
                .find(|m| va >= m.vaddr && va < m.vaddr + m.len)
                .context("a page outside its mapping")?;
            let left_in_map = (m.vaddr + m.len - va) / PAGE;
            let n = (count - done).min(CHUNK_PAGES).min(left_in_map.max(1));
            f(page0, va, n)?;
            done += n;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_make_runs() {
        assert_eq!(runs_of(&[1, 2, 3, 7, 9, 10]), vec![(1, 3), (7, 1), (9, 2)]);
        assert!(runs_of(&[]).is_empty());
    }

    #[test]
    fn chunks_stay_inside_one_mapping() {
        // Two mappings of the file, the second 4 pages long at file page 4.
        let maps = [
            RamMapping {
                vaddr: 0x10000,
                len: 4 * PAGE,
                file_offset: 0,
            },
            RamMapping {
                vaddr: 0x90000,
                len: 4 * PAGE,
                file_offset: 4 * PAGE,
            },
        ];
        let mut seen = Vec::new();
        for_each_chunk(&maps, &[(2, 4)], |p, va, n| {
            seen.push((p, va, n));
            Ok(())
        })
        .expect("chunks");
        assert_eq!(seen, vec![(2, 0x10000 + 2 * PAGE, 2), (4, 0x90000, 2)]);
        assert!(for_each_chunk(&maps, &[(8, 1)], |_, _, _| Ok(())).is_err());
    }

    /// A private read-write mapping of a fresh sparse file of `pages` pages in `dir`, as QEMU
    /// maps RAM with `share=off`.
    fn mapped(dir: &Path, name: &str, pages: u64) -> (std::path::PathBuf, *mut u8) {
        let path = dir.join(name);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create");
        f.set_len(pages * PAGE).expect("len");
        // SAFETY: a new mapping of a file the test owns; the test unmaps it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                (pages * PAGE) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        (path, p.cast())
    }

    #[test]
    fn a_stale_page_is_found_and_repaired() {
        // Two private mappings in this process stand in for the source's and the target's
        // RAM: both get the same writes but for one page the target missed and one it has an
        // older copy of; the check names exactly those, and the repair makes them equal.
        const PAGES: u64 = 64;
        let dir = tempfile::tempdir().expect("tempdir");
        let (src_file, src) = mapped(dir.path(), "src", PAGES);
        let (dst_file, dst) = mapped(dir.path(), "dst", PAGES);
        let put = |m: *mut u8, page: u64, v: u8| {
            // SAFETY: inside the PAGES pages mapped at `m`.
            unsafe { *m.add((page * PAGE + 17) as usize) = v };
        };
        for page in [3, 4, 5, 20, 40] {
            put(src, page, page as u8);
            put(dst, page, page as u8);
        }
        put(src, 4, 0xee); // the target holds the older copy of page 4
        put(src, 41, 1); // and never received page 41
        let pid = std::process::id();
        let digest = private_digest(pid, &src_file).expect("digest");
        assert_eq!(digest.pages, vec![3, 4, 5, 20, 40, 41]);
        let bad = mismatches(pid, &dst_file, &digest).expect("mismatches");
        assert_eq!(bad, vec![4, 41]);
        let pages = read_pages(pid, &src_file, &bad).expect("read");
        write_pages(pid, &dst_file, &bad, &pages).expect("write");
        assert!(mismatches(pid, &dst_file, &digest)
            .expect("again")
            .is_empty());
        // A digest that does not add up, and pages outside the RAM, are refused.
        let odd = PageDigest {
            pages: vec![1],
            hashes: vec![],
        };
        assert!(mismatches(pid, &dst_file, &odd).is_err());
        assert!(write_pages(pid, &dst_file, &[PAGES], &[0u8; PAGE as usize]).is_err());
        assert!(write_pages(pid, &dst_file, &[1], &[0u8; 3]).is_err());
        // SAFETY: unmapping what we mapped above.
        unsafe {
            libc::munmap(src.cast(), (PAGES * PAGE) as usize);
            libc::munmap(dst.cast(), (PAGES * PAGE) as usize);
        }
    }
}
