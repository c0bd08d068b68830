//! The client against a real garage (scripts/garage-dev.sh): put, get, multipart, list,
//! delete, integrity failures, bucket creation, and the benchmark.

use std::path::Path;

use bytes::Bytes;
use vmon_objstore::dev::DevGarage;
use vmon_objstore::{Error, ObjectStore};

fn garage(dir: &Path) -> DevGarage {
    match DevGarage::start(&dir.join("garage")) {
        Ok(g) => g,
        Err(e) => panic!("{e:#}"),
    }
}

fn patterned(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

fn sha(data: &[u8]) -> String {
    vmon_objstore::sha256_hex(data)
}

/// Files in `dir` (temporary download names included).
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn objects_go_up_and_come_back_whole_small_and_multipart() {
    let tmp = tempfile::tempdir().expect("tmp");
    let g = garage(tmp.path());
    let store = ObjectStore::new(g.config.clone())
        .expect("store")
        .with_part_size(5 << 20);
    store
        .ensure_bucket()
        .await
        .expect("existing bucket is fine");

    // Small: one PUT.
    let small = patterned(100_003, 1);
    let src = tmp.path().join("small");
    std::fs::write(&src, &small).expect("write");
    let (len, got_sha) = store.put_file("artifacts/small", &src).await.expect("put");
    assert_eq!(
        (len, got_sha.as_str()),
        (small.len() as u64, sha(&small).as_str())
    );
    let head = store
        .head("artifacts/small")
        .await
        .expect("head")
        .expect("present");
    assert_eq!(head.size, small.len() as u64);
    assert!(head.modified_unix.is_some());
    let dest = tmp.path().join("small.back");
    store
        .get_to_file("artifacts/small", &dest, Some(&sha(&small)))
        .await
        .expect("get");
    assert_eq!(std::fs::read(&dest).expect("read"), small);

    // Large: three parts of 5 MiB (the last short), with a run of zeros that comes back as a
    // hole and still hashes right.
    let mut big = patterned((12 << 20) + 3, 7);
    big[(6 << 20)..(8 << 20)].fill(0);
    let src = tmp.path().join("big");
    std::fs::write(&src, &big).expect("write");
    let (len, got_sha) = store
        .put_file("artifacts/big", &src)
        .await
        .expect("multipart put");
    assert_eq!(len, big.len() as u64);
    assert_eq!(got_sha, sha(&big), "the sha read while sending");
    let dest = tmp.path().join("big.back");
    let (n, back_sha) = store
        .get_to_file("artifacts/big", &dest, Some(&sha(&big)))
        .await
        .expect("get");
    assert_eq!((n, back_sha), (big.len() as u64, sha(&big)));
    assert!(std::fs::read(&dest).expect("read") == big, "bytes differ");

    // Small objects from memory, and the bound on reading them.
    store
        .put_bytes("builds/b1.json", Bytes::from_static(b"{\"id\":\"b1\"}"))
        .await
        .expect("put bytes");
    let got = store
        .get_bytes("builds/b1.json", 1024)
        .await
        .expect("get")
        .expect("some");
    assert_eq!(&got[..], b"{\"id\":\"b1\"}");
    assert!(
        store.get_bytes("builds/b1.json", 4).await.is_err(),
        "over the bound"
    );
    assert!(store
        .get_bytes("builds/none.json", 1024)
        .await
        .expect("ok")
        .is_none());
    assert!(store.head("builds/none.json").await.expect("ok").is_none());
    match store
        .get_to_file("builds/none.json", &tmp.path().join("x"), None)
        .await
    {
        Err(Error::NotFound(k)) => assert_eq!(k, "builds/none.json"),
        other => panic!("{other:?}"),
    }

    // Delete, and deleting what is absent.
    store.delete("artifacts/small").await.expect("delete");
    store.delete("artifacts/small").await.expect("delete again");
    assert!(store.head("artifacts/small").await.expect("head").is_none());
}

#[tokio::test]
async fn listings_page_through_every_key_under_a_prefix() {
    let tmp = tempfile::tempdir().expect("tmp");
    let g = garage(tmp.path());
    let mut cfg = g.config.clone();
    cfg.prefix = "cluster-a".into();
    let store = ObjectStore::new(cfg).expect("store").with_list_page(7);
    let other = ObjectStore::new(g.config.clone()).expect("unprefixed");
    for i in 0..20 {
        store
            .put_bytes(&format!("artifacts/a{i:02}"), Bytes::from(vec![b'x'; i]))
            .await
            .expect("put");
    }
    store
        .put_bytes("builds/x.json", Bytes::from_static(b"{}"))
        .await
        .expect("put");
    other
        .put_bytes("artifacts/elsewhere", Bytes::new())
        .await
        .expect("put");
    let listed = store.list("artifacts/").await.expect("list");
    let keys: Vec<&str> = listed.iter().map(|o| o.key.as_str()).collect();
    let want: Vec<String> = (0..20).map(|i| format!("artifacts/a{i:02}")).collect();
    assert_eq!(keys, want.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(listed.iter().enumerate().all(|(i, o)| o.size == i as u64));
    assert!(listed.iter().all(|o| o.modified_unix.is_some()));
    // The prefix is the store's own: the unprefixed client sees it in the keys.
    let all = other.list("").await.expect("list");
    assert!(all.iter().any(|o| o.key == "cluster-a/builds/x.json"));
    assert!(all.iter().any(|o| o.key == "artifacts/elsewhere"));
    assert_eq!(all.len(), 22);
}

#[tokio::test]
async fn a_download_that_hashes_wrong_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().expect("tmp");
    let g = garage(tmp.path());
    let store = ObjectStore::new(g.config.clone()).expect("store");
    let data = patterned(300_000, 3);
    let src = tmp.path().join("src");
    std::fs::write(&src, &data).expect("write");
    store.put_file("artifacts/x", &src).await.expect("put");
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).expect("mkdir");
    let wrong = sha(b"something else");
    match store
        .get_to_file("artifacts/x", &out.join("x"), Some(&wrong))
        .await
    {
        Err(Error::Integrity { key, want, got }) => {
            assert_eq!(key, "artifacts/x");
            assert_eq!(want, wrong);
            assert_eq!(got, sha(&data));
        }
        other => panic!("{other:?}"),
    }
    assert!(names(&out).is_empty(), "left behind: {:?}", names(&out));
}

