//! Template builds of the Template SDK. The api owns their shape: a build, a log entry and a
//! cached layer are JSON documents here, with the columns the queries select on beside them.

use crate::sql::{get, now_ms};
use crate::{Result, Store};

/// A stored template build: its JSON and the team that owns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateBuildDoc {
    pub id: String,
    pub template_id: String,
    pub team_id: String,
    /// `waiting`, `building`, `ready` or `error`.
    pub status: String,
    pub doc: String,
}

impl Store {
    /// Creates or replaces a template build.
    pub async fn put_template_build(&self, b: &TemplateBuildDoc) -> Result<()> {
        let mut c = self.writer.acquire().await?;
        let now = now_ms();
        sqlx::query(
            "INSERT INTO template_builds (id, template_id, team_id, status, doc, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $6) \
             ON CONFLICT (id) DO UPDATE SET status = excluded.status, doc = excluded.doc, \
             updated_at = excluded.updated_at",
        )
        .bind(&b.id)
        .bind(&b.template_id)
        .bind(&b.team_id)
        .bind(&b.status)
        .bind(&b.doc)
        .bind(now)
        .execute(&mut *c)
        .await?;
        Ok(())
    }

    pub async fn template_build(&self, id: &str) -> Result<Option<TemplateBuildDoc>> {
        let mut c = self.reader.acquire().await?;
        let row = sqlx::query(
            "SELECT id, template_id, team_id, status, doc FROM template_builds WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&mut *c)
        .await?;
        row.map(|r| doc_of(&r)).transpose()
    }

    /// Builds in one of `statuses`, oldest first (selected by the indexed status column, so a
    /// start does not read the whole history).
    pub async fn template_builds_in(&self, statuses: &[&str]) -> Result<Vec<TemplateBuildDoc>> {
        let mut c = self.reader.acquire().await?;
        let mut out = Vec::new();
        for status in statuses {
            let rows = sqlx::query(
                "SELECT id, template_id, team_id, status, doc, created_at FROM template_builds \
                 WHERE status = $1",
            )
            .bind(*status)
            .fetch_all(&mut *c)
            .await?;
            for r in &rows {
                out.push((get::<i64>(r, "created_at")?, doc_of(r)?));
            }
        }
        out.sort_by_key(|(at, _)| *at);
        Ok(out.into_iter().map(|(_, d)| d).collect())
    }

    /// A template's builds, newest first.
    pub async fn template_builds_of(&self, template_id: &str) -> Result<Vec<TemplateBuildDoc>> {
        let mut c = self.reader.acquire().await?;
        let rows = sqlx::query(
            "SELECT id, template_id, team_id, status, doc FROM template_builds \
             WHERE template_id = $1 ORDER BY created_at DESC",
        )
        .bind(template_id)
        .fetch_all(&mut *c)
        .await?;
        rows.iter().map(doc_of).collect()
    }

    /// Deletes a template's builds and their logs.
    pub async fn delete_template_builds(&self, template_id: &str) -> Result<()> {
        let mut tx = self.writer.begin().await?;
        sqlx::query(
            "DELETE FROM template_build_logs WHERE build_id IN \
             (SELECT id FROM template_builds WHERE template_id = $1)",
        )
        .bind(template_id)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM template_builds WHERE template_id = $1")
            .bind(template_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Appends log entries (JSON each) after the build's last one.
    pub async fn append_template_build_logs(&self, build_id: &str, docs: &[String]) -> Result<()> {
        if docs.is_empty() {
            return Ok(());
        }
        let mut tx = self.writer.begin().await?;
        let next: i64 = {
            let row = sqlx::query(
                "SELECT COALESCE(MAX(seq) + 1, 0) AS next FROM template_build_logs WHERE build_id = $1",
            )
            .bind(build_id)
            .fetch_one(&mut *tx)
            .await?;
            get(&row, "next")?
        };
        for (i, doc) in docs.iter().enumerate() {
            sqlx::query("INSERT INTO template_build_logs (build_id, seq, doc) VALUES ($1, $2, $3)")
                .bind(build_id)
                .bind(next + i as i64)
                .bind(doc)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Up to `limit` log entries from index `offset` on.
    pub async fn template_build_logs(
        &self,
        build_id: &str,
        offset: i64,
        limit: i64,
    ) -> Result<Vec<String>> {
        let mut c = self.reader.acquire().await?;
        let rows = sqlx::query(
            "SELECT doc FROM template_build_logs WHERE build_id = $1 AND seq >= $2 \
             ORDER BY seq LIMIT $3",
        )
        .bind(build_id)
        .bind(offset.max(0))
        .bind(limit.clamp(0, 10_000))
        .fetch_all(&mut *c)
        .await?;
        rows.iter().map(|r| get(r, "doc")).collect()
    }

    /// The cached layer of a team under `key`, marked used now.
    pub async fn template_layer(&self, team_id: &str, key: &str) -> Result<Option<String>> {
        let mut c = self.writer.acquire().await?;
        sqlx::query(
            "UPDATE template_layers SET used_at = $3 WHERE team_id = $1 AND cache_key = $2",
        )
        .bind(team_id)
        .bind(key)
        .bind(now_ms())
        .execute(&mut *c)
        .await?;
        let row =
            sqlx::query("SELECT doc FROM template_layers WHERE team_id = $1 AND cache_key = $2")
                .bind(team_id)
                .bind(key)
                .fetch_optional(&mut *c)
                .await?;
        row.map(|r| get(&r, "doc")).transpose()
    }

    pub async fn put_template_layer(&self, team_id: &str, key: &str, doc: &str) -> Result<()> {
        let mut c = self.writer.acquire().await?;
        let now = now_ms();
        sqlx::query(
            "INSERT INTO template_layers (team_id, cache_key, doc, created_at, used_at) \
             VALUES ($1, $2, $3, $4, $4) \
             ON CONFLICT (team_id, cache_key) DO UPDATE SET doc = excluded.doc, used_at = excluded.used_at",
        )
        .bind(team_id)
        .bind(key)
        .bind(doc)
        .bind(now)
        .execute(&mut *c)
        .await?;
        Ok(())
    }

    /// Cached layers not used since `before_ms` (Unix ms): `(team, key, doc)`.
    pub async fn stale_template_layers(
        &self,
        before_ms: i64,
    ) -> Result<Vec<(String, String, String)>> {
        let mut c = self.reader.acquire().await?;
        let rows =
            sqlx::query("SELECT team_id, cache_key, doc FROM template_layers WHERE used_at < $1")
                .bind(before_ms)
                .fetch_all(&mut *c)
                .await?;
        rows.iter()
            .map(|r| Ok((get(r, "team_id")?, get(r, "cache_key")?, get(r, "doc")?)))
            .collect()
    }

    pub async fn delete_template_layer(&self, team_id: &str, key: &str) -> Result<()> {
        let mut c = self.writer.acquire().await?;
        sqlx::query("DELETE FROM template_layers WHERE team_id = $1 AND cache_key = $2")
            .bind(team_id)
            .bind(key)
            .execute(&mut *c)
            .await?;
        Ok(())
    }
}

fn doc_of(r: &sqlx::any::AnyRow) -> Result<TemplateBuildDoc> {
    Ok(TemplateBuildDoc {
        id: get(r, "id")?,
        template_id: get(r, "template_id")?,
        team_id: get(r, "team_id")?,
        status: get(r, "status")?,
        doc: get(r, "doc")?,
    })
}
