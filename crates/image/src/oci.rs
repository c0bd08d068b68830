//! Root filesystems from OCI registries (a template's `from_image(...)`): the image is pulled
//! with `skopeo` (by digest), flattened with `umoci unpack`, given what vmon's guest needs, and
//! made into a sparse raw ext4 like the base image's rootfs.
//!
//! What the image is given is `rootfs.rs`'s; it is written through [`crate::tree::Tree`]
//! only. `umoci unpack` runs as root and makes device nodes and setuid files as the layers say,
//! so the work directory it unpacks into is root's only (0700): no local user reaches them.
//! umoci resolves every layer path inside the bundle itself (hard links' targets and whiteouts
//! included), and `du` and `mkfs.ext4 -d` only read the tree, never following its links.
//!
//! Registry credentials reach skopeo in an auth file that exists only in memory (a `memfd`
//! handed to the child as fd 3), never on its command line, in a log or on disk.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::Image;

pub use crate::rootfs::{prepare_rootfs, RUNTIME_DIR};

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
    // umoci makes the layers' device nodes and setuid files in here, as root.
    std::fs::set_permissions(work, std::fs::Permissions::from_mode(0o700))?;
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
        prepare_rootfs(&root, &work.join("stage"), base, envd).await?;
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
    // SAFETY: between fork and exec only setns, dup2 and fcntl run, all async-signal-safe
    // system calls: setns moves the child into the pull's network namespace (first: its fd may
    // be 3), then the memfd (close-on-exec in this process) goes to fd 3 of the child without
    // close-on-exec (dup2 onto itself keeps the flag, so it is cleared by hand).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(netns, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if fd == 3 {
                if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
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

pub(crate) async fn run(cmd: &mut tokio::process::Command, what: &str) -> anyhow::Result<Vec<u8>> {
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
        tokio::process::Command::new("du").args(["-sxmP"]).arg(root),
        "du",
    )
    .await?;
    Ok(String::from_utf8_lossy(&out)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

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
