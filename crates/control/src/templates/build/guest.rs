//! The build sandbox and what runs in it: each step (RUN through `run.rs`, COPY, USER and
//! WORKDIR), then the template's start and ready commands, each through envd by the node.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use vmon_proto::node::{BuildInfo, ExecOutput, ExecSpec, NetworkPolicy, StartSpec};

use super::log::{cut, Log};
use super::{fail, Failed, READY_TIMEOUT, STEP_TIMEOUT};
use crate::ids;
use crate::records::Team;
use crate::templates::steps::{self, Action, BuildStart, StepState};
use crate::Control;

/// The build sandbox: killed on every way out.
pub(super) struct BuildVm {
    control: Arc<Control>,
    pub(super) sandbox_id: String,
    pub(super) execution_id: String,
}

impl BuildVm {
    /// A build sandbox restored from `from` (cold-booted over it when it has no memory), with
    /// the internet open to it.
    pub(super) async fn start(control: &Arc<Control>, from: &BuildInfo) -> Result<BuildVm, Failed> {
        let vm = BuildVm {
            control: control.clone(),
            sandbox_id: format!("b{}", ids::random_lower(20)),
            execution_id: ids::execution_id(),
        };
        control
            .node
            .start(StartSpec {
                egress: Default::default(),
                gpus: 0,
                sandbox_id: vm.sandbox_id.clone(),
                execution_id: vm.execution_id.clone(),
                build_id: from.build_id.clone(),
                cold_boot: !from.has_memory,
                env_vars: BTreeMap::new(),
                envd_access_token: Some(ids::token()),
                network: NetworkPolicy {
                    allow_internet_access: true,
                    ..Default::default()
                },
                volumes: Vec::new(),
            })
            .await
            .map_err(|e| fail("base", format!("starting the build VM: {e}")))?;
        Ok(vm)
    }

    pub(super) async fn exec(
        &self,
        cmd: String,
        user: &str,
        state: &StepState,
        timeout: Duration,
    ) -> Result<ExecOutput, String> {
        self.control
            .node
            .exec(
                &self.sandbox_id,
                &self.execution_id,
                ExecSpec {
                    cmd,
                    user: user.to_string(),
                    cwd: state.workdir.clone(),
                    env: state.env.clone(),
                    timeout_secs: timeout.as_secs(),
                },
            )
            .await
            .map_err(|e| e.to_string())
    }

    /// A checkpoint with memory: a layer, or the finished template.
    pub(super) async fn checkpoint(&self, step: &str, what: &str) -> Result<BuildInfo, Failed> {
        self.control
            .node
            .checkpoint(&self.sandbox_id, &self.execution_id, true)
            .await
            .map_err(|e| fail(step, format!("saving {what}: {e}")))
    }

    pub(super) async fn kill(&self) {
        if let Err(e) = self
            .control
            .node
            .kill(&self.sandbox_id, &self.execution_id)
            .await
        {
            tracing::warn!(sandbox_id = %self.sandbox_id, error = %e, "killing a build sandbox failed");
        }
    }
}

/// Where one step runs: the build VM, the state before it, the log, the step's number.
pub(super) struct StepAt<'a> {
    pub(super) vm: &'a BuildVm,
    pub(super) state: &'a StepState,
    pub(super) log: &'a Log,
    pub(super) step: &'a str,
}

impl Control {
    /// One step in the build VM; whether it changed the guest (a state-only step does not).
    pub(super) async fn run_step(
        &self,
        team: &Team,
        at: &StepAt<'_>,
        action: &Action,
    ) -> Result<bool, Failed> {
        match action {
            Action::Run { cmd, user } => run_command(at, cmd, user).await.map(|()| true),
            Action::Copy { .. } => self.copy_files(team, at, action).await.map(|()| true),
            Action::State { cmd: Some(cmd) } => change_state(at, cmd).await.map(|()| true),
            Action::State { cmd: None } => Ok(false),
        }
    }

    /// COPY: the uploaded archive into the guest, then unpacked where the step says.
    async fn copy_files(&self, team: &Team, at: &StepAt<'_>, copy: &Action) -> Result<(), Failed> {
        let Action::Copy {
            files_hash,
            src,
            dest,
            owner,
            mode,
        } = copy
        else {
            return Ok(());
        };
        let (vm, step, s) = (at.vm, at.step, Some(at.step));
        let host = self.template_file(&team.id, files_hash);
        if !host.is_file() {
            return Err(fail(
                step,
                format!("the files of step {step} ({files_hash}) were never uploaded"),
            ));
        }
        let archive = format!("/tmp/vmon-copy-{files_hash}");
        self.node
            .put_file(
                &vm.sandbox_id,
                &vm.execution_id,
                host.to_string_lossy(),
                &archive,
            )
            .await
            .map_err(|e| fail(step, format!("copying the files in: {e}")))?;
        let script = steps::copy_script(&archive, src, dest, owner, mode.as_deref());
        let out = vm
            .exec(script, "root", at.state, STEP_TIMEOUT)
            .await
            .map_err(|e| fail(step, format!("placing the files: {e}")))?;
        at.log.output(s, "info", &out.stdout).await;
        at.log.output(s, "info", &out.stderr).await;
        if out.exit_code != 0 {
            return Err(fail(
                step,
                format!(
                    "step {step} (COPY {src} {dest}) failed: {}",
                    cut(out.stderr.trim())
                ),
            ));
        }
        Ok(())
    }
}

