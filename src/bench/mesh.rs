//! `gpumesh bench mesh`: a 3-node loopback mesh in this process, measured side by
//! side with the same work done directly.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumesh::consensus::TaskId;
use gpumesh::node::timeline::{Mark, Stage, Timeline};
use gpumesh::Client;
use gpumesh_protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource, TaskSpec};
use gpumesh_shaders::{BackendChoice, Executor, Job, Kernel};

use super::ms;

#[derive(clap::Args, Debug)]
pub struct MeshBenchArgs {
    /// Trivial tasks timed one at a time for the latency figures.
    #[arg(long, default_value_t = 200)]
    pub latency_tasks: usize,
    /// Tiny tasks submitted for the throughput figure (enough to be sustained:
    /// a few seconds, past a snapshot and compaction of the record on each node).
    #[arg(long, default_value_t = 10_000)]
    pub throughput_tasks: usize,
    /// Tiny tasks in flight at once during the throughput run.
    #[arg(long, default_value_t = 64)]
    pub in_flight: usize,
    /// Gives each latency and throughput task a result of this many KiB, new bytes
    /// each task (checked against the CPU's), instead of the tiny task's 256 bytes.
    #[arg(long, default_value_t = 0)]
    pub result_kib: u32,
    /// Runs of the ~120 ms kernel, each directly and then through the mesh: the
    /// ratio is the median of the pairs' (a pair's two runs are a quarter second
    /// apart, so the machine's drift from minute to minute cancels out).
    #[arg(long, default_value_t = 15)]
    pub spin_runs: usize,
    /// MiB moved in the blob transfer comparison.
    #[arg(long, default_value_t = 64)]
    pub transfer_mib: usize,
    /// Runs of the task with a 16 MiB result, each directly and through the mesh.
    #[arg(long, default_value_t = 5)]
    pub big_runs: usize,
    /// After the table, one JSON object on the last line: p50_ms, p99_ms,
    /// tasks_per_s (result_kib: the size of those figures' results, 0 for 256 bytes),
    /// mesh_vs_direct, blob_vs_tcp (blob_ahead_vs_tcp: the pull opening records
    /// ahead), blob_stored_vs_tcp, blob_stored_vs_disk, the
    /// disk's fsync_ms and fsync_after_idle_ms, input_task_p50_ms, big_result_ms
    /// and big_result_direct_ms, submitter_led and warm_up_tasks.
    #[arg(long)]
    pub json: bool,
}

/// Doubles 64 u32s: the smallest useful task.
pub(super) const TINY: &str = "@group(0) @binding(0) var<storage, read_write> out: array<u32>;\n\
@compute @workgroup_size(64)\n\
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { out[gid.x] = gid.x * 2u; }\n";

/// Trivial tasks run before the latency is timed, at least (see `run`).
const WARM_UP: usize = 64;

/// Each invocation hashes 60,000 times; the workgroup count sets the run time.
pub(super) const SPIN: &str = r#"
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < 60000u; i++) {
        x = (x ^ (x >> 13u)) * 1664525u + i;
    }
    out[gid.x] = x;
}
"#;

/// [`SPIN`] with a seed: each run's output differs from the one before, as a
/// user's runs' outputs do (the same bytes again would be found already stored,
/// here and on the node keeping the second copy, and nothing stored or copied).
/// The whole grid folds its words into one (each workgroup its invocations', then
/// the workgroups theirs), so the result is 4 bytes on every adapter: the ~120 ms
/// this kernel is sized to takes 190 workgroups on lavapipe and 65,535 on an H100,
/// and a result that grows with the GPU's width made the mesh/direct ratio a
/// measure of storing it on two nodes (the 16 MiB result row measures that) instead
/// of the mesh's own cost: 15 MB with a word per invocation (1.375 on the H100),
/// 256 KiB with a word per workgroup (1.020-1.025 there, 0.8 ms of it storing).
const SPIN_SEEDED: &str = r#"
@group(0) @binding(0) var<storage, read_write> out: array<atomic<u32>>;
@group(0) @binding(1) var<uniform> seed: vec4<u32>;
var<workgroup> folded: atomic<u32>;
@compute @workgroup_size(64)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    var x = gid.x ^ seed.x;
    for (var i = 0u; i < 60000u; i++) {
        x = (x ^ (x >> 13u)) * 1664525u + i;
    }
    atomicXor(&folded, x);
    workgroupBarrier();
    if lid == 0u {
        atomicXor(&out[0], atomicLoad(&folded));
    }
}
"#;

