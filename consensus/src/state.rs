//! The replicated state machine: members, tasks, shards and results.
//!
//! `apply` is a plain deterministic function of (state, index, entry): no clocks, no
//! randomness, no I/O, so every replica that applies the same log reaches the same
//! state, and a replica restored from a snapshot equals one that replayed the log.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use gpumesh_protocol::{codec, BlobId, NodeCapability, TaskSpec};
use serde::{Deserialize, Serialize};

use crate::command::{Command, Committed, LogEntry, MergedOutput, Outcome, RequestId, TaskId};
use crate::error::Result;

/// How many outcomes of non-submit proposals are remembered for deduplication. A
/// retry arriving after this many later proposals is applied again; submits are
/// deduplicated for as long as their task exists.
pub const REMEMBERED_REQUESTS: usize = 100_000;
/// A task may be split into at most this many shards.
pub const MAX_SHARDS_PER_TASK: u32 = 65_536;
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
    pub fn name(&self) -> &'static str {
        match self {
            TaskStatus::Pending => "pending",
            TaskStatus::Running => "running",
            TaskStatus::Merging => "merging",
            TaskStatus::Completed => "completed",
            TaskStatus::Failed(_) => "failed",
            TaskStatus::Cancelled(_) => "cancelled",
        }
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

    fn settle(&mut self) {
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
}

impl Task {
    fn record(&mut self, index: u64, shard: Option<u32>, what: String) {
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

/// The replicated record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateMachine {
    applied_index: u64,
    applied_term: u64,
    settings: ClusterSettings,
    members: BTreeMap<u64, Member>,
    tasks: BTreeMap<TaskId, Task>,
    task_by_request: BTreeMap<RequestId, TaskId>,
    requests: BTreeMap<RequestId, Committed>,
    /// Insertion order of `requests`, oldest first, to forget deterministically.
    request_order: VecDeque<RequestId>,
    /// Tasks not yet finished: derived from `tasks` (rebuilt on restore, not
    /// stored), so a scheduling pass costs the live tasks, not the whole history.
    #[serde(skip)]
    active: BTreeSet<TaskId>,
}

impl StateMachine {
    /// The state of a new mesh whose founding members are all voters.
    pub fn bootstrap(founders: &[(u64, String)], settings: ClusterSettings) -> Self {
        let members = founders
            .iter()
            .map(|(raft_id, peer_id)| {
                (
                    *raft_id,
                    Member {
                        raft_id: *raft_id,
                        peer_id: peer_id.clone(),
                        role: Role::Voter,
                        capability: None,
                        last_heartbeat: None,
                        joined_index: 0,
                        addrs: Vec::new(),
                    },
                )
            })
            .collect();
        Self {
            applied_index: 0,
            applied_term: 0,
            settings,
            members,
            tasks: BTreeMap::new(),
            task_by_request: BTreeMap::new(),
            requests: BTreeMap::new(),
            request_order: VecDeque::new(),
            active: BTreeSet::new(),
        }
    }

    /// An empty state (for a node that has not yet received a snapshot).
    pub fn empty() -> Self {
        Self::bootstrap(
            &[],
            ClusterSettings {
                max_voters: DEFAULT_MAX_VOTERS,
            },
        )
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        Ok(codec::to_bytes(self)?)
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut state: StateMachine = codec::from_bytes(bytes)?;
        state.active = state
            .tasks
            .values()
            .filter(|t| !t.status.is_terminal())
            .map(|t| t.id)
            .collect();
        Ok(state)
    }

    pub fn applied_index(&self) -> u64 {
        self.applied_index
    }

    pub fn applied_term(&self) -> u64 {
        self.applied_term
    }

    pub fn settings(&self) -> &ClusterSettings {
        &self.settings
    }

    pub fn members(&self) -> &BTreeMap<u64, Member> {
        &self.members
    }

    pub fn member(&self, raft_id: u64) -> Option<&Member> {
        self.members.get(&raft_id)
    }

    pub fn voter_count(&self) -> usize {
        self.members
            .values()
            .filter(|m| m.role == Role::Voter)
            .count()
    }

