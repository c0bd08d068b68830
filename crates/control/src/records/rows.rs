//! The api's records as the store's rows and back: a sandbox record and the `extra` JSON that
//! carries what the store does not model, teams and their limits, keys, builds, lifecycle
//! events, and a template written as its row, alias, builds and tags.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use vmon_proto::node::BuildInfo;
use vmon_store::{BuildStatus, NewBuild, NewEvent, NewTemplate, PauseMode};

use super::*;

/// The sandbox fields the store keeps as opaque JSON.
#[derive(Default, Serialize, Deserialize)]
struct Extra {
    build: Option<BuildInfo>,
    guest_ip: Option<IpAddr>,
    allow_internet_access: Option<bool>,
    #[serde(default)]
    volume_mounts: Vec<VolumeMount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    s3_mounts: Vec<crate::model::S3Mount>,
    owned_build: Option<String>,
    #[serde(default)]
    idle: Option<IdlePolicy>,
    #[serde(default)]
    idle_suspended_until: Option<OffsetDateTime>,
    #[serde(default)]
    resumes: ResumeHealth,
    #[serde(default, skip_serializing_if = "is_zero")]
    gpus: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn to_i64<T: TryInto<i64>>(v: T) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

fn to_u32(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

pub(super) fn to_store(rec: &SandboxRecord, fence: i64) -> RecordResult<vmon_store::SandboxRecord> {
    let paused = rec.state == SandboxState::Paused;
    let extra = Extra {
        build: Some(rec.build.clone()),
        guest_ip: rec.guest_ip,
        allow_internet_access: rec.allow_internet_access,
        volume_mounts: rec.volume_mounts.clone(),
        s3_mounts: rec.s3_mounts.clone(),
        owned_build: rec.owned_build.clone(),
        idle: rec.idle,
        idle_suspended_until: rec.idle_suspended_until,
        resumes: rec.resumes.clone(),
        gpus: rec.gpus,
    };
    Ok(vmon_store::SandboxRecord {
        sandbox_id: rec.id.clone(),
        team_id: rec.team_id.clone(),
        execution_id: rec.execution_id.clone(),
        template_id: rec.template_id.clone(),
        build_id: rec.build.build_id.clone(),
        paused_build_id: paused.then(|| rec.build.build_id.clone()),
        alias: rec.alias.clone(),
        state: if paused {
            vmon_store::SandboxState::Paused
        } else {
            vmon_store::SandboxState::Running
        },
        node_id: None,
        pause_mode: paused.then_some(if rec.build.has_memory {
            PauseMode::Full
        } else {
            PauseMode::Filesystem
        }),
        vcpus: i64::from(rec.vcpus),
        memory_mb: i64::from(rec.memory_mb),
        disk_mb: i64::from(rec.disk_mb),
        envd_version: rec.envd_version.clone(),
        metadata: rec.metadata.clone(),
        env_vars: rec.env_vars.clone(),
        network: Some(serde_json::to_value(&rec.network)?),
        auto_pause: rec.auto_pause,
        auto_pause_memory: rec.auto_pause_memory,
        auto_resume: rec.auto_resume,
        timeout_secs: to_i64(rec.timeout_secs),
        started_at: rec.started_at,
        end_at: rec.end_at,
        envd_access_token: Some(rec.envd_access_token.clone()),
        traffic_access_token: rec.traffic_access_token.clone(),
        extra: serde_json::to_value(&extra)?,
        fence,
    })
}

pub(super) fn from_store(s: vmon_store::SandboxRecord) -> SandboxRecord {
    let extra: Extra = serde_json::from_value(s.extra).unwrap_or_default();
    let state = match s.state {
        vmon_store::SandboxState::Paused => SandboxState::Paused,
        _ => SandboxState::Running,
    };
    let build = extra.build.unwrap_or_else(|| BuildInfo {
        build_id: s.paused_build_id.clone().unwrap_or(s.build_id.clone()),
        has_memory: s.pause_mode != Some(PauseMode::Filesystem),
        vcpus: to_u32(s.vcpus),
        memory_mb: to_u32(s.memory_mb),
        disk_mb: to_u32(s.disk_mb),
        envd_version: s.envd_version.clone(),
        parent: None,
        older_image: false,
        stored: false,
    });
    SandboxRecord {
        id: s.sandbox_id,
        team_id: s.team_id,
        template_id: s.template_id,
        alias: s.alias,
        execution_id: s.execution_id,
        state,
        started_at: s.started_at,
        end_at: s.end_at,
        build,
        guest_ip: extra.guest_ip,
        envd_version: s.envd_version,
        vcpus: to_u32(s.vcpus),
        memory_mb: to_u32(s.memory_mb),
        disk_mb: to_u32(s.disk_mb),
        metadata: s.metadata,
        env_vars: s.env_vars,
        timeout_secs: u64::try_from(s.timeout_secs).unwrap_or(0),
        auto_pause: s.auto_pause,
        auto_pause_memory: s.auto_pause_memory,
        auto_resume: s.auto_resume,
        allow_internet_access: extra.allow_internet_access,
        network: s
            .network
            .and_then(|n| serde_json::from_value(n).ok())
            .unwrap_or_default(),
        envd_access_token: s.envd_access_token.unwrap_or_default(),
        traffic_access_token: s.traffic_access_token,
        volume_mounts: extra.volume_mounts,
        s3_mounts: extra.s3_mounts,
        owned_build: extra.owned_build,
        idle: extra.idle,
        idle_suspended_until: extra.idle_suspended_until,
        resumes: extra.resumes,
        gpus: extra.gpus,
    }
}

pub(super) fn team_from_store(t: vmon_store::Team) -> Team {
    let l = t.limits;
    Team {
        id: t.id,
        name: t.name,
        slug: t.slug,
        limits: TeamLimits {
            max_concurrent: to_u32(l.max_concurrent_sandboxes),
            max_vcpus: to_u32(l.max_vcpus),
            max_memory_mb: to_u32(l.max_memory_mb),
            max_disk_mb: to_u32(l.max_disk_mb),
            max_lifetime_secs: u64::try_from(l.max_lifetime_secs).unwrap_or(0),
        },
    }
}

pub(super) fn limits_to_store(l: &TeamLimits) -> vmon_store::TeamLimits {
    vmon_store::TeamLimits {
        max_concurrent_sandboxes: i64::from(l.max_concurrent),
        max_vcpus: i64::from(l.max_vcpus),
        max_memory_mb: i64::from(l.max_memory_mb),
        max_disk_mb: i64::from(l.max_disk_mb),
        max_lifetime_secs: to_i64(l.max_lifetime_secs),
    }
}

pub(super) fn key_from_store(k: vmon_store::ApiKey) -> ApiKeyInfo {
    ApiKeyInfo {
        id: k.id,
        team_id: k.team_id,
        mask: k.mask,
        created_at: k.created_at,
        revoked: k.revoked_at.is_some(),
    }
}

pub(super) fn build_info(b: vmon_store::Build) -> BuildInfo {
    BuildInfo {
        build_id: b.id,
        has_memory: b.has_memory,
        vcpus: to_u32(b.vcpus),
        memory_mb: to_u32(b.memory_mb),
        disk_mb: to_u32(b.disk_mb),
        envd_version: b.envd_version,
        parent: b.parent_build_id,
        older_image: false,
        stored: false,
    }
}

/// The store's name for a template alias: team names live under the team's slug.
pub(super) fn stored_alias(slug: Option<&str>, alias: &str) -> String {
    match slug {
        Some(slug) => format!("{slug}/{alias}"),
        None => alias.to_string(),
    }
}

pub(super) fn event_to_store(e: LifecycleEvent) -> NewEvent {
    NewEvent {
        event_type: e.kind.as_str().to_string(),
        event_data: (!e.data.is_null()).then_some(e.data),
        sandbox_id: e.sandbox_id,
        execution_id: e.execution_id,
        build_id: e.build_id,
        team_id: e.team_id,
        template_id: e.template_id,
        timestamp: e.at,
    }
}

/// Creates or updates a template with its alias, builds and tags (tags it no longer has go).
pub(super) async fn write_template(
    tx: &mut vmon_store::StoreTx,
    template: &TemplateRecord,
    alias: Option<&str>,
) -> RecordResult<()> {
    let existing = tx.template(&template.id).await?;
    let old_tags: Vec<String> = match &existing {
        Some(_) => tx
            .tagged_builds(&template.id)
            .await?
            .into_iter()
            .map(|(tag, _)| tag)
            .collect(),
        None => Vec::new(),
    };
    if existing.is_none() {
        let (kind, source) = match &template.kind {
            TemplateKind::Template => (vmon_store::TemplateKind::Template, None),
            TemplateKind::Snapshot { source_sandbox_id } => (
                vmon_store::TemplateKind::Snapshot,
                Some(source_sandbox_id.clone()),
            ),
        };
        tx.create_template(&NewTemplate {
            id: template.id.clone(),
            team_id: template.team_id.clone(),
            kind,
            source_sandbox_id: source,
            public: template.team_id.is_none(),
        })
        .await?;
    }
    if let Some(alias) = alias {
        let named = existing
            .as_ref()
            .is_some_and(|t| t.aliases.iter().any(|a| a == alias));
        if !named {
            tx.add_alias(&template.id, alias).await?;
        }
    }
    for (tag, build) in &template.tags {
        if tx.build(&build.build_id).await?.is_none() {
            tx.create_build(&NewBuild {
                id: build.build_id.clone(),
                template_id: template.id.clone(),
                status: BuildStatus::Ready,
                vcpus: i64::from(build.vcpus),
                memory_mb: i64::from(build.memory_mb),
                disk_mb: i64::from(build.disk_mb),
                envd_version: build.envd_version.clone(),
                node_id: None,
                has_memory: build.has_memory,
                parent_build_id: build.parent.clone(),
            })
            .await?;
        }
        tx.set_tag(&template.id, tag, &build.build_id).await?;
    }
    for tag in old_tags.iter().filter(|t| !template.tags.contains_key(*t)) {
        tx.remove_tag(&template.id, tag).await?;
    }
    Ok(())
}
