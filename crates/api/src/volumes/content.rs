//! The content plane: `/volumecontent/{volumeID}/{dir,path,file}` with
//! `Authorization: Bearer <volume token>`, plain HTTP with JSON or raw bytes. Errors are
//! `{"code": <string>, "message"}` (a string code here, unlike the control plane).
//!
//! Who may: a token whose team is not the volume's sees 404 (another team's volume does not
//! exist for it); a token of the same team that is not this volume's, or has expired, is 401.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;

use super::tree::{EntryStat, Owner, Tree, TreeError, VolumePath};
use super::Volumes;
use crate::state::{query_pairs, AppState};

/// The deepest listing infra answers.
const MAX_LIST_DEPTH: u32 = 10;
/// The most a metadata PATCH body may hold.
const MAX_PATCH_BODY: usize = 4096;

pub(super) fn routes() -> Router<AppState> {
    Router::new()
        .route("/volumecontent/{id}/dir", get(list_dir).post(make_dir))
        .route(
            "/volumecontent/{id}/path",
            get(stat_path).patch(patch_path).delete(remove_path),
        )
        .route("/volumecontent/{id}/file", get(read_file).put(write_file))
}

/// The content plane's `Error`: `code` is a string.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ContentError {
    #[serde(skip)]
    status: u16,
    pub code: String,
    pub message: String,
}

impl ContentError {
    fn new(status: StatusCode, message: impl Into<String>) -> ContentError {
        let code = match status {
            StatusCode::BAD_REQUEST => "bad_request",
            StatusCode::UNAUTHORIZED => "unauthorized",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::CONFLICT => "already_exists",
            StatusCode::PAYLOAD_TOO_LARGE => "too_large",
            StatusCode::INSUFFICIENT_STORAGE => "quota_exceeded",
            StatusCode::NOT_IMPLEMENTED => "not_implemented",
            _ => "internal",
        };
        ContentError {
            status: status.as_u16(),
            code: code.to_string(),
            message: message.into(),
        }
    }
    fn bad(message: impl Into<String>) -> ContentError {
        ContentError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<TreeError> for ContentError {
    fn from(e: TreeError) -> ContentError {
        match e {
            TreeError::NotFound(m) => ContentError::new(StatusCode::NOT_FOUND, m),
            TreeError::Exists(m) => ContentError::new(StatusCode::CONFLICT, m),
            TreeError::Invalid(m) => ContentError::bad(m),
            TreeError::Io(m) => ContentError::new(StatusCode::INTERNAL_SERVER_ERROR, m),
        }
    }
}

impl IntoResponse for ContentError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::warn!(status = self.status, message = %self.message, "volume content request failed");
        }
        (status, Json(self)).into_response()
    }
}

type ContentResult<T> = Result<T, ContentError>;

/// The volume a request may touch, and its tree's directory.
struct Access {
    volumes: Arc<Volumes>,
    volume: vmon_store::Volume,
}

impl Access {
    async fn of(s: &AppState, id: &str, headers: &HeaderMap) -> ContentResult<Access> {
        let volumes = s.control.volumes().cloned().ok_or_else(|| {
            ContentError::new(
                StatusCode::NOT_IMPLEMENTED,
                "volumes are not configured on this server",
            )
        })?;
        if let Some(why) = vmon_control::volumes::store::content_refused(s.control.config()) {
            return Err(ContentError::new(StatusCode::NOT_IMPLEMENTED, why));
        }
        let token = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ContentError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing volume token: send Authorization: Bearer <token>",
                )
            })?;
        let not_found =
            || ContentError::new(StatusCode::NOT_FOUND, format!("volume {id:?} not found"));
        let id = uuid::Uuid::parse_str(id)
            .map_err(|_| ContentError::bad(format!("invalid volume ID {id:?}: it must be a UUID")))?
            .to_string();
        let volume = s
            .control
            .records()
            .volume_by_id(&id)
            .await
            .map_err(|e| {
                ContentError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the records store failed: {e:#}"),
                )
            })?
            .ok_or_else(not_found)?;
        match volumes.verify(&volume, token) {
            Ok(()) => Ok(Access { volumes, volume }),
            Err(super::Refused::OtherTeam) => Err(not_found()),
            Err(super::Refused::Invalid(why)) => {
                Err(ContentError::new(StatusCode::UNAUTHORIZED, why))
            }
        }
    }

    async fn run<T, F>(&self, f: F) -> ContentResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Tree) -> Result<T, TreeError> + Send + 'static,
    {
        let dir = self.volumes.dir_of(&self.volume.id);
        tokio::task::spawn_blocking(move || {
            let tree = Tree::open(&dir)?;
            f(&tree)
        })
        .await
        .map_err(|e| {
            ContentError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the volume operation failed: {e}"),
            )
        })?
        .map_err(ContentError::from)
    }
}

