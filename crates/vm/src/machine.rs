//! The machine description a build is pinned to, and the QEMU command line made from it.
//!
//! A device-state stream only loads into an identical machine, so everything that shapes the
//! machine (type, CPU model, devices and their PCI addresses, RAM size, the QEMU binary and its
//! version) lives in [`MachineDesc`] and is stored with every build. Paths that differ per
//! sandbox (overlay, RAM file, sockets) are not part of it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::accel::Accel;

/// PCI slots the devices are pinned to (a snapshot's device state names them).
const NET_ADDR: &str = "0x3";
const BLK_ADDR: &str = "0x4";
/// The qdev id of the sandbox's disk device.
pub const DISK_DEVICE: &str = "vblk0";

/// QEMU's seccomp filter as every guest runs with it.
pub const SECCOMP: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// TCG translation-block cache size (MiB) unless `VMON_TCG_TB_MIB` says otherwise.
const TCG_TB_MIB: u32 = 32;

/// The TCG translation cache a QEMU gets (MiB): `VMON_TCG_TB_MIB` (4 to 512), else
/// [`TCG_TB_MIB`]. QEMU never gives back what the cache once touched (a flush starts filling it
/// again from the front), so a long-lived sandbox keeps up to this much resident.
/// Read once per process, like the node's other knobs.
pub fn tcg_tb_mib() -> u32 {
    static MIB: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *MIB.get_or_init(|| {
        std::env::var("VMON_TCG_TB_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<u32>().ok())
            .map_or(TCG_TB_MIB, |v| v.clamp(4, 512))
    })
}

/// The guest's fixed MAC: every slot gives its guest the same address, so snapshots move freely.
pub const GUEST_MAC: &str = "52:54:00:a9:00:15";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineDesc {
    pub qemu_binary: PathBuf,
    pub qemu_version: String,
    pub accel: Accel,
    pub cpu_model: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub cmdline: String,
    /// The machine without the devices a guest here never uses (HPET, vmport, SMBus, the PS/2
    /// controller). Builds recorded before the trim have `false` and keep their machine: a
    /// device state loads only into the machine it was saved from.
    #[serde(default)]
    pub trimmed: bool,
}

/// `-machine` for a build: the `pc` machine, trimmed for builds made since the trim.
fn machine_arg(trimmed: bool) -> &'static str {
    if trimmed {
        "pc,memory-backend=ram0,hpet=off,vmport=off,smbus=off,i8042=off"
    } else {
        "pc,memory-backend=ram0"
    }
}

/// A virtio-fs share: a `vhost-user-fs-pci` device whose daemon (virtiofsd) listens on
/// `socket`; the guest mounts it by `tag`. Only cold boots carry them: vhost-user devices
/// cannot be migrated, so such a guest's memory is never saved.
#[derive(Debug, Clone)]
pub struct FsShare {
    pub socket: PathBuf,
    pub tag: String,
}

/// The first PCI slot of virtio-fs devices (`FS_ADDR + i` for share `i`).
const FS_ADDR: u32 = 0x5;

/// A network device backed by a tap inside the VM's namespace (opened by name before exec and
/// handed to QEMU as a descriptor).
#[derive(Debug, Clone)]
pub struct NetDevice {
    pub tap: String,
}

/// The kernel command line every guest boots with. `no_timer_check`: under TCG on a loaded host
/// the kernel's IO-APIC timer check can miss its window and panic the boot.
pub fn kernel_cmdline(extra: &str) -> String {
    let base =
        "console=ttyS0 root=/dev/vda rw panic=-1 quiet nokaslr net.ifnames=0 no_timer_check \
                init=/usr/local/bin/envd vmon.ip=169.254.0.21/30 vmon.gw=169.254.0.22";
    if extra.is_empty() {
        base.to_string()
    } else {
        format!("{base} {extra}")
    }
}

/// How the guest RAM file is mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RamSharing {
    /// `share=on`: guest writes land in the file (template boots, cold boots).
    Shared,
    /// `share=off`: the file is a copy-on-write base (restores).
    Private,
}

/// Everything per-process that completes a [`MachineDesc`] into a command line.
#[derive(Debug, Clone)]
pub struct Placement<'a> {
    /// A unique word put in the process's command line (`-name vmon-<tag>`), by which a
    /// restarted node recognises its QEMU.
    pub tag: &'a str,
    pub ram_file: &'a Path,
    pub ram: RamSharing,
    /// None: no disk yet (a pre-spawned restore process; see [`disk_attach`]).
    pub disk: Option<&'a Path>,
    pub net: Option<&'a NetDevice>,
    pub console_log: &'a Path,
    pub qmp_socket: &'a Path,
    pub pidfile: &'a Path,
    /// Start paused, waiting for `migrate-incoming`.
    pub incoming: bool,
    pub fs_shares: &'a [FsShare],
}

