//! Where webhooks may go: never to this host or the networks behind it unless the operator says
//! so. A webhook URL is checked when it is registered or changed (400 if its host is, or
//! resolves to, a refused address) and again at every delivery, where the connector connects
//! only to the addresses it vetted itself (so a name that later resolves elsewhere, DNS
//! rebinding, gains nothing).
//!
//! Refused: loopback, link-local (169.254/16 holds every sandbox slot and cloud metadata),
//! private and shared ranges, "this network", multicast, reserved, broadcast, IPv6 loopback,
//! link-local and unique-local, and every address of this host's interfaces. The operator opens
//! ranges with `webhook_allow` (`VMON_WEBHOOK_ALLOW`, CIDRs), e.g. `127.0.0.1/32` for a receiver
//! on this machine.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::Name;

use vmon_proto::addrs::reachable;
pub use vmon_proto::addrs::Cidr;

/// The destinations webhooks may reach.
#[derive(Debug, Clone, Default)]
pub struct WebhookTargets {
    allow: Vec<Cidr>,
}

impl WebhookTargets {
    pub fn new(allow: &[String]) -> Result<WebhookTargets, String> {
        let allow = allow
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.parse())
            .collect::<Result<Vec<Cidr>, String>>()?;
        Ok(WebhookTargets { allow })
    }

    /// True when a webhook may be delivered to `ip`.
    pub fn allowed(&self, ip: IpAddr) -> bool {
        reachable(&self.allow, ip)
    }

    /// Why `url`'s host may not receive webhooks (it is, or resolves to, a refused address);
    /// None when it may. A name that does not resolve now is accepted (its deliveries fail
    /// until it does).
    pub async fn refusal(&self, host: &str) -> Option<String> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<IpAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => lookup(host).await,
        };
        addrs.into_iter().find(|a| !self.allowed(*a)).map(|a| {
            format!(
                "webhook host {host} is (or resolves to) {a}, an address on this host or a private, loopback or link-local network; the operator can allow it with webhook_allow"
            )
        })
    }
}

async fn lookup(host: &str) -> Vec<IpAddr> {
    let q = tokio::net::lookup_host(format!("{host}:0"));
    match tokio::time::timeout(std::time::Duration::from_secs(5), q).await {
        Ok(Ok(it)) => it.map(|a| a.ip()).take(64).collect(),
        _ => Vec::new(),
    }
}

/// The delivery connector's resolver: the host's resolver, keeping only addresses webhooks may
/// reach; none left is an error.
#[derive(Debug, Clone)]
pub struct VettedResolver {
    pub targets: Arc<WebhookTargets>,
}

type Resolving =
    Pin<Box<dyn Future<Output = Result<std::vec::IntoIter<SocketAddr>, std::io::Error>> + Send>>;

impl tower::Service<Name> for VettedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = Resolving;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let targets = self.targets.clone();
        Box::pin(async move {
            let host = name.as_str().to_string();
            let all = lookup(&host).await;
            if all.is_empty() {
                return Err(std::io::Error::other(format!("{host} does not resolve")));
            }
            let ok: Vec<SocketAddr> = all
                .into_iter()
                .filter(|a| targets.allowed(*a))
                .map(|a| SocketAddr::new(a, 0))
                .collect();
            if ok.is_empty() {
                return Err(std::io::Error::other(format!(
                    "{host} resolves only to addresses webhooks may not reach"
                )));
            }
            Ok(ok.into_iter())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    #[test]
    fn refused_ranges() {
        let t = WebhookTargets::default();
        for bad in [
            "127.0.0.1",
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "169.254.128.2",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            // NAT64: every embedded IPv4, public ones too (the translator decides where).
            "64:ff9b::7f00:1",
            "64:ff9b::a00:1",
            "64:ff9b::808:808",
            "64:ff9b:1::a00:1",
            // 6to4 embedding private, loopback, link-local IPv4.
            "2002:7f00:1::1",
            "2002:a00:1::",
            "2002:c0a8:101::1",
            "2002:a9fe:a9fe::1",
            "2002:ac10:1::1",
            // Site-local, IPv4-compatible, Teredo.
            "fec0::1",
            "feff::1",
            "::a00:1",
            "::7f00:1",
            "2001:0:4136:e378::1",
        ] {
            assert!(!t.allowed(bad.parse().expect("ip")), "{bad} allowed");
        }
        for good in [
            "8.8.8.8",
            "93.184.216.34",
            "2606:4700::1111",
            // 6to4 of a public IPv4 address.
            "2002:808:808::1",
            "2001:db9::1",
        ] {
            assert!(t.allowed(good.parse().expect("ip")), "{good} refused");
        }
        // This host's own addresses, whatever they are.
        for own in vmon_proto::addrs::host_addresses().expect("interfaces") {
            assert!(!t.allowed(own), "{own} (this host) allowed");
            if let IpAddr::V4(v4) = own {
                let [a, b, c, d] = v4.octets();
                let wrapped = Ipv6Addr::new(
                    0x2002,
                    u16::from_be_bytes([a, b]),
                    u16::from_be_bytes([c, d]),
                    0,
                    0,
                    0,
                    0,
                    1,
                );
                assert!(
                    !t.allowed(IpAddr::V6(wrapped)),
                    "{wrapped} (6to4 of {v4}) allowed"
                );
            }
        }
    }

    #[test]
    fn the_operator_opens_ranges() {
        let t = WebhookTargets::new(&["127.0.0.1/32".into(), "10.9.0.0/16".into()]).expect("cidrs");
        assert!(t.allowed("127.0.0.1".parse().expect("ip")));
        assert!(t.allowed("10.9.3.4".parse().expect("ip")));
        assert!(!t.allowed("127.0.0.2".parse().expect("ip")));
        assert!(!t.allowed("10.8.0.1".parse().expect("ip")));
        assert!(WebhookTargets::new(&["10.0.0.0/33".into()]).is_err());
        assert!(WebhookTargets::new(&["example.com".into()]).is_err());
    }

    #[test]
    fn urls_naming_refused_hosts_are_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        let t = WebhookTargets::default();
        rt.block_on(async {
            assert!(t.refusal("127.0.0.1").await.is_some());
            assert!(t.refusal("[::1]").await.is_some());
            // `localhost` resolves to loopback on every machine.
            assert!(t.refusal("localhost").await.is_some());
            assert!(t.refusal("8.8.8.8").await.is_none());
        });
    }

    #[test]
    fn the_resolver_connects_only_to_allowed_addresses() {
        use std::str::FromStr;
        use tower::Service;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        rt.block_on(async {
            let mut refused = VettedResolver {
                targets: Arc::new(WebhookTargets::default()),
            };
            let name = Name::from_str("localhost").expect("name");
            assert!(
                refused.call(name.clone()).await.is_err(),
                "localhost is this host"
            );
            let mut open = VettedResolver {
                targets: Arc::new(WebhookTargets::new(&["127.0.0.0/8".into()]).expect("cidr")),
            };
            let addrs: Vec<SocketAddr> = open.call(name).await.expect("allowed").collect();
            assert!(!addrs.is_empty());
            assert!(
                addrs.iter().all(|a| a.ip().is_loopback() && a.is_ipv4()),
                "{addrs:?}"
            );
        });
    }
}
