//! `PUT /sandboxes/{id}/network`: replaces a running sandbox's egress rules on its node and in
//! its record, and reports the change as `sandbox.lifecycle.updated`.

use std::net::IpAddr;

use super::{event, network_policy, Control};
use crate::error::{ApiError, ApiResult};
use crate::records::{Change, EventKind, SandboxState, Team};
use crate::wire::NetworkUpdate;

/// More rules than this is a mistake, not a policy.
const MAX_RULES: usize = 1000;

/// `ip` or `ip/prefix`.
fn valid_cidr(s: &str) -> bool {
    let (ip, prefix) = match s.split_once('/') {
        Some((ip, p)) => (ip, Some(p)),
        None => (s, None),
    };
    let Ok(ip) = ip.parse::<IpAddr>() else {
        return false;
    };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    prefix.is_none_or(|p| p.parse::<u8>().is_ok_and(|p| p <= max))
}

pub(crate) fn validate(update: &NetworkUpdate) -> ApiResult<()> {
    for (field, list) in [
        ("allowOut", &update.allow_out),
        ("denyOut", &update.deny_out),
    ] {
        let list = list.as_deref().unwrap_or_default();
        if list.len() > MAX_RULES {
            return Err(ApiError::bad_request(format!(
                "{field} may hold at most {MAX_RULES} entries"
            )));
        }
        if let Some(bad) = list.iter().find(|e| {
            let e = e.trim();
            !valid_cidr(e) && !vmon_proto::node::is_host_name(e)
        }) {
            return Err(ApiError::bad_request(format!(
                "{field} entry {bad:?} is not an IP address, CIDR block or host name"
            )));
        }
    }
    let dns = update.dns_servers.as_deref().unwrap_or_default();
    if let Some(bad) = dns
        .iter()
        .find(|d| !d.trim().parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv4()))
    {
        return Err(ApiError::bad_request(format!(
            "dnsServers entry {bad:?} is not an IPv4 address"
        )));
    }
    Ok(())
}

fn trimmed(list: Option<Vec<String>>) -> Option<Vec<String>> {
    list.map(|l| l.into_iter().map(|e| e.trim().to_string()).collect())
}

impl Control {
    /// Replace-all: a field left out is cleared (internet access then defaults to allowed).
    pub async fn update_network(
        &self,
        team: &Team,
        id: &str,
        update: NetworkUpdate,
    ) -> ApiResult<()> {
        validate(&update)?;
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = async {
            let mut rec = self.owned(team, id).await?;
            if rec.state != SandboxState::Running {
                return Err(ApiError::conflict(format!(
                    "sandbox {id} is paused; resume it before changing its network"
                )));
            }
            rec.network.allow_out = trimmed(update.allow_out);
            rec.network.deny_out = trimmed(update.deny_out);
            rec.network.dns_servers = trimmed(update.dns_servers);
            rec.allow_internet_access = update.allow_internet_access;
            self.node
                .update_network(&rec.id, &rec.execution_id, network_policy(&rec))
                .await?;
            let updated = event(
                &rec,
                EventKind::Updated,
                serde_json::json!({ "network": {
                    "allowOut": rec.network.allow_out,
                    "denyOut": rec.network.deny_out,
                    "dnsServers": rec.network.dns_servers,
                    "allowInternetAccess": rec.allow_internet_access,
                }}),
            );
            self.commit(
                Change::update(&rec, &rec.execution_id),
                updated,
                guard.fence().token(),
            )
            .await?;
            tracing::info!(sandbox_id = %rec.id, "sandbox network updated");
            Ok(())
        }
        .await;
        let _ = guard.unlock().await;
        result
    }
}

/// The secret names `${e2b.secrets.<name>}` markers name anywhere in `rules`.
pub(crate) fn secret_markers(rules: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::String(s) => {
                let mut rest = s.as_str();
                while let Some(i) = rest.find("${e2b.secrets.") {
                    rest = &rest[i + "${e2b.secrets.".len()..];
                    let Some(end) = rest.find('}') else { break };
                    out.push(rest[..end].to_string());
                    rest = &rest[end..];
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            serde_json::Value::Object(o) => o.values().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(rules, &mut out);
    out.sort();
    out.dedup();
    out
}

impl Control {
    /// A create whose network rules name secrets: unknown names are 400 (as in infra); known
    /// ones are 400 too, because vmon has no egress proxy to put them into requests, and a
    /// sandbox started without the header its owner asked for would fail in a worse place.
    pub(crate) async fn refuse_secret_rules(
        &self,
        team_id: &str,
        network: Option<&crate::wire::NetworkConfig>,
    ) -> ApiResult<()> {
        let Some(rules) = network.and_then(|n| n.rules.as_ref()) else {
            return Ok(());
        };
        let names = secret_markers(rules);
        if names.is_empty() {
            return Ok(());
        }
        for name in &names {
            let known = self
                .records
                .secret(team_id, name)
                .await
                .map_err(super::record_error)?;
            if known.is_none() {
                return Err(ApiError::bad_request(format!(
                    "network rules name the unknown secret {name:?}"
                )));
            }
        }
        Err(ApiError::bad_request(
            "secret injection (${e2b.secrets.<name>} in network rules) needs an egress proxy, \
             which this vmon does not have; the sandbox was not created",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs() {
        for ok in ["8.8.8.8", "10.0.0.0/8", "0.0.0.0/0", "::1", "2001:db8::/32"] {
            assert!(valid_cidr(ok), "{ok}");
        }
        for bad in [
            "example.com",
            "10.0.0.0/33",
            "1.2.3",
            "",
            "::/129",
            "1.1.1.1/x",
        ] {
            assert!(!valid_cidr(bad), "{bad}");
        }
    }

    #[test]
    fn secret_markers_are_found_anywhere_in_the_rules() {
        let rules = serde_json::json!({"a.example.com": [{"transform": {"headers": {
            "Authorization": "Bearer ${e2b.secrets.one}",
            "X-Both": "${e2b.secrets.two}:${e2b.secrets.one}",
            "X-Open": "${e2b.secrets.unterminated"
        }}}]});
        assert_eq!(super::secret_markers(&rules), ["one", "two"]);
        assert!(super::secret_markers(&serde_json::json!({"h": [{"transform": {}}]})).is_empty());
    }
}
