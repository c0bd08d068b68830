//! Templates, builds and their names. A name is an alias (`base`, `team-slug/my-snapshot`) plus
//! a tag (`default` unless given) pointing at one build. Snapshots are templates of kind
//! `snapshot`; fork templates (`fork-hidden`) have no name.

use sqlx::any::AnyRow;
use sqlx::AnyConnection;

use crate::sql::{flag, get, now_ms, opt_time, time, Sql};
use crate::{
    Build, BuildStatus, NewBuild, NewTemplate, Page, ResolvedTemplate, Result, Snapshot,
    SnapshotQuery, Store, StoreError, Template,
};

pub(crate) const DEFAULT_TAG: &str = "default";

const TEMPLATE_COLUMNS: &str =
    "id, team_id, kind, source_sandbox_id, public, created_at, updated_at";
const BUILD_COLUMNS: &str =
    "id, template_id, status, vcpus, memory_mb, disk_mb, envd_version, node_id, created_at, finished_at, \
     has_memory, parent_build_id";

/// Splits `name[:tag]`; a colon before the last `/` is not a tag separator.
pub fn split_reference(reference: &str) -> (&str, &str) {
    let slash = reference.rfind('/').map_or(0, |i| i + 1);
    match reference[slash..].rfind(':') {
        Some(i) => (&reference[..slash + i], &reference[slash + i + 1..]),
        None => (reference, DEFAULT_TAG),
    }
}

fn template(row: &AnyRow, aliases: Vec<String>) -> Result<Template> {
    Ok(Template {
        id: get(row, "id")?,
        team_id: get(row, "team_id")?,
        kind: get::<String>(row, "kind")?.parse()?,
        source_sandbox_id: get(row, "source_sandbox_id")?,
        public: flag(row, "public")?,
        aliases,
        created_at: time(row, "created_at")?,
        updated_at: time(row, "updated_at")?,
    })
}

fn build(row: &AnyRow) -> Result<Build> {
    Ok(Build {
        id: get(row, "id")?,
        template_id: get(row, "template_id")?,
        status: get::<String>(row, "status")?.parse()?,
        vcpus: get(row, "vcpus")?,
        memory_mb: get(row, "memory_mb")?,
        disk_mb: get(row, "disk_mb")?,
        envd_version: get(row, "envd_version")?,
        node_id: get(row, "node_id")?,
        has_memory: flag(row, "has_memory")?,
        parent_build_id: get(row, "parent_build_id")?,
        created_at: time(row, "created_at")?,
        finished_at: opt_time(row, "finished_at")?,
    })
}

async fn aliases(c: &mut AnyConnection, template_id: &str) -> Result<Vec<String>> {
    let rows =
        sqlx::query("SELECT alias FROM template_aliases WHERE template_id = $1 ORDER BY alias")
            .bind(template_id)
            .fetch_all(c)
            .await?;
    rows.iter().map(|r| get(r, "alias")).collect()
}

async fn tags(c: &mut AnyConnection, template_id: &str) -> Result<Vec<String>> {
    let rows = sqlx::query("SELECT tag FROM template_tags WHERE template_id = $1 ORDER BY tag")
        .bind(template_id)
        .fetch_all(c)
        .await?;
    rows.iter().map(|r| get(r, "tag")).collect()
}

pub(crate) async fn template_by_id(c: &mut AnyConnection, id: &str) -> Result<Option<Template>> {
    let row = sqlx::query(&format!(
        "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE id = $1 AND deleted_at IS NULL"
    ))
    .bind(id)
    .fetch_optional(&mut *c)
    .await?;
    match row {
        None => Ok(None),
        Some(row) => {
            let names = aliases(c, id).await?;
            Ok(Some(template(&row, names)?))
        }
    }
}

pub(crate) async fn create_template(c: &mut AnyConnection, new: &NewTemplate) -> Result<Template> {
    let now = now_ms();
    sqlx::query(&format!(
        "INSERT INTO templates ({TEMPLATE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $6)"
    ))
    .bind(&new.id)
    .bind(new.team_id.clone())
    .bind(new.kind.as_str())
    .bind(new.source_sandbox_id.clone())
    .bind(i64::from(new.public))
    .bind(now)
    .execute(&mut *c)
    .await?;
    template_by_id(c, &new.id)
        .await?
        .ok_or_else(|| StoreError::Malformed(format!("template {}", new.id)))
}

