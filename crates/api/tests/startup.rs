//! The first start: the api answers before `base` is built. Creates get an E2B-shaped 503 that
//! says what is being built and how far it is, `GET /health` says `building` (503) with the
//! same progress, and once the build is done both turn: creates succeed, health is 200 ready.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::http::StatusCode;
use common::harness_starting;
use vmon_api::records::TeamLimits;

async fn starting() -> common::Harness {
    harness_starting(
        "127.0.0.1".parse().unwrap(),
        TeamLimits::default(),
        Default::default(),
    )
    .await
}

#[tokio::test]
async fn creates_wait_for_base_with_its_progress() {
    let h = starting().await;
    let held = h.node.hold_builds.write().await;
    let control = h.control.clone();
    let build = tokio::spawn(async move { control.ensure_base().await });
    // The build is under way once the node has reported its step.
    for _ in 0..200 {
        if h.control.startup().current_step() == "guest image" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    for path in ["/v2/sandboxes", "/sandboxes"] {
        let r = h
            .req("POST", path, Some(r#"{"templateID":"base","timeout":60}"#))
            .await;
        assert_eq!(
            r.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{path}: {:?}",
            r.json
        );
        assert_eq!(r.json["code"], 503);
        let msg = r.json["message"].as_str().unwrap();
        assert!(
            msg.starts_with("the base template is being built: guest image 40% (debootstrap), "),
            "{msg}"
        );
        assert!(msg.contains(" s elapsed; retry shortly"), "{msg}");
    }
    // A bad request is still told what is wrong with it.
    let r = h
        .req(
            "POST",
            "/v2/sandboxes",
            Some(r#"{"templateID":"base","timeout":-1}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    // Reads need no template and still answer.
    let r = h.req("GET", "/v2/sandboxes", None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json);

    let r = h.call("GET", "/health", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json["status"], "building", "{:?}", r.json);
    assert_eq!(r.json["code"], 503);
    assert_eq!(r.json["step"], "guest image");
    assert_eq!(r.json["percent"], 40);
    assert!(r.json["elapsedSecs"].is_u64());
    assert!(r.json["message"]
        .as_str()
        .unwrap()
        .contains("guest image 40% (debootstrap)"));
    assert_eq!(h.node.running_count(), 0, "nothing was started meanwhile");

    drop(held);
    build.await.unwrap().unwrap();
    let r = h.call("GET", "/health", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["status"], "ready", "{:?}", r.json);
    let id = h.create(r#"{"templateID":"base","timeout":60}"#).await;
    assert_eq!(h.node.running_count(), 1);
    let r = h.req("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn a_failed_base_build_is_reported_and_retried() {
    let h = starting().await;
    h.node.fail_builds.store(1, Ordering::SeqCst);
    assert!(h.control.ensure_base().await.is_err());

    let r = h
        .req("POST", "/v2/sandboxes", Some(r#"{"templateID":"base"}"#))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.json);
    let msg = r.json["message"].as_str().unwrap();
    assert!(
        msg.starts_with("building the base template failed after "),
        "{msg}"
    );
    assert!(msg.contains("injected build failure"), "{msg}");
    let r = h.call("GET", "/health", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json["status"], "failed", "{:?}", r.json);

    h.control.ensure_base().await.unwrap();
    let r = h.call("GET", "/health", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json);
    h.create(r#"{"templateID":"base","timeout":60}"#).await;
}
