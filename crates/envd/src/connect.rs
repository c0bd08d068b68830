//! A small server side of the Connect protocol (JSON codec only), on hyper.
//!
//! Unary calls are plain JSON bodies; streams are envelopes (flag byte, 4-byte big-endian length,
//! payload) with a final end-stream envelope carrying the error, if any. Every envelope is handed to
//! hyper as its own frame, so it leaves as soon as it exists. Every message is size-bound.

use std::convert::Infallible;
use std::fmt;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full, Limited, StreamBody};
use hyper::body::Incoming;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;

/// Largest message (unary body or one envelope) accepted from a client.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// The response body of every route.
pub type Body = UnsyncBoxBody<Bytes, std::io::Error>;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    Empty::new()
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// A body fed by a channel: each `Bytes` sent becomes one frame, written out at once.
pub fn channel_body(rx: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Body {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item.map(Frame::data), rx))
    });
    StreamBody::new(stream).boxed_unsync()
}

/// Connect error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// HTTP status of a unary error, as the Connect protocol maps it.
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An RPC failure as the client will see it.
#[derive(Debug, Clone)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for ConnectError {}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// Maps an OS error met while doing `what` to the code a client can act on.
    pub fn from_io(err: &std::io::Error, what: impl fmt::Display) -> Self {
        let code = match err.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => Code::NotFound,
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => Code::PermissionDenied,
            Some(libc::EEXIST) | Some(libc::ENOTEMPTY) => Code::AlreadyExists,
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Code::ResourceExhausted,
            Some(libc::EINVAL)
            | Some(libc::EISDIR)
            | Some(libc::ENAMETOOLONG)
            | Some(libc::ELOOP) => Code::InvalidArgument,
            _ => Code::Internal,
        };
        Self::new(code, format!("{what}: {err}"))
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }

    /// The error as a unary response.
    pub fn into_response(self) -> Response<Body> {
        json_response(self.code.http_status(), &self.to_json())
    }
}

pub fn json_response<T: Serialize>(status: StatusCode, value: &T) -> Response<Body> {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// The kind of an RPC, which decides how its body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unary,
    ServerStream,
    ClientStream,
}

/// Checks the content type and encodings a request declares against the RPC kind.
pub fn check_request_headers(kind: Kind, headers: &HeaderMap) -> Result<(), Response<Body>> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let want = match kind {
        Kind::Unary => "application/json",
        Kind::ServerStream | Kind::ClientStream => "application/connect+json",
    };
    if ct != want {
        let mut resp = ConnectError::new(
            Code::Unimplemented,
            format!("unsupported content type {ct:?}: this server speaks {want}"),
        )
        .into_response();
        *resp.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return Err(resp);
    }
    let encoding_header = match kind {
        Kind::Unary => header::CONTENT_ENCODING.as_str(),
        _ => "connect-content-encoding",
    };
    if let Some(enc) = headers.get(encoding_header).and_then(|v| v.to_str().ok()) {
        if !enc.eq_ignore_ascii_case("identity") && !enc.is_empty() {
            let err = ConnectError::new(
                Code::Unimplemented,
                format!("unsupported compression {enc:?}: use identity"),
            );
            return Err(match kind {
                Kind::Unary => err.into_response(),
                _ => stream_error_response(err),
            });
        }
    }
    Ok(())
}

/// The client's deadline from `Connect-Timeout-Ms`, if any (0 or unparsable means none).
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let ms: u64 = headers
        .get("connect-timeout-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// Reads and decodes a unary request body.
pub async fn read_unary<T: DeserializeOwned>(body: Incoming) -> Result<T, ConnectError> {
    let bytes = read_bounded(body, MAX_MESSAGE_BYTES).await?;
    decode(&bytes)
}

/// A whole body of at most `limit` bytes.
async fn read_bounded<B>(body: B, limit: usize) -> Result<Bytes, ConnectError>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    Ok(Limited::new(body, limit)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ConnectError::new(
                    Code::ResourceExhausted,
                    format!("message larger than {limit} bytes"),
                )
            } else {
                ConnectError::new(Code::Canceled, format!("reading request body: {e}"))
            }
        })?
        .to_bytes())
}

/// Decodes one JSON message; an empty body is the empty message.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ConnectError> {
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|e| ConnectError::invalid(format!("invalid message: {e}")))
}

/// Encodes a successful unary response.
pub fn unary_response<T: Serialize>(result: Result<T, ConnectError>) -> Response<Body> {
    match result {
        Ok(msg) => json_response(StatusCode::OK, &msg),
        Err(e) => e.into_response(),
    }
}

const FLAG_COMPRESSED: u8 = 0x01;
const FLAG_END_STREAM: u8 = 0x02;

fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(5 + payload.len());
    buf.put_u8(flags);
    buf.put_u32(payload.len() as u32);
    buf.put_slice(payload);
    buf.freeze()
}