    pub fn tasks(&self) -> &BTreeMap<TaskId, Task> {
        &self.tasks
    }

    pub fn task(&self, id: TaskId) -> Option<&Task> {
        self.tasks.get(&id)
    }

    /// Tasks still pending or running, oldest first.
    pub fn active_tasks(&self) -> impl Iterator<Item = &Task> {
        self.active.iter().filter_map(|id| self.tasks.get(id))
    }

    /// Attempts running or queued on each node: the one measure of a node's load,
    /// read by placement, the API and the dashboard. Nodes with none are absent.
    pub fn queue_by_node(&self) -> BTreeMap<u64, u32> {
        let mut queue = BTreeMap::new();
        for t in self.active_tasks() {
            for sh in &t.shards {
                for a in &sh.attempts {
                    *queue.entry(a.node).or_default() += 1;
                }
            }
        }
        queue
    }

    /// The task a submit with this idempotency key created, if any.
    pub fn task_by_request(&self, request_id: &RequestId) -> Option<TaskId> {
        self.task_by_request.get(request_id).copied()
    }

    /// The outcome of an applied request id, while it is remembered.
    pub fn prior(&self, request_id: &RequestId) -> Option<&Committed> {
        self.requests.get(request_id)
    }

    /// The outcome a request id already got, if it is still remembered (submits: for
    /// as long as their task exists).
    pub fn outcome_of(&self, request_id: &RequestId) -> Option<Committed> {
        if let Some(c) = self.requests.get(request_id) {
            return Some(c.clone());
        }
        self.task_by_request.get(request_id).map(|task| Committed {
            index: task.0,
            outcome: Outcome::TaskSubmitted { task: *task },
        })
    }

    /// Advances the applied position for an entry that carries no command (a new
    /// leader's empty entry, or an undecodable one).
    pub fn skip(&mut self, index: u64, term: u64) {
        if index > self.applied_index {
            self.applied_index = index;
            self.applied_term = term;
        }
    }

    /// Whether a membership change may take effect. `Err` carries the outcome to
    /// record instead; the caller then must not apply the Raft ConfChange.
    pub fn membership_verdict(&self, command: &Command) -> Result<(), Outcome> {
        match command {
            Command::NodeJoined { raft_id, .. } => match self.members.get(raft_id) {
                Some(_) => Err(Outcome::Ignored(format!(
                    "node {raft_id} is already a member"
                ))),
                None => Ok(()),
            },
            Command::NodePromoted { raft_id } => match self.members.get(raft_id) {
                None => Err(Outcome::Rejected(format!("node {raft_id} is not a member"))),
                Some(m) if m.role == Role::Voter => Err(Outcome::Ignored(format!(
                    "node {raft_id} is already a voter"
                ))),
                Some(_) if self.voter_count() >= self.settings.max_voters as usize => {
                    Err(Outcome::Rejected(format!(
                        "the voter cap of {} is reached; node {raft_id} stays a learner",
                        self.settings.max_voters
                    )))
                }
                Some(_) => Ok(()),
            },
            Command::NodeLeft { raft_id } => match self.members.get(raft_id) {
                None => Err(Outcome::Ignored(format!("node {raft_id} is not a member"))),
                Some(m) if m.role == Role::Voter && self.voter_count() <= 1 => Err(
                    Outcome::Rejected(format!("node {raft_id} is the last voter")),
                ),
                Some(_) => Ok(()),
            },
            _ => Err(Outcome::Rejected(format!(
                "{} is not a membership change",
                command.kind()
            ))),
        }
    }

    /// Records `outcome` for `entry` without running its command (a refused
    /// membership change).
    pub fn conclude(
        &mut self,
        index: u64,
        term: u64,
        entry: &LogEntry,
        outcome: Outcome,
    ) -> Applied {
        if let Some(prior) = self.requests.get(&entry.request_id) {
            let committed = prior.clone();
            self.skip(index, term);
            return Applied {
                committed,
                duplicate: true,
            };
        }
        self.skip(index, term);
        let committed = Committed { index, outcome };
        self.remember(entry.request_id, committed.clone());
        Applied {
            committed,
            duplicate: false,
        }
    }

