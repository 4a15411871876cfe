//! The replicated state machine: members, tasks, shards and results.
//!
//! `apply` is a plain deterministic function of (state, index, entry): no clocks, no
//! randomness, no I/O, so every replica that applies the same log reaches the same
//! state, and a replica restored from a snapshot equals one that replayed the log.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use gpumesh_protocol::{codec, AdapterLimits, BlobId, KernelNeeds, NodeCapability, TaskSpec};
use serde::{Deserialize, Serialize};

use crate::command::{Command, Committed, LogEntry, MergedOutput, Outcome, Ran, RequestId, TaskId};
use crate::error::Result;

mod actors;
mod commands;
mod placement;
mod types;

pub(crate) use actors::After;
pub use actors::{Actor, CallResult, PendingCall, MAX_WAITING_CALLS, REMEMBERED_CALLS};
pub use placement::{candidates, largest_binding, pick, Candidate, Need};
pub use types::*;

/// The replicated record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StateMachine {
    applied_index: u64,
    applied_term: u64,
    settings: ClusterSettings,
    members: BTreeMap<u64, Member>,
    /// Each task behind its own `Arc`, so a copy of the record (a snapshot being
    /// encoded off the replica's task) shares every task and a change copies only
    /// the task it changes. Encoded as the task itself.
    tasks: BTreeMap<TaskId, Arc<Task>>,
    task_by_request: BTreeMap<RequestId, TaskId>,
    requests: BTreeMap<RequestId, Committed>,
    /// Insertion order of `requests`, oldest first, to forget deterministically.
    request_order: VecDeque<RequestId>,
    /// Tasks not yet finished: derived from `tasks` (rebuilt on restore, not
    /// stored), so a scheduling pass costs the live tasks, not the whole history.
    #[serde(skip)]
    active: BTreeSet<TaskId>,
    /// Tasks finished (completed, failed or cancelled), derived like `active`: the
    /// oldest are forgotten beyond [`KEPT_FINISHED_TASKS`].
    #[serde(skip)]
    finished: BTreeSet<TaskId>,
    /// Attempts of active tasks on each node, derived like `active` (see
    /// [`Self::queue_by_node`]).
    #[serde(skip)]
    queue: BTreeMap<u64, u32>,
    /// Active tasks by submitter, derived like `active`.
    #[serde(skip)]
    active_by_submitter: BTreeMap<String, usize>,
    /// GPU actors by name, each behind its own `Arc` as the tasks are.
    actors: BTreeMap<String, Arc<Actor>>,
    /// Actor names by host (`None`: not placed yet), derived from `actors` like
    /// `active`: a host's pass and the leader's placement cost the actors they
    /// concern, not every actor in the record.
    #[serde(skip)]
    by_host: BTreeMap<Option<u64>, BTreeSet<String>>,
    /// Actors with calls waiting in the record's queue, derived like `by_host`.
    #[serde(skip)]
    queued: BTreeSet<String>,
    /// Members the leader judged down (`MembersDown`).
    down: BTreeSet<u64>,
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
            finished: BTreeSet::new(),
            queue: BTreeMap::new(),
            active_by_submitter: BTreeMap::new(),
            actors: BTreeMap::new(),
            by_host: BTreeMap::new(),
            queued: BTreeSet::new(),
            down: BTreeSet::new(),
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

    /// A copy of what [`Self::to_bytes`] encodes, for encoding elsewhere (a
    /// snapshot, off the replica's task) while this one goes on: it shares every
    /// task and actor, and leaves out the indexes derived from them (rebuilt on
    /// restore), so with 10,000 tasks and 20,000 actors it costs a few
    /// milliseconds where a whole clone cost 8-18. Only for encoding: it is not a
    /// state to apply entries to.
    pub fn for_encoding(&self) -> Self {
        Self {
            applied_index: self.applied_index,
            applied_term: self.applied_term,
            settings: self.settings.clone(),
            members: self.members.clone(),
            tasks: self.tasks.clone(),
            task_by_request: self.task_by_request.clone(),
            requests: self.requests.clone(),
            request_order: self.request_order.clone(),
            actors: self.actors.clone(),
            down: self.down.clone(),
            active: BTreeSet::new(),
            finished: BTreeSet::new(),
            queue: BTreeMap::new(),
            active_by_submitter: BTreeMap::new(),
            by_host: BTreeMap::new(),
            queued: BTreeSet::new(),
        }
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let mut state: StateMachine = codec::from_bytes(bytes)?;
        let (active, finished): (Vec<&Task>, Vec<&Task>) = state
            .tasks
            .values()
            .map(|t| &**t)
            .partition(|t| !t.status.is_terminal());
        state.active = active.iter().map(|t| t.id).collect();
        state.finished = finished.iter().map(|t| t.id).collect();
        let active: Vec<TaskId> = state.active.iter().copied().collect();
        for id in active {
            state.count_active(id, true);
        }
        let names: Vec<String> = state.actors.keys().cloned().collect();
        for name in names {
            state.index_actor(&name, None);
        }
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

    /// Every blob the record names: tasks' inputs, shard results (accepted and
    /// reported), merged outputs and results carried in entries; actors' states,
    /// their waiting calls' inputs and their remembered calls' outputs. What a node
    /// may delete is what is not here (see the node's blob sweeper).
    pub fn blobs_in_use(&self) -> std::collections::HashSet<BlobId> {
        use gpumesh_protocol::BindingRole;
        let mut used = std::collections::HashSet::new();
        let mut bindings = |specs: &[gpumesh_protocol::BindingSpec]| {
            for b in specs {
                if let BindingRole::Input { blob, .. } | BindingRole::InOut { blob, .. } = &b.role {
                    used.insert(*blob);
                }
            }
        };
        for task in self.tasks.values() {
            bindings(&task.spec.bindings);
        }
        for actor in self.actors.values() {
            for call in actor.pending.values() {
                bindings(&call.call.bindings);
            }
        }
        for task in self.tasks.values() {
            used.extend(task.result_blobs());
        }
        for actor in self.actors.values() {
            used.extend(actor.state.iter().filter_map(|s| s.blob));
            for result in actor.results.values() {
                if let CallResult::Done { outputs, .. } = result {
                    used.extend(outputs.iter().map(|o| o.blob));
                }
            }
        }
        used
    }

    /// Every task in the record, by id.
    pub fn tasks(&self) -> impl DoubleEndedIterator<Item = &Task> + ExactSizeIterator {
        self.tasks.values().map(|t| &**t)
    }

    /// A task to change; copied first if a copy of the record shares it.
    pub(super) fn task_mut(&mut self, id: TaskId) -> Option<&mut Task> {
        self.tasks.get_mut(&id).map(Arc::make_mut)
    }

    pub fn task(&self, id: TaskId) -> Option<&Task> {
        self.tasks.get(&id).map(|t| &**t)
    }

    /// Tasks still pending or running, oldest first.
    pub fn active_tasks(&self) -> impl Iterator<Item = &Task> {
        self.active.iter().filter_map(|id| self.task(*id))
    }

    /// Attempts running or queued on each node: the one measure of a node's load,
    /// read by placement, the API and the dashboard. Nodes with none are absent.
    pub fn queue_by_node(&self) -> BTreeMap<u64, u32> {
        self.queue.clone()
    }

    /// How many tasks submitted through `submitter` are pending or running.
    pub fn active_submitted_by(&self, submitter: &str) -> usize {
        self.active_by_submitter
            .get(submitter)
            .copied()
            .unwrap_or(0)
    }

    /// Adds (or takes away) active task `id` in the derived counts: its attempts
    /// in each node's queue, and one for its submitter.
    fn count_active(&mut self, id: TaskId, add: bool) {
        let Some(t) = self.tasks.get(&id) else {
            return;
        };
        for a in t.shards.iter().flat_map(|sh| &sh.attempts) {
            let n = self.queue.entry(a.node).or_default();
            *n = if add { *n + 1 } else { n.saturating_sub(1) };
            if *n == 0 {
                self.queue.remove(&a.node);
            }
        }
        match self.active_by_submitter.get_mut(&t.submitter) {
            Some(n) if add => *n += 1,
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.active_by_submitter.remove(&t.submitter);
            }
            None if add => {
                self.active_by_submitter.insert(t.submitter.clone(), 1);
            }
            None => {}
        }
    }

    /// Debug builds (the tests) check after every entry that what is derived
    /// equals what the record says when counted from scratch.
    #[cfg(debug_assertions)]
    fn check_derived(&self, index: u64) {
        let mut queue: BTreeMap<u64, u32> = BTreeMap::new();
        let mut by: BTreeMap<String, usize> = BTreeMap::new();
        for t in self.active_tasks() {
            for a in t.shards.iter().flat_map(|sh| &sh.attempts) {
                *queue.entry(a.node).or_default() += 1;
            }
            *by.entry(t.submitter.clone()).or_default() += 1;
        }
        assert_eq!(self.queue, queue, "queues after entry {index}");
        assert_eq!(
            self.active_by_submitter, by,
            "submitters after entry {index}"
        );
        let mut hosts: BTreeMap<Option<u64>, BTreeSet<String>> = BTreeMap::new();
        for a in self.actors.values() {
            hosts.entry(a.host).or_default().insert(a.name.clone());
        }
        assert_eq!(self.by_host, hosts, "actor hosts after entry {index}");
        let queued: BTreeSet<String> = self
            .actors
            .values()
            .filter(|a| !a.pending.is_empty())
            .map(|a| a.name.clone())
            .collect();
        assert_eq!(
            self.queued, queued,
            "actors with queued calls after entry {index}"
        );
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
        let actor = entry
            .command
            .actor()
            .map(|name| (name, self.actor(name).map(|a| a.host)));
        // A task's counts come out before the entry and go back after it.
        let counted = entry.command.task().filter(|t| self.active.contains(t));
        if let Some(task) = counted {
            self.count_active(task, false);
        }
        let outcome = self.run(index, entry);
        if let Some((name, before)) = actor {
            self.index_actor(name, before);
        }
        if let Some(task) = entry.command.task().or(match outcome {
            Outcome::TaskSubmitted { task } => Some(task),
            _ => None,
        }) {
            match self.tasks.get(&task) {
                Some(t) if !t.status.is_terminal() => {
                    self.active.insert(task);
                }
                Some(_) => {
                    self.active.remove(&task);
                    self.finished.insert(task);
                    self.forget_old_tasks();
                }
                None => {
                    self.active.remove(&task);
                }
            }
            if self.active.contains(&task) {
                self.count_active(task, true);
            }
        }
        #[cfg(debug_assertions)]
        self.check_derived(index);
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

    /// Forgets the oldest finished tasks beyond [`KEPT_FINISHED_TASKS`] (with the
    /// request ids that named them): the record's size stays bounded however long
    /// the mesh runs. Deterministic, like every change to the record.
    fn forget_old_tasks(&mut self) {
        while self.finished.len() > KEPT_FINISHED_TASKS {
            let Some(old) = self.finished.pop_first() else {
                break;
            };
            if let Some(t) = self.tasks.remove(&old) {
                self.task_by_request.remove(&t.request_id);
            }
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
}
