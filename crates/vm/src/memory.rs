//! Memory layers: the guest RAM pages a sandbox wrote since its restore, captured from outside
//! the QEMU process, and written back into a fresh one.
//!
//! Every guest's RAM is a file mapping (`memory-backend-file`). A restored guest maps its
//! build's `mem0` privately: pages it writes become anonymous copy-on-write pages, which the
//! kernel's pagemap shows as present and not file-backed. Those pages, read through
//! `/proc/PID/mem`, are the layer. A restore writes each layer into the new process's mapping at
//! the same offsets before the device state is loaded.
//!
//! Layer file (version 2): a 32-byte header (magic, page size, run count, page count, index
//! offset) padded to one page, the pages (page-aligned), the index: the runs `(first page, page
//! count)` and one xxh3 hash per page (so the next capture can skip pages that did not change),
//! then an xxh3 checksum of the pages, the index and the header, in that order. The index comes
//! after the pages so a capture writes each page once, straight into the layer, while the disk
//! already writes back what came before. Version 1 layers (header, index, pages, checksum of the
//! file in order) are still read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{bail, Context};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

pub const PAGE: u64 = 4096;
const MAGIC_V1: &[u8; 8] = b"VMONLAY1";
const MAGIC: &[u8; 8] = b"VMONLAY2";
/// A version 2 layer's header bytes; its pages start at [`PAGE`].
const HEADER_V2: u64 = 32;
/// A capture asks the kernel to start writing back every this many bytes it wrote.
const WRITEBACK_STEP: u64 = 32 << 20;
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
/// (a full disk) leaves no `out` behind.
pub fn capture(
    pid: u32,
    ram_file: &Path,
    out: &Path,
    previous: Option<&PageHashes>,
) -> anyhow::Result<LayerStats> {
    let captured = capture_into(pid, ram_file, out, previous);
    if captured.is_err() {
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
    let file = File::create(out)?;
    // The pages go straight to their place after the header's page; the index follows them.
    let mut w = LayerWriter::new(&file, PAGE);
    let mut kept_runs: Vec<(u64, u64)> = Vec::new();
    let mut hashes: Vec<u64> = Vec::new();
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
                w.write(page)?;
            }
            done += n;
        }
    }
    let index_offset = w.offset();
    for &(s, c) in &kept_runs {
        w.write(&s.to_le_bytes())?;
        w.write(&c.to_le_bytes())?;
    }
    for h in &hashes {
        w.write(&h.to_le_bytes())?;
    }
    let mut header = [0u8; HEADER_V2 as usize];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&(PAGE as u32).to_le_bytes());
    header[12..16].copy_from_slice(&(kept_runs.len() as u32).to_le_bytes());
    header[16..24].copy_from_slice(&(hashes.len() as u64).to_le_bytes());
    header[24..32].copy_from_slice(&index_offset.to_le_bytes());
    w.finish(&header)?;
    file.write_all_at(&header, 0)?;
    file.sync_all()?;
    stats.pages = hashes.len() as u64;
    stats.runs = kept_runs.len() as u64;
    stats.bytes = stats.pages * PAGE;
    Ok(stats)
}

/// Writes a layer's body sequentially from an offset, checksumming it, and has the kernel start
/// writing back each [`WRITEBACK_STEP`] once it is complete, so the disk works while the capture
/// still reads the guest (the final `fsync` then waits only for the tail).
struct LayerWriter<'a> {
    file: &'a File,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    at: u64,
    /// Up to here writeback has been started.
    started: u64,
    hasher: Xxh3,
}

impl<'a> LayerWriter<'a> {
    fn new(file: &'a File, at: u64) -> Self {
        LayerWriter {
            file,
            buf: Vec::with_capacity(1 << 20),
            at,
            started: at,
            hasher: Xxh3::new(),
        }
    }

    /// The file offset the next byte goes to.
    fn offset(&self) -> u64 {
        self.at + self.buf.len() as u64
    }

