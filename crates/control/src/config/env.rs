//! The `VMON_*` variables that override the config file: one clap argument each, the variable
//! its `env`, the value parsed by the argument's parser (numbers and addresses trimmed first).
//! A bad value is an error that names the variable and the value, as `VMON_X="v": why`.
//!
//! `vmon` reads them from its environment ([`Overrides::from_env`]); tests hand the same
//! arguments their values ([`Overrides::from_vars`]), so both go through one parser.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use clap::error::ContextKind;
use clap::{CommandFactory, Parser};

#[derive(Debug, Default, Parser)]
#[command(name = "VMON_* variables", no_binary_name = true)]
pub(super) struct Overrides {
    #[arg(long, env = "VMON_API_LISTEN", value_parser = trimmed::<SocketAddr>)]
    pub api_listen: Option<SocketAddr>,
    #[arg(long, env = "VMON_PROXY_LISTEN", value_parser = trimmed::<SocketAddr>)]
    pub proxy_listen: Option<SocketAddr>,
    #[arg(long, env = "VMON_API_URL")]
    pub api_url: Option<String>,
    #[arg(long, env = "VMON_SANDBOX_URL")]
    pub sandbox_url: Option<String>,
    /// Empty: none.
    #[arg(long, env = "VMON_DOMAIN")]
    pub domain: Option<String>,
    /// `0`, `false` or `no` turn it off; anything else on.
    #[arg(long, env = "VMON_PREBUILD_CODE_INTERPRETER", value_parser = loose_bool)]
    pub prebuild_code_interpreter: Option<bool>,
    #[arg(long, env = "VMON_MIGRATION_DOWNTIME_MS", value_parser = trimmed::<u64>)]
    pub migration_downtime_ms: Option<u64>,
    /// Empty: ignored.
    #[arg(long, env = "VMON_FAULT_DIR")]
    pub fault_dir: Option<String>,
    #[arg(long, env = "VMON_CLIENT_ID")]
    pub client_id: Option<String>,
    #[arg(long, env = "VMON_NODE_GRACE_SECS", value_parser = trimmed::<u64>)]
    pub node_grace_secs: Option<u64>,
    #[arg(long, env = "VMON_LOCK_WAIT_SECS", value_parser = trimmed::<u64>)]
    pub lock_wait_secs: Option<u64>,
    #[arg(long, env = "VMON_MAX_CONCURRENT", value_parser = trimmed::<u32>)]
    pub max_concurrent: Option<u32>,
    #[arg(long, env = "VMON_MAX_LIFETIME_SECS", value_parser = trimmed::<u64>)]
    pub max_lifetime_secs: Option<u64>,
    /// Empty: none (SQLite).
    #[arg(long, env = "VMON_STORE_URL")]
    pub store_url: Option<String>,
    #[arg(long, env = "VMON_WEBHOOK_KEY_FILE")]
    pub webhook_key_file: Option<String>,
    /// Comma-separated CIDRs.
    #[arg(long, env = "VMON_WEBHOOK_ALLOW", value_parser = list)]
    pub webhook_allow: Option<::std::vec::Vec<String>>,
    /// Comma-separated CIDRs.
    #[arg(long, env = "VMON_PRIVATE_ALLOW", value_parser = list)]
    pub private_allow: Option<::std::vec::Vec<String>>,
    /// Comma-separated `host[:port]`.
    #[arg(long, env = "VMON_INSECURE_REGISTRIES", value_parser = list)]
    pub insecure_registries: Option<::std::vec::Vec<String>>,
    /// Comma-separated CIDRs.
    #[arg(long, env = "VMON_REGISTRY_ALLOW", value_parser = list)]
    pub registry_allow: Option<::std::vec::Vec<String>>,
    /// Blank: none.
    #[arg(long, env = "VMON_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,
    #[arg(long, env = "VMON_WEBHOOK_CA_FILE")]
    pub webhook_ca_file: Option<String>,
    #[arg(long, env = "VMON_MAX_PAUSED", value_parser = trimmed::<usize>)]
    pub max_paused: Option<usize>,
    #[arg(long, env = "VMON_MAX_SNAPSHOTS", value_parser = trimmed::<usize>)]
    pub max_snapshots: Option<usize>,
    #[arg(long, env = "VMON_MAX_WEBHOOKS", value_parser = trimmed::<usize>)]
    pub max_webhooks: Option<usize>,
    #[arg(long, env = "VMON_MAX_VOLUMES", value_parser = trimmed::<usize>)]
    pub max_volumes: Option<usize>,
    #[arg(long, env = "VMON_MAX_VOLUME_BYTES", value_parser = trimmed::<u64>)]
    pub max_volume_bytes: Option<u64>,
    #[arg(long, env = "VMON_MAX_SECRETS", value_parser = trimmed::<usize>)]
    pub max_secrets: Option<usize>,
    #[arg(long, env = "VMON_MAX_TEMPLATE_FILES", value_parser = trimmed::<usize>)]
    pub max_template_files: Option<usize>,
    #[arg(long, env = "VMON_MAX_TEMPLATE_FILE_BYTES", value_parser = trimmed::<u64>)]
    pub max_template_file_bytes: Option<u64>,
    #[arg(long, env = "VMON_TEMPLATE_FILES_GRACE_SECS", value_parser = trimmed::<u64>)]
    pub template_files_grace_secs: Option<u64>,
    #[arg(long, env = "VMON_VOLUMES_DIR")]
    pub volumes_dir: Option<String>,
    #[arg(long, env = "VMON_VOLUME_KEY_FILE")]
    pub volume_key_file: Option<String>,
    #[arg(long, env = "VMON_VOLUME_TOKEN_TTL_SECS", value_parser = trimmed::<u64>)]
    pub volume_token_ttl_secs: Option<u64>,
    #[arg(long, env = "VMON_PROXY_TLS_CERT")]
    pub proxy_tls_cert: Option<String>,
    #[arg(long, env = "VMON_PROXY_TLS_KEY")]
    pub proxy_tls_key: Option<String>,
    #[arg(long, env = "VMON_API_TLS_CERT")]
    pub api_tls_cert: Option<String>,
    #[arg(long, env = "VMON_API_TLS_KEY")]
    pub api_tls_key: Option<String>,
    #[arg(long, env = "VMON_API_CA_FILE")]
    pub api_ca_file: Option<String>,
    /// Every team's default `max_idle_seconds`; 0 turns it off.
    #[arg(long, env = "VMON_IDLE_MAX_IDLE_SECS", value_parser = trimmed::<u64>)]
    pub idle_max_idle_secs: Option<u64>,
    #[arg(long, env = "VMON_IDLE_SCAN_MS", value_parser = trimmed::<u64>)]
    pub idle_scan_ms: Option<u64>,
    #[arg(long, env = "VMON_PROXY_MAX_PER_SANDBOX", value_parser = trimmed::<usize>)]
    pub proxy_max_per_sandbox: Option<usize>,
    #[arg(long, env = "VMON_PROXY_MAX_PER_CLIENT", value_parser = trimmed::<usize>)]
    pub proxy_max_per_client: Option<usize>,
    #[arg(long, env = "VMON_PROXY_HEADER_TIMEOUT_SECS", value_parser = trimmed::<u64>)]
    pub proxy_header_timeout_secs: Option<u64>,
    #[arg(long, env = "VMON_PROXY_IDLE_BODY_SECS", value_parser = trimmed::<u64>)]
    pub proxy_idle_body_secs: Option<u64>,
    #[arg(long, env = "VMON_PROXY_SIGNED_MISSES_PER_MINUTE", value_parser = trimmed::<u32>)]
    pub proxy_signed_misses_per_minute: Option<u32>,
    #[arg(long, env = "VMON_BASE_VCPUS", value_parser = trimmed::<u32>)]
    pub base_vcpus: Option<u32>,
    #[arg(long, env = "VMON_VOLUME_STORE", value_parser = trimmed::<super::VolumeStore>)]
    pub volume_store: Option<super::VolumeStore>,
    /// Comma-separated `http(s)://host[:port]`.
    #[arg(long, env = "VMON_S3_MOUNT_ENDPOINTS", value_parser = list)]
    pub s3_mount_endpoints: Option<::std::vec::Vec<String>>,
    #[arg(long, env = "VMON_BASE_MEMORY_MB", value_parser = trimmed::<u32>)]
    pub base_memory_mb: Option<u32>,
    #[arg(long, env = "VMON_BASE_DISK_MB", value_parser = trimmed::<u32>)]
    pub base_disk_mb: Option<u32>,
}

