//! `cargo bench -p vmon-store`: commit latencies on SQLite (a temp file, synchronous=FULL) and
//! on PostgreSQL 15 started here (fsync on).

#[path = "../tests/support/mod.rs"]
mod support;

use vmon_store::bench::run;
use vmon_store::{Store, StoreConfig};

const ITERATIONS: usize = 300;

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("nproc {cpus}, CPU {model}, kernel {}", kernel.trim())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!("machine: {}", machine());
    let dir = tempfile::tempdir().expect("temp dir");
    let sqlite = Store::open(&StoreConfig::sqlite(
        dir.path().join("bench.db"),
        support::KEY,
    ))
    .await
    .expect("sqlite");
    println!(
        "{}",
        run(&sqlite, ITERATIONS).await.expect("sqlite benchmark")
    );
    let pg = support::Postgres::start(true).await;
    let postgres = Store::open(&StoreConfig::postgres(pg.url(), support::KEY))
        .await
        .expect("postgres");
    println!(
        "{}",
        run(&postgres, ITERATIONS)
            .await
            .expect("postgres benchmark")
    );
    postgres.close().await;
}