#[tokio::test]
async fn buckets_are_made_when_absent_and_wrong_credentials_are_refused() {
    let tmp = tempfile::tempdir().expect("tmp");
    let g = garage(tmp.path());
    let mut cfg = g.config.clone();
    cfg.bucket = "made-by-the-client".into();
    let store = ObjectStore::new(cfg.clone()).expect("store");
    store.ensure_bucket().await.expect("create");
    store.ensure_bucket().await.expect("again");
    store
        .put_bytes("k", Bytes::from_static(b"v"))
        .await
        .expect("put");
    let mut bad = cfg;
    bad.secret_access_key = "0".repeat(64);
    let bad = ObjectStore::new(bad).expect("store");
    match bad.put_bytes("k", Bytes::from_static(b"v")).await {
        // The store's error document is read: its code says why.
        Err(Error::Status {
            status: 403, code, ..
        }) if !code.is_empty() => {}
        other => panic!("a wrong secret must be refused, with a code: {other:?}"),
    }
}

#[tokio::test]
async fn the_benchmark_reports_both_directions() {
    let tmp = tempfile::tempdir().expect("tmp");
    let g = garage(tmp.path());
    let store = ObjectStore::new(g.config.clone()).expect("store");
    // VMON_BENCH_MIB: a larger file for a measurement (160 MiB: three parts of 64 MiB).
    let mib = std::env::var("VMON_BENCH_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(160);
    let r = vmon_objstore::bench(&store, tmp.path(), mib)
        .await
        .expect("bench");
    eprintln!(
        "garage on loopback, {} MiB: upload {:.0} MiB/s, download {:.0} MiB/s",
        r.mib, r.upload_mib_s, r.download_mib_s
    );
    assert!(r.upload_mib_s > 0.0 && r.download_mib_s > 0.0);
    assert!(
        store.list("bench/").await.expect("list").is_empty(),
        "cleaned up"
    );
}
