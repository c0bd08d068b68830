//! The node calls over the cluster: which member each call goes to.

use std::collections::HashSet;
use std::time::Instant;

use vmon_proto::cluster::Cluster;
use vmon_proto::node::{
    BuildId, BuildInfo, BuildInfoOf, BuildTemplate, Builds, Call, Checkpoint, DeleteBuild,
    DeleteVolume, Kill, LatestMetrics, ListRunning, LogEntry, LogQuery, Logs, MetricSample,
    Metrics, NodeCall, NodeCalls, NodeControl, NodeError, NodeReply, OciImage, Pause, PauseBuilds,
    PausedState, PausedStateOf, PoolDepths, ResolveImage, Running, Start, StartSpec, TemplateSpec,
};

use super::ClusterNodes;
use crate::placement::{self, Need};

/// Each call goes to the node it concerns; a call about one sandbox that is not named here goes
/// to the node running that sandbox ([`NodeCall::sandbox_id`]), so a new call of that kind
/// needs nothing here.
#[async_trait::async_trait]
impl NodeControl for ClusterNodes {
    async fn handle(&self, call: NodeCall) -> Result<NodeReply, NodeError> {
        match call {
            NodeCall::BuildTemplate(c) => {
                BuildTemplate::answered(self.build_template(c.spec).await)
            }
            NodeCall::ResolveImage(c) => ResolveImage::answered(self.resolve_image(c.image).await),
            NodeCall::BuildInfoOf(c) => BuildInfoOf::answered(self.build_info(&c.build_id).await),
            NodeCall::PausedStateOf(c) => {
                PausedStateOf::answered(self.paused_state(&c.build_id).await)
            }
            NodeCall::DeleteBuild(c) => DeleteBuild::answered(self.delete_build(&c.build_id).await),
            NodeCall::DeleteVolume(c) => {
                DeleteVolume::answered(self.delete_volume(&c.volume_id).await)
            }
            // Not gathered from the nodes (yet): over a cluster, interrupted pauses are left to
            // the leader's reconciliation and unnamed builds are not collected.
            NodeCall::PauseBuilds(_) => PauseBuilds::answered(Ok(Vec::new())),
            NodeCall::Builds(_) => Builds::answered(Ok(Vec::new())),
            NodeCall::Start(c) => Start::answered(self.start(c.spec).await),
            NodeCall::Kill(c) => Kill::answered(self.kill(&c.sandbox_id, &c.execution_id).await),
            NodeCall::Pause(c) => {
                Pause::answered(self.pause(&c.sandbox_id, &c.execution_id, c.memory).await)
            }
            NodeCall::Checkpoint(c) => Checkpoint::answered(
                self.checkpoint(&c.sandbox_id, &c.execution_id, c.memory)
                    .await,
            ),
            NodeCall::ListRunning(_) => ListRunning::answered(Ok(self.list_running().await)),
            NodeCall::Metrics(c) => {
                Metrics::answered(self.metrics(&c.sandbox_id, c.start_unix, c.end_unix).await)
            }
            NodeCall::LatestMetrics(c) => {
                LatestMetrics::answered(Ok(self.latest_metrics(&c.sandbox_ids).await))
            }
            NodeCall::Logs(c) => Logs::answered(self.logs(&c.sandbox_id, c.query).await),
            NodeCall::PoolDepths(_) => PoolDepths::answered(Ok(self.pool_depths().await)),
            other => self.on_sandbox_node(other).await,
        }
    }
}

impl ClusterNodes {
    /// `call` on the node running the sandbox it names. The migration calls name no
    /// sandbox to route by: the cluster's migration sends each to the node it picked.
    async fn on_sandbox_node(&self, call: NodeCall) -> Result<NodeReply, NodeError> {
        let Some(id) = call.sandbox_id().map(str::to_string) else {
            return Err(NodeError::InvalidArgument(format!(
                "{} goes to one node, which the cluster's own operations pick",
                call.name()
            )));
        };
        let (node, c) = self.node_of(&id).await?;
        let r = c.handle(call).await;
        self.said_unreached(&node, &c, r).await
    }

    async fn build_template(&self, spec: TemplateSpec) -> Result<BuildInfo, NodeError> {
        let ranked = placement::rank(
            &self.placeable().await,
            &HashSet::new(),
            &Need {
                memory_mb: u64::from(spec.memory_mb),
                ..Need::default()
            },
        )
        .map_err(NodeError::Exhausted)?;
        let (node, info) = self
            .on_first_fit(ranked, &HashSet::new(), |c| {
                let spec = spec.clone();
                async move { c.build_template(spec).await }
            })
            .await?;
        self.holds(&node, &info).await;
        self.spread(node.id.clone(), info.build_id.clone());
        Ok(info)
    }

