//! Volumes in a sandbox: one virtiofsd per mounted volume, serving `<volumes dir>/<id>` to
//! that sandbox's QEMU over a vhost-user socket.
//!
//! virtiofsd (QEMU 7.2's, `/usr/lib/qemu/virtiofsd`) runs unprivileged: in a user namespace
//! that maps the guest's ids `0..65536` to the volume's own range of host ids
//! ([`super::volume_owner`]), as that namespace's root, so on the host it is the range's base
//! uid with no capability, and a file the guest creates as uid `n` is owned by `base + n`
//! (a guest's setuid-root file is setuid to an unprivileged id). It enters the sandbox's
//! cgroups before exec, so its CPU and memory count against the sandbox. Inside it sandboxes
//! itself: new mount, PID and network namespaces with the volume directory (bound over
//! [`MOUNT_POINT`] in a mount namespace the node's child makes as root before the switch: the
//! volumes directory stays root's 0700) `pivot_root`ed as its `/`, seccomp, and `mknod`
//! dropped. Each daemon serves one connection and exits when its QEMU does.

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use vmon_proto::node::{NodeError, VolumeShare};
use vmon_vm::FsShare;

use super::{valid_id, Node};

/// The most shares one sandbox gets (PCI slots 0x5..).
pub(super) const MAX_SHARES: usize = 8;

/// Where the daemons' sockets are made (short: `sun_path` is 108 bytes).
const SOCKET_DIR: &str = "/run/vmon/vfs";

/// The guest's tag of share `i`.
pub(super) fn tag(i: usize) -> String {
    format!("vol{i}")
}

/// The daemons of one boot, killed if the boot fails; once QEMU runs they end with it.
pub(super) struct ShareDaemons {
    children: Vec<tokio::process::Child>,
    pub shares: Vec<FsShare>,
}

impl ShareDaemons {
    pub(super) fn none() -> ShareDaemons {
        ShareDaemons {
            children: Vec::new(),
            shares: Vec::new(),
        }
    }

    /// Kills the daemons (a boot that failed before QEMU connected).
    pub(super) async fn kill(mut self) {
        self.unlink_sockets();
        for c in &mut self.children {
            let _ = c.kill().await;
        }
    }

    /// Removes the socket paths once QEMU has connected (each daemon takes one connection).
    pub(super) fn unlink_sockets(&self) {
        for s in &self.shares {
            let _ = std::fs::remove_file(&s.socket);
        }
    }

    /// Leaves the daemons to exit with their QEMU, reaped in the background.
    pub(super) fn detach(self) {
        self.unlink_sockets();
        for mut c in self.children {
            tokio::spawn(async move {
                let _ = c.wait().await;
            });
        }
    }
}

/// Checks what a start asks to mount before anything is spawned.
pub(super) fn validate(volumes_dir: &Path, shares: &[VolumeShare]) -> Result<(), NodeError> {
    if shares.len() > MAX_SHARES {
        return Err(NodeError::InvalidArgument(format!(
            "at most {MAX_SHARES} volumes per sandbox"
        )));
    }
    for s in shares {
        if !valid_id(&s.volume_id) {
            return Err(NodeError::InvalidArgument(format!(
                "{:?} is not a volume id",
                s.volume_id
            )));
        }
        if !s.path.starts_with('/') || s.path.len() > 1024 || s.path.contains('\0') {
            return Err(NodeError::InvalidArgument(format!(
                "volume path {:?} must be absolute",
                s.path
            )));
        }
        let dir = volumes_dir.join(&s.volume_id);
        match std::fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            _ => {
                return Err(NodeError::InvalidArgument(format!(
                    "volume {} has no directory on this node ({})",
                    s.volume_id,
                    dir.display()
                )))
            }
        }
    }
    Ok(())
}

/// The descriptor number a daemon gets its listening socket under (`--fd`).
const LISTEN_FD: i32 = 3;

