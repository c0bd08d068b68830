//! The embedded backend: the whole key space in memory, written through to `redb` on every
//! change, in one process. Lease expiry is by wall clock (persisted, so keys of a crashed
//! process still expire after a restart); expired keys are invisible at once and swept every
//! 100 ms. Waiters are woken by a revision watch channel.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use redb::{Database, ReadableTable, TableDefinition};
use tokio::sync::watch;

use crate::engine::{Cmp, Engine, Op, TxnOutcome};
use crate::{Entry, KvError, LeaseId, Revision};

const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
const LEASES: TableDefinition<i64, &[u8]> = TableDefinition::new("leases");
const META: TableDefinition<&str, i64> = TableDefinition::new("meta");

fn db_error(e: impl Into<redb::Error>) -> KvError {
    KvError::Embedded(Box::new(e.into()))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[derive(Clone)]
struct Stored {
    value: Vec<u8>,
    create: Revision,
    modified: Revision,
    lease: LeaseId,
}

impl Stored {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + self.value.len());
        out.extend_from_slice(&self.create.to_be_bytes());
        out.extend_from_slice(&self.modified.to_be_bytes());
        out.extend_from_slice(&self.lease.to_be_bytes());
        out.extend_from_slice(&self.value);
        out
    }

    fn decode(raw: &[u8]) -> Option<Stored> {
        let int = |i: usize| {
            raw.get(i * 8..i * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map(i64::from_be_bytes)
        };
        Some(Stored {
            create: int(0)?,
            modified: int(1)?,
            lease: int(2)?,
            value: raw.get(24..)?.to_vec(),
        })
    }
}

#[derive(Clone, Copy)]
struct LeaseRecord {
    expires_ms: i64,
    ttl_ms: i64,
}

impl LeaseRecord {
    fn encode(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.expires_ms.to_be_bytes());
        out[8..].copy_from_slice(&self.ttl_ms.to_be_bytes());
        out
    }

    fn decode(raw: &[u8]) -> Option<LeaseRecord> {
        let int = |i: usize| {
            raw.get(i * 8..i * 8 + 8)
                .and_then(|b| b.try_into().ok())
                .map(i64::from_be_bytes)
        };
        Some(LeaseRecord {
            expires_ms: int(0)?,
            ttl_ms: int(1)?,
        })
    }
}

struct State {
    db: Database,
    revision: Revision,
    next_lease: LeaseId,
    keys: BTreeMap<String, Stored>,
    leases: HashMap<LeaseId, LeaseRecord>,
}

/// One durable change, applied to redb first and to memory only after the commit.
#[derive(Default)]
struct Change {
    puts: Vec<(String, Stored)>,
    deletes: Vec<String>,
    lease_puts: Vec<(LeaseId, LeaseRecord)>,
    lease_deletes: Vec<LeaseId>,
    revision: Option<Revision>,
    next_lease: Option<LeaseId>,
}

impl State {
    fn live(&self, stored: &Stored, now: i64) -> bool {
        stored.lease == 0
            || self
                .leases
                .get(&stored.lease)
                .is_some_and(|l| l.expires_ms > now)
    }

    fn visible(&self, key: &str, now: i64) -> Option<&Stored> {
        self.keys.get(key).filter(|s| self.live(s, now))
    }

    fn commit(&mut self, change: Change) -> Result<(), KvError> {
        let txn = self.db.begin_write().map_err(db_error)?;
        {
            let mut keys = txn.open_table(KEYS).map_err(db_error)?;
            for (k, v) in &change.puts {
                keys.insert(k.as_str(), v.encode().as_slice())
                    .map_err(db_error)?;
            }
            for k in &change.deletes {
                keys.remove(k.as_str()).map_err(db_error)?;
            }
            let mut leases = txn.open_table(LEASES).map_err(db_error)?;
            for (id, l) in &change.lease_puts {
                leases
                    .insert(*id, l.encode().as_slice())
                    .map_err(db_error)?;
            }
            for id in &change.lease_deletes {
                leases.remove(*id).map_err(db_error)?;
            }
            let mut meta = txn.open_table(META).map_err(db_error)?;
            if let Some(r) = change.revision {
                meta.insert("revision", r).map_err(db_error)?;
            }
            if let Some(n) = change.next_lease {
                meta.insert("next_lease", n).map_err(db_error)?;
            }
        }
        txn.commit().map_err(db_error)?;
        for (k, v) in change.puts {
            self.keys.insert(k, v);
        }
        for k in change.deletes {
            self.keys.remove(&k);
        }
        for (id, l) in change.lease_puts {
            self.leases.insert(id, l);
        }
        for id in change.lease_deletes {
            self.leases.remove(&id);
        }
        if let Some(r) = change.revision {
            self.revision = r;
        }
        if let Some(n) = change.next_lease {
            self.next_lease = n;
        }
        Ok(())
    }

