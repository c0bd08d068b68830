//! What the api keeps durably, as the narrow port it needs from a store: teams and keys,
//! templates (snapshots are templates too), and sandbox records.
//!
//! Every change of a sandbox record goes through [`Records::commit`] together with the
//! lifecycle event that reports it, so a store can write both in one transaction.
//! [`MemoryRecords`] is the in-process implementation (tests, and `vmon up` until the SQL
//! store is wired in).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use vmon_proto::node::BuildInfo;

use crate::wire::{NetworkConfig, StringMap, VolumeMount};

pub type RecordResult<T> = anyhow::Result<T>;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
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
pub struct Team {
    pub id: String,
    pub name: String,
    /// Namespace of the team's snapshot names.
    pub slug: String,
    pub limits: TeamLimits,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ApiKeyInfo {
    pub id: String,
    pub team_id: String,
    /// The first characters of the key, to recognise it in a list.
    pub mask: String,
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
    /// A build made for this sandbox alone (its pauses, or the fork point it started from):
    /// deleted when superseded or when the sandbox dies. Never a template's build.
    pub owned_build: Option<String>,
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

/// One change of a sandbox record.
#[derive(Debug, Clone)]
pub enum Change {
    /// Insert or replace the record.
    Put(Box<SandboxRecord>),
    /// The sandbox is gone.
    Delete { team_id: String, sandbox_id: String },
    /// Only an event (a checkpoint leaves the record as it is).
    None,
}

#[async_trait::async_trait]
pub trait Records: Send + Sync + 'static {
    async fn team_by_key_hash(&self, key_hash: &str) -> RecordResult<Option<Team>>;
    async fn team(&self, team_id: &str) -> RecordResult<Option<Team>>;
    async fn teams(&self) -> RecordResult<Vec<Team>>;
    async fn put_team(&self, team: Team) -> RecordResult<()>;
    async fn add_key(&self, team_id: &str, key_hash: &str, mask: &str) -> RecordResult<ApiKeyInfo>;
    async fn keys(&self, team_id: Option<&str>) -> RecordResult<Vec<ApiKeyInfo>>;
    /// `false` when no such key exists.
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
    /// The team's templates of the snapshot kind.
    async fn snapshots(&self, team_id: &str) -> RecordResult<Vec<TemplateRecord>>;

    async fn sandbox(&self, id: &str) -> RecordResult<Option<SandboxRecord>>;
    /// Every team's sandboxes when `team_id` is `None`.
    async fn sandboxes(&self, team_id: Option<&str>) -> RecordResult<Vec<SandboxRecord>>;
    /// Apply a change and record its event, atomically.
    async fn commit(&self, change: Change, event: LifecycleEvent) -> RecordResult<()>;
}

/// Records in memory, optionally saved to a JSON file after every change (the interim
/// durable store of `vmon up` until the SQL store is wired in). Events stay in memory only.
#[derive(Default)]
pub struct MemoryRecords {
    inner: Mutex<Memory>,
    file: Option<std::path::PathBuf>,
}

#[derive(Default, Serialize, Deserialize)]
struct Memory {
    teams: HashMap<String, Team>,
    keys: HashMap<String, (String, ApiKeyInfo)>,
    templates: HashMap<String, TemplateRecord>,
    sandboxes: HashMap<String, SandboxRecord>,
    #[serde(skip)]
    events: Vec<LifecycleEvent>,
}

/// Events kept in memory at most.
const MEMORY_EVENTS: usize = 10_000;

impl MemoryRecords {
    pub fn new() -> Self {
        Self::default()
    }

    /// Loads `file` if it exists and saves every change to it.
    pub fn persistent(file: std::path::PathBuf) -> anyhow::Result<Self> {
        let memory = match std::fs::read(&file) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Memory::default(),
            Err(e) => return Err(anyhow::anyhow!("{}: {e}", file.display())),
        };
        Ok(Self {
            inner: Mutex::new(memory),
            file: Some(file),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the state (under the lock, so saves never interleave): temp file, fsync, rename.
    fn save(&self, m: &Memory) -> RecordResult<()> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        use std::io::Write;
        let tmp = file.with_extension("tmp");
        let bytes = serde_json::to_vec(m)?;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, file)?;
        Ok(())
    }

