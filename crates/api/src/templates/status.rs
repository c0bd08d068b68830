//! A build's status and its log entries, a page at a time (`logsOffset`, `limit`): the
//! Template SDK polls the status while a build runs and prints the entries it has not seen.

use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::{own_build, rfc3339};
use crate::control::record_error;
use crate::error::{ApiError, ApiResult};
use crate::records::BuildState;
use crate::state::{query_pairs, AppState, Auth};

/// Most log entries one status page holds.
const MAX_PAGE: i64 = 100;

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
        match crate::state::query_one(&pairs, name)? {
            Some(v) => crate::state::query_int::<i64>(v)
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
