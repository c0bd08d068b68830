//! Named persistent volumes: the control plane (`/volumes`, by API key and team), the content
//! plane (`/volumecontent/{volumeID}/…`, by a volume token, in [`content`]) and the tokens.
//!
//! A volume is a row in the store (its name unique per team) and a directory
//! `<volumes_dir>/<volumeID>` that sandboxes mount through virtio-fs (the node's side) and the
//! content plane reads and writes through [`tree`], never following a name out of it.
//!
//! A token is `vt1.<teamID>.<expiry>.<mac>`: an HMAC-SHA256, under the key in
//! `volume_key_file`, of the volume id, its team and the expiry. It names no volume because
//! the URL does, so a token of one volume fails the MAC of every other; the team in clear lets
//! another team's token see 404, as every other route of another team's volume does.

mod content;
pub mod tree;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use time::OffsetDateTime;
use vmon_store::{NewVolume, Volume};

use crate::error::{ApiError, ApiResult};
use crate::records::Team;
use crate::state::{body, AppState, Auth};

/// The most characters of a volume name.
const MAX_NAME: usize = 128;

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

/// `Volume`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VolumeView {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
}

/// `VolumeAndToken`: a fresh content-plane token with every answer.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VolumeAndToken {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
    /// `Authorization: Bearer <token>` on `/volumecontent/{volumeID}/…`, for this volume only,
    /// until it expires.
    pub token: String,
}

/// `NewVolume`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct NewVolumeRequest {
    pub name: String,
}

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/volumes", get(list_volumes).post(create_volume))
        .route("/volumes/:id", get(get_volume).delete(delete_volume))
        .merge(content::routes())
}

fn enabled(s: &AppState) -> ApiResult<&Arc<Volumes>> {
    s.control.volumes().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "volumes are not configured on this server (volumes_dir, volume_key_file)",
        )
    })
}

pub(crate) fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn record_error(e: anyhow::Error) -> ApiError {
    ApiError::internal(format!("the records store failed: {e:#}"))
}

/// A volume id as infra checks it: a UUID, else 400.
fn parse_id(id: &str) -> ApiResult<String> {
    uuid::Uuid::parse_str(id)
        .map(|u| u.to_string())
        .map_err(|_| ApiError::bad_request(format!("invalid volume ID {id:?}: it must be a UUID")))
}

async fn team_volume(s: &AppState, team: &Team, id: &str) -> ApiResult<Volume> {
    let id = parse_id(id)?;
    s.control
        .records()
        .volume(&team.id, &id)
        .await
        .map_err(record_error)?
        .ok_or_else(|| ApiError::not_found(format!("volume {id:?} not found")))
}

#[utoipa::path(
    post, path = "/volumes", tag = "volumes",
    summary = "Create a named volume",
    request_body = NewVolumeRequest,
    responses(
        (status = 201, description = "The volume, with a content token", body = VolumeAndToken),
        (status = 400, description = "Invalid or taken name", body = crate::wire::ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = crate::wire::ErrorBody),
        (status = 429, description = "The team keeps its most volumes", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn create_volume(
    State(s): State<AppState>,
    Auth(team): Auth,
    bytes: Bytes,
) -> ApiResult<Response> {
    let volumes = enabled(&s)?.clone();
    let req: NewVolumeRequest = body(&bytes)?;
    if !valid_name(&req.name) {
        return Err(ApiError::bad_request(format!(
            "invalid volume name {:?}: use 1-{MAX_NAME} characters of [a-zA-Z0-9_-]",
            req.name
        )));
    }
    let records = s.control.records().clone();
    let max = s.control.config().quotas.max_volumes;
    let kept = records.volumes(&team.id).await.map_err(record_error)?.len();
    if kept >= max {
        return Err(ApiError::too_many(format!(
            "the team already keeps {kept} volumes, its most (quotas.max_volumes); destroy one first"
        )));
    }
    let id = uuid::Uuid::new_v4().to_string();
    let dir = volumes.dir_of(&id);
    make_root(&dir)
        .map_err(|e| ApiError::internal(format!("creating the volume directory failed: {e}")))?;
    let new = NewVolume {
        id: id.clone(),
        team_id: team.id.clone(),
        name: req.name.clone(),
    };
    let created = match records.create_volume(&new).await {
        Ok(Some(v)) => v,
        Ok(None) => {
            let _ = std::fs::remove_dir(&dir);
            return Err(ApiError::bad_request(format!(
                "Volume with name '{}' already exists",
                req.name
            )));
        }
        Err(e) => {
            let _ = std::fs::remove_dir(&dir);
            return Err(record_error(e));
        }
    };
    tracing::info!(volume_id = %created.id, team_id = %team.id, "volume created");
    let token = volumes.token(&created);
    Ok((
        StatusCode::CREATED,
        Json(VolumeAndToken {
            volume_id: created.id,
            name: created.name,
            token,
        }),
    )
        .into_response())
}

/// The volume root: a directory every guest user may write (the guest's own permission
/// checks apply below it).
fn make_root(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777))
}

