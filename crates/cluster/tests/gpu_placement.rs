//! Placement counts GPUs: nodes advertise their free GPUs through the registry (real etcd, the
//! real `registry::register` heartbeat with its lease), and a start that passes GPUs through
//! goes only to a node with that many free. More than any node has at all is
//! `InvalidArgument` (the api's 400: no wait helps); more than any has free is `Exhausted`
//! (503) naming each node's count. The nodes' RPC ports are closed: a start placed on a node
//! fails there with "node <id> is not reached" (connection refused), which shows where it was placed without
//! a VM (these machines have no GPU to boot one with).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{closed_port, cluster, node_entry, start_spec};
use tokio_util::sync::CancellationToken;
use vmon_proto::cluster::NodeInfo;
use vmon_proto::gpu::GpuInventory;
use vmon_proto::node::{NodeError, StartSpec};

/// One etcd member on loopback, killed on drop.
struct Etcd {
    child: Child,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn etcd() -> (Etcd, vmon_kv::Kv) {
    for _ in 0..3 {
        let dir = tempfile::tempdir().expect("tempdir");
        let (client, peer) = (closed_port(), closed_port());
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).expect("log");
        let child = Command::new("/usr/bin/etcd")
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn /usr/bin/etcd (apt-get install etcd-server)");
        let mut e = Etcd {
            child,
            endpoint,
            _dir: dir,
        };
        for _ in 0..100 {
            if matches!(e.child.try_wait(), Ok(Some(_))) {
                break;
            }
            let cfg = vmon_kv::EtcdConfig {
                retry_for: Duration::from_millis(200),
                ..vmon_kv::EtcdConfig::new(vec![e.endpoint.clone()])
            };
            if let Ok(kv) = vmon_kv::Kv::connect_etcd(&cfg).await {
                if kv.put("probe", b"1".to_vec()).await.is_ok() {
                    let kv = vmon_kv::Kv::connect_etcd(&vmon_kv::EtcdConfig::new(vec![e
                        .endpoint
                        .clone()]))
                    .await
                    .expect("kv");
                    return (e, kv);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = e.child.kill();
    }
    panic!("etcd did not start");
}

/// A node with `total` GPUs, `free` of them free (one model).
fn info(id: &str, total: u32, free: u32) -> NodeInfo {
    node_entry(
        id,
        GpuInventory {
            total,
            free,
            models: [("10de:2330".to_string(), free)].into(),
        },
    )
}

fn spec(gpus: u32) -> StartSpec {
    start_spec(&format!("isbx{gpus}"), gpus, true)
}

#[tokio::test]
async fn starts_go_where_the_gpus_are_free() {
    let (_etcd, kv) = etcd().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let cancel = CancellationToken::new();
    // Each node advertises what its heartbeat says; `busy` turns gpu4's free count to 1.
    let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let entries = [info("plain", 0, 0), info("gpu2", 2, 1), info("gpu4", 4, 4)];
    for e in entries {
        let busy = busy.clone();
        tokio::spawn(vmon_cluster::registry::register(
            kv.clone(),
            e.id.clone(),
            move || {
                let mut e = e.clone();
                if e.id == "gpu4" && busy.load(std::sync::atomic::Ordering::SeqCst) {
                    e.gpus.free = 1;
                }
                async move { e }
            },
            |_| {},
            cancel.clone(),
        ));
    }
    // The registry (a real etcd lease and heartbeat) shows all three with their GPUs.
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = vmon_cluster::registry::members(&kv).await.expect("members");
        if seen.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let gpus: Vec<(String, u32, u32)> = {
        let mut v: Vec<_> = seen
            .iter()
            .map(|n| (n.id.clone(), n.gpus.total, n.gpus.free))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        gpus,
        [
            ("gpu2".to_string(), 2, 1),
            ("gpu4".to_string(), 4, 4),
            ("plain".to_string(), 0, 0)
        ]
    );
    let nodes = cluster(kv.clone(), dir.path());

    // More than any node has: refused at once, with the largest count.
    match nodes.start(spec(5)).await {
        Err(NodeError::InvalidArgument(m)) => {
            assert!(m.contains("asks for 5 GPUs"), "{m}");
            assert!(m.contains("the most any node has is 4"), "{m}");
        }
        other => panic!("5 GPUs must be InvalidArgument (400), got {other:?}"),
    }
    // Three: only gpu4 has them free, so the start goes there (and meets its closed port).
    match nodes.start(spec(3)).await {
        Err(NodeError::Exhausted(m)) => assert!(m.contains("node gpu4 is not reached"), "{m}"),
        other => panic!("expected the start to reach gpu4, got {other:?}"),
    }
    // Without GPUs the plain node is a candidate too (the least loaded, by name: plain last).
    match nodes.start(spec(0)).await {
        Err(NodeError::Exhausted(m)) => assert!(m.contains("is not reached"), "{m}"),
        other => panic!("expected a refused start, got {other:?}"),
    }

    // gpu4 is now busy (its heartbeat says 1 free): two GPUs fit nowhere, and the 503 says
    // each node's count.
    busy.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut last = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let fresh = cluster(kv.clone(), dir.path());
        match fresh.start(spec(2)).await {
            Err(NodeError::Exhausted(m)) if m.contains("no node can take it") => {
                last = Some(m);
                break;
            }
            other => last = Some(format!("{other:?}")),
        }
    }
    let m = last.expect("an answer");
    assert!(m.contains("gpu4 has 1 of 4 GPUs free, 2 needed"), "{m}");
    assert!(m.contains("gpu2 has 1 of 2 GPUs free, 2 needed"), "{m}");
    assert!(m.contains("plain has 0 of 0 GPUs free, 2 needed"), "{m}");
    cancel.cancel();
}
