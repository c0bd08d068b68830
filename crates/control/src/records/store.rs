//! [`Records`] on `vmon-store`: opening the store and its secret key, and the port's calls
//! as the store's reads and transactions. The records become rows and back in `rows.rs`.
//!
//! What the store does not model lives in the sandbox row's `extra` JSON (the full build the
//! record stands on, the guest address, volume mounts, the build owned by the sandbox). Team
//! snapshot names are stored as `<slug>/<alias>` (the store's alias namespace is global);
//! shared templates keep their bare alias.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use time::OffsetDateTime;
use vmon_store::{NewTeam, SandboxQuery, SnapshotQuery, Store, StoreConfig, StoreError};

use super::rows::{
    build_info, event_to_store, from_store, key_from_store, limits_to_store, stored_alias,
    team_from_store, to_store, write_template,
};
use super::*;

/// The records of the control plane in a [`vmon_store::Store`].
#[derive(Clone)]
pub struct StoreRecords {
    store: Store,
}

/// Where the webhook secret key lives when the config names no file.
pub const WEBHOOK_KEY_FILE: &str = "webhook-key";
/// The SQLite file of `vmon up`.
pub const SQLITE_FILE: &str = "vmon.db";

impl StoreRecords {
    pub fn new(store: Store) -> StoreRecords {
        StoreRecords { store }
    }

    /// Opens the store the config names (`store_url`, PostgreSQL for clusters), else SQLite in
    /// the data dir. The webhook secret key comes from `webhook_key_file` or
    /// `<data dir>/webhook-key`, created (0600) on first start.
    pub async fn open(
        config: &crate::config::Config,
        data_dir: &Path,
    ) -> anyhow::Result<StoreRecords> {
        let key_file = config
            .webhook_key_file
            .clone()
            .unwrap_or_else(|| data_dir.join(WEBHOOK_KEY_FILE));
        let key = secret_key(&key_file)?;
        let store_config = match &config.store_url {
            Some(url) => StoreConfig::postgres(url.clone(), key),
            None => StoreConfig::sqlite(data_dir.join(SQLITE_FILE), key),
        };
        let store = Store::open(&store_config)
            .await
            .with_context(|| format!("opening the store {}", store_config.url))?;
        Ok(StoreRecords { store })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// `call` within [`RECORDS_DEADLINE`] when the records are in PostgreSQL: a query under
    /// way when the link to the database starts dropping packets would otherwise wait for
    /// TCP to give up (many minutes) and hold its caller, a lock and a transition with it.
    /// Past the deadline the call fails as [`StoreError::TimedOut`] (the api's 503); a
    /// commit under way then may or may not have been made, so a retry finds either state.
    pub(super) async fn within<T>(
        &self,
        call: impl std::future::Future<Output = RecordResult<T>>,
    ) -> RecordResult<T> {
        let deadline =
            (self.store.backend() == vmon_store::Backend::Postgres).then_some(RECORDS_DEADLINE);
        within_deadline(deadline, call).await
    }
}

/// `call`, failed as [`StoreError::TimedOut`] when it takes longer than `deadline` (if any).
async fn within_deadline<T>(
    deadline: Option<Duration>,
    call: impl std::future::Future<Output = RecordResult<T>>,
) -> RecordResult<T> {
    let Some(d) = deadline else {
        return call.await;
    };
    match tokio::time::timeout(d, call).await {
        Ok(r) => r,
        Err(_) => Err(StoreError::TimedOut(d).into()),
    }
}

/// How long one call of the records may take on PostgreSQL (queries take milliseconds; the
/// event retention's deletes, the longest, well under a second per batch).
pub const RECORDS_DEADLINE: Duration = Duration::from_secs(20);

/// Reads the 32-byte key (hex) from `path`, creating it with a fresh key, mode 0600, if absent.
pub fn secret_key(path: &Path) -> anyhow::Result<[u8; 32]> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_key(text.trim()).with_context(|| {
            format!(
                "{} must hold 64 hex characters (a 32-byte key)",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            use std::io::Write;
            let key: [u8; 32] = rand::random();
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("creating {}", path.display()))?;
            f.write_all(hex::encode(key).as_bytes())?;
            f.sync_all()?;
            Ok(key)
        }
        Err(e) => Err(anyhow::anyhow!("reading {}: {e}", path.display())),
    }
}

fn parse_key(text: &str) -> Option<[u8; 32]> {
    hex::decode(text).ok()?.try_into().ok()
}

