//! The node calls' wire is the one that the hand-written client and server spoke before the
//! calls became one table (`POST /v1/<name>`, the same JSON bodies and replies), so that an
//! api and a node of either version talk during a rolling upgrade.

use serde::Serialize;
use serde_json::{json, Value};
use vmon_proto::node::*;

fn v<T: Serialize>(x: &T) -> Value {
    serde_json::to_value(x).expect("serializes")
}

/// What the previous client sent for `call`: the name in its path and its JSON body (its
/// private structs `Build`, `Target`, `Capture`, `Network`, … written out). A call the table
/// gains must be added here: this match is exhaustive.
fn old_wire(call: &NodeCall) -> (&'static str, Value) {
    let target = |s: &str, e: &str| json!({"sandbox_id": s, "execution_id": e});
    let capture =
        |s: &str, e: &str, m: bool| json!({"sandbox_id": s, "execution_id": e, "memory": m});
    match call {
        NodeCall::BuildTemplate(c) => ("build_template", v(&c.spec)),
        NodeCall::ResolveImage(c) => ("resolve_image", v(&c.image)),
        NodeCall::BuildInfoOf(c) => ("build_info", json!({"build_id": c.build_id})),
        NodeCall::DeleteBuild(c) => ("delete_build", json!({"build_id": c.build_id})),
        // New in this version: an older node answers 404 and the volume's objects stay.
        NodeCall::DeleteVolume(c) => ("delete_volume", json!({"volume_id": c.volume_id})),
        NodeCall::PausedStateOf(c) => ("paused_state", json!({"build_id": c.build_id})),
        NodeCall::PauseBuilds(_) => ("pause_builds", json!({})),
        NodeCall::Builds(_) => ("builds", json!({})),
        NodeCall::Start(c) => ("start", v(&c.spec)),
        NodeCall::Kill(c) => ("kill", target(&c.sandbox_id, &c.execution_id)),
        // New in this version: an older node answers 404 and the api expires as before.
        NodeCall::Keepalive(c) => ("keepalive", target(&c.sandbox_id, &c.execution_id)),
        NodeCall::Pause(c) => ("pause", capture(&c.sandbox_id, &c.execution_id, c.memory)),
        NodeCall::Checkpoint(c) => (
            "checkpoint",
            capture(&c.sandbox_id, &c.execution_id, c.memory),
        ),
        NodeCall::ListRunning(_) => ("list_running", json!({})),
        NodeCall::UpdateNetwork(c) => (
            "update_network",
            json!({"sandbox_id": c.sandbox_id, "execution_id": c.execution_id, "policy": v(&c.policy)}),
        ),
        NodeCall::UpdateEgress(c) => (
            "update_egress",
            json!({"sandbox_id": c.sandbox_id, "execution_id": c.execution_id, "egress": v(&c.egress)}),
        ),
        NodeCall::Metrics(c) => (
            "metrics",
            json!({"sandbox_id": c.sandbox_id, "start_unix": c.start_unix, "end_unix": c.end_unix}),
        ),
        NodeCall::LatestMetrics(c) => ("latest_metrics", json!({"sandbox_ids": c.sandbox_ids})),
        NodeCall::Logs(c) => (
            "logs",
            json!({"sandbox_id": c.sandbox_id, "query": v(&c.query)}),
        ),
        NodeCall::PoolDepths(_) => ("pool_depths", json!({})),
        NodeCall::Exec(c) => (
            "exec",
            json!({"sandbox_id": c.sandbox_id, "execution_id": c.execution_id, "spec": v(&c.spec)}),
        ),
        NodeCall::PutFile(c) => (
            "put_file",
            json!({"sandbox_id": c.sandbox_id, "execution_id": c.execution_id,
                   "host_path": c.host_path, "guest_path": c.guest_path}),
        ),
        NodeCall::MigrateDescribe(c) => {
            ("migrate_describe", target(&c.sandbox_id, &c.execution_id))
        }
        NodeCall::MigrateAccept(c) => ("migrate_in", v(&c.spec)),
        NodeCall::MigrateSend(c) => ("migrate_out", v(&c.spec)),
        NodeCall::MigrateCommit(c) => ("migrate_commit", json!({"migration_id": c.migration_id})),
        NodeCall::MigrateCancel(c) => ("migrate_cancel", json!({"migration_id": c.migration_id})),
        NodeCall::MigrateFinish(c) => ("migrate_finish", target(&c.sandbox_id, &c.execution_id)),
        NodeCall::MigrateAbort(c) => ("migrate_abort", target(&c.sandbox_id, &c.execution_id)),
    }
}

