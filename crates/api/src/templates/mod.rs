//! E2B's template-build API (the Template SDK and `e2b template create`): requesting a build,
//! uploading its files, starting it, polling its status and logs, names and tags, listing and
//! deleting templates. The wire is in the project's `TEMPLATE-WIRE.md`; the build itself runs
//! in `build.rs`, its steps are checked in `steps.rs`, uploads are kept by `files.rs`, and a base
//! from an OCI registry is named and keyed in `image.rs`.
//!
//! The SDKs send a name such as `team/name:v1` as one percent-encoded segment
//! (`team%2Fname%3Av1`): the router matches the raw path and decodes a segment after matching.

mod build;
pub(crate) mod files;
pub mod image;
pub mod steps;

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use vmon_proto::node::BuildInfo;

pub use files::Uploads;

use crate::control::{parse_template_ref, record_error, Control};
use crate::error::{ApiError, ApiResult};
use crate::ids;
use crate::records::{BuildState, Team, TemplateBuild, TemplateKind, TemplateRecord};
use crate::state::{body, query_pairs, AppState, Auth};

/// Tags every template build gets unless the request names its own.
const DEFAULT_TAG: &str = "default";
/// Most log entries one status page holds.
const MAX_PAGE: i64 = 100;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v3/templates", post(request_build))
        .route("/v2/templates", get(list_v2).post(legacy_v2))
        .route("/templates", get(list).post(legacy))
        .route("/v2/templates/:id/builds/:build", post(start_build))
        .route("/v2/templates/:id", axum::routing::patch(patch_v2))
        .route("/templates/tags", post(assign_tags).delete(remove_tags))
        .route("/templates/aliases/:alias", get(alias))
        .route(
            "/templates/:id",
            get(get_template).patch(patch_v1).delete(delete),
        )
        .route("/templates/:id/tags", get(tags_of))
        .route("/templates/:id/files/:hash", get(files_probe))
        .route("/templates/:id/builds/:build/status", get(status))
        .route("/templates/:id/builds/:build/logs", get(logs))
        .route("/template-files/:team/:hash", put(files::upload))
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

/// A UUID for a node build (the SDK insists tag answers carry one).
fn uuid_of(build_id: &str) -> String {
    if uuid::Uuid::parse_str(build_id).is_ok() {
        return build_id.to_string();
    }
    use sha2::Digest;
    let d = sha2::Sha256::digest(build_id.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    uuid::Uuid::from_bytes(b).to_string()
}

fn forbidden(msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, msg)
}

