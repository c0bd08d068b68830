//! Bounded counters for team admission: a CAS loop on one key holding a decimal count, so no
//! interleaving of acquirers can push it past the limit.
//!
//! A transaction whose answer was lost (a leader change, a member down) is retried by the
//! engine, and the retry's comparison then fails if the first attempt had applied. To tell
//! that from losing the race to another writer, each write puts a marker key named by a random
//! nonce in the same transaction: the marker exists exactly when that write applied, whatever
//! was written to the counter since. The marker is deleted once the outcome is known (one left
//! behind by a process that died in between names nothing and is only a few bytes).

use std::sync::Arc;

use crate::engine::{Cmp, Engine, Op};
use crate::{Entry, KvError, COUNTERS};

/// Markers of counter writes that applied (see the module's docs).
const APPLIED: &str = "ca/";

fn parse(key: &str, entry: &Option<Entry>) -> Result<u64, KvError> {
    match entry {
        None => Ok(0),
        Some(e) => std::str::from_utf8(&e.value)
            .ok()
            .and_then(|s| s.split(':').next())
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| KvError::Malformed(key.to_owned())),
    }
}

fn unchanged(key: &str, entry: &Option<Entry>) -> Cmp {
    match entry {
        None => Cmp::CreateRevision(key.to_owned(), 0),
        Some(e) => Cmp::ModRevision(key.to_owned(), e.mod_revision),
    }
}

fn encode(count: u64) -> Vec<u8> {
    format!("{count}:{:016x}", rand::random::<u64>()).into_bytes()
}

/// Writes `count` if the counter is still `entry`; true when this write applied.
async fn swap(
    engine: &Arc<dyn Engine>,
    key: &str,
    entry: &Option<Entry>,
    count: u64,
) -> Result<bool, KvError> {
    let marker = format!(
        "{APPLIED}{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    );
    let ops = vec![
        Op::Put {
            key: key.to_owned(),
            value: encode(count),
            lease: None,
        },
        Op::Put {
            key: marker.clone(),
            value: key.as_bytes().to_vec(),
            lease: None,
        },
    ];
    let applied = if engine
        .txn(vec![unchanged(key, entry)], ops)
        .await?
        .succeeded
    {
        true
    } else {
        // Our own earlier attempt of this very write may be what made the comparison fail.
        engine.get(&marker).await?.is_some()
    };
    if applied {
        let delete = Op::Delete { key: marker };
        if let Err(e) = engine.txn(Vec::new(), vec![delete]).await {
            tracing::debug!(error = %e, "deleting an admission marker failed; it stays behind");
        }
    }
    Ok(applied)
}

pub(crate) async fn acquire(
    engine: &Arc<dyn Engine>,
    name: &str,
    limit: u64,
) -> Result<bool, KvError> {
    let key = format!("{COUNTERS}{name}");
    loop {
        let entry = engine.get(&key).await?;
        let count = parse(&key, &entry)?;
        if count >= limit {
            return Ok(false);
        }
        if swap(engine, &key, &entry, count + 1).await? {
            return Ok(true);
        }
        tokio::task::yield_now().await;
    }
}

pub(crate) async fn release(engine: &Arc<dyn Engine>, name: &str) -> Result<(), KvError> {
    let key = format!("{COUNTERS}{name}");
    loop {
        let entry = engine.get(&key).await?;
        let count = parse(&key, &entry)?;
        if count == 0 {
            return Ok(());
        }
        if swap(engine, &key, &entry, count - 1).await? {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
}

pub(crate) async fn value(engine: &Arc<dyn Engine>, name: &str) -> Result<u64, KvError> {
    let key = format!("{COUNTERS}{name}");
    parse(&key, &engine.get(&key).await?)
}

pub(crate) async fn set(engine: &Arc<dyn Engine>, name: &str, value: u64) -> Result<(), KvError> {
    let key = format!("{COUNTERS}{name}");
    let op = Op::Put {
        key,
        value: encode(value),
        lease: None,
    };
    engine.txn(Vec::new(), vec![op]).await?;
    Ok(())
}
