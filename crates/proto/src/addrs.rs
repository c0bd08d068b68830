//! Address ranges and the ones no outside-controlled destination may reach by default: what
//! webhook deliveries (the api) and registry pulls (the node) vet their destinations with.
//! Pure functions over addresses; the host's own addresses are the callers' to add.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// An address range: network and prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (a, l) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("{s:?} is not an IP or CIDR"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match l {
            Some(l) => l
                .parse::<u8>()
                .ok()
                .filter(|n| *n <= max)
                .ok_or_else(|| format!("{s:?} has a bad prefix length"))?,
            None => max,
        };
        Ok(Cidr { addr, len })
    }
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u32::MAX << (32 - u32::from(self.len))
                };
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = if self.len == 0 {
                    0
                } else {
                    u128::MAX << (128 - u32::from(self.len))
                };
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

/// An IPv4-mapped IPv6 address is the IPv4 address it maps.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

const REFUSED_V4: [(Ipv4Addr, u8); 12] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 0, 0, 0), 24),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(198, 18, 0, 0), 15),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
    (Ipv4Addr::new(255, 255, 255, 255), 32),
];

/// The addresses on this host's interfaces.
pub fn host_addresses() -> std::io::Result<Vec<IpAddr>> {
    Ok(if_addrs::get_if_addrs()?
        .into_iter()
        .map(|i| i.ip())
        .collect())
}

/// True when `ip` may be reached by a connection vmon opens on a tenant's behalf (a webhook, a
/// registry pull): inside an operator-listed range of `allow`, or neither in a refused range nor
/// this host's own (a 6to4 address counts as the IPv4 address it embeds). Interfaces that
/// cannot be read refuse everything not listed.
pub fn reachable(allow: &[Cidr], ip: IpAddr) -> bool {
    if allow.iter().any(|c| c.contains(ip)) {
        return true;
    }
    let ip = canonical(ip);
    let embedded = match ip {
        IpAddr::V6(v6) => six_to_four(v6).map(IpAddr::V4),
        IpAddr::V4(_) => None,
    };
    let Ok(host) = host_addresses() else {
        return false;
    };
    !special(ip)
        && !host
            .into_iter()
            .map(canonical)
            .any(|h| h == ip || Some(h) == embedded)
}

/// True for addresses in the fixed refused ranges (not counting this host's own addresses).
pub fn special(ip: IpAddr) -> bool {
    match canonical(ip) {
        IpAddr::V4(a) => special_v4(a),
        IpAddr::V6(a) => {
            let s = a.segments();
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                // Site-local (deprecated, but some stacks still route it).
                || (s[0] & 0xffc0) == 0xfec0
                // IPv4-compatible ::a.b.c.d (deprecated): whatever IPv4 it carries.
                || s[..6] == [0; 6]
                // NAT64, well-known and local-use prefixes: a translator turns these into any
                // IPv4 address, the operator's private ones and this host's included.
                || s[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
                || s[..3] == [0x64, 0xff9b, 1]
                // Teredo carries an obfuscated IPv4 peer.
                || s[..2] == [0x2001, 0]
                || six_to_four(a).is_some_and(special_v4)
        }
    }
}

fn special_v4(a: Ipv4Addr) -> bool {
    REFUSED_V4.iter().any(|(n, l)| {
        Cidr {
            addr: IpAddr::V4(*n),
            len: *l,
        }
        .contains(IpAddr::V4(a))
    })
}

/// The IPv4 address a 6to4 address (2002:V4ADDR::/48) embeds.
pub fn six_to_four(a: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = a.segments();
    (s[0] == 0x2002).then(|| {
        Ipv4Addr::new(
            (s[1] >> 8) as u8,
            (s[1] & 0xff) as u8,
            (s[2] >> 8) as u8,
            (s[2] & 0xff) as u8,
        )
    })
}
