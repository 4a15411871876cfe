//! How each command changes the record: `run` dispatches a committed command to
//! the step that applies it; every step is deterministic.

use super::*;

impl StateMachine {
    pub(super) fn run(&mut self, index: u64, entry: &LogEntry) -> Outcome {
        match &entry.command {
            Command::SubmitTask {
                spec,
                submitter,
                needs,
            } => self.submit(index, entry, spec, submitter, *needs),
            Command::TaskRan {
                spec,
                submitter,
                node,
                ran,
            } => self.task_ran(index, entry.request_id, spec, submitter, *node, ran),
            Command::CreateActor {
                name,
                state,
                backend,
                creator,
            } => self.create_actor(index, name, state, *backend, creator),
            Command::PlaceActor {
                name, epoch, node, ..
            } => self.place_actor(name, *epoch, *node),
            Command::CallActor { name, call, caller } => self.call_actor(index, name, call, caller),
            Command::ActorCallDone {
                name,
                seq,
                epoch,
                node,
                state,
                backup,
                outputs,
            } => self.actor_call_done(index, name, *seq, *epoch, *node, state, *backup, outputs),
            Command::ActorCallFailed {
                name,
                seq,
                epoch,
                node,
                reason,
            } => self.actor_call_failed(index, name, *seq, *epoch, *node, reason),
            Command::ActorCallsDone {
                name,
                epoch,
                node,
                version,
                first,
                ran,
                state,
                inline,
                backup,
            } => self.actor_calls_done(
                index,
                name,
                (*epoch, *node),
                (*version, *first),
                ran,
                After {
                    state,
                    inline,
                    backup: *backup,
                },
            ),
            Command::ActorCallsRan {
                name,
                epoch,
                node,
                version,
                calls,
                state,
                inline,
                backup,
            } => self.actor_calls_ran(
                index,
                name,
                (*epoch, *node),
                *version,
                calls,
                After {
                    state,
                    inline,
                    backup: *backup,
                },
            ),
            Command::DeleteActor { name } => self.delete_actor(name),
            Command::MembersDown { down } => {
                self.down = down
                    .iter()
                    .copied()
                    .filter(|n| self.members.contains_key(n))
                    .collect();
                Outcome::Applied
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
                inline,
            } => self.shard_result(index, *task, *shard, *epoch, *node, *blob, *size, inline),
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
                if !s.failed_on.contains(node) {
                    s.failed_on.push(*node);
                }
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
            } => self.task_failed(index, *task, *shard, *epoch, *node, reason),
            Command::ForgetTask { task, .. } => match self.tasks.get(task) {
                None => Outcome::Rejected(format!("no task {task}")),
                Some(t) if !t.status.is_terminal() => Outcome::Rejected(format!(
                    "task {task} is {}: only a finished task can be forgotten (cancel it first)",
                    t.status.name()
                )),
                Some(_) => {
                    if let Some(t) = self.tasks.remove(task) {
                        self.task_by_request.remove(&t.request_id);
                    }
                    self.finished.remove(task);
                    Outcome::Applied
                }
            },
            Command::TaskCancelled { task, reason } => match self.task_mut(*task) {
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

    pub(super) fn submit(
        &mut self,
        index: u64,
        entry: &LogEntry,
        spec: &TaskSpec,
        submitter: &str,
        needs: Option<KernelNeeds>,
    ) -> Outcome {
        let outcome = self.create_task(index, entry.request_id, spec, submitter);
        if let Outcome::TaskSubmitted { task } = outcome {
            if let Some(t) = self.task_mut(task) {
                t.needs = needs;
            }
            self.place_new_task(index, task, entry.origin);
        }
        outcome
    }

    /// Records a task that `node` ran where it was submitted, and what came of it.
    pub(super) fn task_ran(
        &mut self,
        index: u64,
        request_id: RequestId,
        spec: &TaskSpec,
        submitter: &str,
        node: u64,
        ran: &Ran,
    ) -> Outcome {
        if spec.shards != 1 || spec.options.replicas > 1 {
            return Outcome::Rejected(
                "only a task of one shard and one replica is run where it is submitted".into(),
            );
        }
        if !self.members.contains_key(&node) {
            return Outcome::Rejected(format!("node {node} is not a member"));
        }
        if let Ran::Result {
            blob,
            size,
            inline: Some(bytes),
        } = ran
        {
            if let Err(e) = check_inline(*blob, *size, bytes) {
                return Outcome::Rejected(e);
            }
        }
        let outcome = self.create_task(index, request_id, spec, submitter);
        let Outcome::TaskSubmitted { task } = outcome else {
            return outcome;
        };
        let Some(t) = self.task_mut(task) else {
            return outcome;
        };
        let epoch = t.shards[0].start_attempt(node, false);
        t.shards[0].settle();
        t.status = TaskStatus::Running;
        t.record(
            index,
            Some(0),
            format!("attempt {epoch} on node {node:x}, where it was submitted"),
        );
        match ran {
            Ran::Result { blob, size, inline } => {
                self.shard_result(index, task, 0, epoch, node, *blob, *size, inline)
            }
            Ran::Failed(reason) => self.task_failed(index, task, 0, epoch, node, reason),
        };
        outcome
    }

    /// A live attempt's result for a shard: accepted at once with one replica; with
    /// more, kept until enough have come to compare.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn shard_result(
        &mut self,
        index: u64,
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
        blob: BlobId,
        size: u64,
        inline: &Option<Vec<u8>>,
    ) -> Outcome {
        if let Some(bytes) = inline {
            if let Err(e) = check_inline(blob, size, bytes) {
                return Outcome::Rejected(e);
            }
        }
        let report = ShardOutput {
            blob,
            size,
            node,
            epoch,
            index,
        };
        self.with_attempt(task, shard, epoch, node, |t, s| {
            s.attempts.retain(|a| a.epoch != epoch);
            s.reports.push(report);
            // A larger carried result is a blob each replica stored on applying this.
            if let Some(bytes) = inline.as_ref().filter(|b| b.len() <= MAX_INLINE_RESULT) {
                t.inline.insert(blob, bytes.clone());
            }
            if t.spec.options.replicas <= 1 {
                accept(t, s, shard, index, report, None);
            } else if t.spec.options.tolerance.is_none() && s.reports.len() as u32 >= s.needed {
                // Bit-for-bit comparison: equal outputs have equal hashes.
                let mut groups: BTreeMap<BlobId, Vec<u32>> = BTreeMap::new();
                for r in &s.reports {
                    groups.entry(r.blob).or_default().push(r.epoch);
                }
                let largest = groups.into_values().max_by_key(|g| g.len());
                judge(t, s, shard, index, largest.unwrap_or_default());
            }
            Outcome::Applied
        })
    }

    /// A live attempt hit what no retry fixes: the task fails.
    pub(super) fn task_failed(
        &mut self,
        index: u64,
        task: TaskId,
        shard: u32,
        epoch: u32,
        node: u64,
        reason: &str,
    ) -> Outcome {
        self.with_attempt(task, shard, epoch, node, |t, s| {
            s.attempts.retain(|a| a.epoch != epoch);
            s.last_error = Some(reason.to_owned());
            t.record(index, Some(shard), format!("node {node:x}: {reason}"));
            t.status = TaskStatus::Failed(format!("shard {shard}: {reason}"));
            Outcome::Applied
        })
    }

    /// A new task in the record, its shards not yet placed.
    fn create_task(
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
            failed_on: Vec::new(),
            output: None,
        };
        self.tasks.insert(
            id,
            Arc::new(Task {
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
                inline: BTreeMap::new(),
                needs: None,
            }),
        );
        self.task_by_request.insert(request_id, id);
        Outcome::TaskSubmitted { task: id }
    }

    pub(super) fn assign(
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
            let epoch = s.start_attempt(node, speculative);
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
    pub(super) fn with_shard(
        &mut self,
        task: TaskId,
        shard: u32,
        f: impl FnOnce(&mut Task, &mut Shard) -> Outcome,
    ) -> Outcome {
        let Some(t) = self.task_mut(task) else {
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
    pub(super) fn with_attempt(
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
    pub(super) fn with_merging(&mut self, task: TaskId, f: impl FnOnce(&mut Task)) -> Outcome {
        match self.task_mut(task) {
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

    pub(super) fn refresh_status(&mut self, task: TaskId) {
        if let Some(t) = self.task_mut(task) {
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

/// A result carried in its entry is small, of its declared size, and hashes to its
/// blob id.
fn check_inline(blob: BlobId, size: u64, bytes: &[u8]) -> Result<(), String> {
    if bytes.len() > MAX_CARRIED_RESULT || bytes.len() as u64 != size || !blob.matches(bytes) {
        return Err(format!(
            "a result carried in its entry must be at most {MAX_CARRIED_RESULT} bytes, of its \
             size, and hash to its blob id"
        ));
    }
    Ok(())
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
