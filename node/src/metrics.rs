//! The node's Prometheus metrics, served by the API at `GET /metrics` in the
//! OpenMetrics text format ([`CONTENT_TYPE`]).
//!
//! Each node owns one [`Metrics`] with its own [`Registry`], kept in the node's
//! shared state: nothing is global, so several nodes in one process (tests,
//! examples) never mix their figures. Events are counted where they happen: the API
//! counts submits, the worker counts shards, the GPU thread its busy time, dispatches
//! and bytes, the network actor its bytes and peers. Values that already live
//! elsewhere are read when the endpoint is scraped: the Raft replica's status and
//! proposal counts, the tasks in this node's copy of the replicated record, and the
//! blob store on disk.
//!
//! | metric | type | what |
//! |---|---|---|
//! | `gpumesh_node_info{peer_id, raft_id}` | info | which node answers |
//! | `gpumesh_raft_term` | gauge | the replica's current Raft term |
//! | `gpumesh_raft_commit_index` | gauge | highest log index known committed |
//! | `gpumesh_raft_applied_index` | gauge | highest log index applied to the state machine |
//! | `gpumesh_raft_is_leader` | gauge | 1 while this replica leads, else 0 |
//! | `gpumesh_raft_leader_changes_total` | counter | times the known leader became another node (the first one counts) |
//! | `gpumesh_raft_snapshot_write_failures_total` | counter | snapshots of this replica's whose files could not be written (a full disk); each left the log whole until a later one |
//! | `gpumesh_raft_proposals_total{outcome}` | counter | proposals made through this node, by how they ended: `applied`, `ignored`, `rejected` (committed), `dropped` (certainly not committed), `unknown` |
//! | `gpumesh_tasks_submitted_total` | counter | tasks submitted through this node's API and committed |
//! | `gpumesh_tasks{status}` | gauge | tasks in this node's copy of the record: `pending`, `running`, `merging`, `completed`, `failed`, `cancelled` |
//! | `gpumesh_shards_done_total` | counter | shards run here whose result the record accepted |
//! | `gpumesh_shards_failed_total` | counter | shard attempts that failed here (GPU error, input not fetched, output not kept) |
//! | `gpumesh_shards_retried_total` | counter | shard attempts started here for a shard that had failed before |
//! | `gpumesh_shard_run_seconds` | histogram | wall time of a shard that produced outputs here: inputs fetched and read from the store, GPU run, readback |
//! | `gpumesh_gpu_busy_seconds_total` | counter | time the GPU thread spent running shards (upload, dispatch, wait, readback) |
//! | `gpumesh_gpu_dispatches_total` | counter | compute dispatches submitted (one per tile of a shard) |
//! | `gpumesh_gpu_batched_runs_total` | counter | one-shard runs that shared a submission with other runs waiting for the GPU |
//! | `gpumesh_gpu_bytes_total{direction}` | counter | bytes written to the device (`to_gpu`: inputs not already resident, output fill, shard info) and read back (`from_gpu`) |
//! | `gpumesh_gpu_resident_bytes` | gauge | bytes of GPU buffers kept on the device between runs: actors' state, inputs reused by later tasks |
//! | `gpumesh_gpu_device_rebuilds_total` | counter | times the GPU device was replaced: lost, or left to a dispatch past its deadline |
//! | `gpumesh_gpu_devices_abandoned` | gauge | replaced devices not yet dropped, each waiting for its work to end; one that stays is a dispatch the driver could not stop |
//! | `gpumesh_net_sent_bytes_total{lane}` | counter | bytes of gpumesh frames written to libp2p streams (and sealed records on direct connections: blobs in the `blob` lane, Raft frames in the `raft` lane) |
//! | `gpumesh_net_received_bytes_total{lane}` | counter | bytes of gpumesh frames read from libp2p streams (and direct blob and Raft connections) |
//! | `gpumesh_net_connected_peers` | gauge | peers with at least one open connection |
//! | `gpumesh_kernels_compiled` | gauge | kernels compiled on this node since it started (each source once while it stays cached) |
//! | `gpumesh_actors` | gauge | GPU actors in this node's copy of the record |
//! | `gpumesh_actors_hosted` | gauge | GPU actors this node hosts |
//! | `gpumesh_actor_moves` | gauge | moves of actors off a host that was down or gone, over the record's actors |
//! | `gpumesh_actor_calls_total` | counter | actor calls run on this node whose result was recorded |
//! | `gpumesh_blob_store_blobs` | gauge | blobs in this node's store |
//! | `gpumesh_blob_store_bytes` | gauge | bytes of those blobs |
//! | `gpumesh_blobs_removed_total{sweep}`, `gpumesh_blobs_removed_bytes_total{sweep}` | counter | blobs (and their bytes) the sweeper removed: `let_go` (an actor's replaced state, a forgotten task's results), `unused` |
//! | `gpumesh_blob_pack_compactions_total`, `gpumesh_blob_pack_freed_bytes_total` | counter | compactions of the pack of small blobs, and the bytes they gave back |
//!
//! The network lanes: `raft` is the Raft lane (the frames with their length
//! prefixes), `blob` the blob chunk requests and answers, `call` every other
//! request-response message between nodes (hello, join, replicate, peers, leave);
//! a request-response message counts its envelope, its bulk bytes and both length
//! prefixes. What is not counted: identify, mDNS, protocol negotiation, Yamux
//! framing, Noise's encryption overhead, TCP/IP headers, and frames that could not
//! be written or decoded. So these are the bytes gpumesh itself moved, a little
//! below what the wire carried.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use gpumesh_consensus::{ConsensusHandle, RaftRole};
use gpumesh_protocol::TaskState;
use gpumesh_shaders::{DeviceCounts, ExecutorCounters, KernelCache};
use libp2p::PeerId;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::{Registry, Unit};

