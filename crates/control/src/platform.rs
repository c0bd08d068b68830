//! The platform's own metrics, served as Prometheus text at `GET /metrics`: sandboxes by state,
//! transitions and their latencies, restore pool depth, webhook delivery outcomes.
//!
//! Counters live in one process-wide [`Platform`] registry ([`platform()`]), so any part of
//! the api can bump them without being handed a handle. Gauges (sandboxes by state, pool depth)
//! are read when scraped.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Upper bounds (seconds) of the transition latency histogram. Restores under TCG take seconds,
/// cold boots minutes.
const BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// How one webhook delivery attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum WebhookOutcome {
    /// The receiver answered 2xx.
    Delivered,
    /// The receiver answered, but not 2xx.
    Rejected,
    /// No answer within the attempt's timeout.
    TimedOut,
    /// Connecting or sending failed.
    Failed,
}

impl WebhookOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookOutcome::Delivered => "delivered",
            WebhookOutcome::Rejected => "rejected",
            WebhookOutcome::TimedOut => "timed_out",
            WebhookOutcome::Failed => "failed",
        }
    }
}

#[derive(Default, Clone)]
struct Histogram {
    /// Per bucket of [`BUCKETS`], not cumulative; the last slot is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len() + 1];
        }
        let i = BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(BUCKETS.len());
        self.counts[i] += 1;
        self.sum += secs;
        self.count += 1;
    }
}

#[derive(Default)]
struct Counters {
    /// (operation, outcome) → latency histogram (its count is the transition counter).
    transitions: BTreeMap<(String, &'static str), Histogram>,
    webhooks: BTreeMap<WebhookOutcome, u64>,
}

/// The process-wide registry of the platform's counters.
#[derive(Default)]
pub struct Platform {
    counters: Mutex<Counters>,
}

/// The registry every part of the api reports to.
pub fn platform() -> &'static Platform {
    static PLATFORM: OnceLock<Platform> = OnceLock::new();
    PLATFORM.get_or_init(Platform::default)
}

impl Platform {
    fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records one sandbox transition (`create`, `kill`, `pause`, `connect`, `fork`, ...): how
    /// it ended and how long it took. The REST layer reports every request-driven one, the
    /// reaper its timeouts (`timeout_kill`, `timeout_pause`).
    pub fn transition(&self, operation: &str, ok: bool, took: Duration) {
        let key = (label_value(operation), if ok { "ok" } else { "error" });
        self.counters()
            .transitions
            .entry(key)
            .or_default()
            .observe(took.as_secs_f64());
    }

    /// Counts one webhook delivery attempt by its outcome. For the webhook dispatcher:
    /// `vmon_api::telemetry::platform().webhook_delivery(WebhookOutcome::Delivered)`.
    pub fn webhook_delivery(&self, outcome: WebhookOutcome) {
        *self.counters().webhooks.entry(outcome).or_default() += 1;
    }

