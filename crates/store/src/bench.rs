//! Latency benchmarks of the store's hot writes, callable from `cargo bench -p vmon-store` and
//! from `vmon bench kv`. Sequential, so the figures are commit latencies.

use std::time::Instant;

use time::OffsetDateTime;

pub use vmon_benchstat::Percentiles;

use crate::{event_types, NewEvent, Result, SandboxRecord, SandboxState, Store};

/// Figures for one backend.
#[derive(Clone, Debug)]
pub struct Report {
    pub backend: &'static str,
    /// One event appended and committed on its own.
    pub event_append: Percentiles,
    /// A state change plus its event in one transaction (what every transition commits).
    pub transition: Percentiles,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "store {:<8} event append         {}",
            self.backend, self.event_append
        )?;
        write!(
            f,
            "store {:<8} state+event commit   {}",
            self.backend, self.transition
        )
    }
}

fn sample_record(now: OffsetDateTime) -> SandboxRecord {
    SandboxRecord {
        sandbox_id: format!("ibench{}", uuid::Uuid::new_v4().simple()),
        team_id: "bench-team".into(),
        execution_id: "bench-exec".into(),
        template_id: "bench-template".into(),
        build_id: "bench-build".into(),
        paused_build_id: None,
        alias: None,
        state: SandboxState::Running,
        node_id: Some("bench-node".into()),
        pause_mode: None,
        vcpus: 2,
        memory_mb: 512,
        disk_mb: 2048,
        envd_version: "0.2.0".into(),
        metadata: [("job".to_owned(), "bench".to_owned())].into(),
        env_vars: Default::default(),
        network: None,
        auto_pause: false,
        auto_pause_memory: true,
        auto_resume: false,
        timeout_secs: 300,
        started_at: now,
        end_at: now + time::Duration::minutes(5),
        envd_access_token: None,
        traffic_access_token: None,
        extra: serde_json::json!({}),
        fence: 0,
    }
}

/// Runs `iterations` of each operation against `store` (it writes a bench sandbox and events
/// under team `bench-team`, and removes the sandbox afterwards).
pub async fn run(store: &Store, iterations: usize) -> Result<Report> {
    let record = sample_record(OffsetDateTime::now_utc());
    store.insert_sandbox(&record).await?;
    let event = |kind: &str| NewEvent {
        event_type: kind.to_owned(),
        event_data: Some(serde_json::json!({"sandbox_metadata": record.metadata})),
        sandbox_id: record.sandbox_id.clone(),
        execution_id: record.execution_id.clone(),
        build_id: record.build_id.clone(),
        team_id: record.team_id.clone(),
        template_id: record.template_id.clone(),
        timestamp: OffsetDateTime::now_utc(),
    };
    let warmup = iterations / 10;
    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations + warmup {
        let start = Instant::now();
        store.append_event(&event(event_types::UPDATED)).await?;
        if i >= warmup {
            samples.push(start.elapsed());
        }
    }
    let event_append = Percentiles::from_samples(samples);

    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations + warmup {
        let (from, to, kind) = if i % 2 == 0 {
            (
                SandboxState::Running,
                SandboxState::Paused,
                event_types::PAUSED,
            )
        } else {
            (
                SandboxState::Paused,
                SandboxState::Running,
                event_types::RESUMED,
            )
        };
        let start = Instant::now();
        let mut tx = store.begin().await?;
        tx.set_sandbox_state(&record.sandbox_id, &record.execution_id, &[from], to, 0)
            .await?;
        tx.append_event(&event(kind)).await?;
        tx.commit().await?;
        if i >= warmup {
            samples.push(start.elapsed());
        }
    }
    let mut tx = store.begin().await?;
    tx.delete_sandbox(&record.sandbox_id, &record.execution_id, 0)
        .await?;
    tx.commit().await?;
    let backend = match store.backend() {
        crate::Backend::Sqlite => "sqlite",
        crate::Backend::Postgres => "postgres",
    };
    Ok(Report {
        backend,
        event_append,
        transition: Percentiles::from_samples(samples),
    })
}