use crate::blobs::store::BlobStore;

/// The content type of the text [`Metrics::encode`] writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One label, as `[(name, value)]`: every labelled metric here has exactly one.
type Label = [(&'static str, &'static str); 1];

/// Every metric of one node, registered in the node's own registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Tasks submitted through this node's API and committed; a retried submit of a
    /// task already created does not count again.
    pub(crate) tasks_submitted: Counter,
    /// Tasks by status in this node's copy of the record, refreshed on scrape.
    tasks: Family<Label, Gauge>,
    pub(crate) shards: ShardMetrics,
    /// Blobs in the store and their bytes, refreshed on scrape.
    blobs: Gauge,
    blob_bytes: Gauge,
    /// Compiles done by the node's kernel cache, refreshed on scrape.
    kernels_compiled: Gauge,
    /// Actors in the record, hosted here, and their moves, refreshed on scrape.
    actors: Gauge,
    actors_hosted: Gauge,
    actor_moves: Gauge,
    /// Actor calls run here and recorded, counted by the actor host.
    pub(crate) actor_calls: Counter,
}

impl Metrics {
    /// A fresh registry for the node `peer_id` / `raft_id`, every metric at zero but
    /// those the GPU thread and the net actor count from their start.
    pub fn new(peer_id: PeerId, raft_id: u64, gpu: GpuMetrics, net: NetMetrics) -> Metrics {
        let mut registry = Registry::with_prefix("gpumesh");
        registry.register(
            "node",
            "Which node this is",
            Info::new(vec![
                ("peer_id".to_string(), peer_id.to_string()),
                ("raft_id".to_string(), raft_id.to_string()),
            ]),
        );

        let tasks_submitted = Counter::default();
        registry.register(
            "tasks_submitted",
            "Tasks submitted through this node's API and committed",
            tasks_submitted.clone(),
        );
        let tasks = Family::<Label, Gauge>::default();
        registry.register(
            "tasks",
            "Tasks in this node's copy of the replicated record, by status",
            tasks.clone(),
        );

        let shards = ShardMetrics::default();
        registry.register(
            "shards_done",
            "Shards run on this node whose result the record accepted",
            shards.done.clone(),
        );
        registry.register(
            "shards_failed",
            "Shard attempts that failed on this node (GPU error, input not fetched, output \
             not kept)",
            shards.failed.clone(),
        );
        registry.register(
            "shards_retried",
            "Shard attempts started on this node for a shard that had failed before",
            shards.retried.clone(),
        );
        registry.register_with_unit(
            "shard_run",
            "Wall time of a shard that produced outputs on this node: inputs fetched and read \
             from the store, GPU run, readback",
            Unit::Seconds,
            shards.run_seconds.clone(),
        );

        registry.register_with_unit(
            "gpu_busy",
            "Time the GPU thread spent running shards (upload, dispatch, wait, readback)",
            Unit::Seconds,
            gpu.busy_seconds.clone(),
        );
        registry.register(
            "gpu_dispatches",
            "Compute dispatches submitted to the GPU, one per tile of a shard",
            gpu.dispatches.clone(),
        );
        registry.register(
            "gpu_batched_runs",
            "One-shard runs that shared a GPU submission with other runs waiting",
            gpu.batched_runs.clone(),
        );
        registry.register_with_unit(
            "gpu",
            "Bytes written to GPU buffers (to_gpu: inputs not already resident, output fill, \
             shard info) and read back from them (from_gpu)",
            Unit::Bytes,
            gpu.bytes.clone(),
        );
        registry.register_with_unit(
            "gpu_resident",
            "Bytes of GPU buffers kept on the device between runs (actor state, reused inputs)",
            Unit::Bytes,
            gpu.resident.clone(),
        );
        registry.register_collector(Box::new(DeviceCollector(gpu.devices.clone())));

        // Every label value from the start, so a rate over a lane that has been quiet
        // so far starts at zero instead of at nothing.
        for lane in [Lane::Raft, Lane::Blob, Lane::Call] {
            net.sent(lane, 0);
            net.received(lane, 0);
        }
        gpu.record(Duration::ZERO, ExecutorCounters::default());
        registry.register_with_unit(
            "net_sent",
            "Bytes of gpumesh frames written to libp2p streams, by lane (raft, blob, call), and \
             of sealed records on direct blob connections (blob); transport overhead not included",
            Unit::Bytes,
            net.sent.clone(),
        );
        registry.register_with_unit(
            "net_received",
            "Bytes of gpumesh frames read from libp2p streams, by lane (raft, blob, call), and \
             of sealed records on direct blob connections (blob); transport overhead not included",
            Unit::Bytes,
            net.received.clone(),
        );
        registry.register(
            "net_connected_peers",
            "Peers with at least one open connection to this node",
            net.connected_peers.clone(),
        );

        let blobs = Gauge::default();
        registry.register(
            "blob_store_blobs",
            "Blobs in this node's store",
            blobs.clone(),
        );
        let blob_bytes = Gauge::default();
        registry.register_with_unit(
            "blob_store",
            "Bytes of the blobs in this node's store",
            Unit::Bytes,
            blob_bytes.clone(),
        );

        let kernels_compiled = Gauge::default();
        registry.register(
            "kernels_compiled",
            "Kernels compiled on this node since it started",
            kernels_compiled.clone(),
        );

        let actors = Gauge::default();
        registry.register(
            "actors",
            "GPU actors in this node's copy of the record",
            actors.clone(),
        );
        let actors_hosted = Gauge::default();
        registry.register(
            "actors_hosted",
            "GPU actors this node hosts",
            actors_hosted.clone(),
        );
        let actor_moves = Gauge::default();
        registry.register(
            "actor_moves",
            "Moves of actors off a host that was down or gone, over the record's actors",
            actor_moves.clone(),
        );
        let actor_calls = Counter::default();
        registry.register(
            "actor_calls",
            "Actor calls run on this node whose result was recorded",
            actor_calls.clone(),
        );

        Metrics {
            registry,
            actors,
            actors_hosted,
            actor_moves,
            actor_calls,
            tasks_submitted,
            tasks,
            shards,
            blobs,
            blob_bytes,
            kernels_compiled,
        }
    }

