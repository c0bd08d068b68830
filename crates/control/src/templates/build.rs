//! Running a template build: find the base, reuse the longest cached prefix of its steps,
//! restore that prefix's build into a build sandbox, run the remaining steps through the
//! node (each one checkpointed with memory, which is the next prefix's layer), start the
//! template's process, wait for its ready command, and checkpoint the result: a template
//! whose creates are memory restores with the start command already running.
//!
//! Here the build from trigger to record; `build/base.rs` its first layer, `build/cache.rs`
//! the layer cache's keys and lookups, `build/guest.rs` the build sandbox and what runs in it
//! (a RUN step's output streamed into the build log as it comes: `build/run.rs`),
//! `build/log.rs` the build log.

mod base;
mod cache;
mod guest;
mod log;
mod run;

use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use vmon_proto::node::BuildInfo;

use self::cache::Keys;
use self::guest::{finalize, BuildVm, StepAt};
use self::log::{describe, Log};
use super::steps::{self, Action, BuildStart, StepState};
use crate::records::{BuildFailure, BuildLogEntry, BuildState, Team, TemplateBuild};
use crate::Control;

/// How long a RUN step may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long the ready command may keep failing.
const READY_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest log message kept per entry.
const MAX_LINE: usize = 4096;
/// Most log lines one step's output adds (the rest is summarized).
const MAX_STEP_LINES: usize = 2000;

/// A build's failure as it is reported: the message, the step, and output for the log.
struct Failed {
    message: String,
    step: String,
}

fn fail(step: impl Into<String>, message: impl Into<String>) -> Failed {
    Failed {
        message: message.into(),
        step: step.into(),
    }
}

impl Control {
    /// Ends the builds a restart interrupted: `building` (or triggered and queued) becomes
    /// `error`.
    pub(crate) async fn end_interrupted_builds(&self) -> anyhow::Result<()> {
        for mut b in self
            .records
            .template_builds_in(&[BuildState::Building, BuildState::Waiting])
            .await?
        {
            // A waiting build whose files may still come stays; a triggered one was queued in
            // the process that ended.
            if b.start.is_none() {
                continue;
            }
            let message = "the build was interrupted: vmon restarted while it ran".to_string();
            self.records
                .append_build_logs(
                    &b.build_id,
                    &[BuildLogEntry {
                        timestamp: OffsetDateTime::now_utc(),
                        level: "error".into(),
                        message: message.clone(),
                        step: None,
                    }],
                )
                .await?;
            b.state = BuildState::Error;
            b.failure = Some(BuildFailure {
                message,
                step: None,
            });
            b.finished_at = Some(OffsetDateTime::now_utc());
            self.records.put_template_build(&b).await?;
        }
        Ok(())
    }

    /// Runs a triggered build to its end (in its own task); the record says how it went.
    pub async fn run_template_build(
        self: Arc<Self>,
        team: Team,
        mut build: TemplateBuild,
        start: BuildStart,
    ) {
        let log = Log {
            control: self.clone(),
            build_id: build.build_id.clone(),
        };
        let permit = self.template_builds.acquire().await;
        build.state = BuildState::Building;
        if let Err(e) = self.records.put_template_build(&build).await {
            tracing::warn!(build = %build.build_id, error = %e, "recording a build failed");
        }
        let t0 = std::time::Instant::now();
        let outcome = self.build_steps(&team, &build, &start, &log).await;
        drop(permit);
        let outcome = match outcome {
            Ok(result) => {
                let secs = t0.elapsed().as_secs_f64();
                match self.publish(&build, &result).await {
                    Ok(()) => {
                        log.info(None, format!("Build finished in {secs:.1} s"))
                            .await;
                        Ok(result)
                    }
                    Err(e) => {
                        let message = format!("the template could not be recorded: {e:#}");
                        log.write("error", Some("finalize"), std::slice::from_ref(&message))
                            .await;
                        Err(fail("finalize", message))
                    }
                }
            }
            Err(f) => {
                let line = format!("Build failed: {}", f.message);
                log.write("error", Some(&f.step), &[line]).await;
                Err(f)
            }
        };
        match outcome {
            Ok(result) => {
                build.state = BuildState::Ready;
                build.result = Some(result);
            }
            Err(f) => {
                build.state = BuildState::Error;
                build.failure = Some(BuildFailure {
                    message: f.message,
                    step: Some(f.step),
                });
            }
        }
        build.finished_at = Some(OffsetDateTime::now_utc());
        if let Err(e) = self.records.put_template_build(&build).await {
            tracing::warn!(build = %build.build_id, error = %e, "recording a build's end failed");
        }
        tracing::info!(build = %build.build_id, template = %build.template_id, state = build.state.as_str(), "template build ended");
    }

