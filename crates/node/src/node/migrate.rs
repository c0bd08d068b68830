//! Live migration of a running sandbox to another node, with QEMU's own pre-copy.
//!
//! The target prepares a QEMU the way a restore does (a slot, a fresh overlay on the basis
//! build's disk chain, the basis's memory layers written in over its RAM base) and exports the
//! overlay over NBD. The source mirrors its overlay's writes into that export
//! (`blockdev-mirror sync=top`, write-blocking once in step), then migrates RAM and device
//! state with `pause-before-switchover`: at the switchover the guest is stopped, the mirror is
//! completed and the NBD link dropped, and only then does QEMU send its last round. Both
//! links run over channels of the target's node RPC port ([`crate::channel`]), relayed by the
//! nodes; QEMU only sees local sockets.
//!
//! The target's guest stays stopped (`-S`) until [`Node::commit_incoming`]: the control plane
//! commits it, switches the sandbox's placement, and only then has the source end its QEMU
//! ([`Node::finish_outgoing`]). Until the commit the source can `cont` its own guest again
//! ([`Node::abort_outgoing`]): a migration that fails leaves the sandbox running where it was.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio::sync::Mutex;
use vmon_proto::node::{MigrateIn, MigrateOut, MigrateStats, NodeError, Running};

use copy::{
    complete_mirror, finish_memory_copy, mirror_disk, start_memory_copy, wait_for_switchover,
};

use super::{err, valid_id, Node};
use crate::builds::new_id;
use crate::channel::{relay, ChannelIo, Channels};
use crate::pool::Prepared;
use crate::rpc::RemoteNode;
use crate::sandbox::{Live, RamSource, SandboxState};

mod copy;

/// A prepared target is dropped when nothing commits it within this.
const INCOMING_TTL: Duration = Duration::from_secs(900);
/// A handed-over source that hears neither finish nor abort within this runs on (the control
/// plane that drove the migration is gone before it switched the placement).
const HANDED_OVER_TTL: Duration = Duration::from_secs(120);
/// How long the mirror may take to catch up with the overlay before RAM is sent.
const MIRROR_READY_TIMEOUT: Duration = Duration::from_secs(600);

/// Node RPC credentials for reaching other nodes (set by `vmon node` in a cluster).
#[derive(Clone)]
pub struct Peers {
    pub token: String,
    pub tls: Option<crate::tls::ClientTls>,
}

/// A target QEMU waiting for (or holding) a migrated guest.
pub(super) struct Incoming {
    pub(super) spec: MigrateIn,
    basis: crate::builds::BuildRecord,
    pub(super) prepared: Mutex<Option<Prepared>>,
    nbd_socket: PathBuf,
}

/// Sandboxes whose QEMU has handed over and waits for finish or abort, with the time.
pub(super) type HandedOver = HashMap<String, Instant>;

/// A unix socket path for QEMU under the node's run dir, short enough for `sun_path`.
fn socket_path(run: &std::path::Path, name: &str) -> PathBuf {
    let p = run.join(name);
    if p.as_os_str().len() < 100 {
        p
    } else {
        std::env::temp_dir().join(format!("vmon-{name}"))
    }
}

/// `query-migrate`'s fields that matter here.
#[derive(Debug, Default)]
pub(super) struct Progress {
    pub(super) status: String,
    pub(super) error: Option<String>,
    ram_bytes: u64,
    rounds: u64,
    downtime_ms: u64,
}

pub(super) fn progress(v: &Value) -> Progress {
    let ram = v.get("ram");
    let num = |o: Option<&Value>, k: &str| o.and_then(|o| o.get(k)).and_then(Value::as_u64);
    Progress {
        status: v
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        error: v
            .get("error-desc")
            .and_then(Value::as_str)
            .map(String::from),
        ram_bytes: num(ram, "transferred").unwrap_or(0),
        rounds: num(ram, "dirty-sync-count").unwrap_or(0),
        downtime_ms: num(Some(v), "downtime").unwrap_or(0),
    }
}

impl Node {
    /// Lets this node reach other nodes' RPC (to send live migrations).
    pub fn set_peers(&self, peers: Peers) {
        let _ = self.peers.set(peers);
    }

