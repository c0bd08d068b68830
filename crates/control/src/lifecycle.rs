//! Create, kill, pause, resume/connect, timeouts.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use time::OffsetDateTime;
use vmon_kv::IdempotencyOutcome;
use vmon_proto::node::{BuildInfo, StartSpec};

use super::model::{self, NewSandbox};
use super::{admission_key, event, kv_error, network_policy, record_error, timeout_secs, Control};
use super::{ControlError, ControlResult};
use crate::ids;
use crate::records::{Change, EventKind, SandboxRecord, SandboxState, Team};

const IDEMPOTENCY_TTL: Duration = Duration::from_secs(24 * 3600);

/// Why a sandbox was killed (`kill_reason` of its killed event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillReason {
    Request,
    Timeout,
    Admin,
    Orphaned,
    /// Its idle policy ends it on suspend (`suspended_duration_seconds` 0).
    Idle,
}

impl KillReason {
    pub fn as_str(self) -> &'static str {
        match self {
            KillReason::Request => "request",
            KillReason::Timeout => "timeout",
            KillReason::Admin => "admin",
            KillReason::Orphaned => "orphaned",
            KillReason::Idle => "idle",
        }
    }
    pub(crate) fn data(self) -> serde_json::Value {
        serde_json::json!({ "kill_reason": self.as_str() })
    }
}

/// A create as the handler hands it over.
pub struct CreateParams {
    pub request: NewSandbox,
    /// `POST /sandboxes` (timeout default 15 s) rather than `/v2/sandboxes` (300 s).
    pub legacy: bool,
    pub idempotency_key: Option<String>,
}

/// How a running sandbox comes to be.
struct Launch<'a> {
    team: &'a Team,
    template_id: String,
    alias: Option<String>,
    build: BuildInfo,
    owned_build: Option<String>,
    timeout: u64,
    /// Everything a fork child inherits; for a create, taken from the request.
    base: Inherited,
}

#[derive(Clone)]
pub(crate) struct Inherited {
    pub metadata: model::StringMap,
    pub env_vars: model::StringMap,
    pub auto_pause: bool,
    pub auto_pause_memory: bool,
    pub auto_resume: bool,
    pub allow_internet_access: Option<bool>,
    pub network: model::NetworkConfig,
    pub public_traffic: bool,
    pub volume_mounts: Vec<model::VolumeMount>,
    pub s3_mounts: Vec<model::S3Mount>,
    pub idle: Option<crate::records::IdlePolicy>,
    /// GPUs passed through (`control/gpus.rs`).
    pub gpus: u32,
}

impl Inherited {
    pub(crate) fn of(rec: &SandboxRecord) -> Inherited {
        Inherited {
            metadata: rec.metadata.clone(),
            env_vars: rec.env_vars.clone(),
            auto_pause: rec.auto_pause,
            auto_pause_memory: rec.auto_pause_memory,
            auto_resume: rec.auto_resume,
            allow_internet_access: rec.allow_internet_access,
            network: rec.network.clone(),
            public_traffic: rec.traffic_access_token.is_none(),
            volume_mounts: rec.volume_mounts.clone(),
            s3_mounts: rec.s3_mounts.clone(),
            idle: rec.idle,
            gpus: rec.gpus,
        }
    }
}

pub(crate) fn validate_idempotency_key(key: &str) -> ControlResult<()> {
    // The seed allows [a-z0-9]; the SDK also sends hyphens, so they are accepted too.
    let ok = (1..=255).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ControlError::bad_request(
            "Idempotency-Key must be 1-255 characters of [a-z0-9-]",
        ))
    }
}

/// 400 when `secs` is longer than the team's maximum lifetime.
fn over_lifetime(team: &Team, secs: u64, what: &str) -> ControlResult<()> {
    if secs > team.limits.max_lifetime_secs {
        return Err(ControlError::bad_request(format!(
            "{what} cannot be greater than {} seconds (the team's maximum lifetime)",
            team.limits.max_lifetime_secs
        )));
    }
    Ok(())
}

