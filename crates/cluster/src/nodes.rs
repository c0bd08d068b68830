//! [`ClusterNodes`]: the node contract over every registered node. Each call goes to the node
//! it concerns: a start to the node placement picks, a sandbox's calls to the node it runs on
//! (`placement/<sandbox>` in the KV, shared by every api replica), a build's calls to the
//! nodes that hold it (`build-at/<build>/<node>`, written when a node makes or fetches it).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vmon_kv::Kv;
use vmon_nodeclient::RemoteNode;
use vmon_proto::cluster::{BuildOrigin, Cluster, Migrated, NodeInfo};
use vmon_proto::node::{BuildInfo, NodeCalls, NodeError, Running};

use crate::placement::{self, Need};
use crate::registry;

mod calls;
mod migrate;

/// How long a members list read from the KV is reused.
const MEMBERS_FRESH: Duration = Duration::from_millis(500);
/// How long a call that only asks (build_info, list_running) waits for one node.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);

const PLACEMENT: &str = "placement/";
const BUILD_AT: &str = "build-at/";
const BUILD_ORIGIN: &str = "build-origin/";

/// What the cluster remembers of a build: where it was made and its guest RAM.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct BuildPlace {
    origin: BuildOrigin,
    memory_mb: u32,
}

/// Every registered node behind one [`vmon_proto::node::NodeControl`].
pub struct ClusterNodes {
    kv: Kv,
    /// The node RPC token every node of the cluster accepts.
    token: String,
    /// The cluster's CA: a node's certificate must chain to it and name the node's id.
    tls: vmon_nodeclient::tls::ClientTls,
    members: Mutex<Option<(Instant, Vec<NodeInfo>)>>,
    /// What the last proof of each registry entry's id gave ([`ClusterNodes::proven`]), by
    /// node id: the URL it was tried at, the outcome and when.
    proofs: Mutex<HashMap<String, (String, Proof, Instant)>>,
    /// Starts this process placed lately, which the nodes' heartbeats may not show yet.
    /// With the GPUs each start passed through.
    placed: Mutex<Vec<(Instant, String, u32)>>,
    clients: Mutex<HashMap<String, (String, Arc<RemoteNode>)>>,
    /// Itself, for the background work a call leaves (spreading a template build).
    me: std::sync::Weak<ClusterNodes>,
}

/// How long a template build is waited for in the object store before it is spread.
const SPREAD_WAIT: Duration = Duration::from_secs(1800);
/// How long a registry entry whose node's certificate was refused stays left out.
const REFUSED_RECHECK: Duration = Duration::from_secs(30);
/// How long a node that could not be reached to prove its id is taken as it is (a member)
/// before it is tried again: a host that drops packets must not stall every members read.
const UNREACHED_RECHECK: Duration = Duration::from_secs(5);

/// The outcome of a node's TLS handshake with its registry entry's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proof {
    /// Its certificate chains to the cluster's CA and names the id.
    Proven,
    /// Plain http, another CA or another node's name: no calls go to it.
    Refused,
    /// Not reached (down, restarting): a member as before, its calls fail on their own.
    Unreached,
}

impl ClusterNodes {
    /// `tls`: the cluster CA's client configuration ([`RemoteNode::cluster_node`]); it must
    /// be a CA file's (pinned), which [`RemoteNode::cluster_node`] checks on every client.
    pub fn new(kv: Kv, token: String, tls: vmon_nodeclient::tls::ClientTls) -> Arc<ClusterNodes> {
        Arc::new_cyclic(|me| ClusterNodes {
            kv,
            token,
            tls,
            members: Mutex::new(None),
            proofs: Mutex::new(HashMap::new()),
            placed: Mutex::new(Vec::new()),
            clients: Mutex::new(HashMap::new()),
            me: me.clone(),
        })
    }

