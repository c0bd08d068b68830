//! The dashboard's files through the api's whole router: where they are, their types, and the
//! headers that keep the page from running foreign script or being framed.

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use axum::http::StatusCode;
use common::harness;
use vmon_api::records::TeamLimits;

fn limits() -> TeamLimits {
    TeamLimits {
        max_concurrent: 5,
        ..TeamLimits::default()
    }
}

fn header<'a>(r: &'a common::Reply, name: &str) -> &'a str {
    r.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no {name} header"))
}

fn assert_secured(r: &common::Reply) {
    assert_eq!(header(r, "x-frame-options"), "DENY");
    assert_eq!(
        header(r, "content-security-policy"),
        vmon_api::dashboard::CONTENT_SECURITY_POLICY
    );
    let csp = header(r, "content-security-policy");
    assert!(csp.contains("default-src 'self'"));
    assert!(csp.contains("frame-ancestors 'none'"));
    assert!(!csp.contains("unsafe-inline") && !csp.contains("unsafe-eval"));
    assert_eq!(header(r, "x-content-type-options"), "nosniff");
    assert_eq!(header(r, "referrer-policy"), "no-referrer");
}

#[tokio::test]
async fn the_page_and_its_files_are_served_without_a_key() {
    let h = harness(limits()).await;

    let r = h.call("GET", "/dashboard", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(header(&r, "location"), "/dashboard/");
    assert_secured(&r);

    let page = h.call("GET", "/dashboard/", None, None, &[]).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(header(&page, "content-type").starts_with("text/html"));
    assert_secured(&page);
    let html = page.json.as_str().expect("html text").to_string();
    assert!(html.contains("<title>vmon dashboard</title>"));

    for (file, kind) in [
        ("app.js", "text/javascript"),
        ("chart.js", "text/javascript"),
        ("app.css", "text/css"),
        ("icon.svg", "image/svg+xml"),
    ] {
        assert!(html.contains(file), "index.html does not load {file}");
        let r = h
            .call("GET", &format!("/dashboard/{file}"), None, None, &[])
            .await;
        assert_eq!(r.status, StatusCode::OK, "{file}");
        assert!(header(&r, "content-type").starts_with(kind), "{file}");
        assert_secured(&r);
    }
}

#[tokio::test]
async fn unknown_files_are_json_404s_and_the_rest_api_is_unchanged() {
    let h = harness(limits()).await;
    let r = h
        .call("GET", "/dashboard/../admin/keys", None, None, &[])
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h
        .call("GET", "/dashboard/secrets.txt", None, None, &[])
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json["code"], 404);
    assert!(r.json["message"]
        .as_str()
        .is_some_and(|m| m.contains("secrets.txt")));
    assert_secured(&r);

    // The dashboard's headers stay on its own routes; the REST API answers as before.
    let r = h.req("GET", "/v2/sandboxes", None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers.get("content-security-policy").is_none());
    let r = h.call("GET", "/v2/sandboxes", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}