impl StoreRecords {
    /// The store's alias for a template's name (under the team's slug for team templates).
    async fn stored_alias_of(&self, template: &TemplateRecord) -> RecordResult<Option<String>> {
        let slug = match &template.team_id {
            Some(team) => Some(
                self.slug_of(team)
                    .await?
                    .ok_or_else(|| anyhow::anyhow!("team {team} does not exist"))?,
            ),
            None => None,
        };
        Ok(template
            .alias
            .as_deref()
            .map(|a| stored_alias(slug.as_deref(), a)))
    }

    async fn slug_of(&self, team_id: &str) -> RecordResult<Option<String>> {
        Ok(self.store.team(team_id).await?.map(|t| t.slug))
    }

    pub(super) async fn load_template(
        &self,
        t: vmon_store::Template,
    ) -> RecordResult<Option<TemplateRecord>> {
        let kind = match t.kind {
            vmon_store::TemplateKind::Snapshot => TemplateKind::Snapshot {
                source_sandbox_id: t.source_sandbox_id.clone().unwrap_or_default(),
            },
            vmon_store::TemplateKind::Template => TemplateKind::Template,
            // Never written by the api; not a template a create may name.
            vmon_store::TemplateKind::ForkHidden => return Ok(None),
        };
        let tags = self
            .store
            .tagged_builds(&t.id)
            .await?
            .into_iter()
            .map(|(tag, b)| (tag, build_info(b)))
            .collect();
        let alias = t
            .aliases
            .first()
            .map(|a| a.rsplit('/').next().unwrap_or(a).to_string());
        Ok(Some(TemplateRecord {
            id: t.id,
            team_id: t.team_id,
            alias,
            kind,
            tags,
            // Snapshots list newest first by their last new tag.
            created_at: t.updated_at,
        }))
    }

    async fn all_sandboxes(&self, team_id: &str) -> RecordResult<Vec<SandboxRecord>> {
        let mut out = Vec::new();
        let mut cursor = None;
        loop {
            let page = self
                .store
                .sandboxes(&SandboxQuery {
                    team_id: team_id.to_string(),
                    limit: 1000,
                    cursor,
                    ..Default::default()
                })
                .await?;
            out.extend(page.items.into_iter().map(from_store));
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => return Ok(out),
            }
        }
    }
}

#[async_trait::async_trait]
impl Records for StoreRecords {
    async fn team_by_key_hash(&self, key_hash: &str) -> RecordResult<Option<Team>> {
        self.within(async {
            let Some(key) = self.store.api_key_by_hash(key_hash).await? else {
                return Ok(None);
            };
            Ok(self.store.team(&key.team_id).await?.map(team_from_store))
        })
        .await
    }

    async fn team(&self, team_id: &str) -> RecordResult<Option<Team>> {
        self.within(async { Ok(self.store.team(team_id).await?.map(team_from_store)) })
            .await
    }

    async fn teams(&self) -> RecordResult<Vec<Team>> {
        self.within(async {
            let mut t: Vec<Team> = self
                .store
                .teams()
                .await?
                .into_iter()
                .map(team_from_store)
                .collect();
            t.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(t)
        })
        .await
    }

    async fn put_team(&self, team: Team) -> RecordResult<()> {
        self.within(async {
            let limits = limits_to_store(&team.limits);
            if self.store.team(&team.id).await?.is_some() {
                self.store.set_team_limits(&team.id, &limits).await?;
                return Ok(());
            }
            self.store
                .create_team(&NewTeam {
                    id: team.id,
                    name: team.name,
                    slug: team.slug,
                    limits,
                })
                .await?;
            Ok(())
        })
        .await
    }

    async fn add_key(&self, team_id: &str, raw_key: &str) -> RecordResult<ApiKeyInfo> {
        self.within(async {
            let key = self
                .store
                .create_api_key(team_id, "default", raw_key)
                .await?;
            Ok(key_from_store(key))
        })
        .await
    }

    async fn keys(&self, team_id: Option<&str>) -> RecordResult<Vec<ApiKeyInfo>> {
        self.within(async {
            let teams = match team_id {
                Some(t) => vec![t.to_string()],
                None => self
                    .store
                    .teams()
                    .await?
                    .into_iter()
                    .map(|t| t.id)
                    .collect(),
            };
            let mut out = Vec::new();
            for team in teams {
                out.extend(
                    self.store
                        .api_keys(&team)
                        .await?
                        .into_iter()
                        .map(key_from_store),
                );
            }
            out.sort_by_key(|k| k.created_at);
            Ok(out)
        })
        .await
    }

