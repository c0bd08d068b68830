//! Forwarding a routed request to its guest: a plain request over a kept or a fresh
//! connection (with the header timeout and the watch that ends it when the sandbox stops
//! running there), or an upgrade (WebSocket and the like) streamed both ways.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::activity::{InFlight, Stamp, Stamped, StampedIo};
use crate::headers::{envd_keepalive_within, keep_host, strip_hop_by_hop, upstream_uri};
use crate::limits::{Beat, Slot};
use crate::watched::Watched;
use crate::{error, port_not_open, BoxError, Proxy, ProxyBody, Target, ENVD_PORT, WATCH_EVERY};

/// What a request holds while it is forwarded: its count in flight (until the guest's
/// headers), its sandbox's activity stamp, its slot (until its response ends) and the beat of
/// its request body (the header timeout counts from its last byte).
pub(crate) struct Held {
    pub(crate) in_flight: InFlight,
    pub(crate) stamp: Arc<Stamp>,
    pub(crate) slot: Slot,
    pub(crate) beat: Arc<Beat>,
    /// When the proxy got the request.
    pub(crate) started: std::time::Instant,
}

/// Where a request goes: over a kept connection of a sandbox run (its pooled authority,
/// [`crate::pool::authority`]), or over a connection of its own to an address.
pub(crate) enum Upstream {
    Kept(String),
    Fresh(SocketAddr),
}

impl Proxy {
    /// 504: the guest sent no response headers within the timeout.
    fn header_timeout(&self, target: &Target) -> Response<ProxyBody> {
        error(
            StatusCode::GATEWAY_TIMEOUT,
            &format!(
                "The sandbox {} did not answer on port {} within {} s",
                target.sandbox_id,
                target.port,
                self.limits.response_header_timeout.as_secs()
            ),
            Some(target),
        )
    }

