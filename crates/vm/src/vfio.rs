//! PCI passthrough by VFIO: the devices bound to `vfio-pci`, their IOMMU groups, and the QEMU
//! arguments that give a guest a whole group.
//!
//! Discovery reads sysfs under a root the caller names (`/sys` on a host; a test builds a tree
//! of the same shape, since the machines vmon is tested on have no GPU and no IOMMU):
//! `bus/pci/drivers/vfio-pci/<addr>` (the devices bound to the driver),
//! `bus/pci/devices/<addr>/{class,vendor,device,driver,iommu_group}` and
//! `kernel/iommu_groups/<n>/devices/<addr>`. A group can be handed to a guest only whole (the
//! IOMMU isolates groups, not devices): every endpoint in it must be bound to `vfio-pci` (or to
//! no driver); PCI bridges may stay with their own driver and are not passed.

use std::path::{Path, PathBuf};

/// The PCI slots passed-through devices take in the guest (`0x10` on): after the pinned
/// devices (net 3, disk 4, virtio-fs shares from 5) and below the bus's 32.
pub const FIRST_SLOT: u32 = 0x10;
/// The most devices one guest gets (slots `0x10`..`0x1f`).
pub const MAX_DEVICES: usize = 16;

/// One PCI function as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// `dddd:bb:dd.f`, checked (it goes into QEMU's command line).
    pub addr: String,
    /// The class code (`0x030000` a VGA controller, `0x030200` a 3D controller).
    pub class: u32,
    /// `vendor:device`, hex without `0x` (`10de:2330`).
    pub model: String,
    /// The driver it is bound to, if any.
    pub driver: Option<String>,
}

impl PciDevice {
    /// A display controller (class 0x03) or a processing accelerator (0x12).
    pub fn is_gpu(&self) -> bool {
        matches!(self.class >> 16, 0x03 | 0x12)
    }

    /// A bridge (class 0x06): stays with its driver, not passed to the guest.
    pub fn is_bridge(&self) -> bool {
        self.class >> 16 == 0x06
    }
}

/// One IOMMU group holding at least one device bound to `vfio-pci`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IommuGroup {
    pub id: u32,
    pub devices: Vec<PciDevice>,
    /// Why the group cannot be passed through (a member bound to another driver, too many
    /// devices), or `None` when it can.
    pub problem: Option<String>,
}

impl IommuGroup {
    /// The devices a guest gets: every member bound to `vfio-pci`.
    pub fn passed(&self) -> impl Iterator<Item = &PciDevice> {
        self.devices
            .iter()
            .filter(|d| d.driver.as_deref() == Some("vfio-pci"))
    }

    /// The GPUs among [`IommuGroup::passed`].
    pub fn gpus(&self) -> impl Iterator<Item = &PciDevice> {
        self.passed().filter(|d| d.is_gpu())
    }

    /// `/dev/vfio/<id>` under `dev_dir` (normally `/dev/vfio`).
    pub fn dev_node(&self, dev_dir: &Path) -> PathBuf {
        dev_dir.join(self.id.to_string())
    }
}

/// Whether `s` is a PCI address as sysfs names devices: `dddd:bb:dd.f`, lowercase hex.
pub fn valid_addr(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && hex(0..4)
        && hex(5..7)
        && hex(8..10)
        && (b'0'..=b'7').contains(&b[11])
}