    fn write(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.hasher.update(bytes);
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= 1 << 20 {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        self.file.write_all_at(&self.buf, self.at)?;
        self.at += self.buf.len() as u64;
        self.buf.clear();
        if self.at - self.started >= WRITEBACK_STEP {
            start_writeback(self.file, self.started, self.at - self.started);
            self.started = self.at;
        }
        Ok(())
    }

    /// Writes what is buffered and the checksum (over the body, then `header`) after it.
    fn finish(mut self, header: &[u8]) -> anyhow::Result<()> {
        self.hasher.update(header);
        let sum = self.hasher.digest();
        self.buf.extend_from_slice(&sum.to_le_bytes());
        self.flush()
    }
}

/// Asks the kernel to start writing `len` bytes at `offset` of `file` back to its device,
/// without waiting. Only a hint: a failure changes nothing but the timing.
fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: a plain syscall on a descriptor `file` owns; no memory is passed.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), off, n, libc::SYNC_FILE_RANGE_WRITE);
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
    let mut hdr = [0u8; HEADER_V2 as usize];
    f.read_exact_at(&mut hdr[..24], 0).context("layer header")?;
    let version = match &hdr[..8] {
        m if m == MAGIC => 2,
        m if m == MAGIC_V1 => 1,
        _ => bail!("not a vmon memory layer (bad magic)"),
    };
    let word = |b: &[u8]| {
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        u64::from_le_bytes(a)
    };
    let page = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as u64;
    let nruns = u32::from_le_bytes([hdr[12], hdr[13], hdr[14], hdr[15]]) as u64;
    let npages = word(&hdr[16..24]);
    if page != PAGE {
        bail!("layer page size {page} is not {PAGE}");
    }
    let index_len = nruns
        .checked_mul(16)
        .and_then(|r| npages.checked_mul(8).and_then(|h| r.checked_add(h)));
    let data_len = npages.checked_mul(PAGE);
    let (Some(index_len), Some(data_len)) = (index_len, data_len) else {
        bail!("layer header counts overflow");
    };
    let (data_offset, index_offset) = if version == 1 {
        (24 + index_len, 24)
    } else {
        f.read_exact_at(&mut hdr[24..], 24)
            .context("layer header")?;
        (PAGE, word(&hdr[24..32]))
    };
    let expected = if version == 1 {
        data_offset.checked_add(data_len)
    } else if index_offset != PAGE.saturating_add(data_len) {
        bail!("layer index offset {index_offset} does not follow its pages");
    } else {
        index_offset.checked_add(index_len)
    };
    if expected.and_then(|e| e.checked_add(8)) != Some(len) {
        bail!("layer is truncated or has trailing bytes");
    }
    let mut idx = vec![0u8; index_len as usize];
    f.read_exact_at(&mut idx, index_offset)?;
    let mut runs = Vec::with_capacity(nruns as usize);
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
    let mut magic = [0u8; 8];
    f.read_exact_at(&mut magic, 0)?;
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    // Version 2 sums the body first and its header last (the header is written last).
    let body = if &magic == MAGIC { PAGE } else { 0 };
    if body > len - 8 {
        bail!("memory layer {} is truncated", path.display());
    }
    let mut off = body;
    while off < len - 8 {
        let n = ((len - 8 - off) as usize).min(buf.len());
        f.read_exact_at(&mut buf[..n], off)?;
        h.update(&buf[..n]);
        off += n as u64;
    }
    if body > 0 {
        let mut header = [0u8; HEADER_V2 as usize];
        f.read_exact_at(&mut header, 0)?;
        h.update(&header);
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
    fn a_version_1_layer_still_goes_in() {
        // Layers written before version 2 (paused sandboxes on an upgraded node): header,
        // index, pages, checksum over the file in order.
        let dir = tempfile::tempdir().expect("tempdir");
        let (ram, file) = ram_file(dir.path(), 16);
        let pages: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i + 1; PAGE as usize]).collect();
        let runs: [(u64, u64); 2] = [(2, 2), (9, 1)];
        let mut bytes = Vec::new();
        bytes.extend_from_slice(MAGIC_V1);
        bytes.extend_from_slice(&(PAGE as u32).to_le_bytes());
        bytes.extend_from_slice(&(runs.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(pages.len() as u64).to_le_bytes());
        for (s, c) in runs {
            bytes.extend_from_slice(&s.to_le_bytes());
            bytes.extend_from_slice(&c.to_le_bytes());
        }
        for p in &pages {
            bytes.extend_from_slice(&xxh3_64(p).to_le_bytes());
        }
        for p in &pages {
            bytes.extend_from_slice(p);
        }
        let sum = xxh3_64(&bytes);
        bytes.extend_from_slice(&sum.to_le_bytes());
        let layer = dir.path().join("v1");
        std::fs::write(&layer, &bytes).expect("write");
        verify(&layer).expect("a version 1 layer verifies");
        let idx = read_layer_index(&layer).expect("index");
        assert_eq!(idx.runs, runs.to_vec());
        let len = (16 * PAGE) as usize;
        let m = map_private(&file, len);
        write_in(std::process::id(), &ram, &layer).expect("write in");
        for (page, want) in [(2u64, 1u8), (3, 2), (9, 3), (4, 0)] {
            // SAFETY: inside the `len` bytes mapped at `m`.
            let got = unsafe { *m.add((page * PAGE + 17) as usize) };
            assert_eq!(got, want, "page {page}");
        }
        // SAFETY: unmapping what we mapped above.
        unsafe { libc::munmap(m.cast(), len) };
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
        assert_eq!(idx.data_offset, PAGE, "the pages start page-aligned");
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
        // A header that disagrees with the file (one run more) is refused before any page.
        let mut bad = bytes.clone();
        bad[12] ^= 1;
        std::fs::write(dir.path().join("bad-hdr"), &bad).expect("write");
        assert!(read_layer_index(&dir.path().join("bad-hdr")).is_err());
        assert!(verify(&dir.path().join("bad-hdr")).is_err());
        // SAFETY: unmapping what we mapped above.
        unsafe {
            libc::munmap(p, len);
        }
    }
}
