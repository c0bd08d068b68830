//! The node's GPUs: the IOMMU groups it can pass through (found at open, [`vmon_vm::vfio`]),
//! which sandbox holds each, and the device nodes handed to a GPU sandbox's QEMU.
//!
//! A group is the unit: a sandbox asking for `n` GPUs gets whole groups holding at least `n`
//! GPUs between them (the fewest GPUs that reach `n`). Every way a GPU sandbox's QEMU ends gives
//! its groups back ([`Gpus::release`]): kill, pause (always filesystem-only, so the QEMU quits),
//! a failed start, the reaping of a dead QEMU, and after a node restart only the re-adopted
//! live sandboxes hold any.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use vmon_proto::gpu::GpuInventory;
use vmon_proto::node::NodeError;
use vmon_vm::vfio::{self, IommuGroup};

/// The passable groups and who holds them.
pub struct Gpus {
    /// Where the groups' device nodes are (`/dev/vfio`).
    dev_dir: PathBuf,
    groups: Vec<IommuGroup>,
    /// Group id → the sandbox holding it.
    held: std::sync::Mutex<HashMap<u32, String>>,
}

impl Gpus {
    /// The usable groups under `sysfs` (`/sys`; a test's tree on machines without GPUs).
    pub fn discover(sysfs: &Path, dev_dir: &Path) -> Gpus {
        let found = vfio::discover(sysfs);
        for g in &found.groups {
            if let Some(p) = &g.problem {
                tracing::warn!(group = g.id, "{p}");
            }
        }
        if !found.ungrouped.is_empty() {
            tracing::warn!(devices = ?found.ungrouped, "devices bound to vfio-pci have no IOMMU group (is the IOMMU on?): not used");
        }
        let groups: Vec<IommuGroup> = found.usable().cloned().collect();
        if !groups.is_empty() {
            tracing::info!(
                groups = ?groups.iter().map(|g| g.id).collect::<Vec<_>>(),
                "GPUs for passthrough"
            );
        }
        Gpus {
            dev_dir: dev_dir.to_path_buf(),
            groups,
            held: Default::default(),
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<u32, String>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Total, free, and the free ones' models.
    pub fn inventory(&self) -> GpuInventory {
        let held = self.held();
        let mut inv = GpuInventory::default();
        let mut models = BTreeMap::new();
        for g in &self.groups {
            let n = g.gpus().count() as u32;
            inv.total += n;
            if !held.contains_key(&g.id) {
                inv.free += n;
                for d in g.gpus() {
                    *models.entry(d.model.clone()).or_insert(0) += 1;
                }
            }
        }
        inv.models = models;
        inv
    }

    /// Takes groups holding at least `n` GPUs for `sandbox_id`. More than the node has at all
    /// is `InvalidArgument` (no wait helps); more than it has free is `Exhausted`.
    pub fn take(&self, sandbox_id: &str, n: u32) -> Result<Vec<IommuGroup>, NodeError> {
        let total: u32 = self.groups.iter().map(|g| g.gpus().count() as u32).sum();
        if n > total {
            return Err(NodeError::InvalidArgument(format!(
                "the sandbox asks for {n} GPUs and this node has {total}"
            )));
        }
        let mut held = self.held();
        let mut free: Vec<&IommuGroup> = self
            .groups
            .iter()
            .filter(|g| !held.contains_key(&g.id))
            .collect();
        // Smallest groups first: a big group is kept for a sandbox that needs it.
        free.sort_by_key(|g| (g.gpus().count(), g.id));
        let mut got = Vec::new();
        let mut count = 0u32;
        for g in free {
            if count >= n {
                break;
            }
            count += g.gpus().count() as u32;
            got.push(g.clone());
        }
        if count < n {
            let free: u32 = self.inventory_free(&held);
            return Err(NodeError::Exhausted(format!(
                "the sandbox asks for {n} GPUs and {free} of this node's {total} are free"
            )));
        }
        for g in &got {
            held.insert(g.id, sandbox_id.to_string());
        }
        Ok(got)
    }

    fn inventory_free(&self, held: &HashMap<u32, String>) -> u32 {
        self.groups
            .iter()
            .filter(|g| !held.contains_key(&g.id))
            .map(|g| g.gpus().count() as u32)
            .sum()
    }

    /// Marks `groups` held by `sandbox_id` (a sandbox re-adopted after a restart).
    pub fn hold(&self, sandbox_id: &str, groups: &[u32]) {
        let mut held = self.held();
        for g in groups {
            if self.groups.iter().any(|k| k.id == *g) {
                held.insert(*g, sandbox_id.to_string());
            }
        }
    }

    /// Gives back every group `sandbox_id` holds, and their device nodes to root; how many.
    pub fn release(&self, sandbox_id: &str) -> usize {
        let mut held = self.held();
        let mine: Vec<u32> = held
            .iter()
            .filter(|(_, s)| *s == sandbox_id)
            .map(|(g, _)| *g)
            .collect();
        for g in &mine {
            held.remove(g);
            let node = self.dev_dir.join(g.to_string());
            if node.exists() {
                if let Err(e) = std::os::unix::fs::chown(&node, Some(0), Some(0)) {
                    tracing::warn!(group = g, error = %e, "giving a VFIO group back to root");
                }
            }
        }
        if !mine.is_empty() {
            tracing::info!(sandbox = sandbox_id, groups = ?mine, "GPUs released");
        }
        mine.len()
    }

    /// Hands the groups' device nodes (`/dev/vfio/<n>`) to the QEMU's user (none: QEMU runs
    /// as root). A missing node is an error: the group cannot be opened.
    pub fn grant(&self, groups: &[IommuGroup], user: Option<(u32, u32)>) -> anyhow::Result<()> {
        for g in groups {
            let node = g.dev_node(&self.dev_dir);
            if !node.exists() {
                anyhow::bail!(
                    "{} is missing: the IOMMU group of {} cannot be opened (is vfio-pci bound and the IOMMU on?)",
                    node.display(),
                    g.devices.first().map(|d| d.addr.as_str()).unwrap_or("?")
                );
            }
            if let Some((uid, gid)) = user {
                std::os::unix::fs::chown(&node, Some(uid), Some(gid))?;
            }
        }
        Ok(())
    }
}

/// The PCI addresses QEMU gets for `groups`: every member bound to `vfio-pci`.
pub fn devices(groups: &[IommuGroup]) -> Vec<String> {
    groups
        .iter()
        .flat_map(|g| g.passed().map(|d| d.addr.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmon_vm::vfio::fake::{build, Dev};

    /// A tree standing in for a host with GPUs (this machine has none, and no IOMMU): groups
    /// 3 and 4 one GPU each (4 with its audio function), group 5 two GPUs.
    fn host(root: &Path) {
        let d = |addr, class, group| Dev {
            addr,
            class,
            model: "10de:2330",
            driver: Some("vfio-pci"),
            group: Some(group),
        };
        build(
            root,
            &[
                d("0000:01:00.0", 0x030200, 3),
                d("0000:02:00.0", 0x030000, 4),
                d("0000:02:00.1", 0x040300, 4),
                d("0000:03:00.0", 0x030200, 5),
                d("0000:03:00.1", 0x030200, 5),
            ],
        )
        .expect("tree");
    }

    #[test]
    fn take_and_release_keep_the_count() {
        let t = tempfile::tempdir().expect("tempdir");
        host(t.path());
        let g = Gpus::discover(t.path(), &t.path().join("dev"));
        assert_eq!((g.inventory().total, g.inventory().free), (4, 4));
        assert_eq!(g.inventory().models.get("10de:2330"), Some(&4));
        let a = g.take("a", 1).expect("one");
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].id, 3, "the smallest group first");
        let b = g.take("b", 2).expect("two");
        assert_eq!(b.iter().map(|g| g.id).collect::<Vec<_>>(), [4, 5]);
        assert_eq!(
            devices(&b),
            [
                "0000:02:00.0",
                "0000:02:00.1",
                "0000:03:00.0",
                "0000:03:00.1"
            ],
            "whole groups, audio function included"
        );
        assert_eq!(g.inventory().free, 0);
        assert!(g.inventory().models.is_empty());
        match g.take("c", 1) {
            Err(NodeError::Exhausted(m)) => assert!(m.contains("0 of this node's 4"), "{m}"),
            other => panic!("expected Exhausted, got {other:?}"),
        }
        match g.take("c", 5) {
            Err(NodeError::InvalidArgument(m)) => assert!(m.contains("this node has 4"), "{m}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        assert_eq!(g.release("b"), 2);
        assert_eq!(g.release("b"), 0, "a second release is a no-op");
        assert_eq!(g.inventory().free, 3);
        assert_eq!(g.release("a"), 1);
        assert_eq!(g.inventory().free, 4);
        // A restart re-adopts a live sandbox's groups; an unknown group is ignored.
        g.hold("d", &[5, 99]);
        assert_eq!(g.inventory().free, 2);
        assert_eq!(g.release("d"), 1);
    }

    #[test]
    fn grant_needs_the_device_node() {
        let t = tempfile::tempdir().expect("tempdir");
        host(t.path());
        let dev = t.path().join("dev");
        let g = Gpus::discover(t.path(), &dev);
        let a = g.take("a", 1).expect("one");
        let e = g.grant(&a, None).expect_err("no /dev/vfio/3");
        assert!(format!("{e:#}").contains("dev/3 is missing"), "{e:#}");
        std::fs::create_dir_all(&dev).expect("dev");
        std::fs::write(dev.join("3"), b"").expect("node");
        g.grant(&a, None).expect("present");
    }

    #[test]
    fn a_host_without_vfio_has_none() {
        let t = tempfile::tempdir().expect("tempdir");
        let g = Gpus::discover(t.path(), t.path());
        assert_eq!(g.inventory(), GpuInventory::default());
        assert!(matches!(g.take("a", 1), Err(NodeError::InvalidArgument(_))));
        assert!(g.take("a", 0).expect("zero").is_empty());
    }
}
