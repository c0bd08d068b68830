//! Traffic accounting for idle auto-suspend: when each sandbox last moved bytes through this
//! proxy, and how many of its requests are waiting on the guest right now.
//!
//! The hot path is one map read (under a read lock) per request and, per body frame or
//! upgraded read/write, a monotonic clock read and a relaxed atomic store. The control plane
//! reads the table in the same process (`vmon up`) or receives [`Activity::report`] from a
//! standalone `vmon proxy`.
//!
//! A pause (any: idle suspend, timeout, request) and a request arriving at once meet through
//! sequentially consistent atomics: the request reads the stamp's pause generation before it
//! looks up its route, counts itself in flight, then looks whether a pause is marked or began
//! since; the pause marks itself (and bumps the generation), then looks for requests in
//! flight. At least one of the two sees the other: either the request waits for the pause
//! (the sandbox's lock) and then resumes it or gets the paused answer, or the pause sees the
//! request and an idle suspend gives up while any other pause waits for its response headers
//! (a bounded drain) before the node stops the guest.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// One sandbox's traffic.
#[derive(Debug)]
pub struct Stamp {
    epoch: Instant,
    /// Milliseconds since `epoch` of the last byte (or request) seen; negative for reports
    /// of traffic before the table existed.
    last_ms: AtomicI64,
    /// Requests sent on to the guest that have no response headers yet.
    in_flight: AtomicU32,
    /// Pauses marked and not yet over (an idle suspend deciding, any pause under way).
    pausing: AtomicU32,
    /// Bumped at the start of every pause mark: a request that saw another value before its
    /// route lookup may hold a route the pause made stale.
    generation: AtomicU64,
    /// Woken when the last request in flight gets its headers (a pause's drain).
    quiet: tokio::sync::Notify,
}

impl Stamp {
    /// Never active until touched (idle for as long as a `Duration` holds).
    fn new(epoch: Instant) -> Stamp {
        Stamp {
            epoch,
            last_ms: AtomicI64::new(i64::MIN),
            in_flight: AtomicU32::new(0),
            pausing: AtomicU32::new(0),
            generation: AtomicU64::new(0),
            quiet: tokio::sync::Notify::new(),
        }
    }

    fn now_ms(&self) -> i64 {
        i64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(i64::MAX)
    }

    /// Traffic now.
    #[inline]
    pub fn touch(&self) {
        let now = self.now_ms();
        if self.last_ms.load(Ordering::Relaxed) < now {
            self.last_ms.store(now, Ordering::Relaxed);
        }
    }

    fn touch_at(&self, ms: i64) {
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long since the last traffic; zero while a request waits on the guest.
    pub fn idle(&self) -> Duration {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Duration::ZERO;
        }
        let last = self.last_ms.load(Ordering::Relaxed);
        Duration::from_millis(u64::try_from(self.now_ms().saturating_sub(last)).unwrap_or(0))
    }

    /// Counts a request in flight until the guard drops (at the guest's response headers).
    pub fn enter(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(self.clone())
    }

    /// Whether a pause is marked (an idle suspend deciding, any pause under way).
    pub fn pausing(&self) -> bool {
        self.pausing.load(Ordering::SeqCst) > 0
    }

    /// The pause generation: read before a route lookup and compared after [`Stamp::enter`].
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    fn mark(self: &Arc<Self>) -> Pausing {
        self.pausing.fetch_add(1, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
        Pausing(self.clone())
    }
}

/// A request waiting on its guest; see [`Stamp::enter`].
#[derive(Debug)]
pub struct InFlight(Arc<Stamp>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        if self.0.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.quiet.notify_waiters();
        }
    }
}

/// Held while a pause is marked; requests arriving meanwhile wait for the sandbox's lock.
#[derive(Debug)]
pub struct Pausing(Arc<Stamp>);

impl Pausing {
    /// Waits until no request waits on the guest's headers, at most `bound`; whether it did.
    /// Requests arriving after the mark never count: they wait for the pause instead.
    pub async fn drained(&self, bound: Duration) -> bool {
        let stamp = &self.0;
        let wait = async {
            loop {
                let quiet = stamp.quiet.notified();
                tokio::pin!(quiet);
                quiet.as_mut().enable();
                if stamp.in_flight.load(Ordering::SeqCst) == 0 {
                    return;
                }
                quiet.await;
            }
        };
        tokio::time::timeout(bound, wait).await.is_ok()
    }
}

impl Drop for Pausing {
    fn drop(&mut self) {
        self.0.pausing.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a standalone proxy tells the control plane: how long each sandbox has been idle.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Idle {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "idleMs")]
    pub idle_ms: u64,
}

