//! Secret injection: a sandbox's `network.rules` turned into the [`EgressSpec`] its node's
//! egress proxy applies (rules checked, hosts in `allowOut`, the named secrets' current values
//! opened from the store), at every start, and again for running sandboxes when a secret they
//! name changes.

use vmon_proto::egress::{parse_rules, secret_names, EgressSpec, SecretValues};

use super::model::NetworkConfig;
use super::{record_error, Control};
use super::{ControlError, ControlResult};
use crate::records::SandboxState;

/// The rules of `network`, checked: each rule host must also be in `allowOut` (the egress
/// proxy reaches only what the sandbox itself may reach).
pub(crate) fn checked_rules(
    network: &NetworkConfig,
) -> ControlResult<Vec<vmon_proto::egress::HostRule>> {
    let Some(rules) = network.rules.as_ref() else {
        return Ok(Vec::new());
    };
    let rules = parse_rules(rules).map_err(ControlError::bad_request)?;
    let allow: Vec<String> = network
        .allow_out
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|e| e.trim().to_ascii_lowercase())
        .collect();
    if let Some(r) = rules.iter().find(|r| !allow.contains(&r.host)) {
        return Err(ControlError::bad_request(format!(
            "network.rules names {:?}, which allowOut does not: a rule host must also be in allowOut",
            r.host
        )));
    }
    Ok(rules)
}

impl Control {
    /// The egress spec of a sandbox of `team_id` with `network`. With `strict`, a secret the
    /// rules name that the team does not have is a 400 (create, resume); without, it is left
    /// out (its headers then fail at the proxy instead of carrying a stale value).
    pub(crate) async fn egress_spec(
        &self,
        team_id: &str,
        network: &NetworkConfig,
        strict: bool,
    ) -> ControlResult<EgressSpec> {
        let rules = checked_rules(network)?;
        let mut secrets = SecretValues::default();
        for name in secret_names(&rules) {
            match self.secret_value_named(team_id, &name).await? {
                Some(v) => {
                    secrets.0.insert(name, v);
                }
                None if strict => {
                    return Err(ControlError::bad_request(format!(
                        "network rules name the unknown secret {name:?}"
                    )))
                }
                None => {}
            }
        }
        Ok(EgressSpec { rules, secrets })
    }

    /// The value of the team's secret `name` (by id or name), `None` when it has none.
    pub(crate) async fn secret_value_named(
        &self,
        team_id: &str,
        name: &str,
    ) -> ControlResult<Option<String>> {
        let Some(secret) = self
            .records
            .secret(team_id, name)
            .await
            .map_err(record_error)?
        else {
            return Ok(None);
        };
        self.records
            .secret_value(team_id, &secret.id)
            .await
            .map_err(record_error)
    }

    /// A secret of `team_id` named `name` was updated or deleted: every running sandbox of the
    /// team whose rules name it gets its rules with the current values. Failures are logged;
    /// the next start reads the values afresh anyway.
    pub async fn secret_changed(&self, team_id: &str, name: &str) {
        let name = name.to_ascii_lowercase();
        let recs = match self.records.sandboxes(Some(team_id)).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "listing sandboxes after a secret change failed");
                return;
            }
        };
        for rec in recs {
            if rec.state != SandboxState::Running {
                continue;
            }
            let Ok(rules) = checked_rules(&rec.network) else {
                continue;
            };
            if !secret_names(&rules).contains(&name) {
                continue;
            }
            let spec = match self.egress_spec(team_id, &rec.network, false).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(sandbox_id = %rec.id, error = %e, "egress rules after a secret change");
                    continue;
                }
            };
            match self
                .node
                .update_egress(&rec.id, &rec.execution_id, spec)
                .await
            {
                Ok(()) => tracing::info!(sandbox_id = %rec.id, "egress secrets updated"),
                Err(e) => {
                    tracing::warn!(sandbox_id = %rec.id, error = %e, "updating egress secrets failed")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn network(allow: &[&str], rules: serde_json::Value) -> NetworkConfig {
        NetworkConfig {
            allow_out: Some(allow.iter().map(|s| s.to_string()).collect()),
            rules: Some(rules),
            ..Default::default()
        }
    }

    #[test]
    fn a_rule_host_must_be_in_allow_out() {
        let rules = serde_json::json!({"API.example.com": [{"transform": {"headers": {
            "Authorization": "Bearer ${e2b.secrets.k}"}}}]});
        assert!(checked_rules(&network(&["api.example.com"], rules.clone())).is_ok());
        assert!(checked_rules(&network(&[" API.Example.com "], rules.clone())).is_ok());
        assert!(checked_rules(&network(&["other.example.com"], rules.clone())).is_err());
        assert!(checked_rules(&network(&[], rules)).is_err());
        assert!(checked_rules(&NetworkConfig::default())
            .expect("none")
            .is_empty());
    }
}
