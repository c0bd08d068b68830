//! vmon-proxy: the ingress for sandbox traffic.
//!
//! The SDKs send every envd request (and any request for a port a sandbox serves) here. A
//! request names its sandbox and port by the `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers or
//! by a `{port}-{sandboxID}.{domain}` Host ([`target`]); the proxy asks its [`Routes`] where that
//! sandbox's guest is, resumes a paused sandbox that allows it, and then streams both ways
//! without buffering (HTTP/1.1, HTTP/2, WebSocket and other upgrades).
//!
//! It must never answer for the guest (bodies are passed through untouched), never let a
//! request reach envd's `/init` (the node owns it), and never learn how sandboxes are stored:
//! it knows them only through [`Routes`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use vmon_faults::Faults;

pub mod activity;
mod forward;
mod headers;
pub mod limits;
pub mod listen;
mod pool;
pub mod signed;
pub mod target;
pub mod tls;
mod watched;

pub use activity::Activity;
use activity::{InFlight, Stamp, Stamped};
use forward::{Held, Upstream};
use headers::is_upgrade;
use limits::Beat;
pub use limits::GuestLimits;
pub use target::Target;

/// The port envd listens on inside every guest.
pub const ENVD_PORT: u16 = 49983;
/// Header carrying the traffic access token of a sandbox with public traffic disabled.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// What the proxy knows of a sandbox.
#[derive(Debug, Clone)]
pub struct SandboxRoute {
    /// Where the guest is reachable; `None` while the sandbox is paused.
    pub guest_ip: Option<IpAddr>,
    /// Whether traffic may resume the sandbox when it is paused.
    pub auto_resume: bool,
    /// Required in `e2b-traffic-access-token` on ports other than envd's when set.
    pub traffic_access_token: Option<String>,
    /// The ingress (a proxy on the node's host) to hand the request to when this proxy runs
    /// on another host and cannot reach the guest's address itself.
    pub via: Option<SocketAddr>,
    /// The sandbox's current run (its execution id, which a resume renews). With it, envd's
    /// connections are kept alive between requests, pooled per run and address ([`pool`]).
    pub execution_id: Option<String>,
}

/// Marks a request one proxy handed to another: the receiver routes it to its guest and
/// never hands it on again.
pub const FORWARDED_HEADER: &str = "x-vmon-forwarded";

#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error("sandbox {0} was not found")]
    NotFound(String),
    /// The sandbox cannot be resumed by traffic (no auto-resume, or a filesystem-only pause).
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Failed(String),
}

