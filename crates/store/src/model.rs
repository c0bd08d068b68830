//! The record types. Times are `OffsetDateTime` (stored as Unix milliseconds, so sub-millisecond
//! precision is dropped); JSON blobs the API owns are `serde_json::Value`.

use std::collections::BTreeMap;

use serde_json::Value;
use time::OffsetDateTime;

use crate::StoreError;

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name { $($variant),+ }

        impl $name {
            /// The stored (and wire) spelling.
            pub fn as_str(&self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl std::str::FromStr for $name {
            type Err = StoreError;
            fn from_str(s: &str) -> Result<Self, StoreError> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(StoreError::Malformed(format!("{} {other:?}", stringify!($name)))),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// A team's limits, enforced by the API (concurrency through `vmon-kv` admission).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TeamLimits {
    pub max_concurrent_sandboxes: i64,
    pub max_vcpus: i64,
    pub max_memory_mb: i64,
    pub max_disk_mb: i64,
    pub max_lifetime_secs: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Team {
    pub id: String,
    pub name: String,
    /// The namespace of the team's template and snapshot names.
    pub slug: String,
    pub limits: TeamLimits,
    pub created_at: OffsetDateTime,
}

#[derive(Clone, Debug)]
pub struct NewTeam {
    pub id: String,
    pub name: String,
    pub slug: String,
    pub limits: TeamLimits,
}

/// An API key. The raw key is never stored; only its SHA-256.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiKey {
    pub id: String,
    pub team_id: String,
    pub name: String,
    /// A displayable hint: the first 6 and last 4 characters of the raw key.
    pub mask: String,
    pub created_at: OffsetDateTime,
    pub last_used_at: Option<OffsetDateTime>,
    pub revoked_at: Option<OffsetDateTime>,
}

string_enum! {
    /// What a template row is.
    TemplateKind { Template = "template", Snapshot = "snapshot", ForkHidden = "fork-hidden" }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    pub id: String,
    /// `None` for templates every team may use (e.g. `base`).
    pub team_id: Option<String>,
    pub kind: TemplateKind,
    /// The sandbox a snapshot or fork template was captured from.
    pub source_sandbox_id: Option<String>,
    pub public: bool,
    /// Names without tag: `base`, `team-slug/my-snapshot`.
    pub aliases: Vec<String>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

#[derive(Clone, Debug)]
pub struct NewTemplate {
    pub id: String,
    pub team_id: Option<String>,
    pub kind: TemplateKind,
    pub source_sandbox_id: Option<String>,
    pub public: bool,
}

string_enum! {
    BuildStatus { Building = "building", Ready = "ready", Failed = "failed" }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Build {
    pub id: String,
    pub template_id: String,
    pub status: BuildStatus,
    pub vcpus: i64,
    pub memory_mb: i64,
    pub disk_mb: i64,
    pub envd_version: String,
    /// The node holding the build's layers.
    pub node_id: Option<String>,
    /// Whether the build holds guest memory (a restore), or only a disk (a cold boot).
    pub has_memory: bool,
    /// The build this one was captured on top of (its layers chain onto the parent's).
    pub parent_build_id: Option<String>,
    pub created_at: OffsetDateTime,
    pub finished_at: Option<OffsetDateTime>,
}

#[derive(Clone, Debug)]
pub struct NewBuild {
    pub id: String,
    pub template_id: String,
    pub status: BuildStatus,
    pub vcpus: i64,
    pub memory_mb: i64,
    pub disk_mb: i64,
    pub envd_version: String,
    pub node_id: Option<String>,
    pub has_memory: bool,
    pub parent_build_id: Option<String>,
}

/// A template reference resolved to the build a create should start from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedTemplate {
    pub template: Template,
    pub build: Build,
    pub tag: String,
}

/// A snapshot as listed: a template of kind `snapshot`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// `<slug>/<alias>:<tag>` for named snapshots, else `<templateID>:default`.
    pub snapshot_id: String,
    /// Full names, `<slug>/<alias>:<tag>`.
    pub names: Vec<String>,
    pub template_id: String,
    pub source_sandbox_id: Option<String>,
    pub created_at: OffsetDateTime,
}

#[derive(Clone, Debug, Default)]
pub struct SnapshotQuery {
    pub team_id: String,
    pub sandbox_id: Option<String>,
    /// A full name or alias (`slug/alias` or `slug/alias:tag`).
    pub name: Option<String>,
    pub limit: i64,
    pub cursor: Option<String>,
}

string_enum! {
    /// The sandbox state machine (DESIGN §6). Killed sandboxes have no record.
    SandboxState {
        Running = "running",
        Pausing = "pausing",
        Paused = "paused",
        Resuming = "resuming",
        Snapshotting = "snapshotting",
        Killing = "killing",
    }
}

string_enum! {
    PauseMode { Full = "full", Filesystem = "filesystem" }
}

/// One sandbox, running or paused, in one execution.
#[derive(Clone, Debug, PartialEq)]
pub struct SandboxRecord {
    pub sandbox_id: String,
    pub team_id: String,
    /// New on every create and resume: a stale operation never touches a newer execution.
    pub execution_id: String,
    pub template_id: String,
    pub build_id: String,
    /// The build holding the paused state, while paused.
    pub paused_build_id: Option<String>,
    pub alias: Option<String>,
    pub state: SandboxState,
    pub node_id: Option<String>,
    pub pause_mode: Option<PauseMode>,
    pub vcpus: i64,
    pub memory_mb: i64,
    pub disk_mb: i64,
    pub envd_version: String,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// `SandboxNetworkConfig` as the API received it.
    pub network: Option<Value>,
    pub auto_pause: bool,
    pub auto_pause_memory: bool,
    pub auto_resume: bool,
    /// The create timeout, seconds (traffic-triggered resumes reuse it).
    pub timeout_secs: i64,
    pub started_at: OffsetDateTime,
    pub end_at: OffsetDateTime,
    pub envd_access_token: Option<String>,
    pub traffic_access_token: Option<String>,
    /// Fields the API owns and the store does not interpret (volume mounts, flags).
    pub extra: Value,
    /// The largest lock fencing token that wrote this record; read-only.
    pub fence: i64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Order {
    Asc,
    #[default]
    Desc,
}

/// `GET /v2/sandboxes` filters.
#[derive(Clone, Debug, Default)]
pub struct SandboxQuery {
    pub team_id: String,
    /// Empty: every state.
    pub states: Vec<SandboxState>,
    /// Every pair must match.
    pub metadata: Vec<(String, String)>,
    /// The template's id or the alias the sandbox was created with.
    pub template_id: Option<String>,
    pub started_after: Option<OffsetDateTime>,
    /// By start time (then id).
    pub order: Order,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
    /// Page size (1..=1000; 0 means 100).
    pub limit: i64,
}

/// One page of a listing.
#[derive(Clone, Debug, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// Pass back as `cursor` for the next page; `None` on the last page.
    pub next_cursor: Option<String>,
}

/// Event types (E2B's names).
pub mod event_types {
    pub const CREATED: &str = "sandbox.lifecycle.created";
    pub const KILLED: &str = "sandbox.lifecycle.killed";
    pub const UPDATED: &str = "sandbox.lifecycle.updated";
    pub const PAUSED: &str = "sandbox.lifecycle.paused";
    pub const RESUMED: &str = "sandbox.lifecycle.resumed";
    pub const CHECKPOINTED: &str = "sandbox.lifecycle.checkpointed";
    pub const ALL: [&str; 6] = [CREATED, KILLED, UPDATED, PAUSED, RESUMED, CHECKPOINTED];
}

/// A lifecycle event to append.
#[derive(Clone, Debug)]
pub struct NewEvent {
    pub event_type: String,
    pub event_data: Option<Value>,
    pub sandbox_id: String,
    pub execution_id: String,
    pub build_id: String,
    pub team_id: String,
    pub template_id: String,
    pub timestamp: OffsetDateTime,
}

/// A stored lifecycle event.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub id: uuid::Uuid,
    /// Append order.
    pub seq: i64,
    pub event_type: String,
    pub event_data: Option<Value>,
    pub sandbox_id: String,
    pub execution_id: String,
    pub build_id: String,
    pub team_id: String,
    pub template_id: String,
    pub timestamp: OffsetDateTime,
}

/// `GET /events/sandboxes[/{id}]`.
#[derive(Clone, Debug, Default)]
pub struct EventQuery {
    pub team_id: String,
    pub sandbox_id: Option<String>,
    /// Empty: every type.
    pub types: Vec<String>,
    pub offset: i64,
    /// 1..=100 by the API; the store caps at 1000.
    pub limit: i64,
    pub order_asc: bool,
}

/// A webhook as returned to clients: never its secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Webhook {
    pub id: String,
    pub team_id: String,
    pub name: String,
    pub url: String,
    pub enabled: bool,
    pub events: Vec<String>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

#[derive(Clone)]
pub struct NewWebhook {
    pub id: String,
    pub team_id: String,
    pub name: String,
    pub url: String,
    pub enabled: bool,
    pub events: Vec<String>,
    pub signature_secret: String,
}

impl std::fmt::Debug for NewWebhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewWebhook")
            .field("id", &self.id)
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// `PATCH /events/webhooks/{id}`: `None` leaves a field unchanged.
#[derive(Clone, Default)]
pub struct WebhookPatch {
    pub name: Option<String>,
    pub url: Option<String>,
    pub enabled: Option<bool>,
    pub events: Option<Vec<String>>,
    pub signature_secret: Option<String>,
}

/// One delivery attempt, as the dispatcher records it.
#[derive(Clone, Debug)]
pub struct DeliveryAttempt {
    pub webhook_id: String,
    pub event_id: uuid::Uuid,
    /// Shared by the attempts of one event (the `e2b-delivery-id` header).
    pub delivery_id: String,
    /// 1-based.
    pub attempt: i64,
    pub status_code: Option<i64>,
    pub success: bool,
    pub duration_ms: i64,
    pub error: Option<String>,
    pub at: OffsetDateTime,
}

/// A recorded attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub id: String,
    pub webhook_id: String,
    pub event_id: uuid::Uuid,
    pub delivery_id: String,
    pub attempt: i64,
    pub status_code: Option<i64>,
    pub success: bool,
    pub duration_ms: i64,
    pub error: Option<String>,
    pub created_at: OffsetDateTime,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WebhookStats {
    pub attempts: i64,
    pub successes: i64,
    pub failures: i64,
    pub average_duration_ms: i64,
    pub last_attempt_at: Option<OffsetDateTime>,
    pub last_success_at: Option<OffsetDateTime>,
    pub last_failure_at: Option<OffsetDateTime>,
    /// Events waiting in the outbox for this webhook.
    pub pending: i64,
}

/// An event waiting to be delivered to one webhook, claimed by one dispatcher.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxItem {
    pub seq: i64,
    pub webhook_id: String,
    pub delivery_id: String,
    pub event: Event,
}

/// A named persistent volume of a team. Its files are not in the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Volume {
    pub id: String,
    pub team_id: String,
    pub name: String,
    pub created_at: OffsetDateTime,
}

#[derive(Clone, Debug)]
pub struct NewVolume {
    pub id: String,
    pub team_id: String,
    pub name: String,
}

/// A team secret as returned to clients: never its value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Secret {
    pub id: String,
    pub team_id: String,
    /// Lower-cased.
    pub name: String,
    /// 1 at creation, +1 on every update.
    pub version: i64,
    pub metadata: BTreeMap<String, String>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

#[derive(Clone)]
pub struct NewSecret {
    pub id: String,
    pub team_id: String,
    pub name: String,
    pub value: String,
    pub metadata: BTreeMap<String, String>,
}
