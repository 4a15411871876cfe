//! Three gpumesh nodes on loopback in one process: a sharded matmul is submitted
//! through a follower, its result fetched through another node and checked against
//! the CPU reference, and a per-node summary printed.
//!
//! `cargo run --release --example local_mesh`
//! `cargo run --release --example local_mesh -- --serve`: then keep the nodes up
//! (their dashboards open in a browser) until Ctrl-C.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{ensure, Context};
use gpumesh::node::{Formation, MeshNode, NodeConfig};
use gpumesh::protocol::BindingRole;
use gpumesh::shaders::builtins;
use gpumesh::Client;

const SHARDS: u32 = 6;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,wgpu_hal=error,wgpu_core=error,naga=error".into()),
        )
        .init();
    let root = std::env::temp_dir().join(format!("gpumesh-local-mesh-{}", std::process::id()));
    let result = run(&root).await;
    let _ = std::fs::remove_dir_all(&root);
    result
}

async fn run(root: &std::path::Path) -> anyhow::Result<()> {
    let config = |name: &str, formation| {
        let mut c = NodeConfig::new(root.join(name));
        c.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("multiaddr")];
        c.api = "127.0.0.1:0".parse().expect("socket address");
        c.mdns = false;
        c.formation = formation;
        c
    };
    let started = Instant::now();
    let first = MeshNode::start(config("node-a", Formation::Init)).await?;
    let seed: gpumesh::node::Multiaddr =
        format!("{}/p2p/{}", first.listen_addrs[0], first.peer_id).parse()?;
    let mut nodes = vec![first];
    for name in ["node-b", "node-c"] {
        let mut c = config(name, Formation::Join);
        c.peers = vec![seed.clone()];
        // The first node made the mesh's cluster key: the others join with it.
        c.cluster_key = nodes[0].cluster_key;
        nodes.push(MeshNode::start(c).await?);
    }
    println!("3 nodes up in {:.2}s", started.elapsed().as_secs_f64());

    // Submit through a follower, fetch through another node.
    let status = Client::new(nodes[0].api_addr.to_string()).status().await?;
    let follower = nodes
        .iter()
        .position(|n| n.raft_id != status.leader)
        .context("a follower")?;
    let other = (follower + 1) % nodes.len();
    let submit = Client::new(nodes[follower].api_addr.to_string());
    let fetch = Client::new(nodes[other].api_addr.to_string());

    let problem = builtins::get("matmul")?.problem(512)?;
    let mut spec = problem.spec(SHARDS);
    for b in &mut spec.bindings {
        if let BindingRole::Input { blob, .. } = &b.role {
            let bytes = problem.blobs.get(blob).context("input bytes")?;
            ensure!(submit.upload(bytes.to_vec()).await? == *blob, "upload hash");
        }
    }
    let t = Instant::now();
    let task = submit.submit(spec, None).await?;
    let done = submit
        .wait(task, |d, n| println!("  task t{task}: {d}/{n} shards done"))
        .await?;
    let outputs: BTreeMap<u32, Vec<u8>> = fetch.results(task).await?;
    let elapsed = t.elapsed();
    let agreement = problem
        .verify(&outputs)
        .map_err(|m| anyhow::anyhow!("{m}"))?;
    println!(
        "task t{task} (matmul 512, {SHARDS} shards): submitted via node {}, fetched via node {} in {:.0} ms",
        follower,
        other,
        elapsed.as_secs_f64() * 1e3
    );
    println!("  verify: {agreement}");

    let status = fetch.status().await?;
    println!(
        "\n{:<6} {:<54} {:<8} {:<7} {:>8} {:>7}",
        "node", "peer id", "role", "backend", "GFLOP/s", "shards"
    );
    for (i, n) in nodes.iter().enumerate() {
        let m = status
            .members
            .iter()
            .find(|m| m.raft_id == n.raft_id)
            .context("member")?;
        let ran = done
            .shards
            .iter()
            .filter(|s| s.node == Some(n.raft_id))
            .count();
        let role = if status.leader == n.raft_id {
            "leader".to_string()
        } else {
            m.role.clone()
        };
        println!(
            "{:<6} {:<54} {:<8} {:<7} {:>8.1} {:>7}",
            i,
            m.peer_id,
            role,
            m.backend.as_deref().unwrap_or("-"),
            m.gflops.unwrap_or(0.0),
            ran
        );
    }
    if std::env::args().any(|a| a == "--serve") {
        println!();
        for (i, n) in nodes.iter().enumerate() {
            println!("node {i}: dashboard http://{}/", n.api_addr);
        }
        println!("(GPUMESH_API=<address> gpumesh submit ... to add work; Ctrl-C stops the nodes)");
        tokio::signal::ctrl_c().await?;
    }
    // Joiners first: a joiner left running would keep dialling its seed, and warn.
    for n in nodes.into_iter().rev() {
        n.stop().await;
    }
    Ok(())
}
