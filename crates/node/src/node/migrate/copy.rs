//! An outgoing migration's copy, step by step: the disk mirrored to the target, the memory
//! pre-copied over the channel, the switchover (the mirror completed, the last round sent).

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use vmon_proto::node::MigrateOut;

use super::{progress, Progress, MIRROR_READY_TIMEOUT};
use crate::sandbox::Live;

/// QMP's timeout for each step of a migration.
const QMP_STEP: Duration = Duration::from_secs(30);

/// Mirrors the sandbox's disk to the target's NBD export until the mirror is in step
/// (writes then go to both); returns the disk's size.
pub(super) async fn mirror_disk(
    vm: &vmon_vm::Vm,
    l: &Live,
    nbd_listen: &std::path::Path,
    deadline: Instant,
) -> anyhow::Result<u64> {
    let q = &vm.qmp;
    q.execute_raw(
        "blockdev-add",
        json!({"driver": "nbd", "node-name": "mig-nbd", "export": "mig",
               "server": {"type": "unix", "path": nbd_listen.display().to_string()}}),
        QMP_STEP,
    )
    .await
    .context("connecting the disk mirror to the target")?;
    q.execute_raw(
        "blockdev-mirror",
        json!({"job-id": "mig", "device": l.state.disk_node, "target": "mig-nbd",
               "sync": "top", "copy-mode": "write-blocking"}),
        QMP_STEP,
    )
    .await
    .context("starting the disk mirror")?;
    let mirror_deadline = Instant::now() + MIRROR_READY_TIMEOUT;
    loop {
        let jobs = q
            .execute_raw("query-block-jobs", Value::Null, QMP_STEP)
            .await?;
        let job = jobs
            .as_array()
            .and_then(|a| a.iter().find(|j| j.get("device") == Some(&json!("mig"))))
            .cloned()
            .context("the disk mirror ended before it was in step")?;
        if job.get("ready").and_then(Value::as_bool) == Some(true) {
            return Ok(job.get("len").and_then(Value::as_u64).unwrap_or(0));
        }
        if Instant::now() > mirror_deadline.min(deadline) {
            bail!("the disk mirror did not catch up in time");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Hands QEMU its end of the memory stream and starts the pre-copy, to pause before the
/// switchover.
pub(super) async fn start_memory_copy(
    vm: &vmon_vm::Vm,
    spec: &MigrateOut,
    qemu_end: std::os::unix::net::UnixStream,
) -> anyhow::Result<()> {
    let q = &vm.qmp;
    q.getfd("vmon-mig", qemu_end.as_fd()).await?;
    drop(qemu_end);
    q.execute_raw(
        "migrate-set-capabilities",
        json!({"capabilities": [
            {"capability": "pause-before-switchover", "state": true},
            {"capability": "events", "state": true},
        ]}),
        QMP_STEP,
    )
    .await?;
    q.execute_raw(
        "migrate-set-parameters",
        json!({"downtime-limit": spec.downtime_ms.max(1), "max-bandwidth": 4u64 << 30}),
        QMP_STEP,
    )
    .await?;
    q.execute_raw("migrate", json!({"uri": "fd:vmon-mig"}), QMP_STEP)
        .await
        .context("starting the memory copy")?;
    Ok(())
}

/// Waits until the pre-copy converged and QEMU paused the guest before the switchover.
pub(super) async fn wait_for_switchover(
    vm: &vmon_vm::Vm,
    spec: &MigrateOut,
    deadline: Instant,
) -> anyhow::Result<()> {
    loop {
        let pr = progress(
            &vm.qmp
                .execute_raw("query-migrate", Value::Null, QMP_STEP)
                .await?,
        );
        match pr.status.as_str() {
            "pre-switchover" => return Ok(()),
            "failed" | "cancelled" => bail!(
                "the memory copy failed: {}",
                pr.error.unwrap_or_else(|| pr.status.clone())
            ),
            _ if Instant::now() > deadline => bail!(
                "the memory copy did not converge within {} s",
                spec.timeout_secs
            ),
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// Completes the disk mirror (the guest is stopped) and drops the link to the target.
pub(super) async fn complete_mirror(vm: &vmon_vm::Vm) -> anyhow::Result<()> {
    let q = &vm.qmp;
    q.execute_raw("block-job-cancel", json!({"device": "mig"}), QMP_STEP)
        .await?;
    let t = Instant::now();
    loop {
        let jobs = q
            .execute_raw("query-block-jobs", Value::Null, QMP_STEP)
            .await?;
        let running = jobs
            .as_array()
            .is_some_and(|a| a.iter().any(|j| j.get("device") == Some(&json!("mig"))));
        if !running {
            break;
        }
        if t.elapsed() > QMP_STEP {
            bail!("the disk mirror did not complete at the switchover");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    q.execute_raw("blockdev-del", json!({"node-name": "mig-nbd"}), QMP_STEP)
        .await?;
    Ok(())
}

/// Releases the switchover and waits for the last round; returns the copy's figures.
pub(super) async fn finish_memory_copy(
    vm: &vmon_vm::Vm,
    deadline: Instant,
) -> anyhow::Result<Progress> {
    let q = &vm.qmp;
    q.execute_raw(
        "migrate-continue",
        json!({"state": "pre-switchover"}),
        QMP_STEP,
    )
    .await?;
    loop {
        let pr = progress(
            &q.execute_raw("query-migrate", Value::Null, QMP_STEP)
                .await?,
        );
        match pr.status.as_str() {
            "completed" => return Ok(pr),
            "failed" | "cancelled" => bail!(
                "the last copy round failed: {}",
                pr.error.unwrap_or_default()
            ),
            _ if Instant::now() > deadline => bail!("the last copy round timed out"),
            _ => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
}
