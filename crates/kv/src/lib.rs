//! vmon-kv: the coordination store (DESIGN §6–7). It holds what must be agreed on between
//! processes and must never be lost by a race: sandbox routes, per-sandbox transition locks with
//! fencing tokens, team admission counters, idempotency records and leader election.
//!
//! It must never hold records (sandboxes, templates, events): those live in `vmon-store`. Values
//! here are small and short-lived; everything is either leased or bounded.
//!
//! # Backends
//! * **embedded** ([`Kv::open_embedded`]): `redb` in the data dir; one process. Same semantics as
//!   etcd, including lease expiry and lock waiting. The default for `vmon up`.
//! * **etcd** ([`Kv::connect_etcd`]): `etcd-client` against etcd 3.4+, for clusters.
//!
//! Both implement one small internal engine (get, range, transaction with revision comparisons,
//! leases, change notification); locks, counters, idempotency and elections are written once on
//! top of it, and one conformance suite (`tests/conformance.rs`) runs against both.
//!
//! # The API in one screen
//! ```text
//! let kv = Kv::open(&KvConfig::Embedded(EmbeddedConfig::new(data_dir))).await?;   // Clone, Send, Sync
//!
//! // Plain keys with compare-and-swap on the modification revision.
//! kv.get("k") -> Option<Entry{key, value, create_revision, mod_revision, lease}>
//! kv.put("k", b"v") -> Revision;  kv.delete("k") -> bool;  kv.list("routes/") -> Vec<Entry>
//! kv.compare_and_swap("k", Expect::Revision(r), Some(b"new".to_vec())) -> WriteOutcome
//! kv.write(Write::put("k", v).expect(Expect::Absent).lease(&lease).fenced(&fence)) -> WriteOutcome
//!     WriteOutcome::{Committed{revision}, Conflict{current}, Fenced}
//!
//! // Leases: keep-alive runs in the background; `lost()` is a CancellationToken.
//! let lease = kv.grant_lease(Duration::from_secs(10)).await?;      // a node's session
//! kv.write(Write::put(format!("routes/{sandbox_id}"), node_id).lease(&lease)).await?;
//! lease.id();  lease.lost();  lease.revoke().await?;  kv.revoke_lease(id)   // e.g. a dead node's
//!
//! // Per-sandbox transition lock: waits up to the deadline, returns a fencing token.
//! let guard = kv.lock(&format!("sandbox/{id}"), Duration::from_secs(120)).await?;  // Err(LockTimeout)
//! kv.write(Write::put(k, v).fenced(&guard.fence())).await?;        // Fenced once a newer holder exists
//! guard.fence().token();  guard.lost();  guard.unlock().await?;
//!
//! // Team admission: bounded counter.
//! kv.acquire("team/T/running", limit) -> bool;   kv.release("team/T/running");  kv.counter("…") -> u64
//!
//! // Idempotency records (expiry kept in the value; expired reads as absent).
//! kv.idempotency_put_if_absent(key, value, expires_at) -> IdempotencyOutcome::{Inserted, Exists(record)}
//! kv.idempotency_get(key) -> Option<IdempotencyRecord{value, expires_at}>;  kv.idempotency_delete(key)
//!
//! // Leader election (reaper, webhook dispatcher).
//! let leadership = kv.campaign("reaper", node_id, &cancel).await?;  // waits until elected
//! leadership.epoch();  leadership.lost();  leadership.resign().await?;
//! kv.observe("reaper") -> Option<LeaderInfo{candidate, epoch}>
//! ```
//!
//! Routes ride on the node's lease: a node grants one lease at start and writes every route
//! with it, so the node's death removes its routes when the lease expires.
//!
//! Key spaces are separate: plain keys, locks, counters, idempotency records and elections never
//! collide, whatever names are chosen.

mod admission;
pub mod bench;
mod embedded;
mod engine;
mod etcd;
mod idempotency;
mod lease;
mod lock;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use engine::{Cmp, Engine, Op};

pub use idempotency::{IdempotencyOutcome, IdempotencyRecord};
pub use lease::{Lease, Refreshes};
pub use lock::{Fence, LeaderInfo, Leadership, LockGuard};

/// A store revision: grows with every write, never reused.
pub type Revision = i64;
/// A backend lease id.
pub type LeaseId = i64;

/// The result type of this crate.
pub type Result<T, E = KvError> = std::result::Result<T, E>;

