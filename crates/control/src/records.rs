//! What the api keeps durably, as the narrow port it needs from a store: teams and keys,
//! templates (snapshots are templates too), and sandbox records.
//!
//! Every change of a sandbox record goes through [`Records::commit`] together with the
//! lifecycle event that reports it and the fence of the sandbox's KV lock, so the store writes
//! both in one transaction and refuses a stale writer. Events, webhooks and the webhook outbox
//! are read and written through the same port, in the store's own types.
//!
//! [`StoreRecords`] implements it on `vmon-store` (SQLite in the data dir, or PostgreSQL).

mod builds;
mod rows;
mod store;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use vmon_proto::node::BuildInfo;

use crate::model::{NetworkConfig, StringMap, VolumeMount};

pub use builds::{BuildFailure, BuildLogEntry, BuildRecords, BuildState, TemplateBuild};
pub use store::{secret_key, StoreRecords, SQLITE_FILE, WEBHOOK_KEY_FILE};
pub use vmon_store::{
    Delivery, DeliveryAttempt, Event, EventQuery, NewSecret, NewVolume, NewWebhook, OutboxItem,
    Secret, Volume, Webhook, WebhookPatch, WebhookStats,
};

pub type RecordResult<T> = anyhow::Result<T>;

/// `GET /v2/sandboxes`: which of a team's sandboxes, in which order, from where.
#[derive(Clone, Debug, Default)]
pub struct SandboxListing {
    pub team_id: String,
    /// Empty: every state.
    pub states: Vec<SandboxState>,
    /// Every pair must match.
    pub metadata: Vec<(String, String)>,
    /// The template's id or its alias.
    pub template: Option<String>,
    /// Inclusive: a sandbox that started at exactly this instant is listed.
    pub started_after: Option<OffsetDateTime>,
    /// Newest first (the API's default) or oldest first.
    pub descending: bool,
    /// The `next_cursor` of the previous page (opaque to clients).
    pub cursor: Option<String>,
    /// Page size, 1-1000.
    pub limit: usize,
}

/// One page of [`SandboxListing`].
#[derive(Clone, Debug, Default)]
pub struct SandboxPage {
    pub items: Vec<SandboxRecord>,
    /// Present when there is a next page.
    pub next_cursor: Option<String>,
    /// The team's running sandboxes, whatever the filters (`X-Total-Running`).
    pub total_running: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct TeamLimits {
    /// Running sandboxes at once (paused ones do not count).
    pub max_concurrent: u32,
    pub max_vcpus: u32,
    pub max_memory_mb: u32,
    pub max_disk_mb: u32,
    /// Longest a sandbox may run without a pause, in seconds.
    pub max_lifetime_secs: u64,
}

impl Default for TeamLimits {
    fn default() -> Self {
        Self {
            max_concurrent: 20,
            max_vcpus: 8,
            max_memory_mb: 8192,
            max_disk_mb: 20480,
            max_lifetime_secs: 24 * 3600,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Team {
    pub id: String,
    pub name: String,
    /// Namespace of the team's snapshot names.
    pub slug: String,
    pub limits: TeamLimits,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiKeyInfo {
    pub id: String,
    pub team_id: String,
    /// The first characters of the key, to recognise it in a list.
    pub mask: String,
    /// RFC 3339.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    pub revoked: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum TemplateKind {
    Template,
    Snapshot { source_sandbox_id: String },
}

/// A template or a snapshot: a name and, per tag, the build it starts from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub id: String,
    /// `None`: visible to every team (the built-in templates).
    pub team_id: Option<String>,
    pub alias: Option<String>,
    pub kind: TemplateKind,
    /// Tag → build. Templates have `default`.
    pub tags: BTreeMap<String, BuildInfo>,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum SandboxState {
    Running,
    Paused,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
        }
    }
}

/// One sandbox, running or paused. A killed sandbox has no record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub team_id: String,
    pub template_id: String,
    pub alias: Option<String>,
    /// The current incarnation; a new one on every start and resume.
    pub execution_id: String,
    pub state: SandboxState,
    pub started_at: OffsetDateTime,
    pub end_at: OffsetDateTime,
    /// Running: the build it started from. Paused: the build its pause produced.
    pub build: BuildInfo,
    pub guest_ip: Option<IpAddr>,
    pub envd_version: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
    pub metadata: StringMap,
    pub env_vars: StringMap,
    /// The timeout the sandbox was created with, in seconds.
    pub timeout_secs: u64,
    pub auto_pause: bool,
    pub auto_pause_memory: bool,
    pub auto_resume: bool,
    pub allow_internet_access: Option<bool>,
    pub network: NetworkConfig,
    pub envd_access_token: String,
    pub traffic_access_token: Option<String>,
    pub volume_mounts: Vec<VolumeMount>,
    /// Bucket prefixes it mounts (`vmonS3Mounts`; secrets by name only).
    pub s3_mounts: Vec<crate::model::S3Mount>,
    /// A build made for this sandbox alone (its pauses, or the fork point it started from):
    /// deleted when superseded or when the sandbox dies. Never a template's build.
    pub owned_build: Option<String>,
    /// Idle auto-suspend, resolved at create (`None`: off).
    pub idle: Option<IdlePolicy>,
    /// Set while paused by its idle policy: when the suspended sandbox ends.
    pub idle_suspended_until: Option<OffsetDateTime>,
    /// How its resumes went (`GET /sandboxes/{id}/health`).
    pub resumes: ResumeHealth,
    /// GPUs passed through to it, resolved at create (`control/gpus.rs`); 0: none.
    pub gpus: u32,
}

/// Seed 004's IdlePolicy as a sandbox keeps it: suspended (a memory pause) after
/// `max_idle_secs` without traffic through the proxy, resumed by traffic when `auto_resume`,
/// ended `suspended_secs` after the suspend (0: ended instead of suspended).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct IdlePolicy {
    pub max_idle_secs: u64,
    pub auto_resume: bool,
    pub suspended_secs: u64,
}

/// A sandbox's resumes: how many restored its memory, and how the last one went.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct ResumeHealth {
    /// Resumes that kept memory (restored or parked).
    pub generation: u32,
    pub last: Option<LastResume>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LastResume {
    /// `restore`, `parked` or `cold_boot` ([`vmon_proto::node::StartKind`]).
    pub kind: String,
    /// From the node call to its answer (envd `/init` done).
    pub duration_ms: u64,
    pub at: OffsetDateTime,
    /// What resumed it: `connect`, `traffic`.
    pub trigger: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum EventKind {
    Created,
    Killed,
    Updated,
    Paused,
    Resumed,
    Checkpointed,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Created => "sandbox.lifecycle.created",
            EventKind::Killed => "sandbox.lifecycle.killed",
            EventKind::Updated => "sandbox.lifecycle.updated",
            EventKind::Paused => "sandbox.lifecycle.paused",
            EventKind::Resumed => "sandbox.lifecycle.resumed",
            EventKind::Checkpointed => "sandbox.lifecycle.checkpointed",
        }
    }
}