    /// Adds the Raft metrics, read from `consensus` on every scrape.
    /// Registers what the blob sweeper counts.
    pub(crate) fn with_sweep(mut self, sweep: &SweepMetrics) -> Metrics {
        self.registry.register(
            "blobs_removed",
            "Blobs this node's sweeper removed, by sweep (let_go: an actor's replaced \
             state, a forgotten task's results; unused: named by nothing and \
             unused for --keep-unused-blobs)",
            sweep.blobs.clone(),
        );
        self.registry.register_with_unit(
            "blobs_removed",
            "Bytes of the blobs this node's sweeper removed, by sweep",
            Unit::Bytes,
            sweep.bytes.clone(),
        );
        self.registry.register(
            "blob_pack_compactions",
            "Times this node's pack of small blobs was compacted (the records of removed \
             blobs left out of a new file)",
            sweep.compactions.clone(),
        );
        self.registry.register_with_unit(
            "blob_pack_freed",
            "Bytes the pack's compactions gave back to the disk",
            Unit::Bytes,
            sweep.compacted_bytes.clone(),
        );
        self
    }

    pub(crate) fn with_raft(mut self, consensus: ConsensusHandle) -> Metrics {
        self.registry
            .register_collector(Box::new(RaftCollector(consensus)));
        self
    }

