//! Host-wide network setup of the slots: forwarding (and whether it was vmon that turned it on),
//! the host's `table ip vmon`, and the removal of vmon's first naming scheme.

use anyhow::Context;

use super::{host_ruleset, sh, Perimeter, Slots};

/// Where the host's IPv4 forwarding setting from before vmon first turned it on (since boot)
/// is kept: `/run` is emptied at boot, as the setting is.
const FORWARDING_RECORD: &str = "/run/vmon/ip_forward.before";

/// Whether IPv4 forwarding was off before vmon turned it on. The first node to start since
/// boot records the setting it found; later starts (vmon's own forwarding is on by then) read
/// that record.
fn forwarding_was_off() -> anyhow::Result<bool> {
    use std::io::Write;
    let record = std::path::Path::new(FORWARDING_RECORD);
    if let Some(dir) = record.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let now = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
        .context("reading net.ipv4.ip_forward")?;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(record)
    {
        Ok(mut f) => {
            f.write_all(now.trim().as_bytes())
                .and_then(|_| f.sync_all())
                .with_context(|| format!("writing {FORWARDING_RECORD}"))?;
            Ok(now.trim() == "0")
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let before = std::fs::read_to_string(record)
                .with_context(|| format!("reading {FORWARDING_RECORD}"))?;
            // Empty: another node's start made it this instant and has not written yet; take
            // the stricter reading.
            Ok(before.trim() != "1")
        }
        Err(e) => Err(e).with_context(|| format!("creating {FORWARDING_RECORD}")),
    }
}

impl Slots {
    /// Host-wide setup: forwarding, the masquerade for slot egress and the host-side isolation
    /// rules ([`host_ruleset`]). Idempotent: the hooked chains are rewritten; the per-slot
    /// chains and their map entries belong to live slots and are kept. The rules are in place
    /// before forwarding is turned on.
    pub async fn prepare_host(perimeter: &Perimeter) -> anyhow::Result<()> {
        let was_off = forwarding_was_off()?;
        sh(
            &format!(
                "nft -f - <<'EOF'
{}
EOF
sysctl -qw net.ipv4.ip_forward=1",
                host_ruleset(perimeter, was_off)
            ),
            "host network setup",
        )
        .await
    }
}

/// Removes namespaces and host links named by vmon's first scheme (`vmon-s<n>`, `vmh<n>`),
/// which predates slot blocks and would shadow block 0's addresses.
pub async fn remove_legacy() {
    let Ok(out) = tokio::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .await
    else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if name
            .strip_prefix("vmon-s")
            .is_some_and(|n| n.parse::<u32>().is_ok())
        {
            let _ = sh(&format!("ip netns del {name}"), "remove legacy namespace").await;
        }
    }
    let Ok(links) = tokio::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .await
    else {
        return;
    };
    for line in String::from_utf8_lossy(&links.stdout).lines() {
        let Some(name) = line.split(':').nth(1).map(|s| s.trim()) else {
            continue;
        };
        let name = name.split('@').next().unwrap_or(name);
        if name
            .strip_prefix("vmh")
            .is_some_and(|n| n.parse::<u32>().is_ok())
        {
            let _ = sh(&format!("ip link del {name}"), "remove legacy veth").await;
        }
    }
}