impl Control {
    pub async fn create(
        self: &Arc<Self>,
        team: &Team,
        params: CreateParams,
    ) -> ControlResult<SandboxRecord> {
        let req = params.request;
        let timeout = match req.timeout {
            Some(t) => timeout_secs(t, "timeout")?,
            None if params.legacy => 15,
            None => 300,
        };
        if timeout > team.limits.max_lifetime_secs {
            return Err(ControlError::bad_request(format!(
                "timeout cannot be greater than {} seconds (the team's maximum lifetime)",
                team.limits.max_lifetime_secs
            )));
        }
        if let Some(key) = &params.idempotency_key {
            validate_idempotency_key(key)?;
        }
        super::check_maps(&req.metadata, &req.env_vars)?;
        // Bad rules, a rule host not in allowOut or an unknown secret: 400 before anything
        // starts (and again at every start, with the values of the moment).
        self.egress_spec(&team.id, &req.network.clone().unwrap_or_default(), true)
            .await?;
        // A private range in allowOut only where the operator's private_allow lists it (the
        // node checks again at every start).
        super::network::check_private(
            req.network
                .as_ref()
                .and_then(|n| n.allow_out.as_deref())
                .unwrap_or_default(),
            &self.config.private_allow,
        )
        .await?;
        let volume_mounts = req.volume_mounts.clone().unwrap_or_default();
        super::volumes::check_mount_paths(&volume_mounts)?;
        // Unknown names are a 400 before anything starts (and again at every start).
        self.volume_shares(&team.id, &volume_mounts).await?;
        let s3_mounts = req.vmon_s3_mounts.clone().unwrap_or_default();
        super::s3mounts::check(&s3_mounts, &volume_mounts, &self.config)?;
        // So are missing or malformed secrets (the bucket itself is the node's to reach).
        self.bucket_shares(&team.id, "check", &s3_mounts).await?;
        let auto_pause = req.auto_pause.unwrap_or(false);
        let auto_resume = req.auto_resume.as_ref().is_some_and(|a| a.enabled);
        let auto_pause_memory = req.auto_pause_memory.unwrap_or(true);
        if auto_resume && !auto_pause {
            return Err(ControlError::bad_request("autoResume requires autoPause"));
        }
        let idle = super::idle::resolve(
            &self.config.idle,
            team,
            &super::idle::Asked {
                field: req.vmon_idle.as_ref(),
                metadata: &req.metadata,
                timeout,
                auto_pause,
                has_volumes: !volume_mounts.is_empty() || !s3_mounts.is_empty(),
            },
        )?;
        self.admit_while_starting()?;
        let (template, tag, build) = self.resolve_template(team, &req.template_id).await?;
        check_limits(team, &build)?;
        let gpus = self
            .requested_gpus(&req.metadata, &template, &build)
            .await?;
        let network = req.network.clone().unwrap_or_default();
        let launch = Launch {
            team,
            template_id: template.id.clone(),
            alias: template_alias(&template, &tag),
            build,
            owned_build: None,
            timeout,
            base: Inherited {
                metadata: req.metadata,
                env_vars: req.env_vars,
                auto_pause,
                auto_pause_memory,
                auto_resume,
                allow_internet_access: req.allow_internet_access,
                public_traffic: network.allow_public_traffic.unwrap_or(true),
                network,
                volume_mounts,
                s3_mounts,
                idle,
                gpus,
            },
        };
        match params.idempotency_key {
            None => self.launch(launch, None).await,
            Some(key) => self.create_idempotent(team, launch, &key).await,
        }
    }

