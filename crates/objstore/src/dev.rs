//! A throwaway single-node garage for tests (this crate's and the node's), started through
//! `scripts/garage-dev.sh` so that the script the cluster scripts call is the one tested.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use crate::ObjectStoreConfig;

/// Where `scripts/install-garage.sh` puts the binary.
pub fn garage_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("VMON_GARAGE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let tools = std::env::var_os("VMON_TOOLS_DIR")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/vmon-tools"));
    tools.join("garage-2.5.0/bin/garage")
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/garage-dev.sh")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A running garage on loopback ports of its own; stopped when dropped.
pub struct DevGarage {
    dir: PathBuf,
    pub config: ObjectStoreConfig,
}

impl DevGarage {
    /// Starts one in `dir` (which it owns from now on). Fails, saying what to run, when the
    /// garage binary is not installed.
    pub fn start(dir: &Path) -> anyhow::Result<DevGarage> {
        let bin = garage_binary();
        if !bin.exists() {
            bail!(
                "garage is not installed at {}: run scripts/install-garage.sh (scripts/install-test-deps.sh does)",
                bin.display()
            );
        }
        let ports = [free_port()?, free_port()?, free_port()?];
        let out = std::process::Command::new(script())
            .arg("start")
            .arg(dir)
            .args(ports.iter().map(|p| p.to_string()))
            .env("VMON_GARAGE", &bin)
            .output()
            .context("running scripts/garage-dev.sh")?;
        if !out.status.success() {
            bail!(
                "scripts/garage-dev.sh failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let vars: std::collections::HashMap<String, String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("export "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let config = ObjectStoreConfig::from_lookup(|k| vars.get(k).cloned())?
            .context("scripts/garage-dev.sh printed no VMON_S3_ENDPOINT")?;
        Ok(DevGarage {
            dir: dir.to_path_buf(),
            config,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for DevGarage {
    fn drop(&mut self) {
        let _ = std::process::Command::new(script())
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}
