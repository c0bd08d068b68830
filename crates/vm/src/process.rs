//! Starting, adopting and stopping one QEMU process.
//!
//! QEMU runs in its own process group (and, when given, inside the slot's network namespace),
//! so it outlives a node restart; the node finds it again by its pidfile and QMP socket. It runs
//! under a seccomp filter ([`crate::machine::SECCOMP`]) and in cgroups of its own
//! ([`crate::cgroup`]), which it enters before exec.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::cgroup;
use crate::machine::{FsShare, MachineDesc, NetDevice, Placement, RamSharing};
use crate::qmp::Qmp;

/// Where and how to run one QEMU.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Unique per process (see [`crate::machine::Placement::tag`]).
    pub tag: String,
    pub machine: MachineDesc,
    /// Directory holding `qmp.sock`, `qemu.pid`, `qemu.stderr`.
    pub run_dir: PathBuf,
    pub console_log: PathBuf,
    pub ram_file: PathBuf,
    pub ram: RamSharing,
    /// None: started without a disk, attached later ([`crate::machine::disk_attach`]).
    pub disk: Option<PathBuf>,
    pub net: Option<NetDevice>,
    pub netns: Option<String>,
    pub incoming: bool,
    /// Killed when the node process ends (a template build is worthless without its node; a
    /// sandbox outlives it and is re-adopted).
    pub die_with_node: bool,
    /// virtio-fs shares (cold boots only; their daemons must already listen).
    pub fs_shares: Vec<FsShare>,
}

/// A running QEMU and its QMP connection.
pub struct Vm {
    pub pid: u32,
    pub qmp: Qmp,
    pub run_dir: PathBuf,
    /// The process's tag (and its cgroups' name).
    tag: String,
    child: Option<tokio::process::Child>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm").field("pid", &self.pid).finish()
    }
}

pub fn qmp_path(run_dir: &Path) -> PathBuf {
    run_dir.join("qmp.sock")
}

pub fn pid_path(run_dir: &Path) -> PathBuf {
    run_dir.join("qemu.pid")
}