/// The proxy's view of the control plane.
#[async_trait::async_trait]
pub trait Routes: Send + Sync + 'static {
    /// The sandbox's route, `None` when no such sandbox exists (or it was killed).
    async fn lookup(&self, sandbox_id: &str) -> Option<SandboxRoute>;
    /// Resume a paused sandbox because traffic arrived for it; returns its guest address.
    async fn resume_for_traffic(&self, sandbox_id: &str) -> Result<IpAddr, ResumeError>;
    /// The id of the sandbox whose envd access token made `signed`
    /// ([`signed::SignedFiles::signed_with`]), if any: how a signed `/files` URL that names no
    /// sandbox finds its own. The default knows no tokens.
    async fn find_signer(&self, _signed: &signed::SignedFiles) -> Option<String> {
        None
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ProxyBody = BoxBody<Bytes, BoxError>;

/// How often a response in flight checks that its sandbox still runs where it did.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// The ingress. Cheap to clone.
#[derive(Clone)]
pub struct Proxy {
    routes: Arc<dyn Routes>,
    client: Client<HttpConnector, Stamped<Incoming>>,
    /// Keeps connections to one port (envd's) alive, pooled per sandbox run.
    pooled: Client<HttpConnector<pool::RunResolver>, Stamped<Incoming>>,
    pooled_port: u16,
    tls: Option<Arc<rustls::ServerConfig>>,
    activity: Arc<Activity>,
    limits: GuestLimits,
    slots: Arc<limits::Slots>,
    misses: Arc<limits::Misses>,
    faults: Faults,
}

/// A sandbox that does not allow public traffic takes requests to its own ports (not envd's)
/// only with its traffic access token: the refusal of one without it.
fn traffic_token_refusal(
    req: &Request<Incoming>,
    route: &SandboxRoute,
    target: &Target,
) -> Option<Response<ProxyBody>> {
    let token = route.traffic_access_token.as_ref()?;
    if target.port == ENVD_PORT {
        return None;
    }
    let sent = req
        .headers()
        .get(TRAFFIC_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok());
    if sent.is_some_and(|s| constant_time_eq(s.as_bytes(), token.as_bytes())) {
        return None;
    }
    Some(error(
        StatusCode::FORBIDDEN,
        "the sandbox does not allow public traffic: send its traffic access token in e2b-traffic-access-token",
        Some(target),
    ))
}

/// A request forwarded to the proxy of the sandbox's node: that host routes it by these
/// headers whatever the Host says, and forwards it no further.
fn mark_forwarded<B>(req: &mut Request<B>, target: &Target) {
    let h = req.headers_mut();
    h.insert(FORWARDED_HEADER, HeaderValue::from_static("1"));
    if let Ok(v) = HeaderValue::from_str(&target.sandbox_id) {
        h.insert(target::SANDBOX_ID_HEADER, v);
    }
    h.insert(target::SANDBOX_PORT_HEADER, HeaderValue::from(target.port));
}

impl Proxy {
    pub fn new(routes: Arc<dyn Routes>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(10)));
        connector.set_nodelay(true);
        // No idle pooling by address: guest addresses belong to slots, and a slot passes to
        // another sandbox after a kill or pause, so a connection pooled by address could reach
        // a dead guest (or a different one). Envd's connections are pooled per run instead.
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build(connector);
        let mut run_connector = HttpConnector::new_with_resolver(pool::RunResolver);
        run_connector.set_connect_timeout(Some(Duration::from_secs(10)));
        run_connector.set_nodelay(true);
        // Envd keeps an idle connection open; a guest of a run that ended (paused, killed)
        // is never asked again, and its connections close after the idle timeout.
        let pooled = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(8)
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(run_connector);
        Self {
            routes,
            client,
            pooled,
            // `VMON_PROXY_KEEP_ALIVE=0`: a connection per request to envd too (A/B benches).
            pooled_port: match std::env::var("VMON_PROXY_KEEP_ALIVE").as_deref() {
                Ok("0") => 0,
                _ => ENVD_PORT,
            },
            tls: None,
            activity: Activity::new(),
            limits: GuestLimits::default(),
            slots: Arc::default(),
            misses: Arc::default(),
            faults: Faults::off(),
        }
    }

    /// Fault points for tests ([`vmon_faults`]): `proxy:await-pause`, where a request that met a
    /// pause waits for it.
    pub fn with_faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// Caps and timeouts towards guests other than the defaults.
    pub fn with_limits(mut self, limits: GuestLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Keep connections alive to `port` instead of envd's (tests run their guest elsewhere).
    pub fn with_pooled_port(mut self, port: u16) -> Self {
        self.pooled_port = port;
        self
    }

    /// Stamp traffic into `activity` (shared with the control plane in one process).
    pub fn with_activity(mut self, activity: Arc<Activity>) -> Self {
        self.activity = activity;
        self
    }

    /// When each sandbox last had traffic through this proxy.
    pub fn activity(&self) -> &Arc<Activity> {
        &self.activity
    }

    /// Also accept TLS (on the same port as plain HTTP) with `config`, e.g. from
    /// [`tls::from_pem`] or a [`tls::LocalCa`].
    pub fn with_tls(mut self, config: Arc<rustls::ServerConfig>) -> Self {
        self.tls = Some(config);
        self
    }

    /// Accept connections until `cancel` fires.
    pub async fn serve(self, listener: TcpListener, cancel: CancellationToken) {
        self.serve_with(listener, listen::Limits::default(), cancel)
            .await
    }

    /// Accept connections until `cancel` fires, within `limits`.
    pub async fn serve_with(
        self,
        listener: TcpListener,
        limits: listen::Limits,
        cancel: CancellationToken,
    ) {
        let tls = self.tls.clone();
        let proxy = self;
        let service = hyper::service::service_fn(move |req| {
            let proxy = proxy.clone();
            async move { Ok::<_, std::convert::Infallible>(proxy.handle(req).await) }
        });
        listen::serve_tls(listener, limits, tls, cancel, "proxy", service).await;
    }

    /// Answer one request: route it, resume if needed, forward it.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let started = std::time::Instant::now();
        let client = req
            .extensions()
            .get::<listen::ClientAddr>()
            .map(|c| c.0.ip());
        let target = match self.target_of(&req, client).await {
            Ok(t) => t,
            Err(resp) => return resp,
        };
        let id = target.sandbox_id.as_str();
        // Read before the lookup: a pause that starts after it makes the route stale.
        let generation = self.activity.generation(id);
        let Some(route) = self.routes.lookup(id).await else {
            return not_found(&target);
        };
        if let Some(refused) = traffic_token_refusal(&req, &route, &target) {
            return refused;
        }
        // Counted from here until the response ends: resumes and waits for the guest included.
        let slot = match self.slots.take(&self.limits, id, client) {
            Ok(s) => s,
            Err(full) => return self.busy(full, &target),
        };
        let forwarded = req.headers().contains_key(FORWARDED_HEADER);
        let stamp = self.activity.stamp(id);
        stamp.touch();
        let seen = Seen { route, generation };
        let (guest_ip, route, in_flight) = match self.running(id, &target, seen, &stamp).await {
            Ok(r) => r,
            Err(resp) => return resp,
        };
        let mut req = req;
        let addr = match route.via {
            Some(_) if forwarded => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    &format!("The sandbox {id} is not on this proxy's host (a forwarding loop)"),
                    Some(&target),
                )
            }
            Some(ingress) => {
                mark_forwarded(&mut req, &target);
                ingress
            }
            None => SocketAddr::new(guest_ip, target.port),
        };
        let beat = Beat::new();
        let req = req.map(|b| Stamped::new(b, stamp.clone()).with_beat(beat.clone()));
        let held = Held {
            in_flight,
            stamp,
            slot,
            beat,
            started,
        };
        if is_upgrade(&req) {
            self.forward_upgrade(req, addr, &target, held).await
        } else {
            // Envd's requests of a known run go over kept-alive connections; other ports
            // (users' servers, whose idle timeouts are theirs) get a connection each.
            let upstream = match route.execution_id.as_deref() {
                Some(exec) if target.port == self.pooled_port => {
                    Upstream::Kept(pool::authority(id, exec, addr))
                }
                _ => Upstream::Fresh(addr),
            };
            self.forward(req, upstream, guest_ip, &target, held).await
        }
    }

    /// Where a request goes: its Host (or the sandbox headers), else a signed files URL's
    /// sandbox; never envd's `/init`.
    async fn target_of(
        &self,
        req: &Request<Incoming>,
        client: Option<std::net::IpAddr>,
    ) -> Result<Target, Response<ProxyBody>> {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_string)
            .or_else(|| req.uri().authority().map(|a| a.to_string()));
        let target = match target::resolve(host.as_deref(), req.headers()) {
            Ok(t) => t,
            Err(target::TargetError::Missing) => {
                match self.signed_files_target(req, client).await? {
                    Some(t) => t,
                    None => {
                        return Err(error(
                            StatusCode::BAD_REQUEST,
                            &target::TargetError::Missing.to_string(),
                            None,
                        ))
                    }
                }
            }
            Err(e) => return Err(error(StatusCode::BAD_REQUEST, &e.to_string(), None)),
        };
        if target.port == ENVD_PORT && is_init_path(req.uri().path()) {
            return Err(error(
                StatusCode::FORBIDDEN,
                "envd's /init is not reachable through the proxy",
                Some(&target),
            ));
        }
        Ok(target)
    }

    /// The guest's address and route once the sandbox runs (resumed for this request when it
    /// was paused, or being paused, and allows it), with the request counted in flight.
    async fn running(
        &self,
        id: &str,
        target: &Target,
        seen: Seen,
        stamp: &Arc<Stamp>,
    ) -> Result<(IpAddr, SandboxRoute, InFlight), Response<ProxyBody>> {
        let mut in_flight = stamp.enter();
        let mut route = seen.route;
        if stamp.pausing() || stamp.generation() != seen.generation {
            // A pause is deciding or under way (it holds the sandbox's lock), or began since
            // the lookup: the resume waits for it, then resumes the sandbox (or finds it still
            // running, or answers that it is paused and does not resume on traffic).
            drop(in_flight);
            self.faults.point("proxy:await-pause", id).await;
            self.resume(id, target).await?;
            route = match self.routes.lookup(id).await {
                Some(r) => r,
                None => return Err(not_found(target)),
            };
            in_flight = stamp.enter();
        }
        let guest_ip = match route.guest_ip {
            Some(ip) => ip,
            None if !route.auto_resume => {
                return Err(error(
                    StatusCode::BAD_GATEWAY,
                    &format!("The sandbox {id} is paused; connect to it to resume it"),
                    Some(target),
                ))
            }
            None => self.resume(id, target).await?,
        };
        if route.guest_ip.is_none() {
            // Just resumed: it may run on another host now.
            match self.routes.lookup(id).await {
                Some(r) => route = r,
                None => return Err(not_found(target)),
            }
        }
        Ok((guest_ip, route, in_flight))
    }

    /// Resumes a paused sandbox for this request; the answer to send when that fails.
    async fn resume(&self, id: &str, target: &Target) -> Result<IpAddr, Response<ProxyBody>> {
        match self.routes.resume_for_traffic(id).await {
            Ok(ip) => Ok(ip),
            Err(ResumeError::NotFound(_)) => Err(not_found(target)),
            Err(ResumeError::Refused(m)) => Err(error(StatusCode::BAD_GATEWAY, &m, Some(target))),
            Err(ResumeError::Failed(m)) => {
                tracing::warn!(sandbox_id = id, error = %m, "auto-resume failed");
                Err(error(
                    StatusCode::BAD_GATEWAY,
                    &format!("The sandbox {id} could not be resumed: {m}"),
                    Some(target),
                ))
            }
        }
    }

    /// A signed `/files` request that names no sandbox goes to envd of the sandbox that
    /// signed it. A client whose signed URLs keep matching nothing is answered 429 for the
    /// rest of the minute, without a lookup.
    async fn signed_files_target(
        &self,
        req: &Request<Incoming>,
        client: Option<IpAddr>,
    ) -> Result<Option<Target>, Response<ProxyBody>> {
        let Some(signed) = signed::SignedFiles::parse(req.method(), req.uri()) else {
            return Ok(None);
        };
        let per_minute = self.limits.signed_misses_per_minute;
        if client.is_some_and(|c| !self.misses.allows(c, per_minute)) {
            return Err(error(
                StatusCode::TOO_MANY_REQUESTS,
                &format!("more than {per_minute} signed URLs from this client matched no sandbox in the last minute; try again later"),
                None,
            ));
        }
        match self.routes.find_signer(&signed).await {
            Some(id) => Ok(Some(Target {
                sandbox_id: id,
                port: ENVD_PORT,
            })),
            None => {
                if let Some(c) = client {
                    self.misses.missed(c);
                }
                Ok(None)
            }
        }
    }

    /// The answer to a request past a cap: at once, never queued.
    fn busy(&self, full: limits::Full, target: &Target) -> Response<ProxyBody> {
        let mut resp = match full {
            limits::Full::Client => error(
                StatusCode::TOO_MANY_REQUESTS,
                &format!(
                    "this client has {} requests to sandboxes open, its limit; try again when some finish",
                    self.limits.per_client
                ),
                Some(target),
            ),
            limits::Full::Sandbox => error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!(
                    "The sandbox {} has {} requests open, its limit; try again when some finish",
                    target.sandbox_id, self.limits.per_sandbox
                ),
                Some(target),
            ),
        };
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        resp
    }
}

