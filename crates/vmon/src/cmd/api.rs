//! `vmon api`: the REST api without the proxy (run `vmon proxy` beside it), with its node
//! in-process or, with `--node`, a `vmon node` reached over RPC. Same data dir layout, config
//! and bootstrap as `vmon up`.

use std::path::Path;

#[derive(clap::Args)]
pub struct Args {
    /// TOML config file (default: `<data dir>/config.toml` when it exists).
    #[arg(long, env = "VMON_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// A `vmon node` to drive over RPC (`http://host:port`) instead of an in-process node.
    #[arg(long, env = "VMON_NODE_URL")]
    pub node: Option<String>,
    /// The node's RPC token (`<node data dir>/node-token`).
    #[arg(long, env = "VMON_NODE_TOKEN")]
    pub node_token: Option<String>,
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    let config = vmon_api::Config::load(args.config.as_deref(), data_dir)?;
    let remote_node = match args.node {
        Some(url) => {
            let token = args
                .node_token
                .ok_or_else(|| anyhow::anyhow!("--node needs --node-token (or VMON_NODE_TOKEN)"))?;
            let n: std::sync::Arc<dyn vmon_proto::node::NodeControl> =
                std::sync::Arc::new(vmon_node::rpc::RemoteNode::new(&url, token)?);
            Some(n)
        }
        None => None,
    };
    super::up::serve(
        data_dir,
        config,
        super::up::Parts {
            proxy: false,
            remote_node,
        },
    )
    .await
}
