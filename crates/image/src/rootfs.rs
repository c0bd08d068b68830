//! What a foreign root filesystem (an unpacked registry image) is given so that vmon's guest
//! boots in it:
//! - envd as `/usr/local/bin/envd` (the kernel's `init=`). envd is linked against the host's
//!   glibc, which the image may not have (Alpine, an older Debian) or have in another version,
//!   so it comes with its own loader and libraries in [`RUNTIME_DIR`] (`patchelf` points its
//!   interpreter and rpath there); the image's own programs keep their own libraries.
//! - `ip`, which envd's init configures the network with, the same way when the image has none.
//! - the modules of the kernel vmon boots, from the base image's rootfs (`debugfs rdump`).
//! - the `user` account (uid 1000 unless taken) with a home, written into `/etc/passwd`,
//!   `/etc/group` and `/etc/shadow` directly (the image may have no `useradd`); sudo rights only
//!   when the image has sudo, since nothing vmon does needs it (envd runs as root and switches
//!   users itself).
//! - the host name, `/etc/hosts`, `/etc/resolv.conf` and `/etc/fstab` the base image has.
//!
//! The tree is the tenant's and vmon is root: every read and write goes through [`Tree`], and
//! the external programs that write files (`patchelf`, `debugfs rdump`) only ever write into a
//! staging directory vmon made outside the tree, whose results are then moved in through it.

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use crate::oci::run;
use crate::tree::Tree;
use crate::Image;

/// Where a foreign rootfs keeps envd's loader and libraries (and a bundled `ip`'s).
pub const RUNTIME_DIR: &str = "/usr/local/lib/vmon/runtime";
/// Directories envd's init finds `ip` in (its `PATH`).
const INIT_PATH: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];
/// The largest account file (`/etc/passwd`, `/etc/group`, `/etc/shadow`) vmon reads from an
/// image, and the largest file of `/etc/skel` it copies.
const MAX_ACCOUNT_FILE: u64 = 16 << 20;

/// Gives the unpacked image at `root` what vmon's guest needs (see the module's doc);
/// `scratch` is an empty directory of vmon's own on the same file system, for staging.
pub async fn prepare_rootfs(
    root: &Path,
    scratch: &Path,
    base: &Image,
    envd: &Path,
) -> anyhow::Result<()> {
    let tree = Tree::open(root)?;
    if !tree.is_file("/bin/bash")? {
        bail!(
            "the image has no /bin/bash: sandboxes and template steps run every command with \
             bash, so the image must have it"
        );
    }
    for (dir, mode) in [
        ("/proc", 0o555),
        ("/sys", 0o555),
        ("/dev", 0o755),
        ("/run", 0o755),
        ("/root", 0o700),
        ("/tmp", 0o1777),
        ("/etc", 0o755),
        ("/home", 0o755),
    ] {
        tree.ensure_dir(dir, mode)?;
    }
    fresh_dir(scratch)?;
    install_runtime(&tree, scratch, envd).await?;
    install_modules(&tree, scratch, base).await?;
    add_user(&tree)?;
    if tree.is_dir("/etc/sudoers.d")? {
        tree.write(
            "/etc/sudoers.d/90-vmon-user",
            b"user ALL=(ALL:ALL) NOPASSWD: ALL\n",
            0o440,
        )?;
    }
    tree.write("/etc/hostname", b"sandbox\n", 0o644)?;
    tree.write(
        "/etc/hosts",
        b"127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        0o644,
    )?;
    tree.write("/etc/fstab", b"# mounts are made by envd init\n", 0o644)?;
    // Often a link into /run (systemd-resolved) in images: a file of its own here.
    tree.write("/etc/resolv.conf", b"nameserver 8.8.8.8\n", 0o644)?;
    Ok(())
}

