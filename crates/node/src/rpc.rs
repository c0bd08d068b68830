//! Node RPC: [`NodeControl`] over HTTP, so `vmon api` and `vmon node` can run as separate
//! processes (or hosts). One route per call, `POST /v1/<call>` with a JSON body, answered with
//! `{"ok": value}` or `{"err": NodeError}`. Every request carries the node's bearer token; the
//! node never accepts calls without it.
//!
//! With a certificate (`vmon node --tls-cert/--tls-key`) the node serves TLS only
//! ([`serve_with`]); clients reach it at `https://host:port` and verify it against a CA file
//! ([`RemoteNode::with_tls`]).

use std::sync::Arc;
use std::time::Duration;

use crate::tls::ClientTls;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use vmon_proto::node::{
    BuildInfo, ExecOutput, ExecSpec, KeptBuild, LogEntry, LogQuery, MetricSample, MigrateIn,
    MigrateOut, MigrateStats, NetworkPolicy, NodeControl, NodeError, OciImage, PauseBuild,
    PausedState, Running, StartSpec, TemplateSpec,
};

/// Largest RPC body either side reads (log pages are the big ones).
const MAX_BODY: usize = 64 << 20;

#[derive(Serialize, Deserialize)]
struct Build {
    build_id: String,
}

#[derive(Serialize, Deserialize)]
struct Target {
    sandbox_id: String,
    execution_id: String,
}

#[derive(Serialize, Deserialize)]
struct Capture {
    sandbox_id: String,
    execution_id: String,
    memory: bool,
}

#[derive(Serialize, Deserialize)]
struct Network {
    sandbox_id: String,
    execution_id: String,
    policy: NetworkPolicy,
}

#[derive(Serialize, Deserialize)]
struct Egress {
    sandbox_id: String,
    execution_id: String,
    egress: vmon_proto::egress::EgressSpec,
}

#[derive(Serialize, Deserialize)]
struct Metrics {
    sandbox_id: String,
    start_unix: i64,
    end_unix: i64,
}

