//! Memory layers: the guest RAM pages a sandbox wrote since its restore, captured from outside
//! the QEMU process, and written back into a fresh one.
//!
//! Every guest's RAM is a file mapping (`memory-backend-file`). A restored guest maps its
//! build's `mem0` privately: pages it writes become anonymous copy-on-write pages, which the
//! kernel's pagemap shows as present and not file-backed. Those pages, read through
//! `/proc/PID/mem`, are the layer. A restore writes each layer into the new process's mapping at
//! the same offsets before the device state is loaded.
//!
//! Layer file: a header, the runs `(first page, page count)`, one xxh3 hash per page (so the next
//! capture can skip pages that did not change), the pages, and an xxh3 checksum of all that.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{bail, Context};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

pub const PAGE: u64 = 4096;
const MAGIC: &[u8; 8] = b"VMONLAY1";
/// Copy at most this much per read/write syscall pair.
const CHUNK_PAGES: u64 = 256;

/// One mapping of the RAM file inside a process.
#[derive(Debug, Clone, Copy)]
pub struct RamMapping {
    pub vaddr: u64,
    pub len: u64,
    /// Offset of `vaddr` within the RAM file.
    pub file_offset: u64,
}

/// The mappings of `ram_file` in process `pid` (normally exactly one).
pub fn ram_mappings(pid: u32, ram_file: &Path) -> anyhow::Result<Vec<RamMapping>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .with_context(|| format!("reading /proc/{pid}/maps"))?;
    let want = std::fs::canonicalize(ram_file).unwrap_or_else(|_| ram_file.to_path_buf());
    let want = want.display().to_string();
    // A restore maps the base's sealed memory file instead (crate::ram_base); a QEMU with a
    // private view of the artifacts (crate::process) may name the file by another path, so
    // the inode decides too.
    let sealed = crate::ram_base::maps_name(ram_file);
    let inode = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(ram_file).map(|m| m.ino()).ok()
    };
    let name = ram_file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(_perm), Some(off), Some(_dev), Some(ino)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path: Vec<&str> = f.collect();
        let path = path.join(" ");
        let same_inode = inode.is_some()
            && ino.parse::<u64>().ok() == inode
            && !name.is_empty()
            && path.ends_with(&format!("/{name}"));
        if path != want && path != sealed && !same_inode {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b), Ok(off)) = (
            u64::from_str_radix(a, 16),
            u64::from_str_radix(b, 16),
            u64::from_str_radix(off, 16),
        ) else {
            continue;
        };
        out.push(RamMapping {
            vaddr: a,
            len: b.saturating_sub(a),
            file_offset: off,
        });
    }
    if out.is_empty() {
        bail!("RAM file {want} is not mapped in process {pid}");
    }
    Ok(out)
}

/// Runs of private (written-since-restore) pages, as `(file page index, count)`.
pub fn private_runs(pid: u32, maps: &[RamMapping]) -> anyhow::Result<Vec<(u64, u64)>> {
    let pagemap = File::open(format!("/proc/{pid}/pagemap"))
        .with_context(|| format!("opening /proc/{pid}/pagemap"))?;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for m in maps {
        let pages = m.len / PAGE;
        let mut buf = vec![0u8; (pages * 8) as usize];
        pagemap
            .read_exact_at(&mut buf, (m.vaddr / PAGE) * 8)
            .context("reading pagemap")?;
        let first = m.file_offset / PAGE;
        for (i, e) in buf.chunks_exact(8).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(e);
            let v = u64::from_le_bytes(b);
            let present = v >> 63 & 1 == 1;
            let swapped = v >> 62 & 1 == 1;
            let file_or_shared = v >> 61 & 1 == 1;
            if (present && !file_or_shared) || swapped {
                let page = first + i as u64;
                match runs.last_mut() {
                    Some((s, n)) if *s + *n == page => *n += 1,
                    _ => runs.push((page, 1)),
                }
            }
        }
    }
    Ok(runs)
}

