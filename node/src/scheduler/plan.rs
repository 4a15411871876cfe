//! Placement: what the leader proposes next, from the record and what it has seen
//! for itself. A pure function of both, so it is tested without a mesh.

use std::collections::{BTreeMap, BTreeSet};

use gpumesh_consensus::{
    candidates, pick, Candidate, Need, Shard, ShardState, StateMachine, TaskId,
};

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
    /// Shards whose replica outputs wait for a float comparison.
    pub verify: Vec<(TaskId, u32)>,
    /// Tasks whose shards all have results, waiting to be merged.
    pub merge: Vec<TaskId>,
    /// (actor, its epoch, node, why): a first host, or a move off a lost one.
    pub place_actors: Vec<(String, u32, u64, String)>,
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
    // Each node's queue, counted the first time a shard wants a node: most passes
    // find every active task placed and need none.
    let mut load: Option<BTreeMap<u64, u32>> = None;
    let workers = candidates(s, &observed.down);
    let mut out = Plan::default();
    for t in s.active_tasks() {
        if t.status == gpumesh_consensus::TaskStatus::Merging {
            out.merge.push(t.id);
            continue;
        }
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
            // Attempts on nodes that are gone or down move elsewhere.
            let lost: Vec<(u32, &str)> = sh
                .attempts
                .iter()
                .filter_map(|a| {
                    if s.member(a.node).is_none() {
                        Some((a.epoch, "the node left the mesh"))
                    } else if observed.down.contains(&a.node) {
                        Some((a.epoch, "the node stopped answering"))
                    } else {
                        None
                    }
                })
                .collect();
            // A straggler gets one speculative copy on another node.
            let slow = !observed.slow.is_empty()
                && sh
                    .attempts
                    .iter()
                    .any(|a| observed.slow.contains(&(t.id, i, a.epoch)));
            let speculate = slow && sh.wanted() == 0 && !sh.attempts.iter().any(|a| a.speculative);
            if lost.is_empty() && sh.wanted() == 0 && !speculate {
                continue; // placed and running: nothing to decide
            }
            let need = Need::of(t);
            let load = load.get_or_insert_with(|| s.queue_by_node());
            let (mut holders, mut kinds) = taken(s, sh);
            // Away from the nodes where it failed while any other can take it.
            let mut choose = |holders: &BTreeSet<u64>, kinds: &[(String, String)]| {
                let elsewhere: BTreeSet<u64> =
                    holders.iter().chain(&sh.failed_on).copied().collect();
                pick(&workers, load, &need, &elsewhere, kinds, None)
                    .or_else(|| pick(&workers, load, &need, holders, kinds, None))
            };
            for (epoch, why) in lost {
                if let Some((node, kind)) = choose(&holders, &kinds) {
                    holders.insert(node);
                    kinds.push(kind);
                    out.reassign.push((t.id, i, epoch, node, why.into()));
                }
            }
            for _ in 0..sh.wanted() {
                if let Some((node, kind)) = choose(&holders, &kinds) {
                    holders.insert(node);
                    kinds.push(kind);
                    out.assign.push((t.id, i, node));
                }
            }
            if speculate {
                if let Some((node, _)) = choose(&holders, &kinds) {
                    out.assign.push((t.id, i, node));
                }
            }
        }
    }
    place_actors(s, observed, &workers, load, &mut out);
    out
}

