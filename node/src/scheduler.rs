//! The scheduler: on the Raft leader only, turns the replicated record into
//! placements, and settles replica results that need a float comparison.
//!
//! Each shard that wants an attempt goes to the member that minimises (shards
//! queued + 1) / measured GFLOP/s among those whose adapter limits fit the task's
//! buffers, so placement is proportional to capability and current queue; replicas
//! of one shard go to distinct nodes, different adapters or backends first. Members
//! without an adapter stay in the mesh and get nothing. Which members are down is
//! [`crate::liveness`]'s to say: the attempts of a node that is down or gone move to
//! another node under a new epoch. An attempt running far past its expected time gets a
//! speculative copy elsewhere; the first valid result wins. Talks to: raft (reads
//! state, proposes), liveness, the mesh (pulls replica outputs to compare them).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpumesh_consensus::{
    AppliedEvent, Command, ConsensusHandle, RaftRole, Shard, ShardState, StateMachine, TaskId,
};
use gpumesh_protocol::TaskSpec;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::blobs::BlobsHandle;
use crate::liveness::LivenessHandle;
use crate::peers::PeersHandle;

/// When the leader gives up on a node and on a slow attempt.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    pub interval: Duration,
    /// An attempt is a straggler once it has run this many times its expected time…
    pub straggler_factor: f64,
    /// …and at least this long.
    pub straggler_min: Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            interval: Duration::from_millis(250),
            straggler_factor: 4.0,
            straggler_min: Duration::from_secs(30),
        }
    }
}

pub(crate) struct Scheduler {
    pub consensus: ConsensusHandle,
    /// Pulls replica outputs to compare them, and shard results to merge them.
    pub blobs: BlobsHandle,
    pub peers: PeersHandle,
    /// Which members are down: their attempts are placed elsewhere.
    pub liveness: LivenessHandle,
    pub config: SchedulerConfig,
}

/// What the leader has seen for itself; not replicated, rebuilt after a leader change.
#[derive(Debug, Default)]
pub struct Observed {
    /// Members the leader considers down.
    pub down: BTreeSet<u64>,
    /// Attempts (task, shard, epoch) running past their expected time.
    pub slow: BTreeSet<(TaskId, u32, u32)>,
}

/// What the scheduler decided in one pass.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// (task, shard, node): a new attempt.
    pub assign: Vec<(TaskId, u32, u64)>,
    /// (task, shard, old epoch, node, why): an attempt moved off a lost node.
    pub reassign: Vec<(TaskId, u32, u32, u64, String)>,
    pub cancel: Vec<(TaskId, String)>,
    /// Shards whose replica outputs wait for a float comparison.
    pub verify: Vec<(TaskId, u32)>,
    /// Tasks whose shards all have results, waiting to be merged.
    pub merge: Vec<TaskId>,
}

