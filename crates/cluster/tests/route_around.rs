//! A start whose nodes refuse connections (their processes are gone while their registry
//! leases still run) is routed past each of them, and when none is left it is the "no node
//! can serve it" error (the api's 503) with the reason, never the first node's failure (a
//! 500). Two registry entries in an embedded KV whose RPC ports nothing listens on; the
//! cluster test `test_portable.py` resumes a paused sandbox past a killed node on real VMs.

mod common;

use common::{cluster, node_entry, start_spec};
use vmon_proto::cluster::NODES_PREFIX;
use vmon_proto::node::NodeError;

#[tokio::test]
async fn a_start_passes_every_node_that_refuses_and_ends_unavailable_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let kv = vmon_kv::Kv::open_embedded(&vmon_kv::EmbeddedConfig::new(dir.path()))
        .await
        .expect("kv");
    for id in ["node1", "node2"] {
        let value = serde_json::to_vec(&node_entry(id, Default::default())).expect("json");
        kv.put(&format!("{NODES_PREFIX}{id}"), value)
            .await
            .expect("register");
    }
    let err = cluster(kv, dir.path())
        .start(start_spec("isbx", 0, false))
        .await
        .expect_err("no node can serve it");
    match err {
        NodeError::Exhausted(m) => {
            assert!(m.contains("is not reached"), "{m}");
            assert!(m.contains("Connection refused"), "{m}");
            // Both were tried: the reason is the last one's.
            assert!(m.contains("node2"), "{m}");
        }
        other => panic!("a refused start must be Exhausted (503), not {other:?}"),
    }
}