/// The query of a content request: `path` (required) and the options of each call.
struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    fn parse(raw: Option<String>) -> ContentResult<Query> {
        let pairs = query_pairs(raw).map_err(|e| ContentError::bad(e.message))?;
        Ok(Query { pairs })
    }
    fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
    fn path(&self) -> ContentResult<VolumePath> {
        let raw = self
            .get("path")
            .ok_or_else(|| ContentError::bad("the query parameter path is required"))?;
        Ok(VolumePath::parse(raw)?)
    }
    fn number(&self, name: &str, max: u32) -> ContentResult<Option<u32>> {
        // Present means a value: an empty one is not a number (the SDKs omit what is unset).
        match self.get(name) {
            None => Ok(None),
            Some(v) => match crate::state::query_int::<u32>(v) {
                Some(n) if n <= max => Ok(Some(n)),
                _ => Err(ContentError::bad(format!(
                    "{name} must be a decimal number of at most {max}"
                ))),
            },
        }
    }
    fn flag(&self, name: &str) -> ContentResult<bool> {
        match self.get(name) {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(v) => Err(ContentError::bad(format!(
                "{name} must be true or false, not {v:?}"
            ))),
        }
    }
    fn owner(&self) -> ContentResult<Owner> {
        // u32::MAX is chown's "leave it": not an owner.
        Ok(Owner {
            uid: self.number("uid", u32::MAX - 1)?,
            gid: self.number("gid", u32::MAX - 1)?,
            mode: self.number("mode", 0o7777)?,
        })
    }
}

