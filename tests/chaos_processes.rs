//! Chaos on real processes: `gpumesh node` processes started the way the README
//! starts them (one `--init`, the rest `--join` its ticket), while tasks stream in,
//! a seeded schedule kills nodes with SIGKILL (the seed first) and restarts them on
//! their data dirs, and cuts links between them.
//!
//! Links are cut for real where the test may: run as root with `ip`, each node lives
//! in its own network namespace behind a veth pair on a bridge the test makes (and
//! removes), and a cut is a blackhole route each way, so packets vanish as on a
//! broken network. Elsewhere the schedule only kills and restarts, and says so.
//!
//! Then every fault is undone and the test checks that enough submissions were
//! acknowledged, that every acknowledged task completed exactly once with the CPU
//! reference's answer, that no submission made two tasks, and that every node
//! reports the same outputs for every task.
//!
//!   GPUMESH_CHAOS_STEPS=30 GPUMESH_CHAOS_SEEDS=1,2 cargo test --test chaos_processes -- --nocapture

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::netns::{nodes, Namespaces};
use common::procs::Proc;
use common::{accepted_once, have_any};
use gpumesh::consensus::RequestId;
use gpumesh::node::api::TaskState;
use gpumesh::protocol::TaskSpec;
use gpumesh::Client;

/// Values per task: each of its two shards' results (12 KB) is over what the record
/// keeps, so it is carried in its Raft entry and stored as a blob (in each node's
/// pack) by every node applying it, through the kills and restarts.
const N: u32 = 6000;

fn spec(salt: u32) -> TaskSpec {
    common::salted_spec(N, salt)
}

fn expected(salt: u32) -> Vec<u8> {
    common::salted_expected(N, salt)
}