    /// Removes leases in `ids` and every key bound to them, in one new revision.
    fn drop_leases(&mut self, ids: &[LeaseId]) -> Result<bool, KvError> {
        if ids.is_empty() {
            return Ok(false);
        }
        let deletes: Vec<String> = self
            .keys
            .iter()
            .filter(|(_, s)| s.lease != 0 && ids.contains(&s.lease))
            .map(|(k, _)| k.clone())
            .collect();
        let changed_keys = !deletes.is_empty();
        let change = Change {
            deletes,
            lease_deletes: ids.to_vec(),
            revision: changed_keys.then_some(self.revision + 1),
            ..Change::default()
        };
        self.commit(change)?;
        Ok(changed_keys)
    }
}

struct Inner {
    state: Mutex<State>,
    changes: watch::Sender<Revision>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves memory consistent with redb (memory is only
        // updated after a commit), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn sweep(&self) -> Result<(), KvError> {
        let mut state = self.lock();
        let now = now_ms();
        let expired: Vec<LeaseId> = state
            .leases
            .iter()
            .filter(|(_, l)| l.expires_ms <= now)
            .map(|(id, _)| *id)
            .collect();
        if state.drop_leases(&expired)? {
            self.changes.send_replace(state.revision);
        }
        Ok(())
    }
}

pub(crate) struct EmbeddedEngine {
    inner: Arc<Inner>,
}

impl EmbeddedEngine {
    pub(crate) async fn open(data_dir: &Path) -> Result<Arc<dyn Engine>, KvError> {
        let dir = data_dir.to_path_buf();
        let state = tokio::task::spawn_blocking(move || load(&dir))
            .await
            .map_err(|e| KvError::Embedded(Box::new(e)))??;
        let (changes, _) = watch::channel(state.revision);
        let inner = Arc::new(Inner {
            state: Mutex::new(state),
            changes,
        });
        tokio::spawn(sweeper(Arc::downgrade(&inner)));
        Ok(Arc::new(EmbeddedEngine { inner }))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, KvError> + Send + 'static,
    ) -> Result<T, KvError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| KvError::Embedded(Box::new(e)))?
    }
}

/// How long an open waits for the lock of a database whose owner just died: a child it forked
/// shares the lock's open file until it execs (descriptors close on exec), and a restart after a
/// crash can come sooner than that. A live owner keeps it: the open fails after this.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

fn create_waiting(path: &Path) -> Result<Database, KvError> {
    let start = std::time::Instant::now();
    loop {
        match Database::create(path) {
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if start.elapsed() < LOCK_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            r => return r.map_err(db_error),
        }
    }
}

fn load(dir: &Path) -> Result<State, KvError> {
    std::fs::create_dir_all(dir).map_err(|e| KvError::Embedded(Box::new(e)))?;
    let db = create_waiting(&dir.join("kv.redb"))?;
    {
        // Make sure the tables exist so the read below never sees "table does not exist".
        let txn = db.begin_write().map_err(db_error)?;
        txn.open_table(KEYS).map_err(db_error)?;
        txn.open_table(LEASES).map_err(db_error)?;
        txn.open_table(META).map_err(db_error)?;
        txn.commit().map_err(db_error)?;
    }
    let mut keys = BTreeMap::new();
    let mut leases = HashMap::new();
    let (revision, next_lease);
    {
        let txn = db.begin_read().map_err(db_error)?;
        for row in txn
            .open_table(KEYS)
            .map_err(db_error)?
            .iter()
            .map_err(db_error)?
        {
            let (k, v) = row.map_err(db_error)?;
            let key = k.value().to_owned();
            let stored =
                Stored::decode(v.value()).ok_or_else(|| KvError::Malformed(key.clone()))?;
            keys.insert(key, stored);
        }
        for row in txn
            .open_table(LEASES)
            .map_err(db_error)?
            .iter()
            .map_err(db_error)?
        {
            let (k, v) = row.map_err(db_error)?;
            let lease = LeaseRecord::decode(v.value())
                .ok_or_else(|| KvError::Malformed(format!("lease {}", k.value())))?;
            leases.insert(k.value(), lease);
        }
        let meta = txn.open_table(META).map_err(db_error)?;
        revision = meta
            .get("revision")
            .map_err(db_error)?
            .map(|v| v.value())
            .unwrap_or(0);
        next_lease = meta
            .get("next_lease")
            .map_err(db_error)?
            .map(|v| v.value())
            .unwrap_or(1);
    }
    Ok(State {
        db,
        revision,
        next_lease,
        keys,
        leases,
    })
}

