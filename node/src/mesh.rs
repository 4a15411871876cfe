//! `MeshNode`: one gpumesh node, every actor wired together.
//!
//! Start-up: identity and blob store from the data dir, the GPU thread (calibrated),
//! the libp2p net actor (behind the cluster key and allow-list, if any), then the
//! Raft record — reopened from the data dir, or formed (`--init`,
//! `--bootstrap-expect N`), or joined through any member reached by `--peer` or
//! mDNS — and finally the worker, the scheduler, heartbeats and the
//! local HTTP API. Raft frames travel over libp2p; a peer's raft id is derived from
//! its Noise-authenticated peer id, so no frame can claim another sender.

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

/// How a node comes into a mesh the first time it starts with an empty data dir.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Formation {
    /// Form a new one-node mesh.
    Init,
    /// Wait until this many nodes (this one included) see each other, then form a
    /// mesh of all of them as voters.
    BootstrapExpect(usize),
    /// Join an existing mesh through any member reached.
    Join,
}

/// Everything a node needs to start.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    pub listen: Vec<Multiaddr>,
    pub api: SocketAddr,
    pub formation: Formation,
    pub peers: Vec<Multiaddr>,
    pub backend: BackendChoice,
    pub mdns: bool,
    pub calibrate: bool,
    /// How long joining or forming may take before the node gives up.
    pub join_timeout: Duration,
    pub heartbeat_interval: Duration,
    /// Raft tick; elections happen after 10 ticks without a leader.
    pub raft_tick: Duration,
    pub max_voters: u32,
    /// What one request may ask of this node (sizes, grid, queue).
    pub limits: Limits,
    /// The mesh's shared secret (a `--cluster-key` file's or a join ticket's). When
    /// `None`, the key in the data dir (`cluster.key`); a node forming a mesh with
    /// `Formation::Init` makes one there. `Debug` shows only its fingerprint.
    pub cluster_key: Option<ClusterKey>,
    /// A mesh without a cluster key, open to anyone who reaches the listen
    /// addresses. Off by default: a node with no key and no `open` refuses to start.
    pub open: bool,
    /// When not empty, the only peers this node keeps connections with.
    pub allow_peers: Vec<PeerId>,
    /// Caps on connections per peer, in total, and half-open.
    pub connections: ConnectionCaps,
    /// How long a member may be silent before every node counts it as down (its
    /// attempts are placed elsewhere, status shows it silent).
    pub down_after: Duration,
    /// How often the leader places work, and when an attempt is a straggler.
    pub scheduler: SchedulerConfig,
    /// How long a shard may run on the GPU unless its task says otherwise.
    pub default_deadline: Duration,
    /// Faults to inject, for tests and `gpumesh bench faults`; none by default.
    pub faults: Faults,
}

/// Faults a node can be told to inject into its own work.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Sleep this long before each shard (a slow or overloaded GPU).
    pub gpu_delay: Option<Duration>,
    /// Flip a bit in every shard output before reporting it (a faulty GPU).
    pub corrupt_outputs: bool,
}

impl NodeConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        NodeConfig {
            data_dir: data_dir.into(),
            listen: vec!["/ip4/0.0.0.0/tcp/0".parse().expect("valid multiaddr")],
            api: SocketAddr::from(([127, 0, 0, 1], 7070)),
            formation: Formation::Join,
            peers: Vec::new(),
            backend: BackendChoice::Auto,
            mdns: true,
            calibrate: true,
            join_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(2),
            raft_tick: Duration::from_millis(100),
            max_voters: 5,
            down_after: crate::liveness::DEFAULT_DOWN_AFTER,
            scheduler: SchedulerConfig::default(),
            default_deadline: Duration::from_secs(60),
            faults: Faults::default(),
            limits: Limits::default(),
            cluster_key: None,
            open: false,
            allow_peers: Vec::new(),
            connections: ConnectionCaps::default(),
        }
    }
}

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

