//! A slot's egress policy: the ranges no guest reaches, checking and resolving `allowOut` and
//! `denyOut`, and the nftables rules made from them (the slot's own chain and the host's table).

use std::net::Ipv4Addr;

use vmon_proto::node::NetworkPolicy;

use super::{is_host_name, GUEST_IP, TAP};

pub(crate) use vmon_proto::ranges::{parse_cidr, within};
pub use vmon_proto::ranges::{NEVER, PRIVATE};

use super::Perimeter;

/// The most entries a policy list may hold, and names among them.
pub(crate) const MAX_ENTRIES: usize = 1000;
pub(crate) const MAX_NAMES: usize = 64;

pub(crate) fn valid_target(s: &str) -> bool {
    // An IPv4 address or CIDR, or a host name; nothing else reaches nft.
    parse_cidr(s).is_some() || is_host_name(s)
}

/// Checks a policy's entries (IPv4 addresses, CIDRs or host names).
pub fn validate_policy(p: &NetworkPolicy) -> Result<(), String> {
    if p.allow_out.len() > MAX_ENTRIES || p.deny_out.len() > MAX_ENTRIES {
        return Err(format!(
            "allowOut and denyOut hold at most {MAX_ENTRIES} entries each"
        ));
    }
    let mut names = 0;
    for t in p.allow_out.iter().chain(p.deny_out.iter()) {
        if !valid_target(t) {
            return Err(format!(
                "{t:?} is not an IPv4 address, CIDR or host name (allowOut/denyOut)"
            ));
        }
        if parse_cidr(t).is_none() {
            names += 1;
        }
    }
    if names > MAX_NAMES {
        return Err(format!(
            "allowOut and denyOut name at most {MAX_NAMES} hosts"
        ));
    }
    Ok(())
}

/// The policy with host names replaced by the IPv4 addresses `resolve` gives for them (at the
/// moment the rules are written; a name that does not resolve matches nothing). Addresses and
/// CIDRs are kept as they are.
pub async fn resolve_names<F, Fut>(p: &NetworkPolicy, resolve: F) -> NetworkPolicy
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Vec<Ipv4Addr>>,
{
    let mut out = NetworkPolicy {
        allow_internet_access: p.allow_internet_access,
        allow_out: Vec::new(),
        deny_out: Vec::new(),
    };
    for (from, to) in [
        (&p.allow_out, &mut out.allow_out),
        (&p.deny_out, &mut out.deny_out),
    ] {
        for e in from {
            if parse_cidr(e).is_some() {
                if !to.contains(e) {
                    to.push(e.clone());
                }
                continue;
            }
            let addrs = resolve(e.clone()).await;
            if addrs.is_empty() {
                tracing::warn!(
                    "network policy: {e} resolves to no IPv4 address; it matches nothing"
                );
            }
            for a in addrs {
                let a = a.to_string();
                if !to.contains(&a) {
                    to.push(a);
                }
            }
        }
    }
    out
}

/// Resolves a host name with the host's resolver (bounded to 5 s), IPv4 answers only.
pub async fn system_resolve(name: String) -> Vec<Ipv4Addr> {
    let lookup = tokio::net::lookup_host(format!("{name}:0"));
    match tokio::time::timeout(std::time::Duration::from_secs(5), lookup).await {
        Ok(Ok(addrs)) => {
            let mut v: Vec<Ipv4Addr> = addrs
                .filter_map(|a| match a.ip() {
                    std::net::IpAddr::V4(v4) => Some(v4),
                    std::net::IpAddr::V6(_) => None,
                })
                .collect();
            v.sort();
            v.dedup();
            v.truncate(64);
            v
        }
        _ => Vec::new(),
    }
}

/// The `allowOut` entries (resolved) that open part of a private range: only an entry that
/// lies inside one does (`0.0.0.0/0` means "the internet", not the host's local networks),
/// and only where it also lies inside the operator's `private_allow` (the api and the node
/// refuse other ones; this keeps the rules closed even if a check were skipped).
pub(crate) fn private_allows(p: &NetworkPolicy, private_allow: &[String]) -> Vec<String> {
    p.allow_out
        .iter()
        .filter(|e| within(e, &PRIVATE) && within(e, private_allow))
        .cloned()
        .collect()
}

pub(crate) fn public_entries(list: &[String]) -> Vec<&str> {
    list.iter()
        .filter(|e| parse_cidr(e).is_some() && !within(e, &PRIVATE) && !within(e, &NEVER))
        .map(|s| s.as_str())
        .collect()
}

