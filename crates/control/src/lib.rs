//! vmon-control: the control plane's domain, without HTTP. The per-sandbox state machine:
//! running → pausing → paused → resuming → running; snapshotting and forking (transient);
//! killing → gone.
//!
//! Every transition of one sandbox holds its KV lock (`sandbox/<id>`, waiting up to the
//! configured two minutes for another holder), calls the node, and then commits the new record
//! together with its lifecycle event through [`Control::commit`], the one place state changes
//! are written. HTTP handlers run transitions in spawned tasks so they finish even when the
//! client goes away.
//!
//! Also here: the records (`records`, the port `records::Records` and its store), the
//! configuration (`config`), ids and keys (`ids`), the platform counters (`platform`),
//! template builds (`templates`: steps, image references, the build itself, collecting
//! uploaded files) and the volumes' trees (`volumes::tree`). Every operation fails with a
//! [`ControlError`]; `vmon-api` turns those into HTTP answers in one place and makes the
//! E2B views of the records (this crate knows no status code and no route).

pub mod config;
pub mod ids;
pub mod platform;
pub mod records;
pub mod telemetry;
pub mod templates;

mod builtin;
pub use builtin::{builtin, Builtin, CODE_INTERPRETER};
mod checkpoint;
mod cluster;
mod collect;
mod delivery;
pub mod desktop;
mod egress;
mod error;
pub use error::{ControlError, ControlResult};
mod gpus;
mod health;
pub use health::{kernel_state_lost, Health};
mod idle;
mod lifecycle;
mod migrate;
pub mod model;
mod network;
mod reaper;
mod recovery;
mod resume;
mod routes;
pub mod s3mounts;
mod signers;
mod targets;
pub mod uploads;
pub mod volumes;
mod why;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use time::OffsetDateTime;
use vmon_kv::{Kv, KvError, LockGuard};
use vmon_proto::node::{NetworkPolicy, NodeControl};
use vmon_proxy::SandboxRoute;

pub use crate::config::Config;
use crate::records::{
    Change, Committed, EventKind, LifecycleEvent, Records, SandboxRecord, SandboxState, Team,
};

pub use checkpoint::{parse_template_ref, SnapshotNames, TemplateRef};
pub use collect::COLLECT_GRACE;
pub use idle::{DEFAULT_IDLE_SECS, METADATA_PREFIX as IDLE_METADATA_PREFIX, MIN_IDLE_SECS};

fn route_of(rec: &SandboxRecord) -> SandboxRoute {
    SandboxRoute {
        guest_ip: match rec.state {
            SandboxState::Running => rec.guest_ip,
            SandboxState::Paused => None,
        },
        auto_resume: idle::resumes_on_traffic(rec),
        traffic_access_token: rec.traffic_access_token.clone(),
        via: None,
        execution_id: Some(rec.execution_id.clone()),
    }
}

/// Whether `name` is a built-in template's (`code-interpreter-v1`, `desktop`).
pub fn builtin_name(name: &str) -> bool {
    builtin::builtin(name).is_some()
}
pub use delivery::{signature, DeliveryPolicy, WebhookPayload};
pub use lifecycle::{CreateParams, KillReason};
pub use migrate::DrainStatus;
pub use routes::ProxyRoutes;
pub use targets::WebhookTargets;

/// The control plane's core, shared by the REST handlers, the reaper and the proxy.
pub struct Control {
    pub(crate) config: Config,
    pub(crate) node: Arc<dyn NodeControl>,
    /// The members' view when `node` is a cluster of nodes: routes are then read from the
    /// store (every replica's commits land there) and the leader reconciles node by node.
    pub(crate) cluster: Option<Arc<dyn vmon_proto::cluster::Cluster>>,
    /// Admission units that may have lost their holder (`cluster.rs`).
    leaks: cluster::Leaks,
    /// Nodes whose registration lapsed, since when this api saw them gone (`cluster.rs`).
    suspects: cluster::Suspects,
    pub(crate) records: Arc<dyn Records>,
    pub(crate) kv: Kv,
    /// What the proxy needs per sandbox, kept in step with every commit.
    routes: RwLock<HashMap<String, SandboxRoute>>,
    /// Every sandbox's envd token, for signed `/files` URLs that name no sandbox
    /// (`signers.rs`); kept with the routes.
    signers: signers::Signers,
    /// Wakes this process's webhook dispatcher after a commit queued deliveries.
    pub(crate) deliveries_due: tokio::sync::Notify,
    pub(crate) delivery_policy: DeliveryPolicy,
    /// Where webhooks may go (`targets.rs`).
    pub(crate) webhook_targets: Arc<WebhookTargets>,
    /// One lock per builtin template (`builtin.rs`), held while it is being built: builtins
    /// never wait for each other's builds.
    builtin_builds: builtin::BuiltinLocks,
    /// The first build (guest image, `base`): creates answer 503 with it until it is ready.
    startup: vmon_proto::progress::Progress,
    /// Template builds that may run at once (more wait as `waiting`).
    pub(crate) template_builds: tokio::sync::Semaphore,
    /// Template build uploads: their signer and directory.
    uploads: uploads::Uploads,
    /// Volumes (`crate::volumes`); `None` when the config names no volumes directory.
    volumes: Option<Arc<volumes::Volumes>>,
    /// When each sandbox last had traffic (`idle.rs`); the in-process proxy's own table.
    activity: Arc<vmon_proxy::Activity>,
    /// Test-only holds in transitions (`vmon_faults`); off unless `VMON_FAULT_DIR`.
    faults: vmon_faults::Faults,
}

