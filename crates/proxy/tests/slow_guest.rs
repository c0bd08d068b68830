//! Guests that keep the proxy waiting: one that accepts and never answers, one that stalls
//! mid-body, one that is slow but steady; and clients that open too much. Each guest is a
//! real TCP server on this machine, the proxy the real one on a real listener; the caps and
//! timeouts are shortened so that the suite takes seconds.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;
use vmon_proxy::{GuestLimits, Proxy, ResumeError, Routes, SandboxRoute};

struct Sandboxes(Mutex<HashMap<String, SandboxRoute>>);

#[async_trait::async_trait]
impl Routes for Sandboxes {
    async fn lookup(&self, id: &str) -> Option<SandboxRoute> {
        self.0.lock().unwrap().get(id).cloned()
    }
    async fn resume_for_traffic(&self, id: &str) -> Result<IpAddr, ResumeError> {
        Err(ResumeError::NotFound(id.into()))
    }
}

/// Sandboxes `ia`, `ib` and `ic`, all with their guest on loopback.
fn sandboxes() -> Arc<Sandboxes> {
    let mut m = HashMap::new();
    for id in ["ia", "ib", "ic"] {
        m.insert(
            id.to_string(),
            SandboxRoute {
                guest_ip: Some("127.0.0.1".parse().unwrap()),
                auto_resume: false,
                traffic_access_token: None,
                via: None,
                execution_id: None,
            },
        );
    }
    Arc::new(Sandboxes(Mutex::new(m)))
}

/// Reads a request's head and its `Content-Length` body; `None` when the client left.
async fn read_request(s: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let len = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.ok()?;
    Some((head, body))
}

/// The guest, by path: `/stuck` accepts and never answers; `/stall` sends its headers and
/// one chunk, then nothing; `/slow` answers after 700 ms and sends a chunk every 400 ms for
/// 2 s; `/echo` answers with the request's body; anything else `ok`.
async fn start_guest() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            tokio::spawn(async move {
                let Some((head, body)) = read_request(&mut s).await else {
                    return;
                };
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                match path.as_str() {
                    "/stuck" => {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    "/stall" => {
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nfirst;\r\n")
                            .await;
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    "/slow" => {
                        tokio::time::sleep(Duration::from_millis(700)).await;
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                            .await;
                        for i in 0..5 {
                            tokio::time::sleep(Duration::from_millis(400)).await;
                            let chunk = format!("p{i};");
                            let _ = s
                                .write_all(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes())
                                .await;
                        }
                        let _ = s.write_all(b"0\r\n\r\n").await;
                    }
                    "/echo" => {
                        let _ = s
                            .write_all(
                                format!(
                                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                                    body.len()
                                )
                                .as_bytes(),
                            )
                            .await;
                        let _ = s.write_all(&body).await;
                    }
                    _ => {
                        let _ = s
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                            .await;
                    }
                }
            });
        }
    });
    port
}

async fn start_proxy(limits: GuestLimits) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(
        Proxy::new(sandboxes())
            .with_limits(limits)
            .serve(l, CancellationToken::new()),
    );
    addr
}

fn limits() -> GuestLimits {
    GuestLimits {
        per_sandbox: 2,
        per_client: 100,
        response_header_timeout: Duration::from_secs(1),
        idle_body_timeout: Duration::from_secs(1),
        signed_misses_per_minute: 60,
    }
}

/// Sends a GET for `path` of sandbox `id` (from `from` when given) and returns the stream.
async fn send(proxy: SocketAddr, from: Option<&str>, id: &str, port: u16, path: &str) -> TcpStream {
    let mut s = match from {
        Some(ip) => {
            let sock = TcpSocket::new_v4().unwrap();
            sock.bind(SocketAddr::new(ip.parse().unwrap(), 0)).unwrap();
            sock.connect(proxy).await.unwrap()
        }
        None => TcpStream::connect(proxy).await.unwrap(),
    };
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: {id}\r\nE2b-Sandbox-Port: {port}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

/// Everything the proxy sends until it closes (or `wait` passes), and how long that took.
async fn read_all(mut s: TcpStream, wait: Duration) -> (String, Duration) {
    let start = Instant::now();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut out)).await;
    (String::from_utf8_lossy(&out).into_owned(), start.elapsed())
}

async fn get(
    proxy: SocketAddr,
    from: Option<&str>,
    id: &str,
    port: u16,
    path: &str,
) -> (String, Duration) {
    let s = send(proxy, from, id, port, path).await;
    read_all(s, Duration::from_secs(10)).await
}