impl MachineDesc {
    pub fn args(&self, p: &Placement<'_>) -> Vec<String> {
        let mut a = self.base_args(p);
        if let Some(disk) = p.disk {
            a.extend(disk_args(disk));
        }
        if !p.incoming {
            // A restored guest booted long ago: QEMU need not read (and keep a heap copy of)
            // the kernel and initrd for it. Only fw_cfg blobs differ, which no device state
            // carries.
            a.extend([
                "-kernel".into(),
                self.kernel.display().to_string(),
                "-initrd".into(),
                self.initrd.display().to_string(),
                "-append".into(),
                self.cmdline.clone(),
            ]);
        }
        if p.net.is_some() {
            // The tap is opened for QEMU before exec ([`crate::process`]): by descriptor.
            a.push("-netdev".into());
            a.push(format!("tap,id=n0,fd={}", crate::process::TAP_FD));
            a.push("-device".into());
            a.push(format!(
                "virtio-net-pci,netdev=n0,id=net0,mac={GUEST_MAC},romfile=,addr={NET_ADDR}"
            ));
        }
        a.extend(fs_share_args(p.fs_shares));
        if p.incoming {
            a.extend(["-incoming", "defer", "-S"].map(String::from));
        }
        // On boots too, so a later device-state save omits the configuration section that
        // restores do not expect.
        a.extend(["-global", "migration.send-configuration=off"].map(String::from));
        a
    }

    /// The machine itself: its name, accelerator, CPUs and RAM file, no default devices,
    /// QEMU's seccomp filter, the console, QMP and the pidfile.
    fn base_args(&self, p: &Placement<'_>) -> Vec<String> {
        let share = match p.ram {
            RamSharing::Shared => "on",
            RamSharing::Private => "off",
        };
        vec![
            "-name".into(),
            format!("vmon-{}", p.tag),
            "-machine".into(),
            machine_arg(self.trimmed).into(),
            "-accel".into(),
            match self.accel {
                // A small translation cache: a sandbox's hot code fits, and every idle sandbox
                // would otherwise keep a large one resident.
                Accel::Tcg => format!("tcg,tb-size={}", tcg_tb_mib()),
                Accel::Kvm => "kvm".into(),
            },
            "-cpu".into(),
            self.cpu_model.clone(),
            "-smp".into(),
            self.vcpus.to_string(),
            "-m".into(),
            format!("{}M", self.memory_mb),
            "-object".into(),
            format!(
                "memory-backend-file,id=ram0,size={}M,mem-path={},share={share}",
                self.memory_mb,
                p.ram_file.display()
            ),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            // seccomp: no obsolete calls, no setuid/setgid, no fork/exec, no scheduler or
            // NUMA-policy changes.
            "-sandbox".into(),
            SECCOMP.into(),
            "-chardev".into(),
            // Appended to, so that the node can cut the log's head while QEMU writes
            // (crate::console).
            format!("file,id=con0,path={},append=on", p.console_log.display()),
            "-serial".into(),
            "chardev:con0".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", p.qmp_socket.display()),
            "-pidfile".into(),
            p.pidfile.display().to_string(),
        ]
    }
}

/// The disk: a qcow2 over `disk` at its fixed PCI slot ([`disk_attach`] gives the same later).
fn disk_args(disk: &Path) -> [String; 6] {
    [
        "-blockdev".into(),
        format!(
            "driver=file,filename={},node-name=f0,cache.direct=off",
            disk.display()
        ),
        "-blockdev".into(),
        "driver=qcow2,file=f0,node-name=d0".into(),
        "-device".into(),
        format!("virtio-blk-pci,drive=d0,id={DISK_DEVICE},addr={BLK_ADDR}"),
    ]
}

/// One vhost-user-fs device per share, each at its own PCI slot from [`FS_ADDR`].
fn fs_share_args(shares: &[FsShare]) -> Vec<String> {
    let mut a = Vec::new();
    for (i, share) in shares.iter().enumerate() {
        a.extend([
            "-chardev".into(),
            format!("socket,id=vfs{i},path={}", share.socket.display()),
            "-device".into(),
            format!(
                "vhost-user-fs-pci,chardev=vfs{i},tag={},queue-size=1024,addr={:#x}",
                share.tag,
                FS_ADDR + i as u32
            ),
        ]);
    }
    a
}

