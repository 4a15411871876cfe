//! What the Raft log carries: commands (metadata only, never bulk data), the request
//! id that makes every proposal idempotent, and the outcome a proposer gets back.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use gpumesh_protocol::{
    ActorCall, BackendKind, BlobId, KernelNeeds, NodeCapability, StateBuffer, TaskSpec,
};
use serde::{Deserialize, Serialize};

/// The idempotency key of a proposal: a proposal retried with the same id is applied
/// at most once, and the retry learns the first application's outcome.
///
/// `client` names who chose the id (a raft id, or any number a client picks);
/// `seq` must not repeat for that client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId {
    pub client: u64,
    pub seq: u64,
}

impl RequestId {
    pub fn new(client: u64, seq: u64) -> Self {
        Self { client, seq }
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}-{:x}", self.client, self.seq)
    }
}

/// Reads what `Display` writes: `CLIENT-SEQ`, both in hex.
impl std::str::FromStr for RequestId {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a request id (CLIENT-SEQ, both in hex)");
        let (client, seq) = s.split_once('-').ok_or_else(bad)?;
        let hex = |part: &str| match part.bytes().all(|b| b.is_ascii_hexdigit()) {
            true => u64::from_str_radix(part, 16).map_err(|_| bad()),
            false => Err(bad()),
        };
        Ok(RequestId::new(hex(client)?, hex(seq)?))
    }
}

/// Hands out request ids that do not repeat across restarts of the same client: the
/// sequence starts at the wall-clock time in nanoseconds, so a restarted process
/// begins above anything it issued before (clocks would have to step back by more
/// than the ids used to break this, and that only costs a spurious dedup hit).
#[derive(Debug)]
pub struct RequestIds {
    client: u64,
    next: AtomicU64,
}

impl RequestIds {
    pub fn new(client: u64) -> Self {
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Self {
            client,
            next: AtomicU64::new(start),
        }
    }

    pub fn next_id(&self) -> RequestId {
        RequestId::new(self.client, self.next.fetch_add(1, Ordering::Relaxed))
    }
}

