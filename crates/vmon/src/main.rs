//! The one vmon binary. Each subcommand lives in its own module under `cmd/`.

use clap::{Parser, Subcommand};

mod cmd;

#[derive(Parser)]
#[command(
    name = "vmon",
    version,
    about = "Self-hosted sandboxes that speak the E2B API"
)]
struct Cli {
    /// Where vmon keeps everything (images, builds, sandboxes, stores).
    #[arg(
        long,
        global = true,
        env = "VMON_DATA_DIR",
        default_value = "/var/lib/vmon"
    )]
    data_dir: std::path::PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Guest images.
    Image(cmd::image::Args),
    /// Check this host: accelerator, QEMU, networking.
    Doctor(cmd::doctor::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VMON_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        match cli.command {
            Command::Image(a) => cmd::image::run(&cli.data_dir, a).await,
            Command::Doctor(a) => cmd::doctor::run(&cli.data_dir, a).await,
        }
    })
}
