//! One intercepted connection: ClientHello, TLS with a minted certificate, HTTP/1.1 requests
//! forwarded with the rule's headers set.

use std::convert::Infallible;
use std::net::Ipv4Addr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, HOST};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::LazyConfigAcceptor;

use crate::SlotRules;

/// Connections one sandbox may hold open through its listener at once; past it new ones are
/// closed.
pub const MAX_CONNECTIONS: usize = 64;
/// A request's header block (request line included) and its header count.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
pub const MAX_HEADERS: usize = 100;
/// The ClientHello and the handshake, each; a request's headers; connecting to the host.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct Shared {
    pub state: Arc<RwLock<Arc<SlotRules>>>,
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
    pub slots: tokio::sync::Semaphore,
}

impl Shared {
    fn rules(&self) -> Arc<SlotRules> {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

type Body = BoxBody<Bytes, hyper::Error>;

pub(crate) async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    // Connections live in the set: aborting this task (the listener dropped) ends them too.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let shared = shared.clone();
                conns.spawn(async move {
                    let Ok(_permit) = shared.slots.try_acquire() else {
                        tracing::debug!("egress: too many connections, one closed");
                        return;
                    };
                    if let Err(e) = serve(stream, &shared).await {
                        tracing::debug!(error = %e, "egress connection ended");
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

async fn serve(stream: TcpStream, shared: &Arc<Shared>) -> anyhow::Result<()> {
    let _ = stream.set_nodelay(true);
    let acceptor = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream);
    let start = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor).await??;
    let name = start
        .client_hello()
        .server_name()
        .map(str::to_ascii_lowercase);
    let rules = shared.rules();
    let Some(host) = name.filter(|n| rules.spec.rule(n).is_some()) else {
        // Not a name the rules cover: nothing is intercepted for it, and nothing is forwarded.
        anyhow::bail!("a ClientHello for a name without rules");
    };
    let tls =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, start.into_stream(shared.server.clone())).await??;
    let upstream: Arc<tokio::sync::Mutex<Option<SendRequest<Incoming>>>> = Default::default();
    let shared2 = shared.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let shared = shared2.clone();
        let host = host.clone();
        let upstream = upstream.clone();
        async move { Ok::<_, Infallible>(forward(req, &host, &shared, &upstream).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_header_size(MAX_HEADER_BYTES)
        .max_headers(MAX_HEADERS)
        .serve_connection(TokioIo::new(tls), service)
        .await?;
    Ok(())
}

fn answer(status: StatusCode, msg: &str) -> Response<Body> {
    let body = Full::new(Bytes::from(format!("vmon egress: {msg}\n")))
        .map_err(|never| match never {})
        .boxed();
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// `Host` without a `:443`, lower-cased.
fn host_of(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?.to_ascii_lowercase();
    Some(s.strip_suffix(":443").map(str::to_string).unwrap_or(s))
}

/// Sets the rule's headers on `req` (replacing the guest's), or says why it cannot.
pub(crate) fn inject(
    req: &mut http::HeaderMap,
    host: &str,
    rules: &SlotRules,
) -> Result<(), String> {
    let Some(rule) = rules.spec.rule(host) else {
        return Err(format!("no rules for {host}"));
    };
    let filled = vmon_proto::egress::fill(rule, &rules.spec.secrets)?;
    for (name, value) in filled {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("{name:?} is not a header name"))?;
        let value = HeaderValue::from_str(&value)
            .map_err(|_| format!("the value for {name} is not a header value"))?;
        req.remove(&name);
        req.insert(name, value);
    }
    Ok(())
}

async fn forward(
    mut req: Request<Incoming>,
    host: &str,
    shared: &Shared,
    upstream: &tokio::sync::Mutex<Option<SendRequest<Incoming>>>,
) -> Response<Body> {
    let hosts = req.headers().get_all(HOST).iter().count();
    if hosts > 1 {
        return answer(StatusCode::BAD_REQUEST, "more than one Host header");
    }
    if let Some(h) = req.headers().get(HOST) {
        if host_of(h).as_deref() != Some(host) {
            return answer(
                StatusCode::MISDIRECTED_REQUEST,
                "the Host header names another host than the TLS server name",
            );
        }
    }
    let rules = shared.rules();
    if let Err(e) = inject(req.headers_mut(), host, &rules) {
        return answer(StatusCode::BAD_GATEWAY, &e);
    }
    // Origin form towards the host.
    if req.uri().authority().is_some() {
        let pq = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        match pq.parse() {
            Ok(u) => *req.uri_mut() = u,
            Err(_) => {
                return answer(
                    StatusCode::BAD_REQUEST,
                    "a request target it cannot forward",
                )
            }
        }
    }
    if !req.headers().contains_key(HOST) {
        if let Ok(v) = HeaderValue::from_str(host) {
            req.headers_mut().insert(HOST, v);
        }
    }
    let mut up = upstream.lock().await;
    if up.as_ref().is_none_or(|s| s.is_closed()) {
        let addrs = rules.upstream.get(host).cloned().unwrap_or_default();
        match connect(host, &addrs, rules.upstream_port, &shared.client).await {
            Ok(s) => *up = Some(s),
            Err(e) => {
                tracing::info!(host, error = %e, "egress: the host cannot be reached");
                return answer(
                    StatusCode::BAD_GATEWAY,
                    &format!("{host} cannot be reached: {e}"),
                );
            }
        }
    }
    let Some(sender) = up.as_mut() else {
        return answer(StatusCode::BAD_GATEWAY, "no connection");
    };
    if sender.ready().await.is_err() {
        *up = None;
        return answer(StatusCode::BAD_GATEWAY, "the connection to the host closed");
    }
    match sender.send_request(req).await {
        Ok(resp) => resp.map(|b| b.boxed()),
        Err(e) => {
            *up = None;
            answer(StatusCode::BAD_GATEWAY, &format!("forwarding failed: {e}"))
        }
    }
}

/// TLS to `host` at the first of `addrs` that answers on `port`, verified for `host`.
async fn connect(
    host: &str,
    addrs: &[Ipv4Addr],
    port: u16,
    client: &Arc<rustls::ClientConfig>,
) -> anyhow::Result<SendRequest<Incoming>> {
    let name = rustls::pki_types::ServerName::try_from(host.to_string())?;
    let mut last = anyhow::anyhow!("no address its policy reaches");
    for a in addrs {
        let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((*a, port))).await
        {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                last = e.into();
                continue;
            }
            Err(_) => {
                last = anyhow::anyhow!("connecting to {a} timed out");
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let tls = tokio_rustls::TlsConnector::from(client.clone());
        let stream =
            tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.connect(name.clone(), tcp)).await??;
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        return Ok(sender);
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmon_proto::egress::{EgressSpec, HeaderRule, HostRule, SecretValues};

    fn rules(value: &str) -> SlotRules {
        SlotRules {
            spec: EgressSpec {
                rules: vec![HostRule {
                    host: "api.example.com".into(),
                    headers: vec![HeaderRule {
                        name: "authorization".into(),
                        template: "Bearer ${e2b.secrets.k}".into(),
                    }],
                }],
                secrets: SecretValues([("k".to_string(), value.to_string())].into()),
            },
            upstream: Default::default(),
            upstream_port: 443,
        }
    }

    #[test]
    fn injection_replaces_what_the_guest_sent() {
        let mut h = http::HeaderMap::new();
        h.append("authorization", HeaderValue::from_static("Bearer guess"));
        h.append("authorization", HeaderValue::from_static("Bearer again"));
        inject(&mut h, "api.example.com", &rules("s3cret")).expect("inject");
        let all: Vec<_> = h.get_all("authorization").iter().collect();
        assert_eq!(all, [HeaderValue::from_static("Bearer s3cret")]);
        assert!(inject(&mut h, "other.example.com", &rules("x")).is_err());
        let e = inject(&mut h, "api.example.com", &rules("a\nb")).expect_err("newline");
        assert!(!e.contains("a\nb"));
    }

    #[test]
    fn host_headers_compare_without_port_and_case() {
        assert_eq!(
            host_of(&HeaderValue::from_static("API.example.com:443")).as_deref(),
            Some("api.example.com")
        );
        assert_eq!(
            host_of(&HeaderValue::from_static("api.example.com:8443")).as_deref(),
            Some("api.example.com:8443")
        );
    }
}
