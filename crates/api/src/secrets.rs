//! Team secrets over REST: `GET|POST /secrets`, `GET|POST|DELETE /secrets/{secretID}` (an id
//! `sec_…` or the name, any case). A value goes in and never comes out: it is sealed in the
//! store (like webhook secrets) and no response, log line or error carries it. Responses are
//! `Cache-Control: no-store`. Lists page with `limit` and `nextToken`; `X-Next-Token` is sent
//! only when another page exists.
//!
//! Values leave the store only for the egress path: a sandbox whose network rules name a
//! secret gets it, opened at each start and pushed again on update or delete, on its node's
//! egress proxy (`control::egress`, `crates/egress`).

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use vmon_store::{NewSecret, Secret};

use crate::control::rfc3339;
use crate::error::{ApiError, ApiResult};
use crate::state::{query_pairs, AppState, Auth};

/// Infra's limits (`spec/openapi.yml`, `docs/ARCHITECTURE.md`).
const MAX_BODY: usize = 512 << 10;
const MAX_VALUE: usize = 64 << 10;
const MAX_NAME: usize = 128;
const MAX_METADATA_ENTRIES: usize = 32;
const MAX_METADATA_KEY: usize = 128;
const MAX_METADATA_VALUE: usize = 1024;
const MAX_METADATA_TOTAL: usize = 8192;
const DEFAULT_LIMIT: i64 = 100;
const MAX_LIMIT: i64 = 1000;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/secrets", get(list_secrets).post(create_secret))
        .route(
            "/secrets/{id}",
            get(get_secret).post(update_secret).delete(delete_secret),
        )
}

/// `Secret`: everything but the value.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SecretView {
    #[serde(rename = "secretID")]
    pub secret_id: String,
    /// Lower-cased.
    pub name: String,
    /// 1 at creation, +1 on every update.
    #[serde(rename = "currentVersion")]
    pub current_version: i64,
    pub metadata: BTreeMap<String, String>,
    #[serde(rename = "createdAt")]
    pub created_at: String,
    #[serde(rename = "updatedAt")]
    pub updated_at: String,
}

impl From<Secret> for SecretView {
    fn from(s: Secret) -> Self {
        SecretView {
            secret_id: s.id,
            name: s.name,
            current_version: s.version,
            metadata: s.metadata,
            created_at: rfc3339(s.created_at),
            updated_at: rfc3339(s.updated_at),
        }
    }
}

/// `NewSecret`. Its `Debug` leaves the value out.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct NewSecretRequest {
    pub name: String,
    /// Write-only: never returned.
    pub value: String,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// `UpdateSecret`: a new value; `metadata` replaces the old when sent, else is kept.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct UpdateSecretRequest {
    pub value: String,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

fn record_error(e: anyhow::Error) -> ApiError {
    ApiError::records("the record store failed", &e)
}

/// A JSON body of at most [`MAX_BODY`] bytes; the parse error never quotes the body (it may
/// hold the value).
fn parse<T: serde::de::DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    if bytes.len() > MAX_BODY {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body must be at most {MAX_BODY} bytes"),
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "invalid request body at line {} column {}: {}",
            e.line(),
            e.column(),
            match e.classify() {
                serde_json::error::Category::Data => "a field is missing or of the wrong type",
                serde_json::error::Category::Syntax => "not JSON",
                serde_json::error::Category::Eof => "it ends early",
                serde_json::error::Category::Io => "unreadable",
            }
        ))
    })
}

fn check_name(name: &str) -> ApiResult<()> {
    let ok = (1..=MAX_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !ok {
        return Err(ApiError::bad_request(format!(
            "invalid secret name: use 1-{MAX_NAME} characters of [a-zA-Z0-9_-]"
        )));
    }
    if name.to_ascii_lowercase().starts_with("sec_") {
        return Err(ApiError::bad_request(
            "secret names may not start with sec_ (the prefix of secret ids)",
        ));
    }
    Ok(())
}

fn check_value(value: &str) -> ApiResult<()> {
    if value.is_empty() || value.len() > MAX_VALUE {
        return Err(ApiError::bad_request(format!(
            "a secret value must be 1-{MAX_VALUE} bytes"
        )));
    }
    Ok(())
}

fn check_metadata(m: &BTreeMap<String, String>) -> ApiResult<()> {
    let total: usize = m.iter().map(|(k, v)| k.len() + v.len()).sum();
    if m.len() > MAX_METADATA_ENTRIES
        || total > MAX_METADATA_TOTAL
        || m.iter().any(|(k, v)| {
            k.is_empty() || k.len() > MAX_METADATA_KEY || v.len() > MAX_METADATA_VALUE
        })
    {
        return Err(ApiError::bad_request(format!(
            "metadata: at most {MAX_METADATA_ENTRIES} entries, keys 1-{MAX_METADATA_KEY} bytes, \
             values up to {MAX_METADATA_VALUE} bytes, {MAX_METADATA_TOTAL} bytes in all"
        )));
    }
    Ok(())
}

fn no_store(mut resp: Response) -> Response {
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("secret {id:?} not found"))
}

