//! Kernels written the way WebGPU programs write them — bounds checks with
//! `arrayLength`, a ragged last workgroup, uniforms, in-place buffers, workgroup
//! reductions, 2-D grids, a shared word, an atomic append, a bitonic sort, a prefix
//! scan, a tiled matrix product and tallies counted from zeroed workgroup memory —
//! each split 1..=7 ways on
//! every local adapter. Every sharded answer must equal the unsharded one byte for
//! byte (or be refused with a clear error), and the unsharded one must equal an
//! independent CPU reference.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use common::kernels::*;
use common::task::Task;

use std::collections::BTreeMap;
use std::sync::Arc;

use gpumesh_protocol::{ElemType, MergeRule};
use gpumesh_shaders::{ExecError, Job, Kernel};
use proptest::prelude::*;

/// Running a test task on this process's executor.
trait Build {
    fn job(
        &self,
        source: &str,
        grid: [u32; 3],
        shards: u32,
        merge: MergeRule,
    ) -> Result<Job, ExecError>;
}

impl Build for Task {
    fn job(
        &self,
        source: &str,
        grid: [u32; 3],
        shards: u32,
        merge: MergeRule,
    ) -> Result<Job, ExecError> {
        let kernel = Arc::new(Kernel::compile(source, "main")?);
        Job::new(self.spec(source, grid, shards, merge), kernel, |id| {
            self.blobs.get(id).cloned()
        })
    }
}

type Outputs = BTreeMap<u32, Vec<u8>>;

/// Runs the task unsharded and in 2..=7 shards on every adapter, and unsharded with
/// its loops bounded: each answer must equal the unsharded one byte for byte, and
/// `check` must accept the unsharded one. Returns each adapter's unsharded outputs.
fn split_1_to_7(
    name: &str,
    source: &str,
    task: &Task,
    grid: [u32; 3],
    merge: MergeRule,
    check: impl Fn(&Outputs),
) -> Vec<Outputs> {
    let mut answers = Vec::new();
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let backend = adapter.backend.name();
        let whole = executor
            .run(&task.job(source, grid, 1, merge).unwrap(), None)
            .unwrap_or_else(|e| panic!("{name} on {backend}, unsharded: {e}"))
            .outputs;
        check(&whole);
        // The same with every loop counted against a bound, as on a GPU.
        if let Some(b) = common::bounded()
            .iter()
            .find(|b| b.backend == adapter.backend)
        {
            let bounded = common::lock(b)
                .run(&task.job(source, grid, 1, merge).unwrap(), None)
                .unwrap_or_else(|e| panic!("{name} on {backend}, loops bounded: {e}"))
                .outputs;
            if bounded != whole {
                let (b, at) = first_difference(&whole, &bounded);
                panic!(
                    "{name} on {backend}: with loops bounded it differs at binding {b}, byte {at}"
                );
            }
        }
        for shards in 2..=7 {
            let job = task.job(source, grid, shards, merge).unwrap();
            assert_eq!(job.plan.len(), shards as usize);
            let out = executor
                .run(&job, None)
                .unwrap_or_else(|e| panic!("{name} on {backend}, {shards} shards: {e}"))
                .outputs;
            if out != whole {
                let (b, at) = first_difference(&whole, &out);
                panic!("{name} on {backend}: {shards} shards differ from the unsharded run at binding {b}, byte {at}");
            }
        }
        answers.push(whole);
    }
    answers
}

fn first_difference(a: &Outputs, b: &Outputs) -> (u32, usize) {
    for (binding, x) in a {
        let y = &b[binding];
        if let Some(at) = x.iter().zip(y).position(|(p, q)| p != q) {
            return (*binding, at);
        }
    }
    (u32::MAX, 0)
}

// ---------------------------------------------------------------------------------
// A bounds check with arrayLength and a ragged last workgroup.

#[test]
fn doubling_with_a_bounds_check_and_a_ragged_last_workgroup() {
    let n = 1000; // 16 workgroups of 64; the last has 40 invocations with work
    let mut rng = Rng(1);
    let input: Vec<f32> = (0..n).map(|_| rng.unit() * 100.0).collect();
    let task = Task::default()
        .input(0, f32_bytes(&input))
        .output(1, n as u64 * 4);
    split_1_to_7(
        "double",
        DOUBLE,
        &task,
        [16, 1, 1],
        MergeRule::Changes,
        |out| {
            let want: Vec<f32> = input.iter().map(|x| x * 2.0).collect();
            assert_eq!(f32s(&out[&1]), want);
        },
    );
}

// ---------------------------------------------------------------------------------
// A particle step: uniform parameters at 0, particles read at 1 and written at 2.

#[test]
fn particles_with_uniform_params_read_and_write_buffers() {
    let n = 1000; // 16 workgroups of 64, the last ragged
    let p = particles(n, 2);
    let flat: Vec<f32> = p.iter().flatten().copied().collect();
    let task = Task::default()
        .input(0, f32_bytes(&PARTICLE_PARAMS))
        .input(1, f32_bytes(&flat))
        .output(2, n as u64 * 16);
    let want = particles_reference(&p);
    let answers = split_1_to_7(
        "particles",
        PARTICLES,
        &task,
        [16, 1, 1],
        MergeRule::Changes,
        |out| assert!(particles_off(&f32s(&out[&2]), &want, 1e-5) <= 2),
    );
    // Different backends agree within the same bound.
    for pair in answers.windows(2) {
        assert!(particles_off(&f32s(&pair[0][&2]), &f32s(&pair[1][&2]), 1e-5) <= 2);
    }
}

// ---------------------------------------------------------------------------------
// One read_write buffer that is both the input and the output (in place).

#[test]
fn collatz_in_place_on_an_inout_buffer() {
    let n = 777; // 13 workgroups, the last with 9 invocations with work
    let mut rng = Rng(3);
    let mut start: Vec<u32> = (0..n).map(|_| rng.below(100_000)).collect();
    start[5] = 0; // steps 0: unchanged
    start[6] = 1; // steps 0: changed
    start[7] = 2_000_000_000; // overflows
    let task = Task::default().inout(0, u32_bytes(&start));
    split_1_to_7(
        "collatz",
        COLLATZ,
        &task,
        [13, 1, 1],
        MergeRule::Changes,
        |out| {
            let want: Vec<u32> = start.iter().map(|&x| collatz_reference(x)).collect();
            assert_eq!(u32s(&out[&0]), want);
        },
    );
}

/// A bitonic sort, each of its 55 steps run in place and split into 1..=7 shards
/// in turn: a shard's invocations write their partners' elements too, which
/// another shard's range holds. Sorted as the CPU sorts, on every adapter.
#[test]
fn a_bitonic_sort_whose_steps_are_split_sorts() {
    let n = 1024u32;
    let mut rng = Rng(13);
    let values: Vec<u32> = (0..n).map(|_| rng.below(1 << 30)).collect();
    let mut want = values.clone();
    want.sort_unstable();
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let mut data = u32_bytes(&values);
        let mut steps = 0u32;
        let mut k = 2;
        while k <= n {
            let mut j = k / 2;
            while j > 0 {
                let task = Task::default().input(0, u32_bytes(&[j, k])).inout(1, data);
                let shards = steps % 7 + 1;
                let job = task
                    .job(BITONIC_STEP, [n / 64, 1, 1], shards, MergeRule::Changes)
                    .unwrap();
                data = executor
                    .run(&job, None)
                    .unwrap()
                    .outputs
                    .remove(&1)
                    .unwrap();
                steps += 1;
                j /= 2;
            }
            k *= 2;
        }
        assert_eq!(steps, 55);
        assert_eq!(u32s(&data), want, "on {}", adapter.backend.name());
    }
}

// ---------------------------------------------------------------------------------
// Two read_write buffers indexed by workgroup_id, from a workgroup reduction.

