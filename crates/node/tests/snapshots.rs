//! Memory snapshots on one node: pause/resume keeping processes, deltas, forks, snapshots as
//! templates, filesystem-only pauses. Real VMs under QEMU (TCG here) and the real envd.

mod common;

use std::time::Duration;

use common::{
    host_lock, node, runs, runtime, sh, start, template, unique, READ_TOKEN, TOKEN_SERVER,
};
use vmon_proto::node::NodeCalls;

#[test]
fn a_process_and_its_files_survive_ten_pause_resume_cycles() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let id = unique("cyc");
        let mut r = start(&node, &id, &tpl, false).await;
        sh(&node, &id, TOKEN_SERVER).await;
        let token = sh(&node, &id, READ_TOKEN).await;
        assert_eq!(token.len(), 32, "token {token:?}");
        let sums = sh(
            &node,
            &id,
            "head -c 64M /dev/urandom > /dev/shm/ram.bin && head -c 64M /dev/urandom > /home/user/disk.bin && sync && sha256sum /dev/shm/ram.bin /home/user/disk.bin | cut -d' ' -f1",
        )
        .await;
        let generation0 = r.resume_generation;
        for cycle in 1..=10u32 {
            let b = node.pause(&id, &r.execution_id, true).await.expect("pause");
            assert!(b.has_memory);
            if cycle % 2 == 1 {
                // Odd cycles restore from the build's files; even ones resume the kept QEMU.
                assert!(node.let_go_parked(&b.build_id).await, "cycle {cycle}: QEMU was kept");
            } else {
                assert!(node.is_parked(&b.build_id), "cycle {cycle}: QEMU was kept");
            }
            r = start(&node, &id, &b.build_id, false).await;
            assert!(!node.is_parked(&b.build_id), "cycle {cycle}: resumed");
            assert_eq!(r.resume_generation, generation0 + cycle, "resume_generation counts");
            assert_eq!(sh(&node, &id, READ_TOKEN).await, token, "cycle {cycle}: RAM token");
            if cycle == 5 || cycle == 10 {
                let now = sh(&node, &id, "sha256sum /dev/shm/ram.bin /home/user/disk.bin | cut -d' ' -f1").await;
                assert_eq!(now, sums, "cycle {cycle}: tmpfs and disk contents");
            }
        }
        node.kill(&id, &r.execution_id).await.expect("kill");
    });
}

#[test]
fn five_forks_see_the_parent_then_diverge() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let parent = unique("par");
        let pr = start(&node, &parent, &tpl, false).await;
        sh(&node, &parent, TOKEN_SERVER).await;
        let token = sh(&node, &parent, READ_TOKEN).await;
        sh(&node, &parent, "echo before > /home/user/parent-pre.txt").await;
        let fork = node
            .checkpoint(&parent, &pr.execution_id, true)
            .await
            .expect("checkpoint");
        sh(&node, &parent, "echo after > /home/user/parent-post.txt").await;
        let kids: Vec<String> = (0..5).map(|i| unique(&format!("kid{i}x"))).collect();
        let started =
            futures_join(kids.iter().map(|k| start(&node, k, &fork.build_id, false))).await;
        let mut randoms = Vec::new();
        for (i, k) in kids.iter().enumerate() {
            assert_eq!(
                sh(&node, k, READ_TOKEN).await,
                token,
                "child sees the parent's RAM"
            );
            assert_eq!(
                sh(&node, k, "cat /home/user/parent-pre.txt").await,
                "before"
            );
            assert_eq!(
                sh(
                    &node,
                    k,
                    "test -e /home/user/parent-post.txt && echo yes || echo no"
                )
                .await,
                "no",
                "writes after the fork stay in the parent"
            );
            sh(&node, k, &format!("echo {i} > /home/user/kid-{i}.txt")).await;
            randoms.push(
                sh(
                    &node,
                    k,
                    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
                )
                .await,
            );
        }
        for (i, k) in kids.iter().enumerate() {
            let seen = sh(&node, k, "ls /home/user | grep -c '^kid-' || true").await;
            assert_eq!(seen, "1", "child {i} sees only its own file");
        }
        let parent_sees = sh(&node, &parent, "ls /home/user | grep -c '^kid-' || true").await;
        assert_eq!(parent_sees, "0");
        let mut uniq = randoms.clone();
        uniq.sort();
        uniq.dedup();
        assert_eq!(
            uniq.len(),
            randoms.len(),
            "children's /dev/urandom differ: {randoms:?}"
        );
        // The parent still runs under its id and execution.
        assert_eq!(sh(&node, &parent, READ_TOKEN).await, token);
        let listed = node.list_running().await.expect("list_running");
        assert!(listed
            .iter()
            .any(|s| s.sandbox_id == parent && s.execution_id == pr.execution_id));
        for (k, r) in kids.iter().zip(started) {
            node.kill(k, &r.execution_id).await.expect("kill kid");
        }
        node.kill(&parent, &pr.execution_id)
            .await
            .expect("kill parent");
        node.delete_build(&fork.build_id)
            .await
            .expect("delete fork build");
    });
}