    /// The Prometheus text exposition, with the gauges read by the caller.
    pub fn render(&self, sandboxes_by_state: &[(&str, u64)], pool: &[(String, usize)]) -> String {
        let c = self.counters();
        let mut out = String::new();
        let _ = writeln!(out, "# HELP vmon_sandboxes Sandboxes by state.");
        let _ = writeln!(out, "# TYPE vmon_sandboxes gauge");
        for (state, n) in sandboxes_by_state {
            let _ = writeln!(
                out,
                "vmon_sandboxes{{state=\"{}\"}} {n}",
                label_value(state)
            );
        }
        let _ = writeln!(
            out,
            "# HELP vmon_sandbox_transitions_total Sandbox transitions by operation and outcome."
        );
        let _ = writeln!(out, "# TYPE vmon_sandbox_transitions_total counter");
        for ((op, outcome), h) in &c.transitions {
            let _ = writeln!(
                out,
                "vmon_sandbox_transitions_total{{operation=\"{op}\",outcome=\"{outcome}\"}} {}",
                h.count
            );
        }
        let _ = writeln!(
            out,
            "# HELP vmon_sandbox_transition_duration_seconds How long sandbox transitions took."
        );
        let _ = writeln!(
            out,
            "# TYPE vmon_sandbox_transition_duration_seconds histogram"
        );
        for ((op, outcome), h) in &c.transitions {
            let labels = format!("operation=\"{op}\",outcome=\"{outcome}\"");
            let mut cumulative = 0;
            for (i, le) in BUCKETS.iter().enumerate() {
                cumulative += h.counts.get(i).copied().unwrap_or(0);
                let _ = writeln!(
                    out,
                    "vmon_sandbox_transition_duration_seconds_bucket{{{labels},le=\"{le}\"}} {cumulative}"
                );
            }
            let _ = writeln!(
                out,
                "vmon_sandbox_transition_duration_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
                h.count
            );
            let _ = writeln!(
                out,
                "vmon_sandbox_transition_duration_seconds_sum{{{labels}}} {}",
                h.sum
            );
            let _ = writeln!(
                out,
                "vmon_sandbox_transition_duration_seconds_count{{{labels}}} {}",
                h.count
            );
        }
        let _ = writeln!(
            out,
            "# HELP vmon_pool_depth Pre-spawned restore processes ready per build."
        );
        let _ = writeln!(out, "# TYPE vmon_pool_depth gauge");
        for (build, n) in pool {
            let _ = writeln!(
                out,
                "vmon_pool_depth{{build=\"{}\"}} {n}",
                label_value(build)
            );
        }
        let _ = writeln!(
            out,
            "# HELP vmon_webhook_deliveries_total Webhook delivery attempts by outcome."
        );
        let _ = writeln!(out, "# TYPE vmon_webhook_deliveries_total counter");
        for outcome in [
            WebhookOutcome::Delivered,
            WebhookOutcome::Rejected,
            WebhookOutcome::TimedOut,
            WebhookOutcome::Failed,
        ] {
            let n = c.webhooks.get(&outcome).copied().unwrap_or(0);
            let _ = writeln!(
                out,
                "vmon_webhook_deliveries_total{{outcome=\"{}\"}} {n}",
                outcome.as_str()
            );
        }
        out
    }
}

/// A label value as the exposition format wants it escaped.
fn label_value(s: &str) -> String {
    s.chars()
        .take(200)
        .flat_map(|c| match c {
            '\\' => vec!['\\', '\\'],
            '"' => vec!['\\', '"'],
            '\n' => vec!['\\', 'n'],
            c => vec![c],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family() {
        let p = Platform::default();
        p.transition("create", true, Duration::from_millis(300));
        p.transition("create", true, Duration::from_secs(400));
        p.transition("pause", false, Duration::from_millis(5));
        p.webhook_delivery(WebhookOutcome::Delivered);
        p.webhook_delivery(WebhookOutcome::Delivered);
        let text = p.render(&[("running", 3), ("paused", 1)], &[("b\"1".to_string(), 2)]);
        assert!(text.contains("vmon_sandboxes{state=\"running\"} 3"));
        assert!(
            text.contains("vmon_sandbox_transitions_total{operation=\"create\",outcome=\"ok\"} 2")
        );
        assert!(text.contains(
            "vmon_sandbox_transition_duration_seconds_bucket{operation=\"create\",outcome=\"ok\",le=\"0.5\"} 1"
        ));
        assert!(text.contains(
            "vmon_sandbox_transition_duration_seconds_bucket{operation=\"create\",outcome=\"ok\",le=\"+Inf\"} 2"
        ));
        assert!(text.contains("vmon_pool_depth{build=\"b\\\"1\"} 2"));
        assert!(text.contains("vmon_webhook_deliveries_total{outcome=\"delivered\"} 2"));
        assert!(text.contains("vmon_webhook_deliveries_total{outcome=\"failed\"} 0"));
    }
}