    async fn resolve_image(&self, image: OciImage) -> Result<String, NodeError> {
        let members = self.live().await;
        let node = members
            .first()
            .ok_or_else(|| NodeError::Exhausted("no node is registered".into()))?;
        self.client(node)?.resolve_image(image).await
    }

    async fn build_info(&self, build_id: &str) -> Result<BuildInfo, NodeError> {
        let holders = self.holders(build_id).await;
        let mut members = self.live().await;
        members.sort_by_key(|n| !holders.contains(&n.id));
        let mut last = NodeError::BuildNotFound(build_id.to_string());
        for n in members {
            match self.client(&n)?.build_info(build_id).await {
                Ok(info) => return Ok(info),
                Err(e @ NodeError::BuildNotFound(_)) => last = e,
                Err(e) => {
                    tracing::warn!(node_id = %n.id, build_id, error = %e, "build_info failed on a node");
                    last = e;
                }
            }
        }
        Err(last)
    }

    async fn paused_state(&self, build_id: &str) -> Result<PausedState, NodeError> {
        // The nodes that hold it, each asked without fetching: a node's own disk (and its
        // parked QEMU) beats the store.
        let holders = self.holders(build_id).await;
        let mut found = PausedState::default();
        let mut answered = false;
        for n in self.live().await {
            if !holders.contains(&n.id) {
                continue;
            }
            match self.client(&n)?.paused_state(build_id).await {
                Ok(s) => {
                    answered = true;
                    found.parked |= s.parked;
                    found.local |= s.local;
                    found.stored |= s.stored;
                }
                Err(e) => {
                    tracing::debug!(node_id = %n.id, build_id, error = %e, "paused_state failed on a node")
                }
            }
        }
        if answered {
            Ok(found)
        } else {
            Err(NodeError::BuildNotFound(build_id.to_string()))
        }
    }

    async fn delete_build(&self, build_id: &str) -> Result<(), NodeError> {
        let id = build_id.to_string();
        let answers = self
            .ask_all(|c| {
                let id = id.clone();
                async move { c.delete_build(&id).await }
            })
            .await;
        let mut deleted = false;
        for (n, r) in answers {
            match r {
                Ok(()) => deleted = true,
                Err(NodeError::BuildNotFound(_)) => {}
                Err(e) => {
                    tracing::warn!(node_id = %n.id, build_id, error = %e, "deleting a build failed on a node");
                    return Err(e);
                }
            }
        }
        self.forget_build(build_id).await;
        if deleted {
            Ok(())
        } else {
            Err(NodeError::BuildNotFound(build_id.to_string()))
        }
    }

    /// Every live node deletes its cache of the volume, and the store's objects (the same
    /// objects for all: deleting twice is harmless). Done when one node did it.
    async fn delete_volume(&self, volume_id: &str) -> Result<(), NodeError> {
        let id = volume_id.to_string();
        let answers = self
            .ask_all(|c| {
                let id = id.clone();
                async move { c.delete_volume(&id).await }
            })
            .await;
        let mut last = NodeError::Exhausted("no node is registered".into());
        let mut done = false;
        for (n, r) in answers {
            match r {
                Ok(()) => done = true,
                Err(e) => {
                    tracing::warn!(node_id = %n.id, volume_id, error = %e, "deleting a volume failed on a node");
                    last = e;
                }
            }
        }
        if done {
            Ok(())
        } else {
            Err(last)
        }
    }

