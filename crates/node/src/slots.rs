//! Network slots: one network namespace per sandbox, so every guest keeps the same address and
//! MAC across snapshots and forks.
//!
//! Slot `n` is the namespace `vmon-s<n>` holding `tap0` (169.254.0.22/30, the guest's gateway;
//! the guest is always 169.254.0.21) and `veth0`, whose peer `vmh<n>` sits on the host. The
//! namespace side of the veth pair is the slot's *host address*: the host connects there and
//! nftables inside the namespace forwards it to the guest (DNAT), while guest egress leaves with
//! the slot's address (SNAT) and the host masquerades it onwards. Egress policy is a filter chain
//! inside the namespace, so it cannot be bypassed from the guest.
//!
//! Addresses come from 169.254.128.0/17 (link-local: never routed off the host).

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::Mutex;

use anyhow::{bail, Context};
use vmon_proto::node::NetworkPolicy;

pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
pub const TAP: &str = "tap0";
/// Slots per node: each node on a host owns one block of 169.254.128.0/17.
const MAX_SLOTS: u32 = 512;
/// Blocks in 169.254.128.0/17.
pub const BLOCKS: u32 = 16;

/// One allocated slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub block: u32,
    pub index: u32,
}

impl Slot {
    pub fn netns(&self) -> String {
        format!("vmon{:x}-s{}", self.block, self.index)
    }
    fn host_if(&self) -> String {
        format!("vmh{:x}-{}", self.block, self.index)
    }
    fn base(&self) -> u32 {
        u32::from(Ipv4Addr::new(169, 254, 128, 0)) + (self.block * MAX_SLOTS + self.index) * 4
    }
    /// The host end of the veth pair.
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base() + 1)
    }
    /// Where the host reaches the guest.
    pub fn addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.base() + 2)
    }
}

/// The slots of this node (its block of addresses and namespace names).
#[derive(Debug)]
pub struct Slots {
    block: u32,
    used: Mutex<BTreeSet<u32>>,
    /// Slots made ahead of time with the default (open) policy: creating one costs tens of
    /// milliseconds of `ip`/`nft` calls, which then stay off the restore path.
    spares: Mutex<Vec<Slot>>,
    spare_target: std::sync::atomic::AtomicUsize,
    refilling: std::sync::atomic::AtomicBool,
}

/// The policy every slot is made with: egress allowed, no lists.
pub fn open_policy() -> NetworkPolicy {
    NetworkPolicy {
        allow_internet_access: true,
        ..Default::default()
    }
}

