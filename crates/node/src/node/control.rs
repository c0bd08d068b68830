//! The node's [`NodeControl`] impl: what the API (in process or over gRPC) may ask of it. Each
//! call is a thin step into the room that does the work.

use std::sync::Arc;

use tokio::sync::Mutex;
use vmon_proto::node::{
    BuildInfo, ExecOutput, ExecSpec, KeptBuild, LogEntry, LogQuery, MetricSample, MigrateIn,
    MigrateOut, MigrateStats, NetworkPolicy, NodeControl, NodeError, OciImage, PauseBuild,
    PausedState, Running, StartSpec, TemplateSpec,
};

use super::{err, Node};
use crate::sandbox::Live;

#[async_trait::async_trait]
impl NodeControl for Node {
    async fn build_template(&self, spec: TemplateSpec) -> Result<BuildInfo, NodeError> {
        self.make_template(spec).await
    }

    async fn resolve_image(&self, image: OciImage) -> Result<String, NodeError> {
        self.image_digest(&image).await
    }

    async fn build_info(&self, build_id: &str) -> Result<BuildInfo, NodeError> {
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

    async fn delete_build(&self, build_id: &str) -> Result<(), NodeError> {
        self.remove_build(build_id).await
    }

    async fn paused_state(&self, build_id: &str) -> Result<PausedState, NodeError> {
        Ok(PausedState {
            parked: self.is_parked(build_id),
            local: self.record(build_id).is_ok(),
            stored: self.is_stored(build_id),
        })
    }

    async fn pause_builds(&self) -> Result<Vec<PauseBuild>, NodeError> {
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

    async fn builds(&self) -> Result<Vec<KeptBuild>, NodeError> {
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

    async fn start(&self, spec: StartSpec) -> Result<Running, NodeError> {
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| NodeError::Failed("node is shutting down".into()))?;
        me.ensure_local(&spec.build_id).await?;
        me.start_sandbox(spec).await
    }

    async fn kill(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
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

    async fn pause(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        self.pause_sandbox(sandbox_id, execution_id, memory).await
    }

    async fn checkpoint(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        memory: bool,
    ) -> Result<BuildInfo, NodeError> {
        self.checkpoint_sandbox(sandbox_id, execution_id, memory)
            .await
    }

    async fn update_network(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        policy: NetworkPolicy,
    ) -> Result<(), NodeError> {
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

    async fn update_egress(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        egress: vmon_proto::egress::EgressSpec,
    ) -> Result<(), NodeError> {
        self.update_egress_of(sandbox_id, execution_id, egress)
            .await
    }

    async fn list_running(&self) -> Vec<Running> {
        let lives: Vec<Arc<Mutex<Live>>> = match self.sandboxes.lock() {
            Ok(m) => m.values().cloned().collect(),
            Err(_) => return Vec::new(),
        };
        let mut out = Vec::new();
        for l in lives {
            let l = l.lock().await;
            out.push(Self::running(&l));
        }
        out
    }

    async fn metrics(
        &self,
        sandbox_id: &str,
        start_unix: i64,
        end_unix: i64,
    ) -> Result<Vec<MetricSample>, NodeError> {
        let dir = self.cfg.data_dir.clone();
        let id = sandbox_id.to_string();
        tokio::task::spawn_blocking(move || {
            crate::telemetry::read_samples(&dir, &id, start_unix, end_unix)
        })
        .await
        .map_err(|e| NodeError::Failed(format!("metrics task: {e}")))
    }

    async fn latest_metrics(&self, sandbox_ids: &[String]) -> Vec<(String, MetricSample)> {
        self.telemetry.latest_of(sandbox_ids)
    }

    async fn logs(&self, sandbox_id: &str, query: LogQuery) -> Result<Vec<LogEntry>, NodeError> {
        let consoles = self.console_logs(sandbox_id);
        tokio::task::spawn_blocking(move || {
            crate::telemetry::select(crate::telemetry::read_entries(&consoles), &query)
        })
        .await
        .map_err(|e| NodeError::Failed(format!("logs task: {e}")))
    }

    async fn pool_depths(&self) -> Vec<(String, usize)> {
        let builds = self.pool.builds();
        builds
            .into_iter()
            .map(|b| {
                let d = self.pool.depth(&b);
                (b, d)
            })
            .collect()
    }

    async fn exec(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        spec: ExecSpec,
    ) -> Result<ExecOutput, NodeError> {
        self.exec_step(sandbox_id, execution_id, spec).await
    }

    async fn put_file(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        host_path: &str,
        guest_path: &str,
    ) -> Result<(), NodeError> {
        self.put_step_file(sandbox_id, execution_id, host_path, guest_path)
            .await
    }

    async fn migrate_describe(
        &self,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<MigrateIn, NodeError> {
        self.describe_outgoing(sandbox_id, execution_id).await
    }

    async fn migrate_in(&self, spec: MigrateIn) -> Result<String, NodeError> {
        self.prepare_incoming(spec).await
    }

    async fn migrate_out(&self, spec: MigrateOut) -> Result<MigrateStats, NodeError> {
        self.send_outgoing(spec).await
    }

    async fn migrate_commit(&self, migration_id: &str) -> Result<Running, NodeError> {
        self.commit_incoming(migration_id).await
    }

    async fn migrate_cancel(&self, migration_id: &str) -> Result<(), NodeError> {
        self.cancel_incoming(migration_id).await
    }

    async fn migrate_finish(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
        self.finish_outgoing(sandbox_id, execution_id).await
    }

    async fn migrate_abort(&self, sandbox_id: &str, execution_id: &str) -> Result<(), NodeError> {
        self.abort_outgoing(sandbox_id, execution_id).await
    }
}