    /// Every event committed so far, oldest first.
    pub fn events(&self) -> Vec<LifecycleEvent> {
        self.lock().events.clone()
    }
}

#[async_trait::async_trait]
impl Records for MemoryRecords {
    async fn team_by_key_hash(&self, key_hash: &str) -> RecordResult<Option<Team>> {
        let m = self.lock();
        Ok(m.keys
            .values()
            .find(|(h, k)| h == key_hash && !k.revoked)
            .and_then(|(_, k)| m.teams.get(&k.team_id).cloned()))
    }
    async fn team(&self, team_id: &str) -> RecordResult<Option<Team>> {
        Ok(self.lock().teams.get(team_id).cloned())
    }
    async fn teams(&self) -> RecordResult<Vec<Team>> {
        let mut t: Vec<_> = self.lock().teams.values().cloned().collect();
        t.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(t)
    }
    async fn put_team(&self, team: Team) -> RecordResult<()> {
        let mut m = self.lock();
        m.teams.insert(team.id.clone(), team);
        self.save(&m)
    }
    async fn add_key(&self, team_id: &str, key_hash: &str, mask: &str) -> RecordResult<ApiKeyInfo> {
        let info = ApiKeyInfo {
            id: crate::ids::random_lower(12),
            team_id: team_id.to_string(),
            mask: mask.to_string(),
            created_at: OffsetDateTime::now_utc(),
            revoked: false,
        };
        let mut m = self.lock();
        m.keys
            .insert(info.id.clone(), (key_hash.to_string(), info.clone()));
        self.save(&m)?;
        Ok(info)
    }
    async fn keys(&self, team_id: Option<&str>) -> RecordResult<Vec<ApiKeyInfo>> {
        let mut k: Vec<_> = self
            .lock()
            .keys
            .values()
            .filter(|(_, k)| team_id.is_none_or(|t| t == k.team_id))
            .map(|(_, k)| k.clone())
            .collect();
        k.sort_by_key(|k| k.created_at);
        Ok(k)
    }
    async fn revoke_key(&self, key_id: &str) -> RecordResult<bool> {
        let mut m = self.lock();
        let found = match m.keys.get_mut(key_id) {
            Some((_, k)) => {
                k.revoked = true;
                true
            }
            None => false,
        };
        self.save(&m)?;
        Ok(found)
    }

    async fn template_by_id(&self, id: &str) -> RecordResult<Option<TemplateRecord>> {
        Ok(self.lock().templates.get(id).cloned())
    }
    async fn template_by_alias(
        &self,
        team_id: &str,
        alias: &str,
    ) -> RecordResult<Option<TemplateRecord>> {
        let m = self.lock();
        let mut shared = None;
        for t in m.templates.values() {
            if t.alias.as_deref() != Some(alias) {
                continue;
            }
            match t.team_id.as_deref() {
                Some(owner) if owner == team_id => return Ok(Some(t.clone())),
                None => shared = Some(t.clone()),
                Some(_) => {}
            }
        }
        Ok(shared)
    }
    async fn put_template(&self, template: TemplateRecord) -> RecordResult<()> {
        let mut m = self.lock();
        m.templates.insert(template.id.clone(), template);
        self.save(&m)
    }
    async fn delete_template(&self, id: &str) -> RecordResult<bool> {
        let mut m = self.lock();
        let found = m.templates.remove(id).is_some();
        self.save(&m)?;
        Ok(found)
    }
    async fn snapshots(&self, team_id: &str) -> RecordResult<Vec<TemplateRecord>> {
        let mut s: Vec<_> = self
            .lock()
            .templates
            .values()
            .filter(|t| {
                t.team_id.as_deref() == Some(team_id)
                    && matches!(t.kind, TemplateKind::Snapshot { .. })
            })
            .cloned()
            .collect();
        s.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
        Ok(s)
    }

    async fn sandbox(&self, id: &str) -> RecordResult<Option<SandboxRecord>> {
        Ok(self.lock().sandboxes.get(id).cloned())
    }
    async fn sandboxes(&self, team_id: Option<&str>) -> RecordResult<Vec<SandboxRecord>> {
        Ok(self
            .lock()
            .sandboxes
            .values()
            .filter(|s| team_id.is_none_or(|t| t == s.team_id))
            .cloned()
            .collect())
    }
    async fn commit(&self, change: Change, event: LifecycleEvent) -> RecordResult<()> {
        let mut m = self.lock();
        match change {
            Change::Put(r) => {
                m.sandboxes.insert(r.id.clone(), *r);
            }
            Change::Delete { sandbox_id, .. } => {
                m.sandboxes.remove(&sandbox_id);
            }
            Change::None => {}
        }
        if m.events.len() >= MEMORY_EVENTS {
            m.events.drain(..MEMORY_EVENTS / 10);
        }
        m.events.push(event);
        self.save(&m)
    }
}
