//! `gpumesh bench executor`: (a) the built-in tiled matmul against an optimized CPU
//! sgemm, (b) the executor's added time against a direct wgpu call, for a trivial
//! kernel and a ~100 ms one, (b') a trivial direct dispatch step by step, (c) one
//! shard against n shards on one adapter, and
//! the sharding sections (d)–(f) of [`super::sharding`].

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpumesh_protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource, TaskSpec};
use gpumesh_shaders::{
    builtins, BackendChoice, Executor, ExecutorLimits, Job, Kernel, DEFAULT_LOOP_BOUND,
};

use super::direct::Direct;
use super::{median_of, ms};

#[derive(clap::Args, Debug)]
pub struct ExecutorBenchArgs {
    /// Matrix sides for the matmul comparison.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048")]
    pub sizes: Vec<u32>,
    /// Shard counts for the 1-vs-n comparison (matmul at 1024).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub shards: Vec<u32>,
    /// Timed runs per measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[arg(long, default_value = "auto", value_parser = <BackendChoice as std::str::FromStr>::from_str)]
    pub backend: BackendChoice,
}

/// A kernel whose run time scales with its workgroup count: each invocation hashes
/// `rounds` times (kept under llvmpipe's 65535-iteration loop cap).
const SPIN: &str = r#"
struct Params { rounds: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    for (var i = 0u; i < params.rounds; i++) {
        x = (x ^ (x >> 13u)) * 1664525u + i;
    }
    out[gid.x] = x;
}
"#;
const SPIN_ROUNDS: u32 = 60_000;

/// [`SPIN`] with its loop left at an exact count: the same work, in a loop the
/// executor does not see end by itself, so bounded where a bound applies.
const SPIN_WHILE: &str = r#"
struct Params { rounds: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var x = gid.x;
    var i = 0u;
    loop {
        if (i == params.rounds) { break; }
        x = (x ^ (x >> 13u)) * 1664525u + i;
        i = i + 1u;
    }
    out[gid.x] = x;
}
"#;

/// Rounds of a step and a workgroup reduction (a barrier after each of its six
/// halvings): loops with barriers in them, which a bound leaves workgroup by
/// workgroup. 8,000 rounds are 64,000 turns as counted (a loop test is a turn too), under Mesa's cap.
const SPIN_REDUCE: &str = r#"
struct Params { rounds: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> part: array<u32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    var x = gid.x;
    for (var r = 0u; r < params.rounds; r++) {
        x = (x ^ (x >> 13u)) * 1664525u + r;
        part[lid] = x;
        workgroupBarrier();
        for (var half = 32u; half > 0u; half = half >> 1u) {
            if (lid < half) {
                part[lid] = part[lid] ^ part[lid + half];
            }
            workgroupBarrier();
        }
        x = x + part[0];
        workgroupBarrier();
    }
    out[gid.x] = x;
}
"#;
const SPIN_REDUCE_ROUNDS: u32 = 8_000;

fn spin_job(groups: u32, shards: u32) -> anyhow::Result<Job> {
    spin_job_of(SPIN, groups, shards)
}

fn spin_job_of(source: &str, groups: u32, shards: u32) -> anyhow::Result<Job> {
    let spec = TaskSpec {
        shader: ShaderSource::Wgsl(source.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::Param {
                    data: bytemuck::cast_slice(&[SPIN_ROUNDS, 0, 0, 0]).to_vec(),
                },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Output {
                    size: u64::from(groups) * 64 * 4,
                },
            },
        ],
        grid: Grid([groups, 1, 1]),
        shards,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    };
    Ok(Job::new(
        spec,
        Arc::new(Kernel::compile(source, "main")?),
        |_| None,
    )?)
}