/// Opens the Raft storage of an existing member, or forms/joins a mesh. Returns the
/// storage and, when joining, the peer to ask for membership once Raft runs.
async fn open_or_form(
    config: &NodeConfig,
    shared: &Arc<Shared>,
) -> Result<(RedbStorage, Option<PeerId>)> {
    let dir = &config.data_dir;
    let raft_path = dir.join("raft.redb");
    let cluster_path = dir.join(CLUSTER_FILE);
    if let Ok(text) = std::fs::read_to_string(&cluster_path) {
        let cluster =
            ClusterId(text.trim().parse().map_err(|_| {
                NodeError::Config(format!("{} is corrupt", cluster_path.display()))
            })?);
        let storage = RedbStorage::open(&raft_path, cluster)?;
        let _ = shared.cluster.set(cluster);
        if storage.is_initialized() {
            return Ok((storage, None));
        }
        // Joined once but never received the mesh's state: join again.
        let peer = find_mesh(config, shared, Some(cluster)).await?.1;
        return Ok((storage, Some(peer)));
    }
    let settings = ClusterSettings {
        max_voters: config.max_voters,
    };
    match config.formation {
        Formation::Init => {
            let cluster = ClusterId::derive(
                format!("{}:{:?}", shared.peer_id, std::time::SystemTime::now()).as_bytes(),
            );
            let mut storage = RedbStorage::open(&raft_path, cluster)?;
            storage.initialize(&[(shared.raft_id, shared.peer_id.to_string())], settings)?;
            save_cluster(&cluster_path, cluster)?;
            let _ = shared.cluster.set(cluster);
            Ok((storage, None))
        }
        Formation::BootstrapExpect(n) => {
            let deadline = Instant::now() + config.join_timeout;
            loop {
                let seen = hello_all(shared).await;
                if let Some((peer, cluster)) = seen.iter().find_map(|(p, c)| c.map(|c| (*p, c))) {
                    // Someone formed it already: join.
                    let cluster = ClusterId(cluster);
                    let storage = RedbStorage::open(&raft_path, cluster)?;
                    save_cluster(&cluster_path, cluster)?;
                    let _ = shared.cluster.set(cluster);
                    return Ok((storage, Some(peer)));
                }
                let mut founders: Vec<(u64, String)> = seen
                    .iter()
                    .map(|(p, _)| (identity::raft_id(p), p.to_string()))
                    .chain([(shared.raft_id, shared.peer_id.to_string())])
                    .collect();
                founders.sort();
                founders.dedup();
                if founders.len() >= n {
                    founders.truncate(n);
                    if founders.iter().any(|(id, _)| *id == shared.raft_id) {
                        let seed: String = founders
                            .iter()
                            .map(|(_, p)| p.as_str())
                            .collect::<Vec<_>>()
                            .join(",");
                        let cluster = ClusterId::derive(seed.as_bytes());
                        let mut storage = RedbStorage::open(&raft_path, cluster)?;
                        storage.initialize(&founders, settings)?;
                        save_cluster(&cluster_path, cluster)?;
                        let _ = shared.cluster.set(cluster);
                        return Ok((storage, None));
                    }
                }
                if Instant::now() > deadline {
                    return Err(NodeError::Config(format!(
                        "--bootstrap-expect {n}: saw only {} node(s) within {:?}; start the others or \
                         point --peer at them",
                        founders.len(),
                        config.join_timeout
                    )));
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
        Formation::Join => {
            let (cluster, peer) = find_mesh(config, shared, None).await?;
            let storage = RedbStorage::open(&raft_path, cluster)?;
            save_cluster(&cluster_path, cluster)?;
            let _ = shared.cluster.set(cluster);
            Ok((storage, Some(peer)))
        }
    }
}

fn save_cluster(path: &std::path::Path, cluster: ClusterId) -> Result<()> {
    std::fs::write(path, cluster.0.to_string()).map_err(|e| NodeError::io(path, e))
}

/// Asks every connected peer which mesh it is in.
async fn hello_all(shared: &Arc<Shared>) -> Vec<(PeerId, Option<u64>)> {
    let peers = shared.net.connected_peers().await.unwrap_or_default();
    let mut out = Vec::new();
    for peer in peers {
        let asked = shared
            .net
            .request(peer, MeshRequest::Node(wire::encode(&NodeRequest::Hello)))
            .await;
        if let Ok(MeshResponse::Node(bytes)) = asked {
            if let Some(NodeReply::Hello { cluster, .. }) = wire::decode(&bytes) {
                out.push((peer, cluster));
            }
        }
    }
    out
}

/// Finds a member of a mesh (of `cluster`, if given) among the reachable peers.
async fn find_mesh(
    config: &NodeConfig,
    shared: &Arc<Shared>,
    cluster: Option<ClusterId>,
) -> Result<(ClusterId, PeerId)> {
    let deadline = Instant::now() + config.join_timeout;
    loop {
        let seen = hello_all(shared).await;
        for (peer, theirs) in &seen {
            match (theirs, cluster) {
                (Some(c), None) => return Ok((ClusterId(*c), *peer)),
                (Some(c), Some(mine)) if *c == mine.0 => return Ok((mine, *peer)),
                (Some(c), Some(mine)) => {
                    return Err(NodeError::Config(format!(
                    "this data dir ({}) belongs to mesh {:x}, but peer {peer} is in mesh {c:x}; \
                         use a fresh --data-dir to join that mesh",
                    config.data_dir.display(),
                    mine.0
                )))
                }
                (None, _) => {}
            }
        }
        if Instant::now() > deadline {
            if config.peers.is_empty() && seen.is_empty() {
                return Err(NodeError::Config(
                    "found no mesh to join: give --peer ADDRESS of a member, or --init to start a new mesh".into(),
                ));
            }
            // Say why, peer by peer, when there are peers to ask.
            let mut why = Vec::new();
            for addr in &config.peers {
                why.push(probe(shared, addr).await);
            }
            return Err(NodeError::Config(if why.is_empty() {
                format!(
                    "no mesh member answered within {:?}; check that a member runs and is \
                     reachable, or --init to start a new mesh",
                    config.join_timeout
                )
            } else {
                format!(
                    "no mesh member answered within {:?}: {}",
                    config.join_timeout,
                    why.join("; ")
                )
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// How long the last look at a `--peer` that never let this node join may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One more attempt at a `--peer`, to say why joining through it failed: a refused or
/// failed handshake (wrong cluster key, nothing there), or a connection that the other
/// side closes as soon as it opens (this node is not on its allow-list).
async fn probe(shared: &Arc<Shared>, addr: &Multiaddr) -> String {
    let me = shared.peer_id;
    let attempt = async {
        let peer = match shared.net.dial(addr.clone()).await {
            Ok(peer) => peer,
            // Names the address and hints at the cluster key itself.
            Err(e) => return e.to_string(),
        };
        let hello = MeshRequest::Node(wire::encode(&NodeRequest::Hello));
        match shared.net.request(peer, hello).await {
            Ok(MeshResponse::Node(bytes)) => match wire::decode(&bytes) {
                Some(NodeReply::Hello { cluster: None, .. }) => {
                    format!("{addr} answered but is not in a mesh yet (start one node with --init)")
                }
                Some(NodeReply::Hello {
                    cluster: Some(_), ..
                }) => {
                    format!("{addr} is a mesh member and answers now; try again")
                }
                _ => format!("{addr} gave an unexpected answer; is it the same gpumesh version?"),
            },
            Ok(other) => format!("{addr} answered {other:?}; is it the same gpumesh version?"),
            Err(e) => format!(
                "{addr} accepted the connection, then closed it or did not answer ({e}); if \
                 that mesh admits only listed peers, add this node's peer id {me} to its \
                 members' --allow-peer"
            ),
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| {
            format!(
                "{addr} did not complete a handshake within {PROBE_TIMEOUT:?}; check that it \
                 uses the same cluster key"
            )
        })
}

/// Asks `peer` to add us as a learner, retrying until it is committed.
async fn join_through(shared: &Arc<Shared>, peer: PeerId, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let request = NodeRequest::Join {
        capability: shared.capability.clone(),
    };
    loop {
        let reply = shared
            .net
            .request(peer, MeshRequest::Node(wire::encode(&request)))
            .await;
        match reply {
            Ok(MeshResponse::Node(bytes)) => match wire::decode(&bytes) {
                Some(NodeReply::Joined) => return Ok(()),
                Some(NodeReply::Refused(why)) if Instant::now() > deadline => {
                    return Err(NodeError::Config(format!(
                        "{peer} refused to add this node: {why}"
                    )))
                }
                _ => {}
            },
            Err(e) if Instant::now() > deadline => {
                return Err(NodeError::Config(format!(
                    "could not join through {peer}: {e}"
                )))
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return Err(NodeError::Config(format!(
                "{peer} did not add this node within {timeout:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// How long a peer whose connections closed may take to come back by itself before
/// this node tries to reach it.
const RECONNECT_GRACE: Duration = Duration::from_millis(100);
/// How long that one attempt to reach it may take.
const REACH_TIMEOUT: Duration = Duration::from_millis(500);

/// After the last connection to `peer` closed: if it does not come back and cannot
/// be dialled at any address known for it, it is unreachable. A process that died
/// refuses the dial at once, so the mesh learns of it in well under a second instead
/// of waiting for missed heartbeats; a peer that merely went quiet still is found by
/// the scheduler's heartbeat timeout.
async fn confirm_lost(shared: Arc<Shared>, peer: PeerId) {
    tokio::time::sleep(RECONNECT_GRACE).await;
    let connected = |list: &[PeerId]| list.contains(&peer);
    if connected(&shared.net.connected_peers().await.unwrap_or_default()) {
        return;
    }
    let addrs = shared
        .addrs
        .read()
        .ok()
        .and_then(|book| book.get(&peer).cloned())
        .unwrap_or_default();
    for addr in addrs {
        let Ok(addr) = addr.with_p2p(peer) else {
            continue;
        };
        if let Ok(Ok(_)) = tokio::time::timeout(REACH_TIMEOUT, shared.net.dial(addr)).await {
            return;
        }
    }
    if connected(&shared.net.connected_peers().await.unwrap_or_default()) {
        return;
    }
    let id = shared.peers.insert(peer);
    tracing::info!(%peer, raft_id = id, "peer unreachable: its connections closed and it cannot be dialled");
    if let Some(liveness) = shared.liveness.get() {
        liveness.unreachable(id).await;
    }
    if let Some(c) = shared.consensus.get() {
        let _ = c.peer_unreachable(id).await;
    }
}

/// Routes network events: Raft frames to the replica, node requests to handlers.
async fn dispatch(
    shared: Arc<Shared>,
    mut events: mpsc::Receiver<NetEvent>,
    cancel: CancellationToken,
) {
    loop {
        let event = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            e = events.recv() => match e { Some(e) => e, None => return },
        };
        match event {
            NetEvent::Raft { from, frame } => {
                let id = shared.peers.insert(from);
                if let Some(c) = shared.consensus.get() {
                    if !c.try_receive(id, frame) {
                        tracing::debug!("raft inbox full; frame dropped (raft retries)");
                    }
                }
            }
            NetEvent::PeerConnected { peer, .. } => {
                let id = shared.peers.insert(peer);
                if let Some(liveness) = shared.liveness.get() {
                    liveness.reachable(id);
                }
            }
            NetEvent::PeerDiscovered { peer, addrs } => {
                shared.learn_addrs(peer, &addrs);
                for a in &addrs {
                    let _ = shared.net.add_address(peer, a.clone()).await;
                }
                let connected = shared.net.connected_peers().await.unwrap_or_default();
                if !connected.contains(&peer) {
                    if let Some(addr) = addrs.first() {
                        let net = shared.net.clone();
                        let addr = addr.clone();
                        tokio::spawn(async move {
                            let _ = net.dial(addr).await;
                        });
                    }
                }
            }
            NetEvent::PeerDisconnected(peer) => {
                tokio::spawn(confirm_lost(shared.clone(), peer));
            }
            NetEvent::Request {
                from,
                request,
                reply,
            } => {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let answer = answer(&shared, from, request).await;
                    let _ = reply.send(answer);
                });
            }
        }
    }
}

async fn answer(shared: &Arc<Shared>, from: PeerId, request: MeshRequest) -> MeshResponse {
    let MeshRequest::Node(bytes) = request else {
        return MeshResponse::Error("unsupported request".into());
    };
    let Some(request) = wire::decode::<NodeRequest>(&bytes) else {
        tracing::warn!(%from, "malformed node request dropped");
        return MeshResponse::Error("malformed node request".into());
    };
    let reply = match request {
        NodeRequest::Hello => NodeReply::Hello {
            raft_id: shared.raft_id,
            cluster: match shared.consensus.get() {
                Some(_) => shared.cluster.get().map(|c| c.0),
                None => None,
            },
        },
        NodeRequest::Join { capability } => match shared.consensus.get() {
            None => NodeReply::Refused("this node is not in a mesh yet".into()),
            Some(c) => {
                let raft_id = shared.peers.insert(from);
                let known = c
                    .read_local(move |s| s.member(raft_id).is_some())
                    .await
                    .unwrap_or(false);
                if known {
                    NodeReply::Joined
                } else {
                    match c.add_learner(raft_id, from.to_string(), capability).await {
                        Ok(_) => NodeReply::Joined,
                        Err(e) => NodeReply::Refused(e.to_string()),
                    }
                }
            }
        },
        NodeRequest::Replicate { blob } => match shared.net.fetch_blob(from, blob).await {
            Ok(()) => NodeReply::Replicated,
            Err(e) => NodeReply::Refused(format!("could not copy blob {blob}: {e}")),
        },
        NodeRequest::Peers => NodeReply::Peers(
            shared
                .addrs
                .read()
                .map(|book| {
                    book.iter()
                        .map(|(p, a)| (p.to_string(), a.iter().map(|a| a.to_string()).collect()))
                        .collect()
                })
                .unwrap_or_default(),
        ),
        NodeRequest::Leave => match shared.consensus.get() {
            None => NodeReply::Refused("not in a mesh".into()),
            Some(c) => {
                let raft_id = crate::identity::raft_id(&from);
                match c.propose(Command::NodeLeft { raft_id }).await {
                    Ok(_) => NodeReply::Left,
                    Err(e) => NodeReply::Refused(e.to_string()),
                }
            }
        },
    };
    MeshResponse::Node(wire::encode(&reply))
}

/// The peer ids in this replica's membership table.
async fn member_peers(consensus: &ConsensusHandle) -> Option<Vec<PeerId>> {
    Some(
        member_records(consensus)
            .await?
            .into_iter()
            .map(|(p, _)| p)
            .collect(),
    )
}

/// Every member's peer id and the addresses in its membership record.
async fn member_records(consensus: &ConsensusHandle) -> Option<Vec<(PeerId, Vec<Multiaddr>)>> {
    consensus
        .read_local(|s| {
            s.members()
                .values()
                .filter_map(|m| {
                    let peer = m.peer_id.parse::<PeerId>().ok()?;
                    let addrs = m.addrs.iter().filter_map(|a| a.parse().ok()).collect();
                    Some((peer, addrs))
                })
                .collect()
        })
        .await
        .ok()
}

/// Keeps the data dir's list of where members listen (what `gpumesh ticket` hands
/// out) in step with the membership records, this node's own addresses included
/// before its record has them. `recorded` is what was last written.
async fn record_mesh_addrs(
    shared: &Arc<Shared>,
    records: &[(PeerId, Vec<Multiaddr>)],
    data_dir: &std::path::Path,
    recorded: &mut Vec<Multiaddr>,
) {
    let mine = shared.net.listen_addrs().await.unwrap_or_default();
    let mut everyone: Vec<Multiaddr> = records
        .iter()
        .filter(|(peer, _)| *peer != shared.peer_id)
        .chain(std::iter::once(&(shared.peer_id, mine)))
        .flat_map(|(peer, addrs)| addrs.iter().filter_map(|a| a.clone().with_p2p(*peer).ok()))
        .collect();
    everyone.sort_by_key(|a| a.to_string());
    everyone.dedup();
    if everyone != *recorded && !everyone.is_empty() {
        match crate::admission::write_mesh_addrs(data_dir, &everyone) {
            Ok(()) => *recorded = everyone,
            Err(e) => tracing::warn!(error = %e, "could not record the members' addresses"),
        }
    }
}

/// How often a node looks for members it has no connection to.
const MEMBER_SWEEP: Duration = Duration::from_millis(500);

/// Keeps a connection to every member: the peer book follows the membership table,
/// and every member this node is not connected to is dialled at the addresses in its
/// membership record (and any learned otherwise), whoever this node bootstrapped
/// from. So losing any one node, the seed included, leaves the others connected.
async fn learn_members(shared: Arc<Shared>, data_dir: PathBuf, cancel: CancellationToken) {
    let Some(consensus) = shared.consensus.get().cloned() else {
        return;
    };
    let mut recorded: Vec<Multiaddr> = Vec::new();
    loop {
        if let Some(records) = member_records(&consensus).await {
            record_mesh_addrs(&shared, &records, &data_dir, &mut recorded).await;
            let connected = shared.net.connected_peers().await.unwrap_or_default();
            let mut missing = Vec::new();
            for (peer, addrs) in records {
                shared.peers.insert(peer);
                shared.learn_addrs(peer, &addrs);
                if peer != shared.peer_id && !connected.contains(&peer) {
                    missing.push(peer);
                }
            }
            if !missing.is_empty() {
                connect_members(&shared, &connected, &missing).await;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(MEMBER_SWEEP) => {}
        }
    }
}

/// Makes blob `id` local, pulling it from `preferred` first and then from every
/// other known peer, connecting to them as needed.
pub(crate) async fn fetch_blob(
    shared: &Arc<Shared>,
    id: gpumesh_protocol::BlobId,
    preferred: Option<PeerId>,
) -> std::result::Result<(), String> {
    if shared.blobs.has(&id) {
        return Ok(());
    }
    let mut last = String::from("no peer to fetch it from");
    for round in 0..5 {
        // Every member is a possible holder; a node that just joined learns them
        // from the replicated membership, not only from its connections.
        if let Some(c) = shared.consensus.get() {
            for p in member_peers(c).await.unwrap_or_default() {
                shared.peers.insert(p);
            }
        }
        let mut sources: Vec<PeerId> = preferred.into_iter().collect();
        for p in shared.peers.all() {
            if !sources.contains(&p) && p != shared.peer_id {
                sources.push(p);
            }
        }
        for &peer in &sources {
            match shared.net.fetch_blob(peer, id).await {
                Ok(()) => return Ok(()),
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "blob fetch failed");
                    last = e.to_string();
                }
            }
        }
        // Maybe we have no connection to the holder yet: make them and try again.
        let connected = shared.net.connected_peers().await.unwrap_or_default();
        let missing: Vec<PeerId> = sources
            .iter()
            .copied()
            .filter(|p| !connected.contains(p))
            .collect();
        connect_members(shared, &connected, &missing).await;
        tokio::time::sleep(Duration::from_millis(100 << round)).await;
    }
    Err(format!("blob {id} could not be fetched: {last}"))
}

/// Has one other member keep a copy of `blob` (the submitter first when it is
/// another node, then every other member, connected ones first), so that losing this
/// node after the result is recorded loses nothing. Succeeds at once in a one-node
/// mesh. Fails only when no other member can be reached or every one refused, and
/// then says how many were reachable.
pub(crate) async fn replicate(
    shared: &Arc<Shared>,
    blob: gpumesh_protocol::BlobId,
    prefer: Option<PeerId>,
) -> std::result::Result<(), String> {
    let members: Vec<PeerId> = match shared.consensus.get() {
        Some(c) => member_peers(c).await.unwrap_or_default(),
        None => Vec::new(),
    };
    let others: Vec<PeerId> = members
        .iter()
        .copied()
        .filter(|p| *p != shared.peer_id)
        .collect();
    if others.is_empty() {
        return Ok(());
    }
    let mut connected = shared.net.connected_peers().await.unwrap_or_default();
    let unconnected: Vec<PeerId> = others
        .iter()
        .copied()
        .filter(|p| !connected.contains(p))
        .collect();
    if unconnected.len() == others.len() {
        // No connection to any other member (this node just lost them, or is just
        // back): try to reach them before giving up.
        connect_members(shared, &connected, &unconnected).await;
        connected = shared.net.connected_peers().await.unwrap_or_default();
    }
    let mut targets: Vec<PeerId> = prefer
        .into_iter()
        .filter(|p| others.contains(p) && connected.contains(p))
        .collect();
    for p in &others {
        if connected.contains(p) && !targets.contains(p) {
            targets.push(*p);
        }
    }
    let reachable = targets.len();
    let mut refusals = Vec::new();
    for peer in targets {
        let asked = shared
            .net
            .request(
                peer,
                MeshRequest::Node(wire::encode(&NodeRequest::Replicate { blob })),
            )
            .await;
        match asked.map(|r| match r {
            MeshResponse::Node(bytes) => wire::decode::<NodeReply>(&bytes),
            _ => None,
        }) {
            Ok(Some(NodeReply::Replicated)) => return Ok(()),
            Ok(Some(NodeReply::Refused(why))) => refusals.push(format!("{peer}: {why}")),
            Ok(_) => refusals.push(format!("{peer}: unexpected answer")),
            Err(e) => refusals.push(format!("{peer}: {e}")),
        }
    }
    let n = others.len();
    Err(if reachable == 0 {
        format!(
            "no second copy of blob {blob}: none of the {n} other member(s) of the mesh is \
             reachable from this node"
        )
    } else {
        format!(
            "no second copy of blob {blob}: {reachable} of the {n} other member(s) are \
             reachable, and none kept a copy ({})",
            refusals.join("; ")
        )
    })
}

/// How long one dial of a member may take before the sweep moves on.
const MEMBER_DIAL_TIMEOUT: Duration = Duration::from_secs(3);

/// Dials members this node has no connection to, all at once, at every address
/// known for each (its membership record, identify, mDNS); asks the connected peers
/// for their address books first when some member's addresses are unknown.
async fn connect_members(shared: &Arc<Shared>, connected: &[PeerId], missing: &[PeerId]) {
    let known = |p: &PeerId| {
        shared
            .addrs
            .read()
            .map(|b| b.get(p).is_some_and(|a| !a.is_empty()))
            .unwrap_or(false)
    };
    if missing.iter().any(|p| !known(p)) {
        for peer in connected {
            let reply = shared
                .net
                .request(*peer, MeshRequest::Node(wire::encode(&NodeRequest::Peers)))
                .await;
            if let Ok(MeshResponse::Node(bytes)) = reply {
                if let Some(NodeReply::Peers(list)) = wire::decode(&bytes) {
                    for (p, addrs) in list {
                        if let Ok(p) = p.parse::<PeerId>() {
                            let addrs: Vec<Multiaddr> =
                                addrs.iter().filter_map(|a| a.parse().ok()).collect();
                            shared.learn_addrs(p, &addrs);
                        }
                    }
                }
            }
        }
    }
    let mut dials = tokio::task::JoinSet::new();
    for &peer in missing {
        let addrs = shared
            .addrs
            .read()
            .ok()
            .and_then(|b| b.get(&peer).cloned())
            .unwrap_or_default();
        let net = shared.net.clone();
        dials.spawn(async move {
            for addr in addrs {
                let _ = net.add_address(peer, addr.clone()).await;
                let with_id = match addr.iter().last() {
                    Some(libp2p::multiaddr::Protocol::P2p(_)) => addr,
                    _ => addr.with(libp2p::multiaddr::Protocol::P2p(peer)),
                };
                match tokio::time::timeout(MEMBER_DIAL_TIMEOUT, net.dial(with_id)).await {
                    Ok(Ok(_)) => return,
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "member dial failed"),
                    Err(_) => tracing::debug!(%peer, "member dial timed out"),
                }
            }
        });
    }
    while dials.join_next().await.is_some() {}
}

/// Publishes where this node listens into its membership record when the record
/// says otherwise (a new member, or one restarted on other addresses).
async fn publish_addrs(shared: &Arc<Shared>, consensus: &ConsensusHandle, recorded: &[String]) {
    let Ok(mine) = shared.net.listen_addrs().await else {
        return;
    };
    let mut mine: Vec<String> = mine.iter().map(|a| a.to_string()).collect();
    // Loopback last: a peer on another machine reaching its own loopback finds
    // itself, not this node.
    mine.sort_by_key(|a| a.starts_with("/ip4/127.") || a.starts_with("/ip6/::1/"));
    if mine.is_empty() || mine == recorded {
        return;
    }
    let proposed = consensus
        .propose(Command::NodeAddresses {
            raft_id: shared.raft_id,
            addrs: mine,
        })
        .await;
    if let Err(e) = proposed {
        tracing::debug!(error = %e, "listen addresses not yet recorded");
    }
}

/// Publishes this node's capability once and a heartbeat every `interval`.
async fn heartbeats(shared: Arc<Shared>, interval: Duration, cancel: CancellationToken) {
    let Some(consensus) = shared.consensus.get().cloned() else {
        return;
    };
    let me = shared.raft_id;
    let mut published = false;
    loop {
        let member = consensus
            .read_local(move |s| s.member(me).cloned())
            .await
            .ok()
            .flatten();
        // Until this node sees itself in the membership (a joiner catching up),
        // look again soon rather than after a whole interval.
        let wait = if member.is_some() {
            interval
        } else {
            Duration::from_millis(200)
        };
        if let Some(member) = member {
            publish_addrs(&shared, &consensus, &member.addrs).await;
            if !published {
                match (&shared.capability, &member.capability) {
                    (Some(mine), theirs) if theirs.as_ref() != Some(mine) => {
                        published = consensus
                            .propose(Command::NodeCapabilities {
                                raft_id: me,
                                capability: mine.clone(),
                            })
                            .await
                            .is_ok();
                    }
                    _ => published = true,
                }
            }
            match consensus
                .propose(Command::Heartbeat {
                    raft_id: me,
                    at_ms: scheduler::now_ms(),
                })
                .await
            {
                Ok(c) if c.outcome == gpumesh_consensus::Outcome::Applied => {}
                Ok(c) => tracing::debug!(outcome = ?c.outcome, "heartbeat had no effect"),
                Err(e) => tracing::debug!(error = %e, "heartbeat not committed"),
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
