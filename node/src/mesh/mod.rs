//! `MeshNode`: one gpumesh node, every actor wired together.
//!
//! Start-up: identity and blob store from the data dir, the GPU thread (calibrated),
//! the libp2p net actor (behind the cluster key and allow-list, if any), then the
//! Raft record — reopened from the data dir, or formed (`--init`,
//! `--bootstrap-expect N`), or joined through any member reached by `--peer` or
//! mDNS — and finally the worker, the scheduler, heartbeats and the
//! local HTTP API. Raft frames travel over libp2p; a peer's raft id is derived from
//! its Noise-authenticated peer id, so no frame can claim another sender.
//!
//! - `config`: [`NodeConfig`], [`Faults`], [`Formation`].
//! - `formation`: reopen, form or join a mesh.
//! - `routing`: network events to their owners; peers' node requests answered.
//! - `members`: a connection to every member, and this node's addresses recorded.
//! - `transfer`: blobs pulled from holders and second copies kept.
//! - `heartbeats`: heartbeat and capability proposals.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use gpumesh_consensus::{
    ClusterId, ClusterSettings, Command, ConsensusHandle, RedbStorage, ReplicaConfig, Transport,
    Unreachable,
};
use gpumesh_protocol::mesh::{MeshRequest, MeshResponse};
use gpumesh_protocol::NodeCapability;
use gpumesh_shaders::BackendChoice;
use libp2p::{Multiaddr, PeerId};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::blob::BlobStore;
use crate::cluster_key::ClusterKey;
use crate::error::{NodeError, Result};
use crate::identity;
use crate::limits::Limits;
use crate::liveness::LivenessHandle;
use crate::metrics::Metrics;
use crate::net::{ConnectionCaps, NetConfig, NetEvent, NetHandle};
use crate::scheduler::{self, Scheduler, SchedulerConfig};
use crate::wire::{self, NodeReply, NodeRequest};
use crate::worker::{GpuHandle, Worker};

mod config;
mod formation;
mod heartbeats;
mod members;
mod routing;
mod transfer;

pub use config::{Faults, Formation, NodeConfig};
use formation::{join_through, open_or_form};
use heartbeats::heartbeats;
use members::{connect_members, learn_members, member_peers, member_records, record_mesh_addrs};
use routing::dispatch;
pub(crate) use transfer::{fetch_blob, replicate};

/// Raft id → peer id, learned from connections and from the membership table.
#[derive(Clone, Default)]
pub struct PeerBook(Arc<RwLock<HashMap<u64, PeerId>>>);

impl PeerBook {
    pub fn insert(&self, peer: PeerId) -> u64 {
        let id = identity::raft_id(&peer);
        if let Ok(mut m) = self.0.write() {
            m.insert(id, peer);
        }
        id
    }

    pub fn get(&self, raft_id: u64) -> Option<PeerId> {
        self.0.read().ok()?.get(&raft_id).copied()
    }

    pub fn all(&self) -> Vec<PeerId> {
        self.0
            .read()
            .map(|m| m.values().copied().collect())
            .unwrap_or_default()
    }
}

struct NetTransport {
    net: NetHandle,
    peers: PeerBook,
}

