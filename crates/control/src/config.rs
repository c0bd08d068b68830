//! The one `Config` of the control plane (`vmon up`, `vmon api`, `vmon proxy`): read from a
//! TOML file, then overridden by `VMON_*` environment variables. Defaults work on one machine.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::records::TeamLimits;

mod env;

/// The shortest idle window.
pub const MIN_IDLE_SECS: u64 = 60;

/// The registries plain HTTP (and unverified TLS) is allowed for when the operator names none:
/// the loopback addresses, where a test's or a developer's own registry listens.
pub const DEFAULT_INSECURE: &[&str] = &["localhost", "127.0.0.0/8", "::1"];

/// An endpoint as the allow-list compares it: `scheme://host[:port]`, lower-cased, without a
/// trailing `/`; anything with a path, a query, credentials or another scheme is refused.
pub fn normal_endpoint(e: &str) -> Result<String, String> {
    let e = e.trim().trim_end_matches('/');
    let (scheme, rest) = e
        .split_once("://")
        .ok_or_else(|| format!("{e:?} is not http(s)://host[:port]"))?;
    let scheme = scheme.to_ascii_lowercase();
    let ok = (scheme == "http" || scheme == "https")
        && !rest.is_empty()
        && rest.len() <= 255
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
    if !ok {
        return Err(format!(
            "{e:?} is not http(s)://host[:port] (no path, query or credentials)"
        ));
    }
    Ok(format!("{scheme}://{}", rest.to_ascii_lowercase()))
}

/// Where volumes keep their files ([`Config::volume_store`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VolumeStore {
    /// `volumes_dir`: one filesystem every node and api shares.
    #[default]
    Local,
    /// The cluster's object store, cached by each node that mounts the volume.
    S3,
}

