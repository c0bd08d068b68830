//! filesystem.Filesystem over the wire, as the test user.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use serde_json::{json, Value};

use crate::harness::*;

/// A fresh directory owned by the test user.
pub fn user_dir(name: &str) -> String {
    ensure_test_user();
    let dir = format!("/tmp/envd-test-{name}-{}", std::process::id());
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let st = std::process::Command::new("chown")
        .args([&format!("{TEST_USER}:{TEST_USER}"), &dir])
        .status()
        .unwrap();
    assert!(st.success());
    dir
}

const FS: &str = "/filesystem.Filesystem/";

async fn fs(envd: &Envd, m: &str, msg: Value) -> (http::StatusCode, Value) {
    envd.unary(&format!("{FS}{m}"), msg, &[]).await
}

#[tokio::test]
async fn make_stat_list_move_remove() {
    let envd = Envd::start().await;
    let dir = user_dir("fsops");
    let (st, v) = fs(&envd, "MakeDir", json!({"path": format!("{dir}/a/b")})).await;
    assert_eq!(st, http::StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(v["entry"]["owner"], TEST_USER);
    let (st, v) = fs(&envd, "MakeDir", json!({"path": format!("{dir}/a/b")})).await;
    assert_eq!(st, http::StatusCode::CONFLICT);
    assert_eq!(v["code"], "already_exists");

    std::fs::write(format!("{dir}/a/f.txt"), b"12345").unwrap();
    std::os::unix::fs::symlink(format!("{dir}/a/f.txt"), format!("{dir}/a/link")).unwrap();
    let (_, v) = fs(&envd, "Stat", json!({"path": format!("{dir}/a/f.txt")})).await;
    let e = &v["entry"];
    assert_eq!(e["name"], "f.txt");
    assert_eq!(e["type"], "FILE_TYPE_FILE");
    assert_eq!(e["size"], "5", "int64 is a JSON string");
    assert_eq!(e["permissions"], "-rw-r--r--");
    assert_eq!(e["mode"], 0o644);
    assert_eq!(e["owner"], "root");
    assert!(e["modifiedTime"].as_str().unwrap().ends_with('Z'));
    let (_, v) = fs(&envd, "Stat", json!({"path": format!("{dir}/a/link")})).await;
    assert_eq!(v["entry"]["isSymlink"], true);
    assert_eq!(v["entry"]["type"], "FILE_TYPE_FILE");
    assert_eq!(v["entry"]["symlinkTarget"], format!("{dir}/a/f.txt"));

    let (_, v) = fs(&envd, "ListDir", json!({"path": dir, "depth": 1})).await;
    let names: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a"]);
    let (_, v) = fs(&envd, "ListDir", json!({"path": dir, "depth": "2"})).await;
    let paths: Vec<&str> = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            format!("{dir}/a"),
            format!("{dir}/a/b"),
            format!("{dir}/a/f.txt"),
            format!("{dir}/a/link")
        ]
    );

    let (st, v) = fs(
        &envd,
        "Move",
        json!({"source": format!("{dir}/a/b"), "destination": format!("{dir}/c/d")}),
    )
    .await;
    assert_eq!(st, http::StatusCode::OK, "{v}");
    assert_eq!(v["entry"]["path"], format!("{dir}/c/d"));
    let (st, v) = fs(&envd, "Stat", json!({"path": format!("{dir}/a/b")})).await;
    assert_eq!(st, http::StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "not_found");
    let (st, _) = fs(&envd, "Remove", json!({"path": format!("{dir}/c")})).await;
    assert_eq!(st, http::StatusCode::OK);
    assert!(!std::path::Path::new(&format!("{dir}/c")).exists());
    let (st, _) = fs(&envd, "ListDir", json!({"path": format!("{dir}/a/f.txt")})).await;
    assert_eq!(st, http::StatusCode::BAD_REQUEST);

    // Relative paths resolve in the user's home.
    let (_, v) = fs(&envd, "Stat", json!({"path": "."})).await;
    assert_eq!(v["entry"]["path"], format!("/home/{TEST_USER}"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn user_cannot_reach_what_root_only_allows() {
    let envd = Envd::start().await;
    let secret_dir = format!("/tmp/envd-test-secret-{}", std::process::id());
    std::fs::create_dir_all(&secret_dir).unwrap();
    std::fs::set_permissions(&secret_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(format!("{secret_dir}/s.txt"), b"secret").unwrap();
    std::fs::write("/tmp/envd-test-rootonly", b"secret").unwrap();
    std::fs::set_permissions(
        "/tmp/envd-test-rootonly",
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();

    let (st, v) = fs(
        &envd,
        "Stat",
        json!({"path": format!("{secret_dir}/s.txt")}),
    )
    .await;
    assert_eq!(st, http::StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["code"], "permission_denied");
    let (st, _) = fs(&envd, "ListDir", json!({"path": secret_dir})).await;
    assert_eq!(st, http::StatusCode::FORBIDDEN);
    let (st, _) = fs(
        &envd,
        "MakeDir",
        json!({"path": "/root/envd-should-not-exist"}),
    )
    .await;
    assert_eq!(st, http::StatusCode::FORBIDDEN);
    let (st, _) = fs(&envd, "Remove", json!({"path": "/tmp/envd-test-rootonly"})).await;
    assert_eq!(
        st,
        http::StatusCode::FORBIDDEN,
        "sticky /tmp: only the owner may remove"
    );
    assert!(std::path::Path::new("/tmp/envd-test-rootonly").exists());

    // Downloads too.
    let r = envd
        .request(
            http::Request::get("/files?path=/tmp/envd-test-rootonly")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), http::StatusCode::FORBIDDEN);
    // And processes.
    let (mut s, _) = start(&envd, "cat /tmp/envd-test-rootonly", json!({}), &[]).await;
    let (out, err, _, end) = s.collect_process().await;
    assert!(out.is_empty());
    assert!(String::from_utf8_lossy(&err).contains("Permission denied"));
    assert_eq!(end["exitCode"], 1);
    // Root may.
    let (st, _) = envd
        .unary(
            &format!("{FS}Stat"),
            json!({"path": format!("{secret_dir}/s.txt")}),
            &[("authorization", &basic("root"))],
        )
        .await;
    assert_eq!(st, http::StatusCode::OK);
    let r = envd
        .request(
            http::Request::get("/files?path=/tmp/envd-test-rootonly&username=root")
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), http::StatusCode::OK);
    std::fs::remove_dir_all(&secret_dir).unwrap();
    std::fs::remove_file("/tmp/envd-test-rootonly").unwrap();
}

fn events_of(v: &[Value]) -> Vec<(String, String)> {
    v.iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_string(),
                e["name"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[tokio::test]
async fn watch_dir_stream_events() {
    let envd = Envd::start().await;
    let dir = user_dir("watch");
    let mut s = envd
        .stream(
            &format!("{FS}WatchDir"),
            json!({"path": dir, "recursive": true, "includeEntry": true}),
            &[],
        )
        .await;
    assert_eq!(s.msg().await, json!({"start": {}}));
    std::fs::write(format!("{dir}/keep.txt"), b"abc").unwrap();
    let m = s.msg().await;
    assert_eq!(m["filesystem"]["type"], "EVENT_TYPE_CREATE", "{m}");
    assert_eq!(m["filesystem"]["name"], "keep.txt");
    assert_eq!(
        m["filesystem"]["entry"]["path"],
        format!("{dir}/keep.txt"),
        "includeEntry adds the entry"
    );
    std::fs::write(format!("{dir}/new.txt"), b"x").unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(format!("{dir}/new.txt"))
        .map(|mut f| {
            use std::io::Write;
            f.write_all(b"more").unwrap();
        })
        .unwrap();
    std::fs::rename(format!("{dir}/new.txt"), format!("{dir}/renamed.txt")).unwrap();
    std::fs::remove_file(format!("{dir}/renamed.txt")).unwrap();
    std::fs::create_dir(format!("{dir}/sub")).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    std::fs::write(format!("{dir}/sub/deep.txt"), b"y").unwrap();

    let mut got = Vec::new();
    while !got
        .iter()
        .any(|(t, n): &(String, String)| t == "EVENT_TYPE_CREATE" && n == "sub/deep.txt")
    {
        let m = s.msg().await;
        if let Some(ev) = m.get("filesystem") {
            got.extend(events_of(std::slice::from_ref(ev)));
        }
    }
    let pos = |t: &str, n: &str| {
        got.iter()
            .position(|(a, b)| a == t && b == n)
            .unwrap_or_else(|| panic!("no {t} {n} in {got:?}"))
    };
    assert!(pos("EVENT_TYPE_CREATE", "new.txt") < pos("EVENT_TYPE_WRITE", "new.txt"));
    assert!(pos("EVENT_TYPE_WRITE", "new.txt") < pos("EVENT_TYPE_RENAME", "new.txt"));
    assert!(pos("EVENT_TYPE_RENAME", "new.txt") < pos("EVENT_TYPE_CREATE", "renamed.txt"));
    assert!(pos("EVENT_TYPE_CREATE", "renamed.txt") < pos("EVENT_TYPE_REMOVE", "renamed.txt"));
    pos("EVENT_TYPE_CREATE", "sub");
    drop(s);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn polled_watchers() {
    let envd = Envd::start().await;
    let dir = user_dir("pollwatch");
    let (st, v) = fs(
        &envd,
        "CreateWatcher",
        json!({"path": dir, "recursive": false}),
    )
    .await;
    assert_eq!(st, http::StatusCode::OK, "{v}");
    let id = v["watcherId"].as_str().unwrap().to_string();
    std::fs::write(format!("{dir}/p.txt"), b"1").unwrap();
    std::fs::remove_file(format!("{dir}/p.txt")).unwrap();
    let mut got = Vec::new();
    for _ in 0..50 {
        let (_, v) = fs(&envd, "GetWatcherEvents", json!({"watcher_id": id})).await;
        got.extend(events_of(
            v["events"].as_array().map(|a| a.as_slice()).unwrap_or(&[]),
        ));
        if got.iter().any(|(t, _)| t == "EVENT_TYPE_REMOVE") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        got.first().map(|g| g.0.as_str()),
        Some("EVENT_TYPE_CREATE"),
        "{got:?}"
    );
    assert!(
        got.contains(&("EVENT_TYPE_REMOVE".into(), "p.txt".into())),
        "{got:?}"
    );
    let (st, _) = fs(&envd, "RemoveWatcher", json!({"watcherId": id})).await;
    assert_eq!(st, http::StatusCode::OK);
    let (st, v) = fs(&envd, "GetWatcherEvents", json!({"watcherId": id})).await;
    assert_eq!(st, http::StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "not_found");
    let (st, _) = fs(
        &envd,
        "CreateWatcher",
        json!({"path": format!("{dir}/missing")}),
    )
    .await;
    assert_eq!(st, http::StatusCode::NOT_FOUND);
    std::fs::remove_dir_all(&dir).unwrap();
}
