//! `cargo bench -p vmon-vm --bench layers`: a memory layer's capture and write-in alone, in
//! this process (a private mapping of a sparse RAM file stands in for QEMU's), for 64 and 256
//! MiB dirtied: medians of the time each takes, with the machine. The layer is written to the
//! directory `VMON_BENCH_DIR` names (default: a temp dir under /var/tmp), fsynced.

use std::fs::File;
use std::path::Path;
use std::time::Instant;

use vmon_vm::memory::{capture, write_in, PAGE};

const RUNS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A private read-write mapping of `file`, as QEMU maps RAM with `share=off`.
fn map_private(file: &File, len: usize) -> *mut u8 {
    use std::os::fd::AsRawFd;
    // SAFETY: a new mapping of a file this process owns; unmapped by the caller.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap");
    p.cast()
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cores} cores, {cpu}")
}

fn run(dir: &Path, dirty_mb: u64) -> (f64, f64) {
    let ram_pages = (dirty_mb + 64) * (1 << 20) / PAGE;
    let len = (ram_pages * PAGE) as usize;
    let ram = dir.join("mem0");
    File::create(&ram)
        .and_then(|f| f.set_len(ram_pages * PAGE))
        .expect("ram file");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&ram)
        .expect("open ram");
    let (mut caps, mut ins) = (Vec::new(), Vec::new());
    let pid = std::process::id();
    for run in 0..RUNS {
        let a = map_private(&file, len);
        let dirty = dirty_mb * (1 << 20) / PAGE;
        for page in 0..dirty {
            // SAFETY: inside the `len` bytes mapped at `a`.
            unsafe {
                std::ptr::write_bytes(
                    a.add((page * PAGE) as usize),
                    (page + run as u64) as u8 | 1,
                    PAGE as usize,
                )
            };
        }
        let layer = dir.join(format!("layer-{run}"));
        let t = Instant::now();
        capture(pid, &ram, &layer, None).expect("capture");
        caps.push(t.elapsed().as_secs_f64() * 1e3);
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(a.cast(), len) };
        let b = map_private(&file, len);
        let t = Instant::now();
        write_in(pid, &ram, &layer).expect("write in");
        ins.push(t.elapsed().as_secs_f64() * 1e3);
        // SAFETY: unmapping what was mapped above.
        unsafe { libc::munmap(b.cast(), len) };
        let _ = std::fs::remove_file(&layer);
    }
    (median(caps), median(ins))
}

fn main() {
    println!("machine: {}", machine());
    let base = std::env::var_os("VMON_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/var/tmp"));
    let dir = tempfile::tempdir_in(base).expect("temp dir");
    println!("| dirtied | capture (fsynced), median | write-in, median | n |");
    println!("|---|---|---|---|");
    for mb in [64u64, 256] {
        let (c, w) = run(dir.path(), mb);
        println!("| {mb} MiB | {c:.1} ms | {w:.1} ms | {RUNS} |");
    }
}
