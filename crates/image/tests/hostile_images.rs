//! The hostile-image suite: registry images whose layers aim links, hard links, `..` names,
//! whiteouts and device nodes at canary files this test makes on the host, each pushed to a
//! real `docker-registry` and built by the real `make_disk` (skopeo pull, `umoci unpack` as
//! root, `prepare_rootfs`, `mkfs.ext4 -d`). After every build each canary is as it was
//! (contents, mode, owner, mtime, no new name beside it), and the build either failed with a
//! message naming the path or made a disk that holds the links as links. No VM is booted:
//! nothing here needs one.

mod common;

use std::path::{Path, PathBuf};

use common::{disk_cat, disk_stat, layout, snapshot, tar, Entry, Registry};
use vmon_image::{Image, Manifest};

const KERNEL: &str = "6.0.0-vmon-test";

struct Suite {
    tmp: tempfile::TempDir,
    /// Outside everything the build touches: `secret` (a file) and `dir/inner`.
    canary: PathBuf,
    _canary_dir: tempfile::TempDir,
    registry: Registry,
    base: Image,
}

impl Suite {
    fn new() -> Suite {
        let tmp = tempfile::tempdir().expect("tempdir");
        // A short path, so links to it fit a tar header.
        let canary_dir = tempfile::Builder::new()
            .prefix("vmc")
            .tempdir_in("/tmp")
            .expect("canary");
        let canary = canary_dir.path().to_path_buf();
        std::fs::create_dir(canary.join("dir")).expect("canary");
        std::fs::write(canary.join("secret"), "canary\n").expect("canary");
        std::fs::write(canary.join("dir/inner"), "inner\n").expect("canary");
        let registry = Registry::start(&tmp.path().join("registry"));
        let base = base_image(tmp.path());
        Suite {
            tmp,
            canary,
            _canary_dir: canary_dir,
            registry,
            base,
        }
    }

    fn secret(&self) -> String {
        self.canary.join("secret").display().to_string()
    }

    fn dir(&self) -> String {
        self.canary.join("dir").display().to_string()
    }

    /// A relative link target that climbs out of any tree to the canary's `name`.
    fn up(&self, name: &str) -> String {
        format!("{}{}", "../".repeat(12), self.canary.join(name).display()).replace("//", "/")
    }

    /// Builds the image of `layers` (on top of a minimal base layer) as `name`; the result
    /// and the disk it made. Asserts the canaries did not change.
    async fn build(&self, name: &str, layers: &[Vec<u8>]) -> (anyhow::Result<u32>, PathBuf) {
        let before = snapshot(&self.canary);
        let dir = self.tmp.path().join(name);
        let mut all = vec![base_layer()];
        all.extend_from_slice(layers);
        layout(&dir.join("layout"), &all);
        let reference = self.registry.push(&dir.join("layout"), name);
        let pull = vmon_image::oci::Pull {
            reference: &reference,
            registry: &self.registry.host,
            credentials: None,
            tls_verify: false,
            // The test's registry is on this machine: the operator's setting lists it.
            registry_allow: &["127.0.0.1/32".to_string()],
        };
        let disk = dir.join("disk.img");
        let r = vmon_image::oci::make_disk(
            &pull,
            &self.base,
            Path::new("/usr/bin/true"),
            &dir.join("work"),
            &disk,
            64,
        )
        .await;
        match &r {
            Ok(mb) => eprintln!("{name}: built a {mb} MiB disk"),
            Err(e) => eprintln!("{name}: refused: {e:#}"),
        }
        assert_eq!(snapshot(&self.canary), before, "{name}: a canary changed");
        assert!(!dir.join("work").exists(), "{name}: the work dir is left");
        (r, disk)
    }
}