/// A task's id in the record: the log index of the `SubmitTask` entry that created it
/// (unique and the same on every replica).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaskId(pub u64);

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// A change to the replicated record. Values that vary per node (clock readings,
/// peer ids) are chosen by the proposer and carried here, so `apply` stays pure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// A new task. Acknowledged only once committed; retried submits with the same
    /// request id return the same task. `needs`: what its kernel asks of an adapter
    /// (the admitting node compiled it), so that its shards go only where they fit;
    /// `None` places it by its buffers alone.
    SubmitTask {
        spec: TaskSpec,
        submitter: String,
        needs: Option<KernelNeeds>,
    },
    /// A one-shard, one-replica task that node `node` already ran (it was submitted
    /// there, with `POST /v1/tasks/run`, and that node's GPU was free), recorded with
    /// what came of it in one entry: the task, its one attempt on `node`, and the
    /// result (or the failure). Nothing was acknowledged before this is committed; a
    /// retry with the same request id finds the task.
    TaskRan {
        spec: TaskSpec,
        submitter: String,
        node: u64,
        ran: Box<Ran>,
    },
    /// Gives shard `shard` of `task` to `node`, starting a new attempt (epoch + 1)
    /// beside any still in flight (a replica, or a speculative copy of a straggler).
    AssignShard { task: TaskId, shard: u32, node: u64 },
    /// Moves attempt `epoch` (its node is down or gone) to `node` under a new epoch:
    /// a late report from the old attempt is stale.
    ReassignShard {
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
        reason: String,
    },
    /// The assigned node began running the shard's current attempt.
    ShardStarted {
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
    },
    /// The shard's output is blob `blob` of `size` bytes, from a live attempt. With one
    /// replica the first such result wins; with more, results are kept until enough
    /// agree (compared bit for bit here, or by a [`Command::ShardVerdict`] under a
    /// float tolerance). Results from attempts no longer live are ignored.
    ///
    /// A small result (at most [`crate::MAX_CARRIED_RESULT`] bytes) rides in the entry
    /// itself (`inline`, whose hash must be `blob`): committed on a quorum, it needs no
    /// blob write or second copy first. The record keeps one of at most
    /// [`crate::MAX_INLINE_RESULT`] bytes; a larger one each replica stores as blob
    /// `blob` when it applies the entry ([`crate::CarriedStore`]).
    ShardResult {
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
        blob: BlobId,
        size: u64,
        #[serde(with = "gpumesh_protocol::mesh::opt_bytes")]
        inline: Option<Vec<u8>>,
    },
    /// A live attempt failed; the scheduler places the shard again.
    ShardFailed {
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
        reason: String,
    },
    /// The outputs reported for a shard were compared under its float tolerance:
    /// `agreeing` lists the epochs of the largest group of outputs that agree (fewer
    /// than two means a mismatch).
    ShardVerdict {
        task: TaskId,
        shard: u32,
        agreeing: Vec<u32>,
    },
    /// A live attempt hit something a retry cannot fix (a shader that runs past its
    /// deadline): the task fails with `reason`.
    TaskFailed {
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
        reason: String,
    },
    /// Stops a task; results that arrive later are ignored.
    TaskCancelled { task: TaskId, reason: String },
    /// Adds a Raft learner (a Raft membership change): `peer_id` is the node's libp2p
    /// peer id in its text form.
    NodeJoined {
        raft_id: u64,
        peer_id: String,
        capability: Option<NodeCapability>,
    },
    /// Promotes a learner to voter (refused when the voter cap is reached).
    NodePromoted { raft_id: u64 },
    /// Removes a member from the Raft group.
    NodeLeft { raft_id: u64 },
    /// A member's (re)measured adapter capability.
    NodeCapabilities {
        raft_id: u64,
        capability: NodeCapability,
    },
    /// The addresses a member listens on (multiaddrs in text form), published by
    /// the member itself when they differ from its record.
    NodeAddresses { raft_id: u64, addrs: Vec<String> },
    /// A liveness beacon; `at_ms` is the proposer's wall clock (ms since the epoch).
    Heartbeat { raft_id: u64, at_ms: u64 },
    /// The results of every shard of a task in `Merging` were merged (by the
    /// leader) into `outputs`, each stored on two nodes: the task is complete.
    TaskMerged {
        task: TaskId,
        outputs: Vec<MergedOutput>,
    },
    /// The results of a task's shards cannot be merged into the unsharded answer
    /// (two shards changed one word to different values): the task fails.
    MergeFailed { task: TaskId, reason: String },
    /// A new GPU actor `name` (unique mesh-wide) whose state buffers start as the
    /// blobs given (zeros where none), to be hosted on a node of `backend` if given.
    /// `creator` is the peer id of the node it was created through (it holds the
    /// starting blobs, as a submitter holds a task's inputs).
    CreateActor {
        name: String,
        state: Vec<ActorState>,
        backend: Option<BackendKind>,
        creator: String,
    },
    /// Hosts actor `name` on `node` under epoch `epoch` + 1: its first placement, or
    /// a move away from a host that is down or gone. A report of an older epoch is
    /// stale, and `epoch` must be the actor's current one.
    PlaceActor {
        name: String,
        epoch: u32,
        node: u64,
        reason: String,
    },
    /// A call to actor `name`: it takes the actor's next sequence number, and the host
    /// runs calls one at a time in that order. `caller` is the peer id of the node it
    /// came through (it holds the call's input blobs).
    CallActor {
        name: String,
        call: ActorCall,
        caller: String,
    },
    /// The host ran call `seq`: the state is now `state` (the next version), held by
    /// the host and by `backup` (which made it from the old state and what the call
    /// changed); `outputs` are the call's own.
    ActorCallDone {
        name: String,
        seq: u64,
        epoch: u32,
        node: u64,
        state: Vec<(u32, BlobId)>,
        backup: u64,
        outputs: Vec<MergedOutput>,
    },
    /// The host could not run call `seq` (a kernel that does not fit, a deadline):
    /// the state stays as it was.
    ActorCallFailed {
        name: String,
        seq: u64,
        epoch: u32,
        node: u64,
        reason: String,
    },
    /// Removes actor `name`; its calls not yet run fail.
    DeleteActor { name: String },
    /// The leader's judgement of which members are down (their silence outlasted
    /// `--down-after`, or their connections closed): new tasks are not placed there.
    MembersDown { down: Vec<u64> },
    /// The host ran calls `first`, `first + 1`, … of actor `name` back to back, one
    /// [`CallRan`] each, in order: all of them are recorded, or none. The state after
    /// the last is `state`, held by the host and by `backup`; the states between
    /// were never kept, and need not be (no call was acknowledged at them).
    ActorCallsDone {
        name: String,
        epoch: u32,
        node: u64,
        /// The version of the state they ran on: a batch run on a state the record
        /// has since moved past (a batch of sent calls recorded meanwhile) is stale.
        version: u64,
        first: u64,
        ran: Vec<CallRan>,
        state: Vec<(u32, BlobId)>,
        /// The state's bytes, buffer by buffer in the actor's order, when the whole
        /// state is at most [`INLINE_STATE_BYTES`]: the record then holds it (on a
        /// quorum, in this entry) and `backup` means nothing. Empty otherwise.
        #[serde(with = "gpumesh_protocol::mesh::bytes_list")]
        inline: Vec<Vec<u8>>,
        backup: u64,
    },
    /// Calls sent straight to actor `name`'s host (not queued in the record first),
    /// which ran them back to back on the state at `version`, recorded with their
    /// results in one entry: each takes the actor's next sequence number here, and
    /// its request id is remembered as if queued, so a retry through the record's
    /// queue finds it. Recorded only if the state is still at `version`, no queued
    /// call waits (those come first) and no request id is known already (that call
    /// went through the queue too; the batch would run it twice); else nothing
    /// changes and the host's callers go through the queue.
    ActorCallsRan {
        name: String,
        epoch: u32,
        node: u64,
        version: u64,
        calls: Vec<(RequestId, CallRan)>,
        state: Vec<(u32, BlobId)>,
        /// As in [`Command::ActorCallsDone`].
        #[serde(with = "gpumesh_protocol::mesh::bytes_list")]
        inline: Vec<Vec<u8>>,
        backup: u64,
    },
    /// Forget a finished task: it leaves the record, its results with it. `results`
    /// are the blobs it named as results where it was proposed, for every node's
    /// blob sweeper to let go at once (the record does not read them; a blob
    /// another task names stays). Refused for a task not finished.
    ForgetTask { task: TaskId, results: Vec<BlobId> },
}

