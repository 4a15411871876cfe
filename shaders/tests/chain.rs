//! Jobs chained in one submission (an actor's batch of calls): each step sees what
//! the one before left in the carried buffer, each job's own output is its own, and
//! the end matches the CPU stepping one call at a time. Independent jobs batched in
//! one submission (tasks waiting on one GPU) each get what they get alone.

#![allow(clippy::unwrap_used)] // tests unwrap: a failure should stop the test

mod common;

use std::sync::Arc;

use gpumesh_protocol::{BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec};
use gpumesh_shaders::{BackendChoice, ExecError, Executor, ExecutorLimits, Job, Kernel};

/// The way a tutorial writes a stateful step: a uniform, a bounds check, an output
/// of what the first words were before the step.
const STEP: &str = r#"
struct Params { add: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read_write> before: array<u32, 4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= arrayLength(&state)) { return; }
    if (gid.x < 4u) { before[gid.x] = state[gid.x]; }
    state[gid.x] = state[gid.x] * 3u + params.add + gid.x;
}
"#;

/// The same step, with a loop in it (counted, turn by turn, where the adapter caps
/// loops).
const LOOPED: &str = r#"
struct Params { add: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read_write> before: array<u32, 4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= arrayLength(&state)) { return; }
    if (gid.x < 4u) { before[gid.x] = state[gid.x]; }
    var v = state[gid.x];
    for (var i = 0u; i < 1u; i++) { v = v * 3u; }
    state[gid.x] = v + params.add + gid.x;
}
"#;

/// [`LOOPED`] with its loop left at an exact count: open-ended as far as the
/// executor can see, so bounded where a bound applies.
const OPEN_LOOPED: &str = r#"
struct Params { add: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;
@group(0) @binding(2) var<storage, read_write> before: array<u32, 4>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x >= arrayLength(&state)) { return; }
    if (gid.x < 4u) { before[gid.x] = state[gid.x]; }
    var v = state[gid.x];
    var k = 0u;
    loop { v = v * 3u; k = k + 1u; if (k == 1u) { break; } }
    state[gid.x] = v + params.add + gid.x;
}
"#;

/// Words of state: not a whole number of workgroups, so the last one is ragged.
const WORDS: u32 = 1000;

fn bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect()
}

/// A step of `add` on `state` (`None`: zeros, never written), keeping the state on
/// the device.
fn step_job(source: &str, kernel: &Arc<Kernel>, state: Option<&[u8]>, add: u32) -> Job {
    loose_step(source, kernel, state, add)
        .keep_resident([0])
        .unwrap()
}

/// The same step, keeping nothing on the device (a one-shot task).
fn loose_step(source: &str, kernel: &Arc<Kernel>, state: Option<&[u8]>, add: u32) -> Job {
    let size = u64::from(WORDS) * 4;
    let spec = TaskSpec {
        shader: ShaderSource::Wgsl(source.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: match state {
                    Some(s) => BindingRole::InOut {
                        blob: BlobId::of(s),
                        size,
                    },
                    None => BindingRole::Output { size },
                },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Param {
                    data: bytes(&[add, 0, 0, 0]),
                },
            },
            BindingSpec {
                binding: 2,
                role: BindingRole::Output { size: 16 },
            },
        ],
        grid: Grid([WORDS.div_ceil(64), 1, 1]),
        shards: 1,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    };
    let blob: Option<Arc<[u8]>> = state.map(Arc::from);
    Job::new(spec, kernel.clone(), |id| {
        blob.clone().filter(|b| id.matches(b))
    })
    .unwrap()
}

#[test]
fn a_chain_of_steps_matches_the_cpu_and_each_step_keeps_its_own_output() {
    let kernel = Arc::new(Kernel::compile(STEP, "main").unwrap());
    let adds = [5u32, 1, 20, 3, 11, 7, 2, 9];
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let name = adapter.backend.name();
        for start in [None, Some((0..WORDS).map(|i| i * 7).collect::<Vec<u32>>())] {
            let start_bytes = start.as_deref().map(bytes);
            let jobs: Vec<Job> = adds
                .iter()
                .map(|add| step_job(STEP, &kernel, start_bytes.as_deref(), *add))
                .collect();
            let out = executor.run_chain(&jobs, &[0], None).unwrap();
            let mut cpu = start.clone().unwrap_or_else(|| vec![0; WORDS as usize]);
            for (k, add) in adds.iter().enumerate() {
                assert_eq!(
                    words(&out.outputs[k][&2]),
                    cpu[..4].to_vec(),
                    "{name}: step {k} saw the state the step before left"
                );
                assert!(
                    !out.outputs[k].contains_key(&0),
                    "the state is not an output"
                );
                for (i, w) in cpu.iter_mut().enumerate() {
                    *w = w.wrapping_mul(3).wrapping_add(*add).wrapping_add(i as u32);
                }
            }
            let end = &out.carried[&0];
            assert_eq!(words(end), cpu, "{name}: the chain's end is the CPU's");

            // The end stays on the device: the next step starts there, uploading
            // no state.
            let before = executor.counters();
            let next = step_job(STEP, &kernel, Some(end), 4);
            let shard = executor.run_shards(&next, &next.plan, None).unwrap();
            let uploaded = executor.counters().since(&before).bytes_to_device;
            assert!(
                uploaded < u64::from(WORDS) * 4,
                "{name}: {uploaded} bytes uploaded for a state kept on the device"
            );
            let merged = next.merge(&[&shard[0].changes]).unwrap();
            for (i, w) in cpu.iter_mut().enumerate() {
                *w = w.wrapping_mul(3).wrapping_add(4).wrapping_add(i as u32);
            }
            assert_eq!(words(&merged[&0]), cpu, "{name}: a step after the chain");
        }
    }
}

