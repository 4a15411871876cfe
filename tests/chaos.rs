//! Chaos: a stream of tasks into a mesh of real nodes (libp2p on loopback, Raft on
//! redb, wgpu) while nodes are killed and restarted, cut off from every peer and
//! slowed, at random from a seed. At the end, with every fault undone:
//! - every acknowledged task completed, exactly once (one task per request id, each
//!   shard's result accepted once), with the CPU reference's result;
//! - every member's state machine is byte-for-byte the same.
//!
//! Short by default (a few steps per mesh size, fixed seeds, run in CI). Longer:
//!   GPUMESH_CHAOS_STEPS=200 GPUMESH_CHAOS_SEEDS=1,2,3,4 cargo test --test chaos -- --nocapture
//! Each run prints its seed and every fault it injected; the same seed injects the
//! same faults in the same order (timing on a shared machine still varies).

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use gpumesh::consensus::sim::SplitMix64;
use gpumesh::consensus::{RaftRole, RequestId};
use gpumesh::node::api::TaskState;
use gpumesh::node::{Formation, MeshNode, Multiaddr, NodeConfig, PeerId};
use gpumesh::protocol::TaskOptions;
use gpumesh::shaders::builtins::{self, Problem};

/// Uniform in 0..n.
fn below(rng: &mut SplitMix64, n: usize) -> usize {
    rng.range(0, n as u64 - 1) as usize
}

fn env_list(name: &str) -> Option<Vec<u64>> {
    let text = std::env::var(name).ok()?;
    Some(
        text.split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect(),
    )
}

