//! Node RPC: the api side's `RemoteNode` driving a real node through `rpc::serve`.

mod common;

use std::sync::Arc;

use common::{host_lock, node, runtime, sh, template, unique, READ_TOKEN, TOKEN_SERVER};
use vmon_node::rpc::{serve, RemoteNode};
use vmon_proto::node::{NetworkPolicy, NodeCalls, NodeControl, NodeError, StartSpec};

#[test]
fn a_remote_node_creates_pauses_resumes_and_kills() {
    let node = node();
    let _shared = host_lock().read();
    let tpl = template(&node);
    runtime().block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cancel = tokio_util::sync::CancellationToken::new();
        let served: Arc<dyn NodeControl> = node.clone();
        let server = tokio::spawn(serve(listener, served, "s3cret".into(), cancel.clone()));
        let remote = RemoteNode::new(&format!("http://{addr}"), "s3cret".into()).expect("client");
        let wrong = RemoteNode::new(&format!("http://{addr}"), "nope".into()).expect("client");

        let info = remote.build_info(&tpl).await.expect("build_info over RPC");
        assert!(info.has_memory);
        assert!(
            matches!(wrong.build_info(&tpl).await, Err(NodeError::Failed(m)) if m.contains("401"))
        );
        assert!(matches!(
            remote.build_info("no-such-build").await,
            Err(NodeError::BuildNotFound(_))
        ));

        let id = unique("rpc");
        let r = remote
            .start(StartSpec {
                egress: Default::default(),
                gpus: 0,
                volumes: Vec::new(),
                sandbox_id: id.clone(),
                execution_id: unique("e"),
                build_id: tpl.clone(),
                cold_boot: false,
                env_vars: Default::default(),
                envd_access_token: Some("t".into()),
                network: NetworkPolicy {
                    allow_internet_access: true,
                    ..Default::default()
                },
            })
            .await
            .expect("start over RPC");
        sh(&node, &id, TOKEN_SERVER).await;
        let token = sh(&node, &id, READ_TOKEN).await;
        // The checked call: an RPC failure shows as itself, not as an empty list.
        assert!(remote
            .list_running()
            .await
            .expect("list_running over RPC")
            .iter()
            .any(|s| s.sandbox_id == id));
        let b = remote
            .pause(&id, &r.execution_id, true)
            .await
            .expect("pause over RPC");
        let r2 = remote
            .start(StartSpec {
                egress: Default::default(),
                gpus: 0,
                volumes: Vec::new(),
                sandbox_id: id.clone(),
                execution_id: unique("e"),
                build_id: b.build_id.clone(),
                cold_boot: false,
                env_vars: Default::default(),
                envd_access_token: Some("t".into()),
                network: NetworkPolicy {
                    allow_internet_access: true,
                    ..Default::default()
                },
            })
            .await
            .expect("resume over RPC");
        assert_eq!(sh(&node, &id, READ_TOKEN).await, token);
        remote
            .kill(&id, &r2.execution_id)
            .await
            .expect("kill over RPC");
        assert!(matches!(
            remote.kill(&id, &r2.execution_id).await,
            Err(NodeError::NotFound(_))
        ));
        remote
            .delete_build(&b.build_id)
            .await
            .expect("delete over RPC");
        cancel.cancel();
        let _ = server.await;
    });
}

/// Node RPC over TLS: the client verifies the node against the CA file it is given, and
/// nothing without TLS or with the wrong CA gets through.
#[test]
fn node_rpc_over_tls_verifies_the_node_and_refuses_plain_http() {
    use vmon_node::rpc::serve_with;
    use vmon_node::tls::{server_config, ClientTls};
    use vmon_proxy::tls::{generate_ca, issue_server_cert};

    let node = node();
    runtime().block_on(async {
        let dir = tempfile::tempdir().expect("dir");
        let write = |name: &str, pem: &str| {
            let p = dir.path().join(name);
            vmon_vm::private::write(&p, pem.as_bytes()).expect("write");
            p
        };
        let (ca, ca_key) = generate_ca().expect("ca");
        let (chain, key) =
            issue_server_cert(&ca, &ca_key, &["127.0.0.1".into()], 1).expect("issue");
        let ca_path = write("ca.pem", &ca);
        let (cert_path, key_path) = (write("node.pem", &chain), write("node.key", &key));
        let (other_ca, _) = generate_ca().expect("another ca");
        let other_path = write("other.pem", &other_ca);

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let cancel = tokio_util::sync::CancellationToken::new();
        let served: Arc<dyn NodeControl> = node.clone();
        let tls = server_config(&cert_path, &key_path, &[b"http/1.1"]).expect("server tls");
        let server = tokio::spawn(serve_with(
            listener,
            served,
            "s3cret".into(),
            Some(tls),
            cancel.clone(),
        ));
        let https = format!("https://{addr}");
        let trust = ClientTls::from_ca_file(&ca_path).expect("client tls");

        let remote = RemoteNode::with_tls(&https, "s3cret".into(), Some(&trust)).expect("client");
        remote.list_running().await.expect("list_running over TLS");
        assert!(matches!(
            remote.build_info("no-such-build").await,
            Err(NodeError::BuildNotFound(_))
        ));
        let wrong = RemoteNode::with_tls(&https, "nope".into(), Some(&trust)).expect("client");
        assert!(
            matches!(wrong.list_running().await, Err(NodeError::Failed(m)) if m.contains("401"))
        );

        // Plain HTTP to the TLS node gets no answer.
        let plain = RemoteNode::new(&format!("http://{addr}"), "s3cret".into()).expect("client");
        assert!(matches!(
            plain.list_running().await,
            Err(NodeError::Failed(_))
        ));
        // A client that trusts another CA, or the system's, refuses the node's certificate.
        let other = ClientTls::from_ca_file(&other_path).expect("other tls");
        for client in [
            RemoteNode::with_tls(&https, "s3cret".into(), Some(&other)).expect("client"),
            RemoteNode::new(&https, "s3cret".into()).expect("client"),
        ] {
            match client.list_running().await {
                Err(NodeError::Failed(m)) => assert!(m.contains("certificate"), "{m}"),
                other => panic!("an untrusted node answered: {other:?}"),
            }
        }
        // The certificate names 127.0.0.1 only.
        let port = addr.port();
        let misnamed = RemoteNode::with_tls(
            &format!("https://localhost:{port}"),
            "s3cret".into(),
            Some(&trust),
        )
        .expect("client");
        assert!(misnamed.list_running().await.is_err());
        // With a CA configured, node RPC is TLS-only: plain URLs are refused up front.
        assert!(
            RemoteNode::with_tls(&format!("http://{addr}"), "s3cret".into(), Some(&trust)).is_err()
        );
        cancel.cancel();
        server.await.expect("join").expect("serve");
    });
}
