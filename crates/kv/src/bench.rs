//! Latency benchmarks of the operations the API does per request, callable from
//! `cargo bench -p vmon-kv` and from `vmon bench kv`. Sequential (one operation in flight),
//! so the figures are round-trip latencies, not throughput.

use std::time::{Duration, Instant};

use crate::{Expect, Kv, KvError, Write, WriteOutcome};

/// Median and tail of one measured operation.
#[derive(Clone, Debug)]
pub struct Percentiles {
    pub samples: usize,
    pub p50: Duration,
    pub p99: Duration,
}

impl Percentiles {
    /// From raw samples (sorted here).
    pub fn from_samples(mut samples: Vec<Duration>) -> Percentiles {
        samples.sort();
        let at = |q: f64| {
            let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples.get(i).copied().unwrap_or_default()
        };
        Percentiles {
            samples: samples.len(),
            p50: at(0.50),
            p99: at(0.99),
        }
    }
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        write!(
            f,
            "p50 {:8.3} ms  p99 {:8.3} ms  (n={})",
            ms(self.p50),
            ms(self.p99),
            self.samples
        )
    }
}

/// The machine the figures were measured on.
#[derive(Clone, Debug)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
}

impl Machine {
    pub fn detect() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|r| r.split_once(':'))
                    .map(|(_, m)| m.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned();
        Machine {
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            kernel,
        }
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "nproc {}, CPU {}, kernel {}",
            self.cpus, self.cpu_model, self.kernel
        )
    }
}

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
