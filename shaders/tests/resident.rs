//! A buffer kept on the device between jobs (an actor's state): the next job that
//! starts an in-out binding from its contents uploads nothing and computes on it.

mod common;

use std::sync::Arc;

use gpumesh_protocol::{BindingRole, BindingSpec, BlobId, Grid, MergeRule, ShaderSource, TaskSpec};
use gpumesh_shaders::{Job, Kernel};

const STEP: &str = r#"
struct Params { add: u32, _a: u32, _b: u32, _c: u32 }
@group(0) @binding(0) var<storage, read_write> state: array<u32>;
@group(0) @binding(1) var<uniform> params: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&state)) {
        state[gid.x] = state[gid.x] * 3u + params.add + gid.x;
    }
}
"#;

/// Words of state: more than the parameters and shard info a job uploads besides.
const WORDS: usize = 1 << 14;

/// The CPU's answer to one step.
fn step(state: &[u32], add: u32) -> Vec<u32> {
    state
        .iter()
        .enumerate()
        .map(|(i, v)| v.wrapping_mul(3).wrapping_add(add).wrapping_add(i as u32))
        .collect()
}

fn bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn step_job(kernel: &Arc<Kernel>, state: &[u8], add: u32) -> Job {
    let spec = TaskSpec {
        shader: ShaderSource::Wgsl(STEP.into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::InOut {
                    blob: BlobId::of(state),
                    size: state.len() as u64,
                },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Param {
                    data: bytes(&[add, 0, 0, 0]),
                },
            },
        ],
        grid: Grid([(WORDS / 64) as u32, 1, 1]),
        shards: 1,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    };
    let blob: Arc<[u8]> = Arc::from(state);
    Job::new(spec, kernel.clone(), |id| {
        id.matches(&blob).then(|| blob.clone())
    })
    .expect("a job of the step kernel")
    .keep_resident([0])
    .expect("the state binding is in-out")
}

#[test]
fn state_kept_on_the_device_is_not_uploaded_again_and_steps_match_the_cpu() {
    let kernel = Arc::new(Kernel::compile(STEP, "main").unwrap());
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let name = adapter.backend.name();
        let mut cpu: Vec<u32> = (0..WORDS as u32).map(|i| i * 7).collect();
        let state_bytes = (WORDS * 4) as u64;
        let resident_before = executor.resident_bytes();
        for (round, add) in [5u32, 11, 2].into_iter().enumerate() {
            let before = executor.counters();
            let job = step_job(&kernel, &bytes(&cpu), add);
            let out = executor.run(&job, None).unwrap();
            let sent = executor.counters().since(&before).bytes_to_device;
            cpu = step(&cpu, add);
            assert_eq!(out.outputs[&0], bytes(&cpu), "round {round} on {name}");
            if round == 0 {
                assert!(
                    sent >= state_bytes,
                    "the first state is uploaded ({sent} B)"
                );
            } else {
                assert!(
                    sent < state_bytes,
                    "round {round} on {name}: {sent} bytes sent, the state ({state_bytes} B) \
                     was on the device already"
                );
            }
        }
        // One version of the state stays on the device, not one per call.
        let held = executor.resident_bytes() - resident_before;
        assert!(
            held >= state_bytes && held < 2 * state_bytes,
            "{name}: {held} bytes resident after three calls on {state_bytes} bytes of state"
        );
        // Forgotten (the actor deleted or moved): its buffer is freed.
        executor.forget(&[BlobId::of(&bytes(&cpu))]);
        assert!(
            executor.resident_bytes() - resident_before < state_bytes,
            "{name}: the state is still resident after it was forgotten"
        );
    }
}

#[test]
fn only_an_output_or_in_out_buffer_is_kept() {
    let kernel = Arc::new(Kernel::compile(STEP, "main").unwrap());
    let state = bytes(&vec![0u32; WORDS]);
    let job = step_job(&kernel, &state, 1);
    let err = job.clone().keep_resident([1]).unwrap_err().to_string();
    assert!(err.contains("output or in-out"), "{err}");
}

/// The buffers results are read back through are reused: a run like one before
/// makes none (on NVIDIA's Vulkan driver a new one cost milliseconds).
#[test]
fn a_run_like_one_before_reuses_its_readback_buffers() {
    let kernel = Arc::new(Kernel::compile(STEP, "main").unwrap());
    for adapter in common::adapters() {
        let mut executor = common::lock(adapter);
        let name = adapter.backend.name();
        let mut state: Vec<u32> = (0..WORDS as u32).collect();
        for (k, add) in [3u32, 9, 27].into_iter().enumerate() {
            let before = executor.counters();
            let job = step_job(&kernel, &bytes(&state), add);
            let out = executor.run(&job, None).unwrap();
            state = step(&state, add);
            assert_eq!(out.outputs[&0], bytes(&state), "{name}: run {k}");
            let made = executor.counters().since(&before).readback_buffers_made;
            if k > 0 {
                assert_eq!(made, 0, "{name}: run {k} made {made} readback buffers");
            }
        }
    }
}
