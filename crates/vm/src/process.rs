//! Starting, adopting and stopping one QEMU process.
//!
//! QEMU runs in its own process group (and, when given, inside the slot's network namespace),
//! so it outlives a node restart; the node finds it again by its pidfile and QMP socket. It runs
//! under a seccomp filter ([`crate::machine::SECCOMP`]) and in cgroups of its own
//! ([`crate::cgroup`]), which it enters before exec, and, given a [`QemuUser`], as that
//! unprivileged user (the switch happens in the child after the namespace and cgroups are
//! entered, before exec).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::cgroup;
use crate::machine::{FsShare, MachineDesc, NetDevice, Placement, RamSharing};
use crate::qmp::Qmp;
use crate::user::QemuUser;

/// The descriptor number a sealed RAM base is inherited under (`mem-path=/proc/self/fd/N`).
const RAM_FD: i32 = 100;
/// The descriptor number the guest's tap is inherited under (`-netdev tap,fd=N`).
pub const TAP_FD: i32 = 101;
/// QEMU's own directory, inherited when its QMP socket's path would not fit a socket address
/// (108 bytes with its NUL; long data dirs): QEMU binds `/proc/self/fd/102/qmp.sock`.
const DIR_FD: i32 = 102;
/// Longer socket paths go through [`DIR_FD`] (the client side does the same, `qmp.rs`).
const MAX_SOCKET_PATH: usize = 100;

/// `struct ifreq` as TUNSETIFF reads it: a name and the flags, padded to the union's size.
#[repr(C)]
struct TunRequest {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
/// A tap, without packet information, with virtio-net headers: what QEMU asks for when it
/// opens a tap by name, so a device state saved either way loads the other way.
const TAP_FLAGS: libc::c_short = 0x0002 | 0x1000 | 0x4000;

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
    /// Run as this user (None: as the node's own user). The caller has handed it the files it
    /// writes ([`QemuUser::hand`]); the run directory is handed here.
    pub user: Option<QemuUser>,
    /// The RAM base as a sealed memory file ([`crate::ram_base`]), mapped instead of opening
    /// `ram_file` (restores: `RamSharing::Private`).
    pub ram_fd: Option<Arc<OwnedFd>>,
    /// A private view of a directory: `(view, over)` bind-mounts `view` over `over` in a mount
    /// namespace of the QEMU's own, so that of the node's artifacts it sees only those linked
    /// into `view` (the caller links them, before launch or before naming them to QEMU).
    pub view: Option<(PathBuf, PathBuf)>,
    /// The CPU weight its cgroup starts with ([`cgroup::set_weight`]), from its first
    /// instruction on (QEMU's own start is CPU work too).
    pub weight: cgroup::Weight,
    /// PCI devices passed through by VFIO (cold boots of GPU sandboxes only): their
    /// `vfio-pci` devices, memory locked, `RLIMIT_MEMLOCK` raised ([`crate::vfio`]). The
    /// caller has given the QEMU user its groups' `/dev/vfio/<n>`.
    pub vfio: Vec<String>,
}

fn c_path(p: &Path) -> anyhow::Result<std::ffi::CString> {
    std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .with_context(|| format!("{} has a NUL byte", p.display()))
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

/// QEMU's own files (QMP socket, pidfile): a directory of the run directory that belongs to
/// the QEMU user, while the run directory itself (the node's records) stays root's.
pub fn qemu_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("qemu")
}

pub fn qmp_path(run_dir: &Path) -> PathBuf {
    qemu_dir(run_dir).join("qmp.sock")
}

pub fn pid_path(run_dir: &Path) -> PathBuf {
    qemu_dir(run_dir).join("qemu.pid")
}

/// Where a QEMU started by an older node (before [`qemu_dir`]) kept its pidfile and socket.
fn legacy_paths(run_dir: &Path) -> (PathBuf, PathBuf) {
    (run_dir.join("qemu.pid"), run_dir.join("qmp.sock"))
}

/// The pidfile and QMP socket of the QEMU recorded in `run_dir`, wherever it kept them.
fn recorded_paths(run_dir: &Path) -> (PathBuf, PathBuf) {
    let (pid, sock) = (pid_path(run_dir), qmp_path(run_dir));
    if pid.exists() {
        (pid, sock)
    } else {
        legacy_paths(run_dir)
    }
}

