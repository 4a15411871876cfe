//! Random faults × concurrent proposals, many seeds. After the chaos, checks that
//! every replica applied a prefix of one history, that no acknowledged proposal was
//! lost, and that none took effect twice.
//!
//! `GPUMESH_SEED=<n>` replays one seed; `GPUMESH_SEEDS=<count>` runs that many
//! (default: a short run for CI); `GPUMESH_SEED_BASE=<n>` shifts the seed range.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use gpumesh_consensus::sim::SplitMix64;
use gpumesh_consensus::{AppliedEvent, Committed, Outcome, ReplicaConfig, RequestId};
use tokio::sync::Mutex as AsyncMutex;

const DEFAULT_SEEDS: u64 = 6;

fn chaos_config(id: u64) -> ReplicaConfig {
    let mut c = test_config(id);
    // Small snapshots so that lagging and restarted replicas go through them.
    c.snapshot_interval = 25;
    c.log_retain = 10;
    c.proposal_timeout = Duration::from_secs(2);
    c.read_timeout = Duration::from_secs(1);
    c
}

#[derive(Default)]
struct History {
    /// index → (request id, outcome, duplicate) as first reported by any replica.
    entries: BTreeMap<u64, (RequestId, Committed, bool)>,
    violations: Vec<String>,
    restores: u64,
}

impl History {
    fn record(&mut self, node: u64, event: AppliedEvent) {
        let AppliedEvent::Entry {
            index,
            entry,
            committed,
            duplicate,
            ..
        } = event
        else {
            self.restores += 1;
            return;
        };
        let now = (entry.request_id, committed, duplicate);
        match self.entries.get(&index) {
            None => {
                self.entries.insert(index, now);
            }
            Some(first) if *first != now => self.violations.push(format!(
                "node {node} applied {now:?} at index {index}, another replica {first:?}"
            )),
            Some(_) => {}
        }
    }
}

fn subscribe(history: &Arc<Mutex<History>>, node: u64, h: &gpumesh_consensus::ConsensusHandle) {
    let mut rx = h.subscribe();
    let history = history.clone();
    tokio::spawn(async move {
        loop {
            match rx.recv().await {
                Ok(e) => history.lock().expect("history").record(node, e),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => history
                    .lock()
                    .expect("history")
                    .violations
                    .push(format!("test subscriber of node {node} lagged by {n}")),
                Err(_) => break,
            }
        }
    });
}

