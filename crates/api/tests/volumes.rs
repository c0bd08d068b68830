//! Volumes over REST: the control plane (`/volumes`), the content plane (`/volumecontent`)
//! with its per-volume tokens, and `volumeMounts` on create, against the real store and the
//! real volume directory (the node is the fake one: mounts in real guests are
//! `tests/e2e/test_volumes.py`'s).

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;
use vmon_api::records::TeamLimits;

struct Raw {
    status: StatusCode,
    body: Vec<u8>,
}

impl Raw {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// A content-plane request: bearer `token`, raw `body`.
async fn content(
    h: &common::Harness,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: &[u8],
) -> Raw {
    let mut b = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let resp = h
        .router
        .clone()
        .oneshot(b.body(Body::from(body.to_vec())).expect("request"))
        .await
        .expect("response");
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
        .to_vec();
    Raw { status, body }
}

async fn new_volume(h: &common::Harness, key: &str, name: &str) -> (String, String) {
    let r = h
        .call(
            "POST",
            "/volumes",
            Some(key),
            Some(&format!(r#"{{"name":"{name}"}}"#)),
            &[],
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json);
    (
        r.json["volumeID"].as_str().expect("id").to_string(),
        r.json["token"].as_str().expect("token").to_string(),
    )
}

#[tokio::test]
async fn the_control_plane_is_team_scoped_with_unique_names() {
    let h = common::harness(TeamLimits::default()).await;
    let (id, token) = new_volume(&h, &h.key, "data").await;
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
    assert!(!token.is_empty());

    let dup = h.req("POST", "/volumes", Some(r#"{"name":"data"}"#)).await;
    assert_eq!(dup.status, StatusCode::BAD_REQUEST);
    assert_eq!(dup.json["code"], 400);
    assert_eq!(
        dup.json["message"],
        "Volume with name 'data' already exists"
    );
    for bad in [
        r#"{"name":""}"#,
        r#"{"name":"a b"}"#,
        r#"{"name":"x/y"}"#,
        r#"{}"#,
        "[1]",
    ] {
        let r = h.req("POST", "/volumes", Some(bad)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
        assert!(r.json["message"].is_string(), "{bad}: {:?}", r.json);
    }
    // Names are per team: the other team may use the same one.
    let (other_id, _) = new_volume(&h, &h.other_key.clone(), "data").await;
    assert_ne!(other_id, id);

    let list = h.req("GET", "/volumes", None).await;
    assert_eq!(list.status, StatusCode::OK);
    assert_eq!(
        list.json,
        serde_json::json!([{"volumeID": id, "name": "data"}])
    );

    let got = h.req("GET", &format!("/volumes/{id}"), None).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.json["volumeID"], id.as_str());
    assert!(got.json["token"].as_str().is_some_and(|t| !t.is_empty()));

    // Another team's key: 404 on every route, nothing destroyed.
    let other = h.other_key.clone();
    for (method, path) in [
        ("GET", format!("/volumes/{id}")),
        ("DELETE", format!("/volumes/{id}")),
    ] {
        let r = h.call(method, &path, Some(&other), None, &[]).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{method} {path}");
        assert_eq!(r.json["code"], 404);
    }
    let r = h.call("GET", "/volumes", Some(&other), None, &[]).await;
    assert_eq!(r.json.as_array().map(Vec::len), Some(1));
    assert_eq!(r.json[0]["volumeID"], other_id.as_str());

    assert_eq!(
        h.req("GET", "/volumes/not-a-uuid", None).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        h.call("GET", "/volumes", None, None, &[]).await.status,
        StatusCode::UNAUTHORIZED
    );

    let del = h.req("DELETE", &format!("/volumes/{id}"), None).await;
    assert_eq!(del.status, StatusCode::NO_CONTENT);
    assert_eq!(
        h.req("GET", &format!("/volumes/{id}"), None).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        h.req("DELETE", &format!("/volumes/{id}"), None)
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    let r = content(
        &h,
        "GET",
        &format!("/volumecontent/{id}/path?path=%2F"),
        Some(&token),
        b"",
    )
    .await;
    assert_eq!(
        r.status,
        StatusCode::NOT_FOUND,
        "content of a destroyed volume"
    );
}

#[tokio::test]
async fn the_content_plane_reads_writes_and_answers_errors_as_the_sdk_parses_them() {
    let h = common::harness(TeamLimits::default()).await;
    let (id, t) = new_volume(&h, &h.key, "files").await;
    let base = format!("/volumecontent/{id}");
    let t = Some(t.as_str());

    let w = content(
        &h,
        "PUT",
        &format!("{base}/file?path=%2Fa%2Fb.txt&force=true"),
        t,
        b"hello",
    )
    .await;
    assert_eq!(w.status, StatusCode::CREATED, "{:?}", w.json());
    let stat = w.json();
    for key in [
        "name", "type", "path", "size", "mode", "uid", "gid", "atime", "mtime", "ctime",
    ] {
        assert!(!stat[key].is_null(), "{key} missing from {stat}");
    }
    assert_eq!(stat["name"], "b.txt");
    assert_eq!(stat["type"], "file");
    assert_eq!(stat["path"], "/a/b.txt");
    assert_eq!(stat["size"], 5);
    assert_eq!(stat["mode"], 0o666);
    assert_eq!(stat["uid"], 9090);

    let r = content(&h, "GET", &format!("{base}/file?path=a/b.txt"), t, b"").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body, b"hello");

    // Without force the file must not exist (O_EXCL) and the parent must.
    let again = content(&h, "PUT", &format!("{base}/file?path=a/b.txt"), t, b"x").await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert!(again.json()["code"].is_string(), "{:?}", again.json());
    let orphan = content(
        &h,
        "PUT",
        &format!("{base}/file?path=no/such/dir.txt"),
        t,
        b"x",
    )
    .await;
    assert_eq!(orphan.status, StatusCode::NOT_FOUND);

    let mk = content(
        &h,
        "POST",
        &format!("{base}/dir?path=x%2Fy%2Fz&force=true&mode=448"),
        t,
        b"",
    )
    .await;
    assert_eq!(mk.status, StatusCode::CREATED, "{:?}", mk.json());
    assert_eq!(mk.json()["type"], "directory");
    assert_eq!(mk.json()["mode"], 0o700);
    assert_eq!(
        content(&h, "POST", &format!("{base}/dir?path=x"), t, b"")
            .await
            .status,
        StatusCode::CONFLICT
    );
    assert_eq!(
        content(&h, "POST", &format!("{base}/dir?path=q%2Fr"), t, b"")
            .await
            .status,
        StatusCode::NOT_FOUND
    );

    let list = content(&h, "GET", &format!("{base}/dir?path=%2F&depth=3"), t, b"").await;
    assert_eq!(list.status, StatusCode::OK);
    let paths: Vec<String> = list
        .json()
        .as_array()
        .expect("array")
        .iter()
        .map(|e| e["path"].as_str().expect("path").to_string())
        .collect();
    assert_eq!(paths, ["/a", "/a/b.txt", "/x", "/x/y", "/x/y/z"]);
    let shallow = content(&h, "GET", &format!("{base}/dir?path=%2F"), t, b"").await;
    assert_eq!(shallow.json().as_array().map(Vec::len), Some(2));
    for bad in ["depth=0", "depth=11", "depth=x", "depth="] {
        let r = content(&h, "GET", &format!("{base}/dir?path=%2F&{bad}"), t, b"").await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
    }
    // A parameter given empty is not the parameter left out: refused, nothing made.
    for bad in ["mode=", "uid=", "force="] {
        let r = content(
            &h,
            "POST",
            &format!("{base}/dir?path=%2Fempty&{bad}"),
            t,
            b"",
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}");
    }
    let none = content(&h, "GET", &format!("{base}/dir?path=%2F"), t, b"").await;
    assert_eq!(none.json().as_array().map(Vec::len), Some(2), "no /empty");

    let patched = content(
        &h,
        "PATCH",
        &format!("{base}/path?path=a/b.txt"),
        t,
        br#"{"mode":384,"uid":1000,"gid":1000}"#,
    )
    .await;
    assert_eq!(patched.status, StatusCode::OK, "{:?}", patched.json());
    assert_eq!(patched.json()["mode"], 0o600);
    assert_eq!(patched.json()["uid"], 1000);
    let bad_patch = content(
        &h,
        "PATCH",
        &format!("{base}/path?path=a/b.txt"),
        t,
        br#"{"mode":"x"}"#,
    )
    .await;
    assert_eq!(bad_patch.status, StatusCode::BAD_REQUEST);

    let missing = content(&h, "GET", &format!("{base}/path?path=nope"), t, b"").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(missing.json()["code"].is_string() && missing.json()["message"].is_string());
    assert_eq!(
        content(&h, "GET", &format!("{base}/path"), t, b"")
            .await
            .status,
        StatusCode::BAD_REQUEST,
        "path is required"
    );

    assert_eq!(
        content(&h, "DELETE", &format!("{base}/path?path=x"), t, b"")
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        content(&h, "GET", &format!("{base}/path?path=x/y"), t, b"")
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        content(&h, "DELETE", &format!("{base}/path?path=%2F"), t, b"")
            .await
            .status,
        StatusCode::BAD_REQUEST,
        "the root cannot be removed"
    );
    let gone = content(&h, "DELETE", &format!("{base}/path?path=x"), t, b"").await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    assert!(gone.json()["message"].is_string());

    // `..` stays inside the volume.
    let climbed = content(
        &h,
        "GET",
        &format!("{base}/file?path=..%2F..%2Fvolume-key"),
        t,
        b"",
    )
    .await;
    assert_eq!(climbed.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_token_opens_its_own_volume_only_and_expires() {
    let h = common::harness(TeamLimits::default()).await;
    let (x, tx) = new_volume(&h, &h.key, "x").await;
    let (y, ty) = new_volume(&h, &h.key, "y").await;
    let (z, tz) = new_volume(&h, &h.other_key.clone(), "z").await;
    let stat = |id: &str| format!("/volumecontent/{id}/path?path=%2F");

    assert_eq!(
        content(&h, "GET", &stat(&x), Some(&tx), b"").await.status,
        StatusCode::OK
    );
    let refused = content(&h, "GET", &stat(&y), Some(&tx), b"").await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "X's token on Y");
    assert!(refused.json()["code"].is_string());
    assert_eq!(
        content(&h, "GET", &stat(&x), Some(&ty), b"").await.status,
        StatusCode::UNAUTHORIZED
    );
    // Another team's token: the volume does not exist for it, on every content route.
    for (method, route) in [
        ("GET", "dir"),
        ("POST", "dir"),
        ("GET", "path"),
        ("PATCH", "path"),
        ("DELETE", "path"),
        ("GET", "file"),
        ("PUT", "file"),
    ] {
        let uri = format!("/volumecontent/{x}/{route}?path=a");
        let r = content(&h, method, &uri, Some(&tz), b"{}").await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{method} {route}");
        assert!(r.json()["code"].is_string());
        let r = content(&h, method, &uri, None, b"{}").await;
        assert_eq!(
            r.status,
            StatusCode::UNAUTHORIZED,
            "{method} {route} without a token"
        );
    }
    assert_eq!(
        content(&h, "GET", &stat(&z), Some(&tz), b"").await.status,
        StatusCode::OK
    );
    // An API key is not a volume token.
    let key = h.key.clone();
    assert_eq!(
        content(&h, "GET", &stat(&x), Some(&key), b"").await.status,
        StatusCode::UNAUTHORIZED
    );
    // A tampered token.
    let mut bent = tx.clone();
    bent.replace_range(bent.len() - 1.., if tx.ends_with('0') { "1" } else { "0" });
    assert_eq!(
        content(&h, "GET", &stat(&x), Some(&bent), b"").await.status,
        StatusCode::UNAUTHORIZED
    );

    // Expired: the same signature scheme, an expiry in the past.
    let vol = h
        .records
        .store()
        .volume_by_id(&x)
        .await
        .expect("store")
        .expect("volume");
    let volumes = h.control.volumes().expect("volumes configured");
    let past = time::OffsetDateTime::now_utc().unix_timestamp() - 1;
    let expired = volumes.token_until(&vol, past);
    let r = content(&h, "GET", &stat(&x), Some(&expired), b"").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(r.json()["message"]
        .as_str()
        .is_some_and(|m| m.contains("expired")));
    let live = volumes.token_until(&vol, past + 3600);
    assert_eq!(
        content(&h, "GET", &stat(&x), Some(&live), b"").await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn volume_quotas_are_enforced() {
    let quotas = vmon_api::config::Quotas {
        max_volumes: 1,
        max_volume_bytes: 10,
        ..Default::default()
    };
    let h = common::harness_with(
        "127.0.0.1".parse().expect("ip"),
        TeamLimits::default(),
        quotas,
    )
    .await;
    let (id, t) = new_volume(&h, &h.key, "one").await;
    let r = h.req("POST", "/volumes", Some(r#"{"name":"two"}"#)).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r.json["message"]
        .as_str()
        .is_some_and(|m| m.contains("max_volumes")));
    let ok = content(
        &h,
        "PUT",
        &format!("/volumecontent/{id}/file?path=a"),
        Some(&t),
        b"0123456789",
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    let over = content(
        &h,
        "PUT",
        &format!("/volumecontent/{id}/file?path=b"),
        Some(&t),
        b"x",
    )
    .await;
    assert_eq!(over.status, StatusCode::INSUFFICIENT_STORAGE);
    assert_eq!(
        content(
            &h,
            "GET",
            &format!("/volumecontent/{id}/path?path=b"),
            Some(&t),
            b""
        )
        .await
        .status,
        StatusCode::NOT_FOUND,
        "a refused write leaves nothing"
    );
}

#[tokio::test]
async fn volume_mounts_are_validated_resolved_and_cold_boot() {
    let h = common::harness(TeamLimits::default()).await;
    let (id, _) = new_volume(&h, &h.key, "data").await;
    let (_, _) = new_volume(&h, &h.other_key.clone(), "theirs").await;
    for (mounts, needle) in [
        (
            r#"[{"name":"nope","path":"/mnt/x"}]"#,
            "volume 'nope' not found",
        ),
        (
            r#"[{"name":"theirs","path":"/mnt/x"}]"#,
            "volume 'theirs' not found",
        ),
        (r#"[{"name":"data","path":"mnt"}]"#, "must be absolute"),
        (r#"[{"name":"data","path":"/mnt/../x"}]"#, "must be clean"),
        (r#"[{"name":"data","path":"/"}]"#, "cannot be /"),
        (
            r#"[{"name":"data","path":"/a"},{"name":"data","path":"/a"}]"#,
            "mounted twice",
        ),
        (r#"[{"name":"data"}]"#, "invalid request body"),
    ] {
        let body = format!(r#"{{"templateID":"base","volumeMounts":{mounts}}}"#);
        let r = h.req("POST", "/v2/sandboxes", Some(&body)).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{mounts}");
        let msg = r.json["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{mounts}: {msg}");
    }
    assert_eq!(h.node.running_count(), 0, "nothing started for a bad mount");

    let sbx = h
        .create(r#"{"templateID":"base","volumeMounts":[{"name":"data","path":"/mnt/data"}]}"#)
        .await;
    let start = h
        .node
        .starts
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("a start");
    assert!(start.cold_boot, "a sandbox with a mount cold-boots");
    assert_eq!(
        start.volumes,
        vec![vmon_proto::node::VolumeShare {
            volume_id: id.clone(),
            path: "/mnt/data".into(),
            ..Default::default()
        }]
    );
    let info = h.req("GET", &format!("/sandboxes/{sbx}"), None).await;
    assert_eq!(
        info.json["volumeMounts"],
        serde_json::json!([{"name": "data", "path": "/mnt/data"}])
    );
    let listed = h.req("GET", "/v2/sandboxes", None).await;
    assert_eq!(
        listed.json[0]["volumeMounts"],
        serde_json::json!([{"name": "data", "path": "/mnt/data"}])
    );

    // Pause keeps the disk only; resume cold-boots and mounts again.
    let p = h
        .req("POST", &format!("/sandboxes/{sbx}/pause"), Some("{}"))
        .await;
    assert_eq!(p.status, StatusCode::NO_CONTENT, "{:?}", p.json);
    let paused = h.events(&sbx).await;
    let last = paused.last().expect("event");
    assert_eq!(last.event_data.as_ref().expect("data")["memory"], false);
    let c = h
        .req(
            "POST",
            &format!("/sandboxes/{sbx}/connect"),
            Some(r#"{"timeout":60}"#),
        )
        .await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
    let start = h
        .node
        .starts
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("a start");
    assert!(start.cold_boot);
    assert_eq!(start.volumes.len(), 1);
}
