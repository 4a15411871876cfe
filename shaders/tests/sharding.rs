//! Sharded + merged equals unsharded, byte for byte, for 1..=7 shards; and every
//! result equals its CPU reference.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use gpumesh_protocol::{
    BindingRole, BindingSpec, ElemType, Grid, MergeRule, ShaderSource, TaskSpec,
};
use gpumesh_shaders::{builtins, Job, Kernel};

/// Runs `make(shards)` for 1..=7 shards on every adapter; every output must equal the
/// 1-shard output byte for byte, and `check` must accept the 1-shard output.
fn assert_shard_invariant(
    name: &str,
    make: impl Fn(u32) -> Job,
    check: impl Fn(&BTreeMap<u32, Vec<u8>>),
) {
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let whole = executor.run(&make(1), None).unwrap().outputs;
        check(&whole);
        for shards in 2..=7 {
            let job = make(shards);
            assert_eq!(job.plan.len(), shards as usize);
            let out = executor.run(&job, None).unwrap().outputs;
            assert!(
                out == whole,
                "{name} on {}: {shards} shards differ from the unsharded run",
                adapter.backend.name()
            );
        }
    }
}

fn builtin_case(name: &str, size: u32) {
    let problem = builtins::get(name).unwrap().problem(size).unwrap();
    assert_shard_invariant(
        name,
        |s| problem.job(s).unwrap(),
        |out| {
            problem.verify(out).unwrap();
        },
    );
}

#[test]
fn vector_add_along_x() {
    builtin_case("vector_add", 256 * 14);
}

#[test]
fn blur_along_y_of_a_2d_grid() {
    builtin_case("blur", 16 * 7);
}

#[test]
fn mandelbrot_along_y() {
    builtin_case("mandelbrot", 16 * 9);
}

#[test]
fn histogram_sum_u32_partials() {
    builtin_case("histogram", 2048 * 9);
}

#[test]
fn montecarlo_counts_per_workgroup() {
    builtin_case("montecarlo_pi", 64 * 11);
}

#[test]
fn matmul_row_blocks() {
    builtin_case("matmul", 64 * 7);
}

#[test]
fn jacobi_rows() {
    builtin_case("jacobi", 64 * 8);
}

fn custom(
    source: &str,
    bindings: Vec<BindingSpec>,
    grid: [u32; 3],
    shards: u32,
    merge: MergeRule,
) -> Job {
    custom_merged(source, bindings, grid, shards, merge, &[])
}

/// [`custom`] with some bindings merged by rules of their own.
fn custom_merged(
    source: &str,
    bindings: Vec<BindingSpec>,
    grid: [u32; 3],
    shards: u32,
    merge: MergeRule,
    merges: &[(u32, MergeRule)],
) -> Job {
    let spec = TaskSpec {
        shader: ShaderSource::Wgsl(source.into()),
        entry_point: "main".into(),
        bindings,
        grid: Grid(grid),
        shards,
        merge,
        merges: merges.iter().copied().collect(),
        options: Default::default(),
    };
    let kernel = Arc::new(Kernel::compile(source, "main").unwrap());
    Job::new(spec, kernel, |_| None).unwrap()
}

fn output(binding: u32, size: u64) -> BindingSpec {
    BindingSpec {
        binding,
        role: BindingRole::Output { size },
    }
}

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Builtins passed loose and inside a struct, on a 3-D grid split along z.
const PROBE: &str = r#"
struct Ids {
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
}

@group(0) @binding(0) var<storage, read_write> out: array<vec4<u32>>;

@compute @workgroup_size(2, 2, 2)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    ids: Ids,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let size = groups * vec3<u32>(2u);
    let i = (gid.z * size.y + gid.y) * size.x + gid.x;
    let w = ids.wid;
    out[i] = vec4<u32>(
        gid.x | (gid.y << 10u) | (gid.z << 20u),
        w.x | (w.y << 10u) | (w.z << 20u),
        groups.x | (groups.y << 10u) | (groups.z << 20u),
        ids.lid.x | (ids.lid.y << 2u) | (ids.lid.z << 4u),
    );
}
"#;

#[test]
fn builtins_in_structs_and_num_workgroups_see_the_full_grid() {
    let grid = [4u32, 3, 9];
    let invocations = grid.iter().product::<u32>() * 8;
    let expected: Vec<u32> = {
        let size = [grid[0] * 2, grid[1] * 2, grid[2] * 2];
        let mut v = vec![0u32; invocations as usize * 4];
        for z in 0..size[2] {
            for y in 0..size[1] {
                for x in 0..size[0] {
                    let i = ((z * size[1] + y) * size[0] + x) as usize * 4;
                    v[i] = x | (y << 10) | (z << 20);
                    v[i + 1] = (x / 2) | ((y / 2) << 10) | ((z / 2) << 20);
                    v[i + 2] = grid[0] | (grid[1] << 10) | (grid[2] << 20);
                    v[i + 3] = (x % 2) | ((y % 2) << 2) | ((z % 2) << 4);
                }
            }
        }
        v
    };
    assert_shard_invariant(
        "probe",
        |s| {
            custom(
                PROBE,
                vec![output(0, u64::from(invocations) * 16)],
                grid,
                s,
                MergeRule::Changes,
            )
        },
        |out| assert_eq!(u32s(&out[&0]), expected),
    );
}

