//! The REST surface (axum): the route table (merging the routes of [`admin`],
//! [`events`](crate::events) and [`telemetry`](crate::telemetry)) and the sandbox handlers,
//! each of which turns one request into one [`Control`](crate::control::Control) call run to
//! completion in its own task. The state and extractors they share are in [`crate::state`].

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use time::OffsetDateTime;

use crate::control::{CreateParams, KillReason};
use crate::error::{ApiError, ApiResult};
use crate::records::{SandboxRecord, SandboxState, Team};
use crate::state::{body, query_pairs, AppState, Auth};
use crate::{admin, wire};

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/sandboxes", post(create_legacy).get(list_legacy))
        .route("/v2/sandboxes", post(create_v2).get(list_v2))
        .route("/sandboxes/:id", get(get_sandbox).delete(kill))
        .route("/sandboxes/:id/timeout", post(set_timeout))
        .route("/sandboxes/:id/refreshes", post(refresh))
        .route("/sandboxes/:id/pause", post(pause))
        .route("/sandboxes/:id/resume", post(resume))
        .route("/sandboxes/:id/connect", post(connect_legacy))
        .route("/v2/sandboxes/:id/connect", post(connect_v2))
        .route("/sandboxes/:id/fork", post(fork))
        .route("/sandboxes/:id/snapshots", post(snapshot))
        .route("/sandboxes/:id/network", put(update_network))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/*id", delete(delete_template))
        .merge(admin::routes())
        .merge(crate::telemetry::routes())
        .layer(axum::middleware::from_fn(
            crate::telemetry::track_transitions,
        ))
        .merge(crate::events::routes())
        .merge(crate::dashboard::routes())
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .with_state(state)
}

/// Runs `f` in its own task so it completes even when the client disconnects.
async fn detached<T, F>(f: F) -> ApiResult<T>
where
    T: Send + 'static,
    F: std::future::Future<Output = ApiResult<T>> + Send + 'static,
{
    tokio::spawn(f)
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("the operation failed: {e}"))))
}

fn query_value<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .rev()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

async fn create_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    create(s, team, headers, bytes, false).await
}

async fn create_legacy(
    State(s): State<AppState>,
    Auth(team): Auth,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    create(s, team, headers, bytes, true).await
}

async fn create(
    s: AppState,
    team: Team,
    headers: HeaderMap,
    bytes: Bytes,
    legacy: bool,
) -> ApiResult<Response> {
    let request: wire::NewSandbox = body(&bytes)?;
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::bad_request("Idempotency-Key must be ASCII"))?
                .to_string(),
        ),
    };
    let control = s.control.clone();
    let sandbox = detached(async move {
        control
            .create(
                &team,
                CreateParams {
                    request,
                    legacy,
                    idempotency_key,
                },
            )
            .await
    })
    .await?;
    Ok((StatusCode::CREATED, Json(sandbox)).into_response())
}

async fn get_sandbox(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::SandboxDetail>> {
    Ok(Json(s.control.detail(&team, &id).await?))
}

async fn kill(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let control = s.control.clone();
    detached(async move { control.kill(&team, &id, KillReason::Request).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn set_timeout(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let req: wire::TimeoutRequest = body(&bytes)?;
    let timeout = crate::control::timeout_secs(req.timeout, "timeout")?;
    let control = s.control.clone();
    detached(async move { control.set_timeout(&team, &id, timeout).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn refresh(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let req: wire::RefreshRequest = body(&bytes)?;
    let duration = req
        .duration
        .map(|d| crate::control::timeout_secs(d, "duration"))
        .transpose()?;
    let control = s.control.clone();
    detached(async move { control.refresh(&team, &id, duration).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let req: wire::PauseRequest = body(&bytes)?;
    let memory = req.memory.unwrap_or(true);
    let control = s.control.clone();
    detached(async move { control.pause(&team, &id, memory).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn connect_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    connect(s, team, id, bytes).await
}

async fn connect_legacy(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    connect(s, team, id, bytes).await
}

async fn connect(s: AppState, team: Team, id: String, bytes: Bytes) -> ApiResult<Response> {
    let req: wire::ConnectRequest = body(&bytes)?;
    let timeout = crate::control::timeout_secs(req.timeout.unwrap_or(300), "timeout")?;
    let control = s.control.clone();
    let (sandbox, resumed) =
        detached(async move { control.connect(&team, &id, timeout, req.memory).await }).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox)).into_response())
}

async fn resume(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: wire::ResumeRequest = body(&bytes)?;
    let timeout = crate::control::timeout_secs(req.timeout.unwrap_or(15), "timeout")?;
    let control = s.control.clone();
    let sandbox = detached(async move {
        control
            .resume(&team, &id, timeout, req.memory, req.auto_pause)
            .await
    })
    .await?;
    Ok((StatusCode::CREATED, Json(sandbox)).into_response())
}

async fn fork(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: wire::ForkRequest = body(&bytes)?;
    let timeout = crate::control::timeout_secs(req.timeout.unwrap_or(15), "timeout")?;
    let count = req.count.unwrap_or(1);
    let count = u32::try_from(count)
        .map_err(|_| ApiError::bad_request("count must be between 1 and 100"))?;
    let control = s.control.clone();
    let results = detached(async move { control.fork(&team, &id, timeout, count).await }).await?;
    Ok((StatusCode::CREATED, Json(results)).into_response())
}

async fn snapshot(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: wire::SnapshotRequest = body(&bytes)?;
    let control = s.control.clone();
    let info = detached(async move {
        control
            .snapshot(&team, &id, req.name.as_deref(), req.memory.unwrap_or(true))
            .await
    })
    .await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn update_network(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let req: wire::NetworkUpdate = body(&bytes)?;
    let control = s.control.clone();
    detached(async move { control.update_network(&team, &id, req).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn delete_template(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let control = s.control.clone();
    detached(async move { control.delete_template(&team, &id).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_snapshots(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q = query_pairs(raw)?;
    let (limit, offset) = paging(&q)?;
    let all = s
        .control
        .list_snapshots(&team, query_value(&q, "sandboxID"), query_value(&q, "name"))
        .await?;
    let page: Vec<_> = all.iter().skip(offset).take(limit).cloned().collect();
    let mut resp = Json(page).into_response();
    if offset + limit < all.len() {
        set_header(&mut resp, "x-next-token", &(offset + limit).to_string());
    }
    Ok(resp)
}

fn paging(q: &[(String, String)]) -> ApiResult<(usize, usize)> {
    let limit = match query_value(q, "limit") {
        None => 100,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| ApiError::bad_request("limit must be between 1 and 1000"))?,
    };
    let offset = match query_value(q, "nextToken").filter(|t| !t.is_empty()) {
        None => 0,
        Some(t) => t
            .parse::<usize>()
            .map_err(|_| ApiError::bad_request("invalid nextToken"))?,
    };
    Ok((limit, offset))
}

fn set_header(resp: &mut Response, name: &'static str, value: &str) {
    if let Ok(v) = HeaderValue::from_str(value) {
        resp.headers_mut().insert(name, v);
    }
}

/// `metadata=k%3Dv%26k2%3Dv2`: one string, itself url-encoded, keys and values quoted inside.
fn metadata_filter(q: &[(String, String)]) -> ApiResult<Vec<(String, String)>> {
    let Some(raw) = query_value(q, "metadata").filter(|m| !m.is_empty()) else {
        return Ok(Vec::new());
    };
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw)
        .map_err(|e| ApiError::bad_request(format!("invalid metadata filter: {e}")))?;
    // The SDK quotes keys and values once more before encoding the pairs.
    Ok(pairs
        .into_iter()
        .map(|(k, v)| (percent_unquote(&k), percent_unquote(&v)))
        .collect())
}

fn percent_unquote(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    serde_urlencoded::from_str::<Vec<(String, String)>>(&format!("x={}", s.replace('+', "%2B")))
        .ok()
        .and_then(|v| v.into_iter().next().map(|(_, v)| v))
        .unwrap_or_else(|| s.to_string())
}

fn matches_metadata(rec: &SandboxRecord, filter: &[(String, String)]) -> bool {
    filter
        .iter()
        .all(|(k, v)| rec.metadata.get(k).is_some_and(|x| x == v))
}

async fn list_legacy(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<wire::ListedSandbox>>> {
    let q = query_pairs(raw)?;
    let filter = metadata_filter(&q)?;
    let mut recs: Vec<_> = s
        .control
        .sandboxes(Some(&team.id))
        .await?
        .into_iter()
        .filter(|r| r.state == SandboxState::Running && matches_metadata(r, &filter))
        .collect();
    recs.sort_by(|a, b| (a.started_at, &a.id).cmp(&(b.started_at, &b.id)));
    Ok(Json(
        recs.iter().map(|r| s.control.listed_view(r)).collect(),
    ))
}

async fn list_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q = query_pairs(raw)?;
    let filter = metadata_filter(&q)?;
    let states: Vec<SandboxState> = match query_value(&q, "state").filter(|v| !v.is_empty()) {
        None => vec![SandboxState::Running, SandboxState::Paused],
        Some(v) => v
            .split(',')
            .map(|s| match s.trim() {
                "running" => Ok(SandboxState::Running),
                "paused" => Ok(SandboxState::Paused),
                other => Err(ApiError::bad_request(format!(
                    "invalid state {other:?}: use running or paused"
                ))),
            })
            .collect::<ApiResult<_>>()?,
    };
    let descending = match query_value(&q, "order") {
        None | Some("") | Some("desc") => true,
        Some("asc") => false,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "invalid order {o:?}: use asc or desc"
            )))
        }
    };
    let started_after = match query_value(&q, "startedAfter").filter(|v| !v.is_empty()) {
        None => None,
        Some(v) => Some(
            OffsetDateTime::parse(v, &time::format_description::well_known::Rfc3339)
                .map_err(|e| ApiError::bad_request(format!("invalid startedAfter {v:?}: {e}")))?,
        ),
    };
    let template = query_value(&q, "template").filter(|v| !v.is_empty());
    let limit = match query_value(&q, "limit") {
        None => 100,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| ApiError::bad_request("limit must be between 1 and 1000"))?,
    };
    let cursor = match query_value(&q, "nextToken").filter(|t| !t.is_empty()) {
        None => None,
        Some(t) => Some(parse_cursor(t).ok_or_else(|| ApiError::bad_request("invalid nextToken"))?),
    };

    let all = s.control.sandboxes(Some(&team.id)).await?;
    let total_running = all
        .iter()
        .filter(|r| r.state == SandboxState::Running)
        .count();
    let mut recs: Vec<_> = all
        .into_iter()
        .filter(|r| states.contains(&r.state))
        .filter(|r| matches_metadata(r, &filter))
        // Inclusive, at the precision the API reports: the sandbox that started at exactly
        // `startedAfter` (a client passing back a `startedAt` it was given) is listed.
        .filter(|r| started_after.is_none_or(|t| crate::control::to_micros(r.started_at) >= t))
        .filter(|r| template.is_none_or(|t| r.template_id == t || r.alias.as_deref() == Some(t)))
        .collect();
    recs.sort_by(|a, b| {
        let o = (a.started_at, &a.id).cmp(&(b.started_at, &b.id));
        if descending {
            o.reverse()
        } else {
            o
        }
    });
    if let Some((t, id)) = &cursor {
        recs.retain(|r| {
            let o = (r.started_at.unix_timestamp_nanos(), &r.id).cmp(&(*t, id));
            if descending {
                o == std::cmp::Ordering::Less
            } else {
                o == std::cmp::Ordering::Greater
            }
        });
    }
    let more = recs.len() > limit;
    recs.truncate(limit);
    let page: Vec<_> = recs.iter().map(|r| s.control.listed_view(r)).collect();
    let mut resp = Json(page).into_response();
    set_header(&mut resp, "x-total-running", &total_running.to_string());
    if more {
        if let Some(last) = recs.last() {
            let token = format!("{}_{}", last.started_at.unix_timestamp_nanos(), last.id);
            set_header(&mut resp, "x-next-token", &token);
        }
    }
    Ok(resp)
}

fn parse_cursor(t: &str) -> Option<(i128, String)> {
    let (nanos, id) = t.split_once('_')?;
    Some((nanos.parse().ok()?, id.to_string()))
}

/// Whether the platform takes creates: 200 `{"status": "ready"}` once `base` is built; until
/// then 503 with `status` `building` (or `failed`, while a failed build waits to be retried),
/// the step, its percent and the time elapsed, and the E2B error fields `code` and `message`.
async fn health(State(st): State<AppState>) -> Response {
    let s = st.control.startup().snapshot();
    let ready = s.phase == vmon_proto::progress::Phase::Ready;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = serde_json::json!({
        "status": s.phase.as_str(),
        "building": s.what,
        "message": s.message(),
        "elapsedSecs": s.elapsed.as_secs(),
    });
    if !ready {
        body["code"] = status.as_u16().into();
        body["step"] = s.step.into();
        body["detail"] = s.detail.into();
        body["percent"] = s.percent.into();
        body["error"] = s.error.into();
    }
    (status, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filter_decodes_the_sdk_encoding() {
        // What the SDK sends for {"a b": "x&y", "k": "v"}.
        let sent = "a%2520b=x%2526y&k=v";
        let q = query_pairs(Some(format!(
            "metadata={}",
            sent.replace('%', "%25")
                .replace('&', "%26")
                .replace('=', "%3D")
        )))
        .expect("query");
        let f = metadata_filter(&q).expect("filter");
        assert_eq!(
            f,
            vec![
                ("a b".to_string(), "x&y".to_string()),
                ("k".to_string(), "v".to_string())
            ]
        );
    }

    #[test]
    fn empty_body_is_an_empty_object() {
        let r: wire::PauseRequest = body(&Bytes::from_static(b"")).expect("empty");
        assert!(r.memory.is_none());
        let e = body::<wire::TimeoutRequest>(&Bytes::from_static(b"{\"timeout\":\"x\"}"))
            .expect_err("type error");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}
