//! `vmon api`: the REST api with its node in-process, without the proxy (run `vmon proxy`
//! beside it). Same data dir layout, config and bootstrap as `vmon up`.

use std::path::Path;

#[derive(clap::Args)]
pub struct Args {
    /// TOML config file (default: `<data dir>/config.toml` when it exists).
    #[arg(long, env = "VMON_CONFIG")]
    pub config: Option<std::path::PathBuf>,
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    let config = vmon_api::Config::load(args.config.as_deref(), data_dir)?;
    super::up::serve(data_dir, config, super::up::Parts { proxy: false }).await
}
