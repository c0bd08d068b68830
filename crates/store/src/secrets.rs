//! Team secrets: a name (lower-cased, unique per team), a version, metadata and a value sealed
//! like webhook secrets (the secret id as associated data, so a sealed value cannot be moved to
//! another row). Reads return everything but the value; [`Store::secret_value`] is for the
//! egress path only. A row is found by its id or, case-insensitively, its name.

use std::collections::BTreeMap;

use sqlx::any::AnyRow;

use crate::sql::{get, json, now_ms, time, to_json};
use crate::{NewSecret, Result, Secret, Store, StoreError};

const COLUMNS: &str = "id, team_id, name, version, metadata, created_at, updated_at";

fn secret(row: &AnyRow) -> Result<Secret> {
    Ok(Secret {
        id: get(row, "id")?,
        team_id: get(row, "team_id")?,
        name: get(row, "name")?,
        version: get(row, "version")?,
        metadata: json(row, "metadata")?,
        created_at: time(row, "created_at")?,
        updated_at: time(row, "updated_at")?,
    })
}

impl Store {
    pub async fn create_secret(&self, new: &NewSecret) -> Result<Secret> {
        let (nonce, sealed) = self.cipher.seal(&new.id, &new.value)?;
        let now = now_ms();
        let row = sqlx::query(&format!(
            "INSERT INTO secrets (id, team_id, name, version, metadata, value_nonce, value_sealed, \
             created_at, updated_at) VALUES ($1, $2, $3, 1, $4, $5, $6, $7, $7) RETURNING {COLUMNS}"
        ))
        .bind(&new.id)
        .bind(&new.team_id)
        .bind(new.name.to_lowercase())
        .bind(to_json(&new.metadata)?)
        .bind(nonce)
        .bind(sealed)
        .bind(now)
        .fetch_one(&self.writer)
        .await
        .map_err(|e| match StoreError::from(e) {
            StoreError::Conflict(_) => StoreError::Conflict(format!("secret {:?}", new.name)),
            other => other,
        })?;
        secret(&row)
    }

    /// The team's secret with that id or (any case) name.
    pub async fn secret(&self, team_id: &str, id_or_name: &str) -> Result<Option<Secret>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM secrets WHERE team_id = $1 AND (id = $2 OR name = $3)"
        ))
        .bind(team_id)
        .bind(id_or_name)
        .bind(id_or_name.to_lowercase())
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(secret).transpose()
    }

    /// Up to `limit` of the team's secrets after the one with id `after` (oldest first).
    pub async fn secrets(
        &self,
        team_id: &str,
        limit: i64,
        after: Option<&str>,
    ) -> Result<Vec<Secret>> {
        let rows = match after {
            None => {
                sqlx::query(&format!(
                    "SELECT {COLUMNS} FROM secrets WHERE team_id = $1 ORDER BY created_at, id \
                     LIMIT $2"
                ))
                .bind(team_id)
                .bind(limit)
                .fetch_all(&self.reader)
                .await?
            }
            Some(after) => {
                sqlx::query(&format!(
                    "SELECT {COLUMNS} FROM secrets s WHERE team_id = $1 AND EXISTS (SELECT 1 FROM \
                     secrets a WHERE a.id = $2 AND a.team_id = $1 AND (s.created_at > a.created_at \
                     OR (s.created_at = a.created_at AND s.id > a.id))) ORDER BY created_at, id \
                     LIMIT $3"
                ))
                .bind(team_id)
                .bind(after)
                .bind(limit)
                .fetch_all(&self.reader)
                .await?
            }
        };
        rows.iter().map(secret).collect()
    }

    pub async fn count_secrets(&self, team_id: &str) -> Result<i64> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM secrets WHERE team_id = $1")
            .bind(team_id)
            .fetch_one(&self.reader)
            .await?;
        get(&row, "n")
    }

    /// A new value (and, when given, new metadata): the version goes up by one. `None` when
    /// the team has no such secret.
    pub async fn update_secret(
        &self,
        team_id: &str,
        id_or_name: &str,
        value: &str,
        metadata: Option<&BTreeMap<String, String>>,
    ) -> Result<Option<Secret>> {
        let Some(current) = self.secret(team_id, id_or_name).await? else {
            return Ok(None);
        };
        let (nonce, sealed) = self.cipher.seal(&current.id, value)?;
        let metadata = metadata.unwrap_or(&current.metadata);
        let row = sqlx::query(&format!(
            "UPDATE secrets SET version = version + 1, metadata = $1, value_nonce = $2, \
             value_sealed = $3, updated_at = $4 WHERE id = $5 AND team_id = $6 RETURNING {COLUMNS}"
        ))
        .bind(to_json(metadata)?)
        .bind(nonce)
        .bind(sealed)
        .bind(now_ms())
        .bind(&current.id)
        .bind(team_id)
        .fetch_optional(&self.writer)
        .await?;
        row.as_ref().map(secret).transpose()
    }

    pub async fn delete_secret(&self, team_id: &str, id_or_name: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM secrets WHERE team_id = $1 AND (id = $2 OR name = $3)")
            .bind(team_id)
            .bind(id_or_name)
            .bind(id_or_name.to_lowercase())
            .execute(&self.writer)
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// The decrypted value, for the egress path only. Never return it to a client.
    pub async fn secret_value(&self, team_id: &str, id: &str) -> Result<Option<String>> {
        let row = sqlx::query(
            "SELECT value_nonce, value_sealed FROM secrets WHERE team_id = $1 AND id = $2",
        )
        .bind(team_id)
        .bind(id)
        .fetch_optional(&self.reader)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let nonce: Vec<u8> = get(&row, "value_nonce")?;
        let sealed: Vec<u8> = get(&row, "value_sealed")?;
        self.cipher.open(id, &nonce, &sealed).map(Some)
    }
}
