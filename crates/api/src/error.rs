//! Errors as the E2B API answers them: `{"code": <status>, "message": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

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

impl From<vmon_proto::node::NodeError> for ApiError {
    fn from(e: vmon_proto::node::NodeError) -> Self {
        use vmon_proto::node::NodeError as E;
        match &e {
            E::NotFound(_) | E::BuildNotFound(_) => Self::not_found(e.to_string()),
            E::BuildInUse(_) => Self::conflict(e.to_string()),
            E::InvalidArgument(_) => Self::bad_request(e.to_string()),
            E::Exhausted(_) => Self::unavailable(e.to_string()),
            E::Failed(_) => Self::internal(e.to_string()),
        }
    }
}
