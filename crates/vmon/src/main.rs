//! The one vmon binary. Each subcommand lives in its own module under `cmd/`.

use clap::{Parser, Subcommand};

mod cmd;
mod progress;

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
    /// Benchmarks that print medians and p99 with the machine they ran on.
    Bench(cmd::bench::Args),
    /// Run api, proxy and one node in one process (prints the E2B_* exports).
    Up(cmd::up::Args),
    /// Run the REST api (with its node in-process), without the proxy.
    Api(cmd::api::Args),
    /// One host's sandboxes, served over node RPC (pair with `vmon api --node`).
    Node(Box<cmd::node::Args>),
    /// Run the sandbox traffic proxy against a running api.
    Proxy(cmd::proxy::Args),
    /// Teams (admin).
    Team(cmd::admin::TeamArgs),
    /// API keys (admin).
    Key(cmd::admin::KeyArgs),
    /// Every team's sandboxes (admin).
    Sandbox(cmd::admin::SandboxArgs),
    /// A local CA and server certificates it signs (TLS inside a cluster).
    Cert(cmd::cert::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VMON_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(|| progress::LogWriter)
        .init();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        match cli.command {
            Command::Image(a) => cmd::image::run(&cli.data_dir, a).await,
            Command::Doctor(a) => cmd::doctor::run(&cli.data_dir, a).await,
            Command::Bench(a) => cmd::bench::run(&cli.data_dir, a).await,
            Command::Up(a) => cmd::up::run(&cli.data_dir, a).await,
            Command::Api(a) => cmd::api::run(&cli.data_dir, a).await,
            Command::Node(a) => cmd::node::run(&cli.data_dir, *a).await,
            Command::Proxy(a) => cmd::proxy::run(&cli.data_dir, a).await,
            Command::Team(a) => cmd::admin::team(&cli.data_dir, a).await,
            Command::Key(a) => cmd::admin::key(&cli.data_dir, a).await,
            Command::Sandbox(a) => cmd::admin::sandbox(&cli.data_dir, a).await,
            Command::Cert(a) => cmd::cert::run(a),
        }
    })
}
