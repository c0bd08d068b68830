//! The node's [`NodeHandler`]: what the API (in process or over node RPC) may ask of it. Each
//! call is a thin step into the room that does the work.

use std::sync::Arc;

use tokio::sync::Mutex;
use vmon_proto::node::{
    BuildInfo, BuildInfoOf, BuildTemplate, Builds, Checkpoint, DeleteBuild, DeleteVolume, Exec,
    ExecOutput, Keepalive, KeepaliveAsk, KeptBuild, Kill, LatestMetrics, ListRunning, LogEntry,
    Logs, MetricSample, Metrics, MigrateAbort, MigrateAccept, MigrateCancel, MigrateCommit,
    MigrateDescribe, MigrateFinish, MigrateIn, MigrateSend, MigrateStats, NodeError, NodeHandler,
    Pause, PauseBuild, PauseBuilds, PausedState, PausedStateOf, PoolDepths, PutFile, ResolveImage,
    Running, Start, UpdateEgress, UpdateNetwork,
};

use super::{err, Node};
use crate::envd_client;
use crate::sandbox::Live;

#[async_trait::async_trait]
impl NodeHandler for Node {
    async fn build_template(
        &self,
        BuildTemplate { spec }: BuildTemplate,
    ) -> Result<BuildInfo, NodeError> {
        self.make_template(spec).await
    }

    async fn resolve_image(
        &self,
        ResolveImage { image }: ResolveImage,
    ) -> Result<String, NodeError> {
        self.image_digest(&image).await
    }

    async fn build_info(
        &self,
        BuildInfoOf { build_id }: BuildInfoOf,
    ) -> Result<BuildInfo, NodeError> {
        let build_id = build_id.as_str();
        self.ensure_local(build_id).await?;
        let r = self.record(build_id)?;
        let mut info = Self::info(&r);
        info.stored = self.is_stored(build_id);
        // A template build (no parent) is compared with the node's image, waiting for it when
        // it is being built; builds made from sandboxes are what they are.
        if r.parent.is_none() {
            info.older_image = r.image_hash != self.image().await?.manifest.hash;
        }
        Ok(info)
    }

    async fn delete_build(&self, DeleteBuild { build_id }: DeleteBuild) -> Result<(), NodeError> {
        self.remove_build(&build_id).await
    }

    async fn delete_volume(
        &self,
        DeleteVolume { volume_id }: DeleteVolume,
    ) -> Result<(), NodeError> {
        self.delete_store_volume(&volume_id).await
    }

    async fn paused_state(
        &self,
        PausedStateOf { build_id }: PausedStateOf,
    ) -> Result<PausedState, NodeError> {
        let build_id = build_id.as_str();
        Ok(PausedState {
            parked: self.is_parked(build_id),
            local: self.record(build_id).is_ok(),
            stored: self.is_stored(build_id),
        })
    }

    async fn pause_builds(&self, _: PauseBuilds) -> Result<Vec<PauseBuild>, NodeError> {
        let records = self.builds.list().map_err(err)?;
        Ok(records
            .iter()
            .filter_map(|r| {
                let from = r.paused_from.as_ref()?;
                Some(PauseBuild {
                    sandbox_id: from.sandbox_id.clone(),
                    execution_id: from.execution_id.clone(),
                    build: Self::info(r),
                })
            })
            .collect())
    }

    async fn builds(&self, _: Builds) -> Result<Vec<KeptBuild>, NodeError> {
        let records = self.builds.list().map_err(err)?;
        Ok(records
            .iter()
            .map(|r| KeptBuild {
                build: Self::info(r),
                // A record whose file vanished meanwhile was just deleted: "now" keeps it
                // out of a collection that would find nothing to delete anyway.
                recorded_unix: self
                    .builds
                    .recorded_unix(&r.id)
                    .unwrap_or_else(crate::builds::now_unix),
            })
            .collect())
    }

