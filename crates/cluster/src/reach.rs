//! Whether a node is reached at all: the failures of a call that prove the call never reached
//! the node, so that another node may take the work at once instead of the caller waiting for
//! the node's lease to end. A node that refuses connections (its process is gone: killed,
//! crashed, restarting), and one whose kernel accepts the connection but whose process never
//! finishes a TLS handshake (stalled: SIGSTOP, a frozen host) are not reached. A node that
//! completes the handshake and then answers nothing is reached: its calls end on their own
//! deadlines (`vmon_nodeclient`).

use std::time::Duration;

/// How long the probe waits for the connection.
const PROBE: Duration = Duration::from_secs(2);

/// `host:port` of a node RPC URL (`http://host:port`, `https://host:port/`).
fn authority(rpc_url: &str) -> Option<&str> {
    let rest = rpc_url
        .strip_prefix("https://")
        .or_else(|| rpc_url.strip_prefix("http://"))
        .unwrap_or(rpc_url);
    let a = rest.split('/').next()?;
    (!a.is_empty()).then_some(a)
}

/// Whether a connection to the node at `rpc_url` is refused (or its host or network is
/// unreachable) right now.
pub(crate) async fn refuses(rpc_url: &str) -> bool {
    use std::io::ErrorKind;
    let Some(a) = authority(rpc_url) else {
        return false;
    };
    match tokio::time::timeout(PROBE, tokio::net::TcpStream::connect(a)).await {
        Ok(Err(e)) => matches!(
            e.kind(),
            ErrorKind::ConnectionRefused
                | ErrorKind::HostUnreachable
                | ErrorKind::NetworkUnreachable
        ),
        _ => false,
    }
}

/// Whether a call to the node at `rpc_url` (reached by `client`) that failed with `failed`
/// did not reach it: the call was never sent (no connection, no TLS handshake in time:
/// [`vmon_nodeclient::never_sent`]), or the node refuses connections now, or accepts them and
/// does not finish a TLS handshake now.
pub(crate) async fn unreached(
    rpc_url: &str,
    client: &vmon_nodeclient::RemoteNode,
    failed: &vmon_proto::node::NodeError,
) -> bool {
    vmon_nodeclient::never_sent(failed) || refuses(rpc_url).await || client.verify().await.is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities_of_node_urls() {
        assert_eq!(authority("https://10.0.0.1:3321"), Some("10.0.0.1:3321"));
        assert_eq!(authority("http://node-a:80/"), Some("node-a:80"));
        assert_eq!(authority("https://"), None);
    }

    #[tokio::test]
    async fn a_closed_port_refuses_and_a_listening_one_does_not() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let open = l.local_addr().expect("addr");
        assert!(!refuses(&format!("https://{open}")).await);
        drop(l);
        assert!(refuses(&format!("https://{open}")).await);
    }
}
