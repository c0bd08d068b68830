//! The sandbox handlers of the REST surface (axum), each of which turns one request into one [`Control`](crate::control::Control) call run to
//! completion in its own task. The state and extractors they share are in [`crate::state`].

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use time::OffsetDateTime;

use crate::control::{CreateParams, KillReason};
use crate::error::{ApiError, ApiResult};
use crate::records::{SandboxListing, SandboxRecord, SandboxState, Team};
use crate::state::{body, query_pairs, AppState, Auth};
use crate::{views, wire};

/// The sandbox routes (`/sandboxes`, `/v2/sandboxes`, `/snapshots`, `/health`); the whole
/// table is assembled in [`crate::router`].
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/health", get(health))
        .route("/sandboxes", post(create_legacy).get(list_legacy))
        .route("/v2/sandboxes", post(create_v2).get(list_v2))
        .route("/sandboxes/{id}", get(get_sandbox).delete(kill))
        .route("/sandboxes/{id}/health", get(sandbox_health))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/connect", post(connect_legacy))
        .route("/v2/sandboxes/{id}/connect", post(connect_v2))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/sandboxes/{id}/network", put(update_network))
        .route("/snapshots", get(list_snapshots))
}

/// Runs `f` in its own task so it completes even when the client disconnects.
async fn detached<T, E, F>(f: F) -> ApiResult<T>
where
    T: Send + 'static,
    E: Into<ApiError> + Send + 'static,
    F: std::future::Future<Output = Result<T, E>> + Send + 'static,
{
    match tokio::spawn(f).await {
        Ok(r) => r.map_err(Into::into),
        Err(e) => Err(ApiError::internal(format!("the operation failed: {e}"))),
    }
}

fn query_value<'a>(pairs: &'a [(String, String)], name: &str) -> ApiResult<Option<&'a str>> {
    crate::state::query_one(pairs, name)
}