#[test]
fn two_outputs_indexed_by_workgroup_id_from_a_workgroup_reduction() {
    let n = 128 * 10 + 50; // 11 workgroups, the last partly empty
    let mut rng = Rng(4);
    let data: Vec<u32> = (0..n).map(|_| rng.below(1 << 20)).collect();
    let task = Task::default()
        .input(0, u32_bytes(&data))
        .output(1, 11 * 4)
        .output(2, 11 * 4);
    split_1_to_7(
        "group stats",
        GROUP_STATS,
        &task,
        [11, 1, 1],
        MergeRule::Changes,
        |out| {
            let sums: Vec<u32> = data.chunks(128).map(|c| c.iter().sum()).collect();
            let maxes: Vec<u32> = data.chunks(128).map(|c| *c.iter().max().unwrap()).collect();
            assert_eq!(u32s(&out[&1]), sums);
            assert_eq!(u32s(&out[&2]), maxes);
        },
    );
}

// ---------------------------------------------------------------------------------
// A 2-D grid (split along y) with image dimensions in a uniform, writing transposed.

#[test]
fn a_2d_grid_with_ragged_edges_writing_transposed() {
    let (w, h) = (61u32, 77u32); // 8 × 10 workgroups of 8×8, ragged on both edges
    let mut rng = Rng(5);
    let src: Vec<u32> = (0..w * h).map(|_| rng.below(1 << 24)).collect();
    let task = Task::default()
        .input(0, u32_bytes(&[w, h]))
        .input(1, u32_bytes(&src))
        .output(2, u64::from(w * h) * 4);
    split_1_to_7(
        "transpose",
        TRANSPOSE,
        &task,
        [8, 10, 1],
        MergeRule::Changes,
        |out| assert_eq!(u32s(&out[&2]), transpose_reference(&src, w, h)),
    );
}

// ---------------------------------------------------------------------------------
// A 3-D grid of 3-D workgroups with fewer workgroups along z than shards.

/// The ids each invocation of a grid of 4 x 3 x 2 workgroups of 2 x 3 x 4 records:
/// whole, the CPU's on every adapter; split 2 ways (along z), 3 (along y) and 4
/// (along x), the same bytes. Before, 3 and 4 shards were refused (only z was split);
/// 5 still is, naming the most.
#[test]
fn a_3d_grid_splits_along_whichever_dimension_has_enough_workgroups() {
    let (grid, size) = ([4u32, 3, 2], [2u32, 3, 4]);
    let invocations = grid.iter().chain(&size).product::<u32>() as usize;
    let mut want: [Vec<u32>; 3] = Default::default();
    for w in want.iter_mut() {
        w.resize(invocations * 4, 0);
    }
    for (wz, wy, wx) in cells(grid) {
        for (lz, ly, lx) in cells(size) {
            let workgroup = wx + wy * grid[0] + wz * grid[0] * grid[1];
            let local = lx + ly * size[0] + lz * size[0] * size[1];
            let at = (workgroup * 24 + local) as usize * 4;
            let ids = [
                [wx, wy, wz],
                [lx, ly, lz],
                [wx * size[0] + lx, wy * size[1] + ly, wz * size[2] + lz],
            ];
            for (w, id) in want.iter_mut().zip(ids) {
                w[at..at + 3].copy_from_slice(&id);
            }
        }
    }
    let bytes = invocations as u64 * 16;
    let task = Task::default()
        .output(0, bytes)
        .output(1, bytes)
        .output(2, bytes);
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let backend = adapter.backend.name();
        let whole = executor
            .run(
                &task
                    .job(WORKGROUP_IDS, grid, 1, MergeRule::Changes)
                    .unwrap(),
                None,
            )
            .unwrap()
            .outputs;
        for (b, w) in want.iter().enumerate() {
            assert_eq!(&u32s(&whole[&(b as u32)]), w, "binding {b} on {backend}");
        }
        for (shards, axis) in [(2, 2), (3, 1), (4, 0)] {
            let job = task
                .job(WORKGROUP_IDS, grid, shards, MergeRule::Changes)
                .unwrap();
            assert!(job.plan.iter().all(|r| r.axis == axis), "{shards} shards");
            let out = executor.run(&job, None).unwrap().outputs;
            assert!(out == whole, "{shards} shards on {backend}");
        }
    }
    let e = task
        .job(WORKGROUP_IDS, grid, 5, MergeRule::Changes)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("4 x 3 x 2") && e.contains("use 1..=4 shards"),
        "{e}"
    );
}

/// (z, y, x) over a box, x fastest.
fn cells(dims: [u32; 3]) -> impl Iterator<Item = (u32, u32, u32)> {
    (0..dims[2])
        .flat_map(move |z| (0..dims[1]).flat_map(move |y| (0..dims[0]).map(move |x| (z, y, x))))
}

// ---------------------------------------------------------------------------------
// Any number of inputs, uniforms, in-out buffers and outputs in one kernel.

#[test]
fn uniforms_inputs_inouts_and_outputs_together() {
    let n = 300u32; // 10 workgroups of 32, the last with 12 invocations with work
    let mut rng = Rng(6);
    let x: Vec<u32> = (0..n).map(|_| rng.below(1000)).collect();
    let y: Vec<u32> = (0..n).map(|_| rng.below(1000)).collect();
    let visits: Vec<u32> = (0..n).map(|i| i % 3).collect();
    let task = Task::default()
        .input(0, u32_bytes(&[7, 11]))
        .input(1, u32_bytes(&x))
        .inout(2, u32_bytes(&y))
        .inout(3, u32_bytes(&visits))
        .output(4, u64::from(n) * 4)
        .input(5, u32_bytes(&[n, 0, 0, 0]));
    split_1_to_7(
        "mixed",
        MIXED,
        &task,
        [10, 1, 1],
        MergeRule::Changes,
        |out| {
            let new_y: Vec<u32> = (0..n as usize).map(|i| 7 * x[i] + y[i] + 11).collect();
            assert_eq!(u32s(&out[&2]), new_y);
            assert_eq!(
                u32s(&out[&3]),
                visits.iter().map(|v| v + 1).collect::<Vec<_>>()
            );
            assert_eq!(
                u32s(&out[&4]),
                new_y.iter().map(|v| v & 1).collect::<Vec<_>>()
            );
        },
    );
}

// ---------------------------------------------------------------------------------
// One shared word.

#[test]
fn a_shared_flag_word_set_to_one_value_by_several_shards_merges() {
    let mut values: Vec<i32> = (0..700).collect();
    values[3] = -1;
    values[650] = -9;
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let task = Task::default().input(0, bytes).output(1, 4);
    // Under a reduction too: the word is a value stored, not a partial, so a sum
    // keeps the 1 (before: 2, one for each shard that saw a negative).
    for rule in [
        MergeRule::Changes,
        MergeRule::Sum(ElemType::U32),
        MergeRule::Max(ElemType::U32),
    ] {
        split_1_to_7(
            "any negative",
            ANY_NEGATIVE,
            &task,
            [11, 1, 1],
            rule,
            |out| {
                assert_eq!(u32s(&out[&1]), [1], "{rule}");
            },
        );
    }
    // None negative: nothing written, the word stays 0.
    let bytes: Vec<u8> = (0..700i32).flat_map(|v| v.to_le_bytes()).collect();
    let task = Task::default().input(0, bytes).output(1, 4);
    split_1_to_7(
        "none negative",
        ANY_NEGATIVE,
        &task,
        [11, 1, 1],
        MergeRule::Changes,
        |out| {
            assert_eq!(u32s(&out[&1]), [0]);
        },
    );
}

/// A flag beside an atomic count in one struct, summed: the count's word folds,
/// the flag's holds the value stored (1, not one for each shard that set it).
#[test]
fn a_flag_beside_an_atomic_count_in_one_struct_sums_only_the_count() {
    let source = r#"
struct Tally { found: u32, negatives: array<atomic<u32>> }
@group(0) @binding(0) var<storage, read> values: array<i32>;
@group(0) @binding(1) var<storage, read_write> tally: Tally;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&values) && values[gid.x] < 0) {
        tally.found = 1u;
        atomicAdd(&tally.negatives[0], 1u);
    }
}
"#;
    let mut values: Vec<i32> = (0..700).collect();
    for i in [3, 200, 333, 650, 699] {
        values[i] = -(i as i32);
    }
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let task = Task::default().input(0, bytes).output(1, 8);
    split_1_to_7(
        "tally",
        source,
        &task,
        [11, 1, 1],
        MergeRule::Sum(ElemType::U32),
        |out| assert_eq!(u32s(&out[&1]), [1, 5]),
    );
}

