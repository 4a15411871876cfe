//! `MeshNode`: one gpumesh node, every actor started in order.
//!
//! Start-up: identity and blob store from the data dir, the GPU thread (calibrated),
//! the libp2p net actor (behind the cluster key and allow-list, if any), the peers
//! actor and the event router; then the Raft record — reopened from the data dir,
//! or formed (`--init`, `--bootstrap-expect N`), or joined through any member
//! reached by `--peer` or a ticket — and only then what needs it: liveness, blobs,
//! the membership sweep, heartbeats, the scheduler, the worker and the HTTP API.
//! Raft frames travel over libp2p; a peer's raft id is derived from its
//! Noise-authenticated peer id, so no frame can claim another sender.
//!
//! - `config`: [`NodeConfig`].
//! - `formation`: reopen, form or join a mesh.
//! - `routing`: network events to their owners; peers' node requests answered.
//! - `heartbeats`: heartbeat, capability and address proposals.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumesh_consensus::{
    ClusterId, ClusterSettings, Command, ConsensusHandle, RedbStorage, ReplicaConfig, Transport,
    Unreachable,
};
use gpumesh_protocol::mesh::{MeshRequest, MeshResponse};
use gpumesh_protocol::NodeCapability;
use gpumesh_shaders::BackendChoice;
use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admission::CLUSTER_FILE;
use crate::api::ApiState;
use crate::blobs::{BlobStore, BlobsHandle};
use crate::cluster_key::ClusterKey;
use crate::error::{NodeError, Result};
use crate::identity;
use crate::limits::Limits;
use crate::liveness::LivenessHandle;
use crate::metrics::{GpuMetrics, Metrics, NetMetrics};
use crate::net::{ConnectionCaps, NetConfig, NetEvent, NetHandle};
use crate::peers::{keep_connected, member_records, record_mesh_addrs, PeersHandle};
use crate::run_here::RunHere;
use crate::scheduler::{self, Scheduler, SchedulerConfig};
use crate::wire::{self, NodeReply, NodeRequest};
use crate::worker::{GpuHandle, ShardRunner, Worker};

mod config;
mod formation;
mod heartbeats;
mod leave;
mod removed;
mod routing;

pub use crate::admission::Formation;
pub use crate::worker::Faults;
pub use config::NodeConfig;
use formation::{join_through, open_or_form, Newcomer};
use heartbeats::heartbeats;
pub use leave::LEFT_FILE;
pub(crate) use leave::{Leaving, NotLeft, REMOVAL_WAIT};
use routing::{raft_sink, request_sink, Membership, Router};

/// Raft frames to the peer behind a raft id, through the net actor.
struct NetTransport {
    net: NetHandle,
    peers: PeersHandle,
}

impl Transport for NetTransport {
    fn send(&self, to: u64, frame: Vec<u8>) -> std::result::Result<(), Unreachable> {
        let peer = self.peers.peer(to).ok_or(Unreachable)?;
        self.net.send_raft(peer, frame).map_err(|_| Unreachable)
    }
}

/// A running node.
pub struct MeshNode {
    pub peer_id: PeerId,
    pub raft_id: u64,
    pub api_addr: SocketAddr,
    pub listen_addrs: Vec<Multiaddr>,
    pub consensus: ConsensusHandle,
    pub net: NetHandle,
    pub blobs: BlobStore,
    pub capability: Option<NodeCapability>,
    /// The key its transport holds; `None` in an open mesh.
    pub cluster_key: Option<ClusterKey>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    gpu_thread: Option<std::thread::JoinHandle<()>>,
    leaving: Leaving,
    removal: removed::Removal,
    /// Which peer is behind each raft id (see [`Self::reaches`]).
    peers: PeersHandle,
    /// Held while the node runs: no second node starts on its data dir.
    _dir_lock: crate::data_dir::DirLock,
}

/// How long a member restarting on its data dir waits for a leader before serving.
const RESTART_WAIT: Duration = Duration::from_secs(5);
/// How long a joined node waits to be made a voter before it serves anyway (the
/// leader promotes a caught-up learner within a second or so).
const PROMOTION_WAIT: Duration = Duration::from_secs(10);

/// How long [`MeshNode::stop`] waits for a dispatch under way to end.
const GPU_STOP_WAIT: Duration = Duration::from_secs(30);

