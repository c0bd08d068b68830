//! `vmon up`: api + proxy + one node in one process, embedded KV and the records store (SQLite
//! `vmon.db`, or PostgreSQL when `store_url` is configured) in the data dir.
//!
//! First start: creates the default team and its API key (the plaintext is kept in
//! `<data dir>/api-key`, mode 0600, so later starts can print it again; the records hold only
//! its hash). The api and the proxy listen at once and the three `export` lines go to stdout
//! right away; logs go to stderr. The guest image and the `base` template build in the
//! background (a bar on a terminal, progress lines in the log otherwise); until `base` is
//! built a create answers 503 saying how far the build is and `GET /health` answers 503
//! `building`. `code-interpreter-v1` builds after `base`, also in the background.
//!
//! `vmon up --print-env` starts nothing: it waits until the `vmon up` using the same data dir
//! is ready (`/health` 200), then prints the lines and exits. So
//! `vmon up & eval "$(vmon up --print-env)"` works in one shell.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use vmon_api::records::{Records, StoreRecords};
use vmon_api::{Config, Control, ProxyRoutes};

#[derive(clap::Args)]
pub struct Args {
    /// TOML config file (default: `<data dir>/config.toml` when it exists).
    #[arg(long, env = "VMON_CONFIG")]
    pub config: Option<PathBuf>,
    /// Wait for the running `vmon up` of this data dir, print the exports, exit.
    #[arg(long)]
    pub print_env: bool,
    /// How long `--print-env` waits, in seconds.
    #[arg(long, default_value_t = 1800)]
    pub wait_secs: u64,
}

pub const API_KEY_FILE: &str = "api-key";
pub const ADMIN_TOKEN_FILE: &str = "admin-token";

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    let config = Config::load(args.config.as_deref(), data_dir)?;
    if args.print_env {
        return print_env_when_ready(data_dir, &config, Duration::from_secs(args.wait_secs)).await;
    }
    serve(
        data_dir,
        config,
        Parts {
            proxy: true,
            remote_node: None,
            cluster: None,
        },
    )
    .await
}

/// Which parts a process runs besides the api.
pub struct Parts {
    pub proxy: bool,
    /// A node reached over RPC (`vmon api --node`); `None` runs the node in-process.
    pub remote_node: Option<Arc<dyn vmon_proto::node::NodeControl>>,
    /// A replica of a cluster: its KV (etcd) and the members' view behind `remote_node`.
    pub cluster: Option<ClusterParts>,
}

/// What a cluster replica runs on instead of the embedded KV and one node.
pub struct ClusterParts {
    pub kv: vmon_kv::Kv,
    pub view: Arc<dyn vmon_proto::cluster::Cluster>,
}

