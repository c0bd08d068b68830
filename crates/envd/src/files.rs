//! `GET`/`POST /files`: streamed downloads and uploads, as the requesting user, in bounded memory.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use async_compression::tokio::bufread::{GzipDecoder, GzipEncoder};
use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use http::{header, HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};
use hyper::body::Incoming;
use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tokio_util::io::{ReaderStream, StreamReader};

use crate::agent::Agent;
use crate::auth::{self, FileAuth};
use crate::connect::{json_response, Body, Code, ConnectError};
use crate::filesystem::entry;
use crate::user::{self, User};

const CHUNK: usize = 256 * 1024;
const METADATA_HEADER_PREFIX: &str = "x-metadata-";

type ByteStream = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

/// An HTTP error with the `{code, message}` body the SDKs read.
fn error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    json_response(
        status,
        &serde_json::json!({ "code": status.as_u16(), "message": message.into() }),
    )
}

fn from_connect(e: ConnectError) -> Response<Body> {
    let status = match e.code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::InvalidArgument | Code::AlreadyExists => StatusCode::BAD_REQUEST,
        Code::ResourceExhausted => StatusCode::INSUFFICIENT_STORAGE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e.message)
}

fn from_io(e: &io::Error, what: impl std::fmt::Display) -> Response<Body> {
    let status = match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => StatusCode::INSUFFICIENT_STORAGE,
        _ => return from_connect(ConnectError::from_io(e, what)),
    };
    error(status, format!("{what}: not enough disk space: {e}"))
}

/// Decoded query parameters (`application/x-www-form-urlencoded` rules).
pub fn parse_query(q: Option<&str>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        out.insert(percent_decode(k), percent_decode(v));
    }
    out
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 3 <= b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .filter(|h| h.bytes().all(|c| c.is_ascii_hexdigit()))
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Common front of both methods: auth, then the user the request acts as.
async fn prologue(
    agent: &Agent,
    headers: &HeaderMap,
    q: &BTreeMap<String, String>,
    operation: &str,
) -> Result<User, Response<Body>> {
    let username = q.get("username").map(String::as_str).unwrap_or("");
    let path = q.get("path").map(String::as_str).unwrap_or("");
    let fa = FileAuth {
        path,
        username,
        signature: q.get("signature").map(String::as_str),
        expiration: q.get("signature_expiration").map(String::as_str),
    };
    auth::check_files(agent, headers, &fa, operation)?;
    let name = if !username.is_empty() {
        username.to_string()
    } else {
        match user::basic_auth_user(headers) {
            Ok(Some(n)) => n,
            Ok(None) => agent.defaults().user,
            Err(e) => return Err(error(StatusCode::UNAUTHORIZED, e.message)),
        }
    };
    agent
        .user_named(name)
        .await
        .map_err(|e| error(StatusCode::UNAUTHORIZED, e.message))
}

fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|enc| {
            let mut parts = enc.split(';');
            let name = parts.next().unwrap_or("").trim();
            let q_zero = parts.any(|p| {
                let p = p.trim();
                p.strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    == Some(0.0)
            });
            name.eq_ignore_ascii_case("gzip") && !q_zero
        })
}

