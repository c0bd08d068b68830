//! The node calls, each written once: its arguments (a struct), its wire name and its reply.
//!
//! From the one table in this file come: the call structs; [`Call`] for each (its name on the
//! wire and its reply type); [`NodeCall`] and [`NodeReply`], every call and every answer as one
//! value; [`NodeHandler`], what a node implements (one method per call, no defaults);
//! and [`NodeCalls`], the typed methods a caller uses on any [`NodeControl`].
//!
//! A new call is one entry in the table and one method of the node's [`NodeHandler`]. The
//! remote client (`vmon-nodeclient`) and the RPC server forward every call generically; the
//! cluster routes a call that names a sandbox to that sandbox's node without knowing it.
//!
//! Wire (node RPC, unchanged since calls were hand-written): `POST /v1/<name>` with the call
//! struct as JSON (a call marked `transparent` is its one field's JSON), answered
//! `{"ok": reply}` or `{"err": NodeError}`.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{
    BuildId, BuildInfo, ExecOutput, ExecSpec, KeepaliveAsk, KeptBuild, LogEntry, LogQuery,
    MetricSample, MigrateIn, MigrateOut, MigrateStats, NetworkPolicy, NodeError, OciImage,
    PauseBuild, PausedState, Running, StartSpec, TemplateSpec,
};
use crate::egress::EgressSpec;

/// One node call: its arguments are `Self`, its answer [`Call::Reply`].
pub trait Call: Serialize + DeserializeOwned + Into<NodeCall> + Send + 'static {
    /// The name on the wire (`POST /v1/<NAME>`).
    const NAME: &'static str;
    type Reply: Serialize + DeserializeOwned + Send + 'static;

    /// This call's reply out of a [`NodeReply`]; another call's reply is a `Failed` error
    /// (an implementor of [`NodeControl`] answered the wrong call).
    fn reply(reply: NodeReply) -> Result<Self::Reply, NodeError>;

    /// `reply` as a [`NodeReply`].
    fn answer(reply: Self::Reply) -> NodeReply;

    /// [`Call::answer`] of a result.
    fn answered(r: Result<Self::Reply, NodeError>) -> Result<NodeReply, NodeError> {
        r.map(Self::answer)
    }
}

/// What serves node calls: a node in process, a node over RPC, or a cluster of nodes. Callers
/// use the typed methods of [`NodeCalls`], which every `NodeControl` has.
#[async_trait::async_trait]
pub trait NodeControl: Send + Sync + 'static {
    /// Answers one call with that call's reply ([`Call::answer`]).
    async fn handle(&self, call: NodeCall) -> Result<NodeReply, NodeError>;
}

/// Sends calls somewhere else and reads their typed replies (the RPC client): with it,
/// [`NodeCall::forward`] serves every call.
pub trait Transport: Send + Sync {
    fn send<C: Call>(&self, call: C) -> impl Future<Output = Result<C::Reply, NodeError>> + Send;
}

