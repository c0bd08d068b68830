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
//! Isolation is enforced twice: in the slot's namespace (the guest reaches only public
//! addresses, from its own address, and nothing in the namespace itself) and again on the host
//! (`table ip vmon`: nothing from a slot veth reaches the host's own sockets, another slot, or a
//! private, link-local, loopback or multicast range an `allowOut` entry did not open).
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
pub const MAX_SLOTS: u32 = 512;
/// Blocks in 169.254.128.0/17.
pub const BLOCKS: u32 = 16;
/// The port of a slot's egress proxy listener, a socket in the slot's namespace on its address
/// (`addr`): the namespace DNATs the guest's TCP/443 to its rule hosts' addresses there.
pub const EGRESS_PORT: u16 = 15443;

/// One allocated slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub block: u32,
    pub index: u32,
}

impl Slot {
    /// The uid this slot's QEMU runs as, given the node's base id (the group is `base`).
    pub fn qemu_uid(&self, base: u32) -> u32 {
        base.saturating_add(self.block * MAX_SLOTS + self.index + 1)
    }
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
    /// The base id of unprivileged QEMUs ([`Slot::qemu_uid`]): each slot's tap is owned by its
    /// QEMU's uid, so QEMU attaches to it without privileges.
    qemu_ids: Option<u32>,
    /// The operator's `private_allow` and the protected addresses, in every slot's rules.
    perimeter: Perimeter,
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

pub use vmon_proto::node::is_host_name;

mod egress;
pub use egress::allow_out_reaches;

mod host;
pub use host::remove_legacy;

mod perimeter;
pub use perimeter::{endpoint_hosts, Perimeter};

mod policy;
pub use policy::*;

impl Slots {
    /// The slots of block `block` (taken modulo [`BLOCKS`]).
    pub fn new(block: u32, qemu_ids: Option<u32>, perimeter: Perimeter) -> Slots {
        Slots {
            qemu_ids,
            perimeter,
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

    /// The operator's side of this node's slots.
    pub fn perimeter(&self) -> &Perimeter {
        &self.perimeter
    }

    /// Checks a policy before anything starts: its entries ([`validate_policy`]) and, with
    /// host names resolved, that it opens no private range `private_allow` does not list.
    pub async fn vet(&self, p: &NetworkPolicy) -> Result<(), String> {
        validate_policy(p)?;
        self.perimeter.check(p).await
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
                if let Err(e) = slot.set_policy(policy, &self.perimeter).await {
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
        if let Err(e) = slot.create(policy, self.qemu_ids, &self.perimeter).await {
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
    async fn create(
        &self,
        policy: &NetworkPolicy,
        qemu_ids: Option<u32>,
        perimeter: &Perimeter,
    ) -> anyhow::Result<()> {
        let policy = resolved_within(policy, perimeter).await?;
        let owner = match qemu_ids {
            Some(base) => format!(" user {} group {base}", self.qemu_uid(base)),
            None => String::new(),
        };
        let ns = self.netns();
        let hif = self.host_if();
        let host_ip = self.host_ip();
        let addr = self.addr();
        // Two `ip` runs in batch mode, one shell in the namespace for the sysctls and its
        // ruleset, one nft run for the host's side: a burst of forks creates several slots at
        // once. IPv6 is off in the namespace (the rules are IPv4's): when the kernel has IPv6,
        // turning it off must work and read back, or the slot is not made.
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
tuntap add {TAP} mode tap{owner}
addr add {GATEWAY_IP}/30 dev {TAP}
link set {TAP} up
route add default via {host_ip}
EOF
ip netns exec {ns} sh -e -c 'echo 1 > /proc/sys/net/ipv4/ip_forward
{IPV6_OFF}
exec nft -f -' <<'EOF'
{}
EOF
nft -f - <<'EOF'
{}
EOF",
            self.ruleset(&policy, perimeter),
            self.host_rules(&policy, perimeter)
        );
        sh(&script, &format!("creating network slot {}", self.index)).await
    }

    /// This slot's chain on the host (private ranges its `allowOut` opens).
    fn host_chain(&self) -> String {
        format!("s-{}", self.host_if())
    }

    /// The host's side of this slot: its chain, rewritten, and its entry in the map.
    fn host_rules(&self, policy: &NetworkPolicy, perimeter: &Perimeter) -> String {
        let chain = self.host_chain();
        let hif = self.host_if();
        let mut r = format!(
            "add chain ip vmon {chain}
flush chain ip vmon {chain}
add element ip vmon slot_chain {{ \"{hif}\" : jump {chain} }}
"
        );
        let allows = private_allows(policy, &perimeter.private_allow);
        if !allows.is_empty() {
            r += &format!(
                "add rule ip vmon {chain} ip daddr {{ {} }} accept\n",
                allows.join(", ")
            );
        }
        r
    }

    /// The slot namespace's table. Entries of `policy` must be resolved.
    fn ruleset(&self, policy: &NetworkPolicy, perimeter: &Perimeter) -> String {
        let addr = self.addr();
        let host_ip = self.host_ip();
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
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname \"{TAP}\" ip saddr {GUEST_IP} ip daddr {addr} tcp dport {EGRESS_PORT} ct status dnat accept
    iifname \"{TAP}\" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname \"veth0\" oifname \"{TAP}\" ip saddr {host_ip} ip daddr {GUEST_IP} accept
{}  }}
}}",
            egress_rules(policy, perimeter)
        )
    }

    /// Replaces the egress policy of a live slot (in its namespace and on the host).
    pub async fn set_policy(
        &self,
        policy: &NetworkPolicy,
        perimeter: &Perimeter,
    ) -> anyhow::Result<()> {
        let policy = resolved_within(policy, perimeter).await?;
        let ns = self.netns();
        let script = format!(
            "ip netns exec {ns} nft -f - <<'EOF'
flush table ip vmon
{}
EOF
nft -f - <<'EOF'
{}
EOF",
            self.ruleset(&policy, perimeter),
            self.host_rules(&policy, perimeter)
        );
        sh(&script, "updating egress policy").await
    }

    async fn destroy(&self) -> anyhow::Result<()> {
        let ns = self.netns();
        let hif = self.host_if();
        let chain = self.host_chain();
        // Deleting the namespace takes tap0, veth0 (and so its host peer) and the nft table;
        // the host's chain and map entry for the slot go here too.
        sh(
            &format!(
                "ip netns del {ns} 2>/dev/null || true
ip link del {hif} 2>/dev/null || true
nft delete element ip vmon slot_chain '{{ \"{hif}\" }}' 2>/dev/null || true
nft delete chain ip vmon {chain} 2>/dev/null || true"
            ),
            "removing network slot",
        )
        .await
    }
}

/// The shell lines that turn IPv6 off in a slot's namespace, failing (under `sh -e`) when the
/// kernel has IPv6 and a write fails or does not read back.
const IPV6_OFF: &str = "if [ -d /proc/sys/net/ipv6 ]; then
  for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/default/disable_ipv6; do
    echo 1 > $f
    [ \"$(cat $f)\" = 1 ]
  done
fi";

/// `policy` with its host names resolved, checked again against `private_allow` (names are
/// resolved anew at every write of the rules, so an address a name moved to is checked too).
async fn resolved_within(
    policy: &NetworkPolicy,
    perimeter: &Perimeter,
) -> anyhow::Result<NetworkPolicy> {
    validate_policy(policy).map_err(|e| anyhow::anyhow!(e))?;
    let resolved = resolve_names(policy, system_resolve).await;
    for e in &resolved.allow_out {
        vmon_proto::ranges::check_private(e, e, &perimeter.private_allow)
            .map_err(|m| anyhow::anyhow!(m))?;
    }
    Ok(resolved)
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

    fn policy(allow: &[&str], deny: &[&str], internet: bool) -> NetworkPolicy {
        NetworkPolicy {
            allow_internet_access: internet,
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn policy_validation() {
        let mut p = policy(&["10.0.0.0/8", "api.example.com"], &["1.2.3.4"], false);
        assert!(validate_policy(&p).is_ok());
        for bad in [
            "1.2.3.4; flush ruleset",
            "10.0.0.0/33",
            "example",
            "-bad.example.com",
            "a..b",
            "1.2.3.400",
            "exa mple.com",
            "x.com }",
        ] {
            p.deny_out = vec![bad.into()];
            assert!(validate_policy(&p).is_err(), "{bad} accepted");
        }
        p.deny_out = (0..=MAX_NAMES)
            .map(|i| format!("h{i}.example.com"))
            .collect();
        assert!(validate_policy(&p).is_err(), "too many names");
    }

    /// The rule lines of a chain body, in order, for assertions on what comes first.
    fn position(rules: &str, needle: &str) -> usize {
        rules
            .lines()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no rule with {needle:?} in\n{rules}"))
    }

    /// The operator opens 10.250.0.0/16 to `allowOut`; 10.250.9.9 (say, etcd) and
    /// 203.0.113.5 (the host's public address) are protected.
    fn perimeter() -> Perimeter {
        Perimeter::new(
            vec!["10.250.0.0/16".into()],
            vec!["10.250.9.9".into(), "203.0.113.5".into()],
        )
    }

    #[test]
    fn egress_rules_drop_the_host_slots_and_private_ranges_first() {
        let r = egress_rules(&open_policy(), &perimeter());
        let spoof = position(&r, &format!("ip saddr != {GUEST_IP} drop"));
        let never = position(&r, "169.254.0.0/16");
        let protected = position(&r, "10.250.9.9");
        let private = position(&r, "10.0.0.0/8");
        let internet = position(&r, "oifname \"veth0\" accept");
        assert!(
            spoof < never && never < protected && protected < private && private < internet,
            "{r}"
        );
        assert!(r
            .lines()
            .nth(protected)
            .is_some_and(|l| l.ends_with("drop") && l.contains("203.0.113.5")));
        assert!(r.lines().nth(private).is_some_and(|l| l.ends_with("drop")));
        for range in NEVER.iter().chain(PRIVATE.iter()) {
            assert!(r.contains(range), "{range} missing:\n{r}");
        }
        // No internet: nothing accepts what the lists do not name.
        let closed = egress_rules(&policy(&[], &[], false), &perimeter());
        assert!(!closed.contains("accept"), "{closed}");
    }

    #[test]
    fn allow_out_opens_a_private_range_only_when_it_names_one_the_operator_lists() {
        // An entry inside a private range (and inside private_allow) is accepted before the
        // private drop, after the protected one; one outside private_allow is not opened.
        let p = policy(&["10.250.0.2", "10.251.0.2", "8.8.8.8"], &[], false);
        let r = egress_rules(&p, &perimeter());
        let open = position(&r, "10.250.0.2");
        let private_drop = position(&r, "192.168.0.0/16");
        assert!(
            open < private_drop && position(&r, "10.250.9.9") < open,
            "{r}"
        );
        assert!(!r.contains("10.251.0.2"), "{r}");
        let allow = perimeter().private_allow;
        assert_eq!(private_allows(&p, &allow), vec!["10.250.0.2".to_string()]);
        assert!(
            private_allows(&p, &[]).is_empty(),
            "nothing without private_allow"
        );
        // "Everything" is the internet, not the host's local networks.
        let p = policy(&["0.0.0.0/0"], &[], false);
        assert!(private_allows(&p, &allow).is_empty());
        let r = egress_rules(&p, &perimeter());
        assert!(
            position(&r, "0.0.0.0/0") > position(&r, "192.168.0.0/16"),
            "{r}"
        );
        // Another slot or the host can never be opened.
        let p = policy(&["169.254.128.6", "127.0.0.1"], &[], true);
        assert!(private_allows(&p, &allow).is_empty());
        assert!(public_entries(&p.allow_out).is_empty());
        assert!(!egress_rules(&p, &perimeter()).contains("169.254.128.6"));
    }

    #[test]
    fn the_host_lets_only_root_open_connections_to_guests() {
        for was_off in [false, true] {
            let r = host_ruleset(&perimeter(), was_off);
            let body = &r[r.rfind("chain output").expect("output chain")..];
            let established =
                position(body, "oifname \"vmh*\" ct state established,related accept");
            let root = position(body, "oifname \"vmh*\" meta skuid 0 accept");
            let drop = position(body, "oifname \"vmh*\" drop");
            assert!(established < root && root < drop, "{body}");
            // Forwarded: only replies go into a slot veth.
            let fwd = &r[r.rfind("chain forward").expect("forward chain")..];
            assert!(
                position(
                    fwd,
                    "    oifname \"vmh*\" ct state established,related accept"
                ) < position(fwd, "    oifname \"vmh*\" drop"),
                "{fwd}"
            );
            assert!(
                position(fwd, "10.250.9.9") < position(fwd, "@slot_chain"),
                "{fwd}"
            );
            assert_eq!(
                fwd.contains("iifname != \"vmh*\" oifname != \"vmh*\" drop"),
                was_off,
                "forwarding that is not vmon's is dropped only when vmon turned it on:\n{fwd}"
            );
        }
    }

    #[test]
    fn host_names_resolve_to_addresses_and_unknown_ones_to_nothing() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let p = policy(
            &["api.example.com", "1.1.1.1"],
            &["gone.example.com"],
            false,
        );
        let resolved = rt.block_on(resolve_names(&p, |name| async move {
            match name.as_str() {
                "api.example.com" => {
                    vec![Ipv4Addr::new(93, 184, 216, 34), Ipv4Addr::new(1, 1, 1, 1)]
                }
                _ => vec![],
            }
        }));
        assert_eq!(resolved.allow_out, ["93.184.216.34", "1.1.1.1"]);
        assert!(resolved.deny_out.is_empty());
        assert!(!resolved.allow_internet_access);
    }

    /// Runs [`IPV6_OFF`] under `sh -e` in a new network and mount namespace, with `all`'s
    /// setting made read-only first when `read_only`: the status and what `all` reads.
    fn ipv6_off_in_a_fresh_namespace(read_only: bool) -> (bool, String) {
        let f = "/proc/sys/net/ipv6/conf/all/disable_ipv6";
        let ro = if read_only {
            format!("mount --bind {f} {f}; mount -o remount,ro,bind {f}\n")
        } else {
            String::new()
        };
        let out = std::process::Command::new("unshare")
            .args(["-m", "-n", "--propagation", "private", "sh", "-c"])
            .arg(format!(
                "{ro}sh -e -c '{IPV6_OFF}' && st=0 || st=1; echo $st $(cat {f})"
            ))
            .output()
            .expect("unshare");
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let (st, v) = text.split_once(' ').unwrap_or(("?", ""));
        (st == "0", v.to_string())
    }

    #[test]
    fn turning_ipv6_off_fails_closed() {
        assert!(
            std::path::Path::new("/proc/sys/net/ipv6").exists(),
            "this host's kernel has no IPv6: nothing to turn off, nothing to test"
        );
        assert_eq!(
            ipv6_off_in_a_fresh_namespace(false),
            (true, "1".to_string())
        );
        // A write that does not take makes the slot's setup fail, not go on with IPv6 on.
        let (ok, v) = ipv6_off_in_a_fresh_namespace(true);
        assert!(
            !ok,
            "IPv6 could not be turned off, yet the setup went on (reads {v:?})"
        );
        assert_eq!(v, "0");
    }

    #[test]
    fn rulesets_are_valid_nft() {
        // `nft -c` parses and checks without changing anything; it needs nft and root, which
        // every machine that runs slots has.
        if !std::process::Command::new("nft")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            panic!("nft is missing (apt-get install nftables)");
        }
        let slot = Slot { block: 3, index: 7 };
        let p = policy(
            &["10.250.0.2", "8.8.8.8/32", "0.0.0.0/0"],
            &["1.2.3.0/24"],
            false,
        );
        for text in [
            host_ruleset(&perimeter(), true),
            host_ruleset(&Perimeter::default(), false),
            slot.ruleset(&p, &perimeter()),
            slot.ruleset(&open_policy(), &perimeter()),
            slot.ruleset(&open_policy(), &Perimeter::default()),
            egress::intercept_ruleset(
                &[Ipv4Addr::new(198, 51, 100, 42), Ipv4Addr::new(8, 8, 8, 8)],
                slot.addr(),
            ),
        ] {
            let mut child = std::process::Command::new("nft")
                .args(["-c", "-f", "-"])
                .stdin(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("nft");
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(text.as_bytes())
                .expect("write");
            let out = child.wait_with_output().expect("nft -c");
            assert!(
                out.status.success(),
                "{}\n{text}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
