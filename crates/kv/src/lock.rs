//! Per-key locks with fencing tokens, and leader election, both on one queue recipe: each
//! contender writes a key bound to its own lease under a common prefix; the contender whose key
//! has the lowest create revision holds. The create revision is the fencing token (the leader
//! epoch for elections): the store's revision only grows, so a later holder always has a larger
//! token, and a holder whose lease expired has no key left to fence with.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::{Cmp, Engine, Op};
use crate::lease::Lease;
use crate::{KvError, Revision};

/// Proof of holding a lock (or leadership) at a given revision. Pass it to
/// [`crate::Write::fenced`] to make a write conditional on still holding it; compare
/// [`Fence::token`]s to refuse work from an older holder elsewhere (e.g. in the store).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    pub(crate) key: String,
    pub(crate) revision: Revision,
}

impl Fence {
    /// The monotonic fencing token: larger for every later holder of the same lock.
    pub fn token(&self) -> Revision {
        self.revision
    }
}

/// Escapes a user-chosen name so that one name's queue prefix never contains another's.
pub(crate) fn escape(name: &str) -> String {
    name.replace('%', "%25").replace('/', "%2F")
}

pub(crate) struct Position {
    pub lease: Lease,
    pub key: String,
    pub revision: Revision,
}

/// Joins the queue under `prefix` and waits until first in it, until `deadline` or `cancel`.
pub(crate) async fn join_queue(
    engine: &Arc<dyn Engine>,
    prefix: &str,
    value: &[u8],
    ttl: Duration,
    deadline: Option<Instant>,
    cancel: Option<&CancellationToken>,
) -> Result<Position, KvError> {
    let lease = Lease::grant(engine.clone(), ttl).await?;
    let key = format!("{prefix}{:016x}", lease.id());
    let put = Op::Put {
        key: key.clone(),
        value: value.to_vec(),
        lease: Some(lease.id()),
    };
    engine
        .txn(vec![Cmp::CreateRevision(key.clone(), 0)], vec![put])
        .await?;
    let result = wait_first(engine, prefix, &key, &lease, deadline, cancel).await;
    match result {
        Ok(revision) => Ok(Position {
            lease,
            key,
            revision,
        }),
        Err(error) => {
            if let Err(revoke) = lease.revoke().await {
                tracing::debug!(%revoke, "leaving a lock queue failed; the key expires with its lease");
            }
            Err(error)
        }
    }
}

async fn wait_first(
    engine: &Arc<dyn Engine>,
    prefix: &str,
    key: &str,
    lease: &Lease,
    deadline: Option<Instant>,
    cancel: Option<&CancellationToken>,
) -> Result<Revision, KvError> {
    loop {
        let (entries, read_at) = engine.range(prefix).await?;
        let mine = entries
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.create_revision);
        let Some(mine) = mine else {
            return Err(KvError::LeaseLost);
        };
        let first = entries
            .iter()
            .map(|e| e.create_revision)
            .min()
            .unwrap_or(mine);
        if first == mine {
            if lease.is_lost() {
                return Err(KvError::LeaseLost);
            }
            return Ok(mine);
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(KvError::LockTimeout);
        }
        // Bounded waits so a missed notification costs at most a second.
        let mut wait = Duration::from_secs(1);
        if let Some(d) = deadline {
            wait = wait.min(d - now);
        }
        let lost = lease.lost();
        let never = CancellationToken::new();
        let cancelled = cancel.unwrap_or(&never);
        tokio::select! {
            _ = lost.cancelled() => return Err(KvError::LeaseLost),
            _ = cancelled.cancelled() => return Err(KvError::Cancelled),
            changed = engine.wait_change(prefix, read_at, wait) => changed?,
        }
    }
}

/// A held lock. Dropping it releases the lock in the background; prefer [`LockGuard::unlock`].
#[derive(Debug)]
pub struct LockGuard {
    name: String,
    fence: Fence,
    lease: Lease,
}

impl LockGuard {
    pub(crate) fn new(name: &str, position: Position) -> LockGuard {
        LockGuard {
            name: name.to_owned(),
            fence: Fence {
                key: position.key,
                revision: position.revision,
            },
            lease: position.lease,
        }
    }

    /// The lock's name as passed to [`crate::Kv::lock`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fence to attach to writes made under this lock.
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Fires when the lock may have been lost (its lease expired); stop work and do not write.
    pub fn lost(&self) -> CancellationToken {
        self.lease.lost()
    }

    /// Releases the lock now.
    pub async fn unlock(self) -> crate::Result<()> {
        self.lease.revoke().await
    }

    /// Stops refreshing without releasing, as if this process had died: the lock frees itself
    /// when its lease expires.
    pub fn abandon(self) {
        self.lease.abandon();
    }
}

/// Who leads an election, as seen by [`crate::Kv::observe`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderInfo {
    /// The identity the leader campaigned with.
    pub candidate: String,
    /// The leader's epoch: larger for every later leader.
    pub epoch: Revision,
}

/// Won leadership. Dropping it resigns in the background; prefer [`Leadership::resign`].
#[derive(Debug)]
pub struct Leadership {
    election: String,
    candidate: String,
    fence: Fence,
    lease: Lease,
}

impl Leadership {
    pub(crate) fn new(election: &str, candidate: &str, position: Position) -> Leadership {
        Leadership {
            election: election.to_owned(),
            candidate: candidate.to_owned(),
            fence: Fence {
                key: position.key,
                revision: position.revision,
            },
            lease: position.lease,
        }
    }

    /// The election's name.
    pub fn election(&self) -> &str {
        &self.election
    }

    /// The identity this leader campaigned with.
    pub fn candidate(&self) -> &str {
        &self.candidate
    }

    /// The leader epoch, monotonic across leaders; fence store writes (the outbox) with it.
    pub fn epoch(&self) -> Revision {
        self.fence.revision
    }

    /// A fence for KV writes that must only succeed while this leadership lasts.
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Fires when leadership may have been lost; the leader must stop leading.
    pub fn lost(&self) -> CancellationToken {
        self.lease.lost()
    }

    /// Gives up leadership now; the next candidate takes over at once.
    pub async fn resign(self) -> crate::Result<()> {
        self.lease.revoke().await
    }

    /// Stops refreshing without resigning, as if this process had died: another candidate
    /// takes over once the lease expires.
    pub fn abandon(self) {
        self.lease.abandon();
    }
}
