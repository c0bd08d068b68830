//! Root filesystems from OCI registries (a template's `from_image(...)`): the image is pulled
//! with `skopeo` (by digest), flattened with `umoci unpack`, given what vmon's guest needs, and
//! made into a sparse raw ext4 like the base image's rootfs.
//!
//! What a foreign root filesystem is given:
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
//! Registry credentials reach skopeo in an auth file that exists only in memory (a `memfd`
//! handed to the child as fd 3), never on its command line, in a log or on disk.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use sha2::{Digest, Sha256};

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
/// How long one registry operation may take (a pull of a large image included).
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(1800);

/// Where to pull from and how.
#[derive(Debug, Clone, Copy)]
pub struct Pull<'a> {
    /// A fully qualified reference (`host[:port]/repository[:tag|@digest]`).
    pub reference: &'a str,
    /// The registry's `host[:port]` (for the auth file and messages).
    pub registry: &'a str,
    pub credentials: Option<&'a vmon_proto::node::RegistryCredentials>,
    /// `false`: plain HTTP and unverified TLS are allowed.
    pub tls_verify: bool,
    /// CIDRs of private, loopback or link-local addresses (or this host's own) the pull may
    /// reach: the operator's `registry_allow` ([`crate::registry_net`]).
    pub registry_allow: &'a [String],
}

/// Why a registry operation failed, as a sentence that names the registry and the image.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RegistryError(pub String);

/// The digest (`sha256:…`) of the manifest `pull.reference` names: the registry's answer
/// hashed as it came, so a tag that moves gives another digest.
pub async fn resolve_digest(pull: &Pull<'_>) -> Result<String, RegistryError> {
    let tls = format!("--tls-verify={}", pull.tls_verify);
    let src = format!("docker://{}", pull.reference);
    let out = skopeo(
        pull,
        &["inspect", "--raw", &tls, "--authfile", AUTH_FD_PATH, &src],
    )
    .await?;
    Ok(format!("sha256:{}", hex::encode(Sha256::digest(&out))))
}

/// Pulls `pull.reference`, flattens it and writes the raw ext4 `out` of at least `min_disk_mb`
/// MiB (more when the image needs it); `work` is a scratch directory, removed afterwards.
/// Returns the disk's size in MiB.
pub async fn make_disk(
    pull: &Pull<'_>,
    base: &Image,
    envd: &Path,
    work: &Path,
    out: &Path,
    min_disk_mb: u32,
) -> anyhow::Result<u32> {
    if work.exists() {
        std::fs::remove_dir_all(work)?;
    }
    std::fs::create_dir_all(work)?;
    let r = async {
        let layout = work.join("layout");
        let tls = format!("--src-tls-verify={}", pull.tls_verify);
        let src = format!("docker://{}", pull.reference);
        let dst = format!("oci:{}:image", layout.display());
        skopeo(
            pull,
            &[
                "copy",
                "--quiet",
                &tls,
                "--src-authfile",
                AUTH_FD_PATH,
                &src,
                &dst,
            ],
        )
        .await?;
        let bundle = work.join("bundle");
        run(
            tokio::process::Command::new("umoci")
                .arg("unpack")
                .arg("--image")
                .arg(format!("{}:image", layout.display()))
                .arg(&bundle),
            "umoci unpack (apt-get install umoci)",
        )
        .await?;
        let _ = std::fs::remove_dir_all(&layout);
        let root = bundle.join("rootfs");
        prepare_rootfs(&root, base, envd).await?;
        let used_mb = du_mb(&root).await?;
        // Room for what the template's steps install, like the base image's disk.
        let disk_mb = min_disk_mb.max((used_mb * 2 + 1024).min(u64::from(u32::MAX)) as u32);
        run(
            tokio::process::Command::new("mkfs.ext4")
                .args(["-q", "-F", "-L", "rootfs", "-E", "root_owner=0:0", "-d"])
                .arg(&root)
                .arg(out)
                .arg(format!("{disk_mb}M")),
            "mkfs.ext4",
        )
        .await?;
        std::fs::File::open(out)?.sync_all()?;
        anyhow::Ok(disk_mb)
    }
    .await;
    let _ = std::fs::remove_dir_all(work);
    if r.is_err() {
        let _ = std::fs::remove_file(out);
    }
    r
}