impl std::str::FromStr for VolumeStore {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "local" => Ok(VolumeStore::Local),
            "s3" => Ok(VolumeStore::S3),
            _ => Err("expected local or s3".into()),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// REST API listen address (`VMON_API_LISTEN`).
    pub api_listen: SocketAddr,
    /// Sandbox traffic proxy listen address (`VMON_PROXY_LISTEN`).
    pub proxy_listen: SocketAddr,
    /// URL printed as `E2B_API_URL` (`VMON_API_URL`); default `http://<api_listen>`.
    pub api_url: Option<String>,
    /// URL printed as `E2B_SANDBOX_URL` (`VMON_SANDBOX_URL`); default `http://<proxy_listen>`.
    pub sandbox_url: Option<String>,
    /// Domain returned to the SDK for `{port}-{id}.{domain}` hosts (`VMON_DOMAIN`).
    pub domain: Option<String>,
    /// The name this api reports as `clientID` and campaigns with (`VMON_CLIENT_ID`).
    pub client_id: String,
    /// How long a request waits for another transition of the same sandbox, in seconds.
    pub lock_wait_secs: u64,
    /// In a cluster: how long a node whose registration lapsed (no heartbeat for its lease)
    /// is only suspect before its running sandboxes are reported killed (`orphaned`), in
    /// seconds (`VMON_NODE_GRACE_SECS`; default 300, as Kubernetes' eviction timeout). A
    /// node back within it keeps every sandbox.
    pub node_grace_secs: u64,
    /// Limits of teams created without explicit ones.
    pub default_limits: TeamLimits,
    /// The `base` template `vmon up` builds when it is missing.
    pub base_template: BaseTemplate,
    /// PostgreSQL URL of the records store (`VMON_STORE_URL`), for clusters; default SQLite
    /// `<data dir>/vmon.db`.
    pub store_url: Option<String>,
    /// The key (64 hex characters) webhook secrets are encrypted with
    /// (`VMON_WEBHOOK_KEY_FILE`); default `<data dir>/webhook-key`, created on first start.
    pub webhook_key_file: Option<std::path::PathBuf>,
    /// Ranges webhooks may be delivered to although they are on this host or a private
    /// network (`VMON_WEBHOOK_ALLOW`, comma-separated CIDRs), e.g. `["127.0.0.1/32"]`.
    pub webhook_allow: Vec<String>,
    /// Ranges inside the private and shared networks (10/8, 100.64/10, 172.16/12,
    /// 192.0.0/24, 192.168/16, 198.18/15) a sandbox's `allowOut` may open
    /// (`VMON_PRIVATE_ALLOW`, comma-separated CIDRs). Empty (the default): an `allowOut` entry
    /// there, or a host name resolving there, is a 400. The node of `vmon up` takes the same
    /// list; a `vmon node` reads `VMON_PRIVATE_ALLOW` and checks again.
    pub private_allow: Vec<String>,
    /// A PEM file of CA certificates trusted for `https://` webhooks besides the system's
    /// (`VMON_WEBHOOK_CA_FILE`).
    pub webhook_ca_file: Option<std::path::PathBuf>,
    /// A token that reads `GET /metrics` (as `Authorization: Bearer`) besides the admin token,
    /// for a Prometheus that should not hold the admin token (`VMON_METRICS_TOKEN`).
    pub metrics_token: Option<String>,
    /// What one team may keep, beyond its concurrency and lifetime limits.
    pub quotas: Quotas,
    /// Where template build uploads are kept (`<data dir>/template-files` once loaded; the
    /// api refuses to start without one).
    pub template_files_dir: Option<std::path::PathBuf>,
    /// An upload no waiting or running build names is deleted once it is this old (seconds
    /// since it was written or last named by a files probe or a build start;
    /// `VMON_TEMPLATE_FILES_GRACE_SECS`, default 3600).
    pub template_files_grace_secs: u64,
    /// Template builds that run at once; more wait (`waiting`).
    pub max_template_builds: usize,
    /// Registries a `from_image(...)` build may pull from over plain HTTP (or TLS without
    /// verification): hosts, `host:port`s, IP addresses or CIDR ranges
    /// (`VMON_INSECURE_REGISTRIES`, comma-separated). Default: the loopback addresses; every
    /// other registry is spoken to over verified TLS.
    pub insecure_registries: Vec<String>,
    /// Ranges a `from_image(...)` pull may reach although they are private, loopback,
    /// link-local or this host's (`VMON_REGISTRY_ALLOW`, comma-separated CIDRs), e.g.
    /// `["127.0.0.1/32"]` for a registry on this machine. Empty by default: such a registry,
    /// or a redirect of a pull to such an address, is refused before anything connects.
    pub registry_allow: Vec<String>,
    /// PEM certificate chain (leaf first) the proxy serves TLS with, on the same port as
    /// plain HTTP (`VMON_PROXY_TLS_CERT`): a certificate for `*.{domain}`. Without one,
    /// `vmon up` serves certificates of a local CA it creates in `<data dir>/tls`.
    pub proxy_tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of `proxy_tls_cert` (`VMON_PROXY_TLS_KEY`).
    pub proxy_tls_key: Option<std::path::PathBuf>,
    /// PEM certificate chain (leaf first) the api serves its listener with, TLS only
    /// (`VMON_API_TLS_CERT`); `api_url` then defaults to `https://<api_listen>`. Without it
    /// the api speaks plain HTTP.
    pub api_tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of `api_tls_cert` (`VMON_API_TLS_KEY`).
    pub api_tls_key: Option<std::path::PathBuf>,
    /// A PEM file of the CA certificates an `https://` `api_url` is verified against by the
    /// api's own clients (`vmon proxy`, the admin verbs) (`VMON_API_CA_FILE`); default: the
    /// system's CAs.
    pub api_ca_file: Option<std::path::PathBuf>,
    /// Where volumes keep their files, `<dir>/<volumeID>` (`VMON_VOLUMES_DIR`); default
    /// `<data dir>/volumes`. In a cluster, a filesystem every node and api mounts at this
    /// same path. Unset (only when the config is built in code): no volume routes.
    pub volumes_dir: Option<std::path::PathBuf>,
    /// The key (64 hex characters) volume tokens are signed with (`VMON_VOLUME_KEY_FILE`);
    /// default `<data dir>/volume-key`, created on first start. Share it across a cluster.
    pub volume_key_file: Option<std::path::PathBuf>,
    /// How long a volume token is valid, in seconds (`VMON_VOLUME_TOKEN_TTL_SECS`).
    pub volume_token_ttl_secs: u64,
    /// Where sandboxes' volumes live (`VMON_VOLUME_STORE`): `local` (default: `volumes_dir`,
    /// shared by every node) or `s3` (the nodes' object store; each node keeps a cache in its
    /// own volumes directory, see docs/architecture.md).
    pub volume_store: VolumeStore,
    /// The S3 endpoints a create's `vmonS3Mounts` may name (`VMON_S3_MOUNT_ENDPOINTS`,
    /// comma-separated `http(s)://host[:port]`); a mount naming none gets the first. Empty
    /// (the default): bucket mounts are refused. The nodes connect to these from the host,
    /// so list only endpoints tenants may reach (never a private service by mistake).
    pub s3_mount_endpoints: Vec<String>,
    /// Whether `code-interpreter-v1` is built in the background after `base`
    /// (`VMON_PREBUILD_CODE_INTERPRETER`); when `false`, the first create naming it builds it.
    pub prebuild_code_interpreter: bool,
    /// The longest guest pause a live migration plans its last copy round for, in ms
    /// (`VMON_MIGRATION_DOWNTIME_MS`).
    pub migration_downtime_ms: u64,
    /// Idle auto-suspend: the teams' defaults and how often the leader looks.
    pub idle: IdleConfig,
    /// The proxy's caps and timeouts towards guests (`[proxy_limits]`).
    pub proxy_limits: ProxyLimits,
    /// Test-only: where fault points are armed (`vmon_faults`). Set only from the
    /// `VMON_FAULT_DIR` environment variable, never from the file.
    #[serde(skip)]
    pub fault_dir: Option<std::path::PathBuf>,
}