pub async fn download(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let q = parse_query(req.uri().query());
    let user = match prologue(&agent, req.headers(), &q, "read").await {
        Ok(u) => u,
        Err(r) => return r,
    };
    let Some(path) = q.get("path").filter(|p| !p.is_empty()) else {
        return error(StatusCode::BAD_REQUEST, "path is required");
    };
    let path = match user.resolve(path) {
        Ok(p) => p,
        Err(e) => return from_connect(e),
    };
    let p = path.clone();
    let opened = user::run_as(&user, move || {
        let file = std::fs::File::open(&p)
            .map_err(|e| ConnectError::from_io(&e, format!("opening {}", p.display())))?;
        let meta = file
            .metadata()
            .map_err(|e| ConnectError::from_io(&e, "stat"))?;
        if meta.is_dir() {
            return Err(ConnectError::invalid(format!(
                "path {} is a directory",
                p.display()
            )));
        }
        Ok((file, meta.len()))
    })
    .await;
    let (file, len) = match opened {
        Ok(f) => f,
        Err(e) => return from_connect(e),
    };
    let file = tokio::fs::File::from_std(file);
    let gzip = accepts_gzip(req.headers());
    let stream: ByteStream = if gzip {
        let reader = tokio::io::BufReader::with_capacity(CHUNK, file);
        Box::pin(ReaderStream::with_capacity(GzipEncoder::new(reader), CHUNK))
    } else {
        Box::pin(ReaderStream::with_capacity(file, CHUNK))
    };
    let body = StreamBody::new(stream.map_ok(Frame::data)).boxed_unsync();
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let safe: String = name
        .chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .filter(|c| *c != '"')
        .collect();
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{safe}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    if gzip {
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    } else {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    resp
}

#[derive(Debug, Serialize)]
struct WriteInfo {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    metadata: BTreeMap<String, String>,
}

/// `X-Metadata-<key>: <value>` headers, keys lower-cased, validated.
fn metadata_from(headers: &HeaderMap) -> Result<BTreeMap<String, String>, Response<Body>> {
    let mut out = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER_PREFIX) else {
            continue;
        };
        if key.is_empty() {
            return Err(error(StatusCode::BAD_REQUEST, "empty metadata key"));
        }
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| {
                error(
                    StatusCode::BAD_REQUEST,
                    format!("metadata value for {key} must be printable ASCII"),
                )
            })?;
        out.insert(key.to_ascii_lowercase(), value.to_string());
    }
    Ok(out)
}

pub async fn upload(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let q = parse_query(req.uri().query());
    let user = match prologue(&agent, req.headers(), &q, "write").await {
        Ok(u) => u,
        Err(r) => return r,
    };
    let metadata = match metadata_from(req.headers()) {
        Ok(m) => m,
        Err(r) => return r,
    };
    let (parts, body) = req.into_parts();
    let raw: ByteStream = Box::pin(
        BodyStream::new(body)
            .try_filter_map(|f| futures::future::ready(Ok(f.into_data().ok())))
            .map_err(io::Error::other),
    );
    let encoding = parts
        .headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity")
        .trim()
        .to_ascii_lowercase();
    let body: ByteStream = match encoding.as_str() {
        "" | "identity" => raw,
        "gzip" | "x-gzip" => {
            let mut dec = GzipDecoder::new(StreamReader::new(raw));
            dec.multiple_members(true);
            Box::pin(ReaderStream::with_capacity(dec, CHUNK))
        }
        other => {
            return error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("unsupported content encoding {other:?}"),
            )
        }
    };
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let query_path = q.get("path").filter(|p| !p.is_empty()).cloned();
    let result = if content_type
        .to_ascii_lowercase()
        .starts_with("multipart/form-data")
    {
        upload_multipart(&user, body, &content_type, query_path, &metadata).await
    } else {
        let Some(path) = query_path else {
            return error(StatusCode::BAD_REQUEST, "path is required for a raw upload");
        };
        match user.resolve(&path) {
            Ok(dest) => write_one(&user, dest, body, &metadata)
                .await
                .map(|w| vec![w]),
            Err(e) => Err(from_connect(e)),
        }
    };
    match result {
        Ok(written) => json_response(StatusCode::OK, &written),
        Err(r) => r,
    }
}

