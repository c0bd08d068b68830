//! etcd over TLS with client certificates, as a cluster runs it (`scripts/cluster.sh`): the
//! KV's client with the cluster CA's certificate works; a client without a certificate, or
//! with one of another CA, is turned away; plain http endpoints with TLS configured are a
//! configuration error. A real etcd member on loopback.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use vmon_kv::{EtcdConfig, EtcdTls, Kv};

fn ca() -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "test CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("ca");
    (cert.pem(), Issuer::new(params, key))
}

/// A certificate for 127.0.0.1 usable by servers and clients: (chain PEM, key PEM).
fn leaf(issuer: &Issuer<'static, KeyPair>) -> (String, String) {
    let mut params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()]).expect("params");
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, issuer).expect("sign");
    (cert.pem(), key.serialize_pem())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

struct Member(Child);

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn etcd(dir: &Path, client_port: u16) -> Member {
    let peer = format!("https://127.0.0.1:{}", free_port());
    let client = format!("https://127.0.0.1:{client_port}");
    let f = |n: &str| dir.join(n).display().to_string();
    let log = std::fs::File::create(dir.join("etcd.log")).expect("log");
    let child = Command::new("/usr/bin/etcd")
        .args(["--name", "m1", "--data-dir", &f("data")])
        .args([
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
        ])
        .args([
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
        ])
        .args(["--initial-cluster", &format!("m1={peer}")])
        .args([
            "--cert-file",
            &f("server.pem"),
            "--key-file",
            &f("server.key"),
        ])
        .args(["--trusted-ca-file", &f("ca.pem"), "--client-cert-auth"])
        .args([
            "--peer-cert-file",
            &f("server.pem"),
            "--peer-key-file",
            &f("server.key"),
        ])
        .args([
            "--peer-trusted-ca-file",
            &f("ca.pem"),
            "--peer-client-cert-auth",
        ])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("etcd (apt-get install etcd-server)");
    Member(child)
}

#[tokio::test]
async fn etcd_takes_the_cluster_cas_clients_only() {
    let dir = tempfile::tempdir().expect("dir");
    let d = dir.path();
    let (ca_pem, issuer) = ca();
    let (server, server_key) = leaf(&issuer);
    let (client, client_key) = leaf(&issuer);
    let (_, other_issuer) = ca();
    let (stranger, stranger_key) = leaf(&other_issuer);
    for (name, pem) in [
        ("ca.pem", &ca_pem),
        ("server.pem", &server),
        ("server.key", &server_key),
        ("client.pem", &client),
        ("client.key", &client_key),
        ("stranger.pem", &stranger),
        ("stranger.key", &stranger_key),
    ] {
        std::fs::write(d.join(name), pem).expect("write");
    }
    let port = free_port();
    let _member = etcd(d, port);
    let endpoint = format!("https://127.0.0.1:{port}");
    let config = |cert: &str, key: &str| {
        let mut c = EtcdConfig::new(vec![endpoint.clone()]);
        c.retry_for = Duration::from_secs(2);
        c.tls = Some(EtcdTls {
            ca_file: d.join("ca.pem"),
            cert_file: d.join(cert),
            key_file: d.join(key),
        });
        c
    };

    // The cluster CA's client: a write and a read back (etcd may take a moment to start).
    let mut kv = None;
    for _ in 0..100 {
        if let Ok(k) = Kv::connect_etcd(&config("client.pem", "client.key")).await {
            if k.put("tls-probe", b"yes".to_vec()).await.is_ok() {
                kv = Some(k);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let kv = kv.expect("the cluster CA's client reaches etcd over TLS");
    let got = kv.get("tls-probe").await.expect("get").expect("the key");
    assert_eq!(got.value, b"yes");

    // A client certificate of another CA: nothing read or written.
    let refused = match Kv::connect_etcd(&config("stranger.pem", "stranger.key")).await {
        Err(_) => true,
        Ok(k) => k.get("tls-probe").await.is_err(),
    };
    assert!(refused, "etcd took a client certificate of another CA");

    // No client certificate at all (the CA only, as a curious local user would try).
    let tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(ca_pem.clone()));
    let options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(2))
        .with_tls(tls);
    let anonymous = match etcd_client::Client::connect([endpoint.clone()], Some(options)).await {
        Err(_) => true,
        Ok(mut c) => c.get("/", None).await.is_err(),
    };
    assert!(anonymous, "etcd answered a client without a certificate");

    // TLS configured but an http endpoint: a configuration error, not a plain connection.
    let mut plain = config("client.pem", "client.key");
    plain.endpoints = vec![format!("http://127.0.0.1:{port}")];
    assert!(Kv::connect_etcd(&plain).await.is_err());
}
