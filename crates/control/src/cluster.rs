//! The leader's reconciliation in a cluster: records and VMs are compared node by node.
//!
//! * A node that left the registry (its lease expired: killed, crashed, stalled, partitioned)
//!   is *suspect*, not dead: its running sandboxes stay `running` for the grace
//!   (`node_grace_secs`), and a node back within it keeps every one. Past the grace they are
//!   reported killed with `kill_reason: orphaned`, event and webhook. One whose node answers
//!   but no longer runs it is reported at once. The grace is counted from when this leader
//!   first saw the node gone: a new leader starts it again (never shorter).
//! * A VM a node runs that no record names (an api replica died between the node's start and
//!   the record, or a node came back after the cluster reported its sandboxes killed) is
//!   killed: nothing the cluster reported gone comes back.
//!
//! Every decision is taken again under the sandbox's lock, with a short wait: a sandbox in a
//! transition is left for the next round, so a create, resume or fork in flight (they hold the
//! lock from the node's start to the record) is never mistaken for a stray VM or an orphan.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use vmon_proto::cluster::Cluster;
use vmon_proto::node::Running;

use super::{Control, KillReason};
use crate::records::{SandboxRecord, SandboxState};

/// How often the leader compares records with the nodes.
pub(crate) const RECONCILE_EVERY: Duration = Duration::from_secs(3);
/// How long a round waits for one sandbox's lock before leaving it for the next round.
const LOCK_WAIT: Duration = Duration::from_millis(300);
/// How long a team's admission counter must stay above its running sandboxes before the
/// difference is released: longer than any start takes, so only units whose holder died
/// (an api replica killed between admission and record) are given back.
const LEAK_AFTER: Duration = Duration::from_secs(60);

/// Per team: since when its counter has exceeded its running records, and the smallest
/// excess seen since.
#[derive(Default)]
pub(crate) struct Leaks(std::sync::Mutex<HashMap<String, (std::time::Instant, u64)>>);

/// Per node that left the registry while sandboxes were placed on it: since when.
#[derive(Default)]
pub(crate) struct Suspects(std::sync::Mutex<HashMap<String, std::time::Instant>>);

impl Suspects {
    /// Notes the nodes seen gone now (and forgets those back); returns those gone for at
    /// least `grace`.
    fn past_grace(&self, gone: &HashSet<String>, grace: Duration) -> HashSet<String> {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|n, _| gone.contains(n));
        let now = std::time::Instant::now();
        let mut past = HashSet::new();
        for n in gone {
            let since = *m.entry(n.clone()).or_insert_with(|| {
                tracing::warn!(node_id = %n, grace_secs = grace.as_secs(), "a node's registration lapsed: suspect, its sandboxes keep running for the grace");
                now
            });
            if now.duration_since(since) >= grace {
                past.insert(n.clone());
            }
        }
        past
    }
}

