//! Requesting a template build (`POST /v3/templates`), the upload URLs of its COPY steps'
//! files, and the trigger that starts it with its steps; the legacy Docker-push flows answer
//! 400 with the way that works.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use time::OffsetDateTime;

use super::{forbidden, own_build, own_template, steps, valid_tag, DEFAULT_TAG};
use crate::control::{parse_template_ref, record_error, Control, TemplateRef};
use crate::error::{ApiError, ApiResult};
use crate::ids;
use crate::records::{BuildState, Team, TemplateBuild, TemplateKind, TemplateRecord};
use crate::state::{body, AppState, Auth};

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

#[utoipa::path(post, path = "/v2/templates", tag = "templates",
    summary = "The v2 build request of older SDKs (answers 400: use the Template SDK)",
    responses((status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 401, description = "No or a wrong API key", body = crate::wire::ErrorBody)),
    security(("ApiKeyAuth" = [])))]
pub(crate) async fn legacy_v2(auth: Auth) -> ApiError {
    legacy(auth).await
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
    let (r, tags) = requested_name(&req, &team)?;
    let c = &s.control;
    let machine = requested_machine(&req, &team, c)?;
    if r.name == "base" || crate::control::builtin_name(&r.name) {
        return Err(ApiError::conflict(format!(
            "{:?} is a built-in template's name",
            r.name
        )));
    }
    let template = template_to_build(c, &team, &r.name).await?;
    let build = TemplateBuild {
        build_id: ids::build_id(),
        template_id: template.id.clone(),
        team_id: team.id.clone(),
        state: BuildState::Waiting,
        tags: tags.clone(),
        vcpus: machine.vcpus,
        memory_mb: machine.memory_mb,
        disk_mb: machine.disk_mb,
        start: None,
        failure: None,
        result: None,
        created_at: OffsetDateTime::now_utc(),
        finished_at: None,
    };
    c.records()
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

/// The requested name (`[team/]name[:tag]`, in the team's namespace) and its tags: the name's own first, `default` when none is given.
fn requested_name(req: &BuildRequest, team: &Team) -> ApiResult<(TemplateRef, Vec<String>)> {
    let name = req
        .name
        .as_ref()
        .or(req.alias.as_ref())
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
    Ok((r, tags))
}

/// The machine a build asks for, within the team's limits; the base template's where it
/// names none.
struct Machine {
    vcpus: u32,
    memory_mb: u32,
    disk_mb: u32,
}

fn requested_machine(req: &BuildRequest, team: &Team, c: &Control) -> ApiResult<Machine> {
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
    Ok(Machine {
        vcpus: vcpus as u32,
        memory_mb: memory_mb as u32,
        disk_mb: (min_disk as u32).max(base.disk_mb),
    })
}

/// The team's template named `name`, made when it has none; a snapshot's name is a conflict.
async fn template_to_build(c: &Control, team: &Team, name: &str) -> ApiResult<TemplateRecord> {
    let records = c.records();
    let existing = records
        .template_by_alias(&team.id, name)
        .await
        .map_err(record_error)?
        .filter(|t| t.team_id.as_deref() == Some(team.id.as_str()));
    match existing {
        Some(t) if matches!(t.kind, TemplateKind::Snapshot { .. }) => Err(ApiError::conflict(
            format!("{name:?} is the name of a snapshot"),
        )),
        Some(t) => Ok(t),
        None => {
            let t = TemplateRecord {
                id: ids::template_id(),
                team_id: Some(team.id.clone()),
                alias: Some(name.to_string()),
                kind: TemplateKind::Template,
                tags: BTreeMap::new(),
                created_at: OffsetDateTime::now_utc(),
            };
            records
                .put_template(t.clone())
                .await
                .map_err(record_error)?;
            Ok(t)
        }
    }
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
    // The template's GPU count (seed 003): a bad one is refused now, not at every create.
    if let Some(v) = plan
        .last()
        .and_then(|(_, s)| s.env.get(vmon_proto::gpu::TEMPLATE_ENV))
    {
        vmon_proto::gpu::parse_count(v, "the template's VMON_GPUS")
            .map_err(ApiError::bad_request)?;
    }
    for (i, (action, _)) in plan.iter().enumerate() {
        if let steps::Action::Copy { files_hash, .. } = action {
            if !c.template_file_kept(&team.id, files_hash) {
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
            .map_err(|e| ApiError::bad_request(format!("fromTemplate {t:?}: {e}")))?;
    }
    build.start = Some(redact(raw));
    // Building from the trigger on, as E2B reports it, unless it has to wait for a slot.
    if c.template_build_slot_free() {
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
    if c.template_file_kept(&team.id, &hash) {
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