#[utoipa::path(
    post, path = "/v2/sandboxes", tag = "sandboxes",
    summary = "Create a sandbox from a template",
    params(("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe creation: the same key answers the same sandbox")),
    request_body = wire::NewSandbox,
    responses(
        (status = 201, description = "The sandbox runs", body = wire::Sandbox),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such template", body = wire::ErrorBody),
        (status = 409, description = "Conflict (an idempotency key in use)", body = wire::ErrorBody),
        (status = 429, description = "A team limit is reached", body = wire::ErrorBody),
        (status = 503, description = "No capacity, or the base template is still building", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn create_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    create(s, team, headers, bytes, false).await
}

#[utoipa::path(
    post, path = "/sandboxes", tag = "sandboxes",
    summary = "Create a sandbox (legacy: `NewSandbox`)",
    params(("Idempotency-Key" = Option<String>, Header, description = "Repeat-safe creation: the same key answers the same sandbox")),
    request_body = wire::NewSandbox,
    responses(
        (status = 201, description = "The sandbox runs", body = wire::Sandbox),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such template", body = wire::ErrorBody),
        (status = 409, description = "Conflict (an idempotency key in use)", body = wire::ErrorBody),
        (status = 429, description = "A team limit is reached", body = wire::ErrorBody),
        (status = 503, description = "No capacity, or the base template is still building", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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
    let rec = detached(async move {
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
    let sandbox = views::sandbox(s.control.config(), &rec);
    Ok((StatusCode::CREATED, Json(sandbox)).into_response())
}

#[utoipa::path(
    get, path = "/sandboxes/{sandboxID}", tag = "sandboxes",
    summary = "A running or paused sandbox",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    responses(
        (status = 200, description = "The sandbox", body = wire::SandboxDetail),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn get_sandbox(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::SandboxDetail>> {
    let (rec, location) = s.control.detail(&team, &id).await?;
    Ok(Json(views::detail(s.control.config(), &rec, location)))
}

#[utoipa::path(
    get, path = "/sandboxes/{sandboxID}/health", tag = "sandboxes",
    summary = "vmon: a sandbox's resumes (generation, whether the last one lost its processes, its kind and duration), where its state is, and its idle policy",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    responses(
        (status = 200, description = "The sandbox's health", body = wire::SandboxHealth),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn sandbox_health(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::SandboxHealth>> {
    Ok(Json(views::health(&s.control.health(&team, &id).await?)))
}

#[utoipa::path(
    delete, path = "/sandboxes/{sandboxID}", tag = "sandboxes",
    summary = "Kill a sandbox",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    responses(
        (status = 204, description = "Killed"),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "Another transition holds the sandbox", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn kill(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let control = s.control.clone();
    detached(async move { control.kill(&team, &id, KillReason::Request).await }).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(
    post, path = "/sandboxes/{sandboxID}/timeout", tag = "sandboxes",
    summary = "Set the time left until the sandbox ends",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = wire::TimeoutRequest,
    responses(
        (status = 204, description = "Set"),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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

#[utoipa::path(
    post, path = "/sandboxes/{sandboxID}/refreshes", tag = "sandboxes",
    summary = "Extend the sandbox's time left",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = Option<wire::RefreshRequest>,
    responses(
        (status = 204, description = "Extended"),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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

#[utoipa::path(
    post, path = "/sandboxes/{sandboxID}/pause", tag = "sandboxes",
    summary = "Pause a sandbox (memory and disk, or the disk only)",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = Option<wire::PauseRequest>,
    responses(
        (status = 204, description = "Paused"),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
        (status = 503, description = "No capacity", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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

#[utoipa::path(
    post, path = "/v2/sandboxes/{sandboxID}/connect", tag = "sandboxes",
    summary = "Connect to a sandbox, resuming it if it is paused",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = Option<wire::ConnectRequest>,
    responses(
        (status = 200, description = "It was running", body = wire::Sandbox),
        (status = 201, description = "It was paused and is resumed", body = wire::Sandbox),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
        (status = 429, description = "A team limit is reached", body = wire::ErrorBody),
        (status = 503, description = "No capacity", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn connect_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    connect(s, team, id, bytes).await
}

#[utoipa::path(
    post, path = "/sandboxes/{sandboxID}/connect", tag = "sandboxes",
    summary = "Connect to a sandbox, resuming it if it is paused",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = Option<wire::ConnectRequest>,
    responses(
        (status = 200, description = "It was running", body = wire::Sandbox),
        (status = 201, description = "It was paused and is resumed", body = wire::Sandbox),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
        (status = 429, description = "A team limit is reached", body = wire::ErrorBody),
        (status = 503, description = "No capacity", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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
    let (rec, resumed) =
        detached(async move { control.connect(&team, &id, timeout, req.memory).await }).await?;
    let sandbox = views::sandbox(s.control.config(), &rec);
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox)).into_response())
}

#[utoipa::path(
    post, path = "/sandboxes/{sandboxID}/resume", tag = "sandboxes",
    summary = "Resume a paused sandbox (deprecated: use connect)",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = Option<wire::ResumeRequest>,
    responses(
        (status = 201, description = "Resumed", body = wire::Sandbox),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
        (status = 429, description = "A team limit is reached", body = wire::ErrorBody),
        (status = 503, description = "No capacity", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn resume(
    State(s): State<AppState>,
    Auth(team): Auth,
    Path(id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let req: wire::ResumeRequest = body(&bytes)?;
    let timeout = crate::control::timeout_secs(req.timeout.unwrap_or(15), "timeout")?;
    let control = s.control.clone();
    let rec = detached(async move {
        control
            .resume(&team, &id, timeout, req.memory, req.auto_pause)
            .await
    })
    .await?;
    let sandbox = views::sandbox(s.control.config(), &rec);
    Ok((StatusCode::CREATED, Json(sandbox)).into_response())
}

#[utoipa::path(
    post, path = "/sandboxes/{sandboxID}/fork", tag = "sandboxes",
    summary = "Fork a running sandbox into new ones",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = Option<wire::ForkRequest>,
    responses(
        (status = 201, description = "One result per child: a sandbox or an error", body = Vec<wire::ForkResult>),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
        (status = 429, description = "A team limit is reached", body = wire::ErrorBody),
        (status = 503, description = "No capacity", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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
    let children = detached(async move { control.fork(&team, &id, timeout, count).await }).await?;
    let results: Vec<wire::ForkResult> = children
        .into_iter()
        .map(|child| views::fork_result(s.control.config(), child))
        .collect();
    Ok((StatusCode::CREATED, Json(results)).into_response())
}

#[utoipa::path(
    post, path = "/sandboxes/{sandboxID}/snapshots", tag = "sandboxes",
    summary = "Snapshot a sandbox into a template others can start from",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = Option<wire::SnapshotRequest>,
    responses(
        (status = 201, description = "The snapshot", body = wire::SnapshotInfo),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
        (status = 503, description = "No capacity", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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
    Ok((StatusCode::CREATED, Json(views::snapshot(info))).into_response())
}

#[utoipa::path(
    put, path = "/sandboxes/{sandboxID}/network", tag = "sandboxes",
    summary = "Replace the sandbox's egress rules",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body = wire::NetworkUpdate,
    responses(
        (status = 204, description = "Applied"),
        (status = 400, description = "Invalid request", body = wire::ErrorBody),
        (status = 404, description = "No such sandbox", body = wire::ErrorBody),
        (status = 409, description = "The sandbox is not in a state that allows this", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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

#[utoipa::path(
    get, path = "/snapshots", tag = "snapshots",
    summary = "The team's snapshots",
    params(
        ("sandboxID" = Option<String>, Query, description = "Only snapshots of this sandbox"),
        ("name" = Option<String>, Query, description = "Only snapshots with this name"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 1000, description = "Page size (default 100)"),
        ("nextToken" = Option<String>, Query, description = "The `x-next-token` of the previous page"),
    ),
    responses(
        (status = 200, description = "A page of snapshots", body = Vec<wire::SnapshotInfo>,
            headers(("x-next-token" = String, description = "Present when there is a next page"))),
        (status = 400, description = "Invalid query", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn list_snapshots(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q = query_pairs(raw)?;
    let (limit, offset) = paging(&q)?;
    let all = s
        .control
        .list_snapshots(
            &team,
            query_value(&q, "sandboxID")?,
            query_value(&q, "name")?,
        )
        .await?;
    let total = all.len();
    let page: Vec<wire::SnapshotInfo> = all
        .into_iter()
        .skip(offset)
        .take(limit)
        .map(views::snapshot)
        .collect();
    let mut resp = Json(page).into_response();
    if offset + limit < total {
        set_header(&mut resp, "x-next-token", &(offset + limit).to_string());
    }
    Ok(resp)
}

/// A list's `limit`: 1-1000, default 100.
fn page_limit(q: &[(String, String)]) -> ApiResult<usize> {
    match query_value(q, "limit")? {
        None => Ok(100),
        Some(v) => crate::state::query_int::<usize>(v)
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| ApiError::bad_request("limit must be between 1 and 1000")),
    }
}

fn paging(q: &[(String, String)]) -> ApiResult<(usize, usize)> {
    let limit = page_limit(q)?;
    let offset = match query_value(q, "nextToken")?.filter(|t| !t.is_empty()) {
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
    let Some(raw) = query_value(q, "metadata")?.filter(|m| !m.is_empty()) else {
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

#[utoipa::path(
    get, path = "/sandboxes", tag = "sandboxes",
    summary = "The team's running sandboxes (legacy)",
    params(("metadata" = Option<String>, Query, description = "URL-encoded `k=v&k2=v2`: only sandboxes with this metadata")),
    responses(
        (status = 200, description = "Running sandboxes, oldest first", body = Vec<wire::ListedSandbox>),
        (status = 400, description = "Invalid query", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
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
        recs.iter()
            .map(|r| views::listed(s.control.config(), r))
            .collect(),
    ))
}

#[utoipa::path(
    get, path = "/v2/sandboxes", tag = "sandboxes",
    summary = "The team's sandboxes, filtered and paged",
    params(
        ("metadata" = Option<String>, Query, description = "URL-encoded `k=v&k2=v2`: only sandboxes with this metadata"),
        ("state" = Option<String>, Query, description = "Comma-separated `running`, `paused` (default both)"),
        ("order" = Option<String>, Query, description = "`asc` or `desc` by start (default `desc`)"),
        ("startedAfter" = Option<String>, Query, description = "RFC 3339: only sandboxes started after"),
        ("template" = Option<String>, Query, description = "Only sandboxes of this template id or alias"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 1000, description = "Page size (default 100)"),
        ("nextToken" = Option<String>, Query, description = "The `x-next-token` of the previous page"),
    ),
    responses(
        (status = 200, description = "A page of sandboxes", body = Vec<wire::ListedSandbox>,
            headers(
                ("x-total-running" = String, description = "How many of the team's sandboxes run"),
                ("x-next-token" = String, description = "Present when there is a next page"),
            )),
        (status = 400, description = "Invalid query", body = wire::ErrorBody),
    ),
    security(("ApiKeyAuth" = []))
)]
async fn list_v2(
    State(s): State<AppState>,
    Auth(team): Auth,
    RawQuery(raw): RawQuery,
) -> ApiResult<Response> {
    let q = query_pairs(raw)?;
    let filter = metadata_filter(&q)?;
    let states: Vec<SandboxState> = match query_value(&q, "state")?.filter(|v| !v.is_empty()) {
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
    let descending = match query_value(&q, "order")? {
        None | Some("") | Some("desc") => true,
        Some("asc") => false,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "invalid order {o:?}: use asc or desc"
            )))
        }
    };
    let started_after = match query_value(&q, "startedAfter")?.filter(|v| !v.is_empty()) {
        None => None,
        Some(v) => Some(
            OffsetDateTime::parse(v, &time::format_description::well_known::Rfc3339)
                .map_err(|e| ApiError::bad_request(format!("invalid startedAfter {v:?}: {e}")))?,
        ),
    };
    let template = query_value(&q, "template")?.filter(|v| !v.is_empty());
    let listing = SandboxListing {
        states,
        metadata: filter,
        template: template.map(str::to_string),
        started_after,
        descending,
        cursor: query_value(&q, "nextToken")?
            .filter(|t| !t.is_empty())
            .map(|t| check_cursor(t).map(str::to_string))
            .transpose()?,
        limit: page_limit(&q)?,
        ..Default::default()
    };
    let page = s.control.sandbox_page(&team, listing).await?;
    let items: Vec<_> = page
        .items
        .iter()
        .map(|r| views::listed(s.control.config(), r))
        .collect();
    let mut resp = Json(items).into_response();
    set_header(
        &mut resp,
        "x-total-running",
        &page.total_running.to_string(),
    );
    if let Some(next) = &page.next_cursor {
        set_header(&mut resp, "x-next-token", next);
    }
    Ok(resp)
}

/// A `nextToken` as `x-next-token` gave it: a start time in milliseconds, a dot, a sandbox id.
fn check_cursor(t: &str) -> ApiResult<&str> {
    let valid = t.split_once('.').is_some_and(|(ms, id)| {
        ms.parse::<i64>().is_ok()
            && !id.is_empty()
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    });
    if valid {
        Ok(t)
    } else {
        Err(ApiError::bad_request("invalid nextToken"))
    }
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
