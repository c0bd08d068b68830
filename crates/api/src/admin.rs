//! Operator routes under `/admin`, authenticated by `X-Admin-Token` (the token `vmon up` keeps
//! in its data dir), behind the `vmon team|key|sandbox` verbs; and the first-start bootstrap.

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::control::KillReason;
use crate::error::{ApiError, ApiResult};
use crate::ids;
use crate::records::{ApiKeyInfo, Records, Team, TeamLimits};
use crate::state::{Admin, AppState};

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/admin/teams", post(create_team).get(list_teams))
        .route("/admin/teams/{id}/keys", post(create_key))
        .route("/admin/keys", get(list_keys))
        .route("/admin/keys/{id}", delete(revoke_key))
        .route("/admin/sandboxes", get(list_sandboxes))
        .route("/admin/nodes", get(list_nodes))
        .route(
            "/admin/nodes/{id}/drain",
            post(drain_node).get(drain_status).delete(undrain_node),
        )
        .route("/admin/sandboxes/{id}/migrate", post(migrate_sandbox))
        .route("/admin/sandboxes/{id}", delete(kill_sandbox))
        .route("/admin/routes/{id}", get(route))
        .route("/admin/routes/{id}/resume", post(resume_route))
        .route("/admin/activity", post(report_activity))
}

/// What a standalone `vmon proxy` reports every few seconds: the sandboxes that had traffic.
#[derive(Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ActivityReport {
    #[schema(value_type = Vec<Object>)]
    pub sandboxes: Vec<vmon_proxy::activity::Idle>,
}

/// Reports at most this many sandboxes per call.
const MAX_ACTIVITY_REPORT: usize = 10_000;

#[utoipa::path(
    post, path = "/admin/activity", tag = "admin",
    summary = "A standalone proxy's traffic report: how long each sandbox has been idle (idle auto-suspend)",
    request_body = ActivityReport,
    responses(
        (status = 204, description = "Noted"),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "Admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn report_activity(
    State(s): State<AppState>,
    _: Admin,
    bytes: Bytes,
) -> ApiResult<StatusCode> {
    let report: ActivityReport = crate::state::body(&bytes)?;
    if report.sandboxes.len() > MAX_ACTIVITY_REPORT {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_ACTIVITY_REPORT} sandboxes per report"
        )));
    }
    s.control.note_activity(&report.sandboxes).await;
    Ok(StatusCode::NO_CONTENT)
}

/// A sandbox's route as a standalone `vmon proxy` reads it.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RouteInfo {
    #[serde(rename = "guestIp")]
    #[schema(value_type = Option<String>)]
    pub guest_ip: Option<std::net::IpAddr>,
    #[serde(rename = "autoResume")]
    pub auto_resume: bool,
    #[serde(rename = "trafficAccessToken")]
    pub traffic_access_token: Option<String>,
    /// In a cluster: the host of the node that runs it (a proxy on another host forwards).
    #[serde(rename = "nodeHost", default, skip_serializing_if = "Option::is_none")]
    pub node_host: Option<String>,
    /// In a cluster: the ingress on that host.
    #[serde(
        rename = "ingressUrl",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub ingress_url: Option<String>,
    /// The sandbox's current run: a proxy keeps envd's connections alive per run.
    #[serde(
        rename = "executionId",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub execution_id: Option<String>,
}

