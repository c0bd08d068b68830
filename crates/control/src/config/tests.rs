//! The configuration's tests: files, environment, checks.

use super::*;

#[test]
fn toml_then_env() {
    let mut c: Config =
        toml::from_str("api_listen = \"127.0.0.1:4000\"\n[default_limits]\nmax_concurrent = 3\n")
            .expect("toml");
    assert_eq!(c.api_listen.port(), 4000);
    assert_eq!(c.default_limits.max_concurrent, 3);
    assert_eq!(c.default_limits.max_vcpus, TeamLimits::default().max_vcpus);
    c.apply_env(|k| (k == "VMON_MAX_CONCURRENT").then(|| "7".to_string()))
        .expect("env");
    assert_eq!(c.default_limits.max_concurrent, 7);
    let e = c
        .apply_env(|k| (k == "VMON_API_LISTEN").then(|| "nope".to_string()))
        .expect_err("not an address");
    assert!(
        e.to_string().starts_with("VMON_API_LISTEN=\"nope\": "),
        "the error names the variable and the value: {e}"
    );
    assert_eq!(c.api_url(), "http://127.0.0.1:4000");
    let e = c
        .apply_env(|k| (k == "VMON_MAX_PAUSED").then(|| " 12x".to_string()))
        .expect_err("not a number");
    assert!(
        e.to_string().starts_with("VMON_MAX_PAUSED=\" 12x\": "),
        "{e}"
    );
    c.apply_env(|k| (k == "VMON_MAX_PAUSED").then(|| " 12 ".to_string()))
        .expect("trimmed");
    assert_eq!(c.quotas.max_paused, 12);
}

#[test]
fn private_allow_is_empty_by_default_and_takes_cidrs_only() {
    let mut c = Config::default();
    assert!(c.private_allow.is_empty());
    c.apply_env(|k| (k == "VMON_PRIVATE_ALLOW").then(|| " 10.9.0.0/16, 192.168.7.7 ".into()))
        .expect("env");
    assert_eq!(c.private_allow, ["10.9.0.0/16", "192.168.7.7"]);
    for bad in ["db.internal", "10.0.0.0/40"] {
        let mut c = Config::default();
        let e = c
            .apply_env(|k| (k == "VMON_PRIVATE_ALLOW").then(|| bad.to_string()))
            .expect_err(bad);
        assert!(e.to_string().contains("private_allow"), "{e}");
    }
    let c: Config = toml::from_str("private_allow = [\"10.0.0.0/24\"]\n").expect("toml");
    assert_eq!(c.private_allow, ["10.0.0.0/24"]);
}

