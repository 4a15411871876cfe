//! The mesh commands: `gpumesh node`, `submit`, `result`, `status`, `tasks`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use gpumesh::node::{
    ClusterKey, ConnectionCaps, Formation, Limits, MeshNode, Multiaddr, NodeConfig, PeerId,
};
use gpumesh::Client;
use gpumesh_shaders::BackendChoice;

use super::{parse_backend, ApiArgs, TaskArgs};

#[derive(clap::Args, Debug)]
pub struct NodeArgs {
    /// Where this node keeps its identity, Raft log and blobs.
    #[arg(long, default_value = "gpumesh-data")]
    pub data_dir: PathBuf,
    /// libp2p listen address.
    #[arg(long, default_value = "/ip4/0.0.0.0/tcp/4070")]
    pub listen: Multiaddr,
    /// Local API address (HTTP+JSON) for the CLI and clients.
    #[arg(long, default_value = gpumesh::DEFAULT_API)]
    pub api: SocketAddr,
    /// Form a new mesh with this node as its first member.
    #[arg(long, conflicts_with = "bootstrap_expect")]
    pub init: bool,
    /// Form a new mesh once this many nodes (this one included) see each other.
    #[arg(long, value_name = "N")]
    pub bootstrap_expect: Option<usize>,
    /// A peer to reach (multiaddr; `/p2p/<peer id>` optional). Repeatable.
    #[arg(long = "peer", value_name = "MULTIADDR")]
    pub peers: Vec<Multiaddr>,
    /// Backend: vulkan, gl, metal, dx12 (default: the best adapter available).
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    pub backend: BackendChoice,
    /// Do not discover peers with mDNS.
    #[arg(long)]
    pub no_mdns: bool,
    /// Seconds to wait for a mesh to join or form.
    #[arg(long, default_value_t = 30)]
    pub join_timeout: u64,
    /// The mesh's cluster key file (`gpumesh keygen --out FILE`): only nodes holding
    /// the same key can connect. Without one, anyone who reaches --listen can.
    #[arg(long, env = "GPUMESH_CLUSTER_KEY", value_name = "FILE")]
    pub cluster_key: Option<PathBuf>,
    /// Admit only this peer id (repeatable; the node's own id is printed at start).
    /// Without any, every peer holding the cluster key is admitted.
    #[arg(long = "allow-peer", value_name = "PEER_ID")]
    pub allow_peers: Vec<PeerId>,
    /// Most connections one peer may hold open with this node.
    #[arg(long, value_name = "N", default_value_t = ConnectionCaps::default().per_peer)]
    pub max_connections_per_peer: u32,
    /// Most connections open with all peers together.
    #[arg(long, value_name = "N", default_value_t = ConnectionCaps::default().total)]
    pub max_connections: u32,
    /// Most incoming connections still in their handshakes at once.
    #[arg(long, value_name = "N", default_value_t = ConnectionCaps::default().pending_incoming)]
    pub max_pending_incoming: u32,
    /// Largest WGSL source of one task, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = Limits::default().max_shader_bytes)]
    pub max_shader_bytes: u64,
    /// Largest blob, in bytes: an upload, a blob from a peer, a task's outputs together.
    #[arg(long, value_name = "BYTES", default_value_t = Limits::default().max_blob_bytes)]
    pub max_blob_bytes: u64,
    /// Most workgroups (x·y·z) in one task's grid.
    #[arg(long, value_name = "N", default_value_t = Limits::default().max_grid)]
    pub max_grid: u64,
    /// Most tasks submitted through this node that may be pending or running at once.
    #[arg(long, value_name = "N", default_value_t = Limits::default().max_queued_per_submitter)]
    pub max_queued_per_submitter: usize,
    /// Largest API request body in bytes, blob uploads excepted (--max-blob-bytes).
    #[arg(long, value_name = "BYTES", default_value_t = Limits::default().max_request_bytes)]
    pub max_request_bytes: u64,
}

