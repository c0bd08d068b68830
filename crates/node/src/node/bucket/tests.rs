use super::*;

const FIRST: u32 = 1_200_000_000;

fn info(key: &str) -> ObjectInfo {
    ObjectInfo {
        key: key.into(),
        size: 1,
        modified_unix: None,
    }
}

#[test]
fn keys_become_paths_only_when_they_can_and_a_directory_beats_a_file() {
    for good in ["a", "a/b.txt", "d/e/f", "with space/é"] {
        assert_eq!(key_path(good), Some(good), "{good:?}");
    }
    let long = "x".repeat(256);
    for bad in [
        "",
        "/abs",
        "a//b",
        "a/./b",
        "../up",
        "a/..",
        "a\0b",
        long.as_str(),
    ] {
        assert_eq!(key_path(bad), None, "{bad:?}");
    }
    let p = plan(vec![
        info("x"),
        info("x/y"),
        info("a/b/c"),
        info("empty/"),
        info("bad/../escape"),
        info("top"),
    ]);
    assert_eq!(p.dirs, ["a", "a/b", "empty", "x"]);
    let files: Vec<&str> = p.files.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(files, ["x/y", "a/b/c", "top"]);
    let mut left = p.left_out.clone();
    left.sort();
    assert_eq!(left, ["bad/../escape", "x"]);
}

struct Rig {
    _root: tempfile::TempDir,
    _garage: vmon_objstore::dev::DevGarage,
    vols: PathBuf,
    /// The tenant's bucket, as the tenant's own client sees it.
    tenant: ObjectStore,
    share: BucketShare,
}

