//! Stopping and leaving, the way a user does them: three `gpumesh node` processes
//! started as the README starts them, stopped with Ctrl-C (SIGINT) and started
//! again; one taken out with `gpumesh leave` while it holds results and hosts an
//! actor; the last voter asked to leave.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::time::{Duration, Instant};

use common::procs::{node, three, three_and_ticket, three_voters, Proc};
use common::{count_call, counted, have_any};
use gpumesh::node::api::TaskState;
use gpumesh::protocol::{BlobId, TaskSpec};
use gpumesh::Client;

/// Words per task: each of its two shards' results (80 KB) is over what a Raft
/// entry carries, so it is a blob kept on two nodes.
const N: u32 = 40_003;

fn spec(salt: u32) -> TaskSpec {
    common::salted_spec(N, salt)
}

fn expected(salt: u32) -> Vec<u8> {
    common::salted_expected(N, salt)
}

/// Submits [`spec`]`(salt)` through `via`, waits for it and checks its output
/// against the CPU through `fetch`; its id.
async fn checked_task(via: &Client, fetch: &Client, salt: u32) -> u64 {
    let id = via.submit(spec(salt), None).await.unwrap();
    let view = tokio::time::timeout(Duration::from_secs(120), via.wait(id, |_, _| {}))
        .await
        .expect("the task finished")
        .unwrap();
    assert_eq!(view.status, TaskState::Completed, "{view:#?}");
    same_output(fetch, id, salt).await;
    id
}

async fn same_output(fetch: &Client, id: u64, salt: u32) {
    let out = fetch.results(id).await.unwrap().remove(&0).unwrap();
    assert!(
        out == expected(salt),
        "t{id} differs from the CPU reference"
    );
}

