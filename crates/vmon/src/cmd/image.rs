//! `vmon image build|list`.

use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(clap::Subcommand)]
enum Cmd {
    /// Build (or find in the cache) the guest image for this host.
    Build(BuildArgs),
    /// List the images in the data dir.
    List,
}

#[derive(clap::Args)]
pub struct BuildArgs {
    /// Debian suite (default: the host's).
    #[arg(long)]
    suite: Option<String>,
    /// Debian mirror (default: the host's).
    #[arg(long)]
    mirror: Option<String>,
    /// envd binary to install (default: `envd` beside this binary).
    #[arg(long)]
    envd: Option<PathBuf>,
    /// Size of the root filesystem in MiB.
    #[arg(long)]
    disk_mb: Option<u32>,
}

/// The envd binary that ships beside the running vmon binary.
pub fn default_envd() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.with_file_name("envd");
    if !p.is_file() {
        anyhow::bail!(
            "no envd binary at {} (build it with `cargo build -p vmon-envd`, or pass --envd)",
            p.display()
        );
    }
    Ok(p)
}

pub fn recipe(args: &BuildArgs) -> anyhow::Result<vmon_image::Recipe> {
    let envd = match &args.envd {
        Some(p) => p.clone(),
        None => default_envd()?,
    };
    let mut r = vmon_image::Recipe::for_host(envd)?;
    if let Some(s) = &args.suite {
        r.suite = s.clone();
    }
    if let Some(m) = &args.mirror {
        r.mirror = m.clone();
    }
    if let Some(d) = args.disk_mb {
        r.disk_mb = d;
    }
    Ok(r)
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    match args.command {
        Cmd::Build(b) => {
            let t0 = std::time::Instant::now();
            let img = vmon_image::build(data_dir, &recipe(&b)?).await?;
            println!(
                "{}\t{}\tkernel {}\t{:.1}s",
                img.manifest.hash,
                img.dir.display(),
                img.manifest.kernel_version,
                t0.elapsed().as_secs_f64()
            );
        }
        Cmd::List => {
            let dir = data_dir.join("images");
            if let Ok(rd) = std::fs::read_dir(&dir) {
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    if let Ok(img) = vmon_image::find(data_dir, &name) {
                        println!(
                            "{}\t{}\t{}",
                            img.manifest.hash, img.manifest.suite, img.manifest.kernel_version
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