/// The largest actor state (all buffers together) the record holds itself: calls to
/// such an actor are acknowledged once their batch's entry (the state inside) is
/// committed, with no blob written or copied.
pub const INLINE_STATE_BYTES: u64 = 16 << 10;

/// How one call of an [`Command::ActorCallsDone`] batch ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CallRan {
    /// It ran; these are its own outputs (each on two nodes).
    Done { outputs: Vec<MergedOutput> },
    /// It could not run (a kernel that does not fit, a deadline): it left the state
    /// as the call before it had.
    Failed { reason: String },
}

/// What came of a task run where it was submitted ([`Command::TaskRan`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Ran {
    /// Its one shard's result, as in [`Command::ShardResult`]: carried when small,
    /// else a blob already stored on `node` and one other node.
    Result {
        blob: BlobId,
        size: u64,
        #[serde(with = "gpumesh_protocol::mesh::opt_bytes")]
        inline: Option<Vec<u8>>,
    },
    /// It cannot succeed anywhere (a shader that runs past its deadline).
    Failed(String),
}

/// One state buffer of an actor and the blob it holds now (`None`: all zeros).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorState {
    pub buffer: StateBuffer,
    pub blob: Option<BlobId>,
}

/// One merged output of a task: the final bytes of a writable binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergedOutput {
    pub binding: u32,
    pub blob: BlobId,
    pub size: u64,
    /// The node that merged it (it holds a copy; so does one other node).
    pub node: u64,
}

impl Command {
    /// The existing task this command changes, if any.
    pub fn task(&self) -> Option<TaskId> {
        match self {
            Command::AssignShard { task, .. }
            | Command::ReassignShard { task, .. }
            | Command::ShardVerdict { task, .. }
            | Command::TaskFailed { task, .. }
            | Command::ShardStarted { task, .. }
            | Command::ShardResult { task, .. }
            | Command::ShardFailed { task, .. }
            | Command::TaskCancelled { task, .. }
            | Command::ForgetTask { task, .. }
            | Command::TaskMerged { task, .. }
            | Command::MergeFailed { task, .. } => Some(*task),
            _ => None,
        }
    }

    /// The actor this command is about, if any.
    pub fn actor(&self) -> Option<&str> {
        match self {
            Command::CreateActor { name, .. }
            | Command::PlaceActor { name, .. }
            | Command::CallActor { name, .. }
            | Command::ActorCallDone { name, .. }
            | Command::ActorCallFailed { name, .. }
            | Command::ActorCallsDone { name, .. }
            | Command::ActorCallsRan { name, .. }
            | Command::DeleteActor { name } => Some(name),
            _ => None,
        }
    }

    /// Whether, once committed, only the node that proposed this entry acts on it:
    /// the host that recorded a batch of calls sent to it answers their callers
    /// itself, and the other nodes only keep the record. A leader that proposed
    /// such an entry itself need not tell followers of its commit at once; they
    /// learn it with the next append or heartbeat.
    pub fn only_proposer_acts(&self) -> bool {
        matches!(self, Command::ActorCallsRan { .. })
    }