    pub(crate) async fn forward(
        &self,
        req: Request<Stamped<Incoming>>,
        upstream: Upstream,
        guest_ip: IpAddr,
        target: &Target,
        held: Held,
    ) -> Response<ProxyBody> {
        let Held {
            in_flight,
            stamp,
            slot,
            beat,
            started,
        } = held;
        let routed = started.elapsed();
        let (mut parts, body) = req.into_parts();
        let path = parts.uri.path().to_string();
        let authority = match &upstream {
            Upstream::Kept(run) => run.clone(),
            Upstream::Fresh(addr) => addr.to_string(),
        };
        let Ok(uri) = upstream_uri(&authority, &parts.uri) else {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid request path",
                Some(target),
            );
        };
        parts.uri = uri;
        // The pooled client speaks HTTP/1.1 to the guest whatever the client spoke to us.
        parts.version = http::Version::HTTP_11;
        keep_host(&mut parts.headers, target);
        strip_hop_by_hop(&mut parts.headers);
        if target.port == ENVD_PORT {
            envd_keepalive_within(&mut parts.headers, self.limits.idle_body_timeout);
        }
        // Watched from the start: a guest paused or killed while this request waits for its
        // answer (a stopped VM answers nothing) gets an answer within a second, not a timeout.
        let mut gone = self.watch(&target.sandbox_id, guest_ip);
        let req = Request::from_parts(parts, body);
        let request = match upstream {
            Upstream::Kept(_) => self.pooled.request(req),
            Upstream::Fresh(_) => self.client.request(req),
        };
        let upstream = tokio::select! {
            r = request => r,
            why = &mut gone => {
                let why = why.unwrap_or_else(|_| "the sandbox went away".to_string());
                return error(StatusCode::BAD_GATEWAY, &why, Some(target));
            }
            _ = beat.quiet_for(self.limits.response_header_timeout) => {
                return self.header_timeout(target);
            }
        };
        drop(in_flight);
        match upstream {
            Ok(resp) => {
                let (mut parts, body) = resp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                // Where a request's time went (`VMON_LOG=vmon_proxy=debug`; the api bench reads
                // these): routing here, the guest's headers, and the body's end (below).
                tracing::debug!(
                    sandbox = %target.sandbox_id,
                    path = %path,
                    route_ms = routed.as_secs_f64() * 1e3,
                    headers_ms = started.elapsed().as_secs_f64() * 1e3,
                    "proxied: headers"
                );
                let body = Watched::new(
                    body.map_err(BoxError::from).boxed(),
                    Some(gone),
                    stamp,
                    self.limits.idle_body_timeout,
                    Some(slot),
                )
                .traced(&target.sandbox_id, path, started);
                Response::from_parts(parts, body.boxed())
            }
            Err(e) if e.is_connect() => port_not_open(target),
            Err(e) => {
                tracing::debug!(sandbox_id = %target.sandbox_id, error = %e, "upstream request failed");
                error(
                    StatusCode::BAD_GATEWAY,
                    &format!("The sandbox {} did not answer: {e}", target.sandbox_id),
                    Some(target),
                )
            }
        }
    }

    /// WebSocket and other `Connection: upgrade` requests: one fresh HTTP/1.1 connection to
    /// the guest, then bytes copied both ways once both sides have switched protocols.
    pub(crate) async fn forward_upgrade(
        &self,
        mut req: Request<Stamped<Incoming>>,
        addr: SocketAddr,
        target: &Target,
        held: Held,
    ) -> Response<ProxyBody> {
        let Held {
            in_flight,
            stamp,
            slot,
            beat,
            ..
        } = held;
        let stream = match tokio::time::timeout(
            Duration::from_secs(10),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(s)) => s,
            _ => return port_not_open(target),
        };
        let (mut sender, conn) =
            match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await {
                Ok(x) => x,
                Err(_) => return port_not_open(target),
            };
        tokio::spawn(async move {
            let _ = conn.with_upgrades().await;
        });
        let client_upgrade = hyper::upgrade::on(&mut req);
        let (mut parts, body) = req.into_parts();
        parts.uri = match parts.uri.path_and_query() {
            Some(pq) => match pq.as_str().parse() {
                Ok(u) => u,
                Err(_) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid request path",
                        Some(target),
                    )
                }
            },
            None => http::Uri::from_static("/"),
        };
        parts.version = http::Version::HTTP_11;
        keep_host(&mut parts.headers, target);
        let sent = tokio::select! {
            r = sender.send_request(Request::from_parts(parts, body)) => r,
            _ = beat.quiet_for(self.limits.response_header_timeout) => {
                return self.header_timeout(target);
            }
        };
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    &format!("The sandbox {} did not answer: {e}", target.sandbox_id),
                    Some(target),
                )
            }
        };
        drop(in_flight);
        // An upgraded connection has no idle bound (a WebSocket may be quiet for as long as
        // its peers like); it holds its slot until either side closes.
        let slot = if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            let upstream_upgrade = hyper::upgrade::on(&mut resp);
            let stamp = stamp.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let (Ok(client), Ok(upstream)) = (client_upgrade.await, upstream_upgrade.await)
                else {
                    return;
                };
                let mut client = StampedIo::new(TokioIo::new(client), stamp);
                let mut upstream = TokioIo::new(upstream);
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            });
            None
        } else {
            Some(slot)
        };
        let (parts, body) = resp.into_parts();
        let body = Watched::new(
            body.map_err(BoxError::from).boxed(),
            None,
            stamp,
            self.limits.idle_body_timeout,
            slot,
        );
        Response::from_parts(parts, body.boxed())
    }

    /// Fires (with the reason) once `sandbox_id` no longer runs at `ip`; ends by itself when
    /// the receiver is dropped (the response finished or its client left).
    fn watch(&self, sandbox_id: &str, ip: IpAddr) -> tokio::sync::oneshot::Receiver<String> {
        let (mut tx, rx) = tokio::sync::oneshot::channel();
        let routes = self.routes.clone();
        let id = sandbox_id.to_string();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(WATCH_EVERY) => {}
                }
                let why = match routes.lookup(&id).await {
                    None => format!("the sandbox {id} was killed or reached its end of life"),
                    Some(r) if r.guest_ip != Some(ip) => {
                        format!("the sandbox {id} was paused or moved")
                    }
                    Some(_) => continue,
                };
                let _ = tx.send(why);
                return;
            }
        });
        rx
    }
}