impl Scheduler {
    pub async fn run(self, cancel: CancellationToken) {
        let mut events = self.consensus.subscribe();
        let mut liveness = self.liveness.watch();
        let mut tick = tokio::time::interval(self.config.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Proposals not yet applied, so a pass does not repeat them.
        let mut in_flight: HashSet<(TaskId, u32)> = HashSet::new();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut was_leader = false;
        // Leader-local clocks: the start of each attempt, and how long finished
        // attempts of each task took.
        let mut started: HashMap<(TaskId, u32, u32), Instant> = HashMap::new();
        let mut took: HashMap<TaskId, Vec<Duration>> = HashMap::new();
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                Some(key) = done_rx.recv() => { in_flight.remove(&key); continue; }
                event = events.recv() => {
                    if let Ok(AppliedEvent::Entry { entry, .. }) = event {
                        let now = Instant::now();
                        match &entry.command {
                            Command::ShardStarted { task, shard, epoch, .. } => {
                                started.insert((*task, *shard, *epoch), now);
                            }
                            Command::ShardResult { task, shard, epoch, .. } => {
                                if let Some(t0) = started.remove(&(*task, *shard, *epoch)) {
                                    took.entry(*task).or_default().push(now - t0);
                                }
                            }
                            _ => {}
                        }
                    }
                }
                _ = tick.tick() => {}
                Ok(()) = liveness.changed() => {}
            }
            if self.consensus.watch_status().borrow().role != RaftRole::Leader {
                in_flight.clear();
                was_leader = false;
                continue;
            }
            let now = Instant::now();
            if !was_leader {
                // A new leader has not seen running attempts start: their clocks
                // start now.
                was_leader = true;
                started.clear();
            }
            let config = self.config;
            let snapshot = self.consensus.read_local(|s| {
                s.active_tasks()
                    .flat_map(|t| {
                        t.shards.iter().enumerate().flat_map(move |(i, sh)| {
                            sh.attempts
                                .iter()
                                .map(move |a| (t.id, i as u32, a.epoch, a.node))
                        })
                    })
                    .collect::<Vec<(TaskId, u32, u32, u64)>>()
            });
            let running = snapshot;
            let mut observed = Observed {
                down: self.liveness.view().down().collect(),
                ..Observed::default()
            };
            let live: HashSet<(TaskId, u32, u32)> =
                running.iter().map(|(t, s, e, _)| (*t, *s, *e)).collect();
            started.retain(|k, _| live.contains(k));
            took.retain(|t, _| live.iter().any(|(lt, _, _)| lt == t));
            for (task, shard, epoch, _) in &running {
                let t0 = *started.entry((*task, *shard, *epoch)).or_insert(now);
                let expected = took
                    .get(task)
                    .and_then(|d| median(d))
                    .map(|m| m.mul_f64(config.straggler_factor))
                    .unwrap_or(Duration::ZERO)
                    .max(config.straggler_min);
                if now - t0 > expected {
                    observed.slow.insert((*task, *shard, *epoch));
                }
            }
            let plan = self.consensus.read_local(move |s| plan(s, &observed));
            self.carry_out(plan, &mut in_flight, &done_tx);
        }
    }

    fn carry_out(
        &self,
        plan: Plan,
        in_flight: &mut HashSet<(TaskId, u32)>,
        done_tx: &tokio::sync::mpsc::UnboundedSender<(TaskId, u32)>,
    ) {
        // Each proposal in a `place{task shard node}` span, matching the workers'
        // `shard{task shard epoch}` spans.
        let mut commands: Vec<((TaskId, u32), Command, tracing::Span)> = Vec::new();
        for (task, shard, node) in plan.assign {
            commands.push((
                (task, shard),
                Command::AssignShard { task, shard, node },
                tracing::info_span!("place", %task, shard, node = %format_args!("{node:x}")),
            ));
        }
        for (task, shard, epoch, node, reason) in plan.reassign {
            let span = tracing::info_span!(
                "place", %task, shard, node = %format_args!("{node:x}"), from_epoch = epoch, %reason
            );
            commands.push((
                (task, shard),
                Command::ReassignShard {
                    task,
                    shard,
                    epoch,
                    node,
                    reason,
                },
                span,
            ));
        }
        // One proposal per shard at a time; the rest wait for the next pass.
        for (key, command, span) in commands {
            if !in_flight.insert(key) {
                continue;
            }
            let consensus = self.consensus.clone();
            let done = done_tx.clone();
            tokio::spawn(
                async move {
                    match consensus.propose(command).await {
                        Ok(_) => tracing::debug!("placement committed"),
                        Err(e) => tracing::debug!(error = %e, "placement not committed"),
                    }
                    let _ = done.send(key);
                }
                .instrument(span),
            );
        }
        for (task, shard) in plan.verify {
            if !in_flight.insert((task, shard)) {
                continue;
            }
            let consensus = self.consensus.clone();
            let (blobs, peers) = (self.blobs.clone(), self.peers.clone());
            let done = done_tx.clone();
            tokio::spawn(async move {
                match verdict(&consensus, &blobs, &peers, task, shard).await {
                    Ok(agreeing) => {
                        let _ = consensus
                            .propose(Command::ShardVerdict {
                                task,
                                shard,
                                agreeing,
                            })
                            .await;
                    }
                    Err(e) => {
                        tracing::warn!(%task, shard, "could not compare replica outputs: {e}")
                    }
                }
                let _ = done.send((task, shard));
            });
        }
        // A merge is keyed by a shard number no shard has.
        for task in plan.merge {
            if !in_flight.insert((task, u32::MAX)) {
                continue;
            }
            let consensus = self.consensus.clone();
            let (blobs, peers) = (self.blobs.clone(), self.peers.clone());
            let done = done_tx.clone();
            tokio::spawn(
                async move {
                    if let Err(e) =
                        crate::outputs::merge_and_record(&consensus, &blobs, &peers, task).await
                    {
                        tracing::warn!("could not merge yet: {e}");
                    }
                    let _ = done.send((task, u32::MAX));
                }
                .instrument(tracing::info_span!("merge", %task)),
            );
        }
        for (task, reason) in plan.cancel {
            let consensus = self.consensus.clone();
            tokio::spawn(async move {
                let _ = consensus
                    .propose(Command::TaskCancelled { task, reason })
                    .await;
            });
        }
    }
}

