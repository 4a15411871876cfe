//! What the record is made of: members, tasks, shards, their attempts and results,
//! and the limits that bound them.

use super::*;

/// How many outcomes of non-submit proposals are remembered for deduplication. A
/// retry arriving after this many later proposals is applied again; submits are
/// deduplicated for as long as their task exists.
pub const REMEMBERED_REQUESTS: usize = 100_000;
/// A task may be split into at most this many shards.
pub const MAX_SHARDS_PER_TASK: u32 = 65_536;

/// Bytes a shard result takes beyond its outputs', allowed on top of
/// [`MAX_CARRIED_RESULT`] so that outputs of a round size (16 KiB) are not just over
/// it: the encoding's magic, and for each buffer where its bytes go (16 bytes in
/// all for one buffer written whole).
pub const RESULT_HEAD: usize = 256;
/// Largest shard result the record itself keeps (it rides in its `ShardResult`
/// entry and stays in the record with its task). Not raised by [`RESULT_HEAD`]
/// with data format 7: replicas apply the entries of a log of format 6 with it, and
/// one that applied an entry before the upgrade must have kept what one applying
/// it after does (a 4 KiB result is carried, which costs the same here).
pub const MAX_INLINE_RESULT: usize = 4096;
/// Largest shard result carried in its `ShardResult` entry instead of a blob stored
/// and copied before it is reported. One over [`MAX_INLINE_RESULT`] is not kept in
/// the record: each replica stores it as a blob when applying the entry (see
/// [`crate::CarriedStore`]), and the log keeps it until then synced. Carried, a
/// result saves a round of fsyncs on two nodes before its commit, but is written
/// to three logs and three packs instead of two packs: past about this size that
/// costs more than it saves once many tasks are in flight (`gpumesh bench mesh
/// --result-kib`).
pub const MAX_CARRIED_RESULT: usize = (16 << 10) + RESULT_HEAD;

/// Finished tasks the record keeps (the newest by id), with their results and the
/// request ids that made them; older ones are forgotten.
pub const KEPT_FINISHED_TASKS: usize = 10_000;
/// After this many failed attempts of one shard, its task fails.
pub const MAX_SHARD_ATTEMPTS: u32 = 3;
/// Default cap on Raft voters; further members stay learners.
pub const DEFAULT_MAX_VOTERS: u32 = 5;

/// Settings fixed when the mesh is initialised and replicated with the state, so
/// every replica judges membership changes alike.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterSettings {
    pub max_voters: u32,
}

/// A member's role in the Raft group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Voter,
    Learner,
}

/// A liveness beacon as recorded: where in the log and what the sender's clock said.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Liveness {
    pub index: u64,
    pub at_ms: u64,
}

/// One node of the mesh.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub raft_id: u64,
    /// The libp2p peer id in text form (consensus does not depend on libp2p).
    pub peer_id: String,
    pub role: Role,
    pub capability: Option<NodeCapability>,
    pub last_heartbeat: Option<Liveness>,
    /// Log index at which the node joined (0 for founding members).
    pub joined_index: u64,
    /// Where the node listens (multiaddrs in text form, without `/p2p/`), as it
    /// last published them: every member dials every other member at these, so the
    /// mesh's connections do not depend on the node each one bootstrapped from.
    pub addrs: Vec<String>,
}

/// Where a task stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskStatus {
    /// No shard has been assigned yet.
    Pending,
    /// Some shard is assigned, running or done; not all are done.
    Running,
    /// Every shard has a result (or, with one shard, its result is the answer).
    Completed,
    Failed(String),
    Cancelled(String),
    /// Every one of its several shards has a result; the leader is merging them.
    Merging,
}

impl TaskStatus {
    /// The status as the API, the CLI and the dashboard name it.
    pub fn state(&self) -> gpumesh_protocol::TaskState {
        use gpumesh_protocol::TaskState;
        match self {
            TaskStatus::Pending => TaskState::Pending,
            TaskStatus::Running => TaskState::Running,
            TaskStatus::Merging => TaskState::Merging,
            TaskStatus::Completed => TaskState::Completed,
            TaskStatus::Failed(_) => TaskState::Failed,
            TaskStatus::Cancelled(_) => TaskState::Cancelled,
        }
    }

    pub fn name(&self) -> &'static str {
        self.state().name()
    }

    /// Why a task failed or was cancelled.
    pub fn reason(&self) -> Option<&str> {
        match self {
            TaskStatus::Failed(r) | TaskStatus::Cancelled(r) => Some(r),
            _ => None,
        }
    }

    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            TaskStatus::Completed | TaskStatus::Failed(_) | TaskStatus::Cancelled(_)
        )
    }
}

/// Where one shard stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShardState {
    /// Needs (another) attempt.
    #[default]
    Pending,
    /// Has attempts placed, none started yet.
    Assigned,
    /// Some attempt is running.
    Running,
    /// Enough results are in; their float comparison is awaited.
    Verifying,
    Done,
}

