//! Starts envd as a host process on a free loopback port and talks to it over real sockets with a
//! small Connect client written on hyper.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use bytes::{Buf, Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

pub const TEST_USER: &str = "vmontest";

pub type ReqBody = BoxBody<Bytes, Infallible>;

pub fn full(b: impl Into<Bytes>) -> ReqBody {
    Full::new(b.into()).boxed()
}

/// A body whose chunks are sent as the test pushes them (chunked transfer on HTTP/1.1).
pub fn channel() -> (mpsc::Sender<Bytes>, ReqBody) {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    (tx, StreamBody::new(stream).boxed())
}

/// Makes sure `vmontest` exists with a home it owns. scripts/install-test-deps.sh makes it before
/// any test runs; this is for `cargo test` run alone. Test binaries run at once (and tests in one
/// binary on several threads), so the check and the `useradd` happen under an exclusive lock on
/// a file every process shares, and once per process.
pub fn ensure_test_user() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/tmp/vmon-test-user.lock")
            .expect("open the test-user lock");
        // Released when `lock` is dropped.
        lock.lock().expect("flock the test-user lock");
        let exists = Command::new("id")
            .arg(TEST_USER)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !matches!(exists, Ok(s) if s.success()) {
            let st = Command::new("useradd")
                .args(["-m", "-s", "/bin/bash", TEST_USER])
                .status()
                .expect("useradd");
            assert!(st.success(), "useradd {TEST_USER} failed");
        }
        // A home left owned by an earlier uid of the same name is given back.
        let uid = Command::new("id")
            .args(["-u", TEST_USER])
            .output()
            .expect("id -u");
        let uid: u32 = String::from_utf8_lossy(&uid.stdout)
            .trim()
            .parse()
            .expect("uid of the test user");
        let home = format!("/home/{TEST_USER}");
        use std::os::unix::fs::MetadataExt;
        match std::fs::metadata(&home) {
            Ok(m) if m.uid() == uid => {}
            _ => {
                std::fs::create_dir_all(&home).expect("make the test user's home");
                let st = Command::new("chown")
                    .args(["-R", &format!("{TEST_USER}:"), &home])
                    .status()
                    .expect("chown");
                assert!(st.success(), "chown {home} failed");
            }
        }
        drop(lock);
    });
}

pub fn basic(user: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:"))
    )
}

pub fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

pub fn unb64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64")
}

/// A running envd; killed (with every process it started) on drop.
pub struct Envd {
    pub addr: SocketAddr,
    child: Child,
    pub token: Option<String>,
}

/// A port no other test of this process was given: tests run in parallel, and two envds
/// handed the same free port would leave one test talking to the other's envd (which goes
/// away when that test ends).
fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

impl Envd {
    pub async fn start() -> Envd {
        Self::start_with(&[]).await
    }

    pub async fn start_with(extra: &[&str]) -> Envd {
        ensure_test_user();
        // A port another process took between our probe and envd's bind: envd exits, and
        // the next port is tried.
        for _ in 0..5 {
            if let Some(envd) = Self::try_start(extra).await {
                return envd;
            }
        }
        panic!("envd did not start on any of 5 ports");
    }

