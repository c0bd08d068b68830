//! Idle auto-suspend (seed 004's IdlePolicy): which policy a create gets, and the leader's
//! scan that suspends sandboxes without traffic and ends suspended ones past their time.
//!
//! Traffic is what the proxy counts ([`vmon_proxy::Activity`]): in `vmon up` the table is the
//! in-process proxy's own; a standalone `vmon proxy` reports it to `POST /admin/activity`,
//! which notes it here and, in a cluster, in the KV (`activity/<id>`, Unix milliseconds) for
//! whichever replica leads. A sandbox's idle time is the least of: since its execution
//! started (create or resume), since the local table's last stamp, since the KV's.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use time::OffsetDateTime;

use super::model::{IdleSettings, StringMap};
use super::why::PauseWhy;
use super::{Control, KillReason, MAX_TIMEOUT_SECS};
use super::{ControlError, ControlResult};
use crate::config::IdleConfig;
use crate::records::{IdlePolicy, SandboxRecord, SandboxState, Team};

pub use crate::config::MIN_IDLE_SECS;
/// The window of a policy that names none.
pub const DEFAULT_IDLE_SECS: u64 = 300;
/// Metadata keys of the policy start with this (as `vmon.gpus` does for GPUs).
pub const METADATA_PREFIX: &str = "vmon.idle.";
/// Where a cluster keeps reported activity.
const KV_PREFIX: &str = "activity/";

/// What a create says that bears on its idle policy.
pub(crate) struct Asked<'a> {
    /// `vmonIdle`: absent, `null` (off) or an object.
    pub field: Option<&'a Option<IdleSettings>>,
    pub metadata: &'a StringMap,
    pub timeout: u64,
    pub auto_pause: bool,
    pub has_volumes: bool,
}

/// The policy a create gets: its `vmonIdle` field, else its `vmon.idle.*` metadata, else the
/// team's configured default. One the create names is checked (400 when it is invalid or does
/// not fit before the timeout); the default is adapted instead (seed 004).
pub(crate) fn resolve(
    config: &IdleConfig,
    team: &Team,
    asked: &Asked<'_>,
) -> ControlResult<Option<IdlePolicy>> {
    let named = match asked.field {
        Some(None) => return Ok(None),
        Some(Some(s)) => Some(Some(s.clone())),
        None => from_metadata(asked.metadata)?,
    };
    match named {
        Some(None) => Ok(None),
        Some(Some(s)) => explicit(&s, asked).map(Some),
        None => Ok(team_default(config, team, asked)),
    }
}

fn explicit(s: &IdleSettings, asked: &Asked<'_>) -> ControlResult<IdlePolicy> {
    let max_idle = match s.max_idle_seconds {
        None => DEFAULT_IDLE_SECS,
        Some(v) => u64::try_from(v)
            .ok()
            .filter(|v| *v >= MIN_IDLE_SECS)
            .ok_or_else(|| {
                ControlError::bad_request(format!(
                    "max_idle_seconds must be at least {MIN_IDLE_SECS}, not {v}"
                ))
            })?,
    };
    if max_idle >= asked.timeout {
        return Err(ControlError::bad_request(format!(
            "max_idle_seconds ({max_idle}) must be less than the sandbox's timeout ({} s): lower it, raise the timeout, or turn idle auto-suspend off",
            asked.timeout
        )));
    }
    if asked.has_volumes {
        return Err(ControlError::bad_request(
            "idle auto-suspend keeps memory, and a sandbox with volume mounts pauses without it: turn one of them off",
        ));
    }
    let suspended = match s.suspended_duration_seconds {
        None => asked.timeout - max_idle,
        Some(v) => u64::try_from(v)
            .ok()
            .filter(|v| *v <= MAX_TIMEOUT_SECS)
            .ok_or_else(|| {
                ControlError::bad_request(format!(
                    "suspended_duration_seconds must be 0-{MAX_TIMEOUT_SECS}, not {v}"
                ))
            })?,
    };
    Ok(IdlePolicy {
        max_idle_secs: max_idle,
        auto_resume: s.auto_resume.unwrap_or(true),
        suspended_secs: suspended,
    })
}