/// Counters in one struct, as tutorials keep statistics: summed, each folds; a
/// maximum among them cannot be merged by the same rule, and the refusal says to
/// give it a binding of its own.
#[test]
fn counters_in_one_struct_sum_and_a_maximum_among_them_is_refused_split() {
    let source = |max: &str| {
        format!(
            r#"
struct Stats {{ count: atomic<u32>, total: atomic<u32>, best: atomic<u32> }}
@group(0) @binding(0) var<storage, read> values: array<u32>;
@group(0) @binding(1) var<storage, read_write> stats: Stats;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    if (gid.x < arrayLength(&values) && values[gid.x] % 3u == 0u) {{
        atomicAdd(&stats.count, 1u);
        atomicAdd(&stats.total, values[gid.x]);
        {max}(&stats.best, values[gid.x]);
    }}
}}
"#
        )
    };
    let values: Vec<u32> = (0..700).map(|i| (i * 37) % 1000).collect();
    let picked: Vec<u32> = values.iter().copied().filter(|v| v % 3 == 0).collect();
    let (count, total) = (picked.len() as u32, picked.iter().sum::<u32>());
    let task = Task::default().input(0, u32_bytes(&values)).output(1, 12);
    let summed = source("atomicAdd");
    split_1_to_7(
        "stats",
        &summed,
        &task,
        [11, 1, 1],
        MergeRule::Sum(ElemType::U32),
        |out| assert_eq!(u32s(&out[&1]), [count, total, total]),
    );
    let e = task
        .job(
            &source("atomicMax"),
            [11, 1, 1],
            3,
            MergeRule::Sum(ElemType::U32),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("atomicMax") && e.contains("a binding of its own") && e.contains("--shards 1"),
        "{e}"
    );
}

#[test]
fn one_word_written_differently_by_shards_is_a_conflict_not_an_answer() {
    // Increasing values: each shard's maximum is its own last value.
    let values: Vec<u32> = (0..640).collect();
    let task = Task::default().input(0, u32_bytes(&values)).output(1, 8);
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        // Unsharded: never refused. Workgroups race on the word, so it holds the
        // maximum of one of them, whichever wrote last.
        let whole = executor
            .run(
                &task
                    .job(RUNNING_MAX, [10, 1, 1], 1, MergeRule::Changes)
                    .unwrap(),
                None,
            )
            .unwrap();
        let words = u32s(&whole.outputs[&1]);
        assert!(words[0] % 64 == 63 && words[0] <= 639, "{words:?}");
        assert_eq!(words[1], 0);
        for shards in 2..=7 {
            let job = task
                .job(RUNNING_MAX, [10, 1, 1], shards, MergeRule::Changes)
                .unwrap();
            let e = executor.run(&job, None).unwrap_err();
            let text = e.to_string();
            assert!(
                matches!(
                    e,
                    ExecError::Conflict {
                        binding: 1,
                        offset: 0,
                        ..
                    }
                ),
                "{shards} shards on {}: {text}",
                adapter.backend.name()
            );
            assert!(
                text.contains("conflict") && text.contains("--shards 1"),
                "{text}"
            );
            // Summed, the word is still a value each shard stored: a conflict, not
            // the sum of the shards' maxima.
            let job = task
                .job(
                    RUNNING_MAX,
                    [10, 1, 1],
                    shards,
                    MergeRule::Sum(ElemType::U32),
                )
                .unwrap();
            let e = executor.run(&job, None).unwrap_err();
            assert!(
                matches!(
                    e,
                    ExecError::StoredConflict {
                        binding: 1,
                        offset: 0,
                        ..
                    }
                ),
                "{shards} shards, summed: {e}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------
// Atomics: a counter and an append buffer.

#[test]
fn an_atomic_append_runs_whole_and_is_refused_when_split() {
    let n = 1000;
    let mut rng = Rng(7);
    let values: Vec<u32> = (0..n).map(|_| rng.below(1 << 16)).collect();
    let mut want: Vec<u32> = values.iter().copied().filter(|v| v % 7 == 3).collect();
    want.sort_unstable();
    let task = Task::default()
        .input(0, u32_bytes(&values))
        .output(1, 4 + 4 * n as u64);
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let out = executor
            .run(
                &task.job(APPEND, [16, 1, 1], 1, MergeRule::Changes).unwrap(),
                None,
            )
            .unwrap();
        let words = u32s(&out.outputs[&1]);
        let count = words[0] as usize;
        assert_eq!(count, want.len(), "on {}", adapter.backend.name());
        let mut got = words[1..=count].to_vec();
        got.sort_unstable(); // appended in whatever order the invocations ran
        assert_eq!(got, want);
    }
    // Split, under any merge: the shards would fill the same slots (a sum of them
    // is garbage; equal entries look like agreement to the word-by-word merge).
    for shards in 2..=7 {
        for rule in [MergeRule::Changes, MergeRule::Sum(ElemType::U32)] {
            let e = task.job(APPEND, [16, 1, 1], shards, rule).unwrap_err();
            let text = e.to_string();
            assert!(matches!(e, ExecError::Unsplittable(_)), "{text}");
            assert!(
                text.contains("binding 1")
                    && text.contains("slots an atomic hands out")
                    && text.contains("--shards 1"),
                "{text}"
            );
        }
    }
}

/// An append kernel with its counter at binding 1 (merged as a sum) and its entries
/// at binding 2, run over `values` in `groups` workgroups: whole, on every adapter,
/// the CPU's entries (those ≡ 3 mod 7, in some order); split into 2..=`shards`,
/// refused under any merge, before anything runs.
fn append_runs_whole_and_is_refused_split(kernel: &str, values: &[u32], groups: u32, shards: u32) {
    let mut want: Vec<u32> = values.iter().copied().filter(|v| v % 7 == 3).collect();
    want.sort_unstable();
    let task = Task::default()
        .input(0, u32_bytes(values))
        .output(1, 4)
        .output(2, 4 * values.len() as u64)
        .merge(1, MergeRule::Sum(ElemType::U32));
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let job = task
            .job(kernel, [groups, 1, 1], 1, MergeRule::Changes)
            .unwrap();
        let out = executor.run(&job, None).unwrap();
        let count = u32s(&out.outputs[&1])[0] as usize;
        let mut got = u32s(&out.outputs[&2])[..count].to_vec();
        got.sort_unstable();
        assert_eq!(got, want, "on {}", adapter.backend.name());
    }
    for shards in 2..=shards {
        for rule in [MergeRule::Changes, MergeRule::Sum(ElemType::U32)] {
            let e = task.job(kernel, [groups, 1, 1], shards, rule).unwrap_err();
            let text = e.to_string();
            assert!(matches!(e, ExecError::Unsplittable(_)), "{text}");
            assert!(
                text.contains("binding 2 (items)") && text.contains("slots an atomic"),
                "{text}"
            );
        }
    }
}

/// The append with its counter and entries apart: whole, the CPU's entries; split,
/// refused even with the counter merged as a sum (as the refusal of a lone counter
/// advises), before anything runs. Before, the entries merged word by word: where
/// every entry was the same value, 640 counted and 256 kept, and no error.
#[test]
fn an_append_apart_from_its_counter_is_refused_split_whatever_the_merges() {
    for values in [(0..640).collect::<Vec<u32>>(), vec![3; 640]] {
        append_runs_whole_and_is_refused_split(APPEND_APART, &values, 10, 5);
    }
}

/// The two-level append (a range reserved per workgroup on the global total, its
/// base passed on in workgroup memory): whole, the CPU's entries on every adapter;
/// split, refused under any merge, the total merged as a sum or not.
#[test]
fn an_append_by_workgroup_ranges_runs_whole_and_is_refused_split() {
    let values: Vec<u32> = (0..1000).map(|i| i * 5 + 3).collect();
    append_runs_whole_and_is_refused_split(APPEND_BY_WORKGROUP, &values, 16, 4);
}

/// The last workgroup to take a ticket sums every partial: whole, on every adapter,
/// the CPU's sum and a ticket per workgroup; split, refused under any merge of the
/// counter, before anything runs. Before, split in two with the counter merged as
/// a sum, `total` came back 0 (no shard's tickets reached the last), and no error.
#[test]
fn a_sum_finished_by_the_last_workgroup_runs_whole_and_is_refused_split() {
    let values: Vec<u32> = (0..1000).map(|i| i * 3 + 1).collect();
    let groups = 16u32;
    let task = Task::default()
        .input(0, u32_bytes(&values))
        .output(1, 4 * u64::from(groups))
        .output(2, 4)
        .output(3, 4);
    let want: u32 = values.iter().sum();
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let job = task
            .clone()
            .merge(2, MergeRule::Sum(ElemType::U32))
            .job(LAST_WORKGROUP_SUM, [groups, 1, 1], 1, MergeRule::Changes)
            .unwrap();
        let out = executor.run(&job, None).unwrap();
        let name = adapter.backend.name();
        assert_eq!(u32s(&out.outputs[&3]), [want], "on {name}");
        assert_eq!(u32s(&out.outputs[&2]), [groups], "on {name}");
    }
    for shards in 2..=4 {
        for done in [MergeRule::Changes, MergeRule::Sum(ElemType::U32)] {
            let e = task
                .clone()
                .merge(2, done)
                .job(
                    LAST_WORKGROUP_SUM,
                    [groups, 1, 1],
                    shards,
                    MergeRule::Changes,
                )
                .unwrap_err();
            let text = e.to_string();
            assert!(matches!(e, ExecError::Unsplittable(_)), "{text}");
            assert!(
                text.contains("binding 3 (total)")
                    && text.contains("what an atomic on a buffer answered")
                    && text.contains("--shards 1"),
                "{text}"
            );
        }
    }
}

