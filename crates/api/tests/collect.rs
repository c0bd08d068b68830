//! The collector of node builds no record names (`control/collect.rs`): after a restart the
//! checkpoint build of a fork or snapshot that crashed before its record, and the build of a
//! template deleted just before a crash, are gone, while every build a record names (a
//! template's or snapshot's tag, a paused sandbox's pause, a fork child's checkpoint, a cached
//! layer, what a running sandbox runs from) stays, and so does an unnamed build a running
//! sandbox stands on. The leader's periodic pass collects only builds older than its grace.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use common::{harness, Harness};
use vmon_api::control::COLLECT_GRACE;
use vmon_api::records::{BuildRecords, Records, TeamLimits, TemplateKind};
use vmon_api::{Config, Control};
use vmon_proto::node::NodeCalls;

fn limits() -> TeamLimits {
    TeamLimits {
        max_concurrent: 10,
        ..TeamLimits::default()
    }
}

/// A restart of the api over the same records and node: a new `Control` (its reconcile runs
/// before it returns), with a fresh KV as after a crash.
async fn restart(h: &Harness) -> (Arc<Control>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let kv = vmon_kv::Kv::open_embedded(&vmon_kv::EmbeddedConfig::new(dir.path()))
        .await
        .unwrap();
    let config = Config {
        lock_wait_secs: 5,
        template_files_dir: Some(dir.path().join("template-files")),
        ..Config::default()
    };
    let control = Control::open_with(
        config,
        h.node.clone(),
        h.records.clone(),
        kv,
        h.node.progress.clone(),
    )
    .await
    .unwrap();
    (control, dir)
}

fn has(h: &Harness, build_id: &str) -> bool {
    h.node.builds.lock().unwrap().contains_key(build_id)
}

/// The builds of the team's snapshot `alias`, by tag.
async fn snapshot_builds(h: &Harness, alias: &str) -> (String, Vec<String>) {
    let t = h
        .records
        .snapshots(&h.team_id)
        .await
        .unwrap()
        .into_iter()
        .find(|t| t.alias.as_deref() == Some(alias))
        .unwrap();
    assert!(matches!(t.kind, TemplateKind::Snapshot { .. }));
    let builds = t.tags.values().map(|b| b.build_id.clone()).collect();
    (t.id, builds)
}