impl Vm {
    pub async fn launch(spec: &LaunchSpec) -> anyhow::Result<Vm> {
        std::fs::create_dir_all(&spec.run_dir)?;
        let qmp_sock = qmp_path(&spec.run_dir);
        let pidfile = pid_path(&spec.run_dir);
        let _ = std::fs::remove_file(&qmp_sock);
        let _ = std::fs::remove_file(&pidfile);
        let args = spec.machine.args(&Placement {
            tag: &spec.tag,
            ram_file: &spec.ram_file,
            ram: spec.ram,
            disk: spec.disk.as_deref(),
            net: spec.net.as_ref(),
            console_log: &spec.console_log,
            qmp_socket: &qmp_sock,
            pidfile: &pidfile,
            incoming: spec.incoming,
            fs_shares: &spec.fs_shares,
        });
        let stderr_path = spec.run_dir.join("qemu.stderr");
        let stderr = std::fs::File::create(&stderr_path)?;
        // Entered by setns(2) in the child rather than through `ip netns exec`: one exec less
        // and no remount of /sys per VM.
        let netns = match &spec.netns {
            Some(ns) => Some(
                std::fs::File::open(Path::new("/run/netns").join(ns))
                    .with_context(|| format!("network namespace {ns} is missing"))?,
            ),
            None => None,
        };
        let netns_fd = netns.as_ref().map(|f| f.as_raw_fd());
        let die_with_node = spec.die_with_node;
        let limits = cgroup::Limits::for_guest(spec.machine.vcpus, spec.machine.memory_mb);
        let groups = cgroup::create(&spec.tag, &limits)
            .with_context(|| format!("cgroups for QEMU {}", spec.tag))?;
        let procs: Vec<std::ffi::CString> = groups.map(|g| g.procs).unwrap_or_default();
        let mut cmd = tokio::process::Command::new(&spec.machine.qemu_binary);
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls on values captured by copy or prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                cgroup::enter(&procs)?;
                if let Some(fd) = netns_fd {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // QEMU asks for huge pages on its translation cache and heap; a 2 MiB page
                // zeroed on first touch costs a restored VM CPU time and resident memory it
                // mostly never uses.
                libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
                if die_with_node {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                }
                Ok(())
            });
        }
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                cgroup::remove(&spec.tag);
                return Err(e)
                    .with_context(|| format!("starting {}", spec.machine.qemu_binary.display()));
            }
        };
        let pid = child.id().unwrap_or(0);
        // Wait for the QMP socket, but notice an early exit (bad arguments, missing files).
        let connect = Qmp::connect(&qmp_sock, Duration::from_secs(30));
        tokio::pin!(connect);
        let qmp = tokio::select! {
            r = &mut connect => r.map_err(anyhow::Error::from),
            status = child.wait() => {
                let err = std::fs::read_to_string(&stderr_path).unwrap_or_default();
                Err(anyhow::anyhow!(
                    "QEMU exited at start ({}): {}",
                    status.map(|s| s.to_string()).unwrap_or_default(),
                    err.trim()
                ))
            }
        };
        let qmp = match qmp {
            Ok(q) => q,
            Err(e) => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                cgroup::remove(&spec.tag);
                return Err(e);
            }
        };
        Ok(Vm {
            pid,
            qmp,
            run_dir: spec.run_dir.clone(),
            tag: spec.tag.clone(),
            child: Some(child),
        })
    }

    /// Re-attaches to a QEMU that a previous node process started.
    pub async fn adopt(run_dir: &Path, tag: &str) -> anyhow::Result<Vm> {
        let text = std::fs::read_to_string(pid_path(run_dir))
            .with_context(|| format!("no pidfile in {}", run_dir.display()))?;
        let pid: u32 = text.trim().parse().context("pidfile is not a number")?;
        if !is_alive(pid) {
            bail!("QEMU {pid} is gone");
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let sock = qmp_path(run_dir);
        if !is_tagged(&cmdline, tag) {
            bail!("process {pid} is not the QEMU of {}", run_dir.display());
        }
        let qmp = Qmp::connect(&sock, Duration::from_secs(5)).await?;
        Ok(Vm {
            pid,
            qmp,
            run_dir: run_dir.to_path_buf(),
            tag: tag.to_string(),
            child: None,
        })
    }

    /// Waits up to `timeout` for the process to end; true when it did.
    pub async fn wait_exit(&mut self, timeout: Duration) -> bool {
        if let Some(child) = self.child.as_mut() {
            return tokio::time::timeout(timeout, child.wait()).await.is_ok();
        }
        let start = tokio::time::Instant::now();
        while start.elapsed() < timeout {
            if !is_alive(self.pid) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        !is_alive(self.pid)
    }

    /// Asks QEMU to quit; kills it if it does not within a few seconds.
    pub async fn quit(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.qmp.quit()).await;
        if !self.wait_exit(Duration::from_secs(5)).await {
            self.kill().await;
        }
        cgroup::remove(&self.tag);
    }

    /// SIGKILL, then reap.
    pub async fn kill(&mut self) {
        signal(self.pid, libc::SIGKILL);
        if self.wait_exit(Duration::from_secs(10)).await {
            cgroup::remove(&self.tag);
        }
    }
}

/// True while `pid` exists and is not a zombie.
pub fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            // The state follows the parenthesised command name.
            let state = s
                .rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next());
            !matches!(state, Some('Z') | Some('X') | None)
        }
        Err(_) => false,
    }
}

/// Sends `sig` to `pid` (errors are ignored: the process may be gone already).
pub fn signal(pid: u32, sig: i32) {
    let Ok(pid) = i32::try_from(pid) else { return };
    if pid <= 1 {
        return;
    }
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    unsafe {
        libc::kill(pid, sig);
    }
}

fn is_tagged(cmdline: &[u8], tag: &str) -> bool {
    let want = format!("vmon-{tag}");
    cmdline.split(|&b| b == 0).any(|w| w == want.as_bytes())
}

/// Kills the QEMU recorded in `run_dir` if it is still alive and carries `tag`; returns
/// whether one was killed.
pub fn kill_recorded(run_dir: &Path, tag: &str) -> bool {
    let Ok(text) = std::fs::read_to_string(pid_path(run_dir)) else {
        return false;
    };
    let Ok(pid) = text.trim().parse::<u32>() else {
        return false;
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if is_alive(pid) && is_tagged(&cmdline, tag) {
        signal(pid, libc::SIGKILL);
        for _ in 0..200 {
            if !is_alive(pid) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        cgroup::remove(tag);
        return true;
    }
    false
}
