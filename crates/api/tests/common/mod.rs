//! Parts for the api's integration tests: a fake node, the real records store (SQLite) and an
//! embedded KV in a temp dir, and helpers to drive the router.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;
use vmon_api::records::{
    Event, EventKind, EventQuery, Records, SandboxRecord, StoreRecords, TeamLimits, TemplateKind,
    TemplateRecord,
};
use vmon_api::{admin, Config, Control};
use vmon_proto::node::{
    self as n, BuildInfo, NodeCalls, NodeError, NodeHandler, Running, StartSpec,
};

/// A node that runs nothing: sandboxes are entries in a map, all at `guest_ip`.
pub struct FakeNode {
    pub guest_ip: IpAddr,
    pub running: Mutex<HashMap<String, Running>>,
    pub builds: Mutex<HashMap<String, BuildInfo>>,
    /// Starts that fail before any succeeds (to test cleanup).
    pub fail_starts: AtomicUsize,
    pub fail_pauses: AtomicUsize,
    pub starts: Mutex<Vec<StartSpec>>,
    /// Every network policy applied to a running sandbox, in order.
    pub networks: Mutex<Vec<(String, vmon_proto::node::NetworkPolicy)>>,
    /// Samples and console entries the telemetry tests plant, per sandbox.
    pub samples: Mutex<HashMap<String, Vec<vmon_proto::node::MetricSample>>>,
    /// What each sandbox's guest asked of self-keepalive (`keepalive` answers it).
    pub keepalive_asks: Mutex<HashMap<String, vmon_proto::node::KeepaliveAsk>>,
    pub log_entries: Mutex<HashMap<String, Vec<vmon_proto::node::LogEntry>>>,
    /// Template builds wait while a writer holds this (to see the api during a build).
    pub hold_builds: tokio::sync::RwLock<()>,
    /// Template builds that fail before any succeeds.
    pub fail_builds: AtomicUsize,
    /// The first build's progress, shared with the Control as `vmon up` shares it with an
    /// in-process node; a build reports an image step into it, as the real node does.
    pub progress: vmon_proto::progress::Progress,
    /// When `builds` says a build was recorded (Unix seconds; absent: long ago).
    pub recorded_unix: Mutex<HashMap<String, u64>>,
    /// Builds a running sandbox stands on: `delete_build` refuses them, as the node does.
    pub in_use: Mutex<std::collections::HashSet<String>>,
    /// The GPUs the fake node has (total, free): a start asking for more is refused as the
    /// real node refuses it (`crates/node/src/gpus.rs`), with nothing started.
    pub gpus: Mutex<(u32, u32)>,
    /// The volumes `delete_volume` was asked to delete, in order.
    pub deleted_volumes: Mutex<Vec<String>>,
}

impl FakeNode {
    pub fn new(guest_ip: IpAddr) -> Arc<FakeNode> {
        Arc::new(FakeNode {
            guest_ip,
            running: Mutex::new(HashMap::new()),
            builds: Mutex::new(HashMap::new()),
            deleted_volumes: Mutex::new(Vec::new()),
            fail_starts: AtomicUsize::new(0),
            fail_pauses: AtomicUsize::new(0),
            starts: Mutex::new(Vec::new()),
            networks: Mutex::new(Vec::new()),
            samples: Mutex::new(HashMap::new()),
            keepalive_asks: Mutex::new(HashMap::new()),
            log_entries: Mutex::new(HashMap::new()),
            hold_builds: tokio::sync::RwLock::new(()),
            fail_builds: AtomicUsize::new(0),
            progress: vmon_proto::progress::Progress::new("the base template"),
            recorded_unix: Mutex::new(HashMap::new()),
            in_use: Mutex::new(std::collections::HashSet::new()),
            gpus: Mutex::new((0, 0)),
        })
    }
    pub fn running_count(&self) -> usize {
        self.running.lock().unwrap().len()
    }
    fn new_build(&self, parent: Option<String>, has_memory: bool) -> BuildInfo {
        let b = BuildInfo {
            build_id: uuid::Uuid::new_v4().to_string(),
            has_memory,
            vcpus: 2,
            memory_mb: 512,
            disk_mb: 1024,
            envd_version: "0.6.4".into(),
            parent,
            older_image: false,
            stored: false,
        };
        self.builds
            .lock()
            .unwrap()
            .insert(b.build_id.clone(), b.clone());
        b
    }
}

