//! GPU sandboxes over REST (seed 003), against the real store and KV and the fake node (these
//! machines have no GPU: the node's passthrough, discovery and accounting are tested in
//! `crates/node/src/gpus.rs` and `crates/vm/src/vfio.rs` with a sysfs tree standing in for
//! the hardware). What the api owns: the count (`metadata["vmon.gpus"]`, a 400 for a bad one),
//! a GPU sandbox always cold-boots (create, resume, fork child), memory pauses and snapshots
//! keep only the filesystem and say why in their events, and a node's refusal is the right
//! status with the admission unit given back.

#![allow(clippy::unwrap_used)]

mod common;

use axum::http::StatusCode;
use common::limits;
use vmon_api::records::EventKind;

fn create_body(gpus: &str) -> String {
    format!(r#"{{"templateID":"base","timeout":600,"metadata":{{"vmon.gpus":"{gpus}"}}}}"#)
}

#[tokio::test]
async fn a_bad_count_is_a_400_and_starts_nothing() {
    let h = common::harness(limits(5)).await;
    for bad in ["x", "-1", "1.5", "17", ""] {
        let r = h
            .req("POST", "/v2/sandboxes", Some(&create_body(bad)))
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {:?}", r.json);
        assert_eq!(r.json["code"], 400, "{:?}", r.json);
        let m = r.json["message"].as_str().unwrap();
        assert!(m.contains("vmon.gpus") && m.contains("0 to 16"), "{m}");
    }
    assert!(h.node.starts.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_gpu_sandbox_cold_boots_and_pauses_its_filesystem_only() {
    let h = common::harness(limits(5)).await;
    *h.node.gpus.lock().unwrap() = (2, 2);
    let id = h.create(&create_body("1")).await;
    let start = h.last_start();
    assert_eq!(start.gpus, 1);
    assert!(start.cold_boot, "a GPU sandbox never restores a snapshot");

    // A memory pause (the default) keeps only the filesystem, and its event says why.
    let p = h.pause(&id).await;
    assert_eq!(p.status, StatusCode::NO_CONTENT, "{:?}", p.json);
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.json["pauseMode"], "filesystem");
    let paused = h.last_event(&id, EventKind::Paused).await;
    let data = paused.event_data.unwrap();
    assert_eq!(data["memory"], false);
    assert!(
        data["memory_skipped"]
            .as_str()
            .unwrap()
            .contains("GPUs passed through"),
        "{data}"
    );

    // The resume asks for the same GPUs and cold-boots.
    let c = h.connect(&id, 60).await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
    let resumed = h.last_start();
    assert_eq!((resumed.gpus, resumed.cold_boot), (1, true));

    // A snapshot keeps the filesystem only, and says so.
    let s = h
        .req("POST", &format!("/sandboxes/{id}/snapshots"), Some("{}"))
        .await;
    assert!(s.status.is_success(), "{:?}", s.json);
    let snap = h.last_event(&id, EventKind::Checkpointed).await;
    assert!(
        snap.event_data.unwrap()["memory_skipped"].is_string(),
        "the snapshot's event names why memory was not kept"
    );

    // A plain sandbox beside it still restores memory and asks for no GPU.
    let plain = h.create(r#"{"templateID":"base","timeout":600}"#).await;
    let last = h.last_start();
    assert_eq!((last.sandbox_id.as_str(), last.gpus), (plain.as_str(), 0));
    assert!(!last.cold_boot);
}

#[tokio::test]
async fn a_node_refusal_is_400_or_503_and_gives_the_admission_back() {
    let h = common::harness(limits(1)).await;
    *h.node.gpus.lock().unwrap() = (2, 1);
    // More than the node has: no wait helps.
    let r = h
        .req("POST", "/v2/sandboxes", Some(&create_body("4")))
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    assert!(r.json["message"]
        .as_str()
        .unwrap()
        .contains("this node has 2"));
    // More than it has free: busy, try later.
    let r = h
        .req("POST", "/v2/sandboxes", Some(&create_body("2")))
        .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{:?}", r.json);
    assert_eq!(r.json["code"], 503);
    assert!(r.json["message"]
        .as_str()
        .unwrap()
        .contains("1 of this node's 2"));
    // Neither kept the team's one admission unit.
    h.create(&create_body("1")).await;
}
