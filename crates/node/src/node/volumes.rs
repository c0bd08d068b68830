//! Volumes in a sandbox: one virtiofsd per mounted volume, serving `<volumes dir>/<id>` to
//! that sandbox's QEMU over a vhost-user socket in the execution's run directory.
//!
//! virtiofsd (QEMU 7.2's, `/usr/lib/qemu/virtiofsd`) runs as root but in a sandbox of its own:
//! new mount, PID and network namespaces with the volume directory `pivot_root`ed as its `/`,
//! seccomp, and `mknod` dropped from its capabilities. A guest reaches the host's files only
//! through FUSE requests that daemon serves inside that root, and no network at all. Each
//! daemon serves one connection and exits when its QEMU does.

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

impl Node {
    /// Starts one virtiofsd per share and waits until each listens.
    pub(super) async fn start_share_daemons(
        &self,
        run_dir: &Path,
        shares: &[VolumeShare],
        user: Option<&vmon_vm::QemuUser>,
    ) -> anyhow::Result<ShareDaemons> {
        let mut daemons = ShareDaemons::none();
        for (i, s) in shares.iter().enumerate() {
            // A socket path must fit sun_path (108 bytes): run dirs can be longer. The daemon
            // takes one connection (its QEMU's, at launch); the path is removed after it.
            let sockets = Path::new(SOCKET_DIR);
            std::fs::create_dir_all(sockets)?;
            match user {
                // QEMUs pass through to their own socket only.
                Some(u) => vmon_vm::user::traverse_only(sockets, u.gid)?,
                None => std::fs::set_permissions(sockets, std::fs::Permissions::from_mode(0o700))?,
            }
            let socket = sockets.join(format!("{}-{i}.sock", crate::builds::new_id("")));
            let _ = std::fs::remove_file(&socket);
            let source: PathBuf = self.cfg.volumes_dir.join(&s.volume_id);
            let log = std::fs::File::create(run_dir.join(format!("virtiofsd{i}.log")))?;
            let spawned = tokio::process::Command::new(&self.cfg.virtiofsd)
                .arg(format!("--socket-path={}", socket.display()))
                .arg("-o")
                .arg(format!("source={}", source.display()))
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
                .args(["-o", "log_level=warn"])
                .stdin(std::process::Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                // Like QEMU, it outlives a restarting node (the sandbox is re-adopted).
                .process_group(0)
                .kill_on_drop(false)
                .spawn()
                .with_context(|| format!("starting {}", self.cfg.virtiofsd.display()));
            let mut child = match spawned {
                Ok(c) => c,
                Err(e) => {
                    daemons.kill().await;
                    return Err(e);
                }
            };
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let listening = loop {
                if socket.exists() {
                    break Ok(());
                }
                if let Ok(Some(status)) = child.try_wait() {
                    let log = std::fs::read_to_string(run_dir.join(format!("virtiofsd{i}.log")))
                        .unwrap_or_default();
                    break Err(anyhow::anyhow!(
                        "virtiofsd for volume {} exited ({status}): {}",
                        s.volume_id,
                        log.chars().take(2000).collect::<String>()
                    ));
                }
                if tokio::time::Instant::now() > deadline {
                    break Err(anyhow::anyhow!(
                        "virtiofsd for volume {} did not listen within 10 s",
                        s.volume_id
                    ));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            daemons.children.push(child);
            let listening = match (listening, user) {
                (Ok(()), Some(u)) => u
                    .hand(&socket)
                    .with_context(|| format!("handing {} to QEMU", socket.display())),
                (r, _) => r,
            };
            if let Err(e) = listening {
                daemons.kill().await;
                return Err(e);
            }
            daemons.shares.push(FsShare {
                socket,
                tag: tag(i),
            });
        }
        if daemons.shares.len() != shares.len() {
            daemons.kill().await;
            bail!("not every volume daemon started");
        }
        Ok(daemons)
    }
}
