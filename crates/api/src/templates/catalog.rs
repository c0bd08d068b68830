//! The team's templates as `GET /templates` shows them (with the shared ones), one template
//! with its builds, updating one (`public: false` only) and deleting a template or snapshot.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use vmon_proto::node::BuildInfo;

use super::{own_template, rfc3339, uuid_of, DEFAULT_TAG};
use crate::control::{record_error, Control};
use crate::error::{ApiError, ApiResult};
use crate::records::{Team, TemplateKind, TemplateRecord};
use crate::state::{body, AppState, Auth};

/// One template as `GET /templates` lists it.
async fn template_json(
    c: &Control,
    team: &Team,
    t: &TemplateRecord,
    with_builds: bool,
) -> ApiResult<Value> {
    let builds = c
        .records()
        .template_builds_of(&t.id)
        .await
        .map_err(record_error)?;
    let current: Option<&BuildInfo> = t.tags.get(DEFAULT_TAG).or_else(|| t.tags.values().next());
    let latest = builds.first();
    let status = match (latest, current) {
        (Some(b), _) => b.state.as_str(),
        (None, Some(_)) => "ready",
        (None, None) => "waiting",
    };
    let build_id = latest
        .map(|b| b.build_id.clone())
        .or_else(|| current.map(|b| uuid_of(&b.build_id)))
        .unwrap_or_default();
    let (vcpus, mem, disk, envd) = match (current, latest) {
        (Some(b), _) => (b.vcpus, b.memory_mb, b.disk_mb, b.envd_version.clone()),
        (None, Some(b)) => (b.vcpus, b.memory_mb, b.disk_mb, String::new()),
        (None, None) => (0, 0, 0, String::new()),
    };
    let alias = t.alias.clone().unwrap_or_default();
    let names = match &t.team_id {
        Some(_) => vec![format!("{}/{alias}", team.slug)],
        None => vec![alias.clone()],
    };
    let mut v = json!({
        "templateID": t.id,
        "buildID": build_id,
        "cpuCount": vcpus,
        "memoryMB": mem,
        "diskSizeMB": disk,
        "public": t.team_id.is_none(),
        "aliases": [alias],
        "names": names,
        "createdAt": rfc3339(t.created_at),
        "updatedAt": rfc3339(latest.and_then(|b| b.finished_at).unwrap_or(t.created_at)),
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": builds.len().max(usize::from(current.is_some())),
        "envdVersion": envd,
        "buildStatus": status,
    });
    if with_builds {
        v["builds"] = builds
            .iter()
            .map(|b| {
                let mut x = json!({
                    "buildID": b.build_id,
                    "status": b.state.as_str(),
                    "createdAt": rfc3339(b.created_at),
                    "updatedAt": rfc3339(b.finished_at.unwrap_or(b.created_at)),
                    "cpuCount": b.vcpus,
                    "memoryMB": b.memory_mb,
                    "diskSizeMB": b.disk_mb,
                });
                if let Some(f) = b.finished_at {
                    x["finishedAt"] = json!(rfc3339(f));
                }
                x
            })
            .collect();
    }
    Ok(v)
}

#[utoipa::path(get, path = "/templates", tag = "templates",
    summary = "The team's templates and the shared ones",
    responses((status = 200, description = "Templates"), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn list(State(s): State<AppState>, Auth(team): Auth) -> ApiResult<Response> {
    let c = &s.control;
    let mut out = Vec::new();
    for t in c
        .records()
        .templates_of(&team.id)
        .await
        .map_err(record_error)?
    {
        if matches!(t.kind, TemplateKind::Template) {
            out.push(template_json(c, &team, &t, false).await?);
        }
    }
    Ok(Json(out).into_response())
}

#[utoipa::path(get, path = "/v2/templates", tag = "templates",
    summary = "The team's templates and the shared ones",
    responses((status = 200, description = "Templates"),
        (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn list_v2(s: State<AppState>, a: Auth) -> ApiResult<Response> {
    list(s, a).await
}

#[utoipa::path(get, path = "/templates/{templateID}", tag = "templates",
    summary = "A template with its builds",
    params(("templateID" = String, Path, description = "The template id or name")),
    responses((status = 200, description = "The template"), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn get_template(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let t = own_template(&s.control, &team, &id).await?;
    Ok(Json(template_json(&s.control, &team, &t, true).await?).into_response())
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Patch {
    public: Option<bool>,
}

async fn patch(c: &Control, team: &Team, id: &str, bytes: &Bytes) -> ApiResult<Response> {
    let req: Patch = body(bytes)?;
    let t = own_template(c, team, id).await?;
    if req.public == Some(true) {
        return Err(ApiError::bad_request(
            "public templates are not offered: a template is its team's",
        ));
    }
    let alias = t.alias.unwrap_or_default();
    Ok(Json(json!({"names": [format!("{}/{alias}", team.slug)]})).into_response())
}

#[utoipa::path(patch, path = "/templates/{templateID}", tag = "templates",
    summary = "Update a template (public: false only)",
    params(("templateID" = String, Path, description = "The template id or name")),
    responses((status = 200, description = "names"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn patch_v1(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    patch(&s.control, &team, &id, &bytes).await
}

#[utoipa::path(patch, path = "/v2/templates/{templateID}", tag = "templates",
    summary = "Update a template (public: false only)",
    params(("templateID" = String, Path, description = "The template id or name")),
    responses((status = 200, description = "names"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn patch_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    patch(&s.control, &team, &id, &bytes).await
}

/// `DELETE /templates/{id}`: a template, a snapshot or one tag of either (`name:tag`).
#[utoipa::path(delete, path = "/templates/{templateID}", tag = "templates",
    summary = "Delete a template or snapshot of the team",
    params(("templateID" = String, Path, description = "The template or snapshot id or name")),
    responses((status = 204, description = "Deleted"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody),
        (status = 409, description = "A sandbox still uses it", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn delete(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let control = s.control.clone();
    match tokio::spawn(async move { control.delete_template(&team, &id).await }).await {
        Ok(deleted) => deleted?,
        Err(e) => return Err(ApiError::internal(format!("the operation failed: {e}"))),
    }
    Ok(StatusCode::NO_CONTENT)
}
