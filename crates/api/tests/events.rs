//! Lifecycle events and signed webhooks against the real store (SQLite) and a local HTTP
//! receiver: order and signatures of a full lifecycle, retries, the 10 s cut, paging and
//! filters, retention, validation, and a secret that never comes back out.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use common::{harness, Harness};
use tokio_util::sync::CancellationToken;
use vmon_api::control::signature;
use vmon_api::records::{EventKind, Records, TeamLimits};

const SECRET: &str = "s3cret-find-me-in-a-response";
const ALL: [&str; 6] = [
    "sandbox.lifecycle.created",
    "sandbox.lifecycle.updated",
    "sandbox.lifecycle.paused",
    "sandbox.lifecycle.resumed",
    "sandbox.lifecycle.checkpointed",
    "sandbox.lifecycle.killed",
];

/// What the receiver does with the next request.
#[derive(Clone, Copy, Debug)]
enum Answer {
    Status(u16),
    /// Never answers.
    Hang,
}

#[derive(Clone, Debug)]
struct Received {
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Clone, Default)]
struct Receiver {
    script: Arc<Mutex<VecDeque<Answer>>>,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    /// Serves on a free loopback port; answers 200 once the script runs out.
    async fn start(script: &[Answer]) -> (Receiver, SocketAddr) {
        let r = Receiver {
            script: Arc::new(Mutex::new(script.iter().copied().collect())),
            got: Arc::default(),
        };
        let app = axum::Router::new().fallback(receive).with_state(r.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (r, addr)
    }

    fn got(&self) -> Vec<Received> {
        self.got.lock().unwrap().clone()
    }

    async fn wait_for(&self, n: usize, within: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let got = self.got();
            if got.len() >= n || tokio::time::Instant::now() > deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> StatusCode {
    r.got.lock().unwrap().push(Received { headers, body });
    let answer = r.script.lock().unwrap().pop_front();
    match answer.unwrap_or(Answer::Status(200)) {
        Answer::Status(s) => StatusCode::from_u16(s).unwrap(),
        Answer::Hang => futures::future::pending().await,
    }
}

fn limits() -> TeamLimits {
    TeamLimits {
        max_concurrent: 5,
        ..TeamLimits::default()
    }
}

/// The harness with its leader duties (reaper, dispatcher) running until the guard drops.
async fn leading_harness() -> (Harness, tokio_util::sync::DropGuard) {
    let h = harness(limits()).await;
    let cancel = CancellationToken::new();
    tokio::spawn(h.control.clone().run_reaper(cancel.clone()));
    (h, cancel.drop_guard())
}

/// Registers a webhook and returns its id; every answer is checked for the secret.
async fn register(h: &Harness, addr: SocketAddr, events: &[&str]) -> String {
    let body = serde_json::json!({
        "name": "test",
        "url": format!("http://{addr}/hook"),
        "signatureSecret": SECRET,
        "events": events,
    });
    let r = h
        .req("POST", "/events/webhooks", Some(&body.to_string()))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    assert_no_secret(&r.json);
    assert!(r.json.get("signatureSecret").is_none());
    r.json["id"].as_str().unwrap().to_string()
}

fn assert_no_secret(v: &serde_json::Value) {
    assert!(
        !v.to_string().contains(SECRET),
        "the secret came back in {v}"
    );
}

fn json(r: &Received) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap()
}

fn header<'a>(r: &'a Received, name: &str) -> &'a str {
    r.headers.get(name).unwrap().to_str().unwrap()
}