#[utoipa::path(
    get, path = "/volumecontent/{volumeID}/dir", tag = "volumes",
    summary = "List a directory of a volume, `depth` levels down (1-10)",
    params(("volumeID" = String, Path, description = "The volume's UUID"), ("path" = String, Query, description = "Path in the volume"), ("depth" = Option<u32>, Query, description = "Levels to list, 1-10 (default 1)")),
    responses(
        (status = 200, description = "The entries, sorted by path", body = Vec<EntryStat>),
        (status = 400, description = "Invalid path or option", body = ContentError),
        (status = 401, description = "Missing, expired or another volume's token", body = ContentError),
        (status = 404, description = "No such volume or path (or another team's token)", body = ContentError),
    ),
    security(("VolumeToken" = []))
)]
pub(crate) async fn list_dir(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ContentResult<Json<Vec<EntryStat>>> {
    let access = Access::of(&s, &id, &headers).await?;
    let q = Query::parse(raw)?;
    let path = q.path()?;
    let depth = match q.get("depth") {
        None => 1,
        Some(v) => match crate::state::query_int::<u32>(v) {
            Some(d) if (1..=MAX_LIST_DEPTH).contains(&d) => d,
            _ => {
                return Err(ContentError::bad(format!(
                    "depth must be between 1 and {MAX_LIST_DEPTH}"
                )))
            }
        },
    };
    Ok(Json(access.run(move |t| t.list(&path, depth)).await?))
}

#[utoipa::path(
    post, path = "/volumecontent/{volumeID}/dir", tag = "volumes",
    summary = "Make a directory (`force`: parents too, an existing directory is fine)",
    params(("volumeID" = String, Path, description = "The volume's UUID"), ("path" = String, Query, description = "Path in the volume"), ("uid" = Option<u32>, Query, description = "Owner (default 9090)"), ("gid" = Option<u32>, Query, description = "Group (default 9090)"), ("mode" = Option<u32>, Query, description = "Mode, decimal (default 0o777)"), ("force" = Option<bool>, Query, description = "Make parents; tolerate an existing directory")),
    responses(
        (status = 201, description = "The directory", body = EntryStat), (status = 409, description = "It exists (without force)", body = ContentError),
        (status = 400, description = "Invalid path or option", body = ContentError),
        (status = 401, description = "Missing, expired or another volume's token", body = ContentError),
        (status = 404, description = "No such volume or path (or another team's token)", body = ContentError),
    ),
    security(("VolumeToken" = []))
)]
pub(crate) async fn make_dir(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ContentResult<Response> {
    let access = Access::of(&s, &id, &headers).await?;
    let q = Query::parse(raw)?;
    let (path, owner, force) = (q.path()?, q.owner()?, q.flag("force")?);
    let stat = access.run(move |t| t.make_dir(&path, owner, force)).await?;
    Ok((StatusCode::CREATED, Json(stat)).into_response())
}

#[utoipa::path(
    get, path = "/volumecontent/{volumeID}/path", tag = "volumes",
    summary = "Stat a path of a volume",
    params(("volumeID" = String, Path, description = "The volume's UUID"), ("path" = String, Query, description = "Path in the volume")),
    responses(
        (status = 200, description = "The entry", body = EntryStat),
        (status = 400, description = "Invalid path or option", body = ContentError),
        (status = 401, description = "Missing, expired or another volume's token", body = ContentError),
        (status = 404, description = "No such volume or path (or another team's token)", body = ContentError),
    ),
    security(("VolumeToken" = []))
)]
pub(crate) async fn stat_path(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ContentResult<Json<EntryStat>> {
    let access = Access::of(&s, &id, &headers).await?;
    let path = Query::parse(raw)?.path()?;
    Ok(Json(access.run(move |t| t.stat(&path)).await?))
}

/// `PATCH …/path` body.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct MetadataPatch {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

#[utoipa::path(
    patch, path = "/volumecontent/{volumeID}/path", tag = "volumes",
    summary = "Change the owner or mode of a path",
    params(("volumeID" = String, Path, description = "The volume's UUID"), ("path" = String, Query, description = "Path in the volume")),
    request_body = MetadataPatch,
    responses(
        (status = 200, description = "The entry", body = EntryStat),
        (status = 400, description = "Invalid path or option", body = ContentError),
        (status = 401, description = "Missing, expired or another volume's token", body = ContentError),
        (status = 404, description = "No such volume or path (or another team's token)", body = ContentError),
    ),
    security(("VolumeToken" = []))
)]
pub(crate) async fn patch_path(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Body,
) -> ContentResult<Json<EntryStat>> {
    let access = Access::of(&s, &id, &headers).await?;
    let path = Query::parse(raw)?.path()?;
    let bytes: Bytes = axum::body::to_bytes(body, MAX_PATCH_BODY)
        .await
        .map_err(|_| {
            ContentError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body must be at most {MAX_PATCH_BODY} bytes"),
            )
        })?;
    let patch: MetadataPatch = if bytes.iter().all(u8::is_ascii_whitespace) {
        MetadataPatch::default()
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| ContentError::bad(format!("invalid request body: {e}")))?
    };
    if patch.mode.is_some_and(|m| m > 0o7777)
        || patch.uid == Some(u32::MAX)
        || patch.gid == Some(u32::MAX)
    {
        return Err(ContentError::bad(
            "mode must be at most 0o7777 and uid/gid below 4294967295",
        ));
    }
    let owner = Owner {
        uid: patch.uid,
        gid: patch.gid,
        mode: patch.mode,
    };
    Ok(Json(access.run(move |t| t.set_meta(&path, owner)).await?))
}

#[utoipa::path(
    delete, path = "/volumecontent/{volumeID}/path", tag = "volumes",
    summary = "Remove a path, recursively (not the root)",
    params(("volumeID" = String, Path, description = "The volume's UUID"), ("path" = String, Query, description = "Path in the volume")),
    responses(
        (status = 204, description = "Removed"),
        (status = 400, description = "Invalid path or option", body = ContentError),
        (status = 401, description = "Missing, expired or another volume's token", body = ContentError),
        (status = 404, description = "No such volume or path (or another team's token)", body = ContentError),
    ),
    security(("VolumeToken" = []))
)]
pub(crate) async fn remove_path(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ContentResult<StatusCode> {
    let access = Access::of(&s, &id, &headers).await?;
    let path = Query::parse(raw)?.path()?;
    access.run(move |t| t.remove(&path)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    get, path = "/volumecontent/{volumeID}/file", tag = "volumes",
    summary = "Read a file (streamed, application/octet-stream)",
    params(("volumeID" = String, Path, description = "The volume's UUID"), ("path" = String, Query, description = "Path in the volume")),
    responses(
        (status = 200, description = "The bytes", content_type = "application/octet-stream"),
        (status = 400, description = "Invalid path or option", body = ContentError),
        (status = 401, description = "Missing, expired or another volume's token", body = ContentError),
        (status = 404, description = "No such volume or path (or another team's token)", body = ContentError),
    ),
    security(("VolumeToken" = []))
)]
pub(crate) async fn read_file(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
) -> ContentResult<Response> {
    let access = Access::of(&s, &id, &headers).await?;
    let path = Query::parse(raw)?.path()?;
    let file = access.run(move |t| t.open_read(&path)).await?;
    let len = file.metadata().map(|m| m.len()).ok();
    let stream =
        tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), 1 << 20);
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    if let Some(len) = len {
        h.insert(header::CONTENT_LENGTH, header::HeaderValue::from(len));
    }
    Ok(resp)
}

