//! What a control operation fails with, in the domain's words. The api gives each kind its
//! HTTP status and `{code, message}` in one place (`crates/api/src/error.rs`,
//! `impl From<ControlError> for ApiError`); nothing here knows HTTP.

use vmon_kv::KvError;
use vmon_proto::node::NodeError;

pub type ControlResult<T> = Result<T, ControlError>;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The request names something malformed, out of range or not allowed.
    #[error("{0}")]
    Invalid(String),
    /// A signed URL whose signature or expiry does not hold.
    #[error("{0}")]
    BadSignature(String),
    #[error("{0}")]
    NotFound(String),
    /// No such sandbox, or another team's (the two are not told apart).
    #[error("sandbox \"{0}\" doesn't exist or you don't have access to it")]
    SandboxNotFound(String),
    /// The object's state forbids the operation, another operation holds it, or it changed
    /// meanwhile.
    #[error("{0}")]
    Conflict(String),
    /// A team limit is reached (concurrent sandboxes, template files).
    #[error("{0}")]
    Limit(String),
    /// The team's stored bytes would pass its quota.
    #[error("{0}")]
    Quota(String),
    /// Something this operation needs is not ready or has no room now.
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
    /// A node call failed; its kind says whose fault.
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("the coordination store failed: {0}")]
    Kv(#[source] KvError),
    #[error("the record store failed: {0:#}")]
    Records(#[source] anyhow::Error),
}

/// Constructors under the names the handlers' errors had, so a message reads the same.
impl ControlError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::NotFound(message.into())
    }
    pub fn sandbox_not_found(id: &str) -> Self {
        Self::SandboxNotFound(id.to_string())
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::Conflict(message.into())
    }
    pub fn too_many(message: impl Into<String>) -> Self {
        Self::Limit(message.into())
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::Internal(message.into())
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::Unavailable(message.into())
    }

    /// The thing is gone (no such sandbox, template or build).
    pub fn is_not_found(&self) -> bool {
        matches!(
            self,
            Self::NotFound(_)
                | Self::SandboxNotFound(_)
                | Self::Node(NodeError::NotFound(_) | NodeError::BuildNotFound(_))
        )
    }

    /// The thing is in another state or held by another operation.
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            Self::Conflict(_) | Self::Node(NodeError::BuildInUse(_))
        )
    }
}
