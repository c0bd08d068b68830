//! The KV leader's duties: the timeout reaper (every second, expired running sandboxes pause
//! when autoPause, otherwise die; a failed auto-pause kills), the idle scan (`idle.rs`, every
//! `idle.scan_interval_ms`), the event retention job, the layer cache's collector and the
//! collector of unnamed builds (`collect.rs`; hourly),
//! and the webhook dispatcher (`delivery.rs`), fenced by the leader epoch.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use super::{Control, KillReason};

/// How often the leader deletes expired events.
const RETENTION_EVERY: Duration = Duration::from_secs(3600);
use crate::records::{Change, EventKind, SandboxRecord, SandboxState};

impl Control {
    /// Campaigns for leadership and reaps while leader, until `cancel` fires.
    pub async fn run_reaper(self: Arc<Self>, cancel: CancellationToken) {
        let in_flight = Arc::new(Mutex::new(HashSet::new()));
        let idle_in_flight = Arc::new(Mutex::new(HashSet::new()));
        while !cancel.is_cancelled() {
            let leadership = match self
                .kv
                .campaign("reaper", &self.config.client_id, &cancel)
                .await
            {
                Ok(l) => l,
                Err(vmon_kv::KvError::Cancelled) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "reaper election failed; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    }
                }
            };
            tracing::info!(epoch = leadership.epoch(), "this api is the leader");
            let lost = leadership.lost();
            let leading = CancellationToken::new();
            // Stops the dispatcher however this leadership ends.
            let _leading_guard = leading.clone().drop_guard();
            tokio::spawn(self.clone().run_dispatcher(leadership.epoch(), leading));
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut members = tokio::time::interval(super::cluster::RECONCILE_EVERY);
            members.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut idle = tokio::time::interval(Duration::from_millis(
                self.config.idle.scan_interval_ms.max(100),
            ));
            idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut retention = tokio::time::interval(RETENTION_EVERY);
            retention.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => {
                        let _ = leadership.resign().await;
                        return;
                    }
                    _ = lost.cancelled() => {
                        tracing::warn!("reaper leadership lost");
                        break;
                    }
                    _ = tick.tick() => self.reap_once(&in_flight).await,
                    _ = idle.tick() => self.idle_once(&idle_in_flight).await,
                    _ = members.tick(), if self.cluster.is_some() => {
                        if let Some(c) = &self.cluster {
                            self.reconcile_cluster(c.as_ref()).await;
                        }
                    }
                    _ = retention.tick() => {
                        self.expire_events().await;
                        self.collect_layers().await;
                        self.collect_builds_periodically().await;
                    }
                }
            }
        }
    }

    /// One pass: hands every expired running sandbox to its own task (each takes the
    /// sandbox's lock, so a slow pause never holds up the others).
    pub async fn reap_once(self: &Arc<Self>, in_flight: &Arc<Mutex<HashSet<String>>>) {
        let now = OffsetDateTime::now_utc();
        let records = match self.records.expired_sandboxes(now).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "reaper could not list sandboxes");
                return;
            }
        };
        for rec in records {
            if rec.state != SandboxState::Running || rec.end_at > now {
                continue;
            }
            if !in_flight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.id.clone())
            {
                continue;
            }
            let control = self.clone();
            let in_flight = in_flight.clone();
            tokio::spawn(async move {
                control.expire(&rec.id, &rec.execution_id).await;
                in_flight
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&rec.id);
            });
        }
    }

    /// Deletes events (and delivery attempts) older than the 30-day retention.
    pub async fn expire_events(&self) {
        match self.records.run_retention(OffsetDateTime::now_utc()).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "expired lifecycle events deleted"),
            Err(e) => tracing::warn!(error = %e, "the event retention job failed"),
        }
    }

    async fn expire(&self, id: &str, execution_id: &str) {
        let Ok(guard) = self.lock(id).await else {
            return;
        };
        // Re-read under the lock: the sandbox may have been extended, paused or killed, or
        // be a newer execution than the one found expired.
        let current = self.records.sandbox(id).await.ok().flatten();
        if let Some(rec) = current.filter(|r| {
            r.execution_id == execution_id
                && r.state == SandboxState::Running
                && r.end_at <= OffsetDateTime::now_utc()
        }) {
            let span = tracing::info_span!("expire", sandbox_id = id, execution_id);
            let _e = span.enter();
            drop(_e);
            if let Some(end) = self.kept_alive(&rec).await {
                let mut rec = rec;
                rec.end_at = end;
                let updated = super::event(
                    &rec,
                    EventKind::Updated,
                    serde_json::json!({ "set_timeout": super::rfc3339(end), "keepalive": true }),
                );
                let committed = self
                    .commit(
                        Change::update(&rec, &rec.execution_id),
                        updated,
                        guard.fence().token(),
                    )
                    .await;
                match committed {
                    Ok(()) => {
                        tracing::info!(sandbox_id = id, end = %end, "timeout: the guest kept its sandbox alive")
                    }
                    Err(e) => {
                        tracing::warn!(sandbox_id = id, error = %e, "recording a self-keepalive failed")
                    }
                }
                let _ = guard.unlock().await;
                return;
            }
            let t0 = std::time::Instant::now();
            let report = |op, ok| crate::platform::platform().transition(op, ok, t0.elapsed());
            if rec.auto_pause {
                let fence = guard.fence().token();
                let paused = self
                    .pause_locked(
                        rec.clone(),
                        rec.auto_pause_memory,
                        fence,
                        super::why::PauseWhy::Timeout,
                    )
                    .await;
                report("timeout_pause", paused.is_ok());
                match paused {
                    Ok(()) => tracing::info!(sandbox_id = id, "timeout: sandbox auto-paused"),
                    Err(e) => {
                        tracing::warn!(sandbox_id = id, error = %e, "auto-pause failed: killing the sandbox");
                        let killed = self.kill_locked(rec, KillReason::Timeout, fence).await;
                        report("timeout_kill", killed.is_ok());
                        if let Err(e) = killed {
                            tracing::warn!(sandbox_id = id, error = %e, "killing after a failed auto-pause failed");
                        }
                    }
                }
            } else {
                let killed = self
                    .kill_locked(rec, KillReason::Timeout, guard.fence().token())
                    .await;
                report("timeout_kill", killed.is_ok());
                if let Err(e) = killed {
                    tracing::warn!(sandbox_id = id, error = %e, "timeout kill failed");
                }
            }
        }
        let _ = guard.unlock().await;
    }

    /// The end a sandbox's guest asked for with self-keepalive (envd `POST /keepalive`, read
    /// through its node now that its timeout ended): the ask's time plus its timeout, within
    /// the team's maximum lifetime; None when there is no ask, it is spent, or the node cannot
    /// say (an older node, a guest that does not answer: the timeout then acts as always).
    async fn kept_alive(&self, rec: &SandboxRecord) -> Option<OffsetDateTime> {
        let ask = match self.node.keepalive(&rec.id, &rec.execution_id).await {
            Ok(ask) => ask?,
            Err(e) => {
                tracing::debug!(sandbox_id = %rec.id, error = %e, "no self-keepalive answer");
                return None;
            }
        };
        // The guest's numbers: checked, never trusted to fit.
        let now = OffsetDateTime::now_utc();
        let asked = now.checked_sub(time::Duration::milliseconds(
            i64::try_from(ask.age_ms).ok()?,
        ))?;
        let asked_end = asked.checked_add(time::Duration::seconds(
            i64::try_from(ask.timeout_secs).ok()?,
        ))?;
        let team = self.records.team(&rec.team_id).await.ok().flatten()?;
        let end = asked_end.min(Self::lifetime_cap(&team, rec.started_at));
        (end > now + Duration::from_secs(1)).then_some(end)
    }
}
