//! Files that hold secrets (tokens, keys, build records naming an envd token), written so that
//! they are never readable by anyone but their owner, not even for an instant, and never seen
//! half-written: a temporary file created `O_EXCL` with mode 0600 in the same directory,
//! synced, then moved into place.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

fn temp_beside(path: &Path) -> PathBuf {
    let mut b = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut b);
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let suffix: String = b.iter().map(|x| format!("{x:02x}")).collect();
    path.with_file_name(format!(".{name}.{suffix}.tmp"))
}

fn write_temp(path: &Path, contents: &[u8]) -> std::io::Result<PathBuf> {
    let tmp = temp_beside(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    if let Err(e) = f.write_all(contents).and_then(|()| f.sync_all()) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(tmp)
}

/// Writes `contents` to `path` (replacing what is there), owner-only.
pub fn write(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let tmp = write_temp(path, contents)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Creates `path` with `contents`, owner-only, unless it exists (`AlreadyExists`): of several
/// processes creating the same secret at once, exactly one wins and the others read its file.
pub fn create(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let tmp = write_temp(path, contents)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vmon-private-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("dir");
        d
    }

    #[test]
    fn secrets_are_owner_only_and_created_once() {
        let d = dir();
        let p = d.join("token");
        let _ = std::fs::remove_file(&p);
        create(&p, b"first").expect("create");
        assert_eq!(
            std::fs::metadata(&p).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        let again = create(&p, b"second").expect_err("exists");
        assert_eq!(again.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&p).expect("read"), b"first");
        write(&p, b"third").expect("write");
        assert_eq!(std::fs::read(&p).expect("read"), b"third");
        assert_eq!(
            std::fs::metadata(&p).expect("meta").permissions().mode() & 0o777,
            0o600
        );
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(&d)
            .expect("list")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