/// A workgroup compacting into its own slots on its own counter (`var<workgroup>`)
/// is no append across the grid: split into any number of shards, on every adapter,
/// each workgroup keeps the CPU's entries of its own elements, in some order.
#[test]
fn a_compaction_within_each_workgroup_splits_and_matches_the_cpu() {
    let n = 1000;
    let mut rng = Rng(21);
    let values: Vec<u32> = (0..n).map(|_| rng.below(1 << 16)).collect();
    let groups = 16usize;
    let task = Task::default()
        .input(0, u32_bytes(&values))
        .output(1, (groups * 64 * 4) as u64)
        .output(2, (groups * 4) as u64);
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        for shards in 1..=5 {
            let job = task
                .job(
                    COMPACT_PER_WORKGROUP,
                    [groups as u32, 1, 1],
                    shards,
                    MergeRule::Changes,
                )
                .unwrap();
            let out = executor.run(&job, None).unwrap();
            let (kept, counts) = (u32s(&out.outputs[&1]), u32s(&out.outputs[&2]));
            for w in 0..groups {
                let own = &values[(w * 64).min(n)..((w + 1) * 64).min(n)];
                let mut want: Vec<u32> = own.iter().copied().filter(|v| v % 7 == 3).collect();
                let c = counts[w] as usize;
                let mut got = kept[w * 64..w * 64 + c].to_vec();
                want.sort_unstable();
                got.sort_unstable();
                assert_eq!(
                    got,
                    want,
                    "workgroup {w}, {shards} shards, on {}",
                    adapter.backend.name()
                );
            }
        }
    }
}

#[test]
fn an_atomic_counter_runs_whole_and_is_refused_split_under_changes() {
    let values: Vec<u32> = (0..900).collect();
    let task = Task::default().input(0, u32_bytes(&values)).output(1, 4);
    for shards in 2..=7 {
        assert!(matches!(
            task.job(COUNTER, [15, 1, 1], shards, MergeRule::Changes),
            Err(ExecError::Unsplittable(_))
        ));
    }
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let job = task
            .job(COUNTER, [15, 1, 1], 1, MergeRule::Changes)
            .unwrap();
        assert_eq!(u32s(&executor.run(&job, None).unwrap().outputs[&1]), [450]);
    }
}

/// Under sum-u32 the counter is a reduction: each shard counts from 0 and the
/// partial counts add up.
#[test]
fn an_atomic_counter_sums_under_sum_u32() {
    let values: Vec<u32> = (0..900).collect();
    let evens = values.iter().filter(|v| *v % 2 == 0).count() as u32;
    let task = Task::default().input(0, u32_bytes(&values)).output(1, 4);
    split_1_to_7(
        "counter",
        COUNTER,
        &task,
        [15, 1, 1],
        MergeRule::Sum(ElemType::U32),
        |out| {
            assert_eq!(u32s(&out[&1]), [evens]);
        },
    );
}

/// A range kept with atomicMax and atomicMin: merged with max and min, each
/// shard's extremes fold into the grid's; under a rule that does not fold what the
/// atomic computes, refused split before anything runs, naming the rule that
/// would. Before, `--merge 1=sum-i32` gave the sum of every shard's maximum, with
/// no error.
#[test]
fn a_range_kept_with_atomic_max_and_min_splits_only_under_max_and_min() {
    let mut rng = Rng(11);
    let values: Vec<i32> = (0..1000)
        .map(|_| rng.below(1 << 20) as i32 - (1 << 19))
        .collect();
    let (max, min) = (*values.iter().max().unwrap(), *values.iter().min().unwrap());
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let task = Task::default().input(0, bytes).output(1, 4).output(2, 4);
    let word = |out: &Outputs, b: u32| i32::from_le_bytes(out[&b][..4].try_into().unwrap());
    let fitting = task
        .clone()
        .merge(1, MergeRule::Max(ElemType::I32))
        .merge(2, MergeRule::Min(ElemType::I32));
    split_1_to_7(
        "range",
        RANGE,
        &fitting,
        [16, 1, 1],
        MergeRule::Changes,
        |out| {
            assert_eq!((word(out, 1), word(out, 2)), (max, min));
        },
    );
    for (rule, op, fix) in [
        (
            MergeRule::Sum(ElemType::I32),
            "atomicMax",
            "--merge 1=max-i32",
        ),
        (
            MergeRule::Min(ElemType::I32),
            "atomicMax",
            "--merge 1=max-i32",
        ),
        (
            MergeRule::Max(ElemType::I32),
            "atomicMin",
            "--merge 2=min-i32",
        ),
    ] {
        for shards in 2..=7 {
            let e = task.job(RANGE, [16, 1, 1], shards, rule).unwrap_err();
            let text = e.to_string();
            assert!(matches!(e, ExecError::Unsplittable(_)), "{text}");
            assert!(
                text.contains(op) && text.contains(&format!("merge {rule}")) && text.contains(fix),
                "{rule}: {text}"
            );
        }
        // Never refused whole: one partial, from the rule's identity.
        assert!(task.job(RANGE, [16, 1, 1], 1, rule).is_ok(), "{rule}");
    }
}

