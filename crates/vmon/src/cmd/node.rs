//! `vmon node`: one host's sandboxes, served over node RPC to a `vmon api` elsewhere.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    action: Option<Action>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Subcommand)]
enum Action {
    /// The cluster's nodes: id, host, capacity and load (asks the api with the admin token).
    List {
        #[command(flatten)]
        conn: super::admin::Conn,
    },
    /// Stop placing work on a node and move its sandboxes away: running ones live-migrate,
    /// those that cannot move are paused (never killed), paused ones are re-homed. Prints
    /// progress until the node is drained.
    Drain {
        /// The node's id (`vmon node list`).
        node: String,
        /// Return once the drain has started.
        #[arg(long)]
        no_wait: bool,
        #[command(flatten)]
        conn: super::admin::Conn,
    },
    /// Let a drained (or draining) node take new work again.
    Undrain {
        node: String,
        #[command(flatten)]
        conn: super::admin::Conn,
    },
    /// Live-migrate one running sandbox to another node.
    Migrate {
        sandbox_id: String,
        /// The target node (default: the best other node).
        #[arg(long)]
        to: Option<String>,
        #[command(flatten)]
        conn: super::admin::Conn,
    },
}

/// Running a node (the default action).
#[derive(clap::Args)]
struct RunArgs {
    /// Where the node RPC listens.
    #[arg(long, env = "VMON_NODE_LISTEN", default_value = "127.0.0.1:3002")]
    listen: std::net::SocketAddr,
    /// Restore processes kept ready per template.
    #[arg(long, env = "VMON_POOL_SIZE", default_value_t = 1)]
    pool_size: usize,
    /// Force an accelerator (kvm or tcg) instead of probing.
    #[arg(long, env = "VMON_ACCEL")]
    accel: Option<String>,
    /// The RPC token (default: `<data dir>/node-token`, made on first start). Every node of
    /// a cluster takes the one token its api replicas present.
    #[arg(long, env = "VMON_NODE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// PEM certificate chain (leaf first) to serve node RPC over TLS with; TLS only, plain
    /// HTTP is then refused. Clients verify it with `vmon api --node-ca`.
    #[arg(long, env = "VMON_NODE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "VMON_NODE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// The CA other nodes' certificates are verified against when this node sends them a live
    /// migration (the api's `--node-ca`); without it, the system's CAs.
    #[arg(long, env = "VMON_NODE_CA_FILE")]
    node_ca: Option<std::path::PathBuf>,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// Joining a cluster: the node registers itself in etcd and heartbeats its load.
#[derive(clap::Args)]
struct ClusterArgs {
    /// etcd (comma-separated client URLs and client TLS): register in this cluster.
    #[command(flatten)]
    etcd: super::etcd::EtcdArgs,
    /// This node's id in the cluster (default: `<data dir>/node-id`, made on first start).
    #[arg(long, env = "VMON_NODE_ID")]
    node_id: Option<String>,
    /// The RPC URL the api replicas reach this node at (default `http://<listen>`, or
    /// `https://<listen>` with `--tls-cert`).
    #[arg(long, env = "VMON_NODE_ADVERTISE")]
    advertise: Option<String>,
    /// The sandbox ingress (`vmon proxy`) on this node's host, for proxies elsewhere.
    #[arg(long, env = "VMON_NODE_INGRESS")]
    ingress: Option<String>,
    /// The host name proxies compare to tell whether they can reach this node's guests
    /// directly (default: the hostname).
    #[arg(long, env = "VMON_NODE_HOST")]
    host: Option<String>,
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    match args.action {
        Some(Action::List { conn }) => super::admin::nodes(data_dir, &conn).await,
        Some(Action::Drain {
            node,
            no_wait,
            conn,
        }) => super::admin::drain(data_dir, &conn, &node, no_wait).await,
        Some(Action::Undrain { node, conn }) => super::admin::undrain(data_dir, &conn, &node).await,
        Some(Action::Migrate {
            sandbox_id,
            to,
            conn,
        }) => super::admin::migrate(data_dir, &conn, &sandbox_id, to.as_deref()).await,
        None => serve(data_dir, args.run).await,
    }
}

async fn serve(data_dir: &Path, args: RunArgs) -> anyhow::Result<()> {
    // A bad certificate is reported before the node starts.
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            vmon_node::tls::server_config(cert, key, &[b"http/1.1"])
                .context("node RPC's TLS certificate (--tls-cert, --tls-key)")?,
        ),
        _ => None,
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    std::fs::create_dir_all(data_dir)?;
    let mut cfg = vmon_node::NodeConfig::new(data_dir.to_path_buf());
    cfg.pool_size = args.pool_size;
    // No guest reaches the parts of the cluster this node knows of.
    cfg.cluster_endpoints.push(args.listen.to_string());
    cfg.cluster_endpoints
        .extend(args.cluster.etcd.endpoints.iter().cloned());
    cfg.cluster_endpoints.extend(
        [&args.cluster.advertise, &args.cluster.ingress]
            .into_iter()
            .flatten()
            .cloned(),
    );
    cfg.accel = match args.accel.as_deref() {
        None | Some("auto") => None,
        Some(a) => Some(a.parse().map_err(|e: String| anyhow::anyhow!(e))?),
    };
    let node = vmon_node::Node::open(cfg)
        .await
        .context("starting the node")?;
    let token_path = data_dir.join("node-token");
    let token = match args.token.clone().filter(|t| !t.trim().is_empty()) {
        Some(t) => t.trim().to_string(),
        None => file_token(&token_path)?,
    };
    // Live migrations go to other nodes' RPC with the cluster's one token.
    let peer_tls = match &args.node_ca {
        Some(ca) => Some(
            vmon_node::tls::ClientTls::from_ca_file(ca)
                .map_err(|e| anyhow::anyhow!("the nodes' CA (--node-ca): {e:#}"))?,
        ),
        None => None,
    };
    node.set_peers(vmon_node::Peers {
        token: token.clone(),
        tls: peer_tls,
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding node RPC to {}", args.listen))?;
    let cancel = tokio_util::sync::CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        c.cancel();
    });
    if !args.cluster.etcd.endpoints.is_empty() {
        join_cluster(data_dir, &args, scheme, node.clone(), cancel.clone()).await?;
    }
    println!(
        "vmon node listening on {scheme}://{} (token in {})",
        args.listen,
        if args.token.is_some() {
            "VMON_NODE_TOKEN".to_string()
        } else {
            token_path.display().to_string()
        }
    );
    if node.object_store().is_some() {
        tokio::spawn(collect_store_hourly(node.clone(), cancel.clone()));
    }
    let served: Arc<dyn vmon_proto::node::NodeControl> = node.clone();
    let channels: Arc<dyn vmon_node::channel::Channels> = node.clone();
    vmon_node::rpc::serve_node(listener, served, Some(channels), token, tls, cancel).await?;
    node.drain_pool().await;
    Ok(())
}

