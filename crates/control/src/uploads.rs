//! Template-file uploads as the domain keeps them: the signer of upload URLs (HMAC-SHA256,
//! the `hmac` crate, over team, hash and expiry; an hour), the per-team directories under the
//! data dir's `template-files/`, and the quotas an upload reserves against
//! (`quotas.max_template_files`, 429; `quotas.max_template_file_bytes`, 507). The route that
//! receives the bytes is `templates/files.rs`; the collector is `templates/collect_files.rs`.

use std::path::{Path as FsPath, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rand::Rng;
use sha2::Sha256;

use super::Control;
use super::{ControlError, ControlResult};

/// How long an upload URL is good for.
const URL_LIFETIME_SECS: u64 = 3600;

/// The upload signer and the directory uploads land in.
pub struct Uploads {
    key: [u8; 32],
    dir: PathBuf,
    /// Per team: bytes and count of the uploads being written now.
    writing: std::sync::Mutex<std::collections::HashMap<String, (u64, usize)>>,
}

/// What a team keeps: archives and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub files: usize,
    pub bytes: u64,
}

/// The quotas an upload is checked against.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub files: usize,
    pub bytes: u64,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn hmac(key: &[u8; 32], msg: &str) -> String {
    use hmac::{Hmac, Mac};
    // HMAC takes a key of any length: `new_from_slice` cannot fail here.
    <Hmac<Sha256> as Mac>::new_from_slice(key)
        .map(|mut m| {
            m.update(msg.as_bytes());
            hex::encode(m.finalize().into_bytes())
        })
        .unwrap_or_default()
}

/// Whether `s` can be a team id in an upload URL.
pub fn safe_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
}

impl Uploads {
    /// A signer with a fresh key (URLs it signed die with the process) over `dir`.
    pub fn new(dir: PathBuf) -> Uploads {
        Uploads {
            key: rand::thread_rng().gen(),
            dir,
            writing: Default::default(),
        }
    }

    /// The directory every team's uploads are under.
    pub fn dir(&self) -> &FsPath {
        &self.dir
    }

    /// What `team_id` keeps, not counting `except` (the archive an upload replaces) or
    /// unfinished uploads (`.upload-*`).
    pub fn usage(&self, team_id: &str, except: Option<&str>) -> Usage {
        let mut u = Usage::default();
        let Ok(entries) = std::fs::read_dir(self.dir.join(team_id)) else {
            return u;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || Some(name.as_ref()) == except {
                continue;
            }
            if let Ok(m) = e.metadata() {
                if m.is_file() {
                    u.files += 1;
                    u.bytes += m.len();
                }
            }
        }
        u
    }

    /// Counts `bytes` more (and, with `new_file`, one file more) against `team_id`'s uploads
    /// in progress, unless `kept` and those would pass `limits`.
    pub(crate) fn reserve(
        &self,
        team_id: &str,
        kept: Usage,
        limits: Limits,
        bytes: u64,
        new_file: bool,
    ) -> ControlResult<()> {
        let mut writing = self
            .writing
            .lock()
            .map_err(|_| ControlError::internal("upload accounting poisoned"))?;
        let w = writing.entry(team_id.to_string()).or_default();
        if new_file && kept.files + w.1 >= limits.files {
            return Err(ControlError::too_many(format!(
                "the team already keeps {} template files, its most (quotas.max_template_files); \
                 they are collected once no build names them",
                kept.files + w.1
            )));
        }
        if kept.bytes + w.0 + bytes > limits.bytes {
            return Err(ControlError::Quota(format!(
                "the team's template files would hold more than {} bytes (quotas.max_template_file_bytes)",
                limits.bytes
            )));
        }
        w.0 += bytes;
        w.1 += usize::from(new_file);
        Ok(())
    }

    /// Gives back what an upload reserved (it ended: kept on disk, or failed).
    pub(crate) fn release(&self, team_id: &str, bytes: u64, new_file: bool) {
        if let Ok(mut writing) = self.writing.lock() {
            if let Some(w) = writing.get_mut(team_id) {
                w.0 = w.0.saturating_sub(bytes);
                w.1 = w.1.saturating_sub(usize::from(new_file));
                if *w == (0, 0) {
                    writing.remove(team_id);
                }
            }
        }
    }