/// The auth file's path as skopeo sees it (fd 3 is the memfd, see [`skopeo`]).
const AUTH_FD_PATH: &str = "/proc/self/fd/3";

/// Runs skopeo with the auth file of `pull` on fd 3, in a network namespace that reaches only
/// vetted addresses ([`crate::registry_net::PullNet`]; the registry is vetted before skopeo
/// starts); stdout on success, else the failure as a sentence about the registry.
async fn skopeo(pull: &Pull<'_>, args: &[&str]) -> Result<Vec<u8>, RegistryError> {
    let policy =
        crate::registry_net::RegistryPolicy::new(pull.registry_allow).map_err(RegistryError)?;
    let net = crate::registry_net::PullNet::open(policy, pull.registry).await?;
    let netns = net.netns_fd();
    let auth = auth_memfd(pull).map_err(|e| {
        RegistryError(format!(
            "preparing the login for the registry {}: {e}",
            pull.registry
        ))
    })?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&auth);
    let mut cmd = tokio::process::Command::new("skopeo");
    for var in ["NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"] {
        cmd.env_remove(var);
    }
    for var in ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
        cmd.env(var, net.proxy_url());
    }
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // SAFETY: between fork and exec only dup2 and setns run, both async-signal-safe system
    // calls: dup2 puts the memfd (close-on-exec in this process) at fd 3 of the child without
    // close-on-exec, setns moves the child into the pull's network namespace.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::setns(netns, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| RegistryError(format!("running skopeo (apt-get install skopeo): {e}")))?;
    let out = tokio::time::timeout(REGISTRY_TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| {
            RegistryError(format!(
                "the registry {} did not answer for {} within {} s",
                pull.registry,
                pull.reference,
                REGISTRY_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|e| RegistryError(format!("running skopeo: {e}")))?;
    drop(auth);
    if out.status.success() {
        return Ok(out.stdout);
    }
    if let Some(refused) = net.refusal() {
        return Err(RegistryError(format!(
            "pulling {} from the registry {} went to a refused destination: {refused}",
            pull.reference, pull.registry
        )));
    }
    Err(RegistryError(explain(
        pull,
        &String::from_utf8_lossy(&out.stderr),
    )))
}

/// A skopeo failure as a sentence: which registry, which image, and what skopeo said last.
fn explain(pull: &Pull<'_>, stderr: &str) -> String {
    let last = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("no output");
    // skopeo's fatal line is `time=… level=fatal msg="…"`: only the message is worth showing.
    let said = match last.split_once("msg=\"") {
        Some((_, m)) => m.strip_suffix('"').unwrap_or(m).replace("\\\"", "\""),
        None => last.to_string(),
    };
    let low = said.to_ascii_lowercase();
    let (reg, image) = (pull.registry, pull.reference);
    let what = if low.contains("unauthorized")
        || low.contains("authentication required")
        || low.contains("denied")
    {
        match pull.credentials {
            Some(c) => format!(
                "the registry {reg} refused the credentials of {:?} for {image}",
                c.username
            ),
            None => format!("the registry {reg} needs credentials for {image}"),
        }
    } else if low.contains("manifest unknown")
        || low.contains("name unknown")
        || low.contains("not found")
    {
        format!("the registry {reg} has no image {image}")
    } else if low.contains("connection refused")
        || low.contains("no such host")
        || low.contains("dial tcp")
        || low.contains("timeout")
        || low.contains("network is unreachable")
        || low.contains("pinging container registry")
        || low.contains("http response to https client")
        || low.contains("x509")
        || low.contains("tls")
    {
        format!("the registry {reg} cannot be reached for {image}")
    } else {
        format!("pulling {image} from the registry {reg} failed")
    };
    format!("{what} ({})", cut(&said, 600))
}

fn cut(s: &str, n: usize) -> &str {
    if s.len() <= n {
        return s;
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A memory-only file holding the containers auth file for `pull` (`{}` without credentials,
/// so the host's own logins are never used).
fn auth_memfd(pull: &Pull<'_>) -> std::io::Result<std::fs::File> {
    let name = c"vmon-registry-auth";
    // SAFETY: `name` is NUL-terminated; the returned descriptor is owned by the File below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nothing else.
    let mut f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let body = match pull.credentials {
        Some(c) => {
            let auth = base64::engine::general_purpose::STANDARD
                .encode(format!("{}:{}", c.username, c.password));
            serde_json::json!({"auths": {pull.registry: {"auth": auth}}})
        }
        None => serde_json::json!({"auths": {}}),
    };
    f.write_all(body.to_string().as_bytes())?;
    Ok(f)
}

async fn run(cmd: &mut tokio::process::Command, what: &str) -> anyhow::Result<Vec<u8>> {
    let out = cmd
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

async fn du_mb(root: &Path) -> anyhow::Result<u64> {
    let out = run(
        tokio::process::Command::new("du").args(["-sxm"]).arg(root),
        "du",
    )
    .await?;
    Ok(String::from_utf8_lossy(&out)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0))
}

/// `path` (absolute, in the guest) inside `root`, with symlinks resolved as the guest would
/// (an absolute link is relative to `root`, `..` stops at it), so nothing written into an
/// image's tree ever lands outside it.
pub fn inside(root: &Path, path: &str) -> PathBuf {
    let mut todo: Vec<String> = Path::new(path)
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    let mut cur: Vec<String> = Vec::new();
    let mut links = 0;
    while let Some(c) = todo.pop() {
        if c == ".." {
            cur.pop();
            continue;
        }
        let here: PathBuf = cur.iter().fold(root.to_path_buf(), |p, s| p.join(s));
        let next = here.join(&c);
        match std::fs::read_link(&next) {
            Ok(target) if links < 40 => {
                links += 1;
                if target.is_absolute() {
                    cur.clear();
                }
                for t in target.components().rev() {
                    match t {
                        Component::Normal(s) => todo.push(s.to_string_lossy().into_owned()),
                        Component::ParentDir => todo.push("..".into()),
                        _ => {}
                    }
                }
            }
            _ => cur.push(c),
        }
    }
    cur.iter().fold(root.to_path_buf(), |p, s| p.join(s))
}

/// Gives the unpacked image at `root` what vmon's guest needs (see the module's doc).
pub async fn prepare_rootfs(root: &Path, base: &Image, envd: &Path) -> anyhow::Result<()> {
    let bash = inside(root, "/bin/bash");
    if !bash.is_file() {
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
        let p = inside(root, dir);
        if !p.is_dir() {
            std::fs::create_dir_all(&p)?;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))?;
        }
    }
    install_runtime(root, envd).await?;
    install_modules(root, base).await?;
    add_user(root)?;
    let etc = |p: &str| inside(root, p);
    if etc("/etc/sudoers.d").is_dir() {
        let sudoers = etc("/etc/sudoers.d/90-vmon-user");
        std::fs::write(&sudoers, "user ALL=(ALL:ALL) NOPASSWD: ALL\n")?;
        std::fs::set_permissions(&sudoers, std::fs::Permissions::from_mode(0o440))?;
    }
    std::fs::write(etc("/etc/hostname"), "sandbox\n")?;
    std::fs::write(
        etc("/etc/hosts"),
        "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    )?;
    std::fs::write(etc("/etc/fstab"), "# mounts are made by envd init\n")?;
    // Often a link into /run (systemd-resolved) in images: a file of its own here.
    let resolv = inside(root, "/etc").join("resolv.conf");
    let _ = std::fs::remove_file(&resolv);
    std::fs::write(&resolv, "nameserver 8.8.8.8\n")?;
    Ok(())
}

/// envd (and `ip` when the image has none) with their own loader and libraries.
async fn install_runtime(root: &Path, envd: &Path) -> anyhow::Result<()> {
    let rt = inside(root, RUNTIME_DIR);
    std::fs::create_dir_all(&rt)?;
    let mut programs: Vec<(PathBuf, &str)> = vec![(envd.to_path_buf(), "/usr/local/bin/envd")];
    let has_ip = INIT_PATH.iter().any(|d| {
        let p = inside(root, &format!("{d}/ip"));
        p.is_file()
    });
    if !has_ip {
        let host_ip = ["/usr/bin/ip", "/usr/sbin/ip", "/sbin/ip", "/bin/ip"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .context("the host has no `ip` to give the image (apt-get install iproute2)")?;
        programs.push((host_ip, "/usr/local/sbin/ip"));
    }
    let mut interpreter = None;
    for (src, _) in &programs {
        for (lib, is_loader) in shared_libraries(src).await? {
            let name = lib
                .file_name()
                .context("a library without a file name")?
                .to_owned();
            let dst = rt.join(&name);
            if !dst.exists() {
                std::fs::copy(&lib, &dst).with_context(|| format!("copying {}", lib.display()))?;
            }
            if is_loader {
                interpreter = Some(Path::new(RUNTIME_DIR).join(&name));
            }
            // glibc loads its NSS modules (getpwnam's `files`, `compat`) at run time.
            if name.to_string_lossy().starts_with("libc.so") {
                if let Some(dir) = lib.parent() {
                    for nss in ["libnss_files.so.2", "libnss_compat.so.2"] {
                        let p = dir.join(nss);
                        if p.is_file() && !rt.join(nss).exists() {
                            std::fs::copy(&p, rt.join(nss))?;
                        }
                    }
                }
            }
        }
    }
    let interpreter = interpreter.context("envd names no ELF interpreter")?;
    for (src, dst) in &programs {
        let to = inside(root, dst);
        if let Some(d) = to.parent() {
            std::fs::create_dir_all(d)?;
        }
        let _ = std::fs::remove_file(&to);
        std::fs::copy(src, &to).with_context(|| format!("copying {}", src.display()))?;
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755))?;
        run(
            tokio::process::Command::new("patchelf")
                .arg("--set-interpreter")
                .arg(&interpreter)
                .arg("--force-rpath")
                .arg("--set-rpath")
                .arg(RUNTIME_DIR)
                .arg(&to),
            "patchelf (apt-get install patchelf)",
        )
        .await?;
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

/// The booted kernel's modules, from the base image's rootfs, unless the image has them.
async fn install_modules(root: &Path, base: &Image) -> anyhow::Result<()> {
    let v = &base.manifest.kernel_version;
    let modules = inside(root, "/lib/modules");
    if modules.join(v).is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(&modules)?;
    let mut last = String::new();
    for from in [format!("/usr/lib/modules/{v}"), format!("/lib/modules/{v}")] {
        let out = tokio::process::Command::new("debugfs")
            .arg("-R")
            .arg(format!("rdump {from} {}", modules.display()))
            .arg(&base.rootfs)
            .stdin(Stdio::null())
            .output()
            .await
            .context("running debugfs (apt-get install e2fsprogs)")?;
        if modules.join(v).is_dir() {
            return Ok(());
        }
        last = String::from_utf8_lossy(&out.stderr).trim().to_string();
    }
    bail!(
        "the kernel's modules ({v}) could not be taken from {}: {last}",
        base.rootfs.display()
    )
}

/// The `user` account (uid 1000 unless the image uses it) with its group and home.
fn add_user(root: &Path) -> anyhow::Result<()> {
    let passwd_path = inside(root, "/etc/passwd");
    let group_path = inside(root, "/etc/group");
    let shadow_path = inside(root, "/etc/shadow");
    let mut passwd = std::fs::read_to_string(&passwd_path).unwrap_or_default();
    let mut group = std::fs::read_to_string(&group_path).unwrap_or_default();
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
            if !passwd.is_empty() && !passwd.ends_with('\n') {
                passwd.push('\n');
            }
            passwd.push_str(&format!("user:x:{uid}:{uid}::/home/user:/bin/bash\n"));
            if !group.lines().any(|l| l.starts_with("user:")) {
                if !group.is_empty() && !group.ends_with('\n') {
                    group.push('\n');
                }
                group.push_str(&format!("user:x:{uid}:\n"));
            }
            let mut shadow = std::fs::read_to_string(&shadow_path).unwrap_or_default();
            if !shadow.lines().any(|l| l.starts_with("user:")) {
                if !shadow.lines().any(|l| l.starts_with("root:")) {
                    shadow.insert_str(0, "root:*:19000:0:99999:7:::\n");
                }
                if !shadow.is_empty() && !shadow.ends_with('\n') {
                    shadow.push('\n');
                }
                shadow.push_str("user:!:19000:0:99999:7:::\n");
                std::fs::write(&shadow_path, shadow)?;
                std::fs::set_permissions(&shadow_path, std::fs::Permissions::from_mode(0o640))?;
            }
            (uid, uid)
        }
    };
    std::fs::write(&passwd_path, passwd)?;
    std::fs::set_permissions(&passwd_path, std::fs::Permissions::from_mode(0o644))?;
    std::fs::write(&group_path, group)?;
    std::fs::set_permissions(&group_path, std::fs::Permissions::from_mode(0o644))?;
    let home = inside(root, "/home/user");
    if !home.is_dir() {
        std::fs::create_dir_all(&home)?;
        let skel = inside(root, "/etc/skel");
        if let Ok(rd) = std::fs::read_dir(&skel) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_file()) {
                    let _ = std::fs::copy(e.path(), home.join(e.file_name()));
                }
            }
        }
    }
    chown_tree(&home, uid, gid)?;
    Ok(())
}

