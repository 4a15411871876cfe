//! What the API's handlers share: handles of the node's actors, and what the API
//! owns itself (the results cache, the submits under way, the dashboard's
//! throughput series).

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use gpumesh_consensus::ConsensusHandle;
use gpumesh_shaders::KernelCache;
use libp2p::PeerId;

use super::changes::Changes;
use super::throughput::Throughput;
use crate::blobs::BlobsHandle;
use crate::host::CallSender;
use crate::limits::Limits;
use crate::liveness::LivenessHandle;
use crate::metrics::Metrics;
use crate::outputs::ResultCache;
use crate::peers::PeersHandle;
use crate::run_here::RunHere;
use crate::timeline::Timeline;

pub(crate) struct ApiState {
    pub raft_id: u64,
    pub peer_id: PeerId,
    /// `peer_id` as text, made once: every submit and call names its submitter so,
    /// and base58 costs microseconds each time.
    pub peer_name: String,
    pub consensus: ConsensusHandle,
    pub liveness: LivenessHandle,
    pub peers: PeersHandle,
    pub blobs: BlobsHandle,
    /// Kernels compiled on this node, by source hash, shared with the worker.
    pub kernels: Arc<KernelCache>,
    pub limits: Limits,
    pub metrics: Metrics,
    /// Completed tasks' outputs made local here: a fetch after the first reads no
    /// record.
    pub results: Arc<ResultCache>,
    /// Submits through this node's API not yet applied here: counted with the
    /// replicated queue so that concurrent submits cannot pass the queue limit.
    pub submits_in_flight: AtomicUsize,
    /// Shard results per node per second, for the dashboard.
    pub throughput: Arc<Throughput>,
    pub timeline: Timeline,
    /// Runs a one-shard task here when this node's GPU has a free slot (none
    /// without a GPU).
    pub run_here: Option<RunHere>,
    /// Sends actor calls straight to their hosts.
    pub calls: Option<CallSender>,
    /// Wakes requests waiting on a task or an actor when an entry about it applies.
    pub changes: Arc<Changes>,
    /// Takes this node out of the mesh (`POST /v1/leave`).
    pub leaving: Option<crate::mesh::Leaving>,
}

impl ApiState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        consensus: ConsensusHandle,
        liveness: LivenessHandle,
        peers: PeersHandle,
        blobs: BlobsHandle,
        kernels: Arc<KernelCache>,
        limits: Limits,
        metrics: Metrics,
        timeline: Timeline,
    ) -> Self {
        ApiState {
            raft_id: consensus.id(),
            peer_id: peers.me(),
            peer_name: peers.me().to_string(),
            consensus,
            liveness,
            peers,
            blobs,
            kernels,
            limits,
            metrics,
            results: Arc::default(),
            submits_in_flight: AtomicUsize::new(0),
            throughput: Arc::default(),
            timeline,
            run_here: None,
            calls: None,
            changes: Arc::default(),
            leaving: None,
        }
    }
}
