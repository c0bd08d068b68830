//! A template's names and tags: whether a name exists (`/templates/aliases/{alias}`), pointing
//! tags at the build a `name:tag` names, removing them, and listing a template's tags.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{forbidden, own_template, rfc3339, uuid_of, valid_tag};
use crate::control::{parse_template_ref, record_error};
use crate::error::{ApiError, ApiResult};
use crate::state::{body, AppState, Auth};

#[utoipa::path(get, path = "/templates/aliases/{alias}", tag = "templates",
    summary = "Whether a template name exists",
    params(("alias" = String, Path, description = "A template name")),
    responses((status = 200, description = "templateID, public"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 403, description = "Another team's name", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn alias(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    let c = &s.control;
    let not_found = || ApiError::not_found(format!("template '{name}' not found"));
    let r = parse_template_ref(name.trim()).ok_or_else(not_found)?;
    if let Some(ns) = &r.namespace {
        if *ns != team.slug {
            return if c.name_taken(ns, &r.name).await? {
                Err(forbidden(format!(
                    "template '{name}' belongs to another team"
                )))
            } else {
                Err(not_found())
            };
        }
    }
    let t = c
        .records()
        .template_by_alias(&team.id, &r.name)
        .await
        .map_err(record_error)?
        .filter(|t| t.team_id.as_deref().is_none_or(|o| o == team.id))
        .ok_or_else(not_found)?;
    if r.tag.as_ref().is_some_and(|tag| !t.tags.contains_key(tag)) {
        return Err(not_found());
    }
    Ok(Json(json!({"templateID": t.id, "public": t.team_id.is_none()})).into_response())
}

#[derive(Deserialize)]
struct AssignTags {
    target: String,
    tags: Vec<String>,
}

#[derive(Deserialize)]
struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

#[utoipa::path(post, path = "/templates/tags", tag = "templates",
    summary = "Point tags at the build a name:tag names",
    responses((status = 201, description = "tags, buildID"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn assign_tags(
    State(s): State<AppState>,
    Auth(team): Auth,
    bytes: Bytes,
) -> ApiResult<Response> {
    let (c, team) = (&s.control, &team);
    let req: AssignTags = body(&bytes)?;
    if req.tags.is_empty() {
        return Err(ApiError::bad_request("tags must not be empty"));
    }
    if let Some(t) = req.tags.iter().find(|t| !valid_tag(t)) {
        return Err(ApiError::bad_request(format!("{t:?} is not a tag")));
    }
    let (_, _, build) = c.resolve_template(team, &req.target).await?;
    let mut t = own_template(c, team, &req.target).await?;
    for tag in &req.tags {
        t.tags.insert(tag.clone(), build.clone());
    }
    c.records().put_template(t).await.map_err(record_error)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"tags": req.tags, "buildID": uuid_of(&build.build_id)})),
    )
        .into_response())
}

#[utoipa::path(delete, path = "/templates/tags", tag = "templates",
    summary = "Remove tags of a template",
    responses((status = 204, description = "Removed"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn remove_tags(
    State(s): State<AppState>,
    Auth(team): Auth,
    bytes: Bytes,
) -> ApiResult<Response> {
    let (c, team) = (&s.control, &team);
    let req: RemoveTags = body(&bytes)?;
    let mut t = own_template(c, team, &req.name).await?;
    for tag in &req.tags {
        if t.tags.remove(tag).is_none() {
            return Err(ApiError::not_found(format!(
                "template '{}' has no tag '{tag}'",
                req.name
            )));
        }
    }
    c.records().put_template(t).await.map_err(record_error)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(get, path = "/templates/{templateID}/tags", tag = "templates",
    summary = "A template's tags",
    params(("templateID" = String, Path, description = "The template id or name")),
    responses((status = 200, description = "tag, buildID, createdAt of each"), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn tags_of(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let t = own_template(&s.control, &team, &id).await?;
    let out: Vec<Value> = t
        .tags
        .iter()
        .map(|(tag, b)| {
            json!({"tag": tag, "buildID": uuid_of(&b.build_id), "createdAt": rfc3339(t.created_at)})
        })
        .collect();
    Ok(Json(out).into_response())
}
