//! A cgroup per QEMU process: a memory cap (guest RAM plus QEMU's own overhead), a CPU quota
//! of its vCPU count, and a cap on its threads, so one guest cannot take the host's memory,
//! CPUs or process table.
//!
//! cgroup v2 is used where `/sys/fs/cgroup` is the unified hierarchy (groups under
//! `/sys/fs/cgroup/vmon/`); otherwise the v1 `memory`, `cpu` and `pids` controllers, each with
//! groups under this process's own group in that controller (`<mount>/<own path>/vmon/`), so the
//! limits of whatever runs the node still apply. The process enters its groups itself, between
//! fork and exec, so it never runs unconfined.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{bail, Context};

/// Which cgroup hierarchy this host offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        })
    }
}

/// Where the groups of this host go: one parent directory per controller (one in all for v2).
#[derive(Debug, Clone)]
pub struct Layout {
    pub version: Version,
    /// (controller, parent directory of the per-VM groups).
    pub parents: Vec<(&'static str, PathBuf)>,
}

/// The caps of one QEMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    /// CPU time per 100 ms period, in microseconds.
    pub cpu_quota_us: u64,
    pub pids: u64,
}

/// The CPU accounting period the quota is a share of.
pub const CPU_PERIOD_US: u64 = 100_000;

/// Node-wide settings: whether to confine, and QEMU's measured overhead above guest RAM.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub enabled: bool,
    /// Memory QEMU itself uses beyond the guest's RAM (TCG translation cache, heap, device
    /// buffers): measured at ~50 MiB PSS for an idle TCG guest; the cap leaves room above it.
    pub overhead_mib: u64,
    /// Threads per QEMU (vCPU threads, the I/O thread, the worker pool).
    pub pids: u64,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            enabled: true,
            overhead_mib: 256,
            pids: 512,
        }
    }
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Sets the node-wide settings (first call wins; later launches use them).
pub fn configure(s: Settings) {
    let _ = SETTINGS.set(s);
}

pub fn settings() -> Settings {
    SETTINGS.get().copied().unwrap_or_default()
}

impl Limits {
    /// The caps for a guest of `vcpus` and `memory_mb`.
    ///
    /// Memory: twice the guest's RAM plus QEMU's overhead. A restored guest's RAM is a private
    /// mapping of its base's sealed memory file, which keeps the base's zero pages as holes;
    /// the first process on a node to touch a hole (a guest writing fresh memory, or a live
    /// migration's target loading every page) allocates that page of the shared file, and the
    /// kernel charges it to that process's group, beside the private copy it then writes. A cap
    /// of RAM plus overhead killed the first migration target on a node (its load touches
    /// every page); the shared pages are one copy per node, not per guest.
    pub fn for_guest(vcpus: u32, memory_mb: u32) -> Limits {
        let s = settings();
        Limits {
            memory_bytes: (2 * u64::from(memory_mb) + s.overhead_mib) * 1024 * 1024,
            cpu_quota_us: u64::from(vcpus.max(1)) * CPU_PERIOD_US,
            pids: s.pids,
        }
    }
}

/// This process's path in the v1 hierarchy of `controller` (from /proc/self/cgroup).
fn own_v1_path(controller: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        ctrls
            .split(',')
            .any(|c| c == controller)
            .then(|| path.to_string())
    })
}

/// The hierarchy this host offers, or why none can be used.
pub fn detect() -> anyhow::Result<Layout> {
    let root = Path::new("/sys/fs/cgroup");
    if let Ok(ctrls) = std::fs::read_to_string(root.join("cgroup.controllers")) {
        for c in ["memory", "cpu", "pids"] {
            if !ctrls.split_whitespace().any(|x| x == c) {
                bail!("cgroup v2 is mounted but lacks the {c} controller");
            }
        }
        return Ok(Layout {
            version: Version::V2,
            parents: vec![("unified", root.join("vmon"))],
        });
    }
    let mut parents = Vec::new();
    for c in ["memory", "cpu", "pids"] {
        let mount = root.join(c);
        if !mount.join("cgroup.procs").exists() {
            bail!(
                "no cgroup v2 and no v1 {c} controller at {}",
                mount.display()
            );
        }
        let own = own_v1_path(c).unwrap_or_else(|| "/".into());
        parents.push((c, mount.join(own.trim_start_matches('/')).join("vmon")));
    }
    Ok(Layout {
        version: Version::V1,
        parents,
    })
}

fn layout() -> Option<&'static Layout> {
    static L: OnceLock<Option<Layout>> = OnceLock::new();
    L.get_or_init(|| match detect() {
        Ok(l) => {
            sweep_in(&l);
            Some(l)
        }
        Err(e) => {
            tracing::warn!("QEMU processes run without cgroup limits: {e:#}");
            None
        }
    })
    .as_ref()
}

fn write(path: &Path, value: &str) -> anyhow::Result<()> {
    std::fs::write(path, value).with_context(|| format!("writing {value:?} to {}", path.display()))
}

/// The groups made for one QEMU: the `cgroup.procs` files its child writes itself into.
#[derive(Debug)]
pub struct Groups {
    pub dirs: Vec<PathBuf>,
    pub procs: Vec<CString>,
}

