//! `vmon doctor`'s GPU part: whether this host can pass GPUs through by VFIO (the modules,
//! the IOMMU's groups, the devices bound to `vfio-pci` and their groups' viability, the
//! device nodes, the memory-lock limit). A host with nothing bound to `vfio-pci` has no GPU
//! sandboxes, which is no failure; a host with some whose setup is incomplete fails.

use std::path::Path;

/// One line of the report: whether it is fine, and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub ok: bool,
    pub what: &'static str,
    pub detail: String,
}

fn check(ok: bool, what: &'static str, detail: impl Into<String>) -> Check {
    Check {
        ok,
        what,
        detail: detail.into(),
    }
}

/// The checks for the tree at `sysfs` (`/sys`) and the device nodes in `dev_vfio`
/// (`/dev/vfio`); `memlock` is this process's `RLIMIT_MEMLOCK` (bytes, `None`: unlimited).
pub fn checks(sysfs: &Path, dev_vfio: &Path, memlock: Option<u64>) -> Vec<Check> {
    let found = vmon_vm::vfio::discover(sysfs);
    let wanted = !found.groups.is_empty() || !found.ungrouped.is_empty();
    let mut out = Vec::new();
    out.push(modules_check(sysfs, wanted));
    out.push(iommu_check(sysfs, wanted));
    if !wanted {
        out.push(check(
            true,
            "gpus",
            "no device is bound to vfio-pci: this node offers no GPUs",
        ));
        return out;
    }
    for g in &found.groups {
        out.extend(group_checks(g, dev_vfio));
    }
    for addr in &found.ungrouped {
        out.push(check(
            false,
            "gpus",
            format!("{addr} is bound to vfio-pci but in no IOMMU group (is the IOMMU on?)"),
        ));
    }
    let container = dev_vfio.join("vfio");
    out.push(check(
        container.exists(),
        "gpus",
        if container.exists() {
            format!("{} present", container.display())
        } else {
            format!("{} is missing", container.display())
        },
    ));
    out.push(check(
        true,
        "memlock",
        match memlock {
            None => "unlimited here; the node sets each GPU QEMU's RLIMIT_MEMLOCK to its RAM + 1 GiB".into(),
            Some(b) => format!(
                "{} MiB here; the node raises each GPU QEMU's RLIMIT_MEMLOCK to its RAM + 1 GiB (needs root)",
                b >> 20
            ),
        },
    ));
    out
}

/// The VFIO modules (a failure only when devices are bound to `vfio-pci`: `wanted`).
fn modules_check(sysfs: &Path, wanted: bool) -> Check {
    let modules: Vec<&str> = ["vfio", "vfio_pci", "vfio_iommu_type1"]
        .into_iter()
        .filter(|m| !sysfs.join("module").join(m).exists())
        .collect();
    if modules.is_empty() {
        check(
            true,
            "vfio modules",
            "vfio, vfio_pci, vfio_iommu_type1 loaded",
        )
    } else {
        check(
            !wanted,
            "vfio modules",
            format!(
                "{} not loaded (modprobe vfio-pci; GPU sandboxes need them)",
                modules.join(", ")
            ),
        )
    }
}

/// The IOMMU is on: it has groups.
fn iommu_check(sysfs: &Path, wanted: bool) -> Check {
    let groups = std::fs::read_dir(sysfs.join("kernel/iommu_groups"))
        .map(|rd| rd.count())
        .unwrap_or(0);
    check(
        groups > 0 || !wanted,
        "iommu",
        if groups > 0 {
            format!("{groups} IOMMU groups")
        } else {
            "no IOMMU groups: the IOMMU is off (intel_iommu=on or amd_iommu=on on the kernel command line, and VT-d/AMD-Vi in the firmware)".into()
        },
    )
}

/// One IOMMU group with GPUs: passed whole (or why not), and its device node.
fn group_checks(g: &vmon_vm::vfio::IommuGroup, dev_vfio: &Path) -> Vec<Check> {
    let devices: Vec<String> = g
        .devices
        .iter()
        .map(|d| {
            format!(
                "{} {} class {:06x} ({})",
                d.addr,
                d.model,
                d.class,
                d.driver.as_deref().unwrap_or("no driver")
            )
        })
        .collect();
    let gpus = g.gpus().count();
    let mut out = vec![match &g.problem {
        None => check(
            true,
            "gpus",
            format!(
                "IOMMU group {}: {gpus} GPU(s), passed whole: {}",
                g.id,
                devices.join("; ")
            ),
        ),
        Some(p) => check(false, "gpus", p.clone()),
    }];
    let node = g.dev_node(dev_vfio);
    if !node.exists() {
        out.push(check(
            false,
            "gpus",
            format!("{} is missing (vfio-pci did not make it)", node.display()),
        ));
    }
    out
}

/// This process's `RLIMIT_MEMLOCK` (`None`: unlimited).
pub fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return Some(0);
    }
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmon_vm::vfio::fake::{build, Dev};

    // The trees stand in for hardware: this machine has no GPU and no IOMMU.
    #[test]
    fn a_host_without_vfio_passes_and_says_so() {
        let t = tempfile::tempdir().expect("tempdir");
        let c = checks(t.path(), &t.path().join("dev"), Some(8 << 20));
        assert!(c.iter().all(|c| c.ok), "{c:?}");
        assert!(
            c.iter().any(|c| c.detail.contains("offers no GPUs")),
            "{c:?}"
        );
        assert!(c.iter().any(|c| c.detail.contains("not loaded")), "{c:?}");
    }

    #[test]
    fn a_host_with_gpus_reports_each_group_and_what_is_missing() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path();
        build(
            root,
            &[
                Dev {
                    addr: "0000:01:00.0",
                    class: 0x030200,
                    model: "10de:2330",
                    driver: Some("vfio-pci"),
                    group: Some(7),
                },
                Dev {
                    addr: "0000:02:00.0",
                    class: 0x030000,
                    model: "1002:73bf",
                    driver: Some("vfio-pci"),
                    group: Some(8),
                },
                Dev {
                    addr: "0000:02:00.1",
                    class: 0x040300,
                    model: "1002:ab28",
                    driver: Some("snd_hda_intel"),
                    group: Some(8),
                },
            ],
        )
        .expect("tree");
        for m in ["vfio", "vfio_pci", "vfio_iommu_type1"] {
            std::fs::create_dir_all(root.join("module").join(m)).expect("module");
        }
        let dev = root.join("dev");
        std::fs::create_dir_all(&dev).expect("dev");
        std::fs::write(dev.join("vfio"), b"").expect("container");
        std::fs::write(dev.join("7"), b"").expect("group node");
        let c = checks(root, &dev, None);
        let text: Vec<String> = c
            .iter()
            .map(|c| format!("{} {}", if c.ok { "ok" } else { "FAIL" }, c.detail))
            .collect();
        let has = |s: &str| text.iter().any(|t| t.contains(s));
        assert!(has("ok 2 IOMMU groups"), "{text:?}");
        assert!(has("ok IOMMU group 7: 1 GPU(s)"), "{text:?}");
        assert!(
            has("FAIL IOMMU group 8 is not viable: 0000:02:00.1 is bound to snd_hda_intel"),
            "{text:?}"
        );
        assert!(has("FAIL") && has("dev/8 is missing"), "{text:?}");
        assert!(
            has("ok vfio, vfio_pci, vfio_iommu_type1 loaded"),
            "{text:?}"
        );
        assert!(has("unlimited here"), "{text:?}");
    }
}
