//! `vmon proxy`: the sandbox traffic proxy as its own process. It learns routes from the api's
//! `/admin/routes` (with the admin token of the data dir) and asks it to resume paused
//! sandboxes on traffic.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use vmon_api::admin::RouteInfo;
use vmon_proxy::{ResumeError, Routes, SandboxRoute};

#[derive(clap::Args)]
pub struct Args {
    /// TOML config file (default: `<data dir>/config.toml` when it exists).
    #[arg(long, env = "VMON_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// The host this proxy runs on, as nodes register theirs (default: the hostname). In a
    /// cluster, traffic for a sandbox on another host goes to that host's ingress.
    #[arg(long, env = "VMON_PROXY_HOST")]
    pub host: Option<String>,
    /// Api replicas to ask (comma-separated), tried in turn when one does not answer
    /// (default: the config's `api_url`).
    #[arg(long, env = "VMON_PROXY_API_URLS", value_delimiter = ',')]
    pub api: Vec<String>,
    /// How often the proxy reports its sandboxes' traffic to the api (idle auto-suspend), in
    /// seconds. A sandbox is suspended at most this much later than its window.
    #[arg(long, env = "VMON_PROXY_ACTIVITY_SECS", default_value_t = 5)]
    pub activity_secs: u64,
}

/// Stamps idle longer than this are dropped from the proxy's table.
const FORGET_ACTIVITY: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

struct ApiRoutes {
    /// The api replicas; the one that answered last is asked first.
    bases: Vec<String>,
    first: std::sync::atomic::AtomicUsize,
    token: String,
    host: String,
    http: super::admin::ApiClient,
}

impl ApiRoutes {
    async fn get(&self, method: &str, path: &str) -> Result<RouteInfo, (u16, String)> {
        use std::sync::atomic::Ordering;
        let n = self.bases.len().max(1);
        let start = self.first.load(Ordering::Relaxed);
        let mut answer = Err((502u16, "no api replica is configured".to_string()));
        for k in 0..n {
            let i = (start + k) % n;
            let Some(base) = self.bases.get(i) else {
                break;
            };
            let url = format!("{base}{path}");
            match self
                .http
                .request(method, &url, &[("x-admin-token", &self.token)], None)
                .await
            {
                // This replica answers but cannot serve (cut from its stores: 503): the next
                // one may (the checker found a proxied request answered "not found" while
                // one replica was cut off).
                Ok((status, body)) if status >= 500 => answer = Ok((status, body)),
                Ok(a) => {
                    self.first.store(i, Ordering::Relaxed);
                    answer = Ok(a);
                    break;
                }
                // This replica is down: the next one answers for the same sandboxes.
                Err(e) => answer = Err((502u16, format!("{url}: {e:#}"))),
            }
        }
        let (status, body) = answer?;
        if status != 200 {
            let msg = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_string))
                .unwrap_or_default();
            return Err((status, msg));
        }
        serde_json::from_slice(&body).map_err(|e| (502, e.to_string()))
    }
}

impl ApiRoutes {
    /// Sends the sandboxes with traffic in the last `within` to `POST /admin/activity` (the
    /// first replica that takes it).
    async fn report(&self, activity: &vmon_proxy::Activity, within: std::time::Duration) {
        use std::sync::atomic::Ordering;
        let sandboxes = activity.report(within, FORGET_ACTIVITY);
        if sandboxes.is_empty() {
            return;
        }
        let body = match serde_json::to_string(&vmon_api::admin::ActivityReport { sandboxes }) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "encoding the activity report failed");
                return;
            }
        };
        let n = self.bases.len().max(1);
        let start = self.first.load(Ordering::Relaxed);
        for k in 0..n {
            let Some(base) = self.bases.get((start + k) % n) else {
                break;
            };
            let url = format!("{base}/admin/activity");
            match self
                .http
                .request(
                    "POST",
                    &url,
                    &[("x-admin-token", &self.token)],
                    Some(body.clone()),
                )
                .await
            {
                Ok((204, _)) => return,
                Ok((status, _)) => {
                    tracing::warn!(%url, status, "the api refused the activity report");
                    return;
                }
                Err(e) => tracing::debug!(%url, error = %e, "activity report failed; next replica"),
            }
        }
    }
}

