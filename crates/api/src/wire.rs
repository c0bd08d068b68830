//! The E2B REST JSON, key for key as the SDK's generated models (`e2b/api/client/models`).
//!
//! Requests ignore unknown keys; responses omit what the SDK treats as unset.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub type StringMap = BTreeMap<String, String>;

/// `NewSandboxV2` (POST /v2/sandboxes) and `NewSandbox` (POST /sandboxes; also `secure`).
#[derive(Debug, Clone, Deserialize, ToSchema)]
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
    #[schema(nullable)]
    pub metadata: StringMap,
    #[serde(rename = "envVars", default, deserialize_with = "nullable_map")]
    #[schema(nullable)]
    pub env_vars: StringMap,
    #[serde(rename = "volumeMounts", default)]
    pub volume_mounts: Option<Vec<VolumeMount>>,
}

fn nullable_map<'de, D: serde::Deserializer<'de>>(d: D) -> Result<StringMap, D::Error> {
    Ok(Option::<StringMap>::deserialize(d)?.unwrap_or_default())
}

#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct AutoResume {
    pub enabled: bool,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq, ToSchema)]
pub struct VolumeMount {
    pub name: String,
    pub path: String,
}

/// `SandboxNetworkConfig`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq, ToSchema)]
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
    /// `${e2b.secrets.<name>}` filled in (`crates/api/src/control/egress.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub rules: Option<serde_json::Value>,
}

/// `SandboxNetworkUpdateConfig` (PUT /sandboxes/{id}/network; replace-all).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct NetworkUpdate {
    #[serde(rename = "allowOut")]
    pub allow_out: Option<Vec<String>>,
    #[serde(rename = "denyOut")]
    pub deny_out: Option<Vec<String>>,
    #[serde(rename = "dnsServers")]
    pub dns_servers: Option<Vec<String>>,
    pub allow_internet_access: Option<bool>,
}

/// `Sandbox`: what create, connect, resume and each fork child answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(rename = "envdAccessToken", skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    #[serde(rename = "trafficAccessToken")]
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Lifecycle {
    #[serde(rename = "autoResume")]
    pub auto_resume: bool,
    /// `"kill"` or `"pause"`.
    #[serde(rename = "onTimeout")]
    pub on_timeout: String,
}

/// `SandboxDetail` (GET /sandboxes/{id}).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    /// `"running"` or `"paused"`.
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(rename = "envdAccessToken", skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    #[serde(rename = "allowInternetAccess")]
    pub allow_internet_access: Option<bool>,
    pub domain: Option<String>,
    pub metadata: StringMap,
    pub network: NetworkConfig,
    pub lifecycle: Lifecycle,
    /// `"full"` or `"filesystem"`, only while paused.
    #[serde(rename = "pauseMode", skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<String>,
    #[serde(
        rename = "envdUnresponsiveAtPause",
        skip_serializing_if = "Option::is_none"
    )]
    pub envd_unresponsive_at_pause: Option<bool>,
    #[serde(rename = "volumeMounts")]
    pub volume_mounts: Vec<VolumeMount>,
}

/// `ListedSandbox` (GET /sandboxes, GET /v2/sandboxes).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u32,
    pub metadata: StringMap,
    pub state: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    #[serde(rename = "volumeMounts")]
    pub volume_mounts: Vec<VolumeMount>,
}

/// `SandboxTimeoutRequest`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TimeoutRequest {
    pub timeout: i64,
}

/// `SandboxRefreshRequest`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct RefreshRequest {
    pub duration: Option<i64>,
}

/// `SandboxPauseRequest`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct PauseRequest {
    pub memory: Option<bool>,
    #[serde(rename = "requireHealthyGuest")]
    pub require_healthy_guest: Option<bool>,
}

/// `ConnectSandboxV2` / `ConnectSandbox` (legacy requires `timeout`; we default it).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ConnectRequest {
    pub timeout: Option<i64>,
    pub memory: Option<bool>,
}

/// `ResumedSandbox` (deprecated POST /sandboxes/{id}/resume).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ResumeRequest {
    pub timeout: Option<i64>,
    #[serde(rename = "autoPause")]
    pub auto_pause: Option<bool>,
    pub memory: Option<bool>,
}

/// `SandboxForkRequest`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ForkRequest {
    pub timeout: Option<i64>,
    pub count: Option<i64>,
}

/// `SandboxForkResult`: exactly one of the two.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// `SandboxSnapshotRequest`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SnapshotRequest {
    pub name: Option<String>,
    pub memory: Option<bool>,
}

/// `SnapshotInfo`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// `Error`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct ErrorBody {
    pub code: u16,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}
