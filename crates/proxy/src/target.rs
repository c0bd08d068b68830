//! Which sandbox and port a request is for: by the `E2b-Sandbox-Id` / `E2b-Sandbox-Port`
//! headers (shared host: `localhost`, an IP literal or `sandbox.<domain>`), or by a
//! `{port}-{sandboxID}.{domain}` Host.

use std::net::IpAddr;

use http::HeaderMap;

pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub sandbox_id: String,
    pub port: u16,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TargetError {
    #[error("the request names no sandbox: send E2b-Sandbox-Id and E2b-Sandbox-Port, or use a {{port}}-{{sandboxID}}.{{domain}} host")]
    Missing,
    #[error("invalid sandbox port {0:?}")]
    BadPort(String),
    #[error("invalid sandbox id {0:?}")]
    BadId(String),
}

/// `host` is the request's Host (or :authority), port included or not.
pub fn resolve(host: Option<&str>, headers: &HeaderMap) -> Result<Target, TargetError> {
    let hostname = host.map(strip_port).unwrap_or("");
    let shared_host = hostname.is_empty()
        || hostname.eq_ignore_ascii_case("localhost")
        || hostname.parse::<IpAddr>().is_ok()
        || hostname
            .get(..8)
            .is_some_and(|p| p.eq_ignore_ascii_case("sandbox."));
    if !shared_host {
        if let Some(t) = from_host(hostname)? {
            return Ok(t);
        }
    }
    from_headers(headers)?.ok_or(TargetError::Missing)
}

fn from_headers(headers: &HeaderMap) -> Result<Option<Target>, TargetError> {
    let id = headers.get(SANDBOX_ID_HEADER).and_then(|v| v.to_str().ok());
    let port = headers
        .get(SANDBOX_PORT_HEADER)
        .and_then(|v| v.to_str().ok());
    match (id, port) {
        (Some(id), Some(port)) => {
            let port = port
                .trim()
                .parse::<u16>()
                .map_err(|_| TargetError::BadPort(port.to_string()))?;
            Ok(Some(Target {
                sandbox_id: checked_id(id.trim())?,
                port,
            }))
        }
        _ => Ok(None),
    }
}

fn from_host(hostname: &str) -> Result<Option<Target>, TargetError> {
    let label = hostname.split('.').next().unwrap_or("");
    let Some((port, id)) = label.split_once('-') else {
        return Ok(None);
    };
    let Ok(port) = port.parse::<u16>() else {
        return Ok(None);
    };
    Ok(Some(Target {
        sandbox_id: checked_id(&id.to_ascii_lowercase())?,
        port,
    }))
}

fn checked_id(id: &str) -> Result<String, TargetError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(id.to_string())
    } else {
        Err(TargetError::BadId(id.chars().take(64).collect()))
    }
}

fn strip_port(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        // [::1]:3001
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(id: &str, port: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(SANDBOX_ID_HEADER, id.parse().expect("header"));
        h.insert(SANDBOX_PORT_HEADER, port.parse().expect("header"));
        h
    }

    #[test]
    fn headers_on_shared_hosts() {
        let h = headers("iabc", "49983");
        for host in [
            "127.0.0.1:3001",
            "localhost",
            "[::1]:3001",
            "sandbox.example.com",
        ] {
            assert_eq!(
                resolve(Some(host), &h),
                Ok(Target {
                    sandbox_id: "iabc".into(),
                    port: 49983
                }),
                "{host}"
            );
        }
        assert_eq!(
            resolve(Some("localhost"), &HeaderMap::new()),
            Err(TargetError::Missing)
        );
        assert!(matches!(
            resolve(Some("localhost"), &headers("iabc", "x")),
            Err(TargetError::BadPort(_))
        ));
    }

    #[test]
    fn port_and_id_in_host() {
        assert_eq!(
            resolve(Some("8080-iabc123.vmon.local:3001"), &HeaderMap::new()),
            Ok(Target {
                sandbox_id: "iabc123".into(),
                port: 8080
            })
        );
        // A host that does not name a sandbox falls back to the headers.
        assert_eq!(
            resolve(Some("proxy.internal"), &headers("iq", "1")),
            Ok(Target {
                sandbox_id: "iq".into(),
                port: 1
            })
        );
        assert!(matches!(
            resolve(Some("80-i$x.d"), &HeaderMap::new()),
            Err(TargetError::BadId(_))
        ));
    }
}
