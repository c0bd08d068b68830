//! `GET`/`POST /files`.

use std::io::Write;

use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};

use crate::filesystem::user_dir;
use crate::harness::*;

async fn body_of(r: http::Response<hyper::body::Incoming>) -> bytes::Bytes {
    r.into_body().collect().await.unwrap().to_bytes()
}

fn gzip(data: &[u8]) -> Vec<u8> {
    // A stored (uncompressed) deflate stream inside a gzip member: valid gzip without a library.
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff];
    for (i, chunk) in data.chunks(65535).enumerate() {
        let last = (i + 1) * 65535 >= data.len();
        out.push(if last { 1 } else { 0 });
        out.extend_from_slice(&(chunk.len() as u16).to_le_bytes());
        out.extend_from_slice(&(!(chunk.len() as u16)).to_le_bytes());
        out.extend_from_slice(chunk);
    }
    if data.is_empty() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[tokio::test]
async fn multipart_octet_gzip_metadata() {
    let envd = Envd::start().await;
    let dir = user_dir("files");
    // Multipart with two files: each part's filename is its destination.
    let boundary = "XBOUNDARYX";
    let mut body = Vec::new();
    for (name, data) in [
        (format!("{dir}/one.txt"), "first"),
        (format!("{dir}/nested/two.txt"), "second"),
    ] {
        write!(body, "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/octet-stream\r\n\r\n{data}\r\n").unwrap();
    }
    write!(body, "--{boundary}--\r\n").unwrap();
    let req = Request::post("/files")
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .header("x-metadata-Owner-Team", "infra")
        .body(full(body))
        .unwrap();
    let r = envd.request(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&body_of(r).await).unwrap();
    assert_eq!(
        v[0],
        json!({"name": "one.txt", "type": "file", "path": format!("{dir}/one.txt"), "metadata": {"owner-team": "infra"}})
    );
    assert_eq!(v[1]["path"], format!("{dir}/nested/two.txt"));
    assert_eq!(
        std::fs::read_to_string(format!("{dir}/nested/two.txt")).unwrap(),
        "second"
    );
    // Written as the user: owned by them, parents too.
    let (_, st) = envd
        .unary(
            "/filesystem.Filesystem/Stat",
            json!({"path": format!("{dir}/nested/two.txt")}),
            &[],
        )
        .await;
    assert_eq!(st["entry"]["owner"], TEST_USER);
    assert_eq!(st["entry"]["metadata"], json!({"owner-team": "infra"}));
    let (_, st) = envd
        .unary(
            "/filesystem.Filesystem/Stat",
            json!({"path": format!("{dir}/nested")}),
            &[],
        )
        .await;
    assert_eq!(st["entry"]["owner"], TEST_USER);

    // Octet-stream with gzip content encoding, relative path into the home directory.
    let payload = b"compressed payload ".repeat(1000);
    let req = Request::post("/files?path=envd-test-gz.bin")
        .header("content-type", "application/octet-stream")
        .header("content-encoding", "gzip")
        .body(full(gzip(&payload)))
        .unwrap();
    let r = envd.request(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let v: Value = serde_json::from_slice(&body_of(r).await).unwrap();
    let home_file = format!("/home/{TEST_USER}/envd-test-gz.bin");
    assert_eq!(v[0]["path"], home_file);
    assert_eq!(std::fs::read(&home_file).unwrap(), payload);

    // Download plain and gzip.
    let r = envd
        .request(
            Request::get("/files?path=envd-test-gz.bin")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["content-length"],
        payload.len().to_string().as_str()
    );
    assert_eq!(body_of(r).await.as_ref(), payload.as_slice());
    let r = envd
        .request(
            Request::get("/files?path=envd-test-gz.bin")
                .header("accept-encoding", "gzip")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.headers()["content-encoding"], "gzip");
    let gz = body_of(r).await;
    assert!(gz.len() < payload.len() / 10, "really compressed");
    let mut child = std::process::Command::new("gzip")
        .arg("-dc")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&gz).unwrap();
    assert_eq!(child.wait_with_output().unwrap().stdout, payload);
    std::fs::remove_file(&home_file).unwrap();

    // Errors: missing file, directory, no path.
    let r = envd
        .request(
            Request::get(format!("/files?path={dir}/nope"))
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_slice(&body_of(r).await).unwrap();
    assert_eq!(v["code"], 404);
    assert!(v["message"].is_string());
    let r = envd
        .request(
            Request::get(format!("/files?path={dir}"))
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = envd
        .request(
            Request::post("/files")
                .header("content-type", "application/octet-stream")
                .body(full("x"))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn disk_full_is_507() {
    let mnt = format!("/tmp/envd-test-full-{}", std::process::id());
    std::fs::create_dir_all(&mnt).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k,mode=1777", "tmpfs", &mnt])
        .status();
    if !matches!(st, Ok(s) if s.success()) {
        eprintln!("SKIP disk_full_is_507: cannot mount a tmpfs here");
        return;
    }
    let envd = Envd::start().await;
    let req = Request::post(format!("/files?path={mnt}/big"))
        .header("content-type", "application/octet-stream")
        .body(full(vec![7u8; 1 << 20]))
        .unwrap();
    let r = envd.request(req).await.unwrap();
    let status = r.status();
    let body = body_of(r).await;
    let _ = std::process::Command::new("umount").arg(&mnt).status();
    let _ = std::fs::remove_dir(&mnt);
    assert_eq!(
        status,
        StatusCode::INSUFFICIENT_STORAGE,
        "{}",
        String::from_utf8_lossy(&body)
    );
}
