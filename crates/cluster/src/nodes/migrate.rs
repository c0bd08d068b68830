//! Moving sandboxes between nodes: live migration (the node calls in order, and the one
//! placement write that switches the sandbox), draining marks, and re-homing a paused
//! sandbox's build onto another node.

use std::collections::HashSet;
use std::time::Instant;

use vmon_proto::cluster::{BuildOrigin, Migrated, NodeInfo, DRAIN_PREFIX};
use vmon_proto::node::{MigrateOut, NodeCalls, NodeError};

use super::ClusterNodes;
use crate::placement::HEADROOM_MB;
use vmon_nodeclient::RemoteNode;

/// The whole copy of one migration ends in failure after this long.
const COPY_TIMEOUT_SECS: u64 = 600;
/// How long a migration waits for the build under the sandbox to reach the object store.
const STORED_WAIT: std::time::Duration = std::time::Duration::from_secs(180);

impl ClusterNodes {
    /// Nodes marked draining.
    pub(super) async fn draining_nodes(&self) -> HashSet<String> {
        match self.kv.list(DRAIN_PREFIX).await {
            Ok(es) => es
                .into_iter()
                .filter_map(|e| e.key.strip_prefix(DRAIN_PREFIX).map(str::to_string))
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "reading the drain marks failed");
                HashSet::new()
            }
        }
    }

    /// Live nodes that take new work.
    pub(super) async fn placeable(&self) -> Vec<NodeInfo> {
        let draining = self.draining_nodes().await;
        self.live()
            .await
            .into_iter()
            .filter(|n| !draining.contains(&n.id))
            .collect()
    }

    pub(super) async fn mark_draining(
        &self,
        node_id: &str,
        draining: bool,
    ) -> Result<(), NodeError> {
        let key = format!("{DRAIN_PREFIX}{node_id}");
        let r = if draining {
            self.kv.put(&key, b"".to_vec()).await.map(|_| ())
        } else {
            self.kv.delete(&key).await.map(|_| ())
        };
        r.map_err(|e| NodeError::Failed(format!("writing the drain mark: {e}")))
    }

    /// Where a sandbox from `from` can go: live, not draining, not `from`, able to load
    /// `from`'s memory, with room; least loaded first.
    async fn targets(&self, from: &NodeInfo, memory_mb: u32) -> Vec<NodeInfo> {
        let origin = BuildOrigin::of(from);
        let mut fit: Vec<NodeInfo> = self
            .placeable()
            .await
            .into_iter()
            .filter(|n| {
                n.id != from.id
                    && n.restores_from(&origin)
                    && n.free_slots > 0
                    && n.free_memory_mb >= u64::from(memory_mb) + HEADROOM_MB
            })
            .collect();
        fit.sort_by(|a, b| a.load().total_cmp(&b.load()));
        fit
    }

    pub(super) async fn migrate_sandbox(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        target: Option<&str>,
        downtime_ms: u64,
    ) -> Result<Migrated, NodeError> {
        let t0 = Instant::now();
        let (from, source) = self.node_of(sandbox_id).await?;
        let spec = source.migrate_describe(sandbox_id, execution_id).await?;
        let to = self
            .migration_target(sandbox_id, &from, target, spec.memory_mb)
            .await?;
        let target = self.client(&to)?;
        let basis = spec.basis.clone();
        if !self.holders(&basis).await.contains(&to.id) {
            wait_stored(&source, &basis, sandbox_id, &to).await?;
        }
        let migration_id = target.migrate_in(spec).await?;
        let sent = source
            .migrate_out(MigrateOut {
                sandbox_id: sandbox_id.to_string(),
                execution_id: execution_id.to_string(),
                target_url: to.rpc_url.clone(),
                target_id: Some(to.id.clone()),
                migration_id: migration_id.clone(),
                downtime_ms,
                timeout_secs: COPY_TIMEOUT_SECS,
            })
            .await;
        let stats = match sent {
            Ok(s) => s,
            Err(e) => {
                let _ = target.migrate_cancel(&migration_id).await;
                return Err(e);
            }
        };
        let t_switch = Instant::now();
        let running = match target.migrate_commit(&migration_id).await {
            Ok(r) => r,
            Err(e) => {
                let _ = target.migrate_cancel(&migration_id).await;
                if let Err(a) = source.migrate_abort(sandbox_id, execution_id).await {
                    tracing::error!(sandbox_id, error = %a, "resuming the source after a failed commit failed");
                }
                return Err(NodeError::Failed(format!(
                    "the target {} did not start the sandbox: {e}",
                    to.id
                )));
            }
        };
        let switch_ms = t_switch.elapsed().as_millis() as u64;
        // The switch: from this write every replica and proxy sends the sandbox's calls and
        // traffic to the target.
        self.place(sandbox_id, &to.id, running.guest_ip).await;
        if let Err(e) = source.migrate_finish(sandbox_id, execution_id).await {
            // The leader's reconciliation ends a VM no placement names.
            tracing::warn!(sandbox_id, node_id = %from.id, error = %e, "ending the migrated source failed");
        }
        if let Ok(info) = target.build_info(&basis).await {
            self.holds(&to, &info).await;
        }
        Ok(Migrated {
            from: from.id,
            to: to.id,
            running,
            stats,
            switch_ms,
            total_ms: t0.elapsed().as_millis() as u64,
        })
    }

    /// Where sandbox `sandbox_id` (of `memory_mb`, on `from`) moves: the node asked for,
    /// when it can load `from`'s memory, else the least loaded that can and has room.
    async fn migration_target(
        &self,
        sandbox_id: &str,
        from: &NodeInfo,
        target: Option<&str>,
        memory_mb: u32,
    ) -> Result<NodeInfo, NodeError> {
        match target {
            Some(id) if id == from.id => Err(NodeError::InvalidArgument(format!(
                "sandbox {sandbox_id} already runs on {id}"
            ))),
            Some(id) => {
                let n = self.member(id).await.ok_or_else(|| {
                    NodeError::InvalidArgument(format!("node {id} is not in the cluster"))
                })?;
                if !n.restores_from(&BuildOrigin::of(from)) {
                    return Err(NodeError::InvalidArgument(format!(
                        "node {id} cannot load memory from {} (another accelerator, QEMU or CPU)",
                        from.id
                    )));
                }
                Ok(n)
            }
            None => self
                .targets(from, memory_mb)
                .await
                .into_iter()
                .next()
                .ok_or_else(|| {
                    NodeError::Exhausted(format!(
                        "no other node can take sandbox {sandbox_id} (compatible, with room, not draining)"
                    ))
                }),
        }
    }

    pub(super) async fn rehome_build(
        &self,
        build_id: &str,
        away_from: &str,
    ) -> Result<String, NodeError> {
        let holders = self.holders(build_id).await;
        let place = self.build_place(build_id).await;
        let mut last = NodeError::Exhausted(format!("no other node can hold build {build_id}"));
        for n in self.placeable().await {
            if n.id == away_from {
                continue;
            }
            if let Some(p) = &place {
                if !n.restores_from(&p.origin) {
                    continue;
                }
            }
            if holders.contains(&n.id) {
                return Ok(n.id);
            }
            // A node that lacks a build fetches it from the object store when asked about it.
            match self.client(&n)?.build_info(build_id).await {
                Ok(info) => {
                    self.holds(&n, &info).await;
                    return Ok(n.id);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// Waits (up to [`STORED_WAIT`]) until build `basis` under the sandbox is in the object
/// store, where the target `to` fetches it from: a build made moments ago (a template, a
/// checkpoint) may still be uploading.
async fn wait_stored(
    source: &RemoteNode,
    basis: &str,
    sandbox_id: &str,
    to: &NodeInfo,
) -> Result<(), NodeError> {
    let t = Instant::now();
    loop {
        match source.build_info(basis).await {
            Ok(info) if info.stored => return Ok(()),
            Ok(_) if t.elapsed() < STORED_WAIT => {
                tokio::time::sleep(std::time::Duration::from_secs(1)).await
            }
            Ok(_) => {
                return Err(NodeError::Exhausted(format!(
                    "build {basis} under sandbox {sandbox_id} is not in the object store yet, so {} cannot load it; try again later",
                    to.id
                )))
            }
            Err(e) => return Err(e),
        }
    }
}