/// Waits until the daemon `child` waits for its QEMU's connection (blocked in `accept` on its
/// socket: QEMU 7.2's virtiofsd accepts before it sandboxes itself), or fails with its log.
async fn accepting(
    child: &mut tokio::process::Child,
    log_path: &Path,
    volume: &str,
) -> anyhow::Result<()> {
    let pid = child.id().context("virtiofsd has no pid")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log_path).unwrap_or_default();
            bail!(
                "virtiofsd for volume {volume} exited ({status}): {}",
                log.chars().take(2000).collect::<String>()
            );
        }
        // The system call it is blocked in: its number first.
        let call = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
        let nr = call
            .split_whitespace()
            .next()
            .and_then(|n| n.parse::<i64>().ok());
        if nr == Some(libc::SYS_accept) || nr == Some(libc::SYS_accept4) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("virtiofsd for volume {volume} did not wait for its QEMU within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Where a daemon finds its volume: an empty directory the volume is bound over in the
/// daemon's own mount namespace (virtiofsd `pivot_root`s into its source, which must be a
/// mount, and reaches it as the unprivileged uid: every parent is passable by anyone).
pub(super) const MOUNT_POINT: &str = "/run/vmon/volume";
pub(super) const MOUNT_POINT_C: &std::ffi::CStr = c"/run/vmon/volume";

/// Makes [`MOUNT_POINT`] (root's, 0755, empty) and lets anyone pass `/run/vmon` (not list it).
pub(super) fn mount_point() -> std::io::Result<()> {
    let dir = Path::new(MOUNT_POINT);
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    if let Some(parent) = dir.parent() {
        let mode = std::fs::metadata(parent)?.permissions().mode();
        if mode & 0o001 == 0 {
            std::fs::set_permissions(
                parent,
                std::fs::Permissions::from_mode((mode & 0o7777) | 0o001),
            )?;
        }
    }
    Ok(())
}

/// A virtiofsd's open-file limit (the guest's open files and directories are its descriptors).
const NOFILE: libc::rlim_t = 65_536;

/// What a daemon needs from its sandbox: the cgroups its QEMU gets, and that QEMU's user (the
/// socket is handed to it).
pub(super) struct ShareContext<'a> {
    pub qemu_tag: &'a str,
    pub limits: vmon_vm::cgroup::Limits,
    pub user: Option<&'a vmon_vm::QemuUser>,
}

impl Node {
    /// Starts one virtiofsd per share and waits until each listens.
    pub(super) async fn start_share_daemons(
        &self,
        run_dir: &Path,
        shares: &[VolumeShare],
        ctx: &ShareContext<'_>,
    ) -> anyhow::Result<ShareDaemons> {
        let mut daemons = ShareDaemons::none();
        if shares.is_empty() {
            return Ok(daemons);
        }
        let groups = vmon_vm::cgroup::create(ctx.qemu_tag, &ctx.limits)
            .with_context(|| format!("cgroups for QEMU {}", ctx.qemu_tag))?;
        let procs: Vec<std::ffi::CString> = groups.map(|g| g.procs).unwrap_or_default();
        for (i, s) in shares.iter().enumerate() {
            match self.start_share_daemon(run_dir, i, s, ctx, &procs).await {
                Ok((child, share)) => {
                    daemons.children.push(child);
                    daemons.shares.push(share);
                }
                Err(e) => {
                    daemons.kill().await;
                    return Err(e);
                }
            }
        }
        Ok(daemons)
    }

    /// One volume's virtiofsd: in the volume's user namespace, its cgroups and a mount
    /// namespace where the volume is bound at [`MOUNT_POINT`], listening on a socket the node
    /// bound and handed to QEMU.
    async fn start_share_daemon(
        &self,
        run_dir: &Path,
        i: usize,
        s: &VolumeShare,
        ctx: &ShareContext<'_>,
        procs: &[std::ffi::CString],
    ) -> anyhow::Result<(tokio::process::Child, FsShare)> {
        let ns = self.volume_userns(&s.volume_id).await?;
        let (socket, listener) = bind_share_socket(i, ctx)?;
        let source: PathBuf = self.cfg.volumes_dir.join(&s.volume_id);
        let source_c = std::ffi::CString::new(source.as_os_str().as_encoded_bytes())
            .context("a volume path holds a NUL byte")?;
        mount_point()?;
        let log_path = run_dir.join(format!("virtiofsd{i}.log"));
        let mut cmd = self.virtiofsd_command(&log_path)?;
        let confined = Confined {
            procs: procs.to_vec(),
            ns_fd: ns.raw_fd(),
            listen_fd: listener.as_raw_fd(),
            nofile: nofile_limit()?,
            source: source_c,
            // A read-only bucket mount: the host's kernel refuses every write of the guest.
            read_only: s.bucket.as_ref().is_some_and(|b| b.read_only),
        };
        confined.enter_at_exec(&mut cmd);
        let spawned = cmd
            .spawn()
            .with_context(|| format!("starting {}", self.cfg.virtiofsd.display()));
        drop((ns, listener));
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_file(&socket);
                return Err(e);
            }
        };
        if let Err(e) = accepting(&mut child, &log_path, &s.volume_id).await {
            let _ = child.kill().await;
            let _ = std::fs::remove_file(&socket);
            return Err(e);
        }
        Ok((
            child,
            FsShare {
                socket,
                tag: tag(i),
            },
        ))
    }

    /// The user namespace of `volume`'s own id range (made on its first use).
    async fn volume_userns(&self, volume: &str) -> anyhow::Result<vmon_vm::userns::UserNs> {
        let (volumes_dir, volume, first) = (
            self.cfg.volumes_dir.clone(),
            volume.to_string(),
            self.cfg.volume_uid_base,
        );
        tokio::task::spawn_blocking(move || {
            let base = super::volume_owner::ensure_range(&volumes_dir, &volume, first)?;
            vmon_vm::userns::UserNs::new(base).context("making the volume daemon's user namespace")
        })
        .await?
    }

    /// virtiofsd's command line: the volume at [`MOUNT_POINT`], no caching, no locks, no
    /// device nodes, its output into `log_path`.
    fn virtiofsd_command(&self, log_path: &Path) -> anyhow::Result<tokio::process::Command> {
        let log = std::fs::File::create(log_path)?;
        let mut cmd = tokio::process::Command::new(&self.cfg.virtiofsd);
        cmd.arg(format!("--fd={LISTEN_FD}"))
            .arg("-o")
            // The volume, bound there in a mount namespace of its own before it left the
            // host's root behind: the volumes directory itself stays root's 0700.
            .arg(format!("source={MOUNT_POINT}"))
            // No guest-side caching: every sandbox mounting the volume at once, and the
            // content plane, see each write when it returns.
            .args(["-o", "cache=none", "-o", "sandbox=namespace"])
            .args([
                "-o",
                "no_posix_lock",
                "-o",
                "no_flock",
                "-o",
                "modcaps=-mknod",
            ])
            .args(["-o", "log_level=warn", "--rlimit-nofile=0"])
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Like QEMU, it outlives a restarting node (the sandbox is re-adopted).
            .process_group(0)
            .kill_on_drop(false);
        Ok(cmd)
    }
}

