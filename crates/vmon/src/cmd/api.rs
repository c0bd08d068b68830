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
    /// The node's RPC token (`<node data dir>/node-token`); in a cluster, every node's.
    #[arg(long, env = "VMON_NODE_TOKEN", hide_env_values = true)]
    pub node_token: Option<String>,
    /// A PEM file of the CA the nodes' TLS certificates are verified against. With it node RPC
    /// is TLS-only: every node must serve TLS and be reached at an `https://` URL.
    #[arg(long, env = "VMON_NODE_CA_FILE")]
    pub node_ca: Option<std::path::PathBuf>,
    /// etcd (comma-separated client URLs and client TLS): be a replica of this cluster. The
    /// KV is then etcd, the nodes are those registered there (reached over TLS only, each
    /// verified against `--node-ca` and its id), and records must be in PostgreSQL
    /// (`store_url`).
    #[command(flatten)]
    pub etcd: super::etcd::EtcdArgs,
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    let config = vmon_api::Config::load(args.config.as_deref(), data_dir)?;
    let node_tls = match &args.node_ca {
        Some(ca) => Some(
            vmon_node::tls::ClientTls::from_ca_file(ca)
                .map_err(|e| anyhow::anyhow!("the nodes' CA (--node-ca): {e:#}"))?,
        ),
        None => None,
    };
    if !args.etcd.endpoints.is_empty() {
        return replica(data_dir, config, args, node_tls).await;
    }
    if args.node.is_none() && !is_root() {
        // The in-process node makes namespaces and nftables rules and runs QEMUs as their own
        // uids: say what to do instead of failing somewhere inside it.
        anyhow::bail!(
            "`vmon api` without --node (VMON_NODE_URL) or --etcd (VMON_ETCD_ENDPOINTS) runs its \
             node in-process, which needs root; as an unprivileged user (the packaged \
             vmon-api.service) point it at a `vmon node` or a cluster, or run `vmon up` as root"
        );
    }
    let remote_node = match args.node {
        Some(url) => {
            let token = args
                .node_token
                .ok_or_else(|| anyhow::anyhow!("--node needs --node-token (or VMON_NODE_TOKEN)"))?;
            let n: std::sync::Arc<dyn vmon_proto::node::NodeControl> = std::sync::Arc::new(
                vmon_node::rpc::RemoteNode::with_tls(&url, token, node_tls.as_ref())?,
            );
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
            cluster: None,
        },
    )
    .await
}

/// One api replica of a cluster: etcd for the KV, the registered nodes behind one
/// `ClusterNodes`, PostgreSQL for records.
async fn replica(
    data_dir: &Path,
    config: vmon_api::Config,
    args: Args,
    node_tls: Option<vmon_node::tls::ClientTls>,
) -> anyhow::Result<()> {
    if config.store_url.is_none() {
        anyhow::bail!(
            "a cluster replica keeps its records in PostgreSQL: set store_url (VMON_STORE_URL)"
        );
    }
    let token = args
        .node_token
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| anyhow::anyhow!("--etcd needs the nodes' --node-token (VMON_NODE_TOKEN)"))?;
    let node_tls = node_tls.ok_or_else(|| {
        anyhow::anyhow!(
            "a cluster replica reaches nodes over TLS verified against the cluster's CA only: \
             set --node-ca (VMON_NODE_CA_FILE)"
        )
    })?;
    let kv = args.etcd.connect().await?;
    let nodes = vmon_cluster::ClusterNodes::new(kv.clone(), token.trim().to_string(), node_tls);
    super::up::serve(
        data_dir,
        config,
        super::up::Parts {
            proxy: false,
            remote_node: Some(nodes.clone()),
            cluster: Some(super::up::ClusterParts { kv, view: nodes }),
        },
    )
    .await
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
