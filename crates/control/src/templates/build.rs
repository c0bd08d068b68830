//! Running a template build: find the base, reuse the longest cached prefix of its steps,
//! restore that prefix's build into a build sandbox, run the remaining steps through the
//! node (each one checkpointed with memory, which is the next prefix's layer), start the
//! template's process, wait for its ready command, and checkpoint the result: a template
//! whose creates are memory restores with the start command already running. A RUN step's
//! output is streamed into the build log as it comes (`build/run.rs`).

mod run;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use time::OffsetDateTime;
use vmon_proto::node::{BuildInfo, ExecSpec, NetworkPolicy, StartSpec, TemplateSpec};

use super::image;
use super::steps::{self, Action, BuildStart, StepState, BASE_IMAGE};
use crate::ids;
use crate::records::{BuildFailure, BuildLogEntry, BuildState, Team, TemplateBuild};
use crate::{record_error, Control};

/// How long a RUN step may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long the ready command may keep failing.
const READY_TIMEOUT: Duration = Duration::from_secs(600);
/// How long an unused layer stays in the cache.
const LAYER_KEEP: Duration = Duration::from_secs(7 * 24 * 3600);
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

/// The log of one build: entries are written to the store as they come.
struct Log {
    control: Arc<Control>,
    build_id: String,
}

impl Log {
    async fn write(&self, level: &str, step: Option<&str>, lines: &[String]) {
        let entries: Vec<BuildLogEntry> = lines
            .iter()
            .map(|m| BuildLogEntry {
                timestamp: OffsetDateTime::now_utc(),
                level: level.to_string(),
                message: cut(m),
                step: step.map(str::to_string),
            })
            .collect();
        if let Err(e) = self
            .control
            .records
            .append_build_logs(&self.build_id, &entries)
            .await
        {
            tracing::warn!(build = %self.build_id, error = %e, "writing build logs failed");
        }
    }

    async fn info(&self, step: Option<&str>, line: impl Into<String>) {
        self.write("info", step, &[line.into()]).await;
    }

    /// A command's output, one entry per line.
    async fn output(&self, step: Option<&str>, level: &str, text: &str) {
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        if lines.len() > MAX_STEP_LINES {
            let dropped = lines.len() - MAX_STEP_LINES;
            lines.drain(..dropped);
            lines.insert(0, format!("[{dropped} earlier lines left out]"));
        }
        if !lines.is_empty() {
            self.write(level, step, &lines).await;
        }
    }
}