/// [`SPIN_SEEDED`] over `groups` workgroups with `seed`: one word of output.
fn seeded_spin(groups: u32, seed: u32) -> TaskSpec {
    let mut s = seeded(SPIN_SEEDED, groups, seed);
    s.bindings[0].role = BindingRole::Output { size: 4 };
    s
}

/// A kernel with its output at binding 0 and a seed at 1, over `groups` workgroups.
fn seeded(source: &str, groups: u32, seed: u32) -> TaskSpec {
    let mut s = spec(source, groups, 1);
    let mut data = seed.to_le_bytes().to_vec();
    data.resize(16, 0);
    s.bindings.push(BindingSpec {
        binding: 1,
        role: BindingRole::Param { data },
    });
    s
}

/// Task `n` of the latency and throughput runs, through `client`, its result
/// checked: the tiny task, or (`result_kib` > 0) one whose result is that many KiB
/// of new bytes.
async fn timed_task(client: &Client, result_kib: u32, n: usize) -> anyhow::Result<TaskId> {
    if result_kib == 0 {
        let (task, out) = client.run(spec(TINY, 1, 1)).await?;
        anyhow::ensure!(out[&0][4..8] == 2u32.to_le_bytes(), "wrong tiny result");
        return Ok(TaskId(task));
    }
    let seed = (n as u32).wrapping_mul(2_654_435_761) ^ std::process::id();
    let (task, out) = client.run(seeded(BIG_SEEDED, result_kib * 4, seed)).await?;
    anyhow::ensure!(
        out[&0] == big_seeded_cpu(result_kib * 4 * 64, seed),
        "a {result_kib} KiB result differs from the CPU's"
    );
    Ok(TaskId(task))
}

/// What [`BIG_SEEDED`] writes over `words` invocations with `seed`, on the CPU.
fn big_seeded_cpu(words: u32, seed: u32) -> Vec<u8> {
    (0..words)
        .flat_map(|i| {
            (i ^ seed)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(1)
                .to_le_bytes()
        })
        .collect()
}

/// Fills its output with words of a seed, so each run's result is new bytes: over
/// [`BIG_GROUPS`] workgroups, a 16 MiB result from next to no GPU work.
const BIG_SEEDED: &str = r#"
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<uniform> seed: vec4<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    out[gid.x] = (gid.x ^ seed.x) * 2654435761u + 1u;
}
"#;

/// Workgroups of [`BIG_SEEDED`]: 16 MiB less 256 bytes of result.
const BIG_GROUPS: u32 = 65_535;

/// Doubles each word of its input: a task with a blob in and a result out.
const DOUBLE: &str = "@group(0) @binding(0) var<storage, read> inp: array<u32>;\n\
@group(0) @binding(1) var<storage, read_write> out: array<u32>;\n\
@compute @workgroup_size(64)\n\
fn main(@builtin(global_invocation_id) gid: vec3<u32>) { out[gid.x] = inp[gid.x] * 2u; }\n";

/// Words in [`DOUBLE`]'s input and output: 16 KiB each, over what a log entry
/// carries, so the input and the result are each kept on two nodes as blobs.
const DOUBLE_WORDS: u32 = 4096;

/// Uploads `words` as a new blob, submits [`DOUBLE`] on it (`POST /v1/tasks`: the
/// mesh places it), waits for it and fetches its output; checks it.
async fn double(client: &Client, words: &[u32]) -> anyhow::Result<TaskId> {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let size = bytes.len() as u64;
    let blob = client.upload(bytes).await?;
    let mut s = spec(DOUBLE, DOUBLE_WORDS / 64, 1);
    s.bindings = super::input_to_output(blob, size);
    let task = client.submit(s, None).await?;
    client.wait(task, |_, _| {}).await?;
    let out = client.results(task).await?;
    let want: Vec<u8> = words
        .iter()
        .flat_map(|w| w.wrapping_mul(2).to_le_bytes())
        .collect();
    anyhow::ensure!(out.get(&1) == Some(&want), "wrong doubled words");
    Ok(TaskId(task))
}