    /// Same key → same sandbox for 24 h. The sandbox id is chosen and locked before the key is
    /// claimed, so a repeat of a create in flight waits on that lock and then reads its outcome.
    async fn create_idempotent(
        self: &Arc<Self>,
        team: &Team,
        launch: Launch<'_>,
        key: &str,
    ) -> ControlResult<SandboxRecord> {
        let kv_key = format!("create/{}/{key}", team.id);
        for _ in 0..5 {
            let id = ids::sandbox_id();
            let guard = self.lock(&id).await?;
            let expires = SystemTime::now() + IDEMPOTENCY_TTL;
            match self
                .kv
                .idempotency_put_if_absent(&kv_key, id.as_bytes(), expires)
                .await
                .map_err(kv_error)?
            {
                IdempotencyOutcome::Inserted => {
                    let result = self
                        .launch_locked(&id, &launch, guard.fence().token())
                        .await;
                    if result.is_err() {
                        if let Err(e) = self.kv.idempotency_delete(&kv_key).await {
                            tracing::warn!(error = %e, "freeing the idempotency key of a failed create failed");
                        }
                    }
                    let _ = guard.unlock().await;
                    return result;
                }
                IdempotencyOutcome::Exists(record) => {
                    let _ = guard.unlock().await;
                    let existing = String::from_utf8_lossy(&record.value).into_owned();
                    // Wait for the create that owns the key, then read what it made.
                    let guard = self.lock(&existing).await?;
                    let rec = self
                        .records
                        .sandbox(&existing)
                        .await
                        .map_err(record_error)?;
                    let _ = guard.unlock().await;
                    match rec {
                        Some(rec) if rec.team_id == team.id => return Ok(rec),
                        // Killed since, or the create failed: the key may be gone or stale.
                        _ => {
                            let still = self.kv.idempotency_get(&kv_key).await.map_err(kv_error)?;
                            if still.is_some_and(|r| r.value == existing.as_bytes()) {
                                return Err(ControlError::conflict(format!(
                                    "the sandbox created with this Idempotency-Key ({existing}) no longer exists"
                                )));
                            }
                        }
                    }
                }
            }
        }
        Err(ControlError::conflict(
            "the Idempotency-Key is contended; try again",
        ))
    }

    async fn launch(
        self: &Arc<Self>,
        launch: Launch<'_>,
        id: Option<String>,
    ) -> ControlResult<SandboxRecord> {
        let id = id.unwrap_or_else(ids::sandbox_id);
        let guard = self.lock(&id).await?;
        let result = self
            .launch_locked(&id, &launch, guard.fence().token())
            .await;
        let _ = guard.unlock().await;
        result
    }

