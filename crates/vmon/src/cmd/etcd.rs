//! The etcd connection of a cluster's processes (`vmon api --etcd`, `vmon node --etcd`): the
//! member URLs and the client TLS every one of them uses. A cluster's etcd takes only TLS
//! clients with a certificate of the cluster's CA (`scripts/cluster.sh`): so there is no
//! plain-http etcd in cluster mode.

use std::path::PathBuf;

#[derive(clap::Args, Clone, Debug)]
pub struct EtcdArgs {
    /// etcd client URLs (comma-separated, `https://host:port`).
    #[arg(long = "etcd", env = "VMON_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub endpoints: Vec<String>,
    /// The CA (PEM) etcd's member certificates are verified against; nothing else is trusted.
    #[arg(long, env = "VMON_ETCD_CA_FILE")]
    pub etcd_ca: Option<PathBuf>,
    /// This process's client certificate for etcd (PEM, signed by the cluster's CA).
    #[arg(long, env = "VMON_ETCD_CERT_FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// The key of `--etcd-cert` (PEM).
    #[arg(long, env = "VMON_ETCD_KEY_FILE")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    /// The KV's etcd configuration: all three TLS files are required.
    pub fn config(&self) -> anyhow::Result<vmon_kv::EtcdConfig> {
        let (Some(ca), Some(cert), Some(key)) = (&self.etcd_ca, &self.etcd_cert, &self.etcd_key)
        else {
            anyhow::bail!(
                "a cluster's etcd is reached over TLS with a client certificate: set --etcd-ca, \
                 --etcd-cert and --etcd-key (VMON_ETCD_CA_FILE, VMON_ETCD_CERT_FILE, \
                 VMON_ETCD_KEY_FILE)"
            );
        };
        let mut config = vmon_kv::EtcdConfig::new(self.endpoints.clone());
        config.tls = Some(vmon_kv::EtcdTls {
            ca_file: ca.clone(),
            cert_file: cert.clone(),
            key_file: key.clone(),
        });
        Ok(config)
    }

    /// [`EtcdArgs::config`], connected.
    pub async fn connect(&self) -> anyhow::Result<vmon_kv::Kv> {
        use anyhow::Context;
        vmon_kv::Kv::connect_etcd(&self.config()?)
            .await
            .context("connecting to etcd")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_etcd_needs_client_tls() {
        let mut args = EtcdArgs {
            endpoints: vec!["https://127.0.0.1:2379".into()],
            etcd_ca: Some("ca.pem".into()),
            etcd_cert: Some("c.pem".into()),
            etcd_key: None,
        };
        assert!(args.config().is_err());
        args.etcd_key = Some("c.key".into());
        let config = args.config().expect("config");
        assert!(config.tls.is_some());
    }
}
