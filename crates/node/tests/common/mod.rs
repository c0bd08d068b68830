//! Shared harness for the node's VM tests: one node (one per host: slots are host-wide) on one
//! runtime for every test of a binary, and the data dir whose image cache survives runs.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use vmon_node::{Node, NodeConfig};

pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("runtime")
    })
}

pub fn data_dir() -> PathBuf {
    std::env::var_os("VMON_TEST_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/vmon-ci"))
}

/// The envd binary cargo built beside this test (target/<profile>/envd).
pub fn envd_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("VMON_ENVD_BINARY") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let p = profile_dir.join("envd");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build -p vmon-envd` first (or set VMON_ENVD_BINARY)",
        p.display()
    );
    p
}

pub fn node() -> Arc<Node> {
    static NODE: OnceLock<Arc<Node>> = OnceLock::new();
    NODE.get_or_init(|| {
        let _ = tracing_subscriber_init();
        runtime().block_on(async {
            let mut cfg = NodeConfig::new(data_dir());
            cfg.envd_binary = Some(envd_binary());
            cfg.pool_size = std::env::var("VMON_TEST_POOL")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            Node::open(cfg).await.expect("node opens")
        })
    })
    .clone()
}

fn tracing_subscriber_init() -> Option<()> {
    None
}

/// Names of the network namespaces that exist now.
pub fn netns_list() -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

pub fn unique(prefix: &str) -> String {
    let n: u64 = rand_u64();
    format!("{prefix}{n:x}")
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut b);
    }
    u64::from_le_bytes(b)
}

/// Tests that count host-wide resources take this exclusively; the others share it.
pub fn host_lock() -> &'static std::sync::RwLock<()> {
    static L: OnceLock<std::sync::RwLock<()>> = OnceLock::new();
    L.get_or_init(|| std::sync::RwLock::new(()))
}