#[derive(Serialize, Deserialize)]
struct Latest {
    sandbox_ids: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct Logs {
    sandbox_id: String,
    query: LogQuery,
}

#[derive(Serialize, Deserialize)]
struct Exec {
    sandbox_id: String,
    execution_id: String,
    spec: ExecSpec,
}

#[derive(Serialize, Deserialize)]
struct PutFile {
    sandbox_id: String,
    execution_id: String,
    host_path: String,
    guest_path: String,
}

#[derive(Serialize, Deserialize)]
struct Migration {
    migration_id: String,
}

#[derive(Clone)]
pub(crate) struct Served {
    node: Arc<dyn NodeControl>,
    pub(crate) token: Arc<String>,
    pub(crate) channels: Option<Arc<dyn crate::channel::Channels>>,
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, NodeError> {
    serde_json::from_slice(body)
        .map_err(|e| NodeError::InvalidArgument(format!("bad request: {e}")))
}

fn answer<T: Serialize>(r: Result<T, NodeError>) -> Response {
    match r {
        Ok(v) => Json(json!({ "ok": v })).into_response(),
        Err(e) => Json(json!({ "err": e })).into_response(),
    }
}

async fn call(
    State(s): State<Served>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&headers, &s.token) {
        return (StatusCode::UNAUTHORIZED, "node RPC needs its bearer token").into_response();
    }
    let n = &s.node;
    match name.as_str() {
        "build_template" => match parse::<TemplateSpec>(&body) {
            Ok(spec) => answer(n.build_template(spec).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "resolve_image" => match parse::<OciImage>(&body) {
            Ok(image) => answer(n.resolve_image(image).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "build_info" => match parse::<Build>(&body) {
            Ok(b) => answer(n.build_info(&b.build_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "delete_build" => match parse::<Build>(&body) {
            Ok(b) => answer(n.delete_build(&b.build_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "paused_state" => match parse::<Build>(&body) {
            Ok(b) => answer(n.paused_state(&b.build_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "start" => match parse::<StartSpec>(&body) {
            Ok(spec) => answer(n.start(spec).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "kill" => match parse::<Target>(&body) {
            Ok(t) => answer(n.kill(&t.sandbox_id, &t.execution_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "pause" => match parse::<Capture>(&body) {
            Ok(c) => answer(n.pause(&c.sandbox_id, &c.execution_id, c.memory).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "checkpoint" => match parse::<Capture>(&body) {
            Ok(c) => answer(n.checkpoint(&c.sandbox_id, &c.execution_id, c.memory).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "list_running" => answer::<Vec<Running>>(Ok(n.list_running().await)),
        "pause_builds" => answer(n.pause_builds().await),
        "builds" => answer(n.builds().await),
        "update_network" => match parse::<Network>(&body) {
            Ok(x) => answer(
                n.update_network(&x.sandbox_id, &x.execution_id, x.policy)
                    .await,
            ),
            Err(e) => answer::<()>(Err(e)),
        },
        "update_egress" => match parse::<Egress>(&body) {
            Ok(x) => answer(
                n.update_egress(&x.sandbox_id, &x.execution_id, x.egress)
                    .await,
            ),
            Err(e) => answer::<()>(Err(e)),
        },
        "metrics" => match parse::<Metrics>(&body) {
            Ok(m) => answer(n.metrics(&m.sandbox_id, m.start_unix, m.end_unix).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "latest_metrics" => match parse::<Latest>(&body) {
            Ok(l) => {
                answer::<Vec<(String, MetricSample)>>(Ok(n.latest_metrics(&l.sandbox_ids).await))
            }
            Err(e) => answer::<()>(Err(e)),
        },
        "logs" => match parse::<Logs>(&body) {
            Ok(l) => answer(n.logs(&l.sandbox_id, l.query).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "pool_depths" => answer::<Vec<(String, usize)>>(Ok(n.pool_depths().await)),
        "exec" => match parse::<Exec>(&body) {
            Ok(x) => answer(n.exec(&x.sandbox_id, &x.execution_id, x.spec).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "put_file" => match parse::<PutFile>(&body) {
            Ok(x) => answer(
                n.put_file(&x.sandbox_id, &x.execution_id, &x.host_path, &x.guest_path)
                    .await,
            ),
            Err(e) => answer::<()>(Err(e)),
        },
        "migrate_describe" => match parse::<Target>(&body) {
            Ok(t) => answer(n.migrate_describe(&t.sandbox_id, &t.execution_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "migrate_in" => match parse::<MigrateIn>(&body) {
            Ok(spec) => answer(n.migrate_in(spec).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "migrate_out" => match parse::<MigrateOut>(&body) {
            Ok(spec) => answer(n.migrate_out(spec).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "migrate_commit" => match parse::<Migration>(&body) {
            Ok(m) => answer(n.migrate_commit(&m.migration_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "migrate_cancel" => match parse::<Migration>(&body) {
            Ok(m) => answer(n.migrate_cancel(&m.migration_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "migrate_finish" => match parse::<Target>(&body) {
            Ok(t) => answer(n.migrate_finish(&t.sandbox_id, &t.execution_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        "migrate_abort" => match parse::<Target>(&body) {
            Ok(t) => answer(n.migrate_abort(&t.sandbox_id, &t.execution_id).await),
            Err(e) => answer::<()>(Err(e)),
        },
        other => (StatusCode::NOT_FOUND, format!("no node call {other:?}")).into_response(),
    }
}

/// Whether `headers` carry the node's bearer token.
pub(crate) fn authorized(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves `node` on `listener` until `cancel` fires, over plain HTTP.
pub async fn serve(
    listener: tokio::net::TcpListener,
    node: Arc<dyn NodeControl>,
    token: String,
    cancel: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    serve_with(listener, node, token, None, cancel).await
}

/// [`serve`], over TLS only when `tls` is given (a client speaking plain HTTP fails the
/// handshake; see [`crate::tls::server_config`]). Calls in flight finish after `cancel`.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    node: Arc<dyn NodeControl>,
    token: String,
    tls: Option<Arc<rustls::ServerConfig>>,
    cancel: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    serve_node(listener, node, None, token, tls, cancel).await
}

/// [`serve_with`], also taking live-migration channels (`POST /v1/migration/<id>/<channel>`
/// upgraded to a raw byte stream) for `channels`.
pub async fn serve_node(
    listener: tokio::net::TcpListener,
    node: Arc<dyn NodeControl>,
    channels: Option<Arc<dyn crate::channel::Channels>>,
    token: String,
    tls: Option<Arc<rustls::ServerConfig>>,
    cancel: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let app = axum::Router::new()
        .route(
            "/v1/migration/{id}/{channel}",
            axum::routing::post(crate::channel::accept),
        )
        .route("/v1/{call}", axum::routing::post(call))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(Served {
            node,
            token: Arc::new(token),
            channels,
        });
    match tls {
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move { cancel.cancelled().await })
                .await?
        }
        Some(config) => serve_tls(listener, app, config, cancel).await,
    }
    Ok(())
}

/// A TLS handshake, and then each request's headers, must arrive within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

async fn serve_tls(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    config: Arc<rustls::ServerConfig>,
    cancel: tokio_util::sync::CancellationToken,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    // Connections in flight when `cancel` fires finish their calls (migration channels, which
    // are upgraded, run to their end).
    let tracker = tokio_util::task::TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "node RPC: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let cancel = cancel.clone();
        tracker.spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "node RPC: TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HANDSHAKE_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                .with_upgrades();
            let mut conn = std::pin::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = cancel.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(%peer, error = %e, "node RPC connection ended");
            }
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

/// A node reached over RPC.
pub struct RemoteNode {
    pub(crate) addr: String,
    pub(crate) token: String,
    /// Set for `https://` URLs: the client configuration and the name the node's
    /// certificate must carry.
    pub(crate) tls: Option<(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
}

impl RemoteNode {
    /// `url` is `http://host:port` (as printed by `vmon node`), or `https://host:port`,
    /// verified against the system's CAs.
    pub fn new(url: &str, token: String) -> anyhow::Result<RemoteNode> {
        RemoteNode::with_tls(url, token, None)
    }

    /// [`RemoteNode::new`] verifying `https://` nodes with `tls`. With a configured CA
    /// ([`ClientTls::pinned`]) the node RPC is TLS-only: a plain `http://` URL is refused,
    /// so that neither the bearer token nor the calls ever travel in the clear (and a
    /// registry entry cannot downgrade the link).
    pub fn with_tls(
        url: &str,
        token: String,
        tls: Option<&ClientTls>,
    ) -> anyhow::Result<RemoteNode> {
        let (https, rest) = match url.strip_prefix("https://") {
            Some(rest) => (true, rest),
            None => (false, url.strip_prefix("http://").unwrap_or(url)),
        };
        let addr = rest.trim_end_matches('/').to_string();
        if addr.is_empty() || addr.contains('/') {
            anyhow::bail!("node URL {url:?} must look like http://host:port or https://host:port");
        }
        if !https {
            if tls.is_some_and(ClientTls::pinned) {
                anyhow::bail!(
                    "node URL {url:?} is plain http, but node RPC is TLS-only once a CA is \
                     configured (VMON_NODE_CA_FILE): the node must serve TLS and advertise https://"
                );
            }
            return Ok(RemoteNode {
                addr,
                token,
                tls: None,
            });
        }
        let client = match tls {
            Some(t) => t.clone(),
            None => ClientTls::system()?,
        };
        let name = crate::tls::server_name(&addr)?;
        Ok(RemoteNode {
            addr,
            token,
            tls: Some((tokio_rustls::TlsConnector::from(client.config()), name)),
        })
    }

    /// A cluster's node `id` at `url`: TLS only, verified against the cluster's CA (`tls`
    /// must be pinned: no system CAs) and against the node's name
    /// ([`crate::tls::node_name`]), not the URL's host. A plain `http://` URL, a
    /// certificate of another CA or one naming another node gets no request and so never the
    /// token.
    pub fn cluster_node(
        url: &str,
        id: &str,
        token: String,
        tls: &ClientTls,
    ) -> anyhow::Result<RemoteNode> {
        if !tls.pinned() {
            anyhow::bail!("node RPC in a cluster verifies nodes against the cluster's CA only");
        }
        let Some(rest) = url.strip_prefix("https://") else {
            anyhow::bail!(
                "node {id}'s RPC URL {url:?} is not https://: a cluster's nodes are reached over \
                 TLS only"
            );
        };
        let addr = rest.trim_end_matches('/').to_string();
        if addr.is_empty() || addr.contains('/') {
            anyhow::bail!("node URL {url:?} must look like https://host:port");
        }
        Ok(RemoteNode {
            addr,
            token,
            tls: Some((
                tokio_rustls::TlsConnector::from(tls.config()),
                crate::tls::node_name(id)?,
            )),
        })
    }

    /// A TLS handshake with the node and nothing more (no request, no token): `Ok(true)` when
    /// its certificate verifies, `Ok(false)` when it is refused (another CA, another name) or
    /// the node is not reached over TLS, `Err` when it could not be reached at all.
    pub async fn verify(&self) -> anyhow::Result<bool> {
        let Some((connector, name)) = &self.tls else {
            return Ok(false);
        };
        let stream = tokio::time::timeout(
            Duration::from_secs(3),
            tokio::net::TcpStream::connect(&self.addr),
        )
        .await
        .map_err(|_| anyhow::anyhow!("connecting to {} timed out", self.addr))??;
        match tokio::time::timeout(
            Duration::from_secs(3),
            connector.connect(name.clone(), stream),
        )
        .await
        {
            Ok(Ok(_)) => Ok(true),
            Ok(Err(e)) if crate::tls::certificate_refused(&e) => Ok(false),
            Ok(Err(e)) => Err(anyhow::anyhow!("TLS with {}: {e}", self.addr)),
            Err(_) => Err(anyhow::anyhow!("TLS with {} timed out", self.addr)),
        }
    }

    /// [`NodeControl::list_running`] that says when the node did not answer (an empty list
    /// would read as "runs nothing").
    pub async fn list_running_checked(&self) -> Result<Vec<Running>, NodeError> {
        self.call("list_running", &json!({})).await
    }

    async fn call<A: Serialize, R: DeserializeOwned>(
        &self,
        name: &str,
        arg: &A,
    ) -> Result<R, NodeError> {
        let body = serde_json::to_vec(arg).map_err(|e| NodeError::Failed(e.to_string()))?;
        // Template builds boot a VM under TCG: allow them time.
        let timeout = if name == "build_template" || name == "exec" {
            Duration::from_secs(1800)
        } else {
            Duration::from_secs(600)
        };
        let fut = async {
            let stream = tokio::net::TcpStream::connect(&self.addr).await?;
            stream.set_nodelay(true)?;
            let req = hyper::Request::builder()
                .method("POST")
                .uri(format!("/v1/{name}"))
                .header("host", &self.addr)
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {}", self.token))
                .body(Full::new(Bytes::from(body)))?;
            match &self.tls {
                None => exchange(stream, req).await,
                Some((connector, server_name)) => {
                    let tls = connector
                        .connect(server_name.clone(), stream)
                        .await
                        .map_err(|e| anyhow::anyhow!("TLS with the node: {e}"))?;
                    exchange(tls, req).await
                }
            }
        };
        let (status, bytes) = tokio::time::timeout(timeout, fut)
            .await
            .map_err(|_| NodeError::Failed(format!("node call {name} timed out")))?
            .map_err(|e| NodeError::Failed(format!("node {} unreachable: {e:#}", self.addr)))?;
        if !status.is_success() {
            return Err(NodeError::Failed(format!(
                "node answered {status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
            )));
        }
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| NodeError::Failed(format!("node answer: {e}")))?;
        if let Some(err) = v.get("err") {
            let e: NodeError = serde_json::from_value(err.clone())
                .map_err(|e| NodeError::Failed(format!("node error: {e}")))?;
            return Err(e);
        }
        serde_json::from_value(v.get("ok").cloned().unwrap_or(Value::Null))
            .map_err(|e| NodeError::Failed(format!("node answer: {e}")))
    }
}

/// One request on a fresh connection `io`: the status and the body (bounded).
async fn exchange<S>(
    io: S,
    req: hyper::Request<Full<Bytes>>,
) -> anyhow::Result<(hyper::StatusCode, Bytes)>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let resp = send.send_request(req).await?;
    let status = resp.status();
    let bytes = Limited::new(resp.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the node's answer: {e}"))?
        .to_bytes();
    Ok((status, bytes))
}

#[async_trait::async_trait]
impl NodeControl for RemoteNode {
    async fn build_template(&self, spec: TemplateSpec) -> Result<BuildInfo, NodeError> {
        self.call("build_template", &spec).await
    }
    async fn resolve_image(&self, image: OciImage) -> Result<String, NodeError> {
        self.call("resolve_image", &image).await
    }
    async fn build_info(&self, build_id: &str) -> Result<BuildInfo, NodeError> {
        self.call(
            "build_info",
            &Build {
                build_id: build_id.into(),
            },
        )
        .await
    }
    async fn paused_state(&self, build_id: &str) -> Result<PausedState, NodeError> {
        self.call(
            "paused_state",
            &Build {
                build_id: build_id.into(),
            },
        )
        .await
    }
    async fn pause_builds(&self) -> Result<Vec<PauseBuild>, NodeError> {
        self.call("pause_builds", &json!({})).await
    }
    async fn builds(&self) -> Result<Vec<KeptBuild>, NodeError> {
        self.call("builds", &json!({})).await
    }
    async fn delete_build(&self, build_id: &str) -> Result<(), NodeError> {
        self.call(
            "delete_build",
            &Build {
                build_id: build_id.into(),
            },
        )
        .await
    }
    async fn start(&self, spec: StartSpec) -> Result<Running, NodeError> {
        self.call("start", &spec).await
    }
    async fn kill(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
        self.call(
            "kill",
            &Target {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
            },
        )
        .await
    }
    async fn pause(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        self.call(
            "pause",
            &Capture {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
                memory,
            },
        )
        .await
    }
    async fn checkpoint(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        self.call(
            "checkpoint",
            &Capture {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
                memory,
            },
        )
        .await
    }
    async fn list_running(&self) -> Vec<Running> {
        match self.call("list_running", &json!({})).await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!("list_running on the node failed: {e}");
                Vec::new()
            }
        }
    }
    async fn update_network(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        policy: NetworkPolicy,
    ) -> Result<(), NodeError> {
        self.call(
            "update_network",
            &Network {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
                policy,
            },
        )
        .await
    }
    async fn update_egress(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        egress: vmon_proto::egress::EgressSpec,
    ) -> Result<(), NodeError> {
        self.call(
            "update_egress",
            &Egress {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
                egress,
            },
        )
        .await
    }
    async fn metrics(
        &self,
        sandbox_id: &str,
        start_unix: i64,
        end_unix: i64,
    ) -> Result<Vec<MetricSample>, NodeError> {
        self.call(
            "metrics",
            &Metrics {
                sandbox_id: sandbox_id.into(),
                start_unix,
                end_unix,
            },
        )
        .await
    }
    async fn latest_metrics(&self, sandbox_ids: &[String]) -> Vec<(String, MetricSample)> {
        self.call(
            "latest_metrics",
            &Latest {
                sandbox_ids: sandbox_ids.to_vec(),
            },
        )
        .await
        .unwrap_or_default()
    }
    async fn logs(&self, sandbox_id: &str, query: LogQuery) -> Result<Vec<LogEntry>, NodeError> {
        self.call(
            "logs",
            &Logs {
                sandbox_id: sandbox_id.into(),
                query,
            },
        )
        .await
    }
    async fn pool_depths(&self) -> Vec<(String, usize)> {
        self.call("pool_depths", &json!({}))
            .await
            .unwrap_or_default()
    }

    async fn exec(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        spec: ExecSpec,
    ) -> Result<ExecOutput, NodeError> {
        self.call(
            "exec",
            &Exec {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
                spec,
            },
        )
        .await
    }
    async fn put_file(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        host_path: &str,
        guest_path: &str,
    ) -> Result<(), NodeError> {
        self.call(
            "put_file",
            &PutFile {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
                host_path: host_path.into(),
                guest_path: guest_path.into(),
            },
        )
        .await
    }

    async fn migrate_describe(
        &self,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<MigrateIn, NodeError> {
        self.call(
            "migrate_describe",
            &Target {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
            },
        )
        .await
    }
    async fn migrate_in(&self, spec: MigrateIn) -> Result<String, NodeError> {
        self.call("migrate_in", &spec).await
    }
    async fn migrate_out(&self, spec: MigrateOut) -> Result<MigrateStats, NodeError> {
        self.call("migrate_out", &spec).await
    }
    async fn migrate_commit(&self, migration_id: &str) -> Result<Running, NodeError> {
        self.call(
            "migrate_commit",
            &Migration {
                migration_id: migration_id.into(),
            },
        )
        .await
    }
    async fn migrate_cancel(&self, migration_id: &str) -> Result<(), NodeError> {
        self.call(
            "migrate_cancel",
            &Migration {
                migration_id: migration_id.into(),
            },
        )
        .await
    }
    async fn migrate_finish(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
        self.call(
            "migrate_finish",
            &Target {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
            },
        )
        .await
    }
    async fn migrate_abort(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
        self.call(
            "migrate_abort",
            &Target {
                sandbox_id: sandbox_id.into(),
                execution_id: execution_id.into(),
            },
        )
        .await
    }
}
