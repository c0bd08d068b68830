//! `POST /init` (the node configuring the agent on boot and after every restore) and `GET /envs`.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Deserialize;

use crate::agent::Agent;
use crate::auth;
use crate::connect::{self, json_response, Body};
use crate::rpc::json::decode_base64;

const MAX_INIT_BODY: usize = 1 << 20;
const MAX_ENTROPY_BYTES: usize = 4096;
/// The guest clock is only stepped when it is behind by more than this …
const MAX_TIME_IN_PAST_NANOS: i128 = 50_000_000;
/// … or ahead by more than this (upstream envd's thresholds).
const MAX_TIME_IN_FUTURE_NANOS: i128 = 5_000_000_000;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InitRequest {
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    access_token: Option<String>,
    #[serde(default)]
    timestamp: Option<String>,
    #[serde(default)]
    default_user: Option<String>,
    #[serde(default)]
    default_workdir: Option<String>,
    #[serde(default)]
    entropy: Option<String>,
    /// virtio-fs shares to mount (vmon's; infra sends NFS mounts here under the same name).
    #[serde(default)]
    volume_mounts: Option<Vec<VolumeMount>>,
}

#[derive(Debug, Deserialize)]
struct VolumeMount {
    tag: String,
    path: String,
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        &serde_json::json!({ "code": status.as_u16(), "message": message }),
    )
}

fn now_nanos() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0)
}

/// Rewrites the agent's init marker, if it has one, with a text no earlier `/init` of this
/// guest wrote (the count of `/init`s and the time): whoever cached what envd answered (the
/// code interpreter's token check) sees it change and asks again. Written aside and renamed
/// into place, mode 0644 (the code interpreter runs as `user`); a failure is logged and leaves
/// the old text, which only makes readers ask envd again.
pub fn mark_init(agent: &Agent) {
    let Some(path) = agent.init_marker.as_deref() else {
        return;
    };
    let n = agent
        .inits
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        + 1;
    let text = format!("{n} {}\n", now_nanos());
    let tmp = path.with_extension("tmp");
    let written = (|| {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        tracing::warn!(logger = "init", path = %path.display(), error = %e, "init marker not written");
    }
}

pub async fn init(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    match apply_init(&agent, req).await {
        Ok(()) => {
            let mut resp = Response::new(connect::empty());
            *resp.status_mut() = StatusCode::NO_CONTENT;
            resp.headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        }
        Err(refused) => refused,
    }
}

/// `/init`'s steps: the request read, its caller checked, the clock set and entropy added,
/// the volumes mounted, then the token and defaults taken.
async fn apply_init(agent: &Agent, req: Request<Incoming>) -> Result<(), Response<Body>> {
    let header_token = auth::header_token(req.headers()).map(str::to_string);
    let mut msg = read_init(req).await?;
    if !may_init(agent, &msg, header_token.as_deref()) {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "access token validation failed",
        ));
    }
    let timestamp = init_timestamp(&msg)?;
    let entropy = init_entropy(&msg)?;
    if let Some(ts) = timestamp {
        follow_clock(agent, ts);
    }
    if let Some(bytes) = entropy {
        // Two short ioctls: run inline rather than wake a blocking thread for them.
        add_entropy(&bytes);
    }
    if let Some(mounts) = msg.volume_mounts.take().filter(|m| !m.is_empty()) {
        mount_volumes(mounts).await?;
    }
    agent.set_token(msg.access_token.filter(|t| !t.is_empty()));
    agent.update_defaults(|d| {
        if let Some(env) = msg.env_vars {
            d.env_vars.extend(env);
        }
        if let Some(u) = msg.default_user.filter(|u| !u.is_empty()) {
            d.user = u;
        }
        if let Some(w) = msg.default_workdir.filter(|w| !w.is_empty()) {
            d.workdir = Some(w);
        }
    });
    // A new start (create, resume, fork child): the api set its timeout; an ask from before
    // the snapshot is not this execution's.
    agent.keepalive.clear();
    mark_init(agent);
    // Not on the console: every create and resume passes here, and under emulation each console
    // line costs the guest's serial path on the way to its first answer.
    tracing::debug!(logger = "init", "init applied");
    Ok(())
}

/// The init request (an empty body is one with nothing in it), at most [`MAX_INIT_BODY`].
async fn read_init(req: Request<Incoming>) -> Result<InitRequest, Response<Body>> {
    let body = match Limited::new(req.into_body(), MAX_INIT_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "init body unreadable or too large",
            ))
        }
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(InitRequest::default());
    }
    serde_json::from_slice(&body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("invalid init body: {e}")))
}