async fn sweeper(inner: Weak<Inner>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let swept = tokio::task::spawn_blocking(move || inner.sweep()).await;
        match swept {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "sweeping expired leases failed"),
            Err(error) => tracing::warn!(%error, "the lease sweeper panicked"),
        }
    }
}

fn entry(key: &str, s: &Stored) -> Entry {
    Entry {
        key: key.to_owned(),
        value: s.value.clone(),
        create_revision: s.create,
        mod_revision: s.modified,
        lease: (s.lease != 0).then_some(s.lease),
    }
}

#[async_trait]
impl Engine for EmbeddedEngine {
    async fn get(&self, key: &str) -> Result<Option<Entry>, KvError> {
        let key = key.to_owned();
        self.blocking(move |inner| {
            let state = inner.lock();
            Ok(state.visible(&key, now_ms()).map(|s| entry(&key, s)))
        })
        .await
    }

    async fn range(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), KvError> {
        let prefix = prefix.to_owned();
        self.blocking(move |inner| {
            let state = inner.lock();
            let now = now_ms();
            let entries = state
                .keys
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .filter(|(_, s)| state.live(s, now))
                .map(|(k, s)| entry(k, s))
                .collect();
            Ok((entries, state.revision))
        })
        .await
    }

    async fn txn(&self, cmps: Vec<Cmp>, ops: Vec<Op>) -> Result<TxnOutcome, KvError> {
        self.blocking(move |inner| {
            let mut state = inner.lock();
            let now = now_ms();
            let holds = cmps.iter().all(|cmp| match cmp {
                Cmp::CreateRevision(k, r) => state.visible(k, now).map_or(0, |s| s.create) == *r,
                Cmp::ModRevision(k, r) => state.visible(k, now).map_or(0, |s| s.modified) == *r,
            });
            if !holds {
                return Ok(TxnOutcome {
                    succeeded: false,
                    revision: state.revision,
                });
            }
            let revision = state.revision + 1;
            let mut change = Change {
                revision: Some(revision),
                ..Change::default()
            };
            for op in ops {
                match op {
                    Op::Put { key, value, lease } => {
                        let lease = lease.unwrap_or(0);
                        if lease != 0
                            && !matches!(state.leases.get(&lease), Some(l) if l.expires_ms > now)
                        {
                            return Err(KvError::LeaseLost);
                        }
                        let create = state.visible(&key, now).map_or(revision, |s| s.create);
                        change.puts.push((
                            key,
                            Stored {
                                value,
                                create,
                                modified: revision,
                                lease,
                            },
                        ));
                    }
                    Op::Delete { key } => {
                        if state.keys.contains_key(&key) {
                            change.deletes.push(key);
                        }
                    }
                }
            }
            state.commit(change)?;
            inner.changes.send_replace(revision);
            Ok(TxnOutcome {
                succeeded: true,
                revision,
            })
        })
        .await
    }

    async fn grant(&self, ttl: Duration) -> Result<LeaseId, KvError> {
        self.blocking(move |inner| {
            let mut state = inner.lock();
            let id = state.next_lease;
            let ttl_ms = ttl.as_millis() as i64;
            let record = LeaseRecord {
                expires_ms: now_ms() + ttl_ms,
                ttl_ms,
            };
            state.commit(Change {
                lease_puts: vec![(id, record)],
                next_lease: Some(id + 1),
                ..Change::default()
            })?;
            Ok(id)
        })
        .await
    }

    async fn keep_alive_once(&self, lease: LeaseId) -> Result<bool, KvError> {
        self.blocking(move |inner| {
            let mut state = inner.lock();
            let now = now_ms();
            match state.leases.get(&lease).copied() {
                Some(record) if record.expires_ms > now => {
                    let refreshed = LeaseRecord {
                        expires_ms: now + record.ttl_ms,
                        ..record
                    };
                    state.commit(Change {
                        lease_puts: vec![(lease, refreshed)],
                        ..Change::default()
                    })?;
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
        .await
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), KvError> {
        self.blocking(move |inner| {
            let mut state = inner.lock();
            if !state.leases.contains_key(&lease) {
                return Ok(());
            }
            if state.drop_leases(&[lease])? {
                inner.changes.send_replace(state.revision);
            }
            Ok(())
        })
        .await
    }

    async fn wait_change(
        &self,
        _prefix: &str,
        after: Revision,
        timeout: Duration,
    ) -> Result<(), KvError> {
        let mut changes = self.inner.changes.subscribe();
        if *changes.borrow_and_update() > after {
            return Ok(());
        }
        // Either outcome means "look again".
        let _ = tokio::time::timeout(timeout, changes.changed()).await;
        Ok(())
    }
}
