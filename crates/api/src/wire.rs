//! The E2B REST JSON, key for key as the SDK's generated models (`e2b/api/client/models`).
//!
//! Requests ignore unknown keys; responses omit what the SDK treats as unset.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use crate::control::model::{
    AutoResume, IdleSettings, NetworkConfig, NetworkUpdate, NewSandbox, StringMap, VolumeMount,
};

/// A sandbox's idle policy as the api resolved it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct IdleView {
    #[serde(rename = "maxIdleSeconds")]
    pub max_idle_seconds: u64,
    #[serde(rename = "autoResume")]
    pub auto_resume: bool,
    #[serde(rename = "suspendedDurationSeconds")]
    pub suspended_duration_seconds: u64,
}

/// The last resume of a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct LastResumeView {
    /// `restore` (memory from the paused build), `parked` (the kept QEMU continued) or
    /// `cold_boot` (booted from the disk: processes were lost).
    pub kind: String,
    /// The node's start, from the call to envd's `/init` answered.
    #[serde(rename = "durationMs")]
    pub duration_ms: u64,
    pub at: String,
    /// `connect` (a connect or resume call) or `traffic` (the proxy's auto-resume).
    pub trigger: String,
}

/// `GET /sandboxes/{id}/health` (vmon's, not E2B's).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SandboxHealth {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// `"running"` or `"paused"`.
    pub state: String,
    /// Resumes that kept the sandbox's memory (processes alive).
    #[serde(rename = "resumeGeneration")]
    pub resume_generation: u32,
    /// The last resume was a cold boot: processes and memory were lost.
    #[serde(rename = "kernelStateLost")]
    pub kernel_state_lost: bool,
    #[serde(rename = "lastResume")]
    pub last_resume: Option<LastResumeView>,
    /// Where the sandbox's state is: `running`, `parked` (paused, its stopped QEMU kept),
    /// `disk` (paused, the build on its node's disk), `object_store` (only in the store),
    /// `unknown` (no node answered).
    #[serde(rename = "stateLocation")]
    pub state_location: String,
    /// Paused and the paused build is in the object store (another node can resume it).
    #[serde(rename = "inObjectStore")]
    pub in_object_store: bool,
    #[serde(rename = "vmonIdle")]
    pub idle: Option<IdleView>,
    /// Paused by its idle policy.
    #[serde(rename = "idleSuspended")]
    pub idle_suspended: bool,
    /// While idle-suspended: when it ends.
    #[serde(rename = "suspendedUntil", skip_serializing_if = "Option::is_none")]
    pub suspended_until: Option<String>,
    /// Running: seconds since its last traffic as this api knows it.
    #[serde(rename = "idleSeconds", skip_serializing_if = "Option::is_none")]
    pub idle_seconds: Option<u64>,
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
    /// vmon's bucket mounts, as the create named them (secrets by name).
    #[serde(
        rename = "vmonS3Mounts",
        skip_serializing_if = "Vec::is_empty",
        default
    )]
    pub s3_mounts: Vec<crate::control::model::S3Mount>,
    /// vmon's (the SDKs ignore unknown keys): see [`SandboxHealth`].
    #[serde(rename = "resumeGeneration")]
    pub resume_generation: u32,
    #[serde(rename = "kernelStateLost")]
    pub kernel_state_lost: bool,
    #[serde(rename = "lastResume", skip_serializing_if = "Option::is_none")]
    pub last_resume: Option<LastResumeView>,
    #[serde(rename = "stateLocation")]
    pub state_location: String,
    #[serde(rename = "vmonIdle", skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdleView>,
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
