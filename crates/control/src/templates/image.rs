//! Builds from an image in an OCI registry (`from_image(...)`, a Dockerfile's `FROM`): which
//! registry the reference names, whether it may be spoken to over plain HTTP, the login the
//! trigger carried, and the first layer's key (the reference and the digest it resolved to).

use std::net::IpAddr;

use serde_json::Value;
use sha2::{Digest, Sha256};
use vmon_proto::node::{OciImage, RegistryCredentials};

pub use crate::config::DEFAULT_INSECURE;

/// Whether `registry` (`host[:port]`) is one of `insecure`: an entry is a host, a
/// `host:port`, an IP address or a CIDR range.
pub fn allows_plain_http(insecure: &[String], registry: &str) -> bool {
    let (host, _port) = split_host_port(registry);
    let ip: Option<IpAddr> = host.parse().ok();
    insecure.iter().any(|entry| {
        let entry = entry.trim();
        if entry.eq_ignore_ascii_case(registry) || entry.eq_ignore_ascii_case(host) {
            return true;
        }
        match (ip, entry.split_once('/')) {
            (Some(ip), Some((net, bits))) => in_range(ip, net, bits),
            (Some(ip), None) => entry.parse::<IpAddr>().is_ok_and(|e| e == ip),
            _ => false,
        }
    })
}

/// `host[:port]` split, with `[v6]:port` and a bare v6 address understood.
fn split_host_port(registry: &str) -> (&str, Option<&str>) {
    if let Some(rest) = registry.strip_prefix('[') {
        if let Some((h, tail)) = rest.split_once(']') {
            return (h, tail.strip_prefix(':'));
        }
    }
    if registry.matches(':').count() > 1 {
        return (registry, None);
    }
    match registry.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (registry, None),
    }
}

fn in_range(ip: IpAddr, net: &str, bits: &str) -> bool {
    let (Ok(net), Ok(bits)) = (net.parse::<IpAddr>(), bits.parse::<u32>()) else {
        return false;
    };
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) if bits <= 32 => {
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - bits)
            };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) if bits <= 128 => {
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// The login of `fromImageRegistry`: only the `registry` type (username and password);
/// AWS and GCP logins are refused with a sentence saying so.
pub fn credentials(v: Option<&Value>) -> Result<Option<RegistryCredentials>, String> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    match s("type").as_deref() {
        Some("registry") => match (s("username"), s("password")) {
            (Some(username), Some(password)) => {
                Ok(Some(RegistryCredentials { username, password }))
            }
            _ => Err("fromImageRegistry of type registry needs a username and a password".into()),
        },
        Some(other @ ("aws" | "gcp")) => Err(format!(
            "fromImageRegistry of type {other} is not supported by vmon: give a registry login \
             (type registry, username and password)"
        )),
        _ => Err("fromImageRegistry must have type registry, aws or gcp".into()),
    }
}

/// The image a build names, with its registry's transport decided.
pub fn image(
    reference: &str,
    registry_login: Option<&Value>,
    insecure: &[String],
) -> Result<(OciImage, String), String> {
    let mut image = OciImage {
        reference: reference.to_string(),
        digest: None,
        credentials: credentials(registry_login)?,
        tls_verify: true,
        registry_allow: Vec::new(),
    };
    let (registry, _) = image
        .qualified()
        .ok_or_else(|| format!("{reference:?} is not an image reference"))?;
    image.tls_verify = !allows_plain_http(insecure, &registry);
    Ok((image, registry))
}

/// The first layer's key of a build from an image: the reference, the digest it names now,
/// and the machine (a tag that moves is a new digest, so a new layer).
pub fn base_key(reference: &str, digest: &str, vcpus: u32, memory_mb: u32) -> String {
    let mut h = Sha256::new();
    h.update(format!("oci\0{reference}\0{digest}\0{vcpus}\0{memory_mb}"));
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> Vec<String> {
        DEFAULT_INSECURE.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_loopback_and_listed_registries_may_use_plain_http() {
        let d = defaults();
        assert!(allows_plain_http(&d, "127.0.0.1:5000"));
        assert!(allows_plain_http(&d, "127.3.2.1"));
        assert!(allows_plain_http(&d, "localhost:5000"));
        assert!(allows_plain_http(&d, "[::1]:5000"));
        assert!(!allows_plain_http(&d, "registry.example.com"));
        assert!(!allows_plain_http(&d, "10.0.0.5:5000"));
        assert!(!allows_plain_http(&d, "docker.io"));
        let listed = vec!["registry.lan:5000".to_string(), "10.0.0.0/8".to_string()];
        assert!(allows_plain_http(&listed, "registry.lan:5000"));
        assert!(!allows_plain_http(&listed, "registry.lan:6000"));
        assert!(allows_plain_http(&listed, "10.1.2.3:5000"));
        assert!(!allows_plain_http(&listed, "127.0.0.1:5000"));
    }

    #[test]
    fn registry_logins_are_read_and_other_kinds_refused() {
        let c = credentials(Some(
            &serde_json::json!({"type":"registry","username":"u","password":"p"}),
        ))
        .expect("accepted")
        .expect("accepted");
        assert_eq!((c.username.as_str(), c.password.as_str()), ("u", "p"));
        assert!(credentials(None).expect("accepted").is_none());
        let e = credentials(Some(
            &serde_json::json!({"type":"aws","awsAccessKeyId":"k"}),
        ))
        .expect_err("refused");
        assert!(e.contains("aws"), "{e}");
        assert!(credentials(Some(&serde_json::json!({"type":"registry","username":"u"}))).is_err());
    }

    #[test]
    fn a_login_in_a_trigger_never_shows_in_debug() {
        let start: crate::templates::steps::BuildStart =
            serde_json::from_value(serde_json::json!({
                "fromImage": "127.0.0.1:5000/x:1",
                "fromImageRegistry": {"type": "registry", "username": "u", "password": "hunter2"},
            }))
            .expect("accepted");
        assert!(!format!("{start:?}").contains("hunter2"));
        let login = start.from_image_registry.as_ref().map(|l| &l.0);
        let c = credentials(login).expect("accepted").expect("a login");
        assert!(!format!("{c:?}").contains("hunter2"));
    }

    #[test]
    fn an_image_reference_decides_its_transport() {
        let (img, reg) = image("127.0.0.1:5000/test/img:1", None, &defaults()).expect("accepted");
        assert_eq!(reg, "127.0.0.1:5000");
        assert!(!img.tls_verify);
        let (img, reg) = image("ghcr.io/o/a:1", None, &defaults()).expect("accepted");
        assert_eq!(reg, "ghcr.io");
        assert!(img.tls_verify);
        assert!(image("not a ref", None, &defaults()).is_err());
    }
}
