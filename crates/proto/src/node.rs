//! The node contract: what the control plane may ask of one host.
//!
//! The calls are written once, in one table (`node/calls.rs`): [`NodeCall`], [`NodeHandler`].
//! In `vmon up` the api calls the node in-process through [`NodeControl`]; in a cluster the
//! same calls travel as node RPC. Every call names the sandbox and the execution it expects, so a
//! stale caller never touches a newer incarnation.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

mod calls;
pub use calls::*;

/// Identifies a build on a node: a template build, a paused sandbox, a fork point or a snapshot.
pub type BuildId = String;

/// Egress policy of a sandbox's slot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkPolicy {
    /// `false` drops all guest egress (E2B `allow_internet_access=false`).
    pub allow_internet_access: bool,
    /// CIDRs, IPs or host names always allowed even when egress is otherwise denied.
    pub allow_out: Vec<String>,
    /// CIDRs, IPs or host names always denied.
    pub deny_out: Vec<String>,
}

/// A DNS name as E2B's `allowOut` takes them (`example.com`, `api.example.com`): letters,
/// digits and hyphens in dot-separated labels, at least one dot, not all-numeric at the end.
pub fn is_host_name(s: &str) -> bool {
    s.len() <= 253
        && s.contains('.')
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
        && !s
            .rsplit('.')
            .next()
            .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
}

/// What a node needs to start (restore or cold-boot) a sandbox from a build.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StartSpec {
    pub sandbox_id: String,
    pub execution_id: String,
    pub build_id: BuildId,
    /// Cold-boot from the build's disk chain instead of restoring its memory.
    pub cold_boot: bool,
    pub env_vars: BTreeMap<String, String>,
    /// Token envd will demand in `X-Access-Token`.
    pub envd_access_token: Option<String>,
    pub network: NetworkPolicy,
    /// Volumes and bucket prefixes to mount (virtio-fs). A sandbox with any is always
    /// cold-booted: a mount's state lives outside the guest's memory and cannot be restored
    /// with it.
    #[serde(default)]
    pub volumes: Vec<VolumeShare>,
    /// Secret injection: the rules of `network.rules` and the values of the secrets they name
    /// (kept in the node's memory only; `Debug` prints no value).
    #[serde(default, skip_serializing_if = "crate::egress::EgressSpec::is_empty")]
    pub egress: crate::egress::EgressSpec,
    /// Whole GPUs to pass through (VFIO). A GPU sandbox always cold-boots, whatever
    /// `cold_boot` says: its devices' state is not in any memory snapshot. A node with fewer
    /// GPUs than this in all refuses with `InvalidArgument`, with fewer free `Exhausted`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub gpus: u32,
}

fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

/// One volume a sandbox mounts: `<volumes dir>/<volume_id>` on the node, `path` in the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeShare {
    pub volume_id: String,
    /// Absolute and clean.
    pub path: String,
    /// The volume lives in the cluster's object store: the node fills `<volumes dir>/<id>`
    /// from it before the mount and writes it back at pause, kill and periodically
    /// (`crates/node/src/node/volume_store.rs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub object_store: bool,
    /// The most bytes (its archive's size) a write-back of an object-store volume keeps;
    /// 0: no limit.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_bytes: u64,
    /// A prefix of a tenant's S3 bucket (`vmonS3Mounts`) instead of a volume: `volume_id`
    /// then names this sandbox's own cache of it on the node (`crates/node/src/node/bucket.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<BucketShare>,
}

/// A bucket prefix a sandbox mounts: each object under `prefix/` a file. The node fills the
/// sandbox's cache from it before the mount and, unless `read_only`, writes what changed back
/// at pause, kill and periodically.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketShare {
    /// `http(s)://host[:port]`, one the operator allows (`s3_mount_endpoints`).
    pub endpoint: String,
    pub region: String,
    pub bucket: String,
    /// Without leading or trailing `/`; empty: the whole bucket.
    #[serde(default)]
    pub prefix: String,
    #[serde(default)]
    pub read_only: bool,
    /// The most bytes (all objects together) a fill fetches and a write-back keeps.
    pub max_bytes: u64,
    /// The most objects a fill fetches.
    pub max_objects: u64,
    /// From the team's secret. Travels in the start call and stays in the node's memory:
    /// `sandbox.json` keeps it empty ([`BucketCredentials::is_empty`]), `Debug` prints no value.
    #[serde(default, skip_serializing_if = "BucketCredentials::is_empty")]
    pub credentials: BucketCredentials,
}

/// An S3 access key pair. `Debug` prints the key id only.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketCredentials {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl BucketCredentials {
    pub fn is_empty(&self) -> bool {
        self.access_key_id.is_empty() && self.secret_access_key.is_empty()
    }
}

