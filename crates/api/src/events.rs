//! Lifecycle events and webhooks over REST: `GET /events/sandboxes[/{id}]`,
//! `GET|POST /events/webhooks`, `GET|PATCH|DELETE /events/webhooks/{id}` and its
//! `/deliveries` and `/stats`. A webhook's signature secret goes in and never comes out.

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use vmon_store::event_types;

use crate::control::rfc3339;
use crate::error::{ApiError, ApiResult};
use crate::records::{
    Delivery, Event, EventQuery, NewWebhook, Webhook, WebhookPatch, WebhookStats,
};
use crate::state::{body, query_pairs, AppState, Auth};

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/events/sandboxes", get(team_events))
        .route("/events/sandboxes/{id}", get(sandbox_events))
        .route("/events/webhooks", get(list_webhooks).post(create_webhook))
        .route(
            "/events/webhooks/{id}",
            get(get_webhook).patch(patch_webhook).delete(delete_webhook),
        )
        .route("/events/webhooks/{id}/deliveries", get(deliveries))
        .route("/events/webhooks/{id}/stats", get(stats))
}

const MAX_URL: usize = 2048;
const MAX_SECRET: usize = 512;
const MAX_NAME: usize = 256;

/// An event as `GET /events/sandboxes` answers it.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EventView {
    pub version: String,
    pub id: String,
    #[serde(rename = "type")]
    pub event_type: String,
    #[serde(rename = "eventData")]
    pub event_data: Option<serde_json::Value>,
    #[serde(rename = "sandboxBuildId")]
    pub sandbox_build_id: String,
    #[serde(rename = "sandboxExecutionId")]
    pub sandbox_execution_id: String,
    #[serde(rename = "sandboxId")]
    pub sandbox_id: String,
    #[serde(rename = "sandboxTeamId")]
    pub sandbox_team_id: String,
    #[serde(rename = "sandboxTemplateId")]
    pub sandbox_template_id: String,
    pub timestamp: String,
}

impl From<Event> for EventView {
    fn from(e: Event) -> Self {
        EventView {
            version: "v1".to_string(),
            id: e.id.to_string(),
            event_type: e.event_type,
            event_data: e.event_data,
            sandbox_build_id: e.build_id,
            sandbox_execution_id: e.execution_id,
            sandbox_id: e.sandbox_id,
            sandbox_team_id: e.team_id,
            sandbox_template_id: e.template_id,
            timestamp: rfc3339(e.timestamp),
        }
    }
}

/// A webhook as every webhook route answers it: never the secret.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct WebhookView {
    pub id: String,
    #[serde(rename = "teamID")]
    pub team_id: String,
    pub name: String,
    pub url: String,
    pub enabled: bool,
    pub events: Vec<String>,
    #[serde(rename = "createdAt")]
    pub created_at: String,
    #[serde(rename = "updatedAt")]
    pub updated_at: String,
}