    async fn start(&self, Start { spec }: Start) -> Result<Running, NodeError> {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| NodeError::Failed("node is shutting down".into()))?;
        me.ensure_local(&spec.build_id).await?;
        me.start_sandbox(spec).await
    }

    async fn kill(
        &self,
        Kill {
            sandbox_id,
            execution_id,
        }: Kill,
    ) -> Result<(), NodeError> {
        let (sandbox_id, execution_id) = (sandbox_id.as_str(), execution_id.as_str());
        let mut l = self.live_execution(sandbox_id, execution_id).await?;
        self.remove(sandbox_id);
        // The answer waits for the guest to end, not for its cleanup: the QEMU is killed (its
        // overlay goes anyway, nothing to flush) and the slot and files are freed after the
        // reply, by a task that holds neither the node nor the sandbox. `sandbox.json` goes
        // last: a node that dies meanwhile finds it at its next start and finishes the cleanup
        // (recovery reaps the dead QEMU's run directory and slot; the sweep takes the files).
        self.egress.stop(&l.state.id, None).await;
        if let Some(mut vm) = l.vm.take() {
            vm.kill().await;
        }
        vmon_vm::process::kill_recorded(&l.dir, &l.state.qemu_tag);
        self.gpus.release(sandbox_id);
        // Its QEMU is gone, and with it the volumes' daemons: what it wrote goes to the store.
        self.write_back_after_kill(&l.state.volumes).await;
        self.drop_bucket_caches(&l.state.volumes).await;
        let slots = self.slots.clone();
        let slot = l.slot.clone();
        let dir = l.dir.clone();
        let mut files = vec![self.builds.artifact(&l.state.overlay)];
        if let crate::sandbox::RamSource::Shared { file } = &l.state.ram {
            files.push(self.builds.artifact(file));
        }
        drop(l);
        tokio::spawn(async move {
            let _ = slots.release(&slot).await;
            for f in files {
                let _ = std::fs::remove_file(f);
            }
            let _ = std::fs::remove_file(crate::sandbox::SandboxState::path(&dir));
            vmon_vm::process::clear_files(&dir);
        });
        Ok(())
    }

    async fn pause(&self, c: Pause) -> Result<BuildInfo, NodeError> {
        self.pause_sandbox(&c.sandbox_id, &c.execution_id, c.memory)
            .await
    }

    async fn checkpoint(&self, c: Checkpoint) -> Result<BuildInfo, NodeError> {
        self.checkpoint_sandbox(&c.sandbox_id, &c.execution_id, c.memory)
            .await
    }

    async fn update_network(&self, c: UpdateNetwork) -> Result<(), NodeError> {
        let UpdateNetwork {
            sandbox_id,
            execution_id,
            policy,
        } = c;
        let (sandbox_id, execution_id) = (sandbox_id.as_str(), execution_id.as_str());
        self.slots
            .vet(&policy)
            .await
            .map_err(NodeError::InvalidArgument)?;
        let mut l = self.live_execution(sandbox_id, execution_id).await?;
        l.slot
            .set_policy(&policy, self.slots.perimeter())
            .await
            .map_err(err)?;
        l.state.network = Some(policy);
        let dir = l.dir.clone();
        l.state.save(&dir).map_err(err)
    }

    async fn update_egress(&self, c: UpdateEgress) -> Result<(), NodeError> {
        self.update_egress_of(&c.sandbox_id, &c.execution_id, c.egress)
            .await
    }

    async fn list_running(&self, _: ListRunning) -> Result<Vec<Running>, NodeError> {
        let lives: Vec<Arc<Mutex<Live>>> = match self.sandboxes.lock() {
            Ok(m) => m.values().cloned().collect(),
            Err(_) => return Err(NodeError::Failed("the sandbox table is poisoned".into())),
        };
        let mut out = Vec::new();
        for l in lives {
            let l = l.lock().await;
            out.push(Self::running(&l));
        }
        Ok(out)
    }

    async fn metrics(&self, c: Metrics) -> Result<Vec<MetricSample>, NodeError> {
        let dir = self.cfg.data_dir.clone();
        let Metrics {
            sandbox_id: id,
            start_unix,
            end_unix,
        } = c;
        tokio::task::spawn_blocking(move || {
            crate::telemetry::read_samples(&dir, &id, start_unix, end_unix)
        })
        .await
        .map_err(|e| NodeError::Failed(format!("metrics task: {e}")))
    }

    async fn latest_metrics(
        &self,
        c: LatestMetrics,
    ) -> Result<Vec<(String, MetricSample)>, NodeError> {
        Ok(self.telemetry.latest_of(&c.sandbox_ids))
    }

    async fn logs(&self, Logs { sandbox_id, query }: Logs) -> Result<Vec<LogEntry>, NodeError> {
        let consoles = self.console_logs(&sandbox_id);
        tokio::task::spawn_blocking(move || {
            crate::telemetry::select(crate::telemetry::read_entries(&consoles), &query)
        })
        .await
        .map_err(|e| NodeError::Failed(format!("logs task: {e}")))
    }

    async fn pool_depths(&self, _: PoolDepths) -> Result<Vec<(String, usize)>, NodeError> {
        let builds = self.pool.builds();
        Ok(builds
            .into_iter()
            .map(|b| {
                let d = self.pool.depth(&b);
                (b, d)
            })
            .collect())
    }

    async fn keepalive(&self, c: Keepalive) -> Result<Option<KeepaliveAsk>, NodeError> {
        let (addr, token) = self.envd_of(&c.sandbox_id, &c.execution_id).await?;
        envd_client::keepalive(addr, token.as_deref())
            .await
            .map_err(|e| NodeError::Failed(format!("envd /keepalive: {e:#}")))
    }

    async fn exec(&self, c: Exec) -> Result<ExecOutput, NodeError> {
        self.exec_step(&c.sandbox_id, &c.execution_id, c.spec).await
    }

    async fn put_file(&self, c: PutFile) -> Result<(), NodeError> {
        self.put_step_file(&c.sandbox_id, &c.execution_id, &c.host_path, &c.guest_path)
            .await
    }

    async fn migrate_describe(&self, c: MigrateDescribe) -> Result<MigrateIn, NodeError> {
        self.describe_outgoing(&c.sandbox_id, &c.execution_id).await
    }

    async fn migrate_in(&self, MigrateAccept { spec }: MigrateAccept) -> Result<String, NodeError> {
        self.prepare_incoming(spec).await
    }

    async fn migrate_out(
        &self,
        MigrateSend { spec }: MigrateSend,
    ) -> Result<MigrateStats, NodeError> {
        self.send_outgoing(spec).await
    }

    async fn migrate_commit(&self, c: MigrateCommit) -> Result<Running, NodeError> {
        self.commit_incoming(&c.migration_id).await
    }

    async fn migrate_cancel(&self, c: MigrateCancel) -> Result<(), NodeError> {
        self.cancel_incoming(&c.migration_id).await
    }

    async fn migrate_finish(&self, c: MigrateFinish) -> Result<(), NodeError> {
        self.finish_outgoing(&c.sandbox_id, &c.execution_id).await
    }

    async fn migrate_abort(&self, c: MigrateAbort) -> Result<(), NodeError> {
        self.abort_outgoing(&c.sandbox_id, &c.execution_id).await
    }
}