impl std::fmt::Debug for BucketCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BucketCredentials")
            .field("access_key_id", &self.access_key_id)
            .finish_non_exhaustive()
    }
}

/// How a volume's files are owned on the host: every volume has a range of
/// [`VOLUME_IDS`] host ids of its own, starting at the owner of its root directory (the
/// node gives it one at its first mount). Guest id `n` is host id `base + n`; the volume's
/// virtiofsd runs in a user namespace with exactly that mapping, so a guest's root is an
/// unprivileged host uid. A root owned by an id below [`VOLUME_IDS`] (a volume never
/// mounted since the ranges came) has base 0: host ids are the guest's.
pub mod volume_ids {
    /// The ids a range maps (guest ids `0..VOLUME_IDS`).
    pub const VOLUME_IDS: u32 = 65_536;
    /// A guest id outside the range reads as `nobody`.
    pub const OVERFLOW: u32 = 65_534;

    /// The base of a volume whose root directory is owned by `root_uid`.
    pub fn base_of(root_uid: u32) -> u32 {
        if root_uid >= VOLUME_IDS {
            root_uid
        } else {
            0
        }
    }

    /// The host id of guest id `id`, None when the range has no such id.
    pub fn to_host(base: u32, id: u32) -> Option<u32> {
        if base == 0 {
            return Some(id);
        }
        (id < VOLUME_IDS).then(|| base + id)
    }

    /// The guest id of host id `host` (ids outside the range read as [`OVERFLOW`]).
    pub fn to_guest(base: u32, host: u32) -> u32 {
        if base == 0 {
            return host;
        }
        match host.checked_sub(base) {
            Some(id) if id < VOLUME_IDS => id,
            _ => OVERFLOW,
        }
    }
}

/// A sandbox that is running on a node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Running {
    pub sandbox_id: String,
    pub execution_id: String,
    /// Where the host reaches the guest (envd is at port 49983 of this IP, other guest
    /// ports likewise).
    pub guest_ip: std::net::IpAddr,
    pub envd_version: String,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
    /// How many memory restores this sandbox's state has been through (0 = fresh boot).
    pub resume_generation: u32,
    /// How this start came about; `None` from a node that does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_kind: Option<StartKind>,
}

/// How a node started a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartKind {
    /// Booted from the build's disk: no process survived.
    ColdBoot,
    /// The build's memory restored into a new (or pooled) QEMU.
    Restore,
    /// The paused sandbox's stopped QEMU, kept since its pause, continued.
    Parked,
}

impl StartKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StartKind::ColdBoot => "cold_boot",
            StartKind::Restore => "restore",
            StartKind::Parked => "parked",
        }
    }
}

/// Where a paused sandbox's state is, as the nodes know it (asked without fetching anything).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PausedState {
    /// Its stopped QEMU is kept (a resume is `cont`).
    pub parked: bool,
    /// The build is on a node's disk.
    pub local: bool,
    /// The build's manifest is in the object store.
    pub stored: bool,
}

impl Running {
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.guest_ip, port)
    }
}

/// Shape and provenance of a build.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuildInfo {
    pub build_id: BuildId,
    /// `true` when the build carries guest memory (restorable with processes alive).
    pub has_memory: bool,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
    pub envd_version: String,
    /// The build this one was derived from, if any.
    pub parent: Option<BuildId>,
    /// Set by `build_info` when the build was made from an older guest image than the node
    /// has now (a newer envd, new packages): a built-in template is then built again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub older_image: bool,
    /// The build's manifest is in the cluster's object store (uploaded by this node, or
    /// fetched from there): another node can restore it. Uploads run in the background after
    /// the call that made the build returned, so `build_info` turns this on later.
    #[serde(default)]
    pub stored: bool,
}

/// A build a pause made, and the run it came from: what a restart needs to finish a pause the
/// node completed but whose record was never written ([`PauseBuilds`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PauseBuild {
    pub sandbox_id: String,
    pub execution_id: String,
    pub build: BuildInfo,
}

/// A build a node keeps, and when its record was written ([`Builds`]): what the
/// api's collector of unnamed builds compares with its records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeptBuild {
    pub build: BuildInfo,
    /// When the node wrote the build's record (Unix seconds): the instant the build began to
    /// exist for the api, whatever the build took before.
    pub recorded_unix: u64,
}

/// How to make a template build from the base image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateSpec {
    pub build_id: BuildId,
    pub vcpus: u32,
    pub memory_mb: u32,
    pub disk_mb: u32,
    /// Run (detached) in the guest before the snapshot is taken.
    pub start_cmd: Option<String>,
    /// Shell command that must exit 0 before the snapshot is taken.
    pub ready_cmd: Option<String>,
    /// `port/path` of a guest HTTP endpoint the restore pool POSTs to (with the build's envd
    /// token as `X-Access-Token`) after warming a process, so the first request a sandbox's
    /// users make of a service in it finds that service's code paths translated (TCG).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_request: Option<String>,
    pub env_vars: BTreeMap<String, String>,
    /// The image in an OCI registry whose root filesystem the template boots instead of the
    /// node's base image (`from_image(...)`), pinned by its digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<OciImage>,
    /// A layer of the node's own the template boots instead of the base image: `desktop`
    /// ([`LAYER_DESKTOP`]: the base tree plus an X desktop, the `desktop` builtin template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<String>,
}