fn end_stream_payload(result: &Result<(), ConnectError>) -> Vec<u8> {
    let v = match result {
        Ok(()) => serde_json::json!({}),
        Err(e) => serde_json::json!({ "error": e.to_json() }),
    };
    serde_json::to_vec(&v).unwrap_or_else(|_| b"{}".to_vec())
}

/// Reads enveloped messages from a streaming request body, one at a time, bounded in size.
pub struct EnvelopeReader<B = Incoming> {
    body: B,
    buf: BytesMut,
    /// Largest payload accepted (`MAX_MESSAGE_BYTES`).
    limit: usize,
}

impl<B> EnvelopeReader<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: fmt::Display,
{
    pub fn new(body: B) -> Self {
        Self {
            body,
            buf: BytesMut::new(),
            limit: MAX_MESSAGE_BYTES,
        }
    }

    /// The next message's payload; `None` at a clean end of the body.
    pub async fn next(&mut self) -> Result<Option<Bytes>, ConnectError> {
        loop {
            if self.buf.len() >= 5 {
                let flags = self.buf[0];
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if len > self.limit {
                    return Err(ConnectError::new(
                        Code::ResourceExhausted,
                        format!("message of {len} bytes is larger than {}", self.limit),
                    ));
                }
                if flags & FLAG_COMPRESSED != 0 {
                    return Err(ConnectError::new(
                        Code::Unimplemented,
                        "compressed messages are not supported",
                    ));
                }
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    let payload = self.buf.split_to(len).freeze();
                    if flags & FLAG_END_STREAM != 0 {
                        return Ok(None);
                    }
                    return Ok(Some(payload));
                }
            }
            match self.body.frame().await {
                None => {
                    return if self.buf.is_empty() {
                        Ok(None)
                    } else {
                        Err(ConnectError::invalid(
                            "request body ends inside an envelope",
                        ))
                    };
                }
                Some(Err(e)) => {
                    return Err(ConnectError::new(
                        Code::Canceled,
                        format!("reading request: {e}"),
                    ))
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    /// Reads the rest of the body and drops it: at most `limit` bytes, for at most `within`.
    /// A server-streaming request holds one message, but a client that streams its body
    /// (chunked) ends it a moment after; hyper reuses the connection for the next request
    /// only once this request's body is read to its end, and otherwise closes it just after
    /// the response, a close a client that kept the connection (the proxy) can meet with
    /// its next request already sent.
    pub async fn drain(mut self, limit: usize, within: Duration) {
        let _ = tokio::time::timeout(within, async {
            let mut read = self.buf.len();
            while read <= limit {
                match self.body.frame().await {
                    Some(Ok(frame)) => {
                        read += frame.data_ref().map_or(0, |d| d.len());
                    }
                    Some(Err(_)) | None => return,
                }
            }
        })
        .await;
    }

    /// The next message, decoded.
    pub async fn next_message<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ConnectError> {
        match self.next().await? {
            None => Ok(None),
            Some(payload) => decode(&payload).map(Some),
        }
    }
}

#[cfg(test)]
#[path = "connect_fuzz.rs"]
pub(crate) mod fuzz;

/// The sending half of a streaming response.
pub struct StreamSender {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
}

/// The client went away; stop producing.
#[derive(Debug)]
pub struct Disconnected;

impl StreamSender {
    pub async fn send<T: Serialize>(&self, msg: &T) -> Result<(), Disconnected> {
        let payload = serde_json::to_vec(msg).map_err(|_| Disconnected)?;
        self.tx
            .send(Ok(envelope(0, &payload)))
            .await
            .map_err(|_| Disconnected)
    }

    /// Ends the stream with the end-stream envelope.
    pub async fn finish(self, result: Result<(), ConnectError>) {
        let payload = end_stream_payload(&result);
        let _ = self.tx.send(Ok(envelope(FLAG_END_STREAM, &payload))).await;
    }

    /// Resolves when the client stops reading the response.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// A streaming response and the sender that feeds it.
pub fn stream_response() -> (Response<Body>, StreamSender) {
    let (tx, rx) = mpsc::channel(16);
    let mut resp = Response::new(channel_body(rx));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    (resp, StreamSender { tx })
}

/// A streaming response that only carries an error.
pub fn stream_error_response(err: ConnectError) -> Response<Body> {
    let payload = end_stream_payload(&Err(err));
    let mut resp = Response::new(full(envelope(FLAG_END_STREAM, &payload)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    resp
}

/// A client-streaming RPC's single response: one message envelope and the end-stream envelope.
pub fn client_stream_response<T: Serialize>(result: Result<T, ConnectError>) -> Response<Body> {
    match result {
        Ok(msg) => {
            let payload = serde_json::to_vec(&msg).unwrap_or_else(|_| b"{}".to_vec());
            let mut buf = BytesMut::new();
            buf.extend_from_slice(&envelope(0, &payload));
            buf.extend_from_slice(&envelope(FLAG_END_STREAM, &end_stream_payload(&Ok(()))));
            let mut resp = Response::new(full(buf.freeze()));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/connect+json"),
            );
            resp
        }
        Err(e) => stream_error_response(e),
    }
}
