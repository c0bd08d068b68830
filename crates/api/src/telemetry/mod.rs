//! What a sandbox's guest reported and what the platform did, read back: guest metrics
//! (`GET /sandboxes/{id}/metrics`, `GET /sandboxes/metrics`), console logs
//! (`GET /sandboxes/{id}/logs`, `GET /v2/sandboxes/{id}/logs`, `/admin/sandboxes/{id}/logs`)
//! and the platform's Prometheus metrics (`GET /metrics`).
//!
//! The node keeps samples and logs ([`vmon_proto::node::Metrics`] and
//! [`vmon_proto::node::Logs`]); this module only decides who may read them and
//! shapes them for the wire. A running or paused sandbox is the team's when its record is; a
//! killed one when the team's `killed` event for it is less than 7 days old (events outlive the
//! record by 30 days).

pub use vmon_control::platform;
pub use vmon_control::telemetry::{thin, Subject, MAX_BATCH, RETENTION};

use std::collections::BTreeMap;
use std::time::Instant;

use axum::extract::{MatchedPath, Path, RawQuery, Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use time::OffsetDateTime;
use vmon_proto::node::{LogDirection, LogEntry, LogLevel, LogQuery, MetricSample};

use crate::error::{ApiError, ApiResult};
use crate::records::SandboxState;
use crate::state::{Admin, AppState, Auth, MetricsReader};

pub use platform::{platform, Platform, WebhookOutcome};

const DEFAULT_LOG_LIMIT: usize = 1000;
const MAX_LOG_LIMIT: usize = 10_000;
const MAX_SEARCH: usize = 256;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/metrics", get(prometheus))
        .route("/sandboxes/metrics", get(batch_metrics))
        .route("/sandboxes/{id}/metrics", get(sandbox_metrics))
        .route("/sandboxes/{id}/logs", get(logs_v1))
        .route("/v2/sandboxes/{id}/logs", get(logs_v2))
        .route("/admin/sandboxes/{id}/logs", get(admin_logs))
}

/// `SandboxMetric` exactly as the SDKs parse it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMetric {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f32,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

impl From<&MetricSample> for SandboxMetric {
    fn from(s: &MetricSample) -> Self {
        SandboxMetric {
            timestamp: rfc3339_ms(s.timestamp_unix.saturating_mul(1000)),
            timestamp_unix: s.timestamp_unix,
            cpu_count: s.cpu_count,
            cpu_used_pct: s.cpu_used_pct,
            mem_used: s.mem_used,
            mem_total: s.mem_total,
            mem_cache: s.mem_cache,
            disk_used: s.disk_used,
            disk_total: s.disk_total,
        }
    }
}

/// `SandboxLogEntry`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SandboxLogEntry {
    pub timestamp: String,
    pub message: String,
    #[schema(value_type = vmon_proto::node::LogLevel)]
    pub level: &'static str,
    pub fields: BTreeMap<String, String>,
}

impl From<&LogEntry> for SandboxLogEntry {
    fn from(e: &LogEntry) -> Self {
        SandboxLogEntry {
            timestamp: rfc3339_ms(e.timestamp_ms),
            message: e.message.clone(),
            level: e.level.as_str(),
            fields: e.fields.clone(),
        }
    }
}

/// `SandboxLog` (the v1 raw lines).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SandboxLog {
    pub timestamp: String,
    pub line: String,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LogsV1 {
    pub logs: Vec<SandboxLog>,
    #[serde(rename = "logEntries")]
    pub log_entries: Vec<SandboxLogEntry>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LogsV2 {
    pub logs: Vec<SandboxLogEntry>,
}

/// Unix milliseconds as RFC 3339 (UTC).
pub fn rfc3339_ms(ms: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".to_string())
}

/// A request's query as pairs; the last of repeated names wins unless asked for all.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(raw: Option<String>) -> ApiResult<Query> {
        serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
            .map(Query)
            .map_err(|e| ApiError::bad_request(format!("invalid query: {e}")))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn int(&self, name: &str) -> ApiResult<Option<i64>> {
        self.get(name)
            .map(|v| {
                crate::state::query_int::<i64>(v)
                    .ok_or_else(|| ApiError::bad_request(format!("{name} must be an integer")))
            })
            .transpose()
    }

    fn limit(&self) -> ApiResult<usize> {
        match self.int("limit")? {
            None => Ok(DEFAULT_LOG_LIMIT),
            Some(l) => usize::try_from(l)
                .ok()
                .filter(|l| *l <= MAX_LOG_LIMIT)
                .ok_or_else(|| {
                    ApiError::bad_request(format!("limit must be between 0 and {MAX_LOG_LIMIT}"))
                }),
        }
    }

    /// The v2 filters: cursor, direction, level, search.
    fn log_query(&self) -> ApiResult<LogQuery> {
        let direction = match self.get("direction") {
            None | Some("forward") => LogDirection::Forward,
            Some("backward") => LogDirection::Backward,
            Some(d) => {
                return Err(ApiError::bad_request(format!(
                    "invalid direction {d:?}: use forward or backward"
                )))
            }
        };
        let min_level = match self.get("level") {
            None => None,
            Some("debug") => Some(LogLevel::Debug),
            Some("info") => Some(LogLevel::Info),
            Some("warn") => Some(LogLevel::Warn),
            Some("error") => Some(LogLevel::Error),
            Some(l) => {
                return Err(ApiError::bad_request(format!(
                    "invalid level {l:?}: use debug, info, warn or error"
                )))
            }
        };
        let search = self.get("search").map(str::to_string);
        if search.as_ref().is_some_and(|s| s.len() > MAX_SEARCH) {
            return Err(ApiError::bad_request(format!(
                "search must be at most {MAX_SEARCH} characters"
            )));
        }
        Ok(LogQuery {
            cursor_ms: self.int("cursor")?,
            direction,
            limit: self.limit()?,
            min_level,
            search,
        })
    }
}