    async fn revoke_key(&self, key_id: &str) -> RecordResult<bool> {
        self.within(async {
            match self.store.api_key(key_id).await? {
                Some(k) => Ok(self.store.revoke_api_key(&k.team_id, key_id).await?),
                None => Ok(false),
            }
        })
        .await
    }

    async fn template_by_id(&self, id: &str) -> RecordResult<Option<TemplateRecord>> {
        self.within(async {
            match self.store.template(id).await? {
                Some(t) => self.load_template(t).await,
                None => Ok(None),
            }
        })
        .await
    }

    async fn template_by_alias(
        &self,
        team_id: &str,
        alias: &str,
    ) -> RecordResult<Option<TemplateRecord>> {
        self.within(async {
            if !team_id.is_empty() {
                if let Some(slug) = self.slug_of(team_id).await? {
                    let owned = self
                        .store
                        .template_by_alias(&stored_alias(Some(&slug), alias))
                        .await?;
                    if let Some(t) = owned.filter(|t| t.team_id.as_deref() == Some(team_id)) {
                        return self.load_template(t).await;
                    }
                }
            }
            match self.store.template_by_alias(alias).await? {
                Some(t) if t.team_id.is_none() => self.load_template(t).await,
                _ => Ok(None),
            }
        })
        .await
    }

    async fn put_template(&self, template: TemplateRecord) -> RecordResult<()> {
        self.within(async {
            let alias = self.stored_alias_of(&template).await?;
            let mut tx = self.store.begin().await?;
            write_template(&mut tx, &template, alias.as_deref()).await?;
            tx.commit().await?;
            Ok(())
        })
        .await
    }

    async fn delete_template(&self, id: &str) -> RecordResult<bool> {
        self.within(async { Ok(self.store.delete_template(id).await?) })
            .await
    }

    async fn snapshots(&self, team_id: &str) -> RecordResult<Vec<TemplateRecord>> {
        self.within(async {
            let mut ids = Vec::new();
            let mut cursor = None;
            loop {
                let page = self
                    .store
                    .snapshots(&SnapshotQuery {
                        team_id: team_id.to_string(),
                        limit: 1000,
                        cursor,
                        ..Default::default()
                    })
                    .await?;
                ids.extend(page.items.into_iter().map(|s| s.template_id));
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if let Some(t) = self.template_by_id(&id).await? {
                    out.push(t);
                }
            }
            out.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
            Ok(out)
        })
        .await
    }

    async fn sandbox(&self, id: &str) -> RecordResult<Option<SandboxRecord>> {
        self.within(async { Ok(self.store.sandbox(id).await?.map(from_store)) })
            .await
    }

    async fn sandboxes(&self, team_id: Option<&str>) -> RecordResult<Vec<SandboxRecord>> {
        self.within(async {
            match team_id {
                Some(t) => self.all_sandboxes(t).await,
                None => {
                    let mut out = Vec::new();
                    for team in self.store.teams().await? {
                        out.extend(self.all_sandboxes(&team.id).await?);
                    }
                    Ok(out)
                }
            }
        })
        .await
    }

    async fn sandbox_page(&self, q: &SandboxListing) -> RecordResult<SandboxPage> {
        let state_of = |s: &SandboxState| match s {
            SandboxState::Paused => vmon_store::SandboxState::Paused,
            SandboxState::Running => vmon_store::SandboxState::Running,
        };
        // The store compares start times in whole milliseconds, exclusively; the listing's bound
        // is inclusive at any precision: after the millisecond before the first one it admits.
        let started_after = q.started_after.map(|t| {
            let ms = t.unix_timestamp_nanos().div_euclid(1_000_000)
                + i128::from(t.unix_timestamp_nanos().rem_euclid(1_000_000) != 0);
            OffsetDateTime::from_unix_timestamp_nanos((ms - 1) * 1_000_000)
                .unwrap_or(OffsetDateTime::UNIX_EPOCH)
        });
        let page = self
            .store
            .sandboxes(&SandboxQuery {
                team_id: q.team_id.clone(),
                states: q.states.iter().map(state_of).collect(),
                metadata: q.metadata.clone(),
                template_id: q.template.clone(),
                started_after,
                order: if q.descending {
                    vmon_store::Order::Desc
                } else {
                    vmon_store::Order::Asc
                },
                cursor: q.cursor.clone(),
                limit: i64::try_from(q.limit).unwrap_or(1000),
            })
            .await?;
        let total_running = self
            .store
            .count_sandboxes(&q.team_id, vmon_store::SandboxState::Running)
            .await?;
        Ok(SandboxPage {
            items: page.items.into_iter().map(from_store).collect(),
            next_cursor: page.next_cursor,
            total_running: u64::try_from(total_running).unwrap_or(0),
        })
    }