/// SplitMix64: the schedule from the seed alone.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Waits until every node answers with one leader and all of them live voters.
async fn settled(procs: &[Proc], limit: Duration) {
    let deadline = Instant::now() + limit;
    let n = procs.len();
    loop {
        let mut leaders = Vec::new();
        for p in procs {
            match p.client().unwrap().status().await {
                Ok(st)
                    if st.members.len() == n
                        && st.members.iter().all(|m| m.alive && m.adapter.is_some()) =>
                {
                    leaders.push(st.leader)
                }
                _ => leaders.push(0),
            }
        }
        if leaders.iter().all(|&l| l != 0 && l == leaders[0]) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the mesh did not settle: leaders {leaders:x?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the submitter saw: salt → task id for every acknowledged submission, and
/// every salt it tried.
#[derive(Default)]
struct Ledger {
    acked: BTreeMap<u32, u64>,
    tried: BTreeSet<u32>,
}

async fn chaos(seed: u64, nodes_n: usize, steps: usize) {
    let root = tempfile::tempdir().unwrap();
    let namespaces = match Namespaces::make(nodes_n) {
        Ok(ns) => Some(ns),
        Err(why) => {
            assert!(
                std::env::var("GPUMESH_REQUIRE_NETNS").is_err(),
                "GPUMESH_REQUIRE_NETNS is set but network namespaces cannot be made: {why}"
            );
            common::skipped(&format!(
                "NO NETWORK NAMESPACES ({why}): link cuts are skipped in this run, nodes \
                 are only killed and restarted"
            ));
            None
        }
    };
    let mut procs = nodes(root.path(), nodes_n, namespaces.as_ref());
    let mut namespaces = namespaces;
    procs[0].start(&["--init"]).unwrap();
    let ticket = procs[0].ticket().unwrap();
    for p in &mut procs[1..] {
        p.start(&["--join", &ticket]).unwrap();
    }
    settled(&procs, Duration::from_secs(90)).await;
    eprintln!("chaos seed {seed}: {nodes_n} processes, {steps} steps");

    // The submitter: one task every 150 ms through a random node until told to
    // stop, each submit retried by its client for a few seconds.
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let clients: Vec<Client> = procs
        .iter()
        .map(|p| p.client().unwrap().retry_for(Duration::from_secs(4)))
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let submitter = {
        let (ledger, stop) = (ledger.clone(), stop.clone());
        let mut rng = Rng(seed ^ 0x5eed);
        tokio::spawn(async move {
            let mut salt = 1u32;
            let mut running = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && salt <= 400 {
                let via = clients[rng.below(clients.len())].clone();
                let ledger = ledger.clone();
                let id = RequestId::new(0xC4A05, u64::from(salt));
                ledger.lock().unwrap().tried.insert(salt);
                running.push(tokio::spawn(async move {
                    let sent = tokio::time::timeout(
                        Duration::from_secs(10),
                        via.submit(spec(salt), Some(id)),
                    )
                    .await;
                    if let Ok(Ok(task)) = sent {
                        ledger.lock().unwrap().acked.insert(salt, task);
                    }
                }));
                salt += 1;
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            for r in running {
                let _ = r.await;
            }
        })
    };

    // The schedule. At most one node is down at a time, so a majority can exist.
    let mut rng = Rng(seed);
    let mut down: Option<usize> = None;
    for step in 0..steps {
        let pick = if step == 0 { 0 } else { rng.below(4) };
        match (pick, down) {
            // The seed dies first; later, any node.
            (0 | 1, None) => {
                let victim = if step == 0 { 0 } else { rng.below(nodes_n) };
                eprintln!("step {step}: kill -9 node {victim}");
                procs[victim].kill9();
                down = Some(victim);
            }
            (0 | 1, Some(i)) => {
                eprintln!("step {step}: restart node {i} on its data dir");
                procs[i].start(&[]).unwrap();
                down = None;
            }
            (2, _) if namespaces.is_some() => {
                let i = rng.below(nodes_n);
                let j = (i + 1 + rng.below(nodes_n - 1)) % nodes_n;
                eprintln!("step {step}: cut the link between nodes {i} and {j}");
                namespaces.as_mut().unwrap().cut(i, j);
            }
            _ => {
                eprintln!("step {step}: mend every cut link");
                if let Some(ns) = namespaces.as_mut() {
                    ns.mend_all();
                }
            }
        }
        let pause = 1500 + rng.below(1500) as u64;
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    submitter.await.unwrap();

    // Undo every fault.
    if let Some(ns) = namespaces.as_mut() {
        ns.mend_all();
    }
    if let Some(i) = down {
        procs[i].start(&[]).unwrap();
    }
    settled(&procs, Duration::from_secs(120)).await;

    let ledger = Arc::try_unwrap(ledger).ok().unwrap().into_inner().unwrap();
    eprintln!(
        "chaos seed {seed}: {} of {} submissions acknowledged",
        ledger.acked.len(),
        ledger.tried.len()
    );
    let least = (ledger.tried.len() / 4).max(3);
    assert!(
        ledger.acked.len() >= least,
        "only {} of {} submissions were acknowledged (at least {least} must be): the mesh \
         was down for most of the run",
        ledger.acked.len(),
        ledger.tried.len()
    );

    // Every acknowledged task completes once with the CPU reference's answer.
    let first = procs[0].client().unwrap();
    for (&salt, &task) in &ledger.acked {
        let view = tokio::time::timeout(Duration::from_secs(120), first.wait(task, |_, _| {}))
            .await
            .unwrap_or_else(|_| panic!("t{task} did not finish"))
            .unwrap();
        assert_eq!(view.status, TaskState::Completed, "{view:#?}");
        accepted_once(&view);
        let out = first.results(task).await.unwrap().remove(&0).unwrap();
        assert!(
            out == expected(salt),
            "t{task} (salt {salt}) differs from the CPU reference"
        );
    }
    // No submission made two tasks: word 0 of each output is its salt.
    let tasks = first.tasks().await.unwrap();
    let mut made: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for t in &tasks {
        if t.status != TaskState::Completed {
            continue;
        }
        let out = first.results(t.id).await.unwrap().remove(&0).unwrap();
        let salt = u32::from_le_bytes(out[..4].try_into().unwrap());
        made.entry(salt).or_default().push(t.id);
    }
    for (salt, ids) in &made {
        assert!(
            ledger.tried.contains(salt),
            "a task no one submitted: {ids:?}"
        );
        assert_eq!(ids.len(), 1, "submission {salt} made tasks {ids:?}");
    }
    // Every node reports the same outcome and the same outputs for every task.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut views = Vec::new();
        for p in &procs {
            let c = p.client().unwrap();
            let mut per_task = BTreeMap::new();
            for t in c.tasks().await.unwrap() {
                let outputs = match t.status {
                    TaskState::Completed => c.outputs(t.id).await.unwrap(),
                    _ => Vec::new(),
                };
                let hashes: Vec<String> = outputs.into_iter().map(|o| o.blake3).collect();
                per_task.insert(t.id, (t.status, hashes));
            }
            views.push(per_task);
        }
        if views.iter().all(|v| *v == views[0]) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "nodes disagree on the tasks' outcomes: {views:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for p in &mut procs {
        assert!(p.running(), "node {} stopped by itself", p.name);
        p.kill9();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_on_three_processes() {
    if !have_any() {
        return;
    }
    let seeds: Vec<u64> = std::env::var("GPUMESH_CHAOS_SEEDS")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![7]);
    let steps = env_number("GPUMESH_CHAOS_STEPS", 8) as usize;
    for seed in seeds {
        chaos(seed, 3, steps).await;
    }
}
