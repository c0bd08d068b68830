//! 1 GiB through `/files` each way with envd's memory staying bounded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::BodyExt;

use crate::filesystem::user_dir;
use crate::harness::*;

const GIB: u64 = 1 << 30;
const CHUNK: usize = 1 << 20;
/// envd may use this much resident memory while moving a GiB (it streams in 256 KiB pieces).
const RSS_LIMIT_KIB: u64 = 128 * 1024;

fn pattern(i: u64) -> Bytes {
    let mut v = vec![0u8; CHUNK];
    for (j, b) in v.iter_mut().enumerate() {
        *b = ((i as usize * 31 + j) % 251) as u8;
    }
    Bytes::from(v)
}

#[tokio::test]
async fn one_gib_up_and_down_with_bounded_rss() {
    let envd = Envd::start().await;
    let dir = user_dir("big");
    let path = format!("{dir}/gib.bin");
    let peak = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let pid = envd.pid();
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                let rss: u64 = s
                    .lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                peak.fetch_max(rss, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        })
    };
    let base_rss = envd.rss_kib();

    let (tx, body) = channel();
    let req = Request::post(format!("/files?path={path}"))
        .header("content-type", "application/octet-stream")
        .body(body)
        .unwrap();
    let feeder = tokio::spawn(async move {
        for i in 0..(GIB / CHUNK as u64) {
            tx.send(pattern(i)).await.unwrap();
        }
    });
    let t = Instant::now();
    let r = envd.request(req).await.unwrap();
    feeder.await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    r.into_body().collect().await.unwrap();
    let up = t.elapsed();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), GIB);

    let t = Instant::now();
    let r = envd
        .request(
            Request::get(format!("/files?path={path}"))
                .body(full(""))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let mut body = r.into_body();
    let (mut got, mut idx, mut pending) = (0u64, 0u64, Vec::<u8>::new());
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        got += data.len() as u64;
        pending.extend_from_slice(&data);
        while pending.len() >= CHUNK {
            assert!(
                pending[..CHUNK] == pattern(idx)[..],
                "content differs in MiB {idx}"
            );
            pending.drain(..CHUNK);
            idx += 1;
        }
    }
    let down = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    assert_eq!(got, GIB);
    let peak = peak.load(Ordering::Relaxed);
    println!(
        "TRANSFER 1 GiB upload {:.1}s ({:.0} MiB/s), download {:.1}s ({:.0} MiB/s); envd RSS idle {} KiB, peak {} KiB",
        up.as_secs_f64(), 1024.0 / up.as_secs_f64(), down.as_secs_f64(), 1024.0 / down.as_secs_f64(), base_rss, peak
    );
    assert!(peak < RSS_LIMIT_KIB, "envd RSS peaked at {peak} KiB");
    std::fs::remove_dir_all(&dir).unwrap();
}