#[tokio::test]
async fn a_restart_collects_unnamed_builds_and_keeps_named_ones() {
    let h = harness(limits()).await;
    // What records name: the base template, a running sandbox, a paused one, fork children
    // (they own the fork's checkpoint), a snapshot, a cached layer.
    let base = h
        .records
        .template_by_alias(&h.team_id, "base")
        .await
        .unwrap()
        .unwrap()
        .tags["default"]
        .build_id
        .clone();
    let running = h.create(r#"{"templateID":"base"}"#).await;
    let paused = h.create(r#"{"templateID":"base"}"#).await;
    let r = h
        .req("POST", &format!("/sandboxes/{paused}/pause"), Some("{}"))
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.json);
    let pause_build = h.record(&paused).await.build.build_id;
    let f = h
        .req(
            "POST",
            &format!("/sandboxes/{running}/fork"),
            Some(r#"{"count":1}"#),
        )
        .await;
    assert_eq!(f.status, StatusCode::CREATED, "{:?}", f.json);
    let child = f.json[0]["sandbox"]["sandboxID"].as_str().unwrap();
    let fork_build = h
        .records
        .sandbox(child)
        .await
        .unwrap()
        .unwrap()
        .owned_build
        .unwrap();
    let s = h
        .req(
            "POST",
            &format!("/sandboxes/{running}/snapshots"),
            Some(r#"{"name":"kept"}"#),
        )
        .await;
    assert_eq!(s.status, StatusCode::CREATED, "{:?}", s.json);
    let (_, kept_snapshot) = snapshot_builds(&h, "kept").await;
    let rec = h.record(&running).await;
    let layer = h
        .node
        .checkpoint(&running, &rec.execution_id, true)
        .await
        .unwrap();
    h.records
        .put_layer(&h.team_id, "some-step", &layer)
        .await
        .unwrap();

    // What no record names. A fork or snapshot that crashed after the node's checkpoint and
    // before its record: the node keeps the build.
    let crashed_checkpoint = h
        .node
        .checkpoint(&running, &rec.execution_id, true)
        .await
        .unwrap()
        .build_id;
    // A template deleted just before a crash: its record is gone, the node's build stays.
    let s = h
        .req(
            "POST",
            &format!("/sandboxes/{running}/snapshots"),
            Some(r#"{"name":"deleted"}"#),
        )
        .await;
    assert_eq!(s.status, StatusCode::CREATED, "{:?}", s.json);
    let (deleted_id, deleted_builds) = snapshot_builds(&h, "deleted").await;
    assert!(h.records.delete_template(&deleted_id).await.unwrap());
    // An unnamed checkpoint the running source stands on (its memory basis): the node refuses.
    let stood_on = h
        .node
        .checkpoint(&running, &rec.execution_id, true)
        .await
        .unwrap()
        .build_id;
    h.node.in_use.lock().unwrap().insert(stood_on.clone());

    let unnamed: Vec<&String> = std::iter::once(&crashed_checkpoint)
        .chain(&deleted_builds)
        .collect();
    for b in &unnamed {
        assert!(has(&h, b), "{b} is on the node before the restart");
    }

    let (control, _kv_dir) = restart(&h).await;

    for b in unnamed {
        assert!(!has(&h, b), "the unnamed build {b} survived the restart");
    }
    let named = [
        ("the base template", &base),
        ("the paused sandbox's pause", &pause_build),
        ("the fork child's checkpoint", &fork_build),
        ("the cached layer", &layer.build_id),
        ("a running sandbox's basis", &stood_on),
    ];
    for (what, b) in named.iter().copied().chain(
        kept_snapshot
            .iter()
            .map(|b| ("the snapshot's tag", b))
            .collect::<Vec<_>>(),
    ) {
        assert!(has(&h, b), "{what} ({b}) was collected");
    }
    // The paused sandbox is still paused on its build, and everything still runs.
    let rec = h.record(&paused).await;
    assert_eq!(rec.build.build_id, pause_build);
    assert_eq!(h.node.running_count(), 2, "the source and the fork child");
    drop(control);
}

#[tokio::test]
async fn the_leaders_pass_collects_only_builds_older_than_its_grace() {
    let h = harness(limits()).await;
    let running = h.create(r#"{"templateID":"base"}"#).await;
    let rec = h.record(&running).await;
    let old = h
        .node
        .checkpoint(&running, &rec.execution_id, true)
        .await
        .unwrap()
        .build_id;
    // A checkpoint made a moment ago whose transition has not written its record yet.
    let young = h
        .node
        .checkpoint(&running, &rec.execution_id, true)
        .await
        .unwrap()
        .build_id;
    let now = time::OffsetDateTime::now_utc().unix_timestamp() as u64;
    h.node
        .recorded_unix
        .lock()
        .unwrap()
        .insert(young.clone(), now);

    let deleted = h.control.collect_builds(COLLECT_GRACE).await.unwrap();
    assert_eq!(deleted, vec![old.clone()]);
    assert!(!has(&h, &old), "the old unnamed build is gone");
    assert!(
        has(&h, &young),
        "a build younger than the grace was collected"
    );
    assert!(has(&h, &rec.build.build_id), "the running sandbox's build");
    // Once the grace has passed, it goes too.
    h.node
        .recorded_unix
        .lock()
        .unwrap()
        .insert(young.clone(), now - COLLECT_GRACE.as_secs());
    let deleted = h.control.collect_builds(COLLECT_GRACE).await.unwrap();
    assert_eq!(deleted, vec![young.clone()]);
}