macro_rules! node_calls {
    ($(
        $(#[doc = $doc:expr])*
        $(#[serde($($serde:tt)*)])?
        $name:ident: $Call:ident { $($field:ident: $ty:ty),* $(,)? } -> $Reply:ty
        $(, sandbox = $($sandbox:ident).+)?;
    )*) => {
        $(
            $(#[doc = $doc])*
            #[derive(Debug, Clone, Serialize, Deserialize)]
            $(#[serde($($serde)*)])?
            pub struct $Call {
                $(pub $field: $ty,)*
            }

            impl Call for $Call {
                const NAME: &'static str = stringify!($name);
                type Reply = $Reply;

                fn reply(reply: NodeReply) -> Result<$Reply, NodeError> {
                    match reply {
                        NodeReply::$Call(r) => Ok(r),
                        #[allow(unreachable_patterns)]
                        other => Err(NodeError::Failed(format!(
                            "the node answered {} with the reply of {}",
                            stringify!($name),
                            other.name()
                        ))),
                    }
                }

                fn answer(reply: $Reply) -> NodeReply {
                    NodeReply::$Call(reply)
                }
            }

            impl From<$Call> for NodeCall {
                fn from(c: $Call) -> NodeCall {
                    NodeCall::$Call(c)
                }
            }
        )*

        /// Every node call, as one value. Serialized, it is the call's arguments alone (the
        /// wire's body).
        #[derive(Debug, Clone, Serialize)]
        #[serde(untagged)]
        pub enum NodeCall {
            $($Call($Call),)*
        }

        /// Every call's reply, as one value. Serialized, it is the reply alone (the wire's
        /// `ok`).
        #[derive(Debug, Clone, Serialize)]
        #[serde(untagged)]
        pub enum NodeReply {
            $($Call($Reply),)*
        }

        impl NodeReply {
            /// The name of the call this answers.
            pub fn name(&self) -> &'static str {
                match self {
                    $(NodeReply::$Call(_) => stringify!($name),)*
                }
            }
        }

        impl NodeCall {
            /// The call named `name` (a wire name) with the JSON arguments `body`; `None`
            /// when no call has that name.
            pub fn from_wire(name: &str, body: &[u8]) -> Option<Result<NodeCall, serde_json::Error>> {
                match name {
                    $(stringify!($name) => Some(serde_json::from_slice::<$Call>(body).map(NodeCall::$Call)),)*
                    _ => None,
                }
            }

            /// The wire name.
            pub fn name(&self) -> &'static str {
                match self {
                    $(NodeCall::$Call(_) => stringify!($name),)*
                }
            }

            /// The sandbox the call is about, for a call that a cluster sends to the node
            /// running it (and to no other).
            pub fn sandbox_id(&self) -> Option<&str> {
                match self {
                    $(NodeCall::$Call(_c) => None::<&str>$(.or(Some(&_c.$($sandbox).+)))?,)*
                }
            }

            /// Serves the call with `handler`.
            pub async fn dispatch<H: NodeHandler + ?Sized>(self, handler: &H) -> Result<NodeReply, NodeError> {
                match self {
                    $(NodeCall::$Call(c) => handler.$name(c).await.map(NodeReply::$Call),)*
                }
            }

            /// Sends the call on with `transport` and reads its typed reply.
            pub async fn forward<T: Transport + ?Sized>(self, transport: &T) -> Result<NodeReply, NodeError> {
                match self {
                    $(NodeCall::$Call(c) => transport.send(c).await.map(NodeReply::$Call),)*
                }
            }
        }

        /// What a node does for each call: one method per call, each required.
        #[async_trait::async_trait]
        pub trait NodeHandler: Send + Sync + 'static {
            $(
                $(#[doc = $doc])*
                async fn $name(&self, call: $Call) -> Result<$Reply, NodeError>;
            )*
        }

        /// The calls as typed methods of every [`NodeControl`] (`node.kill(id, execution)`),
        /// and [`NodeCalls::call`] for a call already built.
        pub trait NodeCalls: NodeControl {
            /// Makes `call` and reads its typed reply.
            fn call<C: Call>(&self, call: C) -> impl Future<Output = Result<C::Reply, NodeError>> + Send {
                let handled = self.handle(call.into());
                async move { C::reply(handled.await?) }
            }

            $(
                $(#[doc = $doc])*
                fn $name(&self, $($field: impl Into<$ty>),*) -> impl Future<Output = Result<$Reply, NodeError>> + Send {
                    self.call($Call { $($field: $field.into()),* })
                }
            )*
        }

        /// The same methods on `dyn NodeControl` itself, so that a caller holding an
        /// `Arc<dyn NodeControl>` (the api) needs no import.
        impl dyn NodeControl {
            /// Makes `call` and reads its typed reply.
            pub fn call<C: Call>(&self, call: C) -> impl Future<Output = Result<C::Reply, NodeError>> + Send + '_ {
                NodeCalls::call(self, call)
            }

            $(
                $(#[doc = $doc])*
                pub fn $name(&self, $($field: impl Into<$ty>),*) -> impl Future<Output = Result<$Reply, NodeError>> + Send + '_ {
                    NodeCalls::call(self, $Call { $($field: $field.into()),* })
                }
            )*
        }
    };
}

impl<T: NodeControl + ?Sized> NodeCalls for T {}

#[async_trait::async_trait]
impl<H: NodeHandler> NodeControl for H {
    async fn handle(&self, call: NodeCall) -> Result<NodeReply, NodeError> {
        call.dispatch(self).await
    }
}

node_calls! {
    /// Build a template from the node's base image; returns when its snapshot is durable.
    #[serde(transparent)]
    build_template: BuildTemplate { spec: TemplateSpec } -> BuildInfo;
    /// The digest (`sha256:…`) of the manifest an image reference names in its registry; a
    /// registry that cannot be reached, refuses the credentials or lacks the image is an
    /// `InvalidArgument` naming it.
    #[serde(transparent)]
    resolve_image: ResolveImage { image: OciImage } -> String;
    /// Look a build up (a node that lacks it fetches it from the object store).
    build_info: BuildInfoOf { build_id: BuildId } -> BuildInfo;
    /// Delete a build; refused with `BuildInUse` while anything depends on it.
    delete_build: DeleteBuild { build_id: BuildId } -> ();
    /// A destroyed object-store volume: its objects go from the store (a marker stays, so a
    /// sandbox still mounting it never writes it back), and this node's cache of it, unless
    /// a sandbox here still mounts it (then it goes with the node's next fill or never).
    delete_volume: DeleteVolume { volume_id: String } -> ();
    /// Where the paused state `build_id` is (parked, on disk, in the object store), without
    /// fetching it.
    paused_state: PausedStateOf { build_id: BuildId } -> PausedState;
    /// Every build a pause made that this node still keeps, with the run it came from.
    pause_builds: PauseBuilds {} -> Vec<PauseBuild>;
    /// Every build this node keeps on its disk (not those only in the object store).
    builds: Builds {} -> Vec<KeptBuild>;
    /// Start a sandbox from a build (memory restore, or cold boot when asked or when the build
    /// has no memory); returns once envd has answered `/init`.
    #[serde(transparent)]
    start: Start { spec: StartSpec } -> Running, sandbox = spec.sandbox_id;
    /// Kill a running sandbox and free its slot and overlay.
    kill: Kill { sandbox_id: String, execution_id: String } -> (), sandbox = sandbox_id;
    /// Pause: the VM stops and its state becomes a new build (memory too when `memory`).
    /// On error the sandbox is still running.
    pause: Pause { sandbox_id: String, execution_id: String, memory: bool } -> BuildInfo,
        sandbox = sandbox_id;
    /// Checkpoint a running sandbox into a new build and keep it running (fork, snapshot).
    checkpoint: Checkpoint { sandbox_id: String, execution_id: String, memory: bool } -> BuildInfo,
        sandbox = sandbox_id;
    /// The sandboxes this node is running (re-adopted ones included).
    list_running: ListRunning {} -> Vec<Running>;
    /// Replaces a running sandbox's egress policy.
    update_network: UpdateNetwork { sandbox_id: String, execution_id: String, policy: NetworkPolicy } -> (),
        sandbox = sandbox_id;
    /// Replaces a running sandbox's secret-injection rules and values (a secret was updated
    /// or deleted).
    update_egress: UpdateEgress { sandbox_id: String, execution_id: String, egress: EgressSpec } -> (),
        sandbox = sandbox_id;
    /// A sandbox's samples with `start_unix <= timestamp <= end_unix`, oldest first: while it
    /// runs and for 7 days after its last execution ended. Empty when the node has none.
    metrics: Metrics { sandbox_id: String, start_unix: i64, end_unix: i64 } -> Vec<MetricSample>,
        sandbox = sandbox_id;
    /// The newest sample of each of these sandboxes that is running and has one.
    latest_metrics: LatestMetrics { sandbox_ids: Vec<String> } -> Vec<(String, MetricSample)>;
    /// A sandbox's console log entries over all its executions (kept as long as its metrics).
    logs: Logs { sandbox_id: String, query: LogQuery } -> Vec<LogEntry>, sandbox = sandbox_id;
    /// Pre-spawned restore processes per build (the restore pool's depth).
    pool_depths: PoolDepths {} -> Vec<(BuildId, usize)>;
    /// Runs a command in a running sandbox to its end (template build steps).
    exec: Exec { sandbox_id: String, execution_id: String, spec: ExecSpec } -> ExecOutput,
        sandbox = sandbox_id;
    /// Writes the file at `host_path` (on the node's host: in `vmon up` the api and the node
    /// share the data dir) into a running sandbox at `guest_path`, as root.
    put_file: PutFile { sandbox_id: String, execution_id: String, host_path: String, guest_path: String } -> (),
        sandbox = sandbox_id;
    /// A running sandbox's latest self-keepalive ask (envd `GET /keepalive`), if its guest
    /// made one since it started; read when its timeout ends.
    keepalive: Keepalive { sandbox_id: String, execution_id: String } -> Option<KeepaliveAsk>,
        sandbox = sandbox_id;
    /// Live migration, source side: whether this sandbox can move, and what the target needs.
    /// (The migration calls go to one node each, which the cluster's migration picks.)
    migrate_describe: MigrateDescribe { sandbox_id: String, execution_id: String } -> MigrateIn;
    /// Target side: spawns a QEMU waiting for the sandbox (its slot, an overlay on the basis's
    /// disk chain, the basis's memory written in); returns the migration's id.
    #[serde(transparent)]
    migrate_in: MigrateAccept { spec: MigrateIn } -> String;
    /// Source side: copies the running sandbox to the prepared target until the source's QEMU
    /// has handed over (stopped, state sent). On error the sandbox is running here unchanged.
    #[serde(transparent)]
    migrate_out: MigrateSend { spec: MigrateOut } -> MigrateStats;
    /// Target side: starts the received guest and takes the sandbox into its table.
    migrate_commit: MigrateCommit { migration_id: String } -> Running;
    /// Target side: drops a prepared or received migration that will not be committed.
    migrate_cancel: MigrateCancel { migration_id: String } -> ();
    /// Source side, after the target committed: ends the handed-over QEMU and frees its slot.
    migrate_finish: MigrateFinish { sandbox_id: String, execution_id: String } -> ();
    /// Source side, when the target did not commit: the sandbox runs on here.
    migrate_abort: MigrateAbort { sandbox_id: String, execution_id: String } -> ();
}
