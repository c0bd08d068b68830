//! Webhooks (secrets sealed with ChaCha20-Poly1305, the webhook id as associated data so a
//! sealed secret cannot be moved to another row), delivery attempts and stats, and the outbox
//! the leader's dispatcher claims.

use std::time::Duration;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use sqlx::any::AnyRow;

use crate::sql::{flag, get, json, ms, now_ms, opt_time, time, to_json};
use crate::{
    Backend, Delivery, DeliveryAttempt, NewWebhook, OutboxItem, Result, Store, StoreError, Webhook,
    WebhookPatch, WebhookStats,
};

#[derive(Clone)]
pub(crate) struct SecretBox {
    cipher: ChaCha20Poly1305,
}

impl SecretBox {
    pub(crate) fn new(key: &[u8; 32]) -> SecretBox {
        SecretBox {
            cipher: ChaCha20Poly1305::new(Key::from_slice(key)),
        }
    }

    pub(crate) fn seal(&self, webhook_id: &str, secret: &str) -> Result<(Vec<u8>, Vec<u8>)> {
        let nonce: [u8; 12] = rand::random();
        let sealed = self
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: secret.as_bytes(),
                    aad: webhook_id.as_bytes(),
                },
            )
            .map_err(|_| StoreError::Crypto)?;
        Ok((nonce.to_vec(), sealed))
    }

    pub(crate) fn open(&self, webhook_id: &str, nonce: &[u8], sealed: &[u8]) -> Result<String> {
        if nonce.len() != 12 {
            return Err(StoreError::Crypto);
        }
        let plain = self
            .cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: webhook_id.as_bytes(),
                },
            )
            .map_err(|_| StoreError::Crypto)?;
        String::from_utf8(plain).map_err(|_| StoreError::Crypto)
    }
}

const COLUMNS: &str = "id, team_id, name, url, enabled, events, created_at, updated_at";
const DELIVERY_COLUMNS: &str =
    "id, webhook_id, event_id, delivery_id, attempt, status_code, success, duration_ms, error, created_at";

fn webhook(row: &AnyRow) -> Result<Webhook> {
    Ok(Webhook {
        id: get(row, "id")?,
        team_id: get(row, "team_id")?,
        name: get(row, "name")?,
        url: get(row, "url")?,
        enabled: flag(row, "enabled")?,
        events: json(row, "events")?,
        created_at: time(row, "created_at")?,
        updated_at: time(row, "updated_at")?,
    })
}

fn delivery(row: &AnyRow) -> Result<Delivery> {
    let event_id: String = get(row, "event_id")?;
    Ok(Delivery {
        id: get(row, "id")?,
        webhook_id: get(row, "webhook_id")?,
        event_id: event_id
            .parse()
            .map_err(|_| StoreError::Malformed(format!("event id {event_id:?}")))?,
        delivery_id: get(row, "delivery_id")?,
        attempt: get(row, "attempt")?,
        status_code: get(row, "status_code")?,
        success: flag(row, "success")?,
        duration_ms: get(row, "duration_ms")?,
        error: get(row, "error")?,
        created_at: time(row, "created_at")?,
    })
}

/// The fence row the outbox claims check the leader epoch against.
const OUTBOX_FENCE: &str = "outbox";

impl Store {
    pub async fn create_webhook(&self, new: &NewWebhook) -> Result<Webhook> {
        let (nonce, sealed) = self.cipher.seal(&new.id, &new.signature_secret)?;
        let now = now_ms();
        let row = sqlx::query(&format!(
            "INSERT INTO webhooks (id, team_id, name, url, enabled, events, secret_nonce, secret_sealed, created_at, \
             updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9) RETURNING {COLUMNS}"
        ))
        .bind(&new.id)
        .bind(&new.team_id)
        .bind(&new.name)
        .bind(&new.url)
        .bind(i64::from(new.enabled))
        .bind(to_json(&new.events)?)
        .bind(nonce)
        .bind(sealed)
        .bind(now)
        .fetch_one(&self.writer)
        .await?;
        webhook(&row)
    }

