//! Leases with a keep-alive driven by the crate. Loss is reported through a
//! [`CancellationToken`] that fires no later than the moment the server may have expired the
//! lease: the deadline counts from when the last *acknowledged* refresh was *sent*.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{sleep_until, Instant};
use tokio_util::sync::CancellationToken;

use crate::engine::Engine;
use crate::LeaseId;

/// A lease kept alive in the background until it is revoked, dropped or abandoned.
///
/// Keys written with it (routes, lock and election keys) vanish when it expires.
/// Dropping a `Lease` revokes it in the background (best effort).
pub struct Lease {
    id: LeaseId,
    ttl: Duration,
    lost: CancellationToken,
    stop: CancellationToken,
    engine: Arc<dyn Engine>,
    revoke_on_drop: bool,
    /// When the last refresh the server acknowledged was sent.
    refreshed: Arc<std::sync::Mutex<Instant>>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl Lease {
    pub(crate) async fn grant(engine: Arc<dyn Engine>, ttl: Duration) -> crate::Result<Lease> {
        let ttl = ttl.max(Duration::from_millis(500));
        let sent = Instant::now();
        let id = engine.grant(ttl).await?;
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let refreshed = Arc::new(std::sync::Mutex::new(sent));
        tokio::spawn(keep_alive(
            engine.clone(),
            id,
            ttl,
            refreshed.clone(),
            lost.clone(),
            stop.clone(),
        ));
        Ok(Lease {
            id,
            ttl,
            lost,
            stop,
            engine,
            revoke_on_drop: true,
            refreshed,
        })
    }

    /// When the last refresh the server acknowledged was sent (the grant's request before the
    /// first): the server keeps the lease at least until this plus its TTL.
    pub fn refreshed_at(&self) -> Instant {
        *self.refreshed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A handle that reads [`Lease::refreshed_at`] from elsewhere (another task), for as long
    /// as it is kept (after the lease ends it reads its last acknowledged refresh).
    pub fn refreshes(&self) -> Refreshes {
        Refreshes(self.refreshed.clone())
    }

    /// The backend's lease id.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The TTL the lease was granted with (the server may keep it longer, never shorter).
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Fires when the lease is, or may be, gone: the server said so, refreshes failed for a
    /// whole TTL, or the lease was revoked.
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Whether [`Lease::lost`] has fired.
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Revokes the lease now; every key bound to it disappears.
    pub async fn revoke(mut self) -> crate::Result<()> {
        self.revoke_on_drop = false;
        self.stop.cancel();
        self.lost.cancel();
        self.engine.revoke(self.id).await
    }

    /// Stops refreshing without revoking, as if this process had died: the lease expires after
    /// its TTL. Used by crash tests and by a process handing its keys over on purpose.
    pub fn abandon(mut self) {
        self.revoke_on_drop = false;
        self.stop.cancel();
    }
}

/// [`Lease::refreshed_at`] apart from the lease ([`Lease::refreshes`]).
#[derive(Clone)]
pub struct Refreshes(Arc<std::sync::Mutex<Instant>>);

impl Refreshes {
    /// When the last refresh the server acknowledged was sent.
    pub fn at(&self) -> Instant {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.stop.cancel();
        if self.revoke_on_drop {
            self.lost.cancel();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let engine = self.engine.clone();
                let id = self.id;
                handle.spawn(async move {
                    if let Err(error) = engine.revoke(id).await {
                        tracing::debug!(lease = id, %error, "revoking a dropped lease failed; it will expire");
                    }
                });
            }
        }
    }
}

async fn keep_alive(
    engine: Arc<dyn Engine>,
    id: LeaseId,
    ttl: Duration,
    acked: Arc<std::sync::Mutex<Instant>>,
    lost: CancellationToken,
    stop: CancellationToken,
) {
    let interval = (ttl / 3).max(Duration::from_millis(100));
    let mut acknowledged = *acked.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let next = Instant::now() + interval;
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = lost.cancelled() => return,
            _ = sleep_until(next) => {}
            _ = sleep_until(acknowledged + ttl) => {
                tracing::warn!(lease = id, "no lease refresh succeeded within its TTL; lease lost");
                lost.cancel();
                return;
            }
        }
        let sent = Instant::now();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = sleep_until(acknowledged + ttl) => {
                tracing::warn!(lease = id, "lease refresh did not complete within its TTL; lease lost");
                lost.cancel();
                return;
            }
            // One attempt may hang on a member that lost its leader; give up on it after an
            // interval and try again (likely through another member) while the TTL lasts.
            refreshed = tokio::time::timeout(interval, engine.keep_alive_once(id)) => match refreshed {
                Ok(Ok(true)) => {
                    acknowledged = sent;
                    *acked.lock().unwrap_or_else(|p| p.into_inner()) = sent;
                }
                Ok(Ok(false)) => {
                    tracing::warn!(lease = id, "lease expired on the server");
                    lost.cancel();
                    return;
                }
                Ok(Err(error)) => tracing::debug!(lease = id, %error, "lease refresh failed; retrying"),
                Err(_) => tracing::debug!(lease = id, "lease refresh timed out; retrying"),
            },
        }
    }
}