pub async fn serve(data_dir: &Path, config: Config, parts: Parts) -> anyhow::Result<()> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating the data dir {}", data_dir.display()))?;
    // A bad certificate is reported before anything starts.
    let api_tls = match (&config.api_tls_cert, &config.api_tls_key) {
        (Some(cert), Some(key)) => Some(
            vmon_node::tls::server_config(cert, key, &[b"h2", b"http/1.1"])
                .context("the api's TLS certificate (api_tls_cert, api_tls_key)")?,
        ),
        _ => None,
    };
    let cancel = CancellationToken::new();
    shutdown_on_signal(cancel.clone());

    let (kv, cluster) = match parts.cluster {
        Some(c) => (c.kv, Some(c.view)),
        None => (
            vmon_kv::Kv::open_embedded(&vmon_kv::EmbeddedConfig::new(data_dir.join("kv")))
                .await
                .context("opening the embedded KV")?,
            None,
        ),
    };
    let records = open_records(&config, data_dir).await?;
    let api_key = bootstrap_team(records.as_ref(), data_dir, &config).await?;
    let admin_token = secret_file(&data_dir.join(ADMIN_TOKEN_FILE))?;

    // The first build (guest image, then `base`) reports here; the bar or log lines, the api's
    // 503s and `/health` read it.
    let startup = vmon_proto::progress::Progress::new("the base template");
    let mut local_node = None;
    let node: Arc<dyn vmon_proto::node::NodeControl> = match parts.remote_node {
        Some(n) => n,
        None => {
            let n = open_local_node(data_dir, &config, &startup).await?;
            local_node = Some(n.clone());
            n
        }
    };
    let control = match cluster {
        Some(view) => {
            Control::open_cluster(config.clone(), node, view, records, kv, startup.clone()).await?
        }
        None => Control::open_with(config.clone(), node, records, kv, startup.clone()).await?,
    };
    tokio::spawn(build_in_background(control.clone(), cancel.clone()));

    let api_listener = tokio::net::TcpListener::bind(config.api_listen)
        .await
        .with_context(|| format!("binding the api to {}", config.api_listen))?;
    let mut tasks = tokio::task::JoinSet::new();
    if parts.proxy {
        let proxy = in_process_proxy(&config, data_dir, &control).await?;
        let c = cancel.clone();
        tasks.spawn(proxy.serve(c));
        tracing::info!(listen = %config.proxy_listen, "proxy ready");
    }
    tasks.spawn(control.clone().run_reaper(cancel.clone()).then_ok());
    tasks.spawn(
        control
            .clone()
            .run_template_files_collector(cancel.clone())
            .then_ok(),
    );
    let c = cancel.clone();
    let api_control = control.clone();
    let token = Some(admin_token);
    let tls_on = api_tls.is_some();
    tasks.spawn(
        async move { vmon_api::serve_with(api_listener, api_control, token, api_tls, c).await },
    );
    tracing::info!(listen = %config.api_listen, tls = tls_on, "api ready");

    println!("{}", exports(&config, &api_key));
    if let Some(trust) = trust_exports(&config, data_dir, parts.proxy) {
        println!("{trust}");
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    if !startup.is_ready() {
        crate::progress::show(startup);
    }

    // The first part to stop (or a signal) stops the others.
    let first = tasks.join_next().await;
    cancel.cancel();
    while tasks.join_next().await.is_some() {}
    // Sandboxes keep running (a restarted node re-adopts them); the warm pool does not.
    if let Some(n) = local_node {
        n.drain_pool().await;
    }
    match first {
        Some(Ok(Err(e))) => Err(e),
        Some(Err(e)) => Err(anyhow::anyhow!("a part of vmon up failed: {e}")),
        _ => Ok(()),
    }
}

/// The records store (SQLite in the data dir, or PostgreSQL at `store_url`).
async fn open_records(config: &Config, data_dir: &Path) -> anyhow::Result<Arc<dyn Records>> {
    let records: Arc<dyn Records> = Arc::new(
        StoreRecords::open(config, data_dir)
            .await
            .context("opening the records store")?,
    );
    if data_dir.join("records.json").exists() {
        tracing::warn!(
            "{} is from an older vmon and is no longer read; records now live in {}",
            data_dir.join("records.json").display(),
            data_dir.join(vmon_api::records::SQLITE_FILE).display()
        );
    }
    Ok(records)
}

/// The node in this process, reporting its first build to `startup`; no guest reaches the
/// api, the proxy or the store.
async fn open_local_node(
    data_dir: &Path,
    config: &Config,
    startup: &vmon_proto::progress::Progress,
) -> anyhow::Result<Arc<vmon_node::Node>> {
    tracing::info!(data_dir = %data_dir.display(), "starting the node");
    let mut node_config = vmon_node::NodeConfig::new(data_dir.to_path_buf());
    node_config.progress = Some(startup.clone());
    // The same private_allow at the api and the node.
    node_config.private_allow = config.private_allow.clone();
    node_config.cluster_endpoints.extend([
        config.api_listen.to_string(),
        config.proxy_listen.to_string(),
        config.api_url(),
        config.sandbox_url(),
    ]);
    node_config
        .cluster_endpoints
        .extend(config.store_url.iter().cloned());
    // Opening is quick: the guest image builds in the background.
    vmon_node::Node::open(node_config)
        .await
        .context("starting the node")
}