#[async_trait::async_trait]
impl NodeHandler for FakeNode {
    async fn build_template(
        &self,
        n::BuildTemplate { spec }: n::BuildTemplate,
    ) -> Result<BuildInfo, NodeError> {
        self.progress.step("guest image");
        self.progress.update("debootstrap", Some(40));
        let _held = self.hold_builds.read().await;
        if self
            .fail_builds
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(NodeError::Failed("injected build failure".into()));
        }
        let b = BuildInfo {
            build_id: spec.build_id,
            has_memory: true,
            vcpus: spec.vcpus,
            memory_mb: spec.memory_mb,
            disk_mb: spec.disk_mb,
            envd_version: "0.6.4".into(),
            parent: None,
            older_image: false,
            stored: false,
        };
        self.builds
            .lock()
            .unwrap()
            .insert(b.build_id.clone(), b.clone());
        Ok(b)
    }
    async fn build_info(&self, c: n::BuildInfoOf) -> Result<BuildInfo, NodeError> {
        let build_id = c.build_id.as_str();
        self.builds
            .lock()
            .unwrap()
            .get(build_id)
            .cloned()
            .ok_or_else(|| NodeError::BuildNotFound(build_id.into()))
    }
    async fn delete_build(&self, c: n::DeleteBuild) -> Result<(), NodeError> {
        let build_id = c.build_id.as_str();
        if self.in_use.lock().unwrap().contains(build_id) {
            return Err(NodeError::BuildInUse(build_id.into()));
        }
        self.builds.lock().unwrap().remove(build_id);
        Ok(())
    }
    async fn builds(&self, _: n::Builds) -> Result<Vec<vmon_proto::node::KeptBuild>, NodeError> {
        let recorded = self.recorded_unix.lock().unwrap();
        Ok(self
            .builds
            .lock()
            .unwrap()
            .values()
            .map(|b| vmon_proto::node::KeptBuild {
                build: b.clone(),
                recorded_unix: recorded.get(&b.build_id).copied().unwrap_or(0),
            })
            .collect())
    }
    async fn paused_state(
        &self,
        c: n::PausedStateOf,
    ) -> Result<vmon_proto::node::PausedState, NodeError> {
        let build_id = c.build_id.as_str();
        let b = self
            .builds
            .lock()
            .unwrap()
            .get(build_id)
            .cloned()
            .ok_or_else(|| NodeError::BuildNotFound(build_id.into()))?;
        Ok(vmon_proto::node::PausedState {
            parked: false,
            local: true,
            stored: b.stored,
        })
    }
    async fn start(&self, n::Start { spec }: n::Start) -> Result<Running, NodeError> {
        if self
            .fail_starts
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(NodeError::Failed("injected start failure".into()));
        }
        let build = NodeCalls::build_info(self, &spec.build_id).await?;
        let (total, free) = *self.gpus.lock().unwrap();
        if spec.gpus > total {
            return Err(NodeError::InvalidArgument(format!(
                "the sandbox asks for {} GPUs and this node has {total}",
                spec.gpus
            )));
        }
        if spec.gpus > free {
            return Err(NodeError::Exhausted(format!(
                "the sandbox asks for {} GPUs and {free} of this node's {total} are free",
                spec.gpus
            )));
        }
        self.starts.lock().unwrap().push(spec.clone());
        let r = Running {
            sandbox_id: spec.sandbox_id.clone(),
            execution_id: spec.execution_id,
            guest_ip: self.guest_ip,
            envd_version: build.envd_version,
            vcpus: build.vcpus,
            memory_mb: build.memory_mb,
            disk_mb: build.disk_mb,
            resume_generation: 0,
            start_kind: Some(if spec.cold_boot || !build.has_memory {
                vmon_proto::node::StartKind::ColdBoot
            } else {
                vmon_proto::node::StartKind::Restore
            }),
        };
        self.running
            .lock()
            .unwrap()
            .insert(spec.sandbox_id, r.clone());
        Ok(r)
    }
    async fn kill(&self, c: n::Kill) -> Result<(), NodeError> {
        let sandbox_id = c.sandbox_id.as_str();
        self.running
            .lock()
            .unwrap()
            .remove(sandbox_id)
            .map(|_| ())
            .ok_or_else(|| NodeError::NotFound(sandbox_id.into()))
    }
    async fn pause(&self, c: n::Pause) -> Result<BuildInfo, NodeError> {
        let (sandbox_id, memory) = (c.sandbox_id.as_str(), c.memory);
        if self
            .fail_pauses
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(NodeError::Failed("injected pause failure".into()));
        }
        self.running
            .lock()
            .unwrap()
            .remove(sandbox_id)
            .ok_or_else(|| NodeError::NotFound(sandbox_id.into()))?;
        Ok(self.new_build(None, memory))
    }
    async fn checkpoint(&self, c: n::Checkpoint) -> Result<BuildInfo, NodeError> {
        let (sandbox_id, memory) = (c.sandbox_id.as_str(), c.memory);
        if !self.running.lock().unwrap().contains_key(sandbox_id) {
            return Err(NodeError::NotFound(sandbox_id.into()));
        }
        Ok(self.new_build(None, memory))
    }
    async fn list_running(&self, _: n::ListRunning) -> Result<Vec<Running>, NodeError> {
        Ok(self.running.lock().unwrap().values().cloned().collect())
    }
    async fn update_network(&self, c: n::UpdateNetwork) -> Result<(), NodeError> {
        let (sandbox_id, policy) = (c.sandbox_id.as_str(), c.policy);
        if self.running.lock().unwrap().contains_key(sandbox_id) {
            self.networks
                .lock()
                .unwrap()
                .push((sandbox_id.to_string(), policy));
            Ok(())
        } else {
            Err(NodeError::NotFound(sandbox_id.into()))
        }
    }
    async fn metrics(
        &self,
        c: n::Metrics,
    ) -> Result<Vec<vmon_proto::node::MetricSample>, NodeError> {
        let (sandbox_id, start_unix, end_unix) = (c.sandbox_id.as_str(), c.start_unix, c.end_unix);
        let all = self.samples.lock().expect("lock");
        Ok(all
            .get(sandbox_id)
            .into_iter()
            .flatten()
            .filter(|s| (start_unix..=end_unix).contains(&s.timestamp_unix))
            .cloned()
            .collect())
    }
    async fn latest_metrics(
        &self,
        c: n::LatestMetrics,
    ) -> Result<Vec<(String, vmon_proto::node::MetricSample)>, NodeError> {
        let all = self.samples.lock().expect("lock");
        let running = self.running.lock().expect("lock");
        Ok(c.sandbox_ids
            .iter()
            .filter(|id| running.contains_key(*id))
            .filter_map(|id| Some((id.clone(), all.get(id)?.last()?.clone())))
            .collect())
    }
    async fn logs(
        &self,
        n::Logs { sandbox_id, query }: n::Logs,
    ) -> Result<Vec<vmon_proto::node::LogEntry>, NodeError> {
        let all = self.log_entries.lock().expect("lock");
        let mut v: Vec<_> = all
            .get(&sandbox_id)
            .into_iter()
            .flatten()
            .filter(|e| match query.direction {
                vmon_proto::node::LogDirection::Forward => {
                    query.cursor_ms.is_none_or(|c| e.timestamp_ms >= c)
                }
                vmon_proto::node::LogDirection::Backward => {
                    query.cursor_ms.is_none_or(|c| e.timestamp_ms <= c)
                }
            })
            .filter(|e| query.min_level.is_none_or(|l| e.level >= l))
            .cloned()
            .collect();
        if query.direction == vmon_proto::node::LogDirection::Backward {
            v.reverse();
        }
        v.truncate(query.limit);
        Ok(v)
    }
    async fn pool_depths(&self, _: n::PoolDepths) -> Result<Vec<(String, usize)>, NodeError> {
        Ok(vec![("base-build".into(), 1)])
    }

    async fn keepalive(
        &self,
        c: n::Keepalive,
    ) -> Result<Option<vmon_proto::node::KeepaliveAsk>, NodeError> {
        if !self
            .running
            .lock()
            .expect("lock")
            .contains_key(&c.sandbox_id)
        {
            return Err(NodeError::NotFound(c.sandbox_id));
        }
        Ok(self
            .keepalive_asks
            .lock()
            .expect("lock")
            .get(&c.sandbox_id)
            .copied())
    }

    async fn exec(&self, c: n::Exec) -> Result<vmon_proto::node::ExecOutput, NodeError> {
        Err(NodeError::NotFound(c.sandbox_id))
    }

    async fn put_file(&self, c: n::PutFile) -> Result<(), NodeError> {
        Err(NodeError::NotFound(c.sandbox_id))
    }

    async fn resolve_image(&self, c: n::ResolveImage) -> Result<String, NodeError> {
        Err(NodeError::InvalidArgument(format!(
            "the fake node reaches no registry for {}",
            c.image.reference
        )))
    }
    async fn pause_builds(&self, _: n::PauseBuilds) -> Result<Vec<n::PauseBuild>, NodeError> {
        Ok(Vec::new())
    }
    async fn delete_volume(&self, c: n::DeleteVolume) -> Result<(), NodeError> {
        self.deleted_volumes.lock().unwrap().push(c.volume_id);
        Ok(())
    }
    async fn update_egress(&self, c: n::UpdateEgress) -> Result<(), NodeError> {
        match self.running.lock().unwrap().contains_key(&c.sandbox_id) {
            true => Ok(()),
            false => Err(NodeError::NotFound(c.sandbox_id)),
        }
    }
    async fn migrate_describe(&self, c: n::MigrateDescribe) -> Result<n::MigrateIn, NodeError> {
        Err(NodeError::InvalidArgument(format!(
            "the fake node does not migrate {}",
            c.sandbox_id
        )))
    }
    async fn migrate_in(&self, _: n::MigrateAccept) -> Result<String, NodeError> {
        Err(NodeError::InvalidArgument(
            "the fake node does not migrate".into(),
        ))
    }
    async fn migrate_out(&self, _: n::MigrateSend) -> Result<n::MigrateStats, NodeError> {
        Err(NodeError::InvalidArgument(
            "the fake node does not migrate".into(),
        ))
    }
    async fn migrate_commit(&self, c: n::MigrateCommit) -> Result<Running, NodeError> {
        Err(NodeError::NotFound(format!("migration {}", c.migration_id)))
    }
    async fn migrate_cancel(&self, _: n::MigrateCancel) -> Result<(), NodeError> {
        Ok(())
    }
    async fn migrate_finish(&self, c: n::MigrateFinish) -> Result<(), NodeError> {
        Err(NodeError::NotFound(c.sandbox_id))
    }
    async fn migrate_abort(&self, _: n::MigrateAbort) -> Result<(), NodeError> {
        Ok(())
    }
}