#[tokio::test]
async fn a_guest_that_never_answers_costs_only_its_own_slots() {
    let port = start_guest().await;
    let proxy = start_proxy(limits()).await;

    // Two requests hold ia's two slots.
    let stuck: Vec<TcpStream> =
        futures::future::join_all((0..2).map(|_| send(proxy, None, "ia", port, "/stuck"))).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A third is refused at once, with an E2B-shaped body.
    let (r, took) = get(proxy, None, "ia", port, "/").await;
    assert!(r.starts_with("HTTP/1.1 503"), "{r}");
    assert!(r.contains("\"code\":503") && r.contains("its limit"), "{r}");
    assert!(r.to_ascii_lowercase().contains("retry-after: 1"), "{r}");
    assert!(took < Duration::from_millis(500), "refused in {took:?}");
    // Another sandbox is answered promptly meanwhile.
    let (r, took) = get(proxy, None, "ib", port, "/").await;
    assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("ok"), "{r}");
    assert!(took < Duration::from_millis(500), "ib answered in {took:?}");
    // The stuck ones are cut off at the header timeout with a 504.
    for s in stuck {
        let (r, took) = read_all(s, Duration::from_secs(5)).await;
        assert!(r.starts_with("HTTP/1.1 504"), "{r}");
        assert!(
            r.contains("\"code\":504") && r.contains("did not answer on port"),
            "{r}"
        );
        assert!(took < Duration::from_secs(2), "504 after {took:?}");
    }
    // Their slots came back.
    let (r, _) = get(proxy, None, "ia", port, "/").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
}

#[tokio::test]
async fn a_body_that_stalls_is_cut_off_and_frees_its_slot() {
    let port = start_guest().await;
    let proxy = start_proxy(GuestLimits {
        per_sandbox: 1,
        ..limits()
    })
    .await;
    let s = send(proxy, None, "ia", port, "/stall").await;
    let (r, took) = read_all(s, Duration::from_secs(5)).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("first;"), "the bytes before the stall pass: {r}");
    // Cut off: the proxy closed without the chunked body's end.
    assert!(!r.ends_with("0\r\n\r\n"), "{r:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "cut after {took:?}"
    );
    let (r, _) = get(proxy, None, "ia", port, "/").await;
    assert!(r.starts_with("HTTP/1.1 200"), "the one slot came back: {r}");
}

#[tokio::test]
async fn a_slow_but_steady_guest_is_answered_whole() {
    let port = start_guest().await;
    let proxy = start_proxy(limits()).await;
    // Headers after 0.7 s and a chunk every 0.4 s: within both 1 s timeouts, 2.7 s in all.
    let (r, took) = get(proxy, None, "ia", port, "/slow").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        r.contains("p0;") && r.contains("p4;") && r.ends_with("0\r\n\r\n"),
        "{r:?}"
    );
    assert!(took >= Duration::from_millis(2500), "{took:?}");

    // An upload sent slowly (1.6 s, longer than the header timeout) is not cut off: the
    // timeout counts from its last byte.
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(
        format!(
            "POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: ia\r\nE2b-Sandbox-Port: {port}\r\nContent-Length: 8\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    for part in [b"ab", b"cd", b"ef", b"gh"] {
        tokio::time::sleep(Duration::from_millis(400)).await;
        s.write_all(part).await.unwrap();
    }
    let (r, _) = read_all(s, Duration::from_secs(5)).await;
    assert!(
        r.starts_with("HTTP/1.1 200") && r.ends_with("abcdefgh"),
        "{r}"
    );
}

#[tokio::test]
async fn one_client_is_capped_and_others_are_not() {
    let port = start_guest().await;
    let proxy = start_proxy(GuestLimits {
        per_sandbox: 10,
        per_client: 2,
        response_header_timeout: Duration::from_secs(2),
        ..limits()
    })
    .await;
    // 127.0.0.2 holds its two slots on two sandboxes.
    let held = vec![
        send(proxy, Some("127.0.0.2"), "ia", port, "/stuck").await,
        send(proxy, Some("127.0.0.2"), "ib", port, "/stuck").await,
    ];
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (r, took) = get(proxy, Some("127.0.0.2"), "ic", port, "/").await;
    assert!(r.starts_with("HTTP/1.1 429"), "{r}");
    assert!(
        r.contains("\"code\":429") && r.contains("this client"),
        "{r}"
    );
    assert!(took < Duration::from_millis(500), "{took:?}");
    // Another client reaches the same sandboxes.
    for id in ["ia", "ib", "ic"] {
        let (r, took) = get(proxy, Some("127.0.0.3"), id, port, "/").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{id}: {r}");
        assert!(took < Duration::from_millis(500), "{id}: {took:?}");
    }
    // A client that hangs up gives its slots back at once.
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (r, _) = get(proxy, Some("127.0.0.2"), "ic", port, "/").await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
}

#[tokio::test]
async fn an_upgraded_connection_may_be_quiet_past_the_idle_timeout() {
    // The guest switches protocols, then echoes bytes for as long as the connection lasts.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        read_request(&mut s).await.unwrap();
        s.write_all(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: test\r\n\r\n",
        )
        .await
        .unwrap();
        let mut buf = [0u8; 64];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    });
    let proxy = start_proxy(limits()).await;
    let mut s = TcpStream::connect(proxy).await.unwrap();
    s.write_all(
        format!(
            "GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: ia\r\nE2b-Sandbox-Port: {port}\r\nConnection: upgrade\r\nUpgrade: test\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).await.unwrap(), 1);
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    // Quiet for longer than the idle-body timeout, then still echoed.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    s.write_all(b"ping").await.unwrap();
    let mut got = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
        .await
        .expect("echoed in time")
        .unwrap();
    assert_eq!(&got, b"ping");
}