async fn futures_join<F, T>(futs: impl Iterator<Item = F>) -> Vec<T>
where
    F: std::future::Future<Output = T>,
{
    let mut out = Vec::new();
    let handles: Vec<_> = futs.collect();
    for f in handles {
        out.push(f.await);
    }
    out
}

#[test]
fn a_paused_sandbox_forks_and_resumes_with_a_correct_clock() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let id = unique("pf");
        let r = start(&node, &id, &tpl, false).await;
        sh(&node, &id, TOKEN_SERVER).await;
        let token = sh(&node, &id, READ_TOKEN).await;
        let b = node.pause(&id, &r.execution_id, true).await.expect("pause");
        // Children straight from the paused build.
        let kid = unique("pfk");
        let kr = start(&node, &kid, &b.build_id, false).await;
        assert_eq!(sh(&node, &kid, READ_TOKEN).await, token);
        node.kill(&kid, &kr.execution_id).await.expect("kill kid");
        tokio::time::sleep(Duration::from_secs(30)).await;
        let r2 = start(&node, &id, &b.build_id, false).await;
        assert_eq!(
            sh(&node, &id, READ_TOKEN).await,
            token,
            "the paused sandbox resumes too"
        );
        let before = now_secs();
        let guest: f64 = sh(&node, &id, "date +%s.%N").await.parse().expect("date");
        let after = now_secs();
        assert!(
            guest >= before - 1.0 && guest <= after + 1.0,
            "guest clock {guest} vs host [{before}, {after}] after a 30 s pause"
        );
        node.kill(&id, &r2.execution_id).await.expect("kill");
    });
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[test]
fn filesystem_pause_loses_processes_and_keeps_synced_files() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let id = unique("fs");
        let r = start(&node, &id, &tpl, false).await;
        sh(&node, &id, TOKEN_SERVER).await;
        sh(&node, &id, "echo kept > /home/user/kept.txt").await;
        let b = node
            .pause(&id, &r.execution_id, false)
            .await
            .expect("fs pause");
        assert!(!b.has_memory);
        let r2 = start(&node, &id, &b.build_id, false).await;
        assert_eq!(sh(&node, &id, "cat /home/user/kept.txt").await, "kept");
        let gone = sh(
            &node,
            &id,
            &format!("{READ_TOKEN} >/dev/null 2>&1 && echo alive || echo gone"),
        )
        .await;
        assert_eq!(gone, "gone", "processes do not survive a filesystem pause");
        assert_eq!(r2.resume_generation, 0, "a cold boot restores no memory");
        node.kill(&id, &r2.execution_id).await.expect("kill");
    });
}

#[test]
fn a_snapshot_outlives_its_source_and_deletes_cleanly() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let src = unique("snap");
        let r = start(&node, &src, &tpl, false).await;
        sh(&node, &src, "echo from-snapshot > /home/user/s.txt").await;
        let snap = node
            .checkpoint(&src, &r.execution_id, true)
            .await
            .expect("snapshot");
        node.kill(&src, &r.execution_id).await.expect("kill source");
        let a = unique("sna");
        let ra = start(&node, &a, &snap.build_id, false).await;
        assert_eq!(sh(&node, &a, "cat /home/user/s.txt").await, "from-snapshot");
        // In use: refused.
        assert!(matches!(
            node.delete_build(&snap.build_id).await,
            Err(vmon_proto::node::NodeError::BuildInUse(_))
        ));
        node.kill(&a, &ra.execution_id).await.expect("kill");
        let artifacts_before = count_artifacts(&node);
        node.delete_build(&snap.build_id)
            .await
            .expect("delete snapshot");
        assert!(node.build_info(&snap.build_id).await.is_err(), "gone");
        assert!(
            count_artifacts(&node) < artifacts_before,
            "its files were freed"
        );
    });
}

#[test]
fn a_kept_qemu_goes_with_its_paused_build() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let id = unique("park");
        let r = start(&node, &id, &tpl, false).await;
        sh(&node, &id, "echo kept > /home/user/k.txt").await;
        let pid = node.qemu_pid(&id).await.expect("pid");
        let b = node.pause(&id, &r.execution_id, true).await.expect("pause");
        assert!(node.is_parked(&b.build_id), "the stopped QEMU is kept");
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        assert!(
            !common::runs(&node, &id).await,
            "a parked sandbox is not running"
        );
        // A fork of the paused sandbox restores from the build and leaves the kept QEMU alone.
        let kid = unique("parkk");
        let kr = start(&node, &kid, &b.build_id, false).await;
        assert_eq!(sh(&node, &kid, "cat /home/user/k.txt").await, "kept");
        node.kill(&kid, &kr.execution_id).await.expect("kill kid");
        assert!(node.is_parked(&b.build_id));
        // Killing the paused sandbox deletes its build: the kept QEMU goes too.
        node.delete_build(&b.build_id).await.expect("delete");
        assert!(!node.is_parked(&b.build_id));
        let gone = async {
            while std::path::Path::new(&format!("/proc/{pid}")).exists() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), gone)
            .await
            .expect("the kept QEMU exits with its build");
    });
}