/// What one sandbox or one client may hold of the proxy, and how long a guest may keep a
/// request waiting (`vmon_proxy::GuestLimits`; docs/operations.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct ProxyLimits {
    /// Requests (and upgraded connections) open to one sandbox at once; past it, 503
    /// (`VMON_PROXY_MAX_PER_SANDBOX`).
    pub max_per_sandbox: usize,
    /// Requests open from one client address (IPv6: its /64) at once; past it, 429
    /// (`VMON_PROXY_MAX_PER_CLIENT`).
    pub max_per_client: usize,
    /// Seconds a guest has to send response headers after a request's last byte; past them,
    /// 504 (`VMON_PROXY_HEADER_TIMEOUT_SECS`; 0 = no bound).
    pub header_timeout_secs: u64,
    /// Seconds a response body may send nothing before it is cut off; upgraded connections
    /// are exempt (`VMON_PROXY_IDLE_BODY_SECS`; 0 = no bound).
    pub idle_body_secs: u64,
    /// Signed `/files` URLs matching no sandbox that one client may send per minute
    /// (`VMON_PROXY_SIGNED_MISSES_PER_MINUTE`).
    pub signed_misses_per_minute: u32,
}

impl Default for ProxyLimits {
    fn default() -> Self {
        let d = vmon_proxy::GuestLimits::default();
        Self {
            max_per_sandbox: d.per_sandbox,
            max_per_client: d.per_client,
            header_timeout_secs: d.response_header_timeout.as_secs(),
            idle_body_secs: d.idle_body_timeout.as_secs(),
            signed_misses_per_minute: d.signed_misses_per_minute,
        }
    }
}

impl ProxyLimits {
    pub fn guest_limits(&self) -> vmon_proxy::GuestLimits {
        vmon_proxy::GuestLimits {
            per_sandbox: self.max_per_sandbox.max(1),
            per_client: self.max_per_client.max(1),
            response_header_timeout: Duration::from_secs(self.header_timeout_secs),
            idle_body_timeout: Duration::from_secs(self.idle_body_secs),
            signed_misses_per_minute: self.signed_misses_per_minute,
        }
    }
}

/// Idle auto-suspend (seed 004's IdlePolicy) for sandboxes whose create names none (no
/// `vmonIdle` field, no `vmon.idle.*` metadata). Off unless configured: E2B's SDK users expect
/// a sandbox to run until its timeout.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct IdleConfig {
    /// Every team's default (`VMON_IDLE_MAX_IDLE_SECS` sets its `max_idle_seconds`; 0 = off).
    pub default: Option<IdleDefault>,
    /// Per team slug, instead of `default` (`max_idle_seconds = 0` turns it off for the team).
    pub teams: std::collections::BTreeMap<String, IdleDefault>,
    /// How often the leader looks for idle sandboxes, in milliseconds (`VMON_IDLE_SCAN_MS`).
    pub scan_interval_ms: u64,
}

impl Default for IdleConfig {
    fn default() -> Self {
        Self {
            default: None,
            teams: Default::default(),
            scan_interval_ms: 5000,
        }
    }
}