fn vaddr_of(maps: &[RamMapping], page: u64) -> Option<u64> {
    let off = page * PAGE;
    maps.iter()
        .find(|m| off >= m.file_offset && off < m.file_offset + m.len)
        .map(|m| m.vaddr + (off - m.file_offset))
}

/// What a capture wrote.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerStats {
    pub pages: u64,
    pub runs: u64,
    pub bytes: u64,
    /// Private pages left out because the previous layer already holds them unchanged.
    pub skipped: u64,
}

/// The page hashes of a layer, by page index: lets the next capture skip unchanged pages.
pub type PageHashes = std::collections::HashMap<u64, u64>;

/// Captures the private pages of a stopped `pid` into `out`. Pages whose hash equals the one in
/// `previous` (the effective content under this process) are left out. A capture that fails
/// (a full disk) leaves neither `out` nor its spool behind.
pub fn capture(
    pid: u32,
    ram_file: &Path,
    out: &Path,
    previous: Option<&PageHashes>,
) -> anyhow::Result<LayerStats> {
    let captured = capture_into(pid, ram_file, out, previous);
    if captured.is_err() {
        let _ = std::fs::remove_file(out.with_extension("spool"));
        let _ = std::fs::remove_file(out);
    }
    captured
}

fn capture_into(
    pid: u32,
    ram_file: &Path,
    out: &Path,
    previous: Option<&PageHashes>,
) -> anyhow::Result<LayerStats> {
    let maps = ram_mappings(pid, ram_file)?;
    let runs = private_runs(pid, &maps)?;
    let mem = File::open(format!("/proc/{pid}/mem"))
        .with_context(|| format!("opening /proc/{pid}/mem"))?;
    // Read the pages first (the hashes decide what is kept), into a spool file so memory stays
    // bounded whatever the delta size.
    let mut kept_runs: Vec<(u64, u64)> = Vec::new();
    let mut hashes: Vec<u64> = Vec::new();
    let spool_path = out.with_extension("spool");
    let mut spool = BufWriter::with_capacity(1 << 20, File::create(&spool_path)?);
    let mut stats = LayerStats::default();
    let mut buf = vec![0u8; (CHUNK_PAGES * PAGE) as usize];
    for &(start, count) in &runs {
        let mut done = 0;
        while done < count {
            let n = (count - done).min(CHUNK_PAGES);
            let page0 = start + done;
            let Some(va) = vaddr_of(&maps, page0) else {
                bail!("page {page0} is outside the RAM mapping");
            };
            let chunk = &mut buf[..(n * PAGE) as usize];
            mem.read_exact_at(chunk, va)
                .with_context(|| format!("reading guest page {page0} of process {pid}"))?;
            for (i, page) in chunk.chunks_exact(PAGE as usize).enumerate() {
                let idx = page0 + i as u64;
                let h = xxh3_64(page);
                if previous.and_then(|p| p.get(&idx)) == Some(&h) {
                    stats.skipped += 1;
                    continue;
                }
                match kept_runs.last_mut() {
                    Some((s, c)) if *s + *c == idx => *c += 1,
                    _ => kept_runs.push((idx, 1)),
                }
                hashes.push(h);
                spool.write_all(page)?;
            }
            done += n;
        }
    }
    spool.flush()?;
    drop(spool);

    let mut w = Checksummed::new(BufWriter::with_capacity(1 << 20, File::create(out)?));
    w.write_all(MAGIC)?;
    w.write_all(&(PAGE as u32).to_le_bytes())?;
    w.write_all(&(kept_runs.len() as u32).to_le_bytes())?;
    w.write_all(&(hashes.len() as u64).to_le_bytes())?;
    for &(s, c) in &kept_runs {
        w.write_all(&s.to_le_bytes())?;
        w.write_all(&c.to_le_bytes())?;
    }
    for h in &hashes {
        w.write_all(&h.to_le_bytes())?;
    }
    let mut spool = BufReader::with_capacity(1 << 20, File::open(&spool_path)?);
    std::io::copy(&mut spool, &mut w)?;
    let _ = std::fs::remove_file(&spool_path);
    let sum = w.digest();
    let mut inner = w.into_inner();
    inner.write_all(&sum.to_le_bytes())?;
    let f = inner.into_inner().map_err(|e| e.into_error())?;
    f.sync_all()?;
    stats.pages = hashes.len() as u64;
    stats.runs = kept_runs.len() as u64;
    stats.bytes = stats.pages * PAGE;
    Ok(stats)
}