    /// A result this entry carries that the record does not keep (over
    /// [`crate::MAX_INLINE_RESULT`] bytes): its blob id and bytes, which each replica
    /// stores when applying the entry. Whether they hash to the id is not checked here.
    pub fn carried(&self) -> Option<(BlobId, &[u8])> {
        let (blob, inline) = match self {
            Command::ShardResult { blob, inline, .. } => (blob, inline),
            Command::TaskRan { ran, .. } => match &**ran {
                Ran::Result { blob, inline, .. } => (blob, inline),
                Ran::Failed(_) => return None,
            },
            _ => return None,
        };
        inline
            .as_deref()
            .filter(|b| b.len() > crate::MAX_INLINE_RESULT)
            .map(|b| (*blob, b))
    }

    /// Whether this command is a Raft membership change (proposed as a ConfChange).
    pub fn is_membership_change(&self) -> bool {
        matches!(
            self,
            Command::NodeJoined { .. } | Command::NodePromoted { .. } | Command::NodeLeft { .. }
        )
    }

    /// A short name for logs and events.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::SubmitTask { .. } => "submit-task",
            Command::TaskRan { .. } => "task-ran",
            Command::AssignShard { .. } => "assign-shard",
            Command::ReassignShard { .. } => "reassign-shard",
            Command::ShardVerdict { .. } => "shard-verdict",
            Command::TaskFailed { .. } => "task-failed",
            Command::ShardStarted { .. } => "shard-started",
            Command::ShardResult { .. } => "shard-result",
            Command::ShardFailed { .. } => "shard-failed",
            Command::TaskCancelled { .. } => "task-cancelled",
            Command::NodeJoined { .. } => "node-joined",
            Command::NodePromoted { .. } => "node-promoted",
            Command::NodeLeft { .. } => "node-left",
            Command::NodeCapabilities { .. } => "node-capabilities",
            Command::NodeAddresses { .. } => "node-addresses",
            Command::Heartbeat { .. } => "heartbeat",
            Command::TaskMerged { .. } => "task-merged",
            Command::MergeFailed { .. } => "merge-failed",
            Command::CreateActor { .. } => "create-actor",
            Command::PlaceActor { .. } => "place-actor",
            Command::CallActor { .. } => "call-actor",
            Command::ActorCallDone { .. } => "actor-call-done",
            Command::ActorCallFailed { .. } => "actor-call-failed",
            Command::DeleteActor { .. } => "delete-actor",
            Command::MembersDown { .. } => "members-down",
            Command::ActorCallsDone { .. } => "actor-calls-done",
            Command::ActorCallsRan { .. } => "actor-calls-ran",
            Command::ForgetTask { .. } => "forget-task",
        }
    }
}

/// One entry of the log as gpumesh writes it: who proposed it, its idempotency key,
/// and the command.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogEntry {
    /// Raft id of the node whose client is waiting for the outcome.
    pub origin: u64,
    pub request_id: RequestId,
    pub command: Command,
}

/// What applying a command did. Deterministic: every replica computes the same one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The command took effect.
    Applied,
    /// A task was created (or, for a retried submit, the one created first).
    TaskSubmitted { task: TaskId },
    /// The shard's new attempt is `epoch`.
    ShardAssigned {
        task: TaskId,
        shard: u32,
        epoch: u32,
    },
    /// Valid but without effect (stale epoch, a later result, a finished task...).
    Ignored(String),
    /// Refused (unknown task, invalid spec, voter cap reached...).
    Rejected(String),
    /// A call to an actor took sequence number `seq`; its result comes with
    /// [`Command::ActorCallDone`] or [`Command::ActorCallFailed`] for that number.
    CallQueued { seq: u64 },
}

/// A proposal's final answer: its outcome and where it sits in the log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    /// Log index of the entry whose application produced `outcome`.
    pub index: u64,
    pub outcome: Outcome,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_id_reads_back_what_it_writes_and_nothing_else() {
        for id in [
            RequestId::new(0, 0),
            RequestId::new(0x4d, 9),
            RequestId::new(u64::MAX, 0x1234_5678_9abc),
        ] {
            assert_eq!(id.to_string().parse::<RequestId>(), Ok(id));
        }
        for bad in [
            "",
            "4d",
            "4d-",
            "-9",
            "4d-9-1",
            "zz-1",
            "4d-+9",
            "10000000000000000-1",
        ] {
            let e = bad.parse::<RequestId>().unwrap_err();
            assert!(e.contains("not a request id"), "{bad}: {e}");
        }
    }
}
