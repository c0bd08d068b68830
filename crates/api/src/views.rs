//! The JSON the sandbox routes answer, made from the domain's records at the route edge
//! (`control` returns records; the E2B shapes of `wire.rs` are made only here).

use crate::control::{kernel_state_lost, rfc3339, ControlError, Health, SnapshotNames};
use crate::error::ApiError;
use crate::records::{SandboxRecord, SandboxState};
use crate::wire;
use crate::Config;

/// `Sandbox`: what create, connect, resume and each fork child answer.
pub fn sandbox(config: &Config, rec: &SandboxRecord) -> wire::Sandbox {
    wire::Sandbox {
        template_id: rec.template_id.clone(),
        sandbox_id: rec.id.clone(),
        client_id: config.client_id.clone(),
        envd_version: rec.envd_version.clone(),
        alias: rec.alias.clone(),
        envd_access_token: Some(rec.envd_access_token.clone()),
        traffic_access_token: rec.traffic_access_token.clone(),
        domain: config.sandbox_domain(),
    }
}

/// `SandboxDetail`, with where its state is (`Control::state_location`).
pub fn detail(config: &Config, rec: &SandboxRecord, location: &str) -> wire::SandboxDetail {
    let mut network = rec.network.clone();
    network.allow_public_traffic = Some(rec.traffic_access_token.is_none());
    wire::SandboxDetail {
        template_id: rec.template_id.clone(),
        sandbox_id: rec.id.clone(),
        client_id: config.client_id.clone(),
        started_at: rfc3339(rec.started_at),
        end_at: rfc3339(rec.end_at),
        envd_version: rec.envd_version.clone(),
        cpu_count: rec.vcpus,
        memory_mb: rec.memory_mb,
        disk_size_mb: rec.disk_mb,
        state: rec.state.as_str().to_string(),
        alias: rec.alias.clone(),
        envd_access_token: Some(rec.envd_access_token.clone()),
        allow_internet_access: rec.allow_internet_access,
        domain: config.sandbox_domain(),
        metadata: rec.metadata.clone(),
        network,
        lifecycle: wire::Lifecycle {
            auto_resume: rec.auto_resume,
            on_timeout: if rec.auto_pause { "pause" } else { "kill" }.to_string(),
        },
        pause_mode: (rec.state == SandboxState::Paused).then(|| {
            if rec.build.has_memory {
                "full"
            } else {
                "filesystem"
            }
            .to_string()
        }),
        envd_unresponsive_at_pause: (rec.state == SandboxState::Paused).then_some(false),
        volume_mounts: rec.volume_mounts.clone(),
        s3_mounts: rec.s3_mounts.clone(),
        resume_generation: rec.resumes.generation,
        kernel_state_lost: kernel_state_lost(rec),
        last_resume: last_resume(rec),
        state_location: location.to_string(),
        idle: idle(rec),
    }
}

/// `ListedSandbox`.
pub fn listed(config: &Config, rec: &SandboxRecord) -> wire::ListedSandbox {
    wire::ListedSandbox {
        template_id: rec.template_id.clone(),
        alias: rec.alias.clone(),
        sandbox_id: rec.id.clone(),
        client_id: config.client_id.clone(),
        started_at: rfc3339(rec.started_at),
        end_at: rfc3339(rec.end_at),
        cpu_count: rec.vcpus,
        memory_mb: rec.memory_mb,
        disk_size_mb: rec.disk_mb,
        metadata: rec.metadata.clone(),
        state: rec.state.as_str().to_string(),
        envd_version: rec.envd_version.clone(),
        volume_mounts: rec.volume_mounts.clone(),
    }
}

/// `GET /sandboxes/{id}/health`.
pub fn health(h: &Health) -> wire::SandboxHealth {
    let rec = &h.record;
    wire::SandboxHealth {
        sandbox_id: rec.id.clone(),
        state: rec.state.as_str().to_string(),
        resume_generation: rec.resumes.generation,
        kernel_state_lost: kernel_state_lost(rec),
        last_resume: last_resume(rec),
        state_location: h.location.to_string(),
        in_object_store: h.in_object_store,
        idle: idle(rec),
        idle_suspended: rec.idle_suspended_until.is_some(),
        suspended_until: rec.idle_suspended_until.map(rfc3339),
        idle_seconds: h.idle_seconds,
    }
}

/// One fork child: its sandbox, or its error as `{code, message}` with the status it would
/// have had alone.
pub fn fork_result(
    config: &Config,
    child: Result<SandboxRecord, ControlError>,
) -> wire::ForkResult {
    match child {
        Ok(rec) => wire::ForkResult {
            sandbox: Some(sandbox(config, &rec)),
            error: None,
        },
        Err(e) => wire::ForkResult {
            sandbox: None,
            error: Some(ApiError::from(e).body()),
        },
    }
}

/// `SnapshotInfo`.
pub fn snapshot(s: SnapshotNames) -> wire::SnapshotInfo {
    wire::SnapshotInfo {
        snapshot_id: s.snapshot_id,
        names: s.names,
    }
}

fn last_resume(rec: &SandboxRecord) -> Option<wire::LastResumeView> {
    rec.resumes.last.as_ref().map(|l| wire::LastResumeView {
        kind: l.kind.clone(),
        duration_ms: l.duration_ms,
        at: rfc3339(l.at),
        trigger: l.trigger.clone(),
    })
}

fn idle(rec: &SandboxRecord) -> Option<wire::IdleView> {
    rec.idle.map(|p| wire::IdleView {
        max_idle_seconds: p.max_idle_secs,
        auto_resume: p.auto_resume,
        suspended_duration_seconds: p.suspended_secs,
    })
}
