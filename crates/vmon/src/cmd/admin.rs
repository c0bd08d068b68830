//! Operator verbs: `vmon team create`, `vmon key create|list|revoke`,
//! `vmon sandbox list|kill|logs`. They talk to the running api's `/admin` routes with the admin
//! token `vmon up` keeps in the data dir, so the api stays the only writer of its records.

use std::path::Path;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use vmon_api::Config;

#[derive(clap::Args)]
pub struct Conn {
    /// TOML config file (default: `<data dir>/config.toml` when it exists).
    #[arg(long, env = "VMON_CONFIG", global = true)]
    pub config: Option<std::path::PathBuf>,
    /// The api's URL (default: from the config).
    #[arg(long, env = "VMON_ADMIN_URL", global = true)]
    pub url: Option<String>,
}

#[derive(clap::Args)]
pub struct TeamArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    cmd: TeamCmd,
}

#[derive(clap::Subcommand)]
enum TeamCmd {
    /// Create a team and its first API key (printed once).
    Create {
        name: String,
        /// Namespace of the team's snapshot names (default: from the name).
        #[arg(long)]
        slug: Option<String>,
        /// Concurrent running sandboxes (default: the config's default limits).
        #[arg(long)]
        max_concurrent: Option<u32>,
    },
    /// List teams.
    List,
}

#[derive(clap::Args)]
pub struct KeyArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    cmd: KeyCmd,
}

#[derive(clap::Subcommand)]
enum KeyCmd {
    /// Create another API key for a team (printed once).
    Create { team_id: String },
    /// List keys (masked).
    List {
        #[arg(long)]
        team: Option<String>,
    },
    /// Revoke a key by its id.
    Revoke { key_id: String },
}

#[derive(clap::Args)]
pub struct SandboxArgs {
    #[command(flatten)]
    conn: Conn,
    #[command(subcommand)]
    cmd: SandboxCmd,
}

#[derive(clap::Subcommand)]
enum SandboxCmd {
    /// Every team's sandboxes.
    List,
    /// Kill a sandbox (recorded with kill_reason "admin").
    Kill { sandbox_id: String },
    /// Print a sandbox's console log (kernel, init and envd lines; kept 7 days after it ends).
    Logs {
        sandbox_id: String,
        /// Keep printing new lines as they arrive.
        #[arg(short, long)]
        follow: bool,
        /// Only lines at this level or above: debug, info, warn, error.
        #[arg(long)]
        level: Option<String>,
    },
}

struct Client {
    base: String,
    token: String,
    config: Config,
    http: ApiClient,
}

impl Client {
    fn new(data_dir: &Path, conn: &Conn) -> anyhow::Result<Client> {
        let config = Config::load(conn.config.as_deref(), data_dir)?;
        let path = data_dir.join(super::up::ADMIN_TOKEN_FILE);
        let token = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading the admin token {} (is this the data dir of a vmon up?)",
                path.display()
            )
        })?;
        Ok(Client {
            base: conn
                .url
                .clone()
                .unwrap_or_else(|| config.api_url())
                .trim_end_matches('/')
                .to_string(),
            token: token.trim().to_string(),
            http: ApiClient::for_config(&config)?,
            config,
        })
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let (status, bytes) = self
            .http
            .request(
                method,
                &format!("{}{path}", self.base),
                &[("x-admin-token", &self.token)],
                body.map(|b| b.to_string()),
            )
            .await?;
        let json: serde_json::Value = if bytes.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned().into())
        };
        if !(200..300).contains(&status) {
            let msg = json["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| json.to_string());
            anyhow::bail!("{status}: {msg}");
        }
        Ok(json)
    }
}

/// A client of the api: `https://` verified against `api_ca_file` (`VMON_API_CA_FILE`), and
/// then nothing else (the admin token never travels in the clear once a CA is configured);
/// without a CA file, `http://` and `https://` verified against the system's CAs.
/// Connections are kept for reuse.
#[derive(Clone)]
pub struct ApiClient {
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
}