    pub async fn webhook(&self, team_id: &str, id: &str) -> Result<Option<Webhook>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM webhooks WHERE id = $1 AND team_id = $2"
        ))
        .bind(id)
        .bind(team_id)
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(webhook).transpose()
    }

    pub async fn webhooks(&self, team_id: &str) -> Result<Vec<Webhook>> {
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM webhooks WHERE team_id = $1 ORDER BY created_at, id"
        ))
        .bind(team_id)
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(webhook).collect()
    }

    /// Applies a partial update; `None` if the team has no such webhook.
    pub async fn update_webhook(
        &self,
        team_id: &str,
        id: &str,
        patch: &WebhookPatch,
    ) -> Result<Option<Webhook>> {
        let mut tx = self.begin().await?;
        let c = tx.connection();
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM webhooks WHERE id = $1 AND team_id = $2"
        ))
        .bind(id)
        .bind(team_id)
        .fetch_optional(&mut *c)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let mut hook = webhook(&row)?;
        if let Some(name) = &patch.name {
            hook.name = name.clone();
        }
        if let Some(url) = &patch.url {
            hook.url = url.clone();
        }
        if let Some(enabled) = patch.enabled {
            hook.enabled = enabled;
        }
        if let Some(events) = &patch.events {
            hook.events = events.clone();
        }
        let now = now_ms();
        sqlx::query("UPDATE webhooks SET name = $1, url = $2, enabled = $3, events = $4, updated_at = $5 WHERE id = $6")
            .bind(&hook.name)
            .bind(&hook.url)
            .bind(i64::from(hook.enabled))
            .bind(to_json(&hook.events)?)
            .bind(now)
            .bind(id)
            .execute(&mut *c)
            .await?;
        if let Some(secret) = &patch.signature_secret {
            let (nonce, sealed) = self.cipher.seal(id, secret)?;
            sqlx::query("UPDATE webhooks SET secret_nonce = $1, secret_sealed = $2 WHERE id = $3")
                .bind(nonce)
                .bind(sealed)
                .bind(id)
                .execute(&mut *c)
                .await?;
        }
        tx.commit().await?;
        hook.updated_at = crate::sql::from_ms(now);
        Ok(Some(hook))
    }

    /// Deletes a webhook with its deliveries and pending outbox rows.
    pub async fn delete_webhook(&self, team_id: &str, id: &str) -> Result<bool> {
        let mut tx = self.begin().await?;
        let c = tx.connection();
        let done = sqlx::query("DELETE FROM webhooks WHERE id = $1 AND team_id = $2")
            .bind(id)
            .bind(team_id)
            .execute(&mut *c)
            .await?;
        if done.rows_affected() > 0 {
            sqlx::query("DELETE FROM outbox WHERE webhook_id = $1")
                .bind(id)
                .execute(&mut *c)
                .await?;
            sqlx::query("DELETE FROM webhook_deliveries WHERE webhook_id = $1")
                .bind(id)
                .execute(&mut *c)
                .await?;
        }
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    /// The decrypted signature secret, for the dispatcher only. Never return it to a client.
    pub async fn webhook_secret(&self, id: &str) -> Result<Option<String>> {
        let row = sqlx::query("SELECT secret_nonce, secret_sealed FROM webhooks WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.reader)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let nonce: Vec<u8> = get(&row, "secret_nonce")?;
        let sealed: Vec<u8> = get(&row, "secret_sealed")?;
        self.cipher.open(id, &nonce, &sealed).map(Some)
    }

    /// Records one delivery attempt.
    pub async fn record_delivery(&self, attempt: &DeliveryAttempt) -> Result<Delivery> {
        let row = sqlx::query(&format!(
            "INSERT INTO webhook_deliveries ({DELIVERY_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
             RETURNING {DELIVERY_COLUMNS}"
        ))
        .bind(uuid::Uuid::new_v4().to_string())
        .bind(&attempt.webhook_id)
        .bind(attempt.event_id.to_string())
        .bind(&attempt.delivery_id)
        .bind(attempt.attempt)
        .bind(attempt.status_code)
        .bind(i64::from(attempt.success))
        .bind(attempt.duration_ms)
        .bind(attempt.error.clone())
        .bind(ms(attempt.at))
        .fetch_one(&self.writer)
        .await?;
        delivery(&row)
    }

    /// Attempts, newest first.
    pub async fn deliveries(
        &self,
        webhook_id: &str,
        limit: i64,
        offset: i64,
    ) -> Result<Vec<Delivery>> {
        let limit = if limit <= 0 { 100 } else { limit.min(1000) };
        let rows = sqlx::query(&format!(
            "SELECT {DELIVERY_COLUMNS} FROM webhook_deliveries WHERE webhook_id = $1 \
             ORDER BY created_at DESC, id DESC LIMIT $2 OFFSET $3"
        ))
        .bind(webhook_id)
        .bind(limit)
        .bind(offset.max(0))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(delivery).collect()
    }

    pub async fn webhook_stats(&self, webhook_id: &str) -> Result<WebhookStats> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS attempts, COUNT(CASE WHEN success = 1 THEN 1 END) AS successes, \
             CAST(COALESCE(AVG(duration_ms), 0) AS BIGINT) AS average_duration_ms, \
             MAX(created_at) AS last_attempt_at, \
             MAX(CASE WHEN success = 1 THEN created_at END) AS last_success_at, \
             MAX(CASE WHEN success = 0 THEN created_at END) AS last_failure_at \
             FROM webhook_deliveries WHERE webhook_id = $1",
        )
        .bind(webhook_id)
        .fetch_one(&self.reader)
        .await?;
        let pending = sqlx::query(
            "SELECT COUNT(*) AS n FROM outbox WHERE webhook_id = $1 AND done_at IS NULL",
        )
        .bind(webhook_id)
        .fetch_one(&self.reader)
        .await?;
        let attempts: i64 = get(&row, "attempts")?;
        let successes: i64 = get(&row, "successes")?;
        Ok(WebhookStats {
            attempts,
            successes,
            failures: attempts - successes,
            average_duration_ms: get(&row, "average_duration_ms")?,
            last_attempt_at: opt_time(&row, "last_attempt_at")?,
            last_success_at: opt_time(&row, "last_success_at")?,
            last_failure_at: opt_time(&row, "last_failure_at")?,
            pending: get(&pending, "n")?,
        })
    }

    /// Claims up to `limit` undelivered outbox rows, oldest first, for `visibility` (after
    /// which an unfinished claim may be taken again, e.g. after the dispatcher died). Claims
    /// of an older epoch are taken over at once. Fails with [`StoreError::Fenced`] if a newer
    /// leader epoch has claimed before: a deposed leader stops.
    pub async fn claim_outbox(
        &self,
        dispatcher: &str,
        epoch: i64,
        limit: i64,
        visibility: Duration,
    ) -> Result<Vec<OutboxItem>> {
        let mut tx = self.begin().await?;
        let c = tx.connection();
        let fenced = sqlx::query(
            "INSERT INTO fences (name, epoch) VALUES ($1, $2) ON CONFLICT (name) \
             DO UPDATE SET epoch = excluded.epoch WHERE fences.epoch <= excluded.epoch",
        )
        .bind(OUTBOX_FENCE)
        .bind(epoch)
        .execute(&mut *c)
        .await?;
        if fenced.rows_affected() == 0 {
            return Err(StoreError::Fenced);
        }
        let now = now_ms();
        let lock = match self.backend {
            // Concurrent claimers skip each other's rows instead of queueing behind them.
            Backend::Postgres => " FOR UPDATE SKIP LOCKED",
            // One writer connection: this statement is already exclusive.
            Backend::Sqlite => "",
        };
        let rows = sqlx::query(&format!(
            "UPDATE outbox SET claimed_by = $1, claimed_epoch = $2, claimed_until = $3 WHERE seq IN \
             (SELECT seq FROM outbox WHERE done_at IS NULL AND \
              (claimed_until IS NULL OR claimed_until < $4 OR claimed_epoch < $2) \
              ORDER BY seq LIMIT $5{lock}) \
             RETURNING seq, webhook_id, event_id, delivery_id"
        ))
        .bind(dispatcher)
        .bind(epoch)
        .bind(now + visibility.as_millis() as i64)
        .bind(now)
        .bind(limit.max(1))
        .fetch_all(&mut *c)
        .await?;
        let mut items = Vec::with_capacity(rows.len());
        for row in &rows {
            let event_id: String = get(row, "event_id")?;
            let event = sqlx::query(&format!(
                "SELECT {} FROM events WHERE id = $1",
                crate::events::COLUMNS
            ))
            .bind(&event_id)
            .fetch_optional(&mut *c)
            .await?;
            let Some(event) = event else { continue };
            items.push(OutboxItem {
                seq: get(row, "seq")?,
                webhook_id: get(row, "webhook_id")?,
                delivery_id: get(row, "delivery_id")?,
                event: crate::events::event(&event)?,
            });
        }
        tx.commit().await?;
        items.sort_by_key(|i| i.seq);
        Ok(items)
    }

    /// Marks a claimed row delivered (or given up on); `false` if the claim was lost to a
    /// newer epoch or already completed.
    pub async fn complete_outbox(&self, epoch: i64, seq: i64) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE outbox SET done_at = $1 WHERE seq = $2 AND claimed_epoch = $3 AND done_at IS NULL \
             AND $3 >= (SELECT epoch FROM fences WHERE name = $4)",
        )
        .bind(now_ms())
        .bind(seq)
        .bind(epoch)
        .bind(OUTBOX_FENCE)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() > 0)
    }
}