pub(crate) async fn add_alias(c: &mut AnyConnection, template_id: &str, alias: &str) -> Result<()> {
    if alias.is_empty() || alias.contains(':') {
        return Err(StoreError::InvalidArgument(format!(
            "template alias {alias:?}"
        )));
    }
    sqlx::query("INSERT INTO template_aliases (alias, template_id) VALUES ($1, $2)")
        .bind(alias)
        .bind(template_id)
        .execute(c)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(_) => StoreError::Conflict(format!("template name {alias:?}")),
            other => other,
        })?;
    Ok(())
}

pub(crate) async fn create_build(c: &mut AnyConnection, new: &NewBuild) -> Result<Build> {
    let row = sqlx::query(&format!(
        "INSERT INTO builds ({BUILD_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, NULL, $10, $11) \
         RETURNING {BUILD_COLUMNS}"
    ))
    .bind(&new.id)
    .bind(&new.template_id)
    .bind(new.status.as_str())
    .bind(new.vcpus)
    .bind(new.memory_mb)
    .bind(new.disk_mb)
    .bind(&new.envd_version)
    .bind(new.node_id.clone())
    .bind(now_ms())
    .bind(i64::from(new.has_memory))
    .bind(new.parent_build_id.clone())
    .fetch_one(c)
    .await?;
    build(&row)
}

pub(crate) async fn set_build_status(
    c: &mut AnyConnection,
    build_id: &str,
    status: BuildStatus,
) -> Result<bool> {
    let finished = (status != BuildStatus::Building).then(now_ms);
    let done = sqlx::query("UPDATE builds SET status = $1, finished_at = $2 WHERE id = $3")
        .bind(status.as_str())
        .bind(finished)
        .bind(build_id)
        .execute(c)
        .await?;
    Ok(done.rows_affected() > 0)
}

pub(crate) async fn set_tag(
    c: &mut AnyConnection,
    template_id: &str,
    tag: &str,
    build_id: &str,
) -> Result<()> {
    let now = now_ms();
    sqlx::query(
        "INSERT INTO template_tags (template_id, tag, build_id, updated_at) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (template_id, tag) DO UPDATE SET build_id = excluded.build_id, updated_at = excluded.updated_at",
    )
    .bind(template_id)
    .bind(tag)
    .bind(build_id)
    .bind(now)
    .execute(&mut *c)
    .await?;
    sqlx::query("UPDATE templates SET updated_at = $1 WHERE id = $2")
        .bind(now)
        .bind(template_id)
        .execute(c)
        .await?;
    Ok(())
}

pub(crate) async fn build_by_id(c: &mut AnyConnection, id: &str) -> Result<Option<Build>> {
    let row = sqlx::query(&format!("SELECT {BUILD_COLUMNS} FROM builds WHERE id = $1"))
        .bind(id)
        .fetch_optional(c)
        .await?;
    row.as_ref().map(build).transpose()
}

/// A template's tags with the build each points at, by tag.
pub(crate) async fn tagged_builds(
    c: &mut AnyConnection,
    template_id: &str,
) -> Result<Vec<(String, Build)>> {
    let rows =
        sqlx::query("SELECT tag, build_id FROM template_tags WHERE template_id = $1 ORDER BY tag")
            .bind(template_id)
            .fetch_all(&mut *c)
            .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in &rows {
        let tag: String = get(row, "tag")?;
        let build_id: String = get(row, "build_id")?;
        let build = build_by_id(&mut *c, &build_id)
            .await?
            .ok_or_else(|| StoreError::Malformed(format!("tag {tag:?} names a missing build")))?;
        out.push((tag, build));
    }
    Ok(out)
}

pub(crate) async fn template_by_alias(
    c: &mut AnyConnection,
    alias: &str,
) -> Result<Option<Template>> {
    let row = sqlx::query("SELECT template_id FROM template_aliases WHERE alias = $1")
        .bind(alias)
        .fetch_optional(&mut *c)
        .await?;
    match row {
        None => Ok(None),
        Some(row) => template_by_id(c, &get::<String>(&row, "template_id")?).await,
    }
}

pub(crate) async fn remove_tag(
    c: &mut AnyConnection,
    template_id: &str,
    tag: &str,
) -> Result<bool> {
    let done = sqlx::query("DELETE FROM template_tags WHERE template_id = $1 AND tag = $2")
        .bind(template_id)
        .bind(tag)
        .execute(c)
        .await?;
    Ok(done.rows_affected() > 0)
}

