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

use std::time::{Duration, Instant};

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

/// Three nodes on loopback in this process, data under `root`: `a` forms the mesh,
/// `b` and `c` join it.
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

/// The median time between consecutive stages of the runs in `ends` (id, when the
/// client began, when it had its answer), from the nodes' `marks`: the client's
/// request to the API first ("client to the API", up to the first of `stages`),
/// then each stage (in path order, with what happens before it), the answer back
/// to the client last. A stage marked twice counts from its first mark; a stage
/// not marked for a run is left out of that run's rows.
pub(crate) fn breakdown<K, S>(
    marks: &[(K, S, Instant)],
    ends: &[(K, Instant, Instant)],
    stages: &[(S, &str)],
) -> Vec<(String, Duration)>
where
    K: Copy + Eq + std::hash::Hash,
    S: Copy + PartialEq,
{
    let mut rows: Vec<(String, Vec<Duration>)> = Vec::new();
    let mut push = |what: &str, d: Duration| match rows.iter_mut().find(|(w, _)| w == what) {
        Some((_, v)) => v.push(d),
        None => rows.push((what.to_string(), vec![d])),
    };
    let mut by_run: std::collections::HashMap<K, Vec<(S, Instant)>> =
        std::collections::HashMap::new();
    for &(id, stage, t) in marks {
        by_run.entry(id).or_default().push((stage, t));
    }
    for &(id, began, ended) in ends {
        let mut at = began;
        let mine = by_run.get(&id).map_or(&[][..], |v| &v[..]);
        for (i, &(stage, what)) in stages.iter().enumerate() {
            let Some(t) = mine
                .iter()
                .filter(|(s, _)| *s == stage)
                .map(|(_, t)| *t)
                .min()
            else {
                continue;
            };
            let what = if i == 0 { "client to the API" } else { what };
            push(what, t.saturating_duration_since(at));
            at = t.max(at);
        }
        push(
            "answer back to the client",
            ended.saturating_duration_since(at),
        );
    }
    rows.into_iter()
        .map(|(what, mut v)| {
            v.sort();
            (what, v[v.len() / 2])
        })
        .collect()
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

    #[test]
    fn a_breakdown_takes_each_stage_from_the_one_before_and_the_median_of_runs() {
        let t0 = Instant::now();
        let at = |us: u64| t0 + Duration::from_micros(us);
        // Two stages, three runs; run 2 marks its second stage twice (the first
        // counts), run 3 never reaches the first.
        let marks = [
            (1, 'a', at(10)),
            (1, 'b', at(30)),
            (2, 'a', at(120)),
            (2, 'b', at(170)),
            (2, 'b', at(190)),
            (3, 'b', at(260)),
        ];
        let ends = [
            (1, at(0), at(40)),
            (2, at(100), at(200)),
            (3, at(200), at(300)),
        ];
        let rows = breakdown(&marks, &ends, &[('a', "to a"), ('b', "a to b")]);
        let row = |w: &str| rows.iter().find(|(x, _)| x == w).map(|(_, d)| *d);
        assert_eq!(row("client to the API"), Some(Duration::from_micros(20)));
        // Runs 1 and 2 (20, 50 us) and run 3 from its start (60 us): the median.
        assert_eq!(row("a to b"), Some(Duration::from_micros(50)));
        assert_eq!(
            row("answer back to the client"),
            Some(Duration::from_micros(30))
        );
        assert_eq!(row("to a"), None);
    }
}