    async fn expired_sandboxes(&self, now: OffsetDateTime) -> RecordResult<Vec<SandboxRecord>> {
        self.within(async {
            Ok(self
                .store
                .expired_sandboxes(now, 1000)
                .await?
                .into_iter()
                .map(from_store)
                .collect())
        })
        .await
    }

    async fn commit(
        &self,
        change: Change,
        event: LifecycleEvent,
        fence: i64,
    ) -> RecordResult<Committed> {
        self.within(async {
            // Reads before the transaction: on SQLite it holds the only writer connection.
            let alias = match &change {
                Change::Checkpoint {
                    template: Some(t), ..
                } => self.stored_alias_of(t).await?,
                _ => None,
            };
            let mut tx = self.store.begin().await?;
            let written = match &change {
                Change::Insert(rec) => {
                    tx.insert_sandbox(&to_store(rec, fence)?).await?;
                    true
                }
                Change::Update {
                    record,
                    expected_execution_id,
                } => {
                    tx.update_sandbox(&to_store(record, fence)?, expected_execution_id, fence)
                        .await?
                }
                Change::Delete {
                    sandbox_id,
                    execution_id,
                } => tx.delete_sandbox(sandbox_id, execution_id, fence).await?,
                Change::Checkpoint {
                    sandbox_id,
                    execution_id,
                    template,
                } => {
                    let running = [vmon_store::SandboxState::Running];
                    let current = tx
                        .set_sandbox_state(
                            sandbox_id,
                            execution_id,
                            &running,
                            vmon_store::SandboxState::Running,
                            fence,
                        )
                        .await?;
                    if let (true, Some(t)) = (current, template) {
                        write_template(&mut tx, t, alias.as_deref()).await?;
                    }
                    current
                }
            };
            if !written {
                tx.rollback().await?;
                return Ok(Committed::Stale);
            }
            tx.append_event(&event_to_store(event)).await?;
            tx.commit().await?;
            Ok(Committed::Done)
        })
        .await
    }

    async fn events(&self, query: &EventQuery) -> RecordResult<Vec<Event>> {
        self.within(async { Ok(self.store.events(query).await?) })
            .await
    }

    async fn run_retention(&self, now: OffsetDateTime) -> RecordResult<u64> {
        self.within(async { Ok(self.store.run_retention(now).await?) })
            .await
    }

    async fn create_webhook(&self, new: &NewWebhook) -> RecordResult<Webhook> {
        self.within(async { Ok(self.store.create_webhook(new).await?) })
            .await
    }

    async fn webhook(&self, team_id: &str, id: &str) -> RecordResult<Option<Webhook>> {
        self.within(async { Ok(self.store.webhook(team_id, id).await?) })
            .await
    }

    async fn webhooks(&self, team_id: &str) -> RecordResult<Vec<Webhook>> {
        self.within(async { Ok(self.store.webhooks(team_id).await?) })
            .await
    }

    async fn update_webhook(
        &self,
        team_id: &str,
        id: &str,
        patch: &WebhookPatch,
    ) -> RecordResult<Option<Webhook>> {
        self.within(async { Ok(self.store.update_webhook(team_id, id, patch).await?) })
            .await
    }

    async fn delete_webhook(&self, team_id: &str, id: &str) -> RecordResult<bool> {
        self.within(async { Ok(self.store.delete_webhook(team_id, id).await?) })
            .await
    }

    async fn webhook_secret(&self, id: &str) -> RecordResult<Option<String>> {
        self.within(async { Ok(self.store.webhook_secret(id).await?) })
            .await
    }

    async fn deliveries(
        &self,
        webhook_id: &str,
        limit: i64,
        offset: i64,
    ) -> RecordResult<Vec<Delivery>> {
        self.within(async { Ok(self.store.deliveries(webhook_id, limit, offset).await?) })
            .await
    }

    async fn webhook_stats(&self, webhook_id: &str) -> RecordResult<WebhookStats> {
        self.within(async { Ok(self.store.webhook_stats(webhook_id).await?) })
            .await
    }

