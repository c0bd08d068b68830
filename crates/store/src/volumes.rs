//! Volumes: one row per named volume, its name unique within its team (a second create of the
//! same name is [`StoreError::Conflict`]). The files are kept by the api under its volumes
//! directory; deleting the row is what makes a volume gone.

use sqlx::any::AnyRow;

use crate::sql::{get, now_ms, time};
use crate::{NewVolume, Result, Store, StoreError, Volume};

const COLUMNS: &str = "id, team_id, name, created_at";

fn volume(row: &AnyRow) -> Result<Volume> {
    Ok(Volume {
        id: get(row, "id")?,
        team_id: get(row, "team_id")?,
        name: get(row, "name")?,
        created_at: time(row, "created_at")?,
    })
}

impl Store {
    pub async fn create_volume(&self, new: &NewVolume) -> Result<Volume> {
        let row = sqlx::query(&format!(
            "INSERT INTO volumes (id, team_id, name, created_at) VALUES ($1, $2, $3, $4) \
             RETURNING {COLUMNS}"
        ))
        .bind(&new.id)
        .bind(&new.team_id)
        .bind(&new.name)
        .bind(now_ms())
        .fetch_one(&self.writer)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(_) => StoreError::Conflict(format!("volume {:?}", new.name)),
            other => other,
        })?;
        volume(&row)
    }

    /// The team's volume `id`; `None` for another team's.
    pub async fn volume(&self, team_id: &str, id: &str) -> Result<Option<Volume>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM volumes WHERE id = $1 AND team_id = $2"
        ))
        .bind(id)
        .bind(team_id)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(volume).transpose()
    }

    /// Any team's volume `id` (the content plane, which authenticates by volume token).
    pub async fn volume_by_id(&self, id: &str) -> Result<Option<Volume>> {
        let row = sqlx::query(&format!("SELECT {COLUMNS} FROM volumes WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(volume).transpose()
    }

    pub async fn volume_by_name(&self, team_id: &str, name: &str) -> Result<Option<Volume>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM volumes WHERE team_id = $1 AND name = $2"
        ))
        .bind(team_id)
        .bind(name)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(volume).transpose()
    }

    /// The team's volumes, oldest first.
    pub async fn volumes(&self, team_id: &str) -> Result<Vec<Volume>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM volumes WHERE team_id = $1 ORDER BY created_at, id"
        ))
        .bind(team_id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(volume).collect()
    }

    /// `false` when the team has no such volume.
    pub async fn delete_volume(&self, team_id: &str, id: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM volumes WHERE id = $1 AND team_id = $2")
            .bind(id)
            .bind(team_id)
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() > 0)
    }
}