/// What can go wrong.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The lock was still held by someone else when the deadline passed.
    #[error("the lock was not acquired before the deadline")]
    LockTimeout,
    /// The lease behind a lock, leadership or queue position expired or was revoked.
    #[error("the lease expired or was revoked")]
    LeaseLost,
    /// The cancellation token passed in fired.
    #[error("the operation was cancelled")]
    Cancelled,
    /// The argument cannot be used (an empty key, a zero TTL).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A value in the store does not decode (written by something else?).
    #[error("the value stored under {0:?} is malformed")]
    Malformed(String),
    /// The embedded database failed.
    #[error("the embedded database failed")]
    Embedded(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// etcd failed (after retries of transient errors).
    #[error("the etcd request failed")]
    Etcd(#[source] Box<etcd_client::Error>),
}

/// One key as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The key, without the crate's internal namespace.
    pub key: String,
    pub value: Vec<u8>,
    /// Revision of the write that created the key (since its last deletion).
    pub create_revision: Revision,
    /// Revision of the last write to the key: what [`Expect::Revision`] compares against.
    pub mod_revision: Revision,
    /// The lease the key is bound to, if any.
    pub lease: Option<LeaseId>,
}

/// The condition of a [`Write`] on the key's current state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// No condition.
    Any,
    /// The key must not exist.
    Absent,
    /// The key must exist with this modification revision.
    Revision(Revision),
}

/// A conditional write: put or delete one key, optionally expecting a revision, bound to a
/// lease, and fenced by a lock or leadership.
#[derive(Clone, Debug)]
pub struct Write {
    key: String,
    value: Option<Vec<u8>>,
    expect: Expect,
    lease: Option<LeaseId>,
    fence: Option<Fence>,
}

impl Write {
    /// Sets `key` to `value`.
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Write {
        Write {
            key: key.into(),
            value: Some(value.into()),
            expect: Expect::Any,
            lease: None,
            fence: None,
        }
    }

    /// Deletes `key`.
    pub fn delete(key: impl Into<String>) -> Write {
        Write {
            key: key.into(),
            value: None,
            expect: Expect::Any,
            lease: None,
            fence: None,
        }
    }

    /// Only if the key's state matches.
    pub fn expect(mut self, expect: Expect) -> Write {
        self.expect = expect;
        self
    }

    /// Binds the key to `lease` (a put only): it disappears when the lease does.
    pub fn lease(mut self, lease: &Lease) -> Write {
        self.lease = Some(lease.id());
        self
    }

    /// Only while `fence` is still the current holder of its lock or leadership.
    pub fn fenced(mut self, fence: &Fence) -> Write {
        self.fence = Some(fence.clone());
        self
    }
}

/// What became of a [`Write`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Applied at this revision.
    Committed { revision: Revision },
    /// The [`Expect`] did not hold; `current` is the key as read just after. After a transient
    /// etcd failure the write is retried; if its first attempt had applied, the retry reports a
    /// conflict whose `current` value is this very write (make values unique to tell).
    Conflict { current: Option<Entry> },
    /// The fence's holder no longer holds: a stale holder's write, refused.
    Fenced,
}

impl WriteOutcome {
    /// Whether the write was applied.
    pub fn is_committed(&self) -> bool {
        matches!(self, WriteOutcome::Committed { .. })
    }
}

/// Embedded backend settings.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    /// The directory holding `kv.redb`; created if missing.
    pub data_dir: PathBuf,
    /// TTL of the leases behind locks and elections.
    pub session_ttl: Duration,
}

impl EmbeddedConfig {
    /// Defaults: a 10 s session TTL.
    pub fn new(data_dir: impl Into<PathBuf>) -> EmbeddedConfig {
        EmbeddedConfig {
            data_dir: data_dir.into(),
            session_ttl: Duration::from_secs(10),
        }
    }
}

/// etcd backend settings.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// `http://host:port` (or with [`EtcdConfig::tls`] `https://host:port`) client URLs of
    /// the members.
    pub endpoints: Vec<String>,
    /// Prefix of every key this crate writes, so several clusters can share one etcd.
    pub prefix: String,
    /// TTL of the leases behind locks and elections (etcd rounds it up to whole seconds).
    pub session_ttl: Duration,
    /// How long a request retries transient failures (a member down, a leader change).
    pub retry_for: Duration,
    /// TLS with a client certificate (`https://` endpoints); `None` is plain http.
    pub tls: Option<EtcdTls>,
}

/// The files of etcd client TLS: the CA the members' certificates are verified against
/// (nothing else is trusted) and this client's certificate and key, which etcd requires
/// (`--client-cert-auth`).
#[derive(Clone, Debug)]
pub struct EtcdTls {
    pub ca_file: std::path::PathBuf,
    pub cert_file: std::path::PathBuf,
    pub key_file: std::path::PathBuf,
}