    /// Points the build's tags at its result.
    async fn publish(&self, build: &TemplateBuild, result: &BuildInfo) -> anyhow::Result<()> {
        let mut t = self
            .records
            .template_by_id(&build.template_id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("the template was deleted during its build"))?;
        for tag in &build.tags {
            t.tags.insert(tag.clone(), result.clone());
        }
        self.records.put_template(t).await
    }

    /// The build: its plan, its base, the finished template when it is cached whole, else the
    /// steps after the longest cached prefix in a build sandbox.
    async fn build_steps(
        self: &Arc<Self>,
        team: &Team,
        build: &TemplateBuild,
        start: &BuildStart,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        let plan = steps::plan(start).map_err(|e| fail("base", e.to_string()))?;
        let base = self.base_of(team, build, start, log).await?;
        let keys = Keys::of(&base, build, start, &plan);
        if let Some(done) = self.cached_template(team, start, &keys).await {
            log.cached_steps(&start.steps, plan.len()).await;
            log.info(Some("finalize"), "CACHED the finished template")
                .await;
            return Ok(done);
        }
        let (first, from) = match self.cached_prefix(team, start, &keys).await {
            Some(prefix) => prefix,
            None => (
                0,
                self.machine_base(team, build, start, base, &keys, log)
                    .await?,
            ),
        };
        log.cached_steps(&start.steps, first).await;
        let vm = BuildVm::start(self, &from).await?;
        let at = Steps {
            team,
            vm: &vm,
            start,
            plan: &plan,
            keys: &keys,
            log,
        };
        let result = self.steps_in(&at, first, from).await;
        vm.kill().await;
        result
    }

    /// The build's steps from `first` on in the build VM (`last` is the build the one before
    /// left), a layer after each that changed the guest, then the template's start and ready
    /// commands and its last checkpoint.
    async fn steps_in(
        &self,
        at: &Steps<'_>,
        first: usize,
        mut last: BuildInfo,
    ) -> Result<BuildInfo, Failed> {
        let n = at.plan.len();
        let mut state = if first == 0 {
            StepState::default()
        } else {
            at.plan[first - 1].1.clone()
        };
        for i in first..n {
            let (action, after) = &at.plan[i];
            let step = (i + 1).to_string();
            at.log
                .info(
                    Some(step.as_str()),
                    format!("[{}/{n}] {}", i + 1, describe(&at.start.steps[i])),
                )
                .await;
            let one = StepAt {
                vm: at.vm,
                state: &state,
                log: at.log,
                step: &step,
            };
            let changed = self.run_step(at.team, &one, action).await?;
            state = after.clone();
            if changed {
                last = at.vm.checkpoint(&step, "the layer").await?;
            }
            self.remember(at.team, &at.keys.steps[i], &last).await;
        }
        finalize(at.vm, at.start, &state, at.log).await?;
        let done = at.vm.checkpoint("finalize", "the template").await?;
        self.remember(at.team, &at.keys.finished, &done).await;
        Ok(done)
    }
}

/// One build's run in its sandbox: the team, what it was asked, its plan and cache keys, its
/// log.
struct Steps<'a> {
    team: &'a Team,
    vm: &'a BuildVm,
    start: &'a BuildStart,
    plan: &'a [(Action, StepState)],
    keys: &'a Keys,
    log: &'a Log,
}
