//! vmon-nodeclient: the client of node RPC, the one way the control plane (the api, the
//! cluster) and the other nodes reach a node that is not in their process.
//!
//! [`RemoteNode`] sends any call of the node contract ([`vmon_proto::node::Call`]) as
//! `POST /v1/<name>` with the call's JSON and reads `{"ok": reply}` or `{"err": NodeError}`;
//! it serves [`NodeControl`] by forwarding, so no call is written here. It also opens the
//! byte channels of a live migration ([`channel`]) and holds the TLS both ends use ([`tls`]).
//!
//! It must never link the node itself (QEMU, images, the object store): `vmon-cluster`
//! depends on it to reach nodes, and the node's server depends on it, not the other way.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::Value;
use vmon_proto::node::{Call, NodeCall, NodeControl, NodeError, NodeReply, Transport};

use crate::tls::ClientTls;

pub mod channel;
pub mod tls;

/// Largest RPC body either side reads (log pages are the big ones).
pub const MAX_BODY: usize = 64 << 20;

/// A node reached over RPC.
pub struct RemoteNode {
    addr: String,
    token: String,
    /// Set for `https://` URLs: the client configuration and the name the node's
    /// certificate must carry.
    tls: Option<(
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

    /// One request on a fresh connection: `path` with `body`, the answer's status and body.
    /// The connection (and its TLS handshake) must be made within [`HANDSHAKE`]: a node that
    /// does not finish it (stalled, its host frozen) has not seen the call, which fails at
    /// once instead of after `timeout` (the whole call's deadline).
    async fn post(
        &self,
        path: &str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<(hyper::StatusCode, Bytes), NodeError> {
        let unreached =
            |e: anyhow::Error| NodeError::Failed(format!("node {} unreachable: {e:#}", self.addr));
        let not_sent = |e: anyhow::Error| {
            NodeError::Failed(format!(
                "node {} unreachable ({NOT_SENT}): {e:#}",
                self.addr
            ))
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let handshake = tokio::time::Instant::now() + HANDSHAKE.min(timeout);
        let stream = tokio::time::timeout_at(handshake, tokio::net::TcpStream::connect(&self.addr))
            .await
            .map_err(|_| not_sent(anyhow::anyhow!("no connection within {HANDSHAKE:?}")))?
            .map_err(|e| not_sent(e.into()))?;
        stream.set_nodelay(true).map_err(|e| not_sent(e.into()))?;
        let req = hyper::Request::builder()
            .method("POST")
            .uri(path)
            .header("host", &self.addr)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", self.token))
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| NodeError::Failed(format!("node call {path}: {e}")))?;
        let answer = match &self.tls {
            None => tokio::time::timeout_at(deadline, exchange(stream, req)).await,
            Some((connector, server_name)) => {
                let tls = tokio::time::timeout_at(
                    handshake,
                    connector.connect(server_name.clone(), stream),
                )
                .await
                .map_err(|_| {
                    not_sent(anyhow::anyhow!(
                        "no TLS handshake within {HANDSHAKE:?} (the node is stalled?)"
                    ))
                })?
                .map_err(|e| not_sent(anyhow::anyhow!("TLS with the node: {e}")))?;
                tokio::time::timeout_at(deadline, exchange(tls, req)).await
            }
        };
        answer
            .map_err(|_| {
                NodeError::Failed(format!(
                    "node call {path} timed out after {} s",
                    timeout.as_secs()
                ))
            })?
            .map_err(unreached)
    }
}

/// Said by a call that failed before its request was sent (no connection, no TLS handshake).
const NOT_SENT: &str = "the call was not sent";

/// Whether `e` is a call that failed before its request was sent: no connection (refused,
/// or none within [`HANDSHAKE`]) or no TLS handshake within it. The node never saw such a
/// call, so another node may take its work.
pub fn never_sent(e: &NodeError) -> bool {
    matches!(e, NodeError::Failed(m) if m.contains(NOT_SENT))
}

/// How long a call waits for its connection and TLS handshake with the node. A node serving
/// calls finishes a handshake in milliseconds even when busy (the handshake is the accept
/// loop's, not a call's).
pub const HANDSHAKE: Duration = Duration::from_secs(5);

/// How long a call may take. Template builds and their steps boot and run a VM under TCG;
/// starts, pauses and captures restore or write guest memory (and may fetch a build from the
/// object store first); the calls that only read the node's tables answer at once.
pub fn timeout_of(name: &str) -> Duration {
    match name {
        "build_template" | "exec" => Duration::from_secs(1800),
        "list_running" | "latest_metrics" | "pool_depths" | "paused_state" | "metrics" | "logs"
        | "update_network" | "update_egress" => Duration::from_secs(30),
        "kill" => Duration::from_secs(120),
        _ => Duration::from_secs(600),
    }
}

impl Transport for RemoteNode {
    async fn send<C: Call>(&self, call: C) -> Result<C::Reply, NodeError> {
        let body = serde_json::to_vec(&call).map_err(|e| NodeError::Failed(e.to_string()))?;
        let (status, bytes) = self
            .post(&format!("/v1/{}", C::NAME), body, timeout_of(C::NAME))
            .await?;
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

#[async_trait::async_trait]
impl NodeControl for RemoteNode {
    async fn handle(&self, call: NodeCall) -> Result<NodeReply, NodeError> {
        call.forward(self).await
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

#[cfg(test)]
mod tests {
    use super::*;
    use vmon_proto::node::NodeCalls;

    #[tokio::test]
    async fn a_node_that_accepts_and_never_handshakes_fails_the_call_at_the_handshake_deadline() {
        // A stalled node: its kernel accepts the connection, nobody answers.
        let stalled = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = stalled.local_addr().expect("addr");
        let held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((c, _)) = stalled.accept().await {
                conns.push(c);
            }
        });
        let node = RemoteNode::new(&format!("https://{addr}"), "t".into()).expect("client");
        let e = node.list_running().await.expect_err("no answer");
        // Ended by the handshake's deadline, not the call's: the request was never sent.
        assert!(
            never_sent(&e) && e.to_string().contains("no TLS handshake"),
            "{e}"
        );
        held.abort();
        // Refused: never sent either.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = closed.local_addr().expect("addr");
        drop(closed);
        let node = RemoteNode::new(&format!("http://{addr}"), "t".into()).expect("client");
        let e = node.kill("i1", "e1").await.expect_err("refused");
        assert!(never_sent(&e), "{e}");
        // A call that reached a node and failed there is not "never sent".
        assert!(!never_sent(&NodeError::Failed("node answered 500".into())));
    }
}
