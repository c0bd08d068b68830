//! The layer cache of template builds: each prefix of a build's steps is keyed (on the base,
//! the machine and the steps so far) and the build it left is kept as a layer for the team,
//! so a later build restores the longest prefix it shares and runs only the rest.

use std::time::Duration;

use sha2::{Digest, Sha256};
use time::OffsetDateTime;
use vmon_proto::node::BuildInfo;

use crate::records::{Team, TemplateBuild};
use crate::templates::steps::{self, Action, BuildStart, StepState};
use crate::{record_error, Control};

/// How long an unused layer stays in the cache.
const LAYER_KEEP: Duration = Duration::from_secs(7 * 24 * 3600);

/// The cache keys of one build.
pub(super) struct Keys {
    /// The first layer: the base build on the machine the template asks for.
    pub(super) machine: String,
    /// Step `i`'s: the prefix up to and with it.
    pub(super) steps: Vec<String>,
    /// The finished template's: all steps, and the start and ready commands.
    pub(super) finished: String,
}

impl Keys {
    pub(super) fn of(
        base: &BuildInfo,
        build: &TemplateBuild,
        start: &BuildStart,
        plan: &[(Action, StepState)],
    ) -> Keys {
        let machine = base_key(base, build.vcpus, build.memory_mb);
        let mut key = machine.clone();
        let mut keys = Vec::with_capacity(plan.len());
        let mut before = StepState::default();
        for (step, (_, after)) in start.steps.iter().zip(plan) {
            key = steps::next_key(&key, step, &before);
            keys.push(key.clone());
            before = after.clone();
        }
        let last_state = plan.last().map(|(_, s)| s.clone()).unwrap_or_default();
        let finished = steps::final_key(&key, start, &last_state);
        Keys {
            machine,
            steps: keys,
            finished,
        }
    }
}

/// The first layer's key: the base build and the machine the template asks for.
fn base_key(base: &BuildInfo, vcpus: u32, memory_mb: u32) -> String {
    let mut h = Sha256::new();
    h.update(format!("base\0{}\0{vcpus}\0{memory_mb}", base.build_id));
    hex::encode(h.finalize())
}

impl Control {
    /// The finished template, when nothing forces a rebuild and it is cached whole.
    pub(super) async fn cached_template(
        &self,
        team: &Team,
        start: &BuildStart,
        keys: &Keys,
    ) -> Option<BuildInfo> {
        if start.force || start.steps.iter().any(|s| s.force) {
            return None;
        }
        self.cached(team, &keys.finished).await
    }

    /// The longest cached prefix of the steps before the first forced one: how many steps it
    /// holds and the build they left.
    pub(super) async fn cached_prefix(
        &self,
        team: &Team,
        start: &BuildStart,
        keys: &Keys,
    ) -> Option<(usize, BuildInfo)> {
        let n = keys.steps.len();
        let no_cache_from = if start.force {
            0
        } else {
            start.steps.iter().position(|s| s.force).unwrap_or(n)
        };
        for i in (0..no_cache_from.min(n)).rev() {
            if let Some(b) = self.cached(team, &keys.steps[i]).await {
                return Some((i + 1, b));
            }
        }
        None
    }

    /// A cached layer that the node still has.
    pub(super) async fn cached(&self, team: &Team, key: &str) -> Option<BuildInfo> {
        let b = self.records.layer(&team.id, key).await.ok()??;
        match self.node.build_info(&b.build_id).await {
            Ok(info) if !info.older_image => Some(b),
            _ => {
                let _ = self.records.delete_layer(&team.id, key).await;
                None
            }
        }
    }

    pub(super) async fn remember(&self, team: &Team, key: &str, b: &BuildInfo) {
        if let Err(e) = self.records.put_layer(&team.id, key, b).await {
            tracing::warn!(error = %record_error(e), "caching a layer failed");
        }
    }

    /// The layer cache's collector (the leader's hourly job): a layer unused for
    /// [`LAYER_KEEP`] leaves the cache and its build goes when nothing stands on it (a template
    /// tag, a sandbox, a later layer: the node refuses those deletions and the build stays).
    pub(crate) async fn collect_layers(&self) {
        let before = OffsetDateTime::now_utc() - LAYER_KEEP;
        let stale = match self.records.stale_layers(before).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "listing stale template layers failed");
                return;
            }
        };
        for (team, key, build) in stale {
            if self.records.delete_layer(&team, &key).await.is_err() {
                continue;
            }
            // A template's tag may still name it (the finished template is a layer too).
            if let Ok(false) = self.records.is_template_build(&build.build_id).await {
                self.drop_build(&build.build_id).await;
            }
        }
    }
}
