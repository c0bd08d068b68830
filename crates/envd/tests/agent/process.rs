//! process.Process over the wire.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::*;

#[tokio::test]
async fn stream_order_start_output_while_running_end_last() {
    let envd = Envd::start().await;
    let (mut s, pid) = start(
        &envd,
        "echo one; sleep 1.5; echo two >&2; exit 4",
        json!({"stdin": false}),
        &[],
    )
    .await;
    let t0 = Instant::now();
    let first = s.msg().await;
    assert_eq!(
        unb64(first["event"]["data"]["stdout"].as_str().unwrap()),
        b"one\n"
    );
    // Output arrived while the process is still running: it must be flushed, not buffered.
    assert!(
        t0.elapsed() < Duration::from_millis(1000),
        "first output took {:?}",
        t0.elapsed()
    );
    let list = envd.ok("/process.Process/List", json!({}), &[]).await;
    assert!(
        list["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid),
        "{list}"
    );
    let (out, err, _, end) = s.collect_process().await;
    assert!(out.is_empty());
    assert_eq!(err, b"two\n");
    assert_eq!(end["exitCode"], 4);
    assert_eq!(end["exited"], true);
    assert_eq!(end["status"], "exit status 4");
    assert_eq!(end["error"], "exit status 4");
    assert_eq!(s.end().await, json!({}));
    assert!(s.next().await.is_none());
    // Finished processes leave the list.
    let list = envd.ok("/process.Process/List", json!({}), &[]).await;
    assert!(!list.to_string().contains(&format!("\"pid\":{pid}")));
}

#[tokio::test]
async fn user_env_cwd_and_defaults() {
    let envd = Envd::start().await;
    let (mut s, _) = start(
        &envd,
        "id -un; echo $HOME; pwd; echo $FOO; echo $USER",
        json!({"process": {"cmd": "/bin/sh", "args": ["-c", "id -un; echo $HOME; pwd; echo $FOO; echo $USER"], "envs": {"FOO": "bar"}, "cwd": "/tmp"}}),
        &[],
    )
    .await;
    let (out, _, _, end) = s.collect_process().await;
    let home = format!("/home/{TEST_USER}");
    assert_eq!(
        String::from_utf8(out).unwrap(),
        format!("{TEST_USER}\n{home}\n/tmp\nbar\n{TEST_USER}\n")
    );
    assert!(
        end.get("exitCode").is_none(),
        "exit code 0 is omitted: {end}"
    );

    // Basic auth picks the user; no cwd means the home directory.
    let (mut s, _) = start(
        &envd,
        "id -u; pwd",
        json!({}),
        &[("authorization", &basic("root"))],
    )
    .await;
    let (out, _, _, _) = s.collect_process().await;
    assert_eq!(String::from_utf8(out).unwrap(), "0\n/root\n");

    // Unknown users and bad cwd are refused.
    let (st, v) = envd
        .unary(
            "/process.Process/List",
            json!({}),
            &[("authorization", &basic("nosuchuser"))],
        )
        .await;
    assert_eq!(st, http::StatusCode::UNAUTHORIZED);
    assert_eq!(v["code"], "unauthenticated");
    let mut s = envd
        .stream(
            "/process.Process/Start",
            json!({"process": {"cmd": "/bin/true", "cwd": "/does/not/exist"}}),
            &[],
        )
        .await;
    assert_eq!(s.end().await["error"]["code"], "invalid_argument");
    let mut s = envd
        .stream(
            "/process.Process/Start",
            json!({"process": {"cmd": "/no/such/binary"}}),
            &[],
        )
        .await;
    assert_eq!(s.end().await["error"]["code"], "invalid_argument");
}

#[tokio::test]
async fn stdin_send_close_and_stream_input() {
    let envd = Envd::start().await;
    let (mut s, pid) = start(&envd, "cat", json!({"stdin": true}), &[]).await;
    envd.ok(
        "/process.Process/SendInput",
        json!({"process": {"pid": pid}, "input": {"stdin": b64(b"hello\n")}}),
        &[],
    )
    .await;
    let m = s.msg().await;
    assert_eq!(
        unb64(m["event"]["data"]["stdout"].as_str().unwrap()),
        b"hello\n"
    );

    // Client-streaming input.
    let (tx, body) = channel();
    let req = http::Request::post("/process.Process/StreamInput")
        .header("content-type", "application/connect+json")
        .body(body)
        .unwrap();
    let resp = tokio::spawn({
        let addr = envd.addr;
        let token = envd.token.clone();
        async move {
            let e = EnvdRef { addr, token };
            e.send(req).await
        }
    });
    tx.send(envelope(
        0,
        json!({"start": {"process": {"pid": pid}}})
            .to_string()
            .as_bytes(),
    ))
    .await
    .unwrap();
    tx.send(envelope(0, json!({"keepalive": {}}).to_string().as_bytes()))
        .await
        .unwrap();
    tx.send(envelope(
        0,
        json!({"data": {"input": {"stdin": b64(b"streamed\n")}}})
            .to_string()
            .as_bytes(),
    ))
    .await
    .unwrap();
    let m = s.msg().await;
    assert_eq!(
        unb64(m["event"]["data"]["stdout"].as_str().unwrap()),
        b"streamed\n"
    );
    drop(tx);
    let (status, mut es) = resp.await.unwrap();
    assert_eq!(status, http::StatusCode::OK);
    assert_eq!(es.msg().await, json!({}));
    assert_eq!(es.end().await, json!({}));

    envd.ok(
        "/process.Process/CloseStdin",
        json!({"process": {"pid": pid}}),
        &[],
    )
    .await;
    let (_, _, _, end) = s.collect_process().await;
    assert_eq!(end["exited"], true);

    // stdin:false gives /dev/null, and input is refused.
    let (mut s, pid) = start(&envd, "cat; echo done", json!({"stdin": false}), &[]).await;
    let (st, _) = envd
        .unary(
            "/process.Process/SendInput",
            json!({"process": {"pid": pid}, "input": {"stdin": "eA=="}}),
            &[],
        )
        .await;
    assert!(
        st == http::StatusCode::BAD_REQUEST || st == http::StatusCode::NOT_FOUND,
        "{st}"
    );
    let (out, _, _, _) = s.collect_process().await;
    assert_eq!(out, b"done\n");
}

/// A tiny helper to send one request from a spawned task.
struct EnvdRef {
    addr: std::net::SocketAddr,
    token: Option<String>,
}

impl EnvdRef {
    async fn send(&self, mut req: http::Request<ReqBody>) -> (http::StatusCode, EnvelopeStream) {
        let stream = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        req.headers_mut()
            .insert(http::header::HOST, "localhost".parse().unwrap());
        if let Some(t) = &self.token {
            req.headers_mut()
                .insert("x-access-token", t.parse().unwrap());
        }
        let r = sender.send_request(req).await.unwrap();
        (r.status(), EnvelopeStream::new(r.into_body()))
    }
}

#[tokio::test]
async fn survives_disconnect_connect_replays_and_signals() {
    let envd = Envd::start().await;
    let (mut s, pid) = start(
        &envd,
        "i=0; while true; do echo tick$i; i=$((i+1)); sleep 0.1; done",
        json!({"tag": "ticker", "stdin": false}),
        &[],
    )
    .await;
    s.msg().await;
    drop(s); // the client goes away
    tokio::time::sleep(Duration::from_millis(400)).await;
    let list = envd.ok("/process.Process/List", json!({}), &[]).await;
    let p = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .cloned()
        .expect("still running");
    assert_eq!(p["tag"], "ticker");
    assert_eq!(p["config"]["cmd"], "/bin/sh");

    // Connect by tag: start (with the pid) first, then the kept output, then live output.
    let mut c = envd
        .stream(
            "/process.Process/Connect",
            json!({"process": {"tag": "ticker"}}),
            &[],
        )
        .await;
    let first = c.msg().await;
    assert_eq!(first["event"]["start"]["pid"], pid);
    let m = c.msg().await;
    assert_eq!(
        unb64(m["event"]["data"]["stdout"].as_str().unwrap()),
        b"tick0\n",
        "replay starts at the beginning"
    );

    envd.ok(
        "/process.Process/SendSignal",
        json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"}),
        &[],
    )
    .await;
    let (_, _, _, end) = c.collect_process().await;
    assert_eq!(
        end["exited"],
        serde_json::Value::Null,
        "signalled: exited is false (omitted)"
    );
    assert_eq!(end["exitCode"], -1);
    assert_eq!(end["status"], "signal: terminated");

    let (st, v) = envd
        .unary(
            "/process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"}),
            &[],
        )
        .await;
    assert_eq!(st, http::StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "not_found");
    let mut c = envd
        .stream(
            "/process.Process/Connect",
            json!({"process": {"pid": 999999}}),
            &[],
        )
        .await;
    assert_eq!(c.end().await["error"]["code"], "not_found");

    // SIGKILL reaches the whole job (the shell and its sleep).
    let (mut s, pid) = start(&envd, "sleep 100 & sleep 100", json!({}), &[]).await;
    envd.ok(
        "/process.Process/SendSignal",
        json!({"process": {"pid": pid}, "signal": 9}),
        &[],
    )
    .await;
    let (_, _, _, end) = s.collect_process().await;
    assert_eq!(end["status"], "signal: killed");
}

