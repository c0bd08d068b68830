//! The OpenAPI document cannot drift from the router: every path and method the real router
//! serves is in `GET /openapi.json`, and everything the document lists is served.
//!
//! The served routes are read from the router itself (axum 0.8's `Debug` of a `Router` lists
//! each route id's path and which methods its `MethodRouter` has). That format is not a
//! stable API, so the parse fails loudly when it finds nothing it recognises, and a second,
//! behavioural check sends every documented operation to the router and expects neither the
//! fallback's 404 nor a 405.

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use axum::http::StatusCode;
use common::harness;
use vmon_api::records::TeamLimits;

type Op = (String, String);

/// `/sandboxes/{id}`, `/templates/{*id}` and `/sandboxes/{sandboxID}` all become
/// `/sandboxes/{}`: parameter names may differ between the router and the document.
fn normalize(path: &str) -> String {
    path.split('/')
        .map(|seg| if seg.starts_with('{') { "{}" } else { seg })
        .collect::<Vec<_>>()
        .join("/")
}

/// The number after each `RouteId(` in `text`, with the text up to the next one.
fn by_route_id(text: &str) -> Vec<(u32, &str)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("RouteId(") {
        rest = &rest[i + "RouteId(".len()..];
        let Some(close) = rest.find(')') else { break };
        let Ok(id) = rest[..close].parse::<u32>() else {
            continue;
        };
        let end = rest.find("RouteId(").unwrap_or(rest.len());
        out.push((id, &rest[close + 1..end]));
    }
    out
}

const METHODS: [&str; 9] = [
    "get", "head", "delete", "options", "patch", "post", "put", "trace", "connect",
];

/// (method, normalized path) of every route the router serves, from its `Debug` form.
fn served(router: &axum::Router) -> BTreeSet<Op> {
    let dbg = format!("{router:?}");
    let (main, _) = dbg
        .split_once("fallback_router:")
        .expect("axum's Router Debug has no fallback_router field: update this parser");
    let (routes, nodes) = main
        .split_once("node: Node")
        .expect("axum's PathRouter Debug has no node field: update this parser");
    let paths: std::collections::HashMap<u32, String> = by_route_id(nodes)
        .into_iter()
        .map(|(id, text)| {
            let text = text.trim_start_matches(':').trim();
            let quoted = text
                .strip_prefix('"')
                .and_then(|t| t.split_once('"'))
                .map(|(p, _)| p.to_string())
                .unwrap_or_else(|| panic!("route {id} has no quoted path: {text}"));
            (id, quoted)
        })
        .collect();
    assert!(paths.len() > 10, "parsed too few paths from {dbg}");
    let mut out = BTreeSet::new();
    for (id, endpoint) in by_route_id(routes) {
        let path = paths
            .get(&id)
            .unwrap_or_else(|| panic!("route {id} has no path"));
        let endpoint = endpoint.trim_start_matches(':').trim();
        assert!(
            endpoint.starts_with("MethodRouter("),
            "{path} is served by a service, not a MethodRouter; its methods cannot be read: \
             {endpoint}"
        );
        let mut any = false;
        for m in METHODS {
            let field = format!(" {m}: ");
            let at = endpoint
                .find(&field)
                .unwrap_or_else(|| panic!("no {m} field in {endpoint}"));
            let value = &endpoint[at + field.len()..];
            if !value.starts_with("None") {
                // `get` also answers HEAD; an explicit HEAD route would still be listed.
                out.insert((m.to_string(), normalize(path)));
                any = true;
            }
        }
        assert!(any, "{path} serves no method: {endpoint}");
    }
    out
}

fn documented(doc: &serde_json::Value) -> BTreeSet<Op> {
    let mut out = BTreeSet::new();
    let paths = doc["paths"].as_object().expect("paths");
    for (path, item) in paths {
        for m in METHODS {
            if item.get(m).is_some() {
                out.insert((m.to_string(), normalize(path)));
            }
        }
    }
    out
}

fn limits() -> TeamLimits {
    TeamLimits::default()
}

