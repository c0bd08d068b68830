//! Template builds of the Template SDK as the api keeps them: the build's state, its log
//! entries in order, and the team's layer cache. [`BuildRecords`] is the port; the store keeps
//! each as JSON beside the columns it selects on.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use vmon_proto::node::BuildInfo;
use vmon_store::TemplateBuildDoc;

use super::{RecordResult, StoreRecords};

/// Where a template build is (the SDK's `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildState {
    /// Requested; its files may be uploading, the trigger has not come.
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildState {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildState::Waiting => "waiting",
            BuildState::Building => "building",
            BuildState::Ready => "ready",
            BuildState::Error => "error",
        }
    }
}

/// Why a build failed: the message the SDK raises, and the step (`"base"`, `"finalize"` or
/// the 1-based step number).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BuildFailure {
    pub message: String,
    pub step: Option<String>,
}

/// One template build.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateBuild {
    pub build_id: String,
    pub template_id: String,
    pub team_id: String,
    pub state: BuildState,
    /// The tags the build's result gets (`default` unless the request named others).
    pub tags: Vec<String>,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
    /// The trigger's body (steps, base, start and ready commands), once it came.
    pub start: Option<serde_json::Value>,
    pub failure: Option<BuildFailure>,
    /// The node build the template starts from, once ready.
    pub result: Option<BuildInfo>,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option", default)]
    pub finished_at: Option<OffsetDateTime>,
}

/// One line of a build's log.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BuildLogEntry {
    #[serde(with = "time::serde::rfc3339")]
    pub timestamp: OffsetDateTime,
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub step: Option<String>,
}

#[async_trait::async_trait]
pub trait BuildRecords: Send + Sync + 'static {
    async fn put_template_build(&self, build: &TemplateBuild) -> RecordResult<()>;
    async fn template_build(&self, build_id: &str) -> RecordResult<Option<TemplateBuild>>;
    /// Builds in these states, oldest first (a restart ends the unfinished ones).
    async fn template_builds_in(&self, states: &[BuildState]) -> RecordResult<Vec<TemplateBuild>>;
    /// A template's builds, newest first.
    async fn template_builds_of(&self, template_id: &str) -> RecordResult<Vec<TemplateBuild>>;
    async fn delete_template_builds(&self, template_id: &str) -> RecordResult<()>;
    async fn append_build_logs(
        &self,
        build_id: &str,
        entries: &[BuildLogEntry],
    ) -> RecordResult<()>;
    async fn build_logs(
        &self,
        build_id: &str,
        offset: i64,
        limit: i64,
    ) -> RecordResult<Vec<BuildLogEntry>>;
    /// The team's cached layer under `key` (marked used).
    async fn layer(&self, team_id: &str, key: &str) -> RecordResult<Option<BuildInfo>>;
    async fn put_layer(&self, team_id: &str, key: &str, build: &BuildInfo) -> RecordResult<()>;
    /// Layers unused since `before`: `(team, key, build)`.
    async fn stale_layers(
        &self,
        before: OffsetDateTime,
    ) -> RecordResult<Vec<(String, String, BuildInfo)>>;
    async fn delete_layer(&self, team_id: &str, key: &str) -> RecordResult<()>;
    /// Every cached layer of every team: `(team, key, build)`.
    async fn layers(&self) -> RecordResult<Vec<(String, String, BuildInfo)>>;
    /// The team's templates and snapshots, and the shared ones.
    async fn templates_of(&self, team_id: &str) -> RecordResult<Vec<super::TemplateRecord>>;
    /// Whether a stored name (`slug/alias`, or a shared alias) is taken.
    async fn alias_in_use(&self, stored_alias: &str) -> RecordResult<bool>;
    /// Whether a template (or snapshot) has ever pointed a tag at this build.
    async fn is_template_build(&self, build_id: &str) -> RecordResult<bool>;
}

fn build_of(d: TemplateBuildDoc) -> RecordResult<TemplateBuild> {
    Ok(serde_json::from_str(&d.doc)?)
}

#[async_trait::async_trait]
impl BuildRecords for StoreRecords {
    async fn put_template_build(&self, b: &TemplateBuild) -> RecordResult<()> {
        self.within(async {
            let doc = TemplateBuildDoc {
                id: b.build_id.clone(),
                template_id: b.template_id.clone(),
                team_id: b.team_id.clone(),
                status: b.state.as_str().to_string(),
                doc: serde_json::to_string(b)?,
            };
            Ok(self.store().put_template_build(&doc).await?)
        })
        .await
    }

