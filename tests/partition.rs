//! A GPU actor's host cut off by a real partition, not killed: three `gpumesh node`
//! processes in network namespaces (root and `ip`; skipped loudly elsewhere), joined
//! by ticket as the README starts them. The two others move the actor and go on
//! counting and running tasks; the host, alive on the other side, acknowledges no
//! call, serves no actor state or view it cannot confirm is current, and shows the
//! tasks it knows marked as its own copy; mended, it serves the mesh's state,
//! and every acknowledged call is counted once. And a member removed while cut off
//! learns it once mended, and stops.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::{Duration, Instant};

use common::netns::{nodes, Namespaces};
use common::procs::Proc;
use common::{count_call, counted, have_any, salted_spec};
use gpumesh::consensus::RequestId;
use gpumesh::node::api::TaskState;
use gpumesh::Client;

const WORDS: u32 = 256;

/// Calls the counter `n` times through `via`; the versions acknowledged.
async fn count(via: &Client, n: usize) -> Vec<u64> {
    let mut versions = Vec::new();
    for _ in 0..n {
        let sent = Instant::now();
        let reply = via
            .call_actor("counter", count_call(WORDS), None)
            .await
            .unwrap();
        eprintln!("version {} in {:?}", reply.version, sent.elapsed());
        versions.push(reply.version);
    }
    versions
}