#[utoipa::path(
    post, path = "/secrets", tag = "secrets",
    summary = "Create a secret (its value is never returned)",
    request_body = NewSecretRequest,
    responses(
        (status = 201, description = "The secret, without its value", body = SecretView),
        (status = 400, description = "Invalid name, value or metadata", body = crate::wire::ErrorBody),
        (status = 409, description = "The name is taken, or the team keeps its most secrets", body = crate::wire::ErrorBody),
        (status = 413, description = "Body over 512 KiB", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn create_secret(
    State(s): State<AppState>,
    Auth(team): Auth,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: NewSecretRequest = parse(&bytes)?;
    check_name(&req.name)?;
    check_value(&req.value)?;
    let metadata = req.metadata.unwrap_or_default();
    check_metadata(&metadata)?;
    let records = s.control.records();
    let max = s.control.config().quotas.max_secrets;
    let kept = records
        .count_secrets(&team.id)
        .await
        .map_err(record_error)?;
    if usize::try_from(kept).unwrap_or(usize::MAX) >= max {
        return Err(ApiError::conflict(format!(
            "the team already keeps {kept} secrets, its most (quotas.max_secrets)"
        )));
    }
    let new = NewSecret {
        id: format!("sec_{}", crate::ids::random_lower(20)),
        team_id: team.id.clone(),
        name: req.name.clone(),
        value: req.value,
        metadata,
    };
    let created = records
        .create_secret(&new)
        .await
        .map_err(record_error)?
        .ok_or_else(|| {
            ApiError::conflict(format!(
                "a secret named {:?} already exists",
                req.name.to_lowercase()
            ))
        })?;
    tracing::info!(secret_id = %created.id, team_id = %team.id, "secret created");
    Ok(no_store(
        (StatusCode::CREATED, Json(SecretView::from(created))).into_response(),
    ))
}

#[utoipa::path(
    get, path = "/secrets", tag = "secrets",
    summary = "List the team's secrets, oldest first (paged)",
    params(
        ("limit" = Option<i64>, Query, description = "Page size, 1-1000 (default 100)"),
        ("nextToken" = Option<String>, Query, description = "The X-Next-Token of the previous page"),
    ),
    responses(
        (status = 200, description = "One page; X-Next-Token when another exists", body = Vec<SecretView>),
        (status = 400, description = "Invalid limit or token", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn list_secrets(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let pairs = query_pairs(raw)?;
    let get = |name: &str| crate::state::query_one(&pairs, name);
    let limit = match get("limit")? {
        None => DEFAULT_LIMIT,
        // An empty value is not an integer: refused like any other (as `GET /v2/sandboxes` does).
        Some(v) => match crate::state::query_int::<i64>(v) {
            Some(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "limit must be between 1 and {MAX_LIMIT}"
                )))
            }
        },
    };
    let after = get("nextToken")?.filter(|t| !t.is_empty());
    if let Some(t) = after {
        if t.len() > 64 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(ApiError::bad_request("invalid nextToken"));
        }
    }
    let mut page = s
        .control
        .records()
        .secrets(&team.id, limit + 1, after)
        .await
        .map_err(record_error)?;
    let more = page.len() as i64 > limit;
    page.truncate(limit as usize);
    let next = more.then(|| page.last().map(|s| s.id.clone())).flatten();
    let body: Vec<SecretView> = page.into_iter().map(SecretView::from).collect();
    let mut resp = no_store(Json(body).into_response());
    if let Some(next) = next {
        if let Ok(v) = HeaderValue::from_str(&next) {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

#[utoipa::path(
    get, path = "/secrets/{secretID}", tag = "secrets",
    summary = "Get a secret (never its value)",
    params(("secretID" = String, Path, description = "Its id (sec_…) or name, any case")),
    responses(
        (status = 200, description = "The secret", body = SecretView),
        (status = 404, description = "No such secret in the team", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn get_secret(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let found = s
        .control
        .records()
        .secret(&team.id, &id)
        .await
        .map_err(record_error)?
        .ok_or_else(|| not_found(&id))?;
    Ok(no_store(Json(SecretView::from(found)).into_response()))
}

#[utoipa::path(
    post, path = "/secrets/{secretID}", tag = "secrets",
    summary = "Give a secret a new value (and metadata, when sent): its version goes up",
    params(("secretID" = String, Path, description = "Its id (sec_…) or name, any case")),
    request_body = UpdateSecretRequest,
    responses(
        (status = 200, description = "The secret", body = SecretView),
        (status = 400, description = "Invalid value or metadata", body = crate::wire::ErrorBody),
        (status = 404, description = "No such secret in the team", body = crate::wire::ErrorBody),
        (status = 413, description = "Body over 512 KiB", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn update_secret(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: UpdateSecretRequest = parse(&bytes)?;
    check_value(&req.value)?;
    if let Some(m) = &req.metadata {
        check_metadata(m)?;
    }
    let updated = s
        .control
        .records()
        .update_secret(&team.id, &id, &req.value, req.metadata.as_ref())
        .await
        .map_err(record_error)?
        .ok_or_else(|| not_found(&id))?;
    tracing::info!(secret_id = %updated.id, version = updated.version, "secret updated");
    s.control.secret_changed(&team.id, &updated.name).await;
    Ok(no_store(Json(SecretView::from(updated)).into_response()))
}

#[utoipa::path(
    delete, path = "/secrets/{secretID}", tag = "secrets",
    summary = "Delete a secret",
    params(("secretID" = String, Path, description = "Its id (sec_…) or name, any case")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such secret in the team", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
pub(crate) async fn delete_secret(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let name = s
        .control
        .records()
        .secret(&team.id, &id)
        .await
        .map_err(record_error)?
        .map(|x| x.name);
    let gone = s
        .control
        .records()
        .delete_secret(&team.id, &id)
        .await
        .map_err(record_error)?;
    if !gone {
        return Err(not_found(&id));
    }
    if let Some(name) = name {
        // Running sandboxes stop injecting it (their requests to its host then fail).
        s.control.secret_changed(&team.id, &name).await;
    }
    Ok(no_store(StatusCode::NO_CONTENT.into_response()))
}