impl Control {
    /// One round (leader only).
    pub(crate) async fn reconcile_cluster(&self, cluster: &dyn Cluster) {
        let members = cluster.members().await;
        let live: HashSet<String> = members.iter().map(|n| n.id.clone()).collect();
        let mut running: HashMap<String, Vec<Running>> = HashMap::new();
        for n in &members {
            match cluster.running_on(&n.id).await {
                Ok(list) => {
                    running.insert(n.id.clone(), list);
                }
                Err(e) => {
                    tracing::debug!(node_id = %n.id, error = %e, "node did not answer; its sandboxes wait")
                }
            }
        }
        let records = match self.records.sandboxes(None).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "cluster reconciliation could not list sandboxes");
                return;
            }
        };
        let all_answered = running.len() == members.len();
        let mut placed_on = Vec::new();
        for rec in records.iter().filter(|r| r.state == SandboxState::Running) {
            placed_on.push((rec, cluster.placement(&rec.id).await));
        }
        let gone: HashSet<String> = placed_on
            .iter()
            .filter_map(|(_, p)| p.clone())
            .filter(|n| !live.contains(n))
            .collect();
        let grace = Duration::from_secs(self.config.node_grace_secs);
        let past_grace = self.suspects.past_grace(&gone, grace);
        for (rec, placed) in placed_on {
            let orphaned = match placed.as_deref() {
                // Suspect: it may still be alive, its guests running; wait out the grace.
                Some(n) if gone.contains(n) => past_grace.contains(n),
                placed => vm_gone(rec, placed, &running, all_answered),
            };
            if orphaned {
                self.orphan(cluster, &rec.id, &rec.execution_id).await;
            }
        }
        if all_answered {
            self.release_leaked_units(&records).await;
        }
        for (node_id, vms) in &running {
            for vm in vms {
                // Template build VMs (`b…`) have no record while they build.
                if !vm.sandbox_id.starts_with('i') {
                    continue;
                }
                let recorded = records.iter().any(|r| {
                    r.id == vm.sandbox_id
                        && r.execution_id == vm.execution_id
                        && r.state == SandboxState::Running
                });
                // A live migration's source that outlived the switch (a crash right after it)
                // runs the same execution as the record, on another node than its placement.
                let elsewhere = cluster
                    .placement(&vm.sandbox_id)
                    .await
                    .is_some_and(|p| p != *node_id);
                if !recorded || elsewhere {
                    self.kill_stray(cluster, node_id, vm).await;
                }
            }
        }
    }

    /// Gives back admission units nobody holds any more (see [`LEAK_AFTER`]).
    async fn release_leaked_units(&self, records: &[SandboxRecord]) {
        let teams = match self.records.teams().await {
            Ok(t) => t,
            Err(_) => return,
        };
        for team in teams {
            let key = super::admission_key(&team.id);
            let Ok(count) = self.kv.counter(&key).await else {
                continue;
            };
            let running = records
                .iter()
                .filter(|r| r.team_id == team.id && r.state == SandboxState::Running)
                .count() as u64;
            let excess = count.saturating_sub(running);
            let due = {
                let mut leaks = self.leaks.0.lock().unwrap_or_else(|p| p.into_inner());
                if excess == 0 {
                    leaks.remove(&team.id);
                    0
                } else {
                    let seen = leaks
                        .entry(team.id.clone())
                        .or_insert((std::time::Instant::now(), excess));
                    seen.1 = seen.1.min(excess);
                    if seen.0.elapsed() >= LEAK_AFTER {
                        let n = seen.1;
                        leaks.remove(&team.id);
                        n
                    } else {
                        0
                    }
                }
            };
            if due > 0 {
                tracing::warn!(team_id = %team.id, units = due, "releasing admission units whose holder died");
                for _ in 0..due {
                    self.release(&key).await;
                }
            }
        }
    }

    /// Reports a running sandbox killed (`orphaned`) once the lock shows it is still the
    /// same execution and its VM is still nowhere.
    async fn orphan(&self, cluster: &dyn Cluster, id: &str, execution_id: &str) {
        let Ok(guard) = self.kv.lock(&format!("sandbox/{id}"), LOCK_WAIT).await else {
            return;
        };
        let current = self.records.sandbox(id).await.ok().flatten();
        if let Some(rec) =
            current.filter(|r| r.execution_id == execution_id && r.state == SandboxState::Running)
        {
            let members: HashSet<String> =
                cluster.members().await.into_iter().map(|n| n.id).collect();
            let still_there = match cluster.placement(id).await {
                Some(n) if members.contains(&n) => match cluster.running_on(&n).await {
                    Ok(list) => list
                        .iter()
                        .any(|r| r.sandbox_id == id && r.execution_id == execution_id),
                    // It does not answer now: decide next round.
                    Err(_) => true,
                },
                _ => false,
            };
            if !still_there {
                tracing::warn!(
                    sandbox_id = id,
                    "the sandbox's node is gone: reporting it killed (orphaned)"
                );
                if let Err(e) = self
                    .kill_locked(rec, KillReason::Orphaned, guard.fence().token())
                    .await
                {
                    tracing::warn!(sandbox_id = id, error = %e, "reporting an orphan failed");
                }
                cluster.forget(id).await;
            }
        }
        let _ = guard.unlock().await;
    }

    /// Kills a VM no record names, once the lock shows no transition is making it one.
    async fn kill_stray(&self, cluster: &dyn Cluster, node_id: &str, vm: &Running) {
        let id = &vm.sandbox_id;
        let Ok(guard) = self.kv.lock(&format!("sandbox/{id}"), LOCK_WAIT).await else {
            return;
        };
        let current = self.records.sandbox(id).await.ok().flatten();
        let recorded = current
            .is_some_and(|r| r.execution_id == vm.execution_id && r.state == SandboxState::Running);
        let elsewhere = cluster.placement(id).await.is_some_and(|p| p != node_id);
        if !recorded || elsewhere {
            tracing::warn!(sandbox_id = %id, node_id, elsewhere, "VM without a record here: killing it");
            if let Err(e) = cluster.kill_on(node_id, id, &vm.execution_id).await {
                tracing::warn!(sandbox_id = %id, node_id, error = %e, "killing a stray VM failed");
            }
        }
        let _ = guard.unlock().await;
    }
}

/// Whether a running record's VM is gone, from one survey of live nodes: its node answered
/// without it (a sandbox placed nowhere: no answering node runs it and all answered).
fn vm_gone(
    rec: &SandboxRecord,
    placed: Option<&str>,
    running: &HashMap<String, Vec<Running>>,
    all_answered: bool,
) -> bool {
    let runs = |list: &Vec<Running>| {
        list.iter()
            .any(|r| r.sandbox_id == rec.id && r.execution_id == rec.execution_id)
    };
    match placed {
        Some(n) => running.get(n).is_some_and(|l| !runs(l)),
        None => all_answered && !running.values().any(runs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lapsed_node_is_suspect_until_the_grace_passes_and_forgiven_when_back() {
        let s = Suspects::default();
        let gone: HashSet<String> = ["n1".to_string()].into();
        let long = Duration::from_secs(3600);
        assert!(s.past_grace(&gone, long).is_empty(), "suspect, not dead");
        assert!(s.past_grace(&gone, Duration::ZERO).contains("n1"));
        // Back: forgotten, so a later lapse starts its grace again.
        assert!(s.past_grace(&HashSet::new(), long).is_empty());
        assert!(s.0.lock().unwrap_or_else(|p| p.into_inner()).is_empty());
        assert!(s.past_grace(&gone, long).is_empty());
    }
}
