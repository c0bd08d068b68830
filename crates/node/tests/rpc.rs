//! Node RPC: the api side's `RemoteNode` driving a real node through `rpc::serve`.

mod common;

use std::sync::Arc;

use common::{host_lock, node, runtime, sh, template, unique, READ_TOKEN, TOKEN_SERVER};
use vmon_node::rpc::{serve, RemoteNode};
use vmon_proto::node::{NetworkPolicy, NodeControl, NodeError, StartSpec};

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
        assert!(remote
            .list_running()
            .await
            .iter()
            .any(|s| s.sandbox_id == id));
        let b = remote
            .pause(&id, &r.execution_id, true)
            .await
            .expect("pause over RPC");
        let r2 = remote
            .start(StartSpec {
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
