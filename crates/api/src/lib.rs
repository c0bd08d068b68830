//! vmon-api: the control plane's HTTP side. The E2B REST surface ([`router`], [`http`] and the
//! route modules), auth by hashed API keys and the admin token (`state.rs`), the JSON it
//! answers (`wire.rs`, `views.rs`), the one mapping of domain errors to statuses
//! (`error.rs`), the OpenAPI document and the dashboard. The domain (state machine, records,
//! template builds, volumes, leader duties) is `vmon-control`, re-exported here as
//! [`control`], [`config`], [`ids`] and [`records`].
//!
//! It talks to hosts only through [`vmon_proto::node::NodeControl`] and to envd never. It
//! must never start a VM, touch a layer file or answer for a guest.

pub mod admin;
pub mod dashboard;
pub mod error;
pub mod events;
pub mod http;
pub mod openapi;
pub mod secrets;
pub mod state;
pub mod telemetry;
pub mod templates;
pub mod views;
pub mod volumes;
pub mod wire;

use std::sync::Arc;

// The domain (`crates/control`) under the paths the routes have always used.
pub use vmon_control as control;
pub use vmon_control::{config, ids, records};

pub use config::Config;
pub use control::{Control, ProxyRoutes};
pub use error::{ApiError, ApiResult};

/// The whole route table: the sandbox routes ([`http`]) and every other module's, the
/// transition metrics around the first group, the JSON error body on every answer.
pub fn router(state: state::AppState) -> axum::Router {
    axum::Router::new()
        .merge(http::routes())
        .merge(templates::routes())
        .merge(admin::routes())
        .merge(telemetry::routes())
        .layer(axum::middleware::from_fn(telemetry::track_transitions))
        .merge(events::routes())
        .merge(volumes::routes())
        .merge(secrets::routes())
        .merge(dashboard::routes())
        .merge(openapi::routes())
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(axum::middleware::map_response(error::json_errors))
        .with_state(state)
}

/// Serves the REST API on `listener` until `cancel` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    control: Arc<Control>,
    admin_token: Option<String>,
    cancel: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    serve_with(listener, control, admin_token, None, cancel).await
}

/// [`serve`], over TLS only when `tls` is given (`api_tls_cert`).
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    control: Arc<Control>,
    admin_token: Option<String>,
    tls: Option<Arc<rustls::ServerConfig>>,
    cancel: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let app = router(state::AppState {
        control,
        admin_token,
    });
    // The same accept loop as the proxy's: a connection cap and a header-read timeout.
    let service = hyper_util::service::TowerToHyperService::new(app);
    let limits = vmon_proxy::listen::Limits::default();
    match tls {
        None => vmon_proxy::listen::serve(listener, limits, cancel, "api", service).await,
        Some(tls) => {
            vmon_proxy::listen::serve_tls_only(listener, limits, tls, cancel, "api", service).await
        }
    }
    Ok(())
}