    /// Once a template build is in the object store, every other live node fetches it (a
    /// `build_info` of a build a node lacks fetches it), so that its sandboxes, and sandboxes
    /// paused from them, start or resume anywhere with only their own layers to fetch.
    fn spread(&self, origin: String, build_id: String) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            let deadline = Instant::now() + SPREAD_WAIT;
            // The origin may be out of the registry for a while (a lapse, a restart) or fail
            // a call: only a build it no longer has ends the wait early.
            loop {
                let asked = match me.member(&origin).await {
                    Some(n) => match me.client(&n) {
                        Ok(c) => tokio::time::timeout(ASK_TIMEOUT, c.build_info(&build_id))
                            .await
                            .ok(),
                        Err(_) => None,
                    },
                    None => None,
                };
                match asked {
                    Some(Ok(info)) if info.stored => break,
                    Some(Err(NodeError::BuildNotFound(_))) => return,
                    _ => {}
                }
                if Instant::now() > deadline {
                    tracing::warn!(build_id = %build_id, origin = %origin, "a template build was not in the object store in time to be fetched ahead");
                    return;
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            for n in me.live().await.into_iter().filter(|n| n.id != origin) {
                let Ok(c) = me.client(&n) else {
                    continue;
                };
                match c.build_info(&build_id).await {
                    Ok(info) => {
                        tracing::info!(node_id = %n.id, build_id = %build_id, "template build fetched ahead");
                        me.holds(&n, &info).await;
                    }
                    Err(e) => {
                        tracing::info!(node_id = %n.id, build_id = %build_id, error = %e, "fetching a template build ahead failed")
                    }
                }
            }
        });
    }

    async fn live(&self) -> Vec<NodeInfo> {
        if let Some((at, ms)) = self
            .members
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            if at.elapsed() < MEMBERS_FRESH {
                return ms.clone();
            }
        }
        match registry::members(&self.kv).await {
            Ok(ms) => {
                let ms = self.proven(ms).await;
                *self.members.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((Instant::now(), ms.clone()));
                ms
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the node registry failed");
                Vec::new()
            }
        }
    }

    /// The entries of `members` whose node proves its id over TLS (or could not be reached
    /// to try: a node restarting stays a member). An entry that fails the proof is logged
    /// and left out, so a forged or stale entry gets no calls (and never the token).
    async fn proven(&self, members: Vec<NodeInfo>) -> Vec<NodeInfo> {
        let checks = members.into_iter().map(|n| async move {
            let last = self
                .proofs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&n.id)
                .filter(|(url, _, _)| *url == n.rpc_url)
                .map(|(_, proof, at)| (*proof, at.elapsed()));
            let proof = match last {
                Some((Proof::Proven, _)) => Proof::Proven,
                Some((Proof::Refused, age)) if age < REFUSED_RECHECK => Proof::Refused,
                Some((Proof::Unreached, age)) if age < UNREACHED_RECHECK => Proof::Unreached,
                _ => {
                    let proof = self.prove(&n).await;
                    self.proofs
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(n.id.clone(), (n.rpc_url.clone(), proof, Instant::now()));
                    proof
                }
            };
            (proof != Proof::Refused).then_some(n)
        });
        futures::future::join_all(checks)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// A TLS handshake (no request, no token) with the node of `n` as `n.id`.
    async fn prove(&self, n: &NodeInfo) -> Proof {
        let verdict = match RemoteNode::cluster_node(&n.rpc_url, &n.id, String::new(), &self.tls) {
            Ok(c) => c.verify().await,
            Err(e) => {
                tracing::warn!(node_id = %n.id, error = %e, "a node entry is refused");
                return Proof::Refused;
            }
        };
        match verdict {
            Ok(true) => Proof::Proven,
            Ok(false) => {
                tracing::warn!(node_id = %n.id, rpc_url = %n.rpc_url, "a node entry's certificate does not prove its id (not the cluster's CA, or another node's name): left out");
                Proof::Refused
            }
            Err(e) => {
                tracing::debug!(node_id = %n.id, error = %e, "a node could not be reached to prove its id");
                Proof::Unreached
            }
        }
    }

    fn client(&self, node: &NodeInfo) -> Result<Arc<RemoteNode>, NodeError> {
        let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((url, c)) = clients.get(&node.id) {
            if *url == node.rpc_url {
                return Ok(c.clone());
            }
        }
        let c = Arc::new(
            RemoteNode::cluster_node(&node.rpc_url, &node.id, self.token.clone(), &self.tls)
                .map_err(|e| NodeError::Failed(format!("node {}: {e:#}", node.id)))?,
        );
        clients.insert(node.id.clone(), (node.rpc_url.clone(), c.clone()));
        Ok(c)
    }

    async fn member(&self, node_id: &str) -> Option<NodeInfo> {
        self.live().await.into_iter().find(|n| n.id == node_id)
    }

    /// The live node a sandbox runs on.
    async fn node_of(&self, sandbox_id: &str) -> Result<(NodeInfo, Arc<RemoteNode>), NodeError> {
        let id = self
            .placement(sandbox_id)
            .await
            .ok_or_else(|| NodeError::NotFound(sandbox_id.to_string()))?;
        let node = self.member(&id).await.ok_or_else(|| {
            NodeError::Exhausted(format!(
                "node {id}, which runs sandbox {sandbox_id}, is not in the cluster"
            ))
        })?;
        let c = self.client(&node)?;
        Ok((node, c))
    }

    /// `r`, the outcome of a call to `node`, with a failure because the node was not reached
    /// (down, or stalled: no TLS handshake) said as such, an unavailable node with the reason
    /// (the api's 503), not a failed call (500).
    async fn said_unreached<T>(
        &self,
        node: &NodeInfo,
        c: &RemoteNode,
        r: Result<T, NodeError>,
    ) -> Result<T, NodeError> {
        match r {
            Err(e @ NodeError::Failed(_))
                if crate::reach::unreached(&node.rpc_url, c, &e).await =>
            {
                Err(NodeError::Exhausted(format!(
                    "node {} is not reached (down or stalled): {e}",
                    node.id
                )))
            }
            r => r,
        }
    }

    /// Records where a sandbox runs: its node and its guest address there, in one value, so
    /// that a reader never pairs a node with another node's address.
    async fn place(&self, sandbox_id: &str, node_id: &str, guest_ip: std::net::IpAddr) {
        let value = serde_json::json!({"node": node_id, "ip": guest_ip}).to_string();
        if let Err(e) = self
            .kv
            .put(&format!("{PLACEMENT}{sandbox_id}"), value.into_bytes())
            .await
        {
            tracing::warn!(sandbox_id, error = %e, "recording the sandbox's node failed");
        }
    }

    /// Remembers that `node` holds `build` (made there, or fetched).
    async fn holds(&self, node: &NodeInfo, build: &BuildInfo) {
        let at = format!("{BUILD_AT}{}/{}", build.build_id, node.id);
        if let Err(e) = self.kv.put(&at, b"".to_vec()).await {
            tracing::warn!(build_id = %build.build_id, error = %e, "recording a build's node failed");
        }
        let origin_key = format!("{BUILD_ORIGIN}{}", build.build_id);
        if matches!(self.kv.get(&origin_key).await, Ok(None)) {
            let place = BuildPlace {
                origin: BuildOrigin::of(node),
                memory_mb: build.memory_mb,
            };
            if let Ok(v) = serde_json::to_vec(&place) {
                let _ = self
                    .kv
                    .write(vmon_kv::Write::put(&origin_key, v).expect(vmon_kv::Expect::Absent))
                    .await;
            }
        }
    }

    async fn build_place(&self, build_id: &str) -> Option<BuildPlace> {
        let e = self
            .kv
            .get(&format!("{BUILD_ORIGIN}{build_id}"))
            .await
            .ok()??;
        serde_json::from_slice(&e.value).ok()
    }

    async fn holders(&self, build_id: &str) -> HashSet<String> {
        let prefix = format!("{BUILD_AT}{build_id}/");
        match self.kv.list(&prefix).await {
            Ok(es) => es
                .into_iter()
                .filter_map(|e| e.key.strip_prefix(&prefix).map(str::to_string))
                .collect(),
            Err(_) => HashSet::new(),
        }
    }

    async fn forget_build(&self, build_id: &str) {
        for e in self
            .kv
            .list(&format!("{BUILD_AT}{build_id}/"))
            .await
            .unwrap_or_default()
        {
            let _ = self.kv.delete(&e.key).await;
        }
        let _ = self.kv.delete(&format!("{BUILD_ORIGIN}{build_id}")).await;
    }

    /// Live nodes ranked for a start of `build_id`.
    async fn candidates(
        &self,
        build_id: &str,
        holders: &HashSet<String>,
        memory_restore: bool,
        gpus: u32,
    ) -> Result<Vec<NodeInfo>, NodeError> {
        let place = self.build_place(build_id).await;
        let recent = {
            let mut placed = self.placed.lock().unwrap_or_else(|p| p.into_inner());
            placed.retain(|(at, _, _)| at.elapsed() < registry::HEARTBEAT * 2);
            placed.clone()
        };
        let mut pending_gpus = HashMap::new();
        for (_, n, g) in &recent {
            *pending_gpus.entry(n.clone()).or_insert(0) += g;
        }
        let need = Need {
            memory_mb: place.as_ref().map(|p| u64::from(p.memory_mb)).unwrap_or(0),
            origin: place.map(|p| p.origin),
            memory_restore,
            gpus,
            pending_gpus,
        };
        let members = self.placeable().await;
        // More GPUs than any node has: no wait helps (400), unlike a busy cluster (503).
        placement::gpu_capacity(&members, &need).map_err(NodeError::InvalidArgument)?;
        let extra = |id: &str| {
            u32::try_from(recent.iter().filter(|(_, n, _)| n == id).count()).unwrap_or(0)
        };
        placement::rank_with(&members, holders, &need, extra).map_err(NodeError::Exhausted)
    }

    /// Calls `f` on each live node at once (bounded by [`ASK_TIMEOUT`]), keeping the answers.
    async fn ask_all<T, F, Fut>(&self, f: F) -> Vec<(NodeInfo, Result<T, NodeError>)>
    where
        F: Fn(Arc<RemoteNode>) -> Fut,
        Fut: std::future::Future<Output = Result<T, NodeError>>,
    {
        let members = self.live().await;
        let calls = members.into_iter().map(|n| {
            let c = self.client(&n);
            let fut = c.map(&f);
            async move {
                let r = match fut {
                    Ok(fut) => tokio::time::timeout(ASK_TIMEOUT, fut)
                        .await
                        .unwrap_or_else(|_| {
                            Err(NodeError::Failed(format!("node {} did not answer", n.id)))
                        }),
                    Err(e) => Err(e),
                };
                (n, r)
            }
        });
        futures::future::join_all(calls).await
    }

    /// [`ClusterNodes::ask_all`], keeping only the answers of the nodes that gave one.
    async fn ask_all_ok<T, F, Fut>(&self, f: F) -> Vec<T>
    where
        F: Fn(Arc<RemoteNode>) -> Fut,
        Fut: std::future::Future<Output = Result<T, NodeError>>,
    {
        self.ask_all(f)
            .await
            .into_iter()
            .filter_map(|(_, r)| r.ok())
            .collect()
    }

    /// Tries `f` on each node ranked for a start until one is not out of capacity.
    async fn on_first_fit<T, F, Fut>(
        &self,
        ranked: Vec<NodeInfo>,
        holders: &HashSet<String>,
        f: F,
    ) -> Result<(NodeInfo, T), NodeError>
    where
        F: Fn(Arc<RemoteNode>) -> Fut,
        Fut: std::future::Future<Output = Result<T, NodeError>>,
    {
        let mut last = NodeError::Exhausted("no node is registered".into());
        let mut holder_down = false;
        // Why each holder of the build that was passed over could not take the start: a
        // node without the build then says "not found", which is not the answer (the build
        // exists, on a node that is busy, lapsed or fenced for now).
        let mut holders_busy: Vec<String> = Vec::new();
        for n in ranked {
            let c = self.client(&n)?;
            match f(c.clone()).await {
                Ok(v) => return Ok((n, v)),
                Err(NodeError::Exhausted(m)) => {
                    tracing::info!(node_id = %n.id, reason = %m, "node out of capacity; trying the next");
                    if holders.contains(&n.id) {
                        holders_busy.push(format!("{}: {m}", n.id));
                    }
                    last = NodeError::Exhausted(format!("{}: {m}", n.id));
                }
                // It lacks the build and could not fetch it: a holder may have it.
                Err(e @ NodeError::BuildNotFound(_)) if !holders.contains(&n.id) => last = e,
                // Down (its lease not yet ended) or stalled (it accepts connections and never
                // finishes a TLS handshake): the call never reached it, the next may.
                Err(e @ NodeError::Failed(_))
                    if crate::reach::unreached(&n.rpc_url, &c, &e).await =>
                {
                    let m = e.to_string();
                    tracing::warn!(node_id = %n.id, error = %m, "node is not reached; trying the next");
                    holder_down |= holders.contains(&n.id);
                    last = NodeError::Exhausted(format!("node {} is not reached: {m}", n.id));
                }
                Err(e) => return Err(e),
            }
        }
        match last {
            NodeError::BuildNotFound(b) if holder_down => Err(NodeError::Exhausted(format!(
                "build {b} is on a node that is down, and no other node could fetch it from the object store"
            ))),
            NodeError::BuildNotFound(b) if !holders_busy.is_empty() => {
                Err(NodeError::Exhausted(format!(
                    "build {b} is not in the object store yet, and the nodes that hold it take no start now ({})",
                    holders_busy.join("; ")
                )))
            }
            last => Err(last),
        }
    }
}

