//! `gpumesh bench ...`: measurements printed as tables, never asserted in tests.

mod actors;
mod blobs;
mod consensus;
mod direct;
mod executor;
mod failover;
mod faults;
mod mesh;
mod sharding;

pub use actors::{actors, ActorsBenchArgs};
pub use blobs::{blobs, BlobsBenchArgs};
pub use consensus::{consensus, ConsensusBenchArgs};
pub use executor::{executor, ExecutorBenchArgs};
pub use faults::{faults, FaultsBenchArgs};
pub use mesh::{mesh, MeshBenchArgs};

use std::time::Duration;

/// Median of `runs` timings of `f`, after one warm-up call.
pub fn median_of<E>(
    runs: usize,
    mut f: impl FnMut() -> Result<Duration, E>,
) -> Result<Duration, E> {
    f()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        times.push(f()?);
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// Workgroups of a kernel whose run time grows with them that make a run of about
/// `target` (at most 65,535), from `time`, which runs it over that many. The count
/// is raised fourfold until a run takes a quarter of `target`: below that a wide
/// GPU is not yet full (more workgroups take no longer), and scaling in
/// proportion from there would fall short; then scaled again from the runs that
/// gives.
pub fn workgroups_for<E>(
    target: Duration,
    mut time: impl FnMut(u32) -> Result<Duration, E>,
) -> Result<u32, E> {
    let most = 65_535u32;
    let mut groups = 64u32;
    time(groups)?;
    let mut t = time(groups)?;
    while t < target / 4 && groups < most {
        groups = groups.saturating_mul(4).min(most);
        t = time(groups)?;
    }
    let scale = |groups: u32, t: Duration| {
        let scaled = f64::from(groups) * target.as_secs_f64() / t.as_secs_f64().max(1e-6);
        scaled.clamp(1.0, f64::from(most)) as u32
    };
    // Scaling from a quarter of the target falls short where a run has a fixed
    // cost or the GPU fills in steps (llvmpipe's threads): scaled again from the
    // run it gives, twice at most, until it is within 5% of the target.
    for _ in 0..2 {
        let next = scale(groups, t);
        if next == groups {
            break;
        }
        groups = next;
        t = time(groups)?;
        if t.abs_diff(target) <= target / 20 {
            return Ok(groups);
        }
    }
    Ok(scale(groups, t))
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A kernel's two bindings when it reads blob `blob` at binding 0 and writes as
/// many bytes at binding 1.
fn input_to_output(
    blob: gpumesh_protocol::BlobId,
    size: u64,
) -> Vec<gpumesh_protocol::BindingSpec> {
    use gpumesh_protocol::{BindingRole, BindingSpec};
    vec![
        BindingSpec {
            binding: 0,
            role: BindingRole::Input { blob, size },
        },
        BindingSpec {
            binding: 1,
            role: BindingRole::Output { size },
        },
    ]
}

/// The cluster key of the meshes a bench starts (meshes are closed by default).
fn mesh_key() -> gpumesh::node::ClusterKey {
    static KEY: std::sync::OnceLock<gpumesh::node::ClusterKey> = std::sync::OnceLock::new();
    *KEY.get_or_init(gpumesh::node::ClusterKey::generate)
}

/// Three nodes on loopback in this process, data under `root`: `a` forms the mesh,
/// `b` and `c` join it.
/// Three `gpumesh node` processes on loopback, keeping their data under `root`,
/// started as the README starts them: `a` with `--init`, `b` and `c` joining
/// through it with its ticket.
fn process_mesh(root: &std::path::Path) -> anyhow::Result<Vec<gpumesh::process::NodeProcess>> {
    use anyhow::Context;
    let bin = std::env::current_exe().context("where is the gpumesh binary?")?;
    let mut procs = Vec::new();
    for name in ["a", "b", "c"] {
        let mut p = gpumesh::process::NodeProcess::new(&bin, root, name)?;
        p.log_filter = "warn,wgpu_hal=error,wgpu_core=error,naga=error".into();
        procs.push(p);
    }
    procs[0].start(&["--init"])?;
    let ticket = procs[0].ticket()?;
    for p in &mut procs[1..] {
        p.start(&["--join", &ticket])?;
    }
    Ok(procs)
}

async fn local_mesh(
    root: &std::path::Path,
    timeline: &gpumesh::node::timeline::Timeline,
) -> anyhow::Result<Vec<gpumesh::node::MeshNode>> {
    use gpumesh::node::{Formation, MeshNode, NodeConfig};
    let config = |name: &str, formation, peers: Vec<_>| {
        let mut c = NodeConfig::new(root.join(name));
        c.timeline = timeline.clone();
        c.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("multiaddr")];
        c.api = "127.0.0.1:0".parse().expect("address");
        c.mdns = false;
        c.formation = formation;
        c.peers = peers;
        c.cluster_key = Some(mesh_key());
        c
    };
    let first = MeshNode::start(config("a", Formation::Init, vec![])).await?;
    let seed: gpumesh::node::Multiaddr =
        format!("{}/p2p/{}", first.listen_addrs[0], first.peer_id).parse()?;
    let mut nodes = vec![first];
    for name in ["b", "c"] {
        nodes.push(MeshNode::start(config(name, Formation::Join, vec![seed.clone()])).await?);
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU with a fixed cost per run and a run time in whole steps of its
    /// threads, as llvmpipe's: scaling from a quarter of the target alone falls
    /// short by the fixed cost's share.
    fn stepped(groups: u32) -> Result<Duration, ()> {
        let steps = groups.div_ceil(16);
        Ok(Duration::from_millis(8) + Duration::from_micros(600) * steps)
    }

    #[test]
    fn workgroups_are_scaled_until_a_run_is_near_the_target() {
        let target = Duration::from_millis(120);
        let groups = workgroups_for(target, stepped).unwrap();
        let t = stepped(groups).unwrap();
        assert!(
            t.abs_diff(target) <= target / 20,
            "{groups} workgroups run {t:?}, not about {target:?}"
        );
    }

    #[test]
    fn a_run_that_no_workgroup_count_lengthens_stops_at_the_most() {
        let flat = |_| Ok::<_, ()>(Duration::from_millis(1));
        assert_eq!(
            workgroups_for(Duration::from_millis(120), flat).unwrap(),
            65_535
        );
    }
}
