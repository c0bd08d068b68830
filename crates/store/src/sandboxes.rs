//! Sandbox records (running and paused) and their listing. Metadata is stored twice: as JSON
//! in the row (returned as is) and as key/value rows (filtered portably with `EXISTS`).

use sqlx::any::AnyRow;
use sqlx::AnyConnection;
use time::OffsetDateTime;

use crate::sql::{flag, get, json, ms, now_ms, opt_json, time, to_json, Sql};
use crate::templates::{cursor, parse_cursor};
use crate::{Order, Page, Result, SandboxQuery, SandboxRecord, SandboxState, Store};

const COLUMNS: &str = "id, team_id, execution_id, template_id, build_id, paused_build_id, alias, state, node_id, \
    pause_mode, vcpus, memory_mb, disk_mb, envd_version, metadata, env_vars, network, auto_pause, \
    auto_pause_memory, auto_resume, timeout_secs, started_at, end_at, envd_access_token, traffic_access_token, \
    extra, fence";

fn record(row: &AnyRow) -> Result<SandboxRecord> {
    Ok(SandboxRecord {
        sandbox_id: get(row, "id")?,
        team_id: get(row, "team_id")?,
        execution_id: get(row, "execution_id")?,
        template_id: get(row, "template_id")?,
        build_id: get(row, "build_id")?,
        paused_build_id: get(row, "paused_build_id")?,
        alias: get(row, "alias")?,
        state: get::<String>(row, "state")?.parse()?,
        node_id: get(row, "node_id")?,
        pause_mode: get::<Option<String>>(row, "pause_mode")?
            .map(|m| m.parse())
            .transpose()?,
        vcpus: get(row, "vcpus")?,
        memory_mb: get(row, "memory_mb")?,
        disk_mb: get(row, "disk_mb")?,
        envd_version: get(row, "envd_version")?,
        metadata: json(row, "metadata")?,
        env_vars: json(row, "env_vars")?,
        network: opt_json(row, "network")?,
        auto_pause: flag(row, "auto_pause")?,
        auto_pause_memory: flag(row, "auto_pause_memory")?,
        auto_resume: flag(row, "auto_resume")?,
        timeout_secs: get(row, "timeout_secs")?,
        started_at: time(row, "started_at")?,
        end_at: time(row, "end_at")?,
        envd_access_token: get(row, "envd_access_token")?,
        traffic_access_token: get(row, "traffic_access_token")?,
        extra: json(row, "extra")?,
        fence: get(row, "fence")?,
    })
}

async fn write_metadata(c: &mut AnyConnection, s: &SandboxRecord) -> Result<()> {
    sqlx::query("DELETE FROM sandbox_metadata WHERE sandbox_id = $1")
        .bind(&s.sandbox_id)
        .execute(&mut *c)
        .await?;
    for (key, value) in &s.metadata {
        sqlx::query("INSERT INTO sandbox_metadata (sandbox_id, key, value) VALUES ($1, $2, $3)")
            .bind(&s.sandbox_id)
            .bind(key)
            .bind(value)
            .execute(&mut *c)
            .await?;
    }
    Ok(())
}

pub(crate) async fn insert(c: &mut AnyConnection, s: &SandboxRecord) -> Result<()> {
    let now = now_ms();
    let sql = format!(
        "INSERT INTO sandboxes ({COLUMNS}, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, \
         $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $28)"
    );
    let q = sqlx::query(&sql).bind(&s.sandbox_id).bind(&s.team_id);
    bind_fields(q, s)?
        .bind(s.fence)
        .bind(now)
        .execute(&mut *c)
        .await?;
    write_metadata(c, s).await
}

type AnyQuery<'q> = sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>;

