//! `cargo bench -p vmon-store`: commit latencies on SQLite (a temp file, synchronous=FULL) and
//! on PostgreSQL 15 started here (fsync on).

#[path = "../tests/support/mod.rs"]
mod support;

use vmon_store::bench::run;
use vmon_store::{Store, StoreConfig};

const ITERATIONS: usize = 300;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!("machine: {}", vmon_benchstat::Machine::detect());
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