/// Every sandbox's [`Stamp`]. Cheap to share.
#[derive(Debug)]
pub struct Activity {
    epoch: Instant,
    stamps: RwLock<HashMap<String, Arc<Stamp>>>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            epoch: Instant::now(),
            stamps: RwLock::new(HashMap::new()),
        }
    }
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity::default())
    }

    /// The sandbox's stamp, made on first use (never active until touched).
    pub fn stamp(&self, sandbox_id: &str) -> Arc<Stamp> {
        if let Some(s) = self
            .stamps
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(sandbox_id)
        {
            return s.clone();
        }
        self.stamps
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(sandbox_id.to_string())
            .or_insert_with(|| Arc::new(Stamp::new(self.epoch)))
            .clone()
    }

    fn get(&self, sandbox_id: &str) -> Option<Arc<Stamp>> {
        self.stamps
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(sandbox_id)
            .cloned()
    }

    /// How long the sandbox has been idle here; `None` when this proxy never saw it.
    pub fn idle(&self, sandbox_id: &str) -> Option<Duration> {
        self.get(sandbox_id).map(|s| s.idle())
    }

    /// Traffic now (a resume, or a report that says so).
    pub fn touch(&self, sandbox_id: &str) {
        self.stamp(sandbox_id).touch();
    }

    /// A report from elsewhere: the sandbox was last active `idle` ago.
    pub fn note_idle(&self, sandbox_id: &str, idle: Duration) {
        let s = self.stamp(sandbox_id);
        let now = s.now_ms();
        s.touch_at(now.saturating_sub(i64::try_from(idle.as_millis()).unwrap_or(i64::MAX)));
    }

    pub fn forget(&self, sandbox_id: &str) {
        self.stamps
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sandbox_id);
    }

    /// Starts an idle suspend of a sandbox idle for at least `min_idle`: `None` (and the mark
    /// taken back) when a request is in flight or traffic came since.
    pub fn begin_suspend(&self, sandbox_id: &str, min_idle: Duration) -> Option<Pausing> {
        let s = self.stamp(sandbox_id);
        let mark = s.mark();
        if s.in_flight.load(Ordering::SeqCst) > 0 || s.idle() < min_idle {
            return None;
        }
        Some(mark)
    }

    /// Marks a pause of the sandbox under way (whatever asked for it): requests from now on
    /// wait for it; those already waiting on the guest are what [`Pausing::drained`] waits
    /// for.
    pub fn begin_pause(&self, sandbox_id: &str) -> Pausing {
        self.stamp(sandbox_id).mark()
    }

    /// The sandbox's pause generation ([`Stamp::generation`]); 0 when this table has no
    /// stamp for it (one made later starts its count at a mark, so never equals 0 after it).
    pub fn generation(&self, sandbox_id: &str) -> u64 {
        self.get(sandbox_id).map_or(0, |s| s.generation())
    }

    /// What a standalone proxy reports: the sandboxes active within `within` (or with a
    /// request in flight) and how long each has been idle; stamps idle past `forget_after`
    /// are dropped.
    pub fn report(&self, within: Duration, forget_after: Duration) -> Vec<Idle> {
        let mut out = Vec::new();
        let mut stale = Vec::new();
        for (id, s) in self.stamps.read().unwrap_or_else(|p| p.into_inner()).iter() {
            let idle = s.idle();
            if idle <= within {
                out.push(Idle {
                    sandbox_id: id.clone(),
                    idle_ms: u64::try_from(idle.as_millis()).unwrap_or(u64::MAX),
                });
            } else if idle > forget_after {
                stale.push(id.clone());
            }
        }
        if !stale.is_empty() {
            let mut m = self.stamps.write().unwrap_or_else(|p| p.into_inner());
            for id in stale {
                if m.get(&id).is_some_and(|s| s.idle() > forget_after) {
                    m.remove(&id);
                }
            }
        }
        out
    }
}

/// A body that stamps its sandbox's activity (and its request's beat, when it has one) with
/// every frame it passes on.
pub struct Stamped<B> {
    inner: B,
    stamp: Arc<Stamp>,
    beat: Option<Arc<crate::limits::Beat>>,
}

impl<B> Stamped<B> {
    pub fn new(inner: B, stamp: Arc<Stamp>) -> Stamped<B> {
        Stamped {
            inner,
            stamp,
            beat: None,
        }
    }

    /// Also touches `beat` with every frame.
    pub fn with_beat(mut self, beat: Arc<crate::limits::Beat>) -> Stamped<B> {
        self.beat = Some(beat);
        self
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for Stamped<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(_))) = &r {
            this.stamp.touch();
            if let Some(b) = &this.beat {
                b.touch();
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An upgraded connection's client side that stamps activity on every read and write.
pub struct StampedIo<T> {
    inner: T,
    stamp: Arc<Stamp>,
}

impl<T> StampedIo<T> {
    pub fn new(inner: T, stamp: Arc<Stamp>) -> StampedIo<T> {
        StampedIo { inner, stamp }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for StampedIo<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.stamp.touch();
        }
        r
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for StampedIo<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = std::pin::Pin::new(&mut this.inner).poll_write(cx, buf);
        if let std::task::Poll::Ready(Ok(n)) = &r {
            if *n > 0 {
                this.stamp.touch();
            }
        }
        r
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_in_flight_is_never_idle() {
        let a = Activity::new();
        let s = a.stamp("s1");
        a.note_idle("s1", Duration::from_secs(0));
        let guard = s.enter();
        assert_eq!(s.idle(), Duration::ZERO);
        assert!(a.begin_suspend("s1", Duration::ZERO).is_none());
        drop(guard);
        let sus = a.begin_suspend("s1", Duration::ZERO).expect("idle now");
        assert!(s.pausing());
        drop(sus);
        assert!(!s.pausing());
    }

    #[test]
    fn recent_traffic_stops_a_suspend() {
        let a = Activity::new();
        a.touch("s1");
        assert!(a.begin_suspend("s1", Duration::from_secs(60)).is_none());
        assert!(!a.stamp("s1").pausing());
        a.note_idle("s2", Duration::from_secs(90));
        assert!(a.idle("s2").is_some_and(|d| d >= Duration::from_secs(90)));
        assert!(a.begin_suspend("s2", Duration::from_secs(60)).is_some());
    }

    #[test]
    fn reports_carry_recent_sandboxes_and_drop_stale_ones() {
        let a = Activity::new();
        a.touch("busy");
        a.stamp("old");
        std::thread::sleep(Duration::from_millis(30));
        a.touch("busy");
        let r = a.report(Duration::from_millis(20), Duration::from_millis(25));
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].sandbox_id, "busy");
        assert!(a.idle("old").is_none(), "stale stamps are forgotten");
    }
}
