//! The few envd calls a node makes itself: health, `/init` after every boot or restore, and
//! running a command (template start commands, the sync before a filesystem-only pause).
//!
//! envd runs inside an untrusted guest: every answer is size-bounded and parsed defensively.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{json, Value};

/// envd's port in every guest.
pub const ENVD_PORT: u16 = 49983;
/// Largest envd answer read by the node.
const MAX_ANSWER: usize = 8 << 20;

pub(crate) async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
    timeout: Duration,
) -> anyhow::Result<(u16, Bytes)> {
    let fut = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut send, conn) = hyper::client::conn::http1::handshake(io).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", addr.to_string());
        for (k, v) in headers {
            req = req.header(*k, v.as_str());
        }
        let req = req.body(Full::new(Bytes::from(body)))?;
        let resp = send.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = Limited::new(resp.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading envd answer: {e}"))?
            .to_bytes();
        anyhow::Ok((status, body))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| anyhow::anyhow!("envd {path} timed out"))?
}

/// The guest's latest self-keepalive ask (`GET /keepalive`: 204 when none; the answer is
/// bounded and checked like any guest's bytes).
pub async fn keepalive(
    addr: SocketAddr,
    token: Option<&str>,
) -> anyhow::Result<Option<vmon_proto::node::KeepaliveAsk>> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Answer {
        age_ms: u64,
        timeout: u64,
    }
    let headers: Vec<(&str, String)> = token
        .map(|t| vec![("x-access-token", t.to_string())])
        .unwrap_or_default();
    let (status, body) = request(
        addr,
        "GET",
        "/keepalive",
        &headers,
        Vec::new(),
        Duration::from_secs(3),
    )
    .await?;
    match status {
        204 => Ok(None),
        200 if body.len() <= 1024 => {
            let a: Answer = serde_json::from_slice(&body)?;
            // What envd itself accepts: 1 s to 30 days; an ask older than that is spent.
            const MAX_SECS: u64 = 30 * 24 * 3600;
            if a.timeout == 0 || a.timeout > MAX_SECS || a.age_ms > MAX_SECS * 1000 {
                anyhow::bail!("an ask out of range ({} s, {} ms old)", a.timeout, a.age_ms);
            }
            Ok(Some(vmon_proto::node::KeepaliveAsk {
                age_ms: a.age_ms,
                timeout_secs: a.timeout,
            }))
        }
        200 => anyhow::bail!("an answer of {} bytes", body.len()),
        s => anyhow::bail!("answered {s}"),
    }
}

/// True when envd answers `GET /health` with a success.
pub async fn healthy(addr: SocketAddr) -> bool {
    matches!(
        request(addr, "GET", "/health", &[], Vec::new(), Duration::from_secs(2)).await,
        Ok((s, _)) if (200..300).contains(&s)
    )
}

/// What `/init` tells a guest after a boot or restore.
#[derive(Debug, Clone, Default)]
pub struct InitRequest {
    pub env_vars: BTreeMap<String, String>,
    /// The token envd will demand from now on.
    pub access_token: Option<String>,
    /// The token envd holds now (from the build), to authenticate this call.
    pub current_token: Option<String>,
    pub default_user: Option<String>,
    /// virtio-fs tags to mount, with their guest paths (cold boots of sandboxes with volumes).
    pub volume_mounts: Vec<(String, String)>,
}

