#[derive(clap::Args)]
pub struct Args {}

pub async fn run(_data_dir: &std::path::Path, _args: Args) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}