/// The deliveries recorded for a webhook, oldest first.
async fn deliveries(h: &Harness, hook: &str, want: usize, within: Duration) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let r = h
            .req("GET", &format!("/events/webhooks/{hook}/deliveries"), None)
            .await;
        assert_eq!(r.status, StatusCode::OK);
        assert_no_secret(&r.json);
        let n = r.json.as_array().unwrap().len();
        if n >= want || tokio::time::Instant::now() > deadline {
            let mut list = r.json.as_array().unwrap().clone();
            list.reverse();
            return serde_json::Value::Array(list);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_full_lifecycle_arrives_signed_and_in_order() {
    let (h, _leading) = leading_harness().await;
    let (rx, addr) = Receiver::start(&[]).await;
    let hook = register(&h, addr, &ALL).await;

    let id = h
        .create(r#"{"templateID":"base","timeout":600,"metadata":{"job":"42"}}"#)
        .await;
    let steps = [
        (
            "POST",
            format!("/sandboxes/{id}/timeout"),
            r#"{"timeout":300}"#,
        ),
        ("POST", format!("/sandboxes/{id}/pause"), "{}"),
        (
            "POST",
            format!("/v2/sandboxes/{id}/connect"),
            r#"{"timeout":60}"#,
        ),
        (
            "POST",
            format!("/sandboxes/{id}/snapshots"),
            r#"{"name":"snap"}"#,
        ),
        ("DELETE", format!("/sandboxes/{id}"), ""),
    ];
    for (m, p, b) in &steps {
        let r = h.req(m, p, Some(b)).await;
        assert!(r.status.is_success(), "{m} {p}: {:?}", r.json);
    }

    let got = rx.wait_for(6, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 6, "six deliveries");
    let types: Vec<String> = got
        .iter()
        .map(|r| json(r)["type"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(types, ALL, "in lifecycle order");
    let mut delivery_ids = HashSet::new();
    for r in &got {
        assert_eq!(
            header(r, "e2b-signature"),
            signature(SECRET, &r.body),
            "signed"
        );
        // The receiver's check, as the seed writes it in Python.
        let expected = {
            use base64::Engine as _;
            use sha2::Digest as _;
            let mut d = sha2::Sha256::new();
            d.update(SECRET.as_bytes());
            d.update(&r.body);
            base64::engine::general_purpose::STANDARD
                .encode(d.finalize())
                .trim_end_matches('=')
                .to_string()
        };
        assert_eq!(header(r, "e2b-signature"), expected);
        assert_eq!(header(r, "e2b-signature-version"), "v1");
        assert_eq!(header(r, "e2b-webhook-id"), hook);
        assert!(header(r, "content-type").starts_with("application/json"));
        assert!(delivery_ids.insert(header(r, "e2b-delivery-id").to_string()));
        let body = json(r);
        let mut keys: Vec<&str> = body
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "event_category",
                "event_data",
                "event_label",
                "events_ttl_days",
                "id",
                "sandbox_build_id",
                "sandbox_execution_id",
                "sandbox_id",
                "sandbox_team_id",
                "sandbox_template_id",
                "timestamp",
                "type",
                "version"
            ]
        );
        assert_eq!(body["sandbox_id"], id.as_str());
        assert_eq!(body["version"], "v1");
        assert_eq!(body["event_category"], "lifecycle");
        assert_eq!(body["sandbox_team_id"], h.team_id.as_str());
        assert_eq!(body["events_ttl_days"], 30);
    }
    let bodies: Vec<serde_json::Value> = got.iter().map(json).collect();
    assert_eq!(bodies[0]["event_data"]["sandbox_metadata"]["job"], "42");
    assert!(bodies[1]["event_data"]["set_timeout"].is_string());
    assert_eq!(bodies[4]["event_data"]["reason"], "snapshot");
    assert_eq!(bodies[5]["event_data"]["kill_reason"], "request");
    assert_ne!(
        bodies[2]["sandbox_execution_id"], bodies[3]["sandbox_execution_id"],
        "a resume is a new execution"
    );

    // The events API tells the same story, in the E2B shape.
    let r = h
        .req(
            "GET",
            &format!("/events/sandboxes/{id}?orderAsc=true&limit=50"),
            None,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let events = r.json.as_array().unwrap();
    let api_types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(api_types, ALL);
    for (e, b) in events.iter().zip(&bodies) {
        assert_eq!(e["id"], b["id"]);
        assert_eq!(e["version"], "v1");
        assert_eq!(e["sandboxId"], id.as_str());
        assert_eq!(e["sandboxExecutionId"], b["sandbox_execution_id"]);
        assert_eq!(e["sandboxBuildId"], b["sandbox_build_id"]);
        assert_eq!(e["sandboxTemplateId"], b["sandbox_template_id"]);
        assert_eq!(e["sandboxTeamId"], h.team_id.as_str());
        assert_eq!(e["eventData"], b["event_data"]);
        assert!(e["timestamp"].is_string());
    }

    // Every attempt was recorded; the secret is in no answer.
    let d = deliveries(&h, &hook, 6, Duration::from_secs(5)).await;
    assert_eq!(d.as_array().unwrap().len(), 6);
    assert!(d
        .as_array()
        .unwrap()
        .iter()
        .all(|a| a["success"] == true && a["statusCode"] == 200 && a["attempt"] == 1));
    // An attempt is recorded before its outbox row is marked done: `pending` reaches 0 just
    // after the last delivery shows, not with it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let s = loop {
        let s = h
            .req("GET", &format!("/events/webhooks/{hook}/stats"), None)
            .await;
        assert_eq!(s.status, StatusCode::OK);
        if s.json["pending"] == 0 || tokio::time::Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (s.json["attempts"].as_i64(), s.json["successes"].as_i64()),
        (Some(6), Some(6))
    );
    assert_eq!(s.json["pending"], 0);
    for path in [
        "/events/webhooks".to_string(),
        format!("/events/webhooks/{hook}"),
        format!("/events/webhooks/{hook}/stats"),
    ] {
        let r = h.req("GET", &path, None).await;
        assert_eq!(r.status, StatusCode::OK, "{path}");
        assert_no_secret(&r.json);
    }
    let r = h
        .req(
            "PATCH",
            &format!("/events/webhooks/{hook}"),
            Some(r#"{"signatureSecret":"another-one","enabled":false}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["enabled"], false);
    assert!(!r.json.to_string().contains("another-one"));
}

#[tokio::test]
async fn a_receiver_failing_twice_gets_the_third_attempt() {
    let (h, _leading) = leading_harness().await;
    let (rx, addr) = Receiver::start(&[Answer::Status(500), Answer::Status(503)]).await;
    let hook = register(&h, addr, &["sandbox.lifecycle.created"]).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;

    let got = rx.wait_for(3, Duration::from_secs(20)).await;
    assert_eq!(got.len(), 3);
    for r in &got {
        assert_eq!(json(r)["sandbox_id"], id.as_str());
        assert_eq!(header(r, "e2b-signature"), signature(SECRET, &r.body));
    }
    let ids: HashSet<&str> = got.iter().map(|r| header(r, "e2b-delivery-id")).collect();
    assert_eq!(
        ids.len(),
        1,
        "the attempts of one event share its delivery id"
    );

    let d = deliveries(&h, &hook, 3, Duration::from_secs(5)).await;
    let d = d.as_array().unwrap();
    let seen: Vec<(i64, i64, bool)> = d
        .iter()
        .map(|a| {
            (
                a["attempt"].as_i64().unwrap(),
                a["statusCode"].as_i64().unwrap(),
                a["success"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(seen, [(1, 500, false), (2, 503, false), (3, 200, true)]);
    assert!(d[0]["error"].as_str().unwrap().contains("500"));
    assert!(d[2]["error"].is_null());
    let s = h
        .req("GET", &format!("/events/webhooks/{hook}/stats"), None)
        .await;
    assert_eq!(
        (s.json["attempts"].as_i64(), s.json["failures"].as_i64()),
        (Some(3), Some(2))
    );
}

#[tokio::test]
async fn a_hanging_receiver_is_cut_at_ten_seconds_and_delivery_moves_on() {
    let (h, _leading) = leading_harness().await;
    let (rx, addr) = Receiver::start(&[Answer::Hang, Answer::Hang, Answer::Hang]).await;
    let hook = register(
        &h,
        addr,
        &["sandbox.lifecycle.created", "sandbox.lifecycle.killed"],
    )
    .await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let k = h.req("DELETE", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(k.status, StatusCode::NO_CONTENT);

    let got = rx.wait_for(4, Duration::from_secs(60)).await;
    let types: Vec<String> = got
        .iter()
        .map(|r| json(r)["type"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        types,
        [
            "sandbox.lifecycle.created",
            "sandbox.lifecycle.created",
            "sandbox.lifecycle.created",
            "sandbox.lifecycle.killed"
        ],
        "three cut attempts, then the next event"
    );
    let d = deliveries(&h, &hook, 4, Duration::from_secs(5)).await;
    let d = d.as_array().unwrap();
    assert_eq!(d.len(), 4);
    for a in &d[..3] {
        assert_eq!(a["success"], false);
        assert!(a["statusCode"].is_null());
        assert!(
            a["durationMs"].as_i64().unwrap() >= 10_000,
            "cut at 10 s, not before: {a}"
        );
        assert!(a["error"].as_str().unwrap().contains("10000 ms"));
    }
    assert_eq!(d[3]["success"], true);
    assert_ne!(d[0]["eventID"], d[3]["eventID"]);
}

#[tokio::test]
async fn events_page_and_filter() {
    let h = harness(limits()).await;
    let a = h.create(r#"{"templateID":"base"}"#).await;
    let b = h.create(r#"{"templateID":"base"}"#).await;
    h.pause(&a).await;
    h.req("DELETE", &format!("/sandboxes/{b}"), None).await;
    // Team-wide: created a, created b, paused a, killed b.

    let r = h.req("GET", "/events/sandboxes", None).await;
    assert_eq!(r.status, StatusCode::OK);
    let all: Vec<&str> = r
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        all,
        [
            "sandbox.lifecycle.killed",
            "sandbox.lifecycle.paused",
            "sandbox.lifecycle.created",
            "sandbox.lifecycle.created"
        ],
        "newest first by default"
    );
    let page = |q: &str| {
        let q = q.to_string();
        let h = &h;
        async move {
            let r = h.req("GET", &format!("/events/sandboxes?{q}"), None).await;
            assert_eq!(r.status, StatusCode::OK, "{q}: {:?}", r.json);
            r.json
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    (
                        e["type"]
                            .as_str()
                            .unwrap()
                            .rsplit('.')
                            .next()
                            .unwrap()
                            .to_string(),
                        e["sandboxId"].as_str().unwrap().to_string(),
                    )
                })
                .collect::<Vec<_>>()
        }
    };
    let c = |s: &str| s.to_string();
    assert_eq!(
        page("limit=2&orderAsc=true").await,
        [(c("created"), a.clone()), (c("created"), b.clone())]
    );
    assert_eq!(
        page("limit=2&offset=2&orderAsc=true").await,
        [(c("paused"), a.clone()), (c("killed"), b.clone())]
    );
    assert_eq!(page("offset=4").await, []);
    assert_eq!(
        page("types=sandbox.lifecycle.paused,sandbox.lifecycle.killed&orderAsc=true").await,
        [(c("paused"), a.clone()), (c("killed"), b.clone())]
    );
    assert_eq!(
        page("types=sandbox.lifecycle.paused&types=sandbox.lifecycle.killed").await,
        [(c("killed"), b.clone()), (c("paused"), a.clone())]
    );
    let r = h
        .req("GET", &format!("/events/sandboxes/{b}?orderAsc=true"), None)
        .await;
    let of_b: Vec<&str> = r
        .json
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        of_b,
        ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"],
        "a killed sandbox's events stay readable"
    );
    for bad in [
        "limit=0",
        "limit=101",
        "limit=ten",
        "offset=-1",
        "orderAsc=sometimes",
        "types=sandbox.lifecycle.exploded",
    ] {
        let r = h
            .req("GET", &format!("/events/sandboxes?{bad}"), None)
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(r.json["code"], 400);
        assert!(r.json["message"].is_string());
    }
    assert_eq!(page("limit=100").await.len(), 4);
    // Another team sees none of it.
    let other = h.other_key.clone();
    let r = h
        .call("GET", "/events/sandboxes", Some(&other), None, &[])
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 0);
    let r = h
        .call(
            "GET",
            &format!("/events/sandboxes/{a}"),
            Some(&other),
            None,
            &[],
        )
        .await;
    assert_eq!(r.json.as_array().unwrap().len(), 0);
    let r = h.call("GET", "/events/sandboxes", None, None, &[]).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn events_older_than_thirty_days_are_deleted() {
    let h = harness(limits()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    let old = h.events(&id).await.remove(0);
    let mut stale = vmon_store::NewEvent {
        event_type: EventKind::Updated.as_str().to_string(),
        event_data: None,
        sandbox_id: id.clone(),
        execution_id: old.execution_id.clone(),
        build_id: old.build_id.clone(),
        team_id: old.team_id.clone(),
        template_id: old.template_id.clone(),
        timestamp: time::OffsetDateTime::now_utc() - time::Duration::days(31),
    };
    h.records.store().append_event(&stale).await.unwrap();
    stale.timestamp = time::OffsetDateTime::now_utc() - time::Duration::days(29);
    h.records.store().append_event(&stale).await.unwrap();
    assert_eq!(h.events(&id).await.len(), 3);
    h.control.expire_events().await;
    let left = h.events(&id).await;
    assert_eq!(left.len(), 2, "only the 31-day-old event went");
    assert!(left
        .iter()
        .any(|e| e.event_type == EventKind::Created.as_str()));
    let cutoff = time::OffsetDateTime::now_utc() - time::Duration::days(30);
    assert!(left.iter().all(|e| e.timestamp > cutoff));
}

#[tokio::test]
async fn webhooks_are_validated_and_owned() {
    let h = harness(limits()).await;
    let ok = |url: &str, events: serde_json::Value, secret: serde_json::Value| {
        serde_json::json!({"name": "x", "url": url, "events": events, "signatureSecret": secret})
            .to_string()
    };
    let events = serde_json::json!(["sandbox.lifecycle.created"]);
    let long_url = format!("https://hooks.example.com/{}", "a".repeat(2048));
    for body in [
        ok("ftp://hooks.example.com/x", events.clone(), SECRET.into()),
        ok("/relative", events.clone(), SECRET.into()),
        ok(&long_url, events.clone(), SECRET.into()),
        ok("http://127.0.0.1:9/x", serde_json::json!([]), SECRET.into()),
        ok(
            "http://127.0.0.1:9/x",
            serde_json::json!(["sandbox.exploded"]),
            SECRET.into(),
        ),
        ok("http://127.0.0.1:9/x", events.clone(), "".into()),
        ok(
            "http://127.0.0.1:9/x",
            events.clone(),
            "s".repeat(513).into(),
        ),
        ok("http://127.0.0.1:9/x", events.clone(), serde_json::json!(7)),
        r#"{"url":"http://127.0.0.1:9/x","events":["sandbox.lifecycle.created"]}"#.to_string(),
    ] {
        let r = h.req("POST", "/events/webhooks", Some(&body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}: {:?}", r.json);
        assert_eq!(r.json["code"], 400);
        assert_no_secret(&r.json);
    }
    let r = h
        .req(
            "POST",
            "/events/webhooks",
            Some(&ok(
                "https://hooks.example.com/e2b",
                events.clone(),
                "s".repeat(512).into(),
            )),
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    let id = r.json["id"].as_str().unwrap().to_string();
    assert_eq!(r.json["enabled"], true);
    assert_eq!(r.json["teamID"], h.team_id.as_str());

    let r = h
        .req(
            "PATCH",
            &format!("/events/webhooks/{id}"),
            Some(r#"{"events":[]}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = h
        .req(
            "PATCH",
            &format!("/events/webhooks/{id}"),
            Some(r#"{"url":"http://127.0.0.1:9/new","events":["sandbox.lifecycle.killed"]}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json["url"], "http://127.0.0.1:9/new");
    assert_eq!(
        r.json["events"],
        serde_json::json!(["sandbox.lifecycle.killed"])
    );

    // Another team's webhook does not exist for this one.
    let other = h.other_key.clone();
    for (m, p) in [
        ("GET", format!("/events/webhooks/{id}")),
        ("DELETE", format!("/events/webhooks/{id}")),
        ("GET", format!("/events/webhooks/{id}/deliveries")),
        ("GET", format!("/events/webhooks/{id}/stats")),
    ] {
        let r = h.call(m, &p, Some(&other), None, &[]).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{m} {p}");
    }
    let r = h
        .req("DELETE", &format!("/events/webhooks/{id}"), None)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h.req("GET", &format!("/events/webhooks/{id}"), None).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(h.records.webhooks(&h.team_id).await.unwrap().len(), 0);
}

/// A private or shared range in `allowOut` is the operator's to open (`private_allow`): a 400
/// naming the entry at create and at a network update otherwise; `0.0.0.0/0` stays the
/// internet; inside `private_allow` it is accepted.
#[tokio::test]
async fn private_allow_out_is_refused_unless_the_operator_lists_it() {
    let h = harness(limits()).await;
    for entry in [
        "10.1.2.3",
        "192.168.0.0/16",
        "100.64.0.1",
        "172.16.5.0/24",
        "198.18.0.1",
    ] {
        let body =
            format!(r#"{{"templateID":"base","network":{{"allowOut":["8.8.8.8","{entry}"]}}}}"#);
        let r = h.req("POST", "/v2/sandboxes", Some(&body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{entry}: {:?}", r.json);
        let m = r.json["message"].as_str().unwrap_or_default();
        assert!(m.contains(entry) && m.contains("private_allow"), "{m}");
        assert_eq!(r.json["code"], 400, "{:?}", r.json);
    }
    let id = h
        .create(r#"{"templateID":"base","network":{"allowOut":["0.0.0.0/0","8.8.8.8"]}}"#)
        .await;
    let r = h
        .req(
            "PUT",
            &format!("/sandboxes/{id}/network"),
            Some(r#"{"allowOut":["10.9.9.9"]}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    assert!(
        r.json["message"]
            .as_str()
            .unwrap_or_default()
            .contains("10.9.9.9"),
        "{:?}",
        r.json
    );
    assert!(
        h.node.networks.lock().unwrap().is_empty(),
        "a refused update never reaches the node"
    );

    // The operator lists 10.9.0.0/16: entries inside it stand, others still do not.
    let h = common::harness_configured(limits(), |c| c.private_allow = vec!["10.9.0.0/16".into()])
        .await;
    let id = h
        .create(r#"{"templateID":"base","network":{"allowOut":["10.9.1.0/24"]}}"#)
        .await;
    let r = h
        .req(
            "PUT",
            &format!("/sandboxes/{id}/network"),
            Some(r#"{"allowOut":["10.9.9.9"]}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.json);
    for outside in ["10.8.0.1", "10.0.0.0/8"] {
        let body = format!(r#"{{"allowOut":["{outside}"]}}"#);
        let r = h
            .req("PUT", &format!("/sandboxes/{id}/network"), Some(&body))
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{outside}: {:?}", r.json);
    }
}

#[tokio::test]
async fn network_updates_reach_the_node_and_emit_updated() {
    let h = harness(limits()).await;
    let id = h.create(r#"{"templateID":"base"}"#).await;
    for bad in [
        r#"{"allowOut":["exa mple.com"]}"#,
        r#"{"allowOut":["example.com; flush ruleset"]}"#,
        r#"{"denyOut":["10.0.0.0/33"]}"#,
        r#"{"dnsServers":["::1"]}"#,
        r#"{"allowOut":"8.8.8.8"}"#,
    ] {
        let r = h
            .req("PUT", &format!("/sandboxes/{id}/network"), Some(bad))
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {:?}", r.json);
    }
    assert!(h.node.networks.lock().unwrap().is_empty());
    let r = h
        .req(
            "PUT",
            &format!("/sandboxes/{id}/network"),
            Some(r#"{"allowOut":["8.8.8.8/32"],"denyOut":["0.0.0.0/0"],"allow_internet_access":false}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT, "{:?}", r.json);
    let (sandbox, policy) = h.node.networks.lock().unwrap().last().cloned().unwrap();
    assert_eq!(sandbox, id);
    assert_eq!(policy.allow_out, ["8.8.8.8/32"]);
    assert_eq!(policy.deny_out, ["0.0.0.0/0"]);
    assert!(!policy.allow_internet_access);
    let d = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(
        d.json["network"]["allowOut"],
        serde_json::json!(["8.8.8.8/32"])
    );
    assert_eq!(d.json["allowInternetAccess"], false);
    let updated = h.events(&id).await.pop().unwrap();
    assert_eq!(updated.event_type, EventKind::Updated.as_str());
    assert_eq!(
        updated.event_data.unwrap()["network"]["allowOut"],
        serde_json::json!(["8.8.8.8/32"])
    );
    // Replace-all: what is left out is cleared; a resume applies the stored policy.
    let r = h
        .req("PUT", &format!("/sandboxes/{id}/network"), Some("{}"))
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let (_, policy) = h.node.networks.lock().unwrap().last().cloned().unwrap();
    assert!(policy.allow_out.is_empty() && policy.allow_internet_access);
    h.pause(&id).await;
    let r = h
        .req("PUT", &format!("/sandboxes/{id}/network"), Some("{}"))
        .await;
    assert_eq!(r.status, StatusCode::CONFLICT, "paused");
    let other = h.other_key.clone();
    let r = h
        .call(
            "PUT",
            &format!("/sandboxes/{id}/network"),
            Some(&other),
            Some("{}"),
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn webhooks_to_this_host_or_private_networks_are_refused() {
    let h = harness(limits()).await;
    for url in [
        "http://169.254.169.254/latest/meta-data",
        "http://10.0.0.1/hook",
        "http://192.168.1.10:8080/hook",
        "http://127.0.0.2:9/hook",
        "http://[::1]:9/hook",
        "http://[::ffff:127.0.0.2]:9/hook",
        "http://0.0.0.0:9/hook",
    ] {
        let body = serde_json::json!({
            "name": "x", "url": url, "events": ["sandbox.lifecycle.created"],
            "signatureSecret": "s3cret-s3cret",
        });
        let r = h
            .req("POST", "/events/webhooks", Some(&body.to_string()))
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{url}: {:?}", r.json);
        assert!(
            r.json["message"]
                .as_str()
                .unwrap_or("")
                .contains("webhook_allow"),
            "{:?}",
            r.json
        );
    }
    assert!(h.records.webhooks(&h.team_id).await.unwrap().is_empty());
    // What the operator allowed (127.0.0.1/32 in this harness) is fine, and a PATCH to a
    // refused address is refused again.
    let body = serde_json::json!({
        "name": "ok", "url": "http://127.0.0.1:9/hook", "events": ["sandbox.lifecycle.created"],
        "signatureSecret": "s3cret-s3cret",
    });
    let r = h
        .req("POST", "/events/webhooks", Some(&body.to_string()))
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    let id = r.json["id"].as_str().unwrap().to_string();
    let r = h
        .req(
            "PATCH",
            &format!("/events/webhooks/{id}"),
            Some(r#"{"url":"http://169.254.169.254/"}"#),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    let r = h.req("GET", &format!("/events/webhooks/{id}"), None).await;
    assert_eq!(r.json["url"], "http://127.0.0.1:9/hook");
}
