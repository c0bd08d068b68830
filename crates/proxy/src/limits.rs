//! What one sandbox or one client may hold of the proxy, and how long a guest may keep it
//! waiting: so a guest server that accepts and never answers (or stops mid-body), or a client
//! that opens request after request, costs only its own share.
//!
//! A *slot* is one request (or upgraded connection) on its way to a guest, from the moment it
//! is routed until its response body ends or its client leaves. Slots are counted per sandbox
//! and per client address; past either cap a request is answered at once (never queued).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The proxy's bounds towards guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestLimits {
    /// Slots one sandbox's guest may hold at once (all its ports together); past it, 503.
    pub per_sandbox: usize,
    /// Slots one client address may hold at once (IPv6: its /64), all sandboxes together;
    /// past it, 429.
    pub per_client: usize,
    /// A guest must send its response headers within this time of the request's last byte;
    /// else 504 and the slot is freed. Zero: no bound.
    pub response_header_timeout: Duration,
    /// A response body (not an upgraded connection) that sends nothing for this long is cut
    /// off. Zero: no bound. Envd's streams are kept within it: the proxy asks envd for
    /// keepalives at most half this far apart.
    pub idle_body_timeout: Duration,
    /// Signed `/files` URLs that match no sandbox one client may send per minute; past it,
    /// 429 without a lookup.
    pub signed_misses_per_minute: u32,
}

impl Default for GuestLimits {
    fn default() -> GuestLimits {
        GuestLimits {
            per_sandbox: 256,
            per_client: 1024,
            response_header_timeout: Duration::from_secs(300),
            idle_body_timeout: Duration::from_secs(600),
            signed_misses_per_minute: 60,
        }
    }
}

/// Which cap a request met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    Sandbox,
    Client,
}

/// The slots held now, per sandbox and per client.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    sandboxes: HashMap<String, usize>,
    clients: HashMap<IpAddr, usize>,
}

/// One slot; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<Slots>,
    sandbox: String,
    client: Option<IpAddr>,
}

/// The key a client is counted by: its address, or for IPv6 its /64 (one host commonly holds
/// the whole prefix).
pub(crate) fn client_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

impl Slots {
    /// A slot for a request to `sandbox` from `client` (`None`: a caller with no address,
    /// counted only against the sandbox).
    pub(crate) fn take(
        self: &Arc<Self>,
        limits: &GuestLimits,
        sandbox: &str,
        client: Option<IpAddr>,
    ) -> Result<Slot, Full> {
        let client = client.map(client_key);
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = client {
            if held.clients.get(&c).copied().unwrap_or(0) >= limits.per_client {
                return Err(Full::Client);
            }
        }
        if held.sandboxes.get(sandbox).copied().unwrap_or(0) >= limits.per_sandbox {
            return Err(Full::Sandbox);
        }
        *held.sandboxes.entry(sandbox.to_string()).or_insert(0) += 1;
        if let Some(c) = client {
            *held.clients.entry(c).or_insert(0) += 1;
        }
        Ok(Slot {
            slots: self.clone(),
            sandbox: sandbox.to_string(),
            client,
        })
    }

    /// Slots held by `sandbox` now.
    #[cfg(test)]
    fn of_sandbox(&self, sandbox: &str) -> usize {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.sandboxes.get(sandbox).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|p| p.into_inner());
        release(&mut held.sandboxes, &self.sandbox);
        if let Some(c) = self.client {
            release(&mut held.clients, &c);
        }
    }
}

fn release<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, key: &K) {
    if let Some(n) = map.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            map.remove(key);
        }
    }
}

/// When a request last moved a byte towards its guest: the response-header timeout counts
/// from the request's last byte, so a long upload is not cut off while it is sent.
#[derive(Debug)]
pub struct Beat {
    epoch: tokio::time::Instant,
    last_ms: AtomicU64,
}

