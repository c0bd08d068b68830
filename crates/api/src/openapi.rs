//! The OpenAPI 3.1 document of everything the api serves, generated from the handlers'
//! `#[utoipa::path]` attributes and the wire types' `ToSchema` derives: `GET /openapi.json`,
//! and `GET /docs`, a small page (no inline script, no CDN) that lists the operations.
//!
//! `tests/openapi.rs` walks the real router and fails when a served path and method is
//! missing here or this lists one that is not served.

use std::sync::OnceLock;

use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, SecurityScheme};
use utoipa::openapi::{Content, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use crate::{admin, events, http, secrets, telemetry, templates, volumes};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "vmon",
        description = "The vmon control plane: E2B's sandbox REST API and vmon's own \
            (admin, lifecycle events and webhooks, telemetry). Team routes authenticate with \
            `X-API-Key`, operator routes with `X-Admin-Token`. Every error answers \
            `{\"code\": <status>, \"message\": \"...\"}`."
    ),
    paths(
        health,
        openapi_json,
        docs_page,
        docs_script,
        dashboard_root,
        dashboard_index,
        dashboard_file,
        http::create_legacy,
        http::list_legacy,
        http::create_v2,
        http::list_v2,
        http::get_sandbox,
        http::sandbox_health,
        http::kill,
        http::set_timeout,
        http::refresh,
        http::pause,
        http::resume,
        http::connect_legacy,
        http::connect_v2,
        http::fork,
        http::snapshot,
        http::update_network,
        http::list_snapshots,
        templates::request::legacy,
        templates::request::legacy_v2,
        templates::request::request_build,
        templates::request::start_build,
        templates::status::status,
        templates::status::logs,
        templates::request::files_probe,
        templates::files::upload,
        templates::tags::alias,
        templates::tags::assign_tags,
        templates::tags::remove_tags,
        templates::tags::tags_of,
        templates::catalog::list,
        templates::catalog::list_v2,
        templates::catalog::get_template,
        templates::catalog::patch_v1,
        templates::catalog::patch_v2,
        templates::catalog::delete,
        admin::create_team,
        admin::list_teams,
        admin::create_key,
        admin::list_keys,
        admin::revoke_key,
        admin::list_sandboxes,
        admin::list_nodes,
        admin::drain_node,
        admin::drain_status,
        admin::undrain_node,
        admin::migrate_sandbox,
        admin::kill_sandbox,
        admin::route,
        admin::resume_route,
        admin::report_activity,
        events::team_events,
        events::sandbox_events,
        events::list_webhooks,
        events::create_webhook,
        events::get_webhook,
        events::patch_webhook,
        events::delete_webhook,
        events::deliveries,
        events::stats,
        telemetry::prometheus,
        telemetry::batch_metrics,
        telemetry::sandbox_metrics,
        telemetry::logs_v1,
        telemetry::logs_v2,
        telemetry::admin_logs,
        volumes::create_volume,
        volumes::list_volumes,
        volumes::get_volume,
        volumes::delete_volume,
        volumes::content::list_dir,
        volumes::content::make_dir,
        volumes::content::stat_path,
        volumes::content::patch_path,
        volumes::content::remove_path,
        volumes::content::read_file,
        volumes::content::write_file,
        secrets::create_secret,
        secrets::list_secrets,
        secrets::get_secret,
        secrets::update_secret,
        secrets::delete_secret,
    ),
    components(schemas(crate::wire::ErrorBody)),
    modifiers(&Conventions),
    tags(
        (name = "sandboxes", description = "E2B: create, list, pause, resume, fork, kill"),
        (name = "snapshots", description = "E2B: snapshots of sandboxes"),
        (name = "templates", description = "E2B: templates"),
        (name = "telemetry", description = "Guest metrics, console logs, platform metrics"),
        (name = "events", description = "Sandbox lifecycle events"),
        (name = "webhooks", description = "Lifecycle events pushed to the team's URLs"),
        (name = "volumes", description = "E2B: named persistent volumes (`/volumes`, `X-API-Key`) and their files (`/volumecontent`, `Authorization: Bearer <volume token>`; errors carry a string `code`)"),
        (name = "secrets", description = "E2B: team secrets; values go in and never come out"),
        (name = "admin", description = "The operator's routes (`X-Admin-Token`)"),
        (name = "meta", description = "Health and this document"),
        (name = "dashboard", description = "The web dashboard's static files"),
    )
)]
struct ApiDoc;