impl From<Webhook> for WebhookView {
    fn from(w: Webhook) -> Self {
        WebhookView {
            id: w.id,
            team_id: w.team_id,
            name: w.name,
            url: w.url,
            enabled: w.enabled,
            events: w.events,
            created_at: rfc3339(w.created_at),
            updated_at: rfc3339(w.updated_at),
        }
    }
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeliveryView {
    pub id: String,
    #[serde(rename = "webhookID")]
    pub webhook_id: String,
    #[serde(rename = "eventID")]
    pub event_id: String,
    #[serde(rename = "deliveryID")]
    pub delivery_id: String,
    pub attempt: i64,
    #[serde(rename = "statusCode")]
    pub status_code: Option<i64>,
    pub success: bool,
    #[serde(rename = "durationMs")]
    pub duration_ms: i64,
    pub error: Option<String>,
    pub timestamp: String,
}

impl From<Delivery> for DeliveryView {
    fn from(d: Delivery) -> Self {
        DeliveryView {
            id: d.id,
            webhook_id: d.webhook_id,
            event_id: d.event_id.to_string(),
            delivery_id: d.delivery_id,
            attempt: d.attempt,
            status_code: d.status_code,
            success: d.success,
            duration_ms: d.duration_ms,
            error: d.error,
            timestamp: rfc3339(d.created_at),
        }
    }
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StatsView {
    pub attempts: i64,
    pub successes: i64,
    pub failures: i64,
    #[serde(rename = "averageDurationMs")]
    pub average_duration_ms: i64,
    pub pending: i64,
    #[serde(rename = "lastAttemptAt")]
    pub last_attempt_at: Option<String>,
    #[serde(rename = "lastSuccessAt")]
    pub last_success_at: Option<String>,
    #[serde(rename = "lastFailureAt")]
    pub last_failure_at: Option<String>,
}

impl From<WebhookStats> for StatsView {
    fn from(s: WebhookStats) -> Self {
        StatsView {
            attempts: s.attempts,
            successes: s.successes,
            failures: s.failures,
            average_duration_ms: s.average_duration_ms,
            pending: s.pending,
            last_attempt_at: s.last_attempt_at.map(rfc3339),
            last_success_at: s.last_success_at.map(rfc3339),
            last_failure_at: s.last_failure_at.map(rfc3339),
        }
    }
}

fn record_error(e: anyhow::Error) -> ApiError {
    ApiError::records("the record store failed", &e)
}

/// `offset`, `limit` (1–100, default 10), `orderAsc`, `types` (repeated or comma-separated).
fn event_query(team_id: &str, raw: Option<String>) -> ApiResult<EventQuery> {
    let pairs = query_pairs(raw)?;
    let last = |name: &str| {
        pairs
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let offset = match last("offset") {
        None => 0,
        Some(v) => crate::state::query_int::<i64>(v)
            .filter(|o| *o >= 0)
            .ok_or_else(|| ApiError::bad_request("offset must be a non-negative integer"))?,
    };
    let limit = match last("limit") {
        None => 10,
        Some(v) => crate::state::query_int::<i64>(v)
            .filter(|l| (1..=100).contains(l))
            .ok_or_else(|| ApiError::bad_request("limit must be between 1 and 100"))?,
    };
    let order_asc = match last("orderAsc") {
        None => false,
        Some(v) => v
            .parse::<bool>()
            .map_err(|_| ApiError::bad_request("orderAsc must be true or false"))?,
    };
    let mut types = Vec::new();
    for (_, v) in pairs.iter().filter(|(k, _)| k == "types" || k == "types[]") {
        for t in v.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if !event_types::ALL.contains(&t) {
                return Err(ApiError::bad_request(format!(
                    "unknown event type {t:?}; use one of {}",
                    event_types::ALL.join(", ")
                )));
            }
            if !types.iter().any(|x| x == t) {
                types.push(t.to_string());
            }
        }
    }
    Ok(EventQuery {
        team_id: team_id.to_string(),
        sandbox_id: None,
        types,
        offset,
        limit,
        order_asc,
    })
}

#[utoipa::path(
    get, path = "/events/sandboxes", tag = "events",
    summary = "The team's sandbox lifecycle events",
    params(
        ("offset" = Option<u64>, Query, description = "Events to skip"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 100, description = "Page size (default 10)"),
        ("orderAsc" = Option<bool>, Query, description = "Oldest first (default newest first)"),
        ("types" = Option<Vec<String>>, Query, explode = true, description = "Only these event types (repeated or comma-separated)"),
    ),
    responses(
        (status = 200, description = "Events", body = Vec<EventView>),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn team_events(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<EventView>>> {
    let q = event_query(&team.id, raw)?;
    let events = s.control.records().events(&q).await.map_err(record_error)?;
    Ok(Json(events.into_iter().map(EventView::from).collect()))
}

/// A sandbox's events, killed ones included (their records are gone; their events stay).
#[utoipa::path(
    get, path = "/events/sandboxes/{sandboxID}", tag = "events",
    summary = "One sandbox's lifecycle events",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
        ("offset" = Option<u64>, Query, description = "Events to skip"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 100, description = "Page size (default 10)"),
        ("orderAsc" = Option<bool>, Query, description = "Oldest first (default newest first)"),
        ("types" = Option<Vec<String>>, Query, explode = true, description = "Only these event types (repeated or comma-separated)"),
    ),
    responses(
        (status = 200, description = "Events", body = Vec<EventView>),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn sandbox_events(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<EventView>>> {
    let mut q = event_query(&team.id, raw)?;
    q.sandbox_id = Some(id);
    let events = s.control.records().events(&q).await.map_err(record_error)?;
    Ok(Json(events.into_iter().map(EventView::from).collect()))
}

/// 400 when the URL's host is on this host or a network behind it (`control/targets.rs`).
async fn check_destination(s: &AppState, url: &str) -> ApiResult<()> {
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|_| ApiError::bad_request(format!("url {url:?} is not a valid URL")))?;
    let host = uri.host().unwrap_or_default();
    match s.control.webhook_targets().refusal(host).await {
        Some(why) => Err(ApiError::bad_request(why)),
        None => Ok(()),
    }
}

fn validate_url(url: &str) -> ApiResult<()> {
    if url.len() > MAX_URL {
        return Err(ApiError::bad_request(format!(
            "url must be at most {MAX_URL} characters"
        )));
    }
    let uri: axum::http::Uri = url
        .parse()
        .map_err(|_| ApiError::bad_request(format!("url {url:?} is not a valid URL")))?;
    let scheme_ok = matches!(uri.scheme_str(), Some("http") | Some("https"));
    let host_ok = uri.host().is_some_and(|h| !h.is_empty());
    if !scheme_ok || !host_ok {
        return Err(ApiError::bad_request(
            "url must be an absolute http:// or https:// URL",
        ));
    }
    Ok(())
}

fn validate_events(events: &[String]) -> ApiResult<Vec<String>> {
    if events.is_empty() {
        return Err(ApiError::bad_request(
            "events must name at least one event type",
        ));
    }
    let mut out: Vec<String> = Vec::new();
    for e in events {
        let e = e.trim();
        if !event_types::ALL.contains(&e) {
            return Err(ApiError::bad_request(format!(
                "unknown event type {e:?}; use one of {}",
                event_types::ALL.join(", ")
            )));
        }
        if !out.iter().any(|x| x == e) {
            out.push(e.to_string());
        }
    }
    Ok(out)
}

fn validate_secret(secret: &str) -> ApiResult<()> {
    let n = secret.chars().count();
    if n == 0 || n > MAX_SECRET {
        return Err(ApiError::bad_request(format!(
            "signatureSecret must be 1-{MAX_SECRET} characters"
        )));
    }
    Ok(())
}

fn validate_name(name: &str) -> ApiResult<()> {
    if name.chars().count() > MAX_NAME {
        return Err(ApiError::bad_request(format!(
            "name must be at most {MAX_NAME} characters"
        )));
    }
    Ok(())
}

#[derive(Deserialize, utoipa::ToSchema)]
struct NewWebhookRequest {
    #[serde(default)]
    name: Option<String>,
    url: String,
    #[serde(default)]
    enabled: Option<bool>,
    events: Vec<String>,
    #[serde(rename = "signatureSecret")]
    signature_secret: String,
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
struct WebhookPatchRequest {
    name: Option<String>,
    url: Option<String>,
    enabled: Option<bool>,
    events: Option<Vec<String>>,
    #[serde(rename = "signatureSecret")]
    signature_secret: Option<String>,
}

#[utoipa::path(
    post, path = "/events/webhooks", tag = "webhooks",
    summary = "Register a webhook for lifecycle events",
    request_body = NewWebhookRequest,
    responses(
        (status = 201, description = "The webhook (never its secret)", body = WebhookView),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 429, description = "The team has as many webhooks as its quota allows", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn create_webhook(
    State(s): State<AppState>,
    Auth(team): Auth,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: NewWebhookRequest = body(&bytes)?;
    let url = req.url.trim().to_string();
    validate_url(&url)?;
    check_destination(&s, &url).await?;
    let have = s
        .control
        .records()
        .webhooks(&team.id)
        .await
        .map_err(record_error)?
        .len();
    let max = s.control.config().quotas.max_webhooks;
    if have >= max {
        return Err(ApiError::too_many(format!(
            "a team may have at most {max} webhooks (quotas.max_webhooks; delete one first)"
        )));
    }
    let events = validate_events(&req.events)?;
    validate_secret(&req.signature_secret)?;
    let name = req.name.unwrap_or_default().trim().to_string();
    validate_name(&name)?;
    let hook = s
        .control
        .records()
        .create_webhook(&NewWebhook {
            id: uuid::Uuid::new_v4().to_string(),
            team_id: team.id.clone(),
            name,
            url,
            enabled: req.enabled.unwrap_or(true),
            events,
            signature_secret: req.signature_secret,
        })
        .await
        .map_err(record_error)?;
    Ok((StatusCode::CREATED, Json(WebhookView::from(hook))).into_response())
}

#[utoipa::path(
    get, path = "/events/webhooks", tag = "webhooks",
    summary = "The team's webhooks",
    responses(
        (status = 200, description = "Webhooks", body = Vec<WebhookView>),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn list_webhooks(
    State(s): State<AppState>,
    Auth(team): Auth,
) -> ApiResult<Json<Vec<WebhookView>>> {
    let hooks = s
        .control
        .records()
        .webhooks(&team.id)
        .await
        .map_err(record_error)?;
    Ok(Json(hooks.into_iter().map(WebhookView::from).collect()))
}

fn webhook_not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("webhook {id:?} not found"))
}

async fn owned_webhook(s: &AppState, team_id: &str, id: &str) -> ApiResult<Webhook> {
    s.control
        .records()
        .webhook(team_id, id)
        .await
        .map_err(record_error)?
        .ok_or_else(|| webhook_not_found(id))
}

#[utoipa::path(
    get, path = "/events/webhooks/{webhookID}", tag = "webhooks",
    summary = "A webhook",
    params(
        ("webhookID" = String, Path, description = "The webhook"),
    ),
    responses(
        (status = 200, description = "The webhook", body = WebhookView),
        (status = 404, description = "No such webhook", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn get_webhook(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Json<WebhookView>> {
    Ok(Json(owned_webhook(&s, &team.id, &id).await?.into()))
}

#[utoipa::path(
    patch, path = "/events/webhooks/{webhookID}", tag = "webhooks",
    summary = "Change a webhook",
    params(
        ("webhookID" = String, Path, description = "The webhook"),
    ),
    request_body = Option<WebhookPatchRequest>,
    responses(
        (status = 200, description = "The webhook", body = WebhookView),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "No such webhook", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn patch_webhook(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Json<WebhookView>> {
    let req: WebhookPatchRequest = body(&bytes)?;
    let url = req.url.map(|u| u.trim().to_string());
    if let Some(url) = &url {
        validate_url(url)?;
        check_destination(&s, url).await?;
    }
    let events = req.events.as_deref().map(validate_events).transpose()?;
    if let Some(secret) = &req.signature_secret {
        validate_secret(secret)?;
    }
    let name = req.name.map(|n| n.trim().to_string());
    if let Some(name) = &name {
        validate_name(name)?;
    }
    let patch = WebhookPatch {
        name,
        url,
        enabled: req.enabled,
        events,
        signature_secret: req.signature_secret,
    };
    let hook = s
        .control
        .records()
        .update_webhook(&team.id, &id, &patch)
        .await
        .map_err(record_error)?
        .ok_or_else(|| webhook_not_found(&id))?;
    Ok(Json(hook.into()))
}

#[utoipa::path(
    delete, path = "/events/webhooks/{webhookID}", tag = "webhooks",
    summary = "Delete a webhook",
    params(
        ("webhookID" = String, Path, description = "The webhook"),
    ),
    responses(
        (status = 200, description = "Deleted"),
        (status = 404, description = "No such webhook", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn delete_webhook(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let deleted = s
        .control
        .records()
        .delete_webhook(&team.id, &id)
        .await
        .map_err(record_error)?;
    if deleted {
        Ok(StatusCode::OK)
    } else {
        Err(webhook_not_found(&id))
    }
}

#[utoipa::path(
    get, path = "/events/webhooks/{webhookID}/deliveries", tag = "webhooks",
    summary = "A webhook's delivery attempts, newest first",
    params(
        ("webhookID" = String, Path, description = "The webhook"),
        ("limit" = Option<u32>, Query, maximum = 1000, description = "Page size (default 100)"),
        ("offset" = Option<u64>, Query, description = "Attempts to skip"),
    ),
    responses(
        (status = 200, description = "Attempts", body = Vec<DeliveryView>),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "No such webhook", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn deliveries(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<DeliveryView>>> {
    owned_webhook(&s, &team.id, &id).await?;
    let pairs = query_pairs(raw)?;
    let get = |name: &str, default: i64, max: i64| -> ApiResult<i64> {
        match crate::state::query_one(&pairs, name)? {
            None => Ok(default),
            Some(v) => crate::state::query_int::<i64>(v)
                .filter(|n| (0..=max).contains(n))
                .ok_or_else(|| {
                    ApiError::bad_request(format!("{name} must be between 0 and {max}"))
                }),
        }
    };
    let limit = get("limit", 100, 1000)?.max(1);
    let offset = get("offset", 0, i64::MAX)?;
    let list = s
        .control
        .records()
        .deliveries(&id, limit, offset)
        .await
        .map_err(record_error)?;
    Ok(Json(list.into_iter().map(DeliveryView::from).collect()))
}

#[utoipa::path(
    get, path = "/events/webhooks/{webhookID}/stats", tag = "webhooks",
    summary = "A webhook's delivery statistics",
    params(
        ("webhookID" = String, Path, description = "The webhook"),
    ),
    responses(
        (status = 200, description = "Statistics", body = StatsView),
        (status = 404, description = "No such webhook", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn stats(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Json<StatsView>> {
    owned_webhook(&s, &team.id, &id).await?;
    let stats = s
        .control
        .records()
        .webhook_stats(&id)
        .await
        .map_err(record_error)?;
    Ok(Json(stats.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_queries() {
        let q = event_query("t", None).expect("defaults");
        assert_eq!((q.offset, q.limit, q.order_asc), (0, 10, false));
        let q = event_query(
            "t",
            Some("types=sandbox.lifecycle.created,sandbox.lifecycle.killed&types=sandbox.lifecycle.paused&orderAsc=true&limit=100&offset=3".into()),
        )
        .expect("query");
        assert_eq!(q.types.len(), 3);
        assert_eq!((q.offset, q.limit, q.order_asc), (3, 100, true));
        for bad in [
            "limit=0",
            "limit=101",
            "limit=x",
            "offset=-1",
            "orderAsc=maybe",
            "orderAsc=",
            "limit=",
            "types=nope",
        ] {
            let e = event_query("t", Some(bad.into())).expect_err(bad);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[test]
    fn webhook_fields() {
        assert!(validate_url("http://127.0.0.1:9/x").is_ok());
        assert!(validate_url("https://hooks.example.com/e2b").is_ok());
        for bad in ["ftp://x/y", "/relative", "hooks.example.com", "http://", ""] {
            assert!(validate_url(bad).is_err(), "{bad}");
        }
        assert!(validate_url(&format!("http://h/{}", "a".repeat(MAX_URL))).is_err());
        assert!(validate_events(&[]).is_err());
        assert!(validate_events(&["sandbox.lifecycle.nope".into()]).is_err());
        assert_eq!(
            validate_events(&[
                "sandbox.lifecycle.killed".into(),
                "sandbox.lifecycle.killed".into()
            ])
            .expect("valid")
            .len(),
            1
        );
        assert!(validate_secret("").is_err());
        assert!(validate_secret(&"s".repeat(512)).is_ok());
        assert!(validate_secret(&"s".repeat(513)).is_err());
    }
}