/// The accepted output of a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardOutput {
    /// blake3 of the output bytes: both its address and its checksum.
    pub blob: BlobId,
    pub size: u64,
    pub node: u64,
    pub epoch: u32,
    /// Log index of the accepted `ShardResult`.
    pub index: u64,
}

/// One node's try at a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    pub epoch: u32,
    pub node: u64,
    pub running: bool,
    /// Placed while another attempt for the same result was already in flight.
    pub speculative: bool,
}

/// A result reported by an attempt, kept until enough results agree.
pub type Report = ShardOutput;

/// One shard of a task.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// The latest attempt's epoch; every assignment takes the next one, so a report
    /// from an attempt that was replaced is recognisably stale.
    pub epoch: u32,
    /// Attempts in flight.
    pub attempts: Vec<Attempt>,
    /// Results reported and not yet accepted (only with replicas ≥ 2).
    pub reports: Vec<Report>,
    /// Agreeing results wanted before one is accepted: the task's replicas, one more
    /// after each mismatch (up to [`gpumesh_protocol::MAX_REPLICAS`]).
    pub needed: u32,
    pub state: ShardState,
    pub failures: u32,
    pub last_error: Option<String>,
    /// Nodes where an attempt failed: a retry goes to another node while there is
    /// one that can take it (the error may be that node's: its adapter's limits or
    /// loop cap, a lost device).
    pub failed_on: Vec<u64>,
    pub output: Option<ShardOutput>,
}

impl Shard {
    /// The node of the most recent attempt in flight, if any.
    pub fn assigned_to(&self) -> Option<u64> {
        self.attempts.last().map(|a| a.node)
    }

    /// The live attempt `epoch` by `node`, if there is one.
    pub fn attempt(&self, epoch: u32, node: u64) -> Option<&Attempt> {
        self.attempts
            .iter()
            .find(|a| a.epoch == epoch && a.node == node)
    }

    /// Results still missing: how many more attempts the shard wants in flight.
    pub fn wanted(&self) -> u32 {
        if self.state == ShardState::Done || self.state == ShardState::Verifying {
            return 0;
        }
        self.needed
            .saturating_sub(self.reports.len() as u32)
            .saturating_sub(self.attempts.len() as u32)
    }

    /// A new attempt on `node` under the next epoch; returns the epoch.
    pub(super) fn start_attempt(&mut self, node: u64, speculative: bool) -> u32 {
        self.epoch += 1;
        self.attempts.push(Attempt {
            epoch: self.epoch,
            node,
            running: false,
            speculative,
        });
        self.epoch
    }

    pub(super) fn settle(&mut self) {
        self.state = if self.output.is_some() {
            ShardState::Done
        } else if self.needed > 1 && self.reports.len() as u32 >= self.needed {
            ShardState::Verifying
        } else if self.attempts.iter().any(|a| a.running) {
            ShardState::Running
        } else if self.attempts.is_empty() {
            ShardState::Pending
        } else {
            ShardState::Assigned
        };
    }
}

/// Entries kept in a task's history; older ones are dropped first.
pub const MAX_HISTORY: usize = 64;

/// Something that happened to a task, for `gpumesh tasks` and the dashboard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskEvent {
    /// Log index of the entry that caused it.
    pub index: u64,
    pub shard: Option<u32>,
    pub what: String,
}

/// A submitted task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: TaskId,
    pub spec: TaskSpec,
    pub spec_hash: [u8; 32],
    pub submitter: String,
    /// The idempotency key it was submitted with.
    pub request_id: RequestId,
    pub status: TaskStatus,
    pub shards: Vec<Shard>,
    pub history: VecDeque<TaskEvent>,
    /// Replica outputs that disagreed, over the task's life.
    pub mismatches: u32,
    /// The merged outputs of a task of several shards, once merged. A task of one
    /// shard has none: its shard's result is its answer.
    pub outputs: Vec<MergedOutput>,
    /// Shard results carried in their log entries (small ones), by blob id: a
    /// result's bytes are here or in the blob store under the same id.
    #[serde(with = "gpumesh_protocol::mesh::bytes_values")]
    pub inline: BTreeMap<BlobId, Vec<u8>>,
    /// What its kernel asks of an adapter, where the submit said.
    pub needs: Option<KernelNeeds>,
}

impl Task {
    /// The blobs it names as results: its shards' accepted and reported outputs,
    /// its merged outputs, and the results carried in entries.
    pub fn result_blobs(&self) -> Vec<BlobId> {
        let mut out: Vec<BlobId> = Vec::new();
        for shard in &self.shards {
            out.extend(shard.output.iter().map(|o| o.blob));
            out.extend(shard.reports.iter().map(|r| r.blob));
        }
        out.extend(self.outputs.iter().map(|o| o.blob));
        out.extend(self.inline.keys().copied());
        out.sort();
        out.dedup();
        out
    }

    pub(super) fn record(&mut self, index: u64, shard: Option<u32>, what: String) {
        if self.history.len() >= MAX_HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(TaskEvent { index, shard, what });
    }
}

/// What one `apply` call produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    pub committed: Committed,
    /// True when the entry repeated an already applied request id: it had no effect
    /// and `committed` is the first application's outcome.
    pub duplicate: bool,
}
