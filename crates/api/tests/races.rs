//! Calls and requests that meet a pause in flight, ordered by fault points
//! (`vmon_faults`) instead of timing: the timeout's auto-pause is held after the node
//! stopped the guest and before the record says so (`pause:commit`), the racing call is let
//! in until it queues behind the sandbox's lock (`lock:busy`) or, for proxied traffic, until
//! the proxy saw the pause (`proxy:await-pause`), and only then is the pause released. Each
//! call must get what it gets after the pause, never a 5xx of the race. A fake node, a real
//! in-process proxy and a loopback server standing in for the guest; the same races on real
//! VMs with the SDK are `tests/e2e/test_races.py`.

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::{harness_configured, Harness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vmon_api::records::TeamLimits;

fn limits() -> TeamLimits {
    TeamLimits {
        max_concurrent: 10,
        ..TeamLimits::default()
    }
}

/// A harness whose fault points are armed in a directory of its own.
async fn harness() -> (Arc<Harness>, tempfile::TempDir) {
    let faults = tempfile::tempdir().unwrap();
    let dir = faults.path().to_path_buf();
    let h = harness_configured(limits(), move |c| c.fault_dir = Some(dir)).await;
    (Arc::new(h), faults)
}

fn arm(dir: &Path, point: &str, how: &str) {
    std::fs::write(dir.join(point), how).unwrap();
}

fn release(dir: &Path, point: &str) {
    std::fs::remove_file(dir.join(point)).unwrap();
}

/// Waits until `point` was reached for `id` (the hook appends the id to `<point>.reached`).
async fn reached(dir: &Path, point: &str, id: &str) {
    let file: PathBuf = dir.join(format!("{point}.reached"));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        if text.lines().any(|l| l == id) {
            return;
        }
        assert!(Instant::now() < deadline, "{point} never reached for {id}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn was_reached(dir: &Path, point: &str, id: &str) -> bool {
    std::fs::read_to_string(dir.join(format!("{point}.reached")))
        .unwrap_or_default()
        .lines()
        .any(|l| l == id)
}

/// Starts the timeout's auto-pause of `id` (expired at create) and returns once it holds at
/// `pause:commit`: the node has paused the guest, the record still says running.
async fn auto_pause_held(h: &Arc<Harness>, dir: &Path, id: &str) {
    arm(dir, "pause:commit", id);
    let in_flight = Arc::new(Mutex::new(HashSet::new()));
    h.control.reap_once(&in_flight).await;
    reached(dir, "pause:commit", id).await;
}

fn event_types(events: &[vmon_api::records::Event]) -> Vec<String> {
    events.iter().map(|e| e.event_type.clone()).collect()
}

/// A racing call: method, path after the sandbox's, body, its status after the pause, and
/// the sandbox's state then (`None`: gone).
type Case = (
    &'static str,
    &'static str,
    Option<&'static str>,
    StatusCode,
    Option<&'static str>,
);

/// Every SDK-facing call that meets the auto-pause in flight waits for it and then answers as
/// it does for a paused sandbox.
#[tokio::test]
async fn calls_that_meet_an_auto_pause_wait_for_it_and_answer_as_after_it() {
    let (h, faults) = harness().await;
    let dir = faults.path();
    arm(dir, "lock:busy", "pass");
    // (method, call, body, status after the pause, what the record is then)
    let cases: [Case; 6] = [
        (
            "POST",
            "connect",
            Some(r#"{"timeout":300}"#),
            StatusCode::CREATED,
            Some("running"),
        ),
        ("DELETE", "", None, StatusCode::NO_CONTENT, None),
        (
            "POST",
            "timeout",
            Some(r#"{"timeout":300}"#),
            StatusCode::NOT_FOUND,
            Some("paused"),
        ),
        (
            "POST",
            "fork",
            Some(r#"{"timeout":300,"count":1}"#),
            StatusCode::CREATED,
            Some("paused"),
        ),
        (
            "POST",
            "snapshots",
            Some("{}"),
            StatusCode::CONFLICT,
            Some("paused"),
        ),
        ("POST", "pause", None, StatusCode::CONFLICT, Some("paused")),
    ];
    for (method, call, body, want, state) in cases {
        let id = h
            .create(r#"{"templateID":"base","timeout":0,"autoPause":true}"#)
            .await;
        auto_pause_held(&h, dir, &id).await;
        let path = if call.is_empty() {
            format!("/sandboxes/{id}")
        } else {
            format!("/sandboxes/{id}/{call}")
        };
        let racer = {
            let h = h.clone();
            let body = body.map(str::to_string);
            tokio::spawn(async move { h.req(method, &path, body.as_deref()).await })
        };
        // The call is queued behind the pause before the pause may finish.
        reached(dir, "lock:busy", &id).await;
        assert!(
            !racer.is_finished(),
            "{call}: answered while the pause held"
        );
        release(dir, "pause:commit");
        let r = racer.await.unwrap();
        assert_eq!(r.status, want, "{call}: {:?}", r.json);
        if !want.is_success() {
            assert_eq!(r.json["code"], want.as_u16(), "{call}: {:?}", r.json);
            assert!(r.json["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
        let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
        match state {
            Some(s) => assert_eq!(d.json["state"], s, "{call}: {:?}", d.json),
            None => assert_eq!(d.status, StatusCode::NOT_FOUND, "{call}: {:?}", d.json),
        }
        let events = event_types(&h.events(&id).await);
        assert_eq!(
            events.iter().filter(|e| e.ends_with(".paused")).count(),
            1,
            "{call}: one pause, recorded once: {events:?}"
        );
    }
}

/// A loopback server standing in for the guest: answers `ok` to every request, after
/// `gate` opens when one is given; `seen` gets a message per request received.
async fn guest(
    gate: Option<Arc<tokio::sync::Semaphore>>,
) -> (u16, tokio::sync::mpsc::UnboundedReceiver<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (seen, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let gate = gate.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = seen.send(());
                if let Some(g) = gate {
                    let _permit = g.acquire().await;
                }
                let _ = s
                    .write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            });
        }
    });
    (port, rx)
}

/// The in-process proxy `vmon up` runs, over this harness's control plane.
async fn proxy(h: &Arc<Harness>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let p = vmon_proxy::Proxy::new(Arc::new(vmon_api::ProxyRoutes(h.control.clone())))
        .with_activity(h.control.activity().clone())
        .with_faults(h.control.faults().clone());
    tokio::spawn(p.serve(listener, tokio_util::sync::CancellationToken::new()));
    addr
}

/// One request through the proxy to `port` of `id`: its status and body.
async fn get(proxy: std::net::SocketAddr, id: &str, port: u16) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(proxy).await.unwrap();
    let req = format!("GET / HTTP/1.1\r\nhost: {port}-{id}.localhost\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body)
}

/// E2B's `test_auto_resume_wakes_on_http_request` on a loaded machine: the request meets the
/// auto-pause in flight. With auto-resume it waits and wakes the sandbox; without, it gets
/// the paused answer (never a 502 of a guest that stopped under it).
#[tokio::test]
async fn a_request_that_meets_an_auto_pause_resumes_or_gets_the_paused_answer() {
    let (h, faults) = harness().await;
    let dir = faults.path();
    let (port, _seen) = guest(None).await;
    let proxy = proxy(&h).await;
    arm(dir, "proxy:await-pause", "pass");
    for auto_resume in [true, false] {
        let body = if auto_resume {
            r#"{"templateID":"base","timeout":0,"autoPause":true,"autoResume":{"enabled":true}}"#
        } else {
            r#"{"templateID":"base","timeout":0,"autoPause":true}"#
        };
        let id = h.create(body).await;
        auto_pause_held(&h, dir, &id).await;
        let request = tokio::spawn({
            let id = id.clone();
            async move { get(proxy, &id, port).await }
        });
        reached(dir, "proxy:await-pause", &id).await;
        assert!(!request.is_finished(), "answered while the pause held");
        release(dir, "pause:commit");
        let (status, text) = request.await.unwrap();
        let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
        let events = event_types(&h.events(&id).await);
        if auto_resume {
            assert_eq!((status, text.as_str()), (200, "ok"));
            assert_eq!(d.json["state"], "running");
            assert!(events.iter().any(|e| e.ends_with(".resumed")), "{events:?}");
        } else {
            assert_eq!(status, 502, "{text}");
            assert!(
                text.contains("does not resume on traffic"),
                "the paused answer: {text}"
            );
            assert_eq!(d.json["state"], "paused");
        }
    }
}

/// A request already waiting on the guest when a pause begins gets its answer before the
/// node stops the guest: the pause drains it first.
#[tokio::test]
async fn a_pause_waits_for_requests_already_waiting_on_the_guest() {
    let (h, faults) = harness().await;
    let dir = faults.path();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (port, mut seen) = guest(Some(gate.clone())).await;
    let proxy = proxy(&h).await;
    let id = h
        .create(
            r#"{"templateID":"base","timeout":0,"autoPause":true,"autoResume":{"enabled":true}}"#,
        )
        .await;
    let request = tokio::spawn({
        let id = id.clone();
        async move { get(proxy, &id, port).await }
    });
    seen.recv().await.unwrap();
    arm(dir, "pause:drain", "pass");
    arm(dir, "pause:node", "pass");
    let in_flight = Arc::new(Mutex::new(HashSet::new()));
    h.control.reap_once(&in_flight).await;
    reached(dir, "pause:drain", &id).await;
    assert!(
        !was_reached(dir, "pause:node", &id),
        "the node was asked to pause while a request waited on the guest"
    );
    gate.add_permits(1);
    assert_eq!(request.await.unwrap(), (200, "ok".to_string()));
    reached(dir, "pause:node", &id).await;
}