/// Binds the mutable columns, `execution_id` through `extra`, in the order insert and update
/// both list them.
fn bind_fields<'q>(q: AnyQuery<'q>, s: &'q SandboxRecord) -> Result<AnyQuery<'q>> {
    Ok(q.bind(&s.execution_id)
        .bind(&s.template_id)
        .bind(&s.build_id)
        .bind(s.paused_build_id.clone())
        .bind(s.alias.clone())
        .bind(s.state.as_str())
        .bind(s.node_id.clone())
        .bind(s.pause_mode.map(|m| m.as_str()))
        .bind(s.vcpus)
        .bind(s.memory_mb)
        .bind(s.disk_mb)
        .bind(&s.envd_version)
        .bind(to_json(&s.metadata)?)
        .bind(to_json(&s.env_vars)?)
        .bind(s.network.as_ref().map(to_json).transpose()?)
        .bind(i64::from(s.auto_pause))
        .bind(i64::from(s.auto_pause_memory))
        .bind(i64::from(s.auto_resume))
        .bind(s.timeout_secs)
        .bind(ms(s.started_at))
        .bind(ms(s.end_at))
        .bind(s.envd_access_token.clone())
        .bind(s.traffic_access_token.clone())
        .bind(to_json(&s.extra)?))
}

/// Overwrites the record if it is still `expected_execution_id` and no newer fence wrote it.
pub(crate) async fn update(
    c: &mut AnyConnection,
    s: &SandboxRecord,
    expected_execution_id: &str,
    fence: i64,
) -> Result<bool> {
    let q = sqlx::query(
        "UPDATE sandboxes SET execution_id = $1, template_id = $2, build_id = $3, paused_build_id = $4, alias = $5, \
         state = $6, node_id = $7, pause_mode = $8, vcpus = $9, memory_mb = $10, disk_mb = $11, envd_version = $12, \
         metadata = $13, env_vars = $14, network = $15, auto_pause = $16, auto_pause_memory = $17, \
         auto_resume = $18, timeout_secs = $19, started_at = $20, end_at = $21, envd_access_token = $22, \
         traffic_access_token = $23, extra = $24, fence = $25, updated_at = $26 \
         WHERE id = $27 AND execution_id = $28 AND fence <= $25",
    );
    let done = bind_fields(q, s)?
        .bind(fence)
        .bind(now_ms())
        .bind(&s.sandbox_id)
        .bind(expected_execution_id)
        .execute(&mut *c)
        .await?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    write_metadata(c, s).await?;
    Ok(true)
}

/// Moves the state if the record is still `execution_id`, in one of `from` (any if empty), and
/// not written by a newer fence.
pub(crate) async fn set_state(
    c: &mut AnyConnection,
    sandbox_id: &str,
    execution_id: &str,
    from: &[SandboxState],
    to: SandboxState,
    fence: i64,
) -> Result<bool> {
    let mut sql = Sql::new("UPDATE sandboxes SET state = ");
    sql.text(to.as_str())
        .push(", fence = ")
        .int(fence)
        .push(", updated_at = ")
        .int(now_ms());
    sql.push(" WHERE id = ")
        .text(sandbox_id)
        .push(" AND execution_id = ")
        .text(execution_id);
    sql.push(" AND fence <= ").int(fence);
    if !from.is_empty() {
        sql.push(" AND state IN (");
        for (i, state) in from.iter().enumerate() {
            if i > 0 {
                sql.push(", ");
            }
            sql.text(state.as_str());
        }
        sql.push(")");
    }
    Ok(sql.query().execute(c).await?.rows_affected() > 0)
}

pub(crate) async fn delete(
    c: &mut AnyConnection,
    sandbox_id: &str,
    execution_id: &str,
    fence: i64,
) -> Result<bool> {
    let done =
        sqlx::query("DELETE FROM sandboxes WHERE id = $1 AND execution_id = $2 AND fence <= $3")
            .bind(sandbox_id)
            .bind(execution_id)
            .bind(fence)
            .execute(&mut *c)
            .await?;
    if done.rows_affected() == 0 {
        return Ok(false);
    }
    // Not relying on ON DELETE CASCADE: SQLite enforces it only with foreign_keys on.
    sqlx::query("DELETE FROM sandbox_metadata WHERE sandbox_id = $1")
        .bind(sandbox_id)
        .execute(c)
        .await?;
    Ok(true)
}

