//! A node process killed in the middle of a pause, then restarted: the sandbox is either still
//! running (the pause had not committed) or paused and restorable (it had), never broken.
//!
//! The crashing node is this test binary re-run as a child with `VMON_CRASH_CHILD` naming the
//! fault point (`vmon_faults`) where it aborts (armed `abort` in the `VMON_FAULT_DIR` it is
//! given) or fails (armed `fail`). It uses its own data dir (sharing the image cache) and its
//! own slot block, so it never touches the other test binaries' node.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{data_dir, envd_binary, runtime, sh, start, READ_TOKEN, TOKEN_SERVER};
use vmon_node::{Node, NodeConfig};
use vmon_proto::node::NodeCalls;

/// The children share one data dir and slot block: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn crash_dir() -> PathBuf {
    let d = data_dir().join("crash-test");
    std::fs::create_dir_all(&d).expect("crash dir");
    let images = d.join("images");
    if !images.exists() {
        std::fs::create_dir_all(data_dir().join("images")).expect("images");
        std::os::unix::fs::symlink(data_dir().join("images"), &images).expect("link images");
    }
    d
}

/// The fault points' directory of the children.
fn fault_dir() -> PathBuf {
    let d = crash_dir().join("faults");
    std::fs::create_dir_all(&d).expect("fault dir");
    d
}

/// The node in the crash dir; with `faults`, its points armed in the `VMON_FAULT_DIR` it was
/// given (the child), else none (the restarted node).
async fn open(dir: &Path, faults: bool) -> Arc<Node> {
    let mut cfg = NodeConfig::new(dir.to_path_buf());
    if !faults {
        cfg.faults = Default::default();
    }
    cfg.envd_binary = Some(envd_binary());
    cfg.pool_size = 0;
    cfg.spare_slots = 0;
    // The block is locked host-wide and remembered in the crash dir, so the restarted node
    // finds the slots of the one that died, and no other node can share them.
    Node::open(cfg).await.expect("node opens")
}

/// In the child: start a sandbox with a RAM token, print its ids, and pause it (which aborts
/// at the fault point). Does nothing when run as an ordinary test.
#[test]
fn crash_child() {
    if std::env::var_os("VMON_CRASH_CHILD").is_none() {
        return;
    }
    runtime().block_on(async {
        let node = open(&crash_dir(), true).await;
        let tpl = format!(
            "crash-tpl-{}",
            node.image().await.expect("guest image").manifest.hash
        );
        common::build_plain(&node, &tpl, 384).await;
        let id = common::unique("crash");
        let r = start(&node, &id, &tpl, false).await;
        sh(&node, &id, TOKEN_SERVER).await;
        let token = sh(&node, &id, READ_TOKEN).await;
        println!("CRASH-READY {id} {} {token}", r.execution_id);
        // Aborts inside (or, for `pause:error`, fails and must leave the sandbox running).
        let res = node.pause(&id, &r.execution_id, true).await;
        if std::env::var("VMON_CRASH_CHILD").as_deref() == Ok("pause:error") {
            assert!(res.is_err(), "the injected failure surfaces");
            let running = node.list_running().await.expect("list_running");
            assert!(running
                .iter()
                .any(|s| s.sandbox_id == id && s.execution_id == r.execution_id));
            assert_eq!(
                sh(&node, &id, READ_TOKEN).await,
                token,
                "still running, same process"
            );
            node.kill(&id, &r.execution_id).await.expect("kill");
            println!("CRASH-ERROR-OK");
            std::process::exit(3);
        }
        println!("CRASH-NOT-REACHED");
    });
}

/// Waits until no node holds the crash dir's lock. The parent's node lets go of it when its
/// last background task on the shared runtime has ended, a moment after the block that used
/// it; a child started before then could not open the dir.
fn wait_released(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("node.lock"))
            .expect("lock file");
        // Dropping `f` releases it.
        if f.try_lock().is_ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the crash dir's node lock was not let go of in 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Runs the child with `point` armed to `action` (`abort` or `fail`); the child must have
