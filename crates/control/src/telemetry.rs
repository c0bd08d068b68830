//! Who may read a sandbox's guest metrics and console logs, and which: a running or paused
//! sandbox is the team's when its record is; a killed one when the team's `killed` event for it
//! is less than [`RETENTION`] old (events outlive the record by 30 days). The node keeps the
//! samples and logs; the api shapes them for the wire (`crates/api/src/telemetry/`).

pub mod thin;

use std::collections::BTreeMap;
use std::time::Duration;

use time::OffsetDateTime;
use vmon_proto::node::{LogEntry, LogQuery, MetricSample, NodeError};

use crate::records::{EventKind, EventQuery, SandboxState, Team};
use crate::{record_error, Control, ControlError, ControlResult};

/// How long after its end a killed sandbox's metrics and logs stay readable.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// The batch metrics call answers at most this many sandboxes.
pub const MAX_BATCH: usize = 100;
/// A batch answer's samples are at most this old.
const LATEST_MAX_AGE_SECS: i64 = 60;

fn now_unix() -> i64 {
    OffsetDateTime::now_utc().unix_timestamp()
}

/// A sandbox as telemetry sees it: what it is and the span it lived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub state: Option<SandboxState>,
    /// Unix seconds.
    pub started: Option<i64>,
    /// Unix seconds; `None` while it is not killed.
    pub ended: Option<i64>,
}

impl Control {
    /// The team's sandbox — running, paused, or killed less than [`RETENTION`] ago — or 404.
    pub async fn telemetry_subject(&self, team: &Team, id: &str) -> ControlResult<Subject> {
        if !crate::ids::plausible_sandbox_id(id) {
            return Err(ControlError::sandbox_not_found(id));
        }
        let created = self
            .team_event(team, id, EventKind::Created, true)
            .await?
            .map(|t| t.unix_timestamp());
        let rec = self.records.sandbox(id).await.map_err(record_error)?;
        if let Some(rec) = rec.filter(|r| r.team_id == team.id) {
            let started = rec.started_at.unix_timestamp();
            return Ok(Subject {
                state: Some(rec.state),
                started: Some(created.map_or(started, |c| c.min(started))),
                ended: None,
            });
        }
        let killed = self.team_event(team, id, EventKind::Killed, false).await?;
        match killed {
            Some(at) if OffsetDateTime::now_utc() - at <= RETENTION => Ok(Subject {
                state: None,
                started: created,
                ended: Some(at.unix_timestamp()),
            }),
            _ => Err(ControlError::sandbox_not_found(id)),
        }
    }

    /// The time of the team's first (`oldest`) or last event of `kind` for a sandbox.
    async fn team_event(
        &self,
        team: &Team,
        id: &str,
        kind: EventKind,
        oldest: bool,
    ) -> ControlResult<Option<OffsetDateTime>> {
        let query = EventQuery {
            team_id: team.id.clone(),
            sandbox_id: Some(id.to_string()),
            types: vec![kind.as_str().to_string()],
            offset: 0,
            limit: 1,
            order_asc: oldest,
        };
        let events = self.records.events(&query).await.map_err(record_error)?;
        Ok(events.first().map(|e| e.timestamp))
    }

    /// A sandbox's samples in `[start, end]` (default: its lifetime), thinned for the range.
    pub async fn sandbox_metrics(
        &self,
        team: &Team,
        id: &str,
        start: Option<i64>,
        end: Option<i64>,
    ) -> ControlResult<Vec<MetricSample>> {
        if start.is_some_and(|s| s < 0) || end.is_some_and(|e| e < 0) {
            return Err(ControlError::bad_request(
                "start and end must not be negative",
            ));
        }
        let subject = self.telemetry_subject(team, id).await?;
        let end = end.unwrap_or(subject.ended.unwrap_or_else(now_unix));
        let start = start.unwrap_or(
            subject
                .started
                .unwrap_or(end.saturating_sub(RETENTION.as_secs() as i64)),
        );
        if start < 0 || end < 0 {
            return Err(ControlError::bad_request(
                "start and end must not be negative",
            ));
        }
        if start > end {
            return Err(ControlError::bad_request("start must not be after end"));
        }
        let samples = match self.node.metrics(id, start, end).await {
            Ok(s) => s,
            Err(NodeError::NotFound(_)) => Vec::new(),
            Err(e) => {
                return Err(ControlError::internal(format!(
                    "reading metrics failed: {e}"
                )))
            }
        };
        Ok(thin::thin(samples, thin::step_for(end - start)))
    }

    /// The latest sample (at most a minute old) of each of the team's running sandboxes named.
    pub async fn latest_metrics(
        &self,
        team: &Team,
        ids: &[String],
    ) -> ControlResult<BTreeMap<String, MetricSample>> {
        if ids.len() > MAX_BATCH {
            return Err(ControlError::bad_request(format!(
                "at most {MAX_BATCH} sandbox_ids per request"
            )));
        }
        let mut running = Vec::new();
        for id in ids {
            if !crate::ids::plausible_sandbox_id(id) {
                continue;
            }
            let rec = self.records.sandbox(id).await.map_err(record_error)?;
            if rec.is_some_and(|r| r.team_id == team.id && r.state == SandboxState::Running) {
                running.push(id.clone());
            }
        }
        let oldest = now_unix() - LATEST_MAX_AGE_SECS;
        Ok(self
            .node
            .latest_metrics(running)
            .await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "the node did not give its latest samples");
                Vec::new()
            })
            .into_iter()
            .filter(|(_, s)| s.timestamp_unix >= oldest)
            .collect())
    }

    /// A sandbox's console log entries; `team` `None` is the operator (any sandbox the node
    /// still has logs of).
    pub async fn sandbox_logs(
        &self,
        team: Option<&Team>,
        id: &str,
        query: LogQuery,
    ) -> ControlResult<Vec<LogEntry>> {
        match team {
            Some(team) => {
                self.telemetry_subject(team, id).await?;
            }
            None if !crate::ids::plausible_sandbox_id(id) => {
                return Err(ControlError::sandbox_not_found(id))
            }
            None => {}
        }
        match self.node.logs(id, query).await {
            Ok(e) => Ok(e),
            Err(NodeError::NotFound(_)) => Ok(Vec::new()),
            Err(e) => Err(ControlError::internal(format!("reading logs failed: {e}"))),
        }
    }
}