/// An empty directory at `path` that only root can enter.
fn fresh_dir(path: &Path) -> anyhow::Result<()> {
    if path.exists() {
        std::fs::remove_dir_all(path).with_context(|| format!("emptying {}", path.display()))?;
    }
    std::fs::create_dir_all(path).with_context(|| format!("making {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))?;
    Ok(())
}

/// envd (and `ip` when the image has none) with their own loader and libraries. The programs
/// are copied and patched in `scratch`, then written into the tree.
async fn install_runtime(tree: &Tree, scratch: &Path, envd: &Path) -> anyhow::Result<()> {
    tree.ensure_dir(RUNTIME_DIR, 0o755)?;
    let mut programs: Vec<(PathBuf, &str)> = vec![(envd.to_path_buf(), "/usr/local/bin/envd")];
    let mut has_ip = false;
    for d in INIT_PATH {
        has_ip |= tree.is_file(&format!("{d}/ip"))?;
    }
    if !has_ip {
        let host_ip = ["/usr/bin/ip", "/usr/sbin/ip", "/sbin/ip", "/bin/ip"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .context("the host has no `ip` to give the image (apt-get install iproute2)")?;
        programs.push((host_ip, "/usr/local/sbin/ip"));
    }
    let mut interpreter = None;
    let mut written = HashSet::new();
    for (src, _) in &programs {
        for (lib, is_loader) in shared_libraries(src).await? {
            let name = lib
                .file_name()
                .and_then(|n| n.to_str())
                .context("a library without a file name")?
                .to_owned();
            if written.insert(name.clone()) {
                tree.copy_in(&format!("{RUNTIME_DIR}/{name}"), &lib, 0o755)
                    .with_context(|| format!("copying {}", lib.display()))?;
            }
            if is_loader {
                interpreter = Some(Path::new(RUNTIME_DIR).join(&name));
            }
            // glibc loads its NSS modules (getpwnam's `files`, `compat`) at run time.
            if name.starts_with("libc.so") {
                if let Some(dir) = lib.parent() {
                    for nss in ["libnss_files.so.2", "libnss_compat.so.2"] {
                        let p = dir.join(nss);
                        if p.is_file() && written.insert(nss.to_string()) {
                            tree.copy_in(&format!("{RUNTIME_DIR}/{nss}"), &p, 0o755)?;
                        }
                    }
                }
            }
        }
    }
    let interpreter = interpreter.context("envd names no ELF interpreter")?;
    for (i, (src, dst)) in programs.iter().enumerate() {
        // patchelf rewrites a file by its path: a copy of vmon's own, never the tree's.
        let staged = scratch.join(format!("program-{i}"));
        std::fs::copy(src, &staged).with_context(|| format!("copying {}", src.display()))?;
        run(
            tokio::process::Command::new("patchelf")
                .arg("--set-interpreter")
                .arg(&interpreter)
                .arg("--force-rpath")
                .arg("--set-rpath")
                .arg(RUNTIME_DIR)
                .arg(&staged),
            "patchelf (apt-get install patchelf)",
        )
        .await?;
        let parent = Path::new(dst)
            .parent()
            .and_then(|p| p.to_str())
            .context("a program's path without a parent")?;
        tree.ensure_dir(parent, 0o755)?;
        tree.copy_in(dst, &staged, 0o755)?;
        let _ = std::fs::remove_file(&staged);
    }
    Ok(())
}

/// The shared libraries `program` loads, as `ldd` finds them on this host (where envd was
/// built), and whether each is the ELF interpreter.
async fn shared_libraries(program: &Path) -> anyhow::Result<Vec<(PathBuf, bool)>> {
    let out = run(tokio::process::Command::new("ldd").arg(program), "ldd").await?;
    let mut libs = Vec::new();
    for line in String::from_utf8_lossy(&out).lines() {
        let line = line.trim();
        if let Some((_, rest)) = line.split_once("=> ") {
            if let Some(path) = rest
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/'))
            {
                libs.push((PathBuf::from(path), false));
            }
        } else if line.starts_with('/') {
            if let Some(path) = line.split_whitespace().next() {
                libs.push((PathBuf::from(path), true));
            }
        }
    }
    Ok(libs)
}

/// The booted kernel's modules, from the base image's rootfs, unless the image has them:
/// `debugfs rdump` writes them into a staging directory, which is then moved into the tree.
async fn install_modules(tree: &Tree, scratch: &Path, base: &Image) -> anyhow::Result<()> {
    let v = &base.manifest.kernel_version;
    if v.is_empty() || v.contains('/') || v.starts_with('.') || v.contains(char::is_whitespace) {
        bail!("the base image's kernel version {v:?} is not a directory name");
    }
    tree.ensure_dir("/lib/modules", 0o755)?;
    let target = format!("/lib/modules/{v}");
    if tree.is_dir(&target)? {
        return Ok(());
    }
    let stage = scratch.join("modules");
    let mut last = String::new();
    for from in [format!("/usr/lib/modules/{v}"), format!("/lib/modules/{v}")] {
        fresh_dir(&stage)?;
        let out = tokio::process::Command::new("debugfs")
            .arg("-R")
            .arg(format!("rdump {from} {}", stage.display()))
            .arg(&base.rootfs)
            .stdin(std::process::Stdio::null())
            .output()
            .await
            .context("running debugfs (apt-get install e2fsprogs)")?;
        if stage.join(v).is_dir() {
            tree.move_in(&stage, v, &target)?;
            let _ = std::fs::remove_dir_all(&stage);
            return Ok(());
        }
        last = String::from_utf8_lossy(&out.stderr).trim().to_string();
    }
    bail!(
        "the kernel's modules ({v}) could not be taken from {}: {last}",
        base.rootfs.display()
    )
}

/// An account file of the image as text (empty when the image has none).
fn account_file(tree: &Tree, path: &str) -> anyhow::Result<String> {
    let bytes = tree.read(path, MAX_ACCOUNT_FILE)?.unwrap_or_default();
    String::from_utf8(bytes).with_context(|| format!("the image's {path} is not UTF-8 text"))
}

/// The `user` account (uid 1000 unless the image uses it) with its group and home.
fn add_user(tree: &Tree) -> anyhow::Result<()> {
    let mut passwd = account_file(tree, "/etc/passwd")?;
    let mut group = account_file(tree, "/etc/group")?;
    let field = |l: &str, i: usize| l.split(':').nth(i).map(str::to_string);
    if !passwd.lines().any(|l| l.starts_with("root:")) {
        passwd.insert_str(0, "root:x:0:0:root:/root:/bin/bash\n");
    }
    if !group.lines().any(|l| l.starts_with("root:")) {
        group.insert_str(0, "root:x:0:\n");
    }
    let (uid, gid) = match passwd.lines().find(|l| l.starts_with("user:")) {
        Some(l) => (
            field(l, 2).and_then(|u| u.parse().ok()).unwrap_or(1000u32),
            field(l, 3).and_then(|g| g.parse().ok()).unwrap_or(1000u32),
        ),
        None => {
            let taken = |text: &str, id: u32| {
                text.lines()
                    .any(|l| field(l, 2).is_some_and(|f| f == id.to_string()))
            };
            let uid = (1000..60000)
                .find(|u| !taken(&passwd, *u) && !taken(&group, *u))
                .unwrap_or(1000);
            append_line(
                &mut passwd,
                &format!("user:x:{uid}:{uid}::/home/user:/bin/bash"),
            );
            if !group.lines().any(|l| l.starts_with("user:")) {
                append_line(&mut group, &format!("user:x:{uid}:"));
            }
            let mut shadow = account_file(tree, "/etc/shadow")?;
            if !shadow.lines().any(|l| l.starts_with("user:")) {
                if !shadow.lines().any(|l| l.starts_with("root:")) {
                    shadow.insert_str(0, "root:*:19000:0:99999:7:::\n");
                }
                append_line(&mut shadow, "user:!:19000:0:99999:7:::");
                tree.write("/etc/shadow", shadow.as_bytes(), 0o640)?;
            }
            (uid, uid)
        }
    };
    tree.write("/etc/passwd", passwd.as_bytes(), 0o644)?;
    tree.write("/etc/group", group.as_bytes(), 0o644)?;
    if !tree.is_dir("/home/user")? {
        tree.ensure_dir("/home/user", 0o755)?;
        tree.copy_files("/etc/skel", "/home/user", MAX_ACCOUNT_FILE)?;
    }
    tree.chown_all("/home/user", uid, gid)?;
    Ok(())
}

fn append_line(text: &mut String, line: &str) {
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
}
