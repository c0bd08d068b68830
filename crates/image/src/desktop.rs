//! The desktop layer: the base image's tree plus an X desktop from Debian's packages, made into
//! a disk of its own for the `desktop` builtin template (what the `e2b-desktop` SDKs drive).
//!
//! It is made on the host, natively: a copy of the base image's debootstrap tree, `apt-get
//! install` of [`DESKTOP_PACKAGES`] in it (chroot), the files of `assets/desktop/`, then
//! `mkfs.ext4 -d`. Installing the same packages in a TCG guest (a Template SDK `apt_install`)
//! would take tens of minutes. The disk is cached under `<data>/images/desktop-<hash>/` by the
//! base image's hash and everything below, so the second template build is a lookup.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use vmon_proto::progress::Progress;

use crate::build::{self, Image, Recipe, Report};

/// Bumped whenever the steps below change what the layer contains.
const DESKTOP_VERSION: u32 = 1;

/// The raw disk's size (sparse): the base's tree, the desktop (about 1.2 GB) and room to work.
pub const DESKTOP_DISK_MB: u32 = 8192;

/// What the SDKs run, each by its Debian package (e2b-desktop 2.7.2, @e2b/desktop 2.4.0).
const DESKTOP_PACKAGES: &[&str] = &[
    // `Xvfb :0 -ac -screen 0 WxHx24 -retro -dpi D -nolisten tcp -nolisten unix`.
    "xvfb",
    // `xdpyinfo -display :0` (the SDK's wait for Xvfb).
    "x11-utils",
    // `xrandr` (get_screen_size, and the size a restored desktop is given), `xset`.
    "x11-xserver-utils",
    // `startxfce4`; the SDK waits for xfce4-session, xfwm4 and xfdesktop.
    "xfce4",
    "xfce4-terminal",
    // The session bus startxfce4 starts (dbus-launch).
    "dbus-x11",
    // Mouse, keyboard and window queries.
    "xdotool",
    // `scrot --pointer PATH` (screenshot).
    "scrot",
    // The stream: `x11vnc -bg -display :0 ... -rfbport 5900`, then
    // `cd /opt/noVNC/utils && ./novnc_proxy --vnc localhost:5900 --listen 6080 --web /opt/noVNC`
    // (noVNC is Debian's /usr/share/novnc, linked there; websockify serves it).
    "x11vnc",
    "novnc",
    "websockify",
    // `netstat -tuln` (the SDK's wait for noVNC's port).
    "net-tools",
    // `xdg-open` (open) and `gtk-launch` (launch).
    "xdg-utils",
    "libgtk-3-bin",
    // The browser `open` of a URL starts.
    "firefox-esr",
    // Fonts for everything above.
    "fonts-dejavu-core",
    "xfonts-base",
];

/// The desktop's files, each (guest path, contents, mode): `crates/image/assets/desktop/`.
const DESKTOP_FILES: &[(&str, &str, u32)] = &[
    (
        "/usr/local/lib/vmon/desktop/env",
        include_str!("../assets/desktop/env"),
        0o644,
    ),
    (
        "/usr/local/lib/vmon/desktop/start",
        include_str!("../assets/desktop/start"),
        0o755,
    ),
    (
        "/usr/local/lib/vmon/desktop/resize",
        include_str!("../assets/desktop/resize"),
        0o755,
    ),
    (
        "/usr/local/bin/Xvfb",
        include_str!("../assets/desktop/Xvfb"),
        0o755,
    ),
    (
        "/usr/local/bin/xdotool",
        include_str!("../assets/desktop/xdotool"),
        0o755,
    ),
    (
        "/usr/local/bin/xdpyinfo",
        include_str!("../assets/desktop/xdpyinfo"),
        0o755,
    ),
    (
        "/usr/local/bin/startxfce4",
        include_str!("../assets/desktop/startxfce4"),
        0o755,
    ),
    // Firefox ESR's enterprise policies: no first-run, default-browser or telemetry pages, so
    // the window `open(url)` makes is titled by the page.
    (
        "/usr/lib/firefox-esr/distribution/policies.json",
        include_str!("../assets/desktop/policies.json"),
        0o644,
    ),
    (
        "/etc/firefox/policies/policies.json",
        include_str!("../assets/desktop/policies.json"),
        0o644,
    ),
    (
        "/etc/xdg/mimeapps.list",
        include_str!("../assets/desktop/mimeapps.list"),
        0o644,
    ),
];

/// The template's start command: the desktop up on :0 (as `user`).
pub const DESKTOP_START: &str = "/usr/local/lib/vmon/desktop/start";

/// Where the SDKs look for noVNC (`/opt/noVNC/utils/novnc_proxy`, `--web /opt/noVNC`).
const NOVNC_LINK: &str = "opt/noVNC";
const NOVNC_DEBIAN: &str = "/usr/share/novnc";

/// What a desktop layer's directory says about itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DesktopManifest {
    pub hash: String,
    pub base_hash: String,
    pub packages: Vec<String>,
    pub disk_mb: u32,
    pub created_at_unix: u64,
}

/// The hash of the desktop layer over `base` (the base image's hash).
pub fn desktop_hash(base_hash: &str) -> String {
    let mut h = Sha256::new();
    h.update(format!(
        "desktop v{DESKTOP_VERSION}\n{base_hash}\n{}\n{DESKTOP_DISK_MB}\n",
        DESKTOP_PACKAGES.join(",")
    ));
    for (path, text, mode) in DESKTOP_FILES {
        h.update(Sha256::digest(path));
        h.update(Sha256::digest(text));
        h.update(mode.to_le_bytes());
    }
    hex::encode(&h.finalize()[..8])
}