/// The guest's forward rules inside its namespace, after the established-traffic accept. Order:
/// spoofed sources, never-reachable ranges, the protected set, private ranges (unless an
/// `allowOut` entry inside one and inside `private_allow` opens it), `allowOut`, `denyOut`,
/// the internet switch. Entries must be resolved ([`resolve_names`]).
pub(crate) fn egress_rules(p: &NetworkPolicy, perimeter: &Perimeter) -> String {
    let mut r = String::new();
    let set = |v: &[&str]| format!("{{ {} }}", v.join(", "));
    r += &format!("    iifname \"{TAP}\" ip saddr != {GUEST_IP} drop\n");
    r += &format!("    iifname \"{TAP}\" ip daddr {} drop\n", set(&NEVER));
    if !perimeter.protected.is_empty() {
        let v: Vec<&str> = perimeter.protected.iter().map(|s| s.as_str()).collect();
        r += &format!("    iifname \"{TAP}\" ip daddr {} drop\n", set(&v));
    }
    let private = private_allows(p, &perimeter.private_allow);
    if !private.is_empty() {
        let v: Vec<&str> = private.iter().map(|s| s.as_str()).collect();
        r += &format!(
            "    iifname \"{TAP}\" oifname \"veth0\" ip daddr {} accept\n",
            set(&v)
        );
    }
    r += &format!("    iifname \"{TAP}\" ip daddr {} drop\n", set(&PRIVATE));
    let allow = public_entries(&p.allow_out);
    if !allow.is_empty() {
        r += &format!(
            "    iifname \"{TAP}\" oifname \"veth0\" ip daddr {} accept\n",
            set(&allow)
        );
    }
    let deny = public_entries(&p.deny_out);
    if !deny.is_empty() {
        r += &format!("    iifname \"{TAP}\" ip daddr {} drop\n", set(&deny));
    }
    if p.allow_internet_access {
        r += &format!("    iifname \"{TAP}\" oifname \"veth0\" accept\n");
    }
    r
}

/// The host's own table: the masquerade for slot egress, and the host-side copy of the
/// isolation rules (a slot veth reaches no host socket, no other slot, no protected address,
/// and no private range its slot's `allowOut` did not open: private destinations jump, by the
/// incoming veth, to the slot's own chain `s-<veth>`, which accepts what its `allowOut`
/// names). Towards the slots: new connections only from uid 0 on this host (vmon's node and
/// proxy; no other local user), none forwarded from elsewhere (a container on the host).
/// With `forwarding_was_off` (vmon turned IPv4 forwarding on), the host forwards nothing that
/// neither enters nor leaves a slot veth.
pub fn host_ruleset(perimeter: &Perimeter, forwarding_was_off: bool) -> String {
    let protected = if perimeter.protected.is_empty() {
        String::new()
    } else {
        format!(
            "    iifname \"vmh*\" ip daddr {{ {} }} drop\n",
            perimeter.protected.join(", ")
        )
    };
    let not_ours = if forwarding_was_off {
        "    iifname != \"vmh*\" oifname != \"vmh*\" drop\n"
    } else {
        ""
    };
    format!(
        "table ip vmon {{
  map slot_chain {{ type ifname : verdict; }}
  chain postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
  chain input {{ type filter hook input priority filter; policy accept; }}
  chain output {{ type filter hook output priority filter; policy accept; }}
  chain forward {{ type filter hook forward priority filter; policy accept; }}
}}
flush chain ip vmon postrouting
flush chain ip vmon input
flush chain ip vmon output
flush chain ip vmon forward
table ip vmon {{
  chain postrouting {{
    ip saddr 169.254.128.0/17 oifname != \"vmh*\" masquerade
  }}
  chain input {{
    iifname \"vmh*\" ct state established,related accept
    iifname \"vmh*\" drop
  }}
  chain output {{
    oifname \"vmh*\" ct state established,related accept
    oifname \"vmh*\" meta skuid 0 accept
    oifname \"vmh*\" drop
  }}
  chain forward {{
    iifname \"vmh*\" oifname \"vmh*\" drop
    oifname \"vmh*\" ct state established,related accept
    oifname \"vmh*\" drop
{not_ours}    iifname \"vmh*\" ip saddr != 169.254.128.0/17 drop
    iifname \"vmh*\" ip daddr {{ {never} }} drop
{protected}    iifname \"vmh*\" ip daddr {{ {private} }} iifname vmap @slot_chain
    iifname \"vmh*\" ip daddr {{ {private} }} drop
  }}
}}",
        never = NEVER.join(", "),
        private = PRIVATE.join(", "),
    )
}
