//! Connect protocol edges: framing, codecs, errors, HTTP/2, chunked bodies.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::json;

use crate::harness::*;

#[tokio::test]
async fn health_unknown_and_malformed() {
    let envd = Envd::start().await;
    let r = envd
        .request(Request::get("/health").body(full("")).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NO_CONTENT);

    let (st, v) = envd.unary("/process.Process/Nope", json!({}), &[]).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "unimplemented");
    let (st, v) = envd.unary("/nope.Service/List", json!({}), &[]).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(v["code"], "unimplemented");

    // Malformed JSON: a Connect error, not a panic.
    let req = Request::post("/process.Process/List")
        .header("content-type", "application/json")
        .body(full("{not json"))
        .unwrap();
    let r = envd.request(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let v: serde_json::Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["code"], "invalid_argument");

    // Wrong field type.
    let (st, v) = envd
        .unary("/filesystem.Filesystem/Stat", json!({"path": 5}), &[])
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");

    // Unsupported codec.
    let req = Request::post("/process.Process/List")
        .header("content-type", "application/proto")
        .body(full(""))
        .unwrap();
    assert_eq!(
        envd.request(req).await.unwrap().status(),
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    );

    // Oversized envelope: refused by its declared length, before it is read.
    let mut huge = vec![0u8];
    huge.extend_from_slice(&(200u32 << 20).to_be_bytes());
    let req = Request::post("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(full(huge))
        .unwrap();
    let r = envd.request(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let mut s = EnvelopeStream::new(r.into_body());
    let end = s.end().await;
    assert_eq!(end["error"]["code"], "resource_exhausted", "{end}");

    // Truncated envelope.
    let req = Request::post("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(full(vec![0u8, 0, 0, 0, 50, b'{']))
        .unwrap();
    let mut s = EnvelopeStream::new(envd.request(req).await.unwrap().into_body());
    assert_eq!(s.end().await["error"]["code"], "invalid_argument");

    // Oversized unary body.
    let big = format!("{{\"path\":\"{}\"}}", "a".repeat(17 << 20));
    let (st, v) = envd
        .unary(
            "/filesystem.Filesystem/Stat",
            serde_json::from_str(&big).unwrap(),
            &[],
        )
        .await;
    assert_eq!(st, StatusCode::TOO_MANY_REQUESTS, "{}", v["code"]);
    assert_eq!(v["code"], "resource_exhausted");

    // Compressed streams are refused with a Connect error.
    let req = Request::post("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .header("connect-content-encoding", "gzip")
        .body(full(envelope(0, b"{}")))
        .unwrap();
    let mut s = EnvelopeStream::new(envd.request(req).await.unwrap().into_body());
    assert_eq!(s.end().await["error"]["code"], "unimplemented");

    // Still serving.
    envd.ok("/process.Process/List", json!({}), &[]).await;
}

#[tokio::test]
async fn chunked_request_split_across_chunks() {
    let envd = Envd::start().await;
    let (tx, body) = channel();
    let req = Request::post("/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(body)
        .unwrap();
    let msg =
        json!({"process": {"cmd": "/bin/echo", "args": ["chunked"]}, "stdin": false}).to_string();
    let env = envelope(0, msg.as_bytes());
    let feeder = tokio::spawn(async move {
        // Header split in two, payload in two: the server must reassemble.
        for part in [&env[..2], &env[2..7], &env[7..]] {
            tx.send(Bytes::copy_from_slice(part)).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        }
    });
    let r = envd.request(req).await.unwrap();
    let mut s = EnvelopeStream::new(r.into_body());
    assert!(s.msg().await["event"]["start"]["pid"].as_u64().is_some());
    let (out, _, _, end) = s.collect_process().await;
    assert_eq!(out, b"chunked\n");
    assert_eq!(end["exited"], true);
    assert_eq!(s.end().await, json!({}));
    feeder.await.unwrap();
}

#[tokio::test]
async fn http2_prior_knowledge() {
    let envd = Envd::start().await;
    let mut h2 = envd.h2().await;
    let req = Request::post(format!("http://{}/process.Process/List", envd.addr))
        .header("content-type", "application/json")
        .body(full("{}"))
        .unwrap();
    let r = h2.send_request(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.version(), http::Version::HTTP_2);

    let msg = json!({"process": {"cmd": "/bin/sh", "args": ["-c", "echo a; sleep 0.3; echo b"]}});
    let req = Request::post(format!("http://{}/process.Process/Start", envd.addr))
        .header("content-type", "application/connect+json")
        .body(full(envelope(0, msg.to_string().as_bytes())))
        .unwrap();
    let r = h2.send_request(req).await.unwrap();
    let mut s = EnvelopeStream::new(r.into_body());
    assert!(s.msg().await["event"].get("start").is_some());
    let (out, _, _, end) = s.collect_process().await;
    assert_eq!(out, b"a\nb\n");
    assert_eq!(end["exited"], true);
    assert_eq!(s.end().await, json!({}));
}

#[tokio::test]
async fn metrics_envs_health() {
    let envd = Envd::start().await;
    let r = envd
        .request(Request::get("/metrics").body(full("")).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let v: serde_json::Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    for k in [
        "ts",
        "cpu_count",
        "cpu_used_pct",
        "mem_total",
        "mem_used",
        "mem_cache",
        "mem_total_mib",
        "mem_used_mib",
        "disk_used",
        "disk_total",
    ] {
        assert!(
            v.get(k).is_some_and(|x| x.is_number()),
            "metrics lacks {k}: {v}"
        );
    }
    assert!(v["mem_total"].as_u64().unwrap() > v["mem_used"].as_u64().unwrap());
    assert!(v["disk_total"].as_u64().unwrap() > 0);
    assert!(v["cpu_count"].as_u64().unwrap() >= 1);
}

/// A server-streaming call whose (chunked) request body ends only after the response: the
/// connection still takes the next request. A client that keeps connections (the proxy) sent
/// its next request over a connection envd closed just after such a response.
#[tokio::test]
async fn a_streamed_request_body_ending_late_keeps_the_connection() {
    let envd = Envd::start().await;
    let stream = tokio::net::TcpStream::connect(envd.addr)
        .await
        .expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(conn);
    let (tx, body) = channel();
    let req = Request::post("/process.Process/Start")
        .header("host", "localhost")
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(body)
        .expect("req");
    let msg = json!({"process": {"cmd": "/bin/echo", "args": ["hi"]}});
    tx.send(envelope(0, msg.to_string().as_bytes()))
        .await
        .expect("send the message");
    let resp = sender.send_request(req).await.expect("start");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut s = EnvelopeStream::new(resp.into_body());
    assert!(s.msg().await["event"]["start"]["pid"].as_u64().is_some());
    let (out, _, _, end) = s.collect_process().await;
    assert_eq!(out, b"hi\n");
    assert_eq!(end["exited"], true);
    assert_eq!(s.end().await, json!({}));
    assert!(s.next().await.is_none(), "the response is complete");
    // Only now does the request body end (its last chunk), then a second request follows on
    // the same connection.
    drop(tx);
    sender.ready().await.expect("the connection is still open");
    let r = sender
        .send_request(
            Request::get("/health")
                .header("host", "localhost")
                .body(full(""))
                .expect("req"),
        )
        .await
        .expect("a second request on the same connection");
    assert_eq!(r.status(), StatusCode::NO_CONTENT);
}