/// Makes the groups of the QEMU tagged `tag` with `limits`. None when confinement is off or the
/// host has no usable hierarchy (said once in the log, and by `vmon doctor`).
pub fn create(tag: &str, limits: &Limits) -> anyhow::Result<Option<Groups>> {
    if !settings().enabled {
        return Ok(None);
    }
    let Some(layout) = layout() else {
        return Ok(None);
    };
    let mut dirs = Vec::new();
    for (controller, parent) in &layout.parents {
        if !parent.exists() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("making {}", parent.display()))?;
            if layout.version == Version::V2 {
                write(
                    &parent
                        .parent()
                        .unwrap_or(Path::new("/sys/fs/cgroup"))
                        .join("cgroup.subtree_control"),
                    "+memory +cpu +pids",
                )?;
                write(&parent.join("cgroup.subtree_control"), "+memory +cpu +pids")?;
            }
        }
        let dir = parent.join(tag);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("making {}", dir.display())),
        }
        match (layout.version, *controller) {
            (Version::V2, _) => {
                write(&dir.join("memory.max"), &limits.memory_bytes.to_string())?;
                write(&dir.join("memory.swap.max"), "0").ok();
                write(
                    &dir.join("cpu.max"),
                    &format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us),
                )?;
                write(&dir.join("pids.max"), &limits.pids.to_string())?;
            }
            (Version::V1, "memory") => {
                write(
                    &dir.join("memory.limit_in_bytes"),
                    &limits.memory_bytes.to_string(),
                )?;
            }
            (Version::V1, "cpu") => {
                write(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                write(
                    &dir.join("cpu.cfs_quota_us"),
                    &limits.cpu_quota_us.to_string(),
                )?;
            }
            (Version::V1, _) => {
                write(&dir.join("pids.max"), &limits.pids.to_string())?;
            }
        }
        dirs.push(dir);
    }
    let procs = dirs
        .iter()
        .map(|d| {
            CString::new(d.join("cgroup.procs").as_os_str().as_encoded_bytes())
                .context("cgroup path holds a NUL byte")
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Some(Groups { dirs, procs }))
}

/// The CPU weight of a QEMU's group relative to its siblings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weight {
    /// A sandbox's guest, or a process a waiting create will get.
    Normal,
    /// A pool refill made ahead of demand: it yields the CPU to sandboxes and waiting creates.
    Background,
}

/// Sets the CPU weight of the QEMU tagged `tag` (`cpu.shares` in v1, `cpu.weight` in v2). Its
/// quota is unchanged: the weight only orders it behind its siblings when the CPUs are busy.
/// A host without groups has nothing to set.
pub fn set_weight(tag: &str, weight: Weight) -> anyhow::Result<()> {
    let Some(layout) = layout() else {
        return Ok(());
    };
    if !settings().enabled {
        return Ok(());
    }
    for (controller, parent) in &layout.parents {
        let dir = parent.join(tag);
        match (layout.version, *controller) {
            (Version::V2, _) => {
                let w = if weight == Weight::Normal { "100" } else { "5" };
                write(&dir.join("cpu.weight"), w)?;
            }
            (Version::V1, "cpu") => {
                let w = if weight == Weight::Normal {
                    "1024"
                } else {
                    "32"
                };
                write(&dir.join("cpu.shares"), w)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Removes the groups of `tag` once its QEMU has exited. What is still in them belongs to that
/// sandbox alone (its volumes' daemons, which end with their QEMU's connection anyway) and is
/// killed first, so the groups go with the sandbox. Errors are ignored: a group still in use
/// stays, and the next node start's sweep takes it.
pub fn remove(tag: &str) {
    let Some(layout) = layout() else { return };
    for (_, parent) in &layout.parents {
        let dir = parent.join(tag);
        if std::fs::remove_dir(&dir).is_ok() {
            continue;
        }
        let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
            continue;
        };
        let members: Vec<u32> = procs
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect();
        if members.is_empty() {
            continue;
        }
        for pid in members {
            crate::process::signal(pid, libc::SIGKILL);
        }
        // Killed processes leave their group within milliseconds; bounded at 0.5 s.
        for _ in 0..50 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            if std::fs::remove_dir(&dir).is_ok() {
                break;
            }
        }
    }
}

/// Removes every empty group of a QEMU that is gone (a node restart, a kill -9, a guest that
/// powered off). Runs once per process, at its first launch.
fn sweep_in(layout: &Layout) {
    for (_, parent) in &layout.parents {
        let Ok(entries) = std::fs::read_dir(parent) else {
            continue;
        };
        for e in entries.flatten() {
            // A group made in the last minute may belong to another node's launch whose child
            // has not entered it yet. rmdir fails on a group with processes in it: exactly the
            // ones to keep.
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > std::time::Duration::from_secs(60));
            if old && e.path().is_dir() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
    }
}

/// In the child between fork and exec: enters the groups (writing "0" to `cgroup.procs` moves
/// the writer). Only async-signal-safe calls on memory prepared before the fork.
///
/// # Safety
/// Call only in a freshly forked child (a `pre_exec` closure).
pub unsafe fn enter(procs: &[CString]) -> std::io::Result<()> {
    for p in procs {
        // SAFETY: `p` is a valid NUL-terminated path made before the fork; open, write and
        // close are async-signal-safe.
        unsafe {
            let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let n = libc::write(fd, b"0".as_ptr().cast(), 1);
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            if n != 1 {
                return Err(err);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_guest() {
        let l = Limits::for_guest(2, 512);
        assert_eq!(l.cpu_quota_us, 200_000);
        assert_eq!(
            l.memory_bytes,
            (2 * 512 + settings().overhead_mib) * 1024 * 1024
        );
        assert!(l.pids >= 64);
        assert_eq!(Limits::for_guest(0, 128).cpu_quota_us, CPU_PERIOD_US);
    }

    #[test]
    fn this_host_has_a_hierarchy() {
        // Every machine vmon runs on has cgroups; which version is the host's business.
        let l = detect().expect("a usable cgroup hierarchy");
        assert!(!l.parents.is_empty());
        for (_, p) in &l.parents {
            assert!(p.ends_with("vmon"), "{}", p.display());
        }
    }
}
