//! `cargo bench -p vmon-api --bench control_plane`: the control plane alone (issue 42): the api's
//! router with its records (SQLite in a temp dir, then PostgreSQL 15 started here, fsync on) and
//! the embedded KV, over the tests' fake node, so no VM time is in any figure.
//!
//! Prints, per backend: creates committed per second and the latency of one create at 1, 10 and
//! 100 concurrent clients; then, with 10,000 running sandbox records, `GET /v2/sandboxes` (the
//! first page and a walk of every page), one reaper pass with nothing expired and the time the
//! reaper takes to end 1,000 expired sandboxes; and the process's resident memory before and
//! after the records exist. Requests go through the router in process (no socket), so the
//! figures are the api's own cost. `VMON_BENCH_RECORDS` changes the 10,000.

// The tests' harness (shared below) unwraps as tests do; a bench that fails should panic.
#![allow(clippy::unwrap_used)]

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../../store/tests/support/mod.rs"]
mod support;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::Harness;
use vmon_api::records::TeamLimits;
use vmon_benchstat::{Machine, Percentiles};

const CREATE: &str = r#"{"templateID":"base","timeout":3600}"#;

fn limits() -> TeamLimits {
    TeamLimits {
        max_concurrent: 1_000_000,
        max_vcpus: u32::MAX / 2,
        max_memory_mb: u32::MAX / 2,
        max_disk_mb: u32::MAX / 2,
        max_lifetime_secs: 24 * 3600,
    }
}

/// The resident memory of this process, in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// One create through the router; its id and how long it took.
async fn create(h: &Harness, body: &str) -> (String, Duration) {
    let t = Instant::now();
    let r = h.req("POST", "/v2/sandboxes", Some(body)).await;
    let took = t.elapsed();
    assert_eq!(r.status, StatusCode::CREATED, "create: {:?}", r.json);
    let id = r.json["sandboxID"].as_str().unwrap_or_default().to_string();
    (id, took)
}

/// `total` creates by `clients` concurrent clients: per-create latencies, wall time and ids.
async fn creates(h: &Arc<Harness>, clients: usize, total: usize, body: &'static str) -> Round {
    let ids = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (h, ids, next) = (h.clone(), ids.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut took = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                let (id, d) = create(&h, body).await;
                took.push(d);
                ids.lock().unwrap_or_else(|p| p.into_inner()).push(id);
            }
            took
        }));
    }
    let mut took = Vec::with_capacity(total);
    for task in tasks {
        took.extend(task.await.expect("client task"));
    }
    let wall = t.elapsed();
    let ids = std::mem::take(&mut *ids.lock().unwrap_or_else(|p| p.into_inner()));
    Round {
        latency: Percentiles::from_samples(took),
        wall,
        ids,
    }
}

struct Round {
    latency: Percentiles,
    wall: Duration,
    ids: Vec<String>,
}

/// Kills `ids` with 10 concurrent clients.
async fn kill_all(h: &Arc<Harness>, ids: Vec<String>) {
    let ids = Arc::new(Mutex::new(ids));
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (h, ids) = (h.clone(), ids.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let Some(id) = ids.lock().unwrap_or_else(|p| p.into_inner()).pop() else {
                    return;
                };
                let r = h.req("DELETE", &format!("/sandboxes/{id}"), None).await;
                assert_eq!(r.status, StatusCode::NO_CONTENT, "kill {id}: {:?}", r.json);
            }
        }));
    }
    for task in tasks {
        task.await.expect("kill task");
    }
}

/// `GET /v2/sandboxes`: the first page `n` times, then `walks` walks of every page.
async fn lists(h: &Harness, n: usize, walks: usize, expect: usize) {
    let mut first = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let r = h.req("GET", "/v2/sandboxes", None).await;
        first.push(t.elapsed());
        assert_eq!(r.status, StatusCode::OK, "list: {:?}", r.json);
    }
    println!(
        "  GET /v2/sandboxes, first page (100)    {}",
        Percentiles::from_samples(first)
    );
    let mut whole = Vec::new();
    for _ in 0..walks {
        let t = Instant::now();
        let mut seen = 0;
        let mut token: Option<String> = None;
        loop {
            let path = match &token {
                Some(tok) => format!("/v2/sandboxes?limit=1000&nextToken={tok}"),
                None => "/v2/sandboxes?limit=1000".to_string(),
            };
            let r = h.req("GET", &path, None).await;
            assert_eq!(r.status, StatusCode::OK, "list page: {:?}", r.json);
            seen += r.json.as_array().map_or(0, |a| a.len());
            token = r
                .headers
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            if token.is_none() {
                break;
            }
        }
        whole.push(t.elapsed());
        assert_eq!(seen, expect, "a walk of every page saw {seen} sandboxes");
    }
    println!(
        "  GET /v2/sandboxes, all {expect} (pages of 1000) {}",
        Percentiles::from_samples(whole)
    );
}

/// The reaper at `records` running sandboxes: a pass with nothing expired, then the time until
/// `expired` sandboxes whose timeout passed are ended.
async fn reaper(h: &Arc<Harness>, records: usize, expired: usize) {
    let in_flight = Arc::new(Mutex::new(HashSet::new()));
    let mut passes = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        h.control.reap_once(&in_flight).await;
        passes.push(t.elapsed());
    }
    println!(
        "  reaper pass, nothing expired           {}",
        Percentiles::from_samples(passes)
    );
    let round = creates(h, 10, expired, r#"{"templateID":"base","timeout":1}"#).await;
    drop(round.ids);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let t = Instant::now();
    loop {
        h.control.reap_once(&in_flight).await;
        if h.node.running_count() <= records {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "the reaper did not end {expired} expired sandboxes in 10 min"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "  reaper: {expired} expired ended in       {:8.1} ms",
        t.elapsed().as_secs_f64() * 1000.0
    );
}

async fn run(backend: &str, h: Harness) {
    let h = Arc::new(h);
    println!("\n## {backend}");
    for (clients, total) in [(1, 200), (10, 1000), (100, 2000)] {
        let round = creates(&h, clients, total, CREATE).await;
        println!(
            "  create, {clients:>3} clients: {:7.1} creates/s   {}",
            total as f64 / round.wall.as_secs_f64(),
            round.latency
        );
        kill_all(&h, round.ids).await;
    }
    let records: usize = std::env::var("VMON_BENCH_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let before = rss_mib();
    let t = Instant::now();
    let round = creates(&h, 100, records, CREATE).await;
    println!(
        "  {records} records made in {:.1} s; resident memory {before:.0} -> {:.0} MiB",
        t.elapsed().as_secs_f64(),
        rss_mib()
    );
    lists(&h, 50, 5, records).await;
    reaper(&h, records, 1000).await;
    kill_all(&h, round.ids).await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!("machine: {}", Machine::detect());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average: {}", load.trim());
    run("SQLite", common::harness(limits()).await).await;
    let pg = support::Postgres::start(true).await;
    let url = pg.url();
    let h = common::harness_configured(limits(), move |c| c.store_url = Some(url)).await;
    run("PostgreSQL 15", h).await;
}
