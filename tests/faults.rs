//! Faults with real nodes in one process: a node or the leader dying mid-task, a
//! straggler, replicas that disagree, a shader that never ends. Every acknowledged
//! task must still finish with the CPU reference's result, and nothing twice.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::Duration;

use common::*;
use gpumesh::node::api::TaskState;
use gpumesh::node::{Faults, MeshNode};
use gpumesh::protocol::{BackendKind, ShaderSource};
use gpumesh::shaders::builtins;
use gpumesh::shaders::BackendChoice;

async fn leader(nodes: &[MeshNode]) -> usize {
    let st = client(&nodes[0]).status().await.unwrap();
    nodes.iter().position(|n| n.raft_id == st.leader).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_dies_mid_task_has_its_shards_moved_and_the_task_completes() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh_with(dir.path(), 3, |i, c| {
            c.down_after = Duration::from_secs(2);
            c.scheduler.straggler_min = Duration::from_secs(600);
            if i == 2 {
                // Holds its shards until it dies.
                c.faults.gpu_delay = Some(Duration::from_secs(600));
            }
        })
        .await;
        let b = builtins::get("histogram").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        // Wait until node 2 holds some shard, then kill it (no goodbye). Placement
        // may pass it over (on a loaded machine it can be judged down for a moment,
        // or its adapter not yet recorded): then that task finishes on the others
        // and another one is submitted.
        let victim = nodes[2].raft_id;
        let mut tries = 0;
        let task = 'placed: loop {
            tries += 1;
            let task = submit(&client(&nodes[0]), &problem, 6).await;
            loop {
                let v = client(&nodes[0]).task(task).await.unwrap();
                if v.shards
                    .iter()
                    .any(|s| s.attempts.iter().any(|a| a.0 == victim))
                {
                    break 'placed task;
                }
                if v.status.is_finished() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let status = client(&nodes[0]).status().await.unwrap();
            assert!(
                tries < 10,
                "node 2 was given no shard in {tries} tasks: {status:#?}"
            );
        };
        nodes.pop().unwrap().stop().await;
        let view = client(&nodes[1]).wait(task, |_, _| {}).await.unwrap();
        assert_eq!(view.status, TaskState::Completed, "{view:#?}");
        assert!(
            view.history
                .iter()
                .any(|e| e.what.contains("stopped answering")),
            "{:#?}",
            view.history
        );
        accepted_once(&view);
        for n in &nodes {
            problem
                .verify(&client(n).results(task).await.unwrap())
                .unwrap();
        }
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_dies_mid_task_and_the_new_leader_finishes_it() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let mut nodes = mesh_with(dir.path(), 3, |_, c| {
            c.down_after = Duration::from_secs(2);
            c.faults.gpu_delay = Some(Duration::from_millis(700));
        })
        .await;
        let b = builtins::get("vector_add").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        let l = leader(&nodes).await;
        let via = (l + 1) % 3;
        let task = submit(&client(&nodes[via]), &problem, 6).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        nodes.remove(l).stop().await;
        let view = client(&nodes[0]).wait(task, |_, _| {}).await.unwrap();
        assert_eq!(view.status, TaskState::Completed, "{view:#?}");
        accepted_once(&view);
        let st = client(&nodes[0]).status().await.unwrap();
        assert!(nodes.iter().any(|n| n.raft_id == st.leader), "a new leader");
        for n in &nodes {
            problem
                .verify(&client(n).results(task).await.unwrap())
                .unwrap();
        }
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_straggler_is_copied_elsewhere_and_the_first_result_wins() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh_with(dir.path(), 2, |i, c| {
            c.scheduler.straggler_min = Duration::from_secs(1);
            if i == 1 {
                c.faults.gpu_delay = Some(Duration::from_secs(40));
            }
        })
        .await;
        let b = builtins::get("vector_add").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        let task = submit(&client(&nodes[0]), &problem, 2).await;
        let view = client(&nodes[0]).wait(task, |_, _| {}).await.unwrap();
        assert_eq!(view.status, TaskState::Completed);
        // Node 1 sleeps 40 s before each shard: every result that won came from
        // node 0, so the task did not wait for the straggler.
        for s in &view.shards {
            assert_eq!(
                s.node,
                Some(nodes[0].raft_id),
                "shard {}: {view:#?}",
                s.index
            );
        }
        let said = |s: &str| view.history.iter().any(|e| e.what.contains(s));
        assert!(said("(speculative)"), "{:#?}", view.history);
        assert!(said("cancelled: a result won"), "{:#?}", view.history);
        accepted_once(&view);
        problem
            .verify(&client(&nodes[1]).results(task).await.unwrap())
            .unwrap();
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_on_vulkan_and_gl_outvote_a_faulty_node() {
    if !(have(BackendKind::Vulkan) && have(BackendKind::Gl)) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        // Node 1 is the only GL node, so every shard has a replica there; it flips
        // a bit in everything it computes.
        let nodes = mesh_with(dir.path(), 3, |i, c| {
            c.backend = BackendChoice::Only(if i == 1 {
                BackendKind::Gl
            } else {
                BackendKind::Vulkan
            });
            c.faults = Faults {
                corrupt_outputs: i == 1,
                ..Faults::default()
            };
        })
        .await;
        let b = builtins::get("histogram").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        for (id, bytes) in &problem.blobs {
            client(&nodes[0]).upload(bytes.to_vec()).await.unwrap();
            let _ = id;
        }
        let mut spec = problem.spec(2);
        spec.options.replicas = 2;
        let task = client(&nodes[0]).submit(spec, None).await.unwrap();
        let view = client(&nodes[2]).wait(task, |_, _| {}).await.unwrap();
        assert_eq!(view.status, TaskState::Completed, "{view:#?}");
        assert_eq!(view.mismatches, 2, "{:#?}", view.history);
        accepted_once(&view);
        problem
            .verify(&client(&nodes[1]).results(task).await.unwrap())
            .unwrap();
        let tasks = client(&nodes[1]).tasks().await.unwrap();
        assert_eq!(tasks.iter().find(|t| t.id == task).unwrap().mismatches, 2);

        // Floats from two backends agree within a tolerance, compared by the leader.
        let b = builtins::get("linreg_grad").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        for bytes in problem.blobs.values() {
            client(&nodes[0]).upload(bytes.to_vec()).await.unwrap();
        }
        let mut spec = problem.spec(2);
        spec.options.replicas = 2;
        spec.options.tolerance = Some(1e-4);
        let task = client(&nodes[0]).submit(spec, None).await.unwrap();
        let view = client(&nodes[0]).wait(task, |_, _| {}).await.unwrap();
        // The faulty GL node's flipped bit is far outside the tolerance.
        assert_eq!(view.status, TaskState::Completed, "{view:#?}");
        assert!(
            view.history.iter().any(|e| e.what.contains("agree")),
            "{:#?}",
            view.history
        );
        problem
            .verify(&client(&nodes[0]).results(task).await.unwrap())
            .unwrap();
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_loop_past_the_nodes_bound_is_stopped_and_its_task_refused_long_before_its_deadline() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        // Under Mesa's own cap (65,535), so the node's bound is what stops loops here.
        let nodes = mesh_with(dir.path(), 1, |_, config| {
            config.limits.max_loop_turns = 30_000;
        })
        .await;
        let c = client(&nodes[0]);
        // A deadline it never comes near: the bound ends it first.
        let runaway = runaway_spec(4_000, 600_000);
        // The LCG in a loop left at an exact count (open-ended, as far as a node
        // can see).
        let open_lcg = |steps: u32| {
            let mut spec = lcg_spec(64, 1);
            spec.shader = ShaderSource::Wgsl(LCG.replace(
                "for (var i = 0u; i < 60000u; i++) {",
                &format!("var i = 0u;\n    loop {{\n        if (i == {steps}u) {{ break; }}\n        i = i + 1u;"),
            ));
            spec
        };
        // The never-ending kernel, and ones that would end but only past the bound
        // (60,000 steps, open-ended or counted): each refused, naming the flag, and
        // not retried.
        for spec in [runaway, open_lcg(60_000), lcg_spec(64, 1)] {
            let task = c.submit(spec, None).await.unwrap();
            let err = c.wait(task, |_, _| {}).await.unwrap_err().to_string();
            assert!(err.contains("--max-loop-turns"), "{err}");
            let view = c.task(task).await.unwrap();
            assert_eq!(view.shards[0].failures, 0, "not retried: {view:#?}");
        }
        // Under the bound, both answer as the CPU does, on the same node.
        let (_, out) = c.run(open_lcg(20_000)).await.unwrap();
        assert_eq!(out[&0], lcg_after(20_000, 64 * 64));
        let mut counted = lcg_spec(64, 1);
        counted.shader = ShaderSource::Wgsl(LCG.replace("60000u", "20000u"));
        let (_, out) = c.run(counted).await.unwrap();
        assert_eq!(out[&0], lcg_after(20_000, 64 * 64));
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_shader_that_never_ends_fails_its_task_and_the_node_keeps_serving() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh_with(dir.path(), 1, |_, _| {}).await;
        let spec = runaway_spec(4_000, 1000);
        let c = client(&nodes[0]);
        let task = c.submit(spec, None).await.unwrap();
        let err = c.wait(task, |_, _| {}).await.unwrap_err().to_string();
        assert!(err.contains("failed") && runaway_stopped(&err), "{err}");
        let view = c.task(task).await.unwrap();
        assert_eq!(view.shards[0].failures, 0, "not retried: {view:#?}");
        // The same node runs the next task.
        let b = builtins::get("vector_add").unwrap();
        let problem = b.problem(b.test_size).unwrap();
        let next = submit(&c, &problem, 1).await;
        c.wait(next, |_, _| {}).await.unwrap();
        problem.verify(&c.results(next).await.unwrap()).unwrap();
        stop(nodes).await;
    })
    .await
    .expect("test exceeded its time limit");
}
