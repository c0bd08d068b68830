//! The template-build API's state machine on a fake node (the real builds are the e2e tests'):
//! a request, the signed upload of a COPY's files, the checks a trigger makes, a build that
//! fails on the node, and its paged log and `reason`.

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use axum::http::StatusCode;
use common::harness;
use vmon_api::records::TeamLimits;

fn limits() -> TeamLimits {
    TeamLimits::default()
}

#[tokio::test]
async fn a_build_request_uploads_checks_and_fails_cleanly() {
    let h = harness(limits()).await;
    let r = h
        .req("POST", "/v3/templates", Some(r#"{"name":"api-tpl:v1"}"#))
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{:?}", r.json);
    let tid = r.json["templateID"].as_str().unwrap().to_string();
    let bid = r.json["buildID"].as_str().unwrap().to_string();
    assert_eq!(r.json["tags"], serde_json::json!(["v1"]));
    assert_eq!(r.json["aliases"], serde_json::json!(["api-tpl"]));

    // A COPY's files: not present, then uploaded to the signed URL, then present.
    let hash = "ab".repeat(32);
    let probe = h
        .req("GET", &format!("/templates/{tid}/files/{hash}"), None)
        .await;
    assert_eq!(probe.status, StatusCode::CREATED);
    assert_eq!(probe.json["present"], false);
    let url = probe.json["url"].as_str().unwrap();
    let path = &url[url.find("/template-files/").unwrap()..];
    let forged = path.replace("signature=", "signature=0");
    let bad = h.call("PUT", &forged, None, Some("x"), &[]).await;
    assert_eq!(bad.status, StatusCode::UNAUTHORIZED, "{:?}", bad.json);
    let other_hash = path.replace(&hash, &"cd".repeat(32));
    let bad = h.call("PUT", &other_hash, None, Some("x"), &[]).await;
    assert_eq!(bad.status, StatusCode::UNAUTHORIZED);
    let up = h.call("PUT", path, None, Some("archive bytes"), &[]).await;
    assert_eq!(up.status, StatusCode::CREATED, "{:?}", up.json);
    let probe = h
        .req("GET", &format!("/templates/{tid}/files/{hash}"), None)
        .await;
    assert_eq!(probe.json, serde_json::json!({"present": true}));

    // Another team sees nothing of it.
    let other = h
        .call(
            "GET",
            &format!("/templates/{tid}/builds/{bid}/status"),
            Some(&h.other_key.clone()),
            None,
            &[],
        )
        .await;
    assert_eq!(other.status, StatusCode::NOT_FOUND);

    // Triggers the checks refuse leave the build waiting.
    let start = format!("/v2/templates/{tid}/builds/{bid}");
    for (body, want) in [
        (
            r#"{"steps":[{"type":"FROM","args":["x"],"force":false}]}"#,
            "step 1: unknown step type",
        ),
        (
            r#"{"steps":[{"type":"COPY","args":["a","/a","",""],"filesHash":"0000000000000000000000000000000000000000000000000000000000000000","force":false}]}"#,
            "never uploaded",
        ),
        (
            r#"{"steps":[],"fromTemplate":"no-such-template"}"#,
            "fromTemplate",
        ),
    ] {
        let r = h.req("POST", &start, Some(body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {:?}", r.json);
        let msg = r.json["message"].as_str().unwrap();
        assert!(msg.contains(want), "{msg} lacks {want}");
    }
    let st = h
        .req(
            "GET",
            &format!("/templates/{tid}/builds/{bid}/status"),
            None,
        )
        .await;
    assert_eq!(st.json["status"], "waiting");
    assert!(st.json.get("reason").is_none());

    // A trigger that passes runs; the fake node cannot run its steps, so it ends in error.
    let body = format!(
        r#"{{"fromImage":"e2bdev/base","force":false,"steps":[{{"type":"COPY","args":["f","/f","",""],"filesHash":"{hash}","force":false}}]}}"#
    );
    let r = h.req("POST", &start, Some(&body)).await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{:?}", r.json);
    let again = h.req("POST", &start, Some(&body)).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    let mut st = serde_json::Value::Null;
    for _ in 0..200 {
        st = h
            .req(
                "GET",
                &format!("/templates/{tid}/builds/{bid}/status?logsOffset=0&limit=100"),
                None,
            )
            .await
            .json;
        if st["status"] == "error" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(st["status"], "error", "{st}");
    assert_eq!(st["reason"]["step"], "1", "{st}");
    let entries = st["logEntries"].as_array().unwrap();
    assert!(
        entries
            .iter()
            .any(|e| e["level"] == "error"
                && e["message"].as_str().unwrap().contains("Build failed")),
        "{st}"
    );
    // Paging: the offset past the end is an empty page, as the SDK's loop needs.
    let n = entries.len();
    let page = h
        .req(
            "GET",
            &format!("/templates/{tid}/builds/{bid}/status?logsOffset={n}&limit=100"),
            None,
        )
        .await;
    assert_eq!(page.json["logEntries"], serde_json::json!([]));
    // Nothing was published: no tag names a build.
    let tags = h.req("GET", &format!("/templates/{tid}/tags"), None).await;
    assert_eq!(tags.json, serde_json::json!([]));
}
