//! Idempotency records. The record's expiry is kept in its value because a lease TTL is only a
//! minimum (etcd extends leases across leader changes; the embedded sweeper runs periodically).
//! The lease is garbage collection, the value's `expires_at` is the truth.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::engine::{Cmp, Engine, Op};
use crate::{KvError, IDEMPOTENCY};

/// A stored idempotency record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyRecord {
    pub value: Vec<u8>,
    pub expires_at: SystemTime,
}

/// What [`crate::Kv::idempotency_put_if_absent`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IdempotencyOutcome {
    /// The record was stored: this caller owns the key.
    Inserted,
    /// An unexpired record exists: reuse its value.
    Exists(IdempotencyRecord),
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// `[expires_at ms: 8][nonce: 8][value]`; the nonce recognises our own write after a retry.
fn encode(value: &[u8], expires_at: SystemTime) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + value.len());
    out.extend_from_slice(&unix_ms(expires_at).to_be_bytes());
    out.extend_from_slice(&rand::random::<u64>().to_be_bytes());
    out.extend_from_slice(value);
    out
}

fn decode(key: &str, raw: &[u8]) -> Result<IdempotencyRecord, KvError> {
    let malformed = || KvError::Malformed(key.to_owned());
    let (head, rest) = raw.split_at_checked(8).ok_or_else(malformed)?;
    let value = rest.get(8..).ok_or_else(malformed)?;
    let mut ms = [0u8; 8];
    ms.copy_from_slice(head);
    let ms = u64::try_from(i64::from_be_bytes(ms)).unwrap_or(0);
    Ok(IdempotencyRecord {
        value: value.to_vec(),
        expires_at: UNIX_EPOCH + Duration::from_millis(ms),
    })
}

pub(crate) async fn put_if_absent(
    engine: &Arc<dyn Engine>,
    name: &str,
    value: &[u8],
    expires_at: SystemTime,
) -> Result<IdempotencyOutcome, KvError> {
    let key = format!("{IDEMPOTENCY}{name}");
    loop {
        let now = SystemTime::now();
        let current = engine.get(&key).await?;
        let cmp = match &current {
            Some(entry) => {
                let record = decode(&key, &entry.value)?;
                if record.expires_at > now {
                    return Ok(IdempotencyOutcome::Exists(record));
                }
                Cmp::ModRevision(key.clone(), entry.mod_revision)
            }
            None => Cmp::CreateRevision(key.clone(), 0),
        };
        let remaining = expires_at.duration_since(now).unwrap_or_default();
        // The lease only collects garbage: one second past the value's own expiry.
        let lease = engine.grant(remaining + Duration::from_secs(1)).await?;
        let encoded = encode(value, expires_at);
        let op = Op::Put {
            key: key.clone(),
            value: encoded.clone(),
            lease: Some(lease),
        };
        if engine.txn(vec![cmp], vec![op]).await?.succeeded {
            return Ok(IdempotencyOutcome::Inserted);
        }
        if engine.get(&key).await?.is_some_and(|e| e.value == encoded) {
            // A retried request whose first attempt had applied.
            return Ok(IdempotencyOutcome::Inserted);
        }
        engine.revoke(lease).await?;
    }
}

pub(crate) async fn get(
    engine: &Arc<dyn Engine>,
    name: &str,
) -> Result<Option<IdempotencyRecord>, KvError> {
    let key = format!("{IDEMPOTENCY}{name}");
    let Some(entry) = engine.get(&key).await? else {
        return Ok(None);
    };
    let record = decode(&key, &entry.value)?;
    Ok((record.expires_at > SystemTime::now()).then_some(record))
}

pub(crate) async fn delete(engine: &Arc<dyn Engine>, name: &str) -> Result<(), KvError> {
    let key = format!("{IDEMPOTENCY}{name}");
    engine.txn(Vec::new(), vec![Op::Delete { key }]).await?;
    Ok(())
}
