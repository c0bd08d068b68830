//! What a sandbox is asked to be, in E2B's JSON (create, network updates, idle settings) and
//! as its record keeps it (metadata, network, volume mounts). The api's `wire.rs` re-exports
//! these as its request types; the views it answers are its own.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub type StringMap = BTreeMap<String, String>;

/// `NewSandboxV2` (POST /v2/sandboxes) and `NewSandbox` (POST /sandboxes; also `secure`).
#[derive(Debug, Clone, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<i64>,
    #[serde(rename = "autoPause")]
    pub auto_pause: Option<bool>,
    #[serde(rename = "autoPauseMemory")]
    pub auto_pause_memory: Option<bool>,
    #[serde(rename = "autoResume")]
    pub auto_resume: Option<AutoResume>,
    pub allow_internet_access: Option<bool>,
    pub network: Option<NetworkConfig>,
    #[serde(default, deserialize_with = "nullable_map")]
    #[cfg_attr(feature = "openapi", schema(nullable))]
    pub metadata: StringMap,
    #[serde(rename = "envVars", default, deserialize_with = "nullable_map")]
    #[cfg_attr(feature = "openapi", schema(nullable))]
    pub env_vars: StringMap,
    #[serde(rename = "volumeMounts", default)]
    pub volume_mounts: Option<Vec<VolumeMount>>,
    /// vmon's bucket mounts (not E2B's): prefixes of S3 buckets as directories in the guest
    /// (`crates/control/src/s3mounts.rs`).
    #[serde(rename = "vmonS3Mounts", default)]
    #[cfg_attr(feature = "openapi", schema(nullable))]
    pub vmon_s3_mounts: Option<Vec<S3Mount>>,
    /// vmon's idle auto-suspend (not E2B's): an object, or `null` for none. Absent: the
    /// `vmon.idle.*` metadata keys, else the team's default from the config.
    #[serde(rename = "vmonIdle", default, deserialize_with = "present")]
    #[cfg_attr(feature = "openapi", schema(nullable, value_type = Option<IdleSettings>))]
    pub vmon_idle: Option<Option<IdleSettings>>,
}

/// Tells a `null` (`Some(None)`) from an absent key (`None`, by `#[serde(default)]`).
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Ok(Some(Option::<T>::deserialize(d)?))
}

/// Seed 004's IdlePolicy as a create names it (`vmonIdle`); every field is optional.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct IdleSettings {
    /// Seconds without traffic through the proxy before the sandbox is suspended (at least
    /// 60; default 300; less than the timeout).
    #[serde(rename = "maxIdleSeconds", default)]
    pub max_idle_seconds: Option<i64>,
    /// Whether traffic resumes a suspended sandbox (default true).
    #[serde(rename = "autoResume", default)]
    pub auto_resume: Option<bool>,
    /// How long a suspended sandbox is kept before it ends; 0 ends it instead of suspending
    /// (default: the timeout minus `maxIdleSeconds`).
    #[serde(rename = "suspendedDurationSeconds", default)]
    pub suspended_duration_seconds: Option<i64>,
}

fn nullable_map<'de, D: serde::Deserializer<'de>>(d: D) -> Result<StringMap, D::Error> {
    Ok(Option::<StringMap>::deserialize(d)?.unwrap_or_default())
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AutoResume {
    pub enabled: bool,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeMount {
    pub name: String,
    pub path: String,
}

/// A prefix of an S3 bucket mounted in the guest (`vmonS3Mounts`): each object under
/// `prefix/` a file under `mountPath`. The endpoint must be one the operator allows
/// (`s3_mount_endpoints`; absent: the first of them); `secret` names a team secret whose value
/// is `ACCESS_KEY_ID:SECRET_ACCESS_KEY`, which only the node's S3 client ever sees.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct S3Mount {
    pub bucket: String,
    /// Without a leading `/`; empty or absent: the whole bucket.
    #[serde(default)]
    pub prefix: String,
    #[serde(rename = "mountPath")]
    pub mount_path: String,
    /// Never written back; the guest's writes are refused (EROFS).
    #[serde(rename = "readOnly", default)]
    pub read_only: bool,
    /// `http(s)://host[:port]`; absent: the first of the server's `s3_mount_endpoints`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The signing region (default `us-east-1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// The name of the team secret holding `ACCESS_KEY_ID:SECRET_ACCESS_KEY`.
    pub secret: String,
}

/// `SandboxNetworkConfig`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkConfig {
    #[serde(rename = "allowPublicTraffic", skip_serializing_if = "Option::is_none")]
    pub allow_public_traffic: Option<bool>,
    #[serde(rename = "allowOut", skip_serializing_if = "Option::is_none")]
    pub allow_out: Option<Vec<String>>,
    #[serde(rename = "denyOut", skip_serializing_if = "Option::is_none")]
    pub deny_out: Option<Vec<String>>,
    #[serde(rename = "dnsServers", skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
    #[serde(rename = "maskRequestHost", skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
    /// Per-host request transforms (`{host: [{transform: {headers: {...}}}]}`): the node's
    /// egress proxy sets those headers on the sandbox's HTTPS requests to the host, with
    /// `${e2b.secrets.<name>}` filled in (`crates/control/src/egress.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub rules: Option<serde_json::Value>,
}

/// `SandboxNetworkUpdateConfig` (PUT /sandboxes/{id}/network; replace-all).
#[derive(Debug, Clone, Default, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkUpdate {
    #[serde(rename = "allowOut")]
    pub allow_out: Option<Vec<String>>,
    #[serde(rename = "denyOut")]
    pub deny_out: Option<Vec<String>>,
    #[serde(rename = "dnsServers")]
    pub dns_servers: Option<Vec<String>>,
    pub allow_internet_access: Option<bool>,
}
