//! The client: one presigned request at a time over a pooled hyper connection. `rusty-s3`
//! builds and signs each request's URL and reads the store's XML; this file sends them.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rusty_s3::actions::{CreateMultipartUpload, ListObjectsV2};
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use sha2::{Digest, Sha256};

use crate::body::{file_body, full, read_bounded, write_sparse};
use crate::{xml, Error, ObjectStoreConfig, Result};

/// Files larger than this go up in parts of this size (multipart upload).
pub const DEFAULT_PART_SIZE: u64 = 64 << 20;
/// S3 allows at most this many parts per upload.
const MAX_PARTS: u64 = 10_000;
/// Largest error, listing or multipart answer read into memory.
const MAX_XML: usize = 8 << 20;
/// How long a request may wait for its response head, and a body for its next bytes.
pub(crate) const IDLE: Duration = Duration::from_secs(60);
/// Attempts per request that a connection failure or a 5xx may repeat.
const ATTEMPTS: u32 = 3;

pub(crate) type ReqBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;
type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// One object as listed or headed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The key without the configured prefix.
    pub key: String,
    pub size: u64,
    /// Last modification (seconds since the epoch), when the store said.
    pub modified_unix: Option<i64>,
}

/// An S3 bucket reached through one endpoint.
#[derive(Clone)]
pub struct ObjectStore {
    cfg: ObjectStoreConfig,
    bucket: Arc<Bucket>,
    credentials: Arc<Credentials>,
    prefix: String,
    part_size: u64,
    list_page: u32,
    client: Client<Connector, ReqBody>,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStore")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn tls() -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for c in found.certs {
        let _ = roots.add(c);
    }
    Ok(rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth())
}

fn parse_rfc3339(s: &str) -> Option<i64> {
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .ok()
        .map(|t| t.unix_timestamp())
}

/// Builds a request's body afresh for each attempt.
type BodyFn<'a> =
    &'a (dyn Fn() -> futures::future::BoxFuture<'static, anyhow::Result<ReqBody>> + Sync);

/// One request: its action (which names the method, the key and the query, and signs them),
/// the headers signed with it, and its body.
struct Call<'a, A> {
    what: &'a str,
    action: A,
    /// Sent and signed (lower-case names).
    headers: Vec<(&'static str, String)>,
    body: BodyFn<'a>,
    len: u64,
    timeout: Duration,
}

impl<'a, A> Call<'a, A> {
    /// A request whose body streams from a file, with no signed header of its own.
    fn streamed(what: &'a str, action: A, body: BodyFn<'a>, len: u64, timeout: Duration) -> Self {
        Call {
            what,
            action,
            headers: Vec::new(),
            body,
            len,
            timeout,
        }
    }
}

/// `Content-MD5` of a body: the store refuses the body if it does not match, and the header is
/// signed, so a small body cannot be altered on the way.
fn content_md5(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(<md5::Md5 as md5::Digest>::digest(data))
}

fn http_method(m: rusty_s3::Method) -> Method {
    match m {
        rusty_s3::Method::Head => Method::HEAD,
        rusty_s3::Method::Get => Method::GET,
        rusty_s3::Method::Post => Method::POST,
        rusty_s3::Method::Put => Method::PUT,
        rusty_s3::Method::Delete => Method::DELETE,
    }
}

