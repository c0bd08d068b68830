//! Template-file uploads (a COPY step's archive, `templates/files.rs`): a team's count and byte
//! quotas refuse an upload past them with the limit named, and the collector
//! (`templates/collect_files.rs`) deletes an archive no waiting or running build names once it
//! is older than the grace, keeping one a build in progress names.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::{harness_starting_with, Harness};
use vmon_api::config::Quotas;
use vmon_api::records::{BuildRecords, BuildState, TeamLimits, TemplateBuild};

async fn setup(quotas: Quotas, grace_secs: u64) -> (Harness, String) {
    let h = harness_starting_with(
        "127.0.0.1".parse().unwrap(),
        TeamLimits::default(),
        quotas,
        |c| c.template_files_grace_secs = grace_secs,
    )
    .await;
    h.control.ensure_base().await.unwrap();
    let r = h
        .req("POST", "/v3/templates", Some(r#"{"name":"files-tpl:v1"}"#))
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{:?}", r.json);
    let tid = r.json["templateID"].as_str().unwrap().to_string();
    (h, tid)
}

fn hash(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

/// Probes `hash` and, when absent, uploads `bytes` to the URL it names.
async fn upload(h: &Harness, tid: &str, hash: &str, bytes: &str) -> common::Reply {
    let probe = h
        .req("GET", &format!("/templates/{tid}/files/{hash}"), None)
        .await;
    assert_eq!(probe.status, StatusCode::CREATED, "{:?}", probe.json);
    let url = probe.json["url"]
        .as_str()
        .unwrap_or_else(|| panic!("{hash} is already present"));
    let path = &url[url.find("/template-files/").unwrap()..];
    h.call("PUT", path, None, Some(bytes), &[]).await
}

async fn present(h: &Harness, tid: &str, hash: &str) -> bool {
    let probe = h
        .req("GET", &format!("/templates/{tid}/files/{hash}"), None)
        .await;
    probe.json["present"] == true
}

#[tokio::test]
async fn uploads_past_the_teams_quotas_are_refused_with_the_limit_named() {
    let quotas = Quotas {
        max_template_files: 2,
        max_template_file_bytes: 100,
        ..Quotas::default()
    };
    let (h, tid) = setup(quotas, 3600).await;
    let r = upload(&h, &tid, &hash(1), &"a".repeat(40)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);

    // Bytes: 40 kept + 70 more would pass 100.
    let r = upload(&h, &tid, &hash(2), &"b".repeat(70)).await;
    assert_eq!(r.status, StatusCode::INSUFFICIENT_STORAGE, "{:?}", r.json);
    let msg = r.json["message"].as_str().unwrap();
    assert!(msg.contains("quotas.max_template_file_bytes"), "{msg}");
    assert_eq!(r.json["code"], 507);
    assert!(
        !present(&h, &tid, &hash(2)).await,
        "a refused upload is not kept"
    );

    // Count: a second archive fits, a third does not.
    let r = upload(&h, &tid, &hash(2), &"b".repeat(50)).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    let r = upload(&h, &tid, &hash(3), "c").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "{:?}", r.json);
    let msg = r.json["message"].as_str().unwrap();
    assert!(msg.contains("quotas.max_template_files"), "{msg}");
    assert_eq!(r.json["code"], 429);
    assert!(!present(&h, &tid, &hash(3)).await);
}

#[tokio::test]
async fn unused_uploads_are_collected_after_the_grace_and_named_ones_kept() {
    let (h, tid) = setup(Quotas::default(), 2).await;
    for n in [1, 2] {
        let r = upload(&h, &tid, &hash(n), "archive").await;
        assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    }
    // An unfinished upload left by a crash: the first pass takes it whatever its age.
    let dir = h.control.config().template_files_dir.clone().unwrap();
    let leftover = dir.join(&h.team_id).join(".upload-leftover");
    std::fs::write(&leftover, "half").unwrap();
    // A build in progress names archive 2.
    h.records
        .put_template_build(&TemplateBuild {
            build_id: "b-files".into(),
            template_id: tid.clone(),
            team_id: h.team_id.clone(),
            state: BuildState::Building,
            tags: vec!["v1".into()],
            vcpus: 1,
            memory_mb: 512,
            disk_mb: 0,
            start: Some(serde_json::json!({"steps": [
                {"type": "COPY", "args": ["a", "/a"], "filesHash": hash(2), "force": false}
            ]})),
            failure: None,
            result: None,
            created_at: time::OffsetDateTime::now_utc(),
            finished_at: None,
        })
        .await
        .unwrap();

    let cancel = tokio_util::sync::CancellationToken::new();
    let collector =
        tokio::spawn(Arc::clone(&h.control).run_template_files_collector(cancel.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let path = |n: u8| dir.join(&h.team_id).join(hash(n));
    while path(1).exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "an unused upload outlived its 2 s grace by 28 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !leftover.exists(),
        "the start pass takes unfinished uploads"
    );
    assert!(path(2).exists(), "an archive a running build names is kept");
    assert!(!present(&h, &tid, &hash(1)).await);

    // Once the build has ended, nothing names it: it goes after its grace too.
    let mut b = h.records.template_build("b-files").await.unwrap().unwrap();
    b.state = BuildState::Ready;
    h.records.put_template_build(&b).await.unwrap();
    while path(2).exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "an archive no build names any more was kept"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cancel.cancel();
    collector.await.unwrap();
}