    /// Admission, node start, record. Nothing is left behind on failure.
    async fn launch_locked(
        &self,
        id: &str,
        launch: &Launch<'_>,
        fence: i64,
    ) -> ControlResult<SandboxRecord> {
        let team = launch.team;
        let mut volumes = self
            .volume_shares(&team.id, &launch.base.volume_mounts)
            .await?;
        volumes.extend(
            self.bucket_shares(&team.id, id, &launch.base.s3_mounts)
                .await?,
        );
        let egress = self
            .egress_spec(&team.id, &launch.base.network, true)
            .await?;
        let counter = self.admit(team).await?;
        let execution_id = ids::execution_id();
        let envd_access_token = ids::token();
        let base = &launch.base;
        let mut rec = SandboxRecord {
            id: id.to_string(),
            team_id: team.id.clone(),
            template_id: launch.template_id.clone(),
            alias: launch.alias.clone(),
            execution_id: execution_id.clone(),
            state: SandboxState::Running,
            started_at: OffsetDateTime::now_utc(),
            end_at: OffsetDateTime::now_utc(),
            build: launch.build.clone(),
            guest_ip: None,
            envd_version: launch.build.envd_version.clone(),
            vcpus: launch.build.vcpus,
            memory_mb: launch.build.memory_mb,
            disk_mb: launch.build.disk_mb,
            metadata: base.metadata.clone(),
            env_vars: base.env_vars.clone(),
            timeout_secs: launch.timeout,
            auto_pause: base.auto_pause,
            auto_pause_memory: base.auto_pause_memory,
            auto_resume: base.auto_resume,
            allow_internet_access: base.allow_internet_access,
            network: base.network.clone(),
            envd_access_token: envd_access_token.clone(),
            traffic_access_token: (!base.public_traffic).then(ids::token),
            volume_mounts: base.volume_mounts.clone(),
            s3_mounts: base.s3_mounts.clone(),
            owned_build: launch.owned_build.clone(),
            idle: base.idle,
            idle_suspended_until: None,
            resumes: Default::default(),
            gpus: base.gpus,
        };
        let span = tracing::info_span!("create", sandbox_id = id, execution_id = %execution_id);
        let _enter = span.enter();
        let spec = StartSpec {
            egress,
            sandbox_id: id.to_string(),
            execution_id: execution_id.clone(),
            build_id: launch.build.build_id.clone(),
            // A mount's state is outside the guest's memory, a GPU's in no snapshot: such
            // sandboxes cold-boot.
            cold_boot: !launch.build.has_memory || !volumes.is_empty() || base.gpus > 0,
            volumes,
            gpus: base.gpus,
            env_vars: base.env_vars.clone(),
            envd_access_token: Some(envd_access_token),
            network: network_policy(&rec),
        };
        drop(_enter);
        let running = match self.node.start(spec).await {
            Ok(r) => r,
            Err(e) => {
                self.release(&counter).await;
                tracing::warn!(sandbox_id = id, error = %e, "start failed");
                return Err(e.into());
            }
        };
        let now = OffsetDateTime::now_utc();
        rec.started_at = now;
        rec.end_at = now + Duration::from_secs(launch.timeout);
        rec.guest_ip = Some(running.guest_ip);
        rec.envd_version = running.envd_version.clone();
        rec.vcpus = running.vcpus;
        rec.memory_mb = running.memory_mb;
        rec.disk_mb = running.disk_mb;
        let created = event(
            &rec,
            EventKind::Created,
            serde_json::json!({ "sandbox_metadata": rec.metadata }),
        );
        if let Err(e) = self
            .commit(Change::Insert(Box::new(rec.clone())), created, fence)
            .await
        {
            let _ = self.node.kill(id, &execution_id).await;
            self.release(&counter).await;
            return Err(e);
        }
        tracing::info!(sandbox_id = id, execution_id = %execution_id, template_id = %rec.template_id, "sandbox created");
        Ok(rec)
    }

    pub(crate) async fn release(&self, counter: &str) {
        if let Err(e) = self.kv.release(counter).await {
            tracing::warn!(counter, error = %e, "releasing an admission unit failed");
        }
    }

    pub async fn kill(&self, team: &Team, id: &str, reason: KillReason) -> ControlResult<()> {
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = match self.records.sandbox(id).await.map_err(record_error)? {
            Some(rec) if rec.team_id == team.id => {
                self.kill_locked(rec, reason, guard.fence().token()).await
            }
            _ => Err(ControlError::sandbox_not_found(id)),
        };
        let _ = guard.unlock().await;
        result
    }