pub fn executor(args: ExecutorBenchArgs) -> anyhow::Result<ExitCode> {
    let mut ex = Executor::new(args.backend)?;
    let cap = ex.capability().clone();
    println!(
        "gpumesh bench executor — adapter: {} ({}, {}), CPU threads: {}",
        cap.adapter_name,
        cap.backend.name(),
        cap.device_kind.name(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );

    println!("\n(a) tiled f32 matmul through the executor vs CPU sgemm (matrixmultiply), median of {} runs", args.runs);
    println!(
        "{:>6} {:>12} {:>12} {:>12} {:>12} {:>8}",
        "n", "gpu ms", "gpu GFLOP/s", "cpu ms", "cpu GFLOP/s", "gpu/cpu"
    );
    let matmul = builtins::get("matmul")?;
    for &n in &args.sizes {
        let problem = matmul.problem(n)?;
        let n = problem.size;
        let job = problem.job(1)?;
        let runs = if n >= 2048 {
            args.runs.min(3)
        } else {
            args.runs
        };
        let gpu = median_of(runs, || ex.run(&job, None).map(|o| o.elapsed))?;
        let (a, b) = matmul_inputs(&problem);
        let mut c = vec![0f32; (n * n) as usize];
        let cpu = median_of(runs, || -> anyhow::Result<Duration> {
            let t = Instant::now();
            sgemm(n as usize, &a, &b, &mut c);
            Ok(t.elapsed())
        })?;
        let flops = problem.flops;
        let (g, c_) = (
            flops / gpu.as_secs_f64() / 1e9,
            flops / cpu.as_secs_f64() / 1e9,
        );
        println!(
            "{n:>6} {:>12.2} {g:>12.2} {:>12.2} {c_:>12.2} {:>8.2}",
            ms(gpu),
            ms(cpu),
            g / c_
        );
    }

    println!(
        "\n(b) executor vs a direct wgpu dispatch on the same device, median of {} runs",
        args.runs
    );
    println!(
        "{:>26} {:>12} {:>12} {:>12} {:>8}",
        "kernel", "direct ms", "executor ms", "added ms", "ratio"
    );
    let (device, queue) = ex.device();
    let direct = Direct::new(device, queue, SPIN);
    let uniform: Vec<u8> = bytemuck::cast_slice(&[SPIN_ROUNDS, 0, 0, 0]).to_vec();
    let trivial_uniform: Vec<u8> = bytemuck::cast_slice(&[1u32, 0, 0, 0]).to_vec();
    // Scale the spin kernel to about 100 ms on this adapter.
    let groups = super::workgroups_for(Duration::from_millis(100), |groups| {
        direct
            .run(&uniform, u64::from(groups) * 256, groups)
            .map(|r| r.0)
    })?;
    let trivial = {
        let mut spec = spin_job(1, 1)?.spec;
        spec.bindings[0].role = BindingRole::Param {
            data: trivial_uniform.clone(),
        };
        Job::new(spec, Arc::new(Kernel::compile(SPIN, "main")?), |_| None)?
    };
    for (label, job, uniform, groups) in [
        (
            "trivial (1 workgroup)".to_string(),
            trivial.clone(),
            &trivial_uniform,
            1u32,
        ),
        (
            format!("~100 ms ({groups} workgroups)"),
            spin_job(groups, 1)?,
            &uniform,
            groups,
        ),
    ] {
        let out_bytes = u64::from(groups) * 256;
        // Interleave so drift in machine load hits both sides alike.
        direct.run(uniform, out_bytes, groups)?;
        ex.run(&job, None)?;
        let (d, e) = interleaved(
            args.runs.max(3),
            || direct.run(uniform, out_bytes, groups),
            || {
                ex.run(&job, None)
                    .map(|e| (e.elapsed, e.outputs[&1].clone()))
            },
            "executor and direct outputs differ",
        )?;
        pair_row(&label, d, e);
    }

    loop_bound_cost(&ex, &args, groups, &trivial_uniform)?;

    let runs = args.runs.max(3) * 10;
    println!("\n(b') one trivial direct dispatch, step by step, median of {runs} runs");
    for (what, d) in super::direct::steps(&direct, runs)? {
        println!("  {what:<56} {:>9.3} ms", ms(d));
    }

    println!(
        "\n(c) matmul n=1024 on one adapter, 1 shard vs n shards, median of {} runs",
        args.runs
    );
    println!("{:>8} {:>12} {:>12}", "shards", "ms", "vs 1 shard");
    let problem = matmul.problem(1024)?;
    let mut base = None;
    for &shards in &args.shards {
        let job = problem.job(shards)?;
        let t = median_of(args.runs, || ex.run(&job, None).map(|o| o.elapsed))?;
        let base = *base.get_or_insert(t);
        println!(
            "{shards:>8} {:>12.2} {:>12.3}",
            ms(t),
            t.as_secs_f64() / base.as_secs_f64()
        );
    }
    super::sharding::sections(&mut ex, args.runs, &args.shards, spin_job, groups)?;
    Ok(ExitCode::SUCCESS)
}

/// (b2) The spin kernel through an executor whose loops are bounded
/// (`--max-loop-turns`) against one running them as the adapter does, interleaved:
/// as a `for` loop (its turns counted as it starts: nothing added a turn) and as a
/// loop left at an exact count (counted and tested each turn). Where the adapter
/// caps loops itself (Mesa's) both sides count every turn, and the bound, just
/// under that cap, adds the second count.
fn loop_bound_cost(
    ex: &Executor,
    args: &ExecutorBenchArgs,
    groups: u32,
    trivial_uniform: &[u8],
) -> anyhow::Result<()> {
    let bound = ex.loop_cap().map_or(DEFAULT_LOOP_BOUND, |cap| cap - 1);
    let with = |loop_bound| {
        Executor::with_limits(
            args.backend,
            ExecutorLimits {
                loop_bound,
                ..ExecutorLimits::default()
            },
        )
    };
    let (mut plain, mut bounded) = (with(None)?, with(Some(bound))?);
    println!(
        "\n(b2) loops bounded at {bound} turns (a for loop counted as it starts, an open one turn by turn) vs as the adapter runs them, median of {} interleaved runs",
        args.runs.max(3)
    );
    println!(
        "{:>26} {:>12} {:>12} {:>12} {:>8}",
        "kernel", "as run ms", "bounded ms", "added ms", "ratio"
    );
    let with_params = |job: Job, params: &[u8]| {
        let mut spec = job.spec;
        spec.bindings[0].role = BindingRole::Param {
            data: params.to_vec(),
        };
        Job::new(spec, job.kernel, |_| None)
    };
    let trivial = with_params(spin_job(1, 1)?, trivial_uniform)?;
    let rounds: Vec<u8> = bytemuck::cast_slice(&[SPIN_REDUCE_ROUNDS, 0, 0, 0]).to_vec();
    let reduce = |groups| -> anyhow::Result<Job> {
        Ok(with_params(spin_job_of(SPIN_REDUCE, groups, 1)?, &rounds)?)
    };
    let reduce_groups = super::workgroups_for(Duration::from_millis(100), |groups| {
        anyhow::Ok(plain.run(&reduce(groups)?, None)?.elapsed)
    })?;
    for (label, job) in [
        ("trivial (1 workgroup)".to_string(), trivial),
        (format!("~100 ms, for ({groups} wg)"), spin_job(groups, 1)?),
        (
            format!("~100 ms, open ({groups} wg)"),
            spin_job_of(SPIN_WHILE, groups, 1)?,
        ),
        (
            format!("~100 ms, barriers ({reduce_groups} wg)"),
            reduce(reduce_groups)?,
        ),
    ] {
        plain.run(&job, None)?;
        bounded.run(&job, None)?;
        let run = |ex: &mut Executor| ex.run(&job, None).map(|o| (o.elapsed, o.outputs));
        let (p, b) = interleaved(
            args.runs.max(3),
            || run(&mut plain),
            || run(&mut bounded),
            "the bounded run's output differs from the unbounded one's",
        )?;
        pair_row(&label, p, b);
    }
    Ok(())
}

/// `runs` of `a` and `b` in turn, each giving its time and output: the medians of
/// their times, once every pair's outputs are the same (else `differ`).
fn interleaved<T: PartialEq, E1, E2>(
    runs: usize,
    mut a: impl FnMut() -> Result<(Duration, T), E1>,
    mut b: impl FnMut() -> Result<(Duration, T), E2>,
    differ: &str,
) -> anyhow::Result<(Duration, Duration)>
where
    anyhow::Error: From<E1> + From<E2>,
{
    let (mut a_times, mut b_times) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let (ta, out_a) = a()?;
        let (tb, out_b) = b()?;
        anyhow::ensure!(out_a == out_b, "{differ}");
        a_times.push(ta);
        b_times.push(tb);
    }
    a_times.sort();
    b_times.sort();
    Ok((a_times[a_times.len() / 2], b_times[b_times.len() / 2]))
}