/// A team's limits: `max_concurrent` sandboxes, the rest the defaults.
pub fn limits(max_concurrent: u32) -> TeamLimits {
    TeamLimits {
        max_concurrent,
        ..TeamLimits::default()
    }
}

pub struct Harness {
    pub control: Arc<Control>,
    pub node: Arc<FakeNode>,
    pub records: Arc<StoreRecords>,
    pub team_id: String,
    pub router: axum::Router,
    pub key: String,
    pub other_key: String,
    pub _dir: tempfile::TempDir,
}

pub async fn harness(limits: TeamLimits) -> Harness {
    harness_at("127.0.0.1".parse().unwrap(), limits).await
}

pub async fn harness_at(guest_ip: IpAddr, limits: TeamLimits) -> Harness {
    harness_with(guest_ip, limits, vmon_api::config::Quotas::default()).await
}

pub async fn harness_with(
    guest_ip: IpAddr,
    limits: TeamLimits,
    quotas: vmon_api::config::Quotas,
) -> Harness {
    let h = harness_starting(guest_ip, limits, quotas).await;
    h.control.ensure_base().await.unwrap();
    h
}

/// A harness whose config `tweak` changed.
pub async fn harness_configured(limits: TeamLimits, tweak: impl FnOnce(&mut Config)) -> Harness {
    let h = harness_starting_with(
        "127.0.0.1".parse().unwrap(),
        limits,
        vmon_api::config::Quotas::default(),
        tweak,
    )
    .await;
    h.control.ensure_base().await.unwrap();
    h
}