/// A share's socket under [`SOCKET_DIR`], bound by the node and handed to QEMU's user.
///
/// A socket path must fit sun_path (108 bytes): run dirs can be longer. The node binds it (the
/// daemon writes nothing on the host) and hands it to QEMU; the daemon gets the listening
/// descriptor and takes one connection (its QEMU's, at launch); the path is removed after it.
fn bind_share_socket(
    i: usize,
    ctx: &ShareContext<'_>,
) -> anyhow::Result<(PathBuf, std::os::unix::net::UnixListener)> {
    let sockets = Path::new(SOCKET_DIR);
    std::fs::create_dir_all(sockets)?;
    match ctx.user {
        Some(u) => vmon_vm::user::traverse_only(sockets, u.gid)?,
        None => std::fs::set_permissions(sockets, std::fs::Permissions::from_mode(0o700))?,
    }
    let socket = sockets.join(format!("{}-{i}.sock", crate::builds::new_id("")));
    let _ = std::fs::remove_file(&socket);
    let listener = std::os::unix::net::UnixListener::bind(&socket)
        .with_context(|| format!("binding {}", socket.display()))?;
    let handed = match ctx.user {
        Some(u) => u.hand(&socket),
        None => std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)),
    };
    if let Err(e) = handed {
        let _ = std::fs::remove_file(&socket);
        return Err(e).with_context(|| format!("handing {} to QEMU", socket.display()));
    }
    Ok((socket, listener))
}

/// The open-file limit for the daemon: lowered to [`NOFILE`] where the node may go higher;
/// never raised (that takes a capability the node may not have).
fn nofile_limit() -> anyhow::Result<libc::rlimit> {
    let mut cur = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut cur) } != 0 {
        return Err(std::io::Error::last_os_error()).context("reading RLIMIT_NOFILE");
    }
    let n = cur.rlim_max.min(NOFILE);
    Ok(libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    })
}

/// What the daemon enters between fork and exec, prepared before the fork.
struct Confined {
    /// Its QEMU's cgroups' `cgroup.procs` files.
    procs: Vec<std::ffi::CString>,
    /// The volume's user namespace.
    ns_fd: std::os::fd::RawFd,
    /// The bound socket, to become [`LISTEN_FD`].
    listen_fd: std::os::fd::RawFd,
    nofile: libc::rlimit,
    /// The volume's directory, bound at [`MOUNT_POINT`].
    source: std::ffi::CString,
    /// Bound read-only.
    read_only: bool,
}

impl Confined {
    fn enter_at_exec(self, cmd: &mut tokio::process::Command) {
        let Confined {
            procs,
            ns_fd,
            listen_fd,
            nofile,
            source,
            read_only,
        } = self;
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe system calls on values prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                vmon_vm::cgroup::enter(&procs)?;
                // Out of the way of the number the socket goes to (closed at exec).
                let ns_fd = libc::fcntl(ns_fd, libc::F_DUPFD_CLOEXEC, 200);
                if ns_fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The listening socket under the number the daemon is told, inheritable.
                let moved = if listen_fd == LISTEN_FD {
                    libc::fcntl(listen_fd, libc::F_SETFD, 0)
                } else {
                    libc::dup2(listen_fd, LISTEN_FD)
                };
                if moved < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::setrlimit(libc::RLIMIT_NOFILE, &nofile) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                vmon_vm::process::bind_in_own_mount_namespace(&source, MOUNT_POINT_C)?;
                if read_only {
                    vmon_vm::process::remount_read_only(MOUNT_POINT_C)?;
                }
                vmon_vm::userns::enter(ns_fd)
            });
        }
    }
}
