//! Boot sandboxes: real VMs under QEMU (TCG here), the real envd, real network slots.

mod common;

use std::net::IpAddr;
use std::time::Duration;

use common::{host_lock, netns_list, node, runs, runtime, unique};
use vmon_node::envd_client;
use vmon_proto::node::{NetworkPolicy, NodeCalls, NodeError, StartSpec};

fn open_policy() -> NetworkPolicy {
    NetworkPolicy {
        allow_internet_access: true,
        ..Default::default()
    }
}

#[test]
fn boots_answers_health_and_runs_a_command() {
    let node = node();
    let _shared = host_lock().read();
    runtime().block_on(async {
        let id = unique("boot");
        let r = node
            .boot_image(&id, 1, 512, &open_policy())
            .await
            .expect("boot");
        assert!(
            envd_client::healthy(r.addr(49983)).await,
            "envd /health over the slot network"
        );
        let out = node
            .exec(&id, "user", "echo hi; id -un", Duration::from_secs(60))
            .await
            .expect("Process.Start");
        assert_eq!(out.exit_code, 0);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "hi\nuser\n");
        let ip = node
            .exec(
                &id,
                "root",
                "ip -4 -o addr show eth0",
                Duration::from_secs(60),
            )
            .await
            .expect("ip addr");
        assert!(
            String::from_utf8_lossy(&ip.stdout).contains("169.254.0.21/30"),
            "{}",
            String::from_utf8_lossy(&ip.stdout)
        );
        // Under TCG the guest runs without address-space randomisation, so a command's shell
        // and libraries sit where the previous command's did and their translation is reused.
        if node.accel().accel == vmon_vm::Accel::Tcg {
            let mut maps = Vec::new();
            for _ in 0..2 {
                let m = node
                    .exec(
                        &id,
                        "user",
                        "grep -m1 libc /proc/self/maps",
                        Duration::from_secs(60),
                    )
                    .await
                    .expect("maps");
                assert_eq!(m.exit_code, 0);
                maps.push(String::from_utf8_lossy(&m.stdout).into_owned());
            }
            assert!(maps[0].contains("libc"), "{maps:?}");
            assert_eq!(maps[0], maps[1], "libc moved between two commands");
        }
        let running = node.list_running().await.expect("list_running");
        let me = running.iter().find(|s| s.sandbox_id == id).expect("listed");
        node.kill(&id, &me.execution_id).await.expect("kill");
        assert!(!envd_client::healthy(r.addr(49983)).await);
    });
}

#[test]
fn rootfs_writes_survive_a_cold_reboot_from_the_same_disk() {
    let node = node();
    let _shared = host_lock().read();
    runtime().block_on(async {
        let id = unique("disk");
        let r = node
            .boot_image(&id, 1, 512, &open_policy())
            .await
            .expect("boot");
        let out = node
            .exec(
                &id,
                "user",
                "echo persisted-$((6*7)) > /home/user/note.txt",
                Duration::from_secs(60),
            )
            .await
            .expect("write");
        assert_eq!(out.exit_code, 0, "{}", String::from_utf8_lossy(&out.stderr));
        let build = node
            .pause(&id, &r.execution_id, false)
            .await
            .expect("filesystem pause");
        assert!(!build.has_memory);
        assert!(!envd_client::healthy(r.addr(49983)).await, "VM stopped");
        let again = node
            .start(StartSpec {
                egress: Default::default(),
                gpus: 0,
                volumes: Vec::new(),
                sandbox_id: id.clone(),
                execution_id: unique("e"),
                build_id: build.build_id.clone(),
                cold_boot: true,
                env_vars: Default::default(),
                envd_access_token: None,
                network: open_policy(),
            })
            .await
            .expect("boot again from the same disk");
        let out = node
            .exec(
                &id,
                "user",
                "cat /home/user/note.txt",
                Duration::from_secs(60),
            )
            .await
            .expect("read back");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "persisted-42\n");
        node.kill(&id, &again.execution_id).await.expect("kill");
        node.delete_build(&build.build_id)
            .await
            .expect("delete build");
    });
}

#[test]
fn two_vms_on_two_slots_share_the_guest_address() {
    let node = node();
    let _shared = host_lock().read();
    runtime().block_on(async {
        let (a, b) = (unique("twa"), unique("twb"));
        let open = open_policy();
        let (ra, rb) = tokio::join!(
            node.boot_image(&a, 1, 384, &open),
            node.boot_image(&b, 1, 384, &open)
        );
        let (ra, rb) = (ra.expect("boot a"), rb.expect("boot b"));
        assert_ne!(ra.guest_ip, rb.guest_ip, "distinct host addresses");
        for id in [&a, &b] {
            let out = node
                .exec(
                    id,
                    "root",
                    "ip -4 -o addr show eth0; hostname",
                    Duration::from_secs(60),
                )
                .await
                .expect("exec");
            let s = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(s.contains("169.254.0.21/30"), "{s}");
        }
        node.kill(&a, &ra.execution_id).await.expect("kill a");
        node.kill(&b, &rb.execution_id).await.expect("kill b");
    });
}