/// A harness whose `base` is not built yet (as on a first `vmon up` before the build ends).
pub async fn harness_starting(
    guest_ip: IpAddr,
    limits: TeamLimits,
    quotas: vmon_api::config::Quotas,
) -> Harness {
    harness_starting_with(guest_ip, limits, quotas, |_| {}).await
}

/// [`harness_starting`] with its configuration changed by `tweak`.
pub async fn harness_starting_with(
    guest_ip: IpAddr,
    limits: TeamLimits,
    quotas: vmon_api::config::Quotas,
    tweak: impl FnOnce(&mut Config),
) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let kv = vmon_kv::Kv::open_embedded(&vmon_kv::EmbeddedConfig::new(dir.path()))
        .await
        .unwrap();
    let node = FakeNode::new(guest_ip);
    let mut config = Config {
        lock_wait_secs: 5,
        // The tests' webhook receivers listen on loopback.
        webhook_allow: vec!["127.0.0.1/32".into()],
        quotas,
        volumes_dir: Some(dir.path().join("volumes")),
        volume_key_file: Some(dir.path().join("volume-key")),
        template_files_dir: Some(dir.path().join("template-files")),
        ..Config::default()
    };
    tweak(&mut config);
    let records = Arc::new(StoreRecords::open(&config, dir.path()).await.unwrap());
    let control = Control::open_with(
        config,
        node.clone(),
        records.clone(),
        kv,
        node.progress.clone(),
    )
    .await
    .unwrap();
    // A template too big for the default limits.
    let big = NodeCalls::build_template(
        &*node,
        n::TemplateSpec {
            build_id: "big".into(),
            vcpus: 64,
            memory_mb: 512,
            disk_mb: 1024,
            start_cmd: None,
            ready_cmd: None,
            warm_request: None,
            env_vars: BTreeMap::new(),
            image: None,
            layer: None,
        },
    )
    .await
    .unwrap();
    records
        .put_template(TemplateRecord {
            id: "bigtemplate".into(),
            team_id: None,
            alias: Some("big".into()),
            kind: TemplateKind::Template,
            tags: BTreeMap::from([("default".to_string(), big)]),
            created_at: time::OffsetDateTime::now_utc(),
        })
        .await
        .unwrap();
    let team = admin::create_team_with_key(records.as_ref(), "Team A", None, limits.clone())
        .await
        .unwrap();
    let other = admin::create_team_with_key(records.as_ref(), "Team B", None, limits)
        .await
        .unwrap();
    let router = vmon_api::router(vmon_api::state::AppState {
        control: control.clone(),
        admin_token: Some("admintoken".into()),
    });
    Harness {
        control,
        node,
        records,
        router,
        team_id: team.team.id.clone(),
        key: team.api_key,
        other_key: other.api_key,
        _dir: dir,
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub json: serde_json::Value,
}