#[utoipa::path(
    put, path = "/volumecontent/{volumeID}/file", tag = "volumes",
    summary = "Write a file from the raw body (streamed; `force`: parents too, truncate an existing file)",
    params(("volumeID" = String, Path, description = "The volume's UUID"), ("path" = String, Query, description = "Path in the volume"), ("uid" = Option<u32>, Query, description = "Owner (default 9090)"), ("gid" = Option<u32>, Query, description = "Group (default 9090)"), ("mode" = Option<u32>, Query, description = "Mode, decimal (default 0o666)"), ("force" = Option<bool>, Query, description = "Make parents; truncate an existing file")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "The file's bytes"),
    responses(
        (status = 201, description = "The file as written", body = EntryStat), (status = 409, description = "It exists (without force)", body = ContentError), (status = 507, description = "The team's volumes would pass quotas.max_volume_bytes", body = ContentError),
        (status = 400, description = "Invalid path or option", body = ContentError),
        (status = 401, description = "Missing, expired or another volume's token", body = ContentError),
        (status = 404, description = "No such volume or path (or another team's token)", body = ContentError),
    ),
    security(("VolumeToken" = []))
)]
pub(crate) async fn write_file(
    State(s): State<AppState>,
    UrlPath(id): UrlPath<String>,
    headers: HeaderMap,
    RawQuery(raw): RawQuery,
    body: Body,
) -> ContentResult<Response> {
    let access = Access::of(&s, &id, &headers).await?;
    let q = Query::parse(raw)?;
    let (path, owner, force) = (q.path()?, q.owner()?, q.flag("force")?);
    let limit = s.control.config().quotas.max_volume_bytes;
    let used = team_usage(&s, &access).await?;
    let open_path = path.clone();
    let file = access
        .run(move |t| t.create_file(&open_path, owner, force))
        .await?;
    let mut out = tokio::fs::File::from_std(file);
    let mut written: u64 = 0;
    let mut stream = body.into_data_stream();
    let failed = loop {
        let Some(chunk) = stream.next().await else {
            break None;
        };
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                break Some(ContentError::bad(format!(
                    "reading the request body failed: {e}"
                )))
            }
        };
        written += chunk.len() as u64;
        if used.saturating_add(written) > limit {
            break Some(ContentError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                format!("the team's volumes would hold more than {limit} bytes (quotas.max_volume_bytes)"),
            ));
        }
        if let Err(e) = out.write_all(&chunk).await {
            break Some(ContentError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("writing {} failed: {e}", path.display()),
            ));
        }
    };
    let file = out.into_std().await;
    if let Some(e) = failed {
        let remove = path.clone();
        let _ = access.run(move |t| t.remove(&remove)).await;
        return Err(e);
    }
    let stat = access.run(move |t| t.written(&path, &file)).await?;
    Ok((StatusCode::CREATED, Json(stat)).into_response())
}

/// Bytes the team's volumes hold now.
async fn team_usage(s: &AppState, access: &Access) -> ContentResult<u64> {
    let list = s
        .control
        .records()
        .volumes(&access.volume.team_id)
        .await
        .map_err(|e| {
            ContentError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the records store failed: {e:#}"),
            )
        })?;
    let dirs: Vec<_> = list.iter().map(|v| access.volumes.dir_of(&v.id)).collect();
    tokio::task::spawn_blocking(move || dirs.iter().map(|d| super::tree::usage(d)).sum())
        .await
        .map_err(|e| {
            ContentError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("measuring the team's volumes failed: {e}"),
            )
        })
}
