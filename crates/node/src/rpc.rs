//! Node RPC, the server: [`NodeControl`] over HTTP, so `vmon api` and `vmon node` can run as
//! separate processes (or hosts). One route per call, `POST /v1/<call>` with a JSON body,
//! answered with `{"ok": value}` or `{"err": NodeError}`; the calls and their JSON are the
//! contract's ([`vmon_proto::node::NodeCall`]), the client is `vmon-nodeclient`'s
//! [`RemoteNode`]. Every request carries the node's bearer token; the node never accepts
//! calls without it.
//!
//! With a certificate (`vmon node --tls-cert/--tls-key`) the node serves TLS only
//! ([`serve_with`]); clients reach it at `https://host:port` and verify it against a CA file
//! ([`RemoteNode::with_tls`]).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::json;
use vmon_proto::node::{NodeCall, NodeControl, NodeError};

pub use vmon_nodeclient::{RemoteNode, MAX_BODY};

#[derive(Clone)]
pub(crate) struct Served {
    node: Arc<dyn NodeControl>,
    pub(crate) token: Arc<String>,
    pub(crate) channels: Option<Arc<dyn crate::channel::Channels>>,
}

/// Every call, dispatched in one place: the name in the path picks the call
/// ([`NodeCall::from_wire`]), its body is the call's JSON, and the node answers it.
async fn call(
    State(s): State<Served>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !authorized(&headers, &s.token) {
        return (StatusCode::UNAUTHORIZED, "node RPC needs its bearer token").into_response();
    }
    let answer = match NodeCall::from_wire(&name, &body) {
        None => return (StatusCode::NOT_FOUND, format!("no node call {name:?}")).into_response(),
        Some(Err(e)) => Err(NodeError::InvalidArgument(format!("bad request: {e}"))),
        Some(Ok(call)) => s.node.handle(call).await,
    };
    match answer {
        Ok(v) => Json(json!({ "ok": v })).into_response(),
        Err(e) => Json(json!({ "err": e })).into_response(),
    }
}

/// Whether `headers` carry the node's bearer token.
pub(crate) fn authorized(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| {
            bool::from(subtle::ConstantTimeEq::ct_eq(
                t.as_bytes(),
                token.as_bytes(),
            ))
        })
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
