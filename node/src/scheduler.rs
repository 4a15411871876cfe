//! The scheduler: on the Raft leader only, turns pending shards into assignments.
//!
//! Each pending shard goes to the member that minimises (shards queued + 1) / measured
//! GFLOP/s among those whose adapter limits fit the task's buffers, so placement is
//! proportional to capability and current queue. Members without an adapter stay in
//! the mesh and get nothing; shards of a node that left are placed again. A shard that failed `MAX_FAILURES` times cancels its task
//! with the last error. Talks to: raft (reads state, proposes).

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpumesh_consensus::{Command, ConsensusHandle, RaftRole, ShardState, StateMachine, TaskId};
use gpumesh_protocol::{BindingRole, TaskSpec};
use tokio_util::sync::CancellationToken;

/// Failures of one shard before its task is cancelled.
pub const MAX_FAILURES: u32 = 3;
/// A member whose last heartbeat is older than this gets no new shards.
pub const STALE_AFTER: Duration = Duration::from_secs(15);

pub struct Scheduler {
    pub consensus: ConsensusHandle,
    pub interval: Duration,
}

/// What the scheduler decided in one pass.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub assign: Vec<(TaskId, u32, u64)>,
    pub cancel: Vec<(TaskId, String)>,
}

impl Scheduler {
    pub async fn run(self, cancel: CancellationToken) {
        let mut events = self.consensus.subscribe();
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Assignments proposed but not yet applied, so a pass does not repeat them.
        let mut in_flight: HashSet<(TaskId, u32)> = HashSet::new();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                Some(key) = done_rx.recv() => { in_flight.remove(&key); continue; }
                _ = events.recv() => {}
                _ = tick.tick() => {}
            }
            if self.consensus.watch_status().borrow().role != RaftRole::Leader {
                in_flight.clear();
                continue;
            }
            let now = now_ms();
            let Ok(plan) = self.consensus.read_local(move |s| plan(s, now)).await else {
                continue;
            };
            for (task, shard, node) in plan.assign {
                if !in_flight.insert((task, shard)) {
                    continue;
                }
                let consensus = self.consensus.clone();
                let done = done_tx.clone();
                tokio::spawn(async move {
                    if let Err(e) = consensus
                        .propose(Command::AssignShard { task, shard, node })
                        .await
                    {
                        tracing::debug!(error = %e, %task, shard, "assignment not committed");
                    }
                    let _ = done.send((task, shard));
                });
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
        .map(|b| match &b.role {
            BindingRole::Input { size, .. } | BindingRole::Output { size } => *size,
            BindingRole::Param { data } => data.len() as u64,
        })
        .max()
        .unwrap_or(0)
}

/// One scheduling pass over the replicated state (pure, so it is tested directly).
pub fn plan(s: &StateMachine, now_ms: u64) -> Plan {
    let mut load: BTreeMap<u64, u32> = BTreeMap::new();
    for t in s.active_tasks() {
        for sh in &t.shards {
            if let (Some(n), ShardState::Assigned | ShardState::Running) =
                (sh.assigned_to, sh.state)
            {
                *load.entry(n).or_default() += 1;
            }
        }
    }
    let workers: Vec<(u64, f64, u64)> = s
        .members()
        .values()
        .filter_map(|m| {
            let cap = m.capability.as_ref()?;
            let fresh = m
                .last_heartbeat
                .is_none_or(|h| now_ms.saturating_sub(h.at_ms) < STALE_AFTER.as_millis() as u64);
            let fits = u64::from(cap.limits.max_storage_buffer_binding_size)
                .min(cap.limits.max_buffer_size);
            fresh.then_some((m.raft_id, cap.gflops.max(0.1), fits))
        })
        .collect();
    let mut out = Plan::default();
    for t in s.active_tasks() {
        let need = largest_binding(&t.spec);
        for (i, sh) in t.shards.iter().enumerate() {
            if sh.failures >= MAX_FAILURES {
                out.cancel.push((
                    t.id,
                    format!(
                        "shard {i} failed {} times; last error: {}",
                        sh.failures,
                        sh.last_error.as_deref().unwrap_or("unknown")
                    ),
                ));
                break;
            }
            // Pending shards, and shards held by a node that has left the mesh (their
            // new epoch makes any late report from it stale).
            let orphaned = matches!(sh.state, ShardState::Assigned | ShardState::Running)
                && sh.assigned_to.is_some_and(|n| s.member(n).is_none());
            if sh.state != ShardState::Pending && !orphaned {
                continue;
            }
            let best = workers
                .iter()
                .filter(|(_, _, fits)| *fits >= need)
                .min_by(|a, b| {
                    let score = |w: &(u64, f64, u64)| {
                        f64::from(load.get(&w.0).copied().unwrap_or(0) + 1) / w.1
                    };
                    score(a).total_cmp(&score(b))
                });
            if let Some(&(node, _, _)) = best {
                *load.entry(node).or_default() += 1;
                out.assign.push((t.id, i as u32, node));
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
        let plan = plan(&s, now_ms());
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
        let plan = plan(&s, now_ms());
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
            plan(&s, now_ms()).assign.is_empty(),
            "nothing to place while node 2 works"
        );
        apply(&mut s, Command::NodeLeft { raft_id: 2 });
        let again = plan(&s, now_ms());
        assert_eq!(per_node(&again), BTreeMap::from([(1, 4)]), "{again:?}");
    }

    #[test]
    fn a_shard_that_keeps_failing_cancels_its_task() {
        let mut s = state(&[Some(capability(10.0, 1 << 27))], 2);
        let task = *s.tasks().keys().next().unwrap();
        for _ in 0..MAX_FAILURES {
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
        // Either the record already failed the task, or this pass cancels it;
        // either way the last error is what the user sees.
        let status = s.task(task).unwrap().status.clone();
        let plan = plan(&s, now_ms());
        match status {
            gpumesh_consensus::TaskStatus::Failed(reason) => {
                assert!(reason.contains("device lost"), "{reason}");
                assert!(plan.assign.is_empty() && plan.cancel.is_empty(), "{plan:?}");
            }
            other => {
                assert!(!other.is_terminal(), "{other:?}");
                assert_eq!(plan.cancel.len(), 1, "{plan:?}");
                assert!(plan.cancel[0].1.contains("device lost"), "{plan:?}");
            }
        }
    }
}
