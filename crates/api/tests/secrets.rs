//! Secrets over REST against the real store: CRUD by id or name, values never returned (and
//! sealed at rest), paging with `X-Next-Token`, team scoping, bounds, and network rules that
//! name secrets.

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use axum::http::StatusCode;
use vmon_api::records::TeamLimits;

const VALUE: &str = "s3cr3t-value-never-returned";

#[tokio::test]
async fn secrets_are_created_read_updated_and_deleted_without_their_values() {
    let h = common::harness(TeamLimits::default()).await;
    let body = format!(r#"{{"name":"My-Key","value":"{VALUE}","metadata":{{"env":"prod"}}}}"#);
    let c = h.req("POST", "/secrets", Some(&body)).await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
    assert_eq!(c.headers["cache-control"], "no-store");
    let id = c.json["secretID"].as_str().unwrap().to_string();
    assert!(id.starts_with("sec_"));
    assert_eq!(c.json["name"], "my-key");
    assert_eq!(c.json["currentVersion"], 1);
    assert_eq!(c.json["metadata"], serde_json::json!({"env": "prod"}));
    for key in ["createdAt", "updatedAt"] {
        assert!(c.json[key].is_string(), "{key}");
    }
    assert!(!c.json.to_string().contains(VALUE));

    for path in [format!("/secrets/{id}"), "/secrets/MY-KEY".to_string()] {
        let g = h.req("GET", &path, None).await;
        assert_eq!(g.status, StatusCode::OK, "{path}");
        assert_eq!(g.json["secretID"], id.as_str());
        assert!(!g.json.to_string().contains(VALUE));
    }
    let dup = h
        .req("POST", "/secrets", Some(r#"{"name":"my-key","value":"x"}"#))
        .await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(dup.json["code"], 409);

    let u = h
        .req("POST", "/secrets/my-key", Some(r#"{"value":"new-value"}"#))
        .await;
    assert_eq!(u.status, StatusCode::OK, "{:?}", u.json);
    assert_eq!(u.json["currentVersion"], 2);
    assert_eq!(
        u.json["metadata"],
        serde_json::json!({"env": "prod"}),
        "kept when not sent"
    );
    let u = h
        .req(
            "POST",
            &format!("/secrets/{id}"),
            Some(r#"{"value":"sealed-at-rest-marker-42","metadata":{}}"#),
        )
        .await;
    assert_eq!(u.json["currentVersion"], 3);
    assert_eq!(
        u.json["metadata"],
        serde_json::json!({}),
        "replaced when sent"
    );

    // Sealed at rest: the stored value decrypts, the database file does not hold it.
    let store = h.records.store();
    assert_eq!(
        store
            .secret_value(&h.team_id, &id)
            .await
            .unwrap()
            .as_deref(),
        Some("sealed-at-rest-marker-42")
    );
    for file in ["vmon.db", "vmon.db-wal"] {
        let bytes = std::fs::read(h._dir.path().join(file)).unwrap_or_default();
        let needle = b"sealed-at-rest-marker-42";
        assert!(
            !bytes.windows(needle.len()).any(|w| w == needle),
            "{file} holds the plaintext"
        );
    }
    let other = h.other_key.clone();
    for (method, path) in [
        ("GET", format!("/secrets/{id}")),
        ("POST", "/secrets/my-key".to_string()),
        ("DELETE", format!("/secrets/{id}")),
    ] {
        let r = h
            .call(method, &path, Some(&other), Some(r#"{"value":"x"}"#), &[])
            .await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{method} {path}");
    }
    let listed = h.call("GET", "/secrets", Some(&other), None, &[]).await;
    assert_eq!(listed.json, serde_json::json!([]));

    let d = h.req("DELETE", "/secrets/My-Key", None).await;
    assert_eq!(d.status, StatusCode::NO_CONTENT);
    assert_eq!(
        h.req("GET", &format!("/secrets/{id}"), None).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        h.req("DELETE", &format!("/secrets/{id}"), None)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn secret_lists_page_with_x_next_token() {
    let h = common::harness(TeamLimits::default()).await;
    for i in 0..5 {
        let r = h
            .req(
                "POST",
                "/secrets",
                Some(&format!(r#"{{"name":"s{i}","value":"v"}}"#)),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
    let mut names = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let uri = match &token {
            None => "/secrets?limit=2".to_string(),
            Some(t) => format!("/secrets?limit=2&nextToken={t}"),
        };
        let r = h.req("GET", &uri, None).await;
        assert_eq!(r.status, StatusCode::OK);
        pages += 1;
        names.extend(
            r.json
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["name"].as_str().unwrap().to_string()),
        );
        match r.headers.get("x-next-token") {
            Some(t) => token = Some(t.to_str().unwrap().to_string()),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    // Oldest first; secrets made in the same millisecond order by id, so compare as a set.
    names.sort();
    assert_eq!(names, ["s0", "s1", "s2", "s3", "s4"], "every secret once");
    let all = h.req("GET", "/secrets?limit=5", None).await;
    assert!(
        all.headers.get("x-next-token").is_none(),
        "no token without another page"
    );
    for bad in [
        "limit=0",
        "limit=1001",
        "limit=x",
        "limit=",
        "limit=%2B2",
        "limit=%202",
        "limit=x&limit=",
        "limit=%C2%9D&limit=2",
        "nextToken=a%20b",
    ] {
        let r = h.req("GET", &format!("/secrets?{bad}"), None).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
    }
}

#[tokio::test]
async fn bad_secrets_are_400_and_never_echo_the_value() {
    let h = common::harness(TeamLimits::default()).await;
    let long = "x".repeat(65 * 1024);
    let many: String = (0..33)
        .map(|i| format!(r#""k{i}":"v""#))
        .collect::<Vec<_>>()
        .join(",");
    for body in [
        r#"{"name":"","value":"v"}"#.to_string(),
        r#"{"name":"a b","value":"v"}"#.to_string(),
        r#"{"name":"sec_x","value":"v"}"#.to_string(),
        r#"{"name":"ok","value":""}"#.to_string(),
        format!(r#"{{"name":"ok","value":"{long}"}}"#),
        format!(r#"{{"name":"ok","value":"v","metadata":{{{many}}}}}"#),
        format!(r#"{{"name":"ok","value":{VALUE:?},"metadata":"nope"}}"#),
        format!(r#"{{"name":"ok","value":{VALUE:?}"#),
    ] {
        let r = h.req("POST", "/secrets", Some(&body)).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{}",
            &body[..body.len().min(80)]
        );
        assert!(r.json["message"].is_string());
        assert!(
            !r.json.to_string().contains(VALUE),
            "the error quotes the value"
        );
    }
    let huge = format!(r#"{{"name":"ok","value":"{}"}}"#, "x".repeat(600 * 1024));
    let r = h.req("POST", "/secrets", Some(&huge)).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn network_rules_send_the_secrets_they_name_to_the_node_only() {
    let h = common::harness(TeamLimits::default()).await;
    let rules = |name: &str| {
        format!(
            r#"{{"templateID":"base","network":{{"allowOut":["api.example.com"],"rules":{{"api.example.com":[{{"transform":{{"headers":{{"Authorization":"Bearer ${{e2b.secrets.{name}}}"}}}}}}]}}}}}}"#
        )
    };
    let r = h
        .req("POST", "/v2/sandboxes", Some(&rules("missing")))
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    assert!(r.json["message"]
        .as_str()
        .unwrap()
        .contains("unknown secret \"missing\""));
    assert_eq!(h.node.running_count(), 0);
    h.req(
        "POST",
        "/secrets",
        Some(r#"{"name":"Known","value":"value-for-the-node"}"#),
    )
    .await;
    // A rule host that allowOut does not name is refused.
    let elsewhere = rules("known").replace(
        r#""allowOut":["api.example.com"]"#,
        r#""allowOut":["other.example.com"]"#,
    );
    let r = h.req("POST", "/v2/sandboxes", Some(&elsewhere)).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{:?}", r.json);
    assert!(r.json["message"].as_str().unwrap().contains("allowOut"));
    let r = h.req("POST", "/v2/sandboxes", Some(&rules("known"))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    assert!(!r.json.to_string().contains("value-for-the-node"));
    let spec = h.node.starts.lock().unwrap().last().cloned().unwrap();
    assert_eq!(spec.egress.rules.len(), 1);
    assert_eq!(spec.egress.rules[0].host, "api.example.com");
    assert_eq!(
        spec.egress.secrets.0.get("known").map(String::as_str),
        Some("value-for-the-node")
    );
    assert!(!format!("{spec:?}").contains("value-for-the-node"));
    // The sandbox's own view never carries it either.
    let id = r.json["sandboxID"].as_str().unwrap().to_string();
    let r = h.req("GET", &format!("/sandboxes/{id}"), None).await;
    assert!(!r.json.to_string().contains("value-for-the-node"));
}
