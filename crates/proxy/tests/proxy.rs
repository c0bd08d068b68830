//! The proxy against a local "guest" HTTP server: routing, streaming, upgrades, errors,
//! traffic tokens, /init, auto-resume.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use vmon_proxy::{Proxy, ResumeError, Routes, SandboxRoute};

#[derive(Default)]
struct TestRoutes {
    routes: Mutex<HashMap<String, SandboxRoute>>,
    resumes: Mutex<u32>,
}

#[async_trait::async_trait]
impl Routes for TestRoutes {
    async fn lookup(&self, id: &str) -> Option<SandboxRoute> {
        self.routes.lock().unwrap().get(id).cloned()
    }
    async fn resume_for_traffic(&self, id: &str) -> Result<IpAddr, ResumeError> {
        *self.resumes.lock().unwrap() += 1;
        let mut routes = self.routes.lock().unwrap();
        let r = routes
            .get_mut(id)
            .ok_or_else(|| ResumeError::NotFound(id.into()))?;
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        r.guest_ip = Some(ip);
        Ok(ip)
    }
}

/// The guest: `/echo` returns the request body, `/stream` sends three chunks 300 ms apart,
/// `/ws` switches protocols and echoes bytes.
async fn guest(
    req: Request<Incoming>,
) -> Result<Response<http_body_util::combinators::BoxBody<Bytes, Infallible>>, Infallible> {
    match req.uri().path() {
        "/echo" => {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            Ok(Response::new(Full::new(body).boxed()))
        }
        "/stream" => {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
            tokio::spawn(async move {
                for i in 0..3 {
                    let _ = tx
                        .send(Ok(Frame::data(Bytes::from(format!("chunk{i};")))))
                        .await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            });
            let stream = tokio_stream_from(rx);
            Ok(Response::new(StreamBody::new(stream).boxed()))
        }
        "/forever" => {
            // One chunk, then silence: a stream from a guest that has stopped.
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(4);
            tokio::spawn(async move {
                let _ = tx
                    .send(Ok(Frame::data(Bytes::from_static(b"first;"))))
                    .await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
                drop(tx);
            });
            Ok(Response::new(
                StreamBody::new(tokio_stream_from(rx)).boxed(),
            ))
        }
        "/ws" => {
            let mut req = req;
            tokio::spawn(async move {
                if let Ok(up) = hyper::upgrade::on(&mut req).await {
                    let mut io = TokioIo::new(up);
                    let mut buf = [0u8; 64];
                    while let Ok(n) = io.read(&mut buf).await {
                        if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                }
            });
            Ok(Response::builder()
                .status(101)
                .header("connection", "upgrade")
                .header("upgrade", "test")
                .body(Full::new(Bytes::new()).boxed())
                .unwrap())
        }
        _ => Ok(Response::new(
            Full::new(Bytes::from_static(b"root")).boxed(),
        )),
    }
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, Infallible>>,
) -> impl futures::Stream<Item = Result<Frame<Bytes>, Infallible>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn start_guest() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), hyper::service::service_fn(guest))
                    .with_upgrades()
                    .await;
            });
        }
    });
    port
}

/// A guest that counts the connections it accepted.
async fn start_counting_guest() -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), hyper::service::service_fn(guest))
                    .await;
            });
        }
    });
    (port, accepted)
}

async fn start_proxy(routes: Arc<TestRoutes>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(Proxy::new(routes).serve(l, CancellationToken::new()));
    addr
}

/// Routes with one running sandbox, `isbx`, on loopback.
fn one_sandbox() -> Arc<TestRoutes> {
    let routes = Arc::new(TestRoutes::default());
    routes
        .routes
        .lock()
        .unwrap()
        .insert("isbx".into(), route(Some("127.0.0.1"), false, None));
    routes
}

fn route(ip: Option<&str>, auto_resume: bool, token: Option<&str>) -> SandboxRoute {
    SandboxRoute {
        guest_ip: ip.map(|i| i.parse().unwrap()),
        auto_resume,
        traffic_access_token: token.map(str::to_string),
        via: None,
        execution_id: None,
    }
}

async fn raw(addr: SocketAddr, request: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn get(path: &str, id: &str, port: u16, extra: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {id}\r\nE2b-Sandbox-Port: {port}\r\n{extra}Connection: close\r\n\r\n"
    )
}

