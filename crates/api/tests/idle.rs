//! Idle policies and sandbox health through the REST API, with a fake node: which policy a
//! create gets (field, metadata, 400s), the health of a sandbox over memory and cold-boot
//! resumes, and the activity reports of a standalone proxy. The idle scan's timing runs on
//! real VMs (`tests/e2e/test_idle.py`).

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

#[tokio::test]
async fn invalid_idle_policies_are_400_with_code_and_message() {
    let h = harness(limits()).await;
    for body in [
        r#"{"templateID":"base","timeout":600,"metadata":{"vmon.idle.max_idle_seconds":"59"}}"#,
        r#"{"templateID":"base","timeout":600,"metadata":{"vmon.idle.max_idle_seconds":"x"}}"#,
        r#"{"templateID":"base","timeout":100,"metadata":{"vmon.idle.max_idle_seconds":"100"}}"#,
        r#"{"templateID":"base","timeout":600,"metadata":{"vmon.idle.auto_resume":"perhaps"}}"#,
        r#"{"templateID":"base","timeout":600,"metadata":{"vmon.idle.typo":"1"}}"#,
        r#"{"templateID":"base","timeout":600,"vmonIdle":{"maxIdleSeconds":10}}"#,
        r#"{"templateID":"base","timeout":600,"vmonIdle":{"suspendedDurationSeconds":-1}}"#,
    ] {
        let r = h.req("POST", "/v2/sandboxes", Some(body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {:?}", r.json);
        assert_eq!(r.json["code"], 400, "{:?}", r.json);
        assert!(r.json["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    assert_eq!(h.node.running_count(), 0, "nothing started");
}

#[tokio::test]
async fn the_policy_comes_from_the_field_else_metadata_and_fork_children_inherit_it() {
    let h = harness(limits()).await;
    let meta = h
        .create(
            r#"{"templateID":"base","timeout":600,"metadata":{"vmon.idle.max_idle_seconds":"60"}}"#,
        )
        .await;
    let d = h.req("GET", &format!("/sandboxes/{meta}"), None).await;
    assert_eq!(
        d.json["vmonIdle"],
        serde_json::json!({"maxIdleSeconds": 60, "autoResume": true, "suspendedDurationSeconds": 540})
    );
    let field = h
        .create(
            r#"{"templateID":"base","timeout":600,"vmonIdle":{"maxIdleSeconds":90,"autoResume":false},
                "metadata":{"vmon.idle.max_idle_seconds":"60"}}"#,
        )
        .await;
    let hl = h
        .req("GET", &format!("/sandboxes/{field}/health"), None)
        .await;
    assert_eq!(hl.status, StatusCode::OK);
    assert_eq!(hl.json["vmonIdle"]["maxIdleSeconds"], 90);
    assert_eq!(hl.json["vmonIdle"]["autoResume"], false);
    let off = h
        .create(r#"{"templateID":"base","timeout":600,"vmonIdle":null,"metadata":{"vmon.idle.max_idle_seconds":"60"}}"#)
        .await;
    let d = h.req("GET", &format!("/sandboxes/{off}"), None).await;
    assert!(d.json.get("vmonIdle").is_none(), "{:?}", d.json);
    // A fork child keeps the policy when it fits its own timeout.
    let f = h
        .req(
            "POST",
            &format!("/sandboxes/{meta}/fork"),
            Some(r#"{"timeout":300,"count":1}"#),
        )
        .await;
    assert_eq!(f.status, StatusCode::CREATED, "{:?}", f.json);
    let child = f.json[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap()
        .to_string();
    let d = h.req("GET", &format!("/sandboxes/{child}"), None).await;
    assert_eq!(d.json["vmonIdle"]["maxIdleSeconds"], 60);
    let f = h
        .req(
            "POST",
            &format!("/sandboxes/{meta}/fork"),
            Some(r#"{"timeout":30,"count":1}"#),
        )
        .await;
    let child = f.json[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap()
        .to_string();
    let d = h.req("GET", &format!("/sandboxes/{child}"), None).await;
    assert!(d.json.get("vmonIdle").is_none(), "60 s does not fit 30 s");
}

#[tokio::test]
async fn health_follows_memory_and_cold_boot_resumes() {
    let h = harness(limits()).await;
    let id = h.create(r#"{"templateID":"base","timeout":600}"#).await;
    let path = format!("/sandboxes/{id}/health");
    let r = h.req("GET", &path, None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json);
    assert_eq!(r.json["resumeGeneration"], 0);
    assert_eq!(r.json["kernelStateLost"], false);
    assert_eq!(r.json["stateLocation"], "running");
    assert!(r.json["lastResume"].is_null());

    let p = h.pause(&id).await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    let r = h.req("GET", &path, None).await;
    assert_eq!(r.json["state"], "paused");
    assert_eq!(r.json["stateLocation"], "disk");
    let c = h
        .req("POST", &format!("/v2/sandboxes/{id}/connect"), Some("{}"))
        .await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
    let r = h.req("GET", &path, None).await;
    assert_eq!(r.json["resumeGeneration"], 1);
    assert_eq!(r.json["kernelStateLost"], false);
    assert_eq!(r.json["lastResume"]["kind"], "restore");
    assert_eq!(r.json["lastResume"]["trigger"], "connect");
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.json["resumeGeneration"], 1);
    assert_eq!(d.json["stateLocation"], "running");

    let p = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/pause"),
            Some(r#"{"memory":false}"#),
        )
        .await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    h.req("POST", &format!("/v2/sandboxes/{id}/connect"), Some("{}"))
        .await;
    let r = h.req("GET", &path, None).await;
    assert_eq!(r.json["kernelStateLost"], true, "{:?}", r.json);
    assert_eq!(r.json["lastResume"]["kind"], "cold_boot");
    assert_eq!(r.json["resumeGeneration"], 1);

    let resumed: Vec<_> = h
        .events(&id)
        .await
        .into_iter()
        .filter(|e| e.event_type == "sandbox.lifecycle.resumed")
        .collect();
    assert_eq!(resumed.len(), 2);
    let last = resumed[1].event_data.clone().unwrap();
    assert_eq!(last["cold_boot"], true);
    assert_eq!(last["trigger"], "connect");

    let r = h.req("GET", "/sandboxes/inope/health", None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let other = h.other_key.clone();
    let r = h.call("GET", &path, Some(&other), None, &[]).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND, "another team's sandbox");
}

#[tokio::test]
async fn a_standalone_proxy_reports_activity() {
    let h = harness(limits()).await;
    let id = h
        .create(
            r#"{"templateID":"base","timeout":600,"metadata":{"vmon.idle.max_idle_seconds":"60"}}"#,
        )
        .await;
    let body = format!(r#"{{"sandboxes":[{{"sandboxID":"{id}","idleMs":1500}}]}}"#);
    let admin = [("x-admin-token", "admintoken")];
    let r = h
        .call("POST", "/admin/activity", None, Some(&body), &admin)
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.json);
    let idle = h.control.activity().idle(&id).unwrap();
    assert!(idle >= std::time::Duration::from_millis(1500), "{idle:?}");
    let r = h
        .call(
            "POST",
            "/admin/activity",
            None,
            Some(r#"{"sandboxes":3}"#),
            &admin,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h
        .call("POST", "/admin/activity", None, Some(&body), &[])
        .await;
    assert_ne!(r.status, StatusCode::NO_CONTENT, "needs the admin token");
}
