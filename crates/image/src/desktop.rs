//! The desktop layer: the base image's tree plus an X desktop from Debian's packages, made into
//! a disk of its own for the `desktop` builtin template (what the `e2b-desktop` SDKs drive).
//!
//! It is made on the host, natively: a copy of the base image's debootstrap tree, `apt-get
//! install` of [`DESKTOP_PACKAGES`] in it (chroot), the files of `assets/desktop/`. Installing
//! the same packages in a TCG guest (a Template SDK `apt_install`) would take tens of minutes.
//! The cache, `<data>/images/desktop-<hash>/`, is in two parts so that a new envd (every
//! change of it makes a new base image) costs one `mkfs.ext4 -d`, not the apt step again:
//! `tree/`, keyed by [`desktop_hash`] (the debootstrap tree's recipe and everything below, not
//! envd), and beside it `rootfs-<image hash>.img`, that tree with the image's own files
//! (envd, ...) made into a disk.

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

/// What a desktop layer's directory says about its tree.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DesktopManifest {
    pub hash: String,
    /// The debootstrap tree's hash (`Recipe::tree_hash`) the desktop was installed over.
    pub tree_hash: String,
    pub packages: Vec<String>,
    pub created_at_unix: u64,
}

/// The hash of the desktop's tree over `recipe`'s debootstrap tree: that tree's recipe (suite,
/// mirror, packages), the desktop's packages, files and disk size. Not envd's bytes nor the
/// other files an image adds (they go into each disk), so a new envd reuses the tree.
pub fn desktop_hash(recipe: &Recipe) -> String {
    let mut h = Sha256::new();
    h.update(format!(
        "desktop v{DESKTOP_VERSION}\n{}\n{}\n{DESKTOP_DISK_MB}\n",
        recipe.tree_hash(),
        DESKTOP_PACKAGES.join(",")
    ));
    for (path, text, mode) in DESKTOP_FILES {
        h.update(Sha256::digest(path));
        h.update(Sha256::digest(text));
        h.update(mode.to_le_bytes());
    }
    hex::encode(&h.finalize()[..8])
}

/// Puts the desktop layer's raw disk for `image` (built from `recipe`) at `out` (a hard link to
/// the cached disk, read-only: the template's overlay is above it), making what is not cached:
/// the desktop's tree (apt, minutes), then the disk of this image (`mkfs.ext4 -d`).
pub async fn desktop_disk(
    data_dir: &Path,
    recipe: &Recipe,
    image: &Image,
    progress: Option<&Progress>,
    out: &Path,
) -> anyhow::Result<()> {
    let images = data_dir.join("images");
    let dir = images.join(format!("desktop-{}", desktop_hash(recipe)));
    let disk = dir.join(format!("rootfs-{}.img", image.manifest.hash));
    std::fs::create_dir_all(&images)?;
    // Held to the link: a build for another image prunes older disks under it.
    let lock_path = images.join(".desktop.lock");
    let _lock = tokio::task::spawn_blocking(move || build::lock_exclusive(&lock_path))
        .await
        .map_err(|e| anyhow::anyhow!("lock task: {e}"))??;
    if !disk.is_file() {
        let t0 = std::time::Instant::now();
        let tree = ensure_desktop_tree(&images, &dir, recipe, Report(progress)).await?;
        make_disk(&tree, recipe, &dir, &disk).await?;
        tracing::info!(
            disk = %disk.display(),
            secs = t0.elapsed().as_secs_f64(),
            "desktop layer built"
        );
    }
    let _ = std::fs::remove_file(out);
    if std::fs::hard_link(&disk, out).is_err() {
        // Another filesystem: a copy (sparse).
        build::run(
            tokio::process::Command::new("cp")
                .args(["--reflink=auto", "--sparse=always"])
                .arg(&disk)
                .arg(out),
            "copying the desktop layer",
        )
        .await?;
    }
    Ok(())
}

