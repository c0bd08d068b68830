//! GPU sandboxes (seed 003): how many GPUs a create asks for, and what a sandbox with GPUs
//! may keep when it pauses or is snapshotted.
//!
//! The count is `metadata["vmon.gpus"]`, else the template's `VMON_GPUS` (the last `ENV`
//! step of the template build that made the build the create starts from), else none
//! ([`vmon_proto::gpu::requested`]); a bad value is a 400. It is resolved once, at create,
//! and kept in the record: resumes and fork children ask for the same. The node passes the
//! GPUs through (VFIO), always cold-boots such a sandbox and captures only its disk; the api
//! asks for the disk alone too, and says why in the pause's event.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use vmon_proto::gpu;
use vmon_proto::node::BuildInfo;

use super::{record_error, Control};
use crate::error::{ControlError, ControlResult};
use crate::records::{SandboxRecord, TemplateKind, TemplateRecord};

/// Why a memory pause or snapshot of a sandbox with GPUs keeps only its filesystem.
pub(crate) const MEMORY_SKIPPED: &str =
    "the sandbox has GPUs passed through: its pauses and snapshots keep only the filesystem";

/// Builds are immutable: what a build's template said of `VMON_GPUS`, by node build id.
fn template_cache() -> &'static Mutex<HashMap<String, Option<String>>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Option<String>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// `VMON_GPUS` as the template build's steps left it: the last `ENV` step naming it.
pub(crate) fn env_of_steps(start: &serde_json::Value) -> Option<String> {
    let steps = start.get("steps")?.as_array()?;
    let mut found = None;
    for step in steps {
        if step.get("type").and_then(|t| t.as_str()) != Some("ENV") {
            continue;
        }
        let Some(args) = step.get("args").and_then(|a| a.as_array()) else {
            continue;
        };
        for pair in args.chunks(2) {
            if let [k, v] = pair {
                if k.as_str() == Some(gpu::TEMPLATE_ENV) {
                    found = v.as_str().map(str::to_string);
                }
            }
        }
    }
    found
}

/// What a memory capture of `rec` can keep: `memory` unless the sandbox mounts volumes or has
/// GPUs; and, when GPUs took it away, why (for the event).
pub(crate) fn memory_capture(rec: &SandboxRecord, memory: bool) -> (bool, Option<&'static str>) {
    if rec.gpus > 0 {
        return (false, memory.then_some(MEMORY_SKIPPED));
    }
    // A mount's state is outside the guest's memory: the disk only.
    (
        memory && rec.volume_mounts.is_empty() && rec.s3_mounts.is_empty(),
        None,
    )
}

impl Control {
    /// The template's `VMON_GPUS` for `build` (none for snapshots and built-in templates).
    async fn template_gpus(
        &self,
        template: &TemplateRecord,
        build: &BuildInfo,
    ) -> ControlResult<Option<String>> {
        if matches!(template.kind, TemplateKind::Snapshot { .. }) {
            return Ok(None);
        }
        if let Some(v) = template_cache()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&build.build_id)
        {
            return Ok(v.clone());
        }
        let builds = self
            .records
            .template_builds_of(&template.id)
            .await
            .map_err(record_error)?;
        let found = builds
            .iter()
            .find(|b| {
                b.result
                    .as_ref()
                    .is_some_and(|r| r.build_id == build.build_id)
            })
            .and_then(|b| b.start.as_ref())
            .and_then(env_of_steps);
        let mut cache = template_cache().lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() > 4096 {
            cache.clear();
        }
        cache.insert(build.build_id.clone(), found.clone());
        Ok(found)
    }

    /// How many GPUs a create asks for; a bad count is a 400 naming where it came from.
    pub(crate) async fn requested_gpus(
        &self,
        metadata: &crate::model::StringMap,
        template: &TemplateRecord,
        build: &BuildInfo,
    ) -> ControlResult<u32> {
        let from_template = if metadata.contains_key(gpu::METADATA_KEY) {
            None
        } else {
            self.template_gpus(template, build).await?
        };
        gpu::requested(metadata, from_template.as_deref()).map_err(ControlError::bad_request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_env_step_names_the_count() {
        let start = serde_json::json!({
            "steps": [
                {"type": "ENV", "args": ["VMON_GPUS", "1", "A", "b"]},
                {"type": "RUN", "args": ["VMON_GPUS", "9"]},
                {"type": "ENV", "args": ["VMON_GPUS", "2"]},
            ]
        });
        assert_eq!(env_of_steps(&start).as_deref(), Some("2"));
        let none = serde_json::json!({"steps": [{"type": "ENV", "args": ["A", "1"]}]});
        assert_eq!(env_of_steps(&none), None);
        assert_eq!(env_of_steps(&serde_json::json!({})), None);
    }
}
