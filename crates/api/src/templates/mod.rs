//! E2B's template-build API (the Template SDK and `e2b template create`): requesting a build,
//! uploading its files, starting it, polling its status and logs, names and tags, listing and
//! deleting templates. The wire is in the project's `TEMPLATE-WIRE.md`. The routes are here
//! with the lookups they share; requesting, uploading and starting a build are in
//! `request.rs`, its status and log pages in `status.rs`, names and tags in `tags.rs`, and
//! listing, reading, updating and deleting templates in `catalog.rs`. The build itself runs
//! in `build.rs`, its steps are checked in `steps.rs`, uploads are kept by `files.rs`, and a
//! base from an OCI registry is named and keyed in `image.rs`.
//!
//! The SDKs send a name such as `team/name:v1` as one percent-encoded segment
//! (`team%2Fname%3Av1`): the router matches the raw path and decodes a segment after matching.

pub(crate) mod catalog;
pub(crate) mod files;
pub(crate) mod request;
pub(crate) mod status;
pub(crate) mod tags;

pub use vmon_control::templates::{image, steps};

use axum::http::StatusCode;
use axum::routing::{get, post, put};
use axum::Router;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

pub use crate::control::uploads::Uploads;

use crate::control::{parse_template_ref, record_error, Control};
use crate::error::{ApiError, ApiResult};
use crate::records::{Team, TemplateBuild, TemplateRecord};
use crate::state::AppState;

/// Tags every template build gets unless the request names its own.
const DEFAULT_TAG: &str = "default";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v3/templates", post(request::request_build))
        .route(
            "/v2/templates",
            get(catalog::list_v2).post(request::legacy_v2),
        )
        .route("/templates", get(catalog::list).post(request::legacy))
        .route(
            "/v2/templates/{id}/builds/{build}",
            post(request::start_build),
        )
        .route(
            "/v2/templates/{id}",
            axum::routing::patch(catalog::patch_v2),
        )
        .route(
            "/templates/tags",
            post(tags::assign_tags).delete(tags::remove_tags),
        )
        .route("/templates/aliases/{alias}", get(tags::alias))
        .route(
            "/templates/{id}",
            get(catalog::get_template)
                .patch(catalog::patch_v1)
                .delete(catalog::delete),
        )
        .route("/templates/{id}/tags", get(tags::tags_of))
        .route("/templates/{id}/files/{hash}", get(request::files_probe))
        .route("/templates/{id}/builds/{build}/status", get(status::status))
        .route("/templates/{id}/builds/{build}/logs", get(status::logs))
        .route("/template-files/{team}/{hash}", put(files::upload))
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

fn valid_tag(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
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