/// RUN: the command, its output streamed into the log; a non-zero exit fails the build.
async fn run_command(at: &StepAt<'_>, cmd: &str, user: &str) -> Result<(), Failed> {
    let step = at.step;
    let code = at
        .vm
        .run_streamed(cmd, user, at.state, at.log, step)
        .await
        .map_err(|e| {
            fail(
                step,
                format!("step {step}: failed to run command '{}': {e}", cut(cmd)),
            )
        })?;
    if code != 0 {
        return Err(fail(
            step,
            format!(
                "step {step}: failed to run command '{}': it ended with exit code {code}",
                cut(cmd),
            ),
        ));
    }
    Ok(())
}

/// USER or WORKDIR: the command that makes the user or the directory.
async fn change_state(at: &StepAt<'_>, cmd: &str) -> Result<(), Failed> {
    let step = at.step;
    let out = at
        .vm
        .exec(cmd.to_string(), "root", at.state, Duration::from_secs(120))
        .await
        .map_err(|e| fail(step, format!("running the step: {e}")))?;
    if out.exit_code != 0 {
        at.log.output(Some(step), "info", &out.stderr).await;
        return Err(fail(
            step,
            format!("step {step} failed: {}", cut(out.stderr.trim())),
        ));
    }
    Ok(())
}

/// Where the start and ready commands run: the build VM, the state after the last step (its
/// user runs them), the log.
struct Finalizing<'a> {
    vm: &'a BuildVm,
    state: &'a StepState,
    log: &'a Log,
}

impl Finalizing<'_> {
    /// `cmd` when the template names one, announced in the log as `doing: cmd`.
    async fn named<'c>(&self, cmd: Option<&'c str>, doing: &str) -> Option<&'c str> {
        let cmd = cmd.filter(|c| !c.trim().is_empty())?;
        self.log
            .info(Some("finalize"), format!("{doing}: {}", cut(cmd)))
            .await;
        Some(cmd)
    }

    /// `cmd` as the last user, a minute to return; a failure to run it says `running`.
    async fn exec(&self, cmd: String, running: &str) -> Result<ExecOutput, Failed> {
        self.vm
            .exec(cmd, &self.state.user, self.state, Duration::from_secs(60))
            .await
            .map_err(|e| fail("finalize", format!("{running}: {e}")))
    }

    /// The template's own process, started detached.
    async fn start_command(&self, start: &BuildStart) -> Result<(), Failed> {
        let Some(cmd) = self.named(start.start_cmd.as_deref(), "Starting").await else {
            return Ok(());
        };
        let detached = format!(
            "{{ setsid -f bash -l -c {q} || bash -l -c {q} & }} >/tmp/vmon-start.log 2>&1 </dev/null",
            q = steps::quote(cmd)
        );
        let out = self.exec(detached, "starting the start command").await?;
        if out.exit_code != 0 {
            return Err(fail(
                "finalize",
                format!(
                    "the start command could not be started: {}",
                    cut(out.stderr.trim())
                ),
            ));
        }
        Ok(())
    }

    /// The ready command, every 500 ms until it succeeds or [`READY_TIMEOUT`] passed (then the
    /// start command's log's tail goes into the build log).
    async fn wait_ready(&self, start: &BuildStart) -> Result<(), Failed> {
        let Some(ready) = self.named(start.ready_cmd.as_deref(), "Waiting for").await else {
            return Ok(());
        };
        let t0 = tokio::time::Instant::now();
        loop {
            let out = self
                .exec(ready.to_string(), "running the ready command")
                .await?;
            if out.exit_code == 0 {
                return Ok(());
            }
            if t0.elapsed() > READY_TIMEOUT {
                self.log_start_tail().await;
                return Err(fail(
                    "finalize",
                    format!(
                        "the ready command did not succeed within {} s (last exit code {})",
                        READY_TIMEOUT.as_secs(),
                        out.exit_code
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The last 50 lines of the start command's output, into the build log as errors.
    async fn log_start_tail(&self) {
        let tail = self
            .vm
            .exec(
                "tail -n 50 /tmp/vmon-start.log 2>/dev/null".into(),
                "root",
                self.state,
                Duration::from_secs(30),
            )
            .await
            .map(|o| o.stdout)
            .unwrap_or_default();
        self.log.output(Some("finalize"), "error", &tail).await;
    }
}

/// The template's start command, then its ready command until it succeeds, then a `sync`, so
/// the checkpoint that follows captures the template as its creates will find it.
pub(super) async fn finalize(
    vm: &BuildVm,
    start: &BuildStart,
    state: &StepState,
    log: &Log,
) -> Result<(), Failed> {
    let f = Finalizing { vm, state, log };
    f.start_command(start).await?;
    f.wait_ready(start).await?;
    let _ = vm
        .exec("sync".into(), "root", state, Duration::from_secs(60))
        .await;
    log.info(Some("finalize"), "Saving the template (memory and disk)")
        .await;
    Ok(())
}