    pub(super) async fn describe_outgoing(
        &self,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<MigrateIn, NodeError> {
        let l = self.live_execution(sandbox_id, execution_id).await?;
        // A drain pauses what cannot move (filesystem-only, for a GPU sandbox).
        if !l.state.gpu_groups.is_empty() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {sandbox_id} has GPUs passed through and cannot live-migrate"
            )));
        }
        let RamSource::Private { basis, .. } = &l.state.ram else {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {sandbox_id} was booted, not restored: its memory has no build under \
                 it, so it cannot live-migrate (pause it to move it)"
            )));
        };
        if !l.state.volumes.is_empty() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {sandbox_id} mounts volumes and cannot live-migrate"
            )));
        }
        if l.state.pausing_build.is_some() || l.vm.is_none() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {sandbox_id} is pausing"
            )));
        }
        Ok(MigrateIn {
            sandbox_id: sandbox_id.to_string(),
            execution_id: execution_id.to_string(),
            basis: basis.clone(),
            envd_token: l.state.envd_token.clone(),
            envd_version: l.state.envd_version.clone(),
            network: l.state.network.clone().unwrap_or_default(),
            resume_generation: l.state.resume_generation,
            disk_mb: l.state.disk_mb,
            vcpus: l.state.machine.vcpus,
            memory_mb: l.state.machine.memory_mb,
            start_kind: l.state.start_kind,
        })
    }

    /// Target: a QEMU for `spec`'s sandbox, waiting for its memory and disk.
    pub(super) async fn prepare_incoming(&self, spec: MigrateIn) -> Result<String, NodeError> {
        if !valid_id(&spec.basis) {
            return Err(NodeError::InvalidArgument("bad migration ids".into()));
        }
        self.vet_arrival(&spec.sandbox_id, &spec.execution_id, &spec.network)
            .await?;
        crate::config::check_free(&self.cfg.data_dir, self.cfg.min_free_mb)?;
        self.ensure_local(&spec.basis).await?;
        let rec = self.record(&spec.basis)?;
        self.check_compatible(&rec)?;
        if rec.machine.memory_mb != spec.memory_mb || rec.machine.vcpus != spec.vcpus {
            return Err(NodeError::InvalidArgument(format!(
                "build {} has another machine shape than the sandbox",
                rec.id
            )));
        }
        let id = new_id("m");
        let _guard = self.artifacts_guard.read().await;
        let p = self
            .prepare(&rec, false, vmon_vm::cgroup::Weight::Normal, None)
            .await
            .map_err(err)?;
        // Made by the target's QEMU, in the directory of its own.
        let nbd_socket = socket_path(
            &vmon_vm::process::qemu_dir(&p.run_dir),
            &format!("{id}.nbd"),
        );
        let _ = std::fs::remove_file(&nbd_socket);
        let exported = async {
            // The slot's egress rules are in place before the guest runs here.
            if spec.network != crate::slots::open_policy() {
                p.slot.set_policy(&spec.network, self.slots.perimeter()).await?;
            }
            p.vm.qmp
                .execute_raw(
                    "nbd-server-start",
                    json!({"addr": {"type": "unix", "data": {"path": nbd_socket.display().to_string()}}}),
                    Duration::from_secs(10),
                )
                .await?;
            p.vm.qmp
                .execute_raw(
                    "block-export-add",
                    json!({"type": "nbd", "id": "mig", "node-name": "d0", "writable": true, "name": "mig"}),
                    Duration::from_secs(10),
                )
                .await?;
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = exported {
            self.discard_prepared(p).await;
            return Err(err(e.context("exporting the target's disk")));
        }
        let incoming = Arc::new(Incoming {
            spec,
            basis: rec,
            prepared: Mutex::new(Some(p)),
            nbd_socket,
        });
        if let Ok(mut m) = self.incoming.lock() {
            m.insert(id.clone(), incoming);
        }
        let weak = self.me.clone();
        let mid = id.clone();
        tokio::spawn(async move {
            tokio::time::sleep(INCOMING_TTL).await;
            if let Some(node) = weak.upgrade() {
                if node.take_incoming(&mid).is_some() {
                    tracing::warn!(migration = %mid, "an uncommitted incoming migration expired");
                }
                let _ = node.cancel_incoming(&mid).await;
            }
        });
        tracing::info!(migration = %id, sandbox = %incoming_sandbox(self, &id), "incoming migration prepared");
        Ok(id)
    }

    fn get_incoming(&self, id: &str) -> Option<Arc<Incoming>> {
        self.incoming.lock().ok()?.get(id).cloned()
    }

    fn take_incoming(&self, id: &str) -> Option<Arc<Incoming>> {
        self.incoming.lock().ok()?.remove(id)
    }

    /// Artifacts prepared targets hold (for the sweep).
    pub(super) fn incoming_artifacts(&self) -> Vec<String> {
        let Ok(m) = self.incoming.lock() else {
            return Vec::new();
        };
        m.values()
            .flat_map(|i| {
                let mut v: Vec<String> = i.basis.artifacts().cloned().collect();
                if let Ok(p) = i.prepared.try_lock() {
                    if let Some(p) = p.as_ref() {
                        v.push(p.overlay.clone());
                    }
                }
                v
            })
            .collect()
    }

    pub(super) async fn cancel_incoming(&self, id: &str) -> Result<(), NodeError> {
        let Some(inc) = self.take_incoming(id) else {
            return Ok(());
        };
        if let Some(p) = inc.prepared.lock().await.take() {
            self.discard_prepared(p).await;
        }
        let _ = std::fs::remove_file(&inc.nbd_socket);
        tracing::info!(migration = %id, "incoming migration cancelled");
        Ok(())
    }

    /// Target: one channel of a migration. Fault point (`vmon_faults`): `migrate:incoming`,
    /// the memory stream has started.
    async fn serve_channel(&self, id: &str, channel: &str, io: ChannelIo) -> anyhow::Result<()> {
        let inc = self.get_incoming(id).context("no such migration")?;
        match channel {
            "nbd" => {
                let local = tokio::net::UnixStream::connect(&inc.nbd_socket).await?;
                relay(io, local).await?;
            }
            "ram" => {
                let (qemu_end, node_end) = std::os::unix::net::UnixStream::pair()?;
                {
                    let guard = inc.prepared.lock().await;
                    let p = guard.as_ref().context("migration already taken")?;
                    p.vm.qmp.getfd("vmon-mig", qemu_end.as_fd()).await?;
                    drop(qemu_end);
                    p.vm.qmp
                        .execute_raw(
                            "migrate-incoming",
                            json!({"uri": "fd:vmon-mig"}),
                            Duration::from_secs(10),
                        )
                        .await?;
                }
                self.cfg.faults.point("migrate:incoming", id).await;
                node_end.set_nonblocking(true)?;
                let local = tokio::net::UnixStream::from_std(node_end)?;
                if let Err(e) = relay(io, local).await {
                    let why = super::migrate_check::incoming_failure(&inc).await;
                    return Err(anyhow::Error::from(e).context(why));
                }
            }
            "check" => self.serve_check(&inc, io).await?,
            other => bail!("unknown channel {other}"),
        }
        Ok(())
    }

    /// Target: starts the received guest and takes the sandbox in.
    pub(super) async fn commit_incoming(&self, id: &str) -> Result<Running, NodeError> {
        let inc = self
            .take_incoming(id)
            .ok_or_else(|| NodeError::NotFound(format!("migration {id}")))?;
        let Some(p) = inc.prepared.lock().await.take() else {
            return Err(NodeError::NotFound(format!("migration {id}")));
        };
        let _guard = self.artifacts_guard.read().await;
        let spec = &inc.spec;
        let run_dir = self.sandbox_root(&spec.sandbox_id).join(&spec.execution_id);
        if let Err(e) = run_received(id, &p.vm).await {
            self.discard_prepared(p).await;
            let _ = std::fs::remove_file(&inc.nbd_socket);
            return Err(err(e));
        }
        let _ = std::fs::remove_file(&inc.nbd_socket);
        let Prepared {
            tag,
            slot,
            overlay,
            vm,
            run_dir: pool_dir,
            mem_base,
            ..
        } = p;
        let moved = (|| {
            if let Some(parent) = run_dir.parent() {
                std::fs::create_dir_all(parent)?;
            }
            if run_dir.exists() {
                std::fs::remove_dir_all(&run_dir)?;
            }
            std::fs::rename(&pool_dir, &run_dir)?;
            // What the guest printed on the source stays there: this log starts now.
            let len = std::fs::metadata(run_dir.join("console.log"))
                .map(|m| m.len())
                .unwrap_or(0);
            std::fs::write(run_dir.join("console.skip"), len.to_string())?;
            // The same execution goes on: the source's token, version, disk size, resume
            // count and start kind.
            let state = SandboxState {
                envd_token: spec.envd_token.clone(),
                envd_version: spec.envd_version.clone(),
                disk_mb: spec.disk_mb,
                resume_generation: spec.resume_generation,
                network: Some(spec.network.clone()),
                start_kind: spec.start_kind,
                ..SandboxState::over_build(
                    &inc.basis,
                    mem_base.clone(),
                    &spec.sandbox_id,
                    &spec.execution_id,
                    slot.index,
                    overlay.clone(),
                    tag.clone(),
                )
            };
            state.save(&run_dir)?;
            anyhow::Ok(state)
        })();
        let state = match moved {
            Ok(s) => s,
            Err(e) => {
                let mut vm = vm;
                vm.kill().await;
                let _ = self.slots.release(&slot).await;
                let _ = std::fs::remove_file(self.builds.artifact(&overlay));
                return Err(err(e));
            }
        };
        tracing::info!(migration = %id, sandbox = %spec.sandbox_id, "incoming migration committed");
        self.insert(Live {
            state,
            vm: Some(vm),
            slot,
            dir: run_dir,
        })
    }

    /// Source: copies the sandbox to the target until QEMU has handed over.
    pub(super) async fn send_outgoing(&self, spec: MigrateOut) -> Result<MigrateStats, NodeError> {
        let peers = self.peers.get().cloned().ok_or_else(|| {
            NodeError::InvalidArgument("this node has no cluster peers to migrate to".into())
        })?;
        // In a cluster the target proves its id with the cluster CA's certificate.
        let target = match (&spec.target_id, peers.tls.as_ref()) {
            (Some(id), Some(tls)) if tls.pinned() => {
                RemoteNode::cluster_node(&spec.target_url, id, peers.token, tls)
            }
            _ => RemoteNode::with_tls(&spec.target_url, peers.token, peers.tls.as_ref()),
        }
        .map_err(err)?;
        let l = self
            .live_execution(&spec.sandbox_id, &spec.execution_id)
            .await?;
        if l.state.pausing_build.is_some() {
            return Err(NodeError::InvalidArgument(format!(
                "sandbox {} is pausing",
                spec.sandbox_id
            )));
        }
        let vm =
            l.vm.as_ref()
                .ok_or_else(|| NodeError::Failed("sandbox has no VM".into()))?;
        let target = Arc::new(target);
        let listen = socket_path(
            &self.cfg.data_dir.join("run"),
            &format!("{}.out", spec.migration_id),
        );
        let _ = std::fs::remove_file(&listen);
        let listener = tokio::net::UnixListener::bind(&listen).map_err(|e| err(e.into()))?;
        // The sandbox's QEMU connects to it (a socket needs write permission to connect).
        if let Err(e) = self.hand_to(&l.slot, &listen) {
            let _ = std::fs::remove_file(&listen);
            return Err(err(e));
        }
        // Every connection QEMU's NBD client makes goes to the target's export.
        let nbd_relay = {
            let target = target.clone();
            let mid = spec.migration_id.clone();
            tokio::spawn(async move {
                while let Ok((local, _)) = listener.accept().await {
                    let target = target.clone();
                    let mid = mid.clone();
                    tokio::spawn(async move {
                        match target.open_channel(&mid, "nbd").await {
                            Ok(ch) => {
                                let _ = relay(ch, local).await;
                            }
                            Err(e) => tracing::warn!(migration = %mid, "nbd channel: {e:#}"),
                        }
                    });
                }
            })
        };
        let t0 = Instant::now();
        let r = self.copy_out(&spec, &l, vm, &target, &listen).await;
        nbd_relay.abort();
        let _ = std::fs::remove_file(&listen);
        match r {
            Ok(mut stats) => {
                stats.copy_ms = t0.elapsed().as_millis() as u64;
                self.watch_handed_over(&spec.sandbox_id, &spec.execution_id);
                tracing::info!(sandbox = %spec.sandbox_id, ms = stats.copy_ms, ram_mib = stats.ram_bytes >> 20, "outgoing migration handed over");
                Ok(stats)
            }
            Err(e) => {
                self.unwind_outgoing(vm).await;
                Err(err(e))
            }
        }
    }

    /// Remembers a handed-over sandbox; with no finish or abort within [`HANDED_OVER_TTL`]
    /// its guest runs on here (the control plane that drove the move died before the switch;
    /// had it switched, the leader ends this VM as placed elsewhere).
    pub(super) fn watch_handed_over(&self, sandbox_id: &str, execution_id: &str) {
        if let Ok(mut m) = self.handed_over.lock() {
            m.insert(sandbox_id.to_string(), Instant::now());
        }
        let weak = self.me.clone();
        let (sid, eid) = (sandbox_id.to_string(), execution_id.to_string());
        tokio::spawn(async move {
            tokio::time::sleep(HANDED_OVER_TTL).await;
            let Some(node) = weak.upgrade() else { return };
            let stale = node
                .handed_over
                .lock()
                .ok()
                .and_then(|m| m.get(&sid).map(|t| t.elapsed() >= HANDED_OVER_TTL))
                .unwrap_or(false);
            if stale {
                tracing::warn!(sandbox = %sid, "no word on a handed-over migration: the sandbox runs on here");
                let _ = node.abort_outgoing(&sid, &eid).await;
            }
        });
    }

    /// The copy itself: mirror the disk, pre-copy RAM, switch over.
    async fn copy_out(
        &self,
        spec: &MigrateOut,
        l: &Live,
        vm: &vmon_vm::Vm,
        target: &Arc<RemoteNode>,
        nbd_listen: &std::path::Path,
    ) -> anyhow::Result<MigrateStats> {
        let deadline = Instant::now() + Duration::from_secs(spec.timeout_secs.max(10));
        let disk_bytes = mirror_disk(vm, l, nbd_listen, deadline).await?;
        // The memory stream: a socket pair, QEMU's end by `getfd`, ours relayed to the target.
        let ram = target
            .open_channel(&spec.migration_id, "ram")
            .await
            .context("opening the memory channel")?;
        let (qemu_end, node_end) = std::os::unix::net::UnixStream::pair()?;
        node_end.set_nonblocking(true)?;
        let local = tokio::net::UnixStream::from_std(node_end)?;
        let ram_relay = tokio::spawn(async move { relay(ram, local).await });
        let r = async {
            start_memory_copy(vm, spec, qemu_end).await?;
            wait_for_switchover(vm, spec, deadline).await?;
            // The guest is stopped: the mirror holds every write. Complete it (a cancel of a
            // mirror in step leaves the target consistent), drop the link, send the rest.
            let stopped = Instant::now();
            complete_mirror(vm).await?;
            let pr = finish_memory_copy(vm, deadline).await?;
            let check = self
                .check_target_ram(&spec.migration_id, l, vm, target)
                .await
                .context("checking the target's memory")?;
            anyhow::Ok(MigrateStats {
                copy_ms: 0,
                qemu_downtime_ms: pr.downtime_ms,
                ram_bytes: pr.ram_bytes,
                disk_bytes,
                rounds: pr.rounds,
                stopped_ms: stopped.elapsed().as_millis() as u64,
                checked_pages: check.checked,
                repaired_pages: check.repaired,
                check_ms: check.ms,
            })
        }
        .await;
        if r.is_err() {
            ram_relay.abort();
        }
        r
    }

    /// After a failed copy: no migration, no mirror, the guest running again.
    async fn unwind_outgoing(&self, vm: &vmon_vm::Vm) {
        let q = &vm.qmp;
        let t = Duration::from_secs(10);
        let _ = q.execute_raw("migrate_cancel", Value::Null, t).await;
        // A migration waiting at the switchover goes on to cancel only once released.
        let _ = q
            .execute_raw("migrate-continue", json!({"state": "pre-switchover"}), t)
            .await;
        let _ = q
            .execute_raw(
                "block-job-cancel",
                json!({"device": "mig", "force": true}),
                t,
            )
            .await;
        for _ in 0..500 {
            match q.execute_raw("query-block-jobs", Value::Null, t).await {
                Ok(v) if v.as_array().is_some_and(|a| !a.is_empty()) => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                _ => break,
            }
        }
        let _ = q
            .execute_raw("blockdev-del", json!({"node-name": "mig-nbd"}), t)
            .await;
        for _ in 0..500 {
            match q.execute_raw("query-migrate", Value::Null, t).await {
                Ok(v)
                    if matches!(
                        progress(&v).status.as_str(),
                        "cancelling" | "active" | "pre-switchover" | "device"
                    ) =>
                {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                _ => break,
            }
        }
        if let Ok(s) = q.query_status().await {
            if s.status != "running" {
                if let Err(e) = q.cont().await {
                    tracing::error!("cont after a failed migration: {e}");
                }
            }
        }
    }

    /// Source, the target committed: the handed-over QEMU ends. Fault point (`vmon_faults`):
    /// `migrate:finish`, right after the control plane switched the placement to the target.
    pub(super) async fn finish_outgoing(
        &self,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<(), NodeError> {
        self.cfg.faults.point("migrate:finish", sandbox_id).await;
        if let Ok(mut m) = self.handed_over.lock() {
            m.remove(sandbox_id);
        }
        let mut l = self.live_execution(sandbox_id, execution_id).await?;
        self.remove(sandbox_id);
        self.destroy(&mut l, false).await;
        tracing::info!(sandbox = sandbox_id, "migrated away");
        Ok(())
    }

    /// Source, the target did not commit: the guest runs on here.
    pub(super) async fn abort_outgoing(
        &self,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<(), NodeError> {
        if let Ok(mut m) = self.handed_over.lock() {
            m.remove(sandbox_id);
        }
        let l = self.live_execution(sandbox_id, execution_id).await?;
        let vm =
            l.vm.as_ref()
                .ok_or_else(|| NodeError::Failed("sandbox has no VM".into()))?;
        let s = vm.qmp.query_status().await.map_err(|e| err(e.into()))?;
        if s.status != "running" {
            vm.qmp.cont().await.map_err(|e| err(e.into()))?;
            tracing::info!(sandbox = sandbox_id, "migration aborted: running on here");
        }
        Ok(())
    }
}

fn incoming_sandbox(node: &Node, id: &str) -> String {
    node.get_incoming(id)
        .map(|i| i.spec.sandbox_id.clone())
        .unwrap_or_default()
}

#[async_trait::async_trait]
impl Channels for Node {
    fn expects(&self, migration_id: &str) -> bool {
        self.get_incoming(migration_id).is_some()
    }

    async fn serve(&self, migration_id: String, channel: String, io: ChannelIo) {
        if let Err(e) = self.serve_channel(&migration_id, &channel, io).await {
            tracing::warn!(migration = %migration_id, channel = %channel, "migration channel: {e:#}");
        }
    }
}

/// Target: the received guest, its memory and disk complete, runs: the disk's export to the
/// source ends and the guest continues.
async fn run_received(id: &str, vm: &vmon_vm::Vm) -> anyhow::Result<()> {
    super::migrate_check::incoming_completed(vm).await?;
    for (cmd, args) in [
        ("block-export-del", json!({"id": "mig", "mode": "hard"})),
        ("nbd-server-stop", Value::Null),
    ] {
        if let Err(e) = vm.qmp.execute_raw(cmd, args, Duration::from_secs(10)).await {
            tracing::warn!(migration = %id, "{cmd}: {e}");
        }
    }
    vm.qmp.cont().await?;
    let st = vm.qmp.query_status().await?;
    if !st.running {
        bail!("the received guest is {} after cont", st.status);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn query_migrate_is_read_for_status_bytes_and_rounds() {
        let v = serde_json::json!({"status": "completed", "downtime": 15,
            "ram": {"transferred": 1234, "dirty-sync-count": 3}});
        let p = super::progress(&v);
        assert_eq!(p.status, "completed");
        assert_eq!((p.ram_bytes, p.rounds, p.downtime_ms), (1234, 3, 15));
        let f = super::progress(&serde_json::json!({"status": "failed", "error-desc": "x"}));
        assert_eq!(f.error.as_deref(), Some("x"));
    }

    #[test]
    fn long_socket_paths_move_to_the_temp_dir() {
        let long = std::path::PathBuf::from("/".to_string() + &"d".repeat(120));
        assert!(super::socket_path(&long, "m1.nbd").starts_with(std::env::temp_dir()));
        assert_eq!(
            super::socket_path(std::path::Path::new("/run"), "m1.nbd"),
            std::path::PathBuf::from("/run/m1.nbd")
        );
    }
}