/// The proxy of `vmon up`, bound to `proxy_listen`: it shares the control plane's traffic
/// table (no reports needed) and fault points.
async fn in_process_proxy(
    config: &Config,
    data_dir: &Path,
    control: &Arc<Control>,
) -> anyhow::Result<ListeningProxy> {
    let listener = tokio::net::TcpListener::bind(config.proxy_listen)
        .await
        .with_context(|| format!("binding the proxy to {}", config.proxy_listen))?;
    let mut proxy = vmon_proxy::Proxy::new(Arc::new(ProxyRoutes(control.clone())))
        .with_activity(control.activity().clone())
        .with_faults(control.faults().clone())
        .with_limits(config.proxy_limits.guest_limits());
    if let Some(tls) = super::proxy_tls::load(config, data_dir, true)? {
        if let Some(files) = &tls.local_ca {
            eprintln!("{}", files.hint());
        }
        proxy = proxy.with_tls(tls.config);
    }
    Ok(ListeningProxy { proxy, listener })
}

/// A proxy with its listener, served until cancelled.
struct ListeningProxy {
    proxy: vmon_proxy::Proxy,
    listener: tokio::net::TcpListener,
}

impl ListeningProxy {
    async fn serve(self, cancel: CancellationToken) -> anyhow::Result<()> {
        self.proxy.serve(self.listener, cancel).await;
        Ok(())
    }
}

/// How long a failed first build waits before it is tried again.
const BASE_RETRY: Duration = Duration::from_secs(30);

/// Builds `base` (after the guest image, when the node builds one) until it succeeds, then
/// `code-interpreter-v1`. Creates answer 503 with the progress meanwhile.
async fn build_in_background(control: Arc<Control>, cancel: CancellationToken) {
    loop {
        match control.ensure_base().await {
            Ok(_) => break,
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                retry_secs = BASE_RETRY.as_secs(),
                "building the base template failed; creates answer 503 until it is built"
            ),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(BASE_RETRY) => {}
        }
    }
    if !control.config().prebuild_code_interpreter {
        return;
    }
    // Not needed to take creates: a create that names it meanwhile waits for this build.
    let alias = vmon_api::control::CODE_INTERPRETER;
    if let Err(e) = control.ensure_builtin(alias).await {
        tracing::warn!(
            alias,
            error = format!("{e:#}"),
            "building a builtin template failed; the first create that names it retries"
        );
    }
}

trait ThenOk {
    fn then_ok(self) -> impl std::future::Future<Output = anyhow::Result<()>> + Send;
}

impl<F: std::future::Future<Output = ()> + Send> ThenOk for F {
    async fn then_ok(self) -> anyhow::Result<()> {
        self.await;
        Ok(())
    }
}

pub fn exports(config: &Config, api_key: &str) -> String {
    format!(
        "export E2B_API_URL={}\nexport E2B_SANDBOX_URL={}\nexport E2B_API_KEY={}\n\
         export E2B_VOLUME_API_URL={}",
        config.api_url(),
        config.sandbox_url(),
        api_key,
        // The SDK's volume content calls ignore E2B_API_URL; the api serves /volumecontent.
        config.api_url(),
    )
}

/// The exports that make clients trust the proxy's local CA, when it serves one.
fn trust_exports(config: &Config, data_dir: &Path, proxy: bool) -> Option<String> {
    let files = super::proxy_tls::LocalCaFiles::paths(data_dir);
    (proxy && config.proxy_tls_cert.is_none() && files.ca.exists()).then(|| files.exports())
}

/// The first start creates the default team; its key's plaintext goes to a 0600 file. Each
/// step is safe to repeat, so a crash anywhere leaves a data dir the next start finishes: the
/// key is written to its file before any record names it; a team without its file (a crash
/// before the file, or a file deleted) gets a fresh key; a key in the file that no team holds
/// (a crash before the key's record) is added to the default team.
async fn bootstrap_team(
    records: &dyn Records,
    data_dir: &Path,
    config: &Config,
) -> anyhow::Result<String> {
    let key_file = data_dir.join(API_KEY_FILE);
    let kept = std::fs::read_to_string(&key_file)
        .ok()
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty());
    if let Some(key) = &kept {
        if records
            .team_by_key_hash(&vmon_api::ids::hash_key(key))
            .await?
            .is_some()
        {
            return Ok(key.clone());
        }
    }
    let key = match kept {
        Some(k) => k,
        None => {
            let k = vmon_api::ids::api_key();
            write_private(&key_file, &k)?;
            k
        }
    };
    let teams = records.teams().await?;
    let team = match teams.iter().find(|t| t.slug == "default") {
        Some(t) => t.clone(),
        None => {
            vmon_api::admin::create_team_only(
                records,
                "default",
                Some("default"),
                config.default_limits.clone(),
            )
            .await?
        }
    };
    records.add_key(&team.id, &key).await?;
    eprintln!(
        "vmon: the {} team's API key is {key} (kept in {})",
        team.slug,
        key_file.display()
    );
    Ok(key)
}

