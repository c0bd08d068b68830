//! GPUs: how many a sandbox asks for, and what a node has free.
//!
//! Seed 003: "GPUs come from `metadata["vmon.gpus"]`, else the template's `VMON_GPUS`
//! environment variable, else none." The value is a count of whole GPUs, a decimal integer
//! from 0 to [`MAX_GPUS`]; anything else is refused (the api answers 400). A node passes its
//! GPUs through whole (VFIO, one IOMMU group at a time) and advertises them as a
//! [`GpuInventory`] in the cluster registry.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The metadata key a create names its GPU count with.
pub const METADATA_KEY: &str = "vmon.gpus";
/// The template environment variable that gives the count when the metadata does not.
pub const TEMPLATE_ENV: &str = "VMON_GPUS";
/// The most GPUs one sandbox can ask for (a PCI bus has 32 slots; QEMU's `pc` machine gives
/// a few to its own devices).
pub const MAX_GPUS: u32 = 16;

/// The GPUs a node has and has free, as it advertises them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuInventory {
    /// GPUs bound to `vfio-pci` whose IOMMU groups can be passed through.
    pub total: u32,
    /// Of those, the ones no sandbox holds.
    pub free: u32,
    /// `vendor:device` PCI ids of the free GPUs (`10de:2330`), with how many of each.
    #[serde(default)]
    pub models: BTreeMap<String, u32>,
}

/// Reads a count (`vmon.gpus` or `VMON_GPUS`); `what` names the source in the error.
pub fn parse_count(value: &str, what: &str) -> Result<u32, String> {
    let v = value.trim();
    let bad = || {
        format!(
            "{what} must be a whole number of GPUs from 0 to {MAX_GPUS}, not {:?}",
            truncate(value)
        )
    };
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    match v.parse::<u32>() {
        Ok(n) if n <= MAX_GPUS => Ok(n),
        _ => Err(bad()),
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(32).collect()
}

/// The GPUs a sandbox asks for: `metadata["vmon.gpus"]`, else the template's `VMON_GPUS`
/// (`template_env`), else 0. A bad value where it is read is an error naming it.
pub fn requested(
    metadata: &BTreeMap<String, String>,
    template_gpus: Option<&str>,
) -> Result<u32, String> {
    if let Some(v) = metadata.get(METADATA_KEY) {
        return parse_count(v, &format!("metadata[\"{METADATA_KEY}\"]"));
    }
    match template_gpus {
        Some(v) => parse_count(v, &format!("the template's {TEMPLATE_ENV}")),
        None => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(v: &str) -> BTreeMap<String, String> {
        [(METADATA_KEY.to_string(), v.to_string())].into()
    }

    #[test]
    fn metadata_then_template_then_none() {
        assert_eq!(requested(&md("2"), Some("1")), Ok(2));
        assert_eq!(requested(&md("0"), Some("1")), Ok(0), "metadata 0 wins");
        assert_eq!(requested(&BTreeMap::new(), Some(" 1 ")), Ok(1));
        assert_eq!(requested(&BTreeMap::new(), None), Ok(0));
        assert_eq!(requested(&md("16"), None), Ok(16));
    }

    #[test]
    fn bad_counts_name_their_source() {
        for bad in [
            "",
            "-1",
            "1.5",
            "two",
            "17",
            "+1",
            "99999999999999999999",
            "1 2",
        ] {
            let e = requested(&md(bad), None).expect_err(bad);
            assert!(e.contains("metadata[\"vmon.gpus\"]"), "{e}");
            assert!(e.contains("0 to 16"), "{e}");
        }
        let e = requested(&BTreeMap::new(), Some("x")).expect_err("template");
        assert!(e.contains("VMON_GPUS"), "{e}");
        // A bad template value does not matter when the metadata names the count.
        assert_eq!(requested(&md("1"), Some("x")), Ok(1));
    }

    #[test]
    fn inventory_reads_without_models() {
        let i: GpuInventory = serde_json::from_str(r#"{"total":2,"free":1}"#).expect("json");
        assert_eq!((i.total, i.free, i.models.len()), (2, 1, 0));
    }
}
