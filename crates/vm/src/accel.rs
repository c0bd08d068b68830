//! Which accelerator this host can really use.
//!
//! `/dev/kvm` existing is not enough: on hosts without VT-x/AMD-V it may be driven by `kvm_pvm`
//! (software virtualization), which cannot boot a stock kernel. KVM is chosen only when
//! `kvm_intel` or `kvm_amd` is loaded and `/dev/kvm` opens.

use std::path::Path;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// The CPU model a snapshot is pinned to: a named baseline so snapshots move between hosts.
    pub fn cpu_model(self) -> &'static str {
        match self {
            Accel::Kvm => "Nehalem",
            Accel::Tcg => "qemu64",
        }
    }
}

impl std::str::FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            other => Err(format!(
                "unknown accelerator {other:?} (expected \"kvm\", \"tcg\" or \"auto\")"
            )),
        }
    }
}

/// The accelerator picked and why.
#[derive(Debug, Clone, Serialize)]
pub struct AccelChoice {
    pub accel: Accel,
    pub reason: String,
}

/// Probes the host. `force` (from config) overrides the probe, but forcing KVM on a host that
/// cannot run it is an error.
pub fn probe(force: Option<Accel>) -> Result<AccelChoice, String> {
    probe_at(Path::new("/sys/module"), Path::new("/dev/kvm"), force)
}

fn probe_at(modules: &Path, dev: &Path, force: Option<Accel>) -> Result<AccelChoice, String> {
    let loaded = |m: &str| modules.join(m).exists();
    let hw = if loaded("kvm_intel") {
        Some("kvm_intel")
    } else if loaded("kvm_amd") {
        Some("kvm_amd")
    } else {
        None
    };
    let dev_ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev)
        .is_ok();
    let kvm_usable = hw.is_some() && dev_ok;
    let why_not = if hw.is_none() && loaded("kvm_pvm") {
        "/dev/kvm is driven by kvm_pvm (no hardware virtualization), which cannot boot a stock kernel".to_string()
    } else if hw.is_none() {
        "neither kvm_intel nor kvm_amd is loaded".to_string()
    } else if !dev_ok {
        format!("{} cannot be opened read-write", dev.display())
    } else {
        String::new()
    };
    match force {
        Some(Accel::Kvm) if !kvm_usable => Err(format!(
            "KVM was forced by config but is not usable here: {why_not}"
        )),
        Some(a) => Ok(AccelChoice {
            accel: a,
            reason: format!("forced to {} by config", a.as_str()),
        }),
        None if kvm_usable => Ok(AccelChoice {
            accel: Accel::Kvm,
            reason: format!("{} drives /dev/kvm", hw.unwrap_or("kvm")),
        }),
        None => Ok(AccelChoice {
            accel: Accel::Tcg,
            reason: format!("using TCG: {why_not}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pvm_means_tcg() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(d.path().join("kvm_pvm")).expect("mkdir");
        let c = probe_at(d.path(), &d.path().join("nokvm"), None).expect("probe");
        assert_eq!(c.accel, Accel::Tcg);
        assert!(c.reason.contains("kvm_pvm"), "{}", c.reason);
        assert!(probe_at(d.path(), &d.path().join("nokvm"), Some(Accel::Kvm)).is_err());
        let f = probe_at(d.path(), &d.path().join("nokvm"), Some(Accel::Tcg)).expect("forced");
        assert_eq!(f.accel, Accel::Tcg);
    }

    #[test]
    fn intel_with_device_means_kvm() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(d.path().join("kvm_intel")).expect("mkdir");
        let dev = d.path().join("kvm");
        std::fs::write(&dev, b"").expect("dev");
        let c = probe_at(d.path(), &dev, None).expect("probe");
        assert_eq!(c.accel, Accel::Kvm);
    }

    #[test]
    fn parse_rejects_unknown() {
        assert!("xen".parse::<Accel>().is_err());
        assert_eq!("tcg".parse::<Accel>(), Ok(Accel::Tcg));
    }
}
