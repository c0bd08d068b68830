//! Latency benchmarks of the operations the API does per request, callable from
//! `cargo bench -p vmon-kv` and from `vmon bench kv`. Sequential (one operation in flight),
//! so the figures are round-trip latencies, not throughput.

use std::time::{Duration, Instant};

pub use vmon_benchstat::{Machine, Percentiles};

use crate::{Expect, Kv, KvError, Write, WriteOutcome};

/// Figures for one backend.
#[derive(Clone, Debug)]
pub struct Report {
    pub backend: &'static str,
    /// `lock` → read → fenced CAS write → `unlock`: one sandbox transition's coordination.
    pub lock_cas_unlock: Percentiles,
    /// `acquire` then `release` of a team admission counter.
    pub admission: Percentiles,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "kv {:<8} lock+CAS+unlock      {}",
            self.backend, self.lock_cas_unlock
        )?;
        write!(
            f,
            "kv {:<8} admission acq+rel    {}",
            self.backend, self.admission
        )
    }
}

/// Runs `iterations` of each operation against `kv`, under keys prefixed `bench/`.
pub async fn run(kv: &Kv, iterations: usize) -> Result<Report, KvError> {
    kv.put("bench/state", "0").await?;
    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations + iterations / 10 {
        let start = Instant::now();
        let guard = kv.lock("bench/sandbox", Duration::from_secs(30)).await?;
        let current = kv.get("bench/state").await?;
        let expect = current.map_or(Expect::Absent, |e| Expect::Revision(e.mod_revision));
        let write = Write::put("bench/state", i.to_string())
            .expect(expect)
            .fenced(&guard.fence());
        let outcome = kv.write(write).await?;
        guard.unlock().await?;
        if !matches!(outcome, WriteOutcome::Committed { .. }) {
            return Err(KvError::InvalidArgument(format!(
                "benchmark write not applied: {outcome:?}"
            )));
        }
        // The first tenth warms connections and caches up.
        if i >= iterations / 10 {
            samples.push(start.elapsed());
        }
    }
    let lock_cas_unlock = Percentiles::from_samples(samples);

    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations + iterations / 10 {
        let start = Instant::now();
        if !kv.acquire("bench/team", u64::MAX).await? {
            return Err(KvError::InvalidArgument(
                "benchmark admission refused".to_owned(),
            ));
        }
        kv.release("bench/team").await?;
        if i >= iterations / 10 {
            samples.push(start.elapsed());
        }
    }
    Ok(Report {
        backend: kv.backend(),
        lock_cas_unlock,
        admission: Percentiles::from_samples(samples),
    })
}
