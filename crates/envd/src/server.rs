//! The listener and the router: every request enters here and leaves as one response.

use std::convert::Infallible;
use std::sync::Arc;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tracing::Instrument;

use crate::agent::Agent;
use crate::connect::{self, Body, Code, ConnectError};
use crate::{auth, control, files, filesystem, metrics, process};

pub async fn run(listener: TcpListener, agent: Arc<Agent>) -> anyhow::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(4 << 20)
        .max_concurrent_streams(1000);
    let builder = Arc::new(builder);
    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        keep_alive(&stream);
        let (agent, builder) = (agent.clone(), builder.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let agent = agent.clone();
                async move { Ok::<_, Infallible>(with_cors(route(agent, req).await)) }
            });
            if let Err(e) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
}

/// TCP keep-alive probes after a minute of silence: a connection whose other end is gone
/// without a word (the proxy's kept connection of a run that a pause snapshotted; a client
/// whose host vanished) is closed within two minutes instead of holding a task and a
/// descriptor for the life of the guest.
fn keep_alive(stream: &tokio::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    for (level, name, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 60),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ] {
        let v: libc::c_int = value;
        // SAFETY: setsockopt on a socket this task owns, with a pointer to a live c_int and
        // its size; a failure leaves the socket as it was.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "keep-alive not set");
            return;
        }
    }
}

/// Browsers (the JS SDK) call envd directly, so every origin is allowed; auth is by token.
fn with_cors(mut resp: Response<Body>) -> Response<Body> {
    let h = resp.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_ORIGIN,
        HeaderValue::from_static("*"),
    );
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("*"),
    );
    resp
}

fn status(code: StatusCode) -> Response<Body> {
    let mut r = Response::new(connect::empty());
    *r.status_mut() = code;
    r
}

async fn route(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    if req.method() == Method::OPTIONS {
        let mut r = status(StatusCode::NO_CONTENT);
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("*"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("86400"),
        );
        return r;
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => status(StatusCode::NO_CONTENT),
        (Method::POST, "/init") => control::init(agent, req).await,
        (Method::GET, "/files") => files::download(agent, req).await,
        (Method::POST, "/files") => files::upload(agent, req).await,
        (Method::GET, "/envs") if auth::token_ok(&agent, req.headers()) => control::envs(&agent),
        (Method::GET, "/metrics") if auth::token_ok(&agent, req.headers()) => {
            connect::json_response(StatusCode::OK, &metrics::collect(&agent).await)
        }
        (Method::POST, "/keepalive") => crate::keepalive::ask(&agent, req).await,
        (Method::GET, "/keepalive") => crate::keepalive::latest(&agent, &req),
        (Method::GET, "/envs" | "/metrics") => {
            auth::unauthorized("invalid or missing access token")
        }
        (_, "/health" | "/init" | "/files" | "/envs" | "/metrics" | "/keepalive") => {
            status(StatusCode::METHOD_NOT_ALLOWED)
        }
        _ => match path.strip_prefix('/').and_then(|p| p.split_once('/')) {
            Some((service, method)) => rpc(agent, service, method, req).await,
            None => status(StatusCode::NOT_FOUND),
        },
    }
}

async fn rpc(
    agent: Arc<Agent>,
    service: &str,
    method: &str,
    req: Request<Incoming>,
) -> Response<Body> {
    let kind = match service {
        "process.Process" => process::kind(method),
        "filesystem.Filesystem" => filesystem::kind(method),
        _ => None,
    };
    let Some(kind) = kind else {
        let mut r = ConnectError::new(
            Code::Unimplemented,
            format!("unknown procedure /{service}/{method}"),
        )
        .into_response();
        *r.status_mut() = StatusCode::NOT_FOUND;
        return r;
    };
    if req.method() != Method::POST {
        let mut r = status(StatusCode::METHOD_NOT_ALLOWED);
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return r;
    }
    if !auth::token_ok(&agent, req.headers()) {
        let mut r = ConnectError::new(Code::Unauthenticated, "invalid or missing access token")
            .into_response();
        *r.status_mut() = StatusCode::UNAUTHORIZED;
        return r;
    }
    if let Err(r) = connect::check_request_headers(kind, req.headers()) {
        return r;
    }
    let user = match agent.request_user(req.headers()).await {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let (parts, body) = req.into_parts();
    let method = method.to_string();
    let span = tracing::debug_span!("rpc", service, method = %method, user = %user.name);
    match service {
        "process.Process" => {
            process::dispatch(agent, user, &method, parts.headers, body)
                .instrument(span)
                .await
        }
        _ => {
            filesystem::dispatch(agent, user, &method, parts.headers, body)
                .instrument(span)
                .await
        }
    }
}
