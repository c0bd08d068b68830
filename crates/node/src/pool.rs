//! The restore pool: QEMU processes pre-spawned for hot builds, each with its own slot and
//! overlay and its memory layers already written in, waiting for `migrate-incoming`. A create
//! then costs a device-state load and `/init`.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use vmon_vm::Vm;

use crate::slots::Slot;

/// Pool keys of blank processes: `blank:<mem_base artifact>`.
pub(crate) const BLANK_PREFIX: &str = "blank:";

/// The pool key of the blank processes for RAM base `mem_base`.
pub(crate) fn blank_key(mem_base: &str) -> String {
    format!("{BLANK_PREFIX}{mem_base}")
}

/// What a refill needs from the pool's owner (the node): the pool itself, the turns and the
/// artifacts guard restores share, and a way to make one process for a key.
pub(crate) trait Filler: Send + Sync + 'static {
    /// The pool being filled.
    fn pool(&self) -> &Pool;
    /// Restores waiting for or holding a turn; refills wait until there are none.
    fn restores_in_flight(&self) -> usize;
    /// The turns of CPU-heavy restore work, shared with restores.
    fn restore_gate(&self) -> &tokio::sync::Semaphore;
    /// The artifacts guard, shared: held until the new process is in the pool.
    fn artifacts_shared(&self)
        -> impl Future<Output = tokio::sync::RwLockReadGuard<'_, ()>> + Send;
    /// One process for pool `key`; None when there is nothing to make for it.
    fn prepare_for_pool(
        &self,
        key: &str,
    ) -> impl Future<Output = anyhow::Result<Option<Prepared>>> + Send;
}

pub(crate) struct Prepared {
    pub tag: String,
    pub slot: Slot,
    pub overlay: String,
    pub vm: Vm,
    pub run_dir: PathBuf,
    /// The device state is loaded already (a warmed, stopped guest): a claim only `cont`s.
    pub loaded: bool,
    /// The RAM file it maps.
    pub mem_base: String,
    pub machine: vmon_vm::MachineDesc,
}

impl Prepared {
    /// Whether this process runs `machine` (a blank one is reused only for the same machine).
    pub fn vm_matches(&self, machine: &vmon_vm::MachineDesc) -> bool {
        self.machine == *machine
    }
}

pub(crate) struct Pool {
    size: std::sync::atomic::AtomicUsize,
    /// Blank processes kept per RAM base (keys `blank:<mem_base>`).
    blank_size: std::sync::atomic::AtomicUsize,
    ready: Mutex<HashMap<String, Vec<Prepared>>>,
    /// Builds with a refill in flight, so one claim does not start several.
    filling: Mutex<std::collections::HashSet<String>>,
}

impl Pool {
    pub fn new(size: usize, blank_size: usize) -> Pool {
        Pool {
            size: std::sync::atomic::AtomicUsize::new(size),
            blank_size: std::sync::atomic::AtomicUsize::new(blank_size),
            ready: Mutex::new(HashMap::new()),
            filling: Mutex::new(Default::default()),
        }
    }

    pub fn size(&self) -> usize {
        self.size.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set_size(&self, n: usize) {
        self.size.store(n, std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set_blank_size(&self, n: usize) {
        self.blank_size
            .store(n, std::sync::atomic::Ordering::Relaxed)
    }

    /// How many processes pool `key` is topped up to.
    fn target(&self, key: &str) -> usize {
        if key.starts_with(BLANK_PREFIX) {
            self.blank_size.load(std::sync::atomic::Ordering::Relaxed)
        } else {
            self.size()
        }
    }

    pub fn take(&self, build_id: &str) -> Option<Prepared> {
        self.ready.lock().ok()?.get_mut(build_id)?.pop()
    }

    pub fn depth(&self, build_id: &str) -> usize {
        self.ready
            .lock()
            .ok()
            .and_then(|m| m.get(build_id).map(Vec::len))
            .unwrap_or(0)
    }

    /// Tops pool `key` (a template build, or `blank:<mem_base>`) up to its size in the
    /// background, after restores in flight are done: a claim never waits for a refill.
    pub fn refill<F: Filler>(&self, node: Arc<F>, key: String) {
        if self.target(&key) == 0 {
            return;
        }
        match self.filling.lock() {
            Ok(mut f) => {
                if !f.insert(key.clone()) {
                    return;
                }
            }
            Err(_) => return,
        }
        tokio::spawn(async move {
            while node.pool().depth(&key) < node.pool().target(&key) {
                while node.restores_in_flight() > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                // Until it is in the pool nothing names the new process's overlay. Taken before
                // the turn, in the order restores take them.
                let _shared = node.artifacts_shared().await;
                let Ok(_turn) = node.restore_gate().acquire().await else {
                    break;
                };
                match node.prepare_for_pool(&key).await {
                    Ok(Some(p)) => {
                        if let Ok(mut m) = node.pool().ready.lock() {
                            m.entry(key.clone()).or_default().push(p);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(pool = %key, "pool refill failed: {e:#}");
                        break;
                    }
                }
            }
            if let Ok(mut f) = node.pool().filling.lock() {
                f.remove(&key);
            }
        });
    }

    pub fn builds(&self) -> Vec<String> {
        self.ready
            .lock()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// (pool key, QEMU pid) of every ready process.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.ready
            .lock()
            .map(|m| {
                m.iter()
                    .flat_map(|(k, v)| v.iter().map(move |p| (k.clone(), p.vm.pid)))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn artifacts(&self) -> Vec<String> {
        self.ready
            .lock()
            .map(|m| {
                m.values()
                    .flatten()
                    .flat_map(|p| [p.overlay.clone(), p.mem_base.clone()])
                    .filter(|a| !a.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Drops the processes prepared for a build (it is being deleted).
    pub async fn discard(&self, build_id: &str) -> Vec<Prepared> {
        self.ready
            .lock()
            .ok()
            .and_then(|mut m| m.remove(build_id))
            .unwrap_or_default()
    }
}