impl Control {
    /// Builds the core and reconciles records with what the node is really running. Creates
    /// answer 503 until [`Control::ensure_base`] has succeeded.
    pub async fn open(
        config: Config,
        node: Arc<dyn NodeControl>,
        records: Arc<dyn Records>,
        kv: Kv,
    ) -> anyhow::Result<Arc<Control>> {
        let startup = vmon_proto::progress::Progress::new(builtin::BASE_BUILD);
        Self::open_with(config, node, records, kv, startup).await
    }

    /// [`Control::open`] with the first build's progress handle, which the in-process node's
    /// image build may report into as well.
    pub async fn open_with(
        config: Config,
        node: Arc<dyn NodeControl>,
        records: Arc<dyn Records>,
        kv: Kv,
        startup: vmon_proto::progress::Progress,
    ) -> anyhow::Result<Arc<Control>> {
        Self::open_parts(config, node, None, records, kv, startup).await
    }

    /// [`Control::open_with`] over a cluster of nodes: `node` routes each call to its member,
    /// `cluster` is the members' view (the same object, as `vmon_cluster::ClusterNodes`).
    pub async fn open_cluster(
        config: Config,
        node: Arc<dyn NodeControl>,
        cluster: Arc<dyn vmon_proto::cluster::Cluster>,
        records: Arc<dyn Records>,
        kv: Kv,
        startup: vmon_proto::progress::Progress,
    ) -> anyhow::Result<Arc<Control>> {
        Self::open_parts(config, node, Some(cluster), records, kv, startup).await
    }