impl MeshNode {
    /// Starts a node; returns once it is a member of a mesh and serving its API.
    pub async fn start(config: NodeConfig) -> Result<MeshNode> {
        config.limits.check()?;
        let cancel = CancellationToken::new();
        let mut tasks = Vec::new();
        match Self::start_with(config, &cancel, &mut tasks).await {
            Ok(node) => Ok(node),
            Err(e) => {
                cancel.cancel();
                for t in tasks {
                    let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
                }
                Err(e)
            }
        }
    }

    async fn start_with(
        config: NodeConfig,
        cancel: &CancellationToken,
        tasks: &mut Vec<JoinHandle<()>>,
    ) -> Result<MeshNode> {
        // First: an address in use is refused before anything is written.
        let api_listener = crate::api::bind(config.api).await?;
        let dir = &config.data_dir;
        std::fs::create_dir_all(dir).map_err(|e| NodeError::io(dir, e))?;
        let dir_lock = crate::data_dir::lock(dir)?;
        crate::data_dir::check_or_stamp(dir)?;
        let cluster_key =
            crate::admission::settle_key(dir, config.cluster_key, config.open, config.formation)?;
        let api_token = crate::admission::api_token(dir)?;
        let keypair = identity::load_or_create(dir)?;
        let peer_id = keypair.public().to_peer_id();
        let raft_id = identity::raft_id(&peer_id);
        let store = BlobStore::open(dir.join("blobs"), config.limits.max_blob_bytes)?
            .with_disk_reserve(config.limits.disk_reserve);

        let backend = config.backend;
        let calibrate = config.calibrate;
        let gpu_metrics = GpuMetrics::default();
        let counted = gpu_metrics.clone();
        let limits = gpumesh_shaders::ExecutorLimits {
            resident_input_bytes: config.limits.gpu_memory,
            loop_bound: Some(config.limits.max_loop_turns),
            ..Default::default()
        };
        let gpu = tokio::task::spawn_blocking(move || {
            GpuHandle::start(backend, calibrate, limits, counted)
        })
        .await
        .map_err(|e| NodeError::Config(format!("GPU start-up panicked: {e}")))?;
        let capability = gpu.as_ref().map(|(_, c, _)| c.clone());
        let mut gpu_thread = None;
        let gpu = gpu.map(|(gpu, _, thread)| {
            gpu_thread = Some(thread);
            gpu
        });

        let (events_tx, events_rx) = mpsc::channel(1024);
        let net_metrics = NetMetrics::default();
        let mut net_config = NetConfig::new(keypair);
        net_config.listen = config.listen.clone();
        net_config.peers = config.peers.clone();
        net_config.mdns = config.mdns;
        net_config.psk = cluster_key.map(|k| k.psk());
        net_config.allow_peers = config.allow_peers.clone();
        net_config.connections = config.connections;
        net_config.metrics = net_metrics.clone();
        match &cluster_key {
            Some(key) => tracing::info!(fingerprint = %key.fingerprint(), "cluster key loaded"),
            None => tracing::warn!(
                "no cluster key (--open): anyone who reaches the listen addresses can connect"
            ),
        }
        if !config.allow_peers.is_empty() {
            tracing::info!(peers = ?config.allow_peers, "only these peers are admitted");
        }
        let (net, net_task) =
            NetHandle::start(net_config, store.clone(), events_tx, cancel.clone()).await?;
        tasks.push(net_task);
        let listen_addrs = net.listen_addrs().await?;
        let (peers, peers_task) = PeersHandle::start(net.clone(), cancel.clone());
        tasks.push(peers_task);
        let (joined, joined_rx) = oneshot::channel();
        tasks.push(tokio::spawn(
            Router {
                raft_id,
                net: net.clone(),
                peers: peers.clone(),
                events: events_rx,
                joined: joined_rx,
            }
            .run(cancel.clone()),
        ));

        // Into a mesh first; everything after this needs the replica.
        let newcomer = Newcomer {
            net: net.clone(),
            peer_id,
            raft_id,
            capability: capability.clone(),
        };
        // A member restarting on its data dir (not joining, not forming).
        let restarting = config.data_dir.join(CLUSTER_FILE).exists();
        let (storage, cluster, joined_through) = open_or_form(&config, &newcomer).await?;
        let restarting = restarting && joined_through.is_none();
        let mut rc = ReplicaConfig::new(raft_id);
        rc.tick_interval = config.raft_tick;
        rc.carried = Some(Arc::new(store.clone()));
        let transport = Arc::new(NetTransport {
            net: net.clone(),
            peers: peers.clone(),
        });
        let consensus = ConsensusHandle::start(rc, storage, transport)?;
        let (liveness, liveness_task) = LivenessHandle::start(
            raft_id,
            consensus.clone(),
            config.down_after,
            cancel.clone(),
        );
        tasks.push(liveness_task);
        let (blobs, blobs_task) = BlobsHandle::start(
            store.clone(),
            net.clone(),
            peers.clone(),
            consensus.clone(),
            cancel.clone(),
        );
        tasks.push(blobs_task);
        tasks.push(tokio::spawn(crate::blobs::repair::run(
            blobs.clone(),
            consensus.clone(),
            config.repair_after,
            cancel.clone(),
        )));
        let made_outputs = Arc::new(crate::outputs::ResultCache::default());
        let sweep_metrics = crate::metrics::SweepMetrics::default();
        tasks.push(tokio::spawn(crate::blobs::sweep::run(
            store.clone(),
            consensus.clone(),
            made_outputs.clone(),
            config.blob_sweep,
            sweep_metrics.clone(),
            cancel.clone(),
        )));
        // Calls sent to this node as an actor's host (by its own API or a peer's);
        // without a GPU nothing takes them, and senders queue them in the record.
        let (calls_tx, calls_rx) = mpsc::channel(1024);
        net.set_raft_sink(raft_sink(consensus.clone(), peers.clone()));
        let membership = Arc::new(Membership {
            cluster,
            consensus: consensus.clone(),
            liveness: liveness.clone(),
            blobs: blobs.clone(),
            calls: calls_tx.clone(),
        });
        net.set_request_sink(request_sink(raft_id, peers.clone(), membership.clone()));
        let _ = joined.send(membership);
        // Dial every member at once: a node restarted with no --peer finds the mesh
        // through the addresses in its own copy of the membership.
        tasks.push(tokio::spawn(keep_connected(
            peers.clone(),
            consensus.clone(),
            liveness.clone(),
            config.data_dir.clone(),
            cancel.clone(),
        )));
        // Cancelled once this node has left, or finds it was removed.
        let left = CancellationToken::new();
        let removal = removed::Removal::default();
        tasks.push(tokio::spawn(
            removed::Watch {
                consensus: consensus.clone(),
                net: net.clone(),
                cluster,
                data_dir: config.data_dir.clone(),
                left: left.clone(),
                removal: removal.clone(),
            }
            .run(cancel.clone()),
        ));
        let joining = joined_through.is_some();
        if let Some(peer) = joined_through {
            join_through(&newcomer, peer, config.join_timeout).await?;
        }
        Self::wait_until_serving(&consensus, &config, restarting, &left).await?;
        if joining {
            Self::wait_until_voting(&consensus, config.join_timeout.min(PROMOTION_WAIT)).await;
        }

        // Before the API answers: `gpumesh ticket` works as soon as the node is up,
        // and its Raft frames reach every member it has applied (it may be handed
        // leadership at once) without waiting for the sweep.
        let records = member_records(&consensus);
        peers.learn_all(records.clone()).await;
        record_mesh_addrs(&peers, &records, &config.data_dir, &mut Vec::new()).await;
        tasks.push(tokio::spawn(heartbeats(
            consensus.clone(),
            net.clone(),
            capability.clone(),
            config.heartbeat_interval,
            cancel.clone(),
        )));
        let kernels = Arc::new(gpumesh_shaders::KernelCache::default());
        tasks.push(tokio::spawn(
            Scheduler {
                consensus: consensus.clone(),
                blobs: blobs.clone(),
                peers: peers.clone(),
                kernels: kernels.clone(),
                liveness: liveness.clone(),
                config: config.scheduler,
            }
            .run(cancel.clone()),
        ));
        let metrics = Metrics::new(peer_id, raft_id, gpu_metrics, net_metrics)
            .with_raft(consensus.clone())
            .with_sweep(&sweep_metrics);
        let mut run_here = None;
        if let Some(gpu) = gpu {
            tasks.push(tokio::spawn(
                crate::host::ActorHost {
                    me: raft_id,
                    consensus: consensus.clone(),
                    blobs: blobs.clone(),
                    peers: peers.clone(),
                    kernels: kernels.clone(),
                    gpu: gpu.clone(),
                    default_deadline: config.default_deadline,
                    calls: metrics.actor_calls.clone(),
                    inbox: calls_rx,
                    timeline: config.timeline.clone(),
                }
                .run(cancel.clone()),
            ));
            let runner = ShardRunner {
                blobs: blobs.clone(),
                kernels: kernels.clone(),
                counts: metrics.shards.clone(),
                gpu,
                default_deadline: config.default_deadline,
                faults: config.faults.clone(),
            };
            run_here = capability.as_ref().map(|cap| RunHere {
                me: raft_id,
                consensus: consensus.clone(),
                runner: runner.clone(),
                slots: Arc::new(tokio::sync::Semaphore::new(config.run_here_slots)),
                slot_count: config.run_here_slots,
                recent_us: Default::default(),
                fits: u64::from(cap.limits.max_storage_buffer_binding_size)
                    .min(cap.limits.max_buffer_size),
                timeline: config.timeline.clone(),
            });
            tasks.push(tokio::spawn(
                Worker {
                    me: raft_id,
                    consensus: consensus.clone(),
                    runner,
                    post: Arc::new(tokio::sync::Semaphore::new(16)),
                    timeline: config.timeline.clone(),
                }
                .run(cancel.clone()),
            ));
        }
        let mut api = ApiState::new(
            consensus.clone(),
            liveness,
            peers.clone(),
            blobs,
            kernels,
            config.limits,
            metrics,
            config.timeline.clone(),
        );
        api.run_here = run_here;
        let leaving = Leaving {
            consensus: consensus.clone(),
            blobs: api.blobs.clone(),
            liveness: api.liveness.clone(),
            data_dir: config.data_dir.clone(),
            cluster,
            left,
            once: Arc::default(),
        };
        api.leaving = Some(leaving.clone());
        api.results = made_outputs;
        api.calls = Some(crate::host::CallSender {
            me: raft_id,
            inbox: calls_tx,
            net: net.clone(),
            peers: api.peers.clone(),
            consensus: consensus.clone(),
        });
        let (api_addr, api_task) =
            crate::api::serve(api_listener, api_token, api, cancel.clone()).await?;
        tasks.push(api_task);
        tracing::info!(%peer_id, raft_id, %api_addr, "node started");
        Ok(MeshNode {
            peer_id,
            raft_id,
            api_addr,
            listen_addrs,
            consensus,
            net,
            blobs: store,
            capability,
            cluster_key,
            cancel: cancel.clone(),
            tasks: std::mem::take(tasks),
            gpu_thread,
            leaving,
            removal,
            peers,
            _dir_lock: dir_lock,
        })
    }