    /// Refreshes what is read rather than counted: the tasks in `consensus`'s record
    /// (one walk of this replica's tasks) and the blob store (one directory listing).
    pub(crate) async fn refresh(
        &self,
        consensus: &ConsensusHandle,
        blobs: &BlobStore,
        kernels: &KernelCache,
    ) {
        self.kernels_compiled
            .set(saturating_i64(kernels.compiled()));
        let store = blobs.clone();
        if let Ok((count, bytes)) = tokio::task::spawn_blocking(move || store.stats()).await {
            self.blobs.set(saturating_i64(count));
            self.blob_bytes.set(saturating_i64(bytes));
        }
        let by_status = consensus.read_local(|s| {
            let mut by_status = [0u64; TaskState::ALL.len()];
            for task in s.tasks() {
                let state = task.status.state();
                if let Some(i) = TaskState::ALL.iter().position(|s| *s == state) {
                    by_status[i] += 1;
                }
            }
            by_status
        });
        let me = consensus.id();
        let (actors, hosted, moves) = consensus.read_local(|s| {
            (
                s.actors().len() as u64,
                s.actors().filter(|a| a.host == Some(me)).count() as u64,
                s.actors().map(|a| u64::from(a.moves)).sum::<u64>(),
            )
        });
        self.actors.set(saturating_i64(actors));
        self.actors_hosted.set(saturating_i64(hosted));
        self.actor_moves.set(saturating_i64(moves));
        for (state, n) in TaskState::ALL.iter().zip(by_status) {
            self.tasks
                .get_or_create(&[("status", state.name())])
                .set(saturating_i64(n));
        }
    }

    /// Everything in the registry, in the OpenMetrics text format.
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// What the worker counts about the shards it runs.
#[derive(Clone, Debug)]
pub(crate) struct ShardMetrics {
    /// Shards run here whose `ShardResult` was committed and applied with effect (a
    /// result that arrived after another attempt won is not done). With
    /// `--replicas N`, each replica's recorded result counts on its own node.
    pub(crate) done: Counter,
    /// Attempts that failed here, whatever the reason, whether or not the failure
    /// could be reported.
    pub(crate) failed: Counter,
    /// Attempts started here for a shard whose earlier attempts had failed (on any
    /// node): the retries that ran on this node.
    pub(crate) retried: Counter,
    /// Seconds from starting a shard to holding its outputs: fetching missing inputs,
    /// reading them from the store, the GPU run, readback. Failed attempts are not
    /// observed.
    pub(crate) run_seconds: Histogram,
}

impl Default for ShardMetrics {
    fn default() -> Self {
        ShardMetrics {
            done: Counter::default(),
            failed: Counter::default(),
            retried: Counter::default(),
            // 1 ms to about 4.4 minutes, ×4 per bucket.
            run_seconds: Histogram::new(exponential_buckets(0.001, 4.0, 10)),
        }
    }
}

/// What the GPU thread counts. Cheap to clone; clones count together.
#[derive(Clone, Debug, Default)]
pub struct GpuMetrics {
    /// Seconds the GPU thread spent in the executor for shards, failed ones included.
    busy_seconds: Counter<f64, AtomicU64>,
    /// Compute dispatches submitted.
    dispatches: Counter,
    /// One-shard runs that shared a submission with others.
    batched_runs: Counter,
    /// Bytes by direction: `to_gpu`, `from_gpu`.
    bytes: Family<Label, Counter>,
    /// Bytes of buffers kept on the device between runs (actor state, reused inputs).
    resident: Gauge,
    /// The executor's device counts, once it has opened (read on every scrape).
    devices: Arc<OnceLock<Arc<DeviceCounts>>>,
}

impl GpuMetrics {
    /// Counts one run of the executor: how long it took and what it moved.
    pub fn record(&self, busy: Duration, work: ExecutorCounters) {
        self.busy_seconds.inc_by(busy.as_secs_f64());
        self.dispatches.inc_by(work.dispatches);
        self.bytes
            .get_or_create(&[("direction", "to_gpu")])
            .inc_by(work.bytes_to_device);
        self.bytes
            .get_or_create(&[("direction", "from_gpu")])
            .inc_by(work.bytes_from_device);
    }

