//! Which QEMU a node runs, and whether vmon supports it.
//!
//! The version comes from the binary itself (`qemu-system-x86_64 --version`, whose first line
//! is `QEMU emulator version X.Y.Z (...)`). Supported are the release lines vmon's suites run
//! on: 7.2 (Debian 12's `qemu-system-x86`) and 10.0 (bookworm-backports, Debian 13's; put
//! beside the system's by `scripts/install-qemu.sh 10.0`). Other versions are refused when a
//! node opens, because what vmon relies on (`xen-save-devices-state` without Xen, the
//! device-state stream a restore loads, `x-ignore-shared`, the pc machine's defaults) is
//! QEMU-internal and changes between releases unannounced; `VMON_QEMU_UNSUPPORTED=1` runs one
//! anyway, for trying a new release.

use std::fmt;
use std::path::Path;

/// The release lines (major, minor) vmon's test suites run on.
pub const SUPPORTED: &[(u32, u32)] = &[(7, 2), (10, 0)];

/// Set to `1` to run a QEMU outside [`SUPPORTED`] (a warning instead of a refusal).
pub const UNSUPPORTED_OK_ENV: &str = "VMON_QEMU_UNSUPPORTED";

/// A QEMU binary's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuVersion {
    pub major: u32,
    pub minor: u32,
    pub micro: u32,
    /// The first line of `--version`, as builds record it.
    pub line: String,
}

impl fmt::Display for QemuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.micro)
    }
}

impl QemuVersion {
    /// Parses the first line of `--version`: `QEMU emulator version 10.0.2 (Debian ...)`.
    pub fn parse(line: &str) -> Option<QemuVersion> {
        let line = line.trim();
        let rest = line.strip_prefix("QEMU emulator version ")?;
        let number = rest.split_whitespace().next()?;
        let mut parts = number.split('.');
        let mut next = || -> Option<u32> {
            match parts.next() {
                // "9.2.0-rc1" style suffixes end the number.
                Some(p) => p
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .filter(|d| !d.is_empty())?
                    .parse()
                    .ok(),
                None => Some(0),
            }
        };
        let major = next()?;
        let minor = next()?;
        let micro = next()?;
        Some(QemuVersion {
            major,
            minor,
            micro,
            line: line.to_string(),
        })
    }

    /// Runs `binary --version` and parses its answer.
    pub fn detect(binary: &Path) -> anyhow::Result<QemuVersion> {
        let line = crate::machine::qemu_version(binary)?;
        QemuVersion::parse(&line).ok_or_else(|| {
            anyhow::anyhow!(
                "{} answered --version with {line:?}, not \"QEMU emulator version X.Y.Z\"",
                binary.display()
            )
        })
    }

    /// Whether this release line is one vmon supports.
    pub fn is_supported(&self) -> bool {
        SUPPORTED.contains(&(self.major, self.minor))
    }

    /// The supported lines, for messages: "7.2, 10.0".
    pub fn supported_list() -> String {
        SUPPORTED
            .iter()
            .map(|(a, b)| format!("{a}.{b}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Why `binary` (of this version) may not run sandboxes; None when it may.
    pub fn refusal(&self, binary: &Path) -> Option<String> {
        if self.is_supported() {
            return None;
        }
        Some(format!(
            "{} is QEMU {self}, which vmon does not support (supported: {}). Debian 12's \
             qemu-system-x86 is 7.2; `scripts/install-qemu.sh 10.0` puts 10.0 beside it and \
             prints the binary for VMON_QEMU. {UNSUPPORTED_OK_ENV}=1 runs this one anyway \
             (untested).",
            binary.display(),
            Self::supported_list()
        ))
    }
}

/// Detects `binary`'s version and refuses an unsupported one unless
/// [`UNSUPPORTED_OK_ENV`] is `1` (then it warns).
pub fn require_supported(binary: &Path) -> anyhow::Result<QemuVersion> {
    let v = QemuVersion::detect(binary)?;
    if let Some(why) = v.refusal(binary) {
        if std::env::var(UNSUPPORTED_OK_ENV).as_deref() == Ok("1") {
            tracing::warn!("{why}");
        } else {
            anyhow::bail!("{why}");
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_version_lines_of_debian_and_upstream_builds() {
        let v =
            QemuVersion::parse("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)")
                .expect("7.2");
        assert_eq!((v.major, v.minor, v.micro), (7, 2, 22));
        assert!(v.is_supported());
        let v = QemuVersion::parse(
            "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)\n",
        )
        .expect("10.0");
        assert_eq!(v.to_string(), "10.0.2");
        assert!(v.is_supported());
        let v = QemuVersion::parse("QEMU emulator version 9.2.90").expect("9.2");
        assert!(!v.is_supported());
        let v = QemuVersion::parse("QEMU emulator version 8.1").expect("no micro");
        assert_eq!((v.major, v.minor, v.micro), (8, 1, 0));
        let v = QemuVersion::parse("QEMU emulator version 10.1.0-rc2").expect("rc");
        assert_eq!((v.major, v.minor, v.micro), (10, 1, 0));
    }

    #[test]
    fn refuses_what_is_not_a_qemu_version_line_or_not_supported() {
        for bad in [
            "",
            "qemu-img version 7.2.22",
            "QEMU emulator version",
            "QEMU emulator version x.y",
            "QEMU emulator version .2.1",
        ] {
            assert_eq!(QemuVersion::parse(bad), None, "{bad:?}");
        }
        let v = QemuVersion::parse("QEMU emulator version 6.2.0").expect("6.2");
        let why = v.refusal(Path::new("/q")).expect("6.2 is refused");
        assert!(why.contains("QEMU 6.2.0"), "{why}");
        assert!(why.contains("7.2, 10.0"), "{why}");
    }
}