/// `dir/tree`: the base tree copied, the desktop installed in it; made unless there.
async fn ensure_desktop_tree(
    images: &Path,
    dir: &Path,
    recipe: &Recipe,
    report: Report<'_>,
) -> anyhow::Result<PathBuf> {
    let tree = dir.join("tree");
    if tree.join(COMPLETE).is_file() {
        return Ok(tree);
    }
    let base_tree = build::ensure_tree(images, recipe, report).await?;
    let tmp = dir.join("tree.tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    if tree.exists() {
        std::fs::remove_dir_all(&tree)?;
    }
    std::fs::create_dir_all(dir)?;
    let t0 = std::time::Instant::now();
    if let Err(e) = install_desktop(&base_tree, &tmp).await {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let manifest = DesktopManifest {
        hash: desktop_hash(recipe),
        tree_hash: recipe.tree_hash(),
        packages: DESKTOP_PACKAGES.iter().map(|s| s.to_string()).collect(),
        created_at_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let mut f = std::fs::File::create(dir.join("manifest.json"))?;
    f.write_all(serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    f.sync_all()?;
    std::fs::write(tmp.join(COMPLETE), b"")?;
    std::fs::rename(&tmp, &tree)?;
    tracing::info!(
        tree = %tree.display(),
        secs = t0.elapsed().as_secs_f64(),
        "desktop tree built"
    );
    Ok(tree)
}

/// Marks a finished tree (as the base trees are marked).
const COMPLETE: &str = ".vmon-complete";

/// The base tree copied to `tree` and the desktop installed in it.
async fn install_desktop(base_tree: &Path, tree: &Path) -> anyhow::Result<()> {
    tracing::info!(from = %base_tree.display(), "desktop layer: copying the base tree");
    build::run(
        tokio::process::Command::new("cp")
            .args(["-a", "--reflink=auto"])
            .arg(base_tree)
            .arg(tree),
        "copying the base tree",
    )
    .await?;
    let _ = std::fs::remove_file(tree.join(COMPLETE));
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
    Ok(())
}

/// `disk`: `tree` with the image's own files (`recipe`'s envd, ...) made into a disk; older
/// disks in `dir` (other images) go, the newest of them kept for a node still on it.
async fn make_disk(tree: &Path, recipe: &Recipe, dir: &Path, disk: &Path) -> anyhow::Result<()> {
    build::install_image_files(tree, recipe)?;
    let tmp = disk.with_extension("img.tmp");
    let _ = std::fs::remove_file(&tmp);
    tracing::info!(disk = %disk.display(), "desktop layer: mkfs.ext4 -d");
    if let Err(e) = build::make_disk(tree, &tmp, DESKTOP_DISK_MB).await {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context("making the desktop layer's disk"));
    }
    std::fs::File::open(&tmp)?.sync_all()?;
    let mut perm = std::fs::metadata(&tmp)?.permissions();
    perm.set_readonly(true);
    std::fs::set_permissions(&tmp, perm)?;
    std::fs::rename(&tmp, disk)?;
    std::fs::File::open(dir)?.sync_all()?;
    prune_disks(dir, disk);
    Ok(())
}

/// Removes the disks in `dir` other than `keep` and the newest one besides it (builds hold
/// their own links to the disks they boot).
fn prune_disks(dir: &Path, keep: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut others: Vec<(std::time::SystemTime, PathBuf)> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p != keep)
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("rootfs-") && (n.ends_with(".img") || n.ends_with(".img.tmp"))
            })
        })
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .collect();
    others.sort();
    others.pop();
    for (_, p) in others {
        let _ = std::fs::remove_file(p);
    }
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

    fn recipe(packages: &[&str], envd: &str) -> Recipe {
        Recipe {
            suite: "bookworm".into(),
            mirror: "http://deb.debian.org/debian".into(),
            packages: packages.iter().map(|s| s.to_string()).collect(),
            disk_mb: 4096,
            envd: PathBuf::from(envd),
        }
    }

    #[test]
    fn the_hash_follows_the_tree_not_envd() {
        let a = recipe(&["bash"], "/a/envd");
        assert_eq!(
            desktop_hash(&a),
            desktop_hash(&recipe(&["bash"], "/b/envd"))
        );
        assert_ne!(
            desktop_hash(&a),
            desktop_hash(&recipe(&["bash", "curl"], "/a/envd"))
        );
        assert!(DESKTOP_FILES.iter().any(|(p, _, _)| *p == DESKTOP_START));
    }

    #[test]
    fn older_disks_are_pruned_but_the_newest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let names = [
            "rootfs-a.img",
            "rootfs-b.img",
            "rootfs-c.img.tmp",
            "rootfs-d.img",
        ];
        for (i, n) in names.iter().enumerate() {
            let p = dir.path().join(n);
            std::fs::write(&p, b"x").expect("write");
            let t =
                std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            std::fs::File::options()
                .write(true)
                .open(&p)
                .and_then(|f| f.set_modified(t))
                .expect("mtime");
        }
        std::fs::create_dir(dir.path().join("tree")).expect("tree");
        prune_disks(dir.path(), &dir.path().join("rootfs-a.img"));
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("dir")
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        left.sort();
        assert_eq!(left, ["rootfs-a.img", "rootfs-d.img", "tree"]);
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
