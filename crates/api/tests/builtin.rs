//! Builtin templates: a create naming `code-interpreter-v1` before it exists builds it on
//! demand, concurrent creates share one build, and the background build makes it once; a
//! builtin built from an older guest image is built again.

#![allow(clippy::unwrap_used)]

mod common;

use axum::http::StatusCode;
use common::harness;
use vmon_api::control::CODE_INTERPRETER;
use vmon_api::records::{Records, TeamLimits};

#[tokio::test]
async fn create_builds_the_code_interpreter_template_once() {
    let h = harness(TeamLimits::default()).await;
    let builds_before = h.node.builds.lock().unwrap().len();
    let body = format!(r#"{{"templateID":"{CODE_INTERPRETER}","timeout":60}}"#);
    let (a, b, c) = tokio::join!(
        h.req("POST", "/v2/sandboxes", Some(&body)),
        h.req("POST", "/v2/sandboxes", Some(&body)),
        h.control.ensure_builtin(CODE_INTERPRETER),
    );
    assert_eq!(a.status, StatusCode::CREATED, "{:?}", a.json);
    assert_eq!(b.status, StatusCode::CREATED, "{:?}", b.json);
    let built = c.unwrap();
    assert_eq!(h.node.builds.lock().unwrap().len(), builds_before + 1);
    assert_eq!(a.json["templateID"], b.json["templateID"]);
    let t = h
        .records
        .template_by_alias("", CODE_INTERPRETER)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(t.tags["default"].build_id, built.build_id);
    // Not a builtin: still a plain 404.
    let r = h
        .req("POST", "/v2/sandboxes", Some(r#"{"templateID":"nope"}"#))
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_builtin_template_from_an_older_guest_image_is_built_again() {
    let h = harness(TeamLimits {
        max_concurrent: 5,
        ..TeamLimits::default()
    })
    .await;
    let first = h
        .control
        .ensure_template("base", &Default::default())
        .await
        .unwrap();
    // Same image: the build is kept.
    let again = h
        .control
        .ensure_template("base", &Default::default())
        .await
        .unwrap();
    assert_eq!(again.build_id, first.build_id);
    // The node now has a newer image than the build was made from.
    h.node
        .builds
        .lock()
        .unwrap()
        .get_mut(&first.build_id)
        .unwrap()
        .older_image = true;
    let rebuilt = h
        .control
        .ensure_template("base", &Default::default())
        .await
        .unwrap();
    assert_ne!(rebuilt.build_id, first.build_id);
    // Creates use the new build; the old one is left for what was made from it.
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let starts = h.node.starts.lock().unwrap().clone();
    let s = starts.iter().find(|s| s.sandbox_id == id).expect("started");
    assert_eq!(s.build_id, rebuilt.build_id);
    assert!(h.node.builds.lock().unwrap().contains_key(&first.build_id));
}
