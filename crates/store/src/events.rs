//! Lifecycle events, their retention, and the fan-out of each new event into the outbox of
//! every enabled webhook of the team that subscribed to its type, in the same transaction.

use sqlx::any::AnyRow;
use sqlx::AnyConnection;
use time::OffsetDateTime;

use crate::sql::{get, ms, now_ms, opt_json, time, to_json, Sql};
use crate::{Event, EventQuery, NewEvent, Result, Store, StoreError};

/// How long events are kept (E2B's retention is 30 days).
pub const EVENT_RETENTION: time::Duration = time::Duration::days(30);

pub(crate) const COLUMNS: &str =
    "seq, id, type, event_data, sandbox_id, execution_id, build_id, team_id, template_id, timestamp";

pub(crate) fn event(row: &AnyRow) -> Result<Event> {
    let id: String = get(row, "id")?;
    Ok(Event {
        id: id
            .parse()
            .map_err(|_| StoreError::Malformed(format!("event id {id:?}")))?,
        seq: get(row, "seq")?,
        event_type: get(row, "type")?,
        event_data: opt_json(row, "event_data")?,
        sandbox_id: get(row, "sandbox_id")?,
        execution_id: get(row, "execution_id")?,
        build_id: get(row, "build_id")?,
        team_id: get(row, "team_id")?,
        template_id: get(row, "template_id")?,
        timestamp: time(row, "timestamp")?,
    })
}

pub(crate) async fn append(c: &mut AnyConnection, new: &NewEvent) -> Result<Event> {
    let id = uuid::Uuid::new_v4();
    let row = sqlx::query(&format!(
        "INSERT INTO events (id, type, event_data, sandbox_id, execution_id, build_id, team_id, template_id, \
         timestamp) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING {COLUMNS}"
    ))
    .bind(id.to_string())
    .bind(&new.event_type)
    .bind(new.event_data.as_ref().map(to_json).transpose()?)
    .bind(&new.sandbox_id)
    .bind(&new.execution_id)
    .bind(&new.build_id)
    .bind(&new.team_id)
    .bind(&new.template_id)
    .bind(ms(new.timestamp))
    .fetch_one(&mut *c)
    .await?;
    let event = event(&row)?;

    let hooks = sqlx::query(
        "SELECT id, events FROM webhooks WHERE team_id = $1 AND enabled = 1 ORDER BY id",
    )
    .bind(&new.team_id)
    .fetch_all(&mut *c)
    .await?;
    let now = now_ms();
    for hook in &hooks {
        let subscribed: Vec<String> = crate::sql::json(hook, "events")?;
        if !subscribed.iter().any(|t| t == &new.event_type) {
            continue;
        }
        sqlx::query("INSERT INTO outbox (webhook_id, event_id, delivery_id, created_at) VALUES ($1, $2, $3, $4)")
            .bind(get::<String>(hook, "id")?)
            .bind(id.to_string())
            .bind(uuid::Uuid::new_v4().to_string())
            .bind(now)
            .execute(&mut *c)
            .await?;
    }
    Ok(event)
}

impl Store {
    /// Appends one event on its own (prefer [`crate::StoreTx::append_event`] beside the change
    /// it reports).
    pub async fn append_event(&self, new: &NewEvent) -> Result<Event> {
        let mut tx = self.begin().await?;
        let event = tx.append_event(new).await?;
        tx.commit().await?;
        Ok(event)
    }

    /// `GET /events/sandboxes[/{id}]`.
    pub async fn events(&self, q: &EventQuery) -> Result<Vec<Event>> {
        let limit = if q.limit <= 0 { 10 } else { q.limit.min(1000) };
        let mut sql = Sql::new(&format!("SELECT {COLUMNS} FROM events WHERE team_id = "));
        sql.text(&q.team_id);
        if let Some(sandbox) = &q.sandbox_id {
            sql.push(" AND sandbox_id = ").text(sandbox);
        }
        if !q.types.is_empty() {
            sql.push(" AND type IN (");
            for (i, t) in q.types.iter().enumerate() {
                if i > 0 {
                    sql.push(", ");
                }
                sql.text(t);
            }
            sql.push(")");
        }
        let dir = if q.order_asc { "ASC" } else { "DESC" };
        sql.push(&format!(" ORDER BY timestamp {dir}, seq {dir} LIMIT "))
            .int(limit);
        sql.push(" OFFSET ").int(q.offset.max(0));
        let rows = sql.query().fetch_all(&self.reader).await?;
        rows.iter().map(event).collect()
    }

    /// One event by id.
    pub async fn event(&self, id: uuid::Uuid) -> Result<Option<Event>> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM events WHERE id = $1"))
            .bind(id.to_string())
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(event).transpose()
    }

    /// Deletes events older than `before` (and their delivered or abandoned outbox rows);
    /// returns how many events went.
    pub async fn delete_events_before(&self, before: OffsetDateTime) -> Result<u64> {
        let mut tx = self.begin().await?;
        let cutoff = ms(before);
        let c = tx.connection();
        sqlx::query(
            "DELETE FROM outbox WHERE event_id IN (SELECT id FROM events WHERE timestamp < $1)",
        )
        .bind(cutoff)
        .execute(&mut *c)
        .await?;
        let done = sqlx::query("DELETE FROM events WHERE timestamp < $1")
            .bind(cutoff)
            .execute(&mut *c)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    /// The retention job: run it periodically (the leader does, daily is plenty). Deletes
    /// events past [`EVENT_RETENTION`] and webhook delivery attempts of the same age.
    pub async fn run_retention(&self, now: OffsetDateTime) -> Result<u64> {
        let cutoff = now - EVENT_RETENTION;
        let deleted = self.delete_events_before(cutoff).await?;
        sqlx::query("DELETE FROM webhook_deliveries WHERE created_at < $1")
            .bind(ms(cutoff))
            .execute(&self.writer)
            .await?;
        if deleted > 0 {
            tracing::info!(deleted, "expired lifecycle events deleted");
        }
        Ok(deleted)
    }
}
