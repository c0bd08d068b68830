//! The tree against the links a hostile image has, each aimed at canary files this test makes
//! on the host beside the tree: after every operation the canaries are as they were.

use std::collections::BTreeMap;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::*;

/// Each canary's contents (files), mode, owner and mtime.
type Canaries = BTreeMap<PathBuf, (Vec<u8>, u32, u32, u32, i64, i64)>;

/// A tree and, outside it, a canary directory with a file and a subdirectory.
struct Scene {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    canary: PathBuf,
}

impl Scene {
    fn new() -> Scene {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("tree");
        let canary = tmp.path().join("canary");
        for d in ["etc", "home", "usr/local/bin"] {
            std::fs::create_dir_all(root.join(d)).expect("tree");
        }
        std::fs::create_dir_all(canary.join("dir")).expect("canary");
        std::fs::write(canary.join("secret"), "canary\n").expect("canary");
        std::fs::set_permissions(
            canary.join("secret"),
            std::fs::Permissions::from_mode(0o640),
        )
        .expect("canary");
        std::fs::write(canary.join("dir/inner"), "inner\n").expect("canary");
        Scene {
            _tmp: tmp,
            root,
            canary,
        }
    }

    fn tree(&self) -> Tree {
        Tree::open(&self.root).expect("open the tree")
    }

    /// A link at `at` (a guest path) to `target`.
    fn link(&self, at: &str, target: impl AsRef<Path>) {
        let p = self.root.join(at.trim_start_matches('/'));
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).expect("link's parent");
        }
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir_all(&p);
        symlink(target, p).expect("symlink");
    }

    /// `/etc/chain0 -> chain1 -> … -> chain{n-1} -> target`, and `at` linked to its start.
    fn chain(&self, at: &str, n: usize, target: impl AsRef<Path>) {
        for i in 0..n - 1 {
            self.link(&format!("/etc/chain{i}"), format!("chain{}", i + 1));
        }
        self.link(&format!("/etc/chain{}", n - 1), target);
        self.link(at, "/etc/chain0");
    }

    /// A relative target from the guest directory `from` that climbs out of the tree to the
    /// canary `name`.
    fn escape(&self, name: &str) -> String {
        format!("{}{}/{name}", "../".repeat(30), self.canary.display())
    }

    /// Every name under the canary directory with its contents, mode, owner and mtime.
    fn canaries(&self) -> Canaries {
        let mut out = BTreeMap::new();
        let mut todo = vec![self.canary.clone()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).expect("canary dir").flatten() {
                let m = std::fs::symlink_metadata(e.path()).expect("canary");
                let bytes = if m.is_file() {
                    std::fs::read(e.path()).expect("canary")
                } else {
                    todo.push(e.path());
                    Vec::new()
                };
                out.insert(
                    e.path(),
                    (bytes, m.mode(), m.uid(), m.gid(), m.mtime(), m.mtime_nsec()),
                );
            }
        }
        let m = std::fs::metadata(&self.canary).expect("canary");
        out.insert(
            self.canary.clone(),
            (Vec::new(), m.mode(), m.uid(), m.gid(), m.mtime(), 0),
        );
        out
    }
}

fn in_tree(s: &Scene, path: &str) -> std::fs::Metadata {
    std::fs::symlink_metadata(s.root.join(path.trim_start_matches('/'))).expect(path)
}

#[test]
fn a_link_that_is_the_last_name_is_replaced_never_followed() {
    let s = Scene::new();
    let before = s.canaries();
    s.link("/etc/hostname", s.canary.join("secret"));
    s.link("/etc/hosts", s.escape("secret"));
    s.link("/etc/new", s.canary.join("dir/new"));
    let t = s.tree();
    // Read as the guest would: inside the tree, where nothing is at the target.
    assert_eq!(t.read("/etc/hostname", 1 << 20).expect("read"), None);
    assert_eq!(t.read("/etc/hosts", 1 << 20).expect("read"), None);
    for p in ["/etc/hostname", "/etc/hosts", "/etc/new"] {
        t.write(p, b"sandbox\n", 0o644).expect("write");
        let m = in_tree(&s, p);
        assert!(m.is_file(), "{p} is a file of the tree now");
        assert_eq!(m.mode() & 0o7777, 0o644);
    }
    t.remove("/etc/hostname").expect("remove");
    s.link("/etc/resolv.conf", s.canary.join("secret"));
    t.remove("/etc/resolv.conf").expect("remove the link");
    assert_eq!(s.canaries(), before);
}