async fn upload_multipart(
    user: &User,
    body: ByteStream,
    content_type: &str,
    query_path: Option<String>,
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<WriteInfo>, Response<Body>> {
    let boundary = multer::parse_boundary(content_type).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("invalid multipart content type: {e}"),
        )
    })?;
    let meter = Arc::new(Meter::default());
    let framing = boundary.len() as u64 + 4;
    let mut mp = multer::Multipart::new(Paced::new(body, meter.clone()), boundary);
    let mut written = Vec::new();
    loop {
        let mut field = match mp.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("invalid multipart body: {e}"),
                ))
            }
        };
        let header_bytes: u64 = field
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().len() + v.len() + 3) as u64)
            .sum();
        meter.part(framing + header_bytes + 2);
        // A part is a file when it names one, or, as E2B's envd takes it, when its form name is
        // `file` (a browser's `FormData.append('file', 'text')` sends no filename; the path
        // parameter names the destination then).
        let file_name = field.file_name().map(str::to_string);
        if file_name.is_none() && field.name() != Some("file") {
            // Drained here, so that its bytes count as handed out.
            loop {
                match field.chunk().await {
                    Ok(Some(c)) => meter.part(c.len() as u64),
                    Ok(None) => break,
                    Err(e) => {
                        return Err(error(
                            StatusCode::BAD_REQUEST,
                            format!("invalid multipart body: {e}"),
                        ))
                    }
                }
            }
            continue;
        }
        let target = match &query_path {
            Some(p) if written.is_empty() => p.clone(),
            Some(_) => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    "the path parameter allows only one file",
                ))
            }
            None => file_name.unwrap_or_default(),
        };
        if target.is_empty() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "a file part has no destination path",
            ));
        }
        let dest = user.resolve(&target).map_err(from_connect)?;
        let m = meter.clone();
        let stream: ByteStream = Box::pin(
            field
                .inspect_ok(move |c| m.part(c.len() as u64))
                .map_err(io::Error::other),
        );
        written.push(write_one(user, dest, stream, metadata).await?);
    }
    if written.is_empty() {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "no file in the multipart body",
        ));
    }
    Ok(written)
}

/// Most bytes multipart parsing may hold beyond what it has handed out: preamble, boundaries,
/// part headers, a partial boundary.
const MAX_MULTIPART_OVERHEAD: u64 = 1 << 20;

/// What went into the multipart parser, and what is known to have come out of it.
#[derive(Default)]
struct Meter {
    fed: std::sync::atomic::AtomicU64,
    /// Part data handed out, plus a lower bound of the framing consumed for each part.
    out: std::sync::atomic::AtomicU64,
}

