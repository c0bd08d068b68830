//! `vmon doctor`: what this host can run, and why.

use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// Force an accelerator (kvm or tcg) to check whether it would be usable.
    #[arg(long, env = "VMON_ACCEL")]
    accel: Option<String>,
    /// The QEMU to check (the node's `VMON_QEMU`).
    #[arg(long, env = "VMON_QEMU", default_value = vmon_node::DEFAULT_QEMU)]
    qemu: PathBuf,
}

fn line(ok: bool, what: &str, detail: &str) -> bool {
    println!("{} {what}: {detail}", if ok { "ok  " } else { "FAIL" });
    ok
}

fn has(cmd: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {cmd} >/dev/null")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    let mut all = true;
    let force = match args.accel.as_deref() {
        None | Some("auto") => None,
        Some(a) => Some(
            a.parse::<vmon_vm::Accel>()
                .map_err(|e| anyhow::anyhow!(e))?,
        ),
    };
    match vmon_vm::probe_accel(force) {
        Ok(c) => {
            line(
                true,
                "accelerator",
                &format!("{} ({})", c.accel.as_str(), c.reason),
            );
        }
        Err(e) => all &= line(false, "accelerator", &e),
    }
    all &= qemu_checks(&args.qemu).await;
    for (cmd, pkg) in [
        ("qemu-img", "qemu-utils"),
        ("debootstrap", "debootstrap"),
        ("mkfs.ext4", "e2fsprogs"),
        ("nft", "nftables"),
        ("ip", "iproute2"),
    ] {
        all &= line(has(cmd), cmd, if has(cmd) { "found" } else { pkg });
    }
    let tun = Path::new("/dev/net/tun").exists();
    all &= line(
        tun,
        "/dev/net/tun",
        if tun {
            "present"
        } else {
            "missing (taps need it)"
        },
    );
    match vmon_image::host_apt_source() {
        Ok(s) => {
            line(
                true,
                "guest suite",
                &format!("{} from {}", s.suite, s.mirror),
            );
        }
        Err(e) => all &= line(false, "guest suite", &format!("{e:#}")),
    }
    all &= host_checks(data_dir);
    // GPU passthrough (VFIO): where the node looks (VMON_SYSFS_ROOT, VMON_VFIO_DEV_DIR).
    let node_cfg = vmon_node::NodeConfig::new(PathBuf::new());
    for c in super::doctor_gpu::checks(
        &node_cfg.sysfs_root,
        &node_cfg.vfio_dev_dir,
        super::doctor_gpu::memlock_limit(),
    ) {
        all &= line(c.ok, c.what, &c.detail);
    }
    let images = data_dir.join("images");
    let n = std::fs::read_dir(&images)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().join("manifest.json").is_file())
                .count()
        })
        .unwrap_or(0);
    line(
        true,
        "images cached",
        &format!("{n} in {}", images.display()),
    );
    if !all {
        anyhow::bail!("some checks failed");
    }
    Ok(())
}

/// The QEMU binary: its version (refused when unsupported) and the QMP commands vmon needs.
async fn qemu_checks(qemu: &Path) -> bool {
    let mut all = true;
    match vmon_vm::qemu_version::QemuVersion::detect(qemu) {
        Ok(v) => {
            match v.refusal(qemu) {
                None => {
                    line(
                        true,
                        "qemu",
                        &format!(
                            "{} ({}; supported: {})",
                            v.line,
                            qemu.display(),
                            vmon_vm::qemu_version::QemuVersion::supported_list()
                        ),
                    );
                }
                Some(why) => all &= line(false, "qemu", &why),
            }
            let probe_dir =
                std::env::temp_dir().join(format!("vmon-doctor-{}", std::process::id()));
            match vmon_node::probe_qmp(qemu, &probe_dir).await {
                Ok(()) => {
                    line(
                        true,
                        "qmp",
                        "xen-save-devices-state, migrate-incoming, blockdev-snapshot-sync present",
                    );
                }
                Err(e) => all &= line(false, "qmp", &format!("{e:#}")),
            }
            let _ = std::fs::remove_dir_all(&probe_dir);
        }
        Err(e) => all &= line(false, "qemu", &format!("{e:#}")),
    }
    all
}