    /// Counts `runs` that shared one submission.
    pub fn batched(&self, runs: usize) {
        self.batched_runs.inc_by(runs as u64);
    }

    pub fn set_resident(&self, bytes: u64) {
        self.resident.set(saturating_i64(bytes));
    }

    /// Reads the executor's device counts on every scrape from now on.
    pub fn watch_devices(&self, devices: Arc<DeviceCounts>) {
        let _ = self.devices.set(devices);
    }
}

/// Which traffic a network byte belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Raft frames on the Raft lane's streams and direct connections.
    Raft,
    /// Blob chunk requests and their answers.
    Blob,
    /// Every other request-response message between nodes.
    Call,
}

impl Lane {
    fn label(self) -> Label {
        [(
            "lane",
            match self {
                Lane::Raft => "raft",
                Lane::Blob => "blob",
                Lane::Call => "call",
            },
        )]
    }
}

/// What the network counts. Cheap to clone; clones count together. A default one
/// counts into no registry (for a [`crate::net::NetConfig`] outside a node).
#[derive(Clone, Debug, Default)]
pub struct NetMetrics {
    sent: Family<Label, Counter>,
    received: Family<Label, Counter>,
    connected_peers: Gauge,
}

impl NetMetrics {
    pub(crate) fn sent(&self, lane: Lane, bytes: usize) {
        self.sent.get_or_create(&lane.label()).inc_by(bytes as u64);
    }

    pub(crate) fn received(&self, lane: Lane, bytes: usize) {
        self.received
            .get_or_create(&lane.label())
            .inc_by(bytes as u64);
    }

    pub(crate) fn set_connected_peers(&self, peers: usize) {
        self.connected_peers.set(saturating_i64(peers as u64));
    }

    /// Bytes counted in `lane` so far, (sent, received).
    #[cfg(test)]
    pub(crate) fn totals(&self, lane: Lane) -> (u64, u64) {
        (
            self.sent.get_or_create(&lane.label()).get(),
            self.received.get_or_create(&lane.label()).get(),
        )
    }
}

/// What the blob sweeper removed (see [`crate::blobs::sweep`]); counts into no
/// registry until [`Metrics::with_sweep`].
#[derive(Clone, Debug, Default)]
pub struct SweepMetrics {
    blobs: Family<Label, Counter>,
    bytes: Family<Label, Counter>,
    compactions: Counter,
    compacted_bytes: Counter,
}

impl SweepMetrics {
    pub(crate) fn removed(&self, sweep: &'static str, blobs: u64, bytes: u64) {
        let label = [("sweep", sweep)];
        self.blobs.get_or_create(&label).inc_by(blobs);
        self.bytes.get_or_create(&label).inc_by(bytes);
    }

    /// The pack was compacted; its file is `freed` bytes shorter.
    pub(crate) fn compacted(&self, freed: u64) {
        self.compactions.inc();
        self.compacted_bytes.inc_by(freed);
    }
}

/// Reads the GPU device counts from the executor on every scrape (zeros before it
/// opens, and on a node without one).
#[derive(Debug)]
struct DeviceCollector(Arc<OnceLock<Arc<DeviceCounts>>>);