    async fn open_parts(
        config: Config,
        node: Arc<dyn NodeControl>,
        cluster: Option<Arc<dyn vmon_proto::cluster::Cluster>>,
        records: Arc<dyn Records>,
        kv: Kv,
        startup: vmon_proto::progress::Progress,
    ) -> anyhow::Result<Arc<Control>> {
        let webhook_targets = Arc::new(
            WebhookTargets::new(&config.webhook_allow)
                .map_err(|e| anyhow::anyhow!("webhook_allow: {e}"))?,
        );
        let config_builds = config.max_template_builds.max(1);
        let config_fault_dir = config.fault_dir.clone();
        // No shared fallback such as /tmp: uploads are tenant bytes, kept where the operator
        // put the data dir.
        let template_files = config.template_files_dir.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "template_files_dir is not set (Config::load makes it <data dir>/template-files)"
            )
        })?;
        let volumes = match (&config.volumes_dir, &config.volume_key_file) {
            (Some(dir), Some(key)) => Some(Arc::new(volumes::Volumes::open(
                dir,
                key,
                Duration::from_secs(config.volume_token_ttl_secs.max(1)),
            )?)),
            _ => None,
        };
        let control = Arc::new(Control {
            volumes,
            config,
            webhook_targets,
            node,
            cluster,
            leaks: cluster::Leaks::default(),
            suspects: cluster::Suspects::default(),
            records,
            kv,
            routes: RwLock::new(HashMap::new()),
            signers: signers::Signers::default(),
            deliveries_due: tokio::sync::Notify::new(),
            delivery_policy: DeliveryPolicy::default(),
            builtin_builds: builtin::BuiltinLocks::default(),
            startup,
            template_builds: tokio::sync::Semaphore::new(config_builds),
            uploads: uploads::Uploads::new(template_files),
            activity: vmon_proxy::Activity::new(),
            faults: match &config_fault_dir {
                Some(d) => vmon_faults::Faults::in_dir(d),
                None => vmon_faults::Faults::off(),
            },
        });
        control.reconcile().await?;
        if control.cluster.is_some() {
            control.reload_signers(true).await;
        }
        control.end_interrupted_builds().await?;
        Ok(control)
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The fault points of this process (tests; see `vmon_faults`), for the
    /// in-process proxy to share.
    pub fn faults(&self) -> &vmon_faults::Faults {
        &self.faults
    }

    /// How far the first build is (`GET /health`, the 503 of a create meanwhile).
    pub fn startup(&self) -> &vmon_proto::progress::Progress {
        &self.startup
    }

    pub fn uploads(&self) -> &uploads::Uploads {
        &self.uploads
    }

    /// Whether the namespace `slug` holds a template or snapshot named `name`.
    pub async fn name_taken(&self, slug: &str, name: &str) -> ControlResult<bool> {
        self.records
            .alias_in_use(&format!("{slug}/{name}"))
            .await
            .map_err(record_error)
    }

    pub fn volumes(&self) -> Option<&Arc<volumes::Volumes>> {
        self.volumes.as_ref()
    }

    pub fn webhook_targets(&self) -> &WebhookTargets {
        &self.webhook_targets
    }

    pub fn records(&self) -> &Arc<dyn Records> {
        &self.records
    }

    pub fn node(&self) -> &Arc<dyn NodeControl> {
        &self.node
    }

    /// Whether a template build triggered now would start at once (else it waits as
    /// `waiting` for a slot).
    pub fn template_build_slot_free(&self) -> bool {
        self.template_builds.available_permits() > 0
    }

    /// The one door for state changes: writes the record change and its event together, under
    /// `fence` (the token of the sandbox lock the caller holds), and keeps the proxy's routes in
    /// step. A record that moved on meanwhile (another execution, a newer lock holder) is left
    /// alone and the change answers 409.
    pub(crate) async fn commit(
        &self,
        change: Change,
        event: LifecycleEvent,
        fence: i64,
    ) -> ControlResult<()> {
        let sandbox_id = event.sandbox_id.clone();
        let route_update = match &change {
            Change::Insert(rec) | Change::Update { record: rec, .. } => {
                Some(Ok(rec.as_ref().clone()))
            }
            Change::Delete { sandbox_id, .. } => Some(Err(sandbox_id.clone())),
            Change::Checkpoint { .. } => None,
        };
        let committed = self
            .records
            .commit(change, event, fence)
            .await
            .map_err(|e| {
                ControlError::internal(format!("writing the sandbox record failed: {e:#}"))
            })?;
        if committed == Committed::Stale {
            return Err(ControlError::conflict(format!(
                "sandbox {sandbox_id} was changed by another operation; try again"
            )));
        }
        self.deliveries_due.notify_one();
        match route_update {
            Some(Ok(rec)) => self.set_route(&rec),
            Some(Err(id)) => {
                self.routes_mut().remove(&id);
                self.signers.remove(&id);
                self.activity.forget(&id);
                if self.cluster.is_some() {
                    let _ = self.kv.delete(&format!("activity/{id}")).await;
                }
            }
            None => {}
        }
        Ok(())
    }

    fn set_route(&self, rec: &SandboxRecord) {
        self.routes_mut().insert(rec.id.clone(), route_of(rec));
        self.signers.set(&rec.id, &rec.envd_access_token);
    }

    fn routes_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, SandboxRoute>> {
        self.routes.write().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) async fn route(&self, id: &str) -> Option<SandboxRoute> {
        if self.cluster.is_some() {
            // Another replica may have made the last change: the store has it.
            let rec = self.records.sandbox(id).await.ok()??;
            let mut route = route_of(&rec);
            // A live migration moves the guest before the record says so: the placement
            // carries its address on the node it runs on now.
            if route.guest_ip.is_some() {
                if let Some(ip) = self.located_ip(id).await {
                    route.guest_ip = Some(ip);
                }
            }
            return Some(route);
        }
        self.routes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// In a cluster: the host of the node a sandbox runs on and the ingress there (the proxy
    /// a proxy on another host hands its traffic to).
    /// Also the guest's address there when the placement carries it (read with the node, in
    /// one read, so the two always belong together).
    pub async fn node_location(
        &self,
        id: &str,
    ) -> Option<(String, Option<String>, Option<std::net::IpAddr>)> {
        let cluster = self.cluster.as_ref()?;
        let (node, ip) = cluster.location(id).await?;
        let info = cluster.members().await.into_iter().find(|n| n.id == node)?;
        Some((info.host, info.ingress_url, ip))
    }

    async fn located_ip(&self, id: &str) -> Option<std::net::IpAddr> {
        self.cluster.as_ref()?.location(id).await?.1
    }

    /// The cluster's registered nodes (empty on one machine).
    pub async fn members(&self) -> Vec<vmon_proto::cluster::NodeInfo> {
        match &self.cluster {
            Some(c) => c.members().await,
            None => Vec::new(),
        }
    }

    /// In a cluster: the node a sandbox was last started on.
    pub async fn placement(&self, id: &str) -> Option<String> {
        self.cluster.as_ref()?.placement(id).await
    }

    /// Takes the sandbox's transition lock. Fault point `lock:busy`: another transition holds
    /// it and this one is about to wait.
    pub(crate) async fn lock(&self, sandbox_id: &str) -> ControlResult<LockGuard> {
        let key = format!("sandbox/{sandbox_id}");
        if self.faults.enabled() {
            // Tests learn that a call queued behind a held transition before they let go.
            match self.kv.lock(&key, Duration::ZERO).await {
                Ok(g) => return Ok(g),
                Err(KvError::LockTimeout) => self.faults.point("lock:busy", sandbox_id).await,
                Err(e) => return Err(kv_error(e)),
            }
        }
        match self.kv.lock(&key, self.config.lock_wait()).await {
            Ok(g) => Ok(g),
            Err(KvError::LockTimeout) => Err(ControlError::conflict(format!(
                "sandbox {sandbox_id} is busy with another operation; try again"
            ))),
            Err(e) => Err(kv_error(e)),
        }
    }

    /// The team's sandbox record, or 404 (also for another team's sandbox).
    pub(crate) async fn owned(&self, team: &Team, id: &str) -> ControlResult<SandboxRecord> {
        if !crate::ids::plausible_sandbox_id(id) {
            return Err(ControlError::sandbox_not_found(id));
        }
        match self.records.sandbox(id).await.map_err(record_error)? {
            Some(rec) if rec.team_id == team.id => Ok(rec),
            _ => Err(ControlError::sandbox_not_found(id)),
        }
    }

    /// Every sandbox of the team (or of all teams), running and paused.
    pub async fn sandboxes(&self, team_id: Option<&str>) -> ControlResult<Vec<SandboxRecord>> {
        self.records.sandboxes(team_id).await.map_err(record_error)
    }

    /// One page of the team's sandboxes (`GET /v2/sandboxes`): the store filters, orders and
    /// pages, so a page costs the same at 10 or 10,000 sandboxes.
    pub async fn sandbox_page(
        &self,
        team: &Team,
        mut listing: records::SandboxListing,
    ) -> ControlResult<records::SandboxPage> {
        listing.team_id = team.id.clone();
        self.records
            .sandbox_page(&listing)
            .await
            .map_err(record_error)
    }

    /// The team's sandbox and where its state is (see [`Control::state_location`]).
    pub async fn detail(
        &self,
        team: &Team,
        id: &str,
    ) -> ControlResult<(SandboxRecord, &'static str)> {
        let rec = self.owned(team, id).await?;
        let (location, _) = self.state_location(&rec).await;
        Ok((rec, location))
    }

    /// Deletes a build that only one sandbox used; the node refuses while something still
    /// depends on it, which is fine: it is then someone else's to delete.
    pub(crate) async fn drop_build(&self, build_id: &str) {
        match self.node.delete_build(build_id).await {
            Ok(()) => tracing::debug!(build_id, "build deleted"),
            Err(e) => tracing::debug!(build_id, error = %e, "build kept"),
        }
    }

    /// The latest end time the team's lifetime cap allows for a run that started at `started`.
    /// A cap beyond what a date holds (an admin may give any u64) is no cap: the last instant
    /// of year 9999, never an overflow.
    pub(crate) fn lifetime_cap(team: &Team, started: OffsetDateTime) -> OffsetDateTime {
        i64::try_from(team.limits.max_lifetime_secs)
            .ok()
            .and_then(|secs| started.checked_add(time::Duration::seconds(secs)))
            .unwrap_or_else(|| {
                time::PrimitiveDateTime::new(time::Date::MAX, time::Time::MAX).assume_utc()
            })
    }
}

