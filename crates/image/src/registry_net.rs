//! Registry pulls vetted like webhooks: the registry's host, and every host a pull goes to on
//! the way (a token service, blob storage a registry redirects to), is resolved and its
//! addresses vetted: private, shared, loopback and link-local ranges and this host's own
//! addresses only where the operator lists them (`registry_allow`, CIDRs; empty by default).
//!
//! skopeo runs in a network namespace of its own that has only `lo` ([`PullNet`]). In it the
//! node listens on loopback for two things, served from the host's namespace:
//! - an HTTP proxy (`CONNECT host:port`, and absolute-form requests for plain-HTTP
//!   registries) that skopeo gets as `HTTPS_PROXY`/`HTTP_PROXY`: it resolves each destination
//!   itself, connects only to vetted addresses, and answers 403 otherwise;
//! - when the registry is on loopback (Go never proxies loopback or `localhost`), a forward of
//!   the registry's port on 127.0.0.1 and ::1 to its vetted address.
//!
//! Nothing else is reachable from the namespace: a redirect to another loopback port finds
//! nothing listening there, and any other address goes through the proxy's vetting.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use vmon_proto::addrs::{reachable, Cidr};

use crate::oci::RegistryError;

/// Longest request head the proxy reads.
const MAX_HEAD: usize = 16 << 10;
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Which addresses a pull may reach.
#[derive(Debug, Clone, Default)]
pub struct RegistryPolicy {
    allow: Vec<Cidr>,
}

impl RegistryPolicy {
    /// `allow`: CIDRs (or addresses) the operator opens besides the public internet.
    pub fn new(allow: &[String]) -> Result<RegistryPolicy, String> {
        let allow = allow
            .iter()
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.parse())
            .collect::<Result<Vec<Cidr>, String>>()
            .map_err(|e| format!("registry_allow: {e}"))?;
        Ok(RegistryPolicy { allow })
    }

    /// Whether a pull may connect to `ip`.
    pub fn allowed(&self, ip: IpAddr) -> bool {
        reachable(&self.allow, ip)
    }

    /// The addresses of `host` (a name or an IP literal, IPv6 in brackets or not), all of
    /// which must be allowed: a name with one refused address is refused whole (its other
    /// addresses could be chosen later).
    pub async fn vet(&self, host: &str) -> Result<Vec<IpAddr>, String> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addrs = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => {
                let q = tokio::net::lookup_host(format!("{host}:0"));
                match tokio::time::timeout(RESOLVE_TIMEOUT, q).await {
                    Ok(Ok(it)) => it.map(|a| a.ip()).take(64).collect(),
                    Ok(Err(e)) => return Err(format!("{host} does not resolve: {e}")),
                    Err(_) => return Err(format!("resolving {host} timed out")),
                }
            }
        };
        if addrs.is_empty() {
            return Err(format!("{host} does not resolve"));
        }
        if let Some(bad) = addrs.iter().find(|a| !self.allowed(**a)) {
            return Err(format!(
                "{host} is (or resolves to) {bad}, an address on this host or a private, \
                 loopback or link-local network; the operator can allow it with \
                 registry_allow (VMON_REGISTRY_ALLOW)"
            ));
        }
        Ok(addrs)
    }

    /// A connection to `host:port` at one of its vetted addresses.
    async fn connect(&self, host: &str, port: u16) -> Result<TcpStream, Failure> {
        let addrs = self.vet(host).await.map_err(Failure::Refused)?;
        let mut last = format!("{host}:{port} is unreachable");
        for ip in addrs {
            let to = SocketAddr::new(ip, port);
            match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(to)).await {
                Ok(Ok(s)) => return Ok(s),
                Ok(Err(e)) => last = format!("connecting to {to}: {e}"),
                Err(_) => last = format!("connecting to {to} timed out"),
            }
        }
        Err(Failure::Unreachable(last))
    }
}

/// Why a connection of the pull's was not made.
#[derive(Debug)]
enum Failure {
    /// The policy refuses the destination: what the build's error says.
    Refused(String),
    /// Allowed, but it did not answer (skopeo reports that itself).
    Unreachable(String),
}

/// `host[:port]` of a registry or a proxy target: the host (brackets kept off) and the port.
pub fn split_host_port(s: &str) -> (String, Option<u16>) {
    if let Some(rest) = s.strip_prefix('[') {
        if let Some((h, tail)) = rest.split_once(']') {
            let port = tail.strip_prefix(':').and_then(|p| p.parse().ok());
            return (h.to_string(), port);
        }
    }
    match s.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => match p.parse() {
            Ok(port) => (h.to_string(), Some(port)),
            Err(_) => (s.to_string(), None),
        },
        _ => (s.to_string(), None),
    }
}