/// What every image has under its hostile part: `/bin/bash` (never run here) and root.
fn base_layer() -> Vec<u8> {
    tar(&[
        Entry::Dir("bin", 0o755),
        Entry::File("bin/bash", b"#!/bin/sh\n", 0o755),
        Entry::Dir("etc", 0o755),
        Entry::File("etc/passwd", b"root:x:0:0:root:/root:/bin/bash\n", 0o644),
        Entry::File("etc/group", b"root:x:0:\n", 0o644),
        Entry::Dir("usr", 0o755),
        Entry::Dir("usr/local", 0o755),
        Entry::Dir("usr/local/lib", 0o755),
        Entry::Dir("home", 0o755),
        Entry::Dir("lib", 0o755),
        Entry::Dir("opt", 0o755),
    ])
}

/// A base image of vmon's kind for `make_disk`: only its rootfs (the kernel's modules, which
/// `debugfs rdump` takes from it) is read.
fn base_image(tmp: &Path) -> Image {
    let src = tmp.join("base-src");
    let modules = src.join(format!("usr/lib/modules/{KERNEL}"));
    std::fs::create_dir_all(&modules).expect("base");
    std::fs::write(modules.join("modules.dep"), "").expect("base");
    let rootfs = tmp.join("base-rootfs.img");
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&src)
        .arg(&rootfs)
        .arg("16M")
        .output()
        .expect("mkfs.ext4");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Image {
        dir: tmp.to_path_buf(),
        vmlinuz: tmp.join("vmlinuz"),
        initrd: tmp.join("initrd"),
        rootfs,
        manifest: Manifest {
            hash: "0".into(),
            suite: "test".into(),
            mirror: String::new(),
            packages: Vec::new(),
            kernel_version: KERNEL.into(),
            disk_mb: 16,
            envd_sha256: String::new(),
            created_at_unix: 0,
        },
    }
}

fn kind(disk: &Path, path: &str) -> String {
    disk_stat(disk, path).map_or_else(|| "missing".into(), |(k, _)| k)
}

/// 41-link chains (one more than the kernel follows) at each path vmon reads or writes.
#[tokio::test]
async fn chains_past_the_link_budget_fail_naming_the_path_or_stay_links() {
    let s = Suite::new();
    // (path, whether the build must fail, to a file or a directory of the canary)
    let cases: &[(&str, bool, bool)] = &[
        ("/etc/hostname", false, true),
        ("/etc/hosts", false, true),
        ("/etc/resolv.conf", false, true),
        ("/etc/passwd", true, true),
        ("/etc/group", true, true),
        ("/etc/shadow", true, true),
        ("/bin/bash", true, true),
        ("/home/user", true, false),
        ("/etc/sudoers.d", true, false),
        ("/etc/skel", true, false),
        ("/usr/local/bin", true, false),
        ("/usr/local/lib/vmon", true, false),
        ("/lib/modules", true, false),
    ];
    for (i, &(at, fails, to_file)) in cases.iter().enumerate() {
        let target = if to_file { s.secret() } else { s.dir() };
        let names: Vec<String> = (0..41).map(|n| format!("etc/c{n}")).collect();
        let mut entries: Vec<Entry> = (0..40)
            .map(|n| Entry::Symlink(&names[n], &names[n + 1][4..]))
            .collect();
        entries.push(Entry::Symlink(&names[40], &target));
        entries.push(Entry::Symlink(&at[1..], "/etc/c0"));
        let (r, disk) = s.build(&format!("chain{i}"), &[tar(&entries)]).await;
        match r {
            Err(e) => {
                let msg = format!("{e:#}");
                assert!(fails || msg.is_empty(), "{at}: {msg}");
                assert!(
                    msg.contains("more than 40 symbolic links") && msg.contains(at),
                    "{at}: {msg}"
                );
            }
            Ok(_) => {
                assert!(!fails, "{at}: the build went through a 41-link chain");
                // The chain is still a chain; the name vmon writes is a file of the image.
                assert_eq!(kind(&disk, "/etc/c0"), "symlink", "{at}");
                assert_eq!(kind(&disk, "/etc/c40"), "symlink", "{at}");
                assert_eq!(kind(&disk, at), "regular", "{at}");
            }
        }
    }
}

