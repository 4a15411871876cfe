//! GPU actors on real nodes (libp2p on loopback, Raft on redb, wgpu): calls from two
//! nodes run one at a time in the log's order on the actor's host, the state stays
//! there between calls, and every result matches a CPU replay of the same order.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{have_any, mesh, metric, runaway_stopped, stop, words, LIMIT, RUNAWAY, STEP};
use gpumesh::consensus::{Actor, ActorState, CallResult, Command, Outcome};
use gpumesh::node::MeshNode;
use gpumesh::protocol::{
    ActorCall, BindingRole, BindingSpec, BlobId, Grid, ShaderSource, StateBuffer,
};

/// A stepper's state: small enough for the record to hold it itself.
const WORDS: u32 = 256;
/// A stepper's state over the record's inline bound: kept as blobs on two nodes.
const BIG_WORDS: u32 = 8192;

/// A call of [`RUNAWAY`] over `groups` workgroups under a deadline of
/// `deadline_ms`: its stop flag (zero) at binding 1.
fn runaway_call(groups: u32, deadline_ms: u64) -> ActorCall {
    ActorCall {
        shader: ShaderSource::Wgsl(RUNAWAY.into()),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 1,
            role: BindingRole::Param { data: vec![0; 16] },
        }],
        grid: Grid([groups, 1, 1]),
        deadline_ms: Some(deadline_ms),
    }
}

fn step_call(add: u32) -> ActorCall {
    step_call_over(add, WORDS)
}

/// What [`step_call`]'s kernel does to the state, on the CPU.
fn cpu_step(state: &mut [u32], add: u32) {
    for (i, w) in state.iter_mut().enumerate() {
        *w = w.wrapping_mul(3).wrapping_add(add).wrapping_add(i as u32);
    }
}

/// A step of every word of a state of `words` words.
fn step_call_over(add: u32, words: u32) -> ActorCall {
    ActorCall {
        shader: ShaderSource::Wgsl(STEP.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 1,
                role: BindingRole::Param {
                    data: [add, 0, 0, 0]
                        .iter()
                        .flat_map(|w| w.to_le_bytes())
                        .collect(),
                },
            },
            BindingSpec {
                binding: 2,
                role: BindingRole::Output { size: 16 },
            },
        ],
        grid: Grid([words / 64, 1, 1]),
        deadline_ms: None,
    }
}

/// Creates, through `via`'s record, an actor of `WORDS` words of state, all zero.
async fn create_stepper(via: &MeshNode, name: &str) {
    create_stepper_of(via, name, WORDS).await;
}

/// Creates, through `via`'s record, an actor of `words` words of state, all zero.
async fn create_stepper_of(via: &MeshNode, name: &str, words: u32) {
    let created = via
        .consensus
        .propose(Command::CreateActor {
            name: name.into(),
            state: vec![ActorState {
                buffer: StateBuffer {
                    binding: 0,
                    size: u64::from(words) * 4,
                },
                blob: None,
            }],
            backend: None,
            creator: via.peer_id.to_string(),
        })
        .await
        .unwrap();
    assert_eq!(created.outcome, Outcome::Applied);
}

/// Reads blob `id` from whichever node holds it.
fn blob(nodes: &[MeshNode], id: BlobId) -> Vec<u8> {
    nodes
        .iter()
        .find_map(|n| n.blobs.get(&id).ok().flatten())
        .unwrap_or_else(|| panic!("no node holds blob {id}"))
}

/// Proposes `calls` to actor `name` all at once, call `i` through node `i % 3`, so
/// that they wait together on its host; returns each call's place in the actor's
/// order.
async fn call_all_at_once(nodes: &[MeshNode], name: &str, calls: Vec<ActorCall>) -> Vec<u64> {
    let mut pending = Vec::new();
    for (i, call) in calls.into_iter().enumerate() {
        let via = &nodes[i % nodes.len()];
        let (consensus, caller) = (via.consensus.clone(), via.peer_id.to_string());
        let name = name.to_string();
        pending.push(tokio::spawn(async move {
            let c = consensus
                .propose(Command::CallActor { name, call, caller })
                .await
                .unwrap();
            match c.outcome {
                Outcome::CallQueued { seq } => seq,
                other => panic!("{other:?}"),
            }
        }));
    }
    let mut seqs = Vec::new();
    for p in pending {
        seqs.push(p.await.unwrap());
    }
    seqs
}

