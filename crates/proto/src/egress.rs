//! Secret injection at egress: the rules a sandbox's `network.rules` carry (E2B's
//! `{host: [{transform: {headers: {Name: "… ${e2b.secrets.<name>} …"}}}]}`), parsed and
//! bounded, and the substitution of secret values into them.
//!
//! The rules travel from the api to the node in [`StartSpec::egress`](crate::node::StartSpec)
//! with the values of the secrets they name ([`SecretValues`]: never printed by `Debug`, never
//! written to disk by the node). The node's egress proxy applies them to the sandbox's outbound
//! HTTPS to those hosts (`crates/egress`).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// The marker E2B's `Secret.fill(name)` writes: `${e2b.secrets.<name>}`.
pub const MARKER_OPEN: &str = "${e2b.secrets.";
/// Hosts one sandbox's rules may name.
pub const MAX_HOSTS: usize = 16;
/// Headers one host's rules may set.
pub const MAX_HEADERS_PER_HOST: usize = 16;
/// Distinct secrets one host's rules may name (infra's limit).
pub const MAX_MARKERS_PER_HOST: usize = 32;
/// A header name's and a header template's longest.
pub const MAX_NAME_LEN: usize = 256;
pub const MAX_TEMPLATE_LEN: usize = 8 * 1024;
/// The most bytes the headers injected into one request may hold once filled in.
pub const MAX_INJECTED_BYTES: usize = 64 * 1024;

/// One header a rule sets on every request to its host (replacing what the guest sent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRule {
    /// Lower-cased.
    pub name: String,
    /// The value, with `${e2b.secrets.<name>}` markers.
    pub template: String,
}

/// The rules of one host (lower-cased, a DNS name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRule {
    pub host: String,
    pub headers: Vec<HeaderRule>,
}

/// Secret values by name. `Debug` prints the names only.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretValues(pub BTreeMap<String, String>);

impl std::fmt::Debug for SecretValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.keys().map(|k| (k, "[redacted]")))
            .finish()
    }
}

/// What a node's egress proxy needs for one sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressSpec {
    pub rules: Vec<HostRule>,
    pub secrets: SecretValues,
}

impl EgressSpec {
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }
    /// The rules of `host` (compared without case).
    pub fn rule(&self, host: &str) -> Option<&HostRule> {
        self.rules
            .iter()
            .find(|r| r.host.eq_ignore_ascii_case(host))
    }
}

/// The secret names a template's markers name, in order; an unterminated or empty marker, or a
/// name outside `[A-Za-z0-9_-]`, is an error.
pub fn markers(template: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(i) = rest.find(MARKER_OPEN) {
        rest = &rest[i + MARKER_OPEN.len()..];
        let Some(end) = rest.find('}') else {
            return Err("a ${e2b.secrets.…} marker is not closed".into());
        };
        let name = &rest[..end];
        if name.is_empty()
            || name.len() > 128
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err("a ${e2b.secrets.…} marker does not name a valid secret".into());
        }
        out.push(name.to_ascii_lowercase());
        rest = &rest[end + 1..];
    }
    Ok(out)
}

