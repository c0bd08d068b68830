//! The restore pool: QEMU processes pre-spawned for hot builds, each with its own slot and
//! overlay and its memory layers already written in, waiting for `migrate-incoming`. A create
//! then costs a device-state load and `/init`.
//!
//! Each pool sizes itself by demand: a key is kept at its base size (the configured one), grown
//! to the number of claims it saw in the last [`DEMAND_WINDOW`] (hits and misses alike) up to
//! the pool's maximum while the host has memory to spare, and trimmed back to its base once no
//! claim came for [`IDLE_AFTER`]. Refills yield to restores: they start only while none is in
//! flight and take a restore turn. A process made ahead of demand (the key already holds its
//! base) runs at background CPU weight until claimed; the one that brings a key back to its base
//! is the next create's, and runs at the normal weight, as does one being made at background
//! weight when a claim leaves its key below its base: at background weight a warm-up beside busy
//! guests could take longer than a user's loop between creates (or time out), and every create
//! then missed the pool (issue 42). While a key still has a process ready, its refill also waits
//! until its last claim is [`SETTLE_AFTER_CLAIM`] old, so a new sandbox's first commands do not
//! share the CPU with a warm-up. An empty key refills at once (the next create must not miss),
//! but its refill *yields* for its first moments ([`Pool::with_yield`]): it starts at background
//! weight and is raised to the normal one when the yield ends, so the sandbox whose claim
//! started it runs its first command beside a warm-up that gives way (issue 42: at equal weight
//! that command took 250 ms instead of ~40).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmon_vm::cgroup::Weight;
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
    /// Whether pool `key` still has something to restore (its build, or its RAM base, was not
    /// deleted while a process was being made for it).
    fn wanted(&self, key: &str) -> bool;
    /// Ends a process the pool will not keep.
    fn discard(&self, p: Prepared) -> impl Future<Output = ()> + Send;
    /// One process for pool `key` at CPU weight `weight`, named to the pool
    /// ([`Pool::making`]) as soon as its QEMU runs; None when there is nothing to make for it.
    fn prepare_for_pool(
        &self,
        key: &str,
        weight: Weight,
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
    /// The CPU weight it was made at (a claim gives a background one the normal weight).
    pub weight: vmon_vm::cgroup::Weight,
    /// Keeps its overlay from the sweep until something else names it (the pool's list, or
    /// the sandbox it became).
    pub held: Option<Held>,
}

/// Artifacts made for a process that nothing names yet (a refill between making its overlay
/// and putting it in the pool): the sweep keeps them. A name is held before its file is made. Refills hold their overlay here instead
/// of holding the artifacts guard through a warm-up, which would make every sweep, and every
/// restore and pause queued behind it, wait for the warm-up.
#[derive(Default, Clone)]
pub(crate) struct HeldArtifacts(Arc<Mutex<std::collections::HashSet<String>>>);

impl HeldArtifacts {
    /// Holds `name` until the returned guard is dropped.
    pub fn hold(&self, name: &str) -> Held {
        if let Ok(mut s) = self.0.lock() {
            s.insert(name.to_string());
        }
        Held {
            set: self.clone(),
            name: name.to_string(),
        }
    }

    /// Whether `name` is held now (a poisoned set holds everything: nothing is swept).
    pub fn contains(&self, name: &str) -> bool {
        self.0.lock().map(|s| s.contains(name)).unwrap_or(true)
    }
}

/// One held artifact (see [`HeldArtifacts`]); dropping it lets the sweep see it again.
pub(crate) struct Held {
    set: HeldArtifacts,
    name: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Ok(mut s) = self.set.0.lock() {
            s.remove(&self.name);
        }
    }
}

impl Prepared {
    /// Whether this process runs `machine` (a blank one is reused only for the same machine).
    pub fn vm_matches(&self, machine: &vmon_vm::MachineDesc) -> bool {
        self.machine == *machine
    }
}