#[test]
fn kill_9_of_qemu_then_reclaim_leaves_nothing() {
    let node = node();
    // It checks that the slot's namespace name is gone: a test booting beside it could take
    // the freed slot (the lowest free index) and make the same name again.
    let _exclusive = host_lock().write();
    runtime().block_on(async {
        let id = unique("k9");
        let r = node
            .boot_image(&id, 1, 384, &open_policy())
            .await
            .expect("boot");
        let IpAddr::V4(v4) = r.guest_ip else {
            panic!("v4")
        };
        let n = (u32::from(v4) - u32::from(std::net::Ipv4Addr::new(169, 254, 128, 0))) / 4;
        let (block, slot_index) = (n / 512, n % 512);
        let ns = format!("vmon{block:x}-s{slot_index}");
        assert!(
            netns_list().contains(&ns),
            "slot namespace exists while running"
        );
        let run_dir = node
            .data_dir()
            .join("sandboxes")
            .join(&id)
            .join(&r.execution_id);
        let state = vmon_node::sandbox::SandboxState::load(&run_dir).expect("sandbox.json");
        let overlay = node.data_dir().join("artifacts").join(&state.overlay);
        assert!(overlay.is_file(), "the overlay exists while running");
        let pid = node.crash_vm(&id).await.expect("kill -9");
        assert!(pid > 0);
        let dead = node.reap_dead().await;
        assert!(dead.contains(&id), "reaper saw the dead VM: {dead:?}");
        assert!(
            !netns_list().contains(&ns),
            "namespace (tap, nft table) removed"
        );
        let links = std::process::Command::new("ip")
            .args(["-o", "link"])
            .output()
            .expect("ip link");
        assert!(
            !String::from_utf8_lossy(&links.stdout)
                .contains(&format!("vmh{block:x}-{slot_index}:")),
            "host veth removed"
        );
        assert!(!overlay.exists(), "overlay removed");
        assert!(
            !run_dir.join("sandbox.json").exists(),
            "no state left to re-adopt"
        );
        assert!(!runs(&node, &id).await);
    });
}

#[test]
fn bad_input_gets_clear_errors_and_leaves_nothing() {
    let node = node();
    let _exclusive = host_lock().write();
    runtime().block_on(async {
        // This node's namespaces only: other nodes on the host (a server a developer runs)
        // make and drop their own meanwhile.
        let ours = || {
            let prefix = format!("vmon{:x}-s", node.slot_block());
            netns_list()
                .iter()
                .filter(|n| n.starts_with(&prefix))
                .count()
        };
        let before = ours();
        let cases: [(u32, u32, &str); 3] = [
            (1, 0, "memory"),
            (0, 512, "vCPUs"),
            (1, 64 * 1024 * 1024, "more than this host"),
        ];
        for (vcpus, mem, needle) in cases {
            let id = unique("bad");
            match node.boot_image(&id, vcpus, mem, &open_policy()).await {
                Err(NodeError::InvalidArgument(m)) => assert!(m.contains(needle), "{m}"),
                other => panic!("vcpus={vcpus} mem={mem}: expected InvalidArgument, got {other:?}"),
            }
            assert!(!runs(&node, &id).await);
        }
        let bad_policy = NetworkPolicy {
            allow_internet_access: true,
            allow_out: vec!["1.2.3.4; flush ruleset".into()],
            deny_out: vec![],
        };
        assert!(matches!(
            node.boot_image(&unique("bad"), 1, 256, &bad_policy).await,
            Err(NodeError::InvalidArgument(_))
        ));
        let missing = node
            .start(StartSpec {
                egress: Default::default(),
                gpus: 0,
                volumes: Vec::new(),
                sandbox_id: unique("bad"),
                execution_id: unique("e"),
                build_id: "no-such-build".into(),
                cold_boot: false,
                env_vars: Default::default(),
                envd_access_token: None,
                network: open_policy(),
            })
            .await;
        assert!(
            matches!(missing, Err(NodeError::BuildNotFound(_))),
            "{missing:?}"
        );
        assert!(
            vmon_image::find(node.data_dir(), "0123456789abcdef").is_err(),
            "missing image"
        );
        assert!(
            "hvf".parse::<vmon_vm::Accel>().is_err(),
            "unknown accelerator"
        );
        assert!(ours() <= before, "no namespace left behind");
    });
}