/// A route as looked up, with the pause generation read before the lookup.
struct Seen {
    route: SandboxRoute,
    generation: u64,
}

/// `/init`, `//init/`, `/%69nit`: however it is spelled, it must not reach envd.
fn is_init_path(path: &str) -> bool {
    let decoded = percent_decode(path);
    let trimmed = decoded.trim_matches('/');
    let first = trimmed.split('/').next().unwrap_or("");
    first.eq_ignore_ascii_case("init")
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    bool::from(subtle::ConstantTimeEq::ct_eq(a, b))
}

fn not_found(target: &Target) -> Response<ProxyBody> {
    error(
        StatusCode::BAD_GATEWAY,
        "The sandbox was not found",
        Some(target),
    )
}

fn port_not_open(target: &Target) -> Response<ProxyBody> {
    error(
        StatusCode::BAD_GATEWAY,
        &format!(
            "The sandbox {} is running but port is not open: nothing listens on port {}",
            target.sandbox_id, target.port
        ),
        Some(target),
    )
}

fn error(status: StatusCode, message: &str, target: Option<&Target>) -> Response<ProxyBody> {
    let mut body = serde_json::json!({ "code": status.as_u16(), "message": message });
    if let Some(t) = target {
        body["sandboxId"] = t.sandbox_id.clone().into();
        body["port"] = t.port.into();
    }
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_blocked_however_spelled() {
        for p in ["/init", "//init", "/init/", "/INIT", "/%69nit", "/init?x=1"] {
            let path = p.split('?').next().unwrap_or(p);
            assert!(is_init_path(path), "{p}");
        }
        for p in ["/", "/health", "/files", "/initx", "/process.Process/Start"] {
            assert!(!is_init_path(p), "{p}");
        }
    }

    #[test]
    fn percent_decode_tolerates_garbage() {
        assert_eq!(percent_decode("/a%2"), "/a%2");
        assert_eq!(percent_decode("%"), "%");
        assert_eq!(percent_decode("%zz"), "%zz");
        assert_eq!(percent_decode("%41"), "A");
    }
}