    async fn try_start(extra: &[&str]) -> Option<Envd> {
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let child = Command::new(env!("CARGO_BIN_EXE_envd"))
            .args(["--addr", &addr.to_string(), "--default-user", TEST_USER])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn envd");
        let token = extra
            .iter()
            .position(|a| *a == "--access-token")
            .map(|i| extra[i + 1].to_string());
        let mut envd = Envd { addr, child, token };
        for _ in 0..400 {
            if envd.child.try_wait().ok().flatten().is_some() {
                return None;
            }
            if TcpStream::connect(addr).await.is_err() {
                tokio::time::sleep(Duration::from_millis(25)).await;
                continue;
            }
            if let Ok(r) = envd
                .request(Request::get("/health").body(full("")).expect("req"))
                .await
            {
                // The answer is ours only if our envd is still running (it exits when its
                // bind fails).
                if r.status() == StatusCode::NO_CONTENT
                    && envd.child.try_wait().ok().flatten().is_none()
                {
                    return Some(envd);
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("envd did not become healthy");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident memory of the envd process, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Sends a request over a fresh HTTP/1.1 connection (adds the token if the test set one).
    pub async fn request(&self, mut req: Request<ReqBody>) -> hyper::Result<Response<Incoming>> {
        let stream = TcpStream::connect(self.addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        if !req.headers().contains_key(http::header::HOST) {
            req.headers_mut()
                .insert(http::header::HOST, "localhost".parse().expect("host"));
        }
        if let Some(t) = &self.token {
            if !req.headers().contains_key("x-access-token") {
                req.headers_mut()
                    .insert("x-access-token", t.parse().expect("token"));
            }
        }
        sender.send_request(req).await
    }

    /// An HTTP/2 (prior knowledge) connection.
    pub async fn h2(&self) -> hyper::client::conn::http2::SendRequest<ReqBody> {
        let stream = TcpStream::connect(self.addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .expect("h2 handshake");
        tokio::spawn(conn);
        sender
    }

    /// A unary Connect call; returns the HTTP status and the JSON body.
    pub async fn unary(
        &self,
        path: &str,
        msg: Value,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Value) {
        let mut b = Request::post(path)
            .header("content-type", "application/json")
            .header("connect-protocol-version", "1");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let resp = self
            .request(b.body(full(msg.to_string())).expect("req"))
            .await
            .expect("send");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let v = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).expect("json body")
        };
        (status, v)
    }

    /// Unary call that must succeed.
    pub async fn ok(&self, path: &str, msg: Value, headers: &[(&str, &str)]) -> Value {
        let (st, v) = self.unary(path, msg, headers).await;
        assert_eq!(st, StatusCode::OK, "{path} failed: {v}");
        v
    }

    /// A server-streaming call (body = one envelope, sent chunked).
    pub async fn stream(&self, path: &str, msg: Value, headers: &[(&str, &str)]) -> EnvelopeStream {
        let mut b = Request::post(path)
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1");
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let (tx, body) = channel();
        let req = b.body(body).expect("req");
        let payload = envelope(0, msg.to_string().as_bytes());
        tokio::spawn(async move {
            let _ = tx.send(payload).await;
        });
        let resp = self.request(req).await.expect("send");
        assert_eq!(resp.status(), StatusCode::OK);
        EnvelopeStream {
            body: resp.into_body(),
            buf: BytesMut::new(),
        }
    }
}

impl Drop for Envd {
    fn drop(&mut self) {
        // Processes started through envd run in their own sessions: end them first.
        let me = self.pid();
        if let Ok(rd) = std::fs::read_dir("/proc") {
            for e in rd.flatten() {
                let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                    continue;
                };
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                let ppid = stat
                    .rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().nth(1))
                    .and_then(|p| p.parse::<u32>().ok());
                if ppid == Some(me) {
                    // SAFETY: signalling a process group we started.
                    unsafe {
                        libc::kill(-pid, libc::SIGKILL);
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.extend_from_slice(&[flags]);
    b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    b.extend_from_slice(payload);
    b.freeze()
}

/// Reads envelopes from a streaming response as they arrive.
pub struct EnvelopeStream {
    pub body: Incoming,
    buf: BytesMut,
}

impl EnvelopeStream {
    pub fn new(body: Incoming) -> Self {
        Self {
            body,
            buf: BytesMut::new(),
        }
    }

    /// Next `(flags, json)`; `None` at the end of the body.
    pub async fn next(&mut self) -> Option<(u8, Value)> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    self.buf.advance(5);
                    let payload = self.buf.split_to(len);
                    return Some((
                        flags,
                        serde_json::from_slice(&payload).expect("envelope json"),
                    ));
                }
            }
            match self.body.frame().await {
                None => return None,
                Some(Err(e)) => panic!("stream error: {e}"),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }

    /// Next data message (panics on end-stream).
    pub async fn msg(&mut self) -> Value {
        let (flags, v) = tokio::time::timeout(Duration::from_secs(20), self.next())
            .await
            .expect("timed out waiting for a message")
            .expect("stream ended");
        assert_eq!(flags, 0, "expected a message, got end-stream {v}");
        v
    }

    /// Reads process events until `end`, skipping keepalives; returns (stdout, stderr, pty, end).
    pub async fn collect_process(&mut self) -> (Vec<u8>, Vec<u8>, Vec<u8>, Value) {
        let (mut out, mut err, mut pty) = (Vec::new(), Vec::new(), Vec::new());
        loop {
            let v = self.msg().await;
            let ev = &v["event"];
            if let Some(d) = ev.get("data") {
                if let Some(s) = d.get("stdout") {
                    out.extend(unb64(s.as_str().expect("str")));
                }
                if let Some(s) = d.get("stderr") {
                    err.extend(unb64(s.as_str().expect("str")));
                }
                if let Some(s) = d.get("pty") {
                    pty.extend(unb64(s.as_str().expect("str")));
                }
            } else if let Some(end) = ev.get("end") {
                return (out, err, pty, end.clone());
            } else {
                assert!(ev.get("keepalive").is_some(), "unexpected event {v}");
            }
        }
    }

    /// The end-stream envelope's JSON.
    pub async fn end(&mut self) -> Value {
        let (flags, v) = tokio::time::timeout(Duration::from_secs(20), self.next())
            .await
            .expect("timed out waiting for end-stream")
            .expect("stream ended without end-stream");
        assert_eq!(flags, 2, "expected end-stream, got {v}");
        v
    }
}

/// Starts a command and returns the stream positioned after the start event, plus the pid.
pub async fn start(
    envd: &Envd,
    cmd: &str,
    extra: Value,
    headers: &[(&str, &str)],
) -> (EnvelopeStream, u32) {
    let mut req = json!({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}});
    if let (Some(o), Some(e)) = (req.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            o.insert(k.clone(), v.clone());
        }
    }
    let mut s = envd.stream("/process.Process/Start", req, headers).await;
    let first = s.msg().await;
    let pid = first["event"]["start"]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("first event must be start: {first}"));
    (s, pid as u32)
}