/// Absolute and relative links out of the tree where vmon reads and writes files: followed
/// inside the tree (where nothing is), replaced where vmon writes, kept as links elsewhere.
#[tokio::test]
async fn escaping_links_are_resolved_inside_the_image() {
    let s = Suite::new();
    let (secret, dir) = (s.secret(), s.dir());
    let (up_secret, up_dir) = (s.up("secret"), s.up("dir"));
    let proc_secret = format!("/proc/self/root{secret}");
    let layer = tar(&[
        Entry::Symlink("etc/hostname", &secret),
        Entry::Symlink("etc/hosts", &up_secret),
        Entry::Symlink("etc/passwd", &secret),
        Entry::Symlink("etc/group", &up_secret),
        Entry::Symlink("etc/shadow", &proc_secret),
        Entry::Symlink("etc/resolv.conf", &secret),
        Entry::Symlink("etc/fstab", &up_secret),
        Entry::Symlink("etc/sudoers.d", &dir),
        Entry::Symlink("etc/skel", &up_dir),
        Entry::Symlink("opt/root", "../../../../../../.."),
        // Resolves inside the image to its own /bin: envd lands there.
        Entry::Symlink("usr/local/bin", "../../../../../bin"),
    ]);
    let (r, disk) = s.build("escapes", &[layer]).await;
    r.expect("an image whose links lead nowhere inside it builds");
    for p in ["/etc/sudoers.d", "/etc/skel", "/opt/root", "/usr/local/bin"] {
        assert_eq!(kind(&disk, p), "symlink", "{p}");
    }
    for p in [
        "/etc/hostname",
        "/etc/hosts",
        "/etc/passwd",
        "/etc/group",
        "/etc/shadow",
    ] {
        assert_eq!(kind(&disk, p), "regular", "{p}");
    }
    assert_eq!(disk_cat(&disk, "/etc/hostname"), b"sandbox\n");
    let passwd = String::from_utf8(disk_cat(&disk, "/etc/passwd")).expect("utf-8");
    assert!(passwd.contains("user:x:1000:1000::/home/user"), "{passwd}");
    assert!(!passwd.contains("canary"), "{passwd}");
    assert_eq!(kind(&disk, "/bin/envd"), "regular");
    assert_eq!(kind(&disk, "/home/user"), "directory");
    assert_eq!(
        kind(&disk, &format!("/lib/modules/{KERNEL}/modules.dep")),
        "regular"
    );
}

/// Links out of the tree where vmon makes a directory: nothing to make it in, a clear failure.
#[tokio::test]
async fn escaping_links_where_directories_are_made_fail_cleanly() {
    let s = Suite::new();
    let (dir, up_dir) = (s.dir(), s.up("dir"));
    let cases: [(&str, &str); 4] = [
        ("home/user", &dir),
        ("lib/modules", &up_dir),
        ("usr/local/lib/vmon", &dir),
        ("etc", &dir),
    ];
    for (i, (at, target)) in cases.iter().enumerate() {
        // `etc` itself: the base layer's directory is replaced by the link.
        let layer = tar(&[Entry::Symlink(at, target)]);
        let (r, _) = s.build(&format!("dirs{i}"), &[layer]).await;
        let msg = format!("{:#}", r.expect_err("nothing to make the directory in"));
        assert!(
            msg.contains("is a symbolic link to nothing") && msg.contains(&format!("/{at}")),
            "{at}: {msg}"
        );
    }
}