fn chown_tree(p: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid))?;
    if p.is_dir() && !p.is_symlink() {
        for e in std::fs::read_dir(p)?.flatten() {
            chown_tree(&e.path(), uid, gid)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_inside_an_image_never_leave_it() {
        let root = std::env::temp_dir().join(format!("vmon-inside-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("usr/lib")).expect("test setup");
        std::os::unix::fs::symlink("/usr/lib", root.join("lib")).expect("test setup");
        std::os::unix::fs::symlink("../../../../etc", root.join("usr/lib/up")).expect("test setup");
        assert_eq!(inside(&root, "/lib/modules"), root.join("usr/lib/modules"));
        assert_eq!(inside(&root, "/usr/lib/up/passwd"), root.join("etc/passwd"));
        assert_eq!(inside(&root, "/../../x"), root.join("x"));
        std::fs::remove_dir_all(&root).expect("test setup");
    }

    #[test]
    fn registry_failures_name_the_registry_and_the_image() {
        let creds = vmon_proto::node::RegistryCredentials {
            username: "u".into(),
            password: "secret".into(),
        };
        let pull = Pull {
            reference: "127.0.0.1:5000/test/img:1",
            registry: "127.0.0.1:5000",
            credentials: Some(&creds),
            tls_verify: false,
            registry_allow: &[],
        };
        let m = explain(
            &pull,
            "time=\"x\" level=fatal msg=\"Error parsing image name: reading manifest 1 in 127.0.0.1:5000/test/img: unauthorized: authentication required\"",
        );
        assert!(
            m.starts_with("the registry 127.0.0.1:5000 refused the credentials"),
            "{m}"
        );
        assert!(!m.contains("secret"));
        let m = explain(
            &pull,
            "dial tcp 127.0.0.1:5000: connect: connection refused",
        );
        assert!(
            m.starts_with("the registry 127.0.0.1:5000 cannot be reached"),
            "{m}"
        );
        let m = explain(
            &pull,
            "reading manifest 2 in 127.0.0.1:5000/test/img: manifest unknown",
        );
        assert!(
            m.starts_with("the registry 127.0.0.1:5000 has no image"),
            "{m}"
        );
    }
}