    /// Applies one committed entry. Entries at or below the applied index are
    /// ignored (replays after a restart), and a repeated request id has no effect.
    pub fn apply(&mut self, index: u64, term: u64, entry: &LogEntry) -> Applied {
        if let Some(prior) = self.requests.get(&entry.request_id) {
            let committed = prior.clone();
            self.skip(index, term);
            return Applied {
                committed,
                duplicate: true,
            };
        }
        if let Some(task) = self.task_by_request.get(&entry.request_id) {
            let committed = Committed {
                index: task.0,
                outcome: Outcome::TaskSubmitted { task: *task },
            };
            self.skip(index, term);
            return Applied {
                committed,
                duplicate: true,
            };
        }
        if index <= self.applied_index {
            // Not a new entry: already part of this state. Report without effect.
            return Applied {
                committed: Committed {
                    index,
                    outcome: Outcome::Ignored("already applied".into()),
                },
                duplicate: true,
            };
        }
        self.applied_index = index;
        self.applied_term = term;
        let outcome = self.run(index, entry);
        if let Some(task) = entry.command.task().or(match outcome {
            Outcome::TaskSubmitted { task } => Some(task),
            _ => None,
        }) {
            match self.tasks.get(&task) {
                Some(t) if !t.status.is_terminal() => self.active.insert(task),
                _ => self.active.remove(&task),
            };
        }
        let committed = Committed { index, outcome };
        // Submits are remembered through their task instead (see `task_by_request`).
        if !matches!(committed.outcome, Outcome::TaskSubmitted { .. }) {
            self.remember(entry.request_id, committed.clone());
        }
        Applied {
            committed,
            duplicate: false,
        }
    }

    fn remember(&mut self, request_id: RequestId, committed: Committed) {
        self.requests.insert(request_id, committed);
        self.request_order.push_back(request_id);
        while self.request_order.len() > REMEMBERED_REQUESTS {
            if let Some(old) = self.request_order.pop_front() {
                self.requests.remove(&old);
            }
        }
    }

