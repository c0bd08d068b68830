//! After a restart of `vmon up`: the records and the node are brought back into agreement
//! before the api serves anything, so no transition is ever left half done.
//!
//! The commit point of a pause is the node's build record (it names the run it came from). A
//! record still `running` whose VM is gone is finished from the node's side: when the node
//! keeps a pause build of that very run, the pause happened and the record becomes `paused`
//! on it; otherwise the sandbox died with the node and is reported killed (`orphaned`). VMs
//! no record names are killed, builds no record names are deleted (`collect.rs`), and the
//! team counters are recounted. Nothing is in flight meanwhile: this runs before the first
//! request.

use std::collections::HashMap;

use vmon_proto::node::PauseBuild;

use super::lifecycle::KillReason;
use super::{admission_key, event, Control};
use crate::records::{Change, EventKind, SandboxRecord, SandboxState};

impl Control {
    /// Brings records and node into agreement (see the module's docs).
    pub(super) async fn reconcile(&self) -> anyhow::Result<()> {
        // In a cluster other replicas are creating meanwhile and nodes come and go: the
        // leader reconciles node by node, all the time (`cluster.rs`).
        if self.cluster.is_some() {
            return Ok(());
        }
        let running = self.node.list_running().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the node did not list its sandboxes: every running record reads as gone");
            Vec::new()
        });
        let pause_builds = match self.node.pause_builds().await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "the node did not list its pause builds: none is recovered or collected");
                Vec::new()
            }
        };
        let mut records = self.records.sandboxes(None).await?;
        let mut per_team: HashMap<String, u64> = HashMap::new();
        for team in self.records.teams().await? {
            per_team.insert(team.id, 0);
        }
        for rec in records.iter_mut() {
            if rec.state != SandboxState::Running {
                self.set_route(rec);
                continue;
            }
            let alive = running
                .iter()
                .find(|r| r.sandbox_id == rec.id && r.execution_id == rec.execution_id);
            if let Some(r) = alive {
                rec.guest_ip = Some(r.guest_ip);
                self.set_route(rec);
                *per_team.entry(rec.team_id.clone()).or_default() += 1;
                continue;
            }
            // A resume starts a new run: a run has at most one pause.
            let paused = pause_builds
                .iter()
                .find(|p| p.sandbox_id == rec.id && p.execution_id == rec.execution_id);
            match paused {
                Some(p) => *rec = self.finish_pause(rec.clone(), p).await?,
                None => self.report_orphan(rec).await?,
            }
        }
        for r in &running {
            let known = records
                .iter()
                .any(|rec| rec.id == r.sandbox_id && rec.execution_id == r.execution_id);
            if !known {
                tracing::warn!(sandbox_id = %r.sandbox_id, "VM without a record: killing it");
                if let Err(e) = self.node.kill(&r.sandbox_id, &r.execution_id).await {
                    tracing::warn!(sandbox_id = %r.sandbox_id, error = %e, "killing an unknown VM failed");
                }
            }
        }
        // Every build no record names now goes (`collect.rs`): pauses superseded or cut by a
        // kill, checkpoints of forks and snapshots that crashed before their record,
        // templates deleted just before a crash.
        match self.collect_builds(std::time::Duration::ZERO).await {
            Ok(deleted) if !deleted.is_empty() => {
                tracing::info!(count = deleted.len(), "deleted builds no record names")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "collecting unnamed builds failed: they stay until the next pass")
            }
        }
        for (team, n) in per_team {
            self.kv.set_counter(&admission_key(&team), n).await?;
        }
        Ok(())
    }

    /// The node paused this run but the record was never written: writes it now (`paused`
    /// on the pause's build, event `paused` with reason `recovered`). Returns the new record.
    async fn finish_pause(
        &self,
        mut rec: SandboxRecord,
        paused: &PauseBuild,
    ) -> anyhow::Result<SandboxRecord> {
        tracing::warn!(sandbox_id = %rec.id, build_id = %paused.build.build_id, "a pause the node finished had no record: recording it paused");
        let guard = self.lock(&rec.id).await?;
        let superseded = rec.owned_build.take();
        rec.state = SandboxState::Paused;
        rec.guest_ip = None;
        rec.build = paused.build.clone();
        rec.owned_build = Some(paused.build.build_id.clone());
        rec.idle_suspended_until = None;
        let ev = event(
            &rec,
            EventKind::Paused,
            serde_json::json!({ "memory": paused.build.has_memory, "reason": "recovered" }),
        );
        let result = self
            .commit(
                Change::update(&rec, &rec.execution_id),
                ev,
                guard.fence().token(),
            )
            .await;
        let _ = guard.unlock().await;
        result.map_err(|e| anyhow::anyhow!("recording a finished pause: {e}"))?;
        if let Some(old) = superseded.filter(|b| *b != paused.build.build_id) {
            self.drop_build(&old).await;
        }
        Ok(rec)
    }

    /// A running record whose VM is gone and never paused: the sandbox died with the node.
    async fn report_orphan(&self, rec: &SandboxRecord) -> anyhow::Result<()> {
        tracing::warn!(sandbox_id = %rec.id, "sandbox record without a VM: reporting it killed (orphaned)");
        let guard = self.lock(&rec.id).await?;
        let ev = event(rec, EventKind::Killed, KillReason::Orphaned.data());
        let result = self
            .commit(
                Change::Delete {
                    sandbox_id: rec.id.clone(),
                    execution_id: rec.execution_id.clone(),
                },
                ev,
                guard.fence().token(),
            )
            .await;
        let _ = guard.unlock().await;
        result.map_err(|e| anyhow::anyhow!("reporting an orphan: {e}"))?;
        if let Some(b) = &rec.owned_build {
            self.drop_build(b).await;
        }
        Ok(())
    }
}
