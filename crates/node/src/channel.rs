//! Live-migration channels between nodes: `POST /v1/migration/<id>/<channel>` on the target's
//! node RPC port, upgraded (HTTP/1.1 `101 Switching Protocols`) to a raw byte stream. The
//! channel rides the node RPC's own listener, so it has its TLS and its bearer token; QEMU on
//! either side sees only a local socket the node relays.
//!
//! Channels: `ram` (QEMU's migration stream), `nbd` (the disk mirror's NBD connection) and
//! `check` (the memory check after the last round, `crate::node::migrate_check`). The client
//! end ([`vmon_nodeclient::RemoteNode::open_channel`]) is in `vmon-nodeclient`.

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;

pub use vmon_nodeclient::channel::{ChannelIo, PROTOCOL};

use crate::rpc::Served;

/// What the target does with an accepted channel.
#[async_trait::async_trait]
pub trait Channels: Send + Sync + 'static {
    /// Whether `migration_id` is a migration this node waits for (checked before the upgrade).
    fn expects(&self, migration_id: &str) -> bool;
    /// Serves one channel of a migration until either end closes it.
    async fn serve(&self, migration_id: String, channel: String, io: ChannelIo);
}

/// Whether `s` can be a migration id or channel name.
fn plain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

pub(crate) async fn accept(
    State(s): State<Served>,
    Path((id, channel)): Path<(String, String)>,
    headers: HeaderMap,
    mut req: Request,
) -> Response {
    if !crate::rpc::authorized(&headers, &s.token) {
        return (StatusCode::UNAUTHORIZED, "node RPC needs its bearer token").into_response();
    }
    let Some(sink) = s.channels.clone() else {
        return (StatusCode::NOT_FOUND, "this node takes no migrations").into_response();
    };
    if !plain(&id) || !matches!(channel.as_str(), "ram" | "nbd" | "check") {
        return (StatusCode::BAD_REQUEST, "bad migration channel").into_response();
    }
    if !sink.expects(&id) {
        return (StatusCode::NOT_FOUND, format!("no migration {id} here")).into_response();
    }
    let upgrade = headers
        .get("upgrade")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL));
    if !upgrade {
        return (StatusCode::BAD_REQUEST, "a migration channel is an upgrade").into_response();
    }
    let on = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        match on.await {
            Ok(up) => sink.serve(id, channel, TokioIo::new(up)).await,
            Err(e) => {
                tracing::warn!(migration = %id, error = %e, "migration channel upgrade failed")
            }
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header("connection", "upgrade")
        .header("upgrade", PROTOCOL)
        .body(axum::body::Body::empty())
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Relays bytes both ways between a channel and a local socket until both ends are done.
pub async fn relay<L>(mut channel: ChannelIo, mut local: L) -> std::io::Result<(u64, u64)>
where
    L: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    tokio::io::copy_bidirectional(&mut channel, &mut local).await
}