async fn rig(bucket: &str) -> Rig {
    let root = tempfile::tempdir().expect("tempdir");
    let garage = vmon_objstore::dev::DevGarage::start(&root.path().join("garage"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut cfg = garage.config.clone();
    cfg.bucket = bucket.into();
    let tenant = ObjectStore::new(cfg.clone()).expect("store");
    tenant.ensure_bucket().await.expect("bucket");
    let vols = root.path().join("volumes");
    let share = BucketShare {
        endpoint: cfg.endpoint.clone(),
        region: cfg.region.clone(),
        bucket: bucket.into(),
        prefix: "team/data".into(),
        read_only: false,
        max_bytes: 1 << 20,
        max_objects: 100,
        credentials: vmon_proto::node::BucketCredentials {
            access_key_id: cfg.access_key_id.clone(),
            secret_access_key: cfg.secret_access_key.clone(),
        },
    };
    Rig {
        _root: root,
        _garage: garage,
        vols,
        tenant,
        share,
    }
}

async fn put(store: &ObjectStore, key: &str, body: &str) {
    store
        .put_bytes(key, bytes::Bytes::from(body.to_string()))
        .await
        .expect("put");
}

async fn get(store: &ObjectStore, key: &str) -> Option<String> {
    store
        .get_bytes(key, 1 << 20)
        .await
        .expect("get")
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

#[tokio::test]
async fn a_prefix_fills_a_cache_as_files_and_only_what_changed_goes_back() {
    let r = rig("tenant-rw").await;
    let t = &r.tenant;
    put(t, "team/data/a.txt", "alpha").await;
    put(t, "team/data/d/e/f", "deep").await;
    put(t, "team/data/keep", "untouched").await;
    put(t, "team/data/x", "shadowed by x/").await;
    put(t, "team/data/x/y", "inside x").await;
    put(t, "team/other", "outside the prefix").await;
    let caches = Caches {
        volumes_dir: &r.vols,
        first: FIRST,
    };
    let id = "s3m-itest-0";
    caches.fill(id, &r.share, "/mnt/s3").await.expect("fill");
    let dir = r.vols.join(id);
    let read = |p: &str| std::fs::read_to_string(dir.join(p)).ok();
    assert_eq!(read("a.txt").as_deref(), Some("alpha"));
    assert_eq!(read("d/e/f").as_deref(), Some("deep"));
    assert_eq!(read("x/y").as_deref(), Some("inside x"));
    assert!(dir.join("x").is_dir(), "the directory wins over the key x");
    assert!(!dir.join("other").exists() && !dir.join("team").exists());
    // Owned by the guest's user in the cache's own id range.
    use std::os::unix::fs::MetadataExt;
    let base = std::fs::metadata(&dir).expect("dir").uid();
    assert!(base >= FIRST);
    assert_eq!(
        std::fs::metadata(dir.join("a.txt")).expect("a").uid(),
        base + tarball::GUEST_USER
    );
    // Nothing changed: nothing is sent.
    assert_eq!(
        caches.write_back(id, &r.share).await.expect("back"),
        WriteBack::Unchanged
    );

    // Someone else writes a key after the fill; the guest changes one, adds one, removes one.
    put(t, "team/data/late", "another writer").await;
    std::fs::write(dir.join("a.txt"), "changed").expect("write");
    std::fs::create_dir_all(dir.join("new/dir")).expect("mkdir");
    std::fs::write(dir.join("new/dir/n.bin"), "fresh").expect("write");
    // As the guest's user writes them through its virtiofsd: owned in the cache's range.
    let user = base + tarball::GUEST_USER;
    for p in ["new", "new/dir", "new/dir/n.bin"] {
        std::os::unix::fs::chown(dir.join(p), Some(user), Some(user)).expect("chown");
    }
    std::fs::remove_file(dir.join("d/e/f")).expect("rm");
    std::os::unix::fs::symlink("/etc/passwd", dir.join("link")).expect("symlink");
    assert!(matches!(
        caches.write_back(id, &r.share).await.expect("back"),
        WriteBack::Stored(..)
    ));
    assert_eq!(get(t, "team/data/a.txt").await.as_deref(), Some("changed"));
    assert_eq!(
        get(t, "team/data/new/dir/n.bin").await.as_deref(),
        Some("fresh")
    );
    assert_eq!(
        get(t, "team/data/d/e/f").await,
        None,
        "removed in the guest"
    );
    assert_eq!(
        get(t, "team/data/late").await.as_deref(),
        Some("another writer")
    );
    assert_eq!(get(t, "team/data/keep").await.as_deref(), Some("untouched"));
    assert_eq!(get(t, "team/data/link").await, None, "links do not travel");
    assert_eq!(
        caches.write_back(id, &r.share).await.expect("again"),
        WriteBack::Unchanged
    );

    // Over the mount's bytes: refused, the bucket keeps what it had.
    std::fs::write(dir.join("big"), vec![1u8; 2 << 20]).expect("big");
    let e = caches.write_back(id, &r.share).await.expect_err("over");
    assert!(
        e.downcast_ref::<volume_store::OverQuota>().is_some(),
        "{e:#}"
    );
    assert_eq!(get(t, "team/data/big").await, None);

    // Read-only: never written back.
    let ro = BucketShare {
        read_only: true,
        ..r.share.clone()
    };
    std::fs::remove_file(dir.join("big")).expect("rm");
    std::fs::write(dir.join("a.txt"), "not sent").expect("write");
    assert_eq!(
        caches.write_back(id, &ro).await.expect("ro"),
        WriteBack::Unchanged
    );
    assert_eq!(get(t, "team/data/a.txt").await.as_deref(), Some("changed"));

    caches.drop_cache(id).await.expect("drop");
    assert!(!dir.exists());
    assert!(!caches.manifest_path(id).expect("path").exists());
}

#[tokio::test]
async fn a_bad_secret_a_missing_bucket_or_too_much_is_the_callers_error() {
    let r = rig("tenant-errors").await;
    put(&r.tenant, "team/data/one", "1").await;
    put(&r.tenant, "team/data/two", "22").await;
    let caches = Caches {
        volumes_dir: &r.vols,
        first: FIRST,
    };
    let mut bad = r.share.clone();
    bad.credentials.secret_access_key = "0".repeat(64);
    let e = caches
        .fill("s3m-e-0", &bad, "/mnt/a")
        .await
        .expect_err("bad secret");
    let m = match e {
        NodeError::InvalidArgument(m) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("refused") && m.contains("/mnt/a"), "{m}");

    let mut missing = r.share.clone();
    missing.bucket = "no-such-bucket".into();
    let e = caches
        .fill("s3m-e-1", &missing, "/mnt/b")
        .await
        .expect_err("no bucket");
    let m = match e {
        NodeError::InvalidArgument(m) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("does not exist"), "{m}");

    let few = BucketShare {
        max_objects: 1,
        ..r.share.clone()
    };
    let e = caches
        .fill("s3m-e-2", &few, "/mnt/c")
        .await
        .expect_err("objects");
    assert!(
        matches!(e, NodeError::InvalidArgument(ref m) if m.contains("2 objects")),
        "{e:?}"
    );
    let small = BucketShare {
        max_bytes: 2,
        ..r.share.clone()
    };
    let e = caches
        .fill("s3m-e-3", &small, "/mnt/d")
        .await
        .expect_err("bytes");
    assert!(
        matches!(e, NodeError::InvalidArgument(ref m) if m.contains("3 bytes")),
        "{e:?}"
    );

    let none = BucketShare {
        credentials: Default::default(),
        ..r.share.clone()
    };
    let e = caches.write_back("s3m-e-4", &none).await;
    // No cache: nothing to do; with one, the missing credentials are said.
    assert_eq!(e.expect("absent"), WriteBack::Absent);
    caches
        .fill("s3m-e-4", &r.share, "/mnt/e")
        .await
        .expect("fill");
    let e = caches
        .write_back("s3m-e-4", &none)
        .await
        .expect_err("no creds");
    assert!(format!("{e:#}").contains("no credentials"), "{e:#}");
}