    pub fn path(&self, team_id: &str, hash: &str) -> PathBuf {
        self.dir.join(team_id).join(hash)
    }

    pub(crate) fn message(team_id: &str, hash: &str, expires: u64) -> String {
        format!("{team_id}\n{hash}\n{expires}")
    }

    /// The absolute upload URL for one archive.
    pub fn url(&self, origin: &str, team_id: &str, hash: &str) -> String {
        let expires = now() + URL_LIFETIME_SECS;
        let sig = hmac(&self.key, &Self::message(team_id, hash, expires));
        format!("{origin}/template-files/{team_id}/{hash}?expires={expires}&signature={sig}")
    }

    pub fn check(
        &self,
        team_id: &str,
        hash: &str,
        expires: &str,
        signature: &str,
    ) -> ControlResult<()> {
        let unauthorized = |m: &str| ControlError::BadSignature(m.to_string());
        let expires: u64 = expires
            .parse()
            .map_err(|_| unauthorized("the upload URL is not signed"))?;
        let want = hmac(&self.key, &Self::message(team_id, hash, expires));
        let ok = want.len() == signature.len()
            && want
                .bytes()
                .zip(signature.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !ok {
            return Err(unauthorized("the upload URL's signature is invalid"));
        }
        if expires < now() {
            return Err(unauthorized("signature is already expired"));
        }
        Ok(())
    }
}

impl Control {
    /// Where the archive of `hash` is kept for a team (present or not).
    pub(crate) fn template_file(&self, team_id: &str, hash: &str) -> PathBuf {
        self.uploads().path(team_id, &hash.to_ascii_lowercase())
    }

    /// Whether the team keeps the archive of `hash`; one it keeps is made new again, so the
    /// collector's grace starts over for a build about to name it.
    pub fn template_file_kept(&self, team_id: &str, hash: &str) -> bool {
        let path = self.template_file(team_id, hash);
        match std::fs::OpenOptions::new().write(true).open(&path) {
            Ok(f) => {
                if f.metadata().is_ok_and(|m| m.is_file()) {
                    let _ = f.set_modified(SystemTime::now());
                    true
                } else {
                    false
                }
            }
            Err(_) => false,
        }
    }
}

/// One upload's place in its team's quotas, given back when it ends.
pub struct Reservation<'a> {
    uploads: &'a Uploads,
    team: &'a str,
    kept: Usage,
    limits: Limits,
    bytes: u64,
    new_file: bool,
}

impl<'a> Reservation<'a> {
    /// Reserves a place for one upload of `team` (a new file unless it replaces one).
    pub fn new(
        uploads: &'a Uploads,
        team: &'a str,
        kept: Usage,
        limits: Limits,
        new_file: bool,
    ) -> ControlResult<Reservation<'a>> {
        uploads.reserve(team, kept, limits, 0, new_file)?;
        Ok(Reservation {
            uploads,
            team,
            kept,
            limits,
            bytes: 0,
            new_file,
        })
    }

    pub fn grow(&mut self, n: u64) -> ControlResult<()> {
        self.uploads
            .reserve(self.team, self.kept, self.limits, n, false)?;
        self.bytes += n;
        Ok(())
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.uploads.release(self.team, self.bytes, self.new_file);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_bind_team_hash_and_expiry() {
        let u = Uploads::new(PathBuf::from("/nonexistent"));
        let url = u.url("http://x", "team1", &"a".repeat(64));
        let q = url.split_once('?').expect("test value").1;
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(q).expect("test value");
        let (exp, sig) = (&pairs[0].1, &pairs[1].1);
        assert!(u.check("team1", &"a".repeat(64), exp, sig).is_ok());
        assert!(u.check("team2", &"a".repeat(64), exp, sig).is_err());
        assert!(u.check("team1", &"b".repeat(64), exp, sig).is_err());
        let later = (exp.parse::<u64>().expect("test value") + 1).to_string();
        assert!(u.check("team1", &"a".repeat(64), &later, sig).is_err());
        let old = "1".to_string();
        let old_sig = hmac(&u.key, &Uploads::message("team1", &"a".repeat(64), 1));
        let e = u
            .check("team1", &"a".repeat(64), &old, &old_sig)
            .expect_err("an error");
        assert_eq!(e.to_string(), "signature is already expired");
    }
}