/// A bitset, a parity and the bits every value shares, kept with atomicOr,
/// atomicXor and atomicAnd: merged with or, xor and and, split 1..7 ways, the
/// CPU's. Under another rule, refused split, naming the one that folds it.
#[test]
fn bits_kept_with_atomic_or_xor_and_split_under_bitwise_merges() {
    let mut rng = Rng(12);
    // Every value has bit 0 and bit 5 set, so the shared bits are not all zero.
    let values: Vec<u32> = (0..1000).map(|_| rng.below(1 << 24) | 0x21).collect();
    let words = 8;
    let (seen, parity, shared) = bits_reference(&values, words);
    let task = Task::default()
        .input(0, u32_bytes(&values))
        .output(1, 4 * words as u64)
        .output(2, 4)
        .output(3, 4);
    let merged = task
        .clone()
        .merge(1, MergeRule::Or(ElemType::U32))
        .merge(2, MergeRule::Xor(ElemType::U32))
        .merge(3, MergeRule::And(ElemType::U32));
    split_1_to_7(
        "bits",
        BITS,
        &merged,
        [16, 1, 1],
        MergeRule::Changes,
        |out| {
            assert_eq!(u32s(&out[&1]), seen);
            assert_eq!(u32s(&out[&2]), [parity]);
            assert_eq!(u32s(&out[&3]), [shared]);
        },
    );
    let summed = merged.merge(1, MergeRule::Sum(ElemType::U32));
    let e = summed
        .job(BITS, [16, 1, 1], 3, MergeRule::Changes)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("atomicOr") && e.contains("--merge 1=or-u32"),
        "{e}"
    );
    // Bitwise merges take integers.
    let floats = Task::default()
        .input(0, f32_bytes(&[1.0; 64]))
        .output(1, 256)
        .merge(1, MergeRule::Or(ElemType::F32));
    let e = floats
        .job(
            "@group(0) @binding(0) var<storage, read> a: array<f32>;\n\
             @group(0) @binding(1) var<storage, read_write> b: array<f32>;\n\
             @compute @workgroup_size(64)\n\
             fn main(@builtin(global_invocation_id) g: vec3<u32>) { b[g.x] = a[g.x]; }\n",
            [1, 1, 1],
            1,
            MergeRule::Changes,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("or-f32") && e.contains("u32 or i32"), "{e}");
}

/// A float maximum kept by a compare-exchange loop (the WGSL idiom for float
/// atomics): merged with max-f32, split 1..7 ways, the CPU's maximum; merged with
/// sum-f32, refused split, naming max-f32. Before, the loop was taken to fold under
/// any rule, and sum-f32 added the shards' maxima.
#[test]
fn a_float_maximum_kept_by_a_compare_exchange_loop_splits_only_under_max() {
    let source = r#"
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> best: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= arrayLength(&values)) {
        return;
    }
    let v = values[gid.x];
    var old = atomicLoad(&best);
    loop {
        let r = atomicCompareExchangeWeak(&best, old, bitcast<u32>(max(bitcast<f32>(old), v)));
        if (r.exchanged) {
            break;
        }
        old = r.old_value;
    }
}
"#;
    let mut rng = Rng(14);
    let values: Vec<f32> = (0..1000).map(|_| rng.unit() * 100.0 - 50.0).collect();
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let task = Task::default().input(0, f32_bytes(&values)).output(1, 4);
    split_1_to_7(
        "float max",
        source,
        &task,
        [16, 1, 1],
        MergeRule::Max(ElemType::F32),
        |out| assert_eq!(f32s(&out[&1]), [max]),
    );
    let e = task
        .job(source, [16, 1, 1], 3, MergeRule::Sum(ElemType::F32))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("keeps the greatest") && e.contains("--merge 1=max-f32"),
        "{e}"
    );
}

/// f32 bit patterns in `atomic<u32>` added with atomicAdd (integer addition of
/// the bits, not a float sum): refused split under sum-f32, which would add the
/// partials as floats; the compare-exchange loop of the float-sum idiom splits
/// (linreg_grad in the sharding tests).
#[test]
fn float_bits_updated_with_integer_atomics_are_refused_split_as_floats() {
    let source = r#"
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> total: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&values)) {
        atomicAdd(&total, bitcast<u32>(values[gid.x]));
    }
}
"#;
    let task = Task::default()
        .input(0, f32_bytes(&[1.5; 640]))
        .output(1, 4);
    let e = task
        .job(source, [10, 1, 1], 3, MergeRule::Sum(ElemType::F32))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("atomicAdd") && e.contains("f32 bit patterns") && e.contains("--shards 1"),
        "{e}"
    );
}

#[test]
fn an_atomic_total_summed_beside_an_output_merged_by_changes() {
    let n = 1000u32;
    let mut rng = Rng(8);
    let values: Vec<u32> = (0..n).map(|_| rng.below(1 << 20)).collect();
    let odd = values.iter().filter(|v| *v % 2 == 1).count() as u32;
    let task = Task::default()
        .input(0, u32_bytes(&values))
        .output(1, u64::from(n) * 4)
        .output(2, 4);
    // By changes alone the total cannot be split, and the error says how to merge it.
    let e = task
        .job(DOUBLE_AND_COUNT, [16, 1, 1], 3, MergeRule::Changes)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("binding 2") && e.contains("--merge 2=sum"),
        "{e}"
    );
    let task = task.merge(2, MergeRule::Sum(ElemType::U32));
    split_1_to_7(
        "double and count",
        DOUBLE_AND_COUNT,
        &task,
        [16, 1, 1],
        MergeRule::Changes,
        |out| {
            assert_eq!(
                u32s(&out[&1]),
                values.iter().map(|v| v * 2).collect::<Vec<_>>()
            );
            assert_eq!(u32s(&out[&2]), [odd]);
        },
    );
}

#[test]
fn an_inout_buffer_under_a_reduction_runs_whole_and_is_refused_split() {
    let values: Vec<u32> = (0..900).collect();
    let task = Task::default()
        .input(0, u32_bytes(&values))
        .inout(1, u32_bytes(&[100]));
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let out = executor
            .run(
                &task
                    .job(COUNTER, [15, 1, 1], 1, MergeRule::Sum(ElemType::U32))
                    .unwrap(),
                None,
            )
            .unwrap();
        assert_eq!(u32s(&out.outputs[&1]), [550]);
    }
    let e = task
        .job(COUNTER, [15, 1, 1], 2, MergeRule::Sum(ElemType::U32))
        .unwrap_err();
    assert!(e.to_string().contains("in-out"), "{e}");
}

// ---------------------------------------------------------------------------------
// Random shapes: any grid, any workgroup size, any buffer length, any shard count.

/// How the random kernel uses its one writable buffer.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Writes a hash of each invocation's linear index where it is inside the buffer
    /// (`--output`, starting as zeros).
    Output,
    /// Mixes the buffer's old value into that hash, in place (`--inout`).
    InOut,
    /// Counts invocations into the buffer's words with atomicAdd, each invocation
    /// into the word its hash picks (`--output` merged with sum-u32).
    AtomicSum,
}

fn random_kernel(wg: [u32; 3], mode: Mode) -> String {
    let (decl, body) = match mode {
        Mode::Output => ("array<u32>", "if (i < n) { buf[i] = h; }"),
        Mode::InOut => (
            "array<u32>",
            "if (i < n) { buf[i] = buf[i] * 2654435761u + h; }",
        ),
        Mode::AtomicSum => ("array<atomic<u32>>", "atomicAdd(&buf[h % n], 1u);"),
    };
    format!(
        r#"
@group(0) @binding(0) var<storage, read_write> buf: {decl};

@compute @workgroup_size({}, {}, {})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {{
    let size = groups * vec3<u32>({}u, {}u, {}u);
    let i = (gid.z * size.y + gid.y) * size.x + gid.x;
    let n = arrayLength(&buf);
    var h = i ^ 0x9e3779b9u;
    h = (h ^ (h >> 16u)) * 0x45d9f3bu;
    h = h ^ (h >> 16u);
    {body}
}}
"#,
        wg[0], wg[1], wg[2], wg[0], wg[1], wg[2]
    )
}

fn hash(i: u32) -> u32 {
    let mut h = i ^ 0x9e37_79b9;
    h = (h ^ (h >> 16)).wrapping_mul(0x045d_9f3b);
    h ^ (h >> 16)
}

