//! `gpumesh bench actors`: a counter actor on a 3-node loopback mesh — call latency
//! one at a time, calls/s with many in flight through every node, and the time from
//! killing the host to the next acknowledged call. The nodes run in this process, or
//! with `--processes` each as a `gpumesh node` process, as a user starts them (and as
//! a local Ray cluster runs its nodes), the host then killed with SIGKILL.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use gpumesh::consensus::{RequestId, RequestIds};
use gpumesh::node::api::StateInit;
use gpumesh::node::timeline::{CallStage, Timeline};
use gpumesh::process::NodeProcess;
use gpumesh::Client;
use gpumesh_protocol::{ActorCall, Grid, ShaderSource};

use super::ms;

#[derive(clap::Args, Debug)]
pub struct ActorsBenchArgs {
    /// Calls timed one at a time for the latency figures.
    #[arg(long, default_value_t = 200)]
    pub latency_calls: usize,
    /// Calls made for the throughput figure.
    #[arg(long, default_value_t = 600)]
    pub throughput_calls: usize,
    /// Calls in flight at once during the throughput run (spread over the nodes).
    #[arg(long, default_value_t = 48)]
    pub in_flight: usize,
    /// Actors created (through every node, `in_flight` at a time) and left idle
    /// before anything is timed: what the calls cost with many actors in the record;
    /// after the throughput run each of them gets one call.
    #[arg(long, default_value_t = 0)]
    pub idle_actors: usize,
    /// Run each node as a `gpumesh node` process of its own (started the way the
    /// README starts three: one with `--init`, two joining through it), instead of
    /// all three in this process on one runtime.
    #[arg(long)]
    pub processes: bool,
    /// The bench actor's state in KiB (every word of it counted by each call, so
    /// each call makes a new state of that size on the host and its backup);
    /// 0 for 64 words (256 bytes). Idle actors keep 64 words.
    #[arg(long, default_value_t = 0)]
    pub state_kib: u64,
    /// Print one JSON object as the last line (`call_p50_ms`, `call_p99_ms`,
    /// `call_at_host_p50_ms`, `call_at_host_p99_ms`, `calls_per_s`, `failover_ms`,
    /// `calls_host_led`, `warm_up_calls`, `processes`, `state_bytes`, and with `--idle-actors`,
    /// `idle_actors`, `creates_per_s` and `spread_calls_per_s`: one call to each of
    /// them).
    #[arg(long)]
    pub json: bool,
}

/// The bench's three nodes, wherever they run.
enum Mesh {
    /// In this process, sharing its runtime.
    Here(Vec<gpumesh::node::MeshNode>),
    /// Each a `gpumesh node` process.
    Processes(Vec<NodeProcess>),
}

impl Mesh {
    /// The nodes; in this process they mark each call's path on `timeline`.
    async fn start(
        root: &std::path::Path,
        processes: bool,
        timeline: &Timeline,
    ) -> anyhow::Result<Mesh> {
        if !processes {
            return Ok(Mesh::Here(super::local_mesh(root, timeline).await?));
        }
        std::fs::create_dir_all(root)?;
        Ok(Mesh::Processes(super::process_mesh(root)?))
    }

    fn clients(&self) -> anyhow::Result<Vec<Client>> {
        Ok(match self {
            Mesh::Here(nodes) => nodes
                .iter()
                .map(|n| Client::new(n.api_addr.to_string()))
                .collect(),
            Mesh::Processes(procs) => procs
                .iter()
                .map(NodeProcess::client)
                .collect::<Result<_, _>>()?,
        })
    }

    /// Each node's peer id and raft id, in the order of [`Mesh::clients`].
    fn ids(&self) -> Vec<(String, u64)> {
        match self {
            Mesh::Here(nodes) => nodes
                .iter()
                .map(|n| (n.peer_id.to_string(), n.raft_id))
                .collect(),
            Mesh::Processes(procs) => procs
                .iter()
                .map(|p| {
                    let peer = p.seed.rsplit("/p2p/").next().unwrap_or_default();
                    (peer.to_string(), p.raft_id)
                })
                .collect(),
        }
    }

    /// Kills node `i` at once (SIGKILL for a process).
    async fn kill(&mut self, i: usize) {
        match self {
            Mesh::Here(nodes) => nodes.remove(i).kill().await,
            Mesh::Processes(procs) => procs[i].kill9(),
        }
    }

