//! Secret injection's side of a slot: the interception table in its namespace and which
//! addresses the egress proxy may reach for it (`docs/networking.md`, "Secrets at egress").

use std::net::Ipv4Addr;

use vmon_proto::node::NetworkPolicy;

use vmon_proto::ranges::holds;

use super::{
    private_allows, sh, within, Perimeter, Slot, EGRESS_PORT, GUEST_IP, NEVER, PRIVATE, TAP,
};

/// The slot namespace's interception table: TCP/443 from the guest to `addrs` is DNATed to
/// the egress listener at `local` ([`Slot::addr`], the namespace's own address):[`EGRESS_PORT`]
/// (the `vmon` table's input chain accepts exactly that DNATed flow).
pub(super) fn intercept_ruleset(addrs: &[Ipv4Addr], local: Ipv4Addr) -> String {
    let set: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
    format!(
        "table ip vmon_egress {{ }}
flush table ip vmon_egress
table ip vmon_egress {{
  chain prerouting {{
    type nat hook prerouting priority dstnat - 1; policy accept;
    iifname \"{TAP}\" ip saddr {GUEST_IP} ip daddr {{ {} }} tcp dport 443 dnat to {local}:{EGRESS_PORT}
  }}
}}",
        set.join(", ")
    )
}

/// Whether a guest whose (resolved) policy is `p` reaches `addr` directly: never one of
/// [`NEVER`] or of the protected addresses (the cluster's parts, the host's own addresses); a
/// private one only when an `allowOut` entry inside a private range and inside the operator's
/// `private_allow` holds it; a public one when an `allowOut` entry holds it. The egress proxy,
/// which runs on the host, connects to a rule host's address only when this holds, so it opens
/// nothing the slot's own rules would not, and never the host itself.
pub fn allow_out_reaches(p: &NetworkPolicy, addr: Ipv4Addr, perimeter: &Perimeter) -> bool {
    let a = addr.to_string();
    if within(&a, &NEVER) || perimeter.protects(addr) {
        return false;
    }
    if within(&a, &PRIVATE) {
        return private_allows(p, &perimeter.private_allow)
            .iter()
            .any(|e| holds(e, addr));
    }
    p.allow_out.iter().any(|e| holds(e, addr))
}

impl Slot {
    /// Sends the guest's TCP/443 to `addrs` to this slot's egress proxy listener, a socket in
    /// the slot's own namespace on [`Slot::addr`]:[`EGRESS_PORT`] (the namespace's input chain
    /// accepts exactly that DNATed flow); empty `addrs` removes it. A table of its own
    /// (`vmon_egress`), so policy writes leave it alone; nothing changes on the host.
    pub async fn set_intercept(&self, addrs: &[Ipv4Addr]) -> anyhow::Result<()> {
        let ns = self.netns();
        let script = if addrs.is_empty() {
            format!("ip netns exec {ns} nft delete table ip vmon_egress 2>/dev/null || true")
        } else {
            format!(
                "ip netns exec {ns} nft -f - <<'EOF'
{}
EOF",
                intercept_ruleset(addrs, self.addr())
            )
        };
        sh(&script, "setting the egress interception").await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str]) -> NetworkPolicy {
        NetworkPolicy {
            allow_internet_access: true,
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: Vec::new(),
        }
    }

    #[test]
    fn the_egress_proxy_reaches_only_what_the_policy_reaches() {
        let p = policy(&["10.250.0.2", "10.251.0.2", "8.8.8.0/24", "198.51.100.42"]);
        // The operator opens 10.250.0.0/16; 8.8.8.53 and 198.51.100.0/24 are protected (a
        // cluster endpoint, the host's own public address).
        let perimeter = Perimeter::new(
            vec!["10.250.0.0/16".into()],
            vec!["8.8.8.53".into(), "198.51.100.0/24".into()],
        );
        for (addr, ok) in [
            ("8.8.8.8", true),
            ("8.8.8.53", false),
            ("198.51.100.42", false),
            ("10.250.0.2", true),
            ("10.251.0.2", false),
            ("1.1.1.1", false),
            ("10.250.0.3", false),
            ("127.0.0.1", false),
            ("169.254.169.254", false),
            ("169.254.128.1", false),
        ] {
            let a: Ipv4Addr = addr.parse().expect("addr");
            assert_eq!(allow_out_reaches(&p, a, &perimeter), ok, "{addr}");
        }
        // `0.0.0.0/0` is the internet, not the host's networks.
        let open = policy(&["0.0.0.0/0"]);
        assert!(allow_out_reaches(
            &open,
            Ipv4Addr::new(8, 8, 4, 4),
            &perimeter
        ));
        assert!(!allow_out_reaches(
            &open,
            Ipv4Addr::new(192, 168, 1, 1),
            &perimeter
        ));
        assert!(!allow_out_reaches(
            &open,
            Ipv4Addr::new(8, 8, 8, 53),
            &perimeter
        ));
        let rules = intercept_ruleset(
            &[Ipv4Addr::new(8, 8, 8, 8)],
            Ipv4Addr::new(169, 254, 128, 2),
        );
        assert!(
            rules.contains("tcp dport 443 dnat to 169.254.128.2:15443"),
            "{rules}"
        );
        assert!(rules.contains("ip saddr 169.254.0.21"), "{rules}");
    }
}