impl Beat {
    pub(crate) fn new() -> Arc<Beat> {
        Arc::new(Beat {
            epoch: tokio::time::Instant::now(),
            last_ms: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    #[inline]
    pub fn touch(&self) {
        self.last_ms.fetch_max(self.now_ms(), Ordering::Relaxed);
    }

    fn quiet(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.last_ms.load(Ordering::Relaxed)),
        )
    }

    /// Ends once nothing moved for `limit`; never when `limit` is zero.
    pub(crate) async fn quiet_for(&self, limit: Duration) {
        if limit.is_zero() {
            return std::future::pending().await;
        }
        loop {
            let quiet = self.quiet();
            if quiet >= limit {
                return;
            }
            tokio::time::sleep(limit - quiet).await;
        }
    }
}

/// Per-client budget of signed `/files` lookups that found nothing, in one-minute windows.
#[derive(Debug, Default)]
pub(crate) struct Misses {
    windows: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

/// Past this many clients tracked, windows that ended are dropped.
const MISS_TABLE_PRUNE_AT: usize = 4096;
const MISS_WINDOW: Duration = Duration::from_secs(60);

impl Misses {
    /// Whether `client` may have another signed lookup now.
    pub(crate) fn allows(&self, client: IpAddr, per_minute: u32) -> bool {
        let windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        match windows.get(&client_key(client)) {
            Some((start, n)) => start.elapsed() >= MISS_WINDOW || *n < per_minute,
            None => true,
        }
    }

    /// A lookup by `client` found nothing.
    pub(crate) fn missed(&self, client: IpAddr) {
        let now = Instant::now();
        let mut windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        if windows.len() >= MISS_TABLE_PRUNE_AT {
            windows.retain(|_, (start, _)| now.duration_since(*start) < MISS_WINDOW);
        }
        let w = windows.entry(client_key(client)).or_insert((now, 0));
        if now.duration_since(w.0) >= MISS_WINDOW {
            *w = (now, 0);
        }
        w.1 = w.1.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Option<IpAddr> {
        s.parse().ok()
    }

    #[test]
    fn caps_per_sandbox_and_per_client_and_slots_come_back() {
        let limits = GuestLimits {
            per_sandbox: 2,
            per_client: 3,
            ..GuestLimits::default()
        };
        let slots = Arc::new(Slots::default());
        let a1 = slots.take(&limits, "a", ip("10.0.0.1")).expect("a1");
        let a2 = slots.take(&limits, "a", ip("10.0.0.2")).expect("a2");
        assert_eq!(
            slots.take(&limits, "a", ip("10.0.0.3")).err(),
            Some(Full::Sandbox)
        );
        // Another sandbox is untouched by a's cap.
        let b1 = slots.take(&limits, "b", ip("10.0.0.1")).expect("b1");
        let b2 = slots.take(&limits, "b", ip("10.0.0.1")).expect("b2");
        assert_eq!(
            slots.take(&limits, "c", ip("10.0.0.1")).err(),
            Some(Full::Client)
        );
        drop(a1);
        assert_eq!(slots.of_sandbox("a"), 1);
        let c1 = slots
            .take(&limits, "c", ip("10.0.0.1"))
            .expect("a slot came back");
        drop((a2, b1, b2, c1));
        assert_eq!(slots.of_sandbox("a"), 0);
        let held = slots.held.lock().expect("lock");
        assert!(held.sandboxes.is_empty() && held.clients.is_empty());
    }

    #[test]
    fn an_ipv6_client_is_its_slash_64() {
        assert_eq!(
            client_key("2001:db8:1:2:aaaa::1".parse().expect("ip")),
            client_key("2001:db8:1:2:bbbb::9".parse().expect("ip"))
        );
        assert_ne!(
            client_key("2001:db8:1:2::1".parse().expect("ip")),
            client_key("2001:db8:1:3::1".parse().expect("ip"))
        );
        assert_eq!(
            client_key("::ffff:10.0.0.1".parse().expect("ip")),
            client_key("10.0.0.1".parse().expect("ip"))
        );
    }

    #[test]
    fn misses_are_limited_per_client() {
        let m = Misses::default();
        let a: IpAddr = "10.0.0.1".parse().expect("ip");
        let b: IpAddr = "10.0.0.2".parse().expect("ip");
        for _ in 0..3 {
            assert!(m.allows(a, 3));
            m.missed(a);
        }
        assert!(!m.allows(a, 3));
        assert!(m.allows(b, 3));
    }

    #[tokio::test]
    async fn quiet_for_counts_from_the_last_byte() {
        let beat = Beat::new();
        let start = tokio::time::Instant::now();
        let b = beat.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            b.touch();
        });
        beat.quiet_for(Duration::from_millis(200)).await;
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(350) && waited < Duration::from_millis(1000),
            "{waited:?}"
        );
    }
}