#[tokio::test]
async fn routes_by_headers_and_host_and_answers_sdk_errors() {
    let port = start_guest().await;
    let routes = one_sandbox();
    let proxy = start_proxy(routes.clone()).await;

    let r = raw(proxy, &get("/", "isbx", port, "")).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.ends_with("root"), "{r}");

    let by_host =
        format!("GET / HTTP/1.1\r\nHost: {port}-isbx.vmon.test\r\nConnection: close\r\n\r\n");
    let r = raw(proxy, &by_host).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");

    let r = raw(proxy, &get("/", "inothere", port, "")).await;
    assert!(r.starts_with("HTTP/1.1 502"), "{r}");
    assert!(r.contains("was not found"), "{r}");

    // Nothing listens on port 1 of the guest.
    let r = raw(proxy, &get("/", "isbx", 1, "")).await;
    assert!(r.starts_with("HTTP/1.1 502"), "{r}");
    assert!(r.contains("port is not open"), "{r}");

    let r = raw(proxy, &get("/init", "isbx", 49983, "")).await;
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");

    let r = raw(
        proxy,
        "GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
}

#[tokio::test]
async fn streams_both_ways_without_buffering() {
    let port = start_guest().await;
    let routes = one_sandbox();
    let proxy = start_proxy(routes).await;

    // A chunked request body comes back whole.
    let req = format!(
        "POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: isbx\r\nE2b-Sandbox-Port: {port}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    );
    let r = raw(proxy, &req).await;
    assert!(r.contains("hello world"), "{r}");

    // The first chunk arrives before the stream ends.
    let stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = Request::get("/stream")
        .header("host", "127.0.0.1")
        .header("e2b-sandbox-id", "isbx")
        .header("e2b-sandbox-port", port.to_string())
        .body(Full::new(Bytes::new()))
        .unwrap();
    let started = std::time::Instant::now();
    let mut body = sender.send_request(req).await.unwrap().into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(&first[..], b"chunk0;");
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "first chunk was held back"
    );
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"chunk1;chunk2;");
    let _ = TokioExecutor::new();
}