struct Checksummed<W> {
    inner: W,
    hasher: Xxh3,
}

impl<W: Write> Checksummed<W> {
    fn new(inner: W) -> Self {
        Checksummed {
            inner,
            hasher: Xxh3::new(),
        }
    }
    fn digest(&self) -> u64 {
        self.hasher.digest()
    }
    fn into_inner(self) -> W {
        self.inner
    }
}

impl<W: Write> Write for Checksummed<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A layer's index (runs and page hashes), read and checked without its pages.
#[derive(Debug, Clone)]
pub struct LayerIndex {
    pub runs: Vec<(u64, u64)>,
    pub hashes: Vec<u64>,
    data_offset: u64,
}

impl LayerIndex {
    pub fn page_hashes(&self) -> PageHashes {
        let mut m = PageHashes::with_capacity(self.hashes.len());
        let mut i = 0;
        for &(s, c) in &self.runs {
            for p in s..s + c {
                if let Some(h) = self.hashes.get(i) {
                    m.insert(p, *h);
                }
                i += 1;
            }
        }
        m
    }
}

fn read_index(f: &File, len: u64) -> anyhow::Result<LayerIndex> {
    let mut hdr = [0u8; 24];
    f.read_exact_at(&mut hdr, 0).context("layer header")?;
    if &hdr[..8] != MAGIC {
        bail!("not a vmon memory layer (bad magic)");
    }
    let page = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as u64;
    let nruns = u32::from_le_bytes([hdr[12], hdr[13], hdr[14], hdr[15]]) as u64;
    let mut pb = [0u8; 8];
    pb.copy_from_slice(&hdr[16..24]);
    let npages = u64::from_le_bytes(pb);
    if page != PAGE {
        bail!("layer page size {page} is not {PAGE}");
    }
    let index_len = nruns * 16 + npages * 8;
    let data_offset = 24 + index_len;
    if data_offset + npages * PAGE + 8 != len {
        bail!("layer is truncated or has trailing bytes");
    }
    let mut idx = vec![0u8; index_len as usize];
    f.read_exact_at(&mut idx, 24)?;
    let mut runs = Vec::with_capacity(nruns as usize);
    let word = |b: &[u8]| {
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        u64::from_le_bytes(a)
    };
    let mut total = 0u64;
    for r in idx[..(nruns * 16) as usize].chunks_exact(16) {
        let (s, c) = (word(&r[..8]), word(&r[8..]));
        total = total.saturating_add(c);
        runs.push((s, c));
    }
    if total != npages {
        bail!("layer runs cover {total} pages but the header says {npages}");
    }
    let hashes = idx[(nruns * 16) as usize..]
        .chunks_exact(8)
        .map(word)
        .collect();
    Ok(LayerIndex {
        runs,
        hashes,
        data_offset,
    })
}

/// Reads and verifies a layer's index (cheap: the pages are not read).
pub fn read_layer_index(path: &Path) -> anyhow::Result<LayerIndex> {
    let f =
        File::open(path).with_context(|| format!("memory layer {} is missing", path.display()))?;
    let len = f.metadata()?.len();
    read_index(&f, len).with_context(|| format!("memory layer {}", path.display()))
}