fn write_private(path: &Path, contents: &str) -> anyhow::Result<()> {
    vmon_vm::private::write(path, contents.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// Reads a secret file, creating it with a fresh token first.
pub fn secret_file(path: &Path) -> anyhow::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => Ok(s.trim().to_string()),
        _ => {
            let token = vmon_api::ids::token();
            write_private(path, &token)?;
            Ok(token)
        }
    }
}

async fn print_env_when_ready(
    data_dir: &Path,
    config: &Config,
    wait: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + wait;
    let health = format!("{}/health", config.api_url().trim_end_matches('/'));
    let client = crate::cmd::admin::ApiClient::for_config(config)?;
    loop {
        let key = std::fs::read_to_string(data_dir.join(API_KEY_FILE)).ok();
        if let Some(key) = key.filter(|k| !k.trim().is_empty()) {
            if matches!(
                client.request("GET", &health, &[], None).await,
                Ok((200, _))
            ) {
                println!("{}", exports(config, key.trim()));
                if let Some(trust) = trust_exports(config, data_dir, true) {
                    println!("{trust}");
                }
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "no ready vmon up answered at {health} within {}s (start one with `vmon up`; \
                 the first start builds the guest image and the base template)",
                wait.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn shutdown_on_signal(cancel: CancellationToken) {
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch SIGTERM");
                    let _ = tokio::signal::ctrl_c().await;
                    cancel.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        cancel.cancel();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn records(dir: &Path) -> StoreRecords {
        StoreRecords::open(&Config::default(), dir)
            .await
            .expect("store opens")
    }

    async fn holder(records: &StoreRecords, key: &str) -> Option<String> {
        records
            .team_by_key_hash(&vmon_api::ids::hash_key(key))
            .await
            .expect("lookup")
            .map(|t| t.slug)
    }

    #[tokio::test]
    async fn a_bootstrap_cut_short_anywhere_is_finished_by_the_next_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = records(dir.path()).await;
        let config = Config::default();
        // The first start: a team, its key in the file, the key valid.
        let key = bootstrap_team(&r, dir.path(), &config)
            .await
            .expect("first");
        assert_eq!(holder(&r, &key).await.as_deref(), Some("default"));
        let file = dir.path().join(API_KEY_FILE);
        assert_eq!(std::fs::read_to_string(&file).expect("file").trim(), key);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the key file is the owner's alone");
        // Starting again changes nothing.
        assert_eq!(
            bootstrap_team(&r, dir.path(), &config)
                .await
                .expect("again"),
            key
        );
        assert_eq!(r.teams().await.expect("teams").len(), 1);

        // A crash after the team, before the file (or the file deleted): a fresh key for it.
        std::fs::remove_file(&file).expect("rm");
        let fresh = bootstrap_team(&r, dir.path(), &config)
            .await
            .expect("no file");
        assert_ne!(fresh, key);
        assert_eq!(holder(&r, &fresh).await.as_deref(), Some("default"));
        assert_eq!(r.teams().await.expect("teams").len(), 1, "no second team");

        // A crash after the file, before any record (a fresh store, the file kept): the key
        // in the file becomes the new default team's.
        let dir2 = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir2.path().join(API_KEY_FILE),
            "e2b_kept_before_the_crash\n",
        )
        .expect("w");
        let r2 = records(dir2.path()).await;
        let kept = bootstrap_team(&r2, dir2.path(), &config)
            .await
            .expect("kept");
        assert_eq!(kept, "e2b_kept_before_the_crash");
        assert_eq!(holder(&r2, &kept).await.as_deref(), Some("default"));
    }
}
