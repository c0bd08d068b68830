//! The accept loop the proxy and the api share: HTTP/1.1 and HTTP/2 on one port, with a cap on
//! open connections and a bound on how long a client may take to send a request's headers, so
//! that slow or idle clients (slowloris) cannot starve new ones.
//!
//! With a TLS configuration ([`serve_tls`], the proxy's), TLS and plain HTTP share the port:
//! a connection whose first byte is a TLS handshake record (0x16) is served over TLS, any
//! other in the clear (no plain HTTP request starts with that byte). [`serve_tls_only`] (the
//! api's, when it has a certificate) serves TLS alone: a plain request fails the handshake.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
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

/// The address of the client a request came from, in every request's extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub std::net::SocketAddr);

/// A connection's service that marks each request with the connection's [`ClientAddr`].
struct WithClient<S> {
    inner: S,
    peer: std::net::SocketAddr,
}

impl<S> hyper::service::Service<http::Request<hyper::body::Incoming>> for WithClient<S>
where
    S: hyper::service::Service<http::Request<hyper::body::Incoming>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn call(&self, mut req: http::Request<hyper::body::Incoming>) -> Self::Future {
        req.extensions_mut().insert(ClientAddr(self.peer));
        self.inner.call(req)
    }
}

/// The first byte of a TLS connection: a handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

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
    serve_tls(listener, limits, None, cancel, what, service).await
}

/// [`serve`], and with `tls` also TLS on the same port (sniffed from each connection's first
/// byte). The TLS handshake must finish within `limits.header_read_timeout`.
pub async fn serve_tls<S, B>(
    listener: TcpListener,
    limits: Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
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
    let tls = tls.map(|c| (c, false));
    accept_loop(listener, limits, tls, cancel, what, service).await
}

/// [`serve`] over TLS only: every connection must start with a TLS handshake.
pub async fn serve_tls_only<S, B>(
    listener: TcpListener,
    limits: Limits,
    tls: Arc<rustls::ServerConfig>,
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
    accept_loop(listener, limits, Some((tls, true)), cancel, what, service).await
}

/// `tls`: the configuration, and whether it is the only protocol (else sniffed).
async fn accept_loop<S, B>(
    listener: TcpListener,
    limits: Limits,
    tls: Option<(Arc<rustls::ServerConfig>, bool)>,
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
    let acceptor = tls.map(|(c, only)| (tokio_rustls::TlsAcceptor::from(c), only));
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
        let service = WithClient {
            inner: service.clone(),
            peer,
        };
        let cancel = cancel.clone();
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let conn = async {
                match acceptor {
                    None => serve_io(stream, limits, service).await,
                    Some((acceptor, only)) => {
                        let tls_first = if only {
                            Some(true)
                        } else {
                            sniff_tls(&stream, limits.header_read_timeout).await
                        };
                        match tls_first {
                            Some(false) => serve_io(stream, limits, service).await,
                            Some(true) => {
                                let accept = acceptor.accept(stream);
                                match tokio::time::timeout(limits.header_read_timeout, accept).await
                                {
                                    Ok(Ok(tls)) => serve_io(tls, limits, service).await,
                                    Ok(Err(e)) => Err(format!("TLS handshake failed: {e}").into()),
                                    Err(_) => Err("TLS handshake timed out".into()),
                                }
                            }
                            // Closed, or silent for too long, before its first byte.
                            None => Ok(()),
                        }
                    }
                }
            };
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

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whether the connection starts with a TLS handshake; `None` when it closes, fails or sends
/// nothing within `wait`. Peeks: the byte stays for whoever reads next.
async fn sniff_tls(stream: &TcpStream, wait: Duration) -> Option<bool> {
    let mut first = [0u8; 1];
    match tokio::time::timeout(wait, stream.peek(&mut first)).await {
        Ok(Ok(1..)) => Some(first[0] == TLS_HANDSHAKE),
        _ => None,
    }
}

/// HTTP/1.1 or HTTP/2 (by the client's preface) on one connection, upgrades included.
async fn serve_io<I, S, B>(io: I, limits: Limits, service: S) -> Result<(), BoxError>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<http::Request<hyper::body::Incoming>, Response = http::Response<B>>
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
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
    builder
        .serve_connection_with_upgrades(TokioIo::new(io), service)
        .await
}