pub(crate) async fn delete_template(c: &mut AnyConnection, template_id: &str) -> Result<bool> {
    sqlx::query("DELETE FROM template_aliases WHERE template_id = $1")
        .bind(template_id)
        .execute(&mut *c)
        .await?;
    let done =
        sqlx::query("UPDATE templates SET deleted_at = $1 WHERE id = $2 AND deleted_at IS NULL")
            .bind(now_ms())
            .bind(template_id)
            .execute(c)
            .await?;
    Ok(done.rows_affected() > 0)
}

impl Store {
    pub async fn create_template(&self, new: &NewTemplate) -> Result<Template> {
        let mut tx = self.begin().await?;
        let t = tx.create_template(new).await?;
        tx.commit().await?;
        Ok(t)
    }

    /// Gives a template a name (without tag); [`StoreError::Conflict`] if taken.
    pub async fn add_alias(&self, template_id: &str, alias: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        tx.add_alias(template_id, alias).await?;
        tx.commit().await
    }

    pub async fn create_build(&self, new: &NewBuild) -> Result<Build> {
        let mut tx = self.begin().await?;
        let b = tx.create_build(new).await?;
        tx.commit().await?;
        Ok(b)
    }

    pub async fn set_build_status(&self, build_id: &str, status: BuildStatus) -> Result<bool> {
        let mut c = self.writer.acquire().await?;
        set_build_status(&mut c, build_id, status).await
    }

    /// Points `template:tag` at a build (a new build under an existing tag replaces the old).
    pub async fn set_tag(&self, template_id: &str, tag: &str, build_id: &str) -> Result<()> {
        let mut tx = self.begin().await?;
        tx.set_tag(template_id, tag, build_id).await?;
        tx.commit().await
    }

    pub async fn template(&self, id: &str) -> Result<Option<Template>> {
        let mut c = self.reader.acquire().await?;
        template_by_id(&mut c, id).await
    }

    pub async fn build(&self, id: &str) -> Result<Option<Build>> {
        let mut c = self.reader.acquire().await?;
        build_by_id(&mut c, id).await
    }

    /// A template's tags with the build each points at, ordered by tag.
    pub async fn tagged_builds(&self, template_id: &str) -> Result<Vec<(String, Build)>> {
        let mut c = self.reader.acquire().await?;
        tagged_builds(&mut c, template_id).await
    }

    /// The live template that owns `alias` (a name without tag), if any.
    pub async fn template_by_alias(&self, alias: &str) -> Result<Option<Template>> {
        let mut c = self.reader.acquire().await?;
        template_by_alias(&mut c, alias).await
    }

    /// Removes one tag of a template; `false` if it had no such tag.
    pub async fn remove_tag(&self, template_id: &str, tag: &str) -> Result<bool> {
        let mut tx = self.begin().await?;
        let done = tx.remove_tag(template_id, tag).await?;
        tx.commit().await?;
        Ok(done)
    }