impl Collector for DeviceCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let (rebuilt, abandoned) = self
            .0
            .get()
            .map_or((0, 0), |d| (d.rebuilt(), d.abandoned()));
        let rebuilds = ConstCounter::new(rebuilt);
        rebuilds.encode(encoder.encode_descriptor(
            "gpu_device_rebuilds",
            "Times the GPU device was replaced: lost, or left to a dispatch past its deadline.",
            None,
            rebuilds.metric_type(),
        )?)?;
        let left = ConstGauge::new(saturating_i64(abandoned));
        left.encode(encoder.encode_descriptor(
            "gpu_devices_abandoned",
            "Replaced GPU devices not yet dropped, each waiting for its work to end: one that \
             stays is a dispatch the driver could not stop, still holding the GPU.",
            None,
            left.metric_type(),
        )?)?;
        Ok(())
    }
}

/// Reads the Raft metrics from the replica on every scrape: its published status
/// (term, indexes, role, leader changes) and its proposal counts.
#[derive(Debug)]
struct RaftCollector(ConsensusHandle);

impl Collector for RaftCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let consensus = &self.0;
        let status = consensus.watch_status().borrow().clone();
        let gauges = [
            ("raft_term", "The replica's current Raft term.", status.term),
            (
                "raft_commit_index",
                "The highest log index this replica knows is committed.",
                status.commit_index,
            ),
            (
                "raft_applied_index",
                "The highest log index applied to this replica's state machine.",
                status.applied_index,
            ),
            (
                "raft_is_leader",
                "1 while this replica is the Raft leader, else 0.",
                u64::from(status.role == RaftRole::Leader),
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(saturating_i64(value));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let changes = ConstCounter::new(status.leader_changes);
        changes.encode(encoder.encode_descriptor(
            "raft_leader_changes",
            "Times the leader this replica knows became another node since it started (the \
             first leader it learns of counts).",
            None,
            changes.metric_type(),
        )?)?;
        let failures = ConstCounter::new(status.snapshot_write_failures);
        failures.encode(encoder.encode_descriptor(
            "raft_snapshot_write_failures",
            "Snapshots of this replica's own whose files could not be written (a full disk) \
             since it started; each left the log whole until a later one.",
            None,
            failures.metric_type(),
        )?)?;
        let p = consensus.proposal_counts();
        let mut family = encoder.encode_descriptor(
            "raft_proposals",
            "Proposals made through this node, by how they ended: applied, ignored, rejected \
             (committed); dropped (certainly not committed); unknown.",
            None,
            ConstCounter::<u64>::TYPE,
        )?;
        for (outcome, n) in [
            ("applied", p.applied),
            ("ignored", p.ignored),
            ("rejected", p.rejected),
            ("dropped", p.dropped),
            ("unknown", p.unknown),
        ] {
            ConstCounter::new(n).encode(family.encode_family(&[("outcome", outcome)])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_named_with_the_prefix_and_encoded_as_openmetrics() {
        let (gpu, net) = (GpuMetrics::default(), NetMetrics::default());
        let metrics = Metrics::new(PeerId::random(), 7, gpu.clone(), net.clone());
        metrics.tasks_submitted.inc();
        metrics.shards.run_seconds.observe(0.5);
        gpu.record(
            Duration::from_millis(250),
            ExecutorCounters {
                dispatches: 2,
                bytes_to_device: 100,
                bytes_from_device: 40,
                readback_buffers_made: 1,
            },
        );
        net.sent(Lane::Blob, 1000);
        net.received(Lane::Raft, 12);
        net.set_connected_peers(2);
        let text = metrics.encode().expect("encodes");
        for line in [
            "gpumesh_node_info{peer_id=",
            "gpumesh_tasks_submitted_total 1",
            "gpumesh_shard_run_seconds_count 1",
            "gpumesh_gpu_busy_seconds_total 0.25",
            "gpumesh_gpu_dispatches_total 2",
            "gpumesh_gpu_bytes_total{direction=\"to_gpu\"} 100",
            "gpumesh_gpu_bytes_total{direction=\"from_gpu\"} 40",
            "gpumesh_net_sent_bytes_total{lane=\"blob\"} 1000",
            "gpumesh_net_received_bytes_total{lane=\"raft\"} 12",
            "gpumesh_net_connected_peers 2",
            "gpumesh_blob_store_blobs 0",
            "gpumesh_blob_store_bytes 0",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
        for sample in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(sample.starts_with("gpumesh_"), "{sample}");
        }
        // No replica given: no Raft metrics rather than made-up zeros.
        assert!(!text.contains("gpumesh_raft_"), "{text}");
    }
}
