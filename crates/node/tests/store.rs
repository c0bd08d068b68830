//! Builds through the object store between two nodes on this host (their own data dirs, the
//! image cache shared, their own slot blocks) and a real garage: a sandbox paused with its
//! memory on node A resumes on node B from what A uploaded, a corrupt object fails a fetch
//! cleanly, and deleting a build lets the store's collection reclaim its objects.
//! Real VMs under QEMU (TCG here) and the real envd.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{envd_binary, runtime, sh, start, unique, READ_TOKEN, TOKEN_SERVER};
use vmon_node::{Node, NodeConfig};
use vmon_objstore::dev::DevGarage;
use vmon_objstore::ObjectStoreConfig;
use vmon_proto::node::{NodeCalls, NodeError};

/// A data dir of its own whose `images/` is the shared test image cache.
fn data_dir(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("data dir");
    let images = common::data_dir().join("images");
    std::fs::create_dir_all(&images).expect("image cache");
    std::os::unix::fs::symlink(&images, dir.join("images")).expect("images link");
    dir
}

async fn open(dir: PathBuf, store: &ObjectStoreConfig) -> Arc<Node> {
    open_with(dir, store, 20 << 10).await
}

async fn open_with(dir: PathBuf, store: &ObjectStoreConfig, cache_mb: u64) -> Arc<Node> {
    let mut cfg = NodeConfig::new(dir);
    cfg.envd_binary = Some(envd_binary());
    cfg.spare_slots = 0;
    cfg.pool_size = 0;
    cfg.blank_pool_size = 0;
    cfg.park_max = 0;
    cfg.object_store = Some(store.clone());
    cfg.store_cache_mb = cache_mb;
    Node::open(cfg).await.expect("node opens")
}