/// Every invocation folds a signed value into one of 16 slots with atomicMin/Max.
const MINMAX: &str = r#"
@group(0) @binding(0) var<storage, read_write> lo: array<atomic<i32>, 16>;
@group(0) @binding(1) var<storage, read_write> hi: array<atomic<i32>, 16>;

fn value(i: u32) -> i32 {
    return i32((i * 2654435761u) >> 3u) - 200000000;
}

@compute @workgroup_size(32)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    atomicMin(&lo[gid.x % 16u], value(gid.x));
    atomicMax(&hi[gid.x % 16u], value(gid.x));
}
"#;

fn minmax_reference(invocations: u32, max: bool) -> Vec<i32> {
    let value = |i: u32| (i.wrapping_mul(2654435761) >> 3) as i32 - 200_000_000;
    (0..16u32)
        .map(|slot| {
            let vals = (0..invocations).filter(|i| i % 16 == slot).map(value);
            if max {
                vals.max().unwrap()
            } else {
                vals.min().unwrap()
            }
        })
        .collect()
}

#[test]
fn min_and_max_i32_partials() {
    let (lo, hi) = (
        minmax_reference(32 * 13, false),
        minmax_reference(32 * 13, true),
    );
    let i32s = |bytes: &[u8]| -> Vec<i32> { u32s(bytes).iter().map(|&u| u as i32).collect() };
    assert_shard_invariant(
        "min-i32 and max-i32",
        |s| {
            custom_merged(
                MINMAX,
                vec![output(0, 64), output(1, 64)],
                [13, 1, 1],
                s,
                MergeRule::Min(ElemType::I32),
                &[(1, MergeRule::Max(ElemType::I32))],
            )
        },
        |out| {
            assert_eq!(i32s(&out[&0]), lo);
            assert_eq!(i32s(&out[&1]), hi);
        },
    );
}

/// A grid past the per-dimension dispatch limit runs in tiles, each told its offset.
const WIDE: &str = r#"
@group(0) @binding(0) var<storage, read_write> out: array<u32>;

@compute @workgroup_size(1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>) {
    out[gid.x] = gid.x ^ (n.x << 1u);
}
"#;

#[test]
fn grids_beyond_65535_workgroups_are_tiled() {
    let groups = 70_001u32;
    let want: Vec<u32> = (0..groups).map(|i| i ^ (groups << 1)).collect();
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        assert!(
            executor
                .capability()
                .limits
                .max_compute_workgroups_per_dimension
                < groups
        );
        for shards in [1, 2] {
            let job = custom(
                WIDE,
                vec![output(0, u64::from(groups) * 4)],
                [groups, 1, 1],
                shards,
                MergeRule::Changes,
            );
            let out = executor.run(&job, None).unwrap().outputs;
            assert_eq!(u32s(&out[&0]), want, "on {}", adapter.backend.name());
        }
    }
}

#[test]
fn sum_f32_across_shards_matches_reference_within_tolerance() {
    // Float atomics add in an unspecified order, so byte equality is not expected;
    // the CPU reference bounds every shard count.
    let problem = builtins::get("linreg_grad")
        .unwrap()
        .problem(256 * 9)
        .unwrap();
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        for shards in 1..=7 {
            let out = executor.run(&problem.job(shards).unwrap(), None).unwrap();
            problem.verify(&out.outputs).unwrap();
        }
    }
}

#[test]
fn the_executor_counts_dispatches_and_bytes_and_uploads_resident_inputs_once() {
    // A size no other test here uses, so its inputs are not resident yet.
    let problem = builtins::get("vector_add")
        .unwrap()
        .problem(256 * 6)
        .unwrap();
    let inputs: u64 = problem.blobs.values().map(|b| b.len() as u64).sum();
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let job = problem.job(3).unwrap();
        let outputs: u64 = job.writable().values().map(|w| w.size).sum();
        let before = executor.counters();
        executor.run(&job, None).unwrap();
        let first = executor.counters().since(&before);
        let before = executor.counters();
        executor.run(&job, None).unwrap();
        let second = executor.counters().since(&before);
        let name = adapter.backend.name();
        // One dispatch per shard (the grid fits in one tile), the same both times.
        assert_eq!(first.dispatches, 3, "{name}");
        assert_eq!(second.dispatches, 3, "{name}");
        // Each shard reads its writable buffers back whole to find what it changed.
        assert_eq!(first.bytes_from_device, 3 * outputs, "{name}");
        assert_eq!(second.bytes_from_device, 3 * outputs, "{name}");
        // The inputs went up the first time only (the shard info is kept on the
        // device too, unless other tests' infos filled its cache meanwhile).
        assert!(
            first.bytes_to_device >= second.bytes_to_device + inputs,
            "{name}: {first:?} then {second:?}, inputs {inputs} bytes"
        );
    }
}