#[async_trait::async_trait]
impl Cluster for ClusterNodes {
    async fn members(&self) -> Vec<NodeInfo> {
        self.live().await
    }

    async fn placement(&self, sandbox_id: &str) -> Option<String> {
        self.location(sandbox_id).await.map(|(node, _)| node)
    }

    async fn location(&self, sandbox_id: &str) -> Option<(String, Option<std::net::IpAddr>)> {
        let e = self
            .kv
            .get(&format!("{PLACEMENT}{sandbox_id}"))
            .await
            .ok()??;
        parse_placement(&e.value)
    }

    async fn migrate(
        &self,
        sandbox_id: &str,
        execution_id: &str,
        target: Option<&str>,
        downtime_ms: u64,
    ) -> Result<Migrated, NodeError> {
        self.migrate_sandbox(sandbox_id, execution_id, target, downtime_ms)
            .await
    }

    async fn set_draining(&self, node_id: &str, draining: bool) -> Result<(), NodeError> {
        self.mark_draining(node_id, draining).await
    }

    async fn draining(&self) -> Vec<String> {
        self.draining_nodes().await.into_iter().collect()
    }

    async fn rehome(&self, build_id: &str, away_from: &str) -> Result<String, NodeError> {
        self.rehome_build(build_id, away_from).await
    }