impl Harness {
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&str>,
        extra: &[(&str, &str)],
    ) -> Reply {
        let mut b = Request::builder().method(method).uri(path);
        if let Some(k) = key {
            b = b.header("x-api-key", k);
        }
        if body.is_some() {
            b = b.header("content-type", "application/json");
        }
        for (k, v) in extra {
            b = b.header(*k, *v);
        }
        let req = b.body(Body::from(body.unwrap_or("").to_string())).unwrap();
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let json = if bytes.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| {
                serde_json::Value::String(String::from_utf8_lossy(&bytes).into())
            })
        };
        Reply {
            status,
            headers,
            json,
        }
    }

    pub async fn req(&self, method: &str, path: &str, body: Option<&str>) -> Reply {
        let key = self.key.clone();
        self.call(method, path, Some(&key), body, &[]).await
    }

    /// The sandbox's events (of the harness team), oldest first, as the store holds them.
    pub async fn events(&self, sandbox_id: &str) -> Vec<Event> {
        self.events_in(&self.team_id.clone(), sandbox_id).await
    }

    pub async fn events_in(&self, team_id: &str, sandbox_id: &str) -> Vec<Event> {
        self.records
            .events(&EventQuery {
                team_id: team_id.to_string(),
                sandbox_id: Some(sandbox_id.to_string()),
                limit: 1000,
                order_asc: true,
                ..Default::default()
            })
            .await
            .unwrap()
    }

    /// `POST /sandboxes/{id}/pause` (a memory pause, the default).
    pub async fn pause(&self, id: &str) -> Reply {
        self.req("POST", &format!("/sandboxes/{id}/pause"), Some("{}"))
            .await
    }

    /// `POST /v2/sandboxes/{id}/connect` with `timeout` seconds.
    pub async fn connect(&self, id: &str, timeout: u32) -> Reply {
        let body = format!(r#"{{"timeout":{timeout}}}"#);
        self.req("POST", &format!("/v2/sandboxes/{id}/connect"), Some(&body))
            .await
    }

    /// The sandbox's record as the store holds it.
    pub async fn record(&self, id: &str) -> SandboxRecord {
        self.records
            .sandbox(id)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no record of {id}"))
    }

    /// The last start the node was asked for.
    pub fn last_start(&self) -> StartSpec {
        self.node
            .starts
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("a start")
    }

    /// The sandbox's newest event of `kind`.
    pub async fn last_event(&self, sandbox_id: &str, kind: EventKind) -> Event {
        self.events(sandbox_id)
            .await
            .into_iter()
            .rfind(|e| e.event_type == kind.as_str())
            .unwrap_or_else(|| panic!("no {} event of {sandbox_id}", kind.as_str()))
    }

    /// Creates a sandbox from `base` and returns its id.
    pub async fn create(&self, body: &str) -> String {
        let r = self.req("POST", "/v2/sandboxes", Some(body)).await;
        assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
        r.json["sandboxID"].as_str().unwrap().to_string()
    }
}