#[tokio::test]
async fn upgrades_pass_through() {
    let port = start_guest().await;
    let routes = one_sandbox();
    let proxy = start_proxy(routes).await;
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let req = format!(
        "GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: isbx\r\nE2b-Sandbox-Port: {port}\r\nConnection: upgrade\r\nUpgrade: test\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = vec![0u8; 0];
    let mut buf = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut buf).await.unwrap();
        head.push(buf[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echo, b"ping");
}

#[tokio::test]
async fn traffic_token_and_auto_resume() {
    let port = start_guest().await;
    let routes = Arc::new(TestRoutes::default());
    routes.routes.lock().unwrap().extend([
        (
            "iprivate".to_string(),
            route(Some("127.0.0.1"), false, Some("sekrit")),
        ),
        ("ipaused".to_string(), route(None, false, None)),
        ("isleepy".to_string(), route(None, true, None)),
    ]);
    let proxy = start_proxy(routes.clone()).await;

    let r = raw(proxy, &get("/", "iprivate", port, "")).await;
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    let r = raw(
        proxy,
        &get("/", "iprivate", port, "e2b-traffic-access-token: wrong\r\n"),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 403"), "{r}");
    let r = raw(
        proxy,
        &get(
            "/",
            "iprivate",
            port,
            "e2b-traffic-access-token: sekrit\r\n",
        ),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");

    let r = raw(proxy, &get("/", "ipaused", port, "")).await;
    assert!(r.starts_with("HTTP/1.1 502"), "{r}");
    assert_eq!(*routes.resumes.lock().unwrap(), 0);

    let r = raw(proxy, &get("/", "isleepy", port, "")).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert_eq!(*routes.resumes.lock().unwrap(), 1);
}

#[tokio::test]
async fn slow_clients_are_cut_off_and_never_starve_new_ones() {
    let guest_port = start_guest().await;
    let routes = one_sandbox();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let limits = vmon_proxy::listen::Limits {
        max_connections: 8,
        header_read_timeout: Duration::from_secs(1),
        keep_alive: Duration::from_secs(5),
    };
    tokio::spawn(Proxy::new(routes).serve_with(l, limits, CancellationToken::new()));
    // Clients that send half a request line and then nothing, up to the cap.
    let mut slow = Vec::new();
    for _ in 0..limits.max_connections {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .unwrap();
        slow.push(s);
    }
    // Past the cap a connection is closed at once (it reads EOF, not a hang).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut over = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), over.read(&mut buf))
        .await
        .expect("the connection over the cap is closed, not left hanging");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    // The slow ones are cut off after the header timeout...
    for s in &mut slow {
        let mut rest = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
        assert!(r.is_ok(), "a slow client was not cut off");
    }
    // ...and a normal client is served again.
    let answer = raw(addr, &get("/", "isbx", guest_port, "")).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn a_stream_ends_when_its_sandbox_is_killed() {
    let port = start_guest().await;
    let routes = one_sandbox();
    let proxy = start_proxy(routes.clone()).await;
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    s.write_all(get("/forever", "isbx", port, "").as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("HTTP/1.1 200"));
    // The sandbox is killed: its route goes.
    routes.routes.lock().unwrap().remove("isbx");
    let t0 = std::time::Instant::now();
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(
        ended.is_ok(),
        "the stream hung after its sandbox was killed"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // Cut off, not completed: no last chunk of a chunked body.
    let text = String::from_utf8_lossy(&rest).into_owned();
    assert!(!text.ends_with("0\r\n\r\n"), "{text:?}");
}

/// Envd's connections are kept alive per sandbox run: requests of one run share one
/// connection, and a new run (a resume), another sandbox at the same address, a route without
/// a run and another port each get connections of their own.
#[tokio::test]
async fn envd_connections_are_kept_per_run_and_never_shared() {
    use std::sync::atomic::Ordering::SeqCst;
    let (port, accepted) = start_counting_guest().await;
    let routes = Arc::new(TestRoutes::default());
    let run = |exec: Option<&str>| SandboxRoute {
        execution_id: exec.map(str::to_string),
        ..route(Some("127.0.0.1"), false, None)
    };
    let put = |id: &str, r: SandboxRoute| {
        routes.routes.lock().unwrap().insert(id.into(), r);
    };
    put("isbx", run(Some("e1")));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = l.local_addr().unwrap();
    tokio::spawn(
        Proxy::new(routes.clone())
            .with_pooled_port(port)
            .serve(l, CancellationToken::new()),
    );
    let ok = |r: String| assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("root"), "{r}");

    for _ in 0..3 {
        ok(raw(proxy, &get("/", "isbx", port, "")).await);
    }
    assert_eq!(
        accepted.load(SeqCst),
        1,
        "one run's requests share a connection"
    );

    // The sandbox was paused and resumed at the same address: a new run.
    put("isbx", run(Some("e2")));
    ok(raw(proxy, &get("/", "isbx", port, "")).await);
    ok(raw(proxy, &get("/", "isbx", port, "")).await);
    assert_eq!(
        accepted.load(SeqCst),
        2,
        "a new run gets a connection of its own"
    );

    // Another sandbox now has the address (a slot passed on), even with the same run id.
    put("iother", run(Some("e2")));
    ok(raw(proxy, &get("/", "iother", port, "")).await);
    assert_eq!(
        accepted.load(SeqCst),
        3,
        "sandboxes never share a connection"
    );

    // No run known: a connection per request, as before.
    put("inorun", run(None));
    ok(raw(proxy, &get("/", "inorun", port, "")).await);
    ok(raw(proxy, &get("/", "inorun", port, "")).await);
    assert_eq!(accepted.load(SeqCst), 5);

    // Back to the first sandbox's run: its kept connection answers.
    ok(raw(proxy, &get("/", "isbx", port, "")).await);
    assert_eq!(accepted.load(SeqCst), 5);

    // Another port of the same run (a user's server): a connection per request.
    let (other, other_accepted) = start_counting_guest().await;
    ok(raw(proxy, &get("/", "isbx", other, "")).await);
    ok(raw(proxy, &get("/", "isbx", other, "")).await);
    assert_eq!(other_accepted.load(SeqCst), 2);
}