pub(crate) fn admission_key(team_id: &str) -> String {
    format!("team/{team_id}/running")
}

pub(crate) fn network_policy(rec: &SandboxRecord) -> NetworkPolicy {
    NetworkPolicy {
        allow_internet_access: rec.allow_internet_access.unwrap_or(true),
        allow_out: rec.network.allow_out.clone().unwrap_or_default(),
        deny_out: rec.network.deny_out.clone().unwrap_or_default(),
    }
}

pub(crate) fn event(
    rec: &SandboxRecord,
    kind: EventKind,
    data: serde_json::Value,
) -> LifecycleEvent {
    LifecycleEvent {
        kind,
        sandbox_id: rec.id.clone(),
        execution_id: rec.execution_id.clone(),
        team_id: rec.team_id.clone(),
        template_id: rec.template_id.clone(),
        build_id: rec.build.build_id.clone(),
        data,
        at: OffsetDateTime::now_utc(),
    }
}

/// `t` to the microsecond: what the API reports and what clients (Python's datetime) hold, so
/// a time a client sends back compares equal to the one it was given.
pub fn to_micros(t: OffsetDateTime) -> OffsetDateTime {
    t.replace_nanosecond(t.nanosecond() / 1000 * 1000)
        .unwrap_or(t)
}

pub fn rfc3339(t: OffsetDateTime) -> String {
    to_micros(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.unix_timestamp().to_string())
}