/// Three node processes in namespaces of their own, joined as the README starts
/// them, and their clients, once one leader counts three live voters; `None` where
/// there is no adapter, or (said loudly) where namespaces cannot be made. The
/// temporary directory holds their data dirs.
async fn three_in_namespaces() -> Option<(Namespaces, Vec<Proc>, Vec<Client>, tempfile::TempDir)> {
    if !have_any() {
        return None;
    }
    let ns = match Namespaces::make(3) {
        Ok(ns) => ns,
        Err(why) => {
            assert!(
                std::env::var("GPUMESH_REQUIRE_NETNS").is_err(),
                "GPUMESH_REQUIRE_NETNS is set but network namespaces cannot be made: {why}"
            );
            common::skipped(&format!(
                "NO NETWORK NAMESPACES ({why}): the partition tests did not run"
            ));
            return None;
        }
    };
    let root = tempfile::tempdir().unwrap();
    let mut procs = nodes(root.path(), 3, Some(&ns));
    procs[0].start(&["--init"]).unwrap();
    let ticket = procs[0].ticket().unwrap();
    for p in &mut procs[1..] {
        p.start(&["--join", &ticket]).unwrap();
    }
    common::procs::three_voters(&procs).await;
    let clients = procs.iter().map(|p| p.client().unwrap()).collect();
    Some((ns, procs, clients, root))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actors_host_cut_off_acknowledges_nothing_and_serves_no_stale_state() {
    let Some((mut ns, mut procs, clients, _root)) = three_in_namespaces().await else {
        return;
    };

    common::create_counter(&clients[0], "counter", WORDS).await;
    assert_eq!(count(&clients[1], 3).await, vec![1, 2, 3]);
    let before = clients[1].submit(salted_spec(4096, 1), None).await.unwrap();
    clients[1].wait(before, |_, _| {}).await.unwrap();

    // Cut the host off from both others: it runs on, unheard.
    let host = clients[0].actor("counter").await.unwrap();
    let h = procs
        .iter()
        .position(|p| p.seed.ends_with(&host.node))
        .unwrap_or_else(|| panic!("no process hosts {host:?}"));
    let others: Vec<usize> = (0..3).filter(|&i| i != h).collect();
    for &o in &others {
        ns.cut(h, o);
    }
    let cut_at = Instant::now();
    let leader = clients[others[0]].status().await.unwrap().leader;
    eprintln!(
        "cut off node {h} (raft id {:x}, the leader: {})",
        procs[h].raft_id,
        leader == procs[h].raft_id
    );

    // The majority moves the actor and counts on, through both of its nodes.
    let mut versions = vec![1, 2, 3];
    versions.extend(count(&clients[others[0]], 2).await);
    versions.extend(count(&clients[others[1]], 2).await);
    versions.sort_unstable();
    assert_eq!(versions, (1..=7).collect::<Vec<u64>>());
    let after = clients[others[0]]
        .submit(salted_spec(4096, 2), None)
        .await
        .unwrap();
    let sent = Instant::now();
    clients[others[0]].wait(after, |_, _| {}).await.unwrap();
    eprintln!("a task through the majority in {:?}", sent.elapsed());
    let moved = clients[others[0]].actor("counter").await.unwrap();
    assert_ne!(
        moved.node, host.node,
        "moved off the cut-off host: {moved:?}"
    );
    eprintln!(
        "7 calls acknowledged, the last {:?} after the cut",
        cut_at.elapsed()
    );

    // The cut-off host: no call acknowledged, and no read of the three calls it saw
    // passed off as the state (the mesh's is at 7).
    let cut_off = clients[h].clone().retry_for(Duration::from_secs(4));
    let lone = RequestId::new(0x9A27, 1);
    // (It fails as soon as the host, long without a leader, gives its proposal up:
    // about a second, then the client's own retries of the 503.)
    let call = cut_off.call_actor("counter", count_call(WORDS), Some(lone));
    let sent = Instant::now();
    match tokio::time::timeout(Duration::from_secs(30), call).await {
        Ok(Ok(reply)) => panic!("a call through the cut-off host was acknowledged: {reply:?}"),
        Ok(Err(e)) => eprintln!("a call through the cut-off host, {:?}: {e}", sent.elapsed()),
        Err(_) => panic!("a call through the cut-off host: no answer within 30 s"),
    }
    match cut_off.actor_state("counter", 0).await {
        Ok(state) => panic!(
            "the cut-off host served the state as current: word 0 = {}",
            u32::from_le_bytes([state[0], state[1], state[2], state[3]])
        ),
        Err(e) => eprintln!("its state: {e}"),
    }
    match cut_off.actor("counter").await {
        Ok(view) => panic!("the cut-off host served its view as current: {view:?}"),
        Err(e) => eprintln!("its view: {e}"),
    }
    // A task it knows is shown as its own copy, marked so; one made since on the
    // other side is not said never to have been made.
    let known = cut_off.task(before).await.unwrap();
    assert_eq!(known.status, TaskState::Completed);
    assert!(known.unconfirmed.is_some(), "{known:?}");
    let e = cut_off.task(after).await.unwrap_err().to_string();
    assert!(e.contains(&format!("does not know task t{after}")), "{e}");

    // Mended, every node serves the mesh's state: the 7 calls, and the call tried
    // through the cut-off host at most once (its request id is one call).
    ns.mend_all();
    common::procs::three_voters(&procs).await;
    let now = clients[h].actor("counter").await.unwrap();
    assert!(
        now.version == 7 || now.version == 8,
        "7 acknowledged calls and one unacknowledged: {now:?}"
    );
    let calls = now.version as u32;
    let task = clients[h].task(after).await.unwrap();
    assert!(task.unconfirmed.is_none(), "{task:?}");
    assert_eq!(
        clients[h].results(after).await.unwrap()[&0],
        common::salted_expected(4096, 2)
    );
    for c in &clients {
        counted(c, "counter", WORDS, calls).await;
    }
    // A retry of the unacknowledged call is answered, and runs it at most once.
    let reply = clients[h]
        .call_actor("counter", count_call(WORDS), Some(lone))
        .await
        .unwrap();
    assert_eq!(reply.version, 8, "the lone call ran once in all: {reply:?}");
    for c in &clients {
        counted(c, "counter", WORDS, 8).await;
    }
    for p in &mut procs {
        p.kill9();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_removed_while_cut_off_learns_it_once_mended_and_stops() {
    let Some((mut ns, mut procs, clients, _root)) = three_in_namespaces().await else {
        return;
    };
    let gone = procs[2].raft_id;
    ns.cut(2, 0);
    ns.cut(2, 1);
    // Refused while the others still count it as running; done once it is silent.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match clients[0].remove_member(gone).await {
            Ok(()) => break,
            Err(e) => {
                let e = e.to_string();
                assert!(Instant::now() < deadline, "never removed: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while clients[1]
        .status()
        .await
        .map_or(true, |st| st.members.len() != 2)
    {
        assert!(
            Instant::now() < deadline,
            "the removal never reached node 1"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Mended, the removed node hears no leader, asks the members whether it still
    // is one, learns that it is not, marks its data dir and stops, saying so.
    ns.mend_all();
    let exit = procs[2].wait_exit(Duration::from_secs(60)).unwrap();
    let log = std::fs::read_to_string(procs[2].log_path()).unwrap();
    // 1, not the 75 of a full disk: starting it again will not help.
    assert!(
        exit.is_some_and(|s| s.code() == Some(1)),
        "the removed node did not stop by itself with status 1 ({exit:?}): {log}"
    );
    assert!(log.contains("no longer a member of its mesh"), "{log}");
    let err = procs[2].start(&[]).unwrap_err().to_string();
    assert!(err.contains("was removed from mesh"), "{err}");
    // The two go on: an actor made and called through each.
    common::create_counter(&clients[0], "counter", WORDS).await;
    count(&clients[0], 1).await;
    count(&clients[1], 1).await;
    counted(&clients[1], "counter", WORDS, 2).await;
    for p in &mut procs {
        p.kill9();
    }
}