#[test]
fn proxy_limits_and_the_metrics_token_from_toml_and_env() {
    let mut c: Config =
        toml::from_str("[proxy_limits]\nmax_per_sandbox = 5\nidle_body_secs = 0\n").expect("toml");
    let vars = [
        ("VMON_PROXY_MAX_PER_CLIENT", "9"),
        ("VMON_PROXY_HEADER_TIMEOUT_SECS", "7"),
        ("VMON_METRICS_TOKEN", " scrape "),
    ];
    c.apply_env(|k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
    .expect("env");
    let g = c.proxy_limits.guest_limits();
    assert_eq!((g.per_sandbox, g.per_client), (5, 9));
    assert_eq!(g.response_header_timeout, Duration::from_secs(7));
    assert!(g.idle_body_timeout.is_zero());
    assert_eq!(c.metrics_token.as_deref(), Some("scrape"));
    assert!(c
        .apply_env(|k| (k == "VMON_PROXY_MAX_PER_SANDBOX").then(|| "-1".to_string()))
        .is_err());
}

#[test]
fn an_api_with_a_certificate_is_https() {
    let mut c = Config::default();
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert!(c
        .apply_env(env(&[("VMON_API_TLS_CERT", "/etc/vmon/api.pem")]))
        .is_err());
    c.apply_env(env(&[
        ("VMON_API_TLS_CERT", "/etc/vmon/api.pem"),
        ("VMON_API_TLS_KEY", "/etc/vmon/api.key"),
        ("VMON_API_CA_FILE", "/etc/vmon/ca.pem"),
    ]))
    .expect("env");
    assert_eq!(c.api_url(), "https://127.0.0.1:3000");
    assert_eq!(
        c.api_ca_file.as_deref(),
        Some(Path::new("/etc/vmon/ca.pem"))
    );
}

/// The commented `/etc/vmon/config.toml` the Debian package installs: as shipped (every
/// setting commented out) it is the defaults; with every `#name = value` and `#[table]`
/// line uncommented it still parses (so no setting it shows is misspelt or of the wrong
/// type: unknown keys are refused), and it shows every setting there is.
#[test]
fn the_packaged_config_shows_every_setting_and_parses() {
    let text = include_str!("../../../../deploy/debian/config.toml");
    let shipped: Config = toml::from_str(text).expect("the shipped file parses");
    assert_eq!(
        serde_json::to_value(&shipped).expect("json"),
        serde_json::to_value(Config::default()).expect("json")
    );
    /// A commented-out setting (`#name = value`, `#[table]`) without its `#`.
    fn setting(l: &str) -> Option<&str> {
        l.strip_prefix('#').filter(|rest| {
            rest.starts_with('[')
                || rest
                    .split_once(" = ")
                    .is_some_and(|(k, _)| !k.is_empty() && !k.contains(' '))
        })
    }
    let uncommented: String = text
        .lines()
        .map(|l| setting(l).unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let all: Config = toml::from_str(&uncommented).expect("every setting parses");
    // Every setting there is (every leaf of the defaults; `None`s are JSON nulls) is
    // shown, as `#name =` or as a `#[table]` of its own.
    fn leaves(prefix: &str, v: &serde_json::Value, out: &mut Vec<String>) {
        for (k, v) in v.as_object().into_iter().flatten() {
            let path = format!("{prefix}{k}");
            match v {
                serde_json::Value::Object(m) if !m.is_empty() => {
                    leaves(&format!("{path}."), v, out)
                }
                _ => out.push(path),
            }
        }
    }
    let mut settings = Vec::new();
    leaves(
        "",
        &serde_json::to_value(Config::default()).expect("json"),
        &mut settings,
    );
    assert!(settings.len() > 40, "{settings:?}");
    for path in &settings {
        let name = path.rsplit('.').next().unwrap_or(path);
        assert!(
            text.contains(&format!("\n#{name} =")) || text.contains(&format!("\n#[{path}")),
            "deploy/debian/config.toml does not show `{path}`"
        );
    }
    assert!(all.idle.teams.contains_key("research"));
}

#[test]
fn the_variables_are_one_consistent_clap_definition() {
    use clap::CommandFactory;
    let cmd = env::Overrides::command();
    cmd.clone().debug_assert();
    let names: Vec<_> = cmd.get_arguments().filter_map(|a| a.get_env()).collect();
    assert_eq!(
        names.len(),
        cmd.get_arguments().count(),
        "every argument is a variable"
    );
    assert!(names
        .iter()
        .all(|n| n.to_string_lossy().starts_with("VMON_")));
}

#[test]
fn empty_paths_clear_and_lists_split() {
    let mut c: Config = toml::from_str("store_url = \"postgres://x\"\n").expect("toml");
    let vars = [
        ("VMON_STORE_URL", ""),
        ("VMON_DOMAIN", "example.com"),
        ("VMON_INSECURE_REGISTRIES", "reg.local:5000, ,10.0.0.1"),
        ("VMON_PREBUILD_CODE_INTERPRETER", "no"),
        ("VMON_FAULT_DIR", ""),
    ];
    c.apply_env(|k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    })
    .expect("env");
    assert_eq!(c.store_url, None);
    assert_eq!(c.domain.as_deref(), Some("example.com"));
    assert_eq!(c.insecure_registries, ["reg.local:5000", "10.0.0.1"]);
    assert!(!c.prebuild_code_interpreter);
    assert_eq!(c.fault_dir, None);
}

#[test]
fn the_sdk_domain_reaches_a_local_proxy() {
    let mut c = Config::default();
    assert_eq!(c.sandbox_domain().as_deref(), Some("localhost:3001"));
    c.proxy_listen = "0.0.0.0:80".parse().expect("addr");
    assert_eq!(c.sandbox_domain().as_deref(), Some("localhost"));
    c.proxy_listen = "10.0.0.5:3001".parse().expect("addr");
    assert_eq!(
        c.sandbox_domain(),
        None,
        "a proxy elsewhere needs VMON_DOMAIN"
    );
    c.sandbox_url = Some("http://sandboxes.example.com".into());
    c.proxy_listen = "127.0.0.1:3001".parse().expect("addr");
    assert_eq!(c.sandbox_domain(), None);
    c.domain = Some("example.com".into());
    assert_eq!(c.sandbox_domain().as_deref(), Some("example.com"));
}
