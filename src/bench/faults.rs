//! `gpumesh bench faults`: failover times and the cost of verification on a 3-node
//! loopback mesh in this process, with the node defaults (heartbeats, Raft ticks,
//! scheduler timeouts) left as they are.
//!
//! A "killed" node is stopped without leaving: its Raft replica and its network stop
//! at once, its sockets close, and it says goodbye to nobody.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpumesh::consensus::{AppliedEvent, Command, RaftRole, RequestId};
use gpumesh::node::api::TaskState;
use gpumesh::node::{Formation, MeshNode, Multiaddr, NodeConfig};
use gpumesh::Client;
use gpumesh_protocol::TaskOptions;

use super::mesh::{spec, SPIN, TINY};
use super::ms;

#[derive(clap::Args, Debug)]
pub struct FaultsBenchArgs {
    /// Times each failover is measured (a killed node is restarted in between).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Tasks per throughput run.
    #[arg(long, default_value_t = 300)]
    pub tasks: usize,
    /// Tasks in flight at once during the throughput runs.
    #[arg(long, default_value_t = 32)]
    pub in_flight: usize,
    /// Print one JSON object (every measurement, in ms) instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub fn faults(args: FaultsBenchArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(args))
}

/// Three nodes, each restartable from its data directory.
struct Mesh {
    root: PathBuf,
    nodes: Vec<Option<MeshNode>>,
}

fn config(dir: &Path, formation: Formation, peers: Vec<Multiaddr>) -> NodeConfig {
    let mut c = NodeConfig::new(dir);
    c.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("multiaddr")];
    c.api = "127.0.0.1:0".parse().expect("address");
    c.mdns = false;
    c.formation = formation;
    c.peers = peers;
    c.cluster_key = Some(super::mesh_key());
    c
}

fn seed(node: &MeshNode) -> anyhow::Result<Multiaddr> {
    Ok(format!("{}/p2p/{}", node.listen_addrs[0], node.peer_id).parse()?)
}

impl Mesh {
    async fn start(root: PathBuf) -> anyhow::Result<Mesh> {
        let first = MeshNode::start(config(&root.join("n0"), Formation::Init, vec![])).await?;
        let s = seed(&first)?;
        let mut nodes = vec![Some(first)];
        for i in 1..3 {
            let c = config(
                &root.join(format!("n{i}")),
                Formation::Join,
                vec![s.clone()],
            );
            nodes.push(Some(MeshNode::start(c).await?));
        }
        let mesh = Mesh { root, nodes };
        mesh.settle().await?;
        Ok(mesh)
    }

    fn live(&self) -> impl Iterator<Item = &MeshNode> {
        self.nodes.iter().flatten()
    }