#[test]
fn an_escaping_link_at_any_component_stays_in_the_tree() {
    let path = "/usr/local/bin/envd";
    let names: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    for k in 0..names.len() {
        for absolute in [true, false] {
            let s = Scene::new();
            let before = s.canaries();
            let at = format!("/{}", names[..=k].join("/"));
            let target = if absolute {
                s.canary.join("dir").display().to_string()
            } else {
                s.escape("dir")
            };
            s.link(&at, &target);
            let t = s.tree();
            let r = t.write(path, b"x", 0o755);
            if k + 1 == names.len() {
                r.expect("the last name is replaced");
            } else {
                let e = r.expect_err("the tree has nothing at the link's target");
                assert!(e.to_string().contains("the image's"), "{e}");
            }
            let _ = t.ensure_dir(&at, 0o755);
            let _ = t.chown_all(&at, 4242, 4242);
            assert_eq!(s.canaries(), before, "a link at {at} -> {target}");
        }
    }
}

#[test]
fn a_chain_longer_than_the_link_budget_fails_naming_the_path() {
    for (at, op) in [
        ("/etc/passwd", "read"),
        ("/home/user", "ensure_dir"),
        ("/etc/sudoers.d", "write"),
        ("/usr/local/bin", "is_dir"),
    ] {
        let s = Scene::new();
        let before = s.canaries();
        // 41 links: one more than the kernel's budget of 40.
        let target = if op == "read" {
            s.canary.join("secret")
        } else {
            s.canary.join("dir")
        };
        s.chain(at, 41, &target);
        let t = s.tree();
        let e = match op {
            "read" => t.read(at, 1 << 20).map(|_| ()),
            "ensure_dir" => t.ensure_dir(at, 0o755).map(|_| ()),
            "write" => t.write(&format!("{at}/90-vmon-user"), b"x", 0o440),
            _ => t.is_dir(at).map(|_| ()),
        }
        .expect_err("the budget runs out");
        assert!(matches!(e, TreeError::LinkBudget(_)), "{at}: {e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains(at) && msg.contains("40 symbolic links"),
            "{msg}"
        );
        assert_eq!(s.canaries(), before);
    }
    // Within the budget, a chain is followed inside the tree.
    let s = Scene::new();
    s.chain("/etc/hosts", 30, "/etc/real-hosts");
    std::fs::write(s.root.join("etc/real-hosts"), "ok\n").expect("file");
    let t = s.tree();
    assert_eq!(
        t.read("/etc/hosts", 1 << 20).expect("read"),
        Some(b"ok\n".to_vec())
    );
}

#[test]
fn dot_dot_stops_at_the_root_of_the_tree() {
    let s = Scene::new();
    let before = s.canaries();
    s.link("/etc/up", "../../../../../..");
    let t = s.tree();
    t.write("/etc/up/written-at-the-root", b"x", 0o644)
        .expect("write through ..");
    assert!(in_tree(&s, "/written-at-the-root").is_file());
    assert!(!s
        .root
        .parent()
        .expect("parent")
        .join("written-at-the-root")
        .exists());
    // vmon's own paths never hold `..`.
    assert!(t.write("/etc/../../x", b"x", 0o644).is_err());
    assert!(t.ensure_dir("etc", 0o755).is_err(), "a relative path");
    assert_eq!(s.canaries(), before);
}