    /// Serves nothing until this node knows a leader and sees itself in the
    /// membership it has applied (a joiner has caught up): reads and proposals
    /// before that would only time out or look empty. A member restarting while no
    /// quorum is reachable serves anyway after a short wait (its API answers 503
    /// until a leader is back) rather than exit.
    async fn wait_until_serving(
        consensus: &ConsensusHandle,
        config: &NodeConfig,
        restarting: bool,
        left: &CancellationToken,
    ) -> Result<()> {
        let me = consensus.id();
        let wait = if restarting {
            config.join_timeout.min(RESTART_WAIT)
        } else {
            config.join_timeout
        };
        let mut status = consensus.watch_status();
        let ready = tokio::time::timeout(wait, async {
            loop {
                let leader = status.borrow_and_update().leader_id;
                // Removed while it was down: it stops as soon as it is up.
                if left.is_cancelled()
                    || (leader != 0 && consensus.read_local(move |s| s.member(me).is_some()))
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if ready.is_err() {
            if !restarting {
                return Err(NodeError::Config(format!(
                    "no Raft leader accepted this node within {:?}; a majority of the \
                     mesh's voters must be running",
                    config.join_timeout
                )));
            }
            tracing::warn!(
                "no Raft leader within {wait:?} of restarting: serving anyway; the API \
                 answers 503 until a majority of the mesh's voters is reachable (a node \
                 removed from its mesh with `gpumesh remove` stops once a member says so)"
            );
        }
        Ok(())
    }

    /// A node that joined serves once the leader has made it a voter (or the mesh
    /// has all the voters it takes): until then the mesh's quorum does not count
    /// on it, and losing one of the voters it joined could stop the whole mesh —
    /// the README's recipe kills the node everyone joined through right after
    /// the third is up. After `wait` it serves anyway, saying so.
    async fn wait_until_voting(consensus: &ConsensusHandle, wait: Duration) {
        let me = consensus.id();
        let voting = move |s: &gpumesh_consensus::StateMachine| {
            s.member(me)
                .is_some_and(|m| m.role == gpumesh_consensus::Role::Voter)
                || s.voter_count() >= s.settings().max_voters as usize
        };
        let promoted = tokio::time::timeout(wait, async {
            while !consensus.read_local(voting) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if promoted.is_err() {
            tracing::warn!(
                "still a learner {wait:?} after joining: serving, but the mesh's quorum \
                 does not count on this node until the leader promotes it"
            );
        }
    }

    /// Leaves the mesh for good (see [`leave`]): other members keep what this node
    /// holds, another voter leads, the mesh removes it and its data dir is marked;
    /// then [`Self::left`] fires, and the caller stops it. An error leaves it a
    /// member, running as it was.
    pub async fn leave(&self) -> Result<crate::api::LeftView> {
        Ok(self.leaving.leave().await?)
    }

    /// Fires once this node has left the mesh (through [`Self::leave`] or its API's
    /// `POST /v1/leave`), or has found it was removed ([`Self::removed`]): what runs
    /// it should then [`Self::stop`] it.
    pub fn left(&self) -> CancellationToken {
        self.leaving.left.clone()
    }

    /// Whether this node can address Raft frames to the replica `raft_id`: it knows
    /// which peer that is. A node serving knows every member it has applied.
    pub fn reaches(&self, raft_id: u64) -> bool {
        self.peers.peer(raft_id).is_some()
    }

    /// Why this node is no longer a member, if it found it was removed by another
    /// (`gpumesh remove` while it was down or cut off) rather than left; its data
    /// dir is then marked as one that left (see [`removed`]).
    pub fn removed(&self) -> Option<String> {
        self.removal.get().cloned()
    }

    /// Stops, staying a member (Ctrl-C, SIGTERM): a leader first hands the
    /// leadership to another voter, so the mesh does not wait out an election
    /// timeout to go on without it. Started again on its data dir, it comes back.
    pub async fn shutdown(self) {
        let me = self.raft_id;
        if let Ok(st) = self.consensus.status().await {
            if st.leader_id == me {
                let handed = self.leaving.hand_over_leadership(me, &st.voters).await;
                tracing::info!(to = ?handed, "handed the leadership over before stopping");
            }
        }
        self.stop().await;
    }

    /// Stops without leaving (as a crash would, minus the crash).
    pub async fn stop(self) {
        self.consensus.shutdown().await;
        self.halt().await;
    }

    /// Stops as abruptly as a process can stop itself: the Raft replica is aborted
    /// wherever it is between two steps (what it had made durable stays; nothing
    /// else is flushed), then everything else stops. For chaos tests; a real crash
    /// is `kill -9` of a `gpumesh node` process.
    pub async fn kill(self) {
        self.consensus.kill().await;
        self.halt().await;
    }

    async fn halt(self) {
        self.cancel.cancel();
        // One deadline for all of them: a task stuck past it (a shard still in its
        // GPU wait) is aborted, not waited on in turn.
        let limit = tokio::time::Instant::now() + Duration::from_secs(5);
        for mut t in self.tasks {
            if tokio::time::timeout_at(limit, &mut t).await.is_err() {
                t.abort();
            }
        }
        // The device is destroyed on the GPU thread once its last dispatch ends; a
        // process that exits before then can crash in the driver's exit handlers.
        if let Some(thread) = self.gpu_thread {
            let limit = tokio::time::Instant::now() + GPU_STOP_WAIT;
            while !thread.is_finished() && tokio::time::Instant::now() < limit {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if thread.is_finished() {
                let _ = thread.join();
            } else {
                tracing::warn!(
                    "the GPU is still busy with a dispatch after {GPU_STOP_WAIT:?}; not waiting for it"
                );
            }
        }
    }
}