pub(super) fn spec(source: &str, groups: u32, shards: u32) -> TaskSpec {
    TaskSpec {
        shader: ShaderSource::Wgsl(source.into()),
        entry_point: "main".into(),
        bindings: vec![BindingSpec {
            binding: 0,
            role: BindingRole::Output {
                size: u64::from(groups) * 256,
            },
        }],
        grid: Grid([groups, 1, 1]),
        shards,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    }
}

/// [`super::breakdown`] of tasks over the task stages.
fn breakdown(marks: &[Mark], ends: &[(TaskId, Instant, Instant)]) -> Vec<(String, Duration)> {
    super::breakdown(marks, ends, &Stage::ALL.map(|s| (s, s.what())))
}

/// [`super::slowest`] of tasks over the task stages: the `count` slowest.
fn slowest(marks: &[Mark], ends: &[(TaskId, Instant, Instant)], count: usize) -> Vec<super::Slow> {
    let stages = Stage::ALL.map(|s| (s, s.what()));
    super::slowest(marks, ends, &stages, count)
}

/// Medians of a 300-byte write and `fdatasync` into a file under `root`: back to
/// back, and after `idle` without a write (the mesh idle meanwhile).
fn disk_wake(root: &std::path::Path, idle: Duration) -> anyhow::Result<(Duration, Duration)> {
    use std::os::unix::fs::FileExt;
    let path = root.join("disk-wake");
    let file = std::fs::File::create(&path)?;
    file.set_len(1 << 20)?;
    file.sync_all()?;
    let mut at = 0u64;
    let mut write = || -> anyhow::Result<Duration> {
        let t = Instant::now();
        file.write_all_at(&[7u8; 300], at)?;
        file.sync_data()?;
        at += 512;
        Ok(t.elapsed())
    };
    let mut warm = (0..21)
        .map(|_| write())
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut cold = Vec::new();
    for _ in 0..7 {
        std::thread::sleep(idle);
        cold.push(write()?);
    }
    std::fs::remove_file(&path)?;
    warm.sort();
    cold.sort();
    Ok((warm[warm.len() / 2], cold[cold.len() / 2]))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = (sorted.len().saturating_sub(1) as f64 * p).round() as usize;
    sorted.get(at).copied().unwrap_or_default()
}

pub fn mesh(args: MeshBenchArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(args))
}

