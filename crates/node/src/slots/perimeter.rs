//! What the operator's configuration says about the networks around the host: which private
//! ranges `allowOut` may open (`private_allow`) and which addresses no guest reaches whatever
//! its policy and that list say (the cluster's own parts and the host's own addresses).

use std::net::{IpAddr, Ipv4Addr};

use vmon_proto::node::NetworkPolicy;
use vmon_proto::ranges::{check_private, holds, parse_cidr, within, NEVER};

use super::{is_host_name, system_resolve};

/// The operator's side of every slot's policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Perimeter {
    /// Ranges inside the private and shared ones that `allowOut` may open (operator config,
    /// `VMON_PRIVATE_ALLOW`; empty by default: no tenant opens a private network).
    pub private_allow: Vec<String>,
    /// Addresses and ranges dropped before any allow, in the slot and on the host: the
    /// cluster's endpoints (resolved), the host's own addresses and the operator's list.
    /// Never overlapping each other or [`NEVER`] (nft interval sets refuse overlaps).
    pub protected: Vec<String>,
}

impl Perimeter {
    /// The perimeter of `private_allow` and `protected` (CIDRs, kept as given, minus what
    /// [`NEVER`] already covers and entries inside others).
    pub fn new(private_allow: Vec<String>, protected: Vec<String>) -> Perimeter {
        let mut kept: Vec<String> = Vec::new();
        let mut all: Vec<String> = protected
            .into_iter()
            .filter(|c| parse_cidr(c).is_some() && !within(c, &NEVER))
            .collect();
        // Widest first, so a range swallows the addresses inside it.
        all.sort_by_key(|c| parse_cidr(c).map(|(_, l)| l).unwrap_or(32));
        for c in all {
            if !within(&c, &kept) {
                kept.push(c);
            }
        }
        Perimeter {
            private_allow,
            protected: kept,
        }
    }

    /// Gathers the protected set: `endpoints` (URLs, `host:port`s, addresses or host names of
    /// the cluster's parts; names resolved now), `extra` (the operator's list of CIDRs) and
    /// every IPv4 address of the host's interfaces.
    pub async fn gather(
        private_allow: Vec<String>,
        endpoints: &[String],
        extra: &[String],
    ) -> anyhow::Result<Perimeter> {
        let mut protected: Vec<String> = extra.to_vec();
        for e in endpoints {
            for host in endpoint_hosts(e) {
                if parse_cidr(&host).is_some() {
                    protected.push(host);
                } else if is_host_name(&host) || !host.contains('.') {
                    let addrs = system_resolve(host.clone()).await;
                    if addrs.is_empty() {
                        tracing::warn!(endpoint = %e, "a cluster endpoint's host {host} resolves to no IPv4 address; nothing protected for it");
                    }
                    protected.extend(addrs.iter().map(|a| a.to_string()));
                }
            }
        }
        protected.extend(host_addresses()?.iter().map(|a| a.to_string()));
        Ok(Perimeter::new(private_allow, protected))
    }

    /// True when `addr` is one of the protected addresses.
    pub fn protects(&self, addr: Ipv4Addr) -> bool {
        self.protected.iter().any(|c| holds(c, addr))
    }

    /// Checks a policy's `allowOut` against `private_allow`, resolving host names: an entry
    /// (or an address a name resolves to) inside a private range the operator does not list
    /// is refused with a message naming it.
    pub async fn check(&self, p: &NetworkPolicy) -> Result<(), String> {
        for e in &p.allow_out {
            if parse_cidr(e).is_some() {
                check_private(e, e, &self.private_allow)?;
                continue;
            }
            for a in system_resolve(e.clone()).await {
                check_private(&a.to_string(), e, &self.private_allow)?;
            }
        }
        Ok(())
    }
}

/// The hosts an endpoint names: `scheme://user@host:port/path`, `host:port`, a bare host, or
/// several of them comma-separated (a PostgreSQL URL's host list, etcd's endpoints).
pub fn endpoint_hosts(endpoint: &str) -> Vec<String> {
    let rest = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, r)| r)
        .split(['/', '?'])
        .next()
        .unwrap_or("");
    let rest = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    rest.split(',')
        .filter_map(|hp| {
            let hp = hp.trim();
            if hp.starts_with('[') {
                return None; // IPv6: guests have none
            }
            let host = match hp.rsplit_once(':') {
                Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
                _ => hp,
            };
            (!host.is_empty()).then(|| host.to_ascii_lowercase())
        })
        .collect()
}

/// Every IPv4 address on the host's interfaces, slot veths included (they are link-local, in
/// [`NEVER`] anyway).
fn host_addresses() -> anyhow::Result<Vec<Ipv4Addr>> {
    use anyhow::Context;
    Ok(vmon_proto::addrs::host_addresses()
        .context("reading the host's interface addresses")?
        .into_iter()
        .filter_map(|a| match a {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_name_their_hosts() {
        for (e, want) in [
            ("http://10.0.0.5:2379", vec!["10.0.0.5"]),
            (
                "postgres://vmon:pw@db.example.com:5432/vmon?sslmode=disable",
                vec!["db.example.com"],
            ),
            (
                "postgresql://u:p@10.0.0.7,10.0.0.8:5433/x",
                vec!["10.0.0.7", "10.0.0.8"],
            ),
            ("127.0.0.1:3002", vec!["127.0.0.1"]),
            ("etcd1:2379", vec!["etcd1"]),
            ("https://S3.Example.com", vec!["s3.example.com"]),
            ("http://[::1]:2379", vec![]),
            ("10.1.2.3", vec!["10.1.2.3"]),
        ] {
            assert_eq!(endpoint_hosts(e), want, "{e}");
        }
    }

    #[test]
    fn the_protected_set_has_no_overlaps_and_nothing_never_covers() {
        let p = Perimeter::new(
            vec![],
            vec![
                "10.9.0.5".into(),
                "10.9.0.0/16".into(),
                "127.0.0.1".into(),
                "169.254.128.1".into(),
                "203.0.113.7".into(),
                "not an address".into(),
            ],
        );
        assert_eq!(p.protected, ["10.9.0.0/16", "203.0.113.7"]);
        assert!(p.protects(Ipv4Addr::new(10, 9, 3, 3)));
        assert!(!p.protects(Ipv4Addr::new(10, 8, 3, 3)));
    }

    #[test]
    fn the_host_s_own_addresses_and_the_endpoints_are_protected() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let addrs = host_addresses().expect("interface addresses");
        assert!(addrs.contains(&Ipv4Addr::LOCALHOST), "{addrs:?}");
        // The gathered set holds the endpoints' addresses and every host address outside
        // NEVER (so the egress proxy, which connects from the host, never reaches the host).
        let p = rt
            .block_on(Perimeter::gather(
                vec![],
                &[
                    "http://10.77.0.9:2379".into(),
                    "postgres://u:p@10.77.0.10:5432/db".into(),
                ],
                &["192.0.2.0/24".into()],
            ))
            .expect("gather");
        for a in ["10.77.0.9", "10.77.0.10", "192.0.2.77"] {
            assert!(
                p.protects(a.parse().expect("addr")),
                "{a}: {:?}",
                p.protected
            );
        }
        for a in addrs.iter().filter(|a| !within(&a.to_string(), &NEVER)) {
            assert!(p.protects(*a), "host address {a}: {:?}", p.protected);
        }
    }
}