    async fn template_build(&self, build_id: &str) -> RecordResult<Option<TemplateBuild>> {
        self.within(async {
            self.store()
                .template_build(build_id)
                .await?
                .map(build_of)
                .transpose()
        })
        .await
    }

    async fn template_builds_in(&self, states: &[BuildState]) -> RecordResult<Vec<TemplateBuild>> {
        self.within(async {
            let names: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
            self.store()
                .template_builds_in(&names)
                .await?
                .into_iter()
                .map(build_of)
                .collect()
        })
        .await
    }

    async fn template_builds_of(&self, template_id: &str) -> RecordResult<Vec<TemplateBuild>> {
        self.within(async {
            self.store()
                .template_builds_of(template_id)
                .await?
                .into_iter()
                .map(build_of)
                .collect()
        })
        .await
    }

    async fn delete_template_builds(&self, template_id: &str) -> RecordResult<()> {
        self.within(async { Ok(self.store().delete_template_builds(template_id).await?) })
            .await
    }

    async fn append_build_logs(
        &self,
        build_id: &str,
        entries: &[BuildLogEntry],
    ) -> RecordResult<()> {
        self.within(async {
            let docs = entries
                .iter()
                .map(serde_json::to_string)
                .collect::<Result<Vec<_>, _>>()?;
            Ok(self
                .store()
                .append_template_build_logs(build_id, &docs)
                .await?)
        })
        .await
    }

    async fn build_logs(
        &self,
        build_id: &str,
        offset: i64,
        limit: i64,
    ) -> RecordResult<Vec<BuildLogEntry>> {
        self.within(async {
            self.store()
                .template_build_logs(build_id, offset, limit)
                .await?
                .iter()
                .map(|d| Ok(serde_json::from_str::<BuildLogEntry>(d)?))
                .collect()
        })
        .await
    }

    async fn layer(&self, team_id: &str, key: &str) -> RecordResult<Option<BuildInfo>> {
        self.within(async {
            match self.store().template_layer(team_id, key).await? {
                Some(d) => Ok(Some(serde_json::from_str::<BuildInfo>(&d)?)),
                None => Ok(None),
            }
        })
        .await
    }

    async fn put_layer(&self, team_id: &str, key: &str, build: &BuildInfo) -> RecordResult<()> {
        self.within(async {
            Ok(self
                .store()
                .put_template_layer(team_id, key, &serde_json::to_string(build)?)
                .await?)
        })
        .await
    }

    async fn stale_layers(
        &self,
        before: OffsetDateTime,
    ) -> RecordResult<Vec<(String, String, BuildInfo)>> {
        self.within(async {
            let ms = (before.unix_timestamp_nanos() / 1_000_000) as i64;
            self.store()
                .stale_template_layers(ms)
                .await?
                .into_iter()
                .map(|(t, k, d)| Ok((t, k, serde_json::from_str(&d)?)))
                .collect()
        })
        .await
    }

    async fn layers(&self) -> RecordResult<Vec<(String, String, BuildInfo)>> {
        self.within(async {
            // Every layer was last used before the end of time.
            self.store()
                .stale_template_layers(i64::MAX)
                .await?
                .into_iter()
                .map(|(t, k, d)| Ok((t, k, serde_json::from_str(&d)?)))
                .collect()
        })
        .await
    }

    async fn delete_layer(&self, team_id: &str, key: &str) -> RecordResult<()> {
        self.within(async { Ok(self.store().delete_template_layer(team_id, key).await?) })
            .await
    }

    async fn templates_of(&self, team_id: &str) -> RecordResult<Vec<super::TemplateRecord>> {
        self.within(async {
            let mut out = Vec::new();
            for t in self.store().templates(team_id, true).await? {
                if let Some(r) = self.load_template(t).await? {
                    out.push(r);
                }
            }
            Ok(out)
        })
        .await
    }

    async fn is_template_build(&self, build_id: &str) -> RecordResult<bool> {
        self.within(async { Ok(self.store().build(build_id).await?.is_some()) })
            .await
    }

    async fn alias_in_use(&self, stored_alias: &str) -> RecordResult<bool> {
        self.within(async {
            Ok(self
                .store()
                .template_by_alias(stored_alias)
                .await?
                .is_some())
        })
        .await
    }
}