/// GPU actors without a host, or whose host is gone or down: a first host, or the
/// node that kept the second copy of the state when it can take it, else the least
/// loaded by measured speed; on the actor's backend when it names one, and on a node
/// whose GPU memory left (its budget less the state of the actors it hosts) holds
/// the state, if any has that much (else the state is uploaded for each call).
fn place_actors(
    s: &StateMachine,
    observed: &Observed,
    workers: &[Candidate],
    load: Option<BTreeMap<u64, u32>>,
    out: &mut Plan,
) {
    // Nothing to place (the usual pass): every host named is a member not down.
    let lost = |host: Option<u64>| {
        host.is_none_or(|h| s.member(h).is_none() || observed.down.contains(&h))
    };
    if !s.actor_hosts().any(|(host, _)| lost(host)) {
        return;
    }
    let mut load = load.unwrap_or_else(|| s.queue_by_node());
    let bytes = |a: &gpumesh_consensus::Actor| a.state.iter().map(|st| st.buffer.size).sum::<u64>();
    let mut used: BTreeMap<u64, u64> = BTreeMap::new();
    for a in s.actors() {
        if let Some(host) = a.host {
            *load.entry(host).or_default() += 1;
            *used.entry(host).or_default() += bytes(a);
        }
    }
    for a in s.actors() {
        let why = match a.host {
            None => "placed",
            Some(h) if s.member(h).is_none() => "the host left the mesh",
            Some(h) if observed.down.contains(&h) => "the host stopped answering",
            Some(_) => continue,
        };
        let need = a.state.iter().map(|st| st.buffer.size).max().unwrap_or(0);
        let eligible: Vec<&Candidate> = workers
            .iter()
            .filter(|w| {
                w.fits >= need && a.backend.is_none_or(|b| b == w.backend) && Some(w.node) != a.host
            })
            .collect();
        let room = |w: &&&Candidate| {
            w.memory
                .saturating_sub(used.get(&w.node).copied().unwrap_or(0))
                >= bytes(a)
        };
        let candidates: Vec<&Candidate> = if eligible.iter().any(|w| room(&w)) {
            eligible.iter().filter(room).copied().collect()
        } else {
            eligible
        };
        let backup = a
            .backup
            .and_then(|b| candidates.iter().find(|w| w.node == b));
        let best = backup.or_else(|| {
            candidates.iter().min_by(|x, y| {
                let score = |w: &Candidate| {
                    f64::from(load.get(&w.node).copied().unwrap_or(0) + 1) / w.gflops
                };
                score(x).total_cmp(&score(y))
            })
        });
        if let Some(w) = best {
            *load.entry(w.node).or_default() += 1;
            *used.entry(w.node).or_default() += bytes(a);
            out.place_actors
                .push((a.name.clone(), a.epoch, w.node, why.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use gpumesh_consensus::{ClusterSettings, Command, LogEntry, RequestId, StateMachine};
    use gpumesh_protocol::{AdapterLimits, BackendKind, DeviceKind, KernelNeeds, NodeCapability};
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
            memory: 512 << 20,
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
        // Submitted before any member reports an adapter: nothing is placed at
        // submit, so the scheduler's pass is what these tests see.
        let problem = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 64)
            .unwrap();
        apply(
            &mut s,
            Command::SubmitTask {
                spec: problem.spec(shards),
                submitter: "peer-1".into(),
                needs: None,
            },
        );
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
        s
    }

    fn per_node(plan: &Plan) -> BTreeMap<u64, usize> {
        let mut m = BTreeMap::new();
        for (_, _, node) in &plan.assign {
            *m.entry(*node).or_default() += 1;
        }
        m
    }

    fn actor(name: &str, backend: Option<BackendKind>) -> Command {
        actor_of(name, backend, 1024)
    }

    fn actor_of(name: &str, backend: Option<BackendKind>, size: u64) -> Command {
        Command::CreateActor {
            name: name.into(),
            state: vec![gpumesh_consensus::ActorState {
                buffer: gpumesh_protocol::StateBuffer { binding: 0, size },
                blob: None,
            }],
            backend,
            creator: "peer-1".into(),
        }
    }

    #[test]
    fn an_actor_is_placed_on_its_backend_and_moves_to_its_backup_when_the_host_is_down() {
        let mut gl = capability(50.0, 1 << 27);
        gl.backend = BackendKind::Gl;
        let mut s = state(
            &[
                Some(capability(10.0, 1 << 27)),
                Some(gl),
                Some(capability(20.0, 1 << 27)),
            ],
            1,
        );
        apply(&mut s, actor("on-gl", Some(BackendKind::Gl)));
        apply(&mut s, actor("any", None));
        let first = plan(&s, &Observed::default());
        let placed: BTreeMap<&str, u64> = first
            .place_actors
            .iter()
            .map(|(name, epoch, node, _)| {
                assert_eq!(*epoch, 0);
                (name.as_str(), *node)
            })
            .collect();
        assert_eq!(placed["on-gl"], 2, "the only GL node");
        // (hosted + 1) / GFLOP/s: node 2 at 2/50 beats node 3 at 1/20 and node 1.
        assert_eq!(placed["any"], 2, "by load over measured speed");

        // Hosted on node 3 with node 1 keeping the copy; node 3 goes down.
        apply(
            &mut s,
            Command::PlaceActor {
                name: "any".into(),
                epoch: 0,
                node: 3,
                reason: "test".into(),
            },
        );
        apply(
            &mut s,
            Command::CallActor {
                name: "any".into(),
                call: gpumesh_protocol::ActorCall {
                    shader: gpumesh_protocol::ShaderSource::Wgsl(String::new()),
                    entry_point: "main".into(),
                    bindings: vec![],
                    grid: gpumesh_protocol::Grid([1, 1, 1]),
                    deadline_ms: None,
                },
                caller: "peer-1".into(),
            },
        );
        apply(
            &mut s,
            Command::ActorCallDone {
                name: "any".into(),
                seq: 1,
                epoch: 1,
                node: 3,
                state: vec![(0, gpumesh_protocol::BlobId::of(b"v1"))],
                backup: 1,
                outputs: vec![],
            },
        );
        let mut observed = Observed::default();
        observed.down.insert(3);
        let moves: Vec<_> = plan(&s, &observed)
            .place_actors
            .into_iter()
            .filter(|(name, ..)| name == "any")
            .collect();
        assert_eq!(
            moves,
            vec![("any".into(), 1, 1, "the host stopped answering".into())],
            "to the backup, which holds the state"
        );
    }

    #[test]
    fn an_actor_goes_where_its_state_fits_in_the_gpu_memory_left() {
        // Node 1 is fast with 8 MiB; node 2 slow with 64 MiB.
        let mut small = capability(100.0, 1 << 27);
        small.memory = 8 << 20;
        let mut slow = capability(1.0, 1 << 27);
        slow.memory = 64 << 20;
        let mut s = state(&[Some(small), Some(slow)], 1);
        apply(&mut s, actor_of("first", None, 6 << 20));
        apply(&mut s, actor_of("second", None, 6 << 20));
        apply(&mut s, actor_of("tiny", None, 1 << 20));
        let placed: BTreeMap<String, u64> = plan(&s, &Observed::default())
            .place_actors
            .into_iter()
            .map(|(name, _, node, _)| (name, node))
            .collect();
        assert_eq!(placed["first"], 1, "the fast node has room for the first");
        assert_eq!(
            placed["second"], 2,
            "6 + 6 MiB is more than the fast node's 8"
        );
        assert_eq!(placed["tiny"], 1, "1 MiB still fits beside the first");

        // Nowhere has room for 100 MiB: it still goes somewhere (uploaded per call).
        apply(&mut s, actor_of("huge", None, 100 << 20));
        let huge = plan(&s, &Observed::default())
            .place_actors
            .into_iter()
            .filter(|(name, ..)| name == "huge")
            .count();
        assert_eq!(huge, 1);
    }

    #[test]
    fn a_task_submitted_to_a_mesh_with_adapters_is_placed_as_it_is_applied() {
        // The same rule at submit: by speed, never on the node that is down.
        let mut s = state(
            &[
                Some(capability(10.0, 1 << 27)),
                Some(capability(30.0, 1 << 27)),
                Some(capability(30.0, 1 << 27)),
            ],
            1,
        );
        apply(&mut s, Command::MembersDown { down: vec![3] });
        let problem = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 64)
            .unwrap();
        apply(
            &mut s,
            Command::SubmitTask {
                spec: problem.spec(8),
                submitter: "peer-1".into(),
                needs: None,
            },
        );
        let placed = s.tasks().last().unwrap();
        let mut per_node: BTreeMap<u64, usize> = BTreeMap::new();
        for sh in &placed.shards {
            assert_eq!(sh.attempts.len(), 1, "each shard placed once");
            *per_node.entry(sh.attempts[0].node).or_default() += 1;
        }
        assert_eq!(per_node.get(&3), None, "nothing on the node that is down");
        assert_eq!(per_node.values().sum::<usize>(), 8);
        assert!(per_node[&2] >= 3 * per_node[&1].max(1) - 1, "{per_node:?}");
        // Nothing of it is left for the scheduler to place.
        let new = placed.id;
        let later = plan(&s, &Observed::default());
        assert!(later.assign.iter().all(|a| a.0 != new), "{later:?}");
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
        let task = s.tasks().next().unwrap().id;
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
        let task = s.tasks().next().unwrap().id;
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
                needs: None,
            },
        );
        // Placed as the submit is applied, by the same rule the scheduler uses.
        let t = s.tasks().last().unwrap();
        let nodes: BTreeSet<u64> = t.shards[0].attempts.iter().map(|a| a.node).collect();
        assert_eq!(nodes.len(), 2, "{:?}", t.shards[0]);
        assert!(
            nodes.contains(&3),
            "the GL node gets one replica: {nodes:?}"
        );
    }

    #[test]
    fn shards_go_only_to_adapters_with_room_for_their_kernels_workgroup() {
        // Node 1 is ten times faster but has 16 KiB of workgroup memory; node 2 has
        // 32 KiB and takes 1,024 invocations a workgroup.
        let mut big = capability(10.0, 1 << 27);
        big.limits.max_compute_workgroup_storage_size = 32 << 10;
        big.limits.max_compute_invocations_per_workgroup = 1024;
        big.limits.max_compute_workgroup_size = [1024, 1024, 64];
        let founders = vec![(1, "peer-1".to_string()), (2, "peer-2".to_string())];
        let mut s = StateMachine::bootstrap(&founders, ClusterSettings { max_voters: 5 });
        for (node, cap) in [(1, capability(100.0, 1 << 27)), (2, big)] {
            apply(
                &mut s,
                Command::NodeCapabilities {
                    raft_id: node,
                    capability: cap,
                },
            );
        }
        let problem = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 64)
            .unwrap();
        let submit = |s: &mut StateMachine, needs: KernelNeeds| {
            apply(
                s,
                Command::SubmitTask {
                    spec: problem.spec(4),
                    submitter: "peer-1".into(),
                    needs: Some(needs),
                },
            );
            s.tasks().last().unwrap().clone()
        };
        let nodes = |t: &gpumesh_consensus::Task| -> BTreeSet<u64> {
            t.shards
                .iter()
                .flat_map(|sh| sh.attempts.iter().map(|a| a.node))
                .collect()
        };
        // 20,000 bytes of workgroup memory, then 512 invocations: node 2 alone,
        // placed as the submit is applied.
        for needs in [
            KernelNeeds {
                workgroup_size: [64, 1, 1],
                workgroup_memory: 20_000,
            },
            KernelNeeds {
                workgroup_size: [512, 1, 1],
                workgroup_memory: 0,
            },
        ] {
            let t = submit(&mut s, needs);
            assert_eq!(nodes(&t), BTreeSet::from([2]), "{needs:?}");
        }
        // What fits both spreads over both (by load over speed).
        let t = submit(&mut s, KernelNeeds::default());
        assert!(nodes(&t).contains(&1), "{:?}", nodes(&t));
        // What fits neither waits unplaced, and the scheduler places none of it.
        let t = submit(
            &mut s,
            KernelNeeds {
                workgroup_size: [64, 1, 1],
                workgroup_memory: 40_000,
            },
        );
        assert!(nodes(&t).is_empty());
        let later = plan(&s, &Observed::default());
        assert!(
            later.assign.iter().all(|(task, _, _)| *task != t.id),
            "{later:?}"
        );
    }

    #[test]
    fn a_failed_shard_is_retried_on_another_node_while_there_is_one() {
        // Node 1 is ten times faster: by load over speed it would take every try.
        let mut s = state(
            &[
                Some(capability(100.0, 1 << 27)),
                Some(capability(10.0, 1 << 27)),
            ],
            1,
        );
        let task = s.tasks().next().unwrap().id;
        let fail_on = |s: &mut StateMachine, node: u64| {
            let placed = plan(s, &Observed::default());
            assert_eq!(placed.assign, vec![(task, 0, node)], "{placed:?}");
            apply(
                s,
                Command::AssignShard {
                    task,
                    shard: 0,
                    node,
                },
            );
            let epoch = s.task(task).unwrap().shards[0].epoch;
            apply(
                s,
                Command::ShardFailed {
                    task,
                    shard: 0,
                    epoch,
                    node,
                    reason: "workgroup memory in bytes is 20000, over the adapter limit".into(),
                },
            );
        };
        fail_on(&mut s, 1);
        // Then on the slower node; failed on both, on the faster again.
        fail_on(&mut s, 2);
        let placed = plan(&s, &Observed::default());
        assert_eq!(placed.assign, vec![(task, 0, 1)], "{placed:?}");
    }

    #[test]
    fn a_shard_that_keeps_failing_fails_its_task_and_is_not_placed_again() {
        let mut s = state(&[Some(capability(10.0, 1 << 27))], 2);
        let task = s.tasks().next().unwrap().id;
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
