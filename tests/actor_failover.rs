//! A GPU actor outlives its host: three `gpumesh node` processes joined by ticket, a
//! counter actor called through two nodes, its host killed with SIGKILL between
//! calls; every acknowledged call counted exactly once in the final state. Once with
//! a state small enough to ride in the record, once with 2 MiB that every call
//! rewrites (its second copy pulled whole from the host at each call). And in a mesh
//! of five, both nodes holding an actor's state killed at once: a call says why it
//! cannot run, and runs once one of them is back. And `gpumesh actor call` through a
//! node killed mid-call: run once, answered once the node is back, or said to have
//! maybe run when it is not; given a second node, answered through it.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{count_call, counted, have_any};
use gpumesh::{Client, ClientError};

/// Calls the counter of `words` words `n` times through `via`, one after another,
/// each retried (one request id) until acknowledged.
async fn count(via: Client, words: u32, n: usize) -> Vec<u64> {
    let mut versions = Vec::new();
    for _ in 0..n {
        let reply = via
            .call_actor("counter", count_call(words), None)
            .await
            .unwrap();
        versions.push(reply.version);
    }
    versions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_survives_its_host_killed_and_counts_every_acknowledged_call_once() {
    survives_its_host_killed(256).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_counter_survives_its_host_killed_and_counts_every_acknowledged_call_once() {
    survives_its_host_killed(1 << 19).await;
}

async fn survives_its_host_killed(words: u32) {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = common::procs::three(root.path());
    let clients: Vec<Client> = procs.iter().map(|p| p.client().unwrap()).collect();
    // Three voters with adapters: the mesh keeps a quorum without any one node, and
    // the actor has a host and a backup.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = clients[0].status().await.unwrap();
        let voters = st.members.iter().filter(|m| m.role == "voter").count();
        if voters == 3 && st.members.iter().all(|m| m.adapter.is_some() && m.alive) {
            break;
        }
        assert!(Instant::now() < deadline, "the mesh never formed: {st:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    common::create_counter(&clients[0], "counter", words).await;
    let before = count(clients[1].clone(), words, 3).await;
    assert_eq!(before, vec![1, 2, 3]);

    // Kill the host, then count through the two others while it moves.
    let host = clients[0].actor("counter").await.unwrap();
    let victim = procs
        .iter()
        .position(|p| p.seed.ends_with(&host.node))
        .unwrap_or_else(|| panic!("no process hosts {host:?}"));
    procs[victim].kill9();
    let killed_at = Instant::now();
    let survivors: Vec<Client> = (0..3)
        .filter(|i| *i != victim)
        .map(|i| clients[i].clone())
        .collect();
    let calls: Vec<_> = survivors
        .iter()
        .map(|c| tokio::spawn(count(c.clone(), words, 4)))
        .collect();
    let mut versions = before.clone();
    for c in calls {
        versions.extend(c.await.unwrap());
    }
    eprintln!(
        "11 calls acknowledged; the last {:?} after the kill",
        killed_at.elapsed()
    );
    // Every acknowledged call made its own version: none lost, none twice.
    versions.sort_unstable();
    assert_eq!(versions, (1..=11).collect::<Vec<u64>>());

    let moved = survivors[0].actor("counter").await.unwrap();
    assert_eq!(moved.version, 11, "{moved:?}");
    assert!(moved.epoch >= 2 && moved.moves >= 1, "moved: {moved:?}");
    assert_ne!(moved.node, host.node, "a new host");
    for c in &survivors {
        counted(c, "counter", words, 11).await;
    }
    for p in &mut procs {
        p.kill9();
    }
}

/// Both copies of an actor's state gone at once: its host and the node keeping the
/// second copy killed with SIGKILL, in a mesh of five that keeps its quorum. A call
/// through a survivor fails with why (the state's blob on no node its new host could
/// reach, the two named), not left to wait for nothing, and the state stays as it
/// was: once the node with the second copy is back, the next call runs on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_to_an_actor_whose_state_is_on_no_live_node_fails_saying_why_and_the_state_waits() {
    if !have_any() {
        return;
    }
    // Over the 16 KiB the record holds itself: the state lives on two nodes.
    const WORDS: u32 = 8192;
    let root = tempfile::tempdir().unwrap();
    let (mut procs, _) = common::procs::joined(root.path(), &["a", "b", "c", "d", "e"]);
    common::procs::voters(&procs, 5).await;
    let clients: Vec<Client> = procs.iter().map(|p| p.client().unwrap()).collect();
    common::create_counter(&clients[0], "counter", WORDS).await;
    assert_eq!(count(clients[1].clone(), WORDS, 3).await, vec![1, 2, 3]);

    let actor = clients[0].actor("counter").await.unwrap();
    let hex = |p: &common::procs::Proc| format!("{:x}", p.raft_id);
    let is_backup = |p: &common::procs::Proc| actor.backup.as_ref() == Some(&hex(p));
    let holders: Vec<usize> = (0..procs.len())
        .filter(|&i| hex(&procs[i]) == actor.host || is_backup(&procs[i]))
        .collect();
    assert_eq!(holders.len(), 2, "a host and a backup: {actor:?}");
    let named: Vec<String> = holders.iter().map(|&i| hex(&procs[i])).collect();
    for &i in &holders {
        procs[i].kill9();
    }
    let via = (0..procs.len()).find(|i| !holders.contains(i)).unwrap();
    let patient = clients[via].clone().retry_for(Duration::from_secs(120));
    let why = match patient.call_actor("counter", count_call(WORDS), None).await {
        Err(ClientError::Refused(why)) => why,
        other => panic!("the call cannot have run: {other:?}"),
    };
    eprintln!("{why}");
    assert!(why.contains("state (version 3) is on no node"), "{why}");
    for holder in &named {
        assert!(
            why.contains(holder.as_str()),
            "{holder} named as out of reach: {why}"
        );
    }

    // The node with the second copy back: the next call runs on the state kept.
    let back = holders
        .iter()
        .copied()
        .find(|&i| is_backup(&procs[i]))
        .unwrap();
    procs[back].start(&[]).unwrap();
    let reply = patient
        .call_actor("counter", count_call(WORDS), None)
        .await
        .unwrap();
    assert_eq!(reply.version, 4);
    counted(&patient, "counter", WORDS, 4).await;
    for p in &mut procs {
        p.kill9();
    }
}

/// Counts every word of the state, as [`common::COUNT`] does, after 60,000 turns of
/// an LCG in every invocation: about a second a call on a software adapter, long
/// enough to kill a node while a call is on its way.
const SLOW_COUNT: &str = "@group(0) @binding(0) var<storage, read_write> count: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < 60000u; i++) {
        x = x * 1664525u + 1013904223u;
    }
    if (gid.x < arrayLength(&count)) {
        count[gid.x] = count[gid.x] + 1u + (x & 0u);
    }
}
";

