//! Moving sandboxes off a node (a cluster only): live migration of one running sandbox under
//! its transition lock, and the drain of a node: it takes no new work, its running sandboxes
//! live-migrate (a few at once), those that cannot move are paused instead, never killed, and
//! paused sandboxes' builds are re-homed on another node. Progress is kept in the KV
//! (`drain-status/<node>`), so every replica answers for it.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vmon_proto::cluster::Migrated;

use super::{event, record_error, Control};
use super::{ControlError, ControlResult};
use crate::records::{Change, EventKind, SandboxState};

const DRAIN_STATUS: &str = "drain-status/";
/// Live migrations one drain runs at once.
const DRAIN_PARALLEL: usize = 2;
/// Tries of one sandbox's migration before the drain pauses it instead.
const MIGRATE_TRIES: u32 = 2;
/// How long a paused build is waited for in the object store before it is re-homed.
const STORED_WAIT: Duration = Duration::from_secs(600);

/// A drain's progress, as `GET /admin/nodes/{id}/drain` and `vmon node list` show it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DrainStatus {
    pub node: String,
    /// `draining` while sandboxes are left, `drained` when none are, `stopped` when undrained
    /// before the end.
    pub state: String,
    /// Running sandboxes that moved live.
    pub migrated: u32,
    /// Running sandboxes that could not move and were paused instead.
    pub paused: u32,
    /// Paused sandboxes whose build another node now holds.
    pub rehomed: u32,
    /// Sandboxes still on the node.
    pub remaining: u32,
    /// What went wrong, one line per sandbox.
    pub errors: Vec<String>,
}

impl Control {
    fn cluster_or_400(&self) -> ControlResult<Arc<dyn vmon_proto::cluster::Cluster>> {
        self.cluster.clone().ok_or_else(|| {
            ControlError::bad_request("moving sandboxes needs a cluster (vmon api --etcd)")
        })
    }

