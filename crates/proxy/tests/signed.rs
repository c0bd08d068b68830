//! A signed `/files` URL that names no sandbox (the SDK's `download_url()` with
//! `E2B_SANDBOX_URL`) reaches envd of the sandbox whose access token signed it.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use vmon_proxy::signed::SignedFiles;
use vmon_proxy::{Proxy, ResumeError, Routes, SandboxRoute, ENVD_PORT};

/// Sandboxes `ione` and `itwo` with envd tokens `token-one` and `token-two`; both "guests"
/// are one server on this machine that says which path and query it was asked for.
struct Two;

/// The "guest" both sandboxes route to.
const GUEST: &str = "127.83.0.1";

#[async_trait::async_trait]
impl Routes for Two {
    async fn lookup(&self, id: &str) -> Option<SandboxRoute> {
        ["ione", "itwo"].contains(&id).then(|| SandboxRoute {
            guest_ip: Some(GUEST.parse().unwrap()),
            auto_resume: false,
            traffic_access_token: None,
            via: None,
            execution_id: None,
        })
    }
    async fn resume_for_traffic(&self, id: &str) -> Result<IpAddr, ResumeError> {
        Err(ResumeError::NotFound(id.into()))
    }
    async fn find_signer(&self, signed: &SignedFiles) -> Option<String> {
        [("ione", "token-one"), ("itwo", "token-two")]
            .into_iter()
            .find(|(_, token)| signed.signed_with(token))
            .map(|(id, _)| id.to_string())
    }
}

fn sign(raw: &str) -> String {
    let sig = format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
    );
    sig.replace('+', "%2B").replace('/', "%2F")
}

async fn raw(addr: SocketAddr, request: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_signed_url_finds_its_sandbox() {
    // Only envd's port is ever chosen this way, so the "guest" must listen on it: on a
    // loopback address of its own, where nothing else on the machine (a real envd) has it.
    let guest = TcpListener::bind((GUEST, ENVD_PORT))
        .await
        .unwrap_or_else(|e| panic!("binding {GUEST}:{ENVD_PORT}: {e}"));
    tokio::spawn(async move {
        while let Ok((s, _)) = guest.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let said = format!("envd saw {}", req.uri());
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(said))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = l.local_addr().unwrap();
    tokio::spawn(Proxy::new(Arc::new(Two)).serve(l, CancellationToken::new()));

    let get = |query: String| {
        format!("GET /files?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    };
    let q = format!(
        "path=%2Fhome%2Fuser%2Fa.txt&signature={}&signature_expiration=1",
        sign("/home/user/a.txt:read::token-two:1")
    );
    let r = raw(proxy, &get(q.clone())).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.ends_with(&format!("envd saw /files?{q}")), "{r}");

    // Signed by no sandbox, or not signed: the request names no sandbox.
    for q in [
        format!("path=%2Fa&signature={}", sign("/a:read::token-three")),
        "path=%2Fa".to_string(),
    ] {
        let r = raw(proxy, &get(q)).await;
        assert!(r.starts_with("HTTP/1.1 400"), "{r}");
        assert!(r.contains("names no sandbox"), "{r}");
    }
}

/// Counts the lookups it is asked for; knows no sandbox.
#[derive(Default)]
struct Counting(std::sync::atomic::AtomicUsize);

#[async_trait::async_trait]
impl Routes for Counting {
    async fn lookup(&self, _: &str) -> Option<SandboxRoute> {
        None
    }
    async fn resume_for_traffic(&self, id: &str) -> Result<IpAddr, ResumeError> {
        Err(ResumeError::NotFound(id.into()))
    }
    async fn find_signer(&self, _: &SignedFiles) -> Option<String> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        None
    }
}

#[tokio::test]
async fn signed_urls_that_find_nothing_are_limited_per_client() {
    let routes = Arc::new(Counting::default());
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = l.local_addr().unwrap();
    let limits = vmon_proxy::GuestLimits {
        signed_misses_per_minute: 3,
        ..Default::default()
    };
    tokio::spawn(
        Proxy::new(routes.clone())
            .with_limits(limits)
            .serve(l, CancellationToken::new()),
    );
    let from = |ip: &'static str, i: usize| async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(SocketAddr::new(ip.parse().unwrap(), 0)).unwrap();
        let mut s = sock.connect(proxy).await.unwrap();
        let q = format!(
            "path=%2Fa{i}&signature={}",
            sign(&format!("/a{i}:read::made-up"))
        );
        s.write_all(
            format!("GET /files?{q} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    };
    for i in 0..3 {
        let r = from("127.0.0.2", i).await;
        assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    }
    let r = from("127.0.0.2", 3).await;
    assert!(r.starts_with("HTTP/1.1 429"), "{r}");
    assert!(r.contains("\"code\":429"), "{r}");
    assert_eq!(
        routes.0.load(std::sync::atomic::Ordering::SeqCst),
        3,
        "the fourth was refused without a lookup"
    );
    // Another client still gets its lookups.
    let r = from("127.0.0.3", 4).await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert_eq!(routes.0.load(std::sync::atomic::Ordering::SeqCst), 4);
}