/// `template` with every marker replaced by its secret's value. A secret missing from
/// `values` is an error naming it (never the value of anything).
pub fn substitute(template: &str, values: &SecretValues) -> Result<String, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find(MARKER_OPEN) {
        out.push_str(&rest[..i]);
        rest = &rest[i + MARKER_OPEN.len()..];
        let Some(end) = rest.find('}') else {
            return Err("a ${e2b.secrets.…} marker is not closed".into());
        };
        let name = rest[..end].to_ascii_lowercase();
        match values.0.get(&name) {
            Some(v) => out.push_str(v),
            None => return Err(format!("the secret {name:?} is not available")),
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// An HTTP header name (RFC 9110 token).
fn valid_header_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= MAX_NAME_LEN
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Headers a rule may not set: they frame the request or the connection.
fn reserved_header(n: &str) -> bool {
    matches!(
        n,
        "host"
            | "content-length"
            | "transfer-encoding"
            | "connection"
            | "upgrade"
            | "te"
            | "trailer"
            | "keep-alive"
            | "proxy-connection"
    )
}

/// E2B's `network.rules` object, checked and bounded: host names only, `transform.headers`
/// only, valid header names, visible ASCII around the markers. Hosts whose rules set no header
/// are left out.
pub fn parse_rules(rules: &serde_json::Value) -> Result<Vec<HostRule>, String> {
    use serde_json::Value;
    let Value::Object(hosts) = rules else {
        return Err("network.rules must be an object of host names".into());
    };
    if hosts.len() > MAX_HOSTS {
        return Err(format!("network.rules may name at most {MAX_HOSTS} hosts"));
    }
    let mut out: Vec<HostRule> = Vec::new();
    for (host, list) in hosts {
        let host_lc = host.trim().to_ascii_lowercase();
        if !crate::node::is_host_name(&host_lc) {
            return Err(format!("network.rules key {host:?} is not a host name"));
        }
        let Value::Array(list) = list else {
            return Err(format!("network.rules[{host:?}] must be a list of rules"));
        };
        let mut headers: BTreeMap<String, String> = BTreeMap::new();
        for rule in list {
            rule_headers(host, rule, &mut headers)?;
        }
        if headers.len() > MAX_HEADERS_PER_HOST {
            return Err(format!(
                "network.rules[{host:?}] may set at most {MAX_HEADERS_PER_HOST} headers"
            ));
        }
        let rule = HostRule {
            host: host_lc.clone(),
            headers: headers
                .into_iter()
                .map(|(name, template)| HeaderRule { name, template })
                .collect(),
        };
        if secret_names(std::slice::from_ref(&rule)).len() > MAX_MARKERS_PER_HOST {
            return Err(format!(
                "network.rules[{host:?}] may name at most {MAX_MARKERS_PER_HOST} secrets"
            ));
        }
        if rule.headers.is_empty() {
            continue;
        }
        if out.iter().any(|r| r.host == host_lc) {
            return Err(format!("network.rules names {host_lc:?} twice"));
        }
        out.push(rule);
    }
    Ok(out)
}

/// The headers one rule of `host` sets (`{"transform": {"headers": {name: template}}}`),
/// checked, into `headers`.
fn rule_headers(
    host: &str,
    rule: &serde_json::Value,
    headers: &mut BTreeMap<String, String>,
) -> Result<(), String> {
    use serde_json::Value;
    let Value::Object(rule) = rule else {
        return Err(format!(
            "network.rules[{host:?}] holds a rule that is not an object"
        ));
    };
    for (key, body) in rule {
        if key != "transform" {
            return Err(format!(
                "network.rules[{host:?}]: {key:?} is not supported (only transform.headers)"
            ));
        }
        let Value::Object(transform) = body else {
            return Err(format!(
                "network.rules[{host:?}].transform must be an object"
            ));
        };
        for (tkey, hs) in transform {
            if tkey != "headers" {
                return Err(format!(
                    "network.rules[{host:?}].transform.{tkey} is not supported (only headers)"
                ));
            }
            let Value::Object(hs) = hs else {
                return Err(format!(
                    "network.rules[{host:?}].transform.headers must be an object"
                ));
            };
            for (name, value) in hs {
                let (name, template) = header_rule(host, name, value)?;
                headers.insert(name, template);
            }
        }
    }
    Ok(())
}

/// One header a rule sets: a name it may set (lower-cased) and its template, visible ASCII
/// with well-formed secret markers.
fn header_rule(
    host: &str,
    name: &str,
    value: &serde_json::Value,
) -> Result<(String, String), String> {
    let name = name.to_ascii_lowercase();
    if !valid_header_name(&name) || reserved_header(&name) {
        return Err(format!(
            "network.rules[{host:?}]: {name:?} is not a header a rule may set"
        ));
    }
    let serde_json::Value::String(template) = value else {
        return Err(format!(
            "network.rules[{host:?}]: the value of {name:?} must be a string"
        ));
    };
    if template.len() > MAX_TEMPLATE_LEN
        || template
            .bytes()
            .any(|b| !(b == b'\t' || (0x20..0x7f).contains(&b)))
    {
        return Err(format!(
            "network.rules[{host:?}]: the value of {name:?} must be at most \
             {MAX_TEMPLATE_LEN} bytes of visible ASCII"
        ));
    }
    markers(template).map_err(|e| format!("network.rules[{host:?}][{name:?}]: {e}"))?;
    Ok((name, template.clone()))
}

/// Every secret the rules name, lower-cased.
pub fn secret_names(rules: &[HostRule]) -> BTreeSet<String> {
    rules
        .iter()
        .flat_map(|r| r.headers.iter())
        .flat_map(|h| markers(&h.template).unwrap_or_default())
        .collect()
}

/// The headers `rule` sets, filled in with `values`: each a valid header value (no control
/// characters), all together within [`MAX_INJECTED_BYTES`].
pub fn fill(rule: &HostRule, values: &SecretValues) -> Result<Vec<(String, String)>, String> {
    let mut total = 0;
    let mut out = Vec::with_capacity(rule.headers.len());
    for h in &rule.headers {
        let v = substitute(&h.template, values)?;
        if v.bytes().any(|b| b != b'\t' && (b < 0x20 || b == 0x7f)) {
            return Err(format!(
                "the value for header {:?} holds a control character",
                h.name
            ));
        }
        total += h.name.len() + v.len();
        if total > MAX_INJECTED_BYTES {
            return Err(format!(
                "the injected headers exceed {MAX_INJECTED_BYTES} bytes"
            ));
        }
        out.push((h.name.clone(), v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn values(pairs: &[(&str, &str)]) -> SecretValues {
        SecretValues(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn the_e2b_wire_parses_into_host_rules() {
        let rules = json!({"API.example.com": [{"transform": {"headers": {
            "Authorization": "Bearer ${e2b.secrets.My-Key}",
            "X-Both": "${e2b.secrets.a}:${e2b.secrets.b}",
        }}}], "noop.example.com": []});
        let parsed = parse_rules(&rules).expect("parse");
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].host, "api.example.com");
        assert_eq!(parsed[0].headers[0].name, "authorization");
        assert_eq!(
            secret_names(&parsed).into_iter().collect::<Vec<_>>(),
            ["a", "b", "my-key"]
        );
    }

    #[test]
    fn bad_rules_are_refused() {
        for bad in [
            json!([]),
            json!({"not a host": []}),
            json!({"10.0.0.1": [{"transform": {"headers": {"a": "b"}}}]}),
            json!({"a.example.com": {}}),
            json!({"a.example.com": [{"block": true}]}),
            json!({"a.example.com": [{"transform": {"body": "x"}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"Bad Name": "x"}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"Host": "x"}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"x": 1}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"x": "a\r\nb: c"}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"x": "${e2b.secrets.open"}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"x": "${e2b.secrets.}"}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"x": "${e2b.secrets.a b}"}}}]}),
            json!({"a.example.com": [{"transform": {"headers": {"x": "y".repeat(MAX_TEMPLATE_LEN + 1)}}}]}),
        ] {
            assert!(parse_rules(&bad).is_err(), "{bad}");
        }
        let many: serde_json::Map<_, _> = (0..=MAX_HOSTS)
            .map(|i| (format!("h{i}.example.com"), json!([])))
            .collect();
        assert!(parse_rules(&serde_json::Value::Object(many)).is_err());
        let headers: serde_json::Map<_, _> = (0..=MAX_HEADERS_PER_HOST)
            .map(|i| (format!("x-{i}"), json!("v")))
            .collect();
        assert!(
            parse_rules(&json!({"a.example.com": [{"transform": {"headers": headers}}]})).is_err()
        );
        let markers: String = (0..=MAX_MARKERS_PER_HOST)
            .map(|i| format!("${{e2b.secrets.s{i}}}"))
            .collect();
        assert!(parse_rules(
            &json!({"a.example.com": [{"transform": {"headers": {"x": markers}}}]})
        )
        .is_err());
    }

    #[test]
    fn substitution_fills_every_marker_and_names_missing_secrets_only() {
        let v = values(&[("one", "1"), ("two", "2")]);
        assert_eq!(
            substitute("Bearer ${e2b.secrets.one}/${e2b.secrets.TWO}.", &v).expect("fill"),
            "Bearer 1/2."
        );
        assert_eq!(substitute("plain", &v).expect("plain"), "plain");
        let e = substitute("${e2b.secrets.three}", &v).expect_err("missing");
        assert!(e.contains("three") && !e.contains('1'));
        // A value is never scanned for markers again.
        let v = values(&[("a", "${e2b.secrets.b}"), ("b", "leak")]);
        assert_eq!(
            substitute("${e2b.secrets.a}", &v).expect("once"),
            "${e2b.secrets.b}"
        );
    }

    #[test]
    fn filled_headers_are_bounded_and_free_of_control_characters() {
        let rule = HostRule {
            host: "a.example.com".into(),
            headers: vec![HeaderRule {
                name: "authorization".into(),
                template: "Bearer ${e2b.secrets.k}".into(),
            }],
        };
        assert_eq!(
            fill(&rule, &values(&[("k", "v")])).expect("fill"),
            [("authorization".to_string(), "Bearer v".to_string())]
        );
        assert!(fill(&rule, &values(&[("k", "a\r\nx: y")])).is_err());
        let big = "x".repeat(MAX_INJECTED_BYTES);
        assert!(fill(&rule, &values(&[("k", &big)])).is_err());
    }

    #[test]
    fn debug_never_prints_a_value() {
        let spec = EgressSpec {
            rules: Vec::new(),
            secrets: values(&[("k", "hunter2")]),
        };
        let s = format!("{spec:?}");
        assert!(s.contains("\"k\"") && !s.contains("hunter2"), "{s}");
    }
}