async fn wait_stored(node: &Node, build: &str) -> Duration {
    let t0 = Instant::now();
    loop {
        let info = node.build_info(build).await.expect("build info");
        if info.stored {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(900),
            "{build} was not uploaded within 15 minutes"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_paused_sandbox_resumes_on_another_node_from_the_object_store() {
    let root = tempfile::Builder::new()
        .prefix("vmon-store-")
        .tempdir_in("/var/tmp")
        .expect("root");
    let garage = DevGarage::start(&root.path().join("garage")).unwrap_or_else(|e| panic!("{e:#}"));
    runtime().block_on(async {
        let a = open(data_dir(root.path(), "a"), &garage.config).await;
        // B's cache of fetched builds holds one at most (a bound of 0: only the one in hand).
        let b = open_with(data_dir(root.path(), "b"), &garage.config, 0).await;
        assert_ne!(a.slot_block(), b.slot_block());
        eprintln!("accelerator: {}", a.accel().accel.as_str());

        // Node A: a template, a sandbox with a process holding a secret in memory and a file on
        // disk, paused with its memory.
        a.image().await.expect("guest image");
        let tpl = unique("tpl-store-");
        let t0 = Instant::now();
        common::build_plain(&a, &tpl, 512).await;
        eprintln!("template built on A in {:.1}s", t0.elapsed().as_secs_f64());
        let id = unique("st");
        let r = start(&a, &id, &tpl, false).await;
        sh(&a, &id, TOKEN_SERVER).await;
        let token = sh(&a, &id, READ_TOKEN).await;
        assert_eq!(token.len(), 32, "token {token:?}");
        let sum = sh(
            &a,
            &id,
            "head -c 32M /dev/urandom > /home/user/f.bin && sync && sha256sum /home/user/f.bin | cut -d' ' -f1",
        )
        .await;
        // A's writes to the store are refused (as a fenced node's are) when it pauses: the
        // upload waits for the gate and is made once it opens, not dropped.
        let open_gate = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let g = open_gate.clone();
        a.set_store_gate(Arc::new(move || {
            if g.load(std::sync::atomic::Ordering::SeqCst) {
                Ok(())
            } else {
                Err("closed by the test (as a fenced node's)".into())
            }
        }));
        let t0 = Instant::now();
        let paused = a.pause(&id, &r.execution_id, true).await.expect("pause");
        eprintln!("pause returned in {:.2}s", t0.elapsed().as_secs_f64());
        assert!(paused.has_memory);
        assert!(!paused.stored, "the upload runs after the pause returned");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            !a.build_info(&paused.build_id).await.expect("info").stored,
            "nothing is stored through a closed gate"
        );
        open_gate.store(true, std::sync::atomic::Ordering::SeqCst);
        let waited = wait_stored(&a, &paused.build_id).await;
        eprintln!(
            "paused build stored {:.1}s after the pause returned",
            waited.as_secs_f64()
        );

        // Node B has never seen either build: it fetches the paused one and resumes it.
        let t0 = Instant::now();
        let r = start(&b, &id, &paused.build_id, false).await;
        let cross = t0.elapsed();
        eprintln!(
            "cross-node resume (fetch + restore) on B: {:.1}s",
            cross.as_secs_f64()
        );
        assert_eq!(sh(&b, &id, READ_TOKEN).await, token, "the process survived");
        assert_eq!(
            sh(&b, &id, "sha256sum /home/user/f.bin | cut -d' ' -f1").await,
            sum,
            "the file survived"
        );
        let info = b.build_info(&paused.build_id).await.expect("info on B");
        assert!(info.stored && info.has_memory);
        // A second start of the same build on B is local.
        let t0 = Instant::now();
        b.kill(&id, &r.execution_id).await.expect("kill");
        let r = start(&b, &id, &paused.build_id, false).await;
        eprintln!("local resume on B: {:.1}s", t0.elapsed().as_secs_f64());
        b.kill(&id, &r.execution_id).await.expect("kill");
        // Fetching the template on B evicts the paused build (no sandbox runs from it now);
        // a later start fetches it again.
        let tpl_info = b.build_info(&tpl).await.expect("template on B");
        assert!(tpl_info.stored);
        let local = |n: &Node, build: &str| {
            n.data_dir().join("builds").join(format!("{build}.json")).exists()
        };
        assert!(!local(&b, &paused.build_id), "evicted from B's cache");
        assert!(local(&b, &tpl));
        let r = start(&b, &id, &paused.build_id, false).await;
        assert_eq!(sh(&b, &id, READ_TOKEN).await, token, "fetched again");
        b.kill(&id, &r.execution_id).await.expect("kill");

        // Node D has an image of the same recipe whose bytes differ (as on another host; here
        // its cached sha256 says so): it fetches the store's rootfs as well and rebases the
        // chain onto that copy.
        let hash = a.image().await.expect("image").manifest.hash.clone();
        let d_dir = root.path().join("d");
        let d_image = d_dir.join("images").join(&hash);
        std::fs::create_dir_all(&d_image).expect("d image dir");
        let shared = common::data_dir().join("images").join(&hash);
        for f in ["manifest.json", "vmlinuz", "initrd", "rootfs.img"] {
            std::fs::hard_link(shared.join(f), d_image.join(f)).expect("link image file");
        }
        let size = std::fs::metadata(d_image.join("rootfs.img")).expect("rootfs").len();
        std::fs::write(
            d_image.join("rootfs.img.sha256"),
            format!("{{\"sha256\":\"{}\",\"size\":{size}}}", "0".repeat(64)),
        )
        .expect("sum");
        let d = open(d_dir.clone(), &garage.config).await;
        let t0 = Instant::now();
        let r = start(&d, &id, &paused.build_id, false).await;
        eprintln!(
            "cross-node resume on D, rootfs fetched too: {:.1}s",
            t0.elapsed().as_secs_f64()
        );
        assert_eq!(sh(&d, &id, READ_TOKEN).await, token, "the process survived on D");
        assert_eq!(
            sh(&d, &id, "sha256sum /home/user/f.bin | cut -d' ' -f1").await,
            sum,
            "the file survived on D"
        );
        let rootfs_copies: Vec<String> = files_in(&d_dir.join("artifacts"))
            .into_iter()
            .filter(|f| f.starts_with("rootfs-"))
            .collect();
        assert_eq!(rootfs_copies.len(), 1, "{rootfs_copies:?}");
        d.kill(&id, &r.execution_id).await.expect("kill");

        // Two concurrent first asks on a fresh node share one fetch (two would collide on the
        // staged files' names).
        let e = open(data_dir(root.path(), "e"), &garage.config).await;
        let (x, y) = tokio::join!(
            e.build_info(&paused.build_id),
            e.build_info(&paused.build_id)
        );
        assert!(x.expect("first").stored && y.expect("second").stored);
        assert_eq!(files_in(&e.data_dir().join("store/fetched")).len(), 1);

        // A corrupt object in the store: a third node's start fails and keeps nothing.
        let c_dir = data_dir(root.path(), "c");
        let c = open(c_dir.clone(), &garage.config).await;
        let s3 = a.object_store().expect("store");
        let rec = vmon_node::builds::Builds::open(a.data_dir())
            .expect("builds")
            .get(&paused.build_id)
            .expect("read")
            .expect("record");
        let dev = rec.devstate.clone().expect("devstate");
        s3.put_bytes(&format!("artifacts/{dev}"), bytes::Bytes::from_static(b"not it"))
            .await
            .expect("corrupt");
        match start_err(&c, &paused.build_id).await {
            NodeError::Failed(m) => assert!(m.contains("sha256"), "{m}"),
            e => panic!("{e:?}"),
        }
        assert!(files_in(&c_dir.join("builds")).is_empty());
        assert!(files_in(&c_dir.join("store/incoming")).is_empty());
        let swept = c.sweep().await.expect("sweep");
        assert!(swept.is_empty(), "nothing half-fetched was left: {swept:?}");
        assert!(files_in(&c_dir.join("artifacts")).is_empty());
        // A build in neither place is not found, as without a store.
        assert!(matches!(
            c.build_info("p-nowhere").await,
            Err(NodeError::BuildNotFound(_))
        ));

        // Deleting the paused build removes its manifest; the collection then reclaims what
        // only it named and keeps the template's objects.
        b.delete_build(&paused.build_id).await.expect("delete");
        assert!(s3
            .head(&format!("builds/{}.json", paused.build_id))
            .await
            .expect("head")
            .is_none());
        let deleted = a.collect_store(Duration::ZERO).await.expect("collect");
        assert!(deleted.contains(&format!("artifacts/{dev}")), "{deleted:?}");
        let tpl_rec = vmon_node::builds::Builds::open(a.data_dir())
            .expect("builds")
            .get(&tpl)
            .expect("read")
            .expect("record");
        for art in tpl_rec.artifacts() {
            assert!(
                s3.head(&format!("artifacts/{art}")).await.expect("head").is_some(),
                "the template's {art} stays"
            );
        }
    });
}

async fn start_err(node: &Node, build: &str) -> NodeError {
    use vmon_proto::node::{NetworkPolicy, StartSpec};
    match node
        .start(StartSpec {
            egress: Default::default(),
            gpus: 0,
            volumes: Vec::new(),
            sandbox_id: unique("bad"),
            execution_id: unique("e"),
            build_id: build.to_string(),
            cold_boot: false,
            env_vars: Default::default(),
            envd_access_token: None,
            network: NetworkPolicy::default(),
        })
        .await
    {
        Ok(r) => panic!("a start from a corrupt store succeeded: {r:?}"),
        Err(e) => e,
    }
}
