//! The data dir's disk fills in the middle of a pause: the pause fails with a clear error, the
//! sandbox keeps running with its memory, nothing half-written is left as a build or as
//! artifacts, and once space is back the same sandbox pauses and restores whole.
//!
//! The data dir is a small ext4 filesystem on a loop device the test makes (the image cache is
//! shared through a symlink, as in `crashes.rs`). The node's own floor (`min_free_mb`) is off,
//! so the capture really runs into ENOSPC rather than being refused up front.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{data_dir, envd_binary, runtime, sh, start, unique};
use vmon_node::{Node, NodeConfig};
use vmon_proto::node::NodeCalls;

/// A loop-mounted ext4 filesystem of `size_mb`, unmounted and deleted on drop.
struct SmallDisk {
    mnt: PathBuf,
    img: PathBuf,
}

impl SmallDisk {
    fn new(size_mb: u64) -> SmallDisk {
        let base = data_dir().join("disk-full");
        let mnt = base.join("mnt");
        let img = base.join("fs.img");
        // What a run that died left.
        let _ = Command::new("umount").arg("-l").arg(&mnt).status();
        let _ = std::fs::remove_file(&img);
        std::fs::create_dir_all(&mnt).expect("mount point");
        run("truncate", &["-s", &format!("{size_mb}M"), path(&img)]);
        run("mkfs.ext4", &["-q", "-F", "-m", "0", path(&img)]);
        run("mount", &["-o", "loop", path(&img), path(&mnt)]);
        let images = data_dir().join("images");
        std::fs::create_dir_all(&images).expect("image cache");
        std::os::unix::fs::symlink(&images, mnt.join("images")).expect("link images");
        SmallDisk { mnt, img }
    }

    fn free_mb(&self) -> u64 {
        let out = Command::new("df")
            .args(["--output=avail", "-m", path(&self.mnt)])
            .output()
            .expect("df");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .expect("df's answer")
    }

    /// Fills the filesystem up to `leave_mb` free with a ballast file.
    fn fill(&self, leave_mb: u64) -> PathBuf {
        let ballast = self.mnt.join("ballast");
        let take = self.free_mb().saturating_sub(leave_mb);
        run("fallocate", &["-l", &format!("{take}M"), path(&ballast)]);
        ballast
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        let _ = std::fs::remove_file(&self.img);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn run(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(st.success(), "{cmd} {args:?} failed");
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn a_disk_that_fills_mid_pause_fails_it_cleanly_and_loses_nothing() {
    let disk = SmallDisk::new(1536);
    runtime().block_on(async {
        let mut cfg = NodeConfig::new(disk.mnt.clone());
        cfg.envd_binary = Some(envd_binary());
        cfg.pool_size = 0;
        cfg.spare_slots = 0;
        cfg.park_max = 0;
        cfg.min_free_mb = 0;
        let node = Node::open(cfg).await.expect("node opens");
        let tpl = unique("full-tpl");
        common::build_plain(&node, &tpl, 384).await;
        let id = unique("full");
        let r = start(&node, &id, &tpl, false).await;
        // 96 MiB of fresh guest memory: the pause must write it out as a layer.
        let want = sh(
            &node,
            &id,
            "head -c 96M /dev/urandom > /dev/shm/blob && sha256sum /dev/shm/blob | cut -c1-64",
        )
        .await;
        let builds_dir = disk.mnt.join("builds");
        let artifacts_dir = disk.mnt.join("artifacts");
        let builds_before = names(&builds_dir);
        let artifacts_before = names(&artifacts_dir);

        let ballast = disk.fill(16);
        let failed = node.pause(&id, &r.execution_id, true).await;
        let e = failed.expect_err("a pause into a full disk must fail");
        let msg = e.to_string();
        assert!(
            msg.to_lowercase().contains("space"),
            "the error says the disk is full: {msg}"
        );
        // Still running, memory intact.
        let got = sh(&node, &id, "sha256sum /dev/shm/blob | cut -c1-64").await;
        assert_eq!(got, want, "the running sandbox kept its memory");
        assert_eq!(
            names(&builds_dir),
            builds_before,
            "a failed pause leaves no build record"
        );
        let left: Vec<String> = names(&artifacts_dir)
            .into_iter()
            .filter(|n| !artifacts_before.contains(n))
            .collect();
        // The disk may have switched to a fresh overlay for the sandbox; nothing else stays.
        assert!(
            left.len() <= 1 && left.iter().all(|n| n.ends_with(".qcow2")),
            "a failed pause leaves no half-written artifacts: {left:?}"
        );

        // Space back: the same sandbox pauses, and its build restores it whole.
        std::fs::remove_file(&ballast).expect("remove ballast");
        let paused = node
            .pause(&id, &r.execution_id, true)
            .await
            .expect("pause with space");
        let back = start(&node, &id, &paused.build_id, false).await;
        let got = sh(&node, &id, "sha256sum /dev/shm/blob | cut -c1-64").await;
        assert_eq!(got, want, "the restored sandbox has its memory");
        node.kill(&id, &back.execution_id).await.expect("kill");
        drop(node);
        // The kill frees the slot just after it answers.
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    });
    drop(disk);
}
