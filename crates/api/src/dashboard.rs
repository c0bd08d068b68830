//! The web dashboard under `/dashboard`: a few static files (HTML, CSS, vanilla JS) compiled
//! into the binary. The page signs in with a team API key and calls the same REST endpoints
//! the SDKs do, from the same origin, sending the key in `X-API-Key`; it has no endpoint of its
//! own and so no power a team key lacks.
//!
//! Every answer here carries a self-only `Content-Security-Policy` and `X-Frame-Options: DENY`,
//! so the page runs no script it did not ship and cannot be framed.

use axum::extract::Path;
use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

use crate::error::ApiError;

/// What the browser may load: this origin only, no inline script or style, no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
     style-src 'self'; img-src 'self'; connect-src 'self'; object-src 'none'; \
     base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// A file of the dashboard: its name under `/dashboard/`, type and contents.
struct Asset {
    name: &'static str,
    content_type: &'static str,
    body: &'static [u8],
}

const ASSETS: &[Asset] = &[
    Asset {
        name: "index.html",
        content_type: "text/html; charset=utf-8",
        body: include_bytes!("../dashboard/index.html"),
    },
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        body: include_bytes!("../dashboard/app.css"),
    },
    Asset {
        name: "chart.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../dashboard/chart.js"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_bytes!("../dashboard/app.js"),
    },
    Asset {
        name: "icon.svg",
        content_type: "image/svg+xml",
        body: include_bytes!("../dashboard/icon.svg"),
    },
];

/// The dashboard's routes; they need no state, so they merge into any router.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/dashboard",
            get(|| async { Redirect::permanent("/dashboard/") }),
        )
        .route("/dashboard/", get(|| async { serve("index.html") }))
        .route(
            "/dashboard/{name}",
            get(|Path(name): Path<String>| async move { serve(&name) }),
        )
        .layer(axum::middleware::map_response(secure))
}

fn serve(name: &str) -> Response {
    match ASSETS.iter().find(|a| a.name == name) {
        Some(a) => ([(header::CONTENT_TYPE, a.content_type)], a.body).into_response(),
        None => ApiError::not_found(format!("the dashboard has no file {name:?}")).into_response(),
    }
}

/// Adds the security headers to every dashboard answer, errors and redirects included.
async fn secure(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    let set = [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-cache"),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn text(name: &str) -> &'static str {
        let a = ASSETS
            .iter()
            .find(|a| a.name == name)
            .unwrap_or_else(|| panic!("no asset {name}"));
        std::str::from_utf8(a.body).unwrap_or_else(|e| panic!("{name} is not UTF-8: {e}"))
    }

    #[test]
    fn scripts_never_parse_data_as_html() {
        for name in ["app.js", "chart.js"] {
            let js = text(name);
            for sink in [
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
                "new Function",
            ] {
                assert!(!js.contains(sink), "{name} uses {sink}");
            }
        }
    }

    #[test]
    fn the_page_has_no_inline_script_or_style() {
        let html = text("index.html");
        for (i, _) in html.match_indices("<script") {
            let tag = &html[i..i + html[i..].find('>').unwrap_or(0)];
            assert!(tag.contains(" src="), "inline script: {tag}");
        }
        assert!(!html.contains("<style"), "inline <style>");
        assert!(!html.contains("style=\""), "inline style attribute");
        let lower = html.to_ascii_lowercase();
        for (i, _) in lower.match_indices(" on") {
            let name: String = lower[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_alphabetic())
                .collect();
            let after = &lower[i + 1 + name.len()..];
            assert!(
                !(name.len() > 2 && after.starts_with('=')),
                "inline event handler {name}"
            );
        }
    }

    #[test]
    fn the_key_stays_out_of_urls() {
        let js = text("app.js");
        assert!(
            js.contains("sessionStorage"),
            "the key lives in sessionStorage"
        );
        assert!(
            !js.contains("localStorage"),
            "the key must not outlive the tab"
        );
        // The sign-in form posts (if script fails) rather than putting the key in a query.
        let html = text("index.html");
        assert!(html.contains("id=\"signin\" method=\"post\""));
    }
}