impl Transport for NetTransport {
    fn send(&self, to: u64, frame: Vec<u8>) -> std::result::Result<(), Unreachable> {
        let peer = self.peers.get(to).ok_or(Unreachable)?;
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
}

/// What the dispatcher and the API share.
pub(crate) struct Shared {
    pub raft_id: u64,
    pub peer_id: PeerId,
    pub net: NetHandle,
    pub blobs: BlobStore,
    pub peers: PeerBook,
    pub consensus: tokio::sync::OnceCell<ConsensusHandle>,
    pub cluster: tokio::sync::OnceCell<ClusterId>,
    pub capability: Option<NodeCapability>,
    pub results: crate::api::ResultCache,
    pub limits: Limits,
    /// Submits through this node's API not yet applied here: counted with the
    /// replicated queue so that concurrent submits cannot pass the queue limit.
    pub submits_in_flight: AtomicUsize,
    /// Where peers listen, from identify, mDNS and other nodes' address books.
    pub addrs: RwLock<HashMap<PeerId, Vec<Multiaddr>>>,
    /// Kernels compiled on this node, by source hash: the API's validation and the
    /// worker's runs share them.
    pub kernels: Arc<gpumesh_shaders::KernelCache>,
    /// Which members are alive; started with consensus.
    pub liveness: tokio::sync::OnceCell<LivenessHandle>,
    /// Shard results per node per second, for the dashboard.
    pub(crate) throughput: Arc<crate::dashboard::Throughput>,
    /// This node's metrics, served at `GET /metrics`.
    pub metrics: Metrics,
}

impl Shared {
    fn learn_addrs(&self, peer: PeerId, addrs: &[Multiaddr]) {
        if let Ok(mut book) = self.addrs.write() {
            let known = book.entry(peer).or_default();
            for a in addrs {
                if !known.contains(a) {
                    known.push(a.clone());
                }
            }
        }
    }
}

/// The file a node leaves in its data dir once it formed or joined a mesh.
pub(crate) const CLUSTER_FILE: &str = "cluster-id";

/// How long a member restarting on its data dir waits for a leader before serving.
const RESTART_WAIT: Duration = Duration::from_secs(5);

/// How long [`MeshNode::stop`] waits for a dispatch under way to end.
const GPU_STOP_WAIT: Duration = Duration::from_secs(30);

impl MeshNode {
    /// Starts a node; returns once it is a member of a mesh and serving its API.
    pub async fn start(config: NodeConfig) -> Result<MeshNode> {
        config.limits.check()?;
        let cancel = CancellationToken::new();
        let dir = &config.data_dir;
        std::fs::create_dir_all(dir).map_err(|e| NodeError::io(dir, e))?;
        let cluster_key =
            crate::admission::settle_key(dir, config.cluster_key, config.open, config.formation)?;
        let api_token = crate::admission::api_token(dir)?;
        let keypair = identity::load_or_create(dir)?;
        let peer_id = keypair.public().to_peer_id();
        let raft_id = identity::raft_id(&peer_id);
        let blobs = BlobStore::open(dir.join("blobs"), config.limits.max_blob_bytes)?;
        let metrics = Metrics::new(peer_id, raft_id);

        let backend = config.backend;
        let calibrate = config.calibrate;
        let gpu_metrics = metrics.gpu.clone();
        let gpu =
            tokio::task::spawn_blocking(move || GpuHandle::start(backend, calibrate, gpu_metrics))
                .await
                .map_err(|e| NodeError::Config(format!("GPU start-up panicked: {e}")))?;
        let capability = gpu.as_ref().map(|(_, c, _)| c.clone());

        let (events_tx, events_rx) = mpsc::channel(1024);
        let mut net_config = NetConfig::new(keypair);
        net_config.listen = config.listen.clone();
        net_config.peers = config.peers.clone();
        net_config.mdns = config.mdns;
        net_config.psk = cluster_key.map(|k| k.psk());
        net_config.allow_peers = config.allow_peers.clone();
        net_config.connections = config.connections;
        net_config.metrics = metrics.net.clone();
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
            NetHandle::start(net_config, blobs.clone(), events_tx, cancel.clone()).await?;
        let listen_addrs = net.listen_addrs().await?;

        let shared = Arc::new(Shared {
            raft_id,
            peer_id,
            net: net.clone(),
            blobs: blobs.clone(),
            peers: PeerBook::default(),
            consensus: tokio::sync::OnceCell::new(),
            cluster: tokio::sync::OnceCell::new(),
            capability: capability.clone(),
            results: Default::default(),
            limits: config.limits,
            submits_in_flight: AtomicUsize::new(0),
            addrs: RwLock::new(HashMap::new()),
            liveness: tokio::sync::OnceCell::new(),
            kernels: Arc::default(),
            throughput: Arc::default(),
            metrics,
        });
        shared.peers.insert(peer_id);
        let mut tasks = vec![net_task];
        tasks.push(tokio::spawn(dispatch(
            shared.clone(),
            events_rx,
            cancel.clone(),
        )));

        // A member restarting on its data dir (not joining, not forming).
        let restarting = config.data_dir.join(CLUSTER_FILE).exists();
        let result = async {
            let (storage, joined_through) = open_or_form(&config, &shared).await?;
            let restarting = restarting && joined_through.is_none();
            let mut rc = ReplicaConfig::new(raft_id);
            rc.tick_interval = config.raft_tick;
            let transport = Arc::new(NetTransport {
                net: net.clone(),
                peers: shared.peers.clone(),
            });
            let consensus = ConsensusHandle::start(rc, storage, transport)?;
            let _ = shared.consensus.set(consensus.clone());
            shared.metrics.follow(consensus.clone());
            let (liveness, liveness_task) = LivenessHandle::start(
                raft_id,
                consensus.clone(),
                config.down_after,
                cancel.clone(),
            );
            let _ = shared.liveness.set(liveness);
            // Dial every member at once: a node restarted with no --peer finds the
            // mesh through the addresses in its own copy of the membership.
            let members = tokio::spawn(learn_members(
                shared.clone(),
                config.data_dir.clone(),
                cancel.clone(),
            ));
            if let Some(peer) = joined_through {
                join_through(&shared, peer, config.join_timeout).await?;
            }
            // Serve nothing until this node knows a leader and sees itself in the
            // membership it has applied (a joiner has caught up): reads and
            // proposals before that would only time out or look empty. A member
            // restarting while no quorum is reachable serves anyway after a short
            // wait (its API answers 503 until a leader is back) rather than exit.
            let me = raft_id;
            let wait = if restarting {
                config.join_timeout.min(RESTART_WAIT)
            } else {
                config.join_timeout
            };
            let ready = tokio::time::timeout(wait, async {
                loop {
                    let leader = consensus.watch_status().borrow().leader_id;
                    let member = consensus
                        .read_local(move |s| s.member(me).is_some())
                        .await
                        .unwrap_or(false);
                    if leader != 0 && member {
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
                     answers 503 until a majority of the mesh's voters is reachable"
                );
            }
            Ok::<_, NodeError>((consensus, [members, liveness_task]))
        }
        .await;
        let consensus = match result {
            Ok((c, started)) => {
                tasks.extend(started);
                c
            }
            Err(e) => {
                cancel.cancel();
                return Err(e);
            }
        };

        // Before the API answers, so `gpumesh ticket` works as soon as the node is up.
        if let Some(records) = member_records(&consensus).await {
            record_mesh_addrs(&shared, &records, &config.data_dir, &mut Vec::new()).await;
        }
        tasks.push(tokio::spawn(
            shared
                .throughput
                .clone()
                .track(consensus.clone(), cancel.clone()),
        ));
        tasks.push(tokio::spawn(heartbeats(
            shared.clone(),
            config.heartbeat_interval,
            cancel.clone(),
        )));
        tasks.push(tokio::spawn(
            Scheduler {
                consensus: consensus.clone(),
                shared: shared.clone(),
                liveness: shared.liveness.get().cloned().ok_or_else(|| {
                    NodeError::Config("liveness did not start with consensus".into())
                })?,
                config: config.scheduler,
            }
            .run(cancel.clone()),
        ));
        let mut gpu_thread = None;
        if let Some((gpu, _, thread)) = gpu {
            gpu_thread = Some(thread);
            tasks.push(tokio::spawn(
                Worker {
                    me: raft_id,
                    consensus: consensus.clone(),
                    shared: shared.clone(),
                    gpu,
                    post: Arc::new(tokio::sync::Semaphore::new(16)),
                    default_deadline: config.default_deadline,
                    faults: config.faults.clone(),
                }
                .run(cancel.clone()),
            ));
        }
        let (api_addr, api_task) =
            crate::api::serve(config.api, api_token, shared.clone(), cancel.clone()).await?;
        tasks.push(api_task);
        tracing::info!(%peer_id, raft_id, %api_addr, "node started");
        Ok(MeshNode {
            peer_id,
            raft_id,
            api_addr,
            listen_addrs,
            consensus,
            net,
            blobs,
            capability,
            cluster_key,
            cancel,
            tasks,
            gpu_thread,
        })
    }

    /// Leaves the mesh gracefully: hands leadership away, asks to be removed, stops.
    pub async fn leave(self) {
        let status = self.consensus.status().await.ok();
        if let Some(st) = &status {
            if st.leader_id == self.raft_id {
                if let Some(&other) = st.voters.iter().find(|&&v| v != self.raft_id) {
                    let _ = self.consensus.transfer_leader(other).await;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        let removal = tokio::time::timeout(
            Duration::from_secs(5),
            self.consensus.propose(Command::NodeLeft {
                raft_id: self.raft_id,
            }),
        )
        .await;
        if !matches!(removal, Ok(Ok(_))) {
            tracing::warn!("could not confirm removal from the mesh before stopping");
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
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
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