/// A lifecycle event, written with the change it reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LifecycleEvent {
    pub kind: EventKind,
    pub sandbox_id: String,
    pub execution_id: String,
    pub team_id: String,
    pub template_id: String,
    pub build_id: String,
    pub data: serde_json::Value,
    pub at: OffsetDateTime,
}

/// One change of a sandbox record. Every variant but [`Change::Insert`] names the execution it
/// expects to find: a record that has moved on (another execution, or written under a newer
/// lock fence) is left alone and the commit reports it stale.
#[derive(Debug, Clone)]
pub enum Change {
    /// A new sandbox.
    Insert(Box<SandboxRecord>),
    /// Replace the record of `expected_execution_id` (a resume moves it to a new execution).
    Update {
        record: Box<SandboxRecord>,
        expected_execution_id: String,
    },
    /// The sandbox is gone.
    Delete {
        sandbox_id: String,
        execution_id: String,
    },
    /// A checkpoint: the event, and the template it produced (a snapshot); the record must
    /// still be this running execution.
    Checkpoint {
        sandbox_id: String,
        execution_id: String,
        template: Option<Box<TemplateRecord>>,
    },
}

impl Change {
    pub fn update(record: &SandboxRecord, expected_execution_id: &str) -> Change {
        Change::Update {
            record: Box::new(record.clone()),
            expected_execution_id: expected_execution_id.to_string(),
        }
    }
}

/// How a commit ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    Done,
    /// Nothing written: the record is another execution or a newer fence wrote it.
    Stale,
}

