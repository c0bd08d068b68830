//! Making and finding images.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncBufReadExt, BufReader};

use vmon_proto::progress::Progress;

use crate::apt::host_apt_source;

/// Bumped whenever the steps below change what an image contains.
const RECIPE_VERSION: u32 = 1;

/// Where the guest has the code-interpreter server's entry (`code-interpreter-v1`'s start command
/// runs it); its package is the directory `code_interpreter/` beside it.
pub const CODE_INTERPRETER_PATH: &str = "/usr/local/lib/vmon/code_interpreter.py";
/// The code-interpreter server's files, each (guest path, contents): the entry at
/// [`CODE_INTERPRETER_PATH`], then its package (`crates/image/assets/code_interpreter/`).
pub const CODE_INTERPRETER_FILES: &[(&str, &str)] = &[
    (
        CODE_INTERPRETER_PATH,
        include_str!("../assets/code_interpreter.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/__init__.py",
        include_str!("../assets/code_interpreter/__init__.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/bash_worker.py",
        include_str!("../assets/code_interpreter/bash_worker.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/common.py",
        include_str!("../assets/code_interpreter/common.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/contexts.py",
        include_str!("../assets/code_interpreter/contexts.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/js_worker.py",
        include_str!("../assets/code_interpreter/js_worker.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/kernel_hooks.py",
        include_str!("../assets/code_interpreter/kernel_hooks.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/kernels.py",
        include_str!("../assets/code_interpreter/kernels.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/server.py",
        include_str!("../assets/code_interpreter/server.py"),
    ),
    (
        "/usr/local/lib/vmon/code_interpreter/workers.py",
        include_str!("../assets/code_interpreter/workers.py"),
    ),
];
/// The login shell's files. Every SDK command runs in a login shell (`bash -l -c`), so what
/// they start is paid by each command: vmon's versions of Debian's start no process in bash
/// and read no `/proc/cpuinfo` (`docs/architecture.md`, "The guest's login shell"). Each is
/// (guest path, contents); base-files installs Debian's only where none is, so upgrades keep
/// these.
const LOGIN_FILES: &[(&str, &str)] = &[
    ("/etc/profile", include_str!("../assets/profile")),
    // Decides OpenBLAS's kernels from what envd's init wrote at boot (`vmon_envd::init`).
    (
        "/etc/profile.d/vmon-cpu.sh",
        include_str!("../assets/vmon-cpu.sh"),
    ),
    ("/root/.profile", include_str!("../assets/root-profile")),
];

/// What the guest's package installs do differently, each (guest path, contents): a sandbox
/// or template build that installs packages does not rebuild an initramfs no boot reads.
const APT_FILES: &[(&str, &str)] = &[(
    "/etc/initramfs-tools/update-initramfs.conf",
    include_str!("../assets/update-initramfs.conf"),
)];

/// Packages every guest gets (on top of debootstrap's minbase).
const BASE_PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "python3",
    // `python` is python3, as on E2B's base image (users and E2B's own tests call `python`).
    "python-is-python3",
    "procps",
    "iproute2",
    "sudo",
    "ca-certificates",
    "curl",
    "e2fsprogs",
    "linux-image-cloud-amd64",
    "initramfs-tools",
    // The data stack E2B's code interpreter offers (the code-interpreter template imports it
    // ahead; charts come back as PNG results).
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    // The code interpreter's JavaScript contexts.
    "nodejs",
];

/// Packages installed with apt in the debootstrap tree, after debootstrap: their dependencies
/// need apt's resolver (alternatives, virtual packages), which debootstrap's `--include` lacks.
const APT_PACKAGES: &[&str] = &[
    // Jupyter kernels for the code interpreter's Python contexts.
    "python3-ipykernel",
    "python3-jupyter-client",
    // The code interpreter's R contexts: R and its Jupyter kernel (IRkernel, whose kernelspec
    // `ir` the package installs in /usr/share/jupyter/kernels).
    "r-base-core",
    "r-cran-irkernel",
    // The code interpreter's TypeScript contexts: esbuild strips the types of a cell, which
    // then runs as JavaScript (the guest's Node.js 18 has no type stripping of its own).
    "esbuild",
    // What template builds run: the Template SDK's helpers (`pip_install`, `npm_install`,
    // `git_clone`) and ready checks (`ss`, `curl`, `pgrep`: iproute2, curl, procps above).
    "python3-pip",
    "npm",
    "git",
];

/// Everything an image is made from. Two equal recipes make the same image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Recipe {
    pub suite: String,
    pub mirror: String,
    pub packages: Vec<String>,
    /// Size of the raw ext4 (sparse).
    pub disk_mb: u32,
    /// The envd binary to install as `/usr/local/bin/envd`.
    #[serde(skip)]
    pub envd: PathBuf,
}

impl Recipe {
    /// The host's suite and mirror, the base packages, and the given envd binary.
    pub fn for_host(envd: PathBuf) -> anyhow::Result<Recipe> {
        let src = host_apt_source()?;
        Ok(Recipe {
            suite: src.suite,
            mirror: src.mirror,
            packages: BASE_PACKAGES
                .iter()
                .chain(APT_PACKAGES)
                .map(|s| s.to_string())
                .collect(),
            disk_mb: 4096,
            envd,
        })
    }

    /// Hash of the part that debootstrap sees (suite, mirror, packages).
    pub(crate) fn tree_hash(&self) -> String {
        let mut h = Sha256::new();
        h.update(format!(
            "v{RECIPE_VERSION}\n{}\n{}\n{}",
            self.suite,
            self.mirror,
            self.packages.join(",")
        ));
        hex::encode(&h.finalize()[..8])
    }

    /// Hash of the whole recipe, envd's bytes included.
    pub fn hash(&self) -> anyhow::Result<String> {
        let envd = std::fs::read(&self.envd)
            .with_context(|| format!("reading envd binary {}", self.envd.display()))?;
        let mut h = Sha256::new();
        h.update(self.tree_hash());
        h.update(format!("\n{}\n", self.disk_mb));
        h.update(Sha256::digest(&envd));
        for (path, text) in CODE_INTERPRETER_FILES {
            h.update(Sha256::digest(path));
            h.update(Sha256::digest(text));
        }
        for (path, text) in LOGIN_FILES.iter().chain(APT_FILES) {
            h.update(Sha256::digest(path));
            h.update(Sha256::digest(text));
        }
        Ok(hex::encode(&h.finalize()[..8]))
    }
}

/// What an image directory says about itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub hash: String,
    pub suite: String,
    pub mirror: String,
    pub packages: Vec<String>,
    pub kernel_version: String,
    pub disk_mb: u32,
    pub envd_sha256: String,
    pub created_at_unix: u64,
}

/// A built image on disk.
#[derive(Debug, Clone)]
pub struct Image {
    pub dir: PathBuf,
    pub vmlinuz: PathBuf,
    pub initrd: PathBuf,
    pub rootfs: PathBuf,
    pub manifest: Manifest,
}

impl Image {
    fn at(dir: PathBuf) -> anyhow::Result<Image> {
        let text = std::fs::read_to_string(dir.join("manifest.json"))
            .with_context(|| format!("reading {}/manifest.json", dir.display()))?;
        let manifest: Manifest = serde_json::from_str(&text).context("parsing manifest.json")?;
        let img = Image {
            vmlinuz: dir.join("vmlinuz"),
            initrd: dir.join("initrd"),
            rootfs: dir.join("rootfs.img"),
            dir,
            manifest,
        };
        for p in [&img.vmlinuz, &img.initrd, &img.rootfs] {
            if !p.is_file() {
                bail!(
                    "image {} is incomplete: {} is missing",
                    img.dir.display(),
                    p.display()
                );
            }
        }
        Ok(img)
    }
}

/// The image with this hash, if it was built.
pub fn find(data_dir: &Path, hash: &str) -> anyhow::Result<Image> {
    if hash.is_empty() || !hash.chars().all(|c| c.is_ascii_hexdigit()) {
        bail!("{hash:?} is not an image hash");
    }
    Image::at(data_dir.join("images").join(hash))
}

/// Builds the image for `recipe`, or returns the cached one.
pub async fn build(data_dir: &Path, recipe: &Recipe) -> anyhow::Result<Image> {
    build_with(data_dir, recipe, None).await
}

/// [`build`], reporting its steps to `progress` (step "guest image", an estimated percent).
/// Without a handle it draws its own spinner on a terminal.
pub async fn build_with(
    data_dir: &Path,
    recipe: &Recipe,
    progress: Option<&Progress>,
) -> anyhow::Result<Image> {
    let report = Report(progress);
    let hash = recipe.hash()?;
    let images = data_dir.join("images");
    let dir = images.join(&hash);
    if let Ok(img) = Image::at(dir.clone()) {
        tracing::info!(hash, "image cache hit");
        return Ok(img);
    }
    std::fs::create_dir_all(&images)?;
    report.step();
    report.update("waiting for another build of the image cache", 0);
    // Several nodes (tests, benches) may share one image cache: one builder at a time.
    let lock_path = images.join(".build.lock");
    let _lock = tokio::task::spawn_blocking(move || lock_exclusive(&lock_path))
        .await
        .map_err(|e| anyhow::anyhow!("lock task: {e}"))??;
    if let Ok(img) = Image::at(dir.clone()) {
        tracing::info!(hash, "image built by another process meanwhile");
        return Ok(img);
    }
    let tree = ensure_tree(&images, recipe, report).await?;
    report.update("installing envd and the code interpreter", 88);

    let staging = images.join(format!("{hash}.tmp"));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir_all(&staging)?;

    install_image_files(&tree, recipe)?;
    let (vmlinuz, initrd, kernel_version) = find_kernel(&tree)?;
    std::fs::copy(&vmlinuz, staging.join("vmlinuz"))?;
    std::fs::copy(&initrd, staging.join("initrd"))?;

    let bar = report.spinner(format!("mkfs.ext4 -d ({} MiB, sparse)", recipe.disk_mb), 92);
    make_disk(&tree, &staging.join("rootfs.img"), recipe.disk_mb).await?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    report.update("writing the manifest", 99);

    let envd_bytes = std::fs::read(&recipe.envd)?;
    let manifest = Manifest {
        hash: hash.clone(),
        suite: recipe.suite.clone(),
        mirror: recipe.mirror.clone(),
        packages: recipe.packages.clone(),
        kernel_version,
        disk_mb: recipe.disk_mb,
        envd_sha256: hex::encode(Sha256::digest(&envd_bytes)),
        created_at_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let mut f = std::fs::File::create(staging.join("manifest.json"))?;
    f.write_all(serde_json::to_string_pretty(&manifest)?.as_bytes())?;
    for name in ["vmlinuz", "initrd", "rootfs.img", "manifest.json"] {
        std::fs::File::open(staging.join(name))?.sync_all()?;
    }
    // The base disk is shared by every sandbox and must never be written again.
    for name in ["vmlinuz", "initrd", "rootfs.img", "manifest.json"] {
        let p = staging.join(name);
        let mut perm = std::fs::metadata(&p)?.permissions();
        perm.set_readonly(true);
        std::fs::set_permissions(&p, perm)?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::rename(&staging, &dir)?;
    std::fs::File::open(&images)?.sync_all()?;
    tracing::info!(hash, dir = %dir.display(), "image built");
    Image::at(dir)
}

/// Blocks until this process holds an exclusive `flock` on `path`; released when the file is
/// dropped (or the process dies).
pub(crate) fn lock_exclusive(path: &Path) -> anyhow::Result<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    f.lock()
        .with_context(|| format!("locking {}", path.display()))?;
    Ok(f)
}

/// Where the steps go: a shared handle, or (without one) a spinner of our own.
#[derive(Clone, Copy)]
pub(crate) struct Report<'a>(pub(crate) Option<&'a Progress>);

impl Report<'_> {
    fn step(self) {
        if let Some(p) = self.0 {
            p.step("guest image");
        }
    }

    fn update(self, detail: impl Into<String>, percent: u8) {
        if let Some(p) = self.0 {
            p.update(detail, Some(percent));
        }
    }

    /// Our own spinner when nobody else shows the progress; otherwise a log line and an update.
    fn spinner(self, msg: String, percent: u8) -> Option<ProgressBar> {
        match self.0 {
            Some(p) => {
                tracing::info!("{msg}");
                p.update(msg, Some(percent));
                None
            }
            None => Some(spinner(msg)),
        }
    }
}

fn spinner(msg: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar.set_message(msg.clone());
    tracing::info!("{msg}");
    bar
}

pub(crate) async fn run(cmd: &mut tokio::process::Command, what: &str) -> anyhow::Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {what} (is it installed?)"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The debootstrap tree, configured, cached by the package part of the recipe.
pub(crate) async fn ensure_tree(
    images: &Path,
    recipe: &Recipe,
    report: Report<'_>,
) -> anyhow::Result<PathBuf> {
    let trees = images.join("trees");
    let tree = trees.join(recipe.tree_hash());
    if tree.join(".vmon-complete").exists() {
        report.update("debootstrap tree cached", DEBOOTSTRAP_DONE);
        return Ok(tree);
    }
    std::fs::create_dir_all(&trees)?;
    let tmp = trees.join(format!("{}.tmp", recipe.tree_hash()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    let (by_apt, by_debootstrap): (Vec<&String>, Vec<&String>) = recipe
        .packages
        .iter()
        .partition(|p| APT_PACKAGES.contains(&p.as_str()));
    let include: Vec<&str> = by_debootstrap.iter().map(|p| p.as_str()).collect();
    // A mirror that drops a download now and then ("Couldn't download packages") fails a
    // whole first start: debootstrap is tried again, from an empty tree, a few times.
    let mut attempt = 1;
    loop {
        match debootstrap(&tmp, recipe, &include, report).await {
            Ok(()) => break,
            Err(e) if attempt < DEBOOTSTRAP_ATTEMPTS => {
                tracing::warn!(attempt, "debootstrap failed, trying again: {e:#}");
                if tmp.exists() {
                    std::fs::remove_dir_all(&tmp)?;
                }
                tokio::time::sleep(std::time::Duration::from_secs(5 * attempt as u64)).await;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
    if !by_apt.is_empty() {
        report.update("installing packages with apt", DEBOOTSTRAP_DONE);
        apt_install(&tmp, &by_apt).await?;
    }
    report.update("configuring the tree", DEBOOTSTRAP_DONE);
    configure_tree(&tmp).await?;
    std::fs::write(tmp.join(".vmon-complete"), b"")?;
    std::fs::rename(&tmp, &tree)?;
    Ok(tree)
}

/// How many times a failed debootstrap is tried (see `ensure_tree`).
const DEBOOTSTRAP_ATTEMPTS: usize = 3;

/// One debootstrap of `recipe`'s minbase plus `include` into `tmp`, its progress reported.
async fn debootstrap(
    tmp: &Path,
    recipe: &Recipe,
    include: &[&str],
    report: Report<'_>,
) -> anyhow::Result<()> {
    let bar = report.spinner(
        format!("debootstrap {} from {}", recipe.suite, recipe.mirror),
        0,
    );
    let mut child = tokio::process::Command::new("debootstrap")
        .arg("--variant=minbase")
        .arg(format!("--include={}", include.join(",")))
        .arg(&recipe.suite)
        .arg(tmp)
        .arg(&recipe.mirror)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running debootstrap (apt-get install debootstrap)")?;
    let mut last = Vec::new();
    let mut phase = DebootstrapProgress::default();
    if let Some(out) = child.stdout.take() {
        let mut lines = BufReader::new(out).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(bar) = &bar {
                bar.set_message(format!("debootstrap: {}", line.trim()));
            }
            if let Some((detail, percent)) = phase.line(&line) {
                // With a handle, whoever shows it writes the log lines.
                if phase.changed_phase() && report.0.is_none() {
                    tracing::info!(percent, "debootstrap: {detail}");
                }
                report.update(format!("debootstrap: {detail}"), percent);
            }
            last.push(line);
            if last.len() > 40 {
                last.remove(0);
            }
        }
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use tokio::io::AsyncReadExt;
        let _ = e.read_to_string(&mut err).await;
    }
    let status = child.wait().await?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if !status.success() {
        bail!(
            "debootstrap failed ({status}):\n{}\n{}",
            last.join("\n"),
            err.trim()
        );
    }
    Ok(())
}

/// Where the image step is when debootstrap is done (the rest is quick).
const DEBOOTSTRAP_DONE: u8 = 85;
/// About how many packages the base recipe's debootstrap retrieves (298 for Debian 12); only
/// used to estimate the percent while retrieving, never past that phase's share.
const EXPECTED_PACKAGES: u32 = 300;

/// An estimate of how far debootstrap is, read from its `I:` lines: retrieving packages is
/// 2-15 % (by count), extracting 15-17 %, then each install phase starts at its share of the
/// time it took on a 2-core TCG host (unpacking the base system is the longest), up to 85 %.
#[derive(Debug, Default)]
struct DebootstrapProgress {
    retrieved: u32,
    extracted: u32,
    phase: &'static str,
    phase_changed: bool,
}

impl DebootstrapProgress {
    /// The detail and percent after `line`, when the line says something about progress.
    fn line(&mut self, line: &str) -> Option<(String, u8)> {
        let msg = line.trim().strip_prefix("I: ")?;
        let (phase, percent): (&'static str, u8) = if msg.starts_with("Retrieving InRelease")
            || msg.starts_with("Retrieving Release")
            || msg.starts_with("Retrieving Packages")
            || msg.starts_with("Resolving dependencies")
            || msg.starts_with("Checking component")
        {
            ("fetching the package lists", 1)
        } else if msg.starts_with("Retrieving ") {
            self.retrieved += 1;
            let share = (self.retrieved.min(EXPECTED_PACKAGES) * 13 / EXPECTED_PACKAGES) as u8;
            self.changed("retrieving packages");
            return Some((
                format!("retrieving packages ({} so far)", self.retrieved),
                2 + share,
            ));
        } else if msg.starts_with("Extracting ") {
            self.extracted += 1;
            let share = (self.extracted * 2 / self.retrieved.max(self.extracted).max(1)) as u8;
            self.changed("extracting");
            return Some(("extracting the required packages".to_string(), 15 + share));
        } else if msg.starts_with("Installing core packages") {
            ("installing the core packages", 17)
        } else if msg.starts_with("Unpacking required packages") {
            ("unpacking the required packages", 23)
        } else if msg.starts_with("Configuring required packages") {
            ("configuring the required packages", 28)
        } else if msg.starts_with("Unpacking the base system") {
            ("unpacking the base system", 30)
        } else if msg.starts_with("Configuring the base system") {
            ("configuring the base system", 66)
        } else if msg.starts_with("Base system installed") {
            ("base system installed", DEBOOTSTRAP_DONE)
        } else {
            return None;
        };
        self.changed(phase);
        Some((phase.to_string(), percent))
    }

    fn changed(&mut self, phase: &'static str) {
        self.phase_changed = self.phase != phase;
        self.phase = phase;
    }

    /// Whether the last line entered a new phase (worth a log line).
    fn changed_phase(&self) -> bool {
        self.phase_changed
    }
}

/// Users, sudo, hosts; drops the package cache.
/// `apt-get install` in the tree (with `/proc` mounted and no service started), then the
/// package cache emptied.
pub(crate) async fn apt_install(tree: &Path, packages: &[&String]) -> anyhow::Result<()> {
    let policy = tree.join("usr/sbin/policy-rc.d");
    std::fs::write(&policy, "#!/bin/sh\nexit 101\n")?;
    std::fs::set_permissions(&policy, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let proc_dir = tree.join("proc");
    run(
        tokio::process::Command::new("mount")
            .args(["-t", "proc", "proc"])
            .arg(&proc_dir),
        "mount /proc in the tree",
    )
    .await?;
    let result = async {
        run(
            tokio::process::Command::new("chroot").arg(tree).args([
                "apt-get",
                "-o",
                "Acquire::Retries=3",
                "update",
                "-q",
            ]),
            "apt-get update in the tree",
        )
        .await?;
        run(
            tokio::process::Command::new("chroot")
                .arg(tree)
                .env("DEBIAN_FRONTEND", "noninteractive")
                .args(["apt-get", "-o", "Acquire::Retries=3", "install", "-y", "-q"])
                .arg("--no-install-recommends")
                .args(packages.iter().map(|p| p.as_str())),
            "apt-get install in the tree",
        )
        .await?;
        run(
            tokio::process::Command::new("chroot")
                .arg(tree)
                .args(["apt-get", "clean"]),
            "apt-get clean in the tree",
        )
        .await
    }
    .await;
    let _ = tokio::process::Command::new("umount")
        .arg(&proc_dir)
        .status()
        .await;
    let _ = std::fs::remove_file(&policy);
    result
}

async fn configure_tree(tree: &Path) -> anyhow::Result<()> {
    let has_user = std::fs::read_to_string(tree.join("etc/passwd"))?
        .lines()
        .any(|l| l.starts_with("user:"));
    if !has_user {
        run(
            tokio::process::Command::new("chroot").arg(tree).args([
                "useradd",
                "-m",
                "-u",
                "1000",
                "-U",
                "-s",
                "/bin/bash",
                "user",
            ]),
            "useradd user",
        )
        .await?;
    }
    let sudoers = tree.join("etc/sudoers.d/90-vmon-user");
    std::fs::write(&sudoers, "user ALL=(ALL:ALL) NOPASSWD: ALL\n")?;
    std::fs::set_permissions(
        &sudoers,
        std::os::unix::fs::PermissionsExt::from_mode(0o440),
    )?;
    std::fs::write(tree.join("etc/hostname"), "sandbox\n")?;
    std::fs::write(
        tree.join("etc/hosts"),
        "127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    )?;
    std::fs::write(tree.join("etc/fstab"), "# mounts are made by envd init\n")?;
    let _ = std::fs::remove_file(tree.join("etc/resolv.conf"));
    std::fs::write(tree.join("etc/resolv.conf"), "nameserver 8.8.8.8\n")?;
    if let Ok(rd) = std::fs::read_dir(tree.join("var/cache/apt/archives")) {
        for e in rd.flatten() {
            if e.path().extension().is_some_and(|x| x == "deb") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

/// What an image adds to its debootstrap tree, as `recipe` has it (and [`Recipe::hash`]
/// covers): envd, the code interpreter, the login shell's and apt's files.
pub(crate) fn install_image_files(tree: &Path, recipe: &Recipe) -> anyhow::Result<()> {
    install_envd(tree, &recipe.envd)?;
    for (path, text) in CODE_INTERPRETER_FILES
        .iter()
        .chain(LOGIN_FILES)
        .chain(APT_FILES)
    {
        install_file(tree, path, text.as_bytes(), 0o644)?;
    }
    Ok(())
}

/// A sparse raw ext4 of `disk_mb` MiB at `disk` holding `tree` (`mkfs.ext4 -d`, the root
/// directory owned by root), labelled `rootfs` as the guest's init expects.
pub(crate) async fn make_disk(tree: &Path, disk: &Path, disk_mb: u32) -> anyhow::Result<()> {
    run(
        tokio::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "rootfs", "-E", "root_owner=0:0", "-d"])
            .arg(tree)
            .arg(disk)
            .arg(format!("{disk_mb}M")),
        "mkfs.ext4",
    )
    .await
}

fn install_envd(tree: &Path, envd: &Path) -> anyhow::Result<()> {
    let dst = tree.join("usr/local/bin/envd");
    std::fs::create_dir_all(tree.join("usr/local/bin"))?;
    let _ = std::fs::remove_file(&dst);
    std::fs::copy(envd, &dst).with_context(|| format!("copying {}", envd.display()))?;
    std::fs::set_permissions(&dst, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    Ok(())
}

/// Writes `contents` at the absolute guest path `path` in the tree.
pub(crate) fn install_file(
    tree: &Path,
    path: &str,
    contents: &[u8],
    mode: u32,
) -> anyhow::Result<()> {
    let dst = tree.join(path.trim_start_matches('/'));
    if let Some(dir) = dst.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(&dst);
    std::fs::write(&dst, contents).with_context(|| format!("writing {}", dst.display()))?;
    std::fs::set_permissions(&dst, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    Ok(())
}

/// The newest `vmlinuz-*` in the tree's /boot and its initrd.
fn find_kernel(tree: &Path) -> anyhow::Result<(PathBuf, PathBuf, String)> {
    let boot = tree.join("boot");
    let mut versions: Vec<String> = std::fs::read_dir(&boot)?
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("vmlinuz-"))
                .map(String::from)
        })
        .collect();
    versions.sort();
    let Some(v) = versions.pop() else {
        bail!(
            "no kernel in {} (is linux-image-cloud-amd64 in the recipe?)",
            boot.display()
        );
    };
    let initrd = boot.join(format!("initrd.img-{v}"));
    if !initrd.is_file() {
        bail!("kernel {v} has no initramfs in {}", boot.display());
    }
    Ok((boot.join(format!("vmlinuz-{v}")), initrd, v))
}

#[cfg(test)]
mod tests;
