//! The accept loop the proxy and the api share: HTTP/1.1 and HTTP/2 on one port, with a cap on
//! open connections and a bound on how long a client may take to send a request's headers, so
//! that slow or idle clients (slowloris) cannot starve new ones.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Open connections at once; past it new connections are closed at once.
    pub max_connections: usize,
    /// A request's headers must arrive within this time (HTTP/1.1), and a keep-alive
    /// connection waiting for its next request is closed after it.
    pub header_read_timeout: Duration,
    /// HTTP/2: ping an idle connection this often and close it when the ping goes unanswered
    /// for as long.
    pub keep_alive: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 10_000,
            header_read_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(60),
        }
    }
}

/// Serves `service` on every connection `listener` accepts until `cancel` fires. Upgrades
/// (WebSocket, CONNECT) pass through.
pub async fn serve<S, B>(
    listener: TcpListener,
    limits: Limits,
    cancel: CancellationToken,
    what: &'static str,
    service: S,
) where
    S: hyper::service::Service<http::Request<hyper::body::Incoming>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let (stream, peer) = tokio::select! {
            _ = cancel.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "{what}: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Full: closing at once costs less than holding a connection nobody serves.
            tracing::warn!(%peer, "{what}: {} connections open; refusing one", limits.max_connections);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = service.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout);
            builder
                .http2()
                .timer(TokioTimer::new())
                .keep_alive_interval(Some(limits.keep_alive))
                .keep_alive_timeout(limits.keep_alive);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "{what} connection ended");
                },
                _ = cancel.cancelled() => {}
            }
            drop(permit);
        });
    }
}