/// The QMP commands that give a process started without a disk the one [`MachineDesc::args`]
/// would have given it: the same node names, device id and PCI slot (a device state names the
/// slot).
pub fn disk_attach(disk: &Path) -> Vec<(&'static str, serde_json::Value)> {
    vec![
        (
            "blockdev-add",
            serde_json::json!({
                "driver": "file",
                "filename": disk.display().to_string(),
                "node-name": "f0",
                "cache": {"direct": false},
            }),
        ),
        (
            "blockdev-add",
            serde_json::json!({"driver": "qcow2", "file": "f0", "node-name": "d0"}),
        ),
        (
            "device_add",
            serde_json::json!({
                "driver": "virtio-blk-pci",
                "drive": "d0",
                "id": DISK_DEVICE,
                "addr": BLK_ADDR,
            }),
        ),
    ]
}

/// Version string of a QEMU binary (`qemu-system-x86_64 --version`, first line).
pub fn qemu_version(binary: &Path) -> anyhow::Result<String> {
    let out = std::process::Command::new(binary)
        .arg("--version")
        .output()
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot run {}: {e} (apt-get install qemu-system-x86)",
                binary.display()
            )
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next().unwrap_or("").trim().to_string();
    if first.is_empty() {
        anyhow::bail!("{} printed no version", binary.display());
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_pin_devices_and_ram() {
        let m = MachineDesc {
            qemu_binary: "/usr/bin/qemu-system-x86_64".into(),
            qemu_version: "QEMU emulator version 7.2".into(),
            accel: Accel::Tcg,
            cpu_model: "qemu64".into(),
            vcpus: 2,
            memory_mb: 512,
            kernel: "/k".into(),
            initrd: "/i".into(),
            cmdline: kernel_cmdline(""),
            trimmed: true,
        };
        let net = NetDevice { tap: "tap0".into() };
        let a = m.args(&Placement {
            tag: "t1",
            ram_file: Path::new("/r/mem0"),
            ram: RamSharing::Private,
            disk: Some(Path::new("/d.qcow2")),
            net: Some(&net),
            console_log: Path::new("/c.log"),
            qmp_socket: Path::new("/q.sock"),
            pidfile: Path::new("/p"),
            fs_shares: &[],
            incoming: true,
        });
        let s = a.join(" ");
        assert!(s.contains("share=off"), "{s}");
        assert!(s.contains("-accel tcg,tb-size="), "{s}");
        assert!(s.contains("-incoming defer -S"));
        assert!(
            s.contains("-machine pc,memory-backend=ram0,hpet=off,vmport=off,smbus=off,i8042=off"),
            "{s}"
        );
        let old = MachineDesc {
            trimmed: false,
            ..m.clone()
        };
        let recorded: MachineDesc = serde_json::from_value({
            let mut v = serde_json::to_value(&old).expect("test value");
            v.as_object_mut().expect("test value").remove("trimmed");
            v
        })
        .expect("test value");
        assert_eq!(
            recorded, old,
            "a record made before the trim reads as untrimmed"
        );
        assert!(s.contains(&format!("mac={GUEST_MAC}")));
        assert!(s.contains("-smp 2"));
        assert!(!s.contains("vhost-user-fs"), "no share, no device");
        let shares = [
            FsShare {
                socket: "/run/vmon/vfs/a-0.sock".into(),
                tag: "vol0".into(),
            },
            FsShare {
                socket: "/run/vmon/vfs/a-1.sock".into(),
                tag: "vol1".into(),
            },
        ];
        let s = m
            .args(&Placement {
                tag: "t2",
                ram_file: Path::new("/r/ram"),
                ram: RamSharing::Shared,
                disk: Some(Path::new("/d.qcow2")),
                net: Some(&net),
                console_log: Path::new("/c.log"),
                qmp_socket: Path::new("/q.sock"),
                pidfile: Path::new("/p"),
                fs_shares: &shares,
                incoming: false,
            })
            .join(" ");
        assert!(
            s.contains("share=on"),
            "vhost-user needs shared guest RAM: {s}"
        );
        assert!(
            s.contains("-chardev socket,id=vfs0,path=/run/vmon/vfs/a-0.sock"),
            "{s}"
        );
        assert!(
            s.contains("vhost-user-fs-pci,chardev=vfs0,tag=vol0,queue-size=1024,addr=0x5"),
            "{s}"
        );
        assert!(
            s.contains("vhost-user-fs-pci,chardev=vfs1,tag=vol1,queue-size=1024,addr=0x6"),
            "{s}"
        );
        assert!(s.contains(
            "-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
        ));
    }
}
