//! Operator verbs: `vmon team create`, `vmon key create|list|revoke`,
//! `vmon sandbox list|kill`. They talk to the running api's `/admin` routes with the admin
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
}

struct Client {
    base: String,
    token: String,
    config: Config,
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
            config,
        })
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let (status, bytes) = request(
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

/// One HTTP/1.1 request (plain http only); returns status and body.
pub async fn request(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<String>,
) -> anyhow::Result<(u16, Bytes)> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut b = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    let req = b.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
    let resp = client
        .request(req)
        .await
        .with_context(|| format!("{method} {url}"))?;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await?.to_bytes();
    Ok((status, bytes))
}

pub async fn http_status(url: &str) -> anyhow::Result<u16> {
    Ok(request("GET", url, &[], None).await?.0)
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
    }
    Ok(())
}