/// `Some(None)`: the metadata turns it off; `None`: the metadata says nothing of it.
fn from_metadata(metadata: &StringMap) -> ControlResult<Option<Option<IdleSettings>>> {
    let mut s = IdleSettings::default();
    let mut any = false;
    let int = |k: &str, v: &str| {
        v.trim().parse::<i64>().map_err(|_| {
            ControlError::bad_request(format!("metadata {k} must be a whole number, not {v:?}"))
        })
    };
    for (k, v) in metadata {
        let Some(name) = k.strip_prefix(METADATA_PREFIX) else {
            continue;
        };
        any = true;
        match name {
            "max_idle_seconds" if matches!(v.trim(), "off" | "none") => return Ok(Some(None)),
            "max_idle_seconds" => s.max_idle_seconds = Some(int(k, v)?),
            "suspended_duration_seconds" => s.suspended_duration_seconds = Some(int(k, v)?),
            "auto_resume" => {
                s.auto_resume = Some(match v.trim() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => {
                        return Err(ControlError::bad_request(format!(
                            "metadata {k} must be true or false, not {v:?}"
                        )))
                    }
                })
            }
            _ => {
                return Err(ControlError::bad_request(format!(
                    "unknown metadata key {k}: the idle policy's are {METADATA_PREFIX}max_idle_seconds, {METADATA_PREFIX}auto_resume and {METADATA_PREFIX}suspended_duration_seconds"
                )))
            }
        }
    }
    Ok(any.then_some(Some(s)))
}

fn team_default(config: &IdleConfig, team: &Team, asked: &Asked<'_>) -> Option<IdlePolicy> {
    let d = config.teams.get(&team.slug).or(config.default.as_ref())?;
    if d.max_idle_seconds == 0 || asked.has_volumes {
        return None;
    }
    let max_idle = if d.max_idle_seconds < asked.timeout {
        d.max_idle_seconds
    } else if asked.auto_pause && MIN_IDLE_SECS < asked.timeout {
        MIN_IDLE_SECS
    } else {
        return None;
    };
    Some(IdlePolicy {
        max_idle_secs: max_idle,
        auto_resume: d.auto_resume,
        suspended_secs: d
            .suspended_duration_seconds
            .unwrap_or(asked.timeout - max_idle),
    })
}

/// Whether traffic may resume `rec` while it is paused.
pub(crate) fn resumes_on_traffic(rec: &SandboxRecord) -> bool {
    rec.auto_resume
        || (rec.idle_suspended_until.is_some() && rec.idle.is_some_and(|p| p.auto_resume))
}

fn since(now: OffsetDateTime, then: OffsetDateTime) -> Duration {
    Duration::try_from(now - then).unwrap_or(Duration::ZERO)
}

impl Control {
    /// What the proxy saw of this process's sandboxes (shared with an in-process proxy).
    pub fn activity(&self) -> &Arc<vmon_proxy::Activity> {
        &self.activity
    }

    /// A standalone proxy's report (`POST /admin/activity`).
    pub async fn note_activity(&self, report: &[vmon_proxy::activity::Idle]) {
        let now_ms = OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000;
        for r in report {
            let idle = Duration::from_millis(r.idle_ms);
            self.activity.note_idle(&r.sandbox_id, idle);
            if self.cluster.is_some() {
                let at = now_ms - i128::from(r.idle_ms);
                let key = format!("{KV_PREFIX}{}", r.sandbox_id);
                if let Err(e) = self.kv.put(&key, at.to_string()).await {
                    tracing::warn!(sandbox_id = %r.sandbox_id, error = %e, "keeping reported activity failed");
                }
            }
        }
    }