/// The network namespace one skopeo run lives in, and the node's listeners in it. Dropping it
/// stops the listeners; the namespace goes with its last socket and skopeo.
pub struct PullNet {
    netns: OwnedFd,
    proxy: SocketAddr,
    refusals: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for PullNet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl PullNet {
    /// Vets `registry` (`host[:port]`) before anything connects to it (an error names the
    /// address and the setting that opens it), then makes the namespace and its listeners.
    pub async fn open(policy: RegistryPolicy, registry: &str) -> Result<PullNet, RegistryError> {
        let (host, port) = split_host_port(registry);
        let addrs = policy
            .vet(&host)
            .await
            .map_err(|e| RegistryError(format!("the registry {registry} is refused: {e}")))?;
        // Go dials loopback registries directly (no proxy): forward their ports.
        let forwards: Vec<u16> = if host == "localhost" || addrs.iter().any(|a| a.is_loopback()) {
            port.map_or_else(|| vec![443, 80], |p| vec![p])
        } else {
            Vec::new()
        };
        let mut binds = vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 0))];
        for p in &forwards {
            binds.push(SocketAddr::from((Ipv4Addr::LOCALHOST, *p)));
            binds.push(SocketAddr::from((Ipv6Addr::LOCALHOST, *p)));
        }
        let (netns, listeners) = std::thread::spawn(move || namespace_with(&binds))
            .join()
            .map_err(|_| RegistryError("making the pull's network namespace panicked".into()))?
            .map_err(|e| {
                RegistryError(format!(
                    "making the pull's network namespace (root needed): {e}"
                ))
            })?;
        let policy = Arc::new(policy);
        let refusals = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        let mut proxy = None;
        for l in listeners {
            let l = TcpListener::from_std(l).map_err(|e| RegistryError(e.to_string()))?;
            let local = l.local_addr().map_err(|e| RegistryError(e.to_string()))?;
            let (policy, refusals) = (policy.clone(), refusals.clone());
            if proxy.is_none() {
                proxy = Some(local);
                tasks.push(tokio::spawn(serve(l, policy, refusals, None)));
            } else {
                let target = (host.clone(), local.port());
                tasks.push(tokio::spawn(serve(l, policy, refusals, Some(target))));
            }
        }
        let proxy = proxy.ok_or_else(|| RegistryError("no proxy listener".into()))?;
        Ok(PullNet {
            netns,
            proxy,
            refusals,
            tasks,
        })
    }

    /// The namespace skopeo joins (`setns` between fork and exec).
    pub fn netns_fd(&self) -> RawFd {
        self.netns.as_raw_fd()
    }

    /// The proxy skopeo is given (`HTTPS_PROXY`, `HTTP_PROXY`).
    pub fn proxy_url(&self) -> String {
        format!("http://{}", self.proxy)
    }

    /// Why the proxy or a forward refused destinations during the run, if it did.
    pub fn refusal(&self) -> Option<String> {
        let r = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        r.first().cloned()
    }
}

/// On this (fresh) thread: a new network namespace with `lo` up, listening on `binds` (an
/// address IPv6 cannot take is left out), and the namespace's fd.
fn namespace_with(binds: &[SocketAddr]) -> io::Result<(OwnedFd, Vec<std::net::TcpListener>)> {
    // SAFETY: unshare affects only this thread's network namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    loopback_up()?;
    let ns: OwnedFd = std::fs::File::open("/proc/thread-self/ns/net")?.into();
    let mut out = Vec::new();
    for (i, a) in binds.iter().enumerate() {
        match std::net::TcpListener::bind(a) {
            Ok(l) => {
                l.set_nonblocking(true)?;
                out.push(l);
            }
            Err(e) if i > 0 && a.is_ipv6() => {
                tracing::debug!(addr = %a, error = %e, "no IPv6 loopback in the pull's namespace");
            }
            Err(e) => return Err(e),
        }
    }
    Ok((ns, out))
}