    fn run(&mut self, index: u64, entry: &LogEntry) -> Outcome {
        match &entry.command {
            Command::SubmitTask { spec, submitter } => {
                self.submit(index, entry.request_id, spec, submitter)
            }
            Command::AssignShard { task, shard, node } => {
                self.assign(index, *task, *shard, *node, None)
            }
            Command::ReassignShard {
                task,
                shard,
                epoch,
                node,
                reason,
            } => self.assign(index, *task, *shard, *node, Some((*epoch, reason))),
            Command::ShardStarted {
                task,
                shard,
                epoch,
                node,
            } => self.with_attempt(*task, *shard, *epoch, *node, |_, s| {
                match s.attempts.iter_mut().find(|a| a.epoch == *epoch) {
                    Some(a) if !a.running => {
                        a.running = true;
                        Outcome::Applied
                    }
                    _ => Outcome::Ignored("attempt already running".into()),
                }
            }),
            Command::ShardResult {
                task,
                shard,
                epoch,
                node,
                blob,
                size,
            } => {
                let report = ShardOutput {
                    blob: *blob,
                    size: *size,
                    node: *node,
                    epoch: *epoch,
                    index,
                };
                self.with_attempt(*task, *shard, *epoch, *node, |t, s| {
                    s.attempts.retain(|a| a.epoch != *epoch);
                    s.reports.push(report);
                    if t.spec.options.replicas <= 1 {
                        accept(t, s, *shard, index, report, None);
                    } else if t.spec.options.tolerance.is_none()
                        && s.reports.len() as u32 >= s.needed
                    {
                        // Bit-for-bit comparison: equal outputs have equal hashes.
                        let mut groups: BTreeMap<BlobId, Vec<u32>> = BTreeMap::new();
                        for r in &s.reports {
                            groups.entry(r.blob).or_default().push(r.epoch);
                        }
                        let largest = groups.into_values().max_by_key(|g| g.len());
                        judge(t, s, *shard, index, largest.unwrap_or_default());
                    }
                    Outcome::Applied
                })
            }
            Command::ShardVerdict {
                task,
                shard,
                agreeing,
            } => self.with_shard(*task, *shard, |t, s| {
                if s.state != ShardState::Verifying {
                    return Outcome::Ignored("shard is not awaiting a verdict".into());
                }
                judge(t, s, *shard, index, agreeing.clone());
                Outcome::Applied
            }),
            Command::ShardFailed {
                task,
                shard,
                epoch,
                node,
                reason,
            } => self.with_attempt(*task, *shard, *epoch, *node, |t, s| {
                s.attempts.retain(|a| a.epoch != *epoch);
                s.failures += 1;
                s.last_error = Some(reason.clone());
                t.record(
                    index,
                    Some(*shard),
                    format!("attempt {epoch} on node {node:x} failed: {reason}"),
                );
                if s.failures >= MAX_SHARD_ATTEMPTS {
                    t.status = TaskStatus::Failed(format!(
                        "shard {shard} failed {} times; last error: {reason}",
                        s.failures
                    ));
                }
                Outcome::Applied
            }),
            Command::TaskFailed {
                task,
                shard,
                epoch,
                node,
                reason,
            } => self.with_attempt(*task, *shard, *epoch, *node, |t, s| {
                s.attempts.retain(|a| a.epoch != *epoch);
                s.last_error = Some(reason.clone());
                t.record(index, Some(*shard), format!("node {node:x}: {reason}"));
                t.status = TaskStatus::Failed(format!("shard {shard}: {reason}"));
                Outcome::Applied
            }),
            Command::TaskCancelled { task, reason } => match self.tasks.get_mut(task) {
                None => Outcome::Rejected(format!("no task {task}")),
                Some(t) if t.status.is_terminal() => {
                    Outcome::Ignored(format!("task {task} already finished: {:?}", t.status))
                }
                Some(t) => {
                    t.status = TaskStatus::Cancelled(reason.clone());
                    t.record(index, None, format!("cancelled: {reason}"));
                    Outcome::Applied
                }
            },
            Command::NodeJoined {
                raft_id,
                peer_id,
                capability,
            } => {
                self.members.insert(
                    *raft_id,
                    Member {
                        raft_id: *raft_id,
                        peer_id: peer_id.clone(),
                        role: Role::Learner,
                        capability: capability.clone(),
                        last_heartbeat: None,
                        joined_index: index,
                        addrs: Vec::new(),
                    },
                );
                Outcome::Applied
            }
            Command::NodePromoted { raft_id } => match self.members.get_mut(raft_id) {
                Some(m) => {
                    m.role = Role::Voter;
                    Outcome::Applied
                }
                None => Outcome::Rejected(format!("node {raft_id} is not a member")),
            },
            Command::NodeLeft { raft_id } => match self.members.remove(raft_id) {
                Some(_) => Outcome::Applied,
                None => Outcome::Ignored(format!("node {raft_id} is not a member")),
            },
            Command::NodeCapabilities {
                raft_id,
                capability,
            } => match self.members.get_mut(raft_id) {
                Some(m) => {
                    m.capability = Some(capability.clone());
                    Outcome::Applied
                }
                None => Outcome::Rejected(format!("node {raft_id} is not a member")),
            },
            Command::NodeAddresses { raft_id, addrs } => match self.members.get_mut(raft_id) {
                Some(m) => {
                    m.addrs = addrs.clone();
                    Outcome::Applied
                }
                None => Outcome::Rejected(format!("node {raft_id} is not a member")),
            },
            Command::TaskMerged { task, outputs } => self.with_merging(*task, |t| {
                t.outputs = outputs.clone();
                t.status = TaskStatus::Completed;
                t.record(index, None, format!("{} shards merged", t.shards.len()));
            }),
            Command::MergeFailed { task, reason } => self.with_merging(*task, |t| {
                t.status = TaskStatus::Failed(reason.clone());
                t.record(index, None, format!("merge failed: {reason}"));
            }),
            Command::Heartbeat { raft_id, at_ms } => match self.members.get_mut(raft_id) {
                Some(m) => {
                    m.last_heartbeat = Some(Liveness {
                        index,
                        at_ms: *at_ms,
                    });
                    Outcome::Applied
                }
                None => Outcome::Rejected(format!("node {raft_id} is not a member")),
            },
        }
    }