fn cut(s: &str) -> String {
    if s.len() <= MAX_LINE {
        return s.to_string();
    }
    let mut end = MAX_LINE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The build sandbox: killed on every way out.
struct BuildVm {
    control: Arc<Control>,
    sandbox_id: String,
    execution_id: String,
}

impl BuildVm {
    async fn exec(
        &self,
        cmd: String,
        user: &str,
        state: &StepState,
        timeout: Duration,
    ) -> Result<vmon_proto::node::ExecOutput, String> {
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

    async fn kill(&self) {
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

/// The first layer's key: the base build and the machine the template asks for.
fn base_key(base: &BuildInfo, vcpus: u32, memory_mb: u32) -> String {
    let mut h = Sha256::new();
    h.update(format!("base\0{}\0{vcpus}\0{memory_mb}", base.build_id));
    hex::encode(h.finalize())
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
        match outcome {
            Ok(result) => {
                let secs = t0.elapsed().as_secs_f64();
                match self.publish(&build, &result).await {
                    Ok(()) => {
                        log.info(None, format!("Build finished in {secs:.1} s"))
                            .await;
                        build.state = BuildState::Ready;
                        build.result = Some(result);
                    }
                    Err(e) => {
                        let message = format!("the template could not be recorded: {e:#}");
                        log.write("error", Some("finalize"), std::slice::from_ref(&message))
                            .await;
                        build.state = BuildState::Error;
                        build.failure = Some(BuildFailure {
                            message,
                            step: Some("finalize".into()),
                        });
                    }
                }
            }
            Err(f) => {
                log.write(
                    "error",
                    Some(&f.step),
                    &[format!("Build failed: {}", f.message)],
                )
                .await;
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

    /// The base build: `fromTemplate`'s, `base` for `e2bdev/base`, or any other `fromImage`
    /// pulled from its registry and booted (a layer keyed on the reference and its digest).
    async fn base_of(
        &self,
        team: &Team,
        build: &TemplateBuild,
        start: &BuildStart,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        if let Some(t) = &start.from_template {
            let (_, _, b) = self
                .resolve_template(team, t)
                .await
                .map_err(|e| fail("base", format!("template {t:?}: {e}")))?;
            return Ok(b);
        }
        match start.from_image.as_deref() {
            None | Some(BASE_IMAGE) | Some("e2bdev/base:latest") => {
                let (_, _, b) = self
                    .resolve_template(team, "base")
                    .await
                    .map_err(|e| fail("base", format!("the base template: {e}")))?;
                Ok(b)
            }
            Some(reference) => self.image_base(team, build, start, reference, log).await,
        }
    }

    /// The first layer of a build from an OCI image: the cached one for the digest the
    /// reference names now, or the image pulled and booted by the node.
    async fn image_base(
        &self,
        team: &Team,
        build: &TemplateBuild,
        start: &BuildStart,
        reference: &str,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        let (mut oci, registry) = image::image(
            reference,
            start.from_image_registry.as_ref().map(|l| &l.0),
            &self.config.insecure_registries,
        )
        .map_err(|e| fail("base", e))?;
        oci.registry_allow = self.config.registry_allow.clone();
        log.info(
            Some("base"),
            format!("Resolving {reference} in the registry {registry}"),
        )
        .await;
        let digest = self
            .node
            .resolve_image(oci.clone())
            .await
            .map_err(|e| fail("base", e.to_string()))?;
        let key = image::base_key(reference, &digest, build.vcpus, build.memory_mb);
        if !start.force {
            if let Some(b) = self.cached(team, &key).await {
                log.info(Some("base"), format!("CACHED {reference} ({digest})"))
                    .await;
                return Ok(b);
            }
        }
        log.info(
            Some("base"),
            format!("Pulling {reference} ({digest}) and booting it"),
        )
        .await;
        oci.digest = Some(digest);
        let b = self
            .node
            .build_template(TemplateSpec {
                build_id: ids::build_id(),
                vcpus: build.vcpus,
                memory_mb: build.memory_mb,
                disk_mb: build.disk_mb,
                start_cmd: None,
                ready_cmd: None,
                warm_request: None,
                env_vars: BTreeMap::new(),
                image: Some(oci),
                layer: None,
            })
            .await
            .map_err(|e| fail("base", e.to_string()))?;
        self.remember(team, &key, &b).await;
        Ok(b)
    }

    async fn build_steps(
        self: &Arc<Self>,
        team: &Team,
        build: &TemplateBuild,
        start: &BuildStart,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        let plan = steps::plan(start).map_err(|e| fail("base", e.to_string()))?;
        let n = plan.len();
        let base = self.base_of(team, build, start, log).await?;
        // A machine other than the base's needs a fresh boot of the base image (a memory
        // restore keeps its machine); it is a layer like any other.
        let shape_differs = start.from_template.is_none()
            && (base.vcpus != build.vcpus || base.memory_mb != build.memory_mb);
        let mut key = base_key(&base, build.vcpus, build.memory_mb);
        let mut keys = Vec::with_capacity(n);
        let mut before = StepState::default();
        for (i, (_, after)) in plan.iter().enumerate() {
            key = steps::next_key(&key, &start.steps[i], &before);
            keys.push(key.clone());
            before = after.clone();
        }
        let last_state = plan.last().map(|(_, s)| s.clone()).unwrap_or_default();
        let final_key = steps::final_key(
            keys.last()
                .map_or(&base_key(&base, build.vcpus, build.memory_mb), |k| k),
            start,
            &last_state,
        );
        let no_cache_from = if start.force {
            0
        } else {
            start.steps.iter().position(|s| s.force).unwrap_or(n)
        };
        // The longest prefix already built.
        let mut from: Option<(usize, BuildInfo)> = None;
        if no_cache_from == n && !start.force {
            if let Some(b) = self.cached(team, &final_key).await {
                for (i, (_, _)) in plan.iter().enumerate() {
                    log.info(
                        Some(&(i + 1).to_string()),
                        format!("CACHED [{}/{n}] {}", i + 1, describe(&start.steps[i])),
                    )
                    .await;
                }
                log.info(Some("finalize"), "CACHED the finished template")
                    .await;
                return Ok(b);
            }
        }
        for i in (0..no_cache_from.min(n)).rev() {
            if let Some(b) = self.cached(team, &keys[i]).await {
                from = Some((i + 1, b));
                break;
            }
        }
        let (first, from_build) = match from {
            Some((k, b)) => (k, b),
            None if !shape_differs => (0, base.clone()),
            None => {
                let machine_key = base_key(&base, build.vcpus, build.memory_mb);
                match self
                    .cached(team, &machine_key)
                    .await
                    .filter(|_| !start.force)
                {
                    Some(b) => (0, b),
                    None => {
                        log.info(
                            Some("base"),
                            format!(
                                "Booting the base image with {} vCPUs and {} MiB",
                                build.vcpus, build.memory_mb
                            ),
                        )
                        .await;
                        let b = self
                            .node
                            .build_template(TemplateSpec {
                                build_id: ids::build_id(),
                                vcpus: build.vcpus,
                                memory_mb: build.memory_mb,
                                disk_mb: build.disk_mb.max(base.disk_mb),
                                start_cmd: None,
                                ready_cmd: None,
                                warm_request: None,
                                env_vars: BTreeMap::new(),
                                image: None,
                                layer: None,
                            })
                            .await
                            .map_err(|e| fail("base", format!("booting the base image: {e}")))?;
                        self.remember(team, &machine_key, &b).await;
                        (0, b)
                    }
                }
            }
        };
        for (i, _) in plan.iter().enumerate().take(first) {
            log.info(
                Some(&(i + 1).to_string()),
                format!("CACHED [{}/{n}] {}", i + 1, describe(&start.steps[i])),
            )
            .await;
        }
        let vm = BuildVm {
            control: self.clone(),
            sandbox_id: format!("b{}", ids::random_lower(20)),
            execution_id: ids::execution_id(),
        };
        self.node
            .start(StartSpec {
                egress: Default::default(),
                gpus: 0,
                sandbox_id: vm.sandbox_id.clone(),
                execution_id: vm.execution_id.clone(),
                build_id: from_build.build_id.clone(),
                cold_boot: !from_build.has_memory,
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
        let result = self
            .steps_in(
                team, &vm, start, &plan, &keys, first, from_build, &final_key, log,
            )
            .await;
        vm.kill().await;
        result
    }

    /// The build's steps from `first` on in the build VM, a layer after each that changed
    /// the guest, then the template's start and ready commands and its last checkpoint.
    #[allow(clippy::too_many_arguments)]
    async fn steps_in(
        &self,
        team: &Team,
        vm: &BuildVm,
        start: &BuildStart,
        plan: &[(Action, StepState)],
        keys: &[String],
        first: usize,
        mut last: BuildInfo,
        final_key: &str,
        log: &Log,
    ) -> Result<BuildInfo, Failed> {
        let n = plan.len();
        let mut state = if first == 0 {
            StepState::default()
        } else {
            plan[first - 1].1.clone()
        };
        for i in first..n {
            let (action, after) = &plan[i];
            let step = (i + 1).to_string();
            log.info(
                Some(step.as_str()),
                format!("[{}/{n}] {}", i + 1, describe(&start.steps[i])),
            )
            .await;
            let at = StepAt {
                vm,
                state: &state,
                log,
                step: &step,
            };
            let changed = self.run_step(team, &at, action).await?;
            state = after.clone();
            if changed {
                last = self
                    .node
                    .checkpoint(&vm.sandbox_id, &vm.execution_id, true)
                    .await
                    .map_err(|e| fail(&step, format!("saving the layer: {e}")))?;
            }
            self.remember(team, &keys[i], &last).await;
        }
        start_command(vm, start, &state, log).await?;
        wait_ready(vm, start, &state, log).await?;
        let _ = vm
            .exec("sync".into(), "root", &state, Duration::from_secs(60))
            .await;
        log.info(Some("finalize"), "Saving the template (memory and disk)")
            .await;
        let done = self
            .node
            .checkpoint(&vm.sandbox_id, &vm.execution_id, true)
            .await
            .map_err(|e| fail("finalize", format!("saving the template: {e}")))?;
        self.remember(team, final_key, &done).await;
        Ok(done)
    }

    /// One step in the build VM; whether it changed the guest (a state-only step does not).
    async fn run_step(
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

    /// The layer cache's collector (the leader's hourly job): a layer unused for
    /// [`LAYER_KEEP`] leaves the cache and its build goes when nothing stands on it (a template
    /// tag, a sandbox, a later layer: the node refuses those deletions and the build stays).
    pub(crate) async fn collect_layers(&self) {
        let before = OffsetDateTime::now_utc() - LAYER_KEEP;
        let stale = match self.records.stale_layers(before).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "listing stale template layers failed");
                return;
            }
        };
        for (team, key, build) in stale {
            if self.records.delete_layer(&team, &key).await.is_err() {
                continue;
            }
            // A template's tag may still name it (the finished template is a layer too).
            if let Ok(false) = self.records.is_template_build(&build.build_id).await {
                self.drop_build(&build.build_id).await;
            }
        }
    }

    /// A cached layer that the node still has.
    async fn cached(&self, team: &Team, key: &str) -> Option<BuildInfo> {
        let b = self.records.layer(&team.id, key).await.ok()??;
        match self.node.build_info(&b.build_id).await {
            Ok(info) if !info.older_image => Some(b),
            _ => {
                let _ = self.records.delete_layer(&team.id, key).await;
                None
            }
        }
    }

    async fn remember(&self, team: &Team, key: &str, b: &BuildInfo) {
        if let Err(e) = self.records.put_layer(&team.id, key, b).await {
            tracing::warn!(error = %record_error(e), "caching a layer failed");
        }
    }
}

/// A step as its log line shows it.
fn describe(s: &steps::Step) -> String {
    match s.kind.as_str() {
        "RUN" => format!("RUN {}", cut(s.args.first().map_or("", |a| a.as_str()))),
        "COPY" => format!(
            "COPY {} {}",
            s.args.first().map_or("", |a| a.as_str()),
            s.args.get(1).map_or("", |a| a.as_str())
        ),
        other => format!("{other} {}", cut(&s.args.join(" "))),
    }
}

/// Where one step runs: the build VM, the state before it, the log, the step's number.
struct StepAt<'a> {
    vm: &'a BuildVm,
    state: &'a StepState,
    log: &'a Log,
    step: &'a str,
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

/// The template's own process, started detached as the last user.
async fn start_command(
    vm: &BuildVm,
    start: &BuildStart,
    state: &StepState,
    log: &Log,
) -> Result<(), Failed> {
    let Some(cmd) = start.start_cmd.as_deref().filter(|c| !c.trim().is_empty()) else {
        return Ok(());
    };
    log.info(Some("finalize"), format!("Starting: {}", cut(cmd)))
        .await;
    let detached = format!(
        "{{ setsid -f bash -l -c {q} || bash -l -c {q} & }} >/tmp/vmon-start.log 2>&1 </dev/null",
        q = steps::quote(cmd)
    );
    let out = vm
        .exec(detached, &state.user, state, Duration::from_secs(60))
        .await
        .map_err(|e| fail("finalize", format!("starting the start command: {e}")))?;
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
async fn wait_ready(
    vm: &BuildVm,
    start: &BuildStart,
    state: &StepState,
    log: &Log,
) -> Result<(), Failed> {
    let Some(ready) = start.ready_cmd.as_deref().filter(|c| !c.trim().is_empty()) else {
        return Ok(());
    };
    log.info(Some("finalize"), format!("Waiting for: {}", cut(ready)))
        .await;
    let t0 = tokio::time::Instant::now();
    loop {
        let out = vm
            .exec(
                ready.to_string(),
                &state.user,
                state,
                Duration::from_secs(60),
            )
            .await
            .map_err(|e| fail("finalize", format!("running the ready command: {e}")))?;
        if out.exit_code == 0 {
            return Ok(());
        }
        if t0.elapsed() > READY_TIMEOUT {
            let started = vm
                .exec(
                    "tail -n 50 /tmp/vmon-start.log 2>/dev/null".into(),
                    "root",
                    state,
                    Duration::from_secs(30),
                )
                .await
                .map(|o| o.stdout)
                .unwrap_or_default();
            log.output(Some("finalize"), "error", &started).await;
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