    /// The team's templates (and, with `include_shared`, those without a team or public).
    pub async fn templates(&self, team_id: &str, include_shared: bool) -> Result<Vec<Template>> {
        let mut c = self.reader.acquire().await?;
        let shared = if include_shared {
            " OR team_id IS NULL OR public = 1"
        } else {
            ""
        };
        let rows = sqlx::query(&format!(
            "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE deleted_at IS NULL AND kind = 'template' \
             AND (team_id = $1{shared}) ORDER BY created_at, id"
        ))
        .bind(team_id)
        .fetch_all(&mut *c)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: String = get(row, "id")?;
            let names = aliases(&mut c, &id).await?;
            out.push(template(row, names)?);
        }
        Ok(out)
    }

    /// The builds of a template, newest first.
    pub async fn builds(&self, template_id: &str) -> Result<Vec<Build>> {
        let rows = sqlx::query(&format!(
            "SELECT {BUILD_COLUMNS} FROM builds WHERE template_id = $1 ORDER BY created_at DESC, id DESC"
        ))
        .bind(template_id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(build).collect()
    }

    /// Full names (`alias:tag`) of a template.
    pub async fn template_names(&self, template_id: &str) -> Result<Vec<String>> {
        let mut c = self.reader.acquire().await?;
        names(&mut c, template_id).await
    }

    /// Resolves a template id, alias or `namespace/alias`, each optionally with `:tag`, to the
    /// build to start from. Without a tag row, `default` means the newest ready build.
    pub async fn resolve_template(&self, reference: &str) -> Result<Option<ResolvedTemplate>> {
        let mut c = self.reader.acquire().await?;
        let (name, tag) = split_reference(reference);
        let mut found = template_by_id(&mut c, name).await?;
        if found.is_none() {
            let row = sqlx::query("SELECT template_id FROM template_aliases WHERE alias = $1")
                .bind(name)
                .fetch_optional(&mut *c)
                .await?;
            if let Some(row) = row {
                let id: String = get(&row, "template_id")?;
                found = template_by_id(&mut c, &id).await?;
            }
        }
        let Some(template) = found else {
            return Ok(None);
        };
        let tagged =
            sqlx::query("SELECT build_id FROM template_tags WHERE template_id = $1 AND tag = $2")
                .bind(&template.id)
                .bind(tag)
                .fetch_optional(&mut *c)
                .await?;
        let build = match tagged {
            Some(row) => build_by_id(&mut c, &get::<String>(&row, "build_id")?).await?,
            None if tag == DEFAULT_TAG => {
                let row = sqlx::query(&format!(
                    "SELECT {BUILD_COLUMNS} FROM builds WHERE template_id = $1 AND status = 'ready' \
                     ORDER BY created_at DESC, id DESC LIMIT 1"
                ))
                .bind(&template.id)
                .fetch_optional(&mut *c)
                .await?;
                row.as_ref().map(build).transpose()?
            }
            None => None,
        };
        Ok(build.map(|build| ResolvedTemplate {
            template,
            build,
            tag: tag.to_owned(),
        }))
    }

    /// Retires a template: its names are freed at once; its builds stay for their users.
    pub async fn delete_template(&self, template_id: &str) -> Result<bool> {
        let mut tx = self.begin().await?;
        let done = tx.delete_template(template_id).await?;
        tx.commit().await?;
        Ok(done)
    }

    /// The team's snapshots, newest first.
    pub async fn snapshots(&self, query: &SnapshotQuery) -> Result<Page<Snapshot>> {
        let mut c = self.reader.acquire().await?;
        let limit = if query.limit <= 0 {
            100
        } else {
            query.limit.min(1000)
        };
        let mut sql = Sql::new(&format!(
            "SELECT {TEMPLATE_COLUMNS} FROM templates WHERE deleted_at IS NULL AND kind = 'snapshot' AND team_id = "
        ));
        sql.text(&query.team_id);
        if let Some(sandbox) = &query.sandbox_id {
            sql.push(" AND source_sandbox_id = ").text(sandbox);
        }
        if let Some(name) = &query.name {
            let (alias, _) = split_reference(name);
            sql.push(" AND id IN (SELECT template_id FROM template_aliases WHERE alias = ")
                .text(alias)
                .push(")");
        }
        if let Some(cursor) = &query.cursor {
            let (at, id) = parse_cursor(cursor)?;
            sql.push(" AND (created_at < ")
                .int(at)
                .push(" OR (created_at = ")
                .int(at)
                .push(" AND id < ");
            sql.text(&id).push("))");
        }
        sql.push(" ORDER BY created_at DESC, id DESC LIMIT ")
            .int(limit + 1);
        let rows = sql.query().fetch_all(&mut *c).await?;
        let mut items = Vec::new();
        for row in rows.iter().take(limit as usize) {
            let t = template(row, Vec::new())?;
            let names = names(&mut c, &t.id).await?;
            let snapshot_id = names
                .first()
                .cloned()
                .unwrap_or_else(|| format!("{}:{DEFAULT_TAG}", t.id));
            items.push(Snapshot {
                snapshot_id,
                names,
                template_id: t.id,
                source_sandbox_id: t.source_sandbox_id,
                created_at: t.created_at,
            });
        }
        let next_cursor = if rows.len() as i64 > limit {
            items
                .last()
                .map(|s| cursor(crate::sql::ms(s.created_at), &s.template_id))
        } else {
            None
        };
        Ok(Page { items, next_cursor })
    }
}

async fn names(c: &mut AnyConnection, template_id: &str) -> Result<Vec<String>> {
    let aliases = aliases(c, template_id).await?;
    let tags = tags(c, template_id).await?;
    let mut names = Vec::new();
    for alias in &aliases {
        for tag in &tags {
            names.push(format!("{alias}:{tag}"));
        }
    }
    Ok(names)
}

/// A keyset cursor: `<millis>.<id>`.
pub(crate) fn cursor(at_ms: i64, id: &str) -> String {
    format!("{at_ms}.{id}")
}

pub(crate) fn parse_cursor(cursor: &str) -> Result<(i64, String)> {
    let (at, id) = cursor
        .split_once('.')
        .ok_or_else(|| StoreError::InvalidArgument("cursor".to_owned()))?;
    let at = at
        .parse()
        .map_err(|_| StoreError::InvalidArgument("cursor".to_owned()))?;
    Ok((at, id.to_owned()))
}
