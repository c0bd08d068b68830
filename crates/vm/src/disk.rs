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
    // An empty overlay is the same bytes whatever its own name: made once per backing image
    // with qemu-img, copied after that (forks start ten children off one backing at once).
    let key = (backing.clone(), fmt);
    let cached = BLANKS.lock().ok().and_then(|m| m.get(&key).cloned());
    if let Some(bytes) = cached {
        let path = path.to_path_buf();
        return tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .with_context(|| format!("creating overlay {}", path.display()))?;
            f.write_all(&bytes)?;
            anyhow::Ok(())
        })
        .await
        .map_err(|e| anyhow::anyhow!("overlay task: {e}"))?;
    }
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
    if let Ok(bytes) = std::fs::read(path) {
        if bytes.len() <= MAX_BLANK {
            if let Ok(mut m) = BLANKS.lock() {
                if m.len() >= MAX_BLANKS {
                    m.clear();
                }
                m.insert(key, std::sync::Arc::new(bytes));
            }
        }
    }
    Ok(())
}

/// Blank overlays by backing image and format.
type Blanks =
    std::collections::HashMap<(std::path::PathBuf, &'static str), std::sync::Arc<Vec<u8>>>;
static BLANKS: std::sync::LazyLock<std::sync::Mutex<Blanks>> =
    std::sync::LazyLock::new(Default::default);
/// Kept blank overlays (each ~200 KiB) and the largest one kept.
const MAX_BLANKS: usize = 64;
const MAX_BLANK: usize = 1 << 20;
