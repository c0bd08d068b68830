//! The narrow contract a backend implements. Every recipe (locks, counters, idempotency,
//! elections) is written once on top of it, so both backends share the same semantics and the
//! conformance suite tests the recipes, not two copies of them.

use std::time::Duration;

use async_trait::async_trait;

use crate::{Entry, KvError, LeaseId, Revision};

/// A comparison inside a transaction. A revision of 0 means "the key does not exist".
#[derive(Clone, Debug)]
pub(crate) enum Cmp {
    CreateRevision(String, Revision),
    ModRevision(String, Revision),
}

/// A mutation inside a transaction.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        key: String,
    },
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct TxnOutcome {
    pub succeeded: bool,
    /// The store revision after the transaction (or at which the comparison failed).
    pub revision: Revision,
}

#[async_trait]
pub(crate) trait Engine: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<Entry>, KvError>;
    /// All live keys starting with `prefix`, in key order, and the revision they were read at.
    async fn range(&self, prefix: &str) -> Result<(Vec<Entry>, Revision), KvError>;
    /// All comparisons hold → all ops apply atomically; otherwise nothing changes.
    async fn txn(&self, cmps: Vec<Cmp>, ops: Vec<Op>) -> Result<TxnOutcome, KvError>;
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, KvError>;
    /// Refreshes the lease; `Ok(false)` when the lease no longer exists.
    async fn keep_alive_once(&self, lease: LeaseId) -> Result<bool, KvError>;
    async fn revoke(&self, lease: LeaseId) -> Result<(), KvError>;
    /// Returns once anything under `prefix` changed after revision `after`, or `timeout` passed.
    /// Spurious returns are allowed; callers re-read.
    async fn wait_change(
        &self,
        prefix: &str,
        after: Revision,
        timeout: Duration,
    ) -> Result<(), KvError>;
}
