//! A start whose nodes refuse connections (their processes are gone while their registry
//! leases still run) is routed past each of them, and when none is left it is the "no node
//! can serve it" error (the api's 503) with the reason, never the first node's failure (a
//! 500). Two registry entries in an embedded KV whose RPC ports nothing listens on; the
//! cluster test `test_portable.py` resumes a paused sandbox past a killed node on real VMs.

use std::time::{SystemTime, UNIX_EPOCH};

use vmon_proto::cluster::{NodeInfo, NODES_PREFIX};
use vmon_proto::node::{NodeControl, NodeError, StartSpec};

/// A loopback port nothing listens on (bound, then closed).
async fn closed_port() -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    l.local_addr().expect("addr").port()
}

fn entry(id: &str, port: u16) -> NodeInfo {
    NodeInfo {
        id: id.into(),
        rpc_url: format!("https://127.0.0.1:{port}"),
        ingress_url: None,
        host: "host".into(),
        accel: "tcg".into(),
        qemu_version: "7.2".into(),
        cpu_baseline: "cpu".into(),
        vcpus: 2,
        memory_mb: 8192,
        free_memory_mb: 8192,
        free_disk_mb: 100_000,
        free_slots: 10,
        running: 0,
        updated_unix: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        gpus: Default::default(),
    }
}

#[tokio::test]
async fn a_start_passes_every_node_that_refuses_and_ends_unavailable_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kv = vmon_kv::Kv::open_embedded(&vmon_kv::EmbeddedConfig::new(dir.path()))
        .await
        .expect("kv");
    for id in ["node1", "node2"] {
        let value = serde_json::to_vec(&entry(id, closed_port().await)).expect("json");
        kv.put(&format!("{NODES_PREFIX}{id}"), value)
            .await
            .expect("register");
    }
    let ca = rcgen::generate_simple_self_signed(vec!["vmon test ca".into()]).expect("ca");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.cert.pem()).expect("write ca");
    let tls = vmon_nodeclient::tls::ClientTls::from_ca_file(&ca_file).expect("tls");
    let nodes: std::sync::Arc<dyn NodeControl> =
        vmon_cluster::ClusterNodes::new(kv, "token".into(), tls);
    let err = nodes
        .start(StartSpec {
            sandbox_id: "isbx".into(),
            execution_id: "e1".into(),
            build_id: "b1".into(),
            cold_boot: false,
            env_vars: Default::default(),
            envd_access_token: None,
            network: Default::default(),
            volumes: Vec::new(),
            egress: Default::default(),
            gpus: 0,
        })
        .await
        .expect_err("no node can serve it");
    match err {
        NodeError::Exhausted(m) => {
            assert!(m.contains("refuses connections"), "{m}");
            // Both were tried: the reason is the last one's.
            assert!(m.contains("node2"), "{m}");
        }
        other => panic!("a refused start must be Exhausted (503), not {other:?}"),
    }
}
