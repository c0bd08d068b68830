//! Volumes as the state machine needs them: where their files live, their content tokens,
//! and the mounts a sandbox start resolves (by name, per team, at every start).
//!
//! A token is `vt1.<teamID>.<expiry>.<mac>`: an HMAC-SHA256, under the key in
//! `volume_key_file`, of the volume id, its team and the expiry. It names no volume because
//! the URL does, so a token of one volume fails the MAC of every other; the team in clear lets
//! another team's token see 404, as every other route of another team's volume does.

pub mod store;
pub mod tree;

use std::path::{Path, PathBuf};
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use time::OffsetDateTime;
use vmon_proto::node::VolumeShare;
use vmon_store::Volume;

use super::model::VolumeMount;
use super::{record_error, Control};
use super::{ControlError, ControlResult};

/// The most characters of a volume name.
pub const MAX_NAME: usize = 128;

/// A volume name as infra takes it: `^[a-zA-Z0-9_-]+$`, at most [`MAX_NAME`] characters.
pub fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 8;

/// Where volumes live and how their tokens are made.
pub struct Volumes {
    dir: PathBuf,
    key: [u8; 32],
    ttl: Duration,
}

impl Volumes {
    /// Creates `dir` (0700: what guests write there, setuid files included, is nobody else's
    /// to reach) and reads or makes the token key.
    pub fn open(dir: &Path, key_file: &Path, ttl: Duration) -> anyhow::Result<Volumes> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(dir).map_err(|e| {
            anyhow::anyhow!("creating the volumes directory {}: {e}", dir.display())
        })?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        let key = crate::records::secret_key(key_file)?;
        Ok(Volumes {
            dir: dir.to_path_buf(),
            key,
            ttl,
        })
    }

    /// The directory of volume `id` (a UUID: no separators).
    pub fn dir_of(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    fn mac(&self, volume: &Volume, expiry: i64) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        mac.update(
            format!(
                "vmon-volume-token/v1\n{}\n{}\n{expiry}",
                volume.id, volume.team_id
            )
            .as_bytes(),
        );
        mac
    }

    /// A fresh token for `volume`, valid for the configured lifetime.
    pub fn token(&self, volume: &Volume) -> String {
        let expiry = OffsetDateTime::now_utc().unix_timestamp()
            + i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX / 2);
        self.token_until(volume, expiry)
    }

    /// A token for `volume` that expires at `expiry` (Unix seconds).
    pub fn token_until(&self, volume: &Volume, expiry: i64) -> String {
        let mac = self.mac(volume, expiry).finalize().into_bytes();
        format!("vt1.{}.{expiry}.{}", volume.team_id, hex::encode(mac))
    }

    /// Whether `token` is a live token of `volume`.
    pub fn verify(&self, volume: &Volume, token: &str) -> Result<(), Refused> {
        let malformed = Refused::Invalid("malformed volume token");
        let rest = token.strip_prefix("vt1.").ok_or(malformed)?;
        let (rest, mac) = rest.rsplit_once('.').ok_or(malformed)?;
        let (team, expiry) = rest.rsplit_once('.').ok_or(malformed)?;
        if team != volume.team_id {
            return Err(Refused::OtherTeam);
        }
        let expiry: i64 = expiry.parse().map_err(|_| malformed)?;
        let mac = hex::decode(mac).map_err(|_| malformed)?;
        self.mac(volume, expiry)
            .verify_slice(&mac)
            .map_err(|_| Refused::Invalid("the token is not valid for this volume"))?;
        if OffsetDateTime::now_utc().unix_timestamp() >= expiry {
            return Err(Refused::Invalid(
                "the volume token has expired; get a new one with GET /volumes/{volumeID}",
            ));
        }
        Ok(())
    }
}

/// Why a token does not open a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Another team's token: for it the volume does not exist (404).
    OtherTeam,
    /// Malformed, another volume's, or expired (401).
    Invalid(&'static str),
}

