//! A sandbox's health as vmon reports it beyond E2B (`GET /sandboxes/{id}/health`, and the
//! same fields in `GET /sandboxes/{id}`): its resumes, and where its state is.

use time::OffsetDateTime;
use vmon_proto::node::StartKind;

use super::{rfc3339, Control};
use super::ControlResult;
use crate::records::{SandboxRecord, SandboxState, Team};
use crate::wire;

/// The last resume cold-booted: the sandbox's processes and memory were lost.
pub(crate) fn kernel_state_lost(rec: &SandboxRecord) -> bool {
    rec.resumes
        .last
        .as_ref()
        .is_some_and(|l| l.kind == StartKind::ColdBoot.as_str())
}

pub(crate) fn last_resume_view(rec: &SandboxRecord) -> Option<wire::LastResumeView> {
    rec.resumes.last.as_ref().map(|l| wire::LastResumeView {
        kind: l.kind.clone(),
        duration_ms: l.duration_ms,
        at: rfc3339(l.at),
        trigger: l.trigger.clone(),
    })
}

pub(crate) fn idle_view(rec: &SandboxRecord) -> Option<wire::IdleView> {
    rec.idle.map(|p| wire::IdleView {
        max_idle_seconds: p.max_idle_secs,
        auto_resume: p.auto_resume,
        suspended_duration_seconds: p.suspended_secs,
    })
}

impl Control {
    /// Where the sandbox's state is (`running`, `parked`, `disk`, `object_store`, `unknown`)
    /// and whether the object store has it; the nodes are asked without fetching anything.
    pub(crate) async fn state_location(&self, rec: &SandboxRecord) -> (&'static str, bool) {
        if rec.state == SandboxState::Running {
            return ("running", false);
        }
        match self.node.paused_state(&rec.build.build_id).await {
            Ok(s) if s.parked => ("parked", s.stored),
            Ok(s) if s.local => ("disk", s.stored),
            Ok(s) if s.stored => ("object_store", true),
            Ok(_) => ("unknown", false),
            Err(e) => {
                tracing::debug!(sandbox_id = %rec.id, error = %e, "where is the paused state?");
                ("unknown", false)
            }
        }
    }

    pub async fn health(&self, team: &Team, id: &str) -> ControlResult<wire::SandboxHealth> {
        let rec = self.owned(team, id).await?;
        let (location, stored) = self.state_location(&rec).await;
        let idle_seconds = (rec.state == SandboxState::Running && rec.idle.is_some()).then(|| {
            self.idle_for(&rec, OffsetDateTime::now_utc(), None)
                .as_secs()
        });
        Ok(wire::SandboxHealth {
            sandbox_id: rec.id.clone(),
            state: rec.state.as_str().to_string(),
            resume_generation: rec.resumes.generation,
            kernel_state_lost: kernel_state_lost(&rec),
            last_resume: last_resume_view(&rec),
            state_location: location.to_string(),
            in_object_store: stored,
            idle: idle_view(&rec),
            idle_suspended: rec.idle_suspended_until.is_some(),
            suspended_until: rec.idle_suspended_until.map(rfc3339),
            idle_seconds,
        })
    }
}
