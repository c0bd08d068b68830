//! The REST surface against in-memory parts: shapes, statuses, auth, idempotency, admission,
//! limits, listing and the admin routes (the state machine and the reaper are in
//! `lifecycle.rs`).

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use common::{harness, limits};
use vmon_api::records::EventKind;

#[tokio::test]
async fn health_and_auth() {
    let h = harness(limits(5)).await;
    let r = h.call("GET", "/health", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["status"], "ready", "{:?}", r.json);

    let r = h.call("GET", "/v2/sandboxes", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json["code"], 401);
    assert!(r.json["message"].is_string());

    let r = h
        .call(
            "POST",
            "/v2/sandboxes",
            Some("e2b_nope"),
            Some(r#"{"templateID":"base"}"#),
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);

    let r = h.req("GET", "/no/such/thing", None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json["code"], 404);
}

#[tokio::test]
async fn create_answers_the_sdk_shape() {
    let h = harness(limits(5)).await;
    let r = h
        .req(
            "POST",
            "/v2/sandboxes",
            Some(r#"{"templateID":"base","timeout":600,"metadata":{"job":"42"},"envVars":{"FOO":"bar"},"someFutureField":{"x":1}}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    let id = r.json["sandboxID"].as_str().unwrap();
    assert_eq!(id.len(), 21);
    assert!(id.starts_with('i'));
    assert!(id[1..]
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()));
    assert_eq!(r.json["envdVersion"], "0.6.4");
    assert_eq!(r.json["alias"], "base");
    assert!(r.json["templateID"].is_string());
    assert!(r.json["clientID"].is_string());
    assert!(r.json["envdAccessToken"].as_str().unwrap().len() >= 32);
    assert!(r.json["trafficAccessToken"].is_null());

    let start = h.last_start();
    assert_eq!(start.env_vars.get("FOO").map(String::as_str), Some("bar"));
    assert_eq!(
        start.envd_access_token.as_deref(),
        r.json["envdAccessToken"].as_str()
    );

    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.status, StatusCode::OK);
    assert_eq!(d.json["state"], "running");
    assert_eq!(d.json["metadata"]["job"], "42");
    assert_eq!(d.json["cpuCount"], 2);
    assert_eq!(d.json["memoryMB"], 512);
    assert_eq!(d.json["lifecycle"]["onTimeout"], "kill");
    assert_eq!(d.json["lifecycle"]["autoResume"], false);
    let started = time::OffsetDateTime::parse(
        d.json["startedAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let end = time::OffsetDateTime::parse(
        d.json["endAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert!((end - started).whole_seconds() >= 599);

    // Legacy path: default timeout 15 s.
    let r = h
        .req("POST", "/sandboxes", Some(r#"{"templateID":"base"}"#))
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
}

#[tokio::test]
async fn private_traffic_gets_a_traffic_token() {
    let h = harness(limits(5)).await;
    let r = h
        .req(
            "POST",
            "/v2/sandboxes",
            Some(r#"{"templateID":"base","network":{"allowPublicTraffic":false}}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(r.json["trafficAccessToken"].as_str().unwrap().len() >= 32);
    let id = r.json["sandboxID"].as_str().unwrap();
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.json["network"]["allowPublicTraffic"], false);
}

#[tokio::test]
async fn bad_input_is_a_400_with_a_message() {
    let h = harness(limits(5)).await;
    for body in [
        r#"{"templateID":"base","timeout":"long"}"#,
        r#"{"templateID":"base","metadata":{"a":1}}"#,
        r#"{"templateID":7}"#,
        r#"{}"#,
        r#"not json"#,
        r#"{"templateID":"base","timeout":-5}"#,
        r#"{"templateID":"base","timeout":9223372036854775807}"#,
        r#"{"templateID":"base","timeout":18446744073709551616}"#,
    ] {
        let r = h.req("POST", "/v2/sandboxes", Some(body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {:?}", r.json);
        assert_eq!(r.json["code"], 400);
        assert!(!r.json["message"].as_str().unwrap().is_empty());
    }
    let r = h
        .req("POST", "/v2/sandboxes", Some(r#"{"templateID":"nope"}"#))
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.json["code"], 404);

    // Above the team's vCPU limit.
    let r = h
        .req("POST", "/v2/sandboxes", Some(r#"{"templateID":"big"}"#))
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);

    let id = h.create(r#"{"templateID":"base"}"#).await;
    let r = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            Some(r#"{"timeout":"x"}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // Out-of-range numbers are 400, never a panic, and change nothing.
    for (path, body) in [
        ("timeout", r#"{"timeout":9223372036854775807}"#),
        ("timeout", r#"{"timeout":86401}"#),
        ("refreshes", r#"{"duration":9223372036854775807}"#),
        ("connect", r#"{"timeout":9223372036854775807}"#),
    ] {
        let url = if path == "connect" {
            format!("/v2/sandboxes/{id}/connect")
        } else {
            format!("/sandboxes/{id}/{path}")
        };
        let r = h.req("POST", &url, Some(body)).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{path} {body}: {:?}",
            r.json
        );
        assert_eq!(r.json["code"], 400);
    }
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(
        d.status,
        StatusCode::OK,
        "the sandbox survived: {:?}",
        d.json
    );
    assert_eq!(d.json["state"], "running");
    for body in [
        r#"{"count":0}"#,
        r#"{"count":101}"#,
        r#"{"count":5}"#,
        r#"{"count":-1}"#,
    ] {
        let r = h
            .req("POST", &format!("/sandboxes/{id}/fork"), Some(body))
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
    }
    // Nothing was left half-done.
    assert_eq!(h.node.running_count(), 1);
}

#[tokio::test]
async fn team_quotas_are_429_with_the_limit_named() {
    let quotas = vmon_api::config::Quotas {
        max_paused: 1,
        max_snapshots: 1,
        max_webhooks: 1,
        ..Default::default()
    };
    let h = common::harness_with("127.0.0.1".parse().unwrap(), limits(5), quotas).await;
    let a = h.create(r#"{"templateID":"base"}"#).await;
    let b = h.create(r#"{"templateID":"base"}"#).await;
    let r = h.pause(&a).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.json);
    let r = h.pause(&b).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.json);
    assert!(r.json["message"].as_str().unwrap().contains("max_paused"));
    let d = h.req("GET", &format!("/sandboxes/{b}"), None).await;
    assert_eq!(
        d.json["state"], "running",
        "the refused pause changed nothing"
    );
    let r = h
        .req("POST", &format!("/sandboxes/{b}/snapshots"), Some("{}"))
        .await;
    assert!(r.status.is_success(), "{:?}", r.json);
    let r = h
        .req("POST", &format!("/sandboxes/{b}/snapshots"), Some("{}"))
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.json);
    assert!(r.json["message"]
        .as_str()
        .unwrap()
        .contains("max_snapshots"));
}

#[tokio::test]
async fn metadata_and_env_vars_are_bounded() {
    let h = harness(limits(5)).await;
    let many: serde_json::Map<String, serde_json::Value> = (0..101)
        .map(|i| (format!("k{i}"), serde_json::Value::from("v")))
        .collect();
    let bodies = [
        serde_json::json!({"templateID": "base", "metadata": many}),
        serde_json::json!({"templateID": "base", "metadata": {"k": "v".repeat(4097)}}),
        serde_json::json!({"templateID": "base", "metadata": {"": "v"}}),
        serde_json::json!({"templateID": "base", "envVars": {"A=B": "v"}}),
        serde_json::json!({"templateID": "base", "envVars": {"BIG": "x".repeat(128 * 1024 + 1)}}),
    ];
    for body in bodies {
        let text = body.to_string();
        let r = h.req("POST", "/v2/sandboxes", Some(&text)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
        assert!(r.json["message"]
            .as_str()
            .is_some_and(|m| m.contains("metadata") || m.contains("envVars")));
    }
    assert_eq!(h.node.running_count(), 0, "nothing was started");
    // At the bounds it is fine.
    let ok: serde_json::Map<String, serde_json::Value> = (0..100)
        .map(|i| (format!("k{i}"), serde_json::Value::from("v".repeat(4096))))
        .collect();
    let body = serde_json::json!({"templateID": "base", "metadata": ok}).to_string();
    h.create(&body).await;
}

#[tokio::test]
async fn other_teams_sandboxes_do_not_exist() {
    let h = harness(limits(5)).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let other = h.other_key.clone();
    for (m, p, b) in [
        ("GET", format!("/sandboxes/{id}"), None),
        ("DELETE", format!("/sandboxes/{id}"), None),
        ("POST", format!("/sandboxes/{id}/pause"), Some("{}")),
        ("POST", format!("/v2/sandboxes/{id}/connect"), Some("{}")),
        (
            "POST",
            format!("/sandboxes/{id}/timeout"),
            Some(r#"{"timeout":5}"#),
        ),
    ] {
        let r = h.call(m, &p, Some(&other), b, &[]).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{m} {p}");
    }
    let r = h
        .call("GET", "/v2/sandboxes", Some(&other), None, &[])
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 0);
    // Still running for its owner.
    let r = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(r.json["state"], "running");
}

#[tokio::test]
async fn idempotency_key_returns_the_same_sandbox_and_failures_free_it() {
    let h = harness(limits(5)).await;
    let key = h.key.clone();
    let body = r#"{"templateID":"base"}"#;
    let hdr = [("idempotency-key", "job-42")];
    let a = h
        .call("POST", "/v2/sandboxes", Some(&key), Some(body), &hdr)
        .await;
    let b = h
        .call("POST", "/v2/sandboxes", Some(&key), Some(body), &hdr)
        .await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(b.status, StatusCode::CREATED);
    assert_eq!(a.json["sandboxID"], b.json["sandboxID"]);
    assert_eq!(h.node.running_count(), 1);

    // Concurrent repeats of one key make one sandbox.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let router = h.router.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            use tower::ServiceExt;
            let req = axum::http::Request::post("/v2/sandboxes")
                .header("x-api-key", key)
                .header("idempotency-key", "parallel")
                .body(axum::body::Body::from(body))
                .unwrap();
            let resp = router.oneshot(req).await.unwrap();
            let bytes = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap()
                .to_bytes();
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            v["sandboxID"].as_str().unwrap().to_string()
        }));
    }
    let ids: HashSet<String> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(h.node.running_count(), 2);

    // A failed create frees its key.
    h.node.fail_starts.store(1, Ordering::SeqCst);
    let hdr = [("idempotency-key", "retry-me")];
    let f = h
        .call("POST", "/v2/sandboxes", Some(&key), Some(body), &hdr)
        .await;
    assert_eq!(f.status, StatusCode::INTERNAL_SERVER_ERROR);
    let ok = h
        .call("POST", "/v2/sandboxes", Some(&key), Some(body), &hdr)
        .await;
    assert_eq!(ok.status, StatusCode::CREATED, "{:?}", ok.json);

    // The same key of another team is another sandbox.
    let other = h.other_key.clone();
    let hdr = [("idempotency-key", "job-42")];
    let c = h
        .call("POST", "/v2/sandboxes", Some(&other), Some(body), &hdr)
        .await;
    assert_eq!(c.status, StatusCode::CREATED);
    assert_ne!(c.json["sandboxID"], a.json["sandboxID"]);

    let bad = h
        .call(
            "POST",
            "/v2/sandboxes",
            Some(&key),
            Some(body),
            &[("idempotency-key", "UPPER")],
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn admission_is_atomic_and_paused_sandboxes_do_not_count() {
    let h = harness(limits(3)).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let router = h.router.clone();
        let key = h.key.clone();
        tasks.push(tokio::spawn(async move {
            use tower::ServiceExt;
            let req = axum::http::Request::post("/v2/sandboxes")
                .header("x-api-key", key)
                .body(axum::body::Body::from(r#"{"templateID":"base"}"#))
                .unwrap();
            router.oneshot(req).await.unwrap().status()
        }));
    }
    let statuses: Vec<StatusCode> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == StatusCode::CREATED)
            .count(),
        3
    );
    assert_eq!(
        statuses
            .iter()
            .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
            .count(),
        5
    );
    let r = h
        .req("POST", "/v2/sandboxes", Some(r#"{"templateID":"base"}"#))
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.json["code"], 429);

    let list = h.req("GET", "/v2/sandboxes", None).await;
    let id = list.json[0]["sandboxID"].as_str().unwrap().to_string();
    let p = h.pause(&id).await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    h.create(r#"{"templateID":"base"}"#).await;
    // A resume counts too.
    let c = h
        .req("POST", &format!("/v2/sandboxes/{id}/connect"), Some("{}"))
        .await;
    assert_eq!(c.status, StatusCode::TOO_MANY_REQUESTS);
    // The other team has its own budget.
    let other = h.other_key.clone();
    let r = h
        .call(
            "POST",
            "/v2/sandboxes",
            Some(&other),
            Some(r#"{"templateID":"base"}"#),
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
}

#[tokio::test]
async fn list_filters_and_pages() {
    let h = harness(limits(20)).await;
    for i in 0..5 {
        h.create(&format!(
            r#"{{"templateID":"base","metadata":{{"n":"{i}","group":"{}"}}}}"#,
            if i % 2 == 0 { "even" } else { "odd" }
        ))
        .await;
    }
    let r = h
        .req("GET", "/v2/sandboxes?metadata=group%3Deven", None)
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 3);
    assert_eq!(r.headers["x-total-running"], "5");
    let r = h
        .req("GET", "/v2/sandboxes?metadata=group%3Deven%26n%3D2", None)
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 1);

    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let path = match &token {
            Some(t) => format!("/v2/sandboxes?limit=2&order=asc&nextToken={t}"),
            None => "/v2/sandboxes?limit=2&order=asc".to_string(),
        };
        let r = h.req("GET", &path, None).await;
        for s in r.json.as_array().unwrap() {
            seen.push(s["metadata"]["n"].as_str().unwrap().to_string());
        }
        match r.headers.get("x-next-token") {
            Some(t) => token = Some(t.to_str().unwrap().to_string()),
            None => break,
        }
    }
    assert_eq!(seen, vec!["0", "1", "2", "3", "4"]);

    let r = h.req("GET", "/v2/sandboxes?state=bogus", None).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h.req("GET", "/v2/sandboxes?template=base", None).await;
    assert_eq!(r.json.as_array().unwrap().len(), 5);
    let r = h.req("GET", "/v2/sandboxes?template=other", None).await;
    assert_eq!(r.json.as_array().unwrap().len(), 0);
    let r = h
        .req(
            "GET",
            "/v2/sandboxes?startedAfter=2999-01-01T00:00:00Z",
            None,
        )
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 0);
}

#[tokio::test]
async fn admin_routes_need_the_admin_token() {
    let h = harness(limits(5)).await;
    let r = h
        .call("POST", "/admin/teams", None, Some(r#"{"name":"Ops"}"#), &[])
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h
        .call(
            "POST",
            "/admin/teams",
            None,
            Some(r#"{"name":"Ops"}"#),
            &[("x-admin-token", "admintoken")],
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let key = r.json["apiKey"].as_str().unwrap().to_string();
    let key_id = r.json["key"]["id"].as_str().unwrap().to_string();
    let ops_team = r.json["team"]["id"].as_str().unwrap().to_string();
    let created = r.json["key"]["created_at"].as_str().unwrap_or_default();
    assert!(
        time::OffsetDateTime::parse(created, &time::format_description::well_known::Rfc3339)
            .is_ok(),
        "a key's created_at is RFC 3339: {:?}",
        r.json["key"]
    );
    let c = h
        .call(
            "POST",
            "/v2/sandboxes",
            Some(&key),
            Some(r#"{"templateID":"base"}"#),
            &[],
        )
        .await;
    assert_eq!(c.status, StatusCode::CREATED);
    let id = c.json["sandboxID"].as_str().unwrap().to_string();
    let r = h
        .call(
            "DELETE",
            &format!("/admin/keys/{key_id}"),
            None,
            None,
            &[("x-admin-token", "admintoken")],
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let c = h.call("GET", "/v2/sandboxes", Some(&key), None, &[]).await;
    assert_eq!(
        c.status,
        StatusCode::UNAUTHORIZED,
        "a revoked key no longer works"
    );
    let r = h
        .call(
            "DELETE",
            &format!("/admin/sandboxes/{id}"),
            None,
            None,
            &[("x-admin-token", "admintoken")],
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let ev = h
        .events_in(&ops_team, &id)
        .await
        .into_iter()
        .find(|e| e.event_type == EventKind::Killed.as_str())
        .unwrap();
    assert_eq!(ev.event_data.unwrap()["kill_reason"], "admin");
}
