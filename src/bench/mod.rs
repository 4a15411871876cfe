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
    let by_run = by_run(marks);
    for &(id, began, ended) in ends {
        for (what, d) in run_stages(&by_run, id, began, ended, stages) {
            match rows.iter_mut().find(|(w, _)| *w == what) {
                Some((_, v)) => v.push(d),
                None => rows.push((what.to_string(), vec![d])),
            }
        }
    }
    rows.into_iter()
        .map(|(what, mut v)| {
            v.sort();
            (what, v[v.len() / 2])
        })
        .collect()
}

/// One of the slowest runs: where it was among the runs, how long it took, and its
/// stages as [`breakdown`] counts them.
pub(crate) struct Slow {
    pub place: usize,
    pub took: Duration,
    pub stages: Vec<(String, Duration)>,
}

/// The `count` slowest runs of `ends`, slowest first, each with its own stages (see
/// [`breakdown`]): a tail's stage is there to read instead of lost in the medians.
pub(crate) fn slowest<K, S>(
    marks: &[(K, S, Instant)],
    ends: &[(K, Instant, Instant)],
    stages: &[(S, &str)],
    count: usize,
) -> Vec<Slow>
where
    K: Copy + Eq + std::hash::Hash,
    S: Copy + PartialEq,
{
    let by_run = by_run(marks);
    let mut places: Vec<usize> = (0..ends.len()).collect();
    places.sort_by_key(|&i| std::cmp::Reverse(ends[i].2 - ends[i].1));
    places
        .into_iter()
        .take(count)
        .map(|place| {
            let (id, began, ended) = ends[place];
            Slow {
                place,
                took: ended - began,
                stages: run_stages(&by_run, id, began, ended, stages)
                    .into_iter()
                    .map(|(what, d)| (what.to_string(), d))
                    .collect(),
            }
        })
        .collect()
}

/// How many runs of `runs` lie above the 99th percentile's place (at least one).
pub(crate) fn above_p99(runs: usize) -> usize {
    (runs - ((runs.max(1) - 1) as f64 * 0.99).round() as usize).max(1)
}

/// Prints the `slow` runs beside the `median` stages, a column each.
pub(crate) fn print_slowest(what: &str, median: &[(String, Duration)], slow: &[Slow]) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    print!("\n{what:<50} {:>8}", "median");
    for s in slow {
        print!(" {:>8}", format!("#{}", s.place + 1));
    }
    println!();
    for (stage, d) in median {
        print!("  {stage:<48} {:>8.2}", ms(*d));
        for s in slow {
            let own = s.stages.iter().find(|(w, _)| w == stage).map(|(_, d)| *d);
            match own {
                Some(d) => print!(" {:>8.2}", ms(d)),
                None => print!(" {:>8}", "-"),
            }
        }
        println!();
    }
    print!("  {:<48} {:>8}", "whole run", "");
    for s in slow {
        print!(" {:>8.2}", ms(s.took));
    }
    println!();
}

/// The slowest runs as JSON: place (from 1), ms, and ms by stage.
pub(crate) fn slowest_json(slow: &[Slow]) -> serde_json::Value {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    slow.iter()
        .map(|s| {
            let stages: serde_json::Map<String, serde_json::Value> = s
                .stages
                .iter()
                .map(|(w, d)| (w.clone(), ms(*d).into()))
                .collect();
            serde_json::json!({ "place": s.place + 1, "ms": ms(s.took), "stages": stages })
        })
        .collect()
}

/// The marks of each run, by its id.
fn by_run<K, S>(marks: &[(K, S, Instant)]) -> std::collections::HashMap<K, Vec<(S, Instant)>>
where
    K: Copy + Eq + std::hash::Hash,
    S: Copy,
{
    let mut by_run: std::collections::HashMap<K, Vec<(S, Instant)>> =
        std::collections::HashMap::new();
    for &(id, stage, t) in marks {
        by_run.entry(id).or_default().push((stage, t));
    }
    by_run
}

/// One run's stages (see [`breakdown`]).
fn run_stages<'a, K, S>(
    by_run: &std::collections::HashMap<K, Vec<(S, Instant)>>,
    id: K,
    began: Instant,
    ended: Instant,
    stages: &[(S, &'a str)],
) -> Vec<(&'a str, Duration)>
where
    K: Copy + Eq + std::hash::Hash,
    S: Copy + PartialEq,
{
    let mut out = Vec::new();
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
        out.push((what, t.saturating_duration_since(at)));
        at = t.max(at);
    }
    out.push((
        "answer back to the client",
        ended.saturating_duration_since(at),
    ));
    out
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

        // The slowest two: run 2 (100 us), then run 3 (100 us too, later: either
        // order), never run 1 (40 us); each with its own stages.
        let slow = slowest(&marks, &ends, &[('a', "to a"), ('b', "a to b")], 2);
        assert_eq!(slow.len(), 2);
        let mut places: Vec<usize> = slow.iter().map(|s| s.place).collect();
        places.sort();
        assert_eq!(places, [1, 2]);
        let two = slow.iter().find(|s| s.place == 1).unwrap();
        assert_eq!(two.took, Duration::from_micros(100));
        let stage = |w: &str| two.stages.iter().find(|(x, _)| x == w).map(|(_, d)| *d);
        assert_eq!(stage("client to the API"), Some(Duration::from_micros(20)));
        assert_eq!(stage("a to b"), Some(Duration::from_micros(50)));
        assert_eq!(
            stage("answer back to the client"),
            Some(Duration::from_micros(30))
        );
        assert_eq!(above_p99(200), 3);
        assert_eq!(above_p99(1), 1);
    }
}