#[utoipa::path(
    get, path = "/sandboxes/{sandboxID}/metrics", tag = "telemetry",
    summary = "A sandbox's metrics samples",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
        ("start" = Option<i64>, Query, description = "Unix seconds: samples from"),
        ("end" = Option<i64>, Query, description = "Unix seconds: samples until"),
    ),
    responses(
        (status = 200, description = "Samples, oldest first", body = Vec<SandboxMetric>),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "No such sandbox (or killed more than 7 days ago)", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn sandbox_metrics(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<SandboxMetric>>> {
    let q = Query::parse(raw)?;
    let (start, end) = (q.int("start")?, q.int("end")?);
    let samples = s.control.sandbox_metrics(&team, &id, start, end).await?;
    Ok(Json(samples.iter().map(SandboxMetric::from).collect()))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct BatchMetrics {
    sandboxes: BTreeMap<String, SandboxMetric>,
}

#[utoipa::path(
    get, path = "/sandboxes/metrics", tag = "telemetry",
    summary = "The latest metrics sample of several sandboxes",
    params(
        ("sandbox_ids" = Vec<String>, Query, explode = true, description = "Sandbox ids (repeated or comma-separated; at most 100)"),
    ),
    responses(
        (status = 200, description = "Latest sample per sandbox that has a recent one", body = BatchMetrics),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn batch_metrics(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<BatchMetrics>> {
    let q = Query::parse(raw)?;
    let mut ids: Vec<String> = q
        .all("sandbox_ids")
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .collect();
    ids.sort();
    ids.dedup();
    if ids.is_empty() {
        return Err(ApiError::bad_request("sandbox_ids is required"));
    }
    let latest = s.control.latest_metrics(&team, &ids).await?;
    let sandboxes = latest
        .iter()
        .map(|(id, sample)| (id.clone(), SandboxMetric::from(sample)))
        .collect();
    Ok(Json(BatchMetrics { sandboxes }))
}

#[utoipa::path(
    get, path = "/sandboxes/{sandboxID}/logs", tag = "telemetry",
    summary = "A sandbox's console log (v1)",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
        ("start" = Option<i64>, Query, description = "Unix milliseconds: entries from"),
        ("limit" = Option<u32>, Query, maximum = 10000, description = "At most this many (default 1000)"),
    ),
    responses(
        (status = 200, description = "Log lines and entries", body = LogsV1),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "No such sandbox (or killed more than 7 days ago)", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn logs_v1(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<LogsV1>> {
    let q = Query::parse(raw)?;
    let query = LogQuery {
        cursor_ms: q.int("start")?,
        direction: LogDirection::Forward,
        limit: q.limit()?,
        ..Default::default()
    };
    let entries = s.control.sandbox_logs(Some(&team), &id, query).await?;
    Ok(Json(LogsV1 {
        logs: entries
            .iter()
            .map(|e| SandboxLog {
                timestamp: rfc3339_ms(e.timestamp_ms),
                line: e.line.clone(),
            })
            .collect(),
        log_entries: entries.iter().map(SandboxLogEntry::from).collect(),
    }))
}

#[utoipa::path(
    get, path = "/v2/sandboxes/{sandboxID}/logs", tag = "telemetry",
    summary = "A sandbox's console log entries, filtered",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
        ("cursor" = Option<i64>, Query, description = "Unix milliseconds to continue from"),
        ("direction" = Option<String>, Query, description = "`forward` (default) or `backward`"),
        ("level" = Option<vmon_proto::node::LogLevel>, Query, description = "Lowest level to answer"),
        ("search" = Option<String>, Query, max_length = 256, description = "Only entries containing this text"),
        ("limit" = Option<u32>, Query, maximum = 10000, description = "At most this many (default 1000)"),
    ),
    responses(
        (status = 200, description = "Entries", body = LogsV2),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "No such sandbox (or killed more than 7 days ago)", body = crate::wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn logs_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<LogsV2>> {
    let query = Query::parse(raw)?.log_query()?;
    let entries = s.control.sandbox_logs(Some(&team), &id, query).await?;
    Ok(Json(LogsV2 {
        logs: entries.iter().map(SandboxLogEntry::from).collect(),
    }))
}

/// The operator's view (`vmon sandbox logs`): v2 filters, entries with their timestamps in
/// milliseconds so a follower can continue from the last one.
#[utoipa::path(
    get, path = "/admin/sandboxes/{sandboxID}/logs", tag = "admin",
    summary = "Any sandbox's console log entries (`vmon sandbox logs`)",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
        ("cursor" = Option<i64>, Query, description = "Unix milliseconds to continue from"),
        ("direction" = Option<String>, Query, description = "`forward` (default) or `backward`"),
        ("level" = Option<vmon_proto::node::LogLevel>, Query, description = "Lowest level to answer"),
        ("search" = Option<String>, Query, max_length = 256, description = "Only entries containing this text"),
        ("limit" = Option<u32>, Query, maximum = 10000, description = "At most this many (default 1000)"),
    ),
    responses(
        (status = 200, description = "Entries, timestamps in milliseconds", body = Vec<LogEntry>),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn admin_logs(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<LogEntry>>> {
    let query = Query::parse(raw)?.log_query()?;
    Ok(Json(s.control.sandbox_logs(None, &id, query).await?))
}

#[utoipa::path(
    get, path = "/metrics", tag = "telemetry",
    summary = "The platform's Prometheus metrics",
    security(("AdminToken" = []), ("MetricsToken" = [])),
    responses(
        (status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain; version=0.0.4"),
    )
)]
async fn prometheus(State(s): State<AppState>, _: MetricsReader) -> Response {
    let (mut running, mut paused) = (0u64, 0u64);
    match s.control.sandboxes(None).await {
        Ok(recs) => {
            for r in recs {
                match r.state {
                    SandboxState::Running => running += 1,
                    SandboxState::Paused => paused += 1,
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "metrics: listing sandboxes failed"),
    }
    let pool = s.control.node().pool_depths().await.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "metrics: the node did not give its pool depths");
        Vec::new()
    });
    let body = platform().render(&[("running", running), ("paused", paused)], &pool);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// The transition a REST route performs, for the latency histogram.
fn operation(method: &Method, path: &str) -> Option<&'static str> {
    Some(match (method.as_str(), path) {
        ("POST", "/sandboxes" | "/v2/sandboxes") => "create",
        ("DELETE", "/sandboxes/{id}") => "kill",
        ("DELETE", "/admin/sandboxes/{id}") => "admin_kill",
        ("POST", "/sandboxes/{id}/pause") => "pause",
        ("POST", "/sandboxes/{id}/resume") => "resume",
        ("POST", "/sandboxes/{id}/connect" | "/v2/sandboxes/{id}/connect") => "connect",
        ("POST", "/sandboxes/{id}/fork") => "fork",
        ("POST", "/sandboxes/{id}/snapshots") => "snapshot",
        ("POST", "/sandboxes/{id}/timeout" | "/sandboxes/{id}/refreshes") => "set_timeout",
        ("PUT", "/sandboxes/{id}/network") => "update_network",
        _ => return None,
    })
}

/// Middleware timing every transition route into [`Platform::transition`].
pub async fn track_transitions(req: Request, next: Next) -> Response {
    let op = req
        .extensions()
        .get::<MatchedPath>()
        .and_then(|p| operation(req.method(), p.as_str()));
    let t0 = Instant::now();
    let resp = next.run(req).await;
    if let Some(op) = op {
        platform().transition(op, resp.status().is_success(), t0.elapsed());
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_json_has_the_sdk_keys() {
        let m = SandboxMetric::from(&MetricSample {
            timestamp_unix: 1_700_000_000,
            cpu_count: 2,
            cpu_used_pct: 12.5,
            mem_used: 1,
            mem_total: 2,
            mem_cache: 3,
            disk_used: 4,
            disk_total: 5,
        });
        let v = serde_json::to_value(&m).expect("json");
        let mut keys: Vec<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort();
        assert_eq!(
            keys,
            vec![
                "cpuCount",
                "cpuUsedPct",
                "diskTotal",
                "diskUsed",
                "memCache",
                "memTotal",
                "memUsed",
                "timestamp",
                "timestampUnix"
            ]
        );
        assert_eq!(v["timestamp"], "2023-11-14T22:13:20Z");
    }

    #[test]
    fn log_queries_are_validated() {
        let q = Query::parse(Some(
            "cursor=5&limit=7&direction=backward&level=warn&search=x".into(),
        ))
        .expect("query");
        let lq = q.log_query().expect("valid");
        assert_eq!(lq.cursor_ms, Some(5));
        assert_eq!(lq.limit, 7);
        assert_eq!(lq.direction, LogDirection::Backward);
        assert_eq!(lq.min_level, Some(LogLevel::Warn));
        for bad in [
            "direction=up",
            "level=loud",
            "limit=-1",
            "limit=100001",
            "cursor=x",
        ] {
            let q = Query::parse(Some(bad.into())).expect("query");
            assert!(q.log_query().is_err(), "{bad}");
        }
    }
}
