//! Teams and API keys.

use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::AnyConnection;

use crate::sql::{get, now_ms, opt_time, time};
use crate::{ApiKey, NewTeam, Result, Store, Team, TeamLimits};

/// The stored form of an API key: lowercase hex SHA-256 of the raw key.
pub fn hash_api_key(raw_key: &str) -> String {
    hex::encode(Sha256::digest(raw_key.as_bytes()))
}

fn mask(raw_key: &str) -> String {
    let chars: Vec<char> = raw_key.chars().collect();
    if chars.len() <= 10 {
        return "*".repeat(chars.len());
    }
    let head: String = chars[..6].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}…{tail}")
}

fn team(row: &AnyRow) -> Result<Team> {
    Ok(Team {
        id: get(row, "id")?,
        name: get(row, "name")?,
        slug: get(row, "slug")?,
        limits: TeamLimits {
            max_concurrent_sandboxes: get(row, "max_concurrent_sandboxes")?,
            max_vcpus: get(row, "max_vcpus")?,
            max_memory_mb: get(row, "max_memory_mb")?,
            max_disk_mb: get(row, "max_disk_mb")?,
            max_lifetime_secs: get(row, "max_lifetime_secs")?,
        },
        created_at: time(row, "created_at")?,
    })
}

fn api_key(row: &AnyRow) -> Result<ApiKey> {
    Ok(ApiKey {
        id: get(row, "id")?,
        team_id: get(row, "team_id")?,
        name: get(row, "name")?,
        mask: get(row, "mask")?,
        created_at: time(row, "created_at")?,
        last_used_at: opt_time(row, "last_used_at")?,
        revoked_at: opt_time(row, "revoked_at")?,
    })
}

const TEAM_COLUMNS: &str =
    "id, name, slug, max_concurrent_sandboxes, max_vcpus, max_memory_mb, max_disk_mb, \
                            max_lifetime_secs, created_at";
const KEY_COLUMNS: &str = "id, team_id, name, mask, created_at, last_used_at, revoked_at";

pub(crate) async fn create_team(c: &mut AnyConnection, new: &NewTeam) -> Result<Team> {
    let l = &new.limits;
    let row = sqlx::query(&format!(
        "INSERT INTO teams ({TEAM_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING {TEAM_COLUMNS}"
    ))
    .bind(&new.id)
    .bind(&new.name)
    .bind(&new.slug)
    .bind(l.max_concurrent_sandboxes)
    .bind(l.max_vcpus)
    .bind(l.max_memory_mb)
    .bind(l.max_disk_mb)
    .bind(l.max_lifetime_secs)
    .bind(now_ms())
    .fetch_one(c)
    .await?;
    team(&row)
}

impl Store {
    pub async fn create_team(&self, new: &NewTeam) -> Result<Team> {
        let mut tx = self.begin().await?;
        let team = tx.create_team(new).await?;
        tx.commit().await?;
        Ok(team)
    }

    pub async fn team(&self, id: &str) -> Result<Option<Team>> {
        let row = sqlx::query(&format!("SELECT {TEAM_COLUMNS} FROM teams WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(team).transpose()
    }

    pub async fn team_by_slug(&self, slug: &str) -> Result<Option<Team>> {
        let row = sqlx::query(&format!("SELECT {TEAM_COLUMNS} FROM teams WHERE slug = $1"))
            .bind(slug)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(team).transpose()
    }

    pub async fn teams(&self) -> Result<Vec<Team>> {
        let rows = sqlx::query(&format!(
            "SELECT {TEAM_COLUMNS} FROM teams ORDER BY created_at, id"
        ))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(team).collect()
    }

    /// Replaces a team's limits; `false` if no such team.
    pub async fn set_team_limits(&self, team_id: &str, l: &TeamLimits) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE teams SET max_concurrent_sandboxes = $1, max_vcpus = $2, max_memory_mb = $3, \
             max_disk_mb = $4, max_lifetime_secs = $5 WHERE id = $6",
        )
        .bind(l.max_concurrent_sandboxes)
        .bind(l.max_vcpus)
        .bind(l.max_memory_mb)
        .bind(l.max_disk_mb)
        .bind(l.max_lifetime_secs)
        .bind(team_id)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() > 0)
    }

    /// Stores the hash of `raw_key` for the team. The caller shows the raw key once.
    pub async fn create_api_key(&self, team_id: &str, name: &str, raw_key: &str) -> Result<ApiKey> {
        let id = uuid::Uuid::new_v4().to_string();
        let row = sqlx::query(&format!(
            "INSERT INTO api_keys (id, team_id, name, key_hash, mask, created_at) VALUES ($1, $2, $3, $4, $5, $6) \
             RETURNING {KEY_COLUMNS}"
        ))
        .bind(&id)
        .bind(team_id)
        .bind(name)
        .bind(hash_api_key(raw_key))
        .bind(mask(raw_key))
        .bind(now_ms())
        .fetch_one(&self.writer)
        .await?;
        api_key(&row)
    }

    /// The unrevoked key whose hash matches `raw_key`.
    pub async fn api_key_by_raw(&self, raw_key: &str) -> Result<Option<ApiKey>> {
        self.api_key_by_hash(&hash_api_key(raw_key)).await
    }

    /// The unrevoked key with this hash (see [`hash_api_key`]).
    pub async fn api_key_by_hash(&self, key_hash: &str) -> Result<Option<ApiKey>> {
        let row = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys WHERE key_hash = $1 AND revoked_at IS NULL"
        ))
        .bind(key_hash)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(api_key).transpose()
    }

    /// One key by id, revoked or not.
    pub async fn api_key(&self, key_id: &str) -> Result<Option<ApiKey>> {
        let row = sqlx::query(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1"))
            .bind(key_id)
            .fetch_optional(&self.reader)
            .await?;
        row.as_ref().map(api_key).transpose()
    }

    /// The team's keys, revoked ones included.
    pub async fn api_keys(&self, team_id: &str) -> Result<Vec<ApiKey>> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys WHERE team_id = $1 ORDER BY created_at, id"
        ))
        .bind(team_id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(api_key).collect()
    }

    /// Revokes a key; `false` if the team has no such unrevoked key.
    pub async fn revoke_api_key(&self, team_id: &str, key_id: &str) -> Result<bool> {
        let done =
            sqlx::query("UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND team_id = $3 AND revoked_at IS NULL")
                .bind(now_ms())
                .bind(key_id)
                .bind(team_id)
                .execute(&self.writer)
                .await?;
        Ok(done.rows_affected() > 0)
    }
}
