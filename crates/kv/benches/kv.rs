//! `cargo bench -p vmon-kv`: latencies on the embedded backend (redb in a temp dir) and on a
//! single etcd member started here.

#[path = "../tests/support/mod.rs"]
mod support;

use vmon_kv::bench::{run, Machine};
use vmon_kv::{EmbeddedConfig, Kv};

const ITERATIONS: usize = 300;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    println!("machine: {}", Machine::detect());
    let dir = tempfile::tempdir().expect("temp dir");
    let embedded = Kv::open_embedded(&EmbeddedConfig::new(dir.path()))
        .await
        .expect("open embedded kv");
    println!(
        "{}",
        run(&embedded, ITERATIONS)
            .await
            .expect("embedded benchmark")
    );
    let cluster = support::EtcdCluster::start(1).await;
    let etcd = Kv::connect_etcd(&cluster.config())
        .await
        .expect("connect to etcd");
    println!("{}", run(&etcd, ITERATIONS).await.expect("etcd benchmark"));
}
