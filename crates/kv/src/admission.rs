//! Bounded counters for team admission: a CAS loop on one key holding a decimal count, so no
//! interleaving of acquirers can push it past the limit. Each write also carries a random
//! nonce (`<count>:<nonce>`): when a retried transaction reports a failed comparison, the nonce
//! tells whether the first attempt had in fact applied, so a retry never counts twice.

use std::sync::Arc;

use crate::engine::{Cmp, Engine, Op};
use crate::{Entry, KvError, COUNTERS};

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

async fn swap(
    engine: &Arc<dyn Engine>,
    key: &str,
    entry: &Option<Entry>,
    count: u64,
) -> Result<bool, KvError> {
    let value = encode(count);
    let op = Op::Put {
        key: key.to_owned(),
        value: value.clone(),
        lease: None,
    };
    if engine
        .txn(vec![unchanged(key, entry)], vec![op])
        .await?
        .succeeded
    {
        return Ok(true);
    }
    // Our own earlier attempt of this very write may be what made the comparison fail.
    Ok(engine.get(key).await?.is_some_and(|e| e.value == value))
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