/// A team's default idle policy. Unlike one a create names, it is adapted to each sandbox:
/// off when its window does not fit before the timeout (60 s for an auto-pausing sandbox
/// when that fits), as seed 004 says.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct IdleDefault {
    /// Seconds without traffic before the suspend (at least 60; 0 = off).
    pub max_idle_seconds: u64,
    pub auto_resume: bool,
    /// Default: the sandbox's timeout minus `max_idle_seconds`.
    pub suspended_duration_seconds: Option<u64>,
}

impl Default for IdleDefault {
    fn default() -> Self {
        Self {
            max_idle_seconds: 300,
            auto_resume: true,
            suspended_duration_seconds: None,
        }
    }
}

/// Per-team quotas; past one the request is 429 with the limit's name.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Quotas {
    /// Paused sandboxes a team may keep (`VMON_MAX_PAUSED`); explicit pauses past it are
    /// refused, auto-pause on timeout is not (it would otherwise lose the sandbox).
    pub max_paused: usize,
    /// Snapshots a team may keep (`VMON_MAX_SNAPSHOTS`).
    pub max_snapshots: usize,
    /// Webhooks a team may register (`VMON_MAX_WEBHOOKS`).
    pub max_webhooks: usize,
    /// Volumes a team may keep (`VMON_MAX_VOLUMES`).
    pub max_volumes: usize,
    /// Bytes a team's volumes may hold, checked on content-plane writes
    /// (`VMON_MAX_VOLUME_BYTES`); in-guest writes are not counted (`docs/security.md`).
    pub max_volume_bytes: u64,
    /// Secrets a team may keep (`VMON_MAX_SECRETS`); past it a create is 409, as in infra.
    pub max_secrets: usize,
    /// Template-file uploads (COPY archives) a team may keep (`VMON_MAX_TEMPLATE_FILES`);
    /// past it an upload is 429.
    pub max_template_files: usize,
    /// Bytes a team's template-file uploads may hold (`VMON_MAX_TEMPLATE_FILE_BYTES`); an
    /// upload that would pass it is 507.
    pub max_template_file_bytes: u64,
}