/// The desktop layer's raw disk over `image` (built from `recipe`), made unless cached.
pub async fn desktop_disk(
    data_dir: &Path,
    recipe: &Recipe,
    image: &Image,
    progress: Option<&Progress>,
) -> anyhow::Result<PathBuf> {
    let hash = desktop_hash(&image.manifest.hash);
    let images = data_dir.join("images");
    let dir = images.join(format!("desktop-{hash}"));
    let disk = dir.join("rootfs.img");
    if dir.join("manifest.json").is_file() && disk.is_file() {
        return Ok(disk);
    }
    std::fs::create_dir_all(&images)?;
    let lock_path = images.join(".desktop.lock");
    let _lock = tokio::task::spawn_blocking(move || build::lock_exclusive(&lock_path))
        .await
        .map_err(|e| anyhow::anyhow!("lock task: {e}"))??;
    if dir.join("manifest.json").is_file() && disk.is_file() {
        return Ok(disk);
    }
    let t0 = std::time::Instant::now();
    let report = Report(progress);
    let base_tree = build::ensure_tree(&images, recipe, report).await?;
    let staging = images.join(format!("desktop-{hash}.tmp"));
    let tree = staging.join("tree");
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir_all(&staging)?;
    let result = make(&base_tree, &tree, recipe, &staging.join("rootfs.img")).await;
    let _ = std::fs::remove_dir_all(&tree);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    let manifest = DesktopManifest {
        hash: hash.clone(),
        base_hash: image.manifest.hash.clone(),
        packages: DESKTOP_PACKAGES.iter().map(|s| s.to_string()).collect(),
        disk_mb: DESKTOP_DISK_MB,
        created_at_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let mut f = std::fs::File::create(staging.join("manifest.json"))?;
    f.write_all(serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    for name in ["rootfs.img", "manifest.json"] {
        let p = staging.join(name);
        std::fs::File::open(&p)?.sync_all()?;
        let mut perm = std::fs::metadata(&p)?.permissions();
        perm.set_readonly(true);
        std::fs::set_permissions(&p, perm)?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::rename(&staging, &dir)?;
    std::fs::File::open(&images)?.sync_all()?;
    tracing::info!(
        hash,
        secs = t0.elapsed().as_secs_f64(),
        "desktop layer built"
    );
    Ok(disk)
}

/// The base tree copied to `tree`, the desktop installed in it, and `disk` made from it.
async fn make(base_tree: &Path, tree: &Path, recipe: &Recipe, disk: &Path) -> anyhow::Result<()> {
    tracing::info!(from = %base_tree.display(), "desktop layer: copying the base tree");
    build::run(
        tokio::process::Command::new("cp")
            .args(["-a", "--reflink=auto"])
            .arg(base_tree)
            .arg(tree),
        "copying the base tree",
    )
    .await?;
    // What the base image puts in its tree after debootstrap, exactly as this recipe has it.
    build::install_envd(tree, &recipe.envd)?;
    for (path, text) in build::CODE_INTERPRETER_FILES
        .iter()
        .chain(build::LOGIN_FILES)
        .chain(build::APT_FILES)
    {
        build::install_file(tree, path, text.as_bytes(), 0o644)?;
    }
    tracing::info!("desktop layer: apt-get install of the desktop's packages");
    let packages: Vec<String> = DESKTOP_PACKAGES.iter().map(|s| s.to_string()).collect();
    let refs: Vec<&String> = packages.iter().collect();
    build::apt_install(tree, &refs).await?;
    for (path, text, mode) in DESKTOP_FILES {
        build::install_file(tree, path, text.as_bytes(), *mode)?;
    }
    let link = tree.join(NOVNC_LINK);
    std::fs::create_dir_all(tree.join("opt"))?;
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(NOVNC_DEBIAN, &link).context("linking /opt/noVNC")?;
    for rel in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        clean_dir(&tree.join(rel));
    }
    tracing::info!("desktop layer: mkfs.ext4 -d");
    build::run(
        tokio::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "rootfs", "-E", "root_owner=0:0", "-d"])
            .arg(tree)
            .arg(disk)
            .arg(format!("{DESKTOP_DISK_MB}M")),
        "mkfs.ext4 of the desktop layer",
    )
    .await
}

/// Removes the regular files directly in `dir` (apt's downloads and lists).
fn clean_dir(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_file()) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_follows_the_base_and_the_files() {
        assert_ne!(desktop_hash("aa"), desktop_hash("bb"));
        assert_eq!(desktop_hash("aa"), desktop_hash("aa"));
        assert!(DESKTOP_FILES.iter().any(|(p, _, _)| *p == DESKTOP_START));
    }

    #[test]
    fn the_wrappers_come_before_the_real_programs() {
        for (p, _, mode) in DESKTOP_FILES {
            if p.starts_with("/usr/local/bin/") {
                assert_eq!(*mode, 0o755, "{p}");
            }
        }
        // The SDKs' noVNC path.
        assert_eq!(
            format!("/{NOVNC_LINK}/utils/novnc_proxy"),
            "/opt/noVNC/utils/novnc_proxy"
        );
    }
}