async fn run_seed(seed: u64) {
    let mut rng = SplitMix64::new(seed);
    let n = if rng.chance(0.5) { 3 } else { 5 };
    let max_down = (n - 1) / 2;
    let cluster = Cluster::with(n, seed, chaos_config, 5).await;
    let history = Arc::new(Mutex::new(History::default()));
    for (&id, h) in &cluster.nodes {
        subscribe(&history, id, h);
    }
    let all: Vec<u64> = (1..=n).collect();
    let cluster = Arc::new(AsyncMutex::new(cluster));

    // Clients: each proposes distinct submits through random replicas, retrying
    // every failure with the same request id until acknowledged.
    let clients = 4u64;
    let per_client = 25u64;
    let acks: Arc<Mutex<HashMap<RequestId, Committed>>> = Arc::default();
    let unacked: Arc<Mutex<HashSet<RequestId>>> = Arc::default();
    let mut workers = Vec::new();
    for client in 0..clients {
        let cluster = cluster.clone();
        let acks = acks.clone();
        let unacked = unacked.clone();
        let mut rng = SplitMix64::new(seed ^ (client + 1).wrapping_mul(0x9e37_79b9));
        workers.push(tokio::spawn(async move {
            for k in 0..per_client {
                // Spread the load over the whole chaos phase.
                tokio::time::sleep(Duration::from_millis(rng.range(20, 500))).await;
                let rid = RequestId::new(1000 + client, k);
                let cmd = submit((client * 100 + k + 1) as u32);
                let mut acked = false;
                for _attempt in 0..40 {
                    let h = {
                        let c = cluster.lock().await;
                        let ids = c.ids();
                        if ids.is_empty() {
                            None
                        } else {
                            Some(
                                c.node(ids[rng.range(0, ids.len() as u64 - 1) as usize])
                                    .clone(),
                            )
                        }
                    };
                    let Some(h) = h else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    match h.propose_with_id(rid, cmd.clone()).await {
                        Ok(c) => {
                            acks.lock().expect("acks").insert(rid, c.clone());
                            acked = true;
                            // Read-your-writes through ReadIndex on the same replica.
                            if let Ok(seen) = h.read_linearizable(move |s| s.outcome_of(&rid)).await
                            {
                                assert_eq!(
                                    seen.as_ref(),
                                    Some(&c),
                                    "linearizable read after ack of {rid} on node {}",
                                    h.id()
                                );
                            }
                            break;
                        }
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(rng.range(10, 100))).await
                        }
                    }
                }
                if !acked {
                    unacked.lock().expect("unacked").insert(rid);
                }
            }
        }));
    }

    // Chaos: partitions, isolation, link faults, crashes (abrupt, or failing storage
    // in the middle of a Ready) and restarts, never more than a minority down.
    let steps = 40;
    let mut down: Vec<u64> = Vec::new();
    for _ in 0..steps {
        tokio::time::sleep(Duration::from_millis(rng.range(50, 400))).await;
        let mut c = cluster.lock().await;
        match rng.range(0, 9) {
            0 | 1 => {
                let mut shuffled = all.clone();
                for i in (1..shuffled.len()).rev() {
                    shuffled.swap(i, rng.range(0, i as u64) as usize);
                }
                let cut = rng.range(1, n - 1) as usize;
                c.net.heal();
                c.net
                    .partition(&[shuffled[..cut].to_vec(), shuffled[cut..].to_vec()]);
            }
            2 => {
                let victim = all[rng.range(0, n - 1) as usize];
                c.net.isolate(victim, &all);
            }
            3 | 4 => c.net.heal(),
            5 => c.net.set_faults(faults(
                rng.next_f64() * 0.15,
                rng.next_f64() * 0.1,
                (0, rng.range(0, 40)),
            )),
            6 | 7 if (down.len() as u64) < max_down => {
                let up: Vec<u64> = c.ids().into_iter().filter(|i| !down.contains(i)).collect();
                if up.is_empty() {
                    continue;
                }
                let victim = up[rng.range(0, up.len() as u64 - 1) as usize];
                c.crash(victim).await;
                down.push(victim);
            }
            _ => {
                if let Some(id) = down.pop() {
                    // It may still run (a failpoint that has not fired yet).
                    c.crash(id).await;
                    let fail = rng.chance(0.4).then(|| rng.range(0, 6));
                    let h = c.start_failing(id, fail);
                    subscribe(&history, id, &h);
                    if fail.is_some() {
                        // It will die on its own at some write; count it as down.
                        down.push(id);
                    }
                }
            }
        }
    }

    for w in workers {
        w.await.expect("client task");
    }

    // Heal everything and bring every replica back.
    {
        let mut c = cluster.lock().await;
        c.net.heal();
        c.net.set_faults(faults(0.0, 0.0, (0, 0)));
        for id in all.clone() {
            c.crash(id).await;
            let h = c.start(id);
            subscribe(&history, id, &h);
        }
    }
    let c = cluster.lock().await;
    c.leader().await;
    // One more commit so every replica has applied everything before it.
    let last = c
        .node(1)
        .propose(submit(9999))
        .await
        .expect("final proposal");
    c.wait_applied(&all, last.index, Duration::from_secs(30))
        .await;
    c.converged(&all, Duration::from_secs(30)).await;

    let (entries, violations, restores) = {
        let h = history.lock().expect("history");
        (h.entries.clone(), h.violations.clone(), h.restores)
    };
    assert!(violations.is_empty(), "{violations:#?}");
    // None applied twice: each request id takes effect at most once.
    let mut effective: HashMap<RequestId, u64> = HashMap::new();
    for (index, (rid, _, duplicate)) in &entries {
        if !duplicate {
            if let Some(first) = effective.insert(*rid, *index) {
                panic!("{rid} took effect at {first} and again at {index}");
            }
        }
    }
    // No acknowledged proposal lost, each with the outcome its client was told.
    let acks = acks.lock().expect("acks").clone();
    for &id in &all {
        let (tasks, outcomes) = c.node(id).read_local({
            let ids: Vec<RequestId> = acks.keys().copied().collect();
            move |s| {
                let outcomes: Vec<(RequestId, Option<Committed>)> =
                    ids.iter().map(|r| (*r, s.outcome_of(r))).collect();
                (
                    s.tasks()
                        .map(|t| (t.id, t.clone()))
                        .collect::<BTreeMap<_, _>>(),
                    outcomes,
                )
            }
        });
        for (rid, got) in outcomes {
            assert_eq!(
                got.as_ref(),
                acks.get(&rid),
                "node {id}: ack of {rid} lost or changed"
            );
        }
        let mut seen = HashSet::new();
        for t in tasks.values() {
            assert!(seen.insert(t.request_id), "two tasks for {}", t.request_id);
        }
        for (rid, ack) in &acks {
            let Outcome::TaskSubmitted { task } = ack.outcome else {
                panic!("unexpected outcome {ack:?}")
            };
            assert_eq!(tasks.get(&task).map(|t| t.request_id), Some(*rid));
        }
    }
    assert_eq!(
        PANICS.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a replica panicked (see above)"
    );
    let stats = c.net.stats();
    eprintln!(
        "seed {seed}: {n} nodes, {} acked, {} unacked, {} entries ({} duplicates), \
         {} snapshot installs, net {stats:?}",
        acks.len(),
        unacked.lock().expect("unacked").len(),
        entries.len(),
        entries.values().filter(|e| e.2).count(),
        restores,
    );
    for h in c.nodes.values() {
        h.shutdown().await;
    }
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("GPUMESH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return vec![seed];
    }
    let count = std::env::var("GPUMESH_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEEDS);
    let base = std::env::var("GPUMESH_SEED_BASE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0u64);
    (base..base + count).collect()
}

/// Panics anywhere (a replica's task included) since the hook was installed.
static PANICS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[test]
fn random_faults_and_concurrent_proposals_keep_one_history() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        default_hook(info);
    }));
    for seed in seeds() {
        eprintln!("randomized: seed {seed} (replay with GPUMESH_SEED={seed})");
        // A fresh paused-clock runtime per seed, so one seed's timers never leak
        // into the next and a replay starts from the same point.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        let result =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(run_seed(seed))));
        if let Err(panic) = result {
            eprintln!("randomized: seed {seed} FAILED; replay with GPUMESH_SEED={seed}");
            std::panic::resume_unwind(panic);
        }
    }
}