#[tokio::test]
async fn keepalive_and_deadline() {
    let envd = Envd::start().await;
    let (mut s, _) = start(
        &envd,
        "sleep 2.5",
        json!({}),
        &[("keepalive-ping-interval", "1")],
    )
    .await;
    let m = s.msg().await;
    assert!(m["event"].get("keepalive").is_some(), "{m}");
    let (_, _, _, end) = s.collect_process().await;
    assert_eq!(end["exited"], true);

    // Connect-Timeout-Ms on Start bounds the command: the stream ends and the process is killed.
    let (mut s, pid) = start(
        &envd,
        "sleep 30",
        json!({}),
        &[("connect-timeout-ms", "500")],
    )
    .await;
    let t0 = Instant::now();
    loop {
        let (flags, v) = s.next().await.expect("stream ended");
        if flags == 2 {
            assert_eq!(v["error"]["code"], "deadline_exceeded", "{v}");
            break;
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let list = envd.ok("/process.Process/List", json!({}), &[]).await;
    assert!(
        !list.to_string().contains(&format!("\"pid\":{pid}")),
        "timed-out process was killed: {list}"
    );
}

async fn read_pty_until(s: &mut EnvelopeStream, needle: &str) -> String {
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let m = s.msg().await;
        if let Some(p) = m["event"]["data"].get("pty") {
            seen.extend(unb64(p.as_str().unwrap()));
            if String::from_utf8_lossy(&seen).contains(needle) {
                return String::from_utf8_lossy(&seen).into_owned();
            }
        }
        assert!(
            m["event"].get("end").is_none(),
            "pty ended early: {}",
            String::from_utf8_lossy(&seen)
        );
    }
    panic!(
        "never saw {needle:?} in {:?}",
        String::from_utf8_lossy(&seen)
    );
}

#[tokio::test]
async fn pty_echo_and_resize() {
    let envd = Envd::start().await;
    let mut s = envd
        .stream(
            "/process.Process/Start",
            json!({"process": {"cmd": "/bin/bash", "args": ["--norc", "--noprofile", "-i"], "envs": {"TERM": "xterm", "PS1": "$ "}},
                   "pty": {"size": {"cols": 80, "rows": 24}}}),
            &[],
        )
        .await;
    let pid = s.msg().await["event"]["start"]["pid"].as_u64().unwrap();
    let send =
        |data: &str| json!({"process": {"pid": pid}, "input": {"pty": b64(data.as_bytes())}});
    envd.ok(
        "/process.Process/SendInput",
        send("echo mark$((40+2))\n"),
        &[],
    )
    .await;
    // The terminal echoes what was typed, and the shell runs it.
    let out = read_pty_until(&mut s, "mark42\r\n").await;
    assert!(
        out.contains("echo mark$((40+2))"),
        "typed input is echoed: {out:?}"
    );
    envd.ok("/process.Process/SendInput", send("stty size\n"), &[])
        .await;
    read_pty_until(&mut s, "24 80").await;
    envd.ok(
        "/process.Process/Update",
        json!({"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 30}}}),
        &[],
    )
    .await;
    envd.ok("/process.Process/SendInput", send("stty size; tty\n"), &[])
        .await;
    let out = read_pty_until(&mut s, "30 100").await;
    let _ = out;
    let (st, v) = envd
        .unary(
            "/process.Process/CloseStdin",
            json!({"process": {"pid": pid}}),
            &[],
        )
        .await;
    assert_eq!(st, http::StatusCode::BAD_REQUEST, "{v}");
    envd.ok("/process.Process/SendInput", send("exit 7\n"), &[])
        .await;
    let (_, _, _, end) = s.collect_process().await;
    assert_eq!(end["exitCode"], 7);
}

#[tokio::test]
async fn latency_report() {
    let envd = Envd::start().await;
    let mut sender = envd.h2().await;
    let mut unary = Vec::new();
    for _ in 0..100 {
        let req = http::Request::post(format!("http://{}/process.Process/List", envd.addr))
            .header("content-type", "application/json")
            .body(full("{}"))
            .unwrap();
        let t = Instant::now();
        let r = sender.send_request(req).await.unwrap();
        http_body_util::BodyExt::collect(r.into_body())
            .await
            .unwrap();
        unary.push(t.elapsed());
    }
    let mut starts = Vec::new();
    for _ in 0..100 {
        let msg = json!({"process": {"cmd": "/bin/true"}, "stdin": false});
        let req = http::Request::post(format!("http://{}/process.Process/Start", envd.addr))
            .header("content-type", "application/connect+json")
            .body(full(envelope(0, msg.to_string().as_bytes())))
            .unwrap();
        let t = Instant::now();
        let r = sender.send_request(req).await.unwrap();
        let mut s = EnvelopeStream::new(r.into_body());
        s.msg().await;
        let (_, _, _, _end) = s.collect_process().await;
        s.end().await;
        starts.push(t.elapsed());
    }
    unary.sort();
    starts.sort();
    println!(
        "LATENCY unary List median {:?} p90 {:?}; Start /bin/true to end-stream median {:?} p90 {:?}",
        unary[50], unary[90], starts[50], starts[90]
    );
    assert!(unary[50] < Duration::from_millis(50));
    assert!(starts[50] < Duration::from_millis(500));
}