fn read_hex(path: &Path) -> Option<u32> {
    let s = std::fs::read_to_string(path).ok()?;
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

/// The file name a symlink points at (`driver` → `…/vfio-pci`).
fn link_name(path: &Path) -> Option<String> {
    let target = std::fs::read_link(path).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

fn device(sysfs: &Path, addr: &str) -> PciDevice {
    let dir = sysfs.join("bus/pci/devices").join(addr);
    let vendor = read_hex(&dir.join("vendor")).unwrap_or(0);
    let dev = read_hex(&dir.join("device")).unwrap_or(0);
    PciDevice {
        addr: addr.to_string(),
        class: read_hex(&dir.join("class")).unwrap_or(0),
        model: format!("{vendor:04x}:{dev:04x}"),
        driver: link_name(&dir.join("driver")),
    }
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// What discovery found: the groups of devices bound to `vfio-pci`, and devices bound to it
/// that no IOMMU group holds (the IOMMU is off: they cannot be passed).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovery {
    pub groups: Vec<IommuGroup>,
    pub ungrouped: Vec<String>,
}

impl Discovery {
    /// The groups a guest can be given that hold a GPU.
    pub fn usable(&self) -> impl Iterator<Item = &IommuGroup> {
        self.groups
            .iter()
            .filter(|g| g.problem.is_none() && g.gpus().next().is_some())
    }
}

/// Reads the devices bound to `vfio-pci` and their IOMMU groups under `sysfs` (`/sys`). A
/// missing driver directory (the module is not loaded) is an empty answer.
pub fn discover(sysfs: &Path) -> Discovery {
    let mut out = Discovery::default();
    let mut ids: Vec<u32> = Vec::new();
    for addr in entries(&sysfs.join("bus/pci/drivers/vfio-pci")) {
        if !valid_addr(&addr) {
            continue;
        }
        let group = link_name(
            &sysfs
                .join("bus/pci/devices")
                .join(&addr)
                .join("iommu_group"),
        )
        .and_then(|g| g.parse::<u32>().ok());
        match group {
            Some(g) if !ids.contains(&g) => ids.push(g),
            Some(_) => {}
            None => out.ungrouped.push(addr),
        }
    }
    ids.sort_unstable();
    for id in ids {
        let members = entries(&sysfs.join(format!("kernel/iommu_groups/{id}/devices")));
        let devices: Vec<PciDevice> = members
            .iter()
            .filter(|a| valid_addr(a))
            .map(|a| device(sysfs, a))
            .collect();
        let mut group = IommuGroup {
            id,
            devices,
            problem: None,
        };
        group.problem = problem(&group);
        out.groups.push(group);
    }
    out
}

fn problem(g: &IommuGroup) -> Option<String> {
    let held: Vec<String> = g
        .devices
        .iter()
        .filter(|d| !d.is_bridge())
        .filter_map(|d| match d.driver.as_deref() {
            None | Some("vfio-pci") => None,
            Some(other) => Some(format!("{} is bound to {other}", d.addr)),
        })
        .collect();
    if !held.is_empty() {
        return Some(format!(
            "IOMMU group {} is not viable: {} (bind every device of the group to vfio-pci)",
            g.id,
            held.join(", ")
        ));
    }
    let n = g.passed().count();
    if n > MAX_DEVICES {
        return Some(format!(
            "IOMMU group {} has {n} devices, more than the {MAX_DEVICES} a guest can take",
            g.id
        ));
    }
    None
}

/// The QEMU arguments that give a guest `devices` (PCI addresses, checked by
/// [`valid_addr`]): one `vfio-pci` device each at slots from [`FIRST_SLOT`], and guest memory
/// locked (`-overcommit mem-lock=on`: VFIO pins every page a device may reach by DMA, so the
/// guest's memory must never be swapped or moved; the process also needs `RLIMIT_MEMLOCK`
/// above its RAM, [`memlock_bytes`]). Empty for no devices.
pub fn args(devices: &[String]) -> anyhow::Result<Vec<String>> {
    if devices.is_empty() {
        return Ok(Vec::new());
    }
    if devices.len() > MAX_DEVICES {
        anyhow::bail!(
            "{} passed-through devices, more than {MAX_DEVICES}",
            devices.len()
        );
    }
    let mut a = vec!["-overcommit".to_string(), "mem-lock=on".to_string()];
    for (i, d) in devices.iter().enumerate() {
        if !valid_addr(d) {
            anyhow::bail!("{d:?} is not a PCI address");
        }
        a.push("-device".into());
        a.push(format!(
            "vfio-pci,host={d},id=hostdev{i},addr={:#x}",
            FIRST_SLOT + i as u32
        ));
    }
    Ok(a)
}

/// The `RLIMIT_MEMLOCK` a QEMU with passed-through devices needs: its guest RAM, which VFIO
/// pins, plus 1 GiB for what `mem-lock=on` locks of QEMU itself (its heap, TCG's translation
/// cache). Its cgroup's memory limit still bounds the whole.
pub fn memlock_bytes(memory_mb: u32) -> u64 {
    (u64::from(memory_mb) + 1024) << 20
}

/// Builds, under `root`, a sysfs tree of the shape [`discover`] reads: for tests, on machines
/// with no GPU and no IOMMU (it stands in for the hardware only there). Each device is
/// `(addr, class, vendor:device, driver, group)`.
pub mod fake {
    use std::path::Path;

    pub struct Dev<'a> {
        pub addr: &'a str,
        pub class: u32,
        pub model: &'a str,
        pub driver: Option<&'a str>,
        pub group: Option<u32>,
    }

    /// Writes the devices into a tree at `root` (made if missing).
    pub fn build(root: &Path, devs: &[Dev<'_>]) -> std::io::Result<()> {
        use std::os::unix::fs::symlink;
        let devices = root.join("bus/pci/devices");
        let drivers = root.join("bus/pci/drivers");
        std::fs::create_dir_all(&devices)?;
        std::fs::create_dir_all(drivers.join("vfio-pci"))?;
        for d in devs {
            let dir = devices.join(d.addr);
            std::fs::create_dir_all(&dir)?;
            let (vendor, device) = d.model.split_once(':').unwrap_or(("0000", "0000"));
            std::fs::write(dir.join("class"), format!("0x{:06x}\n", d.class))?;
            std::fs::write(dir.join("vendor"), format!("0x{vendor}\n"))?;
            std::fs::write(dir.join("device"), format!("0x{device}\n"))?;
            if let Some(drv) = d.driver {
                let drv_dir = drivers.join(drv);
                std::fs::create_dir_all(&drv_dir)?;
                symlink(&drv_dir, dir.join("driver"))?;
                symlink(&dir, drv_dir.join(d.addr))?;
            }
            if let Some(g) = d.group {
                let gdir = root.join(format!("kernel/iommu_groups/{g}"));
                std::fs::create_dir_all(gdir.join("devices"))?;
                symlink(&gdir, dir.join("iommu_group"))?;
                symlink(&dir, gdir.join("devices").join(d.addr))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{build, Dev};
    use super::*;

    fn dev<'a>(addr: &'a str, class: u32, driver: Option<&'a str>, group: u32) -> Dev<'a> {
        Dev {
            addr,
            class,
            model: "10de:2330",
            driver,
            group: Some(group),
        }
    }

    #[test]
    fn addresses_are_checked() {
        assert!(valid_addr("0000:01:00.0"));
        assert!(valid_addr("0000:af:1f.7"));
        for bad in [
            "0000:01:00.8",
            "0000:01:00",
            "0000:AF:00.0",
            "00:01:00.0",
            "0000:01:00.0,x=1",
            "0000-01:00.0",
            "",
        ] {
            assert!(!valid_addr(bad), "{bad}");
        }
    }

    // The tree stands in for hardware: these machines have no GPU and no IOMMU.
    #[test]
    fn discovery_reads_groups_and_viability() {
        let t = tempfile::tempdir().expect("tempdir");
        build(
            t.path(),
            &[
                // Group 12: a GPU and its audio function, both on vfio-pci, behind a bridge.
                dev("0000:01:00.0", 0x030000, Some("vfio-pci"), 12),
                dev("0000:01:00.1", 0x040300, Some("vfio-pci"), 12),
                dev("0000:00:01.0", 0x060400, Some("pcieport"), 12),
                // Group 13: a 3D controller whose group also holds a NIC still on its driver.
                dev("0000:02:00.0", 0x030200, Some("vfio-pci"), 13),
                dev("0000:02:00.1", 0x020000, Some("ixgbe"), 13),
                // Group 14: a GPU with its own driver (not for passthrough): not listed.
                dev("0000:03:00.0", 0x030000, Some("nvidia"), 14),
                // A device on vfio-pci with no group (IOMMU off).
                Dev {
                    addr: "0000:04:00.0",
                    class: 0x030000,
                    model: "1002:73bf",
                    driver: Some("vfio-pci"),
                    group: None,
                },
            ],
        )
        .expect("tree");
        let d = discover(t.path());
        assert_eq!(d.ungrouped, ["0000:04:00.0"]);
        let ids: Vec<u32> = d.groups.iter().map(|g| g.id).collect();
        assert_eq!(ids, [12, 13]);
        let g12 = &d.groups[0];
        assert_eq!(g12.problem, None);
        let passed: Vec<&str> = g12.passed().map(|d| d.addr.as_str()).collect();
        assert_eq!(passed, ["0000:01:00.0", "0000:01:00.1"], "the bridge stays");
        assert_eq!(g12.gpus().count(), 1);
        assert_eq!(g12.devices[1].model, "10de:2330");
        let p = d.groups[1].problem.as_deref().expect("not viable");
        assert!(p.contains("0000:02:00.1 is bound to ixgbe"), "{p}");
        let usable: Vec<u32> = d.usable().map(|g| g.id).collect();
        assert_eq!(usable, [12]);
        assert_eq!(
            g12.dev_node(Path::new("/dev/vfio")),
            Path::new("/dev/vfio/12")
        );
        // No tree at all (no vfio-pci module): nothing.
        assert_eq!(discover(&t.path().join("none")), Discovery::default());
    }

    #[test]
    fn args_pass_each_device_and_lock_memory() {
        let a = args(&["0000:01:00.0".into(), "0000:01:00.1".into()]).expect("args");
        assert_eq!(
            a,
            [
                "-overcommit",
                "mem-lock=on",
                "-device",
                "vfio-pci,host=0000:01:00.0,id=hostdev0,addr=0x10",
                "-device",
                "vfio-pci,host=0000:01:00.1,id=hostdev1,addr=0x11",
            ]
        );
        assert!(args(&[]).expect("none").is_empty());
        assert!(args(&["0000:01:00.0,romfile=/etc/shadow".into()]).is_err());
        let many: Vec<String> = (0..17).map(|i| format!("0000:01:{i:02x}.0")).collect();
        assert!(args(&many).is_err());
        assert_eq!(memlock_bytes(1024), 2048 << 20);
    }
}
