//! `vmon cert`: a CA of one's own and server certificates it signs, for TLS between a
//! cluster's processes (`scripts/cluster.sh` with `VMON_CLUSTER_TLS=1`) where no PKI exists.
//!
//! - `vmon cert ca --dir D`: `D/ca.pem`, `D/ca.key` (0600), made once (a second run keeps
//!   them), and `D/bundle.pem`: the system's CAs and this one, for `SSL_CERT_FILE`.
//! - `vmon cert issue --dir D --out P [--client] NAME...`: `P.pem` (the certificate for the
//!   names, DNS names or IP addresses, then the CA) and `P.key` (0600), signed by `D`'s CA;
//!   with `--client` also a TLS client certificate (etcd's members and clients).

use std::path::{Path, PathBuf};

use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    cmd: CertCmd,
}

#[derive(clap::Subcommand)]
enum CertCmd {
    /// Make the CA in `--dir` (kept when it exists) and its bundle with the system's CAs.
    Ca {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Issue a server certificate for NAMEs (DNS names, IP addresses) signed by `--dir`'s CA.
    Issue {
        #[arg(long)]
        dir: PathBuf,
        /// Writes `<out>.pem` (chain) and `<out>.key` (private key, 0600).
        #[arg(long)]
        out: PathBuf,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = 365)]
        days: i64,
        /// Valid as a TLS client certificate too (etcd's members and clients).
        #[arg(long)]
        client: bool,
        #[arg(required = true)]
        names: Vec<String>,
    },
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.cmd {
        CertCmd::Ca { dir } => {
            let (ca, _) = super::proxy_tls::ca_files(&dir)?;
            super::proxy_tls::write_bundle(&dir.join("bundle.pem"), &ca)?;
            println!("{}", dir.join("ca.pem").display());
            Ok(())
        }
        CertCmd::Issue {
            dir,
            out,
            days,
            client,
            names,
        } => issue(&dir, &out, days, client, &names),
    }
}

fn issue(dir: &Path, out: &Path, days: i64, client: bool, names: &[String]) -> anyhow::Result<()> {
    let read = |p: PathBuf| {
        std::fs::read_to_string(&p).with_context(|| {
            format!(
                "reading {} (make the CA with `vmon cert ca --dir {}`)",
                p.display(),
                dir.display()
            )
        })
    };
    let ca = read(dir.join("ca.pem"))?;
    let ca_key = read(dir.join("ca.key"))?;
    let (chain, key) = vmon_proxy::tls::issue_cert(&ca, &ca_key, names, days, client)
        .context("issuing the certificate")?;
    let with_ext = |ext: &str| {
        let mut p = out.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    let (cert_path, key_path) = (with_ext(".pem"), with_ext(".key"));
    vmon_vm::private::write(&key_path, key.as_bytes())
        .with_context(|| format!("writing {}", key_path.display()))?;
    std::fs::write(&cert_path, chain)
        .with_context(|| format!("writing {}", cert_path.display()))?;
    println!("{}", cert_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn issue_writes_a_chain_and_a_private_key() {
        let dir = tempfile::tempdir().expect("dir");
        let ca_dir = dir.path().join("ca");
        run(Args {
            cmd: CertCmd::Ca {
                dir: ca_dir.clone(),
            },
        })
        .expect("ca");
        let out = dir.path().join("node1");
        issue(&ca_dir, &out, 10, false, &["127.0.0.1".into()]).expect("issue");
        let key = dir.path().join("node1.key");
        let mode = std::fs::metadata(&key).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let server = vmon_node::tls::server_config(&dir.path().join("node1.pem"), &key, &[]);
        assert!(server.is_ok(), "{:?}", server.err());
        assert!(vmon_node::tls::ClientTls::from_ca_file(&ca_dir.join("ca.pem")).is_ok());
        let bundle = std::fs::read_to_string(ca_dir.join("bundle.pem")).expect("bundle");
        assert!(bundle.ends_with(&std::fs::read_to_string(ca_dir.join("ca.pem")).expect("ca")));
    }
}
