//! The sandbox state machine over REST against in-memory parts: pause, connect and resume,
//! kill, forks (of running and paused sandboxes), snapshots, and the reaper's timeouts.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use common::{harness, limits};
use vmon_api::records::EventKind;

#[tokio::test]
async fn a_paused_sandbox_forks_from_its_paused_state_and_stays_paused() {
    let h = harness(limits(5)).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let r = h.pause(&id).await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let paused_build = h.record(&id).await.build.build_id;
    let r = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/fork"),
            Some(r#"{"count":2}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    let children: Vec<String> = r.json["sandboxes"]
        .as_array()
        .or_else(|| r.json.as_array())
        .expect("children")
        .iter()
        .filter_map(|c| {
            c["sandboxID"]
                .as_str()
                .or_else(|| c["sandbox"]["sandboxID"].as_str())
                .map(String::from)
        })
        .collect();
    assert_eq!(children.len(), 2, "{:?}", r.json);
    // The children started from the paused build; the source is untouched.
    let starts = h.node.starts.lock().unwrap().clone();
    for c in &children {
        let s = starts.iter().find(|s| &s.sandbox_id == c).expect("started");
        assert_eq!(s.build_id, paused_build);
        let d = h.req("GET", &format!("/sandboxes/{c}"), None).await;
        assert_eq!(d.json["state"], "running");
    }
    let src = h.record(&id).await;
    assert_eq!(src.state, vmon_api::records::SandboxState::Paused);
    assert_eq!(src.build.build_id, paused_build);
    // Killing the children never deletes the paused source's state.
    for c in &children {
        let r = h.req("DELETE", &format!("/sandboxes/{c}"), None).await;
        assert_eq!(r.status, StatusCode::NO_CONTENT);
    }
    assert!(h.node.builds.lock().unwrap().contains_key(&paused_build));
    // And the source still resumes.
    let r = h.connect(&id, 60).await;
    assert!(r.status.is_success(), "{:?}", r.json);
}

#[tokio::test]
async fn pause_connect_kill() {
    let h = harness(limits(5)).await;
    let id = h.create(r#"{"templateID":"base","timeout":600}"#).await;

    let p = h.pause(&id).await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    let p = h.pause(&id).await;
    assert_eq!(p.status, StatusCode::CONFLICT);
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.json["state"], "paused");
    assert_eq!(d.json["pauseMode"], "full");
    assert!(h.record(&id).await.guest_ip.is_none());

    let l = h.req("GET", "/v2/sandboxes?state=paused", None).await;
    assert_eq!(l.json.as_array().unwrap().len(), 1);
    let l = h.req("GET", "/sandboxes", None).await;
    assert_eq!(
        l.json.as_array().unwrap().len(),
        0,
        "legacy list is running only"
    );

    let c = h.connect(&id, 60).await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
    assert_eq!(c.json["sandboxID"], id.as_str());
    let last = h.last_start();
    assert!(!last.cold_boot, "memory pause restores memory");
    let end1 = h.record(&id).await.end_at;

    // Connect to a running sandbox: 200, extends, never shortens.
    let c = h.connect(&id, 10).await;
    assert_eq!(c.status, StatusCode::OK);
    let end2 = h.record(&id).await.end_at;
    assert_eq!(end1, end2);
    let c = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/connect"),
            Some(r#"{"timeout":3000}"#),
        )
        .await;
    assert_eq!(c.status, StatusCode::OK);
    let end3 = h.record(&id).await.end_at;
    assert!(end3 > end2);

    // set_timeout may shorten.
    let t = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/timeout"),
            Some(r#"{"timeout":5}"#),
        )
        .await;
    assert_eq!(t.status, StatusCode::NO_CONTENT);
    let end4 = h.record(&id).await.end_at;
    assert!(end4 < end3);

    // Filesystem pause, then reboot resume.
    let p = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/pause"),
            Some(r#"{"memory":false}"#),
        )
        .await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.json["pauseMode"], "filesystem");
    let c = h
        .req("POST", &format!("/v2/sandboxes/{id}/connect"), Some("{}"))
        .await;
    assert_eq!(c.status, StatusCode::CREATED);
    assert!(h.node.starts.lock().unwrap().last().unwrap().cold_boot);

    let p = h.pause(&id).await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    let c = h
        .req(
            "POST",
            &format!("/v2/sandboxes/{id}/connect"),
            Some(r#"{"memory":false}"#),
        )
        .await;
    assert_eq!(c.status, StatusCode::CREATED);
    assert!(
        h.node.starts.lock().unwrap().last().unwrap().cold_boot,
        "memory:false reboots"
    );

    // Kill a paused sandbox too.
    let p = h.pause(&id).await;
    assert_eq!(p.status, StatusCode::NO_CONTENT);
    let k = h.req("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(k.status, StatusCode::NO_CONTENT);
    let k = h.req("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(k.status, StatusCode::NOT_FOUND);
    let g = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(g.status, StatusCode::NOT_FOUND);

    let kinds: Vec<String> = h
        .events(&id)
        .await
        .into_iter()
        .map(|e| e.event_type)
        .collect();
    assert_eq!(
        kinds.first().map(String::as_str),
        Some(EventKind::Created.as_str())
    );
    assert_eq!(
        kinds.last().map(String::as_str),
        Some(EventKind::Killed.as_str())
    );
    assert!(kinds.iter().any(|k| k == EventKind::Paused.as_str()));
    assert!(kinds.iter().any(|k| k == EventKind::Resumed.as_str()));
}

#[tokio::test]
async fn execution_ids_change_on_resume() {
    let h = harness(limits(5)).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let e1 = h.record(&id).await.execution_id;
    h.pause(&id).await;
    h.req("POST", &format!("/v2/sandboxes/{id}/connect"), Some("{}"))
        .await;
    let e2 = h.record(&id).await.execution_id;
    assert_ne!(e1, e2);
}

#[tokio::test]
async fn fork_and_snapshots() {
    let h = harness(limits(10)).await;
    let id = h
        .create(r#"{"templateID":"base","metadata":{"role":"parent"},"envVars":{"A":"1"}}"#)
        .await;
    let f = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/fork"),
            Some(r#"{"count":3,"timeout":600}"#),
        )
        .await;
    assert_eq!(f.status, StatusCode::CREATED, "{:?}", f.json);
    let children = f.json.as_array().unwrap();
    assert_eq!(children.len(), 3);
    let ids: HashSet<&str> = children
        .iter()
        .map(|c| c["sandbox"]["sandboxID"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 3);
    assert!(!ids.contains(id.as_str()));
    let child = children[0]["sandbox"]["sandboxID"].as_str().unwrap();
    let d = h.req("GET", &format!("/sandboxes/{child}"), None).await;
    assert_eq!(d.json["metadata"]["role"], "parent");
    // The source keeps running with its id.
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(d.json["state"], "running");

    // Per-child failures are per-child.
    h.node.fail_starts.store(1, Ordering::SeqCst);
    let f = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/fork"),
            Some(r#"{"count":2}"#),
        )
        .await;
    assert_eq!(f.status, StatusCode::CREATED);
    let errors = f
        .json
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["error"]["code"].is_number())
        .count();
    assert_eq!(errors, 1);

    let s = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(r#"{"name":"my-snap:v1"}"#),
        )
        .await;
    assert_eq!(s.status, StatusCode::CREATED, "{:?}", s.json);
    let snap_id = s.json["snapshotID"].as_str().unwrap().to_string();
    assert_eq!(snap_id, "team-a/my-snap:v1");
    assert_eq!(s.json["names"][0], snap_id.as_str());
    let u = h
        .req("POST", &format!("/sandboxes/{id}/snapshots"), Some("{}"))
        .await;
    assert_eq!(u.status, StatusCode::CREATED);
    assert!(u.json["snapshotID"].as_str().unwrap().ends_with(":default"));

    let bad = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(r#"{"name":"other-team/x"}"#),
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let taken = h
        .req(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(r#"{"name":"base"}"#),
        )
        .await;
    assert_eq!(taken.status, StatusCode::CONFLICT);

    // Snapshots outlive their source.
    h.req("DELETE", &format!("/sandboxes/{id}"), None).await;
    for reference in [
        snap_id.as_str(),
        "my-snap:v1",
        u.json["snapshotID"].as_str().unwrap(),
    ] {
        let c = h
            .req(
                "POST",
                "/v2/sandboxes",
                Some(&format!(r#"{{"templateID":"{reference}"}}"#)),
            )
            .await;
        assert_eq!(c.status, StatusCode::CREATED, "{reference}: {:?}", c.json);
    }

    let l = h.req("GET", "/snapshots", None).await;
    assert_eq!(l.json.as_array().unwrap().len(), 2);
    let l = h
        .req("GET", &format!("/snapshots?sandboxID={id}&limit=1"), None)
        .await;
    assert_eq!(l.json.as_array().unwrap().len(), 1);
    assert!(l.headers.contains_key("x-next-token"));

    let enc = snap_id.replace('/', "%2F").replace(':', "%3A");
    let del = h.req("DELETE", &format!("/templates/{enc}"), None).await;
    assert_eq!(del.status, StatusCode::NO_CONTENT, "{:?}", del.json);
    let del = h.req("DELETE", &format!("/templates/{enc}"), None).await;
    assert_eq!(del.status, StatusCode::NOT_FOUND);
    let c = h
        .req(
            "POST",
            "/v2/sandboxes",
            Some(&format!(r#"{{"templateID":"{snap_id}"}}"#)),
        )
        .await;
    assert_eq!(c.status, StatusCode::NOT_FOUND);
    // A shared template cannot be deleted by a team.
    let del = h.req("DELETE", "/templates/base", None).await;
    assert_eq!(del.status, StatusCode::NOT_FOUND);
}

/// One pass of the reaper, waited for until every expiry it started has ended.
async fn reap(h: &common::Harness, in_flight: &Arc<Mutex<HashSet<String>>>) {
    h.control.reap_once(in_flight).await;
    // The expiries run as tasks of their own; on a loaded machine (a CI run beside other
    // builds) they take seconds, so wait for them by a generous deadline, not a short count.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while !in_flight.lock().unwrap().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn reaper_kills_or_pauses_and_a_failed_pause_kills() {
    let h = harness(limits(10)).await;
    let kill_me = h.create(r#"{"templateID":"base","timeout":0}"#).await;
    let pause_me = h
        .create(
            r#"{"templateID":"base","timeout":0,"autoPause":true,"autoResume":{"enabled":true}}"#,
        )
        .await;
    let keep = h.create(r#"{"templateID":"base","timeout":600}"#).await;
    let in_flight = Arc::new(Mutex::new(HashSet::new()));
    reap(&h, &in_flight).await;
    let r = h.req("GET", &format!("/sandboxes/{kill_me}"), None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h.req("GET", &format!("/sandboxes/{pause_me}"), None).await;
    assert_eq!(r.json["state"], "paused");
    assert_eq!(r.json["lifecycle"]["onTimeout"], "pause");
    let r = h.req("GET", &format!("/sandboxes/{keep}"), None).await;
    assert_eq!(r.json["state"], "running");
    let killed = h
        .events(&kill_me)
        .await
        .into_iter()
        .find(|e| e.event_type == EventKind::Killed.as_str())
        .unwrap();
    assert_eq!(killed.event_data.unwrap()["kill_reason"], "timeout");

    let fails = h
        .create(r#"{"templateID":"base","timeout":0,"autoPause":true}"#)
        .await;
    h.node.fail_pauses.store(1, Ordering::SeqCst);
    reap(&h, &in_flight).await;
    let r = h.req("GET", &format!("/sandboxes/{fails}"), None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

/// Self-keepalive: at its timeout, a sandbox whose guest asked to live on (envd
/// `POST /keepalive`, read through the node) is extended to the ask's end instead of reaped,
/// with an `updated` event saying so; a spent ask, or none, lets the timeout act.
#[tokio::test]
async fn a_guest_that_asked_to_live_on_is_extended_at_its_timeout() {
    let h = harness(limits(10)).await;
    let kept = h.create(r#"{"templateID":"base","timeout":0}"#).await;
    let spent = h.create(r#"{"templateID":"base","timeout":0}"#).await;
    let none = h.create(r#"{"templateID":"base","timeout":0}"#).await;
    let hostile = h.create(r#"{"templateID":"base","timeout":0}"#).await;
    {
        let mut asks = h.node.keepalive_asks.lock().unwrap();
        asks.insert(
            kept.clone(),
            vmon_proto::node::KeepaliveAsk {
                age_ms: 1_000,
                timeout_secs: 300,
            },
        );
        // Numbers no clock holds: refused, never a panic of the reaper.
        asks.insert(
            hostile.clone(),
            vmon_proto::node::KeepaliveAsk {
                age_ms: u64::MAX,
                timeout_secs: u64::MAX,
            },
        );
        // Asked 400 s ago for 300 s: over.
        asks.insert(
            spent.clone(),
            vmon_proto::node::KeepaliveAsk {
                age_ms: 400_000,
                timeout_secs: 300,
            },
        );
    }
    let in_flight = Arc::new(Mutex::new(HashSet::new()));
    reap(&h, &in_flight).await;
    let r = h.req("GET", &format!("/sandboxes/{kept}"), None).await;
    assert_eq!(r.json["state"], "running", "{}", r.json);
    let end = time::OffsetDateTime::parse(
        r.json["endAt"].as_str().expect("endAt"),
        &time::format_description::well_known::Rfc3339,
    )
    .expect("rfc3339");
    let left = (end - time::OffsetDateTime::now_utc()).whole_seconds();
    assert!(
        (290..=300).contains(&left),
        "extended to the ask's end: {left} s left"
    );
    let updated = h
        .events(&kept)
        .await
        .into_iter()
        .find(|e| e.event_type == EventKind::Updated.as_str())
        .expect("an updated event");
    assert_eq!(updated.event_data.unwrap()["keepalive"], true);
    for gone in [&spent, &none, &hostile] {
        let r = h.req("GET", &format!("/sandboxes/{gone}"), None).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{gone} is reaped");
    }
}
