//! The restore pool in the loop users run (issue 42): create → command → pause → resume →
//! command → fork → kill. Pauses, resumes and forks must not take the template's warm process,
//! and the process the pool makes for the next create runs at the normal CPU weight (at the
//! background one it could starve beside busy guests and every create then missed the pool).
//! Real VMs under QEMU (TCG here) and the real envd.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{host_lock, node_with, runtime, sh, start, template, unique};
use vmon_proto::node::NodeCalls;

/// The CPU weight of `pid`'s cgroup as the kernel holds it: (value, the value a normal-weight
/// group has) — `cpu.weight` under cgroup v2, `cpu.shares` under v1.
fn cpu_weight(pid: u32) -> (u64, u64) {
    let groups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup of pid");
    for line in groups.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        let path = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "cpu") {
            let file = std::path::Path::new("/sys/fs/cgroup/cpu")
                .join(path)
                .join("cpu.shares");
            return (read_u64(&file), 1024);
        }
        if controllers.is_empty() && path.starts_with("vmon") {
            let file = std::path::Path::new("/sys/fs/cgroup")
                .join(path)
                .join("cpu.weight");
            return (read_u64(&file), 100);
        }
    }
    panic!("pid {pid} is in no cpu cgroup: {groups}");
}

fn read_u64(p: &std::path::Path) -> u64 {
    let t = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    t.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {t:?}: {e}", p.display()))
}

/// Waits until the pool holds a warmed process for `build` (the refill's own event is the
/// process appearing; bounded so a refill that never comes fails the test).
async fn pool_ready(node: &vmon_node::Node, build: &str) {
    let deadline = Instant::now() + Duration::from_secs(600);
    while node.pool_depth(build) == 0 {
        assert!(
            Instant::now() < deadline,
            "the pool of {build} never refilled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn delta(after: &HashMap<String, u64>, before: &HashMap<String, u64>, k: &str) -> u64 {
    after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0)
}

#[test]
fn pauses_resumes_and_forks_leave_the_next_create_a_warm_process_made_at_normal_weight() {
    // One process per template and no growth: the pool holds exactly the next create's.
    let node = node_with(|c| {
        c.pool_size = 1;
        c.pool_max = 1;
    });
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        node.warm(&tpl);
        pool_ready(&node, &tpl).await;
        for round in 0..3 {
            let before = node.starts_by_origin();
            let id = unique("loop");
            let r = start(&node, &id, &tpl, false).await;
            assert_eq!(sh(&node, &id, "echo hi").await, "hi");
            let paused = node.pause(&id, &r.execution_id, true).await.expect("pause");
            let r = start(&node, &id, &paused.build_id, false).await;
            assert_eq!(sh(&node, &id, "echo again").await, "again");
            let point = node
                .checkpoint(&id, &r.execution_id, true)
                .await
                .expect("checkpoint");
            let child = unique("child");
            let c = start(&node, &child, &point.build_id, false).await;
            assert_eq!(sh(&node, &child, "echo child").await, "child");
            node.kill(&child, &c.execution_id)
                .await
                .expect("kill child");
            node.kill(&id, &r.execution_id).await.expect("kill");
            let after = node.starts_by_origin();
            assert_eq!(
                delta(&after, &before, "pool"),
                1,
                "round {round}: the create took the template's warm process ({after:?})"
            );
            assert_eq!(
                delta(&after, &before, "parked"),
                1,
                "round {round}: the resume continued its kept QEMU"
            );
            assert_eq!(
                delta(&after, &before, "blank") + delta(&after, &before, "fresh"),
                1,
                "round {round}: the fork child was a restore of its own"
            );
            // The refill the create started: its process is the next create's.
            pool_ready(&node, &tpl).await;
            let pids = node.warm_pids();
            assert_eq!(pids.len(), 1, "round {round}: one warm process, no growth");
            let (weight, normal) = cpu_weight(pids[0]);
            assert_eq!(
                weight, normal,
                "round {round}: the next create's process was made at the normal CPU weight"
            );
        }
    });
}
