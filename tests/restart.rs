//! The whole mesh killed at once, as a power cut would: three `gpumesh node`
//! processes joined by ticket, all three sent SIGKILL with a task mid-run and an
//! actor's calls acknowledged, then started again on their data directories (no
//! --peer, no ticket). The mesh comes back with every acknowledged task and call: a
//! finished task's result on every node, the task cut short finished with the CPU
//! reference's result, the actor's state with every call counted once, and new
//! work runs.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::Duration;

use common::procs::three_voters as ready;
use common::{count_call, counted, have_any, lcg_finished_right, lcg_spec};
use gpumesh::node::api::TaskState;
use gpumesh::Client;

/// Workgroups of the task cut short: seconds of work on a software adapter.
const GROUPS: u32 = 6000;

const WORDS: u32 = 256;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_mesh_killed_at_once_comes_back_with_every_acknowledged_task_and_call() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = common::procs::three(root.path());
    ready(&procs).await;
    let clients: Vec<Client> = procs.iter().map(|p| p.client().unwrap()).collect();

    // Before the cut: a finished task, an actor called three times, and a task
    // acknowledged and running.
    let done = clients[1].submit(lcg_spec(64, 3), None).await.unwrap();
    lcg_finished_right(&clients[2], done, 64).await;
    common::create_counter(&clients[0], "counter", WORDS).await;
    for expect in 1..=3 {
        let reply = clients[expect as usize % 3]
            .call_actor("counter", count_call(WORDS), None)
            .await
            .unwrap();
        assert_eq!(reply.version, expect);
    }
    let cut_short = clients[2].submit(lcg_spec(GROUPS, 6), None).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let view = clients[0].task(cut_short).await.unwrap();
        if view.shards.iter().any(|s| s.state == "running") {
            break;
        }
        assert!(
            view.status == TaskState::Pending || view.status == TaskState::Running,
            "the long task ended before the cut: {view:#?}"
        );
        assert!(std::time::Instant::now() < deadline, "no shard ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The cut, then every node started again as it was, with nothing to go on but
    // its data directory.
    for p in &mut procs {
        p.kill9();
    }
    let cut_at = std::time::Instant::now();
    for p in &mut procs {
        p.start(&[]).unwrap();
    }
    ready(&procs).await;
    eprintln!(
        "three live voters again {:?} after the cut",
        cut_at.elapsed()
    );
    let clients: Vec<Client> = procs.iter().map(|p| p.client().unwrap()).collect();

    lcg_finished_right(&clients[0], cut_short, GROUPS).await;
    for c in &clients {
        lcg_finished_right(c, done, 64).await;
        lcg_finished_right(c, cut_short, GROUPS).await;
    }
    let actor = clients[1].actor("counter").await.unwrap();
    assert_eq!(actor.version, 3, "{actor:?}");
    for c in &clients {
        counted(c, "counter", WORDS, 3).await;
    }
    // And the mesh goes on: the counter counts on, new tasks run.
    let reply = clients[2]
        .call_actor("counter", count_call(WORDS), None)
        .await
        .unwrap();
    assert_eq!(reply.version, 4);
    counted(&clients[0], "counter", WORDS, 4).await;
    let after = clients[1].submit(lcg_spec(64, 2), None).await.unwrap();
    lcg_finished_right(&clients[0], after, 64).await;
    for p in &mut procs {
        p.kill9();
    }
}
