//! Kept-alive connections to envd, one pool per sandbox *run*.
//!
//! A guest address belongs to a slot, and a slot passes to another sandbox after a kill or a
//! pause, so connections must never be pooled by address alone: an idle one could reach a
//! dead guest or a different tenant's. A run (a sandbox id and its execution id, which a
//! resume renews) at an address is what a kept connection is known by here. The pooled
//! client's request URI carries that as its host, `{ip in hex}.{digest of the run}.run`,
//! which [`RunResolver`] turns back into the address; the client's pool is keyed by the URI's
//! authority, so two runs never share a connection, whatever their addresses.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::Name;
use sha2::{Digest, Sha256};

/// The suffix of every pooled host name.
const SUFFIX: &str = ".run";

/// The pooled URI authority of `sandbox_id`'s run `execution_id` at `addr`.
pub fn authority(sandbox_id: &str, execution_id: &str, addr: SocketAddr) -> String {
    let mut h = Sha256::new();
    h.update(sandbox_id.as_bytes());
    h.update([0]);
    h.update(execution_id.as_bytes());
    let run: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let ip = match addr.ip() {
        IpAddr::V4(v4) => hex(&v4.octets()),
        IpAddr::V6(v6) => hex(&v6.octets()),
    };
    format!("{ip}.{run}{SUFFIX}:{}", addr.port())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The address a pooled host name stands for; `None` for any other name.
pub fn address_of(host: &str) -> Option<IpAddr> {
    let ip = host.strip_suffix(SUFFIX)?.split('.').next()?;
    let bytes: Vec<u8> = (0..ip.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(ip.get(i..i + 2)?, 16).ok())
        .collect::<Option<_>>()?;
    match bytes.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::new(
            bytes[0], bytes[1], bytes[2], bytes[3],
        ))),
        16 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&bytes);
            Some(IpAddr::V6(Ipv6Addr::from(o)))
        }
        _ => None,
    }
}

/// The pooled client's resolver: a run's host name gives its address (no DNS is ever asked).
#[derive(Clone, Copy, Debug, Default)]
pub struct RunResolver;

impl tower_service::Service<Name> for RunResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        std::future::ready(
            address_of(name.as_str())
                // The connector puts the URI's port in.
                .map(|ip| vec![SocketAddr::new(ip, 0)].into_iter())
                .ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("{} is not a sandbox run's name", name.as_str()),
                    )
                }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_s_authority_gives_its_address_back() {
        for addr in ["10.11.0.2:49983", "[fd00::2]:49983", "127.0.0.1:8080"] {
            let addr: SocketAddr = addr.parse().expect("addr");
            let a = authority("isbx", "exec-1", addr);
            let uri: http::Uri = format!("http://{a}/x").parse().expect("a valid uri");
            assert_eq!(uri.port_u16(), Some(addr.port()));
            assert_eq!(address_of(uri.host().expect("host")), Some(addr.ip()));
        }
    }

    #[test]
    fn runs_and_sandboxes_never_share_an_authority() {
        let addr: SocketAddr = "10.11.0.2:49983".parse().expect("addr");
        let a = authority("isbx", "exec-1", addr);
        assert_eq!(a, authority("isbx", "exec-1", addr));
        assert_ne!(a, authority("isbx", "exec-2", addr));
        assert_ne!(a, authority("other", "exec-1", addr));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(authority("ab", "c", addr), authority("a", "bc", addr));
        let moved: SocketAddr = "10.11.0.6:49983".parse().expect("addr");
        assert_ne!(a, authority("isbx", "exec-1", moved));
    }

    #[test]
    fn other_names_are_not_resolved() {
        for h in [
            "example.com",
            "0a0b0002.run.example",
            "zz0b0002.x.run",
            "0a0b00.x.run",
            "",
        ] {
            assert_eq!(address_of(h), None, "{h}");
        }
    }
}