/// Once a token is set, only its holder may change it: the same token in the body (a retry,
/// or a restore that keeps it) or in X-Access-Token (rotation by the node).
fn may_init(agent: &Agent, msg: &InitRequest, header_token: Option<&str>) -> bool {
    let Some(current) = agent.token() else {
        return true;
    };
    // Both compared in constant time: the time taken says nothing about the token.
    let held = |t: Option<&str>| t.is_some_and(|t| auth::same(t.as_bytes(), current.as_bytes()));
    held(msg.access_token.as_deref()) || held(header_token)
}

/// The host's time (RFC 3339) as nanoseconds since the epoch, when it is sent.
fn init_timestamp(msg: &InitRequest) -> Result<Option<i128>, Response<Body>> {
    let Some(t) = msg.timestamp.as_deref().filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .map(|ts| Some(ts.unix_timestamp_nanos()))
        .map_err(|e| error(StatusCode::BAD_REQUEST, &format!("invalid timestamp: {e}")))
}

/// The host's entropy for the guest's pool (base64, at most [`MAX_ENTROPY_BYTES`]).
fn init_entropy(msg: &InitRequest) -> Result<Option<Vec<u8>>, Response<Body>> {
    let Some(e) = msg.entropy.as_deref().filter(|e| !e.is_empty()) else {
        return Ok(None);
    };
    match decode_base64(e) {
        Ok(b) if b.len() <= MAX_ENTROPY_BYTES => Ok(Some(b)),
        Ok(_) => Err(error(
            StatusCode::BAD_REQUEST,
            "entropy is larger than 4096 bytes",
        )),
        Err(e) => Err(error(
            StatusCode::BAD_REQUEST,
            &format!("invalid entropy: {e}"),
        )),
    }
}

/// Sets the guest's clock to the host's time `ts` when it is off by more than the bounds;
/// only a newer request may move it: a delayed retry must not set it back.
fn follow_clock(agent: &Agent, ts: i128) {
    let newer = {
        let mut last = agent
            .last_init_nanos
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let newer = last.is_none_or(|l| ts > l);
        if newer {
            *last = Some(ts);
        }
        newer
    };
    let now = now_nanos();
    if newer && (now < ts - MAX_TIME_IN_PAST_NANOS || now > ts + MAX_TIME_IN_FUTURE_NANOS) {
        set_clock(ts);
    }
}

/// Mounts each volume's virtio-fs tag at its absolute path.
async fn mount_volumes(mounts: Vec<VolumeMount>) -> Result<(), Response<Body>> {
    if mounts
        .iter()
        .any(|m| !m.path.starts_with('/') || m.tag.is_empty() || m.tag.len() > 36)
    {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "volume mounts need a tag and an absolute path",
        ));
    }
    let mounted = tokio::task::spawn_blocking(move || {
        mounts
            .iter()
            .try_for_each(|m| crate::init::mount_volume(&m.tag, &m.path))
    })
    .await;
    match mounted {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, &e)),
        Err(e) => Err(error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())),
    }
}

fn set_clock(nanos: i128) {
    let ts = libc::timespec {
        tv_sec: (nanos.div_euclid(1_000_000_000)) as libc::time_t,
        tv_nsec: (nanos.rem_euclid(1_000_000_000)) as libc::c_long,
    };
    // SAFETY: ts is a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "setting the clock failed");
    } else {
        tracing::debug!(logger = "init", "clock set from init timestamp");
    }
}

/// `RNDADDENTROPY` = `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG` = `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

static RANDOM_DEV: std::sync::OnceLock<Option<std::fs::File>> = std::sync::OnceLock::new();

/// Opens `/dev/random` for [`add_entropy`] once, at start: a snapshot then carries the open
/// file and a restore's `/init` does not look the path up again.
pub fn open_random_dev() -> Option<&'static std::fs::File> {
    RANDOM_DEV
        .get_or_init(|| {
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/random")
                .ok()
        })
        .as_ref()
}

/// Credits host-provided random bytes to the kernel pool and reseeds the CRNG, so a restored
/// snapshot does not replay the random stream of its parent.
fn add_entropy(bytes: &[u8]) {
    use std::os::fd::AsRawFd;
    let Some(dev) = open_random_dev() else {
        tracing::warn!("opening /dev/random failed");
        return;
    };
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    // Keep the buffer u32-aligned in length as the kernel reads whole words.
    while info.len() % 4 != 0 {
        info.push(0);
    }
    // SAFETY: info holds a complete rand_pool_info of the declared size.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "RNDADDENTROPY failed");
        return;
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as _, 0) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "RNDRESEEDCRNG failed");
    }
}

pub fn envs(agent: &Agent) -> Response<Body> {
    json_response(StatusCode::OK, &agent.defaults().env_vars)
}
