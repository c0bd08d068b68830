//! Parking: a paused sandbox may keep its stopped QEMU for a while, so its resume is `cont` and
//! `/init` instead of a restore. A parked process is a cache: its pause was committed like any
//! other, and it is let go on age, count or memory pressure.

use std::net::{IpAddr, SocketAddr};

use anyhow::Context;
use vmon_proto::node::StartSpec;

use super::{meminfo_kib, restore_init, Node};
use crate::builds::BuildRecord;
use crate::envd_client::{self, ENVD_PORT};
use crate::sandbox::Live;

/// A paused sandbox whose QEMU is kept stopped: resuming it is `cont` and `/init`.
pub(super) struct Parked {
    pub(super) live: Live,
    pub(super) since: std::time::Instant,
}

/// Below this share of host memory available, parked processes are let go.
const PARK_MIN_AVAILABLE_PERCENT: u64 = 15;

impl Node {
    /// How many paused sandboxes may keep their stopped QEMU.
    pub fn park_max(&self) -> usize {
        self.cfg.park_max
    }

    /// Lets parked processes go: all of them, or those past their linger time, over the count,
    /// or while the host runs short of memory. Their pauses were committed; nothing is lost.
    pub async fn evict_parked(&self, all: bool) {
        let max = self.cfg.park_max;
        let short = !all && memory_is_short();
        let out: Vec<Parked> = {
            let Ok(mut m) = self.parked.lock() else {
                return;
            };
            let mut by_age: Vec<(String, std::time::Instant)> =
                m.iter().map(|(k, p)| (k.clone(), p.since)).collect();
            by_age.sort_by_key(|(_, t)| *t);
            let over = by_age.len().saturating_sub(max);
            let mut out = Vec::new();
            for (i, (k, t)) in by_age.into_iter().enumerate() {
                let expired = t.elapsed() >= self.cfg.park_linger;
                if all || short || i < over || expired {
                    if let Some(p) = m.remove(&k) {
                        out.push(p);
                    }
                }
            }
            out
        };
        for mut p in out {
            tracing::debug!(sandbox = %p.live.state.id, "parked QEMU let go");
            self.destroy(&mut p.live, false).await;
        }
    }

    /// Takes the parked process of `sandbox_id` paused into `build_id`, if it is still kept.
    pub(super) fn unpark(&self, build_id: &str, sandbox_id: &str) -> Option<Live> {
        let mut m = self.parked.lock().ok()?;
        if m.get(build_id)?.live.state.id != sandbox_id {
            return None;
        }
        m.remove(build_id).map(|p| p.live)
    }

    /// Whether the QEMU of the sandbox paused into `build_id` is kept.
    pub fn is_parked(&self, build_id: &str) -> bool {
        self.parked
            .lock()
            .map(|m| m.contains_key(build_id))
            .unwrap_or(false)
    }

    /// Lets the kept QEMU of a paused build go (its next resume restores from the build).
    /// Returns whether one was kept.
    pub async fn let_go_parked(&self, build_id: &str) -> bool {
        let kept = self.is_parked(build_id);
        self.discard_parked(build_id).await;
        kept
    }

    pub(super) async fn discard_parked(&self, build_id: &str) {
        let p = self.parked.lock().ok().and_then(|mut m| m.remove(build_id));
        if let Some(mut p) = p {
            self.destroy(&mut p.live, false).await;
        }
    }

    /// Resumes a parked sandbox: `cont`, then `/init` with the new run's token and settings.
    pub(super) async fn resume_parked(
        &self,
        spec: &StartSpec,
        rec: &BuildRecord,
        mut live: Live,
    ) -> anyhow::Result<Live> {
        let run_dir = self.sandbox_root(&spec.sandbox_id).join(&spec.execution_id);
        let r = async {
            if live.dir != run_dir {
                if run_dir.exists() {
                    std::fs::remove_dir_all(&run_dir)?;
                }
                std::fs::rename(&live.dir, &run_dir)?;
                live.dir = run_dir.clone();
            }
            if live.state.network.as_ref() != Some(&spec.network) {
                live.slot
                    .set_policy(&spec.network, self.slots.perimeter())
                    .await?;
                live.state.network = Some(spec.network.clone());
            }
            let vm = live.vm.as_ref().context("parked sandbox has no VM")?;
            vm.qmp.cont().await?;
            let addr = SocketAddr::new(IpAddr::V4(live.slot.addr()), ENVD_PORT);
            envd_client::init(addr, &restore_init(spec, rec), self.cfg.restore_timeout).await?;
            live.state.execution_id = spec.execution_id.clone();
            live.state.envd_token = spec.envd_access_token.clone();
            live.state.resume_generation = rec.resume_generation + 1;
            live.state.pausing_build = None;
            live.state.start_kind = Some(vmon_proto::node::StartKind::Parked);
            live.state.save(&live.dir)?;
            anyhow::Ok(())
        }
        .await;
        match r {
            Ok(()) => Ok(live),
            Err(e) => {
                self.destroy(&mut live, false).await;
                Err(e)
            }
        }
    }
}

/// True when less than [`PARK_MIN_AVAILABLE_PERCENT`] of host memory is available.
fn memory_is_short() -> bool {
    match meminfo_kib(["MemTotal", "MemAvailable"]) {
        [Some(total), Some(avail)] if total > 0 => avail * 100 < total * PARK_MIN_AVAILABLE_PERCENT,
        _ => false,
    }
}