/// `gpumesh actor call counter KERNEL --grid 4000` through the node or nodes at `api`
/// (`--api`).
fn call_through(kernel: &std::path::Path, api: &str, retry_for: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_gpumesh"))
        .args(["actor", "call", "counter"])
        .arg(kernel)
        .args(["--grid", "4000", "--retry-for", retry_for, "--api", api])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cli_call_through_a_node_killed_mid_call_runs_once_or_says_it_may_have_run() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = common::procs::three(root.path());
    common::procs::three_voters(&procs).await;
    let kernel = root.path().join("slow_count.wgsl");
    std::fs::write(&kernel, SLOW_COUNT).unwrap();
    let words = 1024;
    common::create_counter(&procs[0].client().unwrap(), "counter", words).await;
    let host = procs[0]
        .client()
        .unwrap()
        .actor("counter")
        .await
        .unwrap()
        .node;
    let hex = |p: &common::procs::Proc| format!("{:x}", p.raft_id);
    // Through a node that does not host it, so that the call runs on while that
    // node is dead.
    let via = (0..3).find(|&i| hex(&procs[i]) != host).unwrap();
    let other = (0..3).find(|&i| i != via).unwrap();
    let watch = procs[other].client().unwrap();

    // 1. Killed mid-call and started again: the command answers once it is back,
    // with the call run once (the retry carries the call's request id).
    let child = call_through(&kernel, &procs[via].api_addr(), "60");
    tokio::time::sleep(Duration::from_millis(400)).await;
    procs[via].kill9();
    procs[via].start(&[]).unwrap();
    let done = common::procs::exited(child).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr),
    );
    assert!(done.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("state version 1"), "{stdout}\n{stderr}");
    assert_eq!(watch.actor("counter").await.unwrap().version, 1);
    counted(&watch, "counter", words, 1).await;

    // 2. Killed and not back within --retry-for: the command says the call may have
    // run; the record says it did (the host ran it), once.
    common::procs::three_voters(&procs).await;
    let child = call_through(&kernel, &procs[via].api_addr(), "2");
    tokio::time::sleep(Duration::from_millis(400)).await;
    procs[via].kill9();
    let done = common::procs::exited(child).await;
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success(), "{stderr}");
    assert!(stderr.contains("may have run"), "{stderr}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while watch.actor("counter").await.unwrap().version < 2 {
        assert!(Instant::now() < deadline, "the call never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(watch.actor("counter").await.unwrap().version, 2);
    counted(&watch, "counter", words, 2).await;

    // 3. Given two nodes (`--api VIA,OTHER`), the first killed mid-call: the command
    // goes on at the second with the call's request id, and answers the call, run
    // once.
    procs[via].start(&[]).unwrap();
    common::procs::three_voters(&procs).await;
    let both = format!("{},{}", procs[via].api_addr(), procs[other].api_addr());
    let child = call_through(&kernel, &both, "60");
    tokio::time::sleep(Duration::from_millis(400)).await;
    procs[via].kill9();
    let done = common::procs::exited(child).await;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr),
    );
    assert!(done.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("state version 3"), "{stdout}\n{stderr}");
    assert_eq!(watch.actor("counter").await.unwrap().version, 3);
    counted(&watch, "counter", words, 3).await;
    for p in &mut procs {
        p.kill9();
    }
}