pub fn kv_error(e: KvError) -> ControlError {
    ControlError::Kv(e)
}

pub fn record_error(e: anyhow::Error) -> ControlError {
    ControlError::Records(e)
}

/// Timeouts arrive as signed integers; negative ones are a client error.
/// The longest timeout any request may name (ten years): past it a date would not fit, and no
/// team's lifetime is longer. Team limits are checked against the value afterwards.
pub const MAX_TIMEOUT_SECS: u64 = 10 * 366 * 24 * 3600;

pub fn timeout_secs(value: i64, what: &str) -> ControlResult<u64> {
    let v = u64::try_from(value)
        .map_err(|_| ControlError::bad_request(format!("{what} must not be negative")))?;
    if v > MAX_TIMEOUT_SECS {
        return Err(ControlError::bad_request(format!(
            "{what} must be at most {MAX_TIMEOUT_SECS} seconds"
        )));
    }
    Ok(v)
}

/// Bounds on what a create carries: metadata and environment variables.
pub const MAX_METADATA_ENTRIES: usize = 100;
pub const MAX_METADATA_KEY: usize = 256;
pub const MAX_METADATA_VALUE: usize = 4096;
pub const MAX_ENV_ENTRIES: usize = 1000;
pub const MAX_ENV_KEY: usize = 256;
pub const MAX_ENV_VALUE: usize = 128 * 1024;
pub const MAX_ENV_TOTAL: usize = 1024 * 1024;

/// 400 when `metadata` or `envVars` is larger than the bounds above (or an env name is not a
/// name a shell can hold).
pub fn check_maps(metadata: &model::StringMap, env: &model::StringMap) -> ControlResult<()> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(ControlError::bad_request(format!(
            "metadata may hold at most {MAX_METADATA_ENTRIES} entries"
        )));
    }
    for (k, v) in metadata {
        if k.is_empty() || k.len() > MAX_METADATA_KEY || v.len() > MAX_METADATA_VALUE {
            return Err(ControlError::bad_request(format!(
                "metadata keys are 1-{MAX_METADATA_KEY} bytes and values at most {MAX_METADATA_VALUE} bytes"
            )));
        }
    }
    if env.len() > MAX_ENV_ENTRIES {
        return Err(ControlError::bad_request(format!(
            "envVars may hold at most {MAX_ENV_ENTRIES} entries"
        )));
    }
    let mut total = 0;
    for (k, v) in env {
        let name_ok = !k.is_empty()
            && k.len() <= MAX_ENV_KEY
            && !k.contains(['=', '\0'])
            && !v.contains('\0');
        if !name_ok || v.len() > MAX_ENV_VALUE {
            return Err(ControlError::bad_request(format!(
                "envVars names are 1-{MAX_ENV_KEY} bytes without '=' or NUL, values at most {MAX_ENV_VALUE} bytes"
            )));
        }
        total += k.len() + v.len();
    }
    if total > MAX_ENV_TOTAL {
        return Err(ControlError::bad_request(format!(
            "envVars may hold at most {MAX_ENV_TOTAL} bytes in all"
        )));
    }
    Ok(())
}

/// The 429 of a team at its concurrent-sandbox limit.
impl Control {
    /// Takes one of the team's concurrent-sandbox slots (429 when none is free); the caller
    /// releases the returned counter if its transition fails.
    pub(crate) async fn admit(&self, team: &Team) -> ControlResult<String> {
        let counter = admission_key(&team.id);
        if !self
            .kv
            .acquire(&counter, u64::from(team.limits.max_concurrent))
            .await
            .map_err(kv_error)?
        {
            return Err(concurrency_error(team));
        }
        Ok(counter)
    }
}

pub(crate) fn concurrency_error(team: &Team) -> ControlError {
    ControlError::too_many(format!(
        "you have reached the maximum number of concurrent sandboxes ({}); kill or pause one first",
        team.limits.max_concurrent
    ))
}