/// The security schemes, and the errors every operation may answer: 401 where a credential
/// is required, 500 everywhere.
struct Conventions;

impl Modify for Conventions {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "ApiKeyAuth",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-API-Key",
                "A team's API key",
            ))),
        );
        components.add_security_scheme(
            "AdminToken",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-Admin-Token",
                "The operator's token (`admin-token` in vmon's data dir)",
            ))),
        );
        components.add_security_scheme(
            "MetricsToken",
            SecurityScheme::Http({
                let mut http = utoipa::openapi::security::Http::new(
                    utoipa::openapi::security::HttpAuthScheme::Bearer,
                );
                http.description = Some(
                    "`GET /metrics` only: the admin token or the config's `metrics_token`"
                        .to_string(),
                );
                http
            }),
        );
        components.add_security_scheme(
            "VolumeToken",
            SecurityScheme::Http({
                let mut http = utoipa::openapi::security::Http::new(
                    utoipa::openapi::security::HttpAuthScheme::Bearer,
                );
                http.description = Some(
                    "A volume's content token (`token` of `GET /volumes/{volumeID}`), for that \
                     volume only, until it expires"
                        .to_string(),
                );
                http
            }),
        );
        // The volume content plane's errors carry a string `code` (E2B's volumecontent spec).
        let error = |path: &str, description: &str| {
            let schema = if path.starts_with("/volumecontent/") {
                "ContentError"
            } else {
                "ErrorBody"
            };
            RefOr::T(
                ResponseBuilder::new()
                    .description(description)
                    .content(
                        "application/json",
                        Content::new(Some(Ref::from_schema_name(schema))),
                    )
                    .build(),
            )
        };
        for (path, item) in doc.paths.paths.iter_mut() {
            let ops = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ];
            for op in ops.into_iter().flatten() {
                let secured = op.security.as_ref().is_some_and(|s| !s.is_empty());
                let responses = &mut op.responses.responses;
                if secured {
                    responses
                        .entry("401".to_string())
                        .or_insert_with(|| error(path, "Missing or invalid credential"));
                }
                responses
                    .entry("500".to_string())
                    .or_insert_with(|| error(path, "Internal error"));
            }
        }
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

fn document_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| {
        serde_json::to_value(document())
            .map(|mut doc| {
                unsigned_formats(&mut doc);
                doc
            })
            .and_then(|doc| serde_json::to_string_pretty(&doc))
            .unwrap_or_else(|e| format!("{{\"error\": \"serializing the document: {e}\"}}"))
    })
}

/// Unsigned fields are documented as what serde takes (`non_strict_integers`: a u32 is not an
/// `int32`, whose range ends at 2^31 - 1), spelled `uint32`, `uint64`, … (utoipa writes
/// `u-int32`).
fn unsigned_formats(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            if let Some(serde_json::Value::String(f)) = map.get_mut("format") {
                if let Some(bits) = f.strip_prefix("u-int") {
                    *f = format!("uint{bits}");
                }
            }
            map.values_mut().for_each(unsigned_formats);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(unsigned_formats),
        _ => {}
    }
}

/// `/openapi.json`, `/docs` and its script; they need no state.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/openapi.json", get(openapi_json))
        .route("/docs", get(docs_page))
        .route("/docs/docs.js", get(docs_script))
}

