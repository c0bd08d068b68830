//! Fencing a node that cannot show its cluster lease (docs/architecture.md, "Fencing").
//!
//! A node in a cluster holds a lease in etcd (its registration, [`crate::registry`]). The
//! cluster counts a node whose lease ended as *suspect* for the grace (`node_grace_secs`) and
//! then reports its running sandboxes killed (`orphaned`), never restarting them elsewhere.
//! So that nothing the cluster reported gone keeps running or writing, the node fences itself
//! before that moment, on its own clock:
//!
//! * **Held**: the last lease refresh etcd acknowledged was sent less than the lease TTL ago
//!   (etcd keeps the lease at least a TTL after it). Every call is served.
//! * **Lapsed** (TTL to `grace + TTL/2`): the cluster may already see the node gone; its
//!   sandboxes are untouched (their guests run, traffic flows) but it takes no new work
//!   (starts, template builds, live migrations), which the cluster places elsewhere.
//! * **Fenced** (from `grace + TTL/2`, and at once when a refresh comes after such a gap, as
//!   after a SIGSTOP): the node stops every VM it runs and refuses every call that
//!   changes a sandbox or writes the object store, until its VMs are stopped and a refresh
//!   is seen again. The cluster's own count ends no sooner than `TTL + grace` after that last
//!   acknowledged refresh, so a node fences itself at least `TTL/2` before its sandboxes are
//!   reported killed.
//!
//! [`FencedNode`] puts the check in front of every call of the node contract; [`watch`] stops
//! the VMs when the fence falls; [`Fence::writable`] is the object store's gate.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use vmon_proto::node::{NodeCall, NodeControl, NodeError, NodeReply};

/// How long the fence's stop waits for calls that were in flight when it fell.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(60);

/// Where a node stands with its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    Held,
    /// No refresh acknowledged for this long (at least the lease TTL).
    Lapsed(Duration),
    Fenced,
}

#[derive(Debug)]
struct State {
    /// When the last lease refresh etcd acknowledged was sent (the node's start until the
    /// first).
    last: Instant,
    /// The fence fell and has not been lifted (VMs stopped, then a refresh seen).
    fenced: bool,
    /// Every VM was stopped since the fence fell.
    stopped: bool,
}

/// A node's lease standing, fed by its lease's refreshes ([`Fence::renewed`]).
#[derive(Debug)]
pub struct Fence {
    node_id: String,
    ttl: Duration,
    after: Duration,
    state: Mutex<State>,
    wake: tokio::sync::Notify,
    in_flight: AtomicUsize,
}