impl ApiClient {
    pub fn new(ca_file: Option<&Path>) -> anyhow::Result<ApiClient> {
        let tls = vmon_node::tls::ClientTls::from_optional_ca(ca_file)?;
        // hyper-rustls sets the ALPN itself.
        let mut config = (*tls.config()).clone();
        config.alpn_protocols.clear();
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config);
        let https = if tls.pinned() {
            builder.https_only()
        } else {
            builder.https_or_http()
        }
        .enable_http1()
        .build();
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(https);
        Ok(ApiClient { client })
    }

    /// The client the config asks for (`api_ca_file`).
    pub fn for_config(config: &Config) -> anyhow::Result<ApiClient> {
        ApiClient::new(config.api_ca_file.as_deref())
    }

    /// One HTTP/1.1 request; returns status and body.
    pub async fn request(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<String>,
    ) -> anyhow::Result<(u16, Bytes)> {
        let mut b = http::Request::builder().method(method).uri(url);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        if body.is_some() {
            b = b.header("content-type", "application/json");
        }
        let req = b.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        let resp = self
            .client
            .request(req)
            .await
            .with_context(|| format!("{method} {url}"))?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes))
    }
}

fn print(v: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

pub async fn team(data_dir: &Path, a: TeamArgs) -> anyhow::Result<()> {
    let c = Client::new(data_dir, &a.conn)?;
    match a.cmd {
        TeamCmd::Create {
            name,
            slug,
            max_concurrent,
        } => {
            let mut limits = c.config.default_limits.clone();
            if let Some(n) = max_concurrent {
                limits.max_concurrent = n;
            }
            let body = serde_json::json!({ "name": name, "slug": slug, "limits": limits });
            let r = c.call("POST", "/admin/teams", Some(body)).await?;
            eprintln!(
                "team {} created; its API key is printed once:",
                r["team"]["id"].as_str().unwrap_or("?")
            );
            println!("{}", r["apiKey"].as_str().unwrap_or(""));
        }
        TeamCmd::List => print(&c.call("GET", "/admin/teams", None).await?),
    }
    Ok(())
}

pub async fn key(data_dir: &Path, a: KeyArgs) -> anyhow::Result<()> {
    let c = Client::new(data_dir, &a.conn)?;
    match a.cmd {
        KeyCmd::Create { team_id } => {
            let r = c
                .call("POST", &format!("/admin/teams/{team_id}/keys"), None)
                .await?;
            eprintln!(
                "key {} created; printed once:",
                r["key"]["id"].as_str().unwrap_or("?")
            );
            println!("{}", r["apiKey"].as_str().unwrap_or(""));
        }
        KeyCmd::List { team } => {
            let path = match team {
                Some(t) => format!("/admin/keys?team={t}"),
                None => "/admin/keys".to_string(),
            };
            print(&c.call("GET", &path, None).await?);
        }
        KeyCmd::Revoke { key_id } => {
            c.call("DELETE", &format!("/admin/keys/{key_id}"), None)
                .await?;
            eprintln!("key {key_id} revoked");
        }
    }
    Ok(())
}

/// `vmon node list`: one line per registered node.
pub async fn nodes(data_dir: &Path, conn: &Conn) -> anyhow::Result<()> {
    let c = Client::new(data_dir, conn)?;
    let v = c.call("GET", "/admin/nodes", None).await?;
    let nodes = v.as_array().cloned().unwrap_or_default();
    if nodes.is_empty() {
        eprintln!("no cluster nodes (one machine, or none registered)");
    }
    println!("NODE\tSTATE\tHOST\tACCEL\tRUNNING\tFREE SLOTS\tFREE MEM MiB\tCPUS\tRPC");
    for n in nodes {
        println!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            n["id"].as_str().unwrap_or(""),
            n["state"].as_str().unwrap_or("active"),
            n["host"].as_str().unwrap_or(""),
            n["accel"].as_str().unwrap_or(""),
            n["running"],
            n["free_slots"],
            n["free_memory_mb"],
            n["vcpus"],
            n["rpc_url"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

/// `vmon node drain`: marks the node draining and, unless `no_wait`, prints its progress until
/// it is drained (or the drain stops).
pub async fn drain(data_dir: &Path, conn: &Conn, node: &str, no_wait: bool) -> anyhow::Result<()> {
    let c = Client::new(data_dir, conn)?;
    let path = format!("/admin/nodes/{node}/drain");
    c.call("POST", &path, None).await?;
    println!("node {node}: draining (no new work)");
    if no_wait {
        return Ok(());
    }
    let mut last = String::new();
    loop {
        let s = c.call("GET", &path, None).await?;
        let line = format!(
            "{}: migrated {}, paused {}, re-homed {}, remaining {}",
            s["state"].as_str().unwrap_or("?"),
            s["migrated"],
            s["paused"],
            s["rehomed"],
            s["remaining"]
        );
        if line != last {
            println!("node {node}: {line}");
            last = line;
        }
        match s["state"].as_str() {
            Some("drained") => break,
            Some("stopped") => anyhow::bail!("the drain of {node} was stopped (undrained)"),
            _ => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
        }
    }
    let s = c.call("GET", &path, None).await?;
    for e in s["errors"].as_array().into_iter().flatten() {
        eprintln!("  {}", e.as_str().unwrap_or(""));
    }
    println!("node {node}: drained");
    Ok(())
}

/// `vmon node undrain`.
pub async fn undrain(data_dir: &Path, conn: &Conn, node: &str) -> anyhow::Result<()> {
    let c = Client::new(data_dir, conn)?;
    c.call("DELETE", &format!("/admin/nodes/{node}/drain"), None)
        .await?;
    println!("node {node}: takes new work");
    Ok(())
}

/// `vmon node migrate`: live-migrates one running sandbox.
pub async fn migrate(
    data_dir: &Path,
    conn: &Conn,
    sandbox_id: &str,
    to: Option<&str>,
) -> anyhow::Result<()> {
    let c = Client::new(data_dir, conn)?;
    let body = serde_json::json!({ "node": to });
    let r = c
        .call(
            "POST",
            &format!("/admin/sandboxes/{sandbox_id}/migrate"),
            Some(body),
        )
        .await?;
    println!(
        "{sandbox_id}: {} -> {} in {} ms (switch {} ms, {} MiB memory in {} rounds, {} MiB disk)",
        r["from"].as_str().unwrap_or("?"),
        r["to"].as_str().unwrap_or("?"),
        r["totalMs"],
        r["switchMs"],
        r["ramBytes"].as_u64().unwrap_or(0) >> 20,
        r["rounds"],
        r["diskBytes"].as_u64().unwrap_or(0) >> 20
    );
    Ok(())
}

pub async fn sandbox(data_dir: &Path, a: SandboxArgs) -> anyhow::Result<()> {
    let c = Client::new(data_dir, &a.conn)?;
    match a.cmd {
        SandboxCmd::List => {
            let v = c.call("GET", "/admin/sandboxes", None).await?;
            for s in v.as_array().into_iter().flatten() {
                println!(
                    "{}\t{}\t{}\t{}\t{}",
                    s["sandboxID"].as_str().unwrap_or(""),
                    s["state"].as_str().unwrap_or(""),
                    s["teamID"].as_str().unwrap_or(""),
                    s["templateID"].as_str().unwrap_or(""),
                    s["endAt"].as_str().unwrap_or("")
                );
            }
        }
        SandboxCmd::Kill { sandbox_id } => {
            c.call("DELETE", &format!("/admin/sandboxes/{sandbox_id}"), None)
                .await?;
            eprintln!("sandbox {sandbox_id} killed");
        }
        SandboxCmd::Logs {
            sandbox_id,
            follow,
            level,
        } => logs(&c, &sandbox_id, follow, level.as_deref()).await?,
    }
    Ok(())
}

/// Pages through `/admin/sandboxes/{id}/logs` from the first entry on; with `follow`, polls
/// for new ones every second. Entries sharing the last printed millisecond are not repeated.
async fn logs(c: &Client, id: &str, follow: bool, level: Option<&str>) -> anyhow::Result<()> {
    const PAGE: usize = 1000;
    let mut cursor: Option<i64> = None;
    let mut seen_at_cursor = 0usize;
    loop {
        let mut path = format!("/admin/sandboxes/{id}/logs?limit={PAGE}");
        if let Some(c) = cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        if let Some(l) = level {
            path.push_str(&format!("&level={l}"));
        }
        let page: Vec<vmon_proto::node::LogEntry> =
            serde_json::from_value(c.call("GET", &path, None).await?)?;
        let full = page.len() == PAGE;
        let mut skip = if cursor.is_some() { seen_at_cursor } else { 0 };
        for e in &page {
            if Some(e.timestamp_ms) == cursor && skip > 0 {
                skip -= 1;
                continue;
            }
            let fields: Vec<String> = e.fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!(
                "{} {:5} {} {}",
                vmon_api::telemetry::rfc3339_ms(e.timestamp_ms),
                e.level.as_str(),
                e.message,
                fields.join(" ")
            );
            if Some(e.timestamp_ms) == cursor {
                seen_at_cursor += 1;
            } else {
                cursor = Some(e.timestamp_ms);
                seen_at_cursor = 1;
            }
        }
        if full && page.iter().all(|e| Some(e.timestamp_ms) == cursor) {
            // A whole page within one millisecond: step past it rather than loop forever.
            cursor = cursor.map(|c| c + 1);
            seen_at_cursor = 0;
        }
        if !full {
            if !follow {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }
}
