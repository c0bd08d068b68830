//! `vmon node`: one host's sandboxes, served over node RPC to a `vmon api` elsewhere.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    /// Where the node RPC listens.
    #[arg(long, env = "VMON_NODE_LISTEN", default_value = "127.0.0.1:3002")]
    listen: std::net::SocketAddr,
    /// Restore processes kept ready per template.
    #[arg(long, env = "VMON_POOL_SIZE", default_value_t = 1)]
    pool_size: usize,
    /// Force an accelerator (kvm or tcg) instead of probing.
    #[arg(long, env = "VMON_ACCEL")]
    accel: Option<String>,
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    std::fs::create_dir_all(data_dir)?;
    let mut cfg = vmon_node::NodeConfig::new(data_dir.to_path_buf());
    cfg.pool_size = args.pool_size;
    cfg.accel = match args.accel.as_deref() {
        None | Some("auto") => None,
        Some(a) => Some(a.parse().map_err(|e: String| anyhow::anyhow!(e))?),
    };
    let node = vmon_node::Node::open(cfg)
        .await
        .context("starting the node")?;
    let token_path = data_dir.join("node-token");
    let token = match std::fs::read_to_string(&token_path) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
        _ => {
            let mut b = [0u8; 24];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
                .context("reading /dev/urandom")?;
            let t: String = b.iter().map(|x| format!("{x:02x}")).collect();
            match vmon_vm::private::create(&token_path, t.as_bytes()) {
                Ok(()) => t,
                // Another node process made it first: use its token.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    std::fs::read_to_string(&token_path)?.trim().to_string()
                }
                Err(e) => return Err(e).context("writing the node token"),
            }
        }
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding node RPC to {}", args.listen))?;
    let cancel = tokio_util::sync::CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        c.cancel();
    });
    println!(
        "vmon node listening on http://{} (token in {})",
        args.listen,
        token_path.display()
    );
    let served: Arc<dyn vmon_proto::node::NodeControl> = node.clone();
    vmon_node::rpc::serve(listener, served, token, cancel).await?;
    node.drain_pool().await;
    Ok(())
}
