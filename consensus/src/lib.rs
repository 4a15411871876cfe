//! gpumesh's replicated record: which nodes are in the mesh, which tasks exist,
//! who runs which shard, and which results won — agreed through Raft (raft-rs),
//! stored durably in redb.
//!
//! Modules:
//! - [`replica`]: the actor that drives raft-rs's `RawNode` ([`ConsensusHandle`] is
//!   its client): ticks, messages, proposals (forwarded to the leader from any
//!   member), linearizable and local reads, membership changes, snapshots.
//! - [`storage`]: [`RedbStorage`], raft-rs's `Storage` on redb, fsync'd per Ready,
//!   with log compaction and snapshots; refuses corrupt or foreign data.
//! - [`state`]: the deterministic [`StateMachine`] (members, tasks, shards, results,
//!   GPU actors).
//! - [`command`]: what the log carries ([`Command`], [`LogEntry`]), request ids for
//!   idempotency, and the [`Outcome`] a proposer gets.
//! - [`transport`]: the [`Transport`] trait the node crate implements over libp2p.
//! - `cluster`: [`ClusterId`], the name of one mesh.
//! - [`wire`]: the frames replicas exchange ([`Frame`]).
//! - [`sim`]: an in-process network with faults, for tests and the benchmark.
//! - [`mod@bench`]: the `gpumesh bench consensus` measurement.
//! - `tracing_drain`: raft-rs's slog output forwarded into `tracing`.
//!
//! # Public API (for the node crate)
//!
//! - [`RedbStorage::open`]`(path, ClusterId)`: opens or creates the durable store;
//!   refuses corrupt files, foreign redb files and other clusters' stores.
//!   [`RedbStorage::initialize`]`(&[(raft_id, peer_id)], ClusterSettings)` founds a
//!   mesh (one node, or all N founders with the same list); a joining node starts
//!   with empty storage and is added by a member with [`ConsensusHandle::add_learner`].
//! - [`ConsensusHandle::start`]`(ReplicaConfig, RedbStorage, Arc<dyn Transport>)`
//!   spawns the actor. The handle is `Clone`:
//!   - `propose(Command) -> Result<Committed>` / `propose_with_id(RequestId, Command)`:
//!     from any member (forwarded to the leader); answered once applied here.
//!     Errors say whether it certainly did not commit (`NoLeader`,
//!     `ProposalDropped`) or may have (`OutcomeUnknown`: retry with the same id).
//!   - `add_learner`, `promote`, `remove`: membership (voters capped by
//!     `ClusterSettings::max_voters`; the leader auto-promotes caught-up learners).
//!   - `read_linearizable(|&StateMachine| ..)` (ReadIndex, through the actor) and
//!     `read_local(|&StateMachine| ..)` (synchronous: the applied state the replica
//!     publishes after each apply, may be stale), `watch_state()` to wake on changes.
//!   - `status() -> Status` (role, leader, term, commit/applied, voters/learners,
//!     leader changes seen), `watch_status()`,
//!     `subscribe() -> broadcast::Receiver<AppliedEvent>`.
//!   - `proposal_counts() -> ProposalCounts`: how this replica's proposals ended
//!     (applied, ignored, rejected, dropped, unknown), for metrics.
//!   - `receive(from_raft_id, bytes)` / `try_receive`: frames from the transport.
//!   - `shutdown()`, `kill()` (crash simulation), `campaign()`, `transfer_leader()`.
//! - [`Transport`]: `send(to_raft_id, bytes) -> Result<(), Unreachable>`, non-blocking,
//!   best effort. Frames are `gpumesh_protocol` envelopes around [`Frame`].
//! - [`bench::run`]`(BenchConfig) -> BenchReport` (`Display`: a plain-text table).
//!
//! # Using it from a node
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use gpumesh_consensus::*;
//! # async fn demo(transport: Arc<dyn Transport>) -> Result<()> {
//! let cluster = ClusterId::derive(b"cluster key bytes");
//! let mut storage = RedbStorage::open("data/raft.redb", cluster)?;
//! if !storage.is_initialized() {
//!     // --init: a one-node mesh (or all N founders with the same list).
//!     storage.initialize(&[(1, "12D3KooW...".into())], ClusterSettings { max_voters: 5 })?;
//! }
//! let raft = ConsensusHandle::start(ReplicaConfig::new(1), storage, transport)?;
//! // Frames from peers: raft.receive(from_raft_id, bytes).await
//! let done = raft.propose(Command::Heartbeat { raft_id: 1, at_ms: 0 }).await?;
//! let tasks = raft.read_linearizable(|s| s.tasks().len()).await?;
//! # let _ = (done, tasks); Ok(()) }
//! ```

pub mod bench;
mod carried;
mod cluster;
pub mod command;
mod error;
pub mod replica;
pub mod sim;
pub mod snapfile;
pub mod state;
pub mod storage;
mod tracing_drain;
pub mod transport;
pub mod wal;
pub mod wire;
pub mod zeros;

pub use carried::CarriedStore;
pub use cluster::ClusterId;
pub use command::{
    ActorState, CallRan, Command, Committed, LogEntry, MergedOutput, Outcome, Ran, RequestId,
    RequestIds, TaskId, INLINE_STATE_BYTES,
};
pub use error::{ConsensusError, Result};
pub use replica::{
    with_waiting, AppliedEvent, ConsensusHandle, ProposalCounts, RaftRole, Received, ReplicaConfig,
    Status,
};
pub use state::{
    candidates, largest_binding, pick, Actor, CallResult, Candidate, ClusterSettings, Liveness,
    Member, Need, PendingCall, Role, Shard, ShardOutput, ShardState, StateMachine, Task,
    TaskStatus, KEPT_FINISHED_TASKS, MAX_CARRIED_RESULT, MAX_HISTORY, MAX_INLINE_RESULT,
    MAX_WAITING_CALLS, REMEMBERED_CALLS,
};
pub use storage::{Compaction, RedbStorage};
pub use tracing_drain::{raft_logger, TracingDrain};
pub use transport::{Transport, Unreachable};
pub use wire::{Frame, FrameBody};
pub use zeros::{write_paced, ZerosAhead};