fn secured(content_type: &'static str, body: &'static [u8]) -> Response {
    let mut resp = ([(header::CONTENT_TYPE, content_type)], body).into_response();
    let h = resp.headers_mut();
    let set = [
        (
            header::CONTENT_SECURITY_POLICY,
            crate::dashboard::CONTENT_SECURITY_POLICY,
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (
            HeaderName::from_static("cross-origin-opener-policy"),
            "same-origin",
        ),
    ];
    for (name, value) in set {
        h.insert(name, HeaderValue::from_static(value));
    }
    resp
}

#[utoipa::path(
    get, path = "/openapi.json", tag = "meta",
    summary = "This document",
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json", body = Object))
)]
async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        document_json(),
    )
        .into_response()
}

#[utoipa::path(
    get, path = "/docs", tag = "meta",
    summary = "This document as a page",
    responses((status = 200, description = "HTML", content_type = "text/html", body = String))
)]
async fn docs_page() -> Response {
    secured("text/html; charset=utf-8", DOCS_HTML.as_bytes())
}

#[utoipa::path(
    get, path = "/docs/docs.js", tag = "meta",
    summary = "The script of the docs page",
    responses((status = 200, description = "JavaScript", content_type = "text/javascript", body = String))
)]
async fn docs_script() -> Response {
    secured("text/javascript; charset=utf-8", DOCS_JS.as_bytes())
}

const DOCS_HTML: &str = include_str!("../docs/index.html");
const DOCS_JS: &str = include_str!("../docs/docs.js");

// Routes served by closures elsewhere (`http::routes`, `dashboard::routes`): described here.

/// `GET /health` (a closure in [`http::routes`]).
#[utoipa::path(
    get, path = "/health", tag = "meta",
    summary = "Whether the platform takes creates",
    responses(
        (status = 200, description = "Ready: `{\"status\": \"ready\", …}`; creates are admitted",
         body = serde_json::Value),
        (status = 503, description = "The first build is running (`status` `building`, or `failed` while it waits to be retried), with its step, percent and time elapsed",
         body = crate::wire::ErrorBody),
    )
)]
#[allow(dead_code)]
fn health() {}

#[utoipa::path(
    get, path = "/dashboard", tag = "dashboard",
    summary = "Redirects to `/dashboard/`",
    responses((status = 308, description = "Redirect to `/dashboard/`"))
)]
#[allow(dead_code)]
fn dashboard_root() {}

#[utoipa::path(
    get, path = "/dashboard/", tag = "dashboard",
    summary = "The dashboard's page",
    responses((status = 200, description = "HTML", content_type = "text/html", body = String))
)]
#[allow(dead_code)]
fn dashboard_index() {}

#[utoipa::path(
    get, path = "/dashboard/{name}", tag = "dashboard",
    summary = "A file of the dashboard",
    params(("name" = String, Path, description = "The file's name")),
    responses(
        (status = 200, description = "The file", content(
            (String = "text/html"), (String = "text/css"), (String = "text/javascript"),
            (String = "image/svg+xml"),
        )),
        (status = 404, description = "No such file", body = crate::wire::ErrorBody),
    )
)]
#[allow(dead_code)]
fn dashboard_file() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_serializes_and_names_both_credentials() {
        let doc: serde_json::Value =
            serde_json::from_str(document_json()).expect("the document is JSON");
        let schemes = &doc["components"]["securitySchemes"];
        assert_eq!(schemes["ApiKeyAuth"]["name"], "X-API-Key");
        assert_eq!(schemes["AdminToken"]["name"], "X-Admin-Token");
        assert!(doc["components"]["schemas"]["ErrorBody"].is_object());
    }

    #[test]
    fn the_page_has_no_inline_script() {
        for (i, _) in DOCS_HTML.match_indices("<script") {
            let tag = &DOCS_HTML[i..i + DOCS_HTML[i..].find('>').unwrap_or(0)];
            assert!(tag.contains(" src="), "inline script: {tag}");
        }
        assert!(
            !DOCS_JS.contains("innerHTML"),
            "docs.js parses data as HTML"
        );
    }
}