impl Overrides {
    /// The variables of this process's environment.
    pub fn from_env() -> anyhow::Result<Overrides> {
        Self::try_parse_from(std::iter::empty::<String>()).map_err(|e| named(&e))
    }

    /// The variables `var` gives, through the same parsers (each becomes its argument).
    #[cfg(test)]
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<Overrides> {
        let cmd = Self::command();
        let args: Vec<String> = cmd
            .get_arguments()
            .filter_map(|a| {
                let name = a.get_env()?.to_str()?;
                let long = a.get_long()?;
                var(name).map(|v| format!("--{long}={v}"))
            })
            .collect();
        // Nothing of the real environment: only what `var` says.
        let mut cmd = cmd;
        for id in cmd
            .get_arguments()
            .map(|a| a.get_id().clone())
            .collect::<Vec<_>>()
        {
            cmd = cmd.mut_arg(id, |a| a.env(None::<&str>));
        }
        let matches = cmd.try_get_matches_from(args).map_err(|e| named(&e))?;
        <Self as clap::FromArgMatches>::from_arg_matches(&matches).map_err(|e| named(&e))
    }
}

/// A clap error as `VMON_X="value": why`.
fn named(e: &clap::Error) -> anyhow::Error {
    let arg = match e.get(ContextKind::InvalidArg) {
        Some(clap::error::ContextValue::String(s)) => s.clone(),
        _ => return anyhow::anyhow!("VMON_* variables: {}", e.render()),
    };
    let value = match e.get(ContextKind::InvalidValue) {
        Some(clap::error::ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    let why = std::error::Error::source(e)
        .map(|s| s.to_string())
        .unwrap_or_else(|| format!("{:?}", e.kind()));
    let cmd = Overrides::command();
    let name = cmd
        .get_arguments()
        .find(|a| {
            a.get_long()
                .is_some_and(|l| arg.starts_with(&format!("--{l} ")) || arg == format!("--{l}"))
        })
        .and_then(|a| a.get_env())
        .and_then(|n| n.to_str())
        .unwrap_or("VMON_*")
        .to_string();
    anyhow::anyhow!("{name}={value:?}: {why}")
}

fn trimmed<T: FromStr>(v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.trim().parse().map_err(|e: T::Err| e.to_string())
}

fn loose_bool(v: &str) -> Result<bool, String> {
    Ok(!matches!(v.trim(), "0" | "false" | "no"))
}

/// Comma-separated, each entry trimmed, empty entries dropped. (The fields spell the type
/// `::std::vec::Vec` so that clap takes one value for the whole list.)
fn list(v: &str) -> Result<Vec<String>, String> {
    Ok(v.split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect())
}

/// An empty value says "none" for a path.
pub(super) fn path(v: String) -> Option<PathBuf> {
    (!v.is_empty()).then(|| v.into())
}
