//! The egress proxy end to end on loopback: a guest-side TLS client trusting the egress CA, the
//! proxy, and an upstream HTTPS server (a CA of the test's own, given as the extra CA) that
//! echoes the headers it received.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vmon_egress::{Egress, SlotRules};
use vmon_proto::egress::{EgressSpec, HeaderRule, HostRule, SecretValues};

const HOST: &str = "api.example.test";

/// An HTTPS server for `HOST` answering each request with its `authorization` headers.
async fn upstream(ca: &str, ca_key: &str) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    let (chain, key) =
        vmon_proxy::tls::issue_server_cert(ca, ca_key, &[HOST.to_string()], 1).expect("leaf");
    let tls = vmon_proxy::tls::from_pem(chain.as_bytes(), key.as_bytes()).expect("config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.clone());
            let counter = counter.clone();
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let auth: Vec<String> = req
                            .headers()
                            .get_all("authorization")
                            .iter()
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            .collect();
                        async move {
                            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                                Bytes::from(format!("auth={}", auth.join("|"))),
                            )))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (port, hits)
}

fn spec(value: &str) -> EgressSpec {
    EgressSpec {
        rules: vec![HostRule {
            host: HOST.into(),
            headers: vec![HeaderRule {
                name: "authorization".into(),
                template: "Bearer ${e2b.secrets.key}".into(),
            }],
        }],
        secrets: SecretValues(BTreeMap::from([("key".to_string(), value.to_string())])),
    }
}

/// One request from the "guest" through the proxy at `at`, asking for `name`; the raw answer.
async fn guest_request(
    at: SocketAddr,
    egress_ca: &str,
    name: &str,
    extra_headers: &str,
) -> std::io::Result<String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(egress_ca.as_bytes()).expect("ca"))
        .expect("root");
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(at).await?;
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from(name.to_string()).expect("name"), tcp)
        .await?;
    let req = format!(
        "GET /x HTTP/1.1\r\nHost: {name}\r\nAuthorization: guest-sent\r\n{extra_headers}Connection: close\r\n\r\n"
    );
    tls.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    let _ = tls.read_to_end(&mut out).await;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

struct Setup {
    egress_ca: String,
    listener: vmon_egress::Listener,
    hits: Arc<std::sync::atomic::AtomicUsize>,
    _dir: tempfile::TempDir,
}

async fn setup(trust_upstream: bool) -> Setup {
    let (up_ca, up_key) = vmon_egress::generate_ca().expect("upstream ca");
    let (port, hits) = upstream(&up_ca, &up_key).await;
    let dir = tempfile::tempdir().expect("tmp");
    let ca_file = dir.path().join("upstream-ca.pem");
    std::fs::write(&ca_file, &up_ca).expect("write");
    let (ca, key) = vmon_egress::generate_ca().expect("egress ca");
    let egress =
        Egress::new(ca.clone(), key, trust_upstream.then_some(ca_file.as_path())).expect("egress");
    let listener = egress
        .listen(
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            SlotRules {
                spec: spec("s3cret-one"),
                upstream: BTreeMap::from([(HOST.to_string(), vec![Ipv4Addr::LOCALHOST])]),
                upstream_port: port,
            },
        )
        .await
        .expect("listen");
    Setup {
        egress_ca: ca,
        listener,
        hits,
        _dir: dir,
    }
}

#[tokio::test]
async fn the_rule_header_carries_the_current_secret_and_replaces_the_guests() {
    let s = setup(true).await;
    let at = s.listener.local_addr();
    let answer = guest_request(at, &s.egress_ca, HOST, "")
        .await
        .expect("request");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("auth=Bearer s3cret-one"), "{answer}");
    s.listener.update(spec("s3cret-two"));
    let answer = guest_request(at, &s.egress_ca, HOST, "")
        .await
        .expect("request");
    assert!(answer.ends_with("auth=Bearer s3cret-two"), "{answer}");
    // A Host naming another host is refused, not forwarded.
    let before = s.hits.load(std::sync::atomic::Ordering::SeqCst);
    let answer = guest_request(at, &s.egress_ca, HOST, "Host: evil.example.test\r\n")
        .await
        .unwrap_or_default();
    assert!(!answer.contains("s3cret"), "{answer}");
    assert_eq!(s.hits.load(std::sync::atomic::Ordering::SeqCst), before);
}

#[tokio::test]
async fn names_without_rules_and_oversized_headers_are_refused() {
    let s = setup(true).await;
    let at = s.listener.local_addr();
    // The proxy has no certificate and no forwarding for a name the rules do not name.
    assert!(guest_request(at, &s.egress_ca, "other.example.test", "")
        .await
        .is_err_or_empty());
    // A header block past the bound never reaches the host.
    let big = format!(
        "X-Big: {}\r\n",
        "a".repeat(vmon_egress::MAX_HEADER_BYTES + 1)
    );
    let answer = guest_request(at, &s.egress_ca, HOST, &big)
        .await
        .unwrap_or_default();
    assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    let many: String = (0..=vmon_egress::MAX_HEADERS)
        .map(|i| format!("X-{i}: v\r\n"))
        .collect();
    let answer = guest_request(at, &s.egress_ca, HOST, &many)
        .await
        .unwrap_or_default();
    assert!(!answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(s.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_upstream_the_roots_do_not_vouch_for_gets_nothing() {
    let s = setup(false).await;
    let answer = guest_request(s.listener.local_addr(), &s.egress_ca, HOST, "")
        .await
        .expect("request");
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(!answer.contains("s3cret"), "{answer}");
    assert_eq!(s.hits.load(std::sync::atomic::Ordering::SeqCst), 0);
}

trait ErrOrEmpty {
    fn is_err_or_empty(&self) -> bool;
}

impl ErrOrEmpty for std::io::Result<String> {
    fn is_err_or_empty(&self) -> bool {
        self.as_ref().map_or(true, |s| s.is_empty())
    }
}
