//! How vmon's latency benchmarks report (`vmon bench kv`, `cargo bench -p vmon-kv`,
//! `cargo bench -p vmon-store`): the median and tail of measured samples, and the machine they
//! were measured on. Figures only: it must never measure or time anything itself.

use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let ms = Duration::from_millis;
        let p = Percentiles::from_samples((1..=100).rev().map(ms).collect());
        assert_eq!((p.samples, p.p50, p.p99), (100, ms(51), ms(99)));
        let none = Percentiles::from_samples(Vec::new());
        assert_eq!((none.samples, none.p50), (0, Duration::ZERO));
        assert!(
            p.to_string()
                .starts_with("p50   51.000 ms  p99   99.000 ms"),
            "{p}"
        );
    }
}