/// Free bytes on the filesystem holding `path` (or its nearest existing parent).
fn free_bytes(path: &Path) -> Option<u64> {
    let mut p = path.to_path_buf();
    while !p.exists() {
        p = p.parent()?.to_path_buf();
    }
    vmon_node::free_mb(&p).map(|mb| mb << 20)
}

/// The data dir's disk, the ports, name resolution for sandbox hosts, privileges and cgroups:
/// each failure names its fix.
fn host_checks(data_dir: &Path) -> bool {
    let mut all = true;
    all &= root_check();
    all &= disk_check(data_dir);
    all &= port_checks();
    all &= nsswitch_check();
    all &= cgroups_check();
    let qemu_user = match vmon_node::NodeConfig::new(std::path::PathBuf::new()).qemu_uid_base {
        Some(base) => format!(
            "unprivileged: one uid per slot from {} up, group {base} (VMON_QEMU_UID_BASE)",
            base + 1
        ),
        None => "root (VMON_QEMU_UID_BASE=0: for debugging only)".to_string(),
    };
    line(true, "QEMU user", &qemu_user);
    all
}

fn root_check() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    line(
        root,
        "root",
        if root {
            "running as root"
        } else {
            "vmon needs root (network namespaces, taps, cgroups): run it with sudo"
        },
    )
}

/// 10 GiB free for the data dir.
fn disk_check(data_dir: &Path) -> bool {
    const MIN_FREE: u64 = 10 << 30;
    let Some(b) = free_bytes(data_dir) else {
        return line(
            false,
            "disk",
            &format!("cannot stat {}", data_dir.display()),
        );
    };
    let ok = b >= MIN_FREE;
    line(
        ok,
        "disk",
        &format!(
            "{:.1} GiB free for {}{}",
            b as f64 / f64::from(1u32 << 30),
            data_dir.display(),
            if ok {
                ""
            } else {
                " (needs 10 GiB: free space there or pass --data-dir on a larger disk)"
            }
        ),
    )
}

/// The api's and the proxy's ports are free.
fn port_checks() -> bool {
    let mut all = true;
    let defaults = vmon_api::Config::default();
    let ports = [
        ("VMON_API_LISTEN", defaults.api_listen),
        ("VMON_PROXY_LISTEN", defaults.proxy_listen),
    ];
    for (var, default) in ports {
        let addr = std::env::var(var)
            .ok()
            .and_then(|v| v.parse::<std::net::SocketAddr>().ok())
            .unwrap_or(default);
        all &= match std::net::TcpListener::bind(addr) {
            Ok(_) => line(true, "port", &format!("{addr} is free")),
            Err(e) => line(
                false,
                "port",
                &format!(
                    "{addr}: {e} (is vmon already running? stop it, or set {var} to another address)"
                ),
            ),
        };
    }
    all
}

/// `*.localhost` names resolve (nss-myhostname).
fn nsswitch_check() -> bool {
    let nss = std::fs::read_to_string("/etc/nsswitch.conf").unwrap_or_default();
    let myhost = nss.lines().any(|l| {
        l.trim_start().starts_with("hosts:") && l.split_whitespace().any(|w| w == "myhostname")
    });
    line(
        myhost,
        "nsswitch",
        if myhost {
            "*.localhost resolves (myhostname on the hosts line)"
        } else {
            "add 'myhostname' after 'files' on the hosts line of /etc/nsswitch.conf (apt-get install libnss-myhostname), so get_host() names resolve"
        },
    )
}

/// The cgroup controllers each QEMU's limits need.
fn cgroups_check() -> bool {
    match vmon_vm::cgroup::detect() {
        Ok(l) => line(
            true,
            "cgroups",
            &format!(
                "{} ({}): each QEMU gets memory, CPU and pids limits",
                l.version,
                l.parents
                    .iter()
                    .map(|(_, p)| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
        Err(e) => line(
            false,
            "cgroups",
            &format!("{e:#} (mount cgroup2 at /sys/fs/cgroup, or the v1 memory, cpu and pids controllers)"),
        ),
    }
}
