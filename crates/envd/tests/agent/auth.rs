//! Access token, `/files` signatures, `/init`.

use base64::Engine;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use sha2::Digest;

use crate::harness::*;

fn sign(path: &str, op: &str, user: &str, token: &str, exp: Option<i64>) -> String {
    let mut raw = format!("{path}:{op}:{user}:{token}");
    if let Some(e) = exp {
        raw += &format!(":{e}");
    }
    let d = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(d)
    )
}

fn q(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

async fn status_of(envd: &Envd, req: Request<ReqBody>) -> (StatusCode, Value) {
    let r = envd.request(req).await.unwrap();
    let st = r.status();
    let b = r.into_body().collect().await.unwrap().to_bytes();
    (st, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

#[tokio::test]
async fn token_required_except_health_and_files() {
    let mut envd = Envd::start_with(&["--access-token", "s3cret"]).await;
    let (st, _) = envd.unary("/process.Process/List", json!({}), &[]).await;
    assert_eq!(st, StatusCode::OK, "the harness sends the token");
    envd.token = None;
    let (st, v) = envd.unary("/process.Process/List", json!({}), &[]).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_eq!(v["code"], "unauthenticated");
    let (st, _) = envd
        .unary(
            "/process.Process/List",
            json!({}),
            &[("x-access-token", "wrong")],
        )
        .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _) = status_of(&envd, Request::get("/health").body(full("")).unwrap()).await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let (st, v) = status_of(&envd, Request::get("/envs").body(full("")).unwrap()).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_eq!(v["code"], 401);
    assert!(v["message"].is_string());
    let (st, _) = status_of(&envd, Request::get("/metrics").body(full("")).unwrap()).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _) = status_of(
        &envd,
        Request::get("/envs")
            .header("x-access-token", "s3cret")
            .body(full(""))
            .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::OK);

    // /files: header, or a signature bound to path, operation, user and expiry.
    let path = format!("/tmp/envd-test-sig-{}", std::process::id());
    std::fs::write(&path, b"signed").unwrap();
    let _ = std::process::Command::new("chown")
        .args([TEST_USER, &path])
        .status();
    let (st, _) = status_of(
        &envd,
        Request::get(format!("/files?path={}", q(&path)))
            .body(full(""))
            .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "no token, no signature");
    let (st, _) = status_of(
        &envd,
        Request::get(format!("/files?path={}", q(&path)))
            .header("x-access-token", "s3cret")
            .body(full(""))
            .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let good = sign(&path, "read", "", "s3cret", None);
    let r = envd
        .request(
            Request::get(format!("/files?path={}&signature={}", q(&path), q(&good)))
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.into_body().collect().await.unwrap().to_bytes().as_ref(),
        b"signed"
    );
    let exp = now() + 60;
    let good_exp = sign(&path, "read", TEST_USER, "s3cret", Some(exp));
    let (st, _) = status_of(
        &envd,
        Request::get(format!(
            "/files?path={}&username={TEST_USER}&signature={}&signature_expiration={exp}",
            q(&path),
            q(&good_exp)
        ))
        .body(full(""))
        .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "valid with expiration");
    let past = now() - 10;
    let expired = sign(&path, "read", "", "s3cret", Some(past));
    let (st, v) = status_of(
        &envd,
        Request::get(format!(
            "/files?path={}&signature={}&signature_expiration={past}",
            q(&path),
            q(&expired)
        ))
        .body(full(""))
        .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "expired");
    assert!(v["message"].as_str().unwrap().contains("expired"));
    let forged = sign(&path, "read", "", "guess", None);
    let (st, _) = status_of(
        &envd,
        Request::get(format!("/files?path={}&signature={}", q(&path), q(&forged)))
            .body(full(""))
            .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "forged");
    let (st, _) = status_of(
        &envd,
        Request::get(format!(
            "/files?path={}&signature={}&signature_expiration={}",
            q(&path),
            q(&good_exp),
            exp + 1
        ))
        .body(full(""))
        .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED, "expiration is signed");
    let (st, _) = status_of(
        &envd,
        Request::get(format!(
            "/files?path={}&signature={}",
            q("/etc/passwd"),
            q(&good)
        ))
        .body(full(""))
        .unwrap(),
    )
    .await;
    assert_eq!(
        st,
        StatusCode::UNAUTHORIZED,
        "signature is bound to the path"
    );
    // A read signature does not allow writing; a write signature does.
    let up = |sig: &str| {
        Request::post(format!("/files?path={}&signature={}", q(&path), q(sig)))
            .header("content-type", "application/octet-stream")
            .body(full("rewritten"))
            .unwrap()
    };
    let (st, _) = status_of(&envd, up(&good)).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _) = status_of(&envd, up(&sign(&path, "write", "", "s3cret", None))).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "rewritten");
    std::fs::remove_file(&path).unwrap();

    // /init cannot take over the token without knowing it.
    let init = |body: Value, hdr: Option<&str>| {
        let mut b = Request::post("/init").header("content-type", "application/json");
        if let Some(h) = hdr {
            b = b.header("x-access-token", h);
        }
        b.body(full(body.to_string())).unwrap()
    };
    let (st, _) = status_of(&envd, init(json!({"accessToken": "mine"}), None)).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _) = status_of(&envd, init(json!({"accessToken": "s3cret"}), None)).await;
    assert_eq!(st, StatusCode::NO_CONTENT, "same token again is idempotent");
    let (st, _) = status_of(
        &envd,
        init(json!({"accessToken": "rotated"}), Some("s3cret")),
    )
    .await;
    assert_eq!(st, StatusCode::NO_CONTENT, "the holder may rotate it");
    let (st, _) = envd
        .unary(
            "/process.Process/List",
            json!({}),
            &[("x-access-token", "s3cret")],
        )
        .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _) = envd
        .unary(
            "/process.Process/List",
            json!({}),
            &[("x-access-token", "rotated")],
        )
        .await;
    assert_eq!(st, StatusCode::OK);
}

#[tokio::test]
async fn init_configures_env_user_workdir_and_is_idempotent() {
    let envd = Envd::start_with(&["--default-user", "root"]).await;
    let ts = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let body = json!({
        "envVars": {"FROM_INIT": "yes"},
        "accessToken": "tok1",
        "timestamp": ts,
        "defaultUser": TEST_USER,
        "defaultWorkdir": "/tmp",
        "entropy": base64::engine::general_purpose::STANDARD.encode([7u8; 64]),
    });
    for _ in 0..3 {
        let req = Request::post("/init")
            .header("content-type", "application/json")
            .body(full(body.to_string()))
            .unwrap();
        let (st, _) = status_of(&envd, req).await;
        assert_eq!(st, StatusCode::NO_CONTENT);
    }
    let tok = [("x-access-token", "tok1")];
    let (mut s, _) = start(&envd, "id -un; pwd; echo $FROM_INIT", json!({}), &tok).await;
    let (out, _, _, _) = s.collect_process().await;
    assert_eq!(
        String::from_utf8(out).unwrap(),
        format!("{TEST_USER}\n/tmp\nyes\n")
    );
    let (st, v) = status_of(
        &envd,
        Request::get("/envs")
            .header("x-access-token", "tok1")
            .body(full(""))
            .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["FROM_INIT"], "yes");
    let (st, _) = status_of(&envd, Request::post("/init").body(full("{bad")).unwrap()).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let (st, _) = status_of(
        &envd,
        Request::post("/init")
            .header("x-access-token", "tok1")
            .body(full(
                json!({"accessToken": "tok1", "timestamp": "yesterday"}).to_string(),
            ))
            .unwrap(),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
}
