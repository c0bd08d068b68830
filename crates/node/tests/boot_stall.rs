//! A cold boot whose guest makes no progress is started again, once, and the guest it gives
//! works. This binary's node checks for progress at once, before any guest could have written
//! its disk, so every first QEMU of a boot counts as stuck.

mod common;

use std::time::Duration;

use common::{host_lock, node_with, runtime, unique};
use vmon_proto::node::{NetworkPolicy, NodeCalls};

/// QEMU processes whose command line names `id` (its run directory does).
fn qemus_of(id: &str) -> usize {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| {
            let text = String::from_utf8_lossy(c);
            text.contains("qemu-system") && text.contains(id)
        })
        .count()
}

#[test]
fn a_cold_boot_that_makes_no_progress_is_started_again() {
    let node = node_with(|cfg| cfg.boot_stall_after = Duration::ZERO);
    let _shared = host_lock().read();
    runtime().block_on(async {
        let before = node.boot_restarts();
        let id = unique("stall");
        let r = node
            .boot_image(&id, 1, 384, &NetworkPolicy::default())
            .await
            .expect("a boot whose first QEMU is taken for stuck still boots");
        assert_eq!(node.boot_restarts(), before + 1, "one restart for one boot");
        assert_eq!(
            qemus_of(&id),
            1,
            "the first QEMU is gone, the second serves the guest"
        );
        let out = node
            .exec(&id, "user", "echo up; id -un", Duration::from_secs(60))
            .await
            .expect("exec");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "up\nuser\n");
        node.kill(&id, &r.execution_id).await.expect("kill");
        assert_eq!(qemus_of(&id), 0);
    });
}
