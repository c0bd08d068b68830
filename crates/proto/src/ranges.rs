//! IPv4 ranges a guest's egress is judged by, shared by the api (which refuses a policy) and
//! the node (which refuses it again and writes the rules): the ranges no guest ever reaches,
//! the private and shared ranges that only the operator's `private_allow` opens, and the
//! CIDR arithmetic both need. Pure functions: no I/O, no resolution.

use std::net::Ipv4Addr;

/// Destinations no guest ever reaches, whatever its policy says: this host and every slot
/// (169.254.0.0/16 holds the slot range and cloud metadata services), loopback, "this network",
/// multicast, reserved and broadcast.
pub const NEVER: [&str; 4] = ["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];

/// Private and shared ranges beyond the host: an `allowOut` entry inside one opens it only
/// where the operator's `private_allow` lists it (a database on the local network, say).
pub const PRIVATE: [&str; 6] = [
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
];

/// `a.b.c.d` or `a.b.c.d/len` (IPv4 only).
pub fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (ip, len) = match s.split_once('/') {
        Some((a, l)) => (a, l.parse::<u8>().ok().filter(|n| *n <= 32)?),
        None => (s, 32),
    };
    Some((ip.parse::<Ipv4Addr>().ok()?, len))
}

fn mask(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    }
}

/// True when the CIDR (or address) `c` lies inside one of `ranges`.
pub fn within<S: AsRef<str>>(c: &str, ranges: &[S]) -> bool {
    let Some((ip, len)) = parse_cidr(c) else {
        return false;
    };
    ranges
        .iter()
        .filter_map(|r| parse_cidr(r.as_ref()))
        .any(|(rip, rlen)| {
            len >= rlen && (u32::from(ip) & mask(rlen)) == (u32::from(rip) & mask(rlen))
        })
}

/// True when the CIDR (or address) `c` holds `addr`.
pub fn holds(c: &str, addr: Ipv4Addr) -> bool {
    parse_cidr(c)
        .is_some_and(|(ip, len)| (u32::from(ip) & mask(len)) == (u32::from(addr) & mask(len)))
}

/// Checks an operator's list of ranges (`private_allow`, the protected list): IPv4 addresses
/// or CIDRs only.
pub fn check_ranges(list: &[String]) -> Result<(), String> {
    match list.iter().find(|r| parse_cidr(r.trim()).is_none()) {
        Some(bad) => Err(format!("{bad:?} is not an IPv4 address or CIDR")),
        None => Ok(()),
    }
}

/// Whether an `allowOut` entry (an address or CIDR; a host name's resolved addresses one by
/// one) may stand: one that lies inside a private or shared range ([`PRIVATE`]) only when it
/// also lies inside one of the operator's `private_allow` ranges. Wider entries (`0.0.0.0/0`,
/// `8.0.0.0/6`) stand: they mean the internet, and the rules drop the private ranges before
/// them. `name` is what the tenant wrote (a host name, or the entry itself).
pub fn check_private(entry: &str, name: &str, private_allow: &[String]) -> Result<(), String> {
    if !within(entry, &PRIVATE) || within(entry, private_allow) {
        return Ok(());
    }
    let what = if name == entry {
        format!("allowOut entry {entry:?}")
    } else {
        format!("allowOut entry {name:?} (which resolves to {entry})")
    };
    Err(format!(
        "{what} lies in a private or shared network ({}); only the operator's private_allow setting can open those, and it does not list this one",
        PRIVATE.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_entries_stand_only_inside_the_operators_list() {
        let none: Vec<String> = Vec::new();
        let listed = vec!["10.231.77.0/24".to_string()];
        for e in [
            "10.0.0.1",
            "192.168.1.0/24",
            "100.64.0.1",
            "172.20.0.0/16",
            "198.18.0.1",
        ] {
            assert!(check_private(e, e, &none).is_err(), "{e}");
        }
        assert!(check_private("10.231.77.2", "10.231.77.2", &listed).is_ok());
        assert!(check_private("10.231.77.0/24", "10.231.77.0/24", &listed).is_ok());
        // Wider than the listed range: not inside it.
        assert!(check_private("10.231.0.0/16", "10.231.0.0/16", &listed).is_err());
        assert!(check_private("10.231.78.1", "10.231.78.1", &listed).is_err());
        // The internet, and public addresses, stand.
        for e in ["0.0.0.0/0", "8.8.8.8", "8.0.0.0/6", "203.0.113.2"] {
            assert!(check_private(e, e, &none).is_ok(), "{e}");
        }
        let m = check_private("10.1.2.3", "db.internal.example", &none).expect_err("refused");
        assert!(
            m.contains("db.internal.example")
                && m.contains("10.1.2.3")
                && m.contains("private_allow"),
            "{m}"
        );
    }

    #[test]
    fn ranges_and_addresses() {
        assert!(within("10.1.2.3", &["10.0.0.0/8"]));
        assert!(!within("10.0.0.0/7", &["10.0.0.0/8"]));
        assert!(holds("0.0.0.0/0", Ipv4Addr::new(1, 2, 3, 4)));
        assert!(holds("10.0.0.0/8", Ipv4Addr::new(10, 9, 9, 9)));
        assert!(!holds("10.0.0.0/8", Ipv4Addr::new(11, 0, 0, 0)));
        assert!(check_ranges(&["10.0.0.0/8".into(), "1.2.3.4".into()]).is_ok());
        assert!(check_ranges(&["db.example.com".into()]).is_err());
        assert!(check_ranges(&["10.0.0.0/33".into()]).is_err());
    }
}