/// reached it.
fn child_at(point: &str, action: &str) -> std::process::Output {
    wait_released(&crash_dir());
    let faults = fault_dir();
    let (arm, reached) = (faults.join(point), faults.join(format!("{point}.reached")));
    let _ = std::fs::remove_file(&reached);
    std::fs::write(&arm, action).expect("arm the fault point");
    let out = Command::new(std::env::current_exe().expect("exe"))
        .args([
            "--exact",
            "crash_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("VMON_CRASH_CHILD", point)
        .env("VMON_FAULT_DIR", &faults)
        .output()
        .expect("run child");
    std::fs::remove_file(&arm).expect("disarm");
    let visits = std::fs::read_to_string(&reached).unwrap_or_default();
    assert_eq!(
        visits.lines().count(),
        1,
        "fault point {point} reached once: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    out
}

fn run_child(point: &str) -> (String, String, String) {
    let out = child_at(point, "abort");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        !out.status.success(),
        "the child must die at {point}: {stdout}"
    );
    assert!(
        !stdout.contains("CRASH-NOT-REACHED"),
        "fault point {point} was not hit"
    );
    let line = stdout
        .lines()
        .find_map(|l| l.find("CRASH-READY").map(|i| &l[i..]))
        .unwrap_or_else(|| {
            panic!(
                "child never got ready: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let mut w = line.split_whitespace().skip(1);
    let (id, exec, token) = (w.next(), w.next(), w.next());
    (
        id.expect("id").to_string(),
        exec.expect("exec").to_string(),
        token.expect("token").to_string(),
    )
}

/// After a restart: sandbox `id` was re-adopted as running execution `exec`, and its process
/// still serves `token` from memory.
async fn assert_running_as_before(node: &Node, id: &str, exec: &str, token: &str) {
    let running = node.list_running().await.expect("list_running");
    let me = running
        .iter()
        .find(|s| s.sandbox_id == id)
        .expect("re-adopted as running");
    assert_eq!(me.execution_id, exec);
    assert_eq!(
        sh(node, id, READ_TOKEN).await,
        token,
        "its process survived"
    );
}

#[test]
fn a_failed_pause_leaves_the_sandbox_running() {
    if std::env::var_os("VMON_CRASH_CHILD").is_some() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let out = child_at("pause:error", "fail");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("CRASH-ERROR-OK"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn node_killed_mid_pause_leaves_a_running_or_a_paused_sandbox() {
    if std::env::var_os("VMON_CRASH_CHILD").is_some() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Killed after the capture, before the commit: the sandbox must come back running.
    let (id, exec, token) = run_child("pause:captured");
    let dir = crash_dir();
    runtime().block_on(async {
        let node = open(&dir, false).await;
        assert_running_as_before(&node, &id, &exec, &token).await;
        node.kill(&id, &exec).await.expect("kill");
        node.drain_pool().await;
    });

    // Killed after the commit, before QEMU quit: the sandbox must be paused and restorable.
    let (id, _exec, token) = run_child("pause:committed");
    runtime().block_on(async {
        let node = open(&dir, false).await;
        assert!(
            !common::runs(&node, &id).await,
            "a committed pause is finished, not re-adopted"
        );
        let builds = vmon_node::builds::Builds::open(&dir).expect("builds");
        let newest = builds
            .list()
            .expect("list")
            .into_iter()
            .filter(|b| b.id.starts_with('p'))
            .max_by_key(|b| b.created_unix)
            .expect("the paused build");
        let r = start(&node, &id, &newest.id, false).await;
        assert_eq!(
            sh(&node, &id, READ_TOKEN).await,
            token,
            "resumed with its RAM"
        );
        node.kill(&id, &r.execution_id).await.expect("kill");
        node.delete_build(&newest.id).await.expect("delete");
    });
}

#[test]
fn node_killed_between_a_disk_switch_and_its_record_keeps_the_guests_writes() {
    if std::env::var_os("VMON_CRASH_CHILD").is_some() {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Killed after QEMU switched to a fresh overlay, before the state file named it.
    let (id, exec, token) = run_child("pause:switched");
    let dir = crash_dir();
    runtime().block_on(async {
        let node = open(&dir, false).await;
        assert_running_as_before(&node, &id, &exec, &token).await;
        // Written after the restart: it lands in the overlay the crash left unrecorded, which
        // the restart's sweep must not have taken.
        sh(
            &node,
            &id,
            "echo kept-$((6*7)) > /root/after-switch && sync",
        )
        .await;
        // A pause with memory switches the disk again (QEMU refused it while the state named
        // the layer under the one it writes).
        let b1 = node
            .pause(&id, &exec, true)
            .await
            .expect("pause with memory after the restart");
        let r = start(&node, &id, &b1.build_id, false).await;
        assert_eq!(
            sh(&node, &id, READ_TOKEN).await,
            token,
            "resumed with its RAM"
        );
        assert_eq!(sh(&node, &id, "cat /root/after-switch").await, "kept-42");
        // Disk only, then a cold boot: the build's disk holds the write.
        let b2 = node
            .pause(&id, &r.execution_id, false)
            .await
            .expect("disk-only pause");
        assert!(!b2.has_memory);
        let r2 = start(&node, &id, &b2.build_id, true).await;
        assert_eq!(
            sh(&node, &id, "cat /root/after-switch").await,
            "kept-42",
            "the disk-only build has the write made after the restart"
        );
        node.kill(&id, &r2.execution_id).await.expect("kill");
        for b in [&b2.build_id, &b1.build_id] {
            let _ = node.delete_build(b).await;
        }
        node.drain_pool().await;
    });
}
