//! Metrics, logs and the platform's Prometheus text through the REST surface, with samples and
//! console entries planted in the fake node.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use axum::http::StatusCode;
use common::{harness, Harness};
use vmon_proto::node::{LogEntry, LogLevel, MetricSample};

fn sample(ts: i64) -> MetricSample {
    MetricSample {
        timestamp_unix: ts,
        cpu_count: 2,
        cpu_used_pct: 12.5,
        mem_used: 100 << 20,
        mem_total: 512 << 20,
        mem_cache: 10 << 20,
        disk_used: 1 << 30,
        disk_total: 4 << 30,
    }
}

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

fn plant_samples(h: &Harness, id: &str, samples: Vec<MetricSample>) {
    h.node
        .samples
        .lock()
        .expect("present")
        .insert(id.to_string(), samples);
}

fn entry(ms: i64, level: LogLevel, message: &str, fields: &[(&str, &str)]) -> LogEntry {
    let fields: BTreeMap<String, String> = fields
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    LogEntry {
        timestamp_ms: ms,
        level,
        message: message.to_string(),
        line: serde_json::json!({"message": message, "fields": fields}).to_string(),
        fields,
    }
}

#[tokio::test]
async fn metrics_are_thinned_by_range() {
    let h = harness(Default::default()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    // Buckets are aligned to the epoch: start on a 30 s boundary.
    let end = now() - now() % 30;
    let start = end - 7200;
    plant_samples(&h, &id, (start..=end).step_by(5).map(sample).collect());

    let r = h
        .req(
            "GET",
            &format!("/sandboxes/{id}/metrics?start={start}&end={end}"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json);
    let list = r.json.as_array().expect("array");
    // Two hours: one sample per 30 s.
    assert_eq!(list.len(), 241);
    let ts: Vec<i64> = list
        .iter()
        .map(|m| m["timestampUnix"].as_i64().expect("present"))
        .collect();
    assert!(ts.windows(2).all(|w| w[1] - w[0] == 30), "{ts:?}");
    let m = &list[0];
    for k in [
        "timestamp",
        "cpuCount",
        "cpuUsedPct",
        "memUsed",
        "memTotal",
        "memCache",
        "diskUsed",
        "diskTotal",
    ] {
        assert!(!m[k].is_null(), "missing {k}: {m}");
    }
    assert_eq!(m["cpuUsedPct"], 12.5);

    // Under an hour: every 5 s sample.
    let r = h
        .req(
            "GET",
            &format!("/sandboxes/{id}/metrics?start={}&end={end}", end - 600),
            None,
        )
        .await;
    assert_eq!(r.json.as_array().expect("present").len(), 121);

    // Defaults: the sandbox's lifetime so far (it started moments ago).
    let r = h
        .req("GET", &format!("/sandboxes/{id}/metrics"), None)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(
        r.json.as_array().expect("present").len() <= 3,
        "{:?}",
        r.json
    );

    let bad = h
        .req(
            "GET",
            &format!("/sandboxes/{id}/metrics?start=10&end=5"),
            None,
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let bad = h
        .req("GET", &format!("/sandboxes/{id}/metrics?start=x"), None)
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn metrics_and_logs_are_team_scoped_and_outlive_a_kill() {
    let h = harness(Default::default()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let t = now();
    plant_samples(&h, &id, vec![sample(t), sample(t + 5)]);
    h.node.log_entries.lock().expect("lock").insert(
        id.clone(),
        vec![entry(
            t * 1000,
            LogLevel::Info,
            "process started",
            &[("logger", "process"), ("event_type", "process_start")],
        )],
    );
    let other = h.other_key.clone();
    for path in [
        format!("/sandboxes/{id}/metrics"),
        format!("/sandboxes/{id}/logs"),
        format!("/v2/sandboxes/{id}/logs"),
    ] {
        let r = h.call("GET", &path, Some(&other), None, &[]).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{path}");
    }
    let r = h
        .req("GET", "/sandboxes/inosuchsandbox/metrics", None)
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);

    let k = h.req("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(k.status, StatusCode::NO_CONTENT);
    assert_eq!(
        h.req("GET", &format!("/sandboxes/{id}"), None).await.status,
        StatusCode::NOT_FOUND
    );
    let r = h
        .req(
            "GET",
            &format!("/sandboxes/{id}/metrics?start={}&end={}", t - 10, t + 10),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json);
    assert_eq!(r.json.as_array().expect("present").len(), 2);
    let r = h.req("GET", &format!("/sandboxes/{id}/logs"), None).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json);
    assert_eq!(
        r.json["logEntries"][0]["fields"]["event_type"],
        "process_start"
    );
    let r = h
        .call(
            "GET",
            &format!("/sandboxes/{id}/logs"),
            Some(&other),
            None,
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn batch_metrics_answer_the_latest_recent_sample() {
    let h = harness(Default::default()).await;
    let a = h.create(r#"{"templateID":"base"}"#).await;
    let b = h.create(r#"{"templateID":"base"}"#).await;
    let c = h.create(r#"{"templateID":"base"}"#).await;
    let t = now();
    plant_samples(&h, &a, vec![sample(t - 10), sample(t - 5)]);
    plant_samples(&h, &b, vec![sample(t - 600)]);
    let r = h
        .req(
            "GET",
            &format!("/sandboxes/metrics?sandbox_ids={a},{b},{c},inope"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json);
    let map = r.json["sandboxes"].as_object().expect("map");
    assert_eq!(map.len(), 1, "{map:?}");
    assert_eq!(map[&a]["timestampUnix"], t - 5);
    // Another team's sandbox is not reported.
    let r = h
        .call(
            "GET",
            &format!("/sandboxes/metrics?sandbox_ids={a}"),
            Some(&h.other_key.clone()),
            None,
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.json["sandboxes"].as_object().expect("present").is_empty());

    let many: Vec<String> = (0..101).map(|i| format!("i{i}")).collect();
    let r = h
        .req(
            "GET",
            &format!("/sandboxes/metrics?sandbox_ids={}", many.join(",")),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h.req("GET", "/sandboxes/metrics", None).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn logs_v1_and_v2_shapes_and_filters() {
    let h = harness(Default::default()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let t = now() * 1000;
    h.node.log_entries.lock().expect("lock").insert(
        id.clone(),
        vec![
            entry(t, LogLevel::Info, "envd listening", &[("logger", "envd")]),
            entry(
                t + 10,
                LogLevel::Info,
                "process started",
                &[("logger", "process"), ("pid", "154")],
            ),
            entry(t + 20, LogLevel::Error, "boom", &[]),
        ],
    );
    let r = h
        .req(
            "GET",
            &format!("/sandboxes/{id}/logs?start={}", t + 5),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["logs"].as_array().expect("present").len(), 2);
    assert!(r.json["logs"][0]["line"].is_string());
    assert!(r.json["logs"][0]["timestamp"].is_string());
    let e = &r.json["logEntries"][0];
    assert_eq!(e["message"], "process started");
    assert_eq!(e["level"], "info");
    assert_eq!(e["fields"]["pid"], "154");

    let r = h
        .req(
            "GET",
            &format!("/v2/sandboxes/{id}/logs?direction=backward&limit=2"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let msgs: Vec<&str> = r.json["logs"]
        .as_array()
        .expect("present")
        .iter()
        .map(|e| e["message"].as_str().expect("present"))
        .collect();
    assert_eq!(msgs, vec!["boom", "process started"]);
    let r = h
        .req("GET", &format!("/v2/sandboxes/{id}/logs?level=error"), None)
        .await;
    assert_eq!(r.json["logs"].as_array().expect("present").len(), 1);
    let r = h
        .req(
            "GET",
            &format!("/v2/sandboxes/{id}/logs?direction=sideways"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    // The operator's view needs the admin token.
    let r = h
        .call(
            "GET",
            &format!("/admin/sandboxes/{id}/logs"),
            None,
            None,
            &[("x-admin-token", "admintoken")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json.as_array().expect("present").len(), 3);
    let r = h
        .call(
            "GET",
            &format!("/admin/sandboxes/{id}/logs"),
            None,
            None,
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn prometheus_text_reports_the_platform() {
    let h = harness(Default::default()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    h.req("POST", &format!("/sandboxes/{id}/pause"), None).await;
    h.create(r#"{"templateID":"base"}"#).await;
    vmon_api::telemetry::platform()
        .webhook_delivery(vmon_api::telemetry::WebhookOutcome::Delivered);
    // Only for the operator: a team's key or no credential is a 401.
    for (key, extra) in [
        (None, &[][..]),
        (Some(h.key.as_str()), &[][..]),
        (None, &[("x-admin-token", "wrong")][..]),
        (None, &[("authorization", "Bearer wrong")][..]),
    ] {
        let r = h.call("GET", "/metrics", key, None, extra).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{extra:?}");
        assert_eq!(r.json["code"], 401);
    }
    let r = h
        .call(
            "GET",
            "/metrics",
            None,
            None,
            &[("authorization", "Bearer admintoken")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h
        .call(
            "GET",
            "/metrics",
            None,
            None,
            &[("x-admin-token", "admintoken")],
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let text = r.json.as_str().expect("text");
    assert!(
        text.contains("vmon_sandboxes{state=\"running\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("vmon_sandboxes{state=\"paused\"} 1"),
        "{text}"
    );
    assert!(text.contains("vmon_sandbox_transitions_total{operation=\"create\",outcome=\"ok\"}"));
    assert!(text.contains("vmon_sandbox_transition_duration_seconds_count{operation=\"pause\""));
    assert!(text.contains("vmon_pool_depth{build=\"base-build\"} 1"));
    assert!(text.contains("vmon_webhook_deliveries_total{outcome=\"delivered\"}"));
}

/// The JSON the api answers is what the official Python SDK parses (skipped without the
/// repo's `.venv`).
#[tokio::test]
async fn the_python_sdk_parses_our_metrics() {
    let python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    if !python.exists() {
        eprintln!("skipped: no {}", python.display());
        return;
    }
    let h = harness(Default::default()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let t = now();
    plant_samples(&h, &id, vec![sample(t)]);
    let r = h
        .req(
            "GET",
            &format!("/sandboxes/{id}/metrics?start={}&end={}", t - 1, t + 1),
            None,
        )
        .await;
    let script = r#"
import json, sys
from e2b.api.client.models.sandbox_metric import SandboxMetric
items = json.loads(sys.stdin.read())
assert len(items) == 1, items
m = SandboxMetric.from_dict(items[0])
assert m.cpu_used_pct == 12.5 and m.mem_total == 512 << 20 and m.timestamp.tzinfo is not None
print("ok")
"#;
    use std::io::Write;
    let mut child = std::process::Command::new(&python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(r.json.to_string().as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("python ran");
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
}