#[async_trait::async_trait]
pub trait Records: BuildRecords + Send + Sync + 'static {
    async fn team_by_key_hash(&self, key_hash: &str) -> RecordResult<Option<Team>>;
    async fn team(&self, team_id: &str) -> RecordResult<Option<Team>>;
    async fn teams(&self) -> RecordResult<Vec<Team>>;
    /// Creates the team, or replaces the limits of an existing one.
    async fn put_team(&self, team: Team) -> RecordResult<()>;
    /// Keeps the hash of `raw_key`; the plaintext is the caller's to show once.
    async fn add_key(&self, team_id: &str, raw_key: &str) -> RecordResult<ApiKeyInfo>;
    async fn keys(&self, team_id: Option<&str>) -> RecordResult<Vec<ApiKeyInfo>>;
    /// `false` when no such unrevoked key exists.
    async fn revoke_key(&self, key_id: &str) -> RecordResult<bool>;

    async fn template_by_id(&self, id: &str) -> RecordResult<Option<TemplateRecord>>;
    /// The team's template with that alias, else a shared one.
    async fn template_by_alias(
        &self,
        team_id: &str,
        alias: &str,
    ) -> RecordResult<Option<TemplateRecord>>;
    async fn put_template(&self, template: TemplateRecord) -> RecordResult<()>;
    async fn delete_template(&self, id: &str) -> RecordResult<bool>;
    /// The team's templates of the snapshot kind, newest first.
    async fn snapshots(&self, team_id: &str) -> RecordResult<Vec<TemplateRecord>>;

    async fn sandbox(&self, id: &str) -> RecordResult<Option<SandboxRecord>>;
    /// Every team's sandboxes when `team_id` is `None`.
    async fn sandboxes(&self, team_id: Option<&str>) -> RecordResult<Vec<SandboxRecord>>;
    /// One page of a team's sandboxes, filtered, ordered and paged by the store itself.
    async fn sandbox_page(&self, q: &SandboxListing) -> RecordResult<SandboxPage>;
    /// Running sandboxes whose end time is not after `now` (the reaper's work).
    async fn expired_sandboxes(&self, now: OffsetDateTime) -> RecordResult<Vec<SandboxRecord>>;
    /// Applies a change and records its event (and the event's webhook deliveries),
    /// atomically, if `fence` (the sandbox lock's token) is not older than the record's.
    async fn commit(
        &self,
        change: Change,
        event: LifecycleEvent,
        fence: i64,
    ) -> RecordResult<Committed>;

    async fn events(&self, query: &EventQuery) -> RecordResult<Vec<Event>>;
    /// Deletes events (and delivery attempts) past their retention; returns how many events.
    async fn run_retention(&self, now: OffsetDateTime) -> RecordResult<u64>;

    async fn create_webhook(&self, new: &NewWebhook) -> RecordResult<Webhook>;
    async fn webhook(&self, team_id: &str, id: &str) -> RecordResult<Option<Webhook>>;
    async fn webhooks(&self, team_id: &str) -> RecordResult<Vec<Webhook>>;
    async fn update_webhook(
        &self,
        team_id: &str,
        id: &str,
        patch: &WebhookPatch,
    ) -> RecordResult<Option<Webhook>>;
    async fn delete_webhook(&self, team_id: &str, id: &str) -> RecordResult<bool>;
    /// For the dispatcher only: never put it in a response.
    async fn webhook_secret(&self, id: &str) -> RecordResult<Option<String>>;
    async fn deliveries(
        &self,
        webhook_id: &str,
        limit: i64,
        offset: i64,
    ) -> RecordResult<Vec<Delivery>>;
    async fn webhook_stats(&self, webhook_id: &str) -> RecordResult<WebhookStats>;
    async fn record_delivery(&self, attempt: &DeliveryAttempt) -> RecordResult<()>;
    /// Claims pending deliveries as leader `epoch`; `Ok(None)` when a newer epoch holds the
    /// outbox (this leader is deposed).
    async fn claim_outbox(
        &self,
        dispatcher: &str,
        epoch: i64,
        limit: i64,
        visibility: Duration,
    ) -> RecordResult<Option<Vec<OutboxItem>>>;
    async fn complete_outbox(&self, epoch: i64, seq: i64) -> RecordResult<bool>;

    /// `None` when the team already has a volume of that name.
    async fn create_volume(&self, new: &NewVolume) -> RecordResult<Option<Volume>>;
    async fn volume(&self, team_id: &str, id: &str) -> RecordResult<Option<Volume>>;
    /// Any team's (the content plane checks the token's team itself).
    async fn volume_by_id(&self, id: &str) -> RecordResult<Option<Volume>>;
    async fn volume_by_name(&self, team_id: &str, name: &str) -> RecordResult<Option<Volume>>;
    async fn volumes(&self, team_id: &str) -> RecordResult<Vec<Volume>>;
    async fn delete_volume(&self, team_id: &str, id: &str) -> RecordResult<bool>;

    /// `None` when the team already has a secret of that name.
    async fn create_secret(&self, new: &NewSecret) -> RecordResult<Option<Secret>>;
    /// By id or (any case) name.
    async fn secret(&self, team_id: &str, id_or_name: &str) -> RecordResult<Option<Secret>>;
    /// Up to `limit` after the secret with id `after`, oldest first.
    async fn secrets(
        &self,
        team_id: &str,
        limit: i64,
        after: Option<&str>,
    ) -> RecordResult<Vec<Secret>>;
    async fn count_secrets(&self, team_id: &str) -> RecordResult<i64>;
    async fn update_secret(
        &self,
        team_id: &str,
        id_or_name: &str,
        value: &str,
        metadata: Option<&std::collections::BTreeMap<String, String>>,
    ) -> RecordResult<Option<Secret>>;
    async fn delete_secret(&self, team_id: &str, id_or_name: &str) -> RecordResult<bool>;
    /// The decrypted value of the secret with id `id`, for the egress path only: it goes to
    /// the node that runs a sandbox whose rules name it, never to a client.
    async fn secret_value(&self, team_id: &str, id: &str) -> RecordResult<Option<String>>;
}
