//! A cluster's node proves its id: a client made with `RemoteNode::cluster_node` completes a
//! TLS handshake only with a certificate of the cluster's CA that names the expected node
//! (`<id>.node.vmon`), whatever the address; otherwise it sends nothing, so never the token.
//! Real TLS servers on loopback (rustls), no VM.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::AsyncReadExt;
use vmon_node::rpc::RemoteNode;
use vmon_node::tls::{server_config, ClientTls};
use vmon_proto::node::{NodeCalls, NodeError};
use vmon_proxy::tls::{generate_ca, issue_server_cert};

/// A TLS server that counts completed handshakes and keeps the plaintext it is sent.
struct Server {
    url: String,
    handshakes: Arc<AtomicUsize>,
    received: Arc<Mutex<Vec<u8>>>,
}

async fn serve(cert: &Path, key: &Path) -> Server {
    let config = server_config(cert, key, &[b"http/1.1"]).expect("server tls");
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("https://{}", listener.local_addr().expect("addr"));
    let handshakes = Arc::new(AtomicUsize::new(0));
    let received = Arc::new(Mutex::new(Vec::new()));
    let (h, r) = (handshakes.clone(), received.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, h, r) = (acceptor.clone(), h.clone(), r.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(stream).await else {
                    return;
                };
                h.fetch_add(1, Ordering::SeqCst);
                let mut buf = vec![0u8; 4096];
                let read =
                    tokio::time::timeout(std::time::Duration::from_millis(500), tls.read(&mut buf))
                        .await;
                if let Ok(Ok(n)) = read {
                    r.lock().expect("lock").extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    Server {
        url,
        handshakes,
        received,
    }
}

/// The count once it reaches `want` (the server finishes a handshake after the client), or
/// after a second.
async fn settled(count: &AtomicUsize, want: usize) -> usize {
    for _ in 0..20 {
        if count.load(Ordering::SeqCst) >= want {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    count.load(Ordering::SeqCst)
}

fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let p = dir.join(name);
    vmon_vm::private::write(&p, pem.as_bytes()).expect("write");
    p
}

#[tokio::test]
async fn only_a_certificate_of_the_cluster_ca_naming_the_node_gets_a_request() {
    let dir = tempfile::tempdir().expect("dir");
    let d = dir.path();
    let (ca, ca_key) = generate_ca().expect("ca");
    let ca_path = write(d, "ca.pem", &ca);
    let names = |id: &str| vec!["127.0.0.1".to_string(), format!("{id}.node.vmon")];
    let (chain, key) = issue_server_cert(&ca, &ca_key, &names("node1"), 1).expect("node1");
    let node1 = serve(&write(d, "n1.pem", &chain), &write(d, "n1.key", &key)).await;
    // Another node's certificate, of the same CA (a compromised node2 would hold it).
    let (chain, key) = issue_server_cert(&ca, &ca_key, &names("node2"), 1).expect("node2");
    let node2 = serve(&write(d, "n2.pem", &chain), &write(d, "n2.key", &key)).await;
    // The right name from another CA (self-made).
    let (other_ca, other_key) = generate_ca().expect("other ca");
    let (chain, key) = issue_server_cert(&other_ca, &other_key, &names("node1"), 1).expect("other");
    let forged = serve(&write(d, "f.pem", &chain), &write(d, "f.key", &key)).await;

    let trust = ClientTls::from_ca_file(&ca_path).expect("cluster ca");
    let client = |url: &str, id: &str| {
        RemoteNode::cluster_node(url, id, "s3cret-token".into(), &trust).expect("client")
    };
    assert!(client(&node1.url, "node1").verify().await.expect("reached"));
    assert_eq!(settled(&node1.handshakes, 1).await, 1);

    for (server, claimed) in [(&node2, "node1"), (&forged, "node1"), (&node1, "node3")] {
        let c = client(&server.url, claimed);
        assert!(
            !c.verify().await.expect("reached"),
            "{claimed} at {}",
            server.url
        );
        match c.list_running().await {
            Err(NodeError::Failed(m)) => assert!(m.contains("certificate"), "{m}"),
            other => panic!("a node that is not {claimed} answered: {other:?}"),
        }
    }
    // node1 saw only the one verified handshake (with no request); the others none at all.
    assert_eq!(settled(&node1.handshakes, 2).await, 1);
    assert_eq!(settled(&node2.handshakes, 1).await, 0);
    assert_eq!(settled(&forged.handshakes, 1).await, 0);
    for s in [&node1, &node2, &forged] {
        let got = s.received.lock().expect("lock");
        assert!(
            !got.windows(12).any(|w| w == b"s3cret-token"),
            "the token reached {}",
            s.url
        );
    }

    // Plain http, a system-CA client and an id no certificate can name are refused up front.
    let port = node1.url.rsplit(':').next().expect("port");
    assert!(RemoteNode::cluster_node(
        &format!("http://127.0.0.1:{port}"),
        "node1",
        "t".into(),
        &trust
    )
    .is_err());
    let system = ClientTls::system().expect("system roots");
    assert!(RemoteNode::cluster_node(&node1.url, "node1", "t".into(), &system).is_err());
    assert!(RemoteNode::cluster_node(&node1.url, "a.b", "t".into(), &trust).is_err());
}
