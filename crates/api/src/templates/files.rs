//! The files a template's COPY steps upload. The SDK asks `GET /templates/{id}/files/{hash}`
//! and, when vmon lacks them, `PUT`s the archive to the URL the answer names, with no API key:
//! that URL is vmon's own `/template-files/{team}/{hash}`, signed (HMAC-SHA256, the `hmac` crate, over team, hash
//! and expiry) and valid for an hour. Archives are kept per team under the data dir's
//! `template-files/`, written to a temporary file and renamed once complete, at most 1 GiB.

use std::path::{Path as FsPath, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use rand::Rng;
use sha2::Sha256;
use tokio::io::AsyncWriteExt;

use super::steps::is_hash;
use crate::control::Control;
use crate::error::{ApiError, ApiResult};
use crate::state::{query_pairs, AppState};

/// Largest archive one upload may hold.
pub const MAX_UPLOAD: u64 = 1 << 30;
/// How long an upload URL is good for.
const URL_LIFETIME_SECS: u64 = 3600;

/// The upload signer and the directory uploads land in.
pub struct Uploads {
    key: [u8; 32],
    dir: PathBuf,
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

fn safe_id(s: &str) -> bool {
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
        }
    }

    pub fn path(&self, team_id: &str, hash: &str) -> PathBuf {
        self.dir.join(team_id).join(hash)
    }

    fn message(team_id: &str, hash: &str, expires: u64) -> String {
        format!("{team_id}\n{hash}\n{expires}")
    }

    /// The absolute upload URL for one archive.
    pub fn url(&self, origin: &str, team_id: &str, hash: &str) -> String {
        let expires = now() + URL_LIFETIME_SECS;
        let sig = hmac(&self.key, &Self::message(team_id, hash, expires));
        format!("{origin}/template-files/{team_id}/{hash}?expires={expires}&signature={sig}")
    }

    fn check(&self, team_id: &str, hash: &str, expires: &str, signature: &str) -> ApiResult<()> {
        let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, m);
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
}

async fn write_capped(dir: &FsPath, dest: &FsPath, body: Body) -> ApiResult<u64> {
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|e| ApiError::internal(format!("making {}: {e}", dir.display())))?;
    let tmp = dir.join(format!(".upload-{}", crate::ids::random_lower(12)));
    let mut f = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .await
        .map_err(|e| ApiError::internal(format!("writing {}: {e}", tmp.display())))?;
    let mut stream = body.into_data_stream();
    let mut total: u64 = 0;
    let result = async {
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::bad_request(format!("reading the upload: {e}")))?;
            total += chunk.len() as u64;
            if total > MAX_UPLOAD {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("an upload holds at most {MAX_UPLOAD} bytes"),
                ));
            }
            f.write_all(&chunk)
                .await
                .map_err(|e| ApiError::internal(format!("writing the upload: {e}")))?;
        }
        f.sync_all()
            .await
            .map_err(|e| ApiError::internal(format!("writing the upload: {e}")))?;
        tokio::fs::rename(&tmp, dest)
            .await
            .map_err(|e| ApiError::internal(format!("keeping the upload: {e}")))?;
        Ok(total)
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    result
}

/// `PUT /template-files/{team}/{hash}?expires=…&signature=…`: the archive's bytes.
#[utoipa::path(put, path = "/template-files/{teamID}/{hash}", tag = "templates",
    summary = "Upload a COPY step's archive to the signed URL the files call gave",
    params(("teamID" = String, Path, description = "The team"), ("hash" = String, Path, description = "The files' hash"),
        ("expires" = u64, Query, description = "When the URL expires (Unix seconds)"),
        ("signature" = String, Query, description = "The URL's signature")),
    responses((status = 201, description = "Kept"),
        (status = 401, description = "A bad or expired signature", body = crate::wire::ErrorBody),
        (status = 413, description = "Larger than 1 GiB", body = crate::wire::ErrorBody)))]
pub(crate) async fn upload(
    State(s): State<AppState>,
    Path((team, hash)): Path<(String, String)>,
    RawQuery(query): RawQuery,
    body: Body,
) -> Response {
    let run = async {
        // Only URLs this api signed name anything; a malformed one cannot have been.
        if !safe_id(&team) || !is_hash(&hash) {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "the upload URL's signature is invalid",
            ));
        }
        let pairs = query_pairs(query)?;
        let get = |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or("")
        };
        let uploads = s.control.uploads();
        uploads.check(&team, &hash, get("expires"), get("signature"))?;
        let dest = uploads.path(&team, &hash.to_ascii_lowercase());
        let dir = dest
            .parent()
            .map(FsPath::to_path_buf)
            .ok_or_else(|| ApiError::internal("no upload directory"))?;
        let n = write_capped(&dir, &dest, body).await?;
        tracing::info!(team = %team, hash = %hash, bytes = n, "template files uploaded");
        Ok(StatusCode::CREATED.into_response())
    };
    run.await.unwrap_or_else(|e: ApiError| e.into_response())
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
        assert_eq!(e.message, "signature is already expired");
    }
}