/// Calls `/init`, retrying until it succeeds or `deadline` passes. Every try carries a fresh
/// timestamp and fresh entropy.
pub async fn init(addr: SocketAddr, req: &InitRequest, deadline: Duration) -> anyhow::Result<()> {
    let start = tokio::time::Instant::now();
    let mut last_err;
    loop {
        let mut entropy = [0u8; 64];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut entropy);
        let now = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        let mut body = json!({
            "envVars": req.env_vars,
            "timestamp": now,
            "entropy": base64::engine::general_purpose::STANDARD.encode(entropy),
        });
        if let Some(t) = &req.access_token {
            body["accessToken"] = json!(t);
        }
        if let Some(u) = &req.default_user {
            body["defaultUser"] = json!(u);
        }
        if !req.volume_mounts.is_empty() {
            body["volumeMounts"] = req
                .volume_mounts
                .iter()
                .map(|(tag, path)| json!({"tag": tag, "path": path}))
                .collect();
        }
        let mut headers = vec![("content-type", "application/json".to_string())];
        if let Some(t) = req.current_token.as_ref().or(req.access_token.as_ref()) {
            headers.push(("x-access-token", t.clone()));
        }
        match request(
            addr,
            "POST",
            "/init",
            &headers,
            body.to_string().into_bytes(),
            Duration::from_secs(5),
        )
        .await
        {
            Ok((s, _)) if (200..300).contains(&s) => return Ok(()),
            Ok((s, b)) => {
                last_err = format!(
                    "status {s}: {}",
                    String::from_utf8_lossy(&b[..b.len().min(200)])
                );
            }
            Err(e) => last_err = e.to_string(),
        }
        if start.elapsed() > deadline {
            bail!("envd /init did not succeed within {deadline:?}: {last_err}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until envd answers `/health`.
pub async fn wait_healthy(addr: SocketAddr, deadline: Duration) -> anyhow::Result<()> {
    let start = tokio::time::Instant::now();
    while start.elapsed() < deadline {
        if healthy(addr).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("envd at {addr} did not become healthy within {deadline:?}")
}

/// The outcome of a command run to its end.
#[derive(Debug, Clone, Default)]
pub struct CommandOutput {
    pub pid: u32,
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

fn envelope(msg: &Value) -> Vec<u8> {
    let payload = msg.to_string().into_bytes();
    let mut out = Vec::with_capacity(payload.len() + 5);
    out.push(0);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Splits a Connect stream body into its messages (flag, JSON).
fn envelopes(mut body: &[u8]) -> anyhow::Result<Vec<(u8, Value)>> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            bail!("truncated Connect envelope");
        }
        let flag = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        let Some(payload) = body.get(5..5 + len) else {
            bail!("truncated Connect envelope");
        };
        out.push((
            flag,
            serde_json::from_slice(payload).context("envelope JSON")?,
        ));
        body = &body[5 + len..];
    }
    Ok(out)
}

/// Runs `bash -l -c <cmd>` as `user` and waits for its end.
pub async fn run(
    addr: SocketAddr,
    token: Option<&str>,
    user: &str,
    cmd: &str,
    timeout: Duration,
) -> anyhow::Result<CommandOutput> {
    run_in(addr, token, user, cmd, None, &BTreeMap::new(), timeout).await
}

fn basic_auth(user: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:"))
    )
}

/// Writes `data` to `path` in the guest, as `user` (envd's raw upload).
pub async fn upload(
    addr: SocketAddr,
    token: Option<&str>,
    user: &str,
    path: &str,
    data: Vec<u8>,
    timeout: Duration,
) -> anyhow::Result<()> {
    let query: String = url_encode(path);
    let mut headers = vec![
        ("content-type", "application/octet-stream".to_string()),
        ("authorization", basic_auth(user)),
    ];
    if let Some(t) = token {
        headers.push(("x-access-token", t.to_string()));
    }
    let (status, bytes) = request(
        addr,
        "POST",
        &format!("/files?path={query}"),
        &headers,
        data,
        timeout,
    )
    .await?;
    if !(200..300).contains(&status) {
        bail!(
            "upload to {path} answered {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
        );
    }
    Ok(())
}

/// Percent-encodes everything but unreserved characters and `/`.
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// [`run`] in a working directory (`None`: the user's home) with extra environment variables.
pub async fn run_in(
    addr: SocketAddr,
    token: Option<&str>,
    user: &str,
    cmd: &str,
    cwd: Option<&str>,
    env: &BTreeMap<String, String>,
    timeout: Duration,
) -> anyhow::Result<CommandOutput> {
    let mut process = json!({"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": env});
    if let Some(dir) = cwd {
        process["cwd"] = json!(dir);
    }
    let body = envelope(&json!({
        "process": process,
        "stdin": false,
    }));
    let auth = basic_auth(user);
    let mut headers = vec![
        ("content-type", "application/connect+json".to_string()),
        ("connect-protocol-version", "1".to_string()),
        ("authorization", auth),
    ];
    if let Some(t) = token {
        headers.push(("x-access-token", t.to_string()));
    }
    let (status, bytes) = request(
        addr,
        "POST",
        "/process.Process/Start",
        &headers,
        body,
        timeout,
    )
    .await?;
    if status != 200 {
        // A Connect error: `{"code": "...", "message": "..."}`.
        if let Ok(Value::Object(e)) = serde_json::from_slice::<Value>(&bytes) {
            let field = |k: &str| e.get(k).and_then(Value::as_str).map(str::to_string);
            if let (Some(code), Some(msg)) = (field("code"), field("message")) {
                bail!("command failed: {code}: {msg}");
            }
        }
        bail!(
            "Process.Start answered {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
        );
    }
    let mut out = CommandOutput {
        exit_code: -1,
        ..Default::default()
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut ended = false;
    for (flag, msg) in envelopes(&bytes)? {
        if flag & 2 != 0 {
            if let Some(e) = msg.get("error") {
                bail!("Process.Start failed: {e}");
            }
            continue;
        }
        let ev = &msg["event"];
        if let Some(p) = ev["start"]["pid"].as_u64() {
            out.pid = u32::try_from(p).unwrap_or(0);
        }
        if let Some(s) = ev["data"]["stdout"].as_str() {
            out.stdout
                .extend(b64.decode(s).context("stdout is not base64")?);
        }
        if let Some(s) = ev["data"]["stderr"].as_str() {
            out.stderr
                .extend(b64.decode(s).context("stderr is not base64")?);
        }
        if ev.get("end").is_some() {
            ended = true;
            out.exit_code = ev["end"]["exitCode"]
                .as_i64()
                .and_then(|c| i32::try_from(c).ok())
                .unwrap_or(0);
        }
    }
    if !ended {
        bail!("Process.Start stream ended without an end event");
    }
    Ok(out)
}
