//! Recovery and cleanup: re-adopting the VMs that survived a node restart (finishing pauses a
//! crash cut short), reclaiming slots of dead nodes, reaping sandboxes whose QEMU died, and
//! the sweep of artifacts nothing names.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;

use super::{try_lock_block, Node};
use crate::sandbox::{Live, SandboxState};
use crate::slots::Slots;
use vmon_vm::Vm;

impl Node {
    /// Re-adopts running VMs and cleans up after a crash.
    pub(super) async fn recover(self: &Arc<Self>) -> anyhow::Result<()> {
        let root = self.cfg.data_dir.join("sandboxes");
        std::fs::create_dir_all(&root)?;
        let mut keep_slots = Vec::new();
        for sb in std::fs::read_dir(&root)?.flatten() {
            for ex in std::fs::read_dir(sb.path()).into_iter().flatten().flatten() {
                let dir = ex.path();
                let Ok(state) = SandboxState::load(&dir) else {
                    continue;
                };
                match self.adopt(&dir, state).await {
                    Ok(Some(slot)) => keep_slots.push(slot),
                    Ok(None) => {}
                    Err(e) => tracing::warn!(dir = %dir.display(), "cannot adopt: {e:#}"),
                }
            }
        }
        // Pool processes are not worth adopting: kill them.
        let pool = self.cfg.data_dir.join("pool");
        if let Ok(rd) = std::fs::read_dir(&pool) {
            for e in rd.flatten() {
                let tag = e.file_name().to_string_lossy().to_string();
                vmon_vm::process::kill_recorded(&e.path(), &tag);
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let removed = self.slots.reclaim(&keep_slots).await?;
        // Namespaces of nodes that died without cleaning up: a block whose lock nobody holds.
        for b in 0..crate::slots::BLOCKS {
            if b == self.slots.block() {
                continue;
            }
            if let Ok(Some(lock)) = try_lock_block(b) {
                let stale = Slots::new(b, None, Default::default())
                    .reclaim(&[])
                    .await
                    .unwrap_or_default();
                if !stale.is_empty() {
                    tracing::info!(
                        block = b,
                        count = stale.len(),
                        "removed slots of a dead node"
                    );
                }
                drop(lock);
            }
        }
        crate::slots::remove_legacy().await;
        if !removed.is_empty() {
            tracing::info!(?removed, "reclaimed network slots");
        }
        self.sweep().await?;
        Ok(())
    }

    async fn adopt(&self, dir: &Path, state: SandboxState) -> anyhow::Result<Option<u32>> {
        let slot = self.slots.slot(state.slot);
        match Vm::adopt(dir, &state.qemu_tag).await {
            Ok(vm) => {
                self.slots.mark_used(slot.index);
                // Its GPUs stay its own (a finished pause below gives them back).
                self.gpus.hold(&state.id, &state.gpu_groups);
                let status = vm.qmp.query_status().await?;
                let mut live = Live {
                    state,
                    vm: Some(vm),
                    slot: slot.clone(),
                    dir: dir.to_path_buf(),
                };
                if let Err(e) = Self::reconcile_disk(&mut live).await {
                    tracing::warn!(sandbox = %live.state.id, "disk layers unclear: {e:#}");
                }
                if let Some(b) = live.state.pausing_build.clone() {
                    if self.builds.get(&b)?.is_some() {
                        // The pause was committed: finish it.
                        tracing::info!(sandbox = %live.state.id, build = %b, "finishing a pause cut by a restart");
                        self.destroy(&mut live, true).await;
                        return Ok(None);
                    }
                }
                if status.status == "postmigrate" {
                    // It handed over to a live migration's target before the restart: it stays
                    // stopped until the control plane's word (or the handed-over timeout).
                    self.watch_handed_over(&live.state.id, &live.state.execution_id);
                } else if !status.running {
                    if let Some(vm) = &live.vm {
                        vm.qmp.cont().await?;
                    }
                }
                live.state.pausing_build = None;
                live.state.save(dir)?;
                tracing::info!(sandbox = %live.state.id, "re-adopted running sandbox");
                let idx = live.slot.index;
                self.insert(live).map_err(|e| anyhow::anyhow!(e))?;
                Ok(Some(idx))
            }
            Err(e) => {
                tracing::warn!(sandbox = %state.id, "QEMU is gone ({e:#}); cleaning up");
                vmon_vm::process::kill_recorded(dir, &state.qemu_tag);
                // Its groups' device nodes go back to root.
                self.gpus.hold(&state.id, &state.gpu_groups);
                self.gpus.release(&state.id);
                let committed = match &state.pausing_build {
                    Some(b) => self.builds.get(b)?.is_some(),
                    None => false,
                };
                if !committed {
                    let _ = std::fs::remove_file(self.builds.artifact(&state.overlay));
                }
                let _ = std::fs::remove_file(SandboxState::path(dir));
                // Its view's links would keep the files' space.
                vmon_vm::process::clear_files(dir);
                Ok(None)
            }
        }
    }

    /// Makes an adopted sandbox's state name the disk layer its QEMU writes. A crash between a
    /// capture's switch to a fresh overlay and the state file's save leaves QEMU one layer
    /// ahead of the file: left so, the sweep would delete the overlay holding the guest's new
    /// writes, a disk-only pause would freeze the layer under it, and every later switch would
    /// fail (the recorded node is the new one's backing).
    async fn reconcile_disk(live: &mut Live) -> anyhow::Result<()> {
        let Some(vm) = live.vm.as_ref() else {
            return Ok(());
        };
        let Some((node, file)) = vm.qmp.block_top(vmon_vm::machine::DISK_DEVICE).await? else {
            return Ok(());
        };
        let st = &mut live.state;
        if node == st.disk_node {
            return Ok(());
        }
        let seq = node.strip_prefix('d').and_then(|n| n.parse::<u32>().ok());
        let name = Path::new(&file)
            .file_name()
            .map(|n| n.to_string_lossy().to_string());
        match (seq, name) {
            (Some(seq), Some(name)) if seq == st.disk_seq + 1 => {
                tracing::info!(sandbox = %st.id, node = %node, overlay = %name,
                    "finishing a disk switch cut by a restart");
                let frozen = std::mem::replace(&mut st.overlay, name);
                st.disk_chain.insert(0, frozen);
                st.disk_node = node;
                st.disk_seq = seq;
                Ok(())
            }
            _ => anyhow::bail!(
                "QEMU writes disk node {node} ({file}), its state names {} (seq {})",
                st.disk_node,
                st.disk_seq
            ),
        }
    }

    /// Deletes artifacts nothing names any more.
    pub async fn sweep(&self) -> anyhow::Result<Vec<String>> {
        let _g = self.artifacts_guard.write().await;
        let mut live: HashSet<String> = HashSet::new();
        let lives: Vec<Arc<Mutex<Live>>> = self
            .sandboxes
            .lock()
            .map_err(|_| anyhow::anyhow!("sandbox table poisoned"))?
            .values()
            .cloned()
            .collect();
        for l in lives {
            let l = l.lock().await;
            live.extend(l.state.live_artifacts());
        }
        live.extend(self.pool.artifacts());
        live.extend(self.incoming_artifacts());
        if let Ok(m) = self.parked.lock() {
            for p in m.values() {
                live.extend(p.live.state.live_artifacts());
            }
        }
        let held = self.held_artifacts.clone();
        let removed = self.builds.sweep(&live, &|name| held.contains(name))?;
        if !removed.is_empty() {
            tracing::debug!(count = removed.len(), "swept artifacts");
        }
        Ok(removed)
    }

    /// Finds sandboxes whose QEMU died and cleans up after them; returns their ids.
    pub async fn reap_dead(&self) -> Vec<String> {
        let lives: Vec<(String, Arc<Mutex<Live>>)> = match self.sandboxes.lock() {
            Ok(m) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => return Vec::new(),
        };
        let mut dead = Vec::new();
        for (id, l) in lives {
            let Ok(mut l) = l.try_lock() else { continue };
            let alive =
                l.vm.as_ref()
                    .is_some_and(|v| vmon_vm::process::is_alive(v.pid));
            if !alive {
                tracing::warn!(sandbox = %id, "QEMU died; cleaning up");
                self.remove(&id);
                if let Some(mut vm) = l.vm.take() {
                    vm.wait_exit(Duration::from_millis(100)).await;
                }
                self.destroy(&mut l, false).await;
                dead.push(id);
            }
        }
        dead
    }
}