impl Fence {
    /// The fence of a node whose lease has `ttl`, in a cluster that waits `grace` after a
    /// lapse before reporting its sandboxes killed. It falls `grace + ttl/2` after the last
    /// acknowledged refresh.
    pub fn new(node_id: impl Into<String>, ttl: Duration, grace: Duration) -> Arc<Fence> {
        Arc::new(Fence {
            node_id: node_id.into(),
            ttl,
            after: grace.saturating_add(ttl / 2),
            state: Mutex::new(State {
                last: Instant::now(),
                fenced: false,
                stopped: false,
            }),
            wake: tokio::sync::Notify::new(),
            in_flight: AtomicUsize::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A refresh of the node's lease sent at `sent` was acknowledged (or a lease granted).
    /// One that follows the previous by the fence's span or more fences first (the node was
    /// stalled: it may have been reported gone while it could not tell); the fence is lifted
    /// by one that comes once its VMs are stopped.
    /// Told again of a refresh it knows (or an older one), it changes nothing.
    pub fn renewed(&self, sent: Instant) {
        let mut s = self.lock();
        if sent <= s.last {
            return;
        }
        let gap = sent - s.last;
        if gap >= self.after && !s.fenced {
            tracing::error!(node_id = %self.node_id, gap_secs = gap.as_secs(), "no lease refresh was acknowledged for longer than the fence allows (a stall?): fencing before serving again");
            s.fenced = true;
            s.stopped = false;
            self.wake.notify_one();
        } else if s.fenced && s.stopped {
            tracing::warn!(node_id = %self.node_id, "the lease is held again: the fence is lifted");
            s.fenced = false;
        }
        s.last = sent;
    }

    /// The standing at `now`.
    pub fn standing_at(&self, now: Instant) -> Standing {
        let s = self.lock();
        let age = now.saturating_duration_since(s.last);
        if s.fenced || age >= self.after {
            Standing::Fenced
        } else if age >= self.ttl {
            Standing::Lapsed(age)
        } else {
            Standing::Held
        }
    }

    pub fn standing(&self) -> Standing {
        self.standing_at(Instant::now())
    }

    /// Whether the node may write the object store now (not fenced).
    pub fn writable(&self) -> Result<(), String> {
        match self.standing() {
            Standing::Fenced => Err(format!(
                "node {} is fenced (no cluster lease): it writes nothing to the object store",
                self.node_id
            )),
            _ => Ok(()),
        }
    }

    /// Whether `call` may be served now.
    pub fn admit(&self, call: &NodeCall) -> Result<(), NodeError> {
        let refused = match self.standing() {
            Standing::Held => None,
            Standing::Lapsed(age) => new_work(call).then(|| {
                format!(
                    "node {} has had no cluster lease for {} s: it takes no new work",
                    self.node_id,
                    age.as_secs()
                )
            }),
            Standing::Fenced => (new_work(call) || changes_a_sandbox(call)).then(|| {
                format!(
                    "node {} is fenced (no cluster lease past the grace): its sandboxes are stopped",
                    self.node_id
                )
            }),
        };
        match refused {
            Some(m) => Err(NodeError::Exhausted(m)),
            None => Ok(()),
        }
    }

    /// Every VM was stopped at `now` since the fence fell. When the lease is held again
    /// already (a refresh acknowledged while the VMs were being stopped: the node
    /// registered again meanwhile), the fence is lifted now, not at the next refresh: a node
    /// that is back in the registry takes work as soon as it has nothing left to stop.
    fn stopped_at(&self, now: Instant) {
        let mut s = self.lock();
        s.stopped = true;
        if s.fenced && now.saturating_duration_since(s.last) < self.ttl {
            tracing::warn!(node_id = %self.node_id, "fenced: every VM is stopped, and the lease is held again: the fence is lifted");
            s.fenced = false;
        } else {
            tracing::warn!(node_id = %self.node_id, "fenced: every VM is stopped; serving again once the lease is held");
        }
    }

    /// The time the fence falls unless a refresh is acknowledged first.
    fn deadline(&self) -> Instant {
        self.lock().last + self.after
    }

    /// The fence fell and the VMs are not stopped yet.
    fn due(&self) -> bool {
        let fenced = self.standing() == Standing::Fenced;
        let mut s = self.lock();
        if fenced && !s.fenced {
            s.fenced = true;
            s.stopped = false;
        }
        s.fenced && !s.stopped
    }
}

/// Calls that start something on the node: a lapsed node takes none.
fn new_work(call: &NodeCall) -> bool {
    matches!(
        call,
        NodeCall::Start(_)
            | NodeCall::BuildTemplate(_)
            | NodeCall::MigrateDescribe(_)
            | NodeCall::MigrateAccept(_)
            | NodeCall::MigrateSend(_)
            | NodeCall::MigrateCommit(_)
    )
}

/// Calls that change a sandbox or write the object store (besides [`new_work`]): a fenced
/// node serves none. Kills, reads and the ends of a migration stay served.
fn changes_a_sandbox(call: &NodeCall) -> bool {
    matches!(
        call,
        NodeCall::Pause(_)
            | NodeCall::Checkpoint(_)
            | NodeCall::DeleteBuild(_)
            | NodeCall::UpdateNetwork(_)
            | NodeCall::UpdateEgress(_)
            | NodeCall::Exec(_)
            | NodeCall::PutFile(_)
    )
}

/// A node behind its fence: every call is admitted ([`Fence::admit`]) before it is served.
pub struct FencedNode {
    inner: Arc<dyn NodeControl>,
    fence: Arc<Fence>,
}

impl FencedNode {
    pub fn new(inner: Arc<dyn NodeControl>, fence: Arc<Fence>) -> Arc<FencedNode> {
        Arc::new(FencedNode { inner, fence })
    }
}

struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl NodeControl for FencedNode {
    async fn handle(&self, call: NodeCall) -> Result<NodeReply, NodeError> {
        // Counted before the check, so that the fence's stop, which reads the count after it
        // fell, waits for every such call it let in.
        let _counted = (new_work(&call) || changes_a_sandbox(&call)).then(|| {
            self.fence.in_flight.fetch_add(1, Ordering::SeqCst);
            InFlight(&self.fence.in_flight)
        });
        self.fence.admit(&call)?;
        self.inner.handle(call).await
    }
}

/// Stops every VM `node` runs whenever the fence falls, until `cancel`.
pub async fn watch(fence: Arc<Fence>, node: Arc<dyn NodeControl>, cancel: CancellationToken) {
    loop {
        if fence.due() {
            stop_all(&fence, node.as_ref()).await;
            fence.stopped_at(Instant::now());
            continue;
        }
        // Past the deadline with the VMs stopped, a refresh lifts the fence: look again
        // now and then.
        let deadline = fence.deadline();
        let now = Instant::now();
        let at = if deadline > now {
            deadline
        } else {
            now + Duration::from_secs(1)
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = fence.wake.notified() => {}
            _ = tokio::time::sleep_until(at) => {}
        }
    }
}

/// Kills every VM `node` runs, again after the calls in flight when the fence fell are done
/// (a start that was under way then ends with its VM killed).
async fn stop_all(fence: &Fence, node: &dyn NodeControl) {
    kill_all(fence, node).await;
    let until = Instant::now() + IN_FLIGHT_WAIT;
    while fence.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    kill_all(fence, node).await;
}

async fn kill_all(fence: &Fence, node: &dyn NodeControl) {
    let running = match node.list_running().await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(node_id = %fence.node_id, error = %e, "fenced, but listing the VMs failed");
            return;
        }
    };
    for r in running {
        tracing::warn!(node_id = %fence.node_id, sandbox_id = %r.sandbox_id, execution_id = %r.execution_id, "fenced: stopping the VM");
        if let Err(e) = node
            .kill(r.sandbox_id.clone(), r.execution_id.clone())
            .await
        {
            tracing::error!(node_id = %fence.node_id, sandbox_id = %r.sandbox_id, error = %e, "fenced, but killing the VM failed");
        }
    }
}

#[cfg(test)]
mod tests;