#[test]
fn a_chain_with_loops_runs_counted_and_one_past_its_bound_fails_the_chain() {
    let kernel = Arc::new(Kernel::compile(LOOPED, "main").unwrap());
    let plain = Arc::new(Kernel::compile(STEP, "main").unwrap());
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let name = adapter.backend.name();
        let jobs: Vec<Job> = [1u32, 2]
            .iter()
            .map(|add| step_job(LOOPED, &kernel, None, *add))
            .collect();
        let out = executor.run_chain(&jobs, &[0], None).unwrap();
        // From zeros, step 1 then step 2, as the CPU steps them.
        let cpu: Vec<u32> = (0..WORDS).map(|i| ((1 + i) * 3) + 2 + i).collect();
        assert_eq!(words(&out.carried[&0]), cpu, "{name}");
        drop(executor);

        // Under a bound of one turn every invocation's open-ended loop is stopped
        // at once.
        let open = Arc::new(Kernel::compile(OPEN_LOOPED, "main").unwrap());
        let jobs: Vec<Job> = [1u32, 2]
            .iter()
            .map(|add| step_job(OPEN_LOOPED, &open, None, *add))
            .collect();
        let limits = ExecutorLimits {
            loop_bound: Some(1),
            ..ExecutorLimits::default()
        };
        let mut bounded =
            Executor::with_limits(BackendChoice::Only(adapter.backend), limits).unwrap();
        let err = bounded.run_chain(&jobs, &[0], None).unwrap_err();
        assert!(
            matches!(err, ExecError::LoopBound { bound: 1 }),
            "{name}: {err}"
        );
        // And the executor goes on: a chain without loops runs, as the CPU steps it.
        let steps: Vec<Job> = [1u32, 2]
            .iter()
            .map(|add| step_job(STEP, &plain, None, *add))
            .collect();
        let out = bounded.run_chain(&steps, &[0], None).unwrap();
        assert_eq!(words(&out.carried[&0]), cpu, "{name}: after the refusal");
    }
}

#[test]
fn a_chain_refuses_a_carried_binding_some_job_does_not_write() {
    let kernel = Arc::new(Kernel::compile(STEP, "main").unwrap());
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let jobs = vec![step_job(STEP, &kernel, None, 1)];
        let err = executor.run_chain(&jobs, &[1], None).unwrap_err();
        assert!(err.to_string().contains("carried"), "{err}");
        // And goes on working.
        executor.run_chain(&jobs, &[0], None).unwrap();
    }
}

#[test]
fn a_batch_of_independent_tasks_gives_each_what_it_gets_alone() {
    let kernel = Arc::new(Kernel::compile(STEP, "main").unwrap());
    let looped = Arc::new(Kernel::compile(LOOPED, "main").unwrap());
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let name = adapter.backend.name();
        // In-place buffers from different starts (and one from zeros), different
        // uniforms: nothing of one may reach another.
        let starts: Vec<Option<Vec<u32>>> = (0..6u32)
            .map(|k| (k != 2).then(|| (0..WORDS).map(|i| i * (k + 1) + k).collect()))
            .collect();
        let start_bytes: Vec<Option<Vec<u8>>> =
            starts.iter().map(|s| s.as_deref().map(bytes)).collect();
        let jobs: Vec<Job> = start_bytes
            .iter()
            .enumerate()
            .map(|(k, s)| loose_step(STEP, &kernel, s.as_deref(), 10 + k as u32))
            .collect();
        let out = executor
            .run_batch(&jobs, None)
            .unwrap()
            .expect("loop-free one-shard jobs that keep nothing batch everywhere");
        assert_eq!(out.len(), jobs.len());
        for (k, (job, shard)) in jobs.iter().zip(&out).enumerate() {
            let start = starts[k].clone().unwrap_or_else(|| vec![0; WORDS as usize]);
            let cpu: Vec<u32> = start
                .iter()
                .enumerate()
                .map(|(i, w)| w.wrapping_mul(3).wrapping_add(10 + k as u32 + i as u32))
                .collect();
            let merged = job.merge(&[&shard.changes]).unwrap();
            assert_eq!(words(&merged[&0]), cpu, "{name}: task {k}'s state");
            assert_eq!(words(&merged[&2]), start[..4], "{name}: task {k}'s output");
            // And the same as the task run alone.
            let alone = executor.run_shards(job, &job.plan, None).unwrap();
            assert_eq!(alone[0].changes, shard.changes, "{name}: task {k}");
        }
        // What cannot share a submission is left to run alone: a job that keeps a
        // buffer on the device. A job with loops shares it, its turns counted.
        let kept = vec![
            loose_step(STEP, &kernel, None, 1),
            step_job(STEP, &kernel, None, 2),
        ];
        assert!(executor.run_batch(&kept, None).unwrap().is_none(), "{name}");
        let loops = vec![
            loose_step(LOOPED, &looped, None, 1),
            loose_step(STEP, &kernel, None, 2),
        ];
        let out = executor
            .run_batch(&loops, None)
            .unwrap()
            .expect("jobs with loops batch too");
        for (job, shard) in loops.iter().zip(&out) {
            let alone = executor.run_shards(job, &job.plan, None).unwrap();
            assert_eq!(alone[0].changes, shard.changes, "{name}: with loops");
        }
        // From zeros: v * 3 (once, in the loop) + add + i, and the step's the same.
        let merged = loops[0].merge(&[&out[0].changes]).unwrap();
        let cpu: Vec<u32> = (0..WORDS).map(|i| 1 + i).collect();
        assert_eq!(words(&merged[&0]), cpu, "{name}: the looped task's state");
    }
}