    async fn record_delivery(&self, attempt: &DeliveryAttempt) -> RecordResult<()> {
        self.within(async {
            self.store.record_delivery(attempt).await?;
            Ok(())
        })
        .await
    }

    async fn claim_outbox(
        &self,
        dispatcher: &str,
        epoch: i64,
        limit: i64,
        visibility: Duration,
    ) -> RecordResult<Option<Vec<OutboxItem>>> {
        self.within(async {
            match self
                .store
                .claim_outbox(dispatcher, epoch, limit, visibility)
                .await
            {
                Ok(items) => Ok(Some(items)),
                Err(StoreError::Fenced) => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    async fn complete_outbox(&self, epoch: i64, seq: i64) -> RecordResult<bool> {
        self.within(async { Ok(self.store.complete_outbox(epoch, seq).await?) })
            .await
    }

    async fn create_volume(&self, new: &NewVolume) -> RecordResult<Option<Volume>> {
        self.within(async {
            match self.store.create_volume(new).await {
                Ok(v) => Ok(Some(v)),
                Err(StoreError::Conflict(_)) => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    async fn volume(&self, team_id: &str, id: &str) -> RecordResult<Option<Volume>> {
        self.within(async { Ok(self.store.volume(team_id, id).await?) })
            .await
    }

    async fn volume_by_id(&self, id: &str) -> RecordResult<Option<Volume>> {
        self.within(async { Ok(self.store.volume_by_id(id).await?) })
            .await
    }

    async fn volume_by_name(&self, team_id: &str, name: &str) -> RecordResult<Option<Volume>> {
        self.within(async { Ok(self.store.volume_by_name(team_id, name).await?) })
            .await
    }

    async fn volumes(&self, team_id: &str) -> RecordResult<Vec<Volume>> {
        self.within(async { Ok(self.store.volumes(team_id).await?) })
            .await
    }

    async fn delete_volume(&self, team_id: &str, id: &str) -> RecordResult<bool> {
        self.within(async { Ok(self.store.delete_volume(team_id, id).await?) })
            .await
    }

    async fn create_secret(&self, new: &NewSecret) -> RecordResult<Option<Secret>> {
        self.within(async {
            match self.store.create_secret(new).await {
                Ok(v) => Ok(Some(v)),
                Err(StoreError::Conflict(_)) => Ok(None),
                Err(e) => Err(e.into()),
            }
        })
        .await
    }

    async fn secret(&self, team_id: &str, id_or_name: &str) -> RecordResult<Option<Secret>> {
        self.within(async { Ok(self.store.secret(team_id, id_or_name).await?) })
            .await
    }

    async fn secret_value(&self, team_id: &str, id: &str) -> RecordResult<Option<String>> {
        self.within(async { Ok(self.store.secret_value(team_id, id).await?) })
            .await
    }

    async fn secrets(
        &self,
        team_id: &str,
        limit: i64,
        after: Option<&str>,
    ) -> RecordResult<Vec<Secret>> {
        self.within(async { Ok(self.store.secrets(team_id, limit, after).await?) })
            .await
    }

    async fn count_secrets(&self, team_id: &str) -> RecordResult<i64> {
        self.within(async { Ok(self.store.count_secrets(team_id).await?) })
            .await
    }

    async fn update_secret(
        &self,
        team_id: &str,
        id_or_name: &str,
        value: &str,
        metadata: Option<&std::collections::BTreeMap<String, String>>,
    ) -> RecordResult<Option<Secret>> {
        self.within(async {
            Ok(self
                .store
                .update_secret(team_id, id_or_name, value, metadata)
                .await?)
        })
        .await
    }

    async fn delete_secret(&self, team_id: &str, id_or_name: &str) -> RecordResult<bool> {
        self.within(async { Ok(self.store.delete_secret(team_id, id_or_name).await?) })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_call_past_the_deadline_fails_as_timed_out_and_one_within_it_is_answered() {
        let stalled = within_deadline::<()>(
            Some(Duration::from_millis(50)),
            std::future::pending::<RecordResult<()>>(),
        )
        .await
        .expect_err("a stalled call must end");
        assert!(
            matches!(
                stalled.downcast_ref::<StoreError>(),
                Some(StoreError::TimedOut(_))
            ),
            "{stalled:#}"
        );
        let answered = within_deadline(Some(Duration::from_secs(5)), async { Ok(7) }).await;
        assert_eq!(answered.expect("answered"), 7);
        let unbounded = within_deadline(None, async { Ok(8) }).await;
        assert_eq!(unbounded.expect("answered"), 8);
    }
}
