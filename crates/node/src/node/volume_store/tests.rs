use super::*;
use std::os::unix::fs::MetadataExt;

const FIRST: u32 = 1_100_000_000;

fn sh(cmd: &str) {
    let st = std::process::Command::new("/bin/sh")
        .args(["-c", cmd])
        .status()
        .expect("sh");
    assert!(st.success(), "{cmd}");
}

#[tokio::test]
async fn a_tree_packs_and_unpacks_as_the_volumes_own_ids_and_hashes_the_same() {
    let vols = tempfile::tempdir().expect("tempdir");
    let outside = tempfile::tempdir().expect("tempdir");
    let a = vols.path().join("a");
    std::fs::create_dir(&a).expect("a");
    std::fs::create_dir_all(a.join("d/e")).expect("tree");
    std::fs::write(a.join("d/e/f"), "deep").expect("file");
    std::fs::write(a.join("big"), vec![7u8; 300_000]).expect("big");
    std::os::unix::fs::symlink(outside.path(), a.join("out")).expect("symlink");
    std::os::unix::fs::chown(a.join("d/e/f"), Some(1000), Some(1000)).expect("chown");
    let tar1 = vols.path().join("one.tar");
    let (sha1, size1) = pack(vols.path(), FIRST, "a", &tar1, 0).await.expect("pack");
    assert_eq!(size1, std::fs::metadata(&tar1).expect("tar").len());
    // Nothing changed: the same bytes (what lets a write-back upload nothing).
    let tar2 = vols.path().join("two.tar");
    let (sha2, _) = pack(vols.path(), FIRST, "a", &tar2, 0)
        .await
        .expect("again");
    assert_eq!(sha1, sha2);
    let base = std::fs::metadata(&a).expect("a").uid();
    assert!(base >= FIRST, "the volume got a range of its own: {base}");

    let b = vols.path().join("b");
    std::fs::create_dir(&b).expect("b");
    std::fs::write(b.join("stale"), "old copy").expect("stale");
    unpack(vols.path(), FIRST, "b", Some(&tar1))
        .await
        .expect("unpack");
    assert!(!b.join("stale").exists(), "the old copy is replaced");
    assert_eq!(std::fs::read_to_string(b.join("d/e/f")).expect("f"), "deep");
    assert_eq!(std::fs::read(b.join("big")).expect("big").len(), 300_000);
    let link = std::fs::symlink_metadata(b.join("out")).expect("link");
    assert!(link.file_type().is_symlink(), "links stay links");
    let bbase = std::fs::metadata(&b).expect("b").uid();
    assert_ne!(bbase, base, "another volume, another range");
    let f = std::fs::metadata(b.join("d/e/f")).expect("f");
    assert_eq!(
        (f.uid(), f.gid()),
        (bbase + 1000, bbase + 1000),
        "guest ids kept"
    );
    assert_eq!(std::fs::metadata(outside.path()).expect("o").uid(), 0);

    // Over the limit: refused.
    let e = pack(vols.path(), FIRST, "a", &tar2, 100_000)
        .await
        .expect_err("over quota");
    assert!(e.downcast_ref::<OverQuota>().is_some(), "{e:#}");
    // No archive: an empty volume.
    unpack(vols.path(), FIRST, "b", None).await.expect("empty");
    assert_eq!(std::fs::read_dir(&b).expect("b").count(), 0);
}

#[tokio::test]
async fn an_archive_that_reaches_out_of_the_volume_writes_nothing_outside() {
    let vols = tempfile::tempdir().expect("tempdir");
    let outside = tempfile::tempdir().expect("tempdir");
    let work = tempfile::tempdir().expect("tempdir");
    let evil = work.path().join("evil.tar");
    let o = outside.path().display();
    let (w, e) = (work.path().display(), evil.display());
    // A link to the host, then a file through it; and a member climbing out with `..`.
    sh(&format!(
        "mkdir -p {w}/s1 {w}/s2/link {w}/s3 && ln -s {o} {w}/s1/link && \
         echo pwned > {w}/s2/link/planted && echo up > {w}/s3/up && \
         tar -cf {e} -C {w}/s1 link && tar -rf {e} -C {w}/s2 link/planted && \
         tar -rf {e} -C {w}/s3 --transform 's,^up,../../../../../tmp/vmon-escape-test,' up"
    ));
    let v = vols.path().join("v");
    std::fs::create_dir(&v).expect("v");
    let r = unpack(vols.path(), FIRST, "v", Some(&evil)).await;
    assert!(r.is_err(), "a hostile archive fails the fill");
    assert!(!outside.path().join("planted").exists());
    assert!(!Path::new("/tmp/vmon-escape-test").exists());
}