    async fn stop(self) {
        match self {
            // Joiners first: a joiner left running would keep dialling its seed.
            Mesh::Here(nodes) => {
                for n in nodes.into_iter().rev() {
                    n.stop().await;
                }
            }
            Mesh::Processes(procs) => drop(procs),
        }
    }
}

/// The state of the idle actors (and of the bench actor by default): 64 words.
const IDLE_STATE: u64 = 256;

/// Calls made through each of the two nodes before the latency is timed.
const WARM_UP: usize = 16;

/// Adds one to each word of state (64 a workgroup).
const COUNT: &str = "@group(0) @binding(0) var<storage, read_write> count: array<u32>;\n\
@compute @workgroup_size(64)\n\
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { count[gid.x] = count[gid.x] + 1u; }\n";

/// A call counting every word of a state of `bytes` (a multiple of 256).
fn call(bytes: u64) -> ActorCall {
    ActorCall {
        shader: ShaderSource::Wgsl(COUNT.into()),
        entry_point: "main".into(),
        bindings: vec![],
        grid: Grid([(bytes / 256).max(1) as u32, 1, 1]),
        deadline_ms: None,
    }
}

/// Runs `each(client, n)` for n in 0..count through every node's client, `in_flight`
/// at a time; returns how many were done per second.
async fn each<F, Fut>(
    clients: &[Client],
    count: usize,
    in_flight: usize,
    each: F,
) -> anyhow::Result<f64>
where
    F: Fn(Client, usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), gpumesh::ClientError>> + Send,
{
    let t = Instant::now();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut running = tokio::task::JoinSet::new();
    for i in 0..in_flight.clamp(1, count.max(1)) {
        let (c, next, each) = (
            clients[i % clients.len()].clone(),
            next.clone(),
            each.clone(),
        );
        running.spawn(async move {
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= count {
                    return Ok::<_, gpumesh::ClientError>(());
                }
                each(c.clone(), n).await?;
            }
        });
    }
    while let Some(r) = running.join_next().await {
        r??;
    }
    Ok(count as f64 / t.elapsed().as_secs_f64())
}

/// The state of an actor of the bench: `bytes`, all zero.
fn counter_state(bytes: u64) -> Vec<StateInit> {
    vec![StateInit {
        binding: 0,
        size: bytes,
        blob: None,
    }]
}

/// Creates `count` actors through every node, `in_flight` at a time, and leaves
/// them idle; returns how many were created per second.
async fn create_idle(clients: &[Client], count: usize, in_flight: usize) -> anyhow::Result<f64> {
    let per_s = each(clients, count, in_flight, |c, n| async move {
        c.create_actor(&format!("idle{n}"), counter_state(IDLE_STATE), None)
            .await
            .map(|_| ())
    })
    .await?;
    let listed = clients[0].actors().await?.len();
    anyhow::ensure!(listed == count, "{listed} actors listed, not {count}");
    Ok(per_s)
}

/// Calls each of the `count` idle actors once, `in_flight` at a time through every
/// node; returns the calls per second, once every actor is at version 1 and a
/// sample of them holds ones where the CPU says.
async fn call_each_idle(clients: &[Client], count: usize, in_flight: usize) -> anyhow::Result<f64> {
    let per_s = each(clients, count, in_flight, |c, n| async move {
        c.call_actor(&format!("idle{n}"), call(IDLE_STATE), None)
            .await
            .map(|_| ())
    })
    .await?;
    let actors = clients[1].actors().await?;
    let idle: Vec<_> = actors
        .iter()
        .filter(|a| a.name.starts_with("idle"))
        .collect();
    anyhow::ensure!(
        idle.len() == count && idle.iter().all(|a| a.version == 1),
        "not every idle actor ran its one call"
    );
    for n in (0..count).step_by(count.div_ceil(16).max(1)) {
        let words = clients[n % clients.len()]
            .actor_state(&format!("idle{n}"), 0)
            .await?;
        anyhow::ensure!(
            words.chunks_exact(4).all(|w| w == 1u32.to_le_bytes()),
            "actor idle{n} does not hold 1 in every word"
        );
    }
    Ok(per_s)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn actors(args: ActorsBenchArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(args))
}