/// Actor `name` as `reader` has it once `n` of its calls have results.
async fn with_results(reader: &MeshNode, name: &str, n: usize) -> Actor {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        // A follower may not have applied the actor's creation yet.
        match reader.consensus.read_local(|s| s.actor(name).cloned()) {
            Some(a) if a.results.len() == n => return a,
            a => assert!(
                tokio::time::Instant::now() < deadline,
                "not all done: {a:#?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_from_two_nodes_run_in_log_order_on_the_host_and_match_the_cpu() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        // A state over the record's inline bound: stored on the host and a backup.
        create_stepper_of(&nodes[0], "stepper", BIG_WORDS).await;

        // Calls through two nodes, several in flight at once.
        let mut calls = Vec::new();
        for (i, add) in [7u32, 1, 20, 3, 11, 5].into_iter().enumerate() {
            let via = &nodes[i % 2];
            let consensus = via.consensus.clone();
            let caller = via.peer_id.to_string();
            calls.push(tokio::spawn(async move {
                let c = consensus
                    .propose(Command::CallActor {
                        name: "stepper".into(),
                        call: step_call_over(add, BIG_WORDS),
                        caller,
                    })
                    .await
                    .unwrap();
                match c.outcome {
                    Outcome::CallQueued { seq } => (seq, add),
                    other => panic!("{other:?}"),
                }
            }));
        }
        let mut by_seq = BTreeMap::new();
        for c in calls {
            let (seq, add) = c.await.unwrap();
            by_seq.insert(seq, add);
        }
        assert_eq!(
            by_seq.keys().copied().collect::<Vec<_>>(),
            (1..=6).collect::<Vec<_>>()
        );

        // Every call ran, read from a node that is not the one most calls came through.
        let reader = &nodes[2].consensus;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let actor = loop {
            // A follower may not have applied the actor's creation yet.
            match reader.read_local(|s| s.actor("stepper").cloned()) {
                Some(a) if a.results.len() == 6 => break a,
                a => assert!(
                    tokio::time::Instant::now() < deadline,
                    "calls not all done: {a:#?}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(actor.version, 6);
        assert!(actor.host.is_some() && actor.backup.is_some() && actor.backup != actor.host);

        // Replayed on the CPU in sequence order.
        let mut cpu = vec![0u32; BIG_WORDS as usize];
        for (seq, add) in &by_seq {
            let before: Vec<u32> = cpu[..4].to_vec();
            cpu_step(&mut cpu, *add);
            match &actor.results[seq] {
                CallResult::Done {
                    version, outputs, ..
                } => {
                    assert_eq!(*version, *seq, "call {seq} is version {seq}");
                    assert_eq!(outputs.len(), 1);
                    assert_eq!(words(&blob(&nodes, outputs[0].blob)), before, "call {seq}");
                }
                other => panic!("call {seq}: {other:?}"),
            }
        }
        let state = actor.state[0].blob.expect("written");
        assert_eq!(words(&blob(&nodes, state)), cpu);
        // Two nodes hold the state: the host and the backup.
        let holders = nodes.iter().filter(|n| n.blobs.has(&state)).count();
        assert!(holders >= 2, "the state is on {holders} node(s)");
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_creates_calls_reads_lists_and_deletes_actors_and_refuses_what_is_wrong() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let (a, b) = (common::client(&nodes[0]), common::client(&nodes[1]));
        let start: Vec<u32> = (0..WORDS).map(|i| i * 2).collect();
        let start_bytes: Vec<u8> = start.iter().flat_map(|w| w.to_le_bytes()).collect();
        let blob = a.upload(start_bytes.clone()).await.unwrap();
        let init = || {
            vec![gpumesh::node::api::StateInit {
                binding: 0,
                size: u64::from(WORDS) * 4,
                blob: Some(blob),
            }]
        };
        let view = a.create_actor("acc", init(), None).await.unwrap();
        assert_eq!(
            (view.name.as_str(), view.version, view.bytes),
            ("acc", 0, 1024)
        );
        let clash = a
            .create_actor("acc", init(), None)
            .await
            .unwrap_err()
            .to_string();
        assert!(clash.contains("exists"), "{clash}");

        // A call through another node, and the same call retried with its id.
        let mut cpu = start.clone();
        let first = b.call_actor("acc", step_call(5), None).await.unwrap();
        assert_eq!((first.seq, first.version), (1, 1));
        let before: BlobId = first.outputs[0].blake3.parse().unwrap();
        assert_eq!(
            words(&b.outputs_of_blob(before).await.unwrap()),
            start[..4].to_vec()
        );
        cpu_step(&mut cpu, 5);
        let id = gpumesh::consensus::RequestId::new(0xacc, 1);
        let once = b.call_actor("acc", step_call(2), Some(id)).await.unwrap();
        let again = a.call_actor("acc", step_call(2), Some(id)).await.unwrap();
        assert_eq!((once.seq, once.version), (again.seq, again.version));
        cpu_step(&mut cpu, 2);
        assert_eq!(
            a.actor("acc").await.unwrap().version,
            2,
            "the retry did not run again"
        );

        // What is wrong is refused with a reason, and the state stays as it was.
        let mut broken = step_call(1);
        broken.shader = ShaderSource::Wgsl("fn main( {".into());
        let err = a
            .call_actor("acc", broken, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("line"), "names where the WGSL is wrong: {err}");
        let mut over = step_call(1);
        over.bindings[1].binding = 0;
        let err = a
            .call_actor("acc", over, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("the actor's state"), "{err}");
        let runaway = runaway_call(4000, 500);
        let err = a
            .call_actor("acc", runaway, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("failed") && runaway_stopped(&err), "{err}");
        assert_eq!(words(&b.actor_state("acc", 0).await.unwrap()), cpu);

        // It still works after the failure, on the same host.
        b.call_actor("acc", step_call(9), None).await.unwrap();
        cpu_step(&mut cpu, 9);
        assert_eq!(words(&a.actor_state("acc", 0).await.unwrap()), cpu);

        let list = b.actors().await.unwrap();
        assert_eq!(list.len(), 1);
        let acc = &list[0];
        assert!(!acc.node.is_empty() && acc.epoch >= 1, "{acc:?}");
        assert_eq!((acc.version, acc.bytes), (3, 1024));
        let host = nodes
            .iter()
            .find(|n| n.peer_id.to_string() == acc.node)
            .expect("hosted by a member");
        // Visible in status and on the host's /metrics.
        let status = b.status().await.unwrap();
        assert_eq!(status.actors.len(), 1, "{status:?}");
        assert_eq!(status.actors[0].version, 3);
        let metrics = common::metrics(host).await;
        for line in [
            "gpumesh_actors 1",
            "gpumesh_actors_hosted 1",
            "gpumesh_actor_calls_total 3",
        ] {
            assert!(metrics.contains(line), "{line} missing: {metrics}");
        }

        // Answered once applied on the node it went through (other nodes' reads of
        // their own copies catch up within a heartbeat).
        a.delete_actor("acc").await.unwrap();
        assert!(a.actor("acc").await.is_err());
        assert!(a.actors().await.unwrap().is_empty());
        a.create_actor("acc", init(), None).await.unwrap();
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_whose_loops_pass_the_hosts_bound_is_refused_and_changes_nothing() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        // Under Mesa's own cap, so the bound is what stops loops here.
        let nodes = common::mesh_with(dir.path(), 3, |_, config| {
            config.limits.max_loop_turns = 30_000;
        })
        .await;
        create_stepper(&nodes[0], "bounded").await;
        let (a, b) = (common::client(&nodes[0]), common::client(&nodes[1]));
        let mut cpu = vec![0u32; WORDS as usize];
        a.call_actor("bounded", step_call(3), None).await.unwrap();
        cpu_step(&mut cpu, 3);
        // A loop that never ends, under a deadline it never comes near.
        let runaway = runaway_call(4000, 600_000);
        let err = b
            .call_actor("bounded", runaway, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("--max-loop-turns"), "{err}");
        assert_eq!(words(&a.actor_state("bounded", 0).await.unwrap()), cpu);
        // The host goes on: the next call runs on the state as it was.
        b.call_actor("bounded", step_call(4), None).await.unwrap();
        cpu_step(&mut cpu, 4);
        assert_eq!(words(&b.actor_state("bounded", 0).await.unwrap()), cpu);
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn actors_pinned_to_gl_and_to_vulkan_share_a_mesh_and_keep_state_past_a_blob_chunk() {
    use gpumesh::protocol::BackendKind;
    use gpumesh::shaders::BackendChoice;
    if !(common::have(BackendKind::Vulkan) && common::have(BackendKind::Gl)) {
        common::skipped("actors on GL and Vulkan: needs both adapters");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = common::mesh_with(dir.path(), 2, |i, c| {
            c.backend = BackendChoice::Only(if i == 0 {
                BackendKind::Vulkan
            } else {
                BackendKind::Gl
            });
        })
        .await;
        let c = common::client(&nodes[0]);
        // 2 MiB of state: more than one 1 MiB chunk when it travels.
        let count = 1u32 << 19;
        for (name, backend) in [("on-vk", "vulkan"), ("on-gl", "gl")] {
            let start: Vec<u8> = (0..count).flat_map(|i| i.to_le_bytes()).collect();
            let blob = c.upload(start).await.unwrap();
            let init = vec![gpumesh::node::api::StateInit {
                binding: 0,
                size: u64::from(count) * 4,
                blob: Some(blob),
            }];
            c.create_actor(name, init, Some(backend.into()))
                .await
                .unwrap();
            let mut call = step_call(4);
            call.grid = Grid([count / 64, 1, 1]);
            c.call_actor(name, call, None).await.unwrap();
            let host = c.actor(name).await.unwrap();
            let want = nodes[usize::from(backend == "gl")].peer_id.to_string();
            assert_eq!(host.node, want, "{name} is hosted on the {backend} node");
            assert_eq!(host.backend.as_deref(), Some(backend));
            let state = words(&c.actor_state(name, 0).await.unwrap());
            let cpu: Vec<u32> = (0..count)
                .map(|i: u32| i.wrapping_mul(3).wrapping_add(4 + i))
                .collect();
            assert!(state == cpu, "{name}: the state differs from the CPU's");
        }
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

/// Adds to four words far apart in a large state: a call changes 16 bytes of 4 MiB.
const TOUCH: &str = r#"
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
@group(0) @binding(1) var<uniform> add: vec4<u32>;

@compute @workgroup_size(4)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x * 65536u;
    state[i] = state[i] + add.x + gid.x;
}
"#;

/// Bytes node `n` has read from blob chunk streams and node requests (where an
/// actor's changes travel: inline in the request, or as a blob).
async fn bytes_received(n: &MeshNode) -> f64 {
    metric(n, "gpumesh_net_received_bytes_total{lane=\"blob\"}").await
        + metric(n, "gpumesh_net_received_bytes_total{lane=\"call\"}").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_second_copy_receives_only_what_each_call_changed_and_delete_frees_the_gpu() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let c = common::client(&nodes[0]);
        let count = 1u32 << 20;
        let mut cpu: Vec<u32> = (0..count).map(|i| i ^ 0x5a5a).collect();
        let start: Vec<u8> = cpu.iter().flat_map(|w| w.to_le_bytes()).collect();
        let blob = c.upload(start).await.unwrap();
        let init = vec![gpumesh::node::api::StateInit {
            binding: 0,
            size: u64::from(count) * 4,
            blob: Some(blob),
        }];
        c.create_actor("big", init, None).await.unwrap();
        let call = |add: u32| ActorCall {
            shader: ShaderSource::Wgsl(TOUCH.into()),
            entry_point: "main".into(),
            bindings: vec![BindingSpec {
                binding: 1,
                role: BindingRole::Param {
                    data: [add, 0, 0, 0]
                        .iter()
                        .flat_map(|w| w.to_le_bytes())
                        .collect(),
                },
            }],
            grid: Grid([1, 1, 1]),
            deadline_ms: None,
        };
        let cpu_call = |cpu: &mut Vec<u32>, add: u32| {
            for t in 0..4u32 {
                let i = (t * 65536) as usize;
                cpu[i] = cpu[i].wrapping_add(add + t);
            }
        };
        // The first call's second copy may need the whole starting state (a member
        // that does not hold it yet pulls it once).
        c.call_actor("big", call(1), None).await.unwrap();
        cpu_call(&mut cpu, 1);
        let first = c.actor("big").await.unwrap();
        let backup_id = first.backup.clone().expect("a second copy is kept");
        let backup = nodes
            .iter()
            .find(|n| format!("{:x}", n.raft_id) == backup_id)
            .expect("the backup is a member");
        assert_ne!(
            backup.peer_id.to_string(),
            first.node,
            "the copy is on another node"
        );
        let before = bytes_received(backup).await;
        for add in 2..=6 {
            c.call_actor("big", call(add), None).await.unwrap();
            cpu_call(&mut cpu, add);
        }
        let after = bytes_received(backup).await;
        let a = c.actor("big").await.unwrap();
        assert_eq!(a.version, 6);
        assert_eq!(
            a.backup.as_deref(),
            Some(backup_id.as_str()),
            "the same node keeps the copy"
        );
        // Five calls of 16 changed bytes each: a few hundred bytes with framing, where
        // whole states would be 20 MiB.
        let moved = after - before;
        assert!(
            moved < 64.0 * 1024.0,
            "the second copy received {moved} bytes for five calls"
        );
        // The copy it made is the state, byte for byte, and matches the CPU.
        let state = nodes[0]
            .consensus
            .read_local(|s| s.actor("big").unwrap().state[0].blob)
            .expect("written");
        let kept = backup
            .blobs
            .get(&state)
            .unwrap()
            .expect("the backup holds the state");
        assert!(words(&kept) == cpu, "the kept state differs from the CPU's");
        assert!(words(&c.actor_state("big", 0).await.unwrap()) == cpu);

        // One version of the state is kept on the host's GPU; deleted, it is freed.
        let host = nodes
            .iter()
            .find(|n| n.peer_id.to_string() == a.node)
            .unwrap();
        let state_bytes = f64::from(count) * 4.0;
        let resident = metric(host, "gpumesh_gpu_resident_bytes").await;
        assert!(
            resident >= state_bytes && resident < 2.0 * state_bytes,
            "{resident} bytes resident on the host for {state_bytes} bytes of state"
        );
        c.delete_actor("big").await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let resident = metric(host, "gpumesh_gpu_resident_bytes").await;
            if resident < state_bytes {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{resident} bytes still resident 10 s after the actor was deleted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

/// A call that changes every word of a 2 MiB state: its second copy pulls the new
/// state whole (hashed as it arrives) rather than the changes made over the old
/// one, and is the state byte for byte, as the CPU makes it. With the host stopped,
/// the actor goes on from that copy on another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_that_changes_a_whole_large_state_leaves_its_copy_right_and_the_actor_goes_on_from_it(
) {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh(dir.path(), 3).await;
        let count = 1u32 << 19;
        create_stepper_of(&nodes[0], "whole", count).await;
        let c = common::client(&nodes[1]);
        let mut cpu = vec![0u32; count as usize];
        for add in 1..=3 {
            c.call_actor("whole", step_call_over(add, count), None)
                .await
                .unwrap();
            cpu_step(&mut cpu, add);
            let a = with_results(&nodes[1], "whole", add as usize).await;
            let (host, backup) = (a.host.expect("hosted"), a.backup.expect("a copy kept"));
            assert_ne!(host, backup, "the copy is on another node");
            let state = a.state[0].blob.expect("written");
            let keeper = nodes.iter().find(|n| n.raft_id == backup).unwrap();
            let kept = keeper
                .blobs
                .get(&state)
                .unwrap()
                .expect("the backup holds the state");
            assert!(
                words(&kept) == cpu,
                "call {add}: the copy differs from the CPU's"
            );
        }
        let host = nodes[1]
            .consensus
            .read_local(|s| s.actor("whole").and_then(|a| a.host))
            .unwrap();
        let at = nodes.iter().position(|n| n.raft_id == host).unwrap();
        nodes.remove(at).stop().await;
        let c = common::client(&nodes[0]);
        c.call_actor("whole", step_call_over(4, count), None)
            .await
            .unwrap();
        cpu_step(&mut cpu, 4);
        let a = c.actor("whole").await.unwrap();
        assert_eq!(a.version, 4);
        assert_ne!(
            nodes[0]
                .consensus
                .read_local(|s| s.actor("whole").and_then(|a| a.host)),
            Some(host),
            "the actor moved off the stopped host"
        );
        assert!(
            words(&c.actor_state("whole", 0).await.unwrap()) == cpu,
            "after the move the state differs from the CPU's"
        );
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_to_many_actors_at_once_keep_each_actors_own_order() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let clients: Vec<_> = nodes.iter().map(common::client).collect();
        // Five actors on three nodes: some share a host, whose calls interleave.
        let names: Vec<String> = (0..5).map(|i| format!("acc-{i}")).collect();
        for name in &names {
            let init = vec![gpumesh::node::api::StateInit {
                binding: 0,
                size: u64::from(WORDS) * 4,
                blob: None,
            }];
            clients[0].create_actor(name, init, None).await.unwrap();
        }
        // Placed, and the nodes connected to each other, first: a call to an actor
        // with no host yet, or whose host cannot be reached, waits in the record's
        // queue instead (this test follows the calls sent straight to a host).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let placed = nodes.iter().all(|n| {
                n.consensus
                    .read_local(|s| s.actors().filter(|a| a.host.is_some()).count())
                    == names.len()
            });
            let mut connected = true;
            for n in &nodes {
                connected &= n.net.connected_peers().len() >= nodes.len() - 1;
            }
            if placed && connected {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "not placed or not connected"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut applied = nodes[0].consensus.subscribe();
        let mut calls = Vec::new();
        for round in 0..4u32 {
            for (i, name) in names.iter().enumerate() {
                let c = clients[(i + round as usize) % 3].clone();
                let name = name.clone();
                let add = round * 10 + i as u32;
                calls.push(tokio::spawn(async move {
                    let reply = c.call_actor(&name, step_call(add), None).await.unwrap();
                    (name, reply.seq, add)
                }));
            }
        }
        let mut order: BTreeMap<String, BTreeMap<u64, u32>> = BTreeMap::new();
        for c in calls {
            let (name, seq, add) = c.await.unwrap();
            order.entry(name).or_default().insert(seq, add);
        }
        let hosts: std::collections::BTreeSet<String> = clients[1]
            .actors()
            .await
            .unwrap()
            .into_iter()
            .map(|a| a.node)
            .collect();
        assert!(
            hosts.len() < names.len(),
            "some actors share a host: {hosts:?}"
        );
        for (name, calls) in &order {
            assert_eq!(
                calls.keys().copied().collect::<Vec<_>>(),
                vec![1, 2, 3, 4],
                "{name}: one sequence number each"
            );
            let mut cpu = vec![0u32; WORDS as usize];
            for add in calls.values() {
                cpu_step(&mut cpu, *add);
            }
            let state = words(&clients[2].actor_state(name, 0).await.unwrap());
            assert_eq!(state, cpu, "{name}: its calls replayed in their order");
            let held = nodes[2]
                .consensus
                .read_local(|s| s.actor(name).unwrap().inline_state(0).map(words));
            assert_eq!(held, Some(cpu), "{name}: the record holds the state");
        }
        // Each call went straight to its actor's host and was recorded there with
        // its result: no call waited in the record's queue.
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        while let Ok(event) = applied.try_recv() {
            if let gpumesh::consensus::AppliedEvent::Entry { entry, .. } = event {
                *kinds.entry(entry.command.kind()).or_default() += 1;
            }
        }
        assert_eq!(kinds.get("call-actor"), None, "{kinds:?}");
        assert!(
            kinds.get("actor-calls-ran").is_some_and(|n| *n >= 5),
            "{kinds:?}"
        );
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_waiting_together_run_back_to_back_and_a_failure_among_them_changes_nothing() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        create_stepper(&nodes[0], "batched").await;
        // 24 calls through all three nodes at once; every sixth never ends (it is
        // stopped at its deadline, or on a software adapter when its loop is cut).
        let runaway = runaway_call(64, 100);
        let calls: Vec<ActorCall> = (0..24u32)
            .map(|i| {
                if i % 6 == 5 {
                    runaway.clone()
                } else {
                    step_call(i * 13 + 1)
                }
            })
            .collect();
        let seqs = call_all_at_once(&nodes, "batched", calls).await;
        let by_seq: BTreeMap<u64, Option<u32>> = seqs
            .into_iter()
            .zip((0..24u32).map(|i| (i % 6 != 5).then_some(i * 13 + 1)))
            .collect();
        let actor = with_results(&nodes[1], "batched", 24).await;
        // Replayed on the CPU in sequence order; a failed call changes nothing.
        let mut cpu = vec![0u32; WORDS as usize];
        let mut version = 0;
        for (seq, add) in &by_seq {
            match (&actor.results[seq], add) {
                (
                    CallResult::Done {
                        version: v,
                        outputs,
                        ..
                    },
                    Some(add),
                ) => {
                    let before: Vec<u32> = cpu[..4].to_vec();
                    cpu_step(&mut cpu, *add);
                    version += 1;
                    assert_eq!(*v, version, "call {seq}");
                    assert_eq!(words(&blob(&nodes, outputs[0].blob)), before, "call {seq}");
                }
                (CallResult::Failed { reason, .. }, None) => {
                    assert!(!reason.is_empty(), "call {seq} says why");
                }
                (result, add) => panic!("call {seq} (adds {add:?}): {result:?}"),
            }
        }
        assert_eq!(actor.version, version);
        // A small state is held by the record (on a quorum, in the batches'
        // entries), not stored as a blob anywhere.
        let state = actor
            .inline_state(0)
            .expect("the record holds a small state");
        assert_eq!(words(state), cpu);
        let id = actor.state[0].blob.expect("written");
        assert_eq!(id, BlobId::of(state));
        assert!(actor.backup.is_none(), "{actor:?}");
        assert!(
            nodes.iter().all(|n| !n.blobs.has(&id)),
            "a state blob was written"
        );
        // Calls were recorded several to an entry, a failure among successes.
        let mut by_entry: BTreeMap<u64, Vec<bool>> = BTreeMap::new();
        for r in actor.results.values() {
            let (index, done) = match r {
                CallResult::Done { index, .. } => (*index, true),
                CallResult::Failed { index, .. } => (*index, false),
            };
            by_entry.entry(index).or_default().push(done);
        }
        assert!(
            by_entry.values().any(|b| b.len() > 1),
            "no two calls in one entry: {by_entry:?}"
        );
        assert!(
            by_entry
                .values()
                .any(|b| b.contains(&true) && b.contains(&false)),
            "no failure recorded beside successes: {by_entry:?}"
        );
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

/// A loop-free kernel (so it runs as written on every adapter, chained with other
/// calls too) that takes over 100 ms on lavapipe: it reads the state and changes
/// none of it; its 16-byte output keeps the work from being dropped.
fn slow_call(deadline_ms: u64) -> ActorCall {
    let mut src = String::from(
        "@group(0) @binding(0) var<storage, read_write> state: array<u32>;\n\
         @group(0) @binding(2) var<storage, read_write> out: array<u32>;\n\
         @compute @workgroup_size(64)\n\
         fn main(@builtin(global_invocation_id) gid: vec3<u32>) {\n\
         var x = gid.x ^ state[0];\n",
    );
    for _ in 0..1000 {
        src.push_str("x = (x ^ (x >> 13u)) * 1664525u + 1013904223u;\n");
    }
    src.push_str("out[gid.x % 4u] = x;\n}\n");
    ActorCall {
        shader: ShaderSource::Wgsl(src),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 2,
            role: BindingRole::Output { size: 16 },
        }],
        grid: Grid([16_384, 1, 1]),
        deadline_ms: Some(deadline_ms),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_waiting_with_others_is_held_to_its_own_deadline() {
    if !have_any() {
        return;
    }
    const DEADLINE_MS: u64 = 5;
    // How long the slow call takes alone on this machine's adapter: where that is
    // well past its deadline (software adapters), it must fail, chained or alone.
    let alone = {
        use gpumesh::protocol::{MergeRule, TaskSpec};
        use gpumesh::shaders::{BackendChoice, Executor, Job, Kernel};
        let call = slow_call(DEADLINE_MS);
        let ShaderSource::Wgsl(src) = &call.shader else {
            unreachable!()
        };
        let kernel = std::sync::Arc::new(Kernel::compile(src, "main").unwrap());
        let mut bindings = call.bindings.clone();
        bindings.push(BindingSpec {
            binding: 0,
            role: BindingRole::Output {
                size: u64::from(WORDS) * 4,
            },
        });
        let spec = TaskSpec {
            shader: call.shader.clone(),
            entry_point: "main".into(),
            bindings,
            grid: call.grid,
            shards: 1,
            merge: MergeRule::Changes,
            merges: Default::default(),
            options: Default::default(),
        };
        let job = Job::new(spec, kernel, |_| None).unwrap();
        let mut executor = Executor::new(BackendChoice::Auto).unwrap();
        executor.run(&job, None).unwrap();
        executor.run(&job, None).unwrap().elapsed
    };
    let must_fail = alone > Duration::from_millis(DEADLINE_MS * 5);
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        create_stepper(&nodes[0], "held").await;
        // Twelve calls at once: every sixth the slow one with a 5 ms deadline, the
        // rest steps with the default deadline (minutes).
        let adds: Vec<Option<u32>> = (0..12u32)
            .map(|i| (i % 6 != 5).then_some(i * 7 + 1))
            .collect();
        let calls = adds
            .iter()
            .map(|a| a.map_or_else(|| slow_call(DEADLINE_MS), step_call))
            .collect();
        let seqs = call_all_at_once(&nodes, "held", calls).await;
        let actor = with_results(&nodes[2], "held", 12).await;
        let by_seq: BTreeMap<u64, Option<u32>> = seqs.into_iter().zip(adds).collect();
        let mut cpu = vec![0u32; WORDS as usize];
        let mut version = 0;
        for (seq, add) in &by_seq {
            match (&actor.results[seq], add) {
                (CallResult::Done { version: v, .. }, Some(add)) => {
                    cpu_step(&mut cpu, *add);
                    version += 1;
                    assert_eq!(*v, version, "call {seq}");
                }
                (CallResult::Failed { reason, .. }, None) => {
                    assert!(reason.contains("deadline"), "call {seq}: {reason}");
                }
                // Only where the adapter runs it within its deadline.
                (CallResult::Done { version: v, .. }, None) if !must_fail => {
                    version += 1;
                    assert_eq!(*v, version, "call {seq}");
                }
                (result, add) => panic!(
                    "call {seq} (adds {add:?}; the slow call alone took {alone:?} \
                     against its {DEADLINE_MS} ms): {result:?}"
                ),
            }
        }
        assert_eq!(actor.version, version);
        assert_eq!(words(actor.inline_state(0).expect("inline")), cpu);
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_actors_created_at_once_are_placed_once_each_and_a_retried_create_is_one_actor() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let clients: Vec<_> = nodes.iter().map(common::client).collect();
        // Every entry the leader's record applies, by kind (an entry skipped by a
        // lagging receiver counts as unknown).
        let mut applied = nodes[0].consensus.subscribe();
        let kinds = std::sync::Arc::new(std::sync::Mutex::new(BTreeMap::<String, usize>::new()));
        let counting = tokio::spawn({
            let kinds = kinds.clone();
            async move {
                loop {
                    let kind = match applied.recv().await {
                        Ok(gpumesh::consensus::AppliedEvent::Entry { entry, .. }) => {
                            (entry.command.kind().to_string(), 1)
                        }
                        Ok(_) => continue,
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                            ("unknown".to_string(), n as usize)
                        }
                        Err(_) => return,
                    };
                    *kinds.lock().unwrap().entry(kind.0).or_default() += kind.1;
                }
            }
        });
        // 240 actors, 24 creates in flight through the three nodes.
        const ACTORS: usize = 240;
        let mut creating = tokio::task::JoinSet::new();
        for first in 0..24 {
            let c = clients[first % 3].clone();
            creating.spawn(async move {
                for i in (first..ACTORS).step_by(24) {
                    let init = vec![gpumesh::node::api::StateInit {
                        binding: 0,
                        size: 64,
                        blob: None,
                    }];
                    c.create_actor(&format!("many-{i}"), init, None)
                        .await
                        .unwrap();
                }
            });
        }
        while let Some(done) = creating.join_next().await {
            done.unwrap();
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while nodes[0]
            .consensus
            .read_local(|s| s.actors().filter(|a| a.host.is_some()).count())
            < ACTORS
        {
            assert!(tokio::time::Instant::now() < deadline, "not all placed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // One placement each: the leader's passes (one per applied entry) proposed
        // each unplaced actor's placement again until it applied, so creating many
        // at once flooded the log with placements and lost the quorum.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let leader = nodes
            .iter()
            .position(|n| {
                n.consensus.watch_status().borrow().role == gpumesh::consensus::RaftRole::Leader
            })
            .unwrap();
        let (index, created) = nodes[leader]
            .consensus
            .read_local(|s| (s.applied_index(), s.actors().len()));
        assert_eq!(created, ACTORS);
        counting.abort();
        let kinds = kinds.lock().unwrap().clone();
        let placements = kinds.get("place-actor").copied().unwrap_or(0);
        assert_eq!(kinds.get("unknown"), None, "{kinds:?}");
        assert!(
            (ACTORS..ACTORS + ACTORS / 4).contains(&placements),
            "{placements} placements for {ACTORS} actors (applied index {index}): {kinds:?}"
        );
        // A retried create (same request id) answers with the actor it made; another
        // request for the same name is refused.
        let http = reqwest::Client::new();
        let url = format!("http://{}/v1/actors", nodes[1].api_addr);
        let body = serde_json::json!({
            "name": "retried",
            "state": [{"binding": 0, "size": 64}],
            "request_id": {"client": 77, "seq": 1},
        });
        for attempt in 0..2 {
            let r = http.post(&url).json(&body).send().await.unwrap();
            assert_eq!(
                r.status(),
                200,
                "attempt {attempt}: {}",
                r.text().await.unwrap()
            );
            let view: serde_json::Value = r.json().await.unwrap();
            assert_eq!(view["name"], "retried");
        }
        let mut other = body.clone();
        other["request_id"]["seq"] = 2.into();
        let r = http.post(&url).json(&other).send().await.unwrap();
        assert_eq!(r.status(), 409);
        assert!(r.text().await.unwrap().contains("exists"));
        // Deleted since: the retry says so (and is not retried as unavailable); once
        // another actor has the name, the retry says that instead of showing it.
        // (Asked where the delete went: a retry is answered from that node's record.)
        clients[0].delete_actor("retried").await.unwrap();
        let url = format!("http://{}/v1/actors", nodes[0].api_addr);
        let r = http.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 410);
        assert!(r.text().await.unwrap().contains("deleted since"));
        let mut third = body.clone();
        third["request_id"]["seq"] = 3.into();
        let r = http.post(&url).json(&third).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let r = http.post(&url).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 409);
        assert!(r
            .text()
            .await
            .unwrap()
            .contains("another actor now has the name"));
        assert_eq!(clients[2].actors().await.unwrap().len(), ACTORS + 1);
        // A retried delete (same request id, through another node) answers as the
        // first did, and deletes nothing made since; a new one for a name that is
        // gone answers 404, and an id that is not one, 400.
        let delete = |node: usize, id: &str| {
            let url = format!(
                "http://{}/v1/actors/retried?request_id={id}",
                nodes[node].api_addr
            );
            http.delete(url).send()
        };
        assert_eq!(delete(1, "4d-9").await.unwrap().status(), 204);
        assert!(clients[0].actor("retried").await.is_err());
        let init = vec![gpumesh::node::api::StateInit {
            binding: 0,
            size: 64,
            blob: None,
        }];
        clients[0]
            .create_actor("retried", init, None)
            .await
            .unwrap();
        let again = delete(2, "4d-9").await.unwrap();
        assert_eq!(again.status(), 204, "{}", again.text().await.unwrap());
        assert_eq!(clients[0].actor("retried").await.unwrap().name, "retried");
        assert_eq!(delete(2, "4d-a").await.unwrap().status(), 204);
        let gone = delete(0, "4d-b").await.unwrap();
        assert_eq!(gone.status(), 404);
        assert!(gone.text().await.unwrap().contains("no actor named"));
        let bad = delete(0, "nonsense").await.unwrap();
        assert_eq!(bad.status(), 400);
        assert!(bad.text().await.unwrap().contains("not a request id"));
        assert_eq!(clients[2].actors().await.unwrap().len(), ACTORS);
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}