fn from<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("sample")
}

/// One sample of every call, with fields set so that a renamed or dropped field shows.
fn samples() -> Vec<NodeCall> {
    let (s, e) = ("sbx-1".to_string(), "exe-1".to_string());
    let start: StartSpec = from(json!({
        "sandbox_id": s, "execution_id": e, "build_id": "b1", "cold_boot": false,
        "env_vars": {"A": "1"}, "envd_access_token": "t",
        "network": {"allow_internet_access": true, "allow_out": ["1.2.3.4"], "deny_out": []},
        "volumes": [{"volume_id": "v", "path": "/data"}]
    }));
    let template: TemplateSpec = from(json!({
        "build_id": "b1", "vcpus": 2, "memory_mb": 512, "disk_mb": 1024, "start_cmd": "x",
        "ready_cmd": null, "env_vars": {}
    }));
    let migrate_in: MigrateIn = from(json!({
        "sandbox_id": s, "execution_id": e, "basis": "b1", "envd_token": null,
        "envd_version": "0.6", "network": NetworkPolicy::default(), "resume_generation": 2,
        "disk_mb": 1, "vcpus": 1, "memory_mb": 1, "start_kind": "restore"
    }));
    let migrate_out: MigrateOut = from(json!({
        "sandbox_id": s, "execution_id": e, "target_url": "https://n2:3021", "target_id": "n2",
        "migration_id": "m1", "downtime_ms": 300, "timeout_secs": 600
    }));
    let policy = NetworkPolicy {
        allow_internet_access: false,
        allow_out: vec!["example.com".into()],
        deny_out: vec!["0.0.0.0/0".into()],
    };
    let image = OciImage {
        reference: "ubuntu".into(),
        tls_verify: true,
        ..Default::default()
    };
    let query = LogQuery {
        cursor_ms: Some(5),
        direction: LogDirection::Backward,
        limit: 50,
        min_level: Some(LogLevel::Warn),
        search: Some("oops".into()),
    };
    let exec = ExecSpec {
        cmd: "true".into(),
        user: "root".into(),
        ..Default::default()
    };
    let (s2, e2) = (s.clone(), e.clone());
    let t = move || (s2.clone(), e2.clone());
    vec![
        BuildTemplate { spec: template }.into(),
        ResolveImage { image }.into(),
        BuildInfoOf {
            build_id: "b1".into(),
        }
        .into(),
        DeleteBuild {
            build_id: "b1".into(),
        }
        .into(),
        DeleteVolume {
            volume_id: "v1".into(),
        }
        .into(),
        PausedStateOf {
            build_id: "b1".into(),
        }
        .into(),
        PauseBuilds {}.into(),
        Builds {}.into(),
        Start { spec: start }.into(),
        Kill {
            sandbox_id: t().0,
            execution_id: t().1,
        }
        .into(),
        Pause {
            sandbox_id: t().0,
            execution_id: t().1,
            memory: true,
        }
        .into(),
        Checkpoint {
            sandbox_id: t().0,
            execution_id: t().1,
            memory: false,
        }
        .into(),
        ListRunning {}.into(),
        UpdateNetwork {
            sandbox_id: t().0,
            execution_id: t().1,
            policy,
        }
        .into(),
        UpdateEgress {
            sandbox_id: t().0,
            execution_id: t().1,
            egress: Default::default(),
        }
        .into(),
        Metrics {
            sandbox_id: t().0,
            start_unix: 10,
            end_unix: 20,
        }
        .into(),
        LatestMetrics {
            sandbox_ids: vec![t().0, "sbx-2".into()],
        }
        .into(),
        Logs {
            sandbox_id: t().0,
            query,
        }
        .into(),
        PoolDepths {}.into(),
        Exec {
            sandbox_id: t().0,
            execution_id: t().1,
            spec: exec,
        }
        .into(),
        PutFile {
            sandbox_id: t().0,
            execution_id: t().1,
            host_path: "/h".into(),
            guest_path: "/g".into(),
        }
        .into(),
        Keepalive {
            sandbox_id: t().0,
            execution_id: t().1,
        }
        .into(),
        MigrateDescribe {
            sandbox_id: t().0,
            execution_id: t().1,
        }
        .into(),
        MigrateAccept { spec: migrate_in }.into(),
        MigrateSend { spec: migrate_out }.into(),
        MigrateCommit {
            migration_id: "m1".into(),
        }
        .into(),
        MigrateCancel {
            migration_id: "m1".into(),
        }
        .into(),
        MigrateFinish {
            sandbox_id: t().0,
            execution_id: t().1,
        }
        .into(),
        MigrateAbort {
            sandbox_id: s,
            execution_id: e,
        }
        .into(),
    ]
}