impl EtcdConfig {
    /// Defaults: prefix `/vmon/`, a 10 s session TTL, 10 s of retries.
    pub fn new(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            prefix: "/vmon/".to_owned(),
            session_ttl: Duration::from_secs(10),
            retry_for: Duration::from_secs(10),
            tls: None,
        }
    }
}

/// Which backend to open.
#[derive(Clone, Debug)]
pub enum KvConfig {
    Embedded(EmbeddedConfig),
    Etcd(EtcdConfig),
}

const PLAIN: &str = "k/";
const LOCKS: &str = "l/";
const ELECTIONS: &str = "e/";
pub(crate) const COUNTERS: &str = "c/";
pub(crate) const IDEMPOTENCY: &str = "i/";

/// The coordination store. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct Kv {
    engine: Arc<dyn Engine>,
    session_ttl: Duration,
    backend: &'static str,
}

impl std::fmt::Debug for Kv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kv")
            .field("backend", &self.backend)
            .finish()
    }
}

impl Kv {
    /// Opens the configured backend.
    pub async fn open(config: &KvConfig) -> Result<Kv> {
        match config {
            KvConfig::Embedded(c) => Kv::open_embedded(c).await,
            KvConfig::Etcd(c) => Kv::connect_etcd(c).await,
        }
    }

    /// Opens (or creates) the embedded store in `config.data_dir`. Fails if another process
    /// has it open.
    pub async fn open_embedded(config: &EmbeddedConfig) -> Result<Kv> {
        let engine = embedded::EmbeddedEngine::open(&config.data_dir).await?;
        Ok(Kv {
            engine,
            session_ttl: config.session_ttl,
            backend: "embedded",
        })
    }

    /// Connects to etcd.
    pub async fn connect_etcd(config: &EtcdConfig) -> Result<Kv> {
        let engine = etcd::EtcdEngine::connect(config).await?;
        Ok(Kv {
            engine,
            session_ttl: config.session_ttl,
            backend: "etcd",
        })
    }

    /// `"embedded"` or `"etcd"`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Reads one key.
    pub async fn get(&self, key: &str) -> Result<Option<Entry>> {
        Ok(self
            .engine
            .get(&format!("{PLAIN}{key}"))
            .await?
            .map(|e| strip(e, PLAIN.len())))
    }

    /// All keys starting with `prefix`, in key order.
    pub async fn list(&self, prefix: &str) -> Result<Vec<Entry>> {
        let (entries, _) = self.engine.range(&format!("{PLAIN}{prefix}")).await?;
        Ok(entries.into_iter().map(|e| strip(e, PLAIN.len())).collect())
    }

    /// Sets a key unconditionally.
    pub async fn put(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<Revision> {
        match self.write(Write::put(key, value)).await? {
            WriteOutcome::Committed { revision } => Ok(revision),
            other => Err(KvError::InvalidArgument(format!(
                "unconditional put reported {other:?}"
            ))),
        }
    }

    /// Deletes a key; `true` if it existed.
    pub async fn delete(&self, key: &str) -> Result<bool> {
        loop {
            let Some(current) = self.get(key).await? else {
                return Ok(false);
            };
            let outcome = self
                .write(Write::delete(key).expect(Expect::Revision(current.mod_revision)))
                .await?;
            if outcome.is_committed() {
                return Ok(true);
            }
        }
    }

    /// Replaces (or deletes, with `None`) the key if it is in the expected state.
    pub async fn compare_and_swap(
        &self,
        key: &str,
        expect: Expect,
        value: Option<Vec<u8>>,
    ) -> Result<WriteOutcome> {
        let write = match value {
            Some(v) => Write::put(key, v),
            None => Write::delete(key),
        };
        self.write(write.expect(expect)).await
    }

    /// The general conditional write.
    pub async fn write(&self, write: Write) -> Result<WriteOutcome> {
        if write.key.is_empty() {
            return Err(KvError::InvalidArgument("empty key".to_owned()));
        }
        let key = format!("{PLAIN}{}", write.key);
        let mut cmps = Vec::new();
        match write.expect {
            Expect::Any => {}
            Expect::Absent => cmps.push(Cmp::CreateRevision(key.clone(), 0)),
            Expect::Revision(r) => cmps.push(Cmp::ModRevision(key.clone(), r)),
        }
        if let Some(fence) = &write.fence {
            cmps.push(Cmp::CreateRevision(fence.key.clone(), fence.revision));
        }
        let op = match write.value {
            Some(value) => Op::Put {
                key: key.clone(),
                value,
                lease: write.lease,
            },
            None => Op::Delete { key: key.clone() },
        };
        let outcome = self.engine.txn(cmps, vec![op]).await?;
        if outcome.succeeded {
            return Ok(WriteOutcome::Committed {
                revision: outcome.revision,
            });
        }
        if let Some(fence) = &write.fence {
            let holder = self.engine.get(&fence.key).await?;
            if holder.map(|e| e.create_revision) != Some(fence.revision) {
                return Ok(WriteOutcome::Fenced);
            }
        }
        let current = self.engine.get(&key).await?.map(|e| strip(e, PLAIN.len()));
        Ok(WriteOutcome::Conflict { current })
    }

    /// Grants a lease kept alive in the background until revoked or dropped.
    pub async fn grant_lease(&self, ttl: Duration) -> Result<Lease> {
        if ttl.is_zero() {
            return Err(KvError::InvalidArgument("zero lease TTL".to_owned()));
        }
        Lease::grant(self.engine.clone(), ttl).await
    }

    /// Revokes a lease by id (an operator removing a dead node's routes at once).
    pub async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.engine.revoke(lease).await
    }