async fn run(args: MeshBenchArgs) -> anyhow::Result<ExitCode> {
    let root = std::env::temp_dir().join(format!("gpumesh-bench-mesh-{}", std::process::id()));
    let timeline = Timeline::recording();
    let nodes = super::local_mesh(&root, &timeline).await?;
    let status = Client::new(nodes[0].api_addr.to_string()).status().await?;
    let (follower, submitter) = nodes
        .iter()
        .find(|n| n.raft_id != status.leader)
        .map_or((0, 0), |n| (n.api_addr.port(), n.raft_id));
    let client = Client::new(format!("127.0.0.1:{follower}"));
    println!(
        "gpumesh bench mesh — 3 nodes on loopback in one process, submitting through a node \
         that does not lead at the start (leadership follows the node most proposals come \
         from)"
    );

    // (1) Latency of a trivial task, submit to result, one at a time.
    // One request each (`Client::run`: submit, wait, outputs inline). Warmed up
    // first, as the Ray script warms up its cluster: the first runs compile the
    // kernel on each node and open the client's connections.
    let mut warm = 0;
    while warm < WARM_UP {
        timed_task(&client, args.result_kib, warm).await?;
        warm += 1;
    }
    // Then on until the submitting node leads the record (at most 2 s of tasks), as
    // `bench actors` does for its host: a steady stream of proposals from one node
    // hands it leadership within a quarter second or so (see
    // `ReplicaConfig::follow_workload`), so that is where a steady submitter's tasks
    // stand. Timed before it, the handover fell inside the latency run in some runs,
    // and the tasks around it set the p99.
    let settle = Instant::now() + Duration::from_secs(2);
    while client.status().await?.leader != submitter && Instant::now() < settle {
        for _ in 0..16 {
            timed_task(&client, args.result_kib, warm).await?;
            warm += 1;
        }
    }
    let before = client.status().await?;
    let submitter_leads = before.leader == submitter;
    timeline.take();
    let mut lat = Vec::new();
    let mut ends = Vec::new();
    for i in 0..args.latency_tasks.max(1) {
        let t = Instant::now();
        let task = timed_task(&client, args.result_kib, warm + i).await?;
        lat.push(t.elapsed());
        ends.push((task, t, Instant::now()));
    }
    lat.sort();
    let marks = timeline.take();
    let alone = breakdown(&marks, &ends);
    let slow = slowest(&marks, &ends, super::above_p99(ends.len()));
    // An election or a handover inside the timed tasks sets the tail: said, not hidden.
    let after = client.status().await?;
    let leader_changed = (after.leader, after.term) != (before.leader, before.term);

    // (1b) A task with an input, as most are: a new 16 KiB blob uploaded, then the
    // task submitted on it, waited for and its output fetched, four requests (the
    // input kept on a second node before the submit is committed, the result on two
    // nodes before it is recorded).
    let mut with_input = Vec::new();
    let mut input_ends = Vec::new();
    for i in 0..(args.latency_tasks / 4).max(8) + 8 {
        let words: Vec<u32> = (0..DOUBLE_WORDS).map(|w| w ^ ((i as u32) << 16)).collect();
        if i == 8 {
            timeline.take();
        }
        let t = Instant::now();
        let task = double(&client, &words).await?;
        if i >= 8 {
            with_input.push(t.elapsed());
            input_ends.push((task, t, Instant::now()));
        }
    }
    with_input.sort();
    let input = breakdown(&timeline.take(), &input_ends);

    // (2) Sustained tiny tasks/s, through every node; one client (and its pool of
    // connections) per node, as a program submitting many tasks would hold.
    let clients: Vec<Client> = nodes
        .iter()
        .map(|n| Client::new(n.api_addr.to_string()))
        .collect();
    let started = Instant::now();
    let mut pending = tokio::task::JoinSet::new();
    let mut loaded_ends = Vec::new();
    let mut done = 0usize;
    for i in 0..args.throughput_tasks {
        if pending.len() >= args.in_flight.max(1) {
            if let Some(end) = pending.join_next().await.transpose()?.transpose()? {
                loaded_ends.push(end);
            }
            done += 1;
        }
        let c = clients[i % clients.len()].clone();
        let result_kib = args.result_kib;
        let n = warm + args.latency_tasks.max(1) + i;
        pending.spawn(async move {
            let began = Instant::now();
            let task = timed_task(&c, result_kib, n).await?;
            anyhow::Ok((task, began, Instant::now()))
        });
    }
    while let Some(r) = pending.join_next().await {
        loaded_ends.push(r??);
        done += 1;
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    let marks = timeline.take();
    let loaded = breakdown(&marks, &loaded_ends);
    let loaded_slow = slowest(&marks, &loaded_ends, 3);
    drop(marks);
    // Each task's own time under that load: its tail shows a stall of the record
    // (a snapshot, a compaction) that the rate averages away.
    let mut under_load: Vec<Duration> = loaded_ends.iter().map(|(_, b, e)| *e - *b).collect();
    under_load.sort();

    // (3) A ~100 ms kernel: directly on this machine's adapter, then through the mesh.
    let mut direct = Executor::new(BackendChoice::Auto)?;
    let kernel = Arc::new(Kernel::compile(SPIN_SEEDED, "main")?);
    let groups = super::workgroups_for(Duration::from_millis(120), |groups| {
        let job = Job::new(seeded_spin(groups, 0), kernel.clone(), |_| None)?;
        anyhow::Ok(direct.run(&job, None)?.elapsed)
    })?;
    direct.run(
        &Job::new(seeded_spin(groups, 0), kernel.clone(), |_| None)?,
        None,
    )?;
    // Warm every node's pipeline cache, as the direct run's warm-up did.
    let mut seed = std::process::id().wrapping_mul(2_654_435_761);
    for _ in 0..6 {
        seed = seed.wrapping_add(1);
        client.run(seeded_spin(groups, seed)).await?;
    }
    let mut d = Vec::new();
    let mut m = Vec::new();
    let mut spin_ends = Vec::new();
    timeline.take();
    let mut ratios = Vec::new();
    for _ in 0..args.spin_runs.max(1) {
        seed = seed.wrapping_add(1);
        let job = Job::new(seeded_spin(groups, seed), kernel.clone(), |_| None)?;
        let alone = direct.run(&job, None)?;
        let t = Instant::now();
        let (task, out) = client.run(seeded_spin(groups, seed)).await?;
        let meshed = t.elapsed();
        spin_ends.push((TaskId(task), t, Instant::now()));
        anyhow::ensure!(
            out == alone.outputs,
            "the spin kernel's output through the mesh differs from the direct run's"
        );
        let alone = alone.elapsed;
        ratios.push(meshed.as_secs_f64() / alone.as_secs_f64());
        d.push(alone);
        m.push(meshed);
    }
    d.sort();
    m.sort();
    ratios.sort_by(f64::total_cmp);
    let (d, m) = (d[d.len() / 2], m[m.len() / 2]);
    let ratio = ratios[ratios.len() / 2];
    let spin = breakdown(&timeline.take(), &spin_ends);

    // (3b) A task with a 16 MiB result: what moving a large result costs (the
    // kernel is next to nothing), directly and through the mesh.
    let big_kernel = Arc::new(Kernel::compile(BIG_SEEDED, "main")?);
    client.run(seeded(BIG_SEEDED, BIG_GROUPS, seed)).await?;
    let (mut big_d, mut big_m, mut big_ends) = (Vec::new(), Vec::new(), Vec::new());
    timeline.take();
    for _ in 0..args.big_runs.max(1) {
        seed = seed.wrapping_add(1);
        let task = seeded(BIG_SEEDED, BIG_GROUPS, seed);
        let alone = direct.run(&Job::new(task.clone(), big_kernel.clone(), |_| None)?, None)?;
        let t = Instant::now();
        let (id, out) = client.run(task).await?;
        big_m.push(t.elapsed());
        big_ends.push((TaskId(id), t, Instant::now()));
        anyhow::ensure!(
            out == alone.outputs,
            "the 16 MiB result through the mesh differs from the direct run's"
        );
        big_d.push(alone.elapsed);
    }
    big_d.sort();
    big_m.sort();
    let (big_d, big_m) = (big_d[big_d.len() / 2], big_m[big_m.len() / 2]);
    let big = breakdown(&timeline.take(), &big_ends);

    // The disk the nodes write on: a log-sized write and fdatasync back to back, and
    // the same after as long without a write as the spin kernel runs. A task's
    // result is committed with such a write on a quorum right after its kernel.
    let disk_root = root.clone();
    let (sync_warm, sync_idle) =
        tokio::task::spawn_blocking(move || disk_wake(&disk_root, d)).await??;

    // (4) Blob transfer between two nodes vs raw loopback TCP.
    let transfer = gpumesh::node::net::bench_blob_transfer(args.transfer_mib << 20).await?;

    println!("\n{:<58} {:>14}", "measurement", "value");
    let which = if args.result_kib == 0 {
        "trivial task".to_string()
    } else {
        format!("task with a {} KiB result", args.result_kib)
    };
    println!(
        "{:<58} {:>11.2} ms",
        format!("{which} submit→result, p50"),
        ms(percentile(&lat, 0.5))
    );
    println!(
        "{:<58} {:>11.2} ms",
        format!("{which} submit→result, p99"),
        ms(percentile(&lat, 0.99))
    );
    println!(
        "{:<58} {:>14}",
        "submitting node leading when those were timed (warm-up)",
        format!("{} ({warm})", if submitter_leads { "yes" } else { "no" })
    );
    println!(
        "{:<58} {:>11.2} ms",
        "task with a new 16 KiB input: upload, submit, wait, fetch, p50",
        ms(percentile(&with_input, 0.5))
    );
    println!(
        "{:<58} {:>10.0} /s",
        if args.result_kib == 0 {
            format!("sustained tiny tasks ({} in flight)", args.in_flight)
        } else {
            format!(
                "sustained tasks, {} KiB results ({} in flight)",
                args.result_kib, args.in_flight
            )
        },
        rate
    );
    println!(
        "{:<58} {:>14}",
        "  each task submit→result then: p50 / p99 / p99.9 / max (ms)",
        format!(
            "{:.1} / {:.1} / {:.1} / {:.1}",
            ms(percentile(&under_load, 0.5)),
            ms(percentile(&under_load, 0.99)),
            ms(percentile(&under_load, 0.999)),
            ms(under_load.last().copied().unwrap_or_default())
        )
    );
    println!(
        "{:<58} {:>11.1} ms",
        format!("spin kernel ({groups} workgroups) run directly"),
        ms(d)
    );
    println!(
        "{:<58} {:>11.1} ms",
        "same kernel through the mesh, submit→result",
        ms(m)
    );
    println!(
        "{:<58} {:>14.3}",
        format!("mesh / direct (median of {} pairs)", ratios.len()),
        ratio
    );
    println!(
        "{:<58} {:>14}",
        "  the pairs' lowest and highest",
        format!("{:.3}-{:.3}", ratios[0], ratios[ratios.len() - 1])
    );
    println!(
        "{:<58} {:>11.1} ms",
        "a 16 MiB result run directly (kernel and readback)",
        ms(big_d)
    );
    println!(
        "{:<58} {:>11.1} ms",
        "the same through the mesh, submit→result",
        ms(big_m)
    );
    println!(
        "{:<58} {:>11.2} ms",
        "disk: 300 bytes written and fdatasync'd, back to back",
        ms(sync_warm)
    );
    println!(
        "{:<58} {:>11.2} ms",
        format!("disk: the same after {:.0} ms without a write", ms(d)),
        ms(sync_idle)
    );
    println!("\nwhere a {which}'s time goes (medians over the latency tasks)");
    for (what, d) in &alone {
        println!("  {what:<56} {:>11.2} ms", ms(*d));
    }
    super::print_slowest(
        &format!(
            "the slowest latency tasks ({} of {}; ms){}",
            slow.len(),
            ends.len(),
            if leader_changed {
                ", the leader changed while they ran"
            } else {
                ""
            }
        ),
        &alone,
        &slow,
    );
    println!(
        "\nthe same with {} in flight (medians over the throughput tasks)",
        args.in_flight
    );
    for (what, d) in &loaded {
        println!("  {what:<56} {:>11.2} ms", ms(*d));
    }
    super::print_slowest(
        &format!(
            "the slowest with {} in flight (3 of {}; ms)",
            args.in_flight,
            loaded_ends.len()
        ),
        &loaded,
        &loaded_slow,
    );
    println!(
        "\nthe spin kernel through the mesh (medians over its {} runs)",
        ratios.len()
    );
    for (what, d) in &spin {
        println!("  {what:<56} {:>11.2} ms", ms(*d));
    }
    println!(
        "\nthe task with a 16 MiB result through the mesh (medians over its {} runs)",
        big_ends.len()
    );
    for (what, d) in &big {
        println!("  {what:<56} {:>11.2} ms", ms(*d));
    }
    println!(
        "\na task with a new 16 KiB input (medians over {}; the upload is before \
         \"client to the API\", fetching the output after \"completion applied\")",
        input_ends.len()
    );
    for (what, d) in &input {
        println!("  {what:<56} {:>11.2} ms", ms(*d));
    }
    println!("\n{transfer}");
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "p50_ms": ms(percentile(&lat, 0.5)),
                "p99_ms": ms(percentile(&lat, 0.99)),
                "tasks_per_s": rate,
                "loaded_p50_ms": ms(percentile(&under_load, 0.5)),
                "loaded_p99_ms": ms(percentile(&under_load, 0.99)),
                "loaded_p999_ms": ms(percentile(&under_load, 0.999)),
                "loaded_max_ms": ms(under_load.last().copied().unwrap_or_default()),
                "result_kib": args.result_kib,
                "mesh_vs_direct": ratio,
                "blob_vs_tcp": transfer.pull_ratio(),
                "blob_ahead_vs_tcp": transfer.pull_ahead_ratio(),
                "blob_stored_vs_tcp": transfer.fetch_ratio(),
                "blob_stored_vs_disk": transfer.fetch_vs_disk(),
                "fsync_ms": ms(sync_warm),
                "fsync_after_idle_ms": ms(sync_idle),
                "input_task_p50_ms": ms(percentile(&with_input, 0.5)),
                "big_result_ms": ms(big_m),
                "big_result_direct_ms": ms(big_d),
                "submitter_led": submitter_leads,
                "leader_changed_while_timed": leader_changed,
                "slowest": super::slowest_json(&slow),
                "loaded_slowest": super::slowest_json(&loaded_slow),
                "warm_up_tasks": warm,
            })
        );
    }
    // Joiners first: a joiner left running would keep dialling its seed.
    for n in nodes.into_iter().rev() {
        n.stop().await;
    }
    let _ = std::fs::remove_dir_all(&root);
    Ok(ExitCode::SUCCESS)
}