#[utoipa::path(
    get, path = "/volumes", tag = "volumes",
    summary = "List the team's volumes",
    responses(
        (status = 200, description = "Every volume of the team, oldest first", body = Vec<VolumeView>),
        (status = 401, description = "Missing or invalid API key", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn list_volumes(
    State(s): State<AppState>,
    Auth(team): Auth,
) -> ApiResult<Json<Vec<VolumeView>>> {
    enabled(&s)?;
    let list = s
        .control
        .records()
        .volumes(&team.id)
        .await
        .map_err(record_error)?;
    Ok(Json(
        list.into_iter()
            .map(|v| VolumeView {
                volume_id: v.id,
                name: v.name,
            })
            .collect(),
    ))
}

#[utoipa::path(
    get, path = "/volumes/{volumeID}", tag = "volumes",
    summary = "Get a volume and a fresh content token",
    params(("volumeID" = String, Path, description = "The volume's UUID")),
    responses(
        (status = 200, description = "The volume, with a new token", body = VolumeAndToken),
        (status = 400, description = "Not a UUID", body = crate::wire::ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = crate::wire::ErrorBody),
        (status = 404, description = "No such volume in the team", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn get_volume(
    State(s): State<AppState>,
    Auth(team): Auth,
    UrlPath(id): UrlPath<String>,
) -> ApiResult<Json<VolumeAndToken>> {
    let volumes = enabled(&s)?.clone();
    let v = team_volume(&s, &team, &id).await?;
    let token = volumes.token(&v);
    Ok(Json(VolumeAndToken {
        volume_id: v.id,
        name: v.name,
        token,
    }))
}

#[utoipa::path(
    delete, path = "/volumes/{volumeID}", tag = "volumes",
    summary = "Destroy a volume and its files",
    params(("volumeID" = String, Path, description = "The volume's UUID")),
    responses(
        (status = 204, description = "Destroyed"),
        (status = 400, description = "Not a UUID", body = crate::wire::ErrorBody),
        (status = 401, description = "Missing or invalid API key", body = crate::wire::ErrorBody),
        (status = 404, description = "No such volume in the team", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn delete_volume(
    State(s): State<AppState>,
    Auth(team): Auth,
    UrlPath(id): UrlPath<String>,
) -> ApiResult<StatusCode> {
    let volumes = enabled(&s)?.clone();
    let v = team_volume(&s, &team, &id).await?;
    let gone = s
        .control
        .records()
        .delete_volume(&team.id, &v.id)
        .await
        .map_err(record_error)?;
    if !gone {
        return Err(ApiError::not_found(format!("volume {:?} not found", v.id)));
    }
    // The row is what makes the volume exist; its files go after (as in infra). Sandboxes
    // that still mount it see them go.
    let dir = volumes.dir_of(&v.id);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "removing a destroyed volume's files failed");
        }
    });
    tracing::info!(volume_id = %v.id, team_id = %team.id, "volume destroyed");
    Ok(StatusCode::NO_CONTENT)
}
