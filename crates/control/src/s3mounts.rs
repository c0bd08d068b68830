//! Bucket mounts (`vmonS3Mounts`, not E2B's): prefixes of S3 buckets a create names, mounted
//! as directories in the guest. This side checks what a create asks (a clear 400 for each bad
//! field), keeps the mounts in the record (secrets by name), and at every start turns them
//! into [`VolumeShare`]s with a [`BucketShare`] each: the endpoint (one the operator allows:
//! `s3_mount_endpoints`), the bucket and prefix, the bounds (the team's `max_volume_bytes`,
//! [`MAX_OBJECTS`]) and the credentials opened from the team's secret at that moment. The node
//! does the rest (`crates/node/src/node/bucket.rs`): a cache per sandbox, filled before the
//! mount, written back at pause, kill and periodically; the guest never sees the credentials.

use vmon_proto::node::{BucketCredentials, BucketShare, VolumeShare};

use super::model::{S3Mount, VolumeMount};
use super::Control;
use super::{ControlError, ControlResult};
use crate::config::{normal_endpoint, Config};
use crate::records::SandboxRecord;

/// The most bucket mounts one sandbox has (with its volumes, at most
/// [`crate::volumes::MAX_MOUNTS`] mounts in all).
pub const MAX_S3_MOUNTS: usize = 4;
/// The most objects one mount fetches.
pub const MAX_OBJECTS: u64 = 100_000;
/// The longest prefix.
const MAX_PREFIX: usize = 512;

/// S3's bucket names: 3-63 of `[a-z0-9.-]`, starting and ending with a letter or digit.
fn valid_bucket(b: &str) -> bool {
    (3..=63).contains(&b.len())
        && b.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'.' || c == b'-')
        && b.as_bytes()[0].is_ascii_alphanumeric()
        && b.as_bytes()[b.len() - 1].is_ascii_alphanumeric()
}

/// A prefix: `/`-separated components, none empty, `.` or `..`, no NUL; a trailing `/` is
/// dropped. Returns it normalised.
fn normal_prefix(p: &str) -> Option<String> {
    let p = p.strip_suffix('/').unwrap_or(p);
    if p.is_empty() {
        return Some(String::new());
    }
    let ok = p.len() <= MAX_PREFIX
        && !p.contains('\0')
        && p.split('/')
            .all(|c| !c.is_empty() && c != "." && c != ".." && c.len() <= 255);
    ok.then(|| p.to_string())
}