#[test]
fn a_link_through_proc_self_never_reaches_the_host() {
    let s = Scene::new();
    let before = s.canaries();
    let via_proc = format!("/proc/self/root{}", s.canary.join("secret").display());
    let via_proc_dir = format!("/proc/self/root{}", s.canary.join("dir").display());
    s.link("/etc/passwd", &via_proc);
    s.link("/etc/sudoers.d", &via_proc_dir);
    s.link("/etc/cwd", "/proc/self/cwd");
    let t = s.tree();
    assert_eq!(t.read("/etc/passwd", 1 << 20).expect("read"), None);
    assert!(!t.is_dir("/etc/sudoers.d").expect("is_dir"));
    assert!(t.write("/etc/sudoers.d/90-vmon-user", b"x", 0o440).is_err());
    assert!(t.write("/etc/cwd/x", b"x", 0o644).is_err());
    t.write("/etc/passwd", b"root:x:0:0::/root:/bin/bash\n", 0o644)
        .expect("the link is replaced");
    assert_eq!(s.canaries(), before);
}

#[test]
fn chown_changes_links_themselves_and_leaves_other_names_of_a_file_alone() {
    let s = Scene::new();
    let before = s.canaries();
    let home = s.root.join("home/user");
    std::fs::create_dir_all(home.join("sub")).expect("home");
    std::fs::write(home.join("own"), "mine\n").expect("home");
    symlink(s.canary.join("secret"), home.join("abs")).expect("link");
    symlink(s.escape("dir"), home.join("sub/rel")).expect("link");
    // What a hard link out of the tree would be (umoci keeps them in; this is the fallback).
    std::fs::hard_link(s.canary.join("secret"), home.join("hard")).expect("hard link");
    let t = s.tree();
    t.chown_all("/home/user", 4242, 4243).expect("chown");
    for p in [
        "/home/user",
        "/home/user/own",
        "/home/user/abs",
        "/home/user/sub/rel",
    ] {
        let m = in_tree(&s, p);
        assert_eq!((m.uid(), m.gid()), (4242, 4243), "{p}");
    }
    assert_eq!(s.canaries(), before);
}

#[test]
fn skel_copies_only_regular_files_and_device_files_are_never_read() {
    let s = Scene::new();
    let before = s.canaries();
    std::fs::create_dir_all(s.root.join("etc/skel")).expect("skel");
    std::fs::write(s.root.join("etc/skel/.bashrc"), "rc\n").expect("skel");
    symlink(s.canary.join("secret"), s.root.join("etc/skel/.profile")).expect("link");
    std::fs::create_dir_all(s.root.join("home/user")).expect("home");
    let t = s.tree();
    t.copy_files("/etc/skel", "/home/user", 1 << 20)
        .expect("copy");
    assert_eq!(
        std::fs::read(s.root.join("home/user/.bashrc")).expect("copied"),
        b"rc\n"
    );
    assert!(!s.root.join("home/user/.profile").exists());
    // A FIFO where the image's /etc/group should be: an error, not a read that hangs.
    let fifo = s.root.join("etc/group");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: mkfifo with a NUL-terminated path; no memory is kept.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let e = t.read("/etc/group", 1 << 20).expect_err("not a file");
    assert!(matches!(e, TreeError::NotAFile(_)), "{e:?}");
    // Larger than the limit: refused before anything is kept.
    std::fs::write(s.root.join("etc/big"), vec![b'x'; 100]).expect("big");
    assert!(matches!(
        t.read("/etc/big", 10),
        Err(TreeError::TooLarge { .. })
    ));
    assert_eq!(s.canaries(), before);
}

#[test]
fn a_dangling_link_where_a_directory_is_made_fails_clearly() {
    let s = Scene::new();
    let before = s.canaries();
    s.link("/home/user", s.canary.join("dir/none"));
    let e = s
        .tree()
        .ensure_dir("/home/user", 0o755)
        .expect_err("dangling");
    assert!(matches!(e, TreeError::DanglingLink(_)), "{e:?}");
    assert!(e.to_string().contains("/home/user"), "{e}");
    let t = s.tree();
    let made = t.ensure_dir("/tmp/a/b", 0o1777).expect("made");
    let m = rustix::fs::fstat(&made).expect("fstat");
    assert_eq!(m.st_mode & 0o7777, 0o1777);
    assert_eq!(in_tree(&s, "/tmp/a").mode() & 0o777, 0o755);
    assert_eq!(s.canaries(), before);
}
