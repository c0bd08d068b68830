//! Where a start goes: a node that can run it (the build's accelerator, QEMU and CPU baseline
//! for a memory restore; enough free memory and a free slot; the GPUs it passes through free),
//! preferring nodes that hold the build, then the least loaded.

use std::collections::{HashMap, HashSet};

use vmon_proto::cluster::{BuildOrigin, NodeInfo};

/// Memory a node keeps beyond a guest's RAM (QEMU itself, page tables, the host).
pub const HEADROOM_MB: u64 = 256;
/// What fetching the build costs a node that lacks it, in load (sandboxes per host CPU): a
/// holder is preferred until it runs this much more than the others.
pub const FETCH_PENALTY: f64 = 1.0;

/// What a start needs of a node.
#[derive(Debug, Clone, Default)]
pub struct Need {
    /// Guest RAM, when known.
    pub memory_mb: u64,
    /// Where the build was made, when known: a memory restore needs a matching node.
    pub origin: Option<BuildOrigin>,
    /// Whether the start restores memory (not a cold boot).
    pub memory_restore: bool,
    /// GPUs the start passes through: one node must have that many free.
    pub gpus: u32,
    /// GPUs of starts placed since each node's last heartbeat (which its `free` does not
    /// show yet), by node id.
    pub pending_gpus: HashMap<String, u32>,
}

/// Whether any member has `need.gpus` GPUs at all: a start asking for more than the largest
/// node has is refused at once (the api's 400), not retried as if busy.
pub fn gpu_capacity(members: &[NodeInfo], need: &Need) -> Result<(), String> {
    if need.gpus == 0 {
        return Ok(());
    }
    let most = members.iter().map(|n| n.gpus.total).max().unwrap_or(0);
    if need.gpus > most {
        return Err(format!(
            "the sandbox asks for {} GPUs and no node has that many (the most any node has is {most})",
            need.gpus
        ));
    }
    Ok(())
}

/// The nodes that can take the start, best first; or why none can. `extra(id)` is load the
/// registry does not show yet (starts placed since the node's last heartbeat).
pub fn rank(
    members: &[NodeInfo],
    holders: &HashSet<String>,
    need: &Need,
) -> Result<Vec<NodeInfo>, String> {
    rank_with(members, holders, need, |_| 0)
}

/// [`rank`] with load the registry does not show yet.
pub fn rank_with(
    members: &[NodeInfo],
    holders: &HashSet<String>,
    need: &Need,
    extra: impl Fn(&str) -> u32,
) -> Result<Vec<NodeInfo>, String> {
    if members.is_empty() {
        return Err("no node is registered".into());
    }
    let mut reasons = Vec::new();
    let mut fit: Vec<&NodeInfo> = Vec::new();
    for n in members {
        if n.free_slots == 0 {
            reasons.push(format!("{} has no free network slot", n.id));
        } else if n.free_memory_mb < need.memory_mb + HEADROOM_MB {
            reasons.push(format!(
                "{} has {} MiB free, {} MiB needed",
                n.id,
                n.free_memory_mb,
                need.memory_mb + HEADROOM_MB
            ));
        } else if need.gpus > 0 && free_gpus(n, need) < need.gpus {
            reasons.push(format!(
                "{} has {} of {} GPUs free, {} needed",
                n.id,
                free_gpus(n, need),
                n.gpus.total,
                need.gpus
            ));
        } else if let Some(o) = need.origin.as_ref().filter(|_| need.memory_restore) {
            if n.restores_from(o) {
                fit.push(n);
            } else {
                reasons.push(format!(
                    "{} cannot restore memory made under {} with QEMU {} (it has {} with QEMU {})",
                    n.id, o.accel, o.qemu_version, n.accel, n.qemu_version
                ));
            }
        } else {
            fit.push(n);
        }
    }
    if fit.is_empty() {
        return Err(format!("no node can take it: {}", reasons.join("; ")));
    }
    let score = |n: &NodeInfo| {
        let load = f64::from(n.running + extra(&n.id)) / f64::from(n.vcpus.max(1));
        if holders.contains(&n.id) {
            load
        } else {
            load + FETCH_PENALTY
        }
    };
    fit.sort_by(|a, b| {
        score(a)
            .total_cmp(&score(b))
            .then(b.free_memory_mb.cmp(&a.free_memory_mb))
            .then(a.id.cmp(&b.id))
    });
    Ok(fit.into_iter().cloned().collect())
}