/// What only a hand-made layer holds: hard links to host paths, `..` names, writes and
/// whiteouts through links, device nodes and setuid files. umoci keeps them in the bundle.
#[tokio::test]
async fn layer_tricks_stay_in_the_bundle() {
    let s = Suite::new();
    let (secret, dir) = (s.secret(), s.dir());
    let rel = secret.trim_start_matches('/');
    let dir_rel = dir.trim_start_matches('/');

    for (i, target) in [secret.clone(), s.up("secret")].iter().enumerate() {
        let layer = tar(&[Entry::HardLink("etc/hard", target)]);
        let (r, disk) = s.build(&format!("hard{i}"), &[layer]).await;
        if r.is_ok() {
            assert_ne!(disk_cat(&disk, "/etc/hard"), b"canary\n", "{target}");
        }
    }

    // The same link with the name it gives made inside the image first: the link is to that.
    let layer = tar(&[
        Entry::Dir("tmp", 0o1777),
        Entry::Dir(&dir_rel[..dir_rel.rfind('/').unwrap_or(0)], 0o755),
        Entry::File(rel, b"inside\n", 0o644),
        Entry::HardLink("etc/hard", &secret),
    ]);
    let (r, disk) = s.build("hard-inside", &[layer]).await;
    r.expect("a hard link to a name inside the image");
    assert_eq!(disk_cat(&disk, "/etc/hard"), b"inside\n");

    let dotdot = format!("../../../../../../{dir_rel}/dotdot");
    let inner_dotdot = format!("etc/../../../../{dir_rel}/dotdot2");
    let (r, disk) = s
        .build(
            "dotdot",
            &[tar(&[
                Entry::File(&dotdot, b"x\n", 0o644),
                Entry::File(&inner_dotdot, b"x\n", 0o644),
            ])],
        )
        .await;
    // Clamped at the image's root: the names exist inside it.
    r.expect("`..` names are clamped");
    for name in ["dotdot", "dotdot2"] {
        assert_eq!(kind(&disk, &format!("/{dir_rel}/{name}")), "regular");
    }

    let wh_secret = format!("../../../../../../{}", rel.replace("secret", ".wh.secret"));
    let first = tar(&[
        Entry::File("etc/removed", b"x\n", 0o644),
        Entry::Dir("opt/gone", 0o755),
        Entry::File("opt/gone/f", b"x\n", 0o644),
        Entry::Symlink("etc/lnk", &dir),
        Entry::Symlink("etc/wl", &dir),
    ]);
    let second = tar(&[
        Entry::File("etc/.wh.removed", b"", 0o644),
        Entry::File("opt/gone/.wh..wh..opq", b"", 0o644),
        Entry::File("etc/wl/.wh.inner", b"", 0o644),
        Entry::File(&wh_secret, b"", 0o644),
        Entry::File("etc/lnk/planted", b"x\n", 0o644),
    ]);
    let (r, disk) = s.build("whiteouts", &[first, second]).await;
    r.expect("whiteouts and writes through links stay in the image");
    assert_eq!(kind(&disk, "/etc/removed"), "missing");
    assert_eq!(kind(&disk, "/opt/gone/f"), "missing");
    assert_eq!(kind(&disk, "/etc/lnk"), "symlink");
    assert_eq!(kind(&disk, &format!("/{dir_rel}/planted")), "regular");

    let devices = tar(&[
        Entry::Dir("dev", 0o755),
        Entry::CharDevice("dev/evil-mem", 1, 1),
        Entry::BlockDevice("dev/evil-disk", 8, 0),
        Entry::Dir("usr/bin", 0o755),
        Entry::File("usr/bin/su", b"#!/bin/sh\n", 0o4755),
    ]);
    let (r, disk) = s.build("devices", &[devices]).await;
    r.expect("device nodes and setuid files are the guest's own");
    assert!(kind(&disk, "/dev/evil-mem").starts_with("character"));
    assert!(kind(&disk, "/dev/evil-disk").starts_with("block"));
    let (_, mode) = disk_stat(&disk, "/usr/bin/su").expect("su");
    assert_eq!(mode & 0o7777, 0o4755);

    // A device node where vmon reads a file: never opened, a clear failure.
    let (r, _) = s
        .build(
            "device-passwd",
            &[tar(&[Entry::CharDevice("etc/passwd", 1, 1)])],
        )
        .await;
    let msg = format!("{:#}", r.expect_err("a device is not an account file"));
    assert!(msg.contains("/etc/passwd is not a regular file"), "{msg}");
}