/// Objects in the store that no build manifest names (a build deleted while uploading, an
/// upload cut by a crash) go once they are an hour old: younger ones may be an upload in
/// flight. Every node may run it; it deletes only what no manifest names.
async fn collect_store_hourly(
    node: Arc<vmon_node::Node>,
    cancel: tokio_util::sync::CancellationToken,
) {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(3600);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
        match node.collect_store(EVERY).await {
            Ok(gone) if !gone.is_empty() => {
                tracing::info!(objects = gone.len(), "deleted objects no build names")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "collecting the object store failed"),
        }
    }
}

/// Registers the node in etcd and keeps its entry fresh until `cancel`.
async fn join_cluster(
    data_dir: &Path,
    args: &RunArgs,
    scheme: &str,
    node: Arc<vmon_node::Node>,
    cancel: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    use vmon_proto::node::NodeCalls;
    let c = &args.cluster;
    if scheme != "https" || args.node_ca.is_none() {
        anyhow::bail!(
            "a cluster's node serves RPC over TLS with a certificate of the cluster's CA naming \
             its id, and verifies its peers against that CA: set --tls-cert, --tls-key and \
             --node-ca"
        );
    }
    let kv = c.etcd.connect().await?;
    let id = match &c.node_id {
        Some(id) => id.clone(),
        None => persistent_id(&data_dir.join("node-id"))?,
    };
    // The api replicas verify this node against its id's name: say so now, not in their logs.
    vmon_node::tls::node_name(&id).context("--node-id")?;
    let facts = vmon_cluster::registry::host_facts(data_dir);
    let rpc_url = c
        .advertise
        .clone()
        .unwrap_or_else(|| format!("{scheme}://{}", args.listen));
    if scheme == "https" && rpc_url.starts_with("http://") {
        anyhow::bail!(
            "--advertise {rpc_url} is plain http, but this node serves TLS: advertise https://"
        );
    }
    let ingress_url = c.ingress.clone();
    let host = c.host.clone().unwrap_or_else(|| facts.hostname.clone());
    let dir = data_dir.to_path_buf();
    let node_id = id.clone();
    let info = move || {
        let node = node.clone();
        let dir = dir.clone();
        let (id, rpc_url, ingress_url, host) = (
            node_id.clone(),
            rpc_url.clone(),
            ingress_url.clone(),
            host.clone(),
        );
        async move {
            let now = vmon_cluster::registry::host_facts(&dir);
            let running =
                u32::try_from(node.list_running().await.map_or(0, |r| r.len())).unwrap_or(u32::MAX);
            vmon_proto::cluster::NodeInfo {
                id,
                rpc_url,
                ingress_url,
                host,
                accel: node.accel().accel.as_str().to_string(),
                qemu_version: node.qemu_version().to_string(),
                cpu_baseline: now.cpu_model,
                vcpus: now.vcpus,
                memory_mb: now.memory_mb,
                free_memory_mb: now.free_memory_mb,
                free_disk_mb: now.free_disk_mb,
                free_slots: vmon_node::slots::MAX_SLOTS.saturating_sub(running),
                running,
                updated_unix: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
                gpus: node.gpu_inventory(),
            }
        }
    };
    println!(
        "vmon node {id} joins the cluster at {}",
        c.etcd.endpoints.join(",")
    );
    tokio::spawn(vmon_cluster::registry::register(kv, id, info, cancel));
    Ok(())
}

/// An id kept in `path`, made on first use.
fn persistent_id(path: &Path) -> anyhow::Result<String> {
    if let Ok(id) = std::fs::read_to_string(path) {
        if !id.trim().is_empty() {
            return Ok(id.trim().to_string());
        }
    }
    let id = format!("node-{}", &random_hex(4)?);
    std::fs::write(path, &id).with_context(|| format!("writing {}", path.display()))?;
    Ok(id)
}

fn random_hex(n: usize) -> anyhow::Result<String> {
    let mut b = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .context("reading /dev/urandom")?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn file_token(token_path: &Path) -> anyhow::Result<String> {
    Ok(match std::fs::read_to_string(token_path) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
        _ => {
            let mut b = [0u8; 24];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
                .context("reading /dev/urandom")?;
            let t: String = b.iter().map(|x| format!("{x:02x}")).collect();
            match vmon_vm::private::create(token_path, t.as_bytes()) {
                Ok(()) => t,
                // Another node process made it first: use its token.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    std::fs::read_to_string(token_path)?.trim().to_string()
                }
                Err(e) => return Err(e).context("writing the node token"),
            }
        }
    })
}
