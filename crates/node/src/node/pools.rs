//! The node's side of the restore pool: what the pool may ask of the node
//! ([`Filler`](crate::pool::Filler)), and the node's own calls to size, drain and read it.

use std::sync::Arc;

use super::Node;
use crate::pool::{blank_key, Prepared, BLANK_PREFIX};
use vmon_vm::cgroup::Weight;

impl Node {
    /// Pre-spawned processes ready for `build_id`.
    pub fn pool_depth(&self, build_id: &str) -> usize {
        self.pool.depth(build_id)
    }

    /// Fills the restore pool of a build in the background.
    pub fn warm(self: &Arc<Self>, build_id: &str) {
        self.pool.refill(self.clone(), build_id.to_string());
    }

    pub(super) async fn discard_prepared(&self, p: Prepared) {
        let Prepared {
            mut vm,
            slot,
            overlay,
            run_dir,
            ..
        } = p;
        vm.kill().await;
        let _ = self.slots.release(&slot).await;
        let _ = std::fs::remove_file(self.builds.artifact(&overlay));
        let _ = std::fs::remove_dir_all(run_dir);
    }

    /// Stops every pooled process and frees the spare slots (shutdown).
    pub async fn drain_pool(&self) {
        self.evict_parked(true).await;
        self.slots.drain_spares().await;
        for id in self.pool.builds() {
            for p in self.pool.discard(&id).await {
                self.discard_prepared(p).await;
            }
        }
    }

    /// Discards the processes of pools idle for a while above their base size, and the
    /// processes of builds deleted while they were being made.
    pub(super) async fn trim_pool(&self) {
        for p in self.pool.trim() {
            self.discard_prepared(p).await;
        }
        for key in self.pool.builds() {
            if !crate::pool::Filler::wanted(self, &key) {
                for p in self.pool.discard(&key).await {
                    self.discard_prepared(p).await;
                }
            }
        }
    }

    /// Changes the most processes one pool grows to under demand.
    pub fn set_pool_max(&self, n: usize) {
        self.pool.set_max(n);
    }

    /// Changes how many processes are kept ready per hot build (0 turns the pool off).
    pub fn set_pool_size(&self, n: usize) {
        self.pool.set_size(n);
    }

    /// Changes how many blank processes are kept per RAM base (0 turns them off).
    pub fn set_blank_pool_size(&self, n: usize) {
        self.pool.set_blank_size(n);
    }

    /// QEMU pids of the blank processes kept ready (any RAM base).
    pub fn blank_pids(&self) -> Vec<u32> {
        self.pool
            .pids()
            .into_iter()
            .filter(|(k, _)| k.starts_with(BLANK_PREFIX))
            .map(|(_, p)| p)
            .collect()
    }

    /// QEMU pids of the warmed processes kept ready for template builds.
    pub fn warm_pids(&self) -> Vec<u32> {
        self.pool
            .pids()
            .into_iter()
            .filter(|(k, _)| !k.starts_with(BLANK_PREFIX))
            .map(|(_, p)| p)
            .collect()
    }

    /// Blank processes ready for the RAM base of `build_id`.
    pub fn blank_depth(&self, build_id: &str) -> usize {
        match self.builds.get(build_id) {
            Ok(Some(rec)) => rec
                .mem_base
                .as_deref()
                .map(|m| self.pool.depth(&blank_key(m)))
                .unwrap_or(0),
            _ => 0,
        }
    }
}

impl crate::pool::Filler for Node {
    fn pool(&self) -> &crate::pool::Pool {
        &self.pool
    }

    fn restore_gate(&self) -> &tokio::sync::Semaphore {
        &self.restore_gate
    }

    fn wanted(&self, key: &str) -> bool {
        match key.strip_prefix(BLANK_PREFIX) {
            Some(mem_base) => self.builds.artifact(mem_base).exists(),
            None => matches!(self.builds.get(key), Ok(Some(_))),
        }
    }

    async fn discard(&self, p: Prepared) {
        self.discard_prepared(p).await;
    }

    /// What the background refill of pool `key` should make: a warmed process of a template
    /// build, or a blank one for a RAM base (`blank:<mem_base>`). None: nothing to make.
    async fn prepare_for_pool(
        &self,
        key: &str,
        weight: Weight,
    ) -> anyhow::Result<Option<Prepared>> {
        if let Some(mem_base) = key.strip_prefix(BLANK_PREFIX) {
            let machine = self
                .blank_machines
                .lock()
                .ok()
                .and_then(|m| m.get(mem_base).cloned());
            let Some(machine) = machine else {
                return Ok(None);
            };
            if !self.builds.artifact(mem_base).exists() {
                return Ok(None);
            }
            return self
                .prepare_blank(mem_base, &machine, weight, Some(key))
                .await
                .map(Some);
        }
        let Some(rec) = self.builds.get(key)? else {
            return Ok(None);
        };
        self.prepare(&rec, true, weight, Some(key)).await.map(Some)
    }

    /// Restores waiting for or holding a turn; pool refills wait until there are none.
    fn restores_in_flight(&self) -> usize {
        self.restores_in_flight
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}