/// A row of (b) or (b2): the two medians, the time added and the ratio.
fn pair_row(label: &str, a: Duration, b: Duration) {
    println!(
        "{label:>26} {:>12.3} {:>12.3} {:>12.3} {:>8.3}",
        ms(a),
        ms(b),
        ms(b) - ms(a),
        b.as_secs_f64() / a.as_secs_f64()
    );
}

fn matmul_inputs(problem: &builtins::Problem) -> (Vec<f32>, Vec<f32>) {
    let mut inputs = problem.bindings.iter().filter_map(|b| match &b.role {
        BindingRole::Input { blob, .. } => problem
            .blobs
            .get(blob)
            .map(|bytes| bytemuck::cast_slice::<u8, f32>(bytes).to_vec()),
        _ => None,
    });
    let a = inputs.next().unwrap_or_default();
    let b = inputs.next().unwrap_or_default();
    (a, b)
}

/// C = A B with matrixmultiply's optimized, threaded sgemm.
fn sgemm(n: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(a.len() >= n * n && b.len() >= n * n && c.len() >= n * n);
    let s = n as isize;
    // SAFETY: the three slices each hold at least n*n row-major f32s (checked above),
    // which is exactly what the strides (n, 1) describe.
    #[allow(unsafe_code)]
    unsafe {
        matrixmultiply::sgemm(
            n,
            n,
            n,
            1.0,
            a.as_ptr(),
            s,
            1,
            b.as_ptr(),
            s,
            1,
            0.0,
            c.as_mut_ptr(),
            s,
            1,
        );
    }
}
