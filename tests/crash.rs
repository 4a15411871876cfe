//! `kill -9` of real `gpumesh node` processes mid-task, the leader first and then a
//! worker, each restarted from its data directory on the same ports: the mesh
//! finishes every task with the CPU reference's result, and the restarted nodes
//! serve the mesh's state and the results from their own disks. And `gpumesh submit
//! --wait` through a node killed so: it waits for the node to come back, or names
//! the task for fetching elsewhere.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::procs::{exited, three_voters as ready, Proc};
use common::{have_any, lcg_finished_right, LCG_STEPS as STEPS};
use gpumesh::node::api::TaskState;
use gpumesh::protocol::TaskSpec;
use gpumesh::Client;

const GROUPS: u32 = 6000;

/// The CPU reference (see [`common::lcg_after`]).
fn expected(invocations: u32) -> Vec<u8> {
    common::lcg_after(STEPS, invocations)
}

fn spec(shards: u32) -> TaskSpec {
    common::lcg_spec(GROUPS, shards)
}

/// Submits through `via` until a task has a shard running on one of the nodes `on`
/// (any node if empty); returns the task and that node. A task that finishes before
/// such a shard is seen running is left to finish and another is submitted. (A node
/// calibrated while the others were busy measures slower and may get no shard of a
/// task at all: placement follows measured speed.)
async fn submit_and_wait_running(via: &Client, on: &[u64]) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let task = via.submit(spec(6), None).await.unwrap();
        loop {
            let view = via.task(task).await.unwrap();
            let running = view
                .shards
                .iter()
                .filter(|s| s.state == "running")
                .flat_map(|s| s.attempts.iter().map(|a| a.0))
                .find(|n| on.is_empty() || on.contains(n));
            if let Some(node) = running {
                return (task, node);
            }
            if Instant::now() > deadline {
                let url = format!("http://{}/v1/overview", via.addr());
                let o: serde_json::Value = reqwest::get(url).await.unwrap().json().await.unwrap();
                panic!("no shard ran on {on:x?}: {view:#?}\n{o:#}");
            }
            if view.status != TaskState::Pending && view.status != TaskState::Running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// SIGKILLs node `i` and starts it again on its data dir, pointed at the others.
fn kill9_and_restart(procs: &mut [Proc], i: usize) {
    procs[i].kill9();
    // No --peer: the data dir holds the key and where every member listens.
    procs[i].start(&[]).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_leader_and_of_a_worker_mid_task_loses_nothing() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = common::procs::three(root.path());
    let st = ready(&procs).await;

    // 1. The leader dies mid-task and comes back.
    let leader = procs.iter().position(|p| p.raft_id == st.leader).unwrap();
    let via = (leader + 1) % 3;
    let (t1, _) = submit_and_wait_running(&procs[via].client().unwrap(), &[]).await;
    kill9_and_restart(&mut procs, leader);
    lcg_finished_right(&procs[via].client().unwrap(), t1, GROUPS).await;
    ready(&procs).await;

    // 2. A worker (not the leader) dies while running a shard and comes back.
    let st = ready(&procs).await;
    let leader = procs.iter().position(|p| p.raft_id == st.leader).unwrap();
    let followers: Vec<u64> = procs
        .iter()
        .map(|p| p.raft_id)
        .filter(|&id| id != st.leader)
        .collect();
    let (t2, busy) = submit_and_wait_running(&procs[leader].client().unwrap(), &followers).await;
    let worker = procs.iter().position(|p| p.raft_id == busy).unwrap();
    kill9_and_restart(&mut procs, worker);
    lcg_finished_right(&procs[leader].client().unwrap(), t2, GROUPS).await;

    // 3. Both restarted nodes serve both tasks from their own state and disks.
    ready(&procs).await;
    for p in &procs {
        for t in [t1, t2] {
            lcg_finished_right(&p.client().unwrap(), t, GROUPS).await;
        }
    }
}

/// `gpumesh submit --wait` of a [`spec`]-like task (the LCG kernel from a file) through
/// the node or nodes at `api` (`--api`), writing its outputs to `out`, retrying for
/// `retry_for` seconds.
fn submit_waiting(kernel: &Path, api: &str, retry_for: &str, out: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .arg("submit")
        .arg(kernel)
        .args(["--output", &format!("0:{}", GROUPS * 64 * 4)])
        .args(["--grid", &GROUPS.to_string(), "--shards", "6", "--wait"])
        .arg("--out-dir")
        .arg(out)
        .args(["--retry-for", retry_for, "--api", api])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until `watch` shows a task newer than `after` with a shard running; its id.
async fn running_after(watch: &Client, after: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let tasks = watch.tasks().await.unwrap();
        let running = tasks
            .iter()
            .find(|t| t.id > after && t.shards.iter().any(|s| s.state == "running"));
        if let Some(t) = running {
            return t.id;
        }
        assert!(Instant::now() < deadline, "no task ran: {tasks:#?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_waiting_through_a_node_killed_mid_task_waits_for_it_or_names_the_task() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = common::procs::three(root.path());
    ready(&procs).await;
    let kernel = root.path().join("lcg.wgsl");
    std::fs::write(&kernel, common::LCG).unwrap();
    let watch = procs[0].client().unwrap();
    let right = expected(GROUPS * 64);

    // 1. The node it waits through is killed mid-task and started again: the
    // command waits for it, then prints the result and writes it, right.
    let out = root.path().join("out1");
    let mut child = submit_waiting(&kernel, &procs[1].api_addr(), "60", &out);
    let first = running_after(&watch, 0).await;
    assert!(child.try_wait().unwrap().is_none(), "it was still waiting");
    kill9_and_restart(&mut procs, 1);
    let done = exited(child).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr),
    );
    assert!(done.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("t{first} completed")), "{stdout}");
    assert!(stderr.contains("does not answer"), "it waited: {stderr}");
    assert!(
        std::fs::read(out.join("0.bin")).unwrap() == right,
        "t{first} differs from the CPU reference"
    );

    // 2. Killed and not started again within --retry-for: the command fails naming
    // the task and where else to fetch it, and the task is fetched so, right.
    ready(&procs).await;
    let out = root.path().join("out2");
    let mut child = submit_waiting(&kernel, &procs[2].api_addr(), "2", &out);
    let second = running_after(&watch, first).await;
    assert!(child.try_wait().unwrap().is_none(), "it was still waiting");
    procs[2].kill9();
    let done = exited(child).await;
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("t{second} was submitted"))
            && stderr.contains(&format!("gpumesh result t{second}")),
        "{stderr}"
    );
    lcg_finished_right(&watch, second, GROUPS).await;

    // 3. Given two nodes (`--api C,A`), the first killed mid-task and not started
    // again: the command goes on at the second and prints the result, right.
    procs[2].start(&[]).unwrap();
    ready(&procs).await;
    let out = root.path().join("out3");
    let both = format!("{},{}", procs[2].api_addr(), procs[0].api_addr());
    let child = submit_waiting(&kernel, &both, "60", &out);
    let third = running_after(&watch, second).await;
    procs[2].kill9();
    let done = exited(child).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr),
    );
    assert!(done.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains(&format!("t{third} completed")), "{stdout}");
    assert!(stderr.contains("going on at"), "{stderr}");
    assert!(
        std::fs::read(out.join("0.bin")).unwrap() == right,
        "t{third} differs from the CPU reference"
    );
}

#[test]
fn the_cpu_reference_matches_stepping_the_lcg() {
    let got = expected(5);
    for x in 0..5u32 {
        let mut v = x;
        for _ in 0..STEPS {
            v = v.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        }
        assert_eq!(got[x as usize * 4..x as usize * 4 + 4], v.to_le_bytes());
    }
}