    fn client(&self, i: usize) -> anyhow::Result<Client> {
        let node = self.nodes[i]
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("node {i} is down"))?;
        Ok(Client::new(node.api_addr.to_string()))
    }

    /// Index of the node that leads now.
    fn leader(&self) -> Option<usize> {
        self.nodes.iter().position(|n| {
            n.as_ref()
                .is_some_and(|n| n.consensus.watch_status().borrow().role == RaftRole::Leader)
        })
    }

    /// Waits until there is a leader, all three nodes are voters and every member
    /// shows its adapter.
    async fn settle(&self) -> anyhow::Result<()> {
        let limit = Instant::now() + Duration::from_secs(60);
        while Instant::now() < limit {
            if let Some(l) = self.leader() {
                let voters = self.nodes[l]
                    .as_ref()
                    .map_or(0, |n| n.consensus.watch_status().borrow().voters.len());
                if let Ok(st) = self.client(l)?.status().await {
                    if voters == 3
                        && st.members.len() == 3
                        && st.members.iter().all(|m| m.adapter.is_some())
                    {
                        return Ok(());
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("the mesh did not settle within 60 s")
    }

    /// Stops node `i` as a crash would, minus the crash. Its Raft replica and network
    /// stop at once; the returned task finishes when the rest has (a GPU dispatch
    /// under way runs to its end first), so clocks are not held up by it.
    fn kill(&mut self, i: usize) -> tokio::task::JoinHandle<()> {
        let node = self.nodes[i].take();
        tokio::spawn(async move {
            if let Some(n) = node {
                n.stop().await;
            }
        })
    }

    /// Stops node `i` as Ctrl-C does: a leader hands the leadership over first. The
    /// returned task finishes once it has stopped.
    fn shut_down(&mut self, i: usize) -> tokio::task::JoinHandle<()> {
        let node = self.nodes[i].take();
        tokio::spawn(async move {
            if let Some(n) = node {
                n.shutdown().await;
            }
        })
    }

    /// Starts node `i` again from its data directory and waits for the mesh.
    async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        let peers = self.live().map(seed).collect::<anyhow::Result<Vec<_>>>()?;
        let c = config(&self.root.join(format!("n{i}")), Formation::Join, peers);
        self.nodes[i] = Some(MeshNode::start(c).await?);
        self.settle().await
    }

    async fn stop(self) {
        for n in self.nodes.into_iter().flatten() {
            n.stop().await;
        }
    }
}

/// Submits a trivial task through `via` until it is acknowledged, retrying with one
/// request id so the mesh records it once; returns when the submit was acknowledged
/// and when the task completed.
async fn next_task(
    via: &Client,
    id: RequestId,
    t0: Instant,
) -> anyhow::Result<(Duration, Duration)> {
    let limit = t0 + Duration::from_secs(60);
    let task = loop {
        anyhow::ensure!(Instant::now() < limit, "no task committed within 60 s");
        match tokio::time::timeout(
            Duration::from_secs(5),
            via.submit(spec(TINY, 1, 1), Some(id)),
        )
        .await
        {
            Ok(Ok(task)) => break task,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    let acked = t0.elapsed();
    via.wait(task, |_, _| {}).await?;
    Ok((acked, t0.elapsed()))
}

/// Kills the leader (or, with `hand_over`, stops it as Ctrl-C does); times the next
/// task submitted through a surviving node.
async fn leader_failover(
    mesh: &mut Mesh,
    round: u64,
    hand_over: bool,
) -> anyhow::Result<(Duration, Duration)> {
    let leader = mesh.leader().ok_or_else(|| anyhow::anyhow!("no leader"))?;
    let via = mesh.client((leader + 1) % 3)?;
    let t0 = Instant::now();
    let stopped = if hand_over {
        mesh.shut_down(leader)
    } else {
        mesh.kill(leader)
    };
    let id = RequestId::new(0xFA11_0000 + round * 2 + u64::from(hand_over), 1);
    let times = next_task(&via, id, t0).await?;
    stopped.await?;
    mesh.restart(leader).await?;
    Ok(times)
}

/// Runs a one-shard task of a few seconds; kills the follower running it (moving
/// leadership away first if the leader got it), while the other two nodes are idle.
/// Returns the time until the shard was placed on another node and until it started
/// there.
async fn worker_failover(mesh: &mut Mesh) -> anyhow::Result<(Duration, Duration)> {
    let limit = Instant::now() + Duration::from_secs(60);
    let first = mesh.leader().ok_or_else(|| anyhow::anyhow!("no leader"))?;
    let mut events = mesh.nodes[first]
        .as_ref()
        .map(|n| n.consensus.subscribe())
        .ok_or_else(|| anyhow::anyhow!("leader is down"))?;
    let task = mesh
        .client(first)?
        .submit(spec(SPIN, 3000, 1), None)
        .await?;
    let worker = loop {
        let left = limit.saturating_duration_since(Instant::now());
        if let AppliedEvent::Entry { entry, .. } =
            tokio::time::timeout(left, events.recv()).await??
        {
            if let Command::ShardStarted { task: t, node, .. } = &entry.command {
                if t.0 == task {
                    break *node;
                }
            }
        }
    };
    let victim = mesh
        .nodes
        .iter()
        .position(|n| n.as_ref().is_some_and(|n| n.raft_id == worker))
        .ok_or_else(|| anyhow::anyhow!("the worker is not a node of this mesh"))?;
    if mesh.leader() == Some(victim) {
        let other = mesh.nodes[(victim + 1) % 3]
            .as_ref()
            .map_or(0, |n| n.raft_id);
        if let Some(n) = mesh.nodes[victim].as_ref() {
            n.consensus.transfer_leader(other).await?;
        }
        while mesh.leader() == Some(victim) || mesh.leader().is_none() {
            anyhow::ensure!(Instant::now() < limit, "leadership did not move");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let survivor = (victim + 1) % 3;
    let via = mesh.client(survivor)?;
    let mut events = mesh.nodes[survivor]
        .as_ref()
        .map(|n| n.consensus.subscribe())
        .ok_or_else(|| anyhow::anyhow!("survivor is down"))?;
    let t0 = Instant::now();
    let stopped = mesh.kill(victim);
    let mut placed = None;
    let started = loop {
        let left = limit.saturating_duration_since(Instant::now());
        if let AppliedEvent::Entry { entry, .. } =
            tokio::time::timeout(left, events.recv()).await??
        {
            match &entry.command {
                Command::ReassignShard { task: t, node, .. } if t.0 == task && *node != worker => {
                    placed.get_or_insert(t0.elapsed());
                }
                Command::ShardStarted { task: t, node, .. } if t.0 == task && *node != worker => {
                    break t0.elapsed();
                }
                _ => {}
            }
        }
    };
    let view = via.wait(task, |_, _| {}).await?;
    anyhow::ensure!(
        view.status == TaskState::Completed,
        "task {task}: {}",
        view.status
    );
    stopped.await?;
    mesh.restart(victim).await?;
    Ok((placed.unwrap_or(started), started))
}

/// Tasks per second for `tasks` spin tasks at `replicas`, `in_flight` at a time,
/// submitted round-robin through every node.
async fn throughput(mesh: &Mesh, args: &FaultsBenchArgs, replicas: u32) -> anyhow::Result<f64> {
    let clients: Vec<Client> = (0..3)
        .map(|i| mesh.client(i))
        .collect::<anyhow::Result<_>>()?;
    let started = Instant::now();
    let mut pending = tokio::task::JoinSet::new();
    for i in 0..args.tasks {
        if pending.len() >= args.in_flight.max(1) {
            pending.join_next().await.transpose()?.transpose()?;
        }
        let c = clients[i % clients.len()].clone();
        pending.spawn(async move {
            let mut s = spec(SPIN, 4, 1);
            s.options = TaskOptions {
                replicas,
                ..TaskOptions::default()
            };
            let task = c.submit(s, None).await?;
            let view = c.wait(task, |_, _| {}).await?;
            anyhow::ensure!(
                view.status == TaskState::Completed,
                "task {task}: {}",
                view.status
            );
            anyhow::Ok(())
        });
    }
    while let Some(r) = pending.join_next().await {
        r??;
    }
    Ok(args.tasks as f64 / started.elapsed().as_secs_f64())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn run(args: FaultsBenchArgs) -> anyhow::Result<ExitCode> {
    let rounds = args.rounds.max(1);
    if !args.json {
        println!("gpumesh bench faults — 3 nodes on loopback, default timeouts, {rounds} rounds");
    }
    // Separate processes first, started as the README starts them.
    let procs = super::failover::run(rounds).await?;

    let root = std::env::temp_dir().join(format!("gpumesh-bench-faults-{}", std::process::id()));
    let mut mesh = Mesh::start(root.clone()).await?;
    let mut acked = Vec::new();
    let mut completed = Vec::new();
    let mut handed = Vec::new();
    for round in 0..rounds {
        let (a, c) = leader_failover(&mut mesh, round as u64, false).await?;
        acked.push(a);
        completed.push(c);
        handed.push(leader_failover(&mut mesh, round as u64, true).await?.0);
    }
    let mut placed = Vec::new();
    let mut moved = Vec::new();
    for _ in 0..rounds {
        let (p, m) = worker_failover(&mut mesh).await?;
        placed.push(p);
        moved.push(m);
    }
    // Alternate the two settings so drift on a shared machine hits both alike.
    let mut one = Vec::new();
    let mut two = Vec::new();
    throughput(&mesh, &args, 1).await?; // warm-up
    for _ in 0..2 {
        one.push(throughput(&mesh, &args, 1).await?);
        two.push(throughput(&mesh, &args, 2).await?);
    }
    let (one, two) = (one.iter().sum::<f64>() / 2.0, two.iter().sum::<f64>() / 2.0);
    mesh.stop().await;
    let _ = std::fs::remove_dir_all(&root);

    let seeds = procs.iter().filter(|r| r.seed).count();
    let proc_rows: [(&str, &str, Vec<Duration>); 3] = [
        (
            "process_new_leader",
            "kill -9 of the leader → every survivor names a new one",
            procs.iter().map(|r| r.new_leader).collect(),
        ),
        (
            "process_next_task_acknowledged",
            "kill -9 of the leader → next task acknowledged",
            procs.iter().map(|r| r.acked).collect(),
        ),
        (
            "process_shown_unreachable",
            "kill -9 of the leader → status shows it unreachable",
            procs.iter().map(|r| r.shown_down).collect(),
        ),
    ];
    let inproc_rows: [(&str, &str, Vec<Duration>); 5] = [
        (
            "leader_killed_next_task_acknowledged",
            "leader killed → next task acknowledged",
            acked,
        ),
        (
            "leader_stopped_next_task_acknowledged",
            "leader stopped as Ctrl-C does (hand-over) → next task acked",
            handed,
        ),
        (
            "leader_killed_task_completed",
            "leader killed → that task completed",
            completed,
        ),
        (
            "worker_killed_shard_placed",
            "worker killed → its shard placed on another node",
            placed,
        ),
        (
            "worker_killed_shard_running",
            "worker killed → its shard running on another node",
            moved,
        ),
    ];
    if args.json {
        let mut out = serde_json::Map::new();
        out.insert("rounds".into(), rounds.into());
        out.insert("process_rounds_killing_the_seed".into(), seeds.into());
        for (key, _, v) in proc_rows.iter().chain(inproc_rows.iter()) {
            out.insert(
                (*key).into(),
                serde_json::json!({
                    "median_ms": ms(median(v.clone())),
                    "max_ms": ms(v.iter().max().copied().unwrap_or_default()),
                    "all_ms": v.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
                }),
            );
        }
        out.insert("throughput_replicas1_per_s".into(), one.into());
        out.insert("throughput_replicas2_per_s".into(), two.into());
        println!("{}", serde_json::Value::Object(out));
        return Ok(ExitCode::SUCCESS);
    }
    let row = |name: &str, v: &[Duration]| {
        let max = v.iter().max().copied().unwrap_or_default();
        println!(
            "{:<58} {:>8.0} ms {:>8.0} ms",
            name,
            ms(median(v.to_vec())),
            ms(max)
        );
    };
    println!(
        "\nseparate `gpumesh node` processes, b and c joined through a's ticket; the \
         leader killed each round ({seeds} of {rounds} times the seed a)"
    );
    println!("{:<58} {:>11} {:>11}", "measurement", "median", "max");
    for (_, name, v) in &proc_rows {
        row(name, v);
    }
    println!("\none process (a killed node stops its Raft and network at once)");
    println!("{:<58} {:>11} {:>11}", "measurement", "median", "max");
    for (_, name, v) in &inproc_rows {
        row(name, v);
    }
    println!(
        "\n{:<58} {:>10.0} /s",
        format!(
            "throughput, replicas=1 ({} tasks, {} in flight)",
            args.tasks, args.in_flight
        ),
        one
    );
    println!("{:<58} {:>10.0} /s", "throughput, replicas=2", two);
    println!("{:<58} {:>13.2}", "replicas=2 / replicas=1", two / one);
    Ok(ExitCode::SUCCESS)
}