#[utoipa::path(post, path = "/templates", tag = "templates",
    summary = "The legacy Docker-push build (answers 400: use the Template SDK)",
    responses((status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn legacy(_auth: Auth) -> ApiError {
    ApiError::bad_request(
        "this endpoint is the legacy Docker-push build flow, which vmon does not offer: build \
         with `e2b template create <name>` (CLI 2.x) or the Template SDK (Template.build)",
    )
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct BuildRequest {
    name: Option<String>,
    alias: Option<String>,
    tags: Vec<String>,
    cpu_count: Option<i64>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<i64>,
    min_free_disk_mb: Option<i64>,
}

fn valid_tag(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[utoipa::path(post, path = "/v3/templates", tag = "templates",
    summary = "Request a template build (Template SDK)",
    responses((status = 202, description = "templateID, buildID, public, names, tags, aliases"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody),
        (status = 403, description = "A name in another team's namespace", body = crate::wire::ErrorBody),
        (status = 409, description = "The name is a snapshot's or a built-in template's", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn request_build(
    State(s): State<AppState>,
    Auth(team): Auth,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: BuildRequest = body(&bytes)?;
    let name = req
        .name
        .or(req.alias)
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    let r = parse_template_ref(name.trim()).ok_or_else(|| {
        ApiError::bad_request(format!(
            "{name:?} is not a template name ([team/]name[:tag], letters, digits, - _ .)"
        ))
    })?;
    if let Some(ns) = &r.namespace {
        if *ns != team.slug {
            return Err(forbidden(format!(
                "the name {name:?} belongs to another team's namespace"
            )));
        }
    }
    let mut tags: Vec<String> = req.tags.clone();
    if let Some(t) = &r.tag {
        tags.insert(0, t.clone());
    }
    if tags.is_empty() {
        tags.push(DEFAULT_TAG.into());
    }
    tags.dedup();
    if let Some(t) = tags.iter().find(|t| !valid_tag(t)) {
        return Err(ApiError::bad_request(format!("{t:?} is not a tag")));
    }
    let c = &s.control;
    let base = &c.config().base_template;
    let vcpus = req.cpu_count.unwrap_or(i64::from(base.vcpus));
    let memory_mb = req.memory_mb.unwrap_or(i64::from(base.memory_mb));
    if vcpus < 1 || vcpus > i64::from(team.limits.max_vcpus).min(64) {
        return Err(ApiError::bad_request(format!(
            "cpuCount must be between 1 and {}",
            team.limits.max_vcpus.min(64)
        )));
    }
    if memory_mb < 128 || memory_mb > i64::from(team.limits.max_memory_mb) {
        return Err(ApiError::bad_request(format!(
            "memoryMB must be between 128 and {}",
            team.limits.max_memory_mb
        )));
    }
    let min_disk = req.min_free_disk_mb.unwrap_or(0);
    if min_disk < 0 || min_disk > i64::from(team.limits.max_disk_mb) {
        return Err(ApiError::bad_request(format!(
            "minFreeDiskMb must be between 0 and {}",
            team.limits.max_disk_mb
        )));
    }
    if r.name == "base" || crate::control::builtin_name(&r.name) {
        return Err(ApiError::conflict(format!(
            "{:?} is a built-in template's name",
            r.name
        )));
    }
    let records = c.records();
    let existing = records
        .template_by_alias(&team.id, &r.name)
        .await
        .map_err(record_error)?
        .filter(|t| t.team_id.as_deref() == Some(team.id.as_str()));
    let template = match existing {
        Some(t) if matches!(t.kind, TemplateKind::Snapshot { .. }) => {
            return Err(ApiError::conflict(format!(
                "{:?} is the name of a snapshot",
                r.name
            )))
        }
        Some(t) => t,
        None => {
            let t = TemplateRecord {
                id: ids::template_id(),
                team_id: Some(team.id.clone()),
                alias: Some(r.name.clone()),
                kind: TemplateKind::Template,
                tags: BTreeMap::new(),
                created_at: OffsetDateTime::now_utc(),
            };
            records
                .put_template(t.clone())
                .await
                .map_err(record_error)?;
            t
        }
    };
    let build = TemplateBuild {
        build_id: ids::build_id(),
        template_id: template.id.clone(),
        team_id: team.id.clone(),
        state: BuildState::Waiting,
        tags: tags.clone(),
        vcpus: vcpus as u32,
        memory_mb: memory_mb as u32,
        disk_mb: (min_disk as u32).max(base.disk_mb),
        start: None,
        failure: None,
        result: None,
        created_at: OffsetDateTime::now_utc(),
        finished_at: None,
    };
    records
        .put_template_build(&build)
        .await
        .map_err(record_error)?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({
            "templateID": template.id,
            "buildID": build.build_id,
            "public": false,
            "names": [format!("{}/{}", team.slug, r.name)],
            "tags": tags,
            "aliases": [r.name],
        })),
    )
        .into_response())
}

/// The team's own template named by an id or a name (`404` for anything else).
async fn own_template(c: &Control, team: &Team, id_or_name: &str) -> ApiResult<TemplateRecord> {
    let not_found = || ApiError::not_found(format!("template '{id_or_name}' not found"));
    let r = parse_template_ref(id_or_name.trim()).ok_or_else(not_found)?;
    if r.namespace.as_ref().is_some_and(|ns| *ns != team.slug) {
        return Err(not_found());
    }
    let records = c.records();
    let by_id = records
        .template_by_id(&r.name)
        .await
        .map_err(record_error)?;
    let t = match by_id {
        Some(t) => Some(t),
        None => records
            .template_by_alias(&team.id, &r.name)
            .await
            .map_err(record_error)?,
    };
    t.filter(|t| t.team_id.as_deref() == Some(team.id.as_str()))
        .ok_or_else(not_found)
}

async fn own_build(
    c: &Control,
    team: &Team,
    template: &str,
    build: &str,
) -> ApiResult<TemplateBuild> {
    let not_found = || {
        ApiError::not_found(format!(
            "build '{build}' of template '{template}' not found"
        ))
    };
    let b = c
        .records()
        .template_build(build)
        .await
        .map_err(record_error)?
        .ok_or_else(not_found)?;
    if b.team_id != team.id {
        return Err(not_found());
    }
    if b.template_id != template {
        let t = own_template(c, team, template).await?;
        if t.id != b.template_id {
            return Err(not_found());
        }
    }
    Ok(b)
}

#[utoipa::path(post, path = "/v2/templates/{templateID}/builds/{buildID}", tag = "templates",
    summary = "Start a requested build with its steps",
    params(("templateID" = String, Path, description = "The template"), ("buildID" = String, Path, description = "The build")),
    responses((status = 202, description = "The build runs"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody),
        (status = 409, description = "The build was already started", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn start_build(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path((template, build_id)): Path<(String, String)>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let c = s.control.clone();
    let mut build = own_build(&c, &team, &template, &build_id).await?;
    if build.start.is_some() || build.state != BuildState::Waiting {
        return Err(ApiError::conflict(format!(
            "build {build_id} was already started"
        )));
    }
    let raw: Value = body(&bytes)?;
    let start: steps::BuildStart = serde_json::from_value(raw.clone())
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    let plan = steps::plan(&start)?;
    for (i, (action, _)) in plan.iter().enumerate() {
        if let steps::Action::Copy { files_hash, .. } = action {
            if !c.template_file(&team.id, files_hash).is_file() {
                return Err(ApiError::bad_request(format!(
                    "step {}: the files {files_hash} were never uploaded",
                    i + 1
                )));
            }
        }
    }
    if start.from_image.is_some() && start.from_template.is_some() {
        return Err(ApiError::bad_request(
            "fromImage and fromTemplate exclude each other",
        ));
    }
    if let Some(t) = &start.from_template {
        c.resolve_template(&team, t)
            .await
            .map_err(|e| ApiError::bad_request(format!("fromTemplate {t:?}: {}", e.message)))?;
    }
    build.start = Some(redact(raw));
    // Building from the trigger on, as E2B reports it, unless it has to wait for a slot.
    if c.template_builds.available_permits() > 0 {
        build.state = BuildState::Building;
    }
    c.records()
        .put_template_build(&build)
        .await
        .map_err(record_error)?;
    tokio::spawn(c.clone().run_template_build(team, build, start));
    Ok(StatusCode::ACCEPTED.into_response())
}

/// The trigger's body as it is kept: registry credentials never reach the store.
fn redact(mut raw: Value) -> Value {
    if let Some(obj) = raw
        .get_mut("fromImageRegistry")
        .and_then(Value::as_object_mut)
    {
        for (k, v) in obj.iter_mut() {
            if k != "type" && k != "username" && k != "awsRegion" {
                *v = json!("[redacted]");
            }
        }
    }
    raw
}

#[utoipa::path(get, path = "/templates/{templateID}/builds/{buildID}/status", tag = "templates",
    summary = "A build's status and a page of its log entries",
    params(("templateID" = String, Path, description = "The template"), ("buildID" = String, Path, description = "The build"),
        ("logsOffset" = Option<i64>, Query, description = "Index of the first entry"),
        ("limit" = Option<i64>, Query, description = "Entries per page, at most 100")),
    responses((status = 200, description = "status, logEntries, reason when failed"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn status(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path((template, build_id)): Path<(String, String)>,
    RawQuery(query): RawQuery,
) -> ApiResult<Response> {
    let c = &s.control;
    let b = own_build(c, &team, &template, &build_id).await?;
    let pairs = query_pairs(query)?;
    let num = |name: &str, default: i64| -> ApiResult<i64> {
        match pairs.iter().rev().find(|(k, _)| k == name) {
            Some((_, v)) => v
                .trim()
                .parse::<i64>()
                .ok()
                .filter(|n| *n >= 0)
                .ok_or_else(|| ApiError::bad_request(format!("{name} must be a number ≥ 0"))),
            None => Ok(default),
        }
    };
    let offset = num("logsOffset", 0)?;
    let limit = num("limit", MAX_PAGE)?.min(MAX_PAGE);
    let entries = c
        .records()
        .build_logs(&b.build_id, offset, limit)
        .await
        .map_err(record_error)?;
    let log_entries: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = json!({
                "timestamp": rfc3339(e.timestamp),
                "level": e.level,
                "message": e.message,
            });
            if let Some(s) = &e.step {
                v["step"] = json!(s);
            }
            v
        })
        .collect();
    let logs: Vec<String> = entries
        .iter()
        .map(|e| format!("{} {}", rfc3339(e.timestamp), e.message))
        .collect();
    let mut out = json!({
        "templateID": b.template_id,
        "buildID": b.build_id,
        "status": b.state.as_str(),
        "logs": logs,
        "logEntries": log_entries,
    });
    if let (BuildState::Error, Some(f)) = (b.state, &b.failure) {
        let mut reason = json!({ "message": f.message });
        if let Some(step) = &f.step {
            reason["step"] = json!(step);
        }
        out["reason"] = reason;
    }
    Ok(Json(out).into_response())
}

#[utoipa::path(get, path = "/templates/{templateID}/files/{hash}", tag = "templates",
    summary = "Whether a COPY step's files are uploaded, else where to upload them",
    params(("templateID" = String, Path, description = "The template"), ("hash" = String, Path, description = "The files' SHA-256")),
    responses((status = 201, description = "present, and url when not present"), (status = 400, description = "Invalid request", body = crate::wire::ErrorBody), (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody), (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn files_probe(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path((template, hash)): Path<(String, String)>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let c = &s.control;
    own_template(c, &team, &template).await?;
    if !steps::is_hash(&hash) {
        return Err(ApiError::bad_request(format!(
            "{hash:?} is not a SHA-256 hash"
        )));
    }
    let hash = hash.to_ascii_lowercase();
    if c.template_file(&team.id, &hash).is_file() {
        return Ok((StatusCode::CREATED, Json(json!({"present": true}))).into_response());
    }
    let url = c.uploads().url(&origin(&headers, c), &team.id, &hash);
    Ok((
        StatusCode::CREATED,
        Json(json!({"present": false, "url": url})),
    )
        .into_response())
}

/// `scheme://host` of the api as the client reached it.
fn origin(headers: &HeaderMap, c: &Control) -> String {
    if let Some(u) = &c.config().api_url {
        return u.trim_end_matches('/').to_string();
    }
    let host = headers
        .get("host")
        .and_then(|v| v.to_str().ok())
        .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| c.config().api_listen.to_string());
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .filter(|p| *p == "https")
        .unwrap_or("http");
    format!("{scheme}://{host}")
}

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
    tokio::spawn(async move { control.delete_template(&team, &id).await })
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("the operation failed: {e}"))))?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v2/templates", tag = "templates",
    summary = "The team's templates and the shared ones",
    responses((status = 200, description = "Templates"),
        (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn list_v2(s: State<AppState>, a: Auth) -> ApiResult<Response> {
    list(s, a).await
}

#[utoipa::path(post, path = "/v2/templates", tag = "templates",
    summary = "The v2 build request of older SDKs (answers 400: use the Template SDK)",
    responses((status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn legacy_v2(auth: Auth) -> ApiError {
    legacy(auth).await
}

#[utoipa::path(get, path = "/templates/{templateID}/builds/{buildID}/logs", tag = "templates",
    summary = "A build's log entries (as the status does)",
    params(("templateID" = String, Path, description = "The template"), ("buildID" = String, Path, description = "The build"),
        ("logsOffset" = Option<i64>, Query, description = "Index of the first entry"),
        ("limit" = Option<i64>, Query, description = "Entries per page, at most 100")),
    responses((status = 200, description = "status, logEntries"),
        (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody),
        (status = 404, description = "No such template or build", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn logs(
    s: State<AppState>,
    a: Auth,
    p: Path<(String, String)>,
    q: RawQuery,
) -> ApiResult<Response> {
    status(s, a, p, q).await
}
