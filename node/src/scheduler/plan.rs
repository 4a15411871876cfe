//! Placement: what the leader proposes next, from the record and what it has seen
//! for itself. A pure function of both, so it is tested without a mesh.

use std::collections::BTreeSet;

use gpumesh_consensus::{Shard, ShardState, StateMachine, TaskId};
use gpumesh_protocol::TaskSpec;

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
    use std::collections::BTreeMap;

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
