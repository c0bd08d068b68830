//! envd: the in-guest agent, wire-compatible with E2B's envd (Connect RPC + JSON, `/files` HTTP).
//!
//! The SDKs talk to it directly: `process.Process` and `filesystem.Filesystem` over the Connect
//! protocol, files over plain HTTP, and the node configures it through `/init`. It also serves as
//! the guest's PID 1 (`init`, owned separately).
//!
//! It must never trust its caller beyond what the access token and the requesting user's
//! permissions allow: envd runs as root, but processes run as the requesting user and file work
//! is done with that user's filesystem identity, never as root on the user's behalf.

// HTTP handlers return a ready response as their error; it is built once per failed request.
#![allow(clippy::result_large_err)]

pub mod agent;
pub mod auth;
pub mod connect;
pub mod control;
pub mod files;
pub mod filesystem;
pub mod init;
pub mod keepalive;
pub mod metrics;
pub mod process;
pub mod rpc;
pub mod server;
pub mod user;

/// The envd version reported to the SDKs; its feature set matches upstream envd 0.6.4, the
/// newest feature gate the SDKs check.
pub const ENVD_VERSION: &str = "0.6.4";

/// Default listen port of envd (the SDKs' `envd_port`).
pub const DEFAULT_PORT: u16 = 49983;

/// How the server starts; `/init` may change the user and token later.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The user requests act as when they name none (upstream: `user`).
    pub default_user: String,
    /// Token required in `X-Access-Token` from the start, if any.
    pub access_token: Option<String>,
    /// A file rewritten after every `/init` (the guest's init passes [`init::INIT_MARKER`]).
    pub init_marker: Option<std::path::PathBuf>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            default_user: "user".to_string(),
            access_token: None,
            init_marker: None,
        }
    }
}

/// Serves the envd API on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, opts: ServeOptions) -> anyhow::Result<()> {
    user::remember_own_groups();
    control::open_random_dev();
    let agent = agent::Agent::new(
        opts.default_user,
        opts.access_token.filter(|t| !t.is_empty()),
        opts.init_marker,
    );
    tracing::info!(
        logger = "envd",
        version = ENVD_VERSION,
        addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        "envd listening"
    );
    server::run(listener, agent).await
}