/// The layer of the `desktop` builtin template ([`TemplateSpec::layer`]).
pub const LAYER_DESKTOP: &str = "desktop";

/// An image in an OCI registry (a template's `fromImage`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct OciImage {
    /// As the user wrote it: `[registry[:port]/]repository[:tag|@digest]`.
    pub reference: String,
    /// `sha256:…` of the manifest the reference names; a build pulls exactly this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<RegistryCredentials>,
    /// `false` for a registry allowed plain HTTP (and unverified TLS): a loopback address or
    /// one the operator listed as insecure.
    pub tls_verify: bool,
    /// Private, loopback or link-local ranges (CIDRs) the pull may reach: the operator's
    /// `registry_allow`. Every other such address is refused, the registry's and those it
    /// sends the pull on to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registry_allow: Vec<String>,
}

impl OciImage {
    /// The registry (`host[:port]`) and the fully qualified reference, as Docker reads a
    /// name: no registry part means Docker Hub (`docker.io`, `library/` for one component), no
    /// tag or digest means `:latest`. `None` for what is not an image reference.
    pub fn qualified(&self) -> Option<(String, String)> {
        let r = self.reference.trim();
        let ok = |c: char| c.is_ascii_alphanumeric() || "._-/:@[]".contains(c);
        if r.is_empty() || r.len() > 1024 || !r.chars().all(ok) || r.starts_with('/') {
            return None;
        }
        let (first, rest) = r.split_once('/').unwrap_or(("", r));
        let (registry, path) = if !first.is_empty()
            && (first.contains('.') || first.contains(':') || first == "localhost")
        {
            (first.to_string(), rest.to_string())
        } else if first.is_empty() {
            ("docker.io".to_string(), format!("library/{rest}"))
        } else {
            ("docker.io".to_string(), r.to_string())
        };
        if path.is_empty() || path.split('/').any(str::is_empty) {
            return None;
        }
        let last = path.rsplit('/').next().unwrap_or_default();
        let tagged = path.contains('@') || last.contains(':');
        let path = if tagged {
            path
        } else {
            format!("{path}:latest")
        };
        Some((registry.clone(), format!("{registry}/{path}")))
    }
}

/// A registry login. Kept in memory for one build only; its `Debug` never shows the password.
#[derive(Clone, Default, Serialize, Deserialize)]
pub struct RegistryCredentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCredentials")
            .field("username", &self.username)
            .field("password", &"[redacted]")
            .finish()
    }
}

/// A command a node runs in one of its sandboxes to its end (template build steps).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExecSpec {
    /// Run as `bash -l -c <cmd>`.
    pub cmd: String,
    pub user: String,
    /// Working directory (`None`: the user's home).
    pub cwd: Option<String>,
    pub env: BTreeMap<String, String>,
    pub timeout_secs: u64,
}

/// How an [`ExecSpec`] ended; output is cut at a bound and decoded lossily (a guest wrote it).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ExecOutput {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// A guest's latest self-keepalive ask (envd `GET /keepalive`): how long ago it came and the
/// timeout it asked for from then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeepaliveAsk {
    pub age_ms: u64,
    pub timeout_secs: u64,
}

/// One sample of a guest's usage, scraped by the node from envd `GET /metrics`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricSample {
    /// When the node took the sample (host clock, not the guest's), Unix seconds.
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    /// 0–100 (clamped: the guest reports it).
    pub cpu_used_pct: f32,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Severity of a console log entry, lowest first.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
    }
}

/// Which way a log query walks from its cursor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogDirection {
    /// Oldest first, from the cursor on.
    #[default]
    Forward,
    /// Newest first, from the cursor back.
    Backward,
}

/// A query of a sandbox's console logs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct LogQuery {
    /// Unix milliseconds, inclusive. Forward: entries at or after it (`None`: from the first);
    /// backward: at or before it (`None`: from the last).
    pub cursor_ms: Option<i64>,
    pub direction: LogDirection,
    /// At most this many entries (the node caps it too).
    pub limit: usize,
    /// Only entries at this level or above.
    pub min_level: Option<LogLevel>,
    /// Only entries whose line contains this text (case-insensitive).
    pub search: Option<String>,
}