fn random_reference(len: usize, invocations: u64, mode: Mode, start: &[u32]) -> Vec<u32> {
    match mode {
        Mode::AtomicSum => {
            let mut bins = vec![0u32; len];
            for i in 0..invocations {
                bins[hash(i as u32) as usize % len] += 1;
            }
            bins
        }
        // Words past the last invocation keep their start (zeros for an output).
        Mode::Output | Mode::InOut => (0..len)
            .map(|i| match mode {
                _ if i as u64 >= invocations => start[i],
                Mode::InOut => start[i]
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(hash(i as u32)),
                _ => hash(i as u32),
            })
            .collect(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn any_shape_split_any_way_equals_the_unsharded_run(
        wg in (1u32..=64, 1u32..=8, 1u32..=4).prop_filter("at most 256 invocations", |(x, y, z)| x * y * z <= 256),
        grid in (1u32..40, 1u32..6, 1u32..4),
        fill in 0.1f64..1.3,
        shards in 1u32..8,
        mode in prop::sample::select(vec![Mode::Output, Mode::InOut, Mode::AtomicSum]),
        seed in any::<u64>(),
    ) {
        let wg = [wg.0, wg.1, wg.2];
        let grid = [grid.0, grid.1, grid.2];
        let invocations: u64 = grid.iter().zip(wg).map(|(&g, w)| u64::from(g * w)).product();
        // A length that is no multiple of anything in particular, sometimes past
        // the last invocation (words nobody writes), usually short of it.
        let len = ((invocations as f64 * fill) as usize).max(1) + (seed % 3) as usize;
        let axis = (0..3).rev().find(|&a| grid[a] > 1).unwrap_or(0);
        let shards = shards.min(grid[axis]);
        let source = random_kernel(wg, mode);
        let mut rng = Rng(seed);
        let (task, start, merge) = match mode {
            Mode::InOut => {
                let start: Vec<u32> = (0..len).map(|_| rng.below(u32::MAX)).collect();
                (Task::default().inout(0, u32_bytes(&start)), start, MergeRule::Changes)
            }
            Mode::Output => (Task::default().output(0, len as u64 * 4), vec![0; len], MergeRule::Changes),
            Mode::AtomicSum => (
                Task::default().output(0, len as u64 * 4),
                vec![0; len],
                MergeRule::Sum(ElemType::U32),
            ),
        };
        let want = random_reference(len, invocations, mode, &start);
        for adapter in common::adapters() {
            let mut executor = common::lock(adapter);
            for s in [1, shards] {
                let job = task.job(&source, grid, s, merge).unwrap();
                let out = executor.run(&job, None).unwrap();
                prop_assert_eq!(
                    u32s(&out.outputs[&0]), want.clone(),
                    "{:?} groups of {:?}, {} words, {} shards, {:?}, on {}",
                    grid, wg, len, s, mode, adapter.backend.name()
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// Loops with barriers in them, nested and stepped by shifts, the way sorting and
// scanning tutorials write them (and, with loops bounded, each counted turn by turn
// with the workgroup leaving together).

/// Sorts each run of 128 words in place, a workgroup of 64 per run: a bitonic
/// network in workgroup memory, the last run padded with the largest word.
const BITONIC_SORT: &str = r#"
@group(0) @binding(0) var<storage, read_write> data: array<u32>;
var<workgroup> tile: array<u32, 128>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let base = wid.x * 128u;
    let n = arrayLength(&data);
    for (var h = 0u; h < 2u; h++) {
        let i = lid + h * 64u;
        var v = 0xffffffffu;
        if (base + i < n) {
            v = data[base + i];
        }
        tile[i] = v;
    }
    workgroupBarrier();
    for (var k = 2u; k <= 128u; k = k << 1u) {
        for (var j = k >> 1u; j > 0u; j = j >> 1u) {
            let i = (lid / j) * 2u * j + lid % j;
            let l = i + j;
            let up = (i & k) == 0u;
            let a = tile[i];
            let b = tile[l];
            if ((a > b) == up) {
                tile[i] = b;
                tile[l] = a;
            }
            workgroupBarrier();
        }
    }
    for (var h = 0u; h < 2u; h++) {
        let i = lid + h * 64u;
        if (base + i < n) {
            data[base + i] = tile[i];
        }
    }
}
"#;

#[test]
fn a_bitonic_sort_of_each_workgroups_run_in_place() {
    let n = 128 * 9 + 77; // 10 workgroups, the last run padded
    let mut rng = Rng(11);
    let start: Vec<u32> = (0..n).map(|_| rng.below(5_000)).collect(); // with repeats
    let task = Task::default().inout(0, u32_bytes(&start));
    split_1_to_7(
        "bitonic sort",
        BITONIC_SORT,
        &task,
        [10, 1, 1],
        MergeRule::Changes,
        |out| {
            let want: Vec<u32> = start
                .chunks(128)
                .flat_map(|run| {
                    let mut run = run.to_vec();
                    run.sort_unstable();
                    run
                })
                .collect();
            assert_eq!(u32s(&out[&0]), want);
        },
    );
}

/// Inclusive prefix sums of each run of 64 words (Hillis and Steele: each step adds
/// the word `offset` back, read before a barrier and written after one).
const PREFIX_SUM: &str = r#"
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
var<workgroup> part: array<u32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let n = arrayLength(&src);
    var v = 0u;
    if (gid.x < n) {
        v = src[gid.x];
    }
    part[lid] = v;
    workgroupBarrier();
    for (var offset = 1u; offset < 64u; offset = offset * 2u) {
        var add = 0u;
        if (lid >= offset) {
            add = part[lid - offset];
        }
        workgroupBarrier();
        part[lid] = part[lid] + add;
        workgroupBarrier();
    }
    if (gid.x < n) {
        dst[gid.x] = part[lid];
    }
}
"#;

#[test]
fn inclusive_prefix_sums_of_each_workgroups_run() {
    let n = 64 * 12 + 5u32; // 13 workgroups, the last with 5 words
    let mut rng = Rng(12);
    let data: Vec<u32> = (0..n).map(|_| rng.below(u32::MAX)).collect(); // sums wrap
    let task = Task::default()
        .input(0, u32_bytes(&data))
        .output(1, u64::from(n) * 4);
    split_1_to_7(
        "prefix sum",
        PREFIX_SUM,
        &task,
        [13, 1, 1],
        MergeRule::Changes,
        |out| {
            let want: Vec<u32> = data
                .chunks(64)
                .flat_map(|run| {
                    run.iter()
                        .scan(0u32, |sum, v| {
                            *sum = sum.wrapping_add(*v);
                            Some(*sum)
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(u32s(&out[&1]), want);
        },
    );
}

/// A per-workgroup histogram and tallies in workgroup memory that the kernel never
/// clears: WGSL gives each workgroup zeros, and counting from there is how
/// histogram examples are written. Atomics in an array, in a struct beside a plain
/// word, in an array of arrays (named only in functions the entry point calls); a
/// plain array longer than the workgroup (1,500
/// elements over 48 invocations, the last round ragged) read where no invocation
/// wrote; builtins taken in a struct. A workgroup that saw the last one's leftovers
/// (as memory is reused between workgroups) would count them again.
const WORKGROUP_TALLIES: &str = r#"
struct Tally { even: atomic<u32>, odd: atomic<u32>, untouched: u32 }
struct In {
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
}
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> hist: array<atomic<u32>, 16>;
var<workgroup> tally: Tally;
var<workgroup> grid: array<array<atomic<i32>, 3>, 5>;
var<workgroup> seen: array<vec2<u32>, 1500>;

// `grid` is named only in these two.
fn count_in_grid(v: u32) {
    atomicAdd(&grid[v % 5u][v % 3u], 1);
}
fn grid_at(i: u32) -> u32 {
    return u32(atomicLoad(&grid[i / 3u][i % 3u]));
}

@compute @workgroup_size(8, 6)
fn main(input: In) {
    let v = src[input.wid.x * 48u + input.lid];
    atomicAdd(&hist[v % 16u], 1u);
    if (v % 2u == 0u) {
        atomicAdd(&tally.even, 1u);
    } else {
        atomicAdd(&tally.odd, 1u);
    }
    count_in_grid(v);
    seen[input.lid * 31u] += vec2<u32>(v, 1u);
    workgroupBarrier();
    if (input.lid == 0u) {
        let at = input.wid.x * 40u;
        for (var i = 0u; i < 16u; i++) {
            out[at + i] = atomicLoad(&hist[i]);
        }
        out[at + 16u] = atomicLoad(&tally.even);
        out[at + 17u] = atomicLoad(&tally.odd);
        out[at + 18u] = tally.untouched;
        for (var i = 0u; i < 15u; i++) {
            out[at + 19u + i] = grid_at(i);
        }
        out[at + 34u] = seen[1499].x;
        out[at + 35u] = seen[1499].y;
        out[at + 36u] = seen[47u * 31u].x;
        out[at + 37u] = seen[47u * 31u].y;
        out[at + 38u] = seen[1u].y;
        out[at + 39u] = seen[0].y;
    }
}
"#;

#[test]
fn workgroup_tallies_count_from_the_zeros_wgsl_promises() {
    let groups = 9u32;
    let mut rng = Rng(13);
    let data: Vec<u32> = (0..groups * 48).map(|_| rng.below(1_000)).collect();
    let task = Task::default()
        .input(0, u32_bytes(&data))
        .output(1, u64::from(groups) * 40 * 4);
    split_1_to_7(
        "workgroup tallies",
        WORKGROUP_TALLIES,
        &task,
        [groups, 1, 1],
        MergeRule::Changes,
        |out| {
            let want: Vec<u32> = data
                .chunks(48)
                .flat_map(|run| {
                    let mut w = vec![0u32; 40];
                    for &v in run {
                        w[(v % 16) as usize] += 1;
                        w[16 + (v % 2) as usize] += 1;
                        w[19 + (v % 5 * 3 + v % 3) as usize] += 1;
                    }
                    // w[18]: the untouched word; w[34], w[35]: never written.
                    w[36] = run[47];
                    w[37] = 1;
                    w[38] = 0;
                    w[39] = 1;
                    w
                })
                .collect();
            assert_eq!(u32s(&out[&1]), want);
        },
    );
}

/// The tiled matrix product of GPU tutorials: each workgroup stages a 16 × 16 tile
/// of each operand in workgroup memory (arrays of arrays), waits, multiplies, waits,
/// and moves to the next tile; the edges of both grids and of `k` are ragged and
/// padded with zeros by `select`.
const TILED_MATMUL: &str = r#"
struct Dims { m: u32, n: u32, k: u32, _pad: u32 }
@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

const TILE: u32 = 16u;
var<workgroup> tile_a: array<array<f32, 16>, 16>;
var<workgroup> tile_b: array<array<f32, 16>, 16>;

@compute @workgroup_size(16, 16)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let row = gid.y;
    let col = gid.x;
    var acc = 0.0;
    let tiles = (dims.k + TILE - 1u) / TILE;
    for (var t = 0u; t < tiles; t++) {
        let ak = t * TILE + lid.x;
        let bk = t * TILE + lid.y;
        tile_a[lid.y][lid.x] = select(0.0, a[row * dims.k + ak], row < dims.m && ak < dims.k);
        tile_b[lid.y][lid.x] = select(0.0, b[bk * dims.n + col], bk < dims.k && col < dims.n);
        workgroupBarrier();
        for (var i = 0u; i < TILE; i++) {
            acc = acc + tile_a[lid.y][i] * tile_b[i][lid.x];
        }
        workgroupBarrier();
    }
    if (row < dims.m && col < dims.n) {
        c[row * dims.n + col] = acc;
    }
}
"#;

#[test]
fn a_tiled_matrix_product_through_workgroup_memory() {
    // 133 × 50 by 50 × 37: 3 × 9 workgroups, ragged on every edge. Small whole
    // numbers, so every sum is exact in f32 whatever the order or fusing.
    let (m, n, k) = (133u32, 37u32, 50u32);
    let mut rng = Rng(14);
    let a: Vec<f32> = (0..m * k).map(|_| rng.below(8) as f32).collect();
    let b: Vec<f32> = (0..k * n).map(|_| rng.below(8) as f32).collect();
    let task = Task::default()
        .input(0, u32_bytes(&[m, n, k, 0]))
        .input(1, f32_bytes(&a))
        .input(2, f32_bytes(&b))
        .output(3, u64::from(m * n) * 4);
    split_1_to_7(
        "tiled matmul",
        TILED_MATMUL,
        &task,
        [n.div_ceil(16), m.div_ceil(16), 1],
        MergeRule::Changes,
        |out| {
            let mut want = vec![0f32; (m * n) as usize];
            for r in 0..m as usize {
                for c in 0..n as usize {
                    want[r * n as usize + c] = (0..k as usize)
                        .map(|i| a[r * k as usize + i] * b[i * n as usize + c])
                        .sum();
                }
            }
            assert_eq!(f32s(&out[&3]), want);
        },
    );
}

/// A workgroup sum sized by a pipeline-overridable constant with a default, as WGSL
/// tours write it: the workgroup's size, its array in workgroup memory and the
/// first step of the halving all `WG`.
const OVERRIDE_SIZED_SUM: &str = r#"
override WG: u32 = 64u;
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;
var<workgroup> part: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    var v = 0u;
    if (gid.x < arrayLength(&src)) {
        v = src[gid.x];
    }
    part[lid] = v;
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half = half >> 1u) {
        if (lid < half) {
            part[lid] += part[lid + half];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out[wid.x] = part[0];
    }
}
"#;

#[test]
fn a_workgroup_sum_sized_by_an_override_runs_at_its_default() {
    let n = 64 * 9 + 13u32; // 10 workgroups, the last with 13 words
    let mut rng = Rng(15);
    let data: Vec<u32> = (0..n).map(|_| rng.below(u32::MAX)).collect();
    let task = Task::default().input(0, u32_bytes(&data)).output(1, 10 * 4);
    split_1_to_7(
        "override-sized sum",
        OVERRIDE_SIZED_SUM,
        &task,
        [10, 1, 1],
        MergeRule::Changes,
        |out| {
            let want: Vec<u32> = data
                .chunks(64)
                .map(|run| run.iter().fold(0u32, |a, v| a.wrapping_add(*v)))
                .collect();
            assert_eq!(u32s(&out[&1]), want);
        },
    );
}

/// A float maximum or minimum kept the way WGSL tutorials write it: the loop
/// leaves once the stored value already wins (`if (bitcast<f32>(old) >= v) {
/// return; }`) and otherwise swaps in `v` itself; the same guarded by an `if`
/// around the swap, or chosen with `select`. The new value is not made from the old
/// one, so the operation is the guard's comparison. Each splits 1..7 ways under
/// its own rule to the CPU's answer and is refused under sum and the opposite
/// rule. Before, such a loop was taken to fold under any rule: sum-f32 added the
/// shards' maxima.
#[test]
fn a_float_maximum_kept_by_swapping_in_the_winner_splits_only_under_its_rule() {
    let helpers = r#"
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> best: atomic<u32>;

fn atomic_max_f32(v: f32) {
    var old = atomicLoad(&best);
    loop {
        if (bitcast<f32>(old) >= v) {
            return;
        }
        let r = atomicCompareExchangeWeak(&best, old, bitcast<u32>(v));
        if (r.exchanged) {
            return;
        }
        old = r.old_value;
    }
}


fn atomic_min_f32(v: f32) {
    var old = atomicLoad(&best);
    loop {
        if (v < bitcast<f32>(old)) {
            let r = atomicCompareExchangeWeak(&best, old, bitcast<u32>(v));
            if (r.exchanged) {
                break;
            }
            old = r.old_value;
        } else {
            break;
        }
    }
}

fn select_max_f32(v: f32) {
    var old = atomicLoad(&best);
    loop {
        let next = select(old, bitcast<u32>(v), v > bitcast<f32>(old));
        let r = atomicCompareExchangeWeak(&best, old, next);
        if (r.exchanged) {
            break;
        }
        old = r.old_value;
    }
}
"#;
    let kernel = |call: &str| {
        format!(
            "{helpers}
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    if (gid.x >= arrayLength(&values)) {{
        return;
    }}
    {call}(values[gid.x]);
}}
"
        )
    };
    let mut rng = Rng(15);
    let values: Vec<f32> = (0..1000).map(|_| rng.unit() * 100.0 - 50.0).collect();
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let min = values.iter().copied().fold(f32::INFINITY, f32::min);
    for (call, keeps, rule, other, answer) in [
        (
            "atomic_max_f32",
            "greatest",
            MergeRule::Max(ElemType::F32),
            MergeRule::Min(ElemType::F32),
            max,
        ),
        (
            "select_max_f32",
            "greatest",
            MergeRule::Max(ElemType::F32),
            MergeRule::Min(ElemType::F32),
            max,
        ),
        (
            "atomic_min_f32",
            "least",
            MergeRule::Min(ElemType::F32),
            MergeRule::Max(ElemType::F32),
            min,
        ),
    ] {
        let source = kernel(call);
        let task = Task::default().input(0, f32_bytes(&values)).output(1, 4);
        split_1_to_7(call, &source, &task, [16, 1, 1], rule, |out| {
            assert_eq!(f32s(&out[&1]), [answer], "{call}")
        });
        for wrong in [MergeRule::Sum(ElemType::F32), other] {
            let Err(e) = task.job(&source, [16, 1, 1], 3, wrong) else {
                panic!("{call} under {wrong}: taken split")
            };
            let e = e.to_string();
            assert!(
                e.contains(&format!("keeps the {keeps}"))
                    && e.contains(&format!("--merge 1={rule}")),
                "{call} under {wrong}: {e}"
            );
        }
    }
}

/// A float sum kept with a compare-exchange loop whose new value is made in a
/// variable: `var next = bitcast<f32>(old);`, then `update`.
fn sum_made_in_a_variable(update: &str) -> String {
    format!(
        "
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> total: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    if (gid.x >= arrayLength(&values)) {{
        return;
    }}
    var old = atomicLoad(&total);
    loop {{
        var next = bitcast<f32>(old);
        {update}
        let r = atomicCompareExchangeWeak(&total, old, bitcast<u32>(next));
        if (r.exchanged) {{
            break;
        }}
        old = r.old_value;
    }}
}}"
    )
}

/// A float sum whose new value is made in a variable, store after store (`var next
/// = bitcast<f32>(old); next += v;`): it splits under sum-f32, as the same made in
/// one expression does, and is refused under max-f32. Before, it was refused split
/// under every rule, the variable's stores not followed.
#[test]
fn a_float_sum_made_in_a_variable_splits_under_its_rule() {
    let source = &sum_made_in_a_variable("next += values[gid.x];");
    // Small whole numbers: every order of adding them gives the same f32.
    let values: Vec<f32> = (0..1000).map(|i| (i % 7) as f32).collect();
    let sum: f32 = values.iter().sum();
    let task = Task::default().input(0, f32_bytes(&values)).output(1, 4);
    let rule = MergeRule::Sum(ElemType::F32);
    split_1_to_7(
        "sum in a variable",
        source,
        &task,
        [16, 1, 1],
        rule,
        |out| assert_eq!(f32s(&out[&1]), [sum]),
    );
    let Err(e) = task.job(source, [16, 1, 1], 3, MergeRule::Max(ElemType::F32)) else {
        panic!("taken split under max-f32")
    };
    let e = e.to_string();
    assert!(
        e.contains("a compare-exchange loop that adds") && e.contains("--merge 1=sum-f32"),
        "{e}"
    );
}

/// A float sum whose new value is made in a variable only under a condition, where
/// the one operation is not seen: refused split under every rule with how to write
/// it, not folded by whichever rule was asked for (before, max-f32 would have kept
/// the greatest of the shards' sums).
#[test]
fn a_compare_exchange_whose_operation_is_not_seen_is_refused_split() {
    let source = &sum_made_in_a_variable("if (values[gid.x] != 0.0) { next += values[gid.x]; }");
    let values: Vec<f32> = (0..1000).map(|i| (i % 7) as f32).collect();
    let task = Task::default().input(0, f32_bytes(&values)).output(1, 4);
    for rule in [MergeRule::Sum(ElemType::F32), MergeRule::Max(ElemType::F32)] {
        let Err(e) = task.job(source, [16, 1, 1], 3, rule) else {
            panic!("taken split under {rule}")
        };
        let e = e.to_string();
        assert!(
            e.contains("not seen to be one operation on the old value")
                && e.contains("Write the exchange's new value"),
            "{e}"
        );
    }
    // Unsharded it runs, and sums.
    for adapter in common::adapters() {
        let job = task
            .job(source, [16, 1, 1], 1, MergeRule::Sum(ElemType::F32))
            .unwrap();
        let out = common::lock(adapter).run(&job, None).unwrap().outputs;
        assert_eq!(f32s(&out[&1]), [values.iter().sum::<f32>()]);
    }
}

/// The index of the least value, kept with a compare-exchange the way GPU argmin
/// tutorials write it: swap this invocation's index in while the value at the held
/// index is greater. Unsharded, the CPU's argmin; split under min-u32 or max-u32 it
/// is refused, since the shards' indices would be merged as numbers, not by the
/// values they point at, with the two runs that do split named; those two runs
/// split give the argmin. Before, such a loop was taken to set its word, and
/// max-u32 returned the greatest of the shards' argmins.
#[test]
fn an_argmin_kept_by_a_compare_exchange_runs_whole_and_is_refused_split() {
    let source = r#"
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> best: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= arrayLength(&values)) {
        return;
    }
    loop {
        let cur = atomicLoad(&best);
        if (values[cur] <= values[i]) {
            break;
        }
        let r = atomicCompareExchangeWeak(&best, cur, i);
        if (r.exchanged) {
            break;
        }
    }
}
"#;
    let mut rng = Rng(16);
    let values: Vec<f32> = (0..1000).map(|_| rng.unit() * 100.0).collect();
    let argmin = (0..values.len())
        .min_by(|&a, &b| values[a].total_cmp(&values[b]))
        .unwrap() as u32;
    let task = Task::default().input(0, f32_bytes(&values)).output(1, 4);
    for adapter in common::adapters() {
        let job = task.job(source, [16, 1, 1], 1, MergeRule::Changes).unwrap();
        let out = common::lock(adapter).run(&job, None).unwrap().outputs;
        assert_eq!(u32s(&out[&1]), [argmin]);
    }
    for rule in [MergeRule::Min(ElemType::U32), MergeRule::Max(ElemType::U32)] {
        let Err(e) = task.job(source, [16, 1, 1], 3, rule) else {
            panic!("taken split under {rule}")
        };
        let e = e.to_string();
        assert!(
            e.contains("holds an index kept with a compare-exchange by the value it points at")
                && e.contains("two runs that split")
                && e.contains("--shards 1"),
            "{e}"
        );
    }
    // The two runs the refusal names, each split: the least value (as a u32 that
    // orders floats as they order), then the least index holding it.
    let ordered = "
fn ordered(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}";
    let least = format!(
        "{ordered}
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> least: atomic<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    if (gid.x < arrayLength(&values)) {{
        atomicMin(&least, ordered(values[gid.x]));
    }}
}}"
    );
    let holding = format!(
        "{ordered}
@group(0) @binding(0) var<storage, read> values: array<f32>;
@group(0) @binding(1) var<storage, read_write> best: atomic<u32>;
@group(0) @binding(2) var<uniform> least: vec4<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {{
    let i = gid.x;
    if (i < arrayLength(&values) && ordered(values[i]) == least.x) {{
        atomicMin(&best, i);
    }}
}}"
    );
    let min_u32 = MergeRule::Min(ElemType::U32);
    let order = |v: f32| {
        let b = v.to_bits();
        if b & 0x8000_0000 != 0 {
            !b
        } else {
            b | 0x8000_0000
        }
    };
    let bits = order(values[argmin as usize]);
    split_1_to_7("least value", &least, &task, [16, 1, 1], min_u32, |out| {
        assert_eq!(u32s(&out[&1]), [bits]);
    });
    let second = task.clone().input(2, u32_bytes(&[bits, 0, 0, 0]));
    split_1_to_7(
        "least index",
        &holding,
        &second,
        [16, 1, 1],
        min_u32,
        |out| {
            assert_eq!(u32s(&out[&1]), [argmin]);
        },
    );
}
