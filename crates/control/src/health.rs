//! A sandbox's health as vmon reports it beyond E2B (`GET /sandboxes/{id}/health`, and the
//! same fields in `GET /sandboxes/{id}`): its resumes, and where its state is.

use time::OffsetDateTime;
use vmon_proto::node::StartKind;

use super::{Control, ControlResult};
use crate::records::{SandboxRecord, SandboxState, Team};

/// The last resume cold-booted: the sandbox's processes and memory were lost.
pub fn kernel_state_lost(rec: &SandboxRecord) -> bool {
    rec.resumes
        .last
        .as_ref()
        .is_some_and(|l| l.kind == StartKind::ColdBoot.as_str())
}

/// A sandbox's record and what only the nodes and this api's traffic table know of it.
#[derive(Debug, Clone)]
pub struct Health {
    pub record: SandboxRecord,
    /// See [`Control::state_location`].
    pub location: &'static str,
    /// Paused and its build is in the object store.
    pub in_object_store: bool,
    /// Running with an idle policy: seconds since its last traffic.
    pub idle_seconds: Option<u64>,
}

impl Control {
    /// Where the sandbox's state is (`running`, `parked`, `disk`, `object_store`, `unknown`)
    /// and whether the object store has it; the nodes are asked without fetching anything.
    pub async fn state_location(&self, rec: &SandboxRecord) -> (&'static str, bool) {
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

    pub async fn health(&self, team: &Team, id: &str) -> ControlResult<Health> {
        let record = self.owned(team, id).await?;
        let (location, in_object_store) = self.state_location(&record).await;
        let idle_seconds =
            (record.state == SandboxState::Running && record.idle.is_some()).then(|| {
                self.idle_for(&record, OffsetDateTime::now_utc(), None)
                    .as_secs()
            });
        Ok(Health {
            record,
            location,
            in_object_store,
            idle_seconds,
        })
    }
}