impl Meter {
    fn part(&self, n: u64) {
        self.out.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    fn held(&self) -> u64 {
        let fed = self.fed.load(std::sync::atomic::Ordering::Relaxed);
        fed.saturating_sub(self.out.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// The body as multer sees it. multer moves every chunk that is ready into its buffer before
/// it parses, and keeps looking for a boundary or the end of part headers for as long as the
/// body goes on: a fast client, a gzip bomb or a body without framing would fill memory. So it
/// gets one chunk per poll, and an error once it holds more than `MAX_MULTIPART_OVERHEAD`
/// bytes it has not handed out.
struct Paced {
    inner: ByteStream,
    meter: Arc<Meter>,
    just_fed: bool,
}

impl Paced {
    fn new(inner: ByteStream, meter: Arc<Meter>) -> Self {
        Self {
            inner,
            meter,
            just_fed: false,
        }
    }
}

impl Stream for Paced {
    type Item = io::Result<Bytes>;

    fn poll_next(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        if self.just_fed {
            self.just_fed = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if self.meter.held() > MAX_MULTIPART_OVERHEAD {
            return Poll::Ready(Some(Err(io::Error::other(format!(
                "more than {MAX_MULTIPART_OVERHEAD} bytes of multipart framing"
            )))));
        }
        let next = self.inner.as_mut().poll_next(cx);
        if let Poll::Ready(Some(Ok(chunk))) = &next {
            self.meter
                .fed
                .fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
            self.just_fed = true;
        }
        next
    }
}

/// Opens `dest` as the user (creating parent directories), tags it, then streams `body` in.
async fn write_one(
    user: &User,
    dest: PathBuf,
    mut body: ByteStream,
    metadata: &BTreeMap<String, String>,
) -> Result<WriteInfo, Response<Body>> {
    let (d, md) = (dest.clone(), metadata.clone());
    let (uid, gid) = (user.uid, user.gid);
    if let Some(parent) = dest.parent().map(Path::to_path_buf) {
        tokio::task::spawn_blocking(move || ensure_dirs(&parent, uid, gid))
            .await
            .map_err(|e| {
                error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("file worker failed: {e}"),
                )
            })?
            .map_err(from_connect)?;
    }
    let file = user::run_as(user, move || open_for_write(&d, &md, uid, gid))
        .await
        .map_err(from_connect)?;
    let mut file = tokio::fs::File::from_std(file);
    while let Some(chunk) = body.next().await {
        let chunk =
            chunk.map_err(|e| error(StatusCode::BAD_REQUEST, format!("reading upload: {e}")))?;
        file.write_all(&chunk)
            .await
            .map_err(|e| from_io(&e, format!("writing {}", dest.display())))?;
    }
    file.flush()
        .await
        .map_err(|e| from_io(&e, format!("writing {}", dest.display())))?;
    Ok(WriteInfo {
        name: dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        kind: "file",
        path: dest.display().to_string(),
        metadata: metadata.clone(),
    })
}

/// Creates the missing directories of `dir` with envd's own identity and gives each to the
/// user, as E2B's envd does for an upload: a write to `/new/dir/file` works for the default
/// user (who may `sudo` anyway), and the file itself is still opened as the user.
fn ensure_dirs(dir: &Path, uid: u32, gid: u32) -> Result<(), ConnectError> {
    let mut missing = Vec::new();
    let mut at = Some(dir);
    while let Some(d) = at {
        match std::fs::metadata(d) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => {
                return Err(ConnectError::invalid(format!(
                    "path {} is a file",
                    d.display()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(d),
            Err(e) => {
                return Err(ConnectError::from_io(
                    &e,
                    format!("creating directory {}", d.display()),
                ))
            }
        }
        at = d.parent();
    }
    for d in missing.into_iter().rev() {
        match std::fs::create_dir(d) {
            Ok(()) => {}
            // Made meanwhile by another upload: it gives it to its user.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(ConnectError::from_io(
                    &e,
                    format!("creating directory {}", d.display()),
                ))
            }
        }
        std::os::unix::fs::chown(d, Some(uid), Some(gid)).map_err(|e| {
            ConnectError::from_io(&e, format!("giving directory {} to its user", d.display()))
        })?;
    }
    Ok(())
}

fn open_for_write(
    dest: &Path,
    metadata: &BTreeMap<String, String>,
    uid: u32,
    gid: u32,
) -> Result<std::fs::File, ConnectError> {
    if std::fs::metadata(dest).map(|m| m.is_dir()).unwrap_or(false) {
        return Err(ConnectError::invalid(format!(
            "path {} is a directory",
            dest.display()
        )));
    }
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).map_err(|e| {
            ConnectError::from_io(&e, format!("creating directory {}", parent.display()))
        })?;
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dest)
        .map_err(|e| ConnectError::from_io(&e, format!("opening {}", dest.display())))?;
    // Given to the user as E2B's envd does (an attribute event a watcher sees, as there:
    // create, chmod, write); a file the user does not own keeps its owner.
    let _ = std::os::unix::fs::fchown(&file, Some(uid), Some(gid));
    entry::clear_metadata(&file).map_err(|e| {
        ConnectError::from_io(&e, format!("clearing old metadata of {}", dest.display()))
    })?;
    for (k, v) in metadata {
        entry::write_metadata(&file, k, v).map_err(|e| {
            ConnectError::from_io(&e, format!("setting metadata {k} on {}", dest.display()))
        })?;
    }
    Ok(file)
}

#[cfg(test)]
#[path = "files_fuzz.rs"]
mod fuzz;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = parse_query(Some(
            "path=%2Ftmp%2Fa+b.txt&username=&signature=v1_abc%2B%2F",
        ));
        assert_eq!(q["path"], "/tmp/a b.txt");
        assert_eq!(q["username"], "");
        assert_eq!(q["signature"], "v1_abc+/");
        assert_eq!(parse_query(Some("p=%zz%"))["p"], "%zz%");
    }
}
