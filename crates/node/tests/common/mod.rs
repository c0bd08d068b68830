//! Shared harness for the node's VM tests: one node (one per host: slots are host-wide) on one
//! runtime for every test of a binary, and the data dir whose image cache survives runs.

#![allow(dead_code)]

pub mod net;

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
    node_with(|_| {})
}

/// The test binary's node, its configuration changed by `tweak` when this call opens it (a
/// binary's first call does; later calls get that node).
pub fn node_with(tweak: impl FnOnce(&mut NodeConfig)) -> Arc<Node> {
    static NODE: OnceLock<Arc<Node>> = OnceLock::new();
    NODE.get_or_init(|| {
        let _ = tracing_subscriber_init();
        runtime().block_on(async {
            let mut cfg = NodeConfig::new(data_dir());
            cfg.envd_binary = Some(envd_binary());
            // Tests count namespaces: no background slot creation.
            cfg.spare_slots = 0;
            cfg.pool_size = std::env::var("VMON_TEST_POOL")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            tweak(&mut cfg);
            // The previous test binary's node may still be letting go of the data dir (a
            // child it forked holds the lock until it execs): wait a bounded while for it.
            let mut waited = 0;
            let node = loop {
                match Node::open(cfg.clone()).await {
                    Ok(n) => break n,
                    Err(e) if waited < 60 && e.to_string().contains("another vmon node") => {
                        eprintln!("waiting for the data dir: {e:#}");
                        waited += 1;
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    }
                    Err(e) => panic!("node opens: {e:#}"),
                }
            };
            // Sandboxes a crashed earlier run left behind were re-adopted: stop them.
            use vmon_proto::node::NodeCalls;
            for r in node.list_running().await.unwrap_or_default() {
                let _ = node.kill(&r.sandbox_id, &r.execution_id).await;
            }
            node
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

/// Builds a plain template (1 vCPU, `memory_mb`, the image's disk, no start command) as
/// `build_id` on `node`.
pub async fn build_plain(node: &Node, build_id: &str, memory_mb: u32) {
    use vmon_proto::node::{NodeCalls, TemplateSpec};
    node.build_template(TemplateSpec {
        build_id: build_id.to_string(),
        vcpus: 1,
        memory_mb,
        disk_mb: 0,
        start_cmd: None,
        ready_cmd: None,
        warm_request: None,
        env_vars: Default::default(),
        image: None,
        layer: None,
    })
    .await
    .unwrap_or_else(|e| panic!("template build {build_id}: {e}"));
}

/// The template every snapshot test restores from: built once per image (the build id carries
/// the image hash), then found in the data dir by later runs.
pub fn template(node: &std::sync::Arc<Node>) -> String {
    static T: OnceLock<String> = OnceLock::new();
    T.get_or_init(|| {
        runtime().block_on(async {
            let image = node.image().await.expect("guest image");
            let id = format!("test-tpl-{}", image.manifest.hash);
            build_plain(node, &id, 512).await;
            id
        })
    })
    .clone()
}

/// Starts a sandbox from `build` (memory restore unless `cold`).
pub async fn start(node: &Node, id: &str, build: &str, cold: bool) -> vmon_proto::node::Running {
    use vmon_proto::node::{NetworkPolicy, NodeCalls, StartSpec};
    node.start(StartSpec {
        egress: Default::default(),
        gpus: 0,
        volumes: Vec::new(),
        sandbox_id: id.to_string(),
        execution_id: unique("e"),
        build_id: build.to_string(),
        cold_boot: cold,
        env_vars: [("VMON_TEST".to_string(), "1".to_string())].into(),
        envd_access_token: Some(format!("tok-{id}")),
        network: NetworkPolicy {
            allow_internet_access: true,
            ..Default::default()
        },
    })
    .await
    .unwrap_or_else(|e| panic!("start {id} from {build}: {e}"))
}

/// Runs `cmd` as root and returns its trimmed stdout, failing the test on a non-zero exit.
pub async fn sh(node: &Node, id: &str, cmd: &str) -> String {
    let out = node
        .exec(id, "root", cmd, std::time::Duration::from_secs(120))
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?} in {id}: {e:#}"));
    assert_eq!(
        out.exit_code,
        0,
        "{cmd:?} in {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A python process that keeps a random token only in its memory and serves it on a port.
pub const TOKEN_SERVER: &str = r#"cat > /tmp/tok.py <<'PY'
import os, socket
tok = os.urandom(16).hex()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7777)); s.listen(8)
while True:
    c, _ = s.accept(); c.sendall(tok.encode()); c.close()
PY
setsid -f python3 /tmp/tok.py >/dev/null 2>&1 </dev/null
up=0
for i in $(seq 600); do (exec 3<>/dev/tcp/127.0.0.1/7777) 2>/dev/null && up=1 && break; sleep 0.1; done
rm /tmp/tok.py
[ "$up" = 1 ] || { echo "the token server did not listen within 60 s" >&2; exit 1; }"#;

pub const READ_TOKEN: &str = "timeout 60 bash -c 'exec 3<>/dev/tcp/127.0.0.1/7777; cat <&3'";

/// Whether the node lists `id` among the sandboxes it runs.
pub async fn runs(node: &Node, id: &str) -> bool {
    use vmon_proto::node::NodeCalls;
    node.list_running()
        .await
        .expect("list_running")
        .iter()
        .any(|s| s.sandbox_id == id)
}