    fn submit(
        &mut self,
        index: u64,
        request_id: RequestId,
        spec: &TaskSpec,
        submitter: &str,
    ) -> Outcome {
        if let Err(e) = spec.check_shape() {
            return Outcome::Rejected(e.to_string());
        }
        if spec.shards > MAX_SHARDS_PER_TASK {
            return Outcome::Rejected(format!(
                "{} shards requested; the limit is {MAX_SHARDS_PER_TASK}",
                spec.shards
            ));
        }
        let spec_hash = match spec.hash() {
            Ok(h) => h,
            Err(e) => return Outcome::Rejected(e.to_string()),
        };
        let id = TaskId(index);
        let shard = Shard {
            epoch: 0,
            attempts: Vec::new(),
            reports: Vec::new(),
            needed: spec.options.replicas.max(1),
            state: ShardState::Pending,
            failures: 0,
            last_error: None,
            output: None,
        };
        self.tasks.insert(
            id,
            Task {
                id,
                spec: spec.clone(),
                spec_hash,
                submitter: submitter.to_owned(),
                request_id,
                status: TaskStatus::Pending,
                shards: vec![shard; spec.shards as usize],
                history: VecDeque::new(),
                mismatches: 0,
                outputs: Vec::new(),
            },
        );
        self.task_by_request.insert(request_id, id);
        Outcome::TaskSubmitted { task: id }
    }

    fn assign(
        &mut self,
        index: u64,
        task: TaskId,
        shard: u32,
        node: u64,
        replaces: Option<(u32, &String)>,
    ) -> Outcome {
        if !self.members.contains_key(&node) {
            return Outcome::Rejected(format!("node {node} is not a member"));
        }
        self.with_shard(task, shard, |t, s| {
            if let Some((old, reason)) = replaces {
                let Some(pos) = s.attempts.iter().position(|a| a.epoch == old) else {
                    return Outcome::Ignored(format!(
                        "attempt {old} of shard {shard} of {task} is no longer in flight"
                    ));
                };
                let gone = s.attempts.remove(pos);
                t.record(
                    index,
                    Some(shard),
                    format!("attempt {old} on node {:x} given up: {reason}", gone.node),
                );
            } else if s.state == ShardState::Verifying {
                return Outcome::Ignored(format!("shard {shard} of {task} is being verified"));
            }
            if s.attempts.iter().any(|a| a.node == node) || s.reports.iter().any(|r| r.node == node)
            {
                return Outcome::Ignored(format!(
                    "node {node:x} already has shard {shard} of {task}"
                ));
            }
            let speculative = s.wanted() == 0;
            s.epoch += 1;
            let epoch = s.epoch;
            s.attempts.push(Attempt {
                epoch,
                node,
                running: false,
                speculative,
            });
            t.record(
                index,
                Some(shard),
                format!(
                    "attempt {epoch} on node {node:x}{}",
                    if speculative { " (speculative)" } else { "" }
                ),
            );
            t.status = TaskStatus::Running;
            Outcome::ShardAssigned { task, shard, epoch }
        })
    }

    /// Runs `f` on a live task's shard that has no accepted result yet, then brings
    /// the shard's and the task's status up to date.
    fn with_shard(
        &mut self,
        task: TaskId,
        shard: u32,
        f: impl FnOnce(&mut Task, &mut Shard) -> Outcome,
    ) -> Outcome {
        let Some(t) = self.tasks.get_mut(&task) else {
            return Outcome::Rejected(format!("no task {task}"));
        };
        if t.status.is_terminal() {
            return Outcome::Ignored(format!("task {task} already finished: {:?}", t.status));
        }
        let Some(slot) = t.shards.get_mut(shard as usize) else {
            return Outcome::Rejected(format!("task {task} has no shard {shard}"));
        };
        if slot.state == ShardState::Done {
            return Outcome::Ignored(format!("shard {shard} of {task} already has a result"));
        }
        // Out of the task while `f` runs, so both can be changed.
        let mut s = std::mem::take(slot);
        let outcome = f(t, &mut s);
        s.settle();
        t.shards[shard as usize] = s;
        self.refresh_status(task);
        outcome
    }

