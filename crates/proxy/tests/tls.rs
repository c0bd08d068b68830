//! TLS and plain HTTP on the proxy's one port: the first byte of a connection decides; TLS
//! with a local CA's per-name certificates or an operator's certificate, ALPN `h2` and
//! `http/1.1`, WebSocket-style upgrades through TLS.

#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use vmon_proxy::{tls, Proxy, ResumeError, Routes, SandboxRoute};

/// One running sandbox, `isbx`, whose guest is this machine.
struct OneSandbox;

#[async_trait::async_trait]
impl Routes for OneSandbox {
    async fn lookup(&self, id: &str) -> Option<SandboxRoute> {
        (id == "isbx").then(|| SandboxRoute {
            guest_ip: Some("127.0.0.1".parse().unwrap()),
            auto_resume: false,
            traffic_access_token: None,
            via: None,
            execution_id: None,
        })
    }
    async fn resume_for_traffic(&self, id: &str) -> Result<IpAddr, ResumeError> {
        Err(ResumeError::NotFound(id.into()))
    }
}

/// The guest: says which path it was asked for; `/ws` switches protocols and echoes.
async fn guest(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() == "/ws" {
        let mut req = req;
        tokio::spawn(async move {
            if let Ok(up) = hyper::upgrade::on(&mut req).await {
                let mut io = TokioIo::new(up);
                let mut buf = [0u8; 64];
                while let Ok(n) = io.read(&mut buf).await {
                    if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        });
        return Ok(Response::builder()
            .status(101)
            .header("connection", "upgrade")
            .header("upgrade", "test")
            .body(Full::new(Bytes::new()))
            .unwrap());
    }
    Ok(Response::new(Full::new(Bytes::from(format!(
        "guest saw {}",
        req.uri().path()
    )))))
}

async fn start_guest() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), hyper::service::service_fn(guest))
                    .with_upgrades()
                    .await;
            });
        }
    });
    port
}

async fn start_proxy(config: Arc<rustls::ServerConfig>) -> SocketAddr {
    start_proxy_with(config, vmon_proxy::listen::Limits::default()).await
}

async fn start_proxy_with(
    config: Arc<rustls::ServerConfig>,
    limits: vmon_proxy::listen::Limits,
) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(
        Proxy::new(Arc::new(OneSandbox))
            .with_tls(config)
            .serve_with(l, limits, CancellationToken::new()),
    );
    addr
}

fn local_ca(domains: &[String]) -> (String, Arc<rustls::ServerConfig>) {
    let (ca, key) = tls::generate_ca().unwrap();
    let local = tls::LocalCa::new(&ca, &key, domains).unwrap();
    (ca, tls::server_config(Arc::new(local)).unwrap())
}

fn client(ca_pem: &str, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

async fn tls_connect(
    addr: SocketAddr,
    ca_pem: &str,
    name: &str,
    alpn: &[&[u8]],
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from(name.to_string()).unwrap();
    client(ca_pem, alpn).connect(name, tcp).await
}

/// One request written by hand, the whole answer read back.
async fn raw<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, request: &str) -> String {
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn get(path: &str, host: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
}

#[tokio::test]
async fn tls_and_plain_http_share_the_port() {
    let port = start_guest().await;
    let (ca, config) = local_ca(&[]);
    let proxy = start_proxy(config).await;
    let host = format!("{port}-isbx.localhost");

    // Plain HTTP, as before.
    let plain = TcpStream::connect(proxy).await.unwrap();
    let r = raw(plain, &get("/plain", &host)).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.ends_with("guest saw /plain"), "{r}");

    // TLS on the same port, the certificate for exactly the name asked for.
    let s = tls_connect(proxy, &ca, &host, &[b"http/1.1"])
        .await
        .unwrap();
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let r = raw(s, &get("/secure", &format!("{host}:{}", proxy.port()))).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.ends_with("guest saw /secure"), "{r}");

    // A client that dials the address (no SNI) gets the localhost/loopback certificate.
    let s = tls_connect(proxy, &ca, "127.0.0.1", &[]).await.unwrap();
    let r = raw(
        s,
        &format!("GET /ip HTTP/1.1\r\nHost: 127.0.0.1\r\nE2b-Sandbox-Id: isbx\r\nE2b-Sandbox-Port: {port}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert!(r.ends_with("guest saw /ip"), "{r}");

    // Plain HTTP still works after TLS connections.
    let plain = TcpStream::connect(proxy).await.unwrap();
    let r = raw(plain, &get("/again", &host)).await;
    assert!(r.ends_with("guest saw /again"), "{r}");
}

#[tokio::test]
async fn http2_over_tls_by_alpn() {
    let port = start_guest().await;
    let (ca, config) = local_ca(&[]);
    let proxy = start_proxy(config).await;
    let host = format!("{port}-isbx.localhost");
    let s = tls_connect(proxy, &ca, &host, &[b"h2", b"http/1.1"])
        .await
        .unwrap();
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s))
            .await
            .unwrap();
    tokio::spawn(conn);
    for path in ["/one", "/two"] {
        let req = Request::get(format!("https://{host}:{}{path}", proxy.port()))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.version(), http::Version::HTTP_2);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, format!("guest saw {path}").as_bytes());
    }
}

