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
    // An empty overlay differs from another of the same size and backing format only in the
    // backing file's name: made once per (size, format) with qemu-img, then copied with the
    // name rewritten (forks start ten children at once, every resume a fresh chain).
    let size = virtual_size(&backing, format);
    let cached = size.and_then(|size| {
        BLANKS
            .lock()
            .ok()
            .and_then(|m| m.get(&(size, fmt)).cloned())
            .and_then(|b| b.renamed(&backing))
    });
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
    if let (Some(size), Ok(bytes)) = (size, std::fs::read(path)) {
        if let Some(b) = Blank::parse(bytes, &backing, size) {
            if let Ok(mut m) = BLANKS.lock() {
                if m.len() >= MAX_BLANKS {
                    m.clear();
                }
                m.insert((size, fmt), std::sync::Arc::new(b));
            }
        }
    }
    Ok(())
}

/// The size a guest sees of `backing`: a raw file's length, a qcow2 image's header field.
fn virtual_size(backing: &Path, format: BackingFormat) -> Option<u64> {
    match format {
        BackingFormat::Raw => std::fs::metadata(backing).ok().map(|m| m.len()),
        BackingFormat::Qcow2 => {
            use std::os::unix::fs::FileExt;
            let mut h = [0u8; 32];
            std::fs::File::open(backing)
                .ok()?
                .read_exact_at(&mut h, 0)
                .ok()?;
            (h[..4] == QCOW2_MAGIC).then(|| be_u64(&h[24..32]))
        }
    }
}

const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";
/// qemu refuses longer backing file names.
const MAX_BACKING_NAME: usize = 1023;

fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// An empty overlay made by qemu-img, and where in it the backing file's name sits.
struct Blank {
    bytes: Vec<u8>,
    name_offset: usize,
    name_len: usize,
    /// Bytes free for the name: up to the end of the header cluster (all zero after it).
    room: usize,
}

impl Blank {
    /// Accepts `bytes` only if it is the qcow2 overlay it should be: the right size, and
    /// `backing`'s name in the header cluster where the header says.
    fn parse(bytes: Vec<u8>, backing: &Path, size: u64) -> Option<Blank> {
        if bytes.len() > MAX_BLANK || bytes.len() < 104 || bytes[..4] != QCOW2_MAGIC {
            return None;
        }
        let name_offset = usize::try_from(be_u64(&bytes[8..16])).ok()?;
        let name_len = u32::from_be_bytes(bytes[16..20].try_into().ok()?) as usize;
        let cluster_bits = u32::from_be_bytes(bytes[20..24].try_into().ok()?);
        if be_u64(&bytes[24..32]) != size || !(9..=21).contains(&cluster_bits) {
            return None;
        }
        let cluster = 1usize << cluster_bits;
        let name = backing.as_os_str().as_encoded_bytes();
        if name_offset + name_len > cluster.min(bytes.len())
            || bytes.get(name_offset..name_offset + name_len)? != name
        {
            return None;
        }
        // The name is the header cluster's last content: what follows it must be free.
        let cluster_end = cluster.min(bytes.len());
        if bytes[name_offset + name_len..cluster_end]
            .iter()
            .any(|&b| b != 0)
        {
            return None;
        }
        Some(Blank {
            bytes,
            name_offset,
            name_len,
            room: cluster_end - name_offset,
        })
    }

    /// A copy naming `backing` instead; None when the name does not fit.
    fn renamed(&self, backing: &Path) -> Option<Vec<u8>> {
        let name = backing.as_os_str().as_encoded_bytes();
        if name.is_empty() || name.len() > MAX_BACKING_NAME || name.len() > self.room {
            return None;
        }
        let mut b = self.bytes.clone();
        let end = self.name_offset + self.name_len.max(name.len());
        if end > b.len() {
            return None;
        }
        b[self.name_offset..self.name_offset + self.name_len].fill(0);
        b[self.name_offset..self.name_offset + name.len()].copy_from_slice(name);
        b[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        Some(b)
    }
}

/// Blank overlays by virtual size and backing format.
type Blanks = std::collections::HashMap<(u64, &'static str), std::sync::Arc<Blank>>;
static BLANKS: std::sync::LazyLock<std::sync::Mutex<Blanks>> =
    std::sync::LazyLock::new(Default::default);
/// Kept blank overlays (each ~200 KiB) and the largest one kept.
const MAX_BLANKS: usize = 64;
const MAX_BLANK: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a qemu-utils tool on `image`; its stdout, once it succeeded.
    fn qemu_tool(tool: &str, args: &[&str], image: &Path) -> String {
        let out = std::process::Command::new(tool)
            .args(args)
            .arg(image)
            .output()
            .unwrap_or_else(|e| panic!("{tool} (qemu-utils): {e}"));
        assert!(
            out.status.success(),
            "{tool} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[tokio::test]
    async fn a_copied_blank_overlay_names_its_own_backing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base.raw");
        std::fs::File::create(&base)
            .expect("base")
            .set_len(64 << 20)
            .expect("len");
        // Two backings of one size: the second overlay is the first's bytes, renamed.
        let a = dir.path().join("a.qcow2");
        let b = dir.path().join("backing-with-a-much-longer-name.qcow2");
        create_overlay(&base, BackingFormat::Raw, &a)
            .await
            .expect("a");
        create_overlay(&base, BackingFormat::Raw, &b)
            .await
            .expect("b");
        let (oa, ob) = (dir.path().join("oa.qcow2"), dir.path().join("ob.qcow2"));
        create_overlay(&a, BackingFormat::Qcow2, &oa)
            .await
            .expect("oa");
        assert!(
            BLANKS
                .lock()
                .expect("lock")
                .contains_key(&(64 << 20, "qcow2")),
            "the first qcow2-backed overlay is kept as a blank"
        );
        create_overlay(&b, BackingFormat::Qcow2, &ob)
            .await
            .expect("ob");
        let i: serde_json::Value = serde_json::from_str(&qemu_tool(
            "qemu-img",
            &["info", "--output=json", "-U"],
            &ob,
        ))
        .expect("json");
        let want = std::fs::canonicalize(&b).expect("canon");
        assert_eq!(i["backing-filename"], want.display().to_string(), "{i}");
        assert_eq!(i["backing-filename-format"], "qcow2", "{i}");
        assert_eq!(i["virtual-size"], 64u64 << 20, "{i}");
        // A sound image; a write through it lands on it and the backing stays as it was.
        qemu_tool("qemu-img", &["check", "-q"], &ob);
        qemu_tool("qemu-io", &["-c", "write -P 0x5a 0 64k"], &ob);
        let out = qemu_tool("qemu-io", &["-r", "-c", "read -P 0x5a 0 64k"], &ob);
        assert!(
            out.contains("read 65536/65536") && !out.contains("failed"),
            "{out}"
        );
        assert_eq!(
            std::fs::metadata(&b).expect("b").len(),
            std::fs::metadata(&a).expect("a").len(),
            "the backing took no write"
        );
    }
}