pub(crate) async fn by_id(
    c: &mut AnyConnection,
    sandbox_id: &str,
) -> Result<Option<SandboxRecord>> {
    let row = sqlx::query(&format!("SELECT {COLUMNS} FROM sandboxes WHERE id = $1"))
        .bind(sandbox_id)
        .fetch_optional(c)
        .await?;
    row.as_ref().map(record).transpose()
}

impl Store {
    pub async fn insert_sandbox(&self, record: &SandboxRecord) -> Result<()> {
        let mut tx = self.begin().await?;
        tx.insert_sandbox(record).await?;
        tx.commit().await
    }

    pub async fn sandbox(&self, sandbox_id: &str) -> Result<Option<SandboxRecord>> {
        let mut c = self.reader.acquire().await?;
        by_id(&mut c, sandbox_id).await
    }

    /// `GET /v2/sandboxes`: keyset-paged by (start time, id).
    pub async fn sandboxes(&self, q: &SandboxQuery) -> Result<Page<SandboxRecord>> {
        let limit = if q.limit <= 0 { 100 } else { q.limit.min(1000) };
        let mut sql = Sql::new(&format!("SELECT {COLUMNS} FROM sandboxes WHERE team_id = "));
        sql.text(&q.team_id);
        if !q.states.is_empty() {
            sql.push(" AND state IN (");
            for (i, state) in q.states.iter().enumerate() {
                if i > 0 {
                    sql.push(", ");
                }
                sql.text(state.as_str());
            }
            sql.push(")");
        }
        for (key, value) in &q.metadata {
            sql.push(" AND EXISTS (SELECT 1 FROM sandbox_metadata m WHERE m.sandbox_id = sandboxes.id AND m.key = ");
            sql.text(key).push(" AND m.value = ").text(value).push(")");
        }
        if let Some(template) = &q.template_id {
            sql.push(" AND (template_id = ")
                .text(template)
                .push(" OR alias = ")
                .text(template)
                .push(")");
        }
        if let Some(after) = q.started_after {
            sql.push(" AND started_at > ").int(ms(after));
        }
        let (cmp, dir) = match q.order {
            Order::Asc => (">", "ASC"),
            Order::Desc => ("<", "DESC"),
        };
        if let Some(c) = &q.cursor {
            let (at, id) = parse_cursor(c)?;
            sql.push(&format!(" AND (started_at {cmp} ")).int(at);
            sql.push(" OR (started_at = ")
                .int(at)
                .push(&format!(" AND id {cmp} "))
                .text(&id)
                .push("))");
        }
        sql.push(&format!(" ORDER BY started_at {dir}, id {dir} LIMIT "))
            .int(limit + 1);
        let rows = sql.query().fetch_all(&self.reader).await?;
        let items: Vec<SandboxRecord> = rows
            .iter()
            .take(limit as usize)
            .map(record)
            .collect::<Result<_>>()?;
        let next_cursor = if rows.len() as i64 > limit {
            items
                .last()
                .map(|s| cursor(ms(s.started_at), &s.sandbox_id))
        } else {
            None
        };
        Ok(Page { items, next_cursor })
    }

    /// How many of the team's sandboxes are in `state` (`X-Total-Running`).
    pub async fn count_sandboxes(&self, team_id: &str, state: SandboxState) -> Result<i64> {
        let row =
            sqlx::query("SELECT COUNT(*) AS n FROM sandboxes WHERE team_id = $1 AND state = $2")
                .bind(team_id)
                .bind(state.as_str())
                .fetch_one(&self.reader)
                .await?;
        get(&row, "n")
    }

    /// Running sandboxes whose end time has passed, oldest first (the reaper's work list).
    pub async fn expired_sandboxes(
        &self,
        now: OffsetDateTime,
        limit: i64,
    ) -> Result<Vec<SandboxRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE state = 'running' AND end_at <= $1 ORDER BY end_at, id LIMIT $2"
        ))
        .bind(ms(now))
        .bind(limit)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(record).collect()
    }

    /// Every sandbox record placed on `node_id` (reconciliation after a node restart or death).
    pub async fn sandboxes_on_node(&self, node_id: &str) -> Result<Vec<SandboxRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM sandboxes WHERE node_id = $1 ORDER BY id"
        ))
        .bind(node_id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(record).collect()
    }
}