    /// Live-migrates a running sandbox to `target` (or the best other node).
    pub async fn migrate(&self, id: &str, target: Option<&str>) -> ControlResult<Migrated> {
        let cluster = self.cluster_or_400()?;
        if !crate::ids::plausible_sandbox_id(id) {
            return Err(ControlError::sandbox_not_found(id));
        }
        let guard = self.lock(id).await?;
        let result = async {
            let mut rec = self
                .records
                .sandbox(id)
                .await
                .map_err(record_error)?
                .ok_or_else(|| ControlError::sandbox_not_found(id))?;
            if rec.state != SandboxState::Running {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is paused; only a running sandbox migrates live"
                )));
            }
            // Its secrets' egress listener lives in its slot on its node, with the values in
            // that node's memory only: a pause and resume makes it anew elsewhere.
            if !self
                .egress_spec(&rec.team_id, &rec.network, false)
                .await?
                .is_empty()
            {
                return Err(ControlError::bad_request(format!(
                    "sandbox {id} injects secrets at egress and cannot migrate live; pause and resume it to move it"
                )));
            }
            let m = cluster
                .migrate(
                    &rec.id,
                    &rec.execution_id,
                    target,
                    self.config.migration_downtime_ms,
                )
                .await?;
            rec.guest_ip = Some(m.running.guest_ip);
            let updated = event(
                &rec,
                EventKind::Updated,
                serde_json::json!({ "migrated": {
                    "from": m.from, "to": m.to,
                    "totalMs": m.total_ms, "switchMs": m.switch_ms,
                }}),
            );
            self.commit(
                Change::update(&rec, &rec.execution_id),
                updated,
                guard.fence().token(),
            )
            .await?;
            tracing::info!(sandbox_id = %rec.id, from = %m.from, to = %m.to, ms = m.total_ms, "sandbox migrated");
            Ok(m)
        }
        .await;
        let _ = guard.unlock().await;
        result
    }

    /// Starts draining `node` in the background; returns its first status.
    pub async fn drain(self: &Arc<Self>, node: &str) -> ControlResult<DrainStatus> {
        let cluster = self.cluster_or_400()?;
        if !cluster.members().await.iter().any(|n| n.id == node) {
            return Err(ControlError::not_found(format!(
                "node {node} is not in the cluster"
            )));
        }
        cluster.set_draining(node, true).await?;
        let status = DrainStatus {
            node: node.to_string(),
            state: "draining".into(),
            ..Default::default()
        };
        self.save_drain(&status).await;
        let me = self.clone();
        let node = node.to_string();
        tokio::spawn(async move {
            if let Err(e) = me.run_drain(&node).await {
                tracing::warn!(node_id = %node, error = %e, "drain stopped");
            }
        });
        Ok(status)
    }

    /// Takes new work on `node` again (a drain in progress stops after its current step).
    pub async fn undrain(&self, node: &str) -> ControlResult<()> {
        let cluster = self.cluster_or_400()?;
        cluster.set_draining(node, false).await?;
        let _ = self.kv.delete(&format!("{DRAIN_STATUS}{node}")).await;
        Ok(())
    }

    pub async fn drain_status(&self, node: &str) -> Option<DrainStatus> {
        let e = self.kv.get(&format!("{DRAIN_STATUS}{node}")).await.ok()??;
        serde_json::from_slice(&e.value).ok()
    }

    async fn save_drain(&self, s: &DrainStatus) {
        if let Ok(v) = serde_json::to_vec(s) {
            let _ = self.kv.put(&format!("{DRAIN_STATUS}{}", s.node), v).await;
        }
    }

    /// The nodes marked draining (empty on one machine).
    pub async fn draining_nodes(&self) -> std::collections::HashSet<String> {
        match &self.cluster {
            Some(c) => c.draining().await.into_iter().collect(),
            None => Default::default(),
        }
    }

    async fn still_draining(&self, node: &str) -> bool {
        match &self.cluster {
            Some(c) => c.draining().await.iter().any(|n| n == node),
            None => false,
        }
    }

    /// The sandboxes whose placement is `node`: running, and paused.
    async fn on_node(&self, node: &str) -> ControlResult<(Vec<String>, Vec<(String, String)>)> {
        let cluster = self.cluster_or_400()?;
        let mut running = Vec::new();
        let mut paused = Vec::new();
        for rec in self.sandboxes(None).await? {
            if cluster.placement(&rec.id).await.as_deref() != Some(node) {
                continue;
            }
            match rec.state {
                SandboxState::Running => running.push(rec.id),
                SandboxState::Paused => paused.push((rec.id, rec.build.build_id)),
            }
        }
        Ok((running, paused))
    }

    async fn run_drain(self: &Arc<Self>, node: &str) -> ControlResult<()> {
        use futures::StreamExt;
        let cluster = self.cluster_or_400()?;
        let mut status = self.drain_status(node).await.unwrap_or(DrainStatus {
            node: node.to_string(),
            state: "draining".into(),
            ..Default::default()
        });
        let (running, paused) = self.on_node(node).await?;
        status.remaining = (running.len() + paused.len()) as u32;
        self.save_drain(&status).await;
        // Running sandboxes first, a few at once; one that cannot move is paused.
        let moves = futures::stream::iter(running.into_iter().map(|id| {
            let me = self.clone();
            async move {
                let mut last = None;
                for _ in 0..MIGRATE_TRIES {
                    if !me.still_draining(node).await {
                        return (id, Err(None));
                    }
                    match me.migrate(&id, None).await {
                        Ok(_) => return (id, Ok(true)),
                        // It ended or paused meanwhile: nothing to move.
                        Err(e) if e.is_not_found() || e.is_conflict() => return (id, Ok(false)),
                        Err(e) => last = Some(e.to_string()),
                    }
                }
                (id, Err(last))
            }
        }))
        .buffer_unordered(DRAIN_PARALLEL)
        .collect::<Vec<_>>()
        .await;
        let mut to_pause = Vec::new();
        for (id, r) in moves {
            match r {
                Ok(true) => status.migrated += 1,
                Ok(false) => {}
                Err(None) => return self.stop_drain(status).await,
                Err(Some(why)) => {
                    status
                        .errors
                        .push(format!("{id}: live migration failed ({why}); pausing it"));
                    to_pause.push(id);
                }
            }
        }
        self.save_drain(&status).await;
        let mut paused = paused;
        for id in to_pause {
            match self.pause_for_drain(&id).await {
                Ok(Some(build)) => {
                    status.paused += 1;
                    paused.push((id, build));
                }
                Ok(None) => {}
                Err(e) => status.errors.push(format!("{id}: pause failed: {e}")),
            }
        }
        // Paused sandboxes: their build in the object store, held by another node.
        for (id, build) in paused {
            if !self.still_draining(node).await {
                return self.stop_drain(status).await;
            }
            match self.wait_stored(&build).await {
                Ok(()) => match cluster.rehome(&build, node).await {
                    Ok(to) => {
                        status.rehomed += 1;
                        tracing::info!(sandbox_id = %id, build_id = %build, node_id = %to, "paused sandbox re-homed");
                    }
                    Err(e) => status.errors.push(format!("{id}: re-homing failed: {e}")),
                },
                Err(e) => status.errors.push(format!("{id}: {e}")),
            }
            self.save_drain(&status).await;
        }
        let left = cluster.running_on(node).await.map(|r| r.len()).unwrap_or(0);
        status.remaining = left as u32;
        status.state = if left == 0 { "drained" } else { "draining" }.into();
        self.save_drain(&status).await;
        tracing::info!(node_id = %node, migrated = status.migrated, paused = status.paused, rehomed = status.rehomed, left, "drain done");
        Ok(())
    }

    async fn stop_drain(&self, mut status: DrainStatus) -> ControlResult<()> {
        status.state = "stopped".into();
        self.save_drain(&status).await;
        Ok(())
    }

    /// Pauses (with memory) a sandbox the drain could not move; its new build's id.
    async fn pause_for_drain(&self, id: &str) -> ControlResult<Option<String>> {
        let guard = self.lock(id).await?;
        let result = async {
            let Some(rec) = self.records.sandbox(id).await.map_err(record_error)? else {
                return Ok(None);
            };
            if rec.state != SandboxState::Running {
                return Ok(None);
            }
            self.pause_locked(
                rec,
                true,
                guard.fence().token(),
                super::why::PauseWhy::Request,
            )
            .await?;
            let rec = self.records.sandbox(id).await.map_err(record_error)?;
            Ok(rec.map(|r| r.build.build_id))
        }
        .await;
        let _ = guard.unlock().await;
        result
    }

    /// Waits until `build`'s manifest is in the object store (uploads run after the pause).
    async fn wait_stored(&self, build: &str) -> ControlResult<()> {
        let t0 = std::time::Instant::now();
        loop {
            match self.node.build_info(build).await {
                Ok(info) if info.stored => return Ok(()),
                Ok(_) => {}
                Err(e) => return Err(e.into()),
            }
            if t0.elapsed() > STORED_WAIT {
                return Err(ControlError::unavailable(format!(
                    "build {build} did not reach the object store in time"
                )));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}