/// One line of a sandbox's console (kernel text, or a JSON line of the init or envd).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LogEntry {
    /// Unix milliseconds: the guest's own timestamp when it is plausible, else the previous
    /// entry's.
    pub timestamp_ms: i64,
    pub level: LogLevel,
    pub message: String,
    /// Every other key of a JSON line, values as strings.
    pub fields: BTreeMap<String, String>,
    /// The line as the guest wrote it (length-bounded).
    pub line: String,
}

/// What a node needs to receive a running sandbox by live migration: the source describes it
/// ([`MigrateDescribe`]) and the target prepares a QEMU for it
/// ([`MigrateAccept`]) on the same build the sandbox's memory and disk lie over.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrateIn {
    pub sandbox_id: String,
    pub execution_id: String,
    /// The build under the sandbox's memory pages and disk overlay (a template, or the
    /// checkpoint or pause it last resumed from). The target fetches it when it lacks it.
    pub basis: BuildId,
    pub envd_token: Option<String>,
    pub envd_version: String,
    pub network: NetworkPolicy,
    pub resume_generation: u32,
    pub disk_mb: u32,
    pub vcpus: u32,
    pub memory_mb: u32,
    /// How the sandbox's execution started (a move does not change it).
    #[serde(default)]
    pub start_kind: Option<StartKind>,
}

/// What the source node of a live migration is asked to do: send the sandbox's memory, device
/// state and disk writes to the QEMU `migration_id` names on `target_url`'s node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrateOut {
    pub sandbox_id: String,
    pub execution_id: String,
    /// The target's node RPC URL (`http(s)://host:port`).
    pub target_url: String,
    /// The target's node id: with the cluster's CA the source verifies the target's
    /// certificate against it (`vmon_node::tls::node_name`) before sending the token.
    #[serde(default)]
    pub target_id: Option<String>,
    pub migration_id: String,
    /// The longest pause of the guest QEMU may plan for the last copy round (ms).
    pub downtime_ms: u64,
    /// The whole copy ends in failure after this long (the sandbox keeps running).
    pub timeout_secs: u64,
}

/// How a live migration's copy went, as the source measured it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MigrateStats {
    /// From the first byte to the source's QEMU handing over (ms).
    pub copy_ms: u64,
    /// The guest was stopped on the source from this moment; QEMU's own downtime (ms).
    pub qemu_downtime_ms: u64,
    /// Guest memory bytes sent (all rounds).
    pub ram_bytes: u64,
    /// Disk bytes the mirror copied (the overlay's writes).
    pub disk_bytes: u64,
    /// Memory copy rounds.
    pub rounds: u64,
    /// How long the guest was stopped on the source before it handed over (the mirror's
    /// completion and QEMU's last round), ms.
    #[serde(default)]
    pub stopped_ms: u64,
    /// Guest pages the source compared with the target's after QEMU's last round.
    #[serde(default)]
    pub checked_pages: u64,
    /// Of those, pages the target held otherwise (writes QEMU's copy missed), repaired.
    #[serde(default)]
    pub repaired_pages: u64,
    /// How long that check took (within `stopped_ms`), ms.
    #[serde(default)]
    pub check_ms: u64,
}

#[derive(Debug, thiserror::Error, Serialize, Deserialize)]
pub enum NodeError {
    #[error("sandbox {0} is not on this node")]
    NotFound(String),
    #[error("build {0} was not found")]
    BuildNotFound(String),
    #[error("build {0} is still in use")]
    BuildInUse(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("the node is out of capacity: {0}")]
    Exhausted(String),
    #[error("{0}")]
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(r: &str) -> Option<(String, String)> {
        OciImage {
            reference: r.into(),
            ..Default::default()
        }
        .qualified()
    }

    #[test]
    fn image_references_are_read_as_docker_reads_them() {
        let p = |a: &str, b: &str| Some((a.to_string(), b.to_string()));
        assert_eq!(
            q("127.0.0.1:5000/test/img:1"),
            p("127.0.0.1:5000", "127.0.0.1:5000/test/img:1")
        );
        assert_eq!(q("localhost/x"), p("localhost", "localhost/x:latest"));
        assert_eq!(
            q("ubuntu"),
            p("docker.io", "docker.io/library/ubuntu:latest")
        );
        assert_eq!(q("org/app:v2"), p("docker.io", "docker.io/org/app:v2"));
        assert_eq!(
            q("ghcr.io/o/a@sha256:00"),
            p("ghcr.io", "ghcr.io/o/a@sha256:00")
        );
        assert_eq!(q(""), None);
        assert_eq!(q("a b"), None);
        assert_eq!(q("x//y"), None);
    }

    #[test]
    fn credentials_never_show_their_password() {
        let c = RegistryCredentials {
            username: "me".into(),
            password: "hunter2".into(),
        };
        let shown = format!("{c:?}");
        assert!(
            shown.contains("me") && !shown.contains("hunter2"),
            "{shown}"
        );
    }
}