    async fn running_on(&self, node_id: &str) -> Result<Vec<Running>, NodeError> {
        let node = self
            .member(node_id)
            .await
            .ok_or_else(|| NodeError::NotFound(format!("node {node_id}")))?;
        let c = self.client(&node)?;
        tokio::time::timeout(ASK_TIMEOUT, c.list_running())
            .await
            .unwrap_or_else(|_| Err(NodeError::Failed(format!("node {node_id} did not answer"))))
    }

    async fn forget(&self, sandbox_id: &str) {
        let _ = self.kv.delete(&format!("{PLACEMENT}{sandbox_id}")).await;
    }

    async fn kill_on(
        &self,
        node_id: &str,
        sandbox_id: &str,
        execution_id: &str,
    ) -> Result<(), NodeError> {
        let node = self
            .member(node_id)
            .await
            .ok_or_else(|| NodeError::NotFound(format!("node {node_id}")))?;
        self.client(&node)?.kill(sandbox_id, execution_id).await
    }
}

/// A placement value: `{"node", "ip"}`, or a bare node id (as written before addresses were kept).
fn parse_placement(v: &[u8]) -> Option<(String, Option<std::net::IpAddr>)> {
    #[derive(Deserialize)]
    struct P {
        node: String,
        ip: Option<std::net::IpAddr>,
    }
    if v.first() == Some(&b'{') {
        let p: P = serde_json::from_slice(v).ok()?;
        return Some((p.node, p.ip));
    }
    String::from_utf8(v.to_vec()).ok().map(|n| (n, None))
}

#[cfg(test)]
mod tests {
    #[test]
    fn placements_are_read_with_and_without_an_address() {
        let ip: std::net::IpAddr = [10, 1, 2, 3].into();
        assert_eq!(
            super::parse_placement(br#"{"node":"node2","ip":"10.1.2.3"}"#),
            Some(("node2".into(), Some(ip)))
        );
        assert_eq!(
            super::parse_placement(b"node1"),
            Some(("node1".into(), None))
        );
        assert_eq!(super::parse_placement(b"{bad"), None);
    }
}