impl ObjectStore {
    pub fn new(cfg: ObjectStoreConfig) -> anyhow::Result<ObjectStore> {
        let uri: http::Uri = cfg
            .endpoint
            .trim_end_matches('/')
            .parse()
            .with_context(|| format!("object store endpoint {:?}", cfg.endpoint))?;
        let scheme = uri.scheme_str().unwrap_or("http").to_string();
        if scheme != "http" && scheme != "https" {
            anyhow::bail!("object store endpoint {:?} is not http(s)", cfg.endpoint);
        }
        let authority = uri
            .authority()
            .with_context(|| format!("object store endpoint {:?} has no host", cfg.endpoint))?
            .clone();
        if uri.path() != "/" && !uri.path().is_empty() {
            anyhow::bail!(
                "object store endpoint {:?} has a path; give the bucket separately",
                cfg.endpoint
            );
        }
        if cfg.bucket.is_empty() || cfg.bucket.contains('/') {
            anyhow::bail!("{:?} is not a bucket name", cfg.bucket);
        }
        let endpoint = url::Url::parse(&format!("{scheme}://{authority}/"))
            .with_context(|| format!("object store endpoint {:?}", cfg.endpoint))?;
        let bucket = Bucket::new(
            endpoint,
            UrlStyle::Path,
            cfg.bucket.clone(),
            cfg.region.clone(),
        )
        .with_context(|| format!("object store bucket {:?}", cfg.bucket))?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(10)));
        http.set_nodelay(true);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls()?)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(https);
        let mut prefix = cfg.prefix.trim_start_matches('/').to_string();
        if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        Ok(ObjectStore {
            bucket: Arc::new(bucket),
            credentials: Arc::new(Credentials::new(
                cfg.access_key_id.clone(),
                cfg.secret_access_key.clone(),
            )),
            prefix,
            part_size: DEFAULT_PART_SIZE,
            list_page: 1000,
            cfg,
            client,
        })
    }

    /// Uploads files larger than `bytes` in parts of `bytes` (at least 5 MiB, S3's minimum).
    pub fn with_part_size(mut self, bytes: u64) -> ObjectStore {
        self.part_size = bytes.max(5 << 20);
        self
    }

    /// Lists at most `keys` keys per request (S3's maximum, 1000, by default).
    pub fn with_list_page(mut self, keys: u32) -> ObjectStore {
        self.list_page = keys.clamp(1, 1000);
        self
    }

    pub fn config(&self) -> &ObjectStoreConfig {
        &self.cfg
    }

    fn full_key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Sends one presigned request (about `key`, `""`: the bucket), repeating it on connection
    /// failures and 5xx answers; non-2xx answers become errors (404 [`Error::NotFound`]).
    async fn send<'a, A: S3Action<'a>>(
        &self,
        key: &str,
        mut call: Call<'_, A>,
    ) -> Result<Response<Incoming>> {
        for (name, value) in &call.headers {
            call.action.headers_mut().insert(*name, value.clone());
        }
        // One URL serves every attempt: valid for all of them and their pauses.
        let valid = (call.timeout + Duration::from_secs(5)) * ATTEMPTS + Duration::from_secs(60);
        let url = call.action.sign(valid);
        let method = http_method(A::METHOD);
        let mut last: Option<Error> = None;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
            }
            let body = (call.body)().await?;
            let mut req = Request::builder()
                .method(method.clone())
                .uri(url.as_str())
                .header(http::header::CONTENT_LENGTH, call.len);
            for (name, value) in &call.headers {
                req = req.header(*name, value);
            }
            let req = req
                .body(body)
                .map_err(|e| anyhow!("building the request: {e}"))?;
            let resp = match tokio::time::timeout(call.timeout, self.client.request(req)).await {
                Err(_) => {
                    last = Some(anyhow!("{} timed out after {:?}", call.what, call.timeout).into());
                    continue;
                }
                Ok(Err(e)) => {
                    last = Some(anyhow!("{}: {e:#}", call.what).into());
                    continue;
                }
                Ok(Ok(r)) => r,
            };
            let status = resp.status();
            if status.is_success() {
                return Ok(resp);
            }
            if status == StatusCode::NOT_FOUND {
                return Err(Error::NotFound(if key.is_empty() {
                    format!("bucket {}", self.cfg.bucket)
                } else {
                    key.to_string()
                }));
            }
            let text = read_bounded(resp.into_body(), 64 << 10)
                .await
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            let (code, message) = xml::error(&text).unwrap_or_default();
            let e = Error::Status {
                what: call.what.to_string(),
                status: status.as_u16(),
                code,
                message,
            };
            if !status.is_server_error() {
                return Err(e);
            }
            last = Some(e);
        }
        Err(last.unwrap_or_else(|| anyhow!("{}: no attempt was made", call.what).into()))
    }

    /// A request with a small in-memory body (its `Content-MD5` signed).
    async fn send_bytes<'a, A: S3Action<'a>>(
        &self,
        key: &str,
        what: &str,
        action: A,
        data: Bytes,
    ) -> Result<Response<Incoming>> {
        let len = data.len() as u64;
        let headers = if data.is_empty() {
            Vec::new()
        } else {
            vec![("content-md5", content_md5(&data))]
        };
        let body = move || -> futures::future::BoxFuture<'static, anyhow::Result<ReqBody>> {
            let d = data.clone();
            Box::pin(async move { Ok(full(d)) })
        };
        self.send(
            key,
            Call {
                what,
                action,
                headers,
                body: &body,
                len,
                timeout: IDLE,
            },
        )
        .await
    }

    /// Creates the bucket unless it exists.
    pub async fn ensure_bucket(&self) -> Result<()> {
        let head = self.bucket.head_bucket(Some(&*self.credentials));
        match self.send_bytes("", "head bucket", head, Bytes::new()).await {
            Ok(_) => return Ok(()),
            Err(Error::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        let create = self.bucket.create_bucket(&self.credentials);
        match self
            .send_bytes("", "create bucket", create, Bytes::new())
            .await
        {
            Ok(_) => Ok(()),
            Err(Error::Status { code, .. })
                if code == "BucketAlreadyOwnedByYou" || code == "BucketAlreadyExists" =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// The object's size, or `None` when it is absent.
    pub async fn head(&self, key: &str) -> Result<Option<ObjectInfo>> {
        let full = self.full_key(key);
        let head = self.bucket.head_object(Some(&*self.credentials), &full);
        let resp = match self.send_bytes(key, "head", head, Bytes::new()).await {
            Ok(r) => r,
            Err(Error::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let size = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("the store's HEAD of {key} has no Content-Length"))?;
        let modified_unix = resp
            .headers()
            .get(http::header::LAST_MODIFIED)
            .and_then(|v| v.to_str().ok())
            .and_then(httpdate_unix);
        Ok(Some(ObjectInfo {
            key: key.to_string(),
            size,
            modified_unix,
        }))
    }

    /// Deletes the object (absent is fine).
    pub async fn delete(&self, key: &str) -> Result<()> {
        let full = self.full_key(key);
        let delete = self.bucket.delete_object(Some(&*self.credentials), &full);
        match self.send_bytes(key, "delete", delete, Bytes::new()).await {
            Ok(_) | Err(Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Puts a small object from memory.
    pub async fn put_bytes(&self, key: &str, data: Bytes) -> Result<()> {
        let full = self.full_key(key);
        let put = self.bucket.put_object(Some(&*self.credentials), &full);
        self.send_bytes(key, "put", put, data).await?;
        Ok(())
    }

    /// A small object, read into memory: `None` when absent, an error beyond `max` bytes.
    pub async fn get_bytes(&self, key: &str, max: usize) -> Result<Option<Bytes>> {
        let full = self.full_key(key);
        let get = self.bucket.get_object(Some(&*self.credentials), &full);
        match self.send_bytes(key, "get", get, Bytes::new()).await {
            Ok(r) => Ok(Some(read_bounded(r.into_body(), max).await?)),
            Err(Error::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every object under `prefix` (after the configured one), in key order, page by page.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        let full_prefix = self.full_key(prefix);
        loop {
            let mut list = self.bucket.list_objects_v2(Some(&*self.credentials));
            list.with_prefix(full_prefix.as_str());
            list.with_max_keys(self.list_page as usize);
            if let Some(t) = &token {
                list.with_continuation_token(t.clone());
            }
            let resp = self.send_bytes("", "list", list, Bytes::new()).await?;
            let body = read_bounded(resp.into_body(), MAX_XML).await?;
            let page = ListObjectsV2::parse_response(&String::from_utf8_lossy(&body))
                .map_err(|e| anyhow!("the store's listing: {e}"))?;
            for c in page.contents {
                let Some(key) = c.key.strip_prefix(&self.prefix) else {
                    continue;
                };
                out.push(ObjectInfo {
                    key: key.to_string(),
                    size: c.size.unwrap_or(0),
                    modified_unix: c.last_modified.as_deref().and_then(parse_rfc3339),
                });
            }
            token = page.next_continuation_token.filter(|t| !t.is_empty());
            if token.is_none() {
                break;
            }
        }
        Ok(out)
    }

    /// Uploads the file at `path` as `key` (in parts when larger than the part size); returns
    /// its size and sha256 (hex) as read while sending.
    pub async fn put_file(&self, key: &str, path: &Path) -> Result<(u64, String)> {
        let len = tokio::fs::metadata(path)
            .await
            .with_context(|| format!("{}", path.display()))?
            .len();
        if len <= self.part_size {
            let (_, hash) = self
                .put_part(key, path, None, 0, len, Sha256::new())
                .await?;
            return Ok((len, hex::encode(hash.finalize())));
        }
        let part_size = self.part_size.max(len.div_ceil(MAX_PARTS));
        let full = self.full_key(key);
        let start = CreateMultipartUpload::new(&self.bucket, Some(&*self.credentials), &full);
        let resp = self
            .send_bytes(key, "start multipart upload", start, Bytes::new())
            .await?;
        let doc = read_bounded(resp.into_body(), MAX_XML).await?;
        let upload_id = CreateMultipartUpload::parse_response(&String::from_utf8_lossy(&doc))
            .map_err(|e| anyhow!("the store's multipart answer: {e}"))?
            .upload_id()
            .to_string();
        if upload_id.is_empty() {
            return Err(anyhow!("the store's multipart answer has no UploadId").into());
        }
        let result = self.put_parts(key, path, &upload_id, len, part_size).await;
        if result.is_err() {
            let abort =
                self.bucket
                    .abort_multipart_upload(Some(&*self.credentials), &full, &upload_id);
            let abort = self
                .send_bytes(key, "abort multipart upload", abort, Bytes::new())
                .await;
            if let Err(e) = abort {
                tracing::warn!(key, "aborting a failed multipart upload failed: {e}");
            }
        }
        result
    }

    async fn put_parts(
        &self,
        key: &str,
        path: &Path,
        upload_id: &str,
        len: u64,
        part_size: u64,
    ) -> Result<(u64, String)> {
        let mut hash = Sha256::new();
        let mut etags = Vec::new();
        let mut offset = 0;
        let mut number = 1u32;
        while offset < len {
            let n = part_size.min(len - offset);
            let part = Some((number, upload_id));
            let (etag, h) = self.put_part(key, path, part, offset, n, hash).await?;
            hash = h;
            etags.push(etag);
            offset += n;
            number += 1;
        }
        let full = self.full_key(key);
        let complete = self.bucket.complete_multipart_upload(
            Some(&*self.credentials),
            &full,
            upload_id,
            etags.iter().map(String::as_str),
        );
        let doc = complete.clone().body();
        let resp = self
            .send_bytes(key, "complete multipart upload", complete, Bytes::from(doc))
            .await?;
        // S3 may answer 200 with an error document once the parts are assembled.
        let answer = read_bounded(resp.into_body(), MAX_XML).await?;
        if let Some((code, message)) = xml::error(&String::from_utf8_lossy(&answer)) {
            return Err(Error::Status {
                what: "complete multipart upload".into(),
                status: 200,
                code,
                message,
            });
        }
        Ok((len, hex::encode(hash.finalize())))
    }

    /// PUTs `len` bytes of the file at `offset` (a whole object, or a part when `part` names
    /// its number and upload); returns the ETag and `hash` advanced over the bytes that were
    /// sent.
    async fn put_part(
        &self,
        key: &str,
        path: &Path,
        part: Option<(u32, &str)>,
        offset: u64,
        len: u64,
        hash: Sha256,
    ) -> Result<(String, Sha256)> {
        // Each attempt hashes from the same state; the last (successful) one is kept.
        let current: Arc<Mutex<Sha256>> = Arc::new(Mutex::new(hash.clone()));
        let body = {
            let path = path.to_path_buf();
            let current = current.clone();
            move || -> futures::future::BoxFuture<'static, anyhow::Result<ReqBody>> {
                let path = path.clone();
                if let Ok(mut c) = current.lock() {
                    *c = hash.clone();
                }
                let current = current.clone();
                Box::pin(async move { file_body(&path, offset, len, current).await })
            }
        };
        // 64 MiB at no less than ~1 MiB/s, plus a minute.
        let timeout = IDLE + Duration::from_secs(len >> 20);
        let full = self.full_key(key);
        let creds = Some(&*self.credentials);
        let resp = match part {
            None => {
                let put = self.bucket.put_object(creds, &full);
                let call = Call::streamed("put", put, &body, len, timeout);
                self.send(key, call).await?
            }
            Some((number, upload_id)) => {
                // At most MAX_PARTS (10 000) parts: the number fits.
                let number = u16::try_from(number).map_err(|_| anyhow!("part {number}"))?;
                let put = self.bucket.upload_part(creds, &full, number, upload_id);
                let call = Call::streamed("put part", put, &body, len, timeout);
                self.send(key, call).await?
            }
        };
        let etag = resp
            .headers()
            .get(http::header::ETAG)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        // The response body of a PUT is empty; drain what there is (bounded).
        let _ = read_bounded(resp.into_body(), 64 << 10).await;
        let h = current
            .lock()
            .map_err(|_| anyhow!("hash state poisoned"))?
            .clone();
        Ok((etag, h))
    }

    /// Downloads `key` into `dest`: written under a temporary name beside it (runs of zeros
    /// left as holes), fsynced, checked against `want_sha256` when given, then renamed. On any
    /// failure nothing stays behind. Returns the size and sha256 (hex).
    pub async fn get_to_file(
        &self,
        key: &str,
        dest: &Path,
        want_sha256: Option<&str>,
    ) -> Result<(u64, String)> {
        let dir = dest
            .parent()
            .ok_or_else(|| anyhow!("{} has no directory", dest.display()))?;
        let name = dest
            .file_name()
            .ok_or_else(|| anyhow!("{} has no file name", dest.display()))?
            .to_string_lossy();
        let tmp = dir.join(format!(
            ".{name}.{:016x}.part",
            rand::Rng::gen::<u64>(&mut rand::thread_rng())
        ));
        let r = self.download(key, &tmp, want_sha256).await;
        match r {
            Ok(v) => {
                tokio::fs::rename(&tmp, dest)
                    .await
                    .with_context(|| format!("renaming into {}", dest.display()))?;
                std::fs::File::open(dir)?.sync_all()?;
                Ok(v)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    async fn download(&self, key: &str, tmp: &Path, want: Option<&str>) -> Result<(u64, String)> {
        let full = self.full_key(key);
        let get = self.bucket.get_object(Some(&*self.credentials), &full);
        let resp = self.send_bytes(key, "get", get, Bytes::new()).await?;
        let expected_len: Option<u64> = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Bytes>(8);
        let writer = tokio::task::spawn_blocking(move || write_sparse(file, rx));
        let mut body = resp.into_body();
        let mut got = 0u64;
        let fed: anyhow::Result<()> = async {
            loop {
                let frame = tokio::time::timeout(IDLE, body.frame())
                    .await
                    .map_err(|_| anyhow!("the store stopped sending {key} for {IDLE:?}"))?;
                let Some(frame) = frame else { break };
                if let Ok(data) = frame
                    .map_err(|e| anyhow!("reading {key}: {e}"))?
                    .into_data()
                {
                    got += data.len() as u64;
                    if expected_len.is_some_and(|n| got > n) {
                        return Err(anyhow!("{key} is longer than its Content-Length"));
                    }
                    // A closed channel means the writer failed; its error is reported below.
                    if tx.send(data).is_err() {
                        break;
                    }
                }
            }
            Ok(())
        }
        .await;
        drop(tx);
        let written = writer
            .await
            .map_err(|e| anyhow!("writer task: {e}"))?
            .with_context(|| format!("writing {}", tmp.display()))?;
        fed?;
        let (len, sha) = written;
        if expected_len.is_some_and(|n| n != len) {
            return Err(anyhow!("{key} ended after {len} bytes of {expected_len:?}").into());
        }
        if let Some(want) = want {
            if !want.eq_ignore_ascii_case(&sha) {
                return Err(Error::Integrity {
                    key: key.to_string(),
                    want: want.to_string(),
                    got: sha,
                });
            }
        }
        Ok((len, sha))
    }
}

/// Seconds since the epoch of an HTTP date (`Last-Modified`).
fn httpdate_unix(s: &str) -> Option<i64> {
    let f = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    time::PrimitiveDateTime::parse(s, &f)
        .ok()
        .map(|t| t.assume_utc().unix_timestamp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::full as full_body;

    #[test]
    fn store_dates_parse_in_both_of_s3s_forms() {
        assert_eq!(
            parse_rfc3339("2013-05-24T00:00:00.000Z"),
            Some(1_369_353_600)
        );
        assert_eq!(
            httpdate_unix("Fri, 24 May 2013 00:00:00 GMT"),
            Some(1_369_353_600)
        );
        assert_eq!(httpdate_unix("yesterday"), None);
    }

    #[test]
    fn endpoints_with_paths_or_other_schemes_are_refused() {
        let cfg = |e: &str| ObjectStoreConfig {
            endpoint: e.into(),
            bucket: "b".into(),
            region: "garage".into(),
            access_key_id: "k".into(),
            secret_access_key: "s".into(),
            prefix: "p".into(),
        };
        assert!(ObjectStore::new(cfg("ftp://x")).is_err());
        assert!(ObjectStore::new(cfg("http://x/bucket")).is_err());
        let s = ObjectStore::new(cfg("http://127.0.0.1:3900/")).expect("ok");
        assert_eq!(
            s.bucket.object_url("a b").as_str(),
            "http://127.0.0.1:3900/b/a%20b"
        );
        assert_eq!(s.full_key("a"), "p/a");
        let s = ObjectStore::new(cfg("https://s3.example:443")).expect("ok");
        assert_eq!(s.bucket.object_url("k").as_str(), "https://s3.example/b/k");
    }

    #[tokio::test]
    async fn a_small_body_altered_after_signing_is_refused_by_the_store() {
        let tmp = tempfile::tempdir().expect("tmp");
        let g = crate::dev::DevGarage::start(&tmp.path().join("garage")).expect("garage");
        let store = ObjectStore::new(g.config.clone()).expect("store");
        store.ensure_bucket().await.expect("bucket");
        // Signed for one body, sent with another: what an on-path rewrite would do.
        let full = store.full_key("k");
        let put = store.bucket.put_object(Some(&*store.credentials), &full);
        let evil = move || -> futures::future::BoxFuture<'static, anyhow::Result<ReqBody>> {
            Box::pin(async { Ok(full_body(Bytes::from_static(b"evil"))) })
        };
        let mut call = Call::streamed("put", put, &evil, 4, IDLE);
        call.headers = vec![("content-md5", content_md5(b"good"))];
        match store.send("k", call).await {
            Err(Error::Status { status: 400, .. }) => {}
            other => panic!("an altered body must be refused: {other:?}"),
        }
        assert_eq!(store.get_bytes("k", 16).await.expect("get"), None);
        store
            .put_bytes("k", Bytes::from_static(b"good"))
            .await
            .expect("the signed body itself goes up");
        assert_eq!(
            store.get_bytes("k", 16).await.expect("get").as_deref(),
            Some(&b"good"[..])
        );
    }
}
