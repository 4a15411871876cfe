//! What a node needs to start ([`NodeConfig`]).

use super::*;

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
    /// `POST /v1/tasks/run` calls of one shard and one replica run on this node's
    /// GPU at once, without a placement round, while fewer than this many are under
    /// way here (0: every task is placed by the mesh).
    pub run_here_slots: usize,
    /// How long a member may be down before the others make the copies it held
    /// again on running members ([`crate::blobs::repair`]).
    pub repair_after: Duration,
    /// When this node removes the blobs nothing needs any more.
    pub blob_sweep: crate::blobs::sweep::SweepConfig,
    /// Faults to inject, for tests and `gpumesh bench faults`; none by default.
    pub faults: Faults,
    /// Where this node marks the stages of each task it touches (benchmarks).
    pub timeline: crate::timeline::Timeline,
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
            run_here_slots: crate::run_here::DEFAULT_SLOTS,
            repair_after: crate::blobs::repair::DEFAULT_REPAIR_AFTER,
            blob_sweep: Default::default(),
            faults: Faults::default(),
            timeline: Default::default(),
            limits: Limits::default(),
            cluster_key: None,
            open: false,
            allow_peers: Vec::new(),
            connections: ConnectionCaps::default(),
        }
    }
}
