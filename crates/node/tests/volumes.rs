//! Volumes in real guests: each volume's virtiofsd runs as an unprivileged uid of the volume's
//! own id range, in a user namespace, inside its sandbox's cgroups; the guest (as root) still
//! creates, writes, chmods, chowns, renames and deletes; two sandboxes mounting the volume see
//! each other's writes; a guest's setuid-root file is not setuid root on the host.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use common::{host_lock, node, runtime, sh, template, unique};
use vmon_proto::node::{NetworkPolicy, NodeCalls, StartSpec, VolumeShare};

fn volumes_dir() -> PathBuf {
    std::env::var_os("VMON_VOLUMES_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| common::data_dir().join("volumes"))
}

async fn start_with_volume(
    node: &vmon_node::Node,
    id: &str,
    build: &str,
    volume: &str,
) -> vmon_proto::node::Running {
    node.start(StartSpec {
        egress: Default::default(),
        gpus: 0,
        volumes: vec![VolumeShare {
            volume_id: volume.to_string(),
            path: "/mnt/v".into(),
            ..Default::default()
        }],
        sandbox_id: id.to_string(),
        execution_id: unique("e"),
        build_id: build.to_string(),
        cold_boot: true,
        env_vars: Default::default(),
        envd_access_token: Some(format!("tok-{id}")),
        network: NetworkPolicy::default(),
    })
    .await
    .unwrap_or_else(|e| panic!("start {id} with volume {volume}: {e}"))
}

/// The virtiofsd processes whose user namespace maps the range at `base`.
fn daemons_of(base: u32) -> Vec<u32> {
    let want = format!("0 {base} 65536");
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !cmdline.windows(9).any(|w| w == b"virtiofsd") {
            continue;
        }
        let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap_or_default();
        if map.split_whitespace().collect::<Vec<_>>().join(" ") == want {
            pids.push(pid);
        }
    }
    pids
}

fn status_field(pid: u32, name: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The groups `pid` is in, one per controller (v1) or its one v2 group.
fn groups_of(pid: u32) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        let path = text
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("v2 line");
        return vec![Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'))];
    }
    ["memory", "cpu", "pids"]
        .iter()
        .map(|c| {
            let path = text
                .lines()
                .find_map(|l| {
                    let mut p = l.splitn(3, ':');
                    let (_, ctrls, path) = (p.next()?, p.next()?, p.next()?);
                    ctrls.split(',').any(|x| x == *c).then_some(path)
                })
                .expect("v1 line");
            Path::new("/sys/fs/cgroup")
                .join(c)
                .join(path.trim_start_matches('/'))
        })
        .collect()
}

/// The QEMU processes in group `dir`.
fn qemus_in(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.windows(11).any(|w| w == b"qemu-system"))
        })
        .collect()
}

