//! GPU accounting on a real node. These machines have no GPU and no IOMMU: the node's sysfs
//! root and `/dev/vfio` are a tree this test builds in the shape of a host with two GPUs (it
//! stands in for the hardware only for that reason). A GPU start reaches a real QEMU, which
//! refuses the device (no such host device here): the node gives the GPUs back and their
//! device node back to root. The other release paths (kill, pause, a QEMU found dead) run on
//! real VMs marked as holding GPUs, since none can be given a device here.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use common::{host_lock, node_with, runtime, start, template, unique};
use vmon_proto::node::{NetworkPolicy, NodeCalls, NodeError, StartSpec};

/// The fake host: groups 3 and 4 with one GPU each; `/dev/vfio/{3,4}` as plain files.
fn fake_host() -> (PathBuf, PathBuf) {
    let root = std::env::temp_dir().join(unique("vmon-gpu-sysfs-"));
    let dev = root.join("dev-vfio");
    let d = |addr, group| vmon_vm::vfio::fake::Dev {
        addr,
        class: 0x030200,
        model: "10de:2330",
        driver: Some("vfio-pci"),
        group: Some(group),
    };
    vmon_vm::vfio::fake::build(&root, &[d("0000:e1:00.0", 3), d("0000:e2:00.0", 4)])
        .expect("fake sysfs");
    std::fs::create_dir_all(&dev).expect("dev");
    for g in ["vfio", "3", "4"] {
        std::fs::write(dev.join(g), b"").expect("dev node");
    }
    (root, dev)
}

/// The fake `/dev/vfio` the binary's node was opened with.
static DEV: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

fn node() -> std::sync::Arc<vmon_node::Node> {
    node_with(|cfg| {
        let (root, dev) = fake_host();
        cfg.sysfs_root = root;
        cfg.vfio_dev_dir = dev.clone();
        let _ = DEV.set(dev);
    })
}

fn free(node: &vmon_node::Node) -> (u32, u32) {
    let i = node.gpu_inventory();
    (i.total, i.free)
}

#[test]
fn a_gpu_start_qemu_refuses_gives_the_gpus_back() {
    let _g = host_lock().read().unwrap_or_else(|p| p.into_inner());
    let node = node();
    let build = template(&node);
    runtime().block_on(async {
        assert_eq!(free(&node), (2, 2));
        let spec = |gpus| StartSpec {
            egress: Default::default(),
            gpus,
            volumes: Vec::new(),
            sandbox_id: unique("gpu"),
            execution_id: unique("e"),
            build_id: build.clone(),
            // Asked for a restore: a GPU sandbox boots anyway.
            cold_boot: false,
            env_vars: Default::default(),
            envd_access_token: Some("tok".into()),
            network: NetworkPolicy::default(),
        };
        match node.start(spec(3)).await {
            Err(NodeError::InvalidArgument(m)) => assert!(m.contains("this node has 2"), "{m}"),
            other => panic!("3 GPUs of 2: {other:?}"),
        }
        let e = node.start(spec(1)).await.expect_err("no such host device");
        // The start reached the launch and failed there: QEMU refuses the device (no such host
        // device), or, where the node lacks CAP_SYS_RESOURCE (containers such as this CI's),
        // raising RLIMIT_MEMLOCK for the passthrough is refused before QEMU runs.
        let m = e.to_string();
        assert!(
            m.contains("vfio")
                || m.contains("starting /usr/bin/qemu-system-x86_64: Operation not permitted"),
            "{m}"
        );
        assert_eq!(free(&node), (2, 2), "the failed start gave its GPU back");
        let dev = DEV.get().expect("the fake dev dir");
        for g in ["3", "4"] {
            let m = std::fs::metadata(dev.join(g)).expect("dev node");
            assert_eq!((m.uid(), m.gid()), (0, 0), "/dev/vfio/{g} is root's again");
        }
        let running = node.list_running().await.expect("list");
        assert!(
            running.iter().all(|r| !r.sandbox_id.starts_with("gpu")),
            "{running:?}"
        );
    });
}

#[test]
fn kill_pause_and_a_dead_qemu_give_the_gpus_back() {
    let _g = host_lock().read().unwrap_or_else(|p| p.into_inner());
    let node = node();
    let build = template(&node);
    runtime().block_on(async {
        // Kill.
        let id = unique("gk");
        let r = start(&node, &id, &build, false).await;
        node.hold_gpus(&id, &[3, 4]);
        assert_eq!(free(&node).1, 0);
        node.kill(&id, &r.execution_id).await.expect("kill");
        assert_eq!(free(&node), (2, 2), "kill");

        // Pause: filesystem-only for a GPU sandbox, and its QEMU ends.
        let id = unique("gp");
        let r = start(&node, &id, &build, false).await;
        node.hold_gpus(&id, &[3]);
        assert_eq!(free(&node).1, 1);
        let paused = node
            .pause(&id, &r.execution_id, false)
            .await
            .expect("pause");
        assert_eq!(free(&node), (2, 2), "pause");
        let _ = node.delete_build(&paused.build_id).await;

        // A QEMU that died, found by the reaper.
        let id = unique("gd");
        start(&node, &id, &build, false).await;
        node.hold_gpus(&id, &[4]);
        assert_eq!(free(&node).1, 1);
        node.crash_vm(&id).await.expect("crash");
        let dead = node.reap_dead().await;
        assert!(dead.contains(&id), "{dead:?}");
        assert_eq!(free(&node), (2, 2), "reaped");
    });
}
