//! `PUT /sandboxes/{id}/network`: replaces a running sandbox's egress rules on its node and in
//! its record, and reports the change as `sandbox.lifecycle.updated`.

use std::net::IpAddr;

use super::model::NetworkUpdate;
use super::{event, network_policy, Control};
use super::{ControlError, ControlResult};
use crate::records::{Change, EventKind, SandboxState, Team};

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

pub(crate) fn validate(update: &NetworkUpdate) -> ControlResult<()> {
    for (field, list) in [
        ("allowOut", &update.allow_out),
        ("denyOut", &update.deny_out),
    ] {
        let list = list.as_deref().unwrap_or_default();
        if list.len() > MAX_RULES {
            return Err(ControlError::bad_request(format!(
                "{field} may hold at most {MAX_RULES} entries"
            )));
        }
        if let Some(bad) = list.iter().find(|e| {
            let e = e.trim();
            !valid_cidr(e) && !vmon_proto::node::is_host_name(e)
        }) {
            return Err(ControlError::bad_request(format!(
                "{field} entry {bad:?} is not an IP address, CIDR block or host name"
            )));
        }
    }
    let dns = update.dns_servers.as_deref().unwrap_or_default();
    if let Some(bad) = dns
        .iter()
        .find(|d| !d.trim().parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv4()))
    {
        return Err(ControlError::bad_request(format!(
            "dnsServers entry {bad:?} is not an IPv4 address"
        )));
    }
    Ok(())
}

/// `allowOut` entries inside a private or shared range stand only inside the operator's
/// `private_allow` (400 naming the entry); host names are judged by the IPv4 addresses the
/// host's resolver gives now (the node resolves and checks again whenever it writes rules).
pub(crate) async fn check_private(
    allow_out: &[String],
    private_allow: &[String],
) -> ControlResult<()> {
    use vmon_proto::ranges::{check_private, parse_cidr};
    for e in allow_out.iter().map(|e| e.trim()) {
        if parse_cidr(e).is_some() {
            check_private(e, e, private_allow).map_err(ControlError::bad_request)?;
        } else if vmon_proto::node::is_host_name(e) {
            for a in resolve_v4(e).await {
                check_private(&a.to_string(), e, private_allow)
                    .map_err(ControlError::bad_request)?;
            }
        }
    }
    Ok(())
}

/// The IPv4 addresses of `name` (5 s bound; none when it does not resolve).
async fn resolve_v4(name: &str) -> Vec<std::net::Ipv4Addr> {
    let lookup = tokio::net::lookup_host(format!("{name}:0"));
    match tokio::time::timeout(std::time::Duration::from_secs(5), lookup).await {
        Ok(Ok(addrs)) => addrs
            .filter_map(|a| match a.ip() {
                IpAddr::V4(v4) => Some(v4),
                IpAddr::V6(_) => None,
            })
            .take(64)
            .collect(),
        _ => Vec::new(),
    }
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
    ) -> ControlResult<()> {
        validate(&update)?;
        check_private(
            update.allow_out.as_deref().unwrap_or_default(),
            &self.config.private_allow,
        )
        .await?;
        self.owned(team, id).await?;
        let guard = self.lock(id).await?;
        let result = async {
            let mut rec = self.owned(team, id).await?;
            if rec.state != SandboxState::Running {
                return Err(ControlError::conflict(format!(
                    "sandbox {id} is paused; resume it before changing its network"
                )));
            }
            // Secret rules stay pointed at hosts the sandbox may reach: a rule host cannot
            // leave allowOut while the rules name it.
            super::egress::checked_rules(&super::model::NetworkConfig {
                allow_out: trimmed(update.allow_out.clone()),
                rules: rec.network.rules.clone(),
                ..Default::default()
            })?;
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
}
