//! Errors as the E2B API answers them: `{"code": <status>, "message": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::control::ControlError;
use crate::wire::ErrorBody;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub error_code: Option<&'static str>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            error_code: None,
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
    pub fn sandbox_not_found(id: &str) -> Self {
        Self::not_found(format!(
            "sandbox \"{id}\" doesn't exist or you don't have access to it"
        ))
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }
    pub fn too_many(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }
    /// A failure of the records store, `what` failing: 503 when the database could not be
    /// reached (the call wrote nothing; retry later or through another replica), else 500.
    pub fn records(what: &str, e: &anyhow::Error) -> Self {
        let store_error = e
            .chain()
            .find_map(|c| c.downcast_ref::<vmon_store::StoreError>());
        if let Some(vmon_store::StoreError::Unavailable(_)) = store_error {
            Self::unavailable(format!("{what}: the record store is unreachable; retry"))
        } else if let Some(vmon_store::StoreError::TimedOut(d)) = store_error {
            Self::unavailable(format!(
                "{what}: the record store did not answer within {} s (the change may or may not have been made); retry",
                d.as_secs()
            ))
        } else {
            Self::internal(format!("{what}: {e:#}"))
        }
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.error_code = Some(code);
        self
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.status.as_u16(),
            message: self.message.clone(),
            error_code: self.error_code.map(str::to_string),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), message = %self.message, "request failed");
        }
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// The one place a domain error becomes an HTTP status; the message is the error's own.
impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        use ControlError as E;
        if let E::Records(inner) = &e {
            // An unreachable PostgreSQL is a 503 (retry), any other store failure a 500.
            return Self::records("the record store failed", inner);
        }
        let status = match &e {
            E::Invalid(_) => StatusCode::BAD_REQUEST,
            E::BadSignature(_) => StatusCode::UNAUTHORIZED,
            E::NotFound(_) | E::SandboxNotFound(_) => StatusCode::NOT_FOUND,
            E::Conflict(_) => StatusCode::CONFLICT,
            E::Limit(_) => StatusCode::TOO_MANY_REQUESTS,
            E::Quota(_) => StatusCode::INSUFFICIENT_STORAGE,
            E::Unavailable(_) | E::Kv(_) => StatusCode::SERVICE_UNAVAILABLE,
            E::Internal(_) | E::Records(_) => StatusCode::INTERNAL_SERVER_ERROR,
            E::Node(n) => node_status(n),
        };
        Self::new(status, e.to_string())
    }
}

impl From<vmon_proto::node::NodeError> for ApiError {
    fn from(e: vmon_proto::node::NodeError) -> Self {
        Self::new(node_status(&e), e.to_string())
    }
}

fn node_status(e: &vmon_proto::node::NodeError) -> StatusCode {
    use vmon_proto::node::NodeError as E;
    match e {
        E::NotFound(_) | E::BuildNotFound(_) => StatusCode::NOT_FOUND,
        E::BuildInUse(_) => StatusCode::CONFLICT,
        E::InvalidArgument(_) => StatusCode::BAD_REQUEST,
        E::Exhausted(_) => StatusCode::SERVICE_UNAVAILABLE,
        E::Failed(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The most of a non-JSON error body that becomes the message.
const MAX_REJECTION_MESSAGE: usize = 1024;

/// Middleware: an error answered by axum itself rather than a handler (an extractor's
/// plain-text rejection, the empty 405 of a known path's unknown method) becomes
/// `{code, message}` like every other error. Its status and headers (e.g. `Allow`) stay.
pub async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    let text = match axum::body::to_bytes(body, MAX_REJECTION_MESSAGE * 4).await {
        Ok(b) => String::from_utf8_lossy(&b).trim().to_string(),
        Err(_) => String::new(),
    };
    let mut message: String = text.chars().take(MAX_REJECTION_MESSAGE).collect();
    if message.is_empty() {
        message = status
            .canonical_reason()
            .unwrap_or("request failed")
            .to_ascii_lowercase();
    }
    let fresh = ApiError::new(status, message).into_response();
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let (fresh_parts, fresh_body) = fresh.into_parts();
    parts.headers.extend(fresh_parts.headers);
    Response::from_parts(parts, fresh_body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_store_that_did_not_answer_is_a_503_that_says_the_change_may_be_made() {
        let e = anyhow::Error::new(vmon_store::StoreError::TimedOut(
            std::time::Duration::from_secs(20),
        ))
        .context("committing a pause");
        let a = ApiError::records("the record store failed", &e);
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(a.message.contains("within 20 s"), "{}", a.message);
        assert!(a.message.contains("may or may not"), "{}", a.message);
        let other = anyhow::anyhow!("syntax error");
        assert_eq!(
            ApiError::records("x", &other).status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
