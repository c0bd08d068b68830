use super::*;
use vmon_proto::node::{Kill, ListRunning, MigrateCommit, NodeCalls, Pause, Running};

const TTL: Duration = Duration::from_millis(400);
const GRACE: Duration = Duration::from_millis(600);
/// When the fence falls after the last heartbeat: grace + TTL/2.
const AFTER: Duration = Duration::from_millis(800);

fn pause() -> NodeCall {
    NodeCall::Pause(Pause {
        sandbox_id: "i1".into(),
        execution_id: "e1".into(),
        memory: true,
    })
}

fn commit() -> NodeCall {
    NodeCall::MigrateCommit(MigrateCommit {
        migration_id: "m1".into(),
    })
}

fn kill() -> NodeCall {
    NodeCall::Kill(Kill {
        sandbox_id: "i1".into(),
        execution_id: "e1".into(),
    })
}

#[test]
fn the_standing_follows_the_last_accepted_heartbeat() {
    let f = Fence::new("n1", TTL, GRACE);
    let t0 = Instant::now();
    f.renewed(t0);
    assert_eq!(f.standing_at(t0 + TTL / 2), Standing::Held);
    assert_eq!(f.standing_at(t0 + TTL), Standing::Lapsed(TTL));
    assert_eq!(f.standing_at(t0 + AFTER), Standing::Fenced);
    // A heartbeat within the span keeps it held; an older one does not move it back.
    f.renewed(t0 + TTL);
    f.renewed(t0);
    assert_eq!(f.standing_at(t0 + TTL + TTL / 2), Standing::Held);
}

#[test]
fn a_heartbeat_after_a_stall_fences_until_the_vms_are_stopped() {
    let f = Fence::new("n1", TTL, GRACE);
    let t0 = Instant::now();
    f.renewed(t0);
    // SIGSTOP for longer than the fence's span: the first accepted heartbeat after it
    // must not make the node held again before its VMs are stopped.
    let back = t0 + AFTER + TTL;
    f.renewed(back);
    assert_eq!(f.standing_at(back), Standing::Fenced);
    assert!(f.due());
    f.renewed(back + TTL / 4);
    assert_eq!(
        f.standing_at(back + TTL / 4),
        Standing::Fenced,
        "not lifted before the stop"
    );
    f.lock().stopped = true;
    assert!(!f.due());
    f.renewed(back + TTL / 2);
    assert_eq!(f.standing_at(back + TTL / 2), Standing::Held);
}

#[test]
fn a_lapsed_node_takes_no_new_work_and_a_fenced_one_changes_nothing() {
    let f = Fence::new("n1", TTL, GRACE);
    assert!(f.admit(&commit()).is_ok() && f.admit(&pause()).is_ok());
    assert!(f.writable().is_ok());
    // Lapsed: its last heartbeat a TTL ago.
    f.lock().last = Instant::now() - TTL;
    assert!(matches!(f.admit(&commit()), Err(NodeError::Exhausted(_))));
    assert!(f.admit(&pause()).is_ok(), "its sandboxes are untouched");
    assert!(f.writable().is_ok());
    // Fenced.
    f.lock().last = Instant::now() - AFTER;
    assert!(matches!(f.admit(&pause()), Err(NodeError::Exhausted(_))));
    assert!(f.admit(&kill()).is_ok(), "kills stay served");
    assert!(f.admit(&NodeCall::ListRunning(ListRunning {})).is_ok());
    assert!(f.writable().is_err());
}

/// A node's table of VMs, for the fence's stop (list_running and kill only).
#[derive(Default)]
struct Vms(Mutex<Vec<Running>>);

#[async_trait::async_trait]
impl NodeControl for Vms {
    async fn handle(&self, call: NodeCall) -> Result<NodeReply, NodeError> {
        let mut vms = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match call {
            NodeCall::ListRunning(_) => Ok(NodeReply::ListRunning(vms.clone())),
            NodeCall::Kill(k) => {
                vms.retain(|r| r.sandbox_id != k.sandbox_id);
                Ok(NodeReply::Kill(()))
            }
            other => Err(NodeError::Failed(format!("not here: {}", other.name()))),
        }
    }
}

fn vm(id: &str) -> Running {
    Running {
        sandbox_id: id.into(),
        execution_id: format!("{id}-e"),
        guest_ip: [10, 0, 0, 2].into(),
        envd_version: "0".into(),
        vcpus: 1,
        memory_mb: 128,
        disk_mb: 512,
        resume_generation: 0,
        start_kind: None,
    }
}

#[tokio::test]
async fn a_node_that_cannot_renew_stops_its_vms_on_its_own_and_serves_again_once_held() {
    let vms = Arc::new(Vms::default());
    vms.0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend([vm("i1"), vm("i2")]);
    let f = Fence::new("n1", TTL, GRACE);
    f.renewed(Instant::now());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(watch(f.clone(), vms.clone(), cancel.clone()));
    let served = FencedNode::new(vms.clone(), f.clone());
    let count = || vms.0.lock().unwrap_or_else(|p| p.into_inner()).len();
    // Within the span (lapsed included) the VMs are untouched.
    tokio::time::sleep(TTL + TTL / 4).await;
    assert_eq!(count(), 2, "a lapsed node keeps its sandboxes");
    // Past it, with no heartbeat: stopped by the node itself.
    tokio::time::sleep(AFTER).await;
    assert_eq!(count(), 0, "the fenced node stopped its VMs");
    assert!(served.handle(pause()).await.is_err());
    assert!(served.list_running().await.is_ok());
    // Heartbeats accepted again: the fence is lifted.
    f.renewed(Instant::now());
    assert_eq!(f.standing(), Standing::Held);
    assert!(
        matches!(served.handle(pause()).await, Err(NodeError::Failed(_))),
        "served again (by the inner node)"
    );
    cancel.cancel();
    task.await.expect("watch");
}

#[test]
fn a_node_registered_again_while_it_stops_its_vms_serves_as_soon_as_they_are_stopped() {
    let f = Fence::new("n1", TTL, GRACE);
    let t0 = Instant::now();
    f.renewed(t0);
    // A stall past the span, then refreshes again while the stop is under way.
    let back = t0 + AFTER + TTL;
    f.renewed(back);
    assert!(f.due());
    f.renewed(back + TTL / 4);
    assert_eq!(f.standing_at(back + TTL / 4), Standing::Fenced);
    // The stop ends with the lease held: lifted at once, not at the next refresh.
    f.stopped_at(back + TTL / 2);
    assert_eq!(f.standing_at(back + TTL / 2), Standing::Held);
    assert!(!f.due());

    // A stop that ends with no refresh within the TTL leaves the node fenced.
    let g = Fence::new("n2", TTL, GRACE);
    g.lock().last = Instant::now() - AFTER;
    assert!(g.due());
    g.stopped_at(Instant::now());
    assert_eq!(g.standing(), Standing::Fenced);
    assert!(!g.due(), "stopped: nothing left to stop");
}