async fn sh(script: &str, what: &str) -> anyhow::Result<()> {
    let out = tokio::process::Command::new("sh")
        .args(["-e", "-c", script])
        .output()
        .await
        .with_context(|| format!("{what}: cannot run sh"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn valid_target(s: &str) -> bool {
    // An IPv4 address or CIDR; nothing else reaches nft.
    let (ip, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    ip.parse::<Ipv4Addr>().is_ok() && len.is_none_or(|l| l.parse::<u8>().is_ok_and(|n| n <= 32))
}

/// Checks a policy's addresses (IPv4 addresses or CIDRs).
pub fn validate_policy(p: &NetworkPolicy) -> Result<(), String> {
    for t in p.allow_out.iter().chain(p.deny_out.iter()) {
        if !valid_target(t) {
            return Err(format!(
                "{t:?} is not an IPv4 address or CIDR (allowOut/denyOut take addresses)"
            ));
        }
    }
    Ok(())
}

fn egress_rules(p: &NetworkPolicy) -> String {
    let mut r = String::new();
    if !p.allow_out.is_empty() {
        r += &format!(
            "    iifname \"{TAP}\" ip daddr {{ {} }} accept\n",
            p.allow_out.join(", ")
        );
    }
    if !p.deny_out.is_empty() {
        r += &format!(
            "    iifname \"{TAP}\" ip daddr {{ {} }} drop\n",
            p.deny_out.join(", ")
        );
    }
    if !p.allow_internet_access {
        r += &format!("    iifname \"{TAP}\" drop\n");
    }
    r
}

impl Slots {
    /// The slots of block `block` (taken modulo [`BLOCKS`]).
    pub fn new(block: u32) -> Slots {
        Slots {
            block: block % BLOCKS,
            used: Mutex::new(BTreeSet::new()),
            spares: Mutex::new(Vec::new()),
            spare_target: std::sync::atomic::AtomicUsize::new(0),
            refilling: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// How many spare slots to keep ready.
    pub fn set_spares(&self, n: usize) {
        self.spare_target
            .store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Tops the spare slots up in the background.
    pub fn refill(self: &std::sync::Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.spare_target.load(Ordering::Relaxed) == 0
            || self.refilling.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let have = me.spares.lock().map(|s| s.len()).unwrap_or(usize::MAX);
                if have >= me.spare_target.load(Ordering::Relaxed) {
                    break;
                }
                match me.create_new(&open_policy()).await {
                    Ok(slot) => {
                        if let Ok(mut s) = me.spares.lock() {
                            s.push(slot);
                        }
                    }
                    Err(e) => {
                        tracing::warn!("spare slot: {e:#}");
                        break;
                    }
                }
            }
            me.refilling.store(false, Ordering::Release);
        });
    }

    /// Destroys the spare slots (shutdown).
    pub async fn drain_spares(&self) {
        let spares: Vec<Slot> = self
            .spares
            .lock()
            .map(|mut s| std::mem::take(&mut *s))
            .unwrap_or_default();
        for s in spares {
            let _ = self.release(&s).await;
        }
    }

    pub fn block(&self) -> u32 {
        self.block
    }

    /// The slot of index `index` in this node's block.
    pub fn slot(&self, index: u32) -> Slot {
        Slot {
            block: self.block,
            index,
        }
    }

    /// Host-wide setup: forwarding and the masquerade for slot egress. Idempotent.
    pub async fn prepare_host() -> anyhow::Result<()> {
        sh(
            "sysctl -qw net.ipv4.ip_forward=1
             nft -f - <<'EOF'
table ip vmon
flush table ip vmon
table ip vmon {
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr 169.254.128.0/17 oifname != \"vmh*\" masquerade
  }
}
EOF",
            "host network setup",
        )
        .await
    }

    /// Removes every slot namespace and host veth not in `keep` (crash leftovers).
    pub async fn reclaim(&self, keep: &[u32]) -> anyhow::Result<Vec<u32>> {
        let ns_prefix = format!("vmon{:x}-s", self.block);
        let host_prefix = format!("vmh{:x}-", self.block);
        let out = tokio::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .await
            .context("ip netns list")?;
        let mut removed = Vec::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            let Some(idx) = name
                .strip_prefix(&ns_prefix)
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if keep.contains(&idx) {
                continue;
            }
            // Whatever still runs in an unclaimed slot is an orphan (a QEMU nobody adopted).
            let _ = sh(
                &format!("for p in $(ip netns pids {name}); do kill -9 $p; done"),
                "stop orphans in a stale slot",
            )
            .await;
            self.slot(idx).destroy().await?;
            removed.push(idx);
        }
        // Host veths whose namespace is already gone.
        let links = tokio::process::Command::new("ip")
            .args(["-o", "link", "show"])
            .output()
            .await
            .context("ip link show")?;
        for line in String::from_utf8_lossy(&links.stdout).lines() {
            let Some(name) = line.split(':').nth(1).map(|s| s.trim()) else {
                continue;
            };
            let name = name.split('@').next().unwrap_or(name);
            if let Some(idx) = name
                .strip_prefix(&host_prefix)
                .and_then(|n| n.parse::<u32>().ok())
            {
                if !keep.contains(&idx) {
                    let _ = sh(&format!("ip link del {name}"), "remove stale veth").await;
                }
            }
        }
        let mut used = self
            .used
            .lock()
            .map_err(|_| anyhow::anyhow!("slot table poisoned"))?;
        used.retain(|i| keep.contains(i));
        for k in keep {
            used.insert(*k);
        }
        Ok(removed)
    }

    /// Marks a slot as taken by an adopted sandbox.
    pub fn mark_used(&self, index: u32) {
        if let Ok(mut u) = self.used.lock() {
            u.insert(index);
        }
    }

    /// Creates a fresh slot with the given egress policy.
    pub async fn acquire(&self, policy: &NetworkPolicy) -> anyhow::Result<Slot> {
        validate_policy(policy).map_err(|e| anyhow::anyhow!(e))?;
        let spare = self.spares.lock().ok().and_then(|mut s| s.pop());
        if let Some(slot) = spare {
            if *policy != open_policy() {
                if let Err(e) = slot.set_policy(policy).await {
                    let _ = self.release(&slot).await;
                    return Err(e);
                }
            }
            return Ok(slot);
        }
        self.create_new(policy).await
    }

    async fn create_new(&self, policy: &NetworkPolicy) -> anyhow::Result<Slot> {
        let index = {
            let mut used = self
                .used
                .lock()
                .map_err(|_| anyhow::anyhow!("slot table poisoned"))?;
            let Some(i) = (0..MAX_SLOTS).find(|i| !used.contains(i)) else {
                bail!("all {MAX_SLOTS} network slots are in use");
            };
            used.insert(i);
            i
        };
        let slot = self.slot(index);
        if let Err(e) = slot.create(policy).await {
            let _ = slot.destroy().await;
            self.forget(index);
            return Err(e);
        }
        Ok(slot)
    }

    /// Destroys a slot and frees its index.
    pub async fn release(&self, slot: &Slot) -> anyhow::Result<()> {
        let r = slot.destroy().await;
        self.forget(slot.index);
        r
    }

    fn forget(&self, index: u32) {
        if let Ok(mut u) = self.used.lock() {
            u.remove(&index);
        }
    }
}

impl Slot {
    async fn create(&self, policy: &NetworkPolicy) -> anyhow::Result<()> {
        let ns = self.netns();
        let hif = self.host_if();
        let host_ip = self.host_ip();
        let addr = self.addr();
        // Two `ip` runs in batch mode and one shell in the namespace for the sysctl and the
        // ruleset: a burst of forks creates several slots at once.
        let script = format!(
            "ip -b - <<'EOF'
netns add {ns}
link add {hif} type veth peer name veth0 netns {ns}
addr add {host_ip}/30 dev {hif}
link set {hif} up
EOF
ip -n {ns} -b - <<'EOF'
link set lo up
addr add {addr}/30 dev veth0
link set veth0 up
tuntap add {TAP} mode tap
addr add {GATEWAY_IP}/30 dev {TAP}
link set {TAP} up
route add default via {host_ip}
EOF
ip netns exec {ns} sh -e -c 'echo 1 > /proc/sys/net/ipv4/ip_forward; exec nft -f -' <<'EOF'
{}
EOF",
            self.ruleset(policy)
        );
        sh(&script, &format!("creating network slot {}", self.index)).await
    }

    fn ruleset(&self, policy: &NetworkPolicy) -> String {
        let addr = self.addr();
        format!(
            "table ip vmon {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname \"veth0\" ip daddr {addr} dnat to {GUEST_IP}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname \"veth0\" ip saddr {GUEST_IP} snat to {addr}
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    ct state established,related accept
{}  }}
}}",
            egress_rules(policy)
        )
    }

    /// Replaces the egress policy of a live slot.
    pub async fn set_policy(&self, policy: &NetworkPolicy) -> anyhow::Result<()> {
        validate_policy(policy).map_err(|e| anyhow::anyhow!(e))?;
        let ns = self.netns();
        let script = format!(
            "ip netns exec {ns} nft -f - <<'EOF'
flush table ip vmon
{}
EOF",
            self.ruleset(policy)
        );
        sh(&script, "updating egress policy").await
    }

    async fn destroy(&self) -> anyhow::Result<()> {
        let ns = self.netns();
        let hif = self.host_if();
        // Deleting the namespace takes tap0, veth0 (and so its host peer) and the nft table.
        sh(
            &format!(
                "ip netns del {ns} 2>/dev/null || true
ip link del {hif} 2>/dev/null || true"
            ),
            "removing network slot",
        )
        .await
    }
}

