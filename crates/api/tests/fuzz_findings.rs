//! What fuzzing the api from its OpenAPI document (tests/e2e/test_openapi.py) found, pinned
//! here so it stays fixed without a VM.

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use axum::http::StatusCode;
use common::harness;
use vmon_api::records::TeamLimits;

const ADMIN: &[(&str, &str)] = &[("x-admin-token", "admintoken")];

/// A second team whose name gives a taken slug was a 500 (the store's UNIQUE constraint).
#[tokio::test]
async fn a_team_whose_name_gives_a_taken_slug_is_a_409() {
    let h = harness(TeamLimits::default()).await;
    let body = r#"{"name": "Team A"}"#; // the harness made "Team A" (slug team-a)
    let r = h
        .call("POST", "/admin/teams", None, Some(body), ADMIN)
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "{:?}", r.json);
    assert_eq!(r.json["code"], 409);
    let r = h
        .call(
            "POST",
            "/admin/teams",
            None,
            Some(r#"{"name": "Team C"}"#),
            ADMIN,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
}

/// An empty value of a typed query parameter is an invalid value, not an absent one.
#[tokio::test]
async fn empty_typed_query_values_are_400s() {
    let h = harness(TeamLimits::default()).await;
    let id = h.create(r#"{"templateID": "base"}"#).await;
    for path in [
        "/events/sandboxes?limit=".to_string(),
        "/events/sandboxes?orderAsc=".to_string(),
        format!("/events/sandboxes/{id}?offset="),
        format!("/sandboxes/{id}/metrics?start="),
        format!("/v2/sandboxes/{id}/logs?level="),
        format!("/v2/sandboxes/{id}/logs?cursor="),
        "/secrets?limit=".to_string(),
        "/secrets?limit=%2B5".to_string(),
        "/v2/sandboxes?limit=%205".to_string(),
        "/events/sandboxes?offset=%2B1".to_string(),
    ] {
        let r = h.req("GET", &path, None).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{path}: {:?}", r.json);
        assert_eq!(r.json["code"], 400, "{path}");
    }
}

/// A u32 field was documented `int32`, so 2147483648 was "schema-violating" yet taken: unsigned
/// fields are documented as what the server takes (`uint32`, `uint64`), and a value beyond that
/// is a 400 that makes nothing.
#[tokio::test]
async fn unsigned_fields_are_documented_as_the_server_takes_them() {
    let h = harness(TeamLimits::default()).await;
    let doc = h.call("GET", "/openapi.json", None, None, &[]).await.json;
    let limits = &doc["components"]["schemas"]["TeamLimits"]["properties"];
    assert_eq!(limits["max_vcpus"]["format"], "uint32", "{limits}");
    assert_eq!(limits["max_lifetime_secs"]["format"], "uint64", "{limits}");
    let teams = |r: &common::Reply| r.json.as_array().map(Vec::len);
    let before = h.call("GET", "/admin/teams", None, None, ADMIN).await;
    let too_big = r#"{"name": "Big", "limits": {"max_vcpus": 4294967296}}"#;
    let r = h
        .call("POST", "/admin/teams", None, Some(too_big), ADMIN)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    assert_eq!(r.json["code"], 400);
    let after = h.call("GET", "/admin/teams", None, None, ADMIN).await;
    assert_eq!(teams(&after), teams(&before), "no team made");
    let fits = r#"{"name": "Big", "limits": {"max_vcpus": 2147483648}}"#;
    let r = h
        .call("POST", "/admin/teams", None, Some(fits), ADMIN)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    assert_eq!(r.json["team"]["limits"]["max_vcpus"], 2147483648u64);
}

/// A team whose lifetime cap is beyond what a date can hold: its sandboxes are created (the cap
/// is no cap), never a panic on the end-time arithmetic.
#[tokio::test]
async fn a_lifetime_cap_beyond_any_date_is_no_cap() {
    let h = harness(TeamLimits::default()).await;
    let body = format!(
        r#"{{"name": "Forever", "limits": {{"max_lifetime_secs": {}}}}}"#,
        u64::MAX
    );
    let r = h
        .call("POST", "/admin/teams", None, Some(&body), ADMIN)
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    let key = r.json["apiKey"].as_str().unwrap().to_string();
    let post = |path: String, body: Option<&'static str>| {
        let (h, key) = (&h, key.clone());
        async move { h.call("POST", &path, Some(&key), body, &[]).await }
    };
    let r = post(
        "/sandboxes".into(),
        Some(r#"{"templateID": "base", "timeout": 60}"#),
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    let id = r.json["sandboxID"].as_str().unwrap().to_string();
    // A new timeout and a resume both clamp the end to the cap.
    for (action, body, want) in [
        (
            "timeout",
            Some(r#"{"timeout": 120}"#),
            StatusCode::NO_CONTENT,
        ),
        ("pause", None, StatusCode::NO_CONTENT),
        ("resume", Some(r#"{"timeout": 60}"#), StatusCode::CREATED),
    ] {
        let r = post(format!("/sandboxes/{id}/{action}"), body).await;
        assert_eq!(r.status, want, "{action}: {:?}", r.json);
    }
}

/// Metrics ranges at the ends of i64 (schemathesis found an `end` near i64::MIN overflowing
/// the default start): a 400 for negative ones, an answer for huge ones, never a panic.
#[tokio::test]
async fn metrics_ranges_at_the_ends_of_i64_are_answered() {
    let h = harness(TeamLimits::default()).await;
    let id = h.create(r#"{"templateID": "base"}"#).await;
    for (query, want) in [
        (format!("end={}", i64::MIN), StatusCode::BAD_REQUEST),
        (format!("start={}", i64::MIN), StatusCode::BAD_REQUEST),
        (
            format!("start=60942250599688&end={}", i64::MIN),
            StatusCode::BAD_REQUEST,
        ),
        (format!("start=0&end={}", i64::MAX), StatusCode::OK),
        (format!("end={}", i64::MAX), StatusCode::OK),
    ] {
        let path = format!("/sandboxes/{id}/metrics?{query}");
        let r = h.req("GET", &path, None).await;
        assert_eq!(r.status, want, "{path}: {:?}", r.json);
    }
}

/// Errors axum answers itself are `{code, message}` too: a known path's unknown method (405,
/// keeping `Allow`), and an extractor's rejection.
#[tokio::test]
async fn axums_own_errors_are_code_and_message() {
    let h = harness(TeamLimits::default()).await;
    let r = h.req("PATCH", "/v2/sandboxes", None).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.json["code"], 405, "{:?}", r.json);
    assert!(r.json["message"].is_string());
    assert!(r.headers.contains_key("allow"));
    assert_eq!(r.headers["content-type"], "application/json");
    let r = h
        .call("POST", "/admin/teams", None, Some("{not json"), ADMIN)
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    assert_eq!(r.json["code"], 400, "{:?}", r.json);
    // A body without the required name was axum's 422, a status the document does not list.
    let r = h
        .call(
            "POST",
            "/admin/teams",
            None,
            Some(r#"{"slug": "x"}"#),
            ADMIN,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
}
