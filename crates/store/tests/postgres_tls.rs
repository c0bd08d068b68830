//! The store over TLS to PostgreSQL: `sslmode=verify-full&sslrootcert=…` connects to a server
//! whose certificate that CA signed, and a server that takes only TLS turns away a client
//! without it or one that trusts another CA.

#![allow(clippy::unwrap_used)] // Tests: a failed unwrap is a failed test.

mod support;

use std::os::unix::fs::PermissionsExt;

use support::{id_of, Postgres, KEY};
use vmon_store::{Store, StoreConfig};

#[tokio::test]
async fn the_store_speaks_verified_tls_to_postgres() {
    let certs = tempfile::tempdir().unwrap();
    std::fs::set_permissions(certs.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (ca, ca_key) = vmon_proxy::tls::generate_ca().unwrap();
    let (chain, key) =
        vmon_proxy::tls::issue_server_cert(&ca, &ca_key, &["127.0.0.1".into()], 1).unwrap();
    let (other_ca, _) = vmon_proxy::tls::generate_ca().unwrap();
    let path = |name: &str| certs.path().join(name);
    std::fs::write(path("ca.pem"), &ca).unwrap();
    std::fs::write(path("other.pem"), &other_ca).unwrap();
    std::fs::write(path("server.pem"), &chain).unwrap();
    // PostgreSQL wants its key owner-only and its own.
    std::fs::write(path("server.key"), &key).unwrap();
    std::fs::set_permissions(path("server.key"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(path("server.key"), Some(id_of("-u")), Some(id_of("-g"))).unwrap();
    // Over TCP, TLS only.
    std::fs::write(
        path("hba.conf"),
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
    )
    .unwrap();
    let c = |k: &str, p: &str| vec!["-c".to_string(), format!("{k}={}", path(p).display())];
    let mut extra = vec!["-c".to_string(), "ssl=on".to_string()];
    extra.extend(c("ssl_cert_file", "server.pem"));
    extra.extend(c("ssl_key_file", "server.key"));
    extra.extend(c("hba_file", "hba.conf"));
    let pg = Postgres::start_with(false, extra).await;

    let url = |query: &str| format!("{}?{query}", pg.url());
    let verified = url(&format!(
        "sslmode=verify-full&sslrootcert={}",
        path("ca.pem").display()
    ));
    let store = Store::open(&StoreConfig::postgres(verified, KEY))
        .await
        .unwrap_or_else(|e| panic!("verified TLS: {e}\n{}", pg.log()));
    assert!(store.teams().await.unwrap().is_empty());

    for (what, query) in [
        ("no TLS", "sslmode=disable".to_string()),
        (
            "another CA",
            format!(
                "sslmode=verify-full&sslrootcert={}",
                path("other.pem").display()
            ),
        ),
    ] {
        let r = Store::open(&StoreConfig::postgres(url(&query), KEY)).await;
        assert!(r.is_err(), "{what}: the store connected");
    }
}
