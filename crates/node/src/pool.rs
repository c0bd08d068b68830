//! The restore pool: QEMU processes pre-spawned for hot builds, each with its own slot and
//! overlay and its memory layers already written in, waiting for `migrate-incoming`. A create
//! then costs a device-state load and `/init`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use vmon_vm::Vm;

use crate::node::Node;
use crate::slots::Slot;

pub(crate) struct Prepared {
    pub tag: String,
    pub slot: Slot,
    pub overlay: String,
    pub vm: Vm,
    pub run_dir: PathBuf,
    /// The device state is loaded already (a warmed, stopped guest): a claim only `cont`s.
    pub loaded: bool,
}

pub(crate) struct Pool {
    size: std::sync::atomic::AtomicUsize,
    ready: Mutex<HashMap<String, Vec<Prepared>>>,
    /// Builds with a refill in flight, so one claim does not start several.
    filling: Mutex<std::collections::HashSet<String>>,
}

impl Pool {
    pub fn new(size: usize) -> Pool {
        Pool {
            size: std::sync::atomic::AtomicUsize::new(size),
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

    /// Tops the build's pool up to its size in the background.
    pub fn refill(&self, node: Arc<Node>, build_id: String) {
        if self.size() == 0 {
            return;
        }
        match self.filling.lock() {
            Ok(mut f) => {
                if !f.insert(build_id.clone()) {
                    return;
                }
            }
            Err(_) => return,
        }
        tokio::spawn(async move {
            while node.pool_ref().depth(&build_id) < node.pool_ref().size() {
                let rec = match node.builds_ref().get(&build_id) {
                    Ok(Some(r)) => r,
                    _ => break,
                };
                let Ok(_turn) = node.restore_gate().acquire().await else {
                    break;
                };
                match node.prepare(&rec, true).await {
                    Ok(p) => {
                        if let Ok(mut m) = node.pool_ref().ready.lock() {
                            m.entry(build_id.clone()).or_default().push(p);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(build = %build_id, "pool refill failed: {e:#}");
                        break;
                    }
                }
            }
            if let Ok(mut f) = node.pool_ref().filling.lock() {
                f.remove(&build_id);
            }
        });
    }

    pub fn builds(&self) -> Vec<String> {
        self.ready
            .lock()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    pub fn artifacts(&self) -> Vec<String> {
        self.ready
            .lock()
            .map(|m| m.values().flatten().map(|p| p.overlay.clone()).collect())
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