/// Where a QEMU's private view of the artifacts is made ([`LaunchSpec::view`]): links, owned
/// by the node, beside the QEMU's own directory.
pub fn view_dir(run_dir: &Path) -> PathBuf {
    run_dir.join("view")
}

/// Removes the QEMU's own files and its view from a run directory (after it ended).
pub fn clear_files(run_dir: &Path) {
    let _ = std::fs::remove_dir_all(qemu_dir(run_dir));
    let _ = std::fs::remove_dir_all(view_dir(run_dir));
    let (pid, sock) = legacy_paths(run_dir);
    let _ = std::fs::remove_file(pid);
    let _ = std::fs::remove_file(sock);
}

/// What the forked child does before exec, prepared before the fork: only values copied in
/// and async-signal-safe calls on them ([`ChildSetup::apply`]).
struct ChildSetup {
    /// The cgroups' `cgroup.procs` files to enter.
    procs: Vec<std::ffi::CString>,
    netns_fd: Option<i32>,
    view: Option<(std::ffi::CString, std::ffi::CString)>,
    ram_fd: Option<i32>,
    tap: Option<TunRequest>,
    /// QEMU's own directory, when its socket path is too long ([`DIR_FD`]).
    own_dir_fd: Option<i32>,
    user: Option<QemuUser>,
    supplementary: Vec<libc::gid_t>,
    die_with_node: bool,
    /// `RLIMIT_MEMLOCK` to set (bytes), for passed-through devices.
    memlock: Option<u64>,
}

impl ChildSetup {
    /// Runs in the forked child: cgroups, the slot's namespace, the private view, the
    /// inherited descriptors (RAM base, tap, own directory), the user, then the process flags.
    ///
    /// # Safety
    /// Only between fork and exec, where it makes async-signal-safe calls on its own fields.
    unsafe fn apply(&self) -> std::io::Result<()> {
        let fail = || Err(std::io::Error::last_os_error());
        // SAFETY: as the function says: the calls below are async-signal-safe and read only
        // this value's own fields.
        unsafe {
            cgroup::enter(&self.procs)?;
            if let Some(fd) = self.netns_fd {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return fail();
                }
            }
            if let Some((view, over)) = &self.view {
                // Its own mount namespace, where `over` shows only `view`'s entries.
                bind_in_own_mount_namespace(view, over)?;
            }
            if let Some(fd) = self.ram_fd {
                if fd == RAM_FD {
                    if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                        return fail();
                    }
                } else if libc::dup2(fd, RAM_FD) < 0 {
                    return fail();
                }
            }
            // After the RAM base: its descriptor may have had the tap's number.
            if let Some(req) = &self.tap {
                let fd = libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR);
                if fd < 0 {
                    return fail();
                }
                if libc::ioctl(fd, TUNSETIFF as _, req as *const TunRequest) != 0 {
                    return fail();
                }
                if fd != TAP_FD {
                    if libc::dup2(fd, TAP_FD) < 0 {
                        return fail();
                    }
                    libc::close(fd);
                }
            }
            // Last of the descriptors: its number is above every other's target.
            if let Some(fd) = self.own_dir_fd {
                if libc::dup2(fd, DIR_FD) < 0 {
                    return fail();
                }
            }
            // Before the uid switch: raising a limit takes CAP_SYS_RESOURCE.
            if let Some(bytes) = self.memlock {
                let lim = libc::rlimit {
                    rlim_cur: bytes,
                    rlim_max: bytes,
                };
                if libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) != 0 {
                    return fail();
                }
            }
            if let Some(u) = &self.user {
                // Groups first, then the gid, then the uid: each later step drops the right to
                // take the earlier one.
                if libc::setgroups(self.supplementary.len(), self.supplementary.as_ptr()) != 0
                    || libc::setgid(u.gid) != 0
                    || libc::setuid(u.uid) != 0
                {
                    return fail();
                }
                // What QEMU creates (pidfile, sockets) is its own alone.
                libc::umask(0o077);
            }
            // QEMU asks for huge pages on its translation cache and heap; a 2 MiB page zeroed on
            // first touch costs a restored VM CPU time and resident memory it mostly never uses.
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
            // After the uid switch, which clears it.
            if self.die_with_node {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            }
        }
        Ok(())
    }
}

