//! Bounded counters for team admission: a CAS loop on one key holding a decimal count, so no
//! interleaving of acquirers can push it past the limit.

use std::sync::Arc;

use crate::engine::{Cmp, Engine, Op};
use crate::{Entry, KvError, COUNTERS};

fn parse(key: &str, entry: &Option<Entry>) -> Result<u64, KvError> {
    match entry {
        None => Ok(0),
        Some(e) => std::str::from_utf8(&e.value)
            .ok()
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

async fn swap(
    engine: &Arc<dyn Engine>,
    key: &str,
    entry: &Option<Entry>,
    value: u64,
) -> Result<bool, KvError> {
    let op = Op::Put {
        key: key.to_owned(),
        value: value.to_string().into_bytes(),
        lease: None,
    };
    Ok(engine
        .txn(vec![unchanged(key, entry)], vec![op])
        .await?
        .succeeded)
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
        value: value.to_string().into_bytes(),
        lease: None,
    };
    engine.txn(Vec::new(), vec![op]).await?;
    Ok(())
}