impl Default for Quotas {
    fn default() -> Self {
        Self {
            max_paused: 1000,
            max_snapshots: 1000,
            max_webhooks: 50,
            max_volumes: 100,
            max_volume_bytes: 10 << 30,
            max_secrets: 100,
            max_template_files: 1000,
            max_template_file_bytes: 10 << 30,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct BaseTemplate {
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
}

impl Default for BaseTemplate {
    fn default() -> Self {
        Self {
            vcpus: 2,
            memory_mb: 512,
            disk_mb: 4096,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            api_listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
            proxy_listen: SocketAddr::from(([127, 0, 0, 1], 3001)),
            api_url: None,
            sandbox_url: None,
            domain: None,
            client_id: "vmon".to_string(),
            lock_wait_secs: 120,
            node_grace_secs: 300,
            default_limits: TeamLimits::default(),
            base_template: BaseTemplate::default(),
            store_url: None,
            webhook_key_file: None,
            webhook_allow: Vec::new(),
            private_allow: Vec::new(),
            webhook_ca_file: None,
            metrics_token: None,
            quotas: Quotas::default(),
            template_files_dir: None,
            template_files_grace_secs: 3600,
            max_template_builds: 2,
            insecure_registries: DEFAULT_INSECURE.iter().map(|s| s.to_string()).collect(),
            registry_allow: Vec::new(),
            proxy_tls_cert: None,
            proxy_tls_key: None,
            api_tls_cert: None,
            api_tls_key: None,
            api_ca_file: None,
            volumes_dir: None,
            volume_key_file: None,
            volume_token_ttl_secs: 3600,
            volume_store: VolumeStore::Local,
            s3_mount_endpoints: Vec::new(),
            prebuild_code_interpreter: true,
            migration_downtime_ms: 300,
            idle: IdleConfig::default(),
            proxy_limits: ProxyLimits::default(),
            fault_dir: None,
        }
    }
}

impl Config {
    /// Reads `file` (when given, or `<data_dir>/config.toml` when that exists), then applies
    /// the `VMON_*` variables.
    pub fn load(file: Option<&Path>, data_dir: &Path) -> anyhow::Result<Config> {
        let default_file = data_dir.join("config.toml");
        let path = match file {
            Some(p) => Some(p.to_path_buf()),
            None if default_file.exists() => Some(default_file),
            None => None,
        };
        let mut config = match path {
            Some(p) => {
                let text = std::fs::read_to_string(&p)
                    .map_err(|e| anyhow::anyhow!("reading {}: {e}", p.display()))?;
                toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
            }
            None => Config::default(),
        };
        config.apply(env::Overrides::from_env()?)?;
        if config.template_files_dir.is_none() {
            config.template_files_dir = Some(data_dir.join("template-files"));
        }
        if config.volumes_dir.is_none() {
            config.volumes_dir = Some(data_dir.join("volumes"));
        }
        if config.volume_key_file.is_none() {
            config.volume_key_file = Some(data_dir.join("volume-key"));
        }
        Ok(config)
    }

    /// The `VMON_*` variables `var` gives, over what the file said (tests; `load` reads the
    /// process's environment through the same parsers).
    #[cfg(test)]
    fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> anyhow::Result<()> {
        self.apply(env::Overrides::from_vars(var)?)
    }

    /// Each variable that is set replaces its setting; then the settings are checked together.
    fn apply(&mut self, o: env::Overrides) -> anyhow::Result<()> {
        set(&mut self.api_listen, o.api_listen);
        set(&mut self.proxy_listen, o.proxy_listen);
        set(&mut self.api_url, o.api_url.map(Some));
        set(&mut self.sandbox_url, o.sandbox_url.map(Some));
        set(
            &mut self.domain,
            o.domain.map(|v| (!v.is_empty()).then_some(v)),
        );
        set(
            &mut self.prebuild_code_interpreter,
            o.prebuild_code_interpreter,
        );
        set(&mut self.migration_downtime_ms, o.migration_downtime_ms);
        set(
            &mut self.fault_dir,
            o.fault_dir.and_then(env::path).map(Some),
        );
        set(&mut self.client_id, o.client_id);
        set(&mut self.node_grace_secs, o.node_grace_secs);
        set(&mut self.lock_wait_secs, o.lock_wait_secs);
        set(&mut self.default_limits.max_concurrent, o.max_concurrent);
        set(
            &mut self.default_limits.max_lifetime_secs,
            o.max_lifetime_secs,
        );
        set(
            &mut self.store_url,
            o.store_url.map(|v| (!v.is_empty()).then_some(v)),
        );
        set(
            &mut self.webhook_key_file,
            o.webhook_key_file.map(env::path),
        );
        set(&mut self.webhook_allow, o.webhook_allow);
        set(&mut self.private_allow, o.private_allow);
        set(&mut self.insecure_registries, o.insecure_registries);
        set(&mut self.registry_allow, o.registry_allow);
        let token = o.metrics_token.map(|v| v.trim().to_string());
        set(
            &mut self.metrics_token,
            token.map(|v| (!v.is_empty()).then_some(v)),
        );
        set(&mut self.webhook_ca_file, o.webhook_ca_file.map(env::path));
        let q = &mut self.quotas;
        set(&mut q.max_paused, o.max_paused);
        set(&mut q.max_snapshots, o.max_snapshots);
        set(&mut q.max_webhooks, o.max_webhooks);
        set(&mut q.max_volumes, o.max_volumes);
        set(&mut q.max_volume_bytes, o.max_volume_bytes);
        set(&mut q.max_secrets, o.max_secrets);
        set(&mut q.max_template_files, o.max_template_files);
        set(&mut q.max_template_file_bytes, o.max_template_file_bytes);
        set(
            &mut self.template_files_grace_secs,
            o.template_files_grace_secs,
        );
        set(&mut self.volumes_dir, o.volumes_dir.map(env::path));
        set(&mut self.volume_key_file, o.volume_key_file.map(env::path));
        set(&mut self.volume_token_ttl_secs, o.volume_token_ttl_secs);
        set(&mut self.volume_store, o.volume_store);
        set(&mut self.s3_mount_endpoints, o.s3_mount_endpoints);
        set(&mut self.proxy_tls_cert, o.proxy_tls_cert.map(env::path));
        set(&mut self.proxy_tls_key, o.proxy_tls_key.map(env::path));
        set(&mut self.api_tls_cert, o.api_tls_cert.map(env::path));
        set(&mut self.api_tls_key, o.api_tls_key.map(env::path));
        set(&mut self.api_ca_file, o.api_ca_file.map(env::path));
        if let Some(secs) = o.idle_max_idle_secs {
            self.idle.default = (secs > 0).then(|| IdleDefault {
                max_idle_seconds: secs,
                ..self.idle.default.clone().unwrap_or_default()
            });
        }
        set(&mut self.idle.scan_interval_ms, o.idle_scan_ms);
        let limits = &mut self.proxy_limits;
        set(&mut limits.max_per_sandbox, o.proxy_max_per_sandbox);
        set(&mut limits.max_per_client, o.proxy_max_per_client);
        set(&mut limits.header_timeout_secs, o.proxy_header_timeout_secs);
        set(&mut limits.idle_body_secs, o.proxy_idle_body_secs);
        set(
            &mut limits.signed_misses_per_minute,
            o.proxy_signed_misses_per_minute,
        );
        set(&mut self.base_template.vcpus, o.base_vcpus);
        set(&mut self.base_template.memory_mb, o.base_memory_mb);
        set(&mut self.base_template.disk_mb, o.base_disk_mb);
        self.check()
    }

    /// What the file and the variables must agree on together.
    fn check(&self) -> anyhow::Result<()> {
        vmon_proto::ranges::check_ranges(&self.private_allow)
            .map_err(|e| anyhow::anyhow!("private_allow: {e}"))?;
        for c in &self.registry_allow {
            c.parse::<vmon_proto::addrs::Cidr>()
                .map_err(|e| anyhow::anyhow!("registry_allow: {e}"))?;
        }
        for e in &self.s3_mount_endpoints {
            normal_endpoint(e).map_err(|why| anyhow::anyhow!("s3_mount_endpoints: {why}"))?;
        }
        for c in self.webhook_allow.iter().filter(|s| !s.trim().is_empty()) {
            c.parse::<vmon_proto::addrs::Cidr>()
                .map_err(|e| anyhow::anyhow!("webhook_allow: {e}"))?;
        }
        if self.proxy_tls_cert.is_some() != self.proxy_tls_key.is_some() {
            anyhow::bail!("proxy_tls_cert and proxy_tls_key (VMON_PROXY_TLS_CERT, VMON_PROXY_TLS_KEY) go together: set both or neither");
        }
        if self.api_tls_cert.is_some() != self.api_tls_key.is_some() {
            anyhow::bail!("api_tls_cert and api_tls_key (VMON_API_TLS_CERT, VMON_API_TLS_KEY) go together: set both or neither");
        }
        let defaults = self.idle.default.iter().chain(self.idle.teams.values());
        for d in defaults {
            if d.max_idle_seconds != 0 && d.max_idle_seconds < MIN_IDLE_SECS {
                anyhow::bail!(
                    "idle: max_idle_seconds is at least {} (0 turns it off), not {}",
                    MIN_IDLE_SECS,
                    d.max_idle_seconds
                );
            }
        }
        Ok(())
    }

    pub fn lock_wait(&self) -> Duration {
        Duration::from_secs(self.lock_wait_secs)
    }

    pub fn api_url(&self) -> String {
        let scheme = if self.api_tls_cert.is_some() {
            "https"
        } else {
            "http"
        };
        self.api_url
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{}", self.api_listen))
    }

    /// The domain the SDK builds `{port}-{sandboxID}.{domain}` hosts from (`get_host`): the
    /// configured one, else `localhost:<proxy port>` when the proxy is reached on this machine
    /// (names under `localhost` are loopback; the proxy routes by that Host). None when the
    /// sandbox URL names some other host: then only a configured domain is right.
    pub fn sandbox_domain(&self) -> Option<String> {
        if let Some(d) = &self.domain {
            return Some(d.clone());
        }
        if self.sandbox_url.is_some() {
            return None;
        }
        let ip = self.proxy_listen.ip();
        (ip.is_loopback() || ip.is_unspecified()).then(|| match self.proxy_listen.port() {
            80 => "localhost".to_string(),
            port => format!("localhost:{port}"),
        })
    }

    pub fn sandbox_url(&self) -> String {
        self.sandbox_url
            .clone()
            .unwrap_or_else(|| format!("http://{}", self.proxy_listen))
    }
}

/// Replaces `field` when the variable was set.
fn set<T>(field: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *field = v;
    }
}

#[cfg(test)]
mod tests;