/// Claims older than this no longer count as demand.
pub(crate) const DEMAND_WINDOW: Duration = Duration::from_secs(30);
/// A key with no claim for this long is trimmed back to its base size.
pub(crate) const IDLE_AFTER: Duration = Duration::from_secs(60);
/// A refill of a key that still has a process ready waits until its last claim is this old:
/// the sandbox just claimed has the CPU for its first commands, not a warm-up beside it.
pub(crate) const SETTLE_AFTER_CLAIM: Duration = Duration::from_secs(1);

/// How long a refill should wait before making one more process: nothing when the pool is
/// empty (the next create must not miss) or its last claim is older than `settle`.
fn settle_wait(depth: usize, since_last_claim: Option<Duration>, settle: Duration) -> Duration {
    match since_last_claim {
        Some(since) if depth > 0 => settle.saturating_sub(since),
        _ => Duration::ZERO,
    }
}

/// The weight a refill makes a key's next process at: the normal one while the key is below its
/// base (the next create claims that process), the background one above it (ahead of demand).
fn refill_weight(depth: usize, base: usize) -> Weight {
    if depth < base {
        Weight::Normal
    } else {
        Weight::Background
    }
}

/// The process a key's refill is making now: its QEMU's tag and the weight it runs at.
struct Making {
    tag: String,
    weight: Weight,
}

/// The claims of one key.
#[derive(Default)]
struct Demand {
    /// Claim instants within the window, oldest first.
    claims: VecDeque<Instant>,
    last: Option<Instant>,
}

impl Demand {
    fn forget_before(&mut self, now: Instant, window: Duration) {
        while let Some(t) = self.claims.front() {
            if now.saturating_duration_since(*t) > window {
                self.claims.pop_front();
            } else {
                break;
            }
        }
    }
}

pub(crate) struct Pool {
    size: std::sync::atomic::AtomicUsize,
    /// Blank processes kept per RAM base (keys `blank:<mem_base>`).
    blank_size: std::sync::atomic::AtomicUsize,
    /// The most processes one key grows to under demand (never below its base size).
    max: std::sync::atomic::AtomicUsize,
    /// Growth above a key's base stops while the host's available memory is below this.
    min_free_mb: u64,
    ready: Mutex<HashMap<String, Vec<Prepared>>>,
    /// Builds with a refill in flight, so one claim does not start several.
    filling: Mutex<std::collections::HashSet<String>>,
    demand: Mutex<HashMap<String, Demand>>,
    /// The process each key's refill is making now (see [`Pool::making`]).
    making: Mutex<HashMap<String, Making>>,
    /// [`DEMAND_WINDOW`] and [`IDLE_AFTER`] (shorter in unit tests).
    window: Duration,
    idle_after: Duration,
    /// How long a refill below its key's base runs at background weight first (0: none).
    yield_for: Duration,
    /// Keys whose refill yields now, until when: nothing raises their process before.
    yielding: Mutex<HashMap<String, Instant>>,
}

impl Pool {
    pub fn new(size: usize, blank_size: usize, max: usize, min_free_mb: u64) -> Pool {
        Pool {
            size: std::sync::atomic::AtomicUsize::new(size),
            blank_size: std::sync::atomic::AtomicUsize::new(blank_size),
            max: std::sync::atomic::AtomicUsize::new(max),
            min_free_mb,
            ready: Mutex::new(HashMap::new()),
            filling: Mutex::new(Default::default()),
            demand: Mutex::new(HashMap::new()),
            making: Mutex::new(HashMap::new()),
            window: DEMAND_WINDOW,
            idle_after: IDLE_AFTER,
            yield_for: Duration::ZERO,
            yielding: Mutex::new(HashMap::new()),
        }
    }

    /// A refill that brings a key back to its base starts at background weight and is raised
    /// to the normal one `d` after it started (or later, when the key is at its base by then
    /// nothing raises it): the sandbox whose claim started the refill has the CPU for its first
    /// commands, and the warm-up is never held back longer than `d`.
    pub fn with_yield(mut self, d: Duration) -> Pool {
        self.yield_for = d;
        self
    }

    /// Whether `key`'s refill yields now.
    fn yields(&self, key: &str) -> bool {
        self.yielding
            .lock()
            .ok()
            .and_then(|m| m.get(key).copied())
            .is_some_and(|until| Instant::now() < until)
    }

