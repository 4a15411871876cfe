//! The mesh end to end: real nodes in one process (real libp2p on loopback, real Raft
//! on redb, real wgpu), tasks submitted and fetched through the HTTP API, every result
//! checked against the CPU reference.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::Duration;

use common::{client, config, have, have_any, mesh, salted_spec, seed, stop, submit, LIMIT};
use gpumesh::node::api::TaskState;
use gpumesh::node::{Formation, MeshNode, Multiaddr, NodeConfig};
use gpumesh::protocol::{BackendKind, ShaderSource};
use gpumesh::shaders::builtins;
use gpumesh::shaders::BackendChoice;
use gpumesh::{Client, ClientError};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_submit_from_each_and_fetch_from_each() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let mut ran_on = std::collections::BTreeSet::new();
        for (i, name) in ["vector_add", "histogram", "blur"].into_iter().enumerate() {
            let b = builtins::get(name).unwrap();
            let problem = b.problem(b.test_size).unwrap();
            let task = submit(&client(&nodes[i]), &problem, 5).await;
            let view = client(&nodes[i]).wait(task, |_, _| {}).await.unwrap();
            ran_on.extend(view.shards.iter().filter_map(|s| s.node));
            for (j, node) in nodes.iter().enumerate() {
                let outputs = client(node).results(task).await.unwrap();
                problem
                    .verify(&outputs)
                    .unwrap_or_else(|m| panic!("{name} submitted via {i}, fetched via {j}: {m}"));
            }
        }
        assert!(ran_on.len() >= 2, "shards spread over the mesh: {ran_on:?}");
        let status = client(&nodes[2]).status().await.unwrap();
        assert_eq!(status.members.len(), 3);
        assert!(status.leader != 0);
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// Read your writes through any node: a task finished through one node is shown
/// finished by every other at once (`gpumesh task`, `gpumesh tasks`), not as a
/// node that has not applied its last entries yet has it. Read from the node's own
/// copy of the record (before), a read here showed the task still running within
/// the first 150 in each of two runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_finished_through_one_node_is_finished_through_every_other() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let via: Vec<_> = nodes.iter().map(client).collect();
        for salt in 0..150u32 {
            let (from, read) = (&via[salt as usize % 3], &via[(salt as usize + 1) % 3]);
            let id = from.submit(salted_spec(1024, salt), None).await.unwrap();
            let done = from.wait(id, |_, _| {}).await.unwrap();
            assert_eq!(done.status, TaskState::Completed, "{done:?}");
            let seen = if salt % 2 == 0 {
                read.task(id).await.unwrap().status
            } else {
                let all = read.tasks().await.unwrap();
                all.into_iter()
                    .find(|t| t.id == id)
                    .map(|t| t.status)
                    .unwrap()
            };
            assert_eq!(
                seen,
                TaskState::Completed,
                "t{id} read through another node"
            );
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joined_node_serves_once_it_votes() {
    // As the README starts a mesh: a forms it, b and c join through a. Once c is up,
    // losing a must leave a quorum: b and c are voters by the time each serves, and
    // each can send Raft frames to every member (before, c learned the members it
    // had not dialled only at its next sweep, half a second on).
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let a = MeshNode::start(config(&dir.path().join("a"), Formation::Init, &[]))
            .await
            .unwrap();
        let mut nodes = vec![a];
        for name in ["b", "c"] {
            let c = config(&dir.path().join(name), Formation::Join, &[seed(&nodes[0])]);
            let node = MeshNode::start(c).await.unwrap();
            let st = client(&node).status().await.unwrap();
            let me = st
                .members
                .iter()
                .find(|m| m.raft_id == node.raft_id)
                .expect("in the membership");
            assert_ne!(me.role, "learner", "{name} serves as a learner: {st:?}");
            // It may be handed leadership at once: it can reach every member.
            for m in &st.members {
                assert!(node.reaches(m.raft_id), "{name} cannot reach {}", m.raft_id);
            }
            nodes.push(node);
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// A node that joins while a member is down has heard nothing from it: within its
/// first `down_after` its status never shows that member as alive, and once its
/// dial is refused shows it unreachable, while the live members, whose heartbeats
/// it applies, show as alive. Before, a node that had just joined called every
/// member alive for its first `down_after` (8 s by default), the dead one too; and
/// then not heard yet until `down_after`, as only a member whose connection closed
/// was ever found unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_just_joined_does_not_call_a_dead_member_alive() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh(dir.path(), 3).await;
        let dead = nodes.pop().unwrap();
        let dead_id = dead.raft_id;
        dead.stop().await;
        let mut c = config(
            &dir.path().join("late"),
            Formation::Join,
            &[seed(&nodes[0])],
        );
        c.down_after = Duration::from_secs(30);
        let late = MeshNode::start(c).await.unwrap();
        let view = |st: &gpumesh::node::api::StatusView, id: u64| {
            st.members
                .iter()
                .find(|m| m.raft_id == id)
                .cloned()
                .unwrap()
        };
        // Each live member proposes a heartbeat every 2 s.
        let (mut heard, mut unreachable) = (false, false);
        for _ in 0..100 {
            let st = client(&late).status().await.unwrap();
            let m = view(&st, dead_id);
            assert!(!m.alive || m.unheard, "called alive: {m:#?}");
            unreachable |= m.unreachable;
            heard = nodes.iter().all(|n| {
                let m = view(&st, n.raft_id);
                m.alive && !m.unheard && !m.unreachable
            });
            if heard && unreachable {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(heard, "the late node never heard from the live members");
        assert!(
            unreachable,
            "the dead member was not found unreachable within 10 s (down_after 30 s)"
        );
        nodes.push(late);
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_shard_output_is_on_two_nodes_so_losing_its_worker_loses_nothing() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh(dir.path(), 3).await;
        let b = builtins::get("mandelbrot").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        let task = submit(&client(&nodes[0]), &problem, 6).await;
        let view = client(&nodes[0]).wait(task, |_, _| {}).await.unwrap();
        let inline = nodes[0].consensus.read_local(move |s| {
            s.task(gpumesh::consensus::TaskId(task))
                .map(|t| t.inline.keys().copied().collect::<Vec<_>>())
                .unwrap_or_default()
        });
        for shard in &view.shards {
            let blob: gpumesh::protocol::BlobId = shard.output.as_ref().unwrap().parse().unwrap();
            if inline.contains(&blob) {
                continue; // in its log entry: on a quorum
            }
            let copies = nodes.iter().filter(|n| n.blobs.has(&blob)).count();
            assert!(
                copies >= 2,
                "shard {} output is on {copies} node(s)",
                shard.index
            );
        }
        // Stop a node that ran shards (not the one we fetch from): nothing is lost.
        let victim = nodes
            .iter()
            .skip(1)
            .position(|n| view.shards.iter().any(|s| s.node == Some(n.raft_id)))
            .map(|i| i + 1);
        if let Some(i) = victim {
            nodes.remove(i).stop().await;
        }
        problem
            .verify(&client(&nodes[0]).results(task).await.unwrap())
            .unwrap();
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_is_acknowledged_with_each_input_on_two_nodes_and_survives_losing_its_submitter() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh(dir.path(), 3).await;
        let b = builtins::get("vector_add").unwrap();
        // Inputs of 64 KiB (sent to the other member in the request) and of 512 KiB
        // (pulled by it), uploaded to node 0 alone and submitted there.
        let mut tasks = Vec::new();
        for size in [b.test_size, 1 << 17] {
            let problem = b.problem(size).unwrap();
            let task = submit(&client(&nodes[0]), &problem, 2).await;
            for id in problem.blobs.keys() {
                let copies = nodes.iter().filter(|n| n.blobs.has(id)).count();
                assert!(
                    copies >= 2,
                    "an input of {size} elements is on {copies} node(s) once acknowledged"
                );
            }
            tasks.push((task, problem));
        }
        // The submitting node gone without a word: the tasks finish from the copies.
        nodes.remove(0).kill().await;
        for (task, problem) in &tasks {
            let view = client(&nodes[0]).wait(*task, |_, _| {}).await.unwrap();
            assert_eq!(view.status, TaskState::Completed, "{view:?}");
            problem
                .verify(&client(&nodes[0]).results(*task).await.unwrap())
                .unwrap();
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// Flips a byte of the copy of `blob` in the store at `dir` (a file of its own, or
/// its record in the pack), under the node that holds it.
fn damage(dir: &std::path::Path, blob: &gpumesh::protocol::BlobId) {
    use std::os::unix::fs::FileExt as _;
    let own = dir.join(blob.to_hex());
    let (path, at) = if own.is_file() {
        (own, 0)
    } else {
        let pack = dir.join("small.pack");
        let bytes = std::fs::read(&pack).unwrap();
        let id = bytes
            .windows(32)
            .position(|w| w == blob.0)
            .expect("the blob's record in the pack");
        (pack, (id + 32) as u64)
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
    f.sync_all().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_output_damaged_where_it_is_fetched_is_made_again_from_the_mesh() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let via = client(&nodes[0]);
        let b = builtins::get("mandelbrot").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        // One shard: its output is the shard's, kept on two nodes. Three: merged
        // here when first fetched, from shards each kept on two nodes.
        for shards in [1, 3] {
            let task = submit(&via, &problem, shards).await;
            via.wait(task, |_, _| {}).await.unwrap();
            problem.verify(&via.results(task).await.unwrap()).unwrap();
            let listed = via.outputs(task).await.unwrap();
            for o in &listed {
                let blob: gpumesh::protocol::BlobId = o.blake3.parse().unwrap();
                damage(&dir.path().join("n0").join("blobs"), &blob);
            }
            // The damaged copy is found on reading, dropped, and the output made
            // again from the others: the right bytes, never the damaged ones.
            problem
                .verify(&via.results(task).await.unwrap())
                .unwrap_or_else(|e| panic!("{shards} shard(s): {e}"));
            let again = via.outputs(task).await.unwrap();
            assert_eq!(
                serde_json::to_string(&again).unwrap(),
                serde_json::to_string(&listed).unwrap(),
                "{shards} shard(s)"
            );
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// A one-shard task of `source` (workgroups of 64) writing `words` words at
/// binding 0.
fn one_output(source: &str, words: u32) -> gpumesh::protocol::TaskSpec {
    gpumesh::protocol::TaskSpec {
        shader: ShaderSource::Wgsl(source.into()),
        entry_point: "main".into(),
        bindings: vec![gpumesh::protocol::BindingSpec {
            binding: 0,
            role: gpumesh::protocol::BindingRole::Output {
                size: u64::from(words) * 4,
            },
        }],
        grid: gpumesh::protocol::Grid([words.div_ceil(64), 1, 1]),
        shards: 1,
        merge: gpumesh::protocol::MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_result_rides_in_the_log_and_is_fetched_from_every_node() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let source = "@group(0) @binding(0) var<storage, read_write> out: array<u32>;\n\
            @compute @workgroup_size(64)\n\
            fn main(@builtin(global_invocation_id) gid: vec3<u32>) { out[gid.x] = gid.x * 7u + 1u; }";
        let spec = one_output(source, 64);
        let task = client(&nodes[1]).submit(spec.clone(), None).await.unwrap();
        let view = client(&nodes[1]).wait(task, |_, _| {}).await.unwrap();
        let blob: gpumesh::protocol::BlobId =
            view.shards[0].output.as_ref().unwrap().parse().unwrap();
        for n in &nodes {
            let carried = n.consensus.read_local(move |s| {
                s.task(gpumesh::consensus::TaskId(task))
                    .is_some_and(|t| t.inline.contains_key(&blob))
            });
            if carried {
                assert!(!n.blobs.has(&blob), "an inline result is not written as a blob");
            }
        }
        let cpu: Vec<u8> = (0..64u32).flat_map(|i| (i * 7 + 1).to_le_bytes()).collect();
        for n in &nodes {
            let out = client(n).results(task).await.unwrap();
            assert_eq!(out[&0], cpu, "fetched through {}", n.raft_id);
        }
        // Every node's record carries it (the one the client waited on, at least).
        let carried = nodes[1].consensus.read_local(move |s| {
            s.task(gpumesh::consensus::TaskId(task))
                .is_some_and(|t| t.inline.contains_key(&blob))
        });
        assert!(carried, "the result rides in the log");

        // Submit, wait and fetch in one request, through each node.
        for n in &nodes {
            let (again, out) = client(n).run(spec.clone()).await.unwrap();
            assert_ne!(again, task, "a new task");
            assert_eq!(out[&0], cpu, "run through {}", n.raft_id);
        }
        // A kernel the node refuses (division by zero) is refused by run as well.
        let mut runaway = spec.clone();
        runaway.shader = ShaderSource::Wgsl(
            "@group(0) @binding(0) var<storage, read_write> out: array<u32>;\n\
             @compute @workgroup_size(64)\n\
             fn main(@builtin(global_invocation_id) gid: vec3<u32>) { out[gid.x] = 1u / 0u; }"
                .into(),
        );
        let refused = client(&nodes[0]).run(runaway).await;
        assert!(refused.is_err(), "{refused:?}");
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// A one-shard run with a result over what JSON carries (1 MiB) answers with the
/// bytes after its JSON: nothing stored for the output and no second request. The
/// output fetched afterwards is the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_with_a_large_result_answers_with_its_bytes() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 3).await;
        let words = 1u32 << 18;
        let source = "@group(0) @binding(0) var<storage, read_write> out: array<u32>;\n\
            @compute @workgroup_size(64)\n\
            fn main(@builtin(global_invocation_id) gid: vec3<u32>) { out[gid.x] = gid.x * 2654435761u + 3u; }";
        let spec = one_output(source, words);
        let cpu: Vec<u8> = (0..words)
            .flat_map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(3).to_le_bytes())
            .collect();
        let output = gpumesh::protocol::BlobId::of(&cpu);
        let (task, out) = client(&nodes[2]).run(spec).await.unwrap();
        assert_eq!(out[&0], cpu, "the run's answer");
        // Its result (the words it changed) is on two nodes, written here while
        // the second copy was pulled.
        let result = nodes[2]
            .consensus
            .read_local(move |s| {
                let t = s.task(gpumesh::consensus::TaskId(task))?;
                t.shards[0].output.as_ref().map(|o| o.blob)
            })
            .expect("a recorded result");
        let holders = nodes.iter().filter(|n| n.blobs.has(&result)).count();
        assert!(holders >= 2, "the result is on {holders} node(s)");
        for n in &nodes {
            assert!(
                !n.blobs.has(&output),
                "node {} stored the output to answer the run",
                n.raft_id
            );
        }
        for n in &nodes {
            let fetched = client(n).results(task).await.unwrap();
            assert_eq!(fetched[&0], cpu, "fetched through {}", n.raft_id);
        }
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fourth_node_joins_mid_run_and_receives_shards() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh(dir.path(), 3).await;
        let b = builtins::get("vector_add").unwrap();
        let problem = b.problem(256 * 16).unwrap();
        let first = submit(&client(&nodes[0]), &problem, 8).await;
        // Joins while the first task may still be running.
        let fourth = MeshNode::start(config(
            &dir.path().join("n3"),
            Formation::Join,
            &[seed(&nodes[1])],
        ))
        .await
        .unwrap();
        let fourth_id = fourth.raft_id;
        nodes.push(fourth);
        client(&nodes[0]).wait(first, |_, _| {}).await.unwrap();
        let mut got_shards = false;
        for _ in 0..10 {
            let task = submit(&client(&nodes[1]), &problem, 8).await;
            let view = client(&nodes[1]).wait(task, |_, _| {}).await.unwrap();
            problem
                .verify(&client(&nodes[3]).results(task).await.unwrap())
                .unwrap();
            if view.shards.iter().any(|s| s.node == Some(fourth_id)) {
                got_shards = true;
                break;
            }
        }
        assert!(got_shards, "the new node ran shards");
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_node_rejoins_with_its_identity_and_state() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh(dir.path(), 3).await;
        let b = builtins::get("histogram").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        let before = submit(&client(&nodes[0]), &problem, 4).await;
        client(&nodes[0]).wait(before, |_, _| {}).await.unwrap();

        let restarted = nodes.remove(2);
        let (peer, raft) = (restarted.peer_id, restarted.raft_id);
        restarted.stop().await;
        let back = MeshNode::start(config(
            &dir.path().join("n2"),
            Formation::Join,
            &[seed(&nodes[0])],
        ))
        .await
        .unwrap();
        assert_eq!((back.peer_id, back.raft_id), (peer, raft), "same identity");
        nodes.push(back);
        // Its replicated state came back from disk and the mesh still works through it.
        let view = client(&nodes[2]).task(before).await.unwrap();
        assert_eq!(view.status, TaskState::Completed);
        problem
            .verify(&client(&nodes[2]).results(before).await.unwrap())
            .unwrap();
        let after = submit(&client(&nodes[2]), &problem, 4).await;
        client(&nodes[2]).wait(after, |_, _| {}).await.unwrap();
        problem
            .verify(&client(&nodes[1]).results(after).await.unwrap())
            .unwrap();
        let status = client(&nodes[0]).status().await.unwrap();
        assert_eq!(status.members.len(), 3, "rejoined, not added twice");
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vulkan_and_gl_nodes_run_shards_of_one_task() {
    if !(have(BackendKind::Vulkan) && have(BackendKind::Gl)) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut a = config(&dir.path().join("vk"), Formation::Init, &[]);
        a.backend = BackendChoice::Only(BackendKind::Vulkan);
        let a = MeshNode::start(a).await.unwrap();
        let mut b = config(&dir.path().join("gl"), Formation::Join, &[seed(&a)]);
        b.backend = BackendChoice::Only(BackendKind::Gl);
        let b = MeshNode::start(b).await.unwrap();
        assert_eq!(a.capability.as_ref().unwrap().backend, BackendKind::Vulkan);
        assert_eq!(b.capability.as_ref().unwrap().backend, BackendKind::Gl);
        let (ids, nodes) = ([a.raft_id, b.raft_id], vec![a, b]);
        let mut both = false;
        for name in ["matmul", "mandelbrot", "montecarlo_pi"] {
            let bi = builtins::get(name).unwrap();
            let problem = bi.problem(bi.test_size).unwrap();
            let task = submit(&client(&nodes[0]), &problem, 4).await;
            let view = client(&nodes[0]).wait(task, |_, _| {}).await.unwrap();
            both |= ids
                .iter()
                .all(|id| view.shards.iter().any(|s| s.node == Some(*id)));
            problem
                .verify(&client(&nodes[1]).results(task).await.unwrap())
                .unwrap_or_else(|m| panic!("{name} across vulkan and gl: {m}"));
        }
        assert!(both, "some task ran on both backends");
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_clear_errors_and_nothing_is_committed() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 1).await;
        let c = client(&nodes[0]);
        let before = c.status().await.unwrap().commit_index;
        // A malformed shader: the message `gpumesh run` gives, before any commit.
        let problem = builtins::get("vector_add").unwrap().problem(1024).unwrap();
        let mut spec = problem.spec(2);
        let broken = "@compute @workgroup_size(64)\nfn main() {\n    let x = ;\n}\n";
        spec.shader = ShaderSource::Wgsl(broken.into());
        let want = gpumesh::shaders::Kernel::compile(broken, "main")
            .unwrap_err()
            .to_string();
        match c.submit(spec, None).await {
            Err(ClientError::Refused(msg)) => assert_eq!(msg, want),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // An input that was never uploaded.
        match c.submit(problem.spec(2), None).await {
            Err(ClientError::Refused(msg)) => assert!(msg.contains("upload it first"), "{msg}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // An impossible spec: more shards than workgroups.
        let mut spec = problem.spec(1);
        spec.shards = 1000;
        for bytes in problem.blobs.values() {
            c.upload(bytes.to_vec()).await.unwrap();
        }
        match c.submit(spec, None).await {
            Err(ClientError::Refused(msg)) => assert!(msg.contains("1000 shards"), "{msg}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        let after = c.status().await.unwrap().commit_index;
        assert!(
            after - before < 5,
            "only heartbeats were committed ({before} -> {after})"
        );
        // An unknown task id.
        match c.task(987_654).await {
            Err(ClientError::Refused(msg)) => assert!(msg.contains("no task t987654"), "{msg}"),
            other => panic!("expected not found, got {other:?}"),
        }
        match c.results(987_654).await {
            Err(ClientError::Refused(msg)) => assert!(msg.contains("no task"), "{msg}"),
            other => panic!("expected not found, got {other:?}"),
        }
        // The node is still fine.
        assert_eq!(c.status().await.unwrap().members.len(), 1);
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}

/// An API or listen address another program holds: refused with the address and
/// the reason, and what to do. Taken first, the API address leaves the data dir
/// as it was (nothing of a mesh made in it); with a free address it forms one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn addresses_in_use_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();

    let mut c = config(&dir.path().join("api"), Formation::Init, &[]);
    c.api = format!("127.0.0.1:{port}").parse().unwrap();
    let err = common::refused(c).await;
    assert!(
        err.contains(&format!("127.0.0.1:{port}"))
            && err.contains("in use")
            && err.contains("another --api"),
        "{err}"
    );
    assert!(!dir.path().join("api").exists(), "the data dir was written");

    let mut c = config(&dir.path().join("listen"), Formation::Init, &[]);
    c.listen = vec![format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap()];
    let err = common::refused(c).await;
    assert!(
        err.contains(&format!("/tcp/{port}"))
            && err.contains("in use")
            && err.contains("another --listen"),
        "{err}"
    );
    drop(held);
    let node = MeshNode::start(config(&dir.path().join("listen"), Formation::Init, &[]))
        .await
        .unwrap();
    assert_eq!(client(&node).status().await.unwrap().members.len(), 1);
    stop(vec![node]).await;
}

/// A second node started on a running node's data dir is refused before it reads
/// or writes anything there (it opened the blob store, which a running node is
/// appending to, before the Raft store's own lock refused it); the first serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_data_dir_in_use_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = MeshNode::start(config(dir.path(), Formation::Init, &[]))
        .await
        .unwrap();
    let before = std::fs::read_dir(dir.path()).unwrap().count();
    let err = common::refused(config(dir.path(), Formation::Init, &[])).await;
    assert!(
        err.contains("in use by another gpumesh node") && err.contains("--data-dir"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), before);
    assert_eq!(client(&first).status().await.unwrap().members.len(), 1);
    stop(vec![first]).await;
    // Stopped, it lets the directory go: the same node starts on it again.
    let again = MeshNode::start(config(dir.path(), Formation::Init, &[]))
        .await
        .unwrap();
    assert_eq!(client(&again).status().await.unwrap().members.len(), 1);
    stop(vec![again]).await;
}

#[tokio::test]
async fn an_unreachable_api_is_named() {
    let err = Client::new("127.0.0.1:9").status().await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("127.0.0.1:9") && msg.contains("is a node running there"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_that_never_answers_fails_the_join_clearly() {
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap();
    let mut c = config(dir.path(), Formation::Join, &[addr]);
    c.join_timeout = Duration::from_secs(2);
    let err = tokio::time::timeout(LIMIT, MeshNode::start(c))
        .await
        .expect("bounded")
        .err()
        .expect("fails");
    let msg = err.to_string();
    assert!(
        msg.contains("no mesh member answered") && msg.contains(&port.to_string()),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_data_dir_of_another_mesh_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        // A node of mesh X, stopped.
        let other = MeshNode::start(config(&dir.path().join("x"), Formation::Init, &[]))
            .await
            .unwrap();
        other.stop().await;
        // Mesh Y.
        let y = mesh(&dir.path().join("y"), 1).await;
        // X's data dir pointed at Y.
        let mut c = config(&dir.path().join("x"), Formation::Join, &[seed(&y[0])]);
        c.join_timeout = Duration::from_secs(5);
        // Its storage is initialised, so it comes back as a member of X, never of Y:
        // Y's frames carry another cluster id and are refused, and Y's records stay Y's.
        if let Ok(x) = MeshNode::start(c).await {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let status = client(&y[0]).status().await.unwrap();
            assert_eq!(status.members.len(), 1, "mesh Y did not absorb X's node");
            x.stop().await;
        }
        stop(y).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_expect_forms_one_mesh_of_all_founders() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        // Three different ports, out of the OS's ephemeral range (see free_port).
        let mut ports: Vec<u16> = Vec::new();
        while ports.len() < 3 {
            let p = gpumesh::process::free_port().unwrap();
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        let addr = |p: u16| -> Multiaddr { format!("/ip4/127.0.0.1/tcp/{p}").parse().unwrap() };
        let configs: Vec<NodeConfig> = (0..3)
            .map(|i| {
                let others: Vec<Multiaddr> =
                    (0..3).filter(|&j| j != i).map(|j| addr(ports[j])).collect();
                let mut c = config(
                    &dir.path().join(format!("f{i}")),
                    Formation::BootstrapExpect(3),
                    &others,
                );
                c.listen = vec![addr(ports[i])];
                c
            })
            .collect();
        let mut starts = configs.into_iter().map(MeshNode::start);
        let (a, b, c) = tokio::join!(
            starts.next().unwrap(),
            starts.next().unwrap(),
            starts.next().unwrap()
        );
        let nodes = vec![a.unwrap(), b.unwrap(), c.unwrap()];
        let status = client(&nodes[1]).status().await.unwrap();
        assert_eq!(status.members.len(), 3, "{status:?}");
        assert!(
            status.members.iter().all(|m| m.role == "voter"),
            "all founders vote: {status:?}"
        );
        let problem = builtins::get("vector_add").unwrap().problem(4096).unwrap();
        let task = submit(&client(&nodes[2]), &problem, 3).await;
        client(&nodes[2]).wait(task, |_, _| {}).await.unwrap();
        problem
            .verify(&client(&nodes[0]).results(task).await.unwrap())
            .unwrap();
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}
