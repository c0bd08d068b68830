//! Named persistent volumes: the control plane (`/volumes`, by API key and team), the content
//! plane (`/volumecontent/{volumeID}/…`, by a volume token, in [`content`]) and the tokens.
//!
//! A volume is a row in the store (its name unique per team) and a directory
//! `<volumes_dir>/<volumeID>` that sandboxes mount through virtio-fs (the node's side) and the
//! content plane reads and writes through [`tree`], never following a name out of it.
//!
//! Where volumes live, their tokens and how mounts are resolved are `control::volumes`'s.

pub(crate) mod content;
pub use vmon_control::volumes::tree;

use std::path::Path;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use vmon_store::{NewVolume, Volume};

pub use crate::control::volumes::{valid_name, Refused, Volumes, MAX_NAME};
use crate::error::{ApiError, ApiResult};
use crate::records::Team;
use crate::state::{body, AppState, Auth};

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
        .route("/volumes/{id}", get(get_volume).delete(delete_volume))
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

fn record_error(e: anyhow::Error) -> ApiError {
    ApiError::records("the record store failed", &e)
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
    s.control.delete_store_volume(&v.id).await;
    let dir = volumes.dir_of(&v.id);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "removing a destroyed volume's files failed");
        }
    });
    tracing::info!(volume_id = %v.id, team_id = %team.id, "volume destroyed");
    Ok(StatusCode::NO_CONTENT)
}