fn steps() -> usize {
    std::env::var("GPUMESH_CHAOS_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6)
}

/// One member: its data directory outlives the process that serves it.
struct Slot {
    dir: PathBuf,
    peer: PeerId,
    node: Option<MeshNode>,
    cut: bool,
    slow: bool,
}

/// A task the mesh acknowledged.
struct Acked {
    task: u64,
    request: RequestId,
    problem: Problem,
}

struct Chaos {
    seed: u64,
    rng: SplitMix64,
    slots: Vec<Slot>,
    acked: Vec<Acked>,
    /// Request ids whose submit was never acknowledged: each may or may not exist.
    unacked: Vec<RequestId>,
    faults: Vec<String>,
    started: Instant,
    next_request: u64,
}

fn tune(c: &mut NodeConfig) {
    // Silent failures (a cut link gives no refused dial) are found in 3 s, not 8.
    c.down_after = Duration::from_secs(3);
    c.heartbeat_interval = Duration::from_millis(500);
}

fn seed_of(node: &MeshNode) -> Multiaddr {
    seed(node)
}

impl Chaos {
    async fn start(root: &Path, n: usize, seed: u64) -> Chaos {
        let nodes = mesh_with(root, n, |_, c| tune(c)).await;
        let slots = nodes
            .into_iter()
            .enumerate()
            .map(|(i, node)| Slot {
                dir: root.join(format!("n{i}")),
                peer: node.peer_id,
                node: Some(node),
                cut: false,
                slow: false,
            })
            .collect();
        let chaos = Chaos {
            seed,
            rng: SplitMix64::new(seed),
            slots,
            acked: Vec::new(),
            unacked: Vec::new(),
            faults: Vec::new(),
            started: Instant::now(),
            next_request: 0,
        };
        chaos.wait_voters().await;
        chaos
    }

    fn note(&mut self, what: String) {
        let line = format!(
            "[seed {} +{:>6.2}s] {what}",
            self.seed,
            self.started.elapsed().as_secs_f64()
        );
        eprintln!("{line}");
        self.faults.push(line);
    }

    fn n(&self) -> usize {
        self.slots.len()
    }

    /// Down or cut off: at most a minority may be, so the mesh keeps a quorum.
    fn impaired(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.node.is_none() || s.cut)
            .count()
    }

    fn healthy(&self) -> Vec<usize> {
        (0..self.n())
            .filter(|&i| self.slots[i].node.is_some() && !self.slots[i].cut)
            .collect()
    }

    fn leader(&self) -> Option<usize> {
        self.slots.iter().position(|s| {
            s.node
                .as_ref()
                .is_some_and(|n| n.consensus.watch_status().borrow().role == RaftRole::Leader)
        })
    }

    /// Waits until one leader counts every member as a voter.
    async fn wait_voters(&self) {
        let n = self.n();
        let limit = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(l) = self.leader() {
                let node = self.slots[l].node.as_ref().unwrap();
                if node.consensus.watch_status().borrow().voters.len() == n {
                    return;
                }
            }
            assert!(
                Instant::now() < limit,
                "seed {}: not every member became a voter",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn kill(&mut self, i: usize) {
        let was_leader = self.leader() == Some(i);
        self.note(format!(
            "kill node {i}{}",
            if was_leader { " (the leader)" } else { "" }
        ));
        if let Some(node) = self.slots[i].node.take() {
            node.kill().await;
        }
        self.slots[i].cut = false;
        self.slots[i].slow = false;
    }

    async fn restart(&mut self, i: usize) {
        self.note(format!("restart node {i}"));
        let peers: Vec<Multiaddr> = self
            .slots
            .iter()
            .filter_map(|s| s.node.as_ref())
            .map(seed_of)
            .collect();
        let mut c = config(&self.slots[i].dir, Formation::Join, &peers);
        tune(&mut c);
        let node = MeshNode::start(c)
            .await
            .unwrap_or_else(|e| panic!("seed {}: node {i} did not restart: {e}", self.seed));
        assert_eq!(
            node.peer_id, self.slots[i].peer,
            "a restarted node keeps its identity"
        );
        self.slots[i].node = Some(node);
    }

    /// Cuts node `i` off from every other member in both directions.
    async fn cut(&mut self, i: usize, cut: bool) {
        self.note(format!(
            "{} node {i}",
            if cut { "partition off" } else { "heal" }
        ));
        let me = self.slots[i].peer;
        for j in 0..self.n() {
            if j == i {
                continue;
            }
            let other = self.slots[j].peer;
            if let Some(n) = &self.slots[i].node {
                if cut {
                    n.net.cut(other).await.unwrap()
                } else {
                    n.net.mend(other).await.unwrap()
                }
            }
            if let Some(n) = &self.slots[j].node {
                if cut {
                    n.net.cut(me).await.unwrap()
                } else {
                    n.net.mend(me).await.unwrap()
                }
            }
        }
        self.slots[i].cut = cut;
    }

    fn slow(&mut self, i: usize, delay: Option<Duration>) {
        match delay {
            Some(d) => self.note(format!("delay node {i}'s messages by {} ms", d.as_millis())),
            None => self.note(format!("undelay node {i}")),
        }
        if let Some(n) = &self.slots[i].node {
            n.net.set_delay(delay.unwrap_or_default());
        }
        self.slots[i].slow = delay.is_some();
    }

    /// One random fault, or the undoing of one.
    async fn fault(&mut self) {
        let n = self.n();
        let minority = (n - 1) / 2;
        for _ in 0..16 {
            let i = below(&mut self.rng, n);
            match below(&mut self.rng, 6) {
                0 | 1 if self.slots[i].node.is_some() && self.impaired() < minority => {
                    // Half the kills go to the leader, wherever it is.
                    let target = match self.leader() {
                        Some(l) if self.rng.chance(0.5) && !self.slots[l].cut => l,
                        _ => i,
                    };
                    return self.kill(target).await;
                }
                2 if self.slots[i].node.is_none() => return self.restart(i).await,
                3 if self.slots[i].node.is_some()
                    && !self.slots[i].cut
                    && self.impaired() < minority =>
                {
                    return self.cut(i, true).await;
                }
                3 | 4 if self.slots[i].cut => return self.cut(i, false).await,
                5 if self.slots[i].node.is_some() => {
                    if self.slots[i].slow {
                        return self.slow(i, None);
                    }
                    let ms = 20 + below(&mut self.rng, 180) as u64;
                    return self.slow(i, Some(Duration::from_millis(ms)));
                }
                _ => {}
            }
        }
    }

    /// Submits one random built-in problem through a random healthy node, retrying
    /// with the same request id (so it can be recorded only once) a few times.
    async fn submit_one(&mut self) {
        let names = ["vector_add", "histogram", "matmul"];
        let name = names[below(&mut self.rng, names.len())];
        let b = builtins::get(name).unwrap();
        let problem = b.problem(b.test_size).unwrap();
        let shards = 1 + below(&mut self.rng, 4) as u32;
        let replicas = if self.rng.chance(0.25) { 2 } else { 1 };
        self.next_request += 1;
        let request = RequestId::new(0xC4A0_5000 + self.seed, self.next_request);
        let mut spec = problem.spec(shards);
        spec.options = TaskOptions {
            replicas,
            ..TaskOptions::default()
        };
        // Half the one-shard, one-replica tasks go as a run, which the node it is
        // sent to runs itself and records with its result in one commit.
        let run = shards == 1 && replicas == 1 && self.rng.chance(0.5);
        for attempt in 0..4 {
            let healthy = self.healthy();
            let via = healthy[below(&mut self.rng, healthy.len())];
            let c = client(self.slots[via].node.as_ref().unwrap());
            let submitted = tokio::time::timeout(Duration::from_secs(10), async {
                for bytes in problem.blobs.values() {
                    c.upload(bytes.to_vec()).await?;
                }
                if run {
                    let (task, outputs) = c.run_with_id(spec.clone(), request).await?;
                    if let Err(e) = problem.verify(&outputs) {
                        panic!("seed {}: run t{task} answered wrong: {e}", self.seed);
                    }
                    return Ok(task);
                }
                c.submit(spec.clone(), Some(request)).await
            })
            .await;
            match submitted {
                Ok(Ok(task)) => {
                    eprintln!(
                        "[seed {}] t{task}: {name} in {shards} shards, replicas {replicas}, via node {via}{}{}",
                        self.seed,
                        if run { " as a run" } else { "" },
                        if attempt > 0 { format!(" (attempt {})", attempt + 1) } else { String::new() }
                    );
                    self.acked.push(Acked {
                        task,
                        request,
                        problem,
                    });
                    return;
                }
                Ok(Err(e)) => eprintln!("[seed {}] submit via node {via} failed: {e}", self.seed),
                Err(_) => eprintln!("[seed {}] submit via node {via} timed out", self.seed),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.unacked.push(request);
    }

    /// Undoes every fault and waits for the full mesh.
    async fn heal_all(&mut self) {
        for i in 0..self.n() {
            if self.slots[i].cut {
                self.cut(i, false).await;
            }
            if self.slots[i].slow {
                self.slow(i, None);
            }
        }
        for i in 0..self.n() {
            if self.slots[i].node.is_none() {
                self.restart(i).await;
            }
        }
        self.wait_voters().await;
    }

    /// The end-of-run checks.
    async fn check(&self) {
        let nodes: Vec<&MeshNode> = self
            .slots
            .iter()
            .map(|s| s.node.as_ref().unwrap())
            .collect();
        for (k, a) in self.acked.iter().enumerate() {
            let c = client(nodes[k % nodes.len()]);
            let view = tokio::time::timeout(Duration::from_secs(120), c.wait(a.task, |_, _| {}))
                .await
                .unwrap_or_else(|_| panic!("seed {}: t{} did not finish", self.seed, a.task))
                .unwrap();
            assert_eq!(
                view.status,
                TaskState::Completed,
                "seed {}: t{}: {view:#?}",
                self.seed,
                a.task
            );
            accepted_once(&view);
            let results = c.results(a.task).await.unwrap();
            a.problem.verify(&results).unwrap_or_else(|e| {
                panic!("seed {}: t{} differs from the CPU: {e}", self.seed, a.task)
            });
        }
        // One task per request id, and no task the test did not ask for.
        let acked: BTreeMap<RequestId, u64> =
            self.acked.iter().map(|a| (a.request, a.task)).collect();
        let unacked = self.unacked.clone();
        let (count, by_request, stray) = nodes[0].consensus.read_local(move |s| {
            let by_request: Vec<(RequestId, Option<u64>)> = acked
                .keys()
                .map(|r| (*r, s.task_by_request(r).map(|t| t.0)))
                .collect();
            let stray = unacked
                .iter()
                .filter(|r| s.task_by_request(r).is_some())
                .count();
            (s.tasks().len(), by_request, stray)
        });
        for (request, task) in by_request {
            assert_eq!(
                task,
                self.acked
                    .iter()
                    .find(|a| a.request == request)
                    .map(|a| a.task)
            );
        }
        assert_eq!(
            count,
            self.acked.len() + stray,
            "seed {}: the mesh holds exactly the acknowledged tasks (plus {stray} whose submit timed out but committed)",
            self.seed
        );
        // Every member's state machine, at the same applied index, is identical.
        let limit = Instant::now() + Duration::from_secs(60);
        loop {
            let mut seen = Vec::new();
            for n in &nodes {
                let digest = n.consensus.read_local(|s| {
                    (
                        s.applied_index(),
                        *blake3::hash(&s.to_bytes().unwrap()).as_bytes(),
                    )
                });
                seen.push(digest);
            }
            if seen.iter().all(|d| d.0 == seen[0].0) {
                assert!(
                    seen.iter().all(|d| d.1 == seen[0].1),
                    "seed {}: state machines differ at index {}",
                    self.seed,
                    seen[0].0
                );
                eprintln!(
                    "[seed {}] {} members identical at applied index {}",
                    self.seed,
                    nodes.len(),
                    seen[0].0
                );
                break;
            }
            assert!(
                Instant::now() < limit,
                "seed {}: members never reached the same index",
                self.seed
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(self) {
        for s in self.slots {
            if let Some(n) = s.node {
                n.stop().await;
            }
        }
    }
}

async fn run(n: usize, seed: u64, steps: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut chaos = Chaos::start(dir.path(), n, seed).await;
    eprintln!("[seed {seed}] chaos on {n} nodes, {steps} steps");
    for _ in 0..steps {
        chaos.fault().await;
        let tasks = 1 + below(&mut chaos.rng, 3);
        for _ in 0..tasks {
            chaos.submit_one().await;
        }
        let pause = 200 + below(&mut chaos.rng, 800) as u64;
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    chaos.note("heal everything, restart every node that is down".into());
    chaos.heal_all().await;
    chaos.check().await;
    eprintln!(
        "[seed {seed}] passed: {n} nodes, {} faults, {} tasks acknowledged, {} not; faults:\n  {}",
        chaos.faults.len(),
        chaos.acked.len(),
        chaos.unacked.len(),
        chaos.faults.join("\n  ")
    );
    chaos.stop().await;
}

/// The two meshes run one after the other: together they would be eight nodes on
/// a two-core machine, testing the machine more than the mesh.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn suite(n: usize, default_seeds: &[u64]) {
    if !have_any() {
        return;
    }
    let _turn = ONE_AT_A_TIME.lock().await;
    let seeds = env_list("GPUMESH_CHAOS_SEEDS").unwrap_or_else(|| default_seeds.to_vec());
    let steps = steps();
    // Bounded: each step is a few seconds at most, plus start and the final checks.
    let limit = Duration::from_secs(120 + 10 * steps as u64);
    for seed in seeds {
        tokio::time::timeout(limit, run(n, seed, steps))
            .await
            .unwrap_or_else(|_| panic!("seed {seed} on {n} nodes exceeded {limit:?}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_three_nodes() {
    suite(3, &[1]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_five_nodes() {
    suite(5, &[2]).await;
}
