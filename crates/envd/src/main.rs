use std::net::SocketAddr;

use vmon_envd::{ServeOptions, DEFAULT_PORT, ENVD_VERSION};

fn main() -> anyhow::Result<()> {
    if std::process::id() == 1 || std::env::args().nth(1).as_deref() == Some("init") {
        return vmon_envd::init::run();
    }
    let mut addr: SocketAddr = SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT));
    let mut opts = ServeOptions::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| anyhow::anyhow!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--addr" => addr = value()?.parse()?,
            "--default-user" => opts.default_user = value()?,
            "--access-token" => opts.access_token = Some(value()?),
            "--init-marker" => opts.init_marker = Some(value()?.into()),
            "--version" => {
                println!("{ENVD_VERSION}");
                return Ok(());
            }
            "-h" | "--help" => {
                println!(
                    "envd [--addr 0.0.0.0:{DEFAULT_PORT}] [--default-user user] [--access-token T] \
                     [--init-marker FILE]"
                );
                return Ok(());
            }
            other => anyhow::bail!("unknown argument {other:?}"),
        }
    }
    if opts.access_token.is_none() {
        opts.access_token = std::env::var("ENVD_ACCESS_TOKEN")
            .ok()
            .filter(|t| !t.is_empty());
    }
    tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(false)
        .with_writer(std::io::stdout)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        vmon_envd::serve(listener, opts).await
    })
}