/// The blobs of task `id`'s shard results.
async fn result_blobs(via: &Client, id: u64) -> Vec<BlobId> {
    let view = via.task(id).await.unwrap();
    let blobs: Vec<BlobId> = view
        .shards
        .iter()
        .map(|s| {
            s.output
                .as_ref()
                .expect("an accepted result")
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(blobs.len(), 2, "{view:#?}");
    blobs
}

/// Waits until `via` knows a leader and `members` members, all alive.
async fn members(via: &Client, members: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(st) = via.status().await {
            if st.leader != 0 && st.members.len() == members && st.members.iter().all(|m| m.alive) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "never {members} live members: {st:#?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn stopped_cleanly(p: &mut Proc, signal: &str) {
    let status = p
        .stop_with(signal, Duration::from_secs(30))
        .unwrap()
        .unwrap_or_else(|| panic!("node {} did not stop within 30 s of SIG{signal}", p.name));
    assert!(
        status.success(),
        "node {} exited {status} on SIG{signal}",
        p.name
    );
}

/// Tasks [`spec`]`(salt)` for each salt, submitted and fetched through `via` (so no
/// other node pulls their results to merge them), each checked: `(id, salt)`s, and
/// their shard results' blobs.
async fn tasks_through(
    via: &Client,
    salts: std::ops::Range<u32>,
) -> (Vec<(u64, u32)>, Vec<BlobId>) {
    let (mut tasks, mut blobs) = (Vec::new(), Vec::new());
    for salt in salts {
        let id = checked_task(via, via, salt).await;
        blobs.extend(result_blobs(via, id).await);
        tasks.push((id, salt));
    }
    (tasks, blobs)
}

/// Waits (30 s at most) until `gpumesh status` through `p` prints `what`; its text.
async fn status_says(p: &Proc, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = std::process::Command::new(&p.bin)
            .args(["status", "--api", &p.api_addr()])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.contains(what) {
            return text;
        }
        assert!(Instant::now() < deadline, "gpumesh status: {text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (30 s at most) until each of `nodes` stores every one of `blobs`.
async fn all_hold(nodes: &[gpumesh::node::MeshNode], blobs: &[BlobId], why: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !blobs.iter().all(|b| nodes.iter().all(|n| n.blobs.has(b))) {
        assert!(Instant::now() < deadline, "{why}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Stops `p` with Ctrl-C, then asserts that its store holds every one of `blobs`.
fn stopped_holding(p: &mut Proc, blobs: &[BlobId]) {
    stopped_cleanly(p, "INT");
    let store = gpumesh::node::blobs::BlobStore::open(p.dir.join("blobs"), u64::MAX).unwrap();
    for blob in blobs {
        assert!(store.has(blob), "{} lacks result blob {blob}", p.name);
    }
}

/// Every node of the README's recipe stopped with Ctrl-C, then all started again on
/// their data dirs (in the opposite order, the seed last): the mesh is back with
/// its tasks, and takes new ones. (Ctrl-C used to take each node out of the mesh,
/// and a mesh whose nodes all left this way never came back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mesh_stopped_node_by_node_with_ctrl_c_comes_back_whole() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = three(root.path());
    three_voters(&procs).await;
    let clients: Vec<Client> = procs.iter().map(|p| p.client().unwrap()).collect();
    let before = checked_task(&clients[1], &clients[2], 7).await;

    stopped_cleanly(&mut procs[0], "INT");
    stopped_cleanly(&mut procs[1], "INT");
    // The one left says why nothing is served, and what to do.
    let text = status_says(&procs[2], "no quorum: 1 of the 3 voters run").await;
    assert!(text.contains("comes back on its --data-dir"), "{text}");
    stopped_cleanly(&mut procs[2], "INT");
    for p in procs.iter_mut().rev() {
        p.start(&[]).unwrap();
    }
    three_voters(&procs).await;
    // The task from before, through the node that stopped first; a new one.
    same_output(&clients[0], before, 7).await;
    checked_task(&clients[0], &clients[1], 8).await;
    // SIGTERM, as a service manager stops it, keeps it a member too.
    stopped_cleanly(&mut procs[2], "TERM");
    procs[2].start(&[]).unwrap();
    three_voters(&procs).await;
    same_output(&clients[2], before, 7).await;
}

/// `gpumesh leave` on the node that hosts an actor and holds task results: it
/// hands them to the other two, leaves, exits by itself; the mesh goes on with two
/// members, the actor moves and counts on, and each of the two keeps every result.
/// Its data dir is refused afterwards, with what to do instead; that (a new data dir)
/// joins again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_leaves_hands_off_what_it_holds_and_stays_out() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut procs = three(root.path());
    three_voters(&procs).await;
    let clients: Vec<Client> = procs.iter().map(|p| p.client().unwrap()).collect();
    // Over what the record keeps itself: a blob on two nodes.
    const WORDS: u32 = 8192;
    common::create_counter(&clients[0], "counter", WORDS).await;
    for _ in 0..3 {
        clients[1]
            .call_actor("counter", count_call(WORDS), None)
            .await
            .unwrap();
    }
    let mut tasks = Vec::new();
    for salt in 0..4 {
        tasks.push((
            checked_task(&clients[salt as usize % 3], &clients[0], salt).await,
            salt,
        ));
    }
    let mut blobs = Vec::new();
    for (id, _) in &tasks {
        blobs.extend(result_blobs(&clients[0], *id).await);
    }
    let host = clients[0].actor("counter").await.unwrap();
    let leaver = procs
        .iter()
        .position(|p| p.seed.ends_with(&host.node))
        .unwrap_or_else(|| panic!("no process hosts {host:?}"));
    let stays: Vec<usize> = (0..3).filter(|i| *i != leaver).collect();

    let out = std::process::Command::new(&procs[leaver].bin)
        .args(["leave", "--json", "--api", &procs[leaver].api_addr()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpumesh leave: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let left: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        left["blobs_handed_off"].as_u64().unwrap() >= 1,
        "the actor's host held its state: {left}"
    );
    let status = procs[leaver]
        .wait_exit(Duration::from_secs(30))
        .unwrap()
        .expect("the node stops once it has left");
    assert!(status.success(), "exited {status}");
    assert!(procs[leaver]
        .dir
        .join(gpumesh::node::mesh::LEFT_FILE)
        .exists());

    let (b, c) = (&clients[stays[0]], &clients[stays[1]]);
    members(b, 2).await;
    // The actor moves off the node that left and counts on from where it was.
    for via in [b, c] {
        via.call_actor("counter", count_call(WORDS), None)
            .await
            .unwrap();
    }
    let moved = b.actor("counter").await.unwrap();
    assert_ne!(moved.node, host.node, "{moved:?}");
    counted(c, "counter", WORDS, 5).await;
    for (id, salt) in &tasks {
        same_output(b, *id, *salt).await;
    }
    checked_task(b, c, 9).await;

    // Its data dir is refused, saying what happened and what to do.
    let err = procs[leaver].start(&[]).unwrap_err().to_string();
    assert!(
        err.contains("left mesh") && err.contains("--data-dir"),
        "{err}"
    );
    members(b, 2).await;
    // What it says to do: a new data dir joins again, as a new node.
    let ticket = procs[stays[0]].ticket().unwrap();
    procs[leaver].dir = root.path().join("again");
    procs[leaver].start(&["--join", &ticket]).unwrap();
    members(b, 3).await;
    checked_task(&clients[leaver], b, 10).await;

    // Each of the two keeps every task result: either could now be lost alone.
    for i in &stays {
        stopped_holding(&mut procs[*i], &blobs);
    }
}

/// The only voter of a mesh cannot leave it: refused with what to do, still serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_only_voter_cannot_leave() {
    let root = tempfile::tempdir().unwrap();
    let nodes = common::mesh(root.path(), 1).await;
    let client = common::client(&nodes[0]);
    let err = client.leave().await.unwrap_err().to_string();
    assert!(
        err.contains("only voter") && err.contains("Ctrl-C"),
        "{err}"
    );
    let st = client.status().await.unwrap();
    assert_eq!(st.members.len(), 1);
    assert!(!nodes[0].left().is_cancelled());
    assert!(!root
        .path()
        .join("n0")
        .join(gpumesh::node::mesh::LEFT_FILE)
        .exists());
    common::still_serves(&nodes[0], &nodes[0]).await;
    common::stop(nodes).await;
}

/// One of three nodes stopped (it stays a member): a second leaving would leave the
/// mesh a configuration of two voters with one of them gone, so no quorum; refused,
/// saying so, and the mesh goes on. The stopped one, gone for good, is removed
/// through another node (refused for a running member, for the node asked and for
/// an unknown id), and the copies of results it held are made again on the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leave_that_would_cost_the_quorum_is_refused_and_a_member_gone_is_removed() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = common::mesh(root.path(), 3).await;
    // Results kept on two of the three nodes each: some on the one to be removed
    // (submitted and fetched through it).
    let mut blobs = Vec::new();
    if have_any() {
        blobs = tasks_through(&common::client(&nodes[2]), 100..104).await.1;
    }
    let stopped = nodes.pop().unwrap();
    let gone = stopped.raft_id;
    stopped.stop().await;
    let client = common::client(&nodes[1]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = client.status().await.unwrap();
        if st.members.iter().any(|m| m.raft_id == gone && !m.alive) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stopped node still looks alive"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let err = client.leave().await.unwrap_err().to_string();
    assert!(
        err.contains("without a quorum") && err.contains("of the 2 other voters 1 run"),
        "{err}"
    );
    assert!(!nodes[1].left().is_cancelled());
    assert_eq!(client.status().await.unwrap().members.len(), 3);
    common::still_serves(&nodes[1], &nodes[0]).await;

    for (id, says) in [
        (nodes[0].raft_id, "runs"),
        (nodes[1].raft_id, "gpumesh leave"),
        (0x1234, "no member 1234"),
    ] {
        let err = client.remove_member(id).await.unwrap_err().to_string();
        assert!(err.contains(says), "{id:x}: {err}");
    }
    assert_eq!(client.status().await.unwrap().members.len(), 3);
    client.remove_member(gone).await.unwrap();
    let st = client.status().await.unwrap();
    assert_eq!(st.members.len(), 2, "{st:#?}");
    assert!(st.members.iter().all(|m| m.raft_id != gone && m.alive));
    // Each of the two now holds every result: the removed node's copies are made
    // again.
    all_hold(
        &nodes,
        &blobs,
        "the removed node's copies were not made again",
    )
    .await;
    // Two voters, both running: the mesh goes on.
    common::still_serves(&nodes[0], &nodes[1]).await;
    common::stop(nodes).await;
}

/// A member down (stopped; still a member) for `--repair-after`: the others make the
/// copies it held again, so each result is on two running members.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copies_a_member_down_held_are_made_again_on_the_others() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let mut nodes = common::mesh_with(root.path(), 3, |_, c| {
        c.repair_after = Duration::from_secs(1);
    })
    .await;
    // Through the node to be stopped: no other node pulls its results.
    let (_, blobs) = tasks_through(&common::client(&nodes[2]), 200..204).await;
    let down = nodes.pop().unwrap();
    down.stop().await;
    all_hold(
        &nodes,
        &blobs,
        "the copies the stopped node held were not made again",
    )
    .await;
    // Still a member: it is down, not removed.
    let st = common::client(&nodes[0]).status().await.unwrap();
    assert_eq!(st.members.len(), 3);
    common::stop(nodes).await;
}

/// The README's recipe, then the seed lost for good: killed with SIGKILL and removed
/// with `gpumesh remove` through another node. The two left each hold every result
/// the seed had a copy of, and go on; the seed started again on its old data dir
/// learns it was removed and stops, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_killed_and_removed_leaves_every_result_on_both_others() {
    if !have_any() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let (mut procs, first_ticket) = three_and_ticket(root.path());
    three_voters(&procs).await;
    let clients: Vec<Client> = procs.iter().map(|p| p.client().unwrap()).collect();
    // Through the seed: no other node pulls the results to merge them.
    let (tasks, blobs) = tasks_through(&clients[0], 300..304).await;
    let seed = procs[0].raft_id;
    procs[0].kill9();
    // Status says what to do about a member down.
    let text = status_says(&procs[1], &format!("down: {seed:x}")).await;
    assert!(text.contains("gpumesh remove RAFT_ID"), "{text}");
    let remove = |via: &Proc| {
        std::process::Command::new(&via.bin)
            .args(["remove", &format!("{seed:x}"), "--api", &via.api_addr()])
            .output()
            .unwrap()
    };
    // Refused while the others still count it as running; done once it is down.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = remove(&procs[1]);
        if out.status.success() {
            break;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("runs"), "gpumesh remove: {err}");
        assert!(Instant::now() < deadline, "never removed: {err}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    members(&clients[1], 2).await;
    for (id, salt) in &tasks {
        same_output(&clients[2], *id, *salt).await;
    }
    checked_task(&clients[1], &clients[2], 310).await;
    // The copies are made in the background, each node saying so when done.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !procs[1..].iter().all(|p| {
        std::fs::read_to_string(p.log_path())
            .unwrap_or_default()
            .contains("made sure another running member holds each blob here")
    }) {
        assert!(Instant::now() < deadline, "no repair pass logged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Started again on its old data dir, the removed seed hears no leader (the
    // others no longer answer it), asks them whether it is still a member, learns
    // that it is not, marks its data dir and stops, saying what to do.
    procs[0].start(&[]).unwrap();
    let exit = procs[0].wait_exit(Duration::from_secs(60)).unwrap();
    let log = std::fs::read_to_string(procs[0].log_path()).unwrap();
    // 1, not the 75 of a full disk: starting it again will not help.
    assert!(
        exit.is_some_and(|s| s.code() == Some(1)),
        "the removed seed did not stop by itself with status 1 ({exit:?}): {log}"
    );
    assert!(
        log.contains("no longer a member of its mesh") && log.contains("new --data-dir"),
        "{log}"
    );
    // The next start on that dir is refused at once, naming the removal.
    let err = procs[0].start(&[]).unwrap_err().to_string();
    assert!(
        err.contains("was removed from mesh") && err.contains("--data-dir"),
        "{err}"
    );
    members(&clients[1], 2).await;
    checked_task(&clients[1], &clients[2], 311).await;

    // A new machine given the ticket the others joined with (the seed's, naming the
    // seed alone) is told why it cannot join and to make a fresh ticket; one made on
    // b names every member, and with it the same data dir joins.
    let mut d = node(root.path(), "d");
    let err = d
        .start(&["--join", &first_ticket, "--join-timeout", "3"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no mesh member answered") && err.contains("make a fresh one"),
        "{err}"
    );
    d.start(&["--join", &procs[1].ticket().unwrap()]).unwrap();
    members(&clients[1], 3).await;
    checked_task(&d.client().unwrap(), &clients[2], 312).await;
    d.stop_with("INT", Duration::from_secs(30)).unwrap();

    for p in &mut procs[1..] {
        stopped_holding(p, &blobs);
    }
}