/// A restored QEMU is an unprivileged user that maps its RAM base from a sealed memory file,
/// and every file of the build it runs from is root's and read-only to it.
#[test]
fn a_restored_qemu_is_unprivileged_and_its_base_is_sealed() {
    use std::os::unix::fs::MetadataExt;
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let id = unique("conf");
        let r = start(&node, &id, &tpl, false).await;
        let pid = node.qemu_pid(&id).await.expect("pid");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let uid: u32 = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .expect("Uid line");
        assert_ne!(uid, 0, "the restored QEMU runs as root");
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
        assert!(
            maps.lines().any(|l| l.contains("/memfd:vmon-ram-")),
            "the RAM base is not a sealed memory file:\n{maps}"
        );
        for f in node.build_files(&tpl) {
            let m = std::fs::metadata(&f).expect("artifact");
            assert_eq!(m.uid(), 0, "{} is not root's", f.display());
            assert_eq!(
                m.mode() & 0o022,
                0,
                "{} is writable: {:o}",
                f.display(),
                m.mode()
            );
        }
        // Its own overlay is the one file of the disk it may write.
        let ov = node.overlay_file(&id).await.expect("overlay");
        let ov = std::fs::metadata(ov).expect("overlay file");
        assert_eq!((ov.uid(), ov.mode() & 0o777), (uid, 0o600));
        // In its own mount namespace the artifacts directory holds its chain and overlay only.
        let artifacts = node.data_dir().join("artifacts");
        let decoy = artifacts.join(format!("decoy-{id}.qcow2"));
        std::fs::write(&decoy, b"another team's disk").expect("decoy");
        let seen: std::collections::BTreeSet<String> =
            std::fs::read_dir(format!("/proc/{pid}/root{}", artifacts.display()))
                .expect("the QEMU's view")
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
        let name = |p: &std::path::Path| {
            p.file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned()
        };
        let mut allowed: std::collections::BTreeSet<String> =
            node.build_files(&tpl).iter().map(|p| name(p)).collect();
        let overlay = name(&node.overlay_file(&id).await.expect("overlay"));
        allowed.insert(overlay.clone());
        assert!(
            seen.contains(&overlay),
            "its overlay is not in its view: {seen:?}"
        );
        assert!(
            !seen.contains(&name(&decoy)),
            "it sees other artifacts: {seen:?}"
        );
        assert!(
            seen.is_subset(&allowed),
            "{seen:?} is more than {allowed:?}"
        );
        std::fs::remove_file(&decoy).expect("decoy");
        // The guest works: a write lands on the disk and survives a pause and resume.
        sh(&node, &id, "echo confined > /home/user/c.txt && sync").await;
        let b = node.pause(&id, &r.execution_id, true).await.expect("pause");
        let files = node.build_files(&b.build_id);
        assert!(!files.is_empty());
        for f in files {
            let m = std::fs::metadata(&f).expect("artifact");
            assert_eq!(
                m.uid(),
                0,
                "paused build's {} is still the QEMU's",
                f.display()
            );
            assert_eq!(m.mode() & 0o777, 0o640, "{}", f.display());
        }
        let back = start(&node, &id, &b.build_id, false).await;
        assert_eq!(sh(&node, &id, "cat /home/user/c.txt").await, "confined");
        node.kill(&id, &back.execution_id).await.expect("kill");
        let _ = node.delete_build(&b.build_id).await;
    });
}

fn count_artifacts(node: &vmon_node::Node) -> usize {
    std::fs::read_dir(node.data_dir().join("artifacts"))
        .map(|r| r.count())
        .unwrap_or(0)
}

#[test]
fn a_corrupt_layer_fails_the_resume_clearly() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let id = unique("cor");
        let r = start(&node, &id, &tpl, false).await;
        sh(&node, &id, "head -c 4M /dev/urandom > /dev/shm/x").await;
        let b = node.pause(&id, &r.execution_id, true).await.expect("pause");
        // From the files, not the kept QEMU.
        node.let_go_parked(&b.build_id).await;
        let builds = vmon_node::builds::Builds::open(node.data_dir()).expect("builds");
        let rec = builds.get(&b.build_id).expect("get").expect("record");
        let layer = builds.artifact(rec.layers.last().expect("a layer"));
        let mut bytes = std::fs::read(&layer).expect("read layer");
        let n = bytes.len();
        bytes[n - 100] ^= 0x5a;
        std::fs::write(&layer, &bytes).expect("corrupt");
        let res = node
            .start(vmon_proto::node::StartSpec {
                egress: Default::default(),
                gpus: 0,
                volumes: Vec::new(),
                sandbox_id: id.clone(),
                execution_id: unique("e"),
                build_id: b.build_id.clone(),
                cold_boot: false,
                env_vars: Default::default(),
                envd_access_token: None,
                network: vmon_proto::node::NetworkPolicy {
                    allow_internet_access: true,
                    ..Default::default()
                },
            })
            .await;
        match res {
            Err(e) => assert!(e.to_string().contains("corrupt"), "{e}"),
            Ok(_) => panic!("a corrupt layer restored"),
        }
        assert!(!runs(&node, &id).await);
        node.delete_build(&b.build_id).await.expect("delete");
    });
}