async fn run(args: ActorsBenchArgs) -> anyhow::Result<ExitCode> {
    let root = std::env::temp_dir().join(format!("gpumesh-bench-actors-{}", std::process::id()));
    let timeline = Timeline::recording();
    let mut mesh = Mesh::start(&root, args.processes, &timeline).await?;
    let clients = mesh.clients()?;
    let ids = mesh.ids();
    // Three voters with adapters before anything is measured.
    let settle = Instant::now() + Duration::from_secs(60);
    loop {
        let st = clients[0].status().await?;
        let voters = st.members.iter().filter(|m| m.role == "voter").count();
        if voters == 3 && st.members.iter().all(|m| m.adapter.is_some()) {
            break;
        }
        anyhow::ensure!(Instant::now() < settle, "the mesh did not settle: {st:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let state = if args.state_kib == 0 {
        IDLE_STATE
    } else {
        args.state_kib << 10
    };
    let created = match args.idle_actors {
        0 => None,
        n => Some(create_idle(&clients, n, args.in_flight).await?),
    };
    clients[0]
        .create_actor("bench", counter_state(state), None)
        .await?;
    let host = clients[0].actor("bench").await?;
    let host_index = ids
        .iter()
        .position(|(peer, _)| *peer == host.node)
        .unwrap_or(0);
    // Calls through a node that is not the host: the path a caller elsewhere takes.
    let via = &clients[(host_index + 1) % ids.len()];
    let what = format!("a counter actor ({state} bytes of state) on 3");
    if args.processes {
        println!("gpumesh bench actors — {what} node processes on loopback");
    } else {
        println!("gpumesh bench actors — {what} nodes on loopback in one process");
    }

    // Warmed up first, as the Ray script warms up its actor: the first calls
    // compile the kernel on the host and open the connections.
    for c in [via, &clients[host_index]] {
        for _ in 0..WARM_UP {
            c.call_actor("bench", call(state), None).await?;
        }
    }
    // Then through the other node until the host leads the record (at most 2 s of
    // calls): a steady stream of calls hands leadership to the node proposing them
    // within a quarter second or so (see `ReplicaConfig::follow_workload`), so that
    // is where a steady caller's calls stand. Before it, each call's entry goes to
    // the leader and its commit back to the host: two hops more.
    let mut warm = 2 * WARM_UP;
    let host_raft_id = ids[host_index].1;
    let settle = Instant::now() + Duration::from_secs(2);
    while via.status().await?.leader != host_raft_id && Instant::now() < settle {
        for _ in 0..WARM_UP {
            via.call_actor("bench", call(state), None).await?;
            warm += 1;
        }
    }
    let before = via.status().await?;
    let host_leads = before.leader == host_raft_id;

    // (1) One call at a time, through a node that is not the host.
    let request_ids = RequestIds::new(u64::from(std::process::id()));
    let mut lat = Vec::new();
    let mut ends: Vec<(RequestId, Instant, Instant)> = Vec::new();
    timeline.take_calls();
    for _ in 0..args.latency_calls.max(1) {
        let id = request_ids.next_id();
        let t = Instant::now();
        via.call_actor("bench", call(state), Some(id)).await?;
        ends.push((id, t, Instant::now()));
        lat.push(t.elapsed());
    }
    let marks = timeline.take_calls();
    let stages = CallStage::ALL.map(|s| (s, s.what()));
    let path = super::breakdown(&marks, &ends, &stages);
    let slow = super::slowest(&marks, &ends, &stages, super::above_p99(ends.len()));
    // An election or a handover inside the timed calls sets the tail: said, not hidden.
    let after = via.status().await?;
    let leader_changed = (after.leader, after.term) != (before.leader, before.term);
    lat.sort();
    let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
    // The same through the host's own API: no hop between nodes before the run.
    let direct = &clients[host_index];
    let mut at_host = Vec::new();
    for _ in 0..args.latency_calls.max(1) {
        let t = Instant::now();
        direct.call_actor("bench", call(state), None).await?;
        at_host.push(t.elapsed());
    }
    at_host.sort();
    let (host_p50, host_p99) = (percentile(&at_host, 0.5), percentile(&at_host, 0.99));

    // (2) Many in flight, through every node.
    let t = Instant::now();
    let per = args.throughput_calls.max(1).div_ceil(args.in_flight.max(1));
    let mut running = Vec::new();
    for i in 0..args.in_flight.max(1) {
        let c = clients[i % clients.len()].clone();
        running.push(tokio::spawn(async move {
            for _ in 0..per {
                c.call_actor("bench", call(state), None).await?;
            }
            Ok::<_, gpumesh::ClientError>(())
        }));
    }
    for r in running {
        r.await??;
    }
    let total = per * args.in_flight.max(1);
    let calls_per_s = total as f64 / t.elapsed().as_secs_f64();
    let version = clients[0].actor("bench").await?.version;
    anyhow::ensure!(
        version == (warm + lat.len() + at_host.len() + total) as u64,
        "the actor ran {version} calls, not {}",
        warm + lat.len() + at_host.len() + total
    );
    // Many actors, one call each: an actor per entity, as programs use them.
    let spread = match args.idle_actors {
        0 => None,
        n => Some(call_each_idle(&clients, n, args.in_flight).await?),
    };

    // (3) The host dies: time to the next acknowledged call.
    let survivor = clients[(host_index + 1) % ids.len()].clone();
    let host_led = survivor.status().await?.leader == host_raft_id;
    let killed = Instant::now();
    mesh.kill(host_index).await;
    survivor.call_actor("bench", call(state), None).await?;
    let failover = killed.elapsed();
    let moved = survivor.actor("bench").await?;
    anyhow::ensure!(moved.node != host.node, "the actor did not move: {moved:?}");
    let counts = survivor.actor_state("bench", 0).await?;
    let expect = (warm + lat.len() + at_host.len() + total + 1) as u32;
    anyhow::ensure!(
        counts
            .chunks_exact(4)
            .all(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == expect),
        "the counter does not hold {expect} in every word"
    );

    println!();
    println!("{:<60} {:>12}", "measurement", "value");
    println!(
        "{:<60} {:>9.2} ms",
        "actor call, one at a time, p50",
        ms(p50)
    );
    println!(
        "{:<60} {:>9.2} ms",
        "actor call, one at a time, p99",
        ms(p99)
    );
    println!(
        "{:<60} {:>9.2} ms",
        "actor call through the host's own API, p50",
        ms(host_p50)
    );
    println!(
        "{:<60} {:>9.2} ms",
        "actor call through the host's own API, p99",
        ms(host_p99)
    );
    println!(
        "{:<60} {:>9.0} /s",
        format!("actor calls, {} in flight through 3 nodes", args.in_flight),
        calls_per_s
    );
    if let Some(per_s) = created {
        println!(
            "{:<60} {:>9.0} /s",
            format!(
                "{} idle actors created, {} at a time",
                args.idle_actors, args.in_flight
            ),
            per_s
        );
    }
    if let Some(per_s) = spread {
        println!(
            "{:<60} {:>9.0} /s",
            format!(
                "one call to each of them, {} in flight through 3 nodes",
                args.in_flight
            ),
            per_s
        );
    }
    println!(
        "{:<60} {:>9.0} ms",
        if host_led {
            "host (the leader too) killed -> next call acknowledged"
        } else {
            "host killed -> next call acknowledged (moved to another node)"
        },
        ms(failover)
    );
    println!(
        "{:<60} {:>12}",
        "host leading the record when the calls were timed (warm-up)",
        format!("{} ({warm})", if host_leads { "yes" } else { "no" })
    );
    // Marked by nodes in this process only.
    if !args.processes {
        println!("\nwhere a call through another node goes (medians over the calls one at a time)");
        for (what, d) in &path {
            println!("  {what:<58} {:>9.2} ms", ms(*d));
        }
        super::print_slowest(
            &format!(
                "the slowest calls ({} of {}; ms){}",
                slow.len(),
                ends.len(),
                if leader_changed {
                    ", the leader changed while they ran"
                } else {
                    ""
                }
            ),
            &path,
            &slow,
        );
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "call_p50_ms": ms(p50),
                "state_bytes": state,
                "call_p99_ms": ms(p99),
                "call_at_host_p50_ms": ms(host_p50),
                "call_at_host_p99_ms": ms(host_p99),
                "calls_per_s": calls_per_s,
                "failover_ms": ms(failover),
                "failover_host_led": host_led,
                "calls_host_led": host_leads,
                "leader_changed_while_timed": leader_changed,
                "warm_up_calls": warm,
                "idle_actors": args.idle_actors,
                "creates_per_s": created,
                "spread_calls_per_s": spread,
                "processes": args.processes,
                "slowest": if args.processes {
                    serde_json::Value::Null
                } else {
                    super::slowest_json(&slow)
                },
            })
        );
    }
    mesh.stop().await;
    let _ = std::fs::remove_dir_all(&root);
    Ok(ExitCode::SUCCESS)
}
