//! What the proxy changes in the headers it passes on.

use std::time::Duration;

use http::{header, HeaderValue, Method, Request};

use crate::Target;

/// Envd sends a keepalive on its streams (commands, watches) as often as the client asks in
/// `keepalive-ping-interval`, 90 s when it does not ask. The proxy asks for at most half its
/// idle-body timeout, so a quiet command (`sleep 600`) is never taken for a stalled guest.
pub(crate) fn envd_keepalive_within(headers: &mut http::HeaderMap, idle: Duration) {
    const ENVD_DEFAULT_SECS: u64 = 90;
    if idle.is_zero() {
        return;
    }
    let most = (idle.as_secs() / 2).max(1);
    let asked = headers
        .get("keepalive-ping-interval")
        .map(|v| v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()));
    let fits = match asked {
        Some(Some(s)) => s > 0 && s <= most,
        Some(None) => false,
        None => ENVD_DEFAULT_SECS <= most,
    };
    if !fits {
        headers.insert("keepalive-ping-interval", HeaderValue::from(most));
    }
}

pub(crate) fn upstream_uri(authority: &str, uri: &http::Uri) -> Result<http::Uri, http::Error> {
    let pq = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    http::Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query(pq)
        .build()
}

/// HTTP/2 requests carry no Host; services in the guest still expect one.
pub(crate) fn keep_host(headers: &mut http::HeaderMap, target: &Target) {
    if !headers.contains_key(header::HOST) {
        if let Ok(v) = HeaderValue::from_str(&format!("{}-{}", target.port, target.sandbox_id)) {
            headers.insert(header::HOST, v);
        }
    }
}

pub(crate) fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    // Headers named by Connection are hop-by-hop too.
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    for name in named {
        headers.remove(name.as_str());
    }
    for name in [
        header::CONNECTION,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove("proxy-connection");
}

pub(crate) fn is_upgrade<B>(req: &Request<B>) -> bool {
    req.method() != Method::CONNECT
        && req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envd_is_asked_for_keepalives_within_the_idle_timeout() {
        let ask = |asked: Option<&str>, idle: u64| {
            let mut h = http::HeaderMap::new();
            if let Some(a) = asked {
                h.insert("keepalive-ping-interval", a.parse().expect("value"));
            }
            envd_keepalive_within(&mut h, Duration::from_secs(idle));
            h.get("keepalive-ping-interval")
                .map(|v| v.to_str().expect("ascii").to_string())
        };
        // The SDKs' 50 s and envd's default 90 s fit in the default 600 s.
        assert_eq!(ask(Some("50"), 600).as_deref(), Some("50"));
        assert_eq!(ask(None, 600), None);
        // Longer than half the timeout, zero, garbage: half the timeout.
        assert_eq!(ask(Some("1000"), 600).as_deref(), Some("300"));
        assert_eq!(ask(Some("0"), 600).as_deref(), Some("300"));
        assert_eq!(ask(Some("x"), 600).as_deref(), Some("300"));
        // A short timeout makes envd's default too long.
        assert_eq!(ask(None, 60).as_deref(), Some("30"));
        // No timeout: left alone.
        assert_eq!(ask(Some("1000"), 0).as_deref(), Some("1000"));
    }
}