pub fn node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    // Before anything starts: a bad key file stops the node with the file's name.
    let cluster_key = args
        .cluster_key
        .as_deref()
        .map(ClusterKey::load)
        .transpose()?;
    let mut config = NodeConfig::new(&args.data_dir);
    config.cluster_key = cluster_key;
    config.allow_peers = args.allow_peers;
    config.connections = ConnectionCaps {
        per_peer: args.max_connections_per_peer,
        total: args.max_connections,
        pending_incoming: args.max_pending_incoming,
    };
    config.limits = Limits {
        max_shader_bytes: args.max_shader_bytes,
        max_blob_bytes: args.max_blob_bytes,
        max_grid: args.max_grid,
        max_queued_per_submitter: args.max_queued_per_submitter,
        max_request_bytes: args.max_request_bytes,
    };
    config.listen = vec![args.listen];
    config.api = args.api;
    config.peers = args.peers;
    config.backend = args.backend;
    config.mdns = !args.no_mdns;
    config.join_timeout = std::time::Duration::from_secs(args.join_timeout);
    config.formation = match (args.init, args.bootstrap_expect) {
        (true, _) => Formation::Init,
        (false, Some(0)) => bail!("--bootstrap-expect must be at least 1"),
        (false, Some(n)) => Formation::BootstrapExpect(n),
        (false, None) => Formation::Join,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let node = MeshNode::start(config).await?;
        println!("gpumesh node {} (raft id {:x})", node.peer_id, node.raft_id);
        for a in &node.listen_addrs {
            println!("  listening on {a}/p2p/{}", node.peer_id);
        }
        match &cluster_key {
            Some(key) => println!("  cluster key: fingerprint {}", key.fingerprint()),
            None => println!(
                "  cluster key: none (anyone who reaches the listen address can connect; \
                 see `gpumesh keygen`)"
            ),
        }
        match &node.capability {
            Some(c) => println!(
                "  adapter: {} ({}), {:.1} GFLOP/s, {:.1} GB/s",
                c.adapter_name,
                c.backend.name(),
                c.gflops,
                c.gbps
            ),
            None => println!("  adapter: none (this node joins the mesh but runs no shards)"),
        }
        println!(
            "  API on http://{}  (Ctrl-C leaves the mesh)",
            node.api_addr
        );
        let _ = std::io::stdout().flush();
        tokio::signal::ctrl_c().await?;
        println!("leaving the mesh...");
        node.leave().await;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args, Debug)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub task: TaskArgs,
    #[command(flatten)]
    pub api: ApiArgs,
    /// Wait for the task, showing shard progress, then print its output hashes.
    #[arg(long)]
    pub wait: bool,
    /// Run each shard on this many nodes (different adapters or backends first) and
    /// accept a result only when two agree; a disagreement brings in a third node.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub replicas: u32,
    /// Compare replica outputs as f32 values within this relative tolerance instead
    /// of bit for bit (default: bit for bit, or 1e-5 for a float merge rule).
    #[arg(long, value_name = "R")]
    pub tolerance: Option<f32>,
    /// Stop a shard that runs longer than this many seconds on a GPU and fail the
    /// task (default: the node's, 60 s).
    #[arg(long, value_name = "SECONDS")]
    pub deadline: Option<f64>,
    /// With --wait: also fetch the outputs into DIR/<binding>.bin.
    #[arg(long, value_name = "DIR", requires = "wait")]
    pub out_dir: Option<PathBuf>,
    /// With --wait and --builtin: check the result against the CPU reference.
    #[arg(long, requires = "wait")]
    pub verify: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn submit(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    if args.verify && args.task.builtin.is_none() {
        bail!("--verify needs a CPU reference, which only built-in kernels have (use --builtin)");
    }
    // Validated here first, with the same messages as `gpumesh run`.
    let mut prepared = super::run::prepare(&args.task)?;
    let options = &mut prepared.spec.options;
    options.replicas = args.replicas;
    options.tolerance = args.tolerance.or_else(|| {
        // Float sums and extremes from different hardware differ in the last bits.
        let float = prepared.spec.merge.elem() == Some(gpumesh::protocol::ElemType::F32);
        (args.replicas > 1 && float).then_some(1e-5)
    });
    if let Some(secs) = args.deadline {
        if !(secs.is_finite() && secs > 0.0) {
            bail!("--deadline must be a positive number of seconds");
        }
        options.deadline_ms = Some((secs * 1000.0).ceil() as u64);
    }
    prepared.spec.check_shape()?;
    let client = Client::new(args.api.api.clone());
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        for (id, bytes) in &prepared.blobs {
            let stored = client.upload(bytes.to_vec()).await?;
            anyhow::ensure!(stored == *id, "the node stored input {id} as {stored}");
        }
        let task = client.submit(prepared.spec, None).await?;
        if !args.wait {
            if args.json {
                println!("{}", serde_json::json!({ "task": task }));
            } else {
                println!("submitted t{task} ({})", prepared.label);
            }
            return Ok(ExitCode::SUCCESS);
        }
        let show = !args.json;
        let started = std::time::Instant::now();
        let view = client
            .wait(task, |done, total| {
                if show {
                    eprint!("\r  t{task} [{}{}] {done}/{total} shards", "#".repeat(done * 20 / total.max(1)), " ".repeat(20 - done * 20 / total.max(1)));
                }
            })
            .await?;
        if show {
            eprintln!();
        }
        let outputs = client.outputs(task).await?;
        let mut verdict = None;
        if args.out_dir.is_some() || args.verify {
            let results = client.results(task).await?;
            if let Some(dir) = &args.out_dir {
                std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
                for (binding, bytes) in &results {
                    std::fs::write(dir.join(format!("{binding}.bin")), bytes)?;
                }
            }
            if let Some(p) = &prepared.problem {
                verdict = Some(p.verify(&results).map(|a| a.to_string()).map_err(|m| m.to_string()));
            }
        }
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "task": task,
                    "status": view.status,
                    "elapsed_ms": started.elapsed().as_secs_f64() * 1e3,
                    "outputs": outputs,
                    "verify": verdict.as_ref().map(|v| serde_json::json!({"ok": v.is_ok(), "detail": match v { Ok(s) | Err(s) => s }})),
                })
            );
        } else {
            println!("t{task} {} in {:.1} ms", view.status, started.elapsed().as_secs_f64() * 1e3);
            for o in &outputs {
                println!("  output {}: {} bytes, blake3 {}", o.binding, o.size, o.blake3);
            }
            if let Some(v) = &verdict {
                match v {
                    Ok(s) => println!("  verify: OK — {s}"),
                    Err(s) => println!("  verify: MISMATCH — {s}"),
                }
            }
        }
        Ok(match verdict {
            Some(Err(_)) => ExitCode::from(3),
            _ => ExitCode::SUCCESS,
        })
    })
}

