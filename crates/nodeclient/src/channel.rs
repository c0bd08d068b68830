//! The client end of live-migration channels: `POST /v1/migration/<id>/<channel>` on the
//! target's node RPC port, upgraded (HTTP/1.1 `101 Switching Protocols`) to a raw byte stream
//! (the node's `channel` module serves them).

use bytes::Bytes;
use http_body_util::Empty;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;

use crate::RemoteNode;

/// The byte stream of one channel.
pub type ChannelIo = TokioIo<hyper::upgrade::Upgraded>;

/// The protocol name in `Upgrade:`.
pub const PROTOCOL: &str = "vmon-migration";

impl RemoteNode {
    /// Opens channel `channel` of migration `migration_id` on this (target) node.
    pub async fn open_channel(
        &self,
        migration_id: &str,
        channel: &str,
    ) -> anyhow::Result<ChannelIo> {
        let stream = tokio::net::TcpStream::connect(&self.addr).await?;
        stream.set_nodelay(true)?;
        let req = hyper::Request::builder()
            .method("POST")
            .uri(format!("/v1/migration/{migration_id}/{channel}"))
            .header("host", &self.addr)
            .header("authorization", format!("Bearer {}", self.token))
            .header("connection", "upgrade")
            .header("upgrade", PROTOCOL)
            .body(Empty::<Bytes>::new())?;
        match &self.tls {
            None => upgrade(stream, req).await,
            Some((connector, name)) => {
                let tls = connector
                    .connect(name.clone(), stream)
                    .await
                    .map_err(|e| anyhow::anyhow!("TLS with the target node: {e}"))?;
                upgrade(tls, req).await
            }
        }
    }
}

async fn upgrade<S>(io: S, req: hyper::Request<Empty<Bytes>>) -> anyhow::Result<ChannelIo>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let resp = send.send_request(req).await?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        use http_body_util::BodyExt;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), 4096)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        anyhow::bail!(
            "the target node answered {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    Ok(TokioIo::new(hyper::upgrade::on(resp).await?))
}