#[tokio::test]
async fn a_volume_goes_from_one_node_to_another_through_a_real_store() {
    let root = tempfile::tempdir().expect("tempdir");
    let garage = vmon_objstore::dev::DevGarage::start(&root.path().join("garage"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let objects = vmon_objstore::ObjectStore::new(garage.config.clone()).expect("store");
    objects.ensure_bucket().await.expect("bucket");
    let (da, db) = (root.path().join("a"), root.path().join("b"));
    std::fs::create_dir_all(&da).expect("a");
    // b's volumes directory is not there yet: a node with the store has none laid out.
    let a = Syncer {
        objects: &objects,
        volumes_dir: &da,
        first: FIRST,
    };
    let b = Syncer {
        objects: &objects,
        volumes_dir: &db,
        first: FIRST,
    };
    let v = "0b8f3c1e-2a4d-4c6e-9f10-1234567890ab";

    // A new volume: an empty copy, nothing in the store, nothing to send.
    assert!(!a.fill(v, false).await.expect("fill a"));
    assert_eq!(std::fs::read_dir(da.join(v)).expect("dir").count(), 0);
    std::fs::write(da.join(v).join("one"), "from a").expect("write");
    let WriteBack::Stored(h1, _) = a.write_back(v, 0).await.expect("back") else {
        panic!("a changed volume is stored");
    };
    assert_eq!(
        a.write_back(v, 0).await.expect("again"),
        WriteBack::Unchanged
    );

    // The other node fills from the store; its unchanged copy sends nothing.
    assert!(b.fill(v, false).await.expect("fill b"));
    let mode = std::fs::metadata(&db)
        .expect("b's volumes dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "made root's own");
    assert_eq!(
        std::fs::read_to_string(db.join(v).join("one")).expect("one"),
        "from a"
    );
    assert!(
        !b.fill(v, false).await.expect("current"),
        "a current copy is not fetched again"
    );
    assert_eq!(b.write_back(v, 0).await.expect("b"), WriteBack::Unchanged);
    std::fs::write(db.join(v).join("two"), "from b").expect("write");
    std::fs::remove_file(db.join(v).join("one")).expect("rm");

    // Over the limit: refused, the store keeps the last tree.
    std::fs::write(db.join(v).join("big"), vec![1u8; 200_000]).expect("big");
    let e = b.write_back(v, 100_000).await.expect_err("over quota");
    assert!(e.downcast_ref::<OverQuota>().is_some(), "{e:#}");
    assert_eq!(a.head(v).await.expect("head"), Some(h1.clone()));
    std::fs::remove_file(db.join(v).join("big")).expect("rm big");
    let WriteBack::Stored(h2, _) = b.write_back(v, 100_000).await.expect("b back") else {
        panic!("stored");
    };
    assert_ne!(h1, h2);

    // A live copy is kept; a copy not mounted is replaced by the store's tree.
    std::fs::write(da.join(v).join("local"), "unsent").expect("write");
    assert!(!a.fill(v, true).await.expect("live"));
    assert!(da.join(v).join("local").exists());
    assert!(a.fill(v, false).await.expect("refill"));
    let mut names: Vec<String> = std::fs::read_dir(da.join(v))
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["two"]);
    // Only the current and the previous trees are kept.
    let trees = objects
        .list(&format!("volumes/{v}/tree-"))
        .await
        .expect("list");
    assert!(trees.len() <= 2, "{trees:?}");
    assert!(trees.iter().any(|o| o.key == tree_key(v, &h2)));

    // Destroyed: its objects and a's copy go; b, still "mounting" it, keeps its copy but
    // its write-back sends nothing from now on.
    std::fs::write(db.join(v).join("three"), "after the destroy").expect("write");
    a.delete(v, false).await.expect("delete");
    assert!(!da.join(v).exists(), "a's copy is gone");
    assert!(a.synced(v).is_none());
    b.delete(v, true).await.expect("delete again");
    assert!(db.join(v).join("three").exists(), "a live copy stays");
    assert_eq!(b.write_back(v, 0).await.expect("b"), WriteBack::Unchanged);
    let left = objects.list(&format!("volumes/{v}/")).await.expect("list");
    let keys: Vec<&str> = left.iter().map(|o| o.key.as_str()).collect();
    assert_eq!(keys, [deleted_key(v).as_str()]);
}