    /// Takes the lock `name`, waiting up to `wait` for the current holder. Holders are served
    /// in arrival order. The lock lives on its own lease (the session TTL): a holder that dies
    /// releases it when the lease expires.
    pub async fn lock(&self, name: &str, wait: Duration) -> Result<LockGuard> {
        let prefix = format!("{LOCKS}{}/", lock::escape(name));
        let deadline = Instant::now() + wait;
        let position = lock::join_queue(
            &self.engine,
            &prefix,
            b"",
            self.session_ttl,
            Some(deadline),
            None,
        )
        .await?;
        Ok(LockGuard::new(name, position))
    }

    /// Admits one more unit under `key` unless `limit` is reached: `false` at the limit.
    pub async fn acquire(&self, key: &str, limit: u64) -> Result<bool> {
        admission::acquire(&self.engine, key, limit).await
    }

    /// Gives one unit back; never goes below zero.
    pub async fn release(&self, key: &str) -> Result<()> {
        admission::release(&self.engine, key).await
    }

    /// The counter's current value.
    pub async fn counter(&self, key: &str) -> Result<u64> {
        admission::value(&self.engine, key).await
    }

    /// Overwrites the counter (reconciliation by the leader after a crash left it off).
    pub async fn set_counter(&self, key: &str, value: u64) -> Result<()> {
        admission::set(&self.engine, key, value).await
    }

    /// Stores `value` under the idempotency `key` until `expires_at`, unless an unexpired record
    /// exists, which is returned instead.
    pub async fn idempotency_put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        expires_at: SystemTime,
    ) -> Result<IdempotencyOutcome> {
        idempotency::put_if_absent(&self.engine, key, value, expires_at).await
    }

    /// The unexpired record under `key`.
    pub async fn idempotency_get(&self, key: &str) -> Result<Option<IdempotencyRecord>> {
        idempotency::get(&self.engine, key).await
    }

    /// Deletes the record (a failed create frees its key for a retry).
    pub async fn idempotency_delete(&self, key: &str) -> Result<()> {
        idempotency::delete(&self.engine, key).await
    }

    /// Campaigns in `election` as `candidate` and returns once elected. Fails with
    /// [`KvError::Cancelled`] when `cancel` fires first. A candidate whose own lease is lost
    /// while waiting (an etcd outage longer than the session TTL) joins the queue again.
    pub async fn campaign(
        &self,
        election: &str,
        candidate: &str,
        cancel: &CancellationToken,
    ) -> Result<Leadership> {
        let prefix = format!("{ELECTIONS}{}/", lock::escape(election));
        loop {
            let ttl = self.session_ttl;
            let value = candidate.as_bytes();
            match lock::join_queue(&self.engine, &prefix, value, ttl, None, Some(cancel)).await {
                Ok(position) => return Ok(Leadership::new(election, candidate, position)),
                Err(KvError::LeaseLost) if !cancel.is_cancelled() => {
                    tracing::warn!(
                        election,
                        candidate,
                        "campaign lease lost; campaigning again"
                    );
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// The current leader of `election`, if any.
    pub async fn observe(&self, election: &str) -> Result<Option<LeaderInfo>> {
        let prefix = format!("{ELECTIONS}{}/", lock::escape(election));
        let (entries, _) = self.engine.range(&prefix).await?;
        Ok(entries
            .into_iter()
            .min_by_key(|e| e.create_revision)
            .map(|e| LeaderInfo {
                candidate: String::from_utf8_lossy(&e.value).into_owned(),
                epoch: e.create_revision,
            }))
    }
}

fn strip(mut entry: Entry, prefix_len: usize) -> Entry {
    entry.key = entry.key.get(prefix_len..).unwrap_or_default().to_owned();
    entry
}
