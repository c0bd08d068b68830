//! Disk chains: a raw base image under qcow2 overlays.

use std::path::Path;

use anyhow::{bail, Context};

#[derive(Debug, Clone, Copy)]
pub enum BackingFormat {
    Raw,
    Qcow2,
}

/// Creates `path` as a qcow2 overlay over `backing` (which must stay unchanged from then on).
pub async fn create_overlay(
    backing: &Path,
    format: BackingFormat,
    path: &Path,
) -> anyhow::Result<()> {
    let backing = std::fs::canonicalize(backing)
        .with_context(|| format!("backing image {} is missing", backing.display()))?;
    let fmt = match format {
        BackingFormat::Raw => "raw",
        BackingFormat::Qcow2 => "qcow2",
    };
    let out = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", fmt, "-b"])
        .arg(&backing)
        .arg(path)
        .output()
        .await
        .context("running qemu-img (apt-get install qemu-utils)")?;
    if !out.status.success() {
        bail!(
            "qemu-img create failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