    pub(crate) async fn kill_locked(
        &self,
        rec: SandboxRecord,
        reason: KillReason,
        fence: i64,
    ) -> ControlResult<()> {
        let span =
            tracing::info_span!("kill", sandbox_id = %rec.id, execution_id = %rec.execution_id);
        let _enter = span.enter();
        drop(_enter);
        if rec.state == SandboxState::Running {
            match self.node.kill(&rec.id, &rec.execution_id).await {
                Ok(()) | Err(vmon_proto::node::NodeError::NotFound(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let killed = event(&rec, EventKind::Killed, reason.data());
        self.commit(
            Change::Delete {
                sandbox_id: rec.id.clone(),
                execution_id: rec.execution_id.clone(),
            },
            killed,
            fence,
        )
        .await?;
        if rec.state == SandboxState::Running {
            self.release(&admission_key(&rec.team_id)).await;
        }
        if let Some(b) = &rec.owned_build {
            self.drop_build(b).await;
        }
        if rec.state == SandboxState::Paused
            && rec.owned_build.as_ref() != Some(&rec.build.build_id)
        {
            self.drop_build(&rec.build.build_id).await;
        }
        tracing::info!(sandbox_id = %rec.id, reason = reason.as_str(), "sandbox killed");
        Ok(())
    }

    /// `POST /sandboxes/{id}/timeout`: end = now + timeout (may shorten).
    pub async fn set_timeout(&self, team: &Team, id: &str, timeout: u64) -> ControlResult<()> {
        over_lifetime(team, timeout, "timeout")?;
        self.update_end(team, id, |rec, now| {
            Some(now + Duration::from_secs(timeout)).filter(|t| *t != rec.end_at)
        })
        .await
    }

    /// `POST /sandboxes/{id}/refreshes`: extends, never shortens.
    pub async fn refresh(&self, team: &Team, id: &str, duration: Option<u64>) -> ControlResult<()> {
        if let Some(d) = duration {
            over_lifetime(team, d, "duration")?;
        }
        self.update_end(team, id, |rec, now| {
            let d = duration.unwrap_or(rec.timeout_secs);
            Some(now + Duration::from_secs(d)).filter(|t| *t > rec.end_at)
        })
        .await
    }

    async fn update_end(
        &self,
        team: &Team,
        id: &str,
        new_end: impl FnOnce(&SandboxRecord, OffsetDateTime) -> Option<OffsetDateTime>,
    ) -> ControlResult<()> {
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = async {
            let mut rec = self.owned(team, id).await?;
            if rec.state != SandboxState::Running {
                return Err(ControlError::sandbox_not_found(id));
            }
            let now = OffsetDateTime::now_utc();
            if let Some(end) = new_end(&rec, now) {
                rec.end_at = end.min(Self::lifetime_cap(team, rec.started_at));
                let updated = event(
                    &rec,
                    EventKind::Updated,
                    serde_json::json!({ "set_timeout": super::rfc3339(rec.end_at) }),
                );
                self.commit(
                    Change::update(&rec, &rec.execution_id),
                    updated,
                    guard.fence().token(),
                )
                .await?;
            }
            Ok(())
        }
        .await;
        let _ = guard.unlock().await;
        result
    }

    /// Shared by create and fork: runs [`Self::launch_locked`] for a child. A child owns its
    /// build (deleted once no sandbox uses it) unless the build is its paused source's own.
    pub(crate) async fn launch_child(
        &self,
        team: &Team,
        source: &SandboxRecord,
        build: &BuildInfo,
        timeout: u64,
        owns_build: bool,
    ) -> ControlResult<SandboxRecord> {
        let id = ids::sandbox_id();
        let guard = self.lock(&id).await?;
        let launch = Launch {
            team,
            template_id: source.template_id.clone(),
            alias: source.alias.clone(),
            build: build.clone(),
            owned_build: owns_build.then(|| build.build_id.clone()),
            timeout,
            base: Inherited {
                // A child's window must fit its own timeout, else it has none.
                idle: source.idle.filter(|p| p.max_idle_secs < timeout),
                ..Inherited::of(source)
            },
        };
        let result = self
            .launch_locked(&id, &launch, guard.fence().token())
            .await;
        let _ = guard.unlock().await;
        result
    }
}

fn check_limits(team: &Team, build: &BuildInfo) -> ControlResult<()> {
    let l = &team.limits;
    if build.vcpus > l.max_vcpus {
        return Err(ControlError::bad_request(format!(
            "the template needs {} vCPUs, more than the team's maximum of {}",
            build.vcpus, l.max_vcpus
        )));
    }
    if build.memory_mb > l.max_memory_mb {
        return Err(ControlError::bad_request(format!(
            "the template needs {} MB of memory, more than the team's maximum of {} MB",
            build.memory_mb, l.max_memory_mb
        )));
    }
    if build.disk_mb > l.max_disk_mb {
        return Err(ControlError::bad_request(format!(
            "the template needs {} MB of disk, more than the team's maximum of {} MB",
            build.disk_mb, l.max_disk_mb
        )));
    }
    Ok(())
}

fn template_alias(t: &crate::records::TemplateRecord, tag: &str) -> Option<String> {
    t.alias.as_ref().map(|a| {
        if tag == "default" {
            a.clone()
        } else {
            format!("{a}:{tag}")
        }
    })
}