    /// [`Self::with_shard`] for a report from attempt `epoch` by `node`, which must
    /// still be in flight; otherwise the report is stale.
    fn with_attempt(
        &mut self,
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
        f: impl FnOnce(&mut Task, &mut Shard) -> Outcome,
    ) -> Outcome {
        self.with_shard(task, shard, |t, s| {
            if s.attempt(epoch, node).is_none() {
                return Outcome::Ignored(format!(
                    "stale report for shard {shard} of {task}: attempt {epoch} by node {node} \
                     is not in flight (latest attempt {})",
                    s.epoch
                ));
            }
            f(t, s)
        })
    }

    /// Runs `f` on a task that awaits its merge.
    fn with_merging(&mut self, task: TaskId, f: impl FnOnce(&mut Task)) -> Outcome {
        match self.tasks.get_mut(&task) {
            None => Outcome::Rejected(format!("no task {task}")),
            Some(t) if t.status != TaskStatus::Merging => Outcome::Ignored(format!(
                "task {task} is not awaiting a merge ({})",
                t.status.name()
            )),
            Some(t) => {
                f(t);
                Outcome::Applied
            }
        }
    }

    fn refresh_status(&mut self, task: TaskId) {
        if let Some(t) = self.tasks.get_mut(&task) {
            if matches!(t.status, TaskStatus::Pending | TaskStatus::Running)
                && t.shards.iter().all(|s| s.state == ShardState::Done)
            {
                // One shard's result is the answer; several must be merged first,
                // and a merge may still fail.
                t.status = if t.shards.len() == 1 {
                    TaskStatus::Completed
                } else {
                    TaskStatus::Merging
                };
            }
        }
    }
}

/// Accepts `report` as the shard's output; attempts still in flight lose (their
/// nodes see the shard done and drop them).
fn accept(
    t: &mut Task,
    s: &mut Shard,
    shard: u32,
    index: u64,
    report: Report,
    note: Option<String>,
) {
    s.output = Some(report);
    for loser in s.attempts.drain(..) {
        t.record(
            index,
            Some(shard),
            format!(
                "attempt {} on node {:x} cancelled: a result won",
                loser.epoch, loser.node
            ),
        );
    }
    t.record(
        index,
        Some(shard),
        match note {
            Some(n) => format!(
                "result of attempt {} on node {:x} accepted: {n}",
                report.epoch, report.node
            ),
            None => format!(
                "result of attempt {} on node {:x} accepted",
                report.epoch, report.node
            ),
        },
    );
}

/// Settles a shard's replica results: `agreeing` lists the epochs of the largest
/// group that agree. Two or more win; otherwise the disagreement is recorded and one
/// more node is asked, or the task fails once every replica slot has answered.
fn judge(t: &mut Task, s: &mut Shard, shard: u32, index: u64, agreeing: Vec<u32>) {
    let total = s.reports.len();
    let nodes: Vec<String> = s.reports.iter().map(|r| format!("{:x}", r.node)).collect();
    if agreeing.len() >= 2 {
        if let Some(&winner) = s.reports.iter().find(|r| r.epoch == agreeing[0]) {
            accept(
                t,
                s,
                shard,
                index,
                winner,
                Some(format!(
                    "{} of {total} replica results agree",
                    agreeing.len()
                )),
            );
            return;
        }
    }
    t.mismatches += 1;
    t.record(
        index,
        Some(shard),
        format!("replica results disagree (nodes {})", nodes.join(", ")),
    );
    if (total as u32) < gpumesh_protocol::MAX_REPLICAS {
        s.needed = total as u32 + 1;
    } else {
        t.status = TaskStatus::Failed(format!(
            "the {total} replica results of a shard all disagree (nodes {})",
            nodes.join(", ")
        ));
    }
}