/// Makes the run directory and QEMU's own directory in it, clears a previous QEMU's socket
/// and pidfile, and hands what QEMU writes to its user. Returns QEMU's directory.
fn prepare_run_dir(spec: &LaunchSpec) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(&spec.run_dir)?;
    let own = qemu_dir(&spec.run_dir);
    std::fs::create_dir_all(&own)?;
    let _ = std::fs::remove_file(qmp_path(&spec.run_dir));
    let _ = std::fs::remove_file(pid_path(&spec.run_dir));
    if let Some(u) = &spec.user {
        let handed = (|| {
            crate::user::traverse_only(&spec.run_dir, u.gid)?;
            u.hand_dir(&own)?;
            // Opened by path (append): it must exist and be the QEMU's.
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&spec.console_log)?;
            u.hand(&spec.console_log)
        })();
        handed.with_context(|| format!("handing {} to QEMU", spec.run_dir.display()))?;
    }
    Ok(own)
}

/// QEMU's directory as a descriptor numbered out of the way of the ones the child sets up,
/// when the QMP socket's path is too long for a socket address; None otherwise.
fn long_socket_dir(own: &Path, qmp_sock: &Path) -> anyhow::Result<Option<OwnedFd>> {
    if qmp_sock.as_os_str().len() <= MAX_SOCKET_PATH {
        return Ok(None);
    }
    let dir = std::fs::File::open(own)?;
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor we own returns a new one or -1.
    let fd = unsafe { libc::fcntl(dir.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 200) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("keeping QEMU's directory open");
    }
    // SAFETY: `fd` was just returned by fcntl and is owned by nothing else.
    Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The TUNSETIFF request for the guest's tap, opened in the child, as root, inside the slot's
/// namespace (so /dev/net/tun need not be open to QEMU's user).
fn tap_request(net: Option<&NetDevice>) -> anyhow::Result<Option<TunRequest>> {
    let Some(n) = net else {
        return Ok(None);
    };
    if n.tap.len() >= libc::IFNAMSIZ {
        bail!("tap name {:?} is too long", n.tap);
    }
    let mut req = TunRequest {
        name: [0; libc::IFNAMSIZ],
        flags: TAP_FLAGS,
        _pad: [0; 22],
    };
    for (d, b) in req.name.iter_mut().zip(n.tap.bytes()) {
        *d = b as libc::c_char;
    }
    Ok(Some(req))
}

/// Waits for QEMU's QMP socket, noticing an early exit (bad arguments, missing files); on
/// failure the QEMU is killed and its cgroups removed.
async fn wait_for_qmp(
    child: &mut tokio::process::Child,
    qmp_sock: &Path,
    stderr_path: &Path,
    tag: &str,
) -> anyhow::Result<Qmp> {
    let connect = Qmp::connect(qmp_sock, Duration::from_secs(30));
    tokio::pin!(connect);
    let qmp = tokio::select! {
        r = &mut connect => r.map_err(anyhow::Error::from),
        status = child.wait() => {
            let err = std::fs::read_to_string(stderr_path).unwrap_or_default();
            Err(anyhow::anyhow!(
                "QEMU exited at start ({}): {}",
                status.map(|s| s.to_string()).unwrap_or_default(),
                err.trim()
            ))
        }
    };
    if qmp.is_err() {
        let _ = child.start_kill();
        let _ = child.wait().await;
        cgroup::remove(tag);
    }
    qmp
}

impl Vm {
    /// Starts a QEMU as `spec` says: its directories, its arguments, the child's setup
    /// ([`ChildSetup`]), then the wait for its QMP socket.
    pub async fn launch(spec: &LaunchSpec) -> anyhow::Result<Vm> {
        let own = prepare_run_dir(spec)?;
        let qmp_sock = qmp_path(&spec.run_dir);
        let pidfile = pid_path(&spec.run_dir);
        let own_fd = long_socket_dir(&own, &qmp_sock)?;
        let qmp_arg = match own_fd {
            Some(_) => PathBuf::from(format!("/proc/self/fd/{DIR_FD}/qmp.sock")),
            None => qmp_sock.clone(),
        };
        let inherited_ram = spec
            .ram_fd
            .as_ref()
            .map(|_| PathBuf::from(format!("/proc/self/fd/{RAM_FD}")));
        let args = spec.machine.args(&Placement {
            tag: &spec.tag,
            ram_file: inherited_ram.as_deref().unwrap_or(&spec.ram_file),
            ram: spec.ram,
            disk: spec.disk.as_deref(),
            net: spec.net.as_ref(),
            console_log: &spec.console_log,
            qmp_socket: &qmp_arg,
            pidfile: &pidfile,
            incoming: spec.incoming,
            fs_shares: &spec.fs_shares,
        });
        let mut args = args;
        args.extend(crate::vfio::args(&spec.vfio)?);
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
        let limits = cgroup::Limits::for_guest(spec.machine.vcpus, spec.machine.memory_mb);
        let groups = cgroup::create(&spec.tag, &limits)
            .with_context(|| format!("cgroups for QEMU {}", spec.tag))?;
        if spec.weight != cgroup::Weight::Normal {
            if let Err(e) = cgroup::set_weight(&spec.tag, spec.weight) {
                tracing::debug!(tag = %spec.tag, "setting a QEMU's CPU weight: {e:#}");
            }
        }
        let view = match &spec.view {
            Some((view, over)) => Some((c_path(view)?, c_path(over)?)),
            None => None,
        };
        let setup = ChildSetup {
            procs: groups.map(|g| g.procs).unwrap_or_default(),
            netns_fd: netns.as_ref().map(|f| f.as_raw_fd()),
            view,
            ram_fd: spec.ram_fd.as_ref().map(|f| f.as_raw_fd()),
            tap: tap_request(spec.net.as_ref())?,
            own_dir_fd: own_fd.as_ref().map(|f| f.as_raw_fd()),
            supplementary: spec
                .user
                .as_ref()
                .map(|u| u.groups.clone())
                .unwrap_or_default(),
            user: spec.user.clone(),
            die_with_node: spec.die_with_node,
            memlock: (!spec.vfio.is_empty())
                .then(|| crate::vfio::memlock_bytes(spec.machine.memory_mb)),
        };
        let mut cmd = tokio::process::Command::new(&spec.machine.qemu_binary);
        // SAFETY: the closure runs in the forked child before exec; `apply` only makes
        // async-signal-safe system calls on values prepared before the fork.
        unsafe {
            cmd.pre_exec(move || setup.apply());
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
        let qmp = wait_for_qmp(&mut child, &qmp_sock, &stderr_path, &spec.tag).await?;
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
        let (pidfile, sock) = recorded_paths(run_dir);
        let text = std::fs::read_to_string(&pidfile)
            .with_context(|| format!("no pidfile in {}", run_dir.display()))?;
        let pid: u32 = text.trim().parse().context("pidfile is not a number")?;
        if !is_alive(pid) {
            bail!("QEMU {pid} is gone");
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
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
    let Ok(text) = std::fs::read_to_string(recorded_paths(run_dir).0) else {
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

/// In a forked child before exec: gives it a mount namespace of its own (nothing it mounts
/// propagates back) in which `over` shows `source`. Only async-signal-safe calls.
///
/// # Safety
/// Call only between fork and exec (`pre_exec`): it changes the calling process's namespaces.
pub unsafe fn bind_in_own_mount_namespace(
    source: &std::ffi::CStr,
    over: &std::ffi::CStr,
) -> std::io::Result<()> {
    use rustix::mount::{mount_bind, mount_change, MountPropagationFlags};
    use rustix::thread::{unshare_unsafe, UnshareFlags};
    // rustix's raw syscalls with `&CStr` paths allocate nothing: async-signal-safe.
    // SAFETY: a new mount namespace only; the descriptor table stays shared.
    unsafe { unshare_unsafe(UnshareFlags::NEWNS) }?;
    mount_change(
        c"/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )?;
    mount_bind(source, over)?;
    Ok(())
}

/// Makes the bind mount at `over` (made by [`bind_in_own_mount_namespace`]) read-only. A less
/// privileged mount namespace made from this one later cannot make it writable again.
///
/// Async-signal-safe (no allocation): for a child between fork and exec.
pub fn remount_read_only(over: &std::ffi::CStr) -> std::io::Result<()> {
    use rustix::mount::{mount_remount, MountFlags};
    mount_remount(over, MountFlags::BIND | MountFlags::RDONLY, c"")?;
    Ok(())
}