/// A node's free GPUs less those of starts its heartbeat does not show yet.
fn free_gpus(n: &NodeInfo, need: &Need) -> u32 {
    n.gpus
        .free
        .saturating_sub(need.pending_gpus.get(&n.id).copied().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, running: u32, free: u64) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            rpc_url: format!("http://{id}"),
            ingress_url: None,
            host: "h".into(),
            accel: "tcg".into(),
            qemu_version: "7.2".into(),
            cpu_baseline: "cpu".into(),
            vcpus: 2,
            memory_mb: 4096,
            free_memory_mb: free,
            free_disk_mb: 10_000,
            free_slots: 10,
            running,
            updated_unix: 0,
            gpus: Default::default(),
        }
    }

    fn with_gpus(id: &str, total: u32, free: u32) -> NodeInfo {
        NodeInfo {
            gpus: vmon_proto::gpu::GpuInventory {
                total,
                free,
                models: Default::default(),
            },
            ..node(id, 0, 4000)
        }
    }

    #[test]
    fn gpus_are_counted() {
        let ms = [
            node("plain", 0, 4000),
            with_gpus("g2", 2, 1),
            with_gpus("g4", 4, 4),
        ];
        let need = |gpus| Need {
            gpus,
            ..Need::default()
        };
        let ids = |r: Vec<NodeInfo>| r.into_iter().map(|n| n.id).collect::<Vec<_>>();
        // No GPU asked: every node, the least loaded first.
        assert_eq!(
            rank(&ms, &HashSet::new(), &need(0))
                .map(ids)
                .expect("fits")
                .len(),
            3
        );
        assert_eq!(
            rank(&ms, &HashSet::new(), &need(1)).map(ids),
            Ok(vec!["g2".to_string(), "g4".to_string()])
        );
        assert_eq!(
            rank(&ms, &HashSet::new(), &need(3)).map(ids),
            Ok(vec!["g4".to_string()])
        );
        // Starts the heartbeat does not show yet hold their GPUs.
        let pending = Need {
            gpus: 1,
            pending_gpus: [("g4".to_string(), 4)].into(),
            ..Need::default()
        };
        assert_eq!(
            rank(&ms, &HashSet::new(), &pending).map(ids),
            Ok(vec!["g2".to_string()])
        );
        let only = rank(&ms, &HashSet::new(), &need(4))
            .map(ids)
            .expect("g4 has 4");
        assert_eq!(only, ["g4"]);
        let busy = [with_gpus("g4", 4, 1)];
        let e = rank(&busy, &HashSet::new(), &need(2)).expect_err("busy");
        assert!(e.contains("g4 has 1 of 4 GPUs free, 2 needed"), "{e}");
        assert_eq!(gpu_capacity(&busy, &need(4)), Ok(()));
        let e = gpu_capacity(&ms, &need(5)).expect_err("too many");
        assert!(e.contains("asks for 5 GPUs"), "{e}");
        assert!(e.contains("the most any node has is 4"), "{e}");
        assert_eq!(gpu_capacity(&ms, &need(0)), Ok(()));
    }

    #[test]
    fn holders_first_then_the_least_loaded() {
        let ms = [node("a", 3, 4000), node("b", 1, 4000), node("c", 0, 4000)];
        let none = HashSet::new();
        let order: Vec<_> = rank(&ms, &none, &Need::default())
            .expect("fits")
            .into_iter()
            .map(|n| n.id)
            .collect();
        assert_eq!(order, ["c", "b", "a"]);
        // a holds the build: preferred until it runs over a CPU's worth (2 here) more than c.
        let held: HashSet<String> = ["a".to_string()].into();
        let ms = [node("a", 3, 4000), node("b", 1, 4000), node("c", 0, 4000)];
        let order: Vec<_> = rank(&ms, &held, &Need::default())
            .expect("fits")
            .into_iter()
            .map(|n| n.id)
            .collect();
        assert_eq!(order, ["c", "a", "b"]);
        let ms = [node("a", 1, 4000), node("b", 1, 4000), node("c", 0, 4000)];
        let first = rank(&ms, &held, &Need::default()).expect("fits")[0]
            .id
            .clone();
        assert_eq!(first, "a");
        // Starts the heartbeat does not show yet count.
        let first = rank_with(&ms, &held, &Need::default(), |id| u32::from(id == "a") * 4)
            .expect("fits")[0]
            .id
            .clone();
        assert_eq!(first, "c");
    }

    #[test]
    fn no_room_and_no_matching_node_say_why() {
        let mut full = node("a", 0, 300);
        let need = Need {
            memory_mb: 512,
            ..Need::default()
        };
        let e = rank(std::slice::from_ref(&full), &HashSet::new(), &need).expect_err("no room");
        assert!(e.contains("a has 300 MiB free"), "{e}");
        full.free_memory_mb = 4000;
        full.free_slots = 0;
        let e = rank(std::slice::from_ref(&full), &HashSet::new(), &need).expect_err("no slot");
        assert!(e.contains("no free network slot"), "{e}");
        let kvm = BuildOrigin {
            node_id: "x".into(),
            accel: "kvm".into(),
            qemu_version: "7.2".into(),
            cpu_baseline: "cpu".into(),
        };
        let need = Need {
            memory_mb: 512,
            origin: Some(kvm.clone()),
            memory_restore: true,
            ..Need::default()
        };
        let e = rank(&[node("b", 0, 4000)], &HashSet::new(), &need).expect_err("accel");
        assert!(e.contains("cannot restore memory made under kvm"), "{e}");
        // A cold boot of the same build goes anywhere.
        let cold = Need {
            memory_restore: false,
            ..need
        };
        assert_eq!(
            rank(&[node("b", 0, 4000)], &HashSet::new(), &cold).map(|v| v.len()),
            Ok(1)
        );
        assert!(rank(&[], &HashSet::new(), &Need::default()).is_err());
    }
}