/// Sets `lo` up in this thread's network namespace.
fn loopback_up() -> io::Result<()> {
    // SAFETY: a plain socket for the interface ioctls, closed by OwnedFd.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh socket we own.
    let sock = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write `req`, which outlives the calls.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Accepts on `l`: as the proxy (`forward` None) or as a forward to `forward`'s host and port.
async fn serve(
    l: TcpListener,
    policy: Arc<RegistryPolicy>,
    refusals: Arc<Mutex<Vec<String>>>,
    forward: Option<(String, u16)>,
) {
    loop {
        let Ok((conn, _)) = l.accept().await else {
            return;
        };
        let (policy, refusals, forward) = (policy.clone(), refusals.clone(), forward.clone());
        tokio::spawn(async move {
            let r = match forward {
                Some((host, port)) => forward_to(conn, &policy, &host, port).await,
                None => proxy(conn, &policy).await,
            };
            match r {
                Ok(()) => {}
                Err(Failure::Refused(e)) => {
                    tracing::info!(error = %e, "a registry pull's connection was refused");
                    refusals.lock().unwrap_or_else(|p| p.into_inner()).push(e);
                }
                Err(Failure::Unreachable(e)) => {
                    tracing::debug!(error = %e, "a registry pull's destination did not answer");
                }
            }
        });
    }
}

async fn forward_to(
    mut conn: TcpStream,
    policy: &RegistryPolicy,
    host: &str,
    port: u16,
) -> Result<(), Failure> {
    let mut up = policy.connect(host, port).await?;
    let _ = tokio::io::copy_bidirectional(&mut conn, &mut up).await;
    Ok(())
}

/// One proxy connection: `CONNECT host:port`, or one absolute-form `http://` request (sent on
/// with `Connection: close`, so the next request, maybe to another host, comes on a new
/// connection and is vetted again).
async fn proxy(mut conn: TcpStream, policy: &RegistryPolicy) -> Result<(), Failure> {
    let (head, rest) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut conn)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return Err(Failure::Refused(format!("a bad proxy request: {e}"))),
        Err(_) => return Err(Failure::Refused("a proxy request's head timed out".into())),
    };
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut words = text.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let (authority, default_port, rewrite) = if method.eq_ignore_ascii_case("CONNECT") {
        (target.to_string(), 443, false)
    } else if let Some(after) = target.strip_prefix("http://") {
        (after.split('/').next().unwrap_or("").to_string(), 80, true)
    } else {
        let _ = conn
            .write_all(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\r\n")
            .await;
        return Err(Failure::Refused(format!("a proxy request for {target:?}")));
    };
    let (host, port) = split_host_port(&authority);
    let port = port.unwrap_or(default_port);
    let mut up = match policy.connect(&host, port).await {
        Ok(s) => s,
        Err(failure) => {
            let (status, e) = match &failure {
                Failure::Refused(e) => ("403 Forbidden", e),
                Failure::Unreachable(e) => ("502 Bad Gateway", e),
            };
            let body = format!("vmon: {e}\n");
            let _ = conn
                .write_all(
                    format!(
                        "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
            return Err(failure);
        }
    };
    let gone = |e: io::Error| Failure::Unreachable(e.to_string());
    if rewrite {
        up.write_all(&close_after(&text).into_bytes())
            .await
            .map_err(gone)?;
    } else {
        conn.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await
            .map_err(gone)?;
    }
    up.write_all(&rest).await.map_err(gone)?;
    let _ = tokio::io::copy_bidirectional(&mut conn, &mut up).await;
    Ok(())
}

/// Reads a request head (up to the blank line, at most [`MAX_HEAD`]): the head and what came
/// after it.
async fn read_head(conn: &mut TcpStream) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(io::Error::other("request head too long"));
        }
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::Error::other("closed before the request head ended"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// A request head with its connection headers replaced by `Connection: close`.
fn close_after(head: &str) -> String {
    let mut out = String::with_capacity(head.len() + 20);
    for line in head.split("\r\n").filter(|l| !l.is_empty()) {
        let name = line.split(':').next().unwrap_or("").trim();
        if ["connection", "proxy-connection", "keep-alive"]
            .iter()
            .any(|h| name.eq_ignore_ascii_case(h))
        {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_port_of_registries() {
        for (s, h, p) in [
            ("127.0.0.1:5000", "127.0.0.1", Some(5000)),
            ("registry.example.com", "registry.example.com", None),
            ("[::1]:5000", "::1", Some(5000)),
            ("[::1]", "::1", None),
            ("::1", "::1", None),
            ("localhost:80", "localhost", Some(80)),
        ] {
            assert_eq!(split_host_port(s), (h.to_string(), p), "{s}");
        }
    }

    #[test]
    fn private_and_own_addresses_need_the_operator() {
        let closed = RegistryPolicy::default();
        for bad in ["127.0.0.1", "10.0.0.1", "169.254.169.254", "::1", "fd00::1"] {
            assert!(!closed.allowed(bad.parse().expect("ip")), "{bad}");
        }
        assert!(closed.allowed("93.184.216.34".parse().expect("ip")));
        let open = RegistryPolicy::new(&["127.0.0.1/32".into()]).expect("policy");
        assert!(open.allowed("127.0.0.1".parse().expect("ip")));
        assert!(!open.allowed("127.0.0.2".parse().expect("ip")));
        assert!(RegistryPolicy::new(&["nope".into()]).is_err());
    }

    #[test]
    fn forwarded_requests_close_their_connection() {
        let head = "GET http://r/v2/ HTTP/1.1\r\nHost: r\r\nProxy-Connection: keep-alive\r\nConnection: keep-alive\r\n\r\n";
        assert_eq!(
            close_after(head),
            "GET http://r/v2/ HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n"
        );
    }
}