    /// Reported activity in the KV (a cluster's), by sandbox.
    async fn reported(&self) -> HashMap<String, OffsetDateTime> {
        if self.cluster.is_none() {
            return HashMap::new();
        }
        match self.kv.list(KV_PREFIX).await {
            Ok(entries) => entries
                .into_iter()
                .filter_map(|e| {
                    let id = e.key.strip_prefix(KV_PREFIX)?.to_string();
                    let ms: i128 = std::str::from_utf8(&e.value).ok()?.parse().ok()?;
                    let at = OffsetDateTime::from_unix_timestamp_nanos(ms * 1_000_000).ok()?;
                    Some((id, at))
                })
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "reading reported activity failed");
                HashMap::new()
            }
        }
    }

    /// How long `rec` has gone without traffic, as far as this api knows.
    pub(crate) fn idle_for(
        &self,
        rec: &SandboxRecord,
        now: OffsetDateTime,
        reported: Option<OffsetDateTime>,
    ) -> Duration {
        let mut idle = since(now, rec.started_at);
        if let Some(local) = self.activity.idle(&rec.id) {
            idle = idle.min(local);
        }
        if let Some(at) = reported {
            idle = idle.min(since(now, at));
        }
        idle
    }

    /// One pass of the leader: suspends running sandboxes idle past their window, ends
    /// idle-suspended ones whose time is up. Each in its own task under the sandbox's lock.
    pub async fn idle_once(self: &Arc<Self>, in_flight: &Arc<Mutex<HashSet<String>>>) {
        let records = match self.records.sandboxes(None).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "the idle scan could not list sandboxes");
                return;
            }
        };
        let reported = self.reported().await;
        let now = OffsetDateTime::now_utc();
        for rec in records {
            let due = match (rec.state, rec.idle, rec.idle_suspended_until) {
                (SandboxState::Running, Some(p), _) => {
                    self.idle_for(&rec, now, reported.get(&rec.id).copied())
                        >= Duration::from_secs(p.max_idle_secs)
                }
                (SandboxState::Paused, _, Some(until)) => until <= now,
                _ => false,
            };
            if !due
                || !in_flight
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(rec.id.clone())
            {
                continue;
            }
            let control = self.clone();
            let in_flight = in_flight.clone();
            tokio::spawn(async move {
                match rec.state {
                    SandboxState::Running => control.idle_suspend(&rec.id, &rec.execution_id).await,
                    SandboxState::Paused => control.end_suspended(&rec.id).await,
                }
                in_flight
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&rec.id);
            });
        }
    }

    async fn idle_suspend(&self, id: &str, execution_id: &str) {
        let Ok(guard) = self.lock(id).await else {
            return;
        };
        let result = async {
            // Under the lock: it may have been paused, killed, resumed or used meanwhile.
            let Some(rec) = self.records.sandbox(id).await.ok().flatten() else {
                return Ok(());
            };
            let Some(policy) = rec.idle else {
                return Ok(());
            };
            if rec.execution_id != execution_id || rec.state != SandboxState::Running {
                return Ok(());
            }
            let reported = match self.cluster {
                Some(_) => self.reported().await.get(id).copied(),
                None => None,
            };
            let now = OffsetDateTime::now_utc();
            let window = Duration::from_secs(policy.max_idle_secs);
            if self.idle_for(&rec, now, reported) < window {
                return Ok(());
            }
            // Requests arriving from here on wait for this sandbox's lock; one in flight
            // stops the suspend.
            let Some(_suspending) = self.activity.begin_suspend(id, window) else {
                return Ok(());
            };
            let idle_secs = self.idle_for(&rec, now, reported).as_secs();
            let fence = guard.fence().token();
            if policy.suspended_secs == 0 {
                tracing::info!(
                    sandbox_id = id,
                    idle_secs,
                    "idle: ending the sandbox (suspended_duration_seconds 0)"
                );
                return self.kill_locked(rec, KillReason::Idle, fence).await;
            }
            let until = now + Duration::from_secs(policy.suspended_secs);
            tracing::info!(sandbox_id = id, idle_secs, "idle: suspending the sandbox");
            self.pause_locked(rec, true, fence, PauseWhy::Idle { until })
                .await
        }
        .await;
        if let Err(e) = result {
            // It keeps running; the next try is a whole window later.
            tracing::warn!(sandbox_id = id, error = %e, "idle suspend failed");
            self.activity.touch(id);
        }
        let _ = guard.unlock().await;
    }

    async fn end_suspended(&self, id: &str) {
        let Ok(guard) = self.lock(id).await else {
            return;
        };
        let rec = self.records.sandbox(id).await.ok().flatten().filter(|r| {
            r.state == SandboxState::Paused
                && r.idle_suspended_until
                    .is_some_and(|t| t <= OffsetDateTime::now_utc())
        });
        if let Some(rec) = rec {
            tracing::info!(sandbox_id = id, "idle: the suspended sandbox's time is up");
            if let Err(e) = self
                .kill_locked(rec, KillReason::Timeout, guard.fence().token())
                .await
            {
                tracing::warn!(sandbox_id = id, error = %e, "ending a suspended sandbox failed");
            }
        }
        let _ = guard.unlock().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::IdleDefault;

    fn team() -> Team {
        Team {
            id: "t".into(),
            name: "t".into(),
            slug: "t".into(),
            limits: Default::default(),
        }
    }

    fn asked<'a>(
        field: Option<&'a Option<IdleSettings>>,
        metadata: &'a StringMap,
        timeout: u64,
    ) -> Asked<'a> {
        Asked {
            field,
            metadata,
            timeout,
            auto_pause: false,
            has_volumes: false,
        }
    }

    fn meta(pairs: &[(&str, &str)]) -> StringMap {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn metadata_names_a_policy_with_seed_defaults() {
        let m = meta(&[("vmon.idle.max_idle_seconds", "60"), ("job", "1")]);
        let p = resolve(&IdleConfig::default(), &team(), &asked(None, &m, 600))
            .expect("valid")
            .expect("on");
        assert_eq!(
            p,
            IdlePolicy {
                max_idle_secs: 60,
                auto_resume: true,
                suspended_secs: 540
            }
        );
        let m = meta(&[("vmon.idle.suspended_duration_seconds", "0")]);
        let p = resolve(&IdleConfig::default(), &team(), &asked(None, &m, 600))
            .expect("valid")
            .expect("on");
        assert_eq!((p.max_idle_secs, p.suspended_secs), (300, 0));
    }

    #[test]
    fn invalid_or_unfitting_policies_are_400() {
        for pairs in [
            &[("vmon.idle.max_idle_seconds", "30")][..],
            &[("vmon.idle.max_idle_seconds", "abc")],
            &[("vmon.idle.max_idle_seconds", "600")],
            &[("vmon.idle.auto_resume", "maybe")],
            &[("vmon.idle.suspended_duration_seconds", "-1")],
            &[("vmon.idle.max_idle", "60")],
        ] {
            let m = meta(pairs);
            let e = resolve(&IdleConfig::default(), &team(), &asked(None, &m, 600))
                .expect_err("invalid");
            assert!(matches!(e, ControlError::Invalid(_)), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn the_field_wins_and_null_turns_it_off() {
        let m = meta(&[("vmon.idle.max_idle_seconds", "60")]);
        let off = None;
        assert_eq!(
            resolve(&IdleConfig::default(), &team(), &asked(Some(&off), &m, 600)).expect("ok"),
            None
        );
        let on = Some(IdleSettings {
            max_idle_seconds: Some(120),
            auto_resume: Some(false),
            suspended_duration_seconds: Some(10),
        });
        let p = resolve(&IdleConfig::default(), &team(), &asked(Some(&on), &m, 600))
            .expect("ok")
            .expect("on");
        assert_eq!(
            p,
            IdlePolicy {
                max_idle_secs: 120,
                auto_resume: false,
                suspended_secs: 10
            }
        );
        let m = meta(&[("vmon.idle.max_idle_seconds", "off")]);
        assert_eq!(
            resolve(&IdleConfig::default(), &team(), &asked(None, &m, 600)).expect("ok"),
            None
        );
    }

    #[test]
    fn the_team_default_is_adapted_not_refused() {
        let config = IdleConfig {
            default: Some(IdleDefault::default()),
            ..IdleConfig::default()
        };
        let none = StringMap::new();
        let p = resolve(&config, &team(), &asked(None, &none, 600))
            .expect("ok")
            .expect("on");
        assert_eq!((p.max_idle_secs, p.suspended_secs), (300, 300));
        // 300 s does not fit a 120 s sandbox: off, as seed 004 says...
        assert_eq!(
            resolve(&config, &team(), &asked(None, &none, 120)).expect("ok"),
            None
        );
        // ...unless it pauses on timeout: then the minimum.
        let a = Asked {
            auto_pause: true,
            ..asked(None, &none, 120)
        };
        let p = resolve(&config, &team(), &a).expect("ok").expect("on");
        assert_eq!(p.max_idle_secs, 60);
        // No default configured: off.
        assert_eq!(
            resolve(&IdleConfig::default(), &team(), &asked(None, &none, 600)).expect("ok"),
            None
        );
    }
}