#[derive(clap::Args, Debug)]
pub struct ResultArgs {
    /// The task id (as `gpumesh tasks` shows it, e.g. t12 or 12).
    pub task: String,
    #[arg(long, value_name = "DIR")]
    pub out_dir: PathBuf,
    #[command(flatten)]
    pub api: ApiArgs,
    #[arg(long)]
    pub json: bool,
}

fn task_id(s: &str) -> anyhow::Result<u64> {
    s.trim_start_matches('t')
        .parse()
        .with_context(|| format!("{s:?} is not a task id (e.g. t12)"))
}

pub fn result(args: ResultArgs) -> anyhow::Result<ExitCode> {
    let task = task_id(&args.task)?;
    let client = Client::new(args.api.api.clone());
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let results = client.results(task).await?;
        std::fs::create_dir_all(&args.out_dir)
            .with_context(|| format!("cannot create {}", args.out_dir.display()))?;
        let mut written = Vec::new();
        for (binding, bytes) in &results {
            let path = args.out_dir.join(format!("{binding}.bin"));
            std::fs::write(&path, bytes)
                .with_context(|| format!("cannot write {}", path.display()))?;
            written.push(serde_json::json!({
                "binding": binding, "bytes": bytes.len(),
                "blake3": blake3::hash(bytes).to_hex().to_string(), "path": path,
            }));
            if !args.json {
                println!(
                    "output {binding}: {} bytes -> {}",
                    bytes.len(),
                    path.display()
                );
            }
        }
        if args.json {
            println!("{}", serde_json::Value::Array(written));
        }
        anyhow::Ok(ExitCode::SUCCESS)
    })
}

pub fn status(api: ApiArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = Client::new(api.api);
    let st = tokio::runtime::Runtime::new()?.block_on(client.status())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "leader {:x}, term {}, commit {}",
        st.leader, st.term, st.commit_index
    );
    println!(
        "{:<17} {:<54} {:<8} {:<6} {:<34} {:<7} {:>8} {:>6} {:>5}",
        "raft id", "peer id", "role", "alive", "adapter", "backend", "GFLOP/s", "GB/s", "queue"
    );
    for m in &st.members {
        let role = if m.raft_id == st.leader {
            "leader".to_string()
        } else {
            m.role.clone()
        };
        println!(
            "{:<17x} {:<54} {:<8} {:<6} {:<34} {:<7} {:>8.1} {:>6.1} {:>5}",
            m.raft_id,
            m.peer_id,
            role,
            if m.alive { "yes" } else { "NO" },
            m.adapter.as_deref().unwrap_or("none"),
            m.backend.as_deref().unwrap_or("-"),
            m.gflops.unwrap_or(0.0),
            m.gbps.unwrap_or(0.0),
            m.queue
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub fn tasks(api: ApiArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = Client::new(api.api);
    let tasks = tokio::runtime::Runtime::new()?.block_on(client.tasks())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&tasks)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<8} {:<10} {:<18} {:<9} {:>7} {:>8} {:>10}  reason",
        "task", "status", "kernel", "merge", "shards", "replicas", "mismatches"
    );
    for t in &tasks {
        println!(
            "{:<8} {:<10} {:<18} {:<9} {:>3}/{:<3} {:>8} {:>10}  {}",
            format!("t{}", t.id),
            t.status,
            t.kernel,
            t.merge,
            t.shards_done,
            t.shards.len(),
            t.replicas,
            t.mismatches,
            t.reason.as_deref().unwrap_or("")
        );
    }
    Ok(ExitCode::SUCCESS)
}