/// Verifies a layer's checksum over the whole file.
pub fn verify(path: &Path) -> anyhow::Result<()> {
    let f =
        File::open(path).with_context(|| format!("memory layer {} is missing", path.display()))?;
    let len = f.metadata()?.len();
    if len < 32 {
        bail!("memory layer {} is truncated", path.display());
    }
    let mut r = BufReader::with_capacity(1 << 20, (&f).take(len - 8));
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let mut tail = [0u8; 8];
    f.read_exact_at(&mut tail, len - 8)?;
    if u64::from_le_bytes(tail) != h.digest() {
        bail!(
            "memory layer {} is corrupt (checksum mismatch)",
            path.display()
        );
    }
    Ok(())
}

/// Writes a layer's pages into process `pid` (started with its RAM file `share=off`), checking
/// the layer's checksum on the way. On error the process must be discarded.
///
/// Most of the cost is the target's copy-on-write faults, so the pages go in from several
/// threads at once (each its own part of the layer) while another checks the checksum over the
/// whole file.
pub fn write_in(pid: u32, ram_file: &Path, layer: &Path) -> anyhow::Result<LayerStats> {
    let maps = ram_mappings(pid, ram_file)?;
    let f = File::open(layer)
        .with_context(|| format!("memory layer {} is missing", layer.display()))?;
    let len = f.metadata()?.len();
    let index = read_index(&f, len).with_context(|| format!("memory layer {}", layer.display()))?;
    // (first guest page, pages, offset in the layer file) of every chunk, in file order.
    let mut pieces = Vec::new();
    let mut off = index.data_offset;
    for &(start, count) in &index.runs {
        let mut done = 0;
        while done < count {
            let n = (count - done).min(CHUNK_PAGES);
            pieces.push((start + done, n, off));
            off += n * PAGE;
            done += n;
        }
    }
    let mem = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .with_context(|| format!("opening /proc/{pid}/mem for writing"))?;
    let pages = index.hashes.len() as u64;
    let writers = if pages * PAGE < (4 << 20) {
        1
    } else {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 4)
    };
    let per = pieces.len().div_ceil(writers).max(1);
    let write_part = |part: &[(u64, u64, u64)]| -> anyhow::Result<()> {
        let mut buf = vec![0u8; (CHUNK_PAGES * PAGE) as usize];
        for &(page0, n, off) in part {
            let chunk = &mut buf[..(n * PAGE) as usize];
            f.read_exact_at(chunk, off)?;
            let Some(va) = vaddr_of(&maps, page0) else {
                bail!("layer page {page0} is outside this machine's RAM");
            };
            mem.write_all_at(chunk, va)
                .with_context(|| format!("writing guest page {page0}"))?;
        }
        Ok(())
    };
    let (checked, written) = std::thread::scope(|s| {
        let check = s.spawn(|| verify(layer));
        let mut parts = pieces.chunks(per);
        let first = parts.next().unwrap_or(&[]);
        let parts: Vec<_> = parts.map(|part| s.spawn(|| write_part(part))).collect();
        let mut written = write_part(first);
        for p in parts {
            let r = p
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a write-in thread panicked")));
            written = written.and(r);
        }
        let checked = check
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the checksum thread panicked")));
        (checked, written)
    });
    // A corrupt layer is the clearer error when both failed.
    checked?;
    written?;
    Ok(LayerStats {
        pages,
        runs: index.runs.len() as u64,
        bytes: pages * PAGE,
        skipped: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sparse RAM file of `pages` pages in `dir`, open for reading and writing.
    fn ram_file(dir: &Path, pages: u64) -> (std::path::PathBuf, File) {
        let ram = dir.join("mem0");
        File::create(&ram)
            .expect("create")
            .set_len(pages * PAGE)
            .expect("len");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&ram)
            .expect("open");
        (ram, file)
    }

    /// A fresh private read-write mapping of `file`, as QEMU maps RAM with `share=off`.
    fn map_private(file: &File, len: usize) -> *mut u8 {
        // SAFETY: a new mapping of a file the test owns; the test unmaps it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(file),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    #[test]
    fn a_large_layer_goes_back_in_from_several_threads() {
        // 16 MiB of distinct pages, captured from one private mapping of the RAM file and
        // written into a fresh one: the threaded path must put every page where it was.
        const PAGES: u64 = 4096;
        let dir = tempfile::tempdir().expect("tempdir");
        let (ram, file) = ram_file(dir.path(), PAGES);
        let len = (PAGES * PAGE) as usize;
        let map = || map_private(&file, len);
        let stamp = |page: u64| (page.wrapping_mul(2654435761) >> 7) as u8 | 1;
        let a = map();
        // Every odd page holds its own stamp at two places; even pages stay untouched.
        for page in (1..PAGES).step_by(2) {
            // SAFETY: inside the `len` bytes mapped at `a`.
            unsafe {
                *a.add((page * PAGE) as usize) = stamp(page);
                *a.add((page * PAGE + PAGE - 1) as usize) = stamp(page);
            }
        }
        let pid = std::process::id();
        let layer = dir.path().join("big");
        let st = capture(pid, &ram, &layer, None).expect("capture");
        assert_eq!(st.pages, PAGES / 2);
        // SAFETY: unmapping what we mapped above.
        unsafe { libc::munmap(a.cast(), len) };
        let b = map();
        let st = write_in(pid, &ram, &layer).expect("write in");
        assert_eq!(st.pages, PAGES / 2);
        for page in 0..PAGES {
            let want = if page % 2 == 1 { stamp(page) } else { 0 };
            // SAFETY: inside the `len` bytes mapped at `b`.
            let (first, last) = unsafe {
                (
                    *b.add((page * PAGE) as usize),
                    *b.add((page * PAGE + PAGE - 1) as usize),
                )
            };
            assert_eq!((first, last), (want, want), "page {page}");
        }
        // A flipped byte in the middle of the data fails the write-in as corrupt.
        let mut bad = std::fs::read(&layer).expect("read");
        let mid = bad.len() / 2;
        bad[mid] ^= 0x40;
        let bad_path = dir.path().join("bad");
        std::fs::write(&bad_path, &bad).expect("write");
        let e = write_in(pid, &ram, &bad_path).expect_err("corrupt layer accepted");
        assert!(format!("{e:#}").contains("corrupt"), "{e:#}");
        // SAFETY: unmapping what we mapped above.
        unsafe { libc::munmap(b.cast(), len) };
    }

    #[test]
    fn layer_roundtrip_on_own_process() {
        // A private mapping of a file in this very process stands in for QEMU's RAM: write
        // some pages, capture them, then check index, checksum and corruption detection.
        let dir = tempfile::tempdir().expect("tempdir");
        let (ram, file) = ram_file(dir.path(), 64);
        let len = (64 * PAGE) as usize;
        let p = map_private(&file, len).cast::<libc::c_void>();
        // SAFETY: `p` maps `len` bytes; we write inside pages 3, 4 and 10.
        unsafe {
            let b = p as *mut u8;
            *b.add(3 * PAGE as usize) = 7;
            *b.add(4 * PAGE as usize + 5) = 9;
            *b.add(10 * PAGE as usize) = 1;
        }
        let pid = std::process::id();
        let out = dir.path().join("l1");
        let st = capture(pid, &ram, &out, None).expect("capture");
        assert_eq!(st.pages, 3);
        assert_eq!(st.runs, 2);
        verify(&out).expect("verify");
        let idx = read_layer_index(&out).expect("index");
        assert_eq!(idx.runs, vec![(3, 2), (10, 1)]);
        // Unchanged pages are skipped against the previous hashes.
        let st2 = capture(pid, &ram, &dir.path().join("l2"), Some(&idx.page_hashes()))
            .expect("capture 2");
        assert_eq!(st2.pages, 0);
        assert_eq!(st2.skipped, 3);
        // Corrupt one data byte: verify must fail.
        let bytes = std::fs::read(&out).expect("read");
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n - 20] ^= 0xff;
        std::fs::write(dir.path().join("bad"), &bad).expect("write");
        assert!(verify(&dir.path().join("bad")).is_err());
        // SAFETY: unmapping what we mapped above.
        unsafe {
            libc::munmap(p, len);
        }
    }
}