#[async_trait::async_trait]
impl Routes for ApiRoutes {
    async fn lookup(&self, sandbox_id: &str) -> Option<SandboxRoute> {
        let r = self
            .get("GET", &format!("/admin/routes/{sandbox_id}"))
            .await
            .ok()?;
        let via = match (&r.node_host, &r.ingress_url) {
            (Some(h), Some(ingress)) if *h != self.host => ingress_addr(ingress).await,
            _ => None,
        };
        Some(SandboxRoute {
            guest_ip: r.guest_ip,
            auto_resume: r.auto_resume,
            traffic_access_token: r.traffic_access_token,
            via,
            execution_id: r.execution_id,
        })
    }

    async fn resume_for_traffic(&self, sandbox_id: &str) -> Result<IpAddr, ResumeError> {
        match self
            .get("POST", &format!("/admin/routes/{sandbox_id}/resume"))
            .await
        {
            Ok(RouteInfo {
                guest_ip: Some(ip), ..
            }) => Ok(ip),
            Ok(_) => Err(ResumeError::Failed("the api returned no address".into())),
            Err((404, _)) => Err(ResumeError::NotFound(sandbox_id.to_string())),
            Err((409, m)) => Err(ResumeError::Refused(m)),
            Err((_, m)) => Err(ResumeError::Failed(m)),
        }
    }
}

/// `http://host:port` (a node's registered ingress) as an address to connect to.
async fn ingress_addr(url: &str) -> Option<std::net::SocketAddr> {
    let hostport = url
        .strip_prefix("http://")
        .unwrap_or(url)
        .trim_end_matches('/');
    match tokio::net::lookup_host(hostport).await {
        Ok(mut addrs) => addrs.next(),
        Err(e) => {
            tracing::warn!(ingress = url, error = %e, "a node's ingress does not resolve");
            None
        }
    }
}

pub async fn run(data_dir: &Path, args: Args) -> anyhow::Result<()> {
    let config = vmon_api::Config::load(args.config.as_deref(), data_dir)?;
    let token_file = data_dir.join(super::up::ADMIN_TOKEN_FILE);
    let token = std::fs::read_to_string(&token_file).with_context(|| {
        format!(
            "reading {} (start `vmon api` with this data dir first)",
            token_file.display()
        )
    })?;
    let host = args.host.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default()
    });
    let bases: Vec<String> = if args.api.is_empty() {
        vec![config.api_url().trim_end_matches('/').to_string()]
    } else {
        args.api
            .iter()
            .map(|u| u.trim().trim_end_matches('/').to_string())
            .filter(|u| !u.is_empty())
            .collect()
    };
    let routes = ApiRoutes {
        bases,
        first: std::sync::atomic::AtomicUsize::new(0),
        token: token.trim().to_string(),
        host,
        http: super::admin::ApiClient::for_config(&config)
            .context("the proxy's client of the api (api_ca_file, VMON_API_CA_FILE)")?,
    };
    let listener = tokio::net::TcpListener::bind(config.proxy_listen)
        .await
        .with_context(|| format!("binding the proxy to {}", config.proxy_listen))?;
    tracing::info!(listen = %config.proxy_listen, api = %routes.bases.join(","), "proxy ready");
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        c.cancel();
    });
    let routes = Arc::new(routes);
    let mut proxy =
        vmon_proxy::Proxy::new(routes.clone()).with_limits(config.proxy_limits.guest_limits());
    {
        // Traffic reports for the api's idle scan: what had traffic since the last one (and a
        // little more, so a report lost on the way is covered by the next).
        let activity = proxy.activity().clone();
        let every = std::time::Duration::from_secs(args.activity_secs.max(1));
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tick.tick() => routes.report(&activity, every * 3).await,
                }
            }
        });
    }
    if let Some(tls) = super::proxy_tls::load(&config, data_dir, false)? {
        proxy = proxy.with_tls(tls.config);
    }
    proxy.serve(listener, cancel).await;
    Ok(())
}
