//! Cancelling a task through any node: it is marked cancelled at once, no shard of
//! it starts after that (a shard already on a GPU runs to its end), its outputs are
//! never served, and the mesh goes on with the next task. A finished task or an
//! unknown one cannot be cancelled, and says why.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::{Duration, Instant};

use common::{client, have_any, lcg_spec, mesh, metric, stop, submit, LIMIT};
use gpumesh::node::api::TaskState;
use gpumesh::shaders::builtins;

/// GPU dispatches over the nodes (one per shard of the task below).
async fn dispatches(nodes: &[gpumesh::node::MeshNode]) -> f64 {
    let mut total = 0.0;
    for n in nodes {
        total += metric(n, "gpumesh_gpu_dispatches_total").await;
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancelled_task_stops_starting_shards_serves_no_output_and_the_mesh_goes_on() {
    if !have_any() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    tokio::time::timeout(LIMIT, async {
        let nodes = mesh(dir.path(), 2).await;
        let (a, b) = (client(&nodes[0]), client(&nodes[1]));

        // 24 shards of seconds of work in all, one at a time on each node.
        const SHARDS: u32 = 24;
        let task = a.submit(lcg_spec(12_000, SHARDS), None).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !a
            .task(task)
            .await
            .unwrap()
            .shards
            .iter()
            .any(|s| s.state == "running")
        {
            assert!(Instant::now() < deadline, "no shard of t{task} ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = dispatches(&nodes).await;
        let view = b.cancel(task, Some("wrong input")).await.unwrap();
        assert_eq!(view.status, TaskState::Cancelled, "{view:#?}");
        assert!(view.reason.as_deref().unwrap().contains("wrong input"));

        // What was on a GPU ends; nothing more of the task starts.
        let mut last = dispatches(&nodes).await;
        let mut still = Instant::now();
        while still.elapsed() < Duration::from_secs(2) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = dispatches(&nodes).await;
            if now != last {
                (last, still) = (now, Instant::now());
            }
        }
        assert!(
            last - before <= nodes.len() as f64,
            "{} dispatches after the cancel; at most one already under way per node",
            last - before
        );
        assert!(last < f64::from(SHARDS), "the whole task ran");
        for c in [&a, &b] {
            let t = c.task(task).await.unwrap();
            assert_eq!(t.status, TaskState::Cancelled);
            let refused = c.results(task).await.unwrap_err().to_string();
            assert!(
                refused.contains("did not complete: wrong input"),
                "{refused}"
            );
        }

        // The mesh goes on: the next task runs and is right.
        let problem = builtins::get("vector_add")
            .unwrap()
            .problem(256 * 8)
            .unwrap();
        let next = submit(&b, &problem, 2).await;
        a.wait(next, |_, _| {}).await.unwrap();
        problem.verify(&a.results(next).await.unwrap()).unwrap();

        // A retried cancel answers as the first; a finished task, an unknown one,
        // refuse and say why.
        assert_eq!(
            a.cancel(task, None).await.unwrap().status,
            TaskState::Cancelled
        );
        let done = b.cancel(next, None).await.unwrap_err().to_string();
        assert!(done.contains("already finished (completed)"), "{done}");
        let unknown = a.cancel(987_654, None).await.unwrap_err().to_string();
        assert!(unknown.contains("no task t987654"), "{unknown}");

        // From the command line, through the other node.
        let long = a.submit(lcg_spec(12_000, SHARDS), None).await.unwrap();
        let api = nodes[1].api_addr.to_string();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpumesh"))
            .args(["cancel", &format!("t{long}"), "--reason", "from the CLI"])
            .args(["--api", &api])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{said} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains(&format!("t{long} cancelled")), "{said}");
        let t = a.task(long).await.unwrap();
        assert_eq!(t.status, TaskState::Cancelled);
        assert!(t.reason.as_deref().unwrap().contains("from the CLI"));
        stop(nodes).await;
    })
    .await
    .expect("bounded");
}