    /// Ends `key`'s yield: its process in the making gets the normal weight if the key is
    /// still below its base.
    fn end_yield(&self, key: &str) {
        if let Ok(mut m) = self.yielding.lock() {
            m.remove(key);
        }
        if self.depth(key) < self.base(key) {
            self.hurry(key);
        }
    }

    /// Changes the most processes one key grows to under demand.
    pub fn set_max(&self, n: usize) {
        self.max.store(n, std::sync::atomic::Ordering::Relaxed)
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

    /// The size pool `key` keeps when idle (0: the pool is off for it).
    fn base(&self, key: &str) -> usize {
        if key.starts_with(BLANK_PREFIX) {
            self.blank_size.load(std::sync::atomic::Ordering::Relaxed)
        } else {
            self.size()
        }
    }

    /// How many processes pool `key` is topped up to: its base, grown to its recent claims
    /// up to the maximum.
    pub fn target(&self, key: &str) -> usize {
        let base = self.base(key);
        if base == 0 {
            return 0;
        }
        let max = self.max.load(std::sync::atomic::Ordering::Relaxed);
        let now = Instant::now();
        let recent = self
            .demand
            .lock()
            .ok()
            .and_then(|mut d| {
                d.get_mut(key).map(|d| {
                    d.forget_before(now, self.window);
                    d.claims.len()
                })
            })
            .unwrap_or(0);
        base.max(recent.min(max))
    }

    /// How long a refill of `key` should wait now (see [`settle_wait`]).
    fn settle_wait(&self, key: &str) -> Duration {
        let since = self
            .demand
            .lock()
            .ok()
            .and_then(|d| d.get(key).and_then(|d| d.last))
            .map(|t| t.elapsed());
        settle_wait(self.depth(key), since, SETTLE_AFTER_CLAIM)
    }

    /// Takes a ready process of pool `key`, counting the claim (hit or miss) as demand. When
    /// the claim leaves the key below its base, the process its refill is making becomes the
    /// next create's: it gets the normal CPU weight.
    pub fn take(&self, key: &str) -> Option<Prepared> {
        if let Ok(mut d) = self.demand.lock() {
            let now = Instant::now();
            let e = d.entry(key.to_string()).or_default();
            e.forget_before(now, self.window);
            e.claims.push_back(now);
            e.last = Some(now);
        }
        let (taken, left) = match self.ready.lock() {
            Ok(mut m) => match m.get_mut(key) {
                Some(ready) => (ready.pop(), ready.len()),
                None => (None, 0),
            },
            Err(_) => return None,
        };
        if left < self.base(key) {
            self.hurry(key);
        }
        taken
    }

    /// Names the QEMU (`tag`) a refill of `key` is making, at `weight`. Its weight is raised
    /// when a claim leaves the key below its base before it is ready ([`Pool::take`]).
    pub fn making(&self, key: &str, tag: &str, weight: Weight) {
        if let Ok(mut m) = self.making.lock() {
            m.insert(
                key.to_string(),
                Making {
                    tag: tag.to_string(),
                    weight,
                },
            );
        }
        // A claim between the refill's choice of weight and now found nothing to raise.
        if self.depth(key) < self.base(key) {
            self.hurry(key);
        }
    }

    /// Forgets the process being made for `key`; returns the weight it runs at now.
    fn made(&self, key: &str) -> Option<Weight> {
        self.making
            .lock()
            .ok()
            .and_then(|mut m| m.remove(key))
            .map(|m| m.weight)
    }

    #[cfg(test)]
    fn making_weight(&self, key: &str) -> Option<Weight> {
        self.making.lock().ok()?.get(key).map(|m| m.weight)
    }

    /// Gives the process being made for `key`, if any, the normal CPU weight (not while its
    /// refill yields: [`Pool::end_yield`] does it then).
    fn hurry(&self, key: &str) {
        if self.yields(key) {
            return;
        }
        let Ok(mut m) = self.making.lock() else {
            return;
        };
        let Some(making) = m.get_mut(key) else {
            return;
        };
        if making.weight == Weight::Normal {
            return;
        }
        making.weight = Weight::Normal;
        tracing::debug!(pool = %key, tag = %making.tag, "pool: the process being made is the next create's now (normal weight)");
        if let Err(e) = vmon_vm::cgroup::set_weight(&making.tag, Weight::Normal) {
            tracing::debug!(tag = %making.tag, "raising a pool process's CPU weight: {e:#}");
        }
    }

    /// Whether pool `key` may hold one more process than it has: up to its base always, above
    /// it only while the host keeps `min_free_mb` available.
    fn may_grow(&self, key: &str) -> bool {
        may_grow(
            self.depth(key),
            self.base(key),
            available_mb(),
            self.min_free_mb,
        )
    }

    /// The processes above their key's base size whose key saw no claim for [`IDLE_AFTER`]
    /// (the caller discards them, oldest first), and forgets the demand of idle keys.
    pub fn trim(&self) -> Vec<Prepared> {
        let now = Instant::now();
        let busy: std::collections::HashSet<String> = match self.demand.lock() {
            Ok(mut d) => {
                d.retain(|_, e| {
                    e.forget_before(now, self.window);
                    e.last
                        .is_some_and(|t| now.saturating_duration_since(t) <= self.idle_after)
                });
                d.keys().cloned().collect()
            }
            Err(_) => return Vec::new(),
        };
        let mut out = Vec::new();
        if let Ok(mut m) = self.ready.lock() {
            for (key, ready) in m.iter_mut().filter(|(k, _)| !busy.contains(*k)) {
                let keep = self.base(key);
                if ready.len() > keep {
                    // Ready processes are pushed at the end: the oldest go.
                    out.extend(ready.drain(..ready.len() - keep));
                }
            }
        }
        out
    }

    pub fn depth(&self, key: &str) -> usize {
        self.ready
            .lock()
            .ok()
            .and_then(|m| m.get(key).map(Vec::len))
            .unwrap_or(0)
    }

    /// Tops pool `key` (a template build, or `blank:<mem_base>`) up to its size in the
    /// background, after restores in flight are done: a claim never waits for a refill.
    pub fn refill<F: Filler>(&self, node: Arc<F>, key: String) {
        if self.base(&key) == 0 {
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
            while node.pool().depth(&key) < node.pool().target(&key) && node.pool().may_grow(&key) {
                if !refill_one(&*node, &key).await {
                    break;
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

/// Whether a pool of `depth` ready processes and base size `base` may make one more, with
/// `available_mb` of host memory available (None: unknown, allowed).
fn may_grow(depth: usize, base: usize, available_mb: Option<u64>, min_free_mb: u64) -> bool {
    depth < base || available_mb.is_none_or(|mb| mb >= min_free_mb)
}

/// The host's available memory (`MemAvailable`), in MiB; None where it cannot be read.
fn available_mb() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb / 1024)
}

/// One process for pool `key`, made in its turn after the claims' settling time and the
/// restores in flight, and put in the pool; false when the refill should stop.
async fn refill_one<F: Filler>(node: &F, key: &str) -> bool {
    let asked = Instant::now();
    loop {
        let wait = node.pool().settle_wait(key);
        if wait.is_zero() {
            break;
        }
        tokio::time::sleep(wait).await;
    }
    while node.restores_in_flight() > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let Ok(_turn) = node.restore_gate().acquire().await else {
        return false;
    };
    let started = Instant::now();
    let wanted = refill_weight(node.pool().depth(key), node.pool().base(key));
    let yield_for = node.pool().yield_for;
    // The next create's process yields first to the sandbox that just claimed.
    let until = (wanted == Weight::Normal && !yield_for.is_zero()).then(|| started + yield_for);
    if let (Some(u), Ok(mut m)) = (until, node.pool().yielding.lock()) {
        m.insert(key.to_string(), u);
    }
    let weight = if until.is_some() {
        Weight::Background
    } else {
        wanted
    };
    tracing::debug!(pool = %key, ?weight, yield_ms = until.map(|_| yield_for.as_millis() as u64), "pool refill making a process");
    let made = make_yielding(node, key, weight, until).await;
    if let Ok(mut m) = node.pool().yielding.lock() {
        m.remove(key);
    }
    let weight = node.pool().made(key).unwrap_or(weight);
    match made {
        Ok(Some(p)) if !node.wanted(key) => {
            node.discard(p).await;
            false
        }
        Ok(Some(p)) => {
            let depth = shelve(node.pool(), key, p, wanted, weight);
            tracing::debug!(
                pool = %key,
                waited_ms = (started - asked).as_millis() as u64,
                made_ms = started.elapsed().as_millis() as u64,
                ?weight,
                depth,
                "pool refill made a process"
            );
            true
        }
        Ok(None) => false,
        Err(e) => {
            tracing::warn!(pool = %key, "pool refill failed: {e:#}");
            false
        }
    }
}

/// Makes a process for `key` at `weight`; a yield that ends (`until`) before it is made ends
/// the process's yield, and it goes on as the pool says. The new process's overlay is held
/// from the sweep (`Prepared::held`) until the pool's list names it.
async fn make_yielding<F: Filler>(
    node: &F,
    key: &str,
    weight: Weight,
    until: Option<Instant>,
) -> anyhow::Result<Option<Prepared>> {
    let making = node.prepare_for_pool(key, weight);
    tokio::pin!(making);
    match until {
        Some(u) => tokio::select! {
            m = &mut making => m,
            _ = tokio::time::sleep_until(u.into()) => {
                node.pool().end_yield(key);
                making.await
            }
        },
        None => making.await,
    }
}

/// Puts a made process into pool `key` at the weight a claim may have raised it to while it
/// was made (the normal one when the refill `wanted` it); returns the pool's depth.
fn shelve(pool: &Pool, key: &str, mut p: Prepared, wanted: Weight, weight: Weight) -> usize {
    p.weight = weight;
    if wanted == Weight::Normal && p.weight != Weight::Normal {
        // Made within its yield: the next create's, at the normal weight.
        if let Err(e) = vmon_vm::cgroup::set_weight(&p.tag, Weight::Normal) {
            tracing::debug!(tag = %p.tag, "raising a pool process's CPU weight: {e:#}");
        }
        p.weight = Weight::Normal;
    }
    match pool.ready.lock() {
        Ok(mut m) => {
            let ready = m.entry(key.to_string()).or_default();
            ready.push(p);
            ready.len()
        }
        Err(_) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(base: usize, max: usize, min_free_mb: u64) -> Pool {
        let mut p = Pool::new(base, 2, max, min_free_mb);
        p.window = Duration::from_millis(200);
        p.idle_after = Duration::from_millis(200);
        p
    }

    #[test]
    fn a_refill_waits_after_a_claim_only_while_a_process_is_ready() {
        let settle = Duration::from_secs(1);
        let ms = Duration::from_millis;
        // A claim 300 ms ago, one process still ready: the rest of the second.
        assert_eq!(settle_wait(1, Some(ms(300)), settle), ms(700));
        // The pool is empty: the next create would miss, so no wait.
        assert_eq!(settle_wait(0, Some(ms(300)), settle), Duration::ZERO);
        // The last claim is old, or there was none.
        assert_eq!(settle_wait(2, Some(ms(1500)), settle), Duration::ZERO);
        assert_eq!(settle_wait(2, None, settle), Duration::ZERO);
    }

    #[test]
    fn the_next_creates_process_is_made_at_normal_weight_and_growth_in_the_background() {
        assert_eq!(
            refill_weight(0, 1),
            Weight::Normal,
            "an empty pool: the next create's"
        );
        assert_eq!(
            refill_weight(1, 1),
            Weight::Background,
            "at its base: ahead of demand"
        );
        assert_eq!(refill_weight(3, 1), Weight::Background);
        assert_eq!(
            refill_weight(3, 4),
            Weight::Normal,
            "blank pools have a base of 4"
        );
    }

    #[test]
    fn a_claim_that_empties_the_pool_hurries_the_process_being_made() {
        // Made while the pool was off (base 0): background, and nothing raises it.
        let p = pool(0, 8, 0);
        p.making("b1", "no-such-qemu", Weight::Background);
        p.take("b1");
        assert_eq!(p.making_weight("b1"), Some(Weight::Background));
        // With a base of 1 the key is below it: a claim makes its process the next create's.
        p.set_size(1);
        p.take("b2");
        assert_eq!(
            p.making_weight("b1"),
            Some(Weight::Background),
            "a claim of another key changes nothing"
        );
        assert!(p.take("b1").is_none(), "nothing ready: a miss");
        assert_eq!(p.made("b1"), Some(Weight::Normal), "raised by the claim");
        assert_eq!(p.made("b1"), None, "forgotten once made");
        // Named after a claim already left the key below its base: raised at once.
        p.making("b1", "no-such-qemu", Weight::Background);
        assert_eq!(p.made("b1"), Some(Weight::Normal));
    }

    #[test]
    fn a_refill_that_yields_is_raised_only_when_its_yield_ends() {
        let p = pool(1, 8, 0).with_yield(Duration::from_secs(60));
        p.yielding
            .lock()
            .expect("yielding")
            .insert("b1".into(), Instant::now() + Duration::from_secs(60));
        p.making("b1", "no-such-qemu", Weight::Background);
        assert_eq!(
            p.making_weight("b1"),
            Some(Weight::Background),
            "named below its base, but yielding"
        );
        assert!(p.take("b1").is_none());
        assert_eq!(
            p.making_weight("b1"),
            Some(Weight::Background),
            "a claim does not cut a yield short"
        );
        p.end_yield("b1");
        assert_eq!(
            p.making_weight("b1"),
            Some(Weight::Normal),
            "raised when it ends"
        );
        // Another key's yield holds nothing back.
        p.making("b2", "no-such-qemu", Weight::Background);
        assert_eq!(p.making_weight("b2"), Some(Weight::Normal));
    }

    #[test]
    fn claims_grow_a_pool_up_to_its_maximum_and_it_falls_back_when_they_stop() {
        let p = pool(1, 8, 0);
        assert_eq!(p.target("b1"), 1);
        for _ in 0..5 {
            assert!(p.take("b1").is_none());
        }
        assert_eq!(
            p.target("b1"),
            5,
            "five claims, hits or misses, want five ready"
        );
        for _ in 0..10 {
            p.take("b1");
        }
        assert_eq!(p.target("b1"), 8, "bounded by the maximum");
        assert_eq!(p.target("b2"), 1, "demand is per key");
        let blank = blank_key("mem");
        for _ in 0..3 {
            p.take(&blank);
        }
        assert_eq!(p.target(&blank), 3, "blank pools grow from their own base");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            p.target("b1"),
            1,
            "claims out of the window no longer count"
        );
        assert!(p.trim().is_empty(), "nothing ready, nothing to trim");
        assert!(
            p.demand.lock().expect("demand").is_empty(),
            "idle keys are forgotten"
        );
    }

    #[test]
    fn a_pool_that_is_off_or_capped_does_not_grow() {
        let off = pool(0, 8, 0);
        for _ in 0..5 {
            off.take("b1");
        }
        assert_eq!(
            off.target("b1"),
            0,
            "size 0 turns the pool off whatever the demand"
        );
        let capped = pool(2, 1, 0);
        for _ in 0..5 {
            capped.take("b1");
        }
        assert_eq!(
            capped.target("b1"),
            2,
            "a maximum below the base keeps the base"
        );
    }

    #[test]
    fn growth_above_the_base_needs_available_memory() {
        assert!(
            may_grow(0, 1, Some(0), 2048),
            "up to its base a pool always refills"
        );
        assert!(
            !may_grow(1, 1, Some(1000), 2048),
            "above it, not while memory is short"
        );
        assert!(may_grow(1, 1, Some(4096), 2048));
        assert!(
            may_grow(3, 1, None, 2048),
            "unknown memory does not stop it"
        );
        assert!(
            available_mb().is_some_and(|mb| mb > 0),
            "this host reports MemAvailable"
        );
    }
}