/// Checks the mounts of a create as infra does: at most [`MAX_MOUNTS`], each path non-empty,
/// absolute, clean (`filepath.Clean`), not `/`, and unique; each name a volume of the team.
/// Every failure is one 400 listing each bad mount.
pub(crate) fn check_mount_paths(mounts: &[VolumeMount]) -> ControlResult<()> {
    if mounts.len() > MAX_MOUNTS {
        return Err(ControlError::bad_request(format!(
            "invalid mounts: at most {MAX_MOUNTS} volumes per sandbox"
        )));
    }
    let mut problems = Vec::new();
    for (i, m) in mounts.iter().enumerate() {
        let p = &m.path;
        if let Err(why) = check_path(p) {
            problems.push(format!("volume mount #{i}: path {why}"));
        } else if mounts[..i].iter().any(|o| o.path == *p) {
            problems.push(format!("volume mount #{i}: path '{p}' is mounted twice"));
        }
        if !valid_name(&m.name) {
            problems.push(format!(
                "volume mount #{i}: invalid volume name '{}'",
                m.name
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ControlError::bad_request(format!(
            "invalid mounts:\n\t- {}",
            problems.join("\n\t- ")
        )))
    }
}

/// A mount path in the guest: non-empty, absolute, clean (`filepath.Clean`), not `/`, at most
/// 1024 bytes, without NUL or commas. The error completes "path …".
pub(crate) fn check_path(p: &str) -> Result<(), String> {
    if p.is_empty() {
        Err("is empty".into())
    } else if !p.starts_with('/') {
        Err(format!("'{p}' must be absolute"))
    } else if p == "/" {
        Err("cannot be /".into())
    } else if clean(p) != *p {
        Err(format!("'{p}' must be clean ('{}')", clean(p)))
    } else if p.len() > 1024 || p.contains('\0') || p.contains(',') {
        Err(format!("'{p}' is too long or has NUL or commas"))
    } else {
        Ok(())
    }
}

/// Go's `filepath.Clean` for an absolute path.
fn clean(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in p.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    format!("/{}", parts.join("/"))
}

impl Control {
    /// The shares a start of a team's sandbox gives the node: each mount's volume looked up
    /// by name now (a volume destroyed since is a 400, and the sandbox does not start).
    pub(crate) async fn volume_shares(
        &self,
        team_id: &str,
        mounts: &[VolumeMount],
    ) -> ControlResult<Vec<VolumeShare>> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        if self.volumes.is_none() {
            return Err(ControlError::bad_request(
                "volume mounts are not available: this server has no volumes directory",
            ));
        }
        let mut shares = Vec::with_capacity(mounts.len());
        let mut missing = Vec::new();
        for (i, m) in mounts.iter().enumerate() {
            match self
                .records
                .volume_by_name(team_id, &m.name)
                .await
                .map_err(record_error)?
            {
                Some(v) => shares.push(VolumeShare {
                    volume_id: v.id,
                    path: m.path.clone(),
                    ..crate::volumes::store::share_fields(self.config())
                }),
                None => missing.push(format!("volume mount #{i}: volume '{}' not found", m.name)),
            }
        }
        if !missing.is_empty() {
            return Err(ControlError::bad_request(format!(
                "invalid mounts:\n\t- {}",
                missing.join("\n\t- ")
            )));
        }
        Ok(shares)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(path: &str) -> VolumeMount {
        VolumeMount {
            name: "data".into(),
            path: path.into(),
        }
    }

    #[test]
    fn mount_paths_are_absolute_clean_and_unique() {
        assert!(check_mount_paths(&[m("/mnt/data"), m("/home/user/x")]).is_ok());
        for bad in ["", "mnt", "/", "/mnt/", "/mnt/../etc", "/mnt//x", "/a,b"] {
            assert!(check_mount_paths(&[m(bad)]).is_err(), "{bad:?}");
        }
        assert!(check_mount_paths(&[m("/a"), m("/a")]).is_err());
    }
}