#[test]
fn volume_daemons_are_unprivileged_in_their_sandboxes_cgroups_and_guests_keep_full_use() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let vol = unique("vol-");
        let vols = volumes_dir();
        std::fs::create_dir_all(&vols).expect("volumes dir");
        std::fs::set_permissions(&vols, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let dir = vols.join(&vol);
        // As the api makes a volume, with a file its content plane wrote before any mount.
        std::fs::create_dir(&dir).expect("volume dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        std::fs::write(dir.join("before"), "from the content plane").expect("file");
        std::os::unix::fs::chown(dir.join("before"), Some(9090), Some(9090)).expect("chown");

        let (ida, idb) = (unique("vola"), unique("volb"));
        let a = start_with_volume(&node, &ida, &tpl, &vol).await;
        let b = start_with_volume(&node, &idb, &tpl, &vol).await;

        // The volume got an id range; what it held moved into it.
        let base = std::fs::metadata(&dir).expect("meta").uid();
        assert!(base >= 65_536, "the volume's root is owned by {base}");
        assert_eq!(
            std::fs::metadata(dir.join("before")).expect("meta").uid(),
            base + 9090
        );
        assert_eq!(
            sh(&node, &ida, "stat -c '%u %g' /mnt/v/before").await,
            "9090 9090"
        );

        // Two daemons (one per sandbox), each unprivileged on the host: the range's base as
        // every uid and gid, no supplementary group, in a user namespace of its own whose map
        // holds no host id below the base (its capabilities count only there).
        // Each daemon forks once into its PID namespace (the parent waits): count the
        // parents, check them all.
        let daemons = daemons_of(base);
        let parent_of = |pid: u32| -> u32 {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().nth(1))
                .and_then(|p| p.parse().ok())
                .unwrap_or(0)
        };
        let tops = daemons
            .iter()
            .filter(|&&p| !daemons.contains(&parent_of(p)))
            .count();
        assert_eq!(tops, 2, "one daemon per sandbox: {daemons:?}");
        let own_ns = std::fs::read_link("/proc/self/ns/user").expect("ns");
        let mut qemus = Vec::new();
        for &pid in &daemons {
            let all = |v: u32| vec![v.to_string(); 4].join(" ");
            assert_eq!(status_field(pid, "Uid:"), all(base), "daemon {pid}");
            assert_eq!(status_field(pid, "Gid:"), all(base), "daemon {pid}");
            assert_eq!(status_field(pid, "Groups:"), "", "daemon {pid}");
            let ns = std::fs::read_link(format!("/proc/{pid}/ns/user")).expect("ns");
            assert_ne!(ns, own_ns, "daemon {pid} is in the host's user namespace");
            // In every group of a sandbox's QEMU, with that QEMU.
            let groups = groups_of(pid);
            let mut its: Vec<u32> = Vec::new();
            for g in &groups {
                assert!(
                    g.parent().is_some_and(|p| p.ends_with("vmon")),
                    "daemon {pid} is in {}",
                    g.display()
                );
                let q = qemus_in(g);
                assert_eq!(q.len(), 1, "one QEMU in {}: {q:?}", g.display());
                its.extend(q);
            }
            its.dedup();
            assert_eq!(its.len(), 1, "the same QEMU in every group: {its:?}");
            qemus.push(its[0]);
        }
        qemus.sort();
        qemus.dedup();
        assert_eq!(
            qemus.len(),
            2,
            "each daemon sits with its own sandbox: {qemus:?}"
        );

        // The guest, as root, does everything a filesystem offers.
        let out = sh(
            &node,
            &ida,
            "set -e; cd /mnt/v; echo hello > f; echo more >> f; chmod 640 f; chown 1000:1000 f; \
             mv f g; mkdir d; touch d/x; rm d/x; rmdir d; echo gone > t; rm t; \
             cp /bin/true suid; chmod 4755 suid; stat -c '%u %g %a' g suid",
        )
        .await;
        assert_eq!(out, "1000 1000 640\n0 0 4755");
        let g = std::fs::metadata(dir.join("g")).expect("g");
        assert_eq!(
            (g.uid(), g.gid(), g.mode() & 0o7777),
            (base + 1000, base + 1000, 0o640)
        );
        assert!(!dir.join("f").exists() && !dir.join("d").exists() && !dir.join("t").exists());
        let suid = std::fs::metadata(dir.join("suid")).expect("suid");
        assert_eq!(suid.mode() & 0o4000, 0o4000, "the guest's mode is kept");
        assert_eq!(
            suid.uid(),
            base,
            "setuid to the range's base, never to root"
        );

        // The other sandbox sees those writes, and its own are seen.
        assert_eq!(sh(&node, &idb, "cat /mnt/v/g").await, "hello\nmore");
        sh(&node, &idb, "echo from-b > /mnt/v/h").await;
        assert_eq!(sh(&node, &ida, "cat /mnt/v/h").await, "from-b");

        node.kill(&ida, &a.execution_id).await.expect("kill a");
        node.kill(&idb, &b.execution_id).await.expect("kill b");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !daemons_of(base).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "daemons outlived their sandboxes"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}
