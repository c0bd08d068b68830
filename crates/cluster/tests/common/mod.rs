//! What the cluster's tests share: a node's registry entry whose RPC port nothing listens on,
//! `ClusterNodes` over a registry, and a start to place.

use std::path::Path;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use vmon_proto::cluster::NodeInfo;
use vmon_proto::gpu::GpuInventory;
use vmon_proto::node::{NodeControl, StartSpec};

/// A loopback port nothing listens on (bound, then closed).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// Node `id`'s registry entry, fresh, with `gpus`; its RPC port refuses connections, so a
/// start placed there fails with "node <id> is not reached: … Connection refused".
pub fn node_entry(id: &str, gpus: GpuInventory) -> NodeInfo {
    NodeInfo {
        id: id.into(),
        rpc_url: format!("https://127.0.0.1:{}", closed_port()),
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
        gpus,
    }
}

/// The node contract over the registry in `kv`, trusting a CA made in `dir`.
pub fn cluster(kv: vmon_kv::Kv, dir: &Path) -> Arc<dyn NodeControl> {
    let ca = rcgen::generate_simple_self_signed(vec!["vmon test ca".into()]).expect("ca");
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca.cert.pem()).expect("write ca");
    let tls = vmon_nodeclient::tls::ClientTls::from_ca_file(&ca_file).expect("tls");
    vmon_cluster::ClusterNodes::new(kv, "token".into(), tls)
}

/// A start of `sandbox_id` from build `b1` asking for `gpus`.
pub fn start_spec(sandbox_id: &str, gpus: u32, cold_boot: bool) -> StartSpec {
    StartSpec {
        sandbox_id: sandbox_id.into(),
        execution_id: "e1".into(),
        build_id: "b1".into(),
        cold_boot,
        env_vars: Default::default(),
        envd_access_token: None,
        network: Default::default(),
        volumes: Vec::new(),
        egress: Default::default(),
        gpus,
    }
}