    async fn start(&self, spec: StartSpec) -> Result<Running, NodeError> {
        let memory_restore = !spec.cold_boot && spec.volumes.is_empty() && spec.gpus == 0;
        let holders = self.holders(&spec.build_id).await;
        let (ranked, spec) = match self
            .candidates(&spec.build_id, &holders, memory_restore, spec.gpus)
            .await
        {
            Ok(r) => (r, spec),
            // No node can restore its memory (another accelerator, QEMU or CPU model than
            // the build's): boot its disk on one that has room, as seed 003 says.
            Err(e) if memory_restore => {
                match self
                    .candidates(&spec.build_id, &holders, false, spec.gpus)
                    .await
                {
                    Ok(r) => {
                        tracing::warn!(sandbox_id = %spec.sandbox_id, build_id = %spec.build_id, reason = %e, "no node can restore this build's memory: cold-booting its disk");
                        (
                            r,
                            StartSpec {
                                cold_boot: true,
                                ..spec
                            },
                        )
                    }
                    Err(_) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let had_holder = ranked.iter().any(|n| holders.contains(&n.id));
        let (node, running) = self
            .on_first_fit(ranked, &holders, |c| {
                let spec = spec.clone();
                async move { c.start(spec).await }
            })
            .await
            .map_err(|e| match e {
                // Only dead nodes held it, and the others could not fetch it.
                NodeError::BuildNotFound(b) if !holders.is_empty() && !had_holder => {
                    NodeError::Exhausted(format!(
                        "build {b} is only on nodes that are down (and not in the object store)"
                    ))
                }
                e => e,
            })?;
        self.placed.lock().unwrap_or_else(|p| p.into_inner()).push((
            Instant::now(),
            node.id.clone(),
            spec.gpus,
        ));
        self.place(&spec.sandbox_id, &node.id, running.guest_ip)
            .await;
        if !holders.contains(&node.id) {
            if let Ok(info) = self.client(&node)?.build_info(&spec.build_id).await {
                self.holds(&node, &info).await;
            }
        }
        Ok(running)
    }

    async fn kill(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
        match self.node_of(sandbox_id).await {
            Ok((node, c)) => {
                let r = c.kill(sandbox_id, execution_id).await;
                match self.said_unreached(&node, &c, r).await {
                    // Not reached (down or stalled): the kill is recorded now, as for a node
                    // that left the registry; the VM, if it still runs, is one no record
                    // names, which the leader kills once the node answers (or the node's
                    // fence, past the grace).
                    Ok(()) | Err(NodeError::Exhausted(_)) => {}
                    Err(e) => return Err(e),
                }
                self.forget(sandbox_id).await;
                Ok(())
            }
            // Its node is gone, and the VM with it.
            Err(NodeError::Exhausted(_)) => {
                self.forget(sandbox_id).await;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn pause(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        self.capture(sandbox_id, execution_id, memory, false).await
    }

    async fn checkpoint(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        self.capture(sandbox_id, execution_id, memory, true).await
    }

    /// A pause (or, `checkpoint`, a capture that leaves the sandbox running) on the sandbox's
    /// node, whose build that node then holds.
    async fn capture(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
        checkpoint: bool,
    ) -> Result<BuildInfo, NodeError> {
        let (node, c) = self.node_of(sandbox_id).await?;
        let info = if checkpoint {
            c.checkpoint(sandbox_id, execution_id, memory).await
        } else {
            c.pause(sandbox_id, execution_id, memory).await
        };
        let info = self.said_unreached(&node, &c, info).await?;
        self.holds(&node, &info).await;
        Ok(info)
    }

    async fn list_running(&self) -> Vec<Running> {
        self.ask_all_ok(|c| async move { c.list_running().await })
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    async fn metrics(
        &self,
        sandbox_id: &str,
        start_unix: i64,
        end_unix: i64,
    ) -> Result<Vec<MetricSample>, NodeError> {
        if let Ok((_, c)) = self.node_of(sandbox_id).await {
            return c.metrics(sandbox_id, start_unix, end_unix).await;
        }
        // Killed (no placement any more): whichever node kept its samples.
        let id = sandbox_id.to_string();
        let answers = self
            .ask_all_ok(|c| {
                let id = id.clone();
                async move { c.metrics(&id, start_unix, end_unix).await }
            })
            .await;
        Ok(answers.into_iter().flatten().collect())
    }

    async fn latest_metrics(&self, sandbox_ids: &[String]) -> Vec<(String, MetricSample)> {
        let ids = sandbox_ids.to_vec();
        self.ask_all_ok(|c| {
            let ids = ids.clone();
            async move { c.latest_metrics(ids).await }
        })
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    async fn logs(&self, sandbox_id: &str, query: LogQuery) -> Result<Vec<LogEntry>, NodeError> {
        if let Ok((_, c)) = self.node_of(sandbox_id).await {
            return c.logs(sandbox_id, query).await;
        }
        let id = sandbox_id.to_string();
        let answers = self
            .ask_all_ok(|c| {
                let id = id.clone();
                let q = query.clone();
                async move { c.logs(&id, q).await }
            })
            .await;
        Ok(answers.into_iter().max_by_key(Vec::len).unwrap_or_default())
    }

    async fn pool_depths(&self) -> Vec<(BuildId, usize)> {
        self.ask_all_ok(|c| async move { c.pool_depths().await })
            .await
            .into_iter()
            .flatten()
            .collect()
    }
}