fn median(d: &[Duration]) -> Option<Duration> {
    let mut v = d.to_vec();
    v.sort();
    v.get(v.len() / 2).copied()
}

/// Pulls the outputs reported for a shard and returns the epochs of the largest
/// group that agree under the task's tolerance.
async fn verdict(
    consensus: &ConsensusHandle,
    blobs: &BlobsHandle,
    peers: &PeersHandle,
    task: TaskId,
    shard: u32,
) -> Result<Vec<u32>, String> {
    let found = consensus.read_local(move |s| s.task(task).cloned());
    let Some(t) = found else {
        return Err("the task is gone".into());
    };
    let reports = t
        .shards
        .get(shard as usize)
        .ok_or("the shard is gone")?
        .reports
        .clone();
    let mut outputs = Vec::new();
    for r in &reports {
        let bytes = blobs
            .pull(r.blob, peers.peer(r.node))
            .await
            .map_err(|e| e.to_string())?;
        outputs.push((
            r.epoch,
            gpumesh_protocol::ShardChanges::decode(&bytes).map_err(|e| e.to_string())?,
        ));
    }
    // Replicas that changed different words are compared over whole buffers.
    let starts = crate::outputs::starts(blobs, &t)
        .await
        .map_err(|e| e.to_string())?;
    let bases: BTreeMap<u32, gpumesh_protocol::Base<'_>> =
        gpumesh_shaders::merge::targets(&t.spec, |b| starts.get(&b).map(Vec::as_slice))
            .into_iter()
            .map(|(b, target)| (b, target.base))
            .collect();
    let tolerance = t.spec.options.tolerance;
    let agree = |a: &gpumesh_protocol::ShardChanges, b: &gpumesh_protocol::ShardChanges| {
        a.agrees(b, tolerance, &bases)
    };
    let mut best: Vec<u32> = Vec::new();
    for (i, (_, a)) in outputs.iter().enumerate() {
        let group: Vec<u32> = outputs
            .iter()
            .enumerate()
            .filter(|(j, (_, b))| *j == i || agree(a, b))
            .map(|(_, (e, _))| *e)
            .collect();
        if group.len() > best.len() {
            best = group;
        }
    }
    Ok(best)
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Largest buffer a task binds.
fn largest_binding(spec: &TaskSpec) -> u64 {
    spec.bindings
        .iter()
        .map(|b| b.role.size())
        .max()
        .unwrap_or(0)
}

/// A worker the scheduler may place on.
struct Worker {
    node: u64,
    gflops: f64,
    fits: u64,
    /// Adapter and backend, so replicas can go to different hardware.
    kind: (String, String),
}

/// Nodes already holding or having reported the shard, and their hardware.
fn taken(s: &StateMachine, sh: &Shard) -> (BTreeSet<u64>, Vec<(String, String)>) {
    let nodes: BTreeSet<u64> = sh
        .attempts
        .iter()
        .map(|a| a.node)
        .chain(sh.reports.iter().map(|r| r.node))
        .collect();
    let kinds = nodes
        .iter()
        .filter_map(|n| s.member(*n)?.capability.as_ref())
        .map(|c| (c.adapter_name.clone(), c.backend.name().to_string()))
        .collect();
    (nodes, kinds)
}

/// One scheduling pass over the replicated state and what the leader observed
/// (pure, so it is tested directly).
pub fn plan(s: &StateMachine, observed: &Observed) -> Plan {
    let mut load = s.queue_by_node();
    let workers: Vec<Worker> = s
        .members()
        .values()
        .filter(|m| !observed.down.contains(&m.raft_id))
        .filter_map(|m| {
            let cap = m.capability.as_ref()?;
            let fits = u64::from(cap.limits.max_storage_buffer_binding_size)
                .min(cap.limits.max_buffer_size);
            Some(Worker {
                node: m.raft_id,
                gflops: cap.gflops.max(0.1),
                fits,
                kind: (cap.adapter_name.clone(), cap.backend.name().to_string()),
            })
        })
        .collect();
    let mut out = Plan::default();
    for t in s.active_tasks() {
        if t.status == gpumesh_consensus::TaskStatus::Merging {
            out.merge.push(t.id);
            continue;
        }
        let need = largest_binding(&t.spec);
        for (i, sh) in t.shards.iter().enumerate() {
            let i = i as u32;
            // A shard that failed too often has already failed its task in the
            // record (the state machine owns that limit); such a task is not active.
            match sh.state {
                ShardState::Done => continue,
                ShardState::Verifying => {
                    if t.spec.options.tolerance.is_some() {
                        out.verify.push((t.id, i));
                    }
                    continue;
                }
                _ => {}
            }
            let (mut holders, mut kinds) = taken(s, sh);
            let mut pick = |holders: &BTreeSet<u64>, kinds: &[(String, String)]| {
                let best = workers
                    .iter()
                    .filter(|w| w.fits >= need && !holders.contains(&w.node))
                    .min_by(|a, b| {
                        let score = |w: &Worker| {
                            // Same hardware as an existing replica counts as busier.
                            let same = kinds.contains(&w.kind) as u32 * 1000;
                            f64::from(load.get(&w.node).copied().unwrap_or(0) + 1 + same) / w.gflops
                        };
                        score(a).total_cmp(&score(b))
                    })?;
                *load.entry(best.node).or_default() += 1;
                Some((best.node, best.kind.clone()))
            };
            // Attempts on nodes that are gone or down move elsewhere.
            for a in &sh.attempts {
                let why = if s.member(a.node).is_none() {
                    "the node left the mesh"
                } else if observed.down.contains(&a.node) {
                    "the node stopped answering"
                } else {
                    continue;
                };
                if let Some((node, kind)) = pick(&holders, &kinds) {
                    holders.insert(node);
                    kinds.push(kind);
                    out.reassign.push((t.id, i, a.epoch, node, why.into()));
                }
            }
            for _ in 0..sh.wanted() {
                if let Some((node, kind)) = pick(&holders, &kinds) {
                    holders.insert(node);
                    kinds.push(kind);
                    out.assign.push((t.id, i, node));
                }
            }
            // A straggler gets one speculative copy on another node.
            let slow = sh
                .attempts
                .iter()
                .any(|a| observed.slow.contains(&(t.id, i, a.epoch)));
            let copies = sh.attempts.iter().filter(|a| a.speculative).count();
            if slow && copies == 0 && sh.wanted() == 0 {
                if let Some((node, _)) = pick(&holders, &kinds) {
                    out.assign.push((t.id, i, node));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use gpumesh_consensus::{ClusterSettings, Command, LogEntry, RequestId, StateMachine};
    use gpumesh_protocol::{AdapterLimits, BackendKind, DeviceKind, NodeCapability};
    use gpumesh_shaders::builtins;

    use super::*;

    fn capability(gflops: f64, max_binding: u32) -> NodeCapability {
        NodeCapability {
            adapter_name: "test".into(),
            vendor: 0,
            backend: BackendKind::Vulkan,
            device_kind: DeviceKind::Cpu,
            driver: String::new(),
            limits: AdapterLimits {
                max_buffer_size: 1 << 30,
                max_storage_buffer_binding_size: max_binding,
                max_uniform_buffer_binding_size: 1 << 16,
                max_storage_buffers_per_shader_stage: 8,
                max_compute_workgroups_per_dimension: 65535,
                max_compute_invocations_per_workgroup: 256,
                max_compute_workgroup_size: [256, 256, 64],
                max_compute_workgroup_storage_size: 16384,
            },
            gflops,
            gbps: 1.0,
        }
    }

    /// Applies `command` as the next log entry.
    fn apply(s: &mut StateMachine, command: Command) {
        let index = s.applied_index() + 1;
        let entry = LogEntry {
            origin: 1,
            request_id: RequestId::new(1, index),
            command,
        };
        s.apply(index, 1, &entry);
    }

    /// A mesh of nodes 1..=n with the given capabilities (None: no adapter).
    fn state(caps: &[Option<NodeCapability>], shards: u32) -> StateMachine {
        let founders: Vec<(u64, String)> = (1..=caps.len() as u64)
            .map(|i| (i, format!("peer-{i}")))
            .collect();
        let mut s = StateMachine::bootstrap(&founders, ClusterSettings { max_voters: 5 });
        for (i, cap) in caps.iter().enumerate() {
            if let Some(c) = cap {
                apply(
                    &mut s,
                    Command::NodeCapabilities {
                        raft_id: i as u64 + 1,
                        capability: c.clone(),
                    },
                );
            }
        }
        let problem = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 64)
            .unwrap();
        apply(
            &mut s,
            Command::SubmitTask {
                spec: problem.spec(shards),
                submitter: "peer-1".into(),
            },
        );
        s
    }

    fn per_node(plan: &Plan) -> BTreeMap<u64, usize> {
        let mut m = BTreeMap::new();
        for (_, _, node) in &plan.assign {
            *m.entry(*node).or_default() += 1;
        }
        m
    }

    #[test]
    fn shards_are_placed_in_proportion_to_measured_speed() {
        let s = state(
            &[
                Some(capability(10.0, 1 << 27)),
                Some(capability(30.0, 1 << 27)),
            ],
            8,
        );
        let plan = plan(&s, &Observed::default());
        assert_eq!(plan.assign.len(), 8);
        assert_eq!(per_node(&plan), BTreeMap::from([(1, 2), (2, 6)]));
    }

    #[test]
    fn nodes_without_an_adapter_or_room_get_nothing() {
        // Node 2 has no adapter; node 3's buffers are too small for the 64 KiB inputs.
        let s = state(
            &[
                Some(capability(5.0, 1 << 27)),
                None,
                Some(capability(500.0, 1024)),
            ],
            6,
        );
        let plan = plan(&s, &Observed::default());
        assert_eq!(per_node(&plan), BTreeMap::from([(1, 6)]));
    }

    #[test]
    fn shards_of_a_node_that_left_are_placed_again() {
        let mut s = state(
            &[
                Some(capability(10.0, 1 << 27)),
                Some(capability(10.0, 1 << 27)),
            ],
            4,
        );
        let task = *s.tasks().keys().next().unwrap();
        for shard in 0..4 {
            apply(
                &mut s,
                Command::AssignShard {
                    task,
                    shard,
                    node: 2,
                },
            );
        }
        assert!(
            plan(&s, &Observed::default()).assign.is_empty(),
            "nothing to place while node 2 works"
        );
        // Declared down by the leader: its attempts move, under new epochs.
        let down = Observed {
            down: BTreeSet::from([2]),
            ..Observed::default()
        };
        let moved = plan(&s, &down);
        assert!(moved.assign.is_empty(), "{moved:?}");
        assert_eq!(moved.reassign.len(), 4, "{moved:?}");
        assert!(moved
            .reassign
            .iter()
            .all(|(_, _, epoch, node, why)| *epoch == 1
                && *node == 1
                && why.contains("answering")));
        apply(&mut s, Command::NodeLeft { raft_id: 2 });
        let again = plan(&s, &Observed::default());
        assert_eq!(again.reassign.len(), 4, "{again:?}");
        assert!(again
            .reassign
            .iter()
            .all(|r| r.3 == 1 && r.4.contains("left")));
    }

    #[test]
    fn a_straggler_gets_one_speculative_copy_on_another_node() {
        let mut s = state(
            &[
                Some(capability(10.0, 1 << 27)),
                Some(capability(10.0, 1 << 27)),
            ],
            1,
        );
        let task = *s.tasks().keys().next().unwrap();
        apply(
            &mut s,
            Command::AssignShard {
                task,
                shard: 0,
                node: 1,
            },
        );
        let slow = Observed {
            slow: BTreeSet::from([(task, 0, 1)]),
            ..Observed::default()
        };
        let p = plan(&s, &slow);
        assert_eq!(p.assign, vec![(task, 0, 2)]);
        apply(
            &mut s,
            Command::AssignShard {
                task,
                shard: 0,
                node: 2,
            },
        );
        assert!(plan(&s, &slow).assign.is_empty(), "only one copy");
    }

    #[test]
    fn replicas_go_to_different_hardware_first() {
        let mut gl = capability(10.0, 1 << 27);
        gl.backend = BackendKind::Gl;
        gl.adapter_name = "other".into();
        let mut s = state(
            &[
                Some(capability(50.0, 1 << 27)),
                Some(capability(50.0, 1 << 27)),
                Some(gl),
            ],
            0,
        );
        let mut spec = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 64)
            .unwrap()
            .spec(1);
        spec.options.replicas = 2;
        apply(
            &mut s,
            Command::SubmitTask {
                spec,
                submitter: "peer-1".into(),
            },
        );
        let p = plan(&s, &Observed::default());
        let nodes: BTreeSet<u64> = p.assign.iter().map(|a| a.2).collect();
        assert_eq!(p.assign.len(), 2, "{p:?}");
        assert!(nodes.contains(&3), "the GL node gets one replica: {p:?}");
    }

    #[test]
    fn a_shard_that_keeps_failing_fails_its_task_and_is_not_placed_again() {
        let mut s = state(&[Some(capability(10.0, 1 << 27))], 2);
        let task = *s.tasks().keys().next().unwrap();
        for _ in 0..gpumesh_consensus::state::MAX_SHARD_ATTEMPTS {
            for command in [
                Command::AssignShard {
                    task,
                    shard: 0,
                    node: 1,
                },
                Command::ShardFailed {
                    task,
                    shard: 0,
                    epoch: s.task(task).unwrap().shards[0].epoch + 1,
                    node: 1,
                    reason: "device lost".into(),
                },
            ] {
                apply(&mut s, command);
            }
        }
        // The record failed the task with the last error, which is what the user
        // sees, and the scheduler has nothing left to do for it.
        match s.task(task).unwrap().status.clone() {
            gpumesh_consensus::TaskStatus::Failed(reason) => {
                assert!(reason.contains("device lost"), "{reason}");
            }
            other => panic!("the task should have failed, it is {other:?}"),
        }
        let plan = plan(&s, &Observed::default());
        assert_eq!(plan, Plan::default(), "{plan:?}");
    }
}