/// Removes namespaces and host links named by vmon's first scheme (`vmon-s<n>`, `vmh<n>`),
/// which predates slot blocks and would shadow block 0's addresses.
pub async fn remove_legacy() {
    let Ok(out) = tokio::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .await
    else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if name
            .strip_prefix("vmon-s")
            .is_some_and(|n| n.parse::<u32>().is_ok())
        {
            let _ = sh(&format!("ip netns del {name}"), "remove legacy namespace").await;
        }
    }
    let Ok(links) = tokio::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .await
    else {
        return;
    };
    for line in String::from_utf8_lossy(&links.stdout).lines() {
        let Some(name) = line.split(':').nth(1).map(|s| s.trim()) else {
            continue;
        };
        let name = name.split('@').next().unwrap_or(name);
        if name
            .strip_prefix("vmh")
            .is_some_and(|n| n.parse::<u32>().is_ok())
        {
            let _ = sh(&format!("ip link del {name}"), "remove legacy veth").await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_distinct_per_slot() {
        let a = Slot { block: 0, index: 0 };
        let b = Slot { block: 0, index: 1 };
        assert_eq!(a.host_ip(), Ipv4Addr::new(169, 254, 128, 1));
        assert_eq!(a.addr(), Ipv4Addr::new(169, 254, 128, 2));
        assert_eq!(b.addr(), Ipv4Addr::new(169, 254, 128, 6));
        let last = Slot {
            block: BLOCKS - 1,
            index: MAX_SLOTS - 1,
        };
        assert_eq!(last.host_ip(), Ipv4Addr::new(169, 254, 255, 253));
        let other = Slot { block: 1, index: 0 };
        assert_ne!(other.addr(), a.addr());
        assert_ne!(other.netns(), a.netns());
        assert!(last.host_if().len() <= 15, "interface names fit IFNAMSIZ");
    }

    #[test]
    fn policy_validation() {
        let mut p = NetworkPolicy {
            allow_internet_access: false,
            allow_out: vec!["10.0.0.0/8".into()],
            deny_out: vec!["1.2.3.4".into()],
        };
        assert!(validate_policy(&p).is_ok());
        p.deny_out.push("1.2.3.4; flush ruleset".into());
        assert!(validate_policy(&p).is_err());
        let r = egress_rules(&NetworkPolicy {
            allow_internet_access: false,
            allow_out: vec![],
            deny_out: vec![],
        });
        assert!(r.contains("drop"));
    }
}