#[utoipa::path(
    get, path = "/admin/routes/{sandboxID}", tag = "admin",
    summary = "A sandbox's route, as a standalone proxy reads it",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
    ),
    responses(
        (status = 200, description = "The route", body = RouteInfo),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn route(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> ApiResult<Json<RouteInfo>> {
    use vmon_proxy::Routes;
    let r = crate::control::ProxyRoutes(s.control.clone())
        .lookup(&id)
        .await
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    let (node_host, ingress_url, located) = match s.control.node_location(&id).await {
        Some((h, i, ip)) => (Some(h), i, ip),
        None => (None, None, None),
    };
    Ok(Json(RouteInfo {
        // Running: the address on the node the placement names (a migration moves both).
        guest_ip: r.guest_ip.map(|ip| located.unwrap_or(ip)),
        auto_resume: r.auto_resume,
        traffic_access_token: r.traffic_access_token,
        node_host,
        ingress_url,
        execution_id: r.execution_id,
    }))
}

#[utoipa::path(
    post, path = "/admin/routes/{sandboxID}/resume", tag = "admin",
    summary = "Resume a paused sandbox for incoming traffic (auto-resume)",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
    ),
    responses(
        (status = 200, description = "The route of the running sandbox", body = RouteInfo),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
        (status = 409, description = "The sandbox may not be resumed", body = crate::wire::ErrorBody),
        (status = 503, description = "No capacity", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn resume_route(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> ApiResult<Json<RouteInfo>> {
    use vmon_proxy::{ResumeError, Routes};
    let routes = crate::control::ProxyRoutes(s.control.clone());
    match routes.resume_for_traffic(&id).await {
        Ok(ip) => Ok(Json(RouteInfo {
            guest_ip: Some(ip),
            auto_resume: true,
            traffic_access_token: None,
            node_host: None,
            ingress_url: None,
            execution_id: None,
        })),
        Err(ResumeError::NotFound(_)) => Err(ApiError::sandbox_not_found(&id)),
        Err(ResumeError::Refused(m)) => Err(ApiError::conflict(m)),
        Err(ResumeError::Failed(m)) => Err(ApiError::internal(m)),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct NewTeam {
    pub name: String,
    pub slug: Option<String>,
    pub limits: Option<TeamLimits>,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TeamWithKey {
    pub team: Team,
    #[serde(rename = "apiKey")]
    pub api_key: String,
    pub key: ApiKeyInfo,
}

#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AdminSandbox {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "teamID")]
    pub team_id: String,
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub state: String,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    /// In a cluster: the node it runs on (or last ran on, while paused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The build it runs from, or (paused) the build its pause made.
    #[serde(rename = "buildID")]
    pub build_id: String,
}

/// Slugs are the namespace of snapshot names: `[a-z0-9-]`.
fn slugify(name: &str) -> String {
    let s: String = name
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let s = s.trim_matches('-').to_string();
    if s.is_empty() {
        ids::random_lower(8)
    } else {
        s
    }
}

/// Creates a team and its first API key; the key's plaintext exists only in the result.
pub async fn create_team_with_key(
    records: &dyn Records,
    name: &str,
    slug: Option<&str>,
    limits: TeamLimits,
) -> anyhow::Result<TeamWithKey> {
    let team = create_team_only(records, name, slug, limits).await?;
    let api_key = ids::api_key();
    let key = records.add_key(&team.id, &api_key).await?;
    Ok(TeamWithKey { team, api_key, key })
}

/// A new team without keys (`vmon up`'s bootstrap adds the key it wrote down first).
pub async fn create_team_only(
    records: &dyn Records,
    name: &str,
    slug: Option<&str>,
    limits: TeamLimits,
) -> anyhow::Result<Team> {
    let team = Team {
        id: uuid::Uuid::new_v4().to_string(),
        name: name.to_string(),
        slug: slug.map(str::to_string).unwrap_or_else(|| slugify(name)),
        limits,
    };
    records.put_team(team.clone()).await?;
    Ok(team)
}

#[utoipa::path(
    post, path = "/admin/teams", tag = "admin",
    summary = "Create a team and its first API key",
    request_body = NewTeam,
    responses(
        (status = 201, description = "The team and its key (the key's only appearance)", body = TeamWithKey),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 409, description = "The slug is taken", body = crate::wire::ErrorBody),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn create_team(
    State(s): State<AppState>,
    _: Admin,
    bytes: Bytes,
) -> ApiResult<(StatusCode, Json<TeamWithKey>)> {
    let req: NewTeam = crate::state::body(&bytes)?;
    if req.name.trim().is_empty() {
        return Err(ApiError::bad_request("name must not be empty"));
    }
    let records = s.control.records();
    // The slug asked for, or the one the name gives: either way it must be free.
    let slug = Some(slugify(req.slug.as_deref().unwrap_or(req.name.trim())));
    if let Some(slug) = &slug {
        let taken = records
            .teams()
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .iter()
            .any(|t| t.slug == *slug);
        if taken {
            return Err(ApiError::conflict(format!(
                "the slug {slug:?} is taken (name the team differently or pass a slug)"
            )));
        }
    }
    let limits = req
        .limits
        .unwrap_or_else(|| s.control.config().default_limits.clone());
    let created = create_team_with_key(records.as_ref(), req.name.trim(), slug.as_deref(), limits)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((StatusCode::CREATED, Json(created)))
}

#[utoipa::path(
    get, path = "/admin/teams", tag = "admin",
    summary = "Every team",
    responses(
        (status = 200, description = "The teams", body = Vec<Team>),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn list_teams(State(s): State<AppState>, _: Admin) -> ApiResult<Json<Vec<Team>>> {
    s.control
        .records()
        .teams()
        .await
        .map(Json)
        .map_err(|e| ApiError::internal(e.to_string()))
}

#[utoipa::path(
    post, path = "/admin/teams/{teamID}/keys", tag = "admin",
    summary = "Create another API key for a team",
    params(
        ("teamID" = String, Path, description = "The team"),
    ),
    responses(
        (status = 201, description = "The team and the new key", body = TeamWithKey),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn create_key(
    State(s): State<AppState>,
    _: Admin,
    Path(team_id): Path<String>,
) -> ApiResult<(StatusCode, Json<TeamWithKey>)> {
    let records = s.control.records();
    let team = records
        .team(&team_id)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .ok_or_else(|| ApiError::not_found(format!("team {team_id} not found")))?;
    let api_key = ids::api_key();
    let key = records
        .add_key(&team.id, &api_key)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((
        StatusCode::CREATED,
        Json(TeamWithKey { team, api_key, key }),
    ))
}

#[utoipa::path(
    get, path = "/admin/keys", tag = "admin",
    summary = "API keys (never their plaintext)",
    params(
        ("team" = Option<String>, Query, description = "Only this team's keys"),
    ),
    responses(
        (status = 200, description = "The keys", body = Vec<ApiKeyInfo>),
        (status = 400, description = "Invalid request", body = crate::wire::ErrorBody),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn list_keys(
    State(s): State<AppState>,
    _: Admin,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<Vec<ApiKeyInfo>>> {
    let q: Vec<(String, String)> = serde_urlencoded::from_str(raw.as_deref().unwrap_or(""))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let team = q.iter().find(|(k, _)| k == "team").map(|(_, v)| v.as_str());
    s.control
        .records()
        .keys(team)
        .await
        .map(Json)
        .map_err(|e| ApiError::internal(e.to_string()))
}

#[utoipa::path(
    delete, path = "/admin/keys/{keyID}", tag = "admin",
    summary = "Revoke an API key",
    params(
        ("keyID" = String, Path, description = "The key"),
    ),
    responses(
        (status = 204, description = "Revoked"),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn revoke_key(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    match s.control.records().revoke_key(&id).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(ApiError::not_found(format!("key {id} not found"))),
        Err(e) => Err(ApiError::internal(e.to_string())),
    }
}

#[utoipa::path(
    get, path = "/admin/sandboxes", tag = "admin",
    summary = "Every team's sandboxes",
    responses(
        (status = 200, description = "The sandboxes, oldest first", body = Vec<AdminSandbox>),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn list_sandboxes(State(s): State<AppState>, _: Admin) -> ApiResult<Json<Vec<AdminSandbox>>> {
    let mut recs = s.control.sandboxes(None).await?;
    recs.sort_by_key(|r| r.started_at);
    let mut out = Vec::with_capacity(recs.len());
    for r in recs {
        out.push(AdminSandbox {
            node: s.control.placement(&r.id).await,
            build_id: r.build.build_id.clone(),
            sandbox_id: r.id,
            team_id: r.team_id,
            template_id: r.template_id,
            state: r.state.as_str().to_string(),
            started_at: crate::control::rfc3339(r.started_at),
            end_at: crate::control::rfc3339(r.end_at),
        });
    }
    Ok(Json(out))
}

#[utoipa::path(
    get, path = "/admin/nodes", tag = "admin",
    summary = "The cluster's nodes: capacity and load (empty on one machine)",
    responses(
        (status = 200, description = "The registered nodes", body = Vec<NodeView>),
        (status = 404, description = "Admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn list_nodes(State(s): State<AppState>, _: Admin) -> Json<Vec<NodeView>> {
    let draining = s.control.draining_nodes().await;
    let mut out = Vec::new();
    for info in s.control.members().await {
        let drain = if draining.contains(&info.id) {
            s.control.drain_status(&info.id).await
        } else {
            None
        };
        let state = match (&drain, draining.contains(&info.id)) {
            (Some(d), _) => d.state.clone(),
            (None, true) => "draining".into(),
            (None, false) => "active".into(),
        };
        out.push(NodeView { info, state, drain });
    }
    Json(out)
}

/// A node as `GET /admin/nodes` lists it: its registration, whether it takes new work, and
/// its drain's progress.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeView {
    #[serde(flatten)]
    pub info: vmon_proto::cluster::NodeInfo,
    /// `active`, `draining` or `drained` (or `stopped`: undrained before the end).
    pub state: String,
    pub drain: Option<crate::control::DrainStatus>,
}

#[utoipa::path(
    post, path = "/admin/nodes/{nodeID}/drain", tag = "admin",
    summary = "Drain a node: no new work; its sandboxes move to other nodes (live, or paused)",
    params(("nodeID" = String, Path, description = "The node")),
    responses(
        (status = 202, description = "Draining", body = crate::control::DrainStatus),
        (status = 400, description = "Not a cluster", body = crate::wire::ErrorBody),
        (status = 404, description = "Unknown node, or admin routes disabled", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn drain_node(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<crate::control::DrainStatus>)> {
    let status = s.control.drain(&id).await?;
    Ok((StatusCode::ACCEPTED, Json(status)))
}

#[utoipa::path(
    get, path = "/admin/nodes/{nodeID}/drain", tag = "admin",
    summary = "A node's drain progress",
    params(("nodeID" = String, Path, description = "The node")),
    responses(
        (status = 200, description = "Its progress", body = crate::control::DrainStatus),
        (status = 404, description = "No drain of this node, or admin routes disabled", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn drain_status(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> ApiResult<Json<crate::control::DrainStatus>> {
    s.control
        .drain_status(&id)
        .await
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("node {id} is not draining")))
}

#[utoipa::path(
    delete, path = "/admin/nodes/{nodeID}/drain", tag = "admin",
    summary = "Undrain a node: it takes new work again",
    params(("nodeID" = String, Path, description = "The node")),
    responses(
        (status = 204, description = "Takes new work"),
        (status = 400, description = "Not a cluster", body = crate::wire::ErrorBody),
        (status = 404, description = "Admin routes disabled", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn undrain_node(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    s.control.undrain(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Where to move a sandbox.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct MigrateRequest {
    /// The target node (default: the best other node that can take it).
    pub node: Option<String>,
}

/// A finished live migration.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct MigrateReport {
    pub from: String,
    pub to: String,
    /// The whole move (ms).
    #[serde(rename = "totalMs")]
    pub total_ms: u64,
    /// From the source's handover to the guest running on the target (ms).
    #[serde(rename = "switchMs")]
    pub switch_ms: u64,
    /// How long the guest was stopped: on the source before it handed over, then until it
    /// ran on the target (ms).
    #[serde(rename = "downtimeMs")]
    pub downtime_ms: u64,
    /// QEMU's own estimate of the guest's pause in the last round (ms).
    #[serde(rename = "qemuDowntimeMs")]
    pub qemu_downtime_ms: u64,
    #[serde(rename = "ramBytes")]
    pub ram_bytes: u64,
    #[serde(rename = "diskBytes")]
    pub disk_bytes: u64,
    pub rounds: u64,
    /// Guest pages compared between source and target after QEMU's last round.
    #[serde(rename = "checkedPages")]
    pub checked_pages: u64,
    /// Pages the target held otherwise (guest writes QEMU's copy missed), repaired from the
    /// source before the guest ran there.
    #[serde(rename = "repairedPages")]
    pub repaired_pages: u64,
    /// How long the check took, within `downtimeMs` (ms).
    #[serde(rename = "checkMs")]
    pub check_ms: u64,
}

#[utoipa::path(
    post, path = "/admin/sandboxes/{sandboxID}/migrate", tag = "admin",
    summary = "Live-migrate a running sandbox to another node",
    params(("sandboxID" = String, Path, description = "The sandbox")),
    request_body(content = MigrateRequest, description = "The target node (optional)"),
    responses(
        (status = 200, description = "Moved; it runs on the target", body = MigrateReport),
        (status = 400, description = "Not a cluster, or the sandbox cannot move", body = crate::wire::ErrorBody),
        (status = 404, description = "Unknown id, or admin routes disabled", body = crate::wire::ErrorBody),
        (status = 409, description = "Paused, or another transition holds it", body = crate::wire::ErrorBody),
        (status = 503, description = "No node can take it", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn migrate_sandbox(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<MigrateReport>> {
    let req: MigrateRequest = if body.is_empty() {
        MigrateRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("bad migrate request: {e}")))?
    };
    let control = s.control.clone();
    // Detached: a client that gives up does not abandon a half-done move.
    let m = tokio::spawn(async move { control.migrate(&id, req.node.as_deref()).await })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(Json(MigrateReport {
        from: m.from,
        to: m.to,
        total_ms: m.total_ms,
        switch_ms: m.switch_ms,
        downtime_ms: m.stats.stopped_ms + m.switch_ms,
        qemu_downtime_ms: m.stats.qemu_downtime_ms,
        ram_bytes: m.stats.ram_bytes,
        disk_bytes: m.stats.disk_bytes,
        rounds: m.stats.rounds,
        checked_pages: m.stats.checked_pages,
        repaired_pages: m.stats.repaired_pages,
        check_ms: m.stats.check_ms,
    }))
}

#[utoipa::path(
    delete, path = "/admin/sandboxes/{sandboxID}", tag = "admin",
    summary = "Kill any team's sandbox",
    params(
        ("sandboxID" = String, Path, description = "The sandbox"),
    ),
    responses(
        (status = 204, description = "Killed"),
        (status = 404, description = "Unknown id, or admin routes disabled (no admin token)", body = crate::wire::ErrorBody),
        (status = 409, description = "Another transition holds the sandbox", body = crate::wire::ErrorBody),
    ),
    security(("AdminToken" = []))
)]
async fn kill_sandbox(
    State(s): State<AppState>,
    _: Admin,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let control = s.control.clone();
    let rec = control
        .records()
        .sandbox(&id)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    let team = control
        .records()
        .team(&rec.team_id)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    tokio::spawn(async move { control.kill(&team, &id, KillReason::Admin).await })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(StatusCode::NO_CONTENT)
}
