//! `vmon doctor`: what this host can run, and why.

use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// Force an accelerator (kvm or tcg) to check whether it would be usable.
    #[arg(long, env = "VMON_ACCEL")]
    accel: Option<String>,
    #[arg(long, default_value = "/usr/bin/qemu-system-x86_64")]
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
    match vmon_vm::machine::qemu_version(&args.qemu) {
        Ok(v) => {
            line(true, "qemu", &v);
            let probe_dir =
                std::env::temp_dir().join(format!("vmon-doctor-{}", std::process::id()));
            match vmon_node::probe_qmp(&args.qemu, &probe_dir).await {
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
