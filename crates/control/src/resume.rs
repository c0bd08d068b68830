//! Pause, resume and connect: a running sandbox becomes a build and back. Pauses say why
//! (a request, the timeout, the idle policy); resumes record how they went (`health.rs`).

use std::time::Duration;

use time::OffsetDateTime;
use vmon_proto::node::{StartKind, StartSpec};

use super::why::{PauseWhy, ResumeTrigger};
use super::{admission_key, event, network_policy, Control};
use super::{ControlError, ControlResult};
use crate::ids;
use crate::records::{Change, EventKind, LastResume, SandboxRecord, SandboxState, Team};

/// How long a pause waits for requests already waiting on the guest to get their response
/// headers before the node stops it.
const PAUSE_DRAIN: Duration = Duration::from_secs(5);

impl Control {
    pub async fn pause(&self, team: &Team, id: &str, memory: bool) -> ControlResult<()> {
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = async {
            let rec = self.owned(team, id).await?;
            if rec.state == SandboxState::Paused {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is already paused"
                )));
            }
            let max = self.config.quotas.max_paused;
            let paused = self
                .records
                .sandboxes(Some(&team.id))
                .await
                .map_err(super::record_error)?
                .iter()
                .filter(|r| r.state == SandboxState::Paused)
                .count();
            if paused >= max {
                return Err(ControlError::too_many(format!(
                    "the team already keeps {paused} paused sandboxes, its most (quotas.max_paused); kill or resume one first"
                )));
            }
            self.pause_locked(rec, memory, guard.fence().token(), PauseWhy::Request)
                .await
        }
        .await;
        let _ = guard.unlock().await;
        result
    }

    pub(crate) async fn pause_locked(
        &self,
        mut rec: SandboxRecord,
        memory: bool,
        fence: i64,
        why: PauseWhy,
    ) -> ControlResult<()> {
        // A mount's state is outside the guest's memory, a GPU's in no snapshot: the disk only.
        let (memory, skipped) = super::gpus::memory_capture(&rec, memory);
        // Requests arriving from here on wait for this pause (the lock) and then resume the
        // sandbox or learn it is paused; those already waiting on the guest get their
        // headers first, within a bound, instead of a 502 from a guest that stopped.
        let pausing = self.activity.begin_pause(&rec.id);
        self.faults.point("pause:drain", &rec.id).await;
        if !pausing.drained(PAUSE_DRAIN).await {
            tracing::info!(sandbox_id = %rec.id, "pausing with requests still waiting on the guest");
        }
        self.faults.point("pause:node", &rec.id).await;
        let build = self.node.pause(&rec.id, &rec.execution_id, memory).await?;
        self.faults.point("pause:commit", &rec.id).await;
        let superseded = rec.owned_build.take();
        rec.state = SandboxState::Paused;
        rec.guest_ip = None;
        rec.build = build.clone();
        rec.owned_build = Some(build.build_id.clone());
        rec.idle_suspended_until = match why {
            PauseWhy::Idle { until } => Some(until),
            _ => None,
        };
        let mut data = serde_json::json!({ "memory": build.has_memory, "reason": why.as_str() });
        if let Some(why) = skipped {
            data["memory_skipped"] = why.into();
        }
        if let Some(until) = rec.idle_suspended_until {
            data["suspended_until"] = super::rfc3339(until).into();
        }
        let paused = event(&rec, EventKind::Paused, data);
        self.commit(Change::update(&rec, &rec.execution_id), paused, fence)
            .await?;
        self.release(&admission_key(&rec.team_id)).await;
        if let Some(old) = superseded {
            self.drop_build(&old).await;
        }
        tracing::info!(sandbox_id = %rec.id, build_id = %build.build_id, memory = build.has_memory, "sandbox paused");
        Ok(())
    }

    /// Connect: a running sandbox keeps running (200, end time extended, never shortened); a
    /// paused one resumes (201). Returns whether it resumed.
    pub async fn connect(
        &self,
        team: &Team,
        id: &str,
        timeout: u64,
        memory: Option<bool>,
    ) -> ControlResult<(SandboxRecord, bool)> {
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = async {
            let mut rec = self.owned(team, id).await?;
            match rec.state {
                SandboxState::Running => {
                    let now = OffsetDateTime::now_utc();
                    let wanted = (now + Duration::from_secs(timeout))
                        .min(Self::lifetime_cap(team, rec.started_at));
                    if wanted > rec.end_at {
                        rec.end_at = wanted;
                        let updated = event(
                            &rec,
                            EventKind::Updated,
                            serde_json::json!({ "set_timeout": super::rfc3339(wanted) }),
                        );
                        self.commit(
                            Change::update(&rec, &rec.execution_id),
                            updated,
                            guard.fence().token(),
                        )
                        .await?;
                    }
                    Ok((rec, false))
                }
                SandboxState::Paused => {
                    let cold = memory == Some(false);
                    let rec = self
                        .resume_locked(
                            team,
                            rec,
                            timeout,
                            cold,
                            guard.fence().token(),
                            ResumeTrigger::Connect,
                        )
                        .await?;
                    Ok((rec, true))
                }
            }
        }
        .await;
        let _ = guard.unlock().await;
        result
    }

    /// Deprecated `POST /sandboxes/{id}/resume`: 409 when running.
    pub async fn resume(
        &self,
        team: &Team,
        id: &str,
        timeout: u64,
        memory: Option<bool>,
        auto_pause: Option<bool>,
    ) -> ControlResult<SandboxRecord> {
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = async {
            let mut rec = self.owned(team, id).await?;
            if rec.state == SandboxState::Running {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is already running"
                )));
            }
            if let Some(p) = auto_pause {
                rec.auto_pause = p;
            }
            let rec = self
                .resume_locked(
                    team,
                    rec,
                    timeout,
                    memory == Some(false),
                    guard.fence().token(),
                    ResumeTrigger::Connect,
                )
                .await?;
            Ok(rec)
        }
        .await;
        let _ = guard.unlock().await;
        result
    }

    /// Starts a new execution from the paused build. Counts against the team's limit.
    pub(crate) async fn resume_locked(
        &self,
        team: &Team,
        mut rec: SandboxRecord,
        timeout: u64,
        cold_boot: bool,
        fence: i64,
        trigger: ResumeTrigger,
    ) -> ControlResult<SandboxRecord> {
        let counter = self.admit(team).await?;
        let execution_id = ids::execution_id();
        let volumes = match self.mount_shares(&team.id, &rec).await {
            Ok(v) => v,
            Err(e) => {
                self.release(&counter).await;
                return Err(e);
            }
        };
        let egress = match self.egress_spec(&team.id, &rec.network, true).await {
            Ok(e) => e,
            Err(e) => {
                self.release(&counter).await;
                return Err(e);
            }
        };
        let cold_boot = cold_boot || !rec.build.has_memory || !volumes.is_empty() || rec.gpus > 0;
        let spec = StartSpec {
            egress,
            volumes,
            sandbox_id: rec.id.clone(),
            execution_id: execution_id.clone(),
            build_id: rec.build.build_id.clone(),
            cold_boot,
            env_vars: rec.env_vars.clone(),
            envd_access_token: Some(rec.envd_access_token.clone()),
            network: network_policy(&rec),
            gpus: rec.gpus,
        };
        let t0 = std::time::Instant::now();
        let running = match self.node.start(spec).await {
            Ok(r) => r,
            Err(e) => {
                self.release(&counter).await;
                tracing::warn!(sandbox_id = %rec.id, error = %e, "resume failed");
                return Err(e.into());
            }
        };
        let took = t0.elapsed();
        // The node says what it did (a cluster may cold-boot what it cannot restore).
        let kind = running.start_kind.unwrap_or(if cold_boot {
            StartKind::ColdBoot
        } else {
            StartKind::Restore
        });
        let cold_boot = kind == StartKind::ColdBoot;
        let now = OffsetDateTime::now_utc();
        let timeout = timeout.min(team.limits.max_lifetime_secs);
        let paused_execution = std::mem::replace(&mut rec.execution_id, execution_id);
        rec.state = SandboxState::Running;
        rec.guest_ip = Some(running.guest_ip);
        rec.envd_version = running.envd_version;
        rec.started_at = now;
        rec.end_at = rec.end_at.max(now + Duration::from_secs(timeout));
        rec.end_at = rec.end_at.min(Self::lifetime_cap(team, now));
        let was_idle = rec.idle_suspended_until.take().is_some();
        if !cold_boot {
            rec.resumes.generation = rec.resumes.generation.saturating_add(1);
        }
        rec.resumes.last = Some(LastResume {
            kind: kind.as_str().to_string(),
            duration_ms: u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
            at: now,
            trigger: trigger.as_str().to_string(),
        });
        let mut data = serde_json::json!({
            "cold_boot": cold_boot,
            "kind": kind.as_str(),
            "trigger": trigger.as_str(),
        });
        if was_idle {
            data["reason"] = "idle".into();
        }
        let resumed = event(&rec, EventKind::Resumed, data);
        if let Err(e) = self
            .commit(Change::update(&rec, &paused_execution), resumed, fence)
            .await
        {
            let _ = self.node.kill(&rec.id, &rec.execution_id).await;
            self.release(&counter).await;
            return Err(e);
        }
        // A resume is traffic: the idle window starts again from it.
        self.activity.touch(&rec.id);
        tracing::info!(sandbox_id = %rec.id, execution_id = %rec.execution_id, cold_boot, "sandbox resumed");
        Ok(rec)
    }
}
