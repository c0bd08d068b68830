//! The files a template's COPY steps upload. The SDK asks `GET /templates/{id}/files/{hash}`
//! and, when vmon lacks them, `PUT`s the archive to the URL the answer names, with no API key:
//! that URL is vmon's own `/template-files/{team}/{hash}`, signed and valid for an hour (the
//! signer, the directories and the quotas are `crates/control/src/uploads.rs`). An archive is written to a
//! temporary file and renamed once complete, at most 1 GiB.
//!
//! A team keeps at most `quotas.max_template_files` archives (429) of at most
//! `quotas.max_template_file_bytes` in all (507), counted over what it keeps and what its other
//! uploads are writing. Archives no waiting or running build names are collected once older
//! than `template_files_grace_secs` (`collect_files.rs`); a probe that finds one, and a build
//! start that names it, make it new again.

use std::path::Path as FsPath;

use axum::body::Body;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use super::steps::is_hash;
use crate::control::uploads::{safe_id, Limits, Reservation};
use crate::error::{ApiError, ApiResult};
use crate::state::{query_pairs, AppState};

/// Largest archive one upload may hold.
pub const MAX_UPLOAD: u64 = 1 << 30;
async fn write_capped(
    dir: &FsPath,
    dest: &FsPath,
    body: Body,
    quota: &mut Reservation<'_>,
) -> ApiResult<u64> {
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
            quota.grow(chunk.len() as u64)?;
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
        (status = 413, description = "Larger than 1 GiB", body = crate::wire::ErrorBody),
        (status = 429, description = "The team keeps quotas.max_template_files uploads", body = crate::wire::ErrorBody),
        (status = 507, description = "The team's uploads would pass quotas.max_template_file_bytes", body = crate::wire::ErrorBody)))]
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
        let quotas = &s.control.config().quotas;
        let limits = Limits {
            files: quotas.max_template_files,
            bytes: quotas.max_template_file_bytes,
        };
        let hash = hash.to_ascii_lowercase();
        let replaces = dest.is_file();
        let kept = uploads.usage(&team, Some(&hash));
        let mut quota = Reservation::new(uploads, &team, kept, limits, !replaces)?;
        let n = write_capped(&dir, &dest, body, &mut quota).await?;
        tracing::info!(team = %team, hash = %hash, bytes = n, "template files uploaded");
        Ok(StatusCode::CREATED.into_response())
    };
    run.await.unwrap_or_else(|e: ApiError| e.into_response())
}
