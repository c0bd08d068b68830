//! PostgreSQL restarted under load by the test: the store reconnects by itself, and no half
//! transaction is ever visible (every committed state change has exactly its event).

#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use time::OffsetDateTime;
use vmon_store::*;

fn record() -> SandboxRecord {
    let now = OffsetDateTime::now_utc();
    SandboxRecord {
        sandbox_id: "isbx1".into(),
        team_id: "t1".into(),
        execution_id: "e1".into(),
        template_id: "base".into(),
        build_id: "b1".into(),
        paused_build_id: None,
        alias: None,
        state: SandboxState::Running,
        node_id: Some("node-a".into()),
        pause_mode: None,
        vcpus: 1,
        memory_mb: 256,
        disk_mb: 1024,
        envd_version: "0.2.0".into(),
        metadata: Default::default(),
        env_vars: Default::default(),
        network: None,
        auto_pause: false,
        auto_pause_memory: true,
        auto_resume: false,
        // Used as the count of committed updates.
        timeout_secs: 0,
        started_at: now,
        end_at: now + time::Duration::hours(1),
        envd_access_token: None,
        traffic_access_token: None,
        extra: json!({}),
        fence: 0,
    }
}

fn event(kind: &str, n: i64) -> NewEvent {
    NewEvent {
        event_type: kind.into(),
        event_data: Some(json!({ "n": n })),
        sandbox_id: "isbx1".into(),
        execution_id: "e1".into(),
        build_id: "b1".into(),
        team_id: "t1".into(),
        template_id: "base".into(),
        timestamp: OffsetDateTime::now_utc(),
    }
}

/// One update: the counter in the record and its event, in one transaction.
async fn update_once(store: &Store) -> Result<()> {
    let mut tx = store.begin().await?;
    let mut s = tx
        .sandbox("isbx1")
        .await?
        .ok_or(StoreError::InvalidArgument("gone".into()))?;
    s.timeout_secs += 1;
    assert!(tx.update_sandbox(&s, "e1", 0).await?);
    tx.append_event(&event(event_types::UPDATED, s.timeout_secs))
        .await?;
    tx.commit().await
}

async fn eventually<T>(what: &str, mut f: impl AsyncFnMut() -> Result<T>) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(error) if tokio::time::Instant::now() < deadline => {
                eprintln!("{what}: {error}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("{what}: {error}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_mid_run_reconnects_and_shows_no_half_transaction() {
    let mut pg = support::Postgres::start(true).await;
    let store = Store::open(&StoreConfig::postgres(pg.url(), support::KEY))
        .await
        .unwrap();
    store.insert_sandbox(&record()).await.unwrap();

    // A transaction cut off by the crash before its commit.
    let mut half = store.begin().await.unwrap();
    assert!(half
        .set_sandbox_state("isbx1", "e1", &[], SandboxState::Paused, 0)
        .await
        .unwrap());
    half.append_event(&event(event_types::PAUSED, -1))
        .await
        .unwrap();
    pg.stop_immediately();
    assert!(
        half.commit().await.is_err(),
        "a commit to a dead server cannot succeed"
    );
    pg.start_again().await;
    let s = eventually("read after restart", async || store.sandbox("isbx1").await)
        .await
        .unwrap();
    assert_eq!(
        s.state,
        SandboxState::Running,
        "the half transaction's state change is not visible"
    );

    // Updates running while the server restarts.
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // The longest single update (ms): one that waited out the restart instead of failing.
    let longest = Arc::new(AtomicU64::new(0));
    // Checked between updates: cancelling one mid-commit would let its COMMIT land after the
    // checks below have read the state but before they read the events.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (store, ok, failed, stop, longest) = (
            store.clone(),
            ok.clone(),
            failed.clone(),
            stop.clone(),
            longest.clone(),
        );
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let t = tokio::time::Instant::now();
                match update_once(&store).await {
                    Ok(()) => {
                        ok.fetch_add(1, Ordering::SeqCst);
                        longest.fetch_max(t.elapsed().as_millis() as u64, Ordering::SeqCst);
                    }
                    Err(_) => {
                        failed.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        })
    };
    let wait_for = |n: u64| {
        let ok = ok.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while ok.load(Ordering::SeqCst) < n {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the store did not recover"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_for(30).await;
    pg.stop_immediately();
    tokio::time::sleep(Duration::from_millis(500)).await;
    pg.start_again().await;
    let before = ok.load(Ordering::SeqCst);
    wait_for(before + 30).await;
    stop.store(true, Ordering::SeqCst);
    writer.await.unwrap();
    let waited = longest.load(Ordering::SeqCst);
    println!(
        "committed {}, failed {} (during the restart), longest update {waited} ms",
        ok.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst)
    );
    // The restart reached the writer: some update failed, or one waited out the outage.
    assert!(
        failed.load(Ordering::SeqCst) > 0 || waited >= 400,
        "the restart did interrupt the writer"
    );

    let s = store.sandbox("isbx1").await.unwrap().unwrap();
    let events = store
        .events(&EventQuery {
            team_id: "t1".into(),
            sandbox_id: Some("isbx1".into()),
            limit: 1000,
            ..Default::default()
        })
        .await
        .unwrap();
    let updates: Vec<i64> = events
        .iter()
        .filter(|e| e.event_type == event_types::UPDATED)
        .map(|e| e.event_data.as_ref().and_then(|d| d["n"].as_i64()).unwrap())
        .collect();
    assert!(
        events.iter().all(|e| e.event_type != event_types::PAUSED),
        "the half transaction's event is not visible"
    );
    assert_eq!(
        updates.len() as i64,
        s.timeout_secs,
        "every committed state change has exactly one event"
    );
    let mut sorted = updates.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        (1..=s.timeout_secs).collect::<Vec<_>>(),
        "no gaps, no duplicates"
    );
    // A commit whose acknowledgement was lost counts as failed here but is in the data: so
    // the data may hold more than `ok` counted, never less.
    assert!(s.timeout_secs as u64 >= ok.load(Ordering::SeqCst));
    store.close().await;
}