/// A new client sends what an old server reads: every call's name and body are the old ones.
#[test]
fn every_call_sends_the_json_the_previous_client_sent() {
    let calls = samples();
    let mut names: Vec<&str> = calls.iter().map(NodeCall::name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), 29, "one sample of each of the 29 calls");
    for call in &calls {
        let (name, old) = old_wire(call);
        assert_eq!(call.name(), name);
        assert_eq!(v(call), old, "the body of {name}");
    }
}

/// An old client's bodies are read by a new server as the same calls.
#[test]
fn every_body_the_previous_client_sent_is_read_as_its_call() {
    for call in samples() {
        let (name, old) = old_wire(&call);
        let body = serde_json::to_vec(&old).expect("body");
        let read = NodeCall::from_wire(name, &body)
            .expect("a known call")
            .expect("a valid body");
        assert_eq!(read.name(), name);
        assert_eq!(v(&read), old);
    }
    assert!(NodeCall::from_wire("no_such_call", b"{}").is_none());
    assert!(matches!(
        NodeCall::from_wire("kill", b"{\"sandbox_id\":1}"),
        Some(Err(_))
    ));
}

/// Replies are the reply alone (`{"ok": reply}` around it), as before: `null` for none.
#[test]
fn replies_serialize_as_the_reply_alone() {
    assert_eq!(v(&Kill::answer(())), Value::Null);
    let depths = PoolDepths::answer(vec![("b1".into(), 2)]);
    assert_eq!(v(&depths), json!([["b1", 2]]));
    assert_eq!(depths.name(), "pool_depths");
    // A reply to another call is an error, not a wrong value.
    assert!(matches!(Kill::reply(depths), Err(NodeError::Failed(_))));
}

/// The calls a cluster routes to a sandbox's node name it; node-level calls do not.
#[test]
fn calls_about_a_sandbox_name_it() {
    for call in samples() {
        let routed = call.sandbox_id().is_some();
        let expect = matches!(
            call.name(),
            "start"
                | "kill"
                | "pause"
                | "checkpoint"
                | "update_network"
                | "update_egress"
                | "metrics"
                | "logs"
                | "exec"
                | "put_file"
                | "keepalive"
        );
        assert_eq!(routed, expect, "{}", call.name());
        if routed {
            assert_eq!(call.sandbox_id(), Some("sbx-1"));
        }
    }
}