#[tokio::test]
async fn the_document_lists_exactly_the_served_routes() {
    let h = harness(limits()).await;
    let r = h.call("GET", "/openapi.json", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["openapi"], "3.1.0", "{:?}", r.json);
    let doc = r.json;

    let served = served(&h.router);
    let documented = documented(&doc);
    // `get` also answers HEAD; the document lists the GET.
    let served: BTreeSet<Op> = served
        .into_iter()
        .filter(|(m, p)| !(m == "head" && documented.contains(&("get".to_string(), p.clone()))))
        .collect();
    let missing: Vec<_> = served.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&served).collect();
    assert!(
        missing.is_empty(),
        "served but not in /openapi.json (add #[utoipa::path] and list it in openapi.rs): \
         {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "in /openapi.json but not served: {extra:?}"
    );
    assert!(served.len() > 40, "only {} routes parsed", served.len());
}

/// The behavioural half: each documented operation reaches a route (no credentials are sent,
/// so nothing is created or changed).
#[tokio::test]
async fn every_documented_operation_is_routed() {
    let h = harness(limits()).await;
    let doc = h.call("GET", "/openapi.json", None, None, &[]).await.json;
    let ops = documented(&doc);
    assert!(ops.len() > 40);
    for (method, path) in ops {
        let concrete = path.replace("{}", "x");
        let r = h
            .call(&method.to_ascii_uppercase(), &concrete, None, None, &[])
            .await;
        assert_ne!(
            r.status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}: 405"
        );
        assert!(
            !(r.status == StatusCode::NOT_FOUND && r.json["message"] == "no such endpoint"),
            "{method} {path}: the fallback answered"
        );
    }
}

/// Every documented error answer is the E2B error shape, and every operation that takes a
/// credential says which.
#[tokio::test]
async fn errors_are_code_and_message_and_credentials_are_named() {
    let h = harness(limits()).await;
    let doc = h.call("GET", "/openapi.json", None, None, &[]).await.json;
    let error = &doc["components"]["schemas"]["ErrorBody"];
    let required: BTreeSet<&str> = error["required"]
        .as_array()
        .expect("ErrorBody.required")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert_eq!(required, BTreeSet::from(["code", "message"]));
    let content_error = &doc["components"]["schemas"]["ContentError"];
    assert_eq!(content_error["properties"]["code"]["type"], "string");
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            let responses = op["responses"].as_object().expect("responses");
            for (status, resp) in responses {
                if !status.starts_with('4') && !status.starts_with('5') {
                    continue;
                }
                // The volume content plane's error has a string code (E2B's own spec).
                let schema = if path.starts_with("/volumecontent/") {
                    "#/components/schemas/ContentError"
                } else {
                    "#/components/schemas/ErrorBody"
                };
                assert_eq!(
                    resp["content"]["application/json"]["schema"]["$ref"], schema,
                    "{method} {path} {status}"
                );
            }
            let secured = op["security"].as_array().is_some_and(|s| !s.is_empty());
            let public = ["/health", "/openapi.json"].contains(&path.as_str())
                || path.starts_with("/docs")
                || path.starts_with("/dashboard")
                // Authorized by the URL's signature: the SDK sends no key there.
                || path.starts_with("/template-files/");
            assert_eq!(secured, !public, "{method} {path}: security");
            if secured {
                assert!(responses.contains_key("401"), "{method} {path}: no 401");
            }
        }
    }
}

#[tokio::test]
async fn the_docs_page_is_served_with_its_script() {
    let h = harness(limits()).await;
    let page = h.call("GET", "/docs", None, None, &[]).await;
    assert_eq!(page.status, StatusCode::OK);
    let html = page.json.as_str().expect("html text");
    assert!(html.contains("<script src=\"/docs/docs.js\""));
    assert!(page.headers["content-security-policy"]
        .to_str()
        .expect("ascii")
        .contains("script-src 'self'"));
    let js = h.call("GET", "/docs/docs.js", None, None, &[]).await;
    assert_eq!(js.status, StatusCode::OK);
    assert!(js.json.as_str().expect("js").contains("/openapi.json"));
}
