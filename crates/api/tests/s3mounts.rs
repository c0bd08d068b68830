//! Bucket mounts (`vmonS3Mounts`) through the api against a fake node: every bad field is a
//! 400 that names it and starts nothing, the endpoint is the operator's (none listed: refused),
//! the secret's value reaches the node's start and nothing else (not the record, not a view),
//! pause keeps the disk only and resume mounts again with the secret's current value; and a
//! destroyed volume of an object-store server is deleted on the nodes.

// The shared harness unwraps its own setup.
#![allow(clippy::unwrap_used)]

mod common;

use axum::http::StatusCode;
use vmon_api::records::TeamLimits;

const KEY: &str = "GKtenant0001:tenant-secret-value-never-shown";
const ENDPOINT: &str = "http://127.0.0.1:3900";

async fn secret(h: &common::Harness, name: &str, value: &str) {
    let body = format!(r#"{{"name":"{name}","value":"{value}"}}"#);
    let c = h.req("POST", "/secrets", Some(&body)).await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
}

fn create_body(mounts: &str) -> String {
    format!(r#"{{"templateID":"base","vmonS3Mounts":{mounts}}}"#)
}

#[tokio::test]
async fn bucket_mounts_are_refused_where_the_operator_lists_no_endpoint() {
    let h = common::harness(TeamLimits::default()).await;
    secret(&h, "s3", KEY).await;
    let r = h
        .req(
            "POST",
            "/v2/sandboxes",
            Some(&create_body(
                r#"[{"bucket":"data","mountPath":"/mnt/s3","secret":"s3"}]"#,
            )),
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.json["message"]
        .as_str()
        .unwrap()
        .contains("allows no S3 mounts"));
    assert_eq!(h.node.running_count(), 0);
}

#[tokio::test]
async fn bucket_mounts_are_checked_carry_their_secret_to_the_node_only_and_cold_boot() {
    let h = common::harness_configured(TeamLimits::default(), |c| {
        c.s3_mount_endpoints = vec![ENDPOINT.into(), "https://s3.example.com".into()];
        c.quotas.max_volume_bytes = 5 << 20;
    })
    .await;
    secret(&h, "s3", KEY).await;
    secret(&h, "malformed", "no-colon-here").await;
    for (mounts, needle) in [
        (
            r#"[{"bucket":"Bad_Name","mountPath":"/m","secret":"s3"}]"#,
            "bucket",
        ),
        (
            r#"[{"bucket":"data","prefix":"../x","mountPath":"/m","secret":"s3"}]"#,
            "prefix",
        ),
        (
            r#"[{"bucket":"data","mountPath":"m","secret":"s3"}]"#,
            "must be absolute",
        ),
        (
            r#"[{"bucket":"data","mountPath":"/m","secret":"s3","endpoint":"http://169.254.169.254"}]"#,
            "not one this server allows",
        ),
        (
            r#"[{"bucket":"data","mountPath":"/m","secret":"nope"}]"#,
            "no secret \"nope\"",
        ),
        (
            r#"[{"bucket":"data","mountPath":"/m","secret":"malformed"}]"#,
            "ACCESS_KEY_ID:SECRET_ACCESS_KEY",
        ),
        (
            r#"[{"bucket":"data","mountPath":"/m","secret":"s3"},{"bucket":"data","mountPath":"/m","secret":"s3"}]"#,
            "mounted twice",
        ),
        (
            r#"[{"bucket":"data","mountPath":"/m","secret":"s3","unknown":1}]"#,
            "invalid request body",
        ),
    ] {
        let r = h
            .req("POST", "/v2/sandboxes", Some(&create_body(mounts)))
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{mounts}: {:?}", r.json);
        let msg = r.json["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{mounts}: {msg}");
        assert!(!msg.contains("tenant-secret-value"), "{msg}");
    }
    assert_eq!(h.node.running_count(), 0, "nothing started for a bad mount");

    let sbx = h
        .create(&create_body(
            r#"[{"bucket":"data","prefix":"team/in/","mountPath":"/mnt/in","readOnly":true,"secret":"s3"},
                {"bucket":"out.bucket","mountPath":"/mnt/out","secret":"S3","endpoint":"HTTPS://s3.example.com/","region":"eu-west-1"}]"#,
        ))
        .await;
    let start = h.node.starts.lock().unwrap().last().cloned().unwrap();
    assert!(start.cold_boot, "a sandbox with a mount cold-boots");
    assert_eq!(start.volumes.len(), 2);
    let (a, b) = (&start.volumes[0], &start.volumes[1]);
    assert_eq!(a.volume_id, format!("s3m-{sbx}-0"));
    assert_eq!(a.path, "/mnt/in");
    let ab = a.bucket.as_ref().unwrap();
    assert_eq!(
        (
            ab.endpoint.as_str(),
            ab.bucket.as_str(),
            ab.prefix.as_str(),
            ab.read_only
        ),
        (ENDPOINT, "data", "team/in", true)
    );
    assert_eq!(ab.region, "us-east-1");
    assert_eq!(ab.max_bytes, 5 << 20);
    assert_eq!(ab.credentials.access_key_id, "GKtenant0001");
    assert_eq!(
        ab.credentials.secret_access_key,
        "tenant-secret-value-never-shown"
    );
    let bb = b.bucket.as_ref().unwrap();
    assert_eq!(bb.endpoint, "https://s3.example.com");
    assert_eq!((bb.region.as_str(), bb.read_only), ("eu-west-1", false));
    assert!(
        !format!("{start:?}").contains("tenant-secret-value"),
        "Debug hides it"
    );

    let info = h.req("GET", &format!("/sandboxes/{sbx}"), None).await;
    let shown = &info.json["vmonS3Mounts"];
    assert_eq!(shown[0]["mountPath"], "/mnt/in");
    assert_eq!(shown[0]["secret"], "s3");
    assert_eq!(shown[1]["readOnly"], false);
    assert!(!info.json.to_string().contains("tenant-secret-value"));

    // Pause keeps the disk only; resume mounts again, with the secret's current value.
    let p = h
        .req("POST", &format!("/sandboxes/{sbx}/pause"), Some("{}"))
        .await;
    assert_eq!(p.status, StatusCode::NO_CONTENT, "{:?}", p.json);
    let paused = h.events(&sbx).await;
    assert_eq!(
        paused.last().unwrap().event_data.as_ref().unwrap()["memory"],
        false
    );
    let u = h
        .req(
            "POST",
            "/secrets/s3",
            Some(r#"{"value":"GKrotated:rotated-value"}"#),
        )
        .await;
    assert_eq!(u.status, StatusCode::OK, "{:?}", u.json);
    let c = h
        .req(
            "POST",
            &format!("/sandboxes/{sbx}/connect"),
            Some(r#"{"timeout":60}"#),
        )
        .await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
    let start = h.node.starts.lock().unwrap().last().cloned().unwrap();
    assert!(start.cold_boot);
    let ab = start.volumes[0].bucket.as_ref().unwrap();
    assert_eq!(ab.credentials.access_key_id, "GKrotated");

    // A deleted secret: the resume is a 400 and the sandbox stays paused.
    let p = h
        .req("POST", &format!("/sandboxes/{sbx}/pause"), Some("{}"))
        .await;
    assert_eq!(p.status, StatusCode::NO_CONTENT, "{:?}", p.json);
    let d = h.req("DELETE", "/secrets/s3", None).await;
    assert!(d.status.is_success(), "{:?}", d.json);
    let c = h
        .req(
            "POST",
            &format!("/sandboxes/{sbx}/connect"),
            Some(r#"{"timeout":60}"#),
        )
        .await;
    assert_eq!(c.status, StatusCode::BAD_REQUEST, "{:?}", c.json);
    let info = h.req("GET", &format!("/sandboxes/{sbx}"), None).await;
    assert_eq!(info.json["state"], "paused");
}

#[tokio::test]
async fn a_destroyed_object_store_volume_is_deleted_on_the_nodes_and_its_content_is_501() {
    let h = common::harness_configured(TeamLimits::default(), |c| {
        c.volume_store = "s3".parse().unwrap();
    })
    .await;
    let c = h
        .req("POST", "/volumes", Some(r#"{"name":"stored"}"#))
        .await;
    assert_eq!(c.status, StatusCode::CREATED, "{:?}", c.json);
    let id = c.json["volumeID"].as_str().unwrap().to_string();
    let token = c.json["token"].as_str().unwrap().to_string();
    let bearer = format!("Bearer {token}");
    let r = h
        .call(
            "GET",
            &format!("/volumecontent/{id}/dir?path=/"),
            None,
            None,
            &[("authorization", bearer.as_str())],
        )
        .await;
    assert_eq!(r.status, StatusCode::NOT_IMPLEMENTED, "{:?}", r.json);
    assert!(r.json["message"]
        .as_str()
        .unwrap()
        .contains("one archive of its whole tree"));
    let d = h.req("DELETE", &format!("/volumes/{id}"), None).await;
    assert_eq!(d.status, StatusCode::NO_CONTENT, "{:?}", d.json);
    assert_eq!(*h.node.deleted_volumes.lock().unwrap(), vec![id]);
}