#[tokio::test]
async fn upgrades_pass_through_tls() {
    let port = start_guest().await;
    let (ca, config) = local_ca(&[]);
    let proxy = start_proxy(config).await;
    let host = format!("{port}-isbx.localhost");
    let mut s = tls_connect(proxy, &ca, &host, &[b"http/1.1"])
        .await
        .unwrap();
    s.write_all(
        format!("GET /ws HTTP/1.1\r\nHost: {host}\r\nConnection: upgrade\r\nUpgrade: test\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.unwrap();
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s.write_all(b"ping over tls").await.unwrap();
    let mut echo = [0u8; 13];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echo, b"ping over tls");
}

#[tokio::test]
async fn the_local_ca_signs_only_its_domains() {
    let port = start_guest().await;
    let (ca, config) = local_ca(&["sbx.example.test:3001".to_string()]);
    let proxy = start_proxy(config).await;
    let host = format!("{port}-isbx.sbx.example.test");
    let s = tls_connect(proxy, &ca, &host, &[]).await.unwrap();
    let r = raw(s, &get("/domain", &host)).await;
    assert!(r.ends_with("guest saw /domain"), "{r}");
    // No certificate for a name outside them: the handshake fails, nothing is proxied.
    assert!(tls_connect(proxy, &ca, "example.com", &[]).await.is_err());
    assert!(tls_connect(proxy, &ca, "other.test", &[]).await.is_err());
    // A client that does not trust the CA refuses the proxy's certificate.
    let (stranger, _) = tls::generate_ca().unwrap();
    assert!(tls_connect(proxy, &stranger, &host, &[]).await.is_err());
}

#[tokio::test]
async fn an_operator_certificate() {
    let port = start_guest().await;
    // The operator's CA and a wildcard certificate it signed, as PEM files would hold them.
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["*.sandboxes.example.test".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &issuer)
        .unwrap();
    let chain = format!("{}{}", leaf.pem(), ca_cert.pem());
    let config = tls::from_pem(chain.as_bytes(), leaf_key.serialize_pem().as_bytes()).unwrap();
    let proxy = start_proxy(config).await;
    let host = format!("{port}-isbx.sandboxes.example.test");
    let s = tls_connect(proxy, &ca_cert.pem(), &host, &[b"http/1.1"])
        .await
        .unwrap();
    let r = raw(s, &get("/wild", &host)).await;
    assert!(r.ends_with("guest saw /wild"), "{r}");
    let plain = TcpStream::connect(proxy).await.unwrap();
    let r = raw(plain, &get("/clear", &host)).await;
    assert!(r.ends_with("guest saw /clear"), "{r}");
}

#[tokio::test]
async fn a_silent_or_stalled_handshake_is_dropped() {
    let (_, config) = local_ca(&[]);
    let limits = vmon_proxy::listen::Limits {
        header_read_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let proxy = start_proxy_with(config, limits).await;
    // Nothing sent: closed once the header timeout passes.
    let mut silent = TcpStream::connect(proxy).await.unwrap();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
        .await
        .expect("closed within the timeout");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    // A handshake record that never finishes: closed too.
    let mut stalled = TcpStream::connect(proxy).await.unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01, 0x00]).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), stalled.read(&mut buf))
        .await
        .expect("closed within the timeout");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
}

#[tokio::test]
async fn a_tls_only_listener_refuses_plain_http() {
    // What the api serves with `api_tls_cert`: an issued certificate, TLS alone on the port.
    let (ca, ca_key) = tls::generate_ca().unwrap();
    let (chain, key) = tls::issue_server_cert(&ca, &ca_key, &["127.0.0.1".into()], 1).unwrap();
    let config = tls::from_pem(chain.as_bytes(), key.as_bytes()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(format!(
            "api saw {}",
            req.uri().path()
        )))))
    });
    tokio::spawn(vmon_proxy::listen::serve_tls_only(
        listener,
        vmon_proxy::listen::Limits::default(),
        config,
        CancellationToken::new(),
        "api",
        service,
    ));

    let s = tls_connect(addr, &ca, "127.0.0.1", &[b"http/1.1"])
        .await
        .unwrap();
    let r = raw(s, &get("/admin/teams", "127.0.0.1")).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.ends_with("api saw /admin/teams"), "{r}");
    // Plain HTTP on the same port: no HTTP answer, the connection just ends.
    let plain = TcpStream::connect(addr).await.unwrap();
    let r = raw(plain, &get("/admin/teams", "127.0.0.1")).await;
    assert!(!r.contains("HTTP/1.1"), "{r}");
    // A client that trusts another CA fails the handshake.
    let (other, _) = tls::generate_ca().unwrap();
    assert!(tls_connect(addr, &other, "127.0.0.1", &[]).await.is_err());
}