fn valid_region(r: &str) -> bool {
    (1..=64).contains(&r.len())
        && r.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn valid_secret_name(n: &str) -> bool {
    (1..=128).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The endpoint mount `m` reaches: the one it names if the operator allows it, else the
/// first allowed; none allowed (or a name not listed) is the reason why not.
fn endpoint_of(m: &S3Mount, cfg: &Config) -> Result<String, String> {
    let allowed: Vec<String> = cfg
        .s3_mount_endpoints
        .iter()
        .filter_map(|e| normal_endpoint(e).ok())
        .collect();
    if allowed.is_empty() {
        return Err(
            "this server allows no S3 mounts (the operator lists endpoints in \
             s3_mount_endpoints / VMON_S3_MOUNT_ENDPOINTS)"
                .into(),
        );
    }
    match &m.endpoint {
        None => Ok(allowed[0].clone()),
        Some(e) => {
            let e = normal_endpoint(e)?;
            if allowed.contains(&e) {
                Ok(e)
            } else {
                Err(format!(
                    "endpoint {e:?} is not one this server allows ({})",
                    allowed.join(", ")
                ))
            }
        }
    }
}

/// Checks a create's bucket mounts with its volume mounts: counts, each field, and mount
/// paths unique among all of them. Every problem goes into one 400.
pub(crate) fn check(
    mounts: &[S3Mount],
    volumes: &[VolumeMount],
    cfg: &Config,
) -> ControlResult<()> {
    if mounts.is_empty() {
        return Ok(());
    }
    if mounts.len() > MAX_S3_MOUNTS {
        return Err(ControlError::bad_request(format!(
            "invalid vmonS3Mounts: at most {MAX_S3_MOUNTS} per sandbox"
        )));
    }
    if mounts.len() + volumes.len() > crate::volumes::MAX_MOUNTS {
        return Err(ControlError::bad_request(format!(
            "invalid vmonS3Mounts: at most {} volume and S3 mounts per sandbox",
            crate::volumes::MAX_MOUNTS
        )));
    }
    let mut problems = Vec::new();
    for (i, m) in mounts.iter().enumerate() {
        let mut bad = |why: String| problems.push(format!("S3 mount #{i}: {why}"));
        if !valid_bucket(&m.bucket) {
            bad(format!(
                "bucket {:?} is not an S3 bucket name (3-63 of [a-z0-9.-])",
                m.bucket
            ));
        }
        if normal_prefix(&m.prefix).is_none() {
            bad(format!(
                "prefix {:?} must be /-separated names without empty, '.' or '..' parts, \
                 not starting with '/', at most {MAX_PREFIX} characters",
                m.prefix
            ));
        }
        let p = &m.mount_path;
        if let Err(why) = crate::volumes::check_path(p) {
            bad(format!("mountPath {why}"));
        } else if volumes.iter().any(|v| v.path == *p)
            || mounts[..i].iter().any(|o| o.mount_path == *p)
        {
            bad(format!("mountPath '{p}' is mounted twice"));
        }
        if let Err(why) = endpoint_of(m, cfg) {
            bad(why);
        }
        if let Some(r) = &m.region {
            if !valid_region(r) {
                bad(format!("region {r:?} must be 1-64 of [A-Za-z0-9_-]"));
            }
        }
        if !valid_secret_name(&m.secret) {
            bad(format!(
                "secret {:?} must name a team secret ([a-zA-Z0-9_-])",
                m.secret
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ControlError::bad_request(format!(
            "invalid vmonS3Mounts:\n\t- {}",
            problems.join("\n\t- ")
        )))
    }
}

/// `ACCESS_KEY_ID:SECRET_ACCESS_KEY` (s3fs's form), surrounding blanks ignored.
fn parse_credentials(value: &str) -> Option<BucketCredentials> {
    let (id, key) = value.trim().split_once(':')?;
    let ok = |s: &str| !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| b.is_ascii_graphic());
    (ok(id) && ok(key)).then(|| BucketCredentials {
        access_key_id: id.to_string(),
        secret_access_key: key.to_string(),
    })
}

/// The cache a node keeps of mount `i` of sandbox `sandbox_id` (its own: a fork child's differs).
pub fn cache_id(sandbox_id: &str, i: usize) -> String {
    format!("s3m-{sandbox_id}-{i}")
}

impl Control {
    /// The shares of a start of sandbox `sandbox_id` for its bucket mounts, with the named
    /// secrets' values of this moment. A secret missing or not of the form
    /// `ACCESS_KEY_ID:SECRET_ACCESS_KEY` is a 400 (no value is ever in a message).
    pub(crate) async fn bucket_shares(
        &self,
        team_id: &str,
        sandbox_id: &str,
        mounts: &[S3Mount],
    ) -> ControlResult<Vec<VolumeShare>> {
        let cfg = self.config();
        let max_bytes = match cfg.quotas.max_volume_bytes {
            0 => u64::MAX,
            n => n,
        };
        let mut shares = Vec::with_capacity(mounts.len());
        for (i, m) in mounts.iter().enumerate() {
            let endpoint = endpoint_of(m, cfg)
                .map_err(|why| ControlError::bad_request(format!("S3 mount #{i}: {why}")))?;
            let Some(value) = self.secret_value_named(team_id, &m.secret).await? else {
                return Err(ControlError::bad_request(format!(
                    "S3 mount #{i}: the team has no secret {:?}",
                    m.secret
                )));
            };
            let credentials = parse_credentials(&value).ok_or_else(|| {
                ControlError::bad_request(format!(
                    "S3 mount #{i}: secret {:?} must hold ACCESS_KEY_ID:SECRET_ACCESS_KEY",
                    m.secret
                ))
            })?;
            shares.push(VolumeShare {
                volume_id: cache_id(sandbox_id, i),
                path: m.mount_path.clone(),
                bucket: Some(BucketShare {
                    endpoint,
                    region: m.region.clone().unwrap_or_else(|| "us-east-1".into()),
                    bucket: m.bucket.clone(),
                    prefix: normal_prefix(&m.prefix).unwrap_or_default(),
                    read_only: m.read_only,
                    max_bytes,
                    max_objects: MAX_OBJECTS,
                    credentials,
                }),
                ..VolumeShare::default()
            });
        }
        Ok(shares)
    }

    /// Every share a start of `rec` mounts: its volumes, then its bucket prefixes.
    pub(crate) async fn mount_shares(
        &self,
        team_id: &str,
        rec: &SandboxRecord,
    ) -> ControlResult<Vec<VolumeShare>> {
        let mut shares = self.volume_shares(team_id, &rec.volume_mounts).await?;
        shares.extend(self.bucket_shares(team_id, &rec.id, &rec.s3_mounts).await?);
        Ok(shares)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(bucket: &str, path: &str) -> S3Mount {
        S3Mount {
            bucket: bucket.into(),
            mount_path: path.into(),
            secret: "s3-key".into(),
            ..Default::default()
        }
    }

    fn cfg(endpoints: &[&str]) -> Config {
        Config {
            s3_mount_endpoints: endpoints.iter().map(|s| s.to_string()).collect(),
            ..Config::default()
        }
    }

    fn refused(mounts: &[S3Mount], volumes: &[VolumeMount], c: &Config) -> String {
        match check(mounts, volumes, c) {
            Ok(()) => panic!("accepted: {mounts:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn endpoints_are_the_operators_and_fail_closed() {
        let m = mount("data", "/mnt/s3");
        assert!(refused(std::slice::from_ref(&m), &[], &cfg(&[])).contains("allows no S3 mounts"));
        let c = cfg(&["https://S3.example.com/", "http://127.0.0.1:3900"]);
        assert!(check(std::slice::from_ref(&m), &[], &c).is_ok());
        assert_eq!(
            endpoint_of(&m, &c).expect("default"),
            "https://s3.example.com"
        );
        let named = S3Mount {
            endpoint: Some("http://127.0.0.1:3900/".into()),
            ..m.clone()
        };
        assert_eq!(
            endpoint_of(&named, &c).expect("listed"),
            "http://127.0.0.1:3900"
        );
        for bad in [
            "http://169.254.169.254",
            "http://127.0.0.1:3901",
            "file:///etc",
            "http://user:pw@127.0.0.1:3900",
            "http://127.0.0.1:3900/path",
        ] {
            let other = S3Mount {
                endpoint: Some(bad.into()),
                ..m.clone()
            };
            assert!(check(&[other], &[], &c).is_err(), "{bad}");
        }
        assert!(normal_endpoint("ftp://x").is_err());
    }

    #[test]
    fn every_bad_field_is_named_in_one_400() {
        let c = cfg(&["http://127.0.0.1:3900"]);
        let bad = S3Mount {
            bucket: "No_Such".into(),
            prefix: "a/../b".into(),
            mount_path: "relative".into(),
            region: Some("us east".into()),
            secret: "".into(),
            ..Default::default()
        };
        let m = refused(&[bad], &[], &c);
        for part in ["bucket", "prefix", "mountPath", "region", "secret"] {
            assert!(m.contains(part), "{part} in {m}");
        }
        let vol = VolumeMount {
            name: "v".into(),
            path: "/mnt/x".into(),
        };
        assert!(refused(&[mount("data", "/mnt/x")], &[vol], &c).contains("twice"));
        let five: Vec<S3Mount> = (0..5).map(|i| mount("data", &format!("/m{i}"))).collect();
        assert!(refused(&five, &[], &c).contains("at most"));
        assert_eq!(normal_prefix("team/data/").as_deref(), Some("team/data"));
        assert_eq!(normal_prefix("").as_deref(), Some(""));
        assert!(normal_prefix("/abs").is_none());
    }

    #[test]
    fn credentials_are_key_colon_secret() {
        let c = parse_credentials(" GK123:abc/def+ghi \n").expect("ok");
        assert_eq!(
            (c.access_key_id.as_str(), c.secret_access_key.as_str()),
            ("GK123", "abc/def+ghi")
        );
        for bad in ["", "nocolon", ":x", "x:", "a b:c"] {
            assert!(parse_credentials(bad).is_none(), "{bad:?}");
        }
        assert!(
            !format!("{c:?}").contains("abc/def"),
            "Debug hides the secret"
        );
    }
}
